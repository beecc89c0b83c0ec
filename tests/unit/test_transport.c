/*
 * test_transport.c - the UCX bundle transport (kvtransfer/transport.h) over real loopback UCX,
 * sent as active messages: a real bundle round trip into a larger reservation, sizes from 1
 * byte to 32 MiB, concurrent transfers, refusals (unknown reservation, a bundle larger than its
 * reservation, bad bundle, wrong token) that leave the receiver serving, a smaller bundle
 * accepted with its own size, expiry and send timeouts, a set's part hook (once per part, in
 * order, before the ack; its refusal reaches the sender), parts owned by the set, the log
 * callback, and peer death both ways with processes killed by SIGKILL mid-transfer (children
 * are this binary re-executed with --child-*, so no UCX state crosses a fork). Parts in pieces
 * and RMA puts: test_transport_pieces.c; the helpers both use: kt_transport_test.h.
 * Not a benchmark: tools/kvrelay-transfer-bench measures throughput.
 * Run: ctest -R transport (about 10 s). Exit 77 (SKIPPED) when UCX cannot listen on loopback.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include <ucp/api/ucp.h>

#include "kt_transport_test.h"
#include "le.h"

/* Receiver child: listens on PORT, reserves ID for SIZE bytes; mode "stop" raises SIGSTOP on
 * itself as soon as bytes start landing (the parent then kills it mid-transfer); mode "serve"
 * waits for the bundle and exits 0 when it arrived intact (pattern seed = ID). */
static int child_receiver(uint16_t port, uint64_t id, uint64_t size, const char *mode)
{
    char err[KT_ERR_MAX];
    kt_transport *t = NULL;
    for (int i = 0; i < 200 && !t; i++) { /* the dead receiver's port may linger briefly */
        t = make("child-rx", 1, port, err);
        if (!t)
            sleep_ms(20);
    }
    if (!t) {
        fprintf(stderr, "child receiver: %s\n", err);
        return 3;
    }
    uint8_t *buf = malloc(size);
    done_box b;
    box_init(&b);
    uint8_t ready[1 + KT_RESV_TOKEN_BYTES] = {'R'}; /* ready, then the reservation's token */
    if (!buf || kt_transport_reserve(t, id, buf, size,
                                     &(kt_resv_opts){.timeout_s = 30.0, .cb = box_cb, .cb_arg = &b},
                                     ready + 1, err) != 0) {
        fprintf(stderr, "child receiver: %s\n", err);
        return 3;
    }
    if (write(1, ready, sizeof ready) != (ssize_t)sizeof ready)
        return 3;
    if (strcmp(mode, "stop") == 0) {
        while (kt_transport_reservation_state(t, id) != KT_XFER_STATE_RECEIVING && !b.done)
            usleep(50);
        raise(SIGSTOP);
        pause();
        return 0;
    }
    if (!box_wait(&b, 20.0) || b.status != 0) {
        fprintf(stderr, "child receiver: %s\n", b.done ? b.msg : "no bundle within 20 s");
        return 4;
    }
    uint8_t *want = malloc(size);
    fill(want, size, (uint32_t)id);
    int same = memcmp(buf, want, size) == 0;
    kt_transport_destroy(t);
    free(want);
    free(buf);
    return same ? 0 : 5;
}

/* The token as hex, for a child's command line. */
static void token_hex(const uint8_t *tok, char hex[2 * KT_RESV_TOKEN_BYTES + 1])
{
    for (int i = 0; i < KT_RESV_TOKEN_BYTES; i++)
        snprintf(hex + 2 * i, 3, "%02x", tok[i]);
}

/* Sender child: sends SIZE bytes of a pattern (seed = ID) to reservation ID, or with `padded` a
 * block-padded layer-0 segment of about SIZE bytes (it travels in pieces), then waits to be
 * killed. */
static int child_sender(uint16_t port, uint64_t id, uint64_t size, const char *hex, int padded)
{
    char err[KT_ERR_MAX];
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    for (int i = 0; i < KT_RESV_TOKEN_BYTES; i++)
        if (sscanf(hex + 2 * i, "%2hhx", &tok[i]) != 1)
            return 3;
    kt_transport *t = make("child-tx", 0, 0, err);
    uint8_t *buf = malloc(size);
    if (!t || !buf)
        return 3;
    if (padded) { /* rows of count + count / 3 + 1 entries, each 128 bytes of K, of V and 4 of
                     position: count of about 3/4 of size / 260 */
        kt_bundle_layout lay;
        size = write_padded(buf, size, 0, (uint32_t)(size / 264 * 3 / 4), 16, &lay);
    } else {
        fill(buf, size, (uint32_t)id);
    }
    done_box b;
    box_init(&b);
    if (kt_transport_send(
            t, &(kt_peer){HOST, port, id, tok}, buf, size,
            &(kt_send_opts){
                .flags = padded ? KT_SEND_MORE : 0, .timeout_s = 30.0, .cb = box_cb, .cb_arg = &b},
            err) != 0)
        return 3;
    pause();
    return 0;
}

/* Starts this binary as a child with argv; its stdout is a pipe the parent reads "R" from. */
static pid_t spawn(char *const argv[], int *ready_fd)
{
    int p[2];
    if (pipe(p) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 1);
        close(p[0]);
        close(p[1]);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(p[1]);
    *ready_fd = p[0];
    return pid;
}

