/*
 * openai.c - the OpenAI-compatible HTTP API on the router's HTTP port (docs/openai.md):
 * GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed as Server-Sent
 * Events or not. A request is checked and tokenized here (chat messages rendered with the
 * model's chat template first), turned into a kvrelay.v1.GenerateRequest and served by
 * rt_generate_run, the path the gRPC API takes, through an rt_sink that writes OpenAI's JSON.
 * Errors are OpenAI's error object with the HTTP status docs/openai.md lists.
 * Threads: libmicrohttpd gives every connection a thread. A non-streamed request is served on
 * it. A streamed one runs on a thread of its own that hands SSE bytes to the connection's
 * thread (libmicrohttpd's content reader); the connection's thread answers with a status only
 * once the first event or an error is known (so a refusal before any token is a real 4xx/5xx),
 * and it watches the socket while it waits, so that a client that goes away is noticed even
 * while nothing is being written: its decode stream is then cancelled by the router's watcher.
 * Not here: n > 1, logprobs, tools, images, embeddings, legacy endpoints.
 */
#define _GNU_SOURCE /* POLLRDHUP: the peer closed its end */
#include "router.h"

#include "apikey.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    OA_POLL_MS = 20,          /* how often a waiting connection thread looks at its socket */
    OA_MAX_STOPS = 16,        /* the gRPC API's limit, checked there; this bounds the copy */
    OA_DEFAULT_MAX_TOKENS = 16, /* completions without max_tokens, as OpenAI's API */
};

#define OA_JSON "application/json"

/* The statuses the API answers with, for kvrelay_http_responses_total. */
static const unsigned http_codes[RT_HTTP_CODES] = {200, 400, 401, 404, 405, 413, 429, 500, 503, 504};

int rt_openai_metrics_init(rt_router *rt)
{
    for (int i = 0; i < RT_HTTP_CODES; i++) {
        char label[32];
        snprintf(label, sizeof label, "code=\"%u\"", http_codes[i]);
        rt->m.http_responses[i] = kc_counter_add(rt->m.reg, "kvrelay_http_responses_total",
                                                 "OpenAI API answers (/v1/), by HTTP status", label);
        if (!rt->m.http_responses[i]) return -1;
    }
    return 0;
}

static void count_response(rt_router *rt, unsigned status)
{
    for (int i = 0; i < RT_HTTP_CODES; i++)
        if (http_codes[i] == status) kc_counter_inc(rt->m.http_responses[i], 1);
}

typedef enum oa_kind { OA_COMPLETION, OA_CHAT } oa_kind;

/* One HTTP generation request: what was asked, what came back. Streamed requests share it
 * between the generation thread and the connection thread (refs, mu). */
typedef struct oa_call {
    rt_router *rt;
    oa_kind kind;
    int stream, include_usage;
    char id[200];        /* "cmpl-<request id>" / "chatcmpl-<request id>" */
    char request_id[RT_REQUEST_ID_MAX + 1];
    int64_t created;     /* unix seconds */
    char policy[1024];   /* as the client gave it ("" = full) */
    int fd;              /* the client's socket, for hang-up checks; -1 unknown */

    /* the request for rt_generate_run */
    Kvrelay__V1__GenerateRequest q;
    Kvrelay__V1__Sampling sampling;
    Kvrelay__V1__TokenIds prompt_ids;
    uint32_t *ids; /* prompt ids, malloc'd */
    char *stops[OA_MAX_STOPS];
    int n_stops;

    /* what came back */
    char *text; /* non-streamed: the whole text */
    size_t text_len, text_cap;
    int finished;
    Kvrelay__V1__FinishReason reason;
    Kvrelay__V1__Usage usage; /* numbers only */
    char prefill_node[64], decode_node[64];
    grpc_status_code code;
    kc_status st;

    /* streamed: SSE bytes the connection's thread has not written yet */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char *out;
    size_t out_len, out_off, out_cap;
    int started; /* an event is in out: the answer is 200 and a stream */
    int done;    /* the generation thread has finished: nothing comes after out */
    int oom;     /* an SSE chunk could not be queued */
    int role_sent;
    atomic_int gone; /* the client went away */
    int refs;
} oa_call;

/* ------------------------------------------------------------------ responses */

static int respond_json(rt_router *rt, struct MHD_Connection *conn, unsigned status, cJSON *doc,
                        const char *request_id)
{
    count_response(rt, status);
    char *body = doc ? cJSON_PrintUnformatted(doc) : NULL;
    cJSON_Delete(doc);
    if (!body) return MHD_NO; /* out of memory: libmicrohttpd closes the connection */
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, OA_JSON);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (request_id && request_id[0]) MHD_add_response_header(r, "X-Request-Id", request_id);
    if (status == MHD_HTTP_UNAUTHORIZED) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    int ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

