/*
 * watch.c - the cancel watcher of kvrelay-router: a thread that, every RT_WATCH_MS, looks at
 * every open decode stream (rt->active) and cancels the stream of a client that went away (its
 * handler may be blocked reading that stream; the decode node frees the slot at once) or of a
 * node silent for --decode-stall-ms (a frozen node keeps its socket open). Also the timed
 * condition wait the router's threads share.
 * Not the membership watch: etcd membership is followed by main.c (kc_watch) into nodes.c.
 * Tested by tests/integration/failures.sh (a frozen decode node) and test_router_cluster
 * (clients that cancel mid-stream).
 */
#include "request.h"

#include <time.h>

void rt_active_add(rt_router *rt, rt_active *a)
{
    pthread_mutex_lock(&rt->mu);
    a->next = rt->active;
    rt->active = a;
    pthread_mutex_unlock(&rt->mu);
}

void rt_active_remove(rt_router *rt, rt_active *a)
{
    pthread_mutex_lock(&rt->mu);
    for (rt_active **p = &rt->active; *p; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    pthread_mutex_unlock(&rt->mu);
}

void rt_cond_wait_ms(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t ms)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += ms / 1000;
    until.tv_nsec += (ms % 1000) * 1000000L;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(cv, mu, &until);
}

void *rt_watcher_main(void *arg)
{
    rt_router *rt = arg;
    pthread_mutex_lock(&rt->mu);
    while (!rt->stopping) {
        int64_t now = rt_now_ms();
        for (rt_active *a = rt->active; a; a = a->next) {
            if (a->sink->cancelled(a->sink->ctx)) kc_stream_cancel(a->stream); /* idempotent */
            else if (now - atomic_load(&a->last_ms) > rt->decode_stall_ms && !atomic_exchange(&a->stalled, 1))
                kc_stream_cancel(a->stream); /* a frozen node keeps its socket open: give up on it */
        }
        rt_cond_wait_ms(&rt->cv, &rt->mu, RT_WATCH_MS);
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}
