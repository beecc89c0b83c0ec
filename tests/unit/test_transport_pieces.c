/*
 * test_transport_pieces.c - the transport's parts that travel in pieces and its RMA puts
 * (kvtransfer/transport.h), over real loopback UCX: block-padded bundles sent as head, K and V
 * landing where a placement hook says (or in a buffer of their own when it declines), pieces
 * that come out of order, twice, at bad offsets or without a head (a raw UCX sender crafts
 * them), and puts: parts put whole into a reservation mapped for RMA, and block-padded parts
 * whose K and V are put into mapped rows regions and validated where they lie. The protocol
 * over plain active messages: test_transport.c; the helpers both use: kt_transport_test.h.
 * Run: ctest -R transport (a few seconds). Exit 77 (SKIPPED) when UCX cannot listen on loopback.
 */
#include <signal.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include <ucp/api/ucp.h>

#include "kt_transport_test.h"
#include "le.h"

/* A block-padded bundle travels in pieces (head, K, V): with a placement hook its K and V land
 * where the hook says and are validated there; without one, or when the hook declines, in a
 * part buffer (or the reservation's buffer) as a whole part would; the hook's refusal, and K
 * or V that do not match their checksums, fail the reservation. Large parts (rendezvous pieces)
 * and small ones (eager pieces, which arrive before their head is placed and are held). */
static void test_pieces(kt_transport *rx, kt_transport *tx)
{
    const uint64_t cap = 1 << 20;
    uint8_t *seg[2] = {malloc(cap), malloc(cap)};
    REQUIRE(seg[0] && seg[1], "out of memory");
    char err[KT_ERR_MAX];
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    const uint16_t port = kt_transport_port(rx);
    uint64_t id = 800;
    for (int big = 0; big < 2; big++)
        for (int mode = -1; mode <= 2; mode++) { /* 2: a reservation with a buffer of its own */
            const uint32_t count = big ? 1000 : 40; /* K: 256 KiB (rendezvous) or 14 KiB (eager) */
            kt_bundle_layout lay[2];
            const uint64_t n[2] = {write_padded(seg[0], cap, 0, count, 16, &lay[0]),
                                   write_padded(seg[1], cap, 1, count, 16, &lay[1])};
            kt_bundle_view parts[2];
            kt_bundle_set set;
            place_log pl = {.mode = mode};
            placed_set(&set, parts, 2, &pl);
            uint8_t *dst = mode == 2 ? malloc(2 * cap) : NULL;
            done_box rb, sb;
            box_init(&rb);
            box_init(&sb);
            id++;
            REQUIRE(kt_transport_reserve(
                        rx, id, dst, 2 * cap,
                        &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb},
                        tok, err) == 0,
                    "%s", err);
            REQUIRE(kt_transport_send(
                        tx, &(kt_peer){HOST, port, id, tok}, seg[0], n[0],
                        &(kt_send_opts){
                            .flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
                        err) == 0,
                    "%s", err);
            REQUIRE(box_wait(&sb, 5.0), "first part answered within 5 s");
            if (mode < 0) {
                CHECK(sb.status == -1 && strstr(sb.msg, "no blocks for part 0"),
                      "the placement hook's refusal reaches the sender: %s", sb.msg);
                REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
                CHECK(rb.status == -1 && strstr(rb.msg, "no blocks for part 0") && pl.parts == 0,
                      "reservation failed, no part taken: %s", rb.msg);
                kt_bundle_set_free(&set);
                continue;
            }
            CHECK(sb.status == 0, "first part (big %d, mode %d): %s", big, mode, sb.msg);
            CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, id, tok}, seg[1], n[1], 5.0,
                                         err) == 0,
                  "last part (big %d, mode %d): %s", big, mode, err);
            REQUIRE(box_wait(&rb, 5.0), "receive callback within 5 s");
            CHECK(rb.status == 0 && set.complete && set.n_parts == 2 && pl.parts == 2,
                  "receive (big %d, mode %d): %s", big, mode, rb.msg);
            for (int i = 0; i < 2 && rb.status == 0; i++) {
                const kt_bundle_view *pv = &parts[i];
                const uint8_t *want_k = seg[i] + lay[i].k_off, *want_v = seg[i] + lay[i].v_off;
                CHECK(pv->k && memcmp(pv->k, want_k, lay[i].k_len) == 0 &&
                          memcmp(pv->v, want_v, lay[i].v_len) == 0 &&
                          memcmp(pv->base, seg[i], lay[i].head_len) == 0,
                      "part %d (big %d, mode %d): head, K and V as sent", i, big, mode);
                if (mode == 0)
                    CHECK(pv->k == pl.k[i] && pv->v == pl.v[i] && pl.part_k[i] == pl.k[i] &&
                              pl.len[i] == lay[i].k_len,
                          "part %d (big %d): K and V validated where the hook placed them", i, big);
                else if (mode == 1)
                    CHECK(pv->k == pv->base + lay[i].k_off && pl.placed == 0,
                          "part %d (big %d): declined, K and V land in the part's buffer", i, big);
                else
                    CHECK(pv->base == dst + (i ? n[0] : 0) && pl.placed == 0 &&
                              memcmp(dst + (i ? n[0] : 0), seg[i], n[i]) == 0,
                          "part %d (big %d): a reservation's buffer takes the part whole", i, big);
            }
            placed_set_free(&set, &pl);
            free(dst);
        }
    /* A corrupt V piece: placed, then refused by its checksum; the place stays the hook's. */
    kt_bundle_layout lay;
    uint64_t n = write_padded(seg[0], cap, 1, 1000, 16, &lay);
    seg[0][lay.v_off + 100] ^= 0x40;
    kt_bundle_view parts[1];
    kt_bundle_set set;
    place_log pl = {.mode = 0};
    placed_set(&set, parts, 1, &pl);
    done_box rb;
    box_init(&rb);
    REQUIRE(kt_transport_reserve(
                rx, ++id, NULL, cap,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, id, tok}, seg[0], n, 5.0, err) != 0,
          "a corrupt V piece is refused");
    CHECK_ERR_HAS(err, "checksum");
    REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
    CHECK(rb.status == -1 && pl.placed == 1 && pl.parts == 0 && set.n_parts == 0,
          "reservation failed after placing, no part taken: %s", rb.msg);
    placed_set_free(&set, &pl);
    free(seg[0]);
    free(seg[1]);
}

