/*
 * bundle-rule.h - where the engine's per-list decode rule (kr_list_rule, engine/include/kr.h) meets the
 * bundle's list record (kt_bundle_list, bundle.h): the prefill node writes each list's rule
 * into the bundle, the decode node reads it back; and where a KV cache's row dtype meets the
 * bundle's payload dtype; and where a received part's rows enter a sequence's blocks.
 * Header-only, for the nodes, their tests and the transfer bench; the codec itself (bundle.c)
 * stays free of the engine.
 */
#ifndef KT_BUNDLE_RULE_H
#define KT_BUNDLE_RULE_H

#include "bundle.h"
#include "kr.h"

#include <stdio.h>
#include <string.h>

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

/* One run of a list's slots in the pool's blocks, filled from a bundle part (kr_list_fill_fn):
 * a plain copy when the wire carries the cache's dtype, a conversion otherwise; a quantized part
 * into a bf16 or f16 pool goes through `rows` (float32 K then V rows of one block), rounded
 * there. */
typedef struct kt_part_fill {
    const kt_bundle_view *part;
    const kt_bundle_list_view *list;
    size_t head_dim;
    float *rows; /* NULL when the rows go straight into the blocks */
} kt_part_fill;

static inline int kt_part_fill_rows(void *arg, int first, int n, int32_t *pos, kr_dtype dtype,
                                    void *k, void *v, char *err)
{
    const kt_part_fill *a = (const kt_part_fill *)arg;
    if (!a->rows)
        return kt_bundle_list_read(a->part, a->list, (uint32_t)first,
                                   &(kt_rows){(uint32_t)n, pos, kt_dtype_of_cache(dtype), k, v},
                                   err);
    const size_t elems = (size_t)n * a->head_dim;
    if (kt_bundle_list_read(a->part, a->list, (uint32_t)first,
                            &(kt_rows){(uint32_t)n, pos, KT_DTYPE_F32, a->rows, a->rows + elems},
                            err) != 0)
        return -1;
    kr_dtype_from_f32(dtype, a->rows, elems, k);
    kr_dtype_from_f32(dtype, a->rows + elems, elems, v);
    return 0;
}

/* The decode rule a list view carries. */
static inline kr_list_rule kt_bundle_list_view_rule(const kt_bundle_list_view *lv)
{
    const kt_bundle_list l = {.count = lv->count, .pinned = lv->pinned, .window = lv->window,
                              .sink = lv->sink, .lazy = lv->lazy, .slack = lv->slack,
                              .max_drop = lv->max_drop, .flags = lv->flags};
    return kt_bundle_list_rule(&l);
}

/* Appends every list of a validated part (a whole bundle, or a layer segment whose layers are
 * s's) to sequence s, each with its pinned entries after the list's earlier pinned ones and
 * its decode rule (a later piece's replaces an earlier one's): the rows go from the part
 * straight into s's blocks. `rows` (2 * block_size * head_dim floats) is needed only for a
 * quantized part into a bf16 or f16 pool; else NULL. The caller checked the part's shape
 * against s (kt_bundle_check_model). Returns 0, or -1 with err (KR_ERR_MAX bytes). */
static inline int kt_bundle_part_to_seq(kr_seq *s, const kt_bundle_view *part, uint32_t head_dim,
                                        float *rows, char *err)
{
    for (uint32_t l = 0; l < part->hdr.n_layers; l++) {
        const int layer = (int)(part->hdr.first_layer + l);
        for (uint32_t h = 0; h < part->hdr.n_kv_heads; h++) {
            kt_bundle_list_view lv;
            if (kt_bundle_view_list(part, l, h, &lv, err) != 0)
                return -1;
            const kr_list_rule rule = kt_bundle_list_view_rule(&lv);
            int len, pinned;
            kr_seq_list_shape(s, layer, (int)h, &len, &pinned);
            kt_part_fill a = {.part = part, .list = &lv, .head_dim = head_dim, .rows = rows};
            if (kr_seq_list_set_rule(s, layer, (int)h, &rule, err) != KR_OK ||
                (lv.count > 0 &&
                 kr_seq_list_fill(s, layer, (int)h, (int)lv.count, pinned + (int)lv.pinned,
                                  kt_part_fill_rows, &a, err) != KR_OK))
                return -1;
        }
    }
    return 0;
}

