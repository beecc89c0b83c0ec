/*
 * test_sampler.c - the sampler on logits small enough to reason about: greedy takes the argmax
 * and the lowest id on ties; top-k 1 and temperature 0 are greedy; a seed reproduces a stream and
 * another seed changes it; top-k and top-p never draw outside the allowed set; frequencies follow
 * softmax(logits / T) (a chi-square bound that a wrong temperature fails); bad settings are refused;
 * kr_logprob matches a long-double log-softmax, sums to 1, and stays finite on huge logits.
 */
#include "kr_test.h"

#include "kr.h"

enum { V = 6, DRAWS = 60000 };

static kr_sampler *make(kr_sampling s)
{
    char err[KR_ERR_MAX];
    kr_sampler *sp;
    REQUIRE(kr_sampler_create(&s, V, &sp, err) == KR_OK, "%s", err);
    return sp;
}

static void counts(kr_sampling s, const float *logits, int *c)
{
    kr_sampler *sp = make(s);
    memset(c, 0, sizeof(int) * V);
    for (int i = 0; i < DRAWS; i++) {
        int id = kr_sampler_sample(sp, logits);
        REQUIRE(id >= 0 && id < V, "id %d out of range", id);
        c[id]++;
    }
    kr_sampler_free(sp);
}

/* chi-square of observed counts against softmax(logits / t) restricted to `allowed` */
static double chi2(const int *c, const float *logits, float t, const int *allowed)
{
    double p[V], z = 0;
    for (int i = 0; i < V; i++) z += p[i] = allowed[i] ? exp(logits[i] / t) : 0;
    double x = 0;
    for (int i = 0; i < V; i++) {
        if (!allowed[i]) continue;
        double e = DRAWS * p[i] / z;
        x += (c[i] - e) * (c[i] - e) / e;
    }
    return x;
}

/* kr_logprob_top: the k most probable ids, most probable first and lower id first on ties, each
 * value kr_logprob's bit for bit, the sampled id's value unchanged by k; k 0 touches nothing. */
static void check_top(void)
{
    const float row[8] = {1.0f, 3.0f, -2.0f, 3.0f, 2.5f, 3.0f, -INFINITY, 2.5f};
    int32_t ids[KR_TOP_LOGPROBS_MAX], top = -1;
    float lps[KR_TOP_LOGPROBS_MAX];
    const int32_t want[8] = {1, 3, 5, 4, 7, 0, 2, 6};
    for (int k = 0; k <= 8; k++) {
        for (int i = 0; i < KR_TOP_LOGPROBS_MAX; i++) ids[i] = -1;
        float lp = kr_logprob_top(row, 8, 4, &top, k, ids, lps);
        CHECK(lp == kr_logprob(row, 8, 4, NULL) && top == 1, "k %d: the sampled id's value or the argmax changed", k);
        for (int i = 0; i < k; i++)
            CHECK(ids[i] == want[i] && lps[i] == kr_logprob(row, 8, ids[i], NULL),
                  "k %d: alternative %d is %d (%.9g), want %d", k, i, ids[i], lps[i], want[i]);
        CHECK(ids[k < 8 ? k : 7] == (k < 8 ? -1 : want[7]), "k %d: wrote past k", k);
    }
    CHECK(kr_logprob_top(row, 8, 0, NULL, 20, ids, lps) == kr_logprob(row, 8, 0, NULL) && ids[7] == 6,
          "k over the vocabulary: the whole row, ordered");
    /* a larger row against a full sort: k 20 of 4096 values with many ties */
    enum { BIG = 4096 };
    static float big[BIG];
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < BIG; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        big[i] = (float)(x % 64) * 0.25f; /* 64 distinct values: ties everywhere */
    }
    kr_logprob_top(big, BIG, 7, NULL, KR_TOP_LOGPROBS_MAX, ids, lps);
    int at = 0;
    for (int v = 63; v >= 0 && at < KR_TOP_LOGPROBS_MAX; v--)
        for (int i = 0; i < BIG && at < KR_TOP_LOGPROBS_MAX; i++)
            if (big[i] == (float)v * 0.25f) {
                CHECK(ids[at] == i, "4096-row alternative %d is %d, want %d", at, ids[at], i);
                at++;
            }
}

