/*
 * test_cli.c - the engine programs as users and outside checks call them (DESIGN.md section 6):
 * kvrelay-logits output equals the fixture references byte layout and values, with --last and
 * --chunk; kvrelay-generate --json --greedy reproduces the fixtures' greedy tokens (both with
 * --kv-cache-dtype f32: the references are float32 computations); --kv-cache-dtype auto follows
 * the weights' dtype and its stats count the cache's bytes; bad flags and bad ids fail with a
 * clear message and a non-zero status; kvrelay-bench-engine's decode roofline figures hold
 * together. Runs the built programs from $KR_BIN on the models in
 * $KR_FIXTURES, on kernels that keep matmul inputs f32.
 */
#include "kr_test.h"

#include "kr.h"

#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *bin, *fx;
static char tmpdir[256];

/* runs a shell command, capturing stdout+stderr into *out (malloc'd); returns the exit status */
static int run(char **out, const char *fmt, ...)
{
    char cmd[65536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[66000];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    FILE *p = popen(full, "r");
    REQUIRE(p, "popen failed");
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += got;
        if (n + 1 >= cap) buf = realloc(buf, cap *= 2);
    }
    buf[n] = 0;
    int st = pclose(p);
    if (out) *out = buf;
    else free(buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    *len = fread(buf, 1, (size_t)n, f);
    buf[*len] = 0;
    fclose(f);
    return buf;
}

static void ids_string(const cJSON *arr, char *s, size_t cap)
{
    size_t at = 0;
    s[0] = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) at += (size_t)snprintf(s + at, cap - at, "%s%d", at ? " " : "", (int)it->valuedouble);
}

