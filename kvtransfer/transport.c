/*
 * transport.c - the UCX transport of transport.h: one ucp worker owned by one progress thread.
 *
 * How it works: every UCX call is made on the progress thread (or on the creating/destroying
 * thread while that thread is not running), so the worker runs in SERIALIZED mode. The API
 * functions only edit tables under t->lock and wake the thread through an eventfd; the thread
 * progresses the worker with the lock held (UCX callbacks therefore see consistent tables and
 * only record facts), acts on what the callbacks recorded (starts sends, acks, closes failed
 * endpoints, expires reservations), then calls the user's callbacks with the lock released and
 * sleeps on the worker's event fd + the eventfd until the next deadline.
 * Wire: AM id KT_AM_BUNDLE carries a 56-byte header (magic, version, seq, id, size, the
 * reservation's 16-byte token) and the bundle as data; the receiver answers every bundle with an
 * AM KT_AM_ACK (seq, id, status, message) on the reply endpoint, so the sender learns a refusal
 * instead of a silent drop. The token is drawn from getrandom at reserve time and compared in
 * constant time: a bundle with a wrong one is refused and the reservation keeps waiting.
 * RMA (KT_TRANSPORT_MODE_RMA): a reservation's buffer is mapped at reserve time and its remote
 * key handed out; the sender's op goes put -> flush -> header (flag KT_WIRE_PUT, the part's
 * offset at 32, no data), and the receiver takes the header as "the part is in buf at offset".
 * A reservation may also map two rows regions (kt_transport_map_rows: a decode node's K and V
 * rows of a run of KV blocks); a block-padded part put with its rows goes as three puts (its
 * head into buf, its K and V into the regions, each after the rows parts before it), one flush,
 * then a header with KT_WIRE_PUT and KT_WIRE_PIECE whose size is the head's. Put parts are read
 * only after the last one's header, once every mapping is gone: validating a part the sender
 * can still overwrite would prove nothing; a rows part is then parsed head first, its K and V
 * where they lie in the regions.
 * Pieces (KT_WIRE_PIECE): a block-padded bundle part is sent as three messages, its head, K and
 * V. The receiver takes the head into a buffer, checks it, asks the set's placement hook where K
 * and V go (a run of KV blocks, or a part buffer as for a whole part), and receives them there;
 * a K or V message that comes before the head was placed is held (its rendezvous descriptor or
 * its eager data, the handler returning UCS_INPROGRESS) until it has a place. ucp_mem_map and ucp_rkey_pack are
 * context calls made by the reserving thread under t->lock, which the progress thread holds
 * while it drives the worker, so they never run beside it.
 * What it is not: multi-worker, or tuned for many thousand peers (tables are linked lists: a
 * node has few peers and few reservations in flight).
 */
#include "transport.h"
#include "partbuf.h"

#include <errno.h>
#include <inttypes.h>
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

/* ------------------------------------------------------------------ helpers */

static void kt_seterr(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void kt_log(const kt_transport *t, kt_log_level level, const char *rid, const char *fmt,
                   ...) __attribute__((format(printf, 4, 5)));

static void kt_seterr(char *err, const char *fmt, ...)
{
    if (!err)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, KT_ERR_MAX, fmt, ap);
    va_end(ap);
}

/* Peer and runtime errors the loop cannot return, and trace lines: through the program's log
 * callback, or one line on stderr tagged with the role, the level and the request id. */
static void kt_log(const kt_transport *t, kt_log_level level, const char *rid, const char *fmt,
                   ...)
{
    static const char *const names[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    char line[KT_ERR_MAX + 64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (rid && !*rid)
        rid = NULL;
    if (t->log)
        t->log(t->log_arg, level, rid, line);
    else
        fprintf(stderr, "[kt %s] %s%s%s%s %s\n", t->name, names[level], rid ? " [" : "",
                rid ? rid : "", rid ? "]" : "", line);
}

static int kt_trace_on = -1;
/* KT_TRANSPORT_TRACE=1 in the environment: one stderr line per protocol event. */
#define KT_TRACE(t, ...)                                                                       \
    do {                                                                                        \
        if (kt_trace_on < 0)                                                                    \
            kt_trace_on = getenv("KT_TRANSPORT_TRACE") != NULL;                                 \
        if (kt_trace_on)                                                                        \
            kt_log(t, KT_LOG_DEBUG, NULL, __VA_ARGS__);                                         \
    } while (0)

static double kt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The progress thread holds the lock while it progresses, which under a bulk transfer is all
 * the time; a mutex is not fair, so API calls announce themselves and the loop steps aside. */
static void kt_api_lock(kt_transport *t)
{
    atomic_fetch_add(&t->api_waiting, 1);
    pthread_mutex_lock(&t->lock);
    atomic_fetch_sub(&t->api_waiting, 1);
}

static void kt_yield_to_api(kt_transport *t)
{
    if (atomic_load(&t->api_waiting) == 0)
        return;
    pthread_mutex_unlock(&t->lock);
    for (int i = 0; i < 1000 && atomic_load(&t->api_waiting) > 0; i++)
        sched_yield();
    pthread_mutex_lock(&t->lock);
}

static void kt_wake(kt_transport *t)
{
    uint64_t one = 1;
    ssize_t n = write(t->wake_fd, &one, sizeof one);
    (void)n; /* EAGAIN means a wake-up is already pending */
}

static kt_resv *kt_resv_find(kt_transport *t, uint64_t id)
{
    for (kt_resv *r = t->resvs; r; r = r->next)
        if (r->id == id && !r->done)
            return r;
    return NULL;
}

/* 1 when the tokens are equal; the time taken does not depend on where they differ, so a
 * stranger learns nothing from how fast a guess is refused. */
static int kt_token_equal(const uint8_t *a, const uint8_t *b)
{
    volatile uint8_t diff = 0;
    for (int i = 0; i < KT_RESV_TOKEN_BYTES; i++)
        diff |= (uint8_t)(a[i] ^ b[i]);
    return diff == 0;
}

static kt_conn *kt_conn_by_ep(kt_transport *t, ucp_ep_h ep)
{
    for (kt_conn *c = t->conns; c; c = c->next)
        if (c->ep == ep)
            return c;
    return NULL;
}

static void kt_resv_finish(kt_resv *r, int status, uint64_t bytes, const char *msg)
{
    if (r->done)
        return;
    r->done = 1;
    r->status = status;
    r->bytes = bytes;
    snprintf(r->msg, sizeof r->msg, "%s", msg ? msg : "");
}

static void kt_on_recv_done(void *request, ucs_status_t status, size_t length, void *user_data);

/* 1 while any of q[0, n) is in flight. */
static int kt_rq_busy(const kt_rq *q, int n)
{
    for (int i = 0; i < n; i++)
        if (q[i].req)
            return 1;
    return 0;
}

/* Frees the requests of q[0, n) that completed, setting bit i of *finished for each that did
 * so successfully; returns the first failure's status (UCS_OK: none). */
static ucs_status_t kt_rq_reap(kt_rq *q, int n, unsigned *finished)
{
    ucs_status_t first = UCS_OK;
    for (int i = 0; i < n; i++) {
        if (!q[i].req || q[i].pending)
            continue;
        ucp_request_free(q[i].req);
        q[i].req = NULL;
        if (q[i].status == UCS_OK)
            *finished |= 1u << i;
        else if (first == UCS_OK)
            first = q[i].status;
    }
    return first;
}

/* Lands `length` bytes of an arriving message at dst: eager data is copied now (and given back
 * to UCX when it was held past its callback), a rendezvous is received through q. 1 when the
 * bytes are in place already, 0 when q will say, -1 with msg when UCX refused. */
static int kt_land(kt_transport *t, void *data, size_t length, int rndv, int held, uint8_t *dst,
                   kt_rq *q, char *msg)
{
    if (!rndv) {
        memcpy(dst, data, length);
        if (held)
            ucp_am_data_release(t->worker, data);
        return 1;
    }
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .cb.recv_am = kt_on_recv_done,
        .user_data = q,
    };
    q->pending = 1; /* before the call: UCX may run the callback inside it */
    ucs_status_ptr_t sp = ucp_am_recv_data_nbx(t->worker, data, dst, length, &p);
    if (UCS_PTR_IS_ERR(sp)) {
        q->pending = 0;
        snprintf(msg, KT_ERR_MAX, "transport: ucp_am_recv_data_nbx failed: %s",
                 ucs_status_string(UCS_PTR_STATUS(sp)));
        return -1;
    }
    q->req = sp;
    return 0;
}

/* Asks UCX once to cancel r's receives still in flight: the buffers are the caller's again only
 * once UCX stops writing into them. */
static void kt_rx_cancel(kt_transport *t, kt_resv *r)
{
    if (r->cancel_asked || !kt_rq_busy(r->rx, KT_PIECES))
        return;
    r->cancel_asked = 1;
    for (int i = 0; i < KT_PIECES; i++)
        if (r->rx[i].req && r->rx[i].pending)
            ucp_request_cancel(t->worker, r->rx[i].req);
}

/* Gives back to UCX the pieces r held for a place they will never get. */
static void kt_held_release(kt_transport *t, kt_resv *r)
{
    for (int i = 0; i < 2; i++) {
        if (r->held[i].data)
            ucp_am_data_release(t->worker, r->held[i].data);
        r->held[i].data = NULL;
    }
}

/* Which piece of r's arriving part lies at [off, off + len): 1 K, 2 V (by the layout read from
 * the head), -1 none. */
static int kt_piece_index(const kt_resv *r, uint64_t off, uint64_t len)
{
    if (off == r->lay.k_off && len == r->lay.k_len)
        return 1;
    if (off == r->lay.v_off && len == r->lay.v_len)
        return 2;
    return -1;
}

/* Ready for r's next part: what the one before left in the piece state is gone (its buffers
 * belong to the set, or were freed). */
static void kt_resv_next_part(kt_resv *r)
{
    kt_partbuf_free(r->head);
    r->head = NULL;
    r->pieces = 0;
    r->got = r->landed = 0;
    r->placed = 0;
    memset(r->dst, 0, sizeof r->dst);
}

static void kt_mem_unmap(kt_transport *t, ucp_mem_h *memh)
{
    if (!*memh) return;
    ucs_status_t st = ucp_mem_unmap(t->ctx, *memh);
    if (st != UCS_OK) KT_UCS_LOG(t, "ucp_mem_unmap", st);
    *memh = NULL;
}

/* Drops r's RMA mappings, its buffer's and its rows regions': from here on a put into any of
 * them fails at the sender (on a transport that checks keys, docs/transport.md). */
static void kt_resv_unmap(kt_transport *t, kt_resv *r)
{
    kt_mem_unmap(t, &r->memh);
    kt_mem_unmap(t, &r->rows_memh[0]);
    kt_mem_unmap(t, &r->rows_memh[1]);
}

/* Adds a validated part to r->set, which then owns *owned (the part's buffer, cleared here;
 * NULL: the caller's memory), and calls the set's part hook on it. */
static int kt_set_take(kt_resv *r, const kt_bundle_view *v, int last, uint8_t **owned, char *err)
{
    if (!r->set)
        return 0;
    if (kt_bundle_set_add(r->set, v, last, err) != 0)
        return -1;
    if (owned)
        *owned = NULL;
    kt_bundle_set *s = r->set;
    return s->on_part ? s->on_part(s->on_part_arg, s, s->n_parts - 1, err) : 0;
}

/* Validates put part i of r, put with its rows: its head of `len` bytes at `head`, its K and V at
 * *rows_at in r's rows regions (advanced past them), and adds it to r->set (the view points
 * into r's buffer and the regions, the caller's memory). */
static int kt_parse_rows_part(kt_resv *r, uint32_t i, const uint8_t *head, uint64_t len,
                              int last, uint64_t *rows_at, char *err)
{
    char why[KT_ERR_MAX] = "";
    kt_bundle_layout lay;
    kt_bundle_view v;
    int rc = kt_bundle_layout_read(head, (size_t)len, &lay, why);
    if (rc == 0 && (!lay.split || lay.head_len != len || lay.k_len != lay.v_len)) {
        snprintf(why, sizeof why, "its %" PRIu64 "-byte head does not match its layout (a %"
                 PRIu64 "-byte head, K and V of %" PRIu64 " and %" PRIu64 " bytes%s)", len,
                 lay.head_len, lay.k_len, lay.v_len, lay.split ? "" : ", not to be split");
        rc = -1;
    } else if (rc == 0 && lay.k_len > r->rows_bytes - *rows_at) {
        snprintf(why, sizeof why, "its K and V (%" PRIu64 " bytes each) end past the rows "
                 "regions (%" PRIu64 " bytes, %" PRIu64 " taken by the parts before it)",
                 lay.k_len, r->rows_bytes, *rows_at);
        rc = -1;
    }
    if (rc == 0 && (kt_bundle_parse_head(head, (size_t)len, lay.size, &v, why) != 0 ||
                    kt_bundle_parse_rows(&v, r->rows[0] + *rows_at, r->rows[1] + *rows_at,
                                         why) != 0))
        rc = -1;
    if (rc != 0) {
        kt_seterr(err, "part %" PRIu32 " (put with its rows): %s", i, why);
        return -1;
    }
    *rows_at += lay.k_len;
    r->rows_more += lay.size - len;
    return kt_set_take(r, &v, last, NULL, err);
}

/* Validates what arrived for r and adds it to r->set, then calls the set's part hook: the part
 * that just landed, or, for a bundle put in parts, each part in order now that the last is in
 * (a part put with its rows: its head in r's buffer, its K and V in the rows regions, each
 * region filled in part order). A part buffer of r's own belongs to the set once added. A part
 * that came in pieces and was placed by the set's hook has its head validated already: only its
 * K and V are checked, where they landed. Runs without t->lock (only the progress thread
 * touches r's buffers and set meanwhile; the rows regions are unmapped and can no longer be
 * mapped). */
static int kt_parse_arrived(kt_resv *r, char *err)
{
    kt_bundle_view v;
    if (r->pieces && r->placed == 1) {
        v = r->hv;
        return kt_bundle_parse_rows(&v, r->dst[1], r->dst[2], err) != 0
                   ? -1
                   : kt_set_take(r, &v, !r->more, &r->head, err);
    }
    uint32_t n = r->put ? r->n_put + 1 : 1;
    uint64_t at = r->put ? 0 : r->filled, rows_at = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t len = i + 1 < n ? r->put_parts[i].len : r->len;
        const int rows = i + 1 < n ? r->put_parts[i].rows : r->put_rows;
        const int last = i + 1 == n && !r->more;
        uint8_t *part = r->buf ? r->buf + at : r->part;
        if (rows ? kt_parse_rows_part(r, i, part, len, last, &rows_at, err) != 0
                 : kt_bundle_parse(part, (size_t)len, &v, err) != 0 ||
                       kt_set_take(r, &v, last, part == r->part ? &r->part : NULL, err) != 0)
            return -1;
        at += len;
    }
    return 0;
}

