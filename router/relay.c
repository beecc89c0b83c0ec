/*
 * relay.c - the decode stream relayed to the client: Decode.Decode opened on the reserved node,
 * its token batches turned into text deltas (the detokenizer, stop strings matched on the text
 * by stop.c, log-probabilities when asked) and sent to the request's sink, its finish kept for
 * the request's own. A failed stream (UNAVAILABLE, DEADLINE_EXCEEDED, or silent for
 * --decode-stall-ms) moves the request to RT_PHASE_DECODE_FAILED so that request.c may migrate
 * it.
 * Not the Finish message (request.c) nor the watcher that cancels streams (watch.c).
 * Tested by test_router_cluster (stop strings, logprobs, cancellation), tests/integration/
 * cluster.sh, openai_api.sh and failures.sh (a decode node killed or frozen mid-stream).
 */
#include "request.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    RT_DEADLINE_SLACK_MS = 20, /* a hop's DEADLINE_EXCEEDED this close to the request's is the request's */
};

int rt_is_stop_id(const rt_req *r, uint32_t id)
{
    for (size_t i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == id) return 1;
    return 0;
}

int rt_alts_fit(Kvrelay__V1__TopLogprobs *const *alts, size_t n_alts, size_t n, uint32_t k)
{
    if (n_alts != n) return 0;
    for (size_t i = 0; i < n; i++)
        if (alts[i]->n_ids != k || alts[i]->n_logprobs != k) return 0;
    return 1;
}

/* Sets st for a send to the client that returned `sent` (not 0) `when`. */
static void send_failed(const rt_req *r, int sent, kc_status *st, const char *when)
{
    if (sent == RT_SINK_FAILED)
        kc_status_set(st, GRPC_STATUS_INTERNAL, "the router could not build the response %s: out of memory", when);
    else rt_req_client_gone(r, st, when);
}

/* Sends ids[0, n) to the client with the text they complete, cut at a stop string, and with
 * r->logprobs their lps[0, n) and tops[0, n). Returns 0, 1 when a stop string matched (later
 * ids are dropped; r->stopped set), -1 when the client is gone (st CANCELLED) or the
 * detokenizer or the sink failed (st INTERNAL). */
int rt_relay(rt_req *r, const uint32_t *ids, const float *lps, const uint32_t *tops,
             Kvrelay__V1__TopLogprobs *const *alts, size_t n, kc_status *st)
{
    char *text = NULL;
    size_t text_len = 0, kept = 0;
    int matched = 0;
    for (size_t i = 0; i < n && !matched; i++, kept++) {
        if (!r->detok) continue;
        const char *delta, *emit;
        size_t dlen, elen;
        char err[KR_ERR_MAX];
        if (kr_detok_push(r->detok, (int32_t)ids[i], &delta, &dlen, err) != KR_OK) {
            free(text);
            kc_status_set(st, GRPC_STATUS_INTERNAL, "detokenizing generated token %u: %s", ids[i], err);
            return -1;
        }
        /* stop strings end nothing before min_tokens: the text before then is never matched */
        int m = 0;
        if (r->completion + i + 1 < r->min_tokens) {
            emit = delta;
            elen = dlen;
        } else {
            m = rt_stop_push(&r->stop, delta, dlen, &emit, &elen);
        }
        if (m < 0) {
            free(text);
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
            return -1;
        }
        matched = m;
        if (elen) {
            char *grown = realloc(text, text_len + elen + 1);
            if (!grown) {
                free(text);
                kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
                return -1;
            }
            memcpy(grown + text_len, emit, elen);
            text = grown;
            text_len += elen;
        }
    }
    if (text) text[text_len] = 0;
    Kvrelay__V1__TokenDelta delta = KVRELAY__V1__TOKEN_DELTA__INIT;
    delta.n_ids = kept;
    delta.ids = (uint32_t *)ids;
    delta.text = text ? text : "";
    if (r->logprobs) {
        delta.n_logprobs = delta.n_top_ids = kept;
        delta.logprobs = (float *)lps;
        delta.top_ids = (uint32_t *)tops;
        if (r->top_logprobs) {
            delta.n_top_logprobs = kept;
            delta.top_logprobs = (Kvrelay__V1__TopLogprobs **)alts;
        }
    }
    if (r->scores) { /* the prompt's scores go with the first delta */
        delta.n_prompt_logprobs = r->scores->n_prompt_logprobs;
        delta.prompt_logprobs = r->scores->prompt_logprobs;
        delta.n_prompt_top_logprobs = r->scores->n_prompt_top_logprobs;
        delta.prompt_top_logprobs = r->scores->prompt_top_logprobs;
    }
    Kvrelay__V1__GenerateResponse msg = KVRELAY__V1__GENERATE_RESPONSE__INIT;
    msg.event_case = KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA;
    msg.delta = &delta;
    int sent = r->sink->send(r->sink->ctx, &msg);
    free(text);
    r->scores = NULL; /* sent once */
    r->completion += (uint32_t)kept;
    if (r->n_sent + kept > r->cap_sent) { /* kept for a migration's re-prefill */
        size_t cap = (r->n_sent + kept) * 2 + 16;
        uint32_t *grown = realloc(r->sent, cap * sizeof *grown);
        if (!grown) {
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
            return -1;
        }
        r->sent = grown;
        r->cap_sent = cap;
    }
    if (kept) memcpy(r->sent + r->n_sent, ids, kept * sizeof *ids); /* none in a scored-only delta */
    r->n_sent += kept;
    r->t_last = rt_now_s();
    if (sent != 0) {
        send_failed(r, sent, st, "while tokens were streamed");
        return -1;
    }
    if (matched) {
        r->stopped = 1;
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP;
        return 1;
    }
    return 0;
}

