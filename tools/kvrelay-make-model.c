/*
 * kvrelay-make-model.c - makes the bundled default model: a complete Hugging Face Llama model
 * directory (tokenizer.json, tokenizer_config.json, config.json, generation_config.json,
 * model.safetensors) whose byte-level BPE tokenizer is trained here, on a corpus the project
 * owns, and whose weights are random from a fixed seed.
 *
 * What it is not: a language model. The weights are random, so generated text is fluent-looking
 * gibberish made of real tokens. The point is a model any machine can make offline, with the
 * file formats and the shape conventions of a real Llama 3 checkpoint. The trainer is plain BPE:
 * no dropout, no minimum frequency, no normalizer, no alphabet limit.
 *
 * Run:  kvrelay-make-model --corpus tools/data/corpus.txt --out build/models/default
 * (--help lists the shape flags; docs/default-model.md explains the model). The same corpus and
 * flags give byte-identical files on every machine: the PRNG and the weight distribution use
 * only integer and exactly-rounded float arithmetic.
 */
#define PCRE2_CODE_UNIT_WIDTH 8

#include "cli.h"
#include "kr.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pcre2.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ================================================================== options */

typedef struct mm_opts {
    const char *corpus; /* training text path */
    const char *out; /* output model directory */
    int vocab; /* total vocabulary, specials included */
    int hidden, layers, heads, kv_heads, intermediate;
    uint64_t seed;
    kr_dtype dtype;
} mm_opts;

/* Special tokens take the top ids, in this order; the first is BOS, the second EOS. */
static const char *const MM_SPECIALS[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"};
#define MM_N_SPECIALS 3
#define MM_MAX_POS 8192

/* --dtype; refused as "is not one of bf16, f16, f32", the wording scripts match */
static int flag_dtype(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    for (const kc_flag_choice *c = cli_weight_dtypes; c->name; c++)
        if (!strcmp(c->name, v)) {
            *(kr_dtype *)dest = (kr_dtype)c->value;
            return 0;
        }
    snprintf(err, cap, "%s: '%.64s' is not one of bf16, f16, f32", flag, v);
    return -1;
}

/* The vocabulary's floor: the 256 byte tokens, the specials and at least one merge. */
#define MM_MIN_VOCAB 260
_Static_assert(MM_MIN_VOCAB == 256 + MM_N_SPECIALS + 1, "--vocab's help names the specials' count and the floor");

static void parse_args(int argc, char **argv, mm_opts *o)
{
    *o = (mm_opts){.vocab = 2048, .hidden = 256, .layers = 4, .heads = 8, .kv_heads = 2,
                   .intermediate = 688, .seed = 1, .dtype = KR_DTYPE_BF16};
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--corpus", .arg = "FILE", .dest = &o->corpus,
         .help = "UTF-8 text to train the tokenizer on (required)"},
        {.kind = KC_FLAG_STRING, .name = "--out", .arg = "DIR", .dest = &o->out,
         .help = "output directory (required); created, or its five model files replaced"},
        {.kind = KC_FLAG_INT, .name = "--vocab", .arg = "N", .dest = &o->vocab, .min = MM_MIN_VOCAB,
         .max = 1 << 20, .def = "2048, min 260", .help = "vocabulary size including the 3 special tokens"},
        {.kind = KC_FLAG_INT, .name = "--hidden", .arg = "N", .dest = &o->hidden, .min = 2, .max = 65536,
         .def = "256", .help = "hidden size"},
        {.kind = KC_FLAG_INT, .name = "--layers", .arg = "N", .dest = &o->layers, .min = 1, .max = 1024,
         .def = "4", .help = "transformer layers"},
        {.kind = KC_FLAG_INT, .name = "--heads", .arg = "N", .dest = &o->heads, .min = 1, .max = 1024,
         .def = "8", .help = "query heads; must divide --hidden, head_dim must be even"},
        {.kind = KC_FLAG_INT, .name = "--kv-heads", .arg = "N", .dest = &o->kv_heads, .min = 1, .max = 1024,
         .def = "2", .help = "key/value heads; must divide --heads"},
        {.kind = KC_FLAG_INT, .name = "--intermediate", .arg = "N", .dest = &o->intermediate, .min = 1,
         .max = 1 << 20, .def = "688", .help = "MLP intermediate size"},
        {.kind = KC_FLAG_FUNC, .name = "--seed", .arg = "N", .dest = &o->seed, .fn = cli_flag_u64, .def = "1",
         .help = "seed of the random weights"},
        {.kind = KC_FLAG_FUNC, .name = "--dtype", .arg = "T", .dest = &o->dtype, .fn = flag_dtype,
         .def = "bf16", .help = "bf16, f16 or f32"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags = {
        .prog = "kvrelay-make-model",
        .usage = "--corpus FILE --out DIR [options]",
        .about = "Makes a Hugging Face Llama model directory: a byte-level BPE tokenizer (Llama 3 style) trained\n"
                 "on FILE, config.json, generation_config.json and model.safetensors with random weights.\n"
                 "Random weights generate fluent-looking gibberish, not language (docs/default-model.md).\n"
                 "The same corpus and flags give byte-identical files.",
        .table = table,
    };
    kc_flags_main(&flags, argc, argv, 0);
    if (!o->corpus) cli_die(2, "--corpus FILE is required (the project's is tools/data/corpus.txt)");
    if (!o->out) cli_die(2, "--out DIR is required");
    if (!*o->out) cli_die(2, "--out: the directory name is empty");
    if (o->hidden % o->heads)
        cli_die(2, "--heads %d must divide --hidden %d (head_dim = hidden / heads)", o->heads, o->hidden);
    if ((o->hidden / o->heads) % 2)
        cli_die(2, "head_dim = --hidden %d / --heads %d = %d must be even (RoPE rotates pairs)",
                o->hidden, o->heads, o->hidden / o->heads);
    if (o->heads % o->kv_heads)
        cli_die(2, "--kv-heads %d must divide --heads %d (grouped-query attention)", o->kv_heads, o->heads);
}

/* ================================================================== small utilities */

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) cli_die(1, "out of memory (%zu bytes)", n);
    return q;
}
#define GROW(arr, n, cap) do { if ((n) >= (cap)) { (cap) = (cap) ? 2 * (cap) : 16; \
        (arr) = xrealloc((arr), (size_t)(cap) * sizeof *(arr)); } } while (0)

