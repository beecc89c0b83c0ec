/*
 * kr-impl.h - engine internals shared between the engine sources. Not installed, not included
 * outside engine/. The public contract is kr.h.
 */
#ifndef KR_IMPL_H
#define KR_IMPL_H

#include "kr.h"

#include <stdarg.h>
#include <stdio.h>

#ifdef __cplusplus /* the CUDA sources include this through backend.h */
extern "C" {
#endif

/* printf-style error message into err (KR_ERR_MAX bytes; err may be NULL). Returns -1 so that
 * callers can write `return kr_errf(err, ...)`. */
int kr_errf(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Reads a whole file into a malloc'd, NUL-terminated buffer. */
int kr_read_file(const char *path, char **data_out, size_t *len_out, char *err);

/* bf16 / f16 <-> f32, exact for the upcast. */
static inline float kr_bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t kr_f32_to_bf16(float f) /* round to nearest even */
{
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
float kr_f16_to_f32(uint16_t h);
uint16_t kr_f32_to_f16(float f);

/* A weight as held in memory: row-major [rows][cols] (1-D tensors: rows == 1). `data` points
 * into a mapping or into an allocation owned by the model. */
typedef struct kr_tensor {
    const void *data;
    kr_dtype dtype;
    int64_t rows;
    int64_t cols;
} kr_tensor;

/* One transformer layer. Linear weights are [out_features][in_features] as HF stores them.
 * Norm weights and biases are always f32 (converted at load). */
typedef struct kr_layer_weights {
    kr_tensor attn_norm; /* [1][d] f32 */
    kr_tensor wq; /* [n_heads*head_dim][d] */
    kr_tensor wk; /* [n_kv_heads*head_dim][d] */
    kr_tensor wv; /* [n_kv_heads*head_dim][d] */
    kr_tensor wo; /* [d][n_heads*head_dim] */
    kr_tensor bq, bk, bv; /* [1][out] f32 when cfg.attn_bias, else data == NULL */
    kr_tensor ffn_norm; /* [1][d] f32 */
    kr_tensor w_gate; /* [f][d] */
    kr_tensor w_up; /* [f][d] */
    kr_tensor w_down; /* [d][f] */
} kr_layer_weights;

struct kr_model {
    kr_config cfg;
    kr_tensor embed; /* [vocab][d] */
    kr_tensor final_norm; /* [1][d] f32 */
    kr_tensor lm_head; /* [vocab][d]; == embed when tied */
    kr_layer_weights *layers; /* [n_layers] */
    kr_dtype weight_dtype; /* dtype of the big matrices in memory */
    size_t weight_bytes;
    char fingerprint[17];
    /* ownership: mappings and allocations released by kr_model_free */
    struct kr_mapping *maps;
    int n_maps;
    void **owned;
    int n_owned;
    int cap_owned;
};

/* Validates a config's sizes and ratios (config.c); `path` names the source in messages. Used by
 * kr_config_parse and by kr_model_random for configs built in code. */
int kr_config_check(const kr_config *cfg, const char *path, char *err);

/* ---- thread pool: fn runs on every thread (the caller is thread 0) and run returns when all
 * are done. Workers spin briefly between jobs, then sleep. */
typedef void (*kr_task_fn)(void *arg, int ith, int nth);
typedef struct kr_threadpool kr_threadpool;
int kr_threadpool_create(int n_threads, kr_threadpool **out, char *err);
void kr_threadpool_free(kr_threadpool *tp);
int kr_threadpool_size(const kr_threadpool *tp);
void kr_threadpool_run(kr_threadpool *tp, kr_task_fn fn, void *arg);
/* Splits [0, n) into nth near-equal parts; part ith is [*lo, *hi). `align` rounds boundaries. */
static inline void kr_split(int64_t n, int ith, int nth, int64_t align, int64_t *lo, int64_t *hi)
{
    int64_t units = (n + align - 1) / align;
    int64_t a = units * ith / nth, b = units * (ith + 1) / nth;
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
}

/* ---- KV cache internals (kv.c). A block stores `block_size` entries of one (layer, KV head):
 * keys [block_size][head_dim] f32 post-RoPE, values [block_size][head_dim] f32, positions. */
struct kr_kv_pool {
    int head_dim;
    int block_size;
    int n_blocks;
    float *k; /* [n_blocks][block_size][head_dim] */
    float *v; /* [n_blocks][block_size][head_dim] */
    int32_t *pos; /* [n_blocks][block_size] */
    int32_t *free_ids; /* stack of free block ids, [n_blocks] */
    int n_free;
    void (*release)(void *p); /* frees k, v and pos: free, or the backend's kv_free */
};

/* kr_kv_pool_create with k, v and pos from `alloc` (host memory, or memory a backend's kernels
 * and the host can both address: CUDA managed memory), released by `release`. */
int kr_kv_pool_create_in(int head_dim, int block_size, int n_blocks,
                         void *(*alloc)(void *ctx, size_t bytes), void *alloc_ctx,
                         void (*release)(void *p), kr_kv_pool **out, char *err);

/* One (layer, KV head) of a sequence: `len` entries in order, entry i in slot off + i of the
 * concatenated blocks (off < block_size: dropping the oldest entries can release whole blocks
 * from the front instead of moving everything behind them). Use the accessors below. */
typedef struct kr_kv_list {
    int32_t *blocks;
    int n_blocks;
    int cap_blocks;
    int len;
    int off; /* slot of entry 0 in blocks[0] */
    int pinned; /* the first `pinned` entries are the policy's pinned set; the rest the window */
    kr_list_rule rule; /* what decode does to the list after each step (kr.h) */
} kr_kv_list;

struct kr_seq {
    kr_kv_pool *pool;
    int n_layers;
    int n_kv_heads;
    int next_pos;
    int closed; /* kr_seq_set_next_pos was called: kr_seq_list_append is closed */
    kr_kv_list *lists; /* [n_layers][n_kv_heads] */
    kr_footprint fp;
    const kr_policy *policy; /* NULL: full attention */
    void *policy_state; /* the policy's per-sequence state, freed with the sequence */
};

static inline kr_kv_list *kr_seq_list(kr_seq *s, int layer, int kv_head)
{
    return &s->lists[layer * s->n_kv_heads + kv_head];
}
static inline float *kr_kv_key(const kr_kv_pool *p, int32_t block, int slot)
{
    return p->k + ((size_t)block * (size_t)p->block_size + (size_t)slot) * (size_t)p->head_dim;
}
static inline float *kr_kv_value(const kr_kv_pool *p, int32_t block, int slot)
{
    return p->v + ((size_t)block * (size_t)p->block_size + (size_t)slot) * (size_t)p->head_dim;
}
static inline int32_t *kr_kv_pos(const kr_kv_pool *p, int32_t block, int slot)
{
    return p->pos + (size_t)block * (size_t)p->block_size + (size_t)slot;
}
/* Entry e of a list: its key, value and position. */
static inline float *kr_kv_list_key(const kr_kv_pool *p, const kr_kv_list *l, int e)
{
    int i = l->off + e;
    return kr_kv_key(p, l->blocks[i / p->block_size], i % p->block_size);
}
static inline float *kr_kv_list_value(const kr_kv_pool *p, const kr_kv_list *l, int e)
{
    int i = l->off + e;
    return kr_kv_value(p, l->blocks[i / p->block_size], i % p->block_size);
}
static inline int32_t *kr_kv_list_pos(const kr_kv_pool *p, const kr_kv_list *l, int e)
{
    int i = l->off + e;
    return kr_kv_pos(p, l->blocks[i / p->block_size], i % p->block_size);
}
/* Key and value rows of entries [e0, e0 + n) of a list, stepping through the blocks (the
 * per-entry accessors divide by the block size: too slow for attention's inner loops). */
static inline void kr_kv_list_rows(const kr_kv_pool *p, const kr_kv_list *l, int e0, int n,
                                   const float **k, const float **v)
{
    int i = l->off + e0, b = i / p->block_size, slot = i % p->block_size;
    for (int j = 0; j < n; j++) {
        k[j] = kr_kv_key(p, l->blocks[b], slot);
        if (v) v[j] = kr_kv_value(p, l->blocks[b], slot);
        if (++slot == p->block_size) slot = 0, b++;
    }
}
/* Makes room for `n` more entries in every (layer, KV head), all or nothing: fails when the
 * pool lacks blocks, leaving the sequence as it was. */
int kr_seq_grow(kr_seq *s, int n, char *err);
/* The same for one list (layer, kv_head). */
int kr_seq_grow_list(kr_seq *s, int layer, int kv_head, int n, char *err);
/* Returns to the pool the blocks a sequence holds past its entries (what kr_seq_grow took and
 * no entry uses yet): undoes a grow. */
void kr_seq_release_spare(kr_seq *s);
/* Keeps entries keep[0..n_keep) (strictly increasing indices < len) of one list, in order,
 * returns freed blocks to the pool, and pins the first min(n_pinned, n_keep) kept entries. */
void kr_seq_keep(kr_seq *s, int layer, int kv_head, const int32_t *keep, int n_keep, int n_pinned);
/* Keeps the first `head` and the last `tail` entries of a list (all of it when they overlap);
 * pins the first min(head, kept). */
void kr_seq_keep_ends(kr_seq *s, int layer, int kv_head, int head, int tail);
/* Index of the first of entries [0, n) of list l whose position is > min_pos (n when none);
 * positions increase along a list. */
int kr_kv_list_first_after(const kr_kv_pool *p, const kr_kv_list *l, int n, int32_t min_pos);
/* The rule of a list that is never trimmed: what a sequence without a policy has. */
extern const kr_list_rule kr_rule_dense; /* kv.c */
/* Writes entry `idx` (< the grown capacity) of one (layer, KV head). Lengths are set by the
 * caller through the list's `len`. */
void kr_seq_put(kr_seq *s, int layer, int kv_head, int idx, const float *k, const float *v,
                int32_t pos);

/* ---- tokenizer (tokenizer.c): kr_tokenizer_load without the file reads, for fuzzing and
 * tests. `json` is tokenizer.json's text; `config_json` (may be NULL) tokenizer_config.json's.
 * The paths are only used in messages. */
int kr_tokenizer_parse(const char *json, size_t len, const char *path, const char *config_json,
                       size_t config_len, const char *config_path, kr_tokenizer **out, char *err);

#ifdef __cplusplus
}
#endif

#endif /* KR_IMPL_H */