/* Reads the receiver child's "R" and its reservation's token into tok (may be NULL). */
static int wait_ready(int fd, uint8_t *tok)
{
    uint8_t ready[1 + KT_RESV_TOKEN_BYTES];
    size_t got = 0;
    while (got < sizeof ready) {
        ssize_t n = read(fd, ready + got, sizeof ready - got);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    if (tok)
        memcpy(tok, ready + 1, KT_RESV_TOKEN_BYTES);
    return got == sizeof ready && ready[0] == 'R';
}

/* A free TCP port chosen by the kernel (a listener then binds it explicitly). */
static uint16_t free_port(void)
{
    char err[KT_ERR_MAX];
    kt_transport *t = make("probe", 1, 0, err);
    uint16_t p = t ? kt_transport_port(t) : 0;
    kt_transport_destroy(t);
    return p;
}

static void test_real_bundle(kt_transport *rx, kt_transport *tx)
{
    kt_bundle_header h = test_header(2, 64, KT_DTYPE_BF16, 7, 40, "streaming:sinks=4,window=16");
    kt_bundle_list lists[4];
    for (int i = 0; i < 4; i++)
        lists[i] = (kt_bundle_list){.count = 20, .pinned = 4, .window = 16};
    uint64_t size = 0;
    char err[KT_ERR_MAX];
    REQUIRE(kt_bundle_size(&h, lists, &size, err) == 0, "%s", err);
    /* The receiver reserves more than the bundle needs (as a decode node reserves the bound):
     * the transport must validate exactly the bytes that arrived, and hand over its view of them
     * (kt_transport_reserve with a set), the only parse a decode node makes. */
    uint64_t cap = size + 4096;
    uint8_t *src = calloc(1, size), *dst = calloc(1, cap);
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &h, lists, src, size, err) == 0, "%s", err);
    float k[20 * 64], v[20 * 64];
    int32_t pos[20];
    for (int l = 0; l < 2; l++)
        for (int hd = 0; hd < 2; hd++) {
            for (int e = 0; e < 20; e++) {
                pos[e] = e < 4 ? e : 20 + e - 4;
                for (int d = 0; d < 64; d++) {
                    k[e * 64 + d] = (float)(l * 1000 + hd * 100 + e) + d * 0.25f;
                    v[e * 64 + d] = -k[e * 64 + d];
                }
            }
            REQUIRE(kt_bundle_writer_put(&w, l, hd, &(kt_rows_in){20, pos, KT_DTYPE_F32, k, v},
                                         err) == 0,
                    "%s", err);
        }
    uint64_t written = 0;
    REQUIRE(kt_bundle_writer_finish(&w, &written, err) == 0, "%s", err);
    REQUIRE(written == size, "bundle size %" PRIu64 " vs %" PRIu64, written, size);

    done_box rb;
    box_init(&rb);
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    kt_bundle_view view;
    kt_bundle_set set;
    kt_bundle_set_init(&set, &view, 1);
    kt_bundle_set roomless;
    kt_bundle_set_init(&roomless, NULL, 0);
    CHECK(kt_transport_reserve(rx, 1, dst, cap,
                               &(kt_resv_opts){
                                   .timeout_s = 5.0, .set = &roomless, .cb = box_cb, .cb_arg = &rb},
                               tok, err) != 0,
          "a bundle reservation into a set without room refused");
    CHECK_ERR_HAS(err, "needs an empty set");
    REQUIRE(kt_transport_reserve(
                rx, 1, dst, cap,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    CHECK(kt_transport_reservation_state(rx, 1) == KT_XFER_STATE_RESERVED, "state RESERVED");
    int rc = kt_transport_send_wait(tx, &(kt_peer){HOST, kt_transport_port(rx), 1, tok}, src, size,
                                    5.0, err);
    CHECK(rc == 0, "send of a real bundle: %s", err);
    REQUIRE(box_wait(&rb, 5.0), "receive callback within 5 s");
    CHECK(rb.status == 0 && rb.bytes == size, "receive: status %d bytes %" PRIu64 " %s",
          rb.status, rb.bytes, rb.msg);
    CHECK(kt_transport_reservation_state(rx, 1) == KT_XFER_STATE_NONE, "state NONE after");
    CHECK(memcmp(src, dst, size) == 0, "received bundle equals the original");
    CHECK(view.size == size && view.hdr.first_token == 7 && view.n_entries == 80,
          "the transport's view: %" PRIu64 " bytes, first token %d, %" PRIu64 " entries",
          view.size, view.hdr.first_token, view.n_entries);
    CHECK(view.lists >= dst && view.v + view.n_entries * view.row_bytes == dst + size,
          "the view points into the receive buffer");
    CHECK(set.complete && set.n_parts == 1 && set.size == size, "a whole bundle is a set of one");
    free(src);
    free(dst);
}

/* A bundle in two layer segments, as a pipelining prefill node sends it: each part lands after
 * the previous one, is acknowledged on its own, and the reservation completes with the last;
 * segments that do not fit together fail the reservation. */
static void test_segments(kt_transport *rx, kt_transport *tx)
{
    enum { CAP = 16384 };
    static uint8_t seg[2][CAP], dst[2 * CAP];
    uint64_t n0 = write_segment(seg[0], CAP, 0, 0), n1 = write_segment(seg[1], CAP, 1, 1);
    char err[KT_ERR_MAX];
    kt_bundle_view parts[2];
    kt_bundle_set set;
    kt_bundle_set_init(&set, parts, 2);
    done_box rb, sb;
    box_init(&rb);
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    const uint16_t port = kt_transport_port(rx);
    REQUIRE(kt_transport_reserve(
                rx, 700, dst, sizeof dst,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    box_init(&sb);
    REQUIRE(
        kt_transport_send(
            tx, &(kt_peer){HOST, port, 700, tok}, seg[0], n0,
            &(kt_send_opts){.flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
            err) == 0,
        "%s", err);
    REQUIRE(box_wait(&sb, 5.0), "first segment acknowledged within 5 s");
    CHECK(sb.status == 0, "first segment: %s", sb.msg);
    CHECK(kt_transport_reservation_state(rx, 700) == KT_XFER_STATE_RESERVED,
          "after a part with more to come, the reservation waits for the next");
    CHECK(!box_wait(&rb, 0.05), "no completion before the last part");
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, 700, tok}, seg[1], n1, 5.0, err) == 0,
          "last segment: %s", err);
    REQUIRE(box_wait(&rb, 5.0), "receive callback within 5 s");
    CHECK(rb.status == 0 && rb.bytes == n0 + n1, "receive: status %d, %" PRIu64 " bytes of %" PRIu64
          " %s", rb.status, rb.bytes, n0 + n1, rb.msg);
    CHECK(memcmp(dst, seg[0], n0) == 0 && memcmp(dst + n0, seg[1], n1) == 0,
          "the parts lie one after the other in the reserved buffer");
    CHECK(set.complete && set.n_parts == 2 && set.hdr.n_layers == 2 && set.hdr.first_token == 9 &&
          set.n_entries == 31, "the set: %u parts, %u layers, first token %d, %" PRIu64 " entries",
          set.n_parts, set.hdr.n_layers, set.hdr.first_token, set.n_entries);
    kt_bundle_list lv;
    CHECK(kt_bundle_set_list(&set, 1, 0, &lv, err) == 0 && lv.count == 11,
          "layer 1 is the second part's: %s", err);

    /* a set must start at layer 0; a second segment that restarts there is refused too */
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 2);
    REQUIRE(kt_transport_reserve(
                rx, 701, dst, sizeof dst,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, 701, tok}, seg[1], n1, 5.0, err) != 0,
          "a set that starts at layer 1 is refused");
    CHECK_ERR_HAS(err, "starts at layer 1, not 0");
    REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
    CHECK(rb.status == -1, "reservation failed");
    box_init(&rb);
    kt_bundle_set_init(&set, parts, 2);
    REQUIRE(kt_transport_reserve(
                rx, 702, dst, sizeof dst,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    box_init(&sb);
    REQUIRE(
        kt_transport_send(
            tx, &(kt_peer){HOST, port, 702, tok}, seg[0], n0,
            &(kt_send_opts){.flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
            err) == 0,
        "%s", err);
    REQUIRE(box_wait(&sb, 5.0), "first segment acknowledged");
    uint64_t bad = write_segment(seg[1], CAP, 1, 0);
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, 702, tok}, seg[1], bad, 5.0, err) != 0,
          "a segment that restarts layer 0 at its old positions is refused");
    CHECK_ERR_HAS(err, "not after its position");
    REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
    CHECK(rb.status == -1 && strstr(rb.msg, "not after its position"), "reservation failed: %s",
          rb.msg);
}

