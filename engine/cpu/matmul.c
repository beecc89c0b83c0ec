/*
 * matmul.c - y[n][out] (+)= x[n][in] . W[out][in]^T (+ bias) on the CPU backend.
 * Output rows are split over the thread pool. Two paths, which round differently:
 * - few tokens (< GEMM_MIN_TOKENS) and every decode batch (`kr_cpu_matmul_rows`): dot products,
 *   register-blocked over tiles of weight rows x tokens, each weight row streamed from memory
 *   once per call (dot_rows). A token's result does not depend on how many tokens share the call
 *   or on the thread count, so a decode batch equals its one-token calls bit for bit. bf16 and
 *   f16 rows are widened in registers; on a CPU with AVX-512-BF16, bf16 rows are multiplied by
 *   vdpbf16ps against x rounded to bf16 (pairs of exact products, f32 sums), as prefill does.
 * - many tokens (prefill): OpenBLAS sgemm per thread on its rows, bf16/f16 rows first upcast
 *   into a per-thread f32 slab; on a CPU with AVX-512-BF16, bf16 weights go through this file's
 *   GEMM of bf16 pairs instead (x rounded to bf16, f32 sums).
 * Not here: attention (attention.c) and the element-wise ops (backend.c).
 */
#include "cpu.h"
#include "simd.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

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

/* ---- Few tokens and decode batches: every output is the dot product of one weight row with one
 * token, and a token's dot product is computed the same way whatever else shares the call.
 * A thread streams its weight rows once, front to back; while a tile of DOT_RB rows is in L1,
 * every token passes over it, DOT_TB tokens at a time: each chunk of a row is loaded (and
 * widened) once per tile and each chunk of a token once per tile, and they feed the tile's
 * DOT_RB x DOT_TB pairs of accumulators, which live in registers. Each (row, token) has its own
 * two accumulators over alternate chunks, its own column order and its own final reduction, so
 * the tile it falls in, the batch size and the thread count never change its arithmetic: one
 * token is this kernel with a 1 x 1 tile, bit for bit the same sums. Tails are exact fmaf, never
 * left to the compiler's contraction, so that every tile shape rounds them alike. */
#if KR_CPU_LEVEL >= 2
#define DOT_TB 6 /* 2 x 6 pairs of accumulators + 4 weight vectors: 28 of 32 registers */
#else
#define DOT_TB 2 /* 2 x 2 pairs + 4 weight vectors: 12 of 16 registers */
#endif
#define DOT_RB 2
/* the vdpbf16ps kernel's tile (dot_tile_dpbf16) from two tokens on, and how far ahead its
 * first token tile asks for rows */
enum { DP_RB = 4, DP_TB = 6, DP_PREFETCH = 16384 };
/* One token reads one row at a time, a single front-to-back stream that the hardware prefetcher
 * follows at full speed (memory binds). More tokens read tiles of DOT_RB rows and ask for the
 * rows DOT_PREFETCH bytes ahead into L2 (prefetcht1): without it a tile's arithmetic and its
 * rows' reads took turns (llama-110m, bf16, 1 thread, Zen 4: the matmuls of a step took
 * 20 / 23 / 22.5 / 67 ms at 2 / 4 / 8 / 32 tokens, 11.8 / 10.3 / 18 / 49 ms with it; ahead into
 * L1 instead, it cost time: the rows pushed the tokens out). One token keeps the stream: the
 * prefetches cost it 5-10%. */
enum { DOT_RB_MIN_TOKENS = 2, DOT_PREFETCH = 8192 };

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* s[r * DOT_TB + t] = x[t] . w[r] for RB rows (w[r] at w + r * ldw) and TB tokens (x[t] at
 * x + t * ldx): f32 or f16 rows widened in registers, chunks of KR_VL columns */
static ALWAYS_INLINE void dot_tile_f32_f16(const int RB, const int TB, const int f16, const float *x,
                                           int64_t ldx, const void *w, int64_t ldw, int in, float *s)
{
    kr_vf a[DOT_RB][DOT_TB], b[DOT_RB][DOT_TB];
#pragma GCC unroll 2
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) a[r][t] = b[r][t] = vf_zero();
    const float *wf = w;
    const uint16_t *wh = w;
