/*
 * rpc.c - the message and client halves of rpc.h: protobuf-c <-> grpc_byte_buffer, channels, the
 * blocking unary call and the server-streaming reader. Each call gets its own pluck completion
 * queue, so any number of threads can make calls on one channel without a shared event loop.
 * Not here: the server (rpc-server.c). Test: ctest -R test_grpc.
 */
#include "rpc.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kc_status_set(kc_status *st, grpc_status_code code, const char *fmt, ...)
{
    if (!st)
        return;
    st->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(st->details, sizeof st->details, fmt, ap);
    va_end(ap);
}

static void status_from_slice(kc_status *st, grpc_status_code code, grpc_slice details)
{
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof st->details)
        n = sizeof st->details - 1;
    st->code = code;
    memcpy(st->details, GRPC_SLICE_START_PTR(details), n);
    st->details[n] = '\0';
}

const char *kc_status_name(grpc_status_code code)
{
    static const char *const names[] = {
        "OK",           "CANCELLED",      "UNKNOWN",       "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
        "NOT_FOUND",    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",  "UNIMPLEMENTED",      "INTERNAL",
        "UNAVAILABLE",  "DATA_LOSS",      "UNAUTHENTICATED",
    };
    if ((int)code >= 0 && (size_t)code < sizeof names / sizeof names[0])
        return names[code];
    return "STATUS_?";
}

/* ------------------------------------------------------------------ messages */

int kc_message_pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out,
                    kc_status *st)
{
    if (max_bytes == 0)
        max_bytes = KC_MAX_MESSAGE_DEFAULT;
    size_t n = protobuf_c_message_get_packed_size(msg);
    if (n > max_bytes) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s of %zu bytes is over the %zu-byte limit",
                   msg->descriptor->name, n, max_bytes);
        return -1;
    }
    grpc_slice slice = grpc_slice_malloc(n);
    size_t packed = protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(slice));
    if (packed != n) { /* a protobuf-c bug or a message mutated concurrently */
        grpc_slice_unref(slice);
        kc_status_set(st, GRPC_STATUS_INTERNAL, "%s packed to %zu bytes, expected %zu",
                   msg->descriptor->name, packed, n);
        return -1;
    }
    *out = grpc_raw_byte_buffer_create(&slice, 1); /* takes its own reference */
    grpc_slice_unref(slice);
    return 0;
}

/* Reads a varint at *p (< end) into *v; 0, or -1 when it runs past end or 10 bytes. */
static int wire_varint(const uint8_t **p, const uint8_t *end, uint64_t *v)
{
    *v = 0;
    for (int shift = 0; *p < end && shift < 70; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80))
            return 0;
    }
    return -1;
}

/* The first string field of a `desc` message's wire bytes [p, end), sub-messages included, that
 * holds a NUL byte: its descriptor (and its message's in *owner), or NULL. protobuf-c hands a
 * string over NUL-terminated without its length, so such a string would go on cut at the NUL.
 * Only for bytes that protobuf-c parsed: the walk stops quietly at what it does not follow. */
static const ProtobufCFieldDescriptor *nul_string(const ProtobufCMessageDescriptor *desc,
                                                  const uint8_t *p, const uint8_t *end, int depth,
                                                  const ProtobufCMessageDescriptor **owner)
{
    while (p < end && depth < 32) {
        uint64_t tag, n;
        if (wire_varint(&p, end, &tag) != 0)
            return NULL;
        switch (tag & 7) {
        case 0: /* varint */
            if (wire_varint(&p, end, &n) != 0)
                return NULL;
            break;
        case 1: /* 64-bit */
            p += (size_t)(end - p) < 8 ? (size_t)(end - p) : 8;
            break;
        case 5: /* 32-bit */
            p += (size_t)(end - p) < 4 ? (size_t)(end - p) : 4;
            break;
        case 2: { /* length-delimited: a string, bytes, a message or a packed array */
            if (wire_varint(&p, end, &n) != 0 || n > (uint64_t)(end - p))
                return NULL;
            const ProtobufCFieldDescriptor *f =
                tag >> 3 <= UINT32_MAX ? protobuf_c_message_descriptor_get_field(desc, (unsigned)(tag >> 3))
                                       : NULL;
            if (f && f->type == PROTOBUF_C_TYPE_STRING && memchr(p, 0, (size_t)n)) {
                *owner = desc;
                return f;
            }
            if (f && f->type == PROTOBUF_C_TYPE_MESSAGE) {
                const ProtobufCFieldDescriptor *in = nul_string(f->descriptor, p, p + n, depth + 1, owner);
                if (in)
                    return in;
            }
            p += n;
            break;
        }
        default: /* groups: protobuf-c skips them, and proto3 has none */
            return NULL;
        }
    }
    return NULL;
}

