/*
 * nodes.c - the router's view of its prefill and decode nodes: one gRPC channel each, their
 * Status polled every RT_POLL_INTERVAL_MS (and on demand by Admin.ClusterStatus), and the load
 * estimates placement orders them by: the node's last answer corrected by what this router
 * started or finished on it since that answer was asked for, so a burst of requests between two
 * polls does not all land on the node that looked emptiest. Several routers would each see only
 * their own corrections (a known limit, docs/router.md).
 */
#include "router.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int64_t rt_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

int rt_nodes_init(rt_router *rt, const rt_members *ms, char *err)
{
    int n = ms->n_prefill + ms->n_decode;
    rt->nodes = calloc((size_t)n, sizeof *rt->nodes);
    if (!rt->nodes) {
        snprintf(err, KR_ERR_MAX, "out of memory");
        return -1;
    }
    rt->n_prefill = ms->n_prefill;
    rt->n_decode = ms->n_decode;
    for (int i = 0; i < n; i++) {
        rt_node *node = &rt->nodes[i];
        const rt_member *m = i < ms->n_prefill ? &ms->prefill[i] : &ms->decode[i - ms->n_prefill];
        node->role = i < ms->n_prefill ? RT_ROLE_PREFILL : RT_ROLE_DECODE;
        snprintf(node->id, sizeof node->id, "%s", m->id);
        snprintf(node->address, sizeof node->address, "%s", m->address);
        snprintf(node->error, sizeof node->error, "not polled yet");
        kc_status st;
        if (kc_channel_create(node->address, 0, &node->ch, &st) != 0) {
            snprintf(err, KR_ERR_MAX, "node %s (%.200s): %.200s", node->id, node->address, st.details);
            rt_nodes_free(rt);
            return -1;
        }
    }
    return 0;
}

void rt_nodes_free(rt_router *rt)
{
    if (!rt->nodes) return;
    for (int i = 0; i < rt->n_prefill + rt->n_decode; i++) kc_channel_destroy(rt->nodes[i].ch);
    free(rt->nodes);
    rt->nodes = NULL;
}

rt_node *rt_nodes_of(rt_router *rt, rt_role role, int *n)
{
    *n = role == RT_ROLE_PREFILL ? rt->n_prefill : rt->n_decode;
    return role == RT_ROLE_PREFILL ? rt->nodes : rt->nodes + rt->n_prefill;
}

/* ------------------------------------------------------------------ polling */

typedef struct poll_job {
    rt_router *rt;
    rt_node *node;
    int64_t timeout_ms;
} poll_job;

static void *poll_one(void *arg)
{
    poll_job *job = arg;
    rt_router *rt = job->rt;
    rt_node *n = job->node;
    pthread_mutex_lock(&rt->mu);
    int64_t tokens = n->own_tokens, running = n->own_running, blocks = n->own_blocks;
    pthread_mutex_unlock(&rt->mu);

    Kvrelay__V1__NodeStatusRequest req = KVRELAY__V1__NODE_STATUS_REQUEST__INIT;
    Kvrelay__V1__Node *resp = NULL;
    kc_status st;
    const char *path = n->role == RT_ROLE_PREFILL ? "/kvrelay.v1.Prefill/Status" : "/kvrelay.v1.Decode/Status";
    int rc = kc_unary(n->ch, path, &req.base, &kvrelay__v1__node__descriptor, job->timeout_ms,
                      (ProtobufCMessage **)&resp, &st);

    pthread_mutex_lock(&rt->mu);
    int was_reachable = n->reachable || !n->polled;
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
        n->since_unix_ms = resp->since_unix_ms;
        n->own_tokens_polled = tokens;
        n->own_running_polled = running;
        n->own_blocks_polled = blocks;
        n->error[0] = 0;
    } else {
        n->reachable = 0;
        snprintf(n->error, sizeof n->error, "%s: %s", kc_status_name(st.code), st.details);
    }
    int now_reachable = n->reachable;
    pthread_mutex_unlock(&rt->mu);
    /* log transitions only: a dead node must not fill the log twice a second */
    if (was_reachable && !now_reachable)
        kc_warn(NULL, "node %s (%s) unreachable: %s: %s", n->id, n->address, kc_status_name(st.code), st.details);
    else if (!was_reachable && now_reachable)
        kc_info(NULL, "node %s (%s) reachable again", n->id, n->address);
    kc_message_free((ProtobufCMessage *)resp); /* NULL when the call failed */
    return NULL;
}

