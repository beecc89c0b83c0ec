/*
 * test_grpc.c - the gRPC helpers of common/rpc.h over real gRPC on loopback (ephemeral ports):
 * a unary round trip (grpc.health.v1.Health/Check), an unknown method answered UNIMPLEMENTED at
 * once, a sleeping handler giving the client DEADLINE_EXCEEDED (and seeing the deadline), a stream
 * of N messages in order then OK, a client cancel seen by the streaming handler, a detached stream
 * fed from another thread (the decode loop's pattern), malformed request bytes answered
 * INVALID_ARGUMENT with a message, a busy port refused, and shutdown with calls in flight; a
 * server auth hook (kc_server_set_auth) with request metadata (kc_call_metadata, sent by
 * kc_unary_md and kc_stream_open_md): calls without or with a wrong token refused with the hook's
 * status and details before decoding and without running the handler, an exempt method open,
 * the right token let through with the handler seeing the metadata.
 * Not tested: TLS, message-size limits over the wire, many concurrent clients (the integration
 * tests do that with the real processes). Leaks are checked by the sanitizer build (LSan).
 * Run: ctest -R test_grpc (about 2 s).
 */
#include "kr_test.h"

#include "rpc.h"

#include "grpc/health/v1/health.pb-c.h"
#include "kvrelay/v1/internal.pb-c.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#define HEALTH_CHECK "/grpc.health.v1.Health/Check"
#define DECODE "/kvrelay.v1.Decode/Decode"
#define PREFILL "/kvrelay.v1.Prefill/Prefill"
#define RESERVE "/kvrelay.v1.Decode/Reserve"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* ------------------------------------------------------------------ the test server */

/* What the handlers saw, for the client side to assert on. */
static atomic_int seen_cancel;      /* the endless stream's handler saw its call cancelled */
static atomic_int handler_running;  /* the endless stream's handler has started */
static atomic_llong prefill_ms_left; /* the deadline as the sleeping handler saw it */

static int health_check(kc_call *call, const ProtobufCMessage *req, void *user)
{
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    if (r->service[0] && strcmp(r->service, "kvrelay.v1.Decode") != 0)
        return kc_call_error(call, GRPC_STATUS_NOT_FOUND, "unknown service '%s'", r->service);
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    kc_call_send(call, &resp.base);
    return GRPC_STATUS_OK;
}

/* Decode.Decode: max_tokens token messages with ids 1000+i, then finish, then OK. Reservation id
 * 7 streams until cancelled instead (the cancellation and shutdown tests). */
static int decode_stream(kc_call *call, const ProtobufCMessage *req, void *user)
{
    const Kvrelay__V1__DecodeRequest *r = (const void *)req;
    if (r->reservation_id == 7) {
        atomic_store(&handler_running, 1);
        for (uint32_t i = 0;; i++) {
            uint32_t id = i;
            Kvrelay__V1__DecodeTokens toks = KVRELAY__V1__DECODE_TOKENS__INIT;
            toks.n_ids = 1;
            toks.ids = &id;
            Kvrelay__V1__DecodeResponse m = KVRELAY__V1__DECODE_RESPONSE__INIT;
            m.event_case = KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS;
            m.tokens = &toks;
            if (kc_call_send(call, &m.base) != 0 || kc_call_wait(call, 5)) {
                atomic_store(&seen_cancel, 1);
                return GRPC_STATUS_CANCELLED;
            }
        }
    }
    for (uint32_t i = 0; i < r->max_tokens; i++) {
        uint32_t id = 1000 + i;
        Kvrelay__V1__DecodeTokens toks = KVRELAY__V1__DECODE_TOKENS__INIT;
        toks.n_ids = 1;
        toks.ids = &id;
        Kvrelay__V1__DecodeResponse m = KVRELAY__V1__DECODE_RESPONSE__INIT;
        m.event_case = KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS;
        m.tokens = &toks;
        if (kc_call_send(call, &m.base) != 0)
            return GRPC_STATUS_CANCELLED;
    }
    Kvrelay__V1__DecodeFinish fin = KVRELAY__V1__DECODE_FINISH__INIT;
    fin.reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    fin.completion_tokens = r->max_tokens;
    Kvrelay__V1__DecodeResponse m = KVRELAY__V1__DECODE_RESPONSE__INIT;
    m.event_case = KVRELAY__V1__DECODE_RESPONSE__EVENT_FINISH;
    m.finish = &fin;
    kc_call_send(call, &m.base);
    return GRPC_STATUS_OK;
}

