/*
 * main.c - kvrelay-decode: the decode node of a kvrelay cluster (DESIGN.md section 2). It loads
 * the model, owns one KV block pool, receives KV bundles from prefill nodes over UCX into
 * reservations, and decodes every admitted sequence in one continuous batch, streaming tokens
 * to the router. This file: flags, start-up, the serving line, metrics registration, the etcd
 * registration (--etcd), and the drain then shutdown on SIGINT/SIGTERM. The rest: node.h.
 * Docs: docs/decode-node.md.
 * Run: kvrelay-decode --model DIR [--listen 127.0.0.1:7201] [--transfer 127.0.0.1:7202]
 *      [--http 127.0.0.1:7203] [--kv-blocks N | --kv-memory 1G] ...   (--help lists all)
 * Not here: TLS on its own gRPC, CUDA graphs; a node serves one model.
 */
#include "node.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpusched.h"
#include "flags.h"
#include "log.h"
#include "signals.h"

__attribute__((format(printf, 1, 2), noreturn)) static void die(const char *fmt, ...)
{
    va_list ap;
    fputs("kvrelay-decode: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(2);
}

/* The split --listen, --transfer and --http; parse() fills them. */
typedef struct dn_addrs {
    kc_hostport listen, transfer, http;
} dn_addrs;

static void parse(int argc, char **argv, dn_config *c, kc_log_level *level, dn_addrs *addrs)
{
    static dn_config cfg;
    static kc_log_level lvl;
    static dn_addrs a;
    static int drain_s, backend, cache_dtype;
    static const kc_flag_choice transfer_modes[] = {{"am", 0}, {"rma", 1}, {NULL, 0}};
    static const kc_flag_choice backends[] = {{"cpu", KR_BACKEND_CPU}, {"cuda", KR_BACKEND_CUDA}, {NULL, 0}};
    static const kc_flag_choice cache_dtypes[] = {{"auto", KR_KV_DTYPE_AUTO}, {"f32", KR_KV_DTYPE_F32},
                                                  {"bf16", KR_KV_DTYPE_BF16}, {"f16", KR_KV_DTYPE_F16},
                                                  {NULL, 0}};
    static const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &cfg.model_dir,
         .help = "Hugging Face model directory (required)"},
        {.kind = KC_FLAG_STRING, .name = "--id", .arg = "NAME", .dest = &cfg.id, .def = "decode-0",
         .help = "node id in logs, Status and metrics"},
        {.kind = KC_FLAG_HOSTPORT, .name = "--listen", .arg = "HOST:PORT", .dest = &a.listen,
         .opts = KC_HOSTPORT_PORT_ZERO, .def = "127.0.0.1:7201", .help = "gRPC address (port 0: any free)"},
        {.kind = KC_FLAG_HOSTPORT, .name = "--transfer", .arg = "HOST:PORT", .dest = &a.transfer,
         .opts = KC_HOSTPORT_PORT_ZERO, .def = "127.0.0.1:7202", .help = "UCX listener for KV bundles"},
        {.kind = KC_FLAG_STRING, .name = "--advertise", .arg = "HOST", .dest = &cfg.advertise,
         .def = "the --transfer host",
         .help = "host put in transfer_address (required when the --transfer host is 0.0.0.0)"},
        {.kind = KC_FLAG_HOSTPORT, .name = "--http", .arg = "HOST:PORT", .dest = &a.http,
         .opts = KC_HOSTPORT_PORT_ZERO, .def = "127.0.0.1:7203", .help = "/metrics and /healthz"},
        {.kind = KC_FLAG_INT64, .name = "--kv-blocks", .arg = "N", .dest = &cfg.kv_blocks, .min = 1,
         .max = INT_MAX, .help = "KV pool size in blocks"},
        {.kind = KC_FLAG_FUNC, .name = "--kv-memory", .arg = "SIZE", .dest = &cfg.kv_memory, .fn = kc_flag_bytes_positive,
         .def = "1G", .help = "KV pool size in bytes, K/M/G suffixes; ignored with --kv-blocks"},
        {.kind = KC_FLAG_CHOICE, .name = "--kv-cache-dtype", .arg = "T", .dest = &cache_dtype,
         .choices = cache_dtypes, .def = "auto",
         .help = "the KV pool's dtype: auto (the weights' dtype; f32 on the CUDA backend), f32, bf16 or f16; "
                 "bundles in another dtype are converted on arrival"},
        {.kind = KC_FLAG_INT, .name = "--block-size", .arg = "N", .dest = &cfg.block_size, .min = 1, .max = 4096,
         .def = "16", .help = "entries per KV block"},
        {.kind = KC_FLAG_INT, .name = "--threads", .arg = "N", .dest = &cfg.threads, .min = 1, .max = 1024,
         .def = "all online CPUs", .help = "compute threads"},
        {.kind = KC_FLAG_INT, .name = "--max-batch", .arg = "N", .dest = &cfg.max_batch, .min = 1, .max = 4096,
         .def = "32",
         .help = "most sequences per batched forward call (more running sequences take several calls per step)"},
        {.kind = KC_FLAG_INT, .name = "--reservation-ttl-ms", .arg = "MS", .dest = &cfg.ttl_ms, .min = 1,
         .max = DN_MAX_TTL_MS, .def = "30000", .help = "expiry of a reservation whose Reserve gave no ttl_ms"},
        {.kind = KC_FLAG_INT, .name = "--drain-timeout-s", .arg = "S", .dest = &drain_s, .min = 0, .max = 86400,
         .def = "30",
         .help = "on SIGTERM/SIGINT the node drains: no new reservations, existing ones are decoded to their "
                 "end; after S seconds what still runs ends UNAVAILABLE. A second signal stops at once"},
        KC_FLAGS_NODE("decode", &cfg.etcd.endpoints, &cfg.cluster, &cfg.lease_ttl_s, &cfg.etcd, &cfg.tls),
        {.kind = KC_FLAG_CHOICE, .name = "--backend", .arg = "cpu|cuda", .dest = &backend, .choices = backends,
         .def = "cpu", .help = "compute backend"},
        KC_FLAG_CPU_SCHED(&cfg.cpu_sched),
        {.kind = KC_FLAG_CHOICE, .name = "--transfer-mode", .arg = "am|rma", .dest = &cfg.rma,
         .choices = transfer_modes, .def = "am",
         .help = "how bundles arrive: am (active messages: UCX's rendezvous reads each part into a "
                 "buffer of its size) or rma (each reservation maps a buffer of its bound and the "
                 "prefill node writes into it: one-sided RDMA where the fabric has it)"},
        {.kind = KC_FLAG_FUNC, .name = "--log-level", .arg = "LEVEL", .dest = &lvl, .fn = kc_flag_log_level,
         .def = "info", .help = "debug, info, warn, error"},
        {.kind = KC_FLAG_END},
    };
    char footer[512];
    snprintf(footer, sizeof footer, "%s\n\n%s", kr_cpu_isa_help(),
             "example: kvrelay-decode --model build/models/default --listen 127.0.0.1:0 \\\n"
             "             --transfer 127.0.0.1:0 --http 127.0.0.1:0 --kv-memory 256M");
    const kc_flags flags = {
        .prog = "kvrelay-decode",
        .usage = "--model DIR [options]",
        .about = "The decode node of a kvrelay cluster: reserves KV blocks for requests, receives\n"
                 "their compressed KV cache from prefill nodes over UCX, and decodes all admitted\n"
                 "sequences in one continuous batch, streaming tokens over gRPC (kvrelay.v1.Decode).\n"
                 "Prints one line 'decode ID: serving grpc HOST:PORT http HOST:PORT' once serving.",
        .table = table,
        .footer = footer,
    };
    cfg = (dn_config){.id = "decode-0",
                      .kv_memory = (int64_t)1 << 30,
                      .block_size = 16,
                      .max_batch = 32,
                      .ttl_ms = 30000,
                      .cluster = "default",
                      .lease_ttl_s = 10};
    a = (dn_addrs){.listen = {.text = "127.0.0.1:7201"}, .transfer = {.text = "127.0.0.1:7202"},
                   .http = {.text = "127.0.0.1:7203"}};
    drain_s = 30;
    backend = KR_BACKEND_CPU;
    cache_dtype = KR_KV_DTYPE_AUTO;
    lvl = KC_LOG_INFO;
    kc_flags_main(&flags, argc, argv, 0);
    cfg.listen = a.listen.text;
    cfg.transfer = a.transfer.text;
    cfg.http = a.http.text;
    cfg.drain_timeout_s = drain_s;
    cfg.backend = (kr_backend_kind)backend;
    cfg.cache_dtype = (kr_kv_dtype)cache_dtype;
    *c = cfg;
    *level = lvl;
    *addrs = a;
    if (!c->model_dir)
        die("--model DIR is required (see --help)");
    if (!c->id[0] || strlen(c->id) > 64)
        die("--id: '%s' must be 1 to 64 characters", c->id);
    char eerr[256];
    if (kc_etcd_flags_finish(&c->etcd, eerr) != 0)
        die("%s", eerr);
    if (kc_tls_flags_finish(&c->tls, KC_TLS_ROLE_NODE, eerr) != 0)
        die("%s", eerr);
    if (c->etcd.endpoints) { /* what registration would refuse later, refused before start-up */
        if (!kc_name_ok(c->cluster, 100))
            die("--cluster: '%s' is not 1 to 100 of [A-Za-z0-9._-]", c->cluster);
        if (!kc_name_ok(c->id, 63))
            die("--id: '%s' is not 1 to 63 of [A-Za-z0-9._-] (it is an etcd key segment)", c->id);
    }
}

