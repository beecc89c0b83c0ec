/*
 * kvrelay-prefill - the prefill node (DESIGN.md section 2, docs/prefill-node.md): loads a
 * model, serves Prefill.Prefill (chunked prefill with the request's KV policy, the first token,
 * the compressed KV shipped over UCX to the decode node's reservation, usage back) and
 * Prefill.Status over gRPC, grpc.health.v1, and /metrics + /healthz over HTTP.
 * Prints "prefill ID: serving grpc HOST:PORT http HOST:PORT" once it serves; registers in etcd
 * with --etcd; SIGINT or SIGTERM drain it (new calls refused, queued ones run) and stop it
 * cleanly (exit 0). Run: kvrelay-prefill --model DIR --listen 127.0.0.1:0 --http
 * 127.0.0.1:0. Test: ctest -R test_prefill_node.
 */
#include "prefill.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bundle-rule.h"
#include "cpusched.h"
#include "flags.h"
#include "health.h"
#include "http.h"
#include "log.h"
#include "signals.h"

#define PF_DEFAULT_MAX_PROMPT 8192

#define PF_STR_(x) #x
#define PF_STR(x) PF_STR_(x)

static void die(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));

static void die(int status, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "kvrelay-prefill: ");
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

/* Flags that depend on the model are -1 until the model is loaded. */
static void parse_flags(int argc, char **argv, pf_config *c, kc_log_level *level)
{
    static pf_config cfg;
    static kc_log_level lvl;
    static kc_hostport listen, http;
    static int kv_dtype, cache_dtype, backend, pipeline;
    static const kc_flag_choice dtypes[] = {
        {"auto", PF_WIRE_AUTO}, {"f32", KT_DTYPE_F32}, {"bf16", KT_DTYPE_BF16}, {"f16", KT_DTYPE_F16},
        {"int8", KT_DTYPE_INT8_TOKEN}, {"fp8", KT_DTYPE_FP8_E4M3_TOKEN}, {NULL, 0}};
    static const kc_flag_choice cache_dtypes[] = {{"auto", KR_KV_DTYPE_AUTO}, {"f32", KR_KV_DTYPE_F32},
                                                  {"bf16", KR_KV_DTYPE_BF16}, {"f16", KR_KV_DTYPE_F16},
                                                  {NULL, 0}};
    static const kc_flag_choice backends[] = {{"cpu", KR_BACKEND_CPU}, {"cuda", KR_BACKEND_CUDA}, {NULL, 0}};
    static const kc_flag_choice on_off[] = {{"on", 1}, {"off", 0}, {NULL, 0}};
    static const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &cfg.model_dir,
         .help = "Hugging Face model directory (config.json, safetensors)"},
        {.kind = KC_FLAG_HOSTPORT, .name = "--listen", .arg = "HOST:PORT", .dest = &listen,
         .opts = KC_HOSTPORT_PORT_ZERO | KC_HOSTPORT_EMPTY_HOST, .def = "127.0.0.1:7101",
         .help = "gRPC address (port 0: any free)"},
        {.kind = KC_FLAG_HOSTPORT, .name = "--http", .arg = "HOST:PORT", .dest = &http,
         .opts = KC_HOSTPORT_PORT_ZERO, .def = "127.0.0.1:9101", .help = "/metrics and /healthz"},
        {.kind = KC_FLAG_STRING, .name = "--id", .arg = "NAME", .dest = &cfg.id, .def = "prefill-0",
         .help = "node id in logs, usage and Status"},
        {.kind = KC_FLAG_INT, .name = "--threads", .arg = "N", .dest = &cfg.threads, .min = 1, .max = 1024,
         .def = "all online CPUs", .help = "engine threads"},
        {.kind = KC_FLAG_INT, .name = "--chunk", .arg = "C", .dest = &cfg.chunk, .min = 1, .max = 1 << 16,
         .def = "512", .help = "prefill chunk size in tokens"},
        {.kind = KC_FLAG_INT, .name = "--queue", .arg = "N", .dest = &cfg.queue, .min = 0, .max = 1 << 20,
         .def = "64; 0: none wait",
         .help = "requests that may wait behind the running one; more are refused with RESOURCE_EXHAUSTED"},
        {.kind = KC_FLAG_CHOICE, .name = "--kv-dtype", .arg = "T", .dest = &kv_dtype, .choices = dtypes,
         .def = "auto",
         .help = "bundle payload when the request names none (kv_wire_dtype): auto (the KV cache's dtype: "
                 "the rows as cached, bit-exact decode at the fewest bytes), f32, bf16, f16, int8 or fp8 "
                 "(a scale per K and V row; docs/bundle.md)"},
        {.kind = KC_FLAG_CHOICE, .name = "--kv-cache-dtype", .arg = "T", .dest = &cache_dtype,
         .choices = cache_dtypes, .def = "auto",
         .help = "this node's KV cache: auto (the weights' dtype; f32 on the CUDA backend), f32, bf16 or f16"},
        {.kind = KC_FLAG_CHOICE, .name = "--pipeline", .arg = "on|off", .dest = &pipeline, .choices = on_off,
         .def = "on",
         .help = "layer-wise pipelining of the transfer: each layer's kept KV is sent as soon as the "
                 "last chunk has made it final, while the later layers still compute (docs/prefill-node.md); "
                 "off: one bundle after the whole prefill"},
        {.kind = KC_FLAG_INT, .name = "--max-prompt", .arg = "N", .dest = &cfg.max_prompt, .min = 1,
         .max = INT32_MAX - 1, .def = PF_STR(PF_DEFAULT_MAX_PROMPT) ", at most the model's max_position_embeddings - 1",
         .help = "longest prompt in tokens"},
        {.kind = KC_FLAG_INT, .name = "--kv-blocks", .arg = "N", .dest = &cfg.kv_blocks, .min = 1, .max = INT32_MAX,
         .def = "what a --max-prompt prompt needs under the full policy, plus one per list",
         .help = "KV pool blocks of " PF_STR(PF_BLOCK_SIZE) " entries"},
        {.kind = KC_FLAG_FUNC, .name = "--prefix-cache-memory", .arg = "SIZE", .dest = &cfg.prefix_cache_bytes,
         .fn = kc_flag_bytes, .def = "the KV pool's bytes (--kv-blocks)",
         .help = "memory of the prefix cache (docs/prefix-cache.md): prefill states kept at chunk "
                 "boundaries, which later prompts beginning with the same tokens continue from; "
                 "least recently used states are evicted for room; 0 turns it off"},
        {.kind = KC_FLAG_DOUBLE, .name = "--transfer-timeout-s", .arg = "S", .dest = &cfg.transfer_timeout_s,
         .dmin = 0.001, .dmax = 86400, .def = "30",
         .help = "cap on one bundle send (the call's deadline caps it too)"},
        {.kind = KC_FLAG_DOUBLE, .name = "--drain-timeout-s", .arg = "S", .dest = &cfg.drain_timeout_s, .dmin = 0,
         .dmax = 86400, .def = "30",
         .help = "on SIGTERM/SIGINT new Prefill calls are refused and the queued and running ones finish; "
                 "after S seconds those left end UNAVAILABLE. A second signal stops at once"},
        {.kind = KC_FLAG_STRING, .name = "--advertise", .arg = "HOST", .dest = &cfg.advertise,
         .def = "the --listen host",
         .help = "host registered in etcd (required with --etcd when the --listen host is 0.0.0.0)"},
        KC_FLAGS_NODE("prefill", &cfg.etcd.endpoints, &cfg.cluster, &cfg.lease_ttl_s, &cfg.etcd, &cfg.tls),
        {.kind = KC_FLAG_CHOICE, .name = "--backend", .arg = "B", .dest = &backend, .choices = backends,
         .def = "cpu", .help = "cpu or cuda"},
        KC_FLAG_CPU_SCHED(&cfg.cpu_sched),
        {.kind = KC_FLAG_FUNC, .name = "--log-level", .arg = "L", .dest = &lvl, .fn = kc_flag_log_level,
         .def = "info", .help = "debug, info, warn, error"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags = {
        .prog = "kvrelay-prefill",
        .usage = "--model DIR [options]",
        .about = "The prefill node: runs chunked prefill with the request's KV policy, samples the\n"
                 "first token, ships the compressed KV cache to the decode node's reservation over\n"
                 "UCX and answers the router with the first token and usage (docs/prefill-node.md).",
        .table = table,
        .footer = kr_cpu_isa_help(),
    };
    cfg = (pf_config){.id = "prefill-0",
                      .chunk = 512,
                      .queue = 64,
                      .max_prompt = -1,
                      .kv_blocks = -1,
                      .prefix_cache_bytes = -1,
                      .transfer_timeout_s = 30.0,
                      .drain_timeout_s = 30.0,
                      .cluster = "default",
                      .lease_ttl_s = 10};
    listen = (kc_hostport){.text = "127.0.0.1:7101"};
    http = (kc_hostport){.text = "127.0.0.1:9101"};
    kv_dtype = PF_WIRE_AUTO;
    cache_dtype = KR_KV_DTYPE_AUTO;
    pipeline = 1;
    backend = KR_BACKEND_CPU;
    lvl = KC_LOG_INFO;
    kc_flags_main(&flags, argc, argv, 0);
    cfg.listen = listen.text;
    cfg.http = http.text;
    cfg.kv_dtype = (kt_dtype)kv_dtype;
    cfg.cache_dtype = (kr_kv_dtype)cache_dtype;
    cfg.pipeline = pipeline;
    cfg.backend = (kr_backend_kind)backend;
    *c = cfg;
    *level = lvl;
    if (!c->model_dir) die(2, "--model DIR is required (see --help)");
    if (!*c->id || strlen(c->id) > 128) die(2, "--id: give 1 to 128 characters");
    char eerr[256];
    if (kc_etcd_flags_finish(&c->etcd, eerr) != 0) die(2, "%s", eerr);
    if (kc_tls_flags_finish(&c->tls, KC_TLS_ROLE_NODE, eerr) != 0) die(2, "%s", eerr);
    if (c->etcd.endpoints) { /* what registration would refuse later, refused before start-up */
        if (!kc_name_ok(c->cluster, 100))
            die(2, "--cluster: '%s' is not 1 to 100 of [A-Za-z0-9._-]", c->cluster);
        if (!kc_name_ok(c->id, 63))
            die(2, "--id: '%s' is not 1 to 63 of [A-Za-z0-9._-] (it is an etcd key segment)",
                c->id);
    }
    if (c->etcd.endpoints && !c->advertise && !strcmp(listen.host, "0.0.0.0"))
        die(2, "--listen %s listens on every interface: give --advertise HOST, the address the "
            "router reaches this node at (it is registered in etcd)", c->listen);
}

