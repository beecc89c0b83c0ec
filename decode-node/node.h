/*
 * node.h - kvrelay-decode's internals, shared by its sources (not a library: nothing outside
 * decode-node/ includes it). Design, flags and failure behaviour: docs/decode-node.md.
 *
 * The pieces and who owns what:
 *   main.c     flags, start-up (model, KV pool, transport, gRPC, HTTP), signals, shutdown
 *   resv.c     the reservation table: admission against free-minus-reserved blocks, receive
 *              buffers, the transport's completion callback, release, expiry
 *   import.c   each part of a bundle, as it arrives, into the reservation's sequence
 *   service.c  the Decode service's handlers (Reserve, Decode, Release, Status)
 *   loop.c     the continuous-batching thread: adopts the imported sequences, one
 *              kr_forward_batch per step over every running sequence, sampling (or the forced
 *              ids of a scoring request, with log-probabilities), streaming
 *
 * Threads: gRPC handler threads (one per call), the transport's progress thread (callbacks and
 * imports), the batching loop thread, libmicrohttpd's threads, and main (waits for a signal).
 * Everything mutable below is guarded by dn_node.lock, except what the loop alone touches
 * (kr_ctx, the running sequences and the running set, marked "loop only"), a reservation's
 * sequence while its transfer is open (the progress thread's), and the KV pool, which locks
 * itself.
 */
#ifndef DN_NODE_H
#define DN_NODE_H

#include <pthread.h>
#include <stdint.h>

#include "bundle.h"
#include "health.h"
#include "http.h"
#include "kr.h"
#include "kr-grammar.h"
#include "membership.h"
#include "metrics.h"
#include "rpc.h"
#include "transport.h"

#define DN_REQUEST_ID_MAX 64 /* request ids are cut to this for logs */
#define DN_MAX_STOP_IDS 1024
#define DN_MAX_TTL_MS 600000 /* a Reserve may ask for at most 10 minutes */
#define DN_PENDING_MAX 64 /* most token ids in one DecodeTokens message */

/* Immutable after start-up: what the flags said. */
#define DN_FAMILIES_MAX 16 /* policy families with their own block gauge */

typedef struct dn_config {
    const char *model_dir;
    const char *id; /* node id, e.g. "decode-0" */
    const char *listen; /* gRPC HOST:PORT */
    const char *transfer; /* UCX listener HOST:PORT */
    const char *http; /* HOST:PORT of /metrics and /healthz */
    const char *advertise; /* host put in transfer_address; NULL: the --transfer host */
    int64_t kv_blocks; /* 0: from kv_memory */
    int64_t kv_memory; /* bytes for the KV pool when kv_blocks is 0 */
    int block_size;
    int threads; /* 0: all online CPUs */
    int max_batch; /* most sequences per kr_forward_batch call */
    int cpu_sched; /* kc_cpu_sched of the node's threads */
    int rma; /* --transfer-mode rma: reservations are mapped for the prefill node's puts */
    int ttl_ms; /* default reservation expiry */
    double drain_timeout_s; /* the longest a SIGTERM'd node waits for its work to end */
    kc_etcd_config etcd; /* etcd.endpoints NULL: no registration */
    kc_tls_config tls; /* --tls-*: mutual TLS with the router; none given: plaintext */
    const char *cluster;
    int lease_ttl_s;
    kr_backend_kind backend;
    kr_kv_dtype cache_dtype; /* the KV pool's dtype (--kv-cache-dtype) */
} dn_config;

typedef struct dn_node dn_node;

/* A reservation's states. It is created WAITING; the only moves are WAITING -> READY (the
 * bundle arrived), WAITING -> FAILED (the transfer failed or expired) and READY -> DECODING (a
 * Decode call claimed it), all made by dn_resv_move. Any state ends by unlinking and
 * dn_resv_end, which is not a state. */
typedef enum dn_resv_state {
    DN_RESV_WAITING = 0, /* reserved in the transport, bundle not (fully) here */
    DN_RESV_READY = 1, /* bundle arrived and parsed by the transport; no Decode yet */
    DN_RESV_FAILED = 2, /* the transfer failed or expired: blocks returned, message kept for a
                           Decode call that asks (a tombstone with no blocks) */
    DN_RESV_DECODING = 3, /* a Decode call took it; freed by that call's path (handler or loop) */
} dn_resv_state;

