/*
 * membership.c - membership.h: the member JSON, the node's registration thread (lease, put,
 * keep-alive, re-registration) and the router's watch thread (list, watch, re-list), both on
 * common/etcd.h. Every transition is logged once, where it happens.
 * Not here: what the router does with the set (placement, suspicion) or the node's draining.
 * Test: ctest -R test_membership (real etcd).
 */
#include "membership.h"

#include "log.h"

#include <cjson/cJSON.h>

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KEY_MAX 512
#define BACKOFF_MIN_MS 250
#define BACKOFF_MAX_MS 4000
#define REGISTER_TIMEOUT_MS 2000 /* per etcd call of the registration thread */
#define WATCH_TIMEOUT_MS 1000    /* per etcd call of the watch thread: bounds kc_watch_stop */
#define REVOKE_TIMEOUT_MS 1000

static void err_set(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void err_set(char *err, const char *fmt, ...)
{
    if (!err)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, KC_MEMBER_ERR_LEN, fmt, ap);
    va_end(ap);
}

static int64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* ------------------------------------------------------------------ member and keys */

/* A key segment: 1-100 bytes of [A-Za-z0-9._-] (no '/', so keys cannot nest or escape). */
#define KC_SEGMENT_OK(s) kc_name_ok((s), 100)

int kc_name_ok(const char *s, size_t max_len)
{
    size_t n = strlen(s);
    if (n == 0 || n > max_len)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

/* Every string field NUL-terminated within its array, and the required ones valid. */
static int member_check(const kc_member *m, char *err)
{
#define TERMINATED(f)                                                                              \
    if (strnlen(m->f, sizeof m->f) == sizeof m->f) {                                               \
        err_set(err, "member field \"" #f "\" is not terminated within %zu bytes", sizeof m->f);   \
        return -1;                                                                                 \
    }
    TERMINATED(id)
    TERMINATED(role)
    TERMINATED(state)
    TERMINATED(grpc)
    TERMINATED(transfer)
    TERMINATED(fingerprint)
    TERMINATED(version)
#undef TERMINATED
    if (!KC_SEGMENT_OK(m->id)) {
        err_set(err, "member id \"%s\" must be 1-100 characters of A-Z a-z 0-9 . _ -", m->id);
        return -1;
    }
    if (strcmp(m->role, "prefill") != 0 && strcmp(m->role, "decode") != 0) {
        err_set(err, "member role \"%s\" is neither \"prefill\" nor \"decode\"", m->role);
        return -1;
    }
    if (strcmp(m->state, "serving") != 0 && strcmp(m->state, "draining") != 0) {
        err_set(err, "member state \"%s\" is neither \"serving\" nor \"draining\"", m->state);
        return -1;
    }
    if (!m->grpc[0]) {
        err_set(err, "member \"%s\" has no grpc address", m->id);
        return -1;
    }
    return 0;
}

int kc_member_prefix(const char *cluster, char *buf, size_t size)
{
    int n = snprintf(buf, size, "/kvrelay/%s/nodes/", cluster);
    return n > 0 && (size_t)n < size ? 0 : -1;
}

int kc_member_key(const char *cluster, const kc_member *m, char *buf, size_t size)
{
    int n = snprintf(buf, size, "/kvrelay/%s/nodes/%s/%s", cluster, m->role, m->id);
    return n > 0 && (size_t)n < size ? 0 : -1;
}

char *kc_member_to_json(const kc_member *m)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    int ok = cJSON_AddStringToObject(o, "id", m->id) && cJSON_AddStringToObject(o, "role", m->role) &&
             cJSON_AddStringToObject(o, "state", m->state) &&
             cJSON_AddStringToObject(o, "grpc", m->grpc) &&
             cJSON_AddStringToObject(o, "transfer", m->transfer) &&
             cJSON_AddStringToObject(o, "fingerprint", m->fingerprint) &&
             cJSON_AddNumberToObject(o, "kv_capacity", (double)m->kv_capacity) &&
             cJSON_AddStringToObject(o, "version", m->version) &&
             cJSON_AddNumberToObject(o, "start_unix_ms", (double)m->start_unix_ms);
    char *s = ok ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    return s;
}

/* Copies string field `name` into dst[size]; a missing one is an error only when required. */
static int json_string(const cJSON *o, const char *name, int required, char *dst, size_t size,
                       char *err)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!it) {
        if (required) {
            err_set(err, "member JSON lacks \"%s\"", name);
            return -1;
        }
        return 0;
    }
    if (!cJSON_IsString(it) || !it->valuestring) {
        err_set(err, "member JSON field \"%s\" is not a string", name);
        return -1;
    }
    size_t n = strlen(it->valuestring);
    if (n >= size) {
        err_set(err, "member JSON field \"%s\" is %zu bytes, over the %zu allowed", name, n,
                size - 1);
        return -1;
    }
    memcpy(dst, it->valuestring, n + 1);
    return 0;
}

