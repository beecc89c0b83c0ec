/*
 * test_rpc_tls.c - TLS in common/rpc.h (rpc-tls.c) over real gRPC on loopback, with certificates
 * from deploy/tls-certs.sh (a cluster CA and another CA): a server requiring client certificates
 * answers a client holding one from its CA, and refuses (UNAVAILABLE) a client without one, with
 * one from the other CA, trusting the other CA, and in plaintext, then still answers the good
 * client; with client_auth REQUEST a client without a certificate is let in, one from the other
 * CA is not; kc_tls_flags_finish and kc_server_create stop on unusable files with a message
 * naming the flag and the file (key of another certificate, certificate of another CA, missing
 * file, a node given --tls-client-auth, a router without --tls-ca, a bad --tls-client-auth).
 * Skips (77) without openssl. The whole cluster over TLS: tests/integration/tls.sh.
 * Run: ctest -R test_rpc_tls (about 1 s).
 */
#include "kr_test.h"

#include "rpc.h"

#include "grpc/health/v1/health.pb-c.h"

#include <grpc/grpc_security.h>
#include <unistd.h>

#define HEALTH_CHECK "/grpc.health.v1.Health/Check"

static char dir[] = "/tmp/kr-rpc-tls-XXXXXX";
static char path_buf[16][300];
static int n_paths;

/* dir/sub/name, kept for the test's life */
static const char *path(const char *sub, const char *name)
{
    char *p = path_buf[n_paths++ % 16];
    snprintf(p, sizeof path_buf[0], "%s/%s/%s", dir, sub, name);
    return p;
}

static int health_check(kc_call *call, const ProtobufCMessage *req, void *user)
{
    (void)req, (void)user;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    kc_call_send(call, &resp.base);
    return GRPC_STATUS_OK;
}

static kc_server *serve(kc_tls_client_auth auth, char *target, size_t cap)
{
    kc_tls_config tls = {.cert_file = path("a", "server.pem"), .key_file = path("a", "server.key"),
                         .ca_file = path("a", "ca.pem"), .client_auth = auth};
    kc_server_config cfg = {.tls = &tls};
    kc_server *srv;
    int port;
    kc_status st;
    REQUIRE(kc_server_create("127.0.0.1:0", &cfg, &srv, &port, &st) == 0, "%s", st.details);
    REQUIRE(kc_server_add_unary(srv, HEALTH_CHECK, &grpc__health__v1__health_check_request__descriptor,
                                health_check, NULL) == 0, "register");
    REQUIRE(kc_server_start(srv, &st) == 0, "%s", st.details);
    snprintf(target, cap, "127.0.0.1:%d", port);
    return srv;
}

/* One Health/Check over a channel with `tls` (NULL: plaintext): the call's status code. */
static grpc_status_code call_with(const char *target, const kc_tls_config *tls, kc_status *st)
{
    kc_channel_opts opts = {0};
    if (tls) {
        opts.creds = kc_tls_channel_credentials(tls, st);
        REQUIRE(opts.creds, "client credentials: %s", st->details);
    }
    kc_channel *ch;
    REQUIRE(kc_channel_create_opts(target, &opts, &ch, st) == 0, "%s", st->details);
    if (opts.creds)
        grpc_channel_credentials_release(opts.creds);
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_unary(ch, HEALTH_CHECK, &req.base, &grpc__health__v1__health_check_response__descriptor,
             5000, &resp, st);
    kc_message_free(resp);
    kc_channel_destroy(ch);
    return st->code;
}

static void test_require(void)
{
    char target[64];
    kc_server *srv = serve(KC_TLS_CLIENT_AUTH_REQUIRE, target, sizeof target);
    kc_tls_config good = {.ca_file = path("a", "ca.pem"), .cert_file = path("a", "client.pem"),
                          .key_file = path("a", "client.key")};
    kc_tls_config no_cert = {.ca_file = path("a", "ca.pem")};
    kc_tls_config other_cert = {.ca_file = path("a", "ca.pem"), .cert_file = path("b", "client.pem"),
                                .key_file = path("b", "client.key")};
    kc_tls_config other_ca = {.ca_file = path("b", "ca.pem"), .cert_file = path("a", "client.pem"),
                              .key_file = path("a", "client.key")};
    kc_status st;
    CHECK(call_with(target, &good, &st) == GRPC_STATUS_OK, "certificate from the CA: %s %s",
          kc_status_name(st.code), st.details);
    CHECK(call_with(target, &no_cert, &st) == GRPC_STATUS_UNAVAILABLE,
          "no client certificate: %s %s", kc_status_name(st.code), st.details);
    CHECK(call_with(target, &other_cert, &st) == GRPC_STATUS_UNAVAILABLE,
          "client certificate from another CA: %s %s", kc_status_name(st.code), st.details);
    CHECK(call_with(target, &other_ca, &st) == GRPC_STATUS_UNAVAILABLE,
          "client trusting another CA: %s %s", kc_status_name(st.code), st.details);
    CHECK(call_with(target, NULL, &st) == GRPC_STATUS_UNAVAILABLE, "plaintext client: %s %s",
          kc_status_name(st.code), st.details);
    CHECK(call_with(target, &good, &st) == GRPC_STATUS_OK, "served again after the refusals: %s",
          st.details);
    kc_server_destroy(srv);
}

