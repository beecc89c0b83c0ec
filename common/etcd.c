/*
 * etcd.c - the etcd v3 client of etcd.h: one lazily connecting gRPC channel per endpoint, unary KV
 * and Lease calls that move on to the next endpoint when one is unreachable, the LeaseKeepAlive
 * stream kept open between keep-alives, Watch streams, and the optional auth token.
 * Not here: retry loops with backoff (membership.c owns them), logging (callers log the status,
 * which names the endpoint). Test: ctest -R test_etcd.
 */
#include "etcd.h"
#include "flags.h"

#include "etcd/rpc.pb-c.h"

#include <grpc/grpc_security.h>

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ETCD_TIMEOUT_DEFAULT_MS 5000
#define ETCD_MAX_ENDPOINTS 16
#define ETCD_TOKEN_MAX 1024
/* HTTP/2 pings on open streams (etcd's default enforcement allows one per 5 s), so a hung etcd
 * fails a watch instead of leaving it silent forever. */
#define ETCD_KEEPALIVE_MS 10000
/* gRPC's reconnect backoff would otherwise grow to 120 s while etcd is down. */
#define ETCD_RECONNECT_MAX_MS 1000

struct kc_etcd {
    int n;
    char *endpoints[ETCD_MAX_ENDPOINTS]; /* "host:port" */
    kc_channel *channels[ETCD_MAX_ENDPOINTS];
    int64_t timeout_ms;
    char *user;     /* NULL: no auth */
    char *password;
    pthread_mutex_t mu; /* current, token */
    int current;        /* the endpoint that answered last */
    char token[ETCD_TOKEN_MAX];
    pthread_mutex_t ka_mu; /* the keep-alive stream */
    kc_stream *ka;
};

struct kc_etcd_watch {
    kc_etcd *c;
    int endpoint;
    kc_stream *s;
};

/* Copies `text` into the details, cut to fit. */
static void details_set(kc_status *st, const char *text)
{
    size_t n = strlen(text);
    if (n >= sizeof st->details)
        n = sizeof st->details - 1;
    memcpy(st->details, text, n);
    st->details[n] = '\0';
}

/* Prefixes `st`'s details with the endpoint and method. */
static void status_name(kc_status *st, const kc_etcd *c, int idx, const char *path)
{
    const char *method = strrchr(path, '/');
    char buf[1024];
    snprintf(buf, sizeof buf, "etcd %s %s: %s: %s", c->endpoints[idx], method ? method + 1 : path,
             kc_status_name(st->code), st->details);
    details_set(st, buf);
}

/* ------------------------------------------------------------------ set-up */

static char *read_text_file(const char *path, kc_status *st)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "cannot read '%s': %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? 2 * cap : 8192;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory reading '%s'", path);
                return NULL;
            }
            buf = nb;
        }
        size_t r = fread(buf + len, 1, 4096, f);
        len += r;
        if (r < 4096)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad || len == 0) {
        free(buf);
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "'%s' is %s", path,
                   bad ? "unreadable" : "empty");
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

/* Splits "http://a:1, b:2" into host:port strings. Returns the count, or -1 with `st`. */
static int parse_endpoints(const char *list, char **out, int *any_https, kc_status *st)
{
    int n = 0;
    const char *p = list;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        while (len && (*p == ' ' || *p == '\t')) {
            p++;
            len--;
        }
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t' || p[len - 1] == '/'))
            len--;
        if (len >= 7 && strncmp(p, "http://", 7) == 0) {
            p += 7;
            len -= 7;
        } else if (len >= 8 && strncmp(p, "https://", 8) == 0) {
            p += 8;
            len -= 8;
            *any_https = 1;
        }
        if (n == ETCD_MAX_ENDPOINTS) {
            kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "more than %d etcd endpoints in '%s'",
                       ETCD_MAX_ENDPOINTS, list);
            goto err;
        }
        out[n] = strndup(p, len);
        if (!out[n]) {
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            goto err;
        }
        kc_hostport hp;
        char why[200];
        if (kc_hostport_parse(NULL, out[n], 0, &hp, why, sizeof why) != 0) {
            kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                       "etcd endpoint '%s' in '%s' is not HOST:PORT (optionally with http:// or "
                       "https://): %s", out[n], list, why);
            free(out[n]);
            goto err;
        }
        n++;
        if (!end)
            break;
        p = end + 1;
    }
    if (n == 0) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "no etcd endpoint in '%s'", list);
        return -1;
    }
    return n;
