/*
 * generate.c - Generation.Generate and Generation.Tokenize (the flow of docs/router.md):
 * validate and tokenize; reserve room on a decode node (placement order; RESOURCE_EXHAUSTED or
 * UNAVAILABLE -> the next node; all full -> back off until the deadline); prefill on a prefill
 * node with the reservation's transfer address (UNAVAILABLE before anything was streamed ->
 * Release and place again elsewhere); send the first token; relay the decode node's stream as
 * text deltas with stop strings matched on the text; end with Finish{reason, usage}.
 * Scoring requests (`forced`) pass their ids on instead of sampling: the first to the prefill
 * node, the rest to the decode node, and log-probabilities come back with every token
 * (docs/rpc.md); they ignore sampling and stops and always run to their last forced id.
 * Every hop gets the time left before the request's deadline. A client that goes away has its
 * decode stream cancelled by the watcher thread (the decode node frees the slot at once) and its
 * reservation Released.
 */
#include "router.h"
#include "stop.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    RT_MAX_STOPS = 16,
    RT_MAX_STOP_LEN = 256,
    RT_MAX_STOP_IDS = 64,
    RT_WATCH_MS = 20, /* how often the watcher looks for clients that went away */
    RT_BACKOFF_MIN_MS = 10,
    RT_BACKOFF_MAX_MS = 500,
    RT_RESERVE_TTL_MAX_MS = 120000,
    RT_DEADLINE_SLACK_MS = 20, /* a hop's DEADLINE_EXCEEDED this close to the request's is the request's */
};

/* A Generate call whose decode stream is open: what the watcher needs. */
struct rt_active {
    const rt_sink *sink;
    kc_stream *stream;
    _Atomic int64_t last_ms; /* rt_now_ms() of the stream's last message (or its opening) */
    atomic_int stalled; /* the watcher cancelled it: silent for --decode-stall-ms */
    rt_active *next;
};

/* One Generate request, owned by its handler thread. */
typedef struct gen_req {
    rt_router *rt;
    const rt_sink *sink; /* the client */
    char id[RT_REQUEST_ID_MAX + 1];
    int32_t *prompt; /* n_prompt, malloc'd */
    int n_prompt;
    uint32_t max_tokens;
    Kvrelay__V1__Sampling sampling; /* as forwarded: the seed always present */
    char policy[1024]; /* the client's spec ("" = full), file keys resolved (rt_policy_resolve) */
    uint64_t kv_entries_bound; /* informational, for Reserve */
    const uint32_t *stop_ids; /* borrowed; none when forcing */
    size_t n_stop_ids;
    const uint32_t *forced; /* borrowed: the ids to emit instead of sampling, max_tokens of them;
                               NULL: sample */
    int logprobs; /* relay logprobs and top_ids (always when forcing) */
    kr_detok *detok; /* NULL without a tokenizer */
    rt_stop stop;
    double t_arrival, t_first, t_last; /* seconds, monotonic */
    double queue_s; /* time spent in the admission FIFO */
    int family; /* the policy's family (kr_policy_family), for the metrics */
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
    int decode_failed; /* the decode stream failed on the node's side (st says how) */
    int reserved; /* a reservation is held on dnode */
    uint64_t reservation;
    int64_t reserved_blocks;
    char transfer_address[256];

    /* results */
    Kvrelay__V1__PrefillUsage pu; /* numbers only */
    int have_decode_finish;
    Kvrelay__V1__DecodeFinish df; /* numbers only */
    uint32_t completion;
    int stopped; /* the router itself stopped generation (stop string, or the first token) */
    Kvrelay__V1__FinishReason reason;
} gen_req;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int64_t ms_left(const gen_req *r)
{
    return r->deadline_ms - rt_now_ms();
}

/* The call is over on the client's side: its deadline passed, or it cancelled (or went away). */
static void client_gone(const gen_req *r, kc_status *st, const char *when)
{
    if (r->sink->ms_left(r->sink->ctx) <= 0)
        kc_status_set(st, GRPC_STATUS_DEADLINE_EXCEEDED, "the client's deadline passed %s", when);
    else
        kc_status_set(st, GRPC_STATUS_CANCELLED, "the client went away %s", when);
}

/* ------------------------------------------------------------------ validation */

void rt_request_id_new(rt_router *rt, char *out, size_t cap)
{
    snprintf(out, cap, "%s-%" PRIx64 "-%" PRIu64, rt->id, (uint64_t)rt->started_unix_ms,
             (uint64_t)atomic_fetch_add(&rt->next_request, 1));
}

static int utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + len > n) return 0;
        uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1f) : len == 3 ? (c & 0x0f) : (c & 0x07);
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += len;
    }
    return 1;
}

