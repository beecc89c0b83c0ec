/*
 * test_router_openai_vllm.c - the OpenAI request parser (router/openai-request.c) on vLLM's
 * extension fields and on strings holding U+0000, against the bundled model's tokenizer and chat
 * template: the bodies `vllm bench serve` sends (completions and chat) parse into the
 * GenerateRequest the gRPC API would get, every vLLM field lands in its GenerateRequest field,
 * bad values are refused naming the field, U+0000 anywhere in a key or a string (escaped or a
 * raw byte, nested in messages) is refused naming the top-level field while an escaped
 * backslash before "u0000" is text; /tokenize and /detokenize bodies parse as vLLM's do.
 * The end-to-end effects are tests/integration/openai_vllm.sh's. Run: ctest -R test_router_openai_vllm.
 */
#include "kr_test.h"

#include "../../router/openai-request.c"

static oa_model model;

static int parse(oa_kind kind, const char *body, oa_request *r, oa_refusal *f)
{
    return oa_request_parse(&model, kind, body, strlen(body), r, f);
}

/* body must parse; r is the caller's to free */
static void accepted(oa_kind kind, const char *body, oa_request *r)
{
    oa_refusal f;
    int rc = parse(kind, body, r, &f);
    CHECK(rc == 0, "refused (%u %s: %s): %s", f.http, f.param, f.msg, body);
}

/* body (completions and chat alike) must be a 400 naming param */
static void refused(oa_kind kind, const char *body, const char *param)
{
    oa_request r;
    oa_refusal f;
    int rc = parse(kind, body, &r, &f);
    CHECK(rc != 0 && f.http == 400 && !strcmp(f.param, param) && f.msg[0],
          "want 400 naming '%s', got rc %d, %u '%s' (%s): %s", param, rc, f.http, f.param, f.msg, body);
    oa_request_free(&r);
}

static void bench_bodies(void)
{
    oa_request r;
    accepted(OA_COMPLETION,
             "{\"model\": \"kjv\", \"prompt\": \"And God said\", \"repetition_penalty\": 1.0, \"max_tokens\": 12,"
             " \"logprobs\": null, \"stream\": true, \"stream_options\": {\"include_usage\": true}, \"ignore_eos\": true}",
             &r);
    CHECK(r.q.max_tokens == 12 && r.q.ignore_eos && r.stream && r.include_usage && r.q.min_tokens == 0 &&
              r.q.sampling->repetition_penalty == 1.0f && r.q.n_stop_ids == 0 && !r.q.keep_special_tokens,
          "vllm bench's completions body: max_tokens %u ignore_eos %d stream %d", r.q.max_tokens, r.q.ignore_eos,
          r.stream);
    oa_request_free(&r);
    accepted(OA_CHAT,
             "{\"model\": \"kjv\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
             "\"In the beginning\"}]}], \"max_completion_tokens\": 12, \"stream\": true, \"stream_options\": "
             "{\"include_usage\": true}, \"ignore_eos\": true}",
             &r);
    CHECK(r.q.max_tokens == 12 && r.q.ignore_eos && r.prompt_ids.n_ids > 0, "vllm bench's chat body");
    oa_request_free(&r);
}