static void test_request(void)
{
    char target[64];
    kc_server *srv = serve(KC_TLS_CLIENT_AUTH_REQUEST, target, sizeof target);
    kc_tls_config no_cert = {.ca_file = path("a", "ca.pem")};
    kc_tls_config other_cert = {.ca_file = path("a", "ca.pem"), .cert_file = path("b", "client.pem"),
                                .key_file = path("b", "client.key")};
    kc_status st;
    CHECK(call_with(target, &no_cert, &st) == GRPC_STATUS_OK,
          "request: no certificate is let in: %s %s", kc_status_name(st.code), st.details);
    CHECK(call_with(target, &other_cert, &st) == GRPC_STATUS_UNAVAILABLE,
          "request: a certificate from another CA is refused: %s", kc_status_name(st.code));
    kc_server_destroy(srv);
}

/* kc_tls_flags_finish for `role` on argv-like pairs must fail with `needle` in its message. */
static void finish_fails(kc_tls_role role, const char *const *argv, const char *needle)
{
    kc_tls_config c = {0};
    for (int i = 0; argv[i]; i += 2)
        REQUIRE(kc_tls_flag(&c, argv[i], argv[i + 1]) == 1, "flag %s", argv[i]);
    char err[256] = "";
    CHECK(kc_tls_flags_finish(&c, role, err) != 0, "accepted, wanted '%s'", needle);
    CHECK_ERR_HAS(err, needle);
}

static void test_flags(void)
{
    const char *ca = path("a", "ca.pem"), *cert = path("a", "server.pem"),
               *key = path("a", "server.key"), *other_key = path("b", "client.key"),
               *other_cert = path("b", "client.pem"), *missing = path("a", "nope.pem");
    finish_fails(KC_TLS_ROLE_NODE,
                 (const char *[]){"--tls-cert", cert, "--tls-key", other_key, "--tls-ca", ca, NULL},
                 "does not belong to the certificate in --tls-cert");
    finish_fails(KC_TLS_ROLE_NODE,
                 (const char *[]){"--tls-cert", other_cert, "--tls-key", other_key, "--tls-ca", ca,
                                  NULL},
                 "does not verify against --tls-ca");
    finish_fails(KC_TLS_ROLE_NODE,
                 (const char *[]){"--tls-cert", missing, "--tls-key", key, "--tls-ca", ca, NULL},
                 "--tls-cert");
    finish_fails(KC_TLS_ROLE_NODE,
                 (const char *[]){"--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
                                  "--tls-client-auth", "none", NULL},
                 "--tls-client-auth is for the router's public port");
    finish_fails(KC_TLS_ROLE_ROUTER, (const char *[]){"--tls-cert", cert, "--tls-key", key, NULL},
                 "(missing --tls-ca)");
    finish_fails(KC_TLS_ROLE_ROUTER,
                 (const char *[]){"--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
                                  "--tls-client-auth", "maybe", NULL},
                 "--tls-client-auth 'maybe'");
    finish_fails(KC_TLS_ROLE_CLIENT, (const char *[]){"--tls-key", key, NULL}, "--tls-key without");
    finish_fails(KC_TLS_ROLE_CLIENT, (const char *[]){"--tls-ca", ca, "--tls-cert", cert, NULL},
                 "--tls-key missing");
    /* a key file holding a certificate is no key */
    finish_fails(KC_TLS_ROLE_NODE,
                 (const char *[]){"--tls-cert", cert, "--tls-key", cert, "--tls-ca", ca, NULL},
                 "no unencrypted PEM private key");

    kc_tls_config ok = {0};
    const char *argv[] = {"--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
                          "--tls-client-auth", "require"};
    for (int i = 0; i < 8; i += 2)
        kc_tls_flag(&ok, argv[i], argv[i + 1]);
    CHECK(kc_tls_flag(&ok, "--tls-other", "x") == 0, "an unknown --tls- flag is not taken");
    char err[256] = "";
    CHECK(kc_tls_flags_finish(&ok, KC_TLS_ROLE_ROUTER, err) == 0 &&
              ok.client_auth == KC_TLS_CLIENT_AUTH_REQUIRE, "good router flags: %s", err);
    kc_tls_config off = {0};
    CHECK(kc_tls_flags_finish(&off, KC_TLS_ROLE_NODE, err) == 0 && !kc_tls_enabled(&off),
          "no flags: TLS off: %s", err);

    /* the server itself refuses an unusable pair, naming the flag */
    kc_tls_config bad = {.cert_file = cert, .key_file = other_key, .ca_file = ca};
    kc_server_config cfg = {.tls = &bad};
    kc_server *srv = NULL;
    int port;
    kc_status st;
    CHECK(kc_server_create("127.0.0.1:0", &cfg, &srv, &port, &st) != 0 &&
              st.code == GRPC_STATUS_INVALID_ARGUMENT, "server with a mismatched key refused");
    CHECK_ERR_HAS(st.details, "--tls-key");
}

int main(void)
{
    char script[400];
    const char *fixtures = kt_env("KR_FIXTURES");
    snprintf(script, sizeof script, "%s/../../deploy/tls-certs.sh", fixtures ? fixtures : "tests/fixtures");
    if (access("/usr/bin/openssl", X_OK) != 0 || access(script, X_OK) != 0) {
        fprintf(stderr, "test_rpc_tls: no openssl or %s: skipped\n", script);
        return KT_SKIP;
    }
    REQUIRE(mkdtemp(dir), "mkdtemp");
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "'%s' '%s/a' server client >/dev/null && '%s' '%s/b' client >/dev/null",
             script, dir, script, dir);
    REQUIRE(system(cmd) == 0, "making certificates failed: %s", cmd);
    grpc_init(); /* credentials are made before any channel */
    test_require();
    test_request();
    test_flags();
    grpc_shutdown();
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
    return kt_done("test_rpc_tls");
}
