/*
 * chat-int.h - the internals that the parts of the chat template renderer share (internal to
 * engine/chat*.c; the public API is the chat template section of kr.h):
 *   chat-lex.c      source -> tokens (jinja2's lexer with trim_blocks and lstrip_blocks)
 *   chat-parse.c    tokens -> syntax tree (jinja2's grammar and precedence)
 *   chat-value.c    the value model: Python's equality, ordering, printing, arithmetic, indexing
 *   chat-eval.c     renders a syntax tree: expressions, statements, scopes
 *   chat-builtins.c the filters, tests, methods and globals, each looked up by name in a table
 *   chat.c          kr.h's entry points and the built-in templates
 * Functions shared between the files carry the chat_ prefix (they are extern symbols of the
 * engine library); the small static inline helpers below do not.
 */
#ifndef KR_CHAT_INT_H
#define KR_CHAT_INT_H

#include "kr-util.h"
#include "kr.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Limits of one render (documented in kr.h and docs/chat-templates.md). */
#define CHAT_MAX_OUTPUT ((size_t)16 << 20) /* rendered bytes, and any one string value */
#define CHAT_MAX_ARENA ((size_t)256 << 20) /* all values made during a render */
#define CHAT_MAX_ITERS 1000000L /* loop iterations, all loops together */
#define CHAT_MAX_RANGE 100000 /* range() items, as jinja2's sandbox (MAX_RANGE) */
#define CHAT_MAX_DEPTH 96 /* nesting of tags, expressions and printed containers */

/* ------------------------------------------------------------------ arena */

/* Bump allocation in 64 KiB chunks, freed all at once: a template's tree, a render's values. */
typedef struct chunk {
    struct chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} chunk;

typedef struct arena {
    chunk *head;
    size_t total, limit;
} arena;

/* NULL when the arena would pass its limit or malloc fails. */
void *chat_arena_alloc(arena *a, size_t n);
void chat_arena_free(arena *a);

/* ------------------------------------------------------------------ values */

typedef enum vtype {
    V_UNDEF, /* jinja2's Undefined: prints "", falsy, an error to take attributes of */
    V_NONE,
    V_BOOL,
    V_INT,
    V_FLOAT,
    V_STR,
    V_LIST, /* also tuples (list.tuple) */
    V_DICT,
    V_NS, /* namespace(): the one mutable object */
    V_LOOP, /* the for loop's `loop` */
} vtype;

typedef struct value value;
typedef struct vlist { size_t n; value *v; int tuple; } vlist;
typedef struct vdict { size_t n, cap; value *k, *v; } vdict;
typedef struct loopinfo {
    const value *items;
    size_t n, i;
} loopinfo;

struct value {
    vtype t;
    union {
        int64_t i; /* V_BOOL, V_INT */
        double f;
        struct { const char *p; size_t n; } s;
        vlist *l;
        vdict *d; /* V_DICT, V_NS */
        loopinfo *lp;
        const char *undef; /* what was undefined, for messages (may be NULL) */
    } u;
};

static inline value v_undef(const char *what) { value v = {.t = V_UNDEF}; v.u.undef = what; return v; }
static inline value v_none(void) { value v = {.t = V_NONE}; return v; }
static inline value v_bool(int b) { value v = {.t = V_BOOL}; v.u.i = !!b; return v; }
static inline value v_int(int64_t i) { value v = {.t = V_INT}; v.u.i = i; return v; }
static inline value v_float(double f) { value v = {.t = V_FLOAT}; v.u.f = f; return v; }
static inline value v_str(const char *p, size_t n) { value v = {.t = V_STR}; v.u.s.p = p; v.u.s.n = n; return v; }
static inline value v_list(vlist *l) { value v = {.t = V_LIST}; v.u.l = l; return v; }

static inline int is_num(const value *v) { return v->t == V_BOOL || v->t == V_INT || v->t == V_FLOAT; }
static inline int is_intlike(const value *v) { return v->t == V_BOOL || v->t == V_INT; }
static inline double num(const value *v) { return v->t == V_FLOAT ? v->u.f : (double)v->u.i; }

/* ------------------------------------------------------------------ UTF-8 and Python's str */

/* Decodes the code point at s[0..n) (n > 0); *len gets its byte length. Invalid bytes decode
 * as themselves with a negative sign, one byte each, so nothing is lost or merged. */
static inline int32_t u8_decode(const char *s, size_t n, size_t *len)
{
    utf8proc_int32_t cp;
    utf8proc_ssize_t r = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)(n > 4 ? 4 : n), &cp);
    if (r <= 0) {
        *len = 1;
        return -(int32_t)(unsigned char)s[0] - 1;
    }
    *len = (size_t)r;
    return cp;
}

