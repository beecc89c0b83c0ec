/*
 * grammar-mask.c - the token mask of kr-grammar.h. The vocabulary is held as a trie of the
 * tokens' bytes, flattened in depth-first order: each node has its byte, its depth and the
 * index just past its subtree. A mask is one pass over that array with one matcher per depth:
 * the matcher of a node is its parent's fed the node's byte; where the matcher refuses the
 * byte, the whole subtree is skipped, so a token costs one byte step only for the bytes it
 * does not share with its trie neighbours, and refused prefixes cost nothing below them.
 *
 * Inside a string nearly every token is allowed and a walk would visit the whole trie. So the
 * tokens that are plain text there (printable, no quote or backslash, whole UTF-8 characters)
 * are set from a precomputed bitset, as many as the string's remaining length admits (they
 * change nothing but the character count), and only the other tokens are walked, in a second
 * trie that holds just them.
 * Not here: the automaton itself (grammar-match.c). Measured cost: docs/structured-output.md.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "kr-util.h"

enum { GV_NEVER, GV_TEXT, GV_END }; /* what a token id is to the mask */

/* A trie node: the byte that leads to it, its depth (the length of its string), the index
 * just past its subtree, and the ids (in kr_grammar_vocab.ids) whose bytes are its string. */
typedef struct gv_node {
    uint32_t skip;
    uint32_t ids_off;
    uint16_t n_ids;
    uint16_t depth;
    uint8_t byte;
} gv_node;

typedef struct gv_trie {
    gv_node *nodes; /* [n_nodes], depth-first */
    uint32_t n_nodes;
    int32_t *ids; /* token ids in trie order */
} gv_trie;

struct kr_grammar_vocab {
    int n_vocab;
    gv_trie all; /* every token that has bytes */
    gv_trie other; /* the tokens that are not plain string text */
    uint32_t *plain_bits; /* [(n_vocab + 31) / 32] the plain ones */
    int32_t *plain_ids; /* [n_plain] by character count, fewest first */
    uint16_t *plain_chars; /* [n_plain] */
    int n_plain, max_plain_chars;
    uint8_t *kind; /* [n_vocab] GV_* */
    uint32_t *off, *len; /* [n_vocab] each token's bytes in `bytes` */
    char *bytes;
    int32_t *end_ids;
    int n_end;
    int max_len; /* longest token, bytes */
};

struct kr_grammar_scratch {
    int max_len;
    kr_matcher *st; /* [max_len + 1]: the matcher at each trie depth */
};

typedef struct gv_tok {
    const char *p;
    uint32_t len;
    int32_t id;
} gv_tok;

static int cmp_tok(const void *a, const void *b)
{
    const gv_tok *x = a, *y = b;
    int r = memcmp(x->p, y->p, x->len < y->len ? x->len : y->len);
    return r ? r : x->len < y->len ? -1 : x->len > y->len ? 1 : x->id < y->id ? -1 : x->id > y->id;
}

/* The trie of the n tokens in t (sorted, none longer than max_len bytes). */
static int build_trie(gv_trie *v, const gv_tok *t, int n, int max_len, char *err)
{
    size_t total = 0;
    for (int i = 0; i < n; i++) total += t[i].len;
    if (total >= UINT32_MAX) return kr_errf(err, "grammar vocabulary: too many token bytes");
    v->nodes = malloc((total + 1) * sizeof *v->nodes);
    v->ids = malloc(((size_t)n + 1) * sizeof *v->ids);
    uint32_t *open = malloc(((size_t)max_len + 1) * sizeof *open); /* node at each depth */
    if (!v->nodes || !v->ids || !open) {
        free(open);
        return kr_errf(err, "grammar vocabulary: out of memory");
    }
    uint32_t nn = 0, ni = 0, depth = 0;
    for (int i = 0; i < n; i++) {
        uint32_t cp = 0;
        if (i) {
            uint32_t m = t[i - 1].len < t[i].len ? t[i - 1].len : t[i].len;
            while (cp < m && t[i - 1].p[cp] == t[i].p[cp]) cp++;
        }
        if (i && cp == t[i].len && cp == t[i - 1].len) { /* same bytes as the previous token */
            v->ids[ni++] = t[i].id;
            v->nodes[open[cp]].n_ids++;
            continue;
        }
        for (; depth > cp; depth--) v->nodes[open[depth]].skip = nn; /* subtrees that end here */
        for (uint32_t d = cp + 1; d <= t[i].len; d++) {
            v->nodes[nn] = (gv_node){.byte = (uint8_t)t[i].p[d - 1], .depth = (uint16_t)d, .ids_off = ni};
            open[d] = nn++;
        }
        depth = t[i].len;
        v->nodes[open[depth]].n_ids = 1;
        v->ids[ni++] = t[i].id;
    }
    for (; depth > 0; depth--) v->nodes[open[depth]].skip = nn;
    v->n_nodes = nn;
    free(open);
    return 0;
}

