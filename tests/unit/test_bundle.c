/*
 * test_bundle.c - the KV bundle codec (kvtransfer/bundle.h) on one bundle: CRC32C against a
 * bitwise reference, the f16/bf16/fp8 conversions against independent oracles, round trips over
 * several shapes and every payload dtype with the size predicted exactly (int8 and fp8 within
 * their documented bounds), and for every validation rule a damaged bundle refused with the
 * message that rule gives. Damage that a checksum would catch first is "resealed" (checksums
 * recomputed) so the semantic check itself is exercised. Bundles in parts (layer segments, a
 * set) and block padding (2.3): test_bundle_parts.c; what both use: kt_bundle_test.h.
 * Not tested here: libFuzzer-scale inputs (tests/fuzz/fuzz_bundle.c).
 * Run: ctest -R test_bundle. With KT_BUNDLE_SEEDS=DIR it also writes the fuzz seeds
 * (tests/fuzz/corpus/bundle/) into DIR.
 */
#include "kt_bundle_test.h"

/* The bitwise CRC32C definition, independent of both library paths. */
static uint32_t crc_ref(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1)));
    }
    return ~c;
}


/* ------------------------------------------------------------------ CRC and conversions */

static void test_crc(void)
{
    CHECK(kt_crc32c(0, "123456789", 9) == 0xe3069283u, "check value 0x%08x",
          kt_crc32c(0, "123456789", 9));
    uint8_t z[32] = {0};
    CHECK(kt_crc32c(0, z, 32) == 0x8a9136aau, "32 zeros: 0x%08x", kt_crc32c(0, z, 32));
    CHECK(kt_crc32c(0, NULL, 0) == 0, "empty");
    CHECK(kt_crc32c_portable(0, "123456789", 9) == 0xe3069283u, "table check value");
    uint8_t buf[1100];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)rnd();
    for (int t = 0; t < 300; t++) {
        size_t off = rnd() % 16, n = rnd() % (sizeof buf - 16), cut = n ? rnd() % n : 0;
        uint32_t want = crc_ref(buf + off, n);
        CHECK(kt_crc32c(0, buf + off, n) == want, "crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c_portable(0, buf + off, n) == want, "table crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c(kt_crc32c(0, buf + off, cut), buf + off + cut, n - cut) == want,
              "chained crc split at %zu of %zu", cut, n);
    }
    /* lengths that take the three-stream paths (3 x 8 KiB and 3 x 256 bytes chunks) with every
     * kind of remainder, at odd offsets */
    enum { BIG = 3 * 3 * 8192 + 3 * 256 + 64 };
    uint8_t *big = malloc(BIG + 16);
    REQUIRE(big, "out of memory");
    for (size_t i = 0; i < BIG + 16; i++) big[i] = (uint8_t)rnd();
    const size_t sizes[] = {3 * 256, 3 * 256 + 7, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 3 * 256 + 9, 6 * 8192 + 100, BIG};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        size_t off = rnd() % 16, n = sizes[i];
        uint32_t want = crc_ref(big + off, n);
        CHECK(kt_crc32c(0, big + off, n) == want, "crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c_portable(0, big + off, n) == want, "table crc of %zu bytes at +%zu", n, off);
        CHECK(kt_crc32c(kt_crc32c(0, big + off, n / 3), big + off + n / 3, n - n / 3) == want,
              "chained crc of %zu bytes split at a third", n);
    }
    free(big);
}

static void test_conversions(void)
{
    /* every f16 and bf16 value survives a trip through f32 (NaNs stay NaN) */
    for (uint32_t x = 0; x < 65536; x++) {
        const uint16_t h = (uint16_t)x;
        float f = kt_f16_to_f32(h);
        if (f != f)
            CHECK(kt_f32_to_f16(f) == (h | 0x0200), "f16 NaN 0x%04x -> 0x%04x", h, kt_f32_to_f16(f));
        else
            CHECK(kt_f32_to_f16(f) == h, "f16 0x%04x -> %a -> 0x%04x", h, f, kt_f32_to_f16(f));
        float g = kt_bf16_to_f32(h);
        if (g != g)
            CHECK((kt_f32_to_bf16(g) & 0x7fff) > 0x7f80, "bf16 NaN 0x%04x", h);
        else
            CHECK(kt_f32_to_bf16(g) == h, "bf16 0x%04x -> %a -> 0x%04x", h, g, kt_f32_to_bf16(g));
    }
    /* hand-checked roundings: ties to even, overflow, subnormals, underflow */
    CHECK(kt_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00, "f16 tie down to even");
    CHECK(kt_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02, "f16 tie up to even");
    CHECK(kt_f32_to_f16(65504.0f) == 0x7bff, "f16 max");
    CHECK(kt_f32_to_f16(65519.0f) == 0x7bff, "f16 below the overflow tie");
    CHECK(kt_f32_to_f16(65520.0f) == 0x7c00, "f16 overflow tie goes to inf");
    CHECK(kt_f32_to_f16(-1e10f) == 0xfc00, "f16 -inf");
    CHECK(kt_f32_to_f16(0x1p-24f) == 0x0001, "f16 smallest subnormal");
    CHECK(kt_f32_to_f16(0x1p-25f) == 0x0000, "f16 tie to zero");
    CHECK(kt_f32_to_f16(0x1.8p-25f) == 0x0001, "f16 above the tie");
    CHECK(kt_f32_to_f16(3 * 0x1p-25f) == 0x0002, "f16 subnormal tie to even");
    CHECK(kt_f32_to_f16(-0.0f) == 0x8000, "f16 -0");
    CHECK(kt_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80, "bf16 tie down to even");
    CHECK(kt_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82, "bf16 tie up to even");
    CHECK(kt_f32_to_bf16(3.4e38f) == 0x7f80, "bf16 overflow to inf");
    /* random f32 bit patterns against the oracles */
    for (int t = 0; t < 200000; t++) {
        uint32_t b = (uint32_t)rnd();
        float f;
        memcpy(&f, &b, 4);
        if (f != f) continue;
        float got = kt_bf16_to_f32(kt_f32_to_bf16(f)), want = bf16_oracle(f);
        if (!(fabsf(f) >= 0x1.fefffep127f)) /* the oracle's hi candidate overflows here */
            CHECK(memcmp(&got, &want, 4) == 0, "bf16(%a) = %a, want %a", f, got, want);
#ifdef __FLT16_MAX__
        got = kt_f16_to_f32(kt_f32_to_f16(f));
        want = (float)(_Float16)f;
        CHECK(memcmp(&got, &want, 4) == 0, "f16(%a) = %a, want %a", f, got, want);
#endif
    }
}

