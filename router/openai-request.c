/*
 * openai-request.c - the OpenAI API's request bodies (openai.h): every field checked by name
 * and type against what docs/openai.md lists, unknown ones refused as OpenAI refuses them, the
 * prompt tokenized (a chat's messages rendered with the model's chat template first), and a
 * kvrelay.v1.GenerateRequest built for the generation path the gRPC API takes.
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
 * is not silently ignored. */
static const char *const completion_fields[] = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "user", "echo", "logprobs", "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias",
    "kv_policy", "kv_wire_dtype", "top_k", "add_special_tokens", NULL};
static const char *const chat_fields[] = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "user", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls", "store", "kv_policy", "kv_wire_dtype",
    "top_k", "add_generation_prompt", NULL};


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
    double x = 0;
    if (num_field(doc, "presence_penalty", &x, f) || x != 0)
        return x != 0 ? refuse(f, "presence_penalty", "'presence_penalty' is not supported (only 0)") : -1;
    if (num_field(doc, "frequency_penalty", &x, f) || x != 0)
        return x != 0 ? refuse(f, "frequency_penalty", "'frequency_penalty' is not supported (only 0)") : -1;
    const cJSON *v = field(doc, "logit_bias");
    if (v && !(cJSON_IsObject(v) && !v->child)) return refuse(f, "logit_bias", "'logit_bias' is not supported");
    int64_t n = 1;
    if (int_field(doc, "n", 1, 128, &n, f)) return -1;
    if (n != 1) return refuse(f, "n", "'n' is %" PRId64 ": only one choice per request is supported (n = 1)", n);
    return 0;
}

static int copy_stop(oa_request *r, const char *s, oa_refusal *f)
{
    if (r->n_stops >= OA_MAX_STOPS) return refuse(f, "stop", "'stop': at most %d strings", OA_MAX_STOPS);
    if (!(r->stops[r->n_stops] = strdup(s))) return refuse(f, NULL, "out of memory");
    r->n_stops++;
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
    if (bool_field(doc, "stream", &r->stream, f)) return -1;
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
    r->ids = (uint32_t *)ids; /* non-negative ids: the same bits */
    r->prompt_ids.n_ids = (size_t)n;
    return 0;
}

/* POST /v1/completions: prompt is a string or token ids (or a list holding one of them). */
static int parse_completion(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    int add_special = 1, echo = 0;
    if (bool_field(doc, "add_special_tokens", &add_special, f) || bool_field(doc, "echo", &echo, f)) return -1;
    if (echo) return refuse(f, "echo", "'echo' is not supported");
    int64_t best_of = 1;
    if (int_field(doc, "best_of", 1, 1, &best_of, f)) return -1;
    if (field(doc, "suffix")) return refuse(f, "suffix", "'suffix' is not supported");
    if (field(doc, "logprobs"))
        return refuse(f, "logprobs", "'logprobs' is not supported over HTTP (the gRPC API has per-token logprobs)");
    const cJSON *p = field(doc, "prompt");
    if (!p) return refuse(f, "prompt", "'prompt' is required");
    if (cJSON_IsArray(p) && p->child && !p->child->next && (cJSON_IsString(p->child) || cJSON_IsArray(p->child)))
        p = p->child; /* a list of one prompt */
    else if (cJSON_IsArray(p) && p->child && !cJSON_IsNumber(p->child))
        return refuse(f, "prompt", "'prompt': one prompt per request (a list of several is not supported)");
    if (cJSON_IsString(p)) {
        if (!p->valuestring[0]) return refuse(f, "prompt", "'prompt' is empty");
        return tokenize(m, r, p->valuestring, add_special, "prompt", f);
    }
    if (!cJSON_IsArray(p)) return refuse(f, "prompt", "'prompt' must be a string or an array of token ids");
    int n = cJSON_GetArraySize(p);
    if (n == 0) return refuse(f, "prompt", "'prompt' is empty");
    if (n > m->cfg->max_position_embeddings)
        return refuse(f, "prompt", "'prompt' has %d tokens: the model's context is %d", n,
                      m->cfg->max_position_embeddings);
    r->ids = malloc((size_t)n * sizeof *r->ids);
    if (!r->ids) return refuse(f, NULL, "out of memory");
    int i = 0;
    for (const cJSON *t = p->child; t; t = t->next, i++) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= m->cfg->vocab_size)
            return refuse(f, "prompt", "'prompt'[%d] is not a token id of the model's vocabulary [0, %d)", i,
                          m->cfg->vocab_size);
        r->ids[i] = (uint32_t)t->valuedouble;
    }
    r->prompt_ids.n_ids = (size_t)n;
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

