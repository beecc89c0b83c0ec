/*
 * http.h - the small HTTP endpoint every process serves beside gRPC (libmicrohttpd, its own
 * threads): GET /metrics renders a kc_registry in the Prometheus text format; GET /healthz
 * answers 200 "ok\n" while the process is healthy and 503 with the reason otherwise (the
 * liveness/readiness probe of deploy/); anything else is 404, methods other than GET/HEAD 405.
 * Test: ctest -R test_http.
 */
#ifndef KC_HTTP_H
#define KC_HTTP_H

#include "metrics.h"

typedef struct kc_http kc_http;

/* Health callback: return 1 when healthy; otherwise write a one-line reason into
 * `reason` (cap bytes) and return 0. Called on libmicrohttpd's threads. NULL: always healthy. */
typedef int (*kc_health_fn)(void *user, char *reason, size_t cap);

/* Serves on host:port (port 0: ephemeral; *port_out gets the bound port). Returns NULL with a
 * message in err (256 bytes) when the port cannot be bound. */
kc_http *kc_http_start(const char *host, int port, kc_registry *reg, kc_health_fn health,
                       void *health_user, int *port_out, char *err);
void kc_http_stop(kc_http *h); /* NULL is fine */

#endif /* KC_HTTP_H */