/* Prefill.Prefill: records the deadline it was given, then sleeps 600 ms without looking at
 * cancellation (a handler stuck in compute), then answers. */
static int prefill_slow(kc_call *call, const ProtobufCMessage *req, void *user)
{
    atomic_store(&prefill_ms_left, (long long)kc_call_ms_left(call));
    sleep_ms(600);
    Kvrelay__V1__PrefillResponse resp = KVRELAY__V1__PREFILL_RESPONSE__INIT;
    resp.first_token = 42;
    kc_call_send(call, &resp.base); /* fails: the client gave up; that must be harmless */
    return GRPC_STATUS_OK;
}

/* Decode.Reserve, unary, detached to a "decode loop" thread that answers 20 ms later: the
 * pattern a node uses when another thread owns the work. */
static void *reserve_loop(void *arg)
{
    kc_call *call = arg;
    sleep_ms(20);
    Kvrelay__V1__ReserveResponse resp = KVRELAY__V1__RESERVE_RESPONSE__INIT;
    resp.reservation_id = 99;
    resp.transfer_address = "127.0.0.1:1";
    if (kc_call_send(call, &resp.base) == 0)
        kc_call_finish(call, GRPC_STATUS_OK, NULL);
    else
        kc_call_finish(call, GRPC_STATUS_CANCELLED, NULL);
    return NULL;
}

static int reserve_detached(kc_call *call, const ProtobufCMessage *req, void *user)
{
    pthread_t *loop = user;
    if (pthread_create(loop, NULL, reserve_loop, call) != 0)
        return kc_call_error(call, GRPC_STATUS_UNAVAILABLE, "no loop thread");
    return KC_DETACHED;
}

static pthread_t reserve_thread;

/* A server with the test's handlers; `cfg` may be NULL. */
static kc_server *server_up_cfg(int *port, const kc_server_config *cfg)
{
    kc_status st;
    kc_server *srv;
    REQUIRE(kc_server_create("127.0.0.1:0", cfg, &srv, port, &st) == 0, "%s", st.details);
    CHECK(*port > 0, "port %d", *port);
    REQUIRE(kc_server_add_unary(srv, HEALTH_CHECK, &grpc__health__v1__health_check_request__descriptor,
                                health_check, NULL) == 0, "add Check");
    REQUIRE(kc_server_add_stream(srv, DECODE, &kvrelay__v1__decode_request__descriptor,
                                 decode_stream, NULL) == 0, "add Decode");
    REQUIRE(kc_server_add_unary(srv, PREFILL, &kvrelay__v1__prefill_request__descriptor,
                                prefill_slow, NULL) == 0, "add Prefill");
    REQUIRE(kc_server_add_unary(srv, RESERVE, &kvrelay__v1__reserve_request__descriptor,
                                reserve_detached, &reserve_thread) == 0, "add Reserve");
    CHECK(kc_server_add_unary(srv, RESERVE, &kvrelay__v1__reserve_request__descriptor,
                              reserve_detached, NULL) != 0, "a duplicate path is refused");
    REQUIRE(kc_server_start(srv, &st) == 0, "%s", st.details);
    return srv;
}

static kc_server *server_up(int *port)
{
    return server_up_cfg(port, NULL);
}

static kc_channel *channel_to(int port)
{
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    kc_channel *ch;
    kc_status st;
    REQUIRE(kc_channel_create(target, 0, &ch, &st) == 0, "%s", st.details);
    return ch;
}

/* ------------------------------------------------------------------ tests */

static void test_unary(kc_channel *ch)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_status st;
    int rc = kc_unary(ch, HEALTH_CHECK, &req.base, &grpc__health__v1__health_check_response__descriptor,
                      5000, &resp, &st);
    CHECK(rc == 0 && st.code == GRPC_STATUS_OK, "Check: %s %s", kc_status_name(st.code), st.details);
    if (rc == 0) {
        const Grpc__Health__V1__HealthCheckResponse *r = (const void *)resp;
        CHECK(r->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING,
              "status %d", (int)r->status);
        kc_message_free(resp);
    }
    /* a handler's error status and details reach the client */
    req.service = "no.such.Service";
    resp = NULL;
    rc = kc_unary(ch, HEALTH_CHECK, &req.base, &grpc__health__v1__health_check_response__descriptor,
                  5000, &resp, &st);
    CHECK(rc == -1 && st.code == GRPC_STATUS_NOT_FOUND, "got %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "no.such.Service");
    CHECK(resp == NULL, "no response on error");
}

