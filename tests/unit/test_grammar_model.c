/*
 * test_grammar_model.c - structured output with a real model's logits: the default model
 * (models/kjv-2l128-2k, trained on the King James Bible, which has never seen JSON) decodes
 * under the mask (kr-grammar.h), greedy and sampled, for a few schemas; each answer must end
 * with EOS within the token budget and parse and validate (tests/unit/grammar_check.h). This is
 * the decode loop the decode node runs, mask before sampling and the matcher advanced by the
 * sampled token, in its smallest form. test_grammar covers the random schemas.
 * Run: ctest -R test_grammar_model
 */
#include "kr-grammar.h"
#include "grammar_check.h"
#include "kr_test.h"

#include <stdint.h>

#define MAX_TOKENS 600
#define BLOCK 16

static const char *const schemas[] = {
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":20},"
    "\"age\":{\"type\":\"integer\"},\"book\":{\"enum\":[\"Genesis\",\"Exodus\",\"Numbers\"]}},"
    "\"required\":[\"name\",\"age\",\"book\"],\"additionalProperties\":false}",
    "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":12},\"minItems\":2,"
    "\"maxItems\":3}",
    "{\"type\":\"object\",\"properties\":{\"verse\":{\"type\":\"object\",\"properties\":{"
    "\"chapter\":{\"type\":\"integer\"},\"text\":{\"type\":\"string\",\"maxLength\":40},"
    "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"chapter\",\"text\",\"ok\"],\"additionalProperties\":false}},"
    "\"required\":[\"verse\"],\"additionalProperties\":false}",
    "{\"type\":[\"number\",\"null\"]}",
    "{\"enum\":[\"light\",\"darkness\",{\"day\":1}]}",
};

typedef struct run {
    kr_model *model;
    kr_ctx *ctx;
    kr_tokenizer *tok;
    kr_grammar_vocab *v;
    kr_grammar_scratch *s;
    const kr_config *cfg;
    int32_t *prompt;
    int n_prompt;
} run;

/* One answer of `schema` after the prompt, with `sampling`; checked. Returns the tokens used. */
static int answer(run *r, const char *schema, const kr_sampling *sampling)
{
    char err[KR_ERR_MAX];
    kr_grammar_limits lim = {.max_string = 48};
    kr_grammar *g;
    REQUIRE(kr_grammar_compile_schema(schema, strlen(schema), &lim, &g, err) == 0, "%s", err);
    kr_matcher *m;
    REQUIRE(kr_matcher_create(g, &m, err) == 0, "%s", err);
    int total = r->n_prompt + MAX_TOKENS + BLOCK;
    int blocks = ((total + BLOCK - 1) / BLOCK) * r->cfg->n_layers * r->cfg->n_kv_heads;
    kr_kv_pool *pool;
    kr_seq *seq;
    kr_sampler *sp;
    REQUIRE(kr_ctx_kv_pool_create(r->ctx, BLOCK, blocks, &pool, err) == 0 &&
                kr_seq_create(pool, r->cfg->n_layers, r->cfg->n_kv_heads, &seq, err) == 0 &&
                kr_sampler_create(sampling, r->cfg->vocab_size, &sp, err) == 0,
            "%s", err);
    float *logits = malloc((size_t)r->cfg->vocab_size * sizeof *logits);
    uint32_t *mask = malloc((size_t)(kr_grammar_vocab_n(r->v) + 31) / 32 * 4);
    int32_t out[MAX_TOKENS];
    REQUIRE(logits && mask, "oom");
    REQUIRE(kr_prefill(r->ctx, seq, r->prompt, r->n_prompt, 64, KR_LOGITS_LAST, logits, err) == 0, "%s", err);
    int n = 0;
    while (n < MAX_TOKENS) {
        if (n > 0) REQUIRE(kr_forward(r->ctx, seq, &out[n - 1], 1, KR_LOGITS_LAST, logits, err) == 0, "%s", err);
        /* the decode node's step: mask, sample, advance */
        CHECK(kr_grammar_mask(r->v, m, r->s, mask) > 0, "nothing allowed after %d tokens", n);
        kr_grammar_mask_logits(mask, r->v, logits, r->cfg->vocab_size);
        int32_t id = kr_sampler_sample(sp, logits);
        if (kr_matcher_accept_token(m, r->v, id)) {
            CHECK(0, "sampled token %d refused", id);
            break;
        }
        if (kr_matcher_ended(m)) break;
        out[n++] = id;
    }
    CHECK(kr_matcher_ended(m), "no end within %d tokens: %s", MAX_TOKENS, schema);
    char *text = NULL;
    REQUIRE(kr_tokenizer_decode(r->tok, out, n, 1, &text, err) == 0, "%s", err);
    const char *end;
    cJSON *doc = cJSON_ParseWithOpts(text, &end, 1), *sch = cJSON_Parse(schema);
    char why[256] = "";
    CHECK(doc && gc_valid(sch, doc, why), "answer %s (%s) for %s", text, doc ? why : "does not parse", schema);
    size_t ws = 0, len = strlen(text);
    for (size_t i = 0; i < len; i++) ws += text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == '\r';
    char *compact = doc ? cJSON_PrintUnformatted(doc) : NULL;
    printf("test_grammar_model: %s %3d tokens, %4zu bytes (%4zu whitespace): %s\n", sampling->greedy ? "greedy " : "sampled",
           n, len, ws, compact ? compact : "-");
    free(compact);
    cJSON_Delete(doc);
    cJSON_Delete(sch);
    free(text);
    free(logits);
    free(mask);
    kr_sampler_free(sp);
    kr_seq_free(seq);
    kr_kv_pool_free(pool);
    kr_matcher_free(m);
    kr_grammar_free(g);
    return n;
}

