/*
 * test_policy.c - the policy framework and the recency / post-fill families (full, streaming,
 * heads, sage) on inputs small enough to check by hand: spec parsing and its errors; Lazy
 * Pruning's Algorithm 1 on its edges and the paper's worked example; the decode rule on a
 * sequence without a policy against a reference over position arrays; what survives in every
 * list after a real chunked prefill and decode (llama3-tiny: 4 layers, 8 query / 2 KV heads);
 * the KV footprint against the closed forms of PruLong's evaluation; the heads gate file and
 * DuoAttention's sparsity rule at both ends and in between; SAGE-KV's selection against a recomputation of the last token's attention
 * in double; pos=rel against a from-scratch recomputation at the re-assigned positions.
 */
#include "kr_test.h"

#include "policy.h"

#include <unistd.h>

static const char *fx;
static char tmp[256];

static kr_policy *parse_ok(const char *spec, const kr_config *cfg)
{
    char err[KR_ERR_MAX];
    kr_policy *p = NULL;
    int rc = kr_policy_parse(spec, cfg, &p, err);
    CHECK(rc == KR_OK, "'%s' refused: %s", spec, err);
    return p;
}

static void parse_fails(const char *spec, const kr_config *cfg, const char *needle)
{
    char err[KR_ERR_MAX] = "";
    kr_policy *p = NULL;
    CHECK(kr_policy_parse(spec, cfg, &p, err) == -1, "'%s' accepted", spec);
    CHECK_ERR_HAS(err, needle);
    kr_policy_free(p);
}

typedef struct rig {
    kr_model *m;
    const kr_config *cfg;
    kr_ctx *ctx;
    kr_kv_pool *pool;
} rig;

static void rig_open(rig *r, const char *dir, int max_chunk)
{
    char err[KR_ERR_MAX];
    REQUIRE(kr_model_load(dir, NULL, &r->m, err) == KR_OK, "%s", err);
    r->cfg = kr_model_config(r->m);
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = max_chunk};
    REQUIRE(kr_ctx_create(r->m, &cp, &r->ctx, err) == KR_OK, "%s", err);
    REQUIRE(kr_kv_pool_create(r->cfg->head_dim, 16, 8192, KR_DTYPE_F32, &r->pool, err) == KR_OK, "%s", err);
}

static void rig_close(rig *r)
{
    CHECK(kr_kv_pool_n_free(r->pool) == kr_kv_pool_n_blocks(r->pool), "blocks leaked");
    kr_kv_pool_free(r->pool);
    kr_ctx_free(r->ctx);
    kr_model_free(r->m);
}

/* a sequence under `p`, prefilled with ids in chunks, then `steps` greedy-free decode steps
 * feeding ids[n + i] */
