/*
 * admission.c - how a request gets its nodes: the admission FIFO (docs/router.md,
 * "Admission") and the placement loop around it. A request that finds no node with room waits
 * in the FIFO, in arrival order, and only the head tries to place itself, so that no request
 * overtakes an earlier one; a request that arrives while others wait joins the end at once.
 * Re-placements after a failure (--migrate) are admitted already and do not queue. Each
 * attempt is Reserve (reserve.c) then Prefill (prefill.c); a failed node is skipped and the
 * request placed again at once, full nodes mean an exponential backoff, and the wait ends at the
 * request's deadline or --max-queue-ms.
 * Not the placement order (placement.c) nor the node table (nodes.c).
 * Tested by tests/integration/admission.sh (FIFO order under overload, --max-queue-ms) and
 * bench/overload.sh.
 */
#include "request.h"

#include <inttypes.h>
#include <stdio.h>

enum {
    RT_BACKOFF_MIN_MS = 10,
    RT_BACKOFF_MAX_MS = 500,
};

/* One request in the FIFO. The list is guarded by rt->mu; fifo_cv wakes the waiters when the
 * head changes. */
struct rt_waiter {
    rt_waiter *next;
    int64_t since_ms; /* rt_now_ms() at joining */
};

static void fifo_join(rt_router *rt, rt_waiter *w)
{
    w->next = NULL;
    w->since_ms = rt_now_ms();
    pthread_mutex_lock(&rt->mu);
    if (rt->fifo_tail) rt->fifo_tail->next = w;
    else rt->fifo_head = w;
    rt->fifo_tail = w;
    pthread_mutex_unlock(&rt->mu);
    atomic_fetch_add(&rt->queued, 1);
    kc_gauge_inc(rt->m.queued, 1);
}

static void fifo_leave(rt_router *rt, rt_waiter *w)
{
    pthread_mutex_lock(&rt->mu);
    rt_waiter *prev = NULL;
    for (rt_waiter *it = rt->fifo_head; it; prev = it, it = it->next)
        if (it == w) {
            if (prev) prev->next = w->next;
            else rt->fifo_head = w->next;
            if (rt->fifo_tail == w) rt->fifo_tail = prev;
            break;
        }
    pthread_cond_broadcast(&rt->fifo_cv);
    pthread_mutex_unlock(&rt->mu);
    kc_gauge_inc(rt->m.queued, -1);
    atomic_fetch_sub(&rt->queued, 1);
}

/* Waits (at most RT_WATCH_MS) until w heads the FIFO; returns 1 when it does. */
static int fifo_wait_turn(rt_router *rt, rt_waiter *w)
{
    pthread_mutex_lock(&rt->mu);
    if (rt->fifo_head != w) rt_cond_wait_ms(&rt->fifo_cv, &rt->mu, RT_WATCH_MS);
    int head = rt->fifo_head == w;
    pthread_mutex_unlock(&rt->mu);
    return head;
}

static int fifo_busy(rt_router *rt)
{
    pthread_mutex_lock(&rt->mu);
    int busy = rt->fifo_head != NULL;
    pthread_mutex_unlock(&rt->mu);
    return busy;
}

/* Reserve + prefill, retried as docs/router.md and docs/failures.md say, in the admission FIFO
 * while there is no room, until done, the deadline or --max-queue-ms. */
grpc_status_code rt_place(rt_req *r, Kvrelay__V1__PrefillResponse **out, kc_status *st)
{
    rt_router *rt = r->rt;
    int64_t backoff = RT_BACKOFF_MIN_MS;
    rt_waiter w;
    int queued = 0, may_queue = r->migrations == 0;
    grpc_status_code code;
    r->prefill_failures = 0;
    for (;;) {
        if (r->sink->cancelled(r->sink->ctx)) {
            rt_req_client_gone(r, st, "before the request was placed");
            code = st->code;
            break;
        }
        if (!queued && may_queue && fifo_busy(rt)) { /* others wait already: behind them */
            fifo_join(rt, &w);
            queued = 1;
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "requests before it are waiting for room");
        }
        int64_t waited = queued ? rt_now_ms() - w.since_ms : 0;
        if (queued && (rt_req_ms_left(r) <= 0 || waited > rt->max_queue_ms)) {
            char why[sizeof st->details];
            snprintf(why, sizeof why, "%s", st->details);
            if (rt_req_ms_left(r) <= 0)
                kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s; gave up at the request's deadline", why);
            else
                kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s; gave up after %" PRId64 " ms (--max-queue-ms)",
                              why, waited);
            code = st->code;
            break;
        }
        if (queued && !fifo_wait_turn(rt, &w)) continue; /* an earlier request goes first */
        rt_req_phase(r, RT_PHASE_PLACING);
        rt_attempt a = r->score_only ? RT_ATTEMPT_DONE : rt_reserve(r, st); /* scoring ships nothing */
        if (a == RT_ATTEMPT_DONE) a = rt_prefill(r, out, st);
        if (a == RT_ATTEMPT_DONE) {
            code = GRPC_STATUS_OK;
            break;
        }
        if (a == RT_ATTEMPT_FAIL) {
            code = st->code;
            break;
        }
        if (a == RT_ATTEMPT_AGAIN) continue;
        /* every node is full: the head of the FIFO waits (waking early if the client goes away)
         * and tries again; the deadline and --max-queue-ms are checked above */
        if (!queued && may_queue) {
            fifo_join(rt, &w);
            queued = 1;
        }
        if (queued) rt_req_phase(r, RT_PHASE_QUEUED);
        int64_t left = rt_req_ms_left(r), wait = backoff < left ? backoff : left > 0 ? left : 0;
        kc_debug(r->id, "%s; retrying in %" PRId64 " ms", st->details, wait);
        if (!queued && wait <= 0) { /* a re-placement: no FIFO, the deadline only */
            char why[sizeof st->details];
            snprintf(why, sizeof why, "%s", st->details);
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s; gave up at the request's deadline", why);
            code = st->code;
            break;
        }
        r->sink->wait(r->sink->ctx, wait);
        backoff = backoff * 2 > RT_BACKOFF_MAX_MS ? RT_BACKOFF_MAX_MS : backoff * 2;
    }
    if (queued) {
        r->queue_s += (double)(rt_now_ms() - w.since_ms) / 1000.0;
        fifo_leave(rt, &w);
    }
    return code;
}
