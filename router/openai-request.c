/*
 * openai-request.c - the OpenAI API's request bodies (openai.h): every field checked by name
 * and type against what docs/openai.md lists (vLLM's extensions included), unknown ones refused
 * as OpenAI refuses them, a string holding U+0000 refused, the prompt tokenized (a chat's
 * messages rendered with the model's chat template first), and a kvrelay.v1.GenerateRequest
 * built for the generation path the gRPC API takes. Also vLLM's /tokenize and /detokenize bodies.
 * Not here: what needs the cluster (the policy spec, sampling ranges and stop strings are
 * checked by rt_generate_run, so that both APIs refuse them alike).
 */
#include "openai.h"

#include <cjson/cJSON.h>

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The request fields each endpoint knows; any other is refused, as OpenAI does, so that a typo
 * is not silently ignored. VLLM_FIELDS: vLLM's sampling extensions, on both endpoints. */
#define VLLM_FIELDS                                                                                      \
    "ignore_eos", "min_tokens", "repetition_penalty", "stop_token_ids", "skip_special_tokens",        \
        "include_stop_str_in_output"
static const char *const completion_fields[] = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "user", "echo", "logprobs", "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias",
    "kv_policy", "kv_wire_dtype", "top_k", "add_special_tokens", "response_format", VLLM_FIELDS, NULL};
static const char *const chat_fields[] = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "user", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls", "store", "kv_policy", "kv_wire_dtype",
    "top_k", "add_generation_prompt", VLLM_FIELDS, NULL};
/* POST /tokenize takes a prompt or messages; POST /detokenize token ids (vLLM's shapes). */
static const char *const tokenize_fields[] = {
    "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs", NULL};
static const char *const detokenize_fields[] = {"model", "tokens", NULL};


static int refuse(oa_refusal *f, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int refuse(oa_refusal *f, const char *param, const char *fmt, ...)
{
    f->http = 400;
    f->type = "invalid_request_error";
    snprintf(f->param, sizeof f->param, "%s", param ? param : "");
    f->code = NULL;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->msg, sizeof f->msg, fmt, ap);
    va_end(ap);
    return -1;
}

