/*
 * tokenizer.c - Hugging Face tokenizer.json (BPE models) for the engine: loading, encoding,
 * decoding and the incremental detokenizer declared in kr.h.
 *
 * What it is: an interpreter of the tokenizer.json sections that Llama-family checkpoints use.
 * normalizer: NFC/NFKC/NFD/NFKD, Prepend, Replace (string pattern), Sequence; pre_tokenizer:
 * Split (regex or string, Isolated/Removed), ByteLevel, Metaspace, Sequence; model: BPE
 * (classic "a b" or ["a","b"] merges, ignore_merges, byte_fallback, unk, fuse_unk);
 * post_processor: TemplateProcessing (for BOS/EOS), ByteLevel, Sequence; decoder: ByteLevel,
 * Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence. Added tokens are matched in the raw
 * text before normalization (leftmost, then longest).
 * What it is not: WordPiece/Unigram/WordLevel models, BPE dropout, offsets, pairs, padding or
 * truncation. Anything it does not interpret is a load error naming the component.
 * Notes: docs/tokenizer.md. Tests: tests/unit/test_tokenizer.c, tests/fuzz/fuzz_tokenizer.c.
 */
#include "kr-tokenizer.h"
#include "kr-util.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>
#include <stdio.h>
#include <utf8proc.h>

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ UTF-8 */

enum { U8_OK = 0, U8_INCOMPLETE = 1, U8_INVALID = 2 };

/* Looks at the character starting at s[0] (n >= 1 bytes available). Returns U8_OK with *len =
 * its length; U8_INCOMPLETE when the bytes are a valid prefix cut by the end of the buffer
 * (*len = n); U8_INVALID with *len = the maximal invalid subpart (>= 1), which is what
 * Rust's from_utf8_lossy (and so HF decode) replaces by one U+FFFD. */
static int u8_char(const uint8_t *s, size_t n, size_t *len)
{
    uint8_t c = s[0];
    size_t need;
    uint8_t lo = 0x80, hi = 0xbf;
    if (c < 0x80) { *len = 1; return U8_OK; }
    if (c >= 0xc2 && c <= 0xdf) need = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        need = 3;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 4;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;
    } else { *len = 1; return U8_INVALID; }
    for (size_t i = 1; i < need; i++) {
        if (i >= n) { *len = n; return U8_INCOMPLETE; }
        uint8_t b = s[i];
        if (b < lo || b > hi) { *len = i; return U8_INVALID; }
        lo = 0x80, hi = 0xbf;
    }
    *len = need;
    return U8_OK;
}

/* Offset of the first invalid byte, or n when all of s is valid UTF-8. */
static size_t u8_check(const uint8_t *s, size_t n)
{
    size_t i = 0, l;
    while (i < n) {
        if (u8_char(s + i, n - i, &l) != U8_OK) return i;
        i += l;
    }
    return n;
}

