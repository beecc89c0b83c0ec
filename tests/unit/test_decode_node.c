/*
 * test_decode_node.c - kvrelay-decode as a black box: the real program on a fixture model, real
 * gRPC and real UCX on loopback. This test plays the router (Reserve, Decode, Release, Status
 * over gRPC) and the prefill node (in-process kr_prefill with a policy, the KV bundle written
 * with kt_bundle_writer and shipped with kt_transport_send_wait to the node's transfer address),
 * and checks:
 *   - streamed tokens equal an in-process one-sequence decode (kr_forward), token for token, for
 *     several policies at once in one batch (greedy, and one seeded sampled stream), on
 *     llama3-tiny and mistral-tiny, plus finish reason and completion_tokens; forced (scoring)
 *     sequences in the same batch stream their forced ids past EOS and a stop id, with
 *     logprobs and top ids equal to kr_logprob on the one-process logits bit for bit;
 *   - a stream cancelled mid-way, a deadline passing mid-stream and while waiting for a bundle,
 *     an expired reservation, a released one: each leaves Status with zero reserved and used
 *     blocks (polled for a few seconds, no timing asserted);
 *   - refusals: Release of an unknown id (released=false), Reserve over capacity
 *     (RESOURCE_EXHAUSTED), bad Reserve fields (INVALID_ARGUMENT naming them), a bundle for
 *     another model, under another policy or longer than its reservation (each refused as it
 *     arrives: the sender's error and Decode's FAILED_PRECONDITION name both sides), a bundle
 *     whose decode rules never trim against a reservation sized for streaming
 *     (FAILED_PRECONDITION naming the list and the blocks; the blocks return), garbage bytes
 *     on all four RPCs (INVALID_ARGUMENT), after all of which the node still serves;
 *   - a node in RMA mode decodes bundles put into it as one process does: padded ones with
 *     their K and V put into the run of KV blocks each reservation took, the others put whole
 *     and copied; the run leaves the pool while the bundle is awaited and comes back; with room
 *     for a reservation's bound but not for its run beside it, it goes without one;
 *   - a node killed with SIGKILL and restarted on the same ports serves the same
 *     sender again; SIGTERM drains (running and reserved work finishes with one-process tokens,
 *     new Reserves UNAVAILABLE "draining", health NOT_SERVING, Status DRAINING, exit 0); an
 *     endless stream is cut UNAVAILABLE by --drain-timeout-s or by a second SIGTERM.
 * Not here: the router and prefill node processes (tests/integration), throughput.
 * Skips (77) when kvrelay-decode is not built or the fixtures are absent.
 * Run: ctest -R test_decode_node (about 10 s with sanitizers).
 */
#include "kr_test.h"
#include "proc.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <semaphore.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "bundle-rule.h"
#include "kr.h"
#include "rma-rows.h"
#include "rpc.h"
#include "transport.h"

#include "grpc/health/v1/health.pb-c.h"
#include "kvrelay/v1/internal.pb-c.h"

#define P_RESERVE "/kvrelay.v1.Decode/Reserve"
#define P_DECODE "/kvrelay.v1.Decode/Decode"
#define P_RELEASE "/kvrelay.v1.Decode/Release"
#define P_STATUS "/kvrelay.v1.Decode/Status"
#define KV_BLOCKS 6000
#define MAX_OUT 256

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* ------------------------------------------------------------------ the node under test */

typedef struct node {
    test_proc proc;
    kc_channel *ch;
    char xfer_host[64];
    uint16_t xfer_port;
    uint64_t total_blocks;
} node;

static Kvrelay__V1__Node *status(node *nd)
{
    Kvrelay__V1__NodeStatusRequest req = KVRELAY__V1__NODE_STATUS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    kc_status st;
    if (kc_unary(nd->ch, P_STATUS, &req.base, &kvrelay__v1__node__descriptor, 5000, &resp, &st) != 0) {
        fprintf(stderr, "Status: %s %s\n", kc_status_name(st.code), st.details);
        return NULL;
    }
    return (Kvrelay__V1__Node *)resp;
}

/* Polls Status until nothing is reserved, used, running or queued (up to ~10 s). */
static int idle(node *nd)
{
    Kvrelay__V1__Node *s = NULL;
    for (int i = 0; i < 200; i++) {
        kc_message_free((ProtobufCMessage *)s);
        s = status(nd);
        if (s && s->reserved_kv_blocks == 0 && s->free_kv_blocks == s->total_kv_blocks &&
            s->running_requests == 0 && s->queued_requests == 0)
            break;
        sleep_ms(50);
    }
    int ok = s && s->reserved_kv_blocks == 0 && s->free_kv_blocks == s->total_kv_blocks &&
             s->running_requests == 0 && s->queued_requests == 0;
    if (!ok && s)
        fprintf(stderr, "not idle: reserved %" PRIu64 ", free %" PRIu64 " of %" PRIu64
                ", running %u, queued %u\n", s->reserved_kv_blocks, s->free_kv_blocks,
                s->total_kv_blocks, s->running_requests, s->queued_requests);
    kc_message_free((ProtobufCMessage *)s);
    return ok;
}

/* GET `path` from the node's HTTP endpoint with a plain socket: the whole response (status
 * line, headers, body) in a static buffer, "" when the connection failed. */
static const char *http_get(const node *nd, const char *path)
{
    static char buf[1 << 17];
    buf[0] = 0;
    const char *colon = strrchr(nd->proc.http, ':');
    if (!colon)
        return buf;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    size_t n = 0;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
        char rq[256];
        snprintf(rq, sizeof rq, "GET %s HTTP/1.0\r\n\r\n", path);
        if (write(fd, rq, strlen(rq)) == (ssize_t)strlen(rq)) {
            ssize_t r;
            while (n + 1 < sizeof buf && (r = read(fd, buf + n, sizeof buf - 1 - n)) > 0)
                n += (size_t)r;
        }
    }
    close(fd);
    buf[n] = 0;
    return buf;
}

/* The value of /metrics sample line `name` (with its labels), or -1. */
static double metric(const node *nd, const char *name)
{
    const char *body = http_get(nd, "/metrics");
    char key[160];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(body, key);
    return p ? strtod(p + strlen(key), NULL) : -1;
}

/* Starts the node on `listen` and `transfer` (HOST:PORT; port 0: any free) with
 * --drain-timeout-s `drain_s`, --transfer-mode `mode` and --kv-blocks `kv_blocks`. */
static void node_start_mode(node *nd, const char *bin, const char *model, const char *listen,
                            const char *transfer, const char *drain_s, const char *mode,
                            int kv_blocks)
{
    char blocks[32];
    snprintf(blocks, sizeof blocks, "%d", kv_blocks);
    char *argv[] = {(char *)bin, "--model", (char *)model, "--id", "decode-t", "--listen",
                    (char *)listen, "--transfer", (char *)transfer, "--http", "127.0.0.1:0",
                    "--kv-blocks", blocks, "--threads", "1", "--max-batch", "4",
                    "--reservation-ttl-ms", "20000", "--drain-timeout-s", (char *)drain_s,
                    "--transfer-mode", (char *)mode, NULL};
    REQUIRE(test_proc_start(argv, 60.0, &nd->proc) == 0, "kvrelay-decode starts on %s", model);
    kc_status st;
    REQUIRE(kc_channel_create(nd->proc.grpc, 0, &nd->ch, &st) == 0, "%s", st.details);
    Kvrelay__V1__Node *s = status(nd);
    REQUIRE(s, "Status answers");
    CHECK(s->role == KVRELAY__V1__NODE_ROLE__NODE_ROLE_DECODE, "role %d", s->role);
    CHECK(s->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING, "state %d", s->state);
    CHECK(strcmp(s->id, "decode-t") == 0, "id %s", s->id);
    CHECK(strcmp(s->grpc_address, nd->proc.grpc) == 0, "grpc_address %s", s->grpc_address);
    CHECK(s->total_kv_blocks == (uint64_t)kv_blocks && s->free_kv_blocks == (uint64_t)kv_blocks &&
          s->reserved_kv_blocks == 0, "blocks %" PRIu64 "/%" PRIu64 "/%" PRIu64,
          s->total_kv_blocks, s->free_kv_blocks, s->reserved_kv_blocks);
    nd->total_blocks = s->total_kv_blocks;
    const char *colon = strrchr(s->transfer_address, ':');
    REQUIRE(colon && (size_t)(colon - s->transfer_address) < sizeof nd->xfer_host,
            "transfer_address %s", s->transfer_address);
    memcpy(nd->xfer_host, s->transfer_address, (size_t)(colon - s->transfer_address));
    nd->xfer_host[colon - s->transfer_address] = 0;
    nd->xfer_port = (uint16_t)atoi(colon + 1);
    kc_message_free(&s->base);

    /* Health, both ways. */
    CHECK(strstr(http_get(nd, "/healthz"), " 200 ") != NULL, "/healthz answers 200");
    for (int i = 0; i < 2; i++) {
        Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
        hreq.service = i ? "kvrelay.v1.Decode" : "";
        ProtobufCMessage *resp = NULL;
        int rc = kc_unary(nd->ch, "/grpc.health.v1.Health/Check", &hreq.base,
                          &grpc__health__v1__health_check_response__descriptor, 5000, &resp, &st);
        CHECK(rc == 0 && ((const Grpc__Health__V1__HealthCheckResponse *)resp)->status ==
                             GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING,
              "grpc.health.v1 Check('%s'): %s", hreq.service, st.details);
        kc_message_free(resp);
    }
}

