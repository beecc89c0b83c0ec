/*
 * kv-index.h - the router's record of which prompt prefixes it sent to one prefill node, for
 * kv-aware placement (docs/prefix-cache.md, "Placement"): the chain hashes of the chunk-aligned
 * blocks of every prompt it placed there (common/chain-hash.h, the function and the cut the
 * prefill node keys its prefix cache with), at most a fixed number of them, least recently used
 * forgotten first. It is a hint: the node may have evicted what the index still holds (a miss
 * there costs a recompute, never a wrong answer), and the router drops a node's index when the
 * node restarts or leaves (nodes.c).
 * What it is not: a copy of the node's cache (which keeps states at two boundaries per prompt,
 * not at every one), or thread-safe (the router's mutex guards it). Pure: tested by
 * tests/unit/test_router_kv_index.c.
 */
#ifndef RT_KV_INDEX_H
#define RT_KV_INDEX_H

#include <stdint.h>

/* A prompt cut as the prefill node cuts it: h[i] is the chain hash of its first i + 1 blocks of
 * `chunk` tokens, for the m blocks that end below its last token (the node always computes the
 * last chunk: it gives the first token's logits), so at most m * chunk of its tokens can come
 * from a cache. */
typedef struct rt_chain {
    uint64_t *h; /* [m], malloc'd by rt_chain_make */
    int m;
    int chunk;
} rt_chain;

/* The chain of tokens[0, n) in blocks of `chunk`, under the policy whose canonical spec is
 * `spec` (h_0 hashes it: prompts under different policies never share). m = 0 (and h NULL) when
 * n <= chunk. Returns 0, or -1 when out of memory (c zeroed: no prefix predicted). */
int rt_chain_make(const char *spec, int chunk, const int32_t *tokens, int n, rt_chain *c);
void rt_chain_free(rt_chain *c);

typedef struct rt_kv_index rt_kv_index;

/* An empty index that holds at most `capacity` block hashes (> 0); its tables are allocated by
 * the first insert. NULL when out of memory. */
rt_kv_index *rt_kv_index_create(int capacity);
void rt_kv_index_free(rt_kv_index *x); /* NULL is fine */
/* Forgets everything (the node restarted or left); keeps the tables. */
void rt_kv_index_clear(rt_kv_index *x);
/* How many leading blocks of c the index holds: the chain stops at the first block it lacks. */
int rt_kv_index_match(const rt_kv_index *x, const rt_chain *c);
/* Records the prompt of c as sent to the node: each of its blocks becomes the most recently
 * used, the first block most of all (so the deepest ones are forgotten first and what is kept
 * is always a whole prefix), forgetting the least recently used ones when full. Out of memory
 * for the tables: records nothing. */
void rt_kv_index_insert(rt_kv_index *x, const rt_chain *c);
int rt_kv_index_size(const rt_kv_index *x); /* block hashes held */

#endif /* RT_KV_INDEX_H */
