/*
 * validate.c - a GenerateRequest checked and turned into an rt_req before anything is placed:
 * the request id (or a new one), the prompt tokenized and bounded by the model's context and
 * --max-prompt-tokens, max_tokens (and min_tokens) or the forced ids, the KV policy parsed (file
 * keys resolved by policy.c), sampling with a seed always present and its penalties in range,
 * stop strings and stop ids, the response_format schema. Every refusal is INVALID_ARGUMENT
 * (FAILED_PRECONDITION when the model lacks a tokenizer) naming the field.
 * Not the OpenAI API's own body checks (openai-request.c), which map onto these.
 * Tested by test_router_cluster (refusals) and tests/integration/openai_api.sh, openai_vllm.sh.
 */
#include "request.h"

#include "bundle.h"
#include "kr-grammar.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    RT_MAX_STOPS = 16,
    RT_MAX_STOP_LEN = 256,
    RT_MAX_STOP_IDS = 64,
};

void rt_request_id_new(rt_router *rt, char *out, size_t cap)
{
    snprintf(out, cap, "%s-%" PRIx64 "-%" PRIu64, rt->id, (uint64_t)rt->started_unix_ms,
             (uint64_t)atomic_fetch_add(&rt->next_request, 1));
}

/* 1 when s[0, n) is well-formed UTF-8 (shortest forms, no surrogates, at most U+10FFFF). */
static int utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + len > n) return 0;
        uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += len;
    }
    return 1;
}

/* A seed for a request that did not give one (splitmix64 of the clock and a counter). */
static uint64_t pick_seed(rt_router *rt)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    uint64_t z = (uint64_t)t.tv_nsec ^ ((uint64_t)t.tv_sec << 30) ^ (atomic_fetch_add(&rt->next_request, 0) << 17);
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}


/* The request id: the client's, printable ASCII, or a new one. */
static grpc_status_code check_id(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    size_t idlen = strlen(q->request_id);
    if (idlen > RT_REQUEST_ID_MAX)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "request_id: %zu bytes (at most %d)", idlen, RT_REQUEST_ID_MAX), st->code;
    for (size_t i = 0; i < idlen; i++)
        if (q->request_id[i] <= ' ' || q->request_id[i] > '~')
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "request_id: byte %zu is not printable ASCII (spaces are not allowed either)", i), st->code;
    if (idlen) snprintf(r->id, sizeof r->id, "%s", q->request_id);
    else rt_request_id_new(rt, r->id, sizeof r->id);
    return GRPC_STATUS_OK;
}

/* The prompt, tokenized when it is text, within the model's context and --max-prompt-tokens. */
static grpc_status_code check_prompt(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    const kr_config *cfg = &rt->cfg;
    char err[KR_ERR_MAX];
    if (q->prompt_case == KVRELAY__V1__GENERATE_REQUEST__PROMPT_TEXT) {
        if (!rt->tok)
            return kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION,
                              "prompt.text: the router's model %s has no tokenizer.json; send prompt.token_ids instead",
                              rt->model_dir), st->code;
        if (!q->text[0]) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.text: empty"), st->code;
        if (kr_tokenizer_encode(rt->tok, q->text, strlen(q->text), q->add_special, &r->prompt, &r->n_prompt, err) != KR_OK)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.text: %s", err), st->code;
        if (r->n_prompt == 0) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.text: no tokens"), st->code;
    } else if (q->prompt_case == KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS) {
        size_t n = q->token_ids->n_ids;
        if (n == 0) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.token_ids: empty"), st->code;
        if (n > (size_t)cfg->max_position_embeddings)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "prompt.token_ids: %zu tokens exceed the model's context (max_position_embeddings %d)",
                              n, cfg->max_position_embeddings), st->code;
        r->prompt = malloc(n * sizeof *r->prompt);
        if (!r->prompt) return kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory"), st->code;
        for (size_t i = 0; i < n; i++) {
            uint32_t id = q->token_ids->ids[i];
            if (id >= (uint32_t)cfg->vocab_size)
                return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                                  "prompt.token_ids[%zu]: %u is outside the model's vocabulary [0, %d)", i, id,
                                  cfg->vocab_size), st->code;
            r->prompt[i] = (int32_t)id;
        }
        r->n_prompt = (int)n;
    } else {
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt: missing (set prompt.text or prompt.token_ids)"), st->code;
    }
    int ctx_room = cfg->max_position_embeddings - 1; /* at least one position to generate into */
    if (r->n_prompt > ctx_room)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                          "prompt: %d tokens exceed the model's context (max_position_embeddings %d leaves room for %d)",
                          r->n_prompt, cfg->max_position_embeddings, ctx_room), st->code;
    if ((uint32_t)r->n_prompt > rt->max_prompt)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt: %d tokens > the router's limit %u (--max-prompt-tokens)",
                          r->n_prompt, rt->max_prompt), st->code;
    return GRPC_STATUS_OK;
}