static size_t u8_encode(uint32_t cp, uint8_t *out)
{
    if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { out[0] = (uint8_t)(0xc0 | (cp >> 6)); out[1] = (uint8_t)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xe0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (uint8_t)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (uint8_t)(0xf0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (uint8_t)(0x80 | (cp & 0x3f));
    return 4;
}

/* ------------------------------------------------------------------ growable byte buffer */

typedef struct kr_buf {
    char *p;
    size_t n, cap;
} kr_buf;

static int buf_reserve(kr_buf *b, size_t extra)
{
    if (b->n + extra + 1 <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static int buf_add(kr_buf *b, const void *s, size_t n)
{
    if (buf_reserve(b, n)) return -1;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

/* ------------------------------------------------------------------ hash maps */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static uint32_t pow2_at_least(size_t n)
{
    uint32_t c = 16;
    while (c < n * 2) c *= 2;
    return c;
}

/* One token: its string as in tokenizer.json and its decoded bytes (after the per-token
 * decoders: ByteLevel byte map, Replace). */
typedef struct kr_tok {
    uint32_t off, len; /* token string in t->arena */
    uint32_t doff, dlen; /* decoded bytes in t->arena */
    int16_t byte; /* <0xXX> byte-fallback token: XX; else -1 */
    uint8_t present; /* some token has this id */
    uint8_t special;
} kr_tok;

typedef struct kr_pair {
    uint64_t key; /* (a << 32 | b) + 1; 0 = empty slot */
    int32_t rank;
    int32_t merged;
} kr_pair;

typedef struct kr_added {
    uint32_t off, len; /* content in arena */
    int32_t id;
    uint8_t lstrip, rstrip, single_word, special;
} kr_added;

enum { NORM_NFC, NORM_NFKC, NORM_NFD, NORM_NFKD, NORM_PREPEND, NORM_REPLACE };
typedef struct kr_norm {
    int kind;
    char *a, *b; /* Prepend: a; Replace: a -> b */
} kr_norm;

enum { PRE_SPLIT, PRE_BYTELEVEL, PRE_METASPACE };
enum { SPLIT_ISOLATED, SPLIT_REMOVED };
typedef struct kr_pre {
    int kind;
    pcre2_code *re; /* Split, ByteLevel with use_regex */
    int behavior;
    int add_prefix_space; /* ByteLevel */
    char repl[8]; /* Metaspace replacement character (UTF-8) */
    int prepend; /* Metaspace: 0 never, 1 always, 2 first */
    int split; /* Metaspace */
} kr_pre;

struct kr_tokenizer {
    char *arena;
    size_t arena_n, arena_cap;
    kr_tok *toks; /* [n_vocab] */
    int n_vocab;
    uint32_t *vmap; /* model vocab: slots hold id + 1, 0 = empty */
    uint32_t vmap_cap;
    kr_pair *pairs;
    uint32_t pairs_cap;
    kr_added *added; /* sorted by content length, longest first */
    int n_added;
    uint8_t added_first[256]; /* some added token starts with this byte */
    kr_norm *norms;
    int n_norms;
    kr_pre *pres;
    int n_pres;
    int byte_level; /* a ByteLevel pre-tokenizer is present */
    /* model */
    int ignore_merges, byte_fallback, fuse_unk;
    int32_t unk; /* -1 when none */
    int32_t byte_id[256]; /* <0xXX> tokens, -1 when absent */
    /* decoder */
    int dec_byte_fallback;
    int dec_strip_start; /* Strip after Fuse: leading ' ' removed from the whole text */
    int dec_strip_first_token; /* Metaspace: leading ' ' removed from the first token */
    /* specials */
    int32_t bos, eos;
    int32_t prefix[4], suffix[4];
    int n_prefix, n_suffix;
};

static uint32_t arena_add(kr_tokenizer *t, const char *s, size_t n, int *oom)
{
    if (t->arena_n + n + 1 > t->arena_cap) {
        size_t cap = t->arena_cap ? t->arena_cap : 1 << 16;
        while (cap < t->arena_n + n + 1) cap *= 2;
        char *p = realloc(t->arena, cap);
        if (!p) { *oom = 1; return 0; }
        t->arena = p;
        t->arena_cap = cap;
    }
    uint32_t off = (uint32_t)t->arena_n;
    memcpy(t->arena + off, s, n);
    t->arena[off + n] = 0;
    t->arena_n += n + 1;
    return off;
}

static int32_t vocab_get(const kr_tokenizer *t, const char *s, size_t n)
{
    if (!t->vmap) return -1;
    uint32_t mask = t->vmap_cap - 1;
    for (uint32_t i = (uint32_t)hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        uint32_t v = t->vmap[i];
        if (!v) return -1;
        const kr_tok *k = &t->toks[v - 1];
        if (k->len == n && memcmp(t->arena + k->off, s, n) == 0) return (int32_t)(v - 1);
    }
}

static void vocab_put(kr_tokenizer *t, int32_t id)
{
    const kr_tok *k = &t->toks[id];
    uint32_t mask = t->vmap_cap - 1;
    uint32_t i = (uint32_t)hash_bytes(t->arena + k->off, k->len) & mask;
    while (t->vmap[i]) i = (i + 1) & mask;
    t->vmap[i] = (uint32_t)id + 1;
}

static const kr_pair *pair_get(const kr_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    uint32_t mask = t->pairs_cap - 1;
    for (uint32_t i = (uint32_t)hash_u64(key) & mask;; i = (i + 1) & mask) {
        const kr_pair *p = &t->pairs[i];
        if (p->key == key) return p;
        if (!p->key) return NULL;
    }
}

/* Inserts unless present (the first, highest-priority merge of a pair wins). */
static void pair_put(kr_tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t merged)
{
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    uint32_t mask = t->pairs_cap - 1;
    uint32_t i = (uint32_t)hash_u64(key) & mask;
    while (t->pairs[i].key && t->pairs[i].key != key) i = (i + 1) & mask;
    if (t->pairs[i].key) return;
    t->pairs[i] = (kr_pair){key, rank, merged};
}

/* ------------------------------------------------------------------ GPT-2 byte map */

/* The printable bytes map to themselves; the other 68 to U+0100.. in byte order. */
static uint32_t byte_to_cp(int b)
{
    if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff)) return (uint32_t)b;
    int k = 0;
    for (int i = 0; i < b; i++)
        if (!((i >= 0x21 && i <= 0x7e) || (i >= 0xa1 && i <= 0xac) || (i >= 0xae && i <= 0xff))) k++;
    return 256u + (uint32_t)k;
}

/* Inverse: a code point to its byte, or -1. */
static int cp_to_byte(uint32_t cp)
{
    if ((cp >= 0x21 && cp <= 0x7e) || (cp >= 0xa1 && cp <= 0xac) || (cp >= 0xae && cp <= 0xff)) return (int)cp;
    if (cp < 256 || cp >= 256 + 68) return -1;
    int k = (int)(cp - 256);
    for (int i = 0; i < 256; i++)
        if (!((i >= 0x21 && i <= 0x7e) || (i >= 0xa1 && i <= 0xac) || (i >= 0xae && i <= 0xff)) && k-- == 0) return i;
    return -1;
}

/* ------------------------------------------------------------------ loading */

typedef struct load_ctx {
    kr_tokenizer *t;
    const char *path; /* tokenizer.json, for messages */
    char *err;
} load_ctx;

static const char *json_str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int json_bool(const cJSON *o, const char *key, int dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (cJSON_IsBool(v)) return cJSON_IsTrue(v);
    return dflt;
}

static int compile_re(load_ctx *c, const char *pat, size_t n, int literal, const char *field, pcre2_code **out)
{
    int ec;
    PCRE2_SIZE eo;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, n, opts, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return kr_errf(c->err, "%s: %s: cannot compile regex at offset %zu: %s", c->path, field,
                       (size_t)eo, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort: the interpreter is the fallback */
    *out = re;
    return 0;
}

static int parse_normalizer(load_ctx *c, const cJSON *n, int depth)
{
    kr_tokenizer *t = c->t;
    if (!n || cJSON_IsNull(n)) return 0;
    const char *type = json_str(n, "type");
    if (!cJSON_IsObject(n) || !type)
        return kr_errf(c->err, "%s: normalizer: expected an object with a string \"type\"", c->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "normalizers");
        if (!cJSON_IsArray(list) || depth > 4)
            return kr_errf(c->err, "%s: normalizer.normalizers: expected an array", c->path);
        const cJSON *e;
        cJSON_ArrayForEach(e, list) if (parse_normalizer(c, e, depth + 1)) return -1;
        return 0;
    }
    kr_norm nm = {0};
    if (!strcmp(type, "NFC")) nm.kind = NORM_NFC;
    else if (!strcmp(type, "NFKC")) nm.kind = NORM_NFKC;
    else if (!strcmp(type, "NFD")) nm.kind = NORM_NFD;
    else if (!strcmp(type, "NFKD")) nm.kind = NORM_NFKD;
    else if (!strcmp(type, "Prepend")) {
        const char *p = json_str(n, "prepend");
        if (!p) return kr_errf(c->err, "%s: normalizer Prepend: \"prepend\" must be a string", c->path);
        nm.kind = NORM_PREPEND;
        nm.a = strdup(p);
        if (!nm.a) return kr_errf(c->err, "%s: out of memory", c->path);
    } else if (!strcmp(type, "Replace")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        const char *from = json_str(pat, "String"), *to = json_str(n, "content");
        if (json_str(pat, "Regex"))
            return kr_errf(c->err, "%s: normalizer Replace: regex patterns are not supported", c->path);
        if (!from || !to || !*from)
            return kr_errf(c->err, "%s: normalizer Replace: needs pattern.String (non-empty) and content", c->path);
        nm.kind = NORM_REPLACE;
        nm.a = strdup(from);
        nm.b = strdup(to);
        if (!nm.a || !nm.b) { free(nm.a); free(nm.b); return kr_errf(c->err, "%s: out of memory", c->path); }
    } else {
        return kr_errf(c->err, "%s: normalizer type \"%s\" is not supported (supported: NFC, NFKC, "
                       "NFD, NFKD, Prepend, Replace, Sequence)", c->path, type);
    }
    kr_norm *g = realloc(t->norms, (size_t)(t->n_norms + 1) * sizeof *g);
    if (!g) { free(nm.a); free(nm.b); return kr_errf(c->err, "%s: out of memory", c->path); }
    t->norms = g;
    t->norms[t->n_norms++] = nm;
    return 0;
}

static const char GPT2_RE[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static int parse_pre(load_ctx *c, const cJSON *n, int depth)
{
    kr_tokenizer *t = c->t;
    if (!n || cJSON_IsNull(n)) return 0;
    const char *type = json_str(n, "type");
    if (!cJSON_IsObject(n) || !type)
        return kr_errf(c->err, "%s: pre_tokenizer: expected an object with a string \"type\"", c->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "pretokenizers");
        if (!cJSON_IsArray(list) || depth > 4)
            return kr_errf(c->err, "%s: pre_tokenizer.pretokenizers: expected an array", c->path);
        const cJSON *e;
        cJSON_ArrayForEach(e, list) if (parse_pre(c, e, depth + 1)) return -1;
        return 0;
    }
    kr_pre p = {0};
    if (!strcmp(type, "Split")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        const char *re = json_str(pat, "Regex"), *lit = json_str(pat, "String");
        const char *beh = json_str(n, "behavior");
        if (!re && !lit)
            return kr_errf(c->err, "%s: pre_tokenizer Split: \"pattern\" needs a string \"Regex\" or \"String\"", c->path);
        if (json_bool(n, "invert", 0))
            return kr_errf(c->err, "%s: pre_tokenizer Split: \"invert\": true is not supported", c->path);
        if (!beh) return kr_errf(c->err, "%s: pre_tokenizer Split: \"behavior\" must be a string", c->path);
        if (!strcmp(beh, "Isolated")) p.behavior = SPLIT_ISOLATED;
        else if (!strcmp(beh, "Removed")) p.behavior = SPLIT_REMOVED;
        else return kr_errf(c->err, "%s: pre_tokenizer Split: behavior \"%s\" is not supported (Isolated, Removed)", c->path, beh);
        p.kind = PRE_SPLIT;
        const char *s = re ? re : lit;
        if (compile_re(c, s, strlen(s), !re, "pre_tokenizer Split.pattern", &p.re)) return -1;
    } else if (!strcmp(type, "ByteLevel")) {
        p.kind = PRE_BYTELEVEL;
        p.add_prefix_space = json_bool(n, "add_prefix_space", 1);
        if (json_bool(n, "use_regex", 1) &&
            compile_re(c, GPT2_RE, sizeof GPT2_RE - 1, 0, "pre_tokenizer ByteLevel", &p.re))
            return -1;
        t->byte_level = 1;
    } else if (!strcmp(type, "Metaspace")) {
        const char *r = json_str(n, "replacement"), *scheme = json_str(n, "prepend_scheme");
        if (!r || !*r || strlen(r) >= sizeof p.repl)
            return kr_errf(c->err, "%s: pre_tokenizer Metaspace: \"replacement\" must be one character", c->path);
        p.kind = PRE_METASPACE;
        strcpy(p.repl, r);
        if (scheme) {
            if (!strcmp(scheme, "always")) p.prepend = 1;
            else if (!strcmp(scheme, "first")) p.prepend = 2;
            else if (!strcmp(scheme, "never")) p.prepend = 0;
            else return kr_errf(c->err, "%s: pre_tokenizer Metaspace: prepend_scheme \"%s\" unknown", c->path, scheme);
        } else {
            p.prepend = json_bool(n, "add_prefix_space", 1);
        }
        p.split = json_bool(n, "split", 1);
    } else {
        return kr_errf(c->err, "%s: pre_tokenizer type \"%s\" is not supported (supported: Split, "
                       "ByteLevel, Metaspace, Sequence)", c->path, type);
    }
    kr_pre *g = realloc(t->pres, (size_t)(t->n_pres + 1) * sizeof *g);
    if (!g) { pcre2_code_free(p.re); return kr_errf(c->err, "%s: out of memory", c->path); }
    t->pres = g;
    t->pres[t->n_pres++] = p;
    return 0;
}

/* Decoders. Per-token steps (ByteLevel, Replace) are applied at load into each token's
 * decoded bytes; ByteFallback / Fuse / Strip / Metaspace's strip work on the stream. */
typedef struct dec_step {
    int kind; /* 0 ByteLevel, 1 Replace */
    const char *from, *to;
} dec_step;

static int parse_decoder(load_ctx *c, const cJSON *n, int depth, dec_step *steps, int *n_steps, int *fused)
{
    kr_tokenizer *t = c->t;
    if (!n || cJSON_IsNull(n)) return 0;
    const char *type = json_str(n, "type");
    if (!cJSON_IsObject(n) || !type)
        return kr_errf(c->err, "%s: decoder: expected an object with a string \"type\"", c->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "decoders");
        if (!cJSON_IsArray(list) || depth > 4)
            return kr_errf(c->err, "%s: decoder.decoders: expected an array", c->path);
        const cJSON *e;
        cJSON_ArrayForEach(e, list) if (parse_decoder(c, e, depth + 1, steps, n_steps, fused)) return -1;
        return 0;
    }
    if (*n_steps >= 8) return kr_errf(c->err, "%s: decoder: too many steps", c->path);
    if (!strcmp(type, "ByteLevel")) {
        steps[(*n_steps)++] = (dec_step){0, NULL, NULL};
    } else if (!strcmp(type, "Replace")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        const char *from = json_str(pat, "String"), *to = json_str(n, "content");
        if (!from || !*from || !to)
            return kr_errf(c->err, "%s: decoder Replace: needs pattern.String (non-empty) and content", c->path);
        steps[(*n_steps)++] = (dec_step){1, from, to};
    } else if (!strcmp(type, "ByteFallback")) {
        t->dec_byte_fallback = 1;
    } else if (!strcmp(type, "Fuse")) {
        *fused = 1;
    } else if (!strcmp(type, "Strip")) {
        const char *content = json_str(n, "content");
        const cJSON *start = cJSON_GetObjectItemCaseSensitive(n, "start");
        const cJSON *stop = cJSON_GetObjectItemCaseSensitive(n, "stop");
        if (!content || strcmp(content, " ") || !cJSON_IsNumber(start) || !cJSON_IsNumber(stop) ||
            start->valuedouble < 0 || start->valuedouble > 64)
            return kr_errf(c->err, "%s: decoder Strip: only content \" \" with numeric start/stop is supported", c->path);
        if (stop->valuedouble != 0)
            return kr_errf(c->err, "%s: decoder Strip: \"stop\" > 0 is not supported", c->path);
        if (!*fused)
            return kr_errf(c->err, "%s: decoder Strip: only supported after Fuse", c->path);
        t->dec_strip_start = (int)start->valuedouble;
    } else if (!strcmp(type, "Metaspace")) {
        const char *r = json_str(n, "replacement"), *scheme = json_str(n, "prepend_scheme");
        if (!r || !*r) return kr_errf(c->err, "%s: decoder Metaspace: \"replacement\" must be a string", c->path);
        steps[(*n_steps)++] = (dec_step){1, r, " "};
        t->dec_strip_first_token = scheme ? strcmp(scheme, "never") != 0 : json_bool(n, "add_prefix_space", 1);
    } else {
        return kr_errf(c->err, "%s: decoder type \"%s\" is not supported (supported: ByteLevel, "
                       "Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence)", c->path, type);
    }
    return 0;
}

/* Applies the per-token decoder steps to every token's string; result in toks[].doff/dlen. */
static int build_decoded(load_ctx *c, const dec_step *steps, int n_steps)
{
    kr_tokenizer *t = c->t;
    kr_buf a = {0}, b = {0};
    int oom = 0;
    for (int id = 0; id < t->n_vocab && !oom; id++) {
        kr_tok *k = &t->toks[id];
        if (!k->present) continue;
        a.n = 0;
        if (t->dec_byte_fallback && k->byte >= 0) { /* <0xXX> decodes to its byte */
            uint8_t by = (uint8_t)k->byte;
            k->doff = arena_add(t, (const char *)&by, 1, &oom);
            k->dlen = 1;
            continue;
        }
        if (buf_add(&a, t->arena + k->off, k->len)) { oom = 1; break; }
        for (int s = 0; s < n_steps; s++) {
            b.n = 0;
            if (buf_reserve(&b, a.n)) { oom = 1; break; }
            if (steps[s].kind == 0) { /* GPT-2 chars back to bytes; a token with others stays */
                size_t i = 0, l;
                int ok = 1;
                while (i < a.n) {
                    if (u8_char((uint8_t *)a.p + i, a.n - i, &l) != U8_OK) { ok = 0; break; }
                    int32_t cp;
                    utf8proc_iterate((const utf8proc_uint8_t *)a.p + i, (utf8proc_ssize_t)l, &cp);
                    int by = cp_to_byte((uint32_t)cp);
                    if (by < 0) { ok = 0; break; }
                    b.p[b.n++] = (char)by;
                    i += l;
                }
                if (!ok) { b.n = 0; if (buf_add(&b, a.p, a.n)) { oom = 1; break; } }
            } else { /* Replace */
                size_t fl = strlen(steps[s].from), tl = strlen(steps[s].to);
                for (size_t i = 0; i < a.n;) {
                    if (i + fl <= a.n && !memcmp(a.p + i, steps[s].from, fl)) {
                        if (buf_add(&b, steps[s].to, tl)) { oom = 1; break; }
                        i += fl;
                    } else {
                        if (buf_add(&b, a.p + i, 1)) { oom = 1; break; }
                        i++;
                    }
                }
                if (oom) break;
            }
            kr_buf tmp = a;
            a = b;
            b = tmp;
        }
        if (oom) break;
        k->doff = arena_add(t, a.p ? a.p : "", a.n, &oom);
        k->dlen = (uint32_t)a.n;
    }
    free(a.p);
    free(b.p);
    if (oom) return kr_errf(c->err, "%s: out of memory", c->path);
    return 0;
}

static int parse_hex_byte(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char ch = s[i];
        int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

static int parse_model(load_ctx *c, const cJSON *root, const cJSON *added)
{
    kr_tokenizer *t = c->t;
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(m)) return kr_errf(c->err, "%s: \"model\" is missing or not an object", c->path);
    const char *type = json_str(m, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(m, "merges");
    if (type && strcmp(type, "BPE"))
        return kr_errf(c->err, "%s: model.type \"%s\" is not supported (only BPE)", c->path, type);
    if (!type && !cJSON_IsArray(merges))
        return kr_errf(c->err, "%s: model.type is missing and the model does not look like BPE", c->path);
    if (!cJSON_IsObject(vocab)) return kr_errf(c->err, "%s: model.vocab is missing or not an object", c->path);
    if (!cJSON_IsArray(merges)) return kr_errf(c->err, "%s: model.merges is missing or not an array", c->path);
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(m, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble > 0)
        return kr_errf(c->err, "%s: model.dropout is not supported (BPE dropout is random)", c->path);
    const char *csp = json_str(m, "continuing_subword_prefix"), *eows = json_str(m, "end_of_word_suffix");
    if ((csp && *csp) || (eows && *eows))
        return kr_errf(c->err, "%s: model.continuing_subword_prefix / end_of_word_suffix are not supported", c->path);
    t->ignore_merges = json_bool(m, "ignore_merges", 0);
    t->byte_fallback = json_bool(m, "byte_fallback", 0);
    t->fuse_unk = json_bool(m, "fuse_unk", 0);

    /* ids: the vocab and the added tokens */
    int max_id = -1, n_v = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > 16777216 || e->valuedouble != (int)e->valuedouble)
            return kr_errf(c->err, "%s: model.vocab[\"%.64s\"]: id must be an integer in [0, 2^24]", c->path, e->string);
        if ((int)e->valuedouble > max_id) max_id = (int)e->valuedouble;
        n_v++;
    }
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble > 16777216 || !json_str(e, "content"))
            return kr_errf(c->err, "%s: added_tokens: each entry needs an integer \"id\" and a string \"content\"", c->path);
        if ((int)id->valuedouble > max_id) max_id = (int)id->valuedouble;
    }
    if (max_id < 0) return kr_errf(c->err, "%s: model.vocab is empty", c->path);
    t->n_vocab = max_id + 1;
    t->toks = calloc((size_t)t->n_vocab, sizeof *t->toks);
    t->vmap_cap = pow2_at_least((size_t)n_v);
    t->vmap = calloc(t->vmap_cap, sizeof *t->vmap);
    if (!t->toks || !t->vmap) return kr_errf(c->err, "%s: out of memory", c->path);
    int oom = 0;
    cJSON_ArrayForEach(e, vocab) {
        int id = (int)e->valuedouble;
        kr_tok *k = &t->toks[id];
        size_t n = strlen(e->string);
        if (k->present) return kr_errf(c->err, "%s: model.vocab: id %d is given to two tokens", c->path, id);
        if (u8_check((const uint8_t *)e->string, n) != n)
            return kr_errf(c->err, "%s: model.vocab: token with id %d is not valid UTF-8", c->path, id);
        if (vocab_get(t, e->string, n) >= 0)
            return kr_errf(c->err, "%s: model.vocab: token \"%.64s\" appears twice", c->path, e->string);
        k->off = arena_add(t, e->string, n, &oom);
        if (oom) return kr_errf(c->err, "%s: out of memory", c->path);
        k->len = (uint32_t)n;
        k->present = 1;
        k->byte = -1;
        vocab_put(t, id);
    }
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    if (t->byte_fallback) {
        for (int i = 0; i < 256; i++) {
            char s[8];
            snprintf(s, sizeof s, "<0x%02X>", i);
            t->byte_id[i] = vocab_get(t, s, 6);
        }
    }
    for (int id = 0; id < t->n_vocab; id++)
        if (t->toks[id].present) t->toks[id].byte = (int16_t)parse_hex_byte(t->arena + t->toks[id].off, t->toks[id].len);
    t->unk = -1;
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(m, "unk_token");
    if (cJSON_IsString(unk)) {
        t->unk = vocab_get(t, unk->valuestring, strlen(unk->valuestring));
        if (t->unk < 0) return kr_errf(c->err, "%s: model.unk_token \"%.64s\" is not in model.vocab", c->path, unk->valuestring);
    } else if (unk && !cJSON_IsNull(unk)) {
        return kr_errf(c->err, "%s: model.unk_token must be a string or null", c->path);
    }

    /* merges */
    int n_m = cJSON_GetArraySize(merges);
    t->pairs_cap = pow2_at_least((size_t)n_m);
    t->pairs = calloc(t->pairs_cap, sizeof *t->pairs);
    if (!t->pairs) return kr_errf(c->err, "%s: out of memory", c->path);
    kr_buf cat = {0};
    int rank = 0;
    cJSON_ArrayForEach(e, merges) {
        const char *l, *r;
        size_t ll, rl;
        if (cJSON_IsString(e)) {
            const char *sp = strchr(e->valuestring, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                free(cat.p);
                return kr_errf(c->err, "%s: model.merges[%d]: \"%.64s\" is not of the form \"left right\"", c->path, rank, e->valuestring);
            }
            l = e->valuestring, ll = (size_t)(sp - l), r = sp + 1, rl = strlen(r);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) && cJSON_IsString(e->child->next)) {
            l = e->child->valuestring, ll = strlen(l), r = e->child->next->valuestring, rl = strlen(r);
        } else {
            free(cat.p);
            return kr_errf(c->err, "%s: model.merges[%d]: expected \"left right\" or [\"left\", \"right\"]", c->path, rank);
        }
        int32_t a = vocab_get(t, l, ll), b = vocab_get(t, r, rl);
        cat.n = 0;
        if (buf_add(&cat, l, ll) || buf_add(&cat, r, rl)) { free(cat.p); return kr_errf(c->err, "%s: out of memory", c->path); }
        int32_t ab = vocab_get(t, cat.p, cat.n);
        if (a < 0 || b < 0 || ab < 0) {
            int bad = a < 0 ? 0 : b < 0 ? 1 : 2;
            kr_errf(c->err, "%s: model.merges[%d]: %s \"%.64s\" is not in model.vocab", c->path, rank,
                    bad == 0 ? "left token" : bad == 1 ? "right token" : "merged token", bad == 0 ? l : bad == 1 ? r : cat.p);
            free(cat.p);
            return -1;
        }
        pair_put(t, a, b, rank, ab);
        rank++;
    }
    free(cat.p);
    return 0;
}

