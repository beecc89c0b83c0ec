/*
 * transport-recv.c - the receiving side of the transport (transport.h): reservations (reserve,
 * map for RMA, release), the bundles and pieces that arrive for them (kt_on_bundle, on the
 * progress thread with t->lock held), where a part's K and V land (kt_place), the validation
 * of what arrived and the acknowledgement each part gets (kt_resv_step, kt_step_acks: phases
 * of the progress loop in transport.c). Tests: tests/unit/test_transport*.c.
 */
#include "transport-impl.h"

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

void kt_resv_finish(kt_resv *r, int status, uint64_t bytes, const char *msg)
{
    if (r->done)
        return;
    r->done = 1;
    r->status = status;
    r->bytes = bytes;
    snprintf(r->msg, sizeof r->msg, "%s", msg ? msg : "");
}

static void kt_on_recv_done(void *request, ucs_status_t status, size_t length, void *user_data);

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
void kt_rx_cancel(kt_transport *t, kt_resv *r)
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
void kt_resv_unmap(kt_transport *t, kt_resv *r)
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

static void kt_on_recv_done(void *request, ucs_status_t status, size_t length, void *user_data)
{
    kt_rq *q = user_data;
    q->pending = 0;
    q->status = status;
    (void)request;
    (void)length;
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

ucs_status_t kt_on_bundle(void *arg, const void *header, size_t header_length, void *data,
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

/* Every byte of r's arriving part is where it goes: a put part before the last is kept for
 * the end; any other is validated (without the lock) and added to the set, and acknowledged. */
static void kt_resv_arrived(kt_transport *t, kt_resv *r)
{
    if (r->put && r->more) {
        /* A put part is read once the last one is in and the sender can write no more. */
        KT_TRACE(t, "bundle %" PRIu64 ": part %" PRIu32 " put%s (%" PRIu64 " bytes in the "
                 "buffer), read with the last", r->id, r->n_put,
                 r->put_rows ? " with its rows" : "", r->len);
        r->put_parts[r->n_put++] = (kt_put_part){.len = r->len, .rows = r->put_rows};
        r->filled += r->len;
        r->state = KT_XFER_STATE_RESERVED;
        kt_ack_queue(t, r->from, r->seq, r->id, 0, r->len, "");
        return;
    }
    /* Its checksums (milliseconds for tens of MiB) are checked without the lock, so Reserve and
     * Send callers need not wait for them: only this thread frees a reservation or accepts its
     * next part, so r and the part stay as they are; a release meanwhile only marks r done, and
     * wins. */
    kt_resv_unmap(t, r); /* no more writes: the last put part, or a sent one (puts after it are
                            refused) */
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
        snprintf(msg, sizeof msg, "transport: bundle %" PRIu64 " rejected: %s", r->id, perr);
        kt_log(t, KT_LOG_WARN, r->rid, "%s", msg + strlen("transport: "));
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

/* One reservation: finishes its receives, places pieces, takes a part that arrived, expires it
 * or fails it when stopping. Returns its deadline, or +inf once it is done. */
double kt_resv_step(kt_transport *t, kt_resv *r, double now)
{
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
    if (!r->done && r->state == KT_XFER_STATE_RECEIVING && !kt_rq_busy(r->rx, KT_PIECES) &&
        (!r->pieces || r->landed == (1u << KT_PIECES) - 1))
        kt_resv_arrived(t, r);
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
        return INFINITY;
    }
    return r->deadline;
}

/* Starts the queued acknowledgements and frees the ones UCX is done with. */
void kt_step_acks(kt_transport *t)
{
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
}

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