/* An optional integer field in [min, 2^53]. */
static int json_integer(const cJSON *o, const char *name, double min, double *out, char *err)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!it)
        return 0;
    double v = cJSON_IsNumber(it) ? it->valuedouble : -1e300;
    if (!cJSON_IsNumber(it) || v < min || v > 9007199254740992.0 || v != (double)(int64_t)v) {
        err_set(err, "member JSON field \"%s\" is not an integer >= %.0f", name, min);
        return -1;
    }
    *out = v;
    return 0;
}

int kc_member_from_json(const char *json, size_t len, kc_member *out, char *err)
{
    cJSON *o = cJSON_ParseWithLength(json, len);
    if (!o || !cJSON_IsObject(o)) {
        cJSON_Delete(o);
        err_set(err, "member value is not a JSON object (%zu bytes)", len);
        return -1;
    }
    kc_member m;
    memset(&m, 0, sizeof m);
    double cap = 0, start = 0;
    int rc = -1;
    if (json_string(o, "id", 1, m.id, sizeof m.id, err) != 0 ||
        json_string(o, "role", 1, m.role, sizeof m.role, err) != 0 ||
        json_string(o, "state", 1, m.state, sizeof m.state, err) != 0 ||
        json_string(o, "grpc", 1, m.grpc, sizeof m.grpc, err) != 0 ||
        json_string(o, "transfer", 0, m.transfer, sizeof m.transfer, err) != 0 ||
        json_string(o, "fingerprint", 0, m.fingerprint, sizeof m.fingerprint, err) != 0 ||
        json_string(o, "version", 0, m.version, sizeof m.version, err) != 0 ||
        json_integer(o, "kv_capacity", 0, &cap, err) != 0 ||
        json_integer(o, "start_unix_ms", 0, &start, err) != 0)
        goto out;
    m.kv_capacity = (uint64_t)cap;
    m.start_unix_ms = (int64_t)start;
    if (member_check(&m, err) != 0)
        goto out;
    *out = m;
    rc = 0;
out:
    cJSON_Delete(o);
    return rc;
}

/* ------------------------------------------------------------------ shared by both threads */

static int cond_init_monotonic(pthread_cond_t *cond)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cond, &a);
    pthread_condattr_destroy(&a);
    return rc;
}

/* Waits up to ms on cond (mu held by the caller); returns when *stop is set or time is up. */
static void cond_wait_ms(pthread_cond_t *cond, pthread_mutex_t *mu, const int *stop, int64_t ms)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += ms / 1000;
    t.tv_nsec += (ms % 1000) * 1000000;
    if (t.tv_nsec >= 1000000000) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000;
    }
    while (!*stop && pthread_cond_timedwait(cond, mu, &t) == 0) {
    }
}

/* The wait between retries while etcd fails: BACKOFF_MIN_MS at least, then until `ms` passed or
 * an etcd endpoint is connected again (waiting on the channel is what lets gRPC reconnect
 * promptly). Returns 1 when asked to stop. */
static int backoff_wait(kc_etcd *etcd, pthread_mutex_t *mu, pthread_cond_t *cond,
                        const int *stop, int64_t ms)
{
    pthread_mutex_lock(mu);
    cond_wait_ms(cond, mu, stop, BACKOFF_MIN_MS);
    int s = *stop;
    pthread_mutex_unlock(mu);
    int64_t end = now_ms() + ms - BACKOFF_MIN_MS;
    while (!s && now_ms() < end) {
        int64_t slice = end - now_ms();
        if (kc_etcd_wait_ready(etcd, slice < 250 ? (slice > 0 ? slice : 1) : 250))
            break;
        pthread_mutex_lock(mu);
        s = *stop;
        pthread_mutex_unlock(mu);
    }
    return s;
}

static int64_t backoff_next(int64_t b, int64_t cap)
{
    return 2 * b < cap ? 2 * b : cap;
}

