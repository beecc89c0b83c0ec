/*
 * run.c - one prefill job on the worker thread (prefill.h): chunked prefill with the request's
 * policy on the node's one kr_ctx, the first token (sampled, or forced; with its log-probability
 * and the row's argmax when asked), the KV bundle written straight from the
 * sequence's lists, the send to the decode node's reservation, and the usage.
 *
 * The bundle goes into one worker-owned buffer grown to the largest bundle so far (a request
 * does not allocate it again), which is also the send buffer: kr_seq_list_visit hands over each
 * list's rows in place in the KV blocks, one run per block, and the writer converts them to the
 * payload dtype as it copies them in, so each shipped byte is written once on this side. The
 * sequence is freed as soon as the bundle is written, before the send, so the pool never holds a
 * request's blocks across a network wait.
 * Cancellation: kr_prefill runs its chunks in one call, so a call cancelled mid-prefill is
 * noticed after it; the transfer is skipped then.
 */
#include "bundle-rule.h"
#include "prefill.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"

double pf_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

grpc_status_code pf_call_gone_code(kc_call *call)
{
    /* The client's own deadline timer fires first and cancels the stream, a moment before the
     * server's copy of the deadline (sent as a relative grpc-timeout, so later by the transit
     * time) passes: a cancellation this close to the deadline is the deadline. */
    return kc_call_ms_left(call) <= PF_DEADLINE_SLACK_MS ? GRPC_STATUS_DEADLINE_EXCEEDED
                                                         : GRPC_STATUS_CANCELLED;
}

int pf_run_init(pf_node *n, char *err)
{
    const kr_config *c = n->mcfg;
    kr_ctx_params cp = {
        .backend = n->cfg->backend, .n_threads = n->cfg->threads, .max_chunk = n->cfg->chunk};
    if (kr_ctx_create(n->model, &cp, &n->ctx, err) != KR_OK) return -1;
    if (kr_ctx_kv_pool_create(n->ctx, PF_BLOCK_SIZE, n->cfg->kv_blocks, &n->pool, err) != KR_OK)
        return -1;
    n->logits = malloc(sizeof(float) * (size_t)c->vocab_size);
    n->lists = calloc((size_t)c->n_layers * (size_t)c->n_kv_heads, sizeof *n->lists);
    if (!n->logits || !n->lists) {
        snprintf(err, KR_ERR_MAX, "out of memory for the worker's scratch buffers");
        return -1;
    }
    return 0;
}

void pf_run_free(pf_node *n)
{
    free(n->bundle);
    free(n->lists);
    free(n->logits);
    kr_kv_pool_free(n->pool);
    kr_ctx_free(n->ctx);
}

static void job_fail(pf_job *j, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void job_fail(pf_job *j, grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->details, sizeof j->details, fmt, ap);
    va_end(ap);
    j->code = code;
    kc_warn(j->request_id, "prefill failed: %s: %s", kc_status_name(code), j->details);
}

/* The worker's bundle buffer, at least `size` bytes, 64-byte aligned (the bundle's sections are
 * 64-byte aligned relative to it, so rows land aligned). */
static int bundle_room(pf_node *n, uint64_t size, char *err)
{
    if (size <= n->bundle_cap) return 0;
    size_t cap = n->bundle_cap ? n->bundle_cap : 1u << 20;
    while (cap < size)
        cap *= 2;
    uint8_t *b = aligned_alloc(64, cap);
    if (!b) {
        snprintf(err, KR_ERR_MAX, "out of memory for a %llu-byte bundle", (unsigned long long)size);
        return -1;
    }
    free(n->bundle);
    n->bundle = b;
    n->bundle_cap = cap;
    return 0;
}

/* One run of a list's rows, from the KV blocks into the bundle (kr_list_rows_fn). */
typedef struct put_arg {
    kt_bundle_writer *w;
    uint32_t layer, head;
} put_arg;

static int put_rows(void *arg, int first, int n, const int32_t *pos, const float *k,
                    const float *v, char *err)
{
    const put_arg *a = arg;
    (void)first;
    return kt_bundle_writer_put(a->w, a->layer, a->head, (uint32_t)n, pos, KT_DTYPE_F32, k, v,
                                err);
}

