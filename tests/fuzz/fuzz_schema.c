/*
 * fuzz_schema.c - fuzz target for the structured-output compiler and matcher (engine/grammar*.c,
 * kr-grammar.h). Input: one byte of options (bit 0: a response_format object rather than a bare
 * schema; bit 1: tight limits; bits 2-7: how many bytes to choose at random before finishing),
 * then the JSON text. A refusal must carry a message naming its place. A compiled grammar must
 * then let a document be written byte by byte: some byte is always accepted until the document
 * may end, kr_matcher_remaining shrinks with the best byte, and the finished document parses and
 * is valid for the schema by tests/unit/grammar_check.h. On the way, the token mask over the
 * default model's vocabulary (models/kjv-2l128-2k) must equal the brute-force one, token by
 * token, and so must the budgeted mask (kr_grammar_mask_budget) with no byte to spare and with
 * one. Anything else aborts.
 * Run: ctest -R fuzz_schema, or build with -DKR_FUZZ=ON (clang) for libFuzzer.
 */
#include "../unit/grammar_check.h"
#include "kr-grammar.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DOC 4096 /* documents longer than this are not written out (a huge minLength) */

static kr_tokenizer *tok;
static kr_grammar_vocab *vocab;
static kr_grammar_scratch *scratch;
static uint32_t *mask;

static void load_vocab(void)
{
    char err[KR_ERR_MAX];
    const char *dir = KR_SOURCE_DIR "/models/kjv-2l128-2k";
    if (kr_tokenizer_load(dir, &tok, err) || kr_grammar_vocab_create(tok, NULL, 0, &vocab, err) ||
        kr_grammar_scratch_create(vocab, &scratch, err)) {
        fprintf(stderr, "fuzz_schema: %s: %s\n", dir, err);
        abort();
    }
    mask = malloc((size_t)(kr_grammar_vocab_n(vocab) + 31) / 32 * 4);
    if (!mask) abort();
}

/* The mask of m must be what feeding each token's bytes says. */
static void check_mask(const kr_matcher *m, kr_matcher *tmp)
{
    int count = kr_grammar_mask(vocab, m, scratch, mask), n = 0;
    int32_t eos = kr_tokenizer_eos(tok);
    for (int32_t id = 0; id < kr_grammar_vocab_n(vocab); id++) {
        const char *p;
        size_t len;
        int want;
        if (id == eos) want = kr_matcher_can_end(m);
        else if (kr_tokenizer_token_bytes(tok, id, &p, &len) || !len || kr_tokenizer_is_special(tok, id)) want = 0;
        else {
            kr_matcher_copy(tmp, m);
            want = kr_matcher_feed_bytes(tmp, p, len) == 0;
        }
        if (want != (int)(mask[id >> 5] >> (id & 31) & 1)) __builtin_trap();
        n += want;
    }
    if (n != count || count == 0) __builtin_trap();
    /* the budgeted mask, with no byte to spare and with one: of those tokens, the ones after
     * which at most `limit` bytes are left (all of them when none is) */
    static uint32_t *plain;
    size_t words = (size_t)(kr_grammar_vocab_n(vocab) + 31) / 32;
    if (!plain && !(plain = malloc(words * 4))) abort();
    memcpy(plain, mask, words * 4);
    uint32_t need = kr_matcher_remaining(m);
    for (int64_t budget = need ? need : 1; budget <= (int64_t)need + 1; budget++) {
        uint32_t limit = budget - 1 >= need ? (uint32_t)budget - 1 : need - 1;
        int got = kr_grammar_mask_budget(vocab, m, scratch, budget, mask), kept = 0;
        for (int pass = 0; pass < 2; pass++) { /* count, then compare */
            for (int32_t id = 0; id < kr_grammar_vocab_n(vocab); id++) {
                int want = plain[id >> 5] >> (id & 31) & 1;
                if (want) {
                    kr_matcher_copy(tmp, m);
                    want = kr_matcher_accept_token(tmp, vocab, id) == 0 && kr_matcher_remaining(tmp) <= limit;
                }
                if (pass == 0) kept += want;
                else if ((kept ? want : (int)(plain[id >> 5] >> (id & 31) & 1)) != (int)(mask[id >> 5] >> (id & 31) & 1))
                    __builtin_trap();
            }
        }
        if (got != (kept ? kept : count)) __builtin_trap();
    }
}