/* A seed for a request that did not give one (splitmix64 of the clock and a counter). */
static uint64_t pick_seed(rt_router *rt)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    uint64_t z = (uint64_t)t.tv_nsec ^ ((uint64_t)t.tv_sec << 30) ^ (atomic_fetch_add(&rt->next_request, 0) << 17);
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Checks and tokenizes the request into r. Returns GRPC_STATUS_OK, or a code with st set. */
static grpc_status_code validate(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, gen_req *r, kc_status *st)
{
    const kr_config *cfg = &rt->cfg;
    char err[KR_ERR_MAX];
    /* the request id first, so every later message can carry it */
    size_t idlen = strlen(q->request_id);
    if (idlen > RT_REQUEST_ID_MAX)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "request_id: %zu bytes (at most %d)", idlen, RT_REQUEST_ID_MAX), st->code;
    for (size_t i = 0; i < idlen; i++)
        if (q->request_id[i] <= ' ' || q->request_id[i] > '~')
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "request_id: byte %zu is not printable ASCII (spaces are not allowed either)", i), st->code;
    if (idlen) snprintf(r->id, sizeof r->id, "%s", q->request_id);
    else rt_request_id_new(rt, r->id, sizeof r->id);

    /* the prompt */
    if (q->prompt_case == KVRELAY__V1__GENERATE_REQUEST__PROMPT_TEXT) {
        if (!rt->tok)
            return kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION,
                              "prompt.text: the router's model %s has no tokenizer.json; send prompt.token_ids instead",
                              rt->model_dir), st->code;
        if (!q->text[0]) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.text: empty"), st->code;
        if (kr_tokenizer_encode(rt->tok, q->text, strlen(q->text), q->add_special, &r->prompt, &r->n_prompt, err) != KR_OK)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.text: %s", err), st->code;
        if (r->n_prompt == 0) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.text: no tokens"), st->code;
    } else if (q->prompt_case == KVRELAY__V1__GENERATE_REQUEST__PROMPT_TOKEN_IDS) {
        size_t n = q->token_ids->n_ids;
        if (n == 0) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt.token_ids: empty"), st->code;
        if (n > (size_t)cfg->max_position_embeddings)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "prompt.token_ids: %zu tokens exceed the model's context (max_position_embeddings %d)",
                              n, cfg->max_position_embeddings), st->code;
        r->prompt = malloc(n * sizeof *r->prompt);
        if (!r->prompt) return kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory"), st->code;
        for (size_t i = 0; i < n; i++) {
            uint32_t id = q->token_ids->ids[i];
            if (id >= (uint32_t)cfg->vocab_size)
                return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                                  "prompt.token_ids[%zu]: %u is outside the model's vocabulary [0, %d)", i, id,
                                  cfg->vocab_size), st->code;
            r->prompt[i] = (int32_t)id;
        }
        r->n_prompt = (int)n;
    } else {
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt: missing (set prompt.text or prompt.token_ids)"), st->code;
    }
    int ctx_room = cfg->max_position_embeddings - 1; /* at least one position to generate into */
    if (r->n_prompt > ctx_room)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                          "prompt: %d tokens exceed the model's context (max_position_embeddings %d leaves room for %d)",
                          r->n_prompt, cfg->max_position_embeddings, ctx_room), st->code;
    if ((uint32_t)r->n_prompt > rt->max_prompt)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "prompt: %d tokens > the router's limit %u (--max-prompt)",
                          r->n_prompt, rt->max_prompt), st->code;

    if (q->forced && q->forced->n_ids > 0) {
        /* scoring: the forced ids are the completion, so they fix its length */
        size_t n = q->forced->n_ids;
        if (q->max_tokens != 0 && q->max_tokens != n)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "max_tokens: %u, but forced has %zu ids (a forced request generates exactly its forced ids: set max_tokens to 0 or %zu)",
                              q->max_tokens, n, n), st->code;
        if (n > rt->max_tokens_limit)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "max_tokens: %zu (the length of forced) > the router's limit %u (--max-tokens-limit)", n,
                              rt->max_tokens_limit), st->code;
        if ((size_t)r->n_prompt + n > (size_t)cfg->max_position_embeddings)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "forced: %d prompt + %zu forced tokens exceed the model's context (max_position_embeddings %d)",
                              r->n_prompt, n, cfg->max_position_embeddings), st->code;
        for (size_t i = 0; i < n; i++)
            if (q->forced->ids[i] >= (uint32_t)cfg->vocab_size)
                return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                                  "forced.ids[%zu]: %u is outside the model's vocabulary [0, %d)", i, q->forced->ids[i],
                                  cfg->vocab_size), st->code;
        r->forced = q->forced->ids;
        r->max_tokens = (uint32_t)n;
    } else {
        if (q->max_tokens == 0)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "max_tokens: 0 (must be 1..%u)", rt->max_tokens_limit), st->code;
        if (q->max_tokens > rt->max_tokens_limit)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "max_tokens: %u > the router's limit %u (--max-tokens-limit)",
                              q->max_tokens, rt->max_tokens_limit), st->code;
        r->max_tokens = q->max_tokens;
    }
    r->logprobs = q->logprobs || r->forced;

    kr_policy *p;
    if (rt_policy_resolve(q->kv_policy, rt->policy_dir, r->policy, sizeof r->policy, err, sizeof err) != 0 ||
        kr_policy_parse(r->policy[0] ? r->policy : "full", cfg, &p, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "kv_policy '%.64s': %s", q->kv_policy, err), st->code;
    r->family = kr_policy_family(p);
    r->kv_entries_bound = (uint64_t)kr_policy_max_entries(p, r->n_prompt, (int)r->max_tokens) *
                          (uint64_t)cfg->n_layers * (uint64_t)cfg->n_kv_heads;
    kr_policy_free(p);

    /* sampling: absent = greedy; temperature 0 = greedy; top_p 0 = off; seed absent = ours */
    r->sampling = (Kvrelay__V1__Sampling)KVRELAY__V1__SAMPLING__INIT;
    if (q->sampling && !r->forced) { /* forcing ignores sampling: the nodes get greedy */
        r->sampling.temperature = q->sampling->temperature;
        r->sampling.top_p = q->sampling->top_p;
        r->sampling.top_k = q->sampling->top_k;
        if (q->sampling->seed_choice_case == KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED) {
            r->sampling.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
            r->sampling.seed = q->sampling->seed;
        }
    }
    if (r->sampling.seed_choice_case != KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED) {
        r->sampling.seed_choice_case = KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED;
        r->sampling.seed = pick_seed(rt);
    }
    if (r->sampling.top_k > (uint32_t)cfg->vocab_size)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "sampling.top_k: %u > the vocabulary size %d",
                          r->sampling.top_k, cfg->vocab_size), st->code;
    kr_sampling ks;
    kr_sampling_default(&ks);
    ks.temperature = r->sampling.temperature;
    ks.greedy = !(r->sampling.temperature > 0);
    ks.top_p = r->sampling.top_p == 0 ? 1.0f : r->sampling.top_p;
    ks.top_k = (int)r->sampling.top_k;
    ks.seed = r->sampling.seed;
    if (kr_sampling_check(&ks, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "%s", err), st->code; /* "sampling: ..." */

    /* stops (a forced request ignores them: it is scored to its last id) */
    size_t n_stop = r->forced ? 0 : q->n_stop;
    if (n_stop > RT_MAX_STOPS)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop: %zu strings (at most %d)", q->n_stop, RT_MAX_STOPS), st->code;
    if (n_stop && !rt->tok)
        return kc_status_set(st, GRPC_STATUS_FAILED_PRECONDITION,
                          "stop: stop strings need text, and the router's model %s has no tokenizer.json (use stop_ids)",
                          rt->model_dir), st->code;
    for (size_t i = 0; i < n_stop; i++) {
        size_t n = strlen(q->stop[i]);
        if (n == 0) return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop[%zu]: empty", i), st->code;
        if (n > RT_MAX_STOP_LEN)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop[%zu]: %zu bytes (at most %d)", i, n, RT_MAX_STOP_LEN), st->code;
        if (!utf8_valid((const unsigned char *)q->stop[i], n))
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop[%zu]: not valid UTF-8", i), st->code;
    }
    size_t n_stop_ids = r->forced ? 0 : q->n_stop_ids;
    if (n_stop_ids > RT_MAX_STOP_IDS)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop_ids: %zu ids (at most %d)", q->n_stop_ids, RT_MAX_STOP_IDS), st->code;
    for (size_t i = 0; i < n_stop_ids; i++)
        if (q->stop_ids[i] >= (uint32_t)cfg->vocab_size)
            return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "stop_ids[%zu]: %u is outside the model's vocabulary [0, %d)",
                              i, q->stop_ids[i], cfg->vocab_size), st->code;
    r->stop_ids = q->stop_ids;
    r->n_stop_ids = n_stop_ids;

    if (rt->tok && kr_detok_create(rt->tok, 1, &r->detok, err) != KR_OK)
        return kc_status_set(st, GRPC_STATUS_INTERNAL, "detokenizer: %s", err), st->code;
    if (rt_stop_init(&r->stop, q->stop, (int)n_stop) != 0)
        return kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory"), st->code;
    return GRPC_STATUS_OK;
}