static void check_model(const char *model)
{
    char path[8192], dir[4096], ids[16384];
    size_t len;
    snprintf(dir, sizeof dir, "%s/models/%s", fx, model);
    snprintf(path, sizeof path, "%s/cases.json", dir);
    char *json = slurp(path, &len);
    REQUIRE(json, "no %s", path);
    snprintf(path, sizeof path, "%s/logits.bin", dir);
    float *ref = (float *)slurp(path, &len);
    cJSON *root = cJSON_Parse(json);
    int vocab = cJSON_GetObjectItem(root, "vocab_size")->valueint;
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *cfg_text = slurp(path, &len);
    REQUIRE(cfg_text, "no %s", path);
    cJSON *cfg = cJSON_Parse(cfg_text);
    /* (layer, KV head) lists: every prompt entry is kept under full attention */
    int lists = cJSON_GetObjectItem(cfg, "num_hidden_layers")->valueint *
                cJSON_GetObjectItem(cfg, "num_key_value_heads")->valueint;
    cJSON_Delete(cfg);
    free(cfg_text);
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(root, "cases"))
    {
        const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
        const cJSON *prompt = cJSON_GetObjectItem(c, "prompt");
        const cJSON *positions = cJSON_GetObjectItem(c, "positions");
        int n = cJSON_GetArraySize(prompt), n_pos = cJSON_GetArraySize(positions);
        ids_string(prompt, ids, sizeof ids);
        size_t off = (size_t)cJSON_GetObjectItem(cJSON_GetObjectItem(c, "logits"), "offset")->valuedouble;
        /* all rows, default chunking; then the stored rows only with --last and odd chunks */
        const char *variants[] = {"", "--chunk 7", "--chunk 1 --threads 1"};
        for (int v = 0; v < 3; v++) {
            char out_path[512], *out;
            snprintf(out_path, sizeof out_path, "%s/logits.bin", tmpdir);
            int last = v == 0 ? n : n_pos;
            char last_flag[64] = "";
            if (v) snprintf(last_flag, sizeof last_flag, "--last %d", last);
            int st = run(&out, "%s/kvrelay-logits --model %s --ids \"%s\" --out %s %s %s --kv-cache-dtype f32", bin,
                         dir, ids, out_path, last_flag, variants[v]);
            CHECK(st == 0, "%s/%s: kvrelay-logits exited %d: %s", model, name, st, out);
            free(out);
            float *got = (float *)slurp(out_path, &len);
            REQUIRE(got, "no output file");
            CHECK(len == (size_t)last * vocab * sizeof(float), "%s/%s: %zu bytes, expected %d rows", model, name, len, last);
            if (len != (size_t)last * vocab * sizeof(float)) {
                free(got);
                continue;
            }
            double worst = 0;
            for (int j = 0; j < n_pos; j++) {
                int p = (int)cJSON_GetArrayItem(positions, j)->valuedouble;
                int row = p - (n - last);
                for (int k = 0; k < vocab; k++) {
                    double d = fabs((double)got[(size_t)row * vocab + k] - ref[off / 4 + (size_t)j * vocab + k]);
                    if (!(d <= worst)) worst = d;
                }
            }
            CHECK(worst <= 1e-4, "%s/%s %s: max |diff| %.3g", model, name, variants[v], worst);
            free(got);
        }
        /* greedy continuation as JSON */
        const cJSON *greedy = cJSON_GetObjectItem(c, "greedy");
        char expect[4096], *out;
        ids_string(cJSON_GetObjectItem(greedy, "tokens"), expect, sizeof expect);
        int st = run(&out, "%s/kvrelay-generate --model %s --ids \"%s\" --max-tokens 16 --greedy --json --stats "
                     "--kv-cache-dtype f32", bin, dir, ids);
        CHECK(st == 0, "%s/%s: kvrelay-generate exited %d: %s", model, name, st, out);
        cJSON *res = cJSON_Parse(out);
        CHECK(res != NULL, "%s/%s: generate printed no JSON: %s", model, name, out);
        if (res) {
            char got_ids[4096];
            ids_string(cJSON_GetObjectItem(res, "ids"), got_ids, sizeof got_ids);
            CHECK(!strcmp(got_ids, expect), "%s/%s: greedy ids '%s', expected '%s'", model, name, got_ids, expect);
            const cJSON *stats = cJSON_GetObjectItem(res, "stats");
            CHECK(cJSON_IsObject(stats), "no stats");
            const cJSON *pt = cJSON_GetObjectItem(stats, "prompt_tokens");
            CHECK(pt && pt->valueint == n, "prompt_tokens");
            const cJSON *fp = cJSON_GetObjectItem(stats, "kv_footprint");
            CHECK(fp && fabs(fp->valuedouble - 1.0) < 1e-12, "full attention footprint must be 1");
            const cJSON *pk = cJSON_GetObjectItem(stats, "peak_kv");
            CHECK(pk && fabs(pk->valuedouble - 1.0) < 1e-12, "full attention peak_kv must be 1");
            const cJSON *kept = cJSON_GetObjectItem(stats, "kv_entries_kept");
            CHECK(kept && kept->valueint == n * lists, "%s/%s: kv_entries_kept %d, expected %d x %d",
                  model, name, kept ? kept->valueint : -1, n, lists);
            CHECK(cJSON_IsString(cJSON_GetObjectItem(res, "text")), "no text");
            cJSON_Delete(res);
        }
        free(out);
    }
    cJSON_Delete(root);
    free(json);
    free(ref);
}

/* --kv-cache-dtype auto (the default) is the weights' dtype (`want`, as kr_dtype_name spells it);
 * kv_bytes_kept counts entries of 2 * head_dim elements of it */
static void check_kv_dtype(const char *model, const char *want, int elem_bytes)
{
    char *out;
    int st = run(&out, "%s/kvrelay-generate --model %s/models/%s --ids \"1 2 3 4 5\" --max-tokens 3 --greedy --json "
                 "--stats", bin, fx, model);
    cJSON *res = cJSON_Parse(out);
    const cJSON *stats = res ? cJSON_GetObjectItem(res, "stats") : NULL;
    CHECK(st == 0 && stats, "%s: generate failed: %s", model, out);
    if (stats) {
        const cJSON *dt = cJSON_GetObjectItem(stats, "kv_cache_dtype");
        CHECK(cJSON_IsString(dt) && !strcmp(dt->valuestring, want), "%s: kv_cache_dtype %s, expected %s", model,
              cJSON_IsString(dt) ? dt->valuestring : "missing", want);
        double kept = cJSON_GetObjectItem(stats, "kv_entries_kept")->valuedouble;
        double bytes = cJSON_GetObjectItem(stats, "kv_bytes_kept")->valuedouble;
        CHECK(bytes == kept * 2 * 32 * elem_bytes, "%s: %g bytes for %g entries of head_dim 32 in %s", model, bytes,
              kept, want);
    }
    cJSON_Delete(res);
    free(out);
}

