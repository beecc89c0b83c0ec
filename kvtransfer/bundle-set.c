/*
 * bundle-set.c - assembling the parts of a transfer (bundle.h: kt_bundle_set): a whole bundle,
 * or the layer segments and early parts of a pipelined one, each checked to continue the parts
 * before it, and read back list by list across them. What it is not: a parser: each part is a
 * view bundle.c validated.
 * Run: ctest -R bundle.
 */
#include "bundle-impl.h"
#include "partbuf.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

void kt_bundle_set_init(kt_bundle_set *s, kt_bundle_view *parts, uint32_t cap)
{
    memset(s, 0, sizeof *s);
    s->parts = parts;
    s->cap = cap;
}

void kt_bundle_set_free(kt_bundle_set *s)
{
    if (s->owned)
        for (uint32_t i = 0; i < s->n_parts; i++)
            kt_partbuf_free((void *)s->parts[i].base);
    kt_partbuf_free(s->region);
    kt_bundle_view *parts = s->parts;
    const uint32_t cap = s->cap;
    const int owned = s->owned;
    kt_bundle_set_init(s, parts, cap);
    s->owned = owned;
}

/* The largest position in a validated view (each list's last entry: positions increase), or
 * -1 when it holds no entry. */
static int32_t view_max_position(const kt_bundle_view *v)
{
    int32_t most = -1;
    for (uint32_t i = 0; i < v->n_lists; i++) {
        const uint8_t *t = v->lists + (size_t)i * BL_LIST_ENTRY;
        const uint32_t count = kt_rd32(t + 8);
        if (count) {
            const int32_t p = (int32_t)kt_rd32(v->positions + (kt_rd64(t) + count - 1) * 4);
            most = p > most ? p : most;
        }
    }
    return most;
}

/* The record of list i of a validated view. */
static kt_bundle_list view_record(const kt_bundle_view *v, uint32_t i)
{
    kt_bundle_list l;
    list_rd(v->lists + (size_t)i * BL_LIST_ENTRY, &l);
    return l;
}

/* Where list (layer, head) of a view starts among the view's entries; the view must hold the
 * layer. */
static uint64_t view_list_first(const kt_bundle_view *v, uint32_t layer, uint32_t head)
{
    const uint32_t i = (layer - v->hdr.first_layer) * v->hdr.n_kv_heads + head;
    return kt_rd64(v->lists + (size_t)i * BL_LIST_ENTRY);
}

static int view_has_layer(const kt_bundle_view *v, uint32_t layer)
{
    return layer >= v->hdr.first_layer && layer - v->hdr.first_layer < v->hdr.n_layers;
}

/* A part continuing list (layer, head) of the set: its entries must come after the list's
 * last one so far, and it may pin entries only when every earlier entry is pinned. */
static int check_piece(const kt_bundle_set *s, const kt_bundle_view *part, uint32_t layer,
                       uint32_t head, char *err)
{
    const kt_bundle_list m = view_record(part, (layer - part->hdr.first_layer) * part->hdr.n_kv_heads + head);
    int32_t last = -1;
    int all_pinned = 1;
    for (uint32_t i = 0; i < s->n_parts; i++) {
        const kt_bundle_view *v = &s->parts[i];
        if (!view_has_layer(v, layer)) continue;
        const kt_bundle_list e = view_record(v, (layer - v->hdr.first_layer) * v->hdr.n_kv_heads + head);
        if (e.count)
            last = (int32_t)kt_rd32(v->positions + (view_list_first(v, layer, head) + e.count - 1) * 4);
        all_pinned &= e.pinned == e.count;
    }
    if (m.count && last >= 0) {
        const int32_t first = (int32_t)kt_rd32(part->positions + view_list_first(part, layer, head) * 4);
        if (first <= last)
            return fail(err, "part %" PRIu32 " continues list (layer %" PRIu32 ", head %" PRIu32
                        ") at position %" PRId32 ", not after its position %" PRId32 " so far",
                        s->n_parts, layer, head, first, last);
    }
    if (m.pinned && !all_pinned)
        return fail(err, "part %" PRIu32 " pins entries of list (layer %" PRIu32 ", head %" PRIu32
                    ") after unpinned ones (the pinned set is the list's first entries)",
                    s->n_parts, layer, head);
    return 0;
}

