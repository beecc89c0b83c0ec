/*
 * http.h - the small HTTP endpoint every process serves beside gRPC (libmicrohttpd, its own
 * threads): GET /metrics renders a kc_registry in the Prometheus text format; GET /healthz
 * answers 200 "ok\n" while the process is healthy and 503 with the reason otherwise (the
 * liveness/readiness probe of deploy/); methods other than GET/HEAD on those are 405; any other
 * URL goes to the process's own routes when it has some (kc_http_start_app), else 404.
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

struct MHD_Connection;

/* A process's own routes beside /metrics and /healthz (the router's OpenAI API): every request
 * to another URL, whatever its method, is handed to `fn` on its connection's thread once its
 * whole body has arrived. `body` is NUL-terminated and valid during the call; NULL when the body
 * was over `max_body` bytes (answer 413). `fn` queues a libmicrohttpd response on `conn` (it may
 * be a streamed one) and returns MHD_queue_response's result. */
typedef int (*kc_http_app_fn)(void *user, struct MHD_Connection *conn, const char *method,
                              const char *url, const char *body, size_t body_len);
typedef struct kc_http_app {
    kc_http_app_fn fn;
    void *user;
    size_t max_body;     /* bytes; 0 = 1 MiB */
    int max_connections; /* connections served at once (each on a thread); 0 = 64 */
    /* Both set: HTTPS (GnuTLS through libmicrohttpd) with this certificate chain and key, PEM
     * text that must stay valid until kc_http_stop; the whole port, /metrics included, is then
     * TLS. NULL: plain HTTP. */
    const char *tls_cert_pem, *tls_key_pem;
} kc_http_app;

/* kc_http_start with the routes of `app` (NULL: none, every other URL is 404). */
kc_http *kc_http_start_app(const char *host, int port, kc_registry *reg, kc_health_fn health,
                           void *health_user, const kc_http_app *app, int *port_out, char *err);
void kc_http_stop(kc_http *h); /* NULL is fine */

#endif /* KC_HTTP_H */