#define DOT_LOAD_W(r, i) (f16 ? vf_load_f16(wh + (r) * ldw + (i)) : vf_load(wf + (r) * ldw + (i)))
    int i = 0;
    for (; i + 2 * KR_VL <= in; i += 2 * KR_VL) {
        kr_vf w0[DOT_RB], w1[DOT_RB];
#pragma GCC unroll 2
        for (int r = 0; r < RB; r++) w0[r] = DOT_LOAD_W(r, i), w1[r] = DOT_LOAD_W(r, i + KR_VL);
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) {
            const kr_vf x0 = vf_load(x + t * ldx + i), x1 = vf_load(x + t * ldx + i + KR_VL);
#pragma GCC unroll 2
            for (int r = 0; r < RB; r++) a[r][t] = vf_fma(x0, w0[r], a[r][t]), b[r][t] = vf_fma(x1, w1[r], b[r][t]);
        }
    }
    for (; i + KR_VL <= in; i += KR_VL)
#pragma GCC unroll 2
        for (int r = 0; r < RB; r++) {
            const kr_vf w0 = DOT_LOAD_W(r, i);
#pragma GCC unroll 8
            for (int t = 0; t < TB; t++) a[r][t] = vf_fma(vf_load(x + t * ldx + i), w0, a[r][t]);
        }
#undef DOT_LOAD_W
#pragma GCC unroll 2
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) {
            float v = vf_sum(a[r][t]) + vf_sum(b[r][t]);
            for (int k = i; k < in; k++)
                v = fmaf(x[t * ldx + k], f16 ? kr_f16_to_f32(wh[r * ldw + k]) : wf[r * ldw + k], v);
            s[r * DOT_TB + t] = v;
        }
}

/* The same for bf16 rows widened in registers: each chunk of 2 * KR_VL columns is split into its
 * even and odd columns with a shift and a mask (the widening shuffle was the bottleneck), against
 * x reordered to match (kr_deinterleave); one accumulator for the even, one for the odd */
static ALWAYS_INLINE void dot_tile_bf16eo(const int RB, const int TB, const float *x, int64_t ldx,
                                          const uint16_t *w, int64_t ldw, int in, float *s)
{
    kr_vf a[DOT_RB][DOT_TB], b[DOT_RB][DOT_TB];
#pragma GCC unroll 2
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) a[r][t] = b[r][t] = vf_zero();
    int i = 0;
    for (; i + 2 * KR_VL <= in; i += 2 * KR_VL) {
        kr_vf e[DOT_RB], o[DOT_RB];
#pragma GCC unroll 2
        for (int r = 0; r < RB; r++) vf_load_bf16_eo(w + r * ldw + i, &e[r], &o[r]);
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) {
            const kr_vf x0 = vf_load(x + t * ldx + i), x1 = vf_load(x + t * ldx + i + KR_VL);
#pragma GCC unroll 2
            for (int r = 0; r < RB; r++) a[r][t] = vf_fma(x0, e[r], a[r][t]), b[r][t] = vf_fma(x1, o[r], b[r][t]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) {
            float v = vf_sum(vf_add(a[r][t], b[r][t]));
            for (int k = i; k < in; k++) v = fmaf(x[t * ldx + k], kr_bf16_to_f32(w[r * ldw + k]), v);
            s[r * DOT_TB + t] = v;
        }
}

