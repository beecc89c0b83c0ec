/*
 * test_prefill_node.c - kvrelay-prefill as a black box: the real program on fixture models
 * (llama3-tiny with f32 bundles and --queue 8, mistral-tiny with bf16 bundles and --queue 0),
 * with this test playing both of its peers: the router (Prefill and Status over real gRPC) and
 * the decode node (a UCX listener that reserves room for each bundle, as large as the decode
 * node's bound, with KT_RESERVE_PARSE).
 * Checked: each received bundle parses and matches an in-process kr_prefill with the same policy
 * and chunk list by list (positions, pinned, windows, K and V bit for bit; bf16 payloads equal
 * the f32 reference rounded), its header and the first token (greedy argmax, a seeded
 * sampler, and a forced id whose first_logprob and first_top_id equal kr_logprob on the
 * reference's logits bit for bit), the usage counts; every invalid field refused with INVALID_ARGUMENT naming it; the
 * receiver's refusals and a dead address as UNAVAILABLE with the transport's message; a pool
 * overflow; concurrent calls; the queue bound (RESOURCE_EXHAUSTED), FIFO order and a deadline
 * that passes in the queue, made deterministic by a transfer address that accepts TCP but never
 * speaks UCX (the worker is stuck in its send until the test closes it) and by polling Status;
 * garbage bytes; gRPC health and /metrics; SIGTERM -> exit 0, idle and with a call in flight;
 * the SIGTERM drain: new calls UNAVAILABLE "draining", health NOT_SERVING, Status
 * DRAINING, the queued job runs to its end, or ends UNAVAILABLE at --drain-timeout-s.
 * Run: ctest -R test_prefill_node (a few seconds under the sanitizers). Exit 77 (SKIPPED) when
 * kvrelay-prefill is not built, a fixture model is missing, or UCX cannot listen on loopback.
 */
#include "kr_test.h"
#include "proc.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>

#include "bundle.h"
#include "quant_bound.h"
#include "grpc/health/v1/health.pb-c.h"
#include "kr.h"
#include "kvrelay/v1/internal.pb-c.h"
#include "rpc.h"
#include "transport.h"

#define PREFILL "/kvrelay.v1.Prefill/Prefill"
#define STATUS "/kvrelay.v1.Prefill/Status"
#define CHUNK 16
#define MAX_PROMPT 200
#define BLOCK 16
#define QUEUE 8 /* node A's --queue */
#define QUEUE_S "8"

static const char *bin_dir, *fixtures;
static kt_transport *rx; /* this test's decode-node side */
static char rx_addr[64];
static uint64_t next_resv = 1000;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ the decode-node side */

typedef struct resv {
    pthread_mutex_t m;
    pthread_cond_t c;
    uint64_t id;
    uint8_t token[KT_RESV_TOKEN_BYTES];
    uint8_t *buf;
    uint64_t cap;
    kt_bundle_view parts[4 + KT_BUNDLE_MAX_EARLY_PARTS]; /* the fixtures have up to 4 layers */
    kt_bundle_set set; /* the whole bundle, or a pipelined transfer's layer segments */
    int done, status;
    int order; /* completions before this one, over all reservations */
    uint64_t bytes;
    char msg[KT_ERR_MAX];
} resv;

static atomic_int n_completed;

static void resv_cb(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    resv *r = arg;
    pthread_mutex_lock(&r->m);
    r->done = 1;
    r->order = atomic_fetch_add(&n_completed, 1);
    r->status = status;
    r->bytes = bytes;
    snprintf(r->msg, sizeof r->msg, "%s", err ? err : "");
    pthread_cond_broadcast(&r->c);
    pthread_mutex_unlock(&r->m);
    (void)id;
}

static void resv_open(resv *r, uint64_t cap)
{
    memset(r, 0, sizeof r[0]);
    pthread_mutex_init(&r->m, NULL);
    pthread_cond_init(&r->c, NULL);
    r->id = next_resv++;
    r->cap = cap;
    r->buf = malloc(cap);
    kt_bundle_set_init(&r->set, r->parts, 4 + KT_BUNDLE_MAX_EARLY_PARTS);
    char err[KT_ERR_MAX];
    const kt_resv_opts o = {.timeout_s = 60.0, .set = &r->set, .cb = resv_cb, .cb_arg = r};
    REQUIRE(r->buf && kt_transport_reserve(rx, r->id, r->buf, cap, &o, r->token, err) == 0,
            "reserve: %s", err);
}

/* Waits for the reservation's outcome (it comes at once after a successful Prefill: the sender
 * returned only after the receiver acknowledged). */
static int resv_wait(resv *r)
{
    double end = now_s() + 20;
    pthread_mutex_lock(&r->m);
    while (!r->done && now_s() < end) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&r->c, &r->m, &ts);
    }
    int d = r->done;
    pthread_mutex_unlock(&r->m);
    return d;
}

static void resv_close(resv *r)
{
    kt_transport_release(rx, r->id); /* -1 when already completed: fine */
    free(r->buf);
    pthread_cond_destroy(&r->c);
    pthread_mutex_destroy(&r->m);
}

/* ------------------------------------------------------------------ the reference */

typedef struct ref_model {
    const char *name;
    char dir[1024];
    kr_model *m;
    const kr_config *c;
    kr_ctx *ctx;
} ref_model;

/* One in-process prefill: what the node must have shipped. */
typedef struct ref_run {
    kr_policy *p;
    kr_kv_pool *pool;
    kr_seq *s;
    float *logits;
    int32_t greedy;
    kr_footprint fp;
    uint64_t entries;
} ref_run;

static void ref_open(ref_model *r, const char *name)
{
    memset(r, 0, sizeof *r);
    r->name = name;
    snprintf(r->dir, sizeof r->dir, "%s/models/%s", fixtures, name);
    char err[KR_ERR_MAX];
    REQUIRE(kr_model_load(r->dir, NULL, &r->m, err) == KR_OK, "%s", err);
    r->c = kr_model_config(r->m);
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 1, .max_chunk = CHUNK};
    REQUIRE(kr_ctx_create(r->m, &cp, &r->ctx, err) == KR_OK, "%s", err);
}

static void ref_close(ref_model *r)
{
    kr_ctx_free(r->ctx);
    kr_model_free(r->m);
}

static void ref_prefill(ref_model *r, const char *spec, const int32_t *tok, int n, ref_run *out)
{
    char err[KR_ERR_MAX];
    memset(out, 0, sizeof *out);
    REQUIRE(kr_policy_parse(spec, r->c, &out->p, err) == KR_OK, "policy %s: %s", spec, err);
    int per_list = (n + kr_policy_appended(out->p, n) + 2 * BLOCK) / BLOCK;
    /* the node's default KV dtype, as its own context resolves it */
    REQUIRE(kr_kv_pool_create(r->c->head_dim, BLOCK, per_list * r->c->n_layers * r->c->n_kv_heads,
                              kr_ctx_kv_dtype(r->ctx), &out->pool, err) == KR_OK,
            "%s", err);
    REQUIRE(kr_seq_create(out->pool, r->c->n_layers, r->c->n_kv_heads, &out->s, err) == KR_OK &&
                kr_seq_set_policy(out->s, out->p, err) == KR_OK,
            "%s", err);
    out->logits = malloc(sizeof(float) * (size_t)r->c->vocab_size);
    REQUIRE(out->logits, "out of memory");
    REQUIRE(kr_prefill(r->ctx, out->s, tok, n, CHUNK, KR_LOGITS_LAST, out->logits, err) == KR_OK,
            "reference prefill: %s", err);
    kr_sampling sg;
    kr_sampling_default(&sg);
    sg.greedy = 1;
    kr_sampler *sp;
    REQUIRE(kr_sampler_create(&sg, r->c->vocab_size, &sp, err) == KR_OK, "%s", err);
    out->greedy = kr_sampler_sample(sp, out->logits);
    kr_sampler_free(sp);
    kr_seq_footprint(out->s, &out->fp);
    out->entries = (uint64_t)kr_seq_entries(out->s);
}

static void ref_free(ref_run *x)
{
    kr_seq_free(x->s);
    kr_kv_pool_free(x->pool);
    kr_policy_free(x->p);
    free(x->logits);
}