/* ------------------------------------------------------------------ damage */

/* The base bundle every damage test starts from: 2 layers x 2 heads, head_dim 4, f32. */

static uint8_t *base_bundle(seqkv *s, uint64_t *size)
{
    seqkv_make(s, 2, 2, 4, KT_DTYPE_F32, BASE_COUNTS, 12, "full"); /* short: header is 192 */
    return encode(s, size);
}

static uint64_t sec_off(const uint8_t *b, int s) { return kt_rd64(b + 80 + 24 * s + 8); }
static uint64_t sec_len(const uint8_t *b, int s) { return kt_rd64(b + 80 + 24 * s + 16); }
/* Recomputes section s's checksum (from the table as it stands), then the header's. */
static void reseal(uint8_t *b, int s)
{
    kt_wr32(b + 80 + 24 * s + 4, kt_crc32c(0, b + sec_off(b, s), sec_len(b, s)));
    reseal_header(b);
}

static void test_damage(void)
{
    seqkv s;
    uint64_t n;
    uint8_t *good = base_bundle(&s, &n);
    uint8_t *b = malloc(n + 64);
    char err[KT_ERR_MAX];
#define FRESH() memcpy(b, good, n)

    FRESH();
    ACCEPT(b, n);
    /* the layout this test relies on: lists 160 bytes at 192, then a 32-byte gap */
    REQUIRE(kt_rd32(b + 12) == 192 && sec_off(b, SEC_LISTS) == 192 && sec_len(b, SEC_LISTS) == 160 &&
            sec_off(b, SEC_POS) == 384, "unexpected base layout");

    /* magic, version */
    FRESH(); b[3] ^= 0x20; REJECT(b, n, "bad magic");
    FRESH(); kt_wr16(b + 8, 3); reseal_header(b); REJECT(b, n, "version 3.0 is newer");
    FRESH(); kt_wr16(b + 8, 1); reseal_header(b); REJECT(b, n, "version 1.0 is older");
    FRESH(); kt_wr16(b + 10, 7); reseal_header(b); ACCEPT(b, n); /* newer minor: read */

    /* truncation at every offset, and trailing bytes */
    for (uint64_t cut = 0; cut < n; cut++) REJECT(good, cut, "truncated");
    REJECT(NULL, 0, "truncated");
    FRESH(); b[n] = 0; REJECT(b, n + 1, "trailing bytes");
    {
        char want[128];
        snprintf(want, sizeof want, "truncated: header says %llu bytes, got %llu",
                 (unsigned long long)n, (unsigned long long)(n / 2));
        REJECT(good, n / 2, want);
    }

    /* sizes in the fixed header */
    FRESH(); kt_wr64(b + 16, n + 64); reseal_header(b); REJECT(b, n, "header says");
    FRESH(); kt_wr64(b + 16, ~0ull); REJECT(b, n, "exceeds the");
    FRESH(); kt_wr32(b + 12, 256); reseal_header(b); REJECT(b, n, "header_size 256, expected 192");
    FRESH(); kt_wr16(b + 62, 5); reseal_header(b); REJECT(b, n, "n_sections 5 invalid");
    FRESH(); kt_wr16(b + 62, 3); reseal_header(b); REJECT(b, n, "n_sections 3 invalid");
    FRESH(); kt_wr16(b + 76, 0); reseal_header(b); REJECT(b, n, "policy_len 0");
    FRESH(); kt_wr16(b + 76, 2000); reseal_header(b); REJECT(b, n, "policy_len 2000");
    FRESH(); kt_wr16(b + 76, 40); reseal_header(b); REJECT(b, n, "header_size 192, expected 256");

    /* header checksum, flags, reserved */
    FRESH(); b[40] ^= 1; REJECT(b, n, "header checksum mismatch (expected 0x");
    FRESH(); b[28] ^= 1; REJECT(b, n, "header checksum mismatch");
    FRESH(); kt_wr32(b + 24, 1); reseal_header(b); REJECT(b, n, "segments are 2.2"); /* 2.0 */
    FRESH(); kt_wr32(b + 24, 2); reseal_header(b); REJECT(b, n, "unknown required flags 0x0002");
    FRESH(); kt_wr32(b + 24, 0x10000); reseal_header(b); ACCEPT(b, n); /* optional bit: ignored */
    FRESH(); kt_wr16(b + 78, 1); reseal_header(b); REJECT(b, n, "reserved header field");

    /* every header field against its bounds */
    FRESH(); b[32] = 'A'; reseal_header(b); REJECT(b, n, "fingerprint byte 0 is 0x41");
    FRESH(); b[47] = 0; reseal_header(b); REJECT(b, n, "fingerprint byte 15");
    FRESH(); kt_wr32(b + 48, 0); reseal_header(b); REJECT(b, n, "n_layers 0 out of range");
    FRESH(); kt_wr32(b + 48, 0x7fffffff); reseal_header(b); REJECT(b, n, "n_layers 2147483647 out of range");
    FRESH(); kt_wr32(b + 48, 1); reseal_header(b); REJECT(b, n, "section lists is 160 bytes, expected 80");
    FRESH(); kt_wr32(b + 52, 0); reseal_header(b); REJECT(b, n, "n_kv_heads 0 out of range");
    FRESH(); kt_wr32(b + 52, 5000); reseal_header(b); REJECT(b, n, "n_kv_heads 5000 out of range");
    FRESH(); kt_wr32(b + 56, 0); reseal_header(b); REJECT(b, n, "head_dim 0 out of range");
    FRESH(); kt_wr32(b + 56, 1u << 20); reseal_header(b); REJECT(b, n, "head_dim 1048576 out of range");
    FRESH(); kt_wr32(b + 56, 8); reseal_header(b); REJECT(b, n, "section K is 160 bytes, but the counts say 320");
    FRESH(); kt_wr16(b + 60, 16); reseal_header(b); REJECT(b, n, "payload dtype int8+scale needs its K and V scale sections: 4 sections in version 2.0");
    FRESH(); kt_wr16(b + 60, 17); reseal_header(b); REJECT(b, n, "payload dtype fp8_e4m3+scale needs its K and V scale sections");
    FRESH(); kt_wr16(b + 60, 9); reseal_header(b); REJECT(b, n, "unknown payload dtype 9");
    FRESH(); kt_wr16(b + 60, 2); reseal_header(b); REJECT(b, n, "section K is 160 bytes, but the counts say 80");
    FRESH(); kt_wr32(b + 64, (uint32_t)-1); reseal_header(b); REJECT(b, n, "first_token -1 is negative");
    FRESH(); kt_wr32(b + 68, 0); reseal_header(b); REJECT(b, n, "prompt_len 0 is below 1");
    FRESH(); kt_wr32(b + 72, (uint32_t)-5); reseal_header(b); REJECT(b, n, "next_pos -5 is negative");
    FRESH(); kt_wr32(b + 72, 4); reseal_header(b); REJECT(b, n, "count 5 exceeds next_pos 4");
    {   /* the largest position is 11 at most; a next_pos just above the count but at or
           below some position is caught by the positions walk */
        int32_t maxp = s.pos[3][4];
        FRESH(); kt_wr32(b + 72, (uint32_t)maxp); reseal_header(b);
        REJECT(b, n, "positions must increase strictly and stay in [0, next_pos)");
    }
    const uint64_t pol = 80 + 4 * 24;
    FRESH(); b[pol + 2] = 0xff; reseal_header(b); REJECT(b, n, "policy spec is not UTF-8");
    FRESH(); b[pol + 2] = 0; reseal_header(b); REJECT(b, n, "policy spec is not UTF-8 without NUL (bad byte at offset 2)");
    FRESH(); b[pol + 1] = 0xc0; b[pol + 2] = 0xaf; reseal_header(b); REJECT(b, n, "not UTF-8"); /* overlong '/' */
    FRESH(); b[190] = 1; reseal_header(b); REJECT(b, n, "padding byte at offset 190 (header padding)");

    /* the section table: ids, offsets, lengths */
    FRESH(); kt_wr32(b + 80 + 24 * SEC_K, 9); reseal_header(b); REJECT(b, n, "entry 2 has id 9, expected 3 (K)");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_V + 8, n + 64); reseal_header(b); REJECT(b, n, "section V [");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_V + 16, 0x7fffffffffffffffull); reseal_header(b); REJECT(b, n, "lies outside the");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_K + 8, sec_off(b, SEC_POS)); reseal_header(b); REJECT(b, n, "section K starts at");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_LISTS + 8, 100); reseal_header(b); REJECT(b, n, "before the end of the header");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_POS + 8, 388); reseal_header(b); REJECT(b, n, "section positions at offset 388, expected 384");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_V + 16, sec_len(b, SEC_V) - 4); reseal_header(b); REJECT(b, n, "4 bytes after the last section");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_LISTS + 16, 136); reseal_header(b); REJECT(b, n, "section lists is 136 bytes, expected 160");
    FRESH(); kt_wr64(b + 80 + 24 * SEC_POS + 16, 36); reseal_header(b); REJECT(b, n, "section positions is 36 bytes, but the counts say 40");
    FRESH(); b[364] = 7; REJECT(b, n, "padding byte at offset 364 (between sections)");

    /* every checksum */
    FRESH(); b[sec_off(b, SEC_LISTS) + 9] ^= 1; REJECT(b, n, "section lists checksum mismatch (expected 0x");
    FRESH(); b[sec_off(b, SEC_POS) + 1] ^= 1; REJECT(b, n, "section positions checksum mismatch");
    FRESH(); b[sec_off(b, SEC_K) + 17] ^= 0x80; REJECT(b, n, "section K checksum mismatch (expected 0x");
    FRESH(); b[n - 1] ^= 0x01; REJECT(b, n, "section V checksum mismatch");
    {   /* the message carries both values */
        FRESH(); b[sec_off(b, SEC_K)] ^= 1;
        char want[96];
        snprintf(want, sizeof want, "section K checksum mismatch (expected 0x%08x, got 0x%08x)",
                 kt_rd32(b + 80 + 24 * SEC_K + 4), kt_crc32c(0, b + sec_off(b, SEC_K), sec_len(b, SEC_K)));
        REJECT(b, n, want);
    }

    /* lies in the list table (resealed: a lying sender computes valid checksums) */
    const uint64_t lt = sec_off(good, SEC_LISTS);