static void kt_op_fail(kt_send_op *op, const char *fmt, ...)
{
    if (op->fail_msg[0])
        return; /* keep the first cause */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(op->fail_msg, sizeof op->fail_msg, fmt, ap);
    va_end(ap);
}

/* Queues an acknowledgement of a bundle on `c` (sent by the loop, never from a callback). */
static void kt_ack_queue(kt_transport *t, kt_conn *c, uint64_t seq, uint64_t id, int status,
                         uint64_t bytes, const char *msg)
{
    if (!c || c->failed || c->closing)
        return;
    kt_ack *a = calloc(1, sizeof *a);
    if (!a) {
        kt_log(t, KT_LOG_ERROR, NULL, "out of memory queueing the ack of bundle %" PRIu64, id);
        return;
    }
    a->conn = c;
    kt_wr32(a->wire, KT_WIRE_MAGIC);
    kt_wr16(a->wire + 4, KT_WIRE_VERSION);
    kt_wr16(a->wire + 6, status == 0 ? 0 : 1);
    kt_wr64(a->wire + 8, seq);
    kt_wr64(a->wire + 16, id);
    kt_wr64(a->wire + 24, bytes);
    snprintf((char *)a->wire + 40, KT_WIRE_ACK_MSG, "%s", msg ? msg : "");
    /* In the order queued: a sender takes the first ack of a seq, and a part refused by one
     * piece has its later pieces answered "unknown or expired" (the list is short). */
    kt_ack **pp = &t->acks;
    while (*pp)
        pp = &(*pp)->next;
    *pp = a;
}

/* ------------------------------------------------------------------ UCX callbacks
 * They run inside ucp_worker_progress, on the progress thread, with t->lock held. They only
 * record what happened; the loop acts on it. */

static void kt_on_conn_request(ucp_conn_request_h req, void *arg)
{
    kt_transport *t = arg;
    kt_conn_req *cr = calloc(1, sizeof *cr);
    if (!cr || t->stopping) {
        free(cr);
        ucs_status_t st = ucp_listener_reject(t->listener, req);
        if (st != UCS_OK)
            KT_UCS_LOG(t, "ucp_listener_reject", st);
        return;
    }
    cr->req = req;
    cr->next = t->conn_reqs;
    t->conn_reqs = cr;
}

static void kt_on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    kt_conn *c = arg;
    if (c->failed)
        return;
    c->failed = 1;
    snprintf(c->fail_msg, sizeof c->fail_msg, "peer %s failed: %s", c->peer,
             ucs_status_string(status));
    c->error = status; /* logged when the loop closes it, where it knows what hung on it */
}

static void kt_on_recv_done(void *request, ucs_status_t status, size_t length, void *user_data)
{
    kt_rq *q = user_data;
    q->pending = 0;
    q->status = status;
    (void)request;
    (void)length;
}

static void kt_on_send_done(void *request, ucs_status_t status, void *user_data)
{
    kt_rq *q = user_data;
    q->pending = 0;
    q->status = status;
    (void)request;
}

static void kt_on_ack_sent(void *request, ucs_status_t status, void *user_data)
{
    kt_ack *a = user_data;
    a->req_pending = 0;
    (void)request;
    (void)status; /* a lost ack shows up as the sender's timeout or peer failure */
}

/* Fails r's arriving bundle: the log names the peer, the sender hears msg in the ack. */
static void kt_resv_reject(kt_transport *t, kt_resv *r, const char *msg)
{
    kt_log(t, KT_LOG_WARN, r->rid, "%s (from %s)", msg + strlen("transport: "),
           r->from ? r->from->peer : "?");
    kt_resv_finish(r, -1, 0, msg);
    kt_ack_queue(t, r->from, r->seq, r->id, -1, 0, msg);
}

/* One piece of r's arriving part (KT_WIRE_PIECE): the head lands in its buffer at once; K or V
 * lands where the part was placed, or is held until the head is placed (kt_place). A piece
 * that fits nowhere fails the reservation. Returns what the AM handler returns: UCS_INPROGRESS
 * keeps a held piece's descriptor or data. */
