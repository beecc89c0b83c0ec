/*
 * test_membership.c - membership.h against a real etcd started here: the member JSON (round trip,
 * unknown fields, missing and bad fields); a registration appears as JSON (read with kc_etcd and,
 * when installed, `etcdctl get --prefix`), an update changes its state, stop removes it at once,
 * an abandoned one (no keep-alives, no revoke) disappears after its TTL, a lost lease is
 * re-registered; a watcher follows all of it; etcd killed for a few seconds and restarted on the
 * same data: the watcher keeps its last set meanwhile, then registration and watch work again
 * without restarting anything. Waits are for conditions, with generous timeouts; the times
 * printed are measurements, not assertions. Skipped (77) without /usr/bin/etcd.
 * Run: ctest -R test_membership.
 */
#include "etcd_proc.h"
#include "kr_test.h"
#include "log.h"
#include "membership.h"

#include <pthread.h>

static test_etcd g_etcd;

static void cleanup(void)
{
    test_etcd_cleanup(&g_etcd);
}

/* ------------------------------------------------------------------ JSON */

static kc_member member(const char *role, const char *id, int port)
{
    kc_member m;
    memset(&m, 0, sizeof m);
    snprintf(m.id, sizeof m.id, "%s", id);
    snprintf(m.role, sizeof m.role, "%s", role);
    snprintf(m.state, sizeof m.state, "serving");
    snprintf(m.grpc, sizeof m.grpc, "127.0.0.1:%d", port);
    snprintf(m.transfer, sizeof m.transfer, "127.0.0.1:%d", port + 1000);
    snprintf(m.fingerprint, sizeof m.fingerprint, "0123456789abcdef");
    m.kv_capacity = 4096;
    snprintf(m.version, sizeof m.version, "0.5.0");
    m.start_unix_ms = 1795000000123;
    return m;
}

static void test_json(void)
{
    char err[KC_MEMBER_ERR_LEN];
    kc_member m = member("decode", "decode-0", 7201), back;
    char *json = kc_member_to_json(&m);
    REQUIRE(json, "to_json");
    CHECK(kc_member_from_json(json, strlen(json), &back, err) == 0, "from_json: %s", err);
    CHECK(memcmp(&m, &back, sizeof m) == 0, "round trip differs: %s", json);
    free(json);

    const char *extra = "{\"id\":\"p\",\"role\":\"prefill\",\"state\":\"draining\",\"grpc\":\"h:1\","
                        "\"future_field\":[1,2],\"kv_capacity\":7}";
    CHECK(kc_member_from_json(extra, strlen(extra), &back, err) == 0, "unknown field: %s", err);
    CHECK(back.kv_capacity == 7 && strcmp(back.state, "draining") == 0 && back.transfer[0] == 0,
          "parsed fields");

    static const struct {
        const char *json, *needle;
    } bad[] = {
        {"{\"id\":\"p\",\"role\":\"prefill\",\"state\":\"serving\"}", "\"grpc\""},
        {"{\"role\":\"prefill\",\"state\":\"serving\",\"grpc\":\"h:1\"}", "\"id\""},
        {"{\"id\":\"p\",\"role\":\"router\",\"state\":\"serving\",\"grpc\":\"h:1\"}", "router"},
        {"{\"id\":\"p\",\"role\":\"prefill\",\"state\":\"gone\",\"grpc\":\"h:1\"}", "gone"},
        {"{\"id\":\"a/b\",\"role\":\"prefill\",\"state\":\"serving\",\"grpc\":\"h:1\"}", "a/b"},
        {"{\"id\":7,\"role\":\"prefill\",\"state\":\"serving\",\"grpc\":\"h:1\"}", "\"id\""},
        {"{\"id\":\"p\",\"role\":\"prefill\",\"state\":\"serving\",\"grpc\":\"h:1\","
         "\"kv_capacity\":-1}", "kv_capacity"},
        {"{\"id\":\"p\",\"role\":\"prefill\",\"state\":\"serving\",\"grpc\":\"h:1\","
         "\"fingerprint\":\"0123456789abcdef0\"}", "fingerprint"},
        {"[1,2]", "not a JSON object"},
        {"{\"id\":", "not a JSON object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        CHECK(kc_member_from_json(bad[i].json, strlen(bad[i].json), &back, err) != 0,
              "accepted %s", bad[i].json);
        CHECK_ERR_HAS(err, bad[i].needle);
    }

    char key[256];
    CHECK(kc_member_key("prod", &m, key, sizeof key) == 0 &&
              strcmp(key, "/kvrelay/prod/nodes/decode/decode-0") == 0, "key %s", key);
    kc_registration *r = NULL;
    CHECK(kc_register_start("127.0.0.1:1", "bad/cluster", &m, 10, &r, err) != 0,
          "a cluster with a slash accepted");
    CHECK_ERR_HAS(err, "bad/cluster");
    CHECK(kc_register_start("127.0.0.1:1", "c", &m, 1, &r, err) != 0, "ttl 1 accepted");
    CHECK(kc_register_start("nohost", "c", &m, 10, &r, err) != 0, "bad endpoint accepted");
    CHECK_ERR_HAS(err, "nohost");
}

