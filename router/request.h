/*
 * request.h - one Generate request inside the router, and the steps that serve it (not a
 * library: only the router's own files include it). Who does what:
 *   request.c    rt_generate_run, the request's state machine: validate, place, relay the first
 *                token, relay the decode stream, migrate on a failed stream, finish; the gRPC sink;
 *                Tokenize
 *   validate.c   a GenerateRequest checked and tokenized into an rt_req
 *   admission.c  the admission FIFO and the placement loop around Reserve + Prefill
 *   reserve.c    Reserve and Release on a decode node
 *   prefill.c    Prefill on a prefill node (with the one retry of docs/failures.md)
 *   relay.c      the decode stream relayed to the client: text deltas, stop strings, the finish
 *   watch.c      the cancel watcher: open decode streams of clients that went away or stalled
 * Every function here runs on the request's handler thread, except the watcher's.
 */
#ifndef RT_REQUEST_H
#define RT_REQUEST_H

#include "auto.h"
#include "router.h"
#include "stop.h"
#include "transport.h" /* KT_RMA_KEY_MAX */

enum {
    RT_WATCH_MS = 20, /* how often the watcher and a queued request look again */
};

/* A Generate call whose decode stream is open: what the watcher needs. */
struct rt_active {
    const rt_sink *sink;
    kc_stream *stream;
    _Atomic int64_t last_ms; /* rt_now_ms() of the stream's last message (or its opening) */
    atomic_int stalled; /* the watcher cancelled it: silent for --decode-stall-ms */
    rt_active *next;
};

/* Where a request is on its path (docs/router.md, "A request's phases"). Set only through
 * rt_req_phase, which logs each move at debug level with the request id. */
typedef enum rt_phase {
    RT_PHASE_ARRIVED = 0, /* not yet validated or within the client's limits */
    RT_PHASE_ADMITTED, /* validated and within the client's limits */
    RT_PHASE_QUEUED, /* in the admission FIFO: every candidate node was full */
    RT_PHASE_PLACING, /* Reserve on a decode node */
    RT_PHASE_PREFILLING, /* Prefill on a prefill node, which ships the KV bundle to the
                            reservation before it answers with the first token */
    RT_PHASE_DECODING, /* the decode stream is open; its tokens are relayed to the client */
    RT_PHASE_DECODE_FAILED, /* the decode node failed mid-stream; with --migrate the request is
                               placed again with the tokens sent so far */
    RT_PHASE_DONE, /* the finish was sent */
    RT_PHASE_FAILED, /* ended with an error status */
} rt_phase;

/* One Generate request, owned by its handler thread. */
typedef struct rt_req {
    rt_router *rt;
    const rt_sink *sink; /* the client */
    char id[RT_REQUEST_ID_MAX + 1];
    rt_phase phase;
    int32_t *prompt; /* n_prompt, malloc'd */
    int n_prompt;
    uint32_t max_tokens;
    Kvrelay__V1__Sampling sampling; /* as forwarded: the seed always present */
    char policy[1024]; /* the client's spec ("" = full), file keys resolved (rt_policy_resolve) */
    char wire[16]; /* the client's kv_wire_dtype ("" = the prefill node's --kv-dtype) */
    char wire_shipped[24]; /* the payload dtype the prefill node reports it shipped */
    uint64_t kv_entries_bound; /* informational, for Reserve */
    const uint32_t *stop_ids; /* borrowed; none when forcing */
    size_t n_stop_ids;
    const uint32_t *forced; /* borrowed: the ids to emit instead of sampling, max_tokens of them;
                               NULL: sample */
    int logprobs; /* relay logprobs and top_ids (always when forcing) */
    uint32_t top_logprobs; /* 0..KR_TOP_LOGPROBS_MAX alternatives relayed per token (with logprobs) */
    int prompt_logprobs; /* the first delta carries the prompt's scores (the prefill node's) */
    int score_only; /* max_tokens 0 with prompt_logprobs: a prefill that scores, no reservation, no decode */
    const Kvrelay__V1__PrefillResponse *scores; /* borrowed: the prefill's answer whose prompt scores
                                                   the next delta carries; NULL: none (sent or not asked) */
    int ignore_eos; /* EOS does not end the completion */
    uint32_t min_tokens; /* neither EOS, a stop id nor a stop string ends it before this many */
    const char *response_format; /* borrowed: the response_format object's JSON text when it
                                    constrains (json_object, json_schema); NULL: none */
    kr_detok *detok; /* NULL without a tokenizer */
    rt_stop stop;
    double t_arrival, t_first, t_last; /* seconds, monotonic */
    double queue_s; /* time spent in the admission FIFO */
    int family; /* the policy's family (kr_policy_family), for the metrics */
    rt_auto_said chosen; /* kv_policy auto: what the rule chose and why (policy holds the spec) */
    int64_t deadline_ms; /* rt_now_ms() clock */

    /* what is being placed: the prompt, or after a migration the prompt and the tokens sent */
    int32_t *pf; /* n_pf; == prompt, or malloc'd by a migration */
    int n_pf;
    uint32_t left_tokens; /* max_tokens still to generate, the first token of the prefill included */
    uint32_t *sent; /* n_sent ids sent to the client (migrations re-prefill them) */
    size_t n_sent, cap_sent;
    int migrations;

    /* placement */
    rt_node *pnode, *dnode;
    rt_node *skip_p[RT_NODES_MAX], *skip_d[RT_NODES_MAX]; /* failed in this request */
    int n_skip_p, n_skip_d;
    int prefill_failures; /* prefill node failures in this placement: one retry, docs/failures.md */
    int reserved; /* a reservation is held on dnode */
    uint64_t reservation;
    uint8_t reservation_token[16]; /* Reserve's, passed on to Prefill (the bundle must carry it) */
    size_t reservation_token_len;
    int64_t reserved_blocks;
    char transfer_address[256];
    uint64_t rma_address; /* Reserve's, passed on to Prefill: a decode node in RMA mode */
    uint8_t rma_key[KT_RMA_KEY_MAX];
    size_t rma_key_len; /* 0: the bundle is sent, not put */
    uint32_t kv_block_rows; /* Reserve's, passed on to Prefill: the decode node's block size */
    char kv_block_dtype[16]; /* Reserve's, passed on to Prefill: its blocks' dtype */
    kt_rma_rows rma_rows; /* Reserve's, passed on to Prefill: RMA mode's run of blocks (bytes 0:
                             none) */

    /* results */
    Kvrelay__V1__PrefillUsage pu; /* numbers only */
    int have_decode_finish;
    Kvrelay__V1__DecodeFinish df; /* numbers only */
    uint32_t completion;
    int stopped; /* the router itself stopped generation (stop string, or the first token) */
    Kvrelay__V1__FinishReason reason;
} rt_req;

