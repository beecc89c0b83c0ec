/*
 * policy-take.c - TAKE, task-aware chunked KV eviction (the TAKE paper, section 4):
 * `take:budget=B,warmup_budget=Bw,warmup_layers=W,probe=p,alpha=a,kernel=r,decode=grow|window:N`.
 *
 * - Probe (4.2): the prompt's last p tokens. They are appended to every non-final chunk at their
 *   true positions (the `appended` op; the forward drops their KV after the hook: "probe tokens do
 *   not contribute directly to the KV cache"); in the final chunk they are the chunk's own last
 *   rows. Per scored layer their post-RoPE queries are accumulated over the chunks by eq. 9,
 *   Q_i = a*Q_{i-1} + (1-a)*Q_i^probe. Eq. 9 leaves Q_{-1} undefined; we read the first chunk as
 *   Q_0 = Q_0^probe (starting from zero would scale the first chunk's queries by 1-a, which
 *   changes the softmax temperature, not the mix).
 * - Scores (eqs. 10-12): softmax(Q K^T / sqrt(d)) averaged over the probe rows, average-pooled
 *   with kernel r over the list, top-k. In a non-final chunk the probe comes after every cached
 *   entry and eq. 10's softmax runs over the Z + k_{i-1} real entries only (backend op
 *   score_past hides the probe's own keys); in the final chunk the probe rows are real tokens,
 *   each sees the entries up to itself (the causal `score` op), and the probe's own entries
 *   compete for the budget like any other: eq. 12 takes the top-k of all Z + k_{i-1} entries and,
 *   unlike SnapKV, reserves no observation window.
 * - GQA: the paper scores per attention head ("no aggregation across the head dimension"),
 *   which with GQA means per query head over repeated keys. DESIGN.md section 1 keeps one set per
 *   KV head, never replicated, so the attention is averaged over the query heads of each group
 *   (per KV head nothing is aggregated; with G = 1 this is exactly the paper).
 * - Budgets (eq. 8): before the last chunk layers < W keep Bw, the others B; in the last chunk
 *   every layer keeps B. Delayed eviction (4.3, eq. 6): layers < W - 1 are not touched by their
 *   own hook; layer W - 1 scores, picks its top-k and the same indices prune layers 0..W-1 (their
 *   lists hold the same positions: they are always pruned together). Layers >= W pick their own.
 *   Only layers >= W - 1 score, so only they hold an accumulated probe (the paper's appendix B
 *   counts scoring FLOPs on those layers only).
 * - Kept entries become the pinned set; decode grows by default, as in the paper, which evicts
 *   during prefill only.
 *
 * Limits: when the final chunk is shorter than p, only its own rows observe in that chunk (the
 * accumulated rows of probe tokens already cached are not used there). The accumulated probe is
 * host memory and score ops read it as such: a GPU backend needs a device copy.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

typedef struct take_params {
    int budget; /* B */
    int warmup_budget; /* Bw; -1 until finish(): 20 * B */
    int warmup_layers; /* W; -1 until finish(): half the layers */
    int probe; /* p */
    float alpha; /* eq. 9's EMA factor */
    int kernel; /* r, odd */
} take_params;

/* Per sequence, one allocation (freed with free() by kr_seq_free). */
typedef struct take_state {
    int first_layer; /* the lowest layer that scores: max(W - 1, 0) */
    int probe; /* p: rows per accumulated probe */
    size_t row; /* floats per probe row: n_heads * head_dim */
    /* acc [n_layers - first_layer][p][n_heads][head_dim]: the accumulated probe of each scored
     * layer, row r for prompt token n - min(p, n) + r; then scratch [p][n_heads][head_dim] for
     * this chunk's probe queries copied out of backend memory */
    float data[];
} take_state;

/* The paper's main setting: B = 512 (NIAH figure 5, the ablations and appendix B), Bw = 10240
 * with it (appendix B; "decided by context length" in 5.1, so we keep appendix B's ratio 20),
 * W = half the layers (5.1), alpha = 0.2 (5.1, LongBench; 0.32 for NIAH). The paper gives no
 * probe length or pooling kernel; SnapKV's reference code observes with a window of 32
 * (init_snapkv) and average-pools with kernel 5. */
static int take_init(kr_policy *p, char *err)
{
    take_params *tp = calloc(1, sizeof *tp);
    if (!tp) return kr_errf(err, "policy: out of memory");
    tp->budget = 512;
    tp->warmup_budget = -1;
    tp->warmup_layers = -1;
    tp->probe = 32;
    tp->alpha = 0.2f;
    tp->kernel = 5;
    p->params = tp;
    return KR_OK;
}

