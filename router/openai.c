/*
 * openai.c - the OpenAI-compatible HTTP API on the router's HTTP port (docs/openai.md):
 * GET /v1/models, POST /v1/completions and POST /v1/chat/completions, streamed as Server-Sent
 * Events or not, and vLLM's POST /tokenize and /detokenize. A request is checked and tokenized here (chat messages rendered with the
 * model's chat template first), turned into a kvrelay.v1.GenerateRequest and served by
 * rt_generate_run, the path the gRPC API takes, through an rt_sink that writes OpenAI's JSON.
 * Errors are OpenAI's error object with the HTTP status docs/openai.md lists.
 * Threads: libmicrohttpd gives every connection a thread. A non-streamed request is served on
 * it. A streamed one runs on a thread of its own that hands SSE bytes to the connection's
 * thread (libmicrohttpd's content reader); the connection's thread answers with a status only
 * once the first event or an error is known (so a refusal before any token is a real 4xx/5xx),
 * and it watches the socket while it waits, so that a client that goes away is noticed even
 * while nothing is being written: its decode stream is then cancelled by the router's watcher.
 * Several choices (n, best_of) and prompts are several generations (openai-choices.c), each
 * with its own sink; the answer numbers their choices. Log-probabilities and echo are rendered
 * by openai-logprobs.c, one oa_lp per generation.
 * Not here: tools, images, embeddings, legacy endpoints.
 */
#define _GNU_SOURCE /* POLLRDHUP: the peer closed its end */
#include "router.h"

#include "adaptive.h"
#include "apikey.h"
#include "openai-choices.h"
#include "openai-logprobs.h"
#include "openai.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>

#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { OA_POLL_MS = 20 }; /* how often a waiting connection thread looks at its socket */

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

/* One HTTP generation request: what was asked, what came back. Streamed requests share it
 * between the generation thread and the connection thread (refs, mu). */
typedef struct oa_call {
    rt_router *rt;
    oa_request req; /* what was asked */
    char id[200];        /* "cmpl-<request id>" / "chatcmpl-<request id>" */
    char request_id[RT_REQUEST_ID_MAX + 1];
    int64_t created;     /* unix seconds */
    int fd;              /* the client's socket, for hang-up checks; -1 unknown */
    rt_client client;    /* whom the limits count it against */

    /* what came back: every choice's in its generation, the request's outcome here */
    oa_fanout fan;
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
    atomic_int gone; /* the client went away */
    int refs;
} oa_call;

/* ------------------------------------------------------------------ responses */

/* What a response whose document could not be built says instead (a fixed string: building it
 * needs no memory). */
static const char oom_body[] = "{\"error\":{\"message\":\"the router ran out of memory building the "
                               "response\",\"type\":\"server_error\",\"param\":null,\"code\":null}}";

/* Answers with doc; a refusal that may succeed later says when (Retry-After, whole seconds). A
 * document that could not be built or printed (out of memory) is answered 500 with oom_body. */
static int respond_json_retry(rt_router *rt, struct MHD_Connection *conn, unsigned status, cJSON *doc,
                              const char *request_id, int64_t retry_after_ms)
{
    char *body = doc ? cJSON_PrintUnformatted(doc) : NULL;
    cJSON_Delete(doc);
    if (!body) {
        kc_error(request_id && request_id[0] ? request_id : NULL, "HTTP %u answer: out of memory building it; "
                 "answering 500", status);
        status = MHD_HTTP_INTERNAL_SERVER_ERROR;
        retry_after_ms = 0;
    }
    count_response(rt, status);
    struct MHD_Response *r = body ? MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE)
                                  : MHD_create_response_from_buffer(sizeof oom_body - 1, (void *)oom_body,
                                                                    MHD_RESPMEM_PERSISTENT);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, OA_JSON);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (request_id && request_id[0]) MHD_add_response_header(r, "X-Request-Id", request_id);
    if (status == MHD_HTTP_UNAUTHORIZED) MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (retry_after_ms > 0) {
        char secs[24];
        snprintf(secs, sizeof secs, "%" PRId64, (retry_after_ms + 999) / 1000);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, secs);
    }
    int ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static int respond_json(rt_router *rt, struct MHD_Connection *conn, unsigned status, cJSON *doc,
                        const char *request_id)
{
    return respond_json_retry(rt, conn, status, doc, request_id, 0);
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
    } map[] = {{"kv_policy", "kv_policy"}, {"kv_wire_dtype", "kv_wire_dtype"}, {"sampling: temperature", "temperature"}, {"sampling: top_p", "top_p"},
               {"sampling.top_k", "top_k"}, {"sampling: top_k", "top_k"}, {"stop_ids", "stop_token_ids"},
               {"stop", "stop"}, {"max_tokens", "max_tokens"}, {"min_tokens", "min_tokens"},
               {"sampling.repetition_penalty", "repetition_penalty"}, {"sampling.presence_penalty", "presence_penalty"},
               {"sampling.frequency_penalty", "frequency_penalty"}, {"request_id", "X-Request-Id"},
               {"response_format", "response_format"}};
    if (!strncmp(details, "prompt", 6)) return c->req.kind == OA_CHAT ? "messages" : "prompt";
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

