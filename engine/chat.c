/*
 * chat.c - chat templates: a renderer for the subset of Jinja2 that Hugging Face chat templates
 * use (tokenizer_config.json "chat_template"), and three built-in templates (Llama 3, ChatML,
 * Mistral) for models that ship none, rendered by the same engine.
 *
 * It follows jinja2 3.1 as transformers runs chat templates: ImmutableSandboxedEnvironment with
 * trim_blocks and lstrip_blocks, the loopcontrols extension ({% break %}, {% continue %}), HF's
 * {% generation %} block, HF's tojson (json.dumps, ensure_ascii off, keys unsorted) and
 * raise_exception. The lexer mirrors jinja2's (same whitespace rules, same tokens), the parser
 * its precedence, the evaluator Python's semantics for the value types templates meet.
 * What it is not: a general Jinja engine: no macros, includes, inheritance, autoescape, custom
 * filters, or Python objects beyond str/int/float/bool/None/list/tuple/dict (docs/chat-templates.md
 * has the subset and the known differences). Outside the subset is a parse or render error.
 *
 * A compiled template is immutable; each render has its own arena, output buffer and limits,
 * so renders of one template may run concurrently.
 * Check a template: kvrelay-tokenize --model DIR --chat conv.json --text-only
 */
#include "kr-util.h"
#include "kr.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
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
static void *arena_alloc(arena *a, size_t n)
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

static void arena_free(arena *a)
{
    for (chunk *c = a->head, *nx; c; c = nx) {
        nx = c->next;
        free(c);
    }
    a->head = NULL;
    a->total = 0;
}

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

static value v_undef(const char *what) { value v = {.t = V_UNDEF}; v.u.undef = what; return v; }
static value v_none(void) { value v = {.t = V_NONE}; return v; }
static value v_bool(int b) { value v = {.t = V_BOOL}; v.u.i = !!b; return v; }
static value v_int(int64_t i) { value v = {.t = V_INT}; v.u.i = i; return v; }
static value v_float(double f) { value v = {.t = V_FLOAT}; v.u.f = f; return v; }
static value v_str(const char *p, size_t n) { value v = {.t = V_STR}; v.u.s.p = p; v.u.s.n = n; return v; }

static const char *type_name(const value *v)
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

/* ------------------------------------------------------------------ UTF-8 and Python's str */

/* Decodes the code point at s[0..n) (n > 0); *len gets its byte length. Invalid bytes decode
 * as themselves with a negative sign, one byte each, so nothing is lost or merged. */
static int32_t u8_decode(const char *s, size_t n, size_t *len)
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
static int py_isspace(int32_t c)
{
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Bytes of s[0..n) that remain after Python's rstrip() / the offset after lstrip(). */
static size_t py_rstrip_len(const char *s, size_t n)
{
    size_t last = 0; /* one past the last non-space character */
    for (size_t i = 0, l; i < n; i += l)
        if (!py_isspace(u8_decode(s + i, n - i, &l))) last = i + l;
    return last;
}

static size_t py_lstrip_off(const char *s, size_t n)
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
static size_t u8_count(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0, l; i < n; i += l, k++) u8_decode(s + i, n - i, &l);
    return k;
}

static size_t u8_encode(int32_t c, char *o)
{
    if (c < 0) { o[0] = (char)(-c - 1); return 1; }
    return (size_t)utf8proc_encode_char(c, (utf8proc_uint8_t *)o);
}

/* ------------------------------------------------------------------ growable byte buffer */

typedef struct sbuf {
    char *p;
    size_t n, cap, limit;
    int over; /* a put was refused: the limit would have been passed, or out of memory */
} sbuf;

static int sb_put(sbuf *b, const char *s, size_t n)
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
static int sb_puts(sbuf *b, const char *s) { return sb_put(b, s, strlen(s)); }

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

typedef struct lexer {
    const char *src;
    size_t n, pos;
    int line_starting; /* jinja2: the last match ended with a newline */
    token *toks;
    int ntok, cap;
    arena *ar;
    char *err;
    size_t lc_pos; /* line/col bookkeeping: position up to which lines are counted */
    int lc_line;
    size_t lc_bol; /* offset of that line's start */
} lexer;

static void lx_linecol(lexer *L, size_t off, int *line, int *col)
{
    if (off < L->lc_pos) { L->lc_pos = 0, L->lc_line = 1, L->lc_bol = 0; }
    for (size_t i = L->lc_pos; i < off && i < L->n; i++)
        if (L->src[i] == '\n') L->lc_line++, L->lc_bol = i + 1;
    L->lc_pos = off;
    *line = L->lc_line;
    *col = (int)(off - L->lc_bol) + 1;
}

