/*
 * policy.h - how KV eviction policies plug into the engine (internal to engine/).
 *
 * DESIGN.md section 1: every policy chooses a *pinned set* per (layer, KV head) during prefill
 * and keeps a *recent window* during decode. A list of a sequence is laid out as
 * [pinned entries | window entries], `pinned` counting the first. Policies run where the prompt
 * is, at two moments only:
 *   - kr_seq_set_policy: each list gets the decode rule the policy starts it with (list_rule);
 *   - after_chunk: layer `layer` has just attended one prefill chunk (its queries are in
 *     `kr_chunk.q`, post-RoPE, in backend memory); the policy may keep any subset of that layer's
 *     lists (kr_seq_keep) and refine their rules (kr_kv_list.rule).
 * Decode runs no policy code: forward.c applies every list's rule (kr_list_rule, kr.h), the
 * same on a prefill node, in one process and on a decode node that received the lists.
 * Attention-guided policies score entries with the one scoring primitive (backend op `score`,
 * then kr_pool1d and kr_topk below). The policy modules are policy-*.c, one per family.
 */
#ifndef KR_POLICY_H
#define KR_POLICY_H

#include "backend.h"

typedef struct kr_policy_ops kr_policy_ops;

enum { KR_POLICY_MAX_SPEC = 512 };

/* Parsed, validated and immutable; shared by every sequence that uses it. */
struct kr_policy {
    const kr_policy_ops *ops;
    char spec[KR_POLICY_MAX_SPEC]; /* canonical: name:key=value,... with every default filled */
    int n_layers, n_heads, n_kv_heads, head_dim;
    /* the decode= key: -1 grows; >= 0 keeps the pinned set plus the newest `decode_window`
     * entries; -2 (not given, for families whose default is their own rule: streaming, sage,
     * hsft) the family's list rules */
    int decode_window;
    void *params; /* the family's parameters, owned (freed with free()) */
};

/* What a hook sees of one prefill chunk. Rows of q: the chunk's real prompt tokens, then
 * `n_appended` observer rows (patched chunked eviction, TAKE's probe: never in the final chunk,
 * whose own last rows are the real observers) whose KV entries are the last `n_appended`
 * entries of each list of the layer. A hook keeps those at the end of the lists; the forward
 * drops them after the hook. */
typedef struct kr_chunk {
    const float *q; /* [n_real + n_appended][n_heads][head_dim], backend memory */
    int n_real;
    int n_appended;
    int start; /* prompt index of the first real token */
    int n_prompt;
    int last; /* this chunk ends the prompt */
} kr_chunk;

/* The backend a hook may use for scoring. */
typedef struct kr_evict_env {
    const kr_backend_ops *ops;
    kr_backend *be;
    const float *inv_freq; /* [head_dim/2] RoPE inverse frequencies, for re-rotating keys */
    float *scores; /* host scratch: [n_heads][cap] floats */
    int32_t *idx; /* host scratch: [3][cap], for kr_topk's tmp and result and a flag row */
    int cap; /* >= the longest list of the layer, appended observers included */
} kr_evict_env;

struct kr_policy_ops {
    const char *name;
    /* Allocates p->params with the family's defaults, before any key is parsed. NULL: none. */
    int (*init)(kr_policy *p, char *err);
    /* One key=value of the spec; unknown keys are an error naming the key and listing the
     * family's keys. */
    int (*set)(kr_policy *p, const char *key, const char *value, char *err);
    /* After all keys: fill defaults, check ranges against the model, write the canonical spec. */
    int (*finish)(kr_policy *p, const kr_config *cfg, char *err);
    /* Observer rows appended to every non-final chunk of an n_prompt-token prompt: the last
     * rows of the prompt (NULL: none). */
    int (*appended)(const kr_policy *p, int n_prompt);
    /* Per-sequence state (NULL: none); freed with free() by kr_seq_free. */
    int (*state_init)(const kr_policy *p, kr_seq *s, char *err);
    void (*after_chunk)(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                        int layer);
    /* How many leading layers are final (no hook will change their lists again in this
     * prefill) once `layer`'s after_chunk ran in the prompt's last chunk; 0: none yet. Only
     * families whose hook changes lists of layers below its own need it (TAKE's delayed
     * eviction); it backs kr_prefill_layers' promise (kr.h). NULL: layer + 1. */
    int (*final_layers)(const kr_policy *p, const kr_seq *s, int layer);
    /* 1: after_chunk never removes or reorders an entry, so every entry is final once its chunk
     * is computed (full); kr_prefill_layers then also reports each chunk's end. */
    int keeps_prompt;
    /* Most entries one (layer, KV head) holds at any moment after prefilling n_prompt tokens,
     * while generating n_generate (for reservations): inside a decode step the new token's entry
     * is there before the step's trim, and counts. NULL: the pinned set of a full prompt plus
     * the decode window and the new entry (or everything when decode grows). */
    int (*max_entries)(const kr_policy *p, int n_prompt, int n_generate);
    /* The same per list, into most[n_layers * n_kv_heads] (layer-major), for families whose
     * lists differ (dense and streaming heads): block reservations sum it. NULL: max_entries
     * for every list. */
    void (*list_max_entries)(const kr_policy *p, int n_prompt, int n_generate, int *most);
    /* The decode rule list (layer, kv_head) starts with, into `rule` (preset to the
     * never-trimmed rule): for sequence `s` when kr_seq_set_policy attaches the policy (its lists
     * are empty; per-sequence state is initialised), NULL for the policy's own value (what
     * reservations size for). NULL op: decode_window when >= 0, else never trimmed. */
    void (*list_rule)(const kr_policy *p, const kr_seq *s, int layer, int kv_head, kr_list_rule *rule);
    /* Frees what p->params points to (p->params itself is freed by kr_policy_free). */
    void (*free_params)(kr_policy *p);
};

