/*
 * test_policy_snapkv.c - the snapkv and pyramidkv policies (engine/policy-snapkv.c):
 *   1. spec parsing: every key, the canonical spec with defaults, clear errors;
 *   2. PyramidKV's layer budgets (kr_pyramid_budget) on tuples worked out by hand;
 *   3. selection on a hand-built cache through the real CPU `score` op: keys are unit vectors
 *      e_j, so an observer query sqrt(d) * x * e_j gives entry j the logit x and the softmax
 *      picks known entries; GQA groups 1, 2 and 4, budget (naive, final chunk) and ratio
 *      (patched, appended observers), avg and max pooling;
 *   4. the footprint closed form of the issue for chunked snapkv with ratio (PruLong's
 *      evaluation) through kr_prefill on llama3-tiny, plus per-layer pyramidkv ratio lengths;
 * (Budgets that hold the whole prompt reproducing the fixtures: test_fixtures.c, KEEP_ALL.)
 * Run through ctest (needs KR_FIXTURES).
 */
#include "kr_test.h"

#include "backend.h"
#include "policy.h"

#include <cjson/cJSON.h>

/* ------------------------------------------------------------------ 1. parsing */

static kr_config shape(int layers, int heads, int kv_heads, int head_dim)
{
    kr_config c;
    memset(&c, 0, sizeof c);
    c.n_layers = layers;
    c.n_heads = heads;
    c.n_kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.hidden_size = heads * head_dim;
    return c;
}

static void check_spec(const char *spec, const char *canonical)
{
    char err[KR_ERR_MAX];
    kr_config c = shape(4, 8, 2, 16);
    kr_policy *p = NULL;
    int rc = kr_policy_parse(spec, &c, &p, err);
    CHECK(rc == KR_OK, "'%s': %s", spec, err);
    if (rc == KR_OK) CHECK(!strcmp(kr_policy_spec(p), canonical), "'%s' -> '%s', expected '%s'", spec, kr_policy_spec(p), canonical);
    kr_policy_free(p);
}

static void check_bad(const char *spec, const char *needle)
{
    char err[KR_ERR_MAX] = "";
    kr_config c = shape(4, 8, 2, 16);
    kr_policy *p = NULL;
    CHECK(kr_policy_parse(spec, &c, &p, err) != KR_OK && !p, "'%s' was accepted", spec);
    CHECK_ERR_HAS(err, needle);
}

static void test_parse(void)
{
    check_spec("snapkv:ratio=0.5", "snapkv:mode=patched,obs=64,kernel=5,pool=avg,ratio=0.5,decode=grow");
    check_spec("pyramidkv:budget=1024", "pyramidkv:mode=patched,obs=64,kernel=5,pool=avg,budget=1024,decode=grow");
    check_spec("snapkv:mode=naive,obs=32,kernel=7,pool=max,budget=100,decode=window:16",
               "snapkv:mode=naive,obs=32,kernel=7,pool=max,budget=100,decode=window:16");
    check_spec("pyramidkv:ratio=0.9,kernel=1,mode=patched,decode=grow",
               "pyramidkv:mode=patched,obs=64,kernel=1,pool=avg,ratio=0.9,decode=grow");
    check_bad("snapkv:ratio=0.5,budget=100", "not both");
    check_bad("snapkv", "needs ratio=p");
    check_bad("pyramidkv:mode=naive", "needs ratio=p");
    check_bad("snapkv:obs=0,ratio=0.5", "obs=0 is out of range");
    check_bad("snapkv:kernel=4,ratio=0.5", "kernel=4 must be odd");
    check_bad("snapkv:window=4,ratio=0.5", "snapkv has no key 'window'");
    check_bad("pyramidkv:beta=4,ratio=0.5", "pyramidkv has no key 'beta'");
    check_bad("snapkv:mode=lazy,ratio=0.5", "mode=lazy must be naive or patched");
    check_bad("snapkv:pool=sum,ratio=0.5", "pool=sum must be avg or max");
    check_bad("snapkv:ratio=1.5", "ratio=1.5 is out of range");
    check_bad("snapkv:budget=64", "budget=64 must exceed obs=64");
    check_bad("snapkv:ratio=0.5,decode=shrink", "decode=shrink");
    /* the reservation bound: budget B after prefill, growing decode */
    char err[KR_ERR_MAX];
    kr_config c = shape(4, 8, 2, 16);
    kr_policy *p;
    REQUIRE(kr_policy_parse("snapkv:budget=100", &c, &p, err) == KR_OK, "%s", err);
    CHECK(kr_policy_max_entries(p, 1000, 10) == 110 && kr_policy_max_entries(p, 50, 10) == 60, "max entries");
    kr_policy_free(p);
}