/* ------------------------------------------------------------------ the watcher's view */

typedef struct {
    pthread_mutex_t mu;
    kc_member set[16];
    int n;
    int calls;
} view;

static void on_members(void *user, const kc_member *members, int n)
{
    view *v = user;
    pthread_mutex_lock(&v->mu);
    v->n = n < 16 ? n : 16;
    if (v->n)
        memcpy(v->set, members, (size_t)v->n * sizeof *members);
    v->calls++;
    pthread_mutex_unlock(&v->mu);
}

/* "" when id is absent from the view, else its state */
static void view_state(view *v, const char *id, char *state, int *n)
{
    pthread_mutex_lock(&v->mu);
    state[0] = 0;
    for (int i = 0; i < v->n; i++)
        if (strcmp(v->set[i].id, id) == 0)
            snprintf(state, 16, "%s", v->set[i].state);
    *n = v->n;
    pthread_mutex_unlock(&v->mu);
}

/* Waits up to timeout_s for the view to hold id in `state` ("" = absent); returns seconds
 * waited, or -1. */
static double wait_view(view *v, const char *id, const char *state, double timeout_s)
{
    double t0 = test_now();
    while (test_now() - t0 < timeout_s) {
        char s[16];
        int n;
        view_state(v, id, s, &n);
        if (strcmp(s, state) == 0)
            return test_now() - t0;
        usleep(20000);
    }
    return -1;
}

/* The member stored at `key` (1), none (0), or etcd failed (-1). */
static int stored(kc_etcd *c, const char *key, kc_member *m, int64_t *lease)
{
    kc_etcd_range_result r;
    kc_status st;
    char err[KC_MEMBER_ERR_LEN];
    if (kc_etcd_range(c, key, 0, 0, &r, &st) != 0)
        return -1;
    int have = r.n == 1;
    if (have) {
        CHECK(kc_member_from_json(r.kvs[0].value, r.kvs[0].value_len, m, err) == 0,
              "stored value is not a member: %s (%s)", r.kvs[0].value, err);
        if (lease)
            *lease = r.kvs[0].lease;
    }
    kc_etcd_range_free(&r);
    return have;
}

static double wait_stored(kc_etcd *c, const char *key, int want, double timeout_s)
{
    double t0 = test_now();
    kc_member m;
    while (test_now() - t0 < timeout_s) {
        if (stored(c, key, &m, NULL) == want)
            return test_now() - t0;
        usleep(20000);
    }
    return -1;
}

static void check_etcdctl(const char *id)
{
    if (access(TEST_ETCDCTL_BIN, X_OK) != 0) {
        fprintf(stderr, "no %s: etcdctl view not checked\n", TEST_ETCDCTL_BIN);
        return;
    }
    char cmd[256], out[4096] = "";
    snprintf(cmd, sizeof cmd, "ETCDCTL_API=3 %s --endpoints=%s get --prefix /kvrelay/t/",
             TEST_ETCDCTL_BIN, g_etcd.endpoint);
    FILE *p = popen(cmd, "r");
    REQUIRE(p, "popen");
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    pclose(p);
    char want[160];
    snprintf(want, sizeof want, "\"id\":\"%s\"", id);
    CHECK(strstr(out, "/kvrelay/t/nodes/decode/decode-0") && strstr(out, want),
          "etcdctl get --prefix shows:\n%s", out);
    printf("etcdctl get --prefix /kvrelay/t/:\n%s", out);
}

