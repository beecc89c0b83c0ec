/*
 * transport-impl.h - what the files of the transport (transport.h) share: the wire constants,
 * the tables the progress thread keeps (connections, reservations, sends, acks) and the
 * functions one file calls in another. Not a public header: only kvtransfer/transport*.c
 * include it. How the transport works: transport.c.
 * Files: transport.c (lifecycle, the progress loop, connections), transport-recv.c (the
 * receiving side: reservations, arriving bundles and pieces, validation, acks),
 * transport-send.c (the sending side: sends, their acknowledgements), transport-put.c (RMA
 * puts, whole and with their rows).
 */
#ifndef KT_TRANSPORT_IMPL_H
#define KT_TRANSPORT_IMPL_H

#include "transport.h"
#include "partbuf.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include <ucp/api/ucp.h>

#include "le.h"

#define KT_AM_BUNDLE 0x4b51u
#define KT_AM_ACK 0x4b52u
#define KT_WIRE_MAGIC 0x4e58544bu /* "KTXN" little-endian */
#define KT_WIRE_VERSION 2u /* 2: the reservation token at offset 40 */
#define KT_WIRE_PUT 2u /* header flag: the part was put at the offset in bytes 32..39, no data */
/* Header flag: the data is one piece of a part, bytes [offset, offset + length) of its `size`
 * (offset in bytes 32..39): a block-padded bundle goes as its head (header, list table,
 * positions), its K section and its V section, so the receiver can land K and V in its KV
 * blocks (kt_bundle_place_fn). The pieces of a part share its seq and are acknowledged once. */
#define KT_WIRE_PIECE 4u
#define KT_PIECES 3 /* head, K, V */
/* A head piece above this goes by rendezvous; below, eagerly, so that the receiver has it (and
 * can place K and V) without a round trip. */
#define KT_HEAD_EAGER_MAX (256u << 10)
#define KT_WIRE_HDR_BYTES (40 + KT_RESV_TOKEN_BYTES)
#define KT_WIRE_ACK_MSG 256
#define KT_WIRE_ACK_BYTES (40 + KT_WIRE_ACK_MSG)
/* Bundles above this go by rendezvous, forced: over TCP alone UCX 1.13's automatic choice kept
 * even 256 MiB eager (reassembled in UCX's memory, then copied), measured here. */
#define KT_RNDV_MIN_BYTES 16384
/* Parts a reservation mapped for RMA without a set accepts (with a set: the set's room). */
#define KT_RMA_MAX_PARTS 64
/* Seconds the progress thread polls before sleeping while transfers are in flight. */
#define KT_SPIN_S 100e-6

/* Records the failing statement, function, file and line, then jumps to the cleanup label. */
#define KT_UCS_CHECK(stmt, err, label)                                                          \
    do {                                                                                        \
        ucs_status_t kt_st_ = (stmt);                                                           \
        if (kt_st_ != UCS_OK) {                                                                 \
            kt_seterr(err, "transport: %s failed: %s (%s, %s:%d)", #stmt,                      \
                      ucs_status_string(kt_st_), __func__, __FILE__, __LINE__);                 \
            goto label;                                                                         \
        }                                                                                       \
    } while (0)

/* Logs a UCX call that failed at runtime (no caller to return to: a callback or the loop). */
#define KT_UCS_LOG(t, stmt, st)                                                                 \
    kt_log(t, KT_LOG_ERROR, NULL, "%s failed: %s (%s, %s:%d)", stmt, ucs_status_string(st),    \
           __func__, __FILE__, __LINE__)

/* Bytes kept of a caller's request id, for log lines. */
#define KT_RID_MAX 64

typedef struct kt_conn kt_conn;

struct kt_conn {
    kt_conn *next;
    kt_transport *t;
    ucp_ep_h ep;
    int outgoing; /* 1: we connected (sender side), 0: accepted by the listener */
    char peer[80]; /* "host:port" as given to send, or "accepted #n" */
    struct sockaddr_storage addr; /* outgoing only: the address it was created for */
    socklen_t addrlen;
    int failed; /* the error callback fired (or we gave up on it) */
    ucs_status_t error; /* what the error callback said; UCS_OK: it did not fire */
    char fail_msg[200]; /* short: it is quoted inside other messages */
    int closing; /* detached from lookups; close request in flight */
    void *close_req;
};

/* One UCX request of ours in flight (a send or a receive): its completion callback clears
 * `pending` and records `status`; the loop frees `req` then. */
typedef struct kt_rq {
    void *req;
    int pending;
    ucs_status_t status;
} kt_rq;

