/*
 * rpc-server.c - the server half of rpc.h. One completion-queue thread owns the queue: it re-arms
 * a request for each registered method as soon as a call to it arrives, keeps one generic request
 * armed to answer unknown methods with UNIMPLEMENTED (without it such a call hangs until the
 * client's deadline: STACK.md), reads requests, and completes sends and statuses. Handlers run on
 * a thread per call, so one slow handler never holds up the queue or another call; the server's
 * auth hook (kc_server_set_auth), when set, runs on that thread first.
 * TLS: the server credentials come from rpc-tls.c when cfg->tls turns it on.
 * Not here: client-streaming or bidi methods, thread pools. Test: ctest -R test_grpc.
 *
 * Call lifetime: a kc_call holds a reference count under its mutex; each outstanding batch, the
 * handler thread and the "not yet finished" state hold one. The call (and its grpc_call) is freed
 * by whoever drops the last reference, which is after every batch completed (STACK.md: free a
 * call only after all its batches completed).
 */
#include "log.h"
#include "rpc.h"

#include <grpc/byte_buffer.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define KC_MAX_CALLS_DEFAULT 1024

/* What a completion-queue tag points at: the first member of every tagged object. */
typedef enum {
    TAG_REQUEST,   /* an armed request for a registered method (kc_pending) */
    TAG_GENERIC,   /* the armed request for any other method (kc_generic) */
    TAG_UNIMPL,    /* the UNIMPLEMENTED answer's batch (kc_generic) */
    TAG_RECV,      /* a streaming call's request message (kc_call) */
    TAG_CLOSE,     /* RECV_CLOSE_ON_SERVER: the call ended or was cancelled (kc_call) */
    TAG_SEND,      /* one SEND_MESSAGE (kc_call) */
    TAG_STATUS,    /* SEND_STATUS_FROM_SERVER (kc_call) */
    TAG_SHUTDOWN,  /* grpc_server_shutdown_and_notify (kc_server) */
} tag_kind;

typedef struct {
    tag_kind kind;
    void *obj;
} kc_tag;

typedef struct kc_method {
    kc_server *srv;
    char *path;
    void *handle; /* from grpc_server_register_method */
    const ProtobufCMessageDescriptor *req_desc;
    kc_handler fn;
    void *user;
    int streaming;
} kc_method;

/* One armed grpc_server_request_registered_call; handed to the call when it arrives. */
typedef struct {
    kc_tag tag;
    kc_method *m;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload; /* unary: the request, read by gRPC */
} kc_pending;

/* The armed generic request, then (after arrival) the UNIMPLEMENTED answer's state. */
typedef struct {
    kc_tag tag;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
    int cancelled;
} kc_generic;

struct kc_server {
    grpc_server *server;
    grpc_completion_queue *cq;
    pthread_t thread;
    int started;
    size_t max_message_bytes;
    int64_t max_deadline_ms; /* <= 0: none */
    int max_calls;
    kc_method *methods;
    int n_methods;
    kc_auth_fn auth; /* NULL: every call goes to its handler */
    void *auth_user;
    kc_tag shutdown_tag;

    pthread_mutex_t mu; /* guards the fields below */
    pthread_cond_t cv;  /* live_calls or shutdown_done changed */
    int shutting_down;
    int shutdown_done;
    int live_calls; /* kc_call objects not yet freed */
};

struct kc_call {
    kc_tag t_recv, t_close, t_send, t_status;
    kc_server *srv;
    kc_method *m;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *recv_bb; /* the request (unary: from the pending; streaming: RECV_MESSAGE) */
    int close_cancelled;       /* written by gRPC when TAG_CLOSE completes */

    pthread_mutex_t mu; /* guards everything below; never held across a blocking wait */
    pthread_cond_t cv;  /* cancelled changed */
    int refs;
    int cancelled;
    int finished;       /* kc_call_finish (or the handler's return) asked for the status */
    int status_started;
    int initial_md_sent;
    int n_sent;
    grpc_byte_buffer *in_flight; /* the one SEND_MESSAGE gRPC allows per call */
    grpc_byte_buffer **queue;    /* waiting to be sent, FIFO, [qhead, qhead + qlen) mod qcap */
    size_t qhead, qlen, qcap;
    grpc_status_code code;
    char details[256];
};