static ucs_status_t kt_on_piece(kt_transport *t, kt_resv *r, const uint8_t *h, void *data,
                                size_t length, uint64_t offset, int rndv,
                                const ucp_am_recv_param_t *param)
{
    char msg[KT_ERR_MAX] = "";
    const int i = offset == 0 ? 0 : r->placed ? kt_piece_index(r, offset, length) : -2;
    if (!kt_token_equal(h + 40, r->resv_token))
        snprintf(msg, sizeof msg, "transport: wrong token in a piece of bundle %" PRIu64, r->id);
    else if (kt_rd64(h + 24) != r->len || length == 0 || offset > r->len ||
             length > r->len - offset)
        snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 ": a piece of %zu bytes at offset "
                 "%" PRIu64 " does not fit its part of %" PRIu64 " bytes", r->id, length, offset,
                 r->len);
    else if (i == -1)
        snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 ": the piece of %zu bytes at "
                 "offset %" PRIu64 " is neither its K nor its V section", r->id, length, offset);
    else if (i >= 0 && (r->got & (1u << i)))
        snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 ": its piece at offset %" PRIu64
                 " came twice", r->id, offset);
    else if (i == -2 && r->held[0].data && r->held[1].data)
        snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 ": more than two pieces came "
                 "before its head", r->id);
    else if (i == -2 && !rndv && !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA))
        snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 ": an eager piece came before "
                 "its head and UCX cannot keep it", r->id);
    if (msg[0]) {
        kt_resv_reject(t, r, msg);
        return UCS_OK;
    }
    if (i == -2) {
        kt_held *held = r->held[0].data ? &r->held[1] : &r->held[0];
        *held = (kt_held){.data = data, .len = length, .off = offset, .rndv = rndv};
        return UCS_INPROGRESS;
    }
    if (i == 0) {
        r->head_len = length;
        r->dst[0] = r->buf ? r->buf + r->filled : (r->head = kt_partbuf_alloc(length));
        if (!r->dst[0]) {
            snprintf(msg, sizeof msg, "transport: no memory for the %zu-byte head of bundle %"
                     PRIu64, length, r->id);
            kt_resv_reject(t, r, msg);
            return UCS_OK;
        }
    }
    r->got |= 1u << i;
    const int rc = kt_land(t, data, length, rndv, 0, r->dst[i], &r->rx[i], msg);
    if (rc > 0)
        r->landed |= 1u << i;
    else if (rc < 0)
        kt_resv_reject(t, r, msg);
    return UCS_OK;
}

static ucs_status_t kt_on_bundle(void *arg, const void *header, size_t header_length, void *data,
                                 size_t length, const ucp_am_recv_param_t *param)
{
    kt_transport *t = arg;
    kt_conn *c = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)
                     ? kt_conn_by_ep(t, param->reply_ep)
                     : NULL;
    if (!c) {
        kt_log(t, KT_LOG_WARN, NULL, "bundle from an unknown endpoint dropped (%zu bytes)", length);
        return UCS_OK;
    }
    const uint8_t *h = header;
    if (header_length != KT_WIRE_HDR_BYTES || kt_rd32(h) != KT_WIRE_MAGIC ||
        kt_rd16(h + 4) != KT_WIRE_VERSION) {
        kt_log(t, KT_LOG_WARN, NULL, "malformed bundle header from %s (%zu bytes) dropped", c->peer,
               header_length);
        kt_ack_queue(t, c, header_length >= 16 ? kt_rd64(h + 8) : 0, 0, -1, 0,
                     "transport: malformed bundle header (version or magic)");
        return UCS_OK;
    }
    uint64_t seq = kt_rd64(h + 8), id = kt_rd64(h + 16), size = kt_rd64(h + 24);
    uint64_t offset = kt_rd64(h + 32);
    const uint16_t wf = kt_rd16(h + 6);
    int put = (wf & KT_WIRE_PUT) != 0, more = (wf & KT_SEND_MORE) != 0;
    /* A put piece is a part put with its rows: its head (`size` bytes) at the offset in buf,
     * its K and V in the rows regions. */
    int piece = (wf & KT_WIRE_PIECE) != 0 && !put, rows = (wf & KT_WIRE_PIECE) != 0 && put;
    const int rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    KT_TRACE(t, "bundle %" PRIu64 " arrives from %s: %zu bytes, %s", id, c->peer, length,
             rows ? "put with its rows" : put ? "put" : rndv ? "rendezvous" : "eager");
    char msg[KT_ERR_MAX];
    kt_resv *r = kt_resv_find(t, id);
    if (piece && r && r->state == KT_XFER_STATE_RECEIVING && r->pieces && r->seq == seq &&
        r->from == c) /* a later piece of the arriving part */
        return kt_on_piece(t, r, h, data, length, offset, rndv, param);
    if (!r || r->state != KT_XFER_STATE_RESERVED) {
        snprintf(msg, sizeof msg,
                 r ? "transport: reservation %" PRIu64 " is already receiving another bundle"
                   : "transport: unknown or expired reservation %" PRIu64,
                 id);
    } else if (!kt_token_equal(h + 40, r->resv_token)) {
        /* the reservation stays RESERVED: the right sender may still come */
        snprintf(msg, sizeof msg,
                 "transport: wrong token for reservation %" PRIu64 ": bundle refused", id);
    } else if (put ? length != 0 || size == 0
               : piece ? length == 0 || offset > size || length > size - offset
                       : size != length || length == 0) {
        snprintf(msg, sizeof msg,
                 "transport: bundle for reservation %" PRIu64 " is malformed: header says %" PRIu64
                 " bytes%s, %zu arrived%s",
                 id, size, put ? " put" : "", length, piece ? " as a piece" : "");
    } else if (put ? r->filled != 0 && r->n_put == 0 : r->n_put > 0) {
        snprintf(msg, sizeof msg,
                 "transport: reservation %" PRIu64 ": a bundle's parts must "
                 "all be put or all be sent",
                 id);
    } else if (put && !r->memh) {
        snprintf(msg, sizeof msg,
                 "transport: reservation %" PRIu64 " is not mapped for RMA: put bundle refused",
                 id);
    } else if (rows && !r->rows_memh[0]) {
        snprintf(msg, sizeof msg,
                 "transport: reservation %" PRIu64 " is not mapped for rows: a part put with its "
                 "rows refused", id);
    } else if (put && offset != r->filled) {
        snprintf(msg, sizeof msg,
                 "transport: part for reservation %" PRIu64 " put at offset %" PRIu64
                 ", the parts before it end at %" PRIu64,
                 id, offset, r->filled);
    } else if (put && more && r->n_put + 1 >= r->cap_put) {
        snprintf(msg, sizeof msg,
                 "transport: reservation %" PRIu64 ": more than %" PRIu32 " parts put", id,
                 r->cap_put);
    } else if (size > r->size - r->filled) {
        snprintf(msg, sizeof msg,
                 "transport: bundle too large for reservation %" PRIu64
                 ": reserved at most %" PRIu64 " bytes, bundle has %" PRIu64,
                 id, r->size, r->filled + size);
    } else {
        msg[0] = 0;
    }
    if (msg[0]) {
        /* Refused: returning OK without receiving drops the data; the ack tells the sender. */
        kt_log(t, KT_LOG_WARN, r ? r->rid : NULL, "%s (from %s)", msg + strlen("transport: "),
               c->peer);
        kt_ack_queue(t, c, seq, id, -1, 0, msg);
        return UCS_OK;
    }
    r->from = c;
    r->seq = seq;
    r->len = size;
    r->more = more;
    r->put = put;
    r->put_rows = rows;
    r->state = KT_XFER_STATE_RECEIVING;
    if (put) /* the part is in buf already: the loop takes it from here */
        return UCS_OK;
    if (piece) {
        r->pieces = 1;
        return kt_on_piece(t, r, h, data, length, offset, rndv, param);
    }
    uint8_t *dst = r->buf ? r->buf + r->filled : (r->part = kt_partbuf_alloc(length));
    if (!dst)
        snprintf(msg, sizeof msg, "transport: no memory for a %zu-byte part of bundle %" PRIu64,
                 length, id);
    if (!dst || kt_land(t, data, length, rndv, 0, dst, &r->rx[0], msg) < 0) {
        kt_log(t, KT_LOG_WARN, r->rid, "%s (from %s)", msg + strlen("transport: "), c->peer);
        kt_resv_finish(r, -1, 0, msg);
        kt_ack_queue(t, c, seq, id, -1, 0, msg);
    }
    return UCS_OK;
}

static ucs_status_t kt_on_ack(void *arg, const void *header, size_t header_length, void *data,
                              size_t length, const ucp_am_recv_param_t *param)
{
    kt_transport *t = arg;
    const uint8_t *w = data;
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || length != KT_WIRE_ACK_BYTES ||
        kt_rd32(w) != KT_WIRE_MAGIC || kt_rd16(w + 4) != KT_WIRE_VERSION) {
        kt_log(t, KT_LOG_WARN, NULL, "malformed acknowledgement (%zu bytes) dropped", length);
        return UCS_OK;
    }
    uint64_t seq = kt_rd64(w + 8);
    KT_TRACE(t, "ack for seq %" PRIu64 ": %s", seq, (const char *)w + 40);
    for (kt_send_op *op = t->ops; op; op = op->next) {
        if (op->seq == seq && !op->acked) {
            op->acked = 1;
            op->ack_status = kt_rd16(w + 6) == 0 ? 0 : -1;
            memcpy(op->ack_msg, w + 40, KT_WIRE_ACK_MSG);
            op->ack_msg[KT_WIRE_ACK_MSG - 1] = 0;
            return UCS_OK;
        }
    }
    (void)header;
    (void)header_length;
    return UCS_OK; /* an ack for a send that already timed out */
}

/* ------------------------------------------------------------------ the loop's actions */

