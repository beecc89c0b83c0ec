/*
 * test_http.c - common/http.h over real HTTP/1.1 on loopback (an ephemeral port, a plain socket
 * client written here): GET /metrics answers exactly kc_registry_render's text with the
 * Prometheus content type, HEAD the same headers and no body, a query string is ignored;
 * /healthz gives 200 "ok\n", then 503 with the health callback's reason (made one line, cut at
 * the buffer); unknown paths 404; other methods 405 with Allow; a busy port, a bad port and an
 * IPv6 loopback (when the machine has one); a process's own routes (kc_http_start_app) get
 * whole request bodies, NULL over the cap, and never /metrics or /healthz.
 * Run: ctest -R test_http (well under a second).
 */
#include "kr_test.h"

#include "http.h"

#include <microhttpd.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

typedef struct {
    int status;
    char headers[2048]; /* the header lines, "\r\n"-separated, lower-case names as sent */
    char *body;         /* malloc'd, NUL-terminated */
    size_t body_len;
} http_reply;

/* Sends `request` (a complete HTTP request) to family/addr:port and reads the reply until the
 * server closes. Returns 0, or -1 on a socket error or an unparsable reply. */
static int http_raw(int family, const char *addr, int port, const char *request, http_reply *r)
{
    memset(r, 0, sizeof *r);
    int fd = socket(family, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct timeval tv = {10, 0}; /* a hung server fails the test instead of hanging it */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    socklen_t sl;
    if (family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)port);
        inet_pton(AF_INET, addr, &a->sin_addr);
        sl = sizeof *a;
    } else {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons((uint16_t)port);
        inet_pton(AF_INET6, addr, &a->sin6_addr);
        sl = sizeof *a;
    }
    if (connect(fd, (struct sockaddr *)&ss, sl) != 0) {
        close(fd);
        return -1;
    }
    size_t len = strlen(request);
    if (send(fd, request, len, MSG_NOSIGNAL) != (ssize_t)len) {
        close(fd);
        return -1;
    }
    size_t cap = 4096, got = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (got + 1024 > cap) buf = realloc(buf, cap *= 2);
        ssize_t n = recv(fd, buf + got, cap - got - 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += (size_t)n;
    }
    close(fd);
    buf[got] = '\0';
    char *end = strstr(buf, "\r\n\r\n");
    if (!end || sscanf(buf, "HTTP/1.%*d %d", &r->status) != 1) {
        free(buf);
        return -1;
    }
    size_t hlen = (size_t)(end - buf);
    snprintf(r->headers, sizeof r->headers, "%.*s", (int)hlen, buf);
    r->body_len = got - hlen - 4;
    r->body = malloc(r->body_len + 1);
    memcpy(r->body, end + 4, r->body_len);
    r->body[r->body_len] = '\0';
    free(buf);
    return 0;
}

static int http_get(int port, const char *method, const char *path, http_reply *r)
{
    char req[512];
    snprintf(req, sizeof req, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
             method, path);
    return http_raw(AF_INET, "127.0.0.1", port, req, r);
}

/* The value of header `name` (case-insensitive), or "" when absent. */
static const char *header(const http_reply *r, const char *name, char *out, size_t cap)
{
    out[0] = '\0';
    size_t n = strlen(name);
    for (const char *l = strstr(r->headers, "\r\n"); l; l = strstr(l + 2, "\r\n")) {
        const char *h = l + 2;
        if (strncasecmp(h, name, n) == 0 && h[n] == ':') {
            const char *v = h + n + 1;
            while (*v == ' ')
                v++;
            const char *e = strstr(v, "\r\n");
            snprintf(out, cap, "%.*s", (int)(e ? (size_t)(e - v) : strlen(v)), v);
            break;
        }
    }
    return out;
}

/* ------------------------------------------------------------------ the health callback */

static atomic_int healthy = 1;
static const char *unhealthy_reason = "draining: 3 requests left";

static int health(void *user, char *reason, size_t cap)
{
    if (atomic_load(&healthy)) return 1;
    snprintf(reason, cap, "%s", unhealthy_reason);
    return 0;
}

/* Writes the whole buffer with no NUL: the server must still end the text itself. */
static int health_overflowing(void *user, char *reason, size_t cap)
{
    memset(reason, 'r', cap);
    return 0;
}

/* ------------------------------------------------------------------ tests */

