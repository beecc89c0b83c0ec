/*
 * test_tokenizer.c - the tokenizer against the shared fixtures, plus fixture-free checks.
 *
 * With $KR_SHARED/fixtures/tokenizers present: for llama-bpe, qwen2, llama-spm (cases.jsonl,
 * cases_extra.jsonl) and tiny/<name>/tokenizer_cases.jsonl: exact ids, decode round trip (qwen2:
 * to the NFC form), the incremental detokenizer (deltas are valid UTF-8 and concatenate to the
 * full decode), BOS with add_special, special-token strings in text. The fixtures are read in
 * place, never copied. Without them the fixture part is skipped (exit 77) after the
 * fixture-free checks ran.
 * Fixture-free: hand-written tokenizer.json strings (bad-input messages, invalid UTF-8, byte
 * fallback, added-token lstrip/rstrip, detokenizer hold-back).
 * Run: ctest -R test_tokenizer (env KR_SHARED=.../shared).
 */
#include "kr-tokenizer.h"
#include "kr-util.h"
#include "kr_test.h"

#include <cjson/cJSON.h>
#include <utf8proc.h>

#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int valid_utf8(const char *s, size_t n)
{
    utf8proc_int32_t cp;
    for (size_t i = 0; i < n;) {
        utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(n - i), &cp);
        if (l <= 0) return 0;
        i += (size_t)l;
    }
    return 1;
}

static void fmt_ids(const int32_t *ids, int n, char *out, size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (int i = 0; i < n && o + 16 < cap; i++) o += (size_t)snprintf(out + o, cap - o, "%s%d", i ? " " : "", ids[i]);
}

/* Feeds ids one by one; checks every delta is valid UTF-8 and the concatenation equals full. */
static void check_detok(const kr_tokenizer *t, const int32_t *ids, int n, int skip, const char *full, const char *what)
{
    char err[KR_ERR_MAX];
    kr_detok *d;
    REQUIRE(kr_detok_create(t, skip, &d, err) == 0, "%s", err);
    size_t cap = strlen(full) + 64, o = 0;
    char *cat = malloc(cap);
    const char *delta;
    size_t dl;
    int ok = 1;
    for (int i = 0; i <= n && ok; i++) {
        int rc = i < n ? kr_detok_push(d, ids[i], &delta, &dl, err) : kr_detok_flush(d, &delta, &dl);
        CHECK(rc == 0, "%s: detok push %d: %s", what, i, err);
        if (rc) { ok = 0; break; }
        CHECK(valid_utf8(delta, dl), "%s: delta %d is not valid UTF-8", what, i);
        if (o + dl >= cap) { ok = 0; break; }
        memcpy(cat + o, delta, dl);
        o += dl;
    }
    cat[o] = 0;
    CHECK(ok && strcmp(cat, full) == 0, "%s: detok concatenation '%s' != decode '%s'", what, cat, full);
    free(cat);
    kr_detok_free(d);
}

typedef struct fam_stats {
    int cases, ids_ok, round_ok, round_checked;
} fam_stats;

