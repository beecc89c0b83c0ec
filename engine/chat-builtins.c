/*
 * chat-builtins.c - what a chat template can call: the filters (`x|trim`), tests (`x is
 * defined`), methods (`s.strip()`, `d.get(k)`, `loop.cycle(a, b)`) and global functions
 * (`range`, `namespace`, `dict`, `raise_exception`) of the subset, with Python's semantics and
 * argument binding (positional or by name, as jinja2 calls them). Each is one small function
 * found by name in a table; docs/chat-templates.md lists them. Not here: user-defined filters
 * or anything jinja2 has beyond that list (the parser refuses unknown filter and test names).
 * Part of the chat template renderer (chat-int.h lists the parts); test: ctest -R test_chat.
 */
#include "chat-int.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ arguments */

/* Binds a call's arguments to the parameter list `params` (names; positional order), as
 * Python does: *vals[k] is NULL for a parameter not given. */
static int bind_args(rctx *c, const node *at, const char *fname, const args *a, const char *const *params,
                     const value **vals)
{
    int np = 0;
    while (params[np]) vals[np] = NULL, np++;
    if (a->npos > np) return chat_rerr(c, at, "%s() takes at most %d argument%s (%d given)", fname, np, np == 1 ? "" : "s", a->npos);
    for (int i = 0; i < a->npos; i++) vals[i] = &a->pos[i];
    for (int i = 0; i < a->nkw; i++) {
        int k = 0;
        while (k < np && strcmp(params[k], a->kwn[i])) k++;
        if (k == np) return chat_rerr(c, at, "%s() got an unexpected keyword argument '%s'", fname, a->kwn[i]);
        if (vals[k]) return chat_rerr(c, at, "%s() got multiple values for argument '%s'", fname, a->kwn[i]);
        vals[k] = &a->kwv[i];
    }
    return 0;
}

static int need_str(rctx *c, const node *at, const char *what, const value *v)
{
    if (v->t == V_STR) return 0;
    if (v->t == V_UNDEF) return chat_undef_err(c, at, v);
    return chat_rerr(c, at, "%s must be a string, not %s", what, chat_type_name(v));
}

static int opt_int(rctx *c, const node *at, const char *what, const value *v, int64_t dflt, int64_t *out)
{
    if (!v || v->t == V_NONE) { *out = dflt; return 0; }
    if (!is_intlike(v)) return chat_rerr(c, at, "%s must be an integer, not %s", what, chat_type_name(v));
    *out = v->u.i;
    return 0;
}

/* ------------------------------------------------------------------ str and dict helpers */

/* Is code point cp one of the characters of set (a string); NULL set: whitespace. */
static int in_chars(int32_t cp, const value *set)
{
    if (!set) return py_isspace(cp);
    for (size_t i = 0, l; i < set->u.s.n; i += l)
        if (u8_decode(set->u.s.p + i, set->u.s.n - i, &l) == cp) return 1;
    return 0;
}

/* str.strip / lstrip / rstrip (which: 3 both ends, 1 left, 2 right). */
static void strip_str(const value *s, const value *set, int which, value *out)
{
    const char *p = s->u.s.p;
    size_t b = 0, e = s->u.s.n;
    if (which & 1)
        for (size_t l; b < e; b += l)
            if (!in_chars(u8_decode(p + b, e - b, &l), set)) break;
    if (which & 2) {
        size_t last = b;
        for (size_t i = b, l; i < e; i += l)
            if (!in_chars(u8_decode(p + i, e - i, &l), set)) last = i + l;
        e = last;
    }
    *out = v_str(p + b, e - b);
}

enum { CASE_UPPER, CASE_LOWER, CASE_CAPITALIZE, CASE_TITLE, CASE_TITLE_FILTER };

