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

typedef struct kc_health kc_health;

/* Registers Check and Watch on `srv` (before kc_server_start). `services` is a NULL-terminated
 * list of service names reported besides "" (e.g. "kvrelay.v1.Generation"); all start
 * SERVING. Returns NULL when registration fails. Free after kc_server_destroy. */
kc_health *kc_health_register(kc_server *srv, const char *const *services);
/* Sets every service's status (1 = SERVING, 0 = NOT_SERVING, e.g. while draining). */
void kc_health_set_serving(kc_health *h, int serving);
void kc_health_free(kc_health *h);

#endif /* KC_HEALTH_H */
