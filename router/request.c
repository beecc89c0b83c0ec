/*
 * request.c - Generation.Generate and Generation.Tokenize (the flow of docs/router.md): one
 * request's state machine. validate (validate.c); place it: reserve room on a decode node and
 * prefill on a prefill node with the reservation's transfer address, in the admission FIFO while
 * there is no room (admission.c); relay the prefill's first token; relay the decode node's
 * stream as text deltas with stop strings matched on the text (relay.c); end with
 * Finish{reason, usage}. With --migrate a decode stream that fails continues on another decode
 * node by prefilling the prompt and every token sent so far.
 * Scoring requests (`forced`) pass their ids on instead of sampling: the first to the prefill
 * node, the rest to the decode node, and log-probabilities come back with every token
 * (docs/rpc.md); they ignore sampling and stops and always run to their last forced id.
 * Every hop gets the time left before the request's deadline. A client that goes away has its
 * decode stream cancelled by the watcher thread (watch.c) and its reservation Released.
 * Not the OpenAI API (openai.c, which runs requests through rt_generate_run with its own sink).
 * Tested by test_router_cluster and the cluster tests (ctest -R 'router|openai|cluster|failures').
 */
#include "request.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

double rt_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int64_t rt_req_ms_left(const rt_req *r)
{
    return r->deadline_ms - rt_now_ms();
}

int64_t rt_req_hop_timeout(const rt_req *r)
{
    int64_t left = rt_req_ms_left(r);
    return left > 0 ? left : 1;
}

void rt_req_phase(rt_req *r, rt_phase to)
{
    static const char *const names[] = {"arrived", "admitted", "queued", "placing", "prefilling",
                                        "decoding", "decode-failed", "done", "failed"};
    kc_debug(r->id[0] ? r->id : NULL, "phase %s -> %s", names[r->phase], names[to]);
    r->phase = to;
}

void rt_req_client_gone(const rt_req *r, kc_status *st, const char *when)
{
    if (r->sink->ms_left(r->sink->ctx) <= 0)
        kc_status_set(st, GRPC_STATUS_DEADLINE_EXCEEDED, "the client's deadline passed %s", when);
    else
        kc_status_set(st, GRPC_STATUS_CANCELLED, "the client went away %s", when);
}