/* Python's str.isspace(), which is also what `\s` matches in jinja2's lexer. */
static inline int py_isspace(int32_t c)
{
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Bytes of s[0..n) that remain after Python's rstrip() / the offset after lstrip(). */
static inline size_t py_rstrip_len(const char *s, size_t n)
{
    size_t last = 0; /* one past the last non-space character */
    for (size_t i = 0, l; i < n; i += l)
        if (!py_isspace(u8_decode(s + i, n - i, &l))) last = i + l;
    return last;
}

static inline size_t py_lstrip_off(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        size_t l;
        int32_t c = u8_decode(s + i, n - i, &l);
        if (!py_isspace(c)) break;
        i += l;
    }
    return i;
}

/* Code points in s[0..n). */
static inline size_t u8_count(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0, l; i < n; i += l, k++) u8_decode(s + i, n - i, &l);
    return k;
}

static inline size_t u8_encode(int32_t c, char *o)
{
    if (c < 0) { o[0] = (char)(-c - 1); return 1; }
    return (size_t)utf8proc_encode_char(c, (utf8proc_uint8_t *)o);
}

/* ------------------------------------------------------------------ growable byte buffer */

typedef struct sbuf {
    char *p;
    size_t n, cap, limit;
    int over; /* a put was refused: 1 the limit would have been passed, 2 out of memory */
} sbuf;

/* -1 when the put is refused (b->over says why; later puts are refused too). */
static inline int sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->over) return -1;
    if (n > b->limit - b->n) { b->over = 1; return -1; }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->over = 2; return -1; }
        b->p = p, b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}
static inline int sb_puts(sbuf *b, const char *s) { return sb_put(b, s, strlen(s)); }

/* ------------------------------------------------------------------ tokens */

typedef enum tktype {
    TK_EOF, TK_DATA, TK_VAR_BEGIN, TK_VAR_END, TK_BLOCK_BEGIN, TK_BLOCK_END,
    TK_NAME, TK_STRING, TK_INT, TK_FLOAT, TK_OP,
} tktype;

typedef struct token {
    tktype type;
    int line, col;
    const char *s; /* DATA, STRING (decoded), NAME (NUL-terminated), OP (not terminated) */
    size_t n;
    int64_t i;
    double f;
} token;

/* The tokens of src[0..len) (NULs are template text), ending with TK_EOF, in *out (malloc'd:
 * the caller frees it); the normalized source, strings and names they point to are in `ar`.
 * -1 with "line N column M: ..." in err. */
int chat_lex(arena *ar, const char *src, size_t len, token **out, char *err);

/* ------------------------------------------------------------------ syntax tree */

typedef enum nkind {
    /* expressions */
    E_CONST, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_LIST, E_TUPLE, E_DICT, E_BIN, E_NEG, E_POS,
    E_NOT, E_AND, E_OR, E_CMP, E_COND, E_FILTER, E_TEST, E_CALL,
    /* statements */
    S_TEXT, S_OUT, S_IF, S_FOR, S_SET, S_SETNS, S_SETBLOCK, S_BREAK, S_CONTINUE, S_BLOCK,
} nkind;

enum { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT };
enum { C_EQ, C_NE, C_LT, C_LE, C_GT, C_GE, C_IN, C_NOTIN };

typedef struct chat_builtin chat_builtin;
typedef struct chat_test chat_test;

typedef struct node node;
struct node {
    nkind kind;
    int op, line, col;
    int negate; /* E_TEST: "is not" */
    const char *name; /* E_NAME, E_ATTR's attribute, E_FILTER/E_TEST's name, S_SETNS's attribute */
    const chat_builtin *filter; /* E_FILTER: its table entry, found when parsed */
    const chat_test *test; /* E_TEST: its table entry, found when parsed */
    value cval; /* E_CONST */
    node *a, *b, *c, *d; /* operands (E_SLICE: object, start, stop, step; NULLs allowed) */
    node **args; /* E_LIST/E_TUPLE items, E_DICT keys, E_CMP operands after a, call arguments */
    int nargs;
    int *ops; /* E_CMP: nargs operators */
    node **kwv; /* keyword argument values; E_DICT: the values */
    const char **kwn; /* keyword argument names */
    int nkw;
    const char **targets; /* S_FOR, S_SET, S_SETBLOCK: names (several: unpacking) */
    int ntargets;
    node *body, *orelse, *next; /* statement lists */
};

/* The statements of a whole template (NULL when it has none) in *body; nodes and their arrays
 * are in `ar`. -1 with "line N column M: ..." in err. */