/* nfc: compare the decode against the NFC form of the text. */
static void run_cases(const kr_tokenizer *t, const char *path, int nfc, fam_stats *st)
{
    char err[KR_ERR_MAX];
    char *data;
    size_t len;
    if (kr_read_file(path, &data, &len, err)) {
        CHECK(0, "%s", err);
        return;
    }
    char *line = data;
    int lineno = 0;
    while (line && *line) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = 0;
        lineno++;
        if (!*line) { line = nl ? nl + 1 : NULL; continue; }
        cJSON *c = cJSON_Parse(line);
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(c, "text");
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(c, "ids");
        REQUIRE(cJSON_IsString(text) && cJSON_IsArray(ids), "%s:%d: bad case line", path, lineno);
        int n_exp = cJSON_GetArraySize(ids);
        int32_t *exp = malloc(sizeof(int32_t) * (size_t)(n_exp + 1));
        for (int i = 0; i < n_exp; i++) exp[i] = (int32_t)cJSON_GetArrayItem(ids, i)->valuedouble;
        /* text may contain NULs? JSON \u0000 is not in the fixtures; strlen is the length. */
        const char *s = text->valuestring;
        size_t sl = strlen(s);
        int32_t *got;
        int n_got;
        st->cases++;
        char what[1400];
        snprintf(what, sizeof what, "%s:%d", path, lineno);
        if (kr_tokenizer_encode(t, s, sl, 0, &got, &n_got, err)) {
            CHECK(0, "%s: encode failed: %s", what, err);
        } else {
            int same = n_got == n_exp && (n_got == 0 || !memcmp(got, exp, sizeof(int32_t) * (size_t)n_got));
            if (!same) {
                char a[2048], b[2048];
                fmt_ids(got, n_got, a, sizeof a);
                fmt_ids(exp, n_exp, b, sizeof b);
                CHECK(0, "%s: text '%s'\n  got      [%s]\n  expected [%s]", what, s, a, b);
            } else {
                st->ids_ok++;
            }
            free(got);
        }
        char *dec;
        if (kr_tokenizer_decode(t, exp, n_exp, 0, &dec, err)) {
            CHECK(0, "%s: decode failed: %s", what, err);
        } else {
            char *want = nfc ? (char *)utf8proc_NFC((const utf8proc_uint8_t *)s) : (char *)s;
            st->round_checked++;
            if (strcmp(dec, want) == 0) st->round_ok++;
            else CHECK(0, "%s: decode '%s' != '%s'", what, dec, want);
            check_detok(t, exp, n_exp, 0, dec, what);
            if (nfc) free(want);
            free(dec);
        }
        free(exp);
        cJSON_Delete(c);
        line = nl ? nl + 1 : NULL;
    }
    free(data);
}

static void check_add_special(const kr_tokenizer *t, const char *fam, int32_t bos_expected)
{
    char err[KR_ERR_MAX];
    int32_t *a, *b;
    int na, nb;
    REQUIRE(kr_tokenizer_encode(t, "Hello world", 11, 0, &a, &na, err) == 0, "%s", err);
    REQUIRE(kr_tokenizer_encode(t, "Hello world", 11, 1, &b, &nb, err) == 0, "%s", err);
    if (bos_expected >= 0) {
        CHECK(nb == na + 1 && b[0] == bos_expected && !memcmp(a, b + 1, sizeof(int32_t) * (size_t)na),
              "%s: add_special should prepend only BOS %d (got %d ids, first %d)", fam, bos_expected, nb, nb ? b[0] : -1);
        CHECK(kr_tokenizer_bos(t) == bos_expected, "%s: bos %d", fam, kr_tokenizer_bos(t));
    } else {
        CHECK(nb == na && !memcmp(a, b, sizeof(int32_t) * (size_t)na), "%s: add_special should add nothing", fam);
    }
    free(a);
    free(b);
}

/* "<special>hello" maps to the special id, then the ids of the rest as encoded alone. */
static void check_special_in_text(const kr_tokenizer *t, const char *fam, const char *special, int32_t id)
{
    char err[KR_ERR_MAX], text[256];
    int32_t *a, *b;
    int na, nb;
    snprintf(text, sizeof text, "%shello", special);
    REQUIRE(kr_tokenizer_encode(t, text, strlen(text), 0, &a, &na, err) == 0, "%s", err);
    REQUIRE(kr_tokenizer_encode(t, "hello", 5, 0, &b, &nb, err) == 0, "%s", err);
    CHECK(na == nb + 1 && a[0] == id && !memcmp(a + 1, b, sizeof(int32_t) * (size_t)nb),
          "%s: '%s' should be [%d] + ids('hello') (got %d ids, first %d)", fam, text, id, na, na ? a[0] : -1);
    CHECK(kr_tokenizer_is_special(t, id), "%s: %d should be special", fam, id);
    /* decode keeps it unless skip_special */
    char *dec;
    REQUIRE(kr_tokenizer_decode(t, a, na, 0, &dec, err) == 0, "%s", err);
    CHECK(strstr(dec, special) == dec, "%s: decode '%s' should start with %s", fam, dec, special);
    check_detok(t, a, na, 0, dec, fam);
    free(dec);
    REQUIRE(kr_tokenizer_decode(t, a, na, 1, &dec, err) == 0, "%s", err);
    CHECK(strstr(dec, special) == NULL && strstr(dec, "hello"), "%s: skip_special decode '%s'", fam, dec);
    check_detok(t, a, na, 1, dec, fam);
    free(dec);
    /* out of range */
    int32_t bad = kr_tokenizer_n_vocab(t);
    CHECK(kr_tokenizer_decode(t, &bad, 1, 0, &dec, err) == -1, "%s: id %d should fail", fam, bad);
    CHECK_ERR_HAS(err, "out of range");
    free(a);
    free(b);
}