static void kt_conn_close(kt_transport *t, kt_conn *c)
{
    if (c->closing)
        return;
    /* Detach: the next send to this address creates a new endpoint. */
    for (kt_conn **pp = &t->conns; *pp; pp = &(*pp)->next) {
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    }
    c->closing = 1;
    if (c->error != UCS_OK) { /* a peer that went away between bundles is no failure */
        const char *busy = NULL; /* the request id of a transfer it held, "" for none given */
        for (kt_resv *r = t->resvs; r && !busy; r = r->next)
            busy = r->from == c && !r->done ? r->rid : NULL;
        for (kt_send_op *op = t->ops; op && !busy; op = op->next)
            busy = op->conn == c && !op->done ? op->rid : NULL;
        if (busy)
            kt_log(t, KT_LOG_WARN, busy, "%s", c->fail_msg);
        else
            kt_log(t, KT_LOG_INFO, NULL, "peer %s disconnected (%s); nothing was in flight on it",
                   c->peer, ucs_status_string(c->error));
    }
    if (!c->failed) {
        c->failed = 1;
        snprintf(c->fail_msg, sizeof c->fail_msg, "connection to %s closed", c->peer);
    }
    /* Nothing may reference c once it is freed: unstarted acks, reservations, sends. */
    for (kt_ack **pp = &t->acks; *pp;) {
        kt_ack *a = *pp;
        if (!a->started && a->conn == c) {
            *pp = a->next;
            free(a);
        } else {
            pp = &a->next;
        }
    }
    for (kt_resv *r = t->resvs; r; r = r->next) {
        if (r->from != c)
            continue;
        r->from = NULL;
        if (!r->done) {
            char msg[KT_ERR_MAX];
            snprintf(msg, sizeof msg, "transport: reservation %" PRIu64
                     ": sender failed mid-transfer (%s)", r->id, c->fail_msg);
            kt_resv_finish(r, -1, 0, msg);
        }
        kt_rx_cancel(t, r);
    }
    for (kt_send_op *op = t->ops; op; op = op->next) {
        if (op->conn != c)
            continue;
        op->conn = NULL;
        op->conn_failed = 1;
        kt_op_fail(op, "transport: send of bundle %" PRIu64 " to %s failed: %s", op->id,
                   op->peer, c->fail_msg);
    }
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t sp = ucp_ep_close_nbx(c->ep, &p);
    if (UCS_PTR_IS_ERR(sp))
        KT_UCS_LOG(t, "ucp_ep_close_nbx(FORCE)", UCS_PTR_STATUS(sp));
    c->close_req = UCS_PTR_IS_PTR(sp) ? sp : NULL;
    c->next = t->closing;
    t->closing = c;
}

static void kt_accept(kt_transport *t, ucp_conn_request_h req)
{
    kt_conn *c = calloc(1, sizeof *c);
    if (!c) {
        kt_log(t, KT_LOG_ERROR, NULL, "out of memory accepting a connection; rejected");
        ucp_listener_reject(t->listener, req);
        return;
    }
    c->t = t;
    snprintf(c->peer, sizeof c->peer, "accepted #%" PRIu64, ++t->n_accepted);
    ucp_conn_request_attr_t qa = {.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR};
    if (ucp_conn_request_query(req, &qa) == UCS_OK && qa.client_address.ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)&qa.client_address;
        char ip[INET_ADDRSTRLEN] = "?";
        inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
        snprintf(c->peer, sizeof c->peer, "%s:%u (accepted)", ip, ntohs(in->sin_port));
    }
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .conn_request = req,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = kt_on_ep_error, .arg = c},
    };
    ucs_status_t st = ucp_ep_create(t->worker, &ep, &c->ep);
    if (st != UCS_OK) {
        KT_UCS_LOG(t, "ucp_ep_create(conn_request)", st);
        free(c);
        return;
    }
    c->next = t->conns;
    t->conns = c;
}

static kt_conn *kt_connect(kt_transport *t, kt_send_op *op)
{
    for (kt_conn *c = t->conns; c; c = c->next)
        if (c->outgoing && !c->failed && c->addrlen == op->addrlen &&
            memcmp(&c->addr, &op->addr, op->addrlen) == 0)
            return c;
    kt_conn *c = calloc(1, sizeof *c);
    if (!c) {
        kt_op_fail(op, "transport: out of memory connecting to %s", op->peer);
        return NULL;
    }
    c->t = t;
    c->outgoing = 1;
    snprintf(c->peer, sizeof c->peer, "%s", op->peer);
    c->addr = op->addr;
    c->addrlen = op->addrlen;
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (const struct sockaddr *)&c->addr, .addrlen = c->addrlen},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = kt_on_ep_error, .arg = c},
    };
    ucs_status_t st = ucp_ep_create(t->worker, &ep, &c->ep);
    if (st != UCS_OK) {
        kt_op_fail(op, "transport: connecting to %s: ucp_ep_create failed: %s (is UCX_TLS "
                   "missing tcp?)", op->peer, ucs_status_string(st));
        free(c);
        return NULL;
    }
    c->next = t->conns;
    t->conns = c;
    return c;
}

/* Issues a put's next step: the data (the part, or its head, K and V: one put each, in flight
 * together), a flush (the data is in the receiver's memory when it completes), then the header
 * that tells the receiver so. 1 when UCX completed all of it in the call, with no request to
 * wait for. */
static int kt_put_step(kt_transport *t, kt_send_op *op)
{
    static const char *const section[KT_PIECES] = {"", " (K)", " (V)"};
    ucp_ep_h ep = op->conn->ep;
    const int phase = ++op->phase, n = phase == KT_PUT_DATA ? op->n_pieces : 1;
    int in_call = 0;
    for (int i = 0; i < n; i++) {
        kt_rq *q = &op->tx[i];
        ucp_request_param_t p = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            .cb.send = kt_on_send_done,
            .user_data = q,
        };
        const char *what;
        ucs_status_ptr_t sp;
        if (phase == KT_PUT_DATA && op->piece_len[i] == 0) { /* nothing to put */
            in_call++;
            continue;
        }
        q->pending = 1; /* before the call: UCX may run the callback inside it */
        switch (phase) {
        case KT_PUT_DATA:
            what = "ucp_put_nbx";
            sp = ucp_put_nbx(ep, (const uint8_t *)op->buf + op->piece_off[i], op->piece_len[i],
                             i == 0   ? op->rma.address + op->offset
                             : i == 1 ? op->rows.k.address + op->rows_off
                                      : op->rows.v.address + op->rows_off,
                             op->rkey[i], &p);
            break;
        case KT_PUT_FLUSH:
            what = "ucp_ep_flush_nbx";
            sp = ucp_ep_flush_nbx(ep, &p);
            break;
        default:
            what = "ucp_am_send_nbx(header)";
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
            sp = ucp_am_send_nbx(ep, KT_AM_BUNDLE, op->hdr[0], sizeof op->hdr[0], NULL, 0, &p);
            break;
        }
        if (UCS_PTR_IS_ERR(sp)) {
            q->pending = 0;
            kt_op_fail(op, "transport: %s%s of bundle %" PRIu64 " to %s failed: %s", what,
                       phase == KT_PUT_DATA ? section[i] : "", op->id, op->peer,
                       ucs_status_string(UCS_PTR_STATUS(sp)));
            return 0; /* the puts already in flight finish or fail; the loop closes the rest */
        }
        if (!sp) {
            KT_TRACE(t, "%s%s of bundle %" PRIu64 " completed in the call", what,
                     phase == KT_PUT_DATA ? section[i] : "", op->id);
            q->pending = 0;
            in_call++;
            continue;
        }
        q->req = sp;
    }
    return in_call == n;
}

/* A put's steps from the next one on, up to the first that UCX has not completed at once. */
static void kt_put_next(kt_transport *t, kt_send_op *op)
{
    while (op->phase < KT_PUT_HEADER && kt_put_step(t, op)) {
    }
}

static void kt_op_start(kt_transport *t, kt_send_op *op)
{
    op->started = 1;
    kt_conn *c = kt_connect(t, op);
    if (!c)
        return;
    op->conn = c;
    if (op->rma.rkey_len) {
        /* The buffer's key, and for a put with its rows the K and V regions' keys. */
        const kt_rma_key *keys[KT_PIECES] = {&op->rma, &op->rows.k, &op->rows.v};
        static const char *const whose[KT_PIECES] = {"", "K rows ", "V rows "};
        for (int i = 0; i < op->n_pieces; i++) {
            ucs_status_t st = ucp_ep_rkey_unpack(c->ep, keys[i]->rkey, &op->rkey[i]);
            if (st != UCS_OK) {
                op->rkey[i] = NULL;
                kt_op_fail(op,
                           "transport: the %sremote key of reservation %" PRIu64 " from %s does "
                           "not unpack: %s",
                           whose[i], op->id, op->peer, ucs_status_string(st));
                return;
            }
        }
        if (op->n_pieces > 1)
            KT_TRACE(t, "put of bundle %" PRIu64 " with its rows: a %" PRIu64 "-byte head at %"
                     PRIu64 ", K and V of %" PRIu64 " bytes each at %" PRIu64 " of the rows",
                     op->id, op->piece_len[0], op->offset, op->piece_len[1], op->rows_off);
        kt_put_next(t, op);
        return;
    }
    /* The part whole, or its pieces (head, K, V) in that order on the one endpoint. */
    for (int i = 0; i < op->n_pieces; i++) {
        const uint64_t len = op->piece_len[i];
        const uint32_t how = op->n_pieces > 1 && i == 0
                                 ? (len > KT_HEAD_EAGER_MAX ? UCP_AM_SEND_FLAG_RNDV
                                                            : UCP_AM_SEND_FLAG_EAGER)
                                 : (len > KT_RNDV_MIN_BYTES ? UCP_AM_SEND_FLAG_RNDV : 0);
        ucp_request_param_t p = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            .cb.send = kt_on_send_done,
            .user_data = &op->tx[i],
            .flags = UCP_AM_SEND_FLAG_REPLY | how,
        };
        /* Pending before the call: UCX may run the callback inside it. */
        op->tx[i].pending = 1;
        ucs_status_ptr_t sp =
            ucp_am_send_nbx(c->ep, KT_AM_BUNDLE, op->hdr[i], sizeof op->hdr[i],
                            (const uint8_t *)op->buf + op->piece_off[i], len, &p);
        if (UCS_PTR_IS_ERR(sp)) {
            op->tx[i].pending = 0;
            kt_op_fail(op, "transport: ucp_am_send_nbx of bundle %" PRIu64 " to %s failed: %s",
                       op->id, op->peer, ucs_status_string(UCS_PTR_STATUS(sp)));
            return;
        }
        op->tx[i].req = sp;
    }
}

