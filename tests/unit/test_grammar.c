/*
 * test_grammar.c - structured output (engine/grammar*.c, kr-grammar.h): the compiler's
 * refusals (unsupported keywords and malformed schemas named with their place), the matcher
 * on hand-written documents, the mask against a brute-force one, and 200 random schemas of the
 * supported subset (seeded) each decoded by picking uniformly random allowed tokens of the
 * default model's vocabulary (models/kjv-2l128-2k) until an end token is picked: every answer
 * must decode (kr_tokenizer_decode) to text that cJSON parses and that grammar_check.h's
 * independent validator accepts. The mask's edges (end ids, logits, refused ids) too. With $KR_SHARED, a few also on Llama 2's 32k sentencepiece
 * vocabulary (byte fallback).
 * Run: ctest -R test_grammar (KR_GRAMMAR_SEED=N for another seed).
 */
#include "kr-grammar.h"
#include "grammar_check.h"
#include "kr_test.h"

#include <stdint.h>

/* ------------------------------------------------------------------ helpers */

static kr_grammar *schema(const char *text)
{
    char err[KR_ERR_MAX];
    kr_grammar *g = NULL;
    REQUIRE(kr_grammar_compile_schema(text, strlen(text), NULL, &g, err) == 0, "%s: %s", text, err);
    return g;
}

/* Feeds doc; the number of bytes accepted (strlen(doc) when all were). */
static size_t feed_prefix(kr_matcher *m, const char *doc)
{
    size_t i = 0;
    while (doc[i] && kr_matcher_feed(m, (uint8_t)doc[i]) == 0) i++;
    return i;
}

/* doc is a whole document of g (every byte accepted, may end there) or, with ok == 0, is
 * refused at byte `at` (-1: accepted but may not end). */
static void expect_doc(kr_grammar *g, const char *doc, int ok, int at)
{
    kr_matcher *m;
    REQUIRE(kr_matcher_create(g, &m, NULL) == 0, "matcher");
    size_t n = feed_prefix(m, doc);
    if (ok) {
        CHECK(n == strlen(doc) && kr_matcher_can_end(m), "'%s': accepted %zu bytes, can_end %d", doc, n,
              kr_matcher_can_end(m));
    } else if (at < 0) {
        CHECK(n == strlen(doc) && !kr_matcher_can_end(m), "'%s': should be an unfinished prefix (accepted %zu)", doc, n);
    } else {
        CHECK(n == (size_t)at && kr_matcher_dead(m), "'%s': refused at byte %zu, expected %d", doc, n, at);
    }
    kr_matcher_free(m);
}

static void expect_refused(const char *text, int response_format, const char *needle)
{
    char err[KR_ERR_MAX] = "";
    kr_grammar *g = NULL;
    int rc = response_format ? kr_grammar_compile(text, strlen(text), NULL, &g, err)
                             : kr_grammar_compile_schema(text, strlen(text), NULL, &g, err);
    CHECK(rc == -1 && g == NULL, "'%s' compiled", text);
    CHECK_ERR_HAS(err, needle);
    kr_grammar_free(g);
}

/* ------------------------------------------------------------------ compiler */

