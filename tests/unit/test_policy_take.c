/*
 * test_policy_take.c - the `take` policy (TAKE, section 4):
 *   - parsing: every key, the defaults in the canonical spec, clear errors, max_entries;
 *   - eq. 9 on tiny numbers, eq. 8's budget per layer and chunk;
 *   - through the real forward of llama3-tiny (4 layers, 8/2 heads), a 300-token prompt in
 *     chunks of 64 with a spy around the hook: the accumulated probe equals an EMA recomputed
 *     here from the probe rows' queries; layers < W - 1 are not pruned by their own hook; after
 *     every chunk the warm-up layers hold exactly the positions chosen at layer W - 1 (Bw of
 *     them before the last chunk, B after it), the others B; no appended probe entry survives a
 *     non-final chunk; every scored layer's choice agrees with a naive re-scoring (softmax of the
 *     accumulated probe, probe keys hidden before the last chunk and causal in it, mean over
 *     probes, avg-pool, top-k); decode=window keeps the pinned set plus the window;
 *   - (a budget holding the whole prompt reproducing the fixtures: test_fixtures.c, KEEP_ALL).
 */
#include "kr_test.h"

#include "policy.h"

#include <cjson/cJSON.h>
#include <stdint.h>

/* ------------------------------------------------------------------ parsing */

static kr_config tiny_cfg(void)
{
    kr_config c;
    memset(&c, 0, sizeof c);
    c.n_layers = 4;
    c.n_heads = 8;
    c.n_kv_heads = 2;
    c.head_dim = 32;
    return c;
}

static void expect_spec(const char *spec, const char *canonical)
{
    char err[KR_ERR_MAX];
    kr_config cfg = tiny_cfg();
    kr_policy *p = NULL;
    int rc = kr_policy_parse(spec, &cfg, &p, err);
    CHECK(rc == KR_OK, "'%s' refused: %s", spec, err);
    if (rc != KR_OK) return;
    CHECK(!strcmp(kr_policy_spec(p), canonical), "'%s' -> '%s', expected '%s'", spec, kr_policy_spec(p), canonical);
    kr_policy_free(p);
}

static void expect_error(const char *spec, const char *needle)
{
    char err[KR_ERR_MAX] = "";
    kr_config cfg = tiny_cfg();
    kr_policy *p = NULL;
    CHECK(kr_policy_parse(spec, &cfg, &p, err) != KR_OK, "'%s' accepted", spec);
    CHECK_ERR_HAS(err, needle);
    kr_policy_free(p);
}

static void test_parse(void)
{
    /* defaults: B 512, Bw 20 B (appendix B), W half of 4 layers, p 32, alpha 0.2, kernel 5 */
    expect_spec("take", "take:budget=512,warmup_budget=10240,warmup_layers=2,probe=32,alpha=0.2,kernel=5,decode=grow");
    expect_spec("take:budget=16", "take:budget=16,warmup_budget=320,warmup_layers=2,probe=32,alpha=0.2,kernel=5,decode=grow");
    expect_spec("take:decode=window:16,kernel=7,alpha=0.32,probe=4,warmup_layers=1,warmup_budget=128,budget=64",
                "take:budget=64,warmup_budget=128,warmup_layers=1,probe=4,alpha=0.32,kernel=7,decode=window:16");
    expect_spec("take:warmup_layers=0,warmup_budget=512", "take:budget=512,warmup_budget=512,warmup_layers=0,probe=32,alpha=0.2,kernel=5,decode=grow");
    expect_spec("take:warmup_layers=4,alpha=1,kernel=1", "take:budget=512,warmup_budget=10240,warmup_layers=4,probe=32,alpha=1,kernel=1,decode=grow");
    expect_error("take:window=3", "take has no key 'window'");
    expect_error("take:window=3", "keys: budget, warmup_budget, warmup_layers, probe, alpha, kernel, decode");
    expect_error("take:kernel=4", "kernel=4 must be odd");
    expect_error("take:budget=100,warmup_budget=50", "warmup_budget=50 is below budget=100");
    expect_error("take:warmup_layers=5", "warmup_layers=5 exceeds the model's 4 layers");
    expect_error("take:alpha=1.5", "alpha=1.5 is out of range");
    expect_error("take:alpha=x", "alpha=x is not a number");
    expect_error("take:budget=0", "budget=0 is out of range");
    expect_error("take:probe=0", "probe=0 is out of range");
    expect_error("take:probe=2.5", "probe=2.5 is not an integer");
    expect_error("take:decode=shrink", "decode=shrink must be grow or window:W");
    expect_error("take:budget", "is not key=value");

    char err[KR_ERR_MAX];
    kr_config cfg = tiny_cfg();
    kr_policy *p;
    REQUIRE(kr_policy_parse("take:budget=64", &cfg, &p, err) == KR_OK, "%s", err);
    CHECK(kr_policy_max_entries(p, 300, 10) == 74, "grow: %d", kr_policy_max_entries(p, 300, 10));
    CHECK(kr_policy_max_entries(p, 30, 10) == 40, "short prompt: %d", kr_policy_max_entries(p, 30, 10));
    kr_policy_free(p);
    REQUIRE(kr_policy_parse("take:budget=64,decode=window:4", &cfg, &p, err) == KR_OK, "%s", err);
    CHECK(kr_policy_max_entries(p, 300, 10) == 69, "window: %d", kr_policy_max_entries(p, 300, 10));
    kr_policy_free(p);
}

