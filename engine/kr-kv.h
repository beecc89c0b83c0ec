/*
 * kr-kv.h - the paged KV cache's internals (kv.c): the pool of blocks, a sequence's block list
 * per (layer, KV head), the accessors that find an entry's key, value and position, and the
 * operations that grow, trim and write lists. Included by the code that reads or edits cached
 * entries: kv.c, forward.c, the policies (policy*.c), sequence import/export (seq-io.c) and the
 * backends (through backend.h). Not installed; the public side is kr.h.
 *
 * Only kv.c writes the pool's fields and a list's: the others read them and change a list
 * through the helpers below (kr_seq_grow, kr_seq_extend, kr_seq_pin, kr_seq_keep,
 * kr_seq_keep_ends, kr_seq_adopt_blocks, kr_seq_set_rule, kr_seq_release_spare), which keep
 * their invariants (KR_ASSERT in the sanitizer build): a block is in one list or free, never
 * both; n_free counts the free blocks; a list's entries fit its blocks and its pinned set its
 * entries.
 *
 * A block stores `block_size` entries of one (layer, KV head): keys [block_size][head_dim]
 * post-RoPE, values [block_size][head_dim], both in the pool's dtype (f32, bf16 or f16), and
 * positions. The row accessors return byte pointers to rows of `row_bytes`; readers widen them
 * (kr_dtype_to_f32, or the backend's vector loads) and writers round into them
 * (kr_dtype_from_f32, kr_seq_put).
 */
#ifndef KR_KV_H
#define KR_KV_H

#include "kr.h"

#include <pthread.h>

#ifdef __cplusplus /* the CUDA sources include this through backend.h */
extern "C" {
#endif

struct kr_kv_pool {
    int head_dim;
    int block_size;
    int n_blocks;
    kr_dtype dtype; /* of keys and values */
    size_t row_bytes; /* one key or value row: head_dim * kr_dtype_size(dtype) */
    uint8_t *k; /* [n_blocks][block_size][head_dim] of dtype */
    uint8_t *v; /* [n_blocks][block_size][head_dim] of dtype */
    int32_t *pos; /* [n_blocks][block_size] */
    uint64_t *free_bits; /* bit i of word i / 64 set: block i is free, [(n_blocks + 63) / 64] */
    int free_hint; /* no free block below word free_hint */
    int n_free;
    /* Serializes taking and returning blocks (free_bits, free_hint, n_free): a decode node fills
     * a new sequence's blocks on its transport thread while its loop grows and trims others.
     * The rows of a block are its owner's: one sequence is used by one thread at a time. */
    pthread_mutex_t lock;
    void (*release)(void *p); /* frees k, v and pos: free, or the backend's kv_free */
};

/* kr_kv_pool_create with k, v and pos from `alloc` (host memory, or memory a backend's kernels
 * and the host can both address: CUDA managed memory), released by `release`. */
int kr_kv_pool_create_in(int head_dim, int block_size, int n_blocks, kr_dtype dtype,
                         void *(*alloc)(void *ctx, size_t bytes), void *alloc_ctx,
                         void (*release)(void *p), kr_kv_pool **out, char *err);

/* One (layer, KV head) of a sequence: `len` entries in order, entry i in slot off + i of the
 * concatenated blocks (off < block_size: dropping the oldest entries can release whole blocks
 * from the front instead of moving everything behind them); off + len <= n_blocks * block_size,
 * n_blocks <= cap_blocks, pinned <= len. Read through the accessors below; write through kv.c's
 * helpers. */
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
static inline void *kr_kv_key(const kr_kv_pool *p, int32_t block, int slot)
{
    return p->k + ((size_t)block * (size_t)p->block_size + (size_t)slot) * p->row_bytes;
}
static inline void *kr_kv_value(const kr_kv_pool *p, int32_t block, int slot)
{
    return p->v + ((size_t)block * (size_t)p->block_size + (size_t)slot) * p->row_bytes;
}
static inline int32_t *kr_kv_pos(const kr_kv_pool *p, int32_t block, int slot)
{
    return p->pos + (size_t)block * (size_t)p->block_size + (size_t)slot;
}
/* Entry e of a list: its key and value rows (of the pool's dtype) and position. */
static inline void *kr_kv_list_key(const kr_kv_pool *p, const kr_kv_list *l, int e)
{
    int i = l->off + e;
    return kr_kv_key(p, l->blocks[i / p->block_size], i % p->block_size);
}
static inline void *kr_kv_list_value(const kr_kv_pool *p, const kr_kv_list *l, int e)
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
                                   const void **k, const void **v)
{
    int i = l->off + e0, b = i / p->block_size, slot = i % p->block_size;
    for (int j = 0; j < n; j++) {
        k[j] = kr_kv_key(p, l->blocks[b], slot);
        if (v) v[j] = kr_kv_value(p, l->blocks[b], slot);
        if (++slot == p->block_size) slot = 0, b++;
    }
}
/* How many of blocks first .. first + n - 1 are free in the pool (under its lock); -1 when they
 * are not all inside it. */
int kr_kv_pool_run_free(kr_kv_pool *p, int32_t first, int n);
/* Makes room for `n` more entries in every (layer, KV head), all or nothing: fails when the
 * pool lacks blocks, leaving the sequence as it was. */
int kr_seq_grow(kr_seq *s, int n, char *err);
/* The same for one list (layer, kv_head). */
int kr_seq_grow_list(kr_seq *s, int layer, int kv_head, int n, char *err);
/* Returns to the pool the blocks a sequence holds past its entries (what kr_seq_grow took and
 * no entry uses yet): undoes a grow. */
void kr_seq_release_spare(kr_seq *s);
/* Counts n more entries at the end of a list, inside the room kr_seq_grow made: the caller
 * writes their rows (kr_seq_put, the backend's kv_store, a bundle's rows) before or after. */
void kr_seq_extend(kr_seq *s, int layer, int kv_head, int n);
/* Pins the first min(max(n, 0), len) entries of a list: the one clamp of a pinned count. */
void kr_seq_pin(kr_seq *s, int layer, int kv_head, int n);
/* Appends blocks first .. first + n - 1 (a run inside the pool, taken, owned by no list) to a
 * list whose entries fill its blocks; its length is unchanged (kr_seq_extend counts the run's
 * entries). Fails (-1, message in err) only when the block array cannot grow, changing nothing. */
int kr_seq_adopt_blocks(kr_seq *s, int layer, int kv_head, int32_t first, int n, char *err);
/* Sets a list's decode rule as it is (kr_seq_list_set_rule in kr.h is the checked one that
 * imports use). */
void kr_seq_set_rule(kr_seq *s, int layer, int kv_head, const kr_list_rule *rule);
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
/* Writes entry `idx` (< the grown capacity) of one (layer, KV head): float32 key and value
 * rounded to the pool's dtype. The caller counts the entry with kr_seq_extend. */
void kr_seq_put(kr_seq *s, int layer, int kv_head, int idx, const float *k, const float *v,
                int32_t pos);

#ifdef __cplusplus
}
#endif

#endif /* KR_KV_H */