static int cmp_added(const void *x, const void *y)
{
    const kr_added *a = x, *b = y;
    if (a->len != b->len) return a->len > b->len ? -1 : 1;
    return a->id - b->id;
}

static int parse_added(load_ctx *c, const cJSON *added)
{
    kr_tokenizer *t = c->t;
    int n = cJSON_GetArraySize(added), oom = 0;
    t->added = calloc((size_t)(n ? n : 1), sizeof *t->added);
    if (!t->added) return kr_errf(c->err, "%s: out of memory", c->path);
    const cJSON *e;
    cJSON_ArrayForEach(e, added) {
        int id = (int)cJSON_GetObjectItemCaseSensitive(e, "id")->valuedouble;
        const char *s = json_str(e, "content");
        size_t len = strlen(s);
        if (!len || u8_check((const uint8_t *)s, len) != len)
            return kr_errf(c->err, "%s: added_tokens: token id %d has empty or invalid UTF-8 content", c->path, id);
        kr_tok *k = &t->toks[id];
        if (!k->present) {
            k->off = arena_add(t, s, len, &oom);
            k->len = (uint32_t)len;
            k->present = 1;
            k->byte = -1;
        }
        kr_added *a = &t->added[t->n_added++];
        a->off = arena_add(t, s, len, &oom);
        if (oom) return kr_errf(c->err, "%s: out of memory", c->path);
        a->len = (uint32_t)len;
        a->id = id;
        a->lstrip = (uint8_t)json_bool(e, "lstrip", 0);
        a->rstrip = (uint8_t)json_bool(e, "rstrip", 0);
        a->single_word = (uint8_t)json_bool(e, "single_word", 0);
        a->special = (uint8_t)json_bool(e, "special", 0);
        if (a->special) k->special = 1;
        t->added_first[(uint8_t)s[0]] = 1;
    }
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, cmp_added);
    return 0;
}