/* The schema the grammar was compiled from, as grammar_check.h reads it (owned by root). */
static const cJSON *schema_of(const cJSON *root, int format, cJSON **made)
{
    *made = NULL;
    if (!format) return root;
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(root, "json_schema");
    if (js) return cJSON_GetObjectItemCaseSensitive(js, "schema");
    return *made = cJSON_Parse("{\"type\":\"object\"}");
}

/* Writes a document: `random` bytes chosen by the input, then always the byte that leaves the
 * least to write. Checks the invariants on the way and the document at the end. */
static void write_document(const kr_grammar *g, const cJSON *schema, uint32_t seed, int random)
{
    kr_matcher *m, *tmp;
    if (kr_matcher_create(g, &m, NULL) || kr_matcher_create(g, &tmp, NULL)) abort();
    check_mask(m, tmp);
    static char doc[MAX_DOC + 1];
    int n = 0;
    for (;;) {
        uint32_t left = kr_matcher_remaining(m);
        if (left == 0) {
            if (!kr_matcher_can_end(m)) __builtin_trap();
            break;
        }
        if (kr_matcher_can_end(m)) __builtin_trap();
        if (n + (int64_t)left > MAX_DOC) goto out; /* too long to write out */
        int accepted[256], k = 0, best = -1;
        uint32_t best_left = UINT32_MAX;
        for (int c = 0; c < 256; c++) {
            kr_matcher_copy(tmp, m);
            if (kr_matcher_feed(tmp, (uint8_t)c)) continue;
            accepted[k++] = c;
            uint32_t l = kr_matcher_remaining(tmp);
            if (l < best_left) best_left = l, best = c;
        }
        if (!k || best_left >= left) __builtin_trap(); /* stuck, or no byte gets closer */
        int c = best;
        if (n < random) {
            seed = seed * 1103515245u + 12345u;
            c = accepted[(seed >> 16) % (uint32_t)k];
        }
        if (kr_matcher_feed(m, (uint8_t)c)) __builtin_trap();
        doc[n++] = (char)c;
        if (n == random) check_mask(m, tmp);
    }
    doc[n] = 0;
    const char *end = NULL;
    cJSON *v = cJSON_ParseWithOpts(doc, &end, 1);
    char why[256];
    if (!v || !gc_valid(schema, v, why)) {
        fprintf(stderr, "fuzz_schema: document %s is not valid (%s)\n", doc, v ? why : "does not parse");
        __builtin_trap();
    }
    cJSON_Delete(v);
out:
    kr_matcher_free(m);
    kr_matcher_free(tmp);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!vocab) load_vocab();
    if (size == 0) return 0;
    int format = data[0] & 1, random = data[0] >> 2;
    kr_grammar_limits tight = {.max_ws = 2, .max_string = 4, .max_int_digits = 2, .max_frac_digits = 1,
                               .max_exp_digits = 1, .max_depth = 3};
    const kr_grammar_limits *lim = data[0] & 2 ? &tight : NULL;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    char err[KR_ERR_MAX] = "";
    kr_grammar *g = NULL;
    int rc = format ? kr_grammar_compile(text, len, lim, &g, err) : kr_grammar_compile_schema(text, len, lim, &g, err);
    if (rc) {
        if (g || strncmp(err, format ? "response_format" : "schema", format ? 15 : 6)) __builtin_trap();
        return 0;
    }
    if (!g) { /* only {"type":"text"} */
        if (!format) __builtin_trap();
        return 0;
    }
    cJSON *root = cJSON_ParseWithLength(text, len), *made;
    const cJSON *schema = root ? schema_of(root, format, &made) : NULL;
    if (!schema) __builtin_trap(); /* it compiled: it is JSON */
    uint32_t seed = 0;
    for (size_t i = 0; i < size; i++) seed = seed * 31 + data[i];
    write_document(g, schema, seed, random);
    cJSON_Delete(made);
    cJSON_Delete(root);
    kr_grammar_free(g);
    return 0;
}