static uint64_t fnv1a(const void *p, size_t n, uint64_t h)
{
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    return h;
}
#define FNV_BASIS 0xcbf29ce484222325ull

/* A set of byte strings, each with a dense index in insertion order (0, 1, ...). Owns copies. */
typedef struct strtab {
    char **key; /* [n] */
    uint32_t *len; /* [n] */
    size_t n, cap;
    int32_t *slot; /* [n_slot] index or -1; open addressing, n_slot a power of two */
    size_t n_slot;
} strtab;

/* Returns the index of s, inserting it when absent (*added says which). */
static int32_t strtab_add(strtab *t, const char *s, size_t n, int *added)
{
    if (2 * (t->n + 1) > t->n_slot) { /* keep the load under 1/2 */
        size_t ns = t->n_slot ? 2 * t->n_slot : 1024;
        free(t->slot);
        t->slot = xrealloc(NULL, ns * sizeof *t->slot);
        memset(t->slot, 0xff, ns * sizeof *t->slot);
        t->n_slot = ns;
        for (size_t i = 0; i < t->n; i++) {
            size_t h = fnv1a(t->key[i], t->len[i], FNV_BASIS) & (ns - 1);
            while (t->slot[h] >= 0) h = (h + 1) & (ns - 1);
            t->slot[h] = (int32_t)i;
        }
    }
    size_t h = fnv1a(s, n, FNV_BASIS) & (t->n_slot - 1);
    for (; t->slot[h] >= 0; h = (h + 1) & (t->n_slot - 1)) {
        int32_t i = t->slot[h];
        if (t->len[i] == n && !memcmp(t->key[i], s, n)) { *added = 0; return i; }
    }
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 1024;
        t->key = xrealloc(t->key, t->cap * sizeof *t->key);
        t->len = xrealloc(t->len, t->cap * sizeof *t->len);
    }
    t->key[t->n] = xrealloc(NULL, n);
    memcpy(t->key[t->n], s, n);
    t->len[t->n] = (uint32_t)n;
    t->slot[h] = (int32_t)t->n;
    *added = 1;
    return (int32_t)t->n++;
}

static void strtab_free(strtab *t)
{
    for (size_t i = 0; i < t->n; i++) free(t->key[i]);
    free(t->key);
    free(t->len);
    free(t->slot);
}

/* ================================================================== byte-level alphabet */

/* GPT-2's byte-to-unicode map: printable Latin-1 bytes stand for themselves, the other 68 bytes
 * are moved to U+0100 and up, so that every token is printable text without spaces. The byte
 * tokens take ids 0..255 in GPT-2's order (the printable ones first), as Llama 3's vocab does. */
typedef struct byte_alphabet {
    uint32_t cp[256]; /* byte -> code point */
    uint8_t byte_of_id[256]; /* byte token id -> byte */
    int32_t id_of_byte[256];
} byte_alphabet;

static int byte_is_printable(int b)
{
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static void byte_alphabet_init(byte_alphabet *ab)
{
    int id = 0, extra = 0;
    for (int b = 0; b < 256; b++)
        if (byte_is_printable(b)) { ab->cp[b] = (uint32_t)b; ab->byte_of_id[id] = (uint8_t)b; ab->id_of_byte[b] = id++; }
    for (int b = 0; b < 256; b++)
        if (!byte_is_printable(b)) { ab->cp[b] = 256u + (uint32_t)extra++; ab->byte_of_id[id] = (uint8_t)b; ab->id_of_byte[b] = id++; }
}

/* The token's display form (as written in tokenizer.json): NUL-terminated, malloc'd. */
static char *byte_alphabet_encode(const byte_alphabet *ab, const char *s, size_t n)
{
    char *o = xrealloc(NULL, 2 * n + 1), *p = o; /* every code point here is < U+0800 */
    for (size_t i = 0; i < n; i++) {
        uint32_t c = ab->cp[(unsigned char)s[i]];
        if (c < 0x80) *p++ = (char)c;
        else { *p++ = (char)(0xC0 | (c >> 6)); *p++ = (char)(0x80 | (c & 0x3F)); }
    }
    *p = 0;
    return o;
}

/* ================================================================== pre-tokenizing the corpus */

/* Llama 3's split regex: the same Split pre-tokenizer that tokenizer.json declares, so that
 * training sees exactly the pieces the tokenizer will later be asked to encode. */
static const char LLAMA3_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static void count_word(strtab *words, int64_t **counts, size_t *cap, const char *s, size_t n)
{
    int added;
    int32_t w = strtab_add(words, s, n, &added);
    if (added) { GROW(*counts, (size_t)w, *cap); (*counts)[w] = 0; }
    (*counts)[w]++;
}

/* Splits text into pieces as the Split(Isolated) pre-tokenizer does (matches and the gaps
 * between them are both pieces) and counts each distinct piece. */
static void count_words(const char *path, const char *text, size_t len, strtab *words, int64_t **counts)
{
    int errcode;
    PCRE2_SIZE erroff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)LLAMA3_SPLIT, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &errcode, &erroff, NULL);
    if (!re) cli_die(1, "internal error: split regex does not compile (PCRE2 error %d at %zu)", errcode, (size_t)erroff);
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) cli_die(1, "out of memory");
    size_t cap = 0, off = 0;
    uint32_t flags = 0; /* the first match checks the whole subject is UTF-8 */
    while (off < len) {
        int rc = pcre2_match(re, (PCRE2_SPTR)text, len, off, flags, md, NULL);
        flags = PCRE2_NO_UTF_CHECK;
        if (rc == PCRE2_ERROR_NOMATCH) { count_word(words, counts, &cap, text + off, len - off); break; }
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            size_t at = (size_t)pcre2_get_startchar(md);
            pcre2_match_data_free(md);
            pcre2_code_free(re);
            cli_die(1, "%s: %s at byte %zu (the corpus must be UTF-8 text)", path, (const char *)msg, at);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (ov[0] > off) count_word(words, counts, &cap, text + off, ov[0] - off);
        size_t end = ov[1];
        if (end == ov[0]) { /* an empty match (the regex has none): take one character */
            end++;
            while (end < len && ((unsigned char)text[end] & 0xC0) == 0x80) end++;
        }
        count_word(words, counts, &cap, text + ov[0], end - ov[0]);
        off = end;
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
}

