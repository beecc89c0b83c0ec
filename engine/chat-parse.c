/*
 * chat-parse.c - the chat template parser: tokens to a syntax tree, by recursive descent with
 * jinja2's grammar and operator precedence (parse_or ... parse_unary, parse_filter_expr,
 * parse_subscribed). Filter and test names are resolved here against chat-builtins.c's tables,
 * so an unknown one is a parse error naming its line and column, as in jinja2. Tags outside the
 * subset (macro, include, ...) are refused by name. Nothing here evaluates (chat-eval.c does).
 * Part of the chat template renderer (chat-int.h lists the parts); test: ctest -R test_chat.
 */
#include "chat-int.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef struct parser {
    const token *t;
    int i;
    arena *ar;
    char *err;
    int depth; /* nesting of expressions and block tags */
    int loops; /* for loops around the current statement (break/continue need one) */
} parser;

static const token *cur(const parser *p) { return &p->t[p->i]; }
static const token *peek(const parser *p, int k)
{
    const token *t = &p->t[p->i];
    for (int j = 0; j < k && t->type != TK_EOF; j++) t++;
    return t;
}
static void adv(parser *p) { if (p->t[p->i].type != TK_EOF) p->i++; }
static int is_op(const token *t, const char *op) { return t->type == TK_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n); }
static int is_name(const token *t, const char *nm) { return t->type == TK_NAME && !strcmp(t->s, nm); }

static const char *tk_desc(const token *t, char *buf, size_t cap)
{
    switch (t->type) {
    case TK_EOF: return "end of template";
    case TK_DATA: return "template text";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "end of print statement '}}'";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "end of statement block '%}'";
    case TK_NAME: snprintf(buf, cap, "'%.40s'", t->s); return buf;
    case TK_STRING: return "a string";
    case TK_INT: case TK_FLOAT: return "a number";
    case TK_OP: snprintf(buf, cap, "'%.*s'", (int)t->n, t->s); return buf;
    }
    return "?";
}

