/*
 * test_policy_hsft.c - the `hsft` policy (engine/policy-hsft.c): spec parsing and file errors,
 * the canonical spec, the dense heads of each layer, the rescaling of learned windows to a
 * global KV budget on numbers worked out by hand (and a monotonicity / budget property over many
 * random cases), a real chunked prefill + decode on llama3-tiny (4 layers, 2 KV heads) with
 * every list's length and positions and the KV footprint checked against hand computations.
 * (budget=1 reproducing the fixtures' full-attention logits: test_fixtures.c, KEEP_ALL.)
 * Run through ctest (needs KR_FIXTURES).
 */
#include "kr_test.h"

#include "policy.h"

#include <cjson/cJSON.h>
#include <unistd.h>

static char tmp[256];

static const char *write_file(const char *name, const char *text)
{
    static char paths[16][512];
    static int next;
    char *path = paths[next++ % 16];
    snprintf(path, 512, "%s/%s", tmp, name);
    FILE *f = fopen(path, "w");
    REQUIRE(f, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
    return path;
}

/* kr_policy_parse must fail with a message containing `needle` */
static void expect_error(const kr_config *cfg, const char *spec, const char *needle)
{
    char err[KR_ERR_MAX] = "";
    kr_policy *p = NULL;
    CHECK(kr_policy_parse(spec, cfg, &p, err) != KR_OK, "'%s' parsed", spec);
    CHECK_ERR_HAS(err, needle);
    kr_policy_free(p);
}

static void expect_spec(const kr_config *cfg, const char *spec, const char *canonical)
{
    char err[KR_ERR_MAX] = "";
    kr_policy *p = NULL;
    int rc = kr_policy_parse(spec, cfg, &p, err);
    CHECK(rc == KR_OK, "'%s': %s", spec, err);
    if (rc != KR_OK) return;
    CHECK(!strcmp(kr_policy_spec(p), canonical), "'%s' canonical '%s', expected '%s'", spec,
          kr_policy_spec(p), canonical);
    kr_policy_free(p);
}

/* learned {1, 2, 3, 2} tokens; gates make heads {0, 1, 0, 0} the dense ones at one per layer:
 * layer 2 ties (lower index wins), layer 3 is clipped to [0, 1] first */
static const char *windows_path, *pattern_path;

static void test_parse(const kr_config *cfg)
{
    char spec[1024], path[600];
    /* defaults: dense = budget - 0.05 (paper section 3.1), budget 0.1, sink 128 (Table 6);
     * dense 0.05 of 2 KV heads floors to 0 dense heads, so the pattern is optional */
    snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s", windows_path, pattern_path);
    snprintf(path, sizeof path, "hsft:windows=%s,pattern=%s,dense=0.05,budget=0.1,sink=128", windows_path,
             pattern_path);
    expect_spec(cfg, spec, path);
    snprintf(spec, sizeof spec, "hsft:windows=%s", windows_path);
    snprintf(path, sizeof path, "hsft:windows=%s,dense=0.05,budget=0.1,sink=128", windows_path);
    expect_spec(cfg, spec, path);
    /* budget 0.3 defaults dense to 0.25 */
    snprintf(spec, sizeof spec, "hsft:budget=0.3,windows=%s", windows_path);
    snprintf(path, sizeof path, "hsft:windows=%s,dense=0.25,budget=0.3,sink=128", windows_path);
    expect_spec(cfg, spec, path);
    snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s,dense=0.5,budget=0.75,sink=2,decode=window:5",
             windows_path, pattern_path);
    snprintf(path, sizeof path, "hsft:windows=%s,pattern=%s,dense=0.5,budget=0.75,sink=2,decode=window:5",
             windows_path, pattern_path);
    expect_spec(cfg, spec, path);
    snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s,budget=1,sink=0,decode=grow", windows_path,
             pattern_path);
    snprintf(path, sizeof path, "hsft:windows=%s,pattern=%s,dense=0.95,budget=1,sink=0,decode=grow",
             windows_path, pattern_path);
    expect_spec(cfg, spec, path);

    /* keys and values */
    expect_error(cfg, "hsft", "needs windows=FILE");
    expect_error(cfg, "hsft:budget=0.5", "needs windows=FILE");
    snprintf(spec, sizeof spec, "hsft:windows=%s,window=4", windows_path);
    expect_error(cfg, spec, "hsft has no key 'window' (keys: windows, pattern, dense, budget, sink, decode)");
    snprintf(spec, sizeof spec, "hsft:windows=%s,budget=0", windows_path);
    expect_error(cfg, spec, "budget=0 must be > 0");
    snprintf(spec, sizeof spec, "hsft:windows=%s,budget=1.5", windows_path);
    expect_error(cfg, spec, "budget=1.5 is out of range [0, 1]");
    snprintf(spec, sizeof spec, "hsft:windows=%s,dense=half", windows_path);
    expect_error(cfg, spec, "dense=half is not a number");
    snprintf(spec, sizeof spec, "hsft:windows=%s,sink=-1", windows_path);
    expect_error(cfg, spec, "sink=-1 is out of range");
    snprintf(spec, sizeof spec, "hsft:windows=%s,decode=window", windows_path);
    expect_error(cfg, spec, "decode=window must be grow or window:W");
    expect_error(cfg, "hsft:windows=", "windows= needs a file path");
    /* dense heads need the gates; dense heads alone must fit the budget */
    snprintf(spec, sizeof spec, "hsft:windows=%s,budget=0.75", windows_path);
    expect_error(cfg, spec, "dense=0.7 makes 1 KV heads per layer dense: it needs pattern=FILE");
    snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s,dense=1,budget=0.6", windows_path, pattern_path);
    expect_error(cfg, spec, "dense=1 keeps 2 of 2 KV heads per layer dense, more than budget=0.6");

    /* the windows file: each error names the file, the line and what was expected */
    struct {
        const char *text, *needle;
    } bad[] = {
        {"1\n2\nabc\n4\n", ":3: expected one window size in tokens (an integer in [1, 1073741824]), got 'abc'"},
        {"1\n2\n0\n4\n", ":3: expected one window size in tokens"},
        {"# c\n1\n-5\n", ":3: expected one window size in tokens (an integer in [1, 1073741824]), got '-5'"},
        {"1\n2 3\n", ":2: expected one window size in tokens (an integer in [1, 1073741824]), got '2 3'"},
        {"1\n2\n3.5\n4\n", ":3: expected one window size in tokens"},
        {"1\n2\n3\n4\n5\n", ":5: more than 4 windows (one line per layer; the model has 4 layers)"},
        {"1\n2\n3\n", ": 3 windows, expected 4 (one line per layer)"},
        {"", ": 0 windows, expected 4"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *wp = write_file("bad_windows.txt", bad[i].text);
        snprintf(spec, sizeof spec, "hsft:windows=%s", wp);
        snprintf(path, sizeof path, "%s%s", wp, bad[i].needle);
        expect_error(cfg, spec, path);
    }
    snprintf(spec, sizeof spec, "hsft:windows=%s/absent.txt", tmp);
    snprintf(path, sizeof path, "%s/absent.txt", tmp);
    expect_error(cfg, spec, path);
    /* the pattern is read (and checked) even when no head is dense */
    const char *bp = write_file("bad_pattern.tsv", "0.1\t0.2\n0.3\t0.4\n");
    snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s", windows_path, bp);
    snprintf(path, sizeof path, "%s: 2 rows, the model has 4 layers", bp);
    expect_error(cfg, spec, path);

    /* comments, blank lines, CRLF and surrounding blanks are fine */
    const char *ok = write_file("ok_windows.txt", "# learned windows (tokens)\r\n 128\r\n\r\n256 \n\t384\n# x\n256");
    int w[4];
    char err[KR_ERR_MAX];
    CHECK(kr_hsft_read_windows(ok, 4, w, err) == KR_OK, "%s", err);
    CHECK(w[0] == 128 && w[1] == 256 && w[2] == 384 && w[3] == 256, "read %d %d %d %d", w[0], w[1], w[2], w[3]);
}

