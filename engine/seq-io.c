/*
 * seq-io.c - moving a sequence between processes: reading a sequence's lists out entry by entry,
 * filling a new sequence's lists and their decode rules from them, closing it with the next
 * position so decode goes on exactly as in the sender, and the block bound a receiver reserves. The KV bundle
 * (kvtransfer/) carries what these read and write; this file knows nothing of it.
 * What it is not: a codec or a transport. Entries are keys (post-RoPE) and values in the pool's
 * dtype; kr_seq_list_read and kr_seq_list_append convert them from and to float32 rows.
 *
 * Order on the receiving side: kr_seq_create, kr_seq_list_append (or kr_seq_list_fill) and
 * kr_seq_list_set_rule for every list (any order), kr_seq_set_next_pos, then decode.
 * kr_seq_list_visit and kr_seq_list_fill hand the caller the rows in the pool's blocks, one run
 * per block, so a node copies a list once: from the blocks into a bundle, or from a bundle into
 * the blocks, converting the dtype on the way.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

static int check_list(const kr_seq *s, int layer, int kv_head, const char *what, char *err)
{
    if (layer < 0 || layer >= s->n_layers || kv_head < 0 || kv_head >= s->n_kv_heads)
        return kr_errf(err, "%s: list (layer %d, KV head %d) does not exist (the sequence has %d layers x %d KV "
                       "heads)", what, layer, kv_head, s->n_layers, s->n_kv_heads);
    return KR_OK;
}

/* Lists are filled before the sequence is fed or closed. */
static int check_open(const kr_seq *s, const char *what, char *err)
{
    if (s->fp.steps != 0 || s->closed)
        return kr_errf(err, "%s: the sequence was already %s; lists are filled before that", what,
                       s->closed ? "closed by kr_seq_set_next_pos" : "fed tokens");
    return KR_OK;
}

/* pos[0, n) continue a list whose last position is *last (-1: none): each >= 0 and above the one
 * before it; *last becomes the final one. Entry `at` is pos[0]'s number in the message. */
static int check_positions(const int32_t *pos, int n, int32_t *last, int at, int layer, int kv_head,
                           const char *what, char *err)
{
    for (int e = 0; e < n; e++) {
        if (pos[e] <= *last)
            return kr_errf(err, "%s: position %d at entry %d of list (layer %d, KV head %d) is not above the one "
                           "before it (%d): positions must be >= 0 and strictly increasing", what, pos[e], at + e,
                           layer, kv_head, *last);
        *last = pos[e];
    }
    return KR_OK;
}

void kr_seq_list_shape(const kr_seq *s, int layer, int kv_head, int *len, int *pinned)
{
    int n = 0, pin = 0;
    if (check_list(s, layer, kv_head, "list_shape", NULL) == KR_OK) {
        const kr_kv_list *l = &s->lists[layer * s->n_kv_heads + kv_head];
        n = l->len;
        pin = l->pinned;
    }
    if (len) *len = n;
    if (pinned) *pinned = pin;
}

/* The run of entries [e, e + n_left) of a list that shares e's block: entry e sits at slot
 * (off + e) % B of block (off + e) / B, and a block's slots are consecutive rows of the pool's
 * arrays. Returns its length (<= n_left) with pointers to its first row. */
static int list_run(const kr_kv_pool *p, const kr_kv_list *l, int e, int n_left, int32_t **pos, void **k,
                    void **v)
{
    const int i = l->off + e, slot = i % p->block_size;
    const int32_t b = l->blocks[i / p->block_size];
    *pos = kr_kv_pos(p, b, slot);
    *k = kr_kv_key(p, b, slot);
    *v = kr_kv_value(p, b, slot);
    return n_left < p->block_size - slot ? n_left : p->block_size - slot;
}

int kr_seq_list_visit(const kr_seq *s, int layer, int kv_head, int first, int n, kr_list_rows_fn fn, void *arg,
                      char *err)
{
    if (check_list(s, layer, kv_head, "list_read", err) != KR_OK) return -1;
    const kr_kv_list *l = &s->lists[layer * s->n_kv_heads + kv_head];
    if (first < 0 || n < 0 || first > l->len || n > l->len - first)
        return kr_errf(err, "list_read: entries [%d, %d) of list (layer %d, KV head %d) are outside its %d entries",
                       first, first + n, layer, kv_head, l->len);
    for (int at = 0, run; at < n; at += run) {
        int32_t *pos;
        void *k, *v;
        run = list_run(s->pool, l, first + at, n - at, &pos, &k, &v);
        int rc = fn(arg, first + at, run, pos, s->pool->dtype, k, v, err);
        if (rc != 0) return rc;
    }
    return KR_OK;
}