err:
    while (n > 0)
        free(out[--n]);
    return -1;
}

static grpc_channel_credentials *tls_credentials(const kc_etcd_config *cfg, kc_status *st)
{
    char *ca = NULL, *cert = NULL, *key = NULL;
    grpc_channel_credentials *creds = NULL;
    if ((cfg->cert_file && *cfg->cert_file) != (cfg->key_file && *cfg->key_file)) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                   "an etcd client certificate needs both the cert and the key file");
        return NULL;
    }
    if (cfg->ca_file && *cfg->ca_file && !(ca = read_text_file(cfg->ca_file, st)))
        goto out;
    if (cfg->cert_file && *cfg->cert_file) {
        if (!(cert = read_text_file(cfg->cert_file, st)) ||
            !(key = read_text_file(cfg->key_file, st)))
            goto out;
    }
    grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
    creds = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
    if (!creds)
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "gRPC refused the etcd TLS files");
out:
    free(ca);
    free(cert);
    free(key);
    return creds;
}

int kc_etcd_create(const kc_etcd_config *cfg, kc_etcd **out, kc_status *st)
{
    if (!cfg || !cfg->endpoints || !*cfg->endpoints) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "no etcd endpoints given");
        return -1;
    }
    if ((cfg->user && *cfg->user) != (cfg->password && *cfg->password)) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "etcd auth needs both a user and a password");
        return -1;
    }
    kc_etcd *c = calloc(1, sizeof *c);
    if (!c) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return -1;
    }
    int any_https = 0;
    c->n = parse_endpoints(cfg->endpoints, c->endpoints, &any_https, st);
    if (c->n < 0) {
        free(c);
        return -1;
    }
    c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : ETCD_TIMEOUT_DEFAULT_MS;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->ka_mu, NULL);
    kc_channel_opts opts = {.keepalive_ms = ETCD_KEEPALIVE_MS,
                            .max_reconnect_backoff_ms = ETCD_RECONNECT_MAX_MS};
    if (any_https || (cfg->ca_file && *cfg->ca_file) || (cfg->cert_file && *cfg->cert_file)) {
        opts.creds = tls_credentials(cfg, st);
        if (!opts.creds)
            goto err;
    }
    if (cfg->user && *cfg->user) {
        c->user = strdup(cfg->user);
        c->password = strdup(cfg->password);
        if (!c->user || !c->password) {
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            goto err;
        }
    }
    for (int i = 0; i < c->n; i++) {
        if (kc_channel_create_opts(c->endpoints[i], &opts, &c->channels[i], st) != 0)
            goto err;
    }
    if (opts.creds)
        grpc_channel_credentials_release(opts.creds);
    *out = c;
    return 0;
err:
    if (opts.creds)
        grpc_channel_credentials_release(opts.creds);
    kc_etcd_destroy(c);
    return -1;
}

