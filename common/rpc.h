/*
 * rpc.h - the gRPC C core helpers the router, prefill and decode nodes share: protobuf-c
 * messages <-> grpc_byte_buffer, a server (registered unary and server-streaming methods, one
 * completion-queue thread, one thread per call for handlers, UNIMPLEMENTED for unknown methods,
 * a clean shutdown), and a client (insecure channel, blocking unary call, server-streaming
 * reader, cancellation).
 * Also, for the etcd client (common/etcd.c): channels with TLS credentials, keepalive and a
 * short reconnect backoff, call metadata (etcd's auth token), bidirectional streams; and for the
 * router's API keys: a server-wide auth hook run before handlers, and reading request metadata.
 * TLS (rpc-tls.c): the --tls-* flags, their files checked at start-up, server and channel
 * credentials (mutual TLS between the router and its nodes; docs/security.md).
 * Not here: client-streaming calls, retries, load balancing (the request id travels in the
 * messages, not in metadata).
 * Threads, ownership and cancellation are spelled out in docs/rpc.md. Test: ctest -R test_grpc.
 */
#ifndef KC_RPC_H
#define KC_RPC_H

#include <grpc/grpc.h>
#include <grpc/status.h>
#include <protobuf-c/protobuf-c.h>

#include <stddef.h>
#include <stdint.h>

/* Default cap on one message, each way, on both servers and channels. A KV bundle never travels
 * over gRPC (it goes over UCX), so messages are small; the cap stops a peer from making us
 * allocate without bound. */
#define KC_MAX_MESSAGE_DEFAULT (16u << 20)
/* Default server-side deadline of a call: every handler ends, even for a client that set none. */
#define KC_MAX_DEADLINE_DEFAULT_MS 600000

/* A call's outcome: the gRPC status code and its human-readable details. */
typedef struct {
    grpc_status_code code;
    char details[256];
} kc_status;

/* ------------------------------------------------------------------ messages */

/* Packs `msg` into a new byte buffer (*out, caller destroys with grpc_byte_buffer_destroy).
 * A message over `max_bytes` (0 = KC_MAX_MESSAGE_DEFAULT) is refused with RESOURCE_EXHAUSTED.
 * Returns 0, or -1 with `st` set. */
int kc_message_pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out,
                    kc_status *st);
/* Unpacks a byte buffer as a `desc` message into *out (free with kc_message_free). Bytes that do
 * not parse give INVALID_ARGUMENT naming the message type and length, and so does a string field
 * (in a sub-message too) holding a NUL byte: "FIELD: Message.FIELD holds U+0000 ..." (protobuf-c
 * would hand it over cut at the NUL); more than `max_bytes` (0 = default) gives
 * RESOURCE_EXHAUSTED. `bb` stays the caller's. Returns 0 or -1. */
int kc_message_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                      size_t max_bytes, ProtobufCMessage **out, kc_status *st);
/* Frees a message from kc_message_unpack, kc_unary or kc_stream_next. NULL is fine. */
void kc_message_free(ProtobufCMessage *msg);

/* ------------------------------------------------------------------ server */

typedef struct kc_server kc_server;
typedef struct kc_call kc_call; /* one server-side call; see the kc_call_* functions */

typedef struct kc_tls_config kc_tls_config; /* see "TLS" below */

typedef struct {
    size_t max_message_bytes; /* per message, each way; 0 = KC_MAX_MESSAGE_DEFAULT */
    int max_calls;            /* calls with a live handler; more get RESOURCE_EXHAUSTED; 0 = 1024 */
    int64_t max_deadline_ms;  /* a call's deadline is at most this long after it arrives, and a
                               * call whose client set none gets it: kc_call_ms_left,
                               * kc_call_cancelled and kc_call_wait see it; 0 =
                               * KC_MAX_DEADLINE_DEFAULT_MS, < 0 = the client's only */
    const kc_tls_config *tls; /* NULL or !kc_tls_enabled: plaintext; else TLS with these files,
                               * asking clients for certificates as tls->client_auth says */
} kc_server_config;

