/*
 * chat-lex.c - the chat template lexer: template source to tokens, as jinja2's lexer does it
 * with trim_blocks and lstrip_blocks (the same whitespace rules, the same tokens). Template text
 * becomes TK_DATA tokens with the tags' whitespace control already applied; {% raw %} bodies
 * and comments are resolved here. It does not know tag names or grammar (chat-parse.c does).
 * Part of the chat template renderer (chat-int.h lists the parts); test: ctest -R test_chat.
 */
#include "chat-int.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    char *o = chat_arena_alloc(L->ar, i - start + 1);
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

/* The digits from i with single underscores between them (jinja2's integer_re), appended to
 * buf[*k..] up to cap - 8 bytes (the caller refuses a longer literal); returns the run's end. */
static size_t lx_digits(const lexer *L, size_t i, char *buf, size_t *k, size_t cap)
{
    while (i < L->n && (L->src[i] >= '0' && L->src[i] <= '9')) {
        if (*k < cap - 8) buf[(*k)++] = L->src[i];
        i++;
        if (i + 1 < L->n && L->src[i] == '_' && L->src[i + 1] >= '0' && L->src[i + 1] <= '9') i++;
    }
    return i;
}

static int lx_number(lexer *L)
{
    size_t start = L->pos, i = start;
    char buf[128];
    size_t k = 0;
    int is_float = 0;
    i = lx_digits(L, i, buf, &k, sizeof buf);
    if (i + 1 < L->n && L->src[i] == '.' && L->src[i + 1] >= '0' && L->src[i + 1] <= '9') {
        is_float = 1;
        buf[k++] = L->src[i++];
        i = lx_digits(L, i, buf, &k, sizeof buf);
    }
    if (i < L->n && (L->src[i] == 'e' || L->src[i] == 'E')) {
        size_t j = i + 1;
        if (j < L->n && (L->src[j] == '+' || L->src[j] == '-')) j++;
        if (j < L->n && L->src[j] >= '0' && L->src[j] <= '9') {
            is_float = 1;
            buf[k++] = 'e';
            if (L->src[i + 1] == '-' || L->src[i + 1] == '+') buf[k++] = L->src[i + 1];
            i = lx_digits(L, j, buf, &k, sizeof buf);
        }
    }
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

/* An operator at L->pos; brackets must pair up (stack[0..*depth) are the closers awaited). */
static int lx_op(lexer *L, char *stack, int *depth)
{
    unsigned char c = (unsigned char)L->src[L->pos];
    size_t opn = 0;
    for (int k = 0; OPS2[k]; k++)
        if (lx_starts(L, L->pos, OPS2[k])) { opn = 2; break; }
    if (!opn && c && strchr(OPS1, c)) opn = 1;
    if (!opn) {
        if (c < 0x20 || c >= 0x7f) return lx_err(L, L->pos, "unexpected byte 0x%02x", c);
        return lx_err(L, L->pos, "unexpected character '%c'", c);
    }
    if (opn == 1 && (c == '(' || c == '[' || c == '{')) {
        if (*depth == CHAT_MAX_DEPTH) return lx_err(L, L->pos, "brackets nested too deep");
        stack[(*depth)++] = c == '(' ? ')' : c == '[' ? ']' : '}';
    } else if (opn == 1 && (c == ')' || c == ']' || c == '}')) {
        if (*depth == 0) return lx_err(L, L->pos, "unexpected '%c'", c);
        if (stack[*depth - 1] != (char)c) return lx_err(L, L->pos, "unexpected '%c', expected '%c'", c, stack[*depth - 1]);
        (*depth)--;
    }
    token *t = lx_push(L, TK_OP, L->pos);
    if (!t) return lx_err(L, L->pos, "out of memory");
    t->s = L->src + L->pos, t->n = opn;
    L->pos += opn;
    return 0;
}

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
            char *name = chat_arena_alloc(L->ar, L->pos - s + 1);
            token *t = name ? lx_push(L, TK_NAME, s) : NULL;
            if (!t) return lx_err(L, s, "out of memory");
            memcpy(name, L->src + s, L->pos - s);
            name[L->pos - s] = 0;
            t->s = name, t->n = L->pos - s;
        } else if (c == '\'' || c == '"') {
            if (lx_string(L)) return -1;
        } else if (lx_op(L, stack, &depth)) {
            return -1;
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

int chat_lex(arena *ar, const char *src, size_t len, token **out, char *err)
{
    lexer L = {.ar = ar, .err = err, .line_starting = 1, .lc_line = 1};
    char *norm = chat_arena_alloc(ar, len + 1);
    if (!norm) return kr_errf(err, "out of memory");
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
    if (lex(&L)) {
        free(L.toks);
        return -1;
    }
    *out = L.toks;
    return 0;
}