/* ------------------------------------------------------------------ registration */

struct kc_registration {
    kc_etcd *etcd;
    char key[KEY_MAX];
    int ttl_s;
    pthread_t thread;
    pthread_mutex_t put_mu; /* one "member + lease -> put" at a time; guards dirty */
    pthread_mutex_t mu;     /* the fields below */
    pthread_cond_t cond;
    int stop;
    kc_member member;
    int64_t lease; /* 0: none */
    int live;
    int dirty; /* the member changed and is not in etcd yet (under put_mu) */
};

static void reg_set_lease(kc_registration *r, int64_t lease)
{
    pthread_mutex_lock(&r->mu);
    r->lease = lease;
    r->live = lease != 0;
    pthread_mutex_unlock(&r->mu);
}

/* Puts the current member under `lease`. put_mu held. */
static int reg_put(kc_registration *r, int64_t lease, kc_status *st)
{
    pthread_mutex_lock(&r->mu);
    char *json = kc_member_to_json(&r->member);
    pthread_mutex_unlock(&r->mu);
    if (!json) {
        st->code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        snprintf(st->details, sizeof st->details, "out of memory");
        return -1;
    }
    int rc = kc_etcd_put(r->etcd, r->key, json, strlen(json), lease, NULL, st);
    free(json);
    if (rc == 0)
        r->dirty = 0;
    return rc;
}

/* A new lease and the key under it. */
static int reg_register(kc_registration *r, kc_status *st)
{
    int64_t lease = 0, granted = 0;
    if (kc_etcd_lease_grant(r->etcd, r->ttl_s, &lease, &granted, st) != 0)
        return -1;
    pthread_mutex_lock(&r->put_mu);
    int rc = reg_put(r, lease, st);
    if (rc == 0)
        reg_set_lease(r, lease);
    pthread_mutex_unlock(&r->put_mu);
    if (rc != 0) {
        kc_status ignored;
        kc_etcd_lease_revoke(r->etcd, lease, REVOKE_TIMEOUT_MS, &ignored); /* or it expires */
        return -1;
    }
    kc_info(NULL, "membership: registered %s under lease %llx (ttl %lld s) at etcd %s", r->key,
            (unsigned long long)lease, (long long)granted, kc_etcd_endpoint(r->etcd));
    return 0;
}

static void *reg_thread(void *arg)
{
    kc_registration *r = arg;
    const int64_t interval = r->ttl_s * 1000 / 3;
    const int64_t backoff_cap = interval < BACKOFF_MAX_MS ? interval : BACKOFF_MAX_MS;
    int64_t backoff = BACKOFF_MIN_MS, delay = 0;
    int failing = 0; /* etcd failed since the last success: log the recovery, re-put */
    for (;;) {
        if (failing) {
            if (backoff_wait(r->etcd, &r->mu, &r->cond, &r->stop, delay))
                break;
        } else {
            pthread_mutex_lock(&r->mu);
            cond_wait_ms(&r->cond, &r->mu, &r->stop, delay);
            int s = r->stop;
            pthread_mutex_unlock(&r->mu);
            if (s)
                break;
        }
        pthread_mutex_lock(&r->mu);
        int64_t lease = r->lease;
        pthread_mutex_unlock(&r->mu);
        kc_status st;
        if (lease == 0) {
            if (reg_register(r, &st) == 0) {
                failing = 0;
                backoff = BACKOFF_MIN_MS;
                delay = interval;
            } else {
                if (!failing)
                    kc_warn(NULL, "membership: cannot register %s: %s; retrying with backoff",
                            r->key, st.details);
                failing = 1;
                delay = backoff;
                backoff = backoff_next(backoff, backoff_cap);
            }
            continue;
        }
        int64_t ttl = 0;
        if (kc_etcd_keepalive(r->etcd, lease, &ttl, &st) != 0) {
            if (!failing)
                kc_warn(NULL, "membership: keep-alive of %s (lease %llx) failed: %s; retrying "
                        "with backoff", r->key, (unsigned long long)lease, st.details);
            pthread_mutex_lock(&r->mu);
            r->live = 0;
            pthread_mutex_unlock(&r->mu);
            failing = 1;
            delay = backoff;
            backoff = backoff_next(backoff, backoff_cap);
            continue;
        }
        if (ttl <= 0) {
            kc_warn(NULL, "membership: lease %llx of %s is gone (etcd answered TTL 0); "
                    "registering again", (unsigned long long)lease, r->key);
            reg_set_lease(r, 0);
            delay = 0;
            continue;
        }
        pthread_mutex_lock(&r->put_mu);
        int put = failing || r->dirty; /* after a failure the key may be gone: put it again */
        int rc = put ? reg_put(r, lease, &st) : 0;
        pthread_mutex_unlock(&r->put_mu);
        if (rc != 0) {
            kc_warn(NULL, "membership: put of %s under lease %llx failed: %s", r->key,
                    (unsigned long long)lease, st.details);
            if (st.code == GRPC_STATUS_NOT_FOUND)
                reg_set_lease(r, 0);
            delay = BACKOFF_MIN_MS;
            continue;
        }
        if (failing)
            kc_info(NULL, "membership: etcd %s answers again; %s kept under lease %llx (ttl %lld s)",
                    kc_etcd_endpoint(r->etcd), r->key, (unsigned long long)lease, (long long)ttl);
        pthread_mutex_lock(&r->mu);
        r->live = 1;
        pthread_mutex_unlock(&r->mu);
        failing = 0;
        backoff = BACKOFF_MIN_MS;
        delay = interval;
    }
    return NULL;
}