/* ------------------------------------------------------------------ eq. 9 and eq. 8 */

static void test_ema_and_budgets(void)
{
    /* alpha 0.2: 1 -> 0.2*1 + 0.8*2 = 1.8 -> 0.2*1.8 + 0.8*3 = 2.76 */
    float acc[2] = {99, 99};
    const float c0[2] = {1, -2}, c1[2] = {2, 0}, c2[2] = {3, 1};
    kr_take_accumulate(acc, c0, 2, 0.2f, 1);
    CHECK(acc[0] == 1.0f && acc[1] == -2.0f, "first chunk: %g %g", acc[0], acc[1]);
    kr_take_accumulate(acc, c1, 2, 0.2f, 0);
    CHECK(fabsf(acc[0] - 1.8f) < 1e-6f && fabsf(acc[1] + 0.4f) < 1e-6f, "second: %g %g", acc[0], acc[1]);
    kr_take_accumulate(acc, c2, 2, 0.2f, 0);
    CHECK(fabsf(acc[0] - 2.76f) < 1e-6f && fabsf(acc[1] - 0.72f) < 1e-6f, "third: %g %g", acc[0], acc[1]);
    kr_take_accumulate(acc, c0, 2, 1.0f, 0); /* alpha 1: the history only */
    CHECK(fabsf(acc[0] - 2.76f) < 1e-6f, "alpha 1: %g", acc[0]);
    kr_take_accumulate(acc, c0, 2, 0.0f, 0); /* alpha 0: this chunk only */
    CHECK(acc[0] == 1.0f && acc[1] == -2.0f, "alpha 0: %g %g", acc[0], acc[1]);

    char err[KR_ERR_MAX];
    kr_config cfg = tiny_cfg();
    struct { const char *spec; int before[4], last[4]; } cases[] = {
        {"take:budget=40,warmup_budget=100", {100, 100, 40, 40}, {40, 40, 40, 40}},
        {"take:budget=40,warmup_budget=100,warmup_layers=0", {40, 40, 40, 40}, {40, 40, 40, 40}},
        {"take:budget=40,warmup_budget=100,warmup_layers=3", {100, 100, 100, 40}, {40, 40, 40, 40}},
        {"take:budget=40,warmup_budget=100,warmup_layers=4", {100, 100, 100, 100}, {40, 40, 40, 40}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kr_policy *p;
        REQUIRE(kr_policy_parse(cases[i].spec, &cfg, &p, err) == KR_OK, "%s", err);
        for (int l = 0; l < 4; l++) {
            CHECK(kr_take_budget(p, l, 0) == cases[i].before[l], "%s: layer %d before the last chunk: %d",
                  cases[i].spec, l, kr_take_budget(p, l, 0));
            CHECK(kr_take_budget(p, l, 1) == cases[i].last[l], "%s: layer %d in the last chunk: %d",
                  cases[i].spec, l, kr_take_budget(p, l, 1));
        }
        kr_policy_free(p);
    }
}

/* ------------------------------------------------------------------ the real forward, spied */

enum { MAXL = 8, MAXG = 8, PROBE = 8, BUDGET = 40, WARM_BUDGET = 100 };

static struct spy {
    const kr_policy_ops *real;
    int W, n_layers, n_heads, head_dim;
    float alpha;
    int kernel;
    float *ref[MAXL]; /* the EMA recomputed here, [PROBE][n_heads][head_dim] */
    int kept[MAXL]; /* entries per list after the previous chunk */
    int chunks, evictions_seen;
} spy;

static int pos_at(kr_seq *s, int layer, int g, int e)
{
    const kr_kv_list *l = kr_seq_list(s, layer, g);
    return *kr_kv_list_pos(s->pool, l, e);
}

/* Naive TAKE scoring of one (layer, KV head) with the recomputed probe: the mean over probe rows
 * of the softmax over visible entries, averaged over the group, avg-pooled (zero padding). */
static void naive_scores(kr_seq *s, int layer, int g, const kr_chunk *c, int rows, const float *q, double *out)
{
    const kr_kv_list *l = kr_seq_list(s, layer, g);
    const int n_app = c->n_appended, cand = l->len - n_app, hd = spy.head_dim;
    const int group = spy.n_heads / s->n_kv_heads, half = spy.kernel / 2;
    double *att = calloc((size_t)l->len, sizeof(double)), *x = malloc(sizeof(double) * l->len);
    for (int h = g * group; h < (g + 1) * group; h++)
        for (int r = 0; r < rows; r++) {
            const float *qh = q + ((size_t)r * spy.n_heads + h) * hd;
            int vis = c->last ? l->len - rows + r + 1 : cand;
            double mx = -1e300, z = 0;
            for (int e = 0; e < vis; e++) {
                const float *k = kr_kv_list_key(s->pool, l, e);
                double dot = 0;
                for (int i = 0; i < hd; i++) dot += (double)qh[i] * k[i];
                x[e] = dot / sqrt((double)hd);
                mx = x[e] > mx ? x[e] : mx;
            }
            for (int e = 0; e < vis; e++) z += x[e] = exp(x[e] - mx);
            for (int e = 0; e < vis; e++) att[e] += x[e] / z / rows / group;
        }
    for (int e = 0; e < cand; e++) {
        double sum = 0;
        for (int i = e - half; i <= e + half; i++)
            if (i >= 0 && i < cand) sum += att[i];
        out[e] = sum / spy.kernel;
    }
    free(att);
    free(x);
}

static int cmp_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

static void spy_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                            int layer)
{
    const int W = spy.W, n_app = c->n_appended, G = s->n_kv_heads;
    const size_t row = (size_t)spy.n_heads * spy.head_dim;
    const int scored = layer >= (W > 0 ? W - 1 : 0);
    int before = kr_seq_list(s, layer, 0)->len;
    CHECK(before == spy.kept[layer] + c->n_real + n_app, "chunk %d layer %d: %d entries before the hook, "
          "expected %d kept + %d + %d probe", spy.chunks, layer, before, spy.kept[layer], c->n_real, n_app);
    /* the probe rows of this chunk, and eq. 9 recomputed */
    int rows = c->last ? (c->n_real < PROBE ? c->n_real : PROBE) : n_app, r0 = PROBE - rows;
    const float *q_rows = c->q + (size_t)(c->last ? c->n_real - rows : c->n_real) * row;
    if (scored)
        for (size_t i = 0; i < (size_t)rows * row; i++) {
            float *a = spy.ref[layer] + (size_t)r0 * row + i;
            *a = c->start == 0 ? q_rows[i] : spy.alpha * *a + (1.0f - spy.alpha) * q_rows[i];
        }
    /* what a naive scoring keeps: everything scoring above the k-th value, nothing clearly below */
    const int k = kr_take_budget(p, layer, c->last);
    double *naive[MAXG] = {0}, kth[MAXG];
    for (int g = 0; g < G && scored; g++) {
        int cand = kr_seq_list(s, layer, g)->len - n_app;
        if (cand <= k) continue;
        naive[g] = malloc(sizeof(double) * 2 * cand);
        naive_scores(s, layer, g, c, rows, spy.ref[layer] + (size_t)r0 * row, naive[g]);
        memcpy(naive[g] + cand, naive[g], sizeof(double) * cand);
        qsort(naive[g] + cand, (size_t)cand, sizeof(double), cmp_desc);
        kth[g] = naive[g][cand + k - 1];
    }
    /* positions each candidate had, to map kept entries back to candidate indices */
    int *cand_pos[MAXG];
    for (int g = 0; g < G; g++) {
        int cand = kr_seq_list(s, layer, g)->len - n_app;
        cand_pos[g] = malloc(sizeof(int) * (cand > 0 ? cand : 1));
        for (int e = 0; e < cand; e++) cand_pos[g][e] = pos_at(s, layer, g, e);
    }

    spy.real->after_chunk(p, s, env, c, layer);

    if (layer < W - 1) /* delayed: the own hook of a warm-up layer below W - 1 evicts nothing */
        CHECK(kr_seq_list(s, layer, 0)->len == before, "chunk %d layer %d pruned by its own hook",
              spy.chunks, layer);
    for (int g = 0; g < G && scored; g++) {
        if (!naive[g]) continue;
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        int cand = before - n_app, kept = l->len - n_app, e = 0, n_above = 0, n_above_kept = 0;
        spy.evictions_seen++;
        for (int j = 0; j < cand; j++) {
            int is_kept = e < kept && pos_at(s, layer, g, e) == cand_pos[g][j];
            if (is_kept) e++;
            double sc = naive[g][j], tol = 1e-6 * kth[g];
            if (sc > kth[g] + tol) n_above++, n_above_kept += is_kept;
            CHECK(!is_kept || sc >= kth[g] - tol, "chunk %d layer %d head %d kept entry %d scoring %.9g "
                  "below the k-th %.9g", spy.chunks, layer, g, j, sc, kth[g]);
        }
        CHECK(e == kept, "chunk %d layer %d head %d: kept entries are not a subsequence", spy.chunks, layer, g);
        CHECK(n_above == n_above_kept, "chunk %d layer %d head %d: %d of %d top entries dropped", spy.chunks,
              layer, g, n_above - n_above_kept, n_above);
    }
    for (int g = 0; g < G; g++) {
        free(naive[g]);
        free(cand_pos[g]);
    }
    if (layer != spy.n_layers - 1) return;

    /* every layer is done with this chunk: check the lists (layer L-1 still has the probe) */
    for (int l = 0; l < spy.n_layers; l++) {
        int total = spy.kept[l] + c->n_real, budget = kr_take_budget(p, l, c->last);
        int expect = total < budget ? total : budget;
        for (int g = 0; g < G; g++) {
            const kr_kv_list *list = kr_seq_list(s, l, g);
            int len = list->len - (l == spy.n_layers - 1 ? n_app : 0);
            CHECK(len == expect, "chunk %d layer %d head %d holds %d, expected min(%d, %d)", spy.chunks, l, g,
                  len, total, budget);
            CHECK(list->pinned == len, "chunk %d layer %d head %d: %d pinned of %d", spy.chunks, l, g,
                  list->pinned, len);
            for (int e = 0; e < len; e++) {
                int at = pos_at(s, l, g, e);
                CHECK(at < c->start + c->n_real && (e == 0 || at > pos_at(s, l, g, e - 1)),
                      "chunk %d layer %d head %d entry %d at position %d", spy.chunks, l, g, e, at);
                /* eq. 6: the warm-up layers hold exactly what layer W - 1 chose */
                if (l < W - 1)
                    CHECK(at == pos_at(s, W - 1, g, e), "chunk %d layer %d head %d entry %d: position %d, "
                          "layer %d has %d", spy.chunks, l, g, e, at, W - 1, pos_at(s, W - 1, g, e));
            }
        }
        spy.kept[l] = expect;
    }
    spy.chunks++;
}

