/*
 * grammar-match.c - the matcher of kr-grammar.h: a pushdown automaton over the bytes of a JSON
 * document, restricted by a compiled schema (grammar.c). The stack holds one frame per open
 * construct (the root, each open object and array, and the key, string, number or literal
 * being read); a byte goes to the top frame, which consumes it, pushes a frame, or pops and
 * (numbers, literals: they have no closing byte) hands the byte to the frame below.
 *
 * The invariant everything rests on: every state a byte leads to can still be completed to a
 * document the schema accepts, so a decoder that only takes accepted bytes always has a way
 * to finish. Each rule below refuses a byte exactly when taking it would break that (a comma
 * when no more items or keys may follow, a closing brace while a required key is missing, a
 * key that can only become one already written, a digit past the cap, ...).
 * docs/structured-output.md has the automaton as a table.
 */
#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "kr-util.h"

/* gr_frame.sub per kind */
enum { GS_ROOT_VALUE, GS_ROOT_DONE };
enum { GS_OBJ_START, GS_OBJ_KEY, GS_OBJ_COLON, GS_OBJ_VALUE, GS_OBJ_NEXT };
enum { GS_ARR_START, GS_ARR_VALUE, GS_ARR_NEXT };
/* number: after '-', a lone 0, integer digits, '.', fraction digits, 'e', exponent sign,
 * exponent digits */
enum { GS_NUM_MINUS, GS_NUM_ZERO, GS_NUM_INT, GS_NUM_DOT, GS_NUM_FRAC, GS_NUM_E, GS_NUM_ESIGN, GS_NUM_EXP };
/* string escapes: none, after '\', then the four hex digits of \uXXXX. The *D state follows a
 * first digit d (surrogates \uD800-\uDFFF are refused: a lone one does not parse), the *Z
 * states follow zeros only (\u0000 is refused: C consumers would cut the string there). */
enum { GS_ESC_NONE, GS_ESC_BACK, GS_ESC_U1, GS_ESC_U2, GS_ESC_U2D, GS_ESC_U2Z, GS_ESC_U3, GS_ESC_U3Z, GS_ESC_U4, GS_ESC_U4Z };
/* key flags (gr_frame.sub of a GF_KEY) */
enum { GS_KEY_FREE = 1, /* may still become an additional property */
       GS_KEY_ESC = 2 /* the previous byte was an escaping backslash */ };

#define GR_KW_NODE 0xFFFF /* literal frame over true/false/null rather than a node's enum */

