/*
 * import.c - a reservation's bundle into its sequence, part by part, as the parts arrive. The
 * transport calls dn_import_part on its progress thread right after it validated a part (a whole
 * bundle, or one layer segment of a pipelined transfer) and before it acknowledges it: the rows
 * are copied from the part, still in cache from the checksum pass, straight into KV blocks taken
 * from the node's pool (the pool serializes taking blocks with the loop, which decodes other
 * sequences meanwhile). So the loop never copies a bundle: it adopts the sequence when the
 * Decode call comes (loop.c), and a pipelined transfer's copies overlap the transfer of the
 * layers after them.
 * A block-padded part sent in pieces (docs/bundle.md, format 2.3) is not copied at all: when its
 * head arrives, dn_place_part takes one run of consecutive blocks for all its lists, the
 * transport receives its K and V sections straight into that run's rows, and dn_import_part
 * only writes the positions and hands each list its share of the run (kr_seq_list_adopt).
 * Each part is checked against this node's model and the reservation's policy, and the blocks
 * it would bring the sequence to against the reservation's bound, before a row is read or a
 * block taken: a part that breaks either is refused, the reservation fails, and the sender hears
 * why. What only the
 * whole bundle shows (every list within the bound over the reserved decode steps, the first
 * token, the next position) is checked at Decode (service.c).
 */
#include "bundle-rule.h"
#include "node.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The part against this node's model (the fingerprint and shape, and for a layer segment that
 * its layers are the model's) and against the reservation's policy. */
static int check_part(const dn_node *n, const dn_resv *r, const kt_bundle_header *h, char *err)
{
    const kr_config *c = n->mcfg;
    /* Both specs are kr_policy_spec's canonical form (every default filled in), so equal
     * policies are equal strings and the bundle's spec needs no parse of its own. */
    if (strcmp(h->policy, kr_policy_spec(r->policy)) != 0) {
        snprintf(err, KT_ERR_MAX, "the KV bundle's policy '%.200s' differs from the reservation's "
                 "'%.200s'", h->policy, kr_policy_spec(r->policy));
        return -1;
    }
    kt_bundle_header whole = *h;
    if (h->segment) {
        if ((uint64_t)h->first_layer + h->n_layers > (uint64_t)c->n_layers) {
            snprintf(err, KT_ERR_MAX, "the KV bundle's segment holds layers [%" PRIu32 ", %" PRIu64
                     "), past this node's model's %d", h->first_layer,
                     (uint64_t)h->first_layer + h->n_layers, c->n_layers);
            return -1;
        }
        whole.n_layers = (uint32_t)c->n_layers;
    }
    char why[KT_ERR_MAX];
    if (kt_bundle_check_model(&whole, n->fingerprint, (uint32_t)c->n_layers,
                              (uint32_t)c->n_kv_heads, (uint32_t)c->head_dim, why) != 0) {
        snprintf(err, KT_ERR_MAX, "the KV bundle is for another model: %.400s", why);
        return -1;
    }
    return 0;
}

/* Blocks r's sequence holds once part is appended: each list of the part grows from its length
 * so far (the lists of a sequence being imported start at slot 0 and hold no spare blocks). */
static int64_t blocks_after(const dn_resv *r, const kt_bundle_view *part, int block_size)
{
    int64_t total = r->seq ? kr_seq_blocks(r->seq) : 0;
    for (uint32_t l = 0; l < part->hdr.n_layers; l++)
        for (uint32_t h = 0; h < part->hdr.n_kv_heads; h++) {
            kt_bundle_list_view lv;
            if (kt_bundle_view_list(part, l, h, &lv, NULL) != 0)
                continue; /* inside the validated part: cannot happen */
            int len = 0;
            if (r->seq)
                kr_seq_list_shape(r->seq, (int)(part->hdr.first_layer + l), (int)h, &len, NULL);
            total += ((int64_t)len + lv.count + block_size - 1) / block_size -
                     ((int64_t)len + block_size - 1) / block_size;
        }
    return total;
}

/* The part against the model and policy (check_part) and against the reservation's bound,
 * before a block is taken: beyond it lie blocks promised to other reservations, which the
 * batching thread may need at its next step. Then r's sequence exists. */