static int take_set(kr_policy *p, const char *key, const char *value, char *err)
{
    take_params *tp = p->params;
    int handled;
    if (kr_policy_decode_key(p, key, value, &handled, err) != KR_OK) return -1;
    if (handled) return KR_OK;
    if (!strcmp(key, "budget")) return kr_policy_int(key, value, 1, 1 << 30, &tp->budget, err);
    if (!strcmp(key, "warmup_budget")) return kr_policy_int(key, value, 1, 1 << 30, &tp->warmup_budget, err);
    if (!strcmp(key, "warmup_layers")) return kr_policy_int(key, value, 0, 1 << 20, &tp->warmup_layers, err);
    if (!strcmp(key, "probe")) return kr_policy_int(key, value, 1, 1 << 16, &tp->probe, err);
    if (!strcmp(key, "alpha")) return kr_policy_float(key, value, 0.0, 1.0, &tp->alpha, err);
    if (!strcmp(key, "kernel")) return kr_policy_int(key, value, 1, 1 << 16, &tp->kernel, err);
    return kr_errf(err, "policy: take has no key '%s' (keys: budget, warmup_budget, warmup_layers, "
                   "probe, alpha, kernel, decode)", key);
}

static int take_finish(kr_policy *p, const kr_config *cfg, char *err)
{
    take_params *tp = p->params;
    if (tp->warmup_layers < 0) tp->warmup_layers = cfg->n_layers / 2;
    if (tp->warmup_layers > cfg->n_layers)
        return kr_errf(err, "policy: take warmup_layers=%d exceeds the model's %d layers",
                       tp->warmup_layers, cfg->n_layers);
    if (tp->warmup_budget < 0) {
        long bw = 20L * tp->budget;
        tp->warmup_budget = bw > (1L << 30) ? 1 << 30 : (int)bw;
    }
    if (tp->warmup_budget < tp->budget)
        return kr_errf(err, "policy: take warmup_budget=%d is below budget=%d (the warm-up budget "
                       "is the relaxed one: use warmup_budget >= budget)", tp->warmup_budget, tp->budget);
    if (tp->kernel % 2 == 0)
        return kr_errf(err, "policy: take kernel=%d must be odd (the pooling is centred)", tp->kernel);
    kr_policy_spec_add(p, "budget", "%d", tp->budget);
    kr_policy_spec_add(p, "warmup_budget", "%d", tp->warmup_budget);
    kr_policy_spec_add(p, "warmup_layers", "%d", tp->warmup_layers);
    kr_policy_spec_add(p, "probe", "%d", tp->probe);
    kr_policy_spec_add(p, "alpha", "%g", tp->alpha);
    kr_policy_spec_add(p, "kernel", "%d", tp->kernel);
    if (p->decode_window == -2) p->decode_window = -1;
    return KR_OK;
}

static int take_appended(const kr_policy *p, int n_prompt)
{
    const take_params *tp = p->params;
    return tp->probe < n_prompt ? tp->probe : n_prompt;
}

static int take_state_init(const kr_policy *p, kr_seq *s, char *err)
{
    const take_params *tp = p->params;
    const int first = tp->warmup_layers > 0 ? tp->warmup_layers - 1 : 0;
    const size_t row = (size_t)p->n_heads * p->head_dim;
    const size_t floats = (size_t)(p->n_layers - first + 1) * tp->probe * row;
    take_state *st = malloc(sizeof *st + floats * sizeof(float));
    if (!st) return kr_errf(err, "policy: out of memory for take's probe state (%zu floats)", floats);
    st->first_layer = first;
    st->probe = tp->probe;
    st->row = row;
    s->policy_state = st;
    return KR_OK;
}

void kr_take_accumulate(float *acc, const float *probe, size_t n, float alpha, int first)
{
    if (first) {
        memcpy(acc, probe, n * sizeof(float));
        return;
    }
    for (size_t i = 0; i < n; i++) acc[i] = alpha * acc[i] + (1.0f - alpha) * probe[i];
}

int kr_take_budget(const kr_policy *p, int layer, int last)
{
    const take_params *tp = p->params;
    return layer <= tp->warmup_layers - 1 && !last ? tp->warmup_budget : tp->budget;
}

const float *kr_take_probe(const kr_seq *s, int layer)
{
    const take_state *st = s->policy_state;
    if (!st || layer < st->first_layer || layer >= s->n_layers) return NULL;
    return st->data + (size_t)(layer - st->first_layer) * st->probe * st->row;
}

#ifndef NDEBUG
/* the first n entries of two lists of one KV head hold the same positions */
static int same_positions(kr_seq *s, int la, int lb, int g, int n)
{
    const kr_kv_pool *pool = s->pool;
    const kr_kv_list *a = kr_seq_list(s, la, g), *b = kr_seq_list(s, lb, g);
    for (int e = 0; e < n; e++)
        if (*kr_kv_list_pos(pool, a, e) != *kr_kv_list_pos(pool, b, e))
            return 0;
    return 1;
}
#endif

