/*
 * test_router_apikey.c - the router's API keys (router/apikey.c): loading from --api-key values,
 * key files (comments, blank lines, CR and trailing blanks) and KVRELAY_API_KEY, all adding up;
 * every start-up error names its source (and a file's line) and never contains the key; the
 * authorization check ("Bearer" in any case, each key accepted, wrong keys, prefixes and
 * extensions of a key, other schemes refused with the right reason); no keys = open.
 * Not tested here: timing (the compare has no data-dependent branch by construction), the gRPC
 * hook (tests/integration/api_keys.sh runs it in the router). No network.
 * Run: ctest -R test_router_apikey.
 */
#include "kr_test.h"

#include <unistd.h>

#include "../../router/apikey.c"
#include "../../router/client-limits.c"

static char dir[] = "/tmp/kr_apikey_XXXXXX";

/* Writes `text` to DIR/name; returns its path (a static buffer: the caller copies it). */
static const char *write_file(const char *name, const char *text)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    REQUIRE(f != NULL, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
    return path;
}

static int ok(const rt_apikeys *k, const char *value)
{
    return rt_apikeys_check_authorization(k, value, value ? strlen(value) : 0);
}

static rt_apikey_why why(const rt_apikeys *k, const char *value)
{
    return rt_apikeys_why(k, value, value ? strlen(value) : 0);
}

/* A load that must fail: the error names `needle` and never contains `secret`. */
static void load_fails(const char *const *flags, int n_flags, const char *const *files, int n_files,
                       const char *env, const char *needle, const char *secret)
{
    rt_apikeys *k = (rt_apikeys *)1;
    char err[512] = "";
    CHECK(rt_apikeys_load(flags, n_flags, files, n_files, env, &k, err, sizeof err) == -1,
          "loaded although '%s' was expected", needle);
    CHECK(k == (rt_apikeys *)1, "*out was set on failure");
    CHECK_ERR_HAS(err, needle);
    if (secret) CHECK(strstr(err, secret) == NULL, "the error '%s' shows the key", err);
}

static void test_sources(void)
{
    const char *flags[] = {"flag-key-1", "flag-key-2"};
    char file[512];
    snprintf(file, sizeof file, "%s",
             write_file("keys.txt", "# the team's keys\n\nfile-key-A\r\nfile-key-B \t\n   \n#file-key-C\nfile-key-D"));
    const char *files[] = {file};
    rt_apikeys *k = NULL;
    char err[512];
    REQUIRE(rt_apikeys_load(flags, 2, files, 1, "env-key", &k, err, sizeof err) == 0, "%s", err);
    REQUIRE(k != NULL, "no keys");
    CHECK(rt_apikeys_count(k) == 6, "%d keys", rt_apikeys_count(k));
    char desc[160];
    rt_apikeys_describe(k, desc, sizeof desc);
    CHECK(strcmp(desc, "6 (2 from --api-key, 3 from --api-key-file, 1 from KVRELAY_API_KEY)") == 0, "describe: %s",
          desc);
    CHECK(!strstr(desc, "flag-key") && !strstr(desc, "file-key") && !strstr(desc, "env-key"), "describe shows a key: %s", desc);

    /* every key from every source, "Bearer" in any case, blanks around */
    const char *good[] = {"Bearer flag-key-1", "Bearer flag-key-2", "Bearer file-key-A", "bearer file-key-B",
                          "BEARER file-key-D", "Bearer env-key", "Bearer   env-key  ", " Bearer\tenv-key"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        CHECK(ok(k, good[i]) == 1 && why(k, good[i]) == RT_APIKEY_WHY_OK, "'%s' refused", good[i]);
    /* a value that is not NUL-terminated where it ends (metadata slices are not) */
    const char buf[] = "Bearer env-keyXYZ";
    CHECK(rt_apikeys_check_authorization(k, buf, strlen("Bearer env-key")) == 1, "length not honoured");

    /* refusals and their reasons */
    CHECK(why(k, NULL) == RT_APIKEY_WHY_MISSING, "absent");
    CHECK(why(k, "") == RT_APIKEY_WHY_MISSING, "empty");
    CHECK(why(k, "   ") == RT_APIKEY_WHY_MISSING, "blank");
    const char *malformed[] = {"env-key", "Bearer", "Bearer  ", "Basic ZW52LWtleQ==", "Bearerenv-key", "Token env-key"};
    for (size_t i = 0; i < sizeof malformed / sizeof malformed[0]; i++)
        CHECK(why(k, malformed[i]) == RT_APIKEY_WHY_MALFORMED, "'%s': %d", malformed[i], (int)why(k, malformed[i]));
    const char *invalid[] = {"Bearer env-ke", "Bearer env-key2", "Bearer ENV-KEY", "Bearer file-key-C",
                             "Bearer #file-key-C", "Bearer env-key x", "Bearer flag-key-1flag-key-2"};
    for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
        CHECK(why(k, invalid[i]) == RT_APIKEY_WHY_INVALID, "'%s': %d", invalid[i], (int)why(k, invalid[i]));
        CHECK(ok(k, invalid[i]) == 0, "'%s' accepted", invalid[i]);
    }
    /* longer than any key can be */
    char longv[600] = "Bearer ";
    memset(longv + 7, 'a', 400);
    longv[407] = 0;
    CHECK(why(k, longv) == RT_APIKEY_WHY_INVALID, "a 400-byte key: %d", (int)why(k, longv));

    /* the messages the client gets */
    CHECK(strcmp(rt_apikey_why_message(RT_APIKEY_WHY_MISSING, 0),
                 "missing API key: send metadata 'authorization: Bearer KEY'") == 0, "missing message");
    CHECK_ERR_HAS(rt_apikey_why_message(RT_APIKEY_WHY_MISSING, 1), "header 'Authorization: Bearer KEY'");
    CHECK(strcmp(rt_apikey_why_message(RT_APIKEY_WHY_INVALID, 0), "invalid API key") == 0, "invalid message");
    CHECK(rt_apikey_why_message(RT_APIKEY_WHY_OK, 0)[0] == 0, "OK message");
    rt_apikeys_free(k);

    /* a 256-byte key is fine; two files add up */
    char key256[RT_APIKEY_MAX_LEN + 1];
    memset(key256, 'k', RT_APIKEY_MAX_LEN);
    key256[RT_APIKEY_MAX_LEN] = 0;
    const char *f256[] = {key256};
    char file2[512];
    snprintf(file2, sizeof file2, "%s", write_file("more.txt", "second-file-key\n"));
    const char *two[] = {file, file2};
    REQUIRE(rt_apikeys_load(f256, 1, two, 2, NULL, &k, err, sizeof err) == 0, "%s", err);
    CHECK(rt_apikeys_count(k) == 5, "%d keys", rt_apikeys_count(k));
    char v256[300];
    snprintf(v256, sizeof v256, "Bearer %s", key256);
    CHECK(ok(k, v256) == 1, "the 256-byte key refused");
    v256[strlen(v256) - 1] = 0;
    CHECK(ok(k, v256) == 0, "its 255-byte prefix accepted");
    CHECK(ok(k, "Bearer second-file-key") == 1, "the second file's key");
    CHECK(ok(k, "Bearer env-key") == 0, "no KVRELAY_API_KEY this time");
    rt_apikeys_free(k);
}