/* A handler's return value: a grpc_status_code (OK, or an error whose details were given with
 * kc_call_error), or KC_DETACHED: the call outlives the handler and whoever holds it must end it
 * with kc_call_finish (the decode node hands its streams to its decode loop this way). */
#define KC_DETACHED (-1)

/* Runs on its own thread, one per call. `req` is the decoded request, valid until the handler
 * returns (a detached call must copy what it keeps). Unary handlers answer with exactly one
 * kc_call_send before returning OK; streaming handlers send any number. */
typedef int (*kc_handler)(kc_call *call, const ProtobufCMessage *req, void *user);

/* Creates a server bound to `addr` ("127.0.0.1:0" = an ephemeral port, "[::]:50051", ...) with
 * insecure credentials, or TLS ones per cfg->tls; *port is the port bound. `cfg` may be NULL.
 * Add methods, then start. Returns 0, or -1 with `st` (UNAVAILABLE when the address cannot be
 * bound; INVALID_ARGUMENT naming the flag and file when the TLS files are not usable). */
int kc_server_create(const char *addr, const kc_server_config *cfg, kc_server **out, int *port,
                     kc_status *st);
/* Registers a method by its full path ("/kvrelay.v1.Decode/Reserve") before kc_server_start.
 * `req_desc` decodes the request; `user` is passed to the handler. Returns 0 or -1 (already
 * started, duplicate path, out of memory). */
int kc_server_add_unary(kc_server *srv, const char *path, const ProtobufCMessageDescriptor *req_desc,
                        kc_handler fn, void *user);
int kc_server_add_stream(kc_server *srv, const char *path,
                         const ProtobufCMessageDescriptor *req_desc, kc_handler fn, void *user);
/* A server-wide check run before the handler of every registered method: it sees the method
 * (kc_call_method) and the client's request metadata (kc_call_metadata) and returns
 * GRPC_STATUS_OK to let the call through, or the status to refuse it with (e.g.
 * UNAUTHENTICATED) after writing the details the client gets into `details` (`cap` bytes,
 * NUL-terminated). A refused call is answered at once: its request is never decoded and its
 * handler never runs. The hook runs on the call's own thread, one per call, so it must be
 * thread-safe; it decides which methods it covers (return OK for the others). */
typedef int (*kc_auth_fn)(void *user, const kc_call *call, char *details, size_t cap);
/* Installs the hook (NULL: none, the default) before kc_server_start. Returns 0, or -1 when the
 * server already started. */
int kc_server_set_auth(kc_server *srv, kc_auth_fn fn, void *user);
/* Starts serving: the completion-queue thread runs from here to kc_server_destroy. */
int kc_server_start(kc_server *srv, kc_status *st);
/* Stops accepting calls, cancels those in flight, waits for every handler to return and every
 * detached call to be finished, then frees everything. Call from a thread that is not a handler
 * of this server. NULL is fine. */
void kc_server_destroy(kc_server *srv);

/* ------------------------------------------------------------------ one server call
 * Every kc_call_* function is thread-safe: a decode loop may send on a detached call while the
 * completion-queue thread completes the previous send. */

/* Queues `msg` (packed at once, so the caller may free or reuse it on return) and returns
 * without waiting for the network: one SEND_MESSAGE is in flight per call and the next queued one
 * starts when it completes. Returns 0, or -1 when the call is over (client cancelled, deadline
 * passed, already finished, server shutting down; a unary call's second message) or `msg` is
 * over the size cap. Never blocks. */
int kc_call_send(kc_call *call, const ProtobufCMessage *msg);
/* Messages queued and not yet completed, for a producer that wants backpressure. */
size_t kc_call_backlog(kc_call *call);
/* Records the error details to send with `code`, and returns `code`, so that a handler can say
 * `return kc_call_error(call, GRPC_STATUS_INVALID_ARGUMENT, "max_tokens %u > %u", n, max);`. */
