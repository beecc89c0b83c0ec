/*
 * bundle.c - the KV bundle codec of bundle.h: layout, writer, validating parser (whole, or in
 * two steps: head, then K and V wherever they landed; one code path for both), the f32 <->
 * f16/bf16/fp8 element conversions, the per-row int8/fp8 quantization and CRC32C. Assembling
 * the parts of a transfer into a set: bundle-set.c. The format is
 * specified in docs/bundle.md; the constants below are the ones that document names.
 * What it is not: a transport, or a user of engine/ (plain C data only).
 * Header fields are read and written byte by byte (little-endian on the wire whatever the
 * host); payload rows and positions are copied with memcpy, which is why the build refuses a
 * big-endian host below instead of silently byte-swapping a gigabyte per request.
 * Run: ctest -R bundle (tests/unit/test_bundle.c, tests/fuzz/fuzz_bundle.c).
 */
#include "bundle-impl.h"
#include "partbuf.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvtransfer/bundle.c copies payload rows as they are in memory: little-endian hosts only"
#endif

/* ------------------------------------------------------------------ wire constants */

static const uint8_t BL_MAGIC[8] = {'K', 'V', 'R', 'B', 'U', 'N', 'D', 'L'};

enum {
    BL_FIXED = 80, /* fixed header bytes before the section table */
    BL_SECT_ENTRY = 24, /* u32 id, u32 crc, u64 offset, u64 length */
    BL_ALIGN = 64, /* every section starts on a multiple of this */
    BL_BASE_SECTIONS = 4,
    BL_QUANT_SECTIONS = 6, /* a quantized payload adds the K and V row scales (format 2.1) */
    BL_MAX_SECTIONS = 16, /* a newer minor may append sections after V; this many at most */
    BL_REQUIRED_FLAGS = 0xffff, /* low flag bits: a reader that does not know one must refuse */
    BL_FLAG_SEGMENT = 0x1, /* required: a layer segment (2.2); first_layer at BL_OFF_RESERVED */
    BL_FLAG_PADDED = 0x2, /* required: block-padded rows (2.3); block_rows at BL_OFF_BLOCK_ROWS */
    BL_PAD_EXT = 8, /* a padded bundle's u32 block_rows and u32 zero after the fixed header */
};

/* Fixed header field offsets (docs/bundle.md, "Fixed header"). */
enum {
    BL_OFF_MAGIC = 0,
    BL_OFF_MAJOR = 8,
    BL_OFF_MINOR = 10,
    BL_OFF_HEADER_SIZE = 12,
    BL_OFF_TOTAL = 16,
    BL_OFF_FLAGS = 24,
    BL_OFF_HEADER_CRC = 28,
    BL_OFF_FINGERPRINT = 32,
    BL_OFF_LAYERS = 48,
    BL_OFF_KV_HEADS = 52,
    BL_OFF_HEAD_DIM = 56,
    BL_OFF_DTYPE = 60,
    BL_OFF_N_SECTIONS = 62,
    BL_OFF_FIRST_TOKEN = 64,
    BL_OFF_PROMPT_LEN = 68,
    BL_OFF_NEXT_POS = 72,
    BL_OFF_POLICY_LEN = 76,
    BL_OFF_RESERVED = 78,
    BL_OFF_BLOCK_ROWS = 80, /* padded bundles only: then the zero u32 at 84, the table at 88 */
};

/* Where the section table starts: right after the fixed header, or after a padded bundle's
 * 8 extra bytes. */
static uint64_t table_at(uint32_t block_rows) { return BL_FIXED + (block_rows ? BL_PAD_EXT : 0); }

enum { BL_SEC_LISTS = 0, BL_SEC_POSITIONS = 1, BL_SEC_K = 2, BL_SEC_V = 3, BL_SEC_KS = 4, BL_SEC_VS = 5 };
static const char *const BL_SEC_NAME[BL_QUANT_SECTIONS] = {"lists", "positions", "K", "V",
                                                           "K scales", "V scales"};

/* Section i's name in a bundle whose payload dtype defines the first `n_known` sections. */
static const char *sec_name(unsigned i, unsigned n_known) { return i < n_known ? BL_SEC_NAME[i] : "extra"; }

/* ------------------------------------------------------------------ small helpers */


static uint64_t align_up(uint64_t x) { return (x + BL_ALIGN - 1) & ~(uint64_t)(BL_ALIGN - 1); }

/* Rows a list of `count` entries takes in the row sections: count, rounded up to a multiple of
 * block_rows in a padded bundle (count <= 2^32-1 and block_rows <= 4096: no overflow). */
static uint64_t list_rows(uint32_t count, uint32_t block_rows)
{
    return block_rows ? ((uint64_t)count + block_rows - 1) / block_rows * block_rows : count;
}

/* ------------------------------------------------------------------ dtypes */

const char *kt_dtype_name(kt_dtype t)
{
    switch (t) {
    case KT_DTYPE_F32: return "f32";
    case KT_DTYPE_F16: return "f16";
    case KT_DTYPE_BF16: return "bf16";
    case KT_DTYPE_INT8_TOKEN: return "int8+scale";
    case KT_DTYPE_FP8_E4M3_TOKEN: return "fp8_e4m3+scale";
    }
    return "?";
}

size_t kt_dtype_size(kt_dtype t)
{
    switch (t) {
    case KT_DTYPE_F32: return 4;
    case KT_DTYPE_F16:
    case KT_DTYPE_BF16: return 2;
    case KT_DTYPE_INT8_TOKEN:
    case KT_DTYPE_FP8_E4M3_TOKEN: return 1;
    default: return 0;
    }
}

int kt_dtype_quantized(kt_dtype t)
{
    return t == KT_DTYPE_INT8_TOKEN || t == KT_DTYPE_FP8_E4M3_TOKEN;
}

uint64_t kt_dtype_row_bytes(kt_dtype t, uint32_t head_dim)
{
    return (uint64_t)head_dim * kt_dtype_size(t) + (kt_dtype_quantized(t) ? 4u : 0u);
}

int kt_dtype_parse(const char *s, kt_dtype *out)
{
    static const struct {
        const char *name;
        kt_dtype t;
    } names[] = {{"f32", KT_DTYPE_F32}, {"f16", KT_DTYPE_F16}, {"bf16", KT_DTYPE_BF16},
                 {"int8", KT_DTYPE_INT8_TOKEN}, {"int8+scale", KT_DTYPE_INT8_TOKEN},
                 {"fp8", KT_DTYPE_FP8_E4M3_TOKEN}, {"fp8_e4m3", KT_DTYPE_FP8_E4M3_TOKEN},
                 {"fp8_e4m3+scale", KT_DTYPE_FP8_E4M3_TOKEN}};
    for (size_t i = 0; s && i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].t;
            return 0;
        }
    return -1;
}

static int check_dtype(uint32_t code, const char *what, char *err)
{
    if (kt_dtype_size((kt_dtype)code)) return 0;
    return fail(err, "unknown %s %u (known: 0 f32, 1 f16, 2 bf16, 16 int8+scale, 17 fp8_e4m3+scale)",
                what, code);
}

uint16_t kt_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1); /* round to nearest even; overflow carries into inf */
    return (uint16_t)(x >> 16);
}

float kt_bf16_to_f32(uint16_t b)
{
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

uint16_t kt_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) { /* a normal half (>= 2^-14): rebias the exponent, round at bit 13 */
        uint32_t m = ax - 0x38000000u;
        m += 0xfffu + ((m >> 13) & 1);
        return (uint16_t)(sign | (m >> 13));
    }
    const uint32_t e = ax >> 23;
    if (e < 102) return (uint16_t)sign; /* below 2^-25: rounds to zero (2^-25 itself ties to 0) */
    /* A subnormal half counts units of 2^-24: the mantissa with its implicit bit, shifted. */
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e; /* 14..24 */
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++; /* q may reach 0x400: the smallest normal */
    return (uint16_t)(sign | q);
}

float kt_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t x;
    if (e == 0) {
        float f = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        return sign ? -f : f;
    }
    if (e == 31)
        x = sign | 0x7f800000u | (m << 13);
    else
        x = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

uint8_t kt_f32_to_fp8_e4m3(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7f; /* NaN */
    if (ax >= 0x43e00000u) return sign | 0x7e; /* >= 448 (and infinity): saturate */
    if (ax >= 0x3c800000u) { /* a normal E4M3 (>= 2^-6): round the mantissa at bit 20 */
        const uint32_t r = ax + 0x7ffffu + ((ax >> 20) & 1);
        return sign | (uint8_t)((((r >> 23) - 120) << 3) | ((r >> 20) & 7));
    }
    /* a subnormal counts units of 2^-9: scaling by 512 is exact, rintf rounds to even; 8 units
     * is the smallest normal, whose code is 0x08 as well */
    float a;
    memcpy(&a, &ax, 4);
    return sign | (uint8_t)rintf(a * 512.0f);
}