#define LIST(i, f) (b + lt + 40 * (i) + (f))
    FRESH(); kt_wr32(LIST(0, 8), 4); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 1) starts at entry 3, expected 4");
    FRESH(); kt_wr32(LIST(3, 8), 6); reseal(b, SEC_LISTS); REJECT(b, n, "section positions is 40 bytes, but the counts say 44");
    FRESH(); kt_wr64(LIST(2, 0), 2); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 1, head 0) starts at entry 2, expected 3");
    FRESH(); kt_wr32(LIST(0, 12), 4); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 0) pinned 4 exceeds its count 3");
    FRESH(); kt_wr32(LIST(1, 12), 1); reseal(b, SEC_LISTS); REJECT(b, n, "pinned 1 exceeds its count 0");
    FRESH(); kt_wr32(LIST(2, 16), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "window 2147483648 is above");
    FRESH(); kt_wr32(LIST(3, 16), KT_BUNDLE_WINDOW_DENSE); reseal(b, SEC_LISTS); ACCEPT(b, n);
    FRESH(); kt_wr32(LIST(1, 20), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 1) sink 2147483648 is above");
    FRESH(); kt_wr32(LIST(1, 28), 0xffffffffu); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 0, head 1) slack 4294967295 is above");
    FRESH(); kt_wr32(LIST(1, 32), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "max_drop 2147483648 is above");
    FRESH(); kt_wr32(LIST(2, 24), 0); reseal(b, SEC_LISTS); ACCEPT(b, n); /* lazy 0: never prunes */
    FRESH(); kt_wr32(LIST(2, 24), 0x80000000u); reseal(b, SEC_LISTS); REJECT(b, n, "lazy 2147483648 is above");
    FRESH(); kt_wr32(LIST(3, 36), 2); reseal(b, SEC_LISTS); REJECT(b, n, "list (layer 1, head 1) has unknown flags 0x00000002");
    FRESH(); kt_wr32(LIST(3, 36), 0); reseal(b, SEC_LISTS); ACCEPT(b, n);
    /* overflow-inducing counts: the sum and the row product are computed in checked arithmetic */
    FRESH();
    kt_wr32(b + 72, 0x7fffffff);
    for (int i = 0; i < 4; i++) {
        kt_wr64(LIST(i, 0), (uint64_t)i * 0x7fffffff);
        kt_wr32(LIST(i, 8), 0x7fffffff);
        kt_wr32(LIST(i, 12), 0);
    }
    reseal(b, SEC_LISTS);
    REJECT(b, n, "bundle of 309237645568 bytes exceeds the 274877906944-byte limit");
    FRESH();
    kt_wr32(b + 72, 0x7fffffff);
    for (int i = 0; i < 4; i++) {
        kt_wr64(LIST(i, 0), i ? 0x7fffffff : 0);
        kt_wr32(LIST(i, 8), i ? 0 : 0x7fffffff);
        kt_wr32(LIST(i, 12), 0);
    }
    reseal(b, SEC_LISTS);
    REJECT(b, n, "section positions is 40 bytes, but the counts say 8589934588");
    FRESH(); kt_wr32(b + 72, 0x7fffffff); kt_wr32(LIST(0, 8), 0x7fffffff); reseal(b, SEC_LISTS);
    REJECT(b, n, "list (layer 0, head 1) starts at entry 3, expected 2147483647");
    FRESH(); kt_wr32(LIST(0, 8), 0xffffffffu); reseal(b, SEC_LISTS); REJECT(b, n, "count 4294967295 exceeds next_pos 12");

    /* positions (resealed) */
    const uint64_t pt = sec_off(good, SEC_POS);
    FRESH(); kt_wr32(b + pt + 4, kt_rd32(b + pt)); reseal(b, SEC_POS);
    REJECT(b, n, "list (layer 0, head 0) entry 1 has position");
    FRESH(); kt_wr32(b + pt + 8, 0); reseal(b, SEC_POS); REJECT(b, n, "entry 2 has position 0");
    FRESH(); kt_wr32(b + pt, (uint32_t)-3); reseal(b, SEC_POS); REJECT(b, n, "entry 0 has position -3 (previous -1");
    FRESH(); kt_wr32(b + pt + 36, 12); reseal(b, SEC_POS); REJECT(b, n, "list (layer 1, head 1) entry 4 has position 12");
    {   /* positions restart per list: list (1,0) may begin below where (0,0) ended */
        FRESH(); kt_wr32(b + pt + 12, 0); kt_wr32(b + pt + 16, 1); reseal(b, SEC_POS); ACCEPT(b, n);
    }
