/*
 * cpu.h - the CPU backend's state and kernels, shared by the CPU backend sources only. The CPU backend
 * is the reference: float32 compute from weights upcast exactly, a thread pool over output
 * rows, OpenBLAS sgemm (single-threaded per worker) for multi-token matmuls, hand-vectorised
 * dot products for decode.
 */
#ifndef KR_CPU_H
#define KR_CPU_H

#include "backend.h"
#include "kr-threadpool.h"

/* These sources are compiled once per instruction set (CMakeLists.txt: KR_CPU_ISA avx512bf16,
 * avx512, avx2 or base, KR_CPU_LEVEL 3, 2, 1 or 0), and engine/cpu-dispatch.c picks one variant at load time by
 * cpuid. Each variant names what it exports with its suffix: kr_cpu_matmul_avx2, the op table
 * kr_cpu_backend_avx2, ... */
#ifndef KR_CPU_ISA
#error "cpu.h is for the engine/cpu sources, which CMakeLists.txt builds once per instruction set"
#endif
#define KR_CPU_CAT2(a, b) a##_##b
#define KR_CPU_CAT(a, b) KR_CPU_CAT2(a, b)
#define KR_CPU_SYM(name) KR_CPU_CAT(name, KR_CPU_ISA)
#define kr_cpu_matmul KR_CPU_SYM(kr_cpu_matmul)
#define kr_cpu_matmul_rows KR_CPU_SYM(kr_cpu_matmul_rows)
#define kr_cpu_attention KR_CPU_SYM(kr_cpu_attention)
#define kr_cpu_attention_batch KR_CPU_SYM(kr_cpu_attention_batch)
#define kr_cpu_score KR_CPU_SYM(kr_cpu_score)
#define kr_cpu_score_past KR_CPU_SYM(kr_cpu_score_past)
#define kr_cpu_attention_scratch KR_CPU_SYM(kr_cpu_attention_scratch)
#define kr_cpu_to_f32 KR_CPU_SYM(kr_cpu_to_f32)
#define kr_cpu_from_f32 KR_CPU_SYM(kr_cpu_from_f32)

/* Matmuls of fewer tokens take the dot-product path, more take sgemm. */
enum { GEMM_MIN_TOKENS = 6 };

struct kr_backend {
    const kr_model *model;
    kr_threadpool *tp;
    int max_chunk;
    size_t slab_floats; /* per-thread scratch for upcast weight slabs */
    float **slab; /* [n_threads][slab_floats] */
    size_t att_floats; /* per-thread attention scratch */
    float **att; /* [n_threads][att_floats] */
    /* [max(max_chunk, GEMM_MIN_TOKENS)][widest input + 16] tokens reordered for the even/odd
     * dot products of bf16 weights (a decode batch of up to max_chunk rows takes that path too),
     * 64-byte aligned */
    float *xperm;
    /* [xbf16_rows][widest input + 32] tokens rounded to bf16 for the AVX-512-BF16 variant's
     * matmuls of bf16 weights (matmul.c), xbf16_rows = max(max_chunk, GEMM_MIN_TOKENS), 64-byte
     * aligned */
    uint16_t *xbf16;
    int xbf16_rows;
};

void kr_cpu_matmul(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                   int accumulate, float *y);
void kr_cpu_matmul_rows(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                        int accumulate, float *y);
void kr_cpu_attention(kr_backend *b, const kr_seq *s, int layer, const float *q, int n,
                      int n_heads, const int32_t *pos, int window, float *out);
void kr_cpu_attention_batch(kr_backend *b, const kr_seq *const *seqs, int layer, const float *q, int n,
                            int n_heads, const int32_t *pos, int window, float *out);
void kr_cpu_score(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                  int n_heads, int per_head, float *scores, size_t stride);
void kr_cpu_score_past(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                       int n_heads, int per_head, int n_hidden, float *scores, size_t stride);
/* Rows of attention scratch each thread needs for a model: see attention.c. */
size_t kr_cpu_attention_scratch(const kr_config *cfg);
/* kr_dtype_to_f32 and kr_dtype_from_f32 at this variant's vector width (convert.c): the
 * variant's own kernels call these directly. */
void kr_cpu_to_f32(kr_dtype t, const void *src, size_t n, float *dst);
void kr_cpu_from_f32(kr_dtype t, const float *src, size_t n, void *dst);

#endif