static void send_finish(rt_req *r)
{
    rt_router *rt = r->rt;
    Kvrelay__V1__ServedBy by = KVRELAY__V1__SERVED_BY__INIT;
    by.prefill_node = r->pnode->id;
    by.decode_node = r->dnode ? r->dnode->id : ""; /* none for a scored-only request */
    Kvrelay__V1__Usage u = KVRELAY__V1__USAGE__INIT;
    u.prompt_tokens = (uint32_t)r->n_prompt;
    u.completion_tokens = r->completion;
    u.ttft_s = r->t_first - r->t_arrival;
    u.tpot_s = r->completion > 1 ? (r->t_last - r->t_first) / (double)(r->completion - 1) : 0.0;
    double attended = r->pu.footprint_attended, full = r->pu.footprint_full;
    uint64_t peak = r->pu.peak_kv_entries;
    if (r->have_decode_finish) {
        attended += r->df.footprint_attended;
        full += r->df.footprint_full;
        if (r->df.peak_kv_entries > peak) peak = r->df.peak_kv_entries;
    }
    u.kv_footprint = full > 0 ? attended / full : 0.0;
    u.peak_kv_entries = peak;
    u.kv_bytes_shipped = r->pu.kv_bytes_shipped;
    u.kv_entries_shipped = r->pu.kv_entries_shipped;
    u.kv_wire_dtype = r->wire_shipped;
    u.queue_s = r->queue_s;
    /* over a migration's prefills the reused tokens add up; the prompt's own cannot exceed it */
    u.cached_tokens = r->pu.cached_tokens < u.prompt_tokens ? r->pu.cached_tokens : u.prompt_tokens;
    u.served_by = &by;
    if (r->chosen.on) { /* kv_policy auto: what was chosen, as docs/adaptive.md says */
        u.auto_policy = r->policy;
        u.auto_score = r->chosen.score;
        u.auto_pressure = (char *)rt_pressure_name(r->chosen.level);
        u.auto_reason = r->chosen.reason;
    }
    Kvrelay__V1__Finish fin = KVRELAY__V1__FINISH__INIT;
    fin.reason = r->reason;
    fin.usage = &u;
    fin.request_id = r->id;
    Kvrelay__V1__GenerateResponse msg = KVRELAY__V1__GENERATE_RESPONSE__INIT;
    msg.event_case = KVRELAY__V1__GENERATE_RESPONSE__EVENT_FINISH;
    msg.finish = &fin;
    r->sink->send(r->sink->ctx, &msg);
    if (r->completion > 1) kc_histogram_observe(rt->m.tpot[r->family], u.tpot_s);
    kc_histogram_observe(rt->m.e2e[r->family], r->t_last - r->t_arrival);
    kc_histogram_observe(rt->m.queue_wait[r->family], r->queue_s);
    kc_counter_inc(rt->m.generated_tokens, r->completion);
    static const char *reasons[] = {"unspecified", "length", "stop", "eos", "context"};
    kc_info(r->id, "finished: %s, %u prompt (%u cached) + %u completion tokens, ttft %.4f s (queued %.4f s), "
            "tpot %.4f s, kv footprint %.3f, %" PRIu64 " bytes shipped, %s -> %s, %d migrations",
            (unsigned)r->reason < 5 ? reasons[r->reason] : "?", u.prompt_tokens, u.cached_tokens, u.completion_tokens,
            u.ttft_s, u.queue_s, u.tpot_s, u.kv_footprint, u.kv_bytes_shipped, r->pnode->id, by.decode_node, r->migrations);
}

/* The prefill's answer holds what the request asked for: the prompt's scores (one per prompt
 * token after the first, and their alternatives) and the first token's alternatives. */
static grpc_status_code check_scores(const rt_req *r, const Kvrelay__V1__PrefillResponse *pr, kc_status *st)
{
    size_t rows = r->n_pf > 0 ? (size_t)r->n_pf - 1 : 0;
    int want_prompt = r->prompt_logprobs && r->migrations == 0;
    if (want_prompt && (pr->n_prompt_logprobs != rows ||
                        (r->top_logprobs &&
                         !rt_alts_fit(pr->prompt_top_logprobs, pr->n_prompt_top_logprobs, rows, r->top_logprobs))))
        return kc_status_set(st, GRPC_STATUS_INTERNAL,
                             "prefill node %s sent %zu prompt logprobs and %zu lists of alternatives for %zu prompt "
                             "rows (a node without prompt scoring?)",
                             r->pnode->id, pr->n_prompt_logprobs, pr->n_prompt_top_logprobs, rows), st->code;
    if (!r->score_only && r->top_logprobs && !rt_alts_fit(&pr->first_top_logprobs, pr->first_top_logprobs ? 1 : 0, 1,
                                                          r->top_logprobs))
        return kc_status_set(st, GRPC_STATUS_INTERNAL,
                             "prefill node %s sent no %u alternatives of the first token (a node without them?)",
                             r->pnode->id, r->top_logprobs), st->code;
    return GRPC_STATUS_OK;
}

/* Places r->pf (reserve + prefill) and relays the prefill's first token. Returns OK with *done
 * set when generation is over already (EOS, a stop id or string, the last token allowed). */