static void timing(const char *dir)
{
    char err[KR_ERR_MAX];
    kr_tokenizer *t;
    double t0 = now_s();
    REQUIRE(kr_tokenizer_load(dir, &t, err) == 0, "%s", err);
    double t1 = now_s();
    static const char para[] = "The quick brown fox jumps over the lazy dog. It's 2024, and naïve café "
                               "owners serve 你好 and emoji 🦙🚀 to   many\tpeople!\n";
    size_t n = 0, cap = 100 * 1024;
    char *text = malloc(cap + sizeof para);
    while (n + sizeof para - 1 <= cap) { memcpy(text + n, para, sizeof para - 1); n += sizeof para - 1; }
    int32_t *ids;
    int n_ids;
    double t2 = now_s();
    REQUIRE(kr_tokenizer_encode(t, text, n, 0, &ids, &n_ids, err) == 0, "%s", err);
    double t3 = now_s();
    char *dec;
    REQUIRE(kr_tokenizer_decode(t, ids, n_ids, 0, &dec, err) == 0, "%s", err);
    double t4 = now_s();
    CHECK(strlen(dec) == n && !memcmp(dec, text, n), "%s: 100 kB round trip", dir);
    printf("timing %s: load %.3f s, encode %zu bytes -> %d ids %.3f s, decode %.3f s\n", dir, t1 - t0, n, n_ids,
           t3 - t2, t4 - t3);
    free(dec);
    free(ids);
    free(text);
    kr_tokenizer_free(t);
}

static int fixture_tests(const char *shared)
{
    char dir[1024], path[1200], err[KR_ERR_MAX];
    struct stat sb;
    snprintf(dir, sizeof dir, "%s/fixtures/tokenizers", shared);
    if (stat(dir, &sb) != 0) {
        printf("test_tokenizer: %s absent: fixture checks SKIPPED\n", dir);
        return KT_SKIP;
    }
    static const struct {
        const char *name;
        int nfc;
        int32_t bos; /* BOS added by add_special, -1 none */
        const char *special;
        int32_t special_id;
    } fams[] = {
        {"llama-bpe", 0, 128000, "<|begin_of_text|>", 128000},
        {"qwen2", 1, -1, "<|im_start|>", 151644},
        {"llama-spm", 0, 1, "</s>", 2},
        {"tiny/llama3-tiny", 0, 509, "<|eot_id|>", 511},
        {"tiny/qwen2-tiny", 1, -1, "<|im_end|>", 511},
        {"tiny/mistral-tiny", 0, 1, "</s>", 2},
    };
    for (size_t f = 0; f < sizeof fams / sizeof fams[0]; f++) {
        kr_tokenizer *t;
        char fdir[1100];
        snprintf(fdir, sizeof fdir, "%s/%s", dir, fams[f].name);
        if (kr_tokenizer_load(fdir, &t, err)) {
            CHECK(0, "load %s: %s", fdir, err);
            continue;
        }
        fam_stats st = {0};
        static const char *files[] = {"cases.jsonl", "cases_extra.jsonl", "tokenizer_cases.jsonl"};
        for (int k = 0; k < 3; k++) {
            snprintf(path, sizeof path, "%s/%s", fdir, files[k]);
            if (stat(path, &sb) == 0) run_cases(t, path, fams[f].nfc, &st);
        }
        CHECK(st.cases > 0, "%s: no cases found", fams[f].name);
        check_add_special(t, fams[f].name, fams[f].bos);
        check_special_in_text(t, fams[f].name, fams[f].special, fams[f].special_id);
        printf("%-18s cases %3d: ids exact %3d, decode round trip %3d/%d\n", fams[f].name, st.cases, st.ids_ok,
               st.round_ok, st.round_checked);
        kr_tokenizer_free(t);
    }
    snprintf(path, sizeof path, "%s/llama-bpe", dir);
    timing(path);
    snprintf(path, sizeof path, "%s/llama-spm", dir);
    timing(path);
    return 0;
}