/* Characters of s when it is plain string text (bytes 0x20 and up but quote and backslash, whole
 * well-formed UTF-8 characters), else -1. */
static int plain_chars(const char *s, uint32_t len)
{
    int chars = 0;
    for (uint32_t i = 0; i < len;) {
        uint8_t b = (uint8_t)s[i];
        uint32_t n = b < 0x80 ? 1 : b >= 0xC2 && b <= 0xDF ? 2 : b >= 0xE0 && b <= 0xEF ? 3 : b >= 0xF0 && b <= 0xF4 ? 4 : 0;
        if (!n || i + n > len || b < 0x20 || b == '"' || b == '\\') return -1;
        for (uint32_t k = 1; k < n; k++)
            if (((uint8_t)s[i + k] & 0xC0) != 0x80) return -1;
        uint8_t b1 = n > 1 ? (uint8_t)s[i + 1] : 0;
        if ((b == 0xE0 && b1 < 0xA0) || (b == 0xED && b1 > 0x9F) || (b == 0xF0 && b1 < 0x90) || (b == 0xF4 && b1 > 0x8F))
            return -1;
        i += n;
        chars++;
    }
    return chars;
}

static int cmp_plain(const void *a, const void *b)
{
    const gv_tok *x = a, *y = b;
    return x->len < y->len ? -1 : x->len > y->len ? 1 : x->id < y->id ? -1 : x->id > y->id;
}

/* Moves the plain tokens of t (sorted) to its end, keeping the others sorted at its start,
 * and records them in v (their character counts in gv_tok.len's place while sorting). */
static int split_plain(kr_grammar_vocab *v, gv_tok *t, int n, char *err)
{
    gv_tok *plain = malloc(((size_t)n + 1) * sizeof *plain);
    v->plain_bits = calloc(((size_t)v->n_vocab + 31) / 32 + 1, sizeof *v->plain_bits);
    v->plain_ids = malloc(((size_t)n + 1) * sizeof *v->plain_ids);
    v->plain_chars = malloc(((size_t)n + 1) * sizeof *v->plain_chars);
    if (!plain || !v->plain_bits || !v->plain_ids || !v->plain_chars) {
        free(plain);
        return kr_errf(err, "grammar vocabulary: out of memory");
    }
    int k = 0, np = 0;
    for (int i = 0; i < n; i++) {
        int c = plain_chars(t[i].p, t[i].len);
        if (c < 0 || c > UINT16_MAX) t[k++] = t[i];
        else plain[np++] = (gv_tok){t[i].p, (uint32_t)c, t[i].id};
    }
    qsort(plain, (size_t)np, sizeof *plain, cmp_plain);
    for (int i = 0; i < np; i++) {
        v->plain_ids[i] = plain[i].id;
        v->plain_chars[i] = (uint16_t)plain[i].len;
        v->plain_bits[plain[i].id >> 5] |= 1u << (plain[i].id & 31);
        if ((int)plain[i].len > v->max_plain_chars) v->max_plain_chars = (int)plain[i].len;
    }
    v->n_plain = np;
    free(plain);
    return 0;
}

void kr_grammar_vocab_free(kr_grammar_vocab *v)
{
    if (!v) return;
    free(v->all.nodes);
    free(v->all.ids);
    free(v->other.nodes);
    free(v->other.ids);
    free(v->plain_bits);
    free(v->plain_ids);
    free(v->plain_chars);
    free(v->kind);
    free(v->off);
    free(v->len);
    free(v->bytes);
    free(v->end_ids);
    free(v);
}

