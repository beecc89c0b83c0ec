/*
 * kvrelay-cli - a command-line client of the public gRPC API that kvrelay-router serves
 * (kvrelay.v1.Generation and kvrelay.v1.Admin): generate streams text to the terminal as it
 * arrives (or prints one JSON object), tokenize prints token ids, status prints the cluster's
 * nodes. It talks gRPC only; it loads no model. With --api-key (or KVRELAY_API_KEY) every call
 * carries "authorization: Bearer KEY"; with --tls-ca (or KVRELAY_TLS_CA) it speaks TLS and checks
 * the router's certificate, presenting --tls-cert/--tls-key when given. docs/cli.md is its
 * manual.
 * Run: kvrelay-cli --router 127.0.0.1:7100 generate --prompt "The relay" --max-tokens 32
 */
#include "bundle.h" /* kt_dtype_parse: --kv-wire-dtype is checked before it is sent */
#include "cli.h"
#include "names.h"
#include "rpc.h"

#include "kvrelay/v1/kvrelay.pb-c.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_STOPS = 64, DEFAULT_MAX_TOKENS = 64 };

/* --router, --api-key and --tls-*, which may come before or after the command */
static const char *router_addr;
static kc_tls_config tls; /* --tls-ca etc.; none given: plaintext */
static const char *api_key; /* NULL: none (the router must then have no keys) */
static const char *api_key_src = "--api-key"; /* where it came from, for messages */

/* The metadata every call carries: "authorization: Bearer KEY" when there is a key. */
static kc_md auth_md[1];
static size_t n_auth_md;
static char auth_value[300];

/* A non-OK status: the message the tests and users rely on, exit 1. */
static void fail_status(const kc_status *st)
{
    fprintf(stderr, "kvrelay-cli: %s: %s\n", kc_status_name(st->code), st->details);
    if (st->code == GRPC_STATUS_UNAVAILABLE)
        fprintf(stderr, "kvrelay-cli: %s\n",
                kc_tls_enabled(&tls)
                    ? "with TLS: is the router's certificate from --tls-ca and for this address, "
                      "and does it want a client certificate (--tls-cert/--tls-key)?"
                    : "without TLS: is the router up there, and not serving TLS (then give "
                      "--tls-ca)?");
    if (st->code == GRPC_STATUS_UNAUTHENTICATED)
        fprintf(stderr, "kvrelay-cli: the router wants an API key: %s\n",
                api_key ? "the one given (--api-key or $KVRELAY_API_KEY) is not one of its keys"
                        : "give it with --api-key KEY or $KVRELAY_API_KEY");
    exit(1);
}

/* Checks the key as the router would (so that gRPC does not refuse it as metadata with a vaguer
 * error) and makes the metadata. The key itself is never printed. */
static void auth_init(void)
{
    if (!api_key) return;
    size_t n = strlen(api_key);
    if (n == 0 || n > 256) cli_die(2, "%s: the key must be 1-256 bytes (it is %zu)", api_key_src, n);
    for (size_t k = 0; k < n; k++)
        if (api_key[k] <= ' ' || api_key[k] > '~')
            cli_die(2, "%s: byte %zu of the key is a space or not printable ASCII", api_key_src, k + 1);
    snprintf(auth_value, sizeof auth_value, "Bearer %s", api_key);
    auth_md[0] = (kc_md){.key = "authorization", .value = auth_value};
    n_auth_md = 1;
}

static int flag_router(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    if (!*v) return snprintf(err, cap, "%s: empty; give the router's HOST:PORT", flag), -1;
    *(const char **)dest = v;
    return 0;
}

static int flag_api_key(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    (void)err, (void)cap;
    *(const char **)dest = v;
    api_key_src = flag;
    return 0;
}

/* The flags every command takes, before or after it: the top level's table and each command's
 * `more` table. Their defaults come from the environment, read in main before parsing. */