/* What a decode node reserves (brief step 2): every list at min(n, max entries), f32, with room
 * for the segment headers of a pipelined transfer. */
static uint64_t decode_bound(ref_model *r, const kr_policy *p, int n)
{
    kt_bundle_header h;
    memset(&h, 0, sizeof h);
    snprintf(h.fingerprint, sizeof h.fingerprint, "%s", kr_model_fingerprint(r->m));
    h.n_layers = (uint32_t)r->c->n_layers;
    h.n_kv_heads = (uint32_t)r->c->n_kv_heads;
    h.head_dim = (uint32_t)r->c->head_dim;
    h.dtype = KT_DTYPE_F32;
    h.prompt_len = n;
    h.next_pos = n;
    snprintf(h.policy, sizeof h.policy, "%s", kr_policy_spec(p));
    int cap = kr_policy_max_entries(p, n, 0);
    int n_lists = r->c->n_layers * r->c->n_kv_heads;
    kt_bundle_list *lists = calloc((size_t)n_lists, sizeof *lists);
    for (int i = 0; i < n_lists; i++)
        lists[i] = (kt_bundle_list){
            .count = (uint32_t)(cap < n ? cap : n), .pinned = 0, .window = KT_BUNDLE_WINDOW_DENSE};
    uint64_t size = 0;
    char err[KT_ERR_MAX];
    REQUIRE(kt_bundle_size(&h, lists, &size, err) == 0, "%s", err);
    free(lists);
    return size + (uint64_t)(r->c->n_layers + KT_BUNDLE_MAX_EARLY_PARTS) * KT_BUNDLE_SEGMENT_SLACK;
}

static float round_to(kt_dtype t, float x)
{
    if (t == KT_DTYPE_BF16) return kt_bf16_to_f32(kt_f32_to_bf16(x));
    if (t == KT_DTYPE_F16) return kt_f16_to_f32(kt_f32_to_f16(x));
    return x;
}

/* The received bundle (`parts` parts: 1 for a whole bundle, a segment per layer when the node
 * pipelines) against the reference, list by list. */
static void check_bundle(ref_model *r, ref_run *x, const resv *rv, kt_dtype dtype, int n,
                         int32_t first_token, int parts, const char *what)
{
    char err[KT_ERR_MAX];
    const kt_bundle_set v = rv->set; /* parsed and assembled by the transport */
    CHECK(v.complete && v.size == rv->bytes && (int)v.n_parts == parts,
          "%s: %u parts of %" PRIu64 " bytes, want %d parts of %" PRIu64, what, v.n_parts,
          v.size, parts, rv->bytes);
    CHECK(kt_bundle_check_model(&v.hdr, kr_model_fingerprint(r->m), (uint32_t)r->c->n_layers,
                                (uint32_t)r->c->n_kv_heads, (uint32_t)r->c->head_dim, err) == 0,
          "%s: %s", what, err);
    CHECK(v.hdr.dtype == dtype, "%s: dtype %s", what, kt_dtype_name(v.hdr.dtype));
    CHECK(v.hdr.first_token == first_token, "%s: header first_token %d, response %d", what,
          v.hdr.first_token, first_token);
    CHECK(v.hdr.prompt_len == n, "%s: prompt_len %d", what, v.hdr.prompt_len);
    CHECK(v.hdr.next_pos == kr_seq_next_pos(x->s), "%s: next_pos %d, reference %d", what,
          v.hdr.next_pos, kr_seq_next_pos(x->s));
    CHECK(!strcmp(v.hdr.policy, kr_policy_spec(x->p)), "%s: policy '%s', reference '%s'", what,
          v.hdr.policy, kr_policy_spec(x->p));
    CHECK(v.n_entries == x->entries, "%s: %" PRIu64 " entries, reference %" PRIu64, what,
          v.n_entries, x->entries);
    int hd = r->c->head_dim, bad = 0;
    for (int l = 0; l < r->c->n_layers && !bad; l++)
        for (int h = 0; h < r->c->n_kv_heads && !bad; h++) {
            int len, pinned;
            kr_seq_list_shape(x->s, l, h, &len, &pinned);
            int w = kr_seq_list_window(x->s, l, h);
            kt_bundle_list lv;
            REQUIRE(kt_bundle_set_list(&v, (uint32_t)l, (uint32_t)h, &lv, err) == 0, "%s", err);
            if (lv.count != (uint32_t)len || lv.pinned != (uint32_t)pinned ||
                lv.window != (w < 0 ? KT_BUNDLE_WINDOW_DENSE : (uint32_t)w)) {
                CHECK(0, "%s: list (%d,%d): count/pinned/window %u/%u/%u, reference %d/%d/%d", what,
                      l, h, lv.count, lv.pinned, lv.window, len, pinned, w);
                bad = 1;
                break;
            }
            if (!len) continue;
            int32_t *rp = malloc(sizeof(int32_t) * (size_t)len),
                    *bp = malloc(sizeof(int32_t) * (size_t)len);
            float *rk = malloc(sizeof(float) * (size_t)len * hd),
                  *rv_ = malloc(sizeof(float) * (size_t)len * hd);
            float *bk = malloc(sizeof(float) * (size_t)len * hd),
                  *bv = malloc(sizeof(float) * (size_t)len * hd);
            REQUIRE(rp && bp && rk && rv_ && bk && bv, "out of memory");
            REQUIRE(kr_seq_list_read(x->s, l, h, 0, len, rp, rk, rv_, err) == KR_OK, "%s", err);
            REQUIRE(kt_bundle_set_read(&v, (uint32_t)l, (uint32_t)h, 0,
                                       &(kt_rows){(uint32_t)len, bp, KT_DTYPE_F32, bk, bv},
                                       err) == 0,
                    "%s", err);
            for (int i = 0; i < len * hd; i++) {
                if (kt_dtype_quantized(dtype)) { /* within the bound, then compared as equal */
                    const float *row_k = rk + i / hd * hd, *row_v = rv_ + i / hd * hd;
                    if (quant_within_bound(dtype, row_k, hd, rk[i], bk[i]) &&
                        quant_within_bound(dtype, row_v, hd, rv_[i], bv[i]))
                        continue;
                    CHECK(0, "%s: list (%d,%d) elem %d: K %a from %a, V %a from %a: past the %s bound",
                          what, l, h, i, bk[i], rk[i], bv[i], rv_[i], kt_dtype_name(dtype));
                    bad = 1;
                    break;
                }
                rk[i] = round_to(dtype, rk[i]);
                rv_[i] = round_to(dtype, rv_[i]);
            }
            if (kt_dtype_quantized(dtype)) { /* compared above */
                memcpy(rk, bk, sizeof(float) * (size_t)len * hd);
                memcpy(rv_, bv, sizeof(float) * (size_t)len * hd);
            }
            if (memcmp(rp, bp, sizeof(int32_t) * (size_t)len) ||
                memcmp(rk, bk, sizeof(float) * (size_t)len * hd) ||
                memcmp(rv_, bv, sizeof(float) * (size_t)len * hd)) {
                CHECK(0, "%s: list (%d,%d): positions, K or V differ from the reference", what, l,
                      h);
                bad = 1;
            }
            free(rp);
            free(bp);
            free(rk);
            free(rv_);
            free(bk);
            free(bv);
        }
}

/* ------------------------------------------------------------------ the node */

typedef struct node {
    test_proc p;
    kc_channel *ch;
    const char *id;
    kt_dtype dtype;
    int parts; /* a bundle's parts: a segment per layer when pipelined, else 1 */
} node;