float kt_fp8_e4m3_to_f32(uint8_t b)
{
    const unsigned e = (b >> 3) & 15, m = b & 7;
    float f;
    if ((b & 0x7f) == 0x7f) f = NAN;
    else if (e == 0) f = (float)m * 0x1p-9f;
    else f = ldexpf(1.0f + (float)m / 8.0f, (int)e - 7);
    return b & 0x80 ? -f : f;
}

/* n elements of `src_dtype` (f32, f16 or bf16) at `src` (any alignment) to `dst_dtype` at `dst`. */
static void convert(void *dst_bytes, kt_dtype dst_dtype, const uint8_t *src, kt_dtype src_dtype,
                    size_t n)
{
    uint8_t *dst = dst_bytes;
    if (dst_dtype == src_dtype) {
        memcpy(dst, src, n * kt_dtype_size(src_dtype));
        return;
    }
    for (size_t i = 0; i < n; i++) {
        float f;
        uint16_t h;
        switch (src_dtype) {
        case KT_DTYPE_F16: memcpy(&h, src + 2 * i, 2); f = kt_f16_to_f32(h); break;
        case KT_DTYPE_BF16: memcpy(&h, src + 2 * i, 2); f = kt_bf16_to_f32(h); break;
        default: memcpy(&f, src + 4 * i, 4); break;
        }
        switch (dst_dtype) {
        case KT_DTYPE_F16: h = kt_f32_to_f16(f); memcpy(dst + 2 * i, &h, 2); break;
        case KT_DTYPE_BF16: h = kt_f32_to_bf16(f); memcpy(dst + 2 * i, &h, 2); break;
        default: memcpy(dst + 4 * i, &f, 4); break;
        }
    }
}

/* Quantizes n rows of head_dim elements of `src_dtype` at `src` into `dst` (one byte each) and
 * their scales into `scales` (float32 LE each): scale = max|row| / 127 for int8, / 448 (the
 * largest E4M3) for fp8, so that the row's largest element lands on the largest code; a row of
 * zeros has scale 0. `which` names the rows in the error for a non-finite element. */
static int quantize(uint8_t *dst, uint8_t *scales, kt_dtype dtype, const kt_rows_in *rows, int is_v,
                    uint32_t head_dim, char *err)
{
    const uint8_t *src = is_v ? rows->v : rows->k;
    const kt_dtype src_dtype = rows->dtype;
    const uint32_t n = rows->n;
    const char *which = is_v ? "V" : "K";
    float row[KT_BUNDLE_MAX_HEAD_DIM];
    const float top = dtype == KT_DTYPE_INT8_TOKEN ? 127.0f : 448.0f;
    const size_t src_row = (size_t)head_dim * kt_dtype_size(src_dtype);
    for (uint32_t i = 0; i < n; i++, dst += head_dim) {
        convert((uint8_t *)row, KT_DTYPE_F32, src + i * src_row, src_dtype, head_dim);
        float amax = 0.0f;
        for (uint32_t e = 0; e < head_dim; e++) {
            if (!isfinite(row[e]))
                return fail(err, "%s row %" PRIu32 " element %" PRIu32 " is %g: a quantized payload "
                            "takes finite values only", which, i, e, (double)row[e]);
            amax = fmaxf(amax, fabsf(row[e]));
        }
        const float scale = amax / top, inv = amax > 0.0f ? top / amax : 0.0f;
        memcpy(scales + 4 * (size_t)i, &scale, 4);
        if (dtype == KT_DTYPE_INT8_TOKEN)
            for (uint32_t e = 0; e < head_dim; e++) {
                const float q = fminf(fmaxf(rintf(row[e] * inv), -127.0f), 127.0f);
                dst[e] = (uint8_t)(int8_t)q;
            }
        else
            for (uint32_t e = 0; e < head_dim; e++) dst[e] = kt_f32_to_fp8_e4m3(row[e] * inv);
    }
    return 0;
}

static float fp8_table[256];
static pthread_once_t fp8_once = PTHREAD_ONCE_INIT;

static void fp8_init(void)
{
    for (int b = 0; b < 256; b++) fp8_table[b] = kt_fp8_e4m3_to_f32((uint8_t)b);
}

/* The inverse of quantize: n rows of `src` (one byte per element) times their scales into f32. */
static void dequantize(float *dst, kt_dtype dtype, const uint8_t *src, const uint8_t *scales,
                       size_t n, uint32_t head_dim)
{
    pthread_once(&fp8_once, fp8_init);
    for (size_t i = 0; i < n; i++, src += head_dim, dst += head_dim) {
        float scale;
        memcpy(&scale, scales + 4 * i, 4);
        if (dtype == KT_DTYPE_INT8_TOKEN)
            for (uint32_t e = 0; e < head_dim; e++) dst[e] = (float)(int8_t)src[e] * scale;
        else
            for (uint32_t e = 0; e < head_dim; e++) dst[e] = fp8_table[src[e]] * scale;
    }
}

/* ------------------------------------------------------------------ CRC32C */

/* Slicing-by-8 tables for the portable path, built once. Why not a library: Debian 12 has no
 * CRC32C -dev package we already depend on (zlib's crc32 is the IEEE polynomial, xxhash is not
 * installed here), and with the SSE4.2 instruction 40 lines are as fast as any of them. */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
}

static uint32_t crc_sw(uint32_t c, const uint8_t *p, size_t n)
{
    pthread_once(&crc_once, crc_init);
    while (n >= 8) {
        uint32_t lo = c ^ kt_rd32(p), hi = kt_rd32(p + 4);
        c = crc_table[7][lo & 0xff] ^ crc_table[6][(lo >> 8) & 0xff] ^
            crc_table[5][(lo >> 16) & 0xff] ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xff] ^
            crc_table[2][(hi >> 8) & 0xff] ^ crc_table[1][(hi >> 16) & 0xff] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = (c >> 8) ^ crc_table[0][(c ^ *p++) & 0xff];
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define KT_CRC_HW 1
/* The crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle, so one
 * stream of it runs at a third of what the core can do: at the wire's speed (docs/transport.md).
 * Three streams over three adjacent chunks run at once and are joined with the linearity of a
 * CRC without its pre- and post-conditioning: crc(A || B) = crc(A) * x^(8|B|) mod P ^ crc(B),
 * the multiplication by x^(8|B|) being a table lookup per byte of the 32-bit value for the two
 * chunk lengths used (the technique of Mark Adler's crc32c.c). */
#define CRC_LONG 8192
#define CRC_SHORT 256
static uint32_t crc_long[4][256], crc_short[4][256];
static pthread_once_t crc_shift_once = PTHREAD_ONCE_INIT;

/* mat (32 columns, GF(2)) times vec */
static uint32_t gf2_times(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    for (; vec; vec >>= 1, mat++)
        if (vec & 1) sum ^= *mat;
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat)
{
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends `len` zero bytes (a power of two) to a raw CRC, as four byte tables. */
static void crc_zeros_tables(uint32_t zeros[4][256], size_t len)
{
    uint32_t even[32], odd[32];
    odd[0] = 0x82f63b78u; /* one zero bit */
    for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four */
    for (;;) { /* even: 8 bits, odd: 16, ... doubling until `len` bytes */
        gf2_square(even, odd);
        len >>= 1;
        if (!len) break;
        gf2_square(odd, even);
        len >>= 1;
        if (!len) {
            memcpy(even, odd, sizeof even);
            break;
        }
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int b = 0; b < 4; b++) zeros[b][n] = gf2_times(even, n << (8 * b));
}

static void crc_shift_init(void)
{
    crc_zeros_tables(crc_long, CRC_LONG);
    crc_zeros_tables(crc_short, CRC_SHORT);
}

static uint32_t crc_shift(uint32_t zeros[4][256], uint32_t crc)
{
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static inline uint64_t rd64(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* Three streams over chunks of `len` bytes while 3 * len remain. */
__attribute__((target("sse4.2"))) static uint32_t crc_hw3(uint32_t c, const uint8_t **pp, size_t *np,
                                                          size_t len, uint32_t zeros[4][256])
{
    const uint8_t *p = *pp;
    size_t n = *np;
    for (; n >= 3 * len; p += 3 * len, n -= 3 * len) {
        uint64_t c0 = c, c1 = 0, c2 = 0;
        for (size_t i = 0; i < len; i += 8) {
            c0 = _mm_crc32_u64(c0, rd64(p + i));
            c1 = _mm_crc32_u64(c1, rd64(p + len + i));
            c2 = _mm_crc32_u64(c2, rd64(p + 2 * len + i));
        }
        c = crc_shift(zeros, (uint32_t)c0) ^ (uint32_t)c1;
        c = crc_shift(zeros, c) ^ (uint32_t)c2;
    }
    *pp = p;
    *np = n;
    return c;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n)
{
    if (n >= 3 * CRC_SHORT) {
        pthread_once(&crc_shift_once, crc_shift_init);
        c = crc_hw3(c, &p, &n, CRC_LONG, crc_long);
        c = crc_hw3(c, &p, &n, CRC_SHORT, crc_short);
    }
    uint64_t c64 = c;
    for (; n >= 8; p += 8, n -= 8) c64 = _mm_crc32_u64(c64, rd64(p));
    c = (uint32_t)c64;
    while (n--) c = _mm_crc32_u8(c, *p++);
    return c;
}
#endif

uint32_t kt_crc32c_portable(uint32_t crc, const void *data, size_t n)
{
    return ~crc_sw(~crc, data, n);
}

uint32_t kt_crc32c(uint32_t crc, const void *data, size_t n)
{
    const uint8_t *p = data;
    uint32_t c = ~crc;
#ifdef KT_CRC_HW
    if (__builtin_cpu_supports("sse4.2")) return ~crc_hw(c, p, n);
#endif
    return ~crc_sw(c, p, n);
}

/* ------------------------------------------------------------------ validation shared by both sides */

static int valid_utf8(const uint8_t *s, size_t n, size_t *bad)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t len;
        uint32_t cp;
        if (c == 0) goto bad;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xe0) == 0xc0) { len = 2; cp = c & 0x1f; }
        else if ((c & 0xf0) == 0xe0) { len = 3; cp = c & 0x0f; }
        else if ((c & 0xf8) == 0xf0) { len = 4; cp = c & 0x07; }
        else goto bad;
        if (n - i < len) goto bad;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) goto bad;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        /* overlong forms, UTF-16 surrogates and code points past U+10FFFF are not UTF-8 */
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
            goto bad;
        i += len;
    }
    return 1;