int kc_message_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                      size_t max_bytes, ProtobufCMessage **out, kc_status *st)
{
    if (max_bytes == 0)
        max_bytes = KC_MAX_MESSAGE_DEFAULT;
    grpc_byte_buffer_reader reader;
    if (!grpc_byte_buffer_reader_init(&reader, bb)) { /* e.g. undecompressable */
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "%s: unreadable (compressed?) payload",
                   desc->name);
        return -1;
    }
    grpc_slice slice = grpc_byte_buffer_reader_readall(&reader);
    grpc_byte_buffer_reader_destroy(&reader);
    size_t n = GRPC_SLICE_LENGTH(slice);
    if (n > max_bytes) {
        grpc_slice_unref(slice);
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s of %zu bytes is over the %zu-byte limit",
                   desc->name, n, max_bytes);
        return -1;
    }
    const uint8_t *bytes = GRPC_SLICE_START_PTR(slice);
    ProtobufCMessage *msg = protobuf_c_message_unpack(desc, NULL, n, bytes);
    const ProtobufCMessageDescriptor *owner = NULL;
    const ProtobufCFieldDescriptor *nul = msg ? nul_string(desc, bytes, bytes + n, 0, &owner) : NULL;
    grpc_slice_unref(slice);
    if (!msg) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "malformed %s (%zu bytes do not parse)",
                   desc->name, n);
        return -1;
    }
    if (nul) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s: %s.%s holds U+0000 (a NUL character), which kvrelay does not take in "
                      "text", nul->name, owner->name, nul->name);
        protobuf_c_message_free_unpacked(msg, NULL);
        return -1;
    }
    *out = msg;
    return 0;
}

void kc_message_free(ProtobufCMessage *msg)
{
    if (msg)
        protobuf_c_message_free_unpacked(msg, NULL);
}

/* ------------------------------------------------------------------ channel */

struct kc_channel {
    grpc_channel *channel;
    size_t max_message_bytes;
};

int kc_channel_create(const char *target, size_t max_message_bytes, kc_channel **out,
                      kc_status *st)
{
    kc_channel_opts opts = {.max_message_bytes = max_message_bytes};
    return kc_channel_create_opts(target, &opts, out, st);
}

int kc_channel_create_opts(const char *target, const kc_channel_opts *opts, kc_channel **out,
                           kc_status *st)
{
    size_t max_message_bytes = opts->max_message_bytes;
    if (max_message_bytes == 0)
        max_message_bytes = KC_MAX_MESSAGE_DEFAULT;
    int lim = max_message_bytes > INT_MAX ? INT_MAX : (int)max_message_bytes;
    kc_channel *ch = calloc(1, sizeof *ch);
    if (!ch) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return -1;
    }
    grpc_init(); /* reference-counted; matched in kc_channel_destroy */
    grpc_arg args[8];
    size_t n = 0;
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                           .value.integer = lim};
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                           .value.integer = lim};
    if (opts->keepalive_ms > 0) {
        args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIME_MS,
                               .value.integer = opts->keepalive_ms};
        args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                               .value.integer = opts->keepalive_ms};
        /* keep pinging a quiet stream (a watch with no events): gRPC stops after 2 by default */
        args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                               .key = GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, .value.integer = 0};
    }
    if (opts->max_reconnect_backoff_ms > 0) {
        int b = opts->max_reconnect_backoff_ms;
        args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                               .value.integer = b};
        args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                               .key = GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
                               .value.integer = b < 200 ? b : 200};
        /* also the least time a connection attempt gets (default 20 s): a peer that accepts
         * while it is still starting can hold an attempt that long */
        args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
                               .value.integer = 2 * b};
    }
    grpc_channel_args cargs = {.num_args = n, .args = args};
    grpc_channel_credentials *creds = opts->creds;
    if (!creds)
        creds = grpc_insecure_credentials_create();
    ch->channel = grpc_channel_create(target, creds, &cargs);
    if (!opts->creds)
        grpc_channel_credentials_release(creds);
    if (!ch->channel) { /* 1.51 returns a lame channel rather than NULL; be safe anyway */
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "cannot create a channel to '%s'", target);
        grpc_shutdown();
        free(ch);
        return -1;
    }
    ch->max_message_bytes = max_message_bytes;
    *out = ch;
    return 0;
}

