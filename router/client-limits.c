/*
 * client-limits.c - per-client limits (client-limits.h): the --limit-* flags and a key's own
 * options, a table of clients (open addressing, keyed by name) each with its streams in flight
 * and a token bucket, and the refusal messages. A client with no stream in flight and a full bucket is the
 * same as one never seen, so such entries are dropped when the table fills up.
 * Not here: where requests are admitted (request.c calls acquire/release around a request).
 * Test: ctest -R test_router_limits (an injected clock); tests/integration/limits.sh.
 */
#include "client-limits.h"
#include "apikey.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RT_LIMIT_MAX_COUNT 1000000L /* the largest concurrency or burst accepted */

typedef struct rt_limit_entry {
    char name[RT_CLIENT_NAME_MAX]; /* "" = free slot */
    int in_flight;
    double tokens;       /* in the bucket at refilled_ms */
    int64_t refilled_ms;
    rt_limit_conf conf;  /* the client's limits at its last request */
} rt_limit_entry;

struct rt_limits {
    pthread_mutex_t mu;
    rt_limit_conf conf; /* the flags' */
    int max_clients;
    int n_slots; /* 2 * max_clients: probes stay short */
    int used;
    rt_limit_entry *slots; /* [n_slots] */
    kc_counter *refusals[RT_LIMIT_KINDS];
};

/* ------------------------------------------------------------------ configuration */

enum { RT_LIMIT_VALUE_MAX = 64 }; /* bytes of one value */

/* v[0, len) NUL-terminated into buf; -1 when it is empty or too long. */
static int value_copy(const char *v, size_t len, char buf[RT_LIMIT_VALUE_MAX])
{
    if (len == 0 || len >= RT_LIMIT_VALUE_MAX) return -1;
    memcpy(buf, v, len);
    buf[len] = 0;
    return 0;
}

static int parse_count(const char *name, const char *v, size_t len, long *out, char *why, size_t cap)
{
    char buf[RT_LIMIT_VALUE_MAX], *end;
    if (value_copy(v, len, buf)) goto bad;
    errno = 0;
    long n = strtol(buf, &end, 10);
    if (errno || *end || n < 0 || n > RT_LIMIT_MAX_COUNT) goto bad;
    *out = n;
    return 0;
bad:
    snprintf(why, cap, "%s: '%.*s' is not an integer in [0, %ld]", name, (int)(len < 64 ? len : 64), v,
             RT_LIMIT_MAX_COUNT);
    return -1;
}

/* "R", "R/s" or "R/m": requests per second. */
static int parse_rate(const char *name, const char *v, size_t len, double *out, char *why, size_t cap)
{
    char buf[RT_LIMIT_VALUE_MAX], *end;
    if (value_copy(v, len, buf)) goto bad;
    errno = 0;
    double r = strtod(buf, &end);
    double per = 1.0;
    if (!strcmp(end, "/m")) per = 60.0;
    else if (*end && strcmp(end, "/s")) goto bad;
    if (errno || end == buf || !(r >= 0) || !isfinite(r) || r / per > (double)RT_LIMIT_MAX_COUNT) goto bad;
    *out = r / per;
    return 0;
bad:
    snprintf(why, cap, "%s: '%.*s' is not a rate: R, R/s or R/m with R a number >= 0 (e.g. 5/s, 30/m)", name,
             (int)(len < 64 ? len : 64), v);
    return -1;
}

int rt_limits_flag(rt_limit_conf *c, const char *flag, const char *v, char *err, size_t cap)
{
    if (!strcmp(flag, "--limit-concurrency")) return parse_count(flag, v, strlen(v), &c->concurrency, err, cap) ? -1 : 1;
    if (!strcmp(flag, "--limit-rate")) return parse_rate(flag, v, strlen(v), &c->rate, err, cap) ? -1 : 1;
    if (!strcmp(flag, "--limit-burst")) {
        long b;
        if (parse_count(flag, v, strlen(v), &b, err, cap)) return -1;
        c->burst = (double)b;
        return 1;
    }
    return 0;
}