static void test_refusals(void)
{
    expect_refused("{\"type\":\"string\",\"pattern\":\"a+\"}", 0, "schema: keyword \"pattern\" is not supported");
    expect_refused("{\"type\":\"object\",\"properties\":{\"a\":{\"anyOf\":[]}}}", 0,
                   "schema.properties.a: keyword \"anyOf\"");
    expect_refused("{\"items\":{\"$ref\":\"#\"}}", 0, "schema.items: keyword \"$ref\"");
    expect_refused("{\"type\":\"number\",\"minimum\":0}", 0, "keyword \"minimum\"");
    expect_refused("{\"type\":\"string\",\"format\":\"date\"}", 0, "keyword \"format\"");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"object\","
                   "\"properties\":{\"a\":{\"oneOf\":[]}}}}}",
                   1, "response_format.json_schema.schema.properties.a: keyword \"oneOf\"");
    /* malformed */
    expect_refused("{\"type\":", 0, "schema: not valid JSON (at byte");
    expect_refused("{\"type\":\"object\"} x", 0, "unexpected bytes after the JSON value (at byte 18)");
    expect_refused("{\"type\":\"strin\"}", 0, "schema.type: expected one of");
    expect_refused("{\"type\":[]}", 0, "schema.type: expected a type name or a non-empty list");
    expect_refused("[1]", 0, "schema: expected a schema");
    expect_refused("false", 0, "schema: the schema false");
    expect_refused("{\"minLength\":3,\"maxLength\":2}", 0, "minLength > maxLength");
    expect_refused("{\"minItems\":-1}", 0, "schema.minItems: expected a non-negative integer");
    expect_refused("{\"maxItems\":1.5}", 0, "schema.maxItems: expected a non-negative integer");
    expect_refused("{\"items\":[{}]}", 0, "schema.items: a list of schemas (tuple form)");
    expect_refused("{\"properties\":[]}", 0, "schema.properties: expected an object");
    expect_refused("{\"required\":[\"a\"],\"additionalProperties\":false}", 0,
                   "schema.required: \"a\" is not in properties and additionalProperties is false");
    expect_refused("{\"required\":[\"a\",\"a\"]}", 0, "\"a\" is listed twice");
    expect_refused("{\"enum\":[]}", 0, "schema.enum: expected a non-empty list");
    expect_refused("{\"type\":\"integer\",\"enum\":[1.5,\"a\"]}", 0, "schema.enum: no value satisfies");
    expect_refused("{\"const\":\"ab\",\"maxLength\":1}", 0, "schema.const: no value satisfies");
    expect_refused("{\"properties\":{\"a\":{\"type\":\"object\",\"properties\":{\"b\":{\"items\":7}}}}}", 0,
                   "schema.properties.a.properties.b.items: expected a schema");
    expect_refused("{\"type\":\"object\",\"properties\":{\"a\":1,\"a\":2}}", 0, "schema.properties.a: expected a schema");
    expect_refused("{\"type\":\"object\",\"properties\":{\"a\":{},\"a\":{}}}", 0, "\"a\" appears twice");
    expect_refused("{\"const\":\"\xff\"}", 0, "invalid UTF-8 at byte 10");
    expect_refused("{\"enum\":[\"a\",[2e+340]]}", 0, "schema.enum: a number beyond the range of a double");
    /* nesting: 33 arrays in a row is one too many */
    char deep[2048] = "";
    for (int i = 0; i < 33; i++) strcat(deep, "{\"type\":\"array\",\"items\":");
    strcat(deep, "true");
    for (int i = 0; i < 33; i++) strcat(deep, "}");
    expect_refused(deep, 0, "an array or object nested deeper than 32 levels");
    strcpy(deep, "{\"type\":\"array\",\"items\":{\"const\":");
    for (int i = 0; i < 32; i++) strcat(deep, "[");
    for (int i = 0; i < 32; i++) strcat(deep, "]");
    strcat(deep, "}}");
    expect_refused(deep, 0, "schema.items.const: a value whose arrays and objects nest deeper than 32 levels");
    /* response_format's own fields */
    expect_refused("{\"type\":\"xml\"}", 1, "response_format.type: \"xml\" is not one of");
    expect_refused("{\"type\":\"json_schema\"}", 1, "response_format.json_schema: expected an object");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{}}}", 1, "response_format.json_schema.name");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a b\",\"schema\":{}}}", 1,
                   "response_format.json_schema.name");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\"}}", 1,
                   "response_format.json_schema.schema: required");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\",\"schema\":{},\"x\":1}}", 1,
                   "response_format.json_schema: field \"x\" is not supported");
    expect_refused("{\"type\":\"json_object\",\"schema\":{}}", 1, "response_format: field \"schema\" is not supported");
    expect_refused("{\"type\":\"json_object\",\"json_schema\":{}}", 1, "only with type \"json_schema\"");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"a\",\"strict\":1,\"schema\":{}}}", 1,
                   "response_format.json_schema.strict");
    /* limits */
    char err[KR_ERR_MAX];
    kr_grammar *g = NULL;
    kr_grammar_limits lim = {.max_ws = 256};
    CHECK(kr_grammar_compile_schema("{}", 2, &lim, &g, err) == -1 && !g, "max_ws 256 accepted");
    CHECK_ERR_HAS(err, "max_ws = 256 is outside [1, 255]");
    /* text: no grammar; json_object: a grammar */
    const char *text = "{\"type\":\"text\"}";
    g = (kr_grammar *)1;
    CHECK(kr_grammar_compile(text, strlen(text), NULL, &g, err) == 0 && g == NULL, "text: %s", err);
    const char *obj = "{\"type\":\"json_object\"}";
    CHECK(kr_grammar_compile(obj, strlen(obj), NULL, &g, err) == 0 && g != NULL, "json_object: %s", err);
    kr_grammar_free(g);
    const char *ok = "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"Person-1\",\"description\":\"d\","
                     "\"strict\":true,\"schema\":{\"type\":\"object\",\"title\":\"t\",\"description\":\"d\","
                     "\"$schema\":\"x\",\"default\":{},\"examples\":[]}}}";
    CHECK(kr_grammar_compile(ok, strlen(ok), NULL, &g, err) == 0 && g != NULL, "json_schema: %s", err);
    kr_grammar_free(g);
}

/* ------------------------------------------------------------------ matcher */