void kc_channel_destroy(kc_channel *ch)
{
    if (!ch)
        return;
    grpc_channel_destroy(ch->channel);
    free(ch);
    grpc_shutdown();
}

static gpr_timespec deadline_after(int64_t timeout_ms)
{
    if (timeout_ms <= 0)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

int kc_channel_wait_connected(kc_channel *ch, int64_t timeout_ms)
{
    gpr_timespec deadline = deadline_after(timeout_ms);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    int ready = 0;
    for (;;) {
        grpc_connectivity_state s = grpc_channel_check_connectivity_state(ch->channel, 1);
        if (s == GRPC_CHANNEL_READY) {
            ready = 1;
            break;
        }
        if (gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), deadline) >= 0)
            break;
        /* completes on a state change or at the deadline; waiting on it polls the channel */
        grpc_channel_watch_connectivity_state(ch->channel, s, deadline, cq, (void *)ch);
        grpc_event ev = grpc_completion_queue_pluck(cq, (void *)ch,
                                                    gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE || !ev.success)
            break; /* the deadline passed */
    }
    grpc_completion_queue_shutdown(cq);
    grpc_completion_queue_destroy(cq);
    return ready;
}

void kc_channel_reset_backoff(kc_channel *ch)
{
    grpc_channel_reset_connect_backoff(ch->channel);
}

/* A call on its own pluck queue. The queue is shut down and destroyed with the call: every batch
 * was plucked by then, so nothing is left in it. */
static grpc_call *call_create(kc_channel *ch, const char *path, int64_t timeout_ms,
                              grpc_completion_queue **cq_out)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_slice method = grpc_slice_from_copied_string(path);
    grpc_call *call = grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                               method, NULL, deadline_after(timeout_ms), NULL);
    grpc_slice_unref(method);
    if (!call) {
        grpc_completion_queue_shutdown(cq);
        grpc_completion_queue_destroy(cq);
        return NULL;
    }
    *cq_out = cq;
    return call;
}

static void call_destroy(grpc_call *call, grpc_completion_queue *cq)
{
    grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    grpc_completion_queue_destroy(cq);
}

static int pluck(grpc_completion_queue *cq, void *tag)
{
    grpc_event ev = grpc_completion_queue_pluck(cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    return ev.type == GRPC_OP_COMPLETE && ev.success;
}

/* Copies `md` into `out` (slices owned by the caller: md_free). */
static grpc_metadata *md_copy(const kc_md *md, size_t n)
{
    if (n == 0)
        return NULL;
    grpc_metadata *out = calloc(n, sizeof *out);
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        out[i].key = grpc_slice_from_copied_string(md[i].key);
        out[i].value = grpc_slice_from_copied_string(md[i].value);
    }
    return out;
}

static void md_free(grpc_metadata *md, size_t n)
{
    for (size_t i = 0; md && i < n; i++) {
        grpc_slice_unref(md[i].key);
        grpc_slice_unref(md[i].value);
    }
    free(md);
}

/* ------------------------------------------------------------------ unary */