/* Blocks of `pool` that a block-padded part (or its head: kt_bundle_parse_head) takes as one
 * run of consecutive blocks when its K and V sections can be received straight into them: its
 * rows padded to the pool's block size, in the pool's dtype, and every list of s it continues
 * (s NULL: none yet) ending on a block boundary. 0 when they cannot: the part is then received
 * into a buffer and copied (kt_bundle_part_to_seq). */
static inline int kt_part_run_blocks(const kr_seq *s, const kr_kv_pool *pool,
                                     const kt_bundle_view *head)
{
    const int bs = kr_kv_pool_block_size(pool);
    if (head->hdr.block_rows != (uint32_t)bs || kt_dtype_quantized(head->hdr.dtype) ||
        (int)head->hdr.dtype != (int)kr_kv_pool_dtype(pool) || head->n_rows == 0 ||
        head->n_rows / (uint64_t)bs > (uint64_t)kr_kv_pool_n_blocks(pool))
        return 0;
    for (uint32_t l = 0; s && l < head->hdr.n_layers; l++)
        for (uint32_t h = 0; h < head->hdr.n_kv_heads; h++) {
            int len;
            kr_seq_list_shape(s, (int)(head->hdr.first_layer + l), (int)h, &len, NULL);
            if (len % bs != 0)
                return 0;
        }
    return (int)(head->n_rows / (uint64_t)bs);
}

/* A placement hook's work (kt_bundle_place_fn): takes the run kt_part_run_blocks asks for and
 * gives its key and value rows as the places for the part's K and V. 0 with *first, *n, *k and
 * *v set; 1 (nothing taken) when the part cannot land in blocks or the pool has no free run
 * that long: the part then lands in a buffer and is copied. */
static inline int kt_part_take_run(const kr_seq *s, kr_kv_pool *pool, const kt_bundle_view *head,
                                   int32_t *first, int *n, void **k, void **v)
{
    const int want = kt_part_run_blocks(s, pool, head);
    int32_t *pos;
    if (want == 0 || kr_kv_pool_take_run(pool, want, first) != KR_OK)
        return 1;
    *n = want;
    kr_kv_pool_run_rows(pool, *first, k, v, &pos);
    return 0;
}

/* Appends every list of a validated part whose K and V were received into the run of `n` blocks
 * from `first` (kt_part_run_blocks, kr_kv_pool_take_run, kr_kv_pool_run_rows) to sequence s:
 * each list's positions are written into its share of the run (they came in the part's head),
 * and the list adopts that share, pinned and ruled as kt_bundle_part_to_seq would. On a failure
 * the lists that adopted their share keep it (it goes with the sequence) and the rest of the run
 * goes back to the pool. Returns 0, or -1 with err (KR_ERR_MAX bytes). */
static inline int kt_bundle_part_adopt(kr_seq *s, kr_kv_pool *pool, const kt_bundle_view *part,
                                       int32_t first, int n, char *err)
{
    const int bs = kr_kv_pool_block_size(pool);
    void *k, *v;
    int32_t *pos;
    kr_kv_pool_run_rows(pool, first, &k, &v, &pos);
    int at = 0;
    for (uint32_t l = 0; l < part->hdr.n_layers; l++)
        for (uint32_t h = 0; h < part->hdr.n_kv_heads; h++) {
            const int layer = (int)(part->hdr.first_layer + l);
            kt_bundle_list_view lv;
            int len, pinned;
            if (kt_bundle_view_list(part, l, h, &lv, err) != 0)
                goto fail;
            const kr_list_rule rule = kt_bundle_list_view_rule(&lv);
            const int nb = (int)((lv.count + (uint32_t)bs - 1) / (uint32_t)bs);
            if (at + nb > n) {
                snprintf(err, KR_ERR_MAX, "the part's lists need more than the %d blocks of its run",
                         n);
                goto fail;
            }
            memcpy(pos + (size_t)at * (size_t)bs, lv.positions, sizeof(int32_t) * lv.count);
            kr_seq_list_shape(s, layer, (int)h, &len, &pinned);
            if (kr_seq_list_set_rule(s, layer, (int)h, &rule, err) != KR_OK ||
                kr_seq_list_adopt(s, layer, (int)h, first + at, nb, (int)lv.count,
                                  pinned + (int)lv.pinned, err) != KR_OK)
                goto fail;
            at += nb;
        }
    if (at == n)
        return 0;
    snprintf(err, KR_ERR_MAX, "the part's lists take %d of the %d blocks of its run", at, n);
fail:
    kr_kv_pool_give_run(pool, first + at, n - at);
    return -1;
}

#endif /* KT_BUNDLE_RULE_H */
