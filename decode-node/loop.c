/*
 * loop.c - kvrelay-decode's continuous-batching thread. Each iteration:
 *   1. admits the Decode calls handed over since the last one: adopts the kr_seq their bundle
 *      was copied into as it arrived (import.c: every list as received, with the decode rule
 *      it carries) and sets its next position, so new sequences join at any step without a
 *      copy here; no policy code runs here: decode applies each list's rule, whatever the
 *      policy that chose it;
 *   2. ends sequences whose call was cancelled (client gone, deadline) or whose reservation was
 *      released, freeing their blocks at once;
 *   3. runs one kr_forward_batch over every running sequence (chunks of --max-batch), samples
 *      each row (a forced sequence takes its next given id instead; either may add the id's
 *      log-probability and the row's argmax), streams the tokens and ends the sequences that
 *      stopped (EOS, a stop id, max_tokens, or the reservation's bound: CONTEXT). Forced and
 *      sampled sequences share a batch: they differ only in how a row becomes an id.
 * When nothing runs it sleeps on the node's condition variable (woken by a hand-over, a
 * release or shutdown; at the latest at the next reservation expiry, which it also enforces).
 * This thread alone touches the kr_ctx and the running sequences; the pool it shares with the
 * transport's thread, which fills new sequences (the pool serializes taking blocks).
 * Not here: admission (resv.c) and request checks (service.c).
 */
#include "names.h"
#include "node.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvrelay/v1/internal.pb-c.h"
#include "log.h"

typedef struct dn_loop {
    dn_node *n;
    dn_job **run; /* running sequences, [n_run] of cap */
    int n_run, cap;
    kr_seq **seqs; /* [max_batch] batch scratch */
    int32_t *tokens; /* [max_batch] */
    float *logits; /* [max_batch][vocab] */
    float *row; /* [vocab]: one job's logits after its penalties and masks */
    kr_grammar_scratch *gscratch; /* the structured-output mask's memory; NULL without gvocab */
} dn_loop;

/* The blocks the batch's sequences hold, by policy family (the loop's own view: it owns run[]). */
static void publish_families(dn_loop *L)
{
    int64_t blocks[DN_FAMILIES_MAX] = {0};
    for (int i = 0; i < L->n_run; i++) {
        const dn_job *j = L->run[i];
        if (j && j->seq) blocks[kr_policy_family(j->resv->policy)] += kr_seq_blocks(j->seq);
    }
    for (int f = 0; f < kr_policy_n_families(); f++) kc_gauge_set(L->n->m.blocks_by_policy[f], (double)blocks[f]);
}

void dn_job_free(dn_job *job)
{
    if (!job)
        return;
    kr_seq_free(job->seq);
    kr_sampler_free(job->sampler);
    kr_penalty_free(job->pen);
    kr_grammar_seq_free(job->gseq);
    free(job->stop_ids);
    free(job->forced);
    free(job);
}

int dn_loop_submit(dn_node *n, dn_job *job)
{
    pthread_mutex_lock(&n->lock);
    int code = n->stopping ? GRPC_STATUS_UNAVAILABLE
               : job->resv->cancel ? GRPC_STATUS_CANCELLED
                                   : GRPC_STATUS_OK;
    if (code == GRPC_STATUS_OK) {
        job->next = NULL;
        *n->pending_tail = job;
        n->pending_tail = &job->next;
        n->n_pending++;
        dn_publish_locked(n);
        pthread_cond_broadcast(&n->cond);
    }
    pthread_mutex_unlock(&n->lock);
    return code;
}

/* ------------------------------------------------------------------ ending a sequence */