bad:
    *bad = i;
    return 0;
}

static int check_fingerprint(const char *fp, char *err)
{
    for (int i = 0; i < 16; i++) {
        char c = fp[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return fail(err, "model fingerprint byte %d is 0x%02x, expected a lowercase hex digit "
                        "(16 of them, as kr_model_fingerprint gives)", i, (unsigned)(uint8_t)c);
    }
    if (fp[16] != '\0')
        return fail(err, "model fingerprint is longer than 16 hex digits");
    return 0;
}

/* Every header field against its bounds: the writer refuses what the parser would. */
static int check_header(const kt_bundle_header *h, size_t policy_len, char *err)
{
    if (check_fingerprint(h->fingerprint, err)) return -1;
    if (h->n_layers < 1 || h->n_layers > KT_BUNDLE_MAX_LAYERS)
        return fail(err, "n_layers %" PRIu32 " out of range [1, %d]", h->n_layers, KT_BUNDLE_MAX_LAYERS);
    if (h->n_kv_heads < 1 || h->n_kv_heads > KT_BUNDLE_MAX_KV_HEADS)
        return fail(err, "n_kv_heads %" PRIu32 " out of range [1, %d]", h->n_kv_heads,
                    KT_BUNDLE_MAX_KV_HEADS);
    if (h->head_dim < 1 || h->head_dim > KT_BUNDLE_MAX_HEAD_DIM)
        return fail(err, "head_dim %" PRIu32 " out of range [1, %d]", h->head_dim, KT_BUNDLE_MAX_HEAD_DIM);
    if (check_dtype((uint32_t)h->dtype, "payload dtype", err)) return -1;
    if (h->first_token < 0) return fail(err, "first_token %" PRId32 " is negative", h->first_token);
    if (h->prompt_len < 1) return fail(err, "prompt_len %" PRId32 " is below 1", h->prompt_len);
    if (h->next_pos < 0) return fail(err, "next_pos %" PRId32 " is negative", h->next_pos);
    if (h->segment > 1) return fail(err, "segment %" PRIu32 " is neither 0 nor 1", h->segment);
    if (!h->segment && h->first_layer != 0)
        return fail(err, "first_layer %" PRIu32 " in a whole bundle (only a layer segment starts "
                    "past layer 0)", h->first_layer);
    if (h->first_layer >= KT_BUNDLE_MAX_LAYERS || h->n_layers > KT_BUNDLE_MAX_LAYERS - h->first_layer)
        return fail(err, "segment layers [%" PRIu32 ", %" PRIu64 ") go past the %d-layer limit",
                    h->first_layer, (uint64_t)h->first_layer + h->n_layers, KT_BUNDLE_MAX_LAYERS);
    if (h->block_rows > KT_BUNDLE_MAX_BLOCK_ROWS)
        return fail(err, "block_rows %" PRIu32 " out of range [0, %d] (0: rows packed)", h->block_rows,
                    KT_BUNDLE_MAX_BLOCK_ROWS);
    if (policy_len == 0) return fail(err, "policy spec is empty (\"full\" is the no-eviction policy)");
    if (policy_len > KT_BUNDLE_MAX_POLICY)
        return fail(err, "policy spec is %zu bytes, more than the %d allowed", policy_len,
                    KT_BUNDLE_MAX_POLICY);
    size_t bad;
    if (!valid_utf8((const uint8_t *)h->policy, policy_len, &bad))
        return fail(err, "policy spec is not UTF-8 without NUL (bad byte at offset %zu)", bad);
    return 0;
}

static void list_wr(uint8_t *t, uint64_t first, const kt_bundle_list *l)
{
    kt_wr64(t, first);
    kt_wr32(t + 8, l->count);
    kt_wr32(t + 12, l->pinned);
    kt_wr32(t + 16, l->window);
    kt_wr32(t + 20, l->sink);
    kt_wr32(t + 24, l->lazy);
    kt_wr32(t + 28, l->slack);
    kt_wr32(t + 32, l->max_drop);
    kt_wr32(t + 36, l->flags);
}

static int check_list(const kt_bundle_header *h, uint32_t i, const kt_bundle_list *l, char *err)
{
    const uint32_t layer = h->first_layer + i / h->n_kv_heads, head = i % h->n_kv_heads;
    const struct {
        const char *name;
        uint32_t value;
    } rule[] = {{"sink", l->sink}, {"lazy", l->lazy}, {"slack", l->slack}, {"max_drop", l->max_drop}};
    if (l->count > (uint32_t)h->next_pos)
        return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") count %" PRIu32
                    " exceeds next_pos %" PRId32 " (positions are distinct and below it)",
                    layer, head, l->count, h->next_pos);
    if (l->pinned > l->count)
        return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") pinned %" PRIu32
                    " exceeds its count %" PRIu32, layer, head, l->pinned, l->count);
    if (l->window != KT_BUNDLE_WINDOW_DENSE && l->window > (uint32_t)INT32_MAX)
        return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") window %" PRIu32
                    " is above 2^31-1 and not the dense marker 0xffffffff", layer, head, l->window);
    for (size_t r = 0; r < sizeof rule / sizeof rule[0]; r++)
        if (rule[r].value > (uint32_t)INT32_MAX)
            return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") %s %" PRIu32 " is above 2^31-1",
                        layer, head, rule[r].name, rule[r].value);
    if (l->flags & ~KT_BUNDLE_LIST_REL)
        return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") has unknown flags 0x%08" PRIx32
                    " (known: 0x1 rel)", layer, head, l->flags & ~KT_BUNDLE_LIST_REL);
    return 0;
}

/* Where every section this build writes goes (4, or 6 with the row scales of a quantized
 * payload), from the header and the row total (entries plus padding rows); checked arithmetic. */
typedef struct bl_layout {
    uint64_t header_size;
    unsigned n; /* sections laid out */
    uint64_t off[BL_QUANT_SECTIONS], len[BL_QUANT_SECTIONS];
    uint64_t total;
} bl_layout;

/* The sections a payload of dtype `t` needs. */
static unsigned dtype_sections(kt_dtype t) { return kt_dtype_quantized(t) ? BL_QUANT_SECTIONS : BL_BASE_SECTIONS; }

/* `n_sections` is what the header declares (>= n_known, the ones laid out here: a newer minor's
 * extra sections are the parser's to check); `block_rows` 0 or the padding's. */
/* What a bundle's layout follows from: its sections (n_known of them this reader knows), its
 * block padding, policy spec, lists, rows and row size. */
typedef struct bl_shape {
    uint32_t n_sections;
    unsigned n_known;
    uint32_t block_rows;
    size_t policy_len;
    uint32_t n_lists;
    uint64_t n_rows;
    size_t row_bytes;
} bl_shape;

static int layout(const bl_shape *sh, bl_layout *L, char *err)
{
    const uint32_t n_sections = sh->n_sections, block_rows = sh->block_rows, n_lists = sh->n_lists;
    const unsigned n_known = sh->n_known;
    const uint64_t n_rows = sh->n_rows;
    const size_t policy_len = sh->policy_len, row_bytes = sh->row_bytes;
    /* n_lists <= 2^20 and n_rows < 2^52 by the bounds checked before: only the row products
     * can overflow 64 bits. */
    L->header_size = align_up(table_at(block_rows) + (uint64_t)n_sections * BL_SECT_ENTRY + policy_len);
    L->len[BL_SEC_LISTS] = (uint64_t)n_lists * BL_LIST_ENTRY;
    L->len[BL_SEC_POSITIONS] = n_rows * 4;
    uint64_t kv;
    if (__builtin_mul_overflow(n_rows, (uint64_t)row_bytes, &kv) || kv > KT_BUNDLE_MAX_BYTES)
        return fail(err, "%" PRIu64 " rows of %zu bytes exceed the %" PRIu64 "-byte bundle limit",
                    n_rows, row_bytes, (uint64_t)KT_BUNDLE_MAX_BYTES);
    L->len[BL_SEC_K] = L->len[BL_SEC_V] = kv;
    L->len[BL_SEC_KS] = L->len[BL_SEC_VS] = n_rows * 4;
    L->n = n_known;
    uint64_t end = L->header_size;
    for (unsigned s = 0; s < n_known; s++) {
        L->off[s] = align_up(end);
        end = L->off[s] + L->len[s]; /* each term <= 2^38: no overflow */
    }
    if (end > KT_BUNDLE_MAX_BYTES)
        return fail(err, "bundle of %" PRIu64 " bytes exceeds the %" PRIu64 "-byte limit", end,
                    (uint64_t)KT_BUNDLE_MAX_BYTES);
    L->total = end;
    return 0;
}