#undef LIST
    free(b);
    free(good);
    seqkv_free(&s);
    (void)err;
#undef FRESH
}

/* A 2.1 bundle as a newer sender might write it: an optional flag bit and a fifth section
 * after V. A 2.0 reader checks the extra section's checksum and placement and ignores it. */
static void test_newer_minor(void)
{
    seqkv s;
    uint64_t n;
    uint8_t *good = base_bundle(&s, &n);
    /* 5 table entries + "full" = 204 bytes: the header grows from 192 to 256, every section
     * moves by 64, and the extra section of 8 bytes starts on the boundary after V */
    const uint64_t v_end = sec_off(good, SEC_V) + sec_len(good, SEC_V) + 64;
    const uint64_t x_off = (v_end + 63) / 64 * 64, m = x_off + 8;
    uint8_t *b = calloc(1, m);
    memcpy(b, good, 80 + 4 * 24);
    memcpy(b + 80 + 5 * 24, good + 80 + 4 * 24, 4); /* the policy */
    memcpy(b + 256, good + 192, n - 192);
    for (int i = 0; i < 4; i++) kt_wr64(b + 80 + 24 * i + 8, sec_off(good, i) + 64);
    kt_wr32(b + 80 + 4 * 24, 5);
    kt_wr64(b + 80 + 4 * 24 + 8, x_off);
    kt_wr64(b + 80 + 4 * 24 + 16, 8);
    memcpy(b + x_off, "future!!", 8);
    kt_wr16(b + 10, 1);
    kt_wr16(b + 62, 5);
    kt_wr32(b + 12, 256);
    kt_wr64(b + 16, m);
    kt_wr32(b + 24, 1u << 20);
    reseal(b, 4);
    ACCEPT(b, m);
    char err[KT_ERR_MAX];
    kt_bundle_view v;
    if (kt_bundle_parse(b, m, &v, err) == 0) {
        CHECK(v.version_minor == 1 && v.flags == 1u << 20, "version/flags");
        CHECK(v.n_entries == 10, "entries");
    }
    b[x_off + 3] ^= 1;
    REJECT(b, m, "section extra checksum mismatch");
    b[x_off + 3] ^= 1;
    kt_wr16(b + 10, 0);
    reseal_header(b);
    REJECT(b, m, "n_sections 5 invalid for version 2.0");
    free(b);
    free(good);
    seqkv_free(&s);
}

