/*
 * resv.c - kvrelay-decode's reservations: admission of a Reserve against the pool's blocks not
 * yet promised to anyone, the KV bundle's parts (each in a buffer of its size, allocated by the
 * transport as it arrives, validated there once and copied into the reservation's sequence by
 * import.c: the sequence and the set of parts are handed over), the
 * transport's completion
 * callback, Release, and expiry. Accounting (docs/decode-node.md "Admission"):
 *   reserved_sum = sum of the blocks bound of every live reservation (a running sequence's
 *                  reservation included: its blocks in use count inside its bound), and of
 *                  the run an RMA reservation holds for the prefill node's puts until its
 *                  transfer ends; a reservation's blocks leave it only once its sequence and
 *                  run are back in the pool (dn_resv_end, which frees outside the node's lock),
 *   used         = blocks sequences hold in the pool (read from it: running ones, and those
 *                  being imported),
 *   free         = total - reserved_sum (what a new Reserve may take),
 *   reserved     = reserved_sum - used (promised, not yet taken from the pool).
 * A reservation is admitted when its bound fits in `free`, so every admitted sequence can reach
 * its bound at once and kr_forward_batch never runs out of blocks.
 * Not here: what happens to the bundle after it arrived (service.c checks it, loop.c imports).
 */
#include "node.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "log.h"
#include "partbuf.h"

/* A FAILED reservation keeps its message this long for a Decode call that comes to ask. */
#define DN_TOMBSTONE_S 60.0

double dn_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int64_t dn_unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t dn_used_blocks(const dn_node *n)
{
    return n->total_blocks - kr_kv_pool_n_free(n->pool);
}

void dn_publish_locked(dn_node *n)
{
    const int64_t used = dn_used_blocks(n);
    int64_t reserved = n->reserved_sum - used;
    kc_gauge_set(n->m.blocks_used, (double)used);
    kc_gauge_set(n->m.blocks_reserved, (double)(reserved > 0 ? reserved : 0));
    kc_gauge_set(n->m.blocks_free, (double)(n->total_blocks - used));
    kc_gauge_set(n->m.running, (double)n->n_running);
    kc_gauge_set(n->m.queued, (double)n->n_pending);
    kc_gauge_set(n->m.reservations, (double)n->n_resvs);
}

dn_resv *dn_resv_find_locked(dn_node *n, uint64_t id)
{
    for (dn_resv *r = n->resvs; r; r = r->next)
        if (r->id == id)
            return r;
    return NULL;
}

void dn_resv_unlink_locked(dn_node *n, dn_resv *r)
{
    for (dn_resv **pp = &n->resvs; *pp; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            n->n_resvs--;
            break;
        }
    }
    r->next = NULL;
    dn_publish_locked(n);
    pthread_cond_broadcast(&n->cond); /* a Decode waiting on this id learns it is gone */
}

void dn_resv_end(dn_node *n, dn_resv *r)
{
    if (!r)
        return;
    kr_policy_free(r->policy);
    kt_bundle_set_free(&r->set);
    kr_seq_free(r->seq);
    dn_resv_drop_run(r);
    pthread_mutex_lock(&n->lock);
    n->reserved_sum -= r->blocks;
    dn_publish_locked(n);
    pthread_mutex_unlock(&n->lock);
    free(r->parts);
    free(r);
}

static const char *state_name(dn_resv_state s)
{
    static const char *names[] = {"WAITING", "READY", "FAILED", "DECODING"};
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "?";
}

int dn_resv_move(dn_resv *r, dn_resv_state to)
{
    const dn_resv_state from = r->state;
    const int legal = (from == DN_RESV_WAITING && (to == DN_RESV_READY || to == DN_RESV_FAILED)) ||
                      (from == DN_RESV_READY && to == DN_RESV_DECODING);
    if (!legal) {
        kc_error(r->request_id, "reservation %" PRIu64 ": refused the move %s -> %s", r->id,
                 state_name(from), state_name(to));
        return -1;
    }
    kc_debug(r->request_id, "reservation %" PRIu64 ": %s -> %s", r->id, state_name(from),
             state_name(to));
    r->state = to;
    return 0;
}