static void test_documents(void)
{
    kr_grammar *g = schema("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},"
                           "\"b\":{\"type\":\"string\",\"maxLength\":3}},\"required\":[\"a\"],"
                           "\"additionalProperties\":false}");
    expect_doc(g, "{\"a\":1}", 1, 0);
    expect_doc(g, " { \"b\" : \"xyz\" ,\n\t\"a\" : -0 } \n", 1, 0);
    expect_doc(g, "{\"a\":-12345}", 1, 0);
    expect_doc(g, "{}", 0, 1); /* a is required */
    expect_doc(g, "{\"b\":\"x\"}", 0, 8);
    expect_doc(g, "{\"a\":1.5}", 0, 6); /* integer */
    expect_doc(g, "{\"a\":01}", 0, 6);
    expect_doc(g, "{\"b\":\"abcd\"}", 0, 9); /* maxLength 3 */
    expect_doc(g, "{\"a\":1,\"a\":2}", 0, 8); /* a twice: no other key starts with a */
    expect_doc(g, "{\"c\":1}", 0, 2);
    expect_doc(g, "{\"a\":1,\"b\":\"\",", 0, 13); /* nothing left to add */
    expect_doc(g, "{\"a\":1", 0, -1);
    expect_doc(g, "{\"a\":1}x", 0, 7);
    kr_grammar_free(g);

    /* additional keys beside declared ones: a key spelled like a declared one is that one */
    g = schema("{\"properties\":{\"a\":{\"type\":\"integer\"},\"q\\\"\":{\"type\":\"null\"}}}");
    expect_doc(g, "{\"b\":\"s\",\"a\":1}", 1, 0);
    expect_doc(g, "{\"a\":\"s\"}", 0, 5);
    expect_doc(g, "{\"a\":1,\"a\":2}", 0, 9); /* the quote that would end a second a */
    expect_doc(g, "{\"ab\":[{}],\"q\\\"\":null}", 1, 0);
    expect_doc(g, "{\"q\\\"\":1}", 0, 7);
    expect_doc(g, "[1]", 1, 0); /* no type: anything, objects constrained */
    kr_grammar_free(g);

    g = schema("{\"type\":\"object\"}"); /* json_object */
    expect_doc(g, "{\"x\":[1,2.5e-3,{\"y\":null}],\"z\":\"\xc3\xa9\\u00e9\\n\",\"t\":true}", 1, 0);
    expect_doc(g, "[1]", 0, 0);
    expect_doc(g, "{\"a\":\"\\ud800\"}", 0, 9); /* lone surrogate */
    expect_doc(g, "{\"a\":\"\\u0000\"}", 0, 11);
    expect_doc(g, "{\"a\":\"\\u0001\\uD7FF\"}", 1, 0);
    expect_doc(g, "{\"a\":\"\xed\xa0\x80\"}", 0, 7); /* UTF-8 surrogate */
    expect_doc(g, "{\"a\":\"\xc0\xaf\"}", 0, 6); /* overlong */
    expect_doc(g, "{\"a\":\"\x01\"}", 0, 6); /* control character */
    expect_doc(g, "{\"a\":12345678901234567}", 0, 21); /* 17 digits */
    expect_doc(g, "{\"a\":1234567890123456.1234567890123456e-99}", 1, 0);
    expect_doc(g, "{\"a\":1e100}", 0, 9); /* 3 exponent digits */
    expect_doc(g, "{\"a\":tru}", 0, 8);
    char ws[64] = "{";
    memset(ws + 1, ' ', 32);
    expect_doc(g, strcat(ws, "}"), 1, 0);
    ws[33] = ' ';
    ws[34] = 0;
    expect_doc(g, ws, 0, 33); /* 33 spaces in a row */
    kr_grammar_free(g);

    g = schema("{\"enum\":[\"a\",\"ab\",1,12,{\"k\":[1]},null,\"\\\"\"]}");
    expect_doc(g, "\"ab\"", 1, 0);
    expect_doc(g, "\"a\"", 1, 0);
    expect_doc(g, "12", 1, 0);
    expect_doc(g, "1 ", 1, 0);
    expect_doc(g, "{\"k\":[1]}", 1, 0);
    expect_doc(g, "\"\\\"\"", 1, 0);
    expect_doc(g, "null", 1, 0);
    expect_doc(g, "2", 0, 0);
    expect_doc(g, "\"abc\"", 0, 3);
    expect_doc(g, "{ \"k\":[1]}", 0, 1); /* literals are written compactly */
    kr_grammar_free(g);

    g = schema("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":2},\"minItems\":1,"
               "\"maxItems\":2}");
    expect_doc(g, "[\"\xc3\xa9\\n\"]", 1, 0); /* characters, not bytes */
    expect_doc(g, "[\"abc\"]", 0, 4);
    expect_doc(g, "[\"\"]", 0, 2);
    expect_doc(g, "[]", 0, 1);
    expect_doc(g, "[\"a\",\"b\",", 0, 8);
    kr_grammar_free(g);

    g = schema("{\"type\":[\"boolean\",\"null\",\"number\"]}");
    expect_doc(g, "false", 1, 0);
    expect_doc(g, "null", 1, 0);
    expect_doc(g, "-0.5E+12", 1, 0);
    expect_doc(g, "\"x\"", 0, 0);
    expect_doc(g, "-", 0, -1);
    kr_grammar_free(g);

    /* copy: the two matchers go their own ways */
    g = schema("{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}");
    kr_matcher *a, *b;
    REQUIRE(kr_matcher_create(g, &a, NULL) == 0 && kr_matcher_create(g, &b, NULL) == 0, "matchers");
    CHECK(kr_matcher_feed_bytes(a, "[1,", 3) == 0, "prefix");
    kr_matcher_copy(b, a);
    CHECK(kr_matcher_feed_bytes(a, "2]", 2) == 0 && kr_matcher_can_end(a), "a");
    CHECK(kr_matcher_feed_bytes(b, "x", 1) == -1 && kr_matcher_dead(b) && !kr_matcher_dead(a), "b");
    kr_matcher_reset(b);
    CHECK(!kr_matcher_dead(b) && kr_matcher_feed_bytes(b, "[]", 2) == 0 && kr_matcher_can_end(b), "reset");
    kr_matcher_free(a);
    kr_matcher_free(b);
    kr_grammar_free(g);
}

