/*
 * rma-rows.h - the RmaRows message (proto/kvrelay/v1/internal.proto) and kt_rma_rows
 * (kvtransfer/transport.h) in both directions, for the three programs it passes through: the
 * decode node answers Reserve with it, the router keeps it and passes it on, the prefill node puts
 * into it. Header-only: kr_common does not link the transport.
 */
#ifndef KC_RMA_ROWS_H
#define KC_RMA_ROWS_H

#include <string.h>

#include "kvrelay/v1/internal.pb-c.h"
#include "transport.h"

/* *m pointing into *r (which must outlive it); NULL when r holds no rows (bytes 0). */
static inline Kvrelay__V1__RmaRows *kc_rma_rows_to_pb(const kt_rma_rows *r, Kvrelay__V1__RmaRows *m)
{
    if (!r->bytes) return NULL;
    *m = (Kvrelay__V1__RmaRows)KVRELAY__V1__RMA_ROWS__INIT;
    m->k_address = r->k.address;
    m->k_key = (ProtobufCBinaryData){.len = r->k.rkey_len, .data = (uint8_t *)r->k.rkey};
    m->v_address = r->v.address;
    m->v_key = (ProtobufCBinaryData){.len = r->v.rkey_len, .data = (uint8_t *)r->v.rkey};
    m->bytes = r->bytes;
    return m;
}

/* *out from m (NULL or bytes 0: no rows, *out zeroed, 0). Returns -1, *out zeroed, when an
 * address is 0 or a key is empty or longer than KT_RMA_KEY_MAX. */
static inline int kc_rma_rows_from_pb(const Kvrelay__V1__RmaRows *m, kt_rma_rows *out)
{
    memset(out, 0, sizeof *out);
    if (!m || !m->bytes) return 0;
    if (!m->k_address || !m->v_address || !m->k_key.len || m->k_key.len > KT_RMA_KEY_MAX ||
        !m->v_key.len || m->v_key.len > KT_RMA_KEY_MAX)
        return -1;
    out->k.address = m->k_address;
    out->k.rkey_len = (uint32_t)m->k_key.len;
    memcpy(out->k.rkey, m->k_key.data, m->k_key.len);
    out->v.address = m->v_address;
    out->v.rkey_len = (uint32_t)m->v_key.len;
    memcpy(out->v.rkey, m->v_key.data, m->v_key.len);
    out->bytes = m->bytes;
    return 0;
}

#endif /* KC_RMA_ROWS_H */