static void add_usage(cJSON *doc, const Kvrelay__V1__Usage *usage)
{
    cJSON *u = cJSON_AddObjectToObject(doc, "usage");
    if (!u) return;
    cJSON_AddNumberToObject(u, "prompt_tokens", usage->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", usage->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", (double)usage->prompt_tokens + usage->completion_tokens);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details"); /* Usage.cached_tokens (docs/rpc.md) */
    if (d) cJSON_AddNumberToObject(d, "cached_tokens", usage->cached_tokens);
}

/* kvrelay's own usage figures (docs/openai.md), beside OpenAI's fields: one generation's, or
 * the request's total (oa_fanout_total). */
static void add_extras(cJSON *doc, const oa_call *c, const oa_figures *fig)
{
    const Kvrelay__V1__Usage *usage = &fig->usage;
    cJSON *k = cJSON_AddObjectToObject(doc, "kvrelay");
    if (!k) return;
    cJSON_AddStringToObject(k, "request_id", c->request_id);
    cJSON_AddStringToObject(k, "kv_policy", c->req.policy[0] ? c->req.policy : "full");
    cJSON_AddNumberToObject(k, "kv_footprint", usage->kv_footprint);
    cJSON_AddNumberToObject(k, "peak_kv_entries", (double)usage->peak_kv_entries);
    cJSON_AddNumberToObject(k, "kv_bytes_shipped", (double)usage->kv_bytes_shipped);
    cJSON_AddNumberToObject(k, "kv_entries_shipped", (double)usage->kv_entries_shipped);
    cJSON_AddStringToObject(k, "kv_wire_dtype", fig->wire_dtype);
    cJSON_AddNumberToObject(k, "ttft_s", usage->ttft_s);
    cJSON_AddNumberToObject(k, "queue_s", usage->queue_s);
    cJSON_AddNumberToObject(k, "tpot_s", usage->tpot_s);
    cJSON_AddStringToObject(k, "prefill_node", fig->prefill_node);
    cJSON_AddStringToObject(k, "decode_node", fig->decode_node);
    if (fig->auto_policy[0]) { /* kv_policy auto (docs/adaptive.md) */
        cJSON *a = cJSON_AddObjectToObject(k, "auto");
        cJSON_AddStringToObject(a, "policy", fig->auto_policy);
        cJSON_AddNumberToObject(a, "score", usage->auto_score);
        cJSON_AddStringToObject(a, "pressure", fig->auto_pressure);
        cJSON_AddStringToObject(a, "reason", fig->auto_reason);
    }
}

/* A choice {"index": index} appended to the array choices. */
static cJSON *add_choice(cJSON *choices, int index)
{
    cJSON *ch = cJSON_CreateObject();
    if (!cJSON_AddItemToArray(choices, ch)) {
        cJSON_Delete(ch);
        return NULL;
    }
    cJSON_AddNumberToObject(ch, "index", index);
    return ch;
}