/* The completion's length: max_tokens, or the forced ids of a scoring request. */
static grpc_status_code check_length(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    const kr_config *cfg = &rt->cfg;
    if (q->forced && q->forced->n_ids > 0) {
        /* scoring: the forced ids are the completion, so they fix its length */
        size_t n = q->forced->n_ids;
        if (q->max_tokens != 0 && q->max_tokens != n)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "max_tokens: %u, but forced has %zu ids (a forced request generates exactly its forced ids: set max_tokens to 0 or %zu)",
                              q->max_tokens, n, n), st->code;
        if (n > rt->max_tokens_limit)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "max_tokens: %zu (the length of forced) > the router's limit %u (--max-tokens-limit)", n,
                              rt->max_tokens_limit), st->code;
        if ((size_t)r->n_prompt + n > (size_t)cfg->max_position_embeddings)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "forced: %d prompt + %zu forced tokens exceed the model's context (max_position_embeddings %d)",
                              r->n_prompt, n, cfg->max_position_embeddings), st->code;
        for (size_t i = 0; i < n; i++)
            if (q->forced->ids[i] >= (uint32_t)cfg->vocab_size)
                return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                                  "forced.ids[%zu]: %u is outside the model's vocabulary [0, %d)", i, q->forced->ids[i],
                                  cfg->vocab_size), st->code;
        r->forced = q->forced->ids;
        r->max_tokens = (uint32_t)n;
    } else if (q->max_tokens == 0 && q->prompt_logprobs) {
        r->score_only = 1; /* the prompt's scores alone: a prefill, no decode (docs/rpc.md) */
        r->max_tokens = 0;
    } else {
        if (q->max_tokens == 0)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                                 "max_tokens: 0 (must be 1..%u; 0 only with prompt_logprobs)", rt->max_tokens_limit), st->code;
        if (q->max_tokens > rt->max_tokens_limit)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "max_tokens: %u > the router's limit %u (--max-tokens-limit)",
                              q->max_tokens, rt->max_tokens_limit), st->code;
        r->max_tokens = q->max_tokens;
    }
    if (q->top_logprobs > KR_TOP_LOGPROBS_MAX)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "top_logprobs: %u (at most %d)", q->top_logprobs,
                             KR_TOP_LOGPROBS_MAX), st->code;
    r->top_logprobs = q->top_logprobs;
    r->prompt_logprobs = q->prompt_logprobs;
    r->logprobs = q->logprobs || r->forced || r->top_logprobs > 0;
    if (!r->forced) { /* a forced request runs to its last id whatever EOS says */
        if (q->min_tokens > r->max_tokens)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "min_tokens: %u > max_tokens %u", q->min_tokens,
                                 r->max_tokens), st->code;
        r->min_tokens = q->min_tokens;
        r->ignore_eos = q->ignore_eos;
    }
    return GRPC_STATUS_OK;
}