int chat_parse(const token *toks, arena *ar, node **body, char *err);

/* ------------------------------------------------------------------ rendering */

typedef struct binding { const char *name; value v; } binding;
typedef struct frame {
    struct frame *parent;
    binding *b;
    int n, cap;
    binding inl[8];
} frame;

/* One render's state: its values, where output goes, its counters. */
typedef struct rctx {
    arena ar; /* every value made during the render */
    sbuf *out;
    char *err;
    long iters;
    int ctl; /* a pending break (1) or continue (2) */
    int raised; /* the error is raise_exception's message */
} rctx;

/* A call's evaluated arguments. */
#define MAX_ARGS 32
typedef struct args {
    value pos[MAX_ARGS];
    int npos;
    const char *kwn[MAX_ARGS];
    value kwv[MAX_ARGS];
    int nkw;
} args;

/* Render errors: "line N: what failed" in c->err; always -1. */
int chat_rerr(rctx *c, const node *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int chat_undef_err(rctx *c, const node *at, const value *v);
/* The error for a buffer that refused a put. */
int chat_sb_fail(rctx *c, const node *at, const sbuf *b, const char *what);
/* n bytes in the render arena / a string of n bytes (+ NUL); NULL (error set) when refused. */
void *chat_ralloc(rctx *c, const node *at, size_t n);
char *chat_rstr(rctx *c, const node *at, size_t n);
vlist *chat_mk_list(rctx *c, const node *at, size_t n, int tuple);
/* Copies a temporary buffer into the arena as a string value, freeing the buffer. */
int chat_sb_to_value(rctx *c, const node *at, sbuf *b, value *out);

/* chat-value.c: Python's semantics for the value types. */
const char *chat_type_name(const value *v);
int chat_truthy(const value *v);
int chat_veq(const value *a, const value *b);
int chat_vcmp(rctx *c, const node *at, const value *a, const value *b, const char *op, int *r);
value *chat_dict_find(const vdict *d, const value *k);
int chat_dict_set(rctx *c, const node *at, vdict *d, value k, value v);
int chat_str_into(rctx *c, const node *at, sbuf *b, const value *v, int repr, int depth);
int chat_to_str(rctx *c, const node *at, const value *v, value *out);
int chat_json_into(rctx *c, const node *at, sbuf *b, const value *v, const char *indent, int level);
int chat_iterate(rctx *c, const node *at, const value *v, vlist **out);
int chat_get_attr(rctx *c, const node *at, const value *obj, const char *name, value *out);
int chat_get_item(rctx *c, const node *at, const value *obj, const value *key, value *out);
int chat_get_slice(rctx *c, const node *at, const value *obj, const value *vs[3], value *out);
int chat_binop(rctx *c, const node *at, int op, const value *a, const value *b, value *out);
int chat_contains(rctx *c, const node *at, const value *hay, const value *needle, int *r);

/* chat-eval.c: scopes and statements. */
void chat_frame_init(frame *f, frame *parent);
int chat_frame_set(rctx *c, const node *at, frame *f, const char *name, value v);
int chat_exec_body(rctx *c, const node *s, frame *f);

/* chat-builtins.c. A filter, method or global function: `self` is the filter's subject or the
 * method's object (NULL for a global), `name` the name it was called by (for messages), `arg`
 * its table entry's (it tells apart the members of a family that share one function). */
struct chat_builtin {
    const char *name;
    int (*fn)(rctx *c, const node *at, const char *name, const value *self, const args *a, int arg, value *out);
    int arg;
};
/* A test `subj is name(x)`: takes `nargs` (0 or 1) positional arguments, x being the one. */
struct chat_test {
    const char *name;
    int (*fn)(rctx *c, const node *at, const value *subj, const value *x, int arg, int *r);
    int nargs, arg;
};
/* NULL for a name the renderer does not know (a parse error, as in jinja2). */
const chat_builtin *chat_filter_find(const char *name);
const chat_test *chat_test_find(const char *name);
/* obj.name(args): the str and dict methods templates use, and loop.cycle. */
int chat_call_method(rctx *c, const node *at, const value *obj, const char *name, const args *a, value *out);
/* name(args) for a name that is not a variable: range, namespace, dict, raise_exception. */
int chat_call_global(rctx *c, const node *at, const char *name, const args *a, value *out);

/* Whether a < b (op C_LT), a <= b, a > b or a >= b holds, k being their ordering (chat_vcmp). */
static inline int cmp_holds(int op, int k)
{
    return op == C_LT ? k < 0 : op == C_LE ? k <= 0 : op == C_GT ? k > 0 : k >= 0;
}

#endif