static void test_dense_choice(void)
{
    /* 3 layers x 4 KV heads, 2 dense per layer: the two highest gates of each row, ties to the
     * lower head index */
    const float gates[] = {
        0.1f, 0.9f, 0.5f, 0.9f, /* 0.9 twice: heads 1 and 3 */
        0.5f, 0.5f, 0.5f, 0.2f, /* three-way tie: heads 0 and 1 */
        0.0f, 0.0f, 0.0f, 0.0f, /* all tied: heads 0 and 1 */
    };
    const uint8_t expect[] = {0, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0};
    uint8_t dense[12];
    kr_hsft_choose_dense(gates, 3, 4, 2, dense);
    for (int i = 0; i < 12; i++) CHECK(dense[i] == expect[i], "layer %d head %d dense %d", i / 4, i % 4, dense[i]);
    kr_hsft_choose_dense(gates, 3, 4, 0, dense);
    for (int i = 0; i < 12; i++) CHECK(dense[i] == 0, "no dense heads asked, head %d dense", i);
    /* per layer, not global: layer 1's 0.5s lose to layer 0's 0.9s globally but still count here */
    kr_hsft_choose_dense(gates, 3, 4, 1, dense);
    CHECK(dense[1] && dense[4] && dense[8] && dense[0] + dense[2] + dense[3] + dense[5] + dense[9] == 0,
          "one per layer: %d %d %d", dense[1], dense[4], dense[8]);
}