static int perr(parser *p, const token *t, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int perr(parser *p, const token *t, const char *fmt, ...)
{
    char msg[KR_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kr_errf(p->err, "line %d column %d: %s", t->line, t->col, msg);
}

/* "expected X, got Y" at the current token; always -1. */
static int p_expected(parser *p, const char *what)
{
    char b[64];
    return perr(p, cur(p), "expected %s, got %s", what, tk_desc(cur(p), b, sizeof b));
}

static node *mk(parser *p, nkind k, const token *at)
{
    node *n = chat_arena_alloc(p->ar, sizeof *n);
    if (!n) { perr(p, at, "out of memory"); return NULL; }
    memset(n, 0, sizeof *n);
    n->kind = k, n->line = at->line, n->col = at->col;
    return n;
}

/* A growable array of node pointers in the arena (old copies are left behind: templates are
 * small, and the arena is freed with the template). */
typedef struct nvec { node **v; const char **s; int n, cap; } nvec;
static int nv_push(parser *p, nvec *v, node *x, const char *s)
{
    if (v->n == v->cap) {
        int cap = v->cap ? v->cap * 2 : 4;
        node **nv = chat_arena_alloc(p->ar, (size_t)cap * sizeof *nv);
        const char **ns = chat_arena_alloc(p->ar, (size_t)cap * sizeof *ns);
        if (!nv || !ns) return perr(p, cur(p), "out of memory");
        if (v->n) { memcpy(nv, v->v, (size_t)v->n * sizeof *nv); memcpy(ns, v->s, (size_t)v->n * sizeof *ns); }
        v->v = nv, v->s = ns, v->cap = cap;
    }
    v->v[v->n] = x, v->s[v->n] = s;
    v->n++;
    return 0;
}

static node *p_expr(parser *p, int with_cond);
static node *p_or(parser *p);
static node *p_unary(parser *p, int with_filter);
static node *p_primary(parser *p);
static node *p_postfix(parser *p, node *n);

static int p_enter(parser *p)
{
    if (++p->depth > CHAT_MAX_DEPTH) { perr(p, cur(p), "nested too deep (limit %d)", CHAT_MAX_DEPTH); return -1; }
    return 0;
}

/* "(" args ")": positional and name=value arguments; the "(" is the current token. */
static int p_call_args(parser *p, node *n)
{
    nvec pos = {0}, kw = {0};
    adv(p);
    while (!is_op(cur(p), ")")) {
        if (pos.n + kw.n) {
            if (!is_op(cur(p), ",")) return p_expected(p, "',' or ')'");
            adv(p);
            if (is_op(cur(p), ")")) break;
        }
        if (is_op(cur(p), "*") || is_op(cur(p), "**")) return perr(p, cur(p), "*args and **kwargs are not supported");
        if (cur(p)->type == TK_NAME && is_op(peek(p, 1), "=")) {
            const char *k = cur(p)->s;
            adv(p);
            adv(p);
            node *v = p_expr(p, 1);
            if (!v || nv_push(p, &kw, v, k)) return -1;
        } else {
            if (kw.n) return perr(p, cur(p), "a positional argument follows a keyword argument");
            node *v = p_expr(p, 1);
            if (!v || nv_push(p, &pos, v, NULL)) return -1;
        }
    }
    adv(p);
    n->args = pos.v, n->nargs = pos.n, n->kwv = kw.v, n->kwn = kw.s, n->nkw = kw.n;
    return 0;
}

static int in_list(const char *const *l, const char *s)
{
    for (int i = 0; l[i]; i++)
        if (!strcmp(l[i], s)) return 1;
    return 0;
}

static node *p_filter(parser *p, node *target)
{
    adv(p); /* | */
    const token *t = cur(p);
    if (t->type != TK_NAME) { p_expected(p, "a filter name"); return NULL; }
    if (is_op(peek(p, 1), ".")) { perr(p, t, "dotted filter names are not supported"); return NULL; }
    const chat_builtin *fn = chat_filter_find(t->s);
    if (!fn) { perr(p, t, "no filter named '%s'", t->s); return NULL; }
    node *n = mk(p, E_FILTER, t);
    if (!n) return NULL;
    n->name = t->s, n->filter = fn, n->a = target;
    adv(p);
    if (is_op(cur(p), "(") && p_call_args(p, n)) return NULL;
    return n;
}

static node *p_test(parser *p, node *target)
{
    adv(p); /* is */
    node *n = mk(p, E_TEST, cur(p));
    if (!n) return NULL;
    if (is_name(cur(p), "not")) { n->negate = 1; adv(p); }
    const token *t = cur(p);
    if (t->type != TK_NAME) { p_expected(p, "a test name"); return NULL; }
    /* `is none` etc: the keyword-like names are test names here */
    if (!(n->test = chat_test_find(t->s))) { perr(p, t, "no test named '%s'", t->s); return NULL; }
    n->name = t->s, n->a = target;
    adv(p);
    const token *c = cur(p);
    if (is_op(c, "(")) {
        if (p_call_args(p, n)) return NULL;
    } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT || c->type == TK_FLOAT ||
                is_op(c, "(") || is_op(c, "[") || is_op(c, "{")) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        /* a single argument without parentheses: `x is divisibleby 3`, `x is sameas none` */
        node *arg = p_primary(p);
        if (!arg || !(arg = p_postfix(p, arg))) return NULL;
        n->args = chat_arena_alloc(p->ar, sizeof *n->args);
        if (!n->args) { perr(p, c, "out of memory"); return NULL; }
        n->args[0] = arg, n->nargs = 1;
    }
    return n;
}

/* [start:stop:step] or [index], the "[" being current; jinja2's parse_subscribed. */
static node *p_subscript(parser *p, node *obj)
{
    const token *at = cur(p);
    adv(p);
    node *idx[3] = {NULL, NULL, NULL};
    int slice = 0;
    if (!is_op(cur(p), ":")) {
        if (!(idx[0] = p_expr(p, 1))) return NULL;
    }
    if (is_op(cur(p), ":")) {
        slice = 1;
        adv(p);
        if (!is_op(cur(p), "]") && !is_op(cur(p), ":") && !(idx[1] = p_expr(p, 1))) return NULL;
        if (is_op(cur(p), ":")) {
            adv(p);
            if (!is_op(cur(p), "]") && !(idx[2] = p_expr(p, 1))) return NULL;
        }
    }
    if (is_op(cur(p), ",")) { perr(p, cur(p), "tuple subscripts are not supported"); return NULL; }
    if (!is_op(cur(p), "]")) { p_expected(p, "']'"); return NULL; }
    adv(p);
    node *n = mk(p, slice ? E_SLICE : E_ITEM, at);
    if (!n) return NULL;
    n->a = obj;
    if (slice) n->b = idx[0], n->c = idx[1], n->d = idx[2];
    else n->b = idx[0];
    return n;
}

