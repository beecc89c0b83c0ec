/*
 * fuzz_openai.c - fuzz target for the OpenAI API's request parser (router/openai-request.c):
 * arbitrary bytes as the JSON body of /v1/completions (first byte's bits 0 and 1 clear),
 * /v1/chat/completions (bit 0 set), /tokenize (bit 1) or /detokenize (both), against the
 * default model's config, tokenizer and chat template (models/kjv-2l128-2k). Every outcome must
 * be a request within the model's limits and vLLM's field ranges (ids in the vocabulary,
 * min_tokens at most max_tokens, penalties in range, n and best_of in range, every prompt of a
 * list non-empty and within the context, logprobs' alternatives at most 20, echo and max_tokens 0
 * on completions only, a response_format that compiles or is refused naming its place) or a
 * refusal with a status and a message;
 * anything else aborts.
 * Run: ctest -R fuzz_openai, or build with -DKR_FUZZ=ON (clang) for libFuzzer.
 */
#include "../../router/openai-request.c"
#include "kr-grammar.h"

#include <stdint.h>

static oa_model model;

static void load_model(void)
{
    static kr_config cfg;
    static kr_tokenizer *tok;
    static kr_chat_template *chat;
    static char err[KR_ERR_MAX];
    const char *dir = KR_SOURCE_DIR "/models/kjv-2l128-2k";
    if (kr_config_load(dir, &cfg, err) != KR_OK || kr_tokenizer_load(dir, &tok, err) != KR_OK ||
        kr_chat_template_load(dir, &chat, err) != KR_OK) {
        fprintf(stderr, "fuzz_openai: %s: %s\n", dir, err);
        abort();
    }
    model = (oa_model){.name = "kjv", .dir = dir, .cfg = &cfg, .tok = tok, .chat = chat, .chat_error = "",
                       .max_tokens_limit = 4096};
}

/* A parsed generation request must be within the model's limits and vLLM's field ranges. */
static void check_request(const oa_request *r)
{
    const Kvrelay__V1__GenerateRequest *q = &r->q;
    size_t n = q->token_ids ? q->token_ids->n_ids : 0;
    if (q->prompt_case != KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS || n == 0 ||
        (q->max_tokens == 0 && !(r->echo && q->prompt_logprobs)) || q->top_logprobs > 20 ||
        (q->top_logprobs && !q->logprobs) || (q->prompt_logprobs && !r->echo) || (r->echo && r->kind == OA_CHAT) ||
        n + q->max_tokens > (size_t)model.cfg->max_position_embeddings || q->n_stop > OA_MAX_STOPS ||
        q->n_stop_ids > OA_MAX_STOP_IDS || q->min_tokens > q->max_tokens)
        abort();
    for (size_t i = 0; i < n; i++)
        if (q->token_ids->ids[i] >= (uint32_t)model.cfg->vocab_size) abort();
    for (size_t i = 0; i < q->n_stop_ids; i++)
        if (q->stop_ids[i] >= (uint32_t)model.cfg->vocab_size) abort();
    /* several choices and prompts: n <= best_of <= OA_MAX_N, the prompts non-empty, one after
     * the other in ids, each within the context with max_tokens, at most OA_MAX_GENERATIONS */
    if (r->n < 1 || r->best_of < r->n || r->best_of > OA_MAX_N || (r->best_of > r->n && r->stream) ||
        r->n_prompts < 1 || r->n_prompts * r->best_of > OA_MAX_GENERATIONS || r->prompt_at[0] != 0 ||
        r->prompt_at[1] != n || (r->kind == OA_CHAT && (r->n_prompts != 1 || r->best_of != r->n)))
        abort();
    for (int p = 0; p < r->n_prompts; p++) {
        size_t len = r->prompt_at[p + 1] - r->prompt_at[p];
        if (r->prompt_at[p + 1] <= r->prompt_at[p] || len + q->max_tokens > (size_t)model.cfg->max_position_embeddings)
            abort();
        for (size_t i = r->prompt_at[p]; i < r->prompt_at[p + 1]; i++)
            if (r->ids[i] >= (uint32_t)model.cfg->vocab_size) abort();
    }
    /* response_format: an object's JSON text, which the generation path compiles: it must
     * compile or be refused naming its place */
    if (q->response_format && *q->response_format) {
        cJSON *rf = cJSON_Parse(q->response_format);
        if (!cJSON_IsObject(rf)) abort();
        cJSON_Delete(rf);
        kr_grammar *g = NULL;
        char err[KR_ERR_MAX];
        if (kr_grammar_compile(q->response_format, strlen(q->response_format), NULL, &g, err) != 0 ?
            strncmp(err, "response_format", 15) != 0 : 0)
            abort();
        kr_grammar_free(g);
    }
    const Kvrelay__V1__Sampling *s = q->sampling;
    /* written so that NaN fails */
    if (!(s->repetition_penalty > 0.0f && s->repetition_penalty <= 100.0f) ||
        !(s->presence_penalty >= -2.0f && s->presence_penalty <= 2.0f) ||
        !(s->frequency_penalty >= -2.0f && s->frequency_penalty <= 2.0f))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!model.cfg) load_model();
    if (size == 0) return 0;
    /* bit 0: chat (or /detokenize); bit 1: /tokenize or /detokenize instead of a generation */
    int chat = data[0] & 1, tok_route = data[0] & 2;
    oa_request r;
    oa_refusal f;
    int rc;
    if (tok_route)
        rc = (chat ? oa_detokenize_parse : oa_tokenize_parse)(&model, (const char *)data + 1, size - 1, &r, &f);
    else
        rc = oa_request_parse(&model, chat ? OA_CHAT : OA_COMPLETION, (const char *)data + 1, size - 1, &r, &f);
    if (rc == 0 && tok_route) {
        for (size_t i = 0; i < r.prompt_ids.n_ids; i++)
            if (r.ids[i] >= (uint32_t)model.cfg->vocab_size) abort();
    } else if (rc == 0) {
        check_request(&r);
    } else if (!f.msg[0] || (f.http != 400 && f.http != 404 && f.http != 500) || !f.type) {
        abort();
    }
    oa_request_free(&r);
    return 0;
}