static int is_ws(uint8_t c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
static int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
static int is_hex(uint8_t c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

static gr_frame *push(kr_matcher *m, uint8_t kind, uint16_t node)
{
    gr_frame *f = &m->f[m->depth++];
    memset(f, 0, sizeof *f);
    f->kind = kind;
    f->node = node;
    return f;
}

/* A run of whitespace in frame f: bounded so that a model cannot pad forever. */
static int ws_step(const kr_matcher *m, gr_frame *f)
{
    if (f->ws >= m->g->lim.max_ws) return -1;
    f->ws++;
    return 0;
}

/* ------------------------------------------------------------------ literals */

static const gr_str *lit_base(const kr_grammar *g, const gr_frame *f)
{
    return g->lits + (f->node == GR_KW_NODE ? g->kw_lits : g->nodes[f->node].lits_off);
}

/* Byte `pos` of literal s, -1 past its end: within a range of candidates sharing `pos` bytes,
 * sorted bytewise (a prefix first), this is non-decreasing. */
static int lit_key(const kr_grammar *g, const gr_str *s, uint32_t pos)
{
    return s->len <= pos ? -1 : (uint8_t)g->text[s->off + pos];
}

/* Narrows candidates [*lo, *hi) to those whose byte `pos` is c; 0 when some remain. */
static int lit_narrow(const kr_grammar *g, const gr_str *L, uint32_t pos, uint8_t c, uint32_t *lo,
                      uint32_t *hi)
{
    uint32_t a = *lo, b = *hi;
    while (a < b) { /* first with key >= c */
        uint32_t mid = a + (b - a) / 2;
        if (lit_key(g, &L[mid], pos) < c) a = mid + 1;
        else b = mid;
    }
    uint32_t e = a;
    b = *hi;
    while (e < b) { /* first with key > c */
        uint32_t mid = e + (b - e) / 2;
        if (lit_key(g, &L[mid], pos) <= c) e = mid + 1;
        else b = mid;
    }
    if (a == e) return -1;
    *lo = a;
    *hi = e;
    return 0;
}

/* 1: a literal frame is done; -1: c was refused; 0: c was consumed and the frame stays. */
static int lit_step(kr_matcher *m, gr_frame *f, uint8_t c)
{
    const gr_str *L = lit_base(m->g, f);
    uint32_t lo = f->u.lit.lo, hi = f->u.lit.hi;
    if (lit_narrow(m->g, L, f->u.lit.pos, c, &lo, &hi) == 0) {
        f->u.lit.lo = (uint16_t)lo;
        f->u.lit.hi = (uint16_t)hi;
        f->u.lit.pos++;
        if (hi - lo == 1 && L[lo].len == f->u.lit.pos) m->depth--; /* nothing longer: done */
        return 0;
    }
    return L[f->u.lit.lo].len == f->u.lit.pos ? 1 : -1;
}

static int lit_start(kr_matcher *m, uint16_t node, uint32_t n, uint8_t c)
{
    gr_frame *f = push(m, GF_LITERAL, node);
    f->u.lit.hi = (uint16_t)n;
    return lit_step(m, f, c) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------ strings and keys */

/* The range the next UTF-8 continuation byte must be in (gr_frame.u8 bits 2-4). */
static const uint8_t u8_lo[5] = {0x80, 0xA0, 0x80, 0x90, 0x80};
static const uint8_t u8_hi[5] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};

/* A byte of string content that is not an escape: a continuation byte due, or the start of a
 * character (counted against max_chars). Refuses control characters, '"' and '\', and
 * anything that is not well-formed UTF-8 (overlongs, surrogates, past U+10FFFF). */
static int str_char(gr_frame *f, uint8_t c, uint32_t max_chars)
{
    if (f->u8 & 3) {
        int r = f->u8 >> 2;
        if (c < u8_lo[r] || c > u8_hi[r]) return -1;
        f->u8 = (uint8_t)((f->u8 & 3) - 1); /* later continuations: 80-BF */
        return 0;
    }
    if (c < 0x20 || c == '"' || c == '\\') return -1;
    if (f->n >= max_chars) return -1;
    int more, range = 0;
    if (c < 0x80) more = 0;
    else if (c >= 0xC2 && c <= 0xDF) more = 1;
    else if (c == 0xE0) more = 2, range = 1;
    else if (c == 0xED) more = 2, range = 2;
    else if (c >= 0xE1 && c <= 0xEF) more = 2;
    else if (c == 0xF0) more = 3, range = 3;
    else if (c >= 0xF1 && c <= 0xF3) more = 3;
    else if (c == 0xF4) more = 3, range = 4;
    else return -1;
    f->n++;
    f->u8 = (uint8_t)(more | range << 2);
    return 0;
}

/* The byte after a backslash, and the hex digits of \uXXXX. */
static int str_escape(gr_frame *f, uint8_t c)
{
    switch (f->sub) {
    case GS_ESC_BACK:
        if (c == 'u') { f->sub = GS_ESC_U1; return 0; }
        if (!strchr("\"\\/bfnrt", c) || !c) return -1;
        f->sub = GS_ESC_NONE;
        return 0;
    case GS_ESC_U1:
        if (!is_hex(c)) return -1;
        f->sub = c == 'd' || c == 'D' ? GS_ESC_U2D : c == '0' ? GS_ESC_U2Z : GS_ESC_U2;
        return 0;
    case GS_ESC_U2:
        if (!is_hex(c)) return -1;
        f->sub = GS_ESC_U3;
        return 0;
    case GS_ESC_U2D:
        if (c < '0' || c > '7') return -1;
        f->sub = GS_ESC_U3;
        return 0;
    case GS_ESC_U2Z:
        if (!is_hex(c)) return -1;
        f->sub = c == '0' ? GS_ESC_U3Z : GS_ESC_U3;
        return 0;
    case GS_ESC_U3:
    case GS_ESC_U3Z:
        if (!is_hex(c)) return -1;
        f->sub = f->sub == GS_ESC_U3Z && c == '0' ? GS_ESC_U4Z : GS_ESC_U4;
        return 0;
    case GS_ESC_U4:
    case GS_ESC_U4Z:
        if (!is_hex(c) || (f->sub == GS_ESC_U4Z && c == '0')) return -1;
        f->sub = GS_ESC_NONE;
        return 0;
    }
    return -1;
}

static int string_step(kr_matcher *m, gr_frame *f, uint8_t c)
{
    const gr_node *n = &m->g->nodes[f->node];
    if (f->sub != GS_ESC_NONE) return str_escape(f, c);
    if (!(f->u8 & 3) && c == '"') {
        if (f->n < n->min_len) return -1;
        m->depth--;
        return 0;
    }
    if (!(f->u8 & 3) && c == '\\') {
        if (f->n >= n->max_len) return -1;
        f->n++;
        f->sub = GS_ESC_BACK;
        return 0;
    }
    return str_char(f, c, n->max_len);
}

/* A key of the object below: either one of its declared names, matched byte for byte against
 * their encoded forms (candidates [lo, hi)), or, where the object allows them, an additional
 * key. Additional keys take no escapes, so a finished one equals a declared name exactly when
 * its bytes do, and is then that property. Alive while some candidate is unwritten or an
 * additional key is still possible (key_max exceeds every name: such a key can always grow
 * past them). */
static int key_step(kr_matcher *m, gr_frame *f, uint8_t c)
{
    const kr_grammar *g = m->g;
    gr_frame *obj = f - 1;
    const gr_node *n = &g->nodes[f->node];
    const gr_prop *P = g->props + n->props_off;
    uint32_t lo = f->u.lit.lo, hi = f->u.lit.hi, pos = f->u.lit.pos;
    if (c == '"' && !(f->sub & GS_KEY_ESC)) {
        uint16_t prop;
        if (lo < hi && P[lo].name.len == pos) {
            if (obj->u.seen >> lo & 1) return -1; /* written already */
            prop = (uint16_t)lo;
            obj->u.seen |= 1ull << lo;
        } else if ((f->sub & GS_KEY_FREE) && !(f->u8 & 3)) {
            prop = GR_ADDITIONAL;
        } else {
            return -1;
        }
        obj->prop = prop;
        obj->sub = GS_OBJ_COLON;
        m->depth--;
        return 0;
    }
    if (lo < hi) {
        /* names are stored as gr_str; narrow over their bytes */
        uint32_t a = lo, b = hi;
        while (a < b && (P[a].name.len <= pos || (uint8_t)g->text[P[a].name.off + pos] != c)) a++;
        b = a;
        while (b < hi && P[b].name.len > pos && (uint8_t)g->text[P[b].name.off + pos] == c) b++;
        lo = a, hi = b;
    }
    if ((f->sub & GS_KEY_FREE) && str_char(f, c, n->key_max) != 0) f->sub &= (uint8_t)~GS_KEY_FREE;
    if (f->sub & GS_KEY_ESC) f->sub &= (uint8_t)~GS_KEY_ESC;
    else if (c == '\\') f->sub |= GS_KEY_ESC;
    f->u.lit.lo = (uint16_t)lo;
    f->u.lit.hi = (uint16_t)hi;
    f->u.lit.pos = pos + 1;
    if (lo < hi) { /* some name in [lo, hi) not written yet? */
        uint64_t range = (hi >= 64 ? ~0ull : (1ull << hi) - 1) & ~((1ull << lo) - 1);
        if (range & ~obj->u.seen) return 0;
    }
    return f->sub & GS_KEY_FREE ? 0 : -1;
}

/* ------------------------------------------------------------------ numbers */

/* 1: the number is done (c is not part of it); -1: refused; 0: consumed. */
static int number_step(kr_matcher *m, gr_frame *f, uint8_t c)
{
    const kr_grammar_limits *L = &m->g->lim;
    int real = (m->g->nodes[f->node].types & GR_NUMBER) != 0; /* fraction and exponent allowed */
    int d = is_digit(c);
    switch (f->sub) {
    case GS_NUM_MINUS:
        if (!d) return -1;
        f->sub = c == '0' ? GS_NUM_ZERO : GS_NUM_INT;
        f->n = 1;
        return 0;
    case GS_NUM_INT:
        if (d) {
            if (f->n >= (uint32_t)L->max_int_digits) return -1;
            f->n++;
            return 0;
        }
        /* fall through */
    case GS_NUM_ZERO:
        if (real && c == '.') { f->sub = GS_NUM_DOT; f->n = 0; return 0; }
        if (real && (c == 'e' || c == 'E')) { f->sub = GS_NUM_E; return 0; }
        return d ? -1 : 1; /* no digit after a leading 0 */
    case GS_NUM_DOT:
        if (!d) return -1;
        f->sub = GS_NUM_FRAC;
        f->n = 1;
        return 0;
    case GS_NUM_FRAC:
        if (d) {
            if (f->n >= (uint32_t)L->max_frac_digits) return -1;
            f->n++;
            return 0;
        }
        if (c == 'e' || c == 'E') { f->sub = GS_NUM_E; return 0; }
        return 1;
    case GS_NUM_E:
        if (c == '+' || c == '-') { f->sub = GS_NUM_ESIGN; return 0; }
        /* fall through */
    case GS_NUM_ESIGN:
        if (!d) return -1;
        f->sub = GS_NUM_EXP;
        f->n = 1;
        return 0;
    case GS_NUM_EXP:
        if (d) {
            if (f->n >= (uint32_t)L->max_exp_digits) return -1;
            f->n++;
            return 0;
        }
        return 1;
    }
    return -1;
}

static int number_can_end(const gr_frame *f)
{
    return f->sub == GS_NUM_ZERO || f->sub == GS_NUM_INT || f->sub == GS_NUM_FRAC || f->sub == GS_NUM_EXP;
}

/* ------------------------------------------------------------------ values and containers */

/* The first byte of a value of `node`, read by the frame on top (which has already moved past
 * the value: a child's frame is simply popped when it ends). */
static int value_start(kr_matcher *m, int32_t node, uint8_t c)
{
    const kr_grammar *g = m->g;
    const gr_node *n = &g->nodes[node];
    if (n->n_lits) return lit_start(m, (uint16_t)node, n->n_lits, c);
    int room = m->depth - 1 < g->lim.max_depth; /* frames below the top: root + containers */
    gr_frame *f;
    switch (c) {
    case '{':
        if (!(n->types & GR_OBJECT) || !room) return -1;
        push(m, GF_OBJECT, (uint16_t)node);
        return 0;
    case '[':
        if (!(n->types & GR_ARRAY) || !room) return -1;
        push(m, GF_ARRAY, (uint16_t)node);
        return 0;
    case '"':
        if (!(n->types & GR_STRING)) return -1;
        push(m, GF_STRING, (uint16_t)node);
        return 0;
    case 't':
    case 'f':
        if (!(n->types & GR_BOOLEAN)) return -1;
        return lit_start(m, GR_KW_NODE, 3, c);
    case 'n':
        if (!(n->types & GR_NULL)) return -1;
        return lit_start(m, GR_KW_NODE, 3, c);
    default:
        if (!(n->types & (GR_INTEGER | GR_NUMBER)) || (c != '-' && !is_digit(c))) return -1;
        f = push(m, GF_NUMBER, (uint16_t)node);
        f->sub = GS_NUM_MINUS;
        return c == '-' ? 0 : number_step(m, f, c);
    }
}

static int object_step(kr_matcher *m, gr_frame *f, uint8_t c)
{
    const kr_grammar *g = m->g;
    const gr_node *n = &g->nodes[f->node];
    if (is_ws(c)) return ws_step(m, f);
    f->ws = 0;
    uint64_t all = n->n_props >= 64 ? ~0ull : (1ull << n->n_props) - 1;
    gr_frame *k;
    switch (f->sub) {
    case GS_OBJ_START:
        if (c == '}' && !n->required) { m->depth--; return 0; }
        if (c != '"' || (!n->n_props && n->additional < 0)) return -1;
        goto key;
    case GS_OBJ_KEY:
        if (c != '"') return -1;
    key:
        k = push(m, GF_KEY, f->node);
        k->sub = n->additional >= 0 ? GS_KEY_FREE : 0;
        k->u.lit.hi = (uint16_t)n->n_props;
        return 0;
    case GS_OBJ_COLON:
        if (c != ':') return -1;
        f->sub = GS_OBJ_VALUE;
        return 0;
    case GS_OBJ_VALUE:
        f->sub = GS_OBJ_NEXT;
        return value_start(m, f->prop == GR_ADDITIONAL ? n->additional : g->props[n->props_off + f->prop].node, c);
    case GS_OBJ_NEXT:
        if (c == ',' && (n->additional >= 0 || (f->u.seen & all) != all)) { f->sub = GS_OBJ_KEY; return 0; }
        if (c == '}' && !(n->required & ~f->u.seen)) { m->depth--; return 0; }
        return -1;
    }
    return -1;
}

static int array_step(kr_matcher *m, gr_frame *f, uint8_t c)
{
    const gr_node *n = &m->g->nodes[f->node];
    if (is_ws(c)) return ws_step(m, f);
    f->ws = 0;
    switch (f->sub) {
    case GS_ARR_START:
        if (c == ']' && !n->min_items) { m->depth--; return 0; }
        if (!n->max_items) return -1;
        /* fall through */
    case GS_ARR_VALUE:
        f->sub = GS_ARR_NEXT;
        f->n++;
        return value_start(m, n->items, c);
    case GS_ARR_NEXT:
        if (c == ',' && f->n < n->max_items) { f->sub = GS_ARR_VALUE; return 0; }
        if (c == ']' && f->n >= n->min_items) { m->depth--; return 0; }
        return -1;
    }
    return -1;
}

/* One byte into m, in place; -1 leaves m in no defined state. */
static int step(kr_matcher *m, uint8_t c)
{
    for (;;) {
        gr_frame *f = &m->f[m->depth - 1];
        int rc;
        switch (f->kind) {
        case GF_ROOT:
            if (is_ws(c)) return ws_step(m, f);
            if (f->sub != GS_ROOT_VALUE) return -1;
            f->ws = 0;
            f->sub = GS_ROOT_DONE;
            return value_start(m, m->g->root, c);
        case GF_OBJECT:
            return object_step(m, f, c);
        case GF_KEY:
            return key_step(m, f, c);
        case GF_ARRAY:
            return array_step(m, f, c);
        case GF_STRING:
            return string_step(m, f, c);
        case GF_NUMBER:
            rc = number_step(m, f, c);
            break;
        case GF_LITERAL:
            rc = lit_step(m, f, c);
            break;
        default:
            return -1;
        }
        if (rc <= 0) return rc;
        m->depth--; /* a number or literal ended before c: c belongs to the frame below */
    }
}

int gr_step(kr_matcher *dst, const kr_matcher *src, uint8_t c)
{
    dst->g = src->g;
    dst->depth = src->depth;
    dst->dead = src->dead;
    dst->ended = src->ended;
    memcpy(dst->f, src->f, (size_t)src->depth * sizeof src->f[0]);
    return step(dst, c);
}

/* ------------------------------------------------------------------ shortest completion */

#define GR_INF (UINT32_MAX / 2)

static uint32_t sat(uint64_t v) { return v > GR_INF ? GR_INF : (uint32_t)v; }

/* "name": value, for property i */
static uint64_t prop_cost(const kr_grammar *g, const gr_node *n, uint32_t i)
{
    const gr_prop *p = &g->props[n->props_off + i];
    return (uint64_t)p->name.len + 3 + g->nodes[p->node].min_doc;
}

/* The rest of an object once its current value is written: the missing required properties,
 * each after a comma, then '}'. */
static uint64_t obj_after(const kr_grammar *g, const gr_node *n, uint64_t seen)
{
    uint64_t need = n->required & ~seen, cost = 1;
    for (uint32_t i = 0; i < n->n_props; i++)
        if (need >> i & 1) cost += 1 + prop_cost(g, n, i);
    return cost;
}

uint32_t gr_node_min_doc(const kr_grammar *g, const gr_node *n)
{
    uint64_t best = GR_INF;
    for (uint32_t i = 0; i < n->n_lits; i++)
        if (g->lits[n->lits_off + i].len < best) best = g->lits[n->lits_off + i].len;
    if (n->n_lits) return sat(best);
    if (n->types & (GR_INTEGER | GR_NUMBER)) best = 1;
    if ((n->types & (GR_NULL | GR_BOOLEAN)) && best > 4) best = 4;
    if ((n->types & GR_STRING) && 2ull + n->min_len < best) best = 2ull + n->min_len;
    if (n->types & GR_ARRAY) {
        uint64_t c = n->min_items ? 1 + (uint64_t)n->min_items * (1 + g->nodes[n->items].min_doc) : 2;
        if (c < best) best = c;
    }
    if (n->types & GR_OBJECT) {
        uint64_t c = n->required ? obj_after(g, n, 0) : 2; /* '{' and the commas' count: one each */
        if (c < best) best = c;
    }
    return sat(best);
}

/* An array's rest once it holds `items` items: what minItems still needs, then ']'. */
static uint64_t arr_after(const kr_grammar *g, const gr_node *n, uint32_t items)
{
    if (items >= n->min_items) return 1;
    return (uint64_t)(n->min_items - items) * (1 + g->nodes[n->items].min_doc) + 1;
}

/* "": value for an additional key: one byte more when "" is a declared name already written */
static uint64_t free_key_cost(const kr_grammar *g, const gr_node *n, uint64_t seen)
{
    int empty_taken = n->n_props && g->props[n->props_off].name.len == 0 && (seen & 1);
    return 3ull + empty_taken + g->nodes[n->additional].min_doc;
}

/* The object below key frame k, with the key finished: the key's rest, ':', the value, the
 * object's rest. The cheapest of the declared names still possible and an additional key. */
static uint64_t key_rest(const kr_grammar *g, const gr_frame *k)
{
    const gr_frame *obj = k - 1;
    const gr_node *n = &g->nodes[k->node];
    const gr_prop *P = g->props + n->props_off;
    uint64_t best = GR_INF;
    for (uint32_t i = k->u.lit.lo; i < k->u.lit.hi; i++) {
        if (obj->u.seen >> i & 1) continue;
        uint64_t c = (uint64_t)P[i].name.len - k->u.lit.pos + 2 + g->nodes[P[i].node].min_doc +
                     obj_after(g, n, obj->u.seen | 1ull << i);
        if (c < best) best = c;
    }
    if (k->sub & GS_KEY_FREE) {
        uint64_t c = (uint64_t)(k->u8 & 3) + 2 + g->nodes[n->additional].min_doc + obj_after(g, n, obj->u.seen);
        if (k->u.lit.lo < k->u.lit.hi && P[k->u.lit.lo].name.len == k->u.lit.pos) c++; /* grow past a name */
        if (c < best) best = c;
    }
    return best;
}

static uint64_t frame_rest(const kr_grammar *g, const gr_frame *f)
{
    const gr_node *n = &g->nodes[f->node == GR_KW_NODE ? 0 : f->node];
    const gr_prop *P = g->props + n->props_off;
    uint64_t best;
    switch (f->kind) {
    case GF_ROOT:
        return f->sub == GS_ROOT_VALUE ? g->nodes[g->root].min_doc : 0;
    case GF_OBJECT:
        switch (f->sub) {
        case GS_OBJ_START: /* no comma before the first key */
            return n->required ? obj_after(g, n, 0) - 1 : 1;
        case GS_OBJ_KEY: /* after a comma: some key, even when none is required */
            if (n->required & ~f->u.seen) return obj_after(g, n, f->u.seen) - 1;
            best = n->additional >= 0 ? free_key_cost(g, n, f->u.seen) : GR_INF;
            for (uint32_t i = 0; i < n->n_props; i++)
                if (!(f->u.seen >> i & 1) && prop_cost(g, n, i) < best) best = prop_cost(g, n, i);
            return best + 1;
        case GS_OBJ_COLON:
        case GS_OBJ_VALUE:
            return (f->sub == GS_OBJ_COLON) +
                   (uint64_t)g->nodes[f->prop == GR_ADDITIONAL ? n->additional : P[f->prop].node].min_doc +
                   obj_after(g, n, f->u.seen);
        default:
            return obj_after(g, n, f->u.seen);
        }
    case GF_KEY:
        return key_rest(g, f);
    case GF_ARRAY:
        if (f->sub == GS_ARR_START) return n->min_items ? arr_after(g, n, 0) - 1 : 1; /* no first comma */
        if (f->sub == GS_ARR_VALUE) return g->nodes[n->items].min_doc + arr_after(g, n, f->n + 1);
        return arr_after(g, n, f->n);
    case GF_STRING: {
        static const uint8_t esc_left[] = {0, 1, 4, 3, 3, 3, 2, 2, 1, 1}; /* by GS_ESC_* */
        uint64_t chars = f->n < n->min_len ? n->min_len - f->n : 0;
        return esc_left[f->sub] + (f->u8 & 3) + chars + 1;
    }
    case GF_NUMBER:
        return f->sub == GS_NUM_MINUS || f->sub == GS_NUM_DOT || f->sub == GS_NUM_E || f->sub == GS_NUM_ESIGN;
    case GF_LITERAL: {
        const gr_str *L = lit_base(g, f);
        best = GR_INF;
        for (uint32_t i = f->u.lit.lo; i < f->u.lit.hi; i++)
            if (L[i].len - f->u.lit.pos < best) best = L[i].len - f->u.lit.pos;
        return best;
    }
    }
    return GR_INF;
}

uint32_t kr_matcher_remaining(const kr_matcher *m)
{
    if (m->dead) return GR_INF;
    if (m->ended) return 0;
    uint64_t total = 0;
    for (int i = 0; i < m->depth; i++) {
        const gr_frame *f = &m->f[i];
        /* an object reading a key: the key frame counts for both */
        if (f->kind == GF_OBJECT && i + 1 < m->depth && m->f[i + 1].kind == GF_KEY) continue;
        total += frame_rest(m->g, f);
    }
    return sat(total);
}

int gr_plain_room(const kr_matcher *m, uint32_t *room, uint32_t *need)
{
    const gr_frame *f = &m->f[m->depth - 1];
    const gr_node *n = &m->g->nodes[f->node == GR_KW_NODE ? 0 : f->node];
    if (m->dead || m->ended || (f->u8 & 3)) return 0;
    if (f->kind == GF_STRING && f->sub == GS_ESC_NONE) {
        *room = n->max_len - f->n;
        *need = f->n < n->min_len ? n->min_len - f->n : 0;
        return GR_PLAIN_STRING;
    }
    /* a free key: a declared name it may also become is shorter than key_max, so the free
     * path decides alone whether plain text is accepted */
    if (f->kind == GF_KEY && (f->sub & GS_KEY_FREE) && !(f->sub & GS_KEY_ESC)) {
        *room = n->key_max - f->n;
        *need = 0;
        return GR_PLAIN_KEY;
    }
    return 0;
}

/* ------------------------------------------------------------------ API */

void kr_matcher_reset(kr_matcher *m)
{
    m->depth = 0;
    m->dead = m->ended = 0;
    push(m, GF_ROOT, 0);
}

int kr_matcher_create(const kr_grammar *g, kr_matcher **out, char *err)
{
    kr_matcher *m = malloc(sizeof *m);
    if (!m) return kr_errf(err, "grammar: matcher: out of memory");
    m->g = g;
    kr_matcher_reset(m);
    *out = m;
    return 0;
}

void kr_matcher_free(kr_matcher *m) { free(m); }

void kr_matcher_copy(kr_matcher *dst, const kr_matcher *src)
{
    dst->g = src->g;
    dst->depth = src->depth;
    dst->dead = src->dead;
    dst->ended = src->ended;
    memcpy(dst->f, src->f, (size_t)src->depth * sizeof src->f[0]);
}

int kr_matcher_feed(kr_matcher *m, uint8_t byte)
{
    if (m->dead || m->ended) return -1;
    if (step(m, byte) != 0) {
        m->dead = 1;
        return -1;
    }
    return 0;
}

int kr_matcher_feed_bytes(kr_matcher *m, const char *bytes, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (kr_matcher_feed(m, (uint8_t)bytes[i])) return -1;
    return 0;
}

int kr_matcher_can_end(const kr_matcher *m)
{
    if (m->dead || m->ended) return 0;
    const gr_frame *f = &m->f[m->depth - 1];
    if (m->depth == 1) return f->sub == GS_ROOT_DONE;
    if (m->depth != 2) return 0;
    if (f->kind == GF_NUMBER) return number_can_end(f);
    if (f->kind == GF_LITERAL) return lit_base(m->g, f)[f->u.lit.lo].len == f->u.lit.pos;
    return 0;
}

int kr_matcher_closed(const kr_matcher *m)
{
    return !m->dead && !m->ended && m->depth == 1 && m->f[0].sub == GS_ROOT_DONE;
}

int kr_matcher_dead(const kr_matcher *m) { return m->dead; }
int kr_matcher_ended(const kr_matcher *m) { return m->ended; }