/* ------------------------------------------------------------------ writer misuse, sizes */

static void test_writer(void)
{
    char err[KT_ERR_MAX];
    seqkv s;
    seqkv_make(&s, 2, 2, 4, KT_DTYPE_BF16, BASE_COUNTS, 12, "full");
    uint64_t size;
    REQUIRE(kt_bundle_size(&s.h, s.lists, &size, err) == 0, "%s", err);
    uint8_t *buf = malloc(size);
    kt_bundle_writer w;
    uint64_t got;

    CHECK(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size - 1, err) == -1, "short buffer");
    CHECK_ERR_HAS(err, "too small");
    CHECK(kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){1, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0]},
                               err) == -1,
          "put after failed begin");
    CHECK_ERR_HAS(err, "not open");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 1, 0, &(kt_rows_in){1, s.pos[2], KT_DTYPE_F32, s.k[2], s.v[2]},
                               err) == -1,
          "skipped a non-empty list");
    CHECK_ERR_HAS(err, "list (layer 0, head 0) got 0 of its 3 entries");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){4, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0]},
                               err) == -1,
          "too many entries");
    CHECK_ERR_HAS(err, "put of 4 entries to list (layer 0, head 0) which has 3 of 3 left");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    int32_t dup[2] = {s.pos[0][0], s.pos[0][0]};
    CHECK(kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){2, dup, KT_DTYPE_F32, s.k[0], s.v[0]},
                               err) == -1,
          "repeated position");
    CHECK_ERR_HAS(err, "positions must increase strictly");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(
              &w, 0, 0, &(kt_rows_in){1, s.pos[0], KT_DTYPE_INT8_TOKEN, s.k[0], s.v[0]}, err) == -1,
          "int8 source");
    CHECK_ERR_HAS(err, "source dtype int8+scale: rows are put as f32, f16 or bf16");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 2, 0, &(kt_rows_in){1, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0]},
                               err) == -1,
          "layer out of range");
    CHECK_ERR_HAS(err, "outside 2 layers x 2 heads");

    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    REQUIRE(kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){3, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0]},
                                 err) == 0,
            "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){0, NULL, KT_DTYPE_F32, NULL, NULL}, err) ==
              0,
          "empty put: %s", err);
    REQUIRE(kt_bundle_writer_put(&w, 1, 0, &(kt_rows_in){2, s.pos[2], KT_DTYPE_F32, s.k[2], s.v[2]},
                                 err) == 0,
            "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 1, &(kt_rows_in){0, NULL, KT_DTYPE_F32, NULL, NULL}, err) ==
              -1,
          "going back");
    CHECK_ERR_HAS(err, "after a later list");
    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    REQUIRE(kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){3, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0]},
                                 err) == 0,
            "%s", err);
    REQUIRE(kt_bundle_writer_put(&w, 1, 0, &(kt_rows_in){2, s.pos[2], KT_DTYPE_F32, s.k[2], s.v[2]},
                                 err) == 0,
            "%s", err);
    CHECK(kt_bundle_writer_finish(&w, &got, err) == -1, "finish with a list short");
    CHECK_ERR_HAS(err, "list (layer 1, head 1) got 0 of its 5 entries");
    CHECK(kt_bundle_writer_finish(&w, &got, err) == -1, "finish twice");

    /* source rows already in the payload dtype are copied as they are: the no-conversion
     * path a GPU producing bf16 would use */
    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    for (uint32_t i = 0; i < 4; i++) {
        const uint32_t c = s.lists[i].count;
        uint16_t *kb = malloc((c * 4 + 1) * 2);
        for (uint32_t e = 0; e < c * 4; e++) kb[e] = kt_f32_to_bf16(s.k[i][e]);
        REQUIRE(kt_bundle_writer_put(&w, i / 2, i % 2,
                                     &(kt_rows_in){c, s.pos[i], KT_DTYPE_BF16, kb, kb}, err) == 0,
                "%s", err);
        free(kb);
    }
    REQUIRE(kt_bundle_writer_finish(&w, &got, err) == 0, "%s", err);
    kt_bundle_view v;
    REQUIRE(kt_bundle_parse(buf, got, &v, err) == 0, "%s", err);
    kt_bundle_list_view lv;
    REQUIRE(kt_bundle_view_list(&v, 1, 1, &lv, err) == 0, "%s", err);
    float k[20];
    REQUIRE(kt_bundle_list_read(&v, &lv, 0, &(kt_rows){5, NULL, KT_DTYPE_F32, k, NULL}, err) == 0,
            "%s", err);
    for (int e = 0; e < 20; e++)
        CHECK(k[e] == bf16_oracle(s.k[3][e]), "bf16 copy elem %d", e);

    /* invalid headers are refused by the writer too, with the parser's words */
    kt_bundle_header h = s.h;
    h.head_dim = 0;
    CHECK(kt_bundle_writer_begin(&w, &h, s.lists, buf, size, err) == -1, "head_dim 0");
    CHECK_ERR_HAS(err, "head_dim 0 out of range");
    h = s.h;
    h.dtype = (kt_dtype)3;
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == -1, "dtype 3");
    CHECK_ERR_HAS(err, "unknown payload dtype 3");
    h = s.h;
    h.policy[0] = '\0';
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == -1, "empty policy");
    CHECK_ERR_HAS(err, "policy spec is empty");
    h = s.h;
    memset(h.policy, 'x', KT_BUNDLE_MAX_POLICY);
    h.policy[KT_BUNDLE_MAX_POLICY] = '\0';
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == 0, "longest policy: %s", err);
    h = s.h;
    h.fingerprint[3] = 'G';
    CHECK(kt_bundle_size(&h, s.lists, &got, err) == -1, "bad fingerprint");
    CHECK_ERR_HAS(err, "fingerprint byte 3");
    kt_bundle_list bad[4];
    memcpy(bad, s.lists, sizeof bad);
    bad[2].pinned = 3;
    CHECK(kt_bundle_size(&s.h, bad, &got, err) == -1, "pinned > count");
    CHECK_ERR_HAS(err, "list (layer 1, head 0) pinned 3 exceeds its count 2");

    /* size arithmetic at the bounds: the largest shape with every list full does not wrap,
     * it is refused against the limit */
    kt_bundle_header big;
    header_init(&big, KT_BUNDLE_MAX_LAYERS, KT_BUNDLE_MAX_KV_HEADS, KT_BUNDLE_MAX_HEAD_DIM,
                KT_DTYPE_F32, 0x7fffffff, "full");
    const size_t nb = (size_t)KT_BUNDLE_MAX_LAYERS * KT_BUNDLE_MAX_KV_HEADS;
    kt_bundle_list *many = malloc(nb * sizeof *many);
    for (size_t i = 0; i < nb; i++)
        many[i] = (kt_bundle_list){.count = 0x7fffffff, .window = KT_BUNDLE_WINDOW_DENSE};
    CHECK(kt_bundle_size(&big, many, &got, err) == -1, "huge bundle accepted");
    CHECK_ERR_HAS(err, "exceed the 274877906944-byte bundle limit");
    for (size_t i = 0; i < nb; i++) many[i].count = i == 0 ? 1000 : 0;
    CHECK(kt_bundle_size(&big, many, &got, err) == 0, "%s", err);
    /* header 192 + lists 40 MiB + positions 4000 (+pad) + 2 x 1000 rows of 16 KiB */
    const uint64_t lists_end = 192 + nb * 40, pos_at = (lists_end + 63) / 64 * 64,
                   k_at = (pos_at + 4000 + 63) / 64 * 64, kv = 1000ull * 4096 * 4;
    CHECK(got == k_at + kv + kv, "size %llu, want %llu", (unsigned long long)got,
          (unsigned long long)(k_at + 2 * kv));
    free(many);

    free(buf);
    seqkv_free(&s);
}