static node *p_postfix(parser *p, node *n)
{
    for (;;) {
        const token *t = cur(p);
        if (is_op(t, ".")) {
            adv(p);
            const token *a = cur(p);
            if (a->type == TK_NAME) {
                node *m = mk(p, E_ATTR, t);
                if (!m) return NULL;
                m->a = n, m->name = a->s;
                adv(p);
                n = m;
            } else if (a->type == TK_INT) {
                node *m = mk(p, E_ITEM, t), *k = mk(p, E_CONST, a);
                if (!m || !k) return NULL;
                k->cval = v_int(a->i);
                m->a = n, m->b = k;
                adv(p);
                n = m;
            } else {
                p_expected(p, "an attribute name after '.'");
                return NULL;
            }
        } else if (is_op(t, "[")) {
            if (!(n = p_subscript(p, n))) return NULL;
        } else if (is_op(t, "(")) {
            node *m = mk(p, E_CALL, t);
            if (!m) return NULL;
            m->a = n;
            if (p_call_args(p, m)) return NULL;
            n = m;
        } else {
            return n;
        }
    }
}

/* jinja2's parse_filter_expr: filters, tests and calls after a unary expression. */
static node *p_filter_expr(parser *p, node *n)
{
    for (;;) {
        if (is_op(cur(p), "|")) n = p_filter(p, n);
        else if (is_name(cur(p), "is")) n = p_test(p, n);
        else if (is_op(cur(p), "(")) n = p_postfix(p, n);
        else return n;
        if (!n) return NULL;
    }
}

/* Comma-separated items up to `close` (trailing comma allowed); the opener is consumed. */
static int p_items(parser *p, const char *close, nvec *keys, nvec *vals)
{
    while (!is_op(cur(p), close)) {
        if (keys->n) {
            if (!is_op(cur(p), ",")) {
                char b[32];
                snprintf(b, sizeof b, "',' or '%s'", close);
                return p_expected(p, b);
            }
            adv(p);
            if (is_op(cur(p), close)) break;
        }
        node *k = p_expr(p, 1);
        if (!k || nv_push(p, keys, k, NULL)) return -1;
        if (vals) {
            if (!is_op(cur(p), ":")) return p_expected(p, "':' in a dict literal");
            adv(p);
            node *v = p_expr(p, 1);
            if (!v || nv_push(p, vals, v, NULL)) return -1;
        }
    }
    adv(p);
    return 0;
}

/* "(" expr ")" or a tuple "(" [expr, ...] ")", the "(" being current. */
static node *p_paren(parser *p)
{
    const token *t = cur(p);
    node *n;
    adv(p);
    if (is_op(cur(p), ")")) { /* () */
        adv(p);
        return mk(p, E_TUPLE, t);
    }
    node *e = p_expr(p, 1);
    if (!e) return NULL;
    if (is_op(cur(p), ",")) {
        nvec items = {0};
        if (nv_push(p, &items, e, NULL)) return NULL;
        adv(p);
        while (!is_op(cur(p), ")")) {
            node *x = p_expr(p, 1);
            if (!x || nv_push(p, &items, x, NULL)) return NULL;
            if (is_op(cur(p), ",")) adv(p);
            else if (!is_op(cur(p), ")")) { p_expected(p, "',' or ')'"); return NULL; }
        }
        if (!(n = mk(p, E_TUPLE, t))) return NULL;
        n->args = items.v, n->nargs = items.n;
    } else {
        n = e;
        if (!is_op(cur(p), ")")) { p_expected(p, "')'"); return NULL; }
    }
    adv(p);
    return n;
}