/* What registration and watch both start with: endpoints given, a valid cluster name, and a
 * client with `default_timeout_ms` per call unless the config sets one. */
static int start_client(const kc_etcd_config *cfg, const char *cluster, int64_t default_timeout_ms,
                        kc_etcd **out, char *err)
{
    if (!cfg || !cfg->endpoints || !*cfg->endpoints) {
        err_set(err, "no etcd endpoints given");
        return -1;
    }
    if (!cluster || !KC_SEGMENT_OK(cluster)) {
        err_set(err, "cluster name \"%s\" must be 1-100 characters of A-Z a-z 0-9 . _ -",
                cluster ? cluster : "(null)");
        return -1;
    }
    kc_etcd_config c = *cfg;
    if (c.timeout_ms <= 0)
        c.timeout_ms = default_timeout_ms;
    kc_status st;
    if (kc_etcd_create(&c, out, &st) != 0) {
        err_set(err, "%s", st.details);
        return -1;
    }
    return 0;
}

int kc_register_start_cfg(const kc_etcd_config *cfg, const char *cluster, const kc_member *m,
                          int ttl_s, kc_registration **out, char *err)
{
    if (ttl_s < 2) {
        err_set(err, "lease TTL %d s is below the minimum of 2 s", ttl_s);
        return -1;
    }
    if (member_check(m, err) != 0)
        return -1;
    kc_etcd *e;
    if (start_client(cfg, cluster, REGISTER_TIMEOUT_MS, &e, err) != 0)
        return -1;
    kc_registration *r = calloc(1, sizeof *r);
    if (!r) {
        err_set(err, "out of memory");
        kc_etcd_destroy(e);
        return -1;
    }
    r->etcd = e;
    if (kc_member_key(cluster, m, r->key, sizeof r->key) != 0) {
        err_set(err, "member key for \"%s\" is too long", m->id);
        kc_etcd_destroy(e);
        free(r);
        return -1;
    }
    r->ttl_s = ttl_s;
    r->member = *m;
    pthread_mutex_init(&r->put_mu, NULL);
    pthread_mutex_init(&r->mu, NULL);
    cond_init_monotonic(&r->cond);
    if (pthread_create(&r->thread, NULL, reg_thread, r) != 0) {
        err_set(err, "cannot start the registration thread");
        pthread_cond_destroy(&r->cond);
        pthread_mutex_destroy(&r->mu);
        pthread_mutex_destroy(&r->put_mu);
        kc_etcd_destroy(r->etcd);
        free(r);
        return -1;
    }
    *out = r;
    return 0;
}

int kc_register_start(const char *endpoints, const char *cluster, const kc_member *m, int ttl_s,
                      kc_registration **out, char *err)
{
    kc_etcd_config cfg = {.endpoints = endpoints};
    return kc_register_start_cfg(&cfg, cluster, m, ttl_s, out, err);
}