static int unary_bb(kc_channel *ch, const char *path, grpc_byte_buffer *req_bb,
                    const ProtobufCMessageDescriptor *resp_desc, const kc_call_opts *hop,
                    ProtobufCMessage **resp, kc_status *st)
{
    grpc_metadata *send_md = md_copy(hop->md, hop->n_md);
    if (hop->n_md && !send_md) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return -1;
    }
    grpc_completion_queue *cq;
    grpc_call *call = call_create(ch, path, hop->timeout_ms, &cq);
    if (!call) {
        md_free(send_md, hop->n_md);
        kc_status_set(st, GRPC_STATUS_INTERNAL, "%s: cannot create the call", path);
        return -1;
    }
    grpc_metadata_array initial_md, trailing_md;
    grpc_metadata_array_init(&initial_md);
    grpc_metadata_array_init(&trailing_md);
    grpc_byte_buffer *resp_bb = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = hop->n_md;
    ops[0].data.send_initial_metadata.metadata = send_md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = req_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &initial_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &resp_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing_md;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    int rc = -1;
    grpc_call_error e = grpc_call_start_batch(call, ops, 6, (void *)1, NULL);
    if (e != GRPC_CALL_OK) {
        kc_status_set(st, GRPC_STATUS_INTERNAL, "%s: start_batch failed (%d)", path, (int)e);
        goto out;
    }
    pluck(cq, (void *)1); /* the status op always completes, success or not */
    if (code != GRPC_STATUS_OK) {
        status_from_slice(st, code, details);
        goto out;
    }
    if (!resp_bb) {
        kc_status_set(st, GRPC_STATUS_INTERNAL, "%s: OK without a response message", path);
        goto out;
    }
    if (kc_message_unpack(resp_bb, resp_desc, ch->max_message_bytes, resp, st) != 0) {
        st->code = GRPC_STATUS_INTERNAL; /* the server's fault, not the caller's argument */
        goto out;
    }
    kc_status_set(st, GRPC_STATUS_OK, "%s", "");
    rc = 0;
out:
    if (resp_bb)
        grpc_byte_buffer_destroy(resp_bb);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&trailing_md);
    grpc_metadata_array_destroy(&initial_md);
    call_destroy(call, cq);
    md_free(send_md, hop->n_md);
    return rc;
}

int kc_unary(kc_channel *ch, const char *path, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
             ProtobufCMessage **resp, kc_status *st)
{
    const kc_call_opts opts = {.timeout_ms = timeout_ms};
    return kc_unary_md(ch, path, req, resp_desc, &opts, resp, st);
}

int kc_unary_md(kc_channel *ch, const char *path, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *resp_desc, const kc_call_opts *opts,
                ProtobufCMessage **resp, kc_status *st)
{
    grpc_byte_buffer *bb;
    if (kc_message_pack(req, ch->max_message_bytes, &bb, st) != 0)
        return -1;
    int rc = unary_bb(ch, path, bb, resp_desc, opts, resp, st);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

int kc_unary_bytes(kc_channel *ch, const char *path, const void *req, size_t len,
                   const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                   ProtobufCMessage **resp, kc_status *st)
{
    grpc_slice slice = grpc_slice_from_copied_buffer(req, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&slice, 1);
    grpc_slice_unref(slice);
    const kc_call_opts hop = {.timeout_ms = timeout_ms};
    int rc = unary_bb(ch, path, bb, resp_desc, &hop, resp, st);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

/* ------------------------------------------------------------------ streams */

enum { TAG_SEND = 1, TAG_STATUS = 2, TAG_RECV = 3, TAG_MSG = 4 };

struct kc_stream {
    kc_channel *ch;
    grpc_call *call;
    grpc_completion_queue *cq;
    grpc_byte_buffer *req_bb;       /* alive until the send batch completes (NULL: bidi) */
    grpc_metadata *send_md;         /* alive until the send batch completes */
    size_t n_md;
    grpc_metadata_array initial_md; /* filled with the first message */
    grpc_metadata_array trailing_md;
    grpc_status_code code;
    grpc_slice details;
    int got_initial_md;
    int send_plucked;
    int ended; /* the status batch was plucked */
};

/* Server streaming (`req` set: metadata, the request, half-close) or bidirectional (`req` NULL:
 * metadata only) start of a call, with the status asked for at once. */
static int stream_start(kc_channel *ch, const char *path, const ProtobufCMessage *req,
                        const kc_md *md, size_t n_md, int64_t timeout_ms, kc_stream **out,
                        kc_status *st)
{
    kc_stream *s = calloc(1, sizeof *s);
    if (!s) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return -1;
    }
    s->ch = ch;
    s->details = grpc_empty_slice();
    s->code = GRPC_STATUS_UNKNOWN;
    grpc_metadata_array_init(&s->initial_md);
    grpc_metadata_array_init(&s->trailing_md);
    s->send_md = md_copy(md, n_md);
    s->n_md = n_md;
    if (n_md && !s->send_md) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        goto err_free;
    }
    if (req && kc_message_pack(req, ch->max_message_bytes, &s->req_bb, st) != 0)
        goto err_free;
    s->call = call_create(ch, path, timeout_ms, &s->cq);
    if (!s->call) {
        kc_status_set(st, GRPC_STATUS_INTERNAL, "%s: cannot create the call", path);
        goto err_bb;
    }
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].data.send_initial_metadata.count = n_md;
    ops[n++].data.send_initial_metadata.metadata = s->send_md;
    if (req) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = s->req_bb;
        ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    }
    if (grpc_call_start_batch(s->call, ops, n, (void *)TAG_SEND, NULL) != GRPC_CALL_OK) {
        kc_status_set(st, GRPC_STATUS_INTERNAL, "%s: start_batch (send) failed", path);
        goto err_call;
    }
    /* The status is asked for at once, as gRPC wants: it completes when the call ends for any
     * reason, which is also what lets kc_stream_close wait for the end after a cancel. */
    grpc_op sop;
    memset(&sop, 0, sizeof sop);
    sop.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    sop.data.recv_status_on_client.trailing_metadata = &s->trailing_md;
    sop.data.recv_status_on_client.status = &s->code;
    sop.data.recv_status_on_client.status_details = &s->details;
    if (grpc_call_start_batch(s->call, &sop, 1, (void *)TAG_STATUS, NULL) != GRPC_CALL_OK) {
        /* the send batch is in flight: cancel and wait for it before freeing */
        grpc_call_cancel(s->call, NULL);
        pluck(s->cq, (void *)TAG_SEND);
        kc_status_set(st, GRPC_STATUS_INTERNAL, "%s: start_batch (status) failed", path);
        goto err_call;
    }
    *out = s;
    return 0;

