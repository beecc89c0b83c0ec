/*
 * elementwise.cu - the CUDA backend's small ops: embedding gather, RMSNorm, SiLU gating, RoPE and
 * the KV store (backend.h gives their contracts; engine/cpu/backend.c is the oracle). Each is
 * one kernel on the backend's stream. Host arrays the op table hands over (token ids, cos/sin
 * rows, destination slots) go up through the pinned block-table staging buffer.
 */
#include "cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { THREADS = 256 };

/* Copies `bytes` of host data to the device table buffer (offset 0) and returns its device
 * address. Ordered on the stream before the kernels launched after it. */
static const void *upload(kr_backend *b, const void *src, size_t bytes)
{
    size_t words = (bytes + sizeof(int32_t) - 1) / sizeof(int32_t);
    if (kr_cuda_tables_reserve(b, words) != KR_OK) {
        fprintf(stderr, "CUDA backend: out of memory for a %zu-byte table\n", bytes);
        abort();
    }
    memcpy(b->host_slice, src, bytes);
    KR_CUDA_CHECK(cudaMemcpyAsync(b->dev_slice, b->host_slice, bytes, cudaMemcpyHostToDevice, b->stream));
    return b->dev_slice;
}

static unsigned blocks_for(size_t count)
{
    size_t g = (count + THREADS - 1) / THREADS;
    return (unsigned)(g < 65535u * 32u ? g : 65535u * 32u); /* grid-stride loops cover the rest */
}

/* ---------------------------------------------------------------- embed */

__global__ void embed_kernel(const __nv_bfloat16 *emb, const int32_t *tokens, int n, int d, float *x)
{
    const int i = blockIdx.x;
    const __nv_bfloat16 *row = emb + (size_t)tokens[i] * (size_t)d;
    for (int e = threadIdx.x; e < d; e += blockDim.x) x[(size_t)i * d + e] = __bfloat162float(row[e]);
}

void kr_cuda_embed(kr_backend *b, const kr_tensor *emb, const int32_t *tokens, int n, float *x)
{
    if (n <= 0) return;
    const kr_cuda_weight *w = kr_cuda_weight_of(b, emb);
    const int32_t *dev_tokens = (const int32_t *)upload(b, tokens, (size_t)n * sizeof(int32_t));
    embed_kernel<<<n, THREADS, 0, b->stream>>>(w->dev_bf16, dev_tokens, n, (int)emb->cols, x);
    KR_CUDA_CHECK(cudaGetLastError());
}

/* ---------------------------------------------------------------- RMSNorm */

/* Sum over the block (THREADS threads), returned to every thread. */
__device__ float block_sum(float v)
{
    __shared__ float part[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < THREADS / 32 ? part[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* part is reused by the next call */
    return v;
}

/* One block per row; y may equal x (each thread reads its elements before writing them). */
__global__ void rmsnorm_kernel(const float *x, const float *w, int d, float eps, float *y)
{
    const float *xr = x + (size_t)blockIdx.x * d;
    float *yr = y + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int e = threadIdx.x; e < d; e += THREADS) ss += xr[e] * xr[e];
    ss = block_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int e = threadIdx.x; e < d; e += THREADS) yr[e] = w[e] * (xr[e] * inv);
}

void kr_cuda_rmsnorm(kr_backend *b, const float *x, const kr_tensor *w, int n, int d, float eps, float *y)
{
    if (n <= 0) return;
    rmsnorm_kernel<<<n, THREADS, 0, b->stream>>>(x, kr_cuda_weight_of(b, w)->dev_f32, d, eps, y);
    KR_CUDA_CHECK(cudaGetLastError());
}

/* ---------------------------------------------------------------- SiLU gating */

__global__ void swiglu_kernel(float *g, const float *u, size_t count)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        float v = g[i];
        g[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

void kr_cuda_swiglu(kr_backend *b, float *g, const float *u, size_t count)
{
    if (count == 0) return;
    swiglu_kernel<<<blocks_for(count), THREADS, 0, b->stream>>>(g, u, count);
    KR_CUDA_CHECK(cudaGetLastError());
}

/* ---------------------------------------------------------------- RoPE */

/* One block per (token, head), a thread per rotated pair (HF rotate-half: i with i + half). */
__global__ void rope_kernel(float *x, int n_heads, int head_dim, const float *cos_sin)
{
    const int t = blockIdx.x / n_heads, half = head_dim / 2;
    const float *cs = cos_sin + (size_t)t * half * 2;
    float *v = x + (size_t)blockIdx.x * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float c = cs[2 * i], s = cs[2 * i + 1], x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
    }
}

void kr_cuda_rope(kr_backend *b, float *x, int n, int n_heads, int head_dim, const float *cos_sin)
{
    if (n <= 0) return;
    const float *dev_cs = (const float *)upload(b, cos_sin, (size_t)n * (size_t)head_dim * sizeof(float));
    const int threads = head_dim / 2 < THREADS ? (head_dim / 2 + 31) / 32 * 32 : THREADS;
    rope_kernel<<<n * n_heads, threads, 0, b->stream>>>(x, n_heads, head_dim, dev_cs);
    KR_CUDA_CHECK(cudaGetLastError());
}

/* ---------------------------------------------------------------- KV store */

/* One block per (token, KV head): row (t, g) of k and v goes to pool entry slots[t * kvh + g]
 * (block * block_size + slot). */
__global__ void kv_store_kernel(const float *k, const float *v, const int32_t *slots, int head_dim,
                                float *pool_k, float *pool_v)
{
    const size_t src = (size_t)blockIdx.x * head_dim;
    const size_t dst = (size_t)slots[blockIdx.x] * head_dim;
    for (int e = threadIdx.x; e < head_dim; e += blockDim.x) {
        pool_k[dst + e] = k[src + e];
        pool_v[dst + e] = v[src + e];
    }
}

void kr_cuda_kv_store(kr_backend *b, kr_seq *s, int layer, const float *k, const float *v, int n,
                      const int32_t *pos)
{
    if (n <= 0) return;
    const kr_kv_pool *p = s->pool;
    const int kvh = s->n_kv_heads, bs = p->block_size;
    const size_t rows = (size_t)n * (size_t)kvh;
    if (kr_cuda_tables_reserve(b, rows) != KR_OK) {
        fprintf(stderr, "CUDA backend: out of memory for a %zu-entry KV store table\n", rows);
        abort();
    }
    for (int g = 0; g < kvh; g++) {
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        const int base = l->len - n;
        for (int t = 0; t < n; t++) {
            const int i = l->off + base + t;
            b->host_slice[(size_t)t * kvh + g] = l->blocks[i / bs] * bs + i % bs;
            /* positions: host writes into managed memory, ordered before the later kernels */
            *kr_kv_list_pos(p, l, base + t) = pos[t];
        }
    }
    KR_CUDA_CHECK(cudaMemcpyAsync(b->dev_slice, b->host_slice, rows * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, b->stream));
    const int threads = p->head_dim < THREADS ? (p->head_dim + 31) / 32 * 32 : THREADS;
    /* f32 pools only: the CUDA backend stores no other dtype (kr_backend_ops.kv_dtypes) */
    kv_store_kernel<<<(unsigned)rows, threads, 0, b->stream>>>(k, v, b->dev_slice, p->head_dim,
                                                               reinterpret_cast<float *>(p->k),
                                                               reinterpret_cast<float *>(p->v));
    KR_CUDA_CHECK(cudaGetLastError());
}