/* null counts as absent, as the OpenAI SDKs send it. */
static const cJSON *field(const cJSON *doc, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(doc, name);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

/* An integer field in [lo, hi] into *out (untouched when absent). */
static int int_field(const cJSON *doc, const char *name, double lo, double hi, int64_t *out, oa_refusal *f)
{
    const cJSON *v = field(doc, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
        return refuse(f, name, "'%s' must be an integer", name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return refuse(f, name, "'%s' is %.0f: it must be in [%.0f, %.0f]", name, v->valuedouble, lo, hi);
    *out = (int64_t)v->valuedouble;
    return 0;
}

static int num_field(const cJSON *doc, const char *name, double *out, oa_refusal *f)
{
    const cJSON *v = field(doc, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return refuse(f, name, "'%s' must be a number", name);
    *out = v->valuedouble;
    return 0;
}

/* A number field in [lo, hi] (lo excluded when open_lo) into *out (untouched when absent). */
static int ranged_field(const cJSON *doc, const char *name, double lo, int open_lo, double hi, double *out,
                        oa_refusal *f)
{
    double x = *out;
    if (num_field(doc, name, &x, f)) return -1;
    if (x > hi || x < lo || (open_lo && x == lo))
        return refuse(f, name, "'%s' is %g: it must be in %c%g, %g]", name, x, open_lo ? '(' : '[', lo, hi);
    *out = x;
    return 0;
}

static int bool_field(const cJSON *doc, const char *name, int *out, oa_refusal *f)
{
    const cJSON *v = field(doc, name);
    if (!v) return 0;
    if (!cJSON_IsBool(v)) return refuse(f, name, "'%s' must be true or false", name);
    *out = cJSON_IsTrue(v);
    return 0;
}

/* Fields kvrelay accepts only at their default value (what OpenAI does when they are absent). */
static int only_default(const cJSON *doc, oa_refusal *f)
{
    const cJSON *v = field(doc, "logit_bias");
    if (v && !(cJSON_IsObject(v) && !v->child)) return refuse(f, "logit_bias", "'logit_bias' is not supported");
    return 0;
}

/* n (both endpoints) and best_of (completions; not streamed, as OpenAI's API): choices and
 * candidates per prompt, 1 <= n <= best_of <= OA_MAX_N. */
static int parse_choices(oa_request *r, const cJSON *doc, oa_refusal *f)
{
    int64_t n = 1, best_of = -1;
    if (int_field(doc, "n", 1, OA_MAX_N, &n, f)) return -1;
    if (r->kind == OA_COMPLETION && int_field(doc, "best_of", 1, OA_MAX_N, &best_of, f)) return -1;
    if (best_of >= 0 && best_of < n)
        return refuse(f, "best_of", "'best_of' is %" PRId64 ": it must be at least 'n' (%" PRId64 ")", best_of, n);
    if (best_of > 1 && r->stream) return refuse(f, "best_of", "'best_of' > 1 cannot be streamed ('stream': true)");
    r->n = (int)n;
    r->best_of = best_of < 0 ? (int)n : (int)best_of;
    return 0;
}

static int copy_stop(oa_request *r, const char *s, oa_refusal *f)
{
    if (r->n_stops >= OA_MAX_STOPS) return refuse(f, "stop", "'stop': at most %d strings", OA_MAX_STOPS);
    if (!(r->stops[r->n_stops] = strdup(s))) return refuse(f, NULL, "out of memory");
    r->n_stops++;
    return 0;
}

/* The penalties (OpenAI's presence and frequency, vLLM's repetition) and vLLM's generation
 * controls; min_tokens waits for max_tokens (parse_request). Ranges as docs/openai.md lists. */
static int parse_vllm(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    double repetition = 1.0, presence = 0.0, frequency = 0.0;
    if (ranged_field(doc, "repetition_penalty", 0.0, 1, 100.0, &repetition, f) ||
        ranged_field(doc, "presence_penalty", -2.0, 0, 2.0, &presence, f) ||
        ranged_field(doc, "frequency_penalty", -2.0, 0, 2.0, &frequency, f))
        return -1;
    r->sampling.repetition_penalty = (float)repetition;
    r->sampling.presence_penalty = (float)presence;
    r->sampling.frequency_penalty = (float)frequency;
    int skip_special = 1;
    if (bool_field(doc, "ignore_eos", &r->ignore_eos, f) || bool_field(doc, "skip_special_tokens", &skip_special, f) ||
        bool_field(doc, "include_stop_str_in_output", &r->include_stop, f))
        return -1;
    r->keep_special = !skip_special;
    const cJSON *ids = field(doc, "stop_token_ids");
    if (ids && !cJSON_IsArray(ids)) return refuse(f, "stop_token_ids", "'stop_token_ids' must be an array of token ids");
    for (const cJSON *t = ids ? ids->child : NULL; t; t = t->next) {
        if (r->n_stop_ids >= OA_MAX_STOP_IDS)
            return refuse(f, "stop_token_ids", "'stop_token_ids': at most %d ids", OA_MAX_STOP_IDS);
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= m->cfg->vocab_size)
            return refuse(f, "stop_token_ids", "'stop_token_ids'[%d] is not a token id of the model's vocabulary [0, %d)",
                          r->n_stop_ids, m->cfg->vocab_size);
        r->stop_ids[r->n_stop_ids++] = (uint32_t)t->valuedouble;
    }
    return 0;
}

/* The fields both endpoints share: sampling, stops, streaming, the KV policy. */
static int parse_common(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    const char *const *known = r->kind == OA_CHAT ? chat_fields : completion_fields;
    for (const cJSON *it = doc->child; it; it = it->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++) ok = !strcmp(it->string, known[i]);
        if (!ok) return refuse(f, it->string, "Unrecognized request argument supplied: %s", it->string);
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(doc, "model");
    if (!cJSON_IsString(model)) return refuse(f, "model", "'model' is required: a string (GET /v1/models lists them)");
    if (strcmp(model->valuestring, m->name) != 0) {
        refuse(f, "model", "The model '%.200s' does not exist (this server serves '%s')", model->valuestring,
               m->name);
        f->http = 404;
        f->code = "model_not_found";
        return -1;
    }
    if (only_default(doc, f)) return -1;
    if (bool_field(doc, "stream", &r->stream, f) || parse_choices(r, doc, f)) return -1;
    const cJSON *so = field(doc, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so)) return refuse(f, "stream_options", "'stream_options' must be an object");
        if (!r->stream) return refuse(f, "stream_options", "'stream_options' is only allowed with 'stream': true");
        for (const cJSON *it = so->child; it; it = it->next)
            if (strcmp(it->string, "include_usage") != 0)
                return refuse(f, "stream_options", "Unrecognized stream option: %s", it->string);
        if (bool_field(so, "include_usage", &r->include_usage, f)) return -1;
    }

    /* sampling: OpenAI's defaults are temperature 1 and top_p 1 */
    double temperature = 1.0, top_p = 1.0;
    int64_t top_k = 0, seed = 0;
    if (num_field(doc, "temperature", &temperature, f) || num_field(doc, "top_p", &top_p, f) ||
        int_field(doc, "top_k", 0, 1 << 30, &top_k, f))
        return -1;
    r->sampling = (Kvrelay__V1__Sampling)KVRELAY__V1__SAMPLING__INIT;
    r->sampling.temperature = (float)temperature;
    r->sampling.top_p = (float)top_p;
    r->sampling.top_k = (uint32_t)top_k;
    if (field(doc, "seed")) {
        if (int_field(doc, "seed", -9007199254740992.0, 9007199254740992.0, &seed, f)) return -1;
        r->sampling.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
        r->sampling.seed = (uint64_t)seed;
    }
    if (parse_vllm(m, r, doc, f)) return -1;

    const cJSON *stop = field(doc, "stop");
    if (cJSON_IsString(stop)) {
        if (copy_stop(r, stop->valuestring, f)) return -1;
    } else if (cJSON_IsArray(stop)) {
        for (const cJSON *s = stop->child; s; s = s->next) {
            if (!cJSON_IsString(s)) return refuse(f, "stop", "'stop' must be a string or an array of strings");
            if (copy_stop(r, s->valuestring, f)) return -1;
        }
    } else if (stop) {
        return refuse(f, "stop", "'stop' must be a string or an array of strings");
    }

    const cJSON *policy = field(doc, "kv_policy");
    if (policy && !cJSON_IsString(policy))
        return refuse(f, "kv_policy", "'kv_policy' must be a policy spec string, e.g. \"streaming:sink=4,window=64\"");
    if (policy && strlen(policy->valuestring) >= sizeof r->policy)
        return refuse(f, "kv_policy", "'kv_policy' is over %zu bytes", sizeof r->policy - 1);
    snprintf(r->policy, sizeof r->policy, "%s", policy ? policy->valuestring : "");
    const cJSON *wire = field(doc, "kv_wire_dtype");
    if (wire && (!cJSON_IsString(wire) || strlen(wire->valuestring) >= sizeof r->wire))
        return refuse(f, "kv_wire_dtype", "'kv_wire_dtype' must be one of \"f32\", \"bf16\", \"f16\", \"int8\", \"fp8\"");
    snprintf(r->wire, sizeof r->wire, "%s", wire ? wire->valuestring : "");
    return 0;
}

/* Room for `more` ids after the r->prompt_ids.n_ids in r->ids. */
static int grow_ids(oa_request *r, size_t more, oa_refusal *f)
{
    uint32_t *grown = realloc(r->ids, (r->prompt_ids.n_ids + more + 1) * sizeof *grown);
    if (!grown) return refuse(f, NULL, "out of memory");
    r->ids = grown;
    return 0;
}

/* Tokenizes text and appends its ids to r->ids (r->prompt_ids.n_ids counts them). */
static int tokenize(const oa_model *m, oa_request *r, const char *text, int add_special, const char *param, oa_refusal *f)
{
    if (!m->tok)
        return refuse(f, param, "the model %s has no tokenizer.json: send the prompt as an array of token ids",
                      m->dir);
    int32_t *ids = NULL;
    int n = 0;
    char err[KR_ERR_MAX];
    if (kr_tokenizer_encode(m->tok, text, strlen(text), add_special, &ids, &n, err) != KR_OK)
        return refuse(f, param, "'%s' does not tokenize: %s", param, err);
    if (grow_ids(r, (size_t)n, f)) {
        free(ids);
        return -1;
    }
    memcpy(r->ids + r->prompt_ids.n_ids, ids, (size_t)n * sizeof *ids); /* non-negative ids: the same bits */
    r->prompt_ids.n_ids += (size_t)n;
    free(ids);
    return 0;
}

/* One prompt of a completions request (a string or an array of token ids; `at` its place in a
 * list, -1 alone) appended to r->ids. */
static int one_prompt(const oa_model *m, oa_request *r, const cJSON *p, int add_special, int at, oa_refusal *f)
{
    char name[32] = "'prompt'";
    if (at >= 0) snprintf(name, sizeof name, "'prompt'[%d]", at);
    size_t before = r->prompt_ids.n_ids;
    if (cJSON_IsString(p)) {
        if (!p->valuestring[0]) return refuse(f, "prompt", "%s is empty", name);
        if (tokenize(m, r, p->valuestring, add_special, "prompt", f)) return -1;
        if (r->prompt_ids.n_ids == before) return refuse(f, "prompt", "%s has no tokens", name);
        return 0;
    }
    if (!cJSON_IsArray(p)) return refuse(f, "prompt", "%s must be a string or an array of token ids", name);
    int n = cJSON_GetArraySize(p);
    if (n == 0) return refuse(f, "prompt", "%s is empty", name);
    if (n > m->cfg->max_position_embeddings)
        return refuse(f, "prompt", "%s has %d tokens: the model's context is %d", name, n, m->cfg->max_position_embeddings);
    if (grow_ids(r, (size_t)n, f)) return -1;
    int i = 0;
    for (const cJSON *t = p->child; t; t = t->next, i++) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= m->cfg->vocab_size)
            return refuse(f, "prompt", "%s[%d] is not a token id of the model's vocabulary [0, %d)", name, i,
                          m->cfg->vocab_size);
        r->ids[r->prompt_ids.n_ids++] = (uint32_t)t->valuedouble;
    }
    return 0;
}

