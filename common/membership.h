/*
 * membership.h - cluster membership: who the prefill and decode nodes are, from either of its two
 * sources, both giving the router the same kc_member list:
 *   - etcd: a node registers itself under a lease and keeps it alive from a background thread
 *     (re-registering when the lease was lost or etcd came back); the router watches the nodes
 *     prefix and is told the whole current set after every change. Key:
 *     /kvrelay/<cluster>/nodes/<role>/<id>; value: JSON of kc_member's fields.
 *   - the router's static --nodes file (kc_members_file_load), read once at start-up.
 * What it is not: placement or health checking (a live lease says the process keeps etcd
 * informed, not that it answers calls); the router's live view of a node is rt_node
 * (router/router.h). Docs: docs/etcd.md, docs/router.md. Tests: ctest -R test_membership.
 */
#ifndef KC_MEMBERSHIP_H
#define KC_MEMBERSHIP_H

#include "etcd.h"

#include <stddef.h>
#include <stdint.h>

#define KC_MEMBER_ERR_LEN 512 /* size of the `err` buffers below (a file's messages name its path) */

/* One member of the cluster as a membership source gives it. The static file gives id, role,
 * state "serving" and grpc only; the other fields are then empty or 0. */
typedef struct kc_member {
    char id[128];
    char role[16];  /* "prefill" | "decode" */
    char state[16]; /* "serving" | "draining" */
    char grpc[256];  /* HOST:PORT of its gRPC server */
    char transfer[256];  /* a decode node's UCX listener ("" for prefill) */
    char fingerprint[17];  /* its model's (docs/failures.md); "" when it did not say */
    uint64_t kv_capacity;
    char version[32];
    int64_t start_unix_ms;
} kc_member;

/* "/kvrelay/<cluster>/nodes/" and "/kvrelay/<cluster>/nodes/<role>/<id>" into buf. Returns 0, or -1
 * when it does not fit. */
int kc_member_prefix(const char *cluster, char *buf, size_t size);
int kc_member_key(const char *cluster, const kc_member *m, char *buf, size_t size);
/* JSON of every field (malloc'd, caller frees). NULL when out of memory. */
char *kc_member_to_json(const kc_member *m);
/* Parses and validates (id non-empty, role prefill|decode, state serving|draining, grpc non-empty;
 * every string fits its field). Unknown fields are ignored; a missing required field (id, role,
 * state, grpc) is an error. Returns 0, or -1 with `err` naming the field. */
int kc_member_from_json(const char *json, size_t len, kc_member *out, char *err);

/* ------------------------------------------------------------------ node side */

typedef struct kc_registration kc_registration;

/* Starts a background thread that grants a lease of `ttl_s` seconds (>= 2), puts the member's key
 * under it, keeps it alive every ttl/3, and, whenever the lease was lost (keep-alive answers TTL
 * 0) or etcd failed, retries with backoff and registers again under a new lease. Logs each
 * transition. Returns 0 at once (the first registration happens in the background; etcd may be
 * down), or -1 with `err` for bad arguments (endpoints, cluster, member). */
int kc_register_start(const char *endpoints, const char *cluster, const kc_member *m, int ttl_s,
                      kc_registration **out, char *err);
/* The same with TLS/auth (cfg->endpoints required). */
int kc_register_start_cfg(const kc_etcd_config *cfg, const char *cluster, const kc_member *m,
                          int ttl_s, kc_registration **out, char *err);
/* Replaces the member (same role and id; e.g. state -> "draining") and puts it under the current
 * lease now (or at the next registration when etcd is down). Returns 0, or -1 when the member is
 * invalid or changes role/id, or the put failed (it is retried by the thread). */
int kc_register_update(kc_registration *r, const kc_member *m);
/* 1 while the key is believed to be in etcd under a live lease. */
int kc_register_live(kc_registration *r);
/* Stops the thread (waiting for at most the etcd call it is in, 2 s by default), revokes the
 * lease (1 s deadline; the key disappears at once) and frees. Not concurrently with
 * kc_register_update on the same registration. NULL is fine. */
void kc_register_stop(kc_registration *r);
/* Tests only: stops the thread and frees WITHOUT revoking, as a killed process would; the key
 * disappears when the lease expires. NULL is fine. */
void kc_register_abandon(kc_registration *r);

/* ------------------------------------------------------------------ router side */

/* Called from the watch thread with the whole current set (valid during the call only), after the
 * first list and after every change. Never called concurrently with itself. */
typedef void (*kc_members_fn)(void *user, const kc_member *members, int n);

typedef struct kc_watch kc_watch;

/* Starts a background thread: list the prefix, call fn with the set, watch from the list's
 * revision + 1, call fn after each change; re-open the watch after an error, re-list after a
 * compaction; while etcd is down keep the last set (no call) and retry with backoff. Values that
 * are not valid member JSON are logged and left out. Returns 0 at once, or -1 with `err` for bad
 * arguments. */
int kc_watch_start(const char *endpoints, const char *cluster, kc_members_fn fn, void *user,
                   kc_watch **out, char *err);
int kc_watch_start_cfg(const kc_etcd_config *cfg, const char *cluster, kc_members_fn fn,
                       void *user, kc_watch **out, char *err);
/* Stops the thread (within about a second; fn is not called after it returns) and frees. NULL is
 * fine. */
void kc_watch_stop(kc_watch *w);

/* ------------------------------------------------------------------ the static file */

/* The router's --nodes file (docs/router.md), the membership source without etcd:
 *   {"prefill": [{"id": "prefill-0", "address": "127.0.0.1:7101"}],
 *    "decode":  [{"id": "decode-0",  "address": "127.0.0.1:7201"}]}
 * Both lists are required and non-empty; ids are unique across both, [A-Za-z0-9._-], at most
 * 63 characters; addresses are HOST:PORT (HOST may be [v6]) and unique; unknown keys are errors
 * (a typo must not silently drop a node). Every error names the file, the entry and the field. */
#define KC_MEMBERS_FILE_MAX 256 /* members per role */

/* Parses the JSON text `json` (`len` bytes; `path` only names it in messages) into members with
 * state "serving" and the address as grpc, the prefill ones first. Returns 0 with *out (malloc'd,
 * caller frees) and *n, or -1 with a message in err (KC_MEMBER_ERR_LEN); outputs set only on
 * success. */
int kc_members_file_parse(const char *json, size_t len, const char *path, kc_member **out, int *n,
                          char *err);
/* Reads the file at `path` (at most 1 MiB) and parses it as above. */
int kc_members_file_load(const char *path, kc_member **out, int *n, char *err);

/* 1 when s is 1..max_len bytes of [A-Za-z0-9._-]: node ids, cluster names, key segments. */
int kc_name_ok(const char *s, size_t max_len);

#endif /* KC_MEMBERSHIP_H */