/* OpenAI's error object: {"error": {"message", "type", "param", "code"}}. */
static cJSON *error_doc(const char *type, const char *param, const char *code, const char *message)
{
    cJSON *doc = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(doc, "error");
    if (!e) {
        cJSON_Delete(doc);
        return NULL;
    }
    cJSON_AddStringToObject(e, "message", message);
    cJSON_AddStringToObject(e, "type", type);
    if (param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    return doc;
}

static int respond_error(rt_router *rt, struct MHD_Connection *conn, unsigned status, const char *type,
                         const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static int respond_error(rt_router *rt, struct MHD_Connection *conn, unsigned status, const char *type,
                         const char *param, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return respond_json(rt, conn, status, error_doc(type, param, code, msg), NULL);
}

/* The HTTP status, error type and code of a gRPC status (docs/openai.md). */
typedef struct oa_status {
    unsigned http;
    const char *type, *code;
} oa_status;

static oa_status status_of(grpc_status_code c)
{
    switch (c) {
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_FAILED_PRECONDITION:
    case GRPC_STATUS_OUT_OF_RANGE:
        return (oa_status){MHD_HTTP_BAD_REQUEST, "invalid_request_error", NULL};
    case GRPC_STATUS_UNAUTHENTICATED:
        return (oa_status){MHD_HTTP_UNAUTHORIZED, "invalid_request_error", "invalid_api_key"};
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return (oa_status){MHD_HTTP_TOO_MANY_REQUESTS, "rate_limit_exceeded", "rate_limit_exceeded"};
    case GRPC_STATUS_UNAVAILABLE:
        return (oa_status){MHD_HTTP_SERVICE_UNAVAILABLE, "server_error", "service_unavailable"};
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return (oa_status){MHD_HTTP_GATEWAY_TIMEOUT, "server_error", "timeout"};
    default:
        return (oa_status){MHD_HTTP_INTERNAL_SERVER_ERROR, "server_error", NULL};
    }
}

/* The request field a gRPC refusal's details are about ("kv_policy 'x': ..." -> "kv_policy"). */
static const char *param_of(const oa_call *c, const char *details)
{
    static const struct {
        const char *prefix, *param;
    } map[] = {{"kv_policy", "kv_policy"}, {"sampling: temperature", "temperature"}, {"sampling: top_p", "top_p"},
               {"sampling.top_k", "top_k"}, {"sampling: top_k", "top_k"}, {"stop", "stop"},
               {"max_tokens", "max_tokens"}, {"request_id", "X-Request-Id"}};
    if (!strncmp(details, "prompt", 6)) return c->kind == OA_CHAT ? "messages" : "prompt";
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strncmp(details, map[i].prefix, strlen(map[i].prefix))) return map[i].param;
    return NULL;
}

static const char *finish_name(Kvrelay__V1__FinishReason r)
{
    /* EOS, a stop string or id: "stop"; max_tokens or the context: "length" */
    return r == KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS || r == KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP
               ? "stop"
               : "length";
}

/* ------------------------------------------------------------------ response documents */

static cJSON *doc_head(const oa_call *c, const char *object)
{
    cJSON *doc = cJSON_CreateObject();
    cJSON_AddStringToObject(doc, "id", c->id);
    cJSON_AddStringToObject(doc, "object", object);
    cJSON_AddNumberToObject(doc, "created", (double)c->created);
    cJSON_AddStringToObject(doc, "model", c->rt->served_model);
    return doc;
}

static void add_usage(cJSON *doc, const oa_call *c)
{
    cJSON *u = cJSON_AddObjectToObject(doc, "usage");
    if (!u) return;
    cJSON_AddNumberToObject(u, "prompt_tokens", c->usage.prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", c->usage.completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)c->usage.prompt_tokens + c->usage.completion_tokens);
}

/* kvrelay's own usage figures (docs/openai.md), beside OpenAI's fields. */
static void add_extras(cJSON *doc, const oa_call *c)
{
    cJSON *k = cJSON_AddObjectToObject(doc, "kvrelay");
    if (!k) return;
    cJSON_AddStringToObject(k, "request_id", c->request_id);
    cJSON_AddStringToObject(k, "kv_policy", c->policy[0] ? c->policy : "full");
    cJSON_AddNumberToObject(k, "kv_footprint", c->usage.kv_footprint);
    cJSON_AddNumberToObject(k, "peak_kv_entries", (double)c->usage.peak_kv_entries);
    cJSON_AddNumberToObject(k, "kv_bytes_shipped", (double)c->usage.kv_bytes_shipped);
    cJSON_AddNumberToObject(k, "kv_entries_shipped", (double)c->usage.kv_entries_shipped);
    cJSON_AddNumberToObject(k, "ttft_s", c->usage.ttft_s);
    cJSON_AddNumberToObject(k, "tpot_s", c->usage.tpot_s);
    cJSON_AddStringToObject(k, "prefill_node", c->prefill_node);
    cJSON_AddStringToObject(k, "decode_node", c->decode_node);
}

/* The document's one choice: {"index": 0} in a new "choices" array. */
static cJSON *add_choice(cJSON *doc)
{
    cJSON *choices = cJSON_AddArrayToObject(doc, "choices"), *ch = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, ch);
    cJSON_AddNumberToObject(ch, "index", 0);
    return ch;
}

/* The whole answer of a non-streamed request. */
static cJSON *completion_doc(const oa_call *c)
{
    cJSON *doc = doc_head(c, c->kind == OA_CHAT ? "chat.completion" : "text_completion");
    cJSON *ch = add_choice(doc);
    if (c->kind == OA_CHAT) {
        cJSON *m = cJSON_AddObjectToObject(ch, "message");
        cJSON_AddStringToObject(m, "role", "assistant");
        cJSON_AddStringToObject(m, "content", c->text ? c->text : "");
    } else {
        cJSON_AddStringToObject(ch, "text", c->text ? c->text : "");
    }
    cJSON_AddNullToObject(ch, "logprobs");
    cJSON_AddStringToObject(ch, "finish_reason", finish_name(c->reason));
    add_usage(doc, c);
    add_extras(doc, c);
    return doc;
}

/* One streamed chunk with one choice: text (NULL: none) and finish (NULL: not yet). */
static cJSON *chunk_doc(oa_call *c, const char *text, const char *finish)
{
    cJSON *doc = doc_head(c, c->kind == OA_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON *ch = add_choice(doc);
    if (c->kind == OA_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(ch, "delta");
        if (!c->role_sent) { /* the first chunk says who speaks */
            cJSON_AddStringToObject(d, "role", "assistant");
            c->role_sent = 1;
            if (!text) text = "";
        }
        if (text) cJSON_AddStringToObject(d, "content", text);
    } else {
        cJSON_AddStringToObject(ch, "text", text ? text : "");
    }
    cJSON_AddNullToObject(ch, "logprobs");
    if (finish) cJSON_AddStringToObject(ch, "finish_reason", finish);
    else cJSON_AddNullToObject(ch, "finish_reason");
    if (c->include_usage) cJSON_AddNullToObject(doc, "usage"); /* as OpenAI: only the last one has it */
    return doc;
}

/* ------------------------------------------------------------------ the client's socket */

/* 1 when the client closed its end of the connection (or it broke). */
static int hung_up(int fd)
{
    if (fd < 0) return 0;
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

static int stopping(const oa_call *c)
{
    return atomic_load(&c->rt->http_stopping);
}

/* ------------------------------------------------------------------ the sinks */

static void keep_finish(oa_call *c, const Kvrelay__V1__Finish *f)
{
    c->finished = 1;
    c->reason = f->reason;
    if (f->usage) {
        c->usage = *f->usage;
        c->usage.served_by = NULL;
        if (f->usage->served_by) {
            snprintf(c->prefill_node, sizeof c->prefill_node, "%s", f->usage->served_by->prefill_node);
            snprintf(c->decode_node, sizeof c->decode_node, "%s", f->usage->served_by->decode_node);
        }
    }
}

/* Non-streamed: the text is gathered, the finish kept. */
static int whole_send(void *ctx, const Kvrelay__V1__GenerateResponse *msg)
{
    oa_call *c = ctx;
    if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA) {
        size_t n = strlen(msg->delta->text);
        if (c->text_len + n + 1 > c->text_cap) {
            size_t cap = (c->text_len + n + 1) * 2;
            char *grown = realloc(c->text, cap);
            if (!grown) return -1;
            c->text = grown;
            c->text_cap = cap;
        }
        memcpy(c->text + c->text_len, msg->delta->text, n + 1);
        c->text_len += n;
    } else if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_FINISH) {
        keep_finish(c, msg->finish);
    }
    return atomic_load(&c->gone) ? -1 : 0;
}

/* Non-streamed: the connection's thread is the one generating, so its socket stays open. */
static int whole_cancelled(void *ctx)
{
    oa_call *c = ctx;
    if (!atomic_load(&c->gone) && (hung_up(c->fd) || stopping(c))) atomic_store(&c->gone, 1);
    return atomic_load(&c->gone);
}

/* Streamed: the connection's thread sets `gone` (its socket may be closed by now). */
static int stream_cancelled(void *ctx)
{
    oa_call *c = ctx;
    if (!atomic_load(&c->gone) && stopping(c)) atomic_store(&c->gone, 1);
    return atomic_load(&c->gone);
}

static int64_t no_deadline(void *ctx)
{
    (void)ctx;
    return INT64_MAX; /* the router's --default-timeout-ms applies */
}

/* Appends "data: JSON\n\n" (doc freed) to the stream's bytes; with c->mu held. */
static void sse_append_locked(oa_call *c, cJSON *doc)
{
    char *json = doc ? cJSON_PrintUnformatted(doc) : NULL;
    cJSON_Delete(doc);
    size_t n = json ? strlen(json) : 0;
    if (!json || c->out_len + n + 9 > c->out_cap) {
        size_t cap = (c->out_len + n + 9) * 2;
        char *grown = json ? realloc(c->out, cap) : NULL;
        if (!grown) {
            free(json);
            c->oom = 1;
            return;
        }
        c->out = grown;
        c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, "data: ", 6);
    memcpy(c->out + c->out_len + 6, json, n);
    memcpy(c->out + c->out_len + 6 + n, "\n\n", 2);
    c->out_len += n + 8;
    free(json);
}

static void sse_raw_locked(oa_call *c, const char *s)
{
    size_t n = strlen(s);
    if (c->out_len + n > c->out_cap) {
        size_t cap = (c->out_len + n) * 2;
        char *grown = realloc(c->out, cap);
        if (!grown) {
            c->oom = 1;
            return;
        }
        c->out = grown;
        c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, s, n);
    c->out_len += n;
}

/* Streamed: every delta with text becomes a chunk; the finish, a last chunk with the finish
 * reason and kvrelay's figures, then the usage chunk when asked for. */
static int stream_send(void *ctx, const Kvrelay__V1__GenerateResponse *msg)
{
    oa_call *c = ctx;
    pthread_mutex_lock(&c->mu);
    if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA) {
        if (msg->delta->text[0] || (c->kind == OA_CHAT && !c->role_sent)) sse_append_locked(c, chunk_doc(c, msg->delta->text, NULL));
    } else if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_FINISH) {
        keep_finish(c, msg->finish);
        cJSON *last = chunk_doc(c, NULL, finish_name(c->reason));
        add_extras(last, c);
        sse_append_locked(c, last);
        if (c->include_usage) {
            cJSON *u = doc_head(c, c->kind == OA_CHAT ? "chat.completion.chunk" : "text_completion");
            cJSON_AddArrayToObject(u, "choices");
            add_usage(u, c);
            sse_append_locked(c, u);
        }
    }
    c->started = 1;
    pthread_cond_broadcast(&c->cv);
    int rc = atomic_load(&c->gone) || c->oom ? -1 : 0;
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Sleeps up to ms in short steps, waking early on cancellation. */
static int sink_wait(const rt_sink *s, int64_t ms)
{
    struct timespec step = {0, OA_POLL_MS * 1000000L};
    for (int64_t t = 0; t < ms && !s->cancelled(s->ctx); t += OA_POLL_MS) {
        if (ms - t < OA_POLL_MS) step.tv_nsec = (long)(ms - t) * 1000000L;
        nanosleep(&step, NULL);
    }
    return s->cancelled(s->ctx);
}