/* POST /v1/completions: prompt is a string or token ids, or a list of prompts (strings or arrays
 * of token ids), each of which gets n choices. */
static int parse_completion(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    int add_special = 1;
    if (bool_field(doc, "add_special_tokens", &add_special, f)) return -1;
    if (field(doc, "suffix")) return refuse(f, "suffix", "'suffix' is not supported");
    int64_t logprobs = -1;
    if (int_field(doc, "logprobs", 0, KR_TOP_LOGPROBS_MAX, &logprobs, f) || bool_field(doc, "echo", &r->echo, f))
        return -1;
    r->logprobs = (int)logprobs;
    const cJSON *p = field(doc, "prompt");
    if (!p) return refuse(f, "prompt", "'prompt' is required");
    if (!(cJSON_IsArray(p) && p->child && !cJSON_IsNumber(p->child))) { /* one prompt */
        r->n_prompts = 1;
        return one_prompt(m, r, p, add_special, -1, f);
    }
    int i = 0;
    for (const cJSON *it = p->child; it; it = it->next, i++) {
        if ((size_t)(i + 1) * (size_t)r->best_of > OA_MAX_GENERATIONS)
            return refuse(f, "prompt", "'prompt': %d prompts x %d choices%s are over %d generations per request",
                          cJSON_GetArraySize(p), r->best_of, r->best_of > r->n ? " (best_of)" : "", OA_MAX_GENERATIONS);
        if (!cJSON_IsString(it) && !cJSON_IsArray(it))
            return refuse(f, "prompt", "'prompt'[%d] must be a string or an array of token ids", i);
        r->prompt_at[i] = r->prompt_ids.n_ids;
        if (one_prompt(m, r, it, add_special, i, f)) return -1;
    }
    r->n_prompts = i;
    return 0;
}

