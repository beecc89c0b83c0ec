/*
 * test_ops.c - every CPU backend op against a naive double-precision reference written out in
 * full here: matmul (f32/bf16/f16 weights, 1..9 tokens so both the dot-product and the sgemm
 * paths run, odd sizes, bias, accumulate; the AVX-512-BF16 GEMM of bf16 weights on its tails and
 * blocks, against the reference on x rounded to bf16, as the variant's contract says), RMSNorm, RoPE, SiLU gating, the vectorised exp, and
 * attention over the paged cache (GQA ratios 1/2/4, head dims 32/64/80, chunks, sliding window,
 * a block size that does not divide the length). These are the references the CUDA ops will
 * be compared with too. KV caches of bf16 and f16: each variant's row conversions against the
 * scalar ones bit for bit (ties, subnormals, overflow, NaN payloads), the row dot and axpy kernels against the f32 ones on
 * the widened rows (odd lengths, tails), and attention (both paths, batched), scoring and
 * sequence read-back over a bf16/f16 pool bit for bit against an f32 pool holding the same
 * rounded entries, besides the double reference on those entries. Every variant of the CPU
 * backend this CPU runs (AVX-512-BF16, AVX-512, AVX2, plain C: engine/cpu-dispatch.c) is checked, each
 * against the same references; the row kernels at the instruction set this test is built for.
 */
#include "kr_test.h"

#include "backend.h"
#include "model_shell.h"
/* the vectorised exp and the row kernels below are simd.h's at the instruction set this test is
 * compiled for */
#if defined(__AVX512F__)
#define KR_CPU_LEVEL 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KR_CPU_LEVEL 1
#else
#define KR_CPU_LEVEL 0
#endif
#include "cpu/simd.h"

static const kr_backend_ops *ops; /* the variant under test */
/* the fewest tokens the CPU's matmul takes through its GEMM instead of dot products (cpu.h) */
enum { GEMM_ROWS = 6 };

static uint64_t rng = 0x853c49e6748fea9bull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1.0p-52 - 1.0);
}

static uint32_t rand_bits(void) /* 32 uniform random bits */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

/* a model shell: the CPU backend only reads the config from it */

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* x rounded to dtype t and widened back, in place */
static void round_to(kr_dtype t, float *x, size_t n)
{
    void *tmp = malloc(n * sizeof(float));
    kr_dtype_from_f32(t, x, n, tmp);
    kr_dtype_to_f32(t, tmp, n, x);
    free(tmp);
}

static void check_matmul(kr_backend *b, kr_dtype dt, int in, int out, int n, int bias, int accumulate)
{
    size_t es = kr_dtype_size(dt);
    void *w = malloc((size_t)in * out * es);
    float *wf = malloc(sizeof(float) * (size_t)in * out);
    for (size_t i = 0; i < (size_t)in * out; i++) {
        float v = frand() * 0.1f;
        if (dt == KR_DTYPE_BF16) ((uint16_t *)w)[i] = kr_f32_to_bf16(v), wf[i] = kr_bf16_to_f32(((uint16_t *)w)[i]);
        else if (dt == KR_DTYPE_F16) ((uint16_t *)w)[i] = kr_f32_to_f16(v), wf[i] = kr_f16_to_f32(((uint16_t *)w)[i]);
        else ((float *)w)[i] = wf[i] = v;
    }
    float *bv = malloc(sizeof(float) * out), *x = malloc(sizeof(float) * (size_t)n * in);
    float *y = malloc(sizeof(float) * (size_t)n * out), *y0 = malloc(sizeof(float) * (size_t)n * out);
    for (int i = 0; i < out; i++) bv[i] = frand();
    for (int i = 0; i < n * in; i++) x[i] = frand();
    for (int i = 0; i < n * out; i++) y[i] = y0[i] = frand();
    kr_tensor tw = {.data = w, .dtype = dt, .rows = out, .cols = in};
    kr_tensor tb = {.data = bv, .dtype = KR_DTYPE_F32, .rows = 1, .cols = out};
    ops->matmul(b, &tw, bias ? &tb : NULL, x, n, accumulate, y);
    /* the x the variant multiplies: rounded to bf16 where its contract says so */
    float *xr = malloc(sizeof(float) * (size_t)n * in);
    memcpy(xr, x, sizeof(float) * (size_t)n * in);
    const int bf16_x = dt == KR_DTYPE_BF16 && ops->bf16_x_min_tokens > 0 && n >= ops->bf16_x_min_tokens;
    if (bf16_x) round_to(KR_DTYPE_BF16, xr, (size_t)n * in);
    double worst = 0;
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double r = (accumulate ? y0[t * out + o] : 0) + (bias ? bv[o] : 0);
            for (int i = 0; i < in; i++) r += (double)xr[t * in + i] * wf[(size_t)o * in + i];
            double e = fabs(r - y[t * out + o]);
            worst = kt_worst(worst, e);
        }
    CHECK(worst < 2e-5 * sqrt((double)in), "matmul %s in %d out %d n %d bias %d acc %d: err %.3g",
          kr_dtype_name(dt), in, out, n, bias, accumulate, worst);
    if (bf16_x && n > GEMM_ROWS && !accumulate) {
        /* a token's row does not depend on the others: the first GEMM_ROWS alone (still a GEMM) */
        const int m = GEMM_ROWS;
        float *y1 = malloc(sizeof(float) * (size_t)m * out);
        ops->matmul(b, &tw, bias ? &tb : NULL, x, m, 0, y1);
        int same = 1;
        for (int i = 0; i < m * out; i++) same &= bits(y1[i]) == bits(y[i]);
        CHECK(same, "matmul bf16 in %d out %d: the first %d rows of %d differ from those rows alone", in, out, m, n);
        free(y1);
    }
    free(w), free(wf), free(bv), free(x), free(xr), free(y), free(y0);
}