static void node_start(node *nd, ref_model *r, const char *id, const char *queue, const char *dtype,
                       const char *transfer_timeout_s, const char *drain_timeout_s,
                       const char *pipeline)
{
    char exe[1024], max_prompt[16], chunk[16];
    snprintf(exe, sizeof exe, "%s/kvrelay-prefill", bin_dir);
    snprintf(max_prompt, sizeof max_prompt, "%d", MAX_PROMPT);
    snprintf(chunk, sizeof chunk, "%d", CHUNK);
    char *argv[] = {exe,
                    "--model",
                    r->dir,
                    "--listen",
                    "127.0.0.1:0",
                    "--http",
                    "127.0.0.1:0",
                    "--id",
                    (char *)id,
                    "--threads",
                    "1",
                    "--chunk",
                    chunk,
                    "--queue",
                    (char *)queue,
                    "--kv-dtype",
                    (char *)dtype,
                    "--max-prompt",
                    max_prompt,
                    "--transfer-timeout-s",
                    (char *)transfer_timeout_s,
                    "--drain-timeout-s",
                    (char *)drain_timeout_s,
                    "--pipeline",
                    (char *)pipeline,
                    NULL};
    REQUIRE(test_proc_start(argv, 60, &nd->p) == 0, "kvrelay-prefill %s did not start", id);
    kc_status st;
    REQUIRE(kc_channel_create(nd->p.grpc, 0, &nd->ch, &st) == 0, "channel: %s", st.details);
    nd->id = id;
    nd->parts = !strcmp(pipeline, "on") ? r->c->n_layers : 1;
    nd->dtype = !strcmp(dtype, "bf16")  ? KT_DTYPE_BF16
                : !strcmp(dtype, "f16") ? KT_DTYPE_F16
                                        : KT_DTYPE_F32;
}

static void node_stop(node *nd, const char *how)
{
    kc_channel_destroy(nd->ch);
    nd->ch = NULL;
    int status = test_proc_stop(&nd->p, SIGTERM, 60);
    CHECK(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "%s: SIGTERM (%s) should exit 0, got status %d", nd->id, how, status);
}

typedef struct call_args {
    node *nd;
    const char *rid, *policy, *addr;
    const char *wire; /* kv_wire_dtype; NULL: "" (the node's --kv-dtype) */
    const int32_t *tok;
    int n;
    uint64_t resv;
    const uint8_t *resv_token; /* NULL: KT_RESV_TOKEN_BYTES zeros (no reservation's token) */
    size_t resv_token_len;     /* 0: KT_RESV_TOKEN_BYTES */
    const Kvrelay__V1__Sampling *sampling;
    int64_t timeout_ms;
    int has_forced, logprobs; /* scoring: forced_first = forced (when has_forced), logprobs */
    uint32_t forced;
    /* outcome */
    kc_status st;
    Kvrelay__V1__PrefillResponse *resp;
} call_args;

static int prefill(call_args *a)
{
    Kvrelay__V1__PrefillRequest req = KVRELAY__V1__PREFILL_REQUEST__INIT;
    uint32_t *ids = malloc(sizeof(uint32_t) * (size_t)(a->n ? a->n : 1));
    for (int i = 0; i < a->n; i++)
        ids[i] = (uint32_t)a->tok[i];
    req.request_id = (char *)a->rid;
    req.n_token_ids = (size_t)a->n;
    req.token_ids = ids;
    req.sampling = (Kvrelay__V1__Sampling *)a->sampling;
    req.kv_policy = (char *)(a->policy ? a->policy : "");
    req.kv_wire_dtype = (char *)(a->wire ? a->wire : "");
    req.transfer_address = (char *)(a->addr ? a->addr : rx_addr);
    req.reservation_id = a->resv;
    static const uint8_t zeros[KT_RESV_TOKEN_BYTES];
    req.reservation_token = (ProtobufCBinaryData){
        .len = a->resv_token_len ? a->resv_token_len : KT_RESV_TOKEN_BYTES,
        .data = (uint8_t *)(a->resv_token ? a->resv_token : zeros)};
    req.decode_node = "test-decode";
    if (a->has_forced) {
        req.forced_first_choice_case = KVRELAY__V1__PREFILL_REQUEST__FORCED_FIRST_CHOICE_FORCED_FIRST;
        req.forced_first = a->forced;
    }
    req.logprobs = a->logprobs;
    a->resp = NULL;
    int rc = kc_unary(a->nd->ch, PREFILL, &req.base, &kvrelay__v1__prefill_response__descriptor,
                      a->timeout_ms ? a->timeout_ms : 60000, (ProtobufCMessage **)&a->resp, &a->st);
    free(ids);
    return rc;
}

static void *prefill_thread(void *p)
{
    prefill((call_args *)p);
    return NULL;
}

static Kvrelay__V1__Node *status(node *nd)
{
    Kvrelay__V1__NodeStatusRequest req = KVRELAY__V1__NODE_STATUS_REQUEST__INIT;
    Kvrelay__V1__Node *out = NULL;
    kc_status st;
    if (kc_unary(nd->ch, STATUS, &req.base, &kvrelay__v1__node__descriptor, 10000,
                 (ProtobufCMessage **)&out, &st) != 0) {
        CHECK(0, "Status: %s %s", kc_status_name(st.code), st.details);
        return NULL;
    }
    return out;
}

