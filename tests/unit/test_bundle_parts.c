/*
 * test_bundle_parts.c - the KV bundle codec (kvtransfer/bundle.h) on bundles in parts and
 * block-padded bundles: layer segments assembled in a set (each refused with its rule's message
 * when it does not continue the parts before it), lists continued across an early part and the
 * last; block-padded bundles (2.3): round trips, the byte image of their row sections, their
 * rules, padded segments in a set; the two-step parse held to the one-step one; unpadded bundles
 * pinned to the 2.2 writer's bytes. One bundle's codec: test_bundle.c; what both use:
 * kt_bundle_test.h.
 * Run: ctest -R test_bundle.
 */
#include "kt_bundle_test.h"

/* Segments that continue lists: an early part with every layer's entries so far (chunks final
 * before the last), then a last part with the rest and the decode rules. The set reads each
 * list across both, and refuses a continuation that pins after unpinned entries. */
static void test_continued_lists(void)
{
    enum { LAYERS = 3, HEADS = 2, DIM = 4 };
    char err[KT_ERR_MAX];
    const uint32_t ca[LAYERS * HEADS] = {5, 3, 0, 2, 4, 1}, cb[LAYERS * HEADS] = {4, 0, 3, 2, 1, 6};
    seqkv a, b;
    seqkv_make(&a, LAYERS, HEADS, DIM, KT_DTYPE_F32, ca, 100, "full");
    seqkv_make(&b, LAYERS, HEADS, DIM, KT_DTYPE_F32, cb, 100, "full");
    a.h.segment = b.h.segment = 1;
    a.h.first_token = 0;
    a.h.next_pos = 100;
    b.h.next_pos = 200;
    for (int i = 0; i < LAYERS * HEADS; i++) {
        a.lists[i].pinned = b.lists[i].pinned = 0;
        for (uint32_t j = 0; j < cb[i]; j++) b.pos[i][j] += 100; /* after every entry of a */
    }
    uint64_t na, nb;
    uint8_t *ba = encode(&a, &na), *bb = encode(&b, &nb);
    kt_bundle_view parts[2], v;
    kt_bundle_set set;
    kt_bundle_set_init(&set, parts, 2);
    REQUIRE(kt_bundle_parse(ba, na, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 0, err) == 0, "early part: %s", err);
    REQUIRE(kt_bundle_parse(bb, nb, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 1, err) == 0, "last part: %s", err);
    CHECK(set.complete && set.hdr.n_layers == LAYERS && set.hdr.next_pos == 200 &&
          set.n_entries == 15 + 16, "set of continued lists: %llu entries",
          (unsigned long long)set.n_entries);
    for (int i = 0; i < LAYERS * HEADS; i++) {
        kt_bundle_list l;
        REQUIRE(kt_bundle_set_list(&set, (uint32_t)i / HEADS, (uint32_t)i % HEADS, &l, err) == 0, "%s", err);
        const uint32_t n = ca[i] + cb[i];
        CHECK(l.count == n && l.window == b.lists[i].window && l.sink == b.lists[i].sink,
              "list %d: %u entries, the last piece's rule", i, l.count);
        int32_t pos[16];
        float k[16 * DIM];
        REQUIRE(kt_bundle_set_read(&set, (uint32_t)i / HEADS, (uint32_t)i % HEADS, 0,
                                   &(kt_rows){n, pos, KT_DTYPE_F32, k, NULL}, err) == 0,
                "%s", err);
        CHECK(!memcmp(pos, a.pos[i], ca[i] * sizeof *pos) && !memcmp(pos + ca[i], b.pos[i], cb[i] * sizeof *pos) &&
              !memcmp(k, a.k[i], ca[i] * DIM * sizeof *k) &&
              !memcmp(k + ca[i] * DIM, b.k[i], cb[i] * DIM * sizeof *k), "list %d read across the parts", i);
        if (n >= 3) { /* a read that starts inside the first piece and ends in the second */
            int32_t p2[2];
            REQUIRE(kt_bundle_set_read(&set, (uint32_t)i / HEADS, (uint32_t)i % HEADS, n - 2,
                                       &(kt_rows){2, p2, KT_DTYPE_F32, NULL, NULL}, err) == 0,
                    "%s", err);
            CHECK(p2[0] == pos[n - 2] && p2[1] == pos[n - 1], "list %d: a partial read", i);
        }
        CHECK(kt_bundle_set_read(&set, (uint32_t)i / HEADS, (uint32_t)i % HEADS, n,
                                 &(kt_rows){1, pos, KT_DTYPE_F32, NULL, NULL}, err) == -1,
              "list %d: a read past the end is refused", i);
    }
    /* pinning after unpinned entries */
    free(bb);
    b.lists[0].pinned = 1;
    bb = encode(&b, &nb);
    kt_bundle_set_init(&set, parts, 2);
    REQUIRE(kt_bundle_parse(ba, na, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 0, err) == 0, "%s", err);
    REQUIRE(kt_bundle_parse(bb, nb, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 1, err) == -1 && strstr(err, "after unpinned ones"), "%s", err);
    free(ba);
    free(bb);
    seqkv_free(&a);
    seqkv_free(&b);
}

/* A request's KV in layer segments (format 2.2), as a pipelining prefill node writes it: each
 * segment parses on its own, the set assembles them into the whole, and every way segments can
 * fail to fit together is refused. */