/* A sequence of one layer in a new pool of dtype dt: len entries per KV head, positions 0..len-1,
 * keys and values k, v [len][kv_heads][hd] stored through the backend (rounded to dt). */
static kr_seq *stored_seq(kr_backend *b, kr_dtype dt, int kv_heads, int hd, int len, int bs, const float *k,
                          const float *v, const int32_t *pos)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *pool;
    kr_seq *s;
    REQUIRE(kr_kv_pool_create(hd, bs, 4096, dt, &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, 1, kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(s, len, err) == KR_OK, "%s", err);
    for (int g = 0; g < kv_heads; g++) kr_seq_list(s, 0, g)->len = len;
    ops->kv_store(b, s, 0, k, v, len, pos);
    return s;
}

static void free_seq(kr_seq *s)
{
    kr_kv_pool *pool = s->pool;
    kr_seq_free(s);
    kr_kv_pool_free(pool);
}


/* Attention over a pool of dtype dt against the double reference on the rounded entries; for
 * bf16 and f16 also against an f32 pool holding those rounded entries, which must give the same
 * bits (both paths; the batch op and the score op too). */
static void check_attention(kr_backend *b, kr_dtype dt, int heads, int kv_heads, int hd, int len, int n, int window,
                            int bs)
{
    /* len entries per KV head at positions 0..len-1; the last n are "the chunk" */
    float *k = malloc(sizeof(float) * (size_t)len * kv_heads * hd), *v = malloc(sizeof(float) * (size_t)len * kv_heads * hd);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)len);
    for (int i = 0; i < len * kv_heads * hd; i++) k[i] = frand() * 2, v[i] = frand();
    for (int i = 0; i < len; i++) pos[i] = i;
    kr_seq *s = stored_seq(b, dt, kv_heads, hd, len, bs, k, v, pos);
    round_to(dt, k, (size_t)len * kv_heads * hd); /* what the pool holds, for the reference */
    round_to(dt, v, (size_t)len * kv_heads * hd);
    float *q = malloc(sizeof(float) * (size_t)n * heads * hd), *out = malloc(sizeof(float) * (size_t)n * heads * hd);
    for (int i = 0; i < n * heads * hd; i++) q[i] = frand() * 2;
    ops->attention(b, s, 0, q, n, heads, pos + len - n, window, out);
    if (dt != KR_DTYPE_F32) {
        kr_seq *f = stored_seq(b, KR_DTYPE_F32, kv_heads, hd, len, bs, k, v, pos);
        float *want = malloc(sizeof(float) * (size_t)n * heads * hd);
        ops->attention(b, f, 0, q, n, heads, pos + len - n, window, want);
        CHECK(!memcmp(out, want, sizeof(float) * (size_t)n * heads * hd),
              "attention %s heads %d/%d hd %d len %d n %d: differs from the f32 pool of the rounded entries",
              kr_dtype_name(dt), heads, kv_heads, hd, len, n);
        /* the last token alone through the batch op, and the observers' scores */
        const kr_seq *one[] = {s}, *one_f[] = {f};
        const float *ql = q + (size_t)(n - 1) * heads * hd;
        ops->attention_batch(b, one, 0, ql, 1, heads, pos + len - 1, window, out);
        ops->attention_batch(b, one_f, 0, ql, 1, heads, pos + len - 1, window, want);
        CHECK(!memcmp(out, want, sizeof(float) * (size_t)heads * hd), "attention_batch %s hd %d len %d",
              kr_dtype_name(dt), hd, len);
        float *sc = malloc(sizeof(float) * (size_t)heads * len), *sc_f = malloc(sizeof(float) * (size_t)heads * len);
        for (int per_head = 0; per_head < 2; per_head++) {
            ops->score(b, s, 0, q, n, heads, per_head, sc, (size_t)len);
            ops->score(b, f, 0, q, n, heads, per_head, sc_f, (size_t)len);
            int rows = per_head ? heads : kv_heads;
            CHECK(!memcmp(sc, sc_f, sizeof(float) * (size_t)rows * len), "score %s per_head %d hd %d len %d",
                  kr_dtype_name(dt), per_head, hd, len);
        }
        /* reading the pool back gives the rounded entries */
        float *rk = malloc(sizeof(float) * (size_t)len * hd), *rv = malloc(sizeof(float) * (size_t)len * hd);
        char err[KR_ERR_MAX];
        int same = 1;
        for (int g = 0; g < kv_heads; g++) {
            REQUIRE(kr_seq_list_read(s, 0, g, 0, len, NULL, rk, rv, err) == KR_OK, "%s", err);
            for (int j = 0; j < len; j++)
                same &= !memcmp(rk + (size_t)j * hd, k + ((size_t)j * kv_heads + g) * hd, sizeof(float) * hd) &&
                        !memcmp(rv + (size_t)j * hd, v + ((size_t)j * kv_heads + g) * hd, sizeof(float) * hd);
        }
        CHECK(same, "list_read %s hd %d: not the rounded entries", kr_dtype_name(dt), hd);
        free(rk), free(rv), free(sc), free(sc_f), free(want);
        free_seq(f);
        ops->attention(b, s, 0, q, n, heads, pos + len - n, window, out);
    }
    double worst = 0, *sc = malloc(sizeof(double) * len);
    int group = heads / kv_heads;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < heads; h++) {
            int g = h / group, p = len - n + t;
            const float *qh = q + ((size_t)t * heads + h) * hd;
            double mx = -1e300, z = 0;
            for (int j = 0; j <= p; j++) {
                if (window > 0 && j <= p - window) continue;
                double dot = 0;
                for (int e = 0; e < hd; e++) dot += (double)qh[e] * k[((size_t)j * kv_heads + g) * hd + e];
                sc[j] = dot / sqrt((double)hd);
                mx = sc[j] > mx ? sc[j] : mx;
            }
            for (int j = 0; j <= p; j++)
                if (!(window > 0 && j <= p - window)) z += sc[j] = exp(sc[j] - mx);
            for (int e = 0; e < hd; e++) {
                double r = 0;
                for (int j = 0; j <= p; j++)
                    if (!(window > 0 && j <= p - window)) r += sc[j] / z * v[((size_t)j * kv_heads + g) * hd + e];
                double err2 = fabs(r - out[((size_t)t * heads + h) * hd + e]);
                worst = kt_worst(worst, err2);
            }
        }
    CHECK(worst < 1e-5, "attention %s heads %d/%d hd %d len %d n %d window %d bs %d: err %.3g", kr_dtype_name(dt),
          heads, kv_heads, hd, len, n, window, bs, worst);
    free(sc), free(k), free(v), free(pos), free(q), free(out);
    free_seq(s);
}