static const kc_flag common_flags[] = {
    {.kind = KC_FLAG_SECTION, .help = "every command takes these, before or after it:"},
    {.kind = KC_FLAG_FUNC, .name = "--router", .arg = "HOST:PORT", .dest = &router_addr, .fn = flag_router,
     .def = "$KVRELAY_ROUTER, else 127.0.0.1:7100", .help = "the router"},
    {.kind = KC_FLAG_FUNC, .name = "--api-key", .arg = "KEY", .dest = &api_key, .fn = flag_api_key,
     .def = "$KVRELAY_API_KEY; none when both are unset",
     .help = "the router's API key, sent as 'authorization: Bearer KEY' on every call"},
    {.kind = KC_FLAG_FUNC, .name = "--tls-ca", .arg = "FILE", .dest = &tls, .fn = kc_flag_tls,
     .def = "$KVRELAY_TLS_CA; plaintext when both are unset",
     .help = "TLS to the router, whose certificate must chain to FILE (PEM)"},
    {.kind = KC_FLAG_FUNC, .name = "--tls-cert", .arg = "FILE", .dest = &tls, .fn = kc_flag_tls,
     .def = "$KVRELAY_TLS_CERT",
     .help = "with --tls-key: the client certificate a router that verifies clients asks for"},
    {.kind = KC_FLAG_FUNC, .name = "--tls-key", .arg = "FILE", .dest = &tls, .fn = kc_flag_tls,
     .def = "$KVRELAY_TLS_KEY", .help = "its private key (PEM, unencrypted)"},
    KC_FLAGS_TLS_CLIENT_AUTH_REFUSED(&tls),
    {.kind = KC_FLAG_END},
};

/* the end of every --help */
#define EXIT_STATUS                                                                                \
    "A request the router refuses prints \"kvrelay-cli: CODE: details\" and exits 1;\n"           \
    "bad flags exit 2."

/* A command's flags: its own table, then the common ones. argv[0] is the command's name. */
static kc_flags command_flags(const kc_flag *table, const char *usage, const char *about)
{
    return (kc_flags){.prog = "kvrelay-cli", .usage = usage, .about = about, .table = table,
                      .more = common_flags, .footer = EXIT_STATUS};
}

static kc_channel *connect_router(void)
{
    auth_init(); /* every command connects once, after its flags are parsed */
    char err[256];
    if (kc_tls_flags_finish(&tls, KC_TLS_ROLE_CLIENT, err) != 0) cli_die(2, "%s", err);
    kc_channel_opts opts = {0};
    kc_channel *ch;
    kc_status st;
    grpc_init(); /* for the credentials, made before the channel */
    if (kc_tls_enabled(&tls) && !(opts.creds = kc_tls_channel_credentials(&tls, &st))) cli_die(2, "%s", st.details);
    if (kc_channel_create_opts(router_addr, &opts, &ch, &st) != 0) fail_status(&st);
    if (opts.creds) grpc_channel_credentials_release(opts.creds); /* the channel holds its own */
    grpc_shutdown();
    return ch;
}

/* ------------------------------------------------------------------ generate */

typedef struct gen_opts {
    const char *prompt, *ids_s, *policy, *request_id, *force_s, *wire;
    int64_t max_tokens, cancel_after, top_k; /* -1: not given */
    int64_t timeout_ms; /* 0: the router's deadline */
    int json, raw, has_seed, logprobs;
    double temperature, top_p; /* -1: not given */
    uint64_t seed;
    const char *stops[MAX_STOPS];
    int n_stops;
    cli_id_list stop_ids;
} gen_opts;

static int flag_seed(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    gen_opts *o = dest;
    o->has_seed = 1;
    return cli_flag_u64(&o->seed, flag, v, err, cap);
}

/* Checked here so that a typo exits 2 naming the flag; sent as given (the router parses it
 * with the same kt_dtype_parse). */
static int flag_wire(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    kt_dtype t;
    if (kt_dtype_parse(v, &t) != 0)
        return snprintf(err, cap, "%s: '%.64s' is not f32, bf16, f16, int8 or fp8", flag, v), -1;
    *(const char **)dest = v;
    return 0;
}

