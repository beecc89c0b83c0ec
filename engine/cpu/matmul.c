/*
 * matmul.c - y[n][out] (+)= x[n][in] . W[out][in]^T (+ bias) on the CPU backend.
 * Output rows are split over the thread pool. Few tokens (decode): each thread streams its
 * weight rows once, one row at a time, dotting each with every token (memory-bound; bf16 and
 * f16 rows are upcast in registers, never in memory; bf16 pairs are split into even and odd
 * lanes with a shift and a mask against a token vector reordered to match, because the
 * widening shuffle was the bottleneck, not memory). Many tokens (prefill): OpenBLAS sgemm per
 * thread on its rows, bf16/f16 rows first upcast into a per-thread f32 slab; on a CPU with
 * AVX-512-BF16, bf16 weights instead go through this file's GEMM of bf16 pairs (x rounded to
 * bf16, f32 sums).
 * The paths round differently. `kr_cpu_matmul_rows` (decode batches) always takes the
 * dot-product path: a token's result there does not depend on how many tokens share the call
 * or on the thread count, so it equals the one-token call bit for bit.
 */
#include "cpu.h"
#include "simd.h"

#include <cblas.h>
#include <string.h>

/* One bf16 row against x reordered by kr_deinterleave; two sums, so that the adds of the even
 * and odd halves do not wait on each other. */
static float dot1_bf16eo(const float *x, const uint16_t *w, int in)
{
    kr_vf a = vf_zero(), b = vf_zero(), e, o;
    int i = 0;
    for (; i + 2 * KR_VL <= in; i += 2 * KR_VL) {
        vf_load_bf16_eo(w + i, &e, &o);
        a = vf_fma(vf_load(x + i), e, a);
        b = vf_fma(vf_load(x + i + KR_VL), o, b);
    }
    float s = vf_sum(vf_add(a, b));
    for (; i < in; i++) s += x[i] * kr_bf16_to_f32(w[i]);
    return s;
}

typedef struct mm_job {
    kr_backend *b;
    const kr_tensor *w;
    const kr_tensor *bias;
    const float *x;
    int n;
    int accumulate;
    int rows_alone; /* every token on the dot-product path, whatever n */
    int bf16_x; /* x rounded to bf16 in b->xbf16, bf16 pairs dotted (KR_CPU_LEVEL 3) */
    float *y;
} mm_job;

static float dot1(const kr_tensor *w, int64_t o, const float *x)
{
    int in = (int)w->cols;
    switch (w->dtype) {
    case KR_DTYPE_BF16: return dot1_bf16eo(x, (const uint16_t *)w->data + o * in, in);
    case KR_DTYPE_F16: return kr_dot_f16(x, (const uint16_t *)w->data + o * in, in);
    default: return kr_dot_f32(x, (const float *)w->data + o * in, in);
    }
}

/* One weight row at a time, every token against it while it is in L1: the thread reads its rows
 * front to back in one stream, which the hardware prefetcher follows at full speed (groups of
 * rows read side by side reached two thirds of that on rows of 1.5 KB) */
static void matvec_rows(const mm_job *j, int64_t lo, int64_t hi)
{
    const int64_t in = j->w->cols, out = j->w->rows;
    const float *x = j->w->dtype == KR_DTYPE_BF16 ? j->b->xperm : j->x;
    for (int64_t o = lo; o < hi; o++)
        for (int t = 0; t < j->n; t++) {
            float *y = j->y + t * out + o;
            *y = (j->accumulate ? *y : 0.0f) + dot1(j->w, o, x + t * in);
        }
}

static void gemm_rows(const mm_job *j, int ith, int64_t lo, int64_t hi)
{
    const int64_t in = j->w->cols, out = j->w->rows;
    const float beta = j->accumulate ? 1.0f : 0.0f;
    if (j->w->dtype == KR_DTYPE_F32) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, (int)(hi - lo), (int)in, 1.0f,
                    j->x, (int)in, (const float *)j->w->data + lo * in, (int)in, beta, j->y + lo,
                    (int)out);
        return;
    }
    float *slab = j->b->slab[ith];
    int64_t step = (int64_t)(j->b->slab_floats / (size_t)in);
    size_t esz = kr_dtype_size(j->w->dtype);
    for (int64_t r0 = lo; r0 < hi; r0 += step) {
        int64_t rows = hi - r0 < step ? hi - r0 : step;
        kr_cpu_to_f32(j->w->dtype, (const char *)j->w->data + (size_t)(r0 * in) * esz, (size_t)(rows * in),
                      slab);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, (int)rows, (int)in, 1.0f, j->x,
                    (int)in, slab, (int)in, beta, j->y + r0, (int)out);
    }
}

