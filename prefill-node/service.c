/*
 * service.c - kvrelay-prefill's gRPC methods (prefill.h): Prefill.Prefill validates a request
 * field by field (INVALID_ARGUMENT naming the field and value), queues it as a job and answers
 * with the worker's outcome; Prefill.Status reports the node's load. Also the policy cache and
 * the node's Prometheus metrics (docs/prefill-node.md lists them).
 */
#include "prefill.h"

#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "kvrelay/v1/internal.pb-c.h"
#include "flags.h"
#include "log.h"
#include "penalties.h"
#include "rma-rows.h"

#define PF_POLICY_CACHE 64 /* parsed specs kept; more distinct specs are parsed per request */

struct pf_policy_entry {
    char *spec; /* as the request spelled it */
    kr_policy *policy;
    pf_policy_entry *next;
};

/* The codes Prefill answers with, each a series of kvrelay_requests_total. */
const kt_dtype pf_wire_dtypes[PF_N_WIRE] = {KT_DTYPE_F32, KT_DTYPE_BF16, KT_DTYPE_F16,
                                            KT_DTYPE_INT8_TOKEN, KT_DTYPE_FP8_E4M3_TOKEN};

static const grpc_status_code pf_codes[] = {
    GRPC_STATUS_OK,
    GRPC_STATUS_INVALID_ARGUMENT,
    GRPC_STATUS_RESOURCE_EXHAUSTED,
    GRPC_STATUS_FAILED_PRECONDITION,
    GRPC_STATUS_UNAVAILABLE,
    GRPC_STATUS_DEADLINE_EXCEEDED,
    GRPC_STATUS_CANCELLED,
    GRPC_STATUS_INTERNAL,
};

/* Names and meanings: docs/observability.md (the naming standard); kvrelay_prefill_seconds and
 * kvrelay_kv_entries_shipped_total are this node's additions. */
int pf_metrics_register(pf_node *n)
{
    pf_metrics *m = &n->metrics;
    kc_registry *r = n->reg;
    for (size_t i = 0; i < sizeof pf_codes / sizeof pf_codes[0]; i++) {
        char label[64];
        snprintf(label, sizeof label, "status=\"%s\"", kc_status_name(pf_codes[i]));
        m->requests[pf_codes[i]] = kc_counter_add(
            r, "kvrelay_requests_total", "Prefill calls finished, by final gRPC status.", label);
        if (!m->requests[pf_codes[i]]) return -1;
    }
    m->prompt_tokens = kc_counter_add(r, "kvrelay_prompt_tokens_total",
                                      "Prompt tokens prefilled by calls answered OK.", NULL);
    m->kv_entries = kc_counter_add(r, "kvrelay_kv_entries_shipped_total",
                                   "KV entries (one position of one layer and KV head) in the "
                                   "bundles sent.",
                                   NULL);
    for (int w = 0; w < PF_N_WIRE; w++) {
        char label[64];
        snprintf(label, sizeof label, "wire_dtype=\"%s\"", kt_dtype_name(pf_wire_dtypes[w]));
        m->kv_bytes[w] = kc_counter_add(r, "kvrelay_kv_bytes_shipped_total",
                                        "K and V payload bytes of the KV bundles sent, by payload "
                                        "dtype (entries x 2 x (head_dim x element size + 4 for a "
                                        "quantized row's scale); framing not counted).",
                                        label);
        if (!m->kv_bytes[w]) return -1;
    }
    m->prefill_s = kc_histogram_add(r, "kvrelay_prefill_seconds",
                                    "One call's chunked prefill, first-token sampling and bundle "
                                    "writing, for calls answered OK.",
                                    NULL, kc_latency_buckets, kc_n_latency_buckets);
    m->transfer_s = kc_histogram_add(r, "kvrelay_kv_transfer_seconds",
                                     "What one bundle's transfer adds after the prefill: from "
                                     "the end of the prefill to the decode node's acknowledgement "
                                     "of the last part (parts sent while later layers computed "
                                     "are hidden behind them).",
                                     NULL, kc_latency_buckets, kc_n_latency_buckets);
    static const char *const phases[2] = {"phase=\"during_prefill\"", "phase=\"after_prefill\""};
    for (int i = 0; i < 2; i++) {
        m->parts[i] = kc_counter_add(r, "kvrelay_kv_parts_sent_total",
                                     "Parts of the KV bundles of calls answered OK (layer segments "
                                     "of a pipelined transfer, or whole bundles), by whether the "
                                     "decode node acknowledged them before the prefill ended.",
                                     phases[i]);
        if (!m->parts[i]) return -1;
    }
    m->queue_depth =
        kc_gauge_add(r, "kvrelay_queue_depth",
                     "Prefill requests waiting in the FIFO behind the running one.", NULL);
    m->running = kc_gauge_add(r, "kvrelay_running_sequences",
                              "Sequences being prefilled now (0 or 1).", NULL);
    m->blocks_used = kc_gauge_add(r, "kvrelay_kv_blocks_used",
                                  "KV pool blocks held by the sequence being prefilled.", NULL);
    m->blocks_free = kc_gauge_add(r, "kvrelay_kv_blocks_free", "KV pool blocks free.", NULL);
    return m->prompt_tokens && m->kv_entries && m->prefill_s && m->transfer_s &&
                   m->queue_depth && m->running && m->blocks_used && m->blocks_free
               ? 0
               : -1;
}

