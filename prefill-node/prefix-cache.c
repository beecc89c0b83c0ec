/*
 * prefix-cache.c - the prefill node's prefix cache (prefix-cache.h, docs/prefix-cache.md).
 *
 * Each entry is one sequence state at a chunk boundary: the prompt tokens before it (a multiple
 * of the chunk), the chain of their chunk hashes (h_i = hash(h_{i-1}, chunk i's tokens), h_0 the
 * hash of the key: model fingerprint, KV dtype, chunk, policy spec), the policy spec, and a copy
 * of the sequence (kr_seq_copy) in the cache's own KV pool. A lookup scans the entries of the
 * prompt's policy: per entry the deepest level whose chain hash equals the prompt's, then the
 * tokens themselves, which decide (a hash collision only costs a comparison). An entry whose
 * whole prefix matches is a hit; the longest match of any entry says where the prompt branches
 * from what is cached, and the prefill keeps its state there too, so the next prompt with that
 * branch point hits (what a radix tree's inner node gives, without splitting entries).
 *
 * Not here: sharing blocks between entries (an entry owns a full copy; for `full` a longer
 * entry holds a shorter one's rows again), a hash index (the scan costs a few hash compares per
 * entry, nothing next to a prefill), and entries at the prompt's last boundary when it is also
 * its end (the last chunk is always computed: it gives the logits).
 */
#include "prefix-cache.h"
#include "chain-hash.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct pf_cache_entry {
    pf_cache_entry *prev, *next; /* the LRU list: c->head most recently used */
    char *spec;                  /* the policy's canonical spec */
    int family;
    int n_tokens;                /* a multiple of the chunk */
    int32_t *tokens;             /* [n_tokens] */
    uint64_t *chain;             /* [n_tokens / chunk]: chain[i] = h_{i+1} */
    kr_seq *state;               /* in c->pool, no policy attached */
    int blocks;
    int refs;                    /* pf_cache_hit holders: never evicted while > 0 */
};

typedef struct family_metrics {
    kc_counter *lookups, *hits, *tokens_reused, *inserts, *skipped, *evictions, *collisions, *never;
    kc_gauge *bytes, *entries;
} family_metrics;

struct pf_cache {
    pf_cache_config cfg;
    char fingerprint[32];
    kr_kv_pool *pool;
    int64_t block_bytes;
    pf_cache_hash_fn hash;
    pf_cache_entry *head, *tail;
    int n_families;
    pf_cache_stats *stats;   /* [n_families] */
    family_metrics *metrics; /* [n_families] */
    kc_gauge *budget;
    uint64_t *h;             /* the last lookup's chain: h[0] the key's hash, h[i] chunk i's */
    int h_cap;
    int h_levels;            /* chunks h holds for the last lookup (0: none) */
};

/* The chain's hash is common/chain-hash.h's, which the router's placement index shares. */
uint64_t pf_cache_hash(uint64_t parent, const int32_t *tokens, int n)
{
    return kc_chain_hash(parent, tokens, n);
}

/* h_0: everything a cached state depends on besides the tokens. */
static uint64_t key_hash(const pf_cache *c, const char *spec)
{
    uint64_t h = KC_HASH_SEED;
    int32_t nums[2] = {c->cfg.chunk, (int32_t)c->cfg.kv_dtype};
    h = kc_hash_bytes(h, c->fingerprint, strlen(c->fingerprint) + 1);
    h = kc_hash_bytes(h, nums, sizeof nums);
    h = kc_hash_bytes(h, spec, strlen(spec) + 1);
    return kc_hash_mix(h);
}