/* The text held back at the end (an incomplete character, a possible stop-string prefix). */
int rt_relay_flush(rt_req *r, kc_status *st)
{
    if (!r->detok || r->stopped) return 0;
    const char *delta, *emit, *held;
    size_t dlen, elen, hlen;
    kr_detok_flush(r->detok, &delta, &dlen);
    int m = rt_stop_push(&r->stop, delta, dlen, &emit, &elen);
    if (m < 0) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        return -1;
    }
    char *text = malloc(elen + 1 + (m ? 0 : r->stop.len));
    if (!text) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        return -1;
    }
    memcpy(text, emit, elen);
    size_t len = elen;
    if (m) {
        r->stopped = 1;
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP;
    } else {
        rt_stop_flush(&r->stop, &held, &hlen);
        memcpy(text + len, held, hlen);
        len += hlen;
    }
    text[len] = 0;
    int rc = 0;
    if (len) {
        Kvrelay__V1__TokenDelta d = KVRELAY__V1__TOKEN_DELTA__INIT;
        d.text = text;
        Kvrelay__V1__GenerateResponse msg = KVRELAY__V1__GENERATE_RESPONSE__INIT;
        msg.event_case = KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA;
        msg.delta = &d;
        int sent = r->sink->send(r->sink->ctx, &msg);
        if (sent != 0) {
            send_failed(r, sent, st, "before the last text");
            rc = -1;
        }
    }
    free(text);
    return rc;
}

/* Sets st for a decode stream that ended with the error s_st: the client went away, the
 * request's deadline passed, or the node failed (RT_PHASE_DECODE_FAILED, its breaker told). */
static void stream_failed(rt_req *r, const rt_active *active, const kc_status *s_st, kc_status *st)
{
    if (r->sink->cancelled(r->sink->ctx)) {
        rt_req_client_gone(r, st, "while tokens were streamed");
    } else if (s_st->code == GRPC_STATUS_DEADLINE_EXCEEDED && rt_req_ms_left(r) <= RT_DEADLINE_SLACK_MS) {
        /* the stream's deadline is the request's (--default-timeout-ms when the client set
         * none): the request ran out of time, the node did not fail */
        kc_status_set(st, GRPC_STATUS_DEADLINE_EXCEEDED, "the request's deadline passed after %u tokens were sent",
                      r->completion);
    } else if (atomic_load(&active->stalled) || s_st->code == GRPC_STATUS_UNAVAILABLE ||
               s_st->code == GRPC_STATUS_DEADLINE_EXCEEDED) {
        char cause[300];
        if (atomic_load(&active->stalled))
            snprintf(cause, sizeof cause, "no message for %" PRId64 " ms (--decode-stall-ms)", r->rt->decode_stall_ms);
        else snprintf(cause, sizeof cause, "%s: %s", kc_status_name(s_st->code), s_st->details);
        kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "decode node %s failed after %u tokens were sent: %s", r->dnode->id,
                      r->completion, cause);
        rt_node_outcome(r->rt, r->dnode, atomic_load(&active->stalled) ? GRPC_STATUS_DEADLINE_EXCEEDED : s_st->code, cause);
        rt_req_phase(r, RT_PHASE_DECODE_FAILED);
    } else {
        kc_status_set(st, s_st->code, "decode node %s: %s", r->dnode->id, s_st->details);
    }
}

