/*
 * kv.c - the paged KV cache: a fixed pool of blocks and, per sequence, a block list per
 * (layer, KV head). Lengths may differ per head (eviction keeps different sets per head).
 * What it is not: a policy. Which entries stay is decided by engine/policy code; this file
 * only stores them and hands blocks out and back.
 */
#include "kr-kv.h"
#include "kr-util.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

const kr_list_rule kr_rule_dense = {.sink = 0, .window = -1, .lazy = 1, .slack = 0, .max_drop = 0, .rel = 0};

static void *host_alloc(void *ctx, size_t bytes)
{
    return kr_alloc_huge(bytes);
}

int kr_kv_pool_create(int head_dim, int block_size, int n_blocks, kr_dtype dtype, kr_kv_pool **out,
                      char *err)
{
    return kr_kv_pool_create_in(head_dim, block_size, n_blocks, dtype, host_alloc, NULL, free, out, err);
}

int kr_kv_pool_create_in(int head_dim, int block_size, int n_blocks, kr_dtype dtype,
                         void *(*alloc)(void *ctx, size_t bytes), void *alloc_ctx,
                         void (*release)(void *p), kr_kv_pool **out, char *err)
{
    if (head_dim <= 0 || block_size <= 0 || n_blocks <= 0)
        return kr_errf(err, "KV pool: head_dim %d, block_size %d, n_blocks %d must be positive",
                       head_dim, block_size, n_blocks);
    if (dtype != KR_DTYPE_F32 && dtype != KR_DTYPE_BF16 && dtype != KR_DTYPE_F16)
        return kr_errf(err, "KV pool: dtype %d is not one of F32, BF16, F16", (int)dtype);
    kr_kv_pool *p = calloc(1, sizeof *p);
    if (!p) return kr_errf(err, "KV pool: out of memory");
    pthread_mutex_init(&p->lock, NULL);
    size_t entries = (size_t)n_blocks * (size_t)block_size;
    p->head_dim = head_dim;
    p->block_size = block_size;
    p->n_blocks = n_blocks;
    p->dtype = dtype;
    p->row_bytes = (size_t)head_dim * kr_dtype_size(dtype);
    p->release = release;
    p->k = alloc(alloc_ctx, entries * p->row_bytes);
    p->v = alloc(alloc_ctx, entries * p->row_bytes);
    p->pos = alloc(alloc_ctx, entries * sizeof(int32_t));
    const size_t words = ((size_t)n_blocks + 63) / 64;
    p->free_bits = malloc(words * sizeof(uint64_t));
    if (!p->k || !p->v || !p->pos || !p->free_bits) {
        kr_kv_pool_free(p);
        return kr_errf(err, "KV pool: cannot allocate %d blocks of %d entries x %d dims of %s (%.1f MiB)",
                       n_blocks, block_size, head_dim, kr_dtype_name(dtype),
                       (double)entries * (double)(2 * p->row_bytes + sizeof(int32_t)) / (1024.0 * 1024.0));
    }
    for (size_t w = 0; w < words; w++) p->free_bits[w] = ~(uint64_t)0;
    if (n_blocks % 64) p->free_bits[words - 1] = ((uint64_t)1 << (n_blocks % 64)) - 1;
    p->free_hint = 0;
    p->n_free = n_blocks;
    *out = p;
    return KR_OK;
}

