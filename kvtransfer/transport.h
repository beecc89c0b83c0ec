/*
 * transport.h - the UCX (ucp) transport that carries one KV bundle from a prefill node to the
 * decode node that reserved room for it (DESIGN.md section 2; contracts in docs/transport.md).
 *
 * What it is: one transport context per process with one ucp worker driven by its own progress
 * thread. The receiving side (decode node) listens on host:port, *reserves* room for an
 * expected bundle (a 64-bit id chosen by the caller; a caller-owned buffer of the largest
 * bundle accepted, or, for a bundle assembled in a kt_bundle_set, buffers the transport
 * allocates at each part's size as the parts arrive) and is told once, by callback and by a
 * pollable state, whether the bundle arrived and its size. The sending side (prefill node)
 * sends a buffer to host:port tagged with the reservation id and the reservation's token, and
 * is told once whether the receiver accepted it, within a timeout.
 * The token (KT_RESV_TOKEN_BYTES random bytes drawn at reserve time) is the only credential on
 * this path: UCX has no TLS, so a bundle is accepted only for the reservation whose token it
 * carries. It keeps strangers out of reservations; it does not hide bundles from an eavesdropper
 * on the cluster network (docs/security.md).
 * Data goes as a ucp active message; UCX switches to rendezvous (zero-copy into the reserved
 * buffer) above its eager threshold. Endpoints use UCP_ERR_HANDLING_MODE_PEER: a dead peer
 * fails every pending operation on both sides with a message, its endpoint is closed, and the
 * next send to that address connects afresh.
 * In KT_TRANSPORT_MODE_RMA a reservation may instead be mapped for remote writes
 * (kt_transport_reserve_rma): the sender puts the bundle straight into the receiver's buffer
 * (kt_transport_put: ucp_put_nbx, a flush, then the header as an active message that says it is
 * in place), which on an RDMA fabric is one write by the network card with no receiver CPU.
 * What it is not: a bundle validator unless asked (KT_RESERVE_PARSE), or a retry policy (a
 * failed send is reported, the caller decides).
 *
 * Threading: every function here may be called from any thread, except from inside a kt_
 * callback where noted. Callbacks run on the progress thread, without internal locks held,
 * one at a time; they must not block for long. Conventions as bundle.h: 0 / -1, a message
 * starting with "transport: " in `err` (KT_ERR_MAX bytes, may be NULL).
 * Tests: tests/unit/test_transport.c, test_transport_pieces.c (real UCX over loopback). Bench:
 * kvrelay-transfer-bench.
 */
#ifndef KT_TRANSPORT_H
#define KT_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "bundle.h" /* KT_ERR_MAX */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_transport kt_transport;

typedef enum kt_transport_mode {
    KT_TRANSPORT_MODE_AM = 0,  /* active messages, rendezvous for bulk data (default) */
    KT_TRANSPORT_MODE_RMA = 1, /* the same, and puts: kt_transport_reserve_rma, kt_transport_put */
} kt_transport_mode;

/* The levels of the transport's log lines: those of the nodes' logger (common/log.h). */
typedef enum kt_log_level {
    KT_LOG_DEBUG = 0, /* a protocol trace line: only with KT_TRANSPORT_TRACE in the environment */
    KT_LOG_INFO = 1,
    KT_LOG_WARN = 2, /* a peer's error: a refused or failed bundle, a lost connection */
    KT_LOG_ERROR = 3, /* a UCX call that failed at runtime, out of memory */
} kt_log_level;

/* One log line of the transport, for an error it cannot return to a caller (it happened on the
 * progress thread) or a trace line. `request_id` is the one given with the reservation or send
 * the line is about (kt_resv_opts, kt_send_opts), NULL when none or not about one; `line` has
 * no newline and is valid only during the call. Called on the progress thread (or the thread of
 * an API call), possibly with the transport's lock held: it must not call into the transport,
 * and should only write the line. */
typedef void (*kt_log_fn)(void *arg, kt_log_level level, const char *request_id,
                          const char *line);