/* Opens the decode stream and relays it until its finish, a stop string or an error. */
grpc_status_code rt_decode_stream(rt_req *r, kc_status *st)
{
    Kvrelay__V1__DecodeRequest req = KVRELAY__V1__DECODE_REQUEST__INIT;
    req.reservation_id = r->reservation;
    req.request_id = r->id;
    req.max_tokens = r->left_tokens;
    req.sampling = &r->sampling;
    req.n_stop_ids = r->n_stop_ids;
    req.stop_ids = (uint32_t *)r->stop_ids;
    if (r->forced) { /* the rest after the prefill's first token (start() relayed it) */
        req.n_forced = r->max_tokens - r->completion;
        req.forced = (uint32_t *)r->forced + r->completion;
    }
    req.logprobs = r->logprobs;
    req.top_logprobs = r->top_logprobs;
    req.ignore_eos = r->ignore_eos;
    uint32_t before = r->max_tokens - r->left_tokens; /* generated before this placement */
    req.min_tokens = r->min_tokens > before ? r->min_tokens - before : 0;
    const Kvrelay__V1__Sampling *sg = &r->sampling;
    if (r->response_format) { /* the matcher replays the tokens of earlier placements */
        req.response_format = (char *)r->response_format;
        req.n_penalty_output = before;
        req.penalty_output = r->sent;
    }
    if (sg->presence_penalty != 0.0f || sg->frequency_penalty != 0.0f ||
        (sg->repetition_penalty != 0.0f && sg->repetition_penalty != 1.0f)) {
        /* what the penalties count: the prompt for repetition, the tokens of earlier placements
         * as output (the decode node adds the prefill's first token and its own) */
        if (sg->repetition_penalty != 0.0f && sg->repetition_penalty != 1.0f) {
            req.n_penalty_prompt = (size_t)r->n_prompt;
            req.penalty_prompt = (uint32_t *)r->prompt; /* ids in the vocabulary: the same bits */
        }
        req.n_penalty_output = before;
        req.penalty_output = r->sent;
    }
    kc_stream *s;
    kc_status s_st;
    if (kc_stream_open(rt_node_channel(r->rt, r->dnode), "/kvrelay.v1.Decode/Decode", &req.base, rt_req_hop_timeout(r), &s,
                       &s_st) != 0) {
        kc_status_set(st, s_st.code, "decode node %s: %s", r->dnode->id, s_st.details);
        rt_reservation_end(r, 1);
        return st->code;
    }
    rt_req_phase(r, RT_PHASE_DECODING);
    rt_active active = {.sink = r->sink, .stream = s};
    atomic_init(&active.last_ms, rt_now_ms());
    atomic_init(&active.stalled, 0);
    rt_active_add(r->rt, &active);
    grpc_status_code code = GRPC_STATUS_OK;
    for (;;) {
        Kvrelay__V1__DecodeResponse *m = NULL;
        int rc = kc_stream_next(s, &kvrelay__v1__decode_response__descriptor, (ProtobufCMessage **)&m, &s_st);
        if (rc == 0) {
            if (!r->have_decode_finish) {
                kc_status_set(st, GRPC_STATUS_INTERNAL, "decode node %s ended the stream without a finish", r->dnode->id);
                code = st->code;
            }
            break;
        }
        if (rc < 0) {
            stream_failed(r, &active, &s_st, st);
            code = st->code;
            break;
        }
        atomic_store(&active.last_ms, rt_now_ms());
        if (m->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS && !r->have_decode_finish) {
            const Kvrelay__V1__DecodeTokens *t = m->tokens;
            if (r->logprobs && (t->n_logprobs != t->n_ids || t->n_top_ids != t->n_ids ||
                                (r->top_logprobs && !rt_alts_fit(t->top_logprobs, t->n_top_logprobs, t->n_ids,
                                                                 r->top_logprobs)))) {
                kc_stream_cancel(s);
                kc_status_set(st, GRPC_STATUS_INTERNAL,
                              "decode node %s sent %zu logprobs, %zu top_ids and %zu top_logprobs (of %u each) for %zu ids",
                              r->dnode->id, t->n_logprobs, t->n_top_ids, t->n_top_logprobs, r->top_logprobs, t->n_ids);
                code = st->code;
                kc_message_free(&m->base);
                break;
            }
            int k = rt_relay(r, t->ids, t->logprobs, t->top_ids, t->top_logprobs, t->n_ids, st);
            if (k != 0) {
                kc_stream_cancel(s); /* a stop string, or the client is gone: the node frees the slot */
                code = k < 0 ? st->code : GRPC_STATUS_OK;
                kc_message_free(&m->base);
                break;
            }
        } else if (m->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_FINISH) {
            r->have_decode_finish = 1;
            r->df = *m->finish;
            r->reason = m->finish->reason;
        }
        kc_message_free(&m->base);
    }
    rt_active_remove(r->rt, &active);
    kc_stream_close(s);
    /* a stream that ended with its finish has freed the reservation on the node; otherwise
     * Release it (idempotent) so the blocks come back even if the cancel did not arrive. Not on
     * a failed node: it is dead (the Release would fail) or frozen (it would wait), and the
     * cancelled stream frees the sequence when it wakes up. */
    rt_reservation_end(r, r->phase != RT_PHASE_DECODE_FAILED &&
                              !(code == GRPC_STATUS_OK && r->have_decode_finish && !r->stopped));
    return code;
}
