/*
 * test_score_past.c - the backend op `score_past` (observers that come after every entry they
 * score: TAKE's accumulated probe) against a naive double-precision reference written out
 * here: lists of different lengths per KV head, GQA ratios 1/2/4, n_hidden 0 and > 0 (the
 * hidden newest entries must score exactly 0), per KV head and per query head, a block size
 * that does not divide the lengths. Also: with one observer and n_hidden = 0 it equals `score`
 * (a single causal observer at the end of the list sees the whole list too).
 */
#include "kr_test.h"

#include "backend.h"
#include "model_shell.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1.0p-52 - 1.0);
}

static void check(int heads, int kv_heads, int hd, int n_obs, int hidden, int bs)
{
    char err[KR_ERR_MAX];
    kr_model m = kr_test_model_shell(heads * hd, 64, heads, kv_heads, hd);
    kr_backend *b;
    REQUIRE(kr_cpu_backend.create(&m, 2, 64, &b, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    kr_seq *s;
    REQUIRE(kr_kv_pool_create(hd, bs, 1024, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, 1, kv_heads, &s, err) == KR_OK, "%s", err);
    const int max_len = 40 + 7 * kv_heads;
    REQUIRE(kr_seq_grow(s, max_len, err) == KR_OK, "%s", err);
    int lens[8];
    float *keys = malloc(sizeof(float) * (size_t)kv_heads * max_len * hd);
    for (int g = 0; g < kv_heads; g++) {
        lens[g] = 40 + 7 * g; /* lists of one layer may differ in length */
        kr_seq_list(s, 0, g)->len = lens[g];
        for (int e = 0; e < lens[g]; e++) {
            float *k = keys + ((size_t)g * max_len + e) * hd, v[256];
            for (int i = 0; i < hd; i++) k[i] = 2 * frand(), v[i] = frand();
            kr_seq_put(s, 0, g, e, k, v, e);
        }
    }
    float *q = malloc(sizeof(float) * (size_t)n_obs * heads * hd);
    for (int i = 0; i < n_obs * heads * hd; i++) q[i] = 2 * frand();
    const size_t stride = (size_t)max_len + 3;
    float *got = malloc(sizeof(float) * heads * stride);
    double *ref = calloc((size_t)heads * stride, sizeof(double)), *x = malloc(sizeof(double) * max_len);
    const int group = heads / kv_heads;
    for (int per_head = 0; per_head < 2; per_head++) {
        for (size_t i = 0; i < (size_t)heads * stride; i++) got[i] = -1.0f, ref[i] = 0.0;
        kr_cpu_backend.score_past(b, s, 0, q, n_obs, heads, per_head, hidden, got, stride);
        for (int h = 0; h < heads; h++) {
            int g = h / group, vis = lens[g] - hidden;
            double *out = ref + (per_head ? (size_t)h : (size_t)g) * stride;
            for (int o = 0; o < n_obs; o++) {
                const float *qh = q + ((size_t)o * heads + h) * hd;
                double mx = -1e300, z = 0;
                for (int e = 0; e < vis; e++) {
                    double dot = 0;
                    for (int i = 0; i < hd; i++) dot += (double)qh[i] * keys[((size_t)g * max_len + e) * hd + i];
                    x[e] = dot / sqrt((double)hd);
                    mx = x[e] > mx ? x[e] : mx;
                }
                for (int e = 0; e < vis; e++) z += x[e] = exp(x[e] - mx);
                for (int e = 0; e < vis; e++) out[e] += x[e] / z / (per_head ? 1 : group);
            }
        }
        double worst = 0;
        int rows = per_head ? heads : kv_heads;
        for (int r = 0; r < rows; r++) {
            int len = lens[per_head ? r / group : r];
            for (int e = 0; e < len; e++) {
                double d = fabs(ref[r * stride + e] - got[r * stride + e]);
                worst = d > worst || d != d ? d : worst;
            }
            for (int e = len - hidden; e < len; e++)
                CHECK(got[r * stride + e] == 0.0f, "hidden entry %d of row %d scored %g", e, r, got[r * stride + e]);
        }
        CHECK(worst < 1e-5, "score_past heads %d/%d hd %d obs %d hidden %d per_head %d: err %.3g", heads,
              kv_heads, hd, n_obs, hidden, per_head, worst);
    }
    if (n_obs == 1 && hidden == 0) {
        float *causal = malloc(sizeof(float) * kv_heads * stride);
        kr_cpu_backend.score(b, s, 0, q, 1, heads, 0, causal, stride);
        kr_cpu_backend.score_past(b, s, 0, q, 1, heads, 0, 0, got, stride);
        for (int g = 0; g < kv_heads; g++)
            CHECK(!memcmp(causal + g * stride, got + g * stride, sizeof(float) * lens[g]),
                  "one observer, nothing hidden: score_past differs from score (KV head %d)", g);
        free(causal);
    }
    free(keys), free(q), free(got), free(ref), free(x);
    kr_seq_free(s);
    kr_kv_pool_free(pool);
    kr_cpu_backend.destroy(b);
}

int main(void)
{
    const struct { int heads, kv, hd, obs, hidden, bs; } cases[] = {
        {4, 4, 32, 3, 3, 16}, {8, 4, 64, 1, 0, 5}, {8, 2, 32, 5, 5, 7}, {8, 2, 80, 4, 0, 16},
        {4, 1, 32, 2, 1, 3}, {2, 2, 32, 1, 0, 4},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check(cases[i].heads, cases[i].kv, cases[i].hd, cases[i].obs, cases[i].hidden, cases[i].bs);
    return kt_done("test_score_past");
}
