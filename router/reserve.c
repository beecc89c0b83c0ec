/*
 * reserve.c - Decode.Reserve and Decode.Release as one request makes them: room for the prompt
 * and max_tokens on the first decode node in placement order that has it (RESOURCE_EXHAUSTED,
 * UNAVAILABLE, OUT_OF_RANGE -> the next node; all full -> RT_ATTEMPT_LATER, the admission loop
 * backs off), and the reservation freed again when the request does not end with the decode
 * node's own finish. The router's load estimate (rt_node_account) follows both.
 * Not the placement order itself (placement.c) nor the retry loop (admission.c).
 * Tested through the cluster: test_router_cluster, tests/integration/admission.sh, failures.sh.
 */
#include "request.h"
#include "rma-rows.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

enum {
    RT_RESERVE_TTL_MAX_MS = 120000,
};

/* Frees the reservation: by Release when `call` (the stream did not end normally), and in the
 * router's own accounting always. Returns the Release's status code (OK when not called). */
grpc_status_code rt_reservation_end(rt_req *r, int call)
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

rt_attempt rt_reserve(rt_req *r, kc_status *st)
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
        int64_t ttl = rt_req_ms_left(r) < rt->prefill_timeout_ms + 5000 ? rt_req_ms_left(r) : rt->prefill_timeout_ms + 5000;
        req.ttl_ms = (uint32_t)(ttl < 1000 ? 1000 : ttl > RT_RESERVE_TTL_MAX_MS ? RT_RESERVE_TTL_MAX_MS : ttl);
        Kvrelay__V1__ReserveResponse *resp = NULL;
        kc_status s;
        int64_t hop = rt_req_hop_timeout(r) < RT_RESERVE_TIMEOUT_MS ? rt_req_hop_timeout(r) : RT_RESERVE_TIMEOUT_MS;
        int rc = kc_unary(rt_node_channel(rt, node), "/kvrelay.v1.Decode/Reserve", &req.base,
                          &kvrelay__v1__reserve_response__descriptor, hop, (ProtobufCMessage **)&resp, &s);
        rt_node_outcome(rt, node, rc == 0 ? GRPC_STATUS_OK : s.code, s.details);
        if (rc == 0) {
            r->dnode = node;
            r->reserved = 1;
            r->reservation = resp->reservation_id;
            /* a token of another length is passed on empty: the prefill node names the fault */
            r->reservation_token_len = resp->reservation_token.len == sizeof r->reservation_token
                                           ? sizeof r->reservation_token : 0;
            if (r->reservation_token_len)
                memcpy(r->reservation_token, resp->reservation_token.data, r->reservation_token_len);
            /* a key too long for a put is passed on empty: the bundle is then sent, which a
             * mapped reservation takes too */
            r->rma_key_len = resp->rma_key.len <= sizeof r->rma_key ? resp->rma_key.len : 0;
            r->rma_address = resp->rma_address;
            r->kv_block_rows = resp->kv_block_rows;
            snprintf(r->kv_block_dtype, sizeof r->kv_block_dtype, "%s",
                     resp->kv_block_dtype ? resp->kv_block_dtype : "");
            /* malformed rows are dropped (bytes 0): the prefill node then puts every part into
             * the reservation's buffer */
            kc_rma_rows_from_pb(resp->rma_rows, &r->rma_rows);
            if (r->rma_key_len) memcpy(r->rma_key, resp->rma_key.data, r->rma_key_len);
            r->reserved_blocks = (int64_t)resp->reserved_blocks;
            snprintf(r->transfer_address, sizeof r->transfer_address, "%s", resp->transfer_address);
            kc_message_free(&resp->base);
            rt_node_account(rt, node, 0, 1, r->reserved_blocks);
            kc_info(r->id, "reserved %" PRId64 " blocks on %s (reservation %" PRIu64 ", transfer %s)",
                    r->reserved_blocks, node->id, r->reservation, r->transfer_address);
            return RT_ATTEMPT_DONE;
        }
        if (s.code == GRPC_STATUS_RESOURCE_EXHAUSTED || s.code == GRPC_STATUS_UNAVAILABLE ||
            s.code == GRPC_STATUS_OUT_OF_RANGE || (s.code == GRPC_STATUS_DEADLINE_EXCEEDED && rt_req_ms_left(r) > 0)) {
            /* OUT_OF_RANGE: larger than that node's whole pool; another node may be bigger, but
             * waiting for this one would not help (only RESOURCE_EXHAUSTED makes us wait) */
            kc_debug(r->id, "decode node %s refused: %s: %s", node->id, kc_status_name(s.code), s.details);
            full |= s.code == GRPC_STATUS_RESOURCE_EXHAUSTED;
            kc_status_set(&last, s.code, "%s: %s", node->id, s.details);
            continue;
        }
        kc_status_set(st, s.code, "decode node %s: %s", node->id, s.details);
        return RT_ATTEMPT_FAIL;
    }
    if (full) {
        kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "every decode node is full (last: %s)", last.details);
        return RT_ATTEMPT_LATER;
    }
    kc_status_set(st, last.code == GRPC_STATUS_OUT_OF_RANGE ? GRPC_STATUS_OUT_OF_RANGE : GRPC_STATUS_UNAVAILABLE,
                  "no decode node can take the request (%d tried; last: %s)", tried, last.details);
    return RT_ATTEMPT_FAIL;
}

void rt_skip_add(rt_node **skip, int *n, rt_node *node)
{
    for (int i = 0; i < *n; i++)
        if (skip[i] == node) return;
    if (*n < RT_NODES_MAX) skip[(*n)++] = node;
}