static void test_unimplemented(kc_channel *ch)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_status st;
    double t0 = now_s();
    int rc = kc_unary(ch, "/kvrelay.v1.Nope/Nothing", &req.base,
                      &grpc__health__v1__health_check_response__descriptor, 5000, &resp, &st);
    double dt = now_s() - t0;
    CHECK(rc == -1 && st.code == GRPC_STATUS_UNIMPLEMENTED, "got %s", kc_status_name(st.code));
    CHECK(dt < 1.0, "UNIMPLEMENTED took %.3f s: it waited for the deadline", dt);
    CHECK_ERR_HAS(st.details, "/kvrelay.v1.Nope/Nothing");
}

static void test_deadline(kc_channel *ch)
{
    Kvrelay__V1__PrefillRequest req = KVRELAY__V1__PREFILL_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_status st;
    double t0 = now_s();
    int rc = kc_unary(ch, PREFILL, &req.base, &kvrelay__v1__prefill_response__descriptor, 150,
                      &resp, &st);
    double dt = now_s() - t0;
    CHECK(rc == -1 && st.code == GRPC_STATUS_DEADLINE_EXCEEDED, "got %s %s",
          kc_status_name(st.code), st.details);
    CHECK(dt < 0.5, "DEADLINE_EXCEEDED after %.3f s, expected ~0.15", dt);
    long long left = atomic_load(&prefill_ms_left);
    /* the grpc-timeout header is rounded up in transit, so the server may see a hair more */
    CHECK(left > 0 && left <= 160, "the handler saw %lld ms left, expected (0, ~150]", left);
}

static void test_stream(kc_channel *ch)
{
    enum { N = 50 };
    Kvrelay__V1__DecodeRequest req = KVRELAY__V1__DECODE_REQUEST__INIT;
    req.max_tokens = N;
    kc_stream *s;
    kc_status st;
    REQUIRE(kc_stream_open(ch, DECODE, &req.base, 5000, &s, &st) == 0, "%s", st.details);
    int n_tokens = 0, n_finish = 0, in_order = 1, rc;
    ProtobufCMessage *m;
    while ((rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st)) == 1) {
        const Kvrelay__V1__DecodeResponse *r = (const void *)m;
        if (r->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS) {
            in_order &= n_finish == 0 && r->tokens->n_ids == 1 &&
                        r->tokens->ids[0] == 1000u + (uint32_t)n_tokens;
            n_tokens++;
        } else if (r->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_FINISH) {
            n_finish++;
            CHECK(r->finish->completion_tokens == N, "finish says %u", r->finish->completion_tokens);
        }
        kc_message_free(m);
    }
    CHECK(rc == 0 && st.code == GRPC_STATUS_OK, "stream ended %s %s", kc_status_name(st.code),
          st.details);
    CHECK(n_tokens == N && n_finish == 1 && in_order, "%d tokens, %d finish, in order %d",
          n_tokens, n_finish, in_order);
    /* after the end, next keeps saying so */
    CHECK(kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st) == 0, "end sticks");
    kc_stream_close(s);

    /* an empty stream: straight to finish */
    req.max_tokens = 0;
    REQUIRE(kc_stream_open(ch, DECODE, &req.base, 5000, &s, &st) == 0, "%s", st.details);
    int n = 0;
    while ((rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st)) == 1) {
        n++;
        kc_message_free(m);
    }
    CHECK(rc == 0 && n == 1, "rc %d, %d messages", rc, n);
    kc_stream_close(s);
}

