/*
 * test_bundle.c - the KV bundle codec (kvtransfer/bundle.h): CRC32C against a bitwise
 * reference, the f16/bf16/fp8 conversions against independent oracles, round trips over several
 * shapes and every payload dtype with the size predicted exactly (int8 and fp8 within their
 * documented bounds), and for every validation
 * rule a damaged bundle refused with the message that rule gives. Block-padded bundles (2.3):
 * round trips, the byte image of their row sections, their rules, padded segments in a set;
 * the two-step parse held to the one-step one; unpadded bundles pinned to the 2.2 writer's bytes. Damage that a checksum would
 * catch first is "resealed" (checksums recomputed) so the semantic check itself is exercised.
 * Not tested here: the transport (none yet) and libFuzzer-scale inputs (tests/fuzz/fuzz_bundle.c).
 * Run: ctest -R test_bundle. With KT_BUNDLE_SEEDS=DIR it also writes the fuzz seeds
 * (tests/fuzz/corpus/bundle/) into DIR.
 */
#include "kr_test.h"

#include "bundle.h"
#include "quant_bound.h"
#include "le.h"

#include <stdint.h>

/* ------------------------------------------------------------------ helpers */

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float rndf(void) { return (float)((double)(rnd() >> 11) / (double)(1ull << 53) * 8.0 - 4.0); }


/* The bitwise CRC32C definition, independent of both library paths. */
static uint32_t crc_ref(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
    }
    return ~c;
}

static void header_init(kt_bundle_header *h, uint32_t layers, uint32_t heads, uint32_t dim,
                        kt_dtype dtype, int32_t next_pos, const char *policy)
{
    memset(h, 0, sizeof *h);
    snprintf(h->fingerprint, sizeof h->fingerprint, "0123456789abcdef");
    h->n_layers = layers;
    h->n_kv_heads = heads;
    h->head_dim = dim;
    h->dtype = dtype;
    h->first_token = 42;
    h->prompt_len = next_pos;
    h->next_pos = next_pos;
    snprintf(h->policy, sizeof h->policy, "%s", policy);
}

/* A sequence's KV as the prefill node holds it: float32 rows and positions per list. */
typedef struct seqkv {
    kt_bundle_header h;
    kt_bundle_list *lists;
    int32_t **pos; /* [list][count] */
    float **k, **v; /* [list][count * head_dim] */
} seqkv;

static void seqkv_make(seqkv *s, uint32_t layers, uint32_t heads, uint32_t dim, kt_dtype dtype,
                       const uint32_t *counts, int32_t next_pos, const char *policy)
{
    header_init(&s->h, layers, heads, dim, dtype, next_pos, policy);
    const uint32_t n = layers * heads;
    s->lists = calloc(n, sizeof *s->lists);
    s->pos = calloc(n, sizeof *s->pos);
    s->k = calloc(n, sizeof *s->k);
    s->v = calloc(n, sizeof *s->v);
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t c = counts[i];
        s->lists[i].count = c;
        s->lists[i].pinned = c ? (uint32_t)(rnd() % (c + 1)) : 0;
        s->lists[i].window = i % 3 == 0 ? KT_BUNDLE_WINDOW_DENSE : 16 + i;
        s->lists[i].sink = i % 5;
        s->lists[i].lazy = 1 + i % 4;
        s->lists[i].slack = i % 3;
        s->lists[i].max_drop = 2 * (i % 2);
        s->lists[i].flags = i % 2 ? KT_BUNDLE_LIST_REL : 0;
        s->pos[i] = malloc((c + 1) * sizeof(int32_t));
        s->k[i] = malloc((c * dim + 1) * sizeof(float));
        s->v[i] = malloc((c * dim + 1) * sizeof(float));
        /* c distinct increasing positions in [0, next_pos): skip forward at random */
        int32_t p = 0;
        for (uint32_t j = 0; j < c; j++) {
            int32_t room = next_pos - (int32_t)(c - j) - p; /* how far we may still skip */
            p += room > 0 ? (int32_t)(rnd() % (uint64_t)(room < 3 ? room + 1 : 3)) : 0;
            s->pos[i][j] = p++;
        }
        for (uint32_t j = 0; j < c * dim; j++) {
            s->k[i][j] = rndf();
            s->v[i][j] = rndf();
        }
    }
}

static void seqkv_free(seqkv *s)
{
    const uint32_t n = s->h.n_layers * s->h.n_kv_heads;
    for (uint32_t i = n; i-- > 0;) {
        free(s->v[i]);
        free(s->k[i]);
        free(s->pos[i]);
    }
    free(s->v);
    free(s->k);
    free(s->pos);
    free(s->lists);
}

/* Encodes s, streaming each list in runs of 1..4 entries as KV blocks would come. Returns a
 * malloc'd buffer of exactly the bundle's size (so ASan sees any overread). */
static uint8_t *encode(const seqkv *s, uint64_t *size_out)
{
    char err[KT_ERR_MAX];
    uint64_t want;
    REQUIRE(kt_bundle_size(&s->h, s->lists, &want, err) == 0, "size: %s", err);
    uint8_t *buf = malloc(want);
    memset(buf, 0xa5, want); /* the writer must define every byte */
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &s->h, s->lists, buf, want, err) == 0, "begin: %s", err);
    const uint32_t dim = s->h.head_dim;
    for (uint32_t l = 0; l < s->h.n_layers; l++)
        for (uint32_t hd = 0; hd < s->h.n_kv_heads; hd++) {
            const uint32_t i = l * s->h.n_kv_heads + hd, c = s->lists[i].count;
            for (uint32_t j = 0; j < c;) {
                uint32_t n = 1 + (uint32_t)(rnd() % 4);
                if (n > c - j) n = c - j;
                REQUIRE(kt_bundle_writer_put(&w, l, hd, n, s->pos[i] + j, KT_DTYPE_F32,
                                             s->k[i] + (size_t)j * dim, s->v[i] + (size_t)j * dim,
                                             err) == 0, "put: %s", err);
                j += n;
            }
        }
    uint64_t size;
    REQUIRE(kt_bundle_writer_finish(&w, &size, err) == 0, "finish: %s", err);
    CHECK(size == want, "finish says %llu bytes, kt_bundle_size said %llu",
          (unsigned long long)size, (unsigned long long)want);
    *size_out = size;
    return buf;
}

/* f32 -> dtype -> f32 by an oracle that does not use the library's conversions. */
static float bf16_oracle(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    uint32_t lo = b & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    memcpy(&flo, &lo, 4);
    memcpy(&fhi, &hi, 4);
    double dl = fabs((double)x - flo), dh = fabs((double)fhi - x);
    if (dl < dh) return flo;
    if (dh < dl) return fhi;
    return (lo >> 16) & 1 ? fhi : flo; /* tie: even */
}

static float rounded(float x, kt_dtype t)
{
    switch (t) {
    case KT_DTYPE_BF16: return bf16_oracle(x);
#ifdef __FLT16_MAX__
    case KT_DTYPE_F16: return (float)(_Float16)x; /* the compiler's own IEEE conversion */
#else
    case KT_DTYPE_F16: return kt_f16_to_f32(kt_f32_to_f16(x));
#endif
    default: return x;
    }
}

/* A list read with half-precision rows, as a decode node with a bf16 or f16 cache reads it:
 * each element is the float32 read (k, v: exact for an unquantized payload) rounded once to the
 * row dtype, and read in the payload's own dtype the rows are the payload's bytes; a quantized
 * payload is refused (it is read as float32 only). */