/* A message's content: a string, or an array of {"type": "text", "text": ...} parts (joined). */
static char *message_text(const cJSON *content, int i, oa_refusal *f)
{
    if (!content) return strdup("");
    if (cJSON_IsString(content)) return strdup(content->valuestring);
    if (!cJSON_IsArray(content)) {
        refuse(f, "messages", "'messages'[%d].content must be a string or an array of text parts", i);
        return NULL;
    }
    size_t len = 0;
    for (const cJSON *part = content->child; part; part = part->next) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0 || !cJSON_IsString(text)) {
            refuse(f, "messages", "'messages'[%d].content: only parts of type \"text\" are supported", i);
            return NULL;
        }
        len += strlen(text->valuestring);
    }
    char *out = malloc(len + 1);
    if (!out) return NULL;
    out[0] = '\0';
    for (const cJSON *part = content->child; part; part = part->next)
        strcat(out, cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring);
    return out;
}

static int chat_prompt(const oa_model *m, oa_request *r, const cJSON *doc, int add_generation_prompt,
                       int add_special, oa_refusal *f);

/* POST /v1/chat/completions: the messages rendered with the model's chat template. */
static int parse_chat(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    int logprobs = 0, add_generation_prompt = 1;
    if (bool_field(doc, "logprobs", &logprobs, f) || bool_field(doc, "add_generation_prompt", &add_generation_prompt, f))
        return -1;
    int64_t top = 0;
    if (int_field(doc, "top_logprobs", 0, KR_TOP_LOGPROBS_MAX, &top, f)) return -1;
    if (field(doc, "top_logprobs") && !logprobs)
        return refuse(f, "top_logprobs", "'top_logprobs' requires 'logprobs': true");
    r->logprobs = logprobs ? (int)top : -1;
    const cJSON *tools = field(doc, "tools");
    if (tools && !(cJSON_IsArray(tools) && !tools->child)) return refuse(f, "tools", "'tools' are not supported");
    const cJSON *tc = field(doc, "tool_choice");
    if (tc && !(cJSON_IsString(tc) && !strcmp(tc->valuestring, "none")))
        return refuse(f, "tool_choice", "'tool_choice' must be \"none\": tools are not supported");
    int store = 0;
    if (bool_field(doc, "store", &store, f)) return -1;
    if (store) return refuse(f, "store", "'store' is not supported");
    if (bool_field(doc, "parallel_tool_calls", &store, f)) return -1;
    return chat_prompt(m, r, doc, add_generation_prompt, 0, f); /* the template writes the special tokens */
}

