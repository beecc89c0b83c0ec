/*
 * transport-put.c - RMA puts (KT_TRANSPORT_MODE_RMA, transport.h: kt_transport_put): a part put
 * whole into the reservation's buffer, or a block-padded one whose head goes there and whose K
 * and V go into the rows regions; each goes put -> flush -> header, one step at a time as UCX
 * completes the last (kt_put_next). What it is not: a second protocol: the header and its
 * acknowledgement are the sending side's (transport-send.c). Tests: tests/unit/test_transport*.c.
 */
#include "transport-impl.h"

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
void kt_put_next(kt_transport *t, kt_send_op *op)
{
    while (op->phase < KT_PUT_HEADER && kt_put_step(t, op)) {
    }
}

/* Starts a put on its connection: unpacks the remote keys it needs, then takes its steps. */
void kt_put_start(kt_transport *t, kt_send_op *op)
{
    /* The buffer's key, and for a put with its rows the K and V regions' keys. */
    const kt_rma_key *keys[KT_PIECES] = {&op->rma, &op->rows.k, &op->rows.v};
    static const char *const whose[KT_PIECES] = {"", "K rows ", "V rows "};
    for (int i = 0; i < op->n_pieces; i++) {
        ucs_status_t st = ucp_ep_rkey_unpack(op->conn->ep, keys[i]->rkey, &op->rkey[i]);
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