static void count(pf_node *n, grpc_status_code code)
{
    kc_counter *c = code >= 0 && code < PF_N_CODES ? n->metrics.requests[code] : NULL;
    kc_counter_inc(c ? c : n->metrics.requests[GRPC_STATUS_INTERNAL], 1);
}

/* Refuses the call with `code`: logs it, counts it, records the details, returns the code. */
static int refuse(pf_node *n, kc_call *call, const char *rid, grpc_status_code code,
                  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static int refuse(pf_node *n, kc_call *call, const char *rid, grpc_status_code code,
                  const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kc_warn(rid, "Prefill refused: %s: %s", kc_status_name(code), msg);
    count(n, code);
    return kc_call_error(call, code, "%s", msg);
}

/* The parsed policy for `spec` ("" = full): cached, or when the cache is full parsed into
 * *owned (the caller frees it after the job). NULL with err on a bad spec. Parsing happens under
 * the cache's lock, so two handlers never parse and insert the same spec twice. */
static const kr_policy *policy_get(pf_node *n, const char *spec, kr_policy **owned, char *err)
{
    if (!*spec) spec = "full";
    const kr_policy *found = NULL;
    pthread_mutex_lock(&n->policy_mu);
    for (pf_policy_entry *e = n->policies; e && !found; e = e->next)
        if (!strcmp(e->spec, spec)) found = e->policy;
    kr_policy *p = NULL;
    if (!found && kr_policy_parse(spec, n->mcfg, &p, err) == KR_OK) {
        /* bad specs are never cached: a client cannot fill the cache with them */
        pf_policy_entry *e = n->n_policies < PF_POLICY_CACHE ? malloc(sizeof *e) : NULL;
        char *copy = e ? strdup(spec) : NULL;
        if (e && copy) {
            *e = (pf_policy_entry){.spec = copy, .policy = p, .next = n->policies};
            n->policies = e;
            n->n_policies++;
        } else {
            free(e);
            *owned = p;
        }
        found = p;
    }
    pthread_mutex_unlock(&n->policy_mu);
    return found;
}

void pf_service_free(pf_node *n)
{
    for (pf_policy_entry *e = n->policies, *next; e; e = next) {
        next = e->next;
        kr_policy_free(e->policy);
        free(e->spec);
        free(e);
    }
    n->policies = NULL;
    n->n_policies = 0;
    pthread_mutex_destroy(&n->policy_mu);
}

static uint64_t random_seed(void)
{
    uint64_t s;
    if (getrandom(&s, sizeof s, GRND_NONBLOCK) == (ssize_t)sizeof s) return s;
    struct timespec ts; /* no entropy yet (early boot): the clock will do for sampling */
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000007u ^ (uint64_t)ts.tv_nsec;
}

/* The first draw's penalties and min_tokens' mask (the decode node draws every later token under
 * the same rules): the last completion_tokens of the prompt are the completion so far. */
static int draw_rules(const kr_config *c, const Kvrelay__V1__PrefillRequest *req, pf_job *j, char *err)
{
    if (req->completion_tokens > req->n_token_ids) {
        snprintf(err, KR_ERR_MAX, "completion_tokens: %u of %zu token_ids", req->completion_tokens,
                 req->n_token_ids);
        return -1;
    }
    if (req->n_stop_ids > PF_MAX_STOP_IDS) {
        snprintf(err, KR_ERR_MAX, "stop_ids: %zu ids (at most %d)", req->n_stop_ids, PF_MAX_STOP_IDS);
        return -1;
    }
    for (size_t i = 0; i < req->n_stop_ids; i++) {
        if (req->stop_ids[i] >= (uint32_t)c->vocab_size) {
            snprintf(err, KR_ERR_MAX, "stop_ids[%zu]: id %u is outside the model's vocabulary [0, %d)", i,
                     req->stop_ids[i], c->vocab_size);
            return -1;
        }
        j->stop_ids[i] = (int32_t)req->stop_ids[i];
    }
    j->mask = (kr_draw_mask){.on = req->completion_tokens < req->min_tokens,
                             .eos = req->ignore_eos ? -1 : c->eos_token_id,
                             .stop = j->stop_ids,
                             .n_stop = (int)req->n_stop_ids};
    kr_penalties p;
    if (kc_penalties_from_pb(req->sampling, &p, err) != 0) return -1;
    size_t n_prompt = req->n_token_ids - req->completion_tokens;
    /* ids outside the vocabulary are refused with the token_ids check before this */
    return kc_penalty_state_make(&p, c->vocab_size, req->token_ids, n_prompt, req->token_ids + n_prompt,
                                 req->completion_tokens, &j->pen, err);
}

/* The bundle's destination: the reservation and how to reach it (Decode.Reserve's, passed on). */
static int validate_transfer(pf_node *n, kc_call *call, const Kvrelay__V1__PrefillRequest *req, pf_job *j)
{
    const char *rid = j->request_id;
    kc_hostport hp;
    char why[200];
    if (kc_hostport_parse(NULL, req->transfer_address, KC_HOSTPORT_NO_IPV6, &hp, why, sizeof why) != 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "transfer_address '%.128s' is not HOST:PORT (port 1..65535): %s",
                      req->transfer_address, why);
    snprintf(j->host, sizeof j->host, "%s", hp.host);
    j->port = (uint16_t)hp.port;
    if (req->reservation_id == 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "reservation_id: 0 is not a reservation (Decode.Reserve never returns 0)");
    j->reservation_id = req->reservation_id;
    if (req->reservation_token.len != KT_RESV_TOKEN_BYTES)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "reservation_token: %zu bytes, want %d (Decode.Reserve's, passed on as is)",
                      req->reservation_token.len, KT_RESV_TOKEN_BYTES);
    memcpy(j->reservation_token, req->reservation_token.data, KT_RESV_TOKEN_BYTES);
    if (req->rma_key.len > KT_RMA_KEY_MAX || (req->rma_key.len && !req->rma_address))
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "rma_key: %zu bytes at address %" PRIu64 ", want at most %d at a nonzero "
                      "address (Decode.Reserve's, passed on as is)",
                      req->rma_key.len, req->rma_address, KT_RMA_KEY_MAX);
    j->rma.address = req->rma_address;
    j->rma.rkey_len = (uint32_t)req->rma_key.len;
    if (req->rma_key.len) memcpy(j->rma.rkey, req->rma_key.data, req->rma_key.len);
    const Kvrelay__V1__RmaRows *rr = req->rma_rows;
    if (kc_rma_rows_from_pb(rr, &j->rma_rows) != 0 || (j->rma_rows.bytes && !req->rma_key.len))
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "rma_rows: keys of %zu and %zu bytes at addresses %" PRIu64 " and %" PRIu64
                      ", want 1..%d bytes each at nonzero addresses, with an rma_key "
                      "(Decode.Reserve's, passed on as is)",
                      rr->k_key.len, rr->v_key.len, rr->k_address, rr->v_address, KT_RMA_KEY_MAX);

    return GRPC_STATUS_OK;
}

