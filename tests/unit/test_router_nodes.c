/*
 * test_router_nodes.c - the router's node table (router/nodes.c) without any node running:
 *   - rt_nodes_apply adds members, keeps a node missing from a later set as GONE (never placed),
 *     brings it back when it reappears, follows an address change and the draining flag;
 *   - a member reporting another model fingerprint than the reference is never placed, and the
 *     first reported fingerprint becomes the reference when the router was given none;
 *   - rt_node_outcome: --breaker-failures consecutive UNAVAILABLE/DEADLINE_EXCEEDED make the
 *     node SUSPECT (left out of placement), an answered call brings it back, UNAVAILABLE
 *     "draining" makes it DRAINING (placed after serving nodes) without counting as a failure;
 *   - states carry the time they were entered;
 *   - kv-aware placement: a prompt recorded on a prefill node sends the next one sharing its
 *     prefix there (the predicted cached tokens, the reason counted), and that node's record is
 *     dropped when its Status shows it restarted (another start time, counters gone back), when
 *     it reports an empty cache asked after the record (not before), and when it leaves.
 * Channels connect lazily, so no process is needed. Run: ctest -R test_router_nodes.
 */
#include "kr_test.h"

#include "../../router/adaptive.c"
#include "../../router/auto.c"
#include "../../router/breaker.c"
#include "../../router/kv-index.c"
#include "../../router/nodes.c"
#include "../../router/placement.c"
#include "../../router/policy.c"

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

/* The prefill ids in kv-aware order for the prompt cut as c, with each one's predicted cached
 * tokens: "p1:64 p0:0". */
static const char *prefill_order(const rt_chain *c)
{
    static char buf[256];
    rt_node *out[RT_NODES_MAX];
    int cached[RT_NODES_MAX];
    int n = rt_nodes_order_prefill(&rt, c, NULL, 0, out, cached);
    buf[0] = 0;
    for (int i = 0; i < n; i++)
        snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "%s%s:%d", i ? " " : "", out[i]->id, cached[i]);
    return buf;
}