static int is_cased(int32_t cp)
{
    if (cp < 0) return 0;
    utf8proc_category_t k = utf8proc_category(cp);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

/* Case mapping by code point (utf8proc's simple mappings; Python uses the full ones, which
 * differ for a few characters such as U+00DF). */
static int recase(rctx *c, const node *at, const value *s, int mode, value *out)
{
    char *o = chat_rstr(c, at, s->u.s.n * 2 + 8);
    if (!o) return -1;
    size_t k = 0;
    int prev_cased = 0, first = 1, word_start = 1;
    for (size_t i = 0, l; i < s->u.s.n; i += l) {
        int32_t cp = u8_decode(s->u.s.p + i, s->u.s.n - i, &l), m = cp;
        if (cp >= 0) {
            switch (mode) {
            case CASE_UPPER: m = utf8proc_toupper(cp); break;
            case CASE_LOWER: m = utf8proc_tolower(cp); break;
            case CASE_CAPITALIZE: m = first ? utf8proc_totitle(cp) : utf8proc_tolower(cp); break;
            case CASE_TITLE: m = prev_cased ? utf8proc_tolower(cp) : utf8proc_totitle(cp); break;
            case CASE_TITLE_FILTER: {
                int sep = py_isspace(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<';
                m = sep ? cp : word_start ? utf8proc_toupper(cp) : utf8proc_tolower(cp);
                word_start = sep;
                break;
            }
            }
        }
        prev_cased = is_cased(cp);
        first = 0;
        char e[8];
        size_t el = u8_encode(m, e);
        if (k + el > s->u.s.n * 2 + 8) return chat_rerr(c, at, "case mapping grew the string too much");
        memcpy(o + k, e, el);
        k += el;
    }
    o[k] = 0;
    *out = v_str(o, k);
    return 0;
}

/* str.replace(old, new, count) */
static int replace_str(rctx *c, const node *at, const value *s, const value *old, const value *nw, int64_t count,
                       value *out)
{
    sbuf b = {.limit = CHAT_MAX_OUTPUT};
    const char *p = s->u.s.p;
    size_t n = s->u.s.n, i = 0;
    int64_t done = 0;
    if (!old->u.s.n) { /* Python inserts `new` before every character and at the end */
        for (size_t l; i <= n && (count < 0 || done < count); i += l, done++) {
            sb_put(&b, nw->u.s.p, nw->u.s.n);
            if (i == n) { i = n + 1; break; }
            u8_decode(p + i, n - i, &l);
            sb_put(&b, p + i, l);
        }
        if (i <= n) sb_put(&b, p + i, n - i);
        return chat_sb_to_value(c, at, &b, out);
    }
    size_t run = 0;
    while (i + old->u.s.n <= n && (count < 0 || done < count)) {
        if (memcmp(p + i, old->u.s.p, old->u.s.n)) { i++; continue; }
        sb_put(&b, p + run, i - run);
        sb_put(&b, nw->u.s.p, nw->u.s.n);
        i += old->u.s.n;
        run = i;
        done++;
    }
    sb_put(&b, p + run, n - run);
    return chat_sb_to_value(c, at, &b, out);
}

/* A list being built in the render arena: 8 items, doubled when full (old copies stay). */
typedef struct vgrow { value *v; size_t n, cap; } vgrow;

static int vgrow_init(rctx *c, const node *at, vgrow *g)
{
    g->n = 0, g->cap = 8;
    g->v = chat_ralloc(c, at, g->cap * sizeof *g->v);
    return g->v ? 0 : -1;
}

static int vgrow_push(rctx *c, const node *at, vgrow *g, value x)
{
    if (g->n == g->cap) {
        value *nv = chat_ralloc(c, at, g->cap * 2 * sizeof *nv);
        if (!nv) return -1;
        memcpy(nv, g->v, g->n * sizeof *nv);
        g->v = nv, g->cap *= 2;
    }
    g->v[g->n++] = x;
    return 0;
}

/* str.split(None, maxsplit): runs of whitespace separate, none at either end. */
static int split_space(rctx *c, const node *at, const char *p, size_t n, int64_t maxsplit, vgrow *g)
{
    size_t i = 0, l;
    int64_t splits = 0;
    for (;;) {
        while (i < n && py_isspace(u8_decode(p + i, n - i, &l))) i += l;
        if (i >= n) return 0;
        if (maxsplit >= 0 && splits == maxsplit) return vgrow_push(c, at, g, v_str(p + i, py_rstrip_len(p + i, n - i)));
        size_t b = i;
        while (i < n && !py_isspace(u8_decode(p + i, n - i, &l))) i += l;
        if (vgrow_push(c, at, g, v_str(p + b, i - b))) return -1;
        splits++;
    }
}

/* str.split(sep=None, maxsplit=-1) */
static int split_str(rctx *c, const node *at, const value *s, const value *sep, int64_t maxsplit, value *out)
{
    const char *p = s->u.s.p;
    size_t n = s->u.s.n;
    vgrow g;
    if (vgrow_init(c, at, &g)) return -1;
    if (!sep) {
        if (split_space(c, at, p, n, maxsplit, &g)) return -1;
    } else {
        if (!sep->u.s.n) return chat_rerr(c, at, "split(): empty separator");
        size_t run = 0, i = 0;
        int64_t splits = 0;
        while (i + sep->u.s.n <= n && (maxsplit < 0 || splits < maxsplit)) {
            if (memcmp(p + i, sep->u.s.p, sep->u.s.n)) { i++; continue; }
            if (vgrow_push(c, at, &g, v_str(p + run, i - run))) return -1;
            i += sep->u.s.n;
            run = i;
            splits++;
        }
        if (vgrow_push(c, at, &g, v_str(p + run, n - run))) return -1;
    }
    vlist *l = chat_ralloc(c, at, sizeof *l);
    if (!l) return -1;
    l->n = g.n, l->v = g.v, l->tuple = 0;
    *out = v_list(l);
    return 0;
}

static int dict_pairs(rctx *c, const node *at, const vdict *d, value *out)
{
    vlist *l = chat_mk_list(c, at, d->n, 0);
    if (!l) return -1;
    for (size_t i = 0; i < d->n; i++) {
        vlist *t = chat_mk_list(c, at, 2, 1);
        if (!t) return -1;
        t->v[0] = d->k[i], t->v[1] = d->v[i];
        l->v[i] = v_list(t);
    }
    *out = v_list(l);
    return 0;
}

/* Tables are scanned linearly: they are small (27 entries at most), filters and tests are
 * looked up once, when a template is parsed, and a method call costs what a chain of strcmp
 * would; unsorted, a table keeps aliases (d, default) and families next to each other. */
static const chat_builtin *builtin_find(const chat_builtin *t, size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(t[i].name, name)) return &t[i];
    return NULL;
}

#define COUNT(t) (sizeof(t) / sizeof((t)[0]))

/* ------------------------------------------------------------------ filters */

static int no_args(rctx *c, const node *at, const char *name, const args *a)
{
    if (a->npos || a->nkw) return chat_rerr(c, at, "filter '%s' takes no arguments", name);
    return 0;
}

static int f_trim(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"chars", NULL};
    const value *v[1];
    value s;
    if (bind_args(c, at, name, a, ps, v)) return -1;
    const value *set = v[0] && v[0]->t != V_NONE ? v[0] : NULL;
    if (set && need_str(c, at, "trim argument", set)) return -1;
    if (chat_to_str(c, at, subj, &s)) return -1;
    strip_str(&s, set, 3, out);
    return 0;
}

