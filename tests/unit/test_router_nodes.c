/*
 * test_router_nodes.c - the router's node table (router/nodes.c) without any node running:
 *   - rt_nodes_apply adds members, keeps a node missing from a later set as GONE (never placed),
 *     brings it back when it reappears, follows an address change and the draining flag;
 *   - a member reporting another model fingerprint than the reference is never placed, and the
 *     first reported fingerprint becomes the reference when the router was given none;
 *   - rt_node_outcome: --breaker-failures consecutive UNAVAILABLE/DEADLINE_EXCEEDED make the
 *     node SUSPECT (left out of placement), an answered call brings it back, UNAVAILABLE
 *     "draining" makes it DRAINING (placed after serving nodes) without counting as a failure;
 *   - states carry the time they were entered.
 * Channels connect lazily, so no process is needed. Run: ctest -R test_router_nodes.
 */
#include "kr_test.h"

#include "../../router/breaker.c"
#include "../../router/nodes.c"
#include "../../router/placement.c"

#include <string.h>

static rt_router rt;

/* A member as a membership source gives it (state "serving" unless `state`). */
static kc_member member(const char *role, const char *id, const char *grpc, const char *state, const char *fingerprint)
{
    kc_member m = {0};
    snprintf(m.role, sizeof m.role, "%s", role);
    snprintf(m.id, sizeof m.id, "%s", id);
    snprintf(m.grpc, sizeof m.grpc, "%s", grpc);
    snprintf(m.state, sizeof m.state, "%s", state ? state : "serving");
    snprintf(m.fingerprint, sizeof m.fingerprint, "%s", fingerprint ? fingerprint : "");
    return m;
}

static rt_node *find(const char *id)
{
    for (int i = 0; i < rt.n_nodes; i++)
        if (!strcmp(rt.nodes[i]->id, id)) return rt.nodes[i];
    return NULL;
}

/* the ids placement would try, in order, joined by spaces */
static const char *order_ids(rt_role role)
{
    static char buf[256];
    rt_node *out[RT_NODES_MAX];
    int n = rt_nodes_order(&rt, role, NULL, 0, out);
    buf[0] = 0;
    for (int i = 0; i < n; i++) snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "%s%s", i ? " " : "", out[i]->id);
    return buf;
}

static int has(const char *list, const char *id)
{
    size_t n = strlen(id);
    for (const char *p = strstr(list, id); p; p = strstr(p + 1, id))
        if ((p == list || p[-1] == ' ') && (p[n] == 0 || p[n] == ' ')) return 1;
    return 0;
}

static void membership(void)
{
    char err[KR_ERR_MAX];
    kc_member set1[] = {
        member("prefill", "p0", "127.0.0.1:1", NULL, NULL),
        member("decode", "d0", "127.0.0.1:2", NULL, NULL),
        member("decode", "d1", "127.0.0.1:3", NULL, NULL),
    };
    REQUIRE(rt_nodes_apply(&rt, set1, 3, err) == 0, "%s", err);
    CHECK(rt.n_nodes == 3, "%d nodes", rt.n_nodes);
    rt_node *d1 = find("d1");
    REQUIRE(d1, "d1 added");
    CHECK(d1->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING && d1->view_since_unix_ms > 0, "new node serving, since set");
    CHECK(has(order_ids(RT_ROLE_DECODE), "d0") && has(order_ids(RT_ROLE_DECODE), "d1"), "both decode nodes placed: %s",
          order_ids(RT_ROLE_DECODE));
    CHECK(!strcmp(order_ids(RT_ROLE_PREFILL), "p0"), "prefill: %s", order_ids(RT_ROLE_PREFILL));

    /* d1 leaves: gone, kept, never placed */
    REQUIRE(rt_nodes_apply(&rt, set1, 2, err) == 0, "%s", err);
    CHECK(rt.n_nodes == 3 && find("d1") == d1, "the gone node is kept (same pointer)");
    CHECK(d1->view == KVRELAY__V1__NODE_STATE__NODE_STATE_GONE, "d1 gone (view %d)", d1->view);
    CHECK(!has(order_ids(RT_ROLE_DECODE), "d1"), "a gone node is not placed: %s", order_ids(RT_ROLE_DECODE));
    /* ... unless it left just now and its last Status says it serves (an etcd outage expired its
     * lease while it ran): placed for RT_GONE_GRACE_MS, not once it said it drains, not after */
    d1->polled = d1->reachable = 1;
    d1->state = KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING;
    CHECK(has(order_ids(RT_ROLE_DECODE), "d1"), "a node gone just now and serving is placed: %s", order_ids(RT_ROLE_DECODE));
    snprintf(d1->member.state, sizeof d1->member.state, "draining");
    CHECK(!has(order_ids(RT_ROLE_DECODE), "d1"), "a gone node that drained is not placed");
    snprintf(d1->member.state, sizeof d1->member.state, "serving");
    d1->gone_unix_ms -= RT_GONE_GRACE_MS + 1000;
    CHECK(!has(order_ids(RT_ROLE_DECODE), "d1"), "a node gone longer than the grace is not placed");
    d1->polled = d1->reachable = 0;

    /* d1 comes back at a new address, d0 says it drains */
    kc_member set2[] = {
        member("prefill", "p0", "127.0.0.1:1", NULL, NULL),
        member("decode", "d0", "127.0.0.1:2", "draining", NULL),
        member("decode", "d1", "127.0.0.1:4", NULL, NULL),
    };
    REQUIRE(rt_nodes_apply(&rt, set2, 3, err) == 0, "%s", err);
    CHECK(rt.n_nodes == 3 && d1->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING, "d1 back (view %d)", d1->view);
    CHECK(!strcmp(d1->member.grpc, "127.0.0.1:4") && rt.n_retired == 1, "d1 moved: %s, %d retired channels", d1->member.grpc,
          rt.n_retired);
    CHECK(find("d0")->view == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING, "d0 draining");
    CHECK(!strcmp(order_ids(RT_ROLE_DECODE), "d1 d0"), "draining goes last: %s", order_ids(RT_ROLE_DECODE));
    snprintf(set2[1].state, sizeof set2[1].state, "serving");
    REQUIRE(rt_nodes_apply(&rt, set2, 3, err) == 0, "%s", err);
    CHECK(find("d0")->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING, "d0 serving again");
}