/* What a part hook saw: the parts it was called for, in order, and whether the first part's
 * sender had been answered by then (it must not have: the hook runs before the ack). */
typedef struct hook_log {
    int calls;
    uint32_t index[4], first_layer[4];
    const done_box *sender;
    int answered_before;
    int refuse_at; /* the call (0-based) that refuses, or -1 */
} hook_log;

static int hook_cb(void *arg, const kt_bundle_set *s, uint32_t i, char *err)
{
    hook_log *h = arg;
    if (h->calls < 4) {
        h->index[h->calls] = i;
        h->first_layer[h->calls] = s->parts[i].hdr.first_layer;
    }
    if (h->calls == 0) { /* were the ack already sent, 50 ms would see the sender answered */
        sleep_ms(50);
        h->answered_before = box_wait((done_box *)h->sender, 0.0);
    }
    if (h->calls++ == h->refuse_at) {
        snprintf(err, KT_ERR_MAX, "no room for part %u", i);
        return -1;
    }
    return 0;
}

/* A set's part hook: called once per part, in order, after the part joined the set and before
 * its sender is answered; its refusal fails the reservation and reaches the sender with its
 * message, and no later part is taken. */
static void test_part_hook(kt_transport *rx, kt_transport *tx)
{
    enum { CAP = 16384 };
    static uint8_t seg[2][CAP];
    uint64_t n0 = write_segment(seg[0], CAP, 0, 0), n1 = write_segment(seg[1], CAP, 1, 1);
    char err[KT_ERR_MAX];
    kt_bundle_view parts[2];
    kt_bundle_set set;
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    const uint16_t port = kt_transport_port(rx);
    for (int refuse_at = -1; refuse_at < 1; refuse_at++) {
        const uint64_t id = 710 + (uint64_t)(refuse_at + 1);
        done_box rb, sb;
        box_init(&rb);
        box_init(&sb);
        hook_log h = {.sender = &sb, .refuse_at = refuse_at};
        kt_bundle_set_init(&set, parts, 2);
        set.on_part = hook_cb;
        set.on_part_arg = &h;
        REQUIRE(kt_transport_reserve(
                    rx, id, NULL, 2 * CAP,
                    &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb},
                    tok, err) == 0,
                "%s", err);
        REQUIRE(kt_transport_send(
                    tx, &(kt_peer){HOST, port, id, tok}, seg[0], n0,
                    &(kt_send_opts){
                        .flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
                    err) == 0,
                "%s", err);
        REQUIRE(box_wait(&sb, 5.0), "first segment answered within 5 s");
        if (refuse_at == 0) {
            CHECK(sb.status == -1 && strstr(sb.msg, "no room for part 0"),
                  "the hook's refusal reaches the sender: %s", sb.msg);
            REQUIRE(box_wait(&rb, 5.0), "failed reservation reported");
            CHECK(rb.status == -1 && strstr(rb.msg, "no room for part 0"), "reservation failed: %s",
                  rb.msg);
            CHECK(h.calls == 1, "no part after a refusal: %d calls", h.calls);
        } else {
            CHECK(sb.status == 0, "first segment: %s", sb.msg);
            CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, id, tok}, seg[1], n1, 5.0,
                                         err) == 0,
                  "last segment: %s", err);
            REQUIRE(box_wait(&rb, 5.0), "receive callback within 5 s");
            CHECK(rb.status == 0 && set.complete, "receive: %s", rb.msg);
            CHECK(h.calls == 2 && h.index[0] == 0 && h.index[1] == 1 && h.first_layer[0] == 0 &&
                      h.first_layer[1] == 1,
                  "one call per part, in order: %d calls (%u, %u)", h.calls, h.index[0],
                  h.index[1]);
        }
        CHECK(h.answered_before == 0, "the hook runs before the part's sender is answered");
        kt_bundle_set_free(&set);
    }
}

/* A reservation without a buffer (a decode node's): each part lands in a buffer of exactly its
 * size that the set owns, eager and rendezvous alike; `size` bounds all parts together; a part
 * past the bound is refused and the parts that came before are the set's to free. */
