/*
 * transport-send.c - the sending side of the transport (transport.h): a send is queued by the
 * caller (kt_send), started by the progress loop on a connection (kt_op_start: the part whole
 * or as head, K and V active messages; a put goes to transport-put.c), and settled by the
 * receiver's acknowledgement, a failure or its timeout (kt_op_step). Tests:
 * tests/unit/test_transport*.c.
 */
#include "transport-impl.h"

void kt_op_fail(kt_send_op *op, const char *fmt, ...)
{
    if (op->fail_msg[0])
        return; /* keep the first cause */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(op->fail_msg, sizeof op->fail_msg, fmt, ap);
    va_end(ap);
}

void kt_on_send_done(void *request, ucs_status_t status, void *user_data)
{
    kt_rq *q = user_data;
    q->pending = 0;
    q->status = status;
    (void)request;
}

ucs_status_t kt_on_ack(void *arg, const void *header, size_t header_length, void *data,
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

static void kt_op_start(kt_transport *t, kt_send_op *op)
{
    op->started = 1;
    kt_conn *c = kt_connect(t, op);
    if (!c)
        return;
    op->conn = c;
    if (op->rma.rkey_len) {
        kt_put_start(t, op);
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

/* One send: starts it, advances a put's steps, times it out, and settles it once its requests
 * are done and the receiver answered. Returns its deadline, or +inf once it is settled. */
double kt_op_step(kt_transport *t, kt_send_op *op, double now)
{
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
        return op->deadline;
    }
    if (op->fail_msg[0]) {
        op->done = 1;
        op->status = -1;
    } else if (op->acked) {
        op->done = 1;
        op->status = op->ack_status;
        if (op->status)
            snprintf(op->fail_msg, sizeof op->fail_msg, "%s", op->ack_msg);
    }
    return op->done ? INFINITY : op->deadline;
}

/* A send (at NULL) or a put (at: where in the receiver's memory) of the part at buf; with
 * `pieces` (the part's layout, split and block-padded) it goes as head, K and V: three
 * messages, or with at->rows three puts (K and V at rows_off in the rows regions). */
int kt_send(kt_transport *t, const kt_peer *to, const kt_put_dest *at,
            const kt_bundle_layout *pieces, const void *buf, uint64_t size, const kt_send_opts *o,
            char *err)
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