static void test_cancel(kc_channel *ch)
{
    atomic_store(&seen_cancel, 0);
    Kvrelay__V1__DecodeRequest req = KVRELAY__V1__DECODE_REQUEST__INIT;
    req.reservation_id = 7; /* endless */
    kc_stream *s;
    kc_status st;
    REQUIRE(kc_stream_open(ch, DECODE, &req.base, 5000, &s, &st) == 0, "%s", st.details);
    ProtobufCMessage *m;
    for (int i = 0; i < 3; i++) {
        int rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st);
        CHECK(rc == 1, "message %d: rc %d %s", i, rc, st.details);
        if (rc == 1)
            kc_message_free(m);
    }
    kc_stream_cancel(s);
    int rc;
    while ((rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st)) == 1)
        kc_message_free(m); /* what was already on its way */
    CHECK(rc == -1 && st.code == GRPC_STATUS_CANCELLED, "after cancel: %s",
          kc_status_name(st.code));
    kc_stream_close(s);
    double t0 = now_s();
    while (!atomic_load(&seen_cancel) && now_s() - t0 < 3.0)
        sleep_ms(2);
    CHECK(atomic_load(&seen_cancel), "the handler never saw the client's cancel");

    /* closing an unfinished stream without reading cancels it too */
    atomic_store(&seen_cancel, 0);
    REQUIRE(kc_stream_open(ch, DECODE, &req.base, 5000, &s, &st) == 0, "%s", st.details);
    CHECK(kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st) == 1, "first");
    kc_message_free(m);
    kc_stream_close(s);
    t0 = now_s();
    while (!atomic_load(&seen_cancel) && now_s() - t0 < 3.0)
        sleep_ms(2);
    CHECK(atomic_load(&seen_cancel), "closing the stream did not cancel the handler");
}

static void test_detached(kc_channel *ch)
{
    Kvrelay__V1__ReserveRequest req = KVRELAY__V1__RESERVE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_status st;
    int rc = kc_unary(ch, RESERVE, &req.base, &kvrelay__v1__reserve_response__descriptor, 5000,
                      &resp, &st);
    CHECK(rc == 0, "Reserve: %s %s", kc_status_name(st.code), st.details);
    if (rc == 0) {
        const Kvrelay__V1__ReserveResponse *r = (const void *)resp;
        CHECK(r->reservation_id == 99 && strcmp(r->transfer_address, "127.0.0.1:1") == 0,
              "reservation %llu at %s", (unsigned long long)r->reservation_id, r->transfer_address);
        kc_message_free(resp);
    }
    pthread_join(reserve_thread, NULL);
}

static void test_malformed(kc_channel *ch)
{
    /* wire type 7 does not exist: no message parses from these bytes */
    static const unsigned char junk[] = {0xff, 0xff, 0xff, 0x01, 0x02};
    ProtobufCMessage *resp = NULL;
    kc_status st;
    int rc = kc_unary_bytes(ch, HEALTH_CHECK, junk, sizeof junk,
                            &grpc__health__v1__health_check_response__descriptor, 5000, &resp, &st);
    CHECK(rc == -1 && st.code == GRPC_STATUS_INVALID_ARGUMENT, "got %s",
          kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "malformed grpc.health.v1.HealthCheckRequest");
    /* the same on a streaming method */
    /* the same on a streaming method (a unary call is a stream of at most one message) */
    rc = kc_unary_bytes(ch, DECODE, junk, sizeof junk, &kvrelay__v1__decode_response__descriptor,
                        5000, &resp, &st);
    CHECK(rc == -1 && st.code == GRPC_STATUS_INVALID_ARGUMENT, "stream: got %s %s",
          kc_status_name(st.code), st.details);
    CHECK_ERR_HAS(st.details, "malformed kvrelay.v1.DecodeRequest");
    /* and the server still serves */
    test_unary(ch);
}

static void test_busy_port(int port)
{
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    kc_server *srv = NULL;
    int p2 = 0;
    kc_status st;
    CHECK(kc_server_create(addr, NULL, &srv, &p2, &st) == -1 && srv == NULL, "bound twice");
    CHECK(st.code == GRPC_STATUS_UNAVAILABLE, "got %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, addr);
}

/* The server goes away with a stream in flight: destroy returns promptly (the handler sees the
 * cancel) and the client's stream ends with an error instead of hanging. */
static void test_shutdown_in_flight(void)
{
    int port;
    kc_server *srv = server_up(&port);
    kc_channel *ch = channel_to(port);
    atomic_store(&seen_cancel, 0);
    atomic_store(&handler_running, 0);
    Kvrelay__V1__DecodeRequest req = KVRELAY__V1__DECODE_REQUEST__INIT;
    req.reservation_id = 7;
    kc_stream *s;
    kc_status st;
    REQUIRE(kc_stream_open(ch, DECODE, &req.base, 5000, &s, &st) == 0, "%s", st.details);
    ProtobufCMessage *m;
    CHECK(kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st) == 1, "first");
    kc_message_free(m);
    double t0 = now_s();
    kc_server_destroy(srv);
    double dt = now_s() - t0;
    CHECK(dt < 2.0, "shutdown took %.3f s", dt);
    CHECK(atomic_load(&seen_cancel), "the stream's handler was not cancelled by shutdown");
    int rc;
    while ((rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st)) == 1)
        kc_message_free(m);
    CHECK(rc == -1, "the stream ended %s after the server went away", kc_status_name(st.code));
    kc_stream_close(s);
    kc_channel_destroy(ch);
}

