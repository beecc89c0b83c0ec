/*
 * fuzz_tokenizer.c - fuzz target for the tokenizer: the tokenizer.json loader and
 * encode/decode/detokenize on arbitrary bytes.
 *
 * The first byte picks the mode: '0' (and every byte = 0 mod 3): the rest is a tokenizer.json,
 * loaded through kr_tokenizer_parse, then used on a few fixed strings when it loads; '1': the
 * rest is text for a small byte-level BPE tokenizer (Llama 3 style regex); '2': the same with
 * a small sentencepiece-style one (byte fallback, unk). Text modes also decode the input read
 * as 16-bit ids (some out of range) and stream them through the detokenizer, checking that the
 * deltas concatenate to the full decode.
 * It is not a correctness test of ids (test_tokenizer.c is). Run: ctest -R fuzz_tokenizer, or
 * build with -DKR_FUZZ=ON (clang) for libFuzzer.
 */
#include "kr-tokenizer.h" /* kr_tokenizer_parse */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char SPM[] =
    "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true},{\"id\":1,\"content\":\"<s>\",\"special\":true},"
    "{\"id\":2,\"content\":\"</s>\",\"special\":true},{\"id\":14,\"content\":\"<x>\",\"lstrip\":true,\"rstrip\":true}],"
    "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"},"
    "{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}]},\"pre_tokenizer\":null,"
    "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
    "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[1],\"tokens\":[\"<s>\"]}}},"
    "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"\\u2581\"},\"content\":\" \"},"
    "{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \",\"start\":1,\"stop\":0}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,\"byte_fallback\":true,"
    "\"vocab\":{\"<unk>\":0,\"<s>\":1,\"</s>\":2,\"<0xC3>\":3,\"<0xA9>\":4,\"<0xE4>\":5,\"a\":6,\"b\":7,\"\\u2581\":8,"
    "\"ab\":9,\"\\u2581ab\":10,\"<0x20>\":11,\"\\u2581\\u2581\":12,\"\\u00e9\":13},"
    "\"merges\":[\"a b\",[\"\\u2581\",\"ab\"],\"\\u2581 \\u2581\"]}}";

static const char RE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+";

static uint32_t gpt2_cp(int b)
{
    int printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    if (printable) return (uint32_t)b;
    int k = 0;
    for (int i = 0; i < b; i++) k += !((i >= 0x21 && i <= 0x7e) || (i >= 0xa1 && i <= 0xac) || (i >= 0xae && i <= 0xff));
    return 256u + (uint32_t)k;
}

/* A byte-level tokenizer with all 256 byte tokens and a few merges, written as JSON. */
static char *byte_level_json(void)
{
    size_t cap = 64 * 1024, n = 0;
    char *s = malloc(cap);
    n += (size_t)snprintf(s + n, cap - n,
                          "{\"added_tokens\":[{\"id\":262,\"content\":\"<|begin_of_text|>\",\"special\":true},"
                          "{\"id\":263,\"content\":\"<|eot_id|>\",\"special\":true}],\"normalizer\":{\"type\":\"NFC\"},"
                          "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":"
                          "{\"Regex\":\"%s\"},\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\","
                          "\"add_prefix_space\":false,\"use_regex\":false}]},\"post_processor\":{\"type\":\"TemplateProcessing\","
                          "\"single\":[{\"SpecialToken\":{\"id\":\"<|begin_of_text|>\",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\","
                          "\"type_id\":0}}],\"special_tokens\":{\"<|begin_of_text|>\":{\"id\":\"<|begin_of_text|>\",\"ids\":[262]}}},"
                          "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"ignore_merges\":true,\"vocab\":{",
                          RE);
    for (int b = 0; b < 256; b++) {
        uint32_t cp = gpt2_cp(b);
        if (cp == '"' || cp == '\\') n += (size_t)snprintf(s + n, cap - n, "\"\\%c\":%d,", (char)cp, b);
        else n += (size_t)snprintf(s + n, cap - n, "\"\\u%04x\":%d,", cp, b);
    }
    n += (size_t)snprintf(s + n, cap - n,
                          "\"he\":256,\"\\u0120t\":257,\"\\u0120the\":258,\"in\":259,\"\\u0120\\u0120\":260,\"\\u00c3\\u00a9\":261},"
                          "\"merges\":[\"h e\",\"\\u0120 t\",[\"\\u0120t\",\"he\"],\"i n\",\"\\u0120 \\u0120\",\"\\u00c3 \\u00a9\"]}}");
    return s;
}