int rt_limit_option(rt_limit_conf *c, const char *opt, size_t len, char *why, size_t cap)
{
    const char *eq = memchr(opt, '=', len);
    size_t nlen = eq ? (size_t)(eq - opt) : len;
    const char *v = eq ? eq + 1 : "";
    size_t vlen = eq ? len - nlen - 1 : 0;
    if (nlen == 11 && !memcmp(opt, "concurrency", 11)) return parse_count("concurrency", v, vlen, &c->concurrency, why, cap);
    if (nlen == 4 && !memcmp(opt, "rate", 4)) return parse_rate("rate", v, vlen, &c->rate, why, cap);
    if (nlen == 5 && !memcmp(opt, "burst", 5)) {
        long b;
        if (parse_count("burst", v, vlen, &b, why, cap)) return -1;
        c->burst = (double)b;
        return 0;
    }
    /* not echoed: it may be the rest of a key with a space in it */
    snprintf(why, cap, "not a limit (concurrency=N, rate=R[/s|/m] or burst=B); a key itself has no spaces");
    return -1;
}

/* The limits that apply to c: its key's own fields where set, else the flags'. */
static rt_limit_conf effective(const rt_limits *l, const rt_client *c)
{
    rt_limit_conf e = l->conf;
    if (c->own) {
        if (c->own->concurrency >= 0) e.concurrency = c->own->concurrency;
        if (c->own->rate >= 0) e.rate = c->own->rate;
        if (c->own->burst >= 0) e.burst = c->own->burst;
    }
    if (e.burst <= 0) e.burst = e.rate > 1 ? floor(e.rate) : 1;
    return e;
}

/* ------------------------------------------------------------------ the table */

rt_limits *rt_limits_create(const rt_limit_conf *conf, int max_clients)
{
    rt_limits *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    l->conf = *conf;
    l->max_clients = max_clients > 0 ? max_clients : RT_LIMIT_CLIENTS_MAX;
    l->n_slots = 2 * l->max_clients;
    l->slots = calloc((size_t)l->n_slots, sizeof *l->slots);
    if (!l->slots) {
        free(l);
        return NULL;
    }
    pthread_mutex_init(&l->mu, NULL);
    return l;
}

void rt_limits_free(rt_limits *l)
{
    if (!l) return;
    pthread_mutex_destroy(&l->mu);
    free(l->slots);
    free(l);
}

const char *rt_limit_kind_name(rt_limit_kind kind)
{
    static const char *const names[RT_LIMIT_KINDS] = {"concurrency", "rate", "clients"};
    return kind >= 0 && kind < RT_LIMIT_KINDS ? names[kind] : "ok";
}

int rt_limits_metrics_init(rt_limits *l, kc_registry *reg)
{
    for (int k = 0; k < RT_LIMIT_KINDS; k++) {
        char label[48];
        snprintf(label, sizeof label, "limit=\"%s\"", rt_limit_kind_name((rt_limit_kind)k));
        l->refusals[k] = kc_counter_add(reg, "kvrelay_limit_refusals_total",
                                        "Requests refused by a per-client limit (docs/router.md \"Limits\")", label);
        if (!l->refusals[k]) return -1;
    }
    return 0;
}

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* The slot holding `name`, or the free slot where it would go. mu held. */
static rt_limit_entry *slot_of(rt_limits *l, const char *name)
{
    int i = (int)(name_hash(name) % (uint64_t)l->n_slots);
    while (l->slots[i].name[0] && strcmp(l->slots[i].name, name) != 0) i = (i + 1) % l->n_slots;
    return &l->slots[i];
}

/* The bucket brought up to now_ms. */
static void refill(rt_limit_entry *e, const rt_limit_conf *conf, int64_t now_ms)
{
    if (now_ms > e->refilled_ms) {
        e->tokens += (double)(now_ms - e->refilled_ms) * conf->rate / 1000.0;
        e->refilled_ms = now_ms;
    }
    if (e->tokens > conf->burst) e->tokens = conf->burst;
}

/* Drops every client that is the same as a new one (nothing in flight, bucket full at now_ms)
 * and puts the others back, so that probing stays correct. mu held. */
static void compact(rt_limits *l, int64_t now_ms)
{
    rt_limit_entry *old = l->slots;
    rt_limit_entry *fresh = calloc((size_t)l->n_slots, sizeof *fresh);
    if (!fresh) return; /* the table stays as it is: new clients are refused until it has room */
    l->slots = fresh;
    l->used = 0;
    for (int i = 0; i < l->n_slots; i++) {
        rt_limit_entry *e = &old[i];
        if (!e->name[0]) continue;
        if (e->conf.rate > 0) refill(e, &e->conf, now_ms);
        if (e->in_flight == 0 && (e->conf.rate <= 0 || e->tokens >= e->conf.burst)) continue;
        *slot_of(l, e->name) = *e;
        l->used++;
    }
    free(old);
}