/* ------------------------------------------------------------------ random schemas */

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) /* uniform in [0, n) */
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((rng_state >> 33) % n);
}

static const char *const names[] = {"a", "b", "name", "id", "x y", "q\"t", "\xc3\xa9t\xc3\xa9", "tab\t", "", "ab"};

static cJSON *random_value(int depth)
{
    switch (rnd(depth > 1 ? 6 : 8)) {
    case 0: return cJSON_CreateNull();
    case 1: return cJSON_CreateBool(rnd(2));
    case 2: return cJSON_CreateNumber((double)rnd(2000) - 1000);
    case 3: return cJSON_CreateNumber(((double)rnd(20000) - 10000) / 64);
    case 4:
    case 5: return cJSON_CreateString(names[rnd(10)]);
    case 6: {
        cJSON *a = cJSON_CreateArray();
        for (uint32_t i = rnd(3); i > 0; i--) cJSON_AddItemToArray(a, random_value(depth + 1));
        return a;
    }
    default: {
        cJSON *o = cJSON_CreateObject();
        for (uint32_t i = rnd(3); i > 0; i--) {
            const char *k = names[rnd(10)];
            if (!cJSON_GetObjectItemCaseSensitive(o, k)) cJSON_AddItemToObject(o, k, random_value(depth + 1));
        }
        return o;
    }
    }
}

static void maybe_count(cJSON *s, const char *lo_key, const char *hi_key, uint32_t lo_max, uint32_t span)
{
    uint32_t lo = 0;
    if (rnd(2)) cJSON_AddNumberToObject(s, lo_key, lo = rnd(lo_max + 1));
    if (rnd(2)) cJSON_AddNumberToObject(s, hi_key, lo + rnd(span + 1));
}

/* A schema of the supported subset; containers below depth 3 only. */
static cJSON *random_schema(int depth)
{
    static const char *const scalars[] = {"null", "boolean", "integer", "number", "string"};
    cJSON *s = cJSON_CreateObject();
    uint32_t kind = rnd(depth < 3 ? 11 : 7);
    if (rnd(8) == 0) cJSON_AddStringToObject(s, "description", "ignored");
    switch (kind) {
    case 0: /* anything */
        break;
    case 1:
    case 2:
        cJSON_AddStringToObject(s, "type", scalars[rnd(5)]);
        maybe_count(s, "minLength", "maxLength", 4, 12);
        break;
    case 3: { /* a list of types */
        cJSON *t = cJSON_AddArrayToObject(s, "type");
        for (int i = 0; i < 5; i++)
            if (rnd(2) || (i == 4 && !cJSON_GetArraySize(t))) cJSON_AddItemToArray(t, cJSON_CreateString(scalars[i]));
        if (depth < 3 && rnd(3) == 0) cJSON_AddItemToArray(t, cJSON_CreateString(rnd(2) ? "array" : "object"));
        maybe_count(s, "minLength", "maxLength", 3, 6);
        break;
    }
    case 4:
    case 5: { /* enum, possibly with a type that filters it */
        cJSON *e = cJSON_AddArrayToObject(s, "enum");
        for (uint32_t i = rnd(5) + 1; i > 0; i--) cJSON_AddItemToArray(e, random_value(depth));
        cJSON_AddItemToArray(e, cJSON_CreateString("fallback"));
        if (rnd(3) == 0) cJSON_AddStringToObject(s, "type", "string");
        break;
    }
    case 6:
        cJSON_AddItemToObject(s, "const", random_value(depth));
        break;
    case 7:
    case 8: {
        cJSON_AddStringToObject(s, "type", "array");
        if (rnd(4)) cJSON_AddItemToObject(s, "items", random_schema(depth + 1));
        maybe_count(s, "minItems", "maxItems", 2, 3);
        break;
    }
    default: {
        cJSON_AddStringToObject(s, "type", "object");
        cJSON *props = cJSON_AddObjectToObject(s, "properties");
        cJSON *req = cJSON_AddArrayToObject(s, "required");
        for (uint32_t i = rnd(4); i > 0; i--) {
            const char *k = names[rnd(10)];
            if (cJSON_GetObjectItemCaseSensitive(props, k)) continue;
            cJSON_AddItemToObject(props, k, random_schema(depth + 1));
            if (rnd(2)) cJSON_AddItemToArray(req, cJSON_CreateString(k));
        }
        uint32_t add = rnd(4);
        if (add == 1) cJSON_AddFalseToObject(s, "additionalProperties");
        if (add == 2) cJSON_AddTrueToObject(s, "additionalProperties");
        if (add == 3) cJSON_AddItemToObject(s, "additionalProperties", random_schema(3));
        if (add != 1 && rnd(4) == 0) cJSON_AddItemToArray(req, cJSON_CreateString("extra"));
        break;
    }
    }
    return s;
}