static int oa_wait(void *ctx, int64_t ms);

static const rt_sink *sink_for(oa_call *c, rt_sink *s)
{
    *s = (rt_sink){.ctx = c,
                   .send = c->stream ? stream_send : whole_send,
                   .cancelled = c->stream ? stream_cancelled : whole_cancelled,
                   .wait = oa_wait,
                   .ms_left = no_deadline};
    return s;
}

static int oa_wait(void *ctx, int64_t ms)
{
    rt_sink s;
    return sink_wait(sink_for(ctx, &s), ms);
}

/* ------------------------------------------------------------------ parsing the request */

static void call_free(oa_call *c)
{
    if (!c) return;
    for (int i = 0; i < c->n_stops; i++) free(c->stops[i]);
    free(c->ids);
    free(c->text);
    free(c->out);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

/* The request fields each endpoint knows; any other is refused, as OpenAI does, so that a typo
 * is not silently ignored. */
static const char *const completion_fields[] = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
    "user", "echo", "logprobs", "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias",
    "kv_policy", "top_k", "add_special_tokens", NULL};
static const char *const chat_fields[] = {
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "user", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls", "store", "kv_policy", "top_k",
    "add_generation_prompt", NULL};

/* A refusal while parsing: status 400 (or `http`), the field, the message. */
typedef struct oa_refusal {
    unsigned http;
    const char *type, *code; /* static strings */
    char param[64]; /* "" = none; a copy: it may name a key of the request's JSON */
    char msg[1024];
} oa_refusal;