void kc_etcd_destroy(kc_etcd *c)
{
    if (!c)
        return;
    kc_stream_close(c->ka);
    for (int i = 0; i < c->n; i++) {
        kc_channel_destroy(c->channels[i]);
        free(c->endpoints[i]);
    }
    free(c->user);
    free(c->password);
    pthread_mutex_destroy(&c->ka_mu);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static int current_get(kc_etcd *c)
{
    pthread_mutex_lock(&c->mu);
    int i = c->current;
    pthread_mutex_unlock(&c->mu);
    return i;
}

const char *kc_etcd_endpoint(const kc_etcd *c)
{
    return c->endpoints[current_get((kc_etcd *)c)];
}

static void current_set(kc_etcd *c, int i)
{
    pthread_mutex_lock(&c->mu);
    c->current = i;
    pthread_mutex_unlock(&c->mu);
}

int kc_etcd_wait_ready(kc_etcd *c, int64_t timeout_ms)
{
    int start = current_get(c);
    int64_t share = timeout_ms / c->n > 0 ? timeout_ms / c->n : 1;
    for (int i = 0; i < c->n; i++) {
        int idx = (start + i) % c->n;
        if (kc_channel_wait_connected(c->channels[idx], share)) {
            current_set(c, idx);
            return 1;
        }
    }
    return 0;
}

/* The endpoint did not answer (as opposed to answering with an error): try the next one. */
static int endpoint_down(grpc_status_code code)
{
    return code == GRPC_STATUS_UNAVAILABLE || code == GRPC_STATUS_DEADLINE_EXCEEDED;
}

/* ------------------------------------------------------------------ auth */

/* Copies the token to use with endpoint `idx` into tok ("" without auth), authenticating first
 * when there is none. Returns 0, or -1 with `st`. */
static int token_get(kc_etcd *c, int idx, char *tok, kc_status *st)
{
    tok[0] = '\0';
    if (!c->user)
        return 0;
    pthread_mutex_lock(&c->mu);
    snprintf(tok, ETCD_TOKEN_MAX, "%s", c->token);
    pthread_mutex_unlock(&c->mu);
    if (tok[0])
        return 0;
    Etcdserverpb__AuthenticateRequest req = ETCDSERVERPB__AUTHENTICATE_REQUEST__INIT;
    req.name = c->user;
    req.password = c->password;
    ProtobufCMessage *resp = NULL;
    static const char path[] = "/etcdserverpb.Auth/Authenticate";
    if (kc_unary(c->channels[idx], path, &req.base, &etcdserverpb__authenticate_response__descriptor,
                 c->timeout_ms, &resp, st) != 0) {
        status_name(st, c, idx, path);
        return -1;
    }
    const Etcdserverpb__AuthenticateResponse *ar = (const Etcdserverpb__AuthenticateResponse *)resp;
    if (!ar->token || !*ar->token || strlen(ar->token) >= ETCD_TOKEN_MAX) {
        kc_message_free(resp);
        kc_status_set(st, GRPC_STATUS_UNAUTHENTICATED, "etcd %s Authenticate: no usable token",
                   c->endpoints[idx]);
        return -1;
    }
    snprintf(tok, ETCD_TOKEN_MAX, "%s", ar->token);
    kc_message_free(resp);
    pthread_mutex_lock(&c->mu);
    snprintf(c->token, sizeof c->token, "%s", tok);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Forgets a token etcd refused, so that the next call authenticates again. */
static void token_drop(kc_etcd *c, const char *tok)
{
    pthread_mutex_lock(&c->mu);
    if (strcmp(c->token, tok) == 0)
        c->token[0] = '\0';
    pthread_mutex_unlock(&c->mu);
}

/* ------------------------------------------------------------------ unary calls */

/* One unary call, trying each endpoint from the current one until one answers; re-authenticates
 * once when etcd says the token is no longer valid. */
static int etcd_unary(kc_etcd *c, const char *path, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                      ProtobufCMessage **resp, kc_status *st)
{
    if (timeout_ms <= 0)
        timeout_ms = c->timeout_ms;
    int start = current_get(c), reauthed = 0;
    kc_status last = {GRPC_STATUS_UNAVAILABLE, "no endpoint tried"};
    char all[1024] = ""; /* every endpoint's failure, for the final message */
    size_t used = 0;
    for (int i = 0; i < c->n; i++) {
        int idx = (start + i) % c->n;
        char tok[ETCD_TOKEN_MAX];
        int rc = token_get(c, idx, tok, &last);
        if (rc == 0) {
            kc_md md = {"token", tok};
            const kc_call_opts opts = {.timeout_ms = timeout_ms, .md = tok[0] ? &md : NULL, .n_md = tok[0] ? 1 : 0};
            rc = kc_unary_md(c->channels[idx], path, req, resp_desc, &opts, resp, &last);
            if (rc == 0) {
                current_set(c, idx);
                *st = last;
                return 0;
            }
            if (last.code == GRPC_STATUS_UNAUTHENTICATED && c->user && !reauthed) {
                token_drop(c, tok);
                reauthed = 1;
                i--; /* the same endpoint again, with a new token */
                continue;
            }
            status_name(&last, c, idx, path);
        }
        if (!endpoint_down(last.code)) {
            current_set(c, idx); /* it answered: an error of the request, not of the endpoint */
            *st = last;
            return -1;
        }
        int w = snprintf(all + used, sizeof all - used, "%s%s", used ? "; " : "", last.details);
        if (w > 0)
            used = used + (size_t)w < sizeof all ? used + (size_t)w : sizeof all - 1;
    }
    *st = last;
    if (c->n > 1) {
        char buf[1200];
        snprintf(buf, sizeof buf, "no etcd endpoint answered: %s", all);
        details_set(st, buf);
    }
    return -1;
}

static int kv_copy(const Mvccpb__KeyValue *src, kc_etcd_kv *dst)
{
    memset(dst, 0, sizeof *dst);
    dst->key = malloc(src->key.len + 1);
    dst->value = malloc(src->value.len + 1);
    if (!dst->key || !dst->value) {
        kc_etcd_kv_free(dst);
        return -1;
    }
    if (src->key.len)
        memcpy(dst->key, src->key.data, src->key.len);
    dst->key[src->key.len] = '\0';
    dst->key_len = src->key.len;
    if (src->value.len)
        memcpy(dst->value, src->value.data, src->value.len);
    dst->value[src->value.len] = '\0';
    dst->value_len = src->value.len;
    dst->create_revision = src->create_revision;
    dst->mod_revision = src->mod_revision;
    dst->version = src->version;
    dst->lease = src->lease;
    return 0;
}

void kc_etcd_kv_free(kc_etcd_kv *kv)
{
    if (!kv)
        return;
    free(kv->key);
    free(kv->value);
    kv->key = kv->value = NULL;
}

/* range_end for every key starting with `key`: the key with its last byte below 0xff incremented
 * and what follows dropped; "\0" (= to the end of the keyspace) when there is none. Caller frees
 * data. */
static int prefix_end(const char *key, ProtobufCBinaryData *end)
{
    size_t n = strlen(key);
    uint8_t *e = malloc(n ? n : 1);
    if (!e)
        return -1;
    memcpy(e, key, n);
    while (n > 0 && e[n - 1] == 0xff)
        n--;
    if (n == 0) {
        e[0] = 0;
        end->len = 1;
    } else {
        e[n - 1]++;
        end->len = n;
    }
    end->data = e;
    return 0;
}

static ProtobufCBinaryData bytes_of(const void *p, size_t n)
{
    return (ProtobufCBinaryData){.len = n, .data = (uint8_t *)p};
}

static int oom(kc_status *st)
{
    kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    return -1;
}

int kc_etcd_range(kc_etcd *c, const char *key, int prefix, int64_t revision,
                  kc_etcd_range_result *out, kc_status *st)
{
    Etcdserverpb__RangeRequest req = ETCDSERVERPB__RANGE_REQUEST__INIT;
    req.key = bytes_of(key, strlen(key));
    if (prefix && prefix_end(key, &req.range_end) != 0)
        return oom(st);
    req.revision = revision;
    ProtobufCMessage *m = NULL;
    int rc = etcd_unary(c, "/etcdserverpb.KV/Range", &req.base,
                        &etcdserverpb__range_response__descriptor, 0, &m, st);
    free(req.range_end.data);
    if (rc != 0)
        return -1;
    const Etcdserverpb__RangeResponse *r = (const Etcdserverpb__RangeResponse *)m;
    kc_etcd_range_result res = {0};
    res.kvs = calloc(r->n_kvs ? r->n_kvs : 1, sizeof *res.kvs);
    if (!res.kvs) {
        kc_message_free(m);
        return oom(st);
    }
    for (size_t i = 0; i < r->n_kvs; i++) {
        if (kv_copy(r->kvs[i], &res.kvs[i]) != 0) {
            kc_etcd_range_free(&res);
            kc_message_free(m);
            return oom(st);
        }
        res.n++;
    }
    res.revision = r->header ? r->header->revision : 0;
    res.count = r->count;
    kc_message_free(m);
    *out = res;
    return 0;
}

void kc_etcd_range_free(kc_etcd_range_result *r)
{
    if (!r)
        return;
    for (size_t i = 0; i < r->n; i++)
        kc_etcd_kv_free(&r->kvs[i]);
    free(r->kvs);
    memset(r, 0, sizeof *r);
}

int kc_etcd_put(kc_etcd *c, const char *key, const void *value, size_t len, int64_t lease,
                int64_t *revision, kc_status *st)
{
    Etcdserverpb__PutRequest req = ETCDSERVERPB__PUT_REQUEST__INIT;
    req.key = bytes_of(key, strlen(key));
    req.value = bytes_of(value, len);
    req.lease = lease;
    ProtobufCMessage *m = NULL;
    if (etcd_unary(c, "/etcdserverpb.KV/Put", &req.base, &etcdserverpb__put_response__descriptor,
                   0, &m, st) != 0)
        return -1;
    const Etcdserverpb__PutResponse *r = (const Etcdserverpb__PutResponse *)m;
    if (revision)
        *revision = r->header ? r->header->revision : 0;
    kc_message_free(m);
    return 0;
}

int kc_etcd_delete(kc_etcd *c, const char *key, int prefix, int64_t *deleted, kc_status *st)
{
    Etcdserverpb__DeleteRangeRequest req = ETCDSERVERPB__DELETE_RANGE_REQUEST__INIT;
    req.key = bytes_of(key, strlen(key));
    if (prefix && prefix_end(key, &req.range_end) != 0)
        return oom(st);
    ProtobufCMessage *m = NULL;
    int rc = etcd_unary(c, "/etcdserverpb.KV/DeleteRange", &req.base,
                        &etcdserverpb__delete_range_response__descriptor, 0, &m, st);
    free(req.range_end.data);
    if (rc != 0)
        return -1;
    if (deleted)
        *deleted = ((const Etcdserverpb__DeleteRangeResponse *)m)->deleted;
    kc_message_free(m);
    return 0;
}

int kc_etcd_create_if_absent(kc_etcd *c, const char *key, const void *value, size_t len,
                             int64_t lease, int *created, int64_t *revision, kc_status *st)
{
    Etcdserverpb__Compare cmp = ETCDSERVERPB__COMPARE__INIT;
    cmp.result = ETCDSERVERPB__COMPARE__COMPARE_RESULT__EQUAL;
    cmp.target = ETCDSERVERPB__COMPARE__COMPARE_TARGET__CREATE;
    cmp.key = bytes_of(key, strlen(key));
    cmp.target_union_case = ETCDSERVERPB__COMPARE__TARGET_UNION_CREATE_REVISION;
    cmp.create_revision = 0; /* a key that does not exist has create_revision 0 */
    Etcdserverpb__PutRequest put = ETCDSERVERPB__PUT_REQUEST__INIT;
    put.key = cmp.key;
    put.value = bytes_of(value, len);
    put.lease = lease;
    Etcdserverpb__RequestOp op = ETCDSERVERPB__REQUEST_OP__INIT;
    op.request_case = ETCDSERVERPB__REQUEST_OP__REQUEST_REQUEST_PUT;
    op.request_put = &put;
    Etcdserverpb__Compare *cmps[1] = {&cmp};
    Etcdserverpb__RequestOp *ops[1] = {&op};
    Etcdserverpb__TxnRequest req = ETCDSERVERPB__TXN_REQUEST__INIT;
    req.n_compare = 1;
    req.compare = cmps;
    req.n_success = 1;
    req.success = ops;
    ProtobufCMessage *m = NULL;
    if (etcd_unary(c, "/etcdserverpb.KV/Txn", &req.base, &etcdserverpb__txn_response__descriptor,
                   0, &m, st) != 0)
        return -1;
    const Etcdserverpb__TxnResponse *r = (const Etcdserverpb__TxnResponse *)m;
    *created = r->succeeded ? 1 : 0;
    if (revision)
        *revision = r->header ? r->header->revision : 0;
    kc_message_free(m);
    return 0;
}

/* ------------------------------------------------------------------ leases */

int kc_etcd_lease_grant(kc_etcd *c, int64_t ttl_s, int64_t *id, int64_t *granted_ttl,
                        kc_status *st)
{
    Etcdserverpb__LeaseGrantRequest req = ETCDSERVERPB__LEASE_GRANT_REQUEST__INIT;
    req.ttl = ttl_s;
    ProtobufCMessage *m = NULL;
    if (etcd_unary(c, "/etcdserverpb.Lease/LeaseGrant", &req.base,
                   &etcdserverpb__lease_grant_response__descriptor, 0, &m, st) != 0)
        return -1;
    const Etcdserverpb__LeaseGrantResponse *r = (const Etcdserverpb__LeaseGrantResponse *)m;
    if ((r->error && *r->error) || r->id == 0) {
        kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION, "etcd %s LeaseGrant(ttl %lld): %s",
                   kc_etcd_endpoint(c), (long long)ttl_s,
                   r->error && *r->error ? r->error : "no lease id");
        kc_message_free(m);
        return -1;
    }
    *id = r->id;
    if (granted_ttl)
        *granted_ttl = r->ttl;
    kc_message_free(m);
    return 0;
}

int kc_etcd_lease_revoke(kc_etcd *c, int64_t id, int64_t timeout_ms, kc_status *st)
{
    Etcdserverpb__LeaseRevokeRequest req = ETCDSERVERPB__LEASE_REVOKE_REQUEST__INIT;
    req.id = id;
    ProtobufCMessage *m = NULL;
    if (etcd_unary(c, "/etcdserverpb.Lease/LeaseRevoke", &req.base,
                   &etcdserverpb__lease_revoke_response__descriptor, timeout_ms, &m, st) != 0)
        return -1;
    kc_message_free(m);
    return 0;
}

int kc_etcd_lease_ttl(kc_etcd *c, int64_t id, int64_t *ttl, kc_status *st)
{
    Etcdserverpb__LeaseTimeToLiveRequest req = ETCDSERVERPB__LEASE_TIME_TO_LIVE_REQUEST__INIT;
    req.id = id;
    ProtobufCMessage *m = NULL;
    if (etcd_unary(c, "/etcdserverpb.Lease/LeaseTimeToLive", &req.base,
                   &etcdserverpb__lease_time_to_live_response__descriptor, 0, &m, st) != 0)
        return -1;
    *ttl = ((const Etcdserverpb__LeaseTimeToLiveResponse *)m)->ttl;
    kc_message_free(m);
    return 0;
}

/* Opens a bidirectional stream to `path` on endpoint `idx`, with the auth token. */
static int bidi_open(kc_etcd *c, int idx, const char *path, kc_stream **out, char *tok,
                     kc_status *st)
{
    if (token_get(c, idx, tok, st) != 0)
        return -1;
    kc_md md = {"token", tok};
    if (kc_bidi_open(c->channels[idx], path, tok[0] ? &md : NULL, tok[0] ? 1 : 0, 0, out, st) != 0) {
        status_name(st, c, idx, path);
        return -1;
    }
    return 0;
}

int kc_etcd_keepalive(kc_etcd *c, int64_t id, int64_t *ttl, kc_status *st)
{
    static const char path[] = "/etcdserverpb.Lease/LeaseKeepAlive";
    Etcdserverpb__LeaseKeepAliveRequest req = ETCDSERVERPB__LEASE_KEEP_ALIVE_REQUEST__INIT;
    req.id = id;
    pthread_mutex_lock(&c->ka_mu);
    int start = current_get(c), rc = -1, retried = 0;
    for (int i = 0; i < c->n; i++) {
        int idx = (start + i) % c->n;
        char tok[ETCD_TOKEN_MAX] = "";
        int reused = c->ka != NULL;
        if (!c->ka && bidi_open(c, idx, path, &c->ka, tok, st) != 0) {
            if (endpoint_down(st->code))
                continue;
            break;
        }
        ProtobufCMessage *m = NULL;
        if (kc_stream_send(c->ka, &req.base, st) == 0 &&
            kc_stream_next_within(c->ka, &etcdserverpb__lease_keep_alive_response__descriptor, &m,
                                  c->timeout_ms, st) == 1) {
            *ttl = ((const Etcdserverpb__LeaseKeepAliveResponse *)m)->ttl;
            kc_message_free(m);
            if (i > 0)
                current_set(c, idx);
            rc = 0;
            break;
        }
        /* the stream broke (or ended): drop it; the next keep-alive opens a new one */
        if (st->code == GRPC_STATUS_OK)
            kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "the keep-alive stream ended");
        kc_stream_close(c->ka);
        c->ka = NULL;
        status_name(st, c, idx, path);
        if (st->code == GRPC_STATUS_UNAUTHENTICATED && tok[0])
            token_drop(c, tok);
        if (reused && !retried) {
            /* a stream opened before may have died with a restarted etcd: one fresh try */
            retried = 1;
            i--;
            continue;
        }
        if (!endpoint_down(st->code))
            break; /* etcd answered with an error: report it */
    }
    pthread_mutex_unlock(&c->ka_mu);
    return rc;
}