/* Polls Status until running/queued are as asked (a state, not a time, is awaited). */
static int wait_load(node *nd, uint32_t running, uint32_t queued)
{
    double end = now_s() + 30;
    while (now_s() < end) {
        Kvrelay__V1__Node *s = status(nd);
        int ok = s && s->running_requests == running && s->queued_requests == queued;
        kc_message_free((ProtobufCMessage *)s);
        if (ok) return 1;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    CHECK(0, "%s: load never became running %u queued %u", nd->id, running, queued);
    return 0;
}

static void make_prompt(int32_t *tok, int n, int vocab, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 12345;
    for (int i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        tok[i] = (int32_t)((x >> 8) % (uint32_t)vocab);
    }
}

/* ------------------------------------------------------------------ the cases */

static uint64_t bytes_ok[KT_DTYPE_FP8_E4M3_TOKEN + 1]; /* kv_bytes_shipped of node A's OK
                                                          answers, by payload dtype */
static int n_ok, parts_ok; /* node A's OK calls, and the bundle parts they sent */
static int n_queue_full; /* RESOURCE_EXHAUSTED answers node A gave */

/* One Prefill compared with the reference: prepared (reference run, reservation, request),
 * called (alone or with others at once), then checked. */
typedef struct pcase {
    node *nd;
    ref_model *r;
    int32_t tok[MAX_PROMPT];
    int n;
    const Kvrelay__V1__Sampling *sampling; /* NULL: greedy */
    kt_dtype wire; /* the bundle's payload dtype expected */
    int cached;    /* usage.cached_tokens expected: the prompt tokens the prefix cache gave */
    char what[160];
    ref_run x;
    resv rv;
    call_args a;
} pcase;

static void pcase_prepare(pcase *c, node *nd, ref_model *r, const char *spec, int n, uint32_t seed,
                          const Kvrelay__V1__Sampling *sampling)
{
    c->nd = nd;
    c->r = r;
    c->n = n;
    c->sampling = sampling;
    c->wire = nd->dtype;
    make_prompt(c->tok, n, r->c->vocab_size, seed);
    ref_prefill(r, *spec ? spec : "full", c->tok, n, &c->x);
    resv_open(&c->rv, decode_bound(r, c->x.p, n));
    snprintf(c->what, sizeof c->what, "%s '%s' n=%d seed=%u%s", r->name, spec, n, seed,
             sampling ? " sampled" : "");
    c->a = (call_args){.nd = nd,
                       .rid = c->what,
                       .policy = spec,
                       .tok = c->tok,
                       .n = n,
                       .resv = c->rv.id,
                       .resv_token = c->rv.token,
                       .sampling = sampling};
}

/* The parts a bundle of this case comes in: 1 from a node that does not pipeline; else a
 * segment per layer, and under `full` (every entry final once computed) an early part per chunk
 * before the last, at most KT_BUNDLE_MAX_EARLY_PARTS of them (every k-th chunk). */
static int want_parts(const pcase *c)
{
    if (c->nd->parts == 1) return 1;
    if (c->a.policy && *c->a.policy && strncmp(c->a.policy, "full", 4) != 0) return c->nd->parts;
    int ends = (c->n - 1) / CHUNK;
    int every = ends / KT_BUNDLE_MAX_EARLY_PARTS + (ends % KT_BUNDLE_MAX_EARLY_PARTS != 0);
    /* chunks that came from the prefix cache are not computed, and end no early part */
    int computed = ends - c->cached / CHUNK;
    return c->nd->parts + (every ? computed / every : 0);
}

static void pcase_check(pcase *c)
{
    const char *what = c->what;
    ref_model *r = c->r;
    ref_run *x = &c->x;
    call_args *a = &c->a;
    if (!a->resp) {
        CHECK(0, "%s: Prefill failed: %s %s", what, kc_status_name(a->st.code), a->st.details);
        goto out;
    }
    REQUIRE(resv_wait(&c->rv), "%s: the reservation never completed", what);
    CHECK(c->rv.status == 0, "%s: receive failed: %s", what, c->rv.msg);
    int32_t want = x->greedy;
    if (c->sampling) {
        kr_sampling s;
        kr_sampling_default(&s);
        s.temperature = c->sampling->temperature;
        s.top_k = (int)c->sampling->top_k;
        s.top_p = c->sampling->top_p == 0 ? 1.0f : c->sampling->top_p;
        s.seed = c->sampling->seed;
        kr_sampler *sp;
        char err[KR_ERR_MAX];
        REQUIRE(kr_sampler_create(&s, r->c->vocab_size, &sp, err) == KR_OK, "%s", err);
        want = kr_sampler_sample(sp, x->logits);
        kr_sampler_free(sp);
    }
    if (a->has_forced)
        want = (int32_t)a->forced;
    CHECK((int32_t)a->resp->first_token == want, "%s: first token %u, reference %d", what,
          a->resp->first_token, want);
    if (a->has_forced || a->logprobs) { /* the same kr_logprob on bit-identical logits */
        int32_t top;
        float lp = kr_logprob(x->logits, r->c->vocab_size, want, &top);
        CHECK(a->resp->first_logprob == lp && isfinite(lp) && lp <= 0.0f,
              "%s: first_logprob %.9g, reference %.9g", what, a->resp->first_logprob, lp);
        CHECK(a->resp->first_top_id == (uint32_t)top && top == x->greedy,
              "%s: first_top_id %u, reference %d", what, a->resp->first_top_id, top);
    } else {
        CHECK(a->resp->first_logprob == 0.0f && a->resp->first_top_id == 0,
              "%s: logprobs sent unasked (%g, %u)", what, a->resp->first_logprob,
              a->resp->first_top_id);
    }
    if (c->rv.status == 0)
        check_bundle(r, x, &c->rv, c->wire, c->n, (int32_t)a->resp->first_token, want_parts(c),
                     what);
    const Kvrelay__V1__PrefillUsage *u = a->resp->usage;
    REQUIRE(u, "%s: no usage", what);
    uint64_t entry_bytes = 2u * kt_dtype_row_bytes(c->wire, (uint32_t)r->c->head_dim);
    CHECK(!strcmp(u->kv_wire_dtype, kt_dtype_name(c->wire)), "%s: kv_wire_dtype '%s', want %s", what,
          u->kv_wire_dtype, kt_dtype_name(c->wire));
    CHECK(u->prompt_tokens == (uint32_t)c->n, "%s: prompt_tokens %u", what, u->prompt_tokens);
    CHECK(u->kv_entries_shipped == x->entries,
          "%s: kv_entries_shipped %" PRIu64 ", reference %" PRIu64, what, u->kv_entries_shipped,
          x->entries);
    CHECK(u->kv_bytes_shipped == x->entries * entry_bytes,
          "%s: kv_bytes_shipped %" PRIu64 ", want %" PRIu64 " x %" PRIu64, what,
          u->kv_bytes_shipped, x->entries, entry_bytes);
    CHECK(u->peak_kv_entries == (uint64_t)x->fp.peak_entries, "%s: peak %" PRIu64 " vs %" PRId64,
          what, u->peak_kv_entries, x->fp.peak_entries);
    CHECK(u->footprint_full == x->fp.full && u->footprint_attended == x->fp.attended,
          "%s: footprint %g/%g, reference %g/%g", what, u->footprint_attended, u->footprint_full,
          x->fp.attended, x->fp.full);
    CHECK(u->footprint_entry_steps == (uint64_t)llround(x->fp.attended), "%s: entry steps %" PRIu64,
          what, u->footprint_entry_steps);
    CHECK(!strcmp(u->prefill_node, c->nd->id), "%s: prefill_node '%s'", what, u->prefill_node);
    CHECK(u->cached_tokens == (uint32_t)c->cached, "%s: cached_tokens %u, want %d", what, u->cached_tokens,
          c->cached);
    CHECK(u->prefill_s > 0 && u->transfer_s > 0, "%s: prefill_s %g transfer_s %g", what,
          u->prefill_s, u->transfer_s);
    bytes_ok[c->wire] += u->kv_bytes_shipped;
    n_ok++;
    parts_ok += want_parts(c);
out:
    kc_message_free((ProtobufCMessage *)a->resp);
    resv_close(&c->rv);
    ref_free(x);
}

static void case_policy(node *nd, ref_model *r, const char *spec, int n, uint32_t seed,
                        const Kvrelay__V1__Sampling *sampling)
{
    pcase *c = calloc(1, sizeof *c);
    pcase_prepare(c, nd, r, spec, n, seed, sampling);
    prefill(&c->a);
    pcase_check(c);
    free(c);
}

/* The prefix cache (docs/prefix-cache.md): a prompt, the same prompt extended (make_prompt's
 * prompts of one seed share their first tokens) and the first again, under policies that reuse
 * and one that must not (patched snapkv). Each bundle, first token and log-probability must be
 * the in-process prefill's from scratch, bit for bit, and cached_tokens what the cache gave:
 * the longer prompt continues from the shorter one's last chunk boundary below its end. */
static void case_prefix_cache(node *nd, ref_model *r, uint32_t seed)
{
    static const struct {
        const char *spec;
        int reuses;
    } specs[] = {{"full", 1}, {"streaming:sink=4,window=24", 1}, {"snapkv:mode=naive,budget=40,obs=8", 1},
                 {"snapkv:budget=40,obs=8", 0}};
    static const struct {
        int n, cached;
    } runs[] = {{100, 0}, {130, 96}, {100, 96}};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++)
        for (size_t k = 0; k < sizeof runs / sizeof runs[0]; k++) {
            pcase *c = calloc(1, sizeof *c);
            pcase_prepare(c, nd, r, specs[i].spec, runs[k].n, seed + (uint32_t)i, NULL);
            c->cached = specs[i].reuses ? runs[k].cached : 0;
            c->a.logprobs = 1;
            snprintf(c->what + strlen(c->what), sizeof c->what - strlen(c->what), " prefix cache run %zu", k);
            prefill(&c->a);
            pcase_check(c);
            free(c);
        }
    /* naive snapkv reused twice (96 tokens each); patched snapkv went around the cache */
    CHECK(test_metric(nd->p.http, "kvrelay_prefix_cache_tokens_reused_total{policy=\"snapkv\"}") == 192 &&
              test_metric(nd->p.http, "kvrelay_prefix_cache_hits_total{policy=\"snapkv\"}") == 2 &&
              test_metric(nd->p.http, "kvrelay_prefix_cache_bypass_total{policy=\"snapkv\"}") >= 3,
          "/metrics: snapkv's prefix cache counters");
    /* the node's default budget (its pool's bytes) holds a few of these states: older ones went */
    double held = 0;
    for (int f = 0; f < kr_policy_n_families(); f++) {
        char series[128];
        snprintf(series, sizeof series, "kvrelay_prefix_cache_bytes{policy=\"%s\"}", kr_policy_family_name(f));
        held += test_metric(nd->p.http, series);
    }
    const double budget = test_metric(nd->p.http, "kvrelay_prefix_cache_budget_bytes");
    CHECK(test_metric(nd->p.http, "kvrelay_prefix_cache_hits_total{policy=\"streaming\"}") >= 2 &&
              test_metric(nd->p.http, "kvrelay_prefix_cache_hits_total{policy=\"full\"}") >= 2 && held > 0 &&
              held <= budget && test_metric(nd->p.http, "kvrelay_prefix_cache_evictions_total{policy=\"full\"}") >= 0,
          "/metrics: hits of streaming and full, %g bytes held within the budget %g", held, budget);
    /* Status sums the same over the families, for the router and kvrelay-cli status */
    Kvrelay__V1__Node *st = status(nd);
    if (st) {
        CHECK(st->prefix_cache_bytes == (uint64_t)held && st->prefix_cache_budget_bytes == (uint64_t)budget &&
                  st->prefix_cache_hits >= 6 && st->prefix_cache_tokens_reused >= 6 * 96 &&
                  st->prefix_cache_lookups >= st->prefix_cache_hits && st->prefix_cache_entries > 0,
              "Status: prefix cache %" PRIu64 " bytes of %" PRIu64 ", %" PRIu64 " states, %" PRIu64 " hits of %" PRIu64
              " lookups, %" PRIu64 " tokens reused",
              st->prefix_cache_bytes, st->prefix_cache_budget_bytes, st->prefix_cache_entries, st->prefix_cache_hits,
              st->prefix_cache_lookups, st->prefix_cache_tokens_reused);
        kc_message_free((ProtobufCMessage *)st);
    }
}

