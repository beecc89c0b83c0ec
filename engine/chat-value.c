/*
 * chat-value.c - the values of the chat template renderer and Python's semantics for them:
 * truthiness, equality (1 == 1.0 == True), ordering, str() and repr() (Python's float repr),
 * json.dumps as HF's tojson filter calls it, iteration, attributes, items and slices (jinja2's
 * Undefined for what is missing), the arithmetic operators with Python's rounding, `in`. Also
 * the memory they live in: the arena and a render's error and allocation helpers.
 * It does not evaluate the syntax tree (chat-eval.c) nor know filters (chat-builtins.c).
 * Part of the chat template renderer (chat-int.h lists the parts); test: ctest -R test_chat.
 */
#include "chat-int.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ arena */

void *chat_arena_alloc(arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > ((size_t)64 << 10) ? n : ((size_t)64 << 10);
        if (a->total + cap > a->limit) return NULL;
        chunk *c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = a->head, c->used = 0, c->cap = cap;
        a->head = c;
        a->total += cap;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

void chat_arena_free(arena *a)
{
    for (chunk *c = a->head, *nx; c; c = nx) {
        nx = c->next;
        free(c);
    }
    a->head = NULL;
    a->total = 0;
}

/* ------------------------------------------------------------------ render errors and memory */

int chat_rerr(rctx *c, const node *at, const char *fmt, ...)
{
    char msg[KR_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kr_errf(c->err, "line %d: %s", at ? at->line : 0, msg);
}

static int oom(rctx *c, const node *at)
{
    return chat_rerr(c, at, "render memory limit reached (%zu MiB of values)", CHAT_MAX_ARENA >> 20);
}

void *chat_ralloc(rctx *c, const node *at, size_t n)
{
    void *p = chat_arena_alloc(&c->ar, n);
    if (!p) oom(c, at);
    return p;
}

char *chat_rstr(rctx *c, const node *at, size_t n)
{
    if (n > CHAT_MAX_OUTPUT) {
        chat_rerr(c, at, "string longer than %zu MiB", CHAT_MAX_OUTPUT >> 20);
        return NULL;
    }
    char *s = chat_ralloc(c, at, n + 1);
    if (s) s[n] = 0;
    return s;
}

vlist *chat_mk_list(rctx *c, const node *at, size_t n, int tuple)
{
    vlist *l = chat_ralloc(c, at, sizeof *l);
    if (!l) return NULL;
    l->n = n, l->tuple = tuple;
    l->v = chat_ralloc(c, at, (n ? n : 1) * sizeof *l->v);
    return l->v ? l : NULL;
}

/* ------------------------------------------------------------------ values */

const char *chat_type_name(const value *v)
{
    switch (v->t) {
    case V_UNDEF: return "Undefined";
    case V_NONE: return "NoneType";
    case V_BOOL: return "bool";
    case V_INT: return "int";
    case V_FLOAT: return "float";
    case V_STR: return "str";
    case V_LIST: return v->u.l->tuple ? "tuple" : "list";
    case V_DICT: return "dict";
    case V_NS: return "Namespace";
    case V_LOOP: return "LoopContext";
    }
    return "?";
}

int chat_truthy(const value *v)
{
    switch (v->t) {
    case V_UNDEF: case V_NONE: return 0;
    case V_BOOL: case V_INT: return v->u.i != 0;
    case V_FLOAT: return v->u.f != 0;
    case V_STR: return v->u.s.n > 0;
    case V_LIST: return v->u.l->n > 0;
    case V_DICT: return v->u.d->n > 0;
    case V_NS: case V_LOOP: return 1;
    }
    return 0;
}

value *chat_dict_find(const vdict *d, const value *k)
{
    for (size_t i = 0; i < d->n; i++)
        if (chat_veq(&d->k[i], k)) return &d->v[i];
    return NULL;
}

static value *dict_find_str(const vdict *d, const char *s)
{
    value k = v_str(s, strlen(s));
    return chat_dict_find(d, &k);
}

int chat_dict_set(rctx *c, const node *at, vdict *d, value k, value v)
{
    value *slot = chat_dict_find(d, &k);
    if (slot) { *slot = v; return 0; }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        value *nk = chat_ralloc(c, at, cap * sizeof *nk), *nv = chat_ralloc(c, at, cap * sizeof *nv);
        if (!nk || !nv) return -1;
        if (d->n) { memcpy(nk, d->k, d->n * sizeof *nk); memcpy(nv, d->v, d->n * sizeof *nv); }
        d->k = nk, d->v = nv, d->cap = cap;
    }
    d->k[d->n] = k, d->v[d->n] = v;
    d->n++;
    return 0;
}

int chat_veq(const value *a, const value *b)
{
    if (a->t == V_UNDEF || b->t == V_UNDEF) return a->t == b->t;
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b)) return a->u.i == b->u.i;
        return num(a) == num(b);
    }
    if (a->t != b->t) return 0;
    switch (a->t) {
    case V_NONE: return 1;
    case V_STR: return a->u.s.n == b->u.s.n && !memcmp(a->u.s.p, b->u.s.p, a->u.s.n);
    case V_LIST:
        if (a->u.l->tuple != b->u.l->tuple || a->u.l->n != b->u.l->n) return 0;
        for (size_t i = 0; i < a->u.l->n; i++)
            if (!chat_veq(&a->u.l->v[i], &b->u.l->v[i])) return 0;
        return 1;
    case V_DICT:
        if (a->u.d->n != b->u.d->n) return 0;
        for (size_t i = 0; i < a->u.d->n; i++) {
            const value *o = chat_dict_find(b->u.d, &a->u.d->k[i]);
            if (!o || !chat_veq(&a->u.d->v[i], o)) return 0;
        }
        return 1;
    case V_NS: return a->u.d == b->u.d;
    case V_LOOP: return a->u.lp == b->u.lp;
    default: return 0;
    }
}

