/* members.c - the static membership file; see members.h. */
#include "members.h"
#include "flags.h"
#include "membership.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* a node id in the file: 1..63 bytes of [A-Za-z0-9._-] */
#define RT_VALID_ID(s) kc_name_ok((s), 63)

static int fail(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(char *err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, RT_MEMBERS_ERR_MAX, fmt, ap);
    va_end(ap);
    return -1;
}

/* HOST:PORT with a non-empty host (a [v6] host in brackets) and a port in 1..65535, at most 255
 * characters (rt_member.address); writes why not into `why`. */
static int valid_address(const char *s, char *why, size_t cap)
{
    size_t n = strlen(s);
    if (n == 0 || n > 255) return snprintf(why, cap, "must be HOST:PORT of at most 255 characters"), 0;
    kc_hostport hp;
    return kc_hostport_parse(NULL, s, 0, &hp, why, cap) == 0;
}

static int parse_role(const cJSON *arr, const char *role, const char *path, rt_member **out,
                      int *n_out, char *err)
{
    if (!arr) return fail(err, "%s: \"%s\" is missing (a list of {\"id\", \"address\"})", path, role);
    if (!cJSON_IsArray(arr)) return fail(err, "%s: \"%s\" must be a list of {\"id\", \"address\"}", path, role);
    int n = cJSON_GetArraySize(arr);
    if (n == 0) return fail(err, "%s: \"%s\" is empty: the router needs at least one %s node", path, role, role);
    if (n > RT_MEMBERS_MAX) return fail(err, "%s: \"%s\" lists %d nodes (at most %d)", path, role, n, RT_MEMBERS_MAX);
    rt_member *m = calloc((size_t)n, sizeof *m);
    if (!m) return fail(err, "%s: out of memory", path);
    int i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        if (!cJSON_IsObject(e)) {
            fail(err, "%s: %s[%d] must be an object {\"id\", \"address\"}", path, role, i);
            goto err_free;
        }
        for (const cJSON *k = e->child; k; k = k->next)
            if (strcmp(k->string, "id") != 0 && strcmp(k->string, "address") != 0) {
                fail(err, "%s: %s[%d]: unknown key \"%s\" (expected \"id\" and \"address\")", path, role, i, k->string);
                goto err_free;
            }
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        const cJSON *addr = cJSON_GetObjectItemCaseSensitive(e, "address");
        if (!cJSON_IsString(id)) {
            fail(err, "%s: %s[%d].id is %s (expected a string)", path, role, i, id ? "not a string" : "missing");
            goto err_free;
        }
        if (!RT_VALID_ID(id->valuestring)) {
            fail(err, "%s: %s[%d].id '%.80s' must be 1-63 characters of A-Z a-z 0-9 . _ -", path, role, i, id->valuestring);
            goto err_free;
        }
        if (!cJSON_IsString(addr)) {
            fail(err, "%s: %s[%d].address is %s (expected \"HOST:PORT\")", path, role, i, addr ? "not a string" : "missing");
            goto err_free;
        }
        char why[128];
        if (!valid_address(addr->valuestring, why, sizeof why)) {
            fail(err, "%s: %s[%d].address '%.80s': %s", path, role, i, addr->valuestring, why);
            goto err_free;
        }
        snprintf(m[i].id, sizeof m[i].id, "%s", id->valuestring);
        snprintf(m[i].address, sizeof m[i].address, "%s", addr->valuestring);
    }
    *out = m;
    *n_out = n;
    return 0;
err_free:
    free(m);
    return -1;
}

/* Ids unique across both roles, addresses too. */
static int check_unique(const rt_members *ms, const char *path, char *err)
{
    int n = ms->n_prefill + ms->n_decode;
    for (int a = 0; a < n; a++) {
        const rt_member *x = a < ms->n_prefill ? &ms->prefill[a] : &ms->decode[a - ms->n_prefill];
        for (int b = a + 1; b < n; b++) {
            const rt_member *y = b < ms->n_prefill ? &ms->prefill[b] : &ms->decode[b - ms->n_prefill];
            if (!strcmp(x->id, y->id)) return fail(err, "%s: node id '%s' appears twice", path, x->id);
            if (!strcmp(x->address, y->address))
                return fail(err, "%s: nodes '%s' and '%s' have the same address %s", path, x->id, y->id, x->address);
        }
    }
    return 0;
}

int rt_members_parse(const char *json, size_t len, const char *path, rt_members *out, char *err)
{
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        size_t at = end && end >= json ? (size_t)(end - json) : 0;
        return fail(err, "%s: not valid JSON (error near byte %zu)", path, at);
    }
    rt_members ms = {0};
    int rc = -1;
    if (!cJSON_IsObject(root)) {
        fail(err, "%s: the top level must be an object {\"prefill\": [...], \"decode\": [...]}", path);
        goto out;
    }
    for (const cJSON *k = root->child; k; k = k->next)
        if (strcmp(k->string, "prefill") != 0 && strcmp(k->string, "decode") != 0) {
            fail(err, "%s: unknown key \"%s\" (expected \"prefill\" and \"decode\")", path, k->string);
            goto out;
        }
    if (parse_role(cJSON_GetObjectItemCaseSensitive(root, "prefill"), "prefill", path, &ms.prefill, &ms.n_prefill, err) ||
        parse_role(cJSON_GetObjectItemCaseSensitive(root, "decode"), "decode", path, &ms.decode, &ms.n_decode, err) ||
        check_unique(&ms, path, err)) {
        rt_members_free(&ms);
        goto out;
    }
    *out = ms;
    rc = 0;
out:
    cJSON_Delete(root);
    return rc;
}

int rt_members_load(const char *path, rt_members *out, char *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, "%s: cannot open the membership file: %s", path, strerror(errno));
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap || n >= (1u << 20)) break;
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
    if (bad || n >= (1u << 20)) {
        free(buf);
        return fail(err, "%s: %s", path, bad ? "read error" : "larger than 1 MiB: not a membership file");
    }
    int rc = rt_members_parse(buf, n, path, out, err);
    free(buf);
    return rc;
}

void rt_members_free(rt_members *m)
{
    free(m->prefill);
    free(m->decode);
    memset(m, 0, sizeof *m);
}
