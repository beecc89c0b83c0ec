/*
 * policy-sage.c - SAGE-KV (the paper's section 3 and appendix settings): after prefill, per
 * layer and KV head, the cache of N entries is split into sinks [0, S), the middle, the recent
 * window [N-1-R, N-1) and the last token N-1. From the middle each query head of the GQA group
 * selects its top k entries by the last token's attention; the union over the group is kept
 * with the sinks, the recent window and the last token. S = B/4 and k = B/(2G) as the paper
 * sets them, R = B - S - G*k (B/4 when G divides B/2; the paper's Qwen2.5 example gives 2560
 * for G = 7), so the reduced cache holds at most S + G*k + R + 1 = B + 1 entries.
 * Decode: sinks and selected entries are pinned; a new token joins the recent window and, once
 * the cache holds B + 1 entries, the oldest window entry leaves (the paper's step 4): each
 * list's decode rule is its pinned set plus a window of B + 1 minus its pinned count. When the
 * G heads' selections overlap, the unused part of the budget lets the window hold more than
 * R + 1; a prompt of at most B entries is kept whole and the window grows until the cache is
 * full. Chunks before the last are not evicted (SAGE is post-fill). decode=grow / window:W
 * replace this rule.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <stdlib.h>
#include <string.h>

typedef struct sage_params {
    int budget;
    int sink, k, recent; /* derived */
} sage_params;

static int sage_init(kr_policy *p, char *err)
{
    sage_params *sp = calloc(1, sizeof *sp);
    if (!sp) return kr_errf(err, "policy: out of memory");
    sp->budget = 8192; /* the paper's setting for Llama 3.1 8B */
    p->params = sp;
    return KR_OK;
}

static int sage_set(kr_policy *p, const char *key, const char *value, char *err)
{
    sage_params *sp = p->params;
    int handled;
    if (kr_policy_decode_key(p, key, value, &handled, err) != KR_OK) return -1;
    if (handled) return KR_OK;
    if (!strcmp(key, "budget")) return kr_policy_int(key, value, 1, 1 << 30, &sp->budget, err);
    return kr_errf(err, "policy: sage has no key '%s' (keys: budget, decode)", key);
}

static int sage_finish(kr_policy *p, const kr_config *cfg, char *err)
{
    sage_params *sp = p->params;
    const int group = cfg->n_heads / cfg->n_kv_heads;
    sp->sink = sp->budget / 4;
    sp->k = sp->budget / (2 * group);
    sp->recent = sp->budget - sp->sink - group * sp->k;
    if (sp->k < 1 || sp->recent < 0)
        return kr_errf(err, "policy: sage budget=%d is too small for %d query heads per KV head "
                       "(needs k = B/(2G) >= 1)", sp->budget, group);
    kr_policy_spec_add(p, "budget", "%d", sp->budget);
    return KR_OK;
}

/* The cache is capped at B + 1 entries: the window is what the list's pinned set leaves of it
 * (without a sequence: R + 1, the window when the G heads' selections do not overlap).
 * decode=window:W or grow replace the cap. */
static void sage_list_rule(const kr_policy *p, const kr_seq *s, int layer, int kv_head, kr_list_rule *rule)
{
    const sage_params *sp = p->params;
    if (p->decode_window != -2) {
        rule->window = p->decode_window;
        return;
    }
    if (!s) {
        rule->window = sp->recent + 1;
        return;
    }
    int pinned = s->lists[layer * s->n_kv_heads + kv_head].pinned;
    rule->window = sp->budget + 1 - pinned > 0 ? sp->budget + 1 - pinned : 0;
}

static void sage_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                             int layer)
{
    const sage_params *sp = p->params;
    if (!c->last) return;
    const int group = p->n_heads / p->n_kv_heads;
    /* the last token's query over every entry, per query head */
    const float *q_last = c->q + (size_t)(c->n_real - 1) * p->n_heads * p->head_dim;
    env->ops->score(env->be, s, layer, q_last, 1, p->n_heads, 1, env->scores, env->cap);
    for (int g = 0; g < s->n_kv_heads; g++) {
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        const int n = l->len, window = sp->recent + 1;
        if (n <= sp->budget) { /* nothing to evict; the sinks are pinned */
            kr_seq_pin(s, layer, g, sp->sink);
            kr_policy_set_list_rule(p, s, layer, g);
            continue;
        }
        const int mid0 = sp->sink, mid1 = n - window; /* middle [mid0, mid1) */
        int32_t *top = env->idx + env->cap;
        uint8_t *chosen = (uint8_t *)(env->idx + 2 * (size_t)env->cap);
        memset(chosen, 0, (size_t)n);
        for (int h = 0; h < group; h++) {
            const float *sc = env->scores + (size_t)(g * group + h) * env->cap;
            int got = kr_topk(sc + mid0, mid1 - mid0, sp->k, env->idx, top);
            for (int i = 0; i < got; i++) chosen[mid0 + top[i]] = 1;
        }
        int m = 0, pinned;
        for (int i = 0; i < mid0; i++) env->idx[m++] = i;
        for (int i = mid0; i < mid1; i++)
            if (chosen[i]) env->idx[m++] = i;
        pinned = m;
        for (int i = mid1; i < n; i++) env->idx[m++] = i;
        kr_seq_keep(s, layer, g, env->idx, m, pinned);
        kr_policy_set_list_rule(p, s, layer, g);
    }
}

/* Own rule: between steps the cache holds at most B + 1 entries; inside a step the new token's
 * entry may make it B + 2 until the trim. */
static int sage_max_entries(const kr_policy *p, int n_prompt, int n_generate)
{
    const sage_params *sp = p->params;
    int after = n_prompt < sp->budget + 1 ? n_prompt : sp->budget + 1;
    if (n_generate == 0) return after;
    if (p->decode_window == -1) return after + n_generate;
    if (p->decode_window >= 0) { /* pinned (at most S + G k = B - R) + W, or the first step's transient */
        int pinned = n_prompt < sp->budget - sp->recent ? n_prompt : sp->budget - sp->recent;
        int kept = pinned + p->decode_window + 1;
        return kept > after + 1 ? kept : after + 1;
    }
    int total = n_prompt + n_generate;
    return total < sp->budget + 2 ? total : sp->budget + 2;
}

const kr_policy_ops kr_policy_sage = {
    .name = "sage",
    .init = sage_init,
    .set = sage_set,
    .finish = sage_finish,
    .after_chunk = sage_after_chunk,
    .max_entries = sage_max_entries,
    .list_rule = sage_list_rule,
};