/* length, count */
static int f_length(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    if (no_args(c, at, name, a)) return -1;
    switch (subj->t) {
    case V_STR: *out = v_int((int64_t)u8_count(subj->u.s.p, subj->u.s.n)); return 0;
    case V_LIST: *out = v_int((int64_t)subj->u.l->n); return 0;
    case V_DICT: *out = v_int((int64_t)subj->u.d->n); return 0;
    case V_UNDEF: *out = v_int(0); return 0;
    case V_LOOP: *out = v_int((int64_t)subj->u.lp->n); return 0;
    default: return chat_rerr(c, at, "object of type '%s' has no len()", chat_type_name(subj));
    }
}

static int f_tojson(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"indent", NULL};
    const value *v[1];
    char ind[64];
    const char *indent = NULL;
    if (bind_args(c, at, name, a, ps, v)) return -1;
    if (v[0] && is_intlike(v[0])) {
        int64_t k = v[0]->u.i < 0 ? 0 : v[0]->u.i;
        if (k > 32) return chat_rerr(c, at, "tojson: indent above 32 is not supported");
        memset(ind, ' ', (size_t)k);
        ind[k] = 0;
        indent = ind;
    } else if (v[0] && v[0]->t == V_STR) {
        if (v[0]->u.s.n >= sizeof ind) return chat_rerr(c, at, "tojson: indent string too long");
        memcpy(ind, v[0]->u.s.p, v[0]->u.s.n);
        ind[v[0]->u.s.n] = 0;
        indent = ind;
    } else if (v[0] && v[0]->t != V_NONE) {
        return chat_rerr(c, at, "tojson: indent must be an integer or a string, not %s", chat_type_name(v[0]));
    }
    sbuf b = {.limit = CHAT_MAX_OUTPUT};
    if (chat_json_into(c, at, &b, subj, indent, 0)) { free(b.p); return -1; }
    return chat_sb_to_value(c, at, &b, out);
}