/* ------------------------------------------------------------------ call lifetime */

static void call_free(kc_call *c)
{
    kc_server *srv = c->srv;
    while (c->qlen) { /* only non-empty when the call was cancelled mid-stream */
        grpc_byte_buffer_destroy(c->queue[c->qhead]);
        c->qhead = (c->qhead + 1) % c->qcap;
        c->qlen--;
    }
    free(c->queue);
    if (c->recv_bb)
        grpc_byte_buffer_destroy(c->recv_bb);
    grpc_metadata_array_destroy(&c->md);
    grpc_call_unref(c->call);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
    pthread_mutex_lock(&srv->mu);
    srv->live_calls--;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

/* Drops one reference; the caller holds c->mu, which this releases. */
static void call_unref_unlock(kc_call *c)
{
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->mu);
    if (last)
        call_free(c);
}

static void call_unref(kc_call *c)
{
    pthread_mutex_lock(&c->mu);
    call_unref_unlock(c);
}

/* ------------------------------------------------------------------ sending (c->mu held) */

static int start_send_locked(kc_call *c, grpc_byte_buffer *bb)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->initial_md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->initial_md_sent = 1;
    }
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = bb;
    if (grpc_call_start_batch(c->call, ops, n, &c->t_send, NULL) != GRPC_CALL_OK) {
        grpc_byte_buffer_destroy(bb);
        c->cancelled = 1;
        return -1;
    }
    c->in_flight = bb; /* alive until TAG_SEND completes */
    c->refs++;
    return 0;
}

/* Sends the status; the reference "not yet finished" moves to the status batch. Returns 1 when
 * that reference was dropped here instead (the caller must unref-unlock). */
static int start_status_locked(kc_call *c)
{
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->initial_md_sent) {
        ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
        c->initial_md_sent = 1;
    }
    grpc_slice details = grpc_slice_from_copied_string(c->details);
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = c->code;
    ops[n++].data.send_status_from_server.status_details = &details; /* copied by gRPC */
    c->status_started = 1;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->t_status, NULL);
    grpc_slice_unref(details);
    return e != GRPC_CALL_OK;
}

/* ------------------------------------------------------------------ kc_call_* */

int kc_call_send(kc_call *c, const ProtobufCMessage *msg)
{
    grpc_byte_buffer *bb;
    kc_status st;
    if (kc_message_pack(msg, c->srv->max_message_bytes, &bb, &st) != 0) {
        kc_error(NULL, "kc_server: %s: cannot send: %s", c->m->path, st.details);
        return -1;
    }
    pthread_mutex_lock(&c->mu);
    if (c->finished || c->cancelled || (!c->m->streaming && c->n_sent > 0)) {
        pthread_mutex_unlock(&c->mu);
        grpc_byte_buffer_destroy(bb);
        return -1;
    }
    c->n_sent++;
    int rc = 0;
    if (!c->in_flight) {
        rc = start_send_locked(c, bb);
    } else {
        if (c->qlen == c->qcap) {
            size_t cap = c->qcap ? 2 * c->qcap : 8;
            grpc_byte_buffer **q = malloc(cap * sizeof *q);
            if (!q) {
                pthread_mutex_unlock(&c->mu);
                grpc_byte_buffer_destroy(bb);
                return -1;
            }
            for (size_t i = 0; i < c->qlen; i++)
                q[i] = c->queue[(c->qhead + i) % c->qcap];
            free(c->queue);
            c->queue = q;
            c->qhead = 0;
            c->qcap = cap;
        }
        c->queue[(c->qhead + c->qlen) % c->qcap] = bb;
        c->qlen++;
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

size_t kc_call_backlog(kc_call *c)
{
    pthread_mutex_lock(&c->mu);
    size_t n = c->qlen + (c->in_flight != NULL);
    pthread_mutex_unlock(&c->mu);
    return n;
}

int kc_call_error(kc_call *c, grpc_status_code code, const char *fmt, ...)
{
    pthread_mutex_lock(&c->mu);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->details, sizeof c->details, fmt, ap);
    va_end(ap);
    pthread_mutex_unlock(&c->mu);
    return (int)code;
}

static void call_finish_v(kc_call *c, grpc_status_code code, const char *fmt, va_list ap)
{
    pthread_mutex_lock(&c->mu);
    if (c->finished) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    c->finished = 1;
    c->code = code;
    if (fmt)
        vsnprintf(c->details, sizeof c->details, fmt, ap);
    if (c->in_flight) { /* the send completion starts the status after the queue drains */
        pthread_mutex_unlock(&c->mu);
        return;
    }
    if (start_status_locked(c))
        call_unref_unlock(c);
    else
        pthread_mutex_unlock(&c->mu);
}

void kc_call_finish(kc_call *c, grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    call_finish_v(c, code, fmt, ap);
    va_end(ap);
}

/* The same from inside this file, where the details are already formatted (or absent). */
static void call_finish(kc_call *c, grpc_status_code code, const char *details)
{
    if (details)
        kc_call_finish(c, code, "%s", details);
    else
        kc_call_finish(c, code, NULL);
}

int kc_call_cancelled(kc_call *c)
{
    pthread_mutex_lock(&c->mu);
    int v = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    return v || kc_call_ms_left(c) <= 0; /* the server's deadline is not gRPC's: checked here */
}

int kc_call_wait(kc_call *c, int64_t ms)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    int64_t left = kc_call_ms_left(c);
    if (ms > left)
        ms = left;
    if (ms < 0)
        ms = 0;
    until.tv_sec += (time_t)(ms / 1000);
    until.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&c->mu);
    while (!c->cancelled && pthread_cond_timedwait(&c->cv, &c->mu, &until) != ETIMEDOUT) {
    }
    int v = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    return v || kc_call_ms_left(c) <= 0;
}