/* The KV policy: file keys resolved, parsed, its family and entry bound kept. */
static grpc_status_code check_policy(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    const kr_config *cfg = &rt->cfg;
    char err[KR_ERR_MAX];
    kr_policy *p;
    /* none named: the router's --default-policy; auto: the spec the rule chooses (auto.c) */
    const char *spec = q->kv_policy[0] ? q->kv_policy : rt_auto_default(rt);
    if (rt_auto_is(spec)) {
        if (rt_auto_select(rt, r->id, spec, r->n_prompt, (int)r->max_tokens, &r->chosen, st) != GRPC_STATUS_OK)
            return st->code;
        spec = r->chosen.spec;
    }
    if (rt_policy_resolve(spec, rt->policy_dir, r->policy, sizeof r->policy, err, sizeof err) != 0 ||
        kr_policy_parse(r->policy[0] ? r->policy : "full", cfg, &p, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "kv_policy '%.64s': %s", spec, err), st->code;
    r->family = kr_policy_family(p);
    r->kv_entries_bound = (uint64_t)kr_policy_max_entries(p, r->n_prompt, (int)r->max_tokens) *
                          (uint64_t)cfg->n_layers * (uint64_t)cfg->n_kv_heads;
    kr_policy_free(p);
    return GRPC_STATUS_OK;
}

/* Sampling: absent = greedy; temperature 0 = greedy; top_p 0 = off; seed absent = ours. */
static grpc_status_code check_sampling(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    const kr_config *cfg = &rt->cfg;
    char err[KR_ERR_MAX];
    r->sampling = (Kvrelay__V1__Sampling)KVRELAY__V1__SAMPLING__INIT;
    if (q->sampling && !r->forced) { /* forcing ignores sampling: the nodes get greedy */
        r->sampling.temperature = q->sampling->temperature;
        r->sampling.top_p = q->sampling->top_p;
        r->sampling.top_k = q->sampling->top_k;
        r->sampling.repetition_penalty = q->sampling->repetition_penalty;
        r->sampling.presence_penalty = q->sampling->presence_penalty;
        r->sampling.frequency_penalty = q->sampling->frequency_penalty;
        if (q->sampling->seed_choice_case == KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED) {
            r->sampling.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
            r->sampling.seed = q->sampling->seed;
        }
    }
    if (r->sampling.seed_choice_case != KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED) {
        r->sampling.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
        r->sampling.seed = pick_seed(rt);
    }
    if (r->sampling.top_k > (uint32_t)cfg->vocab_size)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "sampling.top_k: %u > the vocabulary size %d",
                          r->sampling.top_k, cfg->vocab_size), st->code;
    kr_sampling ks;
    kr_sampling_default(&ks);
    ks.temperature = r->sampling.temperature;
    ks.greedy = !(r->sampling.temperature > 0);
    ks.top_p = r->sampling.top_p == 0 ? 1.0f : r->sampling.top_p;
    ks.top_k = (int)r->sampling.top_k;
    ks.seed = r->sampling.seed;
    if (kr_sampling_check(&ks, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "%s", err), st->code; /* "sampling: ..." */
    kr_penalties kp = {.repetition = r->sampling.repetition_penalty == 0.0f ? 1.0f : r->sampling.repetition_penalty,
                       .presence = r->sampling.presence_penalty,
                       .frequency = r->sampling.frequency_penalty};
    if (kr_penalties_check(&kp, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "sampling.%s", err), st->code;
    return GRPC_STATUS_OK;
}

/* Stop strings and stop ids (a forced request ignores them: it is scored to its last id), and
 * the detokenizer and stop matcher that use them. */
static grpc_status_code check_stops(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    const kr_config *cfg = &rt->cfg;
    char err[KR_ERR_MAX];
    size_t n_stop = r->forced ? 0 : q->n_stop;
    if (n_stop > RT_MAX_STOPS)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop: %zu strings (at most %d)", q->n_stop, RT_MAX_STOPS), st->code;
    if (n_stop && !rt->tok)
        return kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION,
                          "stop: stop strings need text, and the router's model %s has no tokenizer.json (use stop_ids)",
                          rt->model_dir), st->code;
    for (size_t i = 0; i < n_stop; i++) {
        size_t n = strlen(q->stop[i]);
        if (n == 0) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop[%zu]: empty", i), st->code;
        if (n > RT_MAX_STOP_LEN)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop[%zu]: %zu bytes (at most %d)", i, n, RT_MAX_STOP_LEN), st->code;
        if (!utf8_valid((const unsigned char *)q->stop[i], n))
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop[%zu]: not valid UTF-8", i), st->code;
    }
    size_t n_stop_ids = r->forced ? 0 : q->n_stop_ids;
    if (n_stop_ids > RT_MAX_STOP_IDS)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop_ids: %zu ids (at most %d)", q->n_stop_ids, RT_MAX_STOP_IDS), st->code;
    for (size_t i = 0; i < n_stop_ids; i++)
        if (q->stop_ids[i] >= (uint32_t)cfg->vocab_size)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop_ids[%zu]: %u is outside the model's vocabulary [0, %d)",
                              i, q->stop_ids[i], cfg->vocab_size), st->code;
    r->stop_ids = q->stop_ids;
    r->n_stop_ids = n_stop_ids;

    if (rt->tok && kr_detok_create(rt->tok, !q->keep_special_tokens, &r->detok, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INTERNAL, "detokenizer: %s", err), st->code;
    if (rt_stop_init(&r->stop, q->stop, (int)n_stop, q->include_stop_str_in_output) != 0)
        return kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory"), st->code;
    return GRPC_STATUS_OK;
}

/* The KV bundle's payload dtype on the wire: "" (the prefill node's default) or one kt_dtype_parse
 * knows, kept as the client spelled it for the prefill node to parse again. */
static grpc_status_code check_wire(const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    kt_dtype t;
    const char *w = q->kv_wire_dtype ? q->kv_wire_dtype : "";
    if (*w && (strlen(w) >= sizeof r->wire || kt_dtype_parse(w, &t) != 0))
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                             "kv_wire_dtype '%.32s' is not one of f32, bf16, f16, int8, fp8", w), st->code;
    snprintf(r->wire, sizeof r->wire, "%s", w);
    return GRPC_STATUS_OK;
}