int kt_bundle_set_add(kt_bundle_set *s, const kt_bundle_view *part, int last, char *err)
{
    const kt_bundle_header *h = &part->hdr;
    if (s->complete)
        return fail(err, "a part after the last one (the set is complete)");
    if (s->n_parts == s->cap)
        return fail(err, "more than %" PRIu32 " parts", s->cap);
    const uint32_t covered = s->n_parts ? s->hdr.n_layers : 0;
    if (!part->k || !part->v)
        return fail(err, "part %" PRIu32 " has no rows yet (kt_bundle_parse_rows completes a view "
                    "from kt_bundle_parse_head)", s->n_parts);
    if (s->n_parts == 0) {
        if (!h->segment && !last)
            return fail(err, "a whole bundle (not a layer segment) with more parts announced after it");
        if (h->first_layer != 0)
            return fail(err, "the first segment starts at layer %" PRIu32 ", not 0", h->first_layer);
    } else {
        const kt_bundle_header *f = &s->hdr;
        if (!h->segment)
            return fail(err, "part %" PRIu32 " is a whole bundle, not a layer segment", s->n_parts);
        if (h->first_layer > covered)
            return fail(err, "segment %" PRIu32 " starts at layer %" PRIu32 ", past layer %" PRIu32
                        " (where the layers so far end)", s->n_parts, h->first_layer, covered);
        if (strcmp(h->fingerprint, f->fingerprint) != 0 || h->n_kv_heads != f->n_kv_heads ||
            h->head_dim != f->head_dim || h->dtype != f->dtype || h->prompt_len != f->prompt_len ||
            strcmp(h->policy, f->policy) != 0)
            return fail(err, "segment %" PRIu32 " disagrees with the first on the model, dtype, "
                        "prompt length or policy", s->n_parts);
        for (uint32_t l = h->first_layer; l < covered && l - h->first_layer < h->n_layers; l++)
            for (uint32_t g = 0; g < h->n_kv_heads; g++)
                if (check_piece(s, part, l, g, err)) return -1;
    }
    if (last) {
        for (uint32_t i = 0; i < s->n_parts; i++) {
            const int32_t most = view_max_position(&s->parts[i]);
            if (most >= h->next_pos)
                return fail(err, "segment %" PRIu32 " holds position %" PRId32 ", not below the "
                            "last segment's next_pos %" PRId32, i, most, h->next_pos);
        }
    }
    const uint32_t end = h->first_layer + h->n_layers;
    if (s->n_parts == 0) {
        s->hdr = *h;
        s->hdr.segment = 0;
    }
    s->hdr.n_layers = end > covered ? end : covered;
    if (h->block_rows != s->hdr.block_rows) /* each part is read through its own view */
        s->hdr.block_rows = 0;
    if (last) {
        s->hdr.first_token = h->first_token;
        s->hdr.next_pos = h->next_pos;
        s->complete = 1;
    }
    s->size += part->size;
    s->n_entries += part->n_entries;
    if (part != &s->parts[s->n_parts]) s->parts[s->n_parts] = *part;
    s->n_parts++;
    return 0;
}

int kt_bundle_set_list(const kt_bundle_set *s, uint32_t layer, uint32_t head, kt_bundle_list *out,
                       char *err)
{
    if (!s->complete) return fail(err, "the set is not complete (its last part has not arrived)");
    if (layer >= s->hdr.n_layers || head >= s->hdr.n_kv_heads)
        return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") outside the set's %" PRIu32
                    " layers x %" PRIu32 " heads", layer, head, s->hdr.n_layers, s->hdr.n_kv_heads);
    kt_bundle_list l = {0};
    for (uint32_t i = 0; i < s->n_parts; i++) {
        const kt_bundle_view *v = &s->parts[i];
        if (!view_has_layer(v, layer)) continue;
        const kt_bundle_list e = view_record(v, (layer - v->hdr.first_layer) * v->hdr.n_kv_heads + head);
        const uint32_t count = l.count + e.count, pinned = l.pinned + e.pinned;
        l = e; /* the decode rule is the last piece's */
        l.count = count;
        l.pinned = pinned;
    }
    *out = l;
    return 0;
}

int kt_bundle_set_read(const kt_bundle_set *s, uint32_t layer, uint32_t head, uint32_t first,
                       const kt_rows *out, char *err)
{
    uint32_t n = out->n;
    const kt_dtype row_dtype = out->dtype;
    int32_t *positions = out->positions;
    void *k = out->k, *v_out = out->v; /* advanced past each part's entries */
    kt_bundle_list whole;
    if (kt_bundle_set_list(s, layer, head, &whole, err)) return -1;
    if ((uint64_t)first + n > whole.count)
        return fail(err, "read of entries [%" PRIu32 ", %" PRIu64 ") past the list's %" PRIu32,
                    first, (uint64_t)first + n, whole.count);
    const size_t row = (size_t)s->hdr.head_dim * kt_dtype_size(row_dtype);
    uint32_t base = 0; /* the list's entries in the parts before this one */
    for (uint32_t i = 0; i < s->n_parts && n; i++) {
        const kt_bundle_view *v = &s->parts[i];
        if (!view_has_layer(v, layer)) continue;
        kt_bundle_list_view lv;
        if (kt_bundle_view_list(v, layer - v->hdr.first_layer, head, &lv, err)) return -1;
        if (first < base + lv.count) {
            const uint32_t at = first - base, m = lv.count - at < n ? lv.count - at : n;
            const kt_rows piece = {m, positions, row_dtype, k, v_out};
            if (kt_bundle_list_read(v, &lv, at, &piece, err)) return -1;
            if (positions) positions += m;
            if (k) k = (uint8_t *)k + (size_t)m * row;
            if (v_out) v_out = (uint8_t *)v_out + (size_t)m * row;
            first += m;
            n -= m;
        }
        base += lv.count;
    }
    return 0;
}