/* ------------------------------------------------------------------ reserve / release */

/* What one placement attempt came to. */
typedef enum attempt {
    ATTEMPT_DONE, /* reserved / prefilled */
    ATTEMPT_AGAIN, /* a node failed and was excluded: place again at once */
    ATTEMPT_LATER, /* every candidate is full: back off, then place again */
    ATTEMPT_FAIL, /* give the client st */
} attempt;

static int64_t hop_timeout(const gen_req *r)
{
    int64_t left = ms_left(r);
    return left > 0 ? left : 1;
}

/* Frees the reservation: by Release when `call` (the stream did not end normally), and in the
 * router's own accounting always. Returns the Release's status code (OK when not called). */
static grpc_status_code reservation_end(gen_req *r, int call)
{
    if (!r->reserved) return GRPC_STATUS_OK;
    grpc_status_code code = GRPC_STATUS_OK;
    if (call) {
        Kvrelay__V1__ReleaseRequest req = KVRELAY__V1__RELEASE_REQUEST__INIT;
        req.reservation_id = r->reservation;
        req.request_id = r->id;
        Kvrelay__V1__ReleaseResponse *resp = NULL;
        kc_status st;
        if (kc_unary(rt_node_channel(r->rt, r->dnode), "/kvrelay.v1.Decode/Release", &req.base, &kvrelay__v1__release_response__descriptor,
                     RT_RELEASE_TIMEOUT_MS, (ProtobufCMessage **)&resp, &st) == 0) {
            kc_debug(r->id, "released reservation %" PRIu64 " on %s (%s)", r->reservation, r->dnode->id,
                     resp->released ? "freed" : "already gone");
            kc_message_free(&resp->base);
        } else {
            kc_warn(r->id, "release of reservation %" PRIu64 " on %s failed: %s: %s (it expires by itself)",
                    r->reservation, r->dnode->id, kc_status_name(st.code), st.details);
            code = st.code;
        }
    }
    rt_node_account(r->rt, r->dnode, 0, -1, -r->reserved_blocks);
    r->reserved = 0;
    return code;
}