/* A token given by name: an added token first, then the vocab; -1 when unknown. */
static int32_t token_id(const kr_tokenizer *t, const char *s)
{
    size_t n = strlen(s);
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len == n && !memcmp(t->arena + t->added[i].off, s, n)) return t->added[i].id;
    return vocab_get(t, s, n);
}

static int parse_post(load_ctx *c, const cJSON *n, int depth)
{
    kr_tokenizer *t = c->t;
    if (!n || cJSON_IsNull(n)) return 0;
    const char *type = json_str(n, "type");
    if (!cJSON_IsObject(n) || !type)
        return kr_errf(c->err, "%s: post_processor: expected an object with a string \"type\"", c->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "processors");
        if (!cJSON_IsArray(list) || depth > 4)
            return kr_errf(c->err, "%s: post_processor.processors: expected an array", c->path);
        const cJSON *e;
        cJSON_ArrayForEach(e, list) if (parse_post(c, e, depth + 1)) return -1;
        return 0;
    }
    if (!strcmp(type, "ByteLevel")) return 0; /* offsets only */
    if (strcmp(type, "TemplateProcessing"))
        return kr_errf(c->err, "%s: post_processor type \"%s\" is not supported (supported: "
                       "TemplateProcessing, ByteLevel, Sequence)", c->path, type);
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(n, "single");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(n, "special_tokens");
    if (!cJSON_IsArray(single))
        return kr_errf(c->err, "%s: post_processor TemplateProcessing.single: expected an array", c->path);
    int seen_seq = 0;
    t->n_prefix = t->n_suffix = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, single) {
        if (cJSON_GetObjectItemCaseSensitive(e, "Sequence")) { seen_seq = 1; continue; }
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(e, "SpecialToken");
        const char *name = json_str(st, "id");
        if (!name)
            return kr_errf(c->err, "%s: post_processor TemplateProcessing.single: entries must be Sequence or SpecialToken with an \"id\"", c->path);
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(specials, name);
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(sp, "ids");
        const cJSON *idv;
        if (!cJSON_IsArray(ids))
            return kr_errf(c->err, "%s: post_processor TemplateProcessing.special_tokens[\"%.64s\"].ids: missing", c->path, name);
        cJSON_ArrayForEach(idv, ids) {
            if (!cJSON_IsNumber(idv) || idv->valuedouble < 0 || idv->valuedouble >= t->n_vocab)
                return kr_errf(c->err, "%s: post_processor TemplateProcessing.special_tokens[\"%.64s\"].ids: not a valid id", c->path, name);
            int32_t *dst = seen_seq ? t->suffix : t->prefix;
            int *cnt = seen_seq ? &t->n_suffix : &t->n_prefix;
            if (*cnt >= 4) return kr_errf(c->err, "%s: post_processor TemplateProcessing: more than 4 special tokens around the sequence", c->path);
            dst[(*cnt)++] = (int32_t)idv->valuedouble;
        }
    }
    return 0;
}

