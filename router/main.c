/*
 * kvrelay-router - the public face of a kvrelay cluster: serves kvrelay.v1.Generation
 * (Generate, Tokenize), kvrelay.v1.Admin (ClusterStatus) and grpc.health.v1 over gRPC, and
 * /metrics + /healthz over HTTP; sends each request to a decode node (Reserve, Decode) and a
 * prefill node (Prefill) chosen by its placement. It loads the model's config.json and
 * tokenizer.json only: it never runs the model.
 * Membership comes from a static file (--nodes) or from etcd (--etcd: it changes while the
 * router runs); both give a kc_member list (common/membership.h) that router/nodes.c makes the
 * node table match; failed
 * nodes are handled as docs/failures.md says (circuit breaker, prefill retry, decode failure or
 * --migrate). Not here: TLS, several routers sharing load information.
 * Run: kvrelay-router --model DIR --nodes nodes.json --listen 127.0.0.1:7100 --http 127.0.0.1:9100
 * docs/router.md describes the flags, the request flow and its retry rules.
 */
#include "flags.h"
#include "cpusched.h"
#include "health.h"
#include "http.h"
#include "membership.h"
#include "auto.h"
#include "router.h"
#include "signals.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...)
{
    va_list ap;
    fputs("kvrelay-router: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(2);
}

typedef struct router_opts {
    const char *model, *nodes, *id, *placement, *policy_dir;
    const char *cluster, *fingerprint, *served_model_name;
    const char *calibration, *default_policy, *pressure; /* kv_policy auto (auto.h) */
    kc_hostport listen, http; /* --listen, --http */
    kc_log_level log_level;
    int cpu_sched; /* kc_cpu_sched of the router's threads */
    kc_etcd_config etcd; /* --etcd and its TLS/auth flags (etcd.h) */
    kc_tls_config tls;   /* --tls-*: the public port and the mutual TLS to the nodes (rpc.h) */
    int64_t max_tokens_limit, max_prompt, default_timeout_ms, max_queue_ms, max_request_bytes;
    rt_limit_conf limits; /* --limit-* (client-limits.h) */
    int64_t breaker_failures, breaker_cooldown_ms, prefill_timeout_ms, decode_stall_ms;
    int64_t prefill_chunk, kv_index_blocks; /* kv-aware placement */
    int migrate;
    const char *api_keys[64], *api_key_files[64]; /* --api-key, --api-key-file (argv strings) */
    int n_api_keys, n_api_key_files;
} router_opts;

/* --limit-concurrency, --limit-rate, --limit-burst (client-limits.h parses their syntax). */
static int flag_limit(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    return rt_limits_flag(dest, flag, v, err, cap) == 1 ? 0 : -1;
}

static void parse(int argc, char **argv, router_opts *out)
{
    static router_opts o;
    static const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &o.model,
         .help = "model directory: config.json, and tokenizer.json for text prompts and text output "
                 "(without it: token-id prompts only)"},
        {.kind = KC_FLAG_STRING, .name = "--nodes", .arg = "FILE", .dest = &o.nodes,
         .help = "static membership, JSON: {\"prefill\": [{\"id\": \"prefill-0\", \"address\": "
                 "\"127.0.0.1:7101\"}], \"decode\": [{\"id\": \"decode-0\", \"address\": \"127.0.0.1:7201\"}]}"},
        {.kind = KC_FLAG_STRING, .name = "--etcd", .arg = "ENDPOINTS", .dest = &o.etcd.endpoints,
         .help = "membership from etcd instead: \"127.0.0.1:2379,...\" (watches /kvrelay/CLUSTER/nodes/; "
                 "nodes come and go at run time)"},
        {.kind = KC_FLAG_STRING, .name = "--cluster", .arg = "NAME", .dest = &o.cluster, .def = "\"default\"",
         .help = "the etcd cluster name"},
        KC_FLAGS_ETCD(&o.etcd),
        KC_FLAGS_TLS(&o.tls),
        KC_FLAGS_TLS_CLIENT_AUTH(&o.tls),
        {.kind = KC_FLAG_STRING, .name = "--fingerprint", .arg = "HEX", .dest = &o.fingerprint,
         .def = "the first one a member reports",
         .help = "the model fingerprint members must report (etcd membership)"},
        {.kind = KC_FLAG_HOSTPORT, .name = "--listen", .arg = "HOST:PORT", .dest = &o.listen,
         .opts = KC_HOSTPORT_PORT_ZERO, .def = "127.0.0.1:7100", .help = "public gRPC address (port 0 = any free)"},
        {.kind = KC_FLAG_HOSTPORT, .name = "--http", .arg = "HOST:PORT", .dest = &o.http,
         .opts = KC_HOSTPORT_PORT_ZERO, .def = "127.0.0.1:9100",
         .help = "/metrics, /healthz and the OpenAI-compatible API under /v1/ (HTTPS with the --tls-cert pair)"},
        {.kind = KC_FLAG_STRING, .name = "--served-model-name", .arg = "N", .dest = &o.served_model_name,
         .def = "the base name of the model directory", .help = "the model's name in the OpenAI API"},
        {.kind = KC_FLAG_STRING, .name = "--id", .arg = "NAME", .dest = &o.id, .def = "router-0",
         .help = "this router's name in logs and ClusterStatus"},
        {.kind = KC_FLAG_STRING, .name = "--placement", .arg = "P", .dest = &o.placement, .def = "kv-aware",
         .help = "kv-aware (prefill nodes by queued prefill tokens + the prompt tokens each would compute, "
                 "given the prefix its cache is predicted to hold; docs/prefix-cache.md), least-loaded or "
                 "round-robin"},
        {.kind = KC_FLAG_INT64, .name = "--prefill-chunk", .arg = "C", .dest = &o.prefill_chunk, .min = 0,
         .max = 1 << 16, .def = "0",
         .help = "kv-aware placement cuts prompts into blocks of C tokens, as the prefill nodes' prefix "
                 "caches do; 0: the --chunk the first prefill node reports (a node with another one is "
                 "warned about: its hits are predicted less well)"},
        {.kind = KC_FLAG_INT64, .name = "--kv-index-blocks", .arg = "N", .dest = &o.kv_index_blocks, .min = 1,
         .max = 1 << 24, .def = "16384",
         .help = "kv-aware placement: prompt blocks remembered per prefill node (least recently used "
                 "forgotten first; about 28 bytes each)"},
        {.kind = KC_FLAG_INT64, .name = "--max-tokens-limit", .arg = "N", .dest = &o.max_tokens_limit, .min = 1,
         .max = 1 << 24, .def = "4096", .help = "largest max_tokens a request may ask for"},
        {.kind = KC_FLAG_INT64, .name = "--max-prompt-tokens", .alias = "--max-prompt", .arg = "N",
         .dest = &o.max_prompt, .min = 1, .max = 1 << 30, .def = "the model's max_position_embeddings - 1",
         .help = "longest prompt in tokens; longer ones are refused INVALID_ARGUMENT / HTTP 400"},
        {.kind = KC_FLAG_INT64, .name = "--max-request-bytes", .arg = "N", .dest = &o.max_request_bytes,
         .min = 1024, .max = 1L << 30, .def = "16 MiB and 4 MiB",
         .help = "largest gRPC request message and OpenAI API body; larger ones are refused "
                 "RESOURCE_EXHAUSTED / HTTP 413"},
        {.kind = KC_FLAG_INT64, .name = "--default-timeout-ms", .arg = "MS", .dest = &o.default_timeout_ms,
         .min = 1, .max = 86400000L, .def = "300000",
         .help = "deadline of a request whose client set none, and the cap on the deadlines clients set"},
        {.kind = KC_FLAG_INT64, .name = "--max-queue-ms", .arg = "MS", .dest = &o.max_queue_ms, .min = 0,
         .max = 86400000L, .def = "60000",
         .help = "longest wait for a node with room before a request is refused with RESOURCE_EXHAUSTED "
                 "(HTTP 429)"},
        {.kind = KC_FLAG_FUNC, .name = "--limit-concurrency", .arg = "N", .dest = &o.limits, .fn = flag_limit,
         .def = "0: no cap",
         .help = "streams in flight (queued included) per API key, or per client address without keys; "
                 "more are refused RESOURCE_EXHAUSTED / HTTP 429"},
        {.kind = KC_FLAG_FUNC, .name = "--limit-rate", .arg = "R[/s|/m]", .dest = &o.limits, .fn = flag_limit,
         .def = "0: no rate limit",
         .help = "requests per second (or per minute) per key or address, a token bucket"},
        {.kind = KC_FLAG_FUNC, .name = "--limit-burst", .arg = "B", .dest = &o.limits, .fn = flag_limit,
         .def = "the rate per second, at least 1",
         .help = "the bucket's size: requests at once after a quiet spell. A key in --api-key-file may "
                 "follow with its own: KEY concurrency=N rate=R burst=B"},
        {.kind = KC_FLAG_STRING, .name = "--policy-dir", .arg = "DIR", .dest = &o.policy_dir,
         .help = "where policy files (heads pattern=, hsft windows=) live: clients name them by bare file "
                 "name; without it such keys are refused (every node must see DIR at the same path)"},
        {.kind = KC_FLAG_STRING, .name = "--calibration", .arg = "FILE", .dest = &o.calibration,
         .def = "MODEL/calibration.json when there is one",
         .help = "the model's calibration table for kv_policy auto (docs/adaptive.md; kvrelay-eval "
                 "--calibrate-out makes one); without one auto is refused"},
        {.kind = KC_FLAG_STRING, .name = "--default-policy", .arg = "SPEC", .dest = &o.default_policy,
         .def = "full", .help = "the KV policy of a request that names none, e.g. auto:floor=0.95"},
        {.kind = KC_FLAG_STRING, .name = "--pressure", .arg = "LEVEL", .dest = &o.pressure,
         .def = "measured", .help = "pin kv_policy auto's pressure level to low, medium or high instead of "
                                    "measuring it from the decode pools and the admission queue"},
        {.kind = KC_FLAG_INT64, .name = "--breaker-failures", .arg = "N", .dest = &o.breaker_failures, .min = 1,
         .max = 1000, .def = "3",
         .help = "consecutive failed calls (UNAVAILABLE, DEADLINE_EXCEEDED) that make a node SUSPECT: "
                 "skipped until a probe answers"},
        {.kind = KC_FLAG_INT64, .name = "--breaker-cooldown-ms", .arg = "MS", .dest = &o.breaker_cooldown_ms,
         .min = 1, .max = 3600000L, .def = "2000",
         .help = "time before the half-open probe (one Status) of a suspect node"},
        {.kind = KC_FLAG_INT64, .name = "--prefill-timeout-ms", .arg = "MS", .dest = &o.prefill_timeout_ms,
         .min = 1, .max = 86400000L, .def = "60000",
         .help = "cap on one Prefill call: a node silent this long has failed and the request is retried "
                 "once elsewhere"},
        {.kind = KC_FLAG_INT64, .name = "--decode-stall-ms", .arg = "MS", .dest = &o.decode_stall_ms, .min = 1,
         .max = 86400000L, .def = "5000", .help = "a decode stream with no message this long has failed"},
        {.kind = KC_FLAG_BOOL, .name = "--migrate", .dest = &o.migrate,
         .help = "a failed decode stream continues on another decode node (re-prefill of the prompt and "
                 "the tokens sent) instead of failing"},
        {.kind = KC_FLAG_LIST, .name = "--api-key", .arg = "KEY", .dest = o.api_keys, .count = &o.n_api_keys,
         .max_count = 64,
         .help = "an API key clients must send as 'authorization: Bearer KEY' (repeatable, at most 64; "
                 "visible in ps: prefer the file or the variable)"},
        {.kind = KC_FLAG_LIST, .name = "--api-key-file", .arg = "FILE", .dest = o.api_key_files,
         .count = &o.n_api_key_files, .max_count = 64,
         .help = "API keys, one per line ('#' comments, blank lines skipped; repeatable). KVRELAY_API_KEY "
                 "in the environment adds one more. With no key the API is open; grpc.health.v1 always is"},
        KC_FLAG_CPU_SCHED(&o.cpu_sched),
        {.kind = KC_FLAG_FUNC, .name = "--log-level", .arg = "L", .dest = &o.log_level, .fn = kc_flag_log_level,
         .def = "info", .help = "debug, info, warn or error"},
        {.kind = KC_FLAG_END},
    };
    static const kc_flags flags = {
        .prog = "kvrelay-router",
        .usage = "--model DIR (--nodes FILE | --etcd ENDPOINTS) [options]",
        .about = "Serves the kvrelay gRPC API (kvrelay.v1.Generation, kvrelay.v1.Admin, grpc.health.v1)\n"
                 "and sends each request to a decode node and a prefill node of the membership file.",
        .table = table,
        .footer = "Prints \"router ID: serving grpc HOST:PORT http HOST:PORT\" once it serves; SIGINT or\n"
                  "SIGTERM stops it cleanly.",
    };
    o = (router_opts){.listen = {.text = "127.0.0.1:7100"}, .http = {.text = "127.0.0.1:9100"}, .id = "router-0",
                      .placement = "kv-aware", .prefill_chunk = 0, .kv_index_blocks = 16384,
                      .log_level = KC_LOG_INFO, .max_tokens_limit = 4096,
                      .max_prompt = -1, .default_timeout_ms = 300000, .max_queue_ms = 60000,
                      .cluster = "default", .breaker_failures = 3, .breaker_cooldown_ms = 2000,
                      .prefill_timeout_ms = 60000, .decode_stall_ms = 5000};
    kc_flags_main(&flags, argc, argv, 0);
    if (!o.model) die("--model DIR is required (see --help)");
    if (!o.nodes == !o.etcd.endpoints) die("give exactly one of --nodes FILE and --etcd ENDPOINTS (see --help)");
    char eerr[256];
    if (kc_etcd_flags_finish(&o.etcd, eerr) != 0) die("%s", eerr);
    if (kc_tls_flags_finish(&o.tls, KC_TLS_ROLE_ROUTER, eerr) != 0) die("%s", eerr);
    if (o.fingerprint && (strlen(o.fingerprint) != 16 || strspn(o.fingerprint, "0123456789abcdef") != 16))
        die("--fingerprint: '%s' is not 16 lower-case hex digits (the nodes log theirs at start-up)", o.fingerprint);
    size_t idlen = strlen(o.id);
    if (idlen == 0 || idlen > 63) die("--id: '%s' must be 1-63 characters", o.id);
    *out = o;
}