static int register_metrics(pf_cache *c)
{
    kc_registry *r = c->cfg.reg;
    for (int f = 0; f < c->n_families; f++) {
        char label[96];
        snprintf(label, sizeof label, "policy=\"%s\"", kr_policy_family_name(f));
        family_metrics *m = &c->metrics[f];
        m->lookups = kc_counter_add(r, "kvrelay_prefix_cache_lookups_total",
                                    "Prefills whose policy may reuse a cached prefix and whose prompt has a "
                                    "chunk boundary, by policy family.", label);
        m->hits = kc_counter_add(r, "kvrelay_prefix_cache_hits_total",
                                 "Prefills that continued from a cached prefix state.", label);
        m->tokens_reused = kc_counter_add(r, "kvrelay_prefix_cache_tokens_reused_total",
                                          "Prompt tokens taken from the prefix cache instead of computed.", label);
        m->inserts = kc_counter_add(r, "kvrelay_prefix_cache_inserts_total",
                                    "Prefix states kept at chunk boundaries.", label);
        m->skipped = kc_counter_add(r, "kvrelay_prefix_cache_skipped_total",
                                    "Prefix states not kept: no room even after evicting every unused one.",
                                    label);
        m->evictions = kc_counter_add(r, "kvrelay_prefix_cache_evictions_total",
                                      "Prefix states evicted (least recently used first) to make room.", label);
        m->collisions = kc_counter_add(r, "kvrelay_prefix_cache_collisions_total",
                                       "Chain hashes that matched prompts whose tokens differ (not reused).",
                                       label);
        m->never = kc_counter_add(r, "kvrelay_prefix_cache_bypass_total",
                                  "Prefills of a policy that is not prefix-deterministic (never reuses).", label);
        m->bytes = kc_gauge_add(r, "kvrelay_prefix_cache_bytes",
                                "Bytes of KV blocks the prefix cache holds (block bytes x blocks).", label);
        m->entries = kc_gauge_add(r, "kvrelay_prefix_cache_entries", "Prefix states held.", label);
        if (!m->lookups || !m->hits || !m->tokens_reused || !m->inserts || !m->skipped || !m->evictions ||
            !m->collisions || !m->never || !m->bytes || !m->entries)
            return -1;
    }
    c->budget = kc_gauge_add(r, "kvrelay_prefix_cache_budget_bytes",
                             "The prefix cache's memory budget as blocks (--prefix-cache-memory).", NULL);
    if (!c->budget) return -1;
    kc_gauge_set(c->budget, (double)(c->block_bytes * kr_kv_pool_n_blocks(c->pool)));
    return 0;
}

int pf_cache_create(const pf_cache_config *cfg, pf_cache **out, char *err)
{
    const kr_config *mc = kr_model_config(cfg->model);
    const int64_t block_bytes =
        (int64_t)cfg->block_size * (2 * (int64_t)mc->head_dim * (int64_t)kr_dtype_size(cfg->kv_dtype) + 4);
    const int64_t blocks = cfg->budget_bytes / block_bytes;
    if (cfg->chunk < 1 || blocks < 1)
        return snprintf(err, KR_ERR_MAX, "prefix cache: a budget of %lld bytes is less than one KV block "
                        "(%lld bytes)", (long long)cfg->budget_bytes, (long long)block_bytes), -1;
    if (blocks > INT32_MAX)
        return snprintf(err, KR_ERR_MAX, "prefix cache: a budget of %lld bytes is more than one pool holds "
                        "(%d blocks of %lld bytes)", (long long)cfg->budget_bytes, INT32_MAX,
                        (long long)block_bytes), -1;
    pf_cache *c = calloc(1, sizeof *c);
    if (!c) return snprintf(err, KR_ERR_MAX, "prefix cache: out of memory"), -1;
    c->cfg = *cfg;
    c->hash = pf_cache_hash;
    c->block_bytes = block_bytes;
    snprintf(c->fingerprint, sizeof c->fingerprint, "%s", kr_model_fingerprint(cfg->model));
    c->n_families = kr_policy_n_families();
    c->stats = calloc((size_t)c->n_families, sizeof *c->stats);
    c->metrics = calloc((size_t)c->n_families, sizeof *c->metrics);
    if (!c->stats || !c->metrics) {
        snprintf(err, KR_ERR_MAX, "prefix cache: out of memory");
        goto fail;
    }
    if (kr_kv_pool_create(mc->head_dim, cfg->block_size, (int)blocks, cfg->kv_dtype, &c->pool, err) != KR_OK)
        goto fail;
    if (cfg->reg && register_metrics(c) != 0) {
        snprintf(err, KR_ERR_MAX, "prefix cache: cannot register its metrics (out of memory)");
        goto fail;
    }
    *out = c;
    return 0;
fail:
    pf_cache_free(c);
    return -1;
}