static double json_num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

/* kvrelay-bench-engine --json, as bench/vs-llama.cpp.sh reads it: a decode line per (context,
 * batch), each with the roofline of a step (the longer of its bandwidth and compute times, named
 * in `bound`), the fraction of it reached, and for a batch above 1 its speed-up over batch 1 at
 * the same context and its fraction of the prefill tokens/s. Checks the arithmetic, not the
 * speed. */
static void check_bench_engine(const char *m)
{
    char *out;
    int st = run(&out, "{ %s/kvrelay-bench-engine --model %s --threads 1 --prefill 8 --contexts 16 --batch 4,1 "
                 "--decode-tokens 2 --repeat 1 --json 2>/dev/null; }", bin, m);
    cJSON *res = cJSON_Parse(out);
    const cJSON *dec = res ? cJSON_GetObjectItem(res, "decode") : NULL;
    const cJSON *pre = res ? cJSON_GetArrayItem(cJSON_GetObjectItem(res, "prefill"), 0) : NULL;
    CHECK(st == 0 && cJSON_GetArraySize(dec) == 2 && pre, "bench-engine: status %d, '%s'", st, out);
    const double tps1 = json_num(cJSON_GetArrayItem(dec, 1), "tokens_per_second");
    for (int i = 0; i < cJSON_GetArraySize(dec); i++) {
        const cJSON *e = cJSON_GetArrayItem(dec, i);
        const cJSON *bound = cJSON_GetObjectItem(e, "bound");
        const double tps = json_num(e, "tokens_per_second"), roof = json_num(e, "roofline_tokens_per_s");
        const double bw = json_num(e, "bandwidth_bound_seconds"), cp = json_num(e, "compute_bound_seconds");
        const int batch = (int)json_num(e, "batch");
        CHECK(batch == (i ? 1 : 4) && tps > 0 && bw > 0 && cp > 0, "decode line %d: batch %d, %g tokens/s, bounds %g / %g s",
              i, batch, tps, bw, cp);
        CHECK(fabs(roof - batch / fmax(bw, cp)) <= 1e-9 * roof, "batch %d: roofline %g tokens/s, bounds %g / %g s",
              batch, roof, bw, cp);
        CHECK(cJSON_IsString(bound) && !strcmp(bound->valuestring, bw >= cp ? "bandwidth" : "compute"),
              "batch %d: bound '%s' for %g / %g s", batch, cJSON_IsString(bound) ? bound->valuestring : "?", bw, cp);
        CHECK(fabs(json_num(e, "fraction_of_roofline") * roof - tps) <= 1e-9 * tps, "batch %d: fraction of roofline",
              batch);
        if (batch == 1) {
            CHECK(!cJSON_HasObjectItem(e, "speedup_over_batch1"), "batch 1 compared with itself");
            continue;
        }
        CHECK(fabs(json_num(e, "speedup_over_batch1") - tps / tps1) <= 1e-9 * tps, "batch %d: speed-up over %g", batch,
              tps1);
        CHECK(fabs(json_num(e, "fraction_of_prefill") - tps / json_num(pre, "tokens_per_second")) <= 1e-9 * tps,
              "batch %d: fraction of prefill", batch);
    }
    cJSON_Delete(res);
    free(out);
}

/* a command must fail with status != 0 and print `needle` */
static void check_fails(const char *needle, const char *fmt, const char *arg)
{
    char *out;
    int st = run(&out, fmt, bin, arg);
    CHECK(st != 0, "'%s' should fail: %s", fmt, out);
    CHECK(strstr(out, needle) != NULL, "'%s %s': output '%s' lacks '%s'", fmt, arg, out, needle);
    free(out);
}

