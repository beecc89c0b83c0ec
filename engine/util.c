/* util.c - error formatting, whole-file reads and dtype helpers shared by the engine. */
#include "kr-util.h"
#include "kr.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kr_errf(char *err, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, KR_ERR_MAX, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int kr_read_file(const char *path, char **data_out, size_t *len_out, char *err)
{
    FILE *f = fopen(path, "rb");
    if (!f) return kr_errf(err, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) goto err_oom;
    for (;;) {
        if (n + 1 >= cap) {
            char *grown = realloc(buf, cap * 2);
            if (!grown) goto err_oom;
            buf = grown;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        free(buf);
        fclose(f);
        return kr_errf(err, "%s: read error", path);
    }
    fclose(f);
    buf[n] = 0;
    *data_out = buf;
    *len_out = n;
    return KR_OK;
err_oom:
    free(buf);
    fclose(f);
    return kr_errf(err, "%s: out of memory reading the file", path);
}

const char *kr_dtype_name(kr_dtype t)
{
    switch (t) {
    case KR_DTYPE_F32: return "F32";
    case KR_DTYPE_F16: return "F16";
    case KR_DTYPE_BF16: return "BF16";
    }
    return "?";
}

size_t kr_dtype_size(kr_dtype t)
{
    return t == KR_DTYPE_F32 ? 4 : 2;
}

float kr_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: exact as a float */
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    if (exp == 31) v.u = sign | 0x7f800000u | (man << 13);
    else v.u = sign | ((exp + 112) << 23) | (man << 13);
    return v.f;
}

uint16_t kr_f32_to_f16(float f)
{
    union { uint32_t u; float f; } v = {.f = f};
    uint32_t sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow to inf */
    if (a < 0x38800000u) { /* subnormal half: round to nearest even at 2^-24 */
        float r = nearbyintf(fabsf(f) * 16777216.0f);
        return (uint16_t)(sign | (uint16_t)r);
    }
    uint32_t h = ((a >> 13) - (112u << 10));
    uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

/* The vector loops below give exactly what the scalar conversions give (the tails), NaN
 * payloads aside: widening is exact, and narrowing rounds to nearest even in both. */
void kr_dtype_to_f32(kr_dtype t, const void *src, size_t n, float *dst)
{
    const uint16_t *h = src;
    size_t i = 0;
    switch (t) {
    case KR_DTYPE_BF16:
#if defined(__AVX2__) && defined(__F16C__)
        for (; i + 8 <= n; i += 8) {
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
#endif
        for (; i < n; i++) dst[i] = kr_bf16_to_f32(h[i]);
        return;
    case KR_DTYPE_F16:
#if defined(__AVX2__) && defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = kr_f16_to_f32(h[i]);
        return;
    case KR_DTYPE_F32: break;
    }
    memcpy(dst, src, n * sizeof(float));
}

void kr_dtype_from_f32(kr_dtype t, const float *src, size_t n, void *dst)
{
    uint16_t *h = dst;
    size_t i = 0;
    switch (t) {
    case KR_DTYPE_BF16:
#if defined(__AVX2__) && defined(__F16C__)
        for (; i + 8 <= n; i += 8) { /* kr_f32_to_bf16 on 8 lanes */
            __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
            __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                             _mm256_set1_epi32(0x7f800000));
            __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
            r = _mm256_blendv_epi8(r, quiet, nan);
            /* 32 -> 16 bits per lane (every value fits), the two halves put back in order */
            __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
            _mm_storeu_si128((__m128i *)(h + i), _mm256_castsi256_si128(packed));
        }
#endif
        for (; i < n; i++) h[i] = kr_f32_to_bf16(src[i]);
        return;
    case KR_DTYPE_F16:
#if defined(__AVX2__) && defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) h[i] = kr_f32_to_f16(src[i]);
        return;
    case KR_DTYPE_F32: break;
    }
    memcpy(dst, src, n * sizeof(float));
}