static int refuse(oa_refusal *f, const char *param, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int refuse(oa_refusal *f, const char *param, const char *fmt, ...)
{
    f->http = MHD_HTTP_BAD_REQUEST;
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

static int copy_stop(oa_call *c, const char *s, oa_refusal *f)
{
    if (c->n_stops >= OA_MAX_STOPS) return refuse(f, "stop", "'stop': at most %d strings", OA_MAX_STOPS);
    if (!(c->stops[c->n_stops] = strdup(s))) return refuse(f, NULL, "out of memory");
    c->n_stops++;
    return 0;
}

/* The fields both endpoints share: sampling, stops, streaming, the KV policy. */
static int parse_common(oa_call *c, const cJSON *doc, oa_refusal *f)
{
    rt_router *rt = c->rt;
    const char *const *known = c->kind == OA_CHAT ? chat_fields : completion_fields;
    for (const cJSON *it = doc->child; it; it = it->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++) ok = !strcmp(it->string, known[i]);
        if (!ok) return refuse(f, it->string, "Unrecognized request argument supplied: %s", it->string);
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(doc, "model");
    if (!cJSON_IsString(model)) return refuse(f, "model", "'model' is required: a string (GET /v1/models lists them)");
    if (strcmp(model->valuestring, rt->served_model) != 0) {
        refuse(f, "model", "The model '%.200s' does not exist (this server serves '%s')", model->valuestring,
               rt->served_model);
        f->http = MHD_HTTP_NOT_FOUND;
        f->code = "model_not_found";
        return -1;
    }
    if (only_default(doc, f)) return -1;
    if (bool_field(doc, "stream", &c->stream, f)) return -1;
    const cJSON *so = field(doc, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so)) return refuse(f, "stream_options", "'stream_options' must be an object");
        if (!c->stream) return refuse(f, "stream_options", "'stream_options' is only allowed with 'stream': true");
        for (const cJSON *it = so->child; it; it = it->next)
            if (strcmp(it->string, "include_usage") != 0)
                return refuse(f, "stream_options", "Unrecognized stream option: %s", it->string);
        if (bool_field(so, "include_usage", &c->include_usage, f)) return -1;
    }

    /* sampling: OpenAI's defaults are temperature 1 and top_p 1 */
    double temperature = 1.0, top_p = 1.0;
    int64_t top_k = 0, seed = 0;
    if (num_field(doc, "temperature", &temperature, f) || num_field(doc, "top_p", &top_p, f) ||
        int_field(doc, "top_k", 0, 1 << 30, &top_k, f))
        return -1;
    c->sampling = (Kvrelay__V1__Sampling)KVRELAY__V1__SAMPLING__INIT;
    c->sampling.temperature = (float)temperature;
    c->sampling.top_p = (float)top_p;
    c->sampling.top_k = (uint32_t)top_k;
    if (field(doc, "seed")) {
        if (int_field(doc, "seed", -9007199254740992.0, 9007199254740992.0, &seed, f)) return -1;
        c->sampling.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
        c->sampling.seed = (uint64_t)seed;
    }

    const cJSON *stop = field(doc, "stop");
    if (cJSON_IsString(stop)) {
        if (copy_stop(c, stop->valuestring, f)) return -1;
    } else if (cJSON_IsArray(stop)) {
        for (const cJSON *s = stop->child; s; s = s->next) {
            if (!cJSON_IsString(s)) return refuse(f, "stop", "'stop' must be a string or an array of strings");
            if (copy_stop(c, s->valuestring, f)) return -1;
        }
    } else if (stop) {
        return refuse(f, "stop", "'stop' must be a string or an array of strings");
    }

    const cJSON *policy = field(doc, "kv_policy");
    if (policy && !cJSON_IsString(policy))
        return refuse(f, "kv_policy", "'kv_policy' must be a policy spec string, e.g. \"streaming:sink=4,window=64\"");
    if (policy && strlen(policy->valuestring) >= sizeof c->policy)
        return refuse(f, "kv_policy", "'kv_policy' is over %zu bytes", sizeof c->policy - 1);
    snprintf(c->policy, sizeof c->policy, "%s", policy ? policy->valuestring : "");
    return 0;
}

