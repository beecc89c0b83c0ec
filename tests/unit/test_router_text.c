/*
 * test_router_text.c - text end to end through kvrelay-cli, on the bundled default model (it has
 * a tokenizer; the fixture models do not): a decode node, a prefill node and a router as real
 * processes, and the CLI as a user runs it:
 *   - a text prompt's greedy ids and text equal kvrelay-generate's in one process;
 *   - a stop string taken from that text cuts the output just before its first occurrence
 *     (finish_reason "stop", the stop string not in the text, the ids a prefix); a stop string
 *     that never occurs changes nothing (held-back text is flushed at the end);
 *   - tokenize equals kvrelay-tokenize; status lists the nodes;
 *   - a refused request prints "kvrelay-cli: INVALID_ARGUMENT: ..." and exits 1;
 *   - --cancel-after N exits 0 with the first N ids and finish_reason "cancelled".
 * Skips (77) when the default model ($KR_BIN/models/default, made by ./kvrelay or
 * kvrelay-make-model) or the programs are absent. Run: ctest -R test_router_text.
 */
#include "kr_test.h"
#include "proc.h"

#include <cjson/cJSON.h>
#include <ctype.h>

static const char *bin;
static char model[1024];

/* Runs a shell command; returns its stdout (malloc'd) and exit status. stderr goes to `err_out`
 * when given (a file the test reads), else to the test's stderr. */
static char *run(const char *cmd, int *status)
{
    FILE *p = popen(cmd, "r");
    REQUIRE(p, "popen %s", cmd);
    size_t cap = 1 << 16, n = 0;
    char *out = malloc(cap);
    size_t got;
    while ((got = fread(out + n, 1, cap - 1 - n, p)) > 0) {
        n += got;
        if (n + 1 >= cap) out = realloc(out, cap *= 2);
    }
    out[n] = 0;
    int rc = pclose(p);
    *status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    return out;
}

static cJSON *run_json(const char *cmd)
{
    int status;
    char *out = run(cmd, &status);
    CHECK(status == 0, "%s: exit %d", cmd, status);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL, "%s: not JSON: %s", cmd, out);
    free(out);
    return j;
}

static int ids_equal(const cJSON *a, const cJSON *b, int n)
{
    for (int i = 0; i < n; i++) {
        const cJSON *x = cJSON_GetArrayItem(a, i), *y = cJSON_GetArrayItem(b, i);
        if (!x || !y || x->valueint != y->valueint) return 0;
    }
    return 1;
}

static const char *text_of(const cJSON *j)
{
    const cJSON *t = cJSON_GetObjectItem(j, "text");
    return cJSON_IsString(t) ? t->valuestring : "";
}

