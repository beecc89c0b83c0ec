/*
 * policy-snapkv.c - SnapKV adapted to chunked prefill (*Cache Me If You Can* §3):
 * after every prefill chunk, per (layer, KV head), the attention of the observer queries over
 * the cached keys (summed over the observers, averaged over the GQA group's query heads: one
 * kept set per KV head, the paper's GQA fix) is pooled with a 1-D kernel and the top entries
 * are kept, pinned, together with the observers' own entries (the observation window).
 *
 *   mode=naive    the observers are the chunk's last k real tokens;
 *   mode=patched  the prompt's last k tokens are appended to every non-final chunk as
 *                 observers (their KV is dropped by the forward after the hook); in the final
 *                 chunk the observers are its own last k tokens.
 *   ratio=p       only the chunk's new entries compete: the chunk keeps c = round((1-p) n)
 *                 selected entries (n = its real tokens, halves round up) plus the real
 *                 observers' window, at most n: naive adds min(c + k, n) per chunk (the closed
 *                 form of PruLong's evaluation); older entries are untouched.
 *   budget=B      everything cached is re-scored and each list keeps B real entries, the
 *                 window included (SnapKV's max_capacity_prompt includes its window).
 * PyramidKV (policy-pyramid.c) runs this same code with a per-layer budget schedule; the ops
 * below are shared with it, and `pyramid` in the parameters selects the schedule.
 *
 * Not here: per-query-head selection (the replication the paper removes), merging of evicted
 * entries, and SnapKV's softmax over the chunk's keys only (PruLong's reference compresses each
 * chunk alone); we score with the observers' true attention over everything cached (backend
 * op `score`), which only rescales each observer's row. Defaults and sources: docs/policies.md.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct snap_params {
    int pyramid; /* 0 snapkv, 1 pyramidkv (kr_pyramid_budget's schedule) */
    int patched;
    int obs; /* k: observers and window */
    int kernel; /* odd pooling kernel */
    int use_max;
    double ratio; /* < 0: not given */
    int budget; /* < 0: not given */
} snap_params;

/* Defaults: window 64, kernel 5, avgpool are SnapKVCluster's and PyramidKVCluster's constructor
 * defaults in both reference repositories (FasterDecoding/SnapKV snapkv_utils.py,
 * Zefan-Cai/PyramidKV pyramidkv_utils.py); 64 is also the paper's "last 64 input tokens"
 * (Table 5: window and patch amount 64). Patched is the paper's recommended variant. */
int kr_snap_init(kr_policy *p, int pyramid, char *err)
{
    snap_params *sp = calloc(1, sizeof *sp);
    if (!sp) return kr_errf(err, "policy: out of memory");
    sp->pyramid = pyramid;
    sp->patched = 1;
    sp->obs = 64;
    sp->kernel = 5;
    sp->ratio = -1.0;
    sp->budget = -1;
    p->params = sp;
    return KR_OK;
}

static int snapkv_init(kr_policy *p, char *err)
{
    return kr_snap_init(p, 0, err);
}

int kr_snap_set(kr_policy *p, const char *key, const char *value, char *err)
{
    snap_params *sp = p->params;
    int handled;
    if (kr_policy_decode_key(p, key, value, &handled, err) != KR_OK) return -1;
    if (handled) return KR_OK;
    if (!strcmp(key, "mode")) {
        if (!strcmp(value, "naive")) sp->patched = 0;
        else if (!strcmp(value, "patched")) sp->patched = 1;
        else return kr_errf(err, "policy: mode=%s must be naive or patched", value);
        return KR_OK;
    }
    if (!strcmp(key, "obs")) return kr_policy_int(key, value, 1, 1 << 20, &sp->obs, err);
    if (!strcmp(key, "kernel")) {
        if (kr_policy_int(key, value, 1, 1 << 20, &sp->kernel, err) != KR_OK) return -1;
        if (sp->kernel % 2 == 0)
            return kr_errf(err, "policy: kernel=%d must be odd (the pooling is centred, padding kernel/2 "
                           "on each side)", sp->kernel);
        return KR_OK;
    }
    if (!strcmp(key, "pool")) {
        if (!strcmp(value, "avg")) sp->use_max = 0;
        else if (!strcmp(value, "max")) sp->use_max = 1;
        else return kr_errf(err, "policy: pool=%s must be avg or max", value);
        return KR_OK;
    }
    if (!strcmp(key, "ratio")) {
        float f;
        if (kr_policy_float(key, value, 0.0, 1.0, &f, err) != KR_OK) return -1;
        sp->ratio = strtod(value, NULL); /* the exact double, so round((1-p) n) is not off by float error */
        return KR_OK;
    }
    if (!strcmp(key, "budget")) return kr_policy_int(key, value, 1, 1 << 30, &sp->budget, err);
    return kr_errf(err, "policy: %s has no key '%s' (keys: mode, obs, kernel, pool, ratio, budget, decode)",
                   p->ops->name, key);
}