static int tokenize(oa_call *c, const char *text, int add_special, const char *param, oa_refusal *f)
{
    rt_router *rt = c->rt;
    if (!rt->tok)
        return refuse(f, param, "the model %s has no tokenizer.json: send the prompt as an array of token ids",
                      rt->model_dir);
    int32_t *ids = NULL;
    int n = 0;
    char err[KR_ERR_MAX];
    if (kr_tokenizer_encode(rt->tok, text, strlen(text), add_special, &ids, &n, err) != KR_OK)
        return refuse(f, param, "'%s' does not tokenize: %s", param, err);
    c->ids = (uint32_t *)ids; /* non-negative ids: the same bits */
    c->prompt_ids.n_ids = (size_t)n;
    return 0;
}

/* POST /v1/completions: prompt is a string or token ids (or a list holding one of them). */
static int parse_completion(oa_call *c, const cJSON *doc, oa_refusal *f)
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
        return tokenize(c, p->valuestring, add_special, "prompt", f);
    }
    if (!cJSON_IsArray(p)) return refuse(f, "prompt", "'prompt' must be a string or an array of token ids");
    int n = cJSON_GetArraySize(p);
    if (n == 0) return refuse(f, "prompt", "'prompt' is empty");
    if (n > c->rt->cfg.max_position_embeddings)
        return refuse(f, "prompt", "'prompt' has %d tokens: the model's context is %d", n,
                      c->rt->cfg.max_position_embeddings);
    c->ids = malloc((size_t)n * sizeof *c->ids);
    if (!c->ids) return refuse(f, NULL, "out of memory");
    int i = 0;
    for (const cJSON *t = p->child; t; t = t->next, i++) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= c->rt->cfg.vocab_size)
            return refuse(f, "prompt", "'prompt'[%d] is not a token id of the model's vocabulary [0, %d)", i,
                          c->rt->cfg.vocab_size);
        c->ids[i] = (uint32_t)t->valuedouble;
    }
    c->prompt_ids.n_ids = (size_t)n;
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
static int parse_chat(oa_call *c, const cJSON *doc, oa_refusal *f)
{
    rt_router *rt = c->rt;
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
    if (!rt->chat)
        return refuse(f, "messages", "the model %s has no usable chat template: %s (use /v1/completions)",
                      rt->model_dir, rt->chat_error);
    int n = cJSON_GetArraySize(msgs), rc = -1;
    kr_chat_message *m = calloc((size_t)n, sizeof *m);
    char **texts = calloc((size_t)n, sizeof *texts);
    if (!m || !texts) {
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
        m[i] = (kr_chat_message){.role = role->valuestring, .content = texts[i]};
    }
    char *prompt = NULL;
    size_t len = 0;
    char err[KR_ERR_MAX];
    int e = kr_chat_template_render(rt->chat, m, n, add_generation_prompt, &prompt, &len, err);
    if (e == KR_CHAT_RAISED) { /* the template's own words on what is wrong with the messages */
        refuse(f, "messages", "%s", err);
        goto out;
    }
    if (e != KR_OK) { /* the model's template itself failed: the server's problem */
        refuse(f, "messages", "the model's chat template (%s) failed: %s", kr_chat_template_source(rt->chat), err);
        f->http = MHD_HTTP_INTERNAL_SERVER_ERROR;
        f->type = "server_error";
        goto out;
    }
    rc = prompt[0] ? tokenize(c, prompt, 0, "messages", f) /* the template wrote the special tokens */
                   : refuse(f, "messages", "the chat template rendered an empty prompt");
    free(prompt);
out:
    for (int k = 0; texts && k < n; k++) free(texts[k]);
    free(texts);
    free(m);
    return rc;
}

