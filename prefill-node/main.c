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

#include "health.h"
#include "http.h"
#include "log.h"
#include "signals.h"

#define PF_DEFAULT_MAX_PROMPT 8192

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvrelay-prefill --model DIR [options]\n"
            "\n"
            "The prefill node: runs chunked prefill with the request's KV policy, samples the\n"
            "first token, ships the compressed KV cache to the decode node's reservation over\n"
            "UCX and answers the router with the first token and usage (docs/prefill-node.md).\n"
            "\n"
            "  --model DIR             Hugging Face model directory (config.json, safetensors)\n"
            "  --listen HOST:PORT      gRPC address (default 127.0.0.1:7101; port 0: any free)\n"
            "  --http HOST:PORT        /metrics and /healthz (default 127.0.0.1:9101)\n"
            "  --id NAME               node id in logs, usage and Status (default prefill-0)\n"
            "  --threads N             engine threads (default: all online CPUs)\n"
            "  --chunk C               prefill chunk size in tokens (default 512)\n"
            "  --queue N               requests that may wait behind the running one; more are\n"
            "                          refused with RESOURCE_EXHAUSTED (default 64; 0: none wait)\n"
            "  --kv-dtype T            bundle payload: f32 (default, bit-exact decode), bf16, f16\n"
            "  --max-prompt N          longest prompt in tokens (default: %d, at most the\n"
            "                          model's max_position_embeddings - 1)\n"
            "  --kv-blocks N           KV pool blocks of %d entries (default: what a --max-prompt\n"
            "                          prompt needs under the full policy, plus one per list)\n"
            "  --transfer-timeout-s S  cap on one bundle send (default 30; the call's deadline\n"
            "                          caps it too)\n"
            "  --drain-timeout-s S     on SIGTERM/SIGINT new Prefill calls are refused and the\n"
            "                          queued and running ones finish; after S seconds (default\n"
            "                          30) those left end UNAVAILABLE. A second signal stops at\n"
            "                          once\n"
            "  --advertise HOST        host registered in etcd (default: the --listen host;\n"
            "                          required with --etcd when that is 0.0.0.0)\n"
            "  --etcd ENDPOINTS        register in etcd (\"127.0.0.1:2379,...\") under a lease:\n"
            "                          /kvrelay/CLUSTER/nodes/prefill/ID; etcd being down does\n"
            "                          not stop serving (registration retries)\n"
            "  --cluster NAME          etcd cluster name (default \"default\")\n"
            "  --lease-ttl S           etcd lease TTL in seconds (default 10, at least 2)\n"
            KC_ETCD_FLAGS_HELP
            KC_TLS_FLAGS_HELP
            "  --backend B             cpu (default) or cuda\n"
            "  --log-level L           debug, info (default), warn, error\n"
            "  -h, --help              this help\n",
            PF_DEFAULT_MAX_PROMPT, PF_BLOCK_SIZE);
}

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

static const char *flag_value(int argc, char **argv, int *i)
{
    if (*i + 1 >= argc) die(2, "%s needs a value (see --help)", argv[*i]);
    return argv[++*i];
}

static long flag_long(const char *flag, const char *s, long lo, long hi)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        die(2, "%s: '%s' is not an integer in [%ld, %ld]", flag, s, lo, hi);
    return v;
}

static double flag_double(const char *flag, const char *s, double lo, double hi)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        die(2, "%s: '%s' is not a number in [%g, %g]", flag, s, lo, hi);
    return v;
}