#if KR_CPU_LEVEL >= 3
/* bf16 rows on AVX-512-BF16, against x rounded to bf16 (matmul): vdpbf16ps multiplies a chunk of
 * 32 columns pairwise and adds both exact products of a pair to an f32 lane, twice the multiply
 * rate of f32 FMAs and nothing to widen. Each (row, token) pair has one accumulator, chunk after
 * chunk in column order, the last partial chunk masked (zero past the row's end); a tile is up to
 * DP_RB rows x DP_TB tokens (24 accumulators, 4 weight vectors and a token's vector in the 32
 * registers), so a chunk of 32 columns costs 10 loads for 24 multiplies. The tile's sums come
 * out of dp_sum16, which sums 16 accumulators' lanes at once, and go to the outputs 4 at a time
 * (the scalar stores and the additions one output at a time took a tenth of a batch of 8's
 * matmuls). With pf, the first token tile over some rows asks for the rows DP_PREFETCH bytes
 * ahead into L2, one line per row per chunk, spread through its loop: prefetches issued a tile at
 * a time held up the loads and made memory and arithmetic take turns (llama-110m's matmuls, bf16,
 * 1 thread, Zen 4, busy machine, the thread's own CPU time: 8 tokens 17.5 ms without, 14.8 with);
 * 16 KB ahead was the best of 4, 8, 12, 16, 24 and 32. One token reads one row at a time without
 * prefetches, the single stream the hardware prefetcher follows, its chunk loop unrolled twice:
 * on an idle machine that matched the kernel before (two accumulators per pair) within 1%,
 * where 4-row tiles with the prefetches took 10% longer and 2 or 4 rows without them 1.6-1.8x. */

/* The sums of 16 vectors' lanes, each by the same tree whatever vectors share the call: lanes k
 * and k + 8 first, then k and k + 4, k and k + 2, k and k + 1. The vectors are transposed as they
 * are summed (15 shuffle pairs and adds for 16 sums, where one horizontal sum each takes about 8
 * operations); lanes of different vectors never meet. Lane 4q + s of the result holds v[4s + q]'s
 * sum. */
static ALWAYS_INLINE __m512 dp_sum16(const __m512 *v)
{
    __m512 b[8], c[4], d[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) /* [v 0-7 | w 0-7] + [v 8-15 | w 8-15] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) /* quarters of 4 lanes, one per vector: k + (k + 4) */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) /* in each quarter, pairs: k + (k + 2) */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
}

/* Where a tile's results go: y[t * ldy + r] for token t and row r, added to what y holds when
 * accumulate, else to 0 (as every path of this file writes an output) */
typedef struct dp_out {
    float *y;
    int64_t ldy;
    int accumulate;
} dp_out;

/* The accumulators are held as a[g][r * 4 + t % 4] for the tile's tokens 4g .. 4g + 3, so that
 * dp_sum16 of a group gives each token's 4 rows in 4 neighbouring lanes: one 4-float store each. */
static ALWAYS_INLINE void dot_tile_dpbf16(const int RB, const int TB, const uint16_t *x, int64_t ldx,
                                          const uint16_t *w, int64_t ldw, int in, const uint16_t *pf,
                                          const dp_out *o)
{
    enum { GROUPS = (DP_TB + 3) / 4 };
    __m512 a[GROUPS][16];
#pragma GCC unroll 2
    for (int g = 0; g < GROUPS; g++)
#pragma GCC unroll 16
        for (int k = 0; k < 16; k++) a[g][k] = _mm512_setzero_ps();
    int i = 0;
#pragma GCC unroll 2
    for (; i + 32 <= in; i += 32) {
        __m512bh w0[DP_RB];
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) w0[r] = (__m512bh)_mm512_loadu_si512(w + r * ldw + i);
        if (pf)
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) _mm_prefetch((const char *)(pf + r * ldw + i), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int t = 0; t < TB; t++) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + t * ldx + i);
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) a[t / 4][r * 4 + t % 4] = _mm512_dpbf16_ps(a[t / 4][r * 4 + t % 4], x0, w0[r]);
        }
    }
    if (i < in) {
        const __mmask32 m = ((__mmask32)1 << (in - i)) - 1;
#pragma GCC unroll 4
        for (int r = 0; r < RB; r++) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * ldw + i);
#pragma GCC unroll 8
            for (int t = 0; t < TB; t++)
                a[t / 4][r * 4 + t % 4] = _mm512_dpbf16_ps(a[t / 4][r * 4 + t % 4],
                                                           (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * ldx + i), w0);
        }
    }