/* The transport's log lines through this program's logger (its levels are the logger's). */
static void transport_log(void *arg, kt_log_level level, const char *request_id, const char *line)
{
    (void)arg;
    KC_LOG_AT((kc_log_level)level, request_id, "transport: %s", line);
}

/* What this node puts in etcd (membership.h). */
static void member(const dn_node *n, const char *state, kc_member *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->id, sizeof m->id, "%s", n->cfg.id);
    snprintf(m->role, sizeof m->role, "decode");
    snprintf(m->state, sizeof m->state, "%s", state);
    snprintf(m->grpc, sizeof m->grpc, "%s", n->grpc_addr);
    snprintf(m->transfer, sizeof m->transfer, "%s", n->transfer_addr);
    snprintf(m->fingerprint, sizeof m->fingerprint, "%s", n->fingerprint);
    m->kv_capacity = (uint64_t)n->total_blocks;
    snprintf(m->version, sizeof m->version, "%s", KVRELAY_VERSION);
    m->start_unix_ms = n->since_unix_ms;
}

/* ------------------------------------------------------------------ metrics */

static const double batch_buckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};

static int metrics_init(dn_metrics *m)
{
    kc_registry *r = m->reg = kc_registry_create();
    if (!r)
        return -1;
    /* Names and meanings: docs/observability.md (the naming standard). */
    m->blocks_used = kc_gauge_add(r, "kvrelay_kv_blocks_used", "KV pool blocks held by sequences",
                                  NULL);
    m->blocks_free = kc_gauge_add(r, "kvrelay_kv_blocks_free",
                                  "KV pool blocks free (including reserved ones not yet used)",
                                  NULL);
    m->blocks_reserved = kc_gauge_add(r, "kvrelay_kv_blocks_reserved",
                                      "KV blocks promised to reservations and not yet used", NULL);
    m->running = kc_gauge_add(r, "kvrelay_running_sequences", "Sequences in the decode batch",
                              NULL);
    m->queued = kc_gauge_add(r, "kvrelay_queue_depth",
                             "Decode calls handed to the batching loop, not yet in the batch",
                             NULL);
    m->reservations = kc_gauge_add(r, "kvrelay_decode_reservations",
                                   "Live reservations (waiting, ready, decoding, failed)", NULL);
    m->batch_size = kc_histogram_add(r, "kvrelay_batch_size",
                                     "Sequences per batched forward call", NULL, batch_buckets,
                                     (int)(sizeof batch_buckets / sizeof batch_buckets[0]));
    m->tpot = kc_histogram_add(r, "kvrelay_tpot_seconds",
                               "Mean seconds per output token after the first, per request", NULL,
                               kc_latency_buckets, kc_n_latency_buckets);
    m->step_s = kc_histogram_add(r, "kvrelay_decode_step_seconds",
                                 "Seconds per batched forward call (one token for each sequence in it)", NULL,
                                 kc_latency_buckets, kc_n_latency_buckets);
    m->mask_s = kc_histogram_add(r, "kvrelay_decode_grammar_mask_seconds",
                                 "Seconds per structured-output mask: one sequence's allowed "
                                 "tokens computed and its logits row masked (one observation per "
                                 "masked row)", NULL, kc_latency_buckets, kc_n_latency_buckets);
    if (kr_policy_n_families() > DN_FAMILIES_MAX) return -1;
    for (int f = 0; f < kr_policy_n_families(); f++) {
        char label[64];
        snprintf(label, sizeof label, "policy=\"%s\"", kr_policy_family_name(f));
        m->blocks_by_policy[f] = kc_gauge_add(r, "kvrelay_kv_blocks_used_by_policy",
                                              "KV pool blocks held by running sequences, by KV policy family", label);
        if (!m->blocks_by_policy[f]) return -1;
    }
    m->import_s = kc_histogram_add(r, "kvrelay_decode_import_seconds",
                                   "Seconds spent bringing a KV bundle's parts into the pool as they arrived (copying "
                                   "rows, or adopting the blocks they were received into), summed over its parts",
                                   NULL,
                                   kc_latency_buckets, kc_n_latency_buckets);
    m->tokens = kc_counter_add(r, "kvrelay_tokens_generated_total",
                               "Completion tokens sampled by the batching loop (the first is the prefill node's)",
                               NULL);
    m->expired = kc_counter_add(r, "kvrelay_decode_reservations_expired_total",
                                "Reservations that expired unused and returned their blocks", NULL);
    m->parts_in_blocks = kc_counter_add(r, "kvrelay_decode_bundle_parts_total",
                                        "KV bundle parts imported, by how their rows reached the KV blocks: "
                                        "received or put into them, or copied from a part buffer",
                                        "landing=\"received\"");
    m->parts_copied = kc_counter_add(r, "kvrelay_decode_bundle_parts_total",
                                     "KV bundle parts imported, by how their rows reached the KV blocks: "
                                     "received or put into them, or copied from a part buffer",
                                     "landing=\"copied\"");
    if (!m->blocks_used || !m->blocks_reserved || !m->blocks_free ||
        !m->running || !m->queued || !m->reservations || !m->batch_size || !m->tpot ||
        !m->import_s || !m->tokens || !m->expired || !m->step_s || !m->mask_s ||
        !m->parts_in_blocks || !m->parts_copied)
        return -1;
    for (int code = 0; code <= GRPC_STATUS_UNAUTHENTICATED; code++) {
        char label[64];
        snprintf(label, sizeof label, "status=\"%s\"", kc_status_name((grpc_status_code)code));
        m->requests[code] = kc_counter_add(r, "kvrelay_requests_total",
                                           "Decode streams by final gRPC status", label);
        m->reserves[code] = kc_counter_add(r, "kvrelay_decode_reserves_total",
                                           "Reserve calls by gRPC status", label);
        if (!m->requests[code] || !m->reserves[code])
            return -1;
    }
    return 0;
}