/* A request's own payload dtype (kv_wire_dtype, named as a user would), whatever the node's
 * --kv-dtype: the bundle carries it, its rows within the dtype's bound of the reference. */
static void case_wire(node *nd, ref_model *r, const char *spec, const char *wire, kt_dtype want)
{
    pcase *c = calloc(1, sizeof *c);
    pcase_prepare(c, nd, r, spec, 100, 21, NULL);
    c->wire = want;
    c->a.wire = wire;
    snprintf(c->what + strlen(c->what), sizeof c->what - strlen(c->what), " wire %s", wire);
    prefill(&c->a);
    pcase_check(c);
    free(c);
}

/* Scoring: a forced first token (not the greedy one, and with sampling given, which forcing
 * ignores) comes back as the first token with kr_logprob of it and the row's argmax; logprobs
 * alone report the sampled token's. */
static void case_scoring(node *nd, ref_model *r, const char *spec)
{
    Kvrelay__V1__Sampling sampled = KVRELAY__V1__SAMPLING__INIT;
    sampled.temperature = 0.9f;
    sampled.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
    sampled.seed = 5;
    pcase *c = calloc(1, sizeof *c);
    pcase_prepare(c, nd, r, spec, 90, 31, NULL);
    c->a.has_forced = 1;
    c->a.forced = (uint32_t)((c->x.greedy + 1) % r->c->vocab_size);
    c->a.sampling = &sampled;
    prefill(&c->a);
    pcase_check(c);
    memset(c, 0, sizeof *c);
    pcase_prepare(c, nd, r, spec, 90, 32, NULL);
    c->a.logprobs = 1;
    prefill(&c->a);
    pcase_check(c);
    free(c);
}

/* N_CONC calls at once, each with a policy spec the node has not seen (so the handlers parse
 * specs concurrently) and its own length: the worker takes them one by one, QUEUE wait, the
 * rest are refused RESOURCE_EXHAUSTED. Whatever is answered OK must match its reference: prompts,
 * policies, bundles and answers must not get mixed up. */
#define N_CONC 32
static void case_concurrent(node *nd, ref_model *r)
{
    pcase *cs = calloc(N_CONC, sizeof *cs);
    static char specs[N_CONC][64];
    pthread_t th[N_CONC];
    for (int i = 0; i < N_CONC; i++) {
        if (i % 2)
            snprintf(specs[i], sizeof specs[i], "snapkv:budget=%d,obs=8", 30 + i);
        else
            snprintf(specs[i], sizeof specs[i], "streaming:sink=%d,window=%d", 2 + i, 20 + i);
        pcase_prepare(&cs[i], nd, r, specs[i], 40 + 5 * i, 100 + (uint32_t)i, NULL);
    }
    for (int i = 0; i < N_CONC; i++)
        pthread_create(&th[i], NULL, prefill_thread, &cs[i].a);
    int n_full = 0;
    for (int i = 0; i < N_CONC; i++) {
        pthread_join(th[i], NULL);
        if (!cs[i].a.resp && cs[i].a.st.code == GRPC_STATUS_RESOURCE_EXHAUSTED) {
            n_full++;
            resv_close(&cs[i].rv);
            ref_free(&cs[i].x);
            continue;
        }
        pcase_check(&cs[i]);
    }
    n_queue_full += n_full;
    CHECK(n_full <= N_CONC - 1 - QUEUE, "%d of %d concurrent calls refused; at most %d may be",
          n_full, N_CONC, N_CONC - 1 - QUEUE);
    free(cs);
}

/* A Prefill that must fail with `code` and details containing `needle`. */
static void expect_fail(call_args *a, grpc_status_code code, const char *needle)
{
    int rc = prefill(a);
    CHECK(rc != 0 && a->st.code == code, "%s: want %s, got %s '%s'", a->rid, kc_status_name(code),
          kc_status_name(a->st.code), a->st.details);
    CHECK(strstr(a->st.details, needle) != NULL, "%s: details '%s' lack '%s'", a->rid,
          a->st.details, needle);
    kc_message_free((ProtobufCMessage *)a->resp);
    a->resp = NULL;
}

static void case_invalid(node *nd, ref_model *r)
{
    int32_t tok[MAX_PROMPT + 1];
    make_prompt(tok, MAX_PROMPT + 1, r->c->vocab_size, 9);
    call_args a = {.nd = nd, .tok = tok, .n = 20, .resv = 77};
    const grpc_status_code IA = GRPC_STATUS_INVALID_ARGUMENT;

    a.rid = "empty prompt", a.n = 0;
    expect_fail(&a, IA, "token_ids");
    a.rid = "prompt over --max-prompt", a.n = MAX_PROMPT + 1;
    expect_fail(&a, IA, "--max-prompt");
    a.n = 20;
    tok[3] = r->c->vocab_size;
    a.rid = "id outside the vocabulary";
    expect_fail(&a, IA, "token_ids[3]");
    tok[3] = 1;
    a.rid = "unknown wire dtype", a.wire = "int4";
    expect_fail(&a, IA, "kv_wire_dtype 'int4' is not one of f32, bf16, f16, int8, fp8");
    a.wire = NULL;
    a.rid = "unknown policy", a.policy = "nosuchpolicy";
    expect_fail(&a, IA, "kv_policy");
    a.rid = "malformed policy", a.policy = "streaming:sink=x";
    expect_fail(&a, IA, "kv_policy");
    a.policy = NULL;
    Kvrelay__V1__Sampling bad = KVRELAY__V1__SAMPLING__INIT;
    bad.temperature = -1;
    a.rid = "negative temperature", a.sampling = &bad;
    expect_fail(&a, IA, "temperature");
    a.sampling = NULL;
    a.rid = "forced id outside the vocabulary", a.has_forced = 1;
    a.forced = (uint32_t)r->c->vocab_size;
    expect_fail(&a, IA, "forced_first");
    a.has_forced = 0;
    static const char *addrs[] = {"",
                                  "127.0.0.1",
                                  "127.0.0.1:",
                                  ":7000",
                                  "127.0.0.1:0",
                                  "127.0.0.1:65536",
                                  "127.0.0.1:7x",
                                  "[::1]:7000"};
    for (size_t i = 0; i < sizeof addrs / sizeof addrs[0]; i++) {
        char rid[64];
        snprintf(rid, sizeof rid, "transfer_address '%s'", addrs[i]);
        a.rid = rid, a.addr = addrs[i];
        expect_fail(&a, IA, "transfer_address");
    }
    a.addr = NULL;
    a.rid = "reservation 0", a.resv = 0;
    expect_fail(&a, IA, "reservation_id");
    a.rid = "short token", a.resv = 5, a.resv_token_len = 8;
    expect_fail(&a, IA, "reservation_token: 8 bytes, want 16");
}

/* The receiver refuses: an unknown reservation, and one too small for the bundle. Then a
 * transfer address where nobody listens. All UNAVAILABLE with the transport's message. */