static attempt reserve(gen_req *r, kc_status *st)
{
    rt_router *rt = r->rt;
    rt_node *order[RT_NODES_MAX];
    int n = rt_nodes_order(rt, RT_ROLE_DECODE, r->skip_d, r->n_skip_d, order);
    int full = 0, tried = 0;
    kc_status last = {GRPC_STATUS_UNAVAILABLE, "none is serving (gone, suspect, or failed earlier in this request)"};
    for (int k = 0; k < n; k++) {
        rt_node *node = order[k];
        tried++;
        Kvrelay__V1__ReserveRequest req = KVRELAY__V1__RESERVE_REQUEST__INIT;
        req.request_id = r->id;
        req.prompt_tokens = (uint32_t)r->n_pf;
        req.max_tokens = r->left_tokens;
        req.kv_entries = r->kv_entries_bound;
        req.kv_policy = (char *)r->policy;
        /* it must outlive the prefill (queue included), and no more: a reservation whose answer
         * was lost (the call timed out) frees itself this soon */
        int64_t ttl = ms_left(r) < rt->prefill_timeout_ms + 5000 ? ms_left(r) : rt->prefill_timeout_ms + 5000;
        req.ttl_ms = (uint32_t)(ttl < 1000 ? 1000 : ttl > RT_RESERVE_TTL_MAX_MS ? RT_RESERVE_TTL_MAX_MS : ttl);
        Kvrelay__V1__ReserveResponse *resp = NULL;
        kc_status s;
        int64_t hop = hop_timeout(r) < RT_RESERVE_TIMEOUT_MS ? hop_timeout(r) : RT_RESERVE_TIMEOUT_MS;
        int rc = kc_unary(rt_node_channel(rt, node), "/kvrelay.v1.Decode/Reserve", &req.base,
                          &kvrelay__v1__reserve_response__descriptor, hop, (ProtobufCMessage **)&resp, &s);
        rt_node_outcome(rt, node, rc == 0 ? GRPC_STATUS_OK : s.code, s.details);
        if (rc == 0) {
            r->dnode = node;
            r->reserved = 1;
            r->reservation = resp->reservation_id;
            r->reserved_blocks = (int64_t)resp->reserved_blocks;
            snprintf(r->transfer_address, sizeof r->transfer_address, "%s", resp->transfer_address);
            kc_message_free(&resp->base);
            rt_node_account(rt, node, 0, 1, r->reserved_blocks);
            kc_info(r->id, "reserved %" PRId64 " blocks on %s (reservation %" PRIu64 ", transfer %s)",
                    r->reserved_blocks, node->id, r->reservation, r->transfer_address);
            return ATTEMPT_DONE;
        }
        if (s.code == GRPC_STATUS_RESOURCE_EXHAUSTED || s.code == GRPC_STATUS_UNAVAILABLE ||
            s.code == GRPC_STATUS_OUT_OF_RANGE || (s.code == GRPC_STATUS_DEADLINE_EXCEEDED && ms_left(r) > 0)) {
            /* OUT_OF_RANGE: larger than that node's whole pool; another node may be bigger, but
             * waiting for this one would not help (only RESOURCE_EXHAUSTED makes us wait) */
            kc_debug(r->id, "decode node %s refused: %s: %s", node->id, kc_status_name(s.code), s.details);
            full |= s.code == GRPC_STATUS_RESOURCE_EXHAUSTED;
            kc_status_set(&last, s.code, "%s: %s", node->id, s.details);
            continue;
        }
        kc_status_set(st, s.code, "decode node %s: %s", node->id, s.details);
        return ATTEMPT_FAIL;
    }
    if (full) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "every decode node is full (last: %s)", last.details);
        return ATTEMPT_LATER;
    }
    kc_status_set(st, last.code == GRPC_STATUS_OUT_OF_RANGE ? GRPC_STATUS_OUT_OF_RANGE : GRPC_STATUS_UNAVAILABLE,
                  "no decode node can take the request (%d tried; last: %s)", tried, last.details);
    return ATTEMPT_FAIL;
}

static void skip_add(rt_node **skip, int *n, rt_node *node)
{
    for (int i = 0; i < *n; i++)
        if (skip[i] == node) return;
    if (*n < RT_NODES_MAX) skip[(*n)++] = node;
}

/* Prefill on the first prefill node (in placement order, not skipped) that takes it. On
 * anything but success the reservation is released. A prefill node that failed (UNAVAILABLE, or
 * no answer within --prefill-timeout-ms) is skipped from then on and the request placed again,
 * once: a second failure fails the request. When the Release fails too, the transfer's peer is
 * what died: the decode node is skipped instead, and that does not use up the retry. */