/* A unary call whose handler is still sleeping when the server shuts down. */
static void *slow_client(void *arg)
{
    kc_channel *ch = arg;
    Kvrelay__V1__PrefillRequest req = KVRELAY__V1__PREFILL_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_status st;
    if (kc_unary(ch, PREFILL, &req.base, &kvrelay__v1__prefill_response__descriptor, 5000, &resp,
                 &st) == 0)
        kc_message_free(resp);
    return NULL;
}

static void test_shutdown_unary_in_flight(void)
{
    int port;
    kc_server *srv = server_up(&port);
    kc_channel *ch = channel_to(port);
    atomic_store(&prefill_ms_left, -1);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, slow_client, ch) == 0, "thread");
    double t0 = now_s();
    while (atomic_load(&prefill_ms_left) < 0 && now_s() - t0 < 3.0)
        sleep_ms(2);
    CHECK(atomic_load(&prefill_ms_left) >= 0, "the slow handler never started");
    kc_server_destroy(srv); /* waits for the 600 ms handler, not for the 5 s deadline */
    double dt = now_s() - t0;
    CHECK(dt < 2.0, "shutdown took %.3f s", dt);
    pthread_join(t, NULL);
    kc_channel_destroy(ch);
}

/* The server's own deadline: a call without a client deadline gets max_deadline_ms (a handler
 * sees a finite time left), a client's later deadline is cut to it (an endless stream is ended
 * by its handler, not by the client's deadline), a client's sooner deadline is kept. */
static void test_server_deadline(void)
{
    int port;
    const kc_server_config cfg = {.max_deadline_ms = 300};
    kc_server *srv = server_up_cfg(&port, &cfg);
    kc_channel *ch = channel_to(port);
    Kvrelay__V1__PrefillRequest preq = KVRELAY__V1__PREFILL_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_status st;
    atomic_store(&prefill_ms_left, -1);
    if (kc_unary(ch, PREFILL, &preq.base, &kvrelay__v1__prefill_response__descriptor, 0, &resp, &st) == 0)
        kc_message_free(resp);
    long long left = atomic_load(&prefill_ms_left);
    CHECK(left > 0 && left <= 300, "no client deadline: the handler saw %lld ms left, expected (0, 300]", left);
    atomic_store(&prefill_ms_left, -1);
    if (kc_unary(ch, PREFILL, &preq.base, &kvrelay__v1__prefill_response__descriptor, 100, &resp, &st) == 0)
        kc_message_free(resp);
    left = atomic_load(&prefill_ms_left);
    CHECK(left > 0 && left <= 110, "a 100 ms client deadline: the handler saw %lld ms left", left);

    atomic_store(&seen_cancel, 0);
    Kvrelay__V1__DecodeRequest dreq = KVRELAY__V1__DECODE_REQUEST__INIT;
    dreq.reservation_id = 7; /* endless until cancelled */
    kc_stream *s;
    /* a 5 s client deadline is later than the server's: the server's ends the stream */
    REQUIRE(kc_stream_open(ch, DECODE, &dreq.base, 5000, &s, &st) == 0, "%s", st.details);
    ProtobufCMessage *m;
    int rc;
    while ((rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st)) == 1)
        kc_message_free(m);
    CHECK(rc == -1 && st.code == GRPC_STATUS_CANCELLED && atomic_load(&seen_cancel),
          "the endless stream ended %s (%s), expected the handler's CANCELLED at the server's deadline",
          kc_status_name(st.code), st.details);
    kc_stream_close(s);
    kc_channel_destroy(ch);
    kc_server_destroy(srv);
}