static void parse_generate(int argc, char **argv, gen_opts *o)
{
    *o = (gen_opts){.max_tokens = -1, .cancel_after = -1, .top_k = -1, .temperature = -1, .top_p = -1,
                    .stop_ids = {.max = UINT32_MAX}};
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--prompt", .arg = "TEXT", .dest = &o->prompt,
         .help = "the prompt, tokenized by the router"},
        {.kind = KC_FLAG_STRING, .name = "--ids", .arg = "\"1 2 3\"", .dest = &o->ids_s,
         .help = "the prompt as token ids (spaces or commas between)"},
        {.kind = KC_FLAG_INT64, .name = "--max-tokens", .arg = "N", .dest = &o->max_tokens, .min = 0,
         .max = UINT32_MAX, .def = "64", .help = "tokens to generate, the first included"},
        {.kind = KC_FLAG_DOUBLE, .name = "--temperature", .arg = "T", .dest = &o->temperature, .dmin = 0,
         .dmax = 100, .def = "0 = greedy", .help = "sampling temperature"},
        {.kind = KC_FLAG_DOUBLE, .name = "--top-p", .arg = "P", .dest = &o->top_p, .dmin = 0, .dmax = 1,
         .help = "nucleus sampling mass"},
        {.kind = KC_FLAG_INT64, .name = "--top-k", .arg = "K", .dest = &o->top_k, .min = 0, .max = UINT32_MAX,
         .help = "keep the K most likely tokens"},
        {.kind = KC_FLAG_FUNC, .name = "--seed", .arg = "S", .dest = o, .fn = flag_seed, .help = "sampling seed"},
        {.kind = KC_FLAG_STRING, .name = "--policy", .arg = "SPEC", .dest = &o->policy, .def = "full",
         .help = "KV policy, e.g. streaming:sink=4,window=64, or auto:floor=0.9 (docs/adaptive.md)"},
        {.kind = KC_FLAG_FUNC, .name = "--kv-wire-dtype", .arg = "T", .dest = &o->wire, .fn = flag_wire,
         .def = "the prefill node's --kv-dtype",
         .help = "the KV bundle's payload dtype from the prefill to the decode node: f32, bf16, f16, int8 or fp8 "
                 "(docs/rpc.md)"},
        {.kind = KC_FLAG_LIST, .name = "--stop", .arg = "STR", .dest = o->stops, .count = &o->n_stops,
         .max_count = MAX_STOPS, .help = "stop string, not included in the output (repeatable)"},
        {.kind = KC_FLAG_FUNC, .name = "--stop-id", .arg = "N", .dest = &o->stop_ids, .fn = cli_flag_id,
         .help = "stop token id (repeatable)"},
        {.kind = KC_FLAG_STRING, .name = "--force-ids", .arg = "LIST", .dest = &o->force_s,
         .help = "score these continuation ids instead of sampling: exactly that many tokens (--max-tokens then "
                 "defaults to their count); implies --logprobs"},
        {.kind = KC_FLAG_BOOL, .name = "--logprobs", .dest = &o->logprobs,
         .help = "each token's log-probability and the step's argmax id: one line per token on stderr, or "
                 "\"logprobs\"/\"top_ids\" in --json"},
        {.kind = KC_FLAG_BOOL, .name = "--raw", .dest = &o->raw,
         .help = "do not add the tokenizer's special tokens (BOS) to --prompt"},
        {.kind = KC_FLAG_STRING, .name = "--request-id", .arg = "ID", .dest = &o->request_id,
         .def = "made by the router", .help = "the request's id"},
        {.kind = KC_FLAG_INT64, .name = "--timeout-ms", .arg = "MS", .dest = &o->timeout_ms, .min = 1,
         .max = 86400000, .def = "the router's", .help = "deadline for the whole request"},
        {.kind = KC_FLAG_BOOL, .name = "--json", .dest = &o->json,
         .help = "print one JSON object {ids, text, finish_reason, usage, request_id} instead of streaming"},
        {.kind = KC_FLAG_INT64, .name = "--cancel-after", .arg = "N", .dest = &o->cancel_after, .min = 0,
         .max = 1 << 30, .help = "cancel the stream after N tokens and exit 0 with what came (finish_reason "
                                 "\"cancelled\"; for tests)"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags =
        command_flags(table, "[--router HOST:PORT] generate (--prompt TEXT | --ids \"1 2 3\") [options]",
                      "Streams the generated text to stdout as it arrives (token ids when the router's\n"
                      "model has no tokenizer), then the finish reason and usage to stderr.");
    kc_flags_main(&flags, argc, argv, 0);
    if (!o->prompt == !o->ids_s) kc_flags_die(&flags, "generate: give exactly one of --prompt and --ids");
}

/* What the stream brought. */
typedef struct gen_result {
    uint32_t *ids;
    size_t n_ids, cap_ids;
    float *logprobs; /* [n_ids] when the deltas carried them */
    uint32_t *top_ids;
    size_t n_logprobs;
    char *text;
    size_t text_len;
    Kvrelay__V1__GenerateResponse *finish_msg; /* owns the Finish */
    int cancelled;
} gen_result;