/* Writes the bundle of `seq` into n->bundle: *size_out bytes, *entries_out entries. */
static int write_bundle(pf_node *n, const pf_job *j, const kr_seq *seq, int32_t first_token,
                        uint64_t *size_out, uint64_t *entries_out, char *err)
{
    const kr_config *c = n->mcfg;
    kt_bundle_header h;
    memset(&h, 0, sizeof h);
    snprintf(h.fingerprint, sizeof h.fingerprint, "%s", kr_model_fingerprint(n->model));
    h.n_layers = (uint32_t)c->n_layers;
    h.n_kv_heads = (uint32_t)c->n_kv_heads;
    h.head_dim = (uint32_t)c->head_dim;
    h.dtype = j->wire;
    h.first_token = first_token;
    h.prompt_len = j->n_tokens;
    h.next_pos = kr_seq_next_pos(seq);
    snprintf(h.policy, sizeof h.policy, "%s", kr_policy_spec(j->policy));
    uint64_t entries = 0;
    for (int l = 0; l < c->n_layers; l++)
        for (int kv = 0; kv < c->n_kv_heads; kv++) {
            int len, pinned;
            kr_seq_list_shape(seq, l, kv, &len, &pinned);
            kr_list_rule rule;
            kr_seq_list_rule(seq, l, kv, &rule);
            n->lists[l * c->n_kv_heads + kv] = kt_bundle_list_of(len, pinned, &rule);
            entries += (uint64_t)len;
        }
    uint64_t size;
    if (kt_bundle_size(&h, n->lists, &size, err) != 0 || bundle_room(n, size, err) != 0) return -1;
    kt_bundle_writer w;
    if (kt_bundle_writer_begin(&w, &h, n->lists, n->bundle, n->bundle_cap, err) != 0) return -1;
    for (int l = 0; l < c->n_layers; l++)
        for (int kv = 0; kv < c->n_kv_heads; kv++) {
            put_arg a = {.w = &w, .layer = (uint32_t)l, .head = (uint32_t)kv};
            int len = (int)n->lists[l * c->n_kv_heads + kv].count;
            if (kr_seq_list_visit(seq, l, kv, 0, len, put_rows, &a, err) != KR_OK) return -1;
        }
    if (kt_bundle_writer_finish(&w, size_out, err) != 0) return -1;
    *entries_out = entries;
    return 0;
}

static void pool_gauges(pf_node *n)
{
    int free_blocks = kr_kv_pool_n_free(n->pool);
    kc_gauge_set(n->metrics.blocks_used, kr_kv_pool_n_blocks(n->pool) - free_blocks);
    kc_gauge_set(n->metrics.blocks_free, free_blocks);
}

