/*
 * prefill.c - Prefill.Prefill as one request makes it: the prompt (or after a migration the
 * prompt and the tokens sent) with the reservation's transfer address, on the first prefill
 * node in placement order that takes it; the node computes the KV, applies the policy and ships
 * the bundle to the decode node, and answers with the first token.
 * Under kv-aware placement the prompt is cut into the prefill nodes' chunks and hashed
 * (kv-index.h), the nodes are ordered by what each would still compute of it, and the node that
 * prefilled it records it; every prefill's cached tokens are counted and logged.
 * Not the reservation (reserve.c) nor the retry loop around both (admission.c).
 * Tested through the cluster: test_router_cluster, tests/integration/failures.sh (a prefill node
 * killed mid-request, --prefill-timeout-ms).
 */
#include "request.h"
#include "rma-rows.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* The prompt cut as the prefill nodes cut it, for kv-aware placement (m 0 under another
 * placement, for a policy that never reuses a cached prefix, or out of memory: placed by load). */
static void prompt_chain(const rt_req *r, rt_chain *c)
{
    rt_router *rt = r->rt;
    *c = (rt_chain){0};
    int chunk = atomic_load(&rt->prefill_chunk);
    if (rt->placement != &rt_placement_kv_aware || !chunk) return;
    kr_policy *p;
    char err[KR_ERR_MAX];
    if (kr_policy_parse(r->policy[0] ? r->policy : "full", &rt->cfg, &p, err) != KR_OK) return; /* validated before */
    if (kr_policy_prefix_deterministic(p)) rt_chain_make(kr_policy_spec(p), chunk, r->pf, r->n_pf, c);
    kr_policy_free(p);
}

/* What the chosen node's cache gave (summed into r->pu over a migration's prefills), counted
 * and, when anything was predicted or reused, logged with what placement predicted. */
static void cached_report(rt_req *r, const rt_node *node, const Kvrelay__V1__PrefillResponse *resp, int predicted)
{
    rt_router *rt = r->rt;
    uint32_t got = resp->usage ? resp->usage->cached_tokens : 0;
    r->pu.cached_tokens += got;
    kc_counter_inc(rt->m.cached_tokens, got);
    kc_counter_inc(rt->m.predicted_cached, predicted);
    if (got || predicted)
        kc_info(r->id, "prefill node %s took %u of %d prompt tokens from its prefix cache (placement predicted %d)",
                node->id, got, r->n_pf, predicted);
}

/* Prefill on the first prefill node (in placement order, not skipped) that takes it. On
 * anything but success the reservation is released. A prefill node that failed (UNAVAILABLE, or
 * no answer within --prefill-timeout-ms) is skipped from then on and the request placed again,
 * once: a second failure fails the request. When the Release fails too, the transfer's peer is
 * what died: the decode node is skipped instead, and that does not use up the retry. */