/* string, safe */
static int f_string(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    if (no_args(c, at, name, a)) return -1;
    return chat_to_str(c, at, subj, out);
}

/* lower, upper, capitalize, title; arg: the CASE_ mode */
static int f_recase(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    value s;
    if (no_args(c, at, name, a)) return -1;
    if (chat_to_str(c, at, subj, &s)) return -1;
    return recase(c, at, &s, arg, out);
}

/* default, d */
static int f_default(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"default_value", "boolean", NULL};
    const value *v[2];
    if (bind_args(c, at, name, a, ps, v)) return -1;
    int use = subj->t == V_UNDEF || (v[1] && chat_truthy(v[1]) && !chat_truthy(subj));
    *out = use ? (v[0] ? *v[0] : v_str("", 0)) : *subj;
    return 0;
}

static int f_first(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    vlist *l;
    if (no_args(c, at, name, a) || chat_iterate(c, at, subj, &l)) return -1;
    *out = l->n ? l->v[0] : v_undef("first item");
    return 0;
}

static int f_last(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    vlist *l;
    if (no_args(c, at, name, a)) return -1;
    if (subj->t == V_DICT) return chat_rerr(c, at, "last: 'dict' object is not reversible");
    if (chat_iterate(c, at, subj, &l)) return -1;
    *out = l->n ? l->v[l->n - 1] : v_undef("last item");
    return 0;
}

/* list, reverse (arg 1; a string reversed stays a string) */
static int f_list(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    vlist *l;
    if (no_args(c, at, name, a)) return -1;
    if (arg && subj->t == V_STR) {
        value m1 = v_int(-1);
        const value *sl[3] = {NULL, NULL, &m1};
        return chat_get_slice(c, at, subj, sl, out);
    }
    if (chat_iterate(c, at, subj, &l)) return -1;
    vlist *r = chat_mk_list(c, at, l->n, 0);
    if (!r) return -1;
    for (size_t i = 0; i < l->n; i++) r->v[i] = arg ? l->v[l->n - 1 - i] : l->v[i];
    *out = v_list(r);
    return 0;
}

static int f_join(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"d", "attribute", NULL};
    const value *v[2];
    vlist *l;
    value sep = v_str("", 0);
    if (bind_args(c, at, name, a, ps, v)) return -1;
    if (v[1] && v[1]->t != V_NONE) return chat_rerr(c, at, "join(attribute=...) is not supported");
    if (v[0] && chat_to_str(c, at, v[0], &sep)) return -1;
    if (chat_iterate(c, at, subj, &l)) return -1;
    sbuf b = {.limit = CHAT_MAX_OUTPUT};
    for (size_t i = 0; i < l->n; i++) {
        if (i) sb_put(&b, sep.u.s.p, sep.u.s.n);
        if (chat_str_into(c, at, &b, &l->v[i], 0, 0)) { free(b.p); return -1; }
    }
    return chat_sb_to_value(c, at, &b, out);
}

static int f_items(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    if (no_args(c, at, name, a)) return -1;
    if (subj->t == V_UNDEF) { *out = v_list(chat_mk_list(c, at, 0, 0)); return out->u.l ? 0 : -1; }
    if (subj->t != V_DICT) return chat_rerr(c, at, "items: can only get item pairs from a mapping, not %s", chat_type_name(subj));
    return dict_pairs(c, at, subj->u.d, out);
}

static int f_replace(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"old", "new", "count", NULL};
    const value *v[3];
    value s;
    int64_t count = -1;
    if (bind_args(c, at, name, a, ps, v)) return -1;
    if (!v[0] || !v[1]) return chat_rerr(c, at, "replace needs old and new strings");
    if (chat_to_str(c, at, subj, &s) || need_str(c, at, "replace argument", v[0]) || need_str(c, at, "replace argument", v[1]) ||
        opt_int(c, at, "count", v[2], -1, &count))
        return -1;
    return replace_str(c, at, &s, v[0], v[1], count, out);
}