static void case_refusals(node *nd, ref_model *r)
{
    int32_t tok[40];
    make_prompt(tok, 40, r->c->vocab_size, 5);
    call_args a = {.nd = nd, .rid = "unknown reservation", .tok = tok, .n = 40, .resv = 999999};
    expect_fail(&a, GRPC_STATUS_UNAVAILABLE, "unknown or expired reservation 999999");

    resv small;
    resv_open(&small, 100);
    a.rid = "wrong token", a.resv = small.id;
    char want[64];
    snprintf(want, sizeof want, "wrong token for reservation %" PRIu64, small.id);
    expect_fail(&a, GRPC_STATUS_UNAVAILABLE, want);
    CHECK(kt_transport_reservation_state(rx, small.id) == KT_XFER_STATE_RESERVED,
          "a bundle with a wrong token leaves the reservation waiting");
    a.rid = "reservation too small", a.resv_token = small.token;
    snprintf(want, sizeof want, "reservation %" PRIu64, small.id);
    expect_fail(&a, GRPC_STATUS_UNAVAILABLE, want);
    CHECK(kt_transport_reservation_state(rx, small.id) == KT_XFER_STATE_RESERVED,
          "a refused bundle leaves the reservation as it was");
    resv_close(&small);

    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    REQUIRE(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
                getsockname(fd, (struct sockaddr *)&sa, &sl) == 0,
            "probe socket");
    char dead[64];
    snprintf(dead, sizeof dead, "127.0.0.1:%u", ntohs(sa.sin_port));
    close(fd); /* bound once, never listened: nobody is there */
    a.rid = "nobody listens", a.resv = 5, a.addr = dead;
    expect_fail(&a, GRPC_STATUS_UNAVAILABLE, dead);

    /* A policy whose transients do not fit the node's pool next to a --max-prompt prompt (the
     * default pool holds the prompt under full attention, not 64 observers more per chunk):
     * FAILED_PRECONDITION (it would fail again: not "retry later"), the sequence freed, the
     * node serving on (the next case_* calls succeed). */
    int32_t big[MAX_PROMPT];
    make_prompt(big, MAX_PROMPT, r->c->vocab_size, 6);
    call_args p = {.nd = nd,
                   .rid = "pool exhausted",
                   .tok = big,
                   .n = MAX_PROMPT,
                   .resv = 6,
                   .policy = "snapkv:ratio=0,obs=64"};
    expect_fail(&p, GRPC_STATUS_FAILED_PRECONDITION, "KV pool exhausted");
    CHECK(strstr(p.st.details, "--kv-blocks") != NULL, "names the flag: %s", p.st.details);
    Kvrelay__V1__Node *s = status(nd);
    CHECK(s && s->running_requests == 0 && s->outstanding_prefill_tokens == 0,
          "the node is idle again after a failed prefill");
    kc_message_free((ProtobufCMessage *)s);
}

/* A TCP listener that never accepts and never speaks UCX: a send to it hangs until the listener
 * is closed (then the connection is reset), which holds the node's worker busy for as long as
 * the test wants. */
static int blocker_open(char *addr, size_t cap)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    REQUIRE(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(fd, 8) == 0 &&
                getsockname(fd, (struct sockaddr *)&sa, &sl) == 0,
            "blocker socket");
    snprintf(addr, cap, "127.0.0.1:%u", ntohs(sa.sin_port));
    return fd;
}

/* --queue QUEUE: A runs (stuck in its send to the blocker); B with a short deadline waits and is
 * dropped from the queue when its deadline passes; QUEUE more calls to real reservations wait,
 * one at a time so their arrival order is known; one more is refused. Closing the blocker fails
 * A; the waiting calls then run in arrival order (the receiver sees their bundles in that order)
 * and each is checked against the reference. */
static void case_queue(node *nd, ref_model *r)
{
    char blk[64];
    int fd = blocker_open(blk, sizeof blk);
    int32_t tok[30];
    make_prompt(tok, 30, r->c->vocab_size, 11);
    call_args a = {.nd = nd, .rid = "queue A", .tok = tok, .n = 30, .resv = 1, .addr = blk};
    pthread_t ta, tq[QUEUE];
    pthread_create(&ta, NULL, prefill_thread, &a);
    wait_load(nd, 1, 0);

    call_args b = a;
    b.rid = "queue B (deadline)", b.timeout_ms = 1000;
    prefill(&b);
    CHECK(b.st.code == GRPC_STATUS_DEADLINE_EXCEEDED, "B: %s %s", kc_status_name(b.st.code),
          b.st.details);
    kc_message_free((ProtobufCMessage *)b.resp);
    wait_load(nd, 1, 0); /* B left the queue: only its own handler could have taken it out */

    pcase *q = calloc(QUEUE, sizeof *q);
    uint64_t outstanding = 30;
    for (int i = 0; i < QUEUE; i++) {
        pcase_prepare(&q[i], nd, r, i % 2 ? "streaming:sink=4,window=24" : "full", 20 + i,
                      200 + (uint32_t)i, NULL);
        pthread_create(&tq[i], NULL, prefill_thread, &q[i].a);
        wait_load(nd, 1, (uint32_t)i + 1);
        outstanding += (uint64_t)q[i].n;
    }
    Kvrelay__V1__Node *s = status(nd);
    CHECK(s && s->outstanding_prefill_tokens == outstanding,
          "outstanding prefill tokens %" PRIu64 ", want %" PRIu64,
          s ? s->outstanding_prefill_tokens : 0, outstanding);
    kc_message_free((ProtobufCMessage *)s);
    call_args c = a;
    c.rid = "queue C";
    char want[64];
    snprintf(want, sizeof want, "prefill queue full (%d waiting)", QUEUE);
    n_queue_full++;
    expect_fail(&c, GRPC_STATUS_RESOURCE_EXHAUSTED, want);

    close(fd);
    pthread_join(ta, NULL);
    CHECK(a.st.code == GRPC_STATUS_UNAVAILABLE, "A after the blocker closed: %s %s",
          kc_status_name(a.st.code), a.st.details);
    kc_message_free((ProtobufCMessage *)a.resp);
    for (int i = 0; i < QUEUE; i++) {
        pthread_join(tq[i], NULL);
        REQUIRE(resv_wait(&q[i].rv), "%s: the reservation never completed", q[i].what);
        CHECK(i == 0 || q[i].rv.order > q[i - 1].rv.order,
              "FIFO: queued call %d's bundle arrived as number %d, call %d's as %d", i,
              q[i].rv.order, i - 1, q[i - 1].rv.order);
    }
    for (int i = 0; i < QUEUE; i++)
        pcase_check(&q[i]);
    free(q);
    wait_load(nd, 0, 0);
}

/* --queue 0: nothing waits; a request arriving while the worker is busy is refused. With
 * `then_sigterm`, the node is stopped while A is in flight and must still exit 0. */
static void case_queue0(node *nd, ref_model *r, int then_sigterm)
{
    char blk[64];
    int fd = blocker_open(blk, sizeof blk);
    int32_t tok[30];
    make_prompt(tok, 30, r->c->vocab_size, 12);
    call_args a = {.nd = nd, .rid = "queue0 A", .tok = tok, .n = 30, .resv = 1, .addr = blk};
    pthread_t ta;
    pthread_create(&ta, NULL, prefill_thread, &a);
    wait_load(nd, 1, 0);
    call_args c = a;
    c.rid = "queue0 C";
    expect_fail(&c, GRPC_STATUS_RESOURCE_EXHAUSTED, "prefill queue full (0 waiting)");
    if (then_sigterm) {
        kill(nd->p.pid, SIGTERM);
        /* the node cancels A's call; its send ends when the connection does */
        close(fd);
        pthread_join(ta, NULL);
        CHECK(a.st.code != GRPC_STATUS_OK, "A during shutdown: %s", kc_status_name(a.st.code));
        kc_message_free((ProtobufCMessage *)a.resp);
        node_stop(nd, "with a call in flight");
        return;
    }
    close(fd);
    pthread_join(ta, NULL);
    CHECK(a.st.code == GRPC_STATUS_UNAVAILABLE, "queue0 A: %s %s", kc_status_name(a.st.code),
          a.st.details);
    kc_message_free((ProtobufCMessage *)a.resp);
}

/* The node's own send timeout (the call's deadline is far): DEADLINE_EXCEEDED with the
 * transport's message, and the node serves on. */
static void case_send_timeout(node *nd, ref_model *r)
{
    char blk[64];
    int fd = blocker_open(blk, sizeof blk);
    int32_t tok[20];
    make_prompt(tok, 20, r->c->vocab_size, 14);
    call_args a = {.nd = nd, .rid = "send timeout", .tok = tok, .n = 20, .resv = 3, .addr = blk};
    expect_fail(&a, GRPC_STATUS_DEADLINE_EXCEEDED, "timed out");
    close(fd);
    wait_load(nd, 0, 0);
}

/* An --http port another process holds: start-up fails with status 1, before any thread or
 * the transport exists (a LeakSanitizer report in the log, which does not change the status,
 * would mean something was started before the port). */