/* A chat's messages rendered with the model's chat template and tokenized into r->ids, with the
 * tokenizer's special tokens when add_special (on top of those the template wrote). */
static int chat_prompt(const oa_model *m, oa_request *r, const cJSON *doc, int add_generation_prompt,
                       int add_special, oa_refusal *f)
{
    const cJSON *msgs = field(doc, "messages");
    if (!cJSON_IsArray(msgs) || !msgs->child)
        return refuse(f, "messages", "'messages' is required: a non-empty array of {\"role\", \"content\"}");
    if (!m->chat)
        return refuse(f, "messages", "the model %s has no usable chat template: %s (use /v1/completions)",
                      m->dir, m->chat_error);
    int n = cJSON_GetArraySize(msgs), rc = -1;
    kr_chat_message *cm = calloc((size_t)n, sizeof *cm);
    char **texts = calloc((size_t)n, sizeof *texts);
    if (!cm || !texts) {
        refuse(f, NULL, "out of memory");
        goto out;
    }
    int i = 0;
    for (const cJSON *it = msgs->child; it; it = it->next, i++) {
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        if (!cJSON_IsObject(it) || !cJSON_IsString(role)) {
            refuse(f, "messages", "'messages'[%d] must be an object with a string 'role'", i);
            goto out;
        }
        for (const cJSON *k = it->child; k; k = k->next)
            if (strcmp(k->string, "role") && strcmp(k->string, "content") && strcmp(k->string, "name")) {
                refuse(f, "messages", "'messages'[%d].%s is not supported", i, k->string);
                goto out;
            }
        const cJSON *content = field(it, "content");
        if (!(texts[i] = message_text(content, i, f))) {
            if (!f->msg[0]) refuse(f, NULL, "out of memory");
            goto out;
        }
        cm[i] = (kr_chat_message){.role = role->valuestring, .content = texts[i]};
    }
    char *prompt = NULL;
    size_t len = 0;
    char err[KR_ERR_MAX];
    int e = kr_chat_template_render(m->chat, cm, n, add_generation_prompt, &prompt, &len, err);
    if (e == KR_CHAT_RAISED) { /* the template's own words on what is wrong with the messages */
        refuse(f, "messages", "%s", err);
        goto out;
    }
    if (e != KR_OK) { /* the model's template itself failed: the server's problem */
        refuse(f, "messages", "the model's chat template (%s) failed: %s", kr_chat_template_source(m->chat), err);
        f->http = 500;
        f->type = "server_error";
        goto out;
    }
    rc = prompt[0] ? tokenize(m, r, prompt, add_special, "messages", f)
                   : refuse(f, "messages", "the chat template rendered an empty prompt");
    free(prompt);
out:
    for (int k = 0; texts && k < n; k++) free(texts[k]);
    free(texts);
    free(cm);
    return rc;
}