static void half_reads(const kt_bundle_view *v, const kt_bundle_list_view *lv, const float *k,
                       const float *vv)
{
    char err[KT_ERR_MAX];
    const size_t elems = (size_t)lv->count * v->hdr.head_dim;
    uint16_t *hk = malloc((elems + 1) * 2), *hv = malloc((elems + 1) * 2);
    const kt_dtype halves[2] = {KT_DTYPE_BF16, KT_DTYPE_F16};
    for (int t = 0; t < 2; t++) {
        const int rc = kt_bundle_list_read(v, lv, 0, lv->count, NULL, halves[t], hk, hv, err);
        if (kt_dtype_quantized(v->hdr.dtype)) {
            CHECK(rc == -1, "%s payload read as %s", kt_dtype_name(v->hdr.dtype), kt_dtype_name(halves[t]));
            CHECK_ERR_HAS(err, "read as f32");
            continue;
        }
        REQUIRE(rc == 0, "%s", err);
        int bad = 0;
        for (size_t e = 0; e < elems && bad < 3; e++) {
            const uint16_t wk = halves[t] == KT_DTYPE_BF16 ? kt_f32_to_bf16(k[e]) : kt_f32_to_f16(k[e]);
            const uint16_t wv = halves[t] == KT_DTYPE_BF16 ? kt_f32_to_bf16(vv[e]) : kt_f32_to_f16(vv[e]);
            if (hk[e] != wk || hv[e] != wv) {
                bad++;
                CHECK(0, "%s payload read as %s, elem %zu: K 0x%04x want 0x%04x, V 0x%04x want 0x%04x",
                      kt_dtype_name(v->hdr.dtype), kt_dtype_name(halves[t]), e, hk[e], wk, hv[e], wv);
            }
        }
        if (halves[t] == v->hdr.dtype)
            CHECK(!memcmp(hk, lv->k, elems * 2) && !memcmp(hv, lv->v, elems * 2),
                  "%s rows read as %s are not the payload's bytes", kt_dtype_name(v->hdr.dtype),
                  kt_dtype_name(halves[t]));
    }
    CHECK(kt_bundle_list_read(v, lv, 0, lv->count, NULL, KT_DTYPE_INT8_TOKEN, hk, hv, err) == -1,
          "rows read as int8");
    CHECK_ERR_HAS(err, "f32, f16 or bf16");
    free(hk);
    free(hv);
}

/* Rows a list of `count` entries takes in a bundle padded to block_rows (0: packed). */
static uint64_t padded_rows(uint32_t count, uint32_t block_rows)
{
    return block_rows ? ((uint64_t)count + block_rows - 1) / block_rows * block_rows : count;
}

static int round_trip_padded(uint32_t layers, uint32_t heads, uint32_t dim, kt_dtype dtype,
                             const uint32_t *counts, int32_t next_pos, uint32_t block_rows)
{
    char err[KT_ERR_MAX];
    seqkv s;
    const int before = kt_failures;
    seqkv_make(&s, layers, heads, dim, dtype, counts, next_pos, "streaming:sink=4,window=16,pos=abs");
    s.h.block_rows = block_rows;
    uint64_t size;
    uint8_t *buf = encode(&s, &size);
    kt_bundle_view v;
    int rc = kt_bundle_parse(buf, size, &v, err);
    CHECK(rc == 0, "%ux%ux%u %s: parse: %s", layers, heads, dim, kt_dtype_name(dtype), err);
    if (rc == 0) {
        CHECK(v.size == size, "view size");
        CHECK(strcmp(v.hdr.fingerprint, s.h.fingerprint) == 0, "fingerprint");
        CHECK(v.hdr.n_layers == layers && v.hdr.n_kv_heads == heads && v.hdr.head_dim == dim,
              "shape");
        CHECK(v.hdr.dtype == dtype, "dtype");
        CHECK(v.hdr.first_token == 42 && v.hdr.prompt_len == next_pos && v.hdr.next_pos == next_pos,
              "tokens");
        CHECK(strcmp(v.hdr.policy, s.h.policy) == 0, "policy '%s'", v.hdr.policy);
        const int quant = kt_dtype_quantized(dtype);
        CHECK(v.version_major == 2 && v.version_minor == (block_rows ? 3 : quant ? 1 : 0), "version");
        CHECK(v.hdr.block_rows == block_rows, "block_rows %u, wrote %u", v.hdr.block_rows, block_rows);
        CHECK((v.k_scale != NULL) == quant && (v.v_scale != NULL) == quant, "scale sections");
        CHECK(kt_bundle_check_model(&v.hdr, "0123456789abcdef", layers, heads, dim, err) == 0, "%s", err);
        uint64_t total = 0, rows = 0;
        float *k = malloc((next_pos * (size_t)dim + 1) * sizeof(float));
        float *vv = malloc((next_pos * (size_t)dim + 1) * sizeof(float));
        int32_t *pos = malloc(((size_t)next_pos + 1) * sizeof(int32_t));
        for (uint32_t l = 0; l < layers; l++)
            for (uint32_t hd = 0; hd < heads; hd++) {
                const uint32_t i = l * heads + hd;
                kt_bundle_list_view lv;
                REQUIRE(kt_bundle_view_list(&v, l, hd, &lv, err) == 0, "%s", err);
                const kt_bundle_list *m = &s.lists[i];
                CHECK(lv.count == m->count && lv.pinned == m->pinned && lv.window == m->window &&
                          lv.sink == m->sink && lv.lazy == m->lazy && lv.slack == m->slack &&
                          lv.max_drop == m->max_drop && lv.flags == m->flags,
                      "list %u meta", i);
                CHECK(lv.first == rows, "list %u first %llu, want %llu", i,
                      (unsigned long long)lv.first, (unsigned long long)rows);
                CHECK(lv.k == v.k + lv.first * v.row_bytes && lv.v == v.v + lv.first * v.row_bytes &&
                      lv.positions == v.positions + lv.first * 4, "list %u pointers", i);
                total += lv.count;
                rows += padded_rows(lv.count, block_rows);
                REQUIRE(kt_bundle_list_read(&v, &lv, 0, lv.count, pos, KT_DTYPE_F32, k, vv, err) == 0, "%s", err);
                CHECK(memcmp(pos, s.pos[i], lv.count * sizeof(int32_t)) == 0, "list %u positions", i);
                int bad = 0;
                for (size_t e = 0; quant && e < (size_t)lv.count * dim && bad < 3; e++) {
                    const size_t row = e / dim * dim;
                    if (!quant_within_bound(dtype, s.k[i] + row, dim, s.k[i][e], k[e]) ||
                        !quant_within_bound(dtype, s.v[i] + row, dim, s.v[i][e], vv[e])) {
                        bad++;
                        CHECK(0, "%s list %u elem %zu: K %a from %a, V %a from %a: past the bound",
                              kt_dtype_name(dtype), i, e, k[e], s.k[i][e], vv[e], s.v[i][e]);
                    }
                }
                for (size_t e = 0; !quant && e < (size_t)lv.count * dim && bad < 3; e++) {
                    float wk = rounded(s.k[i][e], dtype), wv = rounded(s.v[i][e], dtype);
                    if (memcmp(&wk, &k[e], 4) != 0 || memcmp(&wv, &vv[e], 4) != 0) {
                        bad++;
                        CHECK(0, "%s list %u elem %zu: K %a want %a, V %a want %a",
                              kt_dtype_name(dtype), i, e, k[e], wk, vv[e], wv);
                    }
                }
                /* a partial read gets the same rows */
                if (lv.count >= 2) {
                    float *part = malloc((size_t)dim * sizeof(float));
                    REQUIRE(kt_bundle_list_read(&v, &lv, lv.count - 1, 1, NULL, KT_DTYPE_F32, part, NULL, err) == 0,
                            "%s", err);
                    CHECK(memcmp(part, k + (size_t)(lv.count - 1) * dim, dim * sizeof(float)) == 0,
                          "partial read");
                    free(part);
                }
                CHECK(kt_bundle_list_read(&v, &lv, lv.count, 1, pos, KT_DTYPE_F32, NULL, NULL, err) == -1,
                      "read past the list");
                half_reads(&v, &lv, k, vv);
            }
        CHECK(total == v.n_entries, "n_entries");
        CHECK(rows == v.n_rows, "n_rows %llu, want %llu", (unsigned long long)v.n_rows,
              (unsigned long long)rows);
        kt_bundle_list_view lv;
        CHECK(kt_bundle_view_list(&v, layers, 0, &lv, err) == -1, "layer out of range accepted");
        CHECK_ERR_HAS(err, "outside");
        free(pos);
        free(vv);
        free(k);
    }
    free(buf);
    seqkv_free(&s);
    return kt_failures == before;
}

static int round_trip(uint32_t layers, uint32_t heads, uint32_t dim, kt_dtype dtype,
                      const uint32_t *counts, int32_t next_pos)
{
    return round_trip_padded(layers, heads, dim, dtype, counts, next_pos, 0);
}

/* ------------------------------------------------------------------ CRC and conversions */