int main(void)
{
    const char *fx = kt_env("KR_FIXTURES");
    if (!fx) {
        printf("test_grammar_model: KR_FIXTURES not set: SKIPPED\n");
        return KT_SKIP;
    }
    char dir[1024], err[KR_ERR_MAX];
    snprintf(dir, sizeof dir, "%s/../../models/kjv-2l128-2k", fx);
    run r = {0};
    kr_model_opts mo = {0};
    REQUIRE(kr_model_load(dir, &mo, &r.model, err) == 0, "%s", err);
    r.cfg = kr_model_config(r.model);
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 1};
    REQUIRE(kr_ctx_create(r.model, &cp, &r.ctx, err) == 0, "%s", err);
    REQUIRE(kr_tokenizer_load(dir, &r.tok, err) == 0, "%s", err);
    int32_t end[2] = {kr_tokenizer_eos(r.tok), 2047}; /* <|end_of_text|>, <|eot_id|> */
    REQUIRE(kr_grammar_vocab_create(r.tok, end, 2, &r.v, err) == 0 && kr_grammar_scratch_create(r.v, &r.s, err) == 0,
            "%s", err);
    const char *prompt = "And God said unto Moses, Write the record of the book:";
    REQUIRE(kr_tokenizer_encode(r.tok, prompt, strlen(prompt), 1, &r.prompt, &r.n_prompt, err) == 0, "%s", err);
    int tokens = 0;
    for (size_t i = 0; i < sizeof schemas / sizeof *schemas; i++) {
        kr_sampling greedy = {.greedy = 1}, sampled;
        kr_sampling_default(&sampled);
        sampled.seed = 38 + i;
        tokens += answer(&r, schemas[i], &greedy);
        tokens += answer(&r, schemas[i], &sampled);
    }
    printf("test_grammar_model: %zu answers, %d tokens\n", 2 * sizeof schemas / sizeof *schemas, tokens);
    free(r.prompt);
    kr_grammar_scratch_free(r.s);
    kr_grammar_vocab_free(r.v);
    kr_tokenizer_free(r.tok);
    kr_ctx_free(r.ctx);
    kr_model_free(r.model);
    return kt_done("test_grammar_model");
}