/* response_format (both endpoints; completions' is vLLM's extension): an object, passed on as
 * its compact JSON text. The generation path compiles it (rt_req_validate), so that both APIs
 * refuse a schema alike, naming the keyword. */
static int parse_response_format(oa_request *r, const cJSON *doc, oa_refusal *f)
{
    const cJSON *rf = field(doc, "response_format");
    if (!rf) return 0;
    if (!cJSON_IsObject(rf))
        return refuse(f, "response_format", "'response_format' must be an object such as {\"type\": \"json_object\"}");
    r->response_format = cJSON_PrintUnformatted(rf);
    return r->response_format ? 0 : refuse(f, NULL, "out of memory");
}

/* Builds r->q from the JSON body. */
static int parse_request(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    if (parse_common(m, r, doc, f) || parse_response_format(r, doc, f) ||
        (r->kind == OA_CHAT ? parse_chat(m, r, doc, f) : parse_completion(m, r, doc, f)))
        return -1;
    if (r->kind == OA_CHAT) r->n_prompts = 1;
    r->prompt_at[r->n_prompts] = r->prompt_ids.n_ids;
    int ctx = m->cfg->max_position_embeddings, n_prompt = 0;
    for (int i = 0; i < r->n_prompts; i++) /* the longest prompt decides */
        if (r->prompt_at[i + 1] - r->prompt_at[i] > (size_t)n_prompt) n_prompt = (int)(r->prompt_at[i + 1] - r->prompt_at[i]);
    int64_t max_tokens = -1;
    const char *which = "max_tokens";
    if (r->kind == OA_CHAT && field(doc, "max_completion_tokens")) which = "max_completion_tokens";
    if (int_field(doc, which, r->echo ? 0 : 1, 1e9, &max_tokens, f)) return -1; /* echo alone may generate none */
    if (max_tokens < 0) { /* absent: OpenAI's 16 for completions; chat runs to the context */
        max_tokens = r->kind == OA_CHAT ? ctx - n_prompt : OA_DEFAULT_MAX_TOKENS;
        if (max_tokens > m->max_tokens_limit) max_tokens = m->max_tokens_limit;
        if (max_tokens < 1) max_tokens = 1;
    }
    int64_t min_tokens = 0;
    if (int_field(doc, "min_tokens", 0, 1e9, &min_tokens, f)) return -1;
    if (min_tokens > max_tokens)
        return refuse(f, "min_tokens", "'min_tokens' is %" PRId64 ": it must be at most the %s, %" PRId64, min_tokens,
                      which, max_tokens);
    if ((int64_t)n_prompt + max_tokens > ctx) {
        refuse(f, which,
               "This model's maximum context length is %d tokens. However, you requested %" PRId64
               " tokens (%d in the %s, %" PRId64 " for the completion). Please reduce the length of the %s or the "
               "completion.",
               ctx, n_prompt + max_tokens, n_prompt, r->kind == OA_CHAT ? "messages" : "prompt", max_tokens,
               r->kind == OA_CHAT ? "messages" : "prompt");
        f->code = "context_length_exceeded";
        return -1;
    }
    r->prompt_ids.ids = r->ids;
    r->prompt_ids.n_ids = r->prompt_at[1]; /* prompt 0 */
    r->q = (Kvrelay__V1__GenerateRequest)KVRELAY__V1__GENERATE_REQUEST__INIT;
    r->q.prompt_case = KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    r->q.token_ids = &r->prompt_ids;
    r->q.max_tokens = (uint32_t)max_tokens;
    r->q.sampling = &r->sampling;
    r->q.n_stop = (size_t)r->n_stops;
    r->q.stop = r->stops;
    r->q.kv_policy = r->policy;
    r->q.kv_wire_dtype = r->wire;
    r->q.n_stop_ids = (size_t)r->n_stop_ids;
    r->q.stop_ids = r->stop_ids;
    r->q.ignore_eos = r->ignore_eos;
    r->q.min_tokens = (uint32_t)min_tokens;
    r->q.keep_special_tokens = r->keep_special;
    r->q.include_stop_str_in_output = r->include_stop;
    r->q.logprobs = r->logprobs >= 0;
    r->q.top_logprobs = r->logprobs > 0 ? (uint32_t)r->logprobs : 0;
    /* echo's scores come from the prefill node; max_tokens 0 is a scored-only prefill */
    r->q.prompt_logprobs = r->echo && (r->logprobs >= 0 || max_tokens == 0);
    if (r->response_format) r->q.response_format = r->response_format;
    return 0;
}