static void result_add(gen_result *g, const Kvrelay__V1__TokenDelta *d)
{
    if (g->n_ids + d->n_ids > g->cap_ids) {
        size_t cap = g->cap_ids ? g->cap_ids : 64;
        while (cap < g->n_ids + d->n_ids) cap *= 2;
        uint32_t *grown = realloc(g->ids, cap * sizeof *grown);
        if (!grown) cli_die(1, "out of memory");
        g->ids = grown;
        g->cap_ids = cap;
    }
    if (d->n_ids) memcpy(g->ids + g->n_ids, d->ids, d->n_ids * sizeof *d->ids);
    if (d->n_logprobs == d->n_ids && d->n_top_ids == d->n_ids && d->n_ids) {
        float *lp = realloc(g->logprobs, g->cap_ids * sizeof *lp);
        if (lp) g->logprobs = lp;
        uint32_t *tp = realloc(g->top_ids, g->cap_ids * sizeof *tp);
        if (tp) g->top_ids = tp;
        if (!lp || !tp) cli_die(1, "out of memory");
        /* aligned with ids as long as every delta with ids carried them */
        if (g->n_logprobs == g->n_ids) {
            memcpy(g->logprobs + g->n_ids, d->logprobs, d->n_ids * sizeof *lp);
            memcpy(g->top_ids + g->n_ids, d->top_ids, d->n_ids * sizeof *tp);
            g->n_logprobs += d->n_ids;
        }
    }
    g->n_ids += d->n_ids;
    size_t tl = strlen(d->text);
    char *grown = realloc(g->text, g->text_len + tl + 1);
    if (!grown) cli_die(1, "out of memory");
    memcpy(grown + g->text_len, d->text, tl + 1);
    g->text = grown;
    g->text_len += tl;
}

static void print_json(const gen_result *g)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *ids = cJSON_AddArrayToObject(root, "ids");
    for (size_t i = 0; i < g->n_ids; i++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(g->ids[i]));
    cJSON_AddStringToObject(root, "text", g->text ? g->text : "");
    if (g->n_logprobs) {
        cJSON *jl = cJSON_AddArrayToObject(root, "logprobs");
        cJSON *jt = cJSON_AddArrayToObject(root, "top_ids");
        for (size_t i = 0; i < g->n_logprobs; i++) {
            char num[40];
            cli_json_exact((double)g->logprobs[i], num, sizeof num);
            cJSON_AddItemToArray(jl, cJSON_CreateRaw(num));
            cJSON_AddItemToArray(jt, cJSON_CreateNumber(g->top_ids[i]));
        }
    }
    const Kvrelay__V1__Finish *f = g->finish_msg ? g->finish_msg->finish : NULL;
    cJSON_AddStringToObject(root, "finish_reason", g->cancelled ? "cancelled" : kc_finish_reason_name(f->reason));
    if (f && f->usage) {
        const Kvrelay__V1__Usage *u = f->usage;
        cJSON *ju = cJSON_AddObjectToObject(root, "usage");
        cJSON_AddNumberToObject(ju, "prompt_tokens", u->prompt_tokens);
        cJSON_AddNumberToObject(ju, "cached_tokens", u->cached_tokens);
        cJSON_AddNumberToObject(ju, "completion_tokens", u->completion_tokens);
        cJSON_AddNumberToObject(ju, "ttft_s", u->ttft_s);
        cJSON_AddNumberToObject(ju, "tpot_s", u->tpot_s);
        cJSON_AddNumberToObject(ju, "kv_footprint", u->kv_footprint);
        cJSON_AddNumberToObject(ju, "peak_kv_entries", (double)u->peak_kv_entries);
        cJSON_AddNumberToObject(ju, "kv_bytes_shipped", (double)u->kv_bytes_shipped);
        cJSON_AddStringToObject(ju, "kv_wire_dtype", u->kv_wire_dtype);
        cJSON_AddNumberToObject(ju, "kv_entries_shipped", (double)u->kv_entries_shipped);
        cJSON *sb = cJSON_AddObjectToObject(ju, "served_by");
        cJSON_AddStringToObject(sb, "prefill_node", u->served_by ? u->served_by->prefill_node : "");
        cJSON_AddStringToObject(sb, "decode_node", u->served_by ? u->served_by->decode_node : "");
        if (u->auto_policy && *u->auto_policy) { /* kv_policy auto: what the router chose */
            cJSON *ja = cJSON_AddObjectToObject(ju, "auto");
            cJSON_AddStringToObject(ja, "policy", u->auto_policy);
            cJSON_AddNumberToObject(ja, "score", u->auto_score);
            cJSON_AddStringToObject(ja, "pressure", u->auto_pressure);
            cJSON_AddStringToObject(ja, "reason", u->auto_reason);
        }
    }
    if (f) cJSON_AddStringToObject(root, "request_id", f->request_id);
    char *s = cJSON_PrintUnformatted(root);
    puts(s);
    free(s);
    cJSON_Delete(root);
}