static int send_pending(dn_job *j)
{
    if (j->n_pending == 0)
        return 0;
    uint32_t ids[DN_PENDING_MAX];
    for (int i = 0; i < j->n_pending; i++)
        ids[i] = (uint32_t)j->pending[i];
    Kvrelay__V1__DecodeTokens toks = KVRELAY__V1__DECODE_TOKENS__INIT;
    toks.n_ids = (size_t)j->n_pending;
    toks.ids = ids;
    if (j->logprobs) {
        toks.n_logprobs = toks.n_top_ids = (size_t)j->n_pending;
        toks.logprobs = j->pending_lp;
        toks.top_ids = j->pending_top;
    }
    Kvrelay__V1__TopLogprobs alts[DN_PENDING_MAX], *alt_ptrs[DN_PENDING_MAX];
    if (j->top_logprobs) {
        for (int i = 0; i < j->n_pending; i++) {
            alts[i] = (Kvrelay__V1__TopLogprobs)KVRELAY__V1__TOP_LOGPROBS__INIT;
            alts[i].n_ids = alts[i].n_logprobs = (size_t)j->top_logprobs;
            alts[i].ids = (uint32_t *)j->pending_alt_ids[i]; /* ids of the vocabulary: the same bits */
            alts[i].logprobs = j->pending_alt_lps[i];
            alt_ptrs[i] = &alts[i];
        }
        toks.n_top_logprobs = (size_t)j->n_pending;
        toks.top_logprobs = alt_ptrs;
    }
    Kvrelay__V1__DecodeResponse m = KVRELAY__V1__DECODE_RESPONSE__INIT;
    m.event_case = KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS;
    m.tokens = &toks;
    j->n_pending = 0;
    return kc_call_send(j->call, &m.base); /* packs the message at once */
}

/* Ends a job's call with `code` (details from fmt unless OK; for OK, finish_ok has queued the
 * DecodeFinish, which gRPC sends before the status), logs the outcome, and frees the sequence
 * (its blocks go back to the pool now), the reservation and the job. */
__attribute__((format(printf, 4, 5))) static void finish(dn_loop *L, dn_job *j,
                                                         grpc_status_code code, const char *fmt,
                                                         ...)
{
    dn_node *n = L->n;
    char msg[256] = "";
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
    }
    kr_footprint fp = {0};
    if (j->seq)
        kr_seq_footprint(j->seq, &fp);
    double tpot = j->n_gen > 1 ? (j->t_last - j->t_join) / (double)(j->n_gen - 1) : 0.0;
    if (code == GRPC_STATUS_OK)
        kc_call_finish(j->call, code, NULL);
    else
        kc_call_finish(j->call, code, "%s", msg);
    kc_counter_inc(n->m.requests[code], 1);
    if (code == GRPC_STATUS_OK && j->n_gen > 1)
        kc_histogram_observe(n->m.tpot, tpot);
    kc_info(j->request_id, "decode of reservation %" PRIu64 " ended %s after %d tokens%s%s "
            "(tpot %.2f ms, peak %" PRId64 " KV entries)", j->resv->id, kc_status_name(code),
            j->n_gen, msg[0] ? ": " : "", msg, tpot * 1e3, fp.peak_entries);
    kr_seq_free(j->seq);
    j->seq = NULL;
    pthread_mutex_lock(&n->lock);
    dn_resv_unlink_locked(n, j->resv);
    publish_families(L);
    pthread_mutex_unlock(&n->lock);
    dn_resv_end(n, j->resv);
    dn_job_free(j);
}

/* The normal end: tokens still held back, then DecodeFinish, then OK. */
static void finish_ok(dn_loop *L, dn_job *j, Kvrelay__V1__FinishReason reason)
{
    kr_footprint fp = {0};
    if (j->seq)
        kr_seq_footprint(j->seq, &fp);
    Kvrelay__V1__DecodeFinish fin = KVRELAY__V1__DECODE_FINISH__INIT;
    fin.reason = reason;
    fin.completion_tokens = (uint32_t)j->n_gen;
    fin.tpot_s = j->n_gen > 1 ? (j->t_last - j->t_join) / (double)(j->n_gen - 1) : 0.0;
    fin.footprint_entry_steps = (uint64_t)(fp.attended + 0.5);
    fin.footprint_attended = fp.attended;
    fin.footprint_full = fp.full;
    fin.peak_kv_entries = (uint64_t)fp.peak_entries;
    Kvrelay__V1__DecodeResponse m = KVRELAY__V1__DECODE_RESPONSE__INIT;
    m.event_case = KVRELAY__V1__DECODE_RESPONSE__EVENT_FINISH;
    m.finish = &fin;
    if (send_pending(j) != 0 || kc_call_send(j->call, &m.base) != 0) {
        finish(L, j, GRPC_STATUS_CANCELLED, "the client went away before the end");
        return;
    }
    finish(L, j, GRPC_STATUS_OK, "%s", kc_finish_reason_name(reason));
}