/* ================================================================== BPE training */

/* The trainer keeps every distinct word as a sequence of token ids with its corpus count, and
 * for every adjacent pair of tokens its total count and the words it occurs in. A merge touches
 * only the words of the chosen pair: their pairs are uncounted, the word is rewritten, and its
 * pairs are counted again. The best pair comes from a max-heap with lazy deletion (an entry is
 * valid while its count equals the pair's current count). Ties are broken by the smallest pair
 * in byte order (left token's bytes, then the right's), which makes training deterministic. */
typedef struct bpe_word {
    int32_t *sym; /* [n] token ids */
    int n;
    int64_t count;
    uint32_t stamp; /* merge number that last visited it */
} bpe_word;

typedef struct bpe_pair {
    int32_t a, b;
    int64_t count;
    int64_t count_before; /* count when first touched by the current merge */
    int32_t *where; /* words holding the pair (may hold stale entries, no adjacent repeats) */
    int n_where, cap_where;
    int touched;
} bpe_pair;

typedef struct heap_entry { int64_t count; int32_t pair; } heap_entry;

typedef struct bpe {
    strtab *vocab; /* token bytes; index == token id */
    bpe_word *words;
    size_t n_words;
    bpe_pair *pairs;
    size_t n_pairs, cap_pairs;
    int32_t *pair_slot; /* hash (a, b) -> pair index, -1 empty */
    size_t n_slot;
    int32_t *touched;
    size_t n_touched, cap_touched;
    heap_entry *heap;
    size_t n_heap, cap_heap;
    int32_t *merge_a, *merge_b; /* [n_merges] */
    size_t n_merges, cap_merges;
} bpe;

static size_t pair_hash(int32_t a, int32_t b, size_t mask)
{
    uint64_t k = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9e3779b97f4a7c15ull;
    return (size_t)(k >> 17) & mask;
}

static int32_t pair_get(bpe *t, int32_t a, int32_t b)
{
    if (2 * (t->n_pairs + 1) > t->n_slot) {
        size_t ns = t->n_slot ? 2 * t->n_slot : 4096;
        free(t->pair_slot);
        t->pair_slot = xrealloc(NULL, ns * sizeof *t->pair_slot);
        memset(t->pair_slot, 0xff, ns * sizeof *t->pair_slot);
        t->n_slot = ns;
        for (size_t i = 0; i < t->n_pairs; i++) {
            size_t h = pair_hash(t->pairs[i].a, t->pairs[i].b, ns - 1);
            while (t->pair_slot[h] >= 0) h = (h + 1) & (ns - 1);
            t->pair_slot[h] = (int32_t)i;
        }
    }
    size_t h = pair_hash(a, b, t->n_slot - 1);
    for (; t->pair_slot[h] >= 0; h = (h + 1) & (t->n_slot - 1)) {
        bpe_pair *p = &t->pairs[t->pair_slot[h]];
        if (p->a == a && p->b == b) return t->pair_slot[h];
    }
    GROW(t->pairs, t->n_pairs, t->cap_pairs);
    t->pairs[t->n_pairs] = (bpe_pair){.a = a, .b = b};
    t->pair_slot[h] = (int32_t)t->n_pairs;
    return (int32_t)t->n_pairs++;
}

/* Adds delta to the count of (a, b); with word >= 0 records that the word holds the pair. */
static void pair_count(bpe *t, int32_t a, int32_t b, int64_t delta, int32_t word)
{
    int32_t i = pair_get(t, a, b);
    bpe_pair *p = &t->pairs[i];
    if (!p->touched) {
        p->touched = 1;
        p->count_before = p->count;
        GROW(t->touched, t->n_touched, t->cap_touched);
        t->touched[t->n_touched++] = i;
    }
    p->count += delta;
    if (word >= 0 && (p->n_where == 0 || p->where[p->n_where - 1] != word)) {
        GROW(p->where, p->n_where, p->cap_where);
        p->where[p->n_where++] = word;
    }
}

/* Byte order of two pairs: is x before y? */
static int pair_less(const bpe *t, int32_t x, int32_t y)
{
    const bpe_pair *px = &t->pairs[x], *py = &t->pairs[y];
    int32_t tx[2] = {px->a, px->b}, ty[2] = {py->a, py->b};
    for (int k = 0; k < 2; k++) {
        uint32_t lx = t->vocab->len[tx[k]], ly = t->vocab->len[ty[k]];
        int c = memcmp(t->vocab->key[tx[k]], t->vocab->key[ty[k]], lx < ly ? lx : ly);
        if (c) return c < 0;
        if (lx != ly) return lx < ly;
    }
    return 0;
}

static int heap_better(const bpe *t, heap_entry x, heap_entry y)
{
    return x.count != y.count ? x.count > y.count : pair_less(t, x.pair, y.pair);
}

static void heap_push(bpe *t, heap_entry e)
{
    GROW(t->heap, t->n_heap, t->cap_heap);
    size_t i = t->n_heap++;
    while (i > 0 && heap_better(t, e, t->heap[(i - 1) / 2])) { t->heap[i] = t->heap[(i - 1) / 2]; i = (i - 1) / 2; }
    t->heap[i] = e;
}

static void heap_pop(bpe *t)
{
    heap_entry e = t->heap[--t->n_heap];
    size_t i = 0, n = t->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_better(t, t->heap[c + 1], t->heap[c])) c++;
        if (!heap_better(t, t->heap[c], e)) break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    if (n) t->heap[i] = e;
}