static void expect_windows(const int *got, const int *want, int n, const char *what)
{
    for (int l = 0; l < n; l++) CHECK(got[l] == want[l], "%s: layer %d window %d, expected %d", what, l, got[l], want[l]);
}

static void test_rescale(void)
{
    const int learned[4] = {1, 2, 3, 2};
    int w[4];
    /* (a) 4 layers x (1 dense + 1 streaming), sink 2, context 40, budget 0.75: the full cache is
     * 4*2*40 = 320, the cap 240; dense heads hold 4*40 = 160, so the streaming heads get 80 =
     * sum(2 + W_l), sum W_l = 72 = 9 * (1+2+3+2): scale 9, windows {9, 18, 27, 18}, exact. */
    CHECK(kr_hsft_rescale(learned, 4, 1, 1, 2, 0.75, 40, w) == 240, "(a) total");
    expect_windows(w, (int[]){9, 18, 27, 18}, 4, "(a)");
    /* (b) same with cap 238 (budget 238/320): sum W_l <= 70. A common scale gives at most
     * {8, 17, 26, 17} = 68 for c in [26/3, 9); at c = 9 every layer steps up to 72. The two
     * leftover entries go one layer at a time to the layers that step next, larger learned
     * first, ties to the lower layer: layer 2 (3) -> 27, layer 1 (2) -> 18. Total 238. */
    CHECK(kr_hsft_rescale(learned, 4, 1, 1, 2, 238.0 / 320.0, 40, w) == 238, "(b) total");
    expect_windows(w, (int[]){8, 18, 27, 17}, 4, "(b)");
    /* (c) a window reaching the context: context 10, budget 0.9 -> cap 72, dense 40, streaming
     * 32 = sum min(10, 2 + W_l). At c = 3: {3, 6, 9, 6} -> 5 + 8 + 10 + 8 = 31 (layer 2 holds
     * the whole context). At c = 3.5 layers 1 and 3 step to 7: 33 > 32. Leftover 1 goes to
     * layer 1 (learned 2, lower than layer 3). Layer 2 at c just under 3.5 is floor(10.49) = 10. */
    CHECK(kr_hsft_rescale(learned, 4, 1, 1, 2, 0.9, 10, w) == 72, "(c) total");
    expect_windows(w, (int[]){3, 7, 10, 6}, 4, "(c)");
    /* (d) budget 1: everything fits, nothing is trimmed */
    CHECK(kr_hsft_rescale(learned, 4, 1, 1, 2, 1.0, 40, w) == 320, "(d) total");
    expect_windows(w, (int[]){KR_HSFT_ALL, KR_HSFT_ALL, KR_HSFT_ALL, KR_HSFT_ALL}, 4, "(d)");
    /* (e) unreachable: sinks 30 at context 40 already make 160 + 4*30 = 280 > cap 192 (0.6):
     * windows 0, and the total says by how much the budget is missed */
    CHECK(kr_hsft_rescale(learned, 4, 1, 1, 30, 0.6, 40, w) == 280, "(e) total");
    expect_windows(w, (int[]){0, 0, 0, 0}, 4, "(e)");
    /* (f) no dense heads, 2 streaming per layer, sink 2, context 40, budget 0.75: cap 240 =
     * 2 * sum min(40, 2 + W_l). c = 14: {14, 28, 42 -> holds 40, 28}: 2*(16+30+40+30) = 232;
     * c = 14.5: layers 1, 3 -> 29: 236; c = 15: layers 0, 1, 3 step: 242 > 240. Just under 15
     * the windows are {14, 29, 44, 29} (layer 2 floor(44.99), holding the 40 anyway). Leftover
     * 4 = two layers of 2 heads: layer 1 then layer 3 (learned 2 before layer 0's 1) -> 30. */
    CHECK(kr_hsft_rescale(learned, 4, 0, 2, 2, 0.75, 40, w) == 240, "(f) total");
    expect_windows(w, (int[]){14, 30, 44, 30}, 4, "(f)");
    /* (g) all heads dense and budget 1 */
    CHECK(kr_hsft_rescale(learned, 4, 2, 0, 2, 1.0, 40, w) == 320, "(g) total");

    /* property: over many shapes, a larger learned window never gets a smaller window, the
     * total is what the windows hold, within the cap and short of it by less than n_stream */
    uint32_t seed = 12345;
    for (int trial = 0; trial < 3000; trial++) {
        int lw[12], rw[12];
        const int n_layers = 1 + trial % 12, n_kv = 1 + trial % 5;
        for (int l = 0; l < n_layers; l++) {
            seed = seed * 1664525u + 1013904223u;
            lw[l] = 1 + (int)((seed >> 8) % 8) * (trial % 3 == 0 ? 1 : 128);
        }
        seed = seed * 1664525u + 1013904223u;
        const int n_dense = (int)(seed >> 8) % n_kv, n_stream = n_kv - n_dense;
        const int ctx = 1 + (int)((seed >> 12) % 5000), sink = (int)((seed >> 4) % 200);
        const double budget = (double)n_dense / n_kv + (1.0 - (double)n_dense / n_kv) * ((seed >> 20) % 1000) / 1000.0;
        int64_t total = kr_hsft_rescale(lw, n_layers, n_dense, n_stream, sink, budget, ctx, rw);
        const int64_t full = (int64_t)n_layers * n_kv * ctx;
        const int64_t cap = (int64_t)floor(budget * (double)full + 1e-6);
        int64_t held = (int64_t)n_layers * n_dense * ctx;
        for (int l = 0; l < n_layers; l++) {
            int64_t e = rw[l] == KR_HSFT_ALL ? ctx : (int64_t)sink + rw[l] < ctx ? (int64_t)sink + rw[l] : ctx;
            held += n_stream * e;
            for (int m = 0; m < n_layers; m++)
                if (lw[l] > lw[m] && rw[l] != KR_HSFT_ALL)
                    CHECK(rw[l] >= rw[m], "trial %d: learned %d > %d but window %d < %d", trial, lw[l], lw[m],
                          rw[l], rw[m]);
        }
        CHECK(held == total, "trial %d: returned %lld, the windows hold %lld", trial, (long long)total,
              (long long)held);
        int64_t floor_entries = (int64_t)n_layers * (n_dense * ctx + n_stream * (sink < ctx ? sink : ctx));
        if (floor_entries <= cap && cap < full)
            CHECK(total <= cap && cap - total < n_stream, "trial %d: total %lld, cap %lld, n_stream %d", trial,
                  (long long)total, (long long)cap, n_stream);
    }
}

