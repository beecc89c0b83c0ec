/*
 * chat-eval.c - renders a parsed chat template: evaluates expressions to values (chat-value.c
 * gives them Python's semantics, chat-builtins.c the filters, tests, methods and globals) and
 * executes statements into the render's output, with jinja2's scoping (a {% set %} in a loop
 * body lasts one iteration; namespace() carries values out). The render's limits (loop
 * iterations, output and value sizes) are checked where the work happens.
 * Part of the chat template renderer (chat-int.h lists the parts); test: ctest -R test_chat.
 */
#include "chat-int.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ scopes */

void chat_frame_init(frame *f, frame *parent)
{
    f->parent = parent, f->b = f->inl, f->n = 0, f->cap = (int)(sizeof f->inl / sizeof f->inl[0]);
}

int chat_frame_set(rctx *c, const node *at, frame *f, const char *name, value v)
{
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->b[i].name, name)) { f->b[i].v = v; return 0; }
    if (f->n == f->cap) {
        binding *nb = chat_ralloc(c, at, (size_t)f->cap * 2 * sizeof *nb);
        if (!nb) return -1;
        memcpy(nb, f->b, (size_t)f->n * sizeof *nb);
        f->b = nb, f->cap *= 2;
    }
    f->b[f->n].name = name, f->b[f->n].v = v;
    f->n++;
    return 0;
}

static const value *frame_get(const frame *f, const char *name)
{
    for (; f; f = f->parent)
        for (int i = f->n - 1; i >= 0; i--)
            if (!strcmp(f->b[i].name, name)) return &f->b[i].v;
    return NULL;
}

/* ------------------------------------------------------------------ expressions */

static int eval(rctx *c, const node *n, frame *f, value *out);

/* Evaluates a call's arguments. */
static int eval_args(rctx *c, const node *n, frame *f, args *a)
{
    a->npos = a->nkw = 0;
    if (n->nargs > MAX_ARGS || n->nkw > MAX_ARGS) return chat_rerr(c, n, "too many arguments (at most %d)", MAX_ARGS);
    for (int i = 0; i < n->nargs; i++)
        if (eval(c, n->args[i], f, &a->pos[a->npos++])) return -1;
    for (int i = 0; i < n->nkw; i++) {
        a->kwn[a->nkw] = n->kwn[i];
        if (eval(c, n->kwv[i], f, &a->kwv[a->nkw++])) return -1;
    }
    return 0;
}

static int eval_slice(rctx *c, const node *n, frame *f, value *out)
{
    value obj, vs[3];
    const value *pv[3] = {NULL, NULL, NULL};
    const node *parts[3] = {n->b, n->c, n->d};
    if (eval(c, n->a, f, &obj)) return -1;
    for (int k = 0; k < 3; k++) {
        if (!parts[k]) continue;
        if (eval(c, parts[k], f, &vs[k])) return -1;
        pv[k] = &vs[k];
    }
    return chat_get_slice(c, n, &obj, pv, out);
}

static int eval_list(rctx *c, const node *n, frame *f, value *out)
{
    vlist *l = chat_mk_list(c, n, (size_t)n->nargs, n->kind == E_TUPLE);
    if (!l) return -1;
    for (int i = 0; i < n->nargs; i++)
        if (eval(c, n->args[i], f, &l->v[i])) return -1;
    *out = v_list(l);
    return 0;
}

static int eval_dict(rctx *c, const node *n, frame *f, value *out)
{
    value k, v;
    vdict *d = chat_ralloc(c, n, sizeof *d);
    if (!d) return -1;
    memset(d, 0, sizeof *d);
    for (int i = 0; i < n->nargs; i++) {
        if (eval(c, n->args[i], f, &k) || eval(c, n->kwv[i], f, &v)) return -1;
        if (k.t == V_LIST && !k.u.l->tuple) return chat_rerr(c, n, "unhashable type: 'list'");
        if (k.t == V_DICT || k.t == V_NS || k.t == V_UNDEF) return chat_rerr(c, n, "unhashable type: '%s'", chat_type_name(&k));
        if (chat_dict_set(c, n, d, k, v)) return -1;
    }
    out->t = V_DICT;
    out->u.d = d;
    return 0;
}