int kc_register_update(kc_registration *r, const kc_member *m)
{
    char err[KC_MEMBER_ERR_LEN];
    if (member_check(m, err) != 0) {
        kc_warn(NULL, "membership: update of %s refused: %s", r->key, err);
        return -1;
    }
    pthread_mutex_lock(&r->put_mu);
    pthread_mutex_lock(&r->mu);
    int same = strcmp(m->id, r->member.id) == 0 && strcmp(m->role, r->member.role) == 0;
    if (same)
        r->member = *m;
    int64_t lease = r->lease;
    pthread_mutex_unlock(&r->mu);
    if (!same) {
        pthread_mutex_unlock(&r->put_mu);
        kc_warn(NULL, "membership: update of %s refused: role/id %s/%s differ", r->key, m->role,
                m->id);
        return -1;
    }
    r->dirty = 1;
    int rc = -1;
    kc_status st;
    if (lease != 0 && (rc = reg_put(r, lease, &st)) != 0)
        kc_warn(NULL, "membership: update of %s not in etcd yet (%s); the registration thread "
                "retries", r->key, st.details);
    pthread_mutex_unlock(&r->put_mu);
    if (rc == 0)
        kc_info(NULL, "membership: %s updated (state %s)", r->key, m->state);
    return rc;
}

int kc_register_live(kc_registration *r)
{
    pthread_mutex_lock(&r->mu);
    int live = r->live;
    pthread_mutex_unlock(&r->mu);
    return live;
}

static void reg_end(kc_registration *r, int revoke)
{
    if (!r)
        return;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    if (revoke && r->lease != 0) {
        kc_status st;
        if (kc_etcd_lease_revoke(r->etcd, r->lease, REVOKE_TIMEOUT_MS, &st) == 0)
            kc_info(NULL, "membership: deregistered %s (lease %llx revoked)", r->key,
                    (unsigned long long)r->lease);
        else
            kc_warn(NULL, "membership: revoking lease %llx of %s failed: %s; the key goes when "
                    "the lease expires", (unsigned long long)r->lease, r->key, st.details);
    }
    kc_etcd_destroy(r->etcd);
    pthread_cond_destroy(&r->cond);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->put_mu);
    free(r);
}

void kc_register_stop(kc_registration *r)
{
    reg_end(r, 1);
}

void kc_register_abandon(kc_registration *r)
{
    reg_end(r, 0);
}

/* ------------------------------------------------------------------ watch */

typedef struct {
    char *key;
    kc_member m;
} watch_entry;

struct kc_watch {
    kc_etcd *etcd;
    char prefix[KEY_MAX];
    kc_members_fn fn;
    void *user;
    pthread_t thread;
    pthread_mutex_t mu; /* stop, cur */
    pthread_cond_t cond;
    int stop;
    kc_etcd_watch *cur; /* the open watch, for kc_watch_stop to cancel */
    /* the watch thread's own */
    watch_entry *set;   /* sorted by key */
    size_t n, cap;
    kc_member *scratch; /* [cap] for the callback */
};

static int entry_cmp(const void *a, const void *b)
{
    return strcmp(((const watch_entry *)a)->key, ((const watch_entry *)b)->key);
}

static void set_clear(watch_entry *set, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(set[i].key);
}

static int set_reserve(kc_watch *w, size_t want)
{
    if (want <= w->cap)
        return 0;
    size_t cap = w->cap ? w->cap : 16;
    while (cap < want)
        cap *= 2;
    watch_entry *s = realloc(w->set, cap * sizeof *s);
    if (!s)
        return -1;
    w->set = s;
    kc_member *m = realloc(w->scratch, cap * sizeof *m);
    if (!m)
        return -1;
    w->scratch = m;
    w->cap = cap;
    return 0;
}

static void watch_notify(kc_watch *w)
{
    for (size_t i = 0; i < w->n; i++)
        w->scratch[i] = w->set[i].m;
    w->fn(w->user, w->scratch, (int)w->n);
}

/* Parses a value; logs and returns -1 for one that is not a valid member. */
static int watch_parse(const kc_etcd_kv *kv, kc_member *m)
{
    char err[KC_MEMBER_ERR_LEN];
    memset(m, 0, sizeof *m);
    if (kc_member_from_json(kv->value, kv->value_len, m, err) != 0) {
        kc_warn(NULL, "membership: %s ignored: %s", kv->key, err);
        return -1;
    }
    return 0;
}