static node *p_primary(parser *p)
{
    const token *t = cur(p);
    node *n;
    if (p_enter(p)) return NULL;
    switch (t->type) {
    case TK_NAME:
        if (!(n = mk(p, E_CONST, t))) return NULL;
        if (!strcmp(t->s, "true") || !strcmp(t->s, "True")) n->cval = v_bool(1);
        else if (!strcmp(t->s, "false") || !strcmp(t->s, "False")) n->cval = v_bool(0);
        else if (!strcmp(t->s, "none") || !strcmp(t->s, "None")) n->cval = v_none();
        else n->kind = E_NAME, n->name = t->s;
        adv(p);
        break;
    case TK_STRING: { /* adjacent literals concatenate */
        size_t len = 0;
        int k = p->i;
        for (; p->t[k].type == TK_STRING; k++) len += p->t[k].n;
        char *s = chat_arena_alloc(p->ar, len + 1);
        if (!s || !(n = mk(p, E_CONST, t))) { perr(p, t, "out of memory"); return NULL; }
        len = 0;
        for (; cur(p)->type == TK_STRING; adv(p)) {
            memcpy(s + len, cur(p)->s, cur(p)->n);
            len += cur(p)->n;
        }
        s[len] = 0;
        n->cval = v_str(s, len);
        break;
    }
    case TK_INT: case TK_FLOAT:
        if (!(n = mk(p, E_CONST, t))) return NULL;
        n->cval = t->type == TK_INT ? v_int(t->i) : v_float(t->f);
        adv(p);
        break;
    case TK_OP:
        if (is_op(t, "(")) {
            if (!(n = p_paren(p))) return NULL;
            break;
        }
        if (is_op(t, "[") || is_op(t, "{")) {
            int dict = is_op(t, "{");
            nvec keys = {0}, vals = {0};
            adv(p);
            if (p_items(p, dict ? "}" : "]", &keys, dict ? &vals : NULL)) return NULL;
            if (!(n = mk(p, dict ? E_DICT : E_LIST, t))) return NULL;
            n->args = keys.v, n->nargs = keys.n, n->kwv = vals.v, n->nkw = vals.n;
            break;
        }
        /* fall through */
    default: {
        char b[64];
        perr(p, t, "unexpected %s", tk_desc(t, b, sizeof b));
        return NULL;
    }
    }
    p->depth--;
    return n;
}

static node *p_unary(parser *p, int with_filter)
{
    const token *t = cur(p);
    node *n;
    if (p_enter(p)) return NULL;
    if (is_op(t, "-") || is_op(t, "+")) {
        adv(p);
        node *x = p_unary(p, 0);
        if (!x || !(n = mk(p, is_op(t, "-") ? E_NEG : E_POS, t))) return NULL;
        n->a = x;
    } else {
        n = p_primary(p);
    }
    if (n) n = p_postfix(p, n);
    if (n && with_filter) n = p_filter_expr(p, n);
    p->depth--;
    return n;
}

static node *p_bin(parser *p, node *l, int op, const token *at, node *r)
{
    if (!l || !r) return NULL;
    node *n = mk(p, E_BIN, at);
    if (!n) return NULL;
    n->op = op, n->a = l, n->b = r;
    return n;
}

static node *p_pow(parser *p)
{
    node *n = p_unary(p, 1);
    while (n && is_op(cur(p), "**")) {
        const token *t = cur(p);
        adv(p);
        n = p_bin(p, n, OP_POW, t, p_unary(p, 1));
    }
    return n;
}

static node *p_math2(parser *p)
{
    node *n = p_pow(p);
    for (;;) {
        const token *t = cur(p);
        int op = is_op(t, "*") ? OP_MUL : is_op(t, "/") ? OP_DIV : is_op(t, "//") ? OP_FLOORDIV : is_op(t, "%") ? OP_MOD : -1;
        if (!n || op < 0) return n;
        adv(p);
        n = p_bin(p, n, op, t, p_pow(p));
    }
}

static node *p_concat(parser *p)
{
    node *n = p_math2(p);
    while (n && is_op(cur(p), "~")) {
        const token *t = cur(p);
        adv(p);
        n = p_bin(p, n, OP_CONCAT, t, p_math2(p));
    }
    return n;
}

static node *p_math1(parser *p)
{
    node *n = p_concat(p);
    for (;;) {
        const token *t = cur(p);
        int op = is_op(t, "+") ? OP_ADD : is_op(t, "-") ? OP_SUB : -1;
        if (!n || op < 0) return n;
        adv(p);
        n = p_bin(p, n, op, t, p_concat(p));
    }
}