/* int(s) or float(s) of a string, as jinja2's filters read one: dflt when it is not a number. */
static value parse_number(const value *str, int is_int, value dflt)
{
    char buf[64];
    value t;
    strip_str(str, NULL, 3, &t);
    if (t.u.s.n == 0 || t.u.s.n >= sizeof buf) return dflt;
    memcpy(buf, t.u.s.p, t.u.s.n);
    buf[t.u.s.n] = 0;
    char *end;
    errno = 0;
    long long iv = strtoll(buf, &end, 10);
    if (!*end && !errno) return is_int ? v_int(iv) : v_float((double)iv);
    double fv = strtod(buf, &end);
    if (!*end && isfinite(fv)) return is_int ? (fabs(fv) < 9.2e18 ? v_int((int64_t)fv) : dflt) : v_float(fv);
    return dflt;
}

/* int (arg 1), float (arg 0) */
static int f_number(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"default", NULL};
    const value *v[1];
    if (bind_args(c, at, name, a, ps, v)) return -1;
    value dflt = v[0] ? *v[0] : arg ? v_int(0) : v_float(0);
    if (is_num(subj)) {
        if (!arg) *out = v_float(num(subj));
        else if (is_intlike(subj)) *out = v_int(subj->u.i);
        else *out = isfinite(subj->u.f) && fabs(subj->u.f) < 9.2e18 ? v_int((int64_t)subj->u.f) : dflt;
        return 0;
    }
    *out = subj->t == V_STR ? parse_number(subj, arg, dflt) : dflt;
    return 0;
}

static int f_abs(rctx *c, const node *at, const char *name, const value *subj, const args *a, int arg, value *out)
{
    if (no_args(c, at, name, a)) return -1;
    if (subj->t == V_FLOAT) { *out = v_float(fabs(subj->u.f)); return 0; }
    if (is_intlike(subj)) {
        if (subj->u.i == INT64_MIN) return chat_rerr(c, at, "integer overflow in abs");
        *out = v_int(subj->u.i < 0 ? -subj->u.i : subj->u.i);
        return 0;
    }
    return chat_rerr(c, at, "bad operand type for abs(): '%s'", chat_type_name(subj));
}

static const chat_builtin FILTERS[] = {
    {"trim", f_trim, 0},
    {"length", f_length, 0},
    {"count", f_length, 0},
    {"tojson", f_tojson, 0},
    {"string", f_string, 0},
    {"safe", f_string, 0},
    {"lower", f_recase, CASE_LOWER},
    {"upper", f_recase, CASE_UPPER},
    {"capitalize", f_recase, CASE_CAPITALIZE},
    {"title", f_recase, CASE_TITLE_FILTER},
    {"default", f_default, 0},
    {"d", f_default, 0},
    {"first", f_first, 0},
    {"last", f_last, 0},
    {"list", f_list, 0},
    {"reverse", f_list, 1},
    {"join", f_join, 0},
    {"items", f_items, 0},
    {"replace", f_replace, 0},
    {"int", f_number, 1},
    {"float", f_number, 0},
    {"abs", f_abs, 0},
};

const chat_builtin *chat_filter_find(const char *name)
{
    return builtin_find(FILTERS, COUNT(FILTERS), name);
}

/* ------------------------------------------------------------------ tests */

/* defined, none, string, ...: arg is the set of value types (bit 1 << V_x) that pass. */
static int t_type(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    *r = (arg >> subj->t) & 1;
    return 0;
}

/* true (arg 1), false (arg 0): the booleans themselves, not truthiness */
static int t_bool(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    *r = subj->t == V_BOOL && (subj->u.i != 0) == arg;
    return 0;
}

/* even (arg 0), odd (arg 1) */
static int t_parity(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    value m, two = v_int(2);
    if (chat_binop(c, at, OP_MOD, subj, &two, &m)) return -1;
    *r = arg ? chat_truthy(&m) : !chat_truthy(&m);
    return 0;
}

static int t_divisibleby(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    value m;
    if (chat_binop(c, at, OP_MOD, subj, x, &m)) return -1;
    *r = !chat_truthy(&m);
    return 0;
}

/* eq, equalto (arg 1), ne (arg 0) */
static int t_eq(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    *r = arg ? chat_veq(subj, x) : !chat_veq(subj, x);
    return 0;
}

/* lt, le, gt, ge: arg is the comparison (C_LT, ...) */
static int t_order(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    int k;
    if (chat_vcmp(c, at, subj, x, at->name, &k)) return -1;
    *r = cmp_holds(arg, k);
    return 0;
}

static int t_in(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    return chat_contains(c, at, x, subj, r);
}