static kr_seq *run(rig *r, const kr_policy *p, const int32_t *ids, int n, int chunk, int steps)
{
    char err[KR_ERR_MAX];
    kr_seq *s;
    float *lg = malloc(sizeof(float) * r->cfg->vocab_size);
    REQUIRE(kr_seq_create(r->pool, r->cfg->n_layers, r->cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(s, p, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(r->ctx, s, ids, n, chunk, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    for (int i = 0; i < steps; i++)
        REQUIRE(kr_forward(r->ctx, s, &ids[n + i], 1, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    free(lg);
    return s;
}

/* positions held by one list, as a string "0 1 2 ..." */
static void positions(const kr_seq *s, int layer, int head, char *out, size_t cap)
{
    const kr_kv_list *l = &s->lists[layer * s->n_kv_heads + head];
    size_t at = 0;
    out[0] = 0;
    for (int e = 0; e < l->len && at < cap; e++)
        at += (size_t)snprintf(out + at, cap - at, "%s%d", e ? " " : "", *kr_kv_list_pos(s->pool, l, e));
}

static void range_str(char *out, size_t cap, int a0, int a1, int b0, int b1) /* [a0,a1) then [b0,b1) */
{
    size_t at = 0;
    out[0] = 0;
    for (int i = a0; i < a1; i++) at += (size_t)snprintf(out + at, cap - at, "%s%d", at ? " " : "", i);
    for (int i = b0; i < b1; i++) at += (size_t)snprintf(out + at, cap - at, "%s%d", at ? " " : "", i);
}

static void test_parse(const kr_config *cfg)
{
    kr_policy *p = parse_ok("full", cfg);
    CHECK(p && !strcmp(kr_policy_spec(p), "full:decode=grow"), "full spec '%s'", p ? kr_policy_spec(p) : "");
    kr_policy_free(p);
    p = parse_ok("streaming", cfg);
    CHECK(p && !strcmp(kr_policy_spec(p), "streaming:sink=4,window=2044,lazy=1,slack=0,max_drop=0,pos=abs"),
          "streaming defaults '%s'", p ? kr_policy_spec(p) : "");
    kr_policy_free(p);
    p = parse_ok("streaming:window=8,sink=2,pos=rel,decode=grow", cfg);
    CHECK(p && !strcmp(kr_policy_spec(p), "streaming:sink=2,window=8,lazy=1,slack=0,max_drop=0,pos=rel,decode=grow"),
          "streaming spec '%s'", p ? kr_policy_spec(p) : "");
    kr_policy_free(p);
    p = parse_ok("sage:budget=64", cfg);
    CHECK(p && !strcmp(kr_policy_spec(p), "sage:budget=64"), "sage spec '%s'", p ? kr_policy_spec(p) : "");
    kr_policy_free(p);
    parse_fails("", cfg, "empty");
    parse_fails("nope", cfg, "unknown policy 'nope' (available: full, streaming");
    parse_fails("streaming:sink", cfg, "not key=value");
    parse_fails("streaming:wndow=3", cfg, "no key 'wndow'");
    parse_fails("streaming:sink=-1", cfg, "sink=-1 is out of range");
    parse_fails("streaming:sink=x", cfg, "sink=x is not an integer");
    parse_fails("streaming:sink=0,window=0", cfg, "sink + window > 0");
    parse_fails("streaming:pos=up", cfg, "pos=up must be abs or rel");
    parse_fails("streaming:decode=window:5", cfg, "decode=window:W is not for streaming");
    parse_fails("full:decode=shrink", cfg, "decode=shrink must be grow or window:W");
    parse_fails("full:sink=4", cfg, "full takes no key 'sink'");
    parse_fails("sage:budget=7", cfg, "too small"); /* G = 4: B/(2G) = 0 */
    parse_fails("heads:sparsity=0.5", cfg, "needs pattern=FILE");
    parse_fails("heads:pattern=/nonexistent.tsv", cfg, "/nonexistent.tsv: cannot open");
    parse_fails("heads:pattern=x,sparsity=1.5", cfg, "sparsity=1.5 is out of range");
}

static void test_algorithm1(void)
{
    /* the Lazy Pruning paper, section 3.4: (S, W, R, sigma, delta) = (4, 2044, 32, 16, 32), L = 2090 */
    CHECK(kr_streaming_target(2090, 4, 2044, 32, 16, 32) == 2058, "worked example: %d",
          kr_streaming_target(2090, 4, 2044, 32, 16, 32));
    CHECK(kr_streaming_target(5000, 4, 12, 0, 4, 2) == -1, "R = 0 never prunes");
    CHECK(kr_streaming_target(16, 4, 12, 1, 0, 0) == -1, "L = C is left alone");
    CHECK(kr_streaming_target(17, 4, 12, 1, 0, 0) == 16, "plain StreamingLLM prunes to C");
    CHECK(kr_streaming_target(47, 4, 12, 32, 0, 0) == -1, "L - C = 31 < R = 32: lazy");
    CHECK(kr_streaming_target(48, 4, 12, 32, 0, 0) == 16, "L - C = R: prune, delta 0 -> C");
    CHECK(kr_streaming_target(48, 4, 12, 32, 8, 4) == 24, "max_drop 4 from 48 capped by H = 24");
    CHECK(kr_streaming_target(48, 4, 12, 32, 0, 4) == 16, "slack 0: H = C");
    CHECK(kr_streaming_target(48, 4, 12, 32, 100, 4) == 44, "L - delta inside [C, H]");
    CHECK(kr_streaming_target(48, 4, 12, 32, 100, 40) == 16, "L - delta below C -> C");
}

/* sum over chunks [a, b) of the streaming-head closed form, then decode steps of 1 + local + sink */
static double streaming_closed_form(int n, int chunk, int S, int W, int steps)
{
    double total = 0;
    for (int a = 0; a < n; a += chunk) {
        int b = a + chunk < n ? a + chunk : n;
        double len = b - a, local = a < W ? a : W, rest = a - local, sink = rest < S ? rest : S;
        total += len * (len + 1) / 2 + len * (local + sink);
    }
    for (int i = 0; i < steps; i++) {
        int past = n + i; /* entries before this step, before pruning */
        double local = past < W ? past : W, rest = past - local, sink = rest < S ? rest : S;
        total += 1 + local + sink;
    }
    return total;
}

static void test_streaming(rig *r)
{
    char got[4096], want[4096];
    int32_t ids[128];
    for (int i = 0; i < 128; i++) ids[i] = (int32_t)((i * 73 + 5) % r->cfg->vocab_size);
    const int lists = r->cfg->n_layers * r->cfg->n_kv_heads;

    /* S = 4, W = 16, chunks of 10: after the prompt of 50 the first 4 and the last 16 remain */
    kr_policy *p = parse_ok("streaming:sink=4,window=16", r->cfg);
    kr_seq *s = run(r, p, ids, 50, 10, 0);
    range_str(want, sizeof want, 0, 4, 34, 50);
    for (int l = 0; l < r->cfg->n_layers; l++)
        for (int g = 0; g < r->cfg->n_kv_heads; g++) {
            positions(s, l, g, got, sizeof got);
            CHECK(!strcmp(got, want), "layer %d head %d holds '%s', expected '%s'", l, g, got, want);
            CHECK(s->lists[l * r->cfg->n_kv_heads + g].pinned == 4, "sinks are the pinned set");
        }
    kr_footprint fp;
    kr_seq_footprint(s, &fp);
    CHECK(fp.attended == streaming_closed_form(50, 10, 4, 16, 0) * lists, "prefill footprint %g, closed form %g",
          fp.attended, streaming_closed_form(50, 10, 4, 16, 0) * lists);
    CHECK(fp.full == 50.0 * 51 / 2 * lists, "full-attention denominator %g", fp.full);
    kr_seq_free(s);
    /* ... and after 7 decode steps: the newest 16 of 57 */
    s = run(r, p, ids, 50, 10, 7);
    range_str(want, sizeof want, 0, 4, 41, 57);
    positions(s, 3, 1, got, sizeof got);
    CHECK(!strcmp(got, want), "after decode: '%s', expected '%s'", got, want);
    kr_seq_footprint(s, &fp);
    CHECK(fp.attended == streaming_closed_form(50, 10, 4, 16, 7) * lists, "decode footprint %g, closed form %g",
          fp.attended, streaming_closed_form(50, 10, 4, 16, 7) * lists);
    CHECK(fp.peak_head_entries == 30, "peak per head: 20 held + a chunk of 10, got %lld", (long long)fp.peak_head_entries);
    kr_seq_free(s);
    kr_policy_free(p);

    /* a prompt shorter than sink + window: nothing pruned, window overlapping the sinks */
    p = parse_ok("streaming:sink=4,window=16", r->cfg);
    s = run(r, p, ids, 12, 5, 0);
    range_str(want, sizeof want, 0, 12, 0, 0);
    positions(s, 0, 0, got, sizeof got);
    CHECK(!strcmp(got, want), "short prompt: '%s'", got);
    kr_seq_free(s);
    kr_policy_free(p);

    /* lazy R = 0 never prunes; R = 8 prunes only once the cache is 8 past C */
    p = parse_ok("streaming:sink=2,window=6,lazy=0", r->cfg);
    s = run(r, p, ids, 40, 10, 0);
    CHECK(kr_seq_len(s, 2, 1) == 40, "R = 0 pruned: %d", kr_seq_len(s, 2, 1));
    kr_seq_free(s);
    kr_policy_free(p);
    p = parse_ok("streaming:sink=2,window=6,lazy=8,slack=4,max_drop=3", r->cfg);
    /* chunks of 5: L = 5, 10 (10-8 < 8), 15 (7 < 8), 20 (12 >= 8: target min(max(17, 8), 12) = 12) */
    s = run(r, p, ids, 20, 5, 0);
    range_str(want, sizeof want, 0, 2, 10, 20);
    positions(s, 1, 0, got, sizeof got);
    CHECK(!strcmp(got, want), "lazy/slack/max_drop: '%s', expected '%s'", got, want);
    kr_seq_free(s);
    kr_policy_free(p);

    /* what a decode node holds of a list stays within kr_policy_max_entries, what it reserves:
     * the list after prefill, and at each decode step that list plus the step's entry before
     * the step trims it. With slack >= lazy and max_drop > 0 a chunk leaves C + slack entries,
     * which the next token tops by one. */
    static const char *const bounded[] = {
        "streaming:sink=4,window=16,lazy=2,slack=8,max_drop=4", "streaming:sink=4,window=16,lazy=2,slack=30,max_drop=1",
        "streaming:sink=2,window=6,lazy=8,slack=4,max_drop=3", "streaming:sink=0,window=10,lazy=3,slack=3,max_drop=2",
        "streaming:sink=4,window=16", "streaming:sink=4,window=16,lazy=5,slack=9,max_drop=0",
        "streaming:sink=4,window=16,lazy=2,slack=8,max_drop=4,decode=grow"};
    float *lg = malloc(sizeof(float) * r->cfg->vocab_size);
    for (size_t k = 0; k < sizeof bounded / sizeof bounded[0]; k++)
        for (int chunk = 7; chunk <= 100; chunk += 93) {
            p = parse_ok(bounded[k], r->cfg);
            s = run(r, p, ids, 100, chunk, 0);
            const int most = kr_policy_max_entries(p, 100, 20);
            int worst = 0;
            for (int step = 0; step <= 20; step++) {
                for (int l = 0; l < r->cfg->n_layers; l++)
                    for (int g = 0; g < r->cfg->n_kv_heads; g++) {
                        const int held = kr_seq_len(s, l, g) + (step < 20); /* + the next step's entry */
                        if (held > worst) worst = held;
                    }
                char err[KR_ERR_MAX];
                if (step < 20)
                    REQUIRE(kr_forward(r->ctx, s, &ids[100 + step], 1, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
            }
            CHECK(worst <= most, "%s, chunk %d: a list held %d entries, more than the %d of "
                  "kr_policy_max_entries", bounded[k], chunk, worst, most);
            kr_seq_free(s);
            kr_policy_free(p);
        }
    free(lg);
}

static void test_pattern(const kr_config *cfg)
{
    char err[KR_ERR_MAX], path[512];
    snprintf(path, sizeof path, "%s/gates.tsv", tmp);
    float gates[8];
    FILE *f = fopen(path, "w");
    fprintf(f, "0.9\t-0.5\n# a comment\n1.7\t0.2\n0.4 0.6\n0.1\t0.8\n");
    fclose(f);
    CHECK(kr_heads_read_pattern(path, 4, 2, gates, err) == KR_OK, "%s", err);
    CHECK(gates[1] == 0.0f && gates[2] == 1.0f && gates[5] == 0.6f, "clipped to [0, 1]");
    CHECK(kr_heads_read_pattern(path, 3, 2, gates, err) == -1, "extra row");
    CHECK_ERR_HAS(err, "more than 3 rows");
    CHECK(kr_heads_read_pattern(path, 4, 3, gates, err) == -1, "short row");
    CHECK_ERR_HAS(err, "row 1 has 2 values, the model has 3 KV heads");
    f = fopen(path, "w");
    fprintf(f, "0.9\tx\n");
    fclose(f);
    CHECK(kr_heads_read_pattern(path, 1, 2, gates, err) == -1, "bad number");
    CHECK_ERR_HAS(err, "row 1, column 2 is not a number");
}

/* The decode rule on a sequence without a policy (what a decode node runs): every list gets its
 * own rule and 24 decode steps; after each step every list must hold what a plain reference
 * over position arrays gives (the pinned set grown to `sink`, then Lazy Pruning's Algorithm 1
 * with S = the pinned count), and a list without a rule must hold everything. */
static void test_decode_rule(rig *r)
{
    char err[KR_ERR_MAX], got[4096], want[4096];
    const kr_list_rule rules[] = {
        {.sink = 2, .window = 4, .lazy = 3, .slack = 1, .max_drop = 2}, /* lazy pruning */
        {.sink = 0, .window = 5, .lazy = 1},                           /* plain window */
        {.sink = 3, .window = -1, .lazy = 1},                          /* never trimmed, 3 pinned */
        {.sink = 1, .window = 0, .lazy = 1},                           /* a sink alone */
    };
    const int L = r->cfg->n_layers, H = r->cfg->n_kv_heads, n_rules = (int)(sizeof rules / sizeof rules[0]);
    enum { STEPS = 24 };
    kr_seq *s;
    REQUIRE(kr_seq_create(r->pool, L, H, &s, err) == KR_OK, "%s", err);
    for (int i = 0; i < L * H - 1; i++) /* the last list keeps the rule it was created with */
        REQUIRE(kr_seq_list_set_rule(s, i / H, i % H, &rules[i % n_rules], err) == KR_OK, "%s", err);
    int ref[64][STEPS], len[64] = {0}, pinned[64] = {0};
    float *lg = malloc(sizeof(float) * r->cfg->vocab_size);
    int mismatches = 0;
    for (int step = 0; step < STEPS; step++) {
        int32_t id = (int32_t)((step * 37 + 11) % r->cfg->vocab_size);
        REQUIRE(kr_forward(r->ctx, s, &id, 1, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
        for (int i = 0; i < L * H; i++) {
            const kr_list_rule *u = i < L * H - 1 ? &rules[i % n_rules] : NULL;
            ref[i][len[i]++] = step;
            if (u) {
                int head = pinned[i];
                if (u->sink > head) head = u->sink < len[i] ? u->sink : len[i];
                pinned[i] = head;
                int t = u->window < 0 ? -1 : kr_streaming_target(len[i], head, u->window, u->lazy, u->slack, u->max_drop);
                if (t >= 0) {
                    memmove(ref[i] + head, ref[i] + len[i] - (t - head), sizeof(int) * (size_t)(t - head));
                    len[i] = t;
                }
            }
            size_t at = 0;
            want[0] = 0;
            for (int e = 0; e < len[i]; e++) at += (size_t)snprintf(want + at, sizeof want - at, "%s%d", e ? " " : "", ref[i][e]);
            positions(s, i / H, i % H, got, sizeof got);
            int n, p;
            kr_seq_list_shape(s, i / H, i % H, &n, &p);
            if ((strcmp(got, want) || p != pinned[i]) && mismatches++ < 5)
                CHECK(0, "step %d list %d: '%s' (%d pinned), expected '%s' (%d pinned)", step, i, got, p, want, pinned[i]);
        }
    }
    CHECK(mismatches == 0, "%d list states differ from the reference", mismatches);
    CHECK(len[0] < STEPS && len[1] == 5 && len[2] == STEPS && len[3] == 1, "the rules trimmed (%d %d %d %d)", len[0],
          len[1], len[2], len[3]);
    free(lg);
    kr_seq_free(s);
}

/* DuoAttention's sparsity rule: round(s * n) heads with the lowest gates stream, the others are
 * dense; at s = 1 every head streams (a quantile taken with >= kept the highest gate dense), at
 * s = 0 none does; in between the count is round(s * n), not what a quantile threshold gives
 * (0.3 of 8 distinct gates: round(2.4) = 2 streaming, where >= quantile 0.3 makes 3), and ties
 * keep the lower head dense. Checked through the policy's list windows (-1: dense). */
static void test_heads_sparsity(const kr_config *cfg)
{
    char path[512], spec[700];
    snprintf(path, sizeof path, "%s/sparsity.tsv", tmp);
    FILE *f = fopen(path, "w");
    fprintf(f, "0.9\t0.1\n0.2\t0.8\n0.5\t0.3\n0.4\t0.7\n"); /* ascending: heads 1 2 5 6 4 7 3 0 */
    fclose(f);
    const struct {
        float sparsity;
        int streaming[8];
    } cases[] = {
        {1.0f, {1, 1, 1, 1, 1, 1, 1, 1}},
        {0.0f, {0, 0, 0, 0, 0, 0, 0, 0}},
        {0.3f, {0, 1, 1, 0, 0, 0, 0, 0}},
        {0.5f, {0, 1, 1, 0, 0, 1, 1, 0}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        snprintf(spec, sizeof spec, "heads:pattern=%s,sparsity=%g,sink=3,window=8", path,
                 (double)cases[c].sparsity);
        kr_policy *p = parse_ok(spec, cfg);
        for (int i = 0; i < 8; i++) {
            int w = kr_policy_list_window(p, i / 2, i % 2), want = cases[c].streaming[i] ? 8 : -1;
            CHECK(w == want, "sparsity %g: list (%d, %d) window %d, expected %d", (double)cases[c].sparsity,
                  i / 2, i % 2, w, want);
        }
        kr_policy_free(p);
    }
    const float tied[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    uint8_t dense[4];
    kr_heads_choose_dense(tied, 4, 0.5f, dense);
    CHECK(dense[0] == 1 && dense[1] == 1 && dense[2] == 0 && dense[3] == 0, "ties: %d %d %d %d", dense[0], dense[1],
          dense[2], dense[3]);
}

/* heads: a pattern making some heads streaming; streaming heads keep sinks + window, dense heads
 * everything; footprint = closed form for streaming heads + causal for dense ones */
static void test_heads(rig *r)
{
    char path[512], spec[700], got[4096], want[4096];
    snprintf(path, sizeof path, "%s/llama3.tsv", tmp);
    FILE *f = fopen(path, "w");
    /* 4 layers x 2 KV heads; sparsity 0.5: the four lowest gates stream, the four highest
     * (0.9, 0.8, 0.5, 0.7) stay dense */
    fprintf(f, "0.9\t0.1\n0.2\t0.8\n0.5\t0.3\n0.4\t0.7\n");
    fclose(f);
    snprintf(spec, sizeof spec, "heads:pattern=%s,sparsity=0.5,sink=3,window=8", path);
    kr_policy *p = parse_ok(spec, r->cfg);
    int32_t ids[128];
    for (int i = 0; i < 128; i++) ids[i] = (int32_t)((i * 31 + 7) % r->cfg->vocab_size);
    kr_seq *s = run(r, p, ids, 40, 12, 5);
    const int dense[8] = {1, 0, 0, 1, 1, 0, 0, 1};
    double expect = 0, full = 0;
    for (int i = 0; i < 8; i++) {
        int l = i / 2, g = i % 2;
        positions(s, l, g, got, sizeof got);
        if (dense[i]) range_str(want, sizeof want, 0, 45, 0, 0);
        else range_str(want, sizeof want, 0, 3, 37, 45);
        CHECK(!strcmp(got, want), "layer %d head %d (%s): '%s'", l, g, dense[i] ? "dense" : "streaming", got);
        expect += dense[i] ? 45.0 * 46 / 2 : streaming_closed_form(40, 12, 3, 8, 5);
        full += 45.0 * 46 / 2;
    }
    kr_footprint fp;
    kr_seq_footprint(s, &fp);
    CHECK(fp.attended == expect && fp.full == full, "heads footprint %g / %g, expected %g / %g",
          fp.attended, fp.full, expect, full);
    kr_seq_free(s);
    kr_policy_free(p);
}

/* SAGE-KV on a hand-made cache: 1 layer, 4 query heads over 2 KV heads (G = 2), head_dim 8,
 * 40 entries, B = 16 -> sinks 4, k = 4 per query head, recent 4 + the last token. Query head h
 * is the unit vector u_h; four middle entries per head carry keys 6 u_h (the others small
 * noise), so each head's top 4 is known and the kept middle is the union of its group's. */
static void test_sage_selection(void)
{
    char err[KR_ERR_MAX];
    kr_config cfg = {.n_layers = 1, .n_heads = 4, .n_kv_heads = 2, .head_dim = 8, .hidden_size = 32,
                     .intermediate_size = 32};
    kr_policy *p = parse_ok("sage:budget=16", &cfg);
    kr_model shell;
    memset(&shell, 0, sizeof shell);
    shell.cfg = cfg;
    kr_backend *be;
    REQUIRE(kr_cpu_backend.create(&shell, 2, 8, &be, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    kr_seq *s;
    REQUIRE(kr_kv_pool_create(8, 16, 64, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, 1, 2, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(s, p, err) == KR_OK, "%s", err);
    const int n = 40;
    REQUIRE(kr_seq_grow(s, n, err) == KR_OK, "%s", err);
    /* targets: head 0: 5 9 13 17; head 1 (same group): 9 13 20 30 -> union 5 9 13 17 20 30;
     * head 2: 6 7 8 34; head 3: 4 22 23 24 -> union 4 6 7 8 22 23 24 34 */
    const int target[4][4] = {{5, 9, 13, 17}, {9, 13, 20, 30}, {6, 7, 8, 34}, {4, 22, 23, 24}};
    uint64_t x = 12345;
    for (int g = 0; g < 2; g++) {
        kr_seq_list(s, 0, g)->len = n;
        for (int e = 0; e < n; e++) {
            float k[8], v[8] = {0};
            for (int d = 0; d < 8; d++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                k[d] = (float)((double)(x >> 11) * 0x1.0p-53 - 0.5) * 0.2f;
            }
            for (int h = 2 * g; h < 2 * g + 2; h++)
                for (int t = 0; t < 4; t++)
                    if (target[h][t] == e) k[h] += 6.0f; /* head h's query is the unit vector on axis h */
            kr_seq_put(s, 0, g, e, k, v, e);
        }
    }
    float q[4 * 8] = {0};
    for (int h = 0; h < 4; h++) q[h * 8 + h] = 1.0f;
    float scores[4 * 64];
    int32_t idx[3 * 64];
    kr_evict_env env = {.ops = &kr_cpu_backend, .be = be, .scores = scores, .idx = idx, .cap = 64};
    kr_chunk c = {.q = q, .n_real = 1, .n_appended = 0, .start = n - 1, .n_prompt = n, .last = 1};
    kr_policy_sage.after_chunk(p, s, &env, &c, 0);
    char got[1024];
    positions(s, 0, 0, got, sizeof got);
    CHECK(!strcmp(got, "0 1 2 3 5 9 13 17 20 30 35 36 37 38 39"), "group 0 kept '%s'", got);
    CHECK(s->lists[0].pinned == 10, "group 0 pinned %d (sinks + union)", s->lists[0].pinned);
    positions(s, 0, 1, got, sizeof got);
    CHECK(!strcmp(got, "0 1 2 3 4 6 7 8 22 23 24 34 35 36 37 38 39"), "group 1 kept '%s'", got);
    CHECK(s->lists[1].pinned == 12, "group 1 pinned %d", s->lists[1].pinned);
    kr_seq_free(s);
    kr_kv_pool_free(pool);
    kr_cpu_backend.destroy(be);
    kr_policy_free(p);
}

/* SAGE-KV through a real prefill: sinks, recent window and last token kept in place, middle
 * entries ordered and within the budget */
static void test_sage(rig *r)
{
    const int B = 32, n = 100, H = r->cfg->n_heads, G = H / r->cfg->n_kv_heads;
    const int S = B / 4, k = B / (2 * G), R = B - S - G * k;
    int32_t ids[128];
    for (int i = 0; i < 128; i++) ids[i] = (int32_t)((i * 57 + 3) % r->cfg->vocab_size);
    char spec[64];
    snprintf(spec, sizeof spec, "sage:budget=%d,decode=grow", B);
    kr_policy *p = parse_ok(spec, r->cfg);
    kr_seq *s = run(r, p, ids, n, 32, 0);
    for (int l = 0; l < r->cfg->n_layers; l++)
        for (int g = 0; g < r->cfg->n_kv_heads; g++) {
            const kr_kv_list *kl = &s->lists[l * r->cfg->n_kv_heads + g];
            int pos[256], m = kl->len;
            for (int e = 0; e < m; e++) pos[e] = *kr_kv_list_pos(s->pool, kl, e);
            int ok = m <= B + 1 && m >= S + k + R + 1 && kl->pinned == m - R - 1;
            for (int e = 0; e < S; e++) ok &= pos[e] == e;
            for (int e = 0; e < R + 1; e++) ok &= pos[m - R - 1 + e] == n - R - 1 + e;
            for (int e = S; e < m - R - 1; e++) ok &= pos[e] >= S && pos[e] < n - R - 1 && pos[e] > pos[e - 1];
            CHECK(ok, "layer %d head %d: sage structure wrong (len %d, pinned %d)", l, g, m, kl->pinned);
        }
    kr_seq_free(s);
    kr_policy_free(p);
}

/* pos=rel: after pruning, kept keys are re-rotated to positions 0..L-1. In a one-layer model the
 * next token's logits then depend only on the kept tokens at those positions, so they must equal
 * feeding exactly the kept tokens from scratch (mistral-tiny's weights, cut to one layer). */
static void test_rel(void)
{
    char cmd[4096], dir[512], err[KR_ERR_MAX];
    snprintf(dir, sizeof dir, "%s/m1", tmp);
    snprintf(cmd, sizeof cmd,
             "mkdir -p %s && for f in %s/models/mistral-tiny/*.safetensors %s/models/mistral-tiny/model.safetensors.index.json; "
             "do ln -sf \"$f\" %s/; done && sed -e 's/\"num_hidden_layers\": *[0-9]*/\"num_hidden_layers\": 1/' "
             "%s/models/mistral-tiny/config.json > %s/config.json",
             dir, fx, fx, dir, fx, dir);
    REQUIRE(system(cmd) == 0, "cannot write the one-layer model");
    rig r;
    rig_open(&r, dir, 16);
    const int V = r.cfg->vocab_size, n = 20;
    int32_t ids[32];
    for (int i = 0; i < 32; i++) ids[i] = (int32_t)((i * 41 + 9) % V);
    kr_policy *p = parse_ok("streaming:sink=2,window=6,pos=rel", r.cfg);
    kr_seq *s = run(&r, p, ids, n, 5, 0);
    char got[256];
    positions(s, 0, 0, got, sizeof got);
    CHECK(!strcmp(got, "0 1 2 3 4 5 6 7"), "rel positions '%s'", got);
    CHECK(kr_seq_next_pos(s) == 8, "next position %d", kr_seq_next_pos(s));
    float *a = malloc(sizeof(float) * V), *b = malloc(sizeof(float) * V);
    /* from scratch: the kept tokens (2 sinks, the last 6) at positions 0..7, then the new one */
    int32_t kept[9] = {ids[0], ids[1], ids[14], ids[15], ids[16], ids[17], ids[18], ids[19], ids[n]};
    kr_seq *f;
    REQUIRE(kr_seq_create(r.pool, 1, r.cfg->n_kv_heads, &f, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(r.ctx, f, kept, 8, 8, KR_LOGITS_LAST, b, err) == KR_OK, "%s", err);
    double d = 0, dk = 0;
    for (int g = 0; g < r.cfg->n_kv_heads; g++) /* the re-rotated keys themselves */
        for (int e = 0; e < 8; e++) {
            const float *k1 = kr_kv_list_key(r.pool, &s->lists[g], e);
            const float *k2 = kr_kv_list_key(r.pool, &f->lists[g], e);
            for (int i = 0; i < r.cfg->head_dim; i++) dk = kt_worst(dk, fabs((double)k1[i] - k2[i]));
        }
    CHECK(dk < 1e-5, "re-rotated keys differ by %.3g", dk);
    REQUIRE(kr_forward(r.ctx, s, &ids[n], 1, KR_LOGITS_LAST, a, err) == KR_OK, "%s", err);
    REQUIRE(kr_forward(r.ctx, f, &kept[8], 1, KR_LOGITS_LAST, b, err) == KR_OK, "%s", err);
    for (int i = 0; i < V; i++) d = kt_worst(d, fabs((double)a[i] - b[i]));
    CHECK(d < 2e-5, "pos=rel logits differ from the recomputation by %.3g", d);
    /* the same policy with absolute positions gives other logits: the test can tell */
    kr_policy *pa = parse_ok("streaming:sink=2,window=6,pos=abs", r.cfg);
    kr_seq *t = run(&r, pa, ids, n, 5, 0);
    REQUIRE(kr_forward(r.ctx, t, &ids[n], 1, KR_LOGITS_LAST, a, err) == KR_OK, "%s", err);
    d = 0;
    for (int i = 0; i < V; i++) d = kt_worst(d, fabs((double)a[i] - b[i]));
    CHECK(d > 1e-3, "abs positions should differ from the rel recomputation (%.3g)", d);
    kr_seq_free(t);
    kr_seq_free(f);
    kr_seq_free(s);
    kr_policy_free(pa);
    kr_policy_free(p);
    free(a);
    free(b);
    rig_close(&r);
}

int main(void)
{
    fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    snprintf(tmp, sizeof tmp, "/tmp/kr_test_policy.XXXXXX");
    REQUIRE(mkdtemp(tmp), "mkdtemp");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/models/llama3-tiny", fx);
    rig r;
    rig_open(&r, dir, 64);
    test_parse(r.cfg);
    test_algorithm1();
    test_streaming(&r);
    test_decode_rule(&r);
    test_pattern(r.cfg);
    test_heads_sparsity(r.cfg);
    test_heads(&r);
    test_sage(&r);
    test_sage_selection();
    test_rel();
    rig_close(&r);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    (void)system(cmd);
    return kt_done("test_policy");
}