err_call:
    call_destroy(s->call, s->cq);
err_bb:
    if (s->req_bb)
        grpc_byte_buffer_destroy(s->req_bb);
err_free:
    md_free(s->send_md, s->n_md);
    grpc_metadata_array_destroy(&s->trailing_md);
    grpc_metadata_array_destroy(&s->initial_md);
    free(s);
    return -1;
}

int kc_stream_open(kc_channel *ch, const char *path, const ProtobufCMessage *req,
                   int64_t timeout_ms, kc_stream **out, kc_status *st)
{
    return stream_start(ch, path, req, NULL, 0, timeout_ms, out, st);
}

int kc_stream_open_md(kc_channel *ch, const char *path, const ProtobufCMessage *req,
                      const kc_md *md, size_t n_md, int64_t timeout_ms, kc_stream **out,
                      kc_status *st)
{
    return stream_start(ch, path, req, md, n_md, timeout_ms, out, st);
}

int kc_bidi_open(kc_channel *ch, const char *path, const kc_md *md, size_t n_md,
                 int64_t timeout_ms, kc_stream **out, kc_status *st)
{
    return stream_start(ch, path, NULL, md, n_md, timeout_ms, out, st);
}

/* Waits for the status and reports it: 0 for OK, -1 otherwise. */
static int stream_end(kc_stream *s, kc_status *st)
{
    if (!s->ended) {
        pluck(s->cq, (void *)TAG_STATUS);
        s->ended = 1;
    }
    status_from_slice(st, s->code, s->details);
    return s->code == GRPC_STATUS_OK ? 0 : -1;
}

static void stream_pluck_send(kc_stream *s)
{
    if (!s->send_plucked) {
        pluck(s->cq, (void *)TAG_SEND); /* a failed send shows up in the status */
        s->send_plucked = 1;
    }
}