/* Pushes the pairs whose count the last step changed; clears the touched marks. */
static void flush_touched(bpe *t)
{
    for (size_t k = 0; k < t->n_touched; k++) {
        bpe_pair *p = &t->pairs[t->touched[k]];
        p->touched = 0;
        if (p->count != p->count_before && p->count > 0)
            heap_push(t, (heap_entry){p->count, t->touched[k]});
    }
    t->n_touched = 0;
}

/* Counts (delta = +/-count) the pairs of word w; when adding, records w under the pairs that
 * involve `fresh` (the others already list w). fresh < 0 records w under every pair. */
static void word_pairs(bpe *t, int32_t w, int64_t delta, int32_t fresh)
{
    bpe_word *wd = &t->words[w];
    for (int i = 0; i + 1 < wd->n; i++) {
        int32_t a = wd->sym[i], b = wd->sym[i + 1];
        int record = delta > 0 && (fresh < 0 || a == fresh || b == fresh);
        pair_count(t, a, b, delta, record ? w : -1);
    }
}

/* Trains until the vocabulary holds `target` tokens or no pair is left. `words`/`counts` are
 * the pre-tokenized corpus; `vocab` holds the 256 byte tokens on entry and all tokens on exit. */
static void bpe_train(bpe *t, const byte_alphabet *ab, const strtab *words, const int64_t *counts, int target)
{
    t->n_words = words->n;
    t->words = xrealloc(NULL, t->n_words * sizeof *t->words);
    for (size_t w = 0; w < t->n_words; w++) {
        bpe_word *wd = &t->words[w];
        wd->n = (int)words->len[w];
        wd->sym = xrealloc(NULL, (size_t)wd->n * sizeof *wd->sym);
        for (int i = 0; i < wd->n; i++) wd->sym[i] = ab->id_of_byte[(unsigned char)words->key[w][i]];
        wd->count = counts[w];
        wd->stamp = 0;
        word_pairs(t, (int32_t)w, wd->count, -1);
    }
    flush_touched(t);

    double t0 = cli_now();
    int report_every = (target - 256) / 8 > 0 ? (target - 256) / 8 : 1;
    uint32_t stamp = 0;
    while ((int)t->vocab->n < target) {
        while (t->n_heap && (t->heap[0].count != t->pairs[t->heap[0].pair].count || t->heap[0].count <= 0))
            heap_pop(t);
        if (!t->n_heap) break; /* every word is a single token */
        int32_t best = t->heap[0].pair;
        heap_pop(t);
        int32_t a = t->pairs[best].a, b = t->pairs[best].b;

        size_t la = t->vocab->len[a], lb = t->vocab->len[b];
        char *joined = xrealloc(NULL, la + lb);
        memcpy(joined, t->vocab->key[a], la);
        memcpy(joined + la, t->vocab->key[b], lb);
        int added;
        /* Two different pairs can spell the same token ("a"+"bc", "ab"+"c"): then the merge is
         * recorded but the vocabulary does not grow. */
        int32_t c = strtab_add(t->vocab, joined, la + lb, &added);
        free(joined);
        if (t->n_merges == t->cap_merges) {
            t->cap_merges = t->cap_merges ? 2 * t->cap_merges : 1024;
            t->merge_a = xrealloc(t->merge_a, t->cap_merges * sizeof *t->merge_a);
            t->merge_b = xrealloc(t->merge_b, t->cap_merges * sizeof *t->merge_b);
        }
        t->merge_a[t->n_merges] = a;
        t->merge_b[t->n_merges++] = b;

        stamp++;
        for (int k = 0; k < t->pairs[best].n_where; k++) { /* best's list cannot grow here: c != a, b */
            int32_t w = t->pairs[best].where[k];
            bpe_word *wd = &t->words[w];
            if (wd->stamp == stamp) continue;
            wd->stamp = stamp;
            int has = 0;
            for (int i = 0; i + 1 < wd->n && !has; i++) has = wd->sym[i] == a && wd->sym[i + 1] == b;
            if (!has) continue; /* stale: an earlier merge took the pair apart */
            word_pairs(t, w, -wd->count, c);
            int n = 0;
            for (int i = 0; i < wd->n; i++) {
                if (i + 1 < wd->n && wd->sym[i] == a && wd->sym[i + 1] == b) { wd->sym[n++] = c; i++; }
                else wd->sym[n++] = wd->sym[i];
            }
            wd->n = n;
            word_pairs(t, w, wd->count, c);
        }
        bpe_pair *bp = &t->pairs[best];
        free(bp->where);
        bp->where = NULL;
        bp->n_where = bp->cap_where = 0;
        flush_touched(t);
        if (t->n_merges % (size_t)report_every == 0)
            fprintf(stderr, "kvrelay-make-model: bpe: %zu merges, vocab %zu/%d (%.2f s)\n", t->n_merges,
                    t->vocab->n, target, cli_now() - t0);
    }
}

static void bpe_free(bpe *t)
{
    for (size_t w = 0; w < t->n_words; w++) free(t->words[w].sym);
    for (size_t i = 0; i < t->n_pairs; i++) free(t->pairs[i].where);
    free(t->words);
    free(t->pairs);
    free(t->pair_slot);
    free(t->touched);
    free(t->heap);
    free(t->merge_a);
    free(t->merge_b);
}

/* ================================================================== JSON files */

static cJSON *jobj(cJSON *parent, const char *key)
{
    cJSON *o = cJSON_CreateObject();
    if (parent) cJSON_AddItemToObject(parent, key, o);
    return o;
}

static cJSON *byte_level(cJSON *parent, int add_prefix_space, int trim_offsets, int use_regex)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "type", "ByteLevel");
    cJSON_AddBoolToObject(o, "add_prefix_space", add_prefix_space);
    cJSON_AddBoolToObject(o, "trim_offsets", trim_offsets);
    cJSON_AddBoolToObject(o, "use_regex", use_regex);
    if (cJSON_IsArray(parent)) cJSON_AddItemToArray(parent, o);
    return o;
}