/* One reservation. Lives in dn_node.resvs; found by id under the lock. Ended (dn_resv_end) by
 * whoever unlinks it (Release, expiry, the loop when its sequence ends, a Decode that fails);
 * its blocks stay counted in reserved_sum until then. */
typedef struct dn_resv {
    struct dn_resv *next;
    uint64_t id; /* random, never 0 */
    char request_id[DN_REQUEST_ID_MAX + 1];
    dn_resv_state state;
    int64_t blocks; /* the blocks bound, counted in dn_node.reserved_sum; 0 once returned */
    int prompt_tokens, max_tokens; /* as reserved: what `blocks` covers */
    int max_list_entries; /* most entries a bundle list may bring (the bound's assumption) */
    kr_policy *policy; /* parsed from the Reserve request (owned); a bundle must carry its spec */
    uint64_t cap, len; /* cap: the most bytes the bundle's parts may add up to; len: bytes that
                          arrived (READY) */
    kt_bundle_view *parts; /* [n_layers + KT_BUNDLE_MAX_EARLY_PARTS]: room for every part of a
                              pipelined transfer (owned) */
    kt_bundle_set set; /* the transport's validated parts (a whole bundle, or the layer segments
                          of a pipelined transfer), each in its own buffer, owned by the set;
                          freed once the loop adopted `seq` (Decode checks the lists first) */
    /* The parts' rows, copied into KV blocks by dn_import_part as each part arrives: written on
     * the transport's progress thread until the transfer's callback, read by the Decode path
     * after it; owned (NULL once the loop adopted it). */
    dn_node *node;
    int64_t blocks_bound; /* `blocks` as reserved, fixed: what seq may take */
    kr_seq *seq;
    /* Blocks taken for K and V to be received or put into, not yet adopted by seq's lists (run_n
     * 0: none). In AM mode, the run dn_place_part took for the arriving part; in RMA mode, the
     * run taken at Reserve and mapped for the prefill node's puts, each part adopting the next
     * blocks of it in order (dn_import_part). What is left goes back to the pool when the
     * transfer ends (dn_resv_drop_run). */
    int32_t run_first;
    int run_n;
    int64_t run_extra; /* RMA: the run's blocks, admitted in `blocks` on top of the bound (they are
                          held beside the sequence's own until the transfer ends) */
    double import_s; /* seconds spent copying rows into seq */
    int xfer_open; /* the transport still adds to set (its callback has not run) */
    int cancel; /* DECODING: Release asked to end it */
    double expires; /* monotonic seconds: an unused READY reservation is dropped then */
    double failed_at; /* FAILED: when (tombstones are dropped a while later) */
    int64_t expires_unix_ms;
    char err[KT_ERR_MAX]; /* FAILED: the transport's message */
} dn_resv;

/* One sequence handed from a Decode call to the loop. Created by the Decode handler, owned by
 * the loop from the hand-over on. */