static node *p_compare(parser *p)
{
    const token *at = cur(p);
    node *first = p_math1(p);
    if (!first) return NULL;
    nvec rest = {0};
    int ops[64], nops = 0;
    for (;;) {
        const token *t = cur(p);
        int op = is_op(t, "==") ? C_EQ : is_op(t, "!=") ? C_NE : is_op(t, "<") ? C_LT : is_op(t, "<=") ? C_LE
               : is_op(t, ">") ? C_GT : is_op(t, ">=") ? C_GE : is_name(t, "in") ? C_IN : -1;
        if (op < 0 && is_name(t, "not") && is_name(peek(p, 1), "in")) { adv(p); op = C_NOTIN; }
        if (op < 0) break;
        if (nops == 64) { perr(p, t, "comparison chain too long"); return NULL; }
        adv(p);
        node *r = p_math1(p);
        if (!r || nv_push(p, &rest, r, NULL)) return NULL;
        ops[nops++] = op;
    }
    if (!nops) return first;
    node *n = mk(p, E_CMP, at);
    if (!n || !(n->ops = chat_arena_alloc(p->ar, (size_t)nops * sizeof *n->ops))) { perr(p, at, "out of memory"); return NULL; }
    memcpy(n->ops, ops, (size_t)nops * sizeof *ops);
    n->a = first, n->args = rest.v, n->nargs = nops;
    return n;
}

static node *p_not(parser *p)
{
    if (is_name(cur(p), "not")) {
        const token *t = cur(p);
        adv(p);
        if (p_enter(p)) return NULL;
        node *x = p_not(p), *n;
        p->depth--;
        if (!x || !(n = mk(p, E_NOT, t))) return NULL;
        n->a = x;
        return n;
    }
    return p_compare(p);
}

/* A left-associative chain `x WORD y WORD z` of `operand`s joined by the keyword `word`. */
static node *p_chain(parser *p, const char *word, nkind kind, node *(*operand)(parser *))
{
    node *n = operand(p);
    while (n && is_name(cur(p), word)) {
        const token *t = cur(p);
        adv(p);
        node *r = operand(p), *m;
        if (!r || !(m = mk(p, kind, t))) return NULL;
        m->a = n, m->b = r;
        n = m;
    }
    return n;
}

static node *p_and(parser *p)
{
    return p_chain(p, "and", E_AND, p_not);
}

static node *p_or(parser *p)
{
    return p_chain(p, "or", E_OR, p_and);
}

/* An expression; with_cond: `a if c else b` (the else part optional) is allowed. */
static node *p_expr(parser *p, int with_cond)
{
    if (p_enter(p)) return NULL;
    node *n = p_or(p);
    while (n && with_cond && is_name(cur(p), "if")) {
        const token *t = cur(p);
        adv(p);
        node *c = p_or(p), *m, *e = NULL;
        if (!c) return NULL;
        if (is_name(cur(p), "else")) {
            adv(p);
            if (!(e = p_expr(p, 1))) return NULL;
        }
        if (!(m = mk(p, E_COND, t))) return NULL;
        m->a = n, m->b = c, m->c = e;
        n = m;
    }
    p->depth--;
    return n;
}

/* An expression, or an implicit tuple `a, b` (for `set x = 1, 2` and `{{ a, b }}`). */
static node *p_tuple(parser *p, int with_cond)
{
    const token *at = cur(p);
    node *first = p_expr(p, with_cond);
    if (!first || !is_op(cur(p), ",")) return first;
    nvec items = {0};
    if (nv_push(p, &items, first, NULL)) return NULL;
    while (is_op(cur(p), ",")) {
        adv(p);
        if (cur(p)->type == TK_BLOCK_END || cur(p)->type == TK_VAR_END || is_op(cur(p), ")")) break;
        node *x = p_expr(p, with_cond);
        if (!x || nv_push(p, &items, x, NULL)) return NULL;
    }
    node *n = mk(p, E_TUPLE, at);
    if (!n) return NULL;
    n->args = items.v, n->nargs = items.n;
    return n;
}

/* Assignment targets: `x` or `a, b` (parentheses allowed); for `for` and `set`. */
static int p_targets(parser *p, node *n)
{
    nvec names = {0};
    int paren = is_op(cur(p), "(");
    if (paren) adv(p);
    for (;;) {
        if (cur(p)->type != TK_NAME) return p_expected(p, "a variable name");
        const char *s = cur(p)->s;
        if (!strcmp(s, "true") || !strcmp(s, "false") || !strcmp(s, "none") || !strcmp(s, "True") ||
            !strcmp(s, "False") || !strcmp(s, "None"))
            return perr(p, cur(p), "cannot assign to '%s'", s);
        if (nv_push(p, &names, NULL, s)) return -1;
        adv(p);
        if (!is_op(cur(p), ",")) break;
        adv(p);
        if (paren && is_op(cur(p), ")")) break;
    }
    if (paren) {
        if (!is_op(cur(p), ")")) return p_expected(p, "')'");
        adv(p);
    }
    n->targets = names.s, n->ntargets = names.n;
    return 0;
}

