/*
 * test_health.c - common/health.h over real gRPC on loopback: Check for "", a registered service
 * and an unknown one (NOT_FOUND naming it); kc_health_set_serving(0) -> NOT_SERVING and the
 * /healthz adapter saying so; three Watch streams each get the current status, then every
 * change; a Watch of an unknown service gets SERVICE_UNKNOWN and stays open; malformed request
 * bytes -> INVALID_ARGUMENT with the server still serving; a client cancel ends a Watch; server
 * shutdown with a Watch open ends it and does not hang.
 * Run: ctest -R test_health (about a second).
 */
#include "kr_test.h"

#include "health.h"

#include "grpc/health/v1/health.pb-c.h"

#include <unistd.h>

#define CHECK_PATH "/grpc.health.v1.Health/Check"
#define WATCH_PATH "/grpc.health.v1.Health/Watch"
#define SERVICE "kvrelay.v1.Decode"
#define N_WATCHERS 3

#define ST(x) GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__##x

static const ProtobufCMessageDescriptor *const resp_desc =
    &grpc__health__v1__health_check_response__descriptor;

/* Check(service): the status, or -1 with st set on an error status. */
static int check(kc_channel *ch, const char *service, kc_status *st)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    ProtobufCMessage *resp = NULL;
    if (kc_unary(ch, CHECK_PATH, &req.base, resp_desc, 5000, &resp, st) != 0) return -1;
    int v = (int)((Grpc__Health__V1__HealthCheckResponse *)resp)->status;
    kc_message_free(resp);
    return v;
}

static kc_stream *watch(kc_channel *ch, const char *service, int64_t timeout_ms)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = (char *)service;
    kc_stream *s = NULL;
    kc_status st;
    REQUIRE(kc_stream_open(ch, WATCH_PATH, &req.base, timeout_ms, &s, &st) == 0, "Watch(%s): %s",
            service, st.details);
    return s;
}

/* The next status on a Watch stream, or -1 when it ended (st says how). */
static int watch_next(kc_stream *s, kc_status *st)
{
    ProtobufCMessage *m = NULL;
    if (kc_stream_next(s, resp_desc, &m, st) != 1) return -1;
    int v = (int)((Grpc__Health__V1__HealthCheckResponse *)m)->status;
    kc_message_free(m);
    return v;
}

int main(void)
{
    alarm(120); /* a hung shutdown fails the test instead of hanging ctest */
    kc_server *srv = NULL;
    int port = 0;
    kc_status st;
    REQUIRE(kc_server_create("127.0.0.1:0", NULL, &srv, &port, &st) == 0, "server: %s", st.details);
    const char *const services[] = {SERVICE, "kvrelay.v1.Generation", NULL};
    kc_health *h = kc_health_register(srv, services);
    REQUIRE(h, "kc_health_register");
    REQUIRE(kc_server_start(srv, &st) == 0, "start: %s", st.details);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    kc_channel *ch = NULL;
    REQUIRE(kc_channel_create(target, 0, &ch, &st) == 0, "channel: %s", st.details);

    /* Check */
    CHECK(check(ch, "", &st) == ST(SERVING), "'': %s", st.details);
    CHECK(check(ch, SERVICE, &st) == ST(SERVING), "%s: %s", SERVICE, st.details);
    CHECK(check(ch, "kvrelay.v1.Generation", &st) == ST(SERVING), "Generation: %s", st.details);
    CHECK(check(ch, "no.such.Service", &st) == -1 && st.code == GRPC_STATUS_NOT_FOUND,
          "unknown service: code %d", st.code);
    CHECK_ERR_HAS(st.details, "no.such.Service");
    CHECK(kc_health_serving(h) == 1, "serving at start");

    /* three watchers see the current status, then each change */
    kc_stream *w[N_WATCHERS];
    for (int i = 0; i < N_WATCHERS; i++) {
        w[i] = watch(ch, i == 0 ? "" : SERVICE, 30000);
        CHECK(watch_next(w[i], &st) == ST(SERVING), "watcher %d first: %s", i, st.details);
    }
    kc_health_set_serving(h, 0);
    for (int i = 0; i < N_WATCHERS; i++)
        CHECK(watch_next(w[i], &st) == ST(NOT_SERVING), "watcher %d change: %s", i, st.details);
    CHECK(check(ch, "", &st) == ST(NOT_SERVING), "Check after set_serving(0)");
    CHECK(check(ch, SERVICE, &st) == ST(NOT_SERVING), "Check %s after set_serving(0)", SERVICE);
    CHECK(check(ch, "no.such.Service", &st) == -1 && st.code == GRPC_STATUS_NOT_FOUND,
          "unknown service while not serving");
    char reason[64] = "";
    CHECK(kc_health_http_check(h, reason, sizeof reason) == 0 && strcmp(reason, "not serving") == 0,
          "/healthz adapter: '%s'", reason);
    kc_health_set_serving(h, 0); /* no change: nothing sent */
    kc_health_set_serving(h, 1);
    for (int i = 0; i < N_WATCHERS; i++)
        CHECK(watch_next(w[i], &st) == ST(SERVING), "watcher %d back: %s", i, st.details);
    CHECK(kc_health_http_check(h, reason, sizeof reason) == 1, "/healthz adapter when serving");

    /* a client cancel ends the watch */
    kc_stream_cancel(w[0]);
    CHECK(watch_next(w[0], &st) == -1 && st.code == GRPC_STATUS_CANCELLED, "cancelled: code %d",
          st.code);
    kc_stream_close(w[0]);
    kc_stream_close(w[1]); /* closing unread cancels too */

    /* an unknown service's watch says SERVICE_UNKNOWN and stays open until its deadline */
    kc_stream *u = watch(ch, "no.such.Service", 300);
    CHECK(watch_next(u, &st) == ST(SERVICE_UNKNOWN), "unknown watch: %s", st.details);
    CHECK(watch_next(u, &st) == -1 && st.code == GRPC_STATUS_DEADLINE_EXCEEDED,
          "unknown watch must stay open: code %d %s", st.code, st.details);
    kc_stream_close(u);

    /* malformed requests: refused, and the server still answers */
    static const char garbage[] = "\xff\xff\xff\xff";
    static const char truncated[] = "\x0a\x05"
                                    "ab"; /* service: 5 bytes announced, 2 sent */
    ProtobufCMessage *resp = NULL;
    CHECK(kc_unary_bytes(ch, CHECK_PATH, garbage, 4, resp_desc, 5000, &resp, &st) == -1 &&
              st.code == GRPC_STATUS_INVALID_ARGUMENT,
          "garbage: code %d %s", st.code, st.details);
    CHECK(kc_unary_bytes(ch, CHECK_PATH, truncated, 4, resp_desc, 5000, &resp, &st) == -1 &&
              st.code == GRPC_STATUS_INVALID_ARGUMENT,
          "truncated: code %d %s", st.code, st.details);
    CHECK(check(ch, "", &st) == ST(SERVING), "serving after garbage: %s", st.details);

    /* shutdown with a watch open: the watch ends, the server's destroy returns */
    kc_server_destroy(srv);
    CHECK(watch_next(w[2], &st) == -1 && st.code != GRPC_STATUS_OK, "watch after shutdown: code %d",
          st.code);
    kc_stream_close(w[2]);
    kc_channel_destroy(ch);
    kc_health_free(h);
    kc_health_free(NULL);
    return kt_done("test_health");
}
