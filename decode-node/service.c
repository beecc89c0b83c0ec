/*
 * service.c - the kvrelay.v1.Decode service of kvrelay-decode (proto/kvrelay/v1/internal.proto):
 * Reserve (admission), Decode (waits for the reservation's bundle, checks it against this model
 * and the reservation, and hands a detached call to the batching loop), Release, Status.
 * Every refusal is a gRPC status whose details name the field and the value at fault; nothing a
 * request says can stop the node. Undecodable request bytes never get here: kc_server answers
 * them INVALID_ARGUMENT itself.
 */
#include "node.h"

#include "bundle-rule.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "kvrelay/v1/internal.pb-c.h"
#include "penalties.h"
#include "rma-rows.h"
#include "log.h"

#define PATH_RESERVE "/kvrelay.v1.Decode/Reserve"
#define PATH_DECODE "/kvrelay.v1.Decode/Decode"
#define PATH_RELEASE "/kvrelay.v1.Decode/Release"
#define PATH_STATUS "/kvrelay.v1.Decode/Status"

/* How often a Decode call waiting for its bundle looks at its own cancellation. */
#define WAIT_SLICE_MS 50

/* Refuses a call: sets the status details and logs one line with the request id. Returns code. */
__attribute__((format(printf, 4, 5))) static int refuse(kc_call *call, const char *rid,
                                                        grpc_status_code code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (code == GRPC_STATUS_INVALID_ARGUMENT || code == GRPC_STATUS_RESOURCE_EXHAUSTED ||
        code == GRPC_STATUS_OUT_OF_RANGE ||
        code == GRPC_STATUS_NOT_FOUND)
        kc_info(rid, "%s refused (%s): %s", kc_call_method(call), kc_status_name(code), msg);
    else
        kc_warn(rid, "%s failed (%s): %s", kc_call_method(call), kc_status_name(code), msg);
    return kc_call_error(call, code, "%s", msg);
}

static void count(kc_counter **by_status, int code)
{
    if (code >= 0 && code <= GRPC_STATUS_UNAUTHENTICATED)
        kc_counter_inc(by_status[code], 1);
}

/* ------------------------------------------------------------------ Reserve */

static int reserve(kc_call *call, const Kvrelay__V1__ReserveRequest *req, dn_node *n,
                   const char *rid)
{
    const kr_config *c = n->mcfg;
    int max_prompt = c->max_position_embeddings - 1;
    if (req->prompt_tokens == 0)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                             "prompt_tokens is 0: a reservation needs the prompt's length");
    if (req->prompt_tokens > (uint32_t)max_prompt)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                             "prompt_tokens %u exceeds the model's context: at most %d "
                             "(max_position_embeddings %d - 1)",
                             req->prompt_tokens, max_prompt, c->max_position_embeddings);
    if (req->max_tokens == 0)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                             "max_tokens is 0: at least the first token is generated");
    if (req->max_tokens > (uint32_t)c->max_position_embeddings)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                             "max_tokens %u exceeds the model's context (max_position_embeddings "
                             "%d)", req->max_tokens, c->max_position_embeddings);
    if (req->ttl_ms > DN_MAX_TTL_MS)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                             "ttl_ms %u is over the limit of %d ms", req->ttl_ms, DN_MAX_TTL_MS);
    const char *spec = req->kv_policy && req->kv_policy[0] ? req->kv_policy : "full";
    char err[KT_ERR_MAX > KR_ERR_MAX ? KT_ERR_MAX : KR_ERR_MAX];
    kr_policy *policy = NULL;
    if (kr_policy_parse(spec, c, &policy, err) != KR_OK)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT, "kv_policy '%s': %s", spec, err);
    const dn_resv_ask ask = {.request_id = rid, .policy = policy,
                             .prompt_tokens = (int)req->prompt_tokens,
                             .max_tokens = (int)req->max_tokens,
                             .ttl_ms = req->ttl_ms ? (int)req->ttl_ms : n->cfg.ttl_ms};
    dn_resv_grant g;
    int code = dn_resv_admit(n, &ask, &g, err);
    if (code != GRPC_STATUS_OK)
        return refuse(call, rid, (grpc_status_code)code, "%s", err);
    const uint64_t id = g.id;
    kc_info(rid, "reserved %" PRId64 " blocks as reservation %" PRIu64 " (%u prompt tokens, %u "
            "max_tokens, %s, ttl %d ms)%s", g.blocks, id, req->prompt_tokens, req->max_tokens,
            spec, ask.ttl_ms, g.rows.bytes ? "; mapped for puts, with a run of blocks for K and V"
                              : g.rma.rkey_len ? "; mapped for puts" : "");
    Kvrelay__V1__ReserveResponse resp = KVRELAY__V1__RESERVE_RESPONSE__INIT;
    resp.reservation_id = id;
    resp.transfer_address = n->transfer_addr;
    resp.reserved_blocks = (uint64_t)g.blocks;
    resp.expires_unix_ms = g.expires_unix_ms;
    resp.reservation_token = (ProtobufCBinaryData){.len = sizeof g.token, .data = g.token};
    resp.rma_address = g.rma.address;
    resp.rma_key = (ProtobufCBinaryData){.len = g.rma.rkey_len, .data = g.rma.rkey};
    /* A bundle padded to the pool's blocks, in their dtype, is received into them (AM mode,
     * import.c) or put into the run of them the reservation took (RMA mode, when it took one:
     * without, puts land in the buffer whatever the layout, so none is asked for). */
    const int padded = !n->cfg.rma || g.rows.bytes;
    resp.kv_block_rows = padded ? (uint32_t)kr_kv_pool_block_size(n->pool) : 0;
    resp.kv_block_dtype = (char *)(padded ? kt_dtype_name((kt_dtype)kr_kv_pool_dtype(n->pool)) : "");
    Kvrelay__V1__RmaRows rr;
    resp.rma_rows = kc_rma_rows_to_pb(&g.rows, &rr);
    if (kc_call_send(call, &resp.base) != 0) {
        /* The router is gone or past its deadline: it will never use the reservation. */
        dn_resv_release(n, id, rid);
        return GRPC_STATUS_CANCELLED;
    }
    return GRPC_STATUS_OK;
}