/* The top-level field of a JSON object text body[0, len) in whose key or string values U+0000
 * appears (escaped as \u0000, or a raw NUL byte), copied into name (cut to its bytes before
 * the NUL); 0 when none. cJSON keeps strings NUL-terminated without their length, so such a
 * string would go on cut at the NUL: the request runs on part of what the client sent. Only for
 * a body cJSON parsed: the scan trusts its structure. */
static int nul_field(const char *body, size_t len, char *name, size_t cap)
{
    int depth = 0, in_str = 0, expect_key = 0, in_key = 0;
    size_t key_at = 0;
    name[0] = '\0';
    for (size_t i = 0; i < len; i++) {
        char c = body[i];
        if (in_str) {
            int nul = c == '\0' || (c == '\\' && len - i > 5 && !memcmp(body + i + 1, "u0000", 5));
            if (nul || c == '"') {
                in_str = 0;
                if (in_key) snprintf(name, cap, "%.*s", (int)(i - key_at), body + key_at);
                in_key = 0;
                if (nul) return 1;
            } else if (c == '\\') {
                i++; /* the escaped character, a quote included */
            }
            continue;
        }
        if (c == '"') {
            in_str = 1;
            in_key = depth == 1 && expect_key;
            key_at = i + 1;
            expect_key = 0;
        } else if (c == '{' || c == '[') {
            depth++;
            expect_key = depth == 1 && c == '{';
        } else if (c == '}' || c == ']') {
            depth--;
        } else if (c == ',' && depth == 1) {
            expect_key = 1;
        }
    }
    return 0;
}

/* The body parsed as a JSON object with no U+0000 in its strings; NULL with *f set when not. */
static cJSON *parse_body(const char *body, size_t len, oa_refusal *f)
{
    cJSON *doc = cJSON_ParseWithLength(body, len);
    if (!doc) {
        const char *at = cJSON_GetErrorPtr();
        refuse(f, NULL, "the request body is not valid JSON (near byte %td)",
               at && at >= body && at <= body + len ? at - body : (ptrdiff_t)0);
        return NULL;
    }
    char name[sizeof f->param];
    if (nul_field(body, len, name, sizeof name)) {
        refuse(f, name[0] ? name : NULL, "'%s' holds U+0000 (a NUL character), which kvrelay does not take in text",
               name);
        cJSON_Delete(doc);
        return NULL;
    }
    if (!cJSON_IsObject(doc)) {
        refuse(f, NULL, "the request body must be a JSON object");
        cJSON_Delete(doc);
        return NULL;
    }
    return doc;
}

int oa_request_parse(const oa_model *m, oa_kind kind, const char *body, size_t len, oa_request *r, oa_refusal *f)
{
    memset(r, 0, sizeof *r);
    memset(f, 0, sizeof *f);
    r->kind = kind;
    cJSON *doc = parse_body(body, len, f);
    if (!doc) return -1;
    int rc = parse_request(m, r, doc, f);
    cJSON_Delete(doc);
    return rc;
}