static void add_token_flags(cJSON *o, const char *content)
{
    cJSON_AddStringToObject(o, "content", content);
    cJSON_AddBoolToObject(o, "lstrip", 0);
    cJSON_AddBoolToObject(o, "normalized", 0);
    cJSON_AddBoolToObject(o, "rstrip", 0);
    cJSON_AddBoolToObject(o, "single_word", 0);
    cJSON_AddBoolToObject(o, "special", 1);
}

static cJSON *template_piece(const char *kind, const char *id, int type_id)
{
    cJSON *o = cJSON_CreateObject(), *in = jobj(o, kind);
    cJSON_AddStringToObject(in, "id", id);
    cJSON_AddNumberToObject(in, "type_id", type_id);
    return o;
}

/* tokenizer.json in the shape the Hugging Face `tokenizers` library writes for Llama 3. */
static cJSON *tokenizer_json(const bpe *t, const byte_alphabet *ab, int n_bpe)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "version", "1.0");
    cJSON_AddNullToObject(root, "truncation");
    cJSON_AddNullToObject(root, "padding");
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    for (int s = 0; s < MM_N_SPECIALS; s++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "id", n_bpe + s);
        cJSON_AddStringToObject(o, "content", MM_SPECIALS[s]);
        cJSON_AddBoolToObject(o, "single_word", 0);
        cJSON_AddBoolToObject(o, "lstrip", 0);
        cJSON_AddBoolToObject(o, "rstrip", 0);
        cJSON_AddBoolToObject(o, "normalized", 0);
        cJSON_AddBoolToObject(o, "special", 1);
        cJSON_AddItemToArray(added, o);
    }
    cJSON_AddNullToObject(root, "normalizer");

    cJSON *pre = jobj(root, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "Sequence");
    cJSON *pres = cJSON_AddArrayToObject(pre, "pretokenizers");
    cJSON *split = cJSON_CreateObject();
    cJSON_AddStringToObject(split, "type", "Split");
    cJSON_AddStringToObject(jobj(split, "pattern"), "Regex", LLAMA3_SPLIT);
    cJSON_AddStringToObject(split, "behavior", "Isolated");
    cJSON_AddBoolToObject(split, "invert", 0);
    cJSON_AddItemToArray(pres, split);
    byte_level(pres, 0, 1, 0);

    cJSON *post = jobj(root, "post_processor");
    cJSON_AddStringToObject(post, "type", "Sequence");
    cJSON *procs = cJSON_AddArrayToObject(post, "processors");
    byte_level(procs, 1, 0, 1);
    cJSON *tp = cJSON_CreateObject();
    cJSON_AddItemToArray(procs, tp);
    cJSON_AddStringToObject(tp, "type", "TemplateProcessing");
    const char *bos = MM_SPECIALS[0];
    cJSON *single = cJSON_AddArrayToObject(tp, "single");
    cJSON_AddItemToArray(single, template_piece("SpecialToken", bos, 0));
    cJSON_AddItemToArray(single, template_piece("Sequence", "A", 0));
    cJSON *pair = cJSON_AddArrayToObject(tp, "pair");
    cJSON_AddItemToArray(pair, template_piece("SpecialToken", bos, 0));
    cJSON_AddItemToArray(pair, template_piece("Sequence", "A", 0));
    cJSON_AddItemToArray(pair, template_piece("SpecialToken", bos, 1));
    cJSON_AddItemToArray(pair, template_piece("Sequence", "B", 1));
    cJSON *st = jobj(jobj(tp, "special_tokens"), bos);
    cJSON_AddStringToObject(st, "id", bos);
    cJSON_AddItemToArray(cJSON_AddArrayToObject(st, "ids"), cJSON_CreateNumber(n_bpe));
    cJSON_AddItemToArray(cJSON_AddArrayToObject(st, "tokens"), cJSON_CreateString(bos));

    cJSON *dec = byte_level(NULL, 1, 1, 1);
    cJSON_AddItemToObject(root, "decoder", dec);

    cJSON *model = jobj(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddNullToObject(model, "continuing_subword_prefix");
    cJSON_AddNullToObject(model, "end_of_word_suffix");
    cJSON_AddBoolToObject(model, "fuse_unk", 0);
    cJSON_AddBoolToObject(model, "byte_fallback", 0);
    cJSON_AddBoolToObject(model, "ignore_merges", 1);
    cJSON *vocab = jobj(model, "vocab");
    for (int id = 0; id < n_bpe; id++) {
        char *s = byte_alphabet_encode(ab, t->vocab->key[id], t->vocab->len[id]);
        cJSON_AddNumberToObject(vocab, s, id);
        free(s);
    }
    cJSON *merges = cJSON_AddArrayToObject(model, "merges");
    for (size_t m = 0; m < t->n_merges; m++) {
        char *a = byte_alphabet_encode(ab, t->vocab->key[t->merge_a[m]], t->vocab->len[t->merge_a[m]]);
        char *b = byte_alphabet_encode(ab, t->vocab->key[t->merge_b[m]], t->vocab->len[t->merge_b[m]]);
        size_t la = strlen(a), lb = strlen(b);
        char *ab_s = xrealloc(NULL, la + lb + 2);
        memcpy(ab_s, a, la);
        ab_s[la] = ' ';
        memcpy(ab_s + la + 1, b, lb + 1);
        cJSON_AddItemToArray(merges, cJSON_CreateString(ab_s));
        free(ab_s);
        free(a);
        free(b);
    }
    return root;
}