/* ------------------------------------------------------------------ quantized payloads */

/* The value of E4M3 code c by the format's definition (bias 7, 3 mantissa bits, subnormals
 * below 2^-6), not by the library's decoder; NaN for 0x7f and 0xff. */
static double fp8_value(unsigned c)
{
    const unsigned e = (c >> 3) & 15, m = c & 7;
    if ((c & 0x7f) == 0x7f) return NAN;
    const double mag = e == 0 ? m * 0x1p-9 : ldexp(8 + m, (int)e - 10);
    return c & 0x80 ? -mag : mag;
}

/* The code nearest to x among the 254 finite ones, ties to the even mantissa, |x| > 448 saturating:
 * a brute-force oracle for kt_f32_to_fp8_e4m3. */
static unsigned fp8_nearest(float x)
{
    unsigned best = 0;
    double best_d = INFINITY;
    for (unsigned c = 0; c < 256; c++) {
        const double v = fp8_value(c);
        if (isnan(v) || (v == 0 && !signbit(v) != !signbit(x))) continue;
        if ((v < 0) != (x < 0) && v != 0) continue;
        const double d = fabs(v - (double)x);
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best = c;
            best_d = d;
        }
    }
    return best;
}

static void test_fp8(void)
{
    int bad = 0;
    for (unsigned c = 0; c < 256 && bad < 5; c++) {
        const double want = fp8_value(c);
        const float got = kt_fp8_e4m3_to_f32((uint8_t)c);
        if (isnan(want) ? !isnan(got) : (double)got != want || !signbit(got) != !signbit(want)) {
            bad++;
            CHECK(0, "fp8 code 0x%02x decodes to %a, want %a", c, got, want);
        }
        if (!isnan(want) && kt_f32_to_fp8_e4m3((float)want) != c) {
            bad++;
            CHECK(0, "fp8 %a encodes to 0x%02x, want 0x%02x", want, kt_f32_to_fp8_e4m3((float)want), c);
        }
    }
    /* every value between codes, at random magnitudes, ties included (midpoints) */
    for (int i = 0; i < 20000 && bad < 5; i++) {
        float x;
        if (i < 254 * 2) { /* the midpoints between neighbouring positive codes, and their negatives */
            const unsigned c = (unsigned)(i / 2) % 126;
            x = (float)((fp8_value(c) + fp8_value(c + 1)) / 2);
            if (i % 2) x = -x;
        } else {
            x = (float)ldexp(rndf(), (int)(rnd() % 24) - 14);
        }
        const unsigned want = fp8_nearest(x), got = kt_f32_to_fp8_e4m3(x);
        if (got != want) {
            bad++;
            CHECK(0, "fp8 of %a is 0x%02x, want 0x%02x", x, got, want);
        }
    }
    CHECK(kt_f32_to_fp8_e4m3(1000.0f) == 0x7e && kt_f32_to_fp8_e4m3(-INFINITY) == 0xfe, "saturation");
    CHECK(kt_f32_to_fp8_e4m3(NAN) == 0x7f, "NaN");
}

/* Rows a KV cache can hold that random data misses: zeros, one outlier next to tiny values,
 * values in fp8's subnormal range after scaling; and a non-finite element, refused. */