/* ------------------------------------------------------------------ masked decoding */

static int bit(const uint32_t *mask, int id) { return mask[id >> 5] >> (id & 31) & 1; }

/* The mask as its definition says, token by token: for the cross-check. */
static void brute_mask(const kr_tokenizer *tok, const kr_grammar_vocab *v, const kr_matcher *m, kr_matcher *tmp,
                       const int32_t *end, int n_end, uint32_t *out)
{
    int nv = kr_grammar_vocab_n(v);
    memset(out, 0, (size_t)(nv + 31) / 32 * 4);
    for (int32_t id = 0; id < nv; id++) {
        const char *p;
        size_t len;
        int is_end = 0;
        for (int k = 0; k < n_end; k++) is_end |= end[k] == id;
        if (is_end) {
            if (kr_matcher_can_end(m)) out[id >> 5] |= 1u << (id & 31);
            continue;
        }
        if (kr_tokenizer_token_bytes(tok, id, &p, &len) || !len || kr_tokenizer_is_special(tok, id)) continue;
        kr_matcher_copy(tmp, m);
        if (kr_matcher_feed_bytes(tmp, p, len) == 0) out[id >> 5] |= 1u << (id & 31);
    }
}

/* The budgeted mask's definition: of the brute-force mask `out`, the tokens after which at most
 * `limit` bytes are left to write; all of `out` when none is. */
static void brute_limit(const kr_grammar_vocab *v, const kr_matcher *m, kr_matcher *tmp, uint32_t limit,
                        uint32_t *out)
{
    int nv = kr_grammar_vocab_n(v), kept = 0;
    size_t words = (size_t)(nv + 31) / 32;
    uint32_t *all = malloc(words * 4);
    REQUIRE(all, "oom");
    memcpy(all, out, words * 4);
    for (int32_t id = 0; id < nv; id++) {
        if (!bit(out, id)) continue;
        kr_matcher_copy(tmp, m);
        if (kr_matcher_accept_token(tmp, v, id) == 0 && kr_matcher_remaining(tmp) <= limit) kept++;
        else out[id >> 5] &= ~(1u << (id & 31));
    }
    if (!kept) memcpy(out, all, words * 4);
    free(all);
}

typedef struct decoder {
    const kr_tokenizer *tok;
    kr_grammar_vocab *v;
    kr_grammar_scratch *s;
    const int32_t *end;
    int n_end;
    uint32_t *mask, *brute;
    int32_t *ids;
    int cap, budget; /* tokens in all; random ones, then finishing ones */
    int slack; /* > 0: kr_grammar_mask_budget with the shortest completion's bytes plus up to this
                  many tokens for the document, which must then be whole within them; < 0: 1 to
                  -slack tokens fewer than those bytes (only the masks are checked) */
    long steps, masks_checked;
    int refused, finished_random; /* schemas refused (contradictions); ends before the budget */
} decoder;

/* Past the budget of random tokens: the allowed token after which the document is shortest
 * to complete (kr_matcher_remaining), so that every run ends; it must make progress. */
static int32_t finishing_token(decoder *d, const kr_matcher *m, kr_matcher *tmp, const char *text)
{
    uint32_t before = kr_matcher_remaining(m), best = UINT32_MAX;
    int32_t best_id = -1;
    for (int32_t id = 0; id < kr_grammar_vocab_n(d->v); id++) {
        if (!bit(d->mask, id)) continue;
        kr_matcher_copy(tmp, m);
        CHECK(kr_matcher_accept_token(tmp, d->v, id) == 0, "allowed token %d refused", id);
        uint32_t left = kr_matcher_remaining(tmp);
        if (left < best || (left == best && kr_matcher_ended(tmp))) best = left, best_id = id; /* end first */
    }
    CHECK(best < before || (before == 0 && kr_matcher_can_end(m)), "no allowed token brings the end closer than %u bytes in\n%s", before, text);
    return best_id;
}