/* r's head piece has landed: reads the part's layout from it and decides where K and V land.
 * Without a buffer of r's own and with a placement hook on its set, the head is validated and
 * the hook says (its memory: placed 1); otherwise K and V land after the head in r's buffer, or
 * in a part buffer the head is copied into (placed 2). Then the pieces held for a place are
 * received there. The layout and the hook run without t->lock, as a part's validation does. */
static void kt_place(kt_transport *t, kt_resv *r)
{
    char err[KT_ERR_MAX] = "", msg[KT_ERR_MAX];
    const int hook = !r->buf && r->set && r->set->on_place;
    void *k = NULL, *v = NULL;
    int rc = 0;
    pthread_mutex_unlock(&t->lock);
    if (kt_bundle_layout_read(r->dst[0], (size_t)r->head_len, &r->lay, err) != 0)
        rc = -1;
    else if (!r->lay.split || r->lay.size != r->len || r->lay.head_len != r->head_len) {
        snprintf(err, sizeof err, "its pieces (a %" PRIu64 "-byte head of a %" PRIu64 "-byte "
                 "part) do not match its layout (a %" PRIu64 "-byte head of %" PRIu64 " bytes%s)",
                 r->head_len, r->len, r->lay.head_len, r->lay.size,
                 r->lay.split ? "" : ", not to be sent in pieces");
        rc = -1;
    } else if (hook && kt_bundle_parse_head(r->dst[0], (size_t)r->head_len, r->len, &r->hv,
                                            err) != 0)
        rc = -1;
    else if (hook)
        rc = r->set->on_place(r->set->on_part_arg, r->set, &r->hv, &k, &v, err);
    pthread_mutex_lock(&t->lock);
    if (r->done) /* released meanwhile; memory the hook placed is its owner's to take back */
        return;
    if (rc < 0) {
        snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 " rejected: %s", r->id, err);
        kt_resv_reject(t, r, msg);
        return;
    }
    if (hook && rc == 0) {
        r->placed = 1;
        r->dst[1] = k;
        r->dst[2] = v;
    } else {
        uint8_t *base = r->buf ? r->buf + r->filled : (r->part = kt_partbuf_alloc(r->len));
        if (!base) {
            snprintf(msg, sizeof msg, "transport: no memory for a %" PRIu64 "-byte part of bundle "
                     "%" PRIu64, r->len, r->id);
            kt_resv_reject(t, r, msg);
            return;
        }
        if (!r->buf) {
            memcpy(base, r->head, (size_t)r->head_len);
            kt_partbuf_free(r->head);
            r->head = NULL;
            r->dst[0] = base;
        }
        r->placed = 2;
        r->dst[1] = base + r->lay.k_off;
        r->dst[2] = base + r->lay.v_off;
    }
    for (int h = 0; h < 2; h++) {
        kt_held held = r->held[h];
        if (!held.data)
            continue;
        r->held[h].data = NULL;
        const int i = kt_piece_index(r, held.off, held.len);
        int rc2 = -1;
        if (i < 0 || (r->got & (1u << i)))
            snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 ": the piece of %zu bytes at "
                     "offset %" PRIu64 " is %s", r->id, held.len, held.off,
                     i < 0 ? "neither its K nor its V section" : "there twice");
        else
            rc2 = kt_land(t, held.data, held.len, held.rndv, 1, r->dst[i], &r->rx[i], msg);
        if (rc2 < 0) {
            if (i < 0 || (r->got & (1u << i)))
                ucp_am_data_release(t->worker, held.data);
            kt_resv_reject(t, r, msg);
            return;
        }
        r->got |= 1u << i;
        if (rc2 > 0)
            r->landed |= 1u << i;
    }
}

/* One pass over every table; returns the earliest deadline still ahead (or now + 1 s). */
static double kt_step(kt_transport *t)
{
    double now = kt_now(), next = now + 1.0;

    while (t->conn_reqs) {
        kt_conn_req *cr = t->conn_reqs;
        t->conn_reqs = cr->next;
        if (t->stopping)
            ucp_listener_reject(t->listener, cr->req);
        else
            kt_accept(t, cr->req);
        free(cr);
    }

    /* Reservations: finish receives, place pieces, expire, shut down. */
    for (kt_resv *r = t->resvs; r; r = r->next) {
        unsigned finished = 0;
        ucs_status_t rst = kt_rq_reap(r->rx, KT_PIECES, &finished);
        if (finished || rst != UCS_OK)
            KT_TRACE(t, "receive of bundle %" PRIu64 " done: %s (pieces 0x%x in)", r->id,
                     ucs_status_string(rst), finished);
        r->landed |= finished;
        if (rst != UCS_OK && !r->done) {
            char msg[KT_ERR_MAX];
            snprintf(msg, sizeof msg, "transport: reservation %" PRIu64
                     ": receiving the bundle failed: %s", r->id, ucs_status_string(rst));
            kt_resv_finish(r, -1, 0, msg);
            kt_ack_queue(t, r->from, r->seq, r->id, -1, 0, msg);
        }
        if (!r->done && r->state == KT_XFER_STATE_RECEIVING && r->pieces && !r->placed &&
            (r->landed & 1u))
            kt_place(t, r);
        /* Every byte of the arriving part is where it goes. */
        const int arrived = !r->done && r->state == KT_XFER_STATE_RECEIVING &&
                            !kt_rq_busy(r->rx, KT_PIECES) &&
                            (!r->pieces || r->landed == (1u << KT_PIECES) - 1);
        if (arrived && r->put && r->more) {
            /* A put part is read once the last one is in and the sender can write no more. */
            KT_TRACE(t, "bundle %" PRIu64 ": part %" PRIu32 " put%s (%" PRIu64 " bytes in the "
                     "buffer), read with the last", r->id, r->n_put,
                     r->put_rows ? " with its rows" : "", r->len);
            r->put_parts[r->n_put++] = (kt_put_part){.len = r->len, .rows = r->put_rows};
            r->filled += r->len;
            r->state = KT_XFER_STATE_RESERVED;
            kt_ack_queue(t, r->from, r->seq, r->id, 0, r->len, "");
        } else if (arrived) {
            /* Its checksums (milliseconds for tens of MiB) are checked without the lock, so
             * Reserve and Send callers need not wait for them: only this thread frees a
             * reservation or accepts its next part, so r and the part stay as they are; a
             * release meanwhile only marks r done, and wins. */
            kt_resv_unmap(t, r); /* no more writes: the last put part, or a sent one (puts after it
                                    are refused) */
            char perr[KT_ERR_MAX] = "";
            int bad = 0;
            if (r->flags & KT_RESERVE_PARSE) {
                pthread_mutex_unlock(&t->lock);
                bad = kt_parse_arrived(r, perr) != 0;
                pthread_mutex_lock(&t->lock);
            }
            char msg[KT_ERR_MAX] = "";
            if (r->done) { /* released while the part was checked: the sender hears that */
                snprintf(msg, sizeof msg, "%s", r->msg);
                bad = 1;
            } else if (bad) {
                snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 " rejected: %s", r->id,
                         perr);
                kt_log(t, KT_LOG_WARN, r->rid, "%s", msg);
                kt_resv_finish(r, -1, 0, msg);
            } else if (r->more) { /* the part is in: wait for the next one */
                r->filled += r->len;
                r->state = KT_XFER_STATE_RESERVED;
                kt_resv_next_part(r);
            } else {
                kt_resv_finish(r, 0, r->filled + r->len + r->rows_more, "");
            }
            kt_ack_queue(t, r->from, r->seq, r->id, bad ? -1 : 0, bad ? 0 : r->len, msg);
        }
        if (!r->done && (t->stopping || now >= r->deadline)) {
            char msg[KT_ERR_MAX];
            snprintf(msg, sizeof msg, t->stopping ? "transport: reservation %" PRIu64
                     " failed: transport shutting down" : "transport: reservation %" PRIu64
                     " expired", r->id);
            kt_resv_finish(r, -1, 0, msg);
            if (r->from)
                kt_ack_queue(t, r->from, r->seq, r->id, -1, 0, msg);
        }
        if (r->done) {
            kt_rx_cancel(t, r);
            kt_held_release(t, r);
        }
        if (!r->done && r->deadline < next)
            next = r->deadline;
    }

    /* Sends. */
    for (kt_send_op *op = t->ops; op; op = op->next) {
        if (op->done)
            continue;
        if (!op->started && !t->stopping)
            kt_op_start(t, op);
        if (t->stopping)
            kt_op_fail(op, "transport: send of bundle %" PRIu64 " to %s failed: transport "
                       "shutting down", op->id, op->peer);
        unsigned finished = 0;
        ucs_status_t sst = kt_rq_reap(op->tx, KT_PIECES, &finished);
        if (finished || sst != UCS_OK)
            KT_TRACE(t, "send of bundle %" PRIu64 " done: %s (pieces 0x%x out)", op->id,
                     ucs_status_string(sst), finished);
        if (sst != UCS_OK)
            kt_op_fail(op, "transport: send of bundle %" PRIu64 " to %s failed: %s", op->id,
                       op->peer, ucs_status_string(sst));
        else if (finished && op->rma.rkey_len && op->phase < KT_PUT_HEADER && op->conn &&
                 !op->fail_msg[0] && !kt_rq_busy(op->tx, KT_PIECES))
            kt_put_next(t, op); /* the step's last request (of a rows part's three puts) done */
        const int moving = kt_rq_busy(op->tx, KT_PIECES);
        if (!op->fail_msg[0] && now >= op->deadline)
            kt_op_fail(op, "transport: send of bundle %" PRIu64 " to %s timed out after %.3g s "
                       "(%s)", op->id, op->peer, op->timeout_s,
                       moving ? "data still moving" : "no acknowledgement");
        if (moving) {
            /* Data may still be read from the caller's buffer: a failed op must stop it. */
            if (op->fail_msg[0] && op->conn)
                kt_conn_close(t, op->conn);
            if (op->deadline < next)
                next = op->deadline;
            continue;
        }
        if (op->fail_msg[0]) {
            op->done = 1;
            op->status = -1;
        } else if (op->acked) {
            op->done = 1;
            op->status = op->ack_status;
            if (op->status)
                snprintf(op->fail_msg, sizeof op->fail_msg, "%s", op->ack_msg);
        } else if (op->deadline < next) {
            next = op->deadline;
        }
    }

    /* Failed connections: fail what hangs on them and close them. */
    for (kt_conn *c = t->conns, *nx; c; c = nx) {
        nx = c->next;
        if (c->failed || t->stopping)
            kt_conn_close(t, c);
    }

    /* Acks. */
    for (kt_ack **pp = &t->acks; *pp;) {
        kt_ack *a = *pp;
        if (!a->started) {
            a->started = 1;
            ucp_request_param_t p = {
                .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                UCP_OP_ATTR_FIELD_FLAGS,
                .cb.send = kt_on_ack_sent,
                .user_data = a,
                .flags = UCP_AM_SEND_FLAG_EAGER,
            };
            a->req_pending = 1;
            ucs_status_ptr_t sp =
                ucp_am_send_nbx(a->conn->ep, KT_AM_ACK, NULL, 0, a->wire, sizeof a->wire, &p);
            a->conn = NULL;
            if (UCS_PTR_IS_ERR(sp))
                KT_UCS_LOG(t, "ucp_am_send_nbx(ack)", UCS_PTR_STATUS(sp));
            if (UCS_PTR_IS_PTR(sp))
                a->req = sp;
            else
                a->req_pending = 0;
        }
        if (a->req && !a->req_pending) {
            ucp_request_free(a->req);
            a->req = NULL;
        }
        if (!a->req) {
            *pp = a->next;
            free(a);
        } else {
            pp = &a->next;
        }
    }

    /* Closed endpoints: free once UCX is done with them. */
    for (kt_conn **pp = &t->closing; *pp;) {
        kt_conn *c = *pp;
        if (c->close_req && ucp_request_check_status(c->close_req) == UCS_INPROGRESS) {
            pp = &c->next;
            continue;
        }
        if (c->close_req)
            ucp_request_free(c->close_req);
        *pp = c->next;
        free(c);
    }
    return next;
}

