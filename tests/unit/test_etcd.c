/*
 * test_etcd.c - the etcd client (common/etcd.h) against a real etcd started here: KV put, range
 * (key, prefix, old revision), delete, create-if-absent; leases (keep-alive holds a key past its
 * TTL, expiry deletes it, revoke deletes at once); watch (put, delete with prev_kv, compaction);
 * a dead endpoint first in the list; etcd killed (calls and watches fail with UNAVAILABLE) and
 * restarted on the same data (calls work again). Bad endpoints and TLS files are refused.
 * Skipped (77) without /usr/bin/etcd. Run: ctest -R test_etcd.
 */
#include "etcd.h"
#include "etcd_proc.h"
#include "kr_test.h"

#include <pthread.h>

static test_etcd g_etcd;

static test_etcd g_tls;

static void cleanup(void)
{
    test_etcd_cleanup(&g_etcd);
    test_etcd_cleanup(&g_tls);
}

/* Waits up to timeout_s for the value of `key` to be present (want 1) or absent (want 0). */
static int wait_key(kc_etcd *c, const char *key, int want, double timeout_s)
{
    double t0 = test_now();
    while (test_now() - t0 < timeout_s) {
        kc_etcd_range_result r;
        kc_status st;
        if (kc_etcd_range(c, key, 0, 0, &r, &st) == 0) {
            int have = r.n > 0;
            kc_etcd_range_free(&r);
            if (have == want)
                return 1;
        }
        usleep(100000);
    }
    return 0;
}

static void test_bad_config(void)
{
    kc_etcd *c = NULL;
    kc_status st;
    kc_etcd_config cfg = {.endpoints = "127.0.0.1:2379,nohost"};
    CHECK(kc_etcd_create(&cfg, &c, &st) != 0, "a bad endpoint was accepted");
    CHECK(st.code == GRPC_STATUS_INVALID_ARGUMENT, "code %d", st.code);
    CHECK_ERR_HAS(st.details, "'nohost'");
    cfg.endpoints = "";
    CHECK(kc_etcd_create(&cfg, &c, &st) != 0, "no endpoints accepted");
    cfg.endpoints = "127.0.0.1:2379";
    cfg.ca_file = "/nonexistent/ca.pem";
    CHECK(kc_etcd_create(&cfg, &c, &st) != 0, "a missing CA file was accepted");
    CHECK_ERR_HAS(st.details, "/nonexistent/ca.pem");
    cfg.ca_file = NULL;
    cfg.user = "root";
    CHECK(kc_etcd_create(&cfg, &c, &st) != 0, "a user without a password was accepted");
    CHECK_ERR_HAS(st.details, "password");
}