static void test_segments(void)
{
    enum { LAYERS = 3, HEADS = 2, DIM = 8, NEXT = 50 };
    char err[KT_ERR_MAX];
    seqkv seg[LAYERS];
    uint8_t *buf[LAYERS];
    uint64_t size[LAYERS];
    kt_bundle_view parts[LAYERS], v;
    for (uint32_t l = 0; l < LAYERS; l++) {
        const uint32_t counts[HEADS] = {10 + l, l == 1 ? 0 : 7};
        seqkv_make(&seg[l], 1, HEADS, DIM, KT_DTYPE_F32, counts, NEXT, "full");
        seg[l].h.segment = 1;
        seg[l].h.first_layer = l;
        seg[l].h.first_token = l == LAYERS - 1 ? 42 : 0; /* provisional until the last */
        buf[l] = encode(&seg[l], &size[l]);
        REQUIRE(kt_bundle_parse(buf[l], size[l], &v, err) == 0, "segment %u: %s", l, err);
        CHECK(v.version_minor == 2 && v.hdr.segment == 1 && v.hdr.first_layer == l &&
              v.hdr.n_layers == 1, "segment %u parsed as 2.%u, first layer %u", l,
              v.version_minor, v.hdr.first_layer);
    }
    kt_bundle_set set;
    kt_bundle_set_init(&set, parts, LAYERS);
    for (uint32_t l = 0; l < LAYERS; l++) {
        REQUIRE(kt_bundle_parse(buf[l], size[l], &v, err) == 0, "%s", err);
        CHECK(kt_bundle_set_add(&set, &v, l == LAYERS - 1, err) == 0, "add %u: %s", l, err);
    }
    CHECK(set.complete && set.hdr.n_layers == LAYERS && set.hdr.first_token == 42 &&
          set.hdr.segment == 0 && set.size == size[0] + size[1] + size[2],
          "set: %u layers, first token %d", set.hdr.n_layers, set.hdr.first_token);
    CHECK(kt_bundle_check_model(&set.hdr, "0123456789abcdef", LAYERS, HEADS, DIM, err) == 0, "%s", err);
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t h = 0; h < HEADS; h++) {
            kt_bundle_list lv;
            REQUIRE(kt_bundle_set_list(&set, l, h, &lv, err) == 0, "%s", err);
            const uint32_t c = seg[l].lists[h].count;
            int32_t pos[16];
            float k[16 * DIM], vv[16 * DIM];
            CHECK(lv.count == c && lv.window == seg[l].lists[h].window, "list (%u, %u)", l, h);
            REQUIRE(kt_bundle_set_read(&set, l, h, 0, &(kt_rows){c, pos, KT_DTYPE_F32, k, vv},
                                       err) == 0,
                    "%s", err);
            CHECK(memcmp(pos, seg[l].pos[h], c * sizeof *pos) == 0 &&
                  memcmp(k, seg[l].k[h], c * DIM * sizeof *k) == 0 &&
                  memcmp(vv, seg[l].v[h], c * DIM * sizeof *vv) == 0, "list (%u, %u) rows", l, h);
        }
    kt_bundle_list lv;
    CHECK(kt_bundle_set_list(&set, LAYERS, 0, &lv, err) == -1, "layer past the set");
    CHECK(kt_bundle_set_add(&set, &v, 1, err) == -1 && strstr(err, "complete"), "add after the last");

#define SET_REFUSES(adds, needle)                                                             \
    do {                                                                                       \
        kt_bundle_set_init(&set, parts, LAYERS);                                               \
        int rc_ = 0;                                                                           \
        for (size_t i_ = 0; i_ < sizeof adds / sizeof adds[0] && rc_ == 0; i_++) {             \
            REQUIRE(kt_bundle_parse(buf[adds[i_][0]], size[adds[i_][0]], &v, err) == 0, "%s", err); \
            rc_ = kt_bundle_set_add(&set, &v, adds[i_][1], err);                               \
        }                                                                                      \
        CHECK(rc_ == -1 && strstr(err, needle), "expected '%s', got '%s'", needle, err);        \
    } while (0)
    const int start1[][2] = {{1, 1}};
    SET_REFUSES(start1, "starts at layer 1, not 0");
    const int gap[][2] = {{0, 0}, {2, 1}};
    SET_REFUSES(gap, "starts at layer 2, past layer 1");
    const int again[][2] = {{0, 0}, {0, 0}}; /* continues layer 0, but with the same positions */
    SET_REFUSES(again, "not after its position");
    kt_bundle_set_init(&set, parts, 1); /* a set with room for one part */
    REQUIRE(kt_bundle_parse(buf[0], size[0], &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 0, err) == 0, "%s", err);
    REQUIRE(kt_bundle_parse(buf[1], size[1], &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 1, err) == -1 && strstr(err, "more than 1 parts"), "%s", err);

    /* a segment that disagrees with the first: another policy */
    seqkv other;
    const uint32_t counts[HEADS] = {3, 3};
    seqkv_make(&other, 1, HEADS, DIM, KT_DTYPE_F32, counts, NEXT, "streaming:sink=4,window=16");
    other.h.segment = 1;
    other.h.first_layer = 1;
    uint64_t on;
    uint8_t *ob = encode(&other, &on);
    kt_bundle_set_init(&set, parts, LAYERS);
    REQUIRE(kt_bundle_parse(buf[0], size[0], &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 0, err) == 0, "%s", err);
    REQUIRE(kt_bundle_parse(ob, on, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 1, err) == -1 && strstr(err, "disagrees"), "%s", err);
    /* the last segment's next_pos must lie above every earlier position */
    free(ob);
    seqkv_free(&other);
    seqkv_make(&other, 1, HEADS, DIM, KT_DTYPE_F32, counts, 5, "full");
    other.h.prompt_len = NEXT;
    other.h.segment = 1;
    other.h.first_layer = 1;
    ob = encode(&other, &on);
    kt_bundle_set_init(&set, parts, LAYERS);
    REQUIRE(kt_bundle_parse(buf[0], size[0], &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 0, err) == 0, "%s", err);
    REQUIRE(kt_bundle_parse(ob, on, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 1, err) == -1 && strstr(err, "not below the last segment's next_pos"),
          "%s", err);
    CHECK(set.n_parts == 1 && !set.complete, "a refused part leaves the set as it was");
    free(ob);
    seqkv_free(&other);

    /* a whole bundle comes alone */
    seqkv whole;
    const uint32_t wc[HEADS] = {4, 4};
    seqkv_make(&whole, 1, HEADS, DIM, KT_DTYPE_F32, wc, NEXT, "full");
    uint64_t wn;
    uint8_t *wb = encode(&whole, &wn);
    kt_bundle_set_init(&set, parts, LAYERS);
    REQUIRE(kt_bundle_parse(wb, wn, &v, err) == 0, "%s", err);
    CHECK(v.version_minor == 0 && v.hdr.segment == 0, "a whole f32 bundle stays 2.0");
    CHECK(kt_bundle_set_add(&set, &v, 0, err) == -1 && strstr(err, "whole bundle"), "%s", err);
    REQUIRE(kt_bundle_parse(buf[0], size[0], &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 0, err) == 0, "%s", err);
    REQUIRE(kt_bundle_parse(wb, wn, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_set_add(&set, &v, 1, err) == -1 && strstr(err, "not a layer segment"), "%s", err);

    /* the header's rules: the flag needs 2.2, the first layer lives only in segments */
    uint8_t *b = malloc(size[1]);
    memcpy(b, buf[1], size[1]);
    kt_wr16(b + 10, 1);
    reseal_header(b);
    REJECT(b, size[1], "segments are 2.2");
    memcpy(b, buf[1], size[1]);
    kt_wr32(b + 24, 0); /* the segment flag off, the first layer left in the reserved field */
    reseal_header(b);
    REJECT(b, size[1], "reserved header field at offset 78");
    memcpy(b, buf[1], size[1]);
    kt_wr16(b + 78, KT_BUNDLE_MAX_LAYERS);
    reseal_header(b);
    REJECT(b, size[1], "past the 1024-layer limit");
    free(b);
    kt_bundle_header hh = whole.h;
    hh.first_layer = 2;
    uint64_t sz;
    CHECK(kt_bundle_size(&hh, whole.lists, &sz, err) == -1 && strstr(err, "whole bundle"),
          "the writer refuses a first layer outside a segment: %s", err);
    free(wb);
    seqkv_free(&whole);
    for (uint32_t l = 0; l < LAYERS; l++) {
        free(buf[l]);
        seqkv_free(&seg[l]);
    }
#undef SET_REFUSES
    test_continued_lists();
}