static void test_crc(void)
{
    CHECK(kt_crc32c(0, "123456789", 9) == 0xe3069283u, "check value 0x%08x",
          kt_crc32c(0, "123456789", 9));
    uint8_t z[32] = {0};
    CHECK(kt_crc32c(0, z, 32) == 0x8a9136aau, "32 zeros: 0x%08x", kt_crc32c(0, z, 32));
    CHECK(kt_crc32c(0, NULL, 0) == 0, "empty");
    CHECK(kt_crc32c_portable(0, "123456789", 9) == 0xe3069283u, "table check value");
    uint8_t buf[1100];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)rnd();
    for (int t = 0; t < 300; t++) {
        size_t off = rnd() % 16, n = rnd() % (sizeof buf - 16), cut = n ? rnd() % n : 0;
        uint32_t want = crc_ref(buf + off, n);
        CHECK(kt_crc32c(0, buf + off, n) == want, "crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c_portable(0, buf + off, n) == want, "table crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c(kt_crc32c(0, buf + off, cut), buf + off + cut, n - cut) == want,
              "chained crc split at %zu of %zu", cut, n);
    }
    /* lengths that take the three-stream paths (3 x 8 KiB and 3 x 256 bytes chunks) with every
     * kind of remainder, at odd offsets */
    enum { BIG = 3 * 3 * 8192 + 3 * 256 + 64 };
    uint8_t *big = malloc(BIG + 16);
    REQUIRE(big, "out of memory");
    for (size_t i = 0; i < BIG + 16; i++) big[i] = (uint8_t)rnd();
    const size_t sizes[] = {3 * 256, 3 * 256 + 7, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 3 * 256 + 9, 6 * 8192 + 100, BIG};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        size_t off = rnd() % 16, n = sizes[i];
        uint32_t want = crc_ref(big + off, n);
        CHECK(kt_crc32c(0, big + off, n) == want, "crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c_portable(0, big + off, n) == want, "table crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c(kt_crc32c(0, big + off, n / 3), big + off + n / 3, n - n / 3) == want,
              "chained crc of %zu bytes split at a third", n);
    }
    free(big);
}

static void test_conversions(void)
{
    /* every f16 and bf16 value survives a trip through f32 (NaNs stay NaN) */
    for (uint32_t x = 0; x < 65536; x++) {
        const uint16_t h = (uint16_t)x;
        float f = kt_f16_to_f32(h);
        if (f != f)
            CHECK(kt_f32_to_f16(f) == (h | 0x0200), "f16 NaN 0x%04x -> 0x%04x", h, kt_f32_to_f16(f));
        else
            CHECK(kt_f32_to_f16(f) == h, "f16 0x%04x -> %a -> 0x%04x", h, f, kt_f32_to_f16(f));
        float g = kt_bf16_to_f32(h);
        if (g != g)
            CHECK((kt_f32_to_bf16(g) & 0x7fff) > 0x7f80, "bf16 NaN 0x%04x", h);
        else
            CHECK(kt_f32_to_bf16(g) == h, "bf16 0x%04x -> %a -> 0x%04x", h, g, kt_f32_to_bf16(g));
    }
    /* hand-checked roundings: ties to even, overflow, subnormals, underflow */
    CHECK(kt_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00, "f16 tie down to even");
    CHECK(kt_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02, "f16 tie up to even");
    CHECK(kt_f32_to_f16(65504.0f) == 0x7bff, "f16 max");
    CHECK(kt_f32_to_f16(65519.0f) == 0x7bff, "f16 below the overflow tie");
    CHECK(kt_f32_to_f16(65520.0f) == 0x7c00, "f16 overflow tie goes to inf");
    CHECK(kt_f32_to_f16(-1e10f) == 0xfc00, "f16 -inf");
    CHECK(kt_f32_to_f16(0x1p-24f) == 0x0001, "f16 smallest subnormal");
    CHECK(kt_f32_to_f16(0x1p-25f) == 0x0000, "f16 tie to zero");
    CHECK(kt_f32_to_f16(0x1.8p-25f) == 0x0001, "f16 above the tie");
    CHECK(kt_f32_to_f16(3 * 0x1p-25f) == 0x0002, "f16 subnormal tie to even");
    CHECK(kt_f32_to_f16(-0.0f) == 0x8000, "f16 -0");
    CHECK(kt_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80, "bf16 tie down to even");
    CHECK(kt_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82, "bf16 tie up to even");
    CHECK(kt_f32_to_bf16(3.4e38f) == 0x7f80, "bf16 overflow to inf");
    /* random f32 bit patterns against the oracles */
    for (int t = 0; t < 200000; t++) {
        uint32_t b = (uint32_t)rnd();
        float f;
        memcpy(&f, &b, 4);
        if (f != f) continue;
        float got = kt_bf16_to_f32(kt_f32_to_bf16(f)), want = bf16_oracle(f);
        if (!(fabsf(f) >= 0x1.fefffep127f)) /* the oracle's hi candidate overflows here */
            CHECK(memcmp(&got, &want, 4) == 0, "bf16(%a) = %a, want %a", f, got, want);
#ifdef __FLT16_MAX__
        got = kt_f16_to_f32(kt_f32_to_f16(f));
        want = (float)(_Float16)f;
        CHECK(memcmp(&got, &want, 4) == 0, "f16(%a) = %a, want %a", f, got, want);
#endif
    }
}

/* ------------------------------------------------------------------ damage */

/* The base bundle every damage test starts from: 2 layers x 2 heads, head_dim 4, f32. */
static const uint32_t BASE_COUNTS[4] = {3, 0, 2, 5};
enum { SEC_LISTS, SEC_POS, SEC_K, SEC_V };

static uint8_t *base_bundle(seqkv *s, uint64_t *size)
{
    seqkv_make(s, 2, 2, 4, KT_DTYPE_F32, BASE_COUNTS, 12, "full"); /* short: header is 192 */
    return encode(s, size);
}

static uint64_t sec_off(const uint8_t *b, int s) { return kt_rd64(b + 80 + 24 * s + 8); }
static uint64_t sec_len(const uint8_t *b, int s) { return kt_rd64(b + 80 + 24 * s + 16); }
static void reseal_header(uint8_t *b)
{
    kt_wr32(b + 28, 0);
    kt_wr32(b + 28, kt_crc32c(0, b, kt_rd32(b + 12)));
}
/* Recomputes section s's checksum (from the table as it stands), then the header's. */
static void reseal(uint8_t *b, int s)
{
    kt_wr32(b + 80 + 24 * s + 4, kt_crc32c(0, b + sec_off(b, s), sec_len(b, s)));
    reseal_header(b);
}

/* Parse must fail with `needle` in the message and leave the view untouched. */
#define REJECT(buf, len, needle)                                                               \
    do {                                                                                       \
        char err_[KT_ERR_MAX] = "";                                                            \
        kt_bundle_view v_, sentinel_;                                                          \
        memset(&v_, 0x5a, sizeof v_);                                                          \
        memcpy(&sentinel_, &v_, sizeof v_);                                                    \
        int rc_ = kt_bundle_parse((buf), (len), &v_, err_);                                    \
        CHECK(rc_ == -1, "damage accepted (wanted '%s')", (needle));                           \
        if (rc_ == -1) {                                                                       \
            CHECK_ERR_HAS(err_, (needle));                                                     \
            CHECK(strncmp(err_, "bundle: ", 8) == 0, "error '%s' lacks the prefix", err_);     \
            CHECK(memcmp(&v_, &sentinel_, sizeof v_) == 0, "view written on failure");        \
        }                                                                                      \
    } while (0)

#define ACCEPT(buf, len)                                                                       \
    do {                                                                                       \
        char err_[KT_ERR_MAX] = "";                                                            \
        kt_bundle_view v_;                                                                     \
        CHECK(kt_bundle_parse((buf), (len), &v_, err_) == 0, "rejected: %s", err_);            \
    } while (0)

