/*
 * policy-full.c - the `full` policy: every entry is kept and no chunk is evicted; decode grows
 * the lists unless decode=window:W is given.
 *
 *   full[:decode=grow|window:W]
 */
#include "kr-util.h"
#include "policy.h"

static int full_set(kr_policy *p, const char *key, const char *value, char *err)
{
    int handled;
    if (kr_policy_decode_key(p, key, value, &handled, err) != KR_OK) return -1;
    if (!handled) return kr_errf(err, "policy: full takes no key '%s' (only decode=grow|window:W)", key);
    return KR_OK;
}

static int full_finish(kr_policy *p, const kr_config *cfg, char *err)
{
    if (p->decode_window == -2) p->decode_window = -1;
    return KR_OK;
}

static void full_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                             int layer)
{
}

const kr_policy_ops kr_policy_full = {
    .name = "full",
    .set = full_set,
    .finish = full_finish,
    .after_chunk = full_after_chunk,
    .keeps_prompt = 1,
};