int kr_snap_finish(kr_policy *p, const kr_config *cfg, char *err)
{
    snap_params *sp = p->params;
    const char *name = p->ops->name;
    if (sp->ratio >= 0 && sp->budget >= 0)
        return kr_errf(err, "policy: %s takes ratio=p or budget=B, not both", name);
    if (sp->ratio < 0 && sp->budget < 0)
        return kr_errf(err, "policy: %s needs ratio=p (evict fraction p of each chunk) or budget=B "
                       "(entries kept per layer)", name);
    if (sp->budget >= 0 && sp->budget <= sp->obs)
        return kr_errf(err, "policy: %s budget=%d must exceed obs=%d (the budget includes the "
                       "observation window)", name, sp->budget, sp->obs);
    kr_policy_spec_add(p, "mode", "%s", sp->patched ? "patched" : "naive");
    kr_policy_spec_add(p, "obs", "%d", sp->obs);
    kr_policy_spec_add(p, "kernel", "%d", sp->kernel);
    kr_policy_spec_add(p, "pool", "%s", sp->use_max ? "max" : "avg");
    if (sp->ratio >= 0) kr_policy_spec_add(p, "ratio", "%g", sp->ratio);
    else kr_policy_spec_add(p, "budget", "%d", sp->budget);
    if (p->decode_window == -2) p->decode_window = -1; /* post-fill methods: decode grows */
    return KR_OK;
}

int kr_snap_appended(const kr_policy *p, int n_prompt)
{
    const snap_params *sp = p->params;
    return sp->patched ? sp->obs : 0;
}

/* Round half up of (1 - p) n: the entries a chunk of n tokens keeps besides its window. */
static int ratio_keep(double ratio, int n)
{
    return (int)floor((1.0 - ratio) * n + 0.5);
}

void kr_snap_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                             int layer)
{
    const snap_params *sp = p->params;
    const int hd = p->head_dim, nh = p->n_heads;
    /* the observers: appended rows (patched, non-final chunk) or the chunk's last real rows */
    const int appended = c->n_appended > 0;
    const int n_obs = appended ? c->n_appended : (sp->obs < c->n_real ? sp->obs : c->n_real);
    const float *q_obs = c->q + (size_t)(appended ? c->n_real : c->n_real - n_obs) * nh * hd;
    const int real_window = appended ? 0 : n_obs; /* window entries that are prompt tokens */
    const int seen = c->start + c->n_real; /* prompt tokens fed so far */
    env->ops->score(env->be, s, layer, q_obs, n_obs, nh, 0, env->scores, (size_t)env->cap);

    int32_t *keep = env->idx, *top = env->idx + env->cap;
    float *pooled = (float *)(env->idx + 2 * (size_t)env->cap); /* scratch row, reused as floats */
    for (int g = 0; g < s->n_kv_heads; g++) {
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        const int len = l->len, win0 = len - n_obs; /* the window is [win0, len) */
        const int real = len - c->n_appended; /* prompt entries in the list */
        int cand0, want;
        if (sp->ratio >= 0) { /* the chunk's new entries before the window compete */
            cand0 = real - c->n_real;
            int sel = ratio_keep(sp->ratio, c->n_real);
            if (sp->pyramid) /* PruLong: capacity c + k over the chunk's keys, window included */
                sel = kr_pyramid_budget(sel + sp->obs, sp->obs, p->n_layers, layer, win0 - cand0 + n_obs) - n_obs;
            want = sel;
        } else { /* everything cached competes for the layer's budget */
            cand0 = 0;
            int total = sp->pyramid ? kr_pyramid_budget(sp->budget, sp->obs, p->n_layers, layer, seen)
                                    : sp->budget;
            want = total - real_window;
        }
        const int n_cand = win0 - cand0;
        if (want < 0) want = 0;
        const float *sc = env->scores + (size_t)g * env->cap + cand0;
        kr_pool1d(sc, n_cand, sp->kernel, sp->use_max, pooled);
        int got = kr_topk(pooled, n_cand, want, keep, top);
        int m = 0;
        for (int i = 0; i < cand0; i++) keep[m++] = i; /* older entries (ratio): untouched */
        for (int i = 0; i < got; i++) keep[m++] = cand0 + top[i];
        for (int i = win0; i < len; i++) keep[m++] = i; /* the window, appended observers too */
        kr_seq_keep(s, layer, g, keep, m, m);
    }
}

/* Reservation bound after prefill (every entry kept is pinned). ratio: the whole prompt (a
 * fraction of every chunk, unbounded by a constant); budget: B, or PyramidKV's first layer. */
int kr_snap_max_entries(const kr_policy *p, int n_prompt, int n_generate)
{
    const snap_params *sp = p->params;
    int after = n_prompt;
    if (sp->budget >= 0) {
        /* the pyramid's first layer is largest; its budget grows with the prompt seen so far */
        int b = sp->pyramid ? kr_pyramid_budget(sp->budget, sp->obs, p->n_layers, 0, n_prompt) : sp->budget;
        after = b < n_prompt ? b : n_prompt;
    }
    if (p->decode_window < 0) return after + n_generate;
    int window = p->decode_window + 1 < n_generate ? p->decode_window + 1 : n_generate;
    return after + window;
}

const kr_policy_ops kr_policy_snapkv = {
    .name = "snapkv",
    .init = snapkv_init,
    .set = kr_snap_set,
    .finish = kr_snap_finish,
    .appended = kr_snap_appended,
    .after_chunk = kr_snap_after_chunk,
    .max_entries = kr_snap_max_entries,
};