/* The whole answer of a non-streamed request: its choices by index. */
static cJSON *completion_doc(const oa_call *c)
{
    cJSON *doc = doc_head(c, c->req.kind == OA_CHAT ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(doc, "choices");
    for (int i = 0; i < c->req.n_prompts * c->req.n; i++) {
        const oa_gen *g = oa_fanout_choice(&c->fan, i);
        cJSON *ch = choices && g ? add_choice(choices, i) : NULL;
        if (!ch) { /* out of memory: answered 500 */
            cJSON_Delete(doc);
            return NULL;
        }
        if (c->req.kind == OA_CHAT) {
            cJSON *m = cJSON_AddObjectToObject(ch, "message");
            cJSON_AddStringToObject(m, "role", "assistant");
            cJSON_AddStringToObject(m, "content", g->text ? g->text : "");
        } else {
            cJSON_AddStringToObject(ch, "text", g->text ? g->text : "");
        }
        if (g->lp_obj) cJSON_AddItemReferenceToObject(ch, "logprobs", g->lp_obj); /* freed with the call */
        else cJSON_AddNullToObject(ch, "logprobs");
        cJSON_AddStringToObject(ch, "finish_reason", finish_name(g->reason));
    }
    oa_figures total;
    oa_fanout_total(&c->fan, &total);
    add_usage(doc, &total.usage);
    add_extras(doc, c, &total);
    return doc;
}

/* One streamed chunk with one choice, generation g's: text (NULL: none) and finish (NULL: not
 * yet). */
static cJSON *chunk_doc(oa_call *c, oa_gen *g, const char *text, const char *finish)
{
    cJSON *doc = doc_head(c, c->req.kind == OA_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON *ch = add_choice(cJSON_AddArrayToObject(doc, "choices"), g->index);
    if (!ch) {
        cJSON_Delete(doc);
        return NULL;
    }
    if (c->req.kind == OA_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(ch, "delta");
        if (!g->role_sent) { /* the first chunk says who speaks */
            cJSON_AddStringToObject(d, "role", "assistant");
            g->role_sent = 1;
            if (!text) text = "";
        }
        if (text) cJSON_AddStringToObject(d, "content", text);
    } else {
        cJSON_AddStringToObject(ch, "text", text ? text : "");
    }
    cJSON_AddNullToObject(ch, "logprobs");
    if (finish) cJSON_AddStringToObject(ch, "finish_reason", finish);
    else cJSON_AddNullToObject(ch, "finish_reason");
    if (c->req.include_usage) cJSON_AddNullToObject(doc, "usage"); /* as OpenAI: only the last one has it */
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

/* What every generation's sink keeps of a message, streamed or not: its log-probabilities (for
 * best_of), its finish, and that it has begun. */
static void keep(oa_gen *g, const Kvrelay__V1__GenerateResponse *msg)
{
    if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA) oa_gen_add_logprobs(g, msg->delta);
    else if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_FINISH) oa_gen_finish(g, msg->finish);
    oa_gen_begun(g);
}

/* Non-streamed: the text is gathered, the finish kept. Text that cannot be kept (out of memory)
 * fails the request as an internal error, not as a client that went away. */
static int whole_send(void *ctx, const Kvrelay__V1__GenerateResponse *msg)
{
    oa_gen *g = ctx;
    oa_call *c = g->ctx;
    keep(g, msg);
    if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA &&
        ((g->lp_obj && oa_lp_add(&g->lp, g->lp_obj, g->prompt_ids.ids, msg->delta) != 0) ||
         oa_gen_add_text(g, msg->delta->text) != 0))
        return RT_SINK_FAILED;
    return atomic_load(&c->gone) || oa_fanout_cancelled(&c->fan) ? RT_SINK_GONE : 0;
}

/* Non-streamed: the connection's thread waits for the generations, so its socket stays open. */
static int whole_cancelled(void *ctx)
{
    const oa_gen *g = ctx;
    oa_call *c = g->ctx;
    if (!atomic_load(&c->gone) && (hung_up(c->fd) || stopping(c))) atomic_store(&c->gone, 1);
    return atomic_load(&c->gone) || oa_fanout_cancelled(&c->fan);
}