/* The transport's log lines through this program's logger (its levels are the logger's). */
static void transport_log(void *arg, kt_log_level level, const char *request_id, const char *line)
{
    (void)arg;
    KC_LOG_AT((kc_log_level)level, request_id, "transport: %s", line);
}

/* What this node puts in etcd (membership.h). */
static void member(const pf_node *n, const char *state, kc_member *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->id, sizeof m->id, "%s", n->cfg->id);
    snprintf(m->role, sizeof m->role, "prefill");
    snprintf(m->state, sizeof m->state, "%s", state);
    snprintf(m->grpc, sizeof m->grpc, "%.255s", n->grpc_address);
    snprintf(m->fingerprint, sizeof m->fingerprint, "%s", kr_model_fingerprint(n->model));
    m->kv_capacity = (uint64_t)n->cfg->max_prompt;
    snprintf(m->version, sizeof m->version, "%s", KVRELAY_VERSION);
    m->start_unix_ms = atomic_load(&n->since_unix_ms);
}

/* --max-prompt and --kv-blocks against the model. */
static void size_for_model(pf_config *c, const kr_config *m)
{
    int ctx_limit = m->max_position_embeddings - 1;
    if (c->max_prompt < 0)
        c->max_prompt = ctx_limit < PF_DEFAULT_MAX_PROMPT ? ctx_limit : PF_DEFAULT_MAX_PROMPT;
    if (c->max_prompt > ctx_limit)
        die(2, "--max-prompt %d exceeds the model's context (max_position_embeddings %d - 1)",
            c->max_prompt, m->max_position_embeddings);
    int64_t lists = (int64_t)m->n_layers * m->n_kv_heads;
    int64_t need = lists * ((c->max_prompt + PF_BLOCK_SIZE - 1) / PF_BLOCK_SIZE);
    if (c->kv_blocks < 0) {
        int64_t blocks = need + lists; /* one more per list: evicting from the front of a list
                                          leaves its first block partly used */
        if (blocks > INT32_MAX)
            die(2, "--max-prompt %d needs %lld KV blocks, more than one pool holds; lower it",
                c->max_prompt, (long long)blocks);
        c->kv_blocks = (int)blocks;
    } else if (c->kv_blocks < need) {
        die(2,
            "--kv-blocks %d cannot hold a --max-prompt %d prompt under the full policy: it "
            "needs %lld blocks of %d entries (%d layers x %d KV heads); raise --kv-blocks or "
            "lower --max-prompt",
            c->kv_blocks, c->max_prompt, (long long)need, PF_BLOCK_SIZE, m->n_layers,
            m->n_kv_heads);
    }
}