static int healthy(void *user, char *reason, size_t cap)
{
    dn_node *n = user;
    pthread_mutex_lock(&n->lock);
    int stopping = n->stopping, draining = n->draining, alive = n->loop_alive;
    pthread_mutex_unlock(&n->lock);
    if (stopping || draining)
        snprintf(reason, cap, stopping ? "shutting down" : "draining");
    else if (!alive)
        snprintf(reason, cap, "the batching loop has stopped");
    return !stopping && !draining && alive;
}

/* The drain is over when no reservation is left but failed ones' tombstones: every Decode
 * stream has ended, and unused reservations were released or expired. */
static int drained(void *user)
{
    dn_node *n = user;
    int live = 0;
    pthread_mutex_lock(&n->lock);
    for (dn_resv *r = n->resvs; r; r = r->next)
        live += r->state != DN_RESV_FAILED;
    int running = n->n_running;
    pthread_mutex_unlock(&n->lock);
    return live == 0 && running == 0;
}

/* SIGTERM/SIGINT: stop taking reservations, let the ones made be decoded, then stop. */
static void drain(dn_node *n, int sig)
{
    pthread_mutex_lock(&n->lock);
    n->draining = 1;
    int live = n->n_resvs, running = n->n_running;
    pthread_mutex_unlock(&n->lock);
    kc_health_set_serving(n->health, 0);
    if (n->registration) {
        kc_member m;
        member(n, "draining", &m);
        if (kc_register_update(n->registration, &m) != 0)
            kc_warn(NULL, "etcd: state 'draining' not written yet (retried in the background)");
    }
    kc_info(NULL, "%s: draining: new reservations refused; %d reservations and %d running "
            "sequences may finish (at most %.0f s; another signal stops at once)",
            sig == SIGINT ? "SIGINT" : "SIGTERM", live, running, n->cfg.drain_timeout_s);
    double t0 = dn_now();
    kc_drain_end end = kc_signals_drain(drained, n, n->cfg.drain_timeout_s);
    pthread_mutex_lock(&n->lock);
    live = n->n_resvs;
    running = n->n_running;
    pthread_mutex_unlock(&n->lock);
    if (end == KC_DRAIN_DONE)
        kc_info(NULL, "drained in %.1f s: shutting down", dn_now() - t0);
    else
        kc_warn(NULL, "%s after %.1f s: shutting down with %d reservations and %d running "
                "sequences (their streams end UNAVAILABLE)",
                end == KC_DRAIN_SIGNAL ? "second stop signal" : "drain timeout",
                dn_now() - t0, live, running);
}