static int lx_err(lexer *L, size_t off, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int lx_err(lexer *L, size_t off, const char *fmt, ...)
{
    int line, col;
    lx_linecol(L, off, &line, &col);
    char msg[KR_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kr_errf(L->err, "line %d column %d: %s", line, col, msg);
}

static token *lx_push(lexer *L, tktype type, size_t off)
{
    if (L->ntok == L->cap) {
        int cap = L->cap ? L->cap * 2 : 256;
        token *t = realloc(L->toks, (size_t)cap * sizeof *t);
        if (!t) return NULL;
        L->toks = t, L->cap = cap;
    }
    token *t = &L->toks[L->ntok++];
    memset(t, 0, sizeof *t);
    t->type = type;
    lx_linecol(L, off, &t->line, &t->col);
    return t;
}

/* Python `\s*` from pos: the end of the run. */
static size_t lx_skip_space(const lexer *L, size_t pos)
{
    return pos + py_lstrip_off(L->src + pos, L->n - pos);
}

static int lx_starts(const lexer *L, size_t pos, const char *s)
{
    size_t n = strlen(s);
    return pos + n <= L->n && !memcmp(L->src + pos, s, n);
}

/* The text before a tag, with the tag's whitespace control applied (jinja2's OptionalLStrip):
 * "-" strips all whitespace before the tag; otherwise lstrip_blocks removes the spaces between
 * the line's start and a block or comment tag when nothing else is there. */
static int lx_data(lexer *L, size_t from, size_t to, char sign, int is_var)
{
    const char *text = L->src + from;
    size_t n = to - from;
    if (sign == '-') {
        n = py_rstrip_len(text, n);
    } else if (sign != '+' && !is_var) {
        size_t l_pos = 0;
        for (size_t i = n; i > 0; i--)
            if (text[i - 1] == '\n') { l_pos = i; break; }
        if ((l_pos > 0 || L->line_starting) && l_pos < n && py_lstrip_off(text + l_pos, n - l_pos) == n - l_pos)
            n = l_pos;
    }
    if (n == 0) return 0;
    token *t = lx_push(L, TK_DATA, from);
    if (!t) return lx_err(L, from, "out of memory");
    t->s = text, t->n = n;
    return 0;
}

/* The end of a block tag at pos ("+%}", "-%}" with following whitespace, "%}" with one newline
 * under trim_blocks); 0 when there is none. */
static size_t lx_block_end(const lexer *L, size_t pos)
{
    if (lx_starts(L, pos, "+%}")) return pos + 3;
    if (lx_starts(L, pos, "-%}")) return lx_skip_space(L, pos + 3);
    if (lx_starts(L, pos, "%}")) return pos + 2 + (pos + 2 < L->n && L->src[pos + 2] == '\n');
    return 0;
}

static int lx_string(lexer *L)
{
    size_t start = L->pos;
    char q = L->src[L->pos];
    size_t i = start + 1;
    while (i < L->n && L->src[i] != q) i += L->src[i] == '\\' ? 2 : 1;
    if (i >= L->n) return lx_err(L, start, "unterminated string");
    char *o = arena_alloc(L->ar, i - start + 1);
    if (!o) return lx_err(L, start, "out of memory");
    size_t k = 0;
    for (size_t j = start + 1; j < i;) {
        char c = L->src[j];
        if (c != '\\') { o[k++] = c; j++; continue; }
        char e = L->src[j + 1];
        j += 2;
        switch (e) {
        case 'n': o[k++] = '\n'; break;
        case 't': o[k++] = '\t'; break;
        case 'r': o[k++] = '\r'; break;
        case '\\': o[k++] = '\\'; break;
        case '\'': o[k++] = '\''; break;
        case '"': o[k++] = '"'; break;
        case 'a': o[k++] = '\a'; break;
        case 'b': o[k++] = '\b'; break;
        case 'f': o[k++] = '\f'; break;
        case 'v': o[k++] = '\v'; break;
        case '\n': break; /* a backslash-newline continues the line */
        case 'x': case 'u': case 'U': {
            int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            int32_t cp = 0;
            for (int d = 0; d < digits; d++, j++) {
                char h = j < i ? L->src[j] : 0;
                int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                if (v < 0) return lx_err(L, j, "truncated \\%c escape in a string", e);
                cp = cp * 16 + v;
                if (cp > 0x10ffff) return lx_err(L, j, "\\%c escape out of the Unicode range", e);
            }
            if (cp >= 0xd800 && cp <= 0xdfff) return lx_err(L, j, "\\%c escape names a surrogate", e);
            k += u8_encode(cp, o + k);
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                int32_t cp = e - '0';
                for (int d = 0; d < 2 && j < i && L->src[j] >= '0' && L->src[j] <= '7'; d++) cp = cp * 8 + (L->src[j++] - '0');
                k += u8_encode(cp, o + k);
            } else if (e == 'N') {
                return lx_err(L, j - 2, "\\N{...} escapes are not supported");
            } else { /* Python keeps unknown escapes as written */
                o[k++] = '\\';
                o[k++] = e;
            }
        }
    }
    o[k] = 0;
    token *t = lx_push(L, TK_STRING, start);
    if (!t) return lx_err(L, start, "out of memory");
    t->s = o, t->n = k;
    L->pos = i + 1;
    return 0;
}

static int lx_number(lexer *L)
{
    size_t start = L->pos, i = start;
    char buf[128];
    size_t k = 0;
    int is_float = 0;
    /* digits with single underscores between them, as jinja2's integer_re */
#define LX_DIGITS()                                                                            \
    do {                                                                                       \
        while (i < L->n && (L->src[i] >= '0' && L->src[i] <= '9')) {                           \
            if (k < sizeof buf - 8) buf[k++] = L->src[i];                                      \
            i++;                                                                               \
            if (i + 1 < L->n && L->src[i] == '_' && L->src[i + 1] >= '0' && L->src[i + 1] <= '9') i++; \
        }                                                                                      \
    } while (0)
    LX_DIGITS();
    if (i + 1 < L->n && L->src[i] == '.' && L->src[i + 1] >= '0' && L->src[i + 1] <= '9') {
        is_float = 1;
        buf[k++] = L->src[i++];
        LX_DIGITS();
    }
    if (i < L->n && (L->src[i] == 'e' || L->src[i] == 'E')) {
        size_t j = i + 1;
        if (j < L->n && (L->src[j] == '+' || L->src[j] == '-')) j++;
        if (j < L->n && L->src[j] >= '0' && L->src[j] <= '9') {
            is_float = 1;
            buf[k++] = 'e';
            if (L->src[i + 1] == '-' || L->src[i + 1] == '+') buf[k++] = L->src[i + 1];
            i = j;
            LX_DIGITS();
        }
    }
#undef LX_DIGITS
    buf[k] = 0;
    if (k >= sizeof buf - 8) return lx_err(L, start, "number literal too long");
    token *t = lx_push(L, is_float ? TK_FLOAT : TK_INT, start);
    if (!t) return lx_err(L, start, "out of memory");
    if (is_float) {
        t->f = strtod(buf, NULL);
    } else {
        errno = 0;
        char *end;
        long long v = strtoll(buf, &end, 10);
        if (errno) return lx_err(L, start, "integer literal %s does not fit in 64 bits", buf);
        t->i = v;
    }
    L->pos = i;
    return 0;
}

static const char *const OPS2[] = {"//", "**", "==", "!=", ">=", "<=", NULL};
static const char OPS1[] = "+-/*%~[](){}><=.:|,;";

/* The tokens of a {{ }} or {% %} tag up to and including its end. */
static int lx_tag(lexer *L, int is_block, size_t tag_off)
{
    char stack[CHAT_MAX_DEPTH];
    int depth = 0;
    for (;;) {
        if (L->pos >= L->n)
            return lx_err(L, tag_off, "unterminated %s (no closing %s)", is_block ? "block tag" : "expression",
                          is_block ? "%}" : "}}");
        if (depth == 0) {
            size_t end = 0;
            if (is_block) end = lx_block_end(L, L->pos);
            else if (lx_starts(L, L->pos, "-}}")) end = lx_skip_space(L, L->pos + 3);
            else if (lx_starts(L, L->pos, "}}")) end = L->pos + 2;
            if (end) {
                if (!lx_push(L, is_block ? TK_BLOCK_END : TK_VAR_END, L->pos)) return lx_err(L, L->pos, "out of memory");
                L->line_starting = L->src[end - 1] == '\n';
                L->pos = end;
                return 0;
            }
        }
        size_t l;
        unsigned char c = (unsigned char)L->src[L->pos];
        int32_t cp = u8_decode(L->src + L->pos, L->n - L->pos, &l);
        if (py_isspace(cp)) {
            L->pos = lx_skip_space(L, L->pos);
        } else if (c >= '0' && c <= '9' && !(L->pos > 0 && L->src[L->pos - 1] == '.')) {
            if (lx_number(L)) return -1;
        } else if (c >= '0' && c <= '9') { /* after a dot: an integer (a.0), never a float */
            size_t s = L->pos;
            int64_t v = 0;
            while (L->pos < L->n && L->src[L->pos] >= '0' && L->src[L->pos] <= '9') {
                if (v > (INT64_MAX - 9) / 10) return lx_err(L, s, "integer literal does not fit in 64 bits");
                v = v * 10 + (L->src[L->pos++] - '0');
            }
            token *t = lx_push(L, TK_INT, s);
            if (!t) return lx_err(L, s, "out of memory");
            t->i = v;
        } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            size_t s = L->pos;
            while (L->pos < L->n) {
                char d = L->src[L->pos];
                if (!((d >= 'a' && d <= 'z') || (d >= 'A' && d <= 'Z') || (d >= '0' && d <= '9') || d == '_')) break;
                L->pos++;
            }
            char *name = arena_alloc(L->ar, L->pos - s + 1);
            token *t = name ? lx_push(L, TK_NAME, s) : NULL;
            if (!t) return lx_err(L, s, "out of memory");
            memcpy(name, L->src + s, L->pos - s);
            name[L->pos - s] = 0;
            t->s = name, t->n = L->pos - s;
        } else if (c == '\'' || c == '"') {
            if (lx_string(L)) return -1;
        } else {
            size_t opn = 0;
            for (int k = 0; OPS2[k]; k++)
                if (lx_starts(L, L->pos, OPS2[k])) { opn = 2; break; }
            if (!opn && c && strchr(OPS1, c)) opn = 1;
            if (!opn) {
                if (c < 0x20 || c >= 0x7f) return lx_err(L, L->pos, "unexpected byte 0x%02x", c);
                return lx_err(L, L->pos, "unexpected character '%c'", c);
            }
            if (opn == 1 && (c == '(' || c == '[' || c == '{')) {
                if (depth == CHAT_MAX_DEPTH) return lx_err(L, L->pos, "brackets nested too deep");
                stack[depth++] = c == '(' ? ')' : c == '[' ? ']' : '}';
            } else if (opn == 1 && (c == ')' || c == ']' || c == '}')) {
                if (depth == 0) return lx_err(L, L->pos, "unexpected '%c'", c);
                if (stack[depth - 1] != (char)c) return lx_err(L, L->pos, "unexpected '%c', expected '%c'", c, stack[depth - 1]);
                depth--;
            }
            token *t = lx_push(L, TK_OP, L->pos);
            if (!t) return lx_err(L, L->pos, "out of memory");
            t->s = L->src + L->pos, t->n = opn;
            L->pos += opn;
        }
    }
}

/* {% raw %}: the matched begin tag ends at L->pos; the body runs to {% endraw %}. */
static int lx_raw(lexer *L, size_t tag_off)
{
    for (size_t p = L->pos; p + 1 < L->n; p++) {
        if (L->src[p] != '{' || L->src[p + 1] != '%') continue;
        size_t q = p + 2;
        char sign = 0;
        if (q < L->n && (L->src[q] == '-' || L->src[q] == '+')) sign = L->src[q++];
        q = lx_skip_space(L, q);
        if (!lx_starts(L, q, "endraw")) continue;
        q = lx_skip_space(L, q + 6);
        size_t end = lx_block_end(L, q);
        if (!end) continue;
        if (lx_data(L, L->pos, p, sign, 0)) return -1;
        L->line_starting = L->src[end - 1] == '\n';
        L->pos = end;
        return 0;
    }
    return lx_err(L, tag_off, "missing {%% endraw %%}");
}

static int lex(lexer *L)
{
    while (L->pos < L->n) {
        size_t tag = L->n;
        for (size_t i = L->pos; i + 1 < L->n; i++)
            if (L->src[i] == '{' && (L->src[i + 1] == '{' || L->src[i + 1] == '%' || L->src[i + 1] == '#')) {
                tag = i;
                break;
            }
        if (tag == L->n) {
            token *t = lx_push(L, TK_DATA, L->pos);
            if (!t) return lx_err(L, L->pos, "out of memory");
            t->s = L->src + L->pos, t->n = L->n - L->pos;
            L->pos = L->n;
            break;
        }
        char kind = L->src[tag + 1], sign = 0;
        size_t after = tag + 2;
        if (after < L->n && (L->src[after] == '-' || L->src[after] == '+')) sign = L->src[after++];
        size_t raw_end = 0;
        if (kind == '%') { /* {% raw %} begins with "-%}" plus whitespace or "%}", no trim_blocks */
            size_t q = lx_skip_space(L, after);
            if (lx_starts(L, q, "raw")) {
                q = lx_skip_space(L, q + 3);
                if (lx_starts(L, q, "-%}")) raw_end = lx_skip_space(L, q + 3);
                else if (lx_starts(L, q, "%}")) raw_end = q + 2;
            }
        }
        if (lx_data(L, L->pos, tag, sign, kind == '{')) return -1;
        L->line_starting = 0;
        L->pos = after;
        if (raw_end) {
            L->line_starting = L->src[raw_end - 1] == '\n';
            L->pos = raw_end;
            if (lx_raw(L, tag)) return -1;
        } else if (kind == '#') {
            size_t q = after;
            while (q + 1 < L->n && !(L->src[q] == '#' && L->src[q + 1] == '}')) q++;
            if (q + 1 >= L->n) return lx_err(L, tag, "unterminated comment (no closing #})");
            size_t end;
            if (q > after && L->src[q - 1] == '-') end = lx_skip_space(L, q + 2);
            else if (q > after && L->src[q - 1] == '+') end = q + 2;
            else end = q + 2 + (q + 2 < L->n && L->src[q + 2] == '\n');
            L->line_starting = L->src[end - 1] == '\n';
            L->pos = end;
        } else {
            if (!lx_push(L, kind == '%' ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, tag)) return lx_err(L, tag, "out of memory");
            if (lx_tag(L, kind == '%', tag)) return -1;
        }
    }
    if (!lx_push(L, TK_EOF, L->n)) return lx_err(L, L->n, "out of memory");
    return 0;
}

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

typedef struct node node;
struct node {
    nkind kind;
    int op, line, col;
    int negate; /* E_TEST: "is not" */
    const char *name; /* E_NAME, E_ATTR's attribute, E_FILTER/E_TEST's name, S_SETNS's attribute */
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
    node *n = arena_alloc(p->ar, sizeof *n);
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
        node **nv = arena_alloc(p->ar, (size_t)cap * sizeof *nv);
        const char **ns = arena_alloc(p->ar, (size_t)cap * sizeof *ns);
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

/* Filter and test names the renderer knows: unknown ones are parse errors, as in jinja2. */
static const char *const FILTERS[] = {
    "trim", "length", "count", "tojson", "string", "lower", "upper", "capitalize", "default", "d",
    "first", "last", "join", "items", "list", "replace", "int", "float", "abs", "reverse", "safe",
    "title", NULL};
static const char *const TESTS[] = {
    "defined", "undefined", "none", "string", "mapping", "iterable", "sequence", "number",
    "integer", "float", "boolean", "true", "false", "even", "odd", "divisibleby", "eq",
    "equalto", "ne", "lt", "gt", "le", "ge", "in", "lower", "upper", "sameas", NULL};

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
    if (!in_list(FILTERS, t->s)) { perr(p, t, "no filter named '%s'", t->s); return NULL; }
    node *n = mk(p, E_FILTER, t);
    if (!n) return NULL;
    n->name = t->s, n->a = target;
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
    if (!in_list(TESTS, t->s)) { perr(p, t, "no test named '%s'", t->s); return NULL; }
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
        n->args = arena_alloc(p->ar, sizeof *n->args);
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
        char *s = arena_alloc(p->ar, len + 1);
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
            adv(p);
            if (is_op(cur(p), ")")) { /* () */
                adv(p);
                if (!(n = mk(p, E_TUPLE, t))) return NULL;
                break;
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
    if (!n || !(n->ops = arena_alloc(p->ar, (size_t)nops * sizeof *n->ops))) { perr(p, at, "out of memory"); return NULL; }
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

static node *p_stmt(parser *p, const token *open)
{
    const token *t = cur(p);
    char b[64];
    if (t->type != TK_NAME) { perr(p, t, "expected a tag name, got %s", tk_desc(t, b, sizeof b)); return NULL; }
    const char *kw = t->s;
    node *n;
    if (!strcmp(kw, "if")) return p_if(p);
    if (!strcmp(kw, "for")) {
        static const char *const ends[] = {"else", "endfor", NULL};
        static const char *const ends2[] = {"endfor", NULL};
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
    if (!strcmp(kw, "set")) {
        adv(p);
        if (!(n = mk(p, S_SET, t))) return NULL;
        if (cur(p)->type == TK_NAME && is_op(peek(p, 1), ".")) { /* set ns.attr = value */
            if (peek(p, 2)->type != TK_NAME) { adv(p); adv(p); p_expected(p, "an attribute name"); return NULL; }
            n->kind = S_SETNS;
            n->targets = arena_alloc(p->ar, sizeof *n->targets);
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
        static const char *const ends[] = {"endset", NULL};
        const char *which;
        n->kind = S_SETBLOCK;
        if (p_block_end(p)) return NULL;
        n->body = p_body(p, ends, &which);
        if (!which) return NULL;
        adv(p);
        if (p_block_end(p)) return NULL;
        return n;
    }
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
            if (!(n = p_stmt(p, t))) return NULL;
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

/* ------------------------------------------------------------------ rendering: state */

struct kr_chat_template {
    arena ar; /* the syntax tree, names, literals, the normalized source */
    node *body;
    char *text; /* the source as given (malloc'd) */
    char *bos, *eos; /* malloc'd */
    const char *origin; /* static */
};

typedef struct binding { const char *name; value v; } binding;
typedef struct frame {
    struct frame *parent;
    binding *b;
    int n, cap;
    binding inl[8];
} frame;

typedef struct rctx {
    arena ar; /* every value made during the render */
    sbuf *out;
    char *err;
    long iters;
    int ctl; /* a pending break (1) or continue (2) */
    int raised; /* the error is raise_exception's message */
} rctx;

static int rerr(rctx *c, const node *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int rerr(rctx *c, const node *at, const char *fmt, ...)
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
    return rerr(c, at, "render memory limit reached (%zu MiB of values)", CHAT_MAX_ARENA >> 20);
}

static void *ralloc(rctx *c, const node *at, size_t n)
{
    void *p = arena_alloc(&c->ar, n);
    if (!p) oom(c, at);
    return p;
}

/* A new string of n bytes (+ NUL) in the render arena; NULL (error set) when too long. */
static char *rstr(rctx *c, const node *at, size_t n)
{
    if (n > CHAT_MAX_OUTPUT) {
        rerr(c, at, "string longer than %zu MiB", CHAT_MAX_OUTPUT >> 20);
        return NULL;
    }
    char *s = ralloc(c, at, n + 1);
    if (s) s[n] = 0;
    return s;
}

static void frame_init(frame *f, frame *parent)
{
    f->parent = parent, f->b = f->inl, f->n = 0, f->cap = (int)(sizeof f->inl / sizeof f->inl[0]);
}

static int frame_set(rctx *c, const node *at, frame *f, const char *name, value v)
{
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->b[i].name, name)) { f->b[i].v = v; return 0; }
    if (f->n == f->cap) {
        binding *nb = ralloc(c, at, (size_t)f->cap * 2 * sizeof *nb);
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

/* ------------------------------------------------------------------ rendering: values */

static int truthy(const value *v)
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

static int is_num(const value *v) { return v->t == V_BOOL || v->t == V_INT || v->t == V_FLOAT; }
static int is_intlike(const value *v) { return v->t == V_BOOL || v->t == V_INT; }
static double num(const value *v) { return v->t == V_FLOAT ? v->u.f : (double)v->u.i; }

static int veq(const value *a, const value *b);

static value *dict_find(const vdict *d, const value *k)
{
    for (size_t i = 0; i < d->n; i++)
        if (veq(&d->k[i], k)) return &d->v[i];
    return NULL;
}

static value *dict_find_str(const vdict *d, const char *s)
{
    value k = v_str(s, strlen(s));
    return dict_find(d, &k);
}

static int dict_set(rctx *c, const node *at, vdict *d, value k, value v)
{
    value *slot = dict_find(d, &k);
    if (slot) { *slot = v; return 0; }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        value *nk = ralloc(c, at, cap * sizeof *nk), *nv = ralloc(c, at, cap * sizeof *nv);
        if (!nk || !nv) return -1;
        if (d->n) { memcpy(nk, d->k, d->n * sizeof *nk); memcpy(nv, d->v, d->n * sizeof *nv); }
        d->k = nk, d->v = nv, d->cap = cap;
    }
    d->k[d->n] = k, d->v[d->n] = v;
    d->n++;
    return 0;
}

static int veq(const value *a, const value *b)
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
            if (!veq(&a->u.l->v[i], &b->u.l->v[i])) return 0;
        return 1;
    case V_DICT:
        if (a->u.d->n != b->u.d->n) return 0;
        for (size_t i = 0; i < a->u.d->n; i++) {
            const value *o = dict_find(b->u.d, &a->u.d->k[i]);
            if (!o || !veq(&a->u.d->v[i], o)) return 0;
        }
        return 1;
    case V_NS: return a->u.d == b->u.d;
    case V_LOOP: return a->u.lp == b->u.lp;
    default: return 0;
    }
}

/* Python's ordering for <, <=, >, >=: numbers, strings (code point order = UTF-8 byte order),
 * lists and tuples element by element. *r is <0, 0 or >0. */
static int vcmp(rctx *c, const node *at, const value *a, const value *b, const char *op, int *r)
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
            if (veq(&a->u.l->v[i], &b->u.l->v[i])) continue;
            return vcmp(c, at, &a->u.l->v[i], &b->u.l->v[i], op, r);
        }
        *r = (a->u.l->n > b->u.l->n) - (a->u.l->n < b->u.l->n);
        return 0;
    }
    if (a->t == V_UNDEF || b->t == V_UNDEF) {
        const value *u = a->t == V_UNDEF ? a : b;
        return rerr(c, at, "'%s' is undefined", u->u.undef ? u->u.undef : "value");
    }
    return rerr(c, at, "'%s' not supported between instances of '%s' and '%s'", op, type_name(a), type_name(b));
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
#define PUT(...) do { int w = snprintf(o, left, __VA_ARGS__); if (w < 0 || (size_t)w >= left) return; o += w; left -= (size_t)w; } while (0)
    if (neg) PUT("-");
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            PUT("0.");
            for (int i = 0; i < -decpt; i++) PUT("0");
            PUT("%s", digits);
        } else if (decpt >= nd) {
            PUT("%s", digits);
            for (int i = nd; i < decpt; i++) PUT("0");
            PUT(".0");
        } else {
            PUT("%.*s.%s", decpt, digits, digits + decpt);
        }
    } else {
        PUT("%c", digits[0]);
        if (nd > 1) PUT(".%s", digits + 1);
        PUT("e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
#undef PUT
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
static int str_into(rctx *c, const node *at, sbuf *b, const value *v, int repr, int depth)
{
    char num_buf[40];
    if (depth > CHAT_MAX_DEPTH) return rerr(c, at, "value nested too deep to print");
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
            if (str_into(c, at, b, &l->v[i], 1, depth + 1)) return -1;
        }
        sb_puts(b, l->tuple ? (l->n == 1 ? ",)" : ")") : "]");
        break;
    }
    case V_DICT: case V_NS: {
        const vdict *d = v->u.d;
        sb_puts(b, v->t == V_NS ? "<Namespace {" : "{");
        for (size_t i = 0; i < d->n; i++) {
            if (i) sb_puts(b, ", ");
            if (str_into(c, at, b, &d->k[i], 1, depth + 1)) return -1;
            sb_puts(b, ": ");
            if (str_into(c, at, b, &d->v[i], 1, depth + 1)) return -1;
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

/* The error for a buffer that refused a put. */
static int sb_fail(rctx *c, const node *at, const sbuf *b, const char *what)
{
    if (b->over == 2) return rerr(c, at, "out of memory");
    return rerr(c, at, "%s longer than %zu MiB", what, b->limit >> 20);
}

/* Copies a temporary buffer into the arena as a string value, freeing the buffer. */
static int sb_to_value(rctx *c, const node *at, sbuf *b, value *out)
{
    if (b->over) {
        sb_fail(c, at, b, "string");
        free(b->p);
        return -1;
    }
    char *s = rstr(c, at, b->n);
    if (s && b->n) memcpy(s, b->p, b->n);
    free(b->p);
    if (!s) return -1;
    *out = v_str(s, b->n);
    return 0;
}

/* str(v) as a string value (no copy for strings). */
static int to_str(rctx *c, const node *at, const value *v, value *out)
{
    if (v->t == V_STR) { *out = *v; return 0; }
    if (v->t == V_UNDEF) { *out = v_str("", 0); return 0; }
    sbuf b = {.limit = CHAT_MAX_OUTPUT};
    if (str_into(c, at, &b, v, 0, 0)) { free(b.p); return -1; }
    return sb_to_value(c, at, &b, out);
}

/* json.dumps(v, ensure_ascii=False, indent=indent) as transformers' tojson filter does;
 * indent NULL: one line with ", " and ": " separators. */
static int json_into(rctx *c, const node *at, sbuf *b, const value *v, const char *indent, int level)
{
    char num_buf[40];
    if (level > CHAT_MAX_DEPTH) return rerr(c, at, "value nested too deep for tojson");
    switch (v->t) {
    case V_NONE: sb_puts(b, "null"); return 0;
    case V_BOOL: sb_puts(b, v->u.i ? "true" : "false"); return 0;
    case V_INT: snprintf(num_buf, sizeof num_buf, "%lld", (long long)v->u.i); sb_puts(b, num_buf); return 0;
    case V_FLOAT:
        if (isnan(v->u.f)) sb_puts(b, "NaN");
        else if (isinf(v->u.f)) sb_puts(b, v->u.f < 0 ? "-Infinity" : "Infinity");
        else { py_float(v->u.f, num_buf, sizeof num_buf); sb_puts(b, num_buf); }
        return 0;
    case V_STR: {
        const char *s = v->u.s.p;
        size_t n = v->u.s.n, run = 0;
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
        return 0;
    }
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
                    if (json_into(c, at, b, k, indent, level + 1)) return -1;
                } else if (k->t == V_NONE || k->t == V_BOOL || k->t == V_INT || k->t == V_FLOAT) {
                    sb_puts(b, "\"");
                    if (json_into(c, at, b, k, indent, level + 1)) return -1;
                    sb_puts(b, "\"");
                } else {
                    return rerr(c, at, "tojson: keys must be str, int, float, bool or None, not %s", type_name(k));
                }
                sb_puts(b, ": ");
            }
            if (json_into(c, at, b, is_list ? &v->u.l->v[i] : &v->u.d->v[i], indent, level + 1)) return -1;
        }
        if (indent) {
            sb_puts(b, "\n");
            for (int k = 0; k < level; k++) sb_puts(b, indent);
        }
        sb_puts(b, is_list ? "]" : "}");
        return 0;
    }
    default:
        return rerr(c, at, "tojson: Object of type %s is not JSON serializable", type_name(v));
    }
}

