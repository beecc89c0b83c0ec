/*
 * prefill.h - the insides of kvrelay-prefill (docs/prefill-node.md): the node (model, one
 * kr_ctx with its KV pool, the prefix cache of prefix-cache.h, a send-only UCX transport), its
 * bounded FIFO of prefill jobs run by one worker thread, and the gRPC service (Prefill.Prefill,
 * Prefill.Status) in front of it.
 *
 * Threads: gRPC handler threads (one per call, common/rpc.h) validate a request, turn it into a
 * pf_job on their own stack, queue it and wait for it; the one worker thread owns the kr_ctx,
 * the KV pool, the prefix cache and every scratch buffer below, and runs jobs one at a time in
 * arrival order.
 * A job is the handler's: the worker touches it only between taking it from the queue and
 * marking it PF_JOB_DONE, and the handler does not return before that.
 * Not here: placement, retries (the router's), decode (decode-node/).
 */
#ifndef PF_PREFILL_H
#define PF_PREFILL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "bundle.h"
#include "health.h"
#include "kr.h"
#include "kr-grammar.h"
#include "membership.h"
#include "metrics.h"
#include "prefix-cache.h"
#include "rpc.h"
#include "transport.h"

#include "kvrelay/v1/internal.pb-c.h"

#define PF_BLOCK_SIZE 16 /* KV pool block size (entries) */
#define PF_N_CODES (GRPC_STATUS_UNAUTHENTICATED + 1) /* gRPC status codes 0..16 */
#define PF_N_WIRE 5 /* bundle payload dtypes, in pf_wire_dtypes order */
#define PF_MAX_STOP_IDS 64 /* PrefillRequest.stop_ids, as the router and the decode node allow */
#define PF_WIRE_AUTO (-1) /* --kv-dtype auto before start-up resolves it to the cache's dtype */

/* Every bundle payload dtype, the order of pf_metrics.kv_bytes. */
extern const kt_dtype pf_wire_dtypes[PF_N_WIRE];

/* Flags (main.c parses them; --help lists them with their defaults). */
typedef struct pf_config {
    const char *model_dir;
    const char *listen;        /* gRPC HOST:PORT */
    const char *http;          /* HTTP HOST:PORT (/metrics, /healthz) */
    const char *id;            /* node id, in logs, usage and Status */
    int threads;               /* kr_ctx threads; 0: all online CPUs */
    int cpu_sched;             /* kc_cpu_sched of the node's threads */
    int chunk;                 /* prefill chunk (tokens), also the context's max_chunk */
    int queue;                 /* most jobs waiting behind the running one */
    kt_dtype kv_dtype;         /* bundle payload (PF_WIRE_AUTO until start-up resolves it) */
    kr_kv_dtype cache_dtype;   /* the KV cache's dtype (--kv-cache-dtype) */
    int pipeline;              /* 1: layer-wise pipelined transfer (--pipeline on) */
    int max_prompt;            /* longest prompt accepted (tokens) */
    int kv_blocks;             /* KV pool blocks */
    int64_t prefix_cache_bytes; /* the prefix cache's budget; 0: no cache (-1 until start-up
                                   gives it the KV pool's bytes) */
    double transfer_timeout_s; /* cap on one bundle send */
    double drain_timeout_s;    /* the longest a SIGTERM'd node waits for its jobs */
    const char *advertise;     /* host registered in etcd instead of the --listen host */
    kc_etcd_config etcd;       /* etcd.endpoints NULL: no registration */
    kc_tls_config tls;         /* --tls-*: mutual TLS with the router; none given: plaintext */
    const char *cluster;
    int lease_ttl_s;
    kr_backend_kind backend;
} pf_config;

/* What a finished prefill reports (PrefillUsage without the node id). */
typedef struct pf_usage {
    double prefill_s;       /* kr_prefill, the first token's sampling, writing the bundle */
    double transfer_s;      /* from the end of prefill_s until the decode node acknowledged the
                               bundle's last part: what the transfer adds to the first token */
    int parts, parts_early; /* parts sent (1: a whole bundle), and how many of them the decode
                               node acknowledged before the prefill ended */
    uint64_t kv_entries;    /* entries shipped, summed over every (layer, KV head) */
    uint64_t kv_bytes;      /* K + V payload bytes of those entries, row scales included
                               (framing not counted) */
    kr_footprint footprint; /* the sequence's, after prefill */
    int cached_tokens;      /* prompt tokens that came from the prefix cache, not computed */
} pf_usage;

typedef enum pf_job_state {
    PF_JOB_QUEUED = 0,
    PF_JOB_RUNNING = 1,
    PF_JOB_DONE = 2,
} pf_job_state;

/* The prompt's scores (PrefillRequest.prompt_logprobs): prompt token i+1's log-probability
 * given tokens [0, i] and that row's top alternatives, from the chunked prefill's own rows
 * (kr_prompt_span's score_fn). Buffers are malloc'd by pf_scores_init for one job. */