/* node_start_mode in the default transfer mode (active messages). */
static void node_start(node *nd, const char *bin, const char *model, const char *listen,
                       const char *transfer, const char *drain_s)
{
    node_start_mode(nd, bin, model, listen, transfer, drain_s, "am", KV_BLOCKS);
}

/* grpc.health.v1 Check of the Decode service: 1 SERVING, 0 anything else, -1 no answer. */
static int health_serving(node *nd)
{
    Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    hreq.service = "kvrelay.v1.Decode";
    ProtobufCMessage *resp = NULL;
    kc_status st;
    if (kc_unary(nd->ch, "/grpc.health.v1.Health/Check", &hreq.base,
                 &grpc__health__v1__health_check_response__descriptor, 5000, &resp, &st) != 0)
        return -1;
    int serving = ((const Grpc__Health__V1__HealthCheckResponse *)resp)->status ==
                  GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    kc_message_free(resp);
    return serving;
}

/* ------------------------------------------------------------------ the router's calls */

/* What the latest reservations' Reserve answers gave the sender, by id, for ship() (a bundle
 * must carry its reservation's token; a node in RMA mode also hands out where to put it); a
 * ring, since the tests hold few reservations at a time. */
typedef struct grant {
    uint64_t id;
    uint8_t token[KT_RESV_TOKEN_BYTES];
    kt_rma_key rma; /* rkey_len 0: send */
    kt_rma_rows rows; /* bytes 0: no run of blocks to put K and V into */
} grant;
static grant grants[64];
static unsigned n_grants;

static const grant *grant_of(uint64_t id)
{
    for (unsigned i = 0; i < sizeof grants / sizeof grants[0]; i++)
        if (grants[i].id == id)
            return &grants[i];
    static const grant none;
    return &none;
}

static uint64_t reserve(node *nd, const char *rid, uint32_t prompt, uint32_t max_tokens,
                        const char *policy, uint32_t ttl_ms, kc_status *st)
{
    Kvrelay__V1__ReserveRequest req = KVRELAY__V1__RESERVE_REQUEST__INIT;
    req.request_id = (char *)rid;
    req.prompt_tokens = prompt;
    req.max_tokens = max_tokens;
    req.kv_policy = (char *)policy;
    req.ttl_ms = ttl_ms;
    ProtobufCMessage *resp = NULL;
    if (kc_unary(nd->ch, P_RESERVE, &req.base, &kvrelay__v1__reserve_response__descriptor, 5000,
                 &resp, st) != 0)
        return 0;
    const Kvrelay__V1__ReserveResponse *r = (const void *)resp;
    uint64_t id = r->reservation_id;
    char want[160];
    snprintf(want, sizeof want, "%s:%u", nd->xfer_host, nd->xfer_port);
    CHECK(id != 0 && r->reserved_blocks > 0 && strcmp(r->transfer_address, want) == 0 &&
          r->expires_unix_ms > 0, "Reserve answer: id %" PRIu64 ", %" PRIu64 " blocks, %s",
          id, r->reserved_blocks, r->transfer_address);
    CHECK(r->reservation_token.len == KT_RESV_TOKEN_BYTES, "Reserve answer: a %zu-byte token",
          r->reservation_token.len);
    CHECK(r->rma_key.len <= KT_RMA_KEY_MAX, "Reserve answer: a %zu-byte RMA key", r->rma_key.len);
    if (r->reservation_token.len == KT_RESV_TOKEN_BYTES && r->rma_key.len <= KT_RMA_KEY_MAX) {
        grant *g = &grants[n_grants++ % (sizeof grants / sizeof grants[0])];
        memset(g, 0, sizeof *g);
        g->id = id;
        memcpy(g->token, r->reservation_token.data, KT_RESV_TOKEN_BYTES);
        g->rma = (kt_rma_key){.address = r->rma_address, .rkey_len = (uint32_t)r->rma_key.len};
        if (r->rma_key.len)
            memcpy(g->rma.rkey, r->rma_key.data, r->rma_key.len);
        CHECK(kc_rma_rows_from_pb(r->rma_rows, &g->rows) == 0, "Reserve answer: rma_rows well formed");
        CHECK(!g->rows.bytes || (r->kv_block_rows == 16 && g->rma.rkey_len),
              "Reserve answer: rows only with an RMA key and the block size (%u)", r->kv_block_rows);
    }
    kc_message_free(resp);
    return id;
}

static int release(node *nd, uint64_t id)
{
    Kvrelay__V1__ReleaseRequest req = KVRELAY__V1__RELEASE_REQUEST__INIT;
    req.reservation_id = id;
    req.request_id = "t-release";
    ProtobufCMessage *resp = NULL;
    kc_status st;
    if (kc_unary(nd->ch, P_RELEASE, &req.base, &kvrelay__v1__release_response__descriptor, 5000,
                 &resp, &st) != 0) {
        CHECK(0, "Release: %s %s", kc_status_name(st.code), st.details);
        return -1;
    }
    int released = ((const Kvrelay__V1__ReleaseResponse *)resp)->released;
    kc_message_free(resp);
    return released;
}

static kc_stream *decode_open_forced(node *nd, uint64_t id, const char *rid, uint32_t max_tokens,
                                     const Kvrelay__V1__Sampling *sampling, int64_t timeout_ms,
                                     uint32_t *stop_ids, size_t n_stop, uint32_t *forced,
                                     size_t n_forced)
{
    Kvrelay__V1__DecodeRequest req = KVRELAY__V1__DECODE_REQUEST__INIT;
    req.forced = forced;
    req.n_forced = n_forced;
    req.reservation_id = id;
    req.request_id = (char *)rid;
    req.max_tokens = max_tokens;
    req.sampling = (Kvrelay__V1__Sampling *)sampling;
    req.stop_ids = stop_ids;
    req.n_stop_ids = n_stop;
    kc_stream *s = NULL;
    kc_status st;
    REQUIRE(kc_stream_open(nd->ch, P_DECODE, &req.base, timeout_ms, &s, &st) == 0, "%s",
            st.details);
    return s;
}

static kc_stream *decode_open_stop(node *nd, uint64_t id, const char *rid, uint32_t max_tokens,
                                   const Kvrelay__V1__Sampling *sampling, int64_t timeout_ms,
                                   uint32_t *stop_ids, size_t n_stop)
{
    return decode_open_forced(nd, id, rid, max_tokens, sampling, timeout_ms, stop_ids, n_stop,
                              NULL, 0);
}

static kc_stream *decode_open(node *nd, uint64_t id, const char *rid, uint32_t max_tokens,
                              const Kvrelay__V1__Sampling *sampling, int64_t timeout_ms)
{
    return decode_open_stop(nd, id, rid, max_tokens, sampling, timeout_ms, NULL, 0);
}

/* What one Decode stream said. */
typedef struct streamed {
    int32_t ids[MAX_OUT];
    float lps[MAX_OUT]; /* n_lps of them, with top ids, when the messages carried them */
    uint32_t tops[MAX_OUT];
    int n, n_lps, n_msgs, n_finish;
    Kvrelay__V1__FinishReason reason;
    uint32_t completion_tokens;
    double footprint_full;
    kc_status st;
    int rc; /* kc_stream_next's last: 0 = OK end, -1 = error */
} streamed;

static void decode_read(kc_stream *s, streamed *out)
{
    memset(out, 0, sizeof *out);
    ProtobufCMessage *m;
    while ((out->rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m,
                                     &out->st)) == 1) {
        const Kvrelay__V1__DecodeResponse *r = (const void *)m;
        if (r->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS) {
            out->n_msgs++;
            const Kvrelay__V1__DecodeTokens *t = r->tokens;
            for (size_t i = 0; i < t->n_logprobs && i < t->n_top_ids && out->n_lps < MAX_OUT; i++) {
                out->lps[out->n_lps] = t->logprobs[i];
                out->tops[out->n_lps++] = t->top_ids[i];
            }
            for (size_t i = 0; i < t->n_ids && out->n < MAX_OUT; i++)
                out->ids[out->n++] = (int32_t)t->ids[i];
        } else if (r->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_FINISH) {
            out->n_finish++;
            out->reason = r->finish->reason;
            out->completion_tokens = r->finish->completion_tokens;
            out->footprint_full = r->finish->footprint_full;
        }
        kc_message_free(m);
    }
}

/* ------------------------------------------------------------------ the prefill node's part */

typedef struct engine {
    kr_model *m;
    const kr_config *cfg;
    kr_ctx *ctx;
    kt_transport *tx;
    float *logits;
} engine;

