/*
 * fuzz_bundle.c - kt_bundle_parse on arbitrary bytes, as a decode node receives them from a
 * peer. It must refuse them with a "bundle: " message, or return a view whose every list,
 * position, K/V byte and row scale lies inside the input: the target walks all of them (and
 * reads each list back through kt_bundle_list_read, a quantized one to finite values only) so
 * ASan reports any lie the parser let through, and
 * re-checks the invariants the parser promises, then adds the view to a kt_bundle_set as its
 * only part. The same bytes are then parsed in two steps (kt_bundle_layout_read,
 * kt_bundle_parse_head on the head, kt_bundle_parse_rows on K and V each copied to a buffer of
 * its own, as a receiver landing them in its KV blocks has them), which must agree with the
 * one-step parse: both refuse, or both give the same lists, positions and rows.
 * Random bytes almost never carry valid CRC32Cs,
 * so each input is parsed twice: as it is, and "resealed" (every checksum the section table
 * makes computable recomputed) - that is what a buggy or hostile sender produces, and it
 * takes the fuzzer past the checksums into the field checks.
 * Run: ctest -R fuzz_bundle (replay of tests/fuzz/corpus/bundle/ + mutations), or with
 * -DKR_FUZZ=ON: ./fuzz_bundle tests/fuzz/corpus/bundle. Seeds: KT_BUNDLE_SEEDS=DIR test_bundle.
 */
#include "bundle.h"

#include <stdlib.h>
#include <string.h>

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const uint8_t *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static void wr32(uint8_t *p, uint32_t x)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(x >> (8 * i));
}

/* Recomputes the section checksums whose ranges lie inside b, then the header's (offsets as
 * in docs/bundle.md: the section table at 80, or at 88 in a block-padded bundle). Leaves
 * anything it cannot compute alone. */
static void reseal(uint8_t *b, size_t size)
{
    if (size < 80) return;
    unsigned n_sections = (unsigned)(b[62] | b[63] << 8);
    if (n_sections > 16) n_sections = 16;
    const size_t table = rd32(b + 24) & 2 ? 88 : 80;
    for (unsigned s = 0; s < n_sections && table + 24 * (s + 1) <= size; s++) {
        uint8_t *e = b + table + 24 * s;
        const uint64_t off = rd64(e + 8), len = rd64(e + 16);
        if (off <= size && len <= size - off) wr32(e + 4, kt_crc32c(0, b + off, (size_t)len));
    }
    const uint32_t header_size = rd32(b + 12);
    if (header_size >= 32 && header_size <= size) {
        wr32(b + 28, 0);
        wr32(b + 28, kt_crc32c(0, b, header_size));
    }
}