void kr_kv_pool_free(kr_kv_pool *p)
{
    if (!p) return;
    if (p->k) p->release(p->k);
    if (p->v) p->release(p->v);
    if (p->pos) p->release(p->pos);
    free(p->free_bits);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

kr_dtype kr_kv_pool_dtype(const kr_kv_pool *p)
{
    return p->dtype;
}

int kr_kv_pool_block_size(const kr_kv_pool *p)
{
    return p->block_size;
}

int kr_kv_pool_n_blocks(const kr_kv_pool *p)
{
    return p->n_blocks;
}

/* The pool's free count is the number of set bits of its bitmap: every change below counts the
 * bits it actually flipped, so a bad give cannot inflate it (an inflated count sends pool_take's
 * scan past the bitmap's end). */
static void pool_check(const kr_kv_pool *p)
{
    KR_ASSERT(p->n_free >= 0 && p->n_free <= p->n_blocks);
}

/* The lowest free block, taken (the caller holds p->lock and checked n_free). Lowest first, so that a sequence's
 * blocks lie together and in order however earlier sequences came and went: a list read in
 * order is then one address stream the hardware prefetcher follows, where the blocks a stack of
 * freed ids hands out, after many requests, lie anywhere in the pool (decode 11% slower on a
 * 441-token sequence in a pool shuffled by 200 others, llama-110m shape). */
static int32_t pool_take(kr_kv_pool *p)
{
    KR_ASSERT(p->n_free > 0);
    int w = p->free_hint;
    while (!p->free_bits[w]) {
        w++;
        KR_ASSERT(w < (p->n_blocks + 63) / 64); /* n_free > 0 promised a set bit */
    }
    const int bit = __builtin_ctzll(p->free_bits[w]);
    KR_ASSERT(w * 64 + bit < p->n_blocks); /* bits past the pool's end are never set */
    p->free_bits[w] &= p->free_bits[w] - 1;
    p->free_hint = w;
    p->n_free--;
    pool_check(p);
    return (int32_t)(w * 64 + bit);
}

/* Returns a block a list held (under p->lock). One outside the pool or already free (given
 * twice) is left alone and not counted. */
static void pool_give(kr_kv_pool *p, int32_t block)
{
    const int taken = block >= 0 && block < p->n_blocks && !((p->free_bits[block / 64] >> (block % 64)) & 1);
    KR_ASSERT(taken); /* a block given back must be taken */
    if (!taken) return;
    p->free_bits[block / 64] |= (uint64_t)1 << (block % 64);
    if (block / 64 < p->free_hint) p->free_hint = block / 64;
    p->n_free++;
    pool_check(p);
}

/* Blocks [first, first + n) are a run of at least one block inside the pool. */
static int run_inside(const kr_kv_pool *p, int32_t first, int n)
{
    return n >= 1 && first >= 0 && first <= p->n_blocks - n;
}

/* What run_bits does to the bits of a run of blocks. */
enum run_op { RUN_COUNT, RUN_GIVE, RUN_TAKE };

/* Counts the free blocks among [first, first + n) (before the op), then marks them all free
 * (RUN_GIVE) or taken (RUN_TAKE), a bitmap word at a time. Under p->lock; the run is inside the
 * pool. */
static int run_bits(kr_kv_pool *p, int32_t first, int n, enum run_op op)
{
    KR_ASSERT(run_inside(p, first, n));
    int free_before = 0;
    for (int64_t b = first, end = (int64_t)first + n; b < end;) {
        const int64_t w = b / 64, lo = b % 64, hi = end - w * 64 < 64 ? end - w * 64 : 64; /* bits [lo, hi) */
        const uint64_t mask = (hi == 64 ? ~(uint64_t)0 : ((uint64_t)1 << hi) - 1) & (~(uint64_t)0 << lo);
        free_before += __builtin_popcountll(p->free_bits[w] & mask);
        if (op == RUN_GIVE) p->free_bits[w] |= mask;
        else if (op == RUN_TAKE) p->free_bits[w] &= ~mask;
        b = w * 64 + hi;
    }
    return free_before;
}

/* The lowest first block of n consecutive free blocks, or -1 (the caller holds p->lock). Scans
 * the bitmap from word free_hint, carrying the free run that reaches the top of the word before:
 * a word of all ones lengthens it by 64 and a zero word ends it. A mixed word may finish it with
 * its low free bits, may hold a run of n inside it (n < 64: found in log2(n) shift-and steps,
 * however fragmented the word), and starts the next carried run with its high free bits. Bits
 * past n_blocks are never set, so no run reaches past the pool. Moves free_hint up to the first
 * word holding a free block, which keeps "no free block below word free_hint" true for
 * pool_take. */
static int64_t find_run(kr_kv_pool *p, int n)
{
    const int64_t words = ((int64_t)p->n_blocks + 63) / 64;
    int64_t start = 0, len = 0; /* the free run that ends at the top of the word before */
    int hinted = 0;
    for (int64_t w = p->free_hint; w < words; w++) {
        const uint64_t x = p->free_bits[w];
        if (!x) {
            len = 0;
            continue;
        }
        if (!hinted) p->free_hint = (int)w, hinted = 1;
        if (x == ~(uint64_t)0) {
            if (!len) start = w * 64;
            if ((len += 64) >= n) return start;
            continue;
        }
        if (len && len + __builtin_ctzll(~x) >= n) return start;
        if (n < 64) {
            uint64_t r = x; /* bit i: blocks i .. i + k - 1 of the word are free */
            for (int k = 1; k < n;) {
                const int sh = k < n - k ? k : n - k;
                r &= r >> sh;
                k += sh;
            }
            if (r) return w * 64 + __builtin_ctzll(r);
        }
        len = __builtin_clzll(~x); /* free bits at the top of the word */
        start = w * 64 + 64 - len;
    }
    return -1;
}

int kr_kv_pool_take_run(kr_kv_pool *p, int n, int32_t *first)
{
    if (n < 1 || n > p->n_blocks) return -1;
    pthread_mutex_lock(&p->lock);
    const int64_t at = n <= p->n_free ? find_run(p, n) : -1;
    if (at >= 0) {
        const int was_free = run_bits(p, (int32_t)at, n, RUN_TAKE);
        KR_ASSERT(was_free == n); /* find_run returns a run of free blocks */
        p->n_free -= was_free;
        pool_check(p);
    }
    pthread_mutex_unlock(&p->lock);
    if (at < 0) return -1;
    *first = (int32_t)at;
    return KR_OK;
}

int kr_kv_pool_give_run(kr_kv_pool *p, int32_t first, int n)
{
    if (n == 0) return KR_OK;
    const int inside = run_inside(p, first, n);
    KR_ASSERT(inside); /* a run given back lies in the pool */
    if (!inside) return -1;
    pthread_mutex_lock(&p->lock);
    const int already_free = run_bits(p, first, n, RUN_COUNT);
    KR_ASSERT(already_free == 0); /* a run given back must be wholly taken */
    if (!already_free) {
        run_bits(p, first, n, RUN_GIVE);
        p->n_free += n;
        if (first / 64 < p->free_hint) p->free_hint = first / 64;
        pool_check(p);
    }
    pthread_mutex_unlock(&p->lock);
    return already_free ? -1 : KR_OK;
}

int kr_kv_pool_run_free(kr_kv_pool *p, int32_t first, int n)
{
    if (n == 0) return 0;
    const int inside = run_inside(p, first, n);
    KR_ASSERT(inside);
    if (!inside) return -1;
    pthread_mutex_lock(&p->lock);
    const int n_free = run_bits(p, first, n, RUN_COUNT);
    pthread_mutex_unlock(&p->lock);
    return n_free;
}

void kr_kv_pool_run_rows(const kr_kv_pool *p, int32_t first, void **k, void **v, int32_t **pos)
{
    *k = kr_kv_key(p, first, 0);
    *v = kr_kv_value(p, first, 0);
    *pos = kr_kv_pos(p, first, 0);
}

int kr_kv_pool_n_free(const kr_kv_pool *p)
{
    kr_kv_pool *q = (kr_kv_pool *)p; /* the lock is not part of the pool's value */
    pthread_mutex_lock(&q->lock);
    const int n = q->n_free;
    pthread_mutex_unlock(&q->lock);
    return n;
}

int kr_kv_blocks_for(const kr_kv_pool *p, int n_layers, int n_kv_heads, int n_tokens)
{
    int per_list = (n_tokens + p->block_size - 1) / p->block_size;
    return per_list * n_layers * n_kv_heads;
}

int kr_seq_create(kr_kv_pool *pool, int n_layers, int n_kv_heads, kr_seq **out, char *err)
{
    if (n_layers <= 0 || n_kv_heads <= 0)
        return kr_errf(err, "sequence: %d layers x %d KV heads must be positive", n_layers,
                       n_kv_heads);
    kr_seq *s = calloc(1, sizeof *s);
    if (!s) return kr_errf(err, "sequence: out of memory");
    s->lists = calloc((size_t)n_layers * (size_t)n_kv_heads, sizeof *s->lists);
    if (!s->lists) {
        free(s);
        return kr_errf(err, "sequence: out of memory");
    }
    s->pool = pool;
    s->n_layers = n_layers;
    s->n_kv_heads = n_kv_heads;
    for (int i = 0; i < n_layers * n_kv_heads; i++) s->lists[i].rule = kr_rule_dense;
    *out = s;
    return KR_OK;
}

void kr_seq_free(kr_seq *s)
{
    if (!s) return;
    int n = s->n_layers * s->n_kv_heads;
    for (int i = 0; i < n; i++) {
        kr_kv_list *l = &s->lists[i];
        pthread_mutex_lock(&s->pool->lock);
        for (int b = 0; b < l->n_blocks; b++) pool_give(s->pool, l->blocks[b]);
        pthread_mutex_unlock(&s->pool->lock);
        free(l->blocks);
    }
    free(s->lists);
    free(s->policy_state);
    free(s);
}

int kr_seq_next_pos(const kr_seq *s)
{
    return s->next_pos;
}

int kr_seq_len(const kr_seq *s, int layer, int kv_head)
{
    if (layer < 0 || layer >= s->n_layers || kv_head < 0 || kv_head >= s->n_kv_heads) return 0;
    return s->lists[layer * s->n_kv_heads + kv_head].len;
}

int64_t kr_seq_entries(const kr_seq *s)
{
    int64_t total = 0;
    for (int i = 0; i < s->n_layers * s->n_kv_heads; i++) total += s->lists[i].len;
    return total;
}

int kr_seq_blocks(const kr_seq *s)
{
    int total = 0;
    for (int i = 0; i < s->n_layers * s->n_kv_heads; i++) total += s->lists[i].n_blocks;
    return total;
}

void kr_seq_footprint(const kr_seq *s, kr_footprint *out)
{
    *out = s->fp;
}

/* A list's own invariants: its block ids fit its array, its entries its blocks (from slot off <
 * block_size of the first), its pinned set its entries. */
static void list_check(const kr_kv_pool *p, const kr_kv_list *l)
{
    KR_ASSERT(l->n_blocks >= 0 && l->n_blocks <= l->cap_blocks);
    KR_ASSERT(l->off >= 0 && l->off < p->block_size);
    KR_ASSERT(l->len >= 0 && (int64_t)l->off + l->len <= (int64_t)l->n_blocks * p->block_size);
    KR_ASSERT(l->pinned >= 0 && l->pinned <= l->len);
}

/* The pinned count clamped to the list: min(max(n, 0), len). */
static void list_pin(kr_kv_list *l, int n)
{
    l->pinned = n < 0 ? 0 : n < l->len ? n : l->len;
}

/* Room for `blocks` block ids in l's array (its blocks stay as they are): capacity doubles from
 * 4, so a list that grows a block per step reallocates rarely. */
static int list_reserve(kr_kv_list *l, int blocks, char *err)
{
    if (blocks <= l->cap_blocks) return KR_OK;
    int cap = l->cap_blocks ? l->cap_blocks : 4;
    while (cap < blocks) cap = cap > INT_MAX / 2 ? blocks : cap * 2;
    int32_t *grown = realloc(l->blocks, (size_t)cap * sizeof *grown);
    if (!grown) return kr_errf(err, "sequence: out of memory for block lists");
    l->blocks = grown;
    l->cap_blocks = cap;
    return KR_OK;
}

/* Room for n more entries in lists [first, first + count) of s, all or nothing. */
static int grow_lists(kr_seq *s, int first, int count, int n, char *err)
{
    kr_kv_pool *p = s->pool;
    int need = 0;
    for (int i = first; i < first + count; i++) {
        kr_kv_list *l = &s->lists[i];
        int blocks = (l->off + l->len + n + p->block_size - 1) / p->block_size;
        if (blocks > l->n_blocks) need += blocks - l->n_blocks;
    }
    /* grow the block arrays first so a failed allocation leaves the pool untouched */
    for (int i = first; i < first + count; i++) {
        kr_kv_list *l = &s->lists[i];
        if (list_reserve(l, (l->off + l->len + n + p->block_size - 1) / p->block_size, err) != KR_OK) return -1;
    }
    pthread_mutex_lock(&p->lock);
    if (need > p->n_free) {
        const int n_free = p->n_free;
        pthread_mutex_unlock(&p->lock);
        return kr_errf(err, "KV pool exhausted: %d more blocks needed, %d free of %d", need,
                       n_free, p->n_blocks);
    }
    for (int i = first; i < first + count; i++) {
        kr_kv_list *l = &s->lists[i];
        int blocks = (l->off + l->len + n + p->block_size - 1) / p->block_size;
        while (l->n_blocks < blocks) l->blocks[l->n_blocks++] = pool_take(p);
        list_check(p, l);
    }
    pthread_mutex_unlock(&p->lock);
    return KR_OK;
}

int kr_seq_grow(kr_seq *s, int n, char *err)
{
    return grow_lists(s, 0, s->n_layers * s->n_kv_heads, n, err);
}

int kr_seq_grow_list(kr_seq *s, int layer, int kv_head, int n, char *err)
{
    return grow_lists(s, layer * s->n_kv_heads + kv_head, 1, n, err);
}

void kr_seq_put(kr_seq *s, int layer, int kv_head, int idx, const float *k, const float *v,
                int32_t pos)
{
    kr_kv_pool *p = s->pool;
    kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    kr_dtype_from_f32(p->dtype, k, (size_t)p->head_dim, kr_kv_list_key(p, l, idx));
    kr_dtype_from_f32(p->dtype, v, (size_t)p->head_dim, kr_kv_list_value(p, l, idx));
    *kr_kv_list_pos(p, l, idx) = pos;
}

void kr_seq_extend(kr_seq *s, int layer, int kv_head, int n)
{
    kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    KR_ASSERT(n >= 0);
    l->len += n;
    list_check(s->pool, l); /* within the room kr_seq_grow made */
}

void kr_seq_pin(kr_seq *s, int layer, int kv_head, int n)
{
    list_pin(kr_seq_list(s, layer, kv_head), n);
}

int kr_seq_adopt_blocks(kr_seq *s, int layer, int kv_head, int32_t first, int n, char *err)
{
    kr_kv_pool *p = s->pool;
    kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    KR_ASSERT(run_inside(p, first, n) && kr_kv_pool_run_free(p, first, n) == 0);
    KR_ASSERT((int64_t)l->off + l->len == (int64_t)l->n_blocks * p->block_size);
    if (list_reserve(l, l->n_blocks + n, err) != KR_OK) return -1;
    for (int b = 0; b < n; b++) l->blocks[l->n_blocks++] = first + b;
    list_check(p, l);
    return KR_OK;
}

void kr_seq_set_rule(kr_seq *s, int layer, int kv_head, const kr_list_rule *rule)
{
    kr_seq_list(s, layer, kv_head)->rule = *rule;
}

int kr_kv_list_first_after(const kr_kv_pool *p, const kr_kv_list *l, int n, int32_t min_pos)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (*kr_kv_list_pos(p, l, mid) > min_pos) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* entry `from` of a list overwrites entry `to` */
static void move_entry(const kr_kv_pool *p, const kr_kv_list *l, int from, int to)
{
    memcpy(kr_kv_list_key(p, l, to), kr_kv_list_key(p, l, from), p->row_bytes);
    memcpy(kr_kv_list_value(p, l, to), kr_kv_list_value(p, l, from), p->row_bytes);
    *kr_kv_list_pos(p, l, to) = *kr_kv_list_pos(p, l, from);
}

/* sets the list's new length and pinned count; blocks past the length go back to the pool */
static void shrink(kr_kv_pool *p, kr_kv_list *l, int len, int pinned)
{
    KR_ASSERT(len >= 0 && len <= l->len);
    l->len = len;
    list_pin(l, pinned);
    int need = (l->off + len + p->block_size - 1) / p->block_size;
    if (l->n_blocks > need) {
        pthread_mutex_lock(&p->lock);
        while (l->n_blocks > need) pool_give(p, l->blocks[--l->n_blocks]);
        pthread_mutex_unlock(&p->lock);
    }
    list_check(p, l);
}

void kr_seq_release_spare(kr_seq *s)
{
    for (int i = 0; i < s->n_layers * s->n_kv_heads; i++) {
        kr_kv_list *l = &s->lists[i];
        shrink(s->pool, l, l->len, l->pinned);
    }
}

/* entries from `start` on become the list (start <= len): whole blocks before them go back to
 * the pool and the offset absorbs the rest */
static void drop_front(kr_kv_pool *p, kr_kv_list *l, int start)
{
    KR_ASSERT(start >= 0 && start <= l->len);
    int off = l->off + start, whole = off / p->block_size;
    pthread_mutex_lock(&p->lock);
    for (int b = 0; b < whole; b++) pool_give(p, l->blocks[b]);
    pthread_mutex_unlock(&p->lock);
    memmove(l->blocks, l->blocks + whole, sizeof(int32_t) * (size_t)(l->n_blocks - whole));
    l->n_blocks -= whole;
    l->off = off - whole * p->block_size;
    l->len -= start;
}

void kr_seq_keep(kr_seq *s, int layer, int kv_head, const int32_t *keep, int n_keep, int n_pinned)
{
    kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    for (int i = 0; i < n_keep; i++) /* keep[] increases: entry i is never overwritten early */
        if (keep[i] != i) move_entry(s->pool, l, keep[i], i);
    shrink(s->pool, l, n_keep, n_pinned);
}

void kr_seq_keep_ends(kr_seq *s, int layer, int kv_head, int head, int tail)
{
    kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    if (head < 0) head = 0;
    if (tail < 0) tail = 0;
    if (head + tail >= l->len) {
        shrink(s->pool, l, l->len, head);
        return;
    }
    if (tail <= head) { /* move the tail down behind the head */
        for (int i = 0; i < tail; i++) move_entry(s->pool, l, l->len - tail + i, head + i);
        shrink(s->pool, l, head + tail, head);
        return;
    }
    /* move the head up in front of the tail (backwards: the regions may overlap) and drop what
     * lies before it: a decode step of a streaming cache moves the sinks, not the window */
    int start = l->len - tail - head;
    for (int i = head - 1; i >= 0; i--) move_entry(s->pool, l, i, start + i);
    drop_front(s->pool, l, start);
    shrink(s->pool, l, head + tail, head);
}
