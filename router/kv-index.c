/*
 * kv-index.c - a bounded LRU set of chain hashes per prefill node (kv-index.h): a table of
 * `capacity` entries, hash buckets chained through them, and one doubly linked recency list.
 * Lookups and inserts cost a bucket walk per block; nothing is allocated after the first insert.
 */
#include "kv-index.h"

#include "chain-hash.h"

#include <stdlib.h>
#include <string.h>

typedef struct entry {
    uint64_t h;
    int32_t chain; /* next entry in its bucket, -1: none */
    int32_t newer, older; /* recency list, -1: none */
} entry;

struct rt_kv_index {
    int capacity;
    int size; /* entries in use: e[0, size) */
    entry *e; /* [capacity], NULL until the first insert */
    int32_t *bucket; /* [n_buckets] first entry, -1: empty */
    uint32_t n_buckets; /* a power of two >= capacity */
    int32_t newest, oldest; /* -1 when empty */
};

int rt_chain_make(const char *spec, int chunk, const int32_t *tokens, int n, rt_chain *c)
{
    *c = (rt_chain){.chunk = chunk};
    int m = chunk > 0 && n > 0 ? (n - 1) / chunk : 0;
    if (!m) return 0;
    c->h = malloc((size_t)m * sizeof *c->h);
    if (!c->h) return -1;
    uint64_t h = kc_hash_mix(kc_hash_bytes(KC_HASH_SEED, spec, strlen(spec) + 1));
    for (int i = 0; i < m; i++) c->h[i] = h = kc_chain_hash(h, tokens + (size_t)i * (size_t)chunk, chunk);
    c->m = m;
    return 0;
}

void rt_chain_free(rt_chain *c)
{
    free(c->h);
    *c = (rt_chain){0};
}

rt_kv_index *rt_kv_index_create(int capacity)
{
    if (capacity <= 0) return NULL;
    rt_kv_index *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->capacity = capacity;
    x->newest = x->oldest = -1;
    return x;
}

void rt_kv_index_free(rt_kv_index *x)
{
    if (!x) return;
    free(x->e);
    free(x->bucket);
    free(x);
}

void rt_kv_index_clear(rt_kv_index *x)
{
    if (!x) return;
    x->size = 0;
    x->newest = x->oldest = -1;
    if (x->bucket) memset(x->bucket, 0xff, x->n_buckets * sizeof *x->bucket);
}

int rt_kv_index_size(const rt_kv_index *x)
{
    return x ? x->size : 0;
}

static uint32_t bucket_of(const rt_kv_index *x, uint64_t h)
{
    return (uint32_t)(h ^ (h >> 32)) & (x->n_buckets - 1);
}

static int32_t entry_of(const rt_kv_index *x, uint64_t h)
{
    if (!x->bucket) return -1;
    for (int32_t i = x->bucket[bucket_of(x, h)]; i >= 0; i = x->e[i].chain)
        if (x->e[i].h == h) return i;
    return -1;
}

int rt_kv_index_match(const rt_kv_index *x, const rt_chain *c)
{
    int k = 0;
    while (x && k < c->m && entry_of(x, c->h[k]) >= 0) k++;
    return k;
}

static void unlink_lru(rt_kv_index *x, int32_t i)
{
    entry *e = &x->e[i];
    if (e->newer >= 0) x->e[e->newer].older = e->older;
    else x->newest = e->older;
    if (e->older >= 0) x->e[e->older].newer = e->newer;
    else x->oldest = e->newer;
}

static void push_newest(rt_kv_index *x, int32_t i)
{
    entry *e = &x->e[i];
    e->newer = -1;
    e->older = x->newest;
    if (x->newest >= 0) x->e[x->newest].newer = i;
    x->newest = i;
    if (x->oldest < 0) x->oldest = i;
}

static void unlink_bucket(rt_kv_index *x, int32_t i)
{
    int32_t *p = &x->bucket[bucket_of(x, x->e[i].h)];
    while (*p != i) p = &x->e[*p].chain;
    *p = x->e[i].chain;
}

static int tables(rt_kv_index *x)
{
    if (x->e) return 0;
    uint32_t nb = 1;
    while (nb < (uint32_t)x->capacity) nb <<= 1;
    x->e = malloc((size_t)x->capacity * sizeof *x->e);
    x->bucket = malloc(nb * sizeof *x->bucket);
    if (!x->e || !x->bucket) {
        free(x->e);
        free(x->bucket);
        x->e = NULL;
        x->bucket = NULL;
        return -1;
    }
    x->n_buckets = nb;
    memset(x->bucket, 0xff, nb * sizeof *x->bucket);
    return 0;
}

/* Makes h the most recently used, adding it (in place of the least recently used when full). */
static void touch(rt_kv_index *x, uint64_t h)
{
    int32_t i = entry_of(x, h);
    if (i >= 0) {
        unlink_lru(x, i);
        push_newest(x, i);
        return;
    }
    if (x->size < x->capacity) {
        i = x->size++;
    } else {
        i = x->oldest;
        unlink_lru(x, i);
        unlink_bucket(x, i);
    }
    uint32_t b = bucket_of(x, h);
    x->e[i].h = h;
    x->e[i].chain = x->bucket[b];
    x->bucket[b] = i;
    push_newest(x, i);
}

void rt_kv_index_insert(rt_kv_index *x, const rt_chain *c)
{
    if (!x || !c->m || tables(x) != 0) return;
    for (int k = c->m - 1; k >= 0; k--) touch(x, c->h[k]);
}