static void engine_init(engine *e, const char *dir)
{
    char err[KR_ERR_MAX];
    REQUIRE(kr_model_load(dir, NULL, &e->m, err) == KR_OK, "%s", err);
    e->cfg = kr_model_config(e->m);
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 1, .max_chunk = 16};
    REQUIRE(kr_ctx_create(e->m, &cp, &e->ctx, err) == KR_OK, "%s", err);
    kt_transport_config tc = {.mode = KT_TRANSPORT_MODE_RMA, .name = "test-prefill"}; /* sends too */
    char terr[KT_ERR_MAX];
    REQUIRE(kt_transport_create(&tc, &e->tx, terr) == 0, "%s", terr);
    e->logits = malloc(sizeof(float) * (size_t)e->cfg->vocab_size);
}

static void engine_free(engine *e)
{
    kt_transport_destroy(e->tx);
    kr_ctx_free(e->ctx);
    kr_model_free(e->m);
    free(e->logits);
}

/* One request as the prefill node and as one process would run it. */
typedef struct request {
    const char *policy;
    int n_prompt, max_tokens;
    int sampled; /* 0: greedy; 1: temperature 0.9, top_k 40, seed 7 */
    const char *fingerprint; /* NULL: the model's */
    int decode_max; /* Decode's max_tokens when it differs from the reservation's (CONTEXT) */
    int stop_at; /* > 0: the id one process generated at this index is a stop id */
    int forced; /* scoring: the first token and the decode node's ids are given (EOS among them),
                   a stop id too: none of it ends the stream, and logprobs come back */
    int never_trims; /* the bundle carries the never-trimmed rule on every list, whatever the
                        policy left there (a sender that lies about its rules) */
    int padded; /* the bundle in the node's KV dtype, each list padded to its 16-entry blocks, as
                   a prefill node writes it after Reserve: K and V land in the node's blocks */
    uint32_t forced_ids[MAX_OUT]; /* the ids after the first: max_tokens - 1 */
    float want_lps[MAX_OUT]; /* kr_logprob of each, and each row's argmax */
    uint32_t want_tops[MAX_OUT];
    /* results */
    int32_t first;
    int32_t want[MAX_OUT]; /* one-process continuation after the first token */
    int n_want; /* -1: not computed */
    Kvrelay__V1__FinishReason want_reason;
    uint8_t *bundle;
    uint64_t size;
} request;

static void prompt_ids(int32_t *ids, int n, int vocab, int salt)
{
    uint32_t x = 2166136261u ^ (uint32_t)salt;
    for (int i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        ids[i] = (int32_t)((x >> 8) % (uint32_t)(vocab - 2)); /* avoid the top ids (eos) */
    }
}

static kr_sampling sampling_of(const request *rq)
{
    kr_sampling s;
    kr_sampling_default(&s);
    if (!rq->sampled) {
        s.greedy = 1;
    } else {
        s.temperature = 0.9f;
        s.top_k = 40;
        s.seed = 7;
    }
    return s;
}

/* Prefills, writes the bundle into rq->bundle, then (when `oracle`) continues the same
 * sequence with kr_forward: exactly what one process would generate. */
static void prefill(engine *e, request *rq, int salt, int oracle)
{
    const kr_config *c = e->cfg;
    char err[KR_ERR_MAX];
    int32_t prompt[512];
    REQUIRE(rq->n_prompt <= 512, "prompt");
    prompt_ids(prompt, rq->n_prompt, c->vocab_size, salt);
    int per_list = (rq->n_prompt + (oracle ? rq->max_tokens : 0) + 64) / 16 + 2;
    kr_kv_pool *pool;
    kr_seq *seq;
    kr_policy *pol;
    kr_sampler *sp;
    /* the node's default KV dtype, as its own context resolves it */
    REQUIRE(kr_kv_pool_create(c->head_dim, 16, per_list * c->n_layers * c->n_kv_heads, kr_ctx_kv_dtype(e->ctx),
                              &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, c->n_layers, c->n_kv_heads, &seq, err) == KR_OK, "%s", err);
    REQUIRE(kr_policy_parse(rq->policy, c, &pol, err) == KR_OK, "%s: %s", rq->policy, err);
    REQUIRE(kr_seq_set_policy(seq, pol, err) == KR_OK, "%s", err);
    kr_sampling sm = sampling_of(rq);
    REQUIRE(kr_sampler_create(&sm, c->vocab_size, &sp, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(e->ctx, seq, prompt, rq->n_prompt, 16, KR_LOGITS_LAST, e->logits, err) ==
            KR_OK, "prefill %s: %s", rq->policy, err);
    rq->first = kr_sampler_sample(sp, e->logits);
    if (rq->forced) {
        REQUIRE(rq->max_tokens - 1 <= MAX_OUT, "forced length");
        rq->first = (rq->first + 1) % (c->vocab_size - 2);
        for (int i = 0; i < rq->max_tokens - 1; i++)
            rq->forced_ids[i] = (uint32_t)((rq->first * 7 + i * 13) % (c->vocab_size - 2));
        rq->forced_ids[2] = (uint32_t)c->eos_token_id; /* scored past, not stopped at */
    }

    kt_bundle_header h;
    memset(&h, 0, sizeof h);
    snprintf(h.fingerprint, sizeof h.fingerprint, "%s",
             rq->fingerprint ? rq->fingerprint : kr_model_fingerprint(e->m));
    h.n_layers = (uint32_t)c->n_layers;
    h.n_kv_heads = (uint32_t)c->n_kv_heads;
    h.head_dim = (uint32_t)c->head_dim;
    h.dtype = rq->padded ? (kt_dtype)kr_ctx_kv_dtype(e->ctx) : KT_DTYPE_F32;
    h.block_rows = rq->padded ? 16 : 0;
    h.first_token = rq->first;
    h.prompt_len = rq->n_prompt;
    h.next_pos = kr_seq_next_pos(seq);
    snprintf(h.policy, sizeof h.policy, "%s", kr_policy_spec(pol));
    int n_lists = c->n_layers * c->n_kv_heads;
    kt_bundle_list lists[n_lists];
    for (int l = 0; l < c->n_layers; l++)
        for (int hd = 0; hd < c->n_kv_heads; hd++) {
            int len, pinned;
            kr_list_rule rule;
            kr_seq_list_shape(seq, l, hd, &len, &pinned);
            kr_seq_list_rule(seq, l, hd, &rule);
            if (rq->never_trims)
                rule.window = -1;
            lists[l * c->n_kv_heads + hd] = kt_bundle_list_of(len, pinned, &rule);
        }
    char terr[KT_ERR_MAX];
    REQUIRE(kt_bundle_size(&h, lists, &rq->size, terr) == 0, "%s", terr);
    rq->bundle = malloc(rq->size);
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &h, lists, rq->bundle, rq->size, terr) == 0, "%s", terr);
    float *k = malloc(sizeof(float) * 1024 * (size_t)c->head_dim);
    float *v = malloc(sizeof(float) * 1024 * (size_t)c->head_dim);
    int32_t pos[1024];
    for (int l = 0; l < c->n_layers; l++)
        for (int hd = 0; hd < c->n_kv_heads; hd++) {
            int len = (int)lists[l * c->n_kv_heads + hd].count;
            REQUIRE(len <= 1024, "list length");
            REQUIRE(kr_seq_list_read(seq, l, hd, 0, len, pos, k, v, err) == KR_OK, "%s", err);
            REQUIRE(kt_bundle_writer_put(&w, (uint32_t)l, (uint32_t)hd,
                                         &(kt_rows_in){(uint32_t)len, pos, KT_DTYPE_F32, k, v},
                                         terr) == 0,
                    "%s", terr);
        }
    uint64_t written;
    REQUIRE(kt_bundle_writer_finish(&w, &written, terr) == 0 && written == rq->size, "%s", terr);
    free(k);
    free(v);

    rq->n_want = -1;
    if (oracle) {
        int n_gen = 1;
        int32_t last = rq->first;
        rq->n_want = 0;
        rq->want_reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        if (last == c->eos_token_id)
            rq->want_reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS;
        if (rq->forced)
            rq->want_reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        while (n_gen < rq->max_tokens && (rq->forced || last != c->eos_token_id)) {
            REQUIRE(kr_forward(e->ctx, seq, &last, 1, KR_LOGITS_LAST, e->logits, err) == KR_OK,
                    "decode %s: %s", rq->policy, err);
            if (rq->forced) {
                int32_t top;
                last = (int32_t)rq->forced_ids[n_gen - 1];
                rq->want_lps[rq->n_want] = kr_logprob(e->logits, c->vocab_size, last, &top);
                rq->want_tops[rq->n_want] = (uint32_t)top;
                rq->want[rq->n_want++] = last;
                n_gen++;
                continue;
            }
            last = kr_sampler_sample(sp, e->logits);
            rq->want[rq->n_want++] = last;
            n_gen++;
            if (last == c->eos_token_id)
                rq->want_reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS;
        }
    }
    if (oracle && !rq->forced && rq->stop_at > 0 && rq->stop_at < rq->n_want) {
        /* The router's stop ids: generation ends at the first occurrence. */
        int32_t stop = rq->want[rq->stop_at];
        if (rq->first == stop) {
            rq->n_want = 0;
            rq->want_reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP;
        }
        for (int i = 0; i < rq->n_want; i++) {
            if (rq->want[i] == stop) {
                rq->n_want = i + 1;
                rq->want_reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP;
                break;
            }
        }
    }
    if (oracle && rq->decode_max > rq->max_tokens &&
        rq->want_reason == KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH)
        rq->want_reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_CONTEXT; /* the bound */
    kr_sampler_free(sp);
    kr_seq_free(seq);
    kr_policy_free(pol);
    kr_kv_pool_free(pool);
}