/* ------------------------------------------------------------------ main */

int main(int argc, char **argv)
{
    dn_node node, *n = &node;
    memset(n, 0, sizeof *n);
    int rc = 0;
    kc_log_level level;
    dn_addrs addrs;
    parse(argc, argv, &n->cfg, &level, &addrs);
    const dn_config *c = &n->cfg;
    kc_log_init(c->id, level);
    kc_cpu_sched_apply(c->cpu_sched);

    if (kc_signals_init() != 0)
        die("signal pipe: %s", strerror(errno));

    const char *thost = addrs.transfer.host, *hhost = addrs.http.host, *ghost = addrs.listen.host;
    int hport = addrs.http.port, gport;
    const char *adv = c->advertise ? c->advertise : thost;
    if (c->etcd.endpoints && !c->advertise && !strcmp(ghost, "0.0.0.0"))
        die("--listen %s listens on every interface: give --advertise HOST, the address the "
            "router reaches this node at (it is registered in etcd)", c->listen);
    /* the addresses this node reports (dn_node's *_addr) hold hosts of up to 127 characters */
    const char *hosts[][2] = {{"--transfer", thost}, {"--http", hhost}, {"--listen", ghost}, {"--advertise", adv}};
    for (int k = 0; k < 4; k++)
        if (strlen(hosts[k][1]) > 127)
            die("%s: the host '%s' is longer than 127 characters", hosts[k][0], hosts[k][1]);
    if (!strcmp(adv, "0.0.0.0"))
        die("--transfer %s listens on every interface: give --advertise HOST, the address "
            "prefill nodes reach this node at", c->transfer);

    char err[KT_ERR_MAX > KR_ERR_MAX ? KT_ERR_MAX : KR_ERR_MAX];
    kr_model_opts mo = {.verbose = 1};
    if (kr_model_load(c->model_dir, &mo, &n->model, err) != KR_OK) {
        kc_error(NULL, "loading the model: %s", err);
        return 1;
    }
    n->mcfg = kr_model_config(n->model);
    snprintf(n->fingerprint, sizeof n->fingerprint, "%s", kr_model_fingerprint(n->model));
    n->zero_logits = calloc((size_t)n->mcfg->vocab_size, sizeof *n->zero_logits);
    if (kr_grammar_vocab_load(c->model_dir, n->mcfg->eos_token_id, &n->gvocab, n->gvocab_err) != 0)
        kc_info(NULL, "no structured output (response_format is refused): %s", n->gvocab_err);
    kr_ctx_params cp = {.backend = c->backend, .n_threads = c->threads,
                        .max_chunk = c->max_batch, .kv_dtype = c->cache_dtype};
    if (!n->zero_logits || kr_ctx_create(n->model, &cp, &n->ctx, err) != KR_OK) {
        kc_error(NULL, "%s", n->zero_logits ? err : "out of memory");
        return 1;
    }
    /* a block: K and V rows in the cache's dtype (the weights' by default), and positions */
    const kr_dtype kv_dtype = kr_ctx_kv_dtype(n->ctx);
    int64_t block_bytes = (int64_t)c->block_size *
                          ((int64_t)n->mcfg->head_dim * 2 * (int64_t)kr_dtype_size(kv_dtype) + 4);
    int64_t blocks = c->kv_blocks ? c->kv_blocks : c->kv_memory / block_bytes;
    if (blocks < 1 || blocks > INT_MAX)
        die("--kv-memory %" PRId64 " bytes gives %" PRId64 " blocks of %" PRId64 " bytes: give "
            "between 1 and %d blocks", c->kv_memory, blocks, block_bytes, INT_MAX);
    if (kr_ctx_kv_pool_create(n->ctx, c->block_size, (int)blocks, &n->pool, err) != KR_OK) {
        kc_error(NULL, "%s", err);
        return 1;
    }
    n->total_blocks = blocks;
    kc_info(NULL, "model %s (fingerprint %s): %d layers x %d KV heads x %d dims; KV pool %" PRId64
            " blocks of %d entries in %s (%.1f MiB); %d threads (%s), batches of up to %d",
            c->model_dir, n->fingerprint, n->mcfg->n_layers, n->mcfg->n_kv_heads,
            n->mcfg->head_dim, blocks, c->block_size, kr_dtype_name(kv_dtype),
            (double)(blocks * block_bytes) / 1048576.0, kr_ctx_n_threads(n->ctx),
            c->backend == KR_BACKEND_CPU ? kr_cpu_isa() : "cuda", c->max_batch);

    pthread_mutex_init(&n->lock, NULL);
    pthread_cond_init(&n->cond, NULL);
    if (metrics_init(&n->m) != 0) {
        kc_error(NULL, "cannot register the metrics (out of memory)");
        return 1;
    }
    dn_publish_locked(n); /* no other thread yet */

    kt_transport_config tc = {.mode = c->rma ? KT_TRANSPORT_MODE_RMA : KT_TRANSPORT_MODE_AM,
                              .listen_host = thost,
                              .listen_port = (uint16_t)addrs.transfer.port, .name = c->id,
                              .log = transport_log};
    if (kt_transport_create(&tc, &n->transport, err) != 0) {
        kc_error(NULL, "--transfer %s: %s", c->transfer, err);
        return 1;
    }
    kc_hostport_format(adv, kt_transport_port(n->transport), n->transfer_addr, sizeof n->transfer_addr);
    if (c->rma)
        kc_info(NULL, "transfer mode rma: each reservation maps a buffer of its bound for the "
                "prefill node's puts (docs/transport.md, \"RMA mode\")");

    /* the HTTP port before any thread starts: a port another process holds ends start-up here,
     * with nothing running to unwind */
    n->http = kc_http_start(hhost, hport, n->m.reg, healthy, n, &hport, err);
    if (!n->http) {
        kc_error(NULL, "--http %s: %s", c->http, err);
        return 1;
    }
    kc_hostport_format(hhost, hport, n->http_addr, sizeof n->http_addr);

    kc_status st;
    const kc_server_config scfg = {.tls = &c->tls};
    if (kc_server_create(c->listen, &scfg, &n->server, &gport, &st) != 0) {
        kc_error(NULL, "--listen %s: %s", c->listen, st.details);
        return 1;
    }
    kc_hostport_format(c->advertise ? c->advertise : ghost, gport, n->grpc_addr, sizeof n->grpc_addr);
    if (dn_service_register(n, err) != 0 || dn_loop_start(n, err) != 0) {
        kc_error(NULL, "%s", err);
        return 1;
    }
    if (kc_server_start(n->server, &st) != 0) {
        kc_error(NULL, "starting gRPC: %s", st.details);
        return 1;
    }
    n->since_unix_ms = dn_unix_ms();
    if (c->etcd.endpoints) {
        kc_member m;
        member(n, "serving", &m);
        char rerr[KC_MEMBER_ERR_LEN];
        if (kc_register_start_cfg(&c->etcd, c->cluster, &m, c->lease_ttl_s, &n->registration,
                                  rerr) != 0) {
            kc_error(NULL, "--etcd %s: %s", c->etcd.endpoints, rerr);
            rc = 2;
            goto stop; /* the loop and the gRPC server run: stop them as a shutdown does */
        }
        kc_info(NULL, "registering in etcd %s as /kvrelay/%s/nodes/decode/%s (lease %d s)",
                c->etcd.endpoints, c->cluster, c->id, c->lease_ttl_s);
    }
    kc_info(NULL, "serving kvrelay.v1.Decode on %s, KV bundles on %s, metrics on http://%s",
            n->grpc_addr, n->transfer_addr, n->http_addr);
    printf("decode %s: serving grpc %s http %s\n", c->id, n->grpc_addr, n->http_addr);
    fflush(stdout);

    drain(n, kc_signals_wait());
stop:
    dn_loop_stop(n); /* ends every stream left (UNAVAILABLE) and frees their sequences */
    kc_register_stop(n->registration); /* revokes the lease: the key goes at once */
    kc_server_destroy(n->server); /* waits for every handler */
    dn_resv_release_all(n);
    kt_transport_destroy(n->transport);
    kc_http_stop(n->http);
    kc_health_free(n->health);
    kc_registry_free(n->m.reg);
    kr_ctx_free(n->ctx);
    kr_kv_pool_free(n->pool);
    kr_model_free(n->model);
    kr_grammar_vocab_free(n->gvocab);
    free(n->zero_logits);
    pthread_cond_destroy(&n->cond);
    pthread_mutex_destroy(&n->lock);
    kc_info(NULL, "stopped");
    return rc;
}