/* A sender that speaks the wire by hand (its own UCX context), to send what kt_transport_send
 * never would: pieces at wrong offsets, twice, too many before their head. The wire constants
 * are the transport's (docs/transport.md, *Wire*). */
enum { RAW_AM_BUNDLE = 0x4b51, RAW_AM_ACK = 0x4b52, RAW_HDR = 56, RAW_PIECE = 4, RAW_ACKS = 16 };

typedef struct raw_sender {
    ucp_context_h ctx;
    ucp_worker_h worker;
    ucp_ep_h ep;
    void *reqs[8]; /* sends not yet complete (a held rendezvous completes once the receiver
                      takes or drops it) */
    int n_reqs;
    uint8_t hdr[8][RAW_HDR]; /* each send's header, alive until raw_settle */
    int n_acks;
    uint64_t ack_seq[RAW_ACKS];
    int ack_status[RAW_ACKS];
    char ack_msg[RAW_ACKS][256];
} raw_sender;

static ucs_status_t raw_on_ack(void *arg, const void *header, size_t header_length, void *data,
                               size_t length, const ucp_am_recv_param_t *param)
{
    raw_sender *r = arg;
    const uint8_t *w = data;
    if (length >= 40 + 256 && r->n_acks < RAW_ACKS) {
        r->ack_seq[r->n_acks] = kt_rd64(w + 8);
        r->ack_status[r->n_acks] = kt_rd16(w + 6);
        memcpy(r->ack_msg[r->n_acks], w + 40, 256);
        r->ack_msg[r->n_acks][255] = 0;
        r->n_acks++;
    }
    (void)header;
    (void)header_length;
    (void)param;
    return UCS_OK;
}

static void raw_open(raw_sender *r, uint16_t port)
{
    memset(r, 0, sizeof *r);
    ucp_config_t *cfg;
    REQUIRE(ucp_config_read(NULL, NULL, &cfg) == UCS_OK, "ucp_config_read");
    ucp_params_t up = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM};
    REQUIRE(ucp_init(&up, cfg, &r->ctx) == UCS_OK, "ucp_init");
    ucp_config_release(cfg);
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    REQUIRE(ucp_worker_create(r->ctx, &wp, &r->worker) == UCS_OK, "ucp_worker_create");
    ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                               UCP_AM_HANDLER_PARAM_FIELD_CB |
                                               UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                 .id = RAW_AM_ACK, .cb = raw_on_ack, .arg = r};
    REQUIRE(ucp_worker_set_am_recv_handler(r->worker, &hp) == UCS_OK, "ack handler");
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, HOST, &sa.sin_addr);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {.addr = (const struct sockaddr *)&sa, .addrlen = sizeof sa},
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER};
    REQUIRE(ucp_ep_create(r->worker, &ep, &r->ep) == UCS_OK, "ucp_ep_create");
}

/* Sends bytes [off, off + len) of a part of `size` bytes as a piece for reservation id, with
 * the part's seq, without waiting for it (raw_settle does). */
static void raw_piece(raw_sender *r, uint64_t id, const uint8_t *tok, uint64_t seq, uint64_t size,
                      uint64_t off, const uint8_t *data, uint64_t len)
{
    REQUIRE(r->n_reqs < 8, "raw sends in flight");
    uint8_t *h = r->hdr[r->n_reqs];
    memset(h, 0, RAW_HDR);
    kt_wr32(h, 0x4e58544bu);
    kt_wr16(h + 4, 2);
    kt_wr16(h + 6, RAW_PIECE);
    kt_wr64(h + 8, seq);
    kt_wr64(h + 16, id);
    kt_wr64(h + 24, size);
    kt_wr64(h + 32, off);
    memcpy(h + 40, tok, KT_RESV_TOKEN_BYTES);
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_AM_SEND_FLAG_REPLY};
    ucs_status_ptr_t sp = ucp_am_send_nbx(r->ep, RAW_AM_BUNDLE, h, RAW_HDR, data, len, &p);
    REQUIRE(!UCS_PTR_IS_ERR(sp), "raw piece send: %s", ucs_status_string(UCS_PTR_STATUS(sp)));
    if (UCS_PTR_IS_PTR(sp))
        r->reqs[r->n_reqs++] = sp;
    ucp_worker_progress(r->worker);
}

/* The first acknowledgement of seq, after progressing until it came (or 5 s), and until every
 * send completed; NULL when none came. *status: its status. */