static vlist *mk_list(rctx *c, const node *at, size_t n, int tuple)
{
    vlist *l = ralloc(c, at, sizeof *l);
    if (!l) return NULL;
    l->n = n, l->tuple = tuple;
    l->v = ralloc(c, at, (n ? n : 1) * sizeof *l->v);
    return l->v ? l : NULL;
}

static value v_list(vlist *l) { value v = {.t = V_LIST}; v.u.l = l; return v; }

/* The characters of a string as one-character string values (pointing into the string). */
static int str_chars(rctx *c, const node *at, const value *s, vlist **out)
{
    size_t n = u8_count(s->u.s.p, s->u.s.n);
    vlist *l = mk_list(c, at, n, 0);
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
static int iterate(rctx *c, const node *at, const value *v, vlist **out)
{
    static vlist empty;
    switch (v->t) {
    case V_LIST: *out = v->u.l; return 0;
    case V_DICT: {
        vlist *l = mk_list(c, at, v->u.d->n, 0);
        if (!l) return -1;
        if (v->u.d->n) memcpy(l->v, v->u.d->k, v->u.d->n * sizeof *l->v);
        *out = l;
        return 0;
    }
    case V_STR: return str_chars(c, at, v, out);
    case V_UNDEF: *out = &empty; return 0;
    default: return rerr(c, at, "'%s' object is not iterable", type_name(v));
    }
}

static int undef_err(rctx *c, const node *at, const value *v)
{
    return rerr(c, at, "'%s' is undefined", v->u.undef ? v->u.undef : "value");
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
static int get_attr(rctx *c, const node *at, const value *obj, const char *name, value *out)
{
    const value *f;
    switch (obj->t) {
    case V_UNDEF: return undef_err(c, at, obj);
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
    if (st == 0) return rerr(c, at, "slice step cannot be zero");
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
static int get_item(rctx *c, const node *at, const value *obj, const value *key, value *out)
{
    if (obj->t == V_UNDEF) return undef_err(c, at, obj);
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
        const value *f = dict_find(obj->u.d, key);
        *out = f ? *f : v_undef(key->t == V_STR ? key->u.s.p : "item");
        return 0;
    }
    if (obj->t == V_LOOP && key->t == V_STR) return get_attr(c, at, obj, key->u.s.p, out);
    *out = v_undef("item");
    return 0;
}

static int get_slice(rctx *c, const node *at, const value *obj, const value *vs[3], value *out)
{
    if (obj->t == V_UNDEF) return undef_err(c, at, obj);
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
        vlist *l = mk_list(c, at, n, src->tuple);
        if (!l) return -1;
        for (size_t k = 0; k < n; k++) l->v[k] = src->v[start + (int64_t)k * step];
        *out = v_list(l);
        return 0;
    }
    size_t bytes = 0;
    for (size_t k = 0; k < n; k++) bytes += src->v[start + (int64_t)k * step].u.s.n;
    char *s = rstr(c, at, bytes);
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
    if (an > CHAT_MAX_OUTPUT || bn > CHAT_MAX_OUTPUT - an) return rerr(c, at, "string longer than %zu MiB", CHAT_MAX_OUTPUT >> 20);
    char *s = rstr(c, at, an + bn);
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
            return rerr(c, at, "string longer than %zu MiB", CHAT_MAX_OUTPUT >> 20);
        size_t n = seq->u.s.n * (size_t)times;
        char *s = rstr(c, at, n);
        if (!s) return -1;
        for (int64_t k = 0; k < times; k++) memcpy(s + (size_t)k * seq->u.s.n, seq->u.s.p, seq->u.s.n);
        *out = v_str(s, n);
        return 0;
    }
    size_t m = seq->u.l->n;
    if (m && (uint64_t)times > (CHAT_MAX_ARENA / sizeof(value)) / m) return oom(c, at);
    vlist *l = mk_list(c, at, m * (size_t)times, seq->u.l->tuple);
    if (!l) return -1;
    for (int64_t k = 0; k < times; k++) memcpy(l->v + (size_t)k * m, seq->u.l->v, m * sizeof(value));
    *out = v_list(l);
    return 0;
}

static int binop(rctx *c, const node *at, int op, const value *a, const value *b, value *out)
{
    static const char *const names[] = {"+", "-", "*", "/", "//", "%", "**", "~"};
    if (op == OP_CONCAT) {
        value sa, sb2;
        if (to_str(c, at, a, &sa) || to_str(c, at, b, &sb2)) return -1;
        return concat2(c, at, sa.u.s.p, sa.u.s.n, sb2.u.s.p, sb2.u.s.n, out);
    }
    if (a->t == V_UNDEF) return undef_err(c, at, a);
    if (b->t == V_UNDEF) return undef_err(c, at, b);
    if (op == OP_ADD && a->t == V_STR && b->t == V_STR) return concat2(c, at, a->u.s.p, a->u.s.n, b->u.s.p, b->u.s.n, out);
    if (op == OP_ADD && a->t == V_LIST && b->t == V_LIST && a->u.l->tuple == b->u.l->tuple) {
        vlist *l = mk_list(c, at, a->u.l->n + b->u.l->n, a->u.l->tuple);
        if (!l) return -1;
        if (a->u.l->n) memcpy(l->v, a->u.l->v, a->u.l->n * sizeof(value));
        if (b->u.l->n) memcpy(l->v + a->u.l->n, b->u.l->v, b->u.l->n * sizeof(value));
        *out = v_list(l);
        return 0;
    }
    if (op == OP_MUL && (a->t == V_STR || a->t == V_LIST) && is_intlike(b)) return repeat(c, at, a, b->u.i, out);
    if (op == OP_MUL && (b->t == V_STR || b->t == V_LIST) && is_intlike(a)) return repeat(c, at, b, a->u.i, out);
    if (op == OP_MOD && a->t == V_STR) return rerr(c, at, "string formatting with %% is not supported");
    if (!is_num(a) || !is_num(b))
        return rerr(c, at, "unsupported operand type(s) for %s: '%s' and '%s'", names[op], type_name(a), type_name(b));
    if (is_intlike(a) && is_intlike(b) && op != OP_DIV) {
        int64_t x = a->u.i, y = b->u.i, r = 0;
        int ovf = 0;
        switch (op) {
        case OP_ADD: ovf = __builtin_add_overflow(x, y, &r); break;
        case OP_SUB: ovf = __builtin_sub_overflow(x, y, &r); break;
        case OP_MUL: ovf = __builtin_mul_overflow(x, y, &r); break;
        case OP_FLOORDIV: case OP_MOD: {
            if (y == 0) return rerr(c, at, "integer division or modulo by zero");
            if (x == INT64_MIN && y == -1) { ovf = 1; break; }
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) { q--; m += y; }
            r = op == OP_FLOORDIV ? q : m;
            break;
        }
        case OP_POW:
            if (y < 0) {
                if (x == 0) return rerr(c, at, "0 cannot be raised to a negative power");
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
        if (ovf) return rerr(c, at, "integer overflow in '%s' (beyond 64 bits)", names[op]);
        *out = v_int(r);
        return 0;
    }
    double x = num(a), y = num(b);
    switch (op) {
    case OP_ADD: *out = v_float(x + y); return 0;
    case OP_SUB: *out = v_float(x - y); return 0;
    case OP_MUL: *out = v_float(x * y); return 0;
    case OP_DIV:
        if (y == 0) return rerr(c, at, "division by zero");
        *out = v_float(x / y);
        return 0;
    case OP_FLOORDIV: case OP_MOD: {
        if (y == 0) return rerr(c, at, "float division or modulo by zero");
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
        if (x == 0 && y < 0) return rerr(c, at, "0.0 cannot be raised to a negative power");
        *out = v_float(pow(x, y));
        return 0;
    }
    return rerr(c, at, "bad operator");
}

static int contains(rctx *c, const node *at, const value *hay, const value *needle, int *r)
{
    switch (hay->t) {
    case V_STR:
        if (needle->t != V_STR)
            return rerr(c, at, "'in <string>' requires string as left operand, not %s", type_name(needle));
        if (!needle->u.s.n) { *r = 1; return 0; }
        *r = 0;
        for (size_t i = 0; i + needle->u.s.n <= hay->u.s.n; i++)
            if (!memcmp(hay->u.s.p + i, needle->u.s.p, needle->u.s.n)) { *r = 1; break; }
        return 0;
    case V_LIST:
        *r = 0;
        for (size_t i = 0; i < hay->u.l->n; i++)
            if (veq(&hay->u.l->v[i], needle)) { *r = 1; break; }
        return 0;
    case V_DICT: *r = dict_find(hay->u.d, needle) != NULL; return 0;
    case V_UNDEF: *r = 0; return 0;
    case V_LOOP: *r = 0;
        for (size_t i = 0; i < hay->u.lp->n; i++)
            if (veq(&hay->u.lp->items[i], needle)) { *r = 1; break; }
        return 0;
    default: return rerr(c, at, "argument of type '%s' is not iterable", type_name(hay));
    }
}

/* ------------------------------------------------------------------ rendering: calls */

#define MAX_ARGS 32
typedef struct args {
    value pos[MAX_ARGS];
    int npos;
    const char *kwn[MAX_ARGS];
    value kwv[MAX_ARGS];
    int nkw;
} args;

static int eval(rctx *c, const node *n, frame *f, value *out);

/* Evaluates a call's arguments; `first`, when not NULL, is put before them (a filter's
 * subject). */
static int eval_args(rctx *c, const node *n, frame *f, const value *first, args *a)
{
    a->npos = a->nkw = 0;
    if (n->nargs + (first != NULL) > MAX_ARGS || n->nkw > MAX_ARGS) return rerr(c, n, "too many arguments (at most %d)", MAX_ARGS);
    if (first) a->pos[a->npos++] = *first;
    for (int i = 0; i < n->nargs; i++)
        if (eval(c, n->args[i], f, &a->pos[a->npos++])) return -1;
    for (int i = 0; i < n->nkw; i++) {
        a->kwn[a->nkw] = n->kwn[i];
        if (eval(c, n->kwv[i], f, &a->kwv[a->nkw++])) return -1;
    }
    return 0;
}

/* Binds a call's arguments to the parameter list `params` (names; positional order), as
 * Python does: *vals[k] is NULL for a parameter not given. */
static int bind_args(rctx *c, const node *at, const char *fname, const args *a, const char *const *params,
                     const value **vals)
{
    int np = 0;
    while (params[np]) vals[np] = NULL, np++;
    if (a->npos > np) return rerr(c, at, "%s() takes at most %d argument%s (%d given)", fname, np, np == 1 ? "" : "s", a->npos);
    for (int i = 0; i < a->npos; i++) vals[i] = &a->pos[i];
    for (int i = 0; i < a->nkw; i++) {
        int k = 0;
        while (k < np && strcmp(params[k], a->kwn[i])) k++;
        if (k == np) return rerr(c, at, "%s() got an unexpected keyword argument '%s'", fname, a->kwn[i]);
        if (vals[k]) return rerr(c, at, "%s() got multiple values for argument '%s'", fname, a->kwn[i]);
        vals[k] = &a->kwv[i];
    }
    return 0;
}

static int need_str(rctx *c, const node *at, const char *what, const value *v)
{
    if (v->t == V_STR) return 0;
    if (v->t == V_UNDEF) return undef_err(c, at, v);
    return rerr(c, at, "%s must be a string, not %s", what, type_name(v));
}

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
    char *o = rstr(c, at, s->u.s.n * 2 + 8);
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
        if (k + el > s->u.s.n * 2 + 8) return rerr(c, at, "case mapping grew the string too much");
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
        return sb_to_value(c, at, &b, out);
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
    return sb_to_value(c, at, &b, out);
}

/* str.split(sep=None, maxsplit=-1) */
static int split_str(rctx *c, const node *at, const value *s, const value *sep, int64_t maxsplit, value *out)
{
    const char *p = s->u.s.p;
    size_t n = s->u.s.n, cnt = 0, cap = 8;
    value *items = ralloc(c, at, cap * sizeof *items);
    if (!items) return -1;
#define SPLIT_PUSH(ptr, len)                                                                   \
    do {                                                                                       \
        if (cnt == cap) {                                                                      \
            value *g = ralloc(c, at, cap * 2 * sizeof *g);                                     \
            if (!g) return -1;                                                                 \
            memcpy(g, items, cnt * sizeof *g);                                                 \
            items = g, cap *= 2;                                                               \
        }                                                                                      \
        items[cnt++] = v_str((ptr), (len));                                                    \
    } while (0)
    if (!sep) {
        size_t i = 0, l;
        int64_t splits = 0;
        for (;;) {
            while (i < n && py_isspace(u8_decode(p + i, n - i, &l))) i += l;
            if (i >= n) break;
            if (maxsplit >= 0 && splits == maxsplit) {
                SPLIT_PUSH(p + i, py_rstrip_len(p + i, n - i));
                break;
            }
            size_t b = i;
            while (i < n && !py_isspace(u8_decode(p + i, n - i, &l))) i += l;
            SPLIT_PUSH(p + b, i - b);
            splits++;
        }
    } else {
        if (!sep->u.s.n) return rerr(c, at, "split(): empty separator");
        size_t run = 0, i = 0;
        int64_t splits = 0;
        while (i + sep->u.s.n <= n && (maxsplit < 0 || splits < maxsplit)) {
            if (memcmp(p + i, sep->u.s.p, sep->u.s.n)) { i++; continue; }
            SPLIT_PUSH(p + run, i - run);
            i += sep->u.s.n;
            run = i;
            splits++;
        }
        SPLIT_PUSH(p + run, n - run);
    }
#undef SPLIT_PUSH
    vlist *l = ralloc(c, at, sizeof *l);
    if (!l) return -1;
    l->n = cnt, l->v = items, l->tuple = 0;
    *out = v_list(l);
    return 0;
}

static int opt_int(rctx *c, const node *at, const char *what, const value *v, int64_t dflt, int64_t *out)
{
    if (!v || v->t == V_NONE) { *out = dflt; return 0; }
    if (!is_intlike(v)) return rerr(c, at, "%s must be an integer, not %s", what, type_name(v));
    *out = v->u.i;
    return 0;
}

static int dict_pairs(rctx *c, const node *at, const vdict *d, value *out)
{
    vlist *l = mk_list(c, at, d->n, 0);
    if (!l) return -1;
    for (size_t i = 0; i < d->n; i++) {
        vlist *t = mk_list(c, at, 2, 1);
        if (!t) return -1;
        t->v[0] = d->k[i], t->v[1] = d->v[i];
        l->v[i] = v_list(t);
    }
    *out = v_list(l);
    return 0;
}

/* obj.name(args): the str and dict methods templates use, and loop.cycle. */
static int call_method(rctx *c, const node *at, const value *obj, const char *name, const args *a, value *out)
{
    const value *v[4];
    if (obj->t == V_UNDEF) return undef_err(c, at, obj);
    if (obj->t == V_STR) {
        if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
            static const char *const ps[] = {"chars", NULL};
            if (bind_args(c, at, name, a, ps, v)) return -1;
            const value *set = v[0] && v[0]->t != V_NONE ? v[0] : NULL;
            if (set && need_str(c, at, "strip() argument", set)) return -1;
            strip_str(obj, set, name[0] == 's' ? 3 : name[0] == 'l' ? 1 : 2, out);
            return 0;
        }
        if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
            static const char *const ps[] = {"prefix", NULL};
            if (bind_args(c, at, name, a, ps, v)) return -1;
            if (!v[0]) return rerr(c, at, "%s() takes exactly one argument", name);
            const value *cands = v[0];
            size_t nc = 1;
            if (cands->t == V_LIST) nc = cands->u.l->n, cands = cands->u.l->v;
            *out = v_bool(0);
            for (size_t k = 0; k < nc; k++) {
                const value *x = &cands[k];
                if (need_str(c, at, "startswith/endswith argument", x)) return -1;
                if (x->u.s.n > obj->u.s.n) continue;
                const char *p = name[0] == 's' ? obj->u.s.p : obj->u.s.p + obj->u.s.n - x->u.s.n;
                if (!memcmp(p, x->u.s.p, x->u.s.n)) { *out = v_bool(1); break; }
            }
            return 0;
        }
        if (!strcmp(name, "split")) {
            static const char *const ps[] = {"sep", "maxsplit", NULL};
            int64_t maxsplit = -1;
            if (bind_args(c, at, name, a, ps, v) || opt_int(c, at, "maxsplit", v[1], -1, &maxsplit)) return -1;
            const value *sep = v[0] && v[0]->t != V_NONE ? v[0] : NULL;
            if (sep && need_str(c, at, "split() separator", sep)) return -1;
            return split_str(c, at, obj, sep, maxsplit, out);
        }
        if (!strcmp(name, "replace")) {
            static const char *const ps[] = {"old", "new", "count", NULL};
            int64_t count = -1;
            if (bind_args(c, at, name, a, ps, v) || opt_int(c, at, "count", v[2], -1, &count)) return -1;
            if (!v[0] || !v[1]) return rerr(c, at, "replace() takes at least 2 arguments");
            if (need_str(c, at, "replace() argument", v[0]) || need_str(c, at, "replace() argument", v[1])) return -1;
            return replace_str(c, at, obj, v[0], v[1], count, out);
        }
        int mode = !strcmp(name, "upper") ? CASE_UPPER : !strcmp(name, "lower") ? CASE_LOWER
                 : !strcmp(name, "capitalize") ? CASE_CAPITALIZE : !strcmp(name, "title") ? CASE_TITLE : -1;
        if (mode >= 0) {
            if (a->npos || a->nkw) return rerr(c, at, "%s() takes no arguments", name);
            return recase(c, at, obj, mode, out);
        }
        return rerr(c, at, "str has no supported method '%s'", name);
    }
    if (obj->t == V_DICT) {
        if (!strcmp(name, "get")) {
            static const char *const ps[] = {"key", "default", NULL};
            if (bind_args(c, at, name, a, ps, v)) return -1;
            if (!v[0]) return rerr(c, at, "get() takes at least 1 argument");
            const value *f = dict_find(obj->u.d, v[0]);
            *out = f ? *f : v[1] ? *v[1] : v_none();
            return 0;
        }
        if (a->npos || a->nkw) return rerr(c, at, "%s() takes no arguments", name);
        if (!strcmp(name, "items")) return dict_pairs(c, at, obj->u.d, out);
        if (!strcmp(name, "keys") || !strcmp(name, "values")) {
            vlist *l = mk_list(c, at, obj->u.d->n, 0);
            if (!l) return -1;
            if (obj->u.d->n) memcpy(l->v, name[0] == 'k' ? obj->u.d->k : obj->u.d->v, obj->u.d->n * sizeof(value));
            *out = v_list(l);
            return 0;
        }
        return rerr(c, at, "dict has no supported method '%s' (templates cannot modify dicts)", name);
    }
    if (obj->t == V_LOOP && !strcmp(name, "cycle")) {
        if (!a->npos) return rerr(c, at, "loop.cycle() needs at least one argument");
        *out = a->pos[obj->u.lp->i % (size_t)a->npos];
        return 0;
    }
    if (obj->t == V_LIST) return rerr(c, at, "list has no supported method '%s' (templates cannot modify lists)", name);
    return rerr(c, at, "'%s' object has no method '%s'", type_name(obj), name);
}