/* A fresh id: random (a stale id held by a router is never someone else's reservation),
 * never 0, not in the table. */
static uint64_t new_id_locked(dn_node *n)
{
    for (;;) {
        uint64_t id = 0;
        if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
            /* no entropy source: mix the clock with a counter, still never 0 */
            static uint64_t ctr;
            id = (uint64_t)dn_unix_ms() * 0x9e3779b97f4a7c15ull ^ (++ctr * 0xbf58476d1ce4e5b9ull);
        }
        if (id != 0 && !dn_resv_find_locked(n, id))
            return id;
    }
}

/* Gives back the blocks of r's run that no list adopted, and takes an RMA run (admitted on top
 * of the bound) out of r's count. */
static void return_run_locked(dn_node *n, dn_resv *r)
{
    dn_resv_drop_run(r);
    n->reserved_sum -= r->run_extra;
    r->blocks -= r->run_extra;
    r->run_extra = 0;
}

/* The transport's completion of a reservation (its progress thread, no transport lock held).
 * A failed transfer's parts and rows are freed after the unlock, and only then are its blocks
 * taken out of reserved_sum (by id: Release or a Decode call may have ended it meanwhile, which
 * counts them out itself). */
static void on_transfer(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    dn_node *n = arg;
    kt_bundle_set drop = {.owned = 0};
    kr_seq *seq = NULL;
    pthread_mutex_lock(&n->lock);
    dn_resv *r = dn_resv_find_locked(n, id);
    /* a released reservation was unlinked first: nothing to do */
    if (r && r->xfer_open &&
        dn_resv_move(r, status == 0 ? DN_RESV_READY : DN_RESV_FAILED) == 0) {
        r->xfer_open = 0;
        if (status == 0) {
            r->len = bytes;
            return_run_locked(n, r);
            kc_info(r->request_id, "reservation %" PRIu64 ": bundle arrived (%" PRIu64 " bytes)",
                    id, bytes);
        } else {
            snprintf(r->err, sizeof r->err, "%s", err ? err : "transfer failed");
            r->failed_at = dn_now();
            drop = r->set; /* the parts that did arrive */
            kt_bundle_set_init(&r->set, r->parts, r->set.cap);
            seq = r->seq; /* the rows copied so far */
            r->seq = NULL;
            return_run_locked(n, r); /* blocks a part was received or put into */
            if (strstr(r->err, " expired"))
                kc_counter_inc(n->m.expired, 1);
            kc_warn(r->request_id, "reservation %" PRIu64 ": %s; %" PRId64 " blocks returned", id,
                    r->err, r->blocks);
        }
        dn_publish_locked(n);
        pthread_cond_broadcast(&n->cond);
    }
    pthread_mutex_unlock(&n->lock);
    if (status == 0)
        return;
    kt_bundle_set_free(&drop);
    kr_seq_free(seq);
    pthread_mutex_lock(&n->lock);
    r = dn_resv_find_locked(n, id);
    if (r && r->state == DN_RESV_FAILED) { /* a tombstone holds no blocks */
        n->reserved_sum -= r->blocks;
        r->blocks = 0;
        dn_publish_locked(n);
    }
    pthread_mutex_unlock(&n->lock);
}

/* Maps the key and value rows of the run of blocks reservation `id` took for the prefill node's
 * puts; on failure (logged) the run goes back to the pool and out of the reservation's count,
 * and the bundle is put into the buffer. Called before the Reserve answer, so nobody can put
 * yet; a reservation the transport ended meanwhile (expired) is unknown to it, the mapping
 * fails, and its callback has given the run back already. */