/* ------------------------------------------------------------------ 2. PyramidKV budgets */

static void test_pyramid_budget(void)
{
    /* C=320, W=64 (PyramidKV's default 256+64), L=32, n=10000: C-W = 256, min = 256//20 = 12,
     * max = 512-12 = 500 (< n-W, no clamp), steps = 488//31 = 15; layer l keeps 500-15l+64 */
    CHECK(kr_pyramid_budget(320, 64, 32, 0, 10000) == 564, "l0 %d", kr_pyramid_budget(320, 64, 32, 0, 10000));
    CHECK(kr_pyramid_budget(320, 64, 32, 10, 10000) == 414, "l10");
    CHECK(kr_pyramid_budget(320, 64, 32, 31, 10000) == 99, "l31 %d", kr_pyramid_budget(320, 64, 32, 31, 10000));
    /* same, n=540: max 500 >= n-W = 476 -> max = 476, min = 512-476 = 36, steps = 440//31 = 14:
     * layer 0 keeps the whole prompt, layer 31 keeps 476-434+64 = 106 */
    CHECK(kr_pyramid_budget(320, 64, 32, 0, 540) == 540, "clamped l0");
    CHECK(kr_pyramid_budget(320, 64, 32, 31, 540) == 106, "clamped l31 %d", kr_pyramid_budget(320, 64, 32, 31, 540));
    /* 320 < n=400 < 2(C-W) = 512: every layer keeps C (the reference's middle branch) */
    CHECK(kr_pyramid_budget(320, 64, 32, 0, 400) == 320 && kr_pyramid_budget(320, 64, 32, 31, 400) == 320, "middle");
    /* n <= C: everything */
    CHECK(kr_pyramid_budget(320, 64, 32, 5, 300) == 300 && kr_pyramid_budget(320, 64, 32, 5, 320) == 320, "short");
    /* C=8, W=2, L=4, n=100: C-W = 6, min = 0, max = 12, steps = 12//3 = 4: 14, 10, 6, 2 */
    const int want[4] = {14, 10, 6, 2};
    for (int l = 0; l < 4; l++)
        CHECK(kr_pyramid_budget(8, 2, 4, l, 100) == want[l], "C8 layer %d: %d", l, kr_pyramid_budget(8, 2, 4, l, 100));
    /* one layer: C=100, W=10, n=1000: min = 90//20 = 4, max = 176, no steps: 186 */
    CHECK(kr_pyramid_budget(100, 10, 1, 0, 1000) == 186, "one layer");
    /* llama3-tiny's ratio case below: C = 20+64, W = 64, L = 4, n = 100 (a chunk): min = 1,
     * max = 39 >= 36 -> max 36, min 4, steps = 32//3 = 10: 100, 90, 80, 70 */
    for (int l = 0; l < 4; l++)
        CHECK(kr_pyramid_budget(84, 64, 4, l, 100) == 100 - 10 * l, "tiny layer %d", l);
}

/* ------------------------------------------------------------------ 3. hand-checkable selection */

enum { HD = 64, NH = 4 }; /* head_dim (>= the list length, keys are e_j), query heads */