/* Decodes one document of the schema `text` with uniformly random allowed tokens (up to the
 * budget, then finishing ones) and checks it. `lim` keeps strings short so that the run stays
 * quick. */
static void decode_one(decoder *d, const char *text, const kr_grammar_limits *lim, int check_every)
{
    char err[KR_ERR_MAX];
    kr_grammar *g = NULL;
    if (kr_grammar_compile_schema(text, strlen(text), lim, &g, err)) {
        /* the generator makes contradictions only through enum/const filtering */
        CHECK(strstr(err, "no value satisfies") != NULL, "random schema refused: %s\n%s", err, text);
        d->refused++;
        return;
    }
    kr_matcher *m, *tmp;
    REQUIRE(kr_matcher_create(g, &m, err) == 0 && kr_matcher_create(g, &tmp, err) == 0, "%s", err);
    int n = 0, ended = 0;
    /* with a budget: the tokens the document may take, its shortest completion's bytes and some */
    int64_t need0 = kr_matcher_remaining(m), total = 0;
    if (d->slack > 0) total = need0 + rnd((uint32_t)d->slack + 1);
    if (d->slack < 0 && need0 > 1)
        total = need0 - 1 - rnd((uint32_t)(need0 - 1 < -d->slack ? need0 - 1 : -d->slack));
    if (d->slack < 0 && !total) { /* nothing to fall short of */
        kr_matcher_free(m);
        kr_matcher_free(tmp);
        kr_grammar_free(g);
        return;
    }
    while (n < d->cap) {
        int count = total ? kr_grammar_mask_budget(d->v, m, d->s, total - n, d->mask)
                          : kr_grammar_mask(d->v, m, d->s, d->mask);
        if (count <= 0) {
            CHECK(0, "no token allowed after %d tokens of\n%s", n, text);
            break;
        }
        if (check_every && d->steps % check_every == 0) {
            brute_mask(d->tok, d->v, m, tmp, d->end, d->n_end, d->brute);
            if (total) { /* as kr_grammar_mask_budget computes its limit */
                uint32_t need = kr_matcher_remaining(m);
                int64_t after = total - n - 1;
                brute_limit(d->v, m, tmp, after >= need ? (uint32_t)after : need - 1, d->brute);
            }
            CHECK(!memcmp(d->mask, d->brute, (size_t)(kr_grammar_vocab_n(d->v) + 31) / 32 * 4),
                  "mask differs from the brute-force one after %d tokens of\n%s", n, text);
            d->masks_checked++;
        }
        d->steps++;
        int r = (int)rnd((uint32_t)count), id = -1;
        for (int32_t i = 0; id < 0; i++)
            if (bit(d->mask, i) && r-- == 0) id = i;
        if (!total && n >= d->budget) id = finishing_token(d, m, tmp, text);
        if (kr_matcher_accept_token(m, d->v, id)) {
            CHECK(0, "allowed token %d refused", id);
            break;
        }
        if (kr_matcher_ended(m)) {
            ended = 1;
            d->finished_random += n < d->budget;
            break;
        }
        d->ids[n++] = id;
        if (total && (kr_matcher_closed(m) || n == total)) { /* as the decode node ends it */
            ended = kr_matcher_can_end(m);
            d->finished_random += ended;
            CHECK(ended || total < need0, "the document is not whole after its budget of %d tokens:\n%s", n, text);
            break;
        }
    }
    CHECK(ended || total < need0, "no end within %d tokens of\n%s", d->cap, text);
    char *out = NULL;
    REQUIRE(kr_tokenizer_decode(d->tok, d->ids, n, 1, &out, err) == 0, "decode: %s", err);
    const char *end = NULL;
    cJSON *doc = cJSON_ParseWithOpts(out, &end, 1);
    char why[256] = "";
    cJSON *sch = cJSON_Parse(text);
    if (ended) {
        CHECK(doc != NULL, "answer does not parse:\n%s\nschema: %s", out, text);
        CHECK(!doc || gc_valid(sch, doc, why), "answer not valid (%s):\n%s\nschema: %s", why, out, text);
    }
    cJSON_Delete(sch);
    cJSON_Delete(doc);
    free(out);
    kr_matcher_free(m);
    kr_matcher_free(tmp);
    kr_grammar_free(g);
}

static void decoder_init(decoder *d, const kr_tokenizer *tok, const int32_t *end, int n_end, int budget)
{
    char err[KR_ERR_MAX];
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->end = end;
    d->n_end = n_end;
    d->budget = budget;
    d->cap = budget + 2000;
    REQUIRE(kr_grammar_vocab_create(tok, end, n_end, &d->v, err) == 0, "%s", err);
    REQUIRE(kr_grammar_scratch_create(d->v, &d->s, err) == 0, "%s", err);
    size_t words = (size_t)(kr_grammar_vocab_n(d->v) + 31) / 32;
    d->mask = malloc(words * 4);
    d->brute = malloc(words * 4);
    d->ids = malloc((size_t)d->cap * sizeof *d->ids);
    REQUIRE(d->mask && d->brute && d->ids, "oom");
}