/* A put's outcome, for ship(). */
typedef struct put_wait {
    sem_t done;
    int status;
    char err[KT_ERR_MAX];
} put_wait;

static void put_done(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    put_wait *w = arg;
    w->status = status;
    snprintf(w->err, sizeof w->err, "%s", err ? err : "");
    sem_post(&w->done);
    (void)id;
    (void)bytes;
}

/* Ships rq's bundle to reservation `id` as a prefill node does: sent, or in RMA mode put into
 * the reservation's buffer, with its K and V into the node's blocks when the reservation took
 * a run of them and the bundle is laid out as them. */
static int ship(engine *e, node *nd, uint64_t id, request *rq, char *err)
{
    const grant *g = grant_of(id);
    int rc;
    const kt_peer to = {nd->xfer_host, nd->xfer_port, id, g->token};
    if (!g->rma.rkey_len) {
        rc = kt_transport_send_wait(e->tx, &to, rq->bundle, rq->size, 10.0, err);
    } else {
        put_wait w = {.status = -1};
        sem_init(&w.done, 0, 0);
        kt_bundle_layout lay;
        const int rows = g->rows.bytes && kt_bundle_layout_read(rq->bundle, (size_t)rq->size, &lay, NULL) == 0 &&
                         lay.split && lay.block_rows == 16 && lay.k_len <= g->rows.bytes;
        const kt_put_dest at = {.key = &g->rma, .rows = rows ? &g->rows : NULL};
        const kt_send_opts o = {.timeout_s = 10.0, .cb = put_done, .cb_arg = &w};
        rc = kt_transport_put(e->tx, &to, &at, rq->bundle, rq->size, &o, err);
        if (rc == 0) {
            while (sem_wait(&w.done) != 0) {
            }
            rc = w.status;
            snprintf(err, KT_ERR_MAX, "%s", w.err);
        }
        sem_destroy(&w.done);
    }
    free(rq->bundle);
    rq->bundle = NULL;
    return rc;
}

/* Prefills rq (with `salt`, against the one-process oracle when asked), ships its bundle to
 * reservation `id` and reads the Decode stream it opens into *out. */
static void ship_and_decode(engine *e, node *nd, uint64_t id, request *rq, int salt, int oracle,
                            const char *rid, uint32_t max_tokens, int64_t timeout_ms, streamed *out)
{
    char err[KT_ERR_MAX];
    prefill(e, rq, salt, oracle);
    REQUIRE(ship(e, nd, id, rq, err) == 0, "the transport takes it: %s", err);
    kc_stream *s = decode_open(nd, id, rid, max_tokens, NULL, timeout_ms);
    decode_read(s, out);
    kc_stream_close(s);
}

/* Prefills rq and ships its bundle to reservation `id`, which refuses it as it arrives: the
 * sender's error and the Decode call's (FAILED_PRECONDITION) both contain `a` and `b`. */
static void refused_on_arrival(engine *e, node *nd, uint64_t id, request *rq, int salt,
                               const char *rid, const char *a, const char *b)
{
    char err[KT_ERR_MAX];
    prefill(e, rq, salt, 0);
    CHECK(ship(e, nd, id, rq, err) != 0, "%s: the sender hears the refusal", rid);
    CHECK_ERR_HAS(err, a);
    CHECK_ERR_HAS(err, b);
    streamed out;
    kc_stream *s = decode_open(nd, id, rid, (uint32_t)rq->max_tokens, NULL, 5000);
    decode_read(s, &out);
    kc_stream_close(s);
    CHECK(out.rc == -1 && out.st.code == GRPC_STATUS_FAILED_PRECONDITION, "%s: %s %s", rid,
          kc_status_name(out.st.code), out.st.details);
    CHECK_ERR_HAS(out.st.details, a);
    CHECK_ERR_HAS(out.st.details, b);
}

/* ------------------------------------------------------------------ tests */

/* Files the heads and hsft policies read (the node reads the same paths): per layer, KV head
 * gates (every other head dense) and a learned window. */
static char heads_spec[300], hsft_spec[500];

static void policy_files(const kr_config *c, const char *dir)
{
    char gates[200], windows[200];
    snprintf(gates, sizeof gates, "%s/gates.tsv", dir);
    snprintf(windows, sizeof windows, "%s/windows.txt", dir);
    FILE *g = fopen(gates, "w"), *w = fopen(windows, "w");
    REQUIRE(g && w, "policy files in %s", dir);
    for (int l = 0; l < c->n_layers; l++) {
        for (int h = 0; h < c->n_kv_heads; h++)
            fprintf(g, "%s%.2f", h ? "\t" : "", (h + l) % 2 ? 0.9 : 0.1 + 0.01 * h);
        fprintf(g, "\n");
        fprintf(w, "%d\n", 6 + 2 * l);
    }
    fclose(g);
    fclose(w);
    snprintf(heads_spec, sizeof heads_spec, "heads:pattern=%s,sparsity=0.5,sink=2,window=8", gates);
    snprintf(hsft_spec, sizeof hsft_spec, "hsft:windows=%s,pattern=%s,budget=0.5,sink=2", windows,
             gates);
}

/* Many policies decoded at once in one batch (max-batch 4: several forward calls per step),
 * each equal to one-process generation. */
static void test_batch_equals_one_process(engine *e, node *nd, const char *model)
{
    request rq[] = {
        {.policy = "full", .n_prompt = 37, .max_tokens = 40},
        {.policy = "streaming:sink=4,window=16", .n_prompt = 50, .max_tokens = 48},
        {.policy = "snapkv:mode=patched,obs=8,budget=16", .n_prompt = 45, .max_tokens = 33},
        {.policy = "sage:budget=32", .n_prompt = 60, .max_tokens = 40},
        {.policy = "streaming:sink=2,window=12,pos=rel", .n_prompt = 41, .max_tokens = 44},
        {.policy = "take:budget=16,warmup_budget=32,warmup_layers=1,probe=8", .n_prompt = 48,
         .max_tokens = 36},
        {.policy = "full", .n_prompt = 30, .max_tokens = 40, .sampled = 1},
        {.policy = "streaming:sink=4,window=16", .n_prompt = 33, .max_tokens = 40, .stop_at = 6},
        {.policy = "full", .n_prompt = 25, .max_tokens = 12, .decode_max = 50},
        {.policy = "full", .n_prompt = 21, .max_tokens = 1},
        {.policy = heads_spec, .n_prompt = 40, .max_tokens = 30},
        {.policy = hsft_spec, .n_prompt = 44, .max_tokens = 30},
        /* scoring sequences in the same batch as the sampled ones above */
        {.policy = "full", .n_prompt = 35, .max_tokens = 20, .forced = 1, .stop_at = 4},
        {.policy = "snapkv:mode=patched,obs=8,budget=16", .n_prompt = 47, .max_tokens = 25,
         .forced = 1},
        /* received straight into the node's KV blocks (the rest are copied in: f32 on the wire) */
        {.policy = "full", .n_prompt = 37, .max_tokens = 40, .padded = 1},
        {.policy = "streaming:sink=4,window=16", .n_prompt = 50, .max_tokens = 48, .padded = 1},
        {.policy = "take:budget=16,warmup_budget=32,warmup_layers=1,probe=8", .n_prompt = 48,
         .max_tokens = 36, .padded = 1},
        {.policy = heads_spec, .n_prompt = 40, .max_tokens = 30, .padded = 1},
    };
    enum { N = sizeof rq / sizeof rq[0] };
    uint64_t ids[N];
    char rid[N][32], err[KT_ERR_MAX];
    const char *landed[2] = {"kvrelay_decode_bundle_parts_total{landing=\"received\"}",
                             "kvrelay_decode_bundle_parts_total{landing=\"copied\"}"};
    const double received0 = metric(nd, landed[0]), copied0 = metric(nd, landed[1]);
    int n_padded = 0;
    for (int i = 0; i < N; i++) {
        snprintf(rid[i], sizeof rid[i], "batch-%d", i);
        kc_status st;
        ids[i] = reserve(nd, rid[i], (uint32_t)rq[i].n_prompt, (uint32_t)rq[i].max_tokens,
                         rq[i].policy, 0, &st);
        REQUIRE(ids[i], "Reserve %s: %s %s", rq[i].policy, kc_status_name(st.code), st.details);
        prefill(e, &rq[i], i, 1);
        REQUIRE(ship(e, nd, ids[i], &rq[i], err) == 0, "ship %s: %s", rq[i].policy, err);
        n_padded += rq[i].padded;
    }
    /* each bundle is one part, acknowledged once it is in the blocks */
    const double received = metric(nd, landed[0]) - received0, copied = metric(nd, landed[1]) - copied0;
    CHECK(received == n_padded && copied == N - n_padded,
          "%s: %g parts received into the KV blocks and %g copied, want %d and %d", model, received,
          copied, n_padded, N - n_padded);
    /* All streams open before any is read: the node decodes them together. */
    kc_stream *s[N];
    Kvrelay__V1__Sampling sampled = KVRELAY__V1__SAMPLING__INIT;
    sampled.temperature = 0.9f;
    sampled.top_k = 40;
    sampled.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
    sampled.seed = 7;
    for (int i = 0; i < N; i++) {
        uint32_t stop = rq[i].stop_at > 0 ? (uint32_t)rq[i].want[rq[i].stop_at] : 0;
        s[i] = decode_open_forced(nd, ids[i], rid[i],
                                  (uint32_t)(rq[i].decode_max ? rq[i].decode_max : rq[i].max_tokens),
                                  rq[i].sampled ? &sampled : NULL, 30000, &stop,
                                  rq[i].stop_at > 0, rq[i].forced ? rq[i].forced_ids : NULL,
                                  rq[i].forced ? (size_t)rq[i].max_tokens - 1 : 0);
    }
    for (int i = 0; i < N; i++) {
        streamed out;
        decode_read(s[i], &out);
        kc_stream_close(s[i]);
        CHECK(out.rc == 0 && out.n_finish == 1, "%s %s: stream ended %s %s", model, rq[i].policy,
              kc_status_name(out.st.code), out.st.details);
        int diff = 0; /* first index where the node and one process disagree */
        while (diff < out.n && diff < rq[i].n_want && out.ids[diff] == rq[i].want[diff])
            diff++;
        CHECK(out.n == rq[i].n_want && diff == out.n,
              "%s %s%s: %d tokens streamed, %d from one process; first difference at token %d "
              "(node %d, one process %d)", model, rq[i].policy,
              rq[i].sampled ? " (seeded sampling)" : "", out.n, rq[i].n_want, diff,
              diff < out.n ? out.ids[diff] : -1, diff < rq[i].n_want ? rq[i].want[diff] : -1);
        CHECK(out.completion_tokens == (uint32_t)(1 + out.n), "completion_tokens %u = 1 + %d",
              out.completion_tokens, out.n);
        CHECK(out.reason == rq[i].want_reason, "%s: finish reason %d, want %d", rq[i].policy,
              out.reason, rq[i].want_reason);
        CHECK(out.n <= 1 || out.footprint_full > 0, "decode footprint reported");
        if (!rq[i].forced) {
            CHECK(out.n_lps == 0, "%s: logprobs sent unasked", rq[i].policy);
            continue;
        }
        int same = out.n_lps == rq[i].n_want;
        for (int k = 0; same && k < out.n_lps; k++) /* bit for bit; NaN fails */
            same = out.lps[k] == rq[i].want_lps[k] && out.tops[k] == rq[i].want_tops[k] &&
                   out.lps[k] <= 0.0f;
        CHECK(same, "%s (forced): %d logprobs; they or the top ids differ from one process's",
              rq[i].policy, out.n_lps);
    }
    CHECK(idle(nd), "%s: every block back after the batch", model);
    double sum = metric(nd, "kvrelay_batch_size_sum"), cnt = metric(nd, "kvrelay_batch_size_count");
    CHECK(cnt > 0 && sum > cnt, "%s: some step batched several sequences (batch size sum %g over "
          "%g steps)", model, sum, cnt);
}

