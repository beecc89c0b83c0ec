/*
 * client-limits.h - the router's per-client limits: a cap on concurrent streams (requests in flight,
 * queued ones included) and a token-bucket request rate (rate + burst), counted per API key, or
 * per client address when the router runs without keys. Defaults come from the --limit-* flags;
 * a key in --api-key-file may carry its own (apikey.h). A refusal is RESOURCE_EXHAUSTED (HTTP
 * 429) with a retry hint, counted in kvrelay_limit_refusals_total{limit=...}.
 * Not here: the prompt and message size caps (--max-prompt-tokens in validate.c,
 * --max-request-bytes on the servers: main.c), limits shared between several routers.
 * The clock is passed in, so the bucket is tested deterministically: ctest -R test_router_limits.
 * docs/router.md "Limits".
 */
#ifndef RT_CLIENT_LIMITS_H
#define RT_CLIENT_LIMITS_H

#include "metrics.h"

#include <stddef.h>
#include <stdint.h>

#define RT_CLIENT_NAME_MAX 96 /* bytes of a client's name, "key #3" or "peer 10.0.0.7" */
#define RT_LIMIT_CLIENTS_MAX 4096 /* clients tracked at once (idle ones with a full bucket are dropped) */
#define RT_LIMIT_CONCURRENCY_RETRY_MS 1000 /* the hint given when a client's streams are all in use */

/* One client's limits. In a key's own limits a negative field means "the flag's value". */
typedef struct rt_limit_conf {
    long concurrency; /* streams in flight at once; 0 = no cap */
    double rate;      /* requests per second added to the bucket; 0 = no rate limit */
    double burst;     /* the bucket's size: requests at once after a quiet spell; 0 = max(1, rate) */
} rt_limit_conf;

/* Which limit refused a request (the metric's label, rt_limit_kind_name). */
typedef enum rt_limit_kind {
    RT_LIMIT_KIND_OK = -1,
    RT_LIMIT_KIND_CONCURRENCY = 0, /* the client has `concurrency` streams in flight */
    RT_LIMIT_KIND_RATE = 1,        /* the client's bucket is empty */
    RT_LIMIT_KIND_CLIENTS = 2,     /* RT_LIMIT_CLIENTS_MAX other clients are being tracked */
    RT_LIMIT_KINDS = 3,
} rt_limit_kind;

/* The flags' parsing (router/main.c's flag table calls it for --limit-*). */
/* 1 when `flag` is --limit-concurrency, --limit-rate or --limit-burst (v parsed into *c; a bad
 * value writes err (`cap` bytes) naming the flag and returns -1), 0 for another flag. */
int rt_limits_flag(rt_limit_conf *c, const char *flag, const char *v, char *err, size_t cap);
/* One "name=value" option of a key line (concurrency, rate, burst) into *c. Returns 0, or -1
 * with why (`cap` bytes, naming the option). */
int rt_limit_option(rt_limit_conf *c, const char *opt, size_t len, char *why, size_t cap);

/* The per-client counts. Thread-safe. */
typedef struct rt_limits rt_limits;

/* `conf` is the flags' limits (copied); `max_clients` (0 = RT_LIMIT_CLIENTS_MAX) bounds the
 * table. Returns NULL when out of memory. Free with rt_limits_free. */
rt_limits *rt_limits_create(const rt_limit_conf *conf, int max_clients);
void rt_limits_free(rt_limits *l);
/* Registers kvrelay_limit_refusals_total{limit="concurrency"|"rate"|"clients"}. 0 or -1. */
int rt_limits_metrics_init(rt_limits *l, kc_registry *reg);
const char *rt_limit_kind_name(rt_limit_kind kind);

typedef struct rt_apikeys rt_apikeys; /* apikey.h */

/* Whom a request counts against, and what came of asking. */
typedef struct rt_client {
    char name[RT_CLIENT_NAME_MAX]; /* "key #N" (its place among the loaded keys) or "peer ADDRESS" */
    const rt_limit_conf *own;      /* the key's own limits, borrowed from the keys; NULL: none */
    int held;                      /* a stream slot is held: give it back with rt_limits_release */
    int64_t retry_after_ms;        /* on a refusal: when trying again may succeed */
    char refusal[256];             /* on a refusal: the message for the client */
} rt_client;

/* Names the client of a request: with keys, the key its authorization carries (`auth`, `len`
 * bytes, already accepted by the API key check); without, `peer` (an address without port). */
void rt_client_init(rt_client *c, const rt_apikeys *keys, const char *auth, size_t len, const char *peer);

/* Admits one request of `c` at `now_ms` (any monotonic millisecond clock): takes a stream slot
 * and a token. Returns RT_LIMIT_KIND_OK (c->held set when a slot was taken), or the limit that
 * refused it with c->retry_after_ms and c->refusal set and the refusal counted; a refused
 * request takes nothing. */
rt_limit_kind rt_limits_acquire(rt_limits *l, rt_client *c, int64_t now_ms);
/* Gives back the slot taken by rt_limits_acquire; nothing when none is held. */
void rt_limits_release(rt_limits *l, rt_client *c);
/* Streams `name` has in flight (tests, and the check that none leaks). */
int rt_limits_in_flight(rt_limits *l, const char *name);

#endif /* RT_CLIENT_LIMITS_H */