static void test_kv(kc_etcd *c)
{
    kc_status st;
    int64_t rev1 = 0, rev2 = 0;
    REQUIRE(kc_etcd_put(c, "/t/k", "one", 3, 0, &rev1, &st) == 0, "put: %s", st.details);
    REQUIRE(kc_etcd_put(c, "/t/k", "two", 3, 0, &rev2, &st) == 0, "put: %s", st.details);
    CHECK(rev2 > rev1 && rev1 > 0, "revisions %lld %lld", (long long)rev1, (long long)rev2);
    kc_etcd_range_result r;
    REQUIRE(kc_etcd_range(c, "/t/k", 0, 0, &r, &st) == 0, "range: %s", st.details);
    CHECK(r.n == 1 && strcmp(r.kvs[0].value, "two") == 0, "n %zu", r.n);
    CHECK(r.n == 1 && r.kvs[0].mod_revision == rev2 && r.kvs[0].version == 2, "kv revisions");
    CHECK(r.revision >= rev2, "header revision %lld", (long long)r.revision);
    kc_etcd_range_free(&r);
    REQUIRE(kc_etcd_range(c, "/t/k", 0, rev1, &r, &st) == 0, "range at rev: %s", st.details);
    CHECK(r.n == 1 && strcmp(r.kvs[0].value, "one") == 0, "old revision's value");
    kc_etcd_range_free(&r);

    /* prefix: /t/p/ holds a and b, not /t/pz or /t/q */
    kc_etcd_put(c, "/t/p/a", "A", 1, 0, NULL, &st);
    kc_etcd_put(c, "/t/p/b", "B", 1, 0, NULL, &st);
    kc_etcd_put(c, "/t/pz", "Z", 1, 0, NULL, &st);
    REQUIRE(kc_etcd_range(c, "/t/p/", 1, 0, &r, &st) == 0, "prefix range: %s", st.details);
    CHECK(r.n == 2 && r.count == 2, "prefix n %zu count %lld", r.n, (long long)r.count);
    CHECK(r.n == 2 && strcmp(r.kvs[0].key, "/t/p/a") == 0 && strcmp(r.kvs[1].key, "/t/p/b") == 0,
          "prefix keys");
    kc_etcd_range_free(&r);

    int64_t deleted = -1;
    REQUIRE(kc_etcd_delete(c, "/t/p/a", 0, &deleted, &st) == 0, "delete: %s", st.details);
    CHECK(deleted == 1, "deleted %lld", (long long)deleted);
    REQUIRE(kc_etcd_delete(c, "/t/p/", 1, &deleted, &st) == 0, "delete prefix: %s", st.details);
    CHECK(deleted == 1, "deleted under prefix %lld", (long long)deleted);
    REQUIRE(kc_etcd_range(c, "/t/p", 1, 0, &r, &st) == 0, "range: %s", st.details);
    CHECK(r.n == 1 && strcmp(r.kvs[0].key, "/t/pz") == 0, "left: %zu", r.n);
    kc_etcd_range_free(&r);

    int created = -1;
    REQUIRE(kc_etcd_create_if_absent(c, "/t/once", "first", 5, 0, &created, NULL, &st) == 0,
            "txn: %s", st.details);
    CHECK(created == 1, "first create-if-absent did not create");
    REQUIRE(kc_etcd_create_if_absent(c, "/t/once", "second", 6, 0, &created, NULL, &st) == 0,
            "txn: %s", st.details);
    CHECK(created == 0, "second create-if-absent created");
    REQUIRE(kc_etcd_range(c, "/t/once", 0, 0, &r, &st) == 0, "range: %s", st.details);
    CHECK(r.n == 1 && strcmp(r.kvs[0].value, "first") == 0, "create-if-absent overwrote");
    kc_etcd_range_free(&r);
}

static void test_leases(kc_etcd *c)
{
    kc_status st;
    int64_t id = 0, granted = 0, ttl = 0;
    REQUIRE(kc_etcd_lease_grant(c, 2, &id, &granted, &st) == 0, "grant: %s", st.details);
    CHECK(id != 0 && granted == 2, "lease %lld ttl %lld", (long long)id, (long long)granted);
    REQUIRE(kc_etcd_put(c, "/t/leased", "x", 1, id, NULL, &st) == 0, "put: %s", st.details);
    /* keep-alives every 0.5 s hold the key well past its 2 s TTL */
    double t0 = test_now();
    while (test_now() - t0 < 4.5) {
        CHECK(kc_etcd_keepalive(c, id, &ttl, &st) == 0 && ttl == 2, "keepalive: %s ttl %lld",
              st.details, (long long)ttl);
        usleep(500000);
    }
    CHECK(wait_key(c, "/t/leased", 1, 0.5), "the key died although kept alive");
    CHECK(kc_etcd_lease_ttl(c, id, &ttl, &st) == 0 && ttl > 0, "ttl %lld", (long long)ttl);
    /* no more keep-alives: the lease expires and takes the key */
    CHECK(wait_key(c, "/t/leased", 0, 10), "the key outlived its lease");
    CHECK(kc_etcd_lease_ttl(c, id, &ttl, &st) == 0 && ttl == -1, "expired ttl %lld",
          (long long)ttl);
    CHECK(kc_etcd_keepalive(c, id, &ttl, &st) == 0 && ttl == 0, "keepalive of an expired lease: "
          "%s ttl %lld", st.details, (long long)ttl);
    CHECK(kc_etcd_put(c, "/t/leased", "x", 1, id, NULL, &st) != 0 &&
              st.code == GRPC_STATUS_NOT_FOUND,
          "put with an expired lease: code %d %s", st.code, st.details);

    /* revoke deletes at once */
    REQUIRE(kc_etcd_lease_grant(c, 30, &id, NULL, &st) == 0, "grant: %s", st.details);
    REQUIRE(kc_etcd_put(c, "/t/revoked", "x", 1, id, NULL, &st) == 0, "put: %s", st.details);
    REQUIRE(kc_etcd_lease_revoke(c, id, 1000, &st) == 0, "revoke: %s", st.details);
    kc_etcd_range_result r;
    REQUIRE(kc_etcd_range(c, "/t/revoked", 0, 0, &r, &st) == 0, "range: %s", st.details);
    CHECK(r.n == 0, "a revoked lease's key is still there");
    kc_etcd_range_free(&r);
    CHECK(kc_etcd_lease_revoke(c, id, 1000, &st) != 0 && st.code == GRPC_STATUS_NOT_FOUND,
          "second revoke: code %d", st.code);
}