typedef struct kt_transport_config {
    kt_transport_mode mode;
    /* Receiving side: listen on listen_host:listen_port (port 0: an ephemeral port, read it
     * back with kt_transport_port). listen_host NULL: send-only, no listener. */
    const char *listen_host;
    uint16_t listen_port;
    /* Seconds an idle connection attempt or a stalled peer may take before UCX declares it
     * dead is UCX's own (~1 s on loopback, STACK.md); nothing to set here. */
    const char *name; /* role tag for log lines, e.g. "decode-0"; may be NULL */
    /* Where log lines go: a program passes one that writes through its own logger. NULL: one
     * line on stderr, "[kt NAME] LEVEL [REQUEST_ID] line". */
    kt_log_fn log;
    void *log_arg;
} kt_transport_config;

/* Starts UCX (context, worker, progress thread) and, with listen_host, the listener. Fails with
 * the UCX statement and status named (e.g. a busy port). *out is the caller's until
 * kt_transport_destroy. */
int kt_transport_create(const kt_transport_config *cfg, kt_transport **out, char *err);
/* Fails every pending reservation and send (callbacks run before it returns), closes every
 * endpoint and stops UCX. Not from a kt_ callback. NULL is a no-op. */
void kt_transport_destroy(kt_transport *t);
/* The port the listener is bound to (0 when not listening). */
uint16_t kt_transport_port(const kt_transport *t);

/* ------------------------------------------------------------------ receiving side */

typedef enum kt_xfer_state {
    KT_XFER_STATE_NONE = 0, /* no such reservation (never made, or already completed) */
    KT_XFER_STATE_RESERVED = 1, /* waiting for the bundle */
    KT_XFER_STATE_RECEIVING = 2, /* bytes are landing in the buffer */
} kt_xfer_state;

/* Completion of a reservation or a send, called exactly once. status 0: the whole bundle is
 * in the buffer (receive) or the receiver accepted it (send); -1: `err` says why (expired,
 * released, peer died, bundle too large, parse error, timeout, ...). `bytes` = bytes delivered:
 * on success the bundle's actual size (for a reservation into a buffer, at most the reserved
 * size: the bundle occupies buf[0, bytes), except the K and V of parts put into rows regions,
 * kt_transport_map_rows), 0 otherwise. After the callback the buffer is the caller's again.
 * `err` is valid only during the call. */
typedef void (*kt_xfer_cb)(void *arg, uint64_t id, int status, uint64_t bytes, const char *err);

/* Bytes of a reservation token: 128 bits from getrandom. */
#define KT_RESV_TOKEN_BYTES 16

/* Run kt_bundle_parse on exactly the bytes that arrived; a bad bundle fails both sides. */
#define KT_RESERVE_PARSE 1u

/* How a reservation waits and whom it tells. */
typedef struct kt_resv_opts {
    double timeout_s; /* > 0: the reservation expires after it (the callback says "expired") */
    unsigned flags; /* KT_RESERVE_PARSE */
    /* Non-NULL: the set the parts join (caller-owned, empty from kt_bundle_set_init, valid as
     * long as buf); implies KT_RESERVE_PARSE (below). */
    kt_bundle_set *set;
    kt_xfer_cb cb; /* required */
    void *cb_arg;
    const char *request_id; /* tags the transport's log lines about it (copied); may be NULL */
} kt_resv_opts;