/* Structured output: the response_format compiled (the router checked it; a node of another
 * version may still refuse it) into j->gseq, its matcher fed the completion's tokens from
 * earlier placements, the last completion_tokens of the prompt. */
static int check_format(pf_node *n, kc_call *call, const Kvrelay__V1__PrefillRequest *req,
                        pf_job *j)
{
    const char *rf = req->response_format ? req->response_format : "", *rid = j->request_id;
    if (!*rf)
        return GRPC_STATUS_OK;
    if (!n->gvocab)
        return refuse(n, call, rid, GRPC_STATUS_FAILED_PRECONDITION,
                      "response_format: this node has no vocabulary: %.400s", n->gvocab_err);
    if (j->forced_first >= 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "response_format: not with forced_first");
    if (req->completion_tokens >= (uint32_t)j->n_tokens)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "completion_tokens: %u of the %d token_ids (the prompt needs one at least)",
                      req->completion_tokens, j->n_tokens);
    char err[KR_ERR_MAX];
    if (kr_grammar_seq_create(n->gvocab, rf, strlen(rf),
                              j->tokens + j->n_tokens - req->completion_tokens, req->completion_tokens,
                              &j->gseq, err) != 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT, "response_format: %s", err);
    j->gbudget = req->max_tokens;
    return GRPC_STATUS_OK;
}