rt_attempt rt_prefill(rt_req *r, Kvrelay__V1__PrefillResponse **out, kc_status *st)
{
    rt_router *rt = r->rt;
    rt_req_phase(r, RT_PHASE_PREFILLING);
    rt_node *order[RT_NODES_MAX];
    int cached[RT_NODES_MAX];
    rt_chain chain;
    prompt_chain(r, &chain);
    int n = rt_nodes_order_prefill(rt, &chain, r->skip_p, r->n_skip_p, order, cached);
    uint32_t *ids = malloc((size_t)r->n_pf * sizeof *ids);
    if (!ids) {
        rt_chain_free(&chain);
        rt_reservation_end(r, 1);
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "router out of memory");
        return RT_ATTEMPT_FAIL;
    }
    for (int i = 0; i < r->n_pf; i++) ids[i] = (uint32_t)r->pf[i];
    Kvrelay__V1__PrefillRequest req = KVRELAY__V1__PREFILL_REQUEST__INIT;
    req.request_id = r->id;
    req.n_token_ids = (size_t)r->n_pf;
    req.token_ids = ids;
    req.sampling = &r->sampling;
    req.kv_policy = (char *)r->policy;
    req.kv_wire_dtype = r->wire;
    req.transfer_address = r->transfer_address;
    req.reservation_id = r->reservation;
    req.reservation_token = (ProtobufCBinaryData){.len = r->reservation_token_len,
                                                  .data = r->reservation_token};
    req.rma_address = r->rma_address;
    req.kv_block_rows = r->kv_block_rows;
    req.rma_key = (ProtobufCBinaryData){.len = r->rma_key_len, .data = r->rma_key};
    req.kv_block_dtype = r->kv_block_dtype;
    Kvrelay__V1__RmaRows rows;
    req.rma_rows = kc_rma_rows_to_pb(&r->rma_rows, &rows);
    req.decode_node = r->dnode ? r->dnode->id : ""; /* none when the prompt is only scored */
    if (r->forced) { /* the next id to emit: after a migration, the first not yet sent */
        req.forced_first_choice_case = KVRELAY__V1__PREFILL_REQUEST__FORCED_FIRST_CHOICE_FORCED_FIRST;
        req.forced_first = r->forced[r->completion];
    }
    req.logprobs = r->logprobs;
    /* the first draw under the rules of every later one: after a migration the prompt's tail
     * is the completion so far */
    req.completion_tokens = (uint32_t)(r->n_pf - r->n_prompt);
    req.min_tokens = r->min_tokens;
    req.ignore_eos = r->ignore_eos;
    req.n_stop_ids = r->n_stop_ids;
    req.stop_ids = (uint32_t *)r->stop_ids;
    req.top_logprobs = r->top_logprobs;
    req.prompt_logprobs = r->prompt_logprobs && r->migrations == 0; /* scored once, not after a migration */
    req.score_only = r->score_only;
    if (r->response_format) { /* the matcher replays the completion so far (completion_tokens) */
        req.response_format = (char *)r->response_format;
        req.max_tokens = r->left_tokens;
    }
    int full = 0;
    rt_attempt a = RT_ATTEMPT_FAIL;
    kc_status last = {GRPC_STATUS_UNAVAILABLE, "none is serving (gone, suspect, or failed earlier in this request)"};
    for (int k = 0; k < n; k++) {
        rt_node *node = order[k];
        Kvrelay__V1__PrefillResponse *resp = NULL;
        kc_status s;
        int64_t left = rt_req_hop_timeout(r);
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
            cached_report(r, node, resp, cached[k]);
            if (!req.prompt_logprobs) rt_node_record_prompt(rt, node, &chain); /* scoring bypassed its cache */
            *out = resp;
            free(ids);
            rt_chain_free(&chain);
            return RT_ATTEMPT_DONE;
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
            if (rt_reservation_end(r, 1) == GRPC_STATUS_UNAVAILABLE) {
                kc_warn(r->id, "prefill on %s failed: %s: %s; decode node %s is gone too: placing the request again",
                        node->id, kc_status_name(s.code), s.details, dnode->id);
                rt_skip_add(r->skip_d, &r->n_skip_d, dnode);
            } else if (r->prefill_failures++ == 0) {
                kc_warn(r->id, "prefill on %s failed: %s: %s; retrying once on another prefill node", node->id,
                        kc_status_name(s.code), s.details);
                rt_skip_add(r->skip_p, &r->n_skip_p, node);
            } else {
                kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "prefill failed twice (last on %s: %s: %s)", node->id,
                           kc_status_name(s.code), s.details);
                free(ids);
                rt_chain_free(&chain);
                return RT_ATTEMPT_FAIL;
            }
            kc_counter_inc(rt->m.retries, 1);
            free(ids);
            rt_chain_free(&chain);
            kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "prefill node %s: %s", node->id, s.details);
            return RT_ATTEMPT_AGAIN;
        }
        kc_status_set(st, s.code, "prefill node %s: %s", node->id, s.details);
        a = RT_ATTEMPT_FAIL;
        goto out;
    }
    if (full) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "every prefill node's queue is full (last: %s)", last.details);
        a = RT_ATTEMPT_LATER;
    } else {
        kc_status_set(st, GRPC_STATUS_UNAVAILABLE, "no prefill node can take the request (last: %s)", last.details);
        a = RT_ATTEMPT_FAIL;
    }
out:
    rt_reservation_end(r, 1);
    free(ids);
    rt_chain_free(&chain);
    return a;
}