int64_t kc_call_ms_left(kc_call *c)
{
    if (gpr_time_cmp(c->deadline, gpr_inf_future(c->deadline.clock_type)) == 0)
        return INT64_MAX;
    gpr_timespec d = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

const char *kc_call_method(const kc_call *c)
{
    return c->m->path;
}

void kc_call_peer(const kc_call *c, char *out, size_t cap)
{
    char *peer = grpc_call_get_peer(c->call);
    const char *p = peer ? peer : "";
    size_t n = strlen(p);
    if (!strncmp(p, "ipv4:", 5) || !strncmp(p, "ipv6:", 5)) { /* "ipv4:HOST:PORT", "ipv6:[HOST]:PORT" */
        p += 5;
        const char *colon = strrchr(p, ':');
        n = colon ? (size_t)(colon - p) : strlen(p);
        if (n >= 2 && p[0] == '[' && p[n - 1] == ']') {
            p++;
            n -= 2;
        }
    }
    snprintf(out, cap, "%.*s", (int)n, p);
    gpr_free(peer);
}

/* c->md was filled by gRPC when the call arrived and is never written again, so no lock. */
const char *kc_call_metadata(const kc_call *c, const char *key, size_t *len)
{
    size_t klen = strlen(key);
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_slice *k = &c->md.metadata[i].key;
        if (GRPC_SLICE_LENGTH(*k) == klen &&
            strncasecmp((const char *)GRPC_SLICE_START_PTR(*k), key, klen) == 0) {
            const grpc_slice *v = &c->md.metadata[i].value;
            *len = GRPC_SLICE_LENGTH(*v);
            return (const char *)GRPC_SLICE_START_PTR(*v);
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ handler threads */

static void *handler_main(void *arg)
{
    kc_call *c = arg;
    ProtobufCMessage *req = NULL;
    kc_status st;
    kc_server *srv = c->srv;
    if (srv->auth) { /* before decoding: a refused client's bytes reach no parser */
        char details[sizeof c->details];
        details[0] = '\0';
        int code = srv->auth(srv->auth_user, c, details, sizeof details);
        if (code != GRPC_STATUS_OK) {
            call_finish(c, (grpc_status_code)code, details);
            call_unref(c);
            return NULL;
        }
    }
    if (kc_message_unpack(c->recv_bb, c->m->req_desc, c->srv->max_message_bytes, &req, &st) != 0) {
        call_finish(c, st.code, st.details); /* malformed: the handler never sees it */
        call_unref(c);
        return NULL;
    }
    int rc = c->m->fn(c, req, c->m->user);
    kc_message_free(req);
    if (rc != KC_DETACHED) {
        pthread_mutex_lock(&c->mu);
        int no_answer = !c->m->streaming && c->n_sent == 0 && rc == GRPC_STATUS_OK;
        pthread_mutex_unlock(&c->mu);
        if (no_answer)
            call_finish(c, GRPC_STATUS_INTERNAL, "handler returned OK without a response");
        else
            call_finish(c, (grpc_status_code)rc, NULL);
    }
    call_unref(c);
    return NULL;
}

/* The request is here (or is missing): start the handler, or answer without one. */
static void call_dispatch(kc_call *c)
{
    if (!c->recv_bb) {
        call_finish(c, GRPC_STATUS_INVALID_ARGUMENT, "no request message");
        return;
    }
    kc_server *srv = c->srv;
    pthread_mutex_lock(&srv->mu);
    int over = srv->live_calls > srv->max_calls;
    pthread_mutex_unlock(&srv->mu);
    if (over) {
        kc_call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, "server busy: more than %d calls",
                       srv->max_calls);
        return;
    }
    pthread_mutex_lock(&c->mu);
    c->refs++; /* the handler thread's */
    pthread_mutex_unlock(&c->mu);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    int e = pthread_create(&t, &attr, handler_main, c);
    pthread_attr_destroy(&attr);
    if (e != 0) {
        kc_error(NULL, "kc_server: %s: cannot start a handler thread: %s", c->m->path, strerror(e));
        call_finish(c, GRPC_STATUS_UNAVAILABLE, "server cannot start a handler");
        call_unref(c);
    }
}

/* ------------------------------------------------------------------ arming requests */

static void arm_method(kc_method *m)
{
    kc_server *srv = m->srv;
    kc_pending *p = calloc(1, sizeof *p);
    if (!p) {
        kc_error(NULL, "kc_server: %s: out of memory re-arming; the method stops answering", m->path);
        return;
    }
    p->tag = (kc_tag){TAG_REQUEST, p};
    p->m = m;
    grpc_metadata_array_init(&p->md);
    grpc_call_error e = grpc_server_request_registered_call(
        srv->server, m->handle, &p->call, &p->deadline, &p->md,
        m->streaming ? NULL : &p->payload, srv->cq, srv->cq, &p->tag);
    if (e != GRPC_CALL_OK) { /* only during shutdown */
        grpc_metadata_array_destroy(&p->md);
        free(p);
    }
}

static void arm_generic(kc_server *srv)
{
    kc_generic *g = calloc(1, sizeof *g);
    if (!g) {
        kc_error(NULL, "kc_server: out of memory re-arming the generic request");
        return;
    }
    g->tag = (kc_tag){TAG_GENERIC, g};
    grpc_call_details_init(&g->details);
    grpc_metadata_array_init(&g->md);
    if (grpc_server_request_call(srv->server, &g->call, &g->details, &g->md, srv->cq, srv->cq,
                                 &g->tag) != GRPC_CALL_OK) {
        grpc_call_details_destroy(&g->details);
        grpc_metadata_array_destroy(&g->md);
        free(g);
    }
}

static void generic_free(kc_generic *g)
{
    if (g->call)
        grpc_call_unref(g->call);
    grpc_call_details_destroy(&g->details);
    grpc_metadata_array_destroy(&g->md);
    free(g);
}

static int server_accepting(kc_server *srv)
{
    pthread_mutex_lock(&srv->mu);
    int v = !srv->shutting_down;
    pthread_mutex_unlock(&srv->mu);
    return v;
}

/* A call to a method nobody registered: answer UNIMPLEMENTED at once. */
static void on_generic(kc_server *srv, kc_generic *g, int ok)
{
    if (ok && server_accepting(srv))
        arm_generic(srv);
    if (!ok) { /* the server is shutting down: the armed tag comes back empty */
        generic_free(g);
        return;
    }
    char details[200];
    snprintf(details, sizeof details, "unknown method %.*s",
             (int)GRPC_SLICE_LENGTH(g->details.method),
             (const char *)GRPC_SLICE_START_PTR(g->details.method));
    grpc_slice slice = grpc_slice_from_copied_string(details);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = GRPC_STATUS_UNIMPLEMENTED;
    ops[1].data.send_status_from_server.status_details = &slice;
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &g->cancelled;
    g->tag.kind = TAG_UNIMPL;
    grpc_call_error e = grpc_call_start_batch(g->call, ops, 3, &g->tag, NULL);
    grpc_slice_unref(slice);
    if (e != GRPC_CALL_OK)
        generic_free(g);
}

static kc_call *call_create(kc_server *srv, kc_pending *p)
{
    kc_call *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->t_recv = (kc_tag){TAG_RECV, c};
    c->t_close = (kc_tag){TAG_CLOSE, c};
    c->t_send = (kc_tag){TAG_SEND, c};
    c->t_status = (kc_tag){TAG_STATUS, c};
    c->srv = srv;
    c->m = p->m;
    c->call = p->call;
    c->deadline = p->deadline;
    if (srv->max_deadline_ms > 0) { /* the server's own deadline, when sooner than the client's */
        gpr_timespec cap = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                        gpr_time_from_millis(srv->max_deadline_ms, GPR_TIMESPAN));
        if (gpr_time_cmp(gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC), cap) > 0)
            c->deadline = cap;
    }
    c->md = p->md; /* moved */
    c->recv_bb = p->payload;
    c->code = GRPC_STATUS_OK;
    pthread_mutex_init(&c->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* kc_call_wait measures in monotonic time */
    pthread_cond_init(&c->cv, &ca);
    pthread_condattr_destroy(&ca);
    c->refs = 1; /* "not yet finished": dropped when the status batch completes */
    pthread_mutex_lock(&srv->mu);
    srv->live_calls++;
    pthread_mutex_unlock(&srv->mu);
    return c;
}

static void on_request(kc_server *srv, kc_pending *p, int ok)
{
    kc_method *m = p->m;
    if (ok && server_accepting(srv))
        arm_method(m); /* before anything else: the next call must find a request armed */
    if (!ok) {
        grpc_metadata_array_destroy(&p->md);
        if (p->payload)
            grpc_byte_buffer_destroy(p->payload);
        free(p);
        return;
    }
    kc_call *c = call_create(srv, p);
    if (!c) {
        kc_error(NULL, "kc_server: %s: out of memory for a call; cancelling it", m->path);
        grpc_call_cancel_with_status(p->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory", NULL);
        grpc_call_unref(p->call);
        grpc_metadata_array_destroy(&p->md);
        if (p->payload)
            grpc_byte_buffer_destroy(p->payload);
        free(p);
        return;
    }
    free(p);
    /* RECV_CLOSE_ON_SERVER in a batch of its own completes when the call ends for any reason:
     * that is how a handler learns the client went away (STACK.md). */
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    pthread_mutex_lock(&c->mu);
    if (grpc_call_start_batch(c->call, &op, 1, &c->t_close, NULL) == GRPC_CALL_OK)
        c->refs++;
    else
        c->cancelled = 1;
    pthread_mutex_unlock(&c->mu);
    if (!m->streaming) {
        call_dispatch(c);
        return;
    }
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_bb;
    pthread_mutex_lock(&c->mu);
    if (grpc_call_start_batch(c->call, &op, 1, &c->t_recv, NULL) == GRPC_CALL_OK) {
        c->refs++;
        pthread_mutex_unlock(&c->mu);
    } else {
        pthread_mutex_unlock(&c->mu);
        call_finish(c, GRPC_STATUS_INTERNAL, "cannot receive the request");
    }
}

/* ------------------------------------------------------------------ completions */

static void on_call_event(kc_call *c, tag_kind kind, int ok)
{
    switch (kind) {
    case TAG_RECV:
        if (ok)
            call_dispatch(c); /* a NULL message (client sent none) is answered there */
        else
            call_finish(c, GRPC_STATUS_CANCELLED, "call ended before its request arrived");
        call_unref(c);
        return;
    case TAG_CLOSE:
        pthread_mutex_lock(&c->mu);
        /* Before our status went out, any close means the client will not read more. */
        if (c->close_cancelled || !c->status_started)
            c->cancelled = 1;
        pthread_cond_broadcast(&c->cv);
        call_unref_unlock(c);
        return;
    case TAG_SEND: {
        pthread_mutex_lock(&c->mu);
        grpc_byte_buffer_destroy(c->in_flight);
        c->in_flight = NULL;
        if (!ok) { /* the client is gone: what is queued will never be read */
            c->cancelled = 1;
            pthread_cond_broadcast(&c->cv);
            while (c->qlen) {
                grpc_byte_buffer_destroy(c->queue[c->qhead]);
                c->qhead = (c->qhead + 1) % c->qcap;
                c->qlen--;
            }
        }
        int drop_finish_ref = 0;
        if (c->qlen) {
            grpc_byte_buffer *bb = c->queue[c->qhead];
            c->qhead = (c->qhead + 1) % c->qcap;
            c->qlen--;
            start_send_locked(c, bb);
        }
        if (!c->in_flight && c->finished && !c->status_started)
            drop_finish_ref = start_status_locked(c);
        if (drop_finish_ref)
            c->refs--; /* cannot reach 0 here: this batch's reference is still held */
        call_unref_unlock(c);
        return;
    }
    case TAG_STATUS:
        call_unref(c); /* "not yet finished" */
        return;
    default:
        return;
    }
}

static void *cq_main(void *arg)
{
    kc_server *srv = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        kc_tag *tag = ev.tag;
        switch (tag->kind) {
        case TAG_REQUEST:
            on_request(srv, tag->obj, ev.success);
            break;
        case TAG_GENERIC:
            on_generic(srv, tag->obj, ev.success);
            break;
        case TAG_UNIMPL:
            generic_free(tag->obj);
            break;
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&srv->mu);
            srv->shutdown_done = 1;
            pthread_cond_broadcast(&srv->cv);
            pthread_mutex_unlock(&srv->mu);
            break;
        default:
            on_call_event(tag->obj, tag->kind, ev.success);
            break;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ server */

int kc_server_create(const char *addr, const kc_server_config *cfg, kc_server **out, int *port,
                     kc_status *st)
{
    kc_server *srv = calloc(1, sizeof *srv);
    if (!srv) {
        st->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(st->details, sizeof st->details, "out of memory");
        return -1;
    }
    srv->max_message_bytes = cfg && cfg->max_message_bytes ? cfg->max_message_bytes
                                                           : KC_MAX_MESSAGE_DEFAULT;
    srv->max_calls = cfg && cfg->max_calls > 0 ? cfg->max_calls : KC_MAX_CALLS_DEFAULT;
    srv->max_deadline_ms = cfg && cfg->max_deadline_ms ? cfg->max_deadline_ms : KC_MAX_DEADLINE_DEFAULT_MS;
    srv->shutdown_tag = (kc_tag){TAG_SHUTDOWN, srv};
    pthread_mutex_init(&srv->mu, NULL);
    pthread_cond_init(&srv->cv, NULL);
    grpc_init(); /* matched in kc_server_destroy */
    int lim = srv->max_message_bytes > INT_MAX ? INT_MAX : (int)srv->max_message_bytes;
    /* SO_REUSEPORT off: gRPC turns it on by default, and then a second server on a busy port
     * "succeeds" and silently shares the traffic instead of failing to start. */
    grpc_arg args[3] = {
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, .value.integer = lim},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, .value.integer = lim},
        {.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT, .value.integer = 0},
    };
    grpc_channel_args cargs = {.num_args = 3, .args = args};
    srv->server = grpc_server_create(&cargs, NULL);
    srv->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(srv->server, srv->cq, NULL);
    grpc_server_credentials *creds = kc_tls_enabled(cfg ? cfg->tls : NULL)
                                         ? kc_tls_server_credentials(cfg->tls, st)
                                         : grpc_insecure_server_credentials_create();
    if (!creds) {
        kc_server_destroy(srv);
        return -1;
    }
    int bound = grpc_server_add_http2_port(srv->server, addr, creds);
    grpc_server_credentials_release(creds);
    if (bound <= 0) {
        st->code = GRPC_STATUS_UNAVAILABLE;
        snprintf(st->details, sizeof st->details,
                 "cannot listen on '%s' (address in use, or not HOST:PORT)", addr);
        kc_server_destroy(srv);
        return -1;
    }
    *port = bound;
    *out = srv;
    return 0;
}

static int add_method(kc_server *srv, const char *path, const ProtobufCMessageDescriptor *req_desc,
                      kc_handler fn, void *user, int streaming)
{
    if (srv->started || !path || path[0] != '/' || !req_desc || !fn)
        return -1;
    for (int i = 0; i < srv->n_methods; i++)
        if (strcmp(srv->methods[i].path, path) == 0)
            return -1;
    kc_method *ms = realloc(srv->methods, (size_t)(srv->n_methods + 1) * sizeof *ms);
    if (!ms)
        return -1;
    srv->methods = ms;
    char *copy = strdup(path);
    if (!copy)
        return -1;
    void *handle = grpc_server_register_method(
        srv->server, copy, NULL,
        streaming ? GRPC_SRM_PAYLOAD_NONE : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!handle) {
        free(copy);
        return -1;
    }
    /* kc_method addresses are handed to the queue only after start, so realloc here is safe */
    ms[srv->n_methods++] = (kc_method){.srv = srv, .path = copy, .handle = handle,
                                       .req_desc = req_desc, .fn = fn, .user = user,
                                       .streaming = streaming};
    return 0;
}

int kc_server_add_unary(kc_server *srv, const char *path, const ProtobufCMessageDescriptor *req_desc,
                        kc_handler fn, void *user)
{
    return add_method(srv, path, req_desc, fn, user, 0);
}

int kc_server_add_stream(kc_server *srv, const char *path,
                         const ProtobufCMessageDescriptor *req_desc, kc_handler fn, void *user)
{
    return add_method(srv, path, req_desc, fn, user, 1);
}

int kc_server_set_auth(kc_server *srv, kc_auth_fn fn, void *user)
{
    if (srv->started)
        return -1;
    srv->auth = fn;
    srv->auth_user = user;
    return 0;
}

int kc_server_start(kc_server *srv, kc_status *st)
{
    if (srv->started) {
        st->code = GRPC_STATUS_FAILED_PRECONDITION;
        snprintf(st->details, sizeof st->details, "server already started");
        return -1;
    }
    grpc_server_start(srv->server);
    srv->started = 1;
    for (int i = 0; i < srv->n_methods; i++)
        arm_method(&srv->methods[i]);
    arm_generic(srv);
    int e = pthread_create(&srv->thread, NULL, cq_main, srv);
    if (e != 0) {
        st->code = GRPC_STATUS_UNAVAILABLE;
        snprintf(st->details, sizeof st->details, "cannot start the server thread: %s", strerror(e));
        srv->started = 0; /* destroy will drain the queue inline */
        srv->thread = (pthread_t)0;
        return -1;
    }
    return 0;
}

/* Without the queue thread (never started, or it failed to start): drain inline, freeing what
 * comes back. Only armed requests can be in the queue then. */
static void drain_inline(kc_server *srv)
{
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        kc_tag *tag = ev.tag;
        if (tag->kind == TAG_REQUEST)
            on_request(srv, tag->obj, 0);
        else if (tag->kind == TAG_GENERIC)
            on_generic(srv, tag->obj, 0);
    }
}