#if KR_CPU_LEVEL >= 3
/* ---- bf16 weights on AVX-512-BF16: vdpbf16ps multiplies pairs of bf16 and adds both exact
 * products to an f32 lane, so x is rounded to bf16 once per call (xbf16_task) and the weights
 * are used as they are, twice the multiply rate of f32 FMAs and no widened copy. A thread packs
 * BF_NR of its weight rows at a time, over BF_KC columns, into a panel (slab) that stays in
 * cache (L2) while every token passes over it, BF_MR tokens at a time: 24 accumulators of 16
 * outputs. BF_KC covers the usual hidden and MLP widths in one block, so each output is written
 * once (blocks of 512 columns cost 10% on 2048 x 768, where the outputs are rewritten).
 * Each output's sum runs over k in the same order whatever n, the thread count or the tile a
 * token falls in, so a token's result does not depend on the call's other tokens. */
enum { BF_MR = 8, BF_NR = 48, BF_KC = 2048 };

/* x[n][in] rounded to bf16 into xb[n][ldx], ldx = in rounded up to even, the pad zero */
static void xbf16_task(void *arg, int ith, int nth)
{
    const mm_job *j = arg;
    const int64_t in = j->w->cols, ldx = (in + 1) & ~(int64_t)1;
    int64_t lo, hi;
    kr_split(j->n, ith, nth, 1, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        kr_cpu_from_f32(KR_DTYPE_BF16, j->x + t * in, (size_t)in, j->b->xbf16 + t * ldx);
        if (ldx > in) j->b->xbf16[t * ldx + in] = 0;
    }
}

/* Weight rows [o0, o0 + nr) over columns [k0, k0 + kc) as [kc / 2][BF_NR][2]: the pair of
 * output r at column 2p is panel[(p * BF_NR + r) * 2 ..]. Rows past nr and a column past the
 * row's end (an odd in) are zero. */
static void bf_pack(const uint16_t *w, int64_t in, int64_t o0, int nr, int64_t k0, int kc, uint16_t *panel)
{
    const int kp = (kc + 1) / 2;
    for (int r = 0; r < BF_NR; r++) {
        uint16_t *dst = panel + (size_t)r * 2;
        if (r >= nr) {
            for (int p = 0; p < kp; p++) dst[(size_t)p * BF_NR * 2] = dst[(size_t)p * BF_NR * 2 + 1] = 0;
            continue;
        }
        const uint16_t *src = w + (o0 + r) * in + k0;
        const int64_t left = in - k0;
        for (int p = 0; p < kp; p++) {
            dst[(size_t)p * BF_NR * 2] = src[2 * p];
            dst[(size_t)p * BF_NR * 2 + 1] = 2 * p + 1 < left ? src[2 * p + 1] : 0;
        }
    }
}

/* y[MR][nr] (+)= xb[MR][kp pairs] . panel over kp pairs; add: add to y, else overwrite */
static inline __attribute__((always_inline)) void bf_tile(const int MR, const uint16_t *xb, int64_t ldx,
                                                          const uint16_t *panel, int kp, float *y,
                                                          int64_t ldy, int nr, int add)
{
    /* the loops over r unrolled, so that the accumulators live in registers */
    __m512 acc[BF_MR][3];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = acc[r][2] = _mm512_setzero_ps();
    for (int p = 0; p < kp; p++) {
        const uint16_t *bp = panel + (size_t)p * BF_NR * 2;
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 32),
                 b2 = (__m512bh)_mm512_loadu_si512(bp + 64);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            int32_t pair;
            memcpy(&pair, xb + r * ldx + 2 * p, sizeof pair);
            __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 3
        for (int q = 0; q < 3; q++) {
            int left = nr - 16 * q;
            if (left <= 0) break;
            __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
            float *dst = y + r * ldy + 16 * q;
            __m512 v = add ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, dst), acc[r][q]) : acc[r][q];
            _mm512_mask_storeu_ps(dst, m, v);
        }
}

