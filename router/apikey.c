/*
 * apikey.c - the router's API keys (apikey.h): loading them from flags, files and the
 * environment with errors that name the source but never the key, the constant-time check of an
 * authorization value, and the kc_server hook that applies it to the gRPC API.
 * Not here: the HTTP API's use of the same check (it calls rt_apikeys_check_authorization).
 * Test: ctest -R test_router_apikey (the pure parts); tests/integration/api_keys.sh (the router).
 */
#include "apikey.h"
#include "log.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* One key, zero-padded to the full width so that every comparison reads the same bytes. */
typedef struct rt_key {
    unsigned char bytes[RT_APIKEY_MAX_LEN];
    size_t len; /* 1..RT_APIKEY_MAX_LEN */
    rt_limit_conf limits; /* its own, from its file line; negative fields: the flags' */
} rt_key;

struct rt_apikeys {
    rt_key *keys; /* [n] */
    int n, cap;
    int n_flag, n_file, n_env; /* how many came from each source, for the log */
};

/* Checks one key's syntax; on a fault writes why (without the key) and returns -1. */
static int key_valid(const char *s, size_t len, char *why, size_t cap)
{
    if (len == 0) {
        snprintf(why, cap, "the key is empty");
        return -1;
    }
    if (len > RT_APIKEY_MAX_LEN) {
        snprintf(why, cap, "the key is %zu bytes, more than %d", len, RT_APIKEY_MAX_LEN);
        return -1;
    }
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c <= ' ' || c > '~') {
            snprintf(why, cap, "byte %zu of the key is %s (a key is 1-%d bytes of printable ASCII without spaces)",
                     i + 1, c == ' ' ? "a space" : "not printable ASCII", RT_APIKEY_MAX_LEN);
            return -1;
        }
    }
    return 0;
}

static int keys_add(rt_apikeys *k, const char *s, size_t len)
{
    if (k->n == k->cap) {
        int cap = k->cap ? 2 * k->cap : 4;
        rt_key *grown = calloc((size_t)cap, sizeof *grown);
        if (!grown) return -1;
        if (k->n) memcpy(grown, k->keys, (size_t)k->n * sizeof *grown);
        if (k->keys) explicit_bzero(k->keys, (size_t)k->cap * sizeof *k->keys);
        free(k->keys);
        k->keys = grown;
        k->cap = cap;
    }
    rt_key *key = &k->keys[k->n++];
    memset(key->bytes, 0, sizeof key->bytes);
    memcpy(key->bytes, s, len);
    key->len = len;
    key->limits = (rt_limit_conf){-1, -1, -1};
    return 0;
}

/* One --api-key-file: adds its keys; -1 with err naming the file (and line). */
static int load_file(rt_apikeys *k, const char *path, char *err, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, cap, "--api-key-file %s: cannot read it: %s", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t got;
    int lineno = 0, added = 0, rc = 0;
    while ((got = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        size_t len = (size_t)got;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ' ||
                           line[len - 1] == '\t'))
            len--;
        if (len == 0 || line[0] == '#') continue;
        /* the key ends at the first blank; a line that starts blank is refused as a key */
        size_t klen = line[0] == ' ' || line[0] == '\t' ? len : strcspn(line, " \t");
        if (klen > len) klen = len;
        char why[200];
        if (key_valid(line, klen, why, sizeof why) != 0) {
            snprintf(err, cap, "--api-key-file %s line %d: %s", path, lineno, why);
            rc = -1;
            break;
        }
        if (keys_add(k, line, klen) != 0) {
            snprintf(err, cap, "--api-key-file %s: out of memory", path);
            rc = -1;
            break;
        }
        added++;
        int word = 0;
        for (size_t at = klen; at < len;) { /* the key's own limits: name=value words */
            at += strspn(line + at, " \t");
            size_t olen = strcspn(line + at, " \t");
            if (olen > len - at) olen = len - at;
            word++;
            if (olen && rt_limit_option(&k->keys[k->n - 1].limits, line + at, olen, why, sizeof why) != 0) {
                snprintf(err, cap, "--api-key-file %s line %d, word %d after the key: %s", path, lineno, word, why);
                rc = -1;
                break;
            }
            at += olen;
        }
        if (rc != 0) break;
    }
    if (rc == 0 && ferror(f)) {
        snprintf(err, cap, "--api-key-file %s: cannot read it: %s", path, strerror(errno));
        rc = -1;
    }
    if (rc == 0 && added == 0) {
        snprintf(err, cap, "--api-key-file %s: no key in it (only blank lines and '#' comments)", path);
        rc = -1;
    }
    if (line) explicit_bzero(line, line_cap);
    free(line);
    fclose(f);
    if (rc == 0) k->n_file += added;
    return rc;
}