/* Builds c->q from the JSON body. */
static int parse_request(oa_call *c, const cJSON *doc, oa_refusal *f)
{
    if (!cJSON_IsObject(doc)) return refuse(f, NULL, "the request body must be a JSON object");
    if (parse_common(c, doc, f) ||
        (c->kind == OA_CHAT ? parse_chat(c, doc, f) : parse_completion(c, doc, f)))
        return -1;
    rt_router *rt = c->rt;
    int ctx = rt->cfg.max_position_embeddings, n_prompt = (int)c->prompt_ids.n_ids;
    int64_t max_tokens = -1;
    const char *which = "max_tokens";
    if (c->kind == OA_CHAT && field(doc, "max_completion_tokens")) which = "max_completion_tokens";
    if (int_field(doc, which, 1, 1e9, &max_tokens, f)) return -1;
    if (max_tokens < 0) { /* absent: OpenAI's 16 for completions; chat runs to the context */
        max_tokens = c->kind == OA_CHAT ? ctx - n_prompt : OA_DEFAULT_MAX_TOKENS;
        if (max_tokens > rt->max_tokens_limit) max_tokens = rt->max_tokens_limit;
        if (max_tokens < 1) max_tokens = 1;
    }
    if ((int64_t)n_prompt + max_tokens > ctx) {
        refuse(f, which,
               "This model's maximum context length is %d tokens. However, you requested %" PRId64
               " tokens (%d in the %s, %" PRId64 " for the completion). Please reduce the length of the %s or the "
               "completion.",
               ctx, n_prompt + max_tokens, n_prompt, c->kind == OA_CHAT ? "messages" : "prompt", max_tokens,
               c->kind == OA_CHAT ? "messages" : "prompt");
        f->code = "context_length_exceeded";
        return -1;
    }
    c->prompt_ids.ids = c->ids;
    c->q = (Kvrelay__V1__GenerateRequest)KVRELAY__V1__GENERATE_REQUEST__INIT;
    c->q.prompt_case = KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    c->q.token_ids = &c->prompt_ids;
    c->q.max_tokens = (uint32_t)max_tokens;
    c->q.sampling = &c->sampling;
    c->q.n_stop = (size_t)c->n_stops;
    c->q.stop = c->stops;
    c->q.kv_policy = c->policy;
    c->q.request_id = c->request_id;
    return 0;
}

/* ------------------------------------------------------------------ serving */

static void call_unref(oa_call *c)
{
    pthread_mutex_lock(&c->mu);
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) call_free(c);
}