/* lower (arg 0), upper (arg 1): str(subj) has cased characters, all of that case */
static int t_case(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    value s;
    int cased = 0, ok = 1;
    if (chat_to_str(c, at, subj, &s)) return -1;
    for (size_t i = 0, l; i < s.u.s.n; i += l) {
        int32_t cp = u8_decode(s.u.s.p + i, s.u.s.n - i, &l);
        if (!is_cased(cp)) continue;
        cased = 1;
        if (arg ? utf8proc_toupper(cp) != cp : utf8proc_tolower(cp) != cp) ok = 0;
    }
    *r = cased && ok;
    return 0;
}

/* Python's `is`: values for None, booleans, integers and strings (the same bytes), identity
 * for containers. */
static int t_sameas(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r)
{
    vtype t = subj->t;
    *r = t == x->t && (t == V_NONE || t == V_UNDEF || ((t == V_BOOL || t == V_INT) && subj->u.i == x->u.i) ||
                       ((t == V_LIST || t == V_DICT || t == V_NS) && subj->u.l == x->u.l) ||
                       (t == V_STR && subj->u.s.p == x->u.s.p && subj->u.s.n == x->u.s.n));
    return 0;
}

#define T_ANY ((1 << V_NONE) | (1 << V_BOOL) | (1 << V_INT) | (1 << V_FLOAT) | (1 << V_STR) | (1 << V_LIST) | \
               (1 << V_DICT) | (1 << V_NS) | (1 << V_LOOP))
#define T_SEQUENCE ((1 << V_STR) | (1 << V_LIST) | (1 << V_DICT) | (1 << V_UNDEF))

static const chat_test TESTS[] = {
    {"defined", t_type, 0, T_ANY},
    {"undefined", t_type, 0, 1 << V_UNDEF},
    {"none", t_type, 0, 1 << V_NONE},
    {"string", t_type, 0, 1 << V_STR},
    {"mapping", t_type, 0, 1 << V_DICT},
    {"iterable", t_type, 0, T_SEQUENCE | (1 << V_LOOP)},
    {"sequence", t_type, 0, T_SEQUENCE},
    {"number", t_type, 0, (1 << V_BOOL) | (1 << V_INT) | (1 << V_FLOAT)},
    {"integer", t_type, 0, 1 << V_INT},
    {"float", t_type, 0, 1 << V_FLOAT},
    {"boolean", t_type, 0, 1 << V_BOOL},
    {"true", t_bool, 0, 1},
    {"false", t_bool, 0, 0},
    {"even", t_parity, 0, 0},
    {"odd", t_parity, 0, 1},
    {"divisibleby", t_divisibleby, 1, 0},
    {"eq", t_eq, 1, 1},
    {"equalto", t_eq, 1, 1},
    {"ne", t_eq, 1, 0},
    {"lt", t_order, 1, C_LT},
    {"le", t_order, 1, C_LE},
    {"gt", t_order, 1, C_GT},
    {"ge", t_order, 1, C_GE},
    {"in", t_in, 1, 0},
    {"lower", t_case, 0, 0},
    {"upper", t_case, 0, 1},
    {"sameas", t_sameas, 1, 0},
};

const chat_test *chat_test_find(const char *name)
{
    for (size_t i = 0; i < COUNT(TESTS); i++)
        if (!strcmp(TESTS[i].name, name)) return &TESTS[i];
    return NULL;
}

/* ------------------------------------------------------------------ methods */

/* strip (arg 3: both ends), lstrip (1), rstrip (2) */
static int m_strip(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"chars", NULL};
    const value *v[1];
    if (bind_args(c, at, name, a, ps, v)) return -1;
    const value *set = v[0] && v[0]->t != V_NONE ? v[0] : NULL;
    if (set && need_str(c, at, "strip() argument", set)) return -1;
    strip_str(obj, set, arg, out);
    return 0;
}

/* startswith (arg 0), endswith (arg 1): a string or a tuple of them */
static int m_affix(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"prefix", NULL};
    const value *v[1];
    if (bind_args(c, at, name, a, ps, v)) return -1;
    if (!v[0]) return chat_rerr(c, at, "%s() takes exactly one argument", name);
    const value *cands = v[0];
    size_t nc = 1;
    if (cands->t == V_LIST) nc = cands->u.l->n, cands = cands->u.l->v;
    *out = v_bool(0);
    for (size_t k = 0; k < nc; k++) {
        const value *x = &cands[k];
        if (need_str(c, at, "startswith/endswith argument", x)) return -1;
        if (x->u.s.n > obj->u.s.n) continue;
        const char *p = arg ? obj->u.s.p + obj->u.s.n - x->u.s.n : obj->u.s.p;
        if (!memcmp(p, x->u.s.p, x->u.s.n)) { *out = v_bool(1); break; }
    }
    return 0;
}