static void kv_aware(void)
{
    char err[KR_ERR_MAX];
    rt = (rt_router){.placement = &rt_placement_kv_aware, .breaker_failures = 3, .breaker_cooldown_ms = 60000,
                     .prefill_chunk = 32, .prefill_chunk_given = 32, .kv_index_blocks = 64};
    pthread_mutex_init(&rt.mu, NULL);
    rt.m.reg = kc_registry_create();
    REQUIRE(rt.m.reg, "registry");
    for (int w = 0; w < RT_PLACED_REASONS; w++) {
        char label[64];
        snprintf(label, sizeof label, "reason=\"%s\"", rt_placed_names[w]);
        rt.m.placements[w] = kc_counter_add(rt.m.reg, "kvrelay_placements_total", "test", label);
    }
    kc_member set[] = {
        member("prefill", "p0", "127.0.0.1:1", NULL, NULL),
        member("prefill", "p1", "127.0.0.1:2", NULL, NULL),
        member("decode", "d0", "127.0.0.1:3", NULL, NULL),
    };
    REQUIRE(rt_nodes_apply(&rt, set, 3, err) == 0, "%s", err);
    rt_node *p1 = find("p1");
    /* both polled, serving, idle, with a cache */
    for (int i = 0; i < 2; i++) {
        rt_node *x = find(i ? "p1" : "p0");
        x->polled = x->reachable = 1;
        x->state = KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING;
        x->cache_budget = 1 << 20;
        x->node_since_unix_ms = 1000;
    }
    int32_t doc[100];
    for (int i = 0; i < 100; i++) doc[i] = 7 + i * 3;
    rt_chain c;
    REQUIRE(rt_chain_make("full", 32, doc, 100, &c) == 0 && c.m == 3, "the chain of 100 tokens in 32s: %d blocks", c.m);
    /* nothing recorded: load order with its turns, nothing predicted */
    const char *o = prefill_order(&c);
    CHECK(!strcmp(o, "p0:0 p1:0") || !strcmp(o, "p1:0 p0:0"), "no record: %s", o);
    rt_node_record_prompt(&rt, p1, &c);
    for (int t = 0; t < 2; t++)
        CHECK(!strcmp(prefill_order(&c), "p1:96 p0:0"), "turn %d: the node that holds the prefix first: %s", t,
              prefill_order(&c));
    CHECK(kc_counter_value(rt.m.placements[RT_PLACED_PREFIX]) == 2, "reason prefix counted %g times",
          kc_counter_value(rt.m.placements[RT_PLACED_PREFIX]));
    /* queued work past the saving sends it elsewhere, counted as load */
    p1->prefill_tokens = 97;
    CHECK(!strcmp(prefill_order(&c), "p0:0 p1:96"), "a queue longer than the prefix: %s", prefill_order(&c));
    CHECK(kc_counter_value(rt.m.placements[RT_PLACED_LOAD]) == 1, "reason load");
    p1->prefill_tokens = 0;

    /* an answer with the same start time and a cache holding states keeps the record */
    Kvrelay__V1__Node st = KVRELAY__V1__NODE__INIT;
    st.since_unix_ms = 1000;
    st.prefix_cache_entries = 1;
    st.prefix_cache_budget_bytes = 1 << 20;
    prefix_cache_update(&rt, p1, &st, rt_now_ms());
    CHECK(rt_kv_index_size(p1->kv) == 3, "same node, cache in use: kept (%d)", rt_kv_index_size(p1->kv));
    /* an empty cache reported by a Status asked before the record: kept; after it: dropped */
    st.prefix_cache_entries = 0;
    prefix_cache_update(&rt, p1, &st, p1->kv_recorded_ms - 1);
    CHECK(rt_kv_index_size(p1->kv) == 3, "an empty cache asked before the record: kept");
    prefix_cache_update(&rt, p1, &st, p1->kv_recorded_ms + 1);
    CHECK(rt_kv_index_size(p1->kv) == 0, "an empty cache asked after the record: dropped");
    CHECK(!strstr(prefill_order(&c), ":96"), "nothing predicted any more: %s", prefill_order(&c));
    /* a restart: another start time */
    rt_node_record_prompt(&rt, p1, &c);
    st.prefix_cache_entries = 1;
    st.since_unix_ms = 2000;
    prefix_cache_update(&rt, p1, &st, rt_now_ms() + 1);
    CHECK(rt_kv_index_size(p1->kv) == 0, "restarted (start time): dropped");
    /* a restart seen by counters that went back */
    rt_node_record_prompt(&rt, p1, &c);
    p1->cache_lookups = 50;
    st.prefix_cache_lookups = 3;
    prefix_cache_update(&rt, p1, &st, rt_now_ms() + 1);
    CHECK(rt_kv_index_size(p1->kv) == 0, "restarted (counters): dropped");
    /* the chunk: a given one stays; without one, the first node's reported chunk is taken and a
     * node reporting another changes nothing */
    st.prefill_chunk = 64;
    prefix_cache_update(&rt, p1, &st, rt_now_ms() + 1);
    CHECK(atomic_load(&rt.prefill_chunk) == 32, "--prefill-chunk 32 given: kept, not %d", atomic_load(&rt.prefill_chunk));
    rt.prefill_chunk_given = 0;
    atomic_store(&rt.prefill_chunk, 0);
    p1->chunk = 0;
    prefix_cache_update(&rt, p1, &st, rt_now_ms() + 1);
    CHECK(atomic_load(&rt.prefill_chunk) == 64, "the first chunk reported: 64, not %d", atomic_load(&rt.prefill_chunk));
    st.prefill_chunk = 16;
    rt_node *p0 = find("p0");
    prefix_cache_update(&rt, p0, &st, rt_now_ms() + 1);
    CHECK(atomic_load(&rt.prefill_chunk) == 64 && p0->chunk == 16, "another node's chunk: 64 kept, not %d",
          atomic_load(&rt.prefill_chunk));
    /* a node that answered without a cache records nothing */
    p1->cache_budget = 0;
    rt_node_record_prompt(&rt, p1, &c);
    CHECK(rt_kv_index_size(p1->kv) == 0, "no cache on the node: nothing recorded");
    p1->cache_budget = 1 << 20;
    /* leaving the membership */
    rt_node_record_prompt(&rt, p1, &c);
    REQUIRE(rt_kv_index_size(p1->kv) == 3, "recorded again");
    kc_member rest[] = {set[0], set[2]};
    REQUIRE(rt_nodes_apply(&rt, rest, 2, err) == 0, "%s", err);
    CHECK(rt_kv_index_size(p1->kv) == 0, "left the membership: dropped");
    /* under another placement nothing is recorded or predicted */
    REQUIRE(rt_nodes_apply(&rt, set, 3, err) == 0, "%s", err);
    rt.placement = &rt_placement_least_loaded;
    rt_node_record_prompt(&rt, p1, &c);
    CHECK(rt_kv_index_size(p1->kv) == 0, "least-loaded records nothing");
    rt_chain_free(&c);
    rt_nodes_free(&rt);
    kc_registry_free(rt.m.reg);
    pthread_mutex_destroy(&rt.mu);
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
    pthread_mutex_destroy(&rt.mu);
    kv_aware();
    return kt_done("test_router_nodes");
}
