/*
 * router.h - the insides of kvrelay-router shared by its files (not a library):
 *   main.c      flags, start-up, metrics, the serving line, shutdown
 *   nodes.c     the nodes membership lists (common/membership.h: the --nodes file or etcd, one
 *               kc_member list either way): channels, Status polling, load estimates for
 *               placement, Admin.ClusterStatus
 *   request.c   Generation.Generate (validate, place, relay the decode stream, finish) and
 *               Generation.Tokenize, with validate.c, admission.c, reserve.c, prefill.c,
 *               relay.c and watch.c (request.h says which step is where)
 *   openai.c    the OpenAI-compatible HTTP API (/v1/models, completions, chat completions) on
 *               the HTTP port, served through request.c; its request bodies are parsed by
 *               openai-request.c (openai.h, pure, fuzzed); several choices and prompts run as
 *               several generations by openai-choices.c
 *   placement.c, stop.c, breaker.c, kv-index.c: the pure parts (their own headers, unit-tested)
 * docs/router.md says what the router promises; this header says who owns what.
 */
#ifndef RT_ROUTER_H
#define RT_ROUTER_H

#include "apikey.h"
#include "breaker.h"
#include "health.h"
#include "kr.h"
#include "kv-index.h"
#include "client-limits.h"
#include "log.h"
#include "metrics.h"
#include "membership.h"
#include "placement.h"
#include "rpc.h"

#include "kvrelay/v1/internal.pb-c.h"
#include "kvrelay/v1/kvrelay.pb-c.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* Node-to-node RPC timeouts that do not depend on a client's deadline. */
#define RT_STATUS_TIMEOUT_MS 400 /* one Status call of the poller (a stopped node cannot stall it) */
#define RT_POLL_INTERVAL_MS 500
#define RT_RELEASE_TIMEOUT_MS 2000 /* Release runs even after the client's deadline passed */
#define RT_RESERVE_TIMEOUT_MS 2000 /* Reserve is bookkeeping: a node that takes longer is failing */
#define RT_NODES_MAX (2 * KC_MEMBERS_FILE_MAX) /* nodes ever known, gone ones included */
#define RT_NODE_ID_MAX 63 /* bytes of a node id: longer ones from etcd are left out, as the file refuses them */
#define RT_GONE_LISTED_MS 300000 /* a gone node stays in ClusterStatus this long */
#define RT_GONE_GRACE_MS 10000 /* a gone node still answering as serving is placed this long */
#define RT_NODE_RECONNECT_MS 1000 /* the cap on a node channel's reconnect backoff */
#define RT_REQUEST_ID_MAX 128 /* bytes of a request id */
#define RT_OPENAI_MAX_BODY (4u << 20) /* bytes of an OpenAI API request body */
#define RT_HTTP_MAX_CONNECTIONS 512 /* HTTP connections at once (each OpenAI stream holds one) */
#define RT_HTTP_CODES 10 /* HTTP statuses the OpenAI API answers with (openai.c) */
#define RT_FAMILIES_MAX 16 /* policy families with their own latency histograms */

/* One node the router knows of: the member record membership gave last, and the router's live
 * state of it. Nodes are created by membership and never freed while the router runs (a gone
 * node may still have calls in flight). `role` and `id` are its identity (membership matches
 * nodes by both), never rewritten, so read without a lock; every other field is guarded by
 * rt_router.mu. */
typedef struct rt_node {
    rt_role role; /* member.role, parsed */
    char *id; /* = member.id: the name the request path's logs and errors give the node */
    kc_member member; /* as its source says now: address (grpc), state "draining", fingerprint */

    kc_channel *ch; /* to member.grpc, shared by every call to this node; read with rt_node_channel */
    int gone; /* left membership: never chosen */
    int64_t gone_unix_ms;
    int refused_draining; /* a call was answered UNAVAILABLE "draining" (cleared by a SERVING Status) */
    int fingerprint_bad; /* the member's model differs from the router's: never chosen */
    char status_fingerprint[17]; /* the model its last Status reported ("" none): auto's table check */

    rt_breaker breaker; /* open: SUSPECT, skipped by placement (docs/failures.md) */

    /* what the router says about it, and since when (unix ms) */
    Kvrelay__V1__NodeState view;
    int64_t view_since_unix_ms;

    /* its last Status */
    int polled; /* a Status call has completed (answered or failed) */
    int reachable; /* the last one answered */
    char error[320]; /* why the last one failed */
    Kvrelay__V1__NodeState state;
    char transfer_address[256];
    uint32_t running, queued;
    uint64_t prefill_tokens, free_blocks, total_blocks, reserved_blocks;
    int64_t node_since_unix_ms; /* the node's own since_unix_ms: another value means it restarted */
    uint32_t chunk; /* the prefill chunk its Status reported (0: none yet) */
    /* prefill nodes: their prefix cache, summed over families (Node.prefix_cache_*) */
    uint64_t cache_bytes, cache_budget, cache_entries, cache_lookups, cache_hits, cache_reused;

    /* kv-aware placement: the prompts this router prefilled on the node (NULL until the first);
     * cleared when the node restarts, moves or leaves, or says its cache is empty */
    rt_kv_index *kv;
    int64_t kv_recorded_ms; /* rt_now_ms() of the last prompt recorded */

    /* what this router has in flight on the node now, and had when the last Status was sent:
     * the load estimate is the node's answer plus our change since */
    int64_t own_tokens, own_running, own_blocks;
    int64_t own_tokens_polled, own_running_polled, own_blocks_polled;
} rt_node;