static void bf_gemm_rows(const mm_job *j, int ith, int64_t lo, int64_t hi)
{
    const int64_t in = j->w->cols, out = j->w->rows, ldx = (in + 1) & ~(int64_t)1;
    const uint16_t *w = j->w->data;
    uint16_t *panel = (uint16_t *)j->b->slab[ith]; /* BF_NR x BF_KC bf16, 192 KB: within the slab */
    for (int64_t k0 = 0; k0 < in; k0 += BF_KC) {
        const int kc = (int)(in - k0 < BF_KC ? in - k0 : BF_KC), kp = (kc + 1) / 2;
        const int add = k0 > 0 || j->accumulate;
        for (int64_t o0 = lo; o0 < hi; o0 += BF_NR) {
            const int nr = (int)(hi - o0 < BF_NR ? hi - o0 : BF_NR);
            bf_pack(w, in, o0, nr, k0, kc, panel);
            const uint16_t *xb = j->b->xbf16 + k0;
            float *y = j->y + o0;
            int t = 0;
            for (; t + BF_MR <= j->n; t += BF_MR)
                bf_tile(BF_MR, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add);
            switch (j->n - t) { /* the tokens left, each count its own unrolled tile */
            case 7: bf_tile(7, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add); break;
            case 6: bf_tile(6, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add); break;
            case 5: bf_tile(5, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add); break;
            case 4: bf_tile(4, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add); break;
            case 3: bf_tile(3, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add); break;
            case 2: bf_tile(2, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add); break;
            case 1: bf_tile(1, xb + t * ldx, ldx, panel, kp, y + t * out, out, nr, add); break;
            default: break;
            }
        }
    }
}
#endif

static void mm_task(void *arg, int ith, int nth)
{
    const mm_job *j = arg;
    int64_t lo, hi;
    kr_split(j->w->rows, ith, nth, 16, &lo, &hi);
    if (lo >= hi) return;
#if KR_CPU_LEVEL >= 3
    if (j->bf16_x) bf_gemm_rows(j, ith, lo, hi);
    else
#endif
        if (j->rows_alone || j->n < GEMM_MIN_TOKENS) matvec_rows(j, lo, hi);
    else gemm_rows(j, ith, lo, hi);
    if (j->bias && j->bias->data) {
        const float *bias = j->bias->data;
        for (int t = 0; t < j->n; t++) {
            float *y = j->y + (int64_t)t * j->w->rows;
            for (int64_t o = lo; o < hi; o++) y[o] += bias[o];
        }
    }
}

static void matmul(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                   int accumulate, int rows_alone, float *y)
{
    mm_job j = {.b = b, .w = w, .bias = bias, .x = x, .n = n, .accumulate = accumulate,
                .rows_alone = rows_alone, .y = y};
    if ((rows_alone || n < GEMM_MIN_TOKENS) && w->dtype == KR_DTYPE_BF16)
        for (int t = 0; t < n; t++) kr_deinterleave(x + t * w->cols, (int)w->cols, b->xperm + t * w->cols);
#if KR_CPU_LEVEL >= 3
    if (!rows_alone && n >= GEMM_MIN_TOKENS && w->dtype == KR_DTYPE_BF16) {
        /* xbf16 holds xbf16_rows tokens: more are taken that many at a time */
        j.bf16_x = 1;
        for (int t0 = 0; t0 < n; t0 += b->xbf16_rows) {
            j.x = x + (int64_t)t0 * w->cols;
            j.y = y + (int64_t)t0 * w->rows;
            j.n = n - t0 < b->xbf16_rows ? n - t0 : b->xbf16_rows;
            kr_threadpool_run(b->tp, xbf16_task, &j);
            kr_threadpool_run(b->tp, mm_task, &j);
        }
        return;
    }
#endif
    kr_threadpool_run(b->tp, mm_task, &j);
}

void kr_cpu_matmul(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                   int accumulate, float *y)
{
    matmul(b, w, bias, x, n, accumulate, 0, y);
}

void kr_cpu_matmul_rows(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                        int accumulate, float *y)
{
    matmul(b, w, bias, x, n, accumulate, 1, y);
}
