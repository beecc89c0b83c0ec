/*
 * test_router_policy.c - the router's policy-file rule (router/policy.c, rt_policy_resolve): a
 * client names a heads pattern or hsft windows file by its bare name in --policy-dir and the
 * nodes get DIR/name; without a policy dir, paths, "..", hidden or missing files, it is refused;
 * other keys pass through unchanged. No network. Run: ctest -R test_router_policy.
 */
#include "kr_test.h"

#include <unistd.h>

#include "../../router/policy.c"

int main(void)
{
    char dir[] = "/tmp/kr-policy-XXXXXX";
    REQUIRE(mkdtemp(dir) != NULL, "mkdtemp");
    char path[256];
    snprintf(path, sizeof path, "%s/duo.tsv", dir);
    FILE *f = fopen(path, "w");
    REQUIRE(f != NULL, "create %s", path);
    fputs("1\t0\n", f);
    fclose(f);

    char out[1024], err[256], want[1024];
    /* specs without file keys pass unchanged, with or without a policy dir */
    const char *plain[] = {"", "full", "streaming:sink=4,window=16", "snapkv:budget=24,obs=8,decode=window:8"};
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++) {
        CHECK(rt_policy_resolve(plain[i], NULL, out, sizeof out, err, sizeof err) == 0 && !strcmp(out, plain[i]),
              "'%s' -> '%s' (%s)", plain[i], out, err);
        CHECK(rt_policy_resolve(plain[i], dir, out, sizeof out, err, sizeof err) == 0 && !strcmp(out, plain[i]),
              "'%s' with a dir -> '%s'", plain[i], out);
    }
    /* a bare name in the dir resolves, wherever the key stands */
    snprintf(want, sizeof want, "heads:sink=4,pattern=%s,window=8", path);
    CHECK(rt_policy_resolve("heads:sink=4,pattern=duo.tsv,window=8", dir, out, sizeof out, err, sizeof err) == 0 &&
              !strcmp(out, want), "resolved to '%s' (%s)", out, err);
    snprintf(want, sizeof want, "hsft:windows=%s,pattern=%s", path, path);
    CHECK(rt_policy_resolve("hsft:windows=duo.tsv,pattern=duo.tsv", dir, out, sizeof out, err, sizeof err) == 0 &&
              !strcmp(out, want), "resolved to '%s' (%s)", out, err);
    /* refusals */
    CHECK(rt_policy_resolve("heads:pattern=duo.tsv", NULL, out, sizeof out, err, sizeof err) != 0, "no dir accepted");
    CHECK_ERR_HAS(err, "--policy-dir");
    const char *bad[] = {"heads:pattern=/etc/passwd", "heads:pattern=../duo.tsv", "heads:pattern=.hidden",
                         "heads:pattern=", "heads:pattern=sub/duo.tsv", "heads:pattern=missing.tsv"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        CHECK(rt_policy_resolve(bad[i], dir, out, sizeof out, err, sizeof err) != 0, "'%s' accepted as '%s'", bad[i], out);
        CHECK(strstr(err, "policy:") != NULL, "'%s': message '%s'", bad[i], err);
    }
    char longspec[1200];
    memset(longspec, 'a', sizeof longspec - 1);
    longspec[sizeof longspec - 1] = 0;
    CHECK(rt_policy_resolve(longspec, dir, out, sizeof out, err, sizeof err) != 0, "an over-long spec accepted");
    unlink(path);
    rmdir(dir);
    return kt_done("test_router_policy");
}