static int map_run(dn_node *n, const char *rid, uint64_t id, int32_t first, int blocks,
                   kt_rma_rows *out)
{
    void *k, *v;
    int32_t *pos;
    kr_kv_pool_run_rows(n->pool, first, &k, &v, &pos);
    const uint64_t bytes = (uint64_t)blocks * (uint64_t)kr_kv_pool_block_size(n->pool) *
                           (uint64_t)n->mcfg->head_dim * kr_dtype_size(kr_kv_pool_dtype(n->pool));
    char err[KT_ERR_MAX];
    if (kt_transport_map_rows(n->transport, id, k, v, bytes, out, err) == 0)
        return 0;
    kc_warn(rid, "reservation %" PRIu64 ": %s; its bundle is put into its buffer and copied", id,
            err);
    pthread_mutex_lock(&n->lock);
    dn_resv *r = dn_resv_find_locked(n, id); /* by id: never trust a pointer across the unlock */
    if (r) {
        return_run_locked(n, r);
        dn_publish_locked(n);
    }
    pthread_mutex_unlock(&n->lock);
    return -1;
}

/* What a reservation is sized to (resv_size). */
typedef struct dn_sizing {
    int entries; /* the most entries a bundle list may bring (the bound's assumption) */
    int64_t need; /* the blocks bound */
    uint64_t size; /* the most bytes the bundle's parts may add up to */
    uint32_t max_parts; /* one per layer segment, plus the early parts */
    int64_t run_want; /* RMA: blocks for the parts' K and V (0: none wanted) */
} dn_sizing;

/* The blocks bound, the receive bound in bytes, and in RMA mode the run of blocks wanted for
 * the parts' K and V. Returns OK or INVALID_ARGUMENT with err. */