/* A call that is over from the client's side: which status to record. */
static grpc_status_code gone_code(dn_job *j)
{
    return kc_call_ms_left(j->call) <= 0 ? GRPC_STATUS_DEADLINE_EXCEEDED : GRPC_STATUS_CANCELLED;
}

/* After token `id` joined the completion: the reason to stop, or 0 to go on. A forced
 * continuation is scored to its end: EOS and stop ids inside it do not stop it; neither do
 * they before min_tokens, nor EOS with ignore_eos. */
static Kvrelay__V1__FinishReason stop_reason(dn_node *n, const dn_job *j, int32_t id)
{
    if (j->gseq && kr_grammar_seq_done(j->gseq)) /* the document is finished */
        return KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS;
    /* before min_tokens only the prefill node's first token can be EOS or a stop id: it goes on */
    int may_stop = !j->forced && j->n_gen > j->min_tokens;
    if (may_stop && !j->ignore_eos && id == n->mcfg->eos_token_id)
        return KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS;
    for (int i = 0; may_stop && i < j->n_stop; i++)
        if (j->stop_ids[i] == id)
            return KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP;
    if (j->n_gen >= j->max_tokens)
        return KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    /* The reservation's blocks cover budget_tokens completion tokens; the model's positions
     * end at max_position_embeddings. */
    if (j->n_gen >= j->budget_tokens ||
        (j->seq && kr_seq_next_pos(j->seq) >= n->mcfg->max_position_embeddings))
        return KVRELAY__V1__FINISH_REASON__FINISH_REASON_CONTEXT;
    return KVRELAY__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
}

/* ------------------------------------------------------------------ joining the batch */