/* Validates `req` into `j` (tokens into *tokens, a policy the cache did not take into *owned).
 * Returns GRPC_STATUS_OK or the refusal's code (already recorded on the call). */
static int validate(pf_node *n, kc_call *call, const Kvrelay__V1__PrefillRequest *req, pf_job *j,
                    int32_t **tokens, kr_policy **owned)
{
    const kr_config *c = n->mcfg;
    const char *rid = j->request_id;
    size_t nt = req->n_token_ids;
    if (nt == 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT, "token_ids: the prompt is empty");
    if (nt > (size_t)n->cfg->max_prompt) /* main.c keeps --max-prompt inside the context */
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "token_ids: %zu tokens exceed this node's --max-prompt %d (the model's "
                      "context: max_position_embeddings %d - 1)",
                      nt, n->cfg->max_prompt, c->max_position_embeddings);
    for (size_t i = 0; i < nt; i++)
        if (req->token_ids[i] >= (uint32_t)c->vocab_size)
            return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                          "token_ids[%zu]: id %u is outside the model's vocabulary [0, %d)", i,
                          req->token_ids[i], c->vocab_size);

    char err[KR_ERR_MAX];
    j->policy = policy_get(n, req->kv_policy, owned, err);
    if (!j->policy)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT, "kv_policy '%.64s': %s",
                      req->kv_policy, err);
    if (strlen(kr_policy_spec(j->policy)) > KT_BUNDLE_MAX_POLICY)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "kv_policy: the canonical spec is longer than the bundle's %d bytes",
                      KT_BUNDLE_MAX_POLICY);

    j->wire = n->cfg->kv_dtype;
    if (req->kv_wire_dtype && *req->kv_wire_dtype && kt_dtype_parse(req->kv_wire_dtype, &j->wire) != 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "kv_wire_dtype '%.32s' is not one of f32, bf16, f16, int8, fp8", req->kv_wire_dtype);
    if (req->kv_block_rows > KT_BUNDLE_MAX_BLOCK_ROWS)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "kv_block_rows: %u, want at most %d (Decode.Reserve's, passed on as is)",
                      req->kv_block_rows, KT_BUNDLE_MAX_BLOCK_ROWS);
    kt_dtype block_dtype = j->wire;
    if (req->kv_block_dtype && *req->kv_block_dtype && kt_dtype_parse(req->kv_block_dtype, &block_dtype) != 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "kv_block_dtype '%.32s' is not one of f32, bf16, f16 (Decode.Reserve's, passed on as is)",
                      req->kv_block_dtype);
    /* Rows of another dtype than the decode node's blocks (quantized ones included: it
     * dequantizes them) cannot land in them: packed, and converted there. */
    j->block_rows = block_dtype != j->wire || kt_dtype_quantized(j->wire) ? 0 : req->kv_block_rows;

    kr_sampling *s = &j->sampling;
    kr_sampling_default(s);
    const Kvrelay__V1__Sampling *rs = req->sampling;
    if (rs) {
        if (rs->top_k > INT_MAX)
            return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                          "sampling.top_k %u is out of range", rs->top_k);
        s->temperature = rs->temperature;
        s->top_k = (int)rs->top_k;
        s->top_p = rs->top_p == 0.0f ? 1.0f : rs->top_p; /* proto: 0 = off */
        s->seed = rs->seed_choice_case == KVRELAY__V1__SAMPLING__SEED_CHOICE_SEED ? rs->seed
                                                                                  : random_seed();
    }
    /* greedy when sampling is absent or its temperature is exactly 0 (the proto's default) */
    s->greedy = !rs || rs->temperature == 0.0f;
    if (kr_sampling_check(s, err) != KR_OK)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT, "%s", err);

    /* forcing: the first token is given, not drawn (the sampling above is then unused) */
    j->forced_first = -1;
    if (req->forced_first_choice_case == KVRELAY__V1__PREFILL_REQUEST__FORCED_FIRST_CHOICE_FORCED_FIRST) {
        if (req->forced_first >= (uint32_t)c->vocab_size)
            return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                          "forced_first: id %u is outside the model's vocabulary [0, %d)",
                          req->forced_first, c->vocab_size);
        j->forced_first = (int32_t)req->forced_first;
    }
    j->logprobs = req->logprobs || j->forced_first >= 0;
    if (j->forced_first < 0 && draw_rules(c, req, j, err) != 0)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT, "%s", err);

    if (req->top_logprobs > KR_TOP_LOGPROBS_MAX)
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT, "top_logprobs: %u, at most %d",
                      req->top_logprobs, KR_TOP_LOGPROBS_MAX);
    j->top_logprobs = (int)req->top_logprobs;
    j->logprobs |= j->top_logprobs > 0;
    if (req->score_only && (!req->prompt_logprobs || j->forced_first >= 0))
        return refuse(n, call, rid, GRPC_STATUS_INVALID_ARGUMENT,
                      "score_only: only with prompt_logprobs and without forced_first");
    j->score_only = req->score_only;
    j->scores.on = req->prompt_logprobs;
    if (!j->score_only) {
        int code = validate_transfer(n, call, req, j);
        if (code != GRPC_STATUS_OK) return code;
    }

    *tokens = malloc(nt * sizeof **tokens);
    if (!*tokens)
        return refuse(n, call, rid, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for %zu tokens",
                      nt);
    for (size_t i = 0; i < nt; i++)
        (*tokens)[i] = (int32_t)req->token_ids[i];
    j->tokens = *tokens;
    j->n_tokens = (int)nt;
    return check_format(n, call, req, j);
}