static void fields(void)
{
    oa_request r;
    accepted(OA_COMPLETION,
             "{\"model\": \"kjv\", \"prompt\": [5, 6, 7], \"max_tokens\": 9, \"min_tokens\": 4, \"stop_token_ids\": [11, "
             "2046], \"presence_penalty\": -1.5, \"frequency_penalty\": 0.5, \"repetition_penalty\": 1.25, "
             "\"skip_special_tokens\": false, \"include_stop_str_in_output\": true, \"ignore_eos\": false}",
             &r);
    const Kvrelay__V1__Sampling *s = r.q.sampling;
    CHECK(r.q.min_tokens == 4 && r.q.n_stop_ids == 2 && r.q.stop_ids[0] == 11 && r.q.stop_ids[1] == 2046 &&
              r.q.keep_special_tokens && r.q.include_stop_str_in_output && !r.q.ignore_eos,
          "vLLM's fields: min_tokens %u, %zu stop ids, keep_special %d, include_stop %d", r.q.min_tokens,
          r.q.n_stop_ids, r.q.keep_special_tokens, r.q.include_stop_str_in_output);
    CHECK(s->presence_penalty == -1.5f && s->frequency_penalty == 0.5f && s->repetition_penalty == 1.25f,
          "penalties %g %g %g", s->presence_penalty, s->frequency_penalty, s->repetition_penalty);
    oa_request_free(&r);
    /* min_tokens may equal max_tokens; null is absent */
    accepted(OA_CHAT,
             "{\"model\": \"kjv\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 3, "
             "\"min_tokens\": 3, \"stop_token_ids\": null, \"repetition_penalty\": null}",
             &r);
    CHECK(r.q.min_tokens == 3 && r.q.sampling->repetition_penalty == 1.0f, "min_tokens = max_tokens");
    oa_request_free(&r);

    static const struct {
        const char *field, *value;
    } bad[] = {{"repetition_penalty", "0"}, {"repetition_penalty", "-0.5"}, {"repetition_penalty", "100.5"},
               {"repetition_penalty", "\"1\""}, {"presence_penalty", "2.01"}, {"presence_penalty", "-2.5"},
               {"frequency_penalty", "3"}, {"frequency_penalty", "true"}, {"min_tokens", "-1"},
               {"min_tokens", "2.5"}, {"min_tokens", "5"}, {"stop_token_ids", "[2211]"},
               {"stop_token_ids", "[-1]"}, {"stop_token_ids", "[1.5]"}, {"stop_token_ids", "7"},
               {"stop_token_ids", "[\"7\"]"}, {"ignore_eos", "1"}, {"skip_special_tokens", "\"no\""},
               {"include_stop_str_in_output", "0"}, {"min_token", "1"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char body[512];
        snprintf(body, sizeof body, "{\"model\": \"kjv\", \"prompt\": \"x\", \"max_tokens\": 4, \"%s\": %s}",
                 bad[i].field, bad[i].value);
        refused(OA_COMPLETION, body, bad[i].field);
        snprintf(body, sizeof body,
                 "{\"model\": \"kjv\", \"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"max_tokens\": 4, "
                 "\"%s\": %s}",
                 bad[i].field, bad[i].value);
        refused(OA_CHAT, body, bad[i].field);
    }
    /* 65 stop ids: one over the gRPC API's limit */
    char body[1024];
    int n = snprintf(body, sizeof body, "{\"model\": \"kjv\", \"prompt\": \"x\", \"stop_token_ids\": [1");
    for (int i = 1; i <= OA_MAX_STOP_IDS; i++) n += snprintf(body + n, sizeof body - (size_t)n, ", %d", i);
    snprintf(body + n, sizeof body - (size_t)n, "]}");
    refused(OA_COMPLETION, body, "stop_token_ids");
}

static void nul(void)
{
    refused(OA_COMPLETION, "{\"model\": \"kjv\", \"prompt\": \"And\\u0000 God\"}", "prompt");
    refused(OA_COMPLETION, "{\"model\": \"kjv\", \"prompt\": [\"\\u0000\"]}", "prompt");
    refused(OA_COMPLETION, "{\"model\": \"kjv\", \"prompt\": \"x\", \"stop\": [\"a\", \"\\u0000b\"]}", "stop");
    refused(OA_COMPLETION, "{\"model\": \"kjv\", \"prompt\": \"x\", \"kv_policy\": \"full\\u0000,x\"}", "kv_policy");
    refused(OA_COMPLETION, "{\"model\": \"kjv\\u0000\", \"prompt\": \"x\"}", "model");
    /* a key: named up to the NUL, before the unknown-field check could see "kv_policy" alone */
    refused(OA_COMPLETION, "{\"model\": \"kjv\", \"prompt\": \"x\", \"kv_policy\\u0000\": \"full\"}", "kv_policy");
    refused(OA_CHAT, "{\"model\": \"kjv\", \"messages\": [{\"role\": \"us\\u0000er\", \"content\": \"x\"}]}", "messages");
    refused(OA_CHAT,
            "{\"model\": \"kjv\", \"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": "
            "\"a\"}, {\"type\": \"text\", \"text\": \"\\u0000\"}]}], \"max_tokens\": 2}",
            "messages");
    /* a raw NUL byte inside a string (cJSON takes it as a character) */
    static const char raw[] = "{\"model\": \"kjv\", \"prompt\": \"a\0b\"}";
    oa_request r;
    oa_refusal f;
    int rc = oa_request_parse(&model, OA_COMPLETION, raw, sizeof raw - 1, &r, &f);
    CHECK(rc != 0 && f.http == 400 && !strcmp(f.param, "prompt"), "a raw NUL: rc %d, %u '%s'", rc, f.http, f.param);
    oa_request_free(&r);
    /* an escaped backslash then "u0000": text, served whole; and other escapes are no NUL */
    accepted(OA_COMPLETION, "{\"model\": \"kjv\", \"prompt\": \"a\\\\u0000\", \"stop\": \"\\\"\\u0001\"}", &r);
    CHECK(r.n_stops == 1 && !strcmp(r.stops[0], "\"\x01"), "escapes around a NUL look-alike");
    oa_request_free(&r);
}

static void tokenize_bodies(void)
{
    oa_request r;
    oa_refusal f;
    const char *b = "{\"model\": \"kjv\", \"prompt\": \"And God said\"}";
    CHECK(oa_tokenize_parse(&model, b, strlen(b), &r, &f) == 0, "%s", f.msg);
    int32_t *ids = NULL;
    int n = 0;
    char err[KR_ERR_MAX];
    REQUIRE(kr_tokenizer_encode(model.tok, "And God said", 12, 1, &ids, &n, err) == KR_OK, "%s", err);
    CHECK(r.prompt_ids.n_ids == (size_t)n && !memcmp(r.ids, ids, (size_t)n * sizeof *ids),
          "/tokenize: %zu ids, the tokenizer %d", r.prompt_ids.n_ids, n);
    free(ids);
    oa_request_free(&r);
    b = "{\"prompt\": \"And God said\", \"add_special_tokens\": false}";
    CHECK(oa_tokenize_parse(&model, b, strlen(b), &r, &f) == 0 && r.prompt_ids.n_ids == (size_t)n - 1,
          "/tokenize without special tokens: %zu ids", r.prompt_ids.n_ids);
    oa_request_free(&r);
    /* an empty prompt: the BOS alone with special tokens, nothing without */
    b = "{\"prompt\": \"\"}";
    CHECK(oa_tokenize_parse(&model, b, strlen(b), &r, &f) == 0 && r.prompt_ids.n_ids == 1 &&
              r.ids[0] == (uint32_t)kr_tokenizer_bos(model.tok),
          "/tokenize of an empty prompt: %zu ids (%s)", r.prompt_ids.n_ids, f.msg);
    oa_request_free(&r);
    b = "{\"prompt\": \"\", \"add_special_tokens\": false}";
    CHECK(oa_tokenize_parse(&model, b, strlen(b), &r, &f) == 0 && r.prompt_ids.n_ids == 0,
          "/tokenize of an empty prompt without special tokens: %zu ids (%s)", r.prompt_ids.n_ids, f.msg);
    oa_request_free(&r);
    b = "{\"messages\": [{\"role\": \"user\", \"content\": \"In the beginning\"}]}";
    CHECK(oa_tokenize_parse(&model, b, strlen(b), &r, &f) == 0 && r.prompt_ids.n_ids > 0, "/tokenize of messages");
    oa_request_free(&r);
    static const struct {
        const char *body, *param;
    } bad[] = {{"{\"prompt\": \"x\", \"messages\": []}", "prompt"}, {"{}", "prompt"},
               {"{\"prompt\": 5}", "prompt"}, {"{\"prompt\": \"x\", \"return_token_strs\": true}", "return_token_strs"},
               {"{\"prompt\": \"x\", \"add_generation_prompt\": true}", "add_generation_prompt"},
               {"{\"prompt\": \"x\\u0000\"}", "prompt"}, {"{\"prompt\": \"x\", \"truncate\": 1}", "truncate"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = oa_tokenize_parse(&model, bad[i].body, strlen(bad[i].body), &r, &f);
        CHECK(rc != 0 && f.http == 400 && !strcmp(f.param, bad[i].param), "/tokenize %s: %u '%s'", bad[i].body,
              f.http, f.param);
        oa_request_free(&r);
    }
    b = "{\"model\": \"other\", \"prompt\": \"x\"}";
    CHECK(oa_tokenize_parse(&model, b, strlen(b), &r, &f) != 0 && f.http == 404, "/tokenize of another model");
    oa_request_free(&r);
    b = "{\"tokens\": [2045, 5, 0]}";
    CHECK(oa_detokenize_parse(&model, b, strlen(b), &r, &f) == 0 && r.prompt_ids.n_ids == 3 && r.ids[0] == 2045,
          "/detokenize: %s", f.msg);
    oa_request_free(&r);
    static const char *const bad_detok[] = {"{\"tokens\": [2211]}", "{\"tokens\": [-1]}", "{\"tokens\": \"x\"}",
                                            "{\"tokens\": [1], \"prompt\": \"x\"}"};
    for (size_t i = 0; i < sizeof bad_detok / sizeof bad_detok[0]; i++) {
        int rc = oa_detokenize_parse(&model, bad_detok[i], strlen(bad_detok[i]), &r, &f);
        CHECK(rc != 0 && f.http == 400, "/detokenize %s: %u", bad_detok[i], f.http);
        oa_request_free(&r);
    }
}

int main(void)
{
    static kr_config cfg;
    kr_tokenizer *tok;
    kr_chat_template *chat;
    char err[KR_ERR_MAX], dir[4096];
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    snprintf(dir, sizeof dir, "%s/../../models/kjv-2l128-2k", fx);
    REQUIRE(kr_config_load(dir, &cfg, err) == KR_OK && kr_tokenizer_load(dir, &tok, err) == KR_OK &&
                kr_chat_template_load(dir, &chat, err) == KR_OK,
            "%s: %s", dir, err);
    REQUIRE(cfg.vocab_size == 2211, "the bundled model's vocabulary is %d, the cases assume 2211", cfg.vocab_size);
    model = (oa_model){.name = "kjv", .dir = dir, .cfg = &cfg, .tok = tok, .chat = chat, .chat_error = "",
                       .max_tokens_limit = 4096};
    bench_bodies();
    fields();
    nul();
    tokenize_bodies();
    kr_chat_template_free(chat);
    kr_tokenizer_free(tok);
    return kt_done("test_router_openai_vllm");
}