static cJSON *tokenizer_config_json(int n_bpe)
{
    cJSON *root = cJSON_CreateObject(), *dec = jobj(root, "added_tokens_decoder");
    for (int s = 0; s < MM_N_SPECIALS; s++) {
        char key[16];
        snprintf(key, sizeof key, "%d", n_bpe + s);
        add_token_flags(jobj(dec, key), MM_SPECIALS[s]);
    }
    cJSON_AddStringToObject(root, "bos_token", MM_SPECIALS[0]);
    cJSON_AddBoolToObject(root, "clean_up_tokenization_spaces", 1);
    cJSON_AddStringToObject(root, "eos_token", MM_SPECIALS[1]);
    cJSON *names = cJSON_AddArrayToObject(root, "model_input_names");
    cJSON_AddItemToArray(names, cJSON_CreateString("input_ids"));
    cJSON_AddItemToArray(names, cJSON_CreateString("attention_mask"));
    cJSON_AddNumberToObject(root, "model_max_length", MM_MAX_POS);
    cJSON_AddStringToObject(root, "tokenizer_class", "PreTrainedTokenizerFast");
    return root;
}

static const char *torch_dtype_name(kr_dtype d)
{
    return d == KR_DTYPE_BF16 ? "bfloat16" : d == KR_DTYPE_F16 ? "float16" : "float32";
}

static cJSON *config_json(const mm_opts *o, int vocab, int bos, int eos)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToArray(cJSON_AddArrayToObject(root, "architectures"), cJSON_CreateString("LlamaForCausalLM"));
    cJSON_AddBoolToObject(root, "attention_bias", 0);
    cJSON_AddNumberToObject(root, "attention_dropout", 0.0);
    cJSON_AddNumberToObject(root, "bos_token_id", bos);
    cJSON_AddNumberToObject(root, "eos_token_id", eos);
    cJSON_AddNumberToObject(root, "head_dim", o->hidden / o->heads);
    cJSON_AddStringToObject(root, "hidden_act", "silu");
    cJSON_AddNumberToObject(root, "hidden_size", o->hidden);
    cJSON_AddNumberToObject(root, "intermediate_size", o->intermediate);
    cJSON_AddNumberToObject(root, "max_position_embeddings", MM_MAX_POS);
    cJSON_AddBoolToObject(root, "mlp_bias", 0);
    cJSON_AddStringToObject(root, "model_type", "llama");
    cJSON_AddNumberToObject(root, "num_attention_heads", o->heads);
    cJSON_AddNumberToObject(root, "num_hidden_layers", o->layers);
    cJSON_AddNumberToObject(root, "num_key_value_heads", o->kv_heads);
    cJSON_AddNumberToObject(root, "pretraining_tp", 1);
    cJSON_AddNumberToObject(root, "rms_norm_eps", 1e-5);
    cJSON *rs = jobj(root, "rope_scaling");
    cJSON_AddNumberToObject(rs, "factor", 8.0);
    cJSON_AddNumberToObject(rs, "high_freq_factor", 4.0);
    cJSON_AddNumberToObject(rs, "low_freq_factor", 1.0);
    cJSON_AddNumberToObject(rs, "original_max_position_embeddings", MM_MAX_POS);
    cJSON_AddStringToObject(rs, "rope_type", "llama3");
    cJSON_AddNumberToObject(root, "rope_theta", 500000.0);
    cJSON_AddBoolToObject(root, "tie_word_embeddings", 0);
    cJSON_AddStringToObject(root, "torch_dtype", torch_dtype_name(o->dtype));
    cJSON_AddBoolToObject(root, "use_cache", 1);
    cJSON_AddNumberToObject(root, "vocab_size", vocab);
    return root;
}

static cJSON *generation_config_json(int bos, int eos)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddNumberToObject(root, "bos_token_id", bos);
    cJSON_AddBoolToObject(root, "do_sample", 0);
    cJSON_AddNumberToObject(root, "eos_token_id", eos);
    return root;
}

/* ================================================================== atomic output directory */

/* Everything is written into a fresh sibling directory ".NAME.tmp-XXXXXX" and moved into place
 * at the end: a new DIR appears whole with one rename; an existing DIR gets its files renamed in
 * one by one, model.safetensors removed first and put back last, so a reader that takes
 * model.safetensors as "the model is complete" (./kvrelay does) never sees a mix. An error, an
 * exit or SIGINT/SIGTERM removes the temporary directory. */
static const char *const OUT_FILES[] = {"tokenizer.json", "tokenizer_config.json", "config.json",
                                        "generation_config.json", "model.safetensors"};
#define N_OUT_FILES 5
static char g_tmpdir[PATH_MAX];
static char g_tmpfile[N_OUT_FILES][PATH_MAX + 32]; /* precomputed: the signal handler only unlinks */

static void tmpdir_remove(void)
{
    if (!g_tmpdir[0]) return;
    for (int i = 0; i < N_OUT_FILES; i++) unlink(g_tmpfile[i]);
    rmdir(g_tmpdir);
    g_tmpdir[0] = 0;
}

static void on_signal(int sig)
{
    tmpdir_remove();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void mkdir_parents(const char *path)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) cli_die(2, "--out: path too long");
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0777) && errno != EEXIST) cli_die(1, "cannot create directory %s: %s", buf, strerror(errno));
        *p = '/';
    }
}

static void out_begin(const char *out)
{
    struct stat st;
    if (!stat(out, &st) && !S_ISDIR(st.st_mode)) cli_die(2, "--out %s exists and is not a directory", out);
    char parent[PATH_MAX], name[PATH_MAX];
    size_t n = strlen(out);
    while (n > 1 && out[n - 1] == '/') n--; /* "dir/" */
    if (n >= sizeof parent) cli_die(2, "--out: path too long");
    memcpy(parent, out, n);
    parent[n] = 0;
    char *slash = strrchr(parent, '/');
    snprintf(name, sizeof name, "%s", slash ? slash + 1 : parent);
    if (slash == parent) parent[1] = 0;
    else if (slash) *slash = 0;
    else snprintf(parent, sizeof parent, ".");
    mkdir_parents(out);
    if (snprintf(g_tmpdir, sizeof g_tmpdir, "%s/.%s.tmp-XXXXXX", parent, name) >= (int)sizeof g_tmpdir)
        cli_die(2, "--out: path too long");
    if (!mkdtemp(g_tmpdir)) {
        int e = errno;
        g_tmpdir[0] = 0;
        cli_die(1, "cannot create a temporary directory next to %s: %s", out, strerror(e));
    }
    mode_t mask = umask(0); /* mkdtemp makes 0700; the model is as readable as a mkdir'd one */
    umask(mask);
    chmod(g_tmpdir, 0777 & ~mask);
    for (int i = 0; i < N_OUT_FILES; i++) snprintf(g_tmpfile[i], sizeof g_tmpfile[i], "%s/%s", g_tmpdir, OUT_FILES[i]);
    atexit(tmpdir_remove);
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
}