/* Why kv-aware placement put a prefill first (kvrelay_placements_total{reason}). */
typedef enum rt_placed {
    RT_PLACED_PREFIX = 0, /* it is predicted to hold the longest prefix of the prompt */
    RT_PLACED_LOAD, /* another node holds a longer one, but its queue outweighs the saving */
    RT_PLACED_NO_PREFIX, /* no node is predicted to hold any: by load, as least-loaded */
    RT_PLACED_REASONS
} rt_placed;
extern const char *const rt_placed_names[RT_PLACED_REASONS];

/* The metrics the router exports (docs/observability.md names). */
typedef struct rt_metrics {
    kc_registry *reg;
    kc_counter *requests[GRPC_STATUS_UNAUTHENTICATED + 1]; /* by final status code */
    /* latencies of finished requests, by policy family (kr_policy_family) */
    kc_histogram *ttft[RT_FAMILIES_MAX], *tpot[RT_FAMILIES_MAX], *e2e[RT_FAMILIES_MAX], *queue_wait[RT_FAMILIES_MAX];
    kc_counter *prompt_tokens, *generated_tokens;
    kc_counter *kv_bytes_shipped;
    kc_gauge *in_flight, *queued;
    kc_counter *retries;
    kc_counter *placements[RT_PLACED_REASONS]; /* prefill placements under kv-aware, by reason */
    kc_counter *predicted_cached; /* prompt tokens predicted cached on the prefill node chosen */
    kc_counter *cached_tokens; /* prompt tokens the prefill nodes took from their prefix caches */
    kc_counter *http_responses[RT_HTTP_CODES]; /* by status (openai.c) */
} rt_metrics;

typedef struct rt_active rt_active; /* a Generate call with a decode stream open (request.h) */
struct rt_auto; /* kv_policy auto: the calibration table, --default-policy, --pressure (auto.h) */
typedef struct rt_waiter rt_waiter; /* a request in the admission FIFO (admission.c) */