static grpc_status_code start(rt_req *r, int *done, kc_status *st)
{
    rt_router *rt = r->rt;
    Kvrelay__V1__PrefillResponse *pr = NULL;
    grpc_status_code code = rt_place(r, &pr, st);
    if (code != GRPC_STATUS_OK) return code;
    const Kvrelay__V1__PrefillUsage *u = pr->usage;
    if (u) { /* summed over a migration's prefills */
        r->pu.footprint_attended += u->footprint_attended;
        r->pu.footprint_full += u->footprint_full;
        if (u->peak_kv_entries > r->pu.peak_kv_entries) r->pu.peak_kv_entries = u->peak_kv_entries;
        r->pu.kv_bytes_shipped += u->kv_bytes_shipped;
        r->pu.kv_entries_shipped += u->kv_entries_shipped;
        r->pu.transfer_s = u->transfer_s;
        snprintf(r->wire_shipped, sizeof r->wire_shipped, "%s", u->kv_wire_dtype ? u->kv_wire_dtype : "");
        kc_counter_inc(rt->m.kv_bytes_shipped, (double)u->kv_bytes_shipped); /* shipped, whatever follows */
    }
    uint32_t first = pr->first_token, first_top = pr->first_top_id;
    float first_lp = pr->first_logprob;
    if (check_scores(r, pr, st) != GRPC_STATUS_OK) {
        kc_message_free(&pr->base);
        rt_reservation_end(r, 1);
        return st->code;
    }
    r->scores = r->prompt_logprobs && r->migrations == 0 ? pr : NULL; /* the first delta carries them */
    int k = -2; /* -2: refused before anything was sent (the reservation ended) */
    if (r->score_only) { /* the scores are the answer: no token, nothing was shipped */
        kc_info(r->id, "scored %d prompt tokens on %s", r->n_pf, r->pnode->id);
        k = rt_relay(r, NULL, NULL, NULL, NULL, 0, st);
    } else {
        kc_info(r->id, "prefilled %d tokens on %s: first token %u, %" PRIu64 " KV entries shipped to %s in %.4f s",
                r->n_pf, r->pnode->id, first, r->pu.kv_entries_shipped, r->dnode->id, r->pu.transfer_s);
        if (first >= (uint32_t)rt->cfg.vocab_size) {
            rt_reservation_end(r, 1);
            kc_status_set(st, GRPC_STATUS_INTERNAL, "prefill node %s sent first token %u, outside the vocabulary",
                          r->pnode->id, first);
        } else if (r->forced && first != r->forced[r->completion]) {
            rt_reservation_end(r, 1);
            kc_status_set(st, GRPC_STATUS_INTERNAL,
                          "prefill node %s sent first token %u, not the forced %u (a node without forcing?)",
                          r->pnode->id, first, r->forced[r->completion]);
        } else {
            k = rt_relay(r, &first, &first_lp, &first_top, &pr->first_top_logprobs, 1, st);
        }
    }
    r->scores = NULL;
    kc_message_free(&pr->base);
    if (k == -2) return st->code;
    if (r->t_first == 0) { /* the first token goes out now: TTFT ends here */
        r->t_first = r->t_last;
        kc_histogram_observe(rt->m.ttft[r->family], r->t_first - r->t_arrival);
    }
    if (k < 0) {
        rt_reservation_end(r, 1);
        return st->code;
    }
    if (r->score_only) {
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        r->stopped = 1;
        *done = 1;
        return GRPC_STATUS_OK;
    }
    *done = k == 1;
    /* forcing scores past EOS; EOS and stop ids end nothing before min_tokens (r->completion
     * counts this token now) */
    int may_stop = !r->forced && r->completion > r->min_tokens;
    if (!*done && may_stop && !r->ignore_eos && (int32_t)first == rt->cfg.eos_token_id) {
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS;
        *done = 1;
    } else if (!*done && may_stop && rt_is_stop_id(r, first)) {
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP;
        *done = 1;
    } else if (!*done && r->left_tokens == 1) {
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        *done = 1;
    }
    if (*done) {
        r->stopped = 1;
        rt_reservation_end(r, 1); /* the bundle was shipped to the reservation: free it */
    }
    return GRPC_STATUS_OK;
}

/* --migrate: the decode stream failed; continue on another decode node by prefilling the prompt
 * and every token sent so far (docs/failures.md). Returns 0 when the request can go on. */