/* Calls the callbacks of finished reservations and sends without the lock, then frees them. */
static int kt_deliver(kt_transport *t)
{
    int n = 0;
    for (kt_resv *r = t->resvs; r; r = r->next) {
        if (!r->done || kt_rq_busy(r->rx, KT_PIECES))
            continue;
        kt_resv_unmap(t, r); /* ended otherwise than by its last part: expired, released, failed */
        pthread_mutex_unlock(&t->lock);
        r->cb(r->cb_arg, r->id, r->status, r->bytes, r->msg);
        pthread_mutex_lock(&t->lock);
        r->cb = NULL;
        n++;
    }
    for (kt_send_op *op = t->ops; op; op = op->next) {
        if (!op->done || !op->cb)
            continue;
        pthread_mutex_unlock(&t->lock);
        op->cb(op->cb_arg, op->id, op->status, op->status == 0 ? op->size : 0, op->fail_msg);
        pthread_mutex_lock(&t->lock);
        op->cb = NULL;
        n++;
    }
    for (kt_resv **pp = &t->resvs; *pp;) {
        kt_resv *r = *pp;
        if (r->done && !r->cb) {
            *pp = r->next;
            kt_partbuf_free(r->part);
            kt_partbuf_free(r->head);
            free(r->put_parts);
            free(r);
        } else {
            pp = &r->next;
        }
    }
    for (kt_send_op **pp = &t->ops; *pp;) {
        kt_send_op *op = *pp;
        if (op->done && !op->cb) {
            *pp = op->next;
            for (int i = 0; i < KT_PIECES; i++)
                if (op->rkey[i]) ucp_rkey_destroy(op->rkey[i]);
            free(op);
        } else {
            pp = &op->next;
        }
    }
    if (n)
        pthread_cond_broadcast(&t->cond);
    return n;
}

static void *kt_progress_main(void *arg)
{
    kt_transport *t = arg;
    pthread_mutex_lock(&t->lock);
    for (;;) {
        kt_yield_to_api(t);
        while (ucp_worker_progress(t->worker) != 0) {
            if (atomic_load(&t->api_waiting) > 0)
                break;
        }
        double next = kt_step(t);
        int delivered = kt_deliver(t);
        if (t->stopping && !t->resvs && !t->ops && !t->acks && !t->conns && !t->closing)
            break;
        if (delivered)
            continue;
        /* Anything UCX still has to say before we may sleep? While transfers are in flight, poll
         * for a short while first: the next event (an ack, the next fragment) usually follows
         * within microseconds, and waking from the event fd costs more than that. */
        if (ucp_worker_progress(t->worker) != 0)
            continue;
        if (t->ops || t->acks || t->resvs) {
            double until = kt_now() + KT_SPIN_S;
            int got = 0;
            while (!got && kt_now() < until && atomic_load(&t->api_waiting) == 0)
                got = ucp_worker_progress(t->worker) != 0;
            if (got)
                continue;
        }
        ucs_status_t st = ucp_worker_arm(t->worker);
        if (st == UCS_ERR_BUSY)
            continue;
        if (st != UCS_OK)
            KT_UCS_LOG(t, "ucp_worker_arm", st);
        double wait = next - kt_now();
        int ms = wait <= 0 ? 0 : (int)(wait * 1000.0) + 1;
        if (t->stopping || t->closing)
            ms = ms > 10 ? 10 : ms; /* close requests complete without an event */
        pthread_mutex_unlock(&t->lock);
        struct pollfd fds[2] = {{.fd = t->worker_efd, .events = POLLIN},
                                {.fd = t->wake_fd, .events = POLLIN}};
        int pr = poll(fds, 2, st == UCS_OK ? ms : 1);
        if (pr > 0 && (fds[1].revents & POLLIN)) {
            uint64_t v;
            ssize_t n = read(t->wake_fd, &v, sizeof v);
            (void)n;
        }
        pthread_mutex_lock(&t->lock);
    }
    pthread_mutex_unlock(&t->lock);
    return NULL;
}

/* ------------------------------------------------------------------ API */

int kt_transport_create(const kt_transport_config *cfg, kt_transport **out, char *err)
{
    if (cfg->mode != KT_TRANSPORT_MODE_AM && cfg->mode != KT_TRANSPORT_MODE_RMA) {
        kt_seterr(err, "transport: unknown mode %d", (int)cfg->mode);
        return -1;
    }
    kt_transport *t = calloc(1, sizeof *t);
    if (!t) {
        kt_seterr(err, "transport: out of memory");
        return -1;
    }
    snprintf(t->name, sizeof t->name, "%s", cfg->name ? cfg->name : "transport");
    t->log = cfg->log;
    t->log_arg = cfg->log_arg;
    t->rma = cfg->mode == KT_TRANSPORT_MODE_RMA;
    t->worker_efd = -1;
    t->next_seq = 1;
    pthread_mutex_init(&t->lock, NULL);
    pthread_cond_init(&t->cond, NULL);
    t->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (t->wake_fd < 0) {
        kt_seterr(err, "transport: eventfd: %s", strerror(errno));
        goto err_free;
    }

    ucp_config_t *uc = NULL;
    /* A decode node restarted at the same address must be able to listen again while the
     * dead process's sockets linger; UCX's default is not to reuse. ucp_config_modify does not
     * reach this tcp_cm setting in 1.13 ("invalid configuration"), so it goes through the
     * environment, without overriding a value the user set. */
    setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
    KT_UCS_CHECK(ucp_config_read(NULL, NULL, &uc), err, err_fd);
    ucp_params_t up = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (t->rma ? UCP_FEATURE_RMA : 0),
        .name = t->name,
    };
    ucs_status_t st = ucp_init(&up, uc, &t->ctx);
    ucp_config_release(uc);
    KT_UCS_CHECK(st, err, err_fd);

    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    KT_UCS_CHECK(ucp_worker_create(t->ctx, &wp, &t->worker), err, err_ctx);
    KT_UCS_CHECK(ucp_worker_get_efd(t->worker, &t->worker_efd), err, err_worker);

    /* Eager bundle data stays valid past the handler when it returns UCS_INPROGRESS (a piece
     * held until its part is placed). */
    ucp_am_handler_param_t hb = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = KT_AM_BUNDLE, .cb = kt_on_bundle, .arg = t, .flags = UCP_AM_FLAG_PERSISTENT_DATA,
    };
    KT_UCS_CHECK(ucp_worker_set_am_recv_handler(t->worker, &hb), err, err_worker);
    ucp_am_handler_param_t ha = hb;
    ha.flags = 0;
    ha.id = KT_AM_ACK;
    ha.cb = kt_on_ack;
    KT_UCS_CHECK(ucp_worker_set_am_recv_handler(t->worker, &ha), err, err_worker);

    if (cfg->listen_host) {
        struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM,
                                 .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
        struct addrinfo *ai = NULL;
        char port[8];
        snprintf(port, sizeof port, "%u", cfg->listen_port);
        int gr = getaddrinfo(cfg->listen_host, port, &hints, &ai);
        if (gr != 0) {
            kt_seterr(err, "transport: cannot resolve listen address %s: %s", cfg->listen_host,
                      gai_strerror(gr));
            goto err_worker;
        }
        ucp_listener_params_t lp = {
            .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
            .sockaddr = {.addr = ai->ai_addr, .addrlen = ai->ai_addrlen},
            .conn_handler = {.cb = kt_on_conn_request, .arg = t},
        };
        st = ucp_listener_create(t->worker, &lp, &t->listener);
        freeaddrinfo(ai);
        if (st != UCS_OK) {
            kt_seterr(err, "transport: listening on %s:%u: ucp_listener_create failed: %s "
                      "(port in use, or UCX_TLS without tcp?)", cfg->listen_host,
                      cfg->listen_port, ucs_status_string(st));
            goto err_worker;
        }
        ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
        KT_UCS_CHECK(ucp_listener_query(t->listener, &la), err, err_listener);
        t->port = ntohs(((const struct sockaddr_in *)&la.sockaddr)->sin_port);
    }

    if (pthread_create(&t->thread, NULL, kt_progress_main, t) != 0) {
        kt_seterr(err, "transport: cannot start the progress thread");
        goto err_listener;
    }
    t->thread_started = 1;
    *out = t;
    return 0;