/* ------------------------------------------------------------------ fixture-free */

/* A tiny sentencepiece-style tokenizer: chars a, b, ▁, merges "a b" then "▁ ab", bytes for
 * byte fallback of é (C3 A9), unk. The marker @MERGES@ is replaced per test. */
static const char SPM_JSON[] =
    "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true},"
    "{\"id\":1,\"content\":\"<s>\",\"special\":true},{\"id\":2,\"content\":\"</s>\",\"special\":true},"
    "{\"id\":12,\"content\":\"<tool>\",\"special\":false,\"lstrip\":true,\"rstrip\":true}],"
    "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"},"
    "{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}]},"
    "\"pre_tokenizer\":null,"
    "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
    "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[1],\"tokens\":[\"<s>\"]}}},"
    "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"\\u2581\"},\"content\":\" \"},"
    "{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \",\"start\":1,\"stop\":0}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,\"byte_fallback\":true,"
    "\"vocab\":{\"<unk>\":0,\"<s>\":1,\"</s>\":2,\"<0xC3>\":3,\"<0xA9>\":4,\"<0xE4>\":5,\"a\":6,\"b\":7,\"\\u2581\":8,"
    "\"ab\":9,\"\\u2581ab\":10,\"<0x20>\":11},"
    "\"merges\":@MERGES@}}";

static int write_tok(const char *dir, const char *json)
{
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    fputs(json, f);
    fclose(f);
    return 0;
}

static char *spm_with(const char *merges)
{
    const char *at = strstr(SPM_JSON, "@MERGES@");
    size_t n = strlen(SPM_JSON) + strlen(merges);
    char *s = malloc(n);
    snprintf(s, n, "%.*s%s%s", (int)(at - SPM_JSON), SPM_JSON, merges, at + 8);
    return s;
}

/* Loads `json` from a fresh temp dir; returns the load's rc, message in err. */
static int load_json(const char *json, kr_tokenizer **t, char *err)
{
    char dir[] = "/tmp/kr_tok_XXXXXX";
    REQUIRE(mkdtemp(dir), "mkdtemp");
    REQUIRE(write_tok(dir, json) == 0, "write");
    int rc = kr_tokenizer_load(dir, t, err);
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    rmdir(dir);
    return rc;
}

static void expect_load_error(const char *json, const char *needle)
{
    char err[KR_ERR_MAX] = "";
    kr_tokenizer *t = NULL;
    int rc = load_json(json, &t, err);
    CHECK(rc == -1, "load should fail with '%s'", needle);
    if (rc == 0) kr_tokenizer_free(t);
    else {
        CHECK_ERR_HAS(err, needle);
        CHECK_ERR_HAS(err, "tokenizer.json");
    }
}

static void expect_ids(const kr_tokenizer *t, const char *text, int add, const int32_t *want, int n_want)
{
    char err[KR_ERR_MAX];
    int32_t *ids;
    int n;
    if (kr_tokenizer_encode(t, text, strlen(text), add, &ids, &n, err)) {
        CHECK(0, "encode '%s': %s", text, err);
        return;
    }
    char a[256], b[256];
    fmt_ids(ids, n, a, sizeof a);
    fmt_ids(want, n_want, b, sizeof b);
    CHECK(strcmp(a, b) == 0, "encode '%s': got [%s] want [%s]", text, a, b);
    free(ids);
}

