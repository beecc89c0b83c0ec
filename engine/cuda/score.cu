/*
 * score.cu - the attention half of the scoring primitive (DESIGN.md section 1) on the CUDA
 * backend: `score` and `score_past`, with the semantics of engine/cpu/score.c (the oracle).
 * Observer i (query rows q_obs[n_obs][n_heads][head_dim], post-RoPE) sees the first
 * len - n_obs + i + 1 entries of a list (`score`) or the first len - n_hidden (`score_past`);
 * its softmax(q k^T / sqrt(head_dim)) over those entries is summed over the observers and either
 * averaged over the query heads of each GQA group (scores[kv_head * stride + j]) or kept per
 * query head (scores[head * stride + j]); entries an observer does not see add 0. The rows are
 * written for entries 0 .. len-1 of their list, as the CPU does; `scores` is HOST memory.
 *
 * Three kernels, softmax in fp32 (the CPU sums in double; the op tests give this a tolerance):
 * 1. stats_kernel: the running max and sum of every (observer, query head) pair over a range of
 *    entries, per range (the lists are cut in ranges so that long contexts fill the GPU);
 * 2. reduce_kernel: the ranges of each pair combined in order into its max M and sum Z;
 * 3. out_kernel: per tile of entries, exp(x - M) / Z summed over the observers (and averaged
 *    over the group), written to a device buffer of out_rows x C columns, copied to the pinned
 *    b->host_scores, then (after a stream sync) into `scores` at its stride. Columns go in
 *    chunks of C when the staging buffers are smaller than the lists.
 * Dot products are computed twice (kernels 1 and 3) instead of storing a score per pair and
 * entry, so the scratch needed does not grow with n_obs x len.
 *
 * q_obs may be device memory (a chunk's activations) or host memory (TAKE's accumulated probe):
 * it is copied into the scratch with cudaMemcpyDefault, which takes either (unified addressing).
 * Not run on a GPU yet (written in a session without one): the op tests check it on the first
 * GPU session.
 */
#include "cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int TILE = 32; /* entries per K tile: one per lane */
constexpr int WARPS = 8; /* warps per block in stats_kernel and out_kernel */
constexpr int MAX_RANGES = 64; /* ranges per list in stats_kernel */
constexpr int REC = 3; /* ints per list record: length, off, first block id */

struct score_args {
    const float *k; /* pool keys [n_blocks][block_size][head_dim] */
    const int32_t *rec; /* [n_kv][REC] */
    const int32_t *ids; /* block ids */
    const float *q; /* observers [n_obs][n_heads][d], device copy */
    int bs, d, n_obs, n_heads, n_kv, group;
    int hidden; /* < 0: observer i sees len - n_obs + i + 1; else every observer len - hidden */
    float scale;
};

__device__ __forceinline__ int visible_of(const score_args &a, int len, int i)
{
    return a.hidden < 0 ? len - a.n_obs + i + 1 : len - a.hidden;
}


/* Loads keys of entries [t0, t0 + TILE) (those < end) of list g into sk[TILE][d + 1] (padded:
 * lane j reading row j is conflict-free); warp w copies rows w, w + WARPS, ... */
__device__ void load_keys(const score_args &a, const int32_t *rec, int t0, int end, float *sk)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = a.d;
    const int off = rec[1];
    const int32_t *ids = a.ids + rec[2];
    for (int j = warp; j < TILE; j += WARPS) {
        int e = t0 + j;
        if (e >= end) continue;
        int i = off + e;
        const float *kr = a.k + ((size_t)ids[i / a.bs] * (size_t)a.bs + (size_t)(i % a.bs)) * (size_t)d;
        for (int c = lane; c < d; c += 32) sk[j * (d + 1) + c] = kr[c];
    }
}

/* This lane's entry's scaled score for the pair (observer i, query head hq). */
__device__ __forceinline__ float lane_score(const score_args &a, const float *sk, int i, int hq)
{
    const int lane = threadIdx.x & 31, d = a.d;
    const float *q = a.q + ((size_t)i * a.n_heads + hq) * (size_t)d;
    float s = 0.0f;
    for (int c = 0; c < d; c++) s += q[c] * sk[lane * (d + 1) + c]; /* q[c]: one address, broadcast */
    return s * a.scale;
}