int main(void)
{
    char err[KR_ERR_MAX];
    const float logits[V] = {1.0f, 2.5f, 0.5f, 2.5f, -1.0f, 1.8f};
    kr_sampling s;

    kr_sampling_default(&s);
    s.greedy = 1;
    kr_sampler *sp = make(s);
    CHECK(kr_sampler_sample(sp, logits) == 1, "greedy must take the lowest id among ties");
    kr_sampler_free(sp);
    kr_sampling_default(&s);
    s.temperature = 0;
    sp = make(s);
    CHECK(kr_sampler_sample(sp, logits) == 1, "temperature 0 is greedy");
    kr_sampler_free(sp);

    /* seeds */
    int a[64], b[64], same = 1, differ = 0;
    kr_sampling_default(&s);
    s.seed = 42;
    sp = make(s);
    for (int i = 0; i < 64; i++) a[i] = kr_sampler_sample(sp, logits);
    kr_sampler_free(sp);
    sp = make(s);
    for (int i = 0; i < 64; i++) same &= a[i] == kr_sampler_sample(sp, logits);
    kr_sampler_free(sp);
    s.seed = 43;
    sp = make(s);
    for (int i = 0; i < 64; i++) b[i] = kr_sampler_sample(sp, logits), differ |= a[i] != b[i];
    kr_sampler_free(sp);
    CHECK(same, "the same seed must reproduce the stream");
    CHECK(differ, "another seed must change the stream");

    /* plain sampling follows softmax; a wrong temperature would not */
    int c[V];
    const int all[V] = {1, 1, 1, 1, 1, 1};
    kr_sampling_default(&s);
    s.temperature = 0.7f;
    counts(s, logits, c);
    double x = chi2(c, logits, 0.7f, all);
    CHECK(x < 25.0, "temperature 0.7: chi2 %.1f (5 dof, p ~ 1e-4 bound)", x);
    CHECK(chi2(c, logits, 1.0f, all) > 100.0, "counts also fit temperature 1: the test cannot tell");

    /* top-k 3: ids 1, 3, 5 only, in softmax proportion */
    s.top_k = 3;
    counts(s, logits, c);
    const int top3[V] = {0, 1, 0, 1, 0, 1};
    CHECK(c[0] + c[2] + c[4] == 0, "top-k drew outside the top 3");
    x = chi2(c, logits, 0.7f, top3);
    CHECK(x < 25.0, "top-k 3: chi2 %.1f", x);
    s.top_k = 1;
    counts(s, logits, c);
    CHECK(c[1] == DRAWS, "top-k 1 must be greedy (lowest id on ties)");

    /* top-p: at T=1 the sorted masses are ~[.33 .33 .16 .08 .06 .01 ...]: p=0.5 keeps ids 1 and 3 */
    kr_sampling_default(&s);
    s.top_p = 0.5f;
    counts(s, logits, c);
    CHECK(c[0] + c[2] + c[4] + c[5] == 0, "top-p 0.5 drew outside {1, 3}: %d %d %d %d", c[0], c[2], c[4], c[5]);
    CHECK(abs(c[1] - c[3]) < DRAWS / 20, "ids 1 and 3 have equal mass: %d vs %d", c[1], c[3]);
    s.top_p = 0.7f; /* 1, 3 reach 0.66; the next (5) crosses 0.7 */
    counts(s, logits, c);
    CHECK(c[5] > 0 && c[0] + c[2] + c[4] == 0, "top-p 0.7 must add id 5 only");

    /* bad settings */
    kr_sampling_default(&s);
    s.top_p = 1.5f;
    CHECK(kr_sampler_create(&s, V, &sp, err) == -1, "top_p 1.5 accepted");
    CHECK_ERR_HAS(err, "top_p");
    kr_sampling_default(&s);
    s.temperature = -1;
    CHECK(kr_sampler_create(&s, V, &sp, err) == -1, "negative temperature accepted");
    CHECK_ERR_HAS(err, "temperature");
    kr_sampling_default(&s);
    s.top_k = -2;
    CHECK(kr_sampler_create(&s, V, &sp, err) == -1, "negative top_k accepted");
    CHECK_ERR_HAS(err, "top_k");

    /* log-probabilities: against a long-double reference, normalized, and stable where a naive
     * exp overflows */
    double total = 0.0;
    for (int id = 0; id < V; id++) {
        int32_t top = -1;
        float lp = kr_logprob(logits, V, id, &top);
        long double z = 0.0L;
        for (int i = 0; i < V; i++) z += expl((long double)logits[i]);
        double want = (double)((long double)logits[id] - logl(z));
        CHECK(isfinite(lp) && lp <= 0.0f, "logprob of %d: %g", id, lp);
        CHECK(fabs(lp - want) < 1e-6, "logprob of %d: %.9g, want %.9g", id, lp, want);
        CHECK(top == 1, "top id %d: the argmax is 1 (lowest id on ties)", top);
        total += exp((double)lp);
    }
    CHECK(fabs(total - 1.0) < 1e-6, "probabilities sum to %.9f", total);
    CHECK(kr_argmax(logits, V) == 1, "kr_argmax takes the lowest id on ties");
    CHECK(kr_logprob(logits, V, 1, NULL) == kr_logprob(logits, V, 1, NULL), "not a pure function");
    const float huge[4] = {1000.0f, 999.0f, -1000.0f, 1000.0f}; /* exp(1000) overflows float */
    int32_t top = -1;
    float lp0 = kr_logprob(huge, 4, 0, &top), lp2 = kr_logprob(huge, 4, 2, NULL);
    double want0 = -log(2.0 + exp(-1.0));
    CHECK(isfinite(lp0) && fabs(lp0 - want0) < 1e-6, "large logits: %.9g, want %.9g", lp0, want0);
    CHECK(isfinite(lp2) && lp2 < -1999.0f && lp2 > -2001.0f, "a far tail: %g", lp2);
    CHECK(top == 0, "top id with large logits: %d", top);
    const float flat[3] = {0.5f, 0.5f, 0.5f};
    CHECK(fabs(kr_logprob(flat, 3, 2, NULL) + log(3.0)) < 1e-6, "uniform row: -log 3");
    const float one[1] = {-7.0f};
    CHECK(kr_logprob(one, 1, 0, NULL) == 0.0f, "a one-token vocabulary has log-probability 0");
    check_top();
    return kt_done("test_sampler");
}