static const char *raw_settle(raw_sender *r, uint64_t seq, int *status)
{
    const char *msg = NULL;
    double until = now_s() + 5.0;
    for (;;) {
        for (int i = 0; !msg && i < r->n_acks; i++)
            if (r->ack_seq[i] == seq) {
                msg = r->ack_msg[i];
                *status = r->ack_status[i];
            }
        int busy = 0;
        for (int i = 0; i < r->n_reqs; i++)
            busy |= ucp_request_check_status(r->reqs[i]) == UCS_INPROGRESS;
        if ((msg && !busy) || now_s() > until)
            break;
        ucp_worker_progress(r->worker);
    }
    for (int i = 0; i < r->n_reqs; i++) {
        if (ucp_request_check_status(r->reqs[i]) == UCS_INPROGRESS)
            ucp_request_cancel(r->worker, r->reqs[i]);
        ucp_request_free(r->reqs[i]);
    }
    r->n_reqs = 0;
    return msg;
}

static void raw_close(raw_sender *r)
{
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_EP_CLOSE_FLAG_FORCE};
    ucs_status_ptr_t sp = ucp_ep_close_nbx(r->ep, &p);
    while (UCS_PTR_IS_PTR(sp) && ucp_request_check_status(sp) == UCS_INPROGRESS)
        ucp_worker_progress(r->worker);
    if (UCS_PTR_IS_PTR(sp))
        ucp_request_free(sp);
    ucp_worker_destroy(r->worker);
    ucp_cleanup(r->ctx);
}

/* Pieces a sender should never send fail their reservation with a message that says what was
 * wrong, and harm nothing else: the receiver then takes a padded bundle sent properly. Each case
 * sends the pieces of one padded part (head 0, K 1, V 2; a negative index: that piece at the
 * wrong offset) in the order given. */
static void test_bad_pieces(kt_transport *rx, kt_transport *tx)
{
    const uint64_t cap = 1 << 16;
    uint8_t *seg = malloc(cap), *seg0 = malloc(cap);
    REQUIRE(seg && seg0, "out of memory");
    kt_bundle_layout lay, lay0;
    const uint64_t n = write_padded(seg, cap, 1, 40, 16, &lay);
    const uint64_t n0 = write_padded(seg0, cap, 0, 40, 16, &lay0);
    const uint64_t off[3] = {0, lay.k_off, lay.v_off},
                   len[3] = {lay.head_len, lay.k_len, lay.v_len};
    struct {
        int order[4], n; /* pieces in order; 3: the head cut 64 bytes short; 4: K with a size
                            field one byte larger */
        const char *want;
    } cases[] = {
        {{0, -1, 2}, 3, "is neither its K nor its V section"}, /* K 64 bytes late, after the head */
        {{-1, 0, 2}, 3, "is neither its K nor its V section"}, /* the same, held before the head */
        {{0, 0}, 2, "came twice"},
        {{1, 2, 1}, 3, "more than two pieces came before its head"},
        {{3, 1, 2}, 3, "do not match its layout"},
        {{0, 4}, 2, "does not fit its part"},
    };
    char err[KT_ERR_MAX];
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    raw_sender raw;
    raw_open(&raw, kt_transport_port(rx));
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint64_t id = 850 + c;
        kt_bundle_view parts[1];
        kt_bundle_set set;
        place_log pl = {.mode = 0};
        placed_set(&set, parts, 1, &pl);
        done_box rb;
        box_init(&rb);
        REQUIRE(kt_transport_reserve(
                    rx, id, NULL, cap,
                    &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb},
                    tok, err) == 0,
                "%s", err);
        for (int i = 0; i < cases[c].n; i++) {
            const int p = cases[c].order[i];
            if (p == 3)
                raw_piece(&raw, id, tok, 1000 + c, n, 0, seg, len[0] - 64);
            else if (p == 4)
                raw_piece(&raw, id, tok, 1000 + c, n + 1, off[1], seg + off[1], len[1]);
            else if (p < 0)
                raw_piece(&raw, id, tok, 1000 + c, n, off[-p] + 64, seg + off[-p], len[-p]);
            else
                raw_piece(&raw, id, tok, 1000 + c, n, off[p], seg + off[p], len[p]);
        }
        int status = 0;
        const char *heard = raw_settle(&raw, 1000 + c, &status);
        REQUIRE(box_wait(&rb, 5.0), "case %zu: the reservation ended within 5 s", c);
        CHECK(rb.status == -1 && strstr(rb.msg, cases[c].want) && pl.parts == 0,
              "case %zu: the reservation failed with '%s': %s", c, cases[c].want, rb.msg);
        CHECK(heard && status != 0 && strstr(heard, cases[c].want),
              "case %zu: the sender hears '%s': %s", c, cases[c].want, heard ? heard : "(no ack)");
        placed_set_free(&set, &pl);
    }
    /* K and V before their head, small enough to come eagerly: held (their data kept past the
     * handler) and landed once the head is placed. A one-part set of layer 0 holds it. */
    {
        static uint8_t small[16384];
        kt_bundle_layout sl;
        const uint64_t sn = write_padded(small, sizeof small, 0, 4, 16, &sl);
        kt_bundle_view parts[1];
        kt_bundle_set set;
        place_log pl = {.mode = 0};
        placed_set(&set, parts, 1, &pl);
        done_box rb;
        box_init(&rb);
        REQUIRE(kt_transport_reserve(
                    rx, 869, NULL, cap,
                    &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb},
                    tok, err) == 0,
                "%s", err);
        raw_piece(&raw, 869, tok, 1100, sn, sl.k_off, small + sl.k_off, sl.k_len);
        raw_piece(&raw, 869, tok, 1100, sn, sl.v_off, small + sl.v_off, sl.v_len);
        raw_piece(&raw, 869, tok, 1100, sn, 0, small, sl.head_len);
        int status = -1;
        const char *heard = raw_settle(&raw, 1100, &status);
        REQUIRE(box_wait(&rb, 5.0), "held pieces: the reservation ended within 5 s");
        CHECK(heard && status == 0 && rb.status == 0 && pl.placed == 1 && pl.parts == 1 &&
                  memcmp(pl.k[0], small + sl.k_off, sl.k_len) == 0 &&
                  memcmp(pl.v[0], small + sl.v_off, sl.v_len) == 0,
              "K and V sent before their head land where the hook said: %s / %s", rb.msg,
              heard ? heard : "(no ack)");
        placed_set_free(&set, &pl);
    }
    raw_close(&raw);
    /* The receiver still serves: the same parts, sent properly, land where the hook says. */
    kt_bundle_view parts[2];
    kt_bundle_set set;
    place_log pl = {.mode = 0};
    placed_set(&set, parts, 2, &pl);
    done_box rb;
    box_init(&rb);
    REQUIRE(kt_transport_reserve(
                rx, 870, NULL, cap,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    done_box sb;
    box_init(&sb);
    REQUIRE(
        kt_transport_send(
            tx, &(kt_peer){HOST, kt_transport_port(rx), 870, tok}, seg0, n0,
            &(kt_send_opts){.flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
            err) == 0,
        "%s", err);
    CHECK(box_wait(&sb, 5.0) && sb.status == 0, "a proper first part after the bad pieces: %s",
          sb.msg);
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, kt_transport_port(rx), 870, tok}, seg, n, 5.0,
                                 err) == 0,
          "a proper last part after the bad pieces: %s", err);
    REQUIRE(box_wait(&rb, 5.0), "receive callback within 5 s");
    CHECK(rb.status == 0 && pl.placed == 2 && pl.parts == 2 && parts[1].k == pl.k[1] &&
              memcmp(pl.k[1], seg + lay.k_off, lay.k_len) == 0 &&
              memcmp(pl.v[0], seg0 + lay0.v_off, lay0.v_len) == 0,
          "the proper parts landed where the hook said: %s", rb.msg);
    placed_set_free(&set, &pl);
    free(seg);
    free(seg0);
}