static void test_damage(void)
{
    seqkv s;
    uint64_t n;
    uint8_t *good = base_bundle(&s, &n);
    uint8_t *b = malloc(n + 64);
    char err[KT_ERR_MAX];
#define FRESH() memcpy(b, good, n)

    FRESH();
    ACCEPT(b, n);
    /* the layout this test relies on: lists 160 bytes at 192, then a 32-byte gap */
    REQUIRE(kt_rd32(b + 12) == 192 && sec_off(b, SEC_LISTS) == 192 && sec_len(b, SEC_LISTS) == 160 &&
            sec_off(b, SEC_POS) == 384, "unexpected base layout");

    /* magic, version */
    FRESH(); b[3] ^= 0x20; REJECT(b, n, "bad magic");
    FRESH(); kt_wr16(b + 8, 3); reseal_header(b); REJECT(b, n, "version 3.0 is newer");
    FRESH(); kt_wr16(b + 8, 1); reseal_header(b); REJECT(b, n, "version 1.0 is older");
    FRESH(); kt_wr16(b + 10, 7); reseal_header(b); ACCEPT(b, n); /* newer minor: read */

    /* truncation at every offset, and trailing bytes */
    for (uint64_t cut = 0; cut < n; cut++) REJECT(good, cut, "truncated");
    REJECT(NULL, 0, "truncated");
    FRESH(); b[n] = 0; REJECT(b, n + 1, "trailing bytes");
    {
        char want[128];
        snprintf(want, sizeof want, "truncated: header says %llu bytes, got %llu",
                 (unsigned long long)n, (unsigned long long)(n / 2));
        REJECT(good, n / 2, want);
    }

    /* sizes in the fixed header */
    FRESH(); kt_wr64(b + 16, n + 64); reseal_header(b); REJECT(b, n, "header says");
    FRESH(); kt_wr64(b + 16, ~0ull); REJECT(b, n, "exceeds the");
    FRESH(); kt_wr32(b + 12, 256); reseal_header(b); REJECT(b, n, "header_size 256, expected 192");
    FRESH(); kt_wr16(b + 62, 5); reseal_header(b); REJECT(b, n, "n_sections 5 invalid");
    FRESH(); kt_wr16(b + 62, 3); reseal_header(b); REJECT(b, n, "n_sections 3 invalid");
    FRESH(); kt_wr16(b + 76, 0); reseal_header(b); REJECT(b, n, "policy_len 0");
    FRESH(); kt_wr16(b + 76, 2000); reseal_header(b); REJECT(b, n, "policy_len 2000");
    FRESH(); kt_wr16(b + 76, 40); reseal_header(b); REJECT(b, n, "header_size 192, expected 256");

    /* header checksum, flags, reserved */
    FRESH(); b[40] ^= 1; REJECT(b, n, "header checksum mismatch (expected 0x");
    FRESH(); b[28] ^= 1; REJECT(b, n, "header checksum mismatch");
    FRESH(); kt_wr32(b + 24, 1); reseal_header(b); REJECT(b, n, "segments are 2.2"); /* 2.0 */
    FRESH(); kt_wr32(b + 24, 2); reseal_header(b); REJECT(b, n, "unknown required flags 0x0002");
    FRESH(); kt_wr32(b + 24, 0x10000); reseal_header(b); ACCEPT(b, n); /* optional bit: ignored */
    FRESH(); kt_wr16(b + 78, 1); reseal_header(b); REJECT(b, n, "reserved header field");

    /* every header field against its bounds */
    FRESH(); b[32] = 'A'; reseal_header(b); REJECT(b, n, "fingerprint byte 0 is 0x41");
    FRESH(); b[47] = 0; reseal_header(b); REJECT(b, n, "fingerprint byte 15");
    FRESH(); kt_wr32(b + 48, 0); reseal_header(b); REJECT(b, n, "n_layers 0 out of range");
    FRESH(); kt_wr32(b + 48, 0x7fffffff); reseal_header(b); REJECT(b, n, "n_layers 2147483647 out of range");
    FRESH(); kt_wr32(b + 48, 1); reseal_header(b); REJECT(b, n, "section lists is 160 bytes, expected 80");
    FRESH(); kt_wr32(b + 52, 0); reseal_header(b); REJECT(b, n, "n_kv_heads 0 out of range");
    FRESH(); kt_wr32(b + 52, 5000); reseal_header(b); REJECT(b, n, "n_kv_heads 5000 out of range");
    FRESH(); kt_wr32(b + 56, 0); reseal_header(b); REJECT(b, n, "head_dim 0 out of range");
    FRESH(); kt_wr32(b + 56, 1u << 20); reseal_header(b); REJECT(b, n, "head_dim 1048576 out of range");
    FRESH(); kt_wr32(b + 56, 8); reseal_header(b); REJECT(b, n, "section K is 160 bytes, but the counts say 320");
    FRESH(); kt_wr16(b + 60, 16); reseal_header(b); REJECT(b, n, "payload dtype int8+scale needs its K and V scale sections: 4 sections in version 2.0");
    FRESH(); kt_wr16(b + 60, 17); reseal_header(b); REJECT(b, n, "payload dtype fp8_e4m3+scale needs its K and V scale sections");
    FRESH(); kt_wr16(b + 60, 9); reseal_header(b); REJECT(b, n, "unknown payload dtype 9");
    FRESH(); kt_wr16(b + 60, 2); reseal_header(b); REJECT(b, n, "section K is 160 bytes, but the counts say 80");
    FRESH(); kt_wr32(b + 64, (uint32_t)-1); reseal_header(b); REJECT(b, n, "first_token -1 is negative");
    FRESH(); kt_wr32(b + 68, 0); reseal_header(b); REJECT(b, n, "prompt_len 0 is below 1");
    FRESH(); kt_wr32(b + 72, (uint32_t)-5); reseal_header(b); REJECT(b, n, "next_pos -5 is negative");
    FRESH(); kt_wr32(b + 72, 4); reseal_header(b); REJECT(b, n, "count 5 exceeds next_pos 4");
    {   /* the largest position is 11 at most; a next_pos just above the count but at or
           below some position is caught by the positions walk */
        int32_t maxp = s.pos[3][4];
        FRESH(); kt_wr32(b + 72, (uint32_t)maxp); reseal_header(b);
        REJECT(b, n, "positions must increase strictly and stay in [0, next_pos)");
    }
    const uint64_t pol = 80 + 4 * 24;
    FRESH(); b[pol + 2] = 0xff; reseal_header(b); REJECT(b, n, "policy spec is not UTF-8");
    FRESH(); b[pol + 2] = 0; reseal_header(b); REJECT(b, n, "policy spec is not UTF-8 without NUL (bad byte at offset 2)");
    FRESH(); b[pol + 1] = 0xc0; b[pol + 2] = 0xaf; reseal_header(b); REJECT(b, n, "not UTF-8"); /* overlong '/' */
    FRESH(); b[190] = 1; reseal_header(b); REJECT(b, n, "padding byte at offset 190 (header padding)");

    /* the section table: ids, offsets, lengths */
    FRESH(); kt_wr32(b + 80 + 24 * SEC_K, 9); reseal_header(b); REJECT(b, n, "entry 2 has id 9, expected 3 (K)");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_V + 8, n + 64); reseal_header(b); REJECT(b, n, "section V [");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_V + 16, 0x7fffffffffffffffull); reseal_header(b); REJECT(b, n, "lies outside the");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_K + 8, sec_off(b, SEC_POS)); reseal_header(b); REJECT(b, n, "section K starts at");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_LISTS + 8, 100); reseal_header(b); REJECT(b, n, "before the end of the header");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_POS + 8, 388); reseal_header(b); REJECT(b, n, "section positions at offset 388, expected 384");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_V + 16, sec_len(b, SEC_V) - 4); reseal_header(b); REJECT(b, n, "4 bytes after the last section");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_LISTS + 16, 136); reseal_header(b); REJECT(b, n, "section lists is 136 bytes, expected 160");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_POS + 16, 36); reseal_header(b); REJECT(b, n, "section positions is 36 bytes, but the counts say 40");
    FRESH(); b[364] = 7; REJECT(b, n, "padding byte at offset 364 (between sections)");

    /* every checksum */
    FRESH(); b[sec_off(b, SEC_LISTS) + 9] ^= 1; REJECT(b, n, "section lists checksum mismatch (expected 0x");
    FRESH(); b[sec_off(b, SEC_POS) + 1] ^= 1; REJECT(b, n, "section positions checksum mismatch");
    FRESH(); b[sec_off(b, SEC_K) + 17] ^= 0x80; REJECT(b, n, "section K checksum mismatch (expected 0x");
    FRESH(); b[n - 1] ^= 0x01; REJECT(b, n, "section V checksum mismatch");
    {   /* the message carries both values */
        FRESH(); b[sec_off(b, SEC_K)] ^= 1;
        char want[96];
        snprintf(want, sizeof want, "section K checksum mismatch (expected 0x%08x, got 0x%08x)",
                 kt_rd32(b + 80 + 24 * SEC_K + 4), kt_crc32c(0, b + sec_off(b, SEC_K), sec_len(b, SEC_K)));
        REJECT(b, n, want);
    }

    /* lies in the list table (resealed: a lying sender computes valid checksums) */
    const uint64_t lt = sec_off(good, SEC_LISTS);
