/*
 * test_router_cluster.c - kvrelay-router's placement and retry rules against real processes on
 * loopback (llama3-tiny, token-id prompts): a membership file with an unreachable decode node, a
 * real decode node with a small KV pool, a fake prefill node in this process that fails every
 * Prefill with UNAVAILABLE (listed first, so the router meets it first) and a real prefill node.
 *   - ClusterStatus: router + 4 nodes, the dead one UNREACHABLE (or SUSPECT once its breaker
 *     opened);
 *   - a request placed on the fake prefill node is Released and placed again: it succeeds on the
 *     real nodes, and kvrelay_placement_retries_total counts it;
 *   - backoff: with the decode pool held by a reservation this test makes itself, a request with
 *     a short deadline gets RESOURCE_EXHAUSTED (or DEADLINE_EXCEEDED), and one with a long
 *     deadline waits (the router's ClusterStatus shows it queued) and completes once the
 *     reservation is Released;
 *   - the decode node SIGKILLed mid-stream: the client gets UNAVAILABLE naming the node, the
 *     next request UNAVAILABLE at once, ClusterStatus shows the node UNREACHABLE or SUSPECT, the router
 *     still serves and stops cleanly on SIGTERM.
 * No timing is asserted (deadlines are generous except the one meant to pass).
 * Skips (77) when the programs are not built. Run: ctest -R test_router_cluster (a few seconds).
 */
#include "kr_test.h"
#include "proc.h"

#include "rpc.h"

#include "kvrelay/v1/internal.pb-c.h"
#include "kvrelay/v1/kvrelay.pb-c.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>

/* The long request: its reservation needs X blocks of the pool of POOL_BLOCKS, and the test
 * checks X <= POOL_BLOCKS < 2X, so one such reservation leaves no room for a second. */
#define POOL_BLOCKS 2000
#define LONG_TOKENS 1990
#define PROMPT_LEN 12

static uint32_t prompt[PROMPT_LEN];

/* ------------------------------------------------------------------ the fake prefill node */

static atomic_int fake_prefill_calls;

static int fake_prefill(kc_call *call, const ProtobufCMessage *req, void *user)
{
    atomic_fetch_add(&fake_prefill_calls, 1);
    return kc_call_error(call, GRPC_STATUS_UNAVAILABLE, "fake prefill node: the KV transfer's peer died");
}

static int fake_status(kc_call *call, const ProtobufCMessage *req, void *user)
{
    Kvrelay__V1__Node n = KVRELAY__V1__NODE__INIT;
    n.id = "prefill-fake";
    n.role = KVRELAY__V1__NODE_ROLE__NODE_ROLE_PREFILL;
    n.state = KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING;
    kc_call_send(call, &n.base);
    return GRPC_STATUS_OK;
}

/* ------------------------------------------------------------------ helpers */

/* A port nothing listens on (bound, then closed). */
static int closed_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    REQUIRE(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
            getsockname(fd, (struct sockaddr *)&a, &len) == 0, "bind");
    close(fd);
    return ntohs(a.sin_port);
}

/* The value of a metric line "NAME VALUE" in the router's /metrics, or -1. */
static double metric(const char *http, const char *name)
{
    char host[64];
    int port;
    REQUIRE(sscanf(http, "%63[^:]:%d", host, &port) == 2, "http address %s", http);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, host, &a.sin_addr);
    REQUIRE(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0, "connect to %s", http);
    const char *req = "GET /metrics HTTP/1.0\r\n\r\n";
    REQUIRE(write(fd, req, strlen(req)) == (ssize_t)strlen(req), "write");
    static char buf[1 << 16];
    size_t n = 0;
    ssize_t r;
    while (n + 1 < sizeof buf && (r = read(fd, buf + n, sizeof buf - 1 - n)) > 0) n += (size_t)r;
    close(fd);
    buf[n] = 0;
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *at = strstr(buf, key);
    return at ? atof(at + strlen(key)) : -1;
}

static Kvrelay__V1__ClusterStatusResponse *cluster_status(kc_channel *ch)
{
    Kvrelay__V1__ClusterStatusRequest req = KVRELAY__V1__CLUSTER_STATUS_REQUEST__INIT;
    Kvrelay__V1__ClusterStatusResponse *resp = NULL;
    kc_status st;
    REQUIRE(kc_unary(ch, "/kvrelay.v1.Admin/ClusterStatus", &req.base,
                     &kvrelay__v1__cluster_status_response__descriptor, 10000, (ProtobufCMessage **)&resp, &st) == 0,
            "ClusterStatus: %s", st.details);
    return resp;
}