static void admit(dn_loop *L, dn_job *j)
{
    dn_node *n = L->n;
    j->t_join = j->t_last = dn_now();
    j->n_gen = 1; /* the prefill node's first token */
    int32_t first = j->first_token;
    if (j->pen)
        kr_penalty_add(j->pen, first);
    if (j->gseq && kr_grammar_seq_accept(j->gseq, n->gvocab, first) != 0) {
        finish(L, j, GRPC_STATUS_FAILED_PRECONDITION,
               "response_format: the first token (id %d) is not valid for the schema", (int)first);
        return;
    }
    Kvrelay__V1__FinishReason why = stop_reason(n, j, first);
    if (why) { /* nothing to decode: the router already has the only token */
        finish_ok(L, j, why);
        return;
    }
    /* The rows are in the pool already (import.c copied each part as it arrived, within the
     * reservation's blocks): the sequence only needs its next position. */
    char err[KR_ERR_MAX];
    j->seq = j->resv->seq;
    j->resv->seq = NULL;
    if (kr_seq_set_next_pos(j->seq, j->next_pos, err) != KR_OK) {
        finish(L, j, GRPC_STATUS_INTERNAL, "the KV bundle's sequence: %s", err);
        return;
    }
    kc_histogram_observe(n->m.import_s, j->resv->import_s);
    kt_bundle_set_free(&j->resv->set); /* Decode checked the lists: the parts can go */
    j->next_in = first;
    if (L->n_run == L->cap) {
        int cap = L->cap ? 2 * L->cap : 16;
        dn_job **run = realloc(L->run, (size_t)cap * sizeof *run);
        if (!run) {
            finish(L, j, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
            return;
        }
        L->run = run;
        L->cap = cap;
    }
    L->run[L->n_run++] = j;
    pthread_mutex_lock(&n->lock);
    n->n_running++;
    dn_publish_locked(n);
    publish_families(L);
    pthread_mutex_unlock(&n->lock);
    kc_info(j->request_id, "reservation %" PRIu64 " joined the batch (%" PRId64 " KV entries, "
            "%d running)", j->resv->id, kr_seq_entries(j->seq), L->n_run);
}

/* ------------------------------------------------------------------ one step */

/* Removes run[i] (order is not kept: batch order does not change results). */
static void drop(dn_loop *L, int i)
{
    L->run[i] = L->run[--L->n_run];
    pthread_mutex_lock(&L->n->lock);
    L->n->n_running--;
    pthread_mutex_unlock(&L->n->lock);
}

/* Token `id` was chosen for job j from logits row `row`: stream it or stop. Returns 1 when the
 * job ended. */
static int take_token(dn_loop *L, dn_job *j, int32_t id, const float *row)
{
    dn_node *n = L->n;
    j->n_gen++;
    j->t_last = dn_now();
    kc_counter_inc(n->m.tokens, 1);
    if (j->logprobs) {
        int32_t top;
        j->pending_lp[j->n_pending] = kr_logprob_top(row, n->mcfg->vocab_size, id, &top, j->top_logprobs,
                                                     j->pending_alt_ids[j->n_pending],
                                                     j->pending_alt_lps[j->n_pending]);
        j->pending_top[j->n_pending] = (uint32_t)top;
    }
    j->pending[j->n_pending++] = id;
    if (j->pen)
        kr_penalty_add(j->pen, id);
    if (j->gseq && kr_grammar_seq_accept(j->gseq, n->gvocab, id) != 0) {
        /* the draw came from the mask: a refusal is this node's fault, for this job alone */
        finish(L, j, GRPC_STATUS_INTERNAL,
               "response_format: the drawn token %d is not valid for the schema", (int)id);
        return 1;
    }
    Kvrelay__V1__FinishReason why = stop_reason(n, j, id);
    if (why) {
        finish_ok(L, j, why);
        return 1;
    }
    j->next_in = id;
    /* One id per message while the client keeps up; several once it falls behind. */
    if ((j->n_pending == DN_PENDING_MAX || kc_call_backlog(j->call) == 0) &&
        send_pending(j) != 0) {
        finish(L, j, gone_code(j), "the stream ended while sending");
        return 1;
    }
    return 0;
}

/* The tokens job j may still take, the next one included: max_tokens, the reservation's
 * blocks and the model's context bound them. */
static int64_t tokens_left(const dn_loop *L, const dn_job *j)
{
    int64_t left = (j->max_tokens < j->budget_tokens ? j->max_tokens : j->budget_tokens) - j->n_gen;
    int64_t ctx = (int64_t)L->n->mcfg->max_position_embeddings - kr_seq_next_pos(j->seq);
    return left < ctx ? left : ctx;
}

/* The row job j samples from: the model's logits, or with penalties, before min_tokens or
 * with a response_format a copy in L->row with the penalties applied, EOS (unless ignored) and
 * the stop ids masked out (kr_draw_row, as the prefill node draws the first token), and the
 * tokens the schema refuses masked out (each row alone: a sequence's draw never depends on its
 * batch). Log-probabilities stay those of the model's row. NULL: the schema allows no token. */
static const float *sampling_row(dn_loop *L, dn_job *j, const float *row)
{
    const kr_config *c = L->n->mcfg;
    const kr_draw_mask m = {.on = j->n_gen < j->min_tokens, .eos = j->ignore_eos ? -1 : c->eos_token_id,
                            .stop = j->stop_ids, .n_stop = j->n_stop};
    const float *r = kr_draw_row(j->pen, &m, row, c->vocab_size, L->row);
    if (!j->gseq) return r;
    if (r != L->row) memcpy(L->row, r, (size_t)c->vocab_size * sizeof *L->row);
    double t0 = dn_now();
    int allowed = kr_grammar_seq_mask_logits(j->gseq, L->n->gvocab, L->gscratch, tokens_left(L, j), L->row,
                                             c->vocab_size);
    kc_histogram_observe(L->n->m.mask_s, dn_now() - t0);
    return allowed ? L->row : NULL;
}

/* Feeds run[lo, lo + nb) one token each, samples and streams; a failed batch is retried one
 * sequence at a time so that a bad sequence ends alone. Ended jobs leave NULL in run[]. */
static void step_chunk(dn_loop *L, int lo, int nb)
{
    dn_node *n = L->n;
    const int vocab = n->mcfg->vocab_size;
    char err[KR_ERR_MAX];
    for (int i = 0; i < nb; i++) {
        L->seqs[i] = L->run[lo + i]->seq;
        L->tokens[i] = L->run[lo + i]->next_in;
    }
    double t0 = dn_now();
    int ok = kr_forward_batch(n->ctx, L->seqs, L->tokens, nb, L->logits, err) == KR_OK;
    kc_histogram_observe(n->m.step_s, dn_now() - t0);
    kc_histogram_observe(n->m.batch_size, nb);
    if (!ok) {
        kc_error(NULL, "batched decode step of %d sequences failed: %s; retrying one by one", nb,
                 err);
        for (int i = 0; i < nb; i++) {
            if (kr_forward_batch(n->ctx, &L->seqs[i], &L->tokens[i], 1,
                                 L->logits + (size_t)i * vocab, err) != KR_OK) {
                finish(L, L->run[lo + i], GRPC_STATUS_INTERNAL, "decode step failed: %s", err);
                L->run[lo + i] = NULL;
            }
        }
    }
    for (int i = 0; i < nb; i++) {
        dn_job *j = L->run[lo + i];
        if (!j)
            continue;
        const float *row = L->logits + (size_t)i * vocab;
        /* n_gen tokens so far, the prefill node's first included: this is forced[n_gen - 1]
         * (stop_reason ended the job at max_tokens, so the index is inside the list) */
        const float *draw = j->forced ? NULL : sampling_row(L, j, row);
        if (!j->forced && !draw) {
            finish(L, j, GRPC_STATUS_FAILED_PRECONDITION,
                   "response_format: no token of the vocabulary continues the document");
            L->run[lo + i] = NULL;
            continue;
        }
        int32_t id = j->forced ? j->forced[j->n_gen - 1] : kr_sampler_sample(j->sampler, draw);
        if (take_token(L, j, id, row))
            L->run[lo + i] = NULL;
    }
}

static void step(dn_loop *L)
{
    dn_node *n = L->n;
    int max_batch = n->cfg.max_batch, total = L->n_run;
    for (int lo = 0; lo < total; lo += max_batch)
        step_chunk(L, lo, total - lo < max_batch ? total - lo : max_batch);
    for (int i = L->n_run - 1; i >= 0; i--)
        if (!L->run[i])
            drop(L, i);
    pthread_mutex_lock(&n->lock);
    dn_publish_locked(n);
    publish_families(L);
    pthread_mutex_unlock(&n->lock);
}

/* ------------------------------------------------------------------ the thread */

/* Waits until there is work: a hand-over, a running sequence, shutdown, or reservations whose
 * time is up, unlinked onto *dead for the caller to end after unlocking. */
static void wait_for_work_locked(dn_node *n, dn_loop *L, dn_resv **dead)
{
    for (;;) {
        double now = dn_now(), next = dn_resv_reap_locked(n, now, dead);
        if (n->stopping || n->pending || L->n_run > 0 || *dead)
            return;
        double wait = next - now;
        if (wait > 1.0)
            wait = 1.0;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        long ns = (long)(wait * 1e9) + 1000000L;
        until.tv_sec += ns / 1000000000L;
        until.tv_nsec += ns % 1000000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&n->cond, &n->lock, &until);
    }
}