static void entry_free(pf_cache_entry *e)
{
    kr_seq_free(e->state);
    free(e->spec);
    free(e->tokens);
    free(e->chain);
    free(e);
}

static void unlink_entry(pf_cache *c, pf_cache_entry *e)
{
    if (e->prev) e->prev->next = e->next;
    else c->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else c->tail = e->prev;
    e->prev = e->next = NULL;
}

static void push_front(pf_cache *c, pf_cache_entry *e)
{
    e->prev = NULL;
    e->next = c->head;
    if (c->head) c->head->prev = e;
    c->head = e;
    if (!c->tail) c->tail = e;
}

/* The gauges of family f from its stats. */
static void family_gauges(pf_cache *c, int f)
{
    kc_gauge_set(c->metrics[f].bytes, (double)(c->stats[f].blocks * c->block_bytes));
    kc_gauge_set(c->metrics[f].entries, (double)c->stats[f].entries);
}

static void drop_entry(pf_cache *c, pf_cache_entry *e)
{
    pf_cache_stats *st = &c->stats[e->family];
    st->entries--;
    st->blocks -= e->blocks;
    family_gauges(c, e->family);
    unlink_entry(c, e);
    entry_free(e);
}

void pf_cache_free(pf_cache *c)
{
    if (!c) return;
    while (c->head) drop_entry(c, c->head);
    kr_kv_pool_free(c->pool);
    free(c->stats);
    free(c->metrics);
    free(c->h);
    free(c);
}

void pf_cache_set_hash(pf_cache *c, pf_cache_hash_fn fn)
{
    c->hash = fn ? fn : pf_cache_hash;
}

const pf_cache_stats *pf_cache_family_stats(const pf_cache *c, int family)
{
    return family >= 0 && family < c->n_families ? &c->stats[family] : NULL;
}

void pf_cache_summarize(const pf_cache *c, pf_cache_summary *out)
{
    memset(out, 0, sizeof *out);
    if (!c) return;
    out->budget_bytes = (uint64_t)kc_gauge_value(c->budget);
    for (int f = 0; f < c->n_families; f++) {
        const family_metrics *m = &c->metrics[f];
        out->bytes += (uint64_t)kc_gauge_value(m->bytes);
        out->entries += (uint64_t)kc_gauge_value(m->entries);
        out->lookups += (uint64_t)kc_counter_value(m->lookups);
        out->hits += (uint64_t)kc_counter_value(m->hits);
        out->tokens_reused += (uint64_t)kc_counter_value(m->tokens_reused);
    }
}

int64_t pf_cache_block_bytes(const pf_cache *c)
{
    return c->block_bytes;
}

int pf_cache_n_blocks(const pf_cache *c)
{
    return kr_kv_pool_n_blocks(c->pool);
}

int pf_cache_n_free(const pf_cache *c)
{
    return kr_kv_pool_n_free(c->pool);
}

static int family_of(const kr_policy *p)
{
    return p ? kr_policy_family(p) : 0; /* no policy is full attention, family 0 */
}

static const char *spec_of(const kr_policy *p)
{
    return p ? kr_policy_spec(p) : "full";
}

/* Chain hashes h[0..m] of the prompt's first m chunks into c->h. */
static int chain(pf_cache *c, const kr_policy *p, const int32_t *tokens, int m)
{
    if (m + 1 > c->h_cap) {
        uint64_t *h = realloc(c->h, sizeof *h * (size_t)(m + 1));
        if (!h) return -1;
        c->h = h;
        c->h_cap = m + 1;
    }
    c->h[0] = key_hash(c, spec_of(p));
    for (int i = 1; i <= m; i++)
        c->h[i] = c->hash(c->h[i - 1], tokens + (size_t)(i - 1) * c->cfg.chunk, c->cfg.chunk);
    return 0;
}

/* Tokens two prompts share from the start, up to n. */
static int common_tokens(const int32_t *a, const int32_t *b, int n)
{
    int i = 0;
    while (i < n && a[i] == b[i]) i++;
    return i;
}