/* Reserves `buf` (`size` bytes, caller-owned, must stay valid until the callback) for the
 * bundle tagged `id`, expiring after o->timeout_s seconds (the callback then reports "expired").
 * A bundle of 1..size bytes is accepted (the callback's `bytes` says how many arrived); a
 * larger one is refused with "bundle too large for reservation ID: reserved at most N bytes,
 * bundle has M" and the reservation stays waiting; so is a bundle whose token is not this
 * reservation's ("wrong token for reservation ID"). On success *token (KT_RESV_TOKEN_BYTES) is
 * the reservation's fresh random token, to hand to the one sender allowed to fill it. Fails
 * when not listening, when `id` is already reserved, or size is 0. Any id is fine; ids are the
 * caller's (the decode node's reservation ids).
 * With o->set: KT_RESERVE_PARSE that keeps the parse: each part that arrives (a whole bundle, or
 * one layer segment of a pipelined transfer) is parsed and added to the set; a part that does
 * not parse or does not fit the set fails the reservation. Before a successful callback the set
 * is complete, so the receiver validates a bundle once, in the transport, and reads it through
 * the set.
 * buf NULL (only with o->set): no buffer is reserved up front; each part lands in a buffer of
 * its own, taken when it arrives (partbuf.h: large ones are recycled), and `size` bounds the
 * bytes of all parts together. The set then owns the parts it holds (set->owned): free them with
 * kt_bundle_set_free, whatever the outcome, once the callback has run. A receiver that can only
 * bound a bundle (a decode node: every list at the prompt's length, in f32) so holds what
 * arrived, not the bound. */
int kt_transport_reserve(kt_transport *t, uint64_t id, void *buf, uint64_t size,
                         const kt_resv_opts *o, uint8_t token[KT_RESV_TOKEN_BYTES], char *err);
/* Most bytes of a packed remote key (ucp_rkey_pack): tens over TCP and shared memory, a few
 * hundred with InfiniBand. */
#define KT_RMA_KEY_MAX 1024

/* What a sender needs to put into a reservation mapped for RMA: where its buffer starts in the
 * receiver's memory and the packed remote key that grants writes to it (and nothing else). It
 * travels with the reservation token (Decode.Reserve -> router -> Prefill) and is as secret. */
typedef struct kt_rma_key {
    uint64_t address;
    uint32_t rkey_len;
    uint8_t rkey[KT_RMA_KEY_MAX];
} kt_rma_key;

/* kt_transport_reserve into the caller's `buf` (`size` bytes), mapped for remote writes
 * (ucp_mem_map) until the reservation ends: *key says where and how. A part put with
 * kt_transport_put is not read while more parts follow; when the last one's notice arrives the
 * mapping is dropped first, so the sender can no longer write, then every part is validated and
 * added to o->set, in order, and the callback reports the outcome. o->set NULL: the bytes are not
 * parsed (o->flags is not read). A bundle sent as active messages (kt_transport_send) is
 * received into buf as usual. Needs a transport created in KT_TRANSPORT_MODE_RMA. */
int kt_transport_reserve_rma(kt_transport *t, uint64_t id, void *buf, uint64_t size,
                             const kt_resv_opts *o, uint8_t token[KT_RESV_TOKEN_BYTES],
                             kt_rma_key *key, char *err);

/* Where a reservation mapped for RMA also takes the K and V rows of block-padded parts: two more
 * regions of the receiver's memory (a decode node: the key and value rows of a run of its KV
 * blocks), of `bytes` each, with their keys. Travels with the reservation's kt_rma_key, and is
 * as secret. */
typedef struct kt_rma_rows {
    kt_rma_key k, v;
    uint64_t bytes;
} kt_rma_rows;

/* Maps `bytes` at k and at v (caller-owned, valid until the reservation's callback) as the rows
 * regions of reservation `id`, made by kt_transport_reserve_rma with a set, and fills *out. A
 * part put with its rows (kt_put_dest) then has its head in the reservation's buffer (right after
 * the parts before it) and its K and V sections in the regions, each at the K bytes of the
 * earlier rows parts; when the last part's notice comes every mapping is dropped, and each part
 * is validated where it lies and added to the set in order: a rows part's view then points into
 * the regions. Call before the token is handed out (a Reserve answer); fails when `id` is
 * unknown, not mapped for RMA, has no set, already has rows, or bytes is 0. */
int kt_transport_map_rows(kt_transport *t, uint64_t id, void *k, void *v, uint64_t bytes,
                          kt_rma_rows *out, char *err);

/* Abandons a reservation: if it has not completed, its callback reports "released" before this
 * returns (a transfer in flight is cancelled first), so the buffer may be freed on return.
 * Returns 0 if it released something, -1 if there was nothing under `id`. Not from a kt_
 * callback. */
