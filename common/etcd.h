/*
 * etcd.h - a small etcd v3 client on gRPC C core + protobuf-c (our own minimal proto with etcd's
 * field numbers, proto/etcd/): KV Range/Put/DeleteRange/Txn (create-if-absent), Lease
 * Grant/Revoke/TimeToLive and KeepAlive (a bidirectional stream kept open), Watch (a
 * bidirectional stream). Several endpoints (a failed call moves to the next one), optional TLS and
 * user/password auth (etcd's Auth.Authenticate token sent as metadata "token" on every call).
 * What it is not: a full etcd client (no sorting, no elections, no member API); no call retries
 * beyond trying each endpoint once: the callers (common/membership.c) own backoff.
 * Docs: docs/etcd.md. Test: ctest -R test_etcd (starts a real etcd).
 */
#ifndef KC_ETCD_H
#define KC_ETCD_H

#include "rpc.h"

#include <stddef.h>
#include <stdint.h>

typedef struct kc_etcd kc_etcd;

typedef struct kc_etcd_config {
    /* "127.0.0.1:2379,127.0.0.1:22379"; each may carry an http:// or https:// prefix (https://
     * alone does not enable TLS: ca_file does). Required. */
    const char *endpoints;
    /* TLS: PEM files. ca_file set = TLS on every endpoint; cert_file + key_file = client cert. */
    const char *ca_file;
    const char *cert_file;
    const char *key_file;
    /* Auth: both set = Auth.Authenticate at the first call and whenever etcd says the token is
     * invalid; the token travels as metadata "token". */
    const char *user;
    const char *password;
    int64_t timeout_ms; /* per unary call; 0 = 5000 */
} kc_etcd_config;

/* Parses the endpoints, reads the TLS files and makes one (lazily connecting) channel per
 * endpoint. No network traffic. Returns 0, or -1 with `st` (INVALID_ARGUMENT naming the bad
 * endpoint or unreadable file). */
int kc_etcd_create(const kc_etcd_config *cfg, kc_etcd **out, kc_status *st);
/* Only after every stream made from it was closed. NULL is fine. */
void kc_etcd_destroy(kc_etcd *c);
/* Waits up to `timeout_ms` for a connection to an endpoint (the current one first; each gets a
 * share of the time): 1 when one is ready (it becomes the current one), 0 otherwise. Retry loops
 * wait here instead of sleeping, so that a restarted etcd is found at once (see rpc.h,
 * kc_channel_wait_connected). */
int kc_etcd_wait_ready(kc_etcd *c, int64_t timeout_ms);
/* The endpoint the client currently uses ("127.0.0.1:2379"). */
const char *kc_etcd_endpoint(const kc_etcd *c);

/* One key-value (mvccpb.KeyValue). key and value are NUL-terminated copies (value may hold NULs:
 * use value_len). */
typedef struct kc_etcd_kv {
    char *key;
    size_t key_len;
    char *value;
    size_t value_len;
    int64_t create_revision;
    int64_t mod_revision;
    int64_t version;
    int64_t lease;
} kc_etcd_kv;

typedef struct kc_etcd_range_result {
    kc_etcd_kv *kvs;
    size_t n;
    int64_t revision; /* the store's revision when the range was read */
    int64_t count;    /* keys in the range (n unless limited) */
} kc_etcd_range_result;

/* Every call below: 0 on success, -1 with `st` (the status of the last endpoint tried; details
 * name the endpoint). UNAVAILABLE means no endpoint answered. Thread-safe. */

/* Reads `key` (prefix != 0: every key starting with `key`) at `revision` (0 = latest). Free the
 * result with kc_etcd_range_free. */
int kc_etcd_range(kc_etcd *c, const char *key, int prefix, int64_t revision,
                  kc_etcd_range_result *out, kc_status *st);
void kc_etcd_range_free(kc_etcd_range_result *r);
/* Puts key = value[0..len) under `lease` (0 = none). *revision (may be NULL) = the put's
 * revision. A put with a lease etcd no longer has fails NOT_FOUND. */
int kc_etcd_put(kc_etcd *c, const char *key, const void *value, size_t len, int64_t lease,
                int64_t *revision, kc_status *st);
/* Deletes `key` (prefix != 0: every key under it). *deleted (may be NULL) = how many. */
int kc_etcd_delete(kc_etcd *c, const char *key, int prefix, int64_t *deleted, kc_status *st);
/* Txn: if `key` does not exist (create_revision == 0) put it; *created = 1 then, else 0 (and the
 * key keeps its value). *revision (may be NULL) = the store's revision after the txn. */