int kc_stream_send(kc_stream *s, const ProtobufCMessage *msg, kc_status *st)
{
    if (s->ended) {
        stream_end(s, st);
        if (st->code == GRPC_STATUS_OK)
            kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION, "send on a stream that ended");
        return -1;
    }
    stream_pluck_send(s);
    grpc_byte_buffer *bb;
    if (kc_message_pack(msg, s->ch->max_message_bytes, &bb, st) != 0)
        return -1;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    int ok = grpc_call_start_batch(s->call, &op, 1, (void *)TAG_MSG, NULL) == GRPC_CALL_OK &&
             pluck(s->cq, (void *)TAG_MSG);
    grpc_byte_buffer_destroy(bb);
    if (ok)
        return 0;
    /* the call is over (or broken): its status says why */
    grpc_call_cancel(s->call, NULL);
    stream_end(s, st);
    if (st->code == GRPC_STATUS_OK)
        kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "the stream ended before the message was sent");
    return -1;
}

static int stream_next(kc_stream *s, const ProtobufCMessageDescriptor *desc,
                       ProtobufCMessage **msg, int64_t timeout_ms, kc_status *st)
{
    if (s->ended)
        return stream_end(s, st);
    stream_pluck_send(s);
    grpc_byte_buffer *bb = NULL;
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!s->got_initial_md) {
        ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[n++].data.recv_initial_metadata.recv_initial_metadata = &s->initial_md;
        s->got_initial_md = 1;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n++].data.recv_message.recv_message = &bb;
    if (grpc_call_start_batch(s->call, ops, n, (void *)TAG_RECV, NULL) != GRPC_CALL_OK) {
        grpc_call_cancel(s->call, NULL);
        stream_end(s, st);
        kc_status_set(st, GRPC_STATUS_INTERNAL, "start_batch (receive) failed");
        return -1;
    }
    int ok;
    if (timeout_ms > 0) {
        grpc_event ev = grpc_completion_queue_pluck(s->cq, (void *)TAG_RECV,
                                                    deadline_after(timeout_ms), NULL);
        if (ev.type == GRPC_QUEUE_TIMEOUT) {
            grpc_call_cancel(s->call, NULL);
            pluck(s->cq, (void *)TAG_RECV);
            if (bb)
                grpc_byte_buffer_destroy(bb);
            stream_end(s, st);
            kc_status_set(st, GRPC_STATUS_DEADLINE_EXCEEDED, "no message within %lld ms",
                       (long long)timeout_ms);
            return -1;
        }
        ok = ev.type == GRPC_OP_COMPLETE && ev.success;
    } else {
        ok = pluck(s->cq, (void *)TAG_RECV);
    }
    if (!ok || !bb) { /* end of stream, or the call failed: the status says which */
        if (bb)
            grpc_byte_buffer_destroy(bb);
        return stream_end(s, st);
    }
    int rc = kc_message_unpack(bb, desc, s->ch->max_message_bytes, msg, st);
    grpc_byte_buffer_destroy(bb);
    if (rc != 0) {
        /* keep the unpack error: the server sent something we cannot read */
        kc_status local = *st;
        grpc_call_cancel(s->call, NULL);
        stream_end(s, st);
        *st = local;
        st->code = GRPC_STATUS_INTERNAL;
        return -1;
    }
    return 1;
}

int kc_stream_next(kc_stream *s, const ProtobufCMessageDescriptor *desc, ProtobufCMessage **msg,
                   kc_status *st)
{
    return stream_next(s, desc, msg, 0, st);
}

int kc_stream_next_within(kc_stream *s, const ProtobufCMessageDescriptor *desc,
                          ProtobufCMessage **msg, int64_t timeout_ms, kc_status *st)
{
    return stream_next(s, desc, msg, timeout_ms, st);
}

void kc_stream_cancel(kc_stream *s)
{
    if (s)
        grpc_call_cancel(s->call, NULL); /* thread-safe until grpc_call_unref */
}

void kc_stream_close(kc_stream *s)
{
    if (!s)
        return;
    if (!s->ended) {
        grpc_call_cancel(s->call, NULL);
        pluck(s->cq, (void *)TAG_STATUS);
    }
    if (!s->send_plucked)
        pluck(s->cq, (void *)TAG_SEND);
    call_destroy(s->call, s->cq);
    if (s->req_bb)
        grpc_byte_buffer_destroy(s->req_bb);
    md_free(s->send_md, s->n_md);
    grpc_slice_unref(s->details);
    grpc_metadata_array_destroy(&s->trailing_md);
    grpc_metadata_array_destroy(&s->initial_md);
    free(s);
}