static attempt prefill(gen_req *r, Kvrelay__V1__PrefillResponse **out, kc_status *st)
{
    rt_router *rt = r->rt;
    rt_node *order[RT_NODES_MAX];
    int n = rt_nodes_order(rt, RT_ROLE_PREFILL, r->skip_p, r->n_skip_p, order);
    uint32_t *ids = malloc((size_t)r->n_pf * sizeof *ids);
    if (!ids) {
        reservation_end(r, 1);
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        return ATTEMPT_FAIL;
    }
    for (int i = 0; i < r->n_pf; i++) ids[i] = (uint32_t)r->pf[i];
    Kvrelay__V1__PrefillRequest req = KVRELAY__V1__PREFILL_REQUEST__INIT;
    req.request_id = r->id;
    req.n_token_ids = (size_t)r->n_pf;
    req.token_ids = ids;
    req.sampling = &r->sampling;
    req.kv_policy = (char *)r->policy;
    req.transfer_address = r->transfer_address;
    req.reservation_id = r->reservation;
    req.decode_node = r->dnode->id;
    if (r->forced) { /* the next id to emit: after a migration, the first not yet sent */
        req.forced_first_choice_case = KVRELAY__V1__PREFILL_REQUEST__FORCED_FIRST_CHOICE_FORCED_FIRST;
        req.forced_first = r->forced[r->completion];
    }
    req.logprobs = r->logprobs;
    int full = 0;
    attempt a = ATTEMPT_FAIL;
    kc_status last = {GRPC_STATUS_UNAVAILABLE, "none is serving (gone, suspect, or failed earlier in this request)"};
    for (int k = 0; k < n; k++) {
        rt_node *node = order[k];
        Kvrelay__V1__PrefillResponse *resp = NULL;
        kc_status s;
        int64_t left = hop_timeout(r);
        int capped = left > rt->prefill_timeout_ms;
        rt_node_account(rt, node, r->n_pf, 1, 0);
        int rc = kc_unary(rt_node_channel(rt, node), "/kvrelay.v1.Prefill/Prefill", &req.base,
                          &kvrelay__v1__prefill_response__descriptor, capped ? rt->prefill_timeout_ms : left,
                          (ProtobufCMessage **)&resp, &s);
        rt_node_account(rt, node, -r->n_pf, -1, 0);
        int timed_out = rc != 0 && s.code == GRPC_STATUS_DEADLINE_EXCEEDED && capped;
        if (rc == 0 || s.code == GRPC_STATUS_UNAVAILABLE || timed_out)
            rt_node_outcome(rt, node, rc == 0 ? GRPC_STATUS_OK : s.code, s.details);
        if (rc == 0) {
            r->pnode = node;
            *out = resp;
            free(ids);
            return ATTEMPT_DONE;
        }
        if (s.code == GRPC_STATUS_RESOURCE_EXHAUSTED || (s.code == GRPC_STATUS_UNAVAILABLE && strstr(s.details, "draining"))) {
            kc_debug(r->id, "prefill node %s refused: %s", node->id, s.details); /* the next one */
            full |= s.code == GRPC_STATUS_RESOURCE_EXHAUSTED;
            kc_status_set(&last, s.code, "%s: %s", node->id, s.details);
            continue;
        }
        if (s.code == GRPC_STATUS_UNAVAILABLE || timed_out) {
            if (timed_out) snprintf(s.details, sizeof s.details, "no answer within --prefill-timeout-ms %" PRId64, rt->prefill_timeout_ms);
            rt_node *dnode = r->dnode;
            if (reservation_end(r, 1) == GRPC_STATUS_UNAVAILABLE) {
                kc_warn(r->id, "prefill on %s failed: %s: %s; decode node %s is gone too: placing the request again",
                        node->id, kc_status_name(s.code), s.details, dnode->id);
                skip_add(r->skip_d, &r->n_skip_d, dnode);
            } else if (r->prefill_failures++ == 0) {
                kc_warn(r->id, "prefill on %s failed: %s: %s; retrying once on another prefill node", node->id,
                        kc_status_name(s.code), s.details);
                skip_add(r->skip_p, &r->n_skip_p, node);
            } else {
                kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "prefill failed twice (last on %s: %s: %s)", node->id,
                           kc_status_name(s.code), s.details);
                free(ids);
                return ATTEMPT_FAIL;
            }
            kc_counter_inc(rt->m.retries, 1);
            free(ids);
            kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "prefill node %s: %s", node->id, s.details);
            return ATTEMPT_AGAIN;
        }
        kc_status_set(st, s.code, "prefill node %s: %s", node->id, s.details);
        a = ATTEMPT_FAIL;
        goto out;
    }
    if (full) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "every prefill node's queue is full (last: %s)", last.details);
        a = ATTEMPT_LATER;
    } else {
        kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "no prefill node can take the request (last: %s)", last.details);
        a = ATTEMPT_FAIL;
    }
out:
    reservation_end(r, 1);
    free(ids);
    return a;
}

/* ------------------------------------------------------------------ admission */

/* The admission FIFO (docs/router.md, "Admission"): a request that finds no node with room
 * waits here, in arrival order, and only the first one tries to place itself, so that no
 * request overtakes an earlier one; a request that arrives while others wait joins the end at
 * once. Re-placements after a failure (--migrate) are admitted already and do not queue. The
 * list is guarded by rt->mu; fifo_cv wakes the waiters when the head changes. */
struct rt_waiter {
    rt_waiter *next;
    int64_t since_ms; /* rt_now_ms() at joining */
};

static void fifo_join(rt_router *rt, rt_waiter *w)
{
    w->next = NULL;
    w->since_ms = rt_now_ms();
    pthread_mutex_lock(&rt->mu);
    if (rt->fifo_tail) rt->fifo_tail->next = w;
    else rt->fifo_head = w;
    rt->fifo_tail = w;
    pthread_mutex_unlock(&rt->mu);
    atomic_fetch_add(&rt->queued, 1);
    kc_gauge_inc(rt->m.queued, 1);
}

static void fifo_leave(rt_router *rt, rt_waiter *w)
{
    pthread_mutex_lock(&rt->mu);
    rt_waiter *prev = NULL;
    for (rt_waiter *it = rt->fifo_head; it; prev = it, it = it->next)
        if (it == w) {
            if (prev) prev->next = w->next;
            else rt->fifo_head = w->next;
            if (rt->fifo_tail == w) rt->fifo_tail = prev;
            break;
        }
    pthread_cond_broadcast(&rt->fifo_cv);
    pthread_mutex_unlock(&rt->mu);
    kc_gauge_inc(rt->m.queued, -1);
    atomic_fetch_sub(&rt->queued, 1);
}

/* Waits (at most RT_WATCH_MS) until w heads the FIFO; returns 1 when it does. */
static int fifo_wait_turn(rt_router *rt, rt_waiter *w)
{
    pthread_mutex_lock(&rt->mu);
    if (rt->fifo_head != w) rt_cond_wait_ms(&rt->fifo_cv, &rt->mu, RT_WATCH_MS);
    int head = rt->fifo_head == w;
    pthread_mutex_unlock(&rt->mu);
    return head;
}

static int fifo_busy(rt_router *rt)
{
    pthread_mutex_lock(&rt->mu);
    int busy = rt->fifo_head != NULL;
    pthread_mutex_unlock(&rt->mu);
    return busy;
}

/* Reserve + prefill, retried as docs/router.md and docs/failures.md say, in the admission FIFO
 * while there is no room, until done, the deadline or --max-queue-ms. */