extern const kr_policy_ops kr_policy_full, kr_policy_streaming, kr_policy_heads, kr_policy_sage;
extern const kr_policy_ops kr_policy_snapkv, kr_policy_pyramidkv, kr_policy_take, kr_policy_hsft;

/* ---- helpers shared by the families (policy.c) */

/* Parses a non-negative integer / a float in [lo, hi] for key `key`. */
int kr_policy_int(const char *key, const char *value, long lo, long hi, int *out, char *err);
int kr_policy_float(const char *key, const char *value, double lo, double hi, float *out, char *err);
/* Appends ",key=value" (or ":key=value" first) to the canonical spec. */
void kr_policy_spec_add(kr_policy *p, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Parses the decode=grow|window:W key shared by every family (returns 1 when `key` was it). */
int kr_policy_decode_key(kr_policy *p, const char *key, const char *value, int *handled, char *err);
/* The rule list (layer, kv_head) of a sequence starts with under p (the list_rule op or its
 * default); s NULL: the policy's own value. */
void kr_policy_list_rule(const kr_policy *p, const kr_seq *s, int layer, int kv_head, kr_list_rule *rule);
/* Gives list (layer, kv_head) of s that rule (p NULL: kr_rule_dense, never trimmed). */
void kr_policy_set_list_rule(const kr_policy *p, kr_seq *s, int layer, int kv_head);
/* Re-assigns positions 0..len-1 to a list's entries and rotates each key by its position change
 * (DESIGN.md section 1, `pos=rel`). */
void kr_policy_rerotate(kr_seq *s, const kr_evict_env *env, int layer, int kv_head);

/* Algorithm 1 of the Lazy Pruning paper: the length a cache of L entries is pruned to, or -1 to
 * leave it alone (policy-streaming.c); the decode rule of every list runs it too. */
int kr_streaming_target(int L, int S, int W, int R, int slack, int max_drop);

/* SnapKV's ops (policy-snapkv.c), which PyramidKV (policy-pyramid.c) shares: init with
 * pyramid = 1 selects kr_pyramid_budget's per-layer schedule. */
int kr_snap_init(kr_policy *p, int pyramid, char *err);
int kr_snap_set(kr_policy *p, const char *key, const char *value, char *err);
int kr_snap_finish(kr_policy *p, const kr_config *cfg, char *err);
int kr_snap_appended(const kr_policy *p, int n_prompt);
void kr_snap_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c, int layer);
int kr_snap_max_entries(const kr_policy *p, int n_prompt, int n_generate);

/* PyramidKV's per-layer allocation (pyramidkv_utils.py, PyramidKVCluster.update_kv): how many
 * of n entries layer `layer` of L keeps, its observation window of W included, for a budget of
 * C per layer (window included, C > W). n <= C: all n; n < 2(C-W): C; otherwise, with
 * beta = 20, min = (C-W)//beta and max = 2(C-W) - min, clamped to max = n - W (then
 * min = 2(C-W) - max), steps = (max-min)//(L-1), layer l keeps max - l*steps + W
 * (policy-pyramid.c). */
int kr_pyramid_budget(int C, int W, int L, int layer, int n);

/* The heads policy's pieces, for tests: the gate TSV (clipped to [0, 1]); which of the n heads
 * (all layers' KV heads, gates[n]) stay dense at `sparsity`: round(sparsity * n) heads with
 * the lowest gates stream, the others are dense (dense[i] = 1; ties: the lower index dense). */
int kr_heads_read_pattern(const char *path, int n_layers, int n_kv_heads, float *gates, char *err);
void kr_heads_choose_dense(const float *gates, int n, float sparsity, uint8_t *dense);

/* The hsft policy's pieces, for tests (policy-hsft.c): the learned-windows file (one positive
 * integer per layer line, tokens); the dense heads of each layer (the n_dense highest gates,
 * ties to the lower head); the windows rescaled by one common factor so the cache at context
 * ctx holds at most floor(budget * full) entries, short by less than n_stream (returns the
 * entries it holds; every window KR_HSFT_ALL when everything fits). */
enum { KR_HSFT_ALL = -1 };
int kr_hsft_read_windows(const char *path, int n_layers, int *windows, char *err);
void kr_hsft_choose_dense(const float *gates, int n_layers, int n_kv_heads, int n_dense, uint8_t *dense);
int64_t kr_hsft_rescale(const int *learned, int n_layers, int n_dense, int n_stream, int sink, double budget,
                        int ctx, int *windows);
/* TAKE's pieces, for tests (policy-take.c): eq. 9 over n floats (first: acc = probe); eq. 8's
 * budget of a layer in a chunk; the accumulated probe of a scored layer of a sequence
 * ([min(p, n_prompt)][n_heads][head_dim], NULL for layers that do not score). */
void kr_take_accumulate(float *acc, const float *probe, size_t n, float alpha, int first);
int kr_take_budget(const kr_policy *p, int layer, int last);
const float *kr_take_probe(const kr_seq *s, int layer);

/* ---- the scoring primitive (score.c) */

/* scores[j] (j < n) smoothed by a 1-D pooling of odd `kernel` with zero padding of kernel/2
 * on each side (avg divides by kernel, as torch's avg_pool1d with count_include_pad) or
 * -inf padding (max); kernel 1 copies. out may not alias in. */
void kr_pool1d(const float *in, int n, int kernel, int use_max, float *out);
/* The k highest of scores[0..n) (ties: lower index first), written ascending to idx;
 * returns min(k, n). Scratch: tmp[n]. */
int kr_topk(const float *scores, int n, int k, int32_t *tmp, int32_t *idx);


#endif