static void metrics_init(rt_router *rt)
{
    rt_metrics *m = &rt->m;
    m->reg = kc_registry_create();
    if (!m->reg) die("out of memory");
    for (int c = 0; c <= GRPC_STATUS_UNAUTHENTICATED; c++) {
        char label[64];
        snprintf(label, sizeof label, "status=\"%s\"", kc_status_name((grpc_status_code)c));
        m->requests[c] = kc_counter_add(m->reg, "kvrelay_requests_total",
                                        "Generate calls finished, by final gRPC status", label);
    }
    if (kr_policy_n_families() > RT_FAMILIES_MAX) die("more policy families than RT_FAMILIES_MAX");
    for (int f = 0; f < kr_policy_n_families(); f++) {
        char label[64];
        snprintf(label, sizeof label, "policy=\"%s\"", kr_policy_family_name(f));
        m->ttft[f] = kc_histogram_add(m->reg, "kvrelay_ttft_seconds",
                                      "Time to first token: request arrival at the router to the first token sent, "
                                      "by KV policy family", label, kc_latency_buckets, kc_n_latency_buckets);
        m->tpot[f] = kc_histogram_add(m->reg, "kvrelay_tpot_seconds",
                                      "Time per output token after the first, per request, by KV policy family", label,
                                      kc_latency_buckets, kc_n_latency_buckets);
        m->e2e[f] = kc_histogram_add(m->reg, "kvrelay_e2e_seconds",
                                     "Request arrival at the router to its last token sent, by KV policy family", label,
                                     kc_latency_buckets, kc_n_latency_buckets);
        m->queue_wait[f] = kc_histogram_add(m->reg, "kvrelay_queue_wait_seconds",
                                            "Time a finished request waited in the admission FIFO, by KV policy family",
                                            label, kc_latency_buckets, kc_n_latency_buckets);
        if (!m->ttft[f] || !m->tpot[f] || !m->e2e[f] || !m->queue_wait[f]) die("cannot register metrics");
    }
    m->prompt_tokens = kc_counter_add(m->reg, "kvrelay_prompt_tokens_total", "Prompt tokens of admitted requests", NULL);
    m->generated_tokens = kc_counter_add(m->reg, "kvrelay_tokens_generated_total",
                                         "Completion tokens sent to clients (the first token included)", NULL);
    m->kv_bytes_shipped = kc_counter_add(m->reg, "kvrelay_kv_bytes_shipped_total",
                                         "K and V payload bytes shipped prefill -> decode for this router's requests",
                                         NULL);
    m->in_flight = kc_gauge_add(m->reg, "kvrelay_requests_in_flight", "Generate calls being served", NULL);
    m->queued = kc_gauge_add(m->reg, "kvrelay_queue_depth",
                             "Generate calls waiting for a node with room (backing off)", NULL);
    m->retries = kc_counter_add(m->reg, "kvrelay_placement_retries_total",
                                "Requests placed again after a node failed before anything was streamed", NULL);
    for (int w = 0; w < RT_PLACED_REASONS; w++) {
        char label[64];
        snprintf(label, sizeof label, "reason=\"%s\"", rt_placed_names[w]);
        m->placements[w] = kc_counter_add(m->reg, "kvrelay_placements_total",
                                          "kv-aware prefill placements of prompts longer than a chunk, by why the first node came first",
                                          label);
        if (!m->placements[w]) die("cannot register metrics");
    }
    m->predicted_cached = kc_counter_add(m->reg, "kvrelay_placement_predicted_cached_tokens_total",
                                         "Prompt tokens kv-aware placement predicted cached on the prefill node that "
                                         "took the request",
                                         NULL);
    m->cached_tokens = kc_counter_add(m->reg, "kvrelay_prompt_tokens_cached_total",
                                      "Prompt tokens the prefill nodes took from their prefix caches", NULL);
    for (int c = 0; c <= GRPC_STATUS_UNAUTHENTICATED; c++)
        if (!m->requests[c]) die("cannot register metrics");
    if (!m->prompt_tokens || !m->generated_tokens || !m->kv_bytes_shipped || !m->predicted_cached ||
        !m->cached_tokens || !m->in_flight || !m->queued || !m->retries || rt_openai_metrics_init(rt) != 0 ||
        rt_limits_metrics_init(rt->limits, m->reg) != 0)
        die("cannot register metrics");
}