/* ------------------------------------------------------------------ the auth hook */

static atomic_int echo_calls;  /* md_echo ran */
static atomic_int auth_calls;  /* the hook ran */

/* Decode.Reserve on the auth server: answers the "x-echo" metadata it was sent (or "(none)") as
 * the transfer address, so the client sees what the handler saw. */
static int md_echo(kc_call *call, const ProtobufCMessage *req, void *user)
{
    atomic_fetch_add(&echo_calls, 1);
    size_t len = 0;
    const char *v = kc_call_metadata(call, "X-Echo", &len); /* keys match ignoring case */
    char buf[128];
    snprintf(buf, sizeof buf, "%.*s", v ? (int)len : 6, v ? v : "(none)");
    Kvrelay__V1__ReserveResponse resp = KVRELAY__V1__RESERVE_RESPONSE__INIT;
    resp.transfer_address = buf;
    kc_call_send(call, &resp.base);
    return GRPC_STATUS_OK;
}

/* Health is open; everything else needs "authorization: Bearer sesame". */
static int auth_hook(void *user, const kc_call *call, char *details, size_t cap)
{
    atomic_fetch_add(&auth_calls, 1);
    CHECK(user == &auth_calls, "the hook got user %p", user);
    if (strncmp(kc_call_method(call), "/grpc.health.v1.", 16) == 0)
        return GRPC_STATUS_OK;
    size_t len;
    const char *v = kc_call_metadata(call, "authorization", &len);
    if (!v) {
        snprintf(details, cap, "missing token");
        return GRPC_STATUS_UNAUTHENTICATED;
    }
    if (len != strlen("Bearer sesame") || memcmp(v, "Bearer sesame", len) != 0) {
        snprintf(details, cap, "invalid token");
        return GRPC_STATUS_UNAUTHENTICATED;
    }
    return GRPC_STATUS_OK;
}

/* One Reserve call with `md`: its status code; *echo gets the echoed metadata on OK. */
static grpc_status_code reserve_md(kc_channel *ch, const kc_md *md, size_t n_md, char *echo,
                                   kc_status *st)
{
    Kvrelay__V1__ReserveRequest req = KVRELAY__V1__RESERVE_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    echo[0] = '\0';
    const kc_call_opts opts = {.timeout_ms = 5000, .md = md, .n_md = n_md};
    if (kc_unary_md(ch, RESERVE, &req.base, &kvrelay__v1__reserve_response__descriptor, &opts, &resp, st) == 0) {
        snprintf(echo, 128, "%s", ((const Kvrelay__V1__ReserveResponse *)resp)->transfer_address);
        kc_message_free(resp);
    }
    return st->code;
}

/* Reads a Decode stream to its end: the number of messages; *st the final status. */
static int decode_md(kc_channel *ch, const kc_md *md, size_t n_md, kc_status *st)
{
    Kvrelay__V1__DecodeRequest req = KVRELAY__V1__DECODE_REQUEST__INIT;
    req.max_tokens = 5;
    kc_stream *s;
    REQUIRE(kc_stream_open_md(ch, DECODE, &req.base, md, n_md, 5000, &s, st) == 0, "%s",
            st->details);
    int n = 0, rc;
    ProtobufCMessage *m;
    while ((rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, st)) == 1) {
        n++;
        kc_message_free(m);
    }
    kc_stream_close(s);
    return n;
}