/* ------------------------------------------------------------------ watch */

int kc_etcd_watch_open(kc_etcd *c, const char *key, int prefix, int64_t start_revision,
                       int prev_kv, kc_etcd_watch **out, kc_status *st)
{
    static const char path[] = "/etcdserverpb.Watch/Watch";
    Etcdserverpb__WatchCreateRequest create = ETCDSERVERPB__WATCH_CREATE_REQUEST__INIT;
    create.key = bytes_of(key, strlen(key));
    if (prefix && prefix_end(key, &create.range_end) != 0)
        return oom(st);
    create.start_revision = start_revision;
    create.prev_kv = prev_kv ? 1 : 0;
    Etcdserverpb__WatchRequest req = ETCDSERVERPB__WATCH_REQUEST__INIT;
    req.request_union_case = ETCDSERVERPB__WATCH_REQUEST__REQUEST_UNION_CREATE_REQUEST;
    req.create_request = &create;
    kc_etcd_watch *w = calloc(1, sizeof *w);
    if (!w) {
        free(create.range_end.data);
        return oom(st);
    }
    w->c = c;
    int start = current_get(c), rc = -1;
    for (int i = 0; i < c->n; i++) {
        int idx = (start + i) % c->n;
        char tok[ETCD_TOKEN_MAX] = "";
        if (bidi_open(c, idx, path, &w->s, tok, st) != 0) {
            if (endpoint_down(st->code))
                continue;
            break;
        }
        ProtobufCMessage *m = NULL;
        if (kc_stream_send(w->s, &req.base, st) == 0 &&
            kc_stream_next_within(w->s, &etcdserverpb__watch_response__descriptor, &m,
                                  c->timeout_ms, st) == 1) {
            const Etcdserverpb__WatchResponse *r = (const Etcdserverpb__WatchResponse *)m;
            if (r->created && !r->canceled) {
                kc_message_free(m);
                w->endpoint = idx;
                current_set(c, idx);
                rc = 0;
                break;
            }
            kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION, "watch not created: %s",
                       r->cancel_reason && *r->cancel_reason ? r->cancel_reason
                                                             : "no reason given");
            kc_message_free(m);
        } else if (st->code == GRPC_STATUS_OK) {
            kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "the watch stream ended at once");
        }
        kc_stream_close(w->s);
        w->s = NULL;
        status_name(st, c, idx, path);
        if (tok[0] && (st->code == GRPC_STATUS_UNAUTHENTICATED ||
                       st->code == GRPC_STATUS_FAILED_PRECONDITION))
            token_drop(c, tok); /* an expired token: authenticate again next time */
        if (!endpoint_down(st->code))
            break;
    }
    free(create.range_end.data);
    if (rc != 0) {
        free(w);
        return -1;
    }
    *out = w;
    return 0;
}