int kr_grammar_vocab_create(const kr_tokenizer *t, const int32_t *end_ids, int n_end, kr_grammar_vocab **out,
                            char *err)
{
    int32_t eos = kr_tokenizer_eos(t);
    if (!end_ids || n_end <= 0) {
        end_ids = &eos;
        n_end = eos >= 0;
    }
    int nv = kr_tokenizer_n_vocab(t);
    kr_grammar_vocab *v = calloc(1, sizeof *v);
    gv_tok *toks = NULL;
    if (!v) return kr_errf(err, "grammar vocabulary: out of memory");
    v->n_vocab = nv;
    v->kind = calloc((size_t)nv + 1, 1);
    v->off = calloc((size_t)nv + 1, sizeof *v->off);
    v->len = calloc((size_t)nv + 1, sizeof *v->len);
    v->end_ids = malloc(((size_t)n_end + 1) * sizeof *v->end_ids);
    toks = malloc(((size_t)nv + 1) * sizeof *toks);
    if (!v->kind || !v->off || !v->len || !v->end_ids || !toks) goto err_oom;
    for (int i = 0; i < n_end; i++) {
        if (end_ids[i] < 0 || end_ids[i] >= nv) {
            kr_errf(err, "grammar vocabulary: end id %d is outside the vocabulary [0, %d)", (int)end_ids[i], nv);
            goto err;
        }
        v->end_ids[v->n_end++] = end_ids[i];
        v->kind[end_ids[i]] = GV_END;
    }
    size_t total = 0;
    int n = 0;
    for (int32_t id = 0; id < nv; id++) {
        const char *p;
        size_t len;
        if (v->kind[id] == GV_END || kr_tokenizer_token_bytes(t, id, &p, &len) || !len ||
            kr_tokenizer_is_special(t, id))
            continue;
        if (len > UINT16_MAX) continue; /* longer than any trie depth: never allowed */
        v->kind[id] = GV_TEXT;
        toks[n++] = (gv_tok){p, (uint32_t)len, id};
        total += len;
        if ((int)len > v->max_len) v->max_len = (int)len;
    }
    if (total >= UINT32_MAX) {
        kr_errf(err, "grammar vocabulary: too many token bytes");
        goto err;
    }
    v->bytes = malloc(total + 1);
    if (!v->bytes) goto err_oom;
    total = 0;
    for (int i = 0; i < n; i++) {
        memcpy(v->bytes + total, toks[i].p, toks[i].len);
        v->off[toks[i].id] = (uint32_t)total;
        v->len[toks[i].id] = toks[i].len;
        toks[i].p = v->bytes + total; /* the copy: the tokenizer may go away */
        total += toks[i].len;
    }
    qsort(toks, (size_t)n, sizeof *toks, cmp_tok);
    if (build_trie(&v->all, toks, n, v->max_len, err) || split_plain(v, toks, n, err) ||
        build_trie(&v->other, toks, n - v->n_plain, v->max_len, err))
        goto err;
    free(toks);
    *out = v;
    return 0;
err_oom:
    kr_errf(err, "grammar vocabulary: out of memory");
err:
    free(toks);
    kr_grammar_vocab_free(v);
    return -1;
}

int kr_grammar_vocab_n(const kr_grammar_vocab *v) { return v->n_vocab; }

int kr_grammar_scratch_create(const kr_grammar_vocab *v, kr_grammar_scratch **out, char *err)
{
    kr_grammar_scratch *s = calloc(1, sizeof *s);
    if (!s) return kr_errf(err, "grammar scratch: out of memory");
    s->max_len = v->max_len;
    s->st = malloc(((size_t)v->max_len + 1) * sizeof *s->st);
    if (!s->st) {
        free(s);
        return kr_errf(err, "grammar scratch: out of memory");
    }
    *out = s;
    return 0;
}

void kr_grammar_scratch_free(kr_grammar_scratch *s)
{
    if (!s) return;
    free(s->st);
    free(s);
}

/* The mask; with `limit` below UINT32_MAX a token is allowed only when the matcher it leaves
 * needs at most `limit` more bytes (kr_matcher_remaining). kr_grammar_mask_budget keeps the
 * limit at least the bytes needed now less one, so plain text inside a string (which changes
 * nothing but the character count) passes when the string is within the limit already, or
 * when it still lacks characters for its minLength (each plain token then brings the end a
 * byte closer at least); an additional key's plain text may raise the count (it can leave a
 * declared name), so there every token is walked. */