static void test_owned_parts(kt_transport *rx, kt_transport *tx)
{
    enum { CAP = 16384, D = 256, N = 300 };
    static uint8_t seg[2][CAP];
    uint64_t n0 = write_segment(seg[0], CAP, 0, 0), n1 = write_segment(seg[1], CAP, 1, 1);
    const uint16_t port = kt_transport_port(rx);
    char err[KT_ERR_MAX];
    kt_bundle_view parts[2];
    kt_bundle_set set;
    done_box rb, sb;
    uint8_t tok[KT_RESV_TOKEN_BYTES];

    kt_bundle_set_init(&set, parts, 2);
    box_init(&rb);
    REQUIRE(kt_transport_reserve(
                rx, 800, NULL, n0 + n1,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    CHECK(set.owned, "a reservation without a buffer gives the set its parts");
    box_init(&sb);
    REQUIRE(
        kt_transport_send(
            tx, &(kt_peer){HOST, port, 800, tok}, seg[0], n0,
            &(kt_send_opts){.flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
            err) == 0,
        "%s", err);
    REQUIRE(box_wait(&sb, 5.0), "first segment acknowledged within 5 s");
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, 800, tok}, seg[1], n1, 5.0, err) == 0,
          "last segment: %s", err);
    REQUIRE(box_wait(&rb, 5.0), "receive callback within 5 s");
    CHECK(rb.status == 0 && rb.bytes == n0 + n1, "receive: status %d, %" PRIu64 " bytes %s",
          rb.status, rb.bytes, rb.msg);
    CHECK(set.complete && set.n_parts == 2 && parts[0].size == n0 && parts[1].size == n1 &&
          memcmp(parts[0].base, seg[0], n0) == 0 && memcmp(parts[1].base, seg[1], n1) == 0,
          "each part in its own buffer, byte for byte");
    kt_bundle_set_free(&set);
    CHECK(set.n_parts == 0 && !set.complete && set.owned, "kt_bundle_set_free empties the set");

    /* a whole f32 bundle of 2.4 MB goes by rendezvous into a buffer of its size */
    kt_bundle_header h = test_header(2, D, KT_DTYPE_F32, 3, N, "full");
    kt_bundle_list lists[4];
    for (int i = 0; i < 4; i++)
        lists[i] = (kt_bundle_list){.count = N, .window = KT_BUNDLE_WINDOW_DENSE};
    uint64_t size = 0;
    REQUIRE(kt_bundle_size(&h, lists, &size, err) == 0, "%s", err);
    uint8_t *src = malloc(size);
    float *rows = malloc(sizeof(float) * N * D);
    int32_t *pos = malloc(sizeof(int32_t) * N);
    REQUIRE(src && rows && pos, "out of memory");
    for (int e = 0; e < N; e++) {
        pos[e] = e;
        for (int d = 0; d < D; d++) rows[e * D + d] = (float)(e % 97) - 0.125f * (float)d;
    }
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &h, lists, src, size, err) == 0, "%s", err);
    for (uint32_t l = 0; l < 2; l++)
        for (uint32_t hd = 0; hd < 2; hd++)
            REQUIRE(kt_bundle_writer_put(&w, l, hd, &(kt_rows_in){N, pos, KT_DTYPE_F32, rows, rows},
                                         err) == 0,
                    "%s", err);
    REQUIRE(kt_bundle_writer_finish(&w, &size, err) == 0, "%s", err);
    kt_bundle_set_init(&set, parts, 2);
    box_init(&rb);
    REQUIRE(kt_transport_reserve(
                rx, 801, NULL, 4 * size,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, 801, tok}, src, size, 5.0, err) == 0,
          "a 2.4 MB bundle: %s", err);
    REQUIRE(box_wait(&rb, 5.0), "receive callback within 5 s");
    CHECK(rb.status == 0 && set.n_parts == 1 && parts[0].size == size &&
          memcmp(parts[0].base, src, size) == 0, "the rendezvous part, byte for byte: %s", rb.msg);
    kt_bundle_set_free(&set);
    free(src);
    free(rows);
    free(pos);

    /* the bound counts every part: the second segment is one byte too many */
    kt_bundle_set_init(&set, parts, 2);
    box_init(&rb);
    REQUIRE(kt_transport_reserve(
                rx, 802, NULL, n0 + n1 - 1,
                &(kt_resv_opts){.timeout_s = 5.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    box_init(&sb);
    REQUIRE(
        kt_transport_send(
            tx, &(kt_peer){HOST, port, 802, tok}, seg[0], n0,
            &(kt_send_opts){.flags = KT_SEND_MORE, .timeout_s = 5.0, .cb = box_cb, .cb_arg = &sb},
            err) == 0,
        "%s", err);
    REQUIRE(box_wait(&sb, 5.0), "first segment acknowledged");
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, port, 802, tok}, seg[1], n1, 5.0, err) != 0,
          "a part past the reservation's bound is refused");
    CHECK_ERR_HAS(err, "too large for reservation");
    CHECK(kt_transport_release(rx, 802) == 0, "release after the refusal");
    REQUIRE(box_wait(&rb, 5.0), "released reservation reported");
    CHECK(rb.status == -1 && set.n_parts == 1, "released with the first part in the set: %s",
          rb.msg);
    kt_bundle_set_free(&set); /* the sanitizer build fails on a leak of that part */
}

static void test_sizes(kt_transport *rx, kt_transport *tx)
{
    static const uint64_t sizes[] = {1, 100, 8191, 8193, 65536, 1 << 20, 3u << 20, 32u << 20};
    char err[KT_ERR_MAX];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        uint64_t n = sizes[i], id = 100 + i;
        uint8_t *src = malloc(n), *dst = calloc(1, n);
        fill(src, n, (uint32_t)id);
        done_box rb;
        box_init(&rb);
        uint8_t tok[KT_RESV_TOKEN_BYTES];
        REQUIRE(kt_transport_reserve(
                    rx, id, dst, n, &(kt_resv_opts){.timeout_s = 10.0, .cb = box_cb, .cb_arg = &rb},
                    tok, err) == 0,
                "%s", err);
        int rc = kt_transport_send_wait(tx, &(kt_peer){HOST, kt_transport_port(rx), id, tok}, src,
                                        n, 10.0, err);
        CHECK(rc == 0, "send %" PRIu64 " bytes: %s", n, err);
        CHECK(box_wait(&rb, 5.0) && rb.status == 0 && rb.bytes == n, "receive %" PRIu64 ": %s",
              n, rb.msg);
        CHECK(memcmp(src, dst, n) == 0, "%" PRIu64 " bytes arrive intact", n);
        free(src);
        free(dst);
    }
}