static void test_quantized_rows(kt_dtype t)
{
    char err[KT_ERR_MAX];
    enum { DIM = 8 };
    static const uint32_t counts[1] = {4};
    seqkv s;
    seqkv_make(&s, 1, 1, DIM, t, counts, 8, "full");
    const float rows[4][DIM] = {
        {0, 0, 0, 0, 0, 0, 0, 0},
        {1000.0f, 1e-3f, -1e-3f, 0.5f, -0.25f, 3.0f, 1e-6f, -700.0f},
        {1e-30f, -2e-30f, 3e-31f, 0, 1e-30f, -1e-30f, 5e-31f, 4e-30f},
        {-1, 1, -1, 1, 0.999f, -0.999f, 0.5f, 0},
    };
    memcpy(s.k[0], rows, sizeof rows);
    for (int e = 0; e < 4 * DIM; e++) s.v[0][e] = -s.k[0][e];
    uint64_t size;
    uint8_t *buf = encode(&s, &size);
    kt_bundle_view v;
    REQUIRE(kt_bundle_parse(buf, size, &v, err) == 0, "%s", err);
    kt_bundle_list_view lv;
    REQUIRE(kt_bundle_view_list(&v, 0, 0, &lv, err) == 0, "%s", err);
    float k[4 * DIM], vv[4 * DIM];
    REQUIRE(kt_bundle_list_read(&v, &lv, 0, &(kt_rows){4, NULL, KT_DTYPE_F32, k, vv}, err) == 0,
            "%s", err);
    for (int e = 0; e < 4 * DIM; e++) {
        CHECK(quant_within_bound(t, rows[e / DIM], DIM, rows[e / DIM][e % DIM], k[e]), "%s row %d elem %d: %a from %a",
              kt_dtype_name(t), e / DIM, e % DIM, k[e], rows[e / DIM][e % DIM]);
        CHECK(vv[e] == -k[e], "%s: V is not K negated at %d", kt_dtype_name(t), e);
    }
    for (int e = 0; e < DIM; e++) CHECK(k[e] == 0, "zero row came back as %a", k[e]);
    CHECK(k[DIM] == 1000.0f, "%s: a row's largest element is exact, got %a", kt_dtype_name(t), k[DIM]);

    /* damage only a quantized bundle can have, resealed so the rule itself is what refuses it */
    uint8_t *b = malloc(size);
    const float nan = NAN;
    memcpy(b, buf, size);
    memcpy(b + sec_off(b, 4) + 4, &nan, 4);
    reseal(b, 4);
    REJECT(b, size, "K scale of entry 1 is nan");
    memcpy(b, buf, size);
    const float neg = -1.0f;
    memcpy(b + sec_off(b, 5) + 8, &neg, 4);
    reseal(b, 5);
    REJECT(b, size, "V scale of entry 2 is -1: scales lie in [0, ");
    if (t == KT_DTYPE_FP8_E4M3_TOKEN) {
        memcpy(b, buf, size);
        b[sec_off(b, SEC_K) + 3] = 0xff;
        reseal(b, SEC_K);
        REJECT(b, size, "K element 3 is the fp8 NaN code 0xff");
    }
    memcpy(b, buf, size);
    kt_wr16(b + 10, 0);
    reseal_header(b);
    REJECT(b, size, "n_sections 6 invalid for version 2.0");
    memcpy(b, buf, size);
    b[sec_off(b, 5) + 1] ^= 4;
    REJECT(b, size, "section V scales checksum mismatch");
    free(b);
    free(buf);

    /* a NaN or infinity cannot be quantized: the put fails and says which row */
    s.k[0][DIM + 3] = INFINITY;
    REQUIRE(kt_bundle_size(&s.h, s.lists, &size, err) == 0, "%s", err);
    buf = malloc(size);
    kt_bundle_writer w;
    REQUIRE(kt_bundle_writer_begin(&w, &s.h, s.lists, buf, size, err) == 0, "%s", err);
    CHECK(kt_bundle_writer_put(&w, 0, 0, &(kt_rows_in){4, s.pos[0], KT_DTYPE_F32, s.k[0], s.v[0]},
                               err) == -1,
          "%s quantized an infinity", kt_dtype_name(t));
    CHECK_ERR_HAS(err, "K row 1 element 3 is inf: a quantized payload takes finite values only");
    free(buf);
    seqkv_free(&s);
}

static void test_quantized(void)
{
    test_fp8();
    static const uint32_t gqa[6] = {17, 17, 3, 30, 0, 1};
    for (int q = 0; q < 2; q++) {
        const kt_dtype t = q ? KT_DTYPE_FP8_E4M3_TOKEN : KT_DTYPE_INT8_TOKEN;
        CHECK(round_trip(3, 2, 64, t, gqa, 64), "gqa %s", kt_dtype_name(t));
        CHECK(round_trip(3, 2, 5, t, gqa, 31), "odd head_dim %s", kt_dtype_name(t));
        test_quantized_rows(t);
        /* bytes per row: head_dim + a 4-byte scale, against 4 * head_dim for f32 */
        CHECK(kt_dtype_row_bytes(t, 128) == 132 && kt_dtype_row_bytes(KT_DTYPE_F32, 128) == 512,
              "row bytes");
    }
    /* a 2.1 bundle that claims a quantized dtype but lacks the scale sections */
    seqkv s;
    uint64_t n;
    uint8_t *b = base_bundle(&s, &n);
    kt_wr16(b + 10, 1);
    kt_wr16(b + 60, KT_DTYPE_INT8_TOKEN);
    reseal_header(b);
    REJECT(b, n, "payload dtype int8+scale needs its K and V scale sections: 4 sections in version 2.1");
    free(b);
    seqkv_free(&s);
    kt_dtype t;
    CHECK(kt_dtype_parse("int8", &t) == 0 && t == KT_DTYPE_INT8_TOKEN, "parse int8");
    CHECK(kt_dtype_parse("fp8", &t) == 0 && t == KT_DTYPE_FP8_E4M3_TOKEN, "parse fp8");
    CHECK(kt_dtype_parse("bf16", &t) == 0 && t == KT_DTYPE_BF16, "parse bf16");
    CHECK(kt_dtype_parse("int4", &t) == -1 && kt_dtype_parse(NULL, &t) == -1, "parse junk");
}