/* The OpenAI API's model id: --served-model-name, else the model directory's base name. */
static void served_model_init(rt_router *rt, const char *flag, const char *model_dir)
{
    if (flag) {
        if (!flag[0] || strlen(flag) >= sizeof rt->served_model)
            die("--served-model-name: '%s' must be 1-%zu bytes", flag, sizeof rt->served_model - 1);
        snprintf(rt->served_model, sizeof rt->served_model, "%s", flag);
        return;
    }
    size_t n = strlen(model_dir);
    while (n > 1 && model_dir[n - 1] == '/') n--; /* "models/x/" names x */
    size_t b = n;
    while (b > 0 && model_dir[b - 1] != '/') b--;
    snprintf(rt->served_model, sizeof rt->served_model, "%.*s", (int)(n - b), model_dir + b);
    if (!rt->served_model[0]) snprintf(rt->served_model, sizeof rt->served_model, "model");
}

static int64_t unix_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* kc_watch's callback: the whole membership from etcd, applied as the --nodes file's is. */
static void on_members(void *user, const kc_member *ms, int n)
{
    char err[KR_ERR_MAX];
    if (rt_nodes_apply(user, ms, n, err) != 0) kc_warn(NULL, "etcd membership: %s", err);
}

/* The model's config, its tokenizer and chat template when it has them: what the router checks
 * and tokenizes requests with (it holds no weights). */
