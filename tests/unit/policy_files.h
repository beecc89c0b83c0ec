/*
 * policy_files.h - the policy files the tests of the heads and hsft families read (a gate per
 * (layer, KV head) and a learned window per layer, docs/policies.md), and policy specs that
 * name them: "{g}" and "{w}" in a spec stand for the gates and windows files.
 * Header-only, for tests/unit; needs kr_test.h (REQUIRE) before it.
 */
#ifndef KR_POLICY_FILES_H
#define KR_POLICY_FILES_H

#include "kr.h"

#include <stdio.h>
#include <string.h>

/* The gate of KV head g of layer l in the files: some heads dense, some streaming. */
static inline float kr_test_gate(int l, int g)
{
    return (float)((l * 7 + g * 3) % 5) / 4.0f;
}

/* The learned window of layer l in the files: growing with depth. */
static inline int kr_test_window(int l)
{
    return 6 + 4 * l;
}

/* Writes the gates (tab-separated, a row per layer) and windows (a line per layer) files of a
 * model of cfg's shape. */
static inline void kr_test_policy_files(const kr_config *cfg, const char *gates, const char *windows)
{
    FILE *fg = fopen(gates, "w"), *fw = fopen(windows, "w");
    REQUIRE(fg && fw, "cannot write %s or %s", gates, windows);
    for (int l = 0; l < cfg->n_layers; l++) {
        for (int g = 0; g < cfg->n_kv_heads; g++)
            fprintf(fg, "%.2f%c", (double)kr_test_gate(l, g), g + 1 < cfg->n_kv_heads ? '\t' : '\n');
        fprintf(fw, "%d\n", kr_test_window(l));
    }
    fclose(fg);
    fclose(fw);
}

/* tmpl with "{g}" and "{w}" replaced by the files' paths, into out (cap bytes). */
static inline void kr_test_expand(const char *tmpl, const char *gates, const char *windows, char *out,
                                  size_t cap)
{
    size_t at = 0;
    for (const char *p = tmpl; *p && at + 1 < cap;) {
        const char *with = !strncmp(p, "{g}", 3) ? gates : !strncmp(p, "{w}", 3) ? windows : NULL;
        if (with) {
            at += (size_t)snprintf(out + at, cap - at, "%s", with);
            p += 3;
        } else {
            out[at++] = *p++;
        }
    }
    out[at < cap ? at : cap - 1] = 0;
}

/* The policy tmpl names once expanded, parsed against cfg; REQUIREs that it parses. */
static inline kr_policy *kr_test_policy(const char *tmpl, const kr_config *cfg, const char *gates,
                                        const char *windows)
{
    char spec[1024], err[KR_ERR_MAX];
    kr_test_expand(tmpl, gates, windows, spec, sizeof spec);
    kr_policy *pol;
    REQUIRE(kr_policy_parse(spec, cfg, &pol, err) == KR_OK, "%s: %s", spec, err);
    return pol;
}

#endif