static int migrate(rt_req *r, kc_status *st)
{
    if (r->completion >= r->max_tokens || rt_req_ms_left(r) <= 0 || r->sink->cancelled(r->sink->ctx)) return -1;
    size_t n = (size_t)r->n_prompt + r->n_sent;
    if (n > (size_t)r->rt->cfg.max_position_embeddings - 1) return -1;
    int32_t *pf = malloc(n * sizeof *pf);
    if (!pf) return -1;
    memcpy(pf, r->prompt, (size_t)r->n_prompt * sizeof *pf);
    for (size_t i = 0; i < r->n_sent; i++) pf[(size_t)r->n_prompt + i] = (int32_t)r->sent[i];
    if (r->pf != r->prompt) free(r->pf);
    r->pf = pf;
    r->n_pf = (int)n;
    r->left_tokens = r->max_tokens - r->completion;
    rt_skip_add(r->skip_d, &r->n_skip_d, r->dnode);
    r->have_decode_finish = 0;
    r->migrations++;
    kc_warn(r->id, "migrating: %s; re-prefilling %d tokens for the %u still to generate", st->details, r->n_pf,
            r->left_tokens);
    return 0;
}

/* Everything after validation. */
static grpc_status_code serve(rt_req *r, kc_status *st)
{
    r->pf = r->prompt;
    r->n_pf = r->n_prompt;
    r->left_tokens = r->max_tokens;
    for (;;) {
        int done = 0;
        grpc_status_code code = start(r, &done, st);
        if (code != GRPC_STATUS_OK) return code;
        if (done) break;
        code = rt_decode_stream(r, st);
        if (code == GRPC_STATUS_OK) break;
        if (r->phase != RT_PHASE_DECODE_FAILED || !r->rt->migrate || migrate(r, st) != 0) return code;
    }
    if (rt_relay_flush(r, st) != 0) return st->code;
    send_finish(r);
    return GRPC_STATUS_OK;
}

/* What validation and serving allocated in r, and r. */
static void req_free(rt_req *r)
{
    rt_stop_free(&r->stop);
    kr_detok_free(r->detok);
    if (r->pf != r->prompt) free(r->pf);
    free(r->prompt);
    free(r->sent);
    free(r);
}

grpc_status_code rt_generate_run(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, const rt_sink *sink,
                                 rt_client *client, kc_status *st)
{
    rt_req *r = calloc(1, sizeof *r);
    if (!r) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        kc_counter_inc(rt->m.requests[GRPC_STATUS_RESOURCE_EXHAUSTED], 1);
        return st->code;
    }
    r->rt = rt;
    r->sink = sink;
    r->t_arrival = rt_now_s();
    int64_t left = sink->ms_left(sink->ctx);
    r->deadline_ms = rt_now_ms() + (left < rt->default_timeout_ms ? left : rt->default_timeout_ms);
    atomic_fetch_add(&rt->in_flight, 1);
    kc_gauge_inc(rt->m.in_flight, 1);

    *st = (kc_status){GRPC_STATUS_OK, ""};
    /* the client's limits first: a refused request costs no tokenizing and no placement */
    grpc_status_code code = GRPC_STATUS_OK;
    if (client && rt_limits_acquire(rt->limits, client, rt_now_ms()) != RT_LIMIT_KIND_OK) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s", client->refusal);
        code = st->code;
    }
    if (code == GRPC_STATUS_OK) code = rt_req_validate(rt, q, r, st);
    if (code == GRPC_STATUS_OK) {
        rt_req_phase(r, RT_PHASE_ADMITTED);
        kc_counter_inc(rt->m.prompt_tokens, r->n_prompt);
        kc_info(r->id, "accepted: %d prompt tokens, max_tokens %u%s%s, kv_policy '%s', %zu stop strings, %zu stop ids",
                r->n_prompt, r->max_tokens, r->forced ? " (forced)" : "", r->logprobs ? ", logprobs" : "",
                r->policy[0] ? r->policy : "full", r->forced ? (size_t)0 : q->n_stop, r->n_stop_ids);
        code = serve(r, st);
    }
    rt_req_phase(r, code == GRPC_STATUS_OK ? RT_PHASE_DONE : RT_PHASE_FAILED);
    if (code != GRPC_STATUS_OK) {
        if (code == GRPC_STATUS_CANCELLED) kc_info(r->id[0] ? r->id : NULL, "CANCELLED: %s", st->details);
        else kc_warn(r->id[0] ? r->id : NULL, "%s: %s", kc_status_name(code), st->details);
    }
    kc_counter_inc(rt->m.requests[(unsigned)code <= GRPC_STATUS_UNAUTHENTICATED ? code : GRPC_STATUS_UNKNOWN], 1);
    if (client) rt_limits_release(rt->limits, client); /* every way out of the request passes here */
    kc_gauge_inc(rt->m.in_flight, -1);
    atomic_fetch_sub(&rt->in_flight, 1);
    req_free(r);
    return code;
}