/* Streamed: the connection's thread sets `gone` (its socket may be closed by now). */
static int stream_cancelled(void *ctx)
{
    const oa_gen *g = ctx;
    oa_call *c = g->ctx;
    if (!atomic_load(&c->gone) && stopping(c)) atomic_store(&c->gone, 1);
    return atomic_load(&c->gone) || oa_fanout_cancelled(&c->fan);
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

/* Streamed: a delta of generation g as a chunk of its choice, when it has text, the echoed
 * prompt, or tokens whose log-probabilities were asked (their text may still be held back);
 * with c->mu held. */
static void stream_delta_locked(oa_call *c, oa_gen *g, const Kvrelay__V1__TokenDelta *d)
{
    const char *text = d->text;
    char *joined = NULL;
    if (g->lp.echo && !g->echo_sent) { /* the prompt goes before the completion's first text */
        size_t a = g->lp.echo_len, b = strlen(d->text);
        if (!(joined = malloc(a + b + 1))) {
            c->oom = 1;
            return;
        }
        memcpy(joined, g->lp.echo, a);
        memcpy(joined + a, d->text, b + 1);
        text = joined;
        g->echo_sent = 1;
    }
    cJSON *lp = NULL;
    if (c->req.logprobs >= 0 && (lp = oa_lp_object(&g->lp)) && oa_lp_add(&g->lp, lp, g->prompt_ids.ids, d) != 0)
        c->oom = 1;
    int scored = lp && (d->n_ids || d->n_prompt_logprobs || joined);
    if (text[0] || (c->req.kind == OA_CHAT && !g->role_sent) || scored) {
        cJSON *doc = chunk_doc(c, g, text, NULL);
        cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(doc, "choices"), 0);
        if (lp && ch && cJSON_ReplaceItemInObjectCaseSensitive(ch, "logprobs", lp)) lp = NULL;
        sse_append_locked(c, doc);
    }
    cJSON_Delete(lp);
    free(joined);
}

/* Streamed: every delta becomes a chunk of its choice (stream_delta_locked); the finish, the
 * choice's last chunk with its finish reason and its generation's kvrelay figures. The usage
 * chunk follows the last choice's (stream_main). */
static int stream_send(void *ctx, const Kvrelay__V1__GenerateResponse *msg)
{
    oa_gen *g = ctx;
    oa_call *c = g->ctx;
    keep(g, msg);
    pthread_mutex_lock(&c->mu);
    if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA) {
        stream_delta_locked(c, g, msg->delta);
    } else if (msg->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_FINISH) {
        cJSON *last = chunk_doc(c, g, NULL, finish_name(g->reason));
        if (last) add_extras(last, c, &g->fig);
        sse_append_locked(c, last);
    }
    c->started = 1;
    pthread_cond_broadcast(&c->cv);
    int rc = atomic_load(&c->gone) || oa_fanout_cancelled(&c->fan) ? RT_SINK_GONE : c->oom ? RT_SINK_FAILED : 0;
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

static const rt_sink *sink_for(oa_gen *g, rt_sink *s)
{
    const oa_call *c = g->ctx;
    *s = (rt_sink){.ctx = g,
                   .send = c->req.stream ? stream_send : whole_send,
                   .cancelled = c->req.stream ? stream_cancelled : whole_cancelled,
                   .wait = oa_wait,
                   .ms_left = no_deadline};
    return s;
}

static int oa_wait(void *ctx, int64_t ms)
{
    rt_sink s;
    return sink_wait(sink_for(ctx, &s), ms);
}

static void call_free(oa_call *c)
{
    if (!c) return;
    oa_fanout_free(&c->fan);
    oa_request_free(&c->req);
    free(c->out);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c);
}

/* ------------------------------------------------------------------ serving */

static void call_unref(oa_call *c)
{
    pthread_mutex_lock(&c->mu);
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last) call_free(c);
}

/* One generation: alone, it counts against the client's limits itself; one of several runs
 * under the request's (run). */
static void run_gen(oa_gen *g)
{
    oa_call *c = g->ctx;
    rt_sink s;
    g->code = rt_generate_run(c->rt, &g->q, sink_for(g, &s), c->fan.n_gens == 1 ? &c->client : NULL, &g->st);
}

/* A request of several generations, before any starts: admitted once by the client's limits
 * (one stream slot, one token of the rate), and every generation validated, so that a refusal
 * (a prompt over --max-prompt-tokens, a bad policy) is the whole request's before any token. 0,
 * or -1 with c->code, c->st, logged and counted as rt_generate_run would. */