void kc_server_destroy(kc_server *srv)
{
    if (!srv)
        return;
    pthread_mutex_lock(&srv->mu);
    srv->shutting_down = 1;
    pthread_mutex_unlock(&srv->mu);
    int threaded = srv->started;
    /* STACK.md's order: stop accepting, cancel what is in flight (handlers see
     * kc_call_cancelled), and wait until the server says it is done and every call is freed. */
    grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
    grpc_server_cancel_all_calls(srv->server);
    if (threaded) {
        pthread_mutex_lock(&srv->mu);
        while (!srv->shutdown_done || srv->live_calls > 0)
            pthread_cond_wait(&srv->cv, &srv->mu);
        pthread_mutex_unlock(&srv->mu);
    }
    grpc_completion_queue_shutdown(srv->cq);
    if (threaded)
        pthread_join(srv->thread, NULL); /* it drains the queue to GRPC_QUEUE_SHUTDOWN */
    else
        drain_inline(srv);
    grpc_server_destroy(srv->server);
    grpc_completion_queue_destroy(srv->cq);
    for (int i = 0; i < srv->n_methods; i++)
        free(srv->methods[i].path);
    free(srv->methods);
    pthread_cond_destroy(&srv->cv);
    pthread_mutex_destroy(&srv->mu);
    free(srv);
    grpc_shutdown();
}