static size_t policy_length(const kt_bundle_header *h)
{
    return strnlen(h->policy, sizeof h->policy);
}

/* Header, lists and layout: what kt_bundle_size and the writer both need. */
static int plan(const kt_bundle_header *h, const kt_bundle_list *lists, bl_layout *L, char *err)
{
    if (!h || !lists) return fail(err, "NULL header or list table");
    const size_t policy_len = policy_length(h);
    if (check_header(h, policy_len, err)) return -1;
    const uint32_t n_lists = h->n_layers * h->n_kv_heads;
    uint64_t n_rows = 0;
    for (uint32_t i = 0; i < n_lists; i++) {
        if (check_list(h, i, &lists[i], err)) return -1;
        n_rows += list_rows(lists[i].count, h->block_rows);
    }
    const unsigned n_sec = dtype_sections(h->dtype);
    const bl_shape sh = {n_sec, n_sec, h->block_rows, policy_len, n_lists, n_rows,
                         (size_t)h->head_dim * kt_dtype_size(h->dtype)};
    if (layout(&sh, L, err)) return -1;
    return 0;
}

int kt_bundle_size(const kt_bundle_header *h, const kt_bundle_list *lists, uint64_t *size_out,
                   char *err)
{
    bl_layout L;
    if (plan(h, lists, &L, err)) return -1;
    *size_out = L.total;
    return 0;
}

/* ------------------------------------------------------------------ writer */

int kt_bundle_writer_begin(kt_bundle_writer *w, const kt_bundle_header *h,
                           const kt_bundle_list *lists, void *buf, size_t cap, char *err)
{
    bl_layout L;
    if (!w) return fail(err, "NULL writer");
    w->state = 0;
    if (plan(h, lists, &L, err)) return -1;
    if (!buf || cap < L.total)
        return fail(err, "buffer of %zu bytes is too small for this bundle of %" PRIu64
                    " bytes ---> HINT: size it with kt_bundle_size", buf ? cap : (size_t)0, L.total);
    uint8_t *b = buf;
    const size_t policy_len = policy_length(h);
    const uint32_t n_lists = h->n_layers * h->n_kv_heads;

    /* Everything that is not payload is written here, gaps included, so every byte of the
     * bundle is defined whatever buf held before. */
    memset(b, 0, L.off[BL_SEC_LISTS]);
    memcpy(b + BL_OFF_MAGIC, BL_MAGIC, 8);
    kt_wr16(b + BL_OFF_MAJOR, KT_BUNDLE_VERSION_MAJOR);
    /* the oldest minor that reads it: 2.0 unless quantized (2.1), a segment (2.2) or padded (2.3) */
    kt_wr16(b + BL_OFF_MINOR, h->block_rows ? 3 : h->segment ? 2 : L.n == BL_BASE_SECTIONS ? 0 : 1);
    kt_wr32(b + BL_OFF_HEADER_SIZE, (uint32_t)L.header_size);
    kt_wr64(b + BL_OFF_TOTAL, L.total);
    kt_wr32(b + BL_OFF_FLAGS, (h->segment ? BL_FLAG_SEGMENT : 0u) | (h->block_rows ? BL_FLAG_PADDED : 0u));
    if (h->block_rows) kt_wr32(b + BL_OFF_BLOCK_ROWS, h->block_rows); /* the u32 after it stays 0 */
    kt_wr16(b + BL_OFF_RESERVED, (uint16_t)h->first_layer);
    memcpy(b + BL_OFF_FINGERPRINT, h->fingerprint, 16);
    kt_wr32(b + BL_OFF_LAYERS, h->n_layers);
    kt_wr32(b + BL_OFF_KV_HEADS, h->n_kv_heads);
    kt_wr32(b + BL_OFF_HEAD_DIM, h->head_dim);
    kt_wr16(b + BL_OFF_DTYPE, (uint16_t)h->dtype);
    kt_wr16(b + BL_OFF_N_SECTIONS, (uint16_t)L.n);
    kt_wr32(b + BL_OFF_FIRST_TOKEN, (uint32_t)h->first_token);
    kt_wr32(b + BL_OFF_PROMPT_LEN, (uint32_t)h->prompt_len);
    kt_wr32(b + BL_OFF_NEXT_POS, (uint32_t)h->next_pos);
    kt_wr16(b + BL_OFF_POLICY_LEN, (uint16_t)policy_len);
    const uint64_t table = table_at(h->block_rows);
    for (unsigned s = 0; s < L.n; s++) {
        uint8_t *e = b + table + s * BL_SECT_ENTRY;
        kt_wr32(e, (uint32_t)s + 1);
        kt_wr64(e + 8, L.off[s]);
        kt_wr64(e + 16, L.len[s]);
    }
    memcpy(b + table + L.n * BL_SECT_ENTRY, h->policy, policy_len);

    uint8_t *t = b + L.off[BL_SEC_LISTS];
    uint64_t first = 0;
    for (uint32_t i = 0; i < n_lists; i++, t += BL_LIST_ENTRY) {
        list_wr(t, first, &lists[i]);
        first += list_rows(lists[i].count, h->block_rows);
    }
    kt_wr32(b + table + BL_SEC_LISTS * BL_SECT_ENTRY + 4,
         kt_crc32c(0, b + L.off[BL_SEC_LISTS], L.len[BL_SEC_LISTS]));
    for (unsigned s = 1; s < L.n; s++) { /* alignment gaps before positions, K, V (and scales) */
        uint64_t prev_end = L.off[s - 1] + L.len[s - 1];
        memset(b + prev_end, 0, L.off[s] - prev_end);
    }

    w->buf = b;
    w->size = L.total;
    w->lists = lists;
    w->n_lists = n_lists;
    w->n_kv_heads = h->n_kv_heads;
    w->head_dim = h->head_dim;
    w->dtype = h->dtype;
    w->next_pos = h->next_pos;
    w->row_bytes = (size_t)h->head_dim * kt_dtype_size(h->dtype);
    w->cur = 0;
    w->filled = 0;
    w->last_pos = -1;
    w->block_rows = h->block_rows;
    w->row = 0;
    w->off_pos = L.off[BL_SEC_POSITIONS];
    w->off_k = L.off[BL_SEC_K];
    w->off_v = L.off[BL_SEC_V];
    w->off_ks = L.n > BL_SEC_KS ? L.off[BL_SEC_KS] : 0;
    w->off_vs = L.n > BL_SEC_VS ? L.off[BL_SEC_VS] : 0;
    w->crc_pos = w->crc_k = w->crc_v = w->crc_ks = w->crc_vs = 0;
    w->state = 1;
    return 0;
}

/* Zero rows [w->row, w->row + n) of every row section (a padded list's tail), checksummed as
 * they are written: the caller's buffer is not assumed zeroed. */
static void writer_pad(kt_bundle_writer *w, uint64_t n)
{
    struct {
        uint64_t off;
        size_t row;
        uint32_t *crc;
    } sec[] = {{w->off_pos, 4, &w->crc_pos}, {w->off_k, w->row_bytes, &w->crc_k},
               {w->off_v, w->row_bytes, &w->crc_v}, {w->off_ks, 4, &w->crc_ks},
               {w->off_vs, 4, &w->crc_vs}};
    const unsigned n_sec = kt_dtype_quantized(w->dtype) ? 5 : 3;
    for (unsigned s = 0; s < n_sec; s++) {
        uint8_t *p = w->buf + sec[s].off + w->row * sec[s].row;
        memset(p, 0, (size_t)n * sec[s].row);
        *sec[s].crc = kt_crc32c(*sec[s].crc, p, (size_t)n * sec[s].row);
    }
    w->row += n;
}

/* Moves the cursor to list `to`, requiring every list passed over to be complete, and writes
 * the padding rows after each of them. */
static int writer_advance(kt_bundle_writer *w, uint32_t to, char *err)
{
    while (w->cur < to) {
        const uint32_t count = w->lists[w->cur].count;
        if (w->filled != count)
            return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") got %" PRIu32
                        " of its %" PRIu32 " entries before the writer moved on",
                        w->cur / w->n_kv_heads, w->cur % w->n_kv_heads, w->filled, count);
        if (list_rows(count, w->block_rows) > count) writer_pad(w, list_rows(count, w->block_rows) - count);
        w->cur++;
        w->filled = 0;
        w->last_pos = -1;
    }
    return 0;
}