/*
 * stats_kernel: grid.x = range r (entries [r * range_len, (r + 1) * range_len) of each list),
 * grid.y = KV head g; block = WARPS * 32 threads; dynamic shared memory TILE * (d + 1) floats.
 * Pairs p = i * group + h (observer i, head h of the group) belong to warp p % WARPS for the
 * whole block, which keeps their running (max, sum) in part[((g * n_pairs + p) * n_ranges + r) * 2]
 * (written by lane 0, read back by the same warp after the next barrier).
 */
__global__ void __launch_bounds__(WARPS * 32)
stats_kernel(score_args a, float *part, int range_len, int n_ranges)
{
    extern __shared__ float sk[];
    const int g = blockIdx.y, r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t *rec = a.rec + (size_t)g * REC;
    const int len = rec[0], n_pairs = a.n_obs * a.group;
    const int e0 = r * range_len, e1 = min(e0 + range_len, len);
    for (int p = warp; p < n_pairs; p += WARPS)
        if (lane == 0) {
            float *st = part + (((size_t)g * n_pairs + p) * n_ranges + r) * 2;
            st[0] = -INFINITY;
            st[1] = 0.0f;
        }
    for (int t0 = e0; t0 < e1; t0 += TILE) {
        __syncthreads(); /* the previous tile is no longer read; lane 0's stats are visible */
        load_keys(a, rec, t0, e1, sk);
        __syncthreads();
        const int e = t0 + lane;
        for (int p = warp; p < n_pairs; p += WARPS) {
            const int i = p / a.group, hq = g * a.group + p % a.group;
            const int vis = visible_of(a, len, i);
            if (t0 >= vis) continue; /* warp-uniform */
            float x = e < e1 && e < vis ? lane_score(a, sk, i, hq) : -INFINITY;
            float *st = part + (((size_t)g * n_pairs + p) * n_ranges + r) * 2;
            float m_old = st[0], mt = warp_max(x);
            float m = fmaxf(m_old, mt); /* finite: entry t0 < vis is visible */
            float z = warp_sum(x == -INFINITY ? 0.0f : expf(x - m));
            if (lane == 0) {
                st[0] = m;
                st[1] = st[1] * expf(m_old - m) + z;
            }
        }
    }
}

/* reduce_kernel: one thread per (g, pair) (grid-stride over n_kv * n_pairs); combines the ranges
 * in order into stats[(g * n_pairs + p) * 2] = (M, Z). */
__global__ void reduce_kernel(const float *part, float *stats, int n_total, int n_ranges)
{
    for (int x = blockIdx.x * blockDim.x + threadIdx.x; x < n_total; x += gridDim.x * blockDim.x) {
        const float *p = part + (size_t)x * n_ranges * 2;
        float m = -INFINITY;
        for (int r = 0; r < n_ranges; r++) m = fmaxf(m, p[2 * r]);
        float z = 0.0f;
        for (int r = 0; r < n_ranges; r++)
            if (p[2 * r] != -INFINITY) z += p[2 * r + 1] * expf(p[2 * r] - m);
        stats[2 * (size_t)x] = m;
        stats[2 * (size_t)x + 1] = z;
    }
}

/*
 * out_kernel: grid.x = tile of TILE entries of the column chunk [c0, c1), grid.y = KV head g;
 * block = WARPS * 32 threads; dynamic shared memory TILE * (d + 1) + group * TILE floats.
 * Warp w takes query heads w, w + WARPS, ... of the group; lane j entry c0 + tile * TILE + j.
 * Per head: sum over observers of exp(x - M) / Z (0 where the observer does not see the entry).
 * per_head: row g * group + h of out; else the heads' sums, in head order, times 1 / group into
 * row g. out is [rows][cols] (cols = c1 - c0 of this chunk).
 */