typedef struct dn_job {
    struct dn_job *next; /* pending list */
    dn_resv *resv; /* DECODING: nobody else frees it */
    kc_call *call; /* detached; finished exactly once by the loop */
    char request_id[DN_REQUEST_ID_MAX + 1];
    int32_t first_token, next_pos; /* the bundle's, read from resv->set by the Decode handler
                                      (the parts are freed when the job joins the batch) */
    kr_sampler *sampler;
    int32_t *stop_ids; /* [n_stop] */
    int n_stop;
    int32_t *forced; /* [max_tokens - 1]: the ids after the first, fed instead of sampled; NULL:
                        sample. Forced jobs ignore EOS and stop ids (they end at max_tokens) */
    int logprobs; /* stream logprobs and top_ids with the ids (always when forced) */
    int max_tokens; /* completion tokens allowed, the first included */
    int ignore_eos; /* EOS is a token like any other: it does not stop the sequence */
    int min_tokens; /* while n_gen < min_tokens, EOS and stop ids are masked out of the draws
                       (and the prefill node's first token does not stop the sequence) */
    kr_penalty_state *pen; /* NULL: no repetition, presence or frequency penalty */
    int budget_tokens; /* what the reservation's blocks cover (CONTEXT beyond it) */
    kr_grammar_seq *gseq; /* response_format's matcher, fed the tokens of earlier placements and
                             (at admission) the first; NULL: draws are not constrained */
    /* loop only, from the admission on */
    kr_seq *seq; /* adopted from resv->seq */
    int32_t next_in; /* the token fed at the next step */
    int n_gen; /* completion tokens so far, the first included */
    int32_t pending[DN_PENDING_MAX]; /* sampled ids not yet sent (the client is behind) */
    float pending_lp[DN_PENDING_MAX]; /* with logprobs: theirs, and each step's argmax */
    uint32_t pending_top[DN_PENDING_MAX];
    int top_logprobs; /* 0..KR_TOP_LOGPROBS_MAX alternatives streamed per id (with logprobs) */
    int32_t pending_alt_ids[DN_PENDING_MAX][KR_TOP_LOGPROBS_MAX]; /* [n_pending][top_logprobs] */
    float pending_alt_lps[DN_PENDING_MAX][KR_TOP_LOGPROBS_MAX];
    int n_pending;
    double t_join, t_last; /* monotonic: joined the batch, last token */
    int released; /* its reservation's cancel flag, as the loop last read it */
} dn_job;

/* Metrics (names and meanings: docs/observability.md, docs/decode-node.md; main.c registers). */
typedef struct dn_metrics {
    kc_registry *reg;
    kc_gauge *blocks_used, *blocks_free, *blocks_reserved;
    kc_gauge *running, *queued, *reservations;
    kc_histogram *batch_size, *tpot, *import_s;
    kc_histogram *step_s; /* one batched forward call */
    kc_histogram *mask_s; /* one sequence's structured-output mask (computed and applied) */
    kc_gauge *blocks_by_policy[DN_FAMILIES_MAX]; /* blocks held by running sequences, by family */
    kc_counter *tokens;
    kc_counter *requests[GRPC_STATUS_UNAUTHENTICATED + 1]; /* Decode streams by final status */
    kc_counter *reserves[GRPC_STATUS_UNAUTHENTICATED + 1]; /* Reserve calls by status */
    kc_counter *expired;
    kc_counter *parts_in_blocks, *parts_copied; /* bundle parts received into KV blocks, or
                                                   copied into them (import.c) */
} dn_metrics;

struct dn_node {
    dn_config cfg;
    kr_model *model;
    const kr_config *mcfg;
    char fingerprint[17];
    float *zero_logits; /* [vocab]: what a sampler skips a draw with */
    kr_grammar_vocab *gvocab; /* structured output's vocabulary, read-only; NULL when the model
                                 has no tokenizer (gvocab_err says why) */
    char gvocab_err[KR_ERR_MAX];
    kr_kv_pool *pool; /* the loop's, and import.c's for sequences not yet handed over */
    kr_ctx *ctx; /* loop only */
    kt_transport *transport;
    kc_server *server;
    kc_health *health;
    kc_http *http;
    kc_registration *registration; /* NULL without --etcd */
    dn_metrics m;
    char grpc_addr[160], transfer_addr[160], http_addr[160]; /* HOST:PORT, host <= 127 chars */
    int64_t since_unix_ms;

    pthread_mutex_t lock;
    pthread_cond_t cond; /* loop wake-ups, bundle arrivals, releases */
    int draining; /* SIGTERM: no new reservations; existing ones are still decoded */
    int stopping; /* no new reservations or decodes; the loop ends every stream and exits */
    int loop_alive; /* cleared by the loop thread on exit (health) */
    dn_resv *resvs;
    int n_resvs;
    int64_t total_blocks; /* the pool's */
    int64_t reserved_sum; /* sum of live reservations' bounds (used blocks included) */
    dn_job *pending; /* Decode calls handed over, not yet admitted by the loop (FIFO) */
    dn_job **pending_tail;
    int n_pending, n_running, n_waiting; /* n_waiting: Decode calls waiting for a bundle */
    pthread_t loop;
};