/* A K or V piece whose message came before its part's head was placed: its rendezvous
 * descriptor, or its eager data kept by returning UCS_INPROGRESS (ucp_am_data_release). */
typedef struct kt_held {
    void *data; /* NULL: none */
    size_t len;
    uint64_t off;
    int rndv;
} kt_held;

/* A put part that came before the last, as its header said: read once the last one is in. */
typedef struct kt_put_part {
    uint64_t len; /* its bytes in the reservation's buffer: the part, or its head */
    int rows; /* put with its rows (KT_WIRE_PIECE): K and V in the rows regions */
} kt_put_part;

typedef struct kt_resv {
    struct kt_resv *next;
    uint64_t serial; /* unique per reservation, for release to wait on */
    uint64_t id;
    uint8_t *buf; /* the caller's; NULL: each part lands in a buffer of its own (`part`) */
    uint64_t size; /* capacity of buf, or the bytes all parts may add up to: the largest bundle */
    uint64_t filled; /* bytes of the earlier parts of a bundle sent in parts, at buf[0, filled) */
    uint8_t *part; /* buf NULL: the arriving part's buffer (partbuf.h) of its size; the set takes
                      it once the part is valid, else it is freed */
    uint64_t len; /* the arriving part's size (<= size - filled), set when it is accepted */
    int more; /* the arriving part is not the last (KT_SEND_MORE) */
    uint8_t resv_token[KT_RESV_TOKEN_BYTES]; /* what a bundle for it must carry */
    double deadline;
    unsigned flags;
    kt_bundle_set *set; /* KT_RESERVE_PARSE: the caller's; each valid part is added to it */
    kt_xfer_cb cb;
    void *cb_arg;
    kt_xfer_state state;
    kt_rq rx[KT_PIECES]; /* rendezvous receives in flight: the part, or its pieces */
    kt_conn *from; /* the connection the bundle arrives on (RECEIVING) */
    uint64_t seq; /* the sender's seq, echoed in the ack */
    int cancel_asked; /* ucp_request_cancel issued */
    ucp_mem_h memh;   /* RMA: buf mapped for the sender's puts, until the last part or the end */
    /* kt_transport_map_rows: the caller's K and V rows regions (rows_bytes each) and their
     * mappings, dropped with memh; a rows part's K and V lie there, after the earlier ones'. */
    uint8_t *rows[2];
    uint64_t rows_bytes;
    ucp_mem_h rows_memh[2];
    int put;          /* the arriving part was put (its header came alone) */
    int put_rows;     /* ... with its rows: its head is in buf (len bytes), K and V in the regions */
    kt_put_part *put_parts; /* RMA: the put parts before the arriving one, read at the end */
    uint32_t n_put, cap_put;
    uint64_t rows_more; /* bytes of the rows parts' K and V, added up by their validation */
    /* The arriving part in pieces (KT_WIRE_PIECE), for a reservation without a buffer: the head
     * lands in `head`; once it is checked, K and V land where the set's placement hook says
     * (placed 1) or in `part` after a copy of the head (placed 2). With a buffer, every piece
     * lands at its offset in it at once (placed 2). */
    int pieces;
    unsigned got, landed; /* bit i: piece i (0 head, 1 K, 2 V) came / is in place */
    uint8_t *head;
    uint64_t head_len;
    kt_bundle_layout lay; /* read from the head */
    kt_bundle_view hv; /* the head parsed */
    uint8_t *dst[KT_PIECES]; /* where each piece lands; K's and V's NULL until placed */
    int placed;
    kt_held held[2];
    int done; /* outcome known; callback pending */
    int status;
    uint64_t bytes;
    char msg[KT_ERR_MAX];
    char rid[KT_RID_MAX]; /* the caller's request id, for log lines */
} kt_resv;