err_listener:
    if (t->listener)
        ucp_listener_destroy(t->listener);
err_worker:
    ucp_worker_destroy(t->worker);
err_ctx:
    ucp_cleanup(t->ctx);
err_fd:
    close(t->wake_fd);
err_free:
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->lock);
    free(t);
    return -1;
}

void kt_transport_destroy(kt_transport *t)
{
    if (!t)
        return;
    kt_api_lock(t);
    t->stopping = 1;
    pthread_mutex_unlock(&t->lock);
    kt_wake(t);
    pthread_join(t->thread, NULL);
    if (t->listener)
        ucp_listener_destroy(t->listener);
    while (t->conn_reqs) {
        kt_conn_req *cr = t->conn_reqs;
        t->conn_reqs = cr->next;
        free(cr);
    }
    ucp_worker_destroy(t->worker);
    ucp_cleanup(t->ctx);
    close(t->wake_fd);
    pthread_cond_destroy(&t->cond);
    pthread_mutex_destroy(&t->lock);
    free(t);
}

uint16_t kt_transport_port(const kt_transport *t) { return t->port; }

/* Maps `len` bytes at addr (reservation id's `what`) for remote writes into *memh and packs the
 * key a sender needs into *key; on failure *memh stays NULL. Under t->lock. */
static int kt_mem_map(kt_transport *t, uint64_t id, const char *what, void *addr, uint64_t len,
                      ucp_mem_h *memh, kt_rma_key *key, char *err)
{
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = addr,
        .length = len,
    };
    void *packed = NULL;
    size_t packed_len = 0;
    KT_UCS_CHECK(ucp_mem_map(t->ctx, &mp, memh), err, fail);
    KT_UCS_CHECK(ucp_rkey_pack(t->ctx, *memh, &packed, &packed_len), err, fail_unmap);
    if (packed_len > sizeof key->rkey) {
        ucp_rkey_buffer_release(packed);
        kt_seterr(err,
                  "transport: reservation %" PRIu64 ": the remote key of its %s has %zu bytes, "
                  "more than %d",
                  id, what, packed_len, KT_RMA_KEY_MAX);
        goto fail_unmap;
    }
    memset(key, 0, sizeof *key);
    key->address = (uint64_t)(uintptr_t)addr;
    key->rkey_len = (uint32_t)packed_len;
    memcpy(key->rkey, packed, packed_len);
    ucp_rkey_buffer_release(packed);
    return 0;
fail_unmap:
    kt_mem_unmap(t, memh);
fail:
    *memh = NULL;
    return -1;
}

/* A reservation of buf (NULL: parts in buffers of their own, owned by o->set), mapped for RMA
 * when key is non-NULL. */
static int kt_reserve(kt_transport *t, uint64_t id, void *buf, uint64_t size,
                      const kt_resv_opts *o, uint8_t token[KT_RESV_TOKEN_BYTES], kt_rma_key *key,
                      char *err)
{
    kt_bundle_set *set = o->set;
    if (!t->listener) {
        kt_seterr(err, "transport: reserve needs a listening transport (listen_host unset)");
        return -1;
    }
    if ((!buf && !set) || size == 0 || !o->cb || !(o->timeout_s > 0)) {
        kt_seterr(err, "transport: reserve %" PRIu64 ": needs a buffer (or a set to own the "
                  "parts), a size > 0, a callback and a timeout > 0 (got size %" PRIu64
                  ", timeout %g)", id, size, o->timeout_s);
        return -1;
    }
    if (set && (set->cap == 0 || set->n_parts != 0)) {
        kt_seterr(err, "transport: reserve %" PRIu64 ": needs an empty set (kt_bundle_set_init) "
                  "to assemble the bundle in", id);
        return -1;
    }
    kt_resv *r = calloc(1, sizeof *r);
    if (!r) {
        kt_seterr(err, "transport: out of memory");
        return -1;
    }
    r->id = id;
    r->buf = buf;
    r->size = size;
    r->flags = set ? KT_RESERVE_PARSE : key ? 0 : o->flags;
    r->set = set;
    r->cb = o->cb;
    r->cb_arg = o->cb_arg;
    snprintf(r->rid, sizeof r->rid, "%s", o->request_id ? o->request_id : "");
    r->state = KT_XFER_STATE_RESERVED;
    r->deadline = kt_now() + o->timeout_s;
    r->cap_put = !key ? 0 : set ? set->cap : KT_RMA_MAX_PARTS;
    if (key && !(r->put_parts = calloc(r->cap_put, sizeof *r->put_parts))) {
        kt_seterr(err, "transport: out of memory");
        free(r);
        return -1;
    }
    if (getrandom(r->resv_token, sizeof r->resv_token, 0) != (ssize_t)sizeof r->resv_token) {
        kt_seterr(err, "transport: reserve %" PRIu64 ": getrandom failed: %s", id, strerror(errno));
        free(r->put_parts);
        free(r);
        return -1;
    }
    kt_api_lock(t);
    const char *why = t->stopping           ? "refused: shutting down"
                      : kt_resv_find(t, id) ? "already exists"
                                            : NULL;
    if (why) kt_seterr(err, "transport: reservation %" PRIu64 " %s", id, why);
    if (why || (key && kt_mem_map(t, id, "buffer", buf, size, &r->memh, key, err) != 0)) {
        pthread_mutex_unlock(&t->lock);
        free(r->put_parts);
        free(r);
        return -1;
    }
    if (set) set->owned = buf == NULL;
    r->serial = ++t->next_serial;
    r->next = t->resvs;
    t->resvs = r;
    memcpy(token, r->resv_token, KT_RESV_TOKEN_BYTES);
    pthread_mutex_unlock(&t->lock);
    kt_wake(t);
    return 0;
}

int kt_transport_reserve(kt_transport *t, uint64_t id, void *buf, uint64_t size,
                         const kt_resv_opts *o, uint8_t token[KT_RESV_TOKEN_BYTES], char *err)
{
    return kt_reserve(t, id, buf, size, o, token, NULL, err);
}

int kt_transport_reserve_rma(kt_transport *t, uint64_t id, void *buf, uint64_t size,
                             const kt_resv_opts *o, uint8_t token[KT_RESV_TOKEN_BYTES],
                             kt_rma_key *key, char *err)
{
    if (!t->rma || !buf || !key) {
        kt_seterr(err, "transport: reserve %" PRIu64 " for RMA: %s", id,
                  !t->rma ? "the transport was not created in KT_TRANSPORT_MODE_RMA"
                          : "needs the buffer to map and a key to fill");
        return -1;
    }
    return kt_reserve(t, id, buf, size, o, token, key, err);
}