static void test_auth(void)
{
    kc_status st;
    kc_server *srv;
    int port;
    REQUIRE(kc_server_create("127.0.0.1:0", NULL, &srv, &port, &st) == 0, "%s", st.details);
    REQUIRE(kc_server_add_unary(srv, HEALTH_CHECK, &grpc__health__v1__health_check_request__descriptor,
                                health_check, NULL) == 0, "add Check");
    REQUIRE(kc_server_add_unary(srv, RESERVE, &kvrelay__v1__reserve_request__descriptor, md_echo,
                                NULL) == 0, "add Reserve");
    REQUIRE(kc_server_add_stream(srv, DECODE, &kvrelay__v1__decode_request__descriptor,
                                 decode_stream, NULL) == 0, "add Decode");
    REQUIRE(kc_server_set_auth(srv, auth_hook, &auth_calls) == 0, "set auth");
    REQUIRE(kc_server_start(srv, &st) == 0, "%s", st.details);
    CHECK(kc_server_set_auth(srv, NULL, NULL) == -1, "set_auth after start is refused");
    kc_channel *ch = channel_to(port);
    char echo[128];

    /* an exempt method: no metadata needed */
    test_unary(ch);
    CHECK(atomic_load(&auth_calls) >= 1, "the hook did not run for Check");

    /* no metadata: refused with the hook's status and details; the handler never ran */
    CHECK(reserve_md(ch, NULL, 0, echo, &st) == GRPC_STATUS_UNAUTHENTICATED, "no token: %s %s",
          kc_status_name(st.code), st.details);
    CHECK(strcmp(st.details, "missing token") == 0, "details '%s'", st.details);
    /* other metadata only */
    kc_md other[] = {{"x-echo", "hello"}};
    CHECK(reserve_md(ch, other, 1, echo, &st) == GRPC_STATUS_UNAUTHENTICATED, "other md: %s",
          kc_status_name(st.code));
    /* a wrong token, and a prefix of the right one */
    kc_md wrong[] = {{"authorization", "Bearer sesam"}};
    CHECK(reserve_md(ch, wrong, 1, echo, &st) == GRPC_STATUS_UNAUTHENTICATED, "wrong: %s",
          kc_status_name(st.code));
    CHECK(strcmp(st.details, "invalid token") == 0, "details '%s'", st.details);
    /* malformed bytes without a token: the hook answers before the request is decoded */
    static const unsigned char junk[] = {0xff, 0xff, 0xff, 0x01, 0x02};
    ProtobufCMessage *resp = NULL;
    CHECK(kc_unary_bytes(ch, RESERVE, junk, sizeof junk, &kvrelay__v1__reserve_response__descriptor,
                         5000, &resp, &st) == -1 && st.code == GRPC_STATUS_UNAUTHENTICATED,
          "junk without a token: %s %s", kc_status_name(st.code), st.details);
    CHECK(atomic_load(&echo_calls) == 0, "the handler ran %d times for refused calls",
          atomic_load(&echo_calls));

    /* the right token; the handler sees the other metadata too */
    kc_md good[] = {{"x-echo", "hello"}, {"authorization", "Bearer sesame"}};
    CHECK(reserve_md(ch, good, 2, echo, &st) == GRPC_STATUS_OK, "good: %s %s",
          kc_status_name(st.code), st.details);
    CHECK(strcmp(echo, "hello") == 0, "the handler saw x-echo '%s'", echo);
    CHECK(reserve_md(ch, good + 1, 1, echo, &st) == GRPC_STATUS_OK, "good alone: %s",
          kc_status_name(st.code));
    CHECK(strcmp(echo, "(none)") == 0, "absent metadata read as '%s'", echo);
    CHECK(atomic_load(&echo_calls) == 2, "the handler ran %d times", atomic_load(&echo_calls));

    /* a streaming method: refused before any message, or the whole stream with the token */
    int n = decode_md(ch, NULL, 0, &st);
    CHECK(n == 0 && st.code == GRPC_STATUS_UNAUTHENTICATED, "stream without a token: %d messages, %s",
          n, kc_status_name(st.code));
    CHECK(strcmp(st.details, "missing token") == 0, "stream details '%s'", st.details);
    n = decode_md(ch, good, 2, &st);
    CHECK(n == 6 && st.code == GRPC_STATUS_OK, "stream with the token: %d messages, %s %s", n,
          kc_status_name(st.code), st.details);

    kc_channel_destroy(ch);
    kc_server_destroy(srv);
}

int main(void)
{
    int port;
    kc_server *srv = server_up(&port);
    kc_channel *ch = channel_to(port);
    test_unary(ch);
    test_unimplemented(ch);
    test_deadline(ch);
    test_stream(ch);
    test_cancel(ch);
    test_detached(ch);
    test_malformed(ch);
    test_busy_port(port);
    kc_channel_destroy(ch);
    kc_server_destroy(srv);
    test_shutdown_in_flight();
    test_shutdown_unary_in_flight();
    test_server_deadline();
    test_auth();
    if (kt_failures)
        fprintf(stderr, "test_grpc: %d failure(s)\n", kt_failures);
    return kt_failures ? 1 : 0;
}