static void run(oa_call *c)
{
    rt_sink s;
    c->code = rt_generate_run(c->rt, &c->q, sink_for(c, &s), &c->st);
}

static int respond_failure(struct MHD_Connection *conn, const oa_call *c)
{
    oa_status hs = status_of(c->code);
    return respond_json(c->rt, conn, hs.http, error_doc(hs.type, param_of(c, c->st.details), hs.code, c->st.details),
                        c->request_id);
}

/* The streamed request's own thread. */
static void *stream_main(void *arg)
{
    oa_call *c = arg;
    rt_router *rt = c->rt;
    run(c);
    pthread_mutex_lock(&c->mu);
    if (c->started) { /* after a 200: the error goes in the stream, as OpenAI's SDKs expect */
        if (c->code != GRPC_STATUS_OK) {
            oa_status hs = status_of(c->code);
            sse_append_locked(c, error_doc(hs.type, param_of(c, c->st.details), hs.code, c->st.details));
        }
        sse_raw_locked(c, "data: [DONE]\n\n");
    }
    c->done = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    call_unref(c);
    atomic_fetch_sub(&rt->http_generations, 1);
    return NULL;
}

/* libmicrohttpd's content reader of a stream: the bytes the generation thread queued, waiting
 * for more (and watching the socket) until it is done. */
