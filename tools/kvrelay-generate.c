/*
 * kvrelay-generate - prefill + decode in one process: the engine end to end, without the
 * cluster. Prints the generated text as it is produced (UTF-8-safe deltas), or with --json one
 * object {"ids": [...], "text": "...", "stats": {...}}. DESIGN.md section 6 fixes the interface.
 * Stopping: --max-tokens, --stop-id, and for text prompts the tokenizer's EOS (--ignore-eos
 * turns that off). With --ids the program is a raw engine probe: no BOS is added and EOS does
 * not stop it unless given with --stop-id (see docs/engine.md).
 * Scoring: --force-ids feeds given continuation ids instead of sampling and --logprobs reports
 * each emitted id's log-probability and the step's argmax (kr_logprob), the single-process
 * reference for what the cluster's Generate returns with `forced` / `logprobs`.
 */
#include "cli.h"
#include "kr.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { BLOCK = 16 };

typedef struct gen_opts {
    const char *model_dir, *prompt, *ids_s, *policy, *force_s;
    int max_tokens, chunk, threads, json, stats, ignore_eos, logprobs, backend, kv_dtype;
    kr_sampling sampling;
    double temperature, top_p; /* as parsed, before they narrow to sampling's floats */
    cli_id_list stop; /* --stop-id, then the tokenizer's EOS */
} gen_opts;

static void parse(int argc, char **argv, gen_opts *o)
{
    *o = (gen_opts){.max_tokens = -1, .chunk = 512, .policy = "full", .backend = KR_BACKEND_CPU,
                    .stop = {.max = INT32_MAX}};
    kr_sampling_default(&o->sampling);
    o->temperature = o->sampling.temperature;
    o->top_p = o->sampling.top_p;
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &o->model_dir,
         .help = "Hugging Face model directory (config.json, safetensors, tokenizer.json for --prompt and "
                 "for text output)"},
        {.kind = KC_FLAG_STRING, .name = "--prompt", .arg = "TEXT", .dest = &o->prompt,
         .help = "prompt text; tokenized with the BOS the tokenizer config asks for"},
        {.kind = KC_FLAG_STRING, .name = "--ids", .arg = "LIST", .dest = &o->ids_s,
         .help = "prompt token ids, fed as given (no BOS added)"},
        {.kind = KC_FLAG_INT, .name = "--max-tokens", .arg = "N", .dest = &o->max_tokens, .min = 0,
         .max = 1 << 24, .help = "tokens to generate (required unless --force-ids)"},
        {.kind = KC_FLAG_STRING, .name = "--force-ids", .arg = "LIST", .dest = &o->force_s,
         .help = "score these continuation ids: the i-th generated token is the i-th id (no sampling; stop "
                 "ids and EOS do not end it); implies --logprobs and the count (--max-tokens, if given, "
                 "must equal it)"},
        {.kind = KC_FLAG_BOOL, .name = "--logprobs", .dest = &o->logprobs,
         .help = "report each generated id's log-probability under the full softmax at temperature 1 and "
                 "the step's argmax id (in --json: \"logprobs\" and \"top_ids\"; otherwise one line per "
                 "token on stderr)"},
        {.kind = KC_FLAG_BOOL, .name = "--greedy", .dest = &o->sampling.greedy,
         .help = "argmax decoding (same as --temperature 0)"},
        {.kind = KC_FLAG_DOUBLE, .name = "--temperature", .arg = "T", .dest = &o->temperature, .dmin = 0,
         .dmax = 100, .def = "1", .help = "sampling temperature; 0 = greedy"},
        {.kind = KC_FLAG_INT, .name = "--top-k", .arg = "K", .dest = &o->sampling.top_k, .min = 0, .max = 1 << 24,
         .def = "0 = off", .help = "keep the K most likely tokens"},
        {.kind = KC_FLAG_DOUBLE, .name = "--top-p", .arg = "P", .dest = &o->top_p, .dmin = 0, .dmax = 1,
         .def = "1 = off", .help = "nucleus sampling mass"},
        {.kind = KC_FLAG_FUNC, .name = "--seed", .arg = "S", .dest = &o->sampling.seed, .fn = cli_flag_u64, .def = "0",
         .help = "sampling seed"},
        {.kind = KC_FLAG_FUNC, .name = "--stop-id", .arg = "ID", .dest = &o->stop, .fn = cli_flag_id,
         .help = "stop after generating ID (repeatable)"},
        {.kind = KC_FLAG_BOOL, .name = "--ignore-eos", .dest = &o->ignore_eos,
         .help = "with --prompt, do not stop at the tokenizer's EOS"},
        {.kind = KC_FLAG_STRING, .name = "--policy", .arg = "SPEC", .dest = &o->policy, .def = "full",
         .help = "KV policy: full, streaming, heads, hsft, snapkv, pyramidkv, take, sage; "
                 "name:key=value,... e.g. streaming:sink=4,window=1024 (docs/policies.md)"},
        {.kind = KC_FLAG_INT, .name = "--chunk", .arg = "C", .dest = &o->chunk, .min = 1, .max = 1 << 16,
         .def = "512", .help = "prefill chunk size in tokens"},
        {.kind = KC_FLAG_INT, .name = "--threads", .arg = "N", .dest = &o->threads, .min = 1, .max = 1024,
         .def = "all online CPUs", .help = "CPU threads"},
        {.kind = KC_FLAG_CHOICE, .name = "--backend", .arg = "B", .dest = &o->backend, .choices = cli_backends,
         .def = "cpu", .help = "cpu or cuda"},
        {.kind = KC_FLAG_CHOICE, .name = "--kv-cache-dtype", .arg = "T", .dest = &o->kv_dtype,
         .choices = cli_kv_dtypes, .def = "auto", .help = CLI_KV_DTYPE_HELP},
        {.kind = KC_FLAG_BOOL, .name = "--stats", .dest = &o->stats,
         .help = "report prompt/generated tokens, KV footprint, peak KV, KV kept after prefill, "
                 "prefill/decode seconds (stderr, or in --json)"},
        {.kind = KC_FLAG_BOOL, .name = "--json", .dest = &o->json,
         .help = "print one JSON object instead of streaming text"},
        {.kind = KC_FLAG_END},
    };
    char footer[512];
    snprintf(footer, sizeof footer, "%s\n\n%s", kr_cpu_isa_help(),
             "example: kvrelay-generate --model build/models/default --prompt \"The relay\" \\\n"
             "           --max-tokens 32 --greedy --stats");
    const kc_flags flags = {
        .prog = "kvrelay-generate",
        .usage = "--model DIR (--prompt TEXT | --ids \"1 2 3\") --max-tokens N [options]\n"
                 "       kvrelay-generate --model DIR (--prompt TEXT | --ids LIST) --force-ids LIST [options]",
        .about = "Runs chunked prefill and decode in one process and prints the generated text.",
        .table = table,
        .footer = footer,
    };
    kc_flags_main(&flags, argc, argv, 0);
    if (!o->model_dir) cli_die(2, "--model is required (see --help)");
    if (!o->prompt == !o->ids_s) cli_die(2, "give exactly one of --prompt and --ids");
    if (o->max_tokens < 0 && !o->force_s) cli_die(2, "--max-tokens is required");
    if (o->force_s) o->logprobs = 1;
    o->sampling.temperature = (float)o->temperature;
    o->sampling.top_p = (float)o->top_p;
}