typedef struct kt_send_op {
    struct kt_send_op *next;
    uint64_t seq, id;
    const void *buf;
    uint64_t size;
    char peer[80];
    struct sockaddr_storage addr;
    socklen_t addrlen;
    double deadline, timeout_s;
    kt_xfer_cb cb;
    void *cb_arg;
    kt_conn *conn;
    uint8_t hdr[KT_PIECES][KT_WIRE_HDR_BYTES]; /* the AM headers: alive until the sends complete */
    uint64_t piece_off[KT_PIECES], piece_len[KT_PIECES];
    int n_pieces; /* 1: the part whole; KT_PIECES: head, K, V (KT_WIRE_PIECE) */
    kt_rma_key rma; /* a put (kt_transport_put): the reservation's key; rkey_len 0: a send */
    uint64_t offset; /* where the part goes in the receiver's buffer */
    /* A put with its rows (kt_transport_put with rows, n_pieces KT_PIECES): the regions' keys, and
     * where its K and V go in them. */
    kt_rma_rows rows;
    uint64_t rows_off;
    ucp_rkey_h rkey[KT_PIECES]; /* unpacked on the connection's endpoint: buf's, K's, V's */
    int phase;       /* a put: KT_PUT_DATA, KT_PUT_FLUSH, then KT_PUT_HEADER */
    int started;
    kt_rq tx[KT_PIECES]; /* the sends in flight (a put's: its pieces' puts, then tx[0]) */
    int acked, ack_status;
    char ack_msg[KT_WIRE_ACK_MSG];
    int conn_failed;
    char fail_msg[KT_ERR_MAX]; /* first failure seen; outcome once the request is done */
    int done;
    int status;
    char rid[KT_RID_MAX]; /* the caller's request id, for log lines */
} kt_send_op;

enum { KT_PUT_DATA = 1, KT_PUT_FLUSH, KT_PUT_HEADER };

typedef struct kt_ack {
    struct kt_ack *next;
    kt_conn *conn; /* until started */
    uint8_t wire[KT_WIRE_ACK_BYTES];
    int started;
    void *req;
    int req_pending;
} kt_ack;

typedef struct kt_conn_req {
    struct kt_conn_req *next;
    ucp_conn_request_h req;
} kt_conn_req;

struct kt_transport {
    char name[64];
    kt_log_fn log; /* NULL: stderr */
    void *log_arg;
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_listener_h listener;
    uint16_t port;
    int rma; /* created in KT_TRANSPORT_MODE_RMA */
    int worker_efd;
    int wake_fd; /* eventfd: API calls -> progress thread */
    pthread_t thread;
    int thread_started;

    pthread_mutex_t lock;
    atomic_int api_waiting; /* API threads queued on lock: the busy progress thread yields */
    pthread_cond_t cond; /* broadcast after callbacks were delivered */
    int stopping;
    uint64_t next_seq, next_serial, n_accepted;
    kt_conn *conns;
    kt_conn *closing;
    kt_conn_req *conn_reqs;
    kt_resv *resvs;
    kt_send_op *ops;
    kt_ack *acks;
};

/* KT_TRANSPORT_TRACE in the environment: one DEBUG line per protocol event. */
#define KT_TRACE(t, ...)                                                                       \
    do {                                                                                        \
        if (kt_trace_enabled())                                                                 \
            kt_log(t, KT_LOG_DEBUG, NULL, __VA_ARGS__);                                         \
    } while (0)

/* transport.c: the loop, its helpers and connections */
int kt_trace_enabled(void);
void kt_seterr(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kt_log(const kt_transport *t, kt_log_level level, const char *rid, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
double kt_now(void);
void kt_api_lock(kt_transport *t);
void kt_wake(kt_transport *t);
kt_conn *kt_conn_by_ep(kt_transport *t, ucp_ep_h ep);
int kt_rq_busy(const kt_rq *q, int n);
ucs_status_t kt_rq_reap(kt_rq *q, int n, unsigned *finished);
void kt_on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status);
void kt_conn_close(kt_transport *t, kt_conn *c);

/* transport-recv.c: the receiving side */
void kt_resv_finish(kt_resv *r, int status, uint64_t bytes, const char *msg);
void kt_rx_cancel(kt_transport *t, kt_resv *r);
void kt_resv_unmap(kt_transport *t, kt_resv *r);
ucs_status_t kt_on_bundle(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param);
double kt_resv_step(kt_transport *t, kt_resv *r, double now);
void kt_step_acks(kt_transport *t);

/* transport-send.c: the sending side */
void kt_op_fail(kt_send_op *op, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kt_on_send_done(void *request, ucs_status_t status, void *user_data);
ucs_status_t kt_on_ack(void *arg, const void *header, size_t header_length, void *data,
                       size_t length, const ucp_am_recv_param_t *param);
double kt_op_step(kt_transport *t, kt_send_op *op, double now);
int kt_send(kt_transport *t, const kt_peer *to, const kt_put_dest *at,
            const kt_bundle_layout *pieces, const void *buf, uint64_t size, const kt_send_opts *o,
            char *err);

/* transport-put.c: RMA puts */
void kt_put_next(kt_transport *t, kt_send_op *op);
void kt_put_start(kt_transport *t, kt_send_op *op);

#endif /* KT_TRANSPORT_IMPL_H */
