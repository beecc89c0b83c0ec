/*
 * test_router_adaptive.c - kv_policy auto's pure parts (router/adaptive.c): the calibration
 * table's parser and its refusals, the auto spec's syntax, the pressure levels, and the
 * selection rule on synthetic tables: the floor held at every pressure level, the fewest blocks
 * chosen, full at floor 1 and at low pressure, ties, prompts between and beyond the calibrated
 * lengths, points the router cannot serve. No network. Run: ctest -R test_router_adaptive.
 */
#include "kr_test.h"

#include "../../router/adaptive.c"
#include "../../router/policy.c"

static const kr_config *test_cfg(void)
{
    static kr_config c;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 8;
    c.hidden_size = 32;
    c.intermediate_size = 32;
    return &c;
}

/* A point of a synthetic table: kv and text scores (cases 0: the task is not scored). */
typedef struct pt {
    const char *spec;
    int length;
    double kv;
    int kv_cases;
    double text;
    int text_cases;
} pt;

/* The table's JSON for `pts` at lengths 256 and 1024, tasks kv and text (full's kv accuracy 1). */
static char *table_json(const pt *pts, int n)
{
    size_t cap = 4096 + (size_t)n * 512, len = 0;
    char *s = malloc(cap);
    len += (size_t)snprintf(s + len, cap - len,
                            "{\"kind\":\"kvrelay-calibration\",\"format\":1,\"model\":{\"fingerprint\":"
                            "\"0123456789abcdef\",\"name\":\"synthetic\"},\"chunk\":64,\"seed\":1,\"block_size\":16,"
                            "\"tasks\":[\"kv\",\"text\"],\"lengths\":[256,1024],\"points\":[");
    for (int i = 0; i < n; i++) {
        len += (size_t)snprintf(s + len, cap - len, "%s{\"spec\":\"%s\",\"length\":%d,\"scores\":{", i ? "," : "",
                                pts[i].spec, pts[i].length);
        if (pts[i].kv_cases)
            len += (size_t)snprintf(s + len, cap - len, "\"kv\":{\"policy\":%.17g,\"full\":1,\"cases\":%d}", pts[i].kv,
                                    pts[i].kv_cases);
        if (pts[i].text_cases)
            len += (size_t)snprintf(s + len, cap - len, "%s\"text\":{\"policy\":%.17g,\"full\":1,\"cases\":%d}",
                                    pts[i].kv_cases ? "," : "", pts[i].text, pts[i].text_cases);
        len += (size_t)snprintf(s + len, cap - len, "}}");
    }
    snprintf(s + len, cap - len, "]}");
    return s;
}

static rt_calib *load(const pt *pts, int n, int *dropped)
{
    char *json = table_json(pts, n), err[512];
    rt_calib *t = NULL;
    REQUIRE(rt_calib_parse(json, strlen(json), &t, err, sizeof err) == 0, "parse: %s", err);
    free(json);
    REQUIRE(rt_calib_bind(t, test_cfg(), NULL, dropped, err, sizeof err) == 0, "bind: %s", err);
    return t;
}

static rt_auto_choice choose(const rt_calib *t, const char *spec, int prompt, int max_tokens, rt_pressure level)
{
    rt_auto_ask ask;
    rt_auto_choice c;
    char err[512];
    REQUIRE(rt_auto_parse(spec, &ask, err, sizeof err) == 0, "%s: %s", spec, err);
    REQUIRE(rt_auto_choose(t, &ask, prompt, max_tokens, level, &c, err, sizeof err) == 0, "%s: %s", spec, err);
    return c;
}

static void test_wilson(void)
{
    /* p = 1 on 20 cases: n / (n + z^2) = 0.8808; p = 0.5 on 100: 0.4188 */
    CHECK(fabs(rt_wilson_lower(1.0, 20, RT_AUTO_Z) - 20.0 / (20.0 + RT_AUTO_Z * RT_AUTO_Z)) < 1e-12, "p=1 n=20: %.6f",
          rt_wilson_lower(1.0, 20, RT_AUTO_Z));
    CHECK(fabs(rt_wilson_lower(0.5, 100, RT_AUTO_Z) - 0.41885) < 1e-4, "p=.5 n=100: %.6f", rt_wilson_lower(0.5, 100, RT_AUTO_Z));
    CHECK(rt_wilson_lower(0.0, 50, RT_AUTO_Z) == 0.0, "p=0");
    CHECK(rt_wilson_lower(1.0, 0, RT_AUTO_Z) == 0.0, "n=0 proves nothing");
    CHECK(rt_wilson_lower(NAN, 50, RT_AUTO_Z) == 0.0, "NaN proves nothing");
    CHECK(rt_wilson_lower(0.9, 1000, RT_AUTO_Z) > rt_wilson_lower(0.9, 100, RT_AUTO_Z), "more cases, tighter");
}