/* Reservations: the most one (layer, KV head) holds. No dense heads, context 16, budget 0.75:
 * cap 96 = 2 * sum min(16, 2 + W_l); just under c = 5.5 the windows are {5, 10, 16, 10} (94,
 * layer 2 holding all 16), layers 1 and 3 step next and the leftover 2 gives layer 1 its +1:
 * {5, 11, 16, 10}, holding {7, 13, 16, 12} after prefill. With 4 tokens generated: */
static void test_max_entries(const kr_config *cfg)
{
    const char *decode_key[] = {"", ",decode=window:5", ",decode=grow"};
    /* own windows: sinks + W + the new token, {8, 14, 19, 13} capped by 20 tokens -> 19;
     * window:5: 2 + 5 + 1 = 8, so prefill's 16 is the most; grow: 16 + 4 = 20 */
    const int expect[] = {19, 16, 20};
    char spec[1024], err[KR_ERR_MAX];
    for (int i = 0; i < 3; i++) {
        snprintf(spec, sizeof spec, "hsft:windows=%s,dense=0,budget=0.75,sink=2%s", windows_path, decode_key[i]);
        kr_policy *p;
        REQUIRE(kr_policy_parse(spec, cfg, &p, err) == KR_OK, "%s", err);
        CHECK(kr_policy_max_entries(p, 16, 4) == expect[i], "%s: max entries %d, expected %d", spec,
              kr_policy_max_entries(p, 16, 4), expect[i]);
        CHECK(kr_policy_max_entries(p, 16, 0) == 16, "%s: no decode: %d", spec, kr_policy_max_entries(p, 16, 0));
        kr_policy_free(p);
    }
    int w[4];
    CHECK(kr_hsft_rescale((int[]){1, 2, 3, 2}, 4, 0, 2, 2, 0.75, 16, w) == 96, "reservation example total");
    expect_windows(w, (int[]){5, 11, 16, 10}, 4, "reservation example");
}