#define LIST(i, f) (b + lt + 40 * (i) + (f))
    FRESH(); kt_wr32(LIST(0, 8), 4); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 1) starts at entry 3, expected 4");
    FRESH(); kt_wr32(LIST(3, 8), 6); reseal(b, SEC_LISTS); REJECT(b, n, "section positions is 40 bytes, but the counts say 44");
    FRESH(); kt_wr64(LIST(2, 0), 2); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 1, head 0) starts at entry 2, expected 3");
    FRESH(); kt_wr32(LIST(0, 12), 4); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 0) pinned 4 exceeds its count 3");
    FRESH(); kt_wr32(LIST(1, 12), 1); reseal(b, SEC_LISTS); REJECT(b, n, "pinned 1 exceeds its count 0");
    FRESH(); kt_wr32(LIST(2, 16), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "window 2147483648 is above");
    FRESH(); kt_wr32(LIST(3, 16), KT_BUNDLE_WINDOW_DENSE); reseal(b, SEC_LISTS); ACCEPT(b, n);
    FRESH(); kt_wr32(LIST(1, 20), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 1) sink 2147483648 is above");
    FRESH(); kt_wr32(LIST(1, 28), 0xffffffffu); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 1) slack 4294967295 is above");
    FRESH(); kt_wr32(LIST(1, 32), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "max_drop 2147483648 is above");
    FRESH(); kt_wr32(LIST(2, 24), 0); reseal(b, SEC_LISTS); ACCEPT(b, n); /* lazy 0: never prunes */
    FRESH(); kt_wr32(LIST(2, 24), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "lazy 2147483648 is above");
    FRESH(); kt_wr32(LIST(3, 36), 2); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 1, head 1) has unknown flags 0x00000002");
    FRESH(); kt_wr32(LIST(3, 36), 0); reseal(b, SEC_LISTS); ACCEPT(b, n);
    /* overflow-inducing counts: the sum and the row product are computed in checked arithmetic */
    FRESH();
    kt_wr32(b + 72, 0x7fffffff);
    for (int i = 0; i < 4; i++) {
        kt_wr64(LIST(i, 0), (uint64_t)i * 0x7fffffff);
        kt_wr32(LIST(i, 8), 0x7fffffff);
        kt_wr32(LIST(i, 12), 0);
    }
    reseal(b, SEC_LISTS);
    REJECT(b, n, "bundle of 309237645568 bytes exceeds the 274877906944-byte limit");
    FRESH();
    kt_wr32(b + 72, 0x7fffffff);
    for (int i = 0; i < 4; i++) {
        kt_wr64(LIST(i, 0), i ? 0x7fffffff : 0);
        kt_wr32(LIST(i, 8), i ? 0 : 0x7fffffff);
        kt_wr32(LIST(i, 12), 0);
    }
    reseal(b, SEC_LISTS);
    REJECT(b, n, "section positions is 40 bytes, but the counts say 8589934588");
    FRESH(); kt_wr32(b + 72, 0x7fffffff); kt_wr32(LIST(0, 8), 0x7fffffff); reseal(b, SEC_LISTS);
    REJECT(b, n, "list (layer 0, head 1) starts at entry 3, expected 2147483647");
    FRESH(); kt_wr32(LIST(0, 8), 0xffffffffu); reseal(b, SEC_LISTS); REJECT(b, n, "count 4294967295 exceeds next_pos 12");

    /* positions (resealed) */
    const uint64_t pt = sec_off(good, SEC_POS);
    FRESH(); kt_wr32(b + pt + 4, kt_rd32(b + pt)); reseal(b, SEC_POS);
    REJECT(b, n, "list (layer 0, head 0) entry 1 has position");
    FRESH(); kt_wr32(b + pt + 8, 0); reseal(b, SEC_POS); REJECT(b, n, "entry 2 has position 0");
    FRESH(); kt_wr32(b + pt, (uint32_t)-3); reseal(b, SEC_POS); REJECT(b, n, "entry 0 has position -3 (previous -1");
    FRESH(); kt_wr32(b + pt + 36, 12); reseal(b, SEC_POS); REJECT(b, n, "list (layer 1, head 1) entry 4 has position 12");
    {   /* positions restart per list: list (1,0) may begin below where (0,0) ended */
        FRESH(); kt_wr32(b + pt + 12, 0); kt_wr32(b + pt + 16, 1); reseal(b, SEC_POS); ACCEPT(b, n);
    }
#undef LIST
    free(b);
    free(good);
    seqkv_free(&s);
    (void)err;
#undef FRESH
}

/* A 2.1 bundle as a newer sender might write it: an optional flag bit and a fifth section
 * after V. A 2.0 reader checks the extra section's checksum and placement and ignores it. */
static void test_newer_minor(void)
{
    seqkv s;
    uint64_t n;
    uint8_t *good = base_bundle(&s, &n);
    /* 5 table entries + "full" = 204 bytes: the header grows from 192 to 256, every section
     * moves by 64, and the extra section of 8 bytes starts on the boundary after V */
    const uint64_t v_end = sec_off(good, SEC_V) + sec_len(good, SEC_V) + 64;
    const uint64_t x_off = (v_end + 63) / 64 * 64, m = x_off + 8;
    uint8_t *b = calloc(1, m);
    memcpy(b, good, 80 + 4 * 24);
    memcpy(b + 80 + 5 * 24, good + 80 + 4 * 24, 4); /* the policy */
    memcpy(b + 256, good + 192, n - 192);
    for (int i = 0; i < 4; i++) kt_wr64(b + 80 + 24 * i + 8, sec_off(good, i) + 64);
    kt_wr32(b + 80 + 4 * 24, 5);
    kt_wr64(b + 80 + 4 * 24 + 8, x_off);
    kt_wr64(b + 80 + 4 * 24 + 16, 8);
    memcpy(b + x_off, "future!!", 8);
    kt_wr16(b + 10, 1);
    kt_wr16(b + 62, 5);
    kt_wr32(b + 12, 256);
    kt_wr64(b + 16, m);
    kt_wr32(b + 24, 1u << 20);
    reseal(b, 4);
    ACCEPT(b, m);
    char err[KT_ERR_MAX];
    kt_bundle_view v;
    if (kt_bundle_parse(b, m, &v, err) == 0) {
        CHECK(v.version_minor == 1 && v.flags == 1u << 20, "version/flags");
        CHECK(v.n_entries == 10, "entries");
    }
    b[x_off + 3] ^= 1;
    REJECT(b, m, "section extra checksum mismatch");
    b[x_off + 3] ^= 1;
    kt_wr16(b + 10, 0);
    reseal_header(b);
    REJECT(b, m, "n_sections 5 invalid for version 2.0");
    free(b);
    free(good);
    seqkv_free(&s);
}

/* ------------------------------------------------------------------ writer misuse, sizes */