static int admit_several(oa_call *c)
{
    rt_router *rt = c->rt;
    if (rt_limits_acquire(rt->limits, &c->client, rt_now_ms()) != RT_LIMIT_KIND_OK) {
        kc_status_set(&c->st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s", c->client.refusal);
        c->code = c->st.code;
    }
    for (int k = 0; c->code == GRPC_STATUS_OK && k < c->fan.n_gens; k++)
        c->code = rt_generate_check(rt, &c->fan.gens[k].q, &c->st);
    if (c->code == GRPC_STATUS_OK) return 0;
    rt_limits_release(rt->limits, &c->client); /* nothing when the limits refused */
    kc_warn(c->request_id, "%s: %s", kc_status_name(c->code), c->st.details);
    kc_counter_inc(rt->m.requests[(unsigned)c->code <= GRPC_STATUS_UNAUTHENTICATED ? c->code : GRPC_STATUS_UNKNOWN], 1);
    return -1;
}

/* Every generation of the request. */
static void run(oa_call *c)
{
    int several = c->fan.n_gens > 1;
    if (several && admit_several(c) != 0) return;
    oa_fanout_run(&c->fan, run_gen);
    if (several) rt_limits_release(c->rt->limits, &c->client);
    c->code = c->fan.code;
    c->st = c->fan.st;
    if (c->code == GRPC_STATUS_OK) oa_fanout_rank(&c->fan);
}

static int respond_failure(struct MHD_Connection *conn, const oa_call *c)
{
    oa_status hs = status_of(c->code);
    return respond_json_retry(c->rt, conn, hs.http,
                              error_doc(hs.type, param_of(c, c->st.details), hs.code, c->st.details), c->request_id,
                              c->code == GRPC_STATUS_RESOURCE_EXHAUSTED ? c->client.retry_after_ms : 0);
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
        } else if (c->req.include_usage) { /* every choice's generation is over: the sums */
            oa_figures total;
            oa_fanout_total(&c->fan, &total);
            cJSON *u = doc_head(c, c->req.kind == OA_CHAT ? "chat.completion.chunk" : "text_completion");
            cJSON_AddArrayToObject(u, "choices");
            add_usage(u, &total.usage);
            sse_append_locked(c, u);
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

/* What the request parser knows of the served model. */
static oa_model model_of(const rt_router *rt)
{
    return (oa_model){.name = rt->served_model, .dir = rt->model_dir, .cfg = &rt->cfg, .tok = rt->tok,
                      .chat = rt->chat, .chat_error = rt->chat_error, .max_tokens_limit = rt->max_tokens_limit};
}

/* Log-probabilities and echo for each generation, of its own prompt: the echoed prompt starts a
 * non-streamed text. Returns 0, or -1 with err (no tokenizer, out of memory). */
static int start_logprobs(oa_call *c, char *err)
{
    err[0] = 0;
    for (int k = 0; k < c->fan.n_gens; k++) {
        oa_gen *g = &c->fan.gens[k];
        if (oa_lp_init(&g->lp, &c->req, &g->prompt_ids, c->rt->tok, err) != 0) return -1;
        if (!c->req.stream && c->req.logprobs >= 0 && !(g->lp_obj = oa_lp_object(&g->lp)))
            return snprintf(err, KR_ERR_MAX, "out of memory"), -1;
        if (!c->req.stream && g->lp.echo && oa_gen_add_text(g, g->lp.echo) != 0)
            return snprintf(err, KR_ERR_MAX, "out of memory"), -1;
    }
    return 0;
}

static int serve_generate(rt_router *rt, struct MHD_Connection *conn, oa_kind kind, const char *body, size_t len)
{
    oa_call *c = calloc(1, sizeof *c);
    if (!c) return MHD_NO;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->rt = rt;
    c->created = (int64_t)time(NULL);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    c->fd = ci ? (int)ci->connect_fd : -1;
    char peer[RT_CLIENT_NAME_MAX] = "";
    const union MHD_ConnectionInfo *ai = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ai && ai->client_addr)
        getnameinfo(ai->client_addr,
                    ai->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in),
                    peer, sizeof peer, NULL, 0, NI_NUMERICHOST);
    const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    rt_client_init(&c->client, rt->keys, auth, auth ? strlen(auth) : 0, peer);
    const char *rid = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id");
    if (rid && rid[0]) { /* the client's id goes into logs: printable ASCII only, as on gRPC */
        size_t n = strspn(rid, "!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
                               "abcdefghijklmnopqrstuvwxyz{|}~");
        if (rid[n] || n > RT_REQUEST_ID_MAX) {
            call_free(c);
            return respond_error(rt, conn, MHD_HTTP_BAD_REQUEST, "invalid_request_error", "X-Request-Id", NULL,
                                 "X-Request-Id: 1-%d bytes of printable ASCII without spaces", RT_REQUEST_ID_MAX);
        }
        snprintf(c->request_id, sizeof c->request_id, "%s", rid);
    } else {
        rt_request_id_new(rt, c->request_id, sizeof c->request_id);
    }
    snprintf(c->id, sizeof c->id, "%s-%s", kind == OA_CHAT ? "chatcmpl" : "cmpl", c->request_id);
    const oa_model m = model_of(rt);
    oa_refusal f;
    if (oa_request_parse(&m, kind, body, len, &c->req, &f) != 0) {
        kc_info(c->request_id, "HTTP %u: %s", f.http, f.msg);
        call_free(c);
        return respond_json(rt, conn, f.http, error_doc(f.type, f.param[0] ? f.param : NULL, f.code, f.msg), NULL);
    }
    c->req.q.request_id = c->request_id;
    if (oa_fanout_init(&c->fan, &c->req, c->request_id, c) != 0) {
        call_free(c);
        return respond_error(rt, conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "server_error", NULL, NULL,
                             "the router ran out of memory for the request's choices");
    }
    if (start_logprobs(c, f.msg) != 0) { /* no tokenizer to spell tokens with: the request's fault */
        int ours = rt->tok != NULL; /* else out of memory: the router's */
        kc_info(c->request_id, "HTTP %d: %s", ours ? 500 : 400, f.msg);
        const char *param = c->req.echo ? "echo" : "logprobs";
        call_free(c);
        return ours ? respond_error(rt, conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "server_error", NULL, NULL, "%s", f.msg)
                    : respond_error(rt, conn, MHD_HTTP_BAD_REQUEST, "invalid_request_error", param, NULL, "%s", f.msg);
    }
    return c->req.stream ? serve_stream(conn, c) : serve_whole(conn, c);
}