typedef struct conc_arg {
    kt_transport *tx;
    uint16_t port;
    uint64_t id, n;
    const uint8_t *tok, *src;
    int rc;
    char err[KT_ERR_MAX];
} conc_arg;

static void *conc_main(void *p)
{
    conc_arg *a = p;
    a->rc = kt_transport_send_wait(a->tx, &(kt_peer){HOST, a->port, a->id, a->tok}, a->src, a->n,
                                   10.0, a->err);
    return NULL;
}

static void test_concurrent(kt_transport *rx, kt_transport *tx)
{
    enum { N = 8 };
    char err[KT_ERR_MAX];
    conc_arg args[N];
    pthread_t th[N];
    done_box rb[N];
    uint8_t *src[N], *dst[N], tok[N][KT_RESV_TOKEN_BYTES];
    for (int i = 0; i < N; i++) {
        uint64_t n = (uint64_t)(i + 1) << 19; /* 512 KiB .. 4 MiB */
        src[i] = malloc(n);
        dst[i] = calloc(1, n);
        fill(src[i], n, 200 + i);
        box_init(&rb[i]);
        REQUIRE(
            kt_transport_reserve(rx, 200 + i, dst[i], n,
                                 &(kt_resv_opts){.timeout_s = 10.0, .cb = box_cb, .cb_arg = &rb[i]},
                                 tok[i], err) == 0,
            "%s", err);
        args[i] = (conc_arg){.tx = tx, .port = kt_transport_port(rx), .id = 200 + i, .n = n,
                             .tok = tok[i], .src = src[i]};
    }
    for (int i = 0; i < N; i++)
        pthread_create(&th[i], NULL, conc_main, &args[i]);
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        CHECK(args[i].rc == 0, "concurrent send %d: %s", i, args[i].err);
        CHECK(box_wait(&rb[i], 5.0) && rb[i].status == 0, "concurrent receive %d: %s", i,
              rb[i].msg);
        CHECK(memcmp(src[i], dst[i], args[i].n) == 0, "concurrent %d intact", i);
        free(src[i]);
        free(dst[i]);
    }
}

static void test_refusals(kt_transport *rx, kt_transport *tx)
{
    char err[KT_ERR_MAX];
    uint16_t port = kt_transport_port(rx);
    uint8_t src[40000], dst[40000], tok[KT_RESV_TOKEN_BYTES] = {0};
    fill(src, sizeof src, 300);

    /* Unknown reservation, small (eager) and large (rendezvous). */
    int rc = kt_transport_send_wait(tx, &(kt_peer){HOST, port, 999, tok}, src, 100, 5.0, err);
    CHECK(rc != 0, "unknown reservation refused");
    CHECK_ERR_HAS(err, "unknown or expired reservation 999");
    rc = kt_transport_send_wait(tx, &(kt_peer){HOST, port, 999, tok}, src, sizeof src, 5.0, err);
    CHECK(rc != 0, "unknown reservation refused (rendezvous size)");
    CHECK_ERR_HAS(err, "unknown or expired reservation 999");

    /* A bundle larger than the reservation: refused, the reservation stays and then takes a
     * smaller one (a reservation is an upper bound), eager and rendezvous sizes. */
    done_box rb;
    static const uint64_t smaller[] = {39999, 1000};
    for (int i = 0; i < 2; i++) {
        uint64_t id = 310 + (uint64_t)i, n = smaller[i];
        uint64_t cap = n + 1;
        box_init(&rb);
        memset(dst, 0, sizeof dst);
        REQUIRE(kt_transport_reserve(rx, id, dst, cap,
                                     &(kt_resv_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &rb},
                                     tok, err) == 0,
                "%s", err);
        rc = kt_transport_send_wait(tx, &(kt_peer){HOST, port, id, tok}, src, cap + 1, 5.0, err);
        CHECK(rc != 0, "bundle over the reserved size refused (%" PRIu64 " > %" PRIu64 ")",
              cap + 1, cap);
        char want[160];
        snprintf(want, sizeof want, "bundle too large for reservation %" PRIu64 ": reserved at "
                 "most %" PRIu64 " bytes, bundle has %" PRIu64, id, cap, cap + 1);
        CHECK_ERR_HAS(err, want);
        CHECK(!rb.done && kt_transport_reservation_state(rx, id) == KT_XFER_STATE_RESERVED,
              "reservation survives a too large bundle");
        rc = kt_transport_send_wait(tx, &(kt_peer){HOST, port, id, tok}, src, n, 5.0, err);
        CHECK(rc == 0, "smaller bundle accepted after a refusal: %s", err);
        CHECK(box_wait(&rb, 5.0) && rb.status == 0 && rb.bytes == n, "callback reports the "
              "bundle's own size: status %d bytes %" PRIu64 " (want %" PRIu64 ") %s", rb.status,
              rb.bytes, n, rb.msg);
        CHECK(memcmp(src, dst, n) == 0 && dst[n] == 0, "smaller bundle lands at the start, "
              "nothing written past it");
    }

    /* Duplicate reservation and bad arguments. */
    box_init(&rb);
    REQUIRE(kt_transport_reserve(
                rx, 302, dst, sizeof dst,
                &(kt_resv_opts){
                    .timeout_s = 5.0, .flags = KT_RESERVE_PARSE, .cb = box_cb, .cb_arg = &rb},
                tok, err) == 0,
            "%s", err);
    CHECK(kt_transport_reserve(rx, 302, dst, sizeof dst,
                               &(kt_resv_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &rb}, tok,
                               err) != 0,
          "duplicate reservation refused");
    CHECK_ERR_HAS(err, "already exists");
    CHECK(kt_transport_reserve(tx, 5, dst, 1,
                               &(kt_resv_opts){.timeout_s = 1.0, .cb = box_cb, .cb_arg = &rb}, tok,
                               err) != 0,
          "reserve on a send-only transport refused");
    /* Not a bundle, with KT_RESERVE_PARSE: both sides hear the parser's reason. */
    rc = kt_transport_send_wait(tx, &(kt_peer){HOST, port, 302, tok}, src, sizeof src, 5.0, err);
    CHECK(rc != 0, "garbage refused by the parse flag");
    CHECK_ERR_HAS(err, "bundle 302 rejected: bundle: ");
    CHECK(box_wait(&rb, 5.0) && rb.status != 0, "receiver reports the bad bundle");
    CHECK_ERR_HAS(rb.msg, "rejected");

    /* Release of a pending reservation reports "released" before returning. */
    box_init(&rb);
    REQUIRE(kt_transport_reserve(rx, 303, dst, sizeof dst,
                                 &(kt_resv_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &rb},
                                 tok, err) == 0,
            "%s", err);
    CHECK(kt_transport_release(rx, 303) == 0 && rb.done == 1 && rb.status != 0,
          "release completes the reservation");
    CHECK_ERR_HAS(rb.msg, "released");
    CHECK(kt_transport_release(rx, 303) == -1, "second release finds nothing");

    /* An unknown mode is refused. */
    kt_transport_config cfg = {.mode = (kt_transport_mode)7};
    kt_transport *t = NULL;
    CHECK(kt_transport_create(&cfg, &t, err) != 0 && !t, "unknown mode refused");
    CHECK_ERR_HAS(err, "unknown mode");

    /* No receiver at all: the send fails, quickly, with a message. */
    uint16_t dead = free_port();
    double t0 = now_s();
    rc = kt_transport_send_wait(tx, &(kt_peer){HOST, dead, 1, tok}, src, 100, 5.0, err);
    CHECK(rc != 0 && now_s() - t0 < 5.0, "send to a closed port fails in %.2f s: %s",
          now_s() - t0, err);
}