static void *loop_main(void *arg)
{
    dn_loop *L = arg;
    dn_node *n = L->n;
    for (;;) {
        dn_resv *dead = NULL;
        pthread_mutex_lock(&n->lock);
        wait_for_work_locked(n, L, &dead);
        dn_job *joining = n->pending;
        n->pending = NULL;
        n->pending_tail = &n->pending;
        n->n_pending = 0;
        int stopping = n->stopping;
        /* Releases of running sequences (Release sets the flag under this lock). */
        for (int i = 0; i < L->n_run; i++)
            L->run[i]->released = L->run[i]->resv->cancel;
        dn_publish_locked(n);
        pthread_mutex_unlock(&n->lock);

        for (dn_resv *r = dead, *nx; r; r = nx) { /* freed outside the lock */
            nx = r->next;
            dn_resv_end(n, r);
        }
        for (dn_job *j = joining, *nx; j; j = nx) {
            nx = j->next;
            j->next = NULL;
            if (stopping)
                finish(L, j, GRPC_STATUS_UNAVAILABLE, "decode node %s is shutting down",
                       n->cfg.id);
            else if (kc_call_cancelled(j->call))
                finish(L, j, gone_code(j), "the client went away before decoding started");
            else
                admit(L, j);
        }
        for (int i = L->n_run - 1; i >= 0; i--) {
            dn_job *j = L->run[i];
            if (stopping)
                finish(L, j, GRPC_STATUS_UNAVAILABLE, "decode node %s is shutting down",
                       n->cfg.id);
            else if (j->released)
                finish(L, j, GRPC_STATUS_CANCELLED, "reservation %" PRIu64 " was released",
                       j->resv->id);
            else if (kc_call_cancelled(j->call))
                finish(L, j, gone_code(j), "the client went away");
            else
                continue;
            drop(L, i);
        }
        if (stopping)
            break;
        if (L->n_run > 0)
            step(L);
    }
    pthread_mutex_lock(&n->lock);
    n->loop_alive = 0;
    dn_publish_locked(n);
    publish_families(L);
    pthread_mutex_unlock(&n->lock);
    free(L->run);
    free(L->seqs);
    free(L->tokens);
    free(L->logits);
    free(L->row);
    kr_grammar_scratch_free(L->gscratch);
    free(L);
    return NULL;
}