/* ---- the real forward pass on llama3-tiny */

typedef struct engine {
    kr_model *m;
    const kr_config *cfg;
    kr_ctx *ctx;
    kr_kv_pool *pool;
} engine;

static kr_seq *new_seq(engine *e, const char *spec, kr_policy **pol)
{
    char err[KR_ERR_MAX];
    REQUIRE(kr_policy_parse(spec, e->cfg, pol, err) == KR_OK, "%s: %s", spec, err);
    kr_seq *s;
    REQUIRE(kr_seq_create(e->pool, e->cfg->n_layers, e->cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(s, *pol, err) == KR_OK, "%s", err);
    return s;
}

/* list (layer, g) must hold positions 0..n_sink-1 then from..to-1, pinning `pinned` */
static void check_list(kr_seq *s, int layer, int g, int n_sink, int from, int to, int pinned, const char *when)
{
    const kr_kv_list *l = kr_seq_list(s, layer, g);
    int want = n_sink + (to - from);
    CHECK(l->len == want, "%s: layer %d head %d holds %d, expected %d", when, layer, g, l->len, want);
    CHECK(l->pinned == pinned, "%s: layer %d head %d pins %d, expected %d", when, layer, g, l->pinned, pinned);
    if (l->len != want) return;
    for (int e = 0; e < l->len; e++) {
        int expect = e < n_sink ? e : from + (e - n_sink);
        int32_t pos = *kr_kv_list_pos(s->pool, l, e);
        CHECK(pos == expect, "%s: layer %d head %d entry %d at position %d, expected %d", when, layer, g, e, pos,
              expect);
    }
}

enum { N_PROMPT = 40, CHUNK = 8, N_DECODE = 5, SINK = 2 };
static const int DENSE_HEAD[4] = {0, 1, 0, 0}; /* from the pattern file */
static const int WINDOW[4] = {9, 18, 27, 18}; /* test_rescale (a): context 40, budget 0.75 */

/* decode: 0 own windows, 1 window:5, 2 grow */
static void check_after(kr_seq *s, int n_fed, int decode, const char *when)
{
    for (int l = 0; l < 4; l++)
        for (int g = 0; g < 2; g++) {
            if (g == DENSE_HEAD[l]) {
                check_list(s, l, g, 0, 0, n_fed, n_fed, when);
                continue;
            }
            int w = WINDOW[l], decoded = n_fed - N_PROMPT;
            if (decoded > 0 && decode == 1) w = 5;
            if (decoded > 0 && decode == 2) w = WINDOW[l] + decoded;
            check_list(s, l, g, SINK, n_fed - w, n_fed, SINK, when);
        }
}

static void test_prefill(engine *e)
{
    char err[KR_ERR_MAX], spec[1024], when[64];
    int32_t ids[N_PROMPT + N_DECODE];
    for (int i = 0; i < N_PROMPT + N_DECODE; i++) ids[i] = (int32_t)((i * 37 + 11) % e->cfg->vocab_size);
    float *lg = malloc(sizeof(float) * (size_t)e->cfg->vocab_size);
    const char *decode_key[] = {"", ",decode=window:5", ",decode=grow"};
    for (int decode = 0; decode < 3; decode++) {
        snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s,dense=0.5,budget=0.75,sink=%d%s", windows_path,
                 pattern_path, SINK, decode_key[decode]);
        kr_policy *pol;
        kr_seq *s = new_seq(e, spec, &pol);
        REQUIRE(kr_prefill(e->ctx, s, ids, N_PROMPT, CHUNK, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
        snprintf(when, sizeof when, "decode %d, after prefill", decode);
        check_after(s, N_PROMPT, decode, when);
        /* the budget exactly: 0.75 * 4 layers * 2 heads * 40 */
        CHECK(kr_seq_entries(s) == 240, "after prefill %lld entries, the budget is 240", (long long)kr_seq_entries(s));
        for (int k = 0; k < N_DECODE; k++) {
            REQUIRE(kr_forward(e->ctx, s, &ids[N_PROMPT + k], 1, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
            snprintf(when, sizeof when, "decode %d, step %d", decode, k + 1);
            check_after(s, N_PROMPT + k + 1, decode, when);
        }
        if (decode == 0) {
            /* KV footprint by hand. A streaming head with C = sink + window holds min(a, C)
             * before the chunk [a, a+8), so the chunk's queries attend 8*min(a, C) + 36 (the
             * closed form of PruLong's evaluation), then each decode step attends C + 1:
             *   layer 0 (C 11): 180 + 8*(0+8+11+11+11) = 508, + 5*12 = 568
             *   layer 1 (C 20): 180 + 8*(0+8+16+20+20) = 692, + 5*21 = 797 (layer 3 the same)
             *   layer 2 (C 29): 180 + 8*(0+8+16+24+29) = 796, + 5*30 = 946
             * streaming 568 + 797 + 946 + 797 = 3108; each dense head attends 1+2+...+45 = 1035,
             * 4 of them 4140; attended 7248. Full: 8 lists * 1035 = 8280. */
            kr_footprint fp;
            kr_seq_footprint(s, &fp);
            CHECK(fp.attended == 7248 && fp.full == 8280, "footprint %g / %g, expected 7248 / 8280", fp.attended,
                  fp.full);
            CHECK(fp.steps == 45 && fp.peak_head_entries == 45, "steps %lld peak per head %lld",
                  (long long)fp.steps, (long long)fp.peak_head_entries);
            /* most held at once: while the last step's layer 3 attends, before its trim: layers
             * 0-2 trimmed, 4 dense * 45 + streaming 11+20+29 + layer 3's 20+1 = 261 */
            CHECK(fp.peak_entries == 261, "peak entries %lld, expected 261", (long long)fp.peak_entries);
            CHECK(kr_policy_max_entries(pol, N_PROMPT, N_DECODE) == 45, "max entries %d",
                  kr_policy_max_entries(pol, N_PROMPT, N_DECODE));
        }
        kr_seq_free(s);
        kr_policy_free(pol);
        CHECK(kr_kv_pool_n_free(e->pool) == kr_kv_pool_n_blocks(e->pool), "blocks leaked");
    }

    /* the rescale follows each prompt: 16 tokens in one chunk, context 16, cap 0.75*128 = 96,
     * dense 64, streaming 32 = sum(2 + W): sum W = 24 = 3 * 8 -> {3, 6, 9, 6} */
    snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s,dense=0.5,budget=0.75,sink=%d", windows_path,
             pattern_path, SINK);
    kr_policy *pol;
    kr_seq *s = new_seq(e, spec, &pol);
    REQUIRE(kr_prefill(e->ctx, s, ids, 16, 0, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    const int w16[4] = {3, 6, 9, 6};
    for (int l = 0; l < 4; l++) check_list(s, l, 1 - DENSE_HEAD[l], SINK, 16 - w16[l], 16, SINK, "prompt 16");
    CHECK(kr_seq_entries(s) == 96, "prompt 16: %lld entries, budget 96", (long long)kr_seq_entries(s));
    kr_seq_free(s);
    kr_policy_free(pol);

    /* without dense heads (test_rescale (f)): every head streams; reservations */
    snprintf(spec, sizeof spec, "hsft:windows=%s,dense=0,budget=0.75,sink=%d,decode=window:5", windows_path, SINK);
    s = new_seq(e, spec, &pol);
    REQUIRE(kr_prefill(e->ctx, s, ids, N_PROMPT, CHUNK, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    const int wf[4] = {14, 30, 44, 30};
    for (int l = 0; l < 4; l++)
        for (int g = 0; g < 2; g++) {
            int keep = SINK + wf[l] < N_PROMPT ? wf[l] : N_PROMPT - SINK;
            check_list(s, l, g, SINK, N_PROMPT - keep, N_PROMPT, SINK, "no dense heads");
        }
    /* after prefill the longest list is layer 2's 40; decode holds sinks + 5 + the new token */
    CHECK(kr_policy_max_entries(pol, N_PROMPT, N_DECODE) == 40, "max entries %d",
          kr_policy_max_entries(pol, N_PROMPT, N_DECODE));
    kr_seq_free(s);
    kr_policy_free(pol);
    free(lg);
}

/* Without a prefill (tokens fed by kr_forward alone) the learned windows apply unscaled. */
static void test_forward_only(engine *e)
{
    char err[KR_ERR_MAX], spec[1024];
    snprintf(spec, sizeof spec, "hsft:windows=%s,pattern=%s,dense=0.5,budget=0.75,sink=%d", windows_path,
             pattern_path, SINK);
    kr_policy *pol;
    kr_seq *s = new_seq(e, spec, &pol);
    float *lg = malloc(sizeof(float) * (size_t)e->cfg->vocab_size);
    for (int i = 0; i < 8; i++) {
        int32_t id = (int32_t)(i * 7 + 3);
        REQUIRE(kr_forward(e->ctx, s, &id, 1, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    }
    const int learned[4] = {1, 2, 3, 2};
    for (int l = 0; l < 4; l++) check_list(s, l, 1 - DENSE_HEAD[l], SINK, 8 - learned[l], 8, SINK, "forward only");
    free(lg);
    kr_seq_free(s);
    kr_policy_free(pol);
}

int main(void)
{
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    snprintf(tmp, sizeof tmp, "/tmp/kr_test_hsft.XXXXXX");
    REQUIRE(mkdtemp(tmp), "mkdtemp");
    windows_path = write_file("windows.txt", "# learned window per layer, tokens\n1\n2\n3\n2\n");
    pattern_path = write_file("pattern.tsv", "0.9\t0.1\n0.2\t0.8\n0.5\t0.5\n1.5\t-1\n");

    char dir[4096], err[KR_ERR_MAX];
    snprintf(dir, sizeof dir, "%s/models/llama3-tiny", fx);
    engine e = {0};
    REQUIRE(kr_model_load(dir, NULL, &e.m, err) == KR_OK, "%s", err);
    e.cfg = kr_model_config(e.m);
    REQUIRE(e.cfg->n_layers == 4 && e.cfg->n_kv_heads == 2, "llama3-tiny changed shape");
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = 64};
    REQUIRE(kr_ctx_create(e.m, &cp, &e.ctx, err) == KR_OK, "%s", err);
    REQUIRE(kr_kv_pool_create(e.cfg->head_dim, 4, 4096, KR_DTYPE_F32, &e.pool, err) == KR_OK, "%s", err);

    test_parse(e.cfg);
    test_dense_choice();
    test_rescale();
    test_max_entries(e.cfg);
    test_prefill(&e);
    test_forward_only(&e);

    kr_kv_pool_free(e.pool);
    kr_ctx_free(e.ctx);
    kr_model_free(e.m);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmp);
    return kt_done("test_policy_hsft");
}