/* A bundle carrying another token than its reservation's is refused, in eager and rendezvous
 * sizes, with nothing written; the reservation keeps waiting and then takes the bundle that
 * carries its own token. Two reservations' tokens differ, and neither opens the other. */
static void test_wrong_token(kt_transport *rx, kt_transport *tx)
{
    char err[KT_ERR_MAX];
    uint16_t port = kt_transport_port(rx);
    static uint8_t src[40000], dst[2][40000];
    static const uint64_t sizes[2] = {1000, sizeof src};
    uint8_t tok[2][KT_RESV_TOKEN_BYTES], bad[KT_RESV_TOKEN_BYTES];
    done_box rb[2];
    fill(src, sizeof src, 320);
    memset(dst, 0, sizeof dst);
    for (int i = 0; i < 2; i++) {
        box_init(&rb[i]);
        REQUIRE(
            kt_transport_reserve(rx, 320 + (uint64_t)i, dst[i], sizes[i],
                                 &(kt_resv_opts){.timeout_s = 10.0, .cb = box_cb, .cb_arg = &rb[i]},
                                 tok[i], err) == 0,
            "%s", err);
    }
    CHECK(memcmp(tok[0], tok[1], KT_RESV_TOKEN_BYTES) != 0, "each reservation has its own token");
    for (int i = 0; i < 2; i++) {
        uint64_t id = 320 + (uint64_t)i;
        char want[96];
        snprintf(want, sizeof want, "wrong token for reservation %" PRIu64, id);
        memcpy(bad, tok[i], sizeof bad);
        bad[KT_RESV_TOKEN_BYTES - 1] ^= 1; /* one bit off */
        const uint8_t *wrong[3] = {bad, tok[1 - i], (const uint8_t[KT_RESV_TOKEN_BYTES]){0}};
        for (int w = 0; w < 3; w++) {
            int rc = kt_transport_send_wait(tx, &(kt_peer){HOST, port, id, wrong[w]}, src, sizes[i],
                                            5.0, err);
            CHECK(rc != 0, "reservation %" PRIu64 ": wrong token %d refused", id, w);
            CHECK_ERR_HAS(err, want);
            CHECK(!rb[i].done &&
                      kt_transport_reservation_state(rx, id) == KT_XFER_STATE_RESERVED,
                  "reservation %" PRIu64 " still waiting after wrong token %d", id, w);
        }
        uint64_t nonzero = 0;
        for (uint64_t b = 0; b < sizes[i]; b++)
            nonzero += dst[i][b] != 0;
        CHECK(nonzero == 0, "nothing of a refused bundle was written (%" PRIu64 " bytes)",
              nonzero);
        int rc =
            kt_transport_send_wait(tx, &(kt_peer){HOST, port, id, tok[i]}, src, sizes[i], 5.0, err);
        CHECK(rc == 0, "reservation %" PRIu64 ": its own token accepted: %s", id, err);
        CHECK(box_wait(&rb[i], 5.0) && rb[i].status == 0 && rb[i].bytes == sizes[i],
              "reservation %" PRIu64 " completes: %s", id, rb[i].msg);
        CHECK(memcmp(src, dst[i], sizes[i]) == 0, "reservation %" PRIu64 " bundle intact", id);
    }
}

/* The last line a log callback got. */
typedef struct log_sink {
    pthread_mutex_t m;
    int n;
    kt_log_level level;
    char rid[64], line[KT_ERR_MAX + 64];
} log_sink;

static void sink_cb(void *arg, kt_log_level level, const char *request_id, const char *line)
{
    log_sink *s = arg;
    pthread_mutex_lock(&s->m);
    s->n++;
    s->level = level;
    snprintf(s->rid, sizeof s->rid, "%s", request_id ? request_id : "(none)");
    snprintf(s->line, sizeof s->line, "%s", line);
    pthread_mutex_unlock(&s->m);
}

/* A transport with a log callback hands it its lines (here a refused bundle's) with their level
 * and the request id given with the reservation, instead of writing them on stderr. */
