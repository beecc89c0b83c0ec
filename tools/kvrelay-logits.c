/*
 * kvrelay-logits - runs a prompt of token ids through the engine and writes the logits of every
 * position (float32 little-endian, one row of vocab_size per position), for comparing the
 * engine with a reference implementation. DESIGN.md section 6 fixes this interface.
 *   kvrelay-logits --model DIR --ids "1 2 3" --out FILE [--last N] [--chunk C]
 */
#include "cli.h"
#include "kr.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *model_dir = NULL, *ids_s = NULL, *out_path = NULL;
    int64_t last = -1, chunk = 512;
    int threads = 0, backend = KR_BACKEND_CPU, kv_dtype = KR_KV_DTYPE_AUTO;
    kr_model_opts mo = {0};
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &model_dir,
         .help = "Hugging Face model directory (config.json + safetensors)"},
        {.kind = KC_FLAG_STRING, .name = "--ids", .arg = "LIST", .dest = &ids_s,
         .help = "prompt token ids, separated by spaces or commas"},
        {.kind = KC_FLAG_STRING, .name = "--out", .arg = "FILE", .dest = &out_path,
         .help = "where to write the logits ('-' for stdout)"},
        {.kind = KC_FLAG_INT64, .name = "--last", .arg = "N", .dest = &last, .min = 1, .max = 1L << 30,
         .def = "all", .help = "write only the last N rows"},
        {.kind = KC_FLAG_INT64, .name = "--chunk", .arg = "C", .dest = &chunk, .min = 1, .max = 1 << 16,
         .def = "512", .help = "prefill in chunks of C tokens"},
        {.kind = KC_FLAG_INT, .name = "--threads", .arg = "N", .dest = &threads, .min = 1, .max = 1024,
         .def = "all online CPUs", .help = "CPU threads"},
        {.kind = KC_FLAG_CHOICE, .name = "--backend", .arg = "B", .dest = &backend, .choices = cli_backends,
         .def = "cpu", .help = "cpu or cuda"},
        {.kind = KC_FLAG_CHOICE, .name = "--kv-cache-dtype", .arg = "T", .dest = &kv_dtype,
         .choices = cli_kv_dtypes, .def = "auto", .help = CLI_KV_DTYPE_HELP},
        {.kind = KC_FLAG_BOOL, .name = "--weights-f32", .dest = &mo.weights_f32,
         .help = "convert bf16/f16 weights to f32 at load"},
        {.kind = KC_FLAG_END},
    };
    char footer[512];
    snprintf(footer, sizeof footer, "%s\n\n%s", kr_cpu_isa_help(),
             "example: kvrelay-logits --model tests/fixtures/models/llama3-tiny --ids \"5 9 2\" \\\n"
             "           --out /tmp/logits.bin --last 1");
    const kc_flags flags = {
        .prog = "kvrelay-logits",
        .usage = "--model DIR --ids \"1 2 3\" --out FILE [options]",
        .about = "Feeds the token ids (no BOS is added) at positions 0..n-1 and writes float32\n"
                 "little-endian logits, one row of vocab_size values per position, row-major.",
        .table = table,
        .footer = footer,
    };
    kc_flags_main(&flags, argc, argv, 0);
    if (!model_dir || !ids_s || !out_path) cli_die(2, "--model, --ids and --out are required (see --help)");
    int n;
    int32_t *ids = cli_ids("--ids", ids_s, &n);
    if (n == 0) cli_die(2, "--ids: no token ids given");
    if (last < 0 || last > n) last = n;

    char err[KR_ERR_MAX];
    kr_model *m;
    if (kr_model_load(model_dir, &mo, &m, err) != KR_OK) cli_die(1, "%s", err);
    const kr_config *cfg = kr_model_config(m);
    for (int i = 0; i < n; i++)
        if (ids[i] >= cfg->vocab_size)
            cli_die(2, "--ids: id %d (index %d) is outside the vocabulary [0, %d)", ids[i], i, cfg->vocab_size);
    if (chunk > n) chunk = n;
    kr_ctx *ctx;
    kr_ctx_params cp = {.backend = (kr_backend_kind)backend, .n_threads = (int)threads, .max_chunk = (int)chunk,
                        .kv_dtype = (kr_kv_dtype)kv_dtype};
    if (kr_ctx_create(m, &cp, &ctx, err) != KR_OK) cli_die(1, "%s", err);
    kr_kv_pool *pool;
    kr_seq *seq;
    enum { BLOCK = 16 };
    int blocks = ((n + BLOCK - 1) / BLOCK) * cfg->n_layers * cfg->n_kv_heads;
    if (kr_ctx_kv_pool_create(ctx, BLOCK, blocks, &pool, err) != KR_OK ||
        kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &seq, err) != KR_OK)
        cli_die(1, "%s", err);

    FILE *out = strcmp(out_path, "-") ? fopen(out_path, "wb") : stdout;
    if (!out) cli_die(1, "--out: cannot write '%s'", out_path);
    float *rows = malloc(sizeof(float) * (size_t)chunk * (size_t)cfg->vocab_size);
    if (!rows) cli_die(1, "out of memory for %" PRId64 " rows of logits", chunk);
    int64_t first_out = n - last;
    for (int at = 0; at < n; at += (int)chunk) {
        int len = n - at < chunk ? n - at : (int)chunk;
        kr_logits_mode mode = at + len > first_out ? KR_LOGITS_ALL : KR_LOGITS_NONE;
        if (kr_forward(ctx, seq, ids + at, len, mode, rows, err) != KR_OK) cli_die(1, "%s", err);
        if (mode == KR_LOGITS_NONE) continue;
        int skip = first_out > at ? (int)(first_out - at) : 0;
        size_t count = (size_t)(len - skip) * (size_t)cfg->vocab_size;
        if (fwrite(rows + (size_t)skip * cfg->vocab_size, sizeof(float), count, out) != count)
            cli_die(1, "--out: write to '%s' failed", out_path);
    }
    if (out != stdout && fclose(out) != 0) cli_die(1, "--out: closing '%s' failed", out_path);
    free(rows);
    kr_seq_free(seq);
    kr_kv_pool_free(pool);
    kr_ctx_free(ctx);
    kr_model_free(m);
    free(ids);
    return 0;
}