/* The caller's arrays of kr_seq_list_read (dst) and kr_seq_list_append (src); row 0 is entry
 * `base` of the list (read) or the first appended entry (append). */
typedef struct rows_copy {
    int32_t *pos;
    float *k, *v;
    const int32_t *src_pos;
    const float *src_k, *src_v;
    int base;
    size_t d; /* head_dim */
} rows_copy;

static int copy_out(void *arg, int first, int n, const int32_t *pos, kr_dtype dtype, const void *k,
                    const void *v, char *err)
{
    const rows_copy *c = arg;
    const size_t at = (size_t)(first - c->base);
    if (c->pos) memcpy(c->pos + at, pos, sizeof(int32_t) * (size_t)n);
    if (c->k) kr_dtype_to_f32(dtype, k, (size_t)n * c->d, c->k + at * c->d);
    if (c->v) kr_dtype_to_f32(dtype, v, (size_t)n * c->d, c->v + at * c->d);
    (void)err;
    return 0;
}

int kr_seq_list_read(const kr_seq *s, int layer, int kv_head, int first, int n, int32_t *pos, float *k,
                     float *v, char *err)
{
    rows_copy c = {.pos = pos, .k = k, .v = v, .base = first, .d = (size_t)s->pool->head_dim};
    return kr_seq_list_visit(s, layer, kv_head, first, n, copy_out, &c, err);
}

static int copy_in(void *arg, int first, int n, int32_t *pos, kr_dtype dtype, void *k, void *v, char *err)
{
    const rows_copy *c = arg;
    memcpy(pos, c->src_pos + first, sizeof(int32_t) * (size_t)n);
    kr_dtype_from_f32(dtype, c->src_k + (size_t)first * c->d, (size_t)n * c->d, k);
    kr_dtype_from_f32(dtype, c->src_v + (size_t)first * c->d, (size_t)n * c->d, v);
    (void)err;
    return 0;
}

int kr_seq_list_append(kr_seq *s, int layer, int kv_head, int n, const int32_t *pos, const float *k,
                       const float *v, int pinned, char *err)
{
    if (n > 0 && (!pos || !k || !v))
        return kr_errf(err, "list_append: positions, keys and values are required for %d entries", n);
    rows_copy c = {.src_pos = pos, .src_k = k, .src_v = v, .d = (size_t)s->pool->head_dim};
    return kr_seq_list_fill(s, layer, kv_head, n, pinned, copy_in, &c, err);
}

int kr_seq_list_fill(kr_seq *s, int layer, int kv_head, int n, int pinned, kr_list_fill_fn fn, void *arg,
                     char *err)
{
    if (check_list(s, layer, kv_head, "list_append", err) != KR_OK) return -1;
    if (check_open(s, "list_append", err) != KR_OK) return -1;
    const kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    if (n < 0) return kr_errf(err, "list_append: n = %d entries", n);
    if (pinned < 0 || pinned > l->len + n)
        return kr_errf(err, "list_append: pinned = %d for a list of %d entries (layer %d, KV head %d)", pinned,
                       l->len + n, layer, kv_head);
    char why[KR_ERR_MAX];
    if (kr_seq_grow_list(s, layer, kv_head, n, why) != KR_OK)
        return kr_errf(err, "list_append: %d entries for list (layer %d, KV head %d): %s", n, layer, kv_head, why);
    int32_t last = l->len ? *kr_kv_list_pos(s->pool, l, l->len - 1) : -1;
    for (int at = 0, run; at < n; at += run) {
        int32_t *pos;
        void *k, *v;
        run = list_run(s->pool, l, l->len + at, n - at, &pos, &k, &v);
        if (fn(arg, at, run, pos, s->pool->dtype, k, v, err) != 0 ||
            check_positions(pos, run, &last, at, layer, kv_head, "list_append", err) != KR_OK)
            goto err_spare;
    }
    kr_seq_extend(s, layer, kv_head, n);
    kr_seq_pin(s, layer, kv_head, pinned);
    return KR_OK;
err_spare:
    kr_seq_release_spare(s); /* the blocks this call took: the list is as it was */
    return -1;
}