/* The globals: range, namespace, dict, raise_exception. */
static int call_global(rctx *c, const node *at, const char *name, const args *a, value *out)
{
    if (!strcmp(name, "raise_exception")) {
        value msg = v_str("", 0);
        if (a->npos && to_str(c, at, &a->pos[0], &msg)) return -1;
        if (c->err) {
            size_t n = msg.u.s.n < KR_ERR_MAX - 1 ? msg.u.s.n : KR_ERR_MAX - 1;
            memcpy(c->err, msg.u.s.p, n);
            c->err[n] = 0;
        }
        c->raised = 1;
        return -1;
    }
    if (!strcmp(name, "range")) {
        int64_t r[3] = {0, 0, 1};
        if (a->nkw || a->npos < 1 || a->npos > 3) return rerr(c, at, "range() takes 1 to 3 integer arguments");
        for (int i = 0; i < a->npos; i++)
            if (!is_intlike(&a->pos[i])) return rerr(c, at, "range() arguments must be integers, not %s", type_name(&a->pos[i]));
        if (a->npos == 1) r[1] = a->pos[0].u.i;
        else for (int i = 0; i < a->npos; i++) r[i] = a->pos[i].u.i;
        if (r[2] == 0) return rerr(c, at, "range() step must not be zero");
        double cnt = r[2] > 0 ? ceil(((double)r[1] - (double)r[0]) / (double)r[2]) : ceil(((double)r[0] - (double)r[1]) / -(double)r[2]);
        if (cnt < 0) cnt = 0;
        if (cnt > CHAT_MAX_RANGE) return rerr(c, at, "range() too big: more than %d items", CHAT_MAX_RANGE);
        vlist *l = mk_list(c, at, (size_t)cnt, 0);
        if (!l) return -1;
        for (size_t k = 0; k < l->n; k++) l->v[k] = v_int(r[0] + (int64_t)k * r[2]);
        *out = v_list(l);
        return 0;
    }
    if (!strcmp(name, "namespace") || !strcmp(name, "dict")) {
        vdict *d = ralloc(c, at, sizeof *d);
        if (!d) return -1;
        memset(d, 0, sizeof *d);
        for (int i = 0; i < a->npos; i++) {
            if (a->pos[i].t != V_DICT) return rerr(c, at, "%s() positional arguments must be dicts", name);
            for (size_t k = 0; k < a->pos[i].u.d->n; k++)
                if (dict_set(c, at, d, a->pos[i].u.d->k[k], a->pos[i].u.d->v[k])) return -1;
        }
        for (int i = 0; i < a->nkw; i++)
            if (dict_set(c, at, d, v_str(a->kwn[i], strlen(a->kwn[i])), a->kwv[i])) return -1;
        out->t = name[0] == 'n' ? V_NS : V_DICT;
        out->u.d = d;
        return 0;
    }
    return rerr(c, at, "'%s' is undefined (not a known function)", name);
}