void pf_run(pf_node *n, pf_job *j)
{
    char err[KR_ERR_MAX];
    if (kc_call_cancelled(j->call)) {
        job_fail(j, pf_call_gone_code(j->call), "call ended before its prefill started");
        return;
    }
    if (atomic_load(&n->aborting)) {
        job_fail(j, GRPC_STATUS_UNAVAILABLE, "%s before this request's prefill started",
                 PF_SHUTDOWN_MSG);
        return;
    }
    const kr_config *c = n->mcfg;
    double t0 = pf_now();
    kr_seq *seq = NULL;
    kr_sampler *sampler = NULL;
    if (kr_seq_create(n->pool, c->n_layers, c->n_kv_heads, &seq, err) != KR_OK ||
        kr_seq_set_policy(seq, j->policy, err) != KR_OK) {
        job_fail(j, GRPC_STATUS_INTERNAL, "%s", err);
        goto out;
    }
    /* The inputs were validated; what can fail now is the pool: a policy whose observers or
     * chunk transients do not fit next to a long prompt. The pool is empty when a job starts,
     * so the same request fails the same way every time: FAILED_PRECONDITION (the operator
     * must raise --kv-blocks), not RESOURCE_EXHAUSTED, which the router reads as "queue full,
     * try again later". */
    if (kr_prefill(n->ctx, seq, j->tokens, j->n_tokens, n->cfg->chunk, KR_LOGITS_LAST, n->logits,
                   err) != KR_OK) {
        job_fail(j, GRPC_STATUS_FAILED_PRECONDITION,
                 "%s (this node's --kv-blocks %d is too "
                 "small for this prompt under kv_policy %s)",
                 err, n->cfg->kv_blocks, kr_policy_spec(j->policy));
        goto out;
    }
    if (j->forced_first >= 0) {
        j->first_token = j->forced_first;
    } else {
        if (kr_sampler_create(&j->sampling, c->vocab_size, &sampler, err) != KR_OK) {
            job_fail(j, GRPC_STATUS_INTERNAL, "%s", err);
            goto out;
        }
        j->first_token = kr_sampler_sample(sampler, n->logits);
    }
    if (j->logprobs)
        j->first_logprob = kr_logprob(n->logits, c->vocab_size, j->first_token, &j->first_top_id);
    kr_seq_footprint(seq, &j->usage.footprint);
    pool_gauges(n);
    if (kc_call_cancelled(j->call)) {
        job_fail(j, pf_call_gone_code(j->call), "call ended during prefill; bundle not sent");
        goto out;
    }
    if (atomic_load(&n->aborting)) {
        job_fail(j, GRPC_STATUS_UNAVAILABLE, "%s during this request's prefill; bundle not sent",
                 PF_SHUTDOWN_MSG);
        goto out;
    }

    uint64_t size = 0, entries = 0;
    if (write_bundle(n, j, seq, j->first_token, &size, &entries, err) != 0) {
        job_fail(j, GRPC_STATUS_INTERNAL, "writing the KV bundle: %s", err);
        goto out;
    }
    kr_seq_free(seq); /* the bundle holds what is shipped: the blocks go back now */
    seq = NULL;
    pool_gauges(n);
    j->usage.prefill_s = pf_now() - t0;
    j->usage.kv_entries = entries;
    j->usage.kv_bytes = entries * 2u * kt_dtype_row_bytes(j->wire, (uint32_t)c->head_dim);

    int64_t ms_left = kc_call_ms_left(j->call);
    if (ms_left <= 0) {
        job_fail(j, GRPC_STATUS_DEADLINE_EXCEEDED, "deadline passed before the bundle was sent");
        goto out;
    }
    double timeout = n->cfg->transfer_timeout_s;
    if ((double)ms_left / 1000.0 < timeout) timeout = (double)ms_left / 1000.0;
    double t1 = pf_now();
    int rc = kt_transport_send_wait(n->tx, j->host, j->port, j->reservation_id,
                                    j->reservation_token, n->bundle, size, timeout, err);
    j->usage.transfer_s = pf_now() - t1;
    if (rc != 0) {
        /* the transport reports a timeout at its deadline; anything earlier is the peer */
        grpc_status_code code = j->usage.transfer_s >= timeout * 0.999
                                    ? GRPC_STATUS_DEADLINE_EXCEEDED
                                    : GRPC_STATUS_UNAVAILABLE;
        job_fail(j, code, "KV bundle for reservation %llu at %s:%u (%s): %s",
                 (unsigned long long)j->reservation_id, j->host, j->port,
                 j->decode_node && *j->decode_node ? j->decode_node : "decode node", err);
        goto out;
    }
    j->code = GRPC_STATUS_OK;
    j->details[0] = 0;
    kc_info(j->request_id,
            "prefilled %d tokens (%s): first token %d; %llu entries, %llu bytes (%s) to "
            "reservation %llu at %s:%u (%s); prefill %.3f s, transfer %.3f s",
            j->n_tokens, kr_policy_spec(j->policy), j->first_token, (unsigned long long)entries,
            (unsigned long long)size, kt_dtype_name(j->wire),
            (unsigned long long)j->reservation_id, j->host, j->port,
            j->decode_node && *j->decode_node ? j->decode_node : "-", j->usage.prefill_s,
            j->usage.transfer_s);
out:
    kr_sampler_free(sampler);
    if (seq) {
        kr_seq_free(seq);
        pool_gauges(n);
    }
}