int kc_etcd_create_if_absent(kc_etcd *c, const char *key, const void *value, size_t len,
                             int64_t lease, int *created, int64_t *revision, kc_status *st);

/* A lease of `ttl_s` seconds; *id = its id, *granted_ttl (may be NULL) = what etcd granted. */
int kc_etcd_lease_grant(kc_etcd *c, int64_t ttl_s, int64_t *id, int64_t *granted_ttl,
                        kc_status *st);
/* Revokes (deleting its keys at once) with a deadline of `timeout_ms` (0 = the config's). An
 * unknown lease gives NOT_FOUND. */
int kc_etcd_lease_revoke(kc_etcd *c, int64_t id, int64_t timeout_ms, kc_status *st);
/* *ttl = seconds left, -1 when the lease expired or never existed. */
int kc_etcd_lease_ttl(kc_etcd *c, int64_t id, int64_t *ttl, kc_status *st);
/* One keep-alive for `id` on the client's LeaseKeepAlive stream (opened at the first use, kept
 * open, re-opened after an error; only one thread may use it at a time). *ttl = the TTL etcd
 * renewed to; 0 when the lease is gone (an OK answer: re-grant). Waits at most the call timeout. */
int kc_etcd_keepalive(kc_etcd *c, int64_t id, int64_t *ttl, kc_status *st);

/* ------------------------------------------------------------------ watch */

typedef enum kc_etcd_event_type {
    KC_ETCD_EVENT_PUT = 0,
    KC_ETCD_EVENT_DELETE = 1,
} kc_etcd_event_type;

typedef struct kc_etcd_event {
    kc_etcd_event_type type;
    kc_etcd_kv kv;      /* for a delete: the key and the delete's mod_revision, no value */
    int has_prev;
    kc_etcd_kv prev_kv; /* when the watch asked for prev_kv and etcd had it */
} kc_etcd_event;

typedef struct kc_etcd_watch_batch {
    kc_etcd_event *events;
    size_t n;
    int64_t revision;         /* header revision */
    int64_t compact_revision; /* > 0: start_revision was compacted; re-list (the watch ended) */
} kc_etcd_watch_batch;

typedef struct kc_etcd_watch kc_etcd_watch;

/* Opens a Watch stream on `key` (prefix != 0: the whole prefix) from `start_revision` (0 = now),
 * with prev_kv when asked, and waits for etcd's "created" answer. Returns 0 with *out, or -1. */
int kc_etcd_watch_open(kc_etcd *c, const char *key, int prefix, int64_t start_revision,
                       int prev_kv, kc_etcd_watch **out, kc_status *st);
/* Blocks for the next batch of events: 1 with *out (free with kc_etcd_watch_batch_free; n may be
 * 0 with compact_revision > 0), -1 when the watch ended (`st`: UNAVAILABLE when etcd died,
 * CANCELLED after kc_etcd_watch_cancel, ...). One thread reads it. */
int kc_etcd_watch_next(kc_etcd_watch *w, kc_etcd_watch_batch *out, kc_status *st);
void kc_etcd_watch_batch_free(kc_etcd_watch_batch *b);
/* Makes a blocked kc_etcd_watch_next return -1 (CANCELLED). Any thread; idempotent. */
void kc_etcd_watch_cancel(kc_etcd_watch *w);
/* NULL is fine. */
void kc_etcd_watch_close(kc_etcd_watch *w);

void kc_etcd_kv_free(kc_etcd_kv *kv);

/* ------------------------------------------------------------------ process flags
 * The etcd connection flags every process takes, parsed in one place:
 *   --etcd ENDPOINTS, --etcd-ca FILE, --etcd-cert FILE, --etcd-key FILE, --etcd-user NAME,
 * the password from the environment variable KVRELAY_ETCD_PASSWORD (a flag would show in ps).
 * Their flag-table entries and help: KC_FLAGS_ETCD (flags.h). */
/* 1 when `flag` is one of those flags (its value `v` stored in *c), 0 otherwise. */
int kc_etcd_flag(kc_etcd_config *c, const char *flag, const char *v);
/* After parsing: TLS/auth flags without --etcd are an error; the password is read from the
 * environment; with --etcd, the configuration is checked (files readable, endpoints well formed)
 * by creating a client once. Returns 0, or -1 with a message in err (256 bytes). */
int kc_etcd_flags_finish(kc_etcd_config *c, char *err);

#endif /* KC_ETCD_H */