/* ------------------------------------------------------------------ block padding (2.3) */

/* A bundle from fixed data (no random numbers): entry j of list i has position 3j + i % 2 and
 * element e of its K row (j + 1) * 0.375 - e * 0.125 + i, its V row the negation. dtype, segment
 * and block_rows as given. Returns a malloc'd buffer of *n bytes. */
static uint8_t *fixed_bundle(kt_dtype dtype, int segment, uint32_t block_rows, uint64_t *n)
{
    enum { L = 2, H = 2, D = 6 };
    static const uint32_t counts[L * H] = {3, 0, 5, 1};
    char err[KT_ERR_MAX];
    kt_bundle_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.fingerprint, "00112233aabbccdd", 17);
    h.n_layers = L;
    h.n_kv_heads = H;
    h.head_dim = D;
    h.dtype = dtype;
    h.first_token = 9;
    h.prompt_len = 20;
    h.next_pos = 20;
    h.segment = (uint32_t)segment;
    h.first_layer = segment ? 1 : 0;
    h.block_rows = block_rows;
    snprintf(h.policy, sizeof h.policy, "streaming:sink=4,window=16");
    kt_bundle_list lists[L * H];
    memset(lists, 0, sizeof lists);
    for (int i = 0; i < L * H; i++) {
        lists[i].count = counts[i];
        lists[i].pinned = counts[i] / 2;
        lists[i].window = i ? 16 : KT_BUNDLE_WINDOW_DENSE;
        lists[i].sink = 4;
        lists[i].lazy = 1;
    }
    if (kt_bundle_size(&h, lists, n, err)) return NULL;
    uint8_t *b = malloc(*n);
    memset(b, 0x5c, *n);
    kt_bundle_writer w;
    if (kt_bundle_writer_begin(&w, &h, lists, b, *n, err)) return NULL;
    for (int i = 0; i < L * H; i++)
        for (uint32_t j = 0; j < counts[i]; j++) {
            int32_t p = (int32_t)(3 * j) + i % 2;
            float k[D], v[D];
            for (int e = 0; e < D; e++) {
                k[e] = (float)(j + 1) * 0.375f - (float)e * 0.125f + (float)i;
                v[e] = -k[e];
            }
            if (kt_bundle_writer_put(&w, (uint32_t)i / H, (uint32_t)i % H,
                                     &(kt_rows_in){1, &p, KT_DTYPE_F32, k, v}, err))
                return NULL;
        }
    uint64_t got;
    if (kt_bundle_writer_finish(&w, &got, err) || got != *n) return NULL;
    return b;
}

/* An unpadded bundle is byte for byte what the writer made before block padding existed: the
 * size and CRC32C of fixed_bundle's output for every dtype, whole and as a segment, as the
 * 2.2 writer produced them. */
static void test_unpadded_bytes(void)
{
    static const struct {
        kt_dtype dtype;
        int segment;
        uint64_t size;
        uint32_t crc;
    } want[] = {
        {KT_DTYPE_F32, 0, 984, 0x7a9a7988u}, {KT_DTYPE_BF16, 0, 748, 0xd1a46a3eu},
        {KT_DTYPE_F16, 0, 748, 0x697b624cu}, {KT_DTYPE_INT8_TOKEN, 0, 740, 0x88f84925u},
        {KT_DTYPE_FP8_E4M3_TOKEN, 0, 740, 0x0b35b6c0u}, {KT_DTYPE_F32, 1, 984, 0x3ae13565u},
        {KT_DTYPE_BF16, 1, 748, 0xabeba774u}, {KT_DTYPE_F16, 1, 748, 0x1334af06u},
        {KT_DTYPE_INT8_TOKEN, 1, 740, 0xca671654u}, {KT_DTYPE_FP8_E4M3_TOKEN, 1, 740, 0x49aae9b1u},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        uint64_t n = 0;
        uint8_t *b = fixed_bundle(want[i].dtype, want[i].segment, 0, &n);
        REQUIRE(b, "fixed bundle %zu not written", i);
        CHECK(n == want[i].size && kt_crc32c(0, b, n) == want[i].crc,
              "%s%s: %llu bytes crc 0x%08x, the 2.2 writer made %llu bytes crc 0x%08x",
              kt_dtype_name(want[i].dtype), want[i].segment ? " segment" : "", (unsigned long long)n,
              kt_crc32c(0, b, n), (unsigned long long)want[i].size, want[i].crc);
        free(b);
    }
}

