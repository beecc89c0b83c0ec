/*
 * http.c - the /metrics and /healthz endpoint of http.h on libmicrohttpd 0.9.75 (Debian 12):
 * one listening thread plus a thread per connection (scrapes and probes are rare and short, and
 * a slow client then holds up nobody), bound to the resolved host with MHD_OPTION_SOCK_ADDR,
 * the port read back with MHD_DAEMON_INFO_BIND_PORT. libmicrohttpd's own error messages are
 * caught by a logger: while starting they become the caller's error text (a busy port says
 * "Address already in use"), afterwards they go to kc_log.
 * A process may add its own routes (kc_http_start_app): their request bodies are gathered here,
 * up to a cap, and handed over whole.
 * HTTPS when the app gives a certificate and key (MHD_USE_TLS: GnuTLS); no client certificates.
 * Not here: keep-alive tuning.
 * Test: ctest -R test_http.
 */
#include "http.h"

#include "log.h"

#include <microhttpd.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

/* Connections served at once, each on its own thread; more are refused by libmicrohttpd. */
#define KC_HTTP_MAX_CONNECTIONS 64
/* The default cap on an app route's request body. */
#define KC_HTTP_MAX_BODY (1u << 20)
/* Seconds a connection may stay idle before it is closed. */
#define KC_HTTP_IDLE_TIMEOUT_S 10

#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define TEXT_CONTENT_TYPE "text/plain; charset=utf-8"
/* The size of the caller's error buffer (http.h). */
#define ERR_CAP 256

struct kc_http {
    struct MHD_Daemon *daemon;
    kc_registry *reg;
    kc_health_fn health;
    void *health_user;
    kc_http_app app; /* fn NULL: no routes of the process's own */
    atomic_int starting;   /* 1 while MHD_start_daemon runs: errors go to start_error */
    char start_error[200]; /* libmicrohttpd's first complaint while starting */
};

/* libmicrohttpd's messages: kept as the start error while starting, logged afterwards. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    kc_http *h = cls;
    char msg[256];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    if (atomic_load(&h->starting)) {
        if (!h->start_error[0]) snprintf(h->start_error, sizeof h->start_error, "%s", msg);
        return;
    }
    kc_warn(NULL, "http: %s", msg);
}

/* Queues a response of `len` bytes from `body` (freed by libmicrohttpd when `owned`). */
static enum MHD_Result respond(struct MHD_Connection *conn, unsigned status, const char *ctype,
                               char *body, size_t len, int owned)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, body, owned ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_MUST_COPY);
    if (!r) {
        if (owned) free(body);
        return MHD_NO; /* out of memory: libmicrohttpd closes the connection */
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result respond_text(struct MHD_Connection *conn, unsigned status, const char *text)
{
    return respond(conn, status, TEXT_CONTENT_TYPE, (char *)text, strlen(text), 0);
}

static enum MHD_Result serve_healthz(kc_http *h, struct MHD_Connection *conn)
{
    char reason[256] = "";
    if (!h->health || h->health(h->health_user, reason, sizeof reason))
        return respond_text(conn, MHD_HTTP_OK, "ok\n");
    reason[sizeof reason - 1] = '\0'; /* whatever the callback wrote, it ends here */
    for (char *p = reason; *p; p++)   /* one line, as promised */
        if (*p == '\n' || *p == '\r') *p = ' ';
    char body[sizeof reason + 2];
    snprintf(body, sizeof body, "%s\n", reason[0] ? reason : "unhealthy");
    return respond_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, body);
}

/* An app route's request as it arrives: the body gathered up to the cap. */
typedef struct app_request {
    char *body; /* len bytes + NUL */
    size_t len, cap;
    int too_large; /* over the cap: the rest is read and dropped */
} app_request;

/* Gathers the body of an app route's request over libmicrohttpd's calls, then hands it over. */
static enum MHD_Result serve_app(kc_http *h, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *upload_data, size_t *upload_data_size, void **con_cls)
{
    app_request *q = *con_cls;
    if (!q) { /* the headers are in: the body (if any) comes next */
        q = calloc(1, sizeof *q);
        if (!q) return MHD_NO;
        *con_cls = q;
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (q->too_large || q->len + n > h->app.max_body) {
            q->too_large = 1;
            return MHD_YES;
        }
        if (q->len + n + 1 > q->cap) {
            size_t cap = (q->len + n + 1) * 2;
            if (cap > h->app.max_body + 1) cap = h->app.max_body + 1;
            char *grown = realloc(q->body, cap);
            if (!grown) return MHD_NO;
            q->body = grown;
            q->cap = cap;
        }
        memcpy(q->body + q->len, upload_data, n);
        q->len += n;
        q->body[q->len] = '\0';
        return MHD_YES;
    }
    return (enum MHD_Result)h->app.fn(h->app.user, conn, method, url,
                                      q->too_large ? NULL : q->body ? q->body : "", q->too_large ? 0 : q->len);
}