/* kt_transport_put, with `rows` (K and V at rows_off) or without, waited for: its callback's
 * status (and message in box). */
static int put_rows_wait(kt_transport *tx, uint16_t port, uint64_t id, const uint8_t *tok,
                         const kt_rma_key *key, uint64_t offset, const kt_rma_rows *rows,
                         uint64_t rows_off, const uint8_t *buf, uint64_t n, unsigned flags,
                         done_box *box)
{
    char err[KT_ERR_MAX];
    box_init(box);
    const kt_put_dest at = {.key = key, .offset = offset, .rows = rows, .rows_off = rows_off};
    const kt_send_opts o = {.flags = flags, .timeout_s = 5.0, .cb = box_cb, .cb_arg = box};
    REQUIRE(kt_transport_put(tx, &(kt_peer){HOST, port, id, tok}, &at, buf, n, &o, err) == 0, "%s",
            err);
    REQUIRE(box_wait(box, 5.0), "put of bundle %" PRIu64 " completed within 5 s", id);
    return box->status;
}

static int put_wait(kt_transport *tx, uint16_t port, uint64_t id, const uint8_t *tok,
                    const kt_rma_key *key, uint64_t offset, const uint8_t *buf, uint64_t n,
                    unsigned flags, done_box *box)
{
    return put_rows_wait(tx, port, id, tok, key, offset, NULL, 0, buf, n, flags, box);
}

/* A listening and a sending transport in KT_TRANSPORT_MODE_RMA. */
static void make_rma(kt_transport **rx, kt_transport **tx)
{
    char err[KT_ERR_MAX];
    kt_transport_config rc = {
        .mode = KT_TRANSPORT_MODE_RMA, .listen_host = HOST, .name = "test-rma-rx"};
    kt_transport_config tc = {.mode = KT_TRANSPORT_MODE_RMA, .name = "test-rma-tx"};
    *rx = *tx = NULL;
    REQUIRE(kt_transport_create(&rc, rx, err) == 0 && kt_transport_create(&tc, tx, err) == 0,
            "RMA transports: %s", err);
}

/* RMA: a reservation mapped at reserve time takes a bundle put in two layer segments, each
 * acknowledged and none read before the last, then all validated into the set; a bundle sent
 * as active messages is taken too. Refused, with the reservation left waiting: a put at an
 * offset other than the parts' end, a put into a reservation that is not mapped, a put after
 * parts that were sent. A put bundle that does not validate fails the reservation. A transport
 * not created in RMA mode refuses both calls. */