typedef struct pf_scores {
    int on;               /* asked for */
    int k;                /* alternatives per row */
    int n;                /* rows scored: the prompt's tokens - 1 */
    int vocab;
    const int32_t *tokens; /* the job's prompt (borrowed) */
    float *lps;           /* [n] */
    int32_t *top_ids;     /* [n][k] */
    float *top_lps;       /* [n][k] */
    float *buf;           /* [KR_SCORE_ROWS][vocab]: the engine's logits rows */
} pf_scores;

/* One Prefill call's work. Lives on its handler's stack; every pointer is the handler's. */
typedef struct pf_job {
    /* the validated request */
    const char *request_id;  /* NULL when the request had none */
    const char *decode_node; /* for logs */
    const int32_t *tokens;   /* [n_tokens], every id inside the vocabulary */
    int n_tokens;
    const kr_policy *policy; /* outlives the job (cached, or freed by the handler after it) */
    kr_sampling sampling;    /* checked with kr_sampling_check */
    int32_t forced_first;    /* -1: sample the first token; else this id (in the vocabulary) */
    int logprobs;            /* report first_logprob / first_top_id (set when forcing too) */
    kr_penalty_state *pen;   /* the first draw's penalties (NULL: none on), freed by the handler */
    kr_draw_mask mask;       /* min_tokens' mask of the first draw; stop points into stop_ids */
    int32_t stop_ids[PF_MAX_STOP_IDS];
    kr_grammar_seq *gseq;    /* response_format's matcher, caught up with the completion so far
                                (the handler's); NULL: the draw is not constrained */
    int64_t gbudget;         /* with gseq: the tokens the completion may still take (0: no
                                bound) */
    kt_dtype wire;           /* the bundle's payload dtype: the request's, or --kv-dtype */
    char host[256];          /* transfer address */
    uint16_t port;
    uint64_t reservation_id; /* never 0 */
    uint8_t reservation_token[KT_RESV_TOKEN_BYTES]; /* sent with the bundle */
    kt_rma_key rma;          /* rkey_len > 0: the reservation is mapped; the parts are put there */
    uint32_t block_rows;     /* the decode node's KV block size: lists are padded to whole blocks
                                of it (bundle format 2.3) so they land in its blocks; 0: packed
                                (also when the wire dtype is not its blocks') */
    kt_rma_rows rma_rows;    /* bytes > 0: the K and V rows of the blocks the decode node took,
                                mapped: padded parts are put there, their heads into `rma` */
    kc_call *call;           /* deadline and cancellation */
    /* queue (the node's lock) */
    struct pf_job *next;
    pf_job_state state;
    pthread_cond_t done; /* signalled when state becomes PF_JOB_DONE */
    /* the outcome, set by whoever marks the job done */
    grpc_status_code code;
    char details[256]; /* when code != OK */
    int dropped; /* the drain's abort ended it: its handler calls pf_queue_answered once answered */
    int32_t first_token;
    float first_logprob;  /* when logprobs: kr_logprob of first_token on the last row */
    int32_t first_top_id; /* when logprobs: that row's argmax */
    int top_logprobs;     /* 0..KR_TOP_LOGPROBS_MAX alternatives of the first token (and of each
                             scored prompt row) */
    int32_t first_top_ids[KR_TOP_LOGPROBS_MAX]; /* [top_logprobs] when logprobs */
    float first_top_lps[KR_TOP_LOGPROBS_MAX];
    int score_only;       /* the prompt's scores only: no first token, no bundle */
    pf_scores scores;     /* prompt scores (scores.c); scores.on 0: not asked. The handler frees
                             them with pf_scores_free once answered */
    pf_usage usage;
} pf_job;

typedef struct pf_metrics {
    kc_counter *requests[PF_N_CODES]; /* by status; only the codes the node returns */
    kc_counter *prompt_tokens, *kv_entries;
    kc_counter *kv_bytes[PF_N_WIRE]; /* by the bundle's payload dtype (pf_wire_dtypes) */
    kc_histogram *prefill_s, *transfer_s;
    kc_counter *parts[2]; /* bundle parts acknowledged [0] before and [1] after the prefill ended
                             (layer-wise pipelining) */
    kc_gauge *queue_depth, *running, *blocks_used, *blocks_free;
} pf_metrics;

typedef struct pf_policy_entry pf_policy_entry;
/* A send buffer, 64-byte aligned, grown to the largest part it held so far: a request does not
 * allocate it again. */
typedef struct pf_buf {
    uint8_t *p;
    size_t cap;
} pf_buf;