static int admit_part(dn_resv *r, const kt_bundle_view *part, char *err)
{
    dn_node *n = r->node;
    const kr_config *c = n->mcfg;
    if (check_part(n, r, &part->hdr, err) != 0)
        return -1;
    const int64_t blocks = blocks_after(r, part, kr_kv_pool_block_size(n->pool));
    if (blocks > r->blocks_bound) {
        snprintf(err, KT_ERR_MAX, "the KV bundle takes %" PRId64 " blocks, more than the %" PRId64
                 " its reservation holds", blocks, r->blocks_bound);
        return -1;
    }
    char why[KR_ERR_MAX > KT_ERR_MAX ? KR_ERR_MAX : KT_ERR_MAX];
    if (!r->seq && kr_seq_create(n->pool, c->n_layers, c->n_kv_heads, &r->seq, why) != KR_OK) {
        snprintf(err, KT_ERR_MAX, "%.500s", why);
        return -1;
    }
    return 0;
}

int dn_place_part(void *arg, const kt_bundle_set *s, const kt_bundle_view *head, void **k, void **v,
                  char *err)
{
    dn_resv *r = arg;
    kr_kv_pool *pool = r->node->pool;
    (void)s;
    if (admit_part(r, head, err) != 0)
        return -1;
    if (r->run_n) /* blocks taken for another part (cannot happen: parts come one at a time) */
        return 1;
    /* Not laid out as this pool's blocks, or no free run that long (1): received into a buffer
     * and copied into whatever blocks are free. */
    return kt_part_take_run(r->seq, pool, head, &r->run_first, &r->run_n, k, v);
}

void dn_resv_drop_run(dn_resv *r)
{
    if (r->run_n)
        kr_kv_pool_give_run(r->node->pool, r->run_first, r->run_n);
    r->run_n = 0;
}

int dn_import_part(void *arg, const kt_bundle_set *s, uint32_t i, char *err)
{
    dn_resv *r = arg;
    dn_node *n = r->node;
    const kr_config *c = n->mcfg;
    const kt_bundle_view *part = &s->parts[i];
    const double t0 = dn_now();
    char why[KR_ERR_MAX > KT_ERR_MAX ? KR_ERR_MAX : KT_ERR_MAX];
    void *k = NULL, *v;
    int32_t *pos;
    if (admit_part(r, part, err) != 0)
        return -1;
    if (r->run_n)
        kr_kv_pool_run_rows(n->pool, r->run_first, &k, &v, &pos);
    /* Its K and V are in the run's first blocks already: received there (AM: the run is the
     * part's own), or put there in order (RMA: the run taken at Reserve). */
    const int placed = k && part->k == k;
    int rc;
    if (placed) {
        const int blocks = kt_part_run_blocks(r->seq, n->pool, part);
        if (blocks == 0) {
            snprintf(err, KT_ERR_MAX, "a KV bundle part put into this node's blocks is not laid "
                     "out as them");
            return -1;
        }
        if (blocks > r->run_n) {
            snprintf(err, KT_ERR_MAX, "a KV bundle part put into this node's blocks needs %d of "
                     "them, its reservation has %d left", blocks, r->run_n);
            return -1;
        }
        rc = kt_bundle_part_adopt(r->seq, n->pool, part, r->run_first, blocks, why);
        r->run_first += blocks;
        r->run_n -= blocks;
    } else {
        float *rows = NULL;
        if (kr_kv_pool_dtype(n->pool) != KR_DTYPE_F32 && kt_dtype_quantized(part->hdr.dtype) &&
            !(rows = malloc(sizeof(float) * 2 * (size_t)kr_kv_pool_block_size(n->pool) *
                            (size_t)c->head_dim))) {
            snprintf(err, KT_ERR_MAX, "out of memory for the rows of one KV block");
            return -1;
        }
        rc = kt_bundle_part_to_seq(r->seq, part, (uint32_t)c->head_dim, rows, why);
        free(rows);
    }
    if (rc != 0) {
        snprintf(err, KT_ERR_MAX, "importing the KV bundle failed: %.450s", why);
        return -1;
    }
    r->import_s += dn_now() - t0;
    kc_counter_inc(placed ? n->m.parts_in_blocks : n->m.parts_copied, 1);
    return 0;
}