void rt_nodes_refresh(rt_router *rt, int64_t timeout_ms)
{
    int n = rt->n_prefill + rt->n_decode;
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
        jobs[i] = (poll_job){.rt = rt, .node = &rt->nodes[i], .timeout_ms = timeout_ms};
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

void rt_nodes_order(rt_router *rt, rt_role role, int *order)
{
    int n;
    rt_node *nodes = rt_nodes_of(rt, role, &n);
    rt_load loads[RT_MEMBERS_MAX];
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < n; i++) {
        const rt_node *x = &nodes[i];
        rt_load *l = &loads[i];
        /* never polled yet: optimistic, so the first requests after start-up are not refused */
        l->healthy = !x->polled || (x->reachable && x->state != KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING);
        l->prefill_tokens = corrected(x->prefill_tokens, x->own_tokens, x->own_tokens_polled);
        l->running = corrected((uint64_t)x->running + (role == RT_ROLE_PREFILL ? x->queued : 0),
                               x->own_running, x->own_running_polled);
        int64_t free_now = (int64_t)x->free_blocks - (x->own_blocks - x->own_blocks_polled);
        l->free_blocks = free_now < 0 ? 0 : (uint64_t)free_now;
    }
    pthread_mutex_unlock(&rt->mu);
    uint64_t turn = atomic_fetch_add(&rt->turn[role], 1);
    rt->placement->order(loads, n, role, turn, order);
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
    for (int i = 0; i < rt->n_prefill + rt->n_decode; i++) {
        const rt_node *x = &rt->nodes[i];
        if (x->polled && !x->reachable) continue;
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

    int n = rt->n_prefill + rt->n_decode;
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
    for (int i = 0; i < n; i++) {
        const rt_node *x = &rt->nodes[i];
        Kvrelay__V1__Node *o = &nodes[i + 1];
        *o = (Kvrelay__V1__Node)KVRELAY__V1__NODE__INIT;
        o->id = (char *)x->id;
        o->role = x->role == RT_ROLE_PREFILL ? KVRELAY__V1__NODE_ROLE__NODE_ROLE_PREFILL : KVRELAY__V1__NODE_ROLE__NODE_ROLE_DECODE;
        o->grpc_address = (char *)x->address;
        if (x->reachable) {
            o->state = x->state;
            snprintf(transfer[i + 1], sizeof transfer[i + 1], "%s", x->transfer_address);
            o->transfer_address = transfer[i + 1];
            o->running_requests = x->running;
            o->queued_requests = x->queued;
            o->outstanding_prefill_tokens = x->prefill_tokens;
            o->free_kv_blocks = x->free_blocks;
            o->total_kv_blocks = x->total_blocks;
            o->reserved_kv_blocks = x->reserved_blocks;
            o->since_unix_ms = x->since_unix_ms;
        } else {
            o->state = KVRELAY__V1__NODE_STATE__NODE_STATE_UNREACHABLE;
        }
        ptrs[i + 1] = o;
    }
    pthread_mutex_unlock(&rt->mu);
    Kvrelay__V1__ClusterStatusResponse resp = KVRELAY__V1__CLUSTER_STATUS_RESPONSE__INIT;
    resp.n_nodes = (size_t)n + 1;
    resp.nodes = ptrs;
    kc_call_send(call, &resp.base); /* packed at once: the arrays may go */
    free(transfer);
    free(ptrs);
    free(nodes);
    return GRPC_STATUS_OK;
}