__global__ void __launch_bounds__(WARPS * 32)
out_kernel(score_args a, const float *stats, float *out, int c0, int c1, int per_head)
{
    extern __shared__ float smem[];
    float *sk = smem, *red = smem + TILE * (a.d + 1); /* red: [group][TILE] */
    const int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int32_t *rec = a.rec + (size_t)g * REC;
    const int len = rec[0], n_pairs = a.n_obs * a.group, cols = c1 - c0;
    const int t0 = c0 + blockIdx.x * TILE, end = min(c1, len);
    if (t0 >= end) return; /* block-uniform, before any barrier */
    load_keys(a, rec, t0, end, sk);
    __syncthreads();
    const int e = t0 + lane;
    for (int h = warp; h < a.group; h += WARPS) {
        float acc = 0.0f;
        for (int i = 0; i < a.n_obs; i++) {
            const int vis = visible_of(a, len, i);
            if (t0 >= vis) continue; /* warp-uniform */
            const float *st = stats + ((size_t)g * n_pairs + (size_t)i * a.group + h) * 2;
            if (e < end && e < vis) acc += expf(lane_score(a, sk, i, g * a.group + h) - st[0]) / st[1];
        }
        if (per_head) {
            if (e < end) out[(size_t)(g * a.group + h) * cols + (e - c0)] = acc;
        } else {
            red[h * TILE + lane] = acc;
        }
    }
    if (per_head) return;
    __syncthreads();
    if (warp == 0 && e < end) {
        float sum = 0.0f;
        for (int h = 0; h < a.group; h++) sum += red[h * TILE + lane];
        out[(size_t)g * cols + (e - c0)] = sum * (1.0f / (float)a.group);
    }
}

void fail(const char *what, size_t need, size_t have)
{
    fprintf(stderr, "CUDA score: %s (%zu floats needed, %zu available)\n", what, need, have);
    abort();
}