static void fingerprints(void)
{
    char err[KR_ERR_MAX];
    kc_member set[] = {
        member("prefill", "p0", "127.0.0.1:1", NULL, "0123456789abcdef"),
        member("decode", "d0", "127.0.0.1:2", NULL, "0123456789abcdef"),
        member("decode", "d1", "127.0.0.1:4", NULL, "fedcba9876543210"),
    };
    REQUIRE(rt_nodes_apply(&rt, set, 3, err) == 0, "%s", err);
    CHECK(!strcmp(rt.fingerprint, "0123456789abcdef") && rt.fingerprint_from_node, "the first one is the reference: %s",
          rt.fingerprint);
    CHECK(!strcmp(order_ids(RT_ROLE_DECODE), "d0"), "another model is never placed: %s", order_ids(RT_ROLE_DECODE));
    snprintf(set[2].fingerprint, sizeof set[2].fingerprint, "0123456789abcdef"); /* redeployed with the right model */
    REQUIRE(rt_nodes_apply(&rt, set, 3, err) == 0, "%s", err);
    CHECK(has(order_ids(RT_ROLE_DECODE), "d1"), "same model: placed again: %s", order_ids(RT_ROLE_DECODE));
}

static void breaker(void)
{
    rt_node *d0 = find("d0"), *d1 = find("d1");
    for (int i = 0; i < rt.breaker_failures - 1; i++) rt_node_outcome(&rt, d0, GRPC_STATUS_UNAVAILABLE, "connection refused");
    CHECK(d0->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING, "below the threshold: still serving (view %d)", d0->view);
    rt_node_outcome(&rt, d0, GRPC_STATUS_OK, "");
    for (int i = 0; i < rt.breaker_failures - 1; i++) rt_node_outcome(&rt, d0, GRPC_STATUS_DEADLINE_EXCEEDED, "slow");
    CHECK(d0->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING, "an answer in between restarts the count");
    int64_t before = d0->view_since_unix_ms;
    rt_node_outcome(&rt, d0, GRPC_STATUS_UNAVAILABLE, "connection refused");
    CHECK(d0->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SUSPECT && d0->view_since_unix_ms >= before, "suspect");
    CHECK(!strcmp(order_ids(RT_ROLE_DECODE), "d1"), "a suspect node is not placed: %s", order_ids(RT_ROLE_DECODE));
    rt_node_outcome(&rt, d0, GRPC_STATUS_INVALID_ARGUMENT, "a bad request is an answer");
    CHECK(d0->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING, "any answer closes the breaker (view %d)", d0->view);
    for (int i = 0; i < 5; i++) rt_node_outcome(&rt, d1, GRPC_STATUS_UNAVAILABLE, "decode node d1 is draining");
    CHECK(d1->view == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING && !d1->breaker.open,
          "UNAVAILABLE draining: draining, not suspect (view %d)", d1->view);
    CHECK(!strcmp(order_ids(RT_ROLE_DECODE), "d0 d1"), "draining after serving: %s", order_ids(RT_ROLE_DECODE));
}

int main(void)
{
    kc_log_init("test", KC_LOG_ERROR);
    rt.placement = &rt_placement_round_robin;
    rt.breaker_failures = 3;
    rt.breaker_cooldown_ms = 60000;
    pthread_mutex_init(&rt.mu, NULL);
    membership();
    fingerprints();
    breaker();
    rt_nodes_free(&rt);
    return kt_done("test_router_nodes");
}