/* Where section s is in a bundle, padded (table at 88) or not (at 80). */
static unsigned table_of(const uint8_t *b) { return kt_rd32(b + 24) & 2 ? 88 : 80; }
static uint64_t psec_off(const uint8_t *b, int s) { return kt_rd64(b + table_of(b) + 24 * s + 8); }
static uint64_t psec_len(const uint8_t *b, int s) { return kt_rd64(b + table_of(b) + 24 * s + 16); }
static void preseal(uint8_t *b, int s)
{
    kt_wr32(b + table_of(b) + 24 * s + 4, kt_crc32c(0, b + psec_off(b, s), psec_len(b, s)));
    reseal_header(b);
}

/* The byte image of a padded bundle: each row section (positions, K, V, scales) is the
 * concatenation, list after list, of blocks of block_rows rows holding the list's rows as the
 * packed bundle has them, then zeros. So a run of a receiver's KV blocks takes K and V as they
 * are. Checked for f32, bf16 and int8 with lists of 0 entries, of a multiple of block_rows and
 * of others. */
static void test_padded_image(void)
{
    enum { L = 2, H = 3, D = 8, BR = 4 };
    static const uint32_t counts[L * H] = {0, 4, 5, 1, 8, 3};
    const kt_dtype dtypes[] = {KT_DTYPE_F32, KT_DTYPE_BF16, KT_DTYPE_INT8_TOKEN};
    char err[KT_ERR_MAX];
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        seqkv s;
        seqkv_make(&s, L, H, D, dtypes[d], counts, 30, "full");
        uint64_t np, nu;
        uint8_t *packed = encode(&s, &nu);
        s.h.block_rows = BR;
        uint8_t *padded = encode(&s, &np);
        kt_bundle_view vu, vp;
        REQUIRE(kt_bundle_parse(packed, nu, &vu, err) == 0, "%s", err);
        REQUIRE(kt_bundle_parse(padded, np, &vp, err) == 0, "%s", err);
        CHECK(vp.version_minor == 3 && vp.hdr.block_rows == BR && (vp.flags & 2) && kt_rd32(padded + 80) == BR &&
              kt_rd32(padded + 84) == 0, "%s: padded header", kt_dtype_name(dtypes[d]));
        CHECK(vp.n_entries == 21 && vp.n_rows == 28 && vu.n_rows == 21, "%s: %llu entries in %llu rows",
              kt_dtype_name(dtypes[d]), (unsigned long long)vp.n_entries, (unsigned long long)vp.n_rows);
        const int n_sec = kt_dtype_quantized(dtypes[d]) ? 6 : 4;
        for (int sec = 1; sec < n_sec; sec++) {
            const size_t row = sec == 2 || sec == 3 ? vp.row_bytes : 4;
            uint8_t *image = calloc(28, row);
            uint64_t at_u = 0, at_p = 0; /* the running row of each bundle */
            for (int i = 0; i < L * H; i++) {
                memcpy(image + at_p * row, packed + psec_off(packed, sec) + at_u * row, counts[i] * row);
                at_u += counts[i];
                at_p += (counts[i] + BR - 1) / BR * BR;
            }
            CHECK(psec_len(padded, sec) == 28 * row &&
                  !memcmp(padded + psec_off(padded, sec), image, 28 * row),
                  "%s: section %d is not the lists' zero-padded blocks", kt_dtype_name(dtypes[d]), sec);
            free(image);
        }
        /* the padded bundle reads back the same rows, bit for bit (so a NaN would differ) */
        for (int i = 0; i < L * H; i++) {
            kt_bundle_list_view a, b;
            REQUIRE(kt_bundle_view_list(&vu, (uint32_t)i / H, (uint32_t)i % H, &a, err) == 0, "%s", err);
            REQUIRE(kt_bundle_view_list(&vp, (uint32_t)i / H, (uint32_t)i % H, &b, err) == 0, "%s", err);
            CHECK(b.first % BR == 0 && a.count == b.count, "list %d: first %llu", i, (unsigned long long)b.first);
            float ka[8 * D + 1], kb[8 * D + 1], va[8 * D + 1], vb[8 * D + 1];
            int32_t pa[9], pb[9];
            REQUIRE(kt_bundle_list_read(&vu, &a, 0, &(kt_rows){a.count, pa, KT_DTYPE_F32, ka, va},
                                        err) == 0,
                    "%s", err);
            REQUIRE(kt_bundle_list_read(&vp, &b, 0, &(kt_rows){b.count, pb, KT_DTYPE_F32, kb, vb},
                                        err) == 0,
                    "%s", err);
            CHECK(!memcmp(pa, pb, a.count * 4) && !memcmp(ka, kb, a.count * D * 4) &&
                  !memcmp(va, vb, a.count * D * 4), "%s list %d: padded rows differ", kt_dtype_name(dtypes[d]), i);
        }
        free(padded);
        free(packed);
        seqkv_free(&s);
    }
    /* sizes: padding rows are counted, a list of 0 takes none, block_rows is bounded */
    seqkv s;
    seqkv_make(&s, L, H, D, KT_DTYPE_F32, counts, 30, "full");
    uint64_t n1, n2;
    s.h.block_rows = 1; /* padded in form only: no padding row */
    uint8_t *b1 = encode(&s, &n1);
    kt_bundle_view v;
    REQUIRE(kt_bundle_parse(b1, n1, &v, err) == 0, "%s", err);
    CHECK(v.n_rows == 21 && v.version_minor == 3, "block_rows 1: %llu rows", (unsigned long long)v.n_rows);
    s.h.block_rows = KT_BUNDLE_MAX_BLOCK_ROWS;
    uint8_t *b2 = encode(&s, &n2);
    REQUIRE(kt_bundle_parse(b2, n2, &v, err) == 0, "%s", err);
    CHECK(v.n_rows == 5 * KT_BUNDLE_MAX_BLOCK_ROWS, "block_rows %d: %llu rows", KT_BUNDLE_MAX_BLOCK_ROWS,
          (unsigned long long)v.n_rows);
    s.h.block_rows = KT_BUNDLE_MAX_BLOCK_ROWS + 1;
    CHECK(kt_bundle_size(&s.h, s.lists, &n1, err) == -1, "block_rows past the bound accepted");
    CHECK_ERR_HAS(err, "block_rows 4097 out of range [0, 4096]");
    free(b1);
    free(b2);
    seqkv_free(&s);
}