/* bits of a float, for comparing conversions exactly */

/* first mismatch of a conversion check, for the message */
typedef struct conv_bad {
    int count;
    size_t at;
    uint32_t in, got, want;
} conv_bad;

static void conv_note(conv_bad *bad, size_t at, uint32_t in, uint32_t got, uint32_t want)
{
    if (got == want) return;
    if (bad->count++ == 0) bad->at = at, bad->in = in, bad->got = got, bad->want = want;
}

/* A variant's row conversions against the scalar ones of kr-util.h, bit for bit: a NaN of another
 * payload or quietness is a mismatch. Widening: every bf16 and f16 value. Narrowing: values that
 * probe the rounding (ties either way, bf16 and f16 subnormals, f32 denormals, the f16 overflow
 * threshold, the largest floats, infinities, quiet and signalling NaNs of either sign with
 * payloads in high and low bits), then random bit patterns. Both on every length 0..40 from
 * three start offsets, so that every vector body and tail runs, with a sentinel after the end. */
static void check_conversions(const char *what, const kr_convert_ops *cv)
{
    enum { N = 1 << 16, MAXN = 40, SENTINEL = 0x5a5a };
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u, /* zeros, ones */
        0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0xbf818000u, /* bf16 ties and near */
        0x477fe000u, 0x477fefffu, 0x477ff000u, 0xc77ff000u, 0x477fffffu, /* f16 largest, overflow */
        0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0x33c00000u, 0xb3400000u, /* f16 subnormal */
        0x00000001u, 0x807fffffu, 0x00400000u, 0x0000ffffu, /* f32 denormals */
        0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f800000u, 0xff800000u, /* largest, infinities */
        0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fa00000u, 0xff812345u, /* NaNs */
        0x7fffffffu, 0x7f80e000u, 0x7f802000u, 0xffbfffffu, 0x7fc0ffffu,
    };
    enum { N_SPECIAL = sizeof special / sizeof special[0] };
    static float x[N], wide[N + 1];
    static uint16_t h[N], narrow[N + 1];
    const kr_dtype dts[] = {KR_DTYPE_BF16, KR_DTYPE_F16};
    for (int t = 0; t < 2; t++) {
        const kr_dtype dt = dts[t];
        conv_bad bad = {0};
        /* widening: all 2^16 values at once, then every short length */
        for (size_t i = 0; i < N; i++) h[i] = (uint16_t)i;
        cv->to_f32(dt, h, N, wide);
        for (size_t i = 0; i < N; i++)
            conv_note(&bad, i, h[i], bits(wide[i]), bits(dt == KR_DTYPE_BF16 ? kr_bf16_to_f32(h[i]) : kr_f16_to_f32(h[i])));
        for (size_t start = 0x7bf0; start < 0x7bf3; start++) /* f16 overflow, inf and NaNs in the rows */
            for (size_t n = 0; n <= MAXN; n++) {
                float guard;
                uint32_t g = 0x5a5a5a5au;
                memcpy(&guard, &g, sizeof guard);
                wide[n] = guard;
                cv->to_f32(dt, h + start, n, wide);
                for (size_t i = 0; i < n; i++) {
                    uint16_t v = h[start + i];
                    conv_note(&bad, start + i, v, bits(wide[i]),
                              bits(dt == KR_DTYPE_BF16 ? kr_bf16_to_f32(v) : kr_f16_to_f32(v)));
                }
                conv_note(&bad, start + n, 0, bits(wide[n]), g); /* nothing written past n */
            }
        CHECK(bad.count == 0, "%s: %s to f32: %d values differ from the scalar conversion, first at %zu: 0x%04x gave 0x%08x, want 0x%08x",
              what, kr_dtype_name(dt), bad.count, bad.at, bad.in, bad.got, bad.want);

        /* narrowing: the probes, then random bits */
        bad = (conv_bad){0};
        for (size_t i = 0; i < N; i++) {
            uint32_t u = i < N_SPECIAL ? special[i] : rand_bits();
            memcpy(&x[i], &u, sizeof u);
        }
        cv->from_f32(dt, x, N, narrow);
        for (size_t i = 0; i < N; i++)
            conv_note(&bad, i, bits(x[i]), narrow[i], dt == KR_DTYPE_BF16 ? kr_f32_to_bf16(x[i]) : kr_f32_to_f16(x[i]));
        for (size_t start = 0; start < 3; start++)
            for (size_t n = 0; n <= MAXN; n++) {
                narrow[n] = SENTINEL;
                cv->from_f32(dt, x + start, n, narrow);
                for (size_t i = 0; i < n; i++) {
                    float v = x[start + i];
                    conv_note(&bad, start + i, bits(v), narrow[i], dt == KR_DTYPE_BF16 ? kr_f32_to_bf16(v) : kr_f32_to_f16(v));
                }
                conv_note(&bad, start + n, 0, narrow[n], SENTINEL);
            }
        CHECK(bad.count == 0, "%s: f32 to %s: %d values differ from the scalar conversion, first at %zu: 0x%08x gave 0x%04x, want 0x%04x",
              what, kr_dtype_name(dt), bad.count, bad.at, bad.in, bad.got, bad.want);
    }
    /* f32 rows are copies */
    for (size_t i = 0; i < 64; i++) x[i] = frand();
    cv->to_f32(KR_DTYPE_F32, x, 63, wide);
    cv->from_f32(KR_DTYPE_F32, wide, 63, narrow);
    CHECK(!memcmp(x, wide, 63 * sizeof(float)) && !memcmp(x, narrow, 63 * sizeof(float)), "%s: f32 rows are copied", what);
}