static void parse_and_walk(const uint8_t *data, size_t size)
{
    char err[KT_ERR_MAX];
    kt_bundle_view v;
    if (kt_bundle_parse(data, size, &v, err) != 0) {
        if (strncmp(err, "bundle: ", 8) != 0) __builtin_trap();
        return;
    }
    if (v.size != size || v.n_lists != v.hdr.n_layers * v.hdr.n_kv_heads) __builtin_trap();
    if (kt_bundle_check_model(&v.hdr, v.hdr.fingerprint, v.hdr.n_layers, v.hdr.n_kv_heads,
                              v.hdr.head_dim, err) != 0)
        __builtin_trap();
    const size_t dim = v.hdr.head_dim;
    float *k = malloc(dim * sizeof(float)), *vv = malloc(dim * sizeof(float));
    const uint32_t br = v.hdr.block_rows;
    if (br > KT_BUNDLE_MAX_BLOCK_ROWS || (br != 0) != ((v.flags & 2) != 0) || (br && v.version_minor < 3))
        __builtin_trap();
    uint64_t entries = 0, rows = 0;
    unsigned sum = 0;
    /* every row of every row section, padding rows included, lies inside the input and
     * padding rows are zero */
    for (size_t i = 0; i < v.n_rows * v.row_bytes; i++) sum += v.k[i] ^ v.v[i];
    for (uint32_t l = 0; l < v.hdr.n_layers; l++)
        for (uint32_t h = 0; h < v.hdr.n_kv_heads; h++) {
            kt_bundle_list_view lv;
            if (kt_bundle_view_list(&v, l, h, &lv, err) != 0) __builtin_trap();
            if (lv.first != rows || lv.pinned > lv.count || (br && lv.first % br)) __builtin_trap();
            /* the decode rule: every value fits an int, one known flag */
            if ((lv.window != KT_BUNDLE_WINDOW_DENSE && lv.window > INT32_MAX) ||
                lv.sink > INT32_MAX || lv.lazy > INT32_MAX || lv.slack > INT32_MAX || lv.max_drop > INT32_MAX ||
                (lv.flags & ~KT_BUNDLE_LIST_REL))
                __builtin_trap();
            entries += lv.count;
            rows += br ? ((uint64_t)lv.count + br - 1) / br * br : lv.count;
            for (uint64_t r = lv.count; r < rows - lv.first; r++)
                for (size_t i = 0; i < v.row_bytes; i++)
                    if (lv.k[r * v.row_bytes + i] || lv.v[r * v.row_bytes + i]) __builtin_trap();
            /* touch every byte of the list's positions and rows */
            for (size_t i = 0; i < (size_t)lv.count * 4; i++) sum += lv.positions[i];
            for (size_t i = 0; i < (size_t)lv.count * v.row_bytes; i++) sum += lv.k[i] ^ lv.v[i];
            if ((lv.k_scale != NULL) != kt_dtype_quantized(v.hdr.dtype) || (lv.v_scale != NULL) != (lv.k_scale != NULL))
                __builtin_trap();
            for (size_t i = 0; lv.k_scale && i < (size_t)lv.count * 4; i++) sum += lv.k_scale[i] ^ lv.v_scale[i];
            int32_t last = -1;
            for (uint32_t j = 0; j < lv.count; j++) {
                int32_t p;
                if (kt_bundle_list_read(&v, &lv, j, &(kt_rows){1, &p, KT_DTYPE_F32, k, vv}, err) !=
                    0)
                    __builtin_trap();
                if (p <= last || p >= v.hdr.next_pos) __builtin_trap();
                /* a quantized payload dequantizes to finite values only (the parser's promise) */
                for (size_t e = 0; kt_dtype_quantized(v.hdr.dtype) && e < dim; e++)
                    if (!__builtin_isfinite(k[e]) || !__builtin_isfinite(vv[e])) __builtin_trap();
                last = p;
            }
        }
    if (entries != v.n_entries || rows != v.n_rows) __builtin_trap();
    /* as the one part of a set: taken exactly when it starts at layer 0, then every list of
     * the set is the view's own */
    kt_bundle_view part;
    kt_bundle_set set;
    kt_bundle_set_init(&set, &part, 1);
    if (kt_bundle_set_add(&set, &v, 1, err) != 0) {
        if (v.hdr.first_layer == 0 || strncmp(err, "bundle: ", 8) != 0) __builtin_trap();
    } else {
        if (v.hdr.first_layer != 0 || set.hdr.n_layers != v.hdr.n_layers || set.size != v.size)
            __builtin_trap();
        for (uint32_t l = 0; l < v.hdr.n_layers; l++) {
            kt_bundle_list a;
            kt_bundle_list_view b;
            int32_t p0 = -1, p1 = -2;
            if (kt_bundle_set_list(&set, l, 0, &a, err) != 0 ||
                kt_bundle_view_list(&v, l, 0, &b, err) != 0 || a.count != b.count ||
                a.pinned != b.pinned || a.window != b.window)
                __builtin_trap();
            if (a.count &&
                (kt_bundle_set_read(&set, l, 0, a.count - 1,
                                    &(kt_rows){1, &p0, KT_DTYPE_F32, NULL, NULL}, err) != 0 ||
                 kt_bundle_list_read(&v, &b, a.count - 1,
                                     &(kt_rows){1, &p1, KT_DTYPE_F32, NULL, NULL}, err) != 0 ||
                 p0 != p1))
                __builtin_trap();
        }
    }
    free(vv);
    free(k);
    /* keep the reads from being optimised away */
    volatile unsigned sink = sum;
    (void)sink;
}