static void print_usage_line(const gen_result *g)
{
    if (g->cancelled) {
        fprintf(stderr, "cancelled after %zu tokens\n", g->n_ids);
        return;
    }
    const Kvrelay__V1__Finish *f = g->finish_msg->finish;
    const Kvrelay__V1__Usage *u = f->usage;
    if (!u) {
        fprintf(stderr, "finish: %s (no usage) [%s]\n", kc_finish_reason_name(f->reason), f->request_id);
        return;
    }
    fprintf(stderr,
            "finish: %s | prompt %u (%u cached) + completion %u tokens | ttft %.1f ms | tpot %.2f ms | kv footprint %.3f | "
            "peak kv %" PRIu64 " entries | shipped %" PRIu64 " bytes (%" PRIu64 " entries, %s) | %s -> %s | %s\n",
            kc_finish_reason_name(f->reason), u->prompt_tokens, u->cached_tokens, u->completion_tokens, u->ttft_s * 1e3, u->tpot_s * 1e3,
            u->kv_footprint, u->peak_kv_entries, u->kv_bytes_shipped, u->kv_entries_shipped,
            u->kv_wire_dtype[0] ? u->kv_wire_dtype : "?",
            u->served_by ? u->served_by->prefill_node : "?", u->served_by ? u->served_by->decode_node : "?",
            f->request_id);
    if (u->auto_policy && *u->auto_policy)
        fprintf(stderr, "auto: %s (score %.3f, %s pressure: %s)\n", u->auto_policy, u->auto_score, u->auto_pressure,
                u->auto_reason);
}

static int cmd_generate(int argc, char **argv)
{
    gen_opts o;
    parse_generate(argc, argv, &o);
    Kvrelay__V1__GenerateRequest req = KVRELAY__V1__GENERATE_REQUEST__INIT;
    Kvrelay__V1__TokenIds tids = KVRELAY__V1__TOKEN_IDS__INIT;
    uint32_t *ids = NULL;
    if (o.prompt) {
        req.prompt_case = KVRELAY__V1__GENERATE_REQUEST__PROMPT_TEXT;
        req.text = (char *)o.prompt;
        req.add_special = !o.raw;
    } else {
        int n;
        int32_t *v = cli_ids("--ids", o.ids_s, &n);
        ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
        if (!ids) cli_die(1, "out of memory");
        for (int k = 0; k < n; k++) ids[k] = (uint32_t)v[k];
        free(v);
        tids.n_ids = (size_t)n;
        tids.ids = ids;
        req.prompt_case = KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS;
        req.token_ids = &tids;
    }
    req.max_tokens = o.max_tokens < 0 ? DEFAULT_MAX_TOKENS : (uint32_t)o.max_tokens;
    Kvrelay__V1__TokenIds fids = KVRELAY__V1__TOKEN_IDS__INIT;
    uint32_t *forced = NULL;
    if (o.force_s) {
        int n;
        int32_t *v = cli_ids("--force-ids", o.force_s, &n);
        if (n == 0) cli_die(2, "generate: --force-ids: no ids");
        forced = malloc((size_t)n * sizeof *forced);
        if (!forced) cli_die(1, "out of memory");
        for (int k = 0; k < n; k++) forced[k] = (uint32_t)v[k];
        free(v);
        fids.n_ids = (size_t)n;
        fids.ids = forced;
        req.forced = &fids;
        /* the server takes 0 as "as many as forced"; a given --max-tokens is sent for it to check */
        if (o.max_tokens < 0) req.max_tokens = 0;
    }
    req.logprobs = o.logprobs;
    Kvrelay__V1__Sampling sampling = KVRELAY__V1__SAMPLING__INIT;
    if (o.temperature >= 0 || o.top_p >= 0 || o.top_k >= 0 || o.has_seed) {
        /* a flag not given is the proto's zero: the server's default */
        sampling.temperature = o.temperature < 0 ? 0.0f : (float)o.temperature;
        sampling.top_p = o.top_p < 0 ? 0.0f : (float)o.top_p;
        sampling.top_k = o.top_k < 0 ? 0 : (uint32_t)o.top_k;
        if (o.has_seed) {
            sampling.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
            sampling.seed = o.seed;
        }
        req.sampling = &sampling;
    }
    req.n_stop = (size_t)o.n_stops;
    req.stop = (char **)o.stops;
    req.n_stop_ids = (size_t)o.stop_ids.n;
    req.stop_ids = o.stop_ids.ids;
    if (o.policy) req.kv_policy = (char *)o.policy;
    if (o.request_id) req.request_id = (char *)o.request_id;
    if (o.wire) req.kv_wire_dtype = (char *)o.wire;

    kc_channel *ch = connect_router();
    kc_stream *s;
    kc_status st;
    if (kc_stream_open_md(ch, "/kvrelay.v1.Generation/Generate", &req.base, auth_md, n_auth_md, o.timeout_ms, &s,
                          &st) != 0)
        fail_status(&st);
    gen_result g = {0};
    int any_text = 0;
    for (;;) {
        Kvrelay__V1__GenerateResponse *m = NULL;
        int rc = kc_stream_next(s, &kvrelay__v1__generate_response__descriptor, (ProtobufCMessage **)&m, &st);
        if (rc == 0) break;
        if (rc < 0) {
            if (g.cancelled && st.code == GRPC_STATUS_CANCELLED) break;
            fflush(stdout);
            if (!o.json && (any_text || g.n_ids)) fputc('\n', stdout);
            fail_status(&st);
        }
        if (m->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA && !g.cancelled) {
            result_add(&g, m->delta);
            if (!o.json && m->delta->text[0]) {
                fputs(m->delta->text, stdout);
                fflush(stdout);
                any_text = 1;
            }
            if (o.cancel_after >= 0 && g.n_ids >= (size_t)o.cancel_after) {
                g.cancelled = 1;
                kc_stream_cancel(s);
            }
            kc_message_free(&m->base);
        } else if (m->event_case == KVRELAY__V1__GENERATE_RESPONSE__EVENT_FINISH && !g.finish_msg) {
            g.finish_msg = m;
        } else {
            kc_message_free(&m->base);
        }
    }
    kc_stream_close(s);
    kc_channel_destroy(ch);
    if (!g.finish_msg && !g.cancelled) {
        st.code = GRPC_STATUS_INTERNAL;
        snprintf(st.details, sizeof st.details, "the stream ended without a finish message");
        fail_status(&st);
    }
    if (o.json) {
        print_json(&g);
    } else {
        if (!any_text) /* a model without tokenizer: the ids are the output */
            for (size_t k = 0; k < g.n_ids; k++) printf("%s%u", k ? " " : "", g.ids[k]);
        putchar('\n');
        fflush(stdout);
        for (size_t k = 0; k < g.n_logprobs; k++)
            fprintf(stderr, "token %zu: id %u logprob %.9g top_id %u\n", k, g.ids[k], (double)g.logprobs[k], g.top_ids[k]);
        print_usage_line(&g);
    }
    kc_message_free(g.finish_msg ? &g.finish_msg->base : NULL);
    free(g.ids);
    free(g.logprobs);
    free(g.top_ids);
    free(g.text);
    free(ids);
    free(forced);
    return 0;
}