static void test_writer(void)
{
    char err[KT_ERR_MAX];
    seqkv s;
    seqkv_make(&s, 2, 2, 4, KT_DTYPE_BF16, BASE_COUNTS, 12, "full");
    uint64_t size;
    REQUIRE(kt_bundle_size(&s.h, s.lists, &size, err) == 0, "%s", err);
    uint8_t *buf = malloc(size);
    kt_bundle_writer w;
    uint64_t got;

    CHECK(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size - 1, err) == -1, "short buffer");
    CHECK_ERR_HAS(err, "too small");
    CHECK(kt_bundle_writer_put(&w, 0, 0, 1, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0], err) == -1,
          "put after failed begin");
    CHECK_ERR_HAS(err, "not open");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 1, 0, 1, s.pos[2], KT_DTYPE_F32, s.k[2], s.v[2], err) == -1,
          "skipped a non-empty list");
    CHECK_ERR_HAS(err, "list (layer 0, head 0) got 0 of its 3 entries");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 0, 4, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0], err) == -1,
          "too many entries");
    CHECK_ERR_HAS(err, "put of 4 entries to list (layer 0, head 0) which has 3 of 3 left");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    int32_t dup[2] = {s.pos[0][0], s.pos[0][0]};
    CHECK(kt_bundle_writer_put(&w, 0, 0, 2, dup, KT_DTYPE_F32, s.k[0], s.v[0], err) == -1,
          "repeated position");
    CHECK_ERR_HAS(err, "positions must increase strictly");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 0, 1, s.pos[0], KT_DTYPE_INT8_TOKEN, s.k[0], s.v[0], err) == -1,
          "int8 source");
    CHECK_ERR_HAS(err, "source dtype int8+scale: rows are put as f32, f16 or bf16");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 2, 0, 1, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0], err) == -1,
          "layer out of range");
    CHECK_ERR_HAS(err, "outside 2 layers x 2 heads");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    REQUIRE(kt_bundle_writer_put(&w, 0, 0, 3, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0], err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 0, 0, NULL, KT_DTYPE_F32, NULL, NULL, err) == 0, "empty put: %s", err);
    REQUIRE(kt_bundle_writer_put(&w, 1, 0, 2, s.pos[2], KT_DTYPE_F32, s.k[2], s.v[2], err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 1, 0, NULL, KT_DTYPE_F32, NULL, NULL, err) == -1, "going back");
    CHECK_ERR_HAS(err, "after a later list");
    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    REQUIRE(kt_bundle_writer_put(&w, 0, 0, 3, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0], err) == 0, "%s", err);
    REQUIRE(kt_bundle_writer_put(&w, 1, 0, 2, s.pos[2], KT_DTYPE_F32, s.k[2], s.v[2], err) == 0, "%s", err);
    CHECK(kt_bundle_writer_finish(&w, &got, err) == -1, "finish with a list short");
    CHECK_ERR_HAS(err, "list (layer 1, head 1) got 0 of its 5 entries");
    CHECK(kt_bundle_writer_finish(&w, &got, err) == -1, "finish twice");

    /* source rows already in the payload dtype are copied as they are: the no-conversion
     * path a GPU producing bf16 would use */
    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    for (uint32_t i = 0; i < 4; i++) {
        const uint32_t c = s.lists[i].count;
        uint16_t *kb = malloc((c * 4 + 1) * 2);
        for (uint32_t e = 0; e < c * 4; e++) kb[e] = kt_f32_to_bf16(s.k[i][e]);
        REQUIRE(kt_bundle_writer_put(&w, i / 2, i % 2, c, s.pos[i], KT_DTYPE_BF16, kb, kb, err) == 0,
                "%s", err);
        free(kb);
    }
    REQUIRE(kt_bundle_writer_finish(&w, &got, err) == 0, "%s", err);
    kt_bundle_view v;
    REQUIRE(kt_bundle_parse(buf, got, &v, err) == 0, "%s", err);
    kt_bundle_list_view lv;
    REQUIRE(kt_bundle_view_list(&v, 1, 1, &lv, err) == 0, "%s", err);
    float k[20];
    REQUIRE(kt_bundle_list_read(&v, &lv, 0, 5, NULL, KT_DTYPE_F32, k, NULL, err) == 0, "%s", err);
    for (int e = 0; e < 20; e++)
        CHECK(k[e] == bf16_oracle(s.k[3][e]), "bf16 copy elem %d", e);

    /* invalid headers are refused by the writer too, with the parser's words */
    kt_bundle_header h = s.h;
    h.head_dim = 0;
    CHECK(kt_bundle_writer_begin(&w, &h, s.lists, buf, size, err) == -1, "head_dim 0");
    CHECK_ERR_HAS(err, "head_dim 0 out of range");
    h = s.h;
    h.dtype = (kt_dtype)3;
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == -1, "dtype 3");
    CHECK_ERR_HAS(err, "unknown payload dtype 3");
    h = s.h;
    h.policy[0] = '\0';
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == -1, "empty policy");
    CHECK_ERR_HAS(err, "policy spec is empty");
    h = s.h;
    memset(h.policy, 'x', KT_BUNDLE_MAX_POLICY);
    h.policy[KT_BUNDLE_MAX_POLICY] = '\0';
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == 0, "longest policy: %s", err);
    h = s.h;
    h.fingerprint[3] = 'G';
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == -1, "bad fingerprint");
    CHECK_ERR_HAS(err, "fingerprint byte 3");
    kt_bundle_list bad[4];
    memcpy(bad, s.lists, sizeof bad);
    bad[2].pinned = 3;
    CHECK(kt_bundle_size(&s.h, bad, &got, err) == -1, "pinned > count");
    CHECK_ERR_HAS(err, "list (layer 1, head 0) pinned 3 exceeds its count 2");

    /* size arithmetic at the bounds: the largest shape with every list full does not wrap,
     * it is refused against the limit */
    kt_bundle_header big;
    header_init(&big, KT_BUNDLE_MAX_LAYERS, KT_BUNDLE_MAX_KV_HEADS, KT_BUNDLE_MAX_HEAD_DIM,
                KT_DTYPE_F32, 0x7fffffff, "full");
    const size_t nb = (size_t)KT_BUNDLE_MAX_LAYERS * KT_BUNDLE_MAX_KV_HEADS;
    kt_bundle_list *many = malloc(nb * sizeof *many);
    for (size_t i = 0; i < nb; i++)
        many[i] = (kt_bundle_list){.count = 0x7fffffff, .window = KT_BUNDLE_WINDOW_DENSE};
    CHECK(kt_bundle_size(&big, many, &got, err) == -1, "huge bundle accepted");
    CHECK_ERR_HAS(err, "exceed the 274877906944-byte bundle limit");
    for (size_t i = 0; i < nb; i++) many[i].count = i == 0 ? 1000 : 0;
    CHECK(kt_bundle_size(&big, many, &got, err) == 0, "%s", err);
    /* header 192 + lists 40 MiB + positions 4000 (+pad) + 2 x 1000 rows of 16 KiB */
    const uint64_t lists_end = 192 + nb * 40, pos_at = (lists_end + 63) / 64 * 64,
                   k_at = (pos_at + 4000 + 63) / 64 * 64, kv = 1000ull * 4096 * 4;
    CHECK(got == k_at + kv + kv, "size %llu, want %llu", (unsigned long long)got,
          (unsigned long long)(k_at + 2 * kv));
    free(many);

    free(buf);
    seqkv_free(&s);
}

/* ------------------------------------------------------------------ quantized payloads */

/* The value of E4M3 code c by the format's definition (bias 7, 3 mantissa bits, subnormals
 * below 2^-6), not by the library's decoder; NaN for 0x7f and 0xff. */
static double fp8_value(unsigned c)
{
    const unsigned e = (c >> 3) & 15, m = c & 7;
    if ((c & 0x7f) == 0x7f) return NAN;
    const double mag = e == 0 ? m * 0x1p-9 : ldexp(8 + m, (int)e - 10);
    return c & 0x80 ? -mag : mag;
}

/* The code nearest to x among the 254 finite ones, ties to the even mantissa, |x| > 448 saturating:
 * a brute-force oracle for kt_f32_to_fp8_e4m3. */
static unsigned fp8_nearest(float x)
{
    unsigned best = 0;
    double best_d = INFINITY;
    for (unsigned c = 0; c < 256; c++) {
        const double v = fp8_value(c);
        if (isnan(v) || (v == 0 && !signbit(v) != !signbit(x))) continue;
        if ((v < 0) != (x < 0) && v != 0) continue;
        const double d = fabs(v - (double)x);
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best = c;
            best_d = d;
        }
    }
    return best;
}

static void test_fp8(void)
{
    int bad = 0;
    for (unsigned c = 0; c < 256 && bad < 5; c++) {
        const double want = fp8_value(c);
        const float got = kt_fp8_e4m3_to_f32((uint8_t)c);
        if (isnan(want) ? !isnan(got) : (double)got != want || !signbit(got) != !signbit(want)) {
            bad++;
            CHECK(0, "fp8 code 0x%02x decodes to %a, want %a", c, got, want);
        }
        if (!isnan(want) && kt_f32_to_fp8_e4m3((float)want) != c) {
            bad++;
            CHECK(0, "fp8 %a encodes to 0x%02x, want 0x%02x", want, kt_f32_to_fp8_e4m3((float)want), c);
        }
    }
    /* every value between codes, at random magnitudes, ties included (midpoints) */
    for (int i = 0; i < 20000 && bad < 5; i++) {
        float x;
        if (i < 254 * 2) { /* the midpoints between neighbouring positive codes, and their negatives */
            const unsigned c = (unsigned)(i / 2) % 126;
            x = (float)((fp8_value(c) + fp8_value(c + 1)) / 2);
            if (i % 2) x = -x;
        } else {
            x = (float)ldexp(rndf(), (int)(rnd() % 24) - 14);
        }
        const unsigned want = fp8_nearest(x), got = kt_f32_to_fp8_e4m3(x);
        if (got != want) {
            bad++;
            CHECK(0, "fp8 of %a is 0x%02x, want 0x%02x", x, got, want);
        }
    }
    CHECK(kt_f32_to_fp8_e4m3(1000.0f) == 0x7e && kt_f32_to_fp8_e4m3(-INFINITY) == 0xfe, "saturation");
    CHECK(kt_f32_to_fp8_e4m3(NAN) == 0x7f, "NaN");
}