static int p_block_end(parser *p)
{
    if (cur(p)->type != TK_BLOCK_END) return p_expected(p, "end of statement block '%}'");
    adv(p);
    return 0;
}

static node *p_body(parser *p, const char *const *ends, const char **which);

/* {% if %} or {% elif %} (the current token) through its {% endif %}; elif chains nest. */
static node *p_if(parser *p)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const ends2[] = {"endif", NULL};
    const token *t = cur(p);
    const char *which;
    node *n;
    adv(p);
    if (!(n = mk(p, S_IF, t)) || !(n->a = p_tuple(p, 0)) || p_block_end(p)) return NULL;
    n->body = p_body(p, ends, &which);
    if (!which) return NULL;
    if (!strcmp(which, "elif")) {
        if (p_enter(p)) return NULL;
        n->orelse = p_if(p); /* consumes through endif */
        p->depth--;
        return n->orelse ? n : NULL;
    }
    if (!strcmp(which, "else")) {
        adv(p);
        if (p_block_end(p)) return NULL;
        n->orelse = p_body(p, ends2, &which);
        if (!which) return NULL;
    }
    adv(p); /* endif */
    if (p_block_end(p)) return NULL;
    return n;
}

/* {% for targets in expr [if cond] %} ... [{% else %} ...] {% endfor %} */
static node *p_for(parser *p)
{
    static const char *const ends[] = {"else", "endfor", NULL};
    static const char *const ends2[] = {"endfor", NULL};
    const token *t = cur(p);
    node *n;
    adv(p);
    if (!(n = mk(p, S_FOR, t)) || p_targets(p, n)) return NULL;
    if (!is_name(cur(p), "in")) { p_expected(p, "'in'"); return NULL; }
    adv(p);
    if (!(n->a = p_tuple(p, 0))) return NULL;
    if (is_name(cur(p), "if")) {
        adv(p);
        if (!(n->b = p_expr(p, 1))) return NULL;
    }
    if (is_name(cur(p), "recursive")) { perr(p, cur(p), "recursive loops are not supported"); return NULL; }
    if (p_block_end(p)) return NULL;
    const char *which;
    p->loops++;
    n->body = p_body(p, ends, &which);
    p->loops--;
    if (!which) return NULL;
    if (!strcmp(which, "else")) {
        adv(p);
        if (p_block_end(p)) return NULL;
        n->orelse = p_body(p, ends2, &which);
        if (!which) return NULL;
    }
    adv(p);
    if (p_block_end(p)) return NULL;
    return n;
}

/* {% set x = e %}, {% set a, b = e %}, {% set ns.attr = e %}, {% set x %}...{% endset %} */
static node *p_set(parser *p)
{
    static const char *const ends[] = {"endset", NULL};
    const token *t = cur(p);
    node *n;
    adv(p);
    if (!(n = mk(p, S_SET, t))) return NULL;
    if (cur(p)->type == TK_NAME && is_op(peek(p, 1), ".")) { /* set ns.attr = value */
        if (peek(p, 2)->type != TK_NAME) { adv(p); adv(p); p_expected(p, "an attribute name"); return NULL; }
        n->kind = S_SETNS;
        n->targets = chat_arena_alloc(p->ar, sizeof *n->targets);
        if (!n->targets) { perr(p, t, "out of memory"); return NULL; }
        n->targets[0] = cur(p)->s, n->ntargets = 1;
        n->name = peek(p, 2)->s;
        adv(p); adv(p); adv(p);
        if (!is_op(cur(p), "=")) { p_expected(p, "'='"); return NULL; }
    } else if (p_targets(p, n)) {
        return NULL;
    }
    if (is_op(cur(p), "=")) {
        adv(p);
        if (!(n->a = p_tuple(p, 1)) || p_block_end(p)) return NULL;
        return n;
    }
    if (n->kind == S_SETNS || n->ntargets != 1) { p_expected(p, "'='"); return NULL; }
    if (is_op(cur(p), "|")) { perr(p, cur(p), "filtered {%% set %%} blocks are not supported"); return NULL; }
    const char *which;
    n->kind = S_SETBLOCK;
    if (p_block_end(p)) return NULL;
    n->body = p_body(p, ends, &which);
    if (!which) return NULL;
    adv(p);
    if (p_block_end(p)) return NULL;
    return n;
}