static int on_reserve(kc_call *call, const ProtobufCMessage *msg, void *user)
{
    dn_node *n = user;
    const Kvrelay__V1__ReserveRequest *req = (const void *)msg;
    char rid[DN_REQUEST_ID_MAX + 1];
    snprintf(rid, sizeof rid, "%s", req->request_id ? req->request_id : "");
    int code = reserve(call, req, n, rid);
    count(n->m.reserves, code);
    return code;
}

/* ------------------------------------------------------------------ Decode */

/* Sampling as the router sends it -> the engine's. Must map exactly as the prefill node does:
 * the decode node's sampler continues the prefill node's stream of draws. */
static int sampling_from(const Kvrelay__V1__Sampling *s, kr_sampling *out, char *err)
{
    kr_sampling_default(out);
    if (!s || s->temperature == 0.0f) { /* absent or temperature 0: greedy */
        out->greedy = 1;
        return KR_OK;
    }
    out->temperature = s->temperature;
    out->top_p = s->top_p == 0.0f ? 1.0f : s->top_p;
    if (s->top_k > (uint32_t)INT32_MAX) {
        snprintf(err, KR_ERR_MAX, "sampling.top_k %u is out of range", s->top_k);
        return -1;
    }
    out->top_k = (int)s->top_k;
    if (s->seed_choice_case == KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED) {
        out->seed = s->seed;
    } else if (getrandom(&out->seed, sizeof out->seed, 0) != (ssize_t)sizeof out->seed) {
        out->seed = (uint64_t)dn_unix_ms();
    }
    return kr_sampling_check(out, err);
}

/* The penalties of Sampling and what they count (penalty_prompt, penalty_output): *out NULL
 * when none is on. Forcing samples nothing, so it needs none. */
static int penalties_from(const Kvrelay__V1__DecodeRequest *req, int vocab, kr_penalty_state **out,
                          char *err)
{
    *out = NULL;
    kr_penalties p;
    if (kc_penalties_from_pb(req->sampling, &p, err) != 0) return -1;
    if (req->n_forced) return 0;
    return kc_penalty_state_make(&p, vocab, req->penalty_prompt, req->n_penalty_prompt, req->penalty_output,
                                 req->n_penalty_output, out, err);
}

/* Structured output: response_format compiled and its matcher fed the tokens of earlier
 * placements (penalty_output); the prefill node's first token joins it at admission. Returns
 * OK with *out (NULL: no constraint), or the refusal's code with err. */