static void test_metrics_and_health(void)
{
    kc_registry *reg = kc_registry_create();
    kc_counter *c = kc_counter_add(reg, "kvrelay_requests_total", "Requests.", "status=\"OK\"");
    kc_histogram *h = kc_histogram_add(reg, "kvrelay_ttft_seconds", "TTFT.", NULL,
                                       kc_latency_buckets, kc_n_latency_buckets);
    REQUIRE(c && h, "metrics");
    kc_counter_inc(c, 5);
    kc_histogram_observe(h, 0.042);

    char err[256] = "";
    int port = 0;
    kc_http *srv = kc_http_start("127.0.0.1", 0, reg, health, NULL, &port, err);
    REQUIRE(srv, "start: %s", err);
    CHECK(port > 0 && port < 65536, "port %d", port);

    http_reply r;
    char v[256];
    REQUIRE(http_get(port, "GET", "/metrics", &r) == 0, "GET /metrics");
    size_t len = 0;
    char *want = kc_registry_render(reg, &len);
    CHECK(r.status == 200, "status %d", r.status);
    CHECK(strcmp(header(&r, "Content-Type", v, sizeof v),
                 "text/plain; version=0.0.4; charset=utf-8") == 0,
          "content type '%s'", v);
    CHECK(r.body_len == len && memcmp(r.body, want, len) == 0, "body:\n%s\nwanted:\n%s", r.body,
          want);
    CHECK(atol(header(&r, "Content-Length", v, sizeof v)) == (long)len, "content length %s", v);
    CHECK(strstr(r.body, "kvrelay_requests_total{status=\"OK\"} 5\n"), "counter missing");
    free(r.body);

    /* an update shows up in the next scrape */
    kc_counter_inc(c, 1);
    REQUIRE(http_get(port, "GET", "/metrics?debug=1", &r) == 0, "GET /metrics?debug=1");
    CHECK(r.status == 200 && strstr(r.body, "kvrelay_requests_total{status=\"OK\"} 6\n"),
          "query string or update: %d\n%s", r.status, r.body);
    free(r.body);

    REQUIRE(http_get(port, "HEAD", "/metrics", &r) == 0, "HEAD /metrics");
    CHECK(r.status == 200 && r.body_len == 0, "HEAD: status %d, %zu body bytes", r.status,
          r.body_len);
    CHECK(strncmp(header(&r, "Content-Type", v, sizeof v), "text/plain; version=0.0.4", 25) == 0,
          "HEAD content type '%s'", v);
    free(r.body);
    free(want);

    REQUIRE(http_get(port, "GET", "/healthz", &r) == 0, "GET /healthz");
    CHECK(r.status == 200 && strcmp(r.body, "ok\n") == 0, "healthy: %d '%s'", r.status, r.body);
    free(r.body);
    atomic_store(&healthy, 0);
    REQUIRE(http_get(port, "GET", "/healthz", &r) == 0, "GET /healthz");
    CHECK(r.status == 503 && strcmp(r.body, "draining: 3 requests left\n") == 0,
          "unhealthy: %d '%s'", r.status, r.body);
    free(r.body);
    unhealthy_reason = "two\nlines";
    REQUIRE(http_get(port, "GET", "/healthz", &r) == 0, "GET /healthz");
    CHECK(r.status == 503 && strcmp(r.body, "two lines\n") == 0, "reason made one line: '%s'",
          r.body);
    free(r.body);
    unhealthy_reason = "";
    REQUIRE(http_get(port, "GET", "/healthz", &r) == 0, "GET /healthz");
    CHECK(r.status == 503 && strcmp(r.body, "unhealthy\n") == 0, "empty reason: '%s'", r.body);
    free(r.body);
    atomic_store(&healthy, 1);

    const char *missing[] = {"/", "/metrics/", "/metricsx", "/health", "/healthz/x", NULL};
    for (int i = 0; missing[i]; i++) {
        REQUIRE(http_get(port, "GET", missing[i], &r) == 0, "GET %s", missing[i]);
        CHECK(r.status == 404, "GET %s: %d", missing[i], r.status);
        free(r.body);
    }
    const char *methods[] = {"POST", "PUT", "DELETE", "OPTIONS", "PATCH", NULL};
    for (int i = 0; methods[i]; i++) {
        REQUIRE(http_get(port, methods[i], "/metrics", &r) == 0, "%s /metrics", methods[i]);
        CHECK(r.status == 405, "%s: %d", methods[i], r.status);
        CHECK(strcmp(header(&r, "Allow", v, sizeof v), "GET, HEAD") == 0, "%s: Allow '%s'",
              methods[i], v);
        free(r.body);
    }
    /* a request with a body is refused just the same */
    REQUIRE(http_raw(AF_INET, "127.0.0.1", port,
                     "POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                     "Connection: close\r\n\r\nhello",
                     &r) == 0,
            "POST with a body");
    CHECK(r.status == 405, "POST with a body: %d", r.status);
    free(r.body);

    /* the port is taken now: a second server must fail and say why */
    err[0] = '\0';
    int port2 = -1;
    kc_http *busy = kc_http_start("127.0.0.1", port, reg, NULL, NULL, &port2, err);
    CHECK(!busy, "a second server on a busy port started");
    kc_http_stop(busy);
    CHECK_ERR_HAS(err, "in use");
    char portstr[16];
    snprintf(portstr, sizeof portstr, ":%d", port);
    CHECK_ERR_HAS(err, portstr);
    CHECK(port2 == -1, "port_out set on failure");

    kc_http_stop(srv);
    /* stopped: nothing listens any more */
    CHECK(http_get(port, "GET", "/healthz", &r) != 0, "still answering after stop");
    kc_registry_free(reg);
}