static void case_http_port_taken(void)
{
    int fd, port = test_port_held(&fd);
    REQUIRE(port > 0, "a listening socket: %s", strerror(errno));
    char exe[1024], model[1024], http[64];
    snprintf(exe, sizeof exe, "%s/kvrelay-prefill", bin_dir);
    snprintf(model, sizeof model, "%s/models/llama3-tiny", fixtures);
    snprintf(http, sizeof http, "127.0.0.1:%d", port);
    char *argv[] = {exe, "--model", model, "--id", "prefill-taken", "--listen", "127.0.0.1:0", "--http", http, NULL};
    int status = test_proc_run(argv);
    CHECK(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1, "a taken --http %s: status %#x, not exit 1",
          http, (unsigned)status);
    close(fd);
}

static void case_garbage_and_health(node *nd)
{
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0x0f, 0x01};
    const char *paths[] = {PREFILL, STATUS};
    for (int i = 0; i < 2; i++) {
        ProtobufCMessage *resp = NULL;
        kc_status st;
        int rc = kc_unary_bytes(nd->ch, paths[i], junk, sizeof junk,
                                &kvrelay__v1__prefill_response__descriptor, 5000, &resp, &st);
        CHECK(rc != 0 && st.code == GRPC_STATUS_INVALID_ARGUMENT, "garbage to %s: %s %s", paths[i],
              kc_status_name(st.code), st.details);
        kc_message_free(resp);
    }
    Kvrelay__V1__Node *s = status(nd);
    CHECK(s && s->role == KVRELAY__V1__NODE_ROLE__NODE_ROLE_PREFILL &&
              s->state == KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING && !strcmp(s->id, nd->id) &&
              !strcmp(s->grpc_address, nd->p.grpc) && s->running_requests == 0 &&
              s->queued_requests == 0 && s->outstanding_prefill_tokens == 0 && s->since_unix_ms > 0,
          "Status after garbage: the node still serves and reports itself");
    kc_message_free((ProtobufCMessage *)s);

    Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    hreq.service = "kvrelay.v1.Prefill";
    Grpc__Health__V1__HealthCheckResponse *hr = NULL;
    kc_status st;
    int rc = kc_unary(nd->ch, "/grpc.health.v1.Health/Check", &hreq.base,
                      &grpc__health__v1__health_check_response__descriptor, 5000,
                      (ProtobufCMessage **)&hr, &st);
    CHECK(rc == 0 && hr->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING,
          "health: %s %s", kc_status_name(st.code), st.details);
    kc_message_free((ProtobufCMessage *)hr);
}

/* Runs kvrelay-prefill with `args` (NULL-terminated, after the program name) to its exit;
 * returns the exit status (-1 if killed) with stdout and stderr in out. */