static int event_copy(const Mvccpb__Event *src, kc_etcd_event *dst)
{
    memset(dst, 0, sizeof *dst);
    dst->type = src->type == MVCCPB__EVENT__EVENT_TYPE__DELETE ? KC_ETCD_EVENT_DELETE
                                                               : KC_ETCD_EVENT_PUT;
    static const Mvccpb__KeyValue empty = MVCCPB__KEY_VALUE__INIT;
    if (kv_copy(src->kv ? src->kv : &empty, &dst->kv) != 0)
        return -1;
    if (src->prev_kv) {
        if (kv_copy(src->prev_kv, &dst->prev_kv) != 0) {
            kc_etcd_kv_free(&dst->kv);
            return -1;
        }
        dst->has_prev = 1;
    }
    return 0;
}

int kc_etcd_watch_next(kc_etcd_watch *w, kc_etcd_watch_batch *out, kc_status *st)
{
    for (;;) {
        ProtobufCMessage *m = NULL;
        int rc = kc_stream_next(w->s, &etcdserverpb__watch_response__descriptor, &m, st);
        if (rc != 1) {
            if (rc == 0) /* etcd never ends a watch stream with OK by itself */
                kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "the watch stream ended");
            status_name(st, w->c, w->endpoint, "/etcdserverpb.Watch/Watch");
            return -1;
        }
        const Etcdserverpb__WatchResponse *r = (const Etcdserverpb__WatchResponse *)m;
        if (r->canceled && r->compact_revision <= 0) {
            kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION, "etcd %s cancelled the watch: %s",
                       w->c->endpoints[w->endpoint],
                       r->cancel_reason && *r->cancel_reason ? r->cancel_reason : "no reason");
            kc_message_free(m);
            return -1;
        }
        if (r->compact_revision <= 0 && r->n_events == 0) { /* progress or created: nothing new */
            kc_message_free(m);
            continue;
        }
        kc_etcd_watch_batch b = {0};
        b.revision = r->header ? r->header->revision : 0;
        b.compact_revision = r->compact_revision;
        b.events = calloc(r->n_events ? r->n_events : 1, sizeof *b.events);
        if (!b.events) {
            kc_message_free(m);
            return oom(st);
        }
        for (size_t i = 0; i < r->n_events; i++) {
            if (event_copy(r->events[i], &b.events[i]) != 0) {
                kc_etcd_watch_batch_free(&b);
                kc_message_free(m);
                return oom(st);
            }
            b.n++;
        }
        kc_message_free(m);
        *out = b;
        return 1;
    }
}