static const Kvrelay__V1__Node *find_node(const Kvrelay__V1__ClusterStatusResponse *s, const char *id)
{
    for (size_t i = 0; i < s->n_nodes; i++)
        if (!strcmp(s->nodes[i]->id, id)) return s->nodes[i];
    return NULL;
}

/* Waits (up to 15 s) until decode-0 holds no used or reserved blocks. */
static void check_blocks_back(kc_channel *ch, const char *what)
{
    for (int i = 0;; i++) {
        Kvrelay__V1__ClusterStatusResponse *s = cluster_status(ch);
        const Kvrelay__V1__Node *d = find_node(s, "decode-0");
        int back = d && d->free_kv_blocks == d->total_kv_blocks && d->reserved_kv_blocks == 0;
        if (back || i == 300) {
            CHECK(back, "%s: decode-0 free %llu of %llu, reserved %llu", what,
                  d ? (unsigned long long)d->free_kv_blocks : 0ull, d ? (unsigned long long)d->total_kv_blocks : 0ull,
                  d ? (unsigned long long)d->reserved_kv_blocks : 0ull);
            kc_message_free(&s->base);
            return;
        }
        kc_message_free(&s->base);
        usleep(50000);
    }
}

/* One Generate to the end: tokens received, the finish (copied fields) and the status. */
typedef struct gen_out {
    uint32_t n_tokens;
    int have_finish;
    Kvrelay__V1__FinishReason reason;
    char prefill_node[64], decode_node[64];
    kc_status st;
    /* for the mid-stream kill: after this many tokens, call on_tokens once */
    uint32_t hook_after;
    void (*on_tokens)(void);
} gen_out;

static void generate(kc_channel *ch, uint32_t max_tokens, int64_t timeout_ms, gen_out *o)
{
    Kvrelay__V1__TokenIds ids = KVRELAY__V1__TOKEN_IDS__INIT;
    ids.n_ids = PROMPT_LEN;
    ids.ids = prompt;
    Kvrelay__V1__GenerateRequest req = KVRELAY__V1__GENERATE_REQUEST__INIT;
    req.prompt_case = KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
    req.token_ids = &ids;
    req.max_tokens = max_tokens;
    kc_stream *s;
    if (kc_stream_open(ch, "/kvrelay.v1.Generation/Generate", &req.base, timeout_ms, &s, &o->st) != 0) return;
    for (;;) {
        Kvrelay__V1__GenerateResponse *m;
        int rc = kc_stream_next(s, &kvrelay__v1__generate_response__descriptor, (ProtobufCMessage **)&m, &o->st);
        if (rc <= 0) break;
        if (m->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA) {
            o->n_tokens += (uint32_t)m->delta->n_ids;
            if (o->on_tokens && o->n_tokens >= o->hook_after) {
                o->on_tokens();
                o->on_tokens = NULL;
            }
        } else if (m->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_FINISH) {
            o->have_finish = 1;
            o->reason = m->finish->reason;
            if (m->finish->usage && m->finish->usage->served_by) {
                snprintf(o->prefill_node, sizeof o->prefill_node, "%s", m->finish->usage->served_by->prefill_node);
                snprintf(o->decode_node, sizeof o->decode_node, "%s", m->finish->usage->served_by->decode_node);
            }
        }
        kc_message_free(&m->base);
    }
    kc_stream_close(s);
}

typedef struct waiter {
    kc_channel *ch;
    gen_out out;
} waiter;

static void *waiting_request(void *arg)
{
    waiter *w = arg;
    generate(w->ch, LONG_TOKENS, 120000, &w->out);
    return NULL;
}

static test_proc decode;
static void kill_decode(void)
{
    kill(decode.pid, SIGKILL);
}