int kt_bundle_writer_put(kt_bundle_writer *w, uint32_t layer, uint32_t head,
                         const kt_rows_in *rows, char *err)
{
    const uint32_t n = rows->n;
    const int32_t *positions = rows->positions;
    const kt_dtype src_dtype = rows->dtype;
    const void *k = rows->k, *v = rows->v;
    if (!w || w->state != 1) return fail(err, "writer is not open (never begun, finished or failed)");
    w->state = 0; /* until this call succeeds */
    const uint32_t n_layers = w->n_lists / w->n_kv_heads;
    if (layer >= n_layers || head >= w->n_kv_heads)
        return fail(err, "put to list (layer %" PRIu32 ", head %" PRIu32 ") outside %" PRIu32
                    " layers x %" PRIu32 " heads", layer, head, n_layers, w->n_kv_heads);
    const uint32_t idx = layer * w->n_kv_heads + head;
    if (idx < w->cur)
        return fail(err, "put to list (layer %" PRIu32 ", head %" PRIu32 ") after a later list: "
                    "lists are written in layer-major order", layer, head);
    if (writer_advance(w, idx, err)) return -1;
    const kt_bundle_list *l = &w->lists[idx];
    if (n > l->count - w->filled)
        return fail(err, "put of %" PRIu32 " entries to list (layer %" PRIu32 ", head %" PRIu32
                    ") which has %" PRIu32 " of %" PRIu32 " left", n, layer, head,
                    l->count - w->filled, l->count);
    if (n == 0) {
        w->state = 1;
        return 0;
    }
    if (!positions || !k || !v) return fail(err, "put with NULL positions, K or V rows");
    if (check_dtype((uint32_t)src_dtype, "source dtype", err)) return -1;
    if (kt_dtype_quantized(src_dtype))
        return fail(err, "source dtype %s: rows are put as f32, f16 or bf16", kt_dtype_name(src_dtype));
    for (uint32_t i = 0; i < n; i++) {
        const int32_t p = positions[i];
        if (p <= w->last_pos || p >= w->next_pos)
            return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") entry %" PRIu32
                        " has position %" PRId32 " (previous %" PRId32 ", next_pos %" PRId32
                        "): positions must increase strictly and stay in [0, next_pos)",
                        layer, head, w->filled + i, p, w->last_pos, w->next_pos);
        w->last_pos = p;
    }
    uint8_t *dp = w->buf + w->off_pos + w->row * 4;
    memcpy(dp, positions, (size_t)n * 4);
    w->crc_pos = kt_crc32c(w->crc_pos, dp, (size_t)n * 4);
    const size_t bytes = (size_t)n * w->row_bytes, elems = (size_t)n * w->head_dim;
    uint8_t *dk = w->buf + w->off_k + w->row * w->row_bytes;
    uint8_t *dv = w->buf + w->off_v + w->row * w->row_bytes;
    if (kt_dtype_quantized(w->dtype)) {
        uint8_t *dks = w->buf + w->off_ks + w->row * 4, *dvs = w->buf + w->off_vs + w->row * 4;
        if (quantize(dk, dks, w->dtype, rows, 0, w->head_dim, err) ||
            quantize(dv, dvs, w->dtype, rows, 1, w->head_dim, err))
            return -1;
        w->crc_ks = kt_crc32c(w->crc_ks, dks, (size_t)n * 4);
        w->crc_vs = kt_crc32c(w->crc_vs, dvs, (size_t)n * 4);
    } else {
        convert(dk, w->dtype, k, src_dtype, elems);
        convert(dv, w->dtype, v, src_dtype, elems);
    }
    w->crc_k = kt_crc32c(w->crc_k, dk, bytes);
    w->crc_v = kt_crc32c(w->crc_v, dv, bytes);
    w->filled += n;
    w->row += n;
    w->state = 1;
    return 0;
}

int kt_bundle_writer_finish(kt_bundle_writer *w, uint64_t *size_out, char *err)
{
    if (!w || w->state != 1) return fail(err, "writer is not open (never begun, finished or failed)");
    w->state = 0;
    if (writer_advance(w, w->n_lists, err)) return -1; /* every list, the last one included */
    uint8_t *t = w->buf + table_at(w->block_rows);
    kt_wr32(t + BL_SEC_POSITIONS * BL_SECT_ENTRY + 4, w->crc_pos);
    kt_wr32(t + BL_SEC_K * BL_SECT_ENTRY + 4, w->crc_k);
    kt_wr32(t + BL_SEC_V * BL_SECT_ENTRY + 4, w->crc_v);
    if (kt_dtype_quantized(w->dtype)) {
        kt_wr32(t + BL_SEC_KS * BL_SECT_ENTRY + 4, w->crc_ks);
        kt_wr32(t + BL_SEC_VS * BL_SECT_ENTRY + 4, w->crc_vs);
    }
    uint8_t *b = w->buf;
    const uint32_t header_size = kt_rd32(b + BL_OFF_HEADER_SIZE);
    kt_wr32(b + BL_OFF_HEADER_CRC, 0);
    kt_wr32(b + BL_OFF_HEADER_CRC, kt_crc32c(0, b, header_size));
    *size_out = w->size;
    return 0;
}

/* ------------------------------------------------------------------ parser */

static int check_zero(const uint8_t *base, uint64_t from, uint64_t to, const char *where, char *err)
{
    for (uint64_t i = from; i < to; i++)
        if (base[i])
            return fail(err, "padding byte at offset %" PRIu64 " (%s) is 0x%02x, not zero", i,
                        where, base[i]);
    return 0;
}

/* Index of the first non-zero byte of p[0, n), or n; a word at a time, since the padding rows
 * of a padded bundle can be a sizable share of its bytes. */
static size_t first_nonzero(const uint8_t *p, size_t n)
{
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, 32);
        if (w[0] | w[1] | w[2] | w[3]) break;
    }
    while (i < n && !p[i]) i++;
    return i;
}

static int check_section_crc(const uint8_t *p, unsigned s, unsigned n_known, uint64_t len,
                             uint32_t stored, char *err)
{
    const uint32_t got = kt_crc32c(0, p, (size_t)len);
    if (got != stored)
        return fail(err, "section %s checksum mismatch (expected 0x%08" PRIx32 ", got 0x%08" PRIx32 ")",
                    sec_name(s, n_known), stored, got);
    return 0;
}

/* What checksums cannot vouch for in a quantized payload: every scale is >= 0 and small enough
 * that scale times the largest code is finite (as the writer's max|row| / code is), and no fp8
 * element is a NaN code (the writer never makes one): every dequantized value is finite.
 * Padding rows, zero, pass. */
static int check_quantized(const kt_bundle_view *view, const uint8_t *const *at, char *err)
{
    const kt_dtype dtype = view->hdr.dtype;
    const uint8_t *k = at[BL_SEC_K], *v = at[BL_SEC_V], *ks = at[BL_SEC_KS], *vs = at[BL_SEC_VS];
    const uint64_t n_rows = view->n_rows;
    const uint32_t head_dim = view->hdr.head_dim;
    const char *row_word = view->hdr.block_rows ? "row" : "entry";
    const float most = FLT_MAX / (dtype == KT_DTYPE_INT8_TOKEN ? 127.0f : 448.0f);
    for (uint64_t i = 0; i < n_rows; i++)
        for (int which = 0; which < 2; which++) {
            float scale;
            memcpy(&scale, (which ? vs : ks) + 4 * i, 4);
            if (!(scale >= 0.0f && scale <= most))
                return fail(err, "%s scale of %s %" PRIu64 " is %g: scales lie in [0, %g]",
                            which ? "V" : "K", row_word, i, (double)scale, (double)most);
        }
    if (dtype == KT_DTYPE_FP8_E4M3_TOKEN)
        for (int which = 0; which < 2; which++) {
            const uint8_t *p = which ? v : k;
            for (uint64_t i = 0; i < n_rows * head_dim; i++)
                if ((p[i] & 0x7f) == 0x7f)
                    return fail(err, "%s element %" PRIu64 " is the fp8 NaN code 0x%02x", which ? "V" : "K",
                                i, p[i]);
        }
    return 0;
}

/* The padding rows of row section `name` (at `sec`, rows of `row` bytes) are zero: after each
 * list's entries, up to its multiple of block_rows. Needs the view's validated list table. */
static int check_padding(const kt_bundle_view *v, const uint8_t *sec, size_t row, const char *name,
                         char *err)
{
    const uint32_t block_rows = v->hdr.block_rows;
    if (!block_rows) return 0;
    const uint8_t *t = v->lists;
    for (uint32_t i = 0; i < v->n_lists; i++, t += BL_LIST_ENTRY) {
        const uint32_t count = kt_rd32(t + 8);
        const uint64_t at = kt_rd64(t) + count, pad = list_rows(count, block_rows) - count;
        const uint8_t *p = sec + at * row;
        const size_t z = first_nonzero(p, (size_t)pad * row);
        if (z < pad * row)
            return fail(err, "section %s padding row %" PRIu64 " (after the %" PRIu32 " entries of "
                        "list (layer %" PRIu32 ", head %" PRIu32 ")) has byte %zu = 0x%02x, not zero: "
                        "a list's rows are padded with zeros to a multiple of block_rows %" PRIu32,
                        name, at + z / row, count, v->hdr.first_layer + i / v->hdr.n_kv_heads,
                        i % v->hdr.n_kv_heads, z % row, p[z], block_rows);
    }
    return 0;
}