static int resv_size(const dn_node *n, const dn_resv_ask *ask, dn_sizing *out, char *err)
{
    const kr_config *c = n->mcfg;
    dn_sizing z = {0};
    /* The bound assumes a bundle brings at most this many entries per list; service.c refuses
     * a bundle that brings more. */
    z.entries = kr_policy_max_entries(ask->policy, ask->prompt_tokens, 0);
    if (z.entries > ask->prompt_tokens || z.entries < 0)
        z.entries = ask->prompt_tokens;
    /* Tokens fed: the first token and every sampled one but the last (loop.c stops a sequence
     * at max_tokens completion tokens, CONTEXT beyond). */
    z.need = kr_seq_blocks_bound(n->pool, ask->policy, c->n_layers, c->n_kv_heads,
                                 ask->prompt_tokens, ask->max_tokens - 1);
    if (z.need < 0) {
        snprintf(err, KT_ERR_MAX, "cannot bound the blocks of %d prompt tokens + %d max_tokens",
                 ask->prompt_tokens, ask->max_tokens);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    /* The most bytes this reservation's parts may add up to: every list at `entries`, in the
     * largest payload the request may choose (f32, or int8 with its row scales when head_dim is
     * 1). The spec is sized at its maximum so that a bundle carrying a longer spelling of the
     * policy is refused by Decode's policy check (a clear message), not by the transport's size
     * check. */
    kt_bundle_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.fingerprint, n->fingerprint, sizeof h.fingerprint);
    h.n_layers = (uint32_t)c->n_layers;
    h.n_kv_heads = (uint32_t)c->n_kv_heads;
    h.head_dim = (uint32_t)c->head_dim;
    h.dtype = KT_DTYPE_F32;
    h.prompt_len = ask->prompt_tokens;
    h.next_pos = ask->prompt_tokens;
    snprintf(h.policy, sizeof h.policy, "%s", kr_policy_spec(ask->policy));
    const size_t n_lists = (size_t)c->n_layers * (size_t)c->n_kv_heads;
    kt_bundle_list *lists = calloc(n_lists, sizeof *lists);
    if (!lists) {
        snprintf(err, KT_ERR_MAX, "out of memory sizing the bundle");
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    }
    for (size_t i = 0; i < n_lists; i++)
        lists[i] = (kt_bundle_list){.count = (uint32_t)z.entries, .window = KT_BUNDLE_WINDOW_DENSE};
    uint64_t size_q = 0;
    char berr[KT_ERR_MAX];
    int rc = kt_bundle_size(&h, lists, &z.size, berr);
    h.dtype = KT_DTYPE_INT8_TOKEN;
    if (rc == 0) rc = kt_bundle_size(&h, lists, &size_q, berr);
    if (size_q > z.size) z.size = size_q;
    free(lists);
    if (rc != 0) {
        snprintf(err, KT_ERR_MAX, "cannot size the bundle for %d prompt tokens: %.400s",
                 ask->prompt_tokens, berr);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    /* room for the policy spec's longest spelling, and for the headers and padding of a
     * transfer pipelined in up to one segment per layer plus the early parts */
    z.max_parts = (uint32_t)c->n_layers + KT_BUNDLE_MAX_EARLY_PARTS;
    z.size += KT_BUNDLE_MAX_POLICY + 64 + (uint64_t)z.max_parts * KT_BUNDLE_SEGMENT_SLACK;
    /* and for each list's padding to whole blocks (service.c asks for block-padded bundles): at
     * most block_size - 1 rows per list in each early part and once more in its layer's
     * segment, a row being at most a float32 K and V row and a position (or int8 rows with
     * their scales); in RMA mode a padded part lands whole in the buffer when the run taken
     * for K and V has no room left for it */
    const uint64_t row = 8 * (uint64_t)c->head_dim + 4 > 2 * ((uint64_t)c->head_dim + 4) + 4
                             ? 8 * (uint64_t)c->head_dim + 4
                             : 2 * ((uint64_t)c->head_dim + 4) + 4;
    const int64_t bs = kr_kv_pool_block_size(n->pool);
    z.size += (uint64_t)(KT_BUNDLE_MAX_EARLY_PARTS + 1) * n_lists * (uint64_t)(bs - 1) * row;
    /* RMA: a padded bundle's K and V go straight into a run of the pool's blocks, taken at
     * admission and mapped beside the buffer: every list at `entries` rows in whole blocks, at
     * most the bound (per-layer budgets keep fewer in some lists). */
    if (n->cfg.rma) {
        z.run_want = (int64_t)n_lists * ((z.entries + bs - 1) / bs);
        if (z.run_want > z.need) z.run_want = z.need;
    }
    *out = z;
    return GRPC_STATUS_OK;
}

/* A reservation record, WAITING, not yet in the table; takes ask->policy. In RMA mode with the
 * buffer the prefill node puts the parts into, of the receive bound, mapped later: pages are
 * only backed as they are written, and the set frees it with the parts. NULL when out of
 * memory (err set; the policy freed). */
static dn_resv *resv_new(dn_node *n, const dn_resv_ask *ask, const dn_sizing *z, char *err)
{
    dn_resv *r = calloc(1, sizeof *r);
    if (!r || !(r->parts = calloc(z->max_parts, sizeof *r->parts))) {
        free(r);
        kr_policy_free(ask->policy);
        snprintf(err, KT_ERR_MAX, "out of memory for a reservation");
        return NULL;
    }
    r->policy = ask->policy;
    r->node = n;
    kt_bundle_set_init(&r->set, r->parts, z->max_parts);
    r->set.on_part = dn_import_part;
    r->set.on_place = dn_place_part;
    r->set.on_part_arg = r;
    if (n->cfg.rma && !(r->set.region = kt_partbuf_alloc(z->size))) {
        dn_resv_end(n, r);
        snprintf(err, KT_ERR_MAX, "out of memory for a %" PRIu64 "-byte RMA buffer", z->size);
        return NULL;
    }
    snprintf(r->request_id, sizeof r->request_id, "%s", ask->request_id);
    r->prompt_tokens = ask->prompt_tokens;
    r->max_tokens = ask->max_tokens;
    r->max_list_entries = z->entries;
    r->cap = z->size;
    r->xfer_open = 1;
    r->expires = dn_now() + (double)ask->ttl_ms / 1000.0;
    r->expires_unix_ms = dn_unix_ms() + ask->ttl_ms;
    return r;
}

/* Admission under the lock: r's bound against the blocks no live reservation holds; in RMA
 * mode the run of blocks too when both fit (held beside the sequence's own blocks until the
 * transfer ends, so admitted on top of the bound; without room for both, or without a free run
 * that long, the parts are put into the buffer and copied). On OK r is in the table with a new
 * id and counted in reserved_sum; otherwise err says why. */
static int admit_locked(dn_node *n, dn_resv *r, const dn_sizing *z, char *err)
{
    if (n->stopping || n->draining) {
        snprintf(err, KT_ERR_MAX, "decode node %s is %s", n->cfg.id,
                 n->stopping ? "shutting down" : "draining");
        return GRPC_STATUS_UNAVAILABLE;
    }
    if (z->need > n->total_blocks) { /* waiting would not help: say so, so the router does not wait */
        snprintf(err, KT_ERR_MAX, "need %" PRId64 " blocks, more than this node's whole pool of %" PRId64
                 " for %d prompt tokens + %d max_tokens under policy %.200s", z->need,
                 n->total_blocks, r->prompt_tokens, r->max_tokens, kr_policy_spec(r->policy));
        return GRPC_STATUS_OUT_OF_RANGE;
    }
    const int64_t free_blocks = n->total_blocks - n->reserved_sum;
    if (z->need > free_blocks) {
        snprintf(err, KT_ERR_MAX, "need %" PRId64 " blocks, %" PRId64 " free (%" PRId64
                 " total) for %d prompt tokens + %d max_tokens under policy %.200s", z->need,
                 free_blocks, n->total_blocks, r->prompt_tokens, r->max_tokens,
                 kr_policy_spec(r->policy));
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    }
    r->id = new_id_locked(n);
    if (z->run_want > 0 && z->run_want <= free_blocks - z->need && z->run_want <= INT32_MAX &&
        kr_kv_pool_take_run(n->pool, (int)z->run_want, &r->run_first) == KR_OK)
        r->run_n = (int)(r->run_extra = z->run_want);
    r->blocks_bound = z->need;
    r->blocks = z->need + r->run_extra;
    n->reserved_sum += r->blocks;
    r->next = n->resvs;
    n->resvs = r;
    n->n_resvs++;
    dn_publish_locked(n);
    return GRPC_STATUS_OK;
}

int dn_resv_admit(dn_node *n, const dn_resv_ask *ask, dn_resv_grant *out, char *err)
{
    dn_sizing z;
    dn_resv_grant g = {.id = 0};
    int code = resv_size(n, ask, &z, err);
    if (code != GRPC_STATUS_OK) {
        kr_policy_free(ask->policy);
        return code;
    }
    dn_resv *r = resv_new(n, ask, &z, err);
    if (!r)
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    pthread_mutex_lock(&n->lock);
    code = admit_locked(n, r, &z, err);
    /* read before the unlock: from then on only the id is trusted */
    const uint64_t id = r->id;
    const int32_t run_first = r->run_first;
    const int run_n = r->run_n;
    pthread_mutex_unlock(&n->lock);
    if (code != GRPC_STATUS_OK)
        goto err_end;

    /* The record is in the table first: the callback may come before this returns. The set
     * stays valid meanwhile: only the callback or Release touches it, and neither can act on an
     * id the transport does not know yet (nor the router, before this call answers). Without
     * RMA, parts land in buffers of their own size (no buffer of the bound is held while the
     * bundle is awaited). */
    g.id = id;
    g.blocks = z.need;
    g.expires_unix_ms = r->expires_unix_ms;
    const double ttl_s = (double)ask->ttl_ms / 1000.0;
    void *region = r->set.region;
    char terr[KT_ERR_MAX];
    const kt_resv_opts ro = {.timeout_s = ttl_s, .set = &r->set, .cb = on_transfer, .cb_arg = n,
                             .request_id = ask->request_id};
    if ((region ? kt_transport_reserve_rma(n->transport, id, region, z.size, &ro, g.token, &g.rma,
                                           terr)
                : kt_transport_reserve(n->transport, id, NULL, z.size, &ro, g.token, terr)) != 0) {
        snprintf(err, KT_ERR_MAX, "%s", terr);
        code = GRPC_STATUS_UNAVAILABLE;
        goto err_unlink;
    }
    if (run_n && map_run(n, ask->request_id, id, run_first, run_n, &g.rows) != 0)
        memset(&g.rows, 0, sizeof g.rows);
    *out = g;
    return GRPC_STATUS_OK;

err_unlink:
    pthread_mutex_lock(&n->lock);
    r = dn_resv_find_locked(n, id); /* by id: never trust a pointer across the unlock */
    if (r)
        dn_resv_unlink_locked(n, r);
    pthread_mutex_unlock(&n->lock);
err_end:
    dn_resv_end(n, r);
    return code;
}

int dn_resv_release(dn_node *n, uint64_t id, const char *request_id)
{
    pthread_mutex_lock(&n->lock);
    dn_resv *r = dn_resv_find_locked(n, id);
    if (!r) {
        pthread_mutex_unlock(&n->lock);
        return 0;
    }
    if (r->state == DN_RESV_DECODING) {
        /* Its Decode call (handler or loop) ends it and frees everything at once. */
        r->cancel = 1;
        pthread_cond_broadcast(&n->cond);
        pthread_mutex_unlock(&n->lock);
        kc_info(request_id, "reservation %" PRIu64 " released while decoding: cancelling", id);
        return 1;
    }
    int64_t blocks = r->blocks;
    int xfer = r->xfer_open;
    r->xfer_open = 0;
    dn_resv_unlink_locked(n, r);
    pthread_mutex_unlock(&n->lock);
    /* Returns only once UCX no longer writes into a part. */
    if (xfer)
        kt_transport_release(n->transport, id);
    kc_info(request_id, "reservation %" PRIu64 " released (%" PRId64 " blocks)", id, blocks);
    dn_resv_end(n, r); /* with the rows a transfer still open had copied */
    return 1;
}

double dn_resv_reap_locked(dn_node *n, double now, dn_resv **dead)
{
    double next = now + 1.0;
    for (dn_resv *r = n->resvs, *nx; r; r = nx) {
        nx = r->next;
        double when = r->state == DN_RESV_READY    ? r->expires
                      : r->state == DN_RESV_FAILED ? r->failed_at + DN_TOMBSTONE_S
                                                   : -1.0;
        if (when < 0)
            continue; /* WAITING: the transport expires it; DECODING: its call ends it */
        if (now < when) {
            if (when < next)
                next = when;
            continue;
        }
        if (r->state == DN_RESV_READY) {
            kc_counter_inc(n->m.expired, 1);
            kc_warn(r->request_id, "reservation %" PRIu64 " expired unused after its bundle "
                    "arrived; %" PRId64 " blocks returned", r->id, r->blocks);
        }
        dn_resv_unlink_locked(n, r);
        r->next = *dead;
        *dead = r;
    }
    return next;
}

void dn_resv_release_all(dn_node *n)
{
    for (;;) {
        pthread_mutex_lock(&n->lock);
        dn_resv *r = n->resvs;
        if (!r) {
            pthread_mutex_unlock(&n->lock);
            return;
        }
        int xfer = r->xfer_open;
        r->xfer_open = 0;
        dn_resv_unlink_locked(n, r);
        pthread_mutex_unlock(&n->lock);
        if (xfer)
            kt_transport_release(n->transport, r->id);
        dn_resv_end(n, r);
    }
}