static int64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* /healthz: 503 "draining" once a stop signal came. */
static int healthy(void *user, char *reason, size_t cap)
{
    pf_node *n = user;
    if (!atomic_load(&n->since_unix_ms)) { /* the HTTP port opens before gRPC serves */
        snprintf(reason, cap, "starting");
        return 0;
    }
    if (!atomic_load(&n->draining)) return 1;
    snprintf(reason, cap, "draining");
    return 0;
}

static int idle(void *user)
{
    int running, waiting;
    uint64_t tokens;
    pf_queue_load(user, &running, &waiting, &tokens);
    return running == 0 && waiting == 0;
}

/* SIGTERM/SIGINT: refuse new calls, let the queue run empty, then (timeout, or a second
 * signal) end what is left with UNAVAILABLE before the server cancels the calls. */
static void drain(pf_node *n, int sig)
{
    kc_member m;
    member(n, "draining", &m); /* start_unix_ms: the process's start, not the drain's */
    atomic_store(&n->draining, 1);
    atomic_store(&n->since_unix_ms, unix_ms());
    kc_health_set_serving(n->health, 0);
    if (n->registration && kc_register_update(n->registration, &m) != 0)
        kc_warn(NULL, "etcd: state 'draining' not written yet (retried in the background)");
    int running, waiting;
    uint64_t tokens;
    pf_queue_load(n, &running, &waiting, &tokens);
    kc_info(NULL, "%s: draining: new Prefill calls refused; %d running and %d queued jobs may "
            "finish (at most %.0f s; another signal stops at once)",
            sig == SIGINT ? "SIGINT" : "SIGTERM", running, waiting, n->cfg->drain_timeout_s);
    double t0 = pf_now();
    kc_drain_end end = kc_signals_drain(idle, n, n->cfg->drain_timeout_s);
    if (end == KC_DRAIN_DONE) {
        kc_info(NULL, "drained in %.1f s: shutting down", pf_now() - t0);
        return;
    }
    pf_queue_load(n, &running, &waiting, &tokens);
    kc_warn(NULL, "%s after %.1f s: shutting down; %d running and %d queued jobs end UNAVAILABLE",
            end == KC_DRAIN_SIGNAL ? "second stop signal" : "drain timeout", pf_now() - t0,
            running, waiting);
    atomic_store(&n->aborting, 1);
    pf_queue_abort(n);
}

