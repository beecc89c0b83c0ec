/*
 * seq-copy.c - copying a sequence's whole state into another pool (kr_seq_copy), and which
 * policies leave, at a chunk boundary of a prefill, a state that any prompt beginning with the
 * same tokens would reach too (kr_policy_prefix_deterministic). Together they let a prefix cache
 * keep a prefill's state at chunk boundaries and continue other prompts from it with
 * kr_prefill_span, bit for bit as prefilling them from scratch.
 *
 * Not here: the cache itself (keys, memory budget, eviction: prefill-node/prefix-cache.c), and
 * sharing blocks between sequences (a copy owns its blocks; restoring copies the rows again).
 * Tests: tests/unit/test_prefix_cache.c.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <limits.h>
#include <string.h>

/* Why each family is or is not prefix-deterministic (docs/prefix-cache.md has the long form).
 * A non-final chunk's hook must see only the chunk's own rows and what is cached, and the
 * sequence must carry no state besides its lists, next position and footprint. */
int kr_policy_prefix_deterministic(const kr_policy *p)
{
    if (!p) return 1;
    const kr_policy_ops *o = p->ops;
    /* full keeps everything; streaming and heads keep sinks + the newest entries after every
     * chunk; sage evicts nothing before the prompt's last chunk (post-fill) */
    if (o == &kr_policy_full || o == &kr_policy_streaming || o == &kr_policy_heads ||
        o == &kr_policy_sage)
        return 1;
    /* snapkv and pyramidkv: naive mode observes with the chunk's own last rows and budgets by the
     * tokens seen so far; patched mode appends the prompt's last rows to every chunk, which a
     * prompt with another ending does not share */
    if (o == &kr_policy_snapkv || o == &kr_policy_pyramidkv) return kr_policy_appended(p, INT_MAX) == 0;
    /* take appends its probe (the prompt's last rows) and accumulates it per sequence; hsft
     * rescales its windows for the whole prompt's length at the first chunk */
    return 0;
}

int kr_seq_copy(const kr_seq *src, kr_kv_pool *pool, const kr_policy *p, kr_seq **out, char *err)
{
    const kr_kv_pool *sp = src->pool;
    if (pool->head_dim != sp->head_dim || pool->dtype != sp->dtype)
        return kr_errf(err, "sequence copy: the pool holds head_dim %d rows of %s, the sequence's %d of %s",
                       pool->head_dim, kr_dtype_name(pool->dtype), sp->head_dim, kr_dtype_name(sp->dtype));
    if (src->policy_state || (p && p->ops->state_init))
        return kr_errf(err, "sequence copy: policy %s keeps per-sequence state a copy cannot carry",
                       kr_policy_spec(p ? p : src->policy));
    if (p && (p->n_layers != src->n_layers || p->n_kv_heads != src->n_kv_heads))
        return kr_errf(err, "sequence copy: policy %s was parsed for another model shape", kr_policy_spec(p));
    kr_seq *s;
    if (kr_seq_create(pool, src->n_layers, src->n_kv_heads, &s, err) != KR_OK) return -1;
    s->policy = p;
    const size_t rb = pool->row_bytes;
    for (int l = 0; l < src->n_layers; l++)
        for (int g = 0; g < src->n_kv_heads; g++) {
            const kr_kv_list *from = &src->lists[l * src->n_kv_heads + g];
            if (kr_seq_grow_list(s, l, g, from->len, err) != KR_OK) {
                kr_seq_free(s);
                return -1;
            }
            const kr_kv_list *to = kr_seq_list(s, l, g);
            for (int e = 0; e < from->len; e++) {
                memcpy(kr_kv_list_key(pool, to, e), kr_kv_list_key(sp, from, e), rb);
                memcpy(kr_kv_list_value(pool, to, e), kr_kv_list_value(sp, from, e), rb);
                *kr_kv_list_pos(pool, to, e) = *kr_kv_list_pos(sp, from, e);
            }
            kr_seq_extend(s, l, g, from->len);
            kr_seq_pin(s, l, g, from->pinned);
            kr_seq_set_rule(s, l, g, &from->rule);
        }
    s->next_pos = src->next_pos;
    s->fp = src->fp;
    s->closed = src->closed;
    *out = s;
    return KR_OK;
}