/* GET /v1/models and /v1/models/{id}: OpenAI's fields and those of vLLM's we know (root: the
 * model directory; no parent, no permission list). */
static cJSON *model_doc(const rt_router *rt)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", rt->served_model);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)(rt->started_unix_ms / 1000));
    cJSON_AddStringToObject(m, "owned_by", "kvrelay");
    cJSON_AddStringToObject(m, "root", rt->model_dir);
    cJSON_AddNullToObject(m, "parent");
    cJSON_AddNumberToObject(m, "max_model_len", rt->cfg.max_position_embeddings);
    return m;
}

/* ids[0, n) decoded with their special tokens as a JSON string (quoted and escaped, malloc'd),
 * or NULL with err. Built from the detokenizer's deltas and their lengths, so that a token
 * spelling U+0000 (a byte-level vocabulary has one) comes out as \u0000 instead of ending the
 * text, as a C string would; the deltas are valid UTF-8, kept as they are. */
static char *detokenized_json(const kr_tokenizer *tok, const uint32_t *ids, int n, char *err)
{
    kr_detok *d;
    if (kr_detok_create(tok, 0, &d, err) != KR_OK) return NULL;
    size_t len = 1, cap = 64;
    char *out = malloc(cap);
    if (out) out[0] = '"';
    for (int i = 0; out && i <= n; i++) {
        const char *delta;
        size_t dlen;
        if (i < n && kr_detok_push(d, (int32_t)ids[i], &delta, &dlen, err) != KR_OK) { /* ids in the vocabulary */
            free(out);
            kr_detok_free(d);
            return NULL;
        }
        if (i == n) kr_detok_flush(d, &delta, &dlen);
        if (len + 6 * dlen + 2 > cap) { /* an escape takes at most 6 bytes */
            while (len + 6 * dlen + 2 > cap) cap *= 2;
            char *grown = realloc(out, cap);
            if (!grown) free(out);
            out = grown;
        }
        for (size_t k = 0; out && k < dlen; k++) {
            unsigned char c = (unsigned char)delta[k];
            if (c == '"' || c == '\\') {
                out[len++] = '\\';
                out[len++] = (char)c;
            } else if (c < 0x20) {
                len += (size_t)snprintf(out + len, 7, "\\u%04x", c);
            } else {
                out[len++] = (char)c;
            }
        }
    }
    kr_detok_free(d);
    if (!out) {
        snprintf(err, KR_ERR_MAX, "out of memory");
        return NULL;
    }
    out[len++] = '"';
    out[len] = '\0';
    return out;
}

