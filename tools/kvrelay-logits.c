/*
 * kvrelay-logits - runs a prompt of token ids through the engine and writes the logits of every
 * position (float32 little-endian, one row of vocab_size per position), for comparing the
 * engine with a reference implementation. DESIGN.md section 6 fixes this interface.
 *   kvrelay-logits --model DIR --ids "1 2 3" --out FILE [--last N] [--chunk C]
 */
#include "cli.h"
#include "kr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvrelay-logits --model DIR --ids \"1 2 3\" --out FILE [options]\n"
            "\n"
            "Feeds the token ids (no BOS is added) at positions 0..n-1 and writes float32\n"
            "little-endian logits, one row of vocab_size values per position, row-major.\n"
            "\n"
            "  --model DIR     Hugging Face model directory (config.json + safetensors)\n"
            "  --ids LIST      prompt token ids, separated by spaces or commas\n"
            "  --out FILE      where to write the logits ('-' for stdout)\n"
            "  --last N        write only the last N rows (default: all)\n"
            "  --chunk C       prefill in chunks of C tokens (default 512)\n"
            "  --threads N     CPU threads (default: all online CPUs)\n"
            "  --backend B     cpu (default) or cuda\n"
            "  --weights-f32   convert bf16/f16 weights to f32 at load\n"
            "  -h, --help      this help\n"
            "\n"
            "example: kvrelay-logits --model tests/fixtures/models/llama3-tiny --ids \"5 9 2\" \\\n"
            "           --out /tmp/logits.bin --last 1\n");
}

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *model_dir = NULL, *ids_s = NULL, *out_path = NULL;
    long last = -1, chunk = 512, threads = 0;
    kr_backend_kind backend = KR_BACKEND_CPU;
    kr_model_opts mo = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--model")) model_dir = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--ids")) ids_s = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--out")) out_path = cli_value(argc, argv, &i);
        else if (!strcmp(a, "--last")) last = cli_long(a, cli_value(argc, argv, &i), 1, 1L << 30);
        else if (!strcmp(a, "--chunk")) chunk = cli_long(a, cli_value(argc, argv, &i), 1, 1 << 16);
        else if (!strcmp(a, "--threads")) threads = cli_long(a, cli_value(argc, argv, &i), 1, 1024);
        else if (!strcmp(a, "--weights-f32")) mo.weights_f32 = 1;
        else if (!strcmp(a, "--backend")) backend = (kr_backend_kind)cli_backend(cli_value(argc, argv, &i));
        else cli_die(2, "unknown argument '%s' (see --help)", a);
    }
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
    kr_ctx_params cp = {.backend = backend, .n_threads = (int)threads, .max_chunk = (int)chunk};
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
    if (!rows) cli_die(1, "out of memory for %ld rows of logits", chunk);
    long first_out = n - last;
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