#pragma GCC unroll 2
    for (int g = 0; g * 4 < TB; g++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, dp_sum16(a[g]));
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            if (g * 4 + q >= TB) break;
            float *y = o->y + (g * 4 + q) * o->ldy;
            if (RB == 4) {
                const __m128 prev = o->accumulate ? _mm_loadu_ps(y) : _mm_setzero_ps();
                _mm_storeu_ps(y, _mm_add_ps(prev, _mm_loadu_ps(lanes + 4 * q)));
            } else
                for (int r = 0; r < RB; r++) y[r] = (o->accumulate ? y[r] : 0.0f) + lanes[4 * q + r];
        }
    }
}

#define DP_CASE(R, T)                                                                             \
    case (R) * 16 + (T): dot_tile_dpbf16(R, T, x, ldx, w, in, in, pf, o); return;
#define DP_CASES(R) DP_CASE(R, 1) DP_CASE(R, 2) DP_CASE(R, 3) DP_CASE(R, 4) DP_CASE(R, 5) DP_CASE(R, 6)

static void dp_tile(int rb, int tb, const uint16_t *x, int64_t ldx, const uint16_t *w, int in, const uint16_t *pf,
                    const dp_out *o)
{
    switch (rb * 16 + tb) {
        DP_CASES(1)
        DP_CASES(2)
        DP_CASES(3)
        DP_CASES(4)
    default: return;
    }
}
#undef DP_CASES
#undef DP_CASE
#endif

/* How a matmul's rows are dotted: by the weights' dtype, and for bf16 by the variant */
typedef enum dot_kind { DOT_F32, DOT_F16, DOT_BF16EO, DOT_DPBF16 } dot_kind;

static dot_kind dot_kind_of(kr_dtype t)
{
    switch (t) {
    case KR_DTYPE_BF16: return KR_CPU_LEVEL >= 3 ? DOT_DPBF16 : DOT_BF16EO;
    case KR_DTYPE_F16: return DOT_F16;
    case KR_DTYPE_F32: break;
    }
    return DOT_F32;
}

/* The tokens' layout for dot_rows: rounded to bf16 for vdpbf16ps, reordered for the even/odd
 * split, as given otherwise; rows of ldx values (64-byte multiples where the kernel loads them
 * from the backend's aligned scratch) */
static int64_t dot_ldx(dot_kind kind, int64_t in)
{
    switch (kind) {
    case DOT_DPBF16: return (in + 31) & ~(int64_t)31;
    case DOT_BF16EO: return (in + 15) & ~(int64_t)15;
    case DOT_F32:
    case DOT_F16: break;
    }
    return in;
}

/* One tile of RB rows x TB tokens (constants at each call site, so that the accumulators are
 * registers); x: the tile's first token, in the kind's layout */
static ALWAYS_INLINE void dot_tile_const(const int RB, const int TB, dot_kind kind, const void *x, int64_t ldx,
                                         const void *w, int in, float *s)
{
    switch (kind) {
    case DOT_F32: dot_tile_f32_f16(RB, TB, 0, x, ldx, w, in, in, s); return;
    case DOT_F16: dot_tile_f32_f16(RB, TB, 1, x, ldx, w, in, in, s); return;
    case DOT_BF16EO: dot_tile_bf16eo(RB, TB, x, ldx, w, in, in, s); return;
    case DOT_DPBF16: return; /* dp_tile */
    }
}

#define DOT_CASE(R, T)                                                                            \
    case (R) * 16 + (T): dot_tile_const(R, T, kind, x, ldx, w, in, s); return;
#if DOT_TB == 6
#define DOT_CASES(R) DOT_CASE(R, 1) DOT_CASE(R, 2) DOT_CASE(R, 3) DOT_CASE(R, 4) DOT_CASE(R, 5) DOT_CASE(R, 6)
#else
#define DOT_CASES(R) DOT_CASE(R, 1) DOT_CASE(R, 2)
#endif

static void dot_tile(int rb, int tb, dot_kind kind, const void *x, int64_t ldx, const void *w, int in, float *s)
{
    switch (rb * 16 + tb) {
        DOT_CASES(1)
        DOT_CASES(2)
    default: return;
    }
}
#undef DOT_CASES
#undef DOT_CASE