static FILE *out_open(int file)
{
    FILE *f = fopen(g_tmpfile[file], "wb");
    if (!f) cli_die(1, "cannot write %s: %s", g_tmpfile[file], strerror(errno));
    return f;
}

static void out_close(FILE *f, int file)
{
    if (fflush(f) || fsync(fileno(f)) || ferror(f)) {
        int e = errno;
        fclose(f);
        cli_die(1, "writing %s: %s", g_tmpfile[file], strerror(e));
    }
    if (fclose(f)) cli_die(1, "writing %s: %s", g_tmpfile[file], strerror(errno));
}

/* Writes a JSON document (and frees it) with a final newline. */
static void out_json(int file, cJSON *doc)
{
    char *text = cJSON_Print(doc);
    cJSON_Delete(doc);
    if (!text) cli_die(1, "out of memory printing %s", OUT_FILES[file]);
    FILE *f = out_open(file);
    fputs(text, f);
    fputc('\n', f);
    free(text);
    out_close(f, file);
}

static void out_commit(const char *out)
{
    struct stat st;
    if (stat(out, &st) && errno == ENOENT) {
        if (rename(g_tmpdir, out)) cli_die(1, "cannot move %s to %s: %s", g_tmpdir, out, strerror(errno));
        g_tmpdir[0] = 0;
        return;
    }
    char dst[PATH_MAX + 32];
    snprintf(dst, sizeof dst, "%s/model.safetensors", out);
    if (unlink(dst) && errno != ENOENT) cli_die(1, "cannot replace %s: %s", dst, strerror(errno));
    for (int i = 0; i < N_OUT_FILES; i++) { /* model.safetensors is the last of OUT_FILES */
        snprintf(dst, sizeof dst, "%s/%s", out, OUT_FILES[i]);
        if (rename(g_tmpfile[i], dst)) cli_die(1, "cannot move %s to %s: %s", g_tmpfile[i], dst, strerror(errno));
    }
    tmpdir_remove();
}

/* ================================================================== random weights, safetensors */

typedef struct mm_tensor {
    char name[96];
    int64_t rows, cols; /* a 1-D tensor has rows == 0 and its length in cols */
    int is_norm; /* RMSNorm gains: all 1.0 */
} mm_tensor;

/* HF Llama names; linear weights are [out_features][in_features]. The data is laid out in this
 * order (embedding, layers, final norm, lm_head). */
static mm_tensor *weight_list(const mm_opts *o, int vocab, int *n_out)
{
    int n = 0, cap = 3 + 9 * o->layers;
    mm_tensor *t = xrealloc(NULL, (size_t)cap * sizeof *t);
    int64_t d = o->hidden, hd = o->hidden / o->heads, q = o->heads * hd, kv = o->kv_heads * hd,
            f = o->intermediate;
#define ADD(r, c, norm, ...) do { snprintf(t[n].name, sizeof t[n].name, __VA_ARGS__); \
        t[n].rows = (r); t[n].cols = (c); t[n].is_norm = (norm); n++; } while (0)
    ADD(vocab, d, 0, "model.embed_tokens.weight");
    for (int l = 0; l < o->layers; l++) {
        ADD(0, d, 1, "model.layers.%d.input_layernorm.weight", l);
        ADD(q, d, 0, "model.layers.%d.self_attn.q_proj.weight", l);
        ADD(kv, d, 0, "model.layers.%d.self_attn.k_proj.weight", l);
        ADD(kv, d, 0, "model.layers.%d.self_attn.v_proj.weight", l);
        ADD(d, q, 0, "model.layers.%d.self_attn.o_proj.weight", l);
        ADD(0, d, 1, "model.layers.%d.post_attention_layernorm.weight", l);
        ADD(f, d, 0, "model.layers.%d.mlp.gate_proj.weight", l);
        ADD(f, d, 0, "model.layers.%d.mlp.up_proj.weight", l);
        ADD(d, f, 0, "model.layers.%d.mlp.down_proj.weight", l);
    }
    ADD(0, d, 1, "model.norm.weight");
    ADD(vocab, d, 0, "lm_head.weight");
#undef ADD
    *n_out = n;
    return t;
}

static int64_t tensor_elems(const mm_tensor *t) { return t->rows ? t->rows * t->cols : t->cols; }

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Matrix entries: the sum of four uniform 16-bit draws on (-1, 1) (variance 4/3, close to a
 * normal), scaled to a standard deviation of 0.04. Every step is exact or exactly rounded, so
 * the values do not depend on the machine's libm. Each tensor has its own stream, seeded by the
 * model seed and the tensor's name. */
static void fill_tensor(const mm_tensor *t, uint64_t seed, float *x)
{
    int64_t n = tensor_elems(t);
    if (t->is_norm) { for (int64_t i = 0; i < n; i++) x[i] = 1.0f; return; }
    uint64_t s = fnv1a(t->name, strlen(t->name), FNV_BASIS ^ seed);
    const float scale = 0.04f * 0.8660254f; /* 0.04 / sqrt(4/3) */
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = splitmix64(&s);
        float sum = 0.0f;
        for (int k = 0; k < 4; k++, r >>= 16) sum += ((float)(r & 0xffff) + 0.5f) / 32768.0f - 1.0f;
        x[i] = sum * scale;
    }
}

static const char *st_dtype_name(kr_dtype d)
{
    return d == KR_DTYPE_BF16 ? "BF16" : d == KR_DTYPE_F16 ? "F16" : "F32";
}

