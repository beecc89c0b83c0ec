/*
 * prefix-cache.h - the prefill node's prefix cache (docs/prefix-cache.md): after a prefill it
 * keeps copies of the sequence's state at chunk boundaries, keyed by a hash chain over the
 * prompt's chunk-aligned token blocks and by what the state depends on (the model's
 * fingerprint, the KV cache dtype, the chunk size and the policy's canonical spec); a later
 * prompt that begins with a cached prefix continues from a copy of it (kr_prefill_span). Only
 * policies that are prefix-deterministic at chunk boundaries (kr_policy_prefix_deterministic)
 * use it, so the bundle, the first token and its log-probability are bit for bit those of a
 * prefill from scratch.
 *
 * Memory: the states live in a pool of their own, sized by the budget; unreferenced states are
 * evicted least recently used first when a new one needs room; one that does not fit is not
 * kept. Nothing here fails a request for want of memory.
 * Threads: the worker's alone (not thread-safe); its metrics are thread-safe counters.
 */
#ifndef PF_PREFIX_CACHE_H
#define PF_PREFIX_CACHE_H

#include <stdint.h>

#include "kr.h"
#include "metrics.h"

typedef struct pf_cache pf_cache;

/* The hash of one chunk of tokens chained to its parent's (the first chunk's parent: the hash of
 * the cache's key). Replaceable for tests, which force collisions. */
typedef uint64_t (*pf_cache_hash_fn)(uint64_t parent, const int32_t *tokens, int n);
uint64_t pf_cache_hash(uint64_t parent, const int32_t *tokens, int n);

typedef struct pf_cache_config {
    int64_t budget_bytes;    /* > 0: the pool holds floor(budget / block bytes) blocks */
    int chunk;               /* the prefill chunk every cached state was made with */
    int block_size;          /* the cache pool's block size (entries) */
    const kr_model *model;   /* its fingerprint and shape */
    kr_dtype kv_dtype;       /* the KV cache's dtype (the working pool's) */
    kc_registry *reg;        /* NULL: no metrics */
} pf_cache_config;

/* Counters per policy family (kr_policy_family), also exported as metrics with a policy
 * label. */
typedef struct pf_cache_stats {
    uint64_t lookups;       /* prefills of a prefix-deterministic policy with a boundary */
    uint64_t hits;          /* of which continued from a cached state */
    uint64_t tokens_reused; /* prompt tokens not computed thanks to hits */
    uint64_t inserts;       /* states kept */
    uint64_t skipped;       /* states not kept: no room even after evicting all it could */
    uint64_t evictions;     /* states evicted for room */
    uint64_t collisions;    /* chain hashes that matched tokens that did not */
    uint64_t never;         /* prefills of a policy that is not prefix-deterministic */
    int64_t entries, blocks; /* states held, and their blocks */
} pf_cache_stats;

int pf_cache_create(const pf_cache_config *cfg, pf_cache **out, char *err);
void pf_cache_free(pf_cache *c); /* NULL is fine; every state must be released */
void pf_cache_set_hash(pf_cache *c, pf_cache_hash_fn fn); /* only while the cache is empty */
const pf_cache_stats *pf_cache_family_stats(const pf_cache *c, int family);
/* Totals over every family, read from the metrics (0 when the cache has no registry): safe from
 * any thread, for Prefill.Status. */
typedef struct pf_cache_summary {
    uint64_t bytes, budget_bytes, entries, lookups, hits, tokens_reused;
} pf_cache_summary;
void pf_cache_summarize(const pf_cache *c, pf_cache_summary *out); /* c NULL: zeros */
int64_t pf_cache_block_bytes(const pf_cache *c);
int pf_cache_n_blocks(const pf_cache *c); /* the cache pool's blocks */
int pf_cache_n_free(const pf_cache *c);   /* its free blocks */

/* A state found for a prompt: held (never evicted) until pf_cache_release. */
typedef struct pf_cache_entry pf_cache_entry;
typedef struct pf_cache_hit {
    pf_cache_entry *entry; /* NULL: nothing cached for this prompt */
    int tokens;            /* prompt tokens the entry's state holds (a multiple of chunk) */
    int shared;            /* the longest chunk-aligned prefix any cached state's prompt
                              shares with this one (>= tokens): where prompts branch */
} pf_cache_hit;
/* The longest cached state that prompt tokens[0, n) under policy p can continue from: its
 * tokens a prefix of the prompt ending on a chunk boundary below n (the last chunk is always
 * computed: it gives the logits). A policy that is not prefix-deterministic never hits. */
void pf_cache_lookup(pf_cache *c, const kr_policy *p, const int32_t *tokens, int n, pf_cache_hit *hit);
void pf_cache_release(pf_cache *c, pf_cache_hit *hit);

/* One prefill through the cache. */
typedef struct pf_cache_job {
    const int32_t *tokens;  /* [n] */
    int n;
    int chunk;              /* the prefill chunk: the cache's, when there is one */
    const kr_policy *policy;
    kr_layers_final_fn fn;  /* kr_prefill_layers' callback (NULL: none) */
    void *arg;
    /* Prompt scoring (kr_prompt_span's score_fn, NULL: none): every row must be computed, so a
     * scored prompt bypasses the cache (no lookup, nothing kept). */
    kr_rows_fn score_fn;
    void *score_arg;
    float *score_buf;
} pf_cache_job;
/* kr_prefill_layers of the job's prompt into *seq (a new sequence of `pool` with the job's
 * policy, which this may replace by a copy of a cached state: the caller frees *seq either way),
 * last row's logits into `logits`, keeping the state at up to two chunk boundaries (where the
 * prompt branches from a cached one, and its last boundary) when the cache has room. c NULL:
 * kr_prefill_layers alone. *reused: prompt tokens that came from the cache. Fails as
 * kr_prefill_layers does. */
int pf_cache_prefill(pf_cache *c, kr_ctx *ctx, kr_kv_pool *pool, const pf_cache_job *job, float *logits,
                     kr_seq **seq, int *reused, char *err);

#endif /* PF_PREFIX_CACHE_H */