/* POST /v1/chat/completions: the messages rendered with the model's chat template. */
static int parse_chat(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    int logprobs = 0, add_generation_prompt = 1;
    if (bool_field(doc, "logprobs", &logprobs, f) || bool_field(doc, "add_generation_prompt", &add_generation_prompt, f))
        return -1;
    if (logprobs || field(doc, "top_logprobs"))
        return refuse(f, "logprobs", "'logprobs' is not supported over HTTP (the gRPC API has per-token logprobs)");
    const cJSON *tools = field(doc, "tools");
    if (tools && !(cJSON_IsArray(tools) && !tools->child)) return refuse(f, "tools", "'tools' are not supported");
    const cJSON *tc = field(doc, "tool_choice");
    if (tc && !(cJSON_IsString(tc) && !strcmp(tc->valuestring, "none")))
        return refuse(f, "tool_choice", "'tool_choice' must be \"none\": tools are not supported");
    const cJSON *rf = field(doc, "response_format");
    const cJSON *rft = rf ? cJSON_GetObjectItemCaseSensitive(rf, "type") : NULL;
    if (rf && !(cJSON_IsString(rft) && !strcmp(rft->valuestring, "text")))
        return refuse(f, "response_format", "'response_format' must be {\"type\": \"text\"}");
    int store = 0;
    if (bool_field(doc, "store", &store, f)) return -1;
    if (store) return refuse(f, "store", "'store' is not supported");
    if (bool_field(doc, "parallel_tool_calls", &store, f)) return -1;

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
    rc = prompt[0] ? tokenize(m, r, prompt, 0, "messages", f) /* the template wrote the special tokens */
                   : refuse(f, "messages", "the chat template rendered an empty prompt");
    free(prompt);
out:
    for (int k = 0; texts && k < n; k++) free(texts[k]);
    free(texts);
    free(cm);
    return rc;
}

/* Builds r->q from the JSON body. */
static int parse_request(const oa_model *m, oa_request *r, const cJSON *doc, oa_refusal *f)
{
    if (!cJSON_IsObject(doc)) return refuse(f, NULL, "the request body must be a JSON object");
    if (parse_common(m, r, doc, f) ||
        (r->kind == OA_CHAT ? parse_chat(m, r, doc, f) : parse_completion(m, r, doc, f)))
        return -1;
    int ctx = m->cfg->max_position_embeddings, n_prompt = (int)r->prompt_ids.n_ids;
    int64_t max_tokens = -1;
    const char *which = "max_tokens";
    if (r->kind == OA_CHAT && field(doc, "max_completion_tokens")) which = "max_completion_tokens";
    if (int_field(doc, which, 1, 1e9, &max_tokens, f)) return -1;
    if (max_tokens < 0) { /* absent: OpenAI's 16 for completions; chat runs to the context */
        max_tokens = r->kind == OA_CHAT ? ctx - n_prompt : OA_DEFAULT_MAX_TOKENS;
        if (max_tokens > m->max_tokens_limit) max_tokens = m->max_tokens_limit;
        if (max_tokens < 1) max_tokens = 1;
    }
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
    r->q = (Kvrelay__V1__GenerateRequest)KVRELAY__V1__GENERATE_REQUEST__INIT;
    r->q.prompt_case = KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    r->q.token_ids = &r->prompt_ids;
    r->q.max_tokens = (uint32_t)max_tokens;
    r->q.sampling = &r->sampling;
    r->q.n_stop = (size_t)r->n_stops;
    r->q.stop = r->stops;
    r->q.kv_policy = r->policy;
    r->q.kv_wire_dtype = r->wire;
    return 0;
}

int oa_request_parse(const oa_model *m, oa_kind kind, const char *body, size_t len, oa_request *r, oa_refusal *f)
{
    memset(r, 0, sizeof *r);
    memset(f, 0, sizeof *f);
    r->kind = kind;
    cJSON *doc = cJSON_ParseWithLength(body, len);
    if (!doc) {
        const char *at = cJSON_GetErrorPtr();
        return refuse(f, NULL, "the request body is not valid JSON (near byte %td)",
                      at && at >= body && at <= body + len ? at - body : (ptrdiff_t)0);
    }
    int rc = parse_request(m, r, doc, f);
    cJSON_Delete(doc);
    return rc;
}

void oa_request_free(oa_request *r)
{
    for (int i = 0; i < r->n_stops; i++) free(r->stops[i]);
    free(r->ids);
    memset(r, 0, sizeof *r);
}