int kt_transport_release(kt_transport *t, uint64_t id);
/* The pollable view of a reservation. */
kt_xfer_state kt_transport_reservation_state(kt_transport *t, uint64_t id);

/* ------------------------------------------------------------------ sending side */

/* kt_send_opts flag: this is one part of a bundle sent in parts, and more parts follow for the
 * same reservation. */
#define KT_SEND_MORE 1u

/* Where a bundle goes: the receiver listening on host:port, and its reservation `id` whose token
 * (KT_RESV_TOKEN_BYTES, from the receiver's kt_transport_reserve) is `token`. */
typedef struct kt_peer {
    const char *host;
    uint16_t port;
    uint64_t id;
    const uint8_t *token;
} kt_peer;

/* How a send or a put goes and whom it tells. */
typedef struct kt_send_opts {
    unsigned flags; /* KT_SEND_MORE */
    double timeout_s; /* > 0 */
    kt_xfer_cb cb; /* required */
    void *cb_arg;
    const char *request_id; /* tags the transport's log lines about it (copied); may be NULL */
} kt_send_opts;

/* Sends `size` bytes at `buf` to `to`.
 * A bundle may go in parts (a layer-pipelined transfer): every part but the last with
 * KT_SEND_MORE in o->flags, each sent only once the previous one's callback reported success
 * (a part that arrives while the previous one is still landing is refused). Part k lands in the
 * reserved buffer right after part k-1; each part is acknowledged on its own; the
 * reservation completes with the part sent without KT_SEND_MORE, its `bytes` then the sum.
 * Connects on first use (an endpoint per address, re-created after a failure). Completes
 * through o->cb when the receiver acknowledged the bundle (status 0) or refused it, when the
 * peer died, or after o->timeout_s seconds. `buf` must stay valid until the callback. A send
 * still moving data at its timeout closes the connection (the other sends on it fail too:
 * a stalled connection is not trusted). */
int kt_transport_send(kt_transport *t, const kt_peer *to, const void *buf, uint64_t size,
                      const kt_send_opts *o, char *err);

/* Where a put goes in the receiver's memory: a reservation mapped for RMA. */
typedef struct kt_put_dest {
    const kt_rma_key *key; /* the reservation's, from kt_transport_reserve_rma */
    uint64_t offset; /* where the part (or, with rows, its head) goes: the bytes of the parts
                        before it in the reservation's buffer */
    /* NULL: the part goes whole. Else the rows regions (kt_transport_map_rows) its K and V go
     * to, at rows_off: the K bytes of the rows parts before it. */
    const kt_rma_rows *rows;
    uint64_t rows_off;
} kt_put_dest;

/* kt_transport_send into a reservation mapped for RMA: the part goes by ucp_put_nbx to
 * at->key->address + at->offset, then, once a flush says it is in the receiver's memory, its
 * header as an active message; the receiver's acknowledgement completes it as with
 * kt_transport_send.
 * With at->rows, the part must be block-padded and unquantized (kt_bundle_layout_read: split,
 * block_rows > 0; its K and V sections of equal length): its head goes to key->address + offset
 * and its K and V sections to rows->k.address + rows_off and rows->v.address + rows_off, then a
 * flush, then its notice (flags KT_WIRE_PUT and KT_WIRE_PIECE, the head's length and offset).
 * Fails at once for a part that is not laid out so, or whose sections would end past
 * rows->bytes. Rows parts and whole put parts may alternate in one bundle.
 * Parts, flags, timeout and callback as kt_transport_send. Needs a transport created in
 * KT_TRANSPORT_MODE_RMA. */
int kt_transport_put(kt_transport *t, const kt_peer *to, const kt_put_dest *at, const void *buf,
                     uint64_t size, const kt_send_opts *o, char *err);
/* kt_transport_send of a whole bundle (no flags), waiting at most timeout_s for the outcome.
 * Not from a kt_ callback. */
int kt_transport_send_wait(kt_transport *t, const kt_peer *to, const void *buf, uint64_t size,
                           double timeout_s, char *err);

#ifdef __cplusplus
}
#endif
#endif /* KT_TRANSPORT_H */
