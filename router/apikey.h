/*
 * apikey.h - the router's API keys: loaded at start-up from --api-key (repeatable),
 * --api-key-file (one key per line) and the environment variable KVRELAY_API_KEY, all adding up;
 * then every request to the public API must carry "Bearer KEY" in its authorization (gRPC call
 * metadata `authorization`, the HTTP Authorization header). Keys are compared in constant time
 * and never logged or echoed. A key in a file may carry its own limits (client-limits.h). Not here:
 * scopes, reloading keys while running,
 * TLS (a key on a plaintext connection can be read on the wire: put the router behind TLS when
 * the network is not trusted). docs/router.md "API keys". Test: ctest -R test_router_apikey.
 */
#ifndef RT_APIKEY_H
#define RT_APIKEY_H

#include "client-limits.h"
#include "metrics.h"
#include "rpc.h"

#include <stddef.h>

#define RT_APIKEY_MAX_LEN 256 /* bytes in one key */

/* The loaded keys; immutable once loaded, so any thread may check against them. */
typedef struct rt_apikeys rt_apikeys;

/* Why an authorization value was refused. */
typedef enum rt_apikey_why {
    RT_APIKEY_WHY_OK,        /* "Bearer <a loaded key>", or no keys are configured */
    RT_APIKEY_WHY_MISSING,   /* no authorization at all */
    RT_APIKEY_WHY_MALFORMED, /* not of the form "Bearer KEY" */
    RT_APIKEY_WHY_INVALID,   /* "Bearer KEY" with a key that is not one of the loaded ones */
} rt_apikey_why;

/* Loads keys from `n_flags` --api-key values, `n_files` --api-key-file paths and `env` (the
 * value of KVRELAY_API_KEY; NULL or "" = unset). A key is 1-RT_APIKEY_MAX_LEN bytes of printable
 * ASCII without spaces. In a file: one key per line, optionally followed (after spaces or tabs)
 * by its own limits, "concurrency=N rate=R[/s|/m] burst=B" (any of them; the --limit-* flags
 * give the rest); blank lines and lines starting with '#' are skipped; trailing whitespace and
 * CR are stripped. Returns 0 with *out (NULL when no source gave
 * a key: the API stays open), or -1 with `err` (`cap` bytes) naming the source, and for a file
 * its line, never the key: a bad key, an unreadable file, a file with no key. The caller frees
 * *out with rt_apikeys_free. */
int rt_apikeys_load(const char *const *flags, int n_flags, const char *const *files, int n_files,
                    const char *env, rt_apikeys **out, char *err, size_t cap);
/* Wipes the keys from memory and frees them. NULL is fine. */
void rt_apikeys_free(rt_apikeys *k);
/* How many keys were loaded (duplicates included); 0 for NULL. */
int rt_apikeys_count(const rt_apikeys *k);
/* For the start-up log line, without the keys: "3 (1 from --api-key, 2 from --api-key-file)",
 * or "none" for NULL. */
void rt_apikeys_describe(const rt_apikeys *k, char *out, size_t cap);

/* 1 when `value` (`len` bytes, not necessarily NUL-terminated; NULL = absent) is "Bearer KEY"
 * ("Bearer" in any case, then spaces or tabs, then a loaded key; trailing spaces ignored) with
 * KEY one of the loaded keys, else 0. A NULL `k` (no keys configured) always gives 1. The time
 * it takes depends on the number of keys and on `len`, never on the contents of any key: every
 * key is compared, over RT_APIKEY_MAX_LEN bytes, with no early exit. Thread-safe. */
int rt_apikeys_check_authorization(const rt_apikeys *k, const char *value, size_t len);
/* The same with the reason for a refusal, for the error the client gets. */
rt_apikey_why rt_apikeys_why(const rt_apikeys *k, const char *value, size_t len);
/* The index (in load order: flags, files, environment) of the first loaded key that `value`
 * carries as "Bearer KEY", or -1; in the same constant time as the check. */
int rt_apikeys_find(const rt_apikeys *k, const char *value, size_t len);
/* Key `index`'s own limits from its file line (fields not given are negative: the flags'
 * apply). Borrowed: valid while k is. */
const rt_limit_conf *rt_apikeys_limits(const rt_apikeys *k, int index);
/* The message for a refusal, for the client (never containing what the client sent):
 * "missing API key: send metadata 'authorization: Bearer KEY'" (`http` 0; the HTTP API says
 * "header 'Authorization: Bearer KEY'" with `http` 1), "malformed authorization: expected
 * 'Bearer KEY'", "invalid API key"; "" for RT_APIKEY_WHY_OK. */
const char *rt_apikey_why_message(rt_apikey_why why, int http);

/* What the gRPC hook needs: the keys, and the counter that a refused Generate adds to. */
typedef struct rt_apikeys_grpc {
    const rt_apikeys *keys;          /* NULL: everything open */
    kc_counter *generate_refused;    /* kvrelay_requests_total{status="UNAUTHENTICATED"}; may be NULL */
} rt_apikeys_grpc;

/* The router's kc_server auth hook (kc_auth_fn): `user` is an rt_apikeys_grpc that outlives the
 * server. grpc.health.v1 is always open (probes); every other method needs a key when keys are
 * configured and is refused UNAUTHENTICATED otherwise, with rt_apikey_why_message's details and
 * one warning line naming the method and the reason (never what the client sent). */
int rt_apikeys_grpc_auth(void *user, const kc_call *call, char *details, size_t cap);

#endif /* RT_APIKEY_H */