static void decoder_free(decoder *d)
{
    kr_grammar_vocab_free(d->v);
    kr_grammar_scratch_free(d->s);
    free(d->mask);
    free(d->brute);
    free(d->ids);
}

/* The mask's edges: end ids, logits, refused tokens. */
static void test_mask_api(const char *model_dir)
{
    char err[KR_ERR_MAX];
    kr_tokenizer *tok;
    REQUIRE(kr_tokenizer_load(model_dir, &tok, err) == 0, "%s", err);
    kr_grammar_vocab *v;
    kr_grammar_scratch *s;
    int32_t eos = kr_tokenizer_eos(tok), bad_end = kr_tokenizer_n_vocab(tok);
    CHECK(kr_grammar_vocab_create(tok, &bad_end, 1, &v, err) == -1, "end id past the vocabulary accepted");
    CHECK_ERR_HAS(err, "end id");
    REQUIRE(kr_grammar_vocab_create(tok, NULL, 0, &v, err) == 0 && kr_grammar_scratch_create(v, &s, err) == 0, "%s", err);
    int nv = kr_grammar_vocab_n(v);
    CHECK(nv == kr_tokenizer_n_vocab(tok), "n %d", nv);
    uint32_t *mask = calloc((size_t)(nv + 31) / 32, 4);
    float *logits = malloc((size_t)(nv + 8) * sizeof *logits);
    REQUIRE(mask && logits, "oom");
    kr_grammar *g = schema("{\"type\":\"boolean\"}");
    kr_matcher *m;
    REQUIRE(kr_matcher_create(g, &m, err) == 0, "%s", err);
    int32_t t_id = -1, x_id = -1;
    for (int32_t id = 0; id < nv; id++) {
        const char *p;
        size_t len;
        if (kr_tokenizer_token_bytes(tok, id, &p, &len)) continue;
        if (len == 1 && p[0] == 't') t_id = id;
        if (len == 1 && p[0] == 'x') x_id = id;
    }
    REQUIRE(t_id >= 0 && x_id >= 0 && eos >= 0, "single-byte tokens t, x and an EOS");
    int count = kr_grammar_mask(v, m, s, mask);
    CHECK(count > 0 && bit(mask, t_id) && !bit(mask, x_id) && !bit(mask, eos), "start of a boolean");
    for (int i = 0; i < nv + 8; i++) logits[i] = 1.0f;
    kr_grammar_mask_logits(mask, v, logits, nv + 8);
    CHECK(logits[t_id] == 1.0f && isinf(logits[x_id]) && isinf(logits[nv + 3]), "mask_logits");
    CHECK(kr_matcher_accept_token(m, v, eos) == -1 && kr_matcher_dead(m), "EOS before the document");
    CHECK(kr_grammar_mask(v, m, s, mask) == 0, "a dead matcher allows nothing");
    kr_matcher_reset(m);
    CHECK(kr_matcher_accept_token(m, v, x_id) == -1 && kr_matcher_dead(m), "x refused");
    kr_matcher_reset(m);
    CHECK(kr_matcher_feed_bytes(m, "tru", 3) == 0 && kr_matcher_remaining(m) == 1, "one byte left");
    CHECK(kr_matcher_feed(m, 'e') == 0 && kr_matcher_remaining(m) == 0 && kr_matcher_can_end(m), "true");
    kr_grammar_mask(v, m, s, mask);
    CHECK(bit(mask, eos), "EOS after the document");
    CHECK(kr_matcher_accept_token(m, v, eos) == 0 && kr_matcher_ended(m), "EOS accepted");
    CHECK(kr_grammar_mask(v, m, s, mask) == 0 && kr_matcher_accept_token(m, v, t_id) == -1, "nothing after the end");
    kr_matcher_reset(m);
    CHECK(kr_matcher_accept_token(m, v, -1) == -1 && kr_matcher_dead(m), "id -1");
    kr_matcher_free(m);
    kr_grammar_free(g);
    free(mask);
    free(logits);
    kr_grammar_scratch_free(s);
    kr_grammar_vocab_free(v);
    kr_tokenizer_free(tok);
}