int rt_apikeys_load(const char *const *flags, int n_flags, const char *const *files, int n_files,
                    const char *env, rt_apikeys **out, char *err, size_t cap)
{
    rt_apikeys *k = calloc(1, sizeof *k);
    if (!k) {
        snprintf(err, cap, "API keys: out of memory");
        return -1;
    }
    char why[160];
    for (int i = 0; i < n_flags; i++) {
        if (key_valid(flags[i], strlen(flags[i]), why, sizeof why) != 0) {
            snprintf(err, cap, "--api-key (occurrence %d): %s", i + 1, why);
            goto err_free;
        }
        if (keys_add(k, flags[i], strlen(flags[i])) != 0) {
            snprintf(err, cap, "--api-key: out of memory");
            goto err_free;
        }
        k->n_flag++;
    }
    for (int i = 0; i < n_files; i++)
        if (load_file(k, files[i], err, cap) != 0) goto err_free;
    if (env && env[0]) {
        if (key_valid(env, strlen(env), why, sizeof why) != 0) {
            snprintf(err, cap, "KVRELAY_API_KEY (environment): %s", why);
            goto err_free;
        }
        if (keys_add(k, env, strlen(env)) != 0) {
            snprintf(err, cap, "KVRELAY_API_KEY: out of memory");
            goto err_free;
        }
        k->n_env++;
    }
    if (k->n == 0) { /* no source gave a key: the API is open */
        rt_apikeys_free(k);
        k = NULL;
    }
    *out = k;
    return 0;

err_free:
    rt_apikeys_free(k);
    return -1;
}

void rt_apikeys_free(rt_apikeys *k)
{
    if (!k) return;
    if (k->keys) explicit_bzero(k->keys, (size_t)k->cap * sizeof *k->keys);
    free(k->keys);
    free(k);
}

int rt_apikeys_count(const rt_apikeys *k)
{
    return k ? k->n : 0;
}

void rt_apikeys_describe(const rt_apikeys *k, char *out, size_t cap)
{
    if (!k) {
        snprintf(out, cap, "none");
        return;
    }
    const struct {
        int n;
        const char *name;
    } src[] = {{k->n_flag, "--api-key"}, {k->n_file, "--api-key-file"}, {k->n_env, "KVRELAY_API_KEY"}};
    size_t used = (size_t)snprintf(out, cap, "%d (", k->n);
    const char *sep = "";
    for (size_t i = 0; i < sizeof src / sizeof src[0] && used < cap; i++) {
        if (!src[i].n) continue;
        used += (size_t)snprintf(out + used, cap - used, "%s%d from %s", sep, src[i].n, src[i].name);
        sep = ", ";
    }
    if (used < cap) snprintf(out + used, cap - used, ")");
}

/* ------------------------------------------------------------------ checking */

/* The index of the first key that `tok` equals, or -1. Every key is compared over all
 * RT_APIKEY_MAX_LEN bytes with the differences OR-ed together, lengths included, and the index
 * picked by masks without a branch: the time depends on the number of keys only (and on tlen
 * through the one copy of the client's own bytes), not on how much of any key the candidate got
 * right. */
static int match_index(const rt_apikeys *k, const char *tok, size_t tlen)
{
    if (tlen > RT_APIKEY_MAX_LEN) return -1; /* longer than any key can be: says nothing about them */
    unsigned char cand[RT_APIKEY_MAX_LEN];
    memset(cand, 0, sizeof cand);
    memcpy(cand, tok, tlen);
    unsigned found = 0, index = 0;
    for (int i = 0; i < k->n; i++) {
        const rt_key *key = &k->keys[i];
        unsigned d = (unsigned)(key->len ^ tlen);
        for (size_t j = 0; j < RT_APIKEY_MAX_LEN; j++) d |= (unsigned)(key->bytes[j] ^ cand[j]);
        /* (d | -d) has its top bit set exactly when d != 0 */
        unsigned hit = 1u ^ ((d | (0u - d)) >> (sizeof d * 8 - 1));
        unsigned take = 0u - (hit & (found ^ 1u)); /* all ones for the first hit only */
        index = (index & ~take) | ((unsigned)i & take);
        found |= hit;
    }
    explicit_bzero(cand, sizeof cand);
    return found ? (int)index : -1;
}