/* Rows a KV cache can hold that random data misses: zeros, one outlier next to tiny values,
 * values in fp8's subnormal range after scaling; and a non-finite element, refused. */
static void test_quantized_rows(kt_dtype t)
{
    char err[KT_ERR_MAX];
    enum { DIM = 8 };
    static const uint32_t counts[1] = {4};
    seqkv s;
    seqkv_make(&s, 1, 1, DIM, t, counts, 8, "full");
    const float rows[4][DIM] = {
        {0, 0, 0, 0, 0, 0, 0, 0},
        {1000.0f, 1e-3f, -1e-3f, 0.5f, -0.25f, 3.0f, 1e-6f, -700.0f},
        {1e-30f, -2e-30f, 3e-31f, 0, 1e-30f, -1e-30f, 5e-31f, 4e-30f},
        {-1, 1, -1, 1, 0.999f, -0.999f, 0.5f, 0},
    };
    memcpy(s.k[0], rows, sizeof rows);
    for (int e = 0; e < 4 * DIM; e++) s.v[0][e] = -s.k[0][e];
    uint64_t size;
    uint8_t *buf = encode(&s, &size);
    kt_bundle_view v;
    REQUIRE(kt_bundle_parse(buf, size, &v, err) == 0, "%s", err);
    kt_bundle_list_view lv;
    REQUIRE(kt_bundle_view_list(&v, 0, 0, &lv, err) == 0, "%s", err);
    float k[4 * DIM], vv[4 * DIM];
    REQUIRE(kt_bundle_list_read(&v, &lv, 0, 4, NULL, KT_DTYPE_F32, k, vv, err) == 0, "%s", err);
    for (int e = 0; e < 4 * DIM; e++) {
        CHECK(quant_within_bound(t, rows[e / DIM], DIM, rows[e / DIM][e % DIM], k[e]), "%s row %d elem %d: %a from %a",
              kt_dtype_name(t), e / DIM, e % DIM, k[e], rows[e / DIM][e % DIM]);
        CHECK(vv[e] == -k[e], "%s: V is not K negated at %d", kt_dtype_name(t), e);
    }
    for (int e = 0; e < DIM; e++) CHECK(k[e] == 0, "zero row came back as %a", k[e]);
    CHECK(k[DIM] == 1000.0f, "%s: a row's largest element is exact, got %a", kt_dtype_name(t), k[DIM]);

    /* damage only a quantized bundle can have, resealed so the rule itself is what refuses it */
    uint8_t *b = malloc(size);
    const float nan = NAN;
    memcpy(b, buf, size);
    memcpy(b + sec_off(b, 4) + 4, &nan, 4);
    reseal(b, 4);
    REJECT(b, size, "K scale of entry 1 is nan");
    memcpy(b, buf, size);
    const float neg = -1.0f;
    memcpy(b + sec_off(b, 5) + 8, &neg, 4);
    reseal(b, 5);
    REJECT(b, size, "V scale of entry 2 is -1: scales lie in [0, ");
    if (t == KT_DTYPE_FP8_E4M3_TOKEN) {
        memcpy(b, buf, size);
        b[sec_off(b, SEC_K) + 3] = 0xff;
        reseal(b, SEC_K);
        REJECT(b, size, "K element 3 is the fp8 NaN code 0xff");
    }
    memcpy(b, buf, size);
    kt_wr16(b + 10, 0);
    reseal_header(b);
    REJECT(b, size, "n_sections 6 invalid for version 2.0");
    memcpy(b, buf, size);
    b[sec_off(b, 5) + 1] ^= 4;
    REJECT(b, size, "section V scales checksum mismatch");
    free(b);
    free(buf);

    /* a NaN or infinity cannot be quantized: the put fails and says which row */
    s.k[0][DIM + 3] = INFINITY;
    REQUIRE(kt_bundle_size(&s.h, s.lists, &size, err) == 0, "%s", err);
    buf = malloc(size);
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 0, 4, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0], err) == -1,
          "%s quantized an infinity", kt_dtype_name(t));
    CHECK_ERR_HAS(err, "K row 1 element 3 is inf: a quantized payload takes finite values only");
    free(buf);
    seqkv_free(&s);
}