static void test_watch(kc_etcd *c)
{
    kc_status st;
    kc_etcd_watch *w = NULL;
    REQUIRE(kc_etcd_watch_open(c, "/t/w/", 1, 0, 1, &w, &st) == 0, "watch: %s", st.details);
    kc_etcd_put(c, "/t/w/a", "v1", 2, 0, NULL, &st);
    kc_etcd_put(c, "/t/wz", "outside", 7, 0, NULL, &st);
    kc_etcd_delete(c, "/t/w/a", 0, NULL, &st);
    kc_etcd_watch_batch b;
    int seen_put = 0, seen_del = 0;
    while (!(seen_put && seen_del) && kc_etcd_watch_next(w, &b, &st) == 1) {
        for (size_t i = 0; i < b.n; i++) {
            const kc_etcd_event *e = &b.events[i];
            CHECK(strcmp(e->kv.key, "/t/w/a") == 0, "event on %s", e->kv.key);
            if (e->type == KC_ETCD_EVENT_PUT) {
                CHECK(strcmp(e->kv.value, "v1") == 0, "put value %s", e->kv.value);
                seen_put = 1;
            } else {
                CHECK(e->has_prev && strcmp(e->prev_kv.value, "v1") == 0, "delete's prev_kv");
                seen_del = 1;
            }
        }
        kc_etcd_watch_batch_free(&b);
    }
    CHECK(seen_put && seen_del, "watch saw put %d delete %d (%s)", seen_put, seen_del, st.details);
    kc_etcd_watch_close(w);
}

/* Compaction (needs etcdctl to compact): a watch from a compacted revision says so. */
static void test_compaction(kc_etcd *c)
{
    if (access(TEST_ETCDCTL_BIN, X_OK) != 0) {
        fprintf(stderr, "no %s: compaction not tested\n", TEST_ETCDCTL_BIN);
        return;
    }
    kc_status st;
    int64_t rev = 0;
    kc_etcd_put(c, "/t/c/a", "1", 1, 0, NULL, &st);
    REQUIRE(kc_etcd_put(c, "/t/c/a", "2", 1, 0, &rev, &st) == 0, "put: %s", st.details);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "%s --endpoints=%s compact %lld >/dev/null", TEST_ETCDCTL_BIN,
             g_etcd.endpoint, (long long)rev);
    REQUIRE(system(cmd) == 0, "%s failed", cmd);
    kc_etcd_watch *w = NULL;
    REQUIRE(kc_etcd_watch_open(c, "/t/c/", 1, rev - 1, 0, &w, &st) == 0, "watch: %s", st.details);
    kc_etcd_watch_batch b;
    CHECK(kc_etcd_watch_next(w, &b, &st) == 1 && b.compact_revision == rev,
          "compaction not reported: %s", st.details);
    kc_etcd_watch_batch_free(&b);
    kc_etcd_watch_close(w);
}

