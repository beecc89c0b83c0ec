/*
 * policy.c - parsing of policy specs ("name:key=value,..."), the registry of policy families,
 * the helpers they share (the decode rule a list starts with, re-rotating keys for pos=rel).
 * The families live in policy-*.c, one per family; docs/policies.md lists every key, its
 * default and where it comes from.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const kr_policy_ops *const families[] = {
    &kr_policy_full, &kr_policy_streaming, &kr_policy_heads, &kr_policy_sage,
    &kr_policy_snapkv, &kr_policy_pyramidkv, &kr_policy_take, &kr_policy_hsft,
};

int kr_policy_int(const char *key, const char *value, long lo, long hi, int *out, char *err)
{
    char *end;
    errno = 0;
    long v = strtol(value, &end, 10);
    if (errno || end == value || *end)
        return kr_errf(err, "policy: %s=%s is not an integer", key, value);
    if (v < lo || v > hi) return kr_errf(err, "policy: %s=%ld is out of range [%ld, %ld]", key, v, lo, hi);
    *out = (int)v;
    return KR_OK;
}

int kr_policy_float(const char *key, const char *value, double lo, double hi, float *out, char *err)
{
    char *end;
    errno = 0;
    double v = strtod(value, &end);
    if (errno || end == value || *end || isnan(v))
        return kr_errf(err, "policy: %s=%s is not a number", key, value);
    if (v < lo || v > hi) return kr_errf(err, "policy: %s=%g is out of range [%g, %g]", key, v, lo, hi);
    *out = (float)v;
    return KR_OK;
}

void kr_policy_spec_add(kr_policy *p, const char *key, const char *fmt, ...)
{
    size_t at = strlen(p->spec);
    if (at + 2 >= sizeof p->spec) return;
    at += (size_t)snprintf(p->spec + at, sizeof p->spec - at, "%s%s=", strchr(p->spec, ':') ? "," : ":", key);
    if (at >= sizeof p->spec) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->spec + at, sizeof p->spec - at, fmt, ap);
    va_end(ap);
}

int kr_policy_decode_key(kr_policy *p, const char *key, const char *value, int *handled, char *err)
{
    *handled = 0;
    if (strcmp(key, "decode") != 0) return KR_OK;
    *handled = 1;
    if (!strcmp(value, "grow")) {
        p->decode_window = -1;
        return KR_OK;
    }
    if (!strncmp(value, "window:", 7))
        return kr_policy_int("decode=window", value + 7, 0, 1 << 30, &p->decode_window, err);
    return kr_errf(err, "policy: decode=%s must be grow or window:W", value);
}

void kr_policy_list_rule(const kr_policy *p, const kr_seq *s, int layer, int kv_head, kr_list_rule *rule)
{
    *rule = kr_rule_dense;
    if (p->ops->list_rule) p->ops->list_rule(p, s, layer, kv_head, rule);
    else if (p->decode_window >= 0) rule->window = p->decode_window;
}

void kr_policy_set_list_rule(const kr_policy *p, kr_seq *s, int layer, int kv_head)
{
    kr_list_rule rule = kr_rule_dense;
    if (p) kr_policy_list_rule(p, s, layer, kv_head, &rule);
    kr_seq_set_rule(s, layer, kv_head, &rule);
}

/* Element i of a key row of dtype t, widened; and storing one, rounded to nearest even. */
static float key_at(const void *row, kr_dtype t, int i)
{
    switch (t) {
    case KR_DTYPE_BF16: return kr_bf16_to_f32(((const uint16_t *)row)[i]);
    case KR_DTYPE_F16: return kr_f16_to_f32(((const uint16_t *)row)[i]);
    case KR_DTYPE_F32: break;
    }
    return ((const float *)row)[i];
}

static void key_set(void *row, kr_dtype t, int i, float x)
{
    switch (t) {
    case KR_DTYPE_BF16: ((uint16_t *)row)[i] = kr_f32_to_bf16(x); return;
    case KR_DTYPE_F16: ((uint16_t *)row)[i] = kr_f32_to_f16(x); return;
    case KR_DTYPE_F32: break;
    }
    ((float *)row)[i] = x;
}

/* A bf16 or f16 key is rotated from its rounded value and rounded again: each re-rotation of a
 * pos=rel list adds one rounding to the keys it moves. */
void kr_policy_rerotate(kr_seq *s, const kr_evict_env *env, int layer, int kv_head)
{
    kr_kv_pool *p = s->pool;
    kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    const int half = p->head_dim / 2;
    for (int e = 0; e < l->len; e++) {
        int32_t *pos = kr_kv_list_pos(p, l, e);
        int delta = e - *pos;
        if (delta == 0) continue;
        void *k = kr_kv_list_key(p, l, e);
        /* RoPE(p + delta) = rotation by omega_i * delta of RoPE(p): rotate-half pairs (i, i+half) */
        for (int i = 0; i < half; i++) {
            double a = (double)delta * env->inv_freq[i];
            float c = (float)cos(a), sn = (float)sin(a), x1 = key_at(k, p->dtype, i),
                  x2 = key_at(k, p->dtype, i + half);
            key_set(k, p->dtype, i, x1 * c - x2 * sn);
            key_set(k, p->dtype, i + half, x2 * c + x1 * sn);
        }
        *pos = e;
    }
}