int main(void)
{
    kc_log_init("test_membership", KC_LOG_INFO);
    test_json();
    if (access(TEST_ETCD_BIN, X_OK) != 0) {
        fprintf(stderr, "test_membership: %s not installed (Debian etcd-server): skipped\n",
                TEST_ETCD_BIN);
        return KT_SKIP;
    }
    atexit(cleanup);
    REQUIRE(test_etcd_start(&g_etcd) == 0, "etcd did not start");
    char err[KC_MEMBER_ERR_LEN];
    kc_etcd_config cfg = {.endpoints = g_etcd.endpoint};
    kc_etcd *c = NULL;
    kc_status st;
    REQUIRE(kc_etcd_create(&cfg, &c, &st) == 0, "etcd client: %s", st.details);

    view v = {.mu = PTHREAD_MUTEX_INITIALIZER};
    kc_watch *w = NULL;
    REQUIRE(kc_watch_start(g_etcd.endpoint, "t", on_members, &v, &w, err) == 0, "watch: %s", err);

    /* a registration appears as JSON, in etcd and in the watcher's set */
    const int ttl = 2;
    kc_member d0 = member("decode", "decode-0", 7201);
    kc_registration *rd0 = NULL;
    REQUIRE(kc_register_start(g_etcd.endpoint, "t", &d0, ttl, &rd0, err) == 0, "register: %s",
            err);
    const char *kd0 = "/kvrelay/t/nodes/decode/decode-0";
    CHECK(wait_stored(c, kd0, 1, 10) >= 0, "decode-0 never registered");
    kc_member got;
    CHECK(stored(c, kd0, &got, NULL) == 1 && memcmp(&got, &d0, sizeof got) == 0,
          "stored member differs");
    check_etcdctl("decode-0");
    CHECK(wait_view(&v, "decode-0", "serving", 10) >= 0, "watcher never saw decode-0");

    /* update: state -> draining, in etcd and in the watcher */
    kc_member d0d = d0;
    snprintf(d0d.state, sizeof d0d.state, "draining");
    CHECK(kc_register_update(rd0, &d0d) == 0, "update failed");
    CHECK(stored(c, kd0, &got, NULL) == 1 && strcmp(got.state, "draining") == 0,
          "update not stored at once");
    CHECK(wait_view(&v, "decode-0", "draining", 10) >= 0, "watcher never saw draining");
    kc_member other = member("prefill", "decode-0", 1);
    CHECK(kc_register_update(rd0, &other) != 0, "an update changing the role was accepted");

    /* stop revokes: the key is gone when stop returns */
    kc_member p0 = member("prefill", "prefill-0", 7101);
    kc_registration *rp0 = NULL;
    REQUIRE(kc_register_start(g_etcd.endpoint, "t", &p0, ttl, &rp0, err) == 0, "register: %s",
            err);
    const char *kp0 = "/kvrelay/t/nodes/prefill/prefill-0";
    CHECK(wait_view(&v, "prefill-0", "serving", 10) >= 0, "watcher never saw prefill-0");
    kc_register_stop(rp0);
    CHECK(stored(c, kp0, &got, NULL) == 0, "prefill-0 still stored after stop");
    double t = wait_view(&v, "prefill-0", "", 10);
    CHECK(t >= 0, "watcher still has prefill-0");
    printf("stop -> watcher dropped the member after %.3f s\n", t);

    /* abandoned (a killed process): gone after the TTL, from etcd and from the watcher */
    kc_member d1 = member("decode", "decode-1", 7202);
    kc_registration *rd1 = NULL;
    REQUIRE(kc_register_start(g_etcd.endpoint, "t", &d1, ttl, &rd1, err) == 0, "register: %s",
            err);
    CHECK(wait_view(&v, "decode-1", "serving", 10) >= 0, "watcher never saw decode-1");
    double t_abandon = test_now();
    kc_register_abandon(rd1);
    CHECK(stored(c, "/kvrelay/t/nodes/decode/decode-1", &got, NULL) == 1,
          "an abandoned registration was removed at once (revoked?)");
    t = wait_view(&v, "decode-1", "", 15);
    CHECK(t >= 0, "an abandoned registration never expired");
    printf("abandoned (ttl %d s) -> watcher dropped it after %.2f s\n", ttl, test_now() - t_abandon);

    /* lease lost (revoked behind the node's back): the node registers again */
    int64_t lease = 0;
    REQUIRE(stored(c, kd0, &got, &lease) == 1 && lease != 0, "decode-0's lease");
    REQUIRE(kc_etcd_lease_revoke(c, lease, 1000, &st) == 0, "revoke: %s", st.details);
    double t_lost = test_now();
    CHECK(wait_stored(c, kd0, 0, 1) >= 0, "revoked key still there");
    t = wait_stored(c, kd0, 1, 15);
    CHECK(t >= 0, "decode-0 not re-registered after its lease was lost");
    printf("lease lost -> re-registered after %.2f s\n", test_now() - t_lost);
    int64_t lease2 = 0;
    CHECK(stored(c, kd0, &got, &lease2) == 1 && lease2 != lease && strcmp(got.state, "draining") == 0,
          "re-registration: lease %llx (old %llx), state %s", (unsigned long long)lease2,
          (unsigned long long)lease, got.state);
    CHECK(wait_view(&v, "decode-0", "draining", 10) >= 0, "watcher lost decode-0");

    /* etcd down for a few seconds: the watcher keeps its set; after the restart registrations
     * and the watch work again without restarting anything */
    int calls_before;
    pthread_mutex_lock(&v.mu);
    calls_before = v.calls;
    pthread_mutex_unlock(&v.mu);
    test_etcd_kill(&g_etcd, SIGKILL);
    usleep(3 * 1000 * 1000);
    char s[16];
    int n;
    view_state(&v, "decode-0", s, &n);
    CHECK(strcmp(s, "draining") == 0 && n == 1, "with etcd down the watcher's set changed: n %d", n);
    pthread_mutex_lock(&v.mu);
    CHECK(v.calls == calls_before, "callback called while etcd was down");
    pthread_mutex_unlock(&v.mu);
    CHECK(!kc_register_live(rd0), "registration believed live with etcd down");
    REQUIRE(test_etcd_start(&g_etcd) == 0, "etcd did not restart");
    double t_up = test_now();
    while (!kc_register_live(rd0) && test_now() - t_up < 15)
        usleep(20000);
    CHECK(kc_register_live(rd0), "registration not live again after etcd's restart");
    printf("etcd restarted -> registration live again after %.2f s\n", test_now() - t_up);
    /* a change after the restart reaches the watcher: the watch is back */
    kc_member p1 = member("prefill", "prefill-1", 7102);
    kc_registration *rp1 = NULL;
    REQUIRE(kc_register_start(g_etcd.endpoint, "t", &p1, ttl, &rp1, err) == 0, "register: %s",
            err);
    t = wait_view(&v, "prefill-1", "serving", 15);
    CHECK(t >= 0, "watcher did not see a registration made after etcd's restart");
    printf("etcd restarted -> watcher saw a new member after %.2f s\n", test_now() - t_up);
    /* and the re-established registration outlives several TTLs (keep-alives work again) */
    usleep((useconds_t)(2 * ttl) * 1000 * 1000);
    CHECK(stored(c, kd0, &got, NULL) == 1, "decode-0 expired after etcd's restart");
    CHECK(wait_view(&v, "decode-0", "draining", 1) >= 0, "watcher lost decode-0 after restart");

    kc_register_stop(rp1);
    kc_register_stop(rd0);
    CHECK(wait_view(&v, "decode-0", "", 10) >= 0 && wait_view(&v, "prefill-1", "", 10) >= 0,
          "watcher kept stopped members");
    double t_stop = test_now();
    kc_watch_stop(w);
    printf("kc_watch_stop took %.3f s\n", test_now() - t_stop);
    kc_register_stop(NULL);
    kc_watch_stop(NULL);
    kc_etcd_destroy(c);
    return kt_done("test_membership");
}
