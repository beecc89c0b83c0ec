/*
 * membership-file.c - the router's static membership file (--nodes FILE), read into the same
 * kc_member list the etcd watch gives (membership.h), so the router applies one kind of update
 * whatever the source. Strict on purpose: unknown keys, duplicate ids or addresses and bad
 * addresses are errors naming the file, the entry and the field.
 * Not here: etcd (membership.c), what the router does with the list (router/nodes.c).
 * Pure. Test: ctest -R test_membership_file.
 */
#include "flags.h"
#include "membership.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* a node id in the file: 1..63 bytes of [A-Za-z0-9._-] */
#define ID_OK(s) kc_name_ok((s), 63)

static int fail(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(char *err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, KC_MEMBER_ERR_LEN, fmt, ap);
    va_end(ap);
    return -1;
}

/* HOST:PORT with a non-empty host (a [v6] host in brackets) and a port in 1..65535, at most 255
 * characters (kc_member.grpc); writes why not into `why`. */
static int valid_address(const char *s, char *why, size_t cap)
{
    size_t n = strlen(s);
    if (n == 0 || n > 255) return snprintf(why, cap, "must be HOST:PORT of at most 255 characters"), 0;
    kc_hostport hp;
    return kc_hostport_parse(NULL, s, 0, &hp, why, cap) == 0;
}

/* The list of one role, appended to ms[*n] (room for KC_MEMBERS_FILE_MAX more). */
static int parse_role(const cJSON *arr, const char *role, const char *path, kc_member *ms, int *n,
                      char *err)
{
    if (!arr) return fail(err, "%s: \"%s\" is missing (a list of {\"id\", \"address\"})", path, role);
    if (!cJSON_IsArray(arr)) return fail(err, "%s: \"%s\" must be a list of {\"id\", \"address\"}", path, role);
    int count = cJSON_GetArraySize(arr);
    if (count == 0) return fail(err, "%s: \"%s\" is empty: the router needs at least one %s node", path, role, role);
    if (count > KC_MEMBERS_FILE_MAX)
        return fail(err, "%s: \"%s\" lists %d nodes (at most %d)", path, role, count, KC_MEMBERS_FILE_MAX);
    int i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        if (!cJSON_IsObject(e)) return fail(err, "%s: %s[%d] must be an object {\"id\", \"address\"}", path, role, i);
        for (const cJSON *k = e->child; k; k = k->next)
            if (strcmp(k->string, "id") != 0 && strcmp(k->string, "address") != 0)
                return fail(err, "%s: %s[%d]: unknown key \"%s\" (expected \"id\" and \"address\")", path, role, i,
                            k->string);
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        const cJSON *addr = cJSON_GetObjectItemCaseSensitive(e, "address");
        if (!cJSON_IsString(id))
            return fail(err, "%s: %s[%d].id is %s (expected a string)", path, role, i, id ? "not a string" : "missing");
        if (!ID_OK(id->valuestring))
            return fail(err, "%s: %s[%d].id '%.80s' must be 1-63 characters of A-Z a-z 0-9 . _ -", path, role, i,
                        id->valuestring);
        if (!cJSON_IsString(addr))
            return fail(err, "%s: %s[%d].address is %s (expected \"HOST:PORT\")", path, role, i,
                        addr ? "not a string" : "missing");
        char why[128];
        if (!valid_address(addr->valuestring, why, sizeof why))
            return fail(err, "%s: %s[%d].address '%.80s': %s", path, role, i, addr->valuestring, why);
        kc_member *m = &ms[(*n)++];
        memset(m, 0, sizeof *m);
        snprintf(m->id, sizeof m->id, "%s", id->valuestring);
        snprintf(m->role, sizeof m->role, "%s", role);
        snprintf(m->state, sizeof m->state, "serving"); /* a file cannot say a node drains */
        snprintf(m->grpc, sizeof m->grpc, "%s", addr->valuestring);
    }
    return 0;
}

/* Ids unique across both roles, addresses too. */
static int check_unique(const kc_member *ms, int n, const char *path, char *err)
{
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++) {
            const kc_member *x = &ms[a], *y = &ms[b];
            if (!strcmp(x->id, y->id)) return fail(err, "%s: node id '%s' appears twice", path, x->id);
            if (!strcmp(x->grpc, y->grpc))
                return fail(err, "%s: nodes '%s' and '%s' have the same address %s", path, x->id, y->id, x->grpc);
        }
    return 0;
}

int kc_members_file_parse(const char *json, size_t len, const char *path, kc_member **out, int *n,
                          char *err)
{
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        size_t at = end && end >= json ? (size_t)(end - json) : 0;
        return fail(err, "%s: not valid JSON (error near byte %zu)", path, at);
    }
    kc_member *ms = NULL;
    int n_ms = 0, rc = -1;
    if (!cJSON_IsObject(root)) {
        fail(err, "%s: the top level must be an object {\"prefill\": [...], \"decode\": [...]}", path);
        goto err_root;
    }
    for (const cJSON *k = root->child; k; k = k->next)
        if (strcmp(k->string, "prefill") != 0 && strcmp(k->string, "decode") != 0) {
            fail(err, "%s: unknown key \"%s\" (expected \"prefill\" and \"decode\")", path, k->string);
            goto err_root;
        }
    ms = malloc(2 * KC_MEMBERS_FILE_MAX * sizeof *ms);
    if (!ms) {
        fail(err, "%s: out of memory", path);
        goto err_root;
    }
    if (parse_role(cJSON_GetObjectItemCaseSensitive(root, "prefill"), "prefill", path, ms, &n_ms, err) ||
        parse_role(cJSON_GetObjectItemCaseSensitive(root, "decode"), "decode", path, ms, &n_ms, err) ||
        check_unique(ms, n_ms, path, err)) {
        free(ms);
        goto err_root;
    }
    *out = ms;
    *n = n_ms;
    rc = 0;
err_root:
    cJSON_Delete(root);
    return rc;
}

int kc_members_file_load(const char *path, kc_member **out, int *n, char *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, "%s: cannot open the membership file: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        len += fread(buf + len, 1, cap - len, f);
        if (len < cap || len >= (1u << 20)) break;
        char *grown = realloc(buf, cap * 2);
        if (!grown) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = grown;
        cap *= 2;
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf) return fail(err, "%s: out of memory", path);
    if (bad || len >= (1u << 20)) {
        free(buf);
        return fail(err, "%s: %s", path, bad ? "read error" : "larger than 1 MiB: not a membership file");
    }
    int rc = kc_members_file_parse(buf, len, path, out, n, err);
    free(buf);
    return rc;
}