typedef struct {
    kc_etcd_watch *w;
    int rc;
    kc_status st;
    double ended;
} watch_wait;

static void *watch_thread(void *arg)
{
    watch_wait *ww = arg;
    kc_etcd_watch_batch b;
    while ((ww->rc = kc_etcd_watch_next(ww->w, &b, &ww->st)) == 1)
        kc_etcd_watch_batch_free(&b);
    ww->ended = test_now();
    return NULL;
}

static void test_etcd_death(kc_etcd *c)
{
    kc_status st;
    int64_t lease = 0, ttl = 0;
    REQUIRE(kc_etcd_lease_grant(c, 30, &lease, NULL, &st) == 0, "grant: %s", st.details);
    REQUIRE(kc_etcd_keepalive(c, lease, &ttl, &st) == 0, "keepalive: %s", st.details);
    REQUIRE(kc_etcd_put(c, "/t/durable", "kept", 4, 0, NULL, &st) == 0, "put: %s", st.details);
    watch_wait ww = {0};
    REQUIRE(kc_etcd_watch_open(c, "/t/", 1, 0, 0, &ww.w, &st) == 0, "watch: %s", st.details);
    pthread_t th;
    pthread_create(&th, NULL, watch_thread, &ww);

    double killed = test_now();
    test_etcd_kill(&g_etcd, SIGKILL);
    pthread_join(th, NULL);
    CHECK(ww.rc == -1 && ww.st.code == GRPC_STATUS_UNAVAILABLE, "watch ended with %d %s",
          ww.st.code, ww.st.details);
    printf("etcd killed -> watch ended after %.2f s: %s\n", ww.ended - killed, ww.st.details);
    kc_etcd_watch_close(ww.w);

    double t0 = test_now();
    CHECK(kc_etcd_put(c, "/t/x", "x", 1, 0, NULL, &st) != 0 && st.code == GRPC_STATUS_UNAVAILABLE,
          "put with etcd dead: %d %s", st.code, st.details);
    printf("put with etcd dead failed after %.2f s: %s\n", test_now() - t0, st.details);
    CHECK(strstr(st.details, g_etcd.endpoint) != NULL, "error names no endpoint: %s", st.details);
    CHECK(kc_etcd_keepalive(c, lease, &ttl, &st) != 0, "keepalive with etcd dead succeeded");
    kc_etcd_watch *w2 = NULL;
    CHECK(kc_etcd_watch_open(c, "/t/", 1, 0, 0, &w2, &st) != 0, "watch opened with etcd dead");

    REQUIRE(test_etcd_start(&g_etcd) == 0, "etcd did not restart");
    t0 = test_now();
    int ok = 0;
    while (!ok && test_now() - t0 < 15) {
        ok = kc_etcd_put(c, "/t/after", "y", 1, 0, NULL, &st) == 0;
        if (!ok)
            kc_etcd_wait_ready(c, 250); /* as retry loops do: gRPC connects while we wait */
    }
    CHECK(ok, "no put within 15 s of etcd's restart: %s", st.details);
    printf("etcd restarted -> first put after %.2f s\n", test_now() - t0);
    CHECK(wait_key(c, "/t/durable", 1, 1), "data lost over the restart");
    CHECK(kc_etcd_keepalive(c, lease, &ttl, &st) == 0 && ttl > 0,
          "keepalive after the restart: %s ttl %lld", st.details, (long long)ttl);
    REQUIRE(kc_etcd_watch_open(c, "/t/", 1, 0, 0, &w2, &st) == 0, "watch after restart: %s",
            st.details);
    kc_etcd_watch_close(w2);
}

/* Auth (needs etcdctl to enable it): a client with user/password works, including after etcd's
 * restart invalidated its token (it authenticates again); a wrong password or no user fails. */