/* tokenizer_config.json: bos/eos by name (a string or {"content": ...}), add_bos/eos_token. */
static int parse_config(load_ctx *c, const char *json, size_t len, const char *path)
{
    kr_tokenizer *t = c->t;
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return kr_errf(c->err, "%s: not a valid JSON object", path);
    }
    const char *keys[2] = {"bos_token", "eos_token"};
    int32_t *dst[2] = {&t->bos, &t->eos};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, keys[i]);
        const char *name = cJSON_IsString(v) ? v->valuestring : json_str(v, "content");
        if (!name) {
            if (v && !cJSON_IsNull(v)) {
                cJSON_Delete(root);
                return kr_errf(c->err, "%s: %s must be a string, {\"content\": ...} or null", path, keys[i]);
            }
            continue;
        }
        int32_t id = token_id(t, name);
        if (id < 0) {
            kr_errf(c->err, "%s: %s \"%.64s\" is not a token of the tokenizer", path, keys[i], name);
            cJSON_Delete(root);
            return -1;
        }
        *dst[i] = id;
    }
    const cJSON *ab = cJSON_GetObjectItemCaseSensitive(root, "add_bos_token");
    const cJSON *ae = cJSON_GetObjectItemCaseSensitive(root, "add_eos_token");
    if (cJSON_IsBool(ab)) {
        t->n_prefix = 0;
        if (cJSON_IsTrue(ab) && t->bos >= 0) t->prefix[t->n_prefix++] = t->bos;
    }
    if (cJSON_IsBool(ae)) {
        t->n_suffix = 0;
        if (cJSON_IsTrue(ae) && t->eos >= 0) t->suffix[t->n_suffix++] = t->eos;
    }
    cJSON_Delete(root);
    return 0;
}

void kr_tokenizer_free(kr_tokenizer *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_norms; i++) { free(t->norms[i].a); free(t->norms[i].b); }
    for (int i = 0; i < t->n_pres; i++) pcre2_code_free(t->pres[i].re);
    free(t->norms);
    free(t->pres);
    free(t->added);
    free(t->pairs);
    free(t->vmap);
    free(t->toks);
    free(t->arena);
    free(t);
}

int kr_tokenizer_parse(const char *json, size_t len, const char *path, const char *config_json,
                       size_t config_len, const char *config_path, kr_tokenizer **out, char *err)
{
    kr_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kr_errf(err, "%s: out of memory", path);
    t->bos = t->eos = -1;
    load_ctx *c = calloc(1, sizeof *c);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!c) { kr_errf(err, "%s: out of memory", path); goto err_free; }
    c->t = t, c->path = path, c->err = err;
    if (!cJSON_IsObject(root)) {
        const char *at = cJSON_GetErrorPtr();
        if (root || !at || at < json || at > json + len) kr_errf(err, "%s: not a valid JSON object", path);
        else kr_errf(err, "%s: invalid JSON near byte %zu", path, (size_t)(at - json));
        goto err_free;
    }
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added)) {
        kr_errf(err, "%s: \"added_tokens\" must be an array", path);
        goto err_free;
    }
    dec_step steps[8];
    int n_steps = 0, fused = 0;
    if (parse_normalizer(c, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), 0)) goto err_free;
    if (parse_pre(c, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), 0)) goto err_free;
    if (parse_model(c, root, cJSON_IsArray(added) ? added : NULL)) goto err_free;
    if (parse_added(c, cJSON_IsArray(added) ? added : NULL)) goto err_free;
    if (parse_post(c, cJSON_GetObjectItemCaseSensitive(root, "post_processor"), 0)) goto err_free;
    if (parse_decoder(c, cJSON_GetObjectItemCaseSensitive(root, "decoder"), 0, steps, &n_steps, &fused)) goto err_free;
    if (build_decoded(c, steps, n_steps)) goto err_free;
    /* The template names BOS when the config does not. */
    if (t->n_prefix == 1) t->bos = t->prefix[0];
    if (config_json && parse_config(c, config_json, config_len, config_path)) goto err_free;
    cJSON_Delete(root);
    free(c);
    *out = t;
    return 0;
err_free:
    cJSON_Delete(root);
    free(c);
    kr_tokenizer_free(t);
    return -1;
}

int kr_tokenizer_load(const char *dir, kr_tokenizer **out, char *err)
{
    char path[4096], cpath[4096];
    char *json = NULL, *cjson = NULL;
    size_t len = 0, clen = 0;
    if (snprintf(path, sizeof path, "%s/tokenizer.json", dir) >= (int)sizeof path ||
        snprintf(cpath, sizeof cpath, "%s/tokenizer_config.json", dir) >= (int)sizeof cpath)
        return kr_errf(err, "%s: path too long", dir);
    if (kr_read_file(path, &json, &len, err)) return -1;
    FILE *f = fopen(cpath, "rb");
    if (f) {
        fclose(f);
        if (kr_read_file(cpath, &cjson, &clen, err)) { free(json); return -1; }
    }
    int rc = kr_tokenizer_parse(json, len, path, cjson, clen, cpath, out, err);
    free(json);
    free(cjson);
    return rc;
}

int kr_tokenizer_n_vocab(const kr_tokenizer *t) { return t->n_vocab; }
int kr_tokenizer_bos(const kr_tokenizer *t) { return t->bos; }
int kr_tokenizer_eos(const kr_tokenizer *t) { return t->eos; }
int kr_tokenizer_is_special(const kr_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->toks[id].special;
}

