/*
 * members.h - the router's static membership file (--nodes FILE, DESIGN.md section 6):
 *   {"prefill": [{"id": "prefill-0", "address": "127.0.0.1:7101"}],
 *    "decode":  [{"id": "decode-0",  "address": "127.0.0.1:7201"}]}
 * Both lists are required and non-empty; ids are unique across both, [A-Za-z0-9._-], at most
 * 63 characters; addresses are HOST:PORT (HOST may be [v6]) and unique; unknown keys are errors
 * (a typo must not silently drop a node). Every error names the file, the entry and the field.
 * Not here: etcd membership (main.c's kc_watch callback feeds rt_nodes_apply directly). Pure: tested by tests/unit/test_router_members.c.
 */
#ifndef RT_MEMBERS_H
#define RT_MEMBERS_H

#include <stddef.h>

#define RT_MEMBERS_ERR_MAX 512
#define RT_MEMBERS_MAX 256 /* per role */

typedef struct rt_member {
    char id[64];
    char address[256];
} rt_member;

typedef struct rt_members {
    rt_member *prefill; /* n_prefill, owned */
    int n_prefill;
    rt_member *decode; /* n_decode, owned */
    int n_decode;
} rt_members;

/* Parses the JSON text `json` (`len` bytes; `path` only names it in messages). Returns 0 with
 * *out filled (free with rt_members_free), or -1 with a message in err (RT_MEMBERS_ERR_MAX). */
int rt_members_parse(const char *json, size_t len, const char *path, rt_members *out, char *err);
/* Reads and parses the file at `path`. */
int rt_members_load(const char *path, rt_members *out, char *err);
void rt_members_free(rt_members *m);

#endif /* RT_MEMBERS_H */