int kc_call_error(kc_call *call, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Ends a detached call: queued messages go first, then the status. Exactly once per detached
 * call (later calls are ignored); after it, `call` may be freed at any moment: do not touch it.
 * `fmt` may be NULL (details from kc_call_error, or none). */
void kc_call_finish(kc_call *call, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* 1 once the client cancelled, the deadline passed, the connection broke or the server is
 * shutting down: stop working on the call and return (or kc_call_finish a detached one). */
int kc_call_cancelled(kc_call *call);
/* Sleeps up to `ms` milliseconds, waking early on cancellation. Returns kc_call_cancelled(). */
int kc_call_wait(kc_call *call, int64_t ms);
/* Milliseconds left before the call's deadline: the client's, or the server's max_deadline_ms
 * when sooner (INT64_MAX when there is neither; <= 0 when past).
 * Pass it on as the timeout of the calls this one makes, so deadlines propagate. */
int64_t kc_call_ms_left(kc_call *call);
/* The method path this call was made to. */
const char *kc_call_method(const kc_call *call);
/* The value of the client's request metadata `key` (compared ignoring case; gRPC sends keys in
 * lower case, e.g. "authorization"): the first entry with that key, or NULL when there is none.
 * The value is NOT NUL-terminated: *len is its length. It points into the call and stays valid
 * until the call ends (for a handler: until it returns; a detached call: until kc_call_finish). */
const char *kc_call_metadata(const kc_call *call, const char *key, size_t *len);

/* The client's address without its port ("127.0.0.1", "::1"; "unix:/path" as gRPC gives it)
 * into out (`cap` bytes; "" when gRPC does not know it), for per-client accounting. */
void kc_call_peer(const kc_call *call, char *out, size_t cap);

/* ------------------------------------------------------------------ client */

typedef struct kc_channel kc_channel;
typedef struct kc_stream kc_stream;

/* A channel to `target` ("127.0.0.1:50051", "dns:///host:port") with insecure credentials.
 * Connects lazily. `max_message_bytes` 0 = default. Thread-safe: share one per peer. */
int kc_channel_create(const char *target, size_t max_message_bytes, kc_channel **out,
                      kc_status *st);
/* Channel options beyond the defaults (a zeroed struct = kc_channel_create's behaviour). */
typedef struct kc_channel_opts {
    size_t max_message_bytes;          /* 0 = default */
    grpc_channel_credentials *creds;   /* NULL = insecure; borrowed (the channel takes a ref) */
    int keepalive_ms;                  /* > 0: HTTP/2 pings every so often while calls are open,
                                        * so a hung peer fails open streams (0 = none) */
    int max_reconnect_backoff_ms;      /* > 0: cap on gRPC's reconnect backoff (default 120 s),
                                        * so a restarted peer is found again quickly */
} kc_channel_opts;
int kc_channel_create_opts(const char *target, const kc_channel_opts *opts, kc_channel **out,
                           kc_status *st);
/* Destroy only after every call and stream on it is closed. NULL is fine. */
void kc_channel_destroy(kc_channel *ch);
/* Asks the channel to connect and waits up to `timeout_ms` for it to be ready: 1 when ready,
 * 0 otherwise. Retry loops should wait here rather than sleep: gRPC C core makes progress on a
 * connection only while some thread waits on a completion queue that cares about it (otherwise
 * only its 5-second backup poller does), so a fail-fast call loop with sleeps in between can
 * miss a peer that came back for many seconds. */
int kc_channel_wait_connected(kc_channel *ch, int64_t timeout_ms);
/* Ends the channel's reconnect backoff: when it is waiting to reconnect, it tries again now
 * (for a peer known to be back, e.g. one that registered again). */
void kc_channel_reset_backoff(kc_channel *ch);

/* One metadata entry sent with a call (key lower-case ASCII, e.g. "token"); copied by the
 * functions that take it. */
typedef struct kc_md {
    const char *key;
    const char *value;
} kc_md;

/* A blocking unary call to `path` with a deadline of `timeout_ms` (<= 0 = none). On OK returns 0
 * and *resp (a `resp_desc` message, free with kc_message_free); otherwise -1 with `st` (the
 * server's status, or a local error; *resp untouched). `st` is set on success too (OK). */
int kc_unary(kc_channel *ch, const char *path, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
             ProtobufCMessage **resp, kc_status *st);
/* A unary call's deadline (<= 0 = none) and the metadata it sends (n_md entries of md; none:
 * NULL, 0). */
typedef struct kc_call_opts {
    int64_t timeout_ms;
    const kc_md *md;
    size_t n_md;
} kc_call_opts;
/* kc_unary with the deadline and metadata of `opts`. */
int kc_unary_md(kc_channel *ch, const char *path, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *resp_desc, const kc_call_opts *opts,
                ProtobufCMessage **resp, kc_status *st);
/* Same with the request given as raw bytes (tests send malformed requests with it). */
int kc_unary_bytes(kc_channel *ch, const char *path, const void *req, size_t len,
                   const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                   ProtobufCMessage **resp, kc_status *st);

/* Starts a server-streaming call: sends `req`, half-closes. Returns 0 with *out, or -1 with
 * `st`. One thread reads it; any thread may kc_stream_cancel it. */
int kc_stream_open(kc_channel *ch, const char *path, const ProtobufCMessage *req,
                   int64_t timeout_ms, kc_stream **out, kc_status *st);
/* kc_stream_open with `n_md` metadata entries sent with the call. */
int kc_stream_open_md(kc_channel *ch, const char *path, const ProtobufCMessage *req,
                      const kc_md *md, size_t n_md, int64_t timeout_ms, kc_stream **out,
                      kc_status *st);
/* Blocks for the next message: 1 with *msg (a `desc` message, free with kc_message_free);
 * 0 when the stream ended with OK; -1 when it ended otherwise (`st` says how: the server's
 * status, CANCELLED after kc_stream_cancel, DEADLINE_EXCEEDED, a malformed message). `st` is
 * set whenever 0 or -1 is returned. */
int kc_stream_next(kc_stream *s, const ProtobufCMessageDescriptor *desc, ProtobufCMessage **msg,
                   kc_status *st);
/* Starts a bidirectional stream: sends the metadata only; messages go with kc_stream_send and
 * come with kc_stream_next / kc_stream_next_within. Sends and receives are made by one thread at
 * a time (send, then read the answer); kc_stream_cancel from any thread. */
int kc_bidi_open(kc_channel *ch, const char *path, const kc_md *md, size_t n_md,
                 int64_t timeout_ms, kc_stream **out, kc_status *st);
/* Sends one message on a bidirectional stream and waits until gRPC took it. Returns 0, or -1
 * when the call is over (`st` says why: the call's status, UNAVAILABLE when it broke). */
int kc_stream_send(kc_stream *s, const ProtobufCMessage *msg, kc_status *st);
/* kc_stream_next waiting at most `timeout_ms` (<= 0: forever): with no message by then the call
 * is cancelled and -1 returned with DEADLINE_EXCEEDED (the stream is over). */
int kc_stream_next_within(kc_stream *s, const ProtobufCMessageDescriptor *desc,
                          ProtobufCMessage **msg, int64_t timeout_ms, kc_status *st);
/* Cancels the call (the server's handler sees kc_call_cancelled). Thread-safe, idempotent,
 * valid until kc_stream_close. */
void kc_stream_cancel(kc_stream *s);
/* Cancels the call if it has not ended, waits for its operations, frees. NULL is fine. */
void kc_stream_close(kc_stream *s);

/* ------------------------------------------------------------------ TLS (rpc-tls.c)
 * PEM files given by flags. A server presents cert_file/key_file and, when it asks clients for a
 * certificate, verifies it against ca_file; a client verifies the server's certificate (which
 * must name the host it dials, e.g. an IP subjectAltName 127.0.0.1) against ca_file and presents
 * cert_file/key_file when given. Files are read and checked when credentials are made: a
 * missing or unreadable file, a key of another certificate, or a server certificate that does
 * not verify against ca_file (the CA its peers trust in a cluster) is an INVALID_ARGUMENT naming
 * the flag and the file. */

typedef enum kc_tls_client_auth {
    KC_TLS_CLIENT_AUTH_NONE = 0,    /* clients are not asked for a certificate */
    KC_TLS_CLIENT_AUTH_REQUEST = 1, /* asked; one that is presented must verify against ca_file */
    KC_TLS_CLIENT_AUTH_REQUIRE = 2, /* a client without a certificate from ca_file is refused */
} kc_tls_client_auth;

struct kc_tls_config {
    const char *cert_file;          /* --tls-cert: this process's certificate (then its chain) */
    const char *key_file;           /* --tls-key: its private key, unencrypted */
    const char *ca_file;            /* --tls-ca: the CA bundle peers are verified against */
    kc_tls_client_auth client_auth; /* servers; set from client_auth_arg by the flags' finish */
    const char *client_auth_arg;    /* --tls-client-auth as given (NULL: not given) */
};

/* 1 when `cfg` turns TLS on (a certificate or a CA given). NULL is fine (0). */
int kc_tls_enabled(const kc_tls_config *cfg);
/* Server credentials: cert_file and key_file required; ca_file too unless client_auth is NONE.
 * Call after grpc_init (any live kc_server or kc_channel holds it). Release with
 * grpc_server_credentials_release. Returns NULL with `st` when the files are not usable. */
grpc_server_credentials *kc_tls_server_credentials(const kc_tls_config *cfg, kc_status *st);
/* Channel credentials: ca_file required; cert_file + key_file (both or neither) are presented
 * to servers that ask. For kc_channel_opts.creds; release with
 * grpc_channel_credentials_release. Returns NULL with `st` when the files are not usable. */
grpc_channel_credentials *kc_tls_channel_credentials(const kc_tls_config *cfg, kc_status *st);
/* The PEM text of cert_file and key_file (required), checked as above, for a TLS stack other than
 * gRPC's (the router's HTTPS port). *cert and *key are the caller's to free. Returns 0, or -1
 * with `st`. */
int kc_tls_read_pair(const kc_tls_config *cfg, char **cert, char **key, kc_status *st);

/* The TLS flags every program takes, parsed in one place (as the etcd flags, etcd.h); their
 * flag-table entries and help: KC_FLAGS_TLS and KC_FLAGS_TLS_CLIENT_AUTH (flags.h). */
/* Who takes the flags: the router (server on its public port, mutual-TLS client of the nodes),
 * a node (mutual-TLS server), a client (kvrelay-cli). */
typedef enum kc_tls_role {
    KC_TLS_ROLE_ROUTER = 0,
    KC_TLS_ROLE_NODE = 1,
    KC_TLS_ROLE_CLIENT = 2,
} kc_tls_role;
/* 1 when `flag` is one of --tls-cert, --tls-key, --tls-ca, --tls-client-auth (value `v` stored
 * in *c), 0 otherwise. */
int kc_tls_flag(kc_tls_config *c, const char *flag, const char *v);
/* After parsing: checks the combination for `role` (router and nodes need all three files; only
 * the router takes --tls-client-auth; nodes always require client certificates) and the files
 * themselves by building the credentials once. Returns 0, or -1 with a message in err (256
 * bytes) that names the flag and the file. */
int kc_tls_flags_finish(kc_tls_config *c, kc_tls_role role, char *err);

/* Sets st->code and formats st->details (truncated to fit). NULL st is fine. */
void kc_status_set(kc_status *st, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The canonical upper-case name of a status code ("DEADLINE_EXCEEDED"), for messages. */
const char *kc_status_name(grpc_status_code code);

#endif /* KC_RPC_H */