static void take_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                             int layer)
{
    const take_params *tp = p->params;
    take_state *st = s->policy_state;
    const int W = tp->warmup_layers;
    if (layer < st->first_layer) return; /* delayed: layer W - 1 prunes this one */
    const int H = p->n_heads, n_app = c->n_appended, n = c->n_prompt;
    const int p_eff = tp->probe < n ? tp->probe : n; /* probe rows of this prompt */
    /* which probe rows this chunk has (r0..p_eff-1) and where their queries are */
    int r0, rows;
    const float *q_src;
    if (!c->last) {
        rows = n_app;
        r0 = p_eff - n_app;
        q_src = c->q + (size_t)c->n_real * st->row;
    } else {
        int first_tok = c->start > n - p_eff ? c->start : n - p_eff;
        r0 = first_tok - (n - p_eff);
        rows = n - first_tok;
        q_src = c->q + (size_t)(first_tok - c->start) * st->row;
    }
    float *acc = st->data + (size_t)(layer - st->first_layer) * st->probe * st->row;
    float *scratch = st->data + (size_t)(s->n_layers - st->first_layer) * st->probe * st->row;
    const size_t nf = (size_t)rows * st->row;
    env->ops->to_host(env->be, q_src, nf, scratch);
    /* eq. 9, restarted by each prompt's first chunk */
    kr_take_accumulate(acc + (size_t)r0 * st->row, scratch, nf, tp->alpha, c->start == 0);

    const int k = kr_take_budget(p, layer, c->last);
    const int own = layer >= W; /* layer W - 1 (and 0 when W = 0) prunes for the warm-up layers too */
    int evict = 0;
    for (int g = 0; g < s->n_kv_heads; g++) evict |= kr_seq_list(s, layer, g)->len - n_app > k;
    if (evict) {
        const float *q_acc = acc + (size_t)r0 * st->row;
        if (c->last) env->ops->score(env->be, s, layer, q_acc, rows, H, 0, env->scores, (size_t)env->cap);
        else env->ops->score_past(env->be, s, layer, q_acc, rows, H, 0, n_app, env->scores, (size_t)env->cap);
    }
    for (int g = 0; g < s->n_kv_heads; g++) {
        const int cand = kr_seq_list(s, layer, g)->len - n_app; /* the probe's own keys never compete */
        int32_t *keep = env->idx + env->cap;
        int kept;
        if (cand > k) {
            float *sc = env->scores + (size_t)g * env->cap;
            float *pooled = (float *)(env->idx + 2 * (size_t)env->cap);
            for (int e = 0; e < cand; e++) sc[e] /= (float)rows; /* eq. 11: the mean over probes */
            kr_pool1d(sc, cand, tp->kernel, 0, pooled);
            kept = kr_topk(pooled, cand, k, env->idx, keep);
        } else {
            for (int e = 0; e < cand; e++) keep[e] = e;
            kept = cand;
        }
        if (!own)
            for (int l = 0; l < layer; l++) { /* eq. 6: the warm-up layers take layer W - 1's indices */
                assert(kr_seq_list(s, l, g)->len == cand && same_positions(s, l, layer, g, cand));
                kr_seq_keep(s, l, g, keep, kept, kept);
            }
        /* this layer's appended probe entries stay last, for the forward to drop */
        for (int i = 0; i < n_app; i++) keep[kept + i] = cand + i;
        kr_seq_keep(s, layer, g, keep, kept + n_app, kept);
    }
}

/* Layers below the first scoring one keep whatever that layer's hook picks (eq. 6), so nothing
 * is final until it ran; from then on each layer's hook touches only its own lists. */
static int take_final_layers(const kr_policy *p, const kr_seq *s, int layer)
{
    const take_state *st = s->policy_state;
    return layer < st->first_layer ? 0 : layer + 1;
}

/* After prefill every list holds min(B, n_prompt) pinned entries; decode adds to them. */
static int take_max_entries(const kr_policy *p, int n_prompt, int n_generate)
{
    const take_params *tp = p->params;
    const int kept = n_prompt < tp->budget ? n_prompt : tp->budget;
    if (p->decode_window < 0) return kept + n_generate;
    return kept + (p->decode_window + 1 < n_generate ? p->decode_window + 1 : n_generate);
}

const kr_policy_ops kr_policy_take = {
    .name = "take",
    .init = take_init,
    .set = take_set,
    .finish = take_finish,
    .appended = take_appended,
    .state_init = take_state_init,
    .after_chunk = take_after_chunk,
    .final_layers = take_final_layers,
    .max_entries = take_max_entries,
};
