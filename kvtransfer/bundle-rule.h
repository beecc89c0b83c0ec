/*
 * bundle-rule.h - where the engine's per-list decode rule (kr_list_rule, engine/kr.h) meets the
 * bundle's list record (kt_bundle_list, bundle.h): the prefill node writes each list's rule
 * into the bundle, the decode node reads it back; and where a KV cache's row dtype meets the
 * bundle's payload dtype. Header-only, for the nodes and their tests; the codec itself
 * (bundle.c) stays free of the engine.
 */
#ifndef KT_BUNDLE_RULE_H
#define KT_BUNDLE_RULE_H

#include "bundle.h"
#include "kr.h"

/* The record of a list of `count` entries, the first `pinned` pinned, decoded under `r`. */
static inline kt_bundle_list kt_bundle_list_of(int count, int pinned, const kr_list_rule *r)
{
    return (kt_bundle_list){
        .count = (uint32_t)count,
        .pinned = (uint32_t)pinned,
        .window = r->window < 0 ? KT_BUNDLE_WINDOW_DENSE : (uint32_t)r->window,
        .sink = (uint32_t)r->sink,
        .lazy = (uint32_t)r->lazy,
        .slack = (uint32_t)r->slack,
        .max_drop = (uint32_t)r->max_drop,
        .flags = r->rel ? KT_BUNDLE_LIST_REL : 0,
    };
}

/* The decode rule a list of a parsed bundle carries (kt_bundle_parse bounds every field by
 * 2^31-1, so each fits an int). */
static inline kr_list_rule kt_bundle_list_rule(const kt_bundle_list *l)
{
    return (kr_list_rule){
        .sink = (int)l->sink,
        .window = l->window == KT_BUNDLE_WINDOW_DENSE ? -1 : (int)l->window,
        .lazy = (int)l->lazy,
        .slack = (int)l->slack,
        .max_drop = (int)l->max_drop,
        .rel = (l->flags & KT_BUNDLE_LIST_REL) != 0,
    };
}

/* The payload dtype that carries a KV cache's rows as they are (f32, bf16 or f16). */
static inline kt_dtype kt_dtype_of_cache(kr_dtype t)
{
    return t == KR_DTYPE_BF16 ? KT_DTYPE_BF16 : t == KR_DTYPE_F16 ? KT_DTYPE_F16 : KT_DTYPE_F32;
}

#endif /* KT_BUNDLE_RULE_H */