int kr_seq_list_adopt(kr_seq *s, int layer, int kv_head, int32_t first, int n, int len, int pinned, char *err)
{
    kr_kv_pool *p = s->pool;
    if (check_list(s, layer, kv_head, "list_adopt", err) != KR_OK || check_open(s, "list_adopt", err) != KR_OK)
        return -1;
    const kr_kv_list *l = kr_seq_list(s, layer, kv_head);
    /* the adopted entries follow the list's own in slot order only when those fill its blocks */
    if ((int64_t)l->off + l->len != (int64_t)l->n_blocks * p->block_size)
        return kr_errf(err, "list_adopt: list (layer %d, KV head %d) holds %d entries from slot %d of its %d "
                       "blocks; only a list whose entries fill its blocks adopts more", layer, kv_head, l->len,
                       l->off, l->n_blocks);
    if (len < 0 || n < 0 || n != (int)(((int64_t)len + p->block_size - 1) / p->block_size) ||
        len > INT_MAX - l->len)
        return kr_errf(err, "list_adopt: %d blocks for %d entries in list (layer %d, KV head %d): n must be "
                       "ceil(len / block_size), block_size %d", n, len, layer, kv_head, p->block_size);
    if (pinned < l->pinned || pinned > l->len + len)
        return kr_errf(err, "list_adopt: pinned = %d for a list of %d entries, %d of them pinned before (layer %d, "
                       "KV head %d)", pinned, l->len + len, l->pinned, layer, kv_head);
    if (n == 0) {
        kr_seq_pin(s, layer, kv_head, pinned);
        return KR_OK;
    }
    if (first < 0 || first > p->n_blocks - n)
        return kr_errf(err, "list_adopt: blocks %d..%d are outside the pool's %d", first, first + n - 1,
                       p->n_blocks);
    const int n_free = kr_kv_pool_run_free(p, first, n);
    if (n_free)
        return kr_errf(err, "list_adopt: %d of blocks %d..%d are free in the pool; a list adopts only blocks taken "
                       "by kr_kv_pool_take_run", n_free, first, first + n - 1);
    /* the run's slots are consecutive: entry i's position is pos[i] */
    int32_t last = l->len ? *kr_kv_list_pos(p, l, l->len - 1) : -1;
    if (check_positions(kr_kv_pos(p, first, 0), len, &last, l->len, layer, kv_head, "list_adopt", err) != KR_OK ||
        kr_seq_adopt_blocks(s, layer, kv_head, first, n, err) != KR_OK)
        return -1;
    kr_seq_extend(s, layer, kv_head, len);
    kr_seq_pin(s, layer, kv_head, pinned);
    return KR_OK;
}

void kr_seq_list_rule(const kr_seq *s, int layer, int kv_head, kr_list_rule *out)
{
    *out = check_list(s, layer, kv_head, "list_rule", NULL) == KR_OK ? s->lists[layer * s->n_kv_heads + kv_head].rule
                                                                     : kr_rule_dense;
}

int kr_seq_list_window(const kr_seq *s, int layer, int kv_head)
{
    kr_list_rule r;
    kr_seq_list_rule(s, layer, kv_head, &r);
    return r.window;
}

int kr_seq_list_set_rule(kr_seq *s, int layer, int kv_head, const kr_list_rule *rule, char *err)
{
    if (check_list(s, layer, kv_head, "list_set_rule", err) != KR_OK) return -1;
    if (check_open(s, "list_set_rule", err) != KR_OK) return -1;
    const kr_list_rule *r = rule;
    const char *bad = r->sink < 0 ? "sink" : r->window < -1 ? "window" : r->lazy < 0 ? "lazy" : r->slack < 0 ? "slack"
                      : r->max_drop < 0 ? "max_drop" : r->rel != 0 && r->rel != 1 ? "rel" : NULL;
    if (bad)
        return kr_errf(err, "list_set_rule: list (layer %d, KV head %d): %s is out of range (sink %d, window %d, lazy "
                       "%d, slack %d, max_drop %d, rel %d: window >= -1, rel 0 or 1, the others >= 0)", layer, kv_head,
                       bad, r->sink, r->window, r->lazy, r->slack, r->max_drop, r->rel);
    kr_seq_set_rule(s, layer, kv_head, rule);
    return KR_OK;
}