static void test_random_decoding(const char *model_dir, uint64_t seed)
{
    char err[KR_ERR_MAX];
    kr_tokenizer *tok;
    REQUIRE(kr_tokenizer_load(model_dir, &tok, err) == 0, "%s", err);
    /* the default model stops at <|end_of_text|> and <|eot_id|> */
    int32_t end[2] = {kr_tokenizer_eos(tok), 2047};
    decoder d;
    decoder_init(&d, tok, end, 2, 300);
    kr_grammar_limits lim = {.max_string = 24, .max_ws = 8};
    rng_state = seed;
    for (int i = 0; i < 200; i++) {
        cJSON *s = random_schema(0);
        char *text = cJSON_PrintUnformatted(s);
        decode_one(&d, text, &lim, 5);
        free(text);
        cJSON_Delete(s);
    }
    /* the defaults too, and json_object */
    const char *obj = "{\"type\":\"object\"}";
    for (int i = 0; i < 3; i++) decode_one(&d, obj, NULL, 0);
    printf("test_grammar: %s: 203 schemas (%d refused: enum/const contradictions), %ld tokens, %d ended within "
           "%d random tokens, %ld masks checked against brute force\n", model_dir, d.refused, d.steps,
           d.finished_random, d.budget, d.masks_checked);
    CHECK(d.refused < 40, "%d of 203 random schemas refused", d.refused);
    decoder_free(&d);
    kr_tokenizer_free(tok);
}

/* kr_grammar_mask_budget: random schemas decoded with uniformly random allowed tokens within
 * a budget of the shortest completion's bytes plus 0-16 tokens; every document must be whole
 * when the budget is spent (or closed before), and parse and validate; every other mask must
 * equal its definition (brute force, then brute_limit). */
static void test_budget(const char *model_dir, uint64_t seed)
{
    char err[KR_ERR_MAX];
    kr_tokenizer *tok;
    REQUIRE(kr_tokenizer_load(model_dir, &tok, err) == 0, "%s", err);
    int32_t end[1] = {kr_tokenizer_eos(tok)};
    decoder d;
    decoder_init(&d, tok, end, 1, 300);
    d.slack = 16;
    kr_grammar_limits lim = {.max_string = 24, .max_ws = 8};
    rng_state = seed ^ 0xb0d9e7;
    int n = 100;
    for (int i = 0; i < n; i++) {
        cJSON *s = random_schema(0);
        char *text = cJSON_PrintUnformatted(s);
        decode_one(&d, text, &lim, 2);
        free(text);
        cJSON_Delete(s);
    }
    printf("test_grammar: budgets: %d schemas (%d refused), %d documents whole within their budget, %ld tokens\n", n,
           d.refused, d.finished_random, d.steps);
    CHECK(d.finished_random == n - d.refused, "%d of %d documents whole", d.finished_random, n - d.refused);
    /* budgets short of the shortest document: the masks bring the end as close as they can */
    long masks = d.masks_checked;
    d.slack = -24;
    for (int i = 0; i < 50; i++) {
        cJSON *s = random_schema(0);
        char *text = cJSON_PrintUnformatted(s);
        decode_one(&d, text, &lim, 1);
        free(text);
        cJSON_Delete(s);
    }
    printf("test_grammar: short budgets: 50 schemas, %ld masks checked against their definition\n",
           d.masks_checked - masks);
    decoder_free(&d);
    kr_tokenizer_free(tok);
}

/* Llama 2's sentencepiece vocabulary: byte-fallback tokens and '▁' spaces. */
static void test_spm(const char *shared, uint64_t seed)
{
    char dir[1024], err[KR_ERR_MAX];
    snprintf(dir, sizeof dir, "%s/fixtures/tokenizers/llama-spm", shared);
    kr_tokenizer *tok;
    if (kr_tokenizer_load(dir, &tok, err)) {
        printf("test_grammar: %s absent: sentencepiece run SKIPPED\n", dir);
        return;
    }
    int32_t end[1] = {kr_tokenizer_eos(tok)};
    decoder d;
    decoder_init(&d, tok, end, 1, 100);
    kr_grammar_limits lim = {.max_string = 16, .max_ws = 4};
    rng_state = seed ^ 0x5eed;
    for (int i = 0; i < 10; i++) {
        cJSON *s = random_schema(1);
        char *text = cJSON_PrintUnformatted(s);
        decode_one(&d, text, &lim, 50);
        free(text);
        cJSON_Delete(s);
    }
    printf("test_grammar: llama-spm: 10 documents, %ld tokens\n", d.steps);
    decoder_free(&d);
    kr_tokenizer_free(tok);
}

int main(void)
{
    const char *seed_env = kt_env("KR_GRAMMAR_SEED");
    uint64_t seed = seed_env ? strtoull(seed_env, NULL, 10) : 38;
    test_refusals();
    test_documents();
    const char *fx = kt_env("KR_FIXTURES");
    if (!fx) {
        printf("test_grammar: KR_FIXTURES not set: decoding runs SKIPPED\n");
        return kt_failures ? kt_done("test_grammar") : KT_SKIP;
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/../../models/kjv-2l128-2k", fx);
    test_mask_api(dir);
    test_random_decoding(dir, seed);
    test_budget(dir, seed);
    const char *shared = kt_env("KR_SHARED");
    if (shared) test_spm(shared, seed);
    return kt_done("test_grammar");
}
