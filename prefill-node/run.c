/*
 * run.c - one prefill job on the worker thread (prefill.h): chunked prefill with the request's
 * policy on the node's one kr_ctx, through the prefix cache (prefix-cache.h: the prompt may
 * continue from a cached state of its prefix, exactly), the first token (sampled, or forced;
 * with its log-probability and the row's argmax when asked), the KV bundle written straight from
 * the sequence's lists, the send to the decode node's reservation, and the usage.
 *
 * Layer-wise pipelining (--pipeline on, with more than one layer): kr_prefill_layers says when
 * leading layers are final during the last chunk; each such group of layers is written as a
 * layer segment and sent while the later layers compute, one part in flight at a time. The
 * last part (the remaining layers, with the sampled first token) follows the prefill; the
 * decode node assembles the parts and admits the sequence once the last one arrived. Off, or
 * with one layer: one whole bundle after the prefill.
 * Each part goes into its own worker-owned buffer (n->bufs), grown to the largest part so far
 * (a request does not allocate it again), which is also the send buffer: kr_seq_list_visit
 * hands over each list's rows in place in the KV blocks, one run per block, and the writer
 * converts them to the payload dtype as it copies them in, so each shipped byte is written once
 * on this side. The sequence is freed as soon as the last part is written, before the wait for
 * the transfer, so the pool never holds a request's blocks across a network wait.
 * Cancellation: kr_prefill runs its chunks in one call, so a call cancelled mid-prefill is
 * noticed after it; the rest of the transfer is skipped then.
 */
#include "bundle-rule.h"
#include "prefill.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "partbuf.h"

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
    kr_ctx_params cp = {.backend = n->cfg->backend, .n_threads = n->cfg->threads,
                        .max_chunk = n->cfg->chunk, .kv_dtype = n->cfg->cache_dtype};
    if (kr_ctx_create(n->model, &cp, &n->ctx, err) != KR_OK) return -1;

    if (kr_ctx_kv_pool_create(n->ctx, PF_BLOCK_SIZE, n->cfg->kv_blocks, &n->pool, err) != KR_OK)
        return -1;
    /* structured output: the vocabulary's mask (requests with response_format are refused
     * where the model has no tokenizer) */
    if (kr_grammar_vocab_load(n->cfg->model_dir, c->eos_token_id, &n->gvocab, n->gvocab_err) == 0 &&
        kr_grammar_scratch_create(n->gvocab, &n->gscratch, err) != 0)
        return -1;
    n->logits = malloc(sizeof(float) * (size_t)c->vocab_size);
    n->draw_row = malloc(sizeof(float) * (size_t)c->vocab_size);
    n->lists = calloc((size_t)c->n_layers * (size_t)c->n_kv_heads, sizeof *n->lists);
    n->bufs = calloc((size_t)c->n_layers + KT_BUNDLE_MAX_EARLY_PARTS, sizeof *n->bufs);
    n->sent = calloc((size_t)c->n_layers * (size_t)c->n_kv_heads, sizeof *n->sent);
    if (!n->logits || !n->draw_row || !n->lists || !n->bufs || !n->sent) {
        snprintf(err, KR_ERR_MAX, "out of memory for the worker's scratch buffers");
        return -1;
    }
    return 0;
}