/* The fields of a /tokenize or /detokenize body: none unknown, and "model" the served one when
 * present (vLLM's requests may leave it out). */
static int check_fields(const oa_model *m, const cJSON *doc, const char *const *known, oa_refusal *f)
{
    for (const cJSON *it = doc->child; it; it = it->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++) ok = !strcmp(it->string, known[i]);
        if (!ok) return refuse(f, it->string, "Unrecognized request argument supplied: %s", it->string);
    }
    const cJSON *model = field(doc, "model");
    if (model && !cJSON_IsString(model)) return refuse(f, "model", "'model' must be a string");
    if (model && strcmp(model->valuestring, m->name) != 0) {
        refuse(f, "model", "The model '%.200s' does not exist (this server serves '%s')", model->valuestring, m->name);
        f->http = 404;
        f->code = "model_not_found";
        return -1;
    }
    return 0;
}

static int parse_tokenize(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    if (check_fields(m, doc, tokenize_fields, f)) return -1;
    int strs = 0;
    if (bool_field(doc, "return_token_strs", &strs, f)) return -1;
    if (strs) return refuse(f, "return_token_strs", "'return_token_strs' is not supported");
    const cJSON *prompt = field(doc, "prompt"), *msgs = field(doc, "messages");
    if (!prompt == !msgs) return refuse(f, "prompt", "give either 'prompt' (a string) or 'messages'");
    if (prompt) {
        int add_special = 1;
        if (bool_field(doc, "add_special_tokens", &add_special, f)) return -1;
        if (field(doc, "add_generation_prompt"))
            return refuse(f, "add_generation_prompt", "'add_generation_prompt' goes with 'messages'");
        if (!cJSON_IsString(prompt)) return refuse(f, "prompt", "'prompt' must be a string");
        return tokenize(m, r, prompt->valuestring, add_special, "prompt", f);
    }
    int add_special = 0, add_generation_prompt = 1;
    if (bool_field(doc, "add_special_tokens", &add_special, f) ||
        bool_field(doc, "add_generation_prompt", &add_generation_prompt, f))
        return -1;
    return chat_prompt(m, r, doc, add_generation_prompt, add_special, f);
}

int oa_tokenize_parse(const oa_model *m, const char *body, size_t len, oa_request *r, oa_refusal *f)
{
    memset(r, 0, sizeof *r);
    memset(f, 0, sizeof *f);
    r->kind = OA_CHAT;
    cJSON *doc = parse_body(body, len, f);
    if (!doc) return -1;
    int rc = parse_tokenize(m, r, doc, f);
    cJSON_Delete(doc);
    return rc;
}

static int parse_detokenize(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    if (check_fields(m, doc, detokenize_fields, f)) return -1;
    const cJSON *tokens = field(doc, "tokens");
    if (!cJSON_IsArray(tokens)) return refuse(f, "tokens", "'tokens' is required: an array of token ids");
    int n = cJSON_GetArraySize(tokens);
    r->ids = malloc((n > 0 ? (size_t)n : 1) * sizeof *r->ids);
    if (!r->ids) return refuse(f, NULL, "out of memory");
    int i = 0;
    for (const cJSON *t = tokens->child; t; t = t->next, i++) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= m->cfg->vocab_size)
            return refuse(f, "tokens", "'tokens'[%d] is not a token id of the model's vocabulary [0, %d)", i,
                          m->cfg->vocab_size);
        r->ids[i] = (uint32_t)t->valuedouble;
    }
    r->prompt_ids.n_ids = (size_t)n;
    return 0;
}

int oa_detokenize_parse(const oa_model *m, const char *body, size_t len, oa_request *r, oa_refusal *f)
{
    memset(r, 0, sizeof *r);
    memset(f, 0, sizeof *f);
    cJSON *doc = parse_body(body, len, f);
    if (!doc) return -1;
    int rc = parse_detokenize(m, r, doc, f);
    cJSON_Delete(doc);
    return rc;
}

void oa_request_free(oa_request *r)
{
    for (int i = 0; i < r->n_stops; i++) free(r->stops[i]);
    free(r->ids);
    cJSON_free(r->response_format);
    memset(r, 0, sizeof *r);
}