static grpc_status_code place(gen_req *r, Kvrelay__V1__PrefillResponse **out, kc_status *st)
{
    rt_router *rt = r->rt;
    int64_t backoff = RT_BACKOFF_MIN_MS;
    rt_waiter w;
    int queued = 0, may_queue = r->migrations == 0;
    grpc_status_code code;
    r->prefill_failures = 0;
    for (;;) {
        if (r->sink->cancelled(r->sink->ctx)) {
            client_gone(r, st, "before the request was placed");
            code = st->code;
            break;
        }
        if (!queued && may_queue && fifo_busy(rt)) { /* others wait already: behind them */
            fifo_join(rt, &w);
            queued = 1;
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "requests before it are waiting for room");
        }
        int64_t waited = queued ? rt_now_ms() - w.since_ms : 0;
        if (queued && (ms_left(r) <= 0 || waited > rt->max_queue_ms)) {
            char why[sizeof st->details];
            snprintf(why, sizeof why, "%s", st->details);
            if (ms_left(r) <= 0)
                kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s; gave up at the request's deadline", why);
            else
                kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s; gave up after %" PRId64 " ms (--max-queue-ms)",
                              why, waited);
            code = st->code;
            break;
        }
        if (queued && !fifo_wait_turn(rt, &w)) continue; /* an earlier request goes first */
        attempt a = reserve(r, st);
        if (a == ATTEMPT_DONE) a = prefill(r, out, st);
        if (a == ATTEMPT_DONE) {
            code = GRPC_STATUS_OK;
            break;
        }
        if (a == ATTEMPT_FAIL) {
            code = st->code;
            break;
        }
        if (a == ATTEMPT_AGAIN) continue;
        /* every node is full: the head of the FIFO waits (waking early if the client goes away)
         * and tries again; the deadline and --max-queue-ms are checked above */
        if (!queued && may_queue) {
            fifo_join(rt, &w);
            queued = 1;
        }
        int64_t left = ms_left(r), wait = backoff < left ? backoff : left > 0 ? left : 0;
        kc_debug(r->id, "%s; retrying in %" PRId64 " ms", st->details, wait);
        if (!queued && wait <= 0) { /* a re-placement: no FIFO, the deadline only */
            char why[sizeof st->details];
            snprintf(why, sizeof why, "%s", st->details);
            kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "%s; gave up at the request's deadline", why);
            code = st->code;
            break;
        }
        r->sink->wait(r->sink->ctx, wait);
        backoff = backoff * 2 > RT_BACKOFF_MAX_MS ? RT_BACKOFF_MAX_MS : backoff * 2;
    }
    if (queued) {
        r->queue_s += (double)(rt_now_ms() - w.since_ms) / 1000.0;
        fifo_leave(rt, &w);
    }
    return code;
}

/* ------------------------------------------------------------------ relaying tokens */

static int is_stop_id(const gen_req *r, uint32_t id)
{
    for (size_t i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == id) return 1;
    return 0;
}

/* Sends ids[0, n) to the client with the text they complete, cut at a stop string, and with
 * r->logprobs their lps[0, n) and tops[0, n). Returns 0, 1 when a stop string matched (later
 * ids are dropped; r->stopped set), -1 when the client is gone (st CANCELLED) or the
 * detokenizer failed (st INTERNAL). */
static int relay(gen_req *r, const uint32_t *ids, const float *lps, const uint32_t *tops, size_t n, kc_status *st)
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
        int m = rt_stop_push(&r->stop, delta, dlen, &emit, &elen);
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
    }
    Kvrelay__V1__GenerateResponse msg = KVRELAY__V1__GENERATE_RESPONSE__INIT;
    msg.event_case = KVRELAY__V1__GENERATE_RESPONSE__EVENT_DELTA;
    msg.delta = &delta;
    int sent = r->sink->send(r->sink->ctx, &msg);
    free(text);
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
    memcpy(r->sent + r->n_sent, ids, kept * sizeof *ids);
    r->n_sent += kept;
    r->t_last = now_s();
    if (sent != 0) {
        client_gone(r, st, "while tokens were streamed");
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
static int relay_flush(gen_req *r, kc_status *st)
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
        if (r->sink->send(r->sink->ctx, &msg) != 0) {
            client_gone(r, st, "before the last text");
            rc = -1;
        }
    }
    free(text);
    return rc;
}

/* ------------------------------------------------------------------ the decode stream */

static void active_add(rt_router *rt, rt_active *a)
{
    pthread_mutex_lock(&rt->mu);
    a->next = rt->active;
    rt->active = a;
    pthread_mutex_unlock(&rt->mu);
}

