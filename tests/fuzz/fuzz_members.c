/*
 * fuzz_members.c - kc_members_file_parse (common/membership.h, the router's --nodes file) on
 * arbitrary bytes (not NUL-terminated): it must refuse them with a message that starts with the
 * file's name and leaves the outputs alone, or return what the header promises: 1..256 members
 * per role, the prefill ones first; ids of 1-63 characters of [A-Za-z0-9._-], unique across both
 * roles; state "serving"; a grpc address that kc_hostport_parse accepts (no port 0, no empty
 * host), unique too; every field the file cannot give empty or 0.
 * Run: ctest -R fuzz_members (replay of tests/fuzz/corpus/members/ + mutations), or with
 * -DKR_FUZZ=ON: ./fuzz_members tests/fuzz/corpus/members.
 */
#include "flags.h"
#include "membership.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 1 when the fixed-size field holds a NUL-terminated string */
#define TERMINATED(f) (memchr((f), 0, sizeof(f)) != NULL)

static void check_member(const kc_member *m, const char *role)
{
    if (!TERMINATED(m->id) || !TERMINATED(m->role) || !TERMINATED(m->state) || !TERMINATED(m->grpc) ||
        !TERMINATED(m->transfer) || !TERMINATED(m->fingerprint) || !TERMINATED(m->version))
        __builtin_trap();
    if (!kc_name_ok(m->id, 63)) __builtin_trap();
    if (strcmp(m->role, role) != 0 || strcmp(m->state, "serving") != 0) __builtin_trap();
    kc_hostport hp;
    char why[256];
    if (strlen(m->grpc) > 255 || kc_hostport_parse(NULL, m->grpc, 0, &hp, why, sizeof why) != 0) __builtin_trap();
    if (hp.port < 1 || hp.port > 65535 || !hp.host[0]) __builtin_trap();
    if (m->transfer[0] || m->fingerprint[0] || m->version[0] || m->kv_capacity || m->start_unix_ms) __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[KC_MEMBER_ERR_LEN];
    memset(err, 0x55, sizeof err);
    kc_member *ms = (kc_member *)&err; /* sentinels: a refusal must not touch them */
    int n = -7;
    if (kc_members_file_parse((const char *)data, size, "fuzz.json", &ms, &n, err) != 0) {
        if (ms != (kc_member *)&err || n != -7) __builtin_trap();
        if (!memchr(err, 0, sizeof err) || strncmp(err, "fuzz.json: ", 11) != 0 || !err[11]) __builtin_trap();
        return 0;
    }
    if (!ms || n < 2 || n > 2 * KC_MEMBERS_FILE_MAX) __builtin_trap();
    int n_prefill = 0;
    while (n_prefill < n && !strcmp(ms[n_prefill].role, "prefill")) n_prefill++;
    int n_decode = n - n_prefill;
    if (n_prefill < 1 || n_prefill > KC_MEMBERS_FILE_MAX || n_decode < 1 || n_decode > KC_MEMBERS_FILE_MAX)
        __builtin_trap();
    for (int i = 0; i < n; i++) check_member(&ms[i], i < n_prefill ? "prefill" : "decode");
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++)
            if (!strcmp(ms[a].id, ms[b].id) || !strcmp(ms[a].grpc, ms[b].grpc)) __builtin_trap();
    free(ms);
    return 0;
}
