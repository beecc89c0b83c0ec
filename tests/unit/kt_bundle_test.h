/*
 * kt_bundle_test.h - what the bundle codec's two test programs share (test_bundle.c: the codec
 * of one bundle; test_bundle_parts.c: bundles in parts and block padding): random data, a
 * sequence's lists to encode, round trips checked against the data, the damage macros and the
 * shapes both round-trip. Header-only (static inline): tests/unit/ builds one program per
 * test_*.c.
 */
#ifndef KT_BUNDLE_TEST_H
#define KT_BUNDLE_TEST_H

#include "kr_test.h"

#include "bundle.h"
#include "quant_bound.h"
#include "le.h"

#include <stdint.h>

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static inline uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static inline float rndf(void) { return (float)((double)(rnd() >> 11) / (double)(1ull << 53) * 8.0 - 4.0); }



static inline void header_init(kt_bundle_header *h, uint32_t layers, uint32_t heads, uint32_t dim,
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

static inline void seqkv_make(seqkv *s, uint32_t layers, uint32_t heads, uint32_t dim, kt_dtype dtype,
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

static inline void seqkv_free(seqkv *s)
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
static inline uint8_t *encode(const seqkv *s, uint64_t *size_out)
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
                REQUIRE(kt_bundle_writer_put(&w, l, hd,
                                             &(kt_rows_in){n, s->pos[i] + j, KT_DTYPE_F32,
                                                           s->k[i] + (size_t)j * dim,
                                                           s->v[i] + (size_t)j * dim},
                                             err) == 0,
                        "put: %s", err);
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
static inline float bf16_oracle(float x)
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

static inline float rounded(float x, kt_dtype t)
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
static inline void half_reads(const kt_bundle_view *v, const kt_bundle_list_view *lv, const float *k,
                       const float *vv)
{
    char err[KT_ERR_MAX];
    const size_t elems = (size_t)lv->count * v->hdr.head_dim;
    uint16_t *hk = malloc((elems + 1) * 2), *hv = malloc((elems + 1) * 2);
    const kt_dtype halves[2] = {KT_DTYPE_BF16, KT_DTYPE_F16};
    for (int t = 0; t < 2; t++) {
        const int rc =
            kt_bundle_list_read(v, lv, 0, &(kt_rows){lv->count, NULL, halves[t], hk, hv}, err);
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
    CHECK(kt_bundle_list_read(v, lv, 0, &(kt_rows){lv->count, NULL, KT_DTYPE_INT8_TOKEN, hk, hv},
                              err) == -1,
          "rows read as int8");
    CHECK_ERR_HAS(err, "f32, f16 or bf16");
    free(hk);
    free(hv);
}

/* Rows a list of `count` entries takes in a bundle padded to block_rows (0: packed). */
static inline uint64_t padded_rows(uint32_t count, uint32_t block_rows)
{
    return block_rows ? ((uint64_t)count + block_rows - 1) / block_rows * block_rows : count;
}

static inline int round_trip_padded(uint32_t layers, uint32_t heads, uint32_t dim, kt_dtype dtype,
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
                REQUIRE(kt_bundle_list_read(
                            &v, &lv, 0, &(kt_rows){lv.count, pos, KT_DTYPE_F32, k, vv}, err) == 0,
                        "%s", err);
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
                    REQUIRE(kt_bundle_list_read(&v, &lv, lv.count - 1,
                                                &(kt_rows){1, NULL, KT_DTYPE_F32, part, NULL},
                                                err) == 0,
                            "%s", err);
                    CHECK(memcmp(part, k + (size_t)(lv.count - 1) * dim, dim * sizeof(float)) == 0,
                          "partial read");
                    free(part);
                }
                CHECK(kt_bundle_list_read(&v, &lv, lv.count,
                                          &(kt_rows){1, pos, KT_DTYPE_F32, NULL, NULL}, err) == -1,
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

static inline int round_trip(uint32_t layers, uint32_t heads, uint32_t dim, kt_dtype dtype,
                      const uint32_t *counts, int32_t next_pos)
{
    return round_trip_padded(layers, heads, dim, dtype, counts, next_pos, 0);
}


/* The sections of an unpadded bundle's table, in order. */
enum { SEC_LISTS, SEC_POS, SEC_K, SEC_V };

static inline void reseal_header(uint8_t *b)
{
    kt_wr32(b + 28, 0);
    kt_wr32(b + 28, kt_crc32c(0, b, kt_rd32(b + 12)));
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


/* The list lengths of the bundle the damage tests start from (2 layers x 2 heads). */
static const uint32_t BASE_COUNTS[4] = {3, 0, 2, 5};

/* Round-trip shapes: list lengths for MHA (2 layers x 4 heads) and GQA (3 x 2), all empty (1 x
 * 4). */
static const uint32_t SHAPE_MHA[8] = {5, 0, 7, 1, 0, 3, 12, 2};
static const uint32_t SHAPE_GQA[6] = {17, 17, 3, 30, 0, 1};
static const uint32_t SHAPE_EMPTY[4] = {0, 0, 0, 0};

#endif /* KT_BUNDLE_TEST_H */