/* Flags that depend on the model are -1 until the model is loaded. */
static void parse_flags(int argc, char **argv, pf_config *c, kc_log_level *level)
{
    *c = (pf_config){.listen = "127.0.0.1:7101",
                     .http = "127.0.0.1:9101",
                     .id = "prefill-0",
                     .chunk = 512,
                     .queue = 64,
                     .kv_dtype = KT_DTYPE_F32,
                     .max_prompt = -1,
                     .kv_blocks = -1,
                     .transfer_timeout_s = 30.0,
                     .drain_timeout_s = 30.0,
                     .cluster = "default",
                     .lease_ttl_s = 10,
                     .backend = KR_BACKEND_CPU};
    *level = KC_LOG_INFO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--model")) {
            c->model_dir = flag_value(argc, argv, &i);
        } else if (!strcmp(a, "--listen")) {
            c->listen = flag_value(argc, argv, &i);
        } else if (!strcmp(a, "--http")) {
            c->http = flag_value(argc, argv, &i);
        } else if (!strcmp(a, "--id")) {
            c->id = flag_value(argc, argv, &i);
            if (!*c->id || strlen(c->id) > 128) die(2, "--id: give 1 to 128 characters");
        } else if (!strcmp(a, "--threads")) {
            c->threads = (int)flag_long(a, flag_value(argc, argv, &i), 1, 1024);
        } else if (!strcmp(a, "--chunk")) {
            c->chunk = (int)flag_long(a, flag_value(argc, argv, &i), 1, 1 << 16);
        } else if (!strcmp(a, "--queue")) {
            c->queue = (int)flag_long(a, flag_value(argc, argv, &i), 0, 1 << 20);
        } else if (!strcmp(a, "--kv-dtype")) {
            const char *v = flag_value(argc, argv, &i);
            if (!strcmp(v, "f32"))
                c->kv_dtype = KT_DTYPE_F32;
            else if (!strcmp(v, "bf16"))
                c->kv_dtype = KT_DTYPE_BF16;
            else if (!strcmp(v, "f16"))
                c->kv_dtype = KT_DTYPE_F16;
            else
                die(2, "--kv-dtype: '%s' is not f32, bf16 or f16", v);
        } else if (!strcmp(a, "--max-prompt")) {
            c->max_prompt = (int)flag_long(a, flag_value(argc, argv, &i), 1, INT32_MAX - 1);
        } else if (!strcmp(a, "--kv-blocks")) {
            c->kv_blocks = (int)flag_long(a, flag_value(argc, argv, &i), 1, INT32_MAX);
        } else if (!strcmp(a, "--transfer-timeout-s")) {
            c->transfer_timeout_s = flag_double(a, flag_value(argc, argv, &i), 0.001, 86400);
        } else if (!strcmp(a, "--drain-timeout-s")) {
            c->drain_timeout_s = flag_double(a, flag_value(argc, argv, &i), 0, 86400);
        } else if (!strcmp(a, "--advertise")) {
            c->advertise = flag_value(argc, argv, &i);
        } else if (!strcmp(a, "--cluster")) {
            c->cluster = flag_value(argc, argv, &i);
        } else if (!strcmp(a, "--lease-ttl")) {
            c->lease_ttl_s = (int)flag_long(a, flag_value(argc, argv, &i), 2, 3600);
        } else if (!strncmp(a, "--etcd", 6) && kc_etcd_flag(&c->etcd, a, flag_value(argc, argv, &i))) {
            continue;
        } else if (!strncmp(a, "--tls", 5) && kc_tls_flag(&c->tls, a, flag_value(argc, argv, &i))) {
            continue;
        } else if (!strcmp(a, "--backend")) {
            const char *v = flag_value(argc, argv, &i);
            if (!strcmp(v, "cpu"))
                c->backend = KR_BACKEND_CPU;
            else if (!strcmp(v, "cuda"))
                c->backend = KR_BACKEND_CUDA;
            else
                die(2, "--backend: '%s' is not cpu or cuda", v);
        } else if (!strcmp(a, "--log-level")) {
            const char *v = flag_value(argc, argv, &i);
            if (kc_log_parse_level(v, level) != 0)
                die(2, "--log-level: '%s' is not debug, info, warn or error", v);
        } else {
            die(2, "unknown argument '%s' (see --help)", a);
        }
    }
    if (!c->model_dir) die(2, "--model DIR is required (see --help)");
    char host[256];
    int port;
    if (pf_parse_hostport(c->http, 0, 1, host, sizeof host, &port) != 0)
        die(2, "--http: '%s' is not HOST:PORT", c->http);
    if (!strrchr(c->listen, ':')) die(2, "--listen: '%s' is not HOST:PORT", c->listen);
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
    if (c->etcd.endpoints && !c->advertise && !strncmp(c->listen, "0.0.0.0:", 8))
        die(2, "--listen %s listens on every interface: give --advertise HOST, the address the "
            "router reaches this node at (it is registered in etcd)", c->listen);
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

    n->reg = kc_registry_create();
    if (!n->reg || pf_metrics_register(n) != 0)
        die(1, "cannot register the metrics (out of memory)");
    kc_gauge_set(n->metrics.blocks_free, kr_kv_pool_n_free(n->pool));

    /* the HTTP port before the transport, the gRPC server and the queue's threads: a port another
     * process holds ends start-up while nothing runs yet */
    char http_host[256], http_err[256];
    int http_port, http_bound;
    pf_parse_hostport(cfg.http, 0, 1, http_host, sizeof http_host, &http_port);
    kc_http *http = kc_http_start(http_host, http_port, n->reg, healthy, n, &http_bound,
                                  http_err);
    if (!http) die(1, "--http %s: %s", cfg.http, http_err);

    kt_transport_config tc = {.mode = KT_TRANSPORT_MODE_AM, .listen_host = NULL, .name = cfg.id};
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
    int listen_host_len = (int)(strrchr(cfg.listen, ':') - cfg.listen);
    if (cfg.advertise)
        snprintf(n->grpc_address, sizeof n->grpc_address, "%.255s:%d", cfg.advertise, grpc_port);
    else
        snprintf(n->grpc_address, sizeof n->grpc_address, "%.*s:%d", listen_host_len, cfg.listen,
                 grpc_port);
    if (pf_queue_start(n, err) != 0) die(1, "%s", err);
    if (kc_server_start(srv, &st) != 0) die(1, "starting the gRPC server: %s", st.details);
    atomic_store(&n->since_unix_ms, unix_ms());

    kc_info(NULL,
            "model %s (%s, %d layers, %d KV heads x %d), chunk %d, queue %d, max prompt %d, "
            "%d KV blocks, payload %s, %d threads",
            cfg.model_dir, kr_model_fingerprint(n->model), n->mcfg->n_layers, n->mcfg->n_kv_heads,
            n->mcfg->head_dim, cfg.chunk, cfg.queue, cfg.max_prompt, cfg.kv_blocks,
            kt_dtype_name(cfg.kv_dtype), kr_ctx_n_threads(n->ctx));
    printf("prefill %s: serving grpc %s http %s:%d\n", cfg.id, n->grpc_address, http_host,
           http_bound);
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
    pf_run_free(n);
    pf_service_free(n);
    kc_registry_free(n->reg);
    kr_model_free(n->model);
    kc_info(NULL, "stopped");
    return 0;
}