/* What a bundle's fixed header and section table say, validated by read_head. */
typedef struct bl_head {
    uint32_t header_size;
    unsigned n_sections, n_known; /* declared; defined by the payload dtype (4 or 6) */
    uint64_t off[BL_MAX_SECTIONS], len[BL_MAX_SECTIONS];
    uint32_t crc[BL_MAX_SECTIONS];
} bl_head;

/* The first checks on the `len` bytes at b, which need the fixed header only: magic, major
 * version and the bound on the total size, which it returns. */
static int read_prefix(const uint8_t *b, size_t len, uint64_t *total, char *err)
{
    if (len < 8)
        return fail(err, "truncated: %zu bytes, shorter than the %d-byte fixed header", len, BL_FIXED);
    if (memcmp(b, BL_MAGIC, 8) != 0) {
        char shown[17];
        for (int i = 0; i < 8; i++) snprintf(shown + 2 * i, 3, "%02x", b[i]);
        return fail(err, "bad magic %s (expected \"KVRBUNDL\") ---> HINT: these bytes are not a "
                    "kvrelay KV bundle", shown);
    }
    if (len < BL_FIXED)
        return fail(err, "truncated: %zu bytes, shorter than the %d-byte fixed header", len, BL_FIXED);
    const unsigned major = kt_rd16(b + BL_OFF_MAJOR), minor = kt_rd16(b + BL_OFF_MINOR);
    if (major != KT_BUNDLE_VERSION_MAJOR)
        return fail(err, "version %u.%u is %s than this build reads (%d.x) ---> HINT: run the same "
                    "kvrelay release on prefill and decode nodes", major, minor,
                    major > KT_BUNDLE_VERSION_MAJOR ? "newer" : "older", KT_BUNDLE_VERSION_MAJOR);
    *total = kt_rd64(b + BL_OFF_TOTAL);
    if (*total > KT_BUNDLE_MAX_BYTES)
        return fail(err, "total size %" PRIu64 " exceeds the %" PRIu64 "-byte limit", *total,
                    (uint64_t)KT_BUNDLE_MAX_BYTES);
    return 0;
}

/* The section table at t (n_sections entries of a bundle of `total` bytes whose header ends at
 * header_size) into H: in order, each right after the previous one (64-byte aligned), inside
 * the bundle; the last one ends the bundle. */
static int read_sections(const uint8_t *t, unsigned n_sections, unsigned n_known, uint32_t header_size,
                         uint64_t total, bl_head *H, char *err)
{
    uint64_t end = header_size;
    for (unsigned s = 0; s < n_sections; s++) {
        const uint8_t *e = t + s * BL_SECT_ENTRY;
        const uint32_t id = kt_rd32(e);
        const uint64_t off = kt_rd64(e + 8), len = kt_rd64(e + 16);
        H->crc[s] = kt_rd32(e + 4);
        H->off[s] = off;
        H->len[s] = len;
        if (id != s + 1)
            return fail(err, "section table entry %u has id %" PRIu32 ", expected %u (%s)", s, id,
                        s + 1, sec_name(s, n_known));
        if (off > total || len > total - off)
            return fail(err, "section %s [%" PRIu64 ", +%" PRIu64 ") lies outside the %" PRIu64
                        "-byte bundle", sec_name(s, n_known), off, len, total);
        if (off < end)
            return fail(err, "section %s starts at %" PRIu64 ", before the end of %s at %" PRIu64,
                        sec_name(s, n_known), off, s ? sec_name(s - 1, n_known) : "the header", end);
        if (off != align_up(end))
            return fail(err, "section %s at offset %" PRIu64 ", expected %" PRIu64
                        " (the first 64-byte boundary after %s)", sec_name(s, n_known), off,
                        align_up(end), s ? sec_name(s - 1, n_known) : "the header");
        end = off + len; /* the gap before off is checked once lengths are known */
    }
    if (end != total)
        return fail(err, "%" PRIu64 " bytes after the last section (bundle is %" PRIu64 " bytes)",
                    total - end, total);
    return 0;
}

/* The fixed header and section table of a bundle of `total` bytes (read_prefix's), from the
 * `avail` bytes at b: every field, the header checksum, the sections' placement. Fills v's
 * header, version, flags and size, and *H. */
static int read_head(const uint8_t *b, size_t avail, uint64_t total, kt_bundle_view *v, bl_head *H,
                     char *err)
{
    const unsigned major = kt_rd16(b + BL_OFF_MAJOR), minor = kt_rd16(b + BL_OFF_MINOR);
    const uint32_t header_size = kt_rd32(b + BL_OFF_HEADER_SIZE);
    const unsigned n_sections = kt_rd16(b + BL_OFF_N_SECTIONS);
    const unsigned policy_len = kt_rd16(b + BL_OFF_POLICY_LEN);
    const uint32_t flags = kt_rd32(b + BL_OFF_FLAGS);
    /* The padded flag places the section table; it is trusted only once the header checksum
     * matches, and a flipped flag fails one check or the other. */
    const int padded = (flags & BL_FLAG_PADDED) != 0;
    const uint64_t table = BL_FIXED + (padded ? BL_PAD_EXT : 0);
    if (n_sections < BL_BASE_SECTIONS || n_sections > BL_MAX_SECTIONS ||
        (minor == 0 && n_sections != BL_BASE_SECTIONS))
        return fail(err, "n_sections %u invalid for version %u.%u (4 in %u.0, at most %d later)",
                    n_sections, major, minor, major, BL_MAX_SECTIONS);
    if (policy_len < 1 || policy_len > KT_BUNDLE_MAX_POLICY)
        return fail(err, "policy_len %u out of range [1, %d]", policy_len, KT_BUNDLE_MAX_POLICY);
    const uint64_t want_header = align_up(table + (uint64_t)n_sections * BL_SECT_ENTRY + policy_len);
    if (header_size != want_header)
        return fail(err, "header_size %" PRIu32 ", expected %" PRIu64 " for %u sections and a "
                    "%u-byte policy%s", header_size, want_header, n_sections, policy_len,
                    padded ? " after the 8 bytes of block padding" : "");
    if (header_size > total)
        return fail(err, "header_size %" PRIu32 " exceeds the bundle's %" PRIu64 " bytes",
                    header_size, total);
    if (header_size > avail)
        return fail(err, "truncated: %zu bytes, shorter than the %" PRIu32 "-byte header", avail,
                    header_size);
    const uint32_t header_crc = kt_rd32(b + BL_OFF_HEADER_CRC);
    static const uint8_t zero4[4];
    uint32_t crc = kt_crc32c(0, b, BL_OFF_HEADER_CRC);
    crc = kt_crc32c(crc, zero4, 4);
    crc = kt_crc32c(crc, b + BL_OFF_HEADER_CRC + 4, header_size - (BL_OFF_HEADER_CRC + 4));
    if (crc != header_crc)
        return fail(err, "header checksum mismatch (expected 0x%08" PRIx32 ", got 0x%08" PRIx32 ")",
                    header_crc, crc);

    /* From here the header is what the sender wrote: what remains are lies, not line noise. */
    const uint32_t unknown = flags & BL_REQUIRED_FLAGS & ~(uint32_t)(BL_FLAG_SEGMENT | BL_FLAG_PADDED);
    if (unknown)
        return fail(err, "unknown required flags 0x%04" PRIx32 " ---> HINT: the sender is a newer "
                    "kvrelay using a feature this build lacks", unknown);
    if (padded && minor < 3) /* what a reader of that minor would say */
        return fail(err, "unknown required flags 0x%04x in a version %u.%u bundle (block-padded "
                    "rows, flag 0x%04x, are 2.3)", BL_FLAG_PADDED, major, minor, BL_FLAG_PADDED);
    const int segment = (flags & BL_FLAG_SEGMENT) != 0;
    if (segment && minor < 2)
        return fail(err, "the layer segment flag in a version %u.%u bundle (segments are 2.2)",
                    major, minor);
    if (!segment && kt_rd16(b + BL_OFF_RESERVED) != 0)
        return fail(err, "reserved header field at offset %d is 0x%04x, not zero (it is the first "
                    "layer of a layer segment only)", BL_OFF_RESERVED, kt_rd16(b + BL_OFF_RESERVED));
    kt_bundle_header *h = &v->hdr;
    if (padded) {
        h->block_rows = kt_rd32(b + BL_OFF_BLOCK_ROWS);
        if (h->block_rows < 1 || h->block_rows > KT_BUNDLE_MAX_BLOCK_ROWS)
            return fail(err, "block_rows %" PRIu32 " out of range [1, %d] in a block-padded bundle",
                        h->block_rows, KT_BUNDLE_MAX_BLOCK_ROWS);
        if (kt_rd32(b + BL_OFF_BLOCK_ROWS + 4) != 0)
            return fail(err, "header word at offset %d is 0x%08" PRIx32 ", not zero (it follows "
                        "block_rows)", BL_OFF_BLOCK_ROWS + 4, kt_rd32(b + BL_OFF_BLOCK_ROWS + 4));
    }
    h->segment = (uint32_t)segment;
    h->first_layer = segment ? kt_rd16(b + BL_OFF_RESERVED) : 0;
    memcpy(h->fingerprint, b + BL_OFF_FINGERPRINT, 16);
    h->fingerprint[16] = '\0';
    h->n_layers = kt_rd32(b + BL_OFF_LAYERS);
    h->n_kv_heads = kt_rd32(b + BL_OFF_KV_HEADS);
    h->head_dim = kt_rd32(b + BL_OFF_HEAD_DIM);
    const unsigned dtype = kt_rd16(b + BL_OFF_DTYPE);
    h->dtype = (kt_dtype)dtype;
    if (check_dtype(dtype, "payload dtype", err)) return -1; /* before storing it is meaningful */
    h->first_token = (int32_t)kt_rd32(b + BL_OFF_FIRST_TOKEN);
    h->prompt_len = (int32_t)kt_rd32(b + BL_OFF_PROMPT_LEN);
    h->next_pos = (int32_t)kt_rd32(b + BL_OFF_NEXT_POS);
    const unsigned n_known = dtype_sections(h->dtype);
    if (n_sections < n_known)
        return fail(err, "payload dtype %s needs its K and V scale sections: %u sections in "
                    "version %u.%u, expected at least %u (version 2.1)", kt_dtype_name(h->dtype),
                    n_sections, major, minor, n_known);
    const uint64_t policy_at = table + (uint64_t)n_sections * BL_SECT_ENTRY;
    memcpy(h->policy, b + policy_at, policy_len);
    h->policy[policy_len] = '\0';
    if (check_header(h, policy_len, err)) return -1; /* a NUL in the policy fails as non-UTF-8 */
    if (check_zero(b, policy_at + policy_len, header_size, "header padding", err)) return -1;

    if (read_sections(b + table, n_sections, n_known, header_size, total, H, err)) return -1;
    H->header_size = header_size;
    H->n_sections = n_sections;
    H->n_known = n_known;
    v->version_major = (uint16_t)major;
    v->version_minor = (uint16_t)minor;
    v->flags = flags;
    v->size = total;
    return 0;
}

