/*
 * matmul.c - y[n][out] (+)= x[n][in] . W[out][in]^T (+ bias) on the CPU backend.
 * Output rows are split over the thread pool. Few tokens (decode): each thread streams its
 * weight rows once, four rows at a time, dotting them with every token (memory-bound; bf16 and
 * f16 rows are upcast in registers, never in memory; bf16 pairs are split into even and odd
 * lanes with a shift and a mask against a token vector reordered to match, because the
 * widening shuffle was the bottleneck, not memory). Many tokens (prefill): OpenBLAS sgemm per
 * thread on its rows; bf16/f16 rows are first upcast into a per-thread f32 slab.
 * The two paths round differently. `kr_cpu_matmul_rows` (decode batches) always takes the
 * dot-product path: a token's result there does not depend on how many tokens share the call
 * or on the thread count (row groups of four start at multiples of 16, the odd tail is always
 * the matrix's last rows), so it equals the one-token call bit for bit.
 */
#include "cpu.h"
#include "simd.h"

#include <cblas.h>



/* four rows at once; one row at a time is simd.h's kr_dot_f32 / kr_dot_f16 */
#define DEFINE_DOT4(SUFFIX, T, LOAD, AT, PREFETCH)                                                  \
    static void dot4_##SUFFIX(const float *x, const T *w, int64_t ld, int in, float *r)           \
    {                                                                                              \
        kr_vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero();                      \
        int i = 0;                                                                                 \
        for (; i + KR_VL <= in; i += KR_VL) {                                                      \
            kr_vf xv = vf_load(x + i);                                                             \
            if (PREFETCH)                                                                          \
                for (int q = 4; q < 8; q++) __builtin_prefetch(w + q * ld + i, 0, 0);              \
            a0 = vf_fma(xv, LOAD(w + i), a0);                                                      \
            a1 = vf_fma(xv, LOAD(w + ld + i), a1);                                                 \
            a2 = vf_fma(xv, LOAD(w + 2 * ld + i), a2);                                             \
            a3 = vf_fma(xv, LOAD(w + 3 * ld + i), a3);                                             \
        }                                                                                          \
        r[0] = vf_sum(a0), r[1] = vf_sum(a1), r[2] = vf_sum(a2), r[3] = vf_sum(a3);                \
        for (; i < in; i++) {                                                                      \
            r[0] += x[i] * AT(w[i]);                                                               \
            r[1] += x[i] * AT(w[ld + i]);                                                          \
            r[2] += x[i] * AT(w[2 * ld + i]);                                                      \
            r[3] += x[i] * AT(w[3 * ld + i]);                                                      \
        }                                                                                          \
    }

/* bf16 rows against x reordered by kr_deinterleave */
static void dot4_bf16eo(const float *x, const uint16_t *w, int64_t ld, int in, float *r)
{
    kr_vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero(), e, o;
    int i = 0;
    for (; i + 2 * KR_VL <= in; i += 2 * KR_VL) {
        kr_vf xe = vf_load(x + i), xo = vf_load(x + i + KR_VL);
        /* rows are short: fetch the next four rows' lines while these are summed */
        for (int q = 4; q < 8; q++) __builtin_prefetch(w + q * ld + i, 0, 0);
        vf_load_bf16_eo(w + i, &e, &o);
        a0 = vf_fma(xo, o, vf_fma(xe, e, a0));
        vf_load_bf16_eo(w + ld + i, &e, &o);
        a1 = vf_fma(xo, o, vf_fma(xe, e, a1));
        vf_load_bf16_eo(w + 2 * ld + i, &e, &o);
        a2 = vf_fma(xo, o, vf_fma(xe, e, a2));
        vf_load_bf16_eo(w + 3 * ld + i, &e, &o);
        a3 = vf_fma(xo, o, vf_fma(xe, e, a3));
    }
    r[0] = vf_sum(a0), r[1] = vf_sum(a1), r[2] = vf_sum(a2), r[3] = vf_sum(a3);
    for (; i < in; i++)
        for (int q = 0; q < 4; q++) r[q] += x[i] * kr_bf16_to_f32(w[q * ld + i]);
}

static float dot1_bf16eo(const float *x, const uint16_t *w, int in)
{
    kr_vf a = vf_zero(), e, o;
    int i = 0;
    for (; i + 2 * KR_VL <= in; i += 2 * KR_VL) {
        vf_load_bf16_eo(w + i, &e, &o);
        a = vf_fma(vf_load(x + i + KR_VL), o, vf_fma(vf_load(x + i), e, a));
    }
    float s = vf_sum(a);
    for (; i < in; i++) s += x[i] * kr_bf16_to_f32(w[i]);
    return s;
}

#define AT_F32(v) (v)
DEFINE_DOT4(f32, float, vf_load, AT_F32, 0) /* long rows: the hardware prefetcher keeps up */
DEFINE_DOT4(f16, uint16_t, vf_load_f16, kr_f16_to_f32, 1)

typedef struct mm_job {
    kr_backend *b;
    const kr_tensor *w;
    const kr_tensor *bias;
    const float *x;
    int n;
    int accumulate;
    int rows_alone; /* every token on the dot-product path, whatever n */
    float *y;
} mm_job;

/* dots of 4 consecutive weight rows starting at row o with token vector x */
static void dot4(const kr_tensor *w, int64_t o, const float *x, float *r)
{
    int in = (int)w->cols;
    switch (w->dtype) {
    case KR_DTYPE_BF16: dot4_bf16eo(x, (const uint16_t *)w->data + o * in, in, in, r); break;
    case KR_DTYPE_F16: dot4_f16(x, (const uint16_t *)w->data + o * in, in, in, r); break;
    default: dot4_f32(x, (const float *)w->data + o * in, in, in, r); break;
    }
}

static float dot1(const kr_tensor *w, int64_t o, const float *x)
{
    int in = (int)w->cols;
    switch (w->dtype) {
    case KR_DTYPE_BF16: return dot1_bf16eo(x, (const uint16_t *)w->data + o * in, in);
    case KR_DTYPE_F16: return kr_dot_f16(x, (const uint16_t *)w->data + o * in, in);
    default: return kr_dot_f32(x, (const float *)w->data + o * in, in);
    }
}

static void matvec_rows(const mm_job *j, int64_t lo, int64_t hi)
{
    const int64_t in = j->w->cols, out = j->w->rows;
    const float *x = j->w->dtype == KR_DTYPE_BF16 ? j->b->xperm : j->x;
    int64_t o = lo;
    float r[4];
    for (; o + 4 <= hi; o += 4) {
        for (int t = 0; t < j->n; t++) {
            dot4(j->w, o, x + t * in, r);
            float *y = j->y + t * out + o;
            for (int q = 0; q < 4; q++) y[q] = (j->accumulate ? y[q] : 0.0f) + r[q];
        }
    }
    for (; o < hi; o++) {
        for (int t = 0; t < j->n; t++) {
            float *y = j->y + t * out + o;
            *y = (j->accumulate ? *y : 0.0f) + dot1(j->w, o, x + t * in);
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

static void mm_task(void *arg, int ith, int nth)
{
    const mm_job *j = arg;
    int64_t lo, hi;
    kr_split(j->w->rows, ith, nth, 16, &lo, &hi);
    if (lo >= hi) return;
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