/* Every rule of a padded bundle, each broken once (resealed where a checksum would catch it). */
static void test_padded_damage(void)
{
    seqkv s;
    seqkv_make(&s, 2, 2, 4, KT_DTYPE_F32, BASE_COUNTS, 12, "full"); /* counts 3 0 2 5 */
    s.h.block_rows = 4; /* rows 4 0 4 8: lists start at rows 0 4 4 8 */
    uint64_t n;
    uint8_t *good = encode(&s, &n);
    uint8_t *b = malloc(n);
#define FRESH() memcpy(b, good, n)
    FRESH();
    ACCEPT(b, n);
    REQUIRE(kt_rd32(b + 12) == 192 && psec_off(b, SEC_LISTS) == 192 && psec_len(b, SEC_POS) == 64,
            "unexpected padded layout");
    const uint64_t pt = psec_off(good, SEC_POS), kt = psec_off(good, SEC_K), vt = psec_off(good, SEC_V);
    /* padding rows: positions, K, V */
    FRESH(); b[pt + 3 * 4] = 1; preseal(b, SEC_POS);
    REJECT(b, n, "section positions padding row 3 (after the 3 entries of list (layer 0, head 0)) has byte 0 = 0x01, not zero");
    FRESH(); b[pt + 7 * 4 + 3] = 0x80; preseal(b, SEC_POS);
    REJECT(b, n, "section positions padding row 7 (after the 2 entries of list (layer 1, head 0)) has byte 3 = 0x80");
    FRESH(); b[kt + 3 * 16 + 5] = 0x40; preseal(b, SEC_K);
    REJECT(b, n, "section K padding row 3 (after the 3 entries of list (layer 0, head 0)) has byte 5 = 0x40, not zero");
    FRESH(); b[vt + 15 * 16 + 15] = 1; preseal(b, SEC_V);
    REJECT(b, n, "section V padding row 15 (after the 5 entries of list (layer 1, head 1)) has byte 15");
    FRESH(); b[vt + 15 * 16 + 15] = 1; REJECT(b, n, "section V checksum mismatch"); /* not resealed */
    /* `first` must follow the padded layout */
    const uint64_t lt = psec_off(good, SEC_LISTS);
    FRESH(); kt_wr64(b + lt + 40 * 1, 3); preseal(b, SEC_LISTS);
    REJECT(b, n, "list (layer 0, head 1) starts at row 3, expected 4 (the sum of the counts before it, each rounded up to a multiple of block_rows)");
    FRESH(); kt_wr64(b + lt + 40 * 3, 6); preseal(b, SEC_LISTS); REJECT(b, n, "list (layer 1, head 1) starts at row 6, expected 8");
    /* the 8 bytes after the fixed header */
    FRESH(); kt_wr32(b + 80, 0); reseal_header(b); REJECT(b, n, "block_rows 0 out of range [1, 4096] in a block-padded bundle");
    FRESH(); kt_wr32(b + 80, 4097); reseal_header(b); REJECT(b, n, "block_rows 4097 out of range");
    FRESH(); kt_wr32(b + 80, 8); reseal_header(b); REJECT(b, n, "list (layer 0, head 1) starts at row 4, expected 8");
    FRESH(); kt_wr32(b + 80, 2); reseal_header(b); REJECT(b, n, "list (layer 1, head 1) starts at row 8, expected 6");
    FRESH(); kt_wr32(b + 84, 1); reseal_header(b); REJECT(b, n, "header word at offset 84 is 0x00000001, not zero");
    /* the flag and the version */
    FRESH(); kt_wr16(b + 10, 2); reseal_header(b); REJECT(b, n, "unknown required flags 0x0002 in a version 2.2 bundle");
    FRESH(); kt_wr32(b + 24, 0); reseal_header(b); REJECT(b, n, "policy spec is not UTF-8"); /* table read at 80 */
    FRESH(); kt_wr16(b + 10, 9); reseal_header(b); ACCEPT(b, n); /* a newer minor */
    /* the header size counts the 8 bytes: with a 13-byte policy, 88 + 96 + 13 > 192 */
    {
        seqkv t;
        seqkv_make(&t, 2, 2, 4, KT_DTYPE_F32, BASE_COUNTS, 12, "streaming:w=1");
        uint64_t m;
        uint8_t *u = encode(&t, &m);
        CHECK(kt_rd32(u + 12) == 192, "unpadded header %u", kt_rd32(u + 12));
        free(u);
        t.h.block_rows = 2;
        u = encode(&t, &m);
        CHECK(kt_rd32(u + 12) == 256, "padded header %u", kt_rd32(u + 12));
        ACCEPT(u, m);
        kt_wr32(u + 12, 192);
        reseal_header(u);
        REJECT(u, m, "header_size 192, expected 256 for 4 sections and a 13-byte policy after the 8 bytes of block padding");
        free(u);
        seqkv_free(&t);
    }
    free(b);
    free(good);
    /* a quantized payload's scale sections are padded too */
    seqkv_free(&s);
    seqkv_make(&s, 2, 2, 4, KT_DTYPE_INT8_TOKEN, BASE_COUNTS, 12, "full");
    s.h.block_rows = 4;
    good = encode(&s, &n);
    b = malloc(n);
    FRESH(); ACCEPT(b, n);
    FRESH(); b[psec_off(b, 4) + 3 * 4 + 2] = 0x3f; preseal(b, 4);
    REJECT(b, n, "section K scales padding row 3 (after the 3 entries of list (layer 0, head 0)) has byte 2 = 0x3f");
    FRESH(); b[psec_off(b, 5) + 15 * 4] = 1; preseal(b, 5); REJECT(b, n, "section V scales padding row 15");
    FRESH(); b[psec_off(b, SEC_K) + 3 * 4] = 0xff; preseal(b, SEC_K); REJECT(b, n, "section K padding row 3");
#undef FRESH
    free(b);
    free(good);
    seqkv_free(&s);
}