static void active_remove(rt_router *rt, rt_active *a)
{
    pthread_mutex_lock(&rt->mu);
    for (rt_active **p = &rt->active; *p; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    pthread_mutex_unlock(&rt->mu);
}

void rt_cond_wait_ms(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t ms)
{
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += ms / 1000;
    until.tv_nsec += (ms % 1000) * 1000000L;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(cv, mu, &until);
}

void *rt_watcher_main(void *arg)
{
    rt_router *rt = arg;
    pthread_mutex_lock(&rt->mu);
    while (!rt->stopping) {
        int64_t now = rt_now_ms();
        for (rt_active *a = rt->active; a; a = a->next) {
            if (a->sink->cancelled(a->sink->ctx)) kc_stream_cancel(a->stream); /* idempotent */
            else if (now - atomic_load(&a->last_ms) > rt->decode_stall_ms && !atomic_exchange(&a->stalled, 1))
                kc_stream_cancel(a->stream); /* a frozen node keeps its socket open: give up on it */
        }
        rt_cond_wait_ms(&rt->cv, &rt->mu, RT_WATCH_MS);
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}

/* Opens the decode stream and relays it until its finish, a stop string or an error. */
static grpc_status_code decode(gen_req *r, kc_status *st)
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
    kc_stream *s;
    kc_status s_st;
    r->decode_failed = 0;
    if (kc_stream_open(rt_node_channel(r->rt, r->dnode), "/kvrelay.v1.Decode/Decode", &req.base, hop_timeout(r), &s,
                       &s_st) != 0) {
        kc_status_set(st, s_st.code, "decode node %s: %s", r->dnode->id, s_st.details);
        reservation_end(r, 1);
        return st->code;
    }
    rt_active active = {.sink = r->sink, .stream = s};
    atomic_init(&active.last_ms, rt_now_ms());
    atomic_init(&active.stalled, 0);
    active_add(r->rt, &active);
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
            if (r->sink->cancelled(r->sink->ctx)) {
                client_gone(r, st, "while tokens were streamed");
            } else if (s_st.code == GRPC_STATUS_DEADLINE_EXCEEDED && ms_left(r) <= RT_DEADLINE_SLACK_MS) {
                /* the stream's deadline is the request's (--default-timeout-ms when the client set
                 * none): the request ran out of time, the node did not fail */
                kc_status_set(st, GRPC_STATUS_DEADLINE_EXCEEDED, "the request's deadline passed after %u tokens were sent",
                              r->completion);
            } else if (atomic_load(&active.stalled) || s_st.code == GRPC_STATUS_UNAVAILABLE ||
                       s_st.code == GRPC_STATUS_DEADLINE_EXCEEDED) {
                char cause[300];
                if (atomic_load(&active.stalled))
                    snprintf(cause, sizeof cause, "no message for %" PRId64 " ms (--decode-stall-ms)", r->rt->decode_stall_ms);
                else snprintf(cause, sizeof cause, "%s: %s", kc_status_name(s_st.code), s_st.details);
                kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "decode node %s failed after %u tokens were sent: %s",
                           r->dnode->id, r->completion, cause);
                rt_node_outcome(r->rt, r->dnode, atomic_load(&active.stalled) ? GRPC_STATUS_DEADLINE_EXCEEDED : s_st.code, cause);
                r->decode_failed = 1;
            } else {
                kc_status_set(st, s_st.code, "decode node %s: %s", r->dnode->id, s_st.details);
            }
            code = st->code;
            break;
        }
        atomic_store(&active.last_ms, rt_now_ms());
        if (m->event_case == KVRELAY__V1__DECODE_RESPONSE__EVENT_TOKENS && !r->have_decode_finish) {
            const Kvrelay__V1__DecodeTokens *t = m->tokens;
            if (r->logprobs && (t->n_logprobs != t->n_ids || t->n_top_ids != t->n_ids)) {
                kc_stream_cancel(s);
                kc_status_set(st, GRPC_STATUS_INTERNAL, "decode node %s sent %zu logprobs and %zu top_ids for %zu ids",
                              r->dnode->id, t->n_logprobs, t->n_top_ids, t->n_ids);
                code = st->code;
                kc_message_free(&m->base);
                break;
            }
            int k = relay(r, t->ids, t->logprobs, t->top_ids, t->n_ids, st);
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
    active_remove(r->rt, &active);
    kc_stream_close(s);
    /* a stream that ended with its finish has freed the reservation on the node; otherwise
     * Release it (idempotent) so the blocks come back even if the cancel did not arrive. Not on
     * a failed node: it is dead (the Release would fail) or frozen (it would wait), and the
     * cancelled stream frees the sequence when it wakes up. */
    reservation_end(r, !r->decode_failed && !(code == GRPC_STATUS_OK && r->have_decode_finish && !r->stopped));
    return code;
}

/* ------------------------------------------------------------------ Generate */

static void send_finish(gen_req *r)
{
    rt_router *rt = r->rt;
    Kvrelay__V1__ServedBy by = KVRELAY__V1__SERVED_BY__INIT;
    by.prefill_node = r->pnode->id;
    by.decode_node = r->dnode->id;
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
    u.queue_s = r->queue_s;
    u.served_by = &by;
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
    kc_info(r->id, "finished: %s, %u prompt + %u completion tokens, ttft %.4f s (queued %.4f s), tpot %.4f s, "
            "kv footprint %.3f, %" PRIu64 " bytes shipped, %s -> %s, %d migrations",
            (unsigned)r->reason < 5 ? reasons[r->reason] : "?", u.prompt_tokens, u.completion_tokens, u.ttft_s,
            u.queue_s, u.tpot_s, u.kv_footprint, u.kv_bytes_shipped, r->pnode->id, r->dnode->id, r->migrations);
}

/* Places r->pf (reserve + prefill) and relays the prefill's first token. Returns OK with *done
 * set when generation is over already (EOS, a stop id or string, the last token allowed). */
