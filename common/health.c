/*
 * health.c - grpc.health.v1.Health on a kc_server (health.h). One status for the whole process
 * (SERVING or NOT_SERVING), reported for "" and for every service name registered.
 * Check answers from it at once. Watch runs on its handler thread: it sends the current status,
 * then sleeps on the health object's condition variable, so a change is sent as soon as
 * kc_health_set_serving makes it; it wakes every WATCH_POLL_MS to notice a cancelled call (the
 * client went away, or kc_server_destroy is cancelling every call), because kc_call has no way
 * to wake another object's waiter. A Watch of an unknown service gets SERVICE_UNKNOWN and stays
 * open, as the protocol says.
 * Not here: per-service statuses (not needed yet: a node drains as a whole).
 * Test: ctest -R test_health.
 */
#include "health.h"

#include "grpc/health/v1/health.pb-c.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HEALTH_CHECK_PATH "/grpc.health.v1.Health/Check"
#define HEALTH_WATCH_PATH "/grpc.health.v1.Health/Watch"
/* How late a Watch may notice that its call was cancelled (and so delay server shutdown). */
#define WATCH_POLL_MS 50

typedef Grpc__Health__V1__HealthCheckResponse__ServingStatus serving_status;

struct kc_health {
    char **services; /* [n_services] names reported besides "" */
    int n_services;

    pthread_mutex_t mu; /* guards serving and version */
    pthread_cond_t cv;  /* version changed (CLOCK_MONOTONIC) */
    int serving;
    uint64_t version; /* bumped on every change, so a watcher misses none */
};

static int service_known(const kc_health *h, const char *name)
{
    if (!name[0]) return 1;
    for (int i = 0; i < h->n_services; i++)
        if (strcmp(h->services[i], name) == 0) return 1;
    return 0;
}

static serving_status status_locked(const kc_health *h, const char *service)
{
    if (!service_known(h, service))
        return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    return h->serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static int send_status(kc_call *call, serving_status st)
{
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = st;
    return kc_call_send(call, &resp.base);
}

static int on_check(kc_call *call, const ProtobufCMessage *req, void *user)
{
    kc_health *h = user;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    if (!service_known(h, r->service))
        return kc_call_error(call, GRPC_STATUS_NOT_FOUND, "unknown service '%.200s'", r->service);
    pthread_mutex_lock(&h->mu);
    serving_status st = status_locked(h, r->service);
    pthread_mutex_unlock(&h->mu);
    send_status(call, st);
    return GRPC_STATUS_OK;
}

static void deadline_in(struct timespec *t, int ms)
{
    clock_gettime(CLOCK_MONOTONIC, t);
    t->tv_nsec += (long)ms * 1000000L;
    t->tv_sec += t->tv_nsec / 1000000000L;
    t->tv_nsec %= 1000000000L;
}

static int on_watch(kc_call *call, const ProtobufCMessage *req, void *user)
{
    kc_health *h = user;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    pthread_mutex_lock(&h->mu);
    serving_status sent = status_locked(h, r->service);
    uint64_t seen = h->version;
    pthread_mutex_unlock(&h->mu);
    if (send_status(call, sent) != 0) return GRPC_STATUS_CANCELLED;
    while (!kc_call_cancelled(call)) {
        struct timespec until;
        deadline_in(&until, WATCH_POLL_MS);
        pthread_mutex_lock(&h->mu);
        while (h->version == seen && pthread_cond_timedwait(&h->cv, &h->mu, &until) == 0) {
        }
        seen = h->version;
        serving_status now = status_locked(h, r->service);
        pthread_mutex_unlock(&h->mu);
        if (now != sent) { /* a flip and back between two wake-ups is not news */
            if (send_status(call, now) != 0) break;
            sent = now;
        }
    }
    /* The call's deadline passed: say so, as gRPC would. This side sees the deadline a little
     * before the client does (it arrives as a relative timeout), so a CANCELLED sent here
     * would reach the client ahead of its own DEADLINE_EXCEEDED. Otherwise the client cancelled
     * or the server is stopping, and nobody reads the status. */
    if (kc_call_ms_left(call) <= 0) return kc_call_error(call, GRPC_STATUS_DEADLINE_EXCEEDED, "watch deadline passed");
    return kc_call_error(call, GRPC_STATUS_CANCELLED, "watch ended");
}

kc_health *kc_health_register(kc_server *srv, const char *const *services)
{
    kc_health *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->serving = 1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->cv, &ca);
    pthread_condattr_destroy(&ca);
    int n = 0;
    while (services && services[n])
        n++;
    h->services = calloc((size_t)n + 1, sizeof *h->services);
    if (!h->services) goto err_free;
    for (h->n_services = 0; h->n_services < n; h->n_services++) {
        h->services[h->n_services] = strdup(services[h->n_services]);
        if (!h->services[h->n_services]) goto err_free;
    }
    if (kc_server_add_unary(srv, HEALTH_CHECK_PATH,
                            &grpc__health__v1__health_check_request__descriptor, on_check, h) != 0)
        goto err_free;
    /* Check is registered and cannot be taken back: the caller treats NULL as a start-up error
     * and destroys the server unstarted, so no call ever reaches the freed object. */
    if (kc_server_add_stream(srv, HEALTH_WATCH_PATH,
                             &grpc__health__v1__health_check_request__descriptor, on_watch, h) != 0)
        goto err_free;
    return h;

err_free:
    kc_health_free(h);
    return NULL;
}

void kc_health_set_serving(kc_health *h, int serving)
{
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    if (h->serving != !!serving) {
        h->serving = !!serving;
        h->version++;
        pthread_cond_broadcast(&h->cv);
    }
    pthread_mutex_unlock(&h->mu);
}

int kc_health_serving(kc_health *h)
{
    if (!h) return 0;
    pthread_mutex_lock(&h->mu);
    int v = h->serving;
    pthread_mutex_unlock(&h->mu);
    return v;
}

int kc_health_http_check(void *health, char *reason, size_t cap)
{
    if (kc_health_serving(health)) return 1;
    snprintf(reason, cap, "not serving");
    return 0;
}

void kc_health_free(kc_health *h)
{
    if (!h) return;
    for (int i = 0; i < h->n_services; i++)
        free(h->services[i]);
    free(h->services);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
}