void kc_etcd_watch_batch_free(kc_etcd_watch_batch *b)
{
    if (!b)
        return;
    for (size_t i = 0; i < b->n; i++) {
        kc_etcd_kv_free(&b->events[i].kv);
        kc_etcd_kv_free(&b->events[i].prev_kv);
    }
    free(b->events);
    memset(b, 0, sizeof *b);
}

void kc_etcd_watch_cancel(kc_etcd_watch *w)
{
    if (w)
        kc_stream_cancel(w->s);
}

void kc_etcd_watch_close(kc_etcd_watch *w)
{
    if (!w)
        return;
    kc_stream_close(w->s);
    free(w);
}

/* ------------------------------------------------------------------ process flags */

int kc_etcd_flag(kc_etcd_config *c, const char *flag, const char *v)
{
    const char **slot = !strcmp(flag, "--etcd")        ? &c->endpoints
                        : !strcmp(flag, "--etcd-ca")   ? &c->ca_file
                        : !strcmp(flag, "--etcd-cert") ? &c->cert_file
                        : !strcmp(flag, "--etcd-key")  ? &c->key_file
                        : !strcmp(flag, "--etcd-user") ? &c->user
                                                       : NULL;
    if (!slot)
        return 0;
    *slot = v;
    return 1;
}

int kc_etcd_flags_finish(kc_etcd_config *c, char *err)
{
    if (!c->endpoints && (c->ca_file || c->cert_file || c->key_file || c->user)) {
        snprintf(err, 256, "--etcd-ca/--etcd-cert/--etcd-key/--etcd-user need --etcd");
        return -1;
    }
    if (c->user)
        c->password = getenv("KVRELAY_ETCD_PASSWORD");
    if (!c->endpoints)
        return 0;
    kc_etcd *probe = NULL;
    kc_status st;
    if (kc_etcd_create(c, &probe, &st) != 0) {
        snprintf(err, 256, "--etcd %.64s: %.180s", c->endpoints, st.details);
        return -1;
    }
    kc_etcd_destroy(probe);
    return 0;
}