typedef struct hand {
    kr_backend *be;
    kr_kv_pool *pool;
    kr_seq *s;
    kr_policy *p;
    int kv, len;
    float *q; /* [rows][NH][HD] */
    float *scores;
    int32_t *idx;
} hand;

/* a one-layer cache of `len` entries per KV head, key j = e_j, position 100 + j */
static void hand_init(hand *h, const char *spec, int group, int len, int rows)
{
    char err[KR_ERR_MAX];
    h->kv = NH / group;
    h->len = len;
    kr_config c = shape(1, NH, h->kv, HD);
    kr_model m;
    memset(&m, 0, sizeof m);
    m.cfg = c;
    REQUIRE(kr_cpu_backend.create(&m, 2, 64, &h->be, err) == KR_OK, "%s", err);
    REQUIRE(kr_policy_parse(spec, &c, &h->p, err) == KR_OK, "%s: %s", spec, err);
    REQUIRE(kr_kv_pool_create(HD, 8, 256, KR_DTYPE_F32, &h->pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(h->pool, 1, h->kv, &h->s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(h->s, len, err) == KR_OK, "%s", err);
    float k[HD], v[HD];
    for (int g = 0; g < h->kv; g++) {
        for (int j = 0; j < len; j++) {
            memset(k, 0, sizeof k);
            k[j] = 1.0f;
            for (int e = 0; e < HD; e++) v[e] = (float)j;
            kr_seq_put(h->s, 0, g, j, k, v, 100 + j);
        }
        kr_seq_list(h->s, 0, g)->len = len;
    }
    h->q = calloc((size_t)rows * NH * HD, sizeof(float));
    h->scores = calloc((size_t)NH * len, sizeof(float));
    h->idx = calloc(3 * (size_t)len, sizeof(int32_t));
}

/* query row `row`, head `head` gives entry j the logit x */
static void hand_logit(hand *h, int row, int head, int j, float x)
{
    h->q[((size_t)row * NH + head) * HD + j] = x * sqrtf((float)HD);
}

static void hand_run(hand *h, int n_real, int n_app, int start, int last)
{
    kr_evict_env env = {.ops = &kr_cpu_backend, .be = h->be, .scores = h->scores, .idx = h->idx, .cap = h->len};
    kr_chunk c = {.q = h->q, .n_real = n_real, .n_appended = n_app, .start = start,
                  .n_prompt = start + n_real, .last = last};
    h->p->ops->after_chunk(h->p, h->s, &env, &c, 0);
}

/* the positions a KV head kept must be exactly 100 + want[0..n), all pinned */
static void hand_expect(hand *h, int g, const int *want, int n, const char *what)
{
    const kr_kv_list *l = kr_seq_list(h->s, 0, g);
    int ok = l->len == n && l->pinned == n;
    for (int i = 0; ok && i < n; i++) {
        ok = *kr_kv_list_pos(h->pool, l, i) == 100 + want[i] &&
             ((const float *)kr_kv_list_value(h->pool, l, i))[0] == (float)want[i];
    }
    if (!ok) {
        char got[1024] = "";
        for (int i = 0; i < l->len && strlen(got) < 1000; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), " %d",
                     *kr_kv_list_pos(h->pool, l, i) - 100);
        CHECK(0, "%s, KV head %d: kept [%s ] (pinned %d), expected %d entries", what, g, got, l->pinned, n);
    }
}

static void hand_free(hand *h)
{
    kr_seq_free(h->s);
    CHECK(kr_kv_pool_n_free(h->pool) == kr_kv_pool_n_blocks(h->pool), "blocks leaked");
    kr_kv_pool_free(h->pool);
    kr_policy_free(h->p);
    kr_cpu_backend.destroy(h->be);
    free(h->q), free(h->scores), free(h->idx);
}

static int cmp_int(const void *a, const void *b)
{
    return *(const int *)a - *(const int *)b;
}

static void test_selection(int group)
{
    char spec[128], what[128];
    const int kv = NH / group;

    /* budget, naive, final chunk of 40 tokens: observers = the last 2 (entries 38, 39). Query
     * head h, observer i attends entry 1 + 3(2h + i) with logit 10 (probability ~0.998), so a
     * KV head's group of G query heads points at 2G entries; the budget 2 + 2G keeps exactly
     * them plus the window: one set per KV head, union over its query heads and observers */
    snprintf(spec, sizeof spec, "snapkv:mode=naive,obs=2,kernel=1,budget=%d", 2 + 2 * group);
    hand h;
    hand_init(&h, spec, group, 40, 40);
    for (int hh = 0; hh < NH; hh++)
        for (int i = 0; i < 2; i++) hand_logit(&h, 38 + i, hh, 1 + 3 * (2 * hh + i), 10.0f);
    hand_run(&h, 40, 0, 0, 1);
    for (int g = 0; g < kv; g++) {
        int want[16], n = 0;
        for (int r = 0; r < group; r++)
            for (int i = 0; i < 2; i++) want[n++] = 1 + 3 * (2 * (g * group + r) + i);
        want[n++] = 38, want[n++] = 39;
        qsort(want, (size_t)n, sizeof *want, cmp_int);
        snprintf(what, sizeof what, "budget G=%d", group);
        hand_expect(&h, g, want, n, what);
    }
    hand_free(&h);

    /* ratio, patched, a non-final chunk: entries 0..9 are older (kept whatever their score),
     * 10..29 the chunk's 20 tokens, 30..31 the 2 appended observers. ratio = 1 - 2G/20 keeps
     * round(2G) of the chunk: the targets 10 + 2h + i; an older entry's high score (head 0
     * observer 0 also looks at entry 3) must not take a slot. The appended observers stay at the
     * end for the forward to drop. */
    snprintf(spec, sizeof spec, "snapkv:mode=patched,obs=2,kernel=1,ratio=%g", 1.0 - 2.0 * group / 20.0);
    hand_init(&h, spec, group, 32, 32);
    for (int hh = 0; hh < NH; hh++)
        for (int i = 0; i < 2; i++) hand_logit(&h, 20 + i, hh, 10 + 2 * hh + i, 10.0f);
    hand_logit(&h, 20, 0, 3, 12.0f);
    /* the chunk's real rows are rows 0..19; the hook must read the observers at rows 20, 21 */
    hand_run(&h, 20, 2, 10, 0);
    for (int g = 0; g < kv; g++) {
        int want[40], n = 0;
        for (int j = 0; j < 10; j++) want[n++] = j;
        for (int r = 0; r < group; r++)
            for (int i = 0; i < 2; i++) want[n++] = 10 + 2 * (g * group + r) + i;
        want[n++] = 30, want[n++] = 31;
        snprintf(what, sizeof what, "ratio patched G=%d", group);
        hand_expect(&h, g, want, n, what);
    }
    hand_free(&h);

    /* pooling: one observer (entry 31); every query head splits its attention between
     * entries 10 and 12 (logit 10 each, ~0.5 each). Raw top-1 would be 10; avg kernel 3 makes
     * entry 11 the top ((s10 + s11 + s12)/3 ~ 1/3 against ~1/6 for 10 and 12), so budget 2
     * keeps 11 and the window. */
    hand_init(&h, "snapkv:mode=naive,obs=1,kernel=3,pool=avg,budget=2", group, 32, 32);
    for (int hh = 0; hh < NH; hh++) hand_logit(&h, 31, hh, 10, 10.0f), hand_logit(&h, 31, hh, 12, 10.0f);
    hand_run(&h, 32, 0, 0, 1);
    for (int g = 0; g < kv; g++) {
        const int want[2] = {11, 31};
        snprintf(what, sizeof what, "avg pooling G=%d", group);
        hand_expect(&h, g, want, 2, what);
    }
    hand_free(&h);
    hand_init(&h, "snapkv:mode=naive,obs=1,kernel=3,pool=max,budget=4", group, 32, 32);
    for (int hh = 0; hh < NH; hh++) hand_logit(&h, 31, hh, 20, 10.0f);
    hand_run(&h, 32, 0, 0, 1);
    for (int g = 0; g < kv; g++) { /* max kernel 3 around a spike at 20: 19, 20, 21 tie exactly */
        const int want[4] = {19, 20, 21, 31};
        snprintf(what, sizeof what, "max pooling G=%d", group);
        hand_expect(&h, g, want, 4, what);
    }
    hand_free(&h);
}

/* ------------------------------------------------------------------ 4, 5: real model */

typedef struct real {
    kr_model *m;
    const kr_config *cfg;
    kr_ctx *ctx;
    kr_kv_pool *pool;
} real;

static void real_open(real *r, const char *dir)
{
    char err[KR_ERR_MAX];
    REQUIRE(kr_model_load(dir, NULL, &r->m, err) == KR_OK, "%s: %s", dir, err);
    r->cfg = kr_model_config(r->m);
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 2, .max_chunk = 128};
    REQUIRE(kr_ctx_create(r->m, &cp, &r->ctx, err) == KR_OK, "%s", err);
    REQUIRE(kr_kv_pool_create(r->cfg->head_dim, 16, 4096, KR_DTYPE_F32, &r->pool, err) == KR_OK, "%s", err);
}