void pf_cache_lookup(pf_cache *c, const kr_policy *p, const int32_t *tokens, int n, pf_cache_hit *hit)
{
    memset(hit, 0, sizeof *hit);
    c->h_levels = 0;
    const int C = c->cfg.chunk, m = (n - 1) / C; /* boundaries below the prompt's end */
    const int f = family_of(p);
    if (!kr_policy_prefix_deterministic(p)) {
        c->stats[f].never++;
        kc_counter_inc(c->metrics[f].never, 1);
        return;
    }
    if (m < 1 || chain(c, p, tokens, m) != 0) return;
    c->h_levels = m;
    c->stats[f].lookups++;
    kc_counter_inc(c->metrics[f].lookups, 1);
    const char *spec = spec_of(p);
    pf_cache_entry *best = NULL;
    for (pf_cache_entry *e = c->head; e; e = e->next) {
        if (e->family != f || strcmp(e->spec, spec) != 0) continue;
        int levels = e->n_tokens / C < m ? e->n_tokens / C : m;
        int i = levels;
        while (i > 0 && e->chain[i - 1] != c->h[i]) i--;
        if (i == 0) continue;
        int same = common_tokens(e->tokens, tokens, i * C);
        if (same < i * C) { /* the hashes lied: the tokens decide */
            c->stats[f].collisions++;
            kc_counter_inc(c->metrics[f].collisions, 1);
            i = same / C;
        }
        if (i > hit->shared) hit->shared = i;
        if (i * C == e->n_tokens && (!best || e->n_tokens > best->n_tokens)) best = e;
    }
    hit->shared *= C;
    if (!best) return;
    best->refs++;
    unlink_entry(c, best); /* most recently used */
    push_front(c, best);
    hit->entry = best;
    hit->tokens = best->n_tokens;
}

void pf_cache_release(pf_cache *c, pf_cache_hit *hit)
{
    (void)c;
    if (hit->entry) hit->entry->refs--;
    hit->entry = NULL;
}

/* Blocks a copy of s takes in the cache's pool (kr_seq_copy packs each list from slot 0). */
static int64_t copy_blocks(const pf_cache *c, const kr_seq *s)
{
    const kr_config *mc = kr_model_config(c->cfg.model);
    const int bs = c->cfg.block_size;
    int64_t need = 0;
    for (int l = 0; l < mc->n_layers; l++)
        for (int g = 0; g < mc->n_kv_heads; g++) {
            int len;
            kr_seq_list_shape(s, l, g, &len, NULL);
            need += (len + bs - 1) / bs;
        }
    return need;
}

/* Keeps a copy of s, which holds the prompt's first `upto` tokens (a boundary of the last
 * lookup's chain), evicting unused states least recently used first for its room; when there
 * is none, keeps nothing. */
static void insert(pf_cache *c, const kr_policy *p, const kr_seq *s, const int32_t *tokens, int upto)
{
    const int f = family_of(p);
    pf_cache_stats *st = &c->stats[f];
    const int levels = upto / c->cfg.chunk;
    const int64_t need = levels <= c->h_levels ? copy_blocks(c, s) : INT64_MAX; /* chain known */
    /* what evicting every unused state would free: when even that is too little, the cache is
     * left as it is instead of emptied for nothing */
    int64_t could = kr_kv_pool_n_free(c->pool);
    for (const pf_cache_entry *e = c->head; e; e = e->next) could += e->refs ? 0 : e->blocks;
    pf_cache_entry *e = could >= need ? c->tail : NULL;
    while (kr_kv_pool_n_free(c->pool) < need && e) {
        pf_cache_entry *prev = e->prev;
        if (e->refs == 0) {
            c->stats[e->family].evictions++;
            kc_counter_inc(c->metrics[e->family].evictions, 1);
            drop_entry(c, e);
        }
        e = prev;
    }
    char err[KR_ERR_MAX];
    pf_cache_entry *ne = calloc(1, sizeof *ne);
    if (!ne || kr_kv_pool_n_free(c->pool) < need || !(ne->spec = strdup(spec_of(p))) ||
        !(ne->tokens = malloc(sizeof *ne->tokens * (size_t)upto)) ||
        !(ne->chain = malloc(sizeof *ne->chain * (size_t)levels)) ||
        kr_seq_copy(s, c->pool, NULL, &ne->state, err) != KR_OK) {
        if (ne) entry_free(ne);
        st->skipped++;
        kc_counter_inc(c->metrics[f].skipped, 1);
        return;
    }
    memcpy(ne->tokens, tokens, sizeof *ne->tokens * (size_t)upto);
    memcpy(ne->chain, c->h + 1, sizeof *ne->chain * (size_t)levels);
    ne->family = f;
    ne->n_tokens = upto;
    ne->blocks = kr_seq_blocks(ne->state);
    push_front(c, ne);
    st->inserts++;
    st->entries++;
    st->blocks += ne->blocks;
    kc_counter_inc(c->metrics[f].inserts, 1);
    family_gauges(c, f);
}