int main(void)
{
    bin = kt_env("KR_BIN");
    fx = kt_env("KR_FIXTURES");
    REQUIRE(bin && fx, "KR_BIN and KR_FIXTURES must be set (run through ctest)");
    /* the programs run the reference-exact kernels: the AVX-512-BF16 ones round prefill's matmul
     * inputs of bf16 weights to bf16 (docs/engine.md, "Numerics"), beyond these checks' 1e-4 */
    if (!strcmp(kr_cpu_isa(), "avx512bf16")) setenv("KR_CPU_ISA", "avx512", 1);
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kr_test_cli.XXXXXX");
    REQUIRE(mkdtemp(tmpdir), "mkdtemp");
    check_model("llama3-tiny");
    check_model("qwen2-tiny");
    check_model("mistral-tiny");

    check_kv_dtype("llama3-tiny", "BF16", 2);
    check_kv_dtype("qwen2-tiny", "F16", 2);
    check_kv_dtype("mistral-tiny", "F32", 4);

    char m[4096];
    snprintf(m, sizeof m, "%s/models/llama3-tiny", fx);
    check_bench_engine(m);
    check_fails("--kv-cache-dtype", "%s/kvrelay-generate --model %s --ids 1 --max-tokens 2 --kv-cache-dtype f8", m);
    check_fails("--out", "%s/kvrelay-logits --model %s --ids '1 2'", m);
    check_fails("outside the vocabulary", "%s/kvrelay-logits --model %s --ids '1 512' --out /dev/null", m);
    check_fails("not a token id", "%s/kvrelay-logits --model %s --ids '1 x2' --out /dev/null", m);
    check_fails("cannot open", "%s/kvrelay-logits --model %s/nope --ids '1' --out /dev/null", m);
    check_fails("unknown argument", "%s/kvrelay-generate --model %s --ids 1 --max-tokens 2 --bogus", m);
    check_fails("--max-tokens", "%s/kvrelay-generate --model %s --ids 1", m);
    check_fails("exactly one of", "%s/kvrelay-generate --model %s --max-tokens 2", m);
    check_fails("tokenizer.json", "%s/kvrelay-generate --model %s --prompt hi --max-tokens 2", m);
    check_fails("--top-p", "%s/kvrelay-generate --model %s --ids 1 --max-tokens 2 --top-p 1.5", m);
    check_fails("unknown policy 'bogus'", "%s/kvrelay-generate --model %s --ids 1 --max-tokens 2 --policy bogus", m);
    check_fails("no key 'size'", "%s/kvrelay-generate --model %s --ids 1 --max-tokens 2 --policy streaming:size=3", m);

    /* a policy end to end: 64 prompt tokens in chunks of 8 under streaming with 2 sinks and an
     * 8-token window: every list keeps 10 entries, the footprint and peak fall below 1 */
    char ids[1024], *out;
    size_t at = 0;
    for (int i = 0; i < 64; i++) at += (size_t)snprintf(ids + at, sizeof ids - at, "%s%d", i ? " " : "", (i * 7 + 3) % 500);
    int st = run(&out, "%s/kvrelay-generate --model %s --ids \"%s\" --max-tokens 8 --greedy --json --stats --chunk 8 "
                 "--policy streaming:sink=2,window=8", bin, m, ids);
    cJSON *res = cJSON_Parse(out);
    const cJSON *stats = res ? cJSON_GetObjectItem(res, "stats") : NULL;
    CHECK(st == 0 && stats, "streaming run failed: %s", out);
    if (stats) {
        double fp = cJSON_GetObjectItem(stats, "kv_footprint")->valuedouble;
        double peak = cJSON_GetObjectItem(stats, "peak_kv")->valuedouble;
        int kept = cJSON_GetObjectItem(stats, "kv_entries_kept")->valueint;
        CHECK(fp > 0.1 && fp < 0.5 && peak < 0.4 && kept == 10 * 4 * 2, "streaming stats: footprint %g peak %g kept %d",
              fp, peak, kept);
        CHECK(!strcmp(cJSON_GetObjectItem(stats, "policy")->valuestring,
                      "streaming:sink=2,window=8,lazy=1,slack=0,max_drop=0,pos=abs"), "canonical policy echoed");
    }
    cJSON_Delete(res);
    free(out);
    const char *progs[] = {"kvrelay-logits", "kvrelay-generate", "kvrelay-bench-engine", "kvrelay-tokenize"};
    for (int i = 0; i < 4; i++) {
        st = run(&out, "%s/%s --help", bin, progs[i]);
        CHECK(st == 0 && strstr(out, "usage:"), "%s --help: status %d, '%s'", progs[i], st, out);
        free(out);
    }

    char cmd[8192];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    (void)system(cmd);
    return kt_done("test_cli");
}