static void real_close(real *r)
{
    CHECK(kr_kv_pool_n_free(r->pool) == kr_kv_pool_n_blocks(r->pool), "blocks leaked");
    kr_kv_pool_free(r->pool);
    kr_ctx_free(r->ctx);
    kr_model_free(r->m);
}

/* prefills ids under `spec` (NULL: full) in chunks; returns the sequence (caller frees) */
static kr_seq *real_prefill(real *r, const char *spec, kr_policy **pol, const int32_t *ids, int n, int chunk,
                            kr_logits_mode mode, float *logits)
{
    char err[KR_ERR_MAX];
    kr_seq *s;
    *pol = NULL;
    REQUIRE(kr_seq_create(r->pool, r->cfg->n_layers, r->cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    if (spec) {
        REQUIRE(kr_policy_parse(spec, r->cfg, pol, err) == KR_OK, "%s: %s", spec, err);
        REQUIRE(kr_seq_set_policy(s, *pol, err) == KR_OK, "%s", err);
    }
    REQUIRE(kr_prefill(r->ctx, s, ids, n, chunk, mode, logits, err) == KR_OK, "%s: %s", spec ? spec : "full", err);
    return s;
}

static void test_footprint(const char *fx)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/models/llama3-tiny", fx);
    real r;
    real_open(&r, dir);
    enum { N = 300, CH = 100 };
    int32_t ids[N];
    uint64_t x = 12345;
    for (int i = 0; i < N; i++) x = x * 6364136223846793005ull + 1442695040888963407ull, ids[i] = (int32_t)((x >> 33) % (uint64_t)r.cfg->vocab_size);
    float *lg = malloc(sizeof(float) * r.cfg->vocab_size);
    const double s = 0.8;
    const int lists = r.cfg->n_layers * r.cfg->n_kv_heads;

    /* naive, obs 64: per chunk [a, b) causal(b-a) + past (b-a), then
     * past += min(round((1-s)(b-a)) + 64, b-a) */
    kr_policy *p;
    kr_seq *sq = real_prefill(&r, "snapkv:mode=naive,obs=64,ratio=0.8", &p, ids, N, CH, KR_LOGITS_LAST, lg);
    double expect = 0, past = 0, full = 0;
    for (int a = 0; a < N; a += CH) {
        int n = N - a < CH ? N - a : CH;
        expect += (double)n * (n + 1) / 2 + past * n;
        double add = floor((1 - s) * n + 0.5) + 64;
        past += add < n ? add : n;
    }
    for (int t = 0; t < N; t++) full += t + 1;
    kr_footprint fp;
    kr_seq_footprint(sq, &fp);
    CHECK(fp.attended == expect * lists && fp.full == full * lists, "naive ratio footprint %g / %g, expected %g / %g",
          fp.attended, fp.full, expect * lists, full * lists);
    for (int l = 0; l < r.cfg->n_layers; l++)
        for (int g = 0; g < r.cfg->n_kv_heads; g++)
            CHECK(kr_seq_len(sq, l, g) == (int)past, "naive layer %d head %d holds %d, expected %g", l, g,
                  kr_seq_len(sq, l, g), past);
    kr_seq_free(sq);
    kr_policy_free(p);

    /* patched: non-final chunks keep round((1-s)(b-a)) (their window is the appended
     * observers, dropped); the final chunk keeps that plus its own 64 */
    sq = real_prefill(&r, "snapkv:mode=patched,obs=64,ratio=0.8", &p, ids, N, CH, KR_LOGITS_LAST, lg);
    kr_seq_footprint(sq, &fp);
    expect = 3.0 * CH * (CH + 1) / 2 + (0 + 20 + 40) * CH;
    CHECK(fp.attended == expect * lists, "patched ratio footprint %g, expected %g", fp.attended, expect * lists);
    CHECK(kr_seq_len(sq, 0, 0) == 20 + 20 + 20 + 64 && kr_seq_len(sq, 3, 1) == 124, "patched holds %d",
          kr_seq_len(sq, 0, 0));
    CHECK(kr_seq_next_pos(sq) == N, "appended observers moved the positions: %d", kr_seq_next_pos(sq));
    kr_seq_free(sq);
    kr_policy_free(p);

    /* pyramidkv naive ratio: each chunk of 100 is a PyramidKV prompt with C = 20 + 64, W = 64:
     * layer l keeps 100 - 10 l of every chunk (see test_pyramid_budget) */
    sq = real_prefill(&r, "pyramidkv:mode=naive,obs=64,ratio=0.8", &p, ids, N, CH, KR_LOGITS_LAST, lg);
    for (int l = 0; l < r.cfg->n_layers; l++)
        for (int g = 0; g < r.cfg->n_kv_heads; g++)
            CHECK(kr_seq_len(sq, l, g) == 3 * (100 - 10 * l), "pyramid layer %d holds %d, expected %d", l,
                  kr_seq_len(sq, l, g), 3 * (100 - 10 * l));
    kr_seq_free(sq);
    kr_policy_free(p);

    /* budget: snapkv keeps B per list after every chunk; pyramidkv's layer l at the end keeps
     * kr_pyramid_budget(B, 64, 4, l, 300) */
    sq = real_prefill(&r, "snapkv:mode=naive,budget=120", &p, ids, N, CH, KR_LOGITS_LAST, lg);
    CHECK(kr_seq_len(sq, 2, 1) == 120 && kr_seq_entries(sq) == 120 * lists, "snapkv budget holds %lld",
          (long long)kr_seq_entries(sq));
    kr_seq_free(sq);
    kr_policy_free(p);
    sq = real_prefill(&r, "pyramidkv:mode=patched,budget=120", &p, ids, N, CH, KR_LOGITS_LAST, lg);
    for (int l = 0; l < r.cfg->n_layers; l++) /* C-W = 56: min 2, max 110 (< 236), steps 36 */
        CHECK(kr_seq_len(sq, l, 0) == 110 - 36 * l + 64 && kr_pyramid_budget(120, 64, 4, l, 300) == 174 - 36 * l,
              "pyramid budget layer %d holds %d", l, kr_seq_len(sq, l, 0));
    kr_seq_free(sq);
    kr_policy_free(p);
    free(lg);
    real_close(&r);
}

int main(void)
{
    test_parse();
    test_pyramid_budget();
    const int groups[] = {1, 2, 4};
    for (int i = 0; i < 3; i++) test_selection(groups[i]);
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    test_footprint(fx);
    return kt_done("test_policy_snapkv");
}