/* -x and +x */
static int eval_sign(rctx *c, const node *n, frame *f, value *out)
{
    value a;
    if (eval(c, n->a, f, &a)) return -1;
    if (a.t == V_UNDEF) return chat_undef_err(c, n, &a);
    if (!is_num(&a)) return chat_rerr(c, n, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+', chat_type_name(&a));
    if (n->kind == E_POS) *out = a.t == V_BOOL ? v_int(a.u.i) : a;
    else if (a.t == V_FLOAT) *out = v_float(-a.u.f);
    else if (a.u.i == INT64_MIN) return chat_rerr(c, n, "integer overflow in unary -");
    else *out = v_int(-a.u.i);
    return 0;
}

/* A comparison chain a OP1 b OP2 c ...: each pair compared, false at the first that fails. */
static int eval_cmp(rctx *c, const node *n, frame *f, value *out)
{
    static const char *const names[] = {"==", "!=", "<", "<=", ">", ">=", "in", "not in"};
    value a, b;
    if (eval(c, n->a, f, &a)) return -1;
    for (int i = 0; i < n->nargs; i++) {
        int r = 0, k;
        if (eval(c, n->args[i], f, &b)) return -1;
        switch (n->ops[i]) {
        case C_EQ: r = chat_veq(&a, &b); break;
        case C_NE: r = !chat_veq(&a, &b); break;
        case C_IN: case C_NOTIN:
            if (chat_contains(c, n, &b, &a, &r)) return -1;
            if (n->ops[i] == C_NOTIN) r = !r;
            break;
        default:
            if (chat_vcmp(c, n, &a, &b, names[n->ops[i]], &k)) return -1;
            r = cmp_holds(n->ops[i], k);
        }
        if (!r) { *out = v_bool(0); return 0; }
        a = b;
    }
    *out = v_bool(1);
    return 0;
}

/* subj|name(args): the filter's table entry was found when the template was parsed. */
static int eval_filter(rctx *c, const node *n, frame *f, value *out)
{
    value subj;
    args a;
    if (eval(c, n->a, f, &subj) || eval_args(c, n, f, &a)) return -1;
    return n->filter->fn(c, n, n->name, &subj, &a, n->filter->arg, out);
}

/* subj is [not] name(x) */
static int eval_test(rctx *c, const node *n, frame *f, value *out)
{
    value subj;
    args a;
    const chat_test *t = n->test;
    int r;
    if (eval(c, n->a, f, &subj) || eval_args(c, n, f, &a)) return -1;
    if (a.nkw) return chat_rerr(c, n, "test '%s' takes no keyword arguments", n->name);
    if (a.npos != t->nargs) return chat_rerr(c, n, "test '%s' takes %d argument%s", n->name, t->nargs, t->nargs ? "" : "s");
    if (t->fn(c, n, &subj, &a.pos[0], t->arg, &r)) return -1;
    *out = v_bool(n->negate ? !r : r);
    return 0;
}

/* obj.name(args) is a method, name(args) a global function; nothing else is callable. */
static int eval_call(rctx *c, const node *n, frame *f, value *out)
{
    value obj;
    args a;
    const node *callee = n->a;
    if (callee->kind == E_ATTR) {
        if (eval(c, callee->a, f, &obj) || eval_args(c, n, f, &a)) return -1;
        /* a dict key holding a value shadows nothing: methods are looked up first, as
         * Python's getattr does */
        return chat_call_method(c, n, &obj, callee->name, &a, out);
    }
    if (callee->kind == E_NAME) {
        const value *v = frame_get(f, callee->name);
        if (v) return chat_rerr(c, n, "'%s' (%s) is not callable", callee->name, chat_type_name(v));
        if (eval_args(c, n, f, &a)) return -1;
        return chat_call_global(c, n, callee->name, &a, out);
    }
    if (eval(c, callee, f, &obj)) return -1;
    if (obj.t == V_UNDEF) return chat_undef_err(c, n, &obj);
    return chat_rerr(c, n, "'%s' object is not callable", chat_type_name(&obj));
}

static int eval(rctx *c, const node *n, frame *f, value *out)
{
    value a, b;
    switch (n->kind) {
    case E_CONST: *out = n->cval; return 0;
    case E_NAME: {
        const value *v = frame_get(f, n->name);
        *out = v ? *v : v_undef(n->name);
        return 0;
    }
    case E_ATTR:
        if (eval(c, n->a, f, &a)) return -1;
        return chat_get_attr(c, n, &a, n->name, out);
    case E_ITEM:
        if (eval(c, n->a, f, &a) || eval(c, n->b, f, &b)) return -1;
        return chat_get_item(c, n, &a, &b, out);
    case E_SLICE: return eval_slice(c, n, f, out);
    case E_LIST: case E_TUPLE: return eval_list(c, n, f, out);
    case E_DICT: return eval_dict(c, n, f, out);
    case E_BIN:
        if (eval(c, n->a, f, &a) || eval(c, n->b, f, &b)) return -1;
        return chat_binop(c, n, n->op, &a, &b, out);
    case E_NEG: case E_POS: return eval_sign(c, n, f, out);
    case E_NOT:
        if (eval(c, n->a, f, &a)) return -1;
        *out = v_bool(!chat_truthy(&a));
        return 0;
    case E_AND: case E_OR:
        if (eval(c, n->a, f, &a)) return -1;
        if (chat_truthy(&a) == (n->kind == E_OR)) { *out = a; return 0; }
        return eval(c, n->b, f, out);
    case E_CMP: return eval_cmp(c, n, f, out);
    case E_COND:
        if (eval(c, n->b, f, &a)) return -1;
        if (chat_truthy(&a)) return eval(c, n->a, f, out);
        if (n->c) return eval(c, n->c, f, out);
        *out = v_undef("else branch");
        return 0;
    case E_FILTER: return eval_filter(c, n, f, out);
    case E_TEST: return eval_test(c, n, f, out);
    case E_CALL: return eval_call(c, n, f, out);
    default:
        return chat_rerr(c, n, "not an expression");
    }
}

/* ------------------------------------------------------------------ statements */

static int out_put(rctx *c, const node *at, const char *s, size_t n)
{
    if (sb_put(c->out, s, n)) return chat_sb_fail(c, at, c->out, "rendered output");
    return 0;
}

static int bind_targets(rctx *c, const node *n, frame *f, const value *v)
{
    if (n->ntargets == 1) return chat_frame_set(c, n, f, n->targets[0], *v);
    if (v->t != V_LIST) return chat_rerr(c, n, "cannot unpack %s into %d names", chat_type_name(v), n->ntargets);
    if (v->u.l->n != (size_t)n->ntargets)
        return chat_rerr(c, n, "%s values to unpack (expected %d, got %zu)", v->u.l->n > (size_t)n->ntargets ? "too many" : "not enough",
                    n->ntargets, v->u.l->n);
    for (int i = 0; i < n->ntargets; i++)
        if (chat_frame_set(c, n, f, n->targets[i], v->u.l->v[i])) return -1;
    return 0;
}

static int exec_for(rctx *c, const node *n, frame *f)
{
    value it;
    vlist *items;
    if (eval(c, n->a, f, &it) || chat_iterate(c, n, &it, &items)) return -1;
    frame fr;
    if (n->b) { /* for x in xs if cond: the loop sees only the items that pass */
        vlist *kept = chat_mk_list(c, n, items->n, 0);
        if (!kept) return -1;
        kept->n = 0;
        for (size_t i = 0; i < items->n; i++) {
            value ok;
            if (++c->iters > CHAT_MAX_ITERS) return chat_rerr(c, n, "more than %ld loop iterations", CHAT_MAX_ITERS);
            chat_frame_init(&fr, f);
            if (bind_targets(c, n, &fr, &items->v[i]) || eval(c, n->b, &fr, &ok)) return -1;
            if (chat_truthy(&ok)) kept->v[kept->n++] = items->v[i];
        }
        items = kept;
    }
    loopinfo *lp = chat_ralloc(c, n, sizeof *lp);
    if (!lp) return -1;
    lp->items = items->v, lp->n = items->n;
    value loopv = {.t = V_LOOP};
    loopv.u.lp = lp;
    for (size_t i = 0; i < items->n; i++) {
        if (++c->iters > CHAT_MAX_ITERS) return chat_rerr(c, n, "more than %ld loop iterations", CHAT_MAX_ITERS);
        lp->i = i;
        chat_frame_init(&fr, f); /* each iteration's {% set %}s are its own, as in jinja2 */
        if (bind_targets(c, n, &fr, &items->v[i]) || chat_frame_set(c, n, &fr, "loop", loopv)) return -1;
        if (chat_exec_body(c, n->body, &fr)) return -1;
        if (c->ctl == 1) { c->ctl = 0; break; }
        c->ctl = 0;
    }
    if (items->n == 0 && n->orelse) return chat_exec_body(c, n->orelse, f);
    return 0;
}

int chat_exec_body(rctx *c, const node *s, frame *f)
{
    value v;
    for (; s; s = s->next) {
        switch (s->kind) {
        case S_TEXT:
            if (out_put(c, s, s->cval.u.s.p, s->cval.u.s.n)) return -1;
            break;
        case S_OUT:
            if (eval(c, s->a, f, &v)) return -1;
            if (chat_str_into(c, s, c->out, &v, 0, 0)) return -1;
            if (c->out->over) return chat_sb_fail(c, s, c->out, "rendered output");
            break;
        case S_IF:
            if (eval(c, s->a, f, &v)) return -1;
            if (chat_exec_body(c, chat_truthy(&v) ? s->body : s->orelse, f)) return -1;
            break;
        case S_FOR:
            if (exec_for(c, s, f)) return -1;
            break;
        case S_SET:
            if (eval(c, s->a, f, &v) || bind_targets(c, s, f, &v)) return -1;
            break;
        case S_SETNS: {
            const value *ns = frame_get(f, s->targets[0]);
            if (!ns || ns->t != V_NS)
                return chat_rerr(c, s, "cannot assign attribute '%s' on '%s': not a namespace()", s->name, s->targets[0]);
            if (eval(c, s->a, f, &v) || chat_dict_set(c, s, ns->u.d, v_str(s->name, strlen(s->name)), v)) return -1;
            break;
        }
        case S_SETBLOCK: {
            sbuf cap = {.limit = CHAT_MAX_OUTPUT}, *saved = c->out;
            c->out = &cap;
            int rc = chat_exec_body(c, s->body, f);
            c->out = saved;
            if (rc) { free(cap.p); return -1; }
            if (chat_sb_to_value(c, s, &cap, &v) || chat_frame_set(c, s, f, s->targets[0], v)) return -1;
            break;
        }
        case S_BREAK: c->ctl = 1; return 0;
        case S_CONTINUE: c->ctl = 2; return 0;
        case S_BLOCK:
            if (chat_exec_body(c, s->body, f)) return -1;
            break;
        default:
            return chat_rerr(c, s, "not a statement");
        }
        if (c->ctl) return 0;
    }
    return 0;
}