static int is_space(char c)
{
    return c == ' ' || c == '\t';
}

/* Splits "Bearer KEY" into the key candidate *tok (*tlen bytes); RT_APIKEY_WHY_OK, or why not. */
static rt_apikey_why bearer_token(const char *value, size_t len, const char **tok_out, size_t *tlen_out)
{
    if (!value) return RT_APIKEY_WHY_MISSING;
    while (len > 0 && is_space(value[0])) {
        value++;
        len--;
    }
    while (len > 0 && is_space(value[len - 1])) len--;
    if (len == 0) return RT_APIKEY_WHY_MISSING;
    static const char scheme[] = "Bearer";
    size_t sl = sizeof scheme - 1;
    if (len <= sl || strncasecmp(value, scheme, sl) != 0 || !is_space(value[sl]))
        return RT_APIKEY_WHY_MALFORMED;
    const char *tok = value + sl;
    size_t tlen = len - sl;
    while (tlen > 0 && is_space(tok[0])) {
        tok++;
        tlen--;
    }
    if (tlen == 0) return RT_APIKEY_WHY_MALFORMED;
    *tok_out = tok;
    *tlen_out = tlen;
    return RT_APIKEY_WHY_OK;
}

rt_apikey_why rt_apikeys_why(const rt_apikeys *k, const char *value, size_t len)
{
    if (!k) return RT_APIKEY_WHY_OK;
    const char *tok;
    size_t tlen;
    rt_apikey_why why = bearer_token(value, len, &tok, &tlen);
    if (why != RT_APIKEY_WHY_OK) return why;
    return match_index(k, tok, tlen) >= 0 ? RT_APIKEY_WHY_OK : RT_APIKEY_WHY_INVALID;
}

int rt_apikeys_find(const rt_apikeys *k, const char *value, size_t len)
{
    const char *tok;
    size_t tlen;
    if (!k || bearer_token(value, len, &tok, &tlen) != RT_APIKEY_WHY_OK) return -1;
    return match_index(k, tok, tlen);
}

const rt_limit_conf *rt_apikeys_limits(const rt_apikeys *k, int index)
{
    return k && index >= 0 && index < k->n ? &k->keys[index].limits : NULL;
}

int rt_apikeys_check_authorization(const rt_apikeys *k, const char *value, size_t len)
{
    return rt_apikeys_why(k, value, len) == RT_APIKEY_WHY_OK;
}

const char *rt_apikey_why_message(rt_apikey_why why, int http)
{
    switch (why) {
    case RT_APIKEY_WHY_OK: return "";
    case RT_APIKEY_WHY_MISSING:
        return http ? "missing API key: send header 'Authorization: Bearer KEY'"
                    : "missing API key: send metadata 'authorization: Bearer KEY'";
    case RT_APIKEY_WHY_MALFORMED: return "malformed authorization: expected 'Bearer KEY'";
    case RT_APIKEY_WHY_INVALID: return "invalid API key";
    }
    return "invalid API key";
}

/* ------------------------------------------------------------------ the gRPC hook */

int rt_apikeys_grpc_auth(void *user, const kc_call *call, char *details, size_t cap)
{
    const rt_apikeys_grpc *g = user;
    const char *method = kc_call_method(call);
    if (strncmp(method, "/grpc.health.v1.", 16) == 0) return GRPC_STATUS_OK; /* probes stay open */
    size_t len = 0;
    const char *value = kc_call_metadata(call, "authorization", &len);
    rt_apikey_why why = rt_apikeys_why(g->keys, value, len);
    if (why == RT_APIKEY_WHY_OK) return GRPC_STATUS_OK;
    snprintf(details, cap, "%s", rt_apikey_why_message(why, 0));
    if (g->generate_refused && strcmp(method, "/kvrelay.v1.Generation/Generate") == 0)
        kc_counter_inc(g->generate_refused, 1);
    kc_warn(NULL, "%s: UNAUTHENTICATED: %s", method, details);
    return GRPC_STATUS_UNAUTHENTICATED;
}