int main(void)
{
    bin = kt_env("KR_BIN");
    if (!bin) {
        fprintf(stderr, "test_router_text: KR_BIN is needed: SKIPPED\n");
        return KT_SKIP;
    }
    snprintf(model, sizeof model, "%s/models/default", bin);
    char path[1200];
    snprintf(path, sizeof path, "%s/tokenizer.json", model);
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "test_router_text: %s absent (./kvrelay test makes it, or kvrelay-make-model): SKIPPED\n", path);
        return KT_SKIP;
    }
    char router_bin[1024], decode_bin[1024], prefill_bin[1024];
    snprintf(router_bin, sizeof router_bin, "%s/kvrelay-router", bin);
    snprintf(decode_bin, sizeof decode_bin, "%s/kvrelay-decode", bin);
    snprintf(prefill_bin, sizeof prefill_bin, "%s/kvrelay-prefill", bin);
    if (access(router_bin, X_OK) || access(decode_bin, X_OK) || access(prefill_bin, X_OK)) {
        fprintf(stderr, "test_router_text: the router and node programs are not built: SKIPPED\n");
        return KT_SKIP;
    }

    char *decode_argv[] = {decode_bin, "--model", model, "--listen", "127.0.0.1:0", "--transfer", "127.0.0.1:0",
                           "--http", "127.0.0.1:0", "--kv-memory", "64M", "--threads", "1", NULL};
    char *prefill_argv[] = {prefill_bin, "--model", model, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                            "--threads", "1", NULL};
    test_proc decode, prefill, router;
    REQUIRE(test_proc_start(decode_argv, 60, &decode) == 0, "decode node");
    REQUIRE(test_proc_start(prefill_argv, 60, &prefill) == 0, "prefill node");
    char nodes_path[] = "/tmp/kvrelay-test-router-text-XXXXXX";
    int nfd = mkstemp(nodes_path);
    REQUIRE(nfd >= 0, "mkstemp");
    FILE *nf = fdopen(nfd, "w");
    fprintf(nf, "{\"prefill\": [{\"id\": \"prefill-0\", \"address\": \"%s\"}], \"decode\": [{\"id\": \"decode-0\", \"address\": \"%s\"}]}\n",
            prefill.grpc, decode.grpc);
    fclose(nf);
    char *router_argv[] = {router_bin, "--model", model, "--nodes", nodes_path, "--listen", "127.0.0.1:0",
                           "--http", "127.0.0.1:0", NULL};
    REQUIRE(test_proc_start(router_argv, 60, &router) == 0, "router");

    char cli[1400], cmd[4096];
    snprintf(cli, sizeof cli, "%s/kvrelay-cli --router %s", bin, router.grpc);
    const char *prompt = "The relay carries";
    const int n = 40;

    /* ---- greedy text equals one-process generation */
    snprintf(cmd, sizeof cmd, "%s generate --prompt '%s' --max-tokens %d --json", cli, prompt, n);
    cJSON *got = run_json(cmd);
    snprintf(cmd, sizeof cmd, "%s/kvrelay-generate --model %s --prompt '%s' --max-tokens %d --greedy --json", bin,
             model, prompt, n);
    cJSON *want = run_json(cmd);
    REQUIRE(got && want, "no output to compare");
    const cJSON *got_ids = cJSON_GetObjectItem(got, "ids"), *want_ids = cJSON_GetObjectItem(want, "ids");
    int n_want = cJSON_GetArraySize(want_ids);
    CHECK(cJSON_GetArraySize(got_ids) == n_want && ids_equal(got_ids, want_ids, n_want), "ids differ from kvrelay-generate");
    const char *full = text_of(want);
    CHECK(!strcmp(text_of(got), full), "text '%s' != kvrelay-generate's '%s'", text_of(got), full);
    const cJSON *usage = cJSON_GetObjectItem(got, "usage");
    CHECK(usage && cJSON_GetObjectItem(usage, "served_by") && cJSON_GetObjectItem(usage, "kv_bytes_shipped"),
          "usage fields missing");

    /* ---- a stop string from that text: cut before its first occurrence */
    size_t len = strlen(full);
    char stop[8] = "";
    for (size_t i = len / 3; i + 4 <= len && !stop[0]; i++) {
        int ok = 1;
        for (size_t k = 0; k < 4; k++) ok &= isalnum((unsigned char)full[i + k]) || full[i + k] == ' ';
        if (ok) memcpy(stop, full + i, 4);
    }
    if (!stop[0]) {
        fprintf(stderr, "test_router_text: no ASCII window in '%s' to use as a stop string: that check is skipped\n", full);
    } else {
        size_t cut = (size_t)(strstr(full, stop) - full);
        snprintf(cmd, sizeof cmd, "%s generate --prompt '%s' --max-tokens %d --stop '%s' --json", cli, prompt, n, stop);
        cJSON *s = run_json(cmd);
        if (s) {
            const char *t = text_of(s);
            CHECK(strlen(t) == cut && !strncmp(t, full, cut), "stop '%s': text '%s', want the first %zu bytes of '%s'",
                  stop, t, cut, full);
            const cJSON *fr = cJSON_GetObjectItem(s, "finish_reason");
            CHECK(cJSON_IsString(fr) && !strcmp(fr->valuestring, "stop"), "stop: finish_reason");
            const cJSON *sids = cJSON_GetObjectItem(s, "ids");
            int ns = cJSON_GetArraySize(sids);
            CHECK(ns >= 1 && ns <= n_want && ids_equal(sids, want_ids, ns), "stop: ids not a prefix (%d)", ns);
            cJSON_Delete(s);
        }
    }
    snprintf(cmd, sizeof cmd, "%s generate --prompt '%s' --max-tokens %d --stop 'zqzqzq' --stop 'Xx' --json", cli,
             prompt, n);
    cJSON *never = run_json(cmd);
    if (never) {
        CHECK(!strcmp(text_of(never), full), "a stop that never occurs changed the text: '%s'", text_of(never));
        cJSON_Delete(never);
    }

    /* ---- tokenize, status */
    int status;
    snprintf(cmd, sizeof cmd, "%s tokenize --text '%s'", cli, prompt);
    char *tok_router = run(cmd, &status);
    CHECK(status == 0, "tokenize exit %d", status);
    snprintf(cmd, sizeof cmd, "printf '%%s' '%s' | %s/kvrelay-tokenize --model %s", prompt, bin, model);
    char *tok_local = run(cmd, &status);
    CHECK(!strcmp(tok_router, tok_local), "tokenize: router '%s' != kvrelay-tokenize '%s'", tok_router, tok_local);
    free(tok_router);
    free(tok_local);
    snprintf(cmd, sizeof cmd, "%s status", cli);
    char *table = run(cmd, &status);
    CHECK(status == 0 && strstr(table, "decode-0") && strstr(table, "prefill-0") && strstr(table, "serving"),
          "status table:\n%s", table);
    free(table);

    /* ---- a refused request */
    snprintf(cmd, sizeof cmd, "%s generate --prompt '%s' --max-tokens 0 2>&1", cli, prompt);
    char *msg = run(cmd, &status);
    CHECK(status == 1 && !strncmp(msg, "kvrelay-cli: INVALID_ARGUMENT: max_tokens", 41), "refusal: exit %d, '%s'",
          status, msg);
    free(msg);

    /* ---- cancel after 3 tokens */
    snprintf(cmd, sizeof cmd, "%s generate --prompt '%s' --max-tokens 4000 --cancel-after 3 --json", cli, prompt);
    cJSON *c = run_json(cmd);
    if (c) {
        const cJSON *fr = cJSON_GetObjectItem(c, "finish_reason");
        const cJSON *cids = cJSON_GetObjectItem(c, "ids");
        CHECK(cJSON_IsString(fr) && !strcmp(fr->valuestring, "cancelled"), "cancel: finish_reason");
        CHECK(cJSON_GetArraySize(cids) >= 3 && ids_equal(cids, want_ids, 3), "cancel: %d ids", cJSON_GetArraySize(cids));
        cJSON_Delete(c);
    }

    cJSON_Delete(got);
    cJSON_Delete(want);
    int rs = test_proc_stop(&router, SIGTERM, 20);
    CHECK(rs >= 0 && WIFEXITED(rs) && WEXITSTATUS(rs) == 0, "router exit status %d", rs);
    test_proc_stop(&prefill, SIGTERM, 20);
    test_proc_stop(&decode, SIGTERM, 20);
    unlink(nodes_path);
    return kt_done("test_router_text");
}