int kr_seq_set_next_pos(kr_seq *s, int next_pos, char *err)
{
    if (s->fp.steps != 0)
        return kr_errf(err, "set_next_pos: the sequence was already fed %lld tokens", (long long)s->fp.steps);
    if (next_pos < 0) return kr_errf(err, "set_next_pos: next_pos = %d is negative", next_pos);
    for (int i = 0; i < s->n_layers * s->n_kv_heads; i++) {
        const kr_kv_list *l = &s->lists[i];
        int32_t last = l->len ? *kr_kv_list_pos(s->pool, l, l->len - 1) : -1;
        if (last >= next_pos)
            return kr_errf(err, "set_next_pos: next_pos = %d is not above position %d held by list (layer %d, KV "
                           "head %d)", next_pos, last, i / s->n_kv_heads, i % s->n_kv_heads);
    }
    s->next_pos = next_pos;
    s->closed = 1;
    return KR_OK;
}

/* List i holds at most E_i entries at any moment of decode (kr_policy_max_entries, per list
 * where the family says more, counts the new entry a step adds before its trim). Its entries
 * sit in slots [off, off + len) of its blocks. A list that arrived through kr_seq_list_append
 * starts at off 0, and only a trim that drops the front (kr_seq_keep_ends) moves off, to at
 * most block_size - 1: a list decode never trims spans ceil(E_i / B) blocks, one it trims up
 * to ceil((E_i + B - 1) / B). */
int64_t kr_seq_blocks_bound(const kr_kv_pool *pool, const kr_policy *p, int n_layers, int n_kv_heads,
                            int n_prompt, int n_generate)
{
    if (!pool || n_layers <= 0 || n_kv_heads <= 0 || n_prompt < 0 || n_generate < 0) return -1;
    if (p && (p->n_layers != n_layers || p->n_kv_heads != n_kv_heads)) return -1;
    const int lists = n_layers * n_kv_heads;
    int *most = malloc(sizeof(int) * (size_t)lists);
    if (!most) return -1;
    if (p && p->ops->list_max_entries) {
        p->ops->list_max_entries(p, n_prompt, n_generate, most);
    } else {
        int64_t all = p ? kr_policy_max_entries(p, n_prompt, n_generate) : (int64_t)n_prompt + n_generate;
        for (int i = 0; i < lists; i++) most[i] = all > INT32_MAX ? INT32_MAX : (int)all;
    }
    const int64_t B = pool->block_size;
    int64_t total = 0;
    for (int i = 0; i < lists; i++) {
        int64_t span = kr_policy_list_window(p, i / n_kv_heads, i % n_kv_heads) < 0 ? most[i] : most[i] + B - 1;
        total += (span + B - 1) / B;
    }
    free(most);
    return total;
}

/* Decode appends one entry, then the rule trims (forward.c decode_trim). While len <= sink the
 * pinned set covers the whole list and nothing is trimmed; past it the pinned set is
 * P = max(pinned, sink) for good, so C = P + window and the first trim comes at the first length
 * (after the append) of at least T = C + lazy. Every trim shrinks the list, and after it the list
 * regrows one entry a step to T at most, or is trimmed again at once from at most its previous
 * length minus one: so the first trim's length, max(count + 1, T), is the peak. A list that
 * reaches T within n_generate steps may have had its front dropped (offset up to
 * block_size - 1): it spans peak + block_size - 1 slots, as in kr_seq_blocks_bound. */
int64_t kr_list_rule_blocks_bound(const kr_kv_pool *pool, const kr_list_rule *rule, int count, int pinned,
                                  int n_generate)
{
    if (!pool || !rule || count < 0 || pinned < 0 || pinned > count || n_generate < 0 || rule->sink < 0 ||
        rule->window < -1 || rule->lazy < 0 || rule->slack < 0 || rule->max_drop < 0)
        return -1;
    const int64_t B = pool->block_size, grown = (int64_t)count + n_generate;
    int64_t span = grown; /* never trimmed: every entry stays */
    if (rule->window >= 0 && rule->lazy > 0 && n_generate > 0) {
        int64_t first = (int64_t)(pinned > rule->sink ? pinned : rule->sink) + rule->window + rule->lazy;
        if (first <= grown) span = (first > (int64_t)count + 1 ? first : (int64_t)count + 1) + B - 1;
    }
    return (span + B - 1) / B;
}