/* Long streaming-policy generations (few blocks, many steps): cancelled mid-stream, and a
 * deadline that passes mid-stream. Both free everything. */
static void test_cancel_and_deadline(engine *e, node *nd)
{
    char err[KT_ERR_MAX];
    kc_status st;
    const uint32_t long_run = 100000; /* never reached: the stream ends first */
    enum { long_forced = 50000 }; /* forced tokens of the deadline's run: never reached either */
    for (int mode = 0; mode < 2; mode++) {
        request rq = {.policy = "streaming:sink=4,window=16", .n_prompt = 32,
                      .max_tokens = (int)long_run};
        const char *rid = mode == 0 ? "cancel" : "deadline";
        uint64_t id = reserve(nd, rid, (uint32_t)rq.n_prompt, long_run, rq.policy, 0, &st);
        REQUIRE(id, "Reserve: %s", st.details);
        prefill(e, &rq, 100 + mode, 0);
        REQUIRE(ship(e, nd, id, &rq, err) == 0, "%s", err);
        /* the deadline's run is forced, so an EOS the random model samples cannot end it early:
         * its forced tokens outlast 400 ms in any build */
        static uint32_t forced[long_forced];
        kc_stream *s = mode == 0 ? decode_open(nd, id, rid, long_run, NULL, 30000)
                                 : decode_open_forced(nd, id, rid, long_forced + 1, NULL, 400, NULL, 0,
                                                      forced, long_forced);
        int got = 0, rc;
        ProtobufCMessage *m;
        if (mode == 0) {
            while (got < 5 && (rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor,
                                                   &m, &st)) == 1) {
                got++;
                kc_message_free(m);
            }
            CHECK(got == 5, "tokens before the cancel: %d", got);
            Kvrelay__V1__Node *n1 = status(nd);
            CHECK(n1 && n1->running_requests == 1 && n1->free_kv_blocks < n1->total_kv_blocks,
                  "a running sequence holds blocks");
            kc_message_free((ProtobufCMessage *)n1);
            kc_stream_cancel(s);
        } else {
            while ((rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, &m, &st)) == 1) {
                got++;
                kc_message_free(m);
            }
            CHECK(rc == -1 && st.code == GRPC_STATUS_DEADLINE_EXCEEDED,
                  "deadline mid-stream: %s after %d messages", kc_status_name(st.code), got);
        }
        kc_stream_close(s);
        CHECK(idle(nd), "%s mid-stream: zero reserved and used blocks afterwards", rid);
        CHECK(release(nd, id) == 0, "the %s reservation is gone", rid);
    }

    /* A deadline passing while the Decode call waits for a bundle that never comes. */
    uint64_t id = reserve(nd, "nobundle", 20, 10, "full", 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    kc_stream *s = decode_open(nd, id, "nobundle", 10, NULL, 300);
    streamed out;
    decode_read(s, &out);
    kc_stream_close(s);
    CHECK(out.rc == -1 && out.st.code == GRPC_STATUS_DEADLINE_EXCEEDED,
          "waiting Decode past its deadline: %s", kc_status_name(out.st.code));
    CHECK(idle(nd), "a Decode that gave up waiting returns its reservation's blocks");
}