int kt_transport_map_rows(kt_transport *t, uint64_t id, void *k, void *v, uint64_t bytes,
                          kt_rma_rows *out, char *err)
{
    if (!k || !v || bytes == 0 || !out) {
        kt_seterr(err, "transport: rows of reservation %" PRIu64 ": need the K and V regions, "
                  "a size > 0 and a place for their keys", id);
        return -1;
    }
    kt_rma_rows rows = {.bytes = bytes};
    kt_api_lock(t);
    kt_resv *r = kt_resv_find(t, id);
    const char *why = !r                 ? "unknown or ended"
                      : !r->memh         ? "not mapped for RMA (kt_transport_reserve_rma)"
                      : !r->set          ? "without a set to validate rows parts into"
                      : r->rows_memh[0]  ? "already mapped for rows"
                                         : NULL;
    if (why)
        kt_seterr(err, "transport: rows of reservation %" PRIu64 ": the reservation is %s", id,
                  why);
    if (why || kt_mem_map(t, id, "K rows", k, bytes, &r->rows_memh[0], &rows.k, err) != 0) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    if (kt_mem_map(t, id, "V rows", v, bytes, &r->rows_memh[1], &rows.v, err) != 0) {
        kt_mem_unmap(t, &r->rows_memh[0]);
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    r->rows[0] = k;
    r->rows[1] = v;
    r->rows_bytes = bytes;
    pthread_mutex_unlock(&t->lock);
    *out = rows;
    return 0;
}

int kt_transport_release(kt_transport *t, uint64_t id)
{
    kt_api_lock(t);
    kt_resv *r = kt_resv_find(t, id);
    if (!r) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    uint64_t serial = r->serial;
    char msg[KT_ERR_MAX];
    snprintf(msg, sizeof msg, "transport: reservation %" PRIu64 " released", id);
    kt_resv_finish(r, -1, 0, msg);
    kt_wake(t);
    for (;;) {
        int present = 0;
        for (kt_resv *x = t->resvs; x; x = x->next)
            present |= x->serial == serial;
        if (!present)
            break;
        pthread_cond_wait(&t->cond, &t->lock);
    }
    pthread_mutex_unlock(&t->lock);
    return 0;
}

kt_xfer_state kt_transport_reservation_state(kt_transport *t, uint64_t id)
{
    kt_api_lock(t);
    kt_resv *r = kt_resv_find(t, id);
    kt_xfer_state s = r ? r->state : KT_XFER_STATE_NONE;
    pthread_mutex_unlock(&t->lock);
    return s;
}

/* A send (at NULL) or a put (at: where in the receiver's memory) of the part at buf; with
 * `pieces` (the part's layout, split and block-padded) it goes as head, K and V: three
 * messages, or with at->rows three puts (K and V at rows_off in the rows regions). */
static int kt_send(kt_transport *t, const kt_peer *to, const kt_put_dest *at,
                   const kt_bundle_layout *pieces, const void *buf, uint64_t size,
                   const kt_send_opts *o, char *err)
{
    if (!to->host || !to->token || !buf || size == 0 || !o->cb || !(o->timeout_s > 0)) {
        kt_seterr(err, "transport: send %" PRIu64 ": needs a host, a token, a buffer, a size > 0, "
                  "a callback and a timeout > 0", to->id);
        return -1;
    }
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char ports[8];
    snprintf(ports, sizeof ports, "%u", to->port);
    int gr = getaddrinfo(to->host, ports, &hints, &ai);
    if (gr != 0) {
        kt_seterr(err, "transport: cannot resolve %s: %s", to->host, gai_strerror(gr));
        return -1;
    }
    kt_send_op *op = calloc(1, sizeof *op);
    if (!op) {
        freeaddrinfo(ai);
        kt_seterr(err, "transport: out of memory");
        return -1;
    }
    memcpy(&op->addr, ai->ai_addr, ai->ai_addrlen);
    op->addrlen = ai->ai_addrlen;
    freeaddrinfo(ai);
    snprintf(op->peer, sizeof op->peer, "%s:%u", to->host, to->port);
    op->id = to->id;
    op->buf = buf;
    op->size = size;
    op->n_pieces = 1;
    op->piece_len[0] = size;
    if (at) {
        op->rma = *at->key;
        op->offset = at->offset;
    }
    if (at && at->rows) {
        op->rows = *at->rows;
        op->rows_off = at->rows_off;
    }
    if (pieces) {
        op->n_pieces = KT_PIECES;
        const uint64_t off[KT_PIECES] = {0, pieces->k_off, pieces->v_off};
        const uint64_t len[KT_PIECES] = {pieces->head_len, pieces->k_len, pieces->v_len};
        memcpy(op->piece_off, off, sizeof off);
        memcpy(op->piece_len, len, sizeof len);
    }
    op->timeout_s = o->timeout_s;
    op->deadline = kt_now() + o->timeout_s;
    op->cb = o->cb;
    op->cb_arg = o->cb_arg;
    snprintf(op->rid, sizeof op->rid, "%s", o->request_id ? o->request_id : "");
    kt_api_lock(t);
    if (t->stopping) {
        pthread_mutex_unlock(&t->lock);
        free(op);
        kt_seterr(err, "transport: send refused: shutting down");
        return -1;
    }
    op->seq = t->next_seq++;
    for (int i = 0; i < op->n_pieces; i++) {
        uint8_t *h = op->hdr[i];
        kt_wr32(h, KT_WIRE_MAGIC);
        kt_wr16(h + 4, KT_WIRE_VERSION);
        kt_wr16(h + 6, (uint16_t)((o->flags & KT_SEND_MORE) | (at ? KT_WIRE_PUT : 0) |
                                  (op->n_pieces > 1 ? KT_WIRE_PIECE : 0)));
        kt_wr64(h + 8, op->seq);
        kt_wr64(h + 16, to->id);
        kt_wr64(h + 24, at && at->rows ? pieces->head_len : size); /* a rows part: what is in buf */
        kt_wr64(h + 32, at ? at->offset : op->piece_off[i]);
        memcpy(h + 40, to->token, KT_RESV_TOKEN_BYTES);
    }
    op->next = t->ops;
    t->ops = op;
    pthread_mutex_unlock(&t->lock);
    kt_wake(t);
    return 0;
}

int kt_transport_send(kt_transport *t, const kt_peer *to, const void *buf, uint64_t size,
                      const kt_send_opts *o, char *err)
{
    /* A block-padded bundle goes in pieces, so that the receiver can land K and V in its KV
     * blocks; anything else goes whole. */
    kt_bundle_layout lay;
    const int split = buf && kt_bundle_layout_read(buf, (size_t)size, &lay, NULL) == 0 &&
                      lay.split && lay.block_rows > 0 && lay.size == size;
    return kt_send(t, to, NULL, split ? &lay : NULL, buf, size, o, err);
}

/* 1 for a packed remote key of a plausible length. */
static int kt_key_ok(const kt_rma_key *key)
{
    return key && key->rkey_len > 0 && key->rkey_len <= KT_RMA_KEY_MAX;
}

/* A rows part's layout into *lay: block-padded, unquantized, K and V of one length, ending
 * within the rows regions. */
static int kt_rows_layout(uint64_t id, const kt_put_dest *at, const void *buf, uint64_t size,
                          kt_bundle_layout *lay, char *err)
{
    char why[KT_ERR_MAX] = "";
    if (!buf || size == 0 || kt_bundle_layout_read(buf, (size_t)size, lay, why) != 0) {
        kt_seterr(err, "transport: put of bundle %" PRIu64 " with its rows: %s", id,
                  buf && size ? why : "needs a buffer and a size > 0");
        return -1;
    }
    if (!lay->split || lay->block_rows == 0 || lay->size != size || lay->k_len != lay->v_len) {
        kt_seterr(err, "transport: put of bundle %" PRIu64 " with its rows: the %" PRIu64 "-byte "
                  "part is not a block-padded, unquantized one of K and V of one length (layout: %"
                  PRIu64 " bytes, block_rows %" PRIu32 ", K %" PRIu64 " and V %" PRIu64
                  " bytes%s)", id, size, lay->size, lay->block_rows, lay->k_len, lay->v_len,
                  lay->split ? "" : ", not to be split");
        return -1;
    }
    if (lay->k_len > at->rows->bytes || at->rows_off > at->rows->bytes - lay->k_len) {
        kt_seterr(err, "transport: put of bundle %" PRIu64 " with its rows: its K and V (%" PRIu64
                  " bytes each) at %" PRIu64 " end past the rows regions' %" PRIu64 " bytes", id,
                  lay->k_len, at->rows_off, at->rows->bytes);
        return -1;
    }
    return 0;
}

int kt_transport_put(kt_transport *t, const kt_peer *to, const kt_put_dest *at, const void *buf,
                     uint64_t size, const kt_send_opts *o, char *err)
{
    const int rows = at && at->rows;
    if (!t->rma || !at || !kt_key_ok(at->key) ||
        (rows && (!kt_key_ok(&at->rows->k) || !kt_key_ok(&at->rows->v)))) {
        kt_seterr(err, "transport: put of bundle %" PRIu64 "%s: %s", to->id,
                  rows ? " with its rows" : "",
                  !t->rma ? "the transport was not created in KT_TRANSPORT_MODE_RMA"
                  : rows  ? "needs the reservation's remote key and its rows' keys"
                          : "needs the reservation's remote key");
        return -1;
    }
    kt_bundle_layout lay;
    if (rows && kt_rows_layout(to->id, at, buf, size, &lay, err) != 0)
        return -1;
    return kt_send(t, to, at, rows ? &lay : NULL, buf, size, o, err);
}

typedef struct kt_waiter {
    pthread_mutex_t m;
    pthread_cond_t c;
    int done, status;
    char msg[KT_ERR_MAX];
} kt_waiter;

static void kt_waiter_cb(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    kt_waiter *w = arg;
    pthread_mutex_lock(&w->m);
    w->done = 1;
    w->status = status;
    snprintf(w->msg, sizeof w->msg, "%s", err ? err : "");
    pthread_cond_signal(&w->c);
    pthread_mutex_unlock(&w->m);
    (void)id;
    (void)bytes;
}

int kt_transport_send_wait(kt_transport *t, const kt_peer *to, const void *buf, uint64_t size,
                           double timeout_s, char *err)
{
    kt_waiter w = {.done = 0};
    pthread_mutex_init(&w.m, NULL);
    pthread_cond_init(&w.c, NULL);
    const kt_send_opts o = {.timeout_s = timeout_s, .cb = kt_waiter_cb, .cb_arg = &w};
    int rc = kt_transport_send(t, to, buf, size, &o, err);
    if (rc == 0) {
        pthread_mutex_lock(&w.m);
        while (!w.done)
            pthread_cond_wait(&w.c, &w.m);
        pthread_mutex_unlock(&w.m);
        rc = w.status;
        if (rc)
            kt_seterr(err, "%s", w.msg);
    }
    pthread_cond_destroy(&w.c);
    pthread_mutex_destroy(&w.m);
    return rc;
}