int kr_tokenizer_token_bytes(const kr_tokenizer *t, int32_t id, const char **bytes, size_t *len)
{
    if (id < 0 || id >= t->n_vocab || !t->toks[id].present) return -1;
    *bytes = t->arena + t->toks[id].doff;
    *len = t->toks[id].dlen;
    return 0;
}

/* ------------------------------------------------------------------ encoding */

typedef struct span { size_t off, len; } span;

typedef struct sym {
    int32_t id;
    int32_t prev, next; /* -1 at the ends */
} sym;

typedef struct merge_ent {
    int32_t rank, pos, a, b;
} merge_ent;

/* Per-call scratch, grown as needed and reused across the pieces of one call. */
typedef struct enc_ctx {
    const kr_tokenizer *t;
    char *err;
    kr_buf ids; /* int32 ids as bytes */
    kr_buf norm, alt; /* normalized text; the other buffer of a pre-tokenizer step */
    span *spans, *spans2;
    size_t n_spans, cap_spans, n_spans2, cap_spans2;
    sym *syms;
    size_t cap_syms;
    merge_ent *heap;
    size_t n_heap, cap_heap;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
} enc_ctx;

static int emit(enc_ctx *e, int32_t id)
{
    return buf_add(&e->ids, &id, sizeof id);
}

static int span_push(span **v, size_t *n, size_t *cap, size_t off, size_t len)
{
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        span *g = realloc(*v, c * sizeof *g);
        if (!g) return -1;
        *v = g;
        *cap = c;
    }
    (*v)[(*n)++] = (span){off, len};
    return 0;
}

static int heap_less(const merge_ent *x, const merge_ent *y)
{
    return x->rank < y->rank || (x->rank == y->rank && x->pos < y->pos);
}

static int heap_push(enc_ctx *e, merge_ent m)
{
    if (e->n_heap == e->cap_heap) {
        size_t c = e->cap_heap ? e->cap_heap * 2 : 256;
        merge_ent *g = realloc(e->heap, c * sizeof *g);
        if (!g) return -1;
        e->heap = g;
        e->cap_heap = c;
    }
    size_t i = e->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&m, &e->heap[p])) break;
        e->heap[i] = e->heap[p];
        i = p;
    }
    e->heap[i] = m;
    return 0;
}

static merge_ent heap_pop(enc_ctx *e)
{
    merge_ent top = e->heap[0], last = e->heap[--e->n_heap];
    size_t i = 0, n = e->n_heap;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const merge_ent *best = &last;
        if (l < n && heap_less(&e->heap[l], best)) m = l, best = &e->heap[l];
        if (r < n && heap_less(&e->heap[r], best)) m = r;
        if (m == i) break;
        e->heap[i] = e->heap[m];
        i = m;
    }
    if (n) e->heap[i] = last;
    return top;
}

static int push_pair(enc_ctx *e, int32_t pos)
{
    const sym *s = e->syms;
    if (pos < 0) return 0;
    int32_t nx = s[pos].next;
    if (nx < 0) return 0;
    const kr_pair *p = pair_get(e->t, s[pos].id, s[nx].id);
    if (!p) return 0;
    return heap_push(e, (merge_ent){p->rank, pos, s[pos].id, s[nx].id});
}

/* BPE over one pre-token (UTF-8 bytes of the tokenizer's alphabet): HF's word merge. */
static int bpe_piece(enc_ctx *e, const char *s, size_t n)
{
    const kr_tokenizer *t = e->t;
    if (!n) return 0;
    if (t->ignore_merges) {
        int32_t id = vocab_get(t, s, n);
        if (id >= 0) return emit(e, id);
    }
    if (n > e->cap_syms) {
        size_t c = e->cap_syms ? e->cap_syms : 256;
        while (c < n) c *= 2;
        sym *g = realloc(e->syms, c * sizeof *g);
        if (!g) return -1;
        e->syms = g;
        e->cap_syms = c;
    }
    sym *sy = e->syms;
    int32_t ns = 0;
    int last_unk = 0;
    for (size_t i = 0, l; i < n; i += l) {
        u8_char((const uint8_t *)s + i, n - i, &l); /* the text is valid UTF-8 here */
        int32_t id = vocab_get(t, s + i, l);
        if (id >= 0) {
            sy[ns] = (sym){id, ns - 1, -1};
            ns++;
            last_unk = 0;
            continue;
        }
        if (t->byte_fallback) {
            int all = 1;
            for (size_t j = 0; j < l; j++) all &= t->byte_id[(uint8_t)s[i + j]] >= 0;
            if (all) {
                for (size_t j = 0; j < l; j++, ns++) sy[ns] = (sym){t->byte_id[(uint8_t)s[i + j]], ns - 1, -1};
                last_unk = 0;
                continue;
            }
        }
        if (t->unk >= 0) {
            if (t->fuse_unk && last_unk) continue;
            sy[ns] = (sym){t->unk, ns - 1, -1};
            ns++;
            last_unk = 1;
        }
        /* no unk token: the character is dropped, as HF does */
    }
    for (int32_t i = 0; i < ns; i++) sy[i].next = i + 1 < ns ? i + 1 : -1;
    e->n_heap = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (push_pair(e, i)) return -1;
    while (e->n_heap) {
        merge_ent m = heap_pop(e);
        int32_t nx = sy[m.pos].next;
        if (sy[m.pos].id != m.a || nx < 0 || sy[nx].id != m.b) continue; /* stale */
        const kr_pair *p = pair_get(t, m.a, m.b);
        sy[m.pos].id = p->merged;
        sy[m.pos].next = sy[nx].next;
        if (sy[nx].next >= 0) sy[sy[nx].next].prev = m.pos;
        sy[nx].id = -1;
        if (sy[m.pos].prev >= 0 && push_pair(e, sy[m.pos].prev)) return -1;
        if (push_pair(e, m.pos)) return -1;
    }
    for (int32_t i = ns ? 0 : -1; i >= 0; i = sy[i].next)
        if (emit(e, sy[i].id)) return -1;
    return 0;
}

/* Runs `re` over each span of the current list, producing the next list (Split). */
static int regex_split(enc_ctx *e, const pcre2_code *re, int behavior, const char *text)
{
    e->n_spans2 = 0;
    for (size_t k = 0; k < e->n_spans; k++) {
        size_t off = e->spans[k].off, len = e->spans[k].len, at = 0, last = 0;
        const PCRE2_SPTR subj = (PCRE2_SPTR)(text + off);
        while (at <= len) {
            int rc = pcre2_match(re, subj, len, at, PCRE2_NO_UTF_CHECK, e->md, e->mctx);
            if (rc == PCRE2_ERROR_NOMATCH) break;
            if (rc < 0) {
                PCRE2_UCHAR msg[256];
                pcre2_get_error_message(rc, msg, sizeof msg);
                return kr_errf(e->err, "tokenizer: pre-tokenizer regex failed: %s", (const char *)msg);
            }
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
            size_t s = ov[0], f = ov[1];
            if (f == s) { /* empty match: step over one character */
                if (s >= len) break;
                size_t l;
                u8_char(subj + s, len - s, &l);
                at = s + l;
                continue;
            }
            if (s > last && span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, off + last, s - last)) return -1;
            if (behavior == SPLIT_ISOLATED && span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, off + s, f - s)) return -1;
            last = at = f;
        }
        if (last < len && span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, off + last, len - last)) return -1;
    }
    span *tmp = e->spans;
    size_t tc = e->cap_spans;
    e->spans = e->spans2, e->cap_spans = e->cap_spans2, e->n_spans = e->n_spans2;
    e->spans2 = tmp, e->cap_spans2 = tc;
    return 0;
}

static void swap_bufs(enc_ctx *e)
{
    kr_buf tmp = e->norm;
    e->norm = e->alt;
    e->alt = tmp;
}

static int is_ws(uint8_t ch)
{
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f';
}

/* One run of text between added tokens: normalize, pre-tokenize, BPE. `first`: the run
 * starts the input (Metaspace prepend_scheme "first"). */
