/*
 * health.h - the standard gRPC health service (grpc.health.v1.Health, proto/grpc/health/v1)
 * on a kc_server: Check answers SERVING or NOT_SERVING for "" (the whole server) and for each
 * service name registered here, NOT_FOUND for others; Watch sends the current status, then a
 * new message whenever it changes, until the client cancels or the server stops.
 * Test: ctest -R test_health.
 */
#ifndef KC_HEALTH_H
#define KC_HEALTH_H

#include "rpc.h"

#include <stddef.h>

typedef struct kc_health kc_health;

/* Registers Check and Watch on `srv` (before kc_server_start). `services` is a NULL-terminated
 * list of service names reported besides "" (e.g. "kvrelay.v1.Generation"); all start
 * SERVING. Returns NULL when registration fails (a start-up error: destroy the server without
 * starting it). Free after kc_server_destroy. */
kc_health *kc_health_register(kc_server *srv, const char *const *services);
/* Sets every service's status (1 = SERVING, 0 = NOT_SERVING, e.g. while draining); open Watch
 * streams get the new status at once. Thread-safe. */
void kc_health_set_serving(kc_health *h, int serving);
/* 1 while SERVING. */
int kc_health_serving(kc_health *h);
/* A kc_health_fn (http.h) for kc_http_start with `health` = the kc_health, so /healthz and the
 * gRPC health service agree: 503 "not serving" after kc_health_set_serving(h, 0). */
int kc_health_http_check(void *health, char *reason, size_t cap);
void kc_health_free(kc_health *h);

#endif /* KC_HEALTH_H */