/* Output rows [lo, hi) of every token, the weight rows read once, front to back */
static void dot_rows(const mm_job *j, int64_t lo, int64_t hi)
{
    const int64_t in = j->w->cols, out = j->w->rows;
    const dot_kind kind = dot_kind_of(j->w->dtype);
    const size_t row_bytes = (size_t)in * kr_dtype_size(j->w->dtype);
    const void *x = kind == DOT_DPBF16 ? (const void *)j->b->xbf16
                    : kind == DOT_BF16EO ? (const void *)j->b->xperm : (const void *)j->x;
    const int64_t ldx = dot_ldx(kind, in);
    const size_t xsz = kind == DOT_DPBF16 ? sizeof(uint16_t) : sizeof(float);
    const int dp = KR_CPU_LEVEL >= 3 && kind == DOT_DPBF16;
    const int rb_most = j->n < DOT_RB_MIN_TOKENS ? 1 : dp ? DP_RB : DOT_RB, tile_tokens = dp ? DP_TB : DOT_TB;
    const int n_tiles = (j->n + tile_tokens - 1) / tile_tokens;
    float s[DOT_RB * DOT_TB];
    const char *end = (const char *)j->w->data + (size_t)hi * row_bytes;
    for (int64_t o = lo; o < hi; o += rb_most) {
        const int rb = hi - o < rb_most ? (int)(hi - o) : rb_most;
        const void *w = (const char *)j->w->data + (size_t)o * row_bytes;
        if (!dp && j->n >= DOT_RB_MIN_TOKENS) /* the tile DOT_PREFETCH bytes ahead, into L2 */
            for (const char *p = (const char *)w + DOT_PREFETCH; p < (const char *)w + DOT_PREFETCH + rb * row_bytes && p < end; p += 64)
                __builtin_prefetch(p, 0, 2);
        /* the tokens in n_tiles tiles as even as can be (8 tokens: 4 + 4, not 6 + 2): a tile of
         * few tokens costs nearly the time of a full one */
        for (int k = 0, t0 = 0; k < n_tiles; k++) {
            const int tb = j->n / n_tiles + (k < j->n % n_tiles), tile_t0 = t0;
            t0 += tb;
            const void *xt = (const char *)x + (size_t)(tile_t0 * ldx) * xsz;
#if KR_CPU_LEVEL >= 3
            if (dp) {
                const dp_out to = {.y = j->y + tile_t0 * out + o, .ldy = out, .accumulate = j->accumulate};
                const int ask = k == 0 && j->n >= DOT_RB_MIN_TOKENS; /* one token: the hardware's stream */
                dp_tile(rb, tb, xt, ldx, w, (int)in, ask ? (const uint16_t *)w + DP_PREFETCH / 2 : NULL, &to);
                continue;
            }
#endif
            dot_tile(rb, tb, kind, xt, ldx, w, (int)in, s);
            for (int r = 0; r < rb; r++)
                for (int t = 0; t < tb; t++) {
                    float *y = j->y + (tile_t0 + t) * out + o + r;
                    *y = (j->accumulate ? *y : 0.0f) + s[r * DOT_TB + t];
                }
        }
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
        if (j->rows_alone || j->n < GEMM_MIN_TOKENS) dot_rows(j, lo, hi);
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
    if ((rows_alone || n < GEMM_MIN_TOKENS) && w->dtype == KR_DTYPE_BF16) {
        /* the few tokens in dot_rows' layout, once per call (n * cols values: microseconds) */
        const int64_t in = w->cols, ldx = dot_ldx(dot_kind_of(w->dtype), in);
        for (int t = 0; t < n; t++)
            if (dot_kind_of(w->dtype) == DOT_DPBF16)
                kr_cpu_from_f32(KR_DTYPE_BF16, x + t * in, (size_t)in, b->xbf16 + t * ldx);
            else
                kr_deinterleave(x + t * in, (int)in, b->xperm + t * ldx);
    }
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
