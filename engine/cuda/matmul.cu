/*
 * matmul.cu - y[n][out] (+)= x[n][in] . W^T (+ bias) on cuBLAS: the f32 activations are rounded to
 * bf16 into the backend's scratch (b->xb), then one cublasGemmEx with bf16 inputs, f32 output and
 * f32 accumulation (CUBLAS_COMPUTE_32F); accumulate is beta = 1; the bias is a small kernel after.
 *
 * Layout: cuBLAS is column-major. W row-major [out][in] is the column-major in x out matrix
 * (lda = in), x row-major [n][in] the column-major in x n (ldb = in), and y row-major [n][out]
 * the column-major out x n (ldc = out): y = op_T(W) . x, m = out, n = n, k = in.
 * One-row calls and matmul_rows take a GEMV kernel of our own instead (see below): decode reads
 * each weight once per step, and its rows must not depend on the batch size.
 */
#include "cuda.h"

enum { THREADS = 256 };

__global__ void to_bf16_kernel(const float *x, size_t count, __nv_bfloat16 *xb)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
        xb[i] = __float2bfloat16_rn(x[i]);
}

__global__ void add_bias_kernel(float *y, const float *bias, int n, int out)
{
    const size_t count = (size_t)n * (size_t)out;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
        y[i] += bias[i % (size_t)out];
}

static unsigned grid_for(size_t count)
{
    size_t g = (count + THREADS - 1) / THREADS;
    return (unsigned)(g < 65535u * 32u ? g : 65535u * 32u);
}

/* Grows the bf16 input scratch when a call has more rows than max_chunk (a policy's observers
 * appended to a chunk): once per context, like forward.c's own buffers. */
static void reserve_xb(kr_backend *b, size_t elems)
{
    if (elems <= b->xb_elems) return;
    KR_CUDA_CHECK(cudaStreamSynchronize(b->stream));
    KR_CUDA_CHECK(cudaFree(b->xb));
    b->xb = NULL;
    KR_CUDA_CHECK(cudaMalloc((void **)&b->xb, elems * sizeof(__nv_bfloat16)));
    b->xb_elems = elems;
}