int main(int argc, char **argv)
{
    pf_config cfg;
    kc_log_level level;
    parse_flags(argc, argv, &cfg, &level);
    kc_log_init(cfg.id, level);
    kc_cpu_sched_apply(cfg.cpu_sched);

    if (kc_signals_init() != 0) die(1, "signal pipe: %s", strerror(errno));

    static pf_node node; /* static: zeroed, and large */
    pf_node *n = &node;
    n->cfg = &cfg;
    char err[KR_ERR_MAX];
    kr_model_opts mo = {.verbose = 1};
    if (kr_model_load(cfg.model_dir, &mo, &n->model, err) != KR_OK) die(1, "%s", err);
    n->mcfg = kr_model_config(n->model);
    size_for_model(&cfg, n->mcfg);
    if (pf_run_init(n, err) != 0) die(1, "%s", err);
    if ((int)cfg.kv_dtype == PF_WIRE_AUTO) { /* the cache's rows as they are: exact, fewest bytes */
        kr_dtype t = kr_ctx_kv_dtype(n->ctx);
        cfg.kv_dtype = kt_dtype_of_cache(t);
    }

    n->reg = kc_registry_create();
    if (!n->reg || pf_metrics_register(n) != 0)
        die(1, "cannot register the metrics (out of memory)");
    kc_gauge_set(n->metrics.blocks_free, kr_kv_pool_n_free(n->pool));
    const int64_t block_bytes = (int64_t)PF_BLOCK_SIZE *
                                (2 * (int64_t)n->mcfg->head_dim * (int64_t)kr_dtype_size(kr_ctx_kv_dtype(n->ctx)) + 4);
    if (cfg.prefix_cache_bytes < 0) cfg.prefix_cache_bytes = (int64_t)cfg.kv_blocks * block_bytes;
    if (cfg.prefix_cache_bytes > 0) {
        const pf_cache_config cc = {.budget_bytes = cfg.prefix_cache_bytes, .chunk = cfg.chunk,
                                    .block_size = PF_BLOCK_SIZE, .model = n->model,
                                    .kv_dtype = kr_ctx_kv_dtype(n->ctx), .reg = n->reg};
        if (pf_cache_create(&cc, &n->cache, err) != 0)
            die(2, "--prefix-cache-memory %lld: %s; give 0 to turn the cache off, or at least %lld",
                (long long)cfg.prefix_cache_bytes, err, (long long)block_bytes);
    }

    /* the HTTP port before the transport, the gRPC server and the queue's threads: a port another
     * process holds ends start-up while nothing runs yet */
    char http_err[256];
    int http_bound;
    kc_hostport http_hp, listen_hp; /* checked by parse_flags */
    kc_hostport_parse("--http", cfg.http, KC_HOSTPORT_PORT_ZERO, &http_hp, http_err, sizeof http_err);
    kc_hostport_parse("--listen", cfg.listen, KC_HOSTPORT_PORT_ZERO | KC_HOSTPORT_EMPTY_HOST, &listen_hp,
                      http_err, sizeof http_err);
    kc_http *http = kc_http_start(http_hp.host, http_hp.port, n->reg, healthy, n, &http_bound,
                                  http_err);
    if (!http) die(1, "--http %s: %s", cfg.http, http_err);

    /* RMA capable: a decode node in RMA mode has the bundle put into its memory */
    kt_transport_config tc = {.mode = KT_TRANSPORT_MODE_RMA, .name = cfg.id, .log = transport_log};
    if (kt_transport_create(&tc, &n->tx, err) != 0) die(1, "%s", err);

    kc_server *srv;
    kc_status st;
    int grpc_port;
    const kc_server_config scfg = {.tls = &cfg.tls};
    if (kc_server_create(cfg.listen, &scfg, &srv, &grpc_port, &st) != 0)
        die(1, "--listen %s: %s", cfg.listen, st.details);
    static const char *const services[] = {"kvrelay.v1.Prefill", NULL};
    if (pf_service_register(n, srv) != 0 || !(n->health = kc_health_register(srv, services)))
        die(1, "cannot register the gRPC methods");
    if (cfg.advertise)
        snprintf(n->grpc_address, sizeof n->grpc_address, "%.255s:%d", cfg.advertise, grpc_port);
    else
        kc_hostport_format(listen_hp.host, grpc_port, n->grpc_address, sizeof n->grpc_address);
    if (pf_queue_start(n, err) != 0) die(1, "%s", err);
    if (kc_server_start(srv, &st) != 0) die(1, "starting the gRPC server: %s", st.details);
    atomic_store(&n->since_unix_ms, unix_ms());

    kc_info(NULL,
            "model %s (%s, %d layers, %d KV heads x %d), chunk %d, queue %d, max prompt %d, "
            "%d KV blocks in %s, prefix cache %lld bytes, payload %s, %d threads (%s)",
            cfg.model_dir, kr_model_fingerprint(n->model), n->mcfg->n_layers, n->mcfg->n_kv_heads,
            n->mcfg->head_dim, cfg.chunk, cfg.queue, cfg.max_prompt, cfg.kv_blocks,
            kr_dtype_name(kr_ctx_kv_dtype(n->ctx)), (long long)cfg.prefix_cache_bytes,
            kt_dtype_name(cfg.kv_dtype), kr_ctx_n_threads(n->ctx),
            cfg.backend == KR_BACKEND_CPU ? kr_cpu_isa() : "cuda");
    char http_address[KC_HOST_MAX + 8];
    kc_hostport_format(http_hp.host, http_bound, http_address, sizeof http_address);
    printf("prefill %s: serving grpc %s http %s\n", cfg.id, n->grpc_address, http_address);
    fflush(stdout);

    if (cfg.etcd.endpoints) {
        kc_member m;
        member(n, "serving", &m);
        char rerr[KC_MEMBER_ERR_LEN];
        if (kc_register_start_cfg(&cfg.etcd, cfg.cluster, &m, cfg.lease_ttl_s, &n->registration,
                                  rerr) != 0)
            die(2, "--etcd %s: %s", cfg.etcd.endpoints, rerr);
        kc_info(NULL, "registering in etcd %s as /kvrelay/%s/nodes/prefill/%s (lease %d s)",
                cfg.etcd.endpoints, cfg.cluster, cfg.id, cfg.lease_ttl_s);
    }

    drain(n, kc_signals_wait());
    /* Cancels every call left and waits for their handlers: queued jobs leave the queue, a job
     * in prefill skips its transfer, a send in flight runs to its end (ack, failure, timeout). */
    kc_server_destroy(srv);
    kc_register_stop(n->registration); /* revokes the lease: the key goes at once */
    kc_health_free(n->health);
    pf_queue_stop(n);
    kc_http_stop(http);
    kt_transport_destroy(n->tx);
    pf_cache_free(n->cache); /* the worker is gone: no state is in use */
    pf_run_free(n);
    pf_service_free(n);
    kc_registry_free(n->reg);
    kr_model_free(n->model);
    kc_info(NULL, "stopped");
    return 0;
}