static void load_model(rt_router *rt, const char *model)
{
    char err[KR_ERR_MAX];
    if (kr_config_load(model, &rt->cfg, err) != KR_OK) die("--model: %s", err);
    char path[1200];
    snprintf(path, sizeof path, "%s/tokenizer.json", model);
    if (access(path, F_OK) == 0) {
        if (kr_tokenizer_load(model, &rt->tok, err) != KR_OK) die("--model: %s", err);
        if (kr_tokenizer_n_vocab(rt->tok) > rt->cfg.vocab_size)
            die("--model: %s: the tokenizer has %d ids but config.json's vocab_size is %d", model,
                kr_tokenizer_n_vocab(rt->tok), rt->cfg.vocab_size);
    }
    if (rt->cfg.max_position_embeddings < 2)
        die("--model: %s/config.json: max_position_embeddings %d leaves no room to generate", model,
            rt->cfg.max_position_embeddings);
    if (!rt->tok) snprintf(rt->chat_error, sizeof rt->chat_error, "no tokenizer.json");
    else if (kr_chat_template_load(model, &rt->chat, rt->chat_error) != KR_OK)
        kc_warn(NULL, "chat completions are off: %s", rt->chat_error);
    else kc_info(NULL, "chat template: %s", kr_chat_template_source(rt->chat));
}