static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    oa_call *c = cls;
    pthread_mutex_lock(&c->mu);
    while (c->out_off == c->out_len && !c->done) {
        rt_cond_wait_ms(&c->cv, &c->mu, OA_POLL_MS);
        if (c->out_off == c->out_len && !c->done && hung_up(c->fd)) {
            atomic_store(&c->gone, 1);
            pthread_mutex_unlock(&c->mu);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
    if (c->out_off == c->out_len) {
        pthread_mutex_unlock(&c->mu);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    size_t n = c->out_len - c->out_off < max ? c->out_len - c->out_off : max;
    memcpy(buf, c->out + c->out_off, n);
    c->out_off += n;
    if (c->out_off == c->out_len) c->out_off = c->out_len = 0;
    pthread_mutex_unlock(&c->mu);
    return (ssize_t)n;
}

/* libmicrohttpd is done with the stream's response (sent, or the connection closed). */
static void stream_end(void *cls)
{
    oa_call *c = cls;
    atomic_store(&c->gone, 1);
    call_unref(c);
}

static int serve_stream(struct MHD_Connection *conn, oa_call *c)
{
    rt_router *rt = c->rt;
    c->refs = 2; /* this thread (then the response), and the generation thread */
    atomic_fetch_add(&rt->http_generations, 1);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int e = pthread_create(&t, &attr, stream_main, c);
    pthread_attr_destroy(&attr);
    if (e != 0) {
        atomic_fetch_sub(&rt->http_generations, 1);
        call_free(c);
        return respond_error(rt, conn, MHD_HTTP_SERVICE_UNAVAILABLE, "server_error", NULL, "service_unavailable",
                             "the router cannot start a thread for the request");
    }
    /* answer once the first event or the outcome is known, watching the client meanwhile */
    pthread_mutex_lock(&c->mu);
    while (!c->started && !c->done) {
        rt_cond_wait_ms(&c->cv, &c->mu, OA_POLL_MS);
        if (!c->started && !c->done && hung_up(c->fd)) {
            atomic_store(&c->gone, 1);
            break;
        }
    }
    int started = c->started, gone = atomic_load(&c->gone);
    pthread_mutex_unlock(&c->mu);
    if (!started) {
        int ret = gone ? MHD_NO : respond_failure(conn, c); /* done: c->code is final */
        call_unref(c);
        return ret;
    }
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, c, stream_end);
    if (!r) {
        atomic_store(&c->gone, 1);
        call_unref(c);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(r, "X-Accel-Buffering", "no"); /* proxies: do not hold the events back */
    MHD_add_response_header(r, "X-Request-Id", c->request_id);
    int ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
    MHD_destroy_response(r); /* the connection holds it; stream_end drops our reference */
    count_response(rt, MHD_HTTP_OK);
    return ret;
}

static int serve_whole(struct MHD_Connection *conn, oa_call *c)
{
    atomic_fetch_add(&c->rt->http_generations, 1);
    run(c);
    int ret;
    if (c->code == GRPC_STATUS_OK) ret = respond_json(c->rt, conn, MHD_HTTP_OK, completion_doc(c), c->request_id);
    else if (atomic_load(&c->gone)) ret = MHD_NO;
    else ret = respond_failure(conn, c);
    atomic_fetch_sub(&c->rt->http_generations, 1);
    call_free(c);
    return ret;
}

static int serve_generate(rt_router *rt, struct MHD_Connection *conn, oa_kind kind, const char *body, size_t len)
{
    cJSON *doc = cJSON_ParseWithLength(body, len);
    if (!doc)
        return respond_error(rt, conn, MHD_HTTP_BAD_REQUEST, "invalid_request_error", NULL, NULL,
                             "the request body is not valid JSON (near byte %td)",
                           cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - body : (ptrdiff_t)0);
    oa_call *c = calloc(1, sizeof *c);
    if (!c) {
        cJSON_Delete(doc);
        return MHD_NO;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->rt = rt;
    c->kind = kind;
    c->created = (int64_t)time(NULL);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    c->fd = ci ? (int)ci->connect_fd : -1;
    const char *rid = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id");
    if (rid && rid[0]) snprintf(c->request_id, sizeof c->request_id, "%s", rid); /* checked by rt_generate_run */
    else rt_request_id_new(rt, c->request_id, sizeof c->request_id);
    snprintf(c->id, sizeof c->id, "%s-%s", kind == OA_CHAT ? "chatcmpl" : "cmpl", c->request_id);
    oa_refusal f = {0};
    int bad = parse_request(c, doc, &f);
    cJSON_Delete(doc);
    if (bad) {
        kc_info(c->request_id, "HTTP %u: %s", f.http, f.msg);
        call_free(c);
        return respond_json(rt, conn, f.http, error_doc(f.type, f.param[0] ? f.param : NULL, f.code, f.msg), NULL);
    }
    return c->stream ? serve_stream(conn, c) : serve_whole(conn, c);
}

/* GET /v1/models and /v1/models/{id}. */
static cJSON *model_doc(const rt_router *rt)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", rt->served_model);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)(rt->started_unix_ms / 1000));
    cJSON_AddStringToObject(m, "owned_by", "kvrelay");
    cJSON_AddNumberToObject(m, "max_model_len", rt->cfg.max_position_embeddings);
    return m;
}

int rt_openai_serve(void *user, struct MHD_Connection *conn, const char *method, const char *url, const char *body,
                    size_t len)
{
    rt_router *rt = user;
    if (strncmp(url, "/v1/", 4) != 0)
        return respond_error(rt, conn, MHD_HTTP_NOT_FOUND, "invalid_request_error", NULL, "not_found",
                             "no route %.200s: this port serves /metrics, /healthz and the OpenAI API under /v1/", url);
    const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    rt_apikey_why why = rt_apikeys_why(rt->keys, auth, auth ? strlen(auth) : 0);
    if (why != RT_APIKEY_WHY_OK) {
        kc_warn(NULL, "HTTP 401 on %s %.100s: %s", method, url, rt_apikey_why_message(why, 1));
        return respond_error(rt, conn, MHD_HTTP_UNAUTHORIZED, "invalid_request_error", NULL, "invalid_api_key", "%s",
                             rt_apikey_why_message(why, 1));
    }
    int get = !strcmp(method, MHD_HTTP_METHOD_GET), post = !strcmp(method, MHD_HTTP_METHOD_POST);
    if (!strcmp(url, "/v1/models") || !strncmp(url, "/v1/models/", 11)) {
        if (!get)
            return respond_error(rt, conn, MHD_HTTP_METHOD_NOT_ALLOWED, "invalid_request_error", NULL,
                                 "method_not_allowed", "%s %s: use GET", method, url);
        if (url[10] == '/') {
            if (strcmp(url + 11, rt->served_model) != 0)
                return respond_error(rt, conn, MHD_HTTP_NOT_FOUND, "invalid_request_error", "model", "model_not_found",
                                     "The model '%.200s' does not exist", url + 11);
            return respond_json(rt, conn, MHD_HTTP_OK, model_doc(rt), NULL);
        }
        cJSON *doc = cJSON_CreateObject();
        cJSON_AddStringToObject(doc, "object", "list");
        cJSON_AddItemToArray(cJSON_AddArrayToObject(doc, "data"), model_doc(rt));
        return respond_json(rt, conn, MHD_HTTP_OK, doc, NULL);
    }
    oa_kind kind;
    if (!strcmp(url, "/v1/completions")) kind = OA_COMPLETION;
    else if (!strcmp(url, "/v1/chat/completions")) kind = OA_CHAT;
    else
        return respond_error(rt, conn, MHD_HTTP_NOT_FOUND, "invalid_request_error", NULL, "not_found",
                             "no route %.200s (served: GET /v1/models, POST /v1/completions, POST /v1/chat/completions)",
                             url);
    if (!post)
        return respond_error(rt, conn, MHD_HTTP_METHOD_NOT_ALLOWED, "invalid_request_error", NULL, "method_not_allowed",
                             "%s %s: use POST", method, url);
    if (!body)
        return respond_error(rt, conn, MHD_HTTP_CONTENT_TOO_LARGE, "invalid_request_error", NULL, "request_too_large",
                             "the request body is over %zu bytes", (size_t)RT_OPENAI_MAX_BODY);
    return serve_generate(rt, conn, kind, body, len);
}
