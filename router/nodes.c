/*
 * nodes.c - the router's view of its prefill and decode nodes: one gRPC channel each, their
 * Status polled every RT_POLL_INTERVAL_MS (and on demand by Admin.ClusterStatus), and the load
 * estimates placement orders them by: the node's last answer corrected by what this router
 * started or finished on it since that answer was asked for, so a burst of requests between two
 * polls does not all land on the node that looked emptiest. Several routers would each see only
 * their own corrections (a known limit, docs/router.md).
 * The table changes at run time (rt_nodes_apply: one kc_member list, from the static file or from
 * etcd, applied the same way); each node has a
 * circuit breaker fed by every call's outcome (rt_node_outcome) and the router's view of its
 * state (serving, draining, unreachable, suspect, gone) with the time it entered it
 * (docs/failures.md). Under kv-aware placement each prefill node also has the index of the
 * prompts this router prefilled there (kv-index.h), dropped when the node restarts (its Status
 * reports another start time, or counters that went back), moves, leaves, or reports an empty
 * prefix cache after the last prompt was recorded.
 */
#include "auto.h"
#include "names.h"
#include "router.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How long one poll round waits for a suspect node's channel to connect before it leaves the
 * node to the next round (the round's other Status calls run meanwhile, in their own threads). */
#define RT_READY_WAIT_MS 200

int64_t rt_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static int64_t unix_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* A channel to a node, with the router's TLS credentials when it has them. Its reconnect
 * backoff is capped at RT_NODE_RECONNECT_MS (gRPC's default grows to 120 s): a node restarted
 * after a long downtime is connected again within about a second of coming back, instead of
 * after the channel's backoff runs out. */
static int node_channel(const rt_router *rt, const char *address, kc_channel **out, kc_status *st)
{
    const kc_channel_opts opts = {.max_reconnect_backoff_ms = RT_NODE_RECONNECT_MS,
                                  .creds = rt->node_creds};
    return kc_channel_create_opts(address, &opts, out, st);
}

/* The member itself says it drains (etcd; a static file cannot). rt->mu held. */
static int member_draining(const rt_node *x)
{
    return strcmp(x->member.state, "draining") == 0;
}

/* A member that left the membership less than RT_GONE_GRACE_MS ago but whose last Status (it is
 * still polled) says it serves, and that never said it drains: still placed. When etcd comes back
 * from an outage longer than the lease TTL it expires every lease at once, before the nodes (all
 * alive) have registered again; a node that really leaves drains first (it says so) or is dead
 * (its Status fails). rt->mu held. */
static int departing_usable(const rt_node *x, int64_t now_unix_ms)
{
    return x->gone && now_unix_ms - x->gone_unix_ms <= RT_GONE_GRACE_MS && x->polled && x->reachable &&
           x->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING && !member_draining(x) && !x->refused_draining;
}

/* Recomputes the router's view of n (rt->mu held); logs and stamps a change. */
static void view_update(rt_node *n)
{
    Kvrelay__V1__NodeState v;
    if (n->gone) v = KVRELAY__V1__NODE_STATE__NODE_STATE_GONE;
    else if (n->breaker.open) v = KVRELAY__V1__NODE_STATE__NODE_STATE_SUSPECT;
    else if (n->polled && !n->reachable) v = KVRELAY__V1__NODE_STATE__NODE_STATE_UNREACHABLE;
    else if (member_draining(n) || n->refused_draining || (n->reachable && n->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING))
        v = KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING;
    else v = KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING;
    if (v == n->view) return;
    kc_info(NULL, "node %s (%s): %s -> %s%s%s", n->id, n->member.grpc, kc_node_state_name(n->view), kc_node_state_name(v),
            n->error[0] && (v == KVRELAY__V1__NODE_STATE__NODE_STATE_SUSPECT || v == KVRELAY__V1__NODE_STATE__NODE_STATE_UNREACHABLE) ? ": " : "",
            v == KVRELAY__V1__NODE_STATE__NODE_STATE_SUSPECT || v == KVRELAY__V1__NODE_STATE__NODE_STATE_UNREACHABLE ? n->error : "");
    n->view = v;
    n->view_since_unix_ms = unix_now_ms();
}

/* One failed or successful call (rt->mu held). */
static void breaker_record(rt_router *rt, rt_node *n, int failed)
{
    int change = rt_breaker_record(&n->breaker, failed, rt->breaker_failures, rt->breaker_cooldown_ms, rt_now_ms());
    if (change > 0)
        kc_warn(NULL, "node %s: circuit breaker open after %d failed calls (%s); probing every %" PRId64 " ms",
                n->id, n->breaker.failures, n->error, rt->breaker_cooldown_ms);
    else if (change < 0)
        kc_info(NULL, "node %s: circuit breaker closed (a call answered)", n->id);
    view_update(n);
}

static int is_failure(grpc_status_code code)
{
    return code == GRPC_STATUS_UNAVAILABLE || code == GRPC_STATUS_DEADLINE_EXCEEDED;
}

void rt_node_outcome(rt_router *rt, rt_node *n, grpc_status_code code, const char *details)
{
    pthread_mutex_lock(&rt->mu);
    if (code == GRPC_STATUS_UNAVAILABLE && details && strstr(details, "draining")) {
        n->refused_draining = 1; /* it answered: alive, but taking nothing new */
        breaker_record(rt, n, 0);
    } else {
        if (is_failure(code)) snprintf(n->error, sizeof n->error, "%s: %s", kc_status_name(code), details ? details : "");
        breaker_record(rt, n, is_failure(code));
    }
    pthread_mutex_unlock(&rt->mu);
}

kc_channel *rt_node_channel(rt_router *rt, rt_node *n)
{
    pthread_mutex_lock(&rt->mu);
    kc_channel *ch = n->ch;
    pthread_mutex_unlock(&rt->mu);
    return ch;
}

/* ------------------------------------------------------------------ membership */

static rt_role member_role(const kc_member *m)
{
    return strcmp(m->role, "prefill") == 0 ? RT_ROLE_PREFILL : RT_ROLE_DECODE;
}

/* Whether a member's fingerprint rules it out (rt->mu held): the first one seen becomes the
 * reference when the router could not compute its own (docs/failures.md). */
static int fingerprint_mismatch(rt_router *rt, const char *fp)
{
    if (!fp[0]) return 0;
    if (!rt->fingerprint[0]) {
        snprintf(rt->fingerprint, sizeof rt->fingerprint, "%s", fp);
        rt->fingerprint_from_node = 1;
        kc_info(NULL, "model fingerprint %s taken from the first member that reported one", fp);
        return 0;
    }
    return strcmp(rt->fingerprint, fp) != 0;
}

/* A node for a member not in the table yet, with its channel (rt->mu held). Returns it, or NULL
 * with err. */
static rt_node *node_add(rt_router *rt, const kc_member *m, char *err)
{
    if (rt->n_nodes >= RT_NODES_MAX) {
        snprintf(err, KR_ERR_MAX, "node %.63s: the router knows %d nodes already (at most %d)", m->id, rt->n_nodes, RT_NODES_MAX);
        return NULL;
    }
    kc_channel *ch;
    kc_status st;
    if (node_channel(rt, m->grpc, &ch, &st) != 0) {
        snprintf(err, KR_ERR_MAX, "node %.63s (%.200s): %.200s", m->id, m->grpc, st.details);
        return NULL;
    }
    rt_node *x = calloc(1, sizeof *x);
    if (!x) {
        kc_channel_destroy(ch);
        snprintf(err, KR_ERR_MAX, "out of memory");
        return NULL;
    }
    x->role = member_role(m);
    x->member = *m;
    x->id = x->member.id;
    snprintf(x->error, sizeof x->error, "not polled yet");
    x->ch = ch;
    x->view_since_unix_ms = unix_now_ms();
    rt->nodes[rt->n_nodes++] = x;
    kc_info(NULL, "member %s node %s at %s", x->member.role, x->id, x->member.grpc);
    return x;
}

/* Drops what kv-aware placement recorded on n: its cache is gone or unknown (rt->mu held). */
static void kv_forget(rt_node *n, const char *why)
{
    if (!rt_kv_index_size(n->kv)) return;
    kc_info(NULL, "node %s: %s: forgetting the %d prompt blocks placed there", n->id, why, rt_kv_index_size(n->kv));
    rt_kv_index_clear(n->kv);
}

/* Takes a known node's new record (rt->mu held): a new address gets a new channel, the old one
 * is retired (calls in flight may still use it). The id and role are equal (they matched) and
 * are left as they are, since the request path reads them without the lock. Returns 0, or -1
 * with err when the node cannot move (it keeps its old record). */
static int node_update(rt_router *rt, rt_node *x, const kc_member *m, char *err)
{
    if (strcmp(x->member.grpc, m->grpc) != 0) {
        kc_channel *ch;
        kc_status st;
        if (rt->n_retired >= RT_NODES_MAX || node_channel(rt, m->grpc, &ch, &st) != 0) {
            snprintf(err, KR_ERR_MAX, "node %.63s: cannot move to %.200s", m->id, m->grpc);
            return -1;
        }
        kc_info(NULL, "node %s moved from %s to %s", x->id, x->member.grpc, m->grpc);
        rt->retired[rt->n_retired++] = x->ch;
        x->ch = ch;
        x->polled = 0;
        x->breaker = (rt_breaker){0};
        kv_forget(x, "it moved");
    }
    if (m->start_unix_ms != x->member.start_unix_ms) kv_forget(x, "it registered with another start time");
    kc_member *r = &x->member; /* every field but id and role: a field added to kc_member goes here too */
    memcpy(r->state, m->state, sizeof r->state);
    memcpy(r->grpc, m->grpc, sizeof r->grpc);
    memcpy(r->transfer, m->transfer, sizeof r->transfer);
    memcpy(r->fingerprint, m->fingerprint, sizeof r->fingerprint);
    r->kv_capacity = m->kv_capacity;
    memcpy(r->version, m->version, sizeof r->version);
    r->start_unix_ms = m->start_unix_ms;
    return 0;
}

int rt_nodes_apply(rt_router *rt, const kc_member *ms, int n, char *err)
{
    int rc = 0;
    pthread_mutex_lock(&rt->mu);
    int n_old = rt->n_nodes; /* the nodes before this call: those not in ms become gone */
    char *seen = calloc((size_t)n_old + 1, 1);
    for (int i = 0; i < n; i++) {
        const kc_member *m = &ms[i];
        if (strlen(m->id) > RT_NODE_ID_MAX) {
            kc_warn(NULL, "membership: node id '%.80s...' is over %d characters: left out", m->id, RT_NODE_ID_MAX);
            continue;
        }
        rt_role role = member_role(m);
        rt_node *x = NULL;
        for (int k = 0; k < rt->n_nodes; k++)
            if (rt->nodes[k]->role == role && !strcmp(rt->nodes[k]->id, m->id)) {
                x = rt->nodes[k];
                if (seen && k < n_old) seen[k] = 1;
                break;
            }
        if (!x) x = node_add(rt, m, err);
        else if (node_update(rt, x, m, err) != 0) x = NULL;
        if (!x) {
            rc = -1;
            continue;
        }
        if (x->gone) kc_info(NULL, "node %s is a member again", x->id);
        /* registered again (or still listed) while the router cannot reach it: it is likely back,
         * so its channel reconnects now instead of when its backoff runs out */
        if (x->gone || x->breaker.open || (x->polled && !x->reachable)) kc_channel_reset_backoff(x->ch);
        x->gone = 0;
        int bad = fingerprint_mismatch(rt, m->fingerprint);
        if (bad && !x->fingerprint_bad)
            kc_warn(NULL, "node %s serves model fingerprint %s, the router's is %s: not used", x->id, m->fingerprint, rt->fingerprint);
        x->fingerprint_bad = bad;
        view_update(x);
    }
    for (int k = 0; seen && k < n_old; k++) {
        rt_node *x = rt->nodes[k];
        if (seen[k] || x->gone) continue;
        x->gone = 1; /* calls in flight on it go on; placement never picks it again */
        x->gone_unix_ms = unix_now_ms();
        kv_forget(x, "it left the membership");
        view_update(x);
    }
    free(seen);
    pthread_mutex_unlock(&rt->mu);
    return rc;
}

void rt_nodes_free(rt_router *rt)
{
    for (int i = 0; i < rt->n_nodes; i++) {
        kc_channel_destroy(rt->nodes[i]->ch);
        rt_kv_index_free(rt->nodes[i]->kv);
        free(rt->nodes[i]);
    }
    for (int i = 0; i < rt->n_retired; i++) kc_channel_destroy(rt->retired[i]);
    rt->n_nodes = rt->n_retired = 0;
}

/* ------------------------------------------------------------------ polling */

typedef struct poll_job {
    rt_router *rt;
    rt_node *node;
    int64_t timeout_ms;
    int if_ready; /* a suspect node between probes: call Status only once its channel is ready */
} poll_job;

/* The prefill chunk a node reports: kv-aware placement cuts prompts as the nodes' caches do, so
 * without --prefill-chunk the router takes the first one reported; a node whose chunk differs
 * from the router's is warned about once per value (its hits are predicted less well). */
static void chunk_update(rt_router *rt, rt_node *n, uint32_t chunk)
{
    if (!chunk || chunk == n->chunk) return;
    n->chunk = chunk;
    int mine = 0;
    if (!rt->prefill_chunk_given &&
        atomic_compare_exchange_strong(&rt->prefill_chunk, &mine, (int)chunk)) {
        kc_info(NULL, "kv-aware placement: prefill chunk %u, as node %s reports", chunk, n->id);
        return;
    }
    mine = atomic_load(&rt->prefill_chunk);
    if ((uint32_t)mine != chunk)
        kc_warn(NULL,
                "node %s prefills in chunks of %u tokens, the router's kv-aware placement cuts prompts "
                "into %d (%s): its prefix-cache hits are predicted less well; give every prefill node "
                "the same --chunk",
                n->id, chunk, mine, rt->prefill_chunk_given ? "--prefill-chunk" : "the first node's");
}

/* A prefill node's Status answer (asked at asked_ms): its prefix cache's numbers, and whether
 * what kv-aware placement recorded on it still stands (rt->mu held). A node that restarted
 * answers with another start time (or counters lower than before); an empty cache after the
 * last recorded prompt means the node evicted everything or keeps nothing. */
static void prefix_cache_update(rt_router *rt, rt_node *n, const Kvrelay__V1__Node *resp, int64_t asked_ms)
{
    if (n->node_since_unix_ms && resp->since_unix_ms != n->node_since_unix_ms) kv_forget(n, "it restarted");
    else if (resp->prefix_cache_lookups < n->cache_lookups) kv_forget(n, "its cache counters went back (a restart)");
    else if (!resp->prefix_cache_entries && asked_ms > n->kv_recorded_ms) kv_forget(n, "its prefix cache is empty");
    n->node_since_unix_ms = resp->since_unix_ms;
    n->cache_bytes = resp->prefix_cache_bytes;
    n->cache_budget = resp->prefix_cache_budget_bytes;
    n->cache_entries = resp->prefix_cache_entries;
    n->cache_lookups = resp->prefix_cache_lookups;
    n->cache_hits = resp->prefix_cache_hits;
    n->cache_reused = resp->prefix_cache_tokens_reused;
    chunk_update(rt, n, resp->prefill_chunk);
}

static void *poll_one(void *arg)
{
    poll_job *job = arg;
    rt_router *rt = job->rt;
    rt_node *n = job->node;
    if (job->if_ready) {
        pthread_mutex_lock(&rt->mu);
        kc_channel *ch = n->ch;
        pthread_mutex_unlock(&rt->mu);
        /* waiting here also drives the reconnection (rpc.h); a node that is back answers the
         * probe now instead of after the rest of the cooldown */
        if (!kc_channel_wait_connected(ch, RT_READY_WAIT_MS)) return NULL;
        kc_info(NULL, "node %s: connected again; probing it before its cooldown ends", n->id);
    }
    pthread_mutex_lock(&rt->mu);
    int64_t tokens = n->own_tokens, running = n->own_running, blocks = n->own_blocks;
    kc_channel *ch = n->ch;
    int64_t asked_ms = rt_now_ms();
    pthread_mutex_unlock(&rt->mu);

    Kvrelay__V1__NodeStatusRequest req = KVRELAY__V1__NODE_STATUS_REQUEST__INIT;
    Kvrelay__V1__Node *resp = NULL;
    kc_status st;
    const char *path = n->role == RT_ROLE_PREFILL ? "/kvrelay.v1.Prefill/Status" : "/kvrelay.v1.Decode/Status";
    int rc = kc_unary(ch, path, &req.base, &kvrelay__v1__node__descriptor, job->timeout_ms,
                      (ProtobufCMessage **)&resp, &st);

    pthread_mutex_lock(&rt->mu);
    n->polled = 1;
    if (rc == 0) {
        n->reachable = 1;
        n->state = resp->state;
        snprintf(n->transfer_address, sizeof n->transfer_address, "%s", resp->transfer_address);
        n->running = resp->running_requests;
        n->queued = resp->queued_requests;
        n->prefill_tokens = resp->outstanding_prefill_tokens;
        n->free_blocks = resp->free_kv_blocks;
        n->total_blocks = resp->total_kv_blocks;
        n->reserved_blocks = resp->reserved_kv_blocks;
        snprintf(n->status_fingerprint, sizeof n->status_fingerprint, "%s", resp->model_fingerprint ? resp->model_fingerprint : "");
        prefix_cache_update(job->rt, n, resp, asked_ms);
        if (resp->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING) n->refused_draining = 0;
        n->own_tokens_polled = tokens;
        n->own_running_polled = running;
        n->own_blocks_polled = blocks;
        n->error[0] = 0;
    } else {
        n->reachable = 0;
        snprintf(n->error, sizeof n->error, "%s: %s", kc_status_name(st.code), st.details);
    }
    /* a Status answer closes the breaker (the half-open probe, when it was open); a failure
     * counts like any failed call, and re-opens an open one for another cooldown */
    breaker_record(rt, n, rc != 0);
    pthread_mutex_unlock(&rt->mu);
    kc_message_free((ProtobufCMessage *)resp); /* NULL when the call failed */
    return NULL;
}

void rt_nodes_refresh(rt_router *rt, int64_t timeout_ms)
{
    rt_node *due[RT_NODES_MAX];
    char if_ready[RT_NODES_MAX];
    int n = 0;
    int64_t now = rt_now_ms();
    pthread_mutex_lock(&rt->mu);
    int64_t now_unix = unix_now_ms();
    for (int i = 0; i < rt->n_nodes; i++) {
        rt_node *x = rt->nodes[i];
        if (x->gone && now_unix - x->gone_unix_ms > RT_GONE_GRACE_MS) continue; /* see departing_usable */
        if (rt_breaker_allow(&x->breaker, rt->breaker_cooldown_ms, now)) if_ready[n] = 0, due[n++] = x; /* or the probe */
        else if (!x->gone) if_ready[n] = 1, due[n++] = x; /* suspect: watched for coming back */
    }
    pthread_mutex_unlock(&rt->mu);
    if (!n) return;
    poll_job *jobs = calloc((size_t)n, sizeof *jobs);
    pthread_t *threads = calloc((size_t)n, sizeof *threads);
    char *started = calloc((size_t)n, 1);
    if (!jobs || !threads || !started) {
        free(jobs);
        free(threads);
        free(started);
        return; /* the last known state stays; the next poll tries again */
    }
    for (int i = 0; i < n; i++) {
        jobs[i] = (poll_job){.rt = rt, .node = due[i], .timeout_ms = timeout_ms, .if_ready = if_ready[i]};
        started[i] = pthread_create(&threads[i], NULL, poll_one, &jobs[i]) == 0;
        if (!started[i]) poll_one(&jobs[i]);
    }
    for (int i = 0; i < n; i++)
        if (started[i]) pthread_join(threads[i], NULL);
    free(started);
    free(threads);
    free(jobs);
}

void *rt_poller_main(void *arg)
{
    rt_router *rt = arg;
    pthread_mutex_lock(&rt->mu);
    while (!rt->stopping) {
        pthread_mutex_unlock(&rt->mu);
        rt_nodes_refresh(rt, RT_STATUS_TIMEOUT_MS);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += RT_POLL_INTERVAL_MS * 1000000L;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        pthread_mutex_lock(&rt->mu);
        while (!rt->stopping && pthread_cond_timedwait(&rt->cv, &rt->mu, &until) == 0) {
        }
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}

/* ------------------------------------------------------------------ placement input */

static uint64_t corrected(uint64_t polled, int64_t own_now, int64_t own_then)
{
    int64_t v = (int64_t)polled + own_now - own_then;
    if (v < own_now) v = own_now; /* the node cannot have less than what we know we sent */
    return v < 0 ? 0 : (uint64_t)v;
}

const char *const rt_placed_names[RT_PLACED_REASONS] = {"prefix", "load", "no_prefix"};

/* The usable nodes of `role` in placement order (rt_nodes_order); with a chain c under kv-aware
 * placement, the prefill nodes' loads include what each would compute of the prompt, and
 * cached[i] (when not NULL) says what out[i] is predicted to hold. */
static int order_nodes(rt_router *rt, rt_role role, const rt_chain *c, rt_node *const *skip, int n_skip, rt_node **out,
                       int *cached)
{
    rt_load loads[RT_NODES_MAX];
    rt_node *cand[RT_NODES_MAX];
    int held[RT_NODES_MAX];
    int n = 0, kv = c && c->m && rt->placement == &rt_placement_kv_aware;
    int64_t now_unix = unix_now_ms();
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < rt->n_nodes; i++) {
        rt_node *x = rt->nodes[i];
        int departing = departing_usable(x, now_unix);
        if (x->role != role || (x->gone && !departing) || x->breaker.open || x->fingerprint_bad) continue;
        int skipped = 0;
        for (int k = 0; k < n_skip; k++) skipped |= skip[k] == x;
        if (skipped) continue;
        rt_load *l = &loads[n];
        /* serving: answered its last Status, or was never polled yet (optimistic, so the first
         * requests after start-up are not refused), and not draining */
        l->healthy = x->view == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING || departing;
        l->prefill_tokens = corrected(x->prefill_tokens, x->own_tokens, x->own_tokens_polled);
        l->running = corrected((uint64_t)x->running + (role == RT_ROLE_PREFILL ? x->queued : 0),
                               x->own_running, x->own_running_polled);
        int64_t free_now = (int64_t)x->free_blocks - (x->own_blocks - x->own_blocks_polled);
        l->free_blocks = free_now < 0 ? 0 : (uint64_t)free_now;
        /* every node computes the whole prompt but the prefix it holds; the rule compares the
         * differences, so the prompt's own length (the same for all) is left out */
        held[n] = kv ? rt_kv_index_match(x->kv, c) * c->chunk : 0;
        l->uncached_tokens = kv ? (uint64_t)((int64_t)c->m * c->chunk - held[n]) : 0;
        cand[n++] = x;
    }
    pthread_mutex_unlock(&rt->mu);
    if (!n) return 0;
    int order[RT_NODES_MAX];
    uint64_t turn = atomic_fetch_add(&rt->turn[role], 1);
    rt->placement->order(loads, n, role, turn, order);
    int most = 0;
    for (int i = 0; i < n; i++) {
        out[i] = cand[order[i]];
        if (cached) cached[i] = held[order[i]];
        if (loads[i].healthy && held[i] > most) most = held[i];
    }
    if (kv) {
        rt_placed why = !most ? RT_PLACED_NO_PREFIX : held[order[0]] == most ? RT_PLACED_PREFIX : RT_PLACED_LOAD;
        kc_counter_inc(rt->m.placements[why], 1);
    }
    return n;
}

int rt_nodes_order(rt_router *rt, rt_role role, rt_node *const *skip, int n_skip, rt_node **out)
{
    return order_nodes(rt, role, NULL, skip, n_skip, out, NULL);
}

int rt_nodes_order_prefill(rt_router *rt, const rt_chain *c, rt_node *const *skip, int n_skip, rt_node **out,
                           int *cached)
{
    return order_nodes(rt, RT_ROLE_PREFILL, c, skip, n_skip, out, cached);
}

void rt_node_record_prompt(rt_router *rt, rt_node *n, const rt_chain *c)
{
    if (rt->placement != &rt_placement_kv_aware || !c->m) return;
    pthread_mutex_lock(&rt->mu);
    /* a node that answered without a cache keeps nothing: recording would only mislead */
    if (!(n->reachable && !n->cache_budget)) {
        if (!n->kv) n->kv = rt_kv_index_create(rt->kv_index_blocks);
        rt_kv_index_insert(n->kv, c);
        n->kv_recorded_ms = rt_now_ms();
    }
    pthread_mutex_unlock(&rt->mu);
}

void rt_node_account(rt_router *rt, rt_node *n, int64_t tokens, int64_t running, int64_t blocks)
{
    pthread_mutex_lock(&rt->mu);
    n->own_tokens += tokens;
    n->own_running += running;
    n->own_blocks += blocks;
    pthread_mutex_unlock(&rt->mu);
}

int rt_nodes_healthy(void *user, char *reason, size_t cap)
{
    rt_router *rt = user;
    int prefill = 0, decode = 0;
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < rt->n_nodes; i++) {
        const rt_node *x = rt->nodes[i];
        if ((x->polled && !x->reachable) || x->gone || x->breaker.open || x->fingerprint_bad) continue;
        if (x->role == RT_ROLE_PREFILL) prefill++;
        else decode++;
    }
    int draining = rt->draining;
    pthread_mutex_unlock(&rt->mu);
    if (draining || !kc_health_serving(rt->health)) return snprintf(reason, cap, "not serving (shutting down)"), 0;
    if (!prefill) return snprintf(reason, cap, "no prefill node answers its Status"), 0;
    if (!decode) return snprintf(reason, cap, "no decode node answers its Status"), 0;
    return 1;
}

/* ------------------------------------------------------------------ Admin.ClusterStatus */

int rt_cluster_status(kc_call *call, const ProtobufCMessage *req, void *user)
{
    rt_router *rt = user;
    int64_t timeout = kc_call_ms_left(call);
    if (timeout > 1000) timeout = 1000;
    rt_nodes_refresh(rt, timeout > 0 ? timeout : 1);
    uint64_t p_free, p_total;
    int p_queued;
    rt_pressure level = rt_auto_pressure(rt, &p_free, &p_total, &p_queued);

    pthread_mutex_lock(&rt->mu);
    int n = rt->n_nodes; /* only grows: a node added after this is left out of this answer */
    pthread_mutex_unlock(&rt->mu);
    Kvrelay__V1__Node *nodes = calloc((size_t)n + 1, sizeof *nodes);
    Kvrelay__V1__Node **ptrs = calloc((size_t)n + 1, sizeof *ptrs);
    char (*transfer)[256] = calloc((size_t)n + 1, sizeof *transfer);
    if (!nodes || !ptrs || !transfer) {
        free(nodes);
        free(ptrs);
        free(transfer);
        return kc_call_error(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
    }
    Kvrelay__V1__Node *self = &nodes[0];
    *self = (Kvrelay__V1__Node)KVRELAY__V1__NODE__INIT;
    self->id = rt->id;
    self->role = KVRELAY__V1__NODE_ROLE__NODE_ROLE_ROUTER;
    self->grpc_address = rt->grpc_address;
    self->running_requests = (uint32_t)atomic_load(&rt->in_flight);
    self->queued_requests = (uint32_t)atomic_load(&rt->queued);
    self->since_unix_ms = rt->started_unix_ms;
    ptrs[0] = self;
    pthread_mutex_lock(&rt->mu);
    self->state = rt->draining ? KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING : KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING;
    int64_t now = unix_now_ms();
    size_t k = 1;
    for (int i = 0; i < n; i++) {
        const rt_node *x = rt->nodes[i];
        if (x->gone && now - x->gone_unix_ms > RT_GONE_LISTED_MS) continue;
        Kvrelay__V1__Node *o = &nodes[k];
        *o = (Kvrelay__V1__Node)KVRELAY__V1__NODE__INIT;
        o->id = (char *)x->id;
        o->role = x->role == RT_ROLE_PREFILL ? KVRELAY__V1__NODE_ROLE__NODE_ROLE_PREFILL : KVRELAY__V1__NODE_ROLE__NODE_ROLE_DECODE;
        o->grpc_address = (char *)x->member.grpc;
        o->state = x->view;
        o->since_unix_ms = x->view_since_unix_ms;
        if (x->reachable) {
            snprintf(transfer[k], sizeof transfer[k], "%s", x->transfer_address);
            o->transfer_address = transfer[k];
            o->running_requests = x->running;
            o->queued_requests = x->queued;
            o->outstanding_prefill_tokens = x->prefill_tokens;
            o->free_kv_blocks = x->free_blocks;
            o->total_kv_blocks = x->total_blocks;
            o->reserved_kv_blocks = x->reserved_blocks;
            o->prefix_cache_bytes = x->cache_bytes;
            o->prefix_cache_budget_bytes = x->cache_budget;
            o->prefix_cache_entries = x->cache_entries;
            o->prefix_cache_lookups = x->cache_lookups;
            o->prefix_cache_hits = x->cache_hits;
            o->prefix_cache_tokens_reused = x->cache_reused;
            o->model_fingerprint = (char *)x->status_fingerprint;
        }
        ptrs[k++] = o;
    }
    Kvrelay__V1__ClusterStatusResponse resp = KVRELAY__V1__CLUSTER_STATUS_RESPONSE__INIT;
    resp.n_nodes = k;
    resp.nodes = ptrs;
    resp.pressure = (char *)rt_pressure_name(level);
    resp.pressure_free_blocks = p_free;
    resp.pressure_total_blocks = p_total;
    resp.pressure_queued = (uint32_t)p_queued;
    kc_call_send(call, &resp.base); /* packed at once (never blocks), before an address can change */
    pthread_mutex_unlock(&rt->mu);
    free(transfer);
    free(ptrs);
    free(nodes);
    return GRPC_STATUS_OK;
}