/* The scalar conversions themselves: ties to even, overflow, subnormals, NaN stays NaN */
static void check_scalar_conversions(void)
{
    CHECK(kr_f32_to_bf16(1.00390625f) == 0x3f80 && kr_f32_to_bf16(1.01171875f) == 0x3f82, "bf16 ties to even");
    CHECK(kr_f32_to_f16(65519.996f) == 0x7bff && kr_f32_to_f16(65520.0f) == 0x7c00, "f16 overflow threshold");
    CHECK(kr_f32_to_f16(2.9802322e-8f) == 0 && kr_f32_to_f16(2.9802326e-8f) == 1, "f16 smallest subnormal");
    CHECK(isnan(kr_bf16_to_f32(kr_f32_to_bf16(NAN))) && isnan(kr_f16_to_f32(kr_f32_to_f16(-NAN))), "NaN stays NaN");
}

/* The bf16 and f16 row kernels give bit for bit what the f32 ones give on the widened rows. */
static void check_row_ops(void)
{
    enum { MAXN = 160 };
    float a[MAXN], wide[MAXN], y1[MAXN], y2[MAXN], src[MAXN];
    uint16_t row[MAXN];
    const int lens[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 80, 127, 128, 129, 160};
    const kr_dtype dts[] = {KR_DTYPE_BF16, KR_DTYPE_F16};
    for (int t = 0; t < 2; t++)
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            int n = lens[li];
            for (int i = 0; i < n; i++) a[i] = frand(), src[i] = frand() * 3, y1[i] = y2[i] = frand();
            kr_dtype_from_f32(dts[t], src, (size_t)n, row);
            kr_dtype_to_f32(dts[t], row, (size_t)n, wide);
            float d1 = kr_dot_row(a, row, dts[t], n), d2 = kr_dot_f32(a, wide, n);
            CHECK(bits(d1) == bits(d2), "dot %s n %d: %.9g vs %.9g", kr_dtype_name(dts[t]), n, d1, d2);
            kr_axpy_row(y1, 0.37f, row, dts[t], n);
            kr_axpy_f32(y2, 0.37f, wide, n);
            CHECK(!memcmp(y1, y2, sizeof(float) * (size_t)n), "axpy %s n %d", kr_dtype_name(dts[t]), n);
        }
}