grpc_status_code rt_generate_check(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, kc_status *st)
{
    *st = (kc_status){GRPC_STATUS_OK, ""};
    rt_req *r = calloc(1, sizeof *r);
    if (!r) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        return st->code;
    }
    r->rt = rt;
    grpc_status_code code = rt_req_validate(rt, q, r, st);
    req_free(r);
    return code;
}

/* The gRPC call as a sink. */
static int call_send(void *ctx, const Kvrelay__V1__GenerateResponse *msg)
{
    return kc_call_send(ctx, &msg->base);
}

static int call_cancelled(void *ctx)
{
    return kc_call_cancelled(ctx);
}

static int call_wait(void *ctx, int64_t ms)
{
    return kc_call_wait(ctx, ms);
}

static int64_t call_ms_left(void *ctx)
{
    return kc_call_ms_left(ctx);
}

int rt_generate(kc_call *call, const ProtobufCMessage *req, void *user)
{
    rt_router *rt = user;
    const rt_sink sink = {.ctx = call, .send = call_send, .cancelled = call_cancelled, .wait = call_wait,
                          .ms_left = call_ms_left};
    size_t alen = 0;
    const char *auth = rt->keys ? kc_call_metadata(call, "authorization", &alen) : NULL;
    char peer[RT_CLIENT_NAME_MAX];
    kc_call_peer(call, peer, sizeof peer);
    rt_client client;
    rt_client_init(&client, rt->keys, auth, alen, peer);
    kc_status st;
    grpc_status_code code = rt_generate_run(rt, (const void *)req, &sink, &client, &st);
    if (code == GRPC_STATUS_OK) return GRPC_STATUS_OK;
    return kc_call_error(call, code, "%s", st.details);
}

/* ------------------------------------------------------------------ Tokenize */

int rt_tokenize(kc_call *call, const ProtobufCMessage *req, void *user)
{
    rt_router *rt = user;
    const Kvrelay__V1__TokenizeRequest *q = (const void *)req;
    if (!rt->tok)
        return kc_call_error(call, GRPC_STATUS_FAILED_PRECONDITION,
                             "the router's model %s has no tokenizer.json: Tokenize needs one", rt->model_dir);
    int32_t *ids = NULL;
    int n = 0;
    char err[KR_ERR_MAX];
    if (kr_tokenizer_encode(rt->tok, q->text, strlen(q->text), q->add_special, &ids, &n, err) != KR_OK)
        return kc_call_error(call, GRPC_STATUS_INVALID_ARGUMENT, "text: %s", err);
    Kvrelay__V1__TokenizeResponse resp = KVRELAY__V1__TOKENIZE_RESPONSE__INIT;
    resp.n_ids = (size_t)n;
    resp.ids = (uint32_t *)ids; /* non-negative ids: the same bits */
    kc_call_send(call, &resp.base);
    free(ids);
    return GRPC_STATUS_OK;
}