/* ------------------------------------------------------------------ rendering: filters, tests */

static int filter(rctx *c, const node *n, frame *f, value *out)
{
    value subj;
    args a;
    const value *v[4];
    const char *name = n->name;
    if (eval(c, n->a, f, &subj) || eval_args(c, n, f, NULL, &a)) return -1;
#define PARAMS(...) do { static const char *const ps_[] = {__VA_ARGS__, NULL}; if (bind_args(c, n, name, &a, ps_, v)) return -1; } while (0)
#define NOARGS() do { if (a.npos || a.nkw) return rerr(c, n, "filter '%s' takes no arguments", name); } while (0)
    if (!strcmp(name, "trim")) {
        value s;
        PARAMS("chars");
        const value *set = v[0] && v[0]->t != V_NONE ? v[0] : NULL;
        if (set && need_str(c, n, "trim argument", set)) return -1;
        if (to_str(c, n, &subj, &s)) return -1;
        strip_str(&s, set, 3, out);
        return 0;
    }
    if (!strcmp(name, "length") || !strcmp(name, "count")) {
        NOARGS();
        switch (subj.t) {
        case V_STR: *out = v_int((int64_t)u8_count(subj.u.s.p, subj.u.s.n)); return 0;
        case V_LIST: *out = v_int((int64_t)subj.u.l->n); return 0;
        case V_DICT: *out = v_int((int64_t)subj.u.d->n); return 0;
        case V_UNDEF: *out = v_int(0); return 0;
        case V_LOOP: *out = v_int((int64_t)subj.u.lp->n); return 0;
        default: return rerr(c, n, "object of type '%s' has no len()", type_name(&subj));
        }
    }
    if (!strcmp(name, "tojson")) {
        char ind[64];
        const char *indent = NULL;
        PARAMS("indent");
        if (v[0] && is_intlike(v[0])) {
            int64_t k = v[0]->u.i < 0 ? 0 : v[0]->u.i;
            if (k > 32) return rerr(c, n, "tojson: indent above 32 is not supported");
            memset(ind, ' ', (size_t)k);
            ind[k] = 0;
            indent = ind;
        } else if (v[0] && v[0]->t == V_STR) {
            if (v[0]->u.s.n >= sizeof ind) return rerr(c, n, "tojson: indent string too long");
            memcpy(ind, v[0]->u.s.p, v[0]->u.s.n);
            ind[v[0]->u.s.n] = 0;
            indent = ind;
        } else if (v[0] && v[0]->t != V_NONE) {
            return rerr(c, n, "tojson: indent must be an integer or a string, not %s", type_name(v[0]));
        }
        sbuf b = {.limit = CHAT_MAX_OUTPUT};
        if (json_into(c, n, &b, &subj, indent, 0)) { free(b.p); return -1; }
        return sb_to_value(c, n, &b, out);
    }
    if (!strcmp(name, "string") || !strcmp(name, "safe")) { NOARGS(); return to_str(c, n, &subj, out); }
    if (!strcmp(name, "lower") || !strcmp(name, "upper") || !strcmp(name, "capitalize") || !strcmp(name, "title")) {
        value s;
        NOARGS();
        if (to_str(c, n, &subj, &s)) return -1;
        return recase(c, n, &s, name[0] == 'l' ? CASE_LOWER : name[0] == 'u' ? CASE_UPPER : name[0] == 'c' ? CASE_CAPITALIZE : CASE_TITLE_FILTER, out);
    }
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        PARAMS("default_value", "boolean");
        int use = subj.t == V_UNDEF || (v[1] && truthy(v[1]) && !truthy(&subj));
        *out = use ? (v[0] ? *v[0] : v_str("", 0)) : subj;
        return 0;
    }
    if (!strcmp(name, "first") || !strcmp(name, "last") || !strcmp(name, "list") || !strcmp(name, "reverse")) {
        vlist *l;
        NOARGS();
        if (name[0] == 'l' && name[1] == 'a' && subj.t == V_DICT) return rerr(c, n, "last: 'dict' object is not reversible");
        if (name[0] == 'r' && subj.t == V_STR) {
            const value *sl[3] = {NULL, NULL, NULL};
            value m1 = v_int(-1);
            sl[2] = &m1;
            return get_slice(c, n, &subj, sl, out);
        }
        if (iterate(c, n, &subj, &l)) return -1;
        if (name[0] == 'f') { *out = l->n ? l->v[0] : v_undef("first item"); return 0; }
        if (name[1] == 'a') { *out = l->n ? l->v[l->n - 1] : v_undef("last item"); return 0; }
        vlist *r = mk_list(c, n, l->n, 0);
        if (!r) return -1;
        for (size_t i = 0; i < l->n; i++) r->v[i] = name[0] == 'r' ? l->v[l->n - 1 - i] : l->v[i];
        *out = v_list(r);
        return 0;
    }
    if (!strcmp(name, "join")) {
        vlist *l;
        value sep = v_str("", 0);
        PARAMS("d", "attribute");
        if (v[1] && v[1]->t != V_NONE) return rerr(c, n, "join(attribute=...) is not supported");
        if (v[0] && to_str(c, n, v[0], &sep)) return -1;
        if (iterate(c, n, &subj, &l)) return -1;
        sbuf b = {.limit = CHAT_MAX_OUTPUT};
        for (size_t i = 0; i < l->n; i++) {
            if (i) sb_put(&b, sep.u.s.p, sep.u.s.n);
            if (str_into(c, n, &b, &l->v[i], 0, 0)) { free(b.p); return -1; }
        }
        return sb_to_value(c, n, &b, out);
    }
    if (!strcmp(name, "items")) {
        NOARGS();
        if (subj.t == V_UNDEF) { *out = v_list(mk_list(c, n, 0, 0)); return out->u.l ? 0 : -1; }
        if (subj.t != V_DICT) return rerr(c, n, "items: can only get item pairs from a mapping, not %s", type_name(&subj));
        return dict_pairs(c, n, subj.u.d, out);
    }
    if (!strcmp(name, "replace")) {
        value s;
        int64_t count = -1;
        PARAMS("old", "new", "count");
        if (!v[0] || !v[1]) return rerr(c, n, "replace needs old and new strings");
        if (to_str(c, n, &subj, &s) || need_str(c, n, "replace argument", v[0]) || need_str(c, n, "replace argument", v[1]) ||
            opt_int(c, n, "count", v[2], -1, &count))
            return -1;
        return replace_str(c, n, &s, v[0], v[1], count, out);
    }
    if (!strcmp(name, "int") || !strcmp(name, "float")) {
        int is_int = name[0] == 'i';
        PARAMS("default");
        value dflt = v[0] ? *v[0] : is_int ? v_int(0) : v_float(0);
        if (is_num(&subj)) {
            if (is_int) *out = is_intlike(&subj) ? v_int(subj.u.i) : (isfinite(subj.u.f) && fabs(subj.u.f) < 9.2e18 ? v_int((int64_t)subj.u.f) : dflt);
            else *out = v_float(num(&subj));
            return 0;
        }
        if (subj.t == V_STR) {
            char buf[64];
            value t;
            strip_str(&subj, NULL, 3, &t);
            *out = dflt;
            if (t.u.s.n == 0 || t.u.s.n >= sizeof buf) return 0;
            memcpy(buf, t.u.s.p, t.u.s.n);
            buf[t.u.s.n] = 0;
            char *end;
            errno = 0;
            long long iv = strtoll(buf, &end, 10);
            if (!*end && !errno) { *out = is_int ? v_int(iv) : v_float((double)iv); return 0; }
            double fv = strtod(buf, &end);
            if (!*end && isfinite(fv)) *out = is_int ? (fabs(fv) < 9.2e18 ? v_int((int64_t)fv) : dflt) : v_float(fv);
            return 0;
        }
        *out = dflt;
        return 0;
    }
    if (!strcmp(name, "abs")) {
        NOARGS();
        if (subj.t == V_FLOAT) { *out = v_float(fabs(subj.u.f)); return 0; }
        if (is_intlike(&subj)) {
            if (subj.u.i == INT64_MIN) return rerr(c, n, "integer overflow in abs");
            *out = v_int(subj.u.i < 0 ? -subj.u.i : subj.u.i);
            return 0;
        }
        return rerr(c, n, "bad operand type for abs(): '%s'", type_name(&subj));
    }