static void check_variant(void)
{
    char err[KR_ERR_MAX];
    kr_model m = kr_test_model_shell(96, 160, 8, 2, 64);
    kr_backend *b;
    REQUIRE(ops->create(&m, 2, 64, &b, err) == KR_OK, "%s", err);

    const kr_dtype dts[] = {KR_DTYPE_F32, KR_DTYPE_BF16, KR_DTYPE_F16};
    const int ns[] = {1, 2, 5, 6, 9};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 5; j++) {
            check_matmul(b, dts[i], 96, 160, ns[j], j & 1, j == 2);
            check_matmul(b, dts[i], 37, 19, ns[j], 1, 1); /* sizes no vector width divides */
        }
    /* bf16 GEMMs within one column block and past it (2048), odd in, outputs no tile width
     * divides, token counts with every tail, and more tokens than the scratch's 64 rows; a model
     * as wide as the widest input, which the backend sizes its scratch for */
    kr_model wide = kr_test_model_shell(2085, 1024, 8, 2, 64);
    kr_backend *bw;
    REQUIRE(ops->create(&wide, 2, 64, &bw, err) == KR_OK, "%s", err);
    check_matmul(bw, KR_DTYPE_BF16, 1037, 101, 70, 1, 0);
    check_matmul(bw, KR_DTYPE_BF16, 1024, 96, 13, 0, 1);
    check_matmul(bw, KR_DTYPE_BF16, 768, 48, 8, 0, 0);
    check_matmul(bw, KR_DTYPE_BF16, 2085, 53, 19, 1, 1);
    check_matmul(bw, KR_DTYPE_BF16, 2085, 40, 9, 0, 0);
    ops->destroy(bw);

    /* RMSNorm, SiLU gating, RoPE: element-wise against their formulas */
    float x[3 * 96], y[3 * 96], w[96];
    for (int i = 0; i < 3 * 96; i++) x[i] = frand() * 3;
    for (int i = 0; i < 96; i++) w[i] = 1 + frand() * 0.1f;
    kr_tensor tw = {.data = w, .dtype = KR_DTYPE_F32, .rows = 1, .cols = 96};
    ops->rmsnorm(b, x, &tw, 3, 96, 1e-5f, y);
    double worst = 0;
    for (int t = 0; t < 3; t++) {
        double ss = 0;
        for (int i = 0; i < 96; i++) ss += (double)x[t * 96 + i] * x[t * 96 + i];
        for (int i = 0; i < 96; i++)
            worst = kt_worst(worst, fabs(w[i] * x[t * 96 + i] / sqrt(ss / 96 + 1e-5) - y[t * 96 + i]));
    }
    CHECK(worst < 1e-5, "rmsnorm err %.3g", worst);
    float g[300], u[300], g0[300];
    for (int i = 0; i < 300; i++) g[i] = g0[i] = frand() * 8, u[i] = frand();
    const float far[] = {0.0f, -0.0f, 30.0f, -30.0f, 90.0f, -90.0f, 1e-20f, -1e-20f}; /* exp's clamp, both signs */
    for (int i = 0; i < 8; i++) g[i * 37] = g0[i * 37] = far[i];
    ops->swiglu(b, g, u, 300);
    worst = 0;
    for (int i = 0; i < 300; i++) worst = kt_worst(worst, fabs(g0[i] / (1 + exp(-g0[i])) * u[i] - g[i]));
    CHECK(worst < 1e-5, "swiglu err %.3g", worst);
    float r[2 * 3 * 8], r0[2 * 3 * 8], cs[2 * 4 * 2];
    for (int i = 0; i < 48; i++) r[i] = r0[i] = frand();
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 4; i++) cs[(t * 4 + i) * 2] = cosf(0.3f * (t + 1) * (i + 1)), cs[(t * 4 + i) * 2 + 1] = sinf(0.3f * (t + 1) * (i + 1));
    ops->rope(b, r, 2, 3, 8, cs);
    worst = 0;
    for (int t = 0; t < 2; t++)
        for (int h = 0; h < 3; h++)
            for (int i = 0; i < 4; i++) { /* rotate-half: pair (i, i + 4) */
                double a = 0.3 * (t + 1) * (i + 1), x1 = r0[(t * 3 + h) * 8 + i], x2 = r0[(t * 3 + h) * 8 + i + 4];
                worst = kt_worst(worst, fabs(x1 * cos(a) - x2 * sin(a) - r[(t * 3 + h) * 8 + i]));
                worst = kt_worst(worst, fabs(x2 * cos(a) + x1 * sin(a) - r[(t * 3 + h) * 8 + i + 4]));
            }
    CHECK(worst < 1e-6, "rope err %.3g", worst);

    /* vectorised exp: relative error over [-87, 0] */
    float e[4096], e_in[4096];
    worst = 0;
    for (int i = 0; i < 4096; i++) e[i] = e_in[i] = -87.0f * (float)i / 4095.0f;
    float sum = kr_exp_shift_sum(e, 4096, 0.0f);
    double ref_sum = 0;
    for (int i = 0; i < 4096; i++) {
        double ref = exp((double)e_in[i]);
        ref_sum += ref;
        worst = kt_worst(worst, fabs(e[i] - ref) / ref);
    }
    CHECK(worst < 5e-7, "exp relative err %.3g", worst);
    /* the vector paths sum in KR_VL lanes; plain C adds 4096 floats one after another */
    CHECK(fabs(sum - ref_sum) / ref_sum < (KR_CPU_LEVEL ? 1e-6 : 1e-5), "exp sum %.9g vs %.9g", sum,
          ref_sum);

    ops->destroy(b);

    /* attention: GQA 1/2/4, head dims, chunks, windows, block sizes */
    const struct { int heads, kv, hd, len, n, window, bs; } at[] = {
        {4, 4, 32, 1, 1, 0, 16},   {4, 4, 32, 37, 37, 0, 16}, {8, 2, 64, 300, 1, 0, 16},
        {8, 2, 64, 300, 7, 0, 5},  {8, 4, 80, 129, 64, 0, 16}, {8, 2, 64, 300, 9, 17, 16},
        {4, 1, 32, 50, 50, 1, 3},  {12, 4, 64, 700, 3, 256, 16}, {8, 2, 64, 300, 200, 33, 16},
        {6, 2, 128, 1000, 1000, 0, 16},
    };
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
        kr_model ma = kr_test_model_shell(at[i].heads * at[i].hd, 64, at[i].heads, at[i].kv, at[i].hd);
        REQUIRE(ops->create(&ma, 2, 64, &b, err) == KR_OK, "%s", err);
        for (int t = 0; t < 3; t++)
            check_attention(b, dts[t], at[i].heads, at[i].kv, at[i].hd, at[i].len, at[i].n, at[i].window, at[i].bs);
        ops->destroy(b);
    }
    /* head dims no vector width divides, on both paths, in the cache's dtypes */
    const struct { int heads, kv, hd, len, n, bs; } odd[] = {{6, 2, 33, 150, 1, 7}, {6, 2, 33, 150, 40, 7},
                                                           {4, 4, 17, 200, 20, 16}, {3, 1, 5, 41, 3, 4}};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        kr_model ma = kr_test_model_shell(odd[i].heads * odd[i].hd, 64, odd[i].heads, odd[i].kv, odd[i].hd);
        REQUIRE(ops->create(&ma, 2, 64, &b, err) == KR_OK, "%s", err);
        for (int t = 0; t < 3; t++)
            check_attention(b, dts[t], odd[i].heads, odd[i].kv, odd[i].hd, odd[i].len, odd[i].n, 0, odd[i].bs);
        ops->destroy(b);
    }
}

int main(void)
{
    check_scalar_conversions();
    check_row_ops();
    int ran = 0;
    for (const char *const *isa = (const char *const[]){"avx512bf16", "avx512", "avx2", "base", NULL}; *isa; isa++) {
        if (!kr_cpu_isa_supported(*isa)) {
            printf("test_ops: this CPU does not run the %s variant: skipped\n", *isa);
            continue;
        }
        ops = kr_cpu_backend_variant(*isa);
        REQUIRE(ops && kr_cpu_convert_variant(*isa), "no %s variant", *isa);
        printf("test_ops: the %s variant\n", *isa);
        check_conversions(*isa, kr_cpu_convert_variant(*isa));
        check_variant();
        ran++;
    }
    CHECK(ran >= 1 && kr_cpu_isa_supported(kr_cpu_isa()), "the chosen variant (%s) runs here",
          kr_cpu_isa());
    const kr_convert_ops dispatched = {.to_f32 = kr_dtype_to_f32, .from_f32 = kr_dtype_from_f32};
    check_conversions("kr_dtype_to_f32 / kr_dtype_from_f32", &dispatched);
    return kt_done("test_ops");
}