/* POST /tokenize and /detokenize, as vLLM serves them: the router's tokenizer and chat
 * template, no node involved. */
static int serve_tokenize(rt_router *rt, struct MHD_Connection *conn, int detok, const char *body, size_t len)
{
    const oa_model m = model_of(rt);
    oa_request r;
    oa_refusal f;
    if ((detok ? oa_detokenize_parse : oa_tokenize_parse)(&m, body, len, &r, &f) != 0) {
        oa_request_free(&r);
        return respond_json(rt, conn, f.http, error_doc(f.type, f.param[0] ? f.param : NULL, f.code, f.msg), NULL);
    }
    cJSON *doc = cJSON_CreateObject();
    int n = (int)r.prompt_ids.n_ids;
    if (detok) {
        char err[KR_ERR_MAX];
        if (!rt->tok) {
            oa_request_free(&r);
            cJSON_Delete(doc);
            return respond_error(rt, conn, MHD_HTTP_BAD_REQUEST, "invalid_request_error", "tokens", NULL,
                                 "the model %s has no tokenizer.json: nothing to detokenize with", rt->model_dir);
        }
        char *text = detokenized_json(rt->tok, r.ids, n, err); /* special tokens kept, as vLLM's */
        if (!text) { /* the ids are in the vocabulary: the router's failure */
            oa_request_free(&r);
            cJSON_Delete(doc);
            return respond_error(rt, conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "server_error", NULL, NULL,
                                 "the router could not detokenize: %s", err);
        }
        cJSON_AddRawToObject(doc, "prompt", text);
        free(text);
    } else {
        cJSON_AddNumberToObject(doc, "count", n);
        cJSON_AddNumberToObject(doc, "max_model_len", rt->cfg.max_position_embeddings);
        cJSON *ids = cJSON_AddArrayToObject(doc, "tokens");
        for (int i = 0; i < n && ids; i++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(r.ids[i]));
    }
    oa_request_free(&r);
    return respond_json(rt, conn, MHD_HTTP_OK, doc, NULL);
}

int rt_openai_serve(void *user, struct MHD_Connection *conn, const char *method, const char *url, const char *body,
                    size_t len)
{
    rt_router *rt = user;
    int tok_route = !strcmp(url, "/tokenize") || !strcmp(url, "/detokenize");
    if (strncmp(url, "/v1/", 4) != 0 && !tok_route)
        return respond_error(rt, conn, MHD_HTTP_NOT_FOUND, "invalid_request_error", NULL, "not_found",
                             "no route %.200s: this port serves /metrics, /healthz, /tokenize, /detokenize and the "
                             "OpenAI API under /v1/", url);
    const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    rt_apikey_why why = rt_apikeys_why(rt->keys, auth, auth ? strlen(auth) : 0);
    if (why != RT_APIKEY_WHY_OK) {
        kc_warn(NULL, "HTTP 401 on %s %.100s: %s", method, url, rt_apikey_why_message(why, 1));
        return respond_error(rt, conn, MHD_HTTP_UNAUTHORIZED, "invalid_request_error", NULL, "invalid_api_key", "%s",
                             rt_apikey_why_message(why, 1));
    }
    int get = !strcmp(method, MHD_HTTP_METHOD_GET), post = !strcmp(method, MHD_HTTP_METHOD_POST);
    if (tok_route) {
        if (!post)
            return respond_error(rt, conn, MHD_HTTP_METHOD_NOT_ALLOWED, "invalid_request_error", NULL,
                                 "method_not_allowed", "%s %s: use POST", method, url);
        if (!body)
            return respond_error(rt, conn, MHD_HTTP_CONTENT_TOO_LARGE, "invalid_request_error", NULL,
                                 "request_too_large", "the request body is over %zu bytes (--max-request-bytes)",
                                 rt->max_body);
        return serve_tokenize(rt, conn, url[1] == 'd', body, len);
    }
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
                             "the request body is over %zu bytes (--max-request-bytes)", rt->max_body);
    return serve_generate(rt, conn, kind, body, len);
}