/* libmicrohttpd's end-of-request notice: frees what serve_app gathered. */
static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void)cls, (void)conn, (void)toe;
    app_request *q = *con_cls;
    if (!q) return;
    free(q->body);
    free(q);
    *con_cls = NULL;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    kc_http *h = cls;
    int ours = strcmp(url, "/metrics") == 0 || strcmp(url, "/healthz") == 0;
    if (!ours && h->app.fn) return serve_app(h, conn, url, method, upload_data, upload_data_size, con_cls);
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return respond_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n");
    if (strcmp(url, "/metrics") == 0) {
        size_t len = 0;
        char *text = h->reg ? kc_registry_render(h->reg, &len) : calloc(1, 1);
        if (!text) return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
        return respond(conn, MHD_HTTP_OK, METRICS_CONTENT_TYPE, text, len, 1);
    }
    if (strcmp(url, "/healthz") == 0) return serve_healthz(h, conn);
    return respond_text(conn, MHD_HTTP_NOT_FOUND, "not found\n");
}

/* Resolves host (a name, an IPv4 address, or an IPv6 one with or without brackets; "" or NULL:
 * every IPv4 interface) into *ss. Returns 0, or -1 with err set. */
static int resolve(const char *host, int port, struct sockaddr_storage *ss, char *err)
{
    char name[256];
    if (!host || !*host) host = "0.0.0.0";
    size_t n = strlen(host);
    if (host[0] == '[' && n >= 2 && host[n - 1] == ']') {
        host++;
        n -= 2;
    }
    if (n >= sizeof name) {
        snprintf(err, ERR_CAP, "http: host name too long (%zu bytes)", n);
        return -1;
    }
    memcpy(name, host, n);
    name[n] = '\0';
    char service[8];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int e = getaddrinfo(name, service, &hints, &res);
    if (e != 0 || !res) {
        snprintf(err, ERR_CAP, "http: cannot resolve host '%.100s': %s", name,
                 e ? gai_strerror(e) : "no address");
        return -1;
    }
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return 0;
}

kc_http *kc_http_start(const char *host, int port, kc_registry *reg, kc_health_fn health,
                       void *health_user, int *port_out, char *err)
{
    return kc_http_start_app(host, port, reg, health, health_user, NULL, port_out, err);
}

kc_http *kc_http_start_app(const char *host, int port, kc_registry *reg, kc_health_fn health,
                           void *health_user, const kc_http_app *app, int *port_out, char *err)
{
    char scratch[ERR_CAP];
    if (!err) err = scratch;
    err[0] = '\0';
    if (port < 0 || port > 65535) {
        snprintf(err, ERR_CAP, "http: port %d out of range 0..65535", port);
        return NULL;
    }
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    if (resolve(host, port, &ss, err) != 0) return NULL;
    kc_http *h = calloc(1, sizeof *h);
    if (!h) {
        snprintf(err, ERR_CAP, "http: out of memory");
        return NULL;
    }
    h->reg = reg;
    h->health = health;
    h->health_user = health_user;
    if (app) {
        h->app = *app;
        if (!h->app.max_body) h->app.max_body = KC_HTTP_MAX_BODY;
    }
    unsigned max_connections = h->app.max_connections > 0 ? (unsigned)h->app.max_connections : KC_HTTP_MAX_CONNECTIONS;
    atomic_store(&h->starting, 1);
    int tls = h->app.tls_cert_pem && h->app.tls_key_pem;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_ERROR_LOG | (ss.ss_family == AF_INET6 ? MHD_USE_IPv6 : 0) |
                     (tls ? MHD_USE_TLS : 0);
    struct MHD_OptionItem tls_opts[] = {
        {tls ? MHD_OPTION_HTTPS_MEM_KEY : MHD_OPTION_END, 0, (void *)h->app.tls_key_pem},
        {MHD_OPTION_HTTPS_MEM_CERT, 0, (void *)h->app.tls_cert_pem},
        {MHD_OPTION_END, 0, NULL},
    };
    /* the logger goes first: libmicrohttpd uses its own for anything said before it; the port
     * argument only names the port in its messages (MHD_OPTION_SOCK_ADDR decides the bind) */
    h->daemon = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, h,
                                 MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h, MHD_OPTION_SOCK_ADDR,
                                 (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT, max_connections,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)KC_HTTP_IDLE_TIMEOUT_S,
                                 MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_ARRAY,
                                 tls_opts, MHD_OPTION_END);
    if (!h->daemon) {
        snprintf(err, ERR_CAP, "http: cannot serve on %.60s:%d: %.150s",
                 host && *host ? host : "0.0.0.0", port,
                 h->start_error[0] ? h->start_error : "libmicrohttpd refused to start");
        free(h);
        return NULL;
    }
    atomic_store(&h->starting, 0);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    int bound = info ? (int)info->port : 0;
    if (bound <= 0) {
        snprintf(err, ERR_CAP, "http: started but cannot learn the bound port");
        kc_http_stop(h);
        return NULL;
    }
    if (port_out) *port_out = bound;
    return h;
}

void kc_http_stop(kc_http *h)
{
    if (!h) return;
    MHD_stop_daemon(h->daemon);
    free(h);
}