/* Parse the bundle at b (n bytes) in two steps, its head, K and V each copied to a buffer of
 * its own, and hold the result to the one-step parse: same header, counts, positions and rows
 * bit for bit. Then a damaged K piece is refused by kt_bundle_parse_rows, and the view it
 * leaves completes with the intact one. `what` names the bundle in failures. */
static void two_step_equals_one(const uint8_t *b, uint64_t n, const char *what)
{
    char err[KT_ERR_MAX];
    kt_bundle_view one, two;
    kt_bundle_layout lay;
    REQUIRE(kt_bundle_parse(b, n, &one, err) == 0, "%s: %s", what, err);
    const uint32_t hs = kt_rd32(b + 12);
    REQUIRE(kt_bundle_layout_read(b, hs, &lay, err) == 0, "%s: layout from the header alone: %s", what, err);
    CHECK(lay.size == n && lay.head_len == (uint64_t)(one.k - b) && lay.k_off == lay.head_len &&
          lay.k_len == one.n_rows * one.row_bytes && lay.v_off == (uint64_t)(one.v - b) &&
          lay.v_len == lay.k_len && lay.block_rows == one.hdr.block_rows && lay.split &&
          lay.v_off + lay.v_len == n, "%s: layout", what);
    CHECK(kt_bundle_layout_read(b, hs - 1, &lay, err) == -1, "%s: layout from a short header", what);
    CHECK_ERR_HAS(err, "truncated");
    uint8_t *head = malloc(lay.head_len), *k = malloc(lay.k_len + 1), *v = malloc(lay.v_len + 1);
    memcpy(head, b, lay.head_len);
    memcpy(k, b + lay.k_off, lay.k_len);
    memcpy(v, b + lay.v_off, lay.v_len);
    REQUIRE(kt_bundle_parse_head(head, lay.head_len, n, &two, err) == 0, "%s: head: %s", what, err);
    CHECK(two.k == NULL && two.v == NULL && two.base == head && two.n_entries == one.n_entries &&
          two.n_rows == one.n_rows && two.size == one.size && two.row_bytes == one.row_bytes &&
          two.version_minor == one.version_minor && !memcmp(&two.hdr, &one.hdr, sizeof one.hdr),
          "%s: head view", what);
    {   /* before its rows: counts and positions readable, rows not, and no set takes it */
        kt_bundle_list_view lv;
        int32_t p[64];
        float r[64 * 8];
        REQUIRE(kt_bundle_view_list(&two, 0, 0, &lv, err) == 0, "%s", err);
        CHECK(lv.k == NULL && lv.v == NULL, "%s: rows of a head", what);
        CHECK(kt_bundle_list_read(&two, &lv, 0, &(kt_rows){lv.count, p, KT_DTYPE_F32, NULL, NULL},
                                  err) == 0,
              "%s", err);
        if (lv.count && lv.count <= 64 && one.hdr.head_dim <= 8) {
            CHECK(kt_bundle_list_read(&two, &lv, 0, &(kt_rows){1, NULL, KT_DTYPE_F32, r, NULL},
                                      err) == -1,
                  "%s: rows of a head read", what);
            CHECK_ERR_HAS(err, "not parsed yet");
        }
        kt_bundle_view part;
        kt_bundle_set set;
        kt_bundle_set_init(&set, &part, 1);
        CHECK(kt_bundle_set_add(&set, &two, 1, err) == -1, "%s: a head joined a set", what);
        CHECK_ERR_HAS(err, "no rows yet");
    }
    /* a damaged K piece: caught, and the view stays waiting for its rows */
    if (lay.k_len) {
        k[lay.k_len / 2] ^= 0x10;
        CHECK(kt_bundle_parse_rows(&two, k, v, err) == -1, "%s: a damaged K piece accepted", what);
        CHECK_ERR_HAS(err, "section K checksum mismatch");
        CHECK(two.k == NULL && two.v == NULL, "%s: rows set on failure", what);
        k[lay.k_len / 2] ^= 0x10;
        v[lay.v_len - 1] ^= 1;
        CHECK(kt_bundle_parse_rows(&two, k, v, err) == -1, "%s: a damaged V piece accepted", what);
        CHECK_ERR_HAS(err, "section V checksum mismatch");
        v[lay.v_len - 1] ^= 1;
    }
    REQUIRE(kt_bundle_parse_rows(&two, k, v, err) == 0, "%s: rows: %s", what, err);
    CHECK(two.k == k && two.v == v, "%s: rows where they lie", what);
    CHECK(kt_bundle_parse_rows(&two, k, v, err) == -1, "%s: rows parsed twice", what);
    for (uint32_t l = 0; l < one.hdr.n_layers; l++)
        for (uint32_t h = 0; h < one.hdr.n_kv_heads; h++) {
            kt_bundle_list_view a, c;
            REQUIRE(kt_bundle_view_list(&one, l, h, &a, err) == 0 && kt_bundle_view_list(&two, l, h, &c, err) == 0, "%s", err);
            CHECK(a.first == c.first && a.count == c.count && a.pinned == c.pinned && a.window == c.window &&
                  !memcmp(a.positions, c.positions, a.count * 4) && !memcmp(a.k, c.k, a.count * one.row_bytes) &&
                  !memcmp(a.v, c.v, a.count * one.row_bytes), "%s: list (%u, %u) differs", what, l, h);
            const size_t elems = (size_t)a.count * one.hdr.head_dim;
            float *ka = malloc(elems * 4 + 4), *kc = malloc(elems * 4 + 4);
            REQUIRE(kt_bundle_list_read(
                        &one, &a, 0, &(kt_rows){a.count, NULL, KT_DTYPE_F32, ka, NULL}, err) == 0 &&
                        kt_bundle_list_read(&two, &c, 0,
                                            &(kt_rows){c.count, NULL, KT_DTYPE_F32, kc, NULL},
                                            err) == 0,
                    "%s", err);
            CHECK(!memcmp(ka, kc, elems * 4), "%s: list (%u, %u) reads differ", what, l, h);
            free(ka);
            free(kc);
        }
    /* misuse: a one-step view, a wrong size, a head of the wrong length */
    CHECK(kt_bundle_parse_rows(&one, k, v, err) == -1, "%s: rows of a whole view", what);
    CHECK_ERR_HAS(err, "not a view from kt_bundle_parse_head");
    CHECK(kt_bundle_parse_head(head, lay.head_len, n + 64, &two, err) == -1, "%s: wrong size", what);
    CHECK_ERR_HAS(err, "size mismatch");
    CHECK(kt_bundle_parse_head(b, lay.head_len + 64, n, &two, err) == -1, "%s: long head", what);
    CHECK_ERR_HAS(err, "but section K starts at");
    CHECK(kt_bundle_parse_head(head, lay.head_len - 1, n, &two, err) == -1, "%s: short head", what);
    free(v);
    free(k);
    free(head);
}