static void test_refusals(engine *e, node *nd)
{
    kc_status st;
    CHECK(release(nd, 12345) == 0, "Release of an unknown id: released=false");
    CHECK(release(nd, 0) == 0, "Release of id 0: released=false");

    /* Larger than the whole pool: OUT_OF_RANGE (waiting would not help); larger than what is
     * free now: RESOURCE_EXHAUSTED (the router waits or tries another node). Bad fields, each
     * named. */
    CHECK(reserve(nd, "big", 100000, 10, "full", 0, &st) == 0 &&
          st.code == GRPC_STATUS_OUT_OF_RANGE, "over the pool: %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "need ");
    CHECK_ERR_HAS(st.details, "whole pool");
    uint64_t half = reserve(nd, "half", 6900, 10, "full", 0, &st);
    CHECK(half != 0, "a reservation of most of the pool: %s %s", kc_status_name(st.code), st.details);
    CHECK(reserve(nd, "full-now", 6900, 10, "full", 0, &st) == 0 &&
          st.code == GRPC_STATUS_RESOURCE_EXHAUSTED, "over what is free: %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, " free");
    CHECK(release(nd, half) == 1, "release of the big reservation");
    CHECK(reserve(nd, "bad", 0, 10, "full", 0, &st) == 0 &&
          st.code == GRPC_STATUS_INVALID_ARGUMENT, "prompt_tokens 0: %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "prompt_tokens");
    CHECK(reserve(nd, "bad", 10, 0, "full", 0, &st) == 0 &&
          st.code == GRPC_STATUS_INVALID_ARGUMENT, "max_tokens 0: %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "max_tokens");
    CHECK(reserve(nd, "bad", 10, 10, "nosuch:x=1", 0, &st) == 0 &&
          st.code == GRPC_STATUS_INVALID_ARGUMENT, "unknown policy: %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "nosuch");
    CHECK(reserve(nd, "bad", 10, 10, "streaming:window=-3", 0, &st) == 0 &&
          st.code == GRPC_STATUS_INVALID_ARGUMENT, "bad policy value: %s", kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "window");
    CHECK(reserve(nd, "bad", 200000, 10, "full", 0, &st) == 0 &&
          st.code == GRPC_STATUS_INVALID_ARGUMENT, "prompt over the context: %s",
          kc_status_name(st.code));
    CHECK_ERR_HAS(st.details, "context");

    /* Decode of a reservation that does not exist. */
    kc_stream *s = decode_open(nd, 777, "ghost", 10, NULL, 5000);
    streamed out;
    decode_read(s, &out);
    kc_stream_close(s);
    CHECK(out.rc == -1 && out.st.code == GRPC_STATUS_NOT_FOUND, "Decode of an unknown id: %s",
          kc_status_name(out.st.code));
    /* Forced ids: exactly max_tokens - 1 of them, each in the vocabulary (checked before the
     * reservation is looked at). */
    uint32_t forced[3] = {1, 2, (uint32_t)e->cfg->vocab_size};
    s = decode_open_forced(nd, 777, "forced-count", 10, NULL, 5000, NULL, 0, forced, 2);
    decode_read(s, &out);
    kc_stream_close(s);
    CHECK(out.rc == -1 && out.st.code == GRPC_STATUS_INVALID_ARGUMENT,
          "2 forced ids for max_tokens 10: %s", kc_status_name(out.st.code));
    CHECK_ERR_HAS(out.st.details, "forced");
    s = decode_open_forced(nd, 777, "forced-vocab", 4, NULL, 5000, NULL, 0, forced, 3);
    decode_read(s, &out);
    kc_stream_close(s);
    CHECK(out.rc == -1 && out.st.code == GRPC_STATUS_INVALID_ARGUMENT,
          "a forced id outside the vocabulary: %s", kc_status_name(out.st.code));
    CHECK_ERR_HAS(out.st.details, "forced[2]");

    /* A bundle for another model: refused as it arrives, before a row is copied, with a clear
     * error naming both fingerprints that the sender hears and the Decode call reports; blocks
     * returned. */
    request rq = {.policy = "full", .n_prompt = 20, .max_tokens = 8,
                  .fingerprint = "0123456789abcdef"};
    uint64_t id = reserve(nd, "other-model", 20, 8, "full", 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    refused_on_arrival(e, nd, id, &rq, 200, "other-model", "0123456789abcdef",
                       kr_model_fingerprint(e->m));

    /* A bundle under another policy than reserved: the same, naming both policies. */
    request rq2 = {.policy = "streaming:sink=4,window=16", .n_prompt = 20, .max_tokens = 8};
    id = reserve(nd, "other-policy", 20, 8, "full", 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    refused_on_arrival(e, nd, id, &rq2, 201, "other-policy", "policy 'streaming:",
                       "reservation's 'full");

    /* A bundle longer than its reservation: refused as it arrives, as soon as its rows would
     * take blocks beyond the reservation's (promised to others), before any Decode check. */
    request rq5 = {.policy = "full", .n_prompt = 40, .max_tokens = 1};
    id = reserve(nd, "too-long", 8, 1, "full", 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    refused_on_arrival(e, nd, id, &rq5, 203, "too-long", "blocks, more than the",
                       "its reservation holds");
    /* The same refusals for bundles padded to the node's blocks: made by the placement hook,
     * when the head arrives, before a run of blocks is taken. */
    request rqp = {.policy = "full", .n_prompt = 20, .max_tokens = 8,
                   .fingerprint = "0123456789abcdef", .padded = 1};
    id = reserve(nd, "other-model-padded", 20, 8, "full", 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    refused_on_arrival(e, nd, id, &rqp, 204, "other-model-padded", "0123456789abcdef",
                       kr_model_fingerprint(e->m));
    request rqp5 = {.policy = "full", .n_prompt = 40, .max_tokens = 1, .padded = 1};
    id = reserve(nd, "too-long-padded", 8, 1, "full", 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    refused_on_arrival(e, nd, id, &rqp5, 205, "too-long-padded", "blocks, more than the",
                       "its reservation holds");
    CHECK(idle(nd), "refused bundles return their blocks");

    /* A bundle whose lists never trim against a reservation sized for streaming's window: the
     * lists would grow past the reservation's blocks into blocks promised to others. Refused
     * naming a list and the numbers; the reservation's blocks go back, and a bundle with the
     * policy's own rules for the same reservation size decodes. */
    request rq3 = {.policy = "streaming:sink=4,window=16", .n_prompt = 40, .max_tokens = 60,
                   .never_trims = 1};
    int64_t promised = 0;
    id = reserve(nd, "never-trims", 40, 60, rq3.policy, 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    Kvrelay__V1__Node *n0 = status(nd);
    if (n0)
        promised = (int64_t)n0->reserved_kv_blocks;
    kc_message_free((ProtobufCMessage *)n0);
    ship_and_decode(e, nd, id, &rq3, 202, 0, "never-trims", 60, 5000, &out);
    CHECK(out.rc == -1 && out.st.code == GRPC_STATUS_FAILED_PRECONDITION,
          "a bundle whose rules never trim: %s %s", kc_status_name(out.st.code), out.st.details);
    CHECK_ERR_HAS(out.st.details, "decode rules could need");
    CHECK_ERR_HAS(out.st.details, "window dense");
    CHECK_ERR_HAS(out.st.details, "list (layer ");
    char held[64];
    snprintf(held, sizeof held, "the reservation's %" PRId64 ";", promised);
    CHECK(promised > 0, "the reservation showed in Status");
    CHECK_ERR_HAS(out.st.details, held);
    CHECK(idle(nd), "the refused bundle's reservation returns its blocks");
    request rq4 = {.policy = "streaming:sink=4,window=16", .n_prompt = 40, .max_tokens = 60};
    id = reserve(nd, "trims", 40, 60, rq4.policy, 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    ship_and_decode(e, nd, id, &rq4, 202, 1, "trims", 60, 20000, &out);
    int same = out.n == rq4.n_want;
    for (int i = 0; same && i < out.n; i++)
        same = out.ids[i] == rq4.want[i];
    CHECK(out.rc == 0 && same, "the policy's own rules: ended %s %s with %d tokens (%d from one "
          "process, %s)", kc_status_name(out.st.code), out.st.details, out.n, rq4.n_want,
          same ? "equal" : "different");
    CHECK(idle(nd), "the decoded reservation returns its blocks");

    /* Release of a waiting reservation, then of the same id again. */
    id = reserve(nd, "rel", 20, 8, "full", 0, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    Kvrelay__V1__Node *n1 = status(nd);
    CHECK(n1 && n1->reserved_kv_blocks > 0 && n1->free_kv_blocks < n1->total_kv_blocks,
          "a reservation shows in Status");
    kc_message_free((ProtobufCMessage *)n1);
    CHECK(release(nd, id) == 1, "Release of a waiting reservation: released=true");
    CHECK(release(nd, id) == 0, "Release again: released=false");
    CHECK(idle(nd), "released reservation returns its blocks");

    /* Garbage bytes on every method: INVALID_ARGUMENT, and the node serves on. */
    static const uint8_t garbage[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01, 0x02};
    const char *paths[] = {P_RESERVE, P_DECODE, P_RELEASE, P_STATUS};
    for (int i = 0; i < 4; i++) {
        ProtobufCMessage *resp = NULL;
        if (i == 1) { /* streaming: the same bytes through the raw unary path reach it too */
            kc_unary_bytes(nd->ch, paths[i], garbage, sizeof garbage,
                           &kvrelay__v1__decode_response__descriptor, 5000, &resp, &st);
        } else {
            kc_unary_bytes(nd->ch, paths[i], garbage, sizeof garbage,
                           &kvrelay__v1__node__descriptor, 5000, &resp, &st);
        }
        CHECK(st.code == GRPC_STATUS_INVALID_ARGUMENT, "garbage to %s: %s %s", paths[i],
              kc_status_name(st.code), st.details);
        kc_message_free(resp);
    }
    Kvrelay__V1__Node *n2 = status(nd);
    CHECK(n2 != NULL, "still serving after garbage");
    kc_message_free((ProtobufCMessage *)n2);
}

/* A reservation nobody uses expires and returns its blocks; a late bundle is refused. */
static void test_expiry(engine *e, node *nd)
{
    kc_status st;
    char err[KT_ERR_MAX];
    uint64_t id = reserve(nd, "expire", 20, 8, "full", 300, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    CHECK(idle(nd), "the unused reservation expired and returned its blocks");
    request rq = {.policy = "full", .n_prompt = 20, .max_tokens = 8};
    prefill(e, &rq, 300, 0);
    CHECK(ship(e, nd, id, &rq, err) != 0, "a bundle after expiry is refused");
    CHECK_ERR_HAS(err, "expired");
    kc_stream *s = decode_open(nd, id, "expire", 8, NULL, 5000);
    streamed out;
    decode_read(s, &out);
    kc_stream_close(s);
    CHECK(out.rc == -1 && (out.st.code == GRPC_STATUS_FAILED_PRECONDITION ||
                           out.st.code == GRPC_STATUS_NOT_FOUND),
          "Decode of an expired reservation: %s %s", kc_status_name(out.st.code), out.st.details);

    /* Expiry after the bundle arrived (no Decode ever comes). The bundle is made first so that
     * only the send has to fit in the ttl, and the ttl is long enough for a loaded machine. */
    prefill(e, &rq, 301, 0);
    id = reserve(nd, "expire-ready", 20, 8, "full", 2000, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    REQUIRE(ship(e, nd, id, &rq, err) == 0, "%s", err);
    CHECK(idle(nd), "a received but unused reservation expires too");
    CHECK(metric(nd, "kvrelay_decode_reservations_expired_total") >= 2, "expiries counted");
    CHECK(metric(nd, "kvrelay_kv_blocks_reserved") == 0, "/metrics: nothing reserved");
}

/* Reserves, prefills (with the one-process continuation when `oracle`) and ships one
 * request; returns the reservation id. */
static uint64_t ready(engine *e, node *nd, request *rq, const char *rid, int salt, int oracle)
{
    kc_status st;
    char err[KT_ERR_MAX];
    uint64_t id = reserve(nd, rid, (uint32_t)rq->n_prompt, (uint32_t)rq->max_tokens, rq->policy,
                          0, &st);
    REQUIRE(id, "Reserve %s: %s %s", rid, kc_status_name(st.code), st.details);
    prefill(e, rq, salt, oracle);
    REQUIRE(ship(e, nd, id, rq, err) == 0, "ship %s: %s", rid, err);
    return id;
}

/* A finished stream against its one-process continuation. */
static void check_stream(kc_stream *s, const request *rq, const char *what)
{
    streamed out;
    decode_read(s, &out);
    kc_stream_close(s);
    int same = out.n == rq->n_want;
    for (int i = 0; same && i < out.n; i++)
        same = out.ids[i] == rq->want[i];
    CHECK(out.rc == 0 && out.n_finish == 1 && same, "%s: ended %s %s with %d tokens (%d from "
          "one process, %s)", what, kc_status_name(out.st.code), out.st.details, out.n,
          rq->n_want, same ? "equal" : "different");
}

/* A decode node killed with SIGKILL and started again on the same gRPC and UCX
 * ports serves a sender (this test's transport, standing for a prefill node) that had sent
 * bundles to the old process: the transport drops the dead endpoint and makes a new one. */
/* An --http port another process holds: start-up fails with status 1 and a message, and the
 * process exits cleanly (it used to return with its batching loop and gRPC server running,
 * which aborted in glibc's thread teardown). */
static void test_http_port_taken(const char *bin, const char *model)
{
    int fd, port = test_port_held(&fd);
    REQUIRE(port > 0, "a listening socket: %s", strerror(errno));
    char http[64];
    snprintf(http, sizeof http, "127.0.0.1:%d", port);
    char *argv[] = {(char *)bin, "--model", (char *)model, "--id", "decode-taken", "--listen", "127.0.0.1:0",
                    "--transfer", "127.0.0.1:0", "--http", http, "--kv-blocks", "64", "--threads", "1", NULL};
    int status = test_proc_run(argv);
    CHECK(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1, "a taken --http %s: status %#x, not exit 1",
          http, (unsigned)status);
    close(fd);
}

static void test_restart(engine *e, node *nd, const char *bin, const char *model)
{
    request rq = {.policy = "full", .n_prompt = 24, .max_tokens = 12};
    uint64_t id = ready(e, nd, &rq, "before-kill", 400, 1);
    check_stream(decode_open(nd, id, "before-kill", 12, NULL, 30000), &rq, "before the kill");

    char listen[128], transfer[160];
    snprintf(listen, sizeof listen, "%s", nd->proc.grpc);
    snprintf(transfer, sizeof transfer, "%s:%u", nd->xfer_host, nd->xfer_port);
    kc_channel_destroy(nd->ch);
    int st = test_proc_stop(&nd->proc, SIGKILL, 10.0);
    CHECK(st >= 0 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "SIGKILL: status %d", st);

    /* A send to the dead node fails (it does not hang to its timeout: no assert on time). */
    char err[KT_ERR_MAX];
    request dead = {.policy = "full", .n_prompt = 20, .max_tokens = 4};
    prefill(e, &dead, 401, 0);
    CHECK(ship(e, nd, 12345, &dead, err) != 0, "a bundle to the killed node fails");

    node_start(nd, bin, model, listen, transfer, "30");
    CHECK(strcmp(nd->proc.grpc, listen) == 0, "restarted on the same gRPC address %s (%s)",
          listen, nd->proc.grpc);
    request again = {.policy = "streaming:sink=4,window=16", .n_prompt = 30, .max_tokens = 16};
    id = ready(e, nd, &again, "after-restart", 402, 1);
    check_stream(decode_open(nd, id, "after-restart", 16, NULL, 30000), &again,
                 "after the restart on the same ports");
    CHECK(idle(nd), "after the restart: every block back");
}

/* A node in RMA mode: each reservation maps a buffer and takes a run of KV blocks, mapped too;
 * a bundle padded to the node's blocks in their dtype has its K and V put into the run and the
 * lists adopt it, any other is put whole into the buffer and copied. The tokens equal one
 * process's either way; the run is out of the pool while the bundle is awaited, and every block
 * comes back afterwards, and from a reservation released before its bundle came. */
static void test_rma(engine *e, const char *bin, const char *model)
{
    node nd;
    node_start_mode(&nd, bin, model, "127.0.0.1:0", "127.0.0.1:0", "30", "rma", KV_BLOCKS);
    request rq[] = {
        {.policy = "full", .n_prompt = 37, .max_tokens = 30, .padded = 1},
        {.policy = "streaming:sink=4,window=16", .n_prompt = 50, .max_tokens = 30, .padded = 1},
        {.policy = "take:budget=16,warmup_budget=32,warmup_layers=1,probe=8", .n_prompt = 48,
         .max_tokens = 30, .padded = 1},
        {.policy = heads_spec, .n_prompt = 40, .max_tokens = 30, .padded = 1},
        {.policy = "snapkv:mode=patched,obs=8,budget=16", .n_prompt = 45, .max_tokens = 30},
    };
    enum { N = sizeof rq / sizeof rq[0] };
    const char *landed[2] = {"kvrelay_decode_bundle_parts_total{landing=\"received\"}",
                             "kvrelay_decode_bundle_parts_total{landing=\"copied\"}"};
    uint64_t ids[N];
    char rid[N][32];
    int n_padded = 0;
    for (int i = 0; i < N; i++) {
        snprintf(rid[i], sizeof rid[i], "rma-%d", i);
        ids[i] = ready(e, &nd, &rq[i], rid[i], 500 + i, 1);
        n_padded += rq[i].padded;
    }
    const double received = metric(&nd, landed[0]), copied = metric(&nd, landed[1]);
    CHECK(received == n_padded && copied == N - n_padded,
          "RMA: %g parts put into the KV blocks and %g copied, want %d and %d", received, copied,
          n_padded, N - n_padded);
    kc_stream *s[N];
    for (int i = 0; i < N; i++)
        s[i] = decode_open(&nd, ids[i], rid[i], (uint32_t)rq[i].max_tokens, NULL, 30000);
    for (int i = 0; i < N; i++)
        check_stream(s[i], &rq[i], rq[i].policy);

    /* A reservation's run is out of the pool until it ends; released unused, it comes back. */
    kc_status st;
    uint64_t id = reserve(&nd, "rma-released", 40, 8, "full", 0, &st);
    REQUIRE(id, "Reserve: %s %s", kc_status_name(st.code), st.details);
    CHECK(grant_of(id)->rows.bytes > 0, "RMA: the reservation took a run of blocks for K and V");
    Kvrelay__V1__Node *ns = status(&nd);
    CHECK(ns && ns->free_kv_blocks < ns->total_kv_blocks, "RMA: the run is out of the pool (%" PRIu64
          " of %" PRIu64 " free)", ns ? ns->free_kv_blocks : 0, ns ? ns->total_kv_blocks : 0);
    kc_message_free((ProtobufCMessage *)ns);
    CHECK(release(&nd, id) == 1, "RMA: Release of a waiting reservation");
    CHECK(idle(&nd), "RMA: every block back");
    kc_channel_destroy(nd.ch);
    int rc = test_proc_stop(&nd.proc, SIGTERM, 30.0);
    CHECK(rc >= 0 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "RMA node, SIGTERM: exit 0 (%d)", rc);

    /* A pool with room for a reservation's bound but not for the run beside it: the reservation
     * goes without one (no rows, no block size asked), the padded bundle is put whole into its
     * buffer and copied, and decodes as one process does. The bound and the run as the node
     * computes them: every list at the prompt's length (full), in 16-entry blocks. */
    const kr_config *c = e->cfg;
    request one = {.policy = "full", .n_prompt = 40, .max_tokens = 20, .padded = 1};
    char err[KR_ERR_MAX];
    kr_kv_pool *pool;
    kr_policy *pol;
    REQUIRE(kr_kv_pool_create(c->head_dim, 16, 1, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_policy_parse(one.policy, c, &pol, err) == KR_OK, "%s", err);
    const int64_t need = kr_seq_blocks_bound(pool, pol, c->n_layers, c->n_kv_heads, one.n_prompt,
                                             one.max_tokens - 1);
    const int64_t run = (int64_t)c->n_layers * c->n_kv_heads * ((one.n_prompt + 15) / 16);
    kr_policy_free(pol);
    kr_kv_pool_free(pool);
    REQUIRE(need > 0 && run > 0 && run <= need, "bound %" PRId64 ", run %" PRId64, need, run);
    node_start_mode(&nd, bin, model, "127.0.0.1:0", "127.0.0.1:0", "30", "rma", (int)(need + run - 1));
    const double copied0 = metric(&nd, landed[1]);
    id = ready(e, &nd, &one, "rma-no-run", 520, 1);
    CHECK(grant_of(id)->rma.rkey_len && !grant_of(id)->rows.bytes,
          "RMA: with room for the bound only, a reservation mapped without a run");
    check_stream(decode_open(&nd, id, "rma-no-run", (uint32_t)one.max_tokens, NULL, 30000), &one,
                 "RMA without a run");
    CHECK(metric(&nd, landed[1]) - copied0 == 1, "RMA without a run: the part copied");
    CHECK(idle(&nd), "RMA without a run: every block back");
    kc_channel_destroy(nd.ch);
    rc = test_proc_stop(&nd.proc, SIGTERM, 30.0);
    CHECK(rc >= 0 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "RMA node, SIGTERM: exit 0 (%d)", rc);
}

/* SIGTERM drains. A stream running at the signal and a reservation whose Decode
 * comes after it are decoded to their end (same tokens as one process); a new Reserve is
 * refused UNAVAILABLE "draining"; health says NOT_SERVING, /healthz 503 "draining", Status
 * DRAINING; then the node exits 0 by itself. */
static void test_drain(engine *e, node *nd)
{
    request a = {.policy = "full", .n_prompt = 30, .max_tokens = 40};
    request b = {.policy = "streaming:sink=4,window=16", .n_prompt = 26, .max_tokens = 30};
    uint64_t ida = ready(e, nd, &a, "drain-running", 500, 1);
    uint64_t idb = ready(e, nd, &b, "drain-reserved", 501, 1);
    kc_stream *sa = decode_open(nd, ida, "drain-running", 40, NULL, 60000);
    ProtobufCMessage *m;
    kc_status st;
    REQUIRE(kc_stream_next(sa, &kvrelay__v1__decode_response__descriptor, &m, &st) == 1,
            "the running stream's first message: %s", st.details);
    /* Put the message back in the comparison: read_rest below starts after it. */
    const Kvrelay__V1__DecodeResponse *r0 = (const void *)m;
    int n0 = r0->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS ? (int)r0->tokens->n_ids
                                                                          : 0;
    int32_t first[MAX_OUT];
    for (int i = 0; i < n0 && i < MAX_OUT; i++)
        first[i] = (int32_t)r0->tokens->ids[i];
    kc_message_free(m);

    kill(nd->proc.pid, SIGTERM);
    Kvrelay__V1__Node *s = NULL;
    for (int i = 0; i < 100; i++) { /* the signal is read by the node's main thread */
        kc_message_free((ProtobufCMessage *)s);
        s = status(nd);
        if (s && s->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING)
            break;
        sleep_ms(20);
    }
    CHECK(s && s->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING, "Status: DRAINING");
    kc_message_free((ProtobufCMessage *)s);
    const char *hz = http_get(nd, "/healthz");
    CHECK(strstr(hz, " 503 ") && strstr(hz, "draining"), "/healthz while draining: %.80s", hz);
    CHECK(health_serving(nd) == 0, "grpc.health.v1: NOT_SERVING while draining");
    CHECK(reserve(nd, "drain-new", 20, 8, "full", 0, &st) == 0 &&
          st.code == GRPC_STATUS_UNAVAILABLE && strstr(st.details, "draining"),
          "Reserve while draining: %s %s", kc_status_name(st.code), st.details);

    check_stream(decode_open(nd, idb, "drain-reserved", 30, NULL, 60000), &b,
                 "a reservation made before the drain, decoded during it");
    streamed out;
    decode_read(sa, &out);
    kc_stream_close(sa);
    int same = n0 + out.n == a.n_want;
    for (int i = 0; same && i < n0 + out.n; i++)
        same = (i < n0 ? first[i] : out.ids[i - n0]) == a.want[i];
    CHECK(out.rc == 0 && out.n_finish == 1 && same, "the stream running at SIGTERM: ended %s "
          "%s with %d tokens (%d from one process, %s)", kc_status_name(out.st.code),
          out.st.details, n0 + out.n, a.n_want, same ? "equal" : "different");

    kc_channel_destroy(nd->ch);
    int code = test_proc_stop(&nd->proc, 0, 30.0); /* signal 0: just wait for the exit */
    CHECK(code >= 0 && WIFEXITED(code) && WEXITSTATUS(code) == 0,
          "the drained node exits 0 by itself (status %d)", code);
}

/* Work that does not end by itself during a drain (a Decode waiting for a bundle nobody
 * sends; a running stream could meet EOS): it ends UNAVAILABLE when --drain-timeout-s passes
 * (second == 0) or at a second SIGTERM (second == 1, an impatient operator: the shutdown under
 * way must not die of it); the node exits 0 either way. */
static void test_drain_cut(node *nd, int second)
{
    kc_status st;
    uint64_t id = reserve(nd, "drain-cut", 20, 10, "full", 60000, &st);
    REQUIRE(id, "Reserve: %s", st.details);
    kc_stream *s = decode_open(nd, id, "drain-cut", 10, NULL, 120000);
    Kvrelay__V1__Node *w = NULL;
    for (int i = 0; i < 100 && !(w && w->queued_requests == 1); i++) {
        kc_message_free((ProtobufCMessage *)w);
        sleep_ms(20);
        w = status(nd);
    }
    CHECK(w && w->queued_requests == 1, "the Decode call waits for its bundle");
    kc_message_free((ProtobufCMessage *)w);
    kill(nd->proc.pid, SIGTERM);
    if (second) {
        Kvrelay__V1__Node *ns = NULL;
        for (int i = 0; i < 100; i++) {
            kc_message_free((ProtobufCMessage *)ns);
            ns = status(nd);
            if (ns && ns->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING)
                break;
            sleep_ms(20);
        }
        CHECK(ns && ns->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING,
              "draining with the Decode call waiting");
        kc_message_free((ProtobufCMessage *)ns);
        kill(nd->proc.pid, SIGTERM);
    }
    streamed out;
    decode_read(s, &out);
    kc_stream_close(s);
    /* The details are the node's "... shutting down", or gRPC's own when the server's
     * shutdown cancelled the call before the node's status went out (docs/decode-node.md). */
    CHECK(out.rc == -1 && out.st.code == GRPC_STATUS_UNAVAILABLE, "a stream cut by %s: %s %s",
          second ? "a second SIGTERM" : "the drain timeout", kc_status_name(out.st.code),
          out.st.details);
    kc_channel_destroy(nd->ch);
    int code = test_proc_stop(&nd->proc, 0, 30.0);
    CHECK(code >= 0 && WIFEXITED(code) && WEXITSTATUS(code) == 0,
          "exit 0 after %s (status %d)", second ? "a second SIGTERM" : "the drain timeout", code);
}

int main(void)
{
    const char *bin_dir = kt_env("KR_BIN"), *fix = kt_env("KR_FIXTURES");
    char bin[1024], dir[1024];
    struct stat sb;
    snprintf(bin, sizeof bin, "%s/kvrelay-decode", bin_dir ? bin_dir : ".");
    if (!fix || stat(bin, &sb) != 0) {
        printf("SKIPPED: %s\n", !fix ? "KR_FIXTURES not set" : "kvrelay-decode is not built");
        return KT_SKIP;
    }
    signal(SIGPIPE, SIG_IGN);
    static const char *models[] = {"llama3-tiny", "mistral-tiny"};
    for (int mi = 0; mi < 2; mi++) {
        snprintf(dir, sizeof dir, "%s/models/%s", fix, models[mi]);
        if (stat(dir, &sb) != 0) {
            printf("SKIPPED: fixture %s is absent\n", dir);
            return KT_SKIP;
        }
        engine e;
        engine_init(&e, dir);
        char tmp[] = "/tmp/kvrelay-test-decode-XXXXXX";
        REQUIRE(mkdtemp(tmp), "mkdtemp");
        policy_files(e.cfg, tmp);
        node nd;
        node_start(&nd, bin, dir, "127.0.0.1:0", "127.0.0.1:0", "30");
        test_batch_equals_one_process(&e, &nd, models[mi]);
        if (mi == 0) { /* the node's behaviour does not depend on the model: once is enough */
            test_cancel_and_deadline(&e, &nd);
            test_refusals(&e, &nd);
            test_expiry(&e, &nd);
            test_restart(&e, &nd, bin, dir);
            test_rma(&e, bin, dir);
            test_http_port_taken(bin, dir);
            test_drain(&e, &nd);
            node_start(&nd, bin, dir, "127.0.0.1:0", "127.0.0.1:0", "1");
            test_drain_cut(&nd, 0);
            node_start(&nd, bin, dir, "127.0.0.1:0", "127.0.0.1:0", "30");
            test_drain_cut(&nd, 1);
        } else {
            kc_channel_destroy(nd.ch);
            int st = test_proc_stop(&nd.proc, SIGTERM, 30.0);
            CHECK(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "SIGTERM: exit 0 (%d)", st);
        }
        engine_free(&e);
        char path[200];
        snprintf(path, sizeof path, "%s/gates.tsv", tmp);
        unlink(path);
        snprintf(path, sizeof path, "%s/windows.txt", tmp);
        unlink(path);
        rmdir(tmp);
    }
    return kt_done("test_decode_node");
}