static int m_split(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"sep", "maxsplit", NULL};
    const value *v[2];
    int64_t maxsplit = -1;
    if (bind_args(c, at, name, a, ps, v) || opt_int(c, at, "maxsplit", v[1], -1, &maxsplit)) return -1;
    const value *sep = v[0] && v[0]->t != V_NONE ? v[0] : NULL;
    if (sep && need_str(c, at, "split() separator", sep)) return -1;
    return split_str(c, at, obj, sep, maxsplit, out);
}

static int m_replace(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"old", "new", "count", NULL};
    const value *v[3];
    int64_t count = -1;
    if (bind_args(c, at, name, a, ps, v) || opt_int(c, at, "count", v[2], -1, &count)) return -1;
    if (!v[0] || !v[1]) return chat_rerr(c, at, "replace() takes at least 2 arguments");
    if (need_str(c, at, "replace() argument", v[0]) || need_str(c, at, "replace() argument", v[1])) return -1;
    return replace_str(c, at, obj, v[0], v[1], count, out);
}

static int method_no_args(rctx *c, const node *at, const char *name, const args *a)
{
    if (a->npos || a->nkw) return chat_rerr(c, at, "%s() takes no arguments", name);
    return 0;
}

/* upper, lower, capitalize, title; arg: the CASE_ mode */
static int m_recase(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    if (method_no_args(c, at, name, a)) return -1;
    return recase(c, at, obj, arg, out);
}

/* dict.get(key, default=None) */
static int m_get(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    static const char *const ps[] = {"key", "default", NULL};
    const value *v[2];
    if (bind_args(c, at, name, a, ps, v)) return -1;
    if (!v[0]) return chat_rerr(c, at, "get() takes at least 1 argument");
    const value *f = chat_dict_find(obj->u.d, v[0]);
    *out = f ? *f : v[1] ? *v[1] : v_none();
    return 0;
}

static int m_items(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    if (method_no_args(c, at, name, a)) return -1;
    return dict_pairs(c, at, obj->u.d, out);
}

/* keys (arg 0), values (arg 1) */
static int m_keys(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    if (method_no_args(c, at, name, a)) return -1;
    vlist *l = chat_mk_list(c, at, obj->u.d->n, 0);
    if (!l) return -1;
    if (obj->u.d->n) memcpy(l->v, arg ? obj->u.d->v : obj->u.d->k, obj->u.d->n * sizeof(value));
    *out = v_list(l);
    return 0;
}

static int m_cycle(rctx *c, const node *at, const char *name, const value *obj, const args *a, int arg, value *out)
{
    if (!a->npos) return chat_rerr(c, at, "loop.cycle() needs at least one argument");
    *out = a->pos[obj->u.lp->i % (size_t)a->npos];
    return 0;
}

static const chat_builtin STR_METHODS[] = {
    {"strip", m_strip, 3},
    {"lstrip", m_strip, 1},
    {"rstrip", m_strip, 2},
    {"startswith", m_affix, 0},
    {"endswith", m_affix, 1},
    {"split", m_split, 0},
    {"replace", m_replace, 0},
    {"upper", m_recase, CASE_UPPER},
    {"lower", m_recase, CASE_LOWER},
    {"capitalize", m_recase, CASE_CAPITALIZE},
    {"title", m_recase, CASE_TITLE},
};

static const chat_builtin DICT_METHODS[] = {
    {"get", m_get, 0},
    {"items", m_items, 0},
    {"keys", m_keys, 0},
    {"values", m_keys, 1},
};

static const chat_builtin LOOP_METHODS[] = {
    {"cycle", m_cycle, 0},
};