static void expect_decode(const kr_tokenizer *t, const int32_t *ids, int n, int skip, const char *want)
{
    char err[KR_ERR_MAX], *s;
    if (kr_tokenizer_decode(t, ids, n, skip, &s, err)) {
        CHECK(0, "decode: %s", err);
        return;
    }
    CHECK(strcmp(s, want) == 0, "decode got '%s' want '%s'", s, want);
    check_detok(t, ids, n, skip, s, "hand-written");
    free(s);
}

static void fixture_free_tests(void)
{
    char err[KR_ERR_MAX];
    kr_tokenizer *t;
    char *json = spm_with("[\"a b\",[\"\\u2581\",\"ab\"]]");
    REQUIRE(load_json(json, &t, err) == 0, "%s", err);
    free(json);
    CHECK(kr_tokenizer_n_vocab(t) == 13, "n_vocab %d", kr_tokenizer_n_vocab(t));
    CHECK(kr_tokenizer_bos(t) == 1, "bos from template %d", kr_tokenizer_bos(t));
    {
        int32_t w1[] = {10, 8, 6}; /* ▁ab ▁ a */
        expect_ids(t, "ab a", 0, w1, 3);
        int32_t w2[] = {1, 10};
        expect_ids(t, "ab", 1, w2, 2);
        int32_t w3[] = {8, 3, 4, 0}; /* ▁ é(bytes) unk (fused: xyz -> one) */
        expect_ids(t, "éxyz", 0, w3, 4);
        int32_t w4[] = {10, 12, 10}; /* lstrip/rstrip eat the spaces around <tool> */
        expect_ids(t, "ab <tool> ab", 0, w4, 3);
        int32_t w5[] = {2};
        expect_ids(t, "</s>", 0, w5, 1);
        expect_ids(t, "", 1, (int32_t[]){1}, 1);
        expect_ids(t, "", 0, NULL, 0);
    }
    {
        /* decode: leading space stripped once; bytes fused; incomplete run -> one U+FFFD per byte */
        int32_t d1[] = {10, 8, 6};
        expect_decode(t, d1, 3, 0, "ab a");
        int32_t d2[] = {3, 4, 10};
        expect_decode(t, d2, 3, 0, "\xc3\xa9 ab");
        int32_t d3[] = {5, 3, 6};
        expect_decode(t, d3, 3, 0, "\xef\xbf\xbd\xef\xbf\xbd" "a");
        int32_t d4[] = {1, 10};
        expect_decode(t, d4, 2, 0, "<s> ab");
        expect_decode(t, d4, 2, 1, "ab");
        int32_t d5[] = {11, 11, 6}; /* <0x20><0x20>a: only the first space is stripped */
        expect_decode(t, d5, 3, 0, " a");
        int32_t bad[] = {6, 13};
        char *s;
        CHECK(kr_tokenizer_decode(t, bad, 2, 0, &s, err) == -1, "id 13 out of range");
        CHECK_ERR_HAS(err, "13");
        int32_t neg = -1;
        CHECK(kr_tokenizer_decode(t, &neg, 1, 0, &s, err) == -1, "id -1 out of range");
    }
    {
        /* detokenizer holds back é split over two byte tokens until the run ends */
        kr_detok *d;
        const char *delta;
        size_t dl;
        REQUIRE(kr_detok_create(t, 0, &d, err) == 0, "%s", err);
        CHECK(kr_detok_push(d, 3, &delta, &dl, err) == 0 && dl == 0, "held back");
        CHECK(kr_detok_push(d, 4, &delta, &dl, err) == 0 && dl == 0, "held back until run ends");
        CHECK(kr_detok_push(d, 6, &delta, &dl, err) == 0 && dl == 3 && !memcmp(delta, "\xc3\xa9" "a", 3), "é then a");
        CHECK(kr_detok_push(d, 99, &delta, &dl, err) == -1, "out of range id");
        CHECK_ERR_HAS(err, "99");
        CHECK(kr_detok_push(d, 5, &delta, &dl, err) == 0 && dl == 0, "E4 held");
        CHECK(kr_detok_flush(d, &delta, &dl) == 0 && dl == 3 && !memcmp(delta, "\xef\xbf\xbd", 3), "flush FFFD");
        kr_detok_free(d);
    }
    {
        /* invalid UTF-8 input */
        int32_t *ids;
        int n;
        static const char *bad[] = {"a\xff" "b", "\xc3", "\xed\xa0\x80", "ab\xe4\xbd"};
        for (int i = 0; i < 4; i++) {
            CHECK(kr_tokenizer_encode(t, bad[i], strlen(bad[i]), 0, &ids, &n, err) == -1, "invalid UTF-8 %d", i);
            CHECK_ERR_HAS(err, "not valid UTF-8");
        }
    }
    kr_tokenizer_free(t);

    /* malformed files */
    expect_load_error("{\"model\":", "invalid JSON");
    expect_load_error("[1,2]", "not a valid JSON object");
    expect_load_error("{\"added_tokens\":[]}", "\"model\" is missing");
    expect_load_error("{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", "model.type \"WordPiece\" is not supported");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":[],\"merges\":[]}}", "model.vocab");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":{}}}", "model.merges");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":\"x\"},\"merges\":[]}}", "model.vocab[\"a\"]");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a b\"]}}",
                      "model.merges[0]: merged token \"ab\" is not in model.vocab");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"ab\":1},\"merges\":[\"a c\"]}}",
                      "model.merges[0]: right token \"c\"");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"aa\"]}}", "model.merges[0]");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[7]}}", "model.merges[0]");
    expect_load_error("{\"normalizer\":{\"type\":\"Lowercase\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "normalizer type \"Lowercase\"");
    expect_load_error("{\"pre_tokenizer\":{\"type\":\"Whitespace\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "pre_tokenizer type \"Whitespace\"");
    expect_load_error("{\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},\"behavior\":\"Isolated\"},"
                      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}", "cannot compile regex");
    expect_load_error("{\"decoder\":{\"type\":\"WordPiece\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "decoder type \"WordPiece\"");
    expect_load_error("{\"post_processor\":{\"type\":\"BertProcessing\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "post_processor type \"BertProcessing\"");
    expect_load_error("{\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "model.unk_token \"<unk>\" is not in model.vocab");
    expect_load_error("{\"added_tokens\":{},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}", "added_tokens");
    expect_load_error("{\"added_tokens\":[{\"id\":\"x\"}],\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]}}",
                      "added_tokens");

    /* a missing directory names the file */
    CHECK(kr_tokenizer_load("/nonexistent/kr", &t, err) == -1, "missing dir");
    CHECK_ERR_HAS(err, "/nonexistent/kr/tokenizer.json");

    /* tokenizer_config.json errors name that file and field */
    json = spm_with("[]");
    CHECK(kr_tokenizer_parse(json, strlen(json), "x/tokenizer.json", "{\"bos_token\":\"<nope>\"}", 22,
                             "x/tokenizer_config.json", &t, err) == -1, "unknown bos");
    CHECK_ERR_HAS(err, "x/tokenizer_config.json: bos_token \"<nope>\"");
    const char *cfg = "{\"bos_token\":{\"content\":\"<s>\"},\"eos_token\":\"</s>\",\"add_bos_token\":false}";
    REQUIRE(kr_tokenizer_parse(json, strlen(json), "x/tokenizer.json", cfg, strlen(cfg), "x/tokenizer_config.json", &t, err) == 0,
            "%s", err);
    CHECK(kr_tokenizer_bos(t) == 1 && kr_tokenizer_eos(t) == 2, "bos/eos from config");
    expect_ids(t, "a", 1, (int32_t[]){8, 6}, 2); /* add_bos_token false overrides the template */
    kr_tokenizer_free(t);
    free(json);
}

int main(void)
{
    fixture_free_tests();
    const char *shared = kt_env("KR_SHARED");
    int rc = 0;
    if (!shared) {
        printf("test_tokenizer: KR_SHARED not set: fixture checks SKIPPED\n");
        rc = KT_SKIP;
    } else {
        rc = fixture_tests(shared);
    }
    if (kt_failures) return kt_done("test_tokenizer");
    if (rc == KT_SKIP) return KT_SKIP;
    return kt_done("test_tokenizer");
}
