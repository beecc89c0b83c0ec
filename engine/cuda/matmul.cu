/*
 * matmul.cu - y[n][out] (+)= x[n][in] . W^T (+ bias) on cuBLAS: the f32 activations are rounded to
 * bf16 into the backend's scratch (b->xb), then one cublasGemmEx with bf16 inputs, f32 output and
 * f32 accumulation (CUBLAS_COMPUTE_32F); accumulate is beta = 1; the bias is a small kernel after.
 *
 * Layout: cuBLAS is column-major. W row-major [out][in] is the column-major in x out matrix
 * (lda = in), x row-major [n][in] the column-major in x n (ldb = in), and y row-major [n][out]
 * the column-major out x n (ldc = out): y = op_T(W) . x, m = out, n = n, k = in.
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

/* rows_alone: one GEMM per row (matmul_rows) instead of one for all rows. */
static void matmul(kr_backend *b, const kr_tensor *wt, const kr_tensor *bias, const float *x, int n,
                   int accumulate, float *y, int rows_alone)
{
    if (n <= 0) return;
    const kr_cuda_weight *w = kr_cuda_weight_of(b, wt);
    const size_t in = (size_t)w->cols, out = (size_t)w->rows;
    reserve_xb(b, (size_t)n * in);
    to_bf16_kernel<<<grid_for((size_t)n * in), THREADS, 0, b->stream>>>(x, (size_t)n * in, b->xb);
    KR_CUDA_CHECK(cudaGetLastError());
    if (rows_alone)
        for (int i = 0; i < n; i++) gemm(b, w, b->xb + (size_t)i * in, 1, accumulate, y + (size_t)i * out);
    else
        gemm(b, w, b->xb, n, accumulate, y);
    if (bias && bias->data) {
        add_bias_kernel<<<grid_for((size_t)n * out), THREADS, 0, b->stream>>>(
            y, kr_cuda_weight_of(b, bias)->dev_f32, n, (int)out);
        KR_CUDA_CHECK(cudaGetLastError());
    }
}

void kr_cuda_matmul(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                    int accumulate, float *y)
{
    matmul(b, w, bias, x, n, accumulate, y, 0);
}

/* Rows of one GEMM do not depend on each other mathematically, but cuBLAS picks its kernel (tile
 * shape, split-K) by the problem size, so a row's rounding could change with n. The contract is
 * bit-identity with a one-row call: each row is its own n = 1 GEMM, the very call a one-row
 * matmul makes. This reads the weights once per row (docs/cuda.md: a batched GEMV kernel with a
 * fixed reduction order is the planned replacement for decode batches). */
void kr_cuda_matmul_rows(kr_backend *b, const kr_tensor *w, const kr_tensor *bias, const float *x, int n,
                         int accumulate, float *y)
{
    matmul(b, w, bias, x, n, accumulate, y, 1);
}