static void test_log_callback(kt_transport *tx)
{
    char err[KT_ERR_MAX];
    log_sink sink = {.n = 0};
    pthread_mutex_init(&sink.m, NULL);
    kt_transport_config cfg = {
        .listen_host = HOST, .name = "test-log-rx", .log = sink_cb, .log_arg = &sink};
    kt_transport *rx;
    REQUIRE(kt_transport_create(&cfg, &rx, err) == 0, "%s", err);
    static uint8_t src[1000], dst[1000];
    uint8_t tok[KT_RESV_TOKEN_BYTES];
    done_box rb;
    box_init(&rb);
    const kt_resv_opts ro = {
        .timeout_s = 10.0, .cb = box_cb, .cb_arg = &rb, .request_id = "req-log-1"};
    REQUIRE(kt_transport_reserve(rx, 330, dst, sizeof dst, &ro, tok, err) == 0, "%s", err);
    tok[0] ^= 1;
    CHECK(kt_transport_send_wait(tx, &(kt_peer){HOST, kt_transport_port(rx), 330, tok}, src,
                                 sizeof src, 5.0, err) != 0,
          "a wrong token refused");
    pthread_mutex_lock(&sink.m);
    CHECK(sink.n == 1 && sink.level == KT_LOG_WARN && strcmp(sink.rid, "req-log-1") == 0 &&
              strstr(sink.line, "wrong token for reservation 330") != NULL,
          "%d line(s); the last: level %d, request id %s: %s", sink.n, (int)sink.level, sink.rid,
          sink.line);
    pthread_mutex_unlock(&sink.m);
    kt_transport_release(rx, 330);
    kt_transport_destroy(rx);
    pthread_mutex_destroy(&sink.m);
}

static void test_timeouts(kt_transport *rx, kt_transport *tx)
{
    char err[KT_ERR_MAX];
    uint8_t dst[1000], src[1000], tok[KT_RESV_TOKEN_BYTES];
    fill(src, sizeof src, 400);
    done_box rb;
    box_init(&rb);
    double t0 = now_s();
    REQUIRE(kt_transport_reserve(rx, 400, dst, sizeof dst,
                                 &(kt_resv_opts){.timeout_s = 0.3, .cb = box_cb, .cb_arg = &rb},
                                 tok, err) == 0,
            "%s", err);
    CHECK(box_wait(&rb, 3.0) && rb.status != 0, "reservation expires");
    double dt = now_s() - t0;
    CHECK(dt >= 0.29 && dt < 2.0, "expiry after %.3f s (asked 0.3)", dt);
    CHECK_ERR_HAS(rb.msg, "reservation 400 expired");
    int rc = kt_transport_send_wait(tx, &(kt_peer){HOST, kt_transport_port(rx), 400, tok}, src,
                                    sizeof src, 5.0, err);
    CHECK(rc != 0, "bundle for an expired reservation refused");
    CHECK_ERR_HAS(err, "unknown or expired reservation 400");
}

/* Receiver killed mid-transfer; a send timeout on a stalled receiver; then a new receiver at
 * the same address works with the same sender. */
static void test_receiver_death(kt_transport *tx)
{
    char err[KT_ERR_MAX];
    uint16_t port = free_port();
    REQUIRE(port != 0, "free port");
    char ports[16], ids[32], sizes[32];
    uint64_t big = 256u << 20;
    snprintf(ports, sizeof ports, "%u", port);
    snprintf(ids, sizeof ids, "%u", 500);
    snprintf(sizes, sizeof sizes, "%" PRIu64, big);
    uint8_t *src = malloc(big), tok[KT_RESV_TOKEN_BYTES];
    fill(src, big, 500);

    /* 1. Receiver stops itself as bytes land; our send times out (data still moving). */
    char *argv1[] = {"test_transport", "--child-receiver", ports, ids, sizes, "stop", NULL};
    int fd;
    pid_t pid = spawn(argv1, &fd);
    REQUIRE(pid > 0 && wait_ready(fd, tok), "receiver child ready");
    done_box sb;
    box_init(&sb);
    double t0 = now_s();
    REQUIRE(kt_transport_send(tx, &(kt_peer){HOST, port, 500, tok}, src, big,
                              &(kt_send_opts){.timeout_s = 1.5, .cb = box_cb, .cb_arg = &sb},
                              err) == 0,
            "%s", err);
    int st = 0;
    REQUIRE(waitpid(pid, &st, WUNTRACED) == pid && WIFSTOPPED(st), "child stopped mid-transfer");
    CHECK(box_wait(&sb, 5.0), "stalled send completes (no hang)");
    CHECK(sb.status != 0, "stalled send fails");
    CHECK_ERR_HAS(sb.msg, "timed out after 1.5 s");
    CHECK(now_s() - t0 < 4.0, "timeout honoured: %.2f s", now_s() - t0);
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);

    /* 2. Receiver killed while our send is in flight: fails with the peer named. */
    pid = spawn(argv1, &fd);
    REQUIRE(pid > 0 && wait_ready(fd, tok), "receiver child ready (2)");
    box_init(&sb);
    REQUIRE(kt_transport_send(tx, &(kt_peer){HOST, port, 500, tok}, src, big,
                              &(kt_send_opts){.timeout_s = 10.0, .cb = box_cb, .cb_arg = &sb},
                              err) == 0,
            "%s", err);
    REQUIRE(waitpid(pid, &st, WUNTRACED) == pid && WIFSTOPPED(st), "child stopped (2)");
    t0 = now_s();
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    CHECK(box_wait(&sb, 6.0), "send to a killed receiver completes (no hang)");
    CHECK(sb.status != 0, "send to a killed receiver fails");
    CHECK(strstr(sb.msg, "127.0.0.1") != NULL, "error names the peer: %s", sb.msg);
    fprintf(stderr, "receiver killed -> send failed after %.2f s: %s\n", now_s() - t0, sb.msg);
    CHECK(now_s() - t0 < 5.0, "detected within 5 s (%.2f s)", now_s() - t0);

    /* 3. A new receiver at the same address, same sender: works. */
    uint64_t small = 4u << 20;
    snprintf(ids, sizeof ids, "%u", 501);
    snprintf(sizes, sizeof sizes, "%" PRIu64, small);
    char *argv3[] = {"test_transport", "--child-receiver", ports, ids, sizes, "serve", NULL};
    pid = spawn(argv3, &fd);
    REQUIRE(pid > 0 && wait_ready(fd, tok), "new receiver ready");
    fill(src, small, 501);
    int rc = kt_transport_send_wait(tx, &(kt_peer){HOST, port, 501, tok}, src, small, 10.0, err);
    CHECK(rc == 0, "send to the restarted receiver: %s", err);
    REQUIRE(waitpid(pid, &st, 0) == pid, "wait new receiver");
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "restarted receiver got the bundle intact "
          "(status %d)", st);
    free(src);
}

