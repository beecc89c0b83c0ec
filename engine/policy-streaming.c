/*
 * policy-streaming.c - StreamingLLM with the Lazy Pruning paper's lazy pruning, slack and
 * max-drop (`streaming`). The head-level variant (DuoAttention / PruLong) is policy-heads.c.
 *
 * Lazy Pruning, Algorithm 1: C = S + W, H = C + slack; with cache length L, prune
 * only when lazy R > 0, L > C and L - C >= R; the target is C when max_drop = 0, else
 * min(max(L - max_drop, C), H); keep the first S and the newest target - S. It runs after every
 * prefill chunk here, and every list carries it as its decode rule (S sinks, W, R, slack,
 * max_drop: kr_list_rule), which the forward applies after every decode step. pos=rel re-assigns positions 0..L-1 and re-rotates keys
 * (the paper's eq. 4), so generation can run past the model's maximum position.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct streaming_params {
    int sink, window, lazy, slack, max_drop, rel;
    int decode_grows; /* decode=grow: Algorithm 1 runs during prefill only */
} streaming_params;

/* StreamingLLM's reference run: 4 sinks and a cache capped at 2048 (the Lazy Pruning paper's
 * worked example uses the same S and W); lazy 1 prunes whenever the cap is passed, which is
 * plain StreamingLLM; slack and max_drop off; absolute positions (DESIGN.md section 1). */
static int streaming_init(kr_policy *p, char *err)
{
    streaming_params *sp = calloc(1, sizeof *sp);
    if (!sp) return kr_errf(err, "policy: out of memory");
    sp->sink = 4;
    sp->window = 2044;
    sp->lazy = 1;
    p->params = sp;
    return KR_OK;
}

static int streaming_set(kr_policy *p, const char *key, const char *value, char *err)
{
    streaming_params *sp = p->params;
    int handled;
    if (kr_policy_decode_key(p, key, value, &handled, err) != KR_OK) return -1;
    if (handled) return KR_OK;
    if (!strcmp(key, "sink")) return kr_policy_int(key, value, 0, 1 << 30, &sp->sink, err);
    if (!strcmp(key, "window")) return kr_policy_int(key, value, 0, 1 << 30, &sp->window, err);
    if (!strcmp(key, "lazy")) return kr_policy_int(key, value, 0, 1 << 30, &sp->lazy, err);
    if (!strcmp(key, "slack")) return kr_policy_int(key, value, 0, 1 << 30, &sp->slack, err);
    if (!strcmp(key, "max_drop")) return kr_policy_int(key, value, 0, 1 << 30, &sp->max_drop, err);
    if (!strcmp(key, "pos")) {
        if (!strcmp(value, "abs")) sp->rel = 0;
        else if (!strcmp(value, "rel")) sp->rel = 1;
        else return kr_errf(err, "policy: pos=%s must be abs or rel", value);
        return KR_OK;
    }
    return kr_errf(err, "policy: streaming has no key '%s' (keys: sink, window, lazy, slack, "
                   "max_drop, pos, decode)", key);
}

static int streaming_finish(kr_policy *p, const kr_config *cfg, char *err)
{
    streaming_params *sp = p->params;
    if (sp->sink + sp->window == 0) return kr_errf(err, "policy: streaming needs sink + window > 0");
    kr_policy_spec_add(p, "sink", "%d", sp->sink);
    kr_policy_spec_add(p, "window", "%d", sp->window);
    kr_policy_spec_add(p, "lazy", "%d", sp->lazy);
    kr_policy_spec_add(p, "slack", "%d", sp->slack);
    kr_policy_spec_add(p, "max_drop", "%d", sp->max_drop);
    kr_policy_spec_add(p, "pos", "%s", sp->rel ? "rel" : "abs");
    /* decode runs Algorithm 1 too; decode=grow turns it off, and a different decode window is
     * refused rather than half-applied */
    if (p->decode_window >= 0)
        return kr_errf(err, "policy: streaming prunes decode with its own sink and window "
                       "(decode=grow stops that; decode=window:W is not for streaming)");
    sp->decode_grows = p->decode_window == -1;
    return KR_OK;
}

int kr_streaming_target(int L, int S, int W, int R, int slack, int max_drop)
{
    const int C = S + W, H = C + slack;
    if (R == 0 || L <= C || L - C < R) return -1;
    if (max_drop == 0) return C;
    int t = L - max_drop > C ? L - max_drop : C;
    return t < H ? t : H;
}

static void streaming_prune(const streaming_params *sp, kr_seq *s, const kr_evict_env *env, int layer)
{
    for (int g = 0; g < s->n_kv_heads; g++) {
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        int target = kr_streaming_target(l->len, sp->sink, sp->window, sp->lazy, sp->slack, sp->max_drop);
        if (target >= 0) kr_seq_keep_ends(s, layer, g, sp->sink, target - sp->sink);
        else kr_seq_pin(s, layer, g, sp->sink);
        if (sp->rel) kr_policy_rerotate(s, env, layer, g);
    }
    /* positions restart after the cache (every list of a streaming sequence has one length) */
    if (sp->rel && layer == s->n_layers - 1) s->next_pos = kr_seq_list(s, layer, 0)->len;
}

static void streaming_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env,
                                  const kr_chunk *c, int layer)
{
    streaming_prune(p->params, s, env, layer);
}

/* Decode runs Algorithm 1 as every list's rule; decode=grow leaves the lists alone. lazy 0
 * never prunes, so the window is reported as never trimmed (the sinks stay pinned). */
static void streaming_list_rule(const kr_policy *p, const kr_seq *s, int layer, int kv_head, kr_list_rule *rule)
{
    const streaming_params *sp = p->params;
    if (sp->decode_grows) return;
    *rule = (kr_list_rule){.sink = sp->sink, .window = sp->lazy == 0 ? -1 : sp->window, .lazy = sp->lazy,
                           .slack = sp->slack, .max_drop = sp->max_drop, .rel = sp->rel};
}

/* Between steps a list never holds more than C + R entries (pruning triggers at L - C >= R and
 * never keeps more than it had); without pruning it grows. */
/* The longest a list gets. A prune fires once it is R past C = S + W, so one entry at a time
 * it peaks at C + R. But a prefill chunk appends many at once, and with max_drop > 0 the prune
 * cuts to min(max(L - max_drop, C), H): a chunk can leave H = C + slack entries, which the next
 * token tops by one before it is pruned again. So the peak is C + max(R, slack + 1) then
 * (64-bit: each parameter may be up to 2^30). */
static int streaming_max_entries(const kr_policy *p, int n_prompt, int n_generate)
{
    const streaming_params *sp = p->params;
    int64_t total = (int64_t)n_prompt + n_generate;
    if (sp->lazy == 0) return total < INT32_MAX ? (int)total : INT32_MAX;
    int64_t over = sp->max_drop > 0 && sp->slack + 1 > sp->lazy ? sp->slack + 1 : sp->lazy;
    int64_t peak = (int64_t)sp->sink + sp->window + over, most;
    if (sp->decode_grows) /* after prefill below the peak, then every decoded entry kept */
        most = (n_prompt < peak ? n_prompt : peak) + (int64_t)n_generate;
    else
        most = total < peak ? total : peak;
    return most < INT32_MAX ? (int)most : INT32_MAX;
}

const kr_policy_ops kr_policy_streaming = {
    .name = "streaming",
    .init = streaming_init,
    .set = streaming_set,
    .finish = streaming_finish,
    .after_chunk = streaming_after_chunk,
    .max_entries = streaming_max_entries,
    .list_rule = streaming_list_rule,
};