/* What the router serves and how, in the log before it says it serves. */
static void log_setup(rt_router *rt, const router_opts *o)
{
    int n_prefill = 0;
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < rt->n_nodes; i++) n_prefill += rt->nodes[i]->role == RT_ROLE_PREFILL;
    int n_decode = rt->n_nodes - n_prefill;
    pthread_mutex_unlock(&rt->mu);
    char kv[128] = "", chunk[48] = "as the prefill nodes report";
    if (rt->prefill_chunk_given) snprintf(chunk, sizeof chunk, "%d", rt->prefill_chunk_given);
    if (rt->placement == &rt_placement_kv_aware)
        snprintf(kv, sizeof kv, " (prefill chunk %s, %d blocks remembered per prefill node)", chunk,
                 rt->kv_index_blocks);
    kc_info(NULL, "model %s (%s, vocab %d, context %d, %s), %d prefill + %d decode nodes, placement %s%s%s", o->model,
            rt->cfg.arch_name, rt->cfg.vocab_size, rt->cfg.max_position_embeddings,
            rt->tok ? "tokenizer" : "no tokenizer: token-id prompts only", n_prefill, n_decode, rt->placement->name, kv,
            rt->migrate ? ", --migrate" : "");
    char keys_desc[160];
    rt_apikeys_describe(rt->keys, keys_desc, sizeof keys_desc);
    kc_info(NULL, "API keys: %s%s", keys_desc, rt->keys ? "" : ": the API is open to every client");
    static const char *const client_auth[] = {"none", "request", "require"};
    if (kc_tls_enabled(&o->tls))
        kc_info(NULL, "TLS: gRPC port with %s (client certificates: %s), HTTPS on the HTTP port, mutual TLS to the nodes (CA %s)",
                o->tls.cert_file, client_auth[o->tls.client_auth], o->tls.ca_file);
    else
        kc_info(NULL, "TLS: off: gRPC to clients and nodes and the HTTP port are plaintext (see --tls-cert)");
}