/* The head of a bundle (its bytes at b before section K; read_head validated the header and
 * filled *H): the list table, the section lengths the counts imply, the gaps up to K, the
 * positions with their checksum and padding rows. Fills the rest of *v but its rows. */
static int check_head(const uint8_t *b, kt_bundle_view *v, const bl_head *H, char *err)
{
    const kt_bundle_header *h = &v->hdr;
    const unsigned n_known = H->n_known;
    const uint32_t n_lists = h->n_layers * h->n_kv_heads;
    const uint64_t want_lists = (uint64_t)n_lists * BL_LIST_ENTRY;
    if (H->len[BL_SEC_LISTS] != want_lists)
        return fail(err, "section lists is %" PRIu64 " bytes, expected %" PRIu64 " for %" PRIu32
                    " layers x %" PRIu32 " heads", H->len[BL_SEC_LISTS], want_lists, h->n_layers,
                    h->n_kv_heads);
    const uint8_t *lists = b + H->off[BL_SEC_LISTS];
    if (check_section_crc(lists, BL_SEC_LISTS, n_known, H->len[BL_SEC_LISTS], H->crc[BL_SEC_LISTS], err))
        return -1;
    const uint8_t *t = lists;
    uint64_t n_entries = 0, n_rows = 0;
    for (uint32_t i = 0; i < n_lists; i++, t += BL_LIST_ENTRY) {
        kt_bundle_list l;
        list_rd(t, &l);
        if (kt_rd64(t) != n_rows)
            return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") starts at %s %" PRIu64
                        ", expected %" PRIu64 " (the sum of the counts before it%s)",
                        h->first_layer + i / h->n_kv_heads, i % h->n_kv_heads,
                        h->block_rows ? "row" : "entry", kt_rd64(t), n_rows,
                        h->block_rows ? ", each rounded up to a multiple of block_rows" : "");
        if (check_list(h, i, &l, err)) return -1;
        n_entries += l.count; /* < 2^20 lists x 2^31: no overflow */
        n_rows += list_rows(l.count, h->block_rows);
    }
    bl_layout L;
    const size_t row_bytes = (size_t)h->head_dim * kt_dtype_size(h->dtype);
    const bl_shape sh = {H->n_sections, n_known, h->block_rows, strlen(h->policy), n_lists, n_rows,
                         row_bytes};
    if (layout(&sh, &L, err)) return -1;
    for (unsigned s = BL_SEC_POSITIONS; s < n_known; s++)
        if (H->len[s] != L.len[s]) {
            char rows[64] = "";
            if (n_rows != n_entries)
                snprintf(rows, sizeof rows, " in %" PRIu64 " padded rows", n_rows);
            return fail(err, "section %s is %" PRIu64 " bytes, but the counts say %" PRIu64
                        " (%" PRIu64 " entries%s)", sec_name(s, n_known), H->len[s], L.len[s],
                        n_entries, rows);
        }
    /* Padding between sections is zero: with the checksums, every byte of a bundle is checked.
     * The head holds the gaps up to section K. */
    for (unsigned s = 1; s <= BL_SEC_K; s++)
        if (check_zero(b, H->off[s - 1] + H->len[s - 1], H->off[s], "between sections", err)) return -1;

    /* Positions: checksum, then every list strictly increasing inside [0, next_pos), then the
     * padding rows zero. */
    const uint8_t *pos = b + H->off[BL_SEC_POSITIONS];
    if (check_section_crc(pos, BL_SEC_POSITIONS, n_known, H->len[BL_SEC_POSITIONS],
                          H->crc[BL_SEC_POSITIONS], err))
        return -1;
    t = lists;
    for (uint32_t i = 0; i < n_lists; i++, t += BL_LIST_ENTRY) {
        const uint32_t count = kt_rd32(t + 8);
        const uint8_t *pp = pos + kt_rd64(t) * 4;
        int32_t last = -1;
        for (uint32_t j = 0; j < count; j++, pp += 4) {
            const int32_t p = (int32_t)kt_rd32(pp);
            if (p <= last || p >= h->next_pos)
                return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") entry %" PRIu32
                            " has position %" PRId32 " (previous %" PRId32 ", next_pos %" PRId32
                            "): positions must increase strictly and stay in [0, next_pos)",
                            h->first_layer + i / h->n_kv_heads, i % h->n_kv_heads, j, p, last,
                            h->next_pos);
            last = p;
        }
    }
    v->n_entries = n_entries;
    v->n_rows = n_rows;
    v->row_bytes = row_bytes;
    v->n_lists = n_lists;
    v->base = b;
    v->lists = lists;
    v->positions = pos;
    return check_padding(v, pos, 4, "positions", err);
}

/* The sections from K on, wherever they lie: at[s] holds section s's len[s] bytes, for s in
 * [BL_SEC_K, n_sections) (K and V; in a one-step parse also the row scales and a newer minor's
 * extra sections). Checksums first, then the padding rows and what checksums cannot vouch for
 * in quantized rows. The bulk of the bytes: the cheap checks of the head come before. */
static int check_rows(const kt_bundle_view *v, unsigned n_sections, unsigned n_known,
                      const uint8_t *const *at, const uint64_t *len, const uint32_t *crc, char *err)
{
    for (unsigned s = BL_SEC_K; s < n_sections; s++)
        if (check_section_crc(at[s], s, n_known, len[s], crc[s], err)) return -1;
    for (unsigned s = BL_SEC_K; s < n_known; s++)
        if (check_padding(v, at[s], s <= BL_SEC_V ? v->row_bytes : 4, sec_name(s, n_known), err))
            return -1;
    if (n_known == BL_QUANT_SECTIONS && check_quantized(v, at, err)) return -1;
    return 0;
}

int kt_bundle_parse(const void *buf, size_t len, kt_bundle_view *out, char *err)
{
    const uint8_t *b = buf;
    if (!out) return fail(err, "NULL view");
    if (!b) len = 0;
    uint64_t total;
    if (read_prefix(b, len, &total, err)) return -1;
    if (len < total)
        return fail(err, "truncated: header says %" PRIu64 " bytes, got %zu", total, len);
    if (len > total)
        return fail(err, "size mismatch: header says %" PRIu64 " bytes, got %zu (trailing bytes)",
                    total, len);
    kt_bundle_view v;
    memset(&v, 0, sizeof v);
    bl_head H;
    if (read_head(b, len, total, &v, &H, err) || check_head(b, &v, &H, err)) return -1;
    for (unsigned s = BL_SEC_K + 1; s < H.n_sections; s++) /* the gaps after K */
        if (check_zero(b, H.off[s - 1] + H.len[s - 1], H.off[s], "between sections", err)) return -1;
    const uint8_t *at[BL_MAX_SECTIONS];
    for (unsigned s = 0; s < H.n_sections; s++) at[s] = b + H.off[s];
    if (check_rows(&v, H.n_sections, H.n_known, at, H.len, H.crc, err)) return -1;
    v.k = at[BL_SEC_K];
    v.v = at[BL_SEC_V];
    if (H.n_known == BL_QUANT_SECTIONS) {
        v.k_scale = at[BL_SEC_KS];
        v.v_scale = at[BL_SEC_VS];
    }
    *out = v;
    return 0;
}