/* Replaces the set with a listing; 1 when it differs from the old one, -1 out of memory. */
static int watch_relist(kc_watch *w, const kc_etcd_range_result *r)
{
    watch_entry *fresh = calloc(r->n ? r->n : 1, sizeof *fresh);
    if (!fresh)
        return -1;
    size_t n = 0;
    for (size_t i = 0; i < r->n; i++) {
        if (watch_parse(&r->kvs[i], &fresh[n].m) != 0)
            continue;
        if (!(fresh[n].key = strdup(r->kvs[i].key))) {
            set_clear(fresh, n);
            free(fresh);
            return -1;
        }
        n++;
    }
    qsort(fresh, n, sizeof *fresh, entry_cmp);
    int changed = n != w->n;
    for (size_t i = 0; !changed && i < n; i++)
        changed = strcmp(fresh[i].key, w->set[i].key) != 0 ||
                  memcmp(&fresh[i].m, &w->set[i].m, sizeof fresh[i].m) != 0;
    if (set_reserve(w, n) != 0) {
        set_clear(fresh, n);
        free(fresh);
        return -1;
    }
    set_clear(w->set, w->n);
    if (n)
        memcpy(w->set, fresh, n * sizeof *fresh);
    w->n = n;
    free(fresh);
    return changed;
}

static long set_find(const kc_watch *w, const char *key)
{
    for (size_t i = 0; i < w->n; i++)
        if (strcmp(w->set[i].key, key) == 0)
            return (long)i;
    return -1;
}

/* Applies one event; 1 when the set changed, -1 out of memory. */
static int watch_apply(kc_watch *w, const kc_etcd_event *e)
{
    long at = set_find(w, e->kv.key);
    if (e->type == KC_ETCD_EVENT_DELETE) {
        if (at < 0)
            return 0;
        free(w->set[at].key);
        memmove(&w->set[at], &w->set[at + 1], (w->n - (size_t)at - 1) * sizeof *w->set);
        w->n--;
        return 1;
    }
    kc_member m;
    if (watch_parse(&e->kv, &m) != 0) {
        if (at < 0)
            return 0;
        /* a key that no longer holds a valid member leaves the set */
        free(w->set[at].key);
        memmove(&w->set[at], &w->set[at + 1], (w->n - (size_t)at - 1) * sizeof *w->set);
        w->n--;
        return 1;
    }
    if (at >= 0) {
        if (memcmp(&w->set[at].m, &m, sizeof m) == 0)
            return 0;
        w->set[at].m = m;
        return 1;
    }
    if (set_reserve(w, w->n + 1) != 0)
        return -1;
    char *key = strdup(e->kv.key);
    if (!key)
        return -1;
    w->set[w->n].key = key;
    w->set[w->n].m = m;
    w->n++;
    qsort(w->set, w->n, sizeof *w->set, entry_cmp);
    return 1;
}