static void test_rma(kt_transport *am_rx, kt_transport *am_tx)
{
    char err[KT_ERR_MAX];
    kt_transport *rx, *tx;
    make_rma(&rx, &tx);
    const uint16_t port = kt_transport_port(rx);
    enum { CAP = 16384 };
    static uint8_t seg[2][CAP], dst[2 * CAP];
    const uint64_t n0 = write_segment(seg[0], CAP, 0, 0), n1 = write_segment(seg[1], CAP, 1, 1);
    kt_bundle_view parts[2];
    kt_bundle_set set;
    kt_rma_key key;
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    done_box rb, sb;

    box_init(&rb);
    kt_bundle_set_init(&set, parts, 2);
    REQUIRE(kt_transport_reserve_rma(
                rx, 800, dst, sizeof dst,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                &key, err) == 0,
            "%s", err);
    CHECK(key.address == (uint64_t)(uintptr_t)dst && key.rkey_len > 0 &&
              key.rkey_len <= KT_RMA_KEY_MAX,
          "the key names the buffer and carries a remote key (%u bytes)", key.rkey_len);
    CHECK(put_wait(tx, port, 800, tok, &key, 0, seg[0], n0, KT_SEND_MORE, &sb) == 0,
          "first part put: %s", sb.msg);
    CHECK(memcmp(dst, seg[0], n0) == 0, "the first part is in the receiver's buffer");
    CHECK(set.n_parts == 0 && !box_wait(&rb, 0.05), "a put part is not read before the last one");
    CHECK(kt_transport_reservation_state(rx, 800) == KT_XFER_STATE_RESERVED,
          "waiting for the next");
    CHECK(put_wait(tx, port, 800, tok, &key, n0 + 8, seg[1], n1, 0, &sb) != 0,
          "a part put past the end of the parts before it is refused");
    CHECK_ERR_HAS(sb.msg, "put at offset");
    CHECK(put_wait(tx, port, 800, tok, &key, n0, seg[1], n1, 0, &sb) == 0, "last part put: %s",
          sb.msg);
    REQUIRE(box_wait(&rb, 5.0), "reservation completed within 5 s");
    CHECK(rb.status == 0 && rb.bytes == n0 + n1,
          "receive: status %d, %" PRIu64 " bytes of %" PRIu64 " %s", rb.status, rb.bytes, n0 + n1,
          rb.msg);
    CHECK(memcmp(dst, seg[0], n0) == 0 && memcmp(dst + n0, seg[1], n1) == 0,
          "the parts lie one after the other in the mapped buffer");
    CHECK(set.complete && set.n_parts == 2 && set.hdr.n_layers == 2 && set.hdr.first_token == 9 &&
              set.n_entries == 31,
          "the set: %u parts, %u layers, first token %d, %" PRIu64 " entries", set.n_parts,
          set.hdr.n_layers, set.hdr.first_token, set.n_entries);

    /* sent, not put, into a mapped reservation: taken as usual */
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 2);
    REQUIRE(kt_transport_reserve_rma(
                rx, 801, dst, sizeof dst,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                &key, err) == 0,
            "%s", err);
    box_init(&sb);
    REQUIRE(
        kt_transport_send(
            tx, &(kt_peer){HOST, port, 801, tok}, seg[0], n0,
            &(kt_send_opts){.flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
            err) == 0,
        "%s", err);
    REQUIRE(box_wait(&sb, 5.0) && sb.status == 0, "first part sent: %s", sb.msg);
    /* a put after a sent part: refused */
    CHECK(put_wait(tx, port, 801, tok, &key, n0, seg[1], n1, 0, &sb) != 0,
          "a put after sent parts is refused");
    CHECK_ERR_HAS(sb.msg, "all be put or all be sent");
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, 801, tok}, seg[1], n1, 5.0, err) == 0,
          "last part sent: %s", err);
    REQUIRE(box_wait(&rb, 5.0), "reservation completed within 5 s");
    CHECK(rb.status == 0 && set.complete && set.n_parts == 2,
          "sent parts into a mapped reservation: %s", rb.msg);

    /* a put into a reservation that is not mapped: refused, it waits on */
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 2);
    uint8_t tok2[KT_RESV_TOKEN_BYTES];
    static uint8_t plain[2 * CAP];
    REQUIRE(kt_transport_reserve(
                rx, 802, plain, sizeof plain,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok2,
                err) == 0,
            "%s", err);
    done_box ob; /* a mapped reservation whose key the put borrows: the bytes land there */
    box_init(&ob);
    kt_bundle_view other_part;
    kt_bundle_set other;
    kt_bundle_set_init(&other, &other_part, 1);
    REQUIRE(kt_transport_reserve_rma(
                rx, 805, dst, sizeof dst,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &other, .cb = box_cb, .cb_arg = &ob}, tok,
                &key, err) == 0,
            "%s", err);
    CHECK(put_wait(tx, port, 802, tok2, &key, 0, seg[0], n0, KT_SEND_MORE, &sb) != 0,
          "a put into an unmapped reservation is refused");
    CHECK_ERR_HAS(sb.msg, "not mapped for RMA");
    CHECK(kt_transport_reservation_state(rx, 802) == KT_XFER_STATE_RESERVED, "and it waits on");
    CHECK(kt_transport_release(rx, 802) == 0 && box_wait(&rb, 1.0), "released");
    CHECK(kt_transport_release(rx, 805) == 0 && box_wait(&ob, 1.0), "released");

    /* a put bundle that does not validate fails the reservation, and the sender hears why */
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 2);
    REQUIRE(kt_transport_reserve_rma(
                rx, 803, dst, sizeof dst,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                &key, err) == 0,
            "%s", err);
    static uint8_t bad[CAP];
    memcpy(bad, seg[0], n0);
    bad[n0 / 2] ^= 0x40;
    CHECK(put_wait(tx, port, 803, tok, &key, 0, bad, n0, 0, &sb) != 0,
          "a corrupt put bundle is refused");
    CHECK_ERR_HAS(sb.msg, "bundle 803 rejected");
    REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
    CHECK(rb.status == -1 && strstr(rb.msg, "rejected"), "reservation failed: %s", rb.msg);

    /* RMA calls on a transport created for active messages only */
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 2);
    CHECK(kt_transport_reserve_rma(
              am_rx, 804, dst, sizeof dst,
              &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
              &key, err) != 0,
          "reserve_rma on an AM transport is refused");
    CHECK_ERR_HAS(err, "not created in KT_TRANSPORT_MODE_RMA");
    CHECK(kt_transport_put(
              am_tx, &(kt_peer){HOST, port, 804, tok}, &(kt_put_dest){.key = &key, .offset = 0},
              seg[0], n0, &(kt_send_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb}, err) != 0,
          "put on an AM transport is refused");
    CHECK_ERR_HAS(err, "not created in KT_TRANSPORT_MODE_RMA");
    kt_transport_destroy(tx);
    kt_transport_destroy(rx);
}

