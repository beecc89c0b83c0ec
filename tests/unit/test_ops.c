/*
 * test_ops.c - every CPU backend op against a naive double-precision reference written out in
 * full here: matmul (f32/bf16/f16 weights, 1..9 tokens so both the dot-product and the sgemm
 * paths run, odd sizes, bias, accumulate), RMSNorm, RoPE, SiLU gating, the vectorised exp, and
 * attention over the paged cache (GQA ratios 1/2/4, head dims 32/64/80, chunks, sliding window,
 * a block size that does not divide the length). These are the references the CUDA ops will
 * be compared with too.
 */
#include "kr_test.h"

#include "backend.h"
#include "cpu/cpu.h"
#include "cpu/simd.h"

static uint64_t rng = 0x853c49e6748fea9bull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1.0p-52 - 1.0);
}

/* a model shell: the CPU backend only reads the config from it */
static kr_model shell(int d, int f, int heads, int kv_heads, int head_dim)
{
    kr_model m;
    memset(&m, 0, sizeof m);
    m.cfg.hidden_size = d;
    m.cfg.intermediate_size = f;
    m.cfg.n_heads = heads;
    m.cfg.n_kv_heads = kv_heads;
    m.cfg.head_dim = head_dim;
    return m;
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
    kr_cpu_backend.matmul(b, &tw, bias ? &tb : NULL, x, n, accumulate, y);
    double worst = 0;
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double r = (accumulate ? y0[t * out + o] : 0) + (bias ? bv[o] : 0);
            for (int i = 0; i < in; i++) r += (double)x[t * in + i] * wf[(size_t)o * in + i];
            double e = fabs(r - y[t * out + o]);
            worst = kt_worst(worst, e);
        }
    CHECK(worst < 2e-5 * sqrt((double)in), "matmul %s in %d out %d n %d bias %d acc %d: err %.3g",
          kr_dtype_name(dt), in, out, n, bias, accumulate, worst);
    free(w), free(wf), free(bv), free(x), free(y), free(y0);
}

static void check_attention(kr_backend *b, int heads, int kv_heads, int hd, int len, int n, int window, int bs)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *pool;
    kr_seq *s;
    REQUIRE(kr_kv_pool_create(hd, bs, 4096, &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, 1, kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(s, len, err) == KR_OK, "%s", err);
    /* len entries per KV head at positions 0..len-1; the last n are "the chunk" */
    float *k = malloc(sizeof(float) * (size_t)len * kv_heads * hd), *v = malloc(sizeof(float) * (size_t)len * kv_heads * hd);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)len);
    for (int i = 0; i < len * kv_heads * hd; i++) k[i] = frand() * 2, v[i] = frand();
    for (int i = 0; i < len; i++) pos[i] = i;
    for (int g = 0; g < kv_heads; g++) kr_seq_list(s, 0, g)->len = len;
    kr_cpu_backend.kv_store(b, s, 0, k, v, len, pos);
    float *q = malloc(sizeof(float) * (size_t)n * heads * hd), *out = malloc(sizeof(float) * (size_t)n * heads * hd);
    for (int i = 0; i < n * heads * hd; i++) q[i] = frand() * 2;
    kr_cpu_backend.attention(b, s, 0, q, n, heads, pos + len - n, window, out);
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
    CHECK(worst < 1e-5, "attention heads %d/%d hd %d len %d n %d window %d bs %d: err %.3g", heads,
          kv_heads, hd, len, n, window, bs, worst);
    free(sc), free(k), free(v), free(pos), free(q), free(out);
    kr_seq_free(s);
    kr_kv_pool_free(pool);
}

int main(void)
{
    char err[KR_ERR_MAX];
    kr_model m = shell(96, 160, 8, 2, 64);
    kr_backend *b;
    REQUIRE(kr_cpu_backend.create(&m, 2, 64, &b, err) == KR_OK, "%s", err);

    const kr_dtype dts[] = {KR_DTYPE_F32, KR_DTYPE_BF16, KR_DTYPE_F16};
    const int ns[] = {1, 2, 5, 6, 9};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 5; j++) {
            check_matmul(b, dts[i], 96, 160, ns[j], j & 1, j == 2);
            check_matmul(b, dts[i], 37, 19, ns[j], 1, 1); /* sizes no vector width divides */
        }

    /* RMSNorm, SiLU gating, RoPE: element-wise against their formulas */
    float x[3 * 96], y[3 * 96], w[96];
    for (int i = 0; i < 3 * 96; i++) x[i] = frand() * 3;
    for (int i = 0; i < 96; i++) w[i] = 1 + frand() * 0.1f;
    kr_tensor tw = {.data = w, .dtype = KR_DTYPE_F32, .rows = 1, .cols = 96};
    kr_cpu_backend.rmsnorm(b, x, &tw, 3, 96, 1e-5f, y);
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
    kr_cpu_backend.swiglu(b, g, u, 300);
    worst = 0;
    for (int i = 0; i < 300; i++) worst = kt_worst(worst, fabs(g0[i] / (1 + exp(-g0[i])) * u[i] - g[i]));
    CHECK(worst < 1e-5, "swiglu err %.3g", worst);
    float r[2 * 3 * 8], r0[2 * 3 * 8], cs[2 * 4 * 2];
    for (int i = 0; i < 48; i++) r[i] = r0[i] = frand();
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 4; i++) cs[(t * 4 + i) * 2] = cosf(0.3f * (t + 1) * (i + 1)), cs[(t * 4 + i) * 2 + 1] = sinf(0.3f * (t + 1) * (i + 1));
    kr_cpu_backend.rope(b, r, 2, 3, 8, cs);
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
    CHECK(fabs(sum - ref_sum) / ref_sum < 1e-6, "exp sum %.9g vs %.9g", sum, ref_sum);

    kr_cpu_backend.destroy(b);

    /* attention: GQA 1/2/4, head dims, chunks, windows, block sizes */
    const struct { int heads, kv, hd, len, n, window, bs; } at[] = {
        {4, 4, 32, 1, 1, 0, 16},   {4, 4, 32, 37, 37, 0, 16}, {8, 2, 64, 300, 1, 0, 16},
        {8, 2, 64, 300, 7, 0, 5},  {8, 4, 80, 129, 64, 0, 16}, {8, 2, 64, 300, 9, 17, 16},
        {4, 1, 32, 50, 50, 1, 3},  {12, 4, 64, 700, 3, 256, 16}, {8, 2, 64, 300, 200, 33, 16},
        {6, 2, 128, 1000, 1000, 0, 16},
    };
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
        kr_model ma = shell(at[i].heads * at[i].hd, 64, at[i].heads, at[i].kv, at[i].hd);
        REQUIRE(kr_cpu_backend.create(&ma, 2, 64, &b, err) == KR_OK, "%s", err);
        check_attention(b, at[i].heads, at[i].kv, at[i].hd, at[i].len, at[i].n, at[i].window, at[i].bs);
        kr_cpu_backend.destroy(b);
    }
    return kt_done("test_ops");
}
