/*
 * openai.h - the OpenAI API's request bodies (router/openai-request.c): JSON in, a
 * kvrelay.v1.GenerateRequest out, or a refusal naming the field and the HTTP status. Pure: no
 * network and no router state, so that the fuzz target fuzz_openai can drive it; the HTTP side
 * (routes, streams, answers) is openai.c. docs/openai.md lists the fields and their rules.
 * Test: tests/integration/openai_api.sh and openai_vllm.sh (through the router),
 * ctest -R 'fuzz_openai|test_router_openai_vllm'.
 */
#ifndef RT_OPENAI_H
#define RT_OPENAI_H

#include "kr.h"

#include "kvrelay/v1/kvrelay.pb-c.h"

#include <stddef.h>
#include <stdint.h>

enum {
    OA_MAX_STOPS = 16,          /* stop strings (the gRPC API's limit) */
    OA_MAX_STOP_IDS = 64,       /* stop_token_ids (the gRPC API's limit on stop_ids) */
    OA_DEFAULT_MAX_TOKENS = 16, /* completions without max_tokens, as OpenAI's API */
    OA_MAX_N = 16,              /* n and best_of: choices (candidates) per prompt */
    OA_MAX_GENERATIONS = 64,    /* prompts x max(n, best_of): the generations one request runs */
};

typedef enum oa_kind { OA_COMPLETION, OA_CHAT } oa_kind;

/* What the parser knows of the served model (borrowed). */
typedef struct oa_model {
    const char *name;               /* the id a request's "model" must be */
    const char *dir;                /* the model directory, for messages */
    const kr_config *cfg;           /* context and vocabulary */
    const kr_tokenizer *tok;        /* NULL: token-id prompts only */
    const kr_chat_template *chat;   /* NULL: chat is refused with chat_error */
    const char *chat_error;
    uint32_t max_tokens_limit;      /* the router's --max-tokens-limit */
} oa_model;

/* A parsed request. `q` points into the struct itself: do not move it once parsed. */
typedef struct oa_request {
    oa_kind kind;
    int stream, include_usage;
    char policy[1024]; /* kv_policy as given ("" = full) */
    char wire[16]; /* kv_wire_dtype as given ("" = the prefill node's --kv-dtype); the router
                      checks its value as for gRPC */
    Kvrelay__V1__GenerateRequest q; /* q.request_id is the caller's to set */
    Kvrelay__V1__Sampling sampling;
    Kvrelay__V1__TokenIds prompt_ids;
    uint32_t *ids; /* the prompt, malloc'd */
    char *stops[OA_MAX_STOPS];
    int n_stops;
    uint32_t stop_ids[OA_MAX_STOP_IDS]; /* stop_token_ids */
    int n_stop_ids;
    int ignore_eos, keep_special, include_stop; /* ignore_eos, !skip_special_tokens,
                                                    include_stop_str_in_output */
    /* Several choices and prompts (router/openai-choices.c runs them): every prompt gets n
     * choices, drawn from best_of candidates (best_of = n: all of them). The prompts lie one
     * after the other in ids: prompt i is ids[prompt_at[i], prompt_at[i + 1]); q's prompt is
     * prompt 0. */
    int n, best_of;
    int n_prompts;
    size_t prompt_at[OA_MAX_GENERATIONS + 1];
    int logprobs; /* -1: none; else the alternatives per token (completions' logprobs, chat's
                     top_logprobs with logprobs true) */
    int echo;     /* completions: the prompt comes back before the completion */
    char *response_format; /* the response_format object's compact JSON (cJSON_free), or NULL */
} oa_request;

/* Why a request was refused: the HTTP status, OpenAI's error type and code (static strings,
 * code may be NULL), the field ("" = none) and the message. */
typedef struct oa_refusal {
    unsigned http;
    const char *type, *code;
    char param[64]; /* a copy: it may name a key of the request's JSON */
    char msg[1024];
} oa_refusal;

/* Parses `len` bytes of `body` as a request of `kind` for model m into *r (which the caller
 * frees with oa_request_free whatever this returns). Returns 0, or -1 with *f filled: 400 for
 * bad input (malformed JSON, a missing, mistyped, unknown or unsupported field, a value out of
 * its range, a string holding U+0000 (cJSON would cut it there), a prompt that does not
 * tokenize, prompt + max_tokens over the context (for every prompt of a list), n or best_of out
 * of range, more than OA_MAX_GENERATIONS generations, a chat template's raise_exception), 404 for another model, 500 when the model's chat template fails.
 * Temperature, top_p and top_k ranges, the policy spec and stop strings are left to the
 * generation path to check; the penalties and vLLM's fields are checked here. */
int oa_request_parse(const oa_model *m, oa_kind kind, const char *body, size_t len, oa_request *r, oa_refusal *f);
/* POST /tokenize, vLLM's shapes: {"prompt": text, "add_special_tokens"} (default true) or
 * {"messages", "add_generation_prompt", "add_special_tokens"} (default false: the template
 * writes them), "model" optional. On 0 the ids are r->ids[0, r->prompt_ids.n_ids) (none for an
 * empty prompt). Refusals as oa_request_parse's. */
int oa_tokenize_parse(const oa_model *m, const char *body, size_t len, oa_request *r, oa_refusal *f);
/* POST /detokenize: {"tokens": [ids]}, "model" optional; the ids into r as oa_tokenize_parse's. */
int oa_detokenize_parse(const oa_model *m, const char *body, size_t len, oa_request *r, oa_refusal *f);
void oa_request_free(oa_request *r);

#endif /* RT_OPENAI_H */