typedef struct rt_router {
    /* immutable after start-up */
    char id[64];
    char grpc_address[300]; /* HOST:PORT actually bound */
    char model_dir[1024];
    kr_config cfg;
    kr_tokenizer *tok; /* NULL: the model directory has no tokenizer.json */
    const rt_placement *placement;
    int prefill_chunk_given; /* --prefill-chunk; 0: take the prefill nodes' own (Status) */
    int kv_index_blocks; /* --kv-index-blocks: block hashes remembered per prefill node */
    uint32_t max_tokens_limit;
    uint32_t max_prompt; /* tokens; also capped by max_position_embeddings - 1 */
    int64_t default_timeout_ms; /* the deadline of a request whose client set none */
    int64_t max_queue_ms; /* --max-queue-ms: the longest wait for a node with room */
    const char *policy_dir; /* --policy-dir: where file-valued policy keys may point; NULL: none */
    const rt_apikeys *keys; /* NULL: no API keys: everything open */
    rt_limits *limits; /* --limit-*: streams and request rate per key (or client address) */
    size_t max_body; /* bytes of an OpenAI API request body (--max-request-bytes) */
    char served_model[256]; /* the model's name in the OpenAI API (--served-model-name) */
    kr_chat_template *chat; /* NULL: chat completions are refused with chat_error */
    char chat_error[KR_ERR_MAX];
    int64_t started_unix_ms;
    int breaker_failures; /* --breaker-failures */
    int64_t breaker_cooldown_ms; /* --breaker-cooldown-ms */
    int64_t prefill_timeout_ms; /* --prefill-timeout-ms: the cap on one Prefill call */
    int64_t decode_stall_ms; /* --decode-stall-ms: a decode stream silent this long has failed */
    int migrate; /* --migrate: a failed decode stream continues on another node */
    char fingerprint[17]; /* the router's model's, "" when not known yet (docs/failures.md) */
    int fingerprint_from_node; /* taken from the first member that reported one */
    rt_metrics m;
    kc_health *health; /* grpc.health.v1; NOT_SERVING while draining */
    grpc_channel_credentials *node_creds; /* mutual TLS to the nodes (--tls-*); NULL: plaintext */
    struct rt_auto *adaptive; /* kv_policy auto (auto.h) */

    pthread_mutex_t mu; /* the node table, the guarded parts of the nodes, and the active list */
    rt_node *nodes[RT_NODES_MAX]; /* append-only: a node's pointer stays valid until exit */
    int n_nodes;
    kc_channel *retired[RT_NODES_MAX]; /* channels replaced by an address change (freed at exit) */
    int n_retired;
    pthread_cond_t cv; /* `stopping` changed */
    int stopping; /* the poller and the watcher end */
    int draining; /* shutting down: /healthz and ClusterStatus say so */
    rt_active *active; /* Generate calls with an open decode stream (the cancel watcher's list) */
    rt_waiter *fifo_head, *fifo_tail; /* requests waiting for room, in arrival order */
    pthread_cond_t fifo_cv; /* the FIFO's head changed */
    atomic_uint_fast64_t turn[2]; /* placements made per rt_role */
    atomic_uint_fast64_t next_request; /* for generated request ids */
    atomic_int in_flight, queued; /* Generate calls being served / waiting for room */
    atomic_int http_stopping; /* shutting down: HTTP generations are cancelled */
    atomic_int http_generations; /* OpenAI API requests being served (shutdown waits for 0) */
    atomic_int prefill_chunk; /* kv-aware's block: --prefill-chunk, else the first prefill node's
                                 reported --chunk; 0 until known (prompts then placed by load) */
    pthread_t poller, watcher;
} rt_router;

/* ------------------------------------------------------------------ nodes.c */

/* Makes the node table match `ms` (the whole membership, from the --nodes file or etcd): new
 * members are added, the records of known ones replaced (a new address gets a new channel,
 * "draining" applies), nodes missing from `ms` marked GONE. Members with an id over
 * RT_NODE_ID_MAX bytes are left out with a warning. Thread-safe; `ms` is not kept. Returns 0,
 * or -1 with err (KR_ERR_MAX) when a channel cannot be made (the rest is applied). */
int rt_nodes_apply(rt_router *rt, const kc_member *ms, int n, char *err);
void rt_nodes_free(rt_router *rt);
/* Calls every node's Status at once (one thread each) with `timeout_ms`, updating what the
 * router knows; returns when all answered or failed. A node whose breaker is open is asked only
 * once its cooldown is over (the half-open probe). */
void rt_nodes_refresh(rt_router *rt, int64_t timeout_ms);
/* The poller: rt_nodes_refresh every RT_POLL_INTERVAL_MS until rt->stopping. */
void *rt_poller_main(void *arg);
/* The usable nodes of `role` (not gone, suspect or of another model, not in `skip[0, n_skip)`)
 * in the order the placement wants them tried; returns how many were written to out. */
int rt_nodes_order(rt_router *rt, rt_role role, rt_node *const *skip, int n_skip, rt_node **out);
/* rt_nodes_order for prefill nodes and the prompt cut as c (rt_chain_make; m 0: nothing to
 * match). Under kv-aware placement each node's load includes the prompt's tokens less the
 * prefix its index holds, cached[i] is that prefix of out[i] in tokens, and the placement is
 * counted by reason; otherwise cached[] is 0. */
int rt_nodes_order_prefill(rt_router *rt, const rt_chain *c, rt_node *const *skip, int n_skip, rt_node **out,
                           int *cached);
/* Records that the prompt cut as c was prefilled on prefill node n (kv-aware placement only). */
void rt_node_record_prompt(rt_router *rt, rt_node *n, const rt_chain *c);
/* The node's channel now (its address may change under membership). */
kc_channel *rt_node_channel(rt_router *rt, rt_node *n);
/* The router's own in-flight accounting (deltas, may be negative). */
void rt_node_account(rt_router *rt, rt_node *n, int64_t tokens, int64_t running, int64_t blocks);
/* The outcome of one call to the node, for its circuit breaker: UNAVAILABLE and
 * DEADLINE_EXCEEDED count as failures (except UNAVAILABLE "draining", which marks it draining),
 * anything else closes the count. */
