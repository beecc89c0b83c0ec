/*
 * cuda.h - the CUDA backend's state, shared by engine/cuda's .cu files only (each op in its own file,
 * STYLE.md). The CUDA backend fills the same op table as the CPU backend (backend.h) with bf16
 * weights uploaded once, float32 activations in device memory (the op table's contract),
 * fp32 accumulation, cuBLAS for every GEMM (activations converted to bf16 in a scratch first),
 * own kernels for the rest. The KV pool's K, V and positions are in CUDA managed memory
 * (kr_ctx_kv_pool_create), so the host code that edits lists (policies' kr_seq_keep, sequence
 * import/export, re-rotation) keeps working unchanged; kernels read them through block tables
 * uploaded per call. Built only when CMake finds nvcc (KR_HAVE_CUDA); compiled for sm_90.
 */
#ifndef KR_CUDA_H
#define KR_CUDA_H

#ifdef __cplusplus
extern "C" {
#endif
#include "backend.h"
#include "kr-util.h"
#ifdef __cplusplus
}
#endif

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

/* One weight matrix or vector uploaded to the device: found by the host tensor's data pointer. */
typedef struct kr_cuda_weight {
    const void *host; /* kr_tensor.data of the model */
    __nv_bfloat16 *dev_bf16; /* matrices: [rows][cols] bf16 */
    float *dev_f32; /* norm weights and biases: f32 (exact) */
    int64_t rows, cols;
} kr_cuda_weight;

struct kr_backend {
    const kr_model *model;
    int device;
    int max_chunk;
    cudaStream_t stream;
    cublasHandle_t cublas;
    kr_cuda_weight *weights; /* sorted by `host` for bsearch */
    int n_weights;
    /* scratch, sized at create for max_chunk rows: bf16 copy of a GEMM's input activations */
    __nv_bfloat16 *xb;
    size_t xb_elems;
    /* Tables uploaded per op (block ids and list lengths, token ids, cos/sin rows, KV slots):
     * pinned host staging and its device twin, handed out in slices in call order. A slice is
     * reused only after a stream sync, so an upload never waits for the kernels before it. */
    int32_t *dev_tables;
    size_t dev_tables_cap; /* int32 elements */
    int32_t *host_tables;
    size_t tables_used; /* int32 elements handed out since the last sync */
    int32_t *host_slice, *dev_slice; /* the slice the last kr_cuda_tables_reserve handed out */
    /* scratch for attention partial results (split along the sequence) and scores */
    float *dev_scratch;
    size_t dev_scratch_floats;
    float *host_scores; /* pinned, for `score` results */
    size_t host_scores_floats;
};

/* The device copy of a model tensor (bf16 matrix or f32 vector); aborts if it was not uploaded
 * (a programming error: every model tensor is uploaded at create). */
const kr_cuda_weight *kr_cuda_weight_of(const kr_backend *b, const kr_tensor *t);
/* Points b->host_slice/dev_slice at the next n int32 of the tables; when they do not fit, waits
 * for the stream and starts over (growing the buffers if n alone does not fit). */
int kr_cuda_tables_reserve(kr_backend *b, size_t n);
/* Aborts with file:line and the CUDA / cuBLAS error string: failures inside ops are programming
 * or device errors (ops have no error return); argument and memory errors are caught at create. */
#define KR_CUDA_CHECK(x) kr_cuda_check((x), #x, __FILE__, __LINE__)
#define KR_CUBLAS_CHECK(x) kr_cublas_check((x), #x, __FILE__, __LINE__)
void kr_cuda_check(cudaError_t e, const char *what, const char *file, int line);
void kr_cublas_check(cublasStatus_t s, const char *what, const char *file, int line);

/* ops, one file each (backend.h gives their contracts) */
void kr_cuda_embed(kr_backend *b, const kr_tensor *emb, const int32_t *tokens, int n, float *x);
void kr_cuda_rmsnorm(kr_backend *b, const float *x, const kr_tensor *w, int n, int d, float eps, float *y);
void kr_cuda_matmul(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                    int accumulate, float *y);
/* matmul with row i of y depending on row i of x only, bit for bit (backend.h's matmul_rows) */
void kr_cuda_matmul_rows(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                         int accumulate, float *y);
void kr_cuda_swiglu(kr_backend *b, float *g, const float *u, size_t count);
void kr_cuda_rope(kr_backend *b, float *x, int n, int n_heads, int head_dim, const float *cos_sin);
void kr_cuda_kv_store(kr_backend *b, kr_seq *s, int layer, const float *k, const float *v, int n,
                      const int32_t *pos);
void kr_cuda_attention(kr_backend *b, const kr_seq *s, int layer, const float *q, int n, int n_heads,
                       const int32_t *pos, int window, float *out);
void kr_cuda_attention_batch(kr_backend *b, const kr_seq *const *seqs, int layer, const float *q, int n,
                             int n_heads, const int32_t *pos, int window, float *out);
void kr_cuda_score(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs, int n_heads,
                   int per_head, float *scores, size_t stride);
void kr_cuda_score_past(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                        int n_heads, int per_head, int n_hidden, float *scores, size_t stride);

/* Max and sum over the 32 lanes of a warp (every lane gets the result); for the kernels. */
__device__ __forceinline__ float warp_max(float x)
{
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ float warp_sum(float x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

#endif /* KR_CUDA_H */