int kr_policy_parse(const char *spec, const kr_config *cfg, kr_policy **out, char *err)
{
    if (!spec || !*spec) return kr_errf(err, "policy: empty spec (try 'full')");
    if (strlen(spec) >= KR_POLICY_MAX_SPEC)
        return kr_errf(err, "policy: spec longer than %d characters", KR_POLICY_MAX_SPEC - 1);
    char buf[KR_POLICY_MAX_SPEC];
    strcpy(buf, spec);
    char *args = strchr(buf, ':');
    if (args) *args++ = 0;
    const kr_policy_ops *ops = NULL;
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
        if (!strcmp(families[i]->name, buf)) ops = families[i];
    if (!ops) {
        char names[256] = "";
        for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
            snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "", families[i]->name);
        return kr_errf(err, "policy: unknown policy '%s' (available: %s)", buf, names);
    }
    kr_policy *p = calloc(1, sizeof *p);
    if (!p) return kr_errf(err, "policy: out of memory");
    p->ops = ops;
    p->n_layers = cfg->n_layers;
    p->n_heads = cfg->n_heads;
    p->n_kv_heads = cfg->n_kv_heads;
    p->head_dim = cfg->head_dim;
    p->decode_window = -2; /* "not given": finish() puts the family's default */
    snprintf(p->spec, sizeof p->spec, "%s", ops->name);
    if (ops->init && ops->init(p, err) != KR_OK) {
        kr_policy_free(p);
        return -1;
    }
    char *save = NULL; /* strtok_r: nodes parse specs on many handler threads at once */
    for (char *kv = args ? strtok_r(args, ",", &save) : NULL; kv; kv = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(kv, '=');
        if (!eq || eq == kv) {
            kr_policy_free(p);
            return kr_errf(err, "policy: '%s' in '%s' is not key=value", kv, spec);
        }
        *eq = 0;
        if (ops->set(p, kv, eq + 1, err) != KR_OK) {
            kr_policy_free(p);
            return -1;
        }
    }
    if (ops->finish(p, cfg, err) != KR_OK) {
        kr_policy_free(p);
        return -1;
    }
    if (p->decode_window >= 0) kr_policy_spec_add(p, "decode", "window:%d", p->decode_window);
    else if (p->decode_window == -1) kr_policy_spec_add(p, "decode", "grow");
    *out = p;
    return KR_OK;
}

void kr_policy_free(kr_policy *p)
{
    if (!p) return;
    if (p->ops->free_params && p->params) p->ops->free_params(p);
    free(p->params);
    free(p);
}

int kr_policy_n_families(void)
{
    return (int)(sizeof families / sizeof families[0]);
}

const char *kr_policy_family_name(int i)
{
    return i >= 0 && i < kr_policy_n_families() ? families[i]->name : NULL;
}

int kr_policy_family(const kr_policy *p)
{
    for (int i = 0; i < kr_policy_n_families(); i++)
        if (families[i] == p->ops) return i;
    return 0;
}

const char *kr_policy_spec(const kr_policy *p)
{
    return p->spec;
}

int kr_policy_max_entries(const kr_policy *p, int n_prompt, int n_generate)
{
    if (p->ops->max_entries) return p->ops->max_entries(p, n_prompt, n_generate);
    if (p->decode_window < 0) return n_prompt + n_generate;
    /* the pinned set stays; the window holds at most decode_window entries plus the new one */
    int window = p->decode_window + 1 < n_generate ? p->decode_window + 1 : n_generate;
    return n_prompt + window;
}

int kr_policy_appended(const kr_policy *p, int n_prompt)
{
    int n = p->ops->appended ? p->ops->appended(p, n_prompt) : 0;
    return n < n_prompt ? n : n_prompt;
}

int kr_policy_list_window(const kr_policy *p, int layer, int kv_head)
{
    if (!p || layer < 0 || layer >= p->n_layers || kv_head < 0 || kv_head >= p->n_kv_heads) return -1;
    kr_list_rule rule;
    kr_policy_list_rule(p, NULL, layer, kv_head, &rule);
    return rule.window;
}

int kr_seq_set_policy(kr_seq *s, const kr_policy *p, char *err)
{
    if (s->next_pos != 0 || s->fp.steps != 0 || s->closed)
        return kr_errf(err, "policy: set it before the sequence's first token (and before kr_seq_set_next_pos)");
    if (p && (p->n_layers != s->n_layers || p->n_kv_heads != s->n_kv_heads))
        return kr_errf(err, "policy: parsed for another model shape");
    free(s->policy_state);
    s->policy_state = NULL;
    s->policy = p;
    if (p && p->ops->state_init && p->ops->state_init(p, s, err) != KR_OK) {
        s->policy = NULL;
        return -1;
    }
    for (int i = 0; i < s->n_layers * s->n_kv_heads; i++)
        kr_policy_set_list_rule(p, s, i / s->n_kv_heads, i % s->n_kv_heads);
    return KR_OK;
}