static void test_parse_errors(void)
{
    static const char *head = "\"kind\":\"kvrelay-calibration\",\"model\":{\"fingerprint\":\"0123456789abcdef\"},"
                              "\"chunk\":64,\"seed\":1,\"block_size\":16,\"tasks\":[\"kv\"],\"lengths\":[256]";
    struct {
        const char *body, *want;
    } bad[] = {
        {"[]", "not a JSON object"},
        {"{\"format\":1}", "kind"},
        {"{\"kind\":\"kvrelay-calibration\",\"format\":2}", "format: 2"},
        {"{\"kind\":\"kvrelay-calibration\",\"format\":1,\"model\":{\"fingerprint\":\"XYZ\"}}", "model.fingerprint"},
        {"{%s,\"format\":1,\"points\":[{\"spec\":\"full\",\"length\":512,\"scores\":{}}]}", "points[0].length: 512"},
        {"{%s,\"format\":1,\"points\":[{\"spec\":\"auto\",\"length\":256,\"scores\":{}}]}", "points[0].spec"},
        {"{%s,\"format\":1,\"points\":[{\"spec\":\"full\",\"length\":256,\"scores\":{\"kv\":{\"policy\":1.5,\"full\":1,"
         "\"cases\":3}}}]}", "points[0].scores.kv.policy: 1.5"},
        {"{%s,\"format\":1,\"points\":[{\"spec\":\"full\",\"length\":256,\"scores\":{\"kv\":{\"policy\":1,\"full\":1,"
         "\"cases\":0}}}]}", "points[0].scores.kv.cases"},
        {"{%s,\"format\":1,\"points\":[{\"spec\":\"full\",\"length\":256,\"scores\":{\"copy\":{}}}]}", "task 'copy'"},
        {"{%s,\"format\":1,\"points\":[{\"spec\":\"full\",\"length\":256,\"scores\":{\"kv\":{\"policy\":1,\"full\":1,"
         "\"cases\":2.5}}}]}", "not an integer"},
        {"{%s,\"format\":1}", "points"},
        {"{\"kind\":\"kvrelay-calibration\",\"format\":1,\"model\":{\"fingerprint\":\"0123456789abcdef\"},\"chunk\":64,"
         "\"seed\":1,\"block_size\":16,\"tasks\":[\"kv\"],\"lengths\":[512,256]}", "lengths[1]"},
        {"{\"kind\":\"kvrelay-calibration\",\"format\":1,\"model\":{\"fingerprint\":\"0123456789abcdef\"},\"chunk\":64,"
         "\"seed\":1,\"block_size\":0}", "block_size"},
        {"{\"kind\":", "not valid JSON"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char json[2048], err[512] = "";
        snprintf(json, sizeof json, bad[i].body, head);
        rt_calib *t = NULL;
        CHECK(rt_calib_parse(json, strlen(json), &t, err, sizeof err) == -1 && !t, "accepted %s", json);
        CHECK_ERR_HAS(err, bad[i].want);
    }
}

static void test_auto_syntax(void)
{
    rt_auto_ask a;
    char err[512];
    CHECK(rt_auto_is("auto") && rt_auto_is("auto:floor=0.9") && !rt_auto_is("autox") && !rt_auto_is("full") &&
              !rt_auto_is(""),
          "rt_auto_is");
    CHECK(rt_auto_parse("auto", &a, err, sizeof err) == 0 && a.floor == RT_AUTO_DEFAULT_FLOOR && !a.task[0], "auto");
    CHECK(rt_auto_parse("auto:floor=0.9,task=text", &a, err, sizeof err) == 0 && a.floor == 0.9 && !strcmp(a.task, "text"),
          "floor and task");
    CHECK(rt_auto_parse("auto:task=kv,floor=1", &a, err, sizeof err) == 0 && a.floor == 1.0 && !strcmp(a.task, "kv"),
          "either order");
    struct {
        const char *spec, *want;
    } bad[] = {
        {"auto:floor=0", "(0, 1]"}, {"auto:floor=1.01", "(0, 1]"}, {"auto:floor=-0.5", "(0, 1]"},
        {"auto:floor=nan", "(0, 1]"}, {"auto:floor=0.9x", "(0, 1]"}, {"auto:task=poem", "unknown task"},
        {"auto:budget=3", "unknown key"}, {"auto:floor", "key=value"}, {"auto:floor=", "empty"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        CHECK(rt_auto_parse(bad[i].spec, &a, err, sizeof err) == -1, "accepted %s", bad[i].spec);
        CHECK_ERR_HAS(err, bad[i].want);
    }
}

static void test_pressure(void)
{
    CHECK(rt_pressure_level(100, 100, 0) == RT_PRESSURE_LOW, "empty pools");
    CHECK(rt_pressure_level(50, 100, 0) == RT_PRESSURE_LOW, "half free");
    CHECK(rt_pressure_level(49, 100, 0) == RT_PRESSURE_MEDIUM, "under half");
    CHECK(rt_pressure_level(25, 100, 0) == RT_PRESSURE_MEDIUM, "a quarter");
    CHECK(rt_pressure_level(24, 100, 0) == RT_PRESSURE_HIGH, "under a quarter");
    CHECK(rt_pressure_level(100, 100, 1) == RT_PRESSURE_HIGH, "a queue");
    CHECK(rt_pressure_level(0, 0, 0) == RT_PRESSURE_LOW, "no decode node known");
    rt_pressure p;
    CHECK(rt_pressure_parse("medium", &p) == 0 && p == RT_PRESSURE_MEDIUM && !strcmp(rt_pressure_name(p), "medium"),
          "names");
    CHECK(rt_pressure_parse("extreme", &p) == -1, "unknown level");
}

/* kv and text lower bounds at 1000 cases: 1.0 -> 0.9973, 0.99 -> 0.9829, 0.97 -> 0.9590 */
static const pt synthetic[] = {
    {"streaming:sink=4,window=12", 256, 1.0, 1000, 0.97, 1000}, /* 16 entries: 0.959 */
    {"streaming:sink=4,window=28", 256, 0.5, 1000, 1.0, 1000}, /* 32: kv fails */
    {"streaming:sink=4,window=44", 256, 1.0, 20, 1.0, 20}, /* 48: 20 cases prove 0.88 only */
    {"streaming:sink=4,window=60", 256, 1.0, 1000, 1.0, 1000}, /* 64: 0.997 */
    {"full", 256, 1.0, 1000, 1.0, 1000},
    {"streaming:sink=4,window=124", 1024, 1.0, 1000, 0.0, 0}, /* no text score */
    {"heads:pattern=gates.tsv,sparsity=0.5", 256, 1.0, 5000, 1.0, 5000}, /* not servable here */
};

static int64_t blocks(const rt_calib *t, const char *spec, int prompt, int max_tokens)
{
    kr_policy *p = NULL;
    char err[KR_ERR_MAX];
    if (strcmp(spec, "full") != 0) REQUIRE(kr_policy_parse(spec, test_cfg(), &p, err) == KR_OK, "%s: %s", spec, err);
    int64_t b = kr_seq_blocks_bound(t->pool, p, 2, 2, prompt, max_tokens - 1);
    kr_policy_free(p);
    return b;
}

static void test_rule(void)
{
    int dropped;
    rt_calib *t = load(synthetic, (int)(sizeof synthetic / sizeof synthetic[0]), &dropped);
    CHECK(dropped == 1, "the heads point (no policy dir) is dropped: %d", dropped);
    rt_auto_choice c;

    /* floor 1: full at every level; low pressure: full at any floor */
    for (int l = 0; l < RT_PRESSURE_LEVELS; l++) {
        c = choose(t, "auto:floor=1", 200, 8, (rt_pressure)l);
        CHECK(!strcmp(c.spec, "full") && c.score == 1.0, "floor=1 at %s: %s", rt_pressure_name((rt_pressure)l), c.spec);
    }
    c = choose(t, "auto:floor=0.5", 200, 8, RT_PRESSURE_LOW);
    CHECK(!strcmp(c.spec, "full") && strstr(c.reason, "low pressure"), "low: %s (%s)", c.spec, c.reason);

    /* high: the fewest blocks at or above the floor; medium: half way from 1 to the floor */
    c = choose(t, "auto:floor=0.95", 200, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "streaming:sink=4,window=12") && c.score >= 0.95 && c.score < 0.96, "high: %s %.4f", c.spec,
          c.score);
    CHECK(c.length == 256 && c.blocks == blocks(t, c.spec, 200, 8) && c.full_blocks == blocks(t, "full", 200, 8) &&
              c.blocks < c.full_blocks,
          "blocks %lld of %lld", (long long)c.blocks, (long long)c.full_blocks);
    c = choose(t, "auto:floor=0.95", 200, 8, RT_PRESSURE_MEDIUM);
    CHECK(!strcmp(c.spec, "streaming:sink=4,window=60") && c.score >= 0.975, "medium: %s %.4f", c.spec, c.score);
    c = choose(t, "auto:floor=0.99", 200, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "streaming:sink=4,window=60"), "floor .99: %s", c.spec);
    /* 20 perfect cases do not prove 0.9: that point is never chosen above 0.88 */
    c = choose(t, "auto:floor=0.9,task=text", 200, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "streaming:sink=4,window=12"), "text at .9: %s", c.spec);
    c = choose(t, "auto:floor=0.85,task=kv", 200, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "streaming:sink=4,window=12"), "kv at .85: %s", c.spec);

    /* the floor is never crossed, and the choice has the fewest blocks of those that hold it */
    const char *tasks[] = {"", ",task=kv", ",task=text"};
    for (int l = 0; l < RT_PRESSURE_LEVELS; l++)
        for (int f = 1; f <= 100; f++)
            for (int k = 0; k < 3; k++)
                for (int prompt = 16; prompt <= 1100; prompt += 181) {
                    char spec[64];
                    snprintf(spec, sizeof spec, "auto:floor=%.2f%s", f / 100.0, tasks[k]);
                    c = choose(t, spec, prompt, 8, (rt_pressure)l);
                    double floor = f / 100.0;
                    CHECK(c.score >= floor, "%s at %d tokens, %s: %s scores %.4f", spec, prompt,
                          rt_pressure_name((rt_pressure)l), c.spec, c.score);
                    if (!strcmp(c.spec, "full") || l == RT_PRESSURE_LOW) continue;
                    double target = l == RT_PRESSURE_MEDIUM ? floor + (1 - floor) / 2 : floor;
                    int task = k == 0 ? -1 : k == 1 ? 0 : 1;
                    for (int i = 0; i < t->n_points; i++) {
                        const rt_calib_point *p = &t->points[i];
                        if (p->length != c.length || !p->policy || !strcmp(p->spec, "full")) continue;
                        if (!(guarantee(t, p, task) >= target)) continue;
                        CHECK(blocks(t, p->spec, prompt, 8) >= c.blocks, "%s: %s has fewer blocks than %s", spec,
                              p->spec, c.spec);
                    }
                }

    /* between buckets: the longer one; beyond the last: full; a bucket without the task's
     * scores: full, and with task=kv its own point */
    c = choose(t, "auto:floor=0.9", 900, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "full") && c.length == 1024 && strstr(c.reason, "no point at length 1024"), "900: %s (%s)",
          c.spec, c.reason);
    c = choose(t, "auto:floor=0.9,task=kv", 900, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "streaming:sink=4,window=124"), "900 kv: %s", c.spec);
    c = choose(t, "auto:floor=0.5,task=kv", 2000, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "full") && strstr(c.reason, "longer than every calibrated length"), "2000: %s (%s)", c.spec,
          c.reason);
    /* a prompt so short that full reserves no more than any point: full */
    c = choose(t, "auto:floor=0.5,task=kv", 10, 1, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "full") && strstr(c.reason, "fewer blocks than full"), "10 tokens: %s (%s)", c.spec, c.reason);

    /* a task the table does not score */
    rt_auto_ask ask;
    char err[512];
    REQUIRE(rt_auto_parse("auto:task=copy", &ask, err, sizeof err) == 0, "%s", err);
    CHECK(rt_auto_choose(t, &ask, 200, 8, RT_PRESSURE_HIGH, &c, err, sizeof err) == -1, "copy accepted");
    CHECK_ERR_HAS(err, "scores no such task");
    rt_calib_free(t);
}

static void test_ties(void)
{
    /* equal blocks (both keep 16 entries): the higher bound wins; equal bounds: the earlier */
    const pt tie[] = {
        {"streaming:sink=4,window=12", 256, 1.0, 500, 1.0, 500},
        {"streaming:sink=2,window=14", 256, 1.0, 900, 1.0, 900},
        {"streaming:sink=6,window=10", 256, 1.0, 900, 1.0, 900},
    };
    int dropped;
    rt_calib *t = load(tie, 3, &dropped);
    rt_auto_choice c = choose(t, "auto:floor=0.9", 200, 8, RT_PRESSURE_HIGH);
    CHECK(!strcmp(c.spec, "streaming:sink=2,window=14"), "tie: %s", c.spec);
    rt_calib_free(t);
}

int main(void)
{
    test_wilson();
    test_parse_errors();
    test_auto_syntax();
    test_pressure();
    test_rule();
    test_ties();
    if (kt_failures) return 1;
    printf("ok\n");
    return 0;
}
