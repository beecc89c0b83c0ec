/* policy.c - file-valued keys of client policy specs (router.h: rt_policy_resolve). */
#include "router.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* Keys whose value is a file path (docs/policies.md: heads and hsft). */
static int file_key(const char *key, size_t len)
{
    return (len == 7 && !memcmp(key, "pattern", 7)) || (len == 7 && !memcmp(key, "windows", 7));
}

/* A bare file name: letters, digits, '.', '_', '-', not starting with '.' (no '/', no "..") */
static int bare_name(const char *v, size_t len)
{
    if (len == 0 || v[0] == '.') return 0;
    for (size_t i = 0; i < len; i++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-", v[i]) || !v[i])
            return 0;
    return 1;
}

int rt_policy_resolve(const char *spec, const char *policy_dir, char *out, size_t cap, char *err, size_t err_cap)
{
    size_t n = 0;
    const char *colon = strchr(spec, ':');
    size_t head = colon ? (size_t)(colon - spec) + 1 : strlen(spec);
    if (head >= cap) goto too_long;
    memcpy(out, spec, head);
    n = head;
    const char *p = colon ? colon + 1 : spec + head;
    while (*p) {
        const char *end = strchr(p, ','), *eq = strchr(p, '=');
        size_t item = end ? (size_t)(end - p) : strlen(p);
        if (eq && eq < p + item && file_key(p, (size_t)(eq - p))) {
            const char *v = eq + 1;
            size_t vlen = item - (size_t)(v - p), klen = (size_t)(v - p);
            if (!policy_dir) {
                snprintf(err, err_cap, "policy: '%.*s' names a file, and this router serves no policy files "
                         "(an operator starts it with --policy-dir DIR)", (int)item, p);
                return -1;
            }
            if (!bare_name(v, vlen)) {
                snprintf(err, err_cap, "policy: '%.*s': a policy file is named by its bare name in the router's "
                         "--policy-dir (letters, digits, '.', '_', '-'; no '/')", (int)item, p);
                return -1;
            }
            char path[1024];
            int w = snprintf(path, sizeof path, "%s/%.*s", policy_dir, (int)vlen, v);
            struct stat sb;
            if (w < 0 || (size_t)w >= sizeof path || stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) {
                snprintf(err, err_cap, "policy: '%.*s': no such policy file in --policy-dir", (int)item, p);
                return -1;
            }
            if (n + klen + (size_t)w + 1 >= cap) goto too_long;
            memcpy(out + n, p, klen);
            memcpy(out + n + klen, path, (size_t)w);
            n += klen + (size_t)w;
        } else {
            if (n + item + 1 >= cap) goto too_long;
            memcpy(out + n, p, item);
            n += item;
        }
        p += item;
        if (*p == ',') {
            out[n++] = ',';
            p++;
        }
    }
    out[n] = 0;
    return 0;
too_long:
    snprintf(err, err_cap, "policy: the spec is longer than %zu bytes", cap - 1);
    return -1;
}