static int mask_limited(const kr_grammar_vocab *v, const kr_matcher *m, kr_grammar_scratch *s, uint32_t limit,
                        uint32_t *allowed)
{
    memset(allowed, 0, ((size_t)v->n_vocab + 31) / 32 * sizeof *allowed);
    if (kr_matcher_dead(m) || kr_matcher_ended(m)) return 0;
    KR_ASSERT(s->max_len >= v->max_len);
    int count = 0;
    const gv_trie *trie = &v->all;
    uint32_t room, need;
    int plain = gr_plain_room(m, &room, &need);
    if (plain && (limit == UINT32_MAX || plain == GR_PLAIN_STRING)) {
        /* in a string: plain tokens that fit, then the others */
        trie = &v->other;
        int plain_ok = limit == UINT32_MAX || kr_matcher_remaining(m) <= limit || need > 0;
        if (plain_ok && room >= (uint32_t)v->max_plain_chars) {
            memcpy(allowed, v->plain_bits, ((size_t)v->n_vocab + 31) / 32 * sizeof *allowed);
            count = v->n_plain;
        } else if (plain_ok) {
            for (; count < v->n_plain && v->plain_chars[count] <= room; count++)
                allowed[v->plain_ids[count] >> 5] |= 1u << (v->plain_ids[count] & 31);
        }
    }
    kr_matcher *st = s->st;
    kr_matcher_copy(&st[0], m);
    for (uint32_t i = 0; i < trie->n_nodes;) {
        const gv_node *nd = &trie->nodes[i];
        if (gr_step(&st[nd->depth], &st[nd->depth - 1], nd->byte)) {
            i = nd->skip;
            continue;
        }
        i++;
        if (!nd->n_ids || (limit != UINT32_MAX && kr_matcher_remaining(&st[nd->depth]) > limit)) continue;
        for (uint32_t k = 0; k < nd->n_ids; k++) {
            int32_t id = trie->ids[nd->ids_off + k];
            allowed[id >> 5] |= 1u << (id & 31);
        }
        count += nd->n_ids;
    }
    if (kr_matcher_can_end(m)) {
        for (int k = 0; k < v->n_end; k++) {
            int32_t id = v->end_ids[k];
            count += !(allowed[id >> 5] >> (id & 31) & 1);
            allowed[id >> 5] |= 1u << (id & 31);
        }
    }
    return count;
}

int kr_grammar_mask(const kr_grammar_vocab *v, const kr_matcher *m, kr_grammar_scratch *s, uint32_t *allowed)
{
    return mask_limited(v, m, s, UINT32_MAX, allowed);
}

int kr_grammar_mask_budget(const kr_grammar_vocab *v, const kr_matcher *m, kr_grammar_scratch *s, int64_t budget,
                           uint32_t *allowed)
{
    uint32_t need = kr_matcher_remaining(m);
    if (budget < 1 || need >= UINT32_MAX / 2) return kr_grammar_mask(v, m, s, allowed);
    /* after this token, budget - 1 tokens of at least one byte each; a state already past
     * that may only come closer */
    int64_t after = budget - 1;
    /* at least need - 1: mask_limited relies on it (a state past its budget moves a byte closer) */
    uint32_t limit = after >= need ? (uint32_t)(after < UINT32_MAX / 2 ? after : UINT32_MAX / 2) : need - 1;
    int count = mask_limited(v, m, s, limit, allowed);
    return count ? count : kr_grammar_mask(v, m, s, allowed);
}

void kr_grammar_mask_logits(const uint32_t *allowed, const kr_grammar_vocab *v, float *logits, int n_logits)
{
    for (int id = 0; id < n_logits; id++)
        if (id >= v->n_vocab || !(allowed[id >> 5] >> (id & 31) & 1)) logits[id] = -INFINITY;
}

int kr_matcher_accept_token(kr_matcher *m, const kr_grammar_vocab *v, int32_t id)
{
    if (m->dead || m->ended) return -1;
    int kind = id >= 0 && id < v->n_vocab ? v->kind[id] : GV_NEVER;
    if (kind == GV_END) {
        if (!kr_matcher_can_end(m)) {
            m->dead = 1;
            return -1;
        }
        m->ended = 1;
        return 0;
    }
    if (kind != GV_TEXT) {
        m->dead = 1;
        return -1;
    }
    return kr_matcher_feed_bytes(m, v->bytes + v->off[id], v->len[id]);
}