void pf_run_free(pf_node *n)
{
    for (int i = 0; n->bufs && i < n->mcfg->n_layers + KT_BUNDLE_MAX_EARLY_PARTS; i++)
        kt_partbuf_free(n->bufs[i].p);
    free(n->bufs);
    free(n->sent);
    free(n->lists);
    free(n->logits);
    free(n->draw_row);
    kr_grammar_scratch_free(n->gscratch);
    kr_grammar_vocab_free(n->gvocab);
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

/* A send buffer of at least `size` bytes, 64-byte aligned (the bundle's sections are 64-byte
 * aligned relative to it, so rows land aligned); a bundle buffer of partbuf.h, so from 2 MiB up
 * in huge pages, which the kernel's socket copy reads faster. */
static int buf_room(pf_buf *b, uint64_t size, char *err)
{
    if (size <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 1u << 16;
    while (cap < size)
        cap *= 2;
    uint8_t *p = kt_partbuf_alloc(cap);
    if (!p) {
        snprintf(err, KR_ERR_MAX, "out of memory for a %llu-byte bundle", (unsigned long long)size);
        return -1;
    }
    kt_partbuf_free(b->p);
    b->p = p;
    b->cap = cap;
    return 0;
}

/* One run of a list's rows, from the KV blocks into the bundle (kr_list_rows_fn). */
typedef struct put_arg {
    kt_bundle_writer *w;
    uint32_t layer, head; /* layer within the bundle being written */
} put_arg;

static int put_rows(void *arg, int first, int n, const int32_t *pos, kr_dtype dtype,
                    const void *k, const void *v, char *err)
{
    const put_arg *a = arg;
    (void)first;
    /* the writer converts the cache's rows (f32, bf16 or f16) to the wire dtype */
    return kt_bundle_writer_put(a->w, a->layer, a->head,
                                &(kt_rows_in){(uint32_t)n, pos, kt_dtype_of_cache(dtype), k, v},
                                err);
}

/* A transfer in parts (docs/prefill-node.md, "Layer-wise pipelining"): part k is written into
 * n->bufs[k] as soon as its layers are final and sent once part k-1 is acknowledged, which is
 * what the transport asks of parts. The transport's callbacks (its progress thread) count the
 * outcomes under `mu`; the worker sends and waits. */
typedef struct pf_pipe {
    pf_node *n;
    pf_job *j;
    int layers_written; /* layers [0, layers_written) are final and sent up to their end */
    int written, sent; /* parts written, parts handed to the transport */
    int chunk_ends, early_every; /* chunk-end calls so far; an early part at every early_every-th */
    uint64_t size[KT_BUNDLE_MAX_LAYERS + KT_BUNDLE_MAX_EARLY_PARTS]; /* bytes of each part */
    uint64_t bytes, entries;
    uint64_t offset; /* bytes of the parts handed over: where a put part (or its head) goes */
    uint64_t rows_off; /* K bytes of the parts put into the decode node's blocks: where the next
                          one's K and V go */
    int rows_parts; /* parts put into the decode node's blocks */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int settled; /* sends whose callback ran */
    int failed; /* a part failed: nothing more is sent */
    int timed_out; /* ... at its timeout (the deadline or the transfer cap), or the deadline had
                      passed before it was sent */
    double sent_at, timeout; /* when the part in flight was handed over, and its timeout */
    char err[KT_ERR_MAX];
} pf_pipe;

/* Writes layers [first, first + count) of `seq` as the pipe's next part, into its buffer
 * (n->bufs[p->written]): a whole bundle (segment 0, all the layers) or a layer segment, whose
 * first_token the caller passes provisional when a later segment follows. Each list's entries
 * from n->sent on go in (the ones before are in an earlier part, which this one continues), and
 * n->sent moves to the list's end. Counts the part, its bytes and its entries in p. */
static int pipe_write(pf_pipe *p, const kr_seq *seq, int first, int count, int segment,
                      int32_t first_token, char *err)
{
    pf_node *n = p->n;
    const pf_job *j = p->j;
    pf_buf *b = &n->bufs[p->written];
    const kr_config *c = n->mcfg;
    kt_bundle_header h;
    memset(&h, 0, sizeof h);
    snprintf(h.fingerprint, sizeof h.fingerprint, "%s", kr_model_fingerprint(n->model));
    h.n_layers = (uint32_t)count;
    h.n_kv_heads = (uint32_t)c->n_kv_heads;
    h.head_dim = (uint32_t)c->head_dim;
    h.dtype = j->wire;
    h.first_token = first_token;
    h.prompt_len = j->n_tokens;
    h.next_pos = kr_seq_next_pos(seq);
    h.segment = (uint32_t)segment;
    h.first_layer = (uint32_t)first;
    snprintf(h.policy, sizeof h.policy, "%s", kr_policy_spec(j->policy));
    kt_bundle_list *lists = n->lists + (size_t)first * (size_t)c->n_kv_heads;
    int *sent = n->sent + (size_t)first * (size_t)c->n_kv_heads;
    uint64_t entries = 0, rows = 0;
    int aligned = 1; /* every list's earlier parts end on a block boundary */
    for (int l = 0; l < count; l++)
        for (int kv = 0; kv < c->n_kv_heads; kv++) {
            int len, pinned, from = sent[l * c->n_kv_heads + kv];
            kr_seq_list_shape(seq, first + l, kv, &len, &pinned);
            kr_list_rule rule;
            kr_seq_list_rule(seq, first + l, kv, &rule);
            /* this piece's share of the pinned set, which is the list's first entries */
            int piece_pinned = pinned - from < 0 ? 0 : pinned - from;
            lists[l * c->n_kv_heads + kv] = kt_bundle_list_of(len - from, piece_pinned, &rule);
            entries += (uint64_t)(len - from);
            const uint64_t br = j->block_rows ? j->block_rows : 1;
            rows += ((uint64_t)(len - from) + br - 1) / br * br;
            aligned &= (uint64_t)from % br == 0;
        }
    /* Padded to the decode node's blocks, the part lands in them with no copy there; where
     * that would add more than an eighth to the rows on the wire (short lists, large blocks) it
     * goes packed and the decode node copies it, as it does a part continuing lists that an
     * earlier part left ending inside a block (a list adopts whole blocks only). */
    h.block_rows = aligned && rows - entries <= entries / 8 ? j->block_rows : 0;
    uint64_t size;
    if (kt_bundle_size(&h, lists, &size, err) != 0 || buf_room(b, size, err) != 0) return -1;
    kt_bundle_writer w;
    if (kt_bundle_writer_begin(&w, &h, lists, b->p, b->cap, err) != 0) return -1;
    for (int l = 0; l < count; l++)
        for (int kv = 0; kv < c->n_kv_heads; kv++) {
            put_arg a = {.w = &w, .layer = (uint32_t)l, .head = (uint32_t)kv};
            int from = sent[l * c->n_kv_heads + kv], n_new = (int)lists[l * c->n_kv_heads + kv].count;
            if (kr_seq_list_visit(seq, first + l, kv, from, n_new, put_rows, &a, err) != KR_OK)
                return -1;
        }
    if (kt_bundle_writer_finish(&w, &size, err) != 0) return -1;
    for (int i = 0; i < count * c->n_kv_heads; i++)
        sent[i] += (int)lists[i].count;
    p->size[p->written++] = size;
    p->bytes += size;
    p->entries += entries;
    return 0;
}

static void pipe_cb(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    pf_pipe *p = arg;
    (void)id;
    (void)bytes;
    pthread_mutex_lock(&p->mu);
    if (status != 0 && !p->failed) {
        p->failed = 1;
        p->timed_out = pf_now() - p->sent_at >= p->timeout * 0.999;
        snprintf(p->err, sizeof p->err, "%s", err);
    }
    p->settled++;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Records a part that could not be handed to the transport (timed_out: because the call's
 * deadline had passed), unless an earlier failure was recorded. */
static void pipe_fail(pf_pipe *p, int timed_out, const char *err)
{
    pthread_mutex_lock(&p->mu);
    if (!p->failed) {
        p->failed = 1;
        p->timed_out = timed_out;
        snprintf(p->err, sizeof p->err, "%s", err);
    }
    pthread_mutex_unlock(&p->mu);
}

/* The next written part, once the one before it is acknowledged; `last` says whether every
 * part is written. Returns -1 once a part failed (p->err says why). */
static int pipe_pump(pf_pipe *p, int last)
{
    pthread_mutex_lock(&p->mu);
    int idle = p->settled == p->sent, failed = p->failed;
    pthread_mutex_unlock(&p->mu);
    if (failed) return -1;
    if (!idle || p->sent == p->written) return 0;
    const pf_job *j = p->j;
    int64_t ms_left = kc_call_ms_left(j->call);
    if (ms_left <= 0) { /* the deadline passed while the prefill ran, or while the last part was
                           in flight: the call's deadline, not the peer, ends it */
        pipe_fail(p, 1, "deadline passed before the bundle was sent");
        return -1;
    }
    double timeout = p->n->cfg->transfer_timeout_s;
    if ((double)ms_left / 1000.0 < timeout) timeout = (double)ms_left / 1000.0;
    char err[KT_ERR_MAX];
    int k = p->sent;
    unsigned flags = last && k == p->written - 1 ? 0 : KT_SEND_MORE;
    p->sent_at = pf_now();
    p->timeout = timeout;
    const void *buf = p->n->bufs[k].p;
    /* In RMA mode a part padded to the decode node's blocks puts its K and V into the blocks
     * it took at Reserve, while they have room, and its head into the reservation's buffer;
     * any other part is put whole into the buffer. */
    kt_bundle_layout lay;
    const int rows = j->rma.rkey_len && j->rma_rows.bytes &&
                     kt_bundle_layout_read(buf, (size_t)p->size[k], &lay, NULL) == 0 && lay.split &&
                     lay.block_rows == j->block_rows && lay.block_rows > 0 && lay.k_len == lay.v_len &&
                     lay.k_len <= j->rma_rows.bytes - p->rows_off;
    const kt_peer to = {j->host, j->port, j->reservation_id, j->reservation_token};
    const kt_put_dest at = {.key = &j->rma, .offset = p->offset,
                            .rows = rows ? &j->rma_rows : NULL, .rows_off = p->rows_off};
    const kt_send_opts o = {.flags = flags, .timeout_s = timeout, .cb = pipe_cb, .cb_arg = p,
                            .request_id = j->request_id};
    if ((j->rma.rkey_len ? kt_transport_put(p->n->tx, &to, &at, buf, p->size[k], &o, err)
                         : kt_transport_send(p->n->tx, &to, buf, p->size[k], &o, err)) != 0) {
        pipe_fail(p, 0, err);
        return -1;
    }
    p->offset += rows ? lay.head_len : p->size[k];
    p->rows_off += rows ? lay.k_len : 0;
    p->rows_parts += rows;
    p->sent++;
    return 0;
}

/* kr_layers_final_fn: layers [0, n_final) are final. Every layer but the last goes out now as
 * a segment; the last waits for the first token (the last part carries it). n_final 0: a chunk
 * before the last ended and every entry so far is final (full): they go out as one early part
 * over every layer, at most KT_BUNDLE_MAX_EARLY_PARTS of them (every early_every-th chunk). */
static int pipe_layers_final(void *arg, const kr_seq *s, int n_final, char *err)
{
    pf_pipe *p = arg;
    if (n_final == 0 && ++p->chunk_ends % p->early_every == 0) {
        if (pipe_write(p, s, 0, p->n->mcfg->n_layers, 1, 0, err) != 0) return -1;
    } else if (n_final < p->n->mcfg->n_layers && n_final > p->layers_written) {
        int first = p->layers_written;
        /* provisional: the token is not sampled yet; every position is below the prompt's end */
        if (pipe_write(p, s, first, n_final - first, 1, 0, err) != 0) return -1;
        p->layers_written = n_final;
    }
    if (pipe_pump(p, 0) != 0) {
        snprintf(err, KR_ERR_MAX, "the KV transfer failed: %.480s", p->err);
        return -1;
    }
    return KR_OK;
}

/* Waits for the callback of every part sent: the buffers are the worker's again. */
static void pipe_wait(pf_pipe *p)
{
    pthread_mutex_lock(&p->mu);
    while (p->settled < p->sent)
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* Sends what is left, one part at a time, and waits for the last callback. */
static int pipe_finish(pf_pipe *p)
{
    pipe_pump(p, 1);
    pthread_mutex_lock(&p->mu);
    while (p->settled < p->sent || (!p->failed && p->sent < p->written)) {
        if (p->settled == p->sent) { /* idle, more to send */
            pthread_mutex_unlock(&p->mu);
            pipe_pump(p, 1);
            pthread_mutex_lock(&p->mu);
            continue;
        }
        pthread_cond_wait(&p->cv, &p->mu);
    }
    int failed = p->failed;
    pthread_mutex_unlock(&p->mu);
    return failed ? -1 : 0;
}

static void pool_gauges(pf_node *n)
{
    int free_blocks = kr_kv_pool_n_free(n->pool);
    kc_gauge_set(n->metrics.blocks_used, kr_kv_pool_n_blocks(n->pool) - free_blocks);
    kc_gauge_set(n->metrics.blocks_free, free_blocks);
}

/* The transport's failure as the call's status: a part that failed at its timeout, or was not
 * sent because the deadline had passed, is the deadline (or the transfer cap); anything earlier
 * is the peer. */
static void transfer_fail(pf_job *j, const pf_pipe *p)
{
    grpc_status_code code = p->timed_out ? GRPC_STATUS_DEADLINE_EXCEEDED : GRPC_STATUS_UNAVAILABLE;
    job_fail(j, code, "KV bundle for reservation %llu at %s:%u (%s): %s",
             (unsigned long long)j->reservation_id, j->host, j->port,
             j->decode_node && *j->decode_node ? j->decode_node : "decode node", p->err);
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
    pf_pipe *p = calloc(1, sizeof *p);
    if (!p) {
        job_fail(j, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    p->n = n;
    p->j = j;
    /* the chunk-end calls a prompt gets (kr_prefill_layers: one per chunk before the last),
     * spread over at most KT_BUNDLE_MAX_EARLY_PARTS early parts */
    int chunk_ends = (j->n_tokens - 1) / n->cfg->chunk;
    p->early_every = chunk_ends / KT_BUNDLE_MAX_EARLY_PARTS + (chunk_ends % KT_BUNDLE_MAX_EARLY_PARTS != 0);
    if (p->early_every < 1) p->early_every = 1;
    memset(n->sent, 0, sizeof *n->sent * (size_t)c->n_layers * (size_t)c->n_kv_heads);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (kr_seq_create(n->pool, c->n_layers, c->n_kv_heads, &seq, err) != KR_OK ||
        kr_seq_set_policy(seq, j->policy, err) != KR_OK) {
        job_fail(j, GRPC_STATUS_INTERNAL, "%s", err);
        goto out;
    }
    /* The inputs were validated; what can fail now is the pool: a policy whose observers or
     * chunk transients do not fit next to a long prompt. The pool is empty when a job starts,
     * so the same request fails the same way every time: FAILED_PRECONDITION (the operator
     * must raise --kv-blocks), not RESOURCE_EXHAUSTED, which the router reads as "queue full,
     * try again later". With pipelining, a failed part stops the prefill early: that is the
     * transfer's failure. */
    int pipelined = n->cfg->pipeline && c->n_layers > 1 && !j->score_only;
    if (j->scores.on && pf_scores_init(&j->scores, j->tokens, j->n_tokens, c->vocab_size, j->top_logprobs) != 0) {
        job_fail(j, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for the prompt's scores");
        goto out;
    }
    /* Through the prefix cache: the prompt may continue from a cached state (exact: only
     * prefix-deterministic policies reuse), and its states at chunk boundaries are kept. */
    const pf_cache_job cj = {.tokens = j->tokens, .n = j->n_tokens, .chunk = n->cfg->chunk,
                             .policy = j->policy, .fn = pipelined ? pipe_layers_final : NULL,
                             .arg = p, .score_fn = j->scores.on ? pf_scores_rows : NULL,
                             .score_arg = &j->scores, .score_buf = j->scores.buf};
    if (pf_cache_prefill(n->cache, n->ctx, n->pool, &cj, n->logits, &seq,
                         &j->usage.cached_tokens, err) != KR_OK) {
        if (p->failed)
            transfer_fail(j, p);
        else
            job_fail(j, GRPC_STATUS_FAILED_PRECONDITION,
                     "%s (this node's --kv-blocks %d is too small for this prompt under "
                     "kv_policy %s)",
                     err, n->cfg->kv_blocks, kr_policy_spec(j->policy));
        goto out;
    }
    if (j->score_only) { /* scored: nothing to sample, nothing to ship */
        kr_seq_footprint(seq, &j->usage.footprint);
        j->usage.prefill_s = pf_now() - t0;
        j->code = GRPC_STATUS_OK;
        j->details[0] = 0;
        kc_info(j->request_id, "scored %d prompt tokens (%s) in %.3f s, no bundle", j->n_tokens,
                kr_policy_spec(j->policy), j->usage.prefill_s);
        goto out;
    }
    if (j->forced_first >= 0) {
        j->first_token = j->forced_first;
    } else {
        if (kr_sampler_create(&j->sampling, c->vocab_size, &sampler, err) != KR_OK) {
            job_fail(j, GRPC_STATUS_INTERNAL, "%s", err);
            goto out;
        }
        /* penalties, min_tokens' mask and response_format's on a copy: log-probabilities stay
         * the model's row's */
        const float *row = kr_draw_row(j->pen, &j->mask, n->logits, c->vocab_size, n->draw_row);
        if (j->gseq) {
            if (row != n->draw_row) memcpy(n->draw_row, row, sizeof(float) * (size_t)c->vocab_size);
            if (kr_grammar_seq_mask_logits(j->gseq, n->gvocab, n->gscratch, j->gbudget, n->draw_row,
                                           c->vocab_size) == 0) {
                job_fail(j, GRPC_STATUS_FAILED_PRECONDITION,
                         "response_format: no token of the vocabulary continues the document");
                goto out;
            }
            row = n->draw_row;
        }
        j->first_token = kr_sampler_sample(sampler, row);
    }
    if (j->logprobs)
        j->first_logprob = kr_logprob_top(n->logits, c->vocab_size, j->first_token, &j->first_top_id,
                                          j->top_logprobs, j->first_top_ids, j->first_top_lps);
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

    /* the last part: the layers not sent yet, with the first token; a whole bundle when
     * nothing was sent before */
    int first = p->layers_written;
    if (pipe_write(p, seq, first, c->n_layers - first, p->written > 0, j->first_token, err) != 0) {
        job_fail(j, GRPC_STATUS_INTERNAL, "writing the KV bundle: %s", err);
        goto out;
    }
    kr_seq_free(seq); /* the bundle holds what is shipped: the blocks go back now */
    seq = NULL;
    pool_gauges(n);
    double t1 = pf_now();
    j->usage.prefill_s = t1 - t0;
    j->usage.kv_entries = p->entries;
    j->usage.kv_bytes = p->entries * 2u * kt_dtype_row_bytes(j->wire, (uint32_t)c->head_dim);
    pthread_mutex_lock(&p->mu);
    j->usage.parts_early = p->settled;
    pthread_mutex_unlock(&p->mu);
    int rc = pipe_finish(p);
    j->usage.transfer_s = pf_now() - t1;
    j->usage.parts = p->written;
    if (rc != 0) {
        transfer_fail(j, p);
        goto out;
    }
    j->code = GRPC_STATUS_OK;
    j->details[0] = 0;
    char rows_note[80] = "";
    if (p->rows_parts)
        snprintf(rows_note, sizeof rows_note, "; K and V of %d part(s) put into its KV blocks",
                 p->rows_parts);
    kc_info(j->request_id,
            "prefilled %d tokens (%s), %d of them from the prefix cache: first token %d; %llu "
            "entries, %llu bytes (%s) in %d part(s), %d sent during prefill, %s reservation %llu "
            "at %s:%u (%s); prefill %.3f s, transfer %.3f s after it%s",
            j->n_tokens, kr_policy_spec(j->policy), j->usage.cached_tokens, j->first_token,
            (unsigned long long)p->entries,
            (unsigned long long)p->bytes, kt_dtype_name(j->wire), p->written, j->usage.parts_early,
            j->rma.rkey_len ? "put into" : "sent to", (unsigned long long)j->reservation_id,
            j->host, j->port, j->decode_node && *j->decode_node ? j->decode_node : "-",
            j->usage.prefill_s, j->usage.transfer_s, rows_note);
out:
    pipe_wait(p); /* no send may still read a buffer when the next job starts */
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
    kr_sampler_free(sampler);
    if (seq) {
        kr_seq_free(seq);
        pool_gauges(n);
    }
}