/* Python's ordering for <, <=, >, >=: numbers, strings (code point order = UTF-8 byte order),
 * lists and tuples element by element. *r is <0, 0 or >0. */
int chat_vcmp(rctx *c, const node *at, const value *a, const value *b, const char *op, int *r)
{
    if (is_num(a) && is_num(b)) {
        if (is_intlike(a) && is_intlike(b)) *r = (a->u.i > b->u.i) - (a->u.i < b->u.i);
        else *r = (num(a) > num(b)) - (num(a) < num(b));
        return 0;
    }
    if (a->t == V_STR && b->t == V_STR) {
        size_t m = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int x = m ? memcmp(a->u.s.p, b->u.s.p, m) : 0;
        *r = x ? x : (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
        return 0;
    }
    if (a->t == V_LIST && b->t == V_LIST && a->u.l->tuple == b->u.l->tuple) {
        for (size_t i = 0; i < a->u.l->n && i < b->u.l->n; i++) {
            if (chat_veq(&a->u.l->v[i], &b->u.l->v[i])) continue;
            return chat_vcmp(c, at, &a->u.l->v[i], &b->u.l->v[i], op, r);
        }
        *r = (a->u.l->n > b->u.l->n) - (a->u.l->n < b->u.l->n);
        return 0;
    }
    if (a->t == V_UNDEF || b->t == V_UNDEF) {
        const value *u = a->t == V_UNDEF ? a : b;
        return chat_rerr(c, at, "'%s' is undefined", u->u.undef ? u->u.undef : "value");
    }
    return chat_rerr(c, at, "'%s' not supported between instances of '%s' and '%s'", op, chat_type_name(a), chat_type_name(b));
}

/* snprintf at *o, *left bytes being left there; once a write does not fit, the rest are
 * dropped. */
static void put(char **o, size_t *left, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void put(char **o, size_t *left, const char *fmt, ...)
{
    if (!*left) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(*o, *left, fmt, ap);
    va_end(ap);
    if (w < 0 || (size_t)w >= *left) { *left = 0; return; }
    *o += w;
    *left -= (size_t)w;
}

/* repr(float) of Python: the shortest digits that read back to x, fixed notation for
 * 1e-4 <= |x| < 1e16, else d.ddde+XX. */
static void py_float(double x, char *out, size_t cap)
{
    if (isnan(x)) { snprintf(out, cap, "nan"); return; }
    if (isinf(x)) { snprintf(out, cap, x < 0 ? "-inf" : "inf"); return; }
    if (x == 0) { snprintf(out, cap, signbit(x) ? "-0.0" : "0.0"); return; }
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    /* e = [-]d.ddde[+-]XX */
    const char *p = e;
    int neg = *p == '-';
    if (neg) p++;
    char digits[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    int exp10 = atoi(p + 1), decpt = exp10 + 1;
    char *o = out;
    size_t left = cap;
    if (neg) put(&o, &left, "-");
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            put(&o, &left, "0.");
            for (int i = 0; i < -decpt; i++) put(&o, &left, "0");
            put(&o, &left, "%s", digits);
        } else if (decpt >= nd) {
            put(&o, &left, "%s", digits);
            for (int i = nd; i < decpt; i++) put(&o, &left, "0");
            put(&o, &left, ".0");
        } else {
            put(&o, &left, "%.*s.%s", decpt, digits, digits + decpt);
        }
    } else {
        put(&o, &left, "%c", digits[0]);
        if (nd > 1) put(&o, &left, ".%s", digits + 1);
        put(&o, &left, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
}

/* Python's repr(str): single quotes unless the text has ' and no ", non-printable characters
 * escaped. */
static void py_repr_str(sbuf *b, const char *s, size_t n)
{
    char q = '\'';
    if (memchr(s, '\'', n) && !memchr(s, '"', n)) q = '"';
    sb_put(b, &q, 1);
    for (size_t i = 0, l; i < n; i += l) {
        int32_t cp = u8_decode(s + i, n - i, &l);
        char e[16];
        if (cp == q || cp == '\\') { e[0] = '\\', e[1] = (char)cp; sb_put(b, e, 2); continue; }
        if (cp == '\n') { sb_puts(b, "\\n"); continue; }
        if (cp == '\r') { sb_puts(b, "\\r"); continue; }
        if (cp == '\t') { sb_puts(b, "\\t"); continue; }
        if (cp < 0) { snprintf(e, sizeof e, "\\x%02x", (unsigned)(-cp - 1)); sb_puts(b, e); continue; }
        utf8proc_category_t cat = utf8proc_category(cp);
        int printable = cp == ' ' || !(cat == UTF8PROC_CATEGORY_CC || cat == UTF8PROC_CATEGORY_CF ||
                                       cat == UTF8PROC_CATEGORY_CS || cat == UTF8PROC_CATEGORY_CO ||
                                       cat == UTF8PROC_CATEGORY_CN || cat == UTF8PROC_CATEGORY_ZS ||
                                       cat == UTF8PROC_CATEGORY_ZL || cat == UTF8PROC_CATEGORY_ZP);
        if (printable) { sb_put(b, s + i, l); continue; }
        if (cp < 0x100) snprintf(e, sizeof e, "\\x%02x", (unsigned)cp);
        else if (cp < 0x10000) snprintf(e, sizeof e, "\\u%04x", (unsigned)cp);
        else snprintf(e, sizeof e, "\\U%08x", (unsigned)cp);
        sb_puts(b, e);
    }
    sb_put(b, &q, 1);
}

/* str(v) (repr: repr(v), for the items of containers) appended to b. */
int chat_str_into(rctx *c, const node *at, sbuf *b, const value *v, int repr, int depth)
{
    char num_buf[40];
    if (depth > CHAT_MAX_DEPTH) return chat_rerr(c, at, "value nested too deep to print");
    switch (v->t) {
    case V_UNDEF: if (repr) sb_puts(b, "Undefined"); break;
    case V_NONE: sb_puts(b, "None"); break;
    case V_BOOL: sb_puts(b, v->u.i ? "True" : "False"); break;
    case V_INT: snprintf(num_buf, sizeof num_buf, "%lld", (long long)v->u.i); sb_puts(b, num_buf); break;
    case V_FLOAT: py_float(v->u.f, num_buf, sizeof num_buf); sb_puts(b, num_buf); break;
    case V_STR:
        if (repr) py_repr_str(b, v->u.s.p, v->u.s.n);
        else sb_put(b, v->u.s.p, v->u.s.n);
        break;
    case V_LIST: {
        const vlist *l = v->u.l;
        sb_puts(b, l->tuple ? "(" : "[");
        for (size_t i = 0; i < l->n; i++) {
            if (i) sb_puts(b, ", ");
            if (chat_str_into(c, at, b, &l->v[i], 1, depth + 1)) return -1;
        }
        sb_puts(b, l->tuple ? (l->n == 1 ? ",)" : ")") : "]");
        break;
    }
    case V_DICT: case V_NS: {
        const vdict *d = v->u.d;
        sb_puts(b, v->t == V_NS ? "<Namespace {" : "{");
        for (size_t i = 0; i < d->n; i++) {
            if (i) sb_puts(b, ", ");
            if (chat_str_into(c, at, b, &d->k[i], 1, depth + 1)) return -1;
            sb_puts(b, ": ");
            if (chat_str_into(c, at, b, &d->v[i], 1, depth + 1)) return -1;
        }
        sb_puts(b, v->t == V_NS ? "}>" : "}");
        break;
    }
    case V_LOOP:
        snprintf(num_buf, sizeof num_buf, "<LoopContext %zu/%zu>", v->u.lp->i + 1, v->u.lp->n);
        sb_puts(b, num_buf);
        break;
    }
    return 0;
}

int chat_sb_fail(rctx *c, const node *at, const sbuf *b, const char *what)
{
    if (b->over == 2) return chat_rerr(c, at, "out of memory");
    return chat_rerr(c, at, "%s longer than %zu MiB", what, b->limit >> 20);
}

int chat_sb_to_value(rctx *c, const node *at, sbuf *b, value *out)
{
    if (b->over) {
        chat_sb_fail(c, at, b, "string");
        free(b->p);
        return -1;
    }
    char *s = chat_rstr(c, at, b->n);
    if (s && b->n) memcpy(s, b->p, b->n);
    free(b->p);
    if (!s) return -1;
    *out = v_str(s, b->n);
    return 0;
}

/* str(v) as a string value (no copy for strings). */
int chat_to_str(rctx *c, const node *at, const value *v, value *out)
{
    if (v->t == V_STR) { *out = *v; return 0; }
    if (v->t == V_UNDEF) { *out = v_str("", 0); return 0; }
    sbuf b = {.limit = CHAT_MAX_OUTPUT};
    if (chat_str_into(c, at, &b, v, 0, 0)) { free(b.p); return -1; }
    return chat_sb_to_value(c, at, &b, out);
}

/* A JSON string literal as json.dumps writes it with ensure_ascii off: only '"', '\\' and
 * control characters are escaped. */
static void json_str(sbuf *b, const char *s, size_t n)
{
    size_t run = 0;
    sb_puts(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        const char *e = NULL;
        char u[8];
        if (ch == '"') e = "\\\"";
        else if (ch == '\\') e = "\\\\";
        else if (ch == '\n') e = "\\n";
        else if (ch == '\r') e = "\\r";
        else if (ch == '\t') e = "\\t";
        else if (ch == '\b') e = "\\b";
        else if (ch == '\f') e = "\\f";
        else if (ch < 0x20) { snprintf(u, sizeof u, "\\u%04x", ch); e = u; }
        if (!e) continue;
        sb_put(b, s + run, i - run);
        sb_puts(b, e);
        run = i + 1;
    }
    sb_put(b, s + run, n - run);
    sb_puts(b, "\"");
}

/* json.dumps(v, ensure_ascii=False, indent=indent) as transformers' tojson filter does;
 * indent NULL: one line with ", " and ": " separators. */
int chat_json_into(rctx *c, const node *at, sbuf *b, const value *v, const char *indent, int level)
{
    char num_buf[40];
    if (level > CHAT_MAX_DEPTH) return chat_rerr(c, at, "value nested too deep for tojson");
    switch (v->t) {
    case V_NONE: sb_puts(b, "null"); return 0;
    case V_BOOL: sb_puts(b, v->u.i ? "true" : "false"); return 0;
    case V_INT: snprintf(num_buf, sizeof num_buf, "%lld", (long long)v->u.i); sb_puts(b, num_buf); return 0;
    case V_FLOAT:
        if (isnan(v->u.f)) sb_puts(b, "NaN");
        else if (isinf(v->u.f)) sb_puts(b, v->u.f < 0 ? "-Infinity" : "Infinity");
        else { py_float(v->u.f, num_buf, sizeof num_buf); sb_puts(b, num_buf); }
        return 0;
    case V_STR: json_str(b, v->u.s.p, v->u.s.n); return 0;
    case V_LIST: case V_DICT: {
        int is_list = v->t == V_LIST;
        size_t n = is_list ? v->u.l->n : v->u.d->n;
        sb_puts(b, is_list ? "[" : "{");
        if (!n) { sb_puts(b, is_list ? "]" : "}"); return 0; }
        for (size_t i = 0; i < n; i++) {
            if (i) sb_puts(b, indent ? "," : ", ");
            if (indent) {
                sb_puts(b, "\n");
                for (int k = 0; k <= level; k++) sb_puts(b, indent);
            }
            if (!is_list) {
                const value *k = &v->u.d->k[i];
                if (k->t == V_STR) {
                    if (chat_json_into(c, at, b, k, indent, level + 1)) return -1;
                } else if (k->t == V_NONE || k->t == V_BOOL || k->t == V_INT || k->t == V_FLOAT) {
                    sb_puts(b, "\"");
                    if (chat_json_into(c, at, b, k, indent, level + 1)) return -1;
                    sb_puts(b, "\"");
                } else {
                    return chat_rerr(c, at, "tojson: keys must be str, int, float, bool or None, not %s", chat_type_name(k));
                }
                sb_puts(b, ": ");
            }
            if (chat_json_into(c, at, b, is_list ? &v->u.l->v[i] : &v->u.d->v[i], indent, level + 1)) return -1;
        }
        if (indent) {
            sb_puts(b, "\n");
            for (int k = 0; k < level; k++) sb_puts(b, indent);
        }
        sb_puts(b, is_list ? "]" : "}");
        return 0;
    }
    default:
        return chat_rerr(c, at, "tojson: Object of type %s is not JSON serializable", chat_type_name(v));
    }
}

/* The characters of a string as one-character string values (pointing into the string). */
static int str_chars(rctx *c, const node *at, const value *s, vlist **out)
{
    size_t n = u8_count(s->u.s.p, s->u.s.n);
    vlist *l = chat_mk_list(c, at, n, 0);
    if (!l) return -1;
    size_t k = 0;
    for (size_t i = 0, len; i < s->u.s.n; i += len) {
        u8_decode(s->u.s.p + i, s->u.s.n - i, &len);
        l->v[k++] = v_str(s->u.s.p + i, len);
    }
    *out = l;
    return 0;
}

/* What `for x in v` walks: a list's items, a dict's keys, a string's characters, nothing for
 * undefined (as jinja2's Undefined). */
int chat_iterate(rctx *c, const node *at, const value *v, vlist **out)
{
    static vlist empty;
    switch (v->t) {
    case V_LIST: *out = v->u.l; return 0;
    case V_DICT: {
        vlist *l = chat_mk_list(c, at, v->u.d->n, 0);
        if (!l) return -1;
        if (v->u.d->n) memcpy(l->v, v->u.d->k, v->u.d->n * sizeof *l->v);
        *out = l;
        return 0;
    }
    case V_STR: return str_chars(c, at, v, out);
    case V_UNDEF: *out = &empty; return 0;
    default: return chat_rerr(c, at, "'%s' object is not iterable", chat_type_name(v));
    }
}

int chat_undef_err(rctx *c, const node *at, const value *v)
{
    return chat_rerr(c, at, "'%s' is undefined", v->u.undef ? v->u.undef : "value");
}

static int loop_attr(const loopinfo *lp, const char *name, value *out)
{
    size_t i = lp->i, n = lp->n;
    if (!strcmp(name, "index")) *out = v_int((int64_t)i + 1);
    else if (!strcmp(name, "index0")) *out = v_int((int64_t)i);
    else if (!strcmp(name, "revindex")) *out = v_int((int64_t)(n - i));
    else if (!strcmp(name, "revindex0")) *out = v_int((int64_t)(n - i - 1));
    else if (!strcmp(name, "first")) *out = v_bool(i == 0);
    else if (!strcmp(name, "last")) *out = v_bool(i + 1 == n);
    else if (!strcmp(name, "length")) *out = v_int((int64_t)n);
    else if (!strcmp(name, "depth")) *out = v_int(1);
    else if (!strcmp(name, "depth0")) *out = v_int(0);
    else if (!strcmp(name, "previtem")) *out = i > 0 ? lp->items[i - 1] : v_undef("previtem");
    else if (!strcmp(name, "nextitem")) *out = i + 1 < n ? lp->items[i + 1] : v_undef("nextitem");
    else return -1;
    return 0;
}

/* obj.name: a dict's key, a namespace's attribute, the loop's fields; undefined otherwise
 * (jinja2 turns a missing attribute into Undefined; only Undefined itself refuses). */
int chat_get_attr(rctx *c, const node *at, const value *obj, const char *name, value *out)
{
    const value *f;
    switch (obj->t) {
    case V_UNDEF: return chat_undef_err(c, at, obj);
    case V_DICT: case V_NS:
        f = dict_find_str(obj->u.d, name);
        *out = f ? *f : v_undef(name);
        return 0;
    case V_LOOP:
        if (loop_attr(obj->u.lp, name, out)) *out = v_undef(name);
        return 0;
    default:
        *out = v_undef(name);
        return 0;
    }
}

/* Python's slice.indices() and the items it selects. */
static int slice_range(rctx *c, const node *at, size_t len, const value *vs[3], int64_t *start, int64_t *step,
                       size_t *count, int *bad)
{
    int64_t st = 1, L = (int64_t)len;
    for (int k = 0; k < 3; k++)
        if (vs[k] && vs[k]->t != V_NONE && !is_intlike(vs[k])) { *bad = 1; return 0; }
    if (vs[2] && vs[2]->t != V_NONE) st = vs[2]->u.i;
    if (st == 0) return chat_rerr(c, at, "slice step cannot be zero");
    int64_t lo = st < 0 ? -1 : 0, hi = st < 0 ? L - 1 : L;
    int64_t s = st < 0 ? L - 1 : 0, e = st < 0 ? -1 : L;
    if (vs[0] && vs[0]->t != V_NONE) {
        s = vs[0]->u.i;
        if (s < 0) { s += L; if (s < 0) s = lo; }
        else if (s >= L) s = hi;
    }
    if (vs[1] && vs[1]->t != V_NONE) {
        e = vs[1]->u.i;
        if (e < 0) { e += L; if (e < 0) e = lo; }
        else if (e >= L) e = hi;
    }
    size_t n = 0;
    if (st > 0 && s < e) n = (size_t)((e - s - 1) / st + 1);
    if (st < 0 && s > e) n = (size_t)((s - e - 1) / (-st) + 1);
    *start = s, *step = st, *count = n, *bad = 0;
    return 0;
}

/* obj[key]: list and string indices (negative from the end), dict keys, namespace and loop
 * attributes; a missing item is undefined, as in jinja2. */
int chat_get_item(rctx *c, const node *at, const value *obj, const value *key, value *out)
{
    if (obj->t == V_UNDEF) return chat_undef_err(c, at, obj);
    if ((obj->t == V_LIST || obj->t == V_STR) && is_intlike(key)) {
        int64_t i = key->u.i;
        if (obj->t == V_LIST) {
            int64_t n = (int64_t)obj->u.l->n;
            if (i < 0) i += n;
            *out = i >= 0 && i < n ? obj->u.l->v[i] : v_undef("item");
            return 0;
        }
        int64_t n = (int64_t)u8_count(obj->u.s.p, obj->u.s.n);
        if (i < 0) i += n;
        *out = v_undef("item");
        if (i < 0 || i >= n) return 0;
        size_t off = 0, len;
        for (int64_t k = 0;; k++, off += len) {
            u8_decode(obj->u.s.p + off, obj->u.s.n - off, &len);
            if (k == i) break;
        }
        *out = v_str(obj->u.s.p + off, len);
        return 0;
    }
    if (obj->t == V_DICT || obj->t == V_NS) {
        const value *f = chat_dict_find(obj->u.d, key);
        *out = f ? *f : v_undef(key->t == V_STR ? key->u.s.p : "item");
        return 0;
    }
    if (obj->t == V_LOOP && key->t == V_STR) return chat_get_attr(c, at, obj, key->u.s.p, out);
    *out = v_undef("item");
    return 0;
}

int chat_get_slice(rctx *c, const node *at, const value *obj, const value *vs[3], value *out)
{
    if (obj->t == V_UNDEF) return chat_undef_err(c, at, obj);
    vlist *src;
    if (obj->t == V_LIST) src = obj->u.l;
    else if (obj->t == V_STR) { if (str_chars(c, at, obj, &src)) return -1; }
    else { *out = v_undef("slice"); return 0; }
    int64_t start, step;
    size_t n;
    int bad;
    if (slice_range(c, at, src->n, vs, &start, &step, &n, &bad)) return -1;
    if (bad) { *out = v_undef("slice"); return 0; }
    if (obj->t == V_LIST) {
        vlist *l = chat_mk_list(c, at, n, src->tuple);
        if (!l) return -1;
        for (size_t k = 0; k < n; k++) l->v[k] = src->v[start + (int64_t)k * step];
        *out = v_list(l);
        return 0;
    }
    size_t bytes = 0;
    for (size_t k = 0; k < n; k++) bytes += src->v[start + (int64_t)k * step].u.s.n;
    char *s = chat_rstr(c, at, bytes);
    if (!s) return -1;
    bytes = 0;
    for (size_t k = 0; k < n; k++) {
        const value *ch = &src->v[start + (int64_t)k * step];
        memcpy(s + bytes, ch->u.s.p, ch->u.s.n);
        bytes += ch->u.s.n;
    }
    *out = v_str(s, bytes);
    return 0;
}

static int concat2(rctx *c, const node *at, const char *a, size_t an, const char *b, size_t bn, value *out)
{
    if (an > CHAT_MAX_OUTPUT || bn > CHAT_MAX_OUTPUT - an) return chat_rerr(c, at, "string longer than %zu MiB", CHAT_MAX_OUTPUT >> 20);
    char *s = chat_rstr(c, at, an + bn);
    if (!s) return -1;
    if (an) memcpy(s, a, an);
    if (bn) memcpy(s + an, b, bn);
    *out = v_str(s, an + bn);
    return 0;
}

static int repeat(rctx *c, const node *at, const value *seq, int64_t times, value *out)
{
    if (times < 0) times = 0;
    if (seq->t == V_STR) {
        if (seq->u.s.n && (uint64_t)times > CHAT_MAX_OUTPUT / seq->u.s.n)
            return chat_rerr(c, at, "string longer than %zu MiB", CHAT_MAX_OUTPUT >> 20);
        size_t n = seq->u.s.n * (size_t)times;
        char *s = chat_rstr(c, at, n);
        if (!s) return -1;
        for (int64_t k = 0; k < times; k++) memcpy(s + (size_t)k * seq->u.s.n, seq->u.s.p, seq->u.s.n);
        *out = v_str(s, n);
        return 0;
    }
    size_t m = seq->u.l->n;
    if (m && (uint64_t)times > (CHAT_MAX_ARENA / sizeof(value)) / m) return oom(c, at);
    vlist *l = chat_mk_list(c, at, m * (size_t)times, seq->u.l->tuple);
    if (!l) return -1;
    for (int64_t k = 0; k < times; k++) memcpy(l->v + (size_t)k * m, seq->u.l->v, m * sizeof(value));
    *out = v_list(l);
    return 0;
}

static const char *const OP_NAMES[] = {"+", "-", "*", "/", "//", "%", "**", "~"};

/* x op y for integers (not /): Python's floor division and modulo, an error past 64 bits; a
 * negative power is a float, as in Python. */
static int binop_int(rctx *c, const node *at, int op, int64_t x, int64_t y, value *out)
{
    int64_t r = 0;
    int ovf = 0;
    switch (op) {
    case OP_ADD: ovf = __builtin_add_overflow(x, y, &r); break;
    case OP_SUB: ovf = __builtin_sub_overflow(x, y, &r); break;
    case OP_MUL: ovf = __builtin_mul_overflow(x, y, &r); break;
    case OP_FLOORDIV: case OP_MOD: {
        if (y == 0) return chat_rerr(c, at, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) { ovf = 1; break; }
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) { q--; m += y; }
        r = op == OP_FLOORDIV ? q : m;
        break;
    }
    case OP_POW:
        if (y < 0) {
            if (x == 0) return chat_rerr(c, at, "0 cannot be raised to a negative power");
            *out = v_float(pow((double)x, (double)y));
            return 0;
        }
        r = 1;
        for (int64_t base = x, e = y; e > 0;) { /* square and multiply */
            if (e & 1) ovf |= __builtin_mul_overflow(r, base, &r);
            e >>= 1;
            if (e) ovf |= __builtin_mul_overflow(base, base, &base);
        }
        break;
    }
    if (ovf) return chat_rerr(c, at, "integer overflow in '%s' (beyond 64 bits)", OP_NAMES[op]);
    *out = v_int(r);
    return 0;
}

/* x op y with floats, as Python computes it (float floor division and modulo included). */
static int binop_float(rctx *c, const node *at, int op, double x, double y, value *out)
{
    switch (op) {
    case OP_ADD: *out = v_float(x + y); return 0;
    case OP_SUB: *out = v_float(x - y); return 0;
    case OP_MUL: *out = v_float(x * y); return 0;
    case OP_DIV:
        if (y == 0) return chat_rerr(c, at, "division by zero");
        *out = v_float(x / y);
        return 0;
    case OP_FLOORDIV: case OP_MOD: {
        if (y == 0) return chat_rerr(c, at, "float division or modulo by zero");
        double m = fmod(x, y), d;
        if (m != 0) {
            if ((y < 0) != (m < 0)) m += y;
        } else {
            m = copysign(0.0, y);
        }
        d = (x - m) / y;
        if (d != 0) {
            double f = floor(d);
            if (d - f > 0.5) f += 1.0;
            d = f;
        } else {
            d = copysign(0.0, x / y);
        }
        *out = v_float(op == OP_MOD ? m : d);
        return 0;
    }
    case OP_POW:
        if (x == 0 && y < 0) return chat_rerr(c, at, "0.0 cannot be raised to a negative power");
        *out = v_float(pow(x, y));
        return 0;
    }
    return chat_rerr(c, at, "bad operator");
}

int chat_binop(rctx *c, const node *at, int op, const value *a, const value *b, value *out)
{
    if (op == OP_CONCAT) {
        value sa, sb2;
        if (chat_to_str(c, at, a, &sa) || chat_to_str(c, at, b, &sb2)) return -1;
        return concat2(c, at, sa.u.s.p, sa.u.s.n, sb2.u.s.p, sb2.u.s.n, out);
    }
    if (a->t == V_UNDEF) return chat_undef_err(c, at, a);
    if (b->t == V_UNDEF) return chat_undef_err(c, at, b);
    if (op == OP_ADD && a->t == V_STR && b->t == V_STR) return concat2(c, at, a->u.s.p, a->u.s.n, b->u.s.p, b->u.s.n, out);
    if (op == OP_ADD && a->t == V_LIST && b->t == V_LIST && a->u.l->tuple == b->u.l->tuple) {
        vlist *l = chat_mk_list(c, at, a->u.l->n + b->u.l->n, a->u.l->tuple);
        if (!l) return -1;
        if (a->u.l->n) memcpy(l->v, a->u.l->v, a->u.l->n * sizeof(value));
        if (b->u.l->n) memcpy(l->v + a->u.l->n, b->u.l->v, b->u.l->n * sizeof(value));
        *out = v_list(l);
        return 0;
    }
    if (op == OP_MUL && (a->t == V_STR || a->t == V_LIST) && is_intlike(b)) return repeat(c, at, a, b->u.i, out);
    if (op == OP_MUL && (b->t == V_STR || b->t == V_LIST) && is_intlike(a)) return repeat(c, at, b, a->u.i, out);
    if (op == OP_MOD && a->t == V_STR) return chat_rerr(c, at, "string formatting with %% is not supported");
    if (!is_num(a) || !is_num(b))
        return chat_rerr(c, at, "unsupported operand type(s) for %s: '%s' and '%s'", OP_NAMES[op], chat_type_name(a), chat_type_name(b));
    if (is_intlike(a) && is_intlike(b) && op != OP_DIV) return binop_int(c, at, op, a->u.i, b->u.i, out);
    return binop_float(c, at, op, num(a), num(b), out);
}

int chat_contains(rctx *c, const node *at, const value *hay, const value *needle, int *r)
{
    switch (hay->t) {
    case V_STR:
        if (needle->t != V_STR)
            return chat_rerr(c, at, "'in <string>' requires string as left operand, not %s", chat_type_name(needle));
        if (!needle->u.s.n) { *r = 1; return 0; }
        *r = 0;
        for (size_t i = 0; i + needle->u.s.n <= hay->u.s.n; i++)
            if (!memcmp(hay->u.s.p + i, needle->u.s.p, needle->u.s.n)) { *r = 1; break; }
        return 0;
    case V_LIST:
        *r = 0;
        for (size_t i = 0; i < hay->u.l->n; i++)
            if (chat_veq(&hay->u.l->v[i], needle)) { *r = 1; break; }
        return 0;
    case V_DICT: *r = chat_dict_find(hay->u.d, needle) != NULL; return 0;
    case V_UNDEF: *r = 0; return 0;
    case V_LOOP: *r = 0;
        for (size_t i = 0; i < hay->u.lp->n; i++)
            if (chat_veq(&hay->u.lp->items[i], needle)) { *r = 1; break; }
        return 0;
    default: return chat_rerr(c, at, "argument of type '%s' is not iterable", chat_type_name(hay));
    }
}