typedef struct pf_node {
    const pf_config *cfg;
    kr_model *model;
    const kr_config *mcfg;
    kt_transport *tx;              /* send-only */
    char grpc_address[300];        /* as bound: HOST:PORT */
    _Atomic int draining;          /* SIGTERM: new Prefill calls refused, queued jobs run */
    _Atomic int aborting;          /* the drain is over: jobs not yet sent end UNAVAILABLE */
    _Atomic int64_t since_unix_ms; /* when the current state began */
    kc_registry *reg;
    kc_health *health; /* grpc.health.v1 */
    kc_registration *registration; /* NULL without --etcd */
    pf_metrics metrics;
    kr_grammar_vocab *gvocab; /* the structured-output mask's vocabulary, shared read-only; NULL
                                 when the model has no tokenizer (gvocab_err says why) */
    char gvocab_err[KR_ERR_MAX];

    /* the worker's: only the worker thread touches these after start-up */
    kr_ctx *ctx;
    kr_kv_pool *pool;
    pf_cache *cache;        /* NULL: --prefix-cache-memory 0 */
    float *logits;          /* [vocab_size] */
    float *draw_row;        /* [vocab_size]: the first draw's row under penalties or masks */
    kr_grammar_scratch *gscratch; /* the mask's working memory; NULL without gvocab */
    kt_bundle_list *lists;  /* [n_layers * n_kv_heads] */
    pf_buf *bufs;           /* [n_layers + KT_BUNDLE_MAX_EARLY_PARTS]: a send buffer per part
                               (a whole bundle, or a pipelined transfer's parts); bufs[0] for a
                               whole one */
    int *sent;              /* [n_layers * n_kv_heads]: each list's entries already in a part */
    pthread_t worker;

    /* the queue, under mu */
    pthread_mutex_t mu;
    pthread_cond_t work; /* a job was queued, or stopping */
    pf_job *head, *tail;
    int n_waiting;               /* jobs in the queue (not the running one) */
    int n_unanswered;            /* jobs the drain's abort dropped whose handlers have not answered */
    int running;                 /* 0 or 1 */
    uint64_t outstanding_tokens; /* prompt tokens waiting or running */
    int stopping;

    /* parsed policies by spec, under policy_mu */
    pthread_mutex_t policy_mu;
    pf_policy_entry *policies;
    int n_policies;
} pf_node;

/* queue.c: the FIFO and its worker. */
int pf_queue_start(pf_node *n, char *err);
/* Stops the worker after the running job (the queue must be empty: the server is gone). */
void pf_queue_stop(pf_node *n);
/* The drain is over (n->aborting): wakes the handlers of queued jobs, which end them
 * UNAVAILABLE, and waits up to a second for them (a running job ends at its next check). */
void pf_queue_abort(pf_node *n);
/* A handler whose job the abort dropped has sent its answer (the server may now go). */
void pf_queue_answered(pf_node *n);
/* Queues `j` (state QUEUED) unless more than cfg->queue jobs would be waiting; returns 0, or
 * -1 with *waiting set to the jobs waiting. */
int pf_queue_submit(pf_node *n, pf_job *j, int *waiting);
/* Returns once `j` is done: run by the worker, or dropped from the queue because its call was
 * cancelled or passed its deadline while it waited. */
void pf_queue_wait(pf_node *n, pf_job *j);
/* Load, for Status. */
void pf_queue_load(pf_node *n, int *running, int *waiting, uint64_t *outstanding_tokens);

/* run.c: one job on the worker: prefill, first token, bundle, send. Sets the outcome. */
int pf_run_init(pf_node *n, char *err); /* the worker's context, pool and scratch */
void pf_run_free(pf_node *n);
void pf_run(pf_node *n, pf_job *j);
/* DEADLINE_EXCEEDED when the call's deadline passed (or is within PF_DEADLINE_SLACK_MS), else
 * CANCELLED. */
#define PF_DEADLINE_SLACK_MS 100
grpc_status_code pf_call_gone_code(kc_call *call);
#define PF_SHUTDOWN_MSG "prefill node shutting down"

/* service.c: the gRPC methods and the metrics they keep. */
int pf_metrics_register(pf_node *n);
int pf_service_register(pf_node *n, kc_server *srv);
void pf_service_free(pf_node *n); /* the policy cache; after the server is destroyed */
double pf_now(void); /* monotonic seconds */

/* scores.c: sizes s for a prompt of n tokens with k alternatives per row (s->on set). Returns 0,
 * or -1 (out of memory; what was allocated is freed by pf_scores_free). */
int pf_scores_init(pf_scores *s, const int32_t *tokens, int n, int vocab, int k);
/* kr_rows_fn: the logits of prompt rows [first, first + rows) into s's scores. */
int pf_scores_rows(void *arg, int first, int rows, const float *logits, char *err);
void pf_scores_free(pf_scores *s);
/* The scores' alternatives as PrefillResponse.prompt_top_logprobs: *tops[n] messages pointing
 * into s and *ptrs[n] pointing at them (both malloc'd, the caller frees them; NULL when s has no
 * alternatives). Returns 0, or -1 out of memory. */
int pf_scores_message(const pf_scores *s, Kvrelay__V1__TopLogprobs **tops, Kvrelay__V1__TopLogprobs ***ptrs);

#endif /* PF_PREFILL_H */