/* Whether the bundle read_head described travels as [0, offset of K), K, V: V is its last
 * section (unquantized, nothing after it) and starts where K ends. */
static int head_split(const bl_head *H)
{
    return H->n_sections == BL_BASE_SECTIONS &&
           H->off[BL_SEC_V] == H->off[BL_SEC_K] + H->len[BL_SEC_K];
}

int kt_bundle_layout_read(const void *buf, size_t len, kt_bundle_layout *out, char *err)
{
    const uint8_t *b = buf;
    if (!out) return fail(err, "NULL layout");
    if (!b) len = 0;
    uint64_t total;
    kt_bundle_view v;
    memset(&v, 0, sizeof v);
    bl_head H;
    if (read_prefix(b, len, &total, err) || read_head(b, len, total, &v, &H, err)) return -1;
    kt_bundle_layout l;
    l.size = total;
    l.head_len = H.off[BL_SEC_K];
    l.k_off = H.off[BL_SEC_K];
    l.k_len = H.len[BL_SEC_K];
    l.v_off = H.off[BL_SEC_V];
    l.v_len = H.len[BL_SEC_V];
    l.block_rows = v.hdr.block_rows;
    l.split = head_split(&H);
    *out = l;
    return 0;
}

int kt_bundle_parse_head(const void *head, size_t head_len, uint64_t size, kt_bundle_view *out,
                         char *err)
{
    const uint8_t *b = head;
    if (!out) return fail(err, "NULL view");
    if (!b) head_len = 0;
    uint64_t total;
    if (read_prefix(b, head_len, &total, err)) return -1;
    if (total != size)
        return fail(err, "size mismatch: header says %" PRIu64 " bytes, the bundle is %" PRIu64,
                    total, size);
    kt_bundle_view v;
    memset(&v, 0, sizeof v);
    bl_head H;
    if (read_head(b, head_len, total, &v, &H, err)) return -1;
    if (!head_split(&H))
        return fail(err, "this bundle's K and V sections cannot be parsed apart (%s) ---> HINT: "
                    "parse it whole with kt_bundle_parse",
                    H.n_sections > BL_BASE_SECTIONS ? "sections follow V: row scales or a newer "
                    "minor's extra sections" : "a gap lies between K and V");
    if (head_len != H.off[BL_SEC_K])
        return fail(err, "head of %zu bytes, but section K starts at %" PRIu64 " (the head is the "
                    "bytes before it)", head_len, H.off[BL_SEC_K]);
    if (check_head(b, &v, &H, err)) return -1;
    *out = v;
    return 0;
}

int kt_bundle_parse_rows(kt_bundle_view *v, const void *k, const void *vrows, char *err)
{
    if (!v || !v->base || v->k || v->v || kt_dtype_quantized(v->hdr.dtype))
        return fail(err, "not a view from kt_bundle_parse_head still waiting for its rows");
    if (!k || !vrows) return fail(err, "NULL K or V section");
    /* The checksums from the head's section table (validated by kt_bundle_parse_head, which
     * also checked both lengths against the counts). */
    const uint8_t *t = v->base + table_at(v->hdr.block_rows);
    const uint8_t *at[BL_BASE_SECTIONS] = {NULL, NULL, k, vrows};
    const uint64_t bytes = v->n_rows * v->row_bytes, len[BL_BASE_SECTIONS] = {0, 0, bytes, bytes};
    const uint32_t crc[BL_BASE_SECTIONS] = {0, 0, kt_rd32(t + BL_SEC_K * BL_SECT_ENTRY + 4),
                                            kt_rd32(t + BL_SEC_V * BL_SECT_ENTRY + 4)};
    if (check_rows(v, BL_BASE_SECTIONS, BL_BASE_SECTIONS, at, len, crc, err)) return -1;
    v->k = k;
    v->v = vrows;
    return 0;
}

int kt_bundle_check_model(const kt_bundle_header *h, const char *fingerprint, uint32_t n_layers,
                          uint32_t n_kv_heads, uint32_t head_dim, char *err)
{
    if (fingerprint && strcmp(h->fingerprint, fingerprint) != 0)
        return fail(err, "model fingerprint %s does not match this node's %s ---> HINT: prefill "
                    "and decode nodes must serve the same checkpoint", h->fingerprint, fingerprint);
    if (h->n_layers != n_layers)
        return fail(err, "n_layers %" PRIu32 " does not match this node's model (%" PRIu32 ")",
                    h->n_layers, n_layers);
    if (h->n_kv_heads != n_kv_heads)
        return fail(err, "n_kv_heads %" PRIu32 " does not match this node's model (%" PRIu32 ")",
                    h->n_kv_heads, n_kv_heads);
    if (h->head_dim != head_dim)
        return fail(err, "head_dim %" PRIu32 " does not match this node's model (%" PRIu32 ")",
                    h->head_dim, head_dim);
    return 0;
}

int kt_bundle_view_list(const kt_bundle_view *v, uint32_t layer, uint32_t head,
                        kt_bundle_list_view *out, char *err)
{
    if (layer >= v->hdr.n_layers || head >= v->hdr.n_kv_heads)
        return fail(err, "list (layer %" PRIu32 ", head %" PRIu32 ") outside %" PRIu32
                    " layers x %" PRIu32 " heads", layer, head, v->hdr.n_layers, v->hdr.n_kv_heads);
    const uint8_t *t = v->lists + ((size_t)layer * v->hdr.n_kv_heads + head) * BL_LIST_ENTRY;
    kt_bundle_list m;
    list_rd(t, &m);
    kt_bundle_list_view l;
    l.first = kt_rd64(t);
    l.count = m.count;
    l.pinned = m.pinned;
    l.window = m.window;
    l.sink = m.sink;
    l.lazy = m.lazy;
    l.slack = m.slack;
    l.max_drop = m.max_drop;
    l.flags = m.flags;
    l.positions = v->positions + l.first * 4;
    l.k = v->k ? v->k + l.first * v->row_bytes : NULL; /* NULL: rows not parsed yet */
    l.v = v->v ? v->v + l.first * v->row_bytes : NULL;
    l.k_scale = v->k_scale ? v->k_scale + l.first * 4 : NULL;
    l.v_scale = v->v_scale ? v->v_scale + l.first * 4 : NULL;
    *out = l;
    return 0;
}

/* Whether rows of a payload in `payload` can be read out as `row`: float32 always; float16 or
 * bfloat16 from an unquantized payload. */
static int readable_as(kt_dtype payload, kt_dtype row, char *err)
{
    if (row != KT_DTYPE_F32 && row != KT_DTYPE_F16 && row != KT_DTYPE_BF16)
        return fail(err, "rows can be read as f32, f16 or bf16, not dtype %d", (int)row);
    if (row != KT_DTYPE_F32 && kt_dtype_quantized(payload))
        return fail(err, "a quantized payload (%s) is read as f32, not %s", kt_dtype_name(payload),
                    kt_dtype_name(row));
    return 0;
}

int kt_bundle_list_read(const kt_bundle_view *v, const kt_bundle_list_view *l, uint32_t first,
                        const kt_rows *out, char *err)
{
    const uint32_t n = out->n;
    const kt_dtype row_dtype = out->dtype;
    int32_t *positions = out->positions;
    void *k = out->k, *v_out = out->v;
    if ((uint64_t)first + n > l->count)
        return fail(err, "read of entries [%" PRIu32 ", %" PRIu64 ") past the list's %" PRIu32,
                    first, (uint64_t)first + n, l->count);
    if (readable_as(v->hdr.dtype, row_dtype, err)) return -1;
    if ((k && !l->k) || (v_out && !l->v))
        return fail(err, "rows asked of a view whose rows are not parsed yet (kt_bundle_parse_rows)");
    if (positions) memcpy(positions, l->positions + (size_t)first * 4, (size_t)n * 4);
    const size_t elems = (size_t)n * v->hdr.head_dim, at = (size_t)first * v->row_bytes;
    if (kt_dtype_quantized(v->hdr.dtype)) {
        if (k) dequantize(k, v->hdr.dtype, l->k + at, l->k_scale + (size_t)first * 4, n, v->hdr.head_dim);
        if (v_out) dequantize(v_out, v->hdr.dtype, l->v + at, l->v_scale + (size_t)first * 4, n, v->hdr.head_dim);
        return 0;
    }
    if (k) convert(k, row_dtype, l->k + at, v->hdr.dtype, elems);
    if (v_out) convert(v_out, row_dtype, l->v + at, v->hdr.dtype, elems);
    return 0;
}