/* A copy of n bytes in a buffer of exactly that size (so ASan sees overreads). */
static uint8_t *piece(const uint8_t *p, uint64_t n)
{
    uint8_t *c = malloc(n ? n : 1);
    memcpy(c, p, n);
    return c;
}

/* The two-step parse of the same bytes agrees with the one-step parse. */
static void two_steps(const uint8_t *data, size_t size)
{
    char err[KT_ERR_MAX];
    kt_bundle_view one, two;
    const int ok = kt_bundle_parse(data, size, &one, err) == 0;
    kt_bundle_layout lay;
    if (kt_bundle_layout_read(data, size, &lay, err) != 0) {
        if (ok || strncmp(err, "bundle: ", 8) != 0) __builtin_trap(); /* a subset of parse's checks */
        return;
    }
    if (lay.k_off != lay.head_len || lay.k_len > lay.size - lay.k_off || lay.v_off < lay.k_off + lay.k_len ||
        lay.v_len > lay.size - lay.v_off)
        __builtin_trap();
    if (ok && (lay.size != size || lay.block_rows != one.hdr.block_rows || lay.k_off != (uint64_t)(one.k - data) ||
               lay.v_off != (uint64_t)(one.v - data) || lay.k_len != one.n_rows * one.row_bytes))
        __builtin_trap();
    if (!lay.split || lay.size != size) return;
    uint8_t *head = piece(data, lay.head_len), *k = piece(data + lay.k_off, lay.k_len),
            *v = piece(data + lay.v_off, lay.v_len);
    int ok2 = kt_bundle_parse_head(head, (size_t)lay.head_len, lay.size, &two, err) == 0;
    if (ok2) {
        kt_bundle_list_view lv;
        if (two.k || two.v || kt_bundle_view_list(&two, 0, 0, &lv, err) != 0 || lv.k) __builtin_trap();
        ok2 = kt_bundle_parse_rows(&two, k, v, err) == 0;
        if (!ok2 && (two.k || two.v)) __builtin_trap();
    }
    if (!ok2 && strncmp(err, "bundle: ", 8) != 0) __builtin_trap();
    if (ok != ok2) __builtin_trap();
    if (ok) {
        if (memcmp(&one.hdr, &two.hdr, sizeof one.hdr) != 0 || one.n_entries != two.n_entries ||
            one.n_rows != two.n_rows || two.k != k || two.v != v ||
            memcmp(one.positions, two.positions, one.n_rows * 4) != 0 ||
            memcmp(one.k, k, lay.k_len) != 0 || memcmp(one.v, v, lay.v_len) != 0)
            __builtin_trap();
        for (uint32_t l = 0; l < one.hdr.n_layers; l++) {
            kt_bundle_list_view a, b;
            if (kt_bundle_view_list(&one, l, 0, &a, err) != 0 || kt_bundle_view_list(&two, l, 0, &b, err) != 0 ||
                a.first != b.first || a.count != b.count || b.k != k + b.first * two.row_bytes)
                __builtin_trap();
        }
    }
    free(v);
    free(k);
    free(head);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    parse_and_walk(data, size);
    two_steps(data, size);
    uint8_t *copy = malloc(size ? size : 1); /* exact size, so ASan sees overreads */
    memcpy(copy, data, size);
    reseal(copy, size);
    parse_and_walk(copy, size);
    two_steps(copy, size);
    free(copy);
    return 0;
}