/* What one placement attempt (Reserve, then Prefill) came to. */
typedef enum rt_attempt {
    RT_ATTEMPT_DONE, /* reserved / prefilled */
    RT_ATTEMPT_AGAIN, /* a node failed and was excluded: place again at once */
    RT_ATTEMPT_LATER, /* every candidate is full: back off, then place again */
    RT_ATTEMPT_FAIL, /* give the client st */
} rt_attempt;

/* ------------------------------------------------------------------ request.c */

/* Monotonic seconds. */
double rt_now_s(void);
/* Milliseconds before the request's deadline (negative once it passed). */
int64_t rt_req_ms_left(const rt_req *r);
/* The timeout of one hop: the time left before the request's deadline, at least 1 ms. */
int64_t rt_req_hop_timeout(const rt_req *r);
/* Moves r to phase `to`, logged at debug level. */
void rt_req_phase(rt_req *r, rt_phase to);
/* Sets st for a call that is over on the client's side: DEADLINE_EXCEEDED when its deadline
 * passed, CANCELLED when it went away; `when` says at which step. */
void rt_req_client_gone(const rt_req *r, kc_status *st, const char *when);

/* ------------------------------------------------------------------ validate.c */

/* Checks and tokenizes the request into r. Returns GRPC_STATUS_OK, or a code with st set
 * (the field at fault named first). */
grpc_status_code rt_req_validate(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, rt_req *r, kc_status *st);

/* ------------------------------------------------------------------ admission.c */

/* Reserve + prefill of r->pf, retried as docs/router.md and docs/failures.md say, in the
 * admission FIFO while there is no room, until done, the deadline or --max-queue-ms. On OK *out
 * is the prefill's answer (the caller frees it) and a reservation is held on r->dnode. */
grpc_status_code rt_place(rt_req *r, Kvrelay__V1__PrefillResponse **out, kc_status *st);

/* ------------------------------------------------------------------ reserve.c */

/* Reserves room for r->pf on the first decode node (placement order, not skipped) that has it. */
rt_attempt rt_reserve(rt_req *r, kc_status *st);
/* Frees the reservation: by Release when `call` (the stream did not end normally), and in the
 * router's own accounting always. Returns the Release's status code (OK when not called). */
grpc_status_code rt_reservation_end(rt_req *r, int call);
/* Adds node to skip[0, *n) unless it is there already. */
void rt_skip_add(rt_node **skip, int *n, rt_node *node);

/* ------------------------------------------------------------------ prefill.c */

/* Prefill on a prefill node with the reservation's transfer address; see prefill.c for the
 * retry rule. On anything but RT_ATTEMPT_DONE the reservation is released. */
rt_attempt rt_prefill(rt_req *r, Kvrelay__V1__PrefillResponse **out, kc_status *st);

/* ------------------------------------------------------------------ relay.c */

/* 1 when alts[0, n_alts) are n lists of k alternatives each (what a node must send). */
int rt_alts_fit(Kvrelay__V1__TopLogprobs *const *alts, size_t n_alts, size_t n, uint32_t k);
/* 1 when id is one of the request's stop ids. */
int rt_is_stop_id(const rt_req *r, uint32_t id);
/* Sends ids[0, n) to the client with the text they complete, cut at a stop string, and with
 * r->logprobs their lps[0, n) and tops[0, n), with r->top_logprobs their alternatives alts[0, n).
 * A request with prompt_logprobs has its first delta carry the prompt's scores (r->scores, reset
 * then; n may be 0 for a scored-only request). Returns 0, 1 when a stop string matched
 * (later ids are dropped; r->stopped set), -1 when the client is gone (st CANCELLED) or the
 * detokenizer failed (st INTERNAL). */
int rt_relay(rt_req *r, const uint32_t *ids, const float *lps, const uint32_t *tops,
             Kvrelay__V1__TopLogprobs *const *alts, size_t n, kc_status *st);
/* Sends the text held back at the end (an incomplete character, a possible stop-string
 * prefix). Returns 0, or -1 with st. */
int rt_relay_flush(rt_req *r, kc_status *st);
/* Opens the decode stream on r->dnode and relays it until its finish, a stop string or an
 * error; phase RT_PHASE_DECODE_FAILED says the node failed (a migration may follow). */
grpc_status_code rt_decode_stream(rt_req *r, kc_status *st);

/* ------------------------------------------------------------------ watch.c */

/* Adds / removes an open decode stream to / from the watcher's list (rt->active). */
void rt_active_add(rt_router *rt, rt_active *a);
void rt_active_remove(rt_router *rt, rt_active *a);

#endif /* RT_REQUEST_H */