/* Ends the watcher and the poller (after the servers: nothing starts a request any more). */
static void stop_threads(rt_router *rt)
{
    pthread_mutex_lock(&rt->mu);
    rt->stopping = 1;
    pthread_cond_broadcast(&rt->cv);
    pthread_mutex_unlock(&rt->mu);
    pthread_join(rt->watcher, NULL);
    pthread_join(rt->poller, NULL);
}

/* What the router's state still holds once the nodes and every thread are gone. */
static void free_state(rt_router *rt)
{
    kc_registry_free(rt->m.reg);
    kr_tokenizer_free(rt->tok);
    kr_chat_template_free(rt->chat);
    rt_limits_free(rt->limits);
    pthread_cond_destroy(&rt->cv);
    pthread_cond_destroy(&rt->fifo_cv);
    pthread_mutex_destroy(&rt->mu);
}

int main(int argc, char **argv)
{
    router_opts o;
    parse(argc, argv, &o);
    kc_log_level level = o.log_level;
    const char *grpc_host = o.listen.host, *http_host = o.http.host;
    int http_port = o.http.port;

    static rt_router router; /* static: the handlers and threads reach it until exit */
    rt_router *rt = &router;
    snprintf(rt->id, sizeof rt->id, "%s", o.id);
    snprintf(rt->model_dir, sizeof rt->model_dir, "%s", o.model);
    rt->placement = rt_placement_by_name(o.placement);
    if (!rt->placement) die("--placement: '%s' is not kv-aware, least-loaded or round-robin", o.placement);
    rt->prefill_chunk_given = (int)o.prefill_chunk;
    atomic_init(&rt->prefill_chunk, (int)o.prefill_chunk);
    rt->kv_index_blocks = (int)o.kv_index_blocks;
    kc_log_init(rt->id, level);
    kc_cpu_sched_apply(o.cpu_sched);

    load_model(rt, o.model);
    char err[KR_ERR_MAX];
    rt_apikeys *api_keys; /* NULL: no key from any source, the API is open */
    if (rt_apikeys_load(o.api_keys, o.n_api_keys, o.api_key_files, o.n_api_key_files, getenv("KVRELAY_API_KEY"),
                        &api_keys, err, sizeof err) != 0)
        die("%s", err);
    rt->keys = api_keys;
    long ctx_room = rt->cfg.max_position_embeddings - 1;
    rt->policy_dir = o.policy_dir;
    rt->max_prompt = (uint32_t)(o.max_prompt > 0 && o.max_prompt < ctx_room ? o.max_prompt : ctx_room);
    rt->max_tokens_limit = (uint32_t)o.max_tokens_limit;
    rt->default_timeout_ms = o.default_timeout_ms;
    rt->max_queue_ms = o.max_queue_ms;
    rt->max_body = o.max_request_bytes ? (size_t)o.max_request_bytes : RT_OPENAI_MAX_BODY;
    rt->limits = rt_limits_create(&o.limits, 0);
    if (!rt->limits) die("out of memory");
    served_model_init(rt, o.served_model_name, o.model);
    rt->started_unix_ms = unix_ms();
    rt->breaker_failures = (int)o.breaker_failures;
    rt->breaker_cooldown_ms = o.breaker_cooldown_ms;
    rt->prefill_timeout_ms = o.prefill_timeout_ms;
    rt->decode_stall_ms = o.decode_stall_ms;
    rt->migrate = o.migrate;
    pthread_mutex_init(&rt->mu, NULL);
    pthread_cond_init(&rt->cv, NULL);
    pthread_cond_init(&rt->fifo_cv, NULL);

    if (o.fingerprint) snprintf(rt->fingerprint, sizeof rt->fingerprint, "%s", o.fingerprint);
    char aerr[2048];
    if (rt_auto_init(rt, o.calibration, o.default_policy, o.pressure, aerr, sizeof aerr) != 0) die("%s", aerr);
    kc_status st;
    grpc_init(); /* held until exit: the nodes' credentials are made before any channel or server */
    if (kc_tls_enabled(&o.tls) && !(rt->node_creds = kc_tls_channel_credentials(&o.tls, &st)))
        die("%s", st.details);
    kc_watch *watch = NULL;
    if (o.nodes) {
        kc_member *ms;
        int n_ms;
        char merr[KC_MEMBER_ERR_LEN];
        if (kc_members_file_load(o.nodes, &ms, &n_ms, merr) != 0) die("--nodes: %s", merr);
        if (rt_nodes_apply(rt, ms, n_ms, err) != 0) die("--nodes: %s", err);
        free(ms);
    } else {
        char werr[KC_MEMBER_ERR_LEN];
        if (kc_watch_start_cfg(&o.etcd, o.cluster, on_members, rt, &watch, werr) != 0)
            die("--etcd %s: %s", o.etcd.endpoints, werr);
    }
    metrics_init(rt);

    if (kc_signals_init() != 0) die("signal pipe: %s", strerror(errno));

    kc_server *srv;
    int bound;
    /* every call gets a server deadline, Tokenize and ClusterStatus included; a second after
     * --default-timeout-ms, so that a Generate's own deadline (rt_generate_run, the same flag)
     * fires first and its error says at which step the time ran out */
    const kc_server_config scfg = {.tls = &o.tls, .max_message_bytes = (size_t)o.max_request_bytes,
                                   .max_deadline_ms = o.default_timeout_ms + 1000};
    if (kc_server_create(o.listen.text, &scfg, &srv, &bound, &st) != 0)
        die("--listen %s: %s", o.listen.text, st.details);
    if (kc_server_add_stream(srv, "/kvrelay.v1.Generation/Generate", &kvrelay__v1__generate_request__descriptor,
                             rt_generate, rt) ||
        kc_server_add_unary(srv, "/kvrelay.v1.Generation/Tokenize", &kvrelay__v1__tokenize_request__descriptor,
                            rt_tokenize, rt) ||
        kc_server_add_unary(srv, "/kvrelay.v1.Admin/ClusterStatus",
                            &kvrelay__v1__cluster_status_request__descriptor, rt_cluster_status, rt))
        die("cannot register the gRPC methods");
    static rt_apikeys_grpc auth; /* static: the server's threads read it until exit */
    auth = (rt_apikeys_grpc){.keys = rt->keys, .generate_refused = rt->m.requests[GRPC_STATUS_UNAUTHENTICATED]};
    if (rt->keys && kc_server_set_auth(srv, rt_apikeys_grpc_auth, &auth) != 0) die("cannot install the API key check");
    static const char *const services[] = {"kvrelay.v1.Generation", "kvrelay.v1.Admin", NULL};
    kc_health *health = kc_health_register(srv, services);
    if (!health) die("cannot register grpc.health.v1");
    rt->health = health;
    char herr[256];
    int http_bound;
    kc_http_app openai = {.fn = rt_openai_serve, .user = rt, .max_body = rt->max_body,
                          .max_connections = RT_HTTP_MAX_CONNECTIONS};
    char *https_cert = NULL, *https_key = NULL; /* HTTPS with the gRPC port's pair; freed at exit */
    if (kc_tls_enabled(&o.tls)) {
        if (kc_tls_read_pair(&o.tls, &https_cert, &https_key, &st) != 0) die("%s", st.details);
        openai.tls_cert_pem = https_cert;
        openai.tls_key_pem = https_key;
    }
    kc_http *http = kc_http_start_app(http_host, http_port, rt->m.reg, rt_nodes_healthy, rt, &openai, &http_bound, herr);
    if (!http) die("--http %s: %s", o.http.text, herr);
    kc_hostport_format(grpc_host, bound, rt->grpc_address, sizeof rt->grpc_address);

    /* a first look at the nodes, so the log says at once which ones are missing */
    rt_nodes_refresh(rt, 1000);
    if (pthread_create(&rt->poller, NULL, rt_poller_main, rt) != 0 ||
        pthread_create(&rt->watcher, NULL, rt_watcher_main, rt) != 0)
        die("cannot start the router's threads");
    if (kc_server_start(srv, &st) != 0) die("cannot start the gRPC server: %s", st.details);
    log_setup(rt, &o);
    char http_address[KC_HOST_MAX + 8];
    kc_hostport_format(http_host, http_bound, http_address, sizeof http_address);
    printf("router %s: serving grpc %s http %s\n", rt->id, rt->grpc_address, http_address);
    fflush(stdout);

    int sig = kc_signals_wait();
    kc_info(NULL, "%s: shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    pthread_mutex_lock(&rt->mu);
    rt->draining = 1;
    pthread_mutex_unlock(&rt->mu);
    kc_health_set_serving(health, 0);
    kc_server_destroy(srv); /* cancels the calls in flight; the watcher cancels their streams */
    atomic_store(&rt->http_stopping, 1); /* and the OpenAI API's requests, which it watches too */
    while (atomic_load(&rt->http_generations) > 0) nanosleep(&(struct timespec){0, 10000000L}, NULL);
    stop_threads(rt);
    kc_watch_stop(watch); /* before the table goes: it calls into it */
    kc_health_free(health);
    kc_http_stop(http);
    free(https_cert);
    free(https_key);
    rt_nodes_free(rt);
    rt_auto_free(rt); /* no request is left to read it */
    if (rt->node_creds) grpc_channel_credentials_release(rt->node_creds); /* the channels are gone */
    grpc_shutdown();
    rt_apikeys_free(api_keys); /* the HTTP and gRPC servers that read it are gone */
    free_state(rt);
    kc_info(NULL, "stopped");
    return 0;
}