static void test_quantized(void)
{
    test_fp8();
    static const uint32_t gqa[6] = {17, 17, 3, 30, 0, 1};
    for (int q = 0; q < 2; q++) {
        const kt_dtype t = q ? KT_DTYPE_FP8_E4M3_TOKEN : KT_DTYPE_INT8_TOKEN;
        CHECK(round_trip(3, 2, 64, t, gqa, 64), "gqa %s", kt_dtype_name(t));
        CHECK(round_trip(3, 2, 5, t, gqa, 31), "odd head_dim %s", kt_dtype_name(t));
        test_quantized_rows(t);
        /* bytes per row: head_dim + a 4-byte scale, against 4 * head_dim for f32 */
        CHECK(kt_dtype_row_bytes(t, 128) == 132 && kt_dtype_row_bytes(KT_DTYPE_F32, 128) == 512,
              "row bytes");
    }
    /* a 2.1 bundle that claims a quantized dtype but lacks the scale sections */
    seqkv s;
    uint64_t n;
    uint8_t *b = base_bundle(&s, &n);
    kt_wr16(b + 10, 1);
    kt_wr16(b + 60, KT_DTYPE_INT8_TOKEN);
    reseal_header(b);
    REJECT(b, n, "payload dtype int8+scale needs its K and V scale sections: 4 sections in version 2.1");
    free(b);
    seqkv_free(&s);
    kt_dtype t;
    CHECK(kt_dtype_parse("int8", &t) == 0 && t == KT_DTYPE_INT8_TOKEN, "parse int8");
    CHECK(kt_dtype_parse("fp8", &t) == 0 && t == KT_DTYPE_FP8_E4M3_TOKEN, "parse fp8");
    CHECK(kt_dtype_parse("bf16", &t) == 0 && t == KT_DTYPE_BF16, "parse bf16");
    CHECK(kt_dtype_parse("int4", &t) == -1 && kt_dtype_parse(NULL, &t) == -1, "parse junk");
}

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
        REQUIRE(kt_bundle_set_read(&set, (uint32_t)i / HEADS, (uint32_t)i % HEADS, 0, n, pos, KT_DTYPE_F32, k, NULL,
                                   err) == 0, "%s", err);
        CHECK(!memcmp(pos, a.pos[i], ca[i] * sizeof *pos) && !memcmp(pos + ca[i], b.pos[i], cb[i] * sizeof *pos) &&
              !memcmp(k, a.k[i], ca[i] * DIM * sizeof *k) &&
              !memcmp(k + ca[i] * DIM, b.k[i], cb[i] * DIM * sizeof *k), "list %d read across the parts", i);
        if (n >= 3) { /* a read that starts inside the first piece and ends in the second */
            int32_t p2[2];
            REQUIRE(kt_bundle_set_read(&set, (uint32_t)i / HEADS, (uint32_t)i % HEADS, n - 2, 2, p2, KT_DTYPE_F32, NULL,
                                       NULL, err) == 0, "%s", err);
            CHECK(p2[0] == pos[n - 2] && p2[1] == pos[n - 1], "list %d: a partial read", i);
        }
        CHECK(kt_bundle_set_read(&set, (uint32_t)i / HEADS, (uint32_t)i % HEADS, n, 1, pos, KT_DTYPE_F32, NULL, NULL, err) == -1,
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
            REQUIRE(kt_bundle_set_read(&set, l, h, 0, c, pos, KT_DTYPE_F32, k, vv, err) == 0, "%s", err);
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

static void test_check_model(void)
{
    char err[KT_ERR_MAX];
    seqkv s;
    uint64_t n;
    uint8_t *b = base_bundle(&s, &n);
    kt_bundle_view v;
    REQUIRE(kt_bundle_parse(b, n, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_check_model(&v.hdr, "0123456789abcdef", 2, 2, 4, err) == 0, "%s", err);
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 2, 2, 4, err) == 0, "%s", err);
    CHECK(kt_bundle_check_model(&v.hdr, "fedcba9876543210", 2, 2, 4, err) == -1, "fingerprint");
    CHECK_ERR_HAS(err, "bundle: model fingerprint 0123456789abcdef does not match this node's fedcba9876543210");
    CHECK_ERR_HAS(err, "HINT");
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 3, 2, 4, err) == -1, "layers");
    CHECK_ERR_HAS(err, "n_layers 2 does not match this node's model (3)");
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 2, 8, 4, err) == -1, "heads");
    CHECK_ERR_HAS(err, "n_kv_heads 2 does not match this node's model (8)");
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 2, 2, 128, err) == -1, "head_dim");
    CHECK_ERR_HAS(err, "head_dim 4 does not match this node's model (128)");
    free(b);
    seqkv_free(&s);
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
            if (kt_bundle_writer_put(&w, (uint32_t)i / H, (uint32_t)i % H, 1, &p, KT_DTYPE_F32, k, v, err))
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
            REQUIRE(kt_bundle_list_read(&vu, &a, 0, a.count, pa, KT_DTYPE_F32, ka, va, err) == 0, "%s", err);
            REQUIRE(kt_bundle_list_read(&vp, &b, 0, b.count, pb, KT_DTYPE_F32, kb, vb, err) == 0, "%s", err);
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
        CHECK(kt_bundle_list_read(&two, &lv, 0, lv.count, p, KT_DTYPE_F32, NULL, NULL, err) == 0, "%s", err);
        if (lv.count && lv.count <= 64 && one.hdr.head_dim <= 8) {
            CHECK(kt_bundle_list_read(&two, &lv, 0, 1, NULL, KT_DTYPE_F32, r, NULL, err) == -1, "%s: rows of a head read", what);
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
            REQUIRE(kt_bundle_list_read(&one, &a, 0, a.count, NULL, KT_DTYPE_F32, ka, NULL, err) == 0 &&
                    kt_bundle_list_read(&two, &c, 0, c.count, NULL, KT_DTYPE_F32, kc, NULL, err) == 0, "%s", err);
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
            REQUIRE(kt_bundle_set_read(&set, l, h, 0, c, pos, KT_DTYPE_F32, k, vv, err) == 0, "%s", err);
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
            REQUIRE(kt_bundle_set_read(&set, 1, h, 0, 2, pos, KT_DTYPE_F32, k, vv, err) == 0, "%s", err);
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

/* ------------------------------------------------------------------ fuzz seeds */

/* first_layer >= 0: a layer segment starting there (format 2.2); -1: a whole bundle.
 * block_rows: 0, or block-padded (format 2.3). */
static void write_seed_padded(const char *dir, const char *name, uint32_t layers, uint32_t heads,
                              uint32_t dim, kt_dtype dtype, const uint32_t *counts, int32_t next_pos,
                              const char *policy, int first_layer, uint32_t block_rows)
{
    seqkv s;
    seqkv_make(&s, layers, heads, dim, dtype, counts, next_pos, policy);
    s.h.block_rows = block_rows;
    s.h.segment = first_layer >= 0;
    s.h.first_layer = first_layer >= 0 ? (uint32_t)first_layer : 0;
    uint64_t n;
    uint8_t *b = encode(&s, &n);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    REQUIRE(f && fwrite(b, 1, n, f) == n && fclose(f) == 0, "cannot write %s", path);
    printf("wrote %s (%llu bytes)\n", path, (unsigned long long)n);
    free(b);
    seqkv_free(&s);
}

static void write_seed(const char *dir, const char *name, uint32_t layers, uint32_t heads,
                       uint32_t dim, kt_dtype dtype, const uint32_t *counts, int32_t next_pos,
                       const char *policy, int first_layer)
{
    write_seed_padded(dir, name, layers, heads, dim, dtype, counts, next_pos, policy, first_layer, 0);
}

static void write_seeds(const char *dir)
{
    static const uint32_t c1[1] = {0}, c4[4] = {3, 0, 2, 5}, c6[6] = {4, 4, 1, 0, 6, 2},
                          c8[8] = {2, 1, 1, 2, 3, 0, 1, 2};
    write_seed(dir, "empty-1x1-f32", 1, 1, 2, KT_DTYPE_F32, c1, 1, "full", -1);
    write_seed(dir, "gqa-2x2-f32", 2, 2, 4, KT_DTYPE_F32, c4, 12, "streaming:sink=4,window=16", -1);
    write_seed(dir, "mha-3x2-bf16", 3, 2, 8, KT_DTYPE_BF16, c6, 9, "snapkv:budget=8,window=4", -1);
    write_seed(dir, "gqa-2x4-f16", 2, 4, 6, KT_DTYPE_F16, c8, 5, "sage:budget=6,pos=rel", -1);
    write_seed(dir, "gqa-2x2-int8", 2, 2, 4, KT_DTYPE_INT8_TOKEN, c4, 12, "snapkv:budget=8,window=4", -1);
    write_seed(dir, "segment-2x2-f32", 2, 2, 4, KT_DTYPE_F32, c4, 12, "full", 3);
    write_seed(dir, "segment-3x2-int8", 3, 2, 8, KT_DTYPE_INT8_TOKEN, c6, 9, "full", 0);
    write_seed(dir, "mha-3x2-fp8", 3, 2, 8, KT_DTYPE_FP8_E4M3_TOKEN, c6, 9, "streaming:sink=4,window=16", -1);
    /* block-padded (2.3): rows of 16 bytes padded to 4, so K and V split; a bf16 segment; int8 */
    write_seed_padded(dir, "padded-2x2-f32", 2, 2, 4, KT_DTYPE_F32, c4, 12, "full", -1, 4);
    write_seed_padded(dir, "padded-segment-3x2-bf16", 3, 2, 8, KT_DTYPE_BF16, c6, 9, "full", 1, 4);
    write_seed_padded(dir, "padded-2x2-int8", 2, 2, 4, KT_DTYPE_INT8_TOKEN, c4, 12, "full", -1, 3);
}

int main(void)
{
    const char *seeds = kt_env("KT_BUNDLE_SEEDS");
    if (seeds) write_seeds(seeds);

    test_crc();
    test_conversions();

    /* round trips: MHA and GQA shapes, empty lists, all three dtypes */
    static const uint32_t mha[8] = {5, 0, 7, 1, 0, 3, 12, 2};
    CHECK(round_trip(2, 4, 8, KT_DTYPE_F32, mha, 40), "mha f32");
    CHECK(round_trip(2, 4, 8, KT_DTYPE_BF16, mha, 40), "mha bf16");
    CHECK(round_trip(2, 4, 8, KT_DTYPE_F16, mha, 40), "mha f16");
    static const uint32_t gqa[6] = {17, 17, 3, 30, 0, 1};
    CHECK(round_trip(3, 2, 64, KT_DTYPE_BF16, gqa, 64), "gqa bf16");
    CHECK(round_trip(3, 2, 64, KT_DTYPE_F16, gqa, 64), "gqa f16");
    CHECK(round_trip(3, 2, 5, KT_DTYPE_F32, gqa, 31), "odd head_dim f32");
    static const uint32_t empty[4] = {0, 0, 0, 0};
    CHECK(round_trip(1, 4, 16, KT_DTYPE_F16, empty, 1), "all lists empty");
    uint32_t wide[8 * 8];
    for (int i = 0; i < 64; i++) wide[i] = (uint32_t)(rnd() % 50);
    CHECK(round_trip(8, 8, 128, KT_DTYPE_BF16, wide, 300), "8x8x128 bf16");

    test_damage();
    test_newer_minor();
    test_writer();
    test_check_model();
    test_quantized();
    test_segments();

    /* block padding (2.3) and the two-step parse */
    test_unpadded_bytes();
    CHECK(round_trip_padded(2, 4, 8, KT_DTYPE_F32, mha, 40, 4), "mha f32 padded to 4");
    CHECK(round_trip_padded(2, 4, 8, KT_DTYPE_BF16, mha, 40, 3), "mha bf16 padded to 3");
    CHECK(round_trip_padded(2, 4, 8, KT_DTYPE_F16, mha, 40, 16), "mha f16 padded to 16");
    CHECK(round_trip_padded(3, 2, 64, KT_DTYPE_INT8_TOKEN, gqa, 64, 16), "gqa int8 padded to 16");
    CHECK(round_trip_padded(3, 2, 64, KT_DTYPE_FP8_E4M3_TOKEN, gqa, 64, 17), "gqa fp8 padded to 17");
    CHECK(round_trip_padded(1, 4, 16, KT_DTYPE_F16, empty, 1, 8), "all lists empty, padded");
    CHECK(round_trip_padded(8, 8, 128, KT_DTYPE_BF16, wide, 300, 16), "8x8x128 bf16 padded to 16");
    test_padded_image();
    test_padded_damage();
    test_two_step();
    test_padded_set();
    return kt_done("test_bundle");
}