static grpc_status_code start(gen_req *r, int *done, kc_status *st)
{
    rt_router *rt = r->rt;
    Kvrelay__V1__PrefillResponse *pr = NULL;
    grpc_status_code code = place(r, &pr, st);
    if (code != GRPC_STATUS_OK) return code;
    const Kvrelay__V1__PrefillUsage *u = pr->usage;
    if (u) { /* summed over a migration's prefills */
        r->pu.footprint_attended += u->footprint_attended;
        r->pu.footprint_full += u->footprint_full;
        if (u->peak_kv_entries > r->pu.peak_kv_entries) r->pu.peak_kv_entries = u->peak_kv_entries;
        r->pu.kv_bytes_shipped += u->kv_bytes_shipped;
        r->pu.kv_entries_shipped += u->kv_entries_shipped;
        r->pu.transfer_s = u->transfer_s;
        kc_counter_inc(rt->m.kv_bytes_shipped, (double)u->kv_bytes_shipped); /* shipped, whatever follows */
    }
    uint32_t first = pr->first_token, first_top = pr->first_top_id;
    float first_lp = pr->first_logprob;
    kc_message_free(&pr->base);
    kc_info(r->id, "prefilled %d tokens on %s: first token %u, %" PRIu64 " KV entries shipped to %s in %.4f s", r->n_pf,
            r->pnode->id, first, r->pu.kv_entries_shipped, r->dnode->id, r->pu.transfer_s);
    if (first >= (uint32_t)rt->cfg.vocab_size) {
        reservation_end(r, 1);
        kc_status_set(st, GRPC_STATUS_INTERNAL, "prefill node %s sent first token %u, outside the vocabulary", r->pnode->id, first);
        return st->code;
    }
    if (r->forced && first != r->forced[r->completion]) {
        reservation_end(r, 1);
        kc_status_set(st, GRPC_STATUS_INTERNAL, "prefill node %s sent first token %u, not the forced %u (a node without forcing?)",
                      r->pnode->id, first, r->forced[r->completion]);
        return st->code;
    }
    int k = relay(r, &first, &first_lp, &first_top, 1, st);
    if (r->t_first == 0) { /* the first token goes out now: TTFT ends here */
        r->t_first = r->t_last;
        kc_histogram_observe(rt->m.ttft[r->family], r->t_first - r->t_arrival);
    }
    if (k < 0) {
        reservation_end(r, 1);
        return st->code;
    }
    *done = k == 1;
    if (!*done && !r->forced && (int32_t)first == rt->cfg.eos_token_id) { /* forcing scores past EOS */
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_EOS;
        *done = 1;
    } else if (!*done && is_stop_id(r, first)) {
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_STOP;
        *done = 1;
    } else if (!*done && r->left_tokens == 1) {
        r->reason = KVRELAY__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        *done = 1;
    }
    if (*done) {
        r->stopped = 1;
        reservation_end(r, 1); /* the bundle was shipped to the reservation: free it */
    }
    return GRPC_STATUS_OK;
}

/* --migrate: the decode stream failed; continue on another decode node by prefilling the prompt
 * and every token sent so far (docs/failures.md). Returns 0 when the request can go on. */
static int migrate(gen_req *r, kc_status *st)
{
    if (r->completion >= r->max_tokens || ms_left(r) <= 0 || r->sink->cancelled(r->sink->ctx)) return -1;
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
    skip_add(r->skip_d, &r->n_skip_d, r->dnode);
    r->have_decode_finish = 0;
    r->migrations++;
    kc_warn(r->id, "migrating: %s; re-prefilling %d tokens for the %u still to generate", st->details, r->n_pf,
            r->left_tokens);
    return 0;
}

/* Everything after validation. */
static grpc_status_code serve(gen_req *r, kc_status *st)
{
    r->pf = r->prompt;
    r->n_pf = r->n_prompt;
    r->left_tokens = r->max_tokens;
    for (;;) {
        int done = 0;
        grpc_status_code code = start(r, &done, st);
        if (code != GRPC_STATUS_OK) return code;
        if (done) break;
        code = decode(r, st);
        if (code == GRPC_STATUS_OK) break;
        if (!r->decode_failed || !r->rt->migrate || migrate(r, st) != 0) return code;
    }
    if (relay_flush(r, st) != 0) return st->code;
    send_finish(r);
    return GRPC_STATUS_OK;
}

grpc_status_code rt_generate_run(rt_router *rt, const Kvrelay__V1__GenerateRequest *q, const rt_sink *sink, kc_status *st)
{
    gen_req *r = calloc(1, sizeof *r);
    if (!r) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        kc_counter_inc(rt->m.requests[GRPC_STATUS_RESOURCE_EXHAUSTED], 1);
        return st->code;
    }
    r->rt = rt;
    r->sink = sink;
    r->t_arrival = now_s();
    int64_t left = sink->ms_left(sink->ctx);
    r->deadline_ms = rt_now_ms() + (left < rt->default_timeout_ms ? left : rt->default_timeout_ms);
    atomic_fetch_add(&rt->in_flight, 1);
    kc_gauge_inc(rt->m.in_flight, 1);

    *st = (kc_status){GRPC_STATUS_OK, ""};
    grpc_status_code code = validate(rt, q, r, st);
    if (code == GRPC_STATUS_OK) {
        kc_counter_inc(rt->m.prompt_tokens, r->n_prompt);
        kc_info(r->id, "accepted: %d prompt tokens, max_tokens %u%s%s, kv_policy '%s', %zu stop strings, %zu stop ids",
                r->n_prompt, r->max_tokens, r->forced ? " (forced)" : "", r->logprobs ? ", logprobs" : "",
                r->policy[0] ? r->policy : "full", r->forced ? (size_t)0 : q->n_stop, r->n_stop_ids);
        code = serve(r, st);
    }
    if (code != GRPC_STATUS_OK) {
        if (code == GRPC_STATUS_CANCELLED) kc_info(r->id[0] ? r->id : NULL, "CANCELLED: %s", st->details);
        else kc_warn(r->id[0] ? r->id : NULL, "%s: %s", kc_status_name(code), st->details);
    }
    kc_counter_inc(rt->m.requests[(unsigned)code <= GRPC_STATUS_UNAUTHENTICATED ? code : GRPC_STATUS_UNKNOWN], 1);
    kc_gauge_inc(rt->m.in_flight, -1);
    atomic_fetch_sub(&rt->in_flight, 1);
    rt_stop_free(&r->stop);
    kr_detok_free(r->detok);
    if (r->pf != r->prompt) free(r->pf);
    free(r->prompt);
    free(r->sent);
    free(r);
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
    const rt_sink sink = {.ctx = call, .send = call_send, .cancelled = call_cancelled, .wait = call_wait,
                          .ms_left = call_ms_left};
    kc_status st;
    grpc_status_code code = rt_generate_run(user, (const void *)req, &sink, &st);
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