#undef PARAMS
#undef NOARGS
    return rerr(c, n, "no filter named '%s'", name);
}

static int test(rctx *c, const node *n, frame *f, int *r)
{
    value subj;
    args a;
    const char *name = n->name;
    if (eval(c, n->a, f, &subj) || eval_args(c, n, f, NULL, &a)) return -1;
    if (a.nkw) return rerr(c, n, "test '%s' takes no keyword arguments", name);
    int want = !strcmp(name, "divisibleby") || !strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "ne") ||
               !strcmp(name, "lt") || !strcmp(name, "gt") || !strcmp(name, "le") || !strcmp(name, "ge") ||
               !strcmp(name, "in") || !strcmp(name, "sameas");
    if (a.npos != want) return rerr(c, n, "test '%s' takes %d argument%s", name, want, want ? "" : "s");
    const value *o = &a.pos[0];
    vtype t = subj.t;
    if (!strcmp(name, "defined")) *r = t != V_UNDEF;
    else if (!strcmp(name, "undefined")) *r = t == V_UNDEF;
    else if (!strcmp(name, "none")) *r = t == V_NONE;
    else if (!strcmp(name, "string")) *r = t == V_STR;
    else if (!strcmp(name, "mapping")) *r = t == V_DICT;
    else if (!strcmp(name, "iterable")) *r = t == V_STR || t == V_LIST || t == V_DICT || t == V_UNDEF || t == V_LOOP;
    else if (!strcmp(name, "sequence")) *r = t == V_STR || t == V_LIST || t == V_DICT || t == V_UNDEF;
    else if (!strcmp(name, "number")) *r = is_num(&subj);
    else if (!strcmp(name, "integer")) *r = t == V_INT;
    else if (!strcmp(name, "float")) *r = t == V_FLOAT;
    else if (!strcmp(name, "boolean")) *r = t == V_BOOL;
    else if (!strcmp(name, "true")) *r = t == V_BOOL && subj.u.i;
    else if (!strcmp(name, "false")) *r = t == V_BOOL && !subj.u.i;
    else if (!strcmp(name, "even") || !strcmp(name, "odd") || !strcmp(name, "divisibleby")) {
        value m;
        value two = v_int(2);
        if (binop(c, n, OP_MOD, &subj, name[0] == 'd' ? o : &two, &m)) return -1;
        *r = name[0] == 'o' ? truthy(&m) : !truthy(&m);
    } else if (!strcmp(name, "eq") || !strcmp(name, "equalto")) *r = veq(&subj, o);
    else if (!strcmp(name, "ne")) *r = !veq(&subj, o);
    else if (!strcmp(name, "lt") || !strcmp(name, "gt") || !strcmp(name, "le") || !strcmp(name, "ge")) {
        int k;
        if (vcmp(c, n, &subj, o, name, &k)) return -1;
        *r = name[0] == 'l' ? (name[1] == 't' ? k < 0 : k <= 0) : (name[1] == 't' ? k > 0 : k >= 0);
    } else if (!strcmp(name, "in")) {
        if (contains(c, n, o, &subj, r)) return -1;
    } else if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        value s;
        int cased = 0, ok = 1;
        if (to_str(c, n, &subj, &s)) return -1;
        for (size_t i = 0, l; i < s.u.s.n; i += l) {
            int32_t cp = u8_decode(s.u.s.p + i, s.u.s.n - i, &l);
            if (!is_cased(cp)) continue;
            cased = 1;
            if (name[0] == 'l' ? utf8proc_tolower(cp) != cp : utf8proc_toupper(cp) != cp) ok = 0;
        }
        *r = cased && ok;
    } else if (!strcmp(name, "sameas")) {
        *r = subj.t == o->t && (t == V_NONE || t == V_UNDEF || ((t == V_BOOL || t == V_INT) && subj.u.i == o->u.i) ||
                                ((t == V_LIST || t == V_DICT || t == V_NS) && subj.u.l == o->u.l) ||
                                (t == V_STR && subj.u.s.p == o->u.s.p && subj.u.s.n == o->u.s.n));
    } else {
        return rerr(c, n, "no test named '%s'", name);
    }
    if (n->negate) *r = !*r;
    return 0;
}