static void test_open(void)
{
    rt_apikeys *k = (rt_apikeys *)1;
    char err[256];
    REQUIRE(rt_apikeys_load(NULL, 0, NULL, 0, NULL, &k, err, sizeof err) == 0, "%s", err);
    CHECK(k == NULL, "no source, yet keys");
    REQUIRE(rt_apikeys_load(NULL, 0, NULL, 0, "", &k, err, sizeof err) == 0, "%s", err);
    CHECK(k == NULL, "an empty KVRELAY_API_KEY counts as unset");
    CHECK(rt_apikeys_count(NULL) == 0, "count");
    CHECK(ok(NULL, NULL) == 1 && ok(NULL, "Bearer anything") == 1 && ok(NULL, "junk") == 1, "open");
    char desc[64];
    rt_apikeys_describe(NULL, desc, sizeof desc);
    CHECK(strcmp(desc, "none") == 0, "describe: %s", desc);
    rt_apikeys_free(NULL);
}

static void test_errors(void)
{
    const char *spaced[] = {"good-key", "bad key-secret"};
    load_fails(spaced, 2, NULL, 0, NULL, "--api-key (occurrence 2): byte 4 of the key is a space", "key-secret");
    const char *empty[] = {""};
    load_fails(empty, 1, NULL, 0, NULL, "--api-key (occurrence 1): the key is empty", NULL);
    const char *ctrl[] = {"tab\there-secret"};
    load_fails(ctrl, 1, NULL, 0, NULL, "not printable ASCII", "here-secret");
    char big[RT_APIKEY_MAX_LEN + 2];
    memset(big, 'z', RT_APIKEY_MAX_LEN + 1);
    big[RT_APIKEY_MAX_LEN + 1] = 0;
    const char *toolong[] = {big};
    load_fails(toolong, 1, NULL, 0, NULL, "257 bytes, more than 256", "zzzz");
    const char *utf8[] = {"caf\xc3\xa9-secret"};
    load_fails(utf8, 1, NULL, 0, NULL, "byte 4 of the key is not printable ASCII", "secret");

    load_fails(NULL, 0, NULL, 0, "env secret", "KVRELAY_API_KEY (environment): byte 4", "secret");

    char path[512];
    snprintf(path, sizeof path, "%s", write_file("empty.txt", ""));
    const char *f1[] = {path};
    load_fails(NULL, 0, f1, 1, NULL, "empty.txt: no key in it", NULL);
    snprintf(path, sizeof path, "%s", write_file("comments.txt", "# only\n\n  \n#comments\n"));
    load_fails(NULL, 0, f1, 1, NULL, "comments.txt: no key in it", NULL);
    snprintf(path, sizeof path, "%s", write_file("spaced.txt", "# ok\nfine-key\nhas space-secret\n"));
    load_fails(NULL, 0, f1, 1, NULL, "spaced.txt line 3, word 1 after the key: not a limit", "space-secret");
    snprintf(path, sizeof path, "%s", write_file("lead.txt", "  indented-secret\n"));
    load_fails(NULL, 0, f1, 1, NULL, "lead.txt line 1: byte 1 of the key is a space", "indented-secret");
    snprintf(path, sizeof path, "%s/no-such-file", dir);
    load_fails(NULL, 0, f1, 1, NULL, "no-such-file: cannot read it: No such file or directory", NULL);
    /* a good flag key does not save a bad file */
    const char *good[] = {"good-key"};
    load_fails(good, 1, f1, 1, NULL, "--api-key-file", NULL);
}

int main(void)
{
    REQUIRE(mkdtemp(dir) != NULL, "mkdtemp");
    test_sources();
    test_open();
    test_errors();
    const char *names[] = {"keys.txt", "more.txt", "empty.txt", "comments.txt", "spaced.txt", "lead.txt"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
    return kt_done("test_router_apikey");
}