/* Sender killed mid-transfer: the reservation fails with a message; the receiver serves on. */
static void test_sender_death(kt_transport *rx, kt_transport *tx)
{
    char err[KT_ERR_MAX];
    uint64_t big = 256u << 20;
    uint8_t *dst = malloc(big), tok[KT_RESV_TOKEN_BYTES];
    done_box rb;
    box_init(&rb);
    REQUIRE(kt_transport_reserve(rx, 600, dst, big,
                                 &(kt_resv_opts){.timeout_s = 20.0, .cb = box_cb, .cb_arg = &rb},
                                 tok, err) == 0,
            "%s", err);
    char ports[16], ids[32], sizes[32], hex[2 * KT_RESV_TOKEN_BYTES + 1];
    token_hex(tok, hex);
    snprintf(ports, sizeof ports, "%u", kt_transport_port(rx));
    snprintf(ids, sizeof ids, "600");
    snprintf(sizes, sizeof sizes, "%" PRIu64, big);
    char *argv[] = {"test_transport", "--child-sender", ports, ids, sizes, hex, NULL};
    int fd;
    pid_t pid = spawn(argv, &fd);
    REQUIRE(pid > 0, "sender child");
    close(fd);
    double t0 = now_s();
    while (kt_transport_reservation_state(rx, 600) != KT_XFER_STATE_RECEIVING && !rb.done &&
           now_s() - t0 < 10.0)
        usleep(50);
    kill(pid, SIGSTOP);
    int st;
    waitpid(pid, &st, WUNTRACED);
    CHECK(!rb.done, "sender stopped mid-transfer (before the bundle completed)");
    t0 = now_s();
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    CHECK(box_wait(&rb, 6.0), "reservation completes after the sender died (no hang)");
    CHECK(rb.status != 0, "reservation fails when the sender dies");
    fprintf(stderr, "sender killed -> reservation failed after %.2f s: %s\n", now_s() - t0,
            rb.msg);
    CHECK_ERR_HAS(rb.msg, "reservation 600");
    /* Still serving. */
    uint8_t src[5000], d2[5000];
    fill(src, sizeof src, 601);
    box_init(&rb);
    REQUIRE(kt_transport_reserve(rx, 601, d2, sizeof d2,
                                 &(kt_resv_opts){.timeout_s = 5.0, .cb = box_cb, .cb_arg = &rb},
                                 tok, err) == 0,
            "%s", err);
    int rc = kt_transport_send_wait(tx, &(kt_peer){HOST, kt_transport_port(rx), 601, tok}, src,
                                    sizeof src, 5.0, err);
    CHECK(rc == 0 && box_wait(&rb, 5.0) && rb.status == 0 && memcmp(src, d2, sizeof d2) == 0,
          "receiver serves after a sender died: %s %s", err, rb.msg);
    free(dst);

    /* The same while a part in pieces is landing where a placement hook said: the reservation
     * fails, no part is taken, and the placed memory is the hook's again once the callback
     * reported the failure. */
    kt_bundle_view parts[1];
    kt_bundle_set set;
    place_log pl = {.mode = 0};
    placed_set(&set, parts, 1, &pl);
    box_init(&rb);
    REQUIRE(kt_transport_reserve(
                rx, 602, NULL, big,
                &(kt_resv_opts){.timeout_s = 20.0, .set = &set, .cb = box_cb, .cb_arg = &rb}, tok,
                err) == 0,
            "%s", err);
    token_hex(tok, hex);
    snprintf(ids, sizeof ids, "602");
    char *argv2[] = {"test_transport", "--child-sender", ports, ids, sizes, hex, "padded", NULL};
    pid = spawn(argv2, &fd);
    REQUIRE(pid > 0, "sender child");
    close(fd);
    t0 = now_s();
    while (!__atomic_load_n(&pl.placed, __ATOMIC_ACQUIRE) && !rb.done && now_s() - t0 < 20.0)
        usleep(50);
    kill(pid, SIGSTOP);
    waitpid(pid, &st, WUNTRACED);
    CHECK(pl.placed == 1 && !rb.done, "sender stopped while K and V were landing in their place");
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    CHECK(box_wait(&rb, 6.0) && rb.status != 0 && pl.parts == 0 && set.n_parts == 0,
          "a part in pieces fails, untaken, when its sender dies: %s", rb.msg);
    placed_set_free(&set, &pl);
}

int main(int argc, char **argv)
{
    if (argc >= 6 && strcmp(argv[1], "--child-receiver") == 0)
        return child_receiver((uint16_t)atoi(argv[2]), strtoull(argv[3], NULL, 10),
                              strtoull(argv[4], NULL, 10), argv[5]);
    if (argc >= 6 && strcmp(argv[1], "--child-sender") == 0)
        return child_sender((uint16_t)atoi(argv[2]), strtoull(argv[3], NULL, 10),
                            strtoull(argv[4], NULL, 10), argv[5],
                            argc >= 7 && strcmp(argv[6], "padded") == 0);
    signal(SIGPIPE, SIG_IGN);
    kt_transport *rx, *tx;
    if (make_pair(&rx, &tx) != 0) return KT_SKIP;
    test_real_bundle(rx, tx);
    test_segments(rx, tx);
    test_part_hook(rx, tx);
    test_owned_parts(rx, tx);
    test_sizes(rx, tx);
    test_concurrent(rx, tx);
    test_refusals(rx, tx);
    test_wrong_token(rx, tx);
    test_log_callback(tx);
    test_timeouts(rx, tx);
    kt_transport_destroy(tx);
    kt_transport_destroy(rx);

    /* Peer death needs a transfer that takes a while: over shared memory (cma) a 256 MiB
     * rendezvous is one process_vm_readv call, over before anyone can be killed. TCP moves it in
     * many fragments; it is also what PEER error handling selects between hosts' peers. */
    setenv("UCX_TLS", "tcp", 1);
    char err[KT_ERR_MAX];
    rx = make("test-rx-tcp", 1, 0, err);
    tx = make("test-tx-tcp", 0, 0, err);
    REQUIRE(rx && tx, "tcp transports: %s", err);
    test_receiver_death(tx);
    test_sender_death(rx, tx);
    kt_transport_destroy(tx);
    kt_transport_destroy(rx);
    return kt_done("test_transport");
}