void rt_node_outcome(rt_router *rt, rt_node *n, grpc_status_code code, const char *details);
/* /healthz: healthy while gRPC health says SERVING and at least one prefill and one decode node
 * answered its last Status. */
int rt_nodes_healthy(void *rt, char *reason, size_t cap);
/* Admin.ClusterStatus handler. */
int rt_cluster_status(kc_call *call, const ProtobufCMessage *req, void *user);

/* ------------------------------------------------------------------ openai.c */

struct MHD_Connection;
/* The HTTP port's routes besides /metrics and /healthz (a kc_http_app_fn; `user` is the router). */
int rt_openai_serve(void *user, struct MHD_Connection *conn, const char *method, const char *url, const char *body,
                    size_t len);
/* Registers kvrelay_http_responses_total in rt->m.reg. Returns 0 or -1. */
int rt_openai_metrics_init(rt_router *rt);

/* ------------------------------------------------- request.c, watch.c (request.h: the steps) */

/* Where a Generate request's events go, and how its client is watched: the gRPC call
 * (rt_generate) or an HTTP client of the OpenAI API (openai.c). Every function is thread-safe:
 * the cancel watcher calls `cancelled` from its own thread. */
/* What a sink's send returns besides 0. */
enum {
    RT_SINK_GONE = -1, /* the client went away */
    RT_SINK_FAILED = -2, /* the sink could not take the message (out of memory building the
                            response): an internal error, not the client's doing */
};

typedef struct rt_sink {
    void *ctx;
    /* Sends one GenerateResponse (a delta or the finish). 0, RT_SINK_GONE or RT_SINK_FAILED. */
    int (*send)(void *ctx, const Kvrelay__V1__GenerateResponse *msg);
    /* 1 once the client went away (or its deadline passed, or the router is stopping). */
    int (*cancelled)(void *ctx);
    /* Sleeps up to ms, waking early on cancellation; returns cancelled(). */
    int (*wait)(void *ctx, int64_t ms);
    /* Milliseconds before the client's deadline (INT64_MAX when it set none). */
    int64_t (*ms_left)(void *ctx);
} rt_sink;

/* Serves one request (validation, placement, relaying: docs/router.md) to `sink`: deltas and
 * then exactly one finish on success (OK); otherwise the status code with st. `client` (NULL:
 * not limited) is admitted by rt->limits first (a refusal is RESOURCE_EXHAUSTED with
 * client->retry_after_ms) and its slot given back before returning, whatever the outcome.
 * Counts it in the router's metrics and logs its outcome. */
grpc_status_code rt_generate_run(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, const rt_sink *sink,
                                 rt_client *client, kc_status *st);
/* Checks q as rt_generate_run would before placing it (the same validation: ids, limits such as
 * --max-prompt-tokens, the policy, sampling, stops) without serving, counting or logging it.
 * GRPC_STATUS_OK, or the code with st. For a request of several generations that must be
 * refused whole before any of them starts (openai-choices.c). */
grpc_status_code rt_generate_check(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, kc_status *st);
int rt_generate(kc_call *call, const ProtobufCMessage *req, void *user);
/* A new request id, "<router id>-<start time hex>-<n>" (for requests whose client gave none). */
void rt_request_id_new(rt_router *rt, char *out, size_t cap);
int rt_tokenize(kc_call *call, const ProtobufCMessage *req, void *user);
/* The cancel watcher: every few ms, cancels the decode stream of every active Generate call
 * whose client went away (its handler may be blocked reading that stream). Until stopping. */
void *rt_watcher_main(void *arg);

/* pthread_cond_timedwait for at most `ms` milliseconds (mu held, as the call requires). */
void rt_cond_wait_ms(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t ms);

/* Monotonic milliseconds. */
int64_t rt_now_ms(void);

/* A client's policy spec with its file-valued keys (pattern=, windows=: heads and hsft) checked
 * and resolved: a client names a file by its bare name, which must exist in `policy_dir`, and
 * the nodes are given DIR/name. Without a policy dir, file keys are refused: a remote client must
 * not make the cluster open paths of its choosing. Writes the spec to use into out (cap bytes).
 * Returns 0, or -1 with err. */
int rt_policy_resolve(const char *spec, const char *policy_dir, char *out, size_t cap, char *err, size_t err_cap);

#endif /* RT_ROUTER_H */