/* Every list of the 2-head test model's segments seg[0, n) (layer i in seg[i], as write_padded
 * makes them) read through the complete set equals the same list read from the segment. */
static int set_reads_as(const kt_bundle_set *set, uint8_t *const *seg, const uint64_t *len, int n)
{
    enum { D = 64, MAX = 1000 };
    static float k[2][MAX * D], v[2][MAX * D];
    static int32_t pos[2][MAX];
    char err[KT_ERR_MAX];
    int same = 1;
    for (int l = 0; l < n; l++) {
        kt_bundle_view sv;
        REQUIRE(kt_bundle_parse(seg[l], len[l], &sv, err) == 0, "segment %d: %s", l, err);
        for (uint32_t hd = 0; hd < 2; hd++) {
            kt_bundle_list_view lv;
            REQUIRE(kt_bundle_view_list(&sv, 0, hd, &lv, err) == 0 && lv.count <= MAX, "%s", err);
            REQUIRE(kt_bundle_set_read(set, (uint32_t)l, hd, 0,
                                       &(kt_rows){lv.count, pos[0], KT_DTYPE_F32, k[0], v[0]},
                                       err) == 0 &&
                        kt_bundle_list_read(&sv, &lv, 0,
                                            &(kt_rows){lv.count, pos[1], KT_DTYPE_F32, k[1], v[1]},
                                            err) == 0,
                    "list (%d, %u): %s", l, hd, err);
            same &= memcmp(pos[0], pos[1], lv.count * sizeof pos[0][0]) == 0 &&
                    memcmp(k[0], k[1], lv.count * D * sizeof k[0][0]) == 0 &&
                    memcmp(v[0], v[1], lv.count * D * sizeof v[0][0]) == 0;
        }
    }
    return same;
}

/* RMA with rows regions: a reservation maps two more regions (a decode node's K and V rows of
 * its KV blocks); block-padded parts put with their rows land head in the buffer, K and V in
 * the regions, alternating with a part put whole, and are validated there at the end: the
 * set's views point into the regions, the callback counts whole parts. A corrupt K section
 * fails the reservation; a sender that claims larger regions than the receiver mapped is
 * refused at the end. Refused and left waiting: a part put with its rows into a reservation
 * without rows. Refused at the call: a packed or quantized part, sections past the regions,
 * map_rows on a reservation unknown, not mapped for RMA, without a set, or mapped already.
 * A reservation with rows released reports "released". */