/* The GEMM of rows [0, n) of x (already bf16 in xb) into y. */
static void gemm(kr_backend *b, const kr_cuda_weight *w, const __nv_bfloat16 *xb, int n, int accumulate, float *y)
{
    const int out = (int)w->rows, in = (int)w->cols;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    KR_CUBLAS_CHECK(cublasGemmEx(b->cublas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &alpha, w->dev_bf16,
                                 CUDA_R_16BF, in, xb, CUDA_R_16BF, in, &beta, y, CUDA_R_32F, out,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* ---------------------------------------------------------------- row-exact GEMV
 * y[i][j] (+)= x[i] . W[j] (+ bias[j]) with one warp per output j and every row's sum taken in an
 * order that depends on `in` only: lane l adds elements l*8 .. l*8+7 of each 256-element stride
 * in sequence, then a fixed butterfly adds the 32 lanes. Rows are taken ROWS at a time so a weight
 * row is read once per ROWS rows (decode is bound by reading the weights), and a row's result does
 * not depend on which group it is in or on n: matmul_rows' contract, and the one-row matmul path. */
enum { GEMV_WARPS = 8, ROWS = 8 };

__global__ void gemv_kernel(const __nv_bfloat16 *w, const float *x, const float *bias, int n, int in,
                            int out, int accumulate, int vec, float *y)
{
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= out) return;
    const __nv_bfloat16 *wr = w + (size_t)j * in;
    for (int r0 = 0; r0 < n; r0 += ROWS) {
        const int nr = n - r0 < ROWS ? n - r0 : ROWS;
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
        if (vec) {
            for (int k = lane * 8; k < in; k += 256) {
                uint4 raw = *(const uint4 *)(wr + k);
                const __nv_bfloat16 *wv = (const __nv_bfloat16 *)&raw;
                float wf[8];
#pragma unroll
                for (int e = 0; e < 8; e++) wf[e] = __bfloat162float(wv[e]);
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    if (r >= nr) continue;
                    const float4 *xr = (const float4 *)(x + (size_t)(r0 + r) * in + k);
                    const float4 a = __ldg(xr), c = __ldg(xr + 1);
                    float s = acc[r];
                    s = fmaf(wf[0], a.x, s);
                    s = fmaf(wf[1], a.y, s);
                    s = fmaf(wf[2], a.z, s);
                    s = fmaf(wf[3], a.w, s);
                    s = fmaf(wf[4], c.x, s);
                    s = fmaf(wf[5], c.y, s);
                    s = fmaf(wf[6], c.z, s);
                    s = fmaf(wf[7], c.w, s);
                    acc[r] = s;
                }
            }
        } else {
            for (int k = lane; k < in; k += 32) {
                const float wf = __bfloat162float(wr[k]);
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    if (r >= nr) continue;
                    acc[r] = fmaf(wf, __ldg(x + (size_t)(r0 + r) * in + k), acc[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            float v = acc[r];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && r < nr) {
                if (bias) v += bias[j];
                float *dst = y + (size_t)(r0 + r) * out + j;
                *dst = accumulate ? *dst + v : v;
            }
        }
    }
}

static void gemv(kr_backend *b, const kr_cuda_weight *w, const kr_tensor *bias, const float *x, int n,
                 int accumulate, float *y)
{
    const int out = (int)w->rows;
    const int in = (int)w->cols;
    const float *db = bias && bias->data ? kr_cuda_weight_of(b, bias)->dev_f32 : NULL;
    /* 16-byte loads of 8 weights and 8 inputs when every row starts 16-byte aligned; the choice
     * depends on the shape and x's alignment, never on n */
    const int vec = (in & 7) == 0 && ((uintptr_t)x & 15) == 0;
    gemv_kernel<<<(out + GEMV_WARPS - 1) / GEMV_WARPS, GEMV_WARPS * 32, 0, b->stream>>>(
        w->dev_bf16, x, db, n, in, out, accumulate, vec, y);
    KR_CUDA_CHECK(cudaGetLastError());
}

/* One row (single-sequence decode) takes the row-exact GEMV, so that it equals a row of
 * matmul_rows bit for bit; more rows (prefill chunks) one cuBLAS GEMM. */
void kr_cuda_matmul(kr_backend *b, const kr_tensor *wt, const kr_tensor *bias, const float *x, int n,
                    int accumulate, float *y)
{
    if (n <= 0) return;
    const kr_cuda_weight *w = kr_cuda_weight_of(b, wt);
    if (n == 1) {
        gemv(b, w, bias, x, n, accumulate, y);
        return;
    }
    const size_t in = (size_t)w->cols, out = (size_t)w->rows;
    reserve_xb(b, (size_t)n * in);
    to_bf16_kernel<<<grid_for((size_t)n * in), THREADS, 0, b->stream>>>(x, (size_t)n * in, b->xb);
    KR_CUDA_CHECK(cudaGetLastError());
    gemm(b, w, b->xb, n, accumulate, y);
    if (bias && bias->data) {
        add_bias_kernel<<<grid_for((size_t)n * out), THREADS, 0, b->stream>>>(
            y, kr_cuda_weight_of(b, bias)->dev_f32, n, (int)out);
        KR_CUDA_CHECK(cudaGetLastError());
    }
}

/* Rows of one GEMM do not depend on each other mathematically, but cuBLAS picks its kernel (tile
 * shape, split-K) by the problem size, so a row's rounding could change with n: the contract's
 * bit-identity with a one-row call needs a reduction order fixed per row, the GEMV above. */
void kr_cuda_matmul_rows(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                         int accumulate, float *y)
{
    if (n <= 0) return;
    gemv(b, kr_cuda_weight_of(b, w), bias, x, n, accumulate, y);
}