/* resv.c */
/* What a Reserve asks for, checked by service.c. */
typedef struct dn_resv_ask {
    const char *request_id;
    kr_policy *policy; /* taken by dn_resv_admit in every case */
    int prompt_tokens, max_tokens;
    int ttl_ms;
} dn_resv_ask;

/* What an admitted reservation answers with. */
typedef struct dn_resv_grant {
    uint64_t id;
    int64_t blocks; /* the blocks bound */
    int64_t expires_unix_ms;
    uint8_t token[KT_RESV_TOKEN_BYTES]; /* the transport's random token the bundle must carry */
    kt_rma_key rma; /* RMA mode: where the prefill node puts the bundle (rkey_len 0: AM mode) */
    kt_rma_rows rows; /* RMA mode: where padded parts' K and V go; bytes 0: no run of blocks */
} dn_resv_grant;

/* Admits a reservation and reserves room for its bundle in the transport. Returns a
 * grpc_status_code: OK with *out set, or an error with `err` (KT_ERR_MAX bytes) and *out
 * untouched: RESOURCE_EXHAUSTED when the bound does not fit the free blocks, OUT_OF_RANGE when
 * it exceeds the whole pool. */
int dn_resv_admit(dn_node *n, const dn_resv_ask *ask, dn_resv_grant *out, char *err);
/* Moves r to `to` (n->lock held): WAITING -> READY, WAITING -> FAILED, READY -> DECODING.
 * Returns 0, or -1 (logged with the request id, r unchanged) for any other move. */
int dn_resv_move(dn_resv *r, dn_resv_state to);
dn_resv *dn_resv_find_locked(dn_node *n, uint64_t id);
/* Takes r out of the table (n->lock held); its blocks stay counted until dn_resv_end. */
void dn_resv_unlink_locked(dn_node *n, dn_resv *r);
/* Without n->lock, once r is unlinked (or never linked) and its transfer is over: frees r (its
 * sequence, its unadopted run, its parts, its policy), then takes its blocks out of
 * reserved_sum, so that blocks are counted free only once they are back in the pool. NULL:
 * nothing. */
void dn_resv_end(dn_node *n, dn_resv *r);
int dn_resv_release(dn_node *n, uint64_t id, const char *request_id);
/* Unlinks the reservations whose time is up onto *dead (linked by next; the caller ends each
 * with dn_resv_end after unlocking). Returns the next deadline. */
double dn_resv_reap_locked(dn_node *n, double now, dn_resv **dead);
void dn_resv_release_all(dn_node *n);
void dn_publish_locked(dn_node *n); /* gauges from the accounting */
/* Blocks sequences hold in the pool now: running ones and those being imported. */
int64_t dn_used_blocks(const dn_node *n);

/* import.c */
/* The reservation's kt_bundle_part_fn (arg: its dn_resv): part i's rows into r->seq. */
int dn_import_part(void *arg, const kt_bundle_set *s, uint32_t i, char *err);
/* The set's placement hook (kt_bundle_place_fn): a run of pool blocks for a block-padded part's
 * K and V (import.c). */
int dn_place_part(void *arg, const kt_bundle_set *s, const kt_bundle_view *head, void **k, void **v,
                  char *err);
/* Gives r's placed run back to the pool when no list adopted it (a failed or released
 * transfer). */
void dn_resv_drop_run(dn_resv *r);

/* service.c */
int dn_service_register(dn_node *n, char *err);

/* loop.c */
int dn_loop_start(dn_node *n, char *err);
/* Hands a job to the loop (GRPC_STATUS_OK), or refuses it, job untouched: UNAVAILABLE when the
 * node is stopping, CANCELLED when its reservation was released meanwhile. */
int dn_loop_submit(dn_node *n, dn_job *job);
void dn_loop_stop(dn_node *n);
void dn_job_free(dn_job *job); /* the job's own allocations (not resv, not call) */

/* time */
double dn_now(void); /* monotonic seconds */
int64_t dn_unix_ms(void);

#endif /* DN_NODE_H */