/* The two-step parse on unpadded and padded bundles; layouts that cannot travel in pieces; a
 * head whose table vouches for a K piece with non-zero padding. */
static void test_two_step(void)
{
    char err[KT_ERR_MAX];
    static const uint32_t counts[6] = {0, 4, 5, 1, 8, 3};
    const struct {
        kt_dtype dtype;
        uint32_t dim, block_rows;
    } cases[] = {{KT_DTYPE_F32, 16, 0}, {KT_DTYPE_F32, 8, 4}, {KT_DTYPE_BF16, 16, 4},
                 {KT_DTYPE_F16, 32, 16}, {KT_DTYPE_BF16, 32, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        seqkv s;
        seqkv_make(&s, 2, 3, cases[c].dim, cases[c].dtype, counts, 30, "streaming:sink=4,window=16");
        s.h.block_rows = cases[c].block_rows;
        uint64_t n;
        uint8_t *b = encode(&s, &n);
        char what[64];
        snprintf(what, sizeof what, "%s block_rows %u", kt_dtype_name(cases[c].dtype), cases[c].block_rows);
        two_step_equals_one(b, n, what);
        if (cases[c].block_rows > 1) { /* non-zero padding in K with a checksum that matches it */
            kt_bundle_layout lay;
            REQUIRE(kt_bundle_layout_read(b, n, &lay, err) == 0, "%s", err);
            uint8_t *k = malloc(lay.k_len);
            memcpy(k, b + lay.k_off, lay.k_len);
            kt_bundle_view v;
            REQUIRE(kt_bundle_parse(b, n, &v, err) == 0, "%s", err);
            kt_bundle_list_view lv;
            REQUIRE(kt_bundle_view_list(&v, 0, 2, &lv, err) == 0, "%s", err); /* 5 entries */
            k[(lv.first + 5) * v.row_bytes] = 0x11;
            uint8_t *head = malloc(lay.head_len);
            memcpy(head, b, lay.head_len);
            kt_wr32(head + 88 + 24 * SEC_K + 4, kt_crc32c(0, k, lay.k_len));
            reseal_header(head);
            kt_bundle_view hv;
            REQUIRE(kt_bundle_parse_head(head, lay.head_len, n, &hv, err) == 0, "%s", err);
            CHECK(kt_bundle_parse_rows(&hv, k, b + lay.v_off, err) == -1, "%s: non-zero K padding accepted", what);
            char want[128];
            snprintf(want, sizeof want, "section K padding row %llu (after the 5 entries of list (layer 0, head 2))",
                     (unsigned long long)lv.first + 5);
            CHECK_ERR_HAS(err, want);
            free(head);
            free(k);
        }
        free(b);
        seqkv_free(&s);
    }
    /* layouts that do not split: quantized (scales follow V), a gap between K and V */
    const struct {
        kt_dtype dtype;
        uint32_t dim;
        const char *needle;
    } whole[] = {{KT_DTYPE_INT8_TOKEN, 8, "sections follow V"}, {KT_DTYPE_F32, 5, "a gap lies between K and V"}};
    for (size_t c = 0; c < 2; c++) {
        seqkv s;
        seqkv_make(&s, 2, 3, whole[c].dim, whole[c].dtype, counts, 30, "full");
        s.h.block_rows = 4;
        uint64_t n;
        uint8_t *b = encode(&s, &n);
        kt_bundle_layout lay;
        kt_bundle_view v;
        REQUIRE(kt_bundle_layout_read(b, n, &lay, err) == 0, "%s", err);
        CHECK(!lay.split && lay.block_rows == 4, "%s layout splits", kt_dtype_name(whole[c].dtype));
        CHECK(kt_bundle_parse_head(b, lay.head_len, n, &v, err) == -1, "head of a bundle that does not split");
        CHECK_ERR_HAS(err, whole[c].needle);
        free(b);
        seqkv_free(&s);
    }
    /* the layout of an unpadded bundle, read from the whole buffer, and of junk */
    uint64_t n;
    uint8_t *b = fixed_bundle(KT_DTYPE_BF16, 0, 0, &n);
    kt_bundle_layout lay;
    REQUIRE(kt_bundle_layout_read(b, n, &lay, err) == 0, "%s", err);
    CHECK(lay.size == n && lay.block_rows == 0 && lay.k_off == psec_off(b, SEC_K) &&
          lay.k_len == psec_len(b, SEC_K) && lay.v_off == psec_off(b, SEC_V) && lay.head_len == lay.k_off,
          "unpadded layout");
    b[40] ^= 1;
    CHECK(kt_bundle_layout_read(b, n, &lay, err) == -1, "layout of a damaged header");
    CHECK_ERR_HAS(err, "header checksum mismatch");
    CHECK(kt_bundle_layout_read(NULL, 0, &lay, err) == -1, "layout of nothing");
    free(b);
}

/* Padded layer segments assembled into a set read back the writer's rows; a part padded
 * otherwise than the first is refused. One part is parsed in two steps. */
static void test_padded_set(void)
{
    enum { LAYERS = 3, HEADS = 2, DIM = 8, NEXT = 50, BR = 4 };
    char err[KT_ERR_MAX];
    seqkv seg[LAYERS];
    uint8_t *buf[LAYERS];
    uint64_t size[LAYERS];
    kt_bundle_view parts[LAYERS], v;
    kt_bundle_set set;
    kt_bundle_set_init(&set, parts, LAYERS);
    for (uint32_t l = 0; l < LAYERS; l++) {
        const uint32_t counts[HEADS] = {l == 1 ? 0 : 8, 3 + l};
        seqkv_make(&seg[l], 1, HEADS, DIM, KT_DTYPE_F32, counts, NEXT, "full");
        seg[l].h.segment = 1;
        seg[l].h.first_layer = l;
        seg[l].h.block_rows = BR;
        buf[l] = encode(&seg[l], &size[l]);
        if (l == 1) { /* two steps, the rows left where they are in the buffer */
            kt_bundle_layout lay;
            REQUIRE(kt_bundle_layout_read(buf[l], size[l], &lay, err) == 0 && lay.split, "%s", err);
            REQUIRE(kt_bundle_parse_head(buf[l], lay.head_len, size[l], &v, err) == 0, "%s", err);
            REQUIRE(kt_bundle_parse_rows(&v, buf[l] + lay.k_off, buf[l] + lay.v_off, err) == 0, "%s", err);
        } else {
            REQUIRE(kt_bundle_parse(buf[l], size[l], &v, err) == 0, "%s", err);
        }
        CHECK(v.version_minor == 3 && v.hdr.segment && v.hdr.block_rows == BR, "segment %u header", l);
        CHECK(kt_bundle_set_add(&set, &v, l == LAYERS - 1, err) == 0, "add %u: %s", l, err);
    }
    CHECK(set.complete && set.hdr.block_rows == BR && set.hdr.n_layers == LAYERS, "padded set");
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t h = 0; h < HEADS; h++) {
            kt_bundle_list lv;
            REQUIRE(kt_bundle_set_list(&set, l, h, &lv, err) == 0, "%s", err);
            const uint32_t c = seg[l].lists[h].count;
            int32_t pos[16];
            float k[16 * DIM], vv[16 * DIM];
            CHECK(lv.count == c, "list (%u, %u): %u entries", l, h, lv.count);
            REQUIRE(kt_bundle_set_read(&set, l, h, 0, &(kt_rows){c, pos, KT_DTYPE_F32, k, vv},
                                       err) == 0,
                    "%s", err);
            CHECK(!memcmp(pos, seg[l].pos[h], c * sizeof *pos) && !memcmp(k, seg[l].k[h], c * DIM * sizeof *k) &&
                  !memcmp(vv, seg[l].v[h], c * DIM * sizeof *vv), "list (%u, %u) rows", l, h);
        }
    /* a part padded otherwise joins, read through its own view; the set's header then says 0 */
    seqkv other;
    const uint32_t oc[HEADS] = {2, 2};
    seqkv_make(&other, 1, HEADS, DIM, KT_DTYPE_F32, oc, NEXT, "full");
    other.h.segment = 1;
    other.h.first_layer = 1;
    for (int b2 = 0; b2 < 2; b2++) {
        other.h.block_rows = b2 ? 0 : 8;
        uint64_t on;
        uint8_t *ob = encode(&other, &on);
        kt_bundle_set_init(&set, parts, LAYERS);
        REQUIRE(kt_bundle_parse(buf[0], size[0], &v, err) == 0, "%s", err);
        CHECK(kt_bundle_set_add(&set, &v, 0, err) == 0, "%s", err);
        REQUIRE(kt_bundle_parse(ob, on, &v, err) == 0, "%s", err);
        CHECK(kt_bundle_set_add(&set, &v, 1, err) == 0 && set.n_parts == 2 && set.complete &&
                  set.hdr.block_rows == 0,
              "a part padded to %u after one padded to 4: %s", other.h.block_rows, err);
        for (uint32_t h = 0; h < HEADS; h++) {
            int32_t pos[2];
            float k[2 * DIM], vv[2 * DIM];
            REQUIRE(kt_bundle_set_read(&set, 1, h, 0, &(kt_rows){2, pos, KT_DTYPE_F32, k, vv},
                                       err) == 0,
                    "%s", err);
            CHECK(!memcmp(pos, other.pos[h], sizeof pos) && !memcmp(k, other.k[h], sizeof k) &&
                      !memcmp(vv, other.v[h], sizeof vv),
                  "list (1, %u) of the part padded to %u", h, other.h.block_rows);
        }
        free(ob);
    }
    seqkv_free(&other);
    for (uint32_t l = 0; l < LAYERS; l++) {
        free(buf[l]);
        seqkv_free(&seg[l]);
    }
}