/* ------------------------------------------------------------------ rendering: expressions */

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
        return get_attr(c, n, &a, n->name, out);
    case E_ITEM:
        if (eval(c, n->a, f, &a) || eval(c, n->b, f, &b)) return -1;
        return get_item(c, n, &a, &b, out);
    case E_SLICE: {
        value vs[3];
        const value *pv[3] = {NULL, NULL, NULL};
        const node *parts[3] = {n->b, n->c, n->d};
        if (eval(c, n->a, f, &a)) return -1;
        for (int k = 0; k < 3; k++) {
            if (!parts[k]) continue;
            if (eval(c, parts[k], f, &vs[k])) return -1;
            pv[k] = &vs[k];
        }
        return get_slice(c, n, &a, pv, out);
    }
    case E_LIST: case E_TUPLE: {
        vlist *l = mk_list(c, n, (size_t)n->nargs, n->kind == E_TUPLE);
        if (!l) return -1;
        for (int i = 0; i < n->nargs; i++)
            if (eval(c, n->args[i], f, &l->v[i])) return -1;
        *out = v_list(l);
        return 0;
    }
    case E_DICT: {
        vdict *d = ralloc(c, n, sizeof *d);
        if (!d) return -1;
        memset(d, 0, sizeof *d);
        for (int i = 0; i < n->nargs; i++) {
            if (eval(c, n->args[i], f, &a) || eval(c, n->kwv[i], f, &b)) return -1;
            if (a.t == V_LIST && !a.u.l->tuple) return rerr(c, n, "unhashable type: 'list'");
            if (a.t == V_DICT || a.t == V_NS || a.t == V_UNDEF) return rerr(c, n, "unhashable type: '%s'", type_name(&a));
            if (dict_set(c, n, d, a, b)) return -1;
        }
        out->t = V_DICT;
        out->u.d = d;
        return 0;
    }
    case E_BIN:
        if (eval(c, n->a, f, &a) || eval(c, n->b, f, &b)) return -1;
        return binop(c, n, n->op, &a, &b, out);
    case E_NEG: case E_POS:
        if (eval(c, n->a, f, &a)) return -1;
        if (a.t == V_UNDEF) return undef_err(c, n, &a);
        if (!is_num(&a)) return rerr(c, n, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+', type_name(&a));
        if (n->kind == E_POS) *out = a.t == V_BOOL ? v_int(a.u.i) : a;
        else if (a.t == V_FLOAT) *out = v_float(-a.u.f);
        else if (a.u.i == INT64_MIN) return rerr(c, n, "integer overflow in unary -");
        else *out = v_int(-a.u.i);
        return 0;
    case E_NOT:
        if (eval(c, n->a, f, &a)) return -1;
        *out = v_bool(!truthy(&a));
        return 0;
    case E_AND: case E_OR:
        if (eval(c, n->a, f, &a)) return -1;
        if (truthy(&a) == (n->kind == E_OR)) { *out = a; return 0; }
        return eval(c, n->b, f, out);
    case E_CMP: {
        static const char *const names[] = {"==", "!=", "<", "<=", ">", ">=", "in", "not in"};
        if (eval(c, n->a, f, &a)) return -1;
        for (int i = 0; i < n->nargs; i++) {
            int r = 0, k;
            if (eval(c, n->args[i], f, &b)) return -1;
            switch (n->ops[i]) {
            case C_EQ: r = veq(&a, &b); break;
            case C_NE: r = !veq(&a, &b); break;
            case C_IN: case C_NOTIN:
                if (contains(c, n, &b, &a, &r)) return -1;
                if (n->ops[i] == C_NOTIN) r = !r;
                break;
            default:
                if (vcmp(c, n, &a, &b, names[n->ops[i]], &k)) return -1;
                r = n->ops[i] == C_LT ? k < 0 : n->ops[i] == C_LE ? k <= 0 : n->ops[i] == C_GT ? k > 0 : k >= 0;
            }
            if (!r) { *out = v_bool(0); return 0; }
            a = b;
        }
        *out = v_bool(1);
        return 0;
    }
    case E_COND:
        if (eval(c, n->b, f, &a)) return -1;
        if (truthy(&a)) return eval(c, n->a, f, out);
        if (n->c) return eval(c, n->c, f, out);
        *out = v_undef("else branch");
        return 0;
    case E_FILTER: return filter(c, n, f, out);
    case E_TEST: {
        int r;
        if (test(c, n, f, &r)) return -1;
        *out = v_bool(r);
        return 0;
    }
    case E_CALL: {
        args ar;
        const node *callee = n->a;
        if (callee->kind == E_ATTR) {
            if (eval(c, callee->a, f, &a) || eval_args(c, n, f, NULL, &ar)) return -1;
            /* a dict key holding a value shadows nothing: methods are looked up first, as
             * Python's getattr does */
            return call_method(c, n, &a, callee->name, &ar, out);
        }
        if (callee->kind == E_NAME) {
            const value *v = frame_get(f, callee->name);
            if (v) return rerr(c, n, "'%s' (%s) is not callable", callee->name, type_name(v));
            if (eval_args(c, n, f, NULL, &ar)) return -1;
            return call_global(c, n, callee->name, &ar, out);
        }
        if (eval(c, callee, f, &a)) return -1;
        if (a.t == V_UNDEF) return undef_err(c, n, &a);
        return rerr(c, n, "'%s' object is not callable", type_name(&a));
    }
    default:
        return rerr(c, n, "not an expression");
    }
}

/* ------------------------------------------------------------------ rendering: statements */

static int out_put(rctx *c, const node *at, const char *s, size_t n)
{
    if (sb_put(c->out, s, n)) return sb_fail(c, at, c->out, "rendered output");
    return 0;
}

static int bind_targets(rctx *c, const node *n, frame *f, const value *v)
{
    if (n->ntargets == 1) return frame_set(c, n, f, n->targets[0], *v);
    if (v->t != V_LIST) return rerr(c, n, "cannot unpack %s into %d names", type_name(v), n->ntargets);
    if (v->u.l->n != (size_t)n->ntargets)
        return rerr(c, n, "%s values to unpack (expected %d, got %zu)", v->u.l->n > (size_t)n->ntargets ? "too many" : "not enough",
                    n->ntargets, v->u.l->n);
    for (int i = 0; i < n->ntargets; i++)
        if (frame_set(c, n, f, n->targets[i], v->u.l->v[i])) return -1;
    return 0;
}

static int exec_body(rctx *c, const node *s, frame *f);

static int exec_for(rctx *c, const node *n, frame *f)
{
    value it;
    vlist *items;
    if (eval(c, n->a, f, &it) || iterate(c, n, &it, &items)) return -1;
    frame fr;
    if (n->b) { /* for x in xs if cond: the loop sees only the items that pass */
        vlist *kept = mk_list(c, n, items->n, 0);
        if (!kept) return -1;
        kept->n = 0;
        for (size_t i = 0; i < items->n; i++) {
            value ok;
            if (++c->iters > CHAT_MAX_ITERS) return rerr(c, n, "more than %ld loop iterations", CHAT_MAX_ITERS);
            frame_init(&fr, f);
            if (bind_targets(c, n, &fr, &items->v[i]) || eval(c, n->b, &fr, &ok)) return -1;
            if (truthy(&ok)) kept->v[kept->n++] = items->v[i];
        }
        items = kept;
    }
    loopinfo *lp = ralloc(c, n, sizeof *lp);
    if (!lp) return -1;
    lp->items = items->v, lp->n = items->n;
    value loopv = {.t = V_LOOP};
    loopv.u.lp = lp;
    for (size_t i = 0; i < items->n; i++) {
        if (++c->iters > CHAT_MAX_ITERS) return rerr(c, n, "more than %ld loop iterations", CHAT_MAX_ITERS);
        lp->i = i;
        frame_init(&fr, f); /* each iteration's {% set %}s are its own, as in jinja2 */
        if (bind_targets(c, n, &fr, &items->v[i]) || frame_set(c, n, &fr, "loop", loopv)) return -1;
        if (exec_body(c, n->body, &fr)) return -1;
        if (c->ctl == 1) { c->ctl = 0; break; }
        c->ctl = 0;
    }
    if (items->n == 0 && n->orelse) return exec_body(c, n->orelse, f);
    return 0;
}

static int exec_body(rctx *c, const node *s, frame *f)
{
    value v;
    for (; s; s = s->next) {
        switch (s->kind) {
        case S_TEXT:
            if (out_put(c, s, s->cval.u.s.p, s->cval.u.s.n)) return -1;
            break;
        case S_OUT:
            if (eval(c, s->a, f, &v)) return -1;
            if (str_into(c, s, c->out, &v, 0, 0)) return -1;
            if (c->out->over) return sb_fail(c, s, c->out, "rendered output");
            break;
        case S_IF:
            if (eval(c, s->a, f, &v)) return -1;
            if (exec_body(c, truthy(&v) ? s->body : s->orelse, f)) return -1;
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
                return rerr(c, s, "cannot assign attribute '%s' on '%s': not a namespace()", s->name, s->targets[0]);
            if (eval(c, s->a, f, &v) || dict_set(c, s, ns->u.d, v_str(s->name, strlen(s->name)), v)) return -1;
            break;
        }
        case S_SETBLOCK: {
            sbuf cap = {.limit = CHAT_MAX_OUTPUT}, *saved = c->out;
            c->out = &cap;
            int rc = exec_body(c, s->body, f);
            c->out = saved;
            if (rc) { free(cap.p); return -1; }
            if (sb_to_value(c, s, &cap, &v) || frame_set(c, s, f, s->targets[0], v)) return -1;
            break;
        }
        case S_BREAK: c->ctl = 1; return 0;
        case S_CONTINUE: c->ctl = 2; return 0;
        case S_BLOCK:
            if (exec_body(c, s->body, f)) return -1;
            break;
        default:
            return rerr(c, s, "not a statement");
        }
        if (c->ctl) return 0;
    }
    return 0;
}

/* ------------------------------------------------------------------ built-in templates */

/* Llama 3 header format: <|begin_of_text|>, then per message a role header, the trimmed
 * content and <|eot_id|>; the generation prompt is an open assistant header. */
static const char BUILTIN_LLAMA3[] =
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n";