static void test_rma_rows(void)
{
    char err[KT_ERR_MAX];
    kt_transport *rx, *tx;
    make_rma(&rx, &tx);
    const uint16_t port = kt_transport_port(rx);
    const uint64_t cap = 1 << 20;
    uint8_t *seg[3] = {malloc(cap), malloc(cap), malloc(cap)}, *dst = malloc(cap);
    REQUIRE(seg[0] && seg[1] && seg[2] && dst, "out of memory");
    kt_bundle_layout lay[3];
    const uint64_t n[3] = {write_padded(seg[0], cap, 0, 40, 16, &lay[0]),
                           write_padded(seg[1], cap, 1, 60, 16, &lay[1]),
                           write_padded(seg[2], cap, 2, 1000, 16, &lay[2])}; /* K: 256 KiB */
    /* Regions with room to spare, allocated twice as large as mapped: the part past `rbytes`
     * takes the puts of a sender that claims more than was mapped. */
    const uint64_t rbytes = lay[0].k_len + lay[2].k_len + 4096;
    uint8_t *krows = calloc(1, 2 * rbytes), *vrows = calloc(1, 2 * rbytes);
    REQUIRE(krows && vrows, "out of memory");
    kt_bundle_view parts[3];
    kt_bundle_set set;
    kt_rma_key key;
    kt_rma_rows rows;
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    done_box rb, sb;

    /* parts 0 and 2 with their rows, part 1 whole */
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 3);
    REQUIRE(kt_transport_reserve_rma(
                rx, 900, dst, cap,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                &key, err) == 0,
            "%s", err);
    REQUIRE(kt_transport_map_rows(rx, 900, krows, vrows, rbytes, &rows, err) == 0, "%s", err);
    CHECK(rows.k.address == (uint64_t)(uintptr_t)krows &&
              rows.v.address == (uint64_t)(uintptr_t)vrows && rows.bytes == rbytes &&
              rows.k.rkey_len > 0 && rows.v.rkey_len > 0,
          "the rows keys name the regions and carry remote keys");
    kt_rma_rows again;
    CHECK(kt_transport_map_rows(rx, 900, krows, vrows, rbytes, &again, err) != 0,
          "rows mapped twice refused");
    CHECK_ERR_HAS(err, "already mapped for rows");
    const uint64_t at2 = lay[0].head_len + n[1]; /* where part 2's head goes */
    CHECK(put_rows_wait(tx, port, 900, tok, &key, 0, &rows, 0, seg[0], n[0], KT_SEND_MORE,
                        &sb) == 0 && sb.bytes == n[0],
          "part 0 put with its rows: %s", sb.msg);
    CHECK(put_wait(tx, port, 900, tok, &key, lay[0].head_len, seg[1], n[1], KT_SEND_MORE, &sb) ==
              0,
          "part 1 put whole: %s", sb.msg);
    CHECK(set.n_parts == 0 && !box_wait(&rb, 0.02), "no put part read before the last one");
    CHECK(put_rows_wait(tx, port, 900, tok, &key, at2, &rows, lay[0].k_len, seg[2], n[2], 0,
                        &sb) == 0,
          "part 2 put with its rows: %s", sb.msg);
    REQUIRE(box_wait(&rb, 5.0), "reservation completed within 5 s");
    CHECK(rb.status == 0 && rb.bytes == n[0] + n[1] + n[2],
          "receive: status %d, %" PRIu64 " bytes of %" PRIu64 " %s", rb.status, rb.bytes,
          n[0] + n[1] + n[2], rb.msg);
    CHECK(set.complete && set.n_parts == 3 && set.hdr.n_layers == 3,
          "the set: %u parts, %u layers", set.n_parts, set.hdr.n_layers);
    if (set.complete && set.n_parts == 3) {
        CHECK(parts[0].base == dst && parts[0].k == krows && parts[0].v == vrows,
              "part 0: head in the buffer, K and V at the regions' start");
        CHECK(parts[1].base == dst + lay[0].head_len &&
                  parts[1].k == dst + lay[0].head_len + lay[1].k_off,
              "part 1: whole in the buffer after part 0's head");
        CHECK(parts[2].base == dst + at2 && parts[2].k == krows + lay[0].k_len &&
                  parts[2].v == vrows + lay[0].k_len,
              "part 2: head after part 1, K and V after part 0's");
        for (int i = 0; i < 3; i += 2)
            CHECK(memcmp(parts[i].base, seg[i], lay[i].head_len) == 0 &&
                      memcmp(parts[i].k, seg[i] + lay[i].k_off, lay[i].k_len) == 0 &&
                      memcmp(parts[i].v, seg[i] + lay[i].v_off, lay[i].v_len) == 0,
                  "part %d: head, K and V as sent", i);
        CHECK(set_reads_as(&set, seg, n, 3), "every list read through the set as written");
    }

    /* a K byte flipped after the bundle was sealed: the reservation fails, nothing joins */
    memset(krows, 0, 2 * rbytes); /* no valid rows left from before */
    memset(vrows, 0, 2 * rbytes);
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 3);
    REQUIRE(kt_transport_reserve_rma(
                rx, 901, dst, cap,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                &key, err) == 0,
            "%s", err);
    REQUIRE(kt_transport_map_rows(rx, 901, krows, vrows, rbytes, &rows, err) == 0, "%s", err);
    seg[0][lay[0].k_off + 10] ^= 0x40;
    CHECK(put_rows_wait(tx, port, 901, tok, &key, 0, &rows, 0, seg[0], n[0], 0, &sb) != 0,
          "a corrupt K section put with its rows is refused");
    CHECK_ERR_HAS(sb.msg, "checksum");
    seg[0][lay[0].k_off + 10] ^= 0x40;
    REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
    CHECK(rb.status == -1 && strstr(rb.msg, "bundle 901 rejected: part 0") && set.n_parts == 0,
          "reservation failed, no part taken: %s", rb.msg);

    /* a sender that claims larger regions than the receiver mapped (one byte short of parts 0
     * and 1's K): the second part's K and V land past the mapping (in the spare half here), and
     * the receiver refuses them at the end */
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 3);
    REQUIRE(kt_transport_reserve_rma(
                rx, 902, dst, cap,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                &key, err) == 0,
            "%s", err);
    REQUIRE(kt_transport_map_rows(rx, 902, krows, vrows, lay[0].k_len + lay[1].k_len - 1, &rows,
                                  err) == 0,
            "%s", err);
    kt_rma_rows liar = rows;
    liar.bytes = 2 * rbytes;
    CHECK(put_rows_wait(tx, port, 902, tok, &key, 0, &liar, 0, seg[0], n[0], KT_SEND_MORE, &sb) ==
              0,
          "part 0: %s", sb.msg);
    CHECK(put_rows_wait(tx, port, 902, tok, &key, lay[0].head_len, &liar, lay[0].k_len, seg[1],
                        n[1], 0, &sb) != 0,
          "a part whose rows end past the mapped regions is refused");
    CHECK_ERR_HAS(sb.msg, "end past the rows regions");
    REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
    CHECK(rb.status == -1 && strstr(rb.msg, "part 1 (put with its rows)") && set.n_parts == 1,
          "reservation failed at part 1, part 0 taken: %s", rb.msg);

    /* a part put with its rows into a reservation without rows: refused, it waits on and takes
     * a proper put; the rows' keys are another reservation's (its regions take the bytes) */
    done_box ob;
    box_init(&rb);
    box_init(&ob);
    kt_bundle_set_init(&set, parts, 3);
    kt_bundle_view other_parts[1];
    kt_bundle_set other;
    kt_bundle_set_init(&other, other_parts, 1);
    kt_rma_key okey;
    uint8_t otok[KT_RESV_TOKEN_BYTES];
    static uint8_t odst[4096];
    REQUIRE(kt_transport_reserve_rma(
                rx, 903, dst, cap,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                &key, err) == 0 &&
                kt_transport_reserve_rma(
                    rx, 904, odst, sizeof odst,
                    &(kt_resv_opts){.timeout_s = 5.0, .set = &other, .cb = box_cb, .cb_arg = &ob},
                    otok, &okey, err) == 0 &&
                kt_transport_map_rows(rx, 904, krows, vrows, rbytes, &rows, err) == 0,
            "%s", err);
    CHECK(put_rows_wait(tx, port, 903, tok, &key, 0, &rows, 0, seg[0], n[0], 0, &sb) != 0,
          "a part put with its rows into a reservation without rows is refused");
    CHECK_ERR_HAS(sb.msg, "is not mapped for rows");
    CHECK(kt_transport_reservation_state(rx, 903) == KT_XFER_STATE_RESERVED, "and it waits on");
    CHECK(put_wait(tx, port, 903, tok, &key, 0, seg[0], n[0], 0, &sb) == 0, "then a put: %s",
          sb.msg);
    REQUIRE(box_wait(&rb, 5.0), "reservation completed within 5 s");
    CHECK(rb.status == 0 && rb.bytes == n[0] && set.complete && parts[0].k == dst + lay[0].k_off,
          "the whole put completes it: %s", rb.msg);

    /* refused at the call */
    uint8_t *packed = malloc(cap);
    REQUIRE(packed, "out of memory");
    kt_bundle_layout play;
    uint64_t pn = write_padded(packed, cap, 0, 40, 0, &play);
    CHECK(kt_transport_put(
              tx, &(kt_peer){HOST, port, 904, otok},
              &(kt_put_dest){.key = &okey, .offset = 0, .rows = &rows, .rows_off = 0}, packed, pn,
              &(kt_send_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb}, err) != 0,
          "a packed part cannot be put with its rows");
    CHECK_ERR_HAS(err, "not a block-padded");
    pn = write_segment(packed, cap, 0, 0);
    CHECK(kt_transport_put(
              tx, &(kt_peer){HOST, port, 904, otok},
              &(kt_put_dest){.key = &okey, .offset = 0, .rows = &rows, .rows_off = 0}, packed, pn,
              &(kt_send_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb}, err) != 0,
          "a quantized part cannot be put with its rows");
    CHECK_ERR_HAS(err, "not a block-padded");
    const uint64_t past[2] = {rbytes - lay[0].k_len + 1, UINT64_MAX};
    for (int i = 0; i < 2; i++) {
        CHECK(kt_transport_put(
                  tx, &(kt_peer){HOST, port, 904, otok},
                  &(kt_put_dest){.key = &okey, .offset = 0, .rows = &rows, .rows_off = past[i]},
                  seg[0], n[0], &(kt_send_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
                  err) != 0,
              "sections ending past the regions (at %" PRIu64 ") refused", past[i]);
        CHECK_ERR_HAS(err, "end past the rows regions");
    }
    free(packed);

    /* map_rows refusals */
    done_box pb, qb;
    box_init(&pb);
    box_init(&qb);
    kt_rma_key nokey;
    static uint8_t pbuf[4096];
    kt_bundle_set_init(&set, parts, 3);
    REQUIRE(
        kt_transport_reserve(
            rx, 905, pbuf, sizeof pbuf,
            &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &pb}, tok,
            err) == 0 &&
            kt_transport_reserve_rma(rx, 906, pbuf, sizeof pbuf,
                                     &(kt_resv_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &qb},
                                     tok, &nokey, err) == 0,
        "%s", err);
    const struct {
        uint64_t id, bytes;
        const char *why;
    } refused[] = {{999, rbytes, "unknown"},
                   {905, rbytes, "not mapped for RMA"},
                   {906, rbytes, "without a set"},
                   {904, rbytes, "already mapped for rows"},
                   {906, 0, "a size > 0"}};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        CHECK(kt_transport_map_rows(rx, refused[i].id, krows, vrows, refused[i].bytes, &again,
                                    err) != 0,
              "map_rows on reservation %" PRIu64 " refused", refused[i].id);
        CHECK_ERR_HAS(err, refused[i].why);
    }
    CHECK(kt_transport_release(rx, 905) == 0 && kt_transport_release(rx, 906) == 0 &&
              box_wait(&pb, 1.0) && box_wait(&qb, 1.0),
          "released");

    /* a reservation with rows mapped, released: unmapped, and its callback says so */
    CHECK(kt_transport_release(rx, 904) == 0 && box_wait(&ob, 1.0) && ob.status == -1 &&
              strstr(ob.msg, "released"),
          "a reservation with rows released: %s", ob.msg);
    CHECK(kt_transport_reservation_state(rx, 904) == KT_XFER_STATE_NONE, "and gone");
    kt_transport_destroy(tx);
    kt_transport_destroy(rx);
    for (int i = 0; i < 3; i++)
        free(seg[i]);
    free(dst);
    free(krows);
    free(vrows);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    kt_transport *rx, *tx;
    if (make_pair(&rx, &tx) != 0) return KT_SKIP;
    test_pieces(rx, tx);
    test_bad_pieces(rx, tx);
    test_rma(rx, tx);
    test_rma_rows();
    kt_transport_destroy(tx);
    kt_transport_destroy(rx);
    return kt_done("test_transport_pieces");
}