static int encode_run(enc_ctx *e, const char *text, size_t len, int first)
{
    const kr_tokenizer *t = e->t;
    e->norm.n = 0;
    if (buf_add(&e->norm, text, len)) return -1;
    for (int i = 0; i < t->n_norms; i++) {
        const kr_norm *nm = &t->norms[i];
        if (!e->norm.n) break; /* every normalizer maps "" to "" */
        e->alt.n = 0;
        if (nm->kind <= NORM_NFKD) {
            static const int opts[] = {UTF8PROC_COMPOSE, UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
                                       UTF8PROC_DECOMPOSE, UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT};
            utf8proc_uint8_t *o = NULL;
            utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)e->norm.p, (utf8proc_ssize_t)e->norm.n,
                                              &o, (utf8proc_option_t)(UTF8PROC_STABLE | opts[nm->kind]));
            if (r < 0) return kr_errf(e->err, "tokenizer: normalizer failed: %s", utf8proc_errmsg(r));
            int rc = buf_add(&e->alt, o, (size_t)r);
            free(o);
            if (rc) return -1;
        } else if (nm->kind == NORM_PREPEND) {
            if (buf_add(&e->alt, nm->a, strlen(nm->a)) || buf_add(&e->alt, e->norm.p, e->norm.n)) return -1;
        } else {
            size_t fl = strlen(nm->a), tl = strlen(nm->b);
            for (size_t k = 0; k < e->norm.n;) {
                if (k + fl <= e->norm.n && !memcmp(e->norm.p + k, nm->a, fl)) {
                    if (buf_add(&e->alt, nm->b, tl)) return -1;
                    k += fl;
                } else {
                    if (buf_add(&e->alt, e->norm.p + k, 1)) return -1;
                    k++;
                }
            }
        }
        swap_bufs(e);
    }
    e->n_spans = 0;
    if (e->norm.n && span_push(&e->spans, &e->n_spans, &e->cap_spans, 0, e->norm.n)) return -1;
    for (int i = 0; i < t->n_pres && e->n_spans; i++) {
        const kr_pre *p = &t->pres[i];
        if (p->kind == PRE_SPLIT) {
            if (regex_split(e, p->re, p->behavior, e->norm.p)) return -1;
        } else if (p->kind == PRE_BYTELEVEL) {
            /* HF: each existing piece gets the prefix space, then the GPT-2 split, then the
             * byte map. */
            e->alt.n = 0;
            e->n_spans2 = 0;
            for (size_t k = 0; k < e->n_spans; k++) {
                size_t o0 = e->alt.n;
                if (p->add_prefix_space && e->norm.p[e->spans[k].off] != ' ' && buf_add(&e->alt, " ", 1)) return -1;
                if (buf_add(&e->alt, e->norm.p + e->spans[k].off, e->spans[k].len)) return -1;
                if (span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, o0, e->alt.n - o0)) return -1;
            }
            swap_bufs(e);
            span *tmp = e->spans;
            size_t tc = e->cap_spans;
            e->spans = e->spans2, e->cap_spans = e->cap_spans2, e->n_spans = e->n_spans2;
            e->spans2 = tmp, e->cap_spans2 = tc;
            if (p->re && regex_split(e, p->re, SPLIT_ISOLATED, e->norm.p)) return -1;
            /* map bytes to the GPT-2 alphabet */
            e->alt.n = 0;
            e->n_spans2 = 0;
            for (size_t k = 0; k < e->n_spans; k++) {
                size_t o0 = e->alt.n;
                if (buf_reserve(&e->alt, e->spans[k].len * 2)) return -1;
                for (size_t j = 0; j < e->spans[k].len; j++) {
                    uint8_t s8[4];
                    size_t l = u8_encode(byte_to_cp((uint8_t)e->norm.p[e->spans[k].off + j]), s8);
                    memcpy(e->alt.p + e->alt.n, s8, l);
                    e->alt.n += l;
                }
                if (span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, o0, e->alt.n - o0)) return -1;
            }
            swap_bufs(e);
            span *tmp2 = e->spans;
            size_t tc2 = e->cap_spans;
            e->spans = e->spans2, e->cap_spans = e->cap_spans2, e->n_spans = e->n_spans2;
            e->spans2 = tmp2, e->cap_spans2 = tc2;
        } else { /* Metaspace: ' ' -> replacement, optional prefix, split before each one */
            size_t rl = strlen(p->repl);
            e->alt.n = 0;
            e->n_spans2 = 0;
            for (size_t k = 0; k < e->n_spans; k++) {
                size_t o0 = e->alt.n, start = o0;
                const char *src = e->norm.p + e->spans[k].off;
                size_t sl = e->spans[k].len;
                int pre = p->prepend == 1 || (p->prepend == 2 && first && k == 0);
                if (pre && !(sl >= rl && !memcmp(src, p->repl, rl)) && src[0] != ' ' && buf_add(&e->alt, p->repl, rl)) return -1;
                for (size_t j = 0; j < sl; j++) {
                    if (src[j] == ' ') {
                        if (buf_add(&e->alt, p->repl, rl)) return -1;
                    } else if (buf_add(&e->alt, src + j, 1)) return -1;
                }
                if (!p->split) {
                    if (span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, o0, e->alt.n - o0)) return -1;
                    continue;
                }
                for (size_t j = o0 + 1; j + rl <= e->alt.n; j++) {
                    if (!memcmp(e->alt.p + j, p->repl, rl)) {
                        if (span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, start, j - start)) return -1;
                        start = j;
                    }
                }
                if (e->alt.n > start && span_push(&e->spans2, &e->n_spans2, &e->cap_spans2, start, e->alt.n - start)) return -1;
            }
            swap_bufs(e);
            span *tmp = e->spans;
            size_t tc = e->cap_spans;
            e->spans = e->spans2, e->cap_spans = e->cap_spans2, e->n_spans = e->n_spans2;
            e->spans2 = tmp, e->cap_spans2 = tc;
        }
    }
    for (size_t k = 0; k < e->n_spans; k++)
        if (bpe_piece(e, e->norm.p + e->spans[k].off, e->spans[k].len)) return -1;
    return 0;
}

/* single_word boundaries: ASCII letters, digits, '_' and any non-ASCII byte count as word. */
static int word_char_at(const char *s, size_t at)
{
    uint8_t ch = (uint8_t)s[at];
    return ch >= 0x80 || ch == '_' || (ch >= '0' && ch <= '9') || ((ch | 0x20) >= 'a' && (ch | 0x20) <= 'z');
}

/* The leftmost, then longest, added token at or after `from`: its [start, end) including
 * stripped whitespace, or -1. */
static int find_added(const kr_tokenizer *t, const char *s, size_t n, size_t from, size_t floor,
                      size_t *ms, size_t *me)
{
    for (size_t i = from; i < n; i++) {
        if (!t->added_first[(uint8_t)s[i]]) continue;
        for (int k = 0; k < t->n_added; k++) {
            const kr_added *a = &t->added[k];
            if (a->len > n - i || memcmp(s + i, t->arena + a->off, a->len)) continue;
            size_t st = i, en = i + a->len;
            if (a->single_word && ((st > 0 && word_char_at(s, st - 1)) || (en < n && word_char_at(s, en))))
                continue;
            if (a->lstrip) while (st > floor && is_ws((uint8_t)s[st - 1])) st--;
            if (a->rstrip) while (en < n && is_ws((uint8_t)s[en])) en++;
            *ms = st, *me = en;
            return k;
        }
    }
    return -1;
}

static void enc_free(enc_ctx *e)
{
    free(e->ids.p);
    free(e->norm.p);
    free(e->alt.p);
    free(e->spans);
    free(e->spans2);
    free(e->syms);
    free(e->heap);
    pcre2_match_data_free(e->md);
    pcre2_match_context_free(e->mctx);
    pcre2_jit_stack_free(e->jit);
}