/* A block tag; the current token is its name, after "{%". */
static node *p_stmt(parser *p)
{
    const token *t = cur(p);
    char b[64];
    if (t->type != TK_NAME) { perr(p, t, "expected a tag name, got %s", tk_desc(t, b, sizeof b)); return NULL; }
    const char *kw = t->s;
    node *n;
    if (!strcmp(kw, "if")) return p_if(p);
    if (!strcmp(kw, "for")) return p_for(p);
    if (!strcmp(kw, "set")) return p_set(p);
    if (!strcmp(kw, "break") || !strcmp(kw, "continue")) {
        if (!p->loops) { perr(p, t, "'%s' outside of a for loop", kw); return NULL; }
        adv(p);
        if (!(n = mk(p, kw[0] == 'b' ? S_BREAK : S_CONTINUE, t)) || p_block_end(p)) return NULL;
        return n;
    }
    if (!strcmp(kw, "generation")) { /* transformers' AssistantTracker: renders its body */
        static const char *const ends[] = {"endgeneration", NULL};
        const char *which;
        adv(p);
        if (!(n = mk(p, S_BLOCK, t)) || p_block_end(p)) return NULL;
        n->body = p_body(p, ends, &which);
        if (!which) return NULL;
        adv(p);
        if (p_block_end(p)) return NULL;
        return n;
    }
    static const char *const unsupported[] = {"macro", "call", "filter", "with", "block", "extends", "include",
                                              "import", "from", "autoescape", "do", "trans", NULL};
    if (in_list(unsupported, kw)) { perr(p, t, "'%s' tags are not supported", kw); return NULL; }
    perr(p, t, "unknown tag '%s'", kw);
    return NULL;
}

/* Statements up to a block tag named in `ends` (NULL: up to the end of the template). On
 * success *which is that tag name (the current token is the name, its "{%" consumed), or ""
 * at the end of the template; NULL on error. The return is the first statement (NULL when
 * the body is empty). */
static node *p_body(parser *p, const char *const *ends, const char **which)
{
    node *first = NULL, **tail = &first;
    *which = NULL;
    const token *open = cur(p);
    if (p_enter(p)) return NULL;
    for (;;) {
        const token *t = cur(p);
        node *n = NULL;
        if (t->type == TK_EOF) {
            if (ends) {
                int k = 0;
                while (ends[k + 1]) k++; /* the closing tag is the last of the list */
                perr(p, t, "unexpected end of template: expected {%% %s %%} to close the block that starts on line %d",
                     ends[k], open->line);
                return NULL;
            }
            *which = "";
            break;
        }
        if (t->type == TK_DATA) {
            if (!(n = mk(p, S_TEXT, t))) return NULL;
            n->cval = v_str(t->s, t->n);
            adv(p);
        } else if (t->type == TK_VAR_BEGIN) {
            adv(p);
            if (!(n = mk(p, S_OUT, t)) || !(n->a = p_tuple(p, 1))) return NULL;
            if (cur(p)->type != TK_VAR_END) { p_expected(p, "end of print statement '}}'"); return NULL; }
            adv(p);
        } else if (t->type == TK_BLOCK_BEGIN) {
            adv(p);
            const token *nm = cur(p);
            if (nm->type == TK_NAME && ends && in_list(ends, nm->s)) {
                *which = nm->s;
                break;
            }
            if (!(n = p_stmt(p))) return NULL;
        } else {
            char b[64];
            perr(p, t, "unexpected %s", tk_desc(t, b, sizeof b));
            return NULL;
        }
        *tail = n;
        tail = &n->next;
        while (*tail) tail = &(*tail)->next;
    }
    p->depth--;
    return first;
}

int chat_parse(const token *toks, arena *ar, node **body, char *err)
{
    parser p = {.t = toks, .ar = ar, .err = err};
    const char *which;
    *body = p_body(&p, NULL, &which);
    return which ? 0 : -1;
}