static void test_check_model(void)
{
    char err[KT_ERR_MAX];
    seqkv s;
    uint64_t n;
    uint8_t *b = base_bundle(&s, &n);
    kt_bundle_view v;
    REQUIRE(kt_bundle_parse(b, n, &v, err) == 0, "%s", err);
    CHECK(kt_bundle_check_model(&v.hdr, "0123456789abcdef", 2, 2, 4, err) == 0, "%s", err);
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 2, 2, 4, err) == 0, "%s", err);
    CHECK(kt_bundle_check_model(&v.hdr, "fedcba9876543210", 2, 2, 4, err) == -1, "fingerprint");
    CHECK_ERR_HAS(err, "bundle: model fingerprint 0123456789abcdef does not match this node's fedcba9876543210");
    CHECK_ERR_HAS(err, "HINT");
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 3, 2, 4, err) == -1, "layers");
    CHECK_ERR_HAS(err, "n_layers 2 does not match this node's model (3)");
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 2, 8, 4, err) == -1, "heads");
    CHECK_ERR_HAS(err, "n_kv_heads 2 does not match this node's model (8)");
    CHECK(kt_bundle_check_model(&v.hdr, NULL, 2, 2, 128, err) == -1, "head_dim");
    CHECK_ERR_HAS(err, "head_dim 4 does not match this node's model (128)");
    free(b);
    seqkv_free(&s);
}

/* ------------------------------------------------------------------ fuzz seeds */

/* first_layer >= 0: a layer segment starting there (format 2.2); -1: a whole bundle.
 * block_rows: 0, or block-padded (format 2.3). */
static void write_seed_padded(const char *dir, const char *name, uint32_t layers, uint32_t heads,
                              uint32_t dim, kt_dtype dtype, const uint32_t *counts, int32_t next_pos,
                              const char *policy, int first_layer, uint32_t block_rows)
{
    seqkv s;
    seqkv_make(&s, layers, heads, dim, dtype, counts, next_pos, policy);
    s.h.block_rows = block_rows;
    s.h.segment = first_layer >= 0;
    s.h.first_layer = first_layer >= 0 ? (uint32_t)first_layer : 0;
    uint64_t n;
    uint8_t *b = encode(&s, &n);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    REQUIRE(f && fwrite(b, 1, n, f) == n && fclose(f) == 0, "cannot write %s", path);
    printf("wrote %s (%llu bytes)\n", path, (unsigned long long)n);
    free(b);
    seqkv_free(&s);
}

static void write_seed(const char *dir, const char *name, uint32_t layers, uint32_t heads,
                       uint32_t dim, kt_dtype dtype, const uint32_t *counts, int32_t next_pos,
                       const char *policy, int first_layer)
{
    write_seed_padded(dir, name, layers, heads, dim, dtype, counts, next_pos, policy, first_layer, 0);
}

static void write_seeds(const char *dir)
{
    static const uint32_t c1[1] = {0}, c4[4] = {3, 0, 2, 5}, c6[6] = {4, 4, 1, 0, 6, 2},
                          c8[8] = {2, 1, 1, 2, 3, 0, 1, 2};
    write_seed(dir, "empty-1x1-f32", 1, 1, 2, KT_DTYPE_F32, c1, 1, "full", -1);
    write_seed(dir, "gqa-2x2-f32", 2, 2, 4, KT_DTYPE_F32, c4, 12, "streaming:sink=4,window=16", -1);
    write_seed(dir, "mha-3x2-bf16", 3, 2, 8, KT_DTYPE_BF16, c6, 9, "snapkv:budget=8,window=4", -1);
    write_seed(dir, "gqa-2x4-f16", 2, 4, 6, KT_DTYPE_F16, c8, 5, "sage:budget=6,pos=rel", -1);
    write_seed(dir, "gqa-2x2-int8", 2, 2, 4, KT_DTYPE_INT8_TOKEN, c4, 12, "snapkv:budget=8,window=4", -1);
    write_seed(dir, "segment-2x2-f32", 2, 2, 4, KT_DTYPE_F32, c4, 12, "full", 3);
    write_seed(dir, "segment-3x2-int8", 3, 2, 8, KT_DTYPE_INT8_TOKEN, c6, 9, "full", 0);
    write_seed(dir, "mha-3x2-fp8", 3, 2, 8, KT_DTYPE_FP8_E4M3_TOKEN, c6, 9, "streaming:sink=4,window=16", -1);
    /* block-padded (2.3): rows of 16 bytes padded to 4, so K and V split; a bf16 segment; int8 */
    write_seed_padded(dir, "padded-2x2-f32", 2, 2, 4, KT_DTYPE_F32, c4, 12, "full", -1, 4);
    write_seed_padded(dir, "padded-segment-3x2-bf16", 3, 2, 8, KT_DTYPE_BF16, c6, 9, "full", 1, 4);
    write_seed_padded(dir, "padded-2x2-int8", 2, 2, 4, KT_DTYPE_INT8_TOKEN, c4, 12, "full", -1, 3);
}

int main(void)
{
    const char *seeds = kt_env("KT_BUNDLE_SEEDS");
    if (seeds) write_seeds(seeds);

    test_crc();
    test_conversions();

    /* round trips: MHA and GQA shapes, empty lists, all three dtypes */
    CHECK(round_trip(2, 4, 8, KT_DTYPE_F32, SHAPE_MHA, 40), "mha f32");
    CHECK(round_trip(2, 4, 8, KT_DTYPE_BF16, SHAPE_MHA, 40), "mha bf16");
    CHECK(round_trip(2, 4, 8, KT_DTYPE_F16, SHAPE_MHA, 40), "mha f16");
    CHECK(round_trip(3, 2, 64, KT_DTYPE_BF16, SHAPE_GQA, 64), "gqa bf16");
    CHECK(round_trip(3, 2, 64, KT_DTYPE_F16, SHAPE_GQA, 64), "gqa f16");
    CHECK(round_trip(3, 2, 5, KT_DTYPE_F32, SHAPE_GQA, 31), "odd head_dim f32");
    CHECK(round_trip(1, 4, 16, KT_DTYPE_F16, SHAPE_EMPTY, 1), "all lists empty");
    uint32_t wide[8 * 8];
    for (int i = 0; i < 64; i++) wide[i] = (uint32_t)(rnd() % 50);
    CHECK(round_trip(8, 8, 128, KT_DTYPE_BF16, wide, 300), "8x8x128 bf16");

    test_damage();
    test_newer_minor();
    test_writer();
    test_check_model();
    test_quantized();
    return kt_done("test_bundle");
}
