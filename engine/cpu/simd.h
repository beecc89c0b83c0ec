/*
 * simd.h - the CPU backend's vector primitives: dot products of an f32 vector with f32, bf16
 * or f16 rows, and scaled adds of such rows. Which set is the variant's being compiled
 * (KR_CPU_LEVEL, set by CMakeLists.txt for each build of the engine/cpu sources, cpu.h): 3
 * AVX-512F with AVX-512-BF16 (these primitives as level 2; matmul.c adds its bf16 GEMM), 2
 * AVX-512F, 1 AVX2+FMA+F16C, 0 plain C (the readable definition; the others must agree with it
 * to float rounding). Weights and KV cache rows are upcast exactly to f32; all arithmetic is f32.
 * The row conversions (vf_load_f16_exact, vf_store_bf16, vf_store_f16: convert.c) agree with the
 * scalar ones of kr-util.h bit for bit, NaNs included.
 */
#ifndef KR_CPU_SIMD_H
#define KR_CPU_SIMD_H

#include "kr-util.h"

#include <math.h>

#if !defined(KR_CPU_LEVEL)
#error "engine/cpu sources are built once per instruction set: KR_CPU_LEVEL comes from CMakeLists.txt"
#elif KR_CPU_LEVEL >= 3 && !(defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#error "the AVX-512-BF16 variant needs -mavx512bf16 -mavx512bw -mavx512vl"
#elif KR_CPU_LEVEL >= 2 && !defined(__AVX512F__)
#error "the AVX-512 variant needs -mavx512f"
#elif KR_CPU_LEVEL == 1 && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the AVX2 variant needs -mavx2 -mfma -mf16c"
#endif

#if KR_CPU_LEVEL >= 1
#include <immintrin.h>
#endif

#if KR_CPU_LEVEL >= 2
#define KR_VL 16
typedef __m512 kr_vf;
static inline kr_vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline kr_vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline kr_vf vf_load_bf16(const uint16_t *p)
{
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
static inline kr_vf vf_load_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* vf_load_f16 bit for bit as kr_f16_to_f32 gives it: the instruction quiets a signalling NaN,
 * which the scalar conversion (and this) keeps as it is */
static inline kr_vf vf_load_f16_exact(const uint16_t *p)
{
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    __m512i h = _mm512_cvtepu16_epi32(raw);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(h, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7c00));
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x8000)), 16);
    __m512i man = _mm512_slli_epi32(_mm512_and_si512(h, _mm512_set1_epi32(0x3ff)), 13);
    __m512i bits = _mm512_or_si512(_mm512_or_si512(sign, man), _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_ps(nan, _mm512_cvtph_ps(raw), _mm512_castsi512_ps(bits));
}
/* KR_VL floats rounded to bf16 as kr_f32_to_bf16 rounds them: to nearest even, NaN quieted */
static inline void vf_store_bf16(uint16_t *p, kr_vf v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
/* KR_VL floats rounded to f16 as kr_f32_to_f16 rounds them: the instruction rounds to nearest
 * even with subnormals and overflows to infinity as it does, and a NaN becomes the quiet NaN of
 * its sign first, because the instruction would keep the top bits of its payload */
static inline void vf_store_f16(uint16_t *p, kr_vf v)
{
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)),
                                    _mm512_set1_epi32(0x7fc00000));
    v = _mm512_mask_blend_ps(nan, v, _mm512_castsi512_ps(quiet));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* 2*KR_VL bf16 values as their even- and odd-indexed halves: a shift and a mask, no shuffle */
