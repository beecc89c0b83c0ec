/*
 * backend.h - the op table every compute backend fills once with designated initializers
 * (engine/cpu/backend.c; engine/cuda/ later). forward.c drives a model through these ops only,
 * so it never includes a backend's headers. Activations are float32 buffers the backend
 * allocates (`act_alloc`): host memory on CPU, device memory on a GPU; the core only hands
 * them back to ops and copies results out with `to_host`.
 *
 * Shapes: `n` tokens per call; x[n][d]; linear weights [out][in] (kr_tensor, dtype as loaded).
 * A call's rows belong to one sequence (prefill chunks, single decode) or, in a decode batch, row
 * i to sequence i: the element-wise and weight ops do not care, the cache ops say which they take.
 * Every slot is required except kv_alloc, kv_free and sync. The cache ops read and write a
 * sequence's block lists directly, so the table comes with the KV internals (kr-kv.h) and the
 * weights' layout (kr-model.h).
 */
#ifndef KR_BACKEND_H
#define KR_BACKEND_H

#include "kr-kv.h"
#include "kr-model.h"

typedef struct kr_backend kr_backend;

typedef struct kr_backend_ops {
    const char *name;
    int (*create)(const kr_model *m, int n_threads, int max_chunk, kr_backend **out, char *err);
    void (*destroy)(kr_backend *b);
    int (*n_threads)(const kr_backend *b);
    float *(*act_alloc)(kr_backend *b, size_t n_floats); /* NULL when out of memory */
    void (*act_free)(kr_backend *b, float *p);
    void (*to_host)(kr_backend *b, const float *src, size_t n_floats, float *dst);
    /* Optional (NULL: malloc/free): memory for the KV pool's keys, values and positions, which
     * both the host (kv.c, policies, sequence import/export) and the ops address. kv_free takes
     * no backend: a pool may outlive the context that made it. */
    void *(*kv_alloc)(kr_backend *b, size_t bytes); /* NULL when out of memory */
    void (*kv_free)(void *p);
    /* Optional (NULL: ops finish before they return): waits until every op issued so far is
     * done. forward.c calls it before host code reads or edits pool memory (a policy's rule)
     * and before kr_forward returns. */
    void (*sync)(kr_backend *b);

    /* x[i] = emb[tokens[i]] upcast to f32 */
    void (*embed)(kr_backend *b, const kr_tensor *emb, const int32_t *tokens, int n, float *x);
    /* y[i] = x[i] / rms(x[i]) * w  (rms over d, eps inside the root), y may equal x */
    void (*rmsnorm)(kr_backend *b, const float *x, const kr_tensor *w, int n, int d, float eps,
                    float *y);
    /* y[n][out] (+)= x[n][in] . w^T (+ bias); accumulate: add into y instead of overwriting */
    void (*matmul)(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                   int accumulate, float *y);
    /* As matmul, with every row computed exactly as a one-row matmul computes it: row i of y is
     * bit-identical whatever n is and whatever the other rows hold. Decode batches use it (each
     * sequence's logits must equal decoding it alone); it may be slower than matmul for many
     * rows (the CPU takes dot products where matmul would switch to sgemm). */
    void (*matmul_rows)(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x,
                        int n, int accumulate, float *y);
    /* g[i] = silu(g[i]) * u[i] over n*f elements */
    void (*swiglu)(kr_backend *b, float *g, const float *u, size_t count);
    /* Rotates x[n][n_heads][head_dim] in place (HF rotate-half): cos_sin[n][head_dim/2][2]. */
    void (*rope)(kr_backend *b, float *x, int n, int n_heads, int head_dim, const float *cos_sin);
    /* Stores k, v [n][n_kv_heads][head_dim] of layer `layer` as entries len-n .. len-1 of each
     * (layer, KV head) of s (room made by kr_seq_grow, lengths already set), positions pos[n],
     * rounded to the pool's dtype. */
    void (*kv_store)(kr_backend *b, kr_seq *s, int layer, const float *k, const float *v, int n,
                     const int32_t *pos);
    /* out[n][n_heads][head_dim] = causal attention of q[n][n_heads][head_dim] over the cached
     * entries of each (layer, KV head): token i (at position pos[i]) sees the first
     * len - n + i + 1 entries, minus those at positions <= pos[i] - window when window > 0. */
    void (*attention)(kr_backend *b, const kr_seq *s, int layer, const float *q, int n, int n_heads,
                      const int32_t *pos, int window, float *out);
    /* Batched decode: row i of q[n][n_heads][head_dim] is one token of seqs[i] (distinct
     * sequences), at position pos[i], whose entry is already the newest of each of its lists;
     * it attends every entry of each (layer, KV head) list of seqs[i], minus those at positions
     * <= pos[i] - window when window > 0. Row i of out is bit-identical to what `attention`
     * writes for a one-token call on seqs[i] alone. */
    void (*attention_batch)(kr_backend *b, const kr_seq *const *seqs, int layer, const float *q,
                            int n, int n_heads, const int32_t *pos, int window, float *out);
    /* The scoring primitive's attention (DESIGN.md section 1): observer rows
     * q_obs[n_obs][n_heads][head_dim] (post-RoPE) are the newest n_obs entries of every list of
     * the layer, so observer i sees the first len - n_obs + i + 1 entries of its list. Writes,
     * in host memory, softmax(q k^T / sqrt(d)) summed over the observers: per_head = 0 averaged
     * over the query heads of each GQA group, scores[kv_head * stride + j]; per_head = 1 per
     * query head, scores[head * stride + j]. Entries an observer does not see add 0. */
    void (*score)(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                  int n_heads, int per_head, float *scores, size_t stride);
    /* As `score`, for observers that come after every entry they score (TAKE's accumulated
     * probe, appended to a chunk): every observer sees the first len - n_hidden entries of its
     * list, and the newest n_hidden (the appended probe rows' own keys, which TAKE's eq. 10 leaves
     * out of the softmax) add 0. n_hidden = 0: every observer sees the whole list. */
    void (*score_past)(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                       int n_heads, int per_head, int n_hidden, float *scores, size_t stride);
    /* The KV pool dtypes the cache ops read and write, bit 1 << kr_dtype for each (f32 is always
     * one: 0 means f32 only). kr_ctx_create refuses a KV dtype the backend does not store and
     * kr_forward a sequence in a pool of one. */
    unsigned kv_dtypes;
    /* matmul (and matmul_rows) round x to bf16 before multiplying when the weights are bf16 and
     * n is at least this (0: never; x stays f32): every matmul of bf16 weights on the CPU's
     * AVX-512-BF16 variant (1: decode too, so that a batch equals its one-token calls), the
     * multi-token ones of CUDA, whose weights are bf16 on the device whatever the checkpoint's
     * dtype. Sums are f32 either way. Tests widen their references' x the same way. */
    int bf16_x_min_tokens;
} kr_backend_ops;

/* The CPU backend: the variant for the best instruction set this CPU has, chosen by cpuid when
 * the program loads (engine/cpu-dispatch.c; kr_cpu_isa names it), or the one KR_CPU_ISA names. */
extern kr_backend_ops kr_cpu_backend;
/* Each variant of it, whatever the CPU: a test runs those the CPU supports side by side. */
extern const kr_backend_ops kr_cpu_backend_avx512bf16, kr_cpu_backend_avx512, kr_cpu_backend_avx2,
    kr_cpu_backend_base;
/* The variant named avx512bf16, avx512, avx2 or base (NULL for another name), and whether this CPU (and its
 * OS) runs it. */
const kr_backend_ops *kr_cpu_backend_variant(const char *name);
int kr_cpu_isa_supported(const char *name);
#ifdef KR_HAVE_CUDA
extern const kr_backend_ops kr_cuda_backend; /* engine/cuda/backend.cu */
#endif

#endif