int main(void)
{
    test_segments();

    /* block padding (2.3) and the two-step parse */
    test_unpadded_bytes();
    CHECK(round_trip_padded(2, 4, 8, KT_DTYPE_F32, SHAPE_MHA, 40, 4), "mha f32 padded to 4");
    CHECK(round_trip_padded(2, 4, 8, KT_DTYPE_BF16, SHAPE_MHA, 40, 3), "mha bf16 padded to 3");
    CHECK(round_trip_padded(2, 4, 8, KT_DTYPE_F16, SHAPE_MHA, 40, 16), "mha f16 padded to 16");
    CHECK(round_trip_padded(3, 2, 64, KT_DTYPE_INT8_TOKEN, SHAPE_GQA, 64, 16),
          "gqa int8 padded to 16");
    CHECK(round_trip_padded(3, 2, 64, KT_DTYPE_FP8_E4M3_TOKEN, SHAPE_GQA, 64, 17),
          "gqa fp8 padded to 17");
    CHECK(round_trip_padded(1, 4, 16, KT_DTYPE_F16, SHAPE_EMPTY, 1, 8), "all lists empty, padded");
    uint32_t wide[8 * 8];
    for (int i = 0; i < 64; i++) wide[i] = (uint32_t)(rnd() % 50);
    CHECK(round_trip_padded(8, 8, 128, KT_DTYPE_BF16, wide, 300, 16), "8x8x128 bf16 padded to 16");
    test_padded_image();
    test_padded_damage();
    test_two_step();
    test_padded_set();
    return kt_done("test_bundle_parts");
}