/* Converts to the file dtype, little-endian, into out (n * dtype size bytes). */
static void encode_tensor(const float *x, int64_t n, kr_dtype d, unsigned char *out)
{
    for (int64_t i = 0; i < n; i++) {
        if (d == KR_DTYPE_F32) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            for (int k = 0; k < 4; k++) out[4 * i + k] = (unsigned char)(u >> (8 * k));
        } else {
            uint16_t h;
            kr_dtype_from_f32(d, &x[i], 1, &h); /* the engine's own rounding */
            out[2 * i] = (unsigned char)h;
            out[2 * i + 1] = (unsigned char)(h >> 8);
        }
    }
}

/* safetensors: u64 LE header length, a JSON header (padded with spaces so the data starts at a
 * multiple of 8) mapping each name to dtype, shape and [begin, end) byte offsets into the data
 * that follows; "__metadata__" says the tensors came from PyTorch, as HF writes it. */
static void write_safetensors(int file, const mm_opts *o, int vocab)
{
    int n;
    mm_tensor *ts = weight_list(o, vocab, &n);
    size_t esz = kr_dtype_size(o->dtype), hcap = 256 + (size_t)n * 160, hlen = 0;
    char *hdr = xrealloc(NULL, hcap);
    int64_t off = 0, max_elems = 0;
    hlen += (size_t)snprintf(hdr, hcap, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        int64_t bytes = tensor_elems(&ts[i]) * (int64_t)esz;
        char shape[64];
        if (ts[i].rows) snprintf(shape, sizeof shape, "%" PRId64 ",%" PRId64, ts[i].rows, ts[i].cols);
        else snprintf(shape, sizeof shape, "%" PRId64, ts[i].cols);
        hlen += (size_t)snprintf(hdr + hlen, hcap - hlen,
                                 ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%" PRId64 ",%" PRId64 "]}",
                                 ts[i].name, st_dtype_name(o->dtype), shape, off, off + bytes);
        off += bytes;
        if (tensor_elems(&ts[i]) > max_elems) max_elems = tensor_elems(&ts[i]);
    }
    hdr[hlen++] = '}';
    while (hlen % 8) hdr[hlen++] = ' ';
    FILE *f = out_open(file);
    unsigned char len8[8];
    for (int k = 0; k < 8; k++) len8[k] = (unsigned char)((uint64_t)hlen >> (8 * k));
    fwrite(len8, 1, 8, f);
    fwrite(hdr, 1, hlen, f);
    free(hdr);

    float *x = xrealloc(NULL, (size_t)max_elems * sizeof *x);
    unsigned char *buf = xrealloc(NULL, (size_t)max_elems * esz);
    double t0 = cli_now();
    int64_t done = 0;
    for (int i = 0; i < n; i++) {
        int64_t ne = tensor_elems(&ts[i]);
        done += ne * (int64_t)esz;
        fill_tensor(&ts[i], o->seed, x);
        encode_tensor(x, ne, o->dtype, buf);
        if (fwrite(buf, esz, (size_t)ne, f) != (size_t)ne) cli_die(1, "writing %s: %s", g_tmpfile[file], strerror(errno));
        if (i == n - 1 || (i + 1) % 9 == 0)
            fprintf(stderr, "kvrelay-make-model: weights: %d/%d tensors, %.1f MB (%.2f s)\n", i + 1, n,
                    (double)done / 1e6, cli_now() - t0);
    }
    free(x);
    free(buf);
    free(ts);
    out_close(f, file);
    fprintf(stderr, "kvrelay-make-model: model.safetensors: %" PRId64 " bytes of %s weights\n", off,
            st_dtype_name(o->dtype));
}

/* ================================================================== main */

int main(int argc, char **argv)
{
    cli_init(argv);
    mm_opts o;
    parse_args(argc, argv, &o);

    FILE *corpus = fopen(o.corpus, "rb");
    if (!corpus) cli_die(1, "--corpus %s: cannot open: %s", o.corpus, strerror(errno));
    size_t len;
    char *text = cli_read_file(corpus, &len);
    fclose(corpus);
    if (len == 0) { free(text); cli_die(1, "--corpus %s is empty: the tokenizer needs text to train on", o.corpus); }

    out_begin(o.out);
    double t0 = cli_now();
    byte_alphabet ab;
    byte_alphabet_init(&ab);
    strtab words = {0};
    int64_t *counts = NULL;
    count_words(o.corpus, text, len, &words, &counts);
    free(text);
    fprintf(stderr, "kvrelay-make-model: corpus %s: %zu bytes, %zu distinct pieces\n", o.corpus, len, words.n);

    strtab vocab = {0};
    for (int id = 0; id < 256; id++) {
        int added;
        char c = (char)ab.byte_of_id[id];
        strtab_add(&vocab, &c, 1, &added);
    }
    bpe t = {.vocab = &vocab};
    bpe_train(&t, &ab, &words, counts, o.vocab - MM_N_SPECIALS);
    int n_bpe = (int)vocab.n, n_vocab = n_bpe + MM_N_SPECIALS;
    fprintf(stderr, "kvrelay-make-model: bpe: %zu merges, %d tokens + %d specials in %.2f s\n", t.n_merges, n_bpe,
            MM_N_SPECIALS, cli_now() - t0);
    if (n_vocab < o.vocab)
        fprintf(stderr, "kvrelay-make-model: note: the corpus has no pairs left to merge; vocab is %d, not %d\n",
                n_vocab, o.vocab);

    out_json(0, tokenizer_json(&t, &ab, n_bpe));
    out_json(1, tokenizer_config_json(n_bpe));
    bpe_free(&t);
    strtab_free(&vocab);
    strtab_free(&words);
    free(counts);

    int bos = n_bpe, eos = n_bpe + 1;
    out_json(2, config_json(&o, n_vocab, bos, eos));
    out_json(3, generation_config_json(bos, eos));
    write_safetensors(4, &o, n_vocab);
    out_commit(o.out);
    fprintf(stderr, "kvrelay-make-model: wrote %s (vocab %d, hidden %d, %d layers, %d/%d heads) in %.2f s\n", o.out,
            n_vocab, o.hidden, o.layers, o.heads, o.kv_heads, cli_now() - t0);
    return 0;
}