static int watch_stopping(kc_watch *w)
{
    pthread_mutex_lock(&w->mu);
    int s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

static void *watch_thread(void *arg)
{
    kc_watch *w = arg;
    int64_t rev = 0, backoff = BACKOFF_MIN_MS;
    int need_list = 1, first = 1, failing = 0;
    while (!watch_stopping(w)) {
        kc_status st;
        if (need_list) {
            kc_etcd_range_result r;
            if (kc_etcd_range(w->etcd, w->prefix, 1, 0, &r, &st) != 0) {
                if (!failing)
                    kc_warn(NULL, "membership: cannot list %s: %s; keeping the last %zu members, "
                            "retrying with backoff", w->prefix, st.details, w->n);
                failing = 1;
                if (backoff_wait(w->etcd, &w->mu, &w->cond, &w->stop, backoff))
                    break;
                backoff = backoff_next(backoff, BACKOFF_MAX_MS);
                continue;
            }
            int changed = watch_relist(w, &r);
            rev = r.revision;
            kc_etcd_range_free(&r);
            if (changed < 0) {
                kc_error(NULL, "membership: out of memory listing %s", w->prefix);
                if (backoff_wait(w->etcd, &w->mu, &w->cond, &w->stop, BACKOFF_MAX_MS))
                    break;
                continue;
            }
            kc_info(NULL, "membership: listed %s: %zu members at revision %lld%s", w->prefix,
                    w->n, (long long)rev, failing ? " (etcd answers again)" : "");
            if (first || changed)
                watch_notify(w);
            first = 0;
            need_list = 0;
        }
        kc_etcd_watch *ew = NULL;
        if (kc_etcd_watch_open(w->etcd, w->prefix, 1, rev + 1, 0, &ew, &st) != 0) {
            if (!failing)
                kc_warn(NULL, "membership: cannot watch %s: %s; retrying with backoff", w->prefix,
                        st.details);
            failing = 1;
            need_list = 1;
            if (backoff_wait(w->etcd, &w->mu, &w->cond, &w->stop, backoff))
                break;
            backoff = backoff_next(backoff, BACKOFF_MAX_MS);
            continue;
        }
        pthread_mutex_lock(&w->mu);
        int s = w->stop;
        if (!s)
            w->cur = ew;
        pthread_mutex_unlock(&w->mu);
        if (s) {
            kc_etcd_watch_close(ew);
            break;
        }
        failing = 0;
        backoff = BACKOFF_MIN_MS;
        int64_t opened = now_ms();
        kc_etcd_watch_batch b;
        int rc;
        while ((rc = kc_etcd_watch_next(ew, &b, &st)) == 1) {
            if (b.compact_revision > 0) {
                kc_info(NULL, "membership: watch of %s from revision %lld hit compaction at %lld; "
                        "re-listing", w->prefix, (long long)(rev + 1),
                        (long long)b.compact_revision);
                kc_etcd_watch_batch_free(&b);
                break;
            }
            int changed = 0, oom = 0;
            for (size_t i = 0; i < b.n; i++) {
                int c = watch_apply(w, &b.events[i]);
                oom |= c < 0;
                changed |= c > 0;
                if (b.events[i].kv.mod_revision > rev)
                    rev = b.events[i].kv.mod_revision;
            }
            kc_etcd_watch_batch_free(&b);
            if (oom) {
                kc_error(NULL, "membership: out of memory applying events; re-listing");
                break;
            }
            if (changed)
                watch_notify(w);
        }
        pthread_mutex_lock(&w->mu);
        w->cur = NULL;
        s = w->stop;
        pthread_mutex_unlock(&w->mu);
        kc_etcd_watch_close(ew);
        if (s)
            break;
        need_list = 1; /* after any end of the watch: list again, then watch from there */
        if (rc != 1) {
            kc_warn(NULL, "membership: watch of %s ended: %s; keeping the last %zu members, "
                    "re-listing", w->prefix, st.details, w->n);
            failing = 1;
            if (now_ms() - opened < 1000 &&
                backoff_wait(w->etcd, &w->mu, &w->cond, &w->stop, backoff))
                break;
        }
    }
    return NULL;
}

int kc_watch_start_cfg(const kc_etcd_config *cfg, const char *cluster, kc_members_fn fn,
                       void *user, kc_watch **out, char *err)
{
    if (!fn) {
        err_set(err, "no members callback given");
        return -1;
    }
    kc_etcd *e;
    if (start_client(cfg, cluster, WATCH_TIMEOUT_MS, &e, err) != 0)
        return -1;
    kc_watch *w = calloc(1, sizeof *w);
    if (!w) {
        err_set(err, "out of memory");
        kc_etcd_destroy(e);
        return -1;
    }
    w->etcd = e;
    kc_member_prefix(cluster, w->prefix, sizeof w->prefix);
    w->fn = fn;
    w->user = user;
    if (set_reserve(w, 16) != 0) { /* also: the callback never gets NULL, even for 0 members */
        err_set(err, "out of memory");
        kc_etcd_destroy(w->etcd);
        free(w->set);
        free(w);
        return -1;
    }
    pthread_mutex_init(&w->mu, NULL);
    cond_init_monotonic(&w->cond);
    if (pthread_create(&w->thread, NULL, watch_thread, w) != 0) {
        err_set(err, "cannot start the membership watch thread");
        pthread_cond_destroy(&w->cond);
        pthread_mutex_destroy(&w->mu);
        kc_etcd_destroy(w->etcd);
        free(w->set);
        free(w->scratch);
        free(w);
        return -1;
    }
    *out = w;
    return 0;
}

int kc_watch_start(const char *endpoints, const char *cluster, kc_members_fn fn, void *user,
                   kc_watch **out, char *err)
{
    kc_etcd_config cfg = {.endpoints = endpoints};
    return kc_watch_start_cfg(&cfg, cluster, fn, user, out, err);
}

void kc_watch_stop(kc_watch *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    if (w->cur)
        kc_etcd_watch_cancel(w->cur);
    pthread_cond_broadcast(&w->cond);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    set_clear(w->set, w->n);
    free(w->set);
    free(w->scratch);
    kc_etcd_destroy(w->etcd);
    pthread_cond_destroy(&w->cond);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