static grpc_status_code grammar_from(const dn_node *n, const Kvrelay__V1__DecodeRequest *req,
                                     kr_grammar_seq **out, char *err)
{
    *out = NULL;
    if (!req->response_format || !*req->response_format)
        return GRPC_STATUS_OK;
    if (!n->gvocab) {
        snprintf(err, KR_ERR_MAX, "response_format: %.400s", n->gvocab_err);
        return GRPC_STATUS_FAILED_PRECONDITION;
    }
    if (req->n_forced) {
        snprintf(err, KR_ERR_MAX, "response_format: not with forced");
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    for (size_t i = 0; i < req->n_penalty_output; i++)
        if (req->penalty_output[i] >= (uint32_t)kr_grammar_vocab_n(n->gvocab)) {
            snprintf(err, KR_ERR_MAX, "penalty_output[%zu] = %u is outside the vocabulary", i,
                     req->penalty_output[i]);
            return GRPC_STATUS_INVALID_ARGUMENT;
        }
    char msg[KR_ERR_MAX];
    if (kr_grammar_seq_create(n->gvocab, req->response_format, strlen(req->response_format),
                              (const int32_t *)req->penalty_output, req->n_penalty_output, out,
                              msg) != 0) {
        snprintf(err, KR_ERR_MAX, "response_format: %.400s", msg);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    return GRPC_STATUS_OK;
}

/* A transfer that failed: which status tells the router the right thing. */
static grpc_status_code transfer_code(const char *msg)
{
    if (strstr(msg, " expired") || strstr(msg, " rejected") || strstr(msg, " released"))
        return GRPC_STATUS_FAILED_PRECONDITION; /* nothing to retry on this reservation */
    return GRPC_STATUS_UNAVAILABLE; /* the sender died or the connection broke */
}

/* Waits until reservation `id` has its bundle and claims it (state DECODING, so nobody else
 * frees it). Returns OK with *out, or an error status set on the call. */
static int claim(kc_call *call, dn_node *n, uint64_t id, const char *rid, dn_resv **out)
{
    int waiting = 0, abandon = 0, code = GRPC_STATUS_OK;
    dn_resv *dead = NULL;
    pthread_mutex_lock(&n->lock);
    for (;;) {
        dn_resv *r = dn_resv_find_locked(n, id);
        if (n->stopping) {
            code = refuse(call, rid, GRPC_STATUS_UNAVAILABLE, "decode node %s is shutting down",
                                 n->cfg.id);
            break;
        }
        if (!r) {
            code = refuse(call, rid, GRPC_STATUS_NOT_FOUND,
                                 "reservation_id %" PRIu64 " is not reserved here (never made, "
                                 "released, expired, or already decoded)", id);
            break;
        }
        if (r->state == DN_RESV_READY) {
            if (dn_resv_move(r, DN_RESV_DECODING) != 0) {
                code = refuse(call, rid, GRPC_STATUS_INTERNAL, "reservation_id %" PRIu64
                              " cannot be claimed", id);
                break;
            }
            *out = r;
            break;
        }
        if (r->state == DN_RESV_DECODING) {
            code = refuse(call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                                 "reservation_id %" PRIu64 " is already being decoded", id);
            break;
        }
        if (r->state == DN_RESV_FAILED) {
            code = refuse(call, rid, transfer_code(r->err), "reservation_id %" PRIu64
                                 ": no KV bundle to decode: %s", id, r->err);
            dn_resv_unlink_locked(n, r); /* reported: the tombstone has served */
            dead = r;
            break;
        }
        /* WAITING: the bundle is on its way (or the prefill node has not sent it yet). */
        if (kc_call_cancelled(call)) {
            /* The stream that was to decode it is gone (client cancel or deadline): nobody will
             * decode this reservation, so its blocks go back now rather than at expiry. */
            code = kc_call_ms_left(call) <= 0 ? GRPC_STATUS_DEADLINE_EXCEEDED
                                              : GRPC_STATUS_CANCELLED;
            abandon = 1;
            break;
        }
        if (!waiting) {
            waiting = 1;
            n->n_waiting++;
            dn_publish_locked(n);
        }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += WAIT_SLICE_MS * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&n->cond, &n->lock, &until);
    }
    if (waiting) {
        n->n_waiting--;
        dn_publish_locked(n);
    }
    pthread_mutex_unlock(&n->lock);
    dn_resv_end(n, dead);
    if (abandon) {
        kc_info(rid, "Decode call ended (%s) while waiting for the bundle of reservation %" PRIu64,
                kc_status_name((grpc_status_code)code), id);
        dn_resv_release(n, id, rid);
    }
    return code;
}

/* The whole bundle against this model and against what the reservation promised (each part's
 * model and policy were checked as it arrived, import.c): a bundle whose lists could hold more
 * blocks than the reservation's bound could take blocks promised to others. Two checks: no list brings more entries than the bound assumed, and the lists' decode
 * rules, as the bundle carries them, keep the whole sequence within r->blocks over the
 * reservation's max_tokens - 1 decode steps (kr_list_rule_blocks_bound summed over the lists).
 * The rules themselves are not compared with the policy's (for hsft and sage they depend on the
 * sender's sequence): a rule that trims less than the policy's passes while its peak fits. */
static int check_bundle(kc_call *call, dn_node *n, dn_resv *r, dn_job *job, const char *rid)
{
    const kr_config *c = n->mcfg;
    char err[KT_ERR_MAX > KR_ERR_MAX ? KT_ERR_MAX : KR_ERR_MAX];
    /* validated by the transport as the bytes arrived (kt_transport_reserve); the model
     * and the policy were checked part by part as the bundle arrived (import.c) */
    const kt_bundle_set *v = &r->set;
    const kt_bundle_header *h = &v->hdr;
    if (h->prompt_len > r->prompt_tokens)
        return refuse(call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                             "the KV bundle's prompt_len %d exceeds the reservation's "
                             "prompt_tokens %d", h->prompt_len, r->prompt_tokens);
    if (h->first_token >= c->vocab_size)
        return refuse(call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                             "the KV bundle's first_token %d is outside the vocabulary [0, %d)",
                             h->first_token, c->vocab_size);
    if (h->next_pos >= c->max_position_embeddings)
        return refuse(call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                             "the KV bundle's next_pos %d is at the model's context limit %d",
                             h->next_pos, c->max_position_embeddings);
    const int n_generate = r->max_tokens - 1; /* tokens fed after the bundle, as reserved */
    int64_t need = 0, worst = -1;
    int worst_l = 0, worst_h = 0;
    kt_bundle_list worst_lv;
    memset(&worst_lv, 0, sizeof worst_lv);
    for (int l = 0; l < c->n_layers; l++) {
        for (int hd = 0; hd < c->n_kv_heads; hd++) {
            kt_bundle_list lv;
            if (kt_bundle_set_list(v, (uint32_t)l, (uint32_t)hd, &lv, err) != 0)
                return refuse(call, rid, GRPC_STATUS_INTERNAL, "%s", err);
            if (lv.count > (uint32_t)r->max_list_entries)
                return refuse(call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                                     "the KV bundle's list (layer %d, head %d) has %u entries; "
                                     "the reservation allows at most %d", l, hd, lv.count,
                                     r->max_list_entries);
            const kr_list_rule rule = kt_bundle_list_rule(&lv);
            int64_t b = kr_list_rule_blocks_bound(n->pool, &rule, (int)lv.count, (int)lv.pinned,
                                                  n_generate);
            if (b < 0)
                return refuse(call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                              "the KV bundle's list (layer %d, head %d) has a decode rule out of "
                              "range (sink %u, window %u, lazy %u, slack %u, max_drop %u; %u "
                              "entries, %u pinned)", l, hd, lv.sink, lv.window, lv.lazy, lv.slack,
                              lv.max_drop, lv.count, lv.pinned);
            need += b;
            if (b > worst) {
                worst = b;
                worst_l = l;
                worst_h = hd;
                worst_lv = lv;
            }
        }
    }
    if (need > r->blocks) {
        char window[16] = "dense";
        if (worst_lv.window != KT_BUNDLE_WINDOW_DENSE)
            snprintf(window, sizeof window, "%u", worst_lv.window);
        return refuse(call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                      "the KV bundle's decode rules could need %" PRId64 " KV blocks over %d "
                      "decode steps, more than the reservation's %" PRId64 "; the largest, list "
                      "(layer %d, head %d) with %u entries (%u pinned) under sink %u, window %s, "
                      "lazy %u, slack %u, max_drop %u, alone could need %" PRId64, need,
                      n_generate, r->blocks, worst_l, worst_h, worst_lv.count, worst_lv.pinned,
                      worst_lv.sink, window, worst_lv.lazy, worst_lv.slack, worst_lv.max_drop,
                      worst);
    }
    /* all the loop needs of the bundle once the parts are freed at its admission */
    job->first_token = h->first_token;
    job->next_pos = h->next_pos;
    return GRPC_STATUS_OK;
}

/* Everything up to the hand-over. Returns KC_DETACHED once the loop owns the call. */
static int decode(kc_call *call, const Kvrelay__V1__DecodeRequest *req, dn_node *n,
                  const char *rid)
{
    const kr_config *c = n->mcfg;
    char err[KR_ERR_MAX];
    if (req->reservation_id == 0)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                             "reservation_id is 0 (Reserve never answers 0)");
    if (req->max_tokens == 0)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                             "max_tokens is 0: it counts the first token, so at least 1");
    kr_sampling sampling;
    if (sampling_from(req->sampling, &sampling, err) != 0)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT, "%s", err);
    if (req->n_stop_ids > DN_MAX_STOP_IDS)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT, "%zu stop_ids, at most %d",
                             req->n_stop_ids, DN_MAX_STOP_IDS);
    for (size_t i = 0; i < req->n_stop_ids; i++)
        if (req->stop_ids[i] >= (uint32_t)c->vocab_size)
            return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                                 "stop_ids[%zu] = %u is outside the vocabulary [0, %d)", i,
                                 req->stop_ids[i], c->vocab_size);
    /* forcing: the ids after the prefill node's first, one per decode step to the end */
    if (req->n_forced && req->n_forced != (size_t)req->max_tokens - 1)
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "forced: %zu ids, but max_tokens %u needs exactly %u after the first token",
                      req->n_forced, req->max_tokens, req->max_tokens - 1);
    for (size_t i = 0; i < req->n_forced; i++)
        if (req->forced[i] >= (uint32_t)c->vocab_size)
            return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                          "forced[%zu] = %u is outside the vocabulary [0, %d)", i,
                          req->forced[i], c->vocab_size);

    dn_job *job = calloc(1, sizeof *job);
    if (!job)
        return refuse(call, rid, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    snprintf(job->request_id, sizeof job->request_id, "%s", rid);
    job->call = call;
    job->max_tokens = (int)(req->max_tokens > (uint32_t)INT32_MAX ? INT32_MAX : req->max_tokens);
    if (req->n_stop_ids) {
        job->stop_ids = malloc(req->n_stop_ids * sizeof *job->stop_ids);
        if (!job->stop_ids) {
            dn_job_free(job);
            return refuse(call, rid, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        }
        for (size_t i = 0; i < req->n_stop_ids; i++)
            job->stop_ids[i] = (int32_t)req->stop_ids[i];
        job->n_stop = (int)req->n_stop_ids;
    }
    if (req->n_forced) {
        job->forced = malloc(req->n_forced * sizeof *job->forced);
        if (!job->forced) {
            dn_job_free(job);
            return refuse(call, rid, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
        }
        for (size_t i = 0; i < req->n_forced; i++)
            job->forced[i] = (int32_t)req->forced[i];
    }
    if (req->top_logprobs > KR_TOP_LOGPROBS_MAX) {
        dn_job_free(job);
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT, "top_logprobs: %u, at most %d", req->top_logprobs,
                      KR_TOP_LOGPROBS_MAX);
    }
    job->top_logprobs = (int)req->top_logprobs;
    job->logprobs = req->logprobs || req->n_forced > 0 || job->top_logprobs > 0;
    job->ignore_eos = req->ignore_eos;
    job->min_tokens = (int)(req->min_tokens > (uint32_t)INT32_MAX ? INT32_MAX : req->min_tokens);
    if (kr_sampler_create(&sampling, c->vocab_size, &job->sampler, err) != KR_OK ||
        penalties_from(req, c->vocab_size, &job->pen, err) != 0) {
        dn_job_free(job);
        return refuse(call, rid, GRPC_STATUS_INVALID_ARGUMENT, "%s", err);
    }
    grpc_status_code gcode = grammar_from(n, req, &job->gseq, err);
    if (gcode != GRPC_STATUS_OK) {
        dn_job_free(job);
        return refuse(call, rid, gcode, "%s", err);
    }
    /* The prefill node drew the first token from a sampler seeded the same way: skip that draw
     * so that seeded sampling continues exactly as one process would (one draw per
     * non-greedy sample, whatever the logits). */
    if (!sampling.greedy && sampling.temperature > 0.0f)
        kr_sampler_sample(job->sampler, n->zero_logits);

    dn_resv *r = NULL;
    int code = claim(call, n, req->reservation_id, rid, &r);
    if (code != GRPC_STATUS_OK) {
        dn_job_free(job);
        return code;
    }
    job->resv = r;
    job->budget_tokens = r->max_tokens;
    code = check_bundle(call, n, r, job, rid);
    if (code == GRPC_STATUS_OK) {
        code = dn_loop_submit(n, job);
        if (code == GRPC_STATUS_OK)
            return KC_DETACHED;
        code = refuse(call, rid, (grpc_status_code)code, "reservation %" PRIu64 " %s",
                      r->id, code == GRPC_STATUS_CANCELLED ? "was released"
                                                           : "not decoded: shutting down");
    }
    kc_info(rid, "reservation %" PRIu64 " dropped with its Decode call; %" PRId64
            " blocks returned", r->id, r->blocks);
    pthread_mutex_lock(&n->lock);
    dn_resv_unlink_locked(n, r);
    pthread_mutex_unlock(&n->lock);
    dn_resv_end(n, r);
    dn_job_free(job);
    return code;
}

static int on_decode(kc_call *call, const ProtobufCMessage *msg, void *user)
{
    dn_node *n = user;
    const Kvrelay__V1__DecodeRequest *req = (const void *)msg;
    char rid[DN_REQUEST_ID_MAX + 1];
    snprintf(rid, sizeof rid, "%s", req->request_id ? req->request_id : "");
    int code = decode(call, req, n, rid);
    if (code != KC_DETACHED)
        count(n->m.requests, code);
    return code;
}

/* ------------------------------------------------------------------ Release, Status */

static int on_release(kc_call *call, const ProtobufCMessage *msg, void *user)
{
    dn_node *n = user;
    const Kvrelay__V1__ReleaseRequest *req = (const void *)msg;
    char rid[DN_REQUEST_ID_MAX + 1];
    snprintf(rid, sizeof rid, "%s", req->request_id ? req->request_id : "");
    Kvrelay__V1__ReleaseResponse resp = KVRELAY__V1__RELEASE_RESPONSE__INIT;
    resp.released = req->reservation_id != 0 && dn_resv_release(n, req->reservation_id, rid);
    if (!resp.released)
        kc_debug(rid, "release of unknown reservation %" PRIu64, req->reservation_id);
    kc_call_send(call, &resp.base);
    return GRPC_STATUS_OK;
}

static int on_status(kc_call *call, const ProtobufCMessage *msg, void *user)
{
    dn_node *n = user;
    Kvrelay__V1__Node node = KVRELAY__V1__NODE__INIT;
    node.id = (char *)n->cfg.id;
    node.role = KVRELAY__V1__NODE_ROLE__NODE_ROLE_DECODE;
    node.grpc_address = n->grpc_addr;
    node.transfer_address = n->transfer_addr;
    node.model_fingerprint = n->fingerprint;
    pthread_mutex_lock(&n->lock);
    node.state = n->stopping || n->draining ? KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING
                             : KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING;
    node.running_requests = (uint32_t)n->n_running;
    node.queued_requests = (uint32_t)(n->n_pending + n->n_waiting);
    node.total_kv_blocks = (uint64_t)n->total_blocks;
    node.free_kv_blocks = (uint64_t)(n->total_blocks - n->reserved_sum);
    int64_t reserved = n->reserved_sum - dn_used_blocks(n);
    node.reserved_kv_blocks = (uint64_t)(reserved > 0 ? reserved : 0);
    node.since_unix_ms = n->since_unix_ms;
    pthread_mutex_unlock(&n->lock);
    kc_call_send(call, &node.base);
    (void)msg;
    return GRPC_STATUS_OK;
}

int dn_service_register(dn_node *n, char *err)
{
    if (kc_server_add_unary(n->server, PATH_RESERVE, &kvrelay__v1__reserve_request__descriptor,
                            on_reserve, n) != 0 ||
        kc_server_add_stream(n->server, PATH_DECODE, &kvrelay__v1__decode_request__descriptor,
                             on_decode, n) != 0 ||
        kc_server_add_unary(n->server, PATH_RELEASE, &kvrelay__v1__release_request__descriptor,
                            on_release, n) != 0 ||
        kc_server_add_unary(n->server, PATH_STATUS,
                            &kvrelay__v1__node_status_request__descriptor, on_status, n) != 0) {
        snprintf(err, 256, "cannot register the kvrelay.v1.Decode methods");
        return -1;
    }
    static const char *const services[] = {"kvrelay.v1.Decode", NULL};
    n->health = kc_health_register(n->server, services);
    if (!n->health) {
        snprintf(err, 256, "cannot register grpc.health.v1.Health");
        return -1;
    }
    return 0;
}