static int run_exit(const char *const *args, char *out, size_t cap)
{
    char exe[1024];
    snprintf(exe, sizeof exe, "%s/kvrelay-prefill", bin_dir);
    char *argv[32] = {exe};
    for (int i = 0; args[i] && i < 30; i++)
        argv[i + 1] = (char *)args[i];
    int fds[2];
    REQUIRE(pipe(fds) == 0, "pipe");
    pid_t pid = fork();
    REQUIRE(pid >= 0, "fork");
    if (pid == 0) {
        dup2(fds[1], 1);
        dup2(fds[1], 2);
        close(fds[0]);
        close(fds[1]);
        execv(exe, argv);
        _exit(127);
    }
    close(fds[1]);
    size_t len = 0;
    ssize_t got;
    while ((got = read(fds[0], out + len, cap - 1 - len)) > 0 && len + 1 < cap)
        len += (size_t)got;
    out[len] = 0;
    close(fds[0]);
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Flags: --help, and start-up refusals that name the flag (exit 2) or the cause (exit 1). */
static void case_flags(ref_model *r)
{
    static char out[1 << 16];
    const char *help[] = {"--help", NULL};
    CHECK(run_exit(help, out, sizeof out) == 0 && strstr(out, "--transfer-timeout-s"),
          "--help exits 0 and lists the flags");
    char blk[64];
    int fd = blocker_open(blk, sizeof blk); /* a busy TCP port */
    struct {
        const char *args[8];
        int status;
        const char *needle;
    } bad[] = {
        {{"--model", r->dir, "--bogus", NULL}, 2, "--bogus"},
        {{"--listen", "127.0.0.1:0", NULL}, 2, "--model"},
        {{"--model", r->dir, "--kv-dtype", "f64", NULL}, 2, "--kv-dtype"},
        {{"--model", r->dir, "--queue", "-1", NULL}, 2, "--queue"},
        {{"--model", r->dir, "--http", "nohost", NULL}, 2, "--http"},
        {{"--model", r->dir, "--max-prompt", "40000", NULL}, 2, "max_position_embeddings"},
        {{"--model", r->dir, "--max-prompt", "100", "--kv-blocks", "8", NULL}, 2, "--kv-blocks"},
        {{"--model", r->dir, "--prefix-cache-memory", "2T", NULL}, 2, "unknown unit 'T'"},
        {{"--model", r->dir, "--prefix-cache-memory", "100", NULL}, 2, "less than one KV block"},
        {{"--model", "/nonexistent", NULL}, 1, "/nonexistent"},
        {{"--model", r->dir, "--listen", blk, NULL}, 1, blk},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int st = run_exit(bad[i].args, out, sizeof out);
        CHECK(st == bad[i].status && strstr(out, bad[i].needle),
              "flags case %zu: exit %d (want %d), output lacks '%s'? %s", i, st, bad[i].status,
              bad[i].needle, out);
    }
    close(fd);
}

/* SIGTERM drains. A runs (stuck in its send to the blocker) and Q waits behind it when
 * the signal comes; the node says DRAINING (Status), 503 "draining" (/healthz), NOT_SERVING
 * (grpc.health.v1) and refuses a new call UNAVAILABLE "draining". Without a timeout
 * (timeout == 0): closing the blocker ends A, Q runs and is checked against the reference,
 * and the node exits 0 by itself. With --drain-timeout-s 1 (timeout == 1): Q ends UNAVAILABLE
 * "prefill node shutting down" while A still hangs; closing the blocker lets the node exit 0. */
static void case_drain(node *nd, ref_model *r, int timeout)
{
    char blk[64];
    int fd = blocker_open(blk, sizeof blk);
    int32_t tok[30];
    make_prompt(tok, 30, r->c->vocab_size, 15);
    call_args a = {.nd = nd, .rid = "drain A", .tok = tok, .n = 30, .resv = 1, .addr = blk};
    pthread_t ta, tq;
    pthread_create(&ta, NULL, prefill_thread, &a);
    wait_load(nd, 1, 0);
    pcase *q = calloc(1, sizeof *q);
    pcase_prepare(q, nd, r, "streaming:sink=4,window=24", 40, 300, NULL);
    pthread_create(&tq, NULL, prefill_thread, &q->a);
    wait_load(nd, 1, 1);

    kill(nd->p.pid, SIGTERM);
    Kvrelay__V1__Node *s = NULL;
    for (int i = 0; i < 500; i++) {
        kc_message_free((ProtobufCMessage *)s);
        s = status(nd);
        if (!s || s->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING) break;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    CHECK(s && s->state == KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING, "%s: Status DRAINING",
          nd->id);
    kc_message_free((ProtobufCMessage *)s);
    char *hz = test_http_get(nd->p.http, "/healthz");
    CHECK(strstr(hz, " 503 ") && strstr(hz, "draining"), "/healthz while draining: %.80s", hz);
    free(hz);
    Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    hreq.service = "kvrelay.v1.Prefill";
    ProtobufCMessage *hresp = NULL;
    kc_status st;
    CHECK(kc_unary(nd->ch, "/grpc.health.v1.Health/Check", &hreq.base,
                   &grpc__health__v1__health_check_response__descriptor, 5000, &hresp, &st) == 0 &&
              ((Grpc__Health__V1__HealthCheckResponse *)hresp)->status ==
                  GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING,
          "grpc.health.v1: NOT_SERVING while draining (%s)", st.details);
    kc_message_free(hresp);
    call_args d = a;
    d.rid = "drain D";
    d.addr = rx_addr;
    expect_fail(&d, GRPC_STATUS_UNAVAILABLE, "draining");

    if (!timeout) {
        close(fd);
        pthread_join(ta, NULL);
        CHECK(a.st.code == GRPC_STATUS_UNAVAILABLE, "drain A after the blocker closed: %s %s",
              kc_status_name(a.st.code), a.st.details);
        kc_message_free((ProtobufCMessage *)a.resp);
        pthread_join(tq, NULL);
        pcase_check(q); /* queued before the signal: prefilled and shipped during the drain */
    } else {
        pthread_join(tq, NULL);
        CHECK(q->a.st.code == GRPC_STATUS_UNAVAILABLE &&
                  strstr(q->a.st.details, "prefill node shutting down"),
              "queued at the drain timeout: %s %s", kc_status_name(q->a.st.code), q->a.st.details);
        kc_message_free((ProtobufCMessage *)q->a.resp);
        resv_close(&q->rv);
        ref_free(&q->x);
        close(fd);
        pthread_join(ta, NULL);
        kc_message_free((ProtobufCMessage *)a.resp);
    }
    free(q);
    kc_channel_destroy(nd->ch);
    nd->ch = NULL;
    int code = test_proc_stop(&nd->p, 0, 60); /* signal 0: only wait */
    CHECK(code != -1 && WIFEXITED(code) && WEXITSTATUS(code) == 0,
          "%s: exit 0 after the drain%s, got status %d", nd->id, timeout ? " timeout" : "", code);
}

int main(void)
{
    bin_dir = kt_env("KR_BIN");
    fixtures = kt_env("KR_FIXTURES");
    REQUIRE(bin_dir && fixtures, "KR_BIN and KR_FIXTURES must be set (run through ctest)");
    char exe[1024];
    snprintf(exe, sizeof exe, "%s/kvrelay-prefill", bin_dir);
    if (access(exe, X_OK) != 0) {
        printf("SKIP: %s is not built\n", exe);
        return KT_SKIP;
    }
    const char *models[] = {"llama3-tiny", "mistral-tiny"};
    for (int i = 0; i < 2; i++) {
        char cfg[1024];
        snprintf(cfg, sizeof cfg, "%s/models/%s/config.json", fixtures, models[i]);
        if (access(cfg, R_OK) != 0) {
            printf("SKIP: fixture model %s is missing\n", models[i]);
            return KT_SKIP;
        }
    }
    char err[KT_ERR_MAX];
    kt_transport_config tc = {.mode = KT_TRANSPORT_MODE_AM,
                              .listen_host = "127.0.0.1",
                              .listen_port = 0,
                              .name = "test-decode"};
    if (kt_transport_create(&tc, &rx, err) != 0) {
        printf("SKIP: UCX cannot listen on loopback: %s\n", err);
        return KT_SKIP;
    }
    snprintf(rx_addr, sizeof rx_addr, "127.0.0.1:%u", kt_transport_port(rx));
    signal(SIGPIPE, SIG_IGN);

    static const char *policies[] = {"", "full", "streaming:sink=4,window=24",
                                     "snapkv:budget=40,obs=8", "sage:budget=32"};
    const int n_pol = (int)(sizeof policies / sizeof policies[0]);

    /* llama3-tiny: f32 bundles (bit-exact), --queue 1 */
    ref_model ra;
    ref_open(&ra, "llama3-tiny");
    node na;
    node_start(&na, &ra, "prefill-a", QUEUE_S, "f32", "60", "60", "on");
    for (int i = 0; i < n_pol; i++)
        case_policy(&na, &ra, policies[i], 100, 1 + (uint32_t)i, NULL);
    case_policy(&na, &ra, "streaming:sink=4,window=24", 5, 7, NULL); /* one chunk, no eviction */
    Kvrelay__V1__Sampling sampled = KVRELAY__V1__SAMPLING__INIT;
    sampled.temperature = 0.8f;
    sampled.top_k = 40;
    sampled.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
    sampled.seed = 7;
    case_policy(&na, &ra, "snapkv:budget=40,obs=8", 100, 8, &sampled);
    case_wire(&na, &ra, "snapkv:budget=40,obs=8", "int8", KT_DTYPE_INT8_TOKEN);
    case_wire(&na, &ra, "full", "fp8", KT_DTYPE_FP8_E4M3_TOKEN);
    case_wire(&na, &ra, "streaming:sink=4,window=24", "bf16", KT_DTYPE_BF16);
    case_concurrent(&na, &ra);
    case_invalid(&na, &ra);
    case_scoring(&na, &ra, "snapkv:budget=40,obs=8");
    case_refusals(&na, &ra);
    case_policy(&na, &ra, "full", MAX_PROMPT, 13, NULL); /* the pool survived the refusals */
    case_queue(&na, &ra);
    case_garbage_and_health(&na);
    case_http_port_taken();
    case_prefix_cache(&na, &ra, 900);
    for (int t = 0; t <= KT_DTYPE_FP8_E4M3_TOKEN; t++) {
        if (!kt_dtype_size((kt_dtype)t)) continue;
        char series[96];
        snprintf(series, sizeof series, "kvrelay_kv_bytes_shipped_total{wire_dtype=\"%s\"}",
                 kt_dtype_name((kt_dtype)t));
        CHECK(test_metric(na.p.http, series) == (double)bytes_ok[t], "/metrics %s %g, usage says %" PRIu64,
              series, test_metric(na.p.http, series), bytes_ok[t]);
    }
    CHECK(test_metric(na.p.http, "kvrelay_requests_total{status=\"OK\"}") == n_ok,
          "/metrics OK requests %g, want %d",
          test_metric(na.p.http, "kvrelay_requests_total{status=\"OK\"}"), n_ok);
    double early = test_metric(na.p.http, "kvrelay_kv_parts_sent_total{phase=\"during_prefill\"}"),
           late = test_metric(na.p.http, "kvrelay_kv_parts_sent_total{phase=\"after_prefill\"}");
    CHECK(early + late == parts_ok && early > 0 && late >= n_ok,
          "/metrics: %g parts acknowledged during the prefill and %g after, for %d bundles of %d "
          "parts in all (the last one of each after)", early, late, n_ok, parts_ok);
    CHECK(test_metric(na.p.http, "kvrelay_requests_total{status=\"RESOURCE_EXHAUSTED\"}") ==
                  n_queue_full &&
              test_metric(na.p.http, "kvrelay_requests_total{status=\"FAILED_PRECONDITION\"}") == 1,
          "/metrics: %d queue refusals, one pool overflow", n_queue_full);
    CHECK(test_metric(na.p.http, "kvrelay_kv_blocks_used") == 0, "/metrics: every block back");
    CHECK(test_metric(na.p.http, "kvrelay_requests_total{status=\"DEADLINE_EXCEEDED\"}") == 1,
          "/metrics: queue B's handler saw its deadline pass in the queue");
    CHECK(test_metric(na.p.http, "kvrelay_queue_depth") == 0 &&
              test_metric(na.p.http, "kvrelay_running_sequences") == 0,
          "/metrics queue depth and running back to 0");
    case_drain(&na, &ra, 0);
    node nd1;
    node_start(&nd1, &ra, "prefill-d", "4", "f32", "60", "1", "on");
    case_drain(&nd1, &ra, 1);
    ref_close(&ra);

    /* mistral-tiny: bf16 bundles, --queue 0 */
    ref_model rb;
    ref_open(&rb, "mistral-tiny");
    case_flags(&rb);
    node nb;
    node_start(&nb, &rb, "prefill-b", "0", "bf16", "60", "60", "off"); /* one whole bundle */
    for (int i = 1; i < n_pol; i++)
        case_policy(&nb, &rb, policies[i], 120, 20 + (uint32_t)i, NULL);
    case_prefix_cache(&nb, &rb, 950);
    case_queue0(&nb, &rb, 0);
    case_queue0(&nb, &rb, 1); /* stops the node */

    /* --transfer-timeout-s 1: a send that is never acknowledged ends DEADLINE_EXCEEDED */
    node nc;
    node_start(&nc, &rb, "prefill-c", "0", "f32", "1", "60", "on");
    case_send_timeout(&nc, &rb);
    node_stop(&nc, "after a timed-out send");
    ref_close(&rb);

    kt_transport_destroy(rx);
    return kt_done("test_prefill_node");
}