static void test_forward(const char *fixtures)
{
    char path[4096], err[KR_ERR_MAX];
    snprintf(path, sizeof path, "%s/models/llama3-tiny", fixtures);
    kr_model *m;
    REQUIRE(kr_model_load(path, NULL, &m, err) == KR_OK, "load %s: %s", path, err);
    const kr_config *cfg = kr_model_config(m);
    REQUIRE(cfg->n_layers <= MAXL && cfg->n_kv_heads <= MAXG, "fixture shape changed");
    kr_ctx *ctx;
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 2, .max_chunk = 64};
    REQUIRE(kr_ctx_create(m, &cp, &ctx, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, 16, 4096, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);

    enum { N = 300 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 131 + 7) % 500);
    const char *specs[] = {
        "take:budget=40,warmup_budget=100,probe=8,alpha=0.2,kernel=5", /* W = 2 by default */
        "take:budget=40,warmup_budget=100,probe=8,alpha=0.32,kernel=3,warmup_layers=3",
        "take:budget=40,warmup_budget=100,probe=8,alpha=0.5,kernel=1,warmup_layers=0",
        "take:budget=40,warmup_budget=100,probe=8,warmup_layers=4,decode=window:8",
    };
    for (size_t t = 0; t < sizeof specs / sizeof specs[0]; t++) {
        kr_policy *pol;
        REQUIRE(kr_policy_parse(specs[t], cfg, &pol, err) == KR_OK, "%s", err);
        static kr_policy_ops spy_ops;
        memset(&spy, 0, sizeof spy);
        spy.real = pol->ops;
        spy_ops = *pol->ops;
        spy_ops.after_chunk = spy_after_chunk;
        pol->ops = &spy_ops;
        spy.n_layers = cfg->n_layers;
        spy.n_heads = cfg->n_heads;
        spy.head_dim = cfg->head_dim;
        REQUIRE(sscanf(strstr(kr_policy_spec(pol), "warmup_layers="), "warmup_layers=%d", &spy.W) == 1, "spec");
        REQUIRE(sscanf(strstr(kr_policy_spec(pol), "alpha="), "alpha=%f", &spy.alpha) == 1, "spec");
        REQUIRE(sscanf(strstr(kr_policy_spec(pol), "kernel="), "kernel=%d", &spy.kernel) == 1, "spec");
        for (int l = 0; l < cfg->n_layers; l++)
            spy.ref[l] = calloc((size_t)PROBE * cfg->n_heads * cfg->head_dim, sizeof(float));

        kr_seq *s;
        REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_set_policy(s, pol, err) == KR_OK, "%s", err);
        float *lg = malloc(sizeof(float) * cfg->vocab_size);
        REQUIRE(kr_prefill(ctx, s, ids, N, 64, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
        CHECK(spy.chunks == 5, "%s: %d chunks", specs[t], spy.chunks);
        CHECK(spy.evictions_seen > 0, "%s: nothing was ever scored", specs[t]);

        /* after the last chunk every list holds B, and the accumulated probe is eq. 9's */
        const size_t pf = (size_t)PROBE * cfg->n_heads * cfg->head_dim;
        for (int l = 0; l < cfg->n_layers; l++) {
            for (int g = 0; g < cfg->n_kv_heads; g++)
                CHECK(kr_seq_len(s, l, g) == BUDGET, "%s: layer %d head %d holds %d after prefill", specs[t], l,
                      g, kr_seq_len(s, l, g));
            const float *acc = kr_take_probe(s, l);
            int scored = l >= (spy.W > 0 ? spy.W - 1 : 0);
            CHECK(!acc == !scored, "%s: layer %d %s an accumulated probe", specs[t], l, acc ? "has" : "lacks");
            double worst = 0;
            for (size_t i = 0; acc && i < pf; i++) {
                double d = fabs((double)acc[i] - spy.ref[l][i]);
                worst = d > worst || d != d ? d : worst;
            }
            CHECK(worst <= 1e-6, "%s: layer %d accumulated probe off by %.3g", specs[t], l, worst);
        }
        /* decode: grow adds one entry per step; window:8 keeps the B pinned plus the newest 8 */
        for (int step = 0; step < 12; step++) {
            int32_t tok = (int32_t)(step * 17 % 500);
            REQUIRE(kr_forward(ctx, s, &tok, 1, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
        }
        int expect = strstr(specs[t], "window:8") ? BUDGET + 8 : BUDGET + 12;
        for (int l = 0; l < cfg->n_layers; l++)
            CHECK(kr_seq_len(s, l, 0) == expect && kr_seq_list(s, l, 0)->pinned == BUDGET,
                  "%s: after decode layer %d holds %d (%d pinned), expected %d (%d)", specs[t], l,
                  kr_seq_len(s, l, 0), kr_seq_list(s, l, 0)->pinned, expect, BUDGET);
        free(lg);
        kr_seq_free(s);
        for (int l = 0; l < cfg->n_layers; l++) free(spy.ref[l]);
        kr_policy_free(pol);
    }
    CHECK(kr_kv_pool_n_free(pool) == kr_kv_pool_n_blocks(pool), "blocks leaked");
    kr_kv_pool_free(pool);
    kr_ctx_free(ctx);
    kr_model_free(m);
}

int main(void)
{
    test_parse();
    test_ema_and_budgets();
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    test_forward(fx);
    return kt_done("test_policy_take");
}