int main(void)
{
    const char *bin = kt_env("KR_BIN"), *fix = kt_env("KR_FIXTURES");
    if (!bin || !fix) {
        fprintf(stderr, "test_router_cluster: KR_BIN and KR_FIXTURES are needed: SKIPPED\n");
        return KT_SKIP;
    }
    char router_bin[1024], decode_bin[1024], prefill_bin[1024], model[1024];
    snprintf(router_bin, sizeof router_bin, "%s/kvrelay-router", bin);
    snprintf(decode_bin, sizeof decode_bin, "%s/kvrelay-decode", bin);
    snprintf(prefill_bin, sizeof prefill_bin, "%s/kvrelay-prefill", bin);
    snprintf(model, sizeof model, "%s/models/llama3-tiny", fix);
    if (access(router_bin, X_OK) || access(decode_bin, X_OK) || access(prefill_bin, X_OK)) {
        fprintf(stderr, "test_router_cluster: the router and node programs are not built: SKIPPED\n");
        return KT_SKIP;
    }
    for (int i = 0; i < PROMPT_LEN; i++) prompt[i] = (uint32_t)(13 * i + 7);

    /* the fake prefill node, in this process */
    kc_server *fake;
    kc_status st;
    int fake_port;
    REQUIRE(kc_server_create("127.0.0.1:0", NULL, &fake, &fake_port, &st) == 0, "%s", st.details);
    REQUIRE(kc_server_add_unary(fake, "/kvrelay.v1.Prefill/Prefill", &kvrelay__v1__prefill_request__descriptor,
                                fake_prefill, NULL) == 0 &&
            kc_server_add_unary(fake, "/kvrelay.v1.Prefill/Status", &kvrelay__v1__node_status_request__descriptor,
                                fake_status, NULL) == 0 &&
            kc_server_start(fake, &st) == 0, "fake prefill node");

    char pool[32];
    snprintf(pool, sizeof pool, "%d", POOL_BLOCKS);
    char *decode_argv[] = {decode_bin, "--model", model, "--id", "decode-0", "--listen", "127.0.0.1:0",
                           "--transfer", "127.0.0.1:0", "--http", "127.0.0.1:0", "--kv-blocks", pool,
                           "--threads", "1", NULL};
    char *prefill_argv[] = {prefill_bin, "--model", model, "--id", "prefill-0", "--listen", "127.0.0.1:0",
                            "--http", "127.0.0.1:0", "--threads", "1", NULL};
    test_proc prefill, router;
    REQUIRE(test_proc_start(decode_argv, 60, &decode) == 0, "decode node");
    REQUIRE(test_proc_start(prefill_argv, 60, &prefill) == 0, "prefill node");

    char nodes_path[] = "/tmp/kvrelay-test-router-XXXXXX";
    int nfd = mkstemp(nodes_path);
    REQUIRE(nfd >= 0, "mkstemp");
    FILE *nf = fdopen(nfd, "w");
    fprintf(nf,
            "{\"prefill\": [{\"id\": \"prefill-fake\", \"address\": \"127.0.0.1:%d\"},"
            "              {\"id\": \"prefill-0\", \"address\": \"%s\"}],"
            " \"decode\": [{\"id\": \"decode-dead\", \"address\": \"127.0.0.1:%d\"},"
            "              {\"id\": \"decode-0\", \"address\": \"%s\"}]}\n",
            fake_port, prefill.grpc, closed_port(), decode.grpc);
    fclose(nf);
    char *router_argv[] = {router_bin, "--model", model, "--nodes", nodes_path, "--listen", "127.0.0.1:0",
                           "--http", "127.0.0.1:0", "--placement", "least-loaded", NULL};
    REQUIRE(test_proc_start(router_argv, 60, &router) == 0, "router");
    kc_channel *ch, *dch;
    REQUIRE(kc_channel_create(router.grpc, 0, &ch, &st) == 0, "%s", st.details);
    REQUIRE(kc_channel_create(decode.grpc, 0, &dch, &st) == 0, "%s", st.details);

    /* ---- the cluster as the router sees it */
    Kvrelay__V1__ClusterStatusResponse *cs = cluster_status(ch);
    CHECK(cs->n_nodes == 5, "%zu nodes", cs->n_nodes);
    const Kvrelay__V1__Node *dead = find_node(cs, "decode-dead"), *d0 = find_node(cs, "decode-0");
    CHECK(dead && (dead->state == KVRELAY__V1__NODE_STATE__NODE_STATE_UNREACHABLE ||
                   dead->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SUSPECT) && dead->since_unix_ms > 0,
          "decode-dead not UNREACHABLE or SUSPECT with a since");
    CHECK(d0 && d0->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING && d0->total_kv_blocks == POOL_BLOCKS,
          "decode-0 state/blocks");
    CHECK(find_node(cs, "prefill-fake") && find_node(cs, "prefill-0") && find_node(cs, "router-0"), "ids");
    kc_message_free(&cs->base);

    /* ---- the fake prefill node fails UNAVAILABLE: Release, placed again on the real ones */
    for (int i = 0; i < 2; i++) {
        gen_out o = {0};
        generate(ch, 8, 60000, &o);
        CHECK(o.st.code == GRPC_STATUS_OK && o.have_finish && o.n_tokens == 8, "request %d: %s %s, %u tokens", i,
              kc_status_name(o.st.code), o.st.details, o.n_tokens);
        CHECK(!strcmp(o.prefill_node, "prefill-0") && !strcmp(o.decode_node, "decode-0"), "served by %s -> %s",
              o.prefill_node, o.decode_node);
    }
    CHECK(atomic_load(&fake_prefill_calls) >= 1, "the fake prefill node was never tried");
    CHECK(metric(router.http, "kvrelay_placement_retries_total") >= 1, "retries metric %g",
          metric(router.http, "kvrelay_placement_retries_total"));
    check_blocks_back(ch, "after the retried requests");

    /* ---- backoff: hold the pool with a reservation of our own */
    Kvrelay__V1__ReserveRequest rq = KVRELAY__V1__RESERVE_REQUEST__INIT;
    rq.request_id = "test-blocker";
    rq.prompt_tokens = PROMPT_LEN;
    rq.max_tokens = LONG_TOKENS;
    rq.ttl_ms = 120000;
    Kvrelay__V1__ReserveResponse *blocker = NULL;
    REQUIRE(kc_unary(dch, "/kvrelay.v1.Decode/Reserve", &rq.base, &kvrelay__v1__reserve_response__descriptor, 10000,
                     (ProtobufCMessage **)&blocker, &st) == 0, "blocker: %s", st.details);
    REQUIRE(blocker->reserved_blocks <= POOL_BLOCKS && POOL_BLOCKS < 2 * blocker->reserved_blocks,
            "a %d-token request reserves %llu blocks: pick POOL_BLOCKS in [X, 2X)", LONG_TOKENS,
            (unsigned long long)blocker->reserved_blocks);
    gen_out quick = {0};
    generate(ch, LONG_TOKENS, 300, &quick);
    CHECK(quick.st.code == GRPC_STATUS_RESOURCE_EXHAUSTED || quick.st.code == GRPC_STATUS_DEADLINE_EXCEEDED,
          "pool full, short deadline: %s %s", kc_status_name(quick.st.code), quick.st.details);
    waiter w = {.ch = ch};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, waiting_request, &w) == 0, "thread");
    int queued = 0;
    for (int i = 0; i < 400 && !queued; i++) {
        cs = cluster_status(ch);
        const Kvrelay__V1__Node *self = find_node(cs, "router-0");
        queued = self && self->queued_requests >= 1;
        kc_message_free(&cs->base);
        if (!queued) usleep(50000);
    }
    CHECK(queued, "the router never showed the request waiting for room");
    Kvrelay__V1__ReleaseRequest rel = KVRELAY__V1__RELEASE_REQUEST__INIT;
    rel.reservation_id = blocker->reservation_id;
    rel.request_id = "test-blocker";
    Kvrelay__V1__ReleaseResponse *released = NULL;
    CHECK(kc_unary(dch, "/kvrelay.v1.Decode/Release", &rel.base, &kvrelay__v1__release_response__descriptor, 10000,
                   (ProtobufCMessage **)&released, &st) == 0 && released->released, "release the blocker: %s",
          st.details);
    kc_message_free((ProtobufCMessage *)released);
    kc_message_free(&blocker->base);
    pthread_join(t, NULL);
    CHECK(w.out.st.code == GRPC_STATUS_OK && w.out.n_tokens == LONG_TOKENS, "the waiting request: %s %s, %u tokens",
          kc_status_name(w.out.st.code), w.out.st.details, w.out.n_tokens);
    check_blocks_back(ch, "after the backoff");

    /* ---- the decode node dies mid-stream */
    gen_out doomed = {.hook_after = 10, .on_tokens = kill_decode};
    generate(ch, LONG_TOKENS, 60000, &doomed);
    CHECK(doomed.st.code == GRPC_STATUS_UNAVAILABLE && strstr(doomed.st.details, "decode-0"),
          "decode node killed mid-stream: %s %s", kc_status_name(doomed.st.code), doomed.st.details);
    gen_out after = {0};
    generate(ch, 8, 60000, &after);
    CHECK(after.st.code == GRPC_STATUS_UNAVAILABLE && strstr(after.st.details, "no decode node"),
          "no decode node left: %s %s", kc_status_name(after.st.code), after.st.details);
    cs = cluster_status(ch);
    d0 = find_node(cs, "decode-0");
    CHECK(d0 && (d0->state == KVRELAY__V1__NODE_STATE__NODE_STATE_UNREACHABLE ||
                 d0->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SUSPECT),
          "decode-0 not UNREACHABLE or SUSPECT after kill");
    kc_message_free(&cs->base);

    kc_channel_destroy(dch);
    kc_channel_destroy(ch);
    int rs = test_proc_stop(&router, SIGTERM, 20);
    CHECK(rs >= 0 && WIFEXITED(rs) && WEXITSTATUS(rs) == 0, "router exit status %d", rs);
    test_proc_stop(&prefill, SIGTERM, 20);
    test_proc_stop(&decode, SIGKILL, 5);
    kc_server_destroy(fake);
    unlink(nodes_path);
    return kt_done("test_router_cluster");
}