static void refuse(rt_limits *l, rt_client *c, rt_limit_kind kind, int64_t retry_ms, const rt_limit_conf *e)
{
    c->retry_after_ms = retry_ms;
    switch (kind) {
    case RT_LIMIT_KIND_CONCURRENCY:
        snprintf(c->refusal, sizeof c->refusal,
                 "concurrency limit: %s has %ld streams in flight, its cap (--limit-concurrency); retry after %lld ms "
                 "or once one of them ends", c->name, e->concurrency, (long long)retry_ms);
        break;
    case RT_LIMIT_KIND_RATE:
        snprintf(c->refusal, sizeof c->refusal,
                 "rate limit: %s is over %g requests/s with a burst of %g (--limit-rate, --limit-burst); retry after %lld ms",
                 c->name, e->rate, e->burst, (long long)retry_ms);
        break;
    default:
        snprintf(c->refusal, sizeof c->refusal,
                 "clients limit: the router tracks %d clients with limits at once and has no room for %s; retry after %lld ms",
                 l->max_clients, c->name, (long long)retry_ms);
        break;
    }
    if (l->refusals[kind]) kc_counter_inc(l->refusals[kind], 1);
}

rt_limit_kind rt_limits_acquire(rt_limits *l, rt_client *c, int64_t now_ms)
{
    c->held = 0;
    c->retry_after_ms = 0;
    c->refusal[0] = 0;
    rt_limit_conf e = effective(l, c);
    if (e.concurrency <= 0 && e.rate <= 0) return RT_LIMIT_KIND_OK;
    pthread_mutex_lock(&l->mu);
    rt_limit_entry *s = slot_of(l, c->name);
    if (!s->name[0]) { /* a new client: its bucket starts full */
        if (l->used >= l->max_clients) {
            compact(l, now_ms);
            s = slot_of(l, c->name);
        }
        if (l->used >= l->max_clients) {
            refuse(l, c, RT_LIMIT_KIND_CLIENTS, RT_LIMIT_CONCURRENCY_RETRY_MS, &e);
            pthread_mutex_unlock(&l->mu);
            return RT_LIMIT_KIND_CLIENTS;
        }
        snprintf(s->name, sizeof s->name, "%s", c->name);
        s->in_flight = 0;
        s->tokens = e.burst;
        s->refilled_ms = now_ms;
        l->used++;
    }
    s->conf = e;
    rt_limit_kind kind = RT_LIMIT_KIND_OK;
    int64_t retry_ms = 0;
    if (e.rate > 0) refill(s, &e, now_ms);
    if (e.concurrency > 0 && s->in_flight >= e.concurrency) {
        kind = RT_LIMIT_KIND_CONCURRENCY;
        retry_ms = RT_LIMIT_CONCURRENCY_RETRY_MS;
    } else if (e.rate > 0 && s->tokens < 1.0) {
        kind = RT_LIMIT_KIND_RATE;
        retry_ms = (int64_t)ceil((1.0 - s->tokens) * 1000.0 / e.rate - 1e-6); /* less rounding noise */
        if (retry_ms < 1) retry_ms = 1;
    }
    if (kind != RT_LIMIT_KIND_OK) {
        refuse(l, c, kind, retry_ms, &e);
    } else {
        if (e.rate > 0) s->tokens -= 1.0;
        s->in_flight++;
        c->held = 1;
    }
    pthread_mutex_unlock(&l->mu);
    return kind;
}

void rt_limits_release(rt_limits *l, rt_client *c)
{
    if (!c->held) return;
    pthread_mutex_lock(&l->mu);
    rt_limit_entry *s = slot_of(l, c->name);
    if (s->name[0] && s->in_flight > 0) s->in_flight--;
    pthread_mutex_unlock(&l->mu);
    c->held = 0;
}

int rt_limits_in_flight(rt_limits *l, const char *name)
{
    pthread_mutex_lock(&l->mu);
    const rt_limit_entry *s = slot_of(l, name);
    int n = s->name[0] ? s->in_flight : 0;
    pthread_mutex_unlock(&l->mu);
    return n;
}

/* ------------------------------------------------------------------ clients */

void rt_client_init(rt_client *c, const rt_apikeys *keys, const char *auth, size_t len, const char *peer)
{
    *c = (rt_client){0};
    int index = keys ? rt_apikeys_find(keys, auth, len) : -1;
    if (index >= 0) {
        snprintf(c->name, sizeof c->name, "key #%d", index + 1);
        c->own = rt_apikeys_limits(keys, index);
    } else {
        snprintf(c->name, sizeof c->name, "peer %s", peer && peer[0] ? peer : "unknown");
    }
}