static void exercise(const kr_tokenizer *t, const uint8_t *data, size_t size)
{
    char err[KR_ERR_MAX];
    int32_t *ids;
    int n;
    for (int add = 0; add < 2; add++) {
        if (kr_tokenizer_encode(t, (const char *)data, size, add, &ids, &n, err) == 0) {
            char *text;
            if (kr_tokenizer_decode(t, ids, n, 0, &text, err) == 0) free(text);
            free(ids);
        }
    }
    /* decode the bytes read as ids; some are out of range */
    int nv = kr_tokenizer_n_vocab(t);
    int m = (int)(size / 2);
    int32_t *raw = malloc(sizeof(int32_t) * (size_t)(m + 1));
    for (int i = 0; i < m; i++) raw[i] = (int32_t)((data[2 * i] | (data[2 * i + 1] << 8)) % (nv + 2));
    for (int skip = 0; skip < 2; skip++) {
        char *full = NULL;
        int ok = kr_tokenizer_decode(t, raw, m, skip, &full, err) == 0;
        kr_detok *d;
        if (kr_detok_create(t, skip, &d, err)) abort();
        size_t cap = 64, o = 0;
        char *cat = malloc(cap);
        const char *delta;
        size_t dl;
        int pushed_all = 1;
        for (int i = 0; i < m; i++) {
            if (kr_detok_push(d, raw[i], &delta, &dl, err)) { pushed_all = 0; continue; }
            while (o + dl + 1 > cap) cat = realloc(cat, cap *= 2);
            memcpy(cat + o, delta, dl);
            o += dl;
        }
        kr_detok_flush(d, &delta, &dl);
        while (o + dl + 1 > cap) cat = realloc(cat, cap *= 2);
        memcpy(cat + o, delta, dl);
        o += dl;
        cat[o] = 0;
        if (ok != pushed_all) abort(); /* decode fails exactly when some id is bad */
        if (ok && strcmp(cat, full) != 0) abort(); /* deltas must concatenate to the decode */
        free(cat);
        free(full);
        kr_detok_free(d);
    }
    free(raw);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kr_tokenizer *bl, *spm;
    char err[KR_ERR_MAX];
    if (!bl) {
        char *j = byte_level_json();
        if (kr_tokenizer_parse(j, strlen(j), "byte-level", NULL, 0, "", &bl, err)) abort();
        free(j);
        if (kr_tokenizer_parse(SPM, sizeof SPM - 1, "spm", NULL, 0, "", &spm, err)) abort();
    }
    if (size == 0) return 0;
    int mode = data[0] % 3;
    data++, size--;
    if (mode == 0) {
        kr_tokenizer *t;
        if (kr_tokenizer_parse((const char *)data, size, "fuzz/tokenizer.json", NULL, 0, "", &t, err) == 0) {
            static const uint8_t probe[] = "Hello, world! 12345 caf\xc3\xa9 \xe4\xbd\xa0 <s></s><|eot_id|>  \n";
            exercise(t, probe, sizeof probe - 1);
            kr_tokenizer_free(t);
        } else if (!err[0]) {
            abort(); /* a failure must say why */
        }
    } else {
        exercise(mode == 1 ? bl : spm, data, size);
    }
    return 0;
}