static int is_stop(const gen_opts *o, int32_t id)
{
    for (int i = 0; i < o->stop.n; i++)
        if (o->stop.ids[i] == (uint32_t)id) return 1;
    return 0;
}

/* Appends a text delta to the generated text and, when streaming, prints it at once. */
static void emit(char **text, size_t *len, const char *delta, size_t dlen, int stream)
{
    if (!dlen) return;
    char *grown = realloc(*text, *len + dlen + 1);
    if (!grown) cli_die(1, "out of memory");
    memcpy(grown + *len, delta, dlen);
    *len += dlen;
    grown[*len] = 0;
    *text = grown;
    if (stream) {
        fwrite(delta, 1, dlen, stdout);
        fflush(stdout);
    }
}

int main(int argc, char **argv)
{
    cli_init(argv);
    gen_opts o;
    parse(argc, argv, &o);
    char err[KR_ERR_MAX];

    /* the tokenizer is needed for --prompt, and optional for text output with --ids */
    kr_tokenizer *tok = NULL;
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", o.model_dir);
    if (o.prompt || access(path, R_OK) == 0)
        if (kr_tokenizer_load(o.model_dir, &tok, err) != KR_OK) cli_die(1, "%s", err);
    int32_t *prompt;
    int n_prompt;
    if (o.prompt) {
        if (kr_tokenizer_encode(tok, o.prompt, strlen(o.prompt), 1, &prompt, &n_prompt, err) != KR_OK)
            cli_die(2, "--prompt: %s", err);
        int eos = kr_tokenizer_eos(tok);
        if (!o.ignore_eos && eos >= 0 && o.stop.n < CLI_MAX_IDS) o.stop.ids[o.stop.n++] = (uint32_t)eos;
    } else {
        prompt = cli_ids("--ids", o.ids_s, &n_prompt);
    }
    if (n_prompt == 0) cli_die(2, "the prompt is empty");
    int32_t *forced = NULL;
    int n_forced = 0;
    if (o.force_s) {
        forced = cli_ids("--force-ids", o.force_s, &n_forced);
        if (n_forced == 0) cli_die(2, "--force-ids: no ids");
        if (o.max_tokens >= 0 && o.max_tokens != n_forced)
            cli_die(2, "--max-tokens %d differs from the %d ids of --force-ids (give one or make them equal)",
                    o.max_tokens, n_forced);
        o.max_tokens = n_forced;
        o.stop.n = 0; /* a forced continuation is scored to its end, EOS or not */
    }

    kr_model *m;
    kr_model_opts mo = {.verbose = 0};
    if (kr_model_load(o.model_dir, &mo, &m, err) != KR_OK) cli_die(1, "%s", err);
    const kr_config *cfg = kr_model_config(m);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] >= cfg->vocab_size)
            cli_die(2, "prompt token %d (index %d) is outside the model's vocabulary [0, %d)", prompt[i], i, cfg->vocab_size);
    for (int i = 0; i < n_forced; i++)
        if (forced[i] >= cfg->vocab_size)
            cli_die(2, "--force-ids: id %d (index %d) is outside the model's vocabulary [0, %d)", forced[i], i, cfg->vocab_size);
    if (tok && kr_tokenizer_n_vocab(tok) > cfg->vocab_size)
        cli_die(1, "%s: the tokenizer has %d ids but the model only %d", o.model_dir, kr_tokenizer_n_vocab(tok), cfg->vocab_size);

    kr_ctx *ctx;
    kr_ctx_params cp = {.backend = (kr_backend_kind)o.backend, .n_threads = o.threads,
                        .max_chunk = o.chunk < n_prompt ? o.chunk : n_prompt,
                        .kv_dtype = (kr_kv_dtype)o.kv_dtype};
    if (kr_ctx_create(m, &cp, &ctx, err) != KR_OK) cli_die(1, "%s", err);
    kr_policy *policy;
    if (kr_policy_parse(o.policy, cfg, &policy, err) != KR_OK) cli_die(2, "--policy: %s", err);
    /* room for the whole sequence plus a policy's appended observers and one block of list
     * offset: a policy never holds more than full attention would */
    int total = n_prompt + o.max_tokens + kr_policy_appended(policy, n_prompt) + BLOCK;
    kr_kv_pool *pool;
    kr_seq *seq;
    int blocks = ((total + BLOCK - 1) / BLOCK) * cfg->n_layers * cfg->n_kv_heads;
    if (kr_ctx_kv_pool_create(ctx, BLOCK, blocks, &pool, err) != KR_OK ||
        kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &seq, err) != KR_OK)
        cli_die(1, "%s", err);
    if (kr_seq_set_policy(seq, policy, err) != KR_OK) cli_die(1, "%s", err);
    kr_sampler *sp;
    if (kr_sampler_create(&o.sampling, cfg->vocab_size, &sp, err) != KR_OK) cli_die(2, "%s", err);
    kr_detok *dt = NULL;
    if (tok && kr_detok_create(tok, 1, &dt, err) != KR_OK) cli_die(1, "%s", err);

    float *logits = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    int32_t *out = malloc(sizeof(int32_t) * (size_t)(o.max_tokens + 1));
    int32_t *top_ids = malloc(sizeof(int32_t) * (size_t)(o.max_tokens + 1));
    float *lps = malloc(sizeof(float) * (size_t)(o.max_tokens + 1));
    char *text = calloc(1, 1);
    size_t text_len = 0;
    if (!logits || !out || !top_ids || !lps || !text) cli_die(1, "out of memory");

    double t0 = cli_now();
    int n_out = 0;
    const char *finish = "length";
    if (o.max_tokens > 0) {
        if (kr_prefill(ctx, seq, prompt, n_prompt, o.chunk, KR_LOGITS_LAST, logits, err) != KR_OK)
            cli_die(1, "prefill: %s", err);
    }
    double t1 = cli_now();
    int64_t kept_after_prefill = kr_seq_entries(seq);
    while (n_out < o.max_tokens) {
        if (n_out > 0 && kr_forward(ctx, seq, &out[n_out - 1], 1, KR_LOGITS_LAST, logits, err) != KR_OK)
            cli_die(1, "decode: %s", err);
        int32_t id = forced ? forced[n_out] : kr_sampler_sample(sp, logits);
        if (o.logprobs) lps[n_out] = kr_logprob(logits, cfg->vocab_size, id, &top_ids[n_out]);
        out[n_out++] = id;
        if (dt) {
            const char *delta;
            size_t dlen;
            if (kr_detok_push(dt, id, &delta, &dlen, err) != KR_OK) cli_die(1, "%s", err);
            emit(&text, &text_len, delta, dlen, !o.json);
        } else if (!o.json) {
            printf("%s%d", n_out > 1 ? " " : "", id);
            fflush(stdout);
        }
        if (is_stop(&o, id)) {
            finish = "stop";
            break;
        }
    }
    double t2 = cli_now();
    if (dt) {
        const char *delta;
        size_t dlen;
        kr_detok_flush(dt, &delta, &dlen);
        emit(&text, &text_len, delta, dlen, !o.json);
    }

    kr_footprint fp;
    kr_seq_footprint(seq, &fp);
    int64_t entry_bytes = (int64_t)cfg->head_dim * 2 * (int64_t)kr_dtype_size(kr_ctx_kv_dtype(ctx));
    cJSON *stats = cJSON_CreateObject();
    cJSON_AddNumberToObject(stats, "prompt_tokens", n_prompt);
    cJSON_AddNumberToObject(stats, "generated_tokens", n_out);
    cJSON_AddStringToObject(stats, "finish_reason", finish);
    cJSON_AddStringToObject(stats, "policy", kr_policy_spec(policy));
    /* Cache Me If You Can: footprint over every query step; peak KV of one (layer, KV head)
     * per query step (both exactly 1 for full attention) */
    cJSON_AddNumberToObject(stats, "kv_footprint", fp.full > 0 ? fp.attended / fp.full : 1.0);
    cJSON_AddNumberToObject(stats, "peak_kv", fp.steps > 0 ? (double)fp.peak_head_entries / (double)fp.steps : 0.0);
    cJSON_AddNumberToObject(stats, "peak_kv_entries", (double)fp.peak_entries);
    cJSON_AddNumberToObject(stats, "kv_entries_kept", (double)kept_after_prefill);
    cJSON_AddNumberToObject(stats, "kv_bytes_kept", (double)(kept_after_prefill * entry_bytes));
    cJSON_AddStringToObject(stats, "kv_cache_dtype", kr_dtype_name(kr_ctx_kv_dtype(ctx)));
    cJSON_AddStringToObject(stats, "cpu_isa", kr_cpu_isa());
    cJSON_AddNumberToObject(stats, "prefill_seconds", t1 - t0);
    cJSON_AddNumberToObject(stats, "decode_seconds", t2 - t1);
    cJSON_AddNumberToObject(stats, "prefill_tokens_per_second", t1 > t0 ? n_prompt / (t1 - t0) : 0);
    cJSON_AddNumberToObject(stats, "decode_tokens_per_second", n_out > 1 && t2 > t1 ? (n_out - 1) / (t2 - t1) : 0);
    cJSON_AddNumberToObject(stats, "threads", kr_ctx_n_threads(ctx));

    if (o.json) {
        cJSON *root = cJSON_CreateObject();
        cJSON *ids = cJSON_AddArrayToObject(root, "ids");
        for (int i = 0; i < n_out; i++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(out[i]));
        cJSON_AddStringToObject(root, "text", text);
        if (o.logprobs) {
            /* float32 widened to double, printed to parse back exactly (compared bit for bit
             * with the cluster's TokenDelta.logprobs) */
            cJSON *jl = cJSON_AddArrayToObject(root, "logprobs");
            cJSON *jt = cJSON_AddArrayToObject(root, "top_ids");
            for (int i = 0; i < n_out; i++) {
                char num[40];
                cli_json_exact((double)lps[i], num, sizeof num);
                cJSON_AddItemToArray(jl, cJSON_CreateRaw(num));
                cJSON_AddItemToArray(jt, cJSON_CreateNumber(top_ids[i]));
            }
        }
        if (o.stats) cJSON_AddItemToObject(root, "stats", stats);
        else cJSON_Delete(stats);
        char *s = cJSON_PrintUnformatted(root);
        puts(s);
        free(s);
        cJSON_Delete(root);
    } else {
        putchar('\n');
        fflush(stdout);
        for (int i = 0; o.logprobs && i < n_out; i++)
            fprintf(stderr, "token %d: id %d logprob %.9g top_id %d\n", i, out[i], (double)lps[i], top_ids[i]);
        if (o.stats) {
            char *s = cJSON_Print(stats);
            fprintf(stderr, "%s\n", s);
            free(s);
        }
        cJSON_Delete(stats);
    }
    free(text);
    free(out);
    free(top_ids);
    free(lps);
    free(forced);
    free(logits);
    kr_detok_free(dt);
    kr_sampler_free(sp);
    kr_seq_free(seq);
    kr_policy_free(policy);
    kr_kv_pool_free(pool);
    kr_ctx_free(ctx);
    kr_model_free(m);
    kr_tokenizer_free(tok);
    free(prompt);
    return 0;
}