int dn_loop_start(dn_node *n, char *err)
{
    dn_loop *L = calloc(1, sizeof *L);
    int mb = n->cfg.max_batch;
    if (L) {
        L->n = n;
        L->seqs = calloc((size_t)mb, sizeof *L->seqs);
        L->tokens = calloc((size_t)mb, sizeof *L->tokens);
        L->logits = malloc((size_t)mb * (size_t)n->mcfg->vocab_size * sizeof *L->logits);
        L->row = malloc((size_t)n->mcfg->vocab_size * sizeof *L->row);
        char gerr[KR_ERR_MAX];
        if (n->gvocab && kr_grammar_scratch_create(n->gvocab, &L->gscratch, gerr) != 0)
            L->gscratch = NULL;
    }
    if (!L || !L->seqs || !L->tokens || !L->logits || !L->row || (n->gvocab && !L->gscratch)) {
        if (L) {
            kr_grammar_scratch_free(L->gscratch);
            free(L->seqs);
            free(L->tokens);
            free(L->logits);
            free(L->row);
        }
        free(L);
        snprintf(err, 256, "out of memory for a batch of %d (%d-token vocabulary)", mb,
                 n->mcfg->vocab_size);
        return -1;
    }
    n->pending_tail = &n->pending;
    n->loop_alive = 1;
    if (pthread_create(&n->loop, NULL, loop_main, L) != 0) {
        n->loop_alive = 0;
        free(L->seqs);
        free(L->tokens);
        free(L->logits);
        free(L->row);
        kr_grammar_scratch_free(L->gscratch);
        free(L);
        snprintf(err, 256, "cannot start the batching thread");
        return -1;
    }
    return 0;
}

void dn_loop_stop(dn_node *n)
{
    pthread_mutex_lock(&n->lock);
    n->stopping = 1;
    pthread_cond_broadcast(&n->cond);
    pthread_mutex_unlock(&n->lock);
    pthread_join(n->loop, NULL);
}