int kr_tokenizer_encode(const kr_tokenizer *t, const char *text, size_t len, int add_special,
                        int32_t **ids_out, int *n_out, char *err)
{
    if (!text && len) return kr_errf(err, "tokenizer: encode: NULL text");
    size_t bad = u8_check((const uint8_t *)text, len);
    if (bad != len) return kr_errf(err, "tokenizer: encode: input is not valid UTF-8 (byte %zu)", bad);
    enc_ctx e = {.t = t, .err = err};
    if (err) err[0] = 0; /* helpers fail silently on allocation; see err_fail */
    int needs_re = 0;
    for (int i = 0; i < t->n_pres; i++) needs_re |= t->pres[i].re != NULL;
    if (needs_re) {
        e.md = pcre2_match_data_create(4, NULL);
        e.mctx = pcre2_match_context_create(NULL);
        e.jit = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
        if (!e.md || !e.mctx) goto err_oom;
        if (e.jit) pcre2_jit_stack_assign(e.mctx, NULL, e.jit);
    }
    if (add_special)
        for (int i = 0; i < t->n_prefix; i++)
            if (emit(&e, t->prefix[i])) goto err_oom;
    size_t pos = 0;
    while (pos < len) {
        size_t ms = len, me = len;
        int k = t->n_added ? find_added(t, text, len, pos, pos, &ms, &me) : -1;
        if (k < 0) ms = me = len;
        if (ms > pos && encode_run(&e, text + pos, ms - pos, pos == 0)) goto err_fail;
        if (k >= 0 && emit(&e, t->added[k].id)) goto err_oom;
        pos = me;
    }
    if (add_special)
        for (int i = 0; i < t->n_suffix; i++)
            if (emit(&e, t->suffix[i])) goto err_oom;
    size_t n = e.ids.n / sizeof(int32_t);
    if (n > (size_t)INT32_MAX) { kr_errf(err, "tokenizer: encode: too many tokens"); goto err_fail; }
    int32_t *ids = malloc(n ? e.ids.n : sizeof(int32_t));
    if (!ids) goto err_oom;
    if (n) memcpy(ids, e.ids.p, e.ids.n);
    enc_free(&e);
    *ids_out = ids;
    *n_out = (int)n;
    return 0;
err_oom:
    kr_errf(err, "tokenizer: encode: out of memory");
err_fail:
    if (err && !err[0]) kr_errf(err, "tokenizer: encode: out of memory");
    enc_free(&e);
    return -1;
}

/* ------------------------------------------------------------------ decoding */

struct kr_detok {
    const kr_tokenizer *t;
    int skip_special;
    int strip_left; /* leading ' ' still to strip from the stream (Strip decoder) */
    int n_tokens; /* tokens that reached the decoder (Metaspace first-token strip) */
    kr_buf run; /* pending <0xXX> bytes */
    kr_buf pend; /* bytes not yet emitted (an incomplete UTF-8 tail) */
    kr_buf stage; /* text of the current step before the stream-start strip */
    kr_buf out; /* the last delta */
};

static const char FFFD[3] = {(char)0xef, (char)0xbf, (char)0xbd};

/* Ends a byte-fallback run as HF's ByteFallback does: valid UTF-8 as is, else one U+FFFD per
 * byte. */
static int detok_end_run(kr_detok *d, kr_buf *stage)
{
    if (!d->run.n) return 0;
    int rc = 0;
    if (u8_check((const uint8_t *)d->run.p, d->run.n) == d->run.n) rc = buf_add(stage, d->run.p, d->run.n);
    else
        for (size_t i = 0; i < d->run.n && !rc; i++) rc = buf_add(stage, FFFD, 3);
    d->run.n = 0;
    return rc;
}

/* Moves `stage` into pend (after the stream-start strip) and emits into d->out what is final:
 * complete characters, and U+FFFD for each maximal invalid subpart; with `final` an
 * incomplete tail too. */
static int detok_feed(kr_detok *d, const char *s, size_t n, int final)
{
    while (d->strip_left > 0 && n) {
        if (*s != ' ') { d->strip_left = 0; break; }
        s++, n--, d->strip_left--;
    }
    if (n) d->strip_left = 0;
    if (buf_add(&d->pend, s, n)) return -1;
    size_t i = 0, l;
    const uint8_t *p = (const uint8_t *)d->pend.p;
    while (i < d->pend.n) {
        int st = u8_char(p + i, d->pend.n - i, &l);
        if (st == U8_INCOMPLETE && !final) break;
        if (st == U8_OK) { if (buf_add(&d->out, p + i, l)) return -1; }
        else if (buf_add(&d->out, FFFD, 3)) return -1;
        i += l;
    }
    memmove(d->pend.p, d->pend.p + i, d->pend.n - i);
    d->pend.n -= i;
    return 0;
}

int kr_detok_create(const kr_tokenizer *t, int skip_special, kr_detok **out, char *err)
{
    kr_detok *d = calloc(1, sizeof *d);
    if (!d) return kr_errf(err, "tokenizer: detokenizer: out of memory");
    d->t = t;
    d->skip_special = skip_special;
    d->strip_left = t->dec_strip_start;
    if (buf_reserve(&d->out, 64) || buf_reserve(&d->stage, 64)) { kr_detok_free(d); return kr_errf(err, "tokenizer: detokenizer: out of memory"); }
    *out = d;
    return 0;
}

void kr_detok_free(kr_detok *d)
{
    if (!d) return;
    free(d->run.p);
    free(d->pend.p);
    free(d->stage.p);
    free(d->out.p);
    free(d);
}

int kr_detok_push(kr_detok *d, int32_t id, const char **delta, size_t *delta_len, char *err)
{
    const kr_tokenizer *t = d->t;
    if (id < 0 || id >= t->n_vocab || !t->toks[id].present)
        return kr_errf(err, "tokenizer: decode: id %d is out of range [0, %d) or has no token", (int)id, t->n_vocab);
    d->out.n = 0;
    d->out.p[0] = 0;
    const kr_tok *k = &t->toks[id];
    if (d->skip_special && k->special) goto done;
    int first = d->n_tokens++ == 0;
    if (t->dec_byte_fallback && k->byte >= 0) {
        uint8_t b = (uint8_t)k->byte;
        if (buf_add(&d->run, &b, 1)) goto err_oom;
        goto done;
    }
    d->stage.n = 0;
    if (detok_end_run(d, &d->stage)) goto err_oom;
    const char *s = t->arena + k->doff;
    size_t n = k->dlen;
    if (first && t->dec_strip_first_token && n && *s == ' ') s++, n--;
    if (buf_add(&d->stage, s, n) || detok_feed(d, d->stage.p, d->stage.n, 0)) goto err_oom;
done:
    *delta = d->out.p;
    *delta_len = d->out.n;
    return 0;
err_oom:
    return kr_errf(err, "tokenizer: detokenizer: out of memory");
}

int kr_detok_flush(kr_detok *d, const char **delta, size_t *delta_len)
{
    d->out.n = 0;
    d->out.p[0] = 0;
    d->stage.n = 0;
    int rc = detok_end_run(d, &d->stage);
    if (!rc) rc = detok_feed(d, d->stage.p, d->stage.n, 1);
    *delta = d->out.p;
    *delta_len = d->out.n;
    return rc ? -1 : 0;
}

int kr_tokenizer_decode(const kr_tokenizer *t, const int32_t *ids, int n, int skip_special,
                        char **text_out, char *err)
{
    kr_detok *d;
    kr_buf all = {0};
    const char *s;
    size_t l;
    if (n < 0 || (n && !ids)) return kr_errf(err, "tokenizer: decode: bad id array");
    if (kr_detok_create(t, skip_special, &d, err)) return -1;
    for (int i = 0; i < n; i++) {
        if (kr_detok_push(d, ids[i], &s, &l, err)) goto err_free;
        if (buf_add(&all, s, l)) goto err_oom;
    }
    if (kr_detok_flush(d, &s, &l) || buf_add(&all, s, l)) goto err_oom;
    if (!all.p && buf_reserve(&all, 1)) goto err_oom;
    all.p[all.n] = 0;
    kr_detok_free(d);
    *text_out = all.p;
    return 0;
err_oom:
    kr_errf(err, "tokenizer: decode: out of memory");
err_free:
    free(all.p);
    kr_detok_free(d);
    return -1;
}