void run(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs, int n_heads,
         int per_head, int hidden, float *scores, size_t stride)
{
    if (n_obs <= 0) return;
    const kr_kv_pool *pool = s->pool;
    const int n_kv = s->n_kv_heads, d = pool->head_dim;
    if (d <= 0 || d > 256 || n_kv <= 0 || n_heads % n_kv != 0) fail("unsupported shape", 0, 0);
    const int group = n_heads / n_kv, n_pairs = n_obs * group;
    const int out_rows = per_head ? n_heads : n_kv;

    /* tables: per KV head {len, off, first id}, then the block ids */
    int maxlen = 0;
    size_t n_ids = 0;
    for (int g = 0; g < n_kv; g++) {
        const kr_kv_list *l = &s->lists[layer * n_kv + g];
        maxlen = l->len > maxlen ? l->len : maxlen;
        n_ids += (size_t)((l->off + l->len + pool->block_size - 1) / pool->block_size);
    }
    if (maxlen == 0) return;
    const size_t n_ints = (size_t)n_kv * REC + n_ids;
    if (kr_cuda_tables_reserve(b, n_ints) != KR_OK) fail("out of device memory for block tables", n_ints, 0);
    int32_t *rec = b->host_slice, *ids = rec + (size_t)n_kv * REC;
    int32_t at = 0;
    for (int g = 0; g < n_kv; g++) {
        const kr_kv_list *l = &s->lists[layer * n_kv + g];
        int nb = (l->off + l->len + pool->block_size - 1) / pool->block_size;
        rec[g * REC + 0] = l->len;
        rec[g * REC + 1] = l->off;
        rec[g * REC + 2] = at;
        memcpy(ids + at, l->blocks, sizeof(int32_t) * (size_t)nb);
        at += nb;
    }
    KR_CUDA_CHECK(cudaMemcpyAsync(b->dev_slice, b->host_slice, n_ints * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, b->stream));

    /* scratch: observers' queries, per-pair stats, per-range partials, output columns */
    const size_t q_floats = (size_t)n_obs * n_heads * d, stat_floats = (size_t)n_kv * n_pairs * 2;
    const size_t min_cols = (size_t)(maxlen < TILE ? maxlen : TILE);
    size_t fixed = q_floats + stat_floats + (size_t)out_rows * min_cols;
    if (fixed + (size_t)n_kv * n_pairs * 2 > b->dev_scratch_floats)
        fail("scratch too small for the observers", fixed + (size_t)n_kv * n_pairs * 2, b->dev_scratch_floats);
    int n_ranges = (maxlen + TILE - 1) / TILE;
    if (n_ranges > MAX_RANGES) n_ranges = MAX_RANGES;
    size_t fit = (b->dev_scratch_floats - fixed) / ((size_t)n_kv * n_pairs * 2);
    if ((size_t)n_ranges > fit) n_ranges = (int)fit;
    int range_len = (maxlen + n_ranges - 1) / n_ranges;
    range_len = (range_len + TILE - 1) / TILE * TILE;
    n_ranges = (maxlen + range_len - 1) / range_len;
    float *dq = b->dev_scratch, *stats = dq + q_floats, *part = stats + stat_floats;
    float *dout = part + (size_t)n_kv * n_pairs * n_ranges * 2;
    size_t room = b->dev_scratch_floats - (size_t)(dout - b->dev_scratch);
    size_t cols = room / (size_t)out_rows;
    if (cols > b->host_scores_floats / (size_t)out_rows) cols = b->host_scores_floats / (size_t)out_rows;
    if (cols > (size_t)maxlen) cols = (size_t)maxlen;
    if (cols == 0) fail("no room for a column of scores", (size_t)out_rows, b->host_scores_floats);

    KR_CUDA_CHECK(cudaMemcpyAsync(dq, q_obs, q_floats * sizeof(float), cudaMemcpyDefault, b->stream));
    score_args a;
    a.k = reinterpret_cast<const float *>(pool->k); /* f32: the CUDA backend stores no other dtype */
    a.rec = b->dev_slice;
    a.ids = b->dev_slice + (size_t)n_kv * REC;
    a.q = dq;
    a.bs = pool->block_size;
    a.d = d;
    a.n_obs = n_obs;
    a.n_heads = n_heads;
    a.n_kv = n_kv;
    a.group = group;
    a.hidden = hidden;
    a.scale = 1.0f / sqrtf((float)d);

    const size_t sk_bytes = sizeof(float) * TILE * (size_t)(d + 1);
    stats_kernel<<<dim3((unsigned)n_ranges, (unsigned)n_kv), WARPS * 32, sk_bytes, b->stream>>>(
        a, part, range_len, n_ranges);
    KR_CUDA_CHECK(cudaGetLastError());
    const int n_total = n_kv * n_pairs;
    reduce_kernel<<<(unsigned)((n_total + 127) / 128), 128, 0, b->stream>>>(part, stats, n_total, n_ranges);
    KR_CUDA_CHECK(cudaGetLastError());

    const size_t out_bytes = sk_bytes + sizeof(float) * (size_t)group * TILE;
    if (out_bytes > 48 * 1024)
        KR_CUDA_CHECK(cudaFuncSetAttribute((const void *)out_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)out_bytes));
    for (int c0 = 0; c0 < maxlen; c0 += (int)cols) {
        const int c1 = c0 + (int)cols < maxlen ? c0 + (int)cols : maxlen, w = c1 - c0;
        out_kernel<<<dim3((unsigned)((w + TILE - 1) / TILE), (unsigned)n_kv), WARPS * 32, out_bytes, b->stream>>>(
            a, stats, dout, c0, c1, per_head);
        KR_CUDA_CHECK(cudaGetLastError());
        KR_CUDA_CHECK(cudaMemcpyAsync(b->host_scores, dout, sizeof(float) * (size_t)out_rows * w,
                                      cudaMemcpyDeviceToHost, b->stream));
        KR_CUDA_CHECK(cudaStreamSynchronize(b->stream));
        /* each row gets the columns its list has (len of its KV head), as the CPU writes them */
        for (int row = 0; row < out_rows; row++) {
            const int len = rec[(per_head ? row / group : row) * REC];
            const int upto = len < c1 ? len : c1;
            if (upto > c0)
                memcpy(scores + (size_t)row * stride + c0, b->host_scores + (size_t)row * w,
                       sizeof(float) * (size_t)(upto - c0));
        }
    }
}

} // namespace

void kr_cuda_score(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs, int n_heads,
                   int per_head, float *scores, size_t stride)
{
    run(b, s, layer, q_obs, n_obs, n_heads, per_head, -1, scores, stride);
}

void kr_cuda_score_past(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                        int n_heads, int per_head, int n_hidden, float *scores, size_t stride)
{
    run(b, s, layer, q_obs, n_obs, n_heads, per_head, n_hidden, scores, stride);
}