static int prefill_handler(kc_call *call, const ProtobufCMessage *msg, void *user)
{
    pf_node *n = user;
    const Kvrelay__V1__PrefillRequest *req = (const Kvrelay__V1__PrefillRequest *)msg;
    pf_job j;
    memset(&j, 0, sizeof j);
    j.request_id = *req->request_id ? req->request_id : NULL;
    j.decode_node = req->decode_node;
    j.call = call;
    int32_t *tokens = NULL;
    kr_policy *owned = NULL;
    int code = atomic_load(&n->draining)
                   ? refuse(n, call, j.request_id, GRPC_STATUS_UNAVAILABLE,
                            "prefill node %s is draining", n->cfg->id)
                   : validate(n, call, req, &j, &tokens, &owned);
    if (code != GRPC_STATUS_OK) goto out;
    int waiting;
    if (pf_queue_submit(n, &j, &waiting) != 0) {
        code = refuse(n, call, j.request_id, GRPC_STATUS_RESOURCE_EXHAUSTED,
                      "prefill queue full (%d waiting)", waiting);
        goto out;
    }
    pf_queue_wait(n, &j);
    count(n, j.code);
    if (j.code != GRPC_STATUS_OK) {
        code = kc_call_error(call, j.code, "%s", j.details);
        if (j.dropped)
            pf_queue_answered(n);
        goto out;
    }
    const kr_footprint *fp = &j.usage.footprint;
    Kvrelay__V1__PrefillUsage u = KVRELAY__V1__PREFILL_USAGE__INIT;
    u.prompt_tokens = (uint32_t)j.n_tokens;
    u.prefill_s = j.usage.prefill_s;
    u.transfer_s = j.usage.transfer_s;
    u.kv_entries_shipped = j.usage.kv_entries;
    u.kv_bytes_shipped = j.usage.kv_bytes;
    u.cached_tokens = (uint32_t)j.usage.cached_tokens;
    u.kv_wire_dtype = (char *)kt_dtype_name(j.wire);
    u.footprint_entry_steps = (uint64_t)llround(fp->attended);
    u.peak_kv_entries = (uint64_t)fp->peak_entries;
    u.prefill_node = (char *)n->cfg->id;
    u.footprint_full = fp->full;
    u.footprint_attended = fp->attended;
    Kvrelay__V1__PrefillResponse r = KVRELAY__V1__PREFILL_RESPONSE__INIT;
    r.first_token = (uint32_t)j.first_token;
    r.usage = &u;
    Kvrelay__V1__TopLogprobs first_top = KVRELAY__V1__TOP_LOGPROBS__INIT;
    if (j.logprobs && !j.score_only) {
        r.first_logprob = j.first_logprob;
        r.first_top_id = (uint32_t)j.first_top_id;
        if (j.top_logprobs) {
            first_top.n_ids = first_top.n_logprobs = (size_t)j.top_logprobs;
            first_top.ids = (uint32_t *)j.first_top_ids; /* ids of the vocabulary: the same bits */
            first_top.logprobs = j.first_top_lps;
            r.first_top_logprobs = &first_top;
        }
    }
    Kvrelay__V1__TopLogprobs *prompt_top = NULL, **prompt_top_ptrs = NULL;
    if (j.scores.on) {
        r.n_prompt_logprobs = (size_t)j.scores.n;
        r.prompt_logprobs = j.scores.lps;
        if (pf_scores_message(&j.scores, &prompt_top, &prompt_top_ptrs) != 0) {
            code = kc_call_error(call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory for the prompt's scores");
            goto out;
        }
        if (prompt_top_ptrs) {
            r.n_prompt_top_logprobs = (size_t)j.scores.n;
            r.prompt_top_logprobs = prompt_top_ptrs;
        }
    }
    kc_call_send(call, &r.base); /* fails only when the call is already over */
    free(prompt_top);
    free(prompt_top_ptrs);
    kc_counter_inc(n->metrics.prompt_tokens, j.n_tokens);
    kc_counter_inc(n->metrics.kv_entries, (double)j.usage.kv_entries);
    for (int w = 0; w < PF_N_WIRE; w++)
        if (pf_wire_dtypes[w] == j.wire) kc_counter_inc(n->metrics.kv_bytes[w], (double)j.usage.kv_bytes);
    kc_histogram_observe(n->metrics.prefill_s, j.usage.prefill_s);
    kc_histogram_observe(n->metrics.transfer_s, j.usage.transfer_s);
    kc_counter_inc(n->metrics.parts[0], j.usage.parts_early);
    kc_counter_inc(n->metrics.parts[1], j.usage.parts - j.usage.parts_early);
    code = GRPC_STATUS_OK;
out:
    pf_scores_free(&j.scores);
    kr_grammar_seq_free(j.gseq);
    kr_policy_free(owned);
    kr_penalty_free(j.pen);
    free(tokens);
    return code;
}

static int status_handler(kc_call *call, const ProtobufCMessage *msg, void *user)
{
    pf_node *n = user;
    int running, waiting;
    uint64_t outstanding;
    pf_queue_load(n, &running, &waiting, &outstanding);
    Kvrelay__V1__Node node = KVRELAY__V1__NODE__INIT;
    node.id = (char *)n->cfg->id;
    node.role = KVRELAY__V1__NODE_ROLE__NODE_ROLE_PREFILL;
    node.state = atomic_load(&n->draining) ? KVRELAY__V1__NODE_STATE__NODE_STATE_DRAINING
                                           : KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING;
    node.grpc_address = n->grpc_address;
    node.running_requests = (uint32_t)running;
    node.queued_requests = (uint32_t)waiting;
    node.outstanding_prefill_tokens = outstanding;
    node.since_unix_ms = atomic_load(&n->since_unix_ms);
    pf_cache_summary pc;
    pf_cache_summarize(n->cache, &pc);
    node.prefix_cache_bytes = pc.bytes;
    node.prefix_cache_budget_bytes = pc.budget_bytes;
    node.prefill_chunk = (uint32_t)n->cfg->chunk;
    node.prefix_cache_entries = pc.entries;
    node.prefix_cache_lookups = pc.lookups;
    node.prefix_cache_hits = pc.hits;
    node.prefix_cache_tokens_reused = pc.tokens_reused;
    node.model_fingerprint = (char *)kr_model_fingerprint(n->model);
    kc_call_send(call, &node.base);
    (void)msg;
    return GRPC_STATUS_OK;
}

int pf_service_register(pf_node *n, kc_server *srv)
{
    pthread_mutex_init(&n->policy_mu, NULL);
    if (kc_server_add_unary(srv, "/kvrelay.v1.Prefill/Prefill",
                            &kvrelay__v1__prefill_request__descriptor, prefill_handler, n) != 0 ||
        kc_server_add_unary(srv, "/kvrelay.v1.Prefill/Status",
                            &kvrelay__v1__node_status_request__descriptor, status_handler, n) != 0)
        return -1;
    return 0;
}