static void test_edges(void)
{
    char err[256] = "";
    int port = 0;
    CHECK(!kc_http_start("127.0.0.1", 70000, NULL, NULL, NULL, &port, err), "port 70000");
    CHECK_ERR_HAS(err, "70000");
    CHECK(!kc_http_start("127.0.0.1", -1, NULL, NULL, NULL, &port, err), "port -1");

    /* no registry: /metrics is empty; a callback that fills its buffer without a NUL */
    kc_http *srv = kc_http_start("127.0.0.1", 0, NULL, health_overflowing, NULL, &port, err);
    REQUIRE(srv, "start: %s", err);
    http_reply r;
    REQUIRE(http_get(port, "GET", "/metrics", &r) == 0, "GET /metrics");
    CHECK(r.status == 200 && r.body_len == 0, "empty metrics: %d, %zu bytes", r.status, r.body_len);
    free(r.body);
    REQUIRE(http_get(port, "GET", "/healthz", &r) == 0, "GET /healthz");
    CHECK(r.status == 503 && r.body_len == 256 && r.body[254] == 'r' && r.body[255] == '\n',
          "overflowing reason: %d, %zu bytes", r.status, r.body_len);
    free(r.body);
    kc_http_stop(srv);
    kc_http_stop(NULL);

    /* IPv6 loopback, where the machine has one */
    srv = kc_http_start("[::1]", 0, NULL, NULL, NULL, &port, err);
    if (!srv) {
        printf("test_http: no IPv6 loopback here (%s); IPv6 not tested\n", err);
        return;
    }
    REQUIRE(http_raw(AF_INET6, "::1", port,
                     "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", &r) == 0,
            "GET over IPv6");
    CHECK(r.status == 200 && strcmp(r.body, "ok\n") == 0, "IPv6: %d", r.status);
    free(r.body);
    kc_http_stop(srv);
}

/* An app route that answers "METHOD URL LEN FIRST-BYTE" for what it was handed, 413 for a NULL
 * body. */
static int echo_app(void *user, struct MHD_Connection *conn, const char *method, const char *url, const char *body,
                    size_t len)
{
    atomic_fetch_add((atomic_int *)user, 1);
    char text[256];
    unsigned status = body ? 200 : 413;
    snprintf(text, sizeof text, "%s %s %zu %c", method, url, len, body && len ? body[0] : '-');
    CHECK(!body || strlen(body) == len, "the body is NUL-terminated at its length");
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_COPY);
    int ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

/* A POST of `len` bytes of 'x' to path. */
static int http_post(int port, const char *path, size_t len, http_reply *r)
{
    char *req = malloc(len + 256);
    int n = snprintf(req, 256, "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: %zu\r\n\r\n",
                     path, len);
    memset(req + n, 'x', len);
    req[n + len] = '\0';
    int rc = http_raw(AF_INET, "127.0.0.1", port, req, r);
    free(req);
    return rc;
}

static void test_app_routes(void)
{
    atomic_int calls = 0;
    kc_http_app app = {.fn = echo_app, .user = &calls, .max_body = 100000};
    char err[256] = "";
    int port = 0;
    kc_http *srv = kc_http_start_app("127.0.0.1", 0, NULL, NULL, NULL, &app, &port, err);
    REQUIRE(srv, "start with an app: %s", err);
    http_reply r;
    /* a body that arrives in several pieces is handed over whole, once */
    REQUIRE(http_post(port, "/v1/x", 70000, &r) == 0, "POST 70000 bytes");
    CHECK(r.status == 200 && strcmp(r.body, "POST /v1/x 70000 x") == 0, "whole body: %d '%s'", r.status, r.body);
    free(r.body);
    REQUIRE(http_post(port, "/v1/x", 100001, &r) == 0, "POST over the cap");
    CHECK(r.status == 413 && strcmp(r.body, "POST /v1/x 0 -") == 0, "over the cap: %d '%s'", r.status, r.body);
    free(r.body);
    REQUIRE(http_get(port, "GET", "/anything", &r) == 0, "GET /anything");
    CHECK(r.status == 200 && strcmp(r.body, "GET /anything 0 -") == 0, "GET to the app: %d '%s'", r.status, r.body);
    free(r.body);
    CHECK(atomic_load(&calls) == 3, "the app was called once per request: %d", atomic_load(&calls));
    /* the process's own routes stay its own */
    REQUIRE(http_get(port, "GET", "/healthz", &r) == 0, "GET /healthz");
    CHECK(r.status == 200 && strcmp(r.body, "ok\n") == 0, "/healthz with an app: %d", r.status);
    free(r.body);
    REQUIRE(http_post(port, "/metrics", 10, &r) == 0, "POST /metrics");
    CHECK(r.status == 405, "POST /metrics: %d", r.status);
    free(r.body);
    CHECK(atomic_load(&calls) == 3, "the app saw neither");
    kc_http_stop(srv);
}

int main(void)
{
    test_metrics_and_health();
    test_edges();
    test_app_routes();
    return kt_done("test_http");
}