int chat_call_method(rctx *c, const node *at, const value *obj, const char *name, const args *a, value *out)
{
    const chat_builtin *m = NULL;
    switch (obj->t) {
    case V_UNDEF: return chat_undef_err(c, at, obj);
    case V_STR: m = builtin_find(STR_METHODS, COUNT(STR_METHODS), name); break;
    case V_DICT: m = builtin_find(DICT_METHODS, COUNT(DICT_METHODS), name); break;
    case V_LOOP: m = builtin_find(LOOP_METHODS, COUNT(LOOP_METHODS), name); break;
    default: break;
    }
    if (m) return m->fn(c, at, name, obj, a, m->arg, out);
    switch (obj->t) {
    case V_STR: return chat_rerr(c, at, "str has no supported method '%s'", name);
    case V_DICT: /* the dict methods other than get() take none: arguments are refused first */
        if (method_no_args(c, at, name, a)) return -1;
        return chat_rerr(c, at, "dict has no supported method '%s' (templates cannot modify dicts)", name);
    case V_LIST: return chat_rerr(c, at, "list has no supported method '%s' (templates cannot modify lists)", name);
    default: return chat_rerr(c, at, "'%s' object has no method '%s'", chat_type_name(obj), name);
    }
}

/* ------------------------------------------------------------------ globals */

/* HF's raise_exception(msg): the render fails with exactly msg as its error. */
static int g_raise(rctx *c, const node *at, const char *name, const value *self, const args *a, int arg, value *out)
{
    value msg = v_str("", 0);
    if (a->npos && chat_to_str(c, at, &a->pos[0], &msg)) return -1;
    if (c->err) {
        size_t n = msg.u.s.n < KR_ERR_MAX - 1 ? msg.u.s.n : KR_ERR_MAX - 1;
        memcpy(c->err, msg.u.s.p, n);
        c->err[n] = 0;
    }
    c->raised = 1;
    return -1;
}

/* range(stop), range(start, stop[, step]) */
static int g_range(rctx *c, const node *at, const char *name, const value *self, const args *a, int arg, value *out)
{
    int64_t r[3] = {0, 0, 1};
    if (a->nkw || a->npos < 1 || a->npos > 3) return chat_rerr(c, at, "range() takes 1 to 3 integer arguments");
    for (int i = 0; i < a->npos; i++)
        if (!is_intlike(&a->pos[i])) return chat_rerr(c, at, "range() arguments must be integers, not %s", chat_type_name(&a->pos[i]));
    if (a->npos == 1) r[1] = a->pos[0].u.i;
    else for (int i = 0; i < a->npos; i++) r[i] = a->pos[i].u.i;
    if (r[2] == 0) return chat_rerr(c, at, "range() step must not be zero");
    double cnt = r[2] > 0 ? ceil(((double)r[1] - (double)r[0]) / (double)r[2]) : ceil(((double)r[0] - (double)r[1]) / -(double)r[2]);
    if (cnt < 0) cnt = 0;
    if (cnt > CHAT_MAX_RANGE) return chat_rerr(c, at, "range() too big: more than %d items", CHAT_MAX_RANGE);
    vlist *l = chat_mk_list(c, at, (size_t)cnt, 0);
    if (!l) return -1;
    for (size_t k = 0; k < l->n; k++) l->v[k] = v_int(r[0] + (int64_t)k * r[2]);
    *out = v_list(l);
    return 0;
}

/* namespace(...) (arg V_NS), dict(...) (arg V_DICT): from dicts and keyword arguments */
static int g_dict(rctx *c, const node *at, const char *name, const value *self, const args *a, int arg, value *out)
{
    vdict *d = chat_ralloc(c, at, sizeof *d);
    if (!d) return -1;
    memset(d, 0, sizeof *d);
    for (int i = 0; i < a->npos; i++) {
        if (a->pos[i].t != V_DICT) return chat_rerr(c, at, "%s() positional arguments must be dicts", name);
        for (size_t k = 0; k < a->pos[i].u.d->n; k++)
            if (chat_dict_set(c, at, d, a->pos[i].u.d->k[k], a->pos[i].u.d->v[k])) return -1;
    }
    for (int i = 0; i < a->nkw; i++)
        if (chat_dict_set(c, at, d, v_str(a->kwn[i], strlen(a->kwn[i])), a->kwv[i])) return -1;
    out->t = (vtype)arg;
    out->u.d = d;
    return 0;
}

static const chat_builtin GLOBALS[] = {
    {"raise_exception", g_raise, 0},
    {"range", g_range, 0},
    {"namespace", g_dict, V_NS},
    {"dict", g_dict, V_DICT},
};

int chat_call_global(rctx *c, const node *at, const char *name, const args *a, value *out)
{
    const chat_builtin *g = builtin_find(GLOBALS, COUNT(GLOBALS), name);
    if (!g) return chat_rerr(c, at, "'%s' is undefined (not a known function)", name);
    return g->fn(c, at, name, NULL, a, g->arg, out);
}