/* Structured output: the response_format object compiled once to check it (the nodes compile
 * it again: no compiled form crosses the wire), and refused beside what asks for tokens after
 * the document or instead of sampled ones. Its errors name the keyword and where it is. */
static grpc_status_code check_format(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    const char *rf = q->response_format ? q->response_format : "";
    r->response_format = NULL;
    if (!*rf) return GRPC_STATUS_OK;
    char err[KR_ERR_MAX];
    kr_grammar *g = NULL;
    if (kr_grammar_compile(rf, strlen(rf), NULL, &g, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "%s%s",
                             strncmp(err, "response_format", 15) ? "response_format: " : "", err), st->code;
    if (!g) return GRPC_STATUS_OK; /* {"type": "text"} */
    kr_grammar_free(g);
    const char *with = r->forced ? "forced (a scoring request's tokens are given, not drawn)"
                       : r->ignore_eos ? "ignore_eos (the completion ends with its document)"
                       : r->min_tokens ? "min_tokens > 0 (the completion ends with its document)"
                                       : NULL;
    if (with)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "response_format: cannot be combined with %s", with),
               st->code;
    if (!rt->tok)
        return kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION,
                             "response_format: the router's model %s has no tokenizer.json (the mask is built from "
                             "its vocabulary)", rt->model_dir), st->code;
    r->response_format = rf;
    return GRPC_STATUS_OK;
}

grpc_status_code rt_req_validate(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st)
{
    /* the request id first, so every later message can carry it */
    grpc_status_code code = check_id(rt, q, r, st);
    if (code == GRPC_STATUS_OK) code = check_prompt(rt, q, r, st);
    if (code == GRPC_STATUS_OK) code = check_length(rt, q, r, st);
    if (code == GRPC_STATUS_OK) code = check_format(rt, q, r, st);
    if (code == GRPC_STATUS_OK) code = check_policy(rt, q, r, st);
    if (code == GRPC_STATUS_OK) code = check_wire(q, r, st);
    if (code == GRPC_STATUS_OK) code = check_sampling(rt, q, r, st);
    if (code == GRPC_STATUS_OK) code = check_stops(rt, q, r, st);
    return code;
}