int pf_cache_prefill(pf_cache *c, kr_ctx *ctx, kr_kv_pool *pool, const pf_cache_job *job, float *logits,
                     kr_seq **seq, int *reused, char *err)
{
    *reused = 0;
    if (!c || job->score_fn) { /* scoring computes every row: nothing is looked up or kept */
        const kr_prompt_span all = {.tokens = job->tokens, .n = job->n, .from = 0, .to = job->n,
                                    .chunk = job->chunk, .pos0 = kr_seq_next_pos(*seq),
                                    .score_fn = job->score_fn, .score_arg = job->score_arg,
                                    .score_buf = job->score_buf};
        return kr_prefill_span(ctx, *seq, &all, KR_LOGITS_LAST, logits, job->fn, job->arg, err);
    }
    const int C = c->cfg.chunk;
    if (job->chunk != C)
        return snprintf(err, KR_ERR_MAX, "prefix cache: a prefill in %d-token chunks through a cache of "
                        "%d-token chunks", job->chunk, C), -1;
    kr_prompt_span sp = {.tokens = job->tokens, .n = job->n, .chunk = C, .pos0 = kr_seq_next_pos(*seq)};
    pf_cache_hit hit;
    pf_cache_lookup(c, job->policy, job->tokens, job->n, &hit);
    int restored = 0;
    if (hit.entry) {
        kr_seq *copy;
        char why[KR_ERR_MAX];
        /* the working pool holds a whole prompt; a copy that does not fit is computed instead */
        if (kr_seq_copy(hit.entry->state, pool, job->policy, &copy, why) == KR_OK) {
            kr_seq_free(*seq);
            *seq = copy;
            sp.from = restored = hit.tokens;
            const int f = family_of(job->policy);
            c->stats[f].hits++;
            c->stats[f].tokens_reused += (uint64_t)hit.tokens;
            kc_counter_inc(c->metrics[f].hits, 1);
            kc_counter_inc(c->metrics[f].tokens_reused, hit.tokens);
        }
    }
    /* states to keep: where the prompt branches from a cached one, and its last boundary */
    int keep[2], n_keep = 0;
    const int last = kr_policy_prefix_deterministic(job->policy) ? (job->n - 1) / C * C : 0;
    if (hit.shared > sp.from && hit.shared < last) keep[n_keep++] = hit.shared;
    if (last > sp.from) keep[n_keep++] = last;
    int rc = KR_OK;
    for (int k = 0; k < n_keep && rc == KR_OK; k++) {
        sp.to = keep[k];
        rc = kr_prefill_span(ctx, *seq, &sp, KR_LOGITS_NONE, NULL, job->fn, job->arg, err);
        if (rc == KR_OK) insert(c, job->policy, *seq, job->tokens, keep[k]);
        sp.from = keep[k];
    }
    if (rc == KR_OK) {
        sp.to = job->n;
        rc = kr_prefill_span(ctx, *seq, &sp, KR_LOGITS_LAST, logits, job->fn, job->arg, err);
    }
    *reused = rc == KR_OK ? restored : 0;
    pf_cache_release(c, &hit);
    return rc;
}