static inline void vf_load_bf16_eo(const uint16_t *p, kr_vf *even, kr_vf *odd)
{
    __m512i v = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline kr_vf vf_fma(kr_vf a, kr_vf b, kr_vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline kr_vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline void vf_store(float *p, kr_vf v) { _mm512_storeu_ps(p, v); }
static inline float vf_sum(kr_vf v) { return _mm512_reduce_add_ps(v); }
static inline kr_vf vf_add(kr_vf a, kr_vf b) { return _mm512_add_ps(a, b); }
static inline kr_vf vf_sub(kr_vf a, kr_vf b) { return _mm512_sub_ps(a, b); }
static inline kr_vf vf_mul(kr_vf a, kr_vf b) { return _mm512_mul_ps(a, b); }
static inline kr_vf vf_div(kr_vf a, kr_vf b) { return _mm512_div_ps(a, b); }
static inline kr_vf vf_neg_abs(kr_vf a) /* -|a| */
{
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)));
}
static inline kr_vf vf_select_nonneg(kr_vf x, kr_vf a, kr_vf b) /* x >= 0 ? a : b, per lane */
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
static inline kr_vf vf_max(kr_vf a, kr_vf b) { return _mm512_max_ps(a, b); }
static inline kr_vf vf_round(kr_vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
/* a * 2^n for integral n in [-127, 127] (carried as floats) */
static inline kr_vf vf_ldexp(kr_vf a, kr_vf n)
{
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(a, _mm512_castsi512_ps(e));
}
#elif KR_CPU_LEVEL == 1
#define KR_VL 8
typedef __m256 kr_vf;
static inline kr_vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline kr_vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline kr_vf vf_load_bf16(const uint16_t *p)
{
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline kr_vf vf_load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline kr_vf vf_load_f16_exact(const uint16_t *p)
{
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    __m256i h = _mm256_cvtepu16_epi32(raw);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7fff)), _mm256_set1_epi32(0x7c00));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x8000)), 16);
    __m256i man = _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x3ff)), 13);
    __m256i bits = _mm256_or_si256(_mm256_or_si256(sign, man), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_ps(_mm256_cvtph_ps(raw), _mm256_castsi256_ps(bits), _mm256_castsi256_ps(nan));
}
static inline void vf_store_bf16(uint16_t *p, kr_vf v)
{
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    /* 32 -> 16 bits per lane (every value fits), the two halves put back in order */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
static inline void vf_store_f16(uint16_t *p, kr_vf v)
{
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    __m256 quiet = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    v = _mm256_blendv_ps(v, quiet, nan);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline void vf_load_bf16_eo(const uint16_t *p, kr_vf *even, kr_vf *odd)
{
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline kr_vf vf_fma(kr_vf a, kr_vf b, kr_vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline kr_vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline void vf_store(float *p, kr_vf v) { _mm256_storeu_ps(p, v); }
static inline float vf_sum(kr_vf v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline kr_vf vf_add(kr_vf a, kr_vf b) { return _mm256_add_ps(a, b); }
static inline kr_vf vf_sub(kr_vf a, kr_vf b) { return _mm256_sub_ps(a, b); }
static inline kr_vf vf_mul(kr_vf a, kr_vf b) { return _mm256_mul_ps(a, b); }
static inline kr_vf vf_div(kr_vf a, kr_vf b) { return _mm256_div_ps(a, b); }
static inline kr_vf vf_neg_abs(kr_vf a) { return _mm256_or_ps(a, _mm256_set1_ps(-0.0f)); }
static inline kr_vf vf_select_nonneg(kr_vf x, kr_vf a, kr_vf b)
{
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
static inline kr_vf vf_max(kr_vf a, kr_vf b) { return _mm256_max_ps(a, b); }
static inline kr_vf vf_round(kr_vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline kr_vf vf_ldexp(kr_vf a, kr_vf n)
{
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
#else
#define KR_VL 1
typedef float kr_vf;
static inline kr_vf vf_zero(void) { return 0.0f; }
static inline kr_vf vf_load(const float *p) { return *p; }
static inline kr_vf vf_load_bf16(const uint16_t *p) { return kr_bf16_to_f32(*p); }
static inline kr_vf vf_load_f16(const uint16_t *p) { return kr_f16_to_f32(*p); }
static inline kr_vf vf_load_f16_exact(const uint16_t *p) { return kr_f16_to_f32(*p); }
static inline void vf_store_bf16(uint16_t *p, kr_vf v) { *p = kr_f32_to_bf16(v); }
static inline void vf_store_f16(uint16_t *p, kr_vf v) { *p = kr_f32_to_f16(v); }
static inline void vf_load_bf16_eo(const uint16_t *p, kr_vf *even, kr_vf *odd)
{
    *even = kr_bf16_to_f32(p[0]);
    *odd = kr_bf16_to_f32(p[1]);
}
static inline kr_vf vf_fma(kr_vf a, kr_vf b, kr_vf c) { return a * b + c; }
static inline kr_vf vf_set1(float x) { return x; }
static inline void vf_store(float *p, kr_vf v) { *p = v; }
static inline float vf_sum(kr_vf v) { return v; }
static inline kr_vf vf_add(kr_vf a, kr_vf b) { return a + b; }
static inline kr_vf vf_sub(kr_vf a, kr_vf b) { return a - b; }
static inline kr_vf vf_mul(kr_vf a, kr_vf b) { return a * b; }
static inline kr_vf vf_div(kr_vf a, kr_vf b) { return a / b; }
static inline kr_vf vf_neg_abs(kr_vf a) { return -fabsf(a); }
static inline kr_vf vf_select_nonneg(kr_vf x, kr_vf a, kr_vf b) { return x >= 0.0f ? a : b; }
static inline kr_vf vf_max(kr_vf a, kr_vf b) { return a > b ? a : b; }
static inline kr_vf vf_round(kr_vf a) { return nearbyintf(a); }
static inline kr_vf vf_ldexp(kr_vf a, kr_vf n) { return ldexpf(a, (int)n); }
#endif

/* x reordered for vf_load_bf16_eo: each block of 2*KR_VL values becomes its even-indexed
 * values then its odd-indexed ones; a tail shorter than a block stays in order. */
static inline void kr_deinterleave(const float *x, int n, float *out)
{
    int i = 0;
    for (; i + 2 * KR_VL <= n; i += 2 * KR_VL)
        for (int k = 0; k < KR_VL; k++) out[i + k] = x[i + 2 * k], out[i + KR_VL + k] = x[i + 2 * k + 1];
    for (; i < n; i++) out[i] = x[i];
}

static inline float kr_f32_at(float x) { return x; }

/* kr_dot_T(a, b, n): the f32 vector a dotted with row b of dtype T; kr_axpy_T(y, a, x, n):
 * y[0..n) += a * x[0..n) for a row x of dtype T. One definition for the three dtypes, so a bf16
 * or f16 row gives bit for bit what its exactly widened f32 row gives: a KV cache of any dtype
 * computes as the f32 path would on its rounded entries. */
#define KR_DEFINE_ROW_OPS(T, ELEM, LOAD, AT)                                                         \
    static inline float kr_dot_##T(const float *a, const ELEM *b, int n)                              \
    {                                                                                                 \
        kr_vf s0 = vf_zero(), s1 = vf_zero();                                                         \
        int i = 0;                                                                                    \
        for (; i + 2 * KR_VL <= n; i += 2 * KR_VL) {                                                  \
            s0 = vf_fma(vf_load(a + i), LOAD(b + i), s0);                                             \
            s1 = vf_fma(vf_load(a + i + KR_VL), LOAD(b + i + KR_VL), s1);                             \
        }                                                                                             \
        for (; i + KR_VL <= n; i += KR_VL) s0 = vf_fma(vf_load(a + i), LOAD(b + i), s0);             \
        float s = vf_sum(s0) + vf_sum(s1);                                                            \
        for (; i < n; i++) s += a[i] * AT(b[i]);                                                      \
        return s;                                                                                     \
    }                                                                                                 \
    static inline void kr_axpy_##T(float *y, float a, const ELEM *x, int n)                           \
    {                                                                                                 \
        kr_vf va = vf_set1(a);                                                                        \
        int i = 0;                                                                                    \
        for (; i + KR_VL <= n; i += KR_VL) vf_store(y + i, vf_fma(va, LOAD(x + i), vf_load(y + i))); \
        for (; i < n; i++) y[i] += a * AT(x[i]);                                                      \
    }
KR_DEFINE_ROW_OPS(f32, float, vf_load, kr_f32_at)
KR_DEFINE_ROW_OPS(bf16, uint16_t, vf_load_bf16, kr_bf16_to_f32)
KR_DEFINE_ROW_OPS(f16, uint16_t, vf_load_f16, kr_f16_to_f32)

/* The same on a KV cache row of dtype t (a pool's dtype: one well-predicted branch per row). */
static inline float kr_dot_row(const float *a, const void *row, kr_dtype t, int n)
{
    switch (t) {
    case KR_DTYPE_BF16: return kr_dot_bf16(a, row, n);
    case KR_DTYPE_F16: return kr_dot_f16(a, row, n);
    case KR_DTYPE_F32: break;
    }
    return kr_dot_f32(a, row, n);
}

static inline void kr_axpy_row(float *y, float a, const void *row, kr_dtype t, int n)
{
    switch (t) {
    case KR_DTYPE_BF16: kr_axpy_bf16(y, a, row, n); return;
    case KR_DTYPE_F16: kr_axpy_f16(y, a, row, n); return;
    case KR_DTYPE_F32: break;
    }
    kr_axpy_f32(y, a, row, n);
}

/* exp(x) for x <= 0 (softmax after subtracting the max): x = n ln2 + r with |r| <= ln2/2
 * (ln2 split in two for an exact product), exp(r) by its degree-7 Taylor polynomial
 * (truncation error < 6e-9 relative), times 2^n. Inputs below -87 are taken as -87 (exp is
 * then 1.6e-38 instead of smaller: nothing a softmax can see). Within a few ulp of expf, which
 * test_ops checks. */
static inline kr_vf kr_vexp_nonpos(kr_vf x)
{
    const kr_vf lo = vf_set1(-87.0f);
    kr_vf xc = vf_max(x, lo);
    kr_vf n = vf_round(vf_fma(xc, vf_set1(1.44269504088896341f), vf_zero()));
    kr_vf r = vf_fma(n, vf_set1(-0.693359375f), xc); /* ln2 high part: exact product */
    r = vf_fma(n, vf_set1(2.12194440e-4f), r); /* ln2 = 0.693359375 - 2.12194440e-4 */
    kr_vf p = vf_set1(1.0f / 5040.0f);
    p = vf_fma(p, r, vf_set1(1.0f / 720.0f));
    p = vf_fma(p, r, vf_set1(1.0f / 120.0f));
    p = vf_fma(p, r, vf_set1(1.0f / 24.0f));
    p = vf_fma(p, r, vf_set1(1.0f / 6.0f));
    p = vf_fma(p, r, vf_set1(0.5f));
    p = vf_fma(p, r, vf_set1(1.0f));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_ldexp(p, n);
}

/* x[i] = exp(x[i] - m) for i < n (every x[i] <= m); returns the sum of the results */
static inline float kr_exp_shift_sum(float *x, int n, float m)
{
    kr_vf vm = vf_set1(m), acc = vf_zero();
    int i = 0;
    for (; i + KR_VL <= n; i += KR_VL) {
        kr_vf e = kr_vexp_nonpos(vf_sub(vf_load(x + i), vm));
        vf_store(x + i, e);
        acc = vf_fma(e, vf_set1(1.0f), acc);
    }
    float s = vf_sum(acc);
    for (; i < n; i++) s += x[i] = expf(x[i] - m);
    return s;
}

/* y[0..n) *= a */
static inline void kr_scale(float *y, float a, int n)
{
    for (int i = 0; i < n; i++) y[i] *= a;
}

#endif