static void test_auth(void)
{
    if (access(TEST_ETCDCTL_BIN, X_OK) != 0) {
        fprintf(stderr, "no %s: auth not tested\n", TEST_ETCDCTL_BIN);
        return;
    }
    char cmd[512];
    snprintf(cmd, sizeof cmd,
             "%s --endpoints=%s user add root:rootpw >/dev/null && "
             "%s --endpoints=%s auth enable >/dev/null",
             TEST_ETCDCTL_BIN, g_etcd.endpoint, TEST_ETCDCTL_BIN, g_etcd.endpoint);
    REQUIRE(system(cmd) == 0, "%s failed", cmd);
    kc_status st;
    kc_etcd *c = NULL;
    kc_etcd_config cfg = {.endpoints = g_etcd.endpoint, .user = "root", .password = "rootpw"};
    REQUIRE(kc_etcd_create(&cfg, &c, &st) == 0, "create: %s", st.details);
    CHECK(kc_etcd_put(c, "/t/auth", "a", 1, 0, NULL, &st) == 0, "put with auth: %s", st.details);
    kc_etcd_watch *w = NULL;
    CHECK(kc_etcd_watch_open(c, "/t/auth", 0, 0, 0, &w, &st) == 0, "watch with auth: %s",
          st.details);
    kc_etcd_watch_close(w);

    kc_etcd *bad = NULL;
    kc_etcd_config badcfg = {.endpoints = g_etcd.endpoint, .user = "root", .password = "wrong"};
    REQUIRE(kc_etcd_create(&badcfg, &bad, &st) == 0, "create: %s", st.details);
    CHECK(kc_etcd_put(bad, "/t/auth", "b", 1, 0, NULL, &st) != 0, "put with a wrong password");
    CHECK_ERR_HAS(st.details, "Authenticate");
    printf("wrong password: %s\n", st.details);
    kc_etcd_destroy(bad);
    kc_etcd_config none = {.endpoints = g_etcd.endpoint};
    REQUIRE(kc_etcd_create(&none, &bad, &st) == 0, "create: %s", st.details);
    CHECK(kc_etcd_put(bad, "/t/auth", "b", 1, 0, NULL, &st) != 0, "put without a user");
    printf("no user: %s\n", st.details);
    kc_etcd_destroy(bad);

    /* etcd's simple tokens do not survive a restart: the client must authenticate again */
    test_etcd_kill(&g_etcd, SIGKILL);
    REQUIRE(test_etcd_start(&g_etcd) == 0, "etcd did not restart");
    int ok = 0;
    double t0 = test_now();
    while (!ok && test_now() - t0 < 15) {
        ok = kc_etcd_put(c, "/t/auth", "c", 1, 0, NULL, &st) == 0;
        if (!ok)
            kc_etcd_wait_ready(c, 250);
    }
    CHECK(ok, "put with auth after a restart: %s", st.details);
    /* auth disabled and enabled again drops every token: the next call must re-authenticate */
    snprintf(cmd, sizeof cmd,
             "%s --endpoints=%s --user root:rootpw auth disable >/dev/null && "
             "%s --endpoints=%s auth enable >/dev/null",
             TEST_ETCDCTL_BIN, g_etcd.endpoint, TEST_ETCDCTL_BIN, g_etcd.endpoint);
    REQUIRE(system(cmd) == 0, "%s failed", cmd);
    CHECK(kc_etcd_put(c, "/t/auth", "d", 1, 0, NULL, &st) == 0, "put after the token was dropped: "
          "%s", st.details);
    kc_etcd_destroy(c);
}

/* TLS (needs openssl to make a CA and a server certificate for 127.0.0.1): a client with the CA
 * works over https; one without TLS cannot talk to it. */