/* ChatML (Qwen2): <|im_start|>ROLE\nCONTENT<|im_end|>\n per message, a default system message
 * when the conversation does not start with one. */
static const char BUILTIN_CHATML[] =
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n";

/* Mistral: <s>[INST] user [/INST]assistant</s>[INST] ... ; a leading system message goes
 * before the first user message, followed by a blank line; user and assistant must alternate.
 * The [/INST] is the generation prompt, so add_generation_prompt changes nothing. */
static const char BUILTIN_MISTRAL[] =
    "{%- if messages and messages[0]['role'] == 'system' %}\n"
    "    {%- set system_prefix = messages[0]['content'] + '\\n\\n' %}\n"
    "    {%- set conversation = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_prefix = '' %}\n"
    "    {%- set conversation = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in conversation %}\n"
    "    {%- if message['role'] not in ['user', 'assistant'] %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported after an optional first system message') }}\n"
    "    {%- endif %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {{- '[INST] ' + (system_prefix if loop.first else '') + message['content'] + ' [/INST]' }}\n"
    "    {%- else %}\n"
    "        {{- message['content'] + eos_token }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n";

static const struct builtin {
    const char *name, *origin, *src, *bos, *eos; /* bos/eos: when tokenizer_config.json has none */
} BUILTINS[] = {
    {"llama3", "built-in llama3", BUILTIN_LLAMA3, "<|begin_of_text|>", "<|eot_id|>"},
    {"chatml", "built-in chatml", BUILTIN_CHATML, "", "<|im_end|>"},
    {"mistral", "built-in mistral", BUILTIN_MISTRAL, "<s>", "</s>"},
};

static const struct builtin *builtin_find(const char *name)
{
    for (size_t i = 0; i < sizeof BUILTINS / sizeof BUILTINS[0]; i++)
        if (!strcmp(BUILTINS[i].name, name)) return &BUILTINS[i];
    return NULL;
}

/* ------------------------------------------------------------------ public API */

void kr_chat_template_free(kr_chat_template *t)
{
    if (!t) return;
    arena_free(&t->ar);
    free(t->text);
    free(t->bos);
    free(t->eos);
    free(t);
}

static char *dup_str(const char *s)
{
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

/* Parses src (len bytes, may hold NULs: they are template text) into a template. */
static int template_parse(const char *src, size_t len, const char *bos, const char *eos, const char *origin,
                          kr_chat_template **out, char *err)
{
    kr_chat_template *t = calloc(1, sizeof *t);
    if (!t) return kr_errf(err, "out of memory");
    t->ar.limit = CHAT_MAX_ARENA;
    t->origin = origin;
    lexer L = {.ar = &t->ar, .err = err, .line_starting = 1, .lc_line = 1};
    t->text = malloc(len + 1);
    t->bos = dup_str(bos ? bos : "");
    t->eos = dup_str(eos ? eos : "");
    char *norm = arena_alloc(&t->ar, len + 1);
    if (!t->text || !t->bos || !t->eos || !norm) {
        kr_errf(err, "out of memory");
        goto err_free;
    }
    memcpy(t->text, src, len);
    t->text[len] = 0;
    /* jinja2 reads \r\n and \r as \n everywhere and drops one trailing newline */
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n && norm[n - 1] == '\n') n--;
    norm[n] = 0;
    L.src = norm, L.n = n;
    if (lex(&L)) goto err_free;
    parser p = {.t = L.toks, .ar = &t->ar, .err = err};
    const char *which;
    t->body = p_body(&p, NULL, &which);
    if (!which) goto err_free;
    free(L.toks);
    *out = t;
    return KR_OK;
err_free:
    free(L.toks);
    kr_chat_template_free(t);
    return -1;
}

int kr_chat_template_parse(const char *src, const char *bos, const char *eos, kr_chat_template **out, char *err)
{
    if (!src || !out) return kr_errf(err, "kr_chat_template_parse: NULL argument");
    return template_parse(src, strlen(src), bos, eos, "template", out, err);
}

int kr_chat_template_builtin(const char *name, const char *bos, const char *eos, kr_chat_template **out, char *err)
{
    const struct builtin *b = name ? builtin_find(name) : NULL;
    if (!b) return kr_errf(err, "no built-in chat template named '%s' (built-in: llama3, chatml, mistral)", name ? name : "(null)");
    if (template_parse(b->src, strlen(b->src), bos ? bos : b->bos, eos ? eos : b->eos, b->origin, out, err))
        return -1;
    return KR_OK;
}

const char *kr_chat_template_source(const kr_chat_template *t) { return t->origin; }
const char *kr_chat_template_text(const kr_chat_template *t) { return t->text; }
const char *kr_chat_template_bos(const kr_chat_template *t) { return t->bos; }
const char *kr_chat_template_eos(const kr_chat_template *t) { return t->eos; }

/* bos_token / eos_token of tokenizer_config.json: a string or {"content": ...}; NULL when
 * absent or null. */
static const char *special_token(const cJSON *root, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, key);
    if (cJSON_IsString(v)) return v->valuestring;
    const cJSON *c = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

static int file_exists(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

int kr_chat_template_load(const char *dir, kr_chat_template **out, char *err)
{
    char tpath[4096], cpath[4096];
    char *tjson = NULL, *cjson = NULL;
    size_t tlen = 0, clen = 0;
    cJSON *troot = NULL, *croot = NULL;
    int rc = -1;
    if (snprintf(tpath, sizeof tpath, "%s/tokenizer_config.json", dir) >= (int)sizeof tpath ||
        snprintf(cpath, sizeof cpath, "%s/config.json", dir) >= (int)sizeof cpath)
        return kr_errf(err, "%s: path too long", dir);
    const char *bos = NULL, *eos = NULL, *src = NULL;
    if (file_exists(tpath)) {
        if (kr_read_file(tpath, &tjson, &tlen, err)) return -1;
        troot = cJSON_ParseWithLength(tjson, tlen);
        if (!cJSON_IsObject(troot)) {
            kr_errf(err, "%s: not a valid JSON object", tpath);
            goto out;
        }
        bos = special_token(troot, "bos_token");
        eos = special_token(troot, "eos_token");
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(troot, "chat_template");
        if (cJSON_IsString(ct)) {
            src = ct->valuestring;
        } else if (cJSON_IsArray(ct)) { /* [{"name", "template"}]: "default", else the first */
            const cJSON *pick = NULL;
            for (const cJSON *e = ct->child; e; e = e->next) {
                const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
                const cJSON *tp = cJSON_GetObjectItemCaseSensitive(e, "template");
                if (!cJSON_IsObject(e) || !cJSON_IsString(tp)) {
                    kr_errf(err, "%s: chat_template list entries must be {\"name\": ..., \"template\": \"...\"}", tpath);
                    goto out;
                }
                if (!pick) pick = tp;
                if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default")) { pick = tp; break; }
            }
            if (!pick) {
                kr_errf(err, "%s: chat_template is an empty list", tpath);
                goto out;
            }
            src = pick->valuestring;
        } else if (ct && !cJSON_IsNull(ct)) {
            kr_errf(err, "%s: chat_template must be a string or a list of {\"name\", \"template\"}", tpath);
            goto out;
        }
    }
    if (src) {
        char perr_buf[KR_ERR_MAX];
        if (template_parse(src, strlen(src), bos, eos, "tokenizer_config.json", out, perr_buf)) {
            kr_errf(err, "%s: chat_template %s", tpath, perr_buf);
            goto out;
        }
        rc = KR_OK;
        goto out;
    }
    /* no template of its own: a built-in one by model type */
    if (kr_read_file(cpath, &cjson, &clen, err)) goto out;
    croot = cJSON_ParseWithLength(cjson, clen);
    const cJSON *mt = cJSON_IsObject(croot) ? cJSON_GetObjectItemCaseSensitive(croot, "model_type") : NULL;
    const char *type = cJSON_IsString(mt) ? mt->valuestring : NULL;
    const char *name = !type ? NULL : !strcmp(type, "llama") ? "llama3" : !strcmp(type, "qwen2") ? "chatml"
                     : !strcmp(type, "mistral") ? "mistral" : NULL;
    if (!name) {
        kr_errf(err, "%s: the model has no chat template (%s has no \"chat_template\", and model_type %s%s%s has no built-in one: llama, qwen2 and mistral do)",
                dir, file_exists(tpath) ? "tokenizer_config.json" : "there is no tokenizer_config.json that",
                type ? "\"" : "", type ? type : "(absent)", type ? "\"" : "");
        goto out;
    }
    rc = kr_chat_template_builtin(name, bos, eos, out, err);
out:
    cJSON_Delete(troot);
    cJSON_Delete(croot);
    free(tjson);
    free(cjson);
    return rc;
}

int kr_chat_template_render(const kr_chat_template *t, const kr_chat_message *msgs, int n, int add_generation_prompt,
                            char **out, size_t *out_len, char *err)
{
    if (!t || !out || n < 0 || (n > 0 && !msgs)) return kr_errf(err, "kr_chat_template_render: bad arguments");
    sbuf o = {.limit = CHAT_MAX_OUTPUT};
    rctx c = {.out = &o, .err = err};
    c.ar.limit = CHAT_MAX_ARENA;
    frame root;
    frame_init(&root, NULL);
    int rc = -1;
    /* messages: a list of {"role", "content"} dicts; a NULL field is None */
    vlist *l = mk_list(&c, NULL, (size_t)n, 0);
    if (!l) goto out;
    for (int i = 0; i < n; i++) {
        vdict *d = ralloc(&c, NULL, sizeof *d);
        if (!d) goto out;
        memset(d, 0, sizeof *d);
        const char *role = msgs[i].role, *content = msgs[i].content;
        if (dict_set(&c, NULL, d, v_str("role", 4), role ? v_str(role, strlen(role)) : v_none()) ||
            dict_set(&c, NULL, d, v_str("content", 7), content ? v_str(content, strlen(content)) : v_none()))
            goto out;
        l->v[i].t = V_DICT;
        l->v[i].u.d = d;
    }
    /* what transformers' apply_chat_template binds (tools and documents: None without tools) */
    if (frame_set(&c, NULL, &root, "messages", v_list(l)) ||
        frame_set(&c, NULL, &root, "add_generation_prompt", v_bool(add_generation_prompt)) ||
        frame_set(&c, NULL, &root, "bos_token", v_str(t->bos, strlen(t->bos))) ||
        frame_set(&c, NULL, &root, "eos_token", v_str(t->eos, strlen(t->eos))) ||
        frame_set(&c, NULL, &root, "tools", v_none()) || frame_set(&c, NULL, &root, "documents", v_none()))
        goto out;
    if (exec_body(&c, t->body, &root)) goto out;
    if (sb_put(&o, "", 0)) { sb_fail(&c, NULL, &o, "rendered output"); goto out; }
    *out = o.p ? o.p : dup_str("");
    if (!*out) { kr_errf(err, "out of memory"); goto out; }
    if (out_len) *out_len = o.n;
    o.p = NULL;
    rc = KR_OK;
out:
    if (rc && c.raised) rc = KR_CHAT_RAISED;
    free(o.p);
    arena_free(&c.ar);
    return rc;
}