/* ------------------------------------------------------------------ tokenize */

static int cmd_tokenize(int argc, char **argv)
{
    const char *text = NULL;
    int add_special = 0;
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--text", .arg = "TEXT", .dest = &text, .help = "the text (required)"},
        {.kind = KC_FLAG_BOOL, .name = "--add-special", .dest = &add_special,
         .help = "add the tokenizer's special tokens (BOS)"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags = command_flags(table, "[--router HOST:PORT] tokenize --text TEXT [--add-special]",
                                         "Prints the token ids, space-separated.");
    kc_flags_main(&flags, argc, argv, 0);
    if (!text) kc_flags_die(&flags, "tokenize: --text is required");
    Kvrelay__V1__TokenizeRequest req = KVRELAY__V1__TOKENIZE_REQUEST__INIT;
    req.text = (char *)text;
    req.add_special = add_special;
    kc_channel *ch = connect_router();
    Kvrelay__V1__TokenizeResponse *resp;
    kc_status st;
    const kc_call_opts opts = {.timeout_ms = 30000, .md = auth_md, .n_md = n_auth_md};
    if (kc_unary_md(ch, "/kvrelay.v1.Generation/Tokenize", &req.base, &kvrelay__v1__tokenize_response__descriptor,
                    &opts, (ProtobufCMessage **)&resp, &st) != 0)
        fail_status(&st);
    for (size_t k = 0; k < resp->n_ids; k++) printf("%s%u", k ? " " : "", resp->ids[k]);
    putchar('\n');
    kc_message_free(&resp->base);
    kc_channel_destroy(ch);
    return 0;
}

/* ------------------------------------------------------------------ status */

/* A prefill node's prefix cache in the status table: "3 states 1.5/64.0 MiB, 2/5 hits, 768
 * tokens reused", or "off" without one. */
static void prefix_cache_cell(const Kvrelay__V1__Node *n, char *out, size_t cap)
{
    if (!n->prefix_cache_budget_bytes) {
        snprintf(out, cap, "off");
        return;
    }
    snprintf(out, cap, "%" PRIu64 " states %.1f/%.1f MiB, %" PRIu64 "/%" PRIu64 " hits, %" PRIu64 " tokens reused",
             n->prefix_cache_entries, (double)n->prefix_cache_bytes / (1 << 20),
             (double)n->prefix_cache_budget_bytes / (1 << 20), n->prefix_cache_hits, n->prefix_cache_lookups,
             n->prefix_cache_tokens_reused);
}

static int cmd_status(int argc, char **argv)
{
    int json = 0;
    const kc_flag table[] = {
        {.kind = KC_FLAG_BOOL, .name = "--json", .dest = &json, .help = "one JSON object {nodes: [...]}"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags = command_flags(table, "[--router HOST:PORT] status [--json]",
                                         "Prints the router and every node: role, state, load, KV blocks, "
                                         "each prefill node's prefix cache, and the router's pressure level "
                                         "(kv_policy auto).");
    kc_flags_main(&flags, argc, argv, 0);
    kc_channel *ch = connect_router();
    Kvrelay__V1__ClusterStatusRequest req = KVRELAY__V1__CLUSTER_STATUS_REQUEST__INIT;
    Kvrelay__V1__ClusterStatusResponse *resp;
    kc_status st;
    const kc_call_opts opts = {.timeout_ms = 30000, .md = auth_md, .n_md = n_auth_md};
    if (kc_unary_md(ch, "/kvrelay.v1.Admin/ClusterStatus", &req.base,
                    &kvrelay__v1__cluster_status_response__descriptor, &opts, (ProtobufCMessage **)&resp, &st) != 0)
        fail_status(&st);
    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON *arr = cJSON_AddArrayToObject(root, "nodes");
        for (size_t k = 0; k < resp->n_nodes; k++) {
            const Kvrelay__V1__Node *n = resp->nodes[k];
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "id", n->id);
            cJSON_AddStringToObject(o, "role", kc_node_role_name(n->role));
            cJSON_AddStringToObject(o, "state", kc_node_state_name(n->state));
            cJSON_AddStringToObject(o, "grpc_address", n->grpc_address);
            cJSON_AddStringToObject(o, "transfer_address", n->transfer_address);
            cJSON_AddNumberToObject(o, "running_requests", n->running_requests);
            cJSON_AddNumberToObject(o, "queued_requests", n->queued_requests);
            cJSON_AddNumberToObject(o, "outstanding_prefill_tokens", (double)n->outstanding_prefill_tokens);
            cJSON_AddNumberToObject(o, "free_kv_blocks", (double)n->free_kv_blocks);
            cJSON_AddNumberToObject(o, "total_kv_blocks", (double)n->total_kv_blocks);
            cJSON_AddNumberToObject(o, "reserved_kv_blocks", (double)n->reserved_kv_blocks);
            cJSON_AddNumberToObject(o, "since_unix_ms", (double)n->since_unix_ms);
            cJSON_AddNumberToObject(o, "prefix_cache_bytes", (double)n->prefix_cache_bytes);
            cJSON_AddNumberToObject(o, "prefix_cache_budget_bytes", (double)n->prefix_cache_budget_bytes);
            cJSON_AddNumberToObject(o, "prefix_cache_entries", (double)n->prefix_cache_entries);
            cJSON_AddNumberToObject(o, "prefix_cache_lookups", (double)n->prefix_cache_lookups);
            cJSON_AddNumberToObject(o, "prefix_cache_hits", (double)n->prefix_cache_hits);
            cJSON_AddNumberToObject(o, "prefix_cache_tokens_reused", (double)n->prefix_cache_tokens_reused);
            cJSON_AddStringToObject(o, "model_fingerprint", n->model_fingerprint);
            cJSON_AddItemToArray(arr, o);
        }
        if (resp->pressure && *resp->pressure) { /* kv_policy auto's level (docs/adaptive.md) */
            cJSON *p = cJSON_AddObjectToObject(root, "pressure");
            cJSON_AddStringToObject(p, "level", resp->pressure);
            cJSON_AddNumberToObject(p, "free_kv_blocks", (double)resp->pressure_free_blocks);
            cJSON_AddNumberToObject(p, "total_kv_blocks", (double)resp->pressure_total_blocks);
            cJSON_AddNumberToObject(p, "queued_requests", resp->pressure_queued);
        }
        char *s = cJSON_PrintUnformatted(root);
        puts(s);
        free(s);
        cJSON_Delete(root);
    } else {
        printf("%-16s %-8s %-12s %8s %-22s %7s %6s %14s %17s %9s  %s\n", "ID", "ROLE", "STATE", "SINCE_S", "ADDRESS",
               "RUNNING", "QUEUED", "PREFILL_TOKENS", "KV_FREE/TOTAL", "RESERVED", "PREFIX_CACHE");
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        int64_t now_ms = (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
        for (size_t k = 0; k < resp->n_nodes; k++) {
            const Kvrelay__V1__Node *n = resp->nodes[k];
            char tokens[32] = "-", blocks[48] = "-", reserved[32] = "-", running[16] = "-", queued[16] = "-";
            char cache[128] = "-";
            /* load numbers only for nodes that answered (unreachable, suspect, gone: none) */
            int up = n->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING ||
                     n->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING;
            char since[24] = "-"; /* seconds in the current state */
            if (n->since_unix_ms > 0) snprintf(since, sizeof since, "%.1f", (double)(now_ms - n->since_unix_ms) / 1000.0);
            if (up) {
                snprintf(running, sizeof running, "%u", n->running_requests);
                snprintf(queued, sizeof queued, "%u", n->queued_requests);
            }
            if (up && n->role == KVRELAY__V1__NODE_ROLE__NODE_ROLE_PREFILL) {
                snprintf(tokens, sizeof tokens, "%" PRIu64, n->outstanding_prefill_tokens);
                prefix_cache_cell(n, cache, sizeof cache);
            }
            if (up && n->role == KVRELAY__V1__NODE_ROLE__NODE_ROLE_DECODE) {
                snprintf(blocks, sizeof blocks, "%" PRIu64 "/%" PRIu64, n->free_kv_blocks, n->total_kv_blocks);
                snprintf(reserved, sizeof reserved, "%" PRIu64, n->reserved_kv_blocks);
            }
            printf("%-16s %-8s %-12s %8s %-22s %7s %6s %14s %17s %9s  %s\n", n->id, kc_node_role_name(n->role),
                   kc_node_state_name(n->state), since, n->grpc_address, running, queued, tokens, blocks, reserved,
                   cache);
        }
        if (resp->pressure && *resp->pressure)
            printf("pressure: %s (%" PRIu64 "/%" PRIu64 " decode KV blocks free, %u requests queued at the router)\n",
                   resp->pressure, resp->pressure_free_blocks, resp->pressure_total_blocks, resp->pressure_queued);
    }
    kc_message_free(&resp->base);
    kc_channel_destroy(ch);
    return 0;
}

int main(int argc, char **argv)
{
    cli_init(argv);
    router_addr = getenv("KVRELAY_ROUTER");
    if (!router_addr || !*router_addr) router_addr = "127.0.0.1:7100";
    api_key = getenv("KVRELAY_API_KEY"); /* --api-key, before or after the command, wins */
    if (api_key && !*api_key) api_key = NULL;
    if (api_key) api_key_src = "KVRELAY_API_KEY";
    tls = (kc_tls_config){.ca_file = getenv("KVRELAY_TLS_CA"), .cert_file = getenv("KVRELAY_TLS_CERT"),
                          .key_file = getenv("KVRELAY_TLS_KEY")}; /* the flags win */
    const kc_flags flags = {
        .prog = "kvrelay-cli",
        .usage = "[--router HOST:PORT] [--api-key KEY] [--tls-ca FILE] COMMAND [options]",
        .about = "A client of kvrelay-router's gRPC API.",
        .table = common_flags + 1, /* without the heading: here they are the only flags */
        .footer = "commands (kvrelay-cli COMMAND --help lists a command's flags):\n"
                  "  generate (--prompt TEXT | --ids \"1 2 3\") [options]\n"
                  "      streams the generated text to stdout as it arrives, then the finish reason and\n"
                  "      usage to stderr\n"
                  "  tokenize --text TEXT [--add-special]\n"
                  "      prints the token ids, space-separated\n"
                  "  status [--json]\n"
                  "      prints the router and every node: role, state, load, KV blocks\n"
                  "\n" EXIT_STATUS,
    };
    int at = kc_flags_main(&flags, argc, argv, 1);
    if (at >= argc) kc_flags_die(&flags, "give a command: generate, tokenize or status (see --help)");
    /* the command's own parser starts after its name, which stands in for argv[0] */
    const char *cmd = argv[at];
    if (!strcmp(cmd, "generate")) return cmd_generate(argc - at, argv + at);
    if (!strcmp(cmd, "tokenize")) return cmd_tokenize(argc - at, argv + at);
    if (!strcmp(cmd, "status")) return cmd_status(argc - at, argv + at);
    kc_flags_die(&flags, "unknown command '%s' (generate, tokenize or status; see --help)", cmd);
}