static void test_tls(void)
{
    if (access("/usr/bin/openssl", X_OK) != 0) {
        fprintf(stderr, "no openssl: TLS not tested\n");
        return;
    }
    char dir[] = "/tmp/kr-etcd-tls-XXXXXX";
    REQUIRE(mkdtemp(dir), "mkdtemp");
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
             "-subj /CN=kr-test-ca && openssl req -newkey rsa:2048 -nodes -keyout server.key "
             "-out server.csr -subj /CN=127.0.0.1 && printf 'subjectAltName=IP:127.0.0.1\\n' > "
             "ext.cnf && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key "
             "-CAcreateserial -out server.pem -days 1 -extfile ext.cnf",
             dir);
    char quiet[2100];
    snprintf(quiet, sizeof quiet, "(%s) >/dev/null 2>&1", cmd);
    REQUIRE(system(quiet) == 0, "making certificates failed: %s", cmd);
    char cert[128], key[128], ca[128];
    snprintf(cert, sizeof cert, "%s/server.pem", dir);
    snprintf(key, sizeof key, "%s/server.key", dir);
    snprintf(ca, sizeof ca, "%s/ca.pem", dir);
    g_tls.tls_cert = cert;
    g_tls.tls_key = key;
    REQUIRE(test_etcd_start(&g_tls) == 0, "etcd with TLS did not start");
    char ep[96];
    snprintf(ep, sizeof ep, "https://%s", g_tls.endpoint);
    kc_etcd_config cfg = {.endpoints = ep, .ca_file = ca};
    kc_etcd *c = NULL;
    kc_status st;
    REQUIRE(kc_etcd_create(&cfg, &c, &st) == 0, "create: %s", st.details);
    int ok = 0;
    double t0 = test_now();
    while (!ok && test_now() - t0 < 20) { /* readiness was only "the port accepts" */
        ok = kc_etcd_put(c, "/t/tls", "s", 1, 0, NULL, &st) == 0;
        if (!ok)
            kc_etcd_wait_ready(c, 250);
    }
    CHECK(ok, "put over TLS: %s", st.details);
    kc_etcd_range_result r;
    CHECK(kc_etcd_range(c, "/t/tls", 0, 0, &r, &st) == 0 && r.n == 1, "range over TLS: %s",
          st.details);
    if (ok)
        kc_etcd_range_free(&r);
    kc_etcd_destroy(c);
    kc_etcd_config plain = {.endpoints = g_tls.endpoint, .timeout_ms = 2000};
    REQUIRE(kc_etcd_create(&plain, &c, &st) == 0, "create: %s", st.details);
    CHECK(kc_etcd_put(c, "/t/tls", "p", 1, 0, NULL, &st) != 0, "plaintext put to a TLS etcd");
    printf("plaintext client to a TLS etcd: %s\n", st.details);
    kc_etcd_destroy(c);
    test_etcd_cleanup(&g_tls);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int main(void)
{
    test_bad_config();
    if (access(TEST_ETCD_BIN, X_OK) != 0) {
        fprintf(stderr, "test_etcd: %s not installed (Debian etcd-server): skipped\n",
                TEST_ETCD_BIN);
        return KT_SKIP;
    }
    atexit(cleanup);
    REQUIRE(test_etcd_start(&g_etcd) == 0, "etcd did not start");
    /* a dead endpoint first: every call must move on to the live one */
    char endpoints[160];
    snprintf(endpoints, sizeof endpoints, "http://127.0.0.1:%d, http://%s", test_free_port(),
             g_etcd.endpoint);
    printf("etcd at %s; client endpoints \"%s\"\n", g_etcd.endpoint, endpoints);
    kc_etcd_config cfg = {.endpoints = endpoints, .timeout_ms = 3000};
    kc_etcd *c = NULL;
    kc_status st;
    REQUIRE(kc_etcd_create(&cfg, &c, &st) == 0, "create: %s", st.details);
    test_kv(c);
    CHECK(strcmp(kc_etcd_endpoint(c), g_etcd.endpoint) == 0, "current endpoint %s",
          kc_etcd_endpoint(c));
    test_leases(c);
    test_watch(c);
    test_compaction(c);
    test_etcd_death(c);
    kc_etcd_destroy(c);
    test_auth();
    test_tls();
    return kt_done("test_etcd");
}
