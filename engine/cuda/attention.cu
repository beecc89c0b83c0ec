/*
 * attention.cu - causal GQA attention over the paged KV cache on the CUDA backend: `attention`
 * (a chunk of one sequence) and `attention_batch` (decode: row i is one token of seqs[i]).
 * Same semantics as engine/cpu/attention.c (the oracle): token i of a chunk of n sees the first
 * len - n + i + 1 entries of each (layer, KV head) list, a batch row its whole list, minus the
 * entries at positions <= pos - window when window > 0; scale 1/sqrt(head_dim); softmax in fp32
 * with a running max and sum (online softmax), so no score matrix of the context exists.
 *
 * Three paths:
 * - chunk_tc_kernel (chunks of more than DECODE_MAX_TOKENS tokens, head_dim 64 or 128): a block
 *   per (tile of TC_ROWS (query, head) rows, KV head), flash-attention style on tensor cores
 *   (wmma bf16 x bf16 -> f32): K/V tiles converted to bf16 in shared memory once for every query
 *   head of the GQA group, S = Q K^T and O += P V as 16x16x16 mma, online softmax in fp32.
 * - chunk_kernel (the same chunks for other head sizes, up to 256): the same rows and tiles with
 *   fp32 dot products on the CUDA cores (attend_range: one entry per lane, online softmax and
 *   P.V in registers).
 * - split_kernel + merge_kernel (decode batches, and chunks of at most DECODE_MAX_TOKENS tokens,
 *   so a one-token `attention` row is bit-identical to its `attention_batch` row), fp32 through
 *   attend_range: a block per (split of `split` entries, (row, KV head), chunk of ROWS query
 *   heads of the group); each split writes its unnormalised partial result (max, sum, output)
 *   to b->dev_scratch and merge_kernel combines them in split order (flash-decoding). A list
 *   with a single split is written directly. The split length of a list depends only on its
 *   visible length, head_dim, n_heads and the scratch size, never on the other rows of the
 *   batch: rows are computed the same whatever the batch holds.
 * Each kernel's comment gives its grid, block and shared memory.
 *
 * The lists' block ids, lengths and offsets and the query positions are host memory: each call
 * copies what it needs into its own slice of the pinned staging (kr_cuda_tables_reserve) and
 * uploads it with one cudaMemcpyAsync on b->stream, without waiting for earlier kernels. K, V
 * and positions of the pool are read where they are (CUDA managed memory). The window is
 * applied on the device (chunk blocks binary-search their first entry, decode splits check
 * their newest one, and every entry is masked by its position), so the host never reads the
 * managed pool here.
 *
 * Limits: the tensor-core path is plain wmma (no cp.async pipelining, no wgmma): correct first,
 * to be measured; decode reads the f32 pool on the CUDA cores, which is bandwidth-bound anyway.
 * Not run on a GPU yet (written in a session without one): the op tests check it against the
 * CPU on the first GPU session.
 */
#include "cuda.h"

#include <mma.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

namespace {

constexpr int BN = 32; /* entries per K/V tile: one per lane when scoring */
constexpr int WARPS = 4; /* warps per block in both kernels */
constexpr int ROWS_PER_WARP = 4;
constexpr int ROWS = WARPS * ROWS_PER_WARP; /* (query, head) rows per block; warp w has rows w, w+4, ... */
constexpr int DECODE_MAX_TOKENS = 16; /* chunks up to this long take the split path (as the CPU) */
constexpr int SPLIT = 256; /* entries per split before the scratch forces longer ones */
constexpr int REC = 5; /* ints per list record in the tables: see rec_* below */
enum { REC_HI = 0, REC_OFF = 1, REC_IDS = 2, REC_SPLIT = 3, REC_PART = 4 };

/* Where the call's tables are on the device (all in b->dev_slice). */
struct tables {
    const int32_t *rec; /* [n_rows][n_kv][REC]: visible count, off, first block id, split, partial base */
    const int32_t *qpos; /* [n_rows] query positions */
    const int32_t *ids; /* block ids, each list's from rec[REC_IDS] */
};

/* The pool as the kernels see it. */
struct pool_view {
    const float *k, *v; /* [n_blocks][block_size][head_dim] */
    const int32_t *pos; /* [n_blocks][block_size] */
    int bs, d;
};

__device__ __forceinline__ size_t slot_of(const pool_view &p, const int32_t *ids, int off, int e)
{
    int i = off + e;
    return (size_t)ids[i / p.bs] * (size_t)p.bs + (size_t)(i % p.bs);
}

/* First of entries [0, n) whose position is > min_pos (positions increase along a list), as
 * kr_kv_list_first_after. */
__device__ int first_after(const pool_view &p, const int32_t *ids, int off, int n, int32_t min_pos)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (p.pos[slot_of(p, ids, off, mid)] > min_pos) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}


/* Shared memory of both kernels (dynamic, floats): q rows [ROWS][DMAX], keys [BN][DMAX + 1]
 * (padded: lane j reads key row j column c, conflict-free), values [BN][DMAX], positions [BN]. */
template <int DMAX> constexpr size_t smem_bytes()
{
    return sizeof(float) * ((size_t)ROWS * DMAX + (size_t)BN * (DMAX + 1) + (size_t)BN * DMAX) +
           sizeof(int32_t) * BN;
}

/* The block's rows: row r (< ROWS) is valid when valid[r]; sees entries [lo, hi[r]) where lo is
 * the block's start and the window hides positions <= qpos[r] - window. Per-lane state of the
 * rows of this warp (rows warp + WARPS * rr). */
template <int DMAX> struct row_state {
    float m[ROWS_PER_WARP], l[ROWS_PER_WARP];
    float acc[ROWS_PER_WARP][DMAX / 32]; /* lane holds columns lane + 32 * k */
};

/* This lane's key (row `lane` of sk) against the warp's first NR query rows (warp + WARPS * rr). */
template <int DMAX, int NR>
__device__ __forceinline__ void dots(const float *sq, const float *sk, int d, float *s)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int c = 0; c < d; c++) {
        float kc = sk[lane * (DMAX + 1) + c];
#pragma unroll
        for (int rr = 0; rr < NR; rr++) s[rr] += sq[(warp + WARPS * rr) * DMAX + c] * kc;
    }
}

/* Attends entries [e0, e1) of one list (ids, off) with the block's ROWS rows whose queries are
 * in sq; the valid rows are a prefix of the ROWS. Every thread of the block calls it (it synchronises). Masking: entry e counts for row
 * r when e < hi[r] and (window <= 0 or its position > qpos[r] - window); the block's range
 * [e0, e1) must cover every row's visible entries that this block is responsible for. */
template <int DMAX>
__device__ void attend_range(const pool_view &p, const int32_t *ids, int off, int e0, int e1,
                             const float *sq, float *sk, float *sv, int32_t *spos, const int *hi,
                             const int32_t *qpos, const bool *valid, int window, float scale,
                             row_state<DMAX> &st)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d = p.d;
    int nr = 0; /* valid rows of this warp */
    while (nr < ROWS_PER_WARP && valid[warp + WARPS * nr]) nr++;
    for (int t0 = e0; t0 < e1; t0 += BN) {
        /* load the tile: warp w copies entries w, w + WARPS, ... (one coalesced row each); all
         * of a row's loads are issued before its stores, two rows at a time, so that decode
         * (bandwidth-bound) keeps many loads in flight */
#pragma unroll 2
        for (int j = warp; j < BN; j += WARPS) {
            const int e = t0 + j;
            float kv[DMAX / 32], vv[DMAX / 32];
            if (e < e1) {
                size_t s = slot_of(p, ids, off, e);
                const float *kr = p.k + s * (size_t)d, *vr = p.v + s * (size_t)d;
#pragma unroll
                for (int k = 0; k < DMAX / 32; k++) {
                    int c = lane + 32 * k;
                    kv[k] = c < d ? kr[c] : 0.0f;
                    vv[k] = c < d ? vr[c] : 0.0f;
                }
                if (lane == 0) spos[j] = p.pos[s];
            } else {
#pragma unroll
                for (int k = 0; k < DMAX / 32; k++) kv[k] = vv[k] = 0.0f; /* p = 0 times it */
            }
#pragma unroll
            for (int k = 0; k < DMAX / 32; k++) {
                int c = lane + 32 * k;
                if (c < d) {
                    sk[j * (DMAX + 1) + c] = kv[k];
                    sv[j * DMAX + c] = vv[k];
                }
            }
        }
        __syncthreads();
        const int e = t0 + lane;
        float s[ROWS_PER_WARP] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (e < e1) {
            /* only this warp's valid rows (a prefix: decode blocks often hold fewer than ROWS) */
            if (nr == 1) dots<DMAX, 1>(sq, sk, d, s);
            else if (nr == 2) dots<DMAX, 2>(sq, sk, d, s);
            else if (nr == 3) dots<DMAX, 3>(sq, sk, d, s);
            else if (nr == 4) dots<DMAX, 4>(sq, sk, d, s);
        }
#pragma unroll
        for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
            const int r = warp + WARPS * rr;
            if (!valid[r]) continue; /* warp-uniform */
            bool vis = e < e1 && e < hi[r] && (window <= 0 || spos[lane] > qpos[r] - window);
            float x = vis ? s[rr] * scale : -INFINITY;
            float m_new = fmaxf(st.m[rr], warp_max(x));
            if (m_new == -INFINITY) continue; /* nothing seen yet: warp-uniform */
            float pr = vis ? expf(x - m_new) : 0.0f;
            float corr = expf(st.m[rr] - m_new); /* exp(-inf) = 0 on the first visible tile */
            st.l[rr] = st.l[rr] * corr + warp_sum(pr);
            st.m[rr] = m_new;
#pragma unroll
            for (int k = 0; k < DMAX / 32; k++) st.acc[rr][k] *= corr;
            for (int j = 0; j < BN; j++) {
                float pj = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
                for (int k = 0; k < DMAX / 32; k++) {
                    int c = lane + 32 * k;
                    if (c < d) st.acc[rr][k] += pj * sv[j * DMAX + c];
                }
            }
        }
        __syncthreads(); /* the next tile overwrites sk, sv, spos */
    }
}

template <int DMAX> __device__ void state_init(row_state<DMAX> &st)
{
#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
        st.m[rr] = -INFINITY;
        st.l[rr] = 0.0f;
#pragma unroll
        for (int k = 0; k < DMAX / 32; k++) st.acc[rr][k] = 0.0f;
    }
}

/*
 * chunk_kernel: a chunk of n > DECODE_MAX_TOKENS queries of one sequence.
 * grid.x = ceil(n * group / ROWS) tiles of (query, head) rows, row index ri = i * group + h
 * (query i, head h of the group), taken in reverse so the blocks with the most entries (the
 * last queries) start first; grid.y = KV head g. block = WARPS * 32 threads. Dynamic shared
 * memory smem_bytes<DMAX>(). The block attends entries [lo(first query), hi(last query)) of
 * list g in tiles of BN; each row masks what it does not see. Writes normalised rows of out.
 */
template <int DMAX>
__global__ void __launch_bounds__(WARPS * 32)
chunk_kernel(pool_view p, tables t, const float *q, float *out, int n, int n_heads, int n_kv,
             int window, float scale)
{
    extern __shared__ float smem[];
    float *sq = smem, *sk = sq + ROWS * DMAX, *sv = sk + BN * (DMAX + 1);
    int32_t *spos = (int32_t *)(sv + BN * DMAX);
    __shared__ int hi[ROWS];
    __shared__ int32_t qpos[ROWS];
    __shared__ bool valid[ROWS];
    __shared__ int range[2];
    const int g = blockIdx.y, group = n_heads / n_kv, d = p.d;
    const int tile = gridDim.x - 1 - blockIdx.x, rows = n * group;
    const int32_t *rec = t.rec + (size_t)g * REC; /* row 0's records: one list per KV head */
    const int len = rec[REC_HI] + n - 1; /* the records hold query 0's visible count */
    const int off = rec[REC_OFF];
    const int32_t *ids = t.ids + rec[REC_IDS];

    if (threadIdx.x < ROWS) {
        int r = threadIdx.x, ri = tile * ROWS + r;
        valid[r] = ri < rows;
        int i = valid[r] ? ri / group : 0;
        hi[r] = len - n + i + 1;
        qpos[r] = t.qpos[i];
    }
    for (int x = threadIdx.x; x < ROWS * DMAX; x += blockDim.x) {
        int r = x / DMAX, c = x % DMAX, ri = tile * ROWS + r;
        float v = 0.0f;
        if (ri < rows && c < d) v = q[((size_t)(ri / group) * n_heads + (size_t)g * group + ri % group) * d + c];
        sq[x] = v;
    }
    if (threadIdx.x == 0) {
        int i_first = tile * ROWS / group;
        int last = min(rows, (tile + 1) * ROWS) - 1;
        int hi_first = len - n + i_first + 1;
        range[0] = window > 0 ? first_after(p, ids, off, hi_first, t.qpos[i_first] - window) : 0;
        range[1] = len - n + last / group + 1;
    }
    __syncthreads();
    row_state<DMAX> st;
    state_init(st);
    attend_range<DMAX>(p, ids, off, range[0], range[1], sq, sk, sv, spos, hi, qpos, valid, window,
                       scale, st);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
        const int r = warp + WARPS * rr, ri = tile * ROWS + r;
        if (!valid[r]) continue;
        float inv = 1.0f / st.l[rr];
        float *o = out + ((size_t)(ri / group) * n_heads + (size_t)g * group + ri % group) * d;
#pragma unroll
        for (int k = 0; k < DMAX / 32; k++) {
            int c = lane + 32 * k;
            if (c < d) o[c] = st.acc[rr][k] * inv;
        }
    }
}

/*
 * chunk_tc_kernel: the chunk path on tensor cores for head_dim 64 and 128 (the shapes of the
 * models users run): bf16 operands, fp32 accumulation (wmma m16n16k16), same rows and masking
 * as chunk_kernel. grid.x = ceil(n * group / TC_ROWS) tiles of (query, head) rows ri = i * group
 * + h, taken in reverse (the longest first); grid.y = KV head g. block = TC_WARPS * 32 threads;
 * warp w owns rows 16w .. 16w + 15 of the tile. Dynamic shared memory tc_layout<D>::bytes:
 * Q [TC_ROWS][D] bf16, K and V tiles [TC_BN][D] bf16 (converted from the f32 pool on load,
 * shared by every head of the group), scores [TC_ROWS][TC_BN] f32, probabilities [TC_ROWS][TC_BN]
 * bf16, the output accumulator [TC_ROWS][D] f32 (rescaled in shared memory when a row's max
 * grows: wmma accumulators have no defined element layout), positions [TC_BN]. Each row's
 * running max and sum live in registers (every lane holds the warp's 16 rows' values).
 * The rows of a warp are touched by that warp only, so only K/V loads need block barriers.
 */
constexpr int TC_WARPS = 4;
constexpr int TC_ROWS = TC_WARPS * 16;
constexpr int TC_BN = 64;

template <int D> struct tc_layout {
    static constexpr int LDB = D + 8; /* bf16 row stride of Q, K, V: rows stay 32-byte aligned per 16 */
    static constexpr int LDP = TC_BN + 8; /* bf16 row stride of the probabilities */
    static constexpr size_t q_off = 0;
    static constexpr size_t k_off = q_off + sizeof(__nv_bfloat16) * TC_ROWS * LDB;
    static constexpr size_t v_off = k_off + sizeof(__nv_bfloat16) * TC_BN * LDB;
    static constexpr size_t s_off = v_off + sizeof(__nv_bfloat16) * TC_BN * LDB;
    static constexpr size_t p_off = s_off + sizeof(float) * TC_ROWS * TC_BN;
    static constexpr size_t o_off = p_off + sizeof(__nv_bfloat16) * TC_ROWS * LDP;
    static constexpr size_t pos_off = o_off + sizeof(float) * TC_ROWS * D;
    static constexpr size_t bytes = pos_off + sizeof(int32_t) * TC_BN;
};

template <int D>
__global__ void __launch_bounds__(TC_WARPS * 32)
chunk_tc_kernel(pool_view p, tables t, const float *q, float *out, int n, int n_heads, int n_kv,
                int window, float scale)
{
    using L = tc_layout<D>;
    namespace wmma = nvcuda::wmma;
    extern __shared__ __align__(128) unsigned char tc_smem[];
    __nv_bfloat16 *sq = (__nv_bfloat16 *)(tc_smem + L::q_off), *sk = (__nv_bfloat16 *)(tc_smem + L::k_off);
    __nv_bfloat16 *sv = (__nv_bfloat16 *)(tc_smem + L::v_off), *sp = (__nv_bfloat16 *)(tc_smem + L::p_off);
    float *ss = (float *)(tc_smem + L::s_off), *so = (float *)(tc_smem + L::o_off);
    int32_t *spos = (int32_t *)(tc_smem + L::pos_off);
    __shared__ int hi[TC_ROWS];
    __shared__ int32_t qpos[TC_ROWS];
    __shared__ bool valid[TC_ROWS];
    __shared__ int range[2];
    const int g = blockIdx.y, group = n_heads / n_kv, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tile = gridDim.x - 1 - blockIdx.x, rows = n * group;
    const int32_t *rec = t.rec + (size_t)g * REC; /* query 0's record of list g */
    const int len = rec[REC_HI] + n - 1, off = rec[REC_OFF];
    const int32_t *ids = t.ids + rec[REC_IDS];

    for (int r = threadIdx.x; r < TC_ROWS; r += blockDim.x) {
        int ri = tile * TC_ROWS + r;
        valid[r] = ri < rows;
        int i = ri < rows ? ri / group : 0;
        hi[r] = len - n + i + 1;
        qpos[r] = t.qpos[i];
    }
    for (int x = threadIdx.x; x < TC_ROWS * D; x += blockDim.x) {
        int r = x / D, c = x % D, ri = tile * TC_ROWS + r;
        float v = ri < rows ? q[((size_t)(ri / group) * n_heads + (size_t)g * group + ri % group) * D + c] : 0.0f;
        sq[r * L::LDB + c] = __float2bfloat16(v);
        so[x] = 0.0f;
    }
    if (threadIdx.x == 0) {
        int i_first = tile * TC_ROWS / group, last = min(rows, (tile + 1) * TC_ROWS) - 1;
        range[0] = window > 0 ? first_after(p, ids, off, len - n + i_first + 1, t.qpos[i_first] - window) : 0;
        range[1] = len - n + last / group + 1;
    }
    __syncthreads();
    float m[16], l[16]; /* rows 16 * warp + rr: the same in every lane */
#pragma unroll
    for (int rr = 0; rr < 16; rr++) m[rr] = -INFINITY, l[rr] = 0.0f;
    const int e0 = range[0], e1 = range[1];
    for (int t0 = e0; t0 < e1; t0 += TC_BN) {
        for (int j = warp; j < TC_BN; j += TC_WARPS) {
            int e = t0 + j;
            if (e < e1) {
                size_t s = slot_of(p, ids, off, e);
                const float *kr = p.k + s * D, *vr = p.v + s * D;
                for (int c = lane; c < D; c += 32) {
                    sk[j * L::LDB + c] = __float2bfloat16(kr[c]);
                    sv[j * L::LDB + c] = __float2bfloat16(vr[c]);
                }
                if (lane == 0) spos[j] = p.pos[s];
            } else { /* zeros: a masked probability times garbage could still be NaN */
                for (int c = lane; c < D; c += 32) {
                    sk[j * L::LDB + c] = __float2bfloat16(0.0f);
                    sv[j * L::LDB + c] = __float2bfloat16(0.0f);
                }
            }
        }
        __syncthreads();
        /* S = Q K^T for this warp's 16 rows */
        {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
#pragma unroll
            for (int nb = 0; nb < TC_BN / 16; nb++) {
                wmma::fill_fragment(fc, 0.0f);
#pragma unroll
                for (int k = 0; k < D / 16; k++) {
                    wmma::load_matrix_sync(fa, sq + warp * 16 * L::LDB + k * 16, L::LDB);
                    wmma::load_matrix_sync(fb, sk + nb * 16 * L::LDB + k * 16, L::LDB);
                    wmma::mma_sync(fc, fa, fb, fc);
                }
                wmma::store_matrix_sync(ss + warp * 16 * TC_BN + nb * 16, fc, TC_BN, wmma::mem_row_major);
            }
        }
        __syncwarp();
        /* online softmax of each row; lanes hold entries lane and lane + 32 */
#pragma unroll
        for (int rr = 0; rr < 16; rr++) {
            const int r = warp * 16 + rr;
            float x[2], pr[2];
#pragma unroll
            for (int u = 0; u < 2; u++) {
                int j = lane + 32 * u, e = t0 + j;
                bool vis = valid[r] && e < e1 && e < hi[r] && (window <= 0 || spos[j] > qpos[r] - window);
                x[u] = vis ? ss[r * TC_BN + j] * scale : -INFINITY;
            }
            float m_new = fmaxf(m[rr], warp_max(fmaxf(x[0], x[1])));
            float corr = 1.0f;
            if (m_new == -INFINITY) { /* nothing seen yet (or an invalid row): warp-uniform */
                pr[0] = pr[1] = 0.0f;
            } else {
                pr[0] = expf(x[0] - m_new); /* exp(-inf) = 0 for masked entries */
                pr[1] = expf(x[1] - m_new);
                corr = expf(m[rr] - m_new);
                l[rr] = l[rr] * corr + warp_sum(pr[0] + pr[1]);
                m[rr] = m_new;
            }
            sp[r * L::LDP + lane] = __float2bfloat16(pr[0]);
            sp[r * L::LDP + lane + 32] = __float2bfloat16(pr[1]);
            if (corr != 1.0f)
                for (int c = lane; c < D; c += 32) so[r * D + c] *= corr;
        }
        __syncwarp();
        /* O += P V for this warp's rows */
        {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> fc;
#pragma unroll
            for (int cb = 0; cb < D / 16; cb++) {
                wmma::load_matrix_sync(fc, so + warp * 16 * D + cb * 16, D, wmma::mem_row_major);
#pragma unroll
                for (int k = 0; k < TC_BN / 16; k++) {
                    wmma::load_matrix_sync(fa, sp + warp * 16 * L::LDP + k * 16, L::LDP);
                    wmma::load_matrix_sync(fb, sv + k * 16 * L::LDB + cb * 16, L::LDB);
                    wmma::mma_sync(fc, fa, fb, fc);
                }
                wmma::store_matrix_sync(so + warp * 16 * D + cb * 16, fc, D, wmma::mem_row_major);
            }
        }
        __syncthreads(); /* the next tile overwrites K, V and positions */
    }
#pragma unroll
    for (int rr = 0; rr < 16; rr++) {
        const int r = warp * 16 + rr, ri = tile * TC_ROWS + r;
        if (!valid[r]) continue;
        const float inv = 1.0f / l[rr];
        float *o = out + ((size_t)(ri / group) * n_heads + (size_t)g * group + ri % group) * D;
        for (int c = lane; c < D; c += 32) o[c] = so[r * D + c] * inv;
    }
}

/*
 * split_kernel: decode rows (one query token each) split along their lists.
 * grid.x = split index s (up to the most splits any list of the launch has; blocks past their
 * list's count return), grid.y = KV head g * head_chunks + chunk of ROWS query heads,
 * grid.z = row i - row0 of this launch. block = WARPS * 32 threads, dynamic shared memory
 * smem_bytes<DMAX>(). Row i's record for g gives its visible count hi, off, block ids, split
 * length and partial base; the block attends [s * split, min((s + 1) * split, hi)) less the
 * entries the window hides. One split: writes the normalised row to out. Several:
 * writes (max, sum, unnormalised output[d]) for each query head at
 * part[((base + s) * group + h) * (d + 2)], for merge_kernel.
 */
template <int DMAX>
__global__ void __launch_bounds__(WARPS * 32)
split_kernel(pool_view p, tables t, const float *q, float *out, float *part, int row0, int n_heads,
             int n_kv, int head_chunks, int window, float scale)
{
    extern __shared__ float smem[];
    float *sq = smem, *sk = sq + ROWS * DMAX, *sv = sk + BN * (DMAX + 1);
    int32_t *spos = (int32_t *)(sv + BN * DMAX);
    __shared__ int hi[ROWS];
    __shared__ int32_t qpos[ROWS];
    __shared__ bool valid[ROWS];
    __shared__ int range[2];
    const int i = row0 + blockIdx.z, g = blockIdx.y / head_chunks, h0 = (blockIdx.y % head_chunks) * ROWS;
    const int group = n_heads / n_kv, d = p.d, s = blockIdx.x;
    const int32_t *rec = t.rec + ((size_t)i * n_kv + g) * REC;
    const int len = rec[REC_HI], off = rec[REC_OFF], split = rec[REC_SPLIT], base = rec[REC_PART];
    const int n_splits = (len + split - 1) / split;
    if (s >= n_splits) return; /* block-uniform, before any barrier */
    const int32_t *ids = t.ids + rec[REC_IDS];
    const int32_t qp = t.qpos[i];

    if (threadIdx.x < ROWS) {
        int r = threadIdx.x;
        valid[r] = h0 + r < group;
        hi[r] = len;
        qpos[r] = qp;
    }
    const float *qrow = q + ((size_t)i * n_heads + (size_t)g * group + h0) * d;
    for (int x = threadIdx.x; x < ROWS * DMAX; x += blockDim.x) {
        int r = x / DMAX, c = x % DMAX;
        sq[x] = h0 + r < group && c < d ? qrow[(size_t)r * d + c] : 0.0f;
    }
    if (threadIdx.x == 0) {
        /* a split wholly behind the window (its newest entry hidden) attends nothing; the one
         * split the window's edge cuts is masked entry by entry in attend_range (one read here
         * instead of a binary search per block: decode blocks are short) */
        int a = s * split, b = min(a + split, len);
        bool hidden = window > 0 && b > a && p.pos[slot_of(p, ids, off, b - 1)] <= qp - window;
        range[0] = a;
        range[1] = hidden ? a : b;
    }
    __syncthreads();
    row_state<DMAX> st;
    state_init(st);
    attend_range<DMAX>(p, ids, off, range[0], range[1], sq, sk, sv, spos, hi, qpos, valid, window,
                       scale, st);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int rr = 0; rr < ROWS_PER_WARP; rr++) {
        const int r = warp + WARPS * rr, h = h0 + r;
        if (!valid[r]) continue;
        if (n_splits == 1) {
            float inv = 1.0f / st.l[rr];
            float *o = out + ((size_t)i * n_heads + (size_t)g * group + h) * d;
#pragma unroll
            for (int k = 0; k < DMAX / 32; k++) {
                int c = lane + 32 * k;
                if (c < d) o[c] = st.acc[rr][k] * inv;
            }
        } else {
            float *o = part + ((size_t)(base + s) * group + h) * (size_t)(d + 2);
            if (lane == 0) o[0] = st.m[rr], o[1] = st.l[rr];
#pragma unroll
            for (int k = 0; k < DMAX / 32; k++) {
                int c = lane + 32 * k;
                if (c < d) o[2 + c] = st.acc[rr][k];
            }
        }
    }
}

/*
 * merge_kernel: combines the splits of each (row, KV head) that has more than one.
 * grid.x = n_kv * group query heads (head hq, its KV head hq / group), grid.y = row i - row0;
 * block = 128 threads over the d columns. Splits are combined in order: M = max of the split
 * maxima, L = sum l_s exp(m_s - M), out = sum acc_s exp(m_s - M) / L (empty splits, m = -inf,
 * add 0). Deterministic: a row's result does not depend on the rest of the batch.
 */
__global__ void merge_kernel(tables t, float *out, const float *part, int row0, int n_heads, int n_kv,
                             int d)
{
    const int i = row0 + blockIdx.y, hq = blockIdx.x, group = n_heads / n_kv;
    const int g = hq / group, h = hq % group;
    const int32_t *rec = t.rec + ((size_t)i * n_kv + g) * REC;
    const int len = rec[REC_HI], split = rec[REC_SPLIT], base = rec[REC_PART];
    const int n_splits = (len + split - 1) / split;
    if (n_splits <= 1) return; /* split_kernel wrote it */
    float m = -INFINITY;
    for (int s = 0; s < n_splits; s++) m = fmaxf(m, part[((size_t)(base + s) * group + h) * (size_t)(d + 2)]);
    float l = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        const float *ps = part + ((size_t)(base + s) * group + h) * (size_t)(d + 2);
        l += ps[0] == -INFINITY ? 0.0f : ps[1] * expf(ps[0] - m);
    }
    const float inv = 1.0f / l;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float *ps = part + ((size_t)(base + s) * group + h) * (size_t)(d + 2);
            if (ps[0] != -INFINITY) a += ps[2 + c] * expf(ps[0] - m);
        }
        out[((size_t)i * n_heads + hq) * d + c] = a * inv;
    }
}

void fail(const char *what)
{
    fprintf(stderr, "CUDA attention: %s\n", what);
    abort();
}

pool_view view_of(const kr_kv_pool *pool)
{
    pool_view p;
    p.k = reinterpret_cast<const float *>(pool->k); /* f32: the CUDA backend stores no other dtype */
    p.v = reinterpret_cast<const float *>(pool->v);
    p.pos = pool->pos;
    p.bs = pool->block_size;
    p.d = pool->head_dim;
    return p;
}

/* Blocks a list's first `visible` entries span. */
int blocks_spanned(const kr_kv_pool *p, const kr_kv_list *l, int visible)
{
    return (l->off + visible + p->block_size - 1) / p->block_size;
}

template <int DMAX> void set_smem(const void *kernel)
{
    if (smem_bytes<DMAX>() > 48 * 1024)
        KR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem_bytes<DMAX>()));
}

/* Split length of a list of `visible` entries: SPLIT, doubled until the partials of a whole
 * row (every query head with this many splits) fit the scratch; a function of the list only,
 * so a row rounds the same in any batch. */
int split_of(const kr_backend *b, int visible, int n_heads, int d)
{
    const size_t per = (size_t)n_heads * (size_t)(d + 2);
    int split = SPLIT;
    while ((size_t)((visible + split - 1) / split) * per > b->dev_scratch_floats && split < (1 << 29))
        split *= 2;
    return split;
}

/* Partial slots row i needs (lists with one split need none: they write `out` directly) and
 * the most splits of its lists. */
size_t row_need(const int32_t *rec, int i, int n_kv, int *most)
{
    size_t need = 0;
    for (int g = 0; g < n_kv; g++) {
        const int32_t *r = rec + ((size_t)i * n_kv + g) * REC;
        int ns = (r[REC_HI] + r[REC_SPLIT] - 1) / r[REC_SPLIT];
        if (ns > 1) need += (size_t)ns;
        if (ns > *most) *most = ns;
    }
    return need;
}

/* The split path over rows 0 .. n_rows-1 whose records are in b->host_slice (fill_tables):
 * sets each list's split length and partial base, uploads the tables, then launches
 * (split_kernel, merge_kernel) once per run of consecutive rows whose partials fit the scratch
 * together (one run unless the batch is long and its contexts too). */
template <int DMAX>
void run_split(kr_backend *b, const kr_kv_pool *pool, const float *q, int n_rows, int n_heads, int n_kv,
               int window, size_t n_ints, float *out)
{
    const int d = pool->head_dim, group = n_heads / n_kv;
    const int head_chunks = (group + ROWS - 1) / ROWS;
    const size_t per = (size_t)group * (size_t)(d + 2); /* floats of one partial slot */
    int32_t *rec = b->host_slice;
    tables t;
    t.rec = b->dev_slice;
    t.qpos = b->dev_slice + (size_t)n_rows * n_kv * REC;
    t.ids = t.qpos + n_rows;
    /* pass 1: split lengths and partial bases (bases restart at 0 with each launch) */
    int row0 = 0, most = 1;
    size_t used = 0;
    for (int i = 0; i < n_rows; i++) {
        for (int g = 0; g < n_kv; g++) {
            int32_t *r = rec + ((size_t)i * n_kv + g) * REC;
            r[REC_SPLIT] = split_of(b, r[REC_HI], n_heads, d);
        }
        size_t need = row_need(rec, i, n_kv, &most);
        if (i > row0 && (used + need) * per > b->dev_scratch_floats) row0 = i, used = 0;
        for (int g = 0; g < n_kv; g++) {
            int32_t *r = rec + ((size_t)i * n_kv + g) * REC;
            int ns = (r[REC_HI] + r[REC_SPLIT] - 1) / r[REC_SPLIT];
            r[REC_PART] = (int32_t)used;
            if (ns > 1) used += (size_t)ns;
        }
    }
    KR_CUDA_CHECK(cudaMemcpyAsync(b->dev_slice, b->host_slice, n_ints * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, b->stream));
    set_smem<DMAX>((const void *)split_kernel<DMAX>);
    const float scale = 1.0f / sqrtf((float)d);
    auto launch = [&](int r0, int r1, int max_splits) {
        dim3 grid((unsigned)max_splits, (unsigned)(n_kv * head_chunks), (unsigned)(r1 - r0));
        split_kernel<DMAX><<<grid, WARPS * 32, smem_bytes<DMAX>(), b->stream>>>(
            view_of(pool), t, q, out, b->dev_scratch, r0, n_heads, n_kv, head_chunks, window, scale);
        KR_CUDA_CHECK(cudaGetLastError());
        if (max_splits > 1) {
            merge_kernel<<<dim3((unsigned)n_heads, (unsigned)(r1 - r0)), 128, 0, b->stream>>>(
                t, out, b->dev_scratch, r0, n_heads, n_kv, d);
            KR_CUDA_CHECK(cudaGetLastError());
        }
    };
    /* pass 2: the same boundaries as pass 1, launching each run of rows */
    row0 = 0;
    used = 0;
    most = 1;
    for (int i = 0; i < n_rows; i++) {
        int row_most = 1;
        size_t need = row_need(rec, i, n_kv, &row_most);
        if (i > row0 && (used + need) * per > b->dev_scratch_floats) {
            launch(row0, i, most);
            row0 = i, used = 0, most = 1;
        }
        used += need;
        most = row_most > most ? row_most : most;
    }
    launch(row0, n_rows, most);
}

/* Fills b->host_slice for n_rows rows: records [n_rows][n_kv][REC] (visible count, off, block
 * ids' start; split and partial base 0), then query positions, then the block ids. Row i's
 * lists are seqs[i] (batch) or s's (chunk: rows are its tokens, token i sees len - n + i + 1;
 * the ids are written once per list). Returns the ints used. */
size_t fill_tables(kr_backend *b, const kr_seq *s, const kr_seq *const *seqs, int layer, int n_rows,
                   const int32_t *pos)
{
    const int n_kv = seqs ? seqs[0]->n_kv_heads : s->n_kv_heads;
    const kr_kv_pool *pool = seqs ? seqs[0]->pool : s->pool;
    size_t n_ids = 0;
    for (int i = 0; i < (seqs ? n_rows : 1); i++) {
        const kr_seq *owner = seqs ? seqs[i] : s;
        for (int g = 0; g < n_kv; g++) {
            const kr_kv_list *l = &owner->lists[layer * n_kv + g];
            n_ids += (size_t)blocks_spanned(pool, l, l->len);
        }
    }
    const size_t n_ints = (size_t)n_rows * n_kv * REC + (size_t)n_rows + n_ids;
    if (kr_cuda_tables_reserve(b, n_ints) != KR_OK) fail("out of device memory for block tables");
    int32_t *rec = b->host_slice, *qpos = rec + (size_t)n_rows * n_kv * REC, *ids = qpos + n_rows;
    int32_t at = 0;
    for (int i = 0; i < n_rows; i++) {
        const kr_seq *owner = seqs ? seqs[i] : s;
        qpos[i] = pos[i];
        for (int g = 0; g < n_kv; g++) {
            const kr_kv_list *l = &owner->lists[layer * n_kv + g];
            int32_t *r = rec + ((size_t)i * n_kv + g) * REC;
            r[REC_HI] = seqs ? l->len : l->len - n_rows + i + 1;
            r[REC_OFF] = l->off;
            r[REC_SPLIT] = 0;
            r[REC_PART] = 0;
            if (seqs || i == 0) {
                int nb = blocks_spanned(pool, l, l->len);
                r[REC_IDS] = at;
                for (int x = 0; x < nb; x++) ids[at + x] = l->blocks[x];
                at += nb;
            } else {
                r[REC_IDS] = rec[(size_t)g * REC + REC_IDS];
            }
        }
    }
    return n_ints;
}

void check_shape(const kr_kv_pool *pool, int n_heads, int n_kv)
{
    if (pool->head_dim > 256 || pool->head_dim <= 0) fail("head_dim must be 1..256");
    if (n_kv <= 0 || n_heads % n_kv != 0) fail("n_heads must be a multiple of n_kv_heads");
}

/* The chunk path: tensor cores for head_dim 64 and 128, the fp32 kernel for other sizes. */
template <int DMAX>
void chunk(kr_backend *b, const kr_seq *s, const float *q, int n, int n_heads, int window, size_t n_ints,
           float *out)
{
    const kr_kv_pool *pool = s->pool;
    const int n_kv = s->n_kv_heads, group = n_heads / n_kv, d = pool->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    tables t;
    t.rec = b->dev_slice;
    t.qpos = b->dev_slice + (size_t)n * n_kv * REC;
    t.ids = t.qpos + n;
    KR_CUDA_CHECK(cudaMemcpyAsync(b->dev_slice, b->host_slice, n_ints * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, b->stream));
    const size_t rows = (size_t)n * group;
    if (d == DMAX && (DMAX == 64 || DMAX == 128)) {
        constexpr int D = DMAX == 64 ? 64 : 128; /* instantiates the tensor-core kernel only for 64/128 */
        const size_t bytes = tc_layout<D>::bytes;
        KR_CUDA_CHECK(cudaFuncSetAttribute((const void *)chunk_tc_kernel<D>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
        dim3 grid((unsigned)((rows + TC_ROWS - 1) / TC_ROWS), (unsigned)n_kv);
        chunk_tc_kernel<D><<<grid, TC_WARPS * 32, bytes, b->stream>>>(view_of(pool), t, q, out, n, n_heads,
                                                                     n_kv, window, scale);
    } else {
        set_smem<DMAX>((const void *)chunk_kernel<DMAX>);
        dim3 grid((unsigned)((rows + ROWS - 1) / ROWS), (unsigned)n_kv);
        chunk_kernel<DMAX><<<grid, WARPS * 32, smem_bytes<DMAX>(), b->stream>>>(view_of(pool), t, q, out, n,
                                                                             n_heads, n_kv, window, scale);
    }
    KR_CUDA_CHECK(cudaGetLastError());
}

} // namespace

void kr_cuda_attention(kr_backend *b, const kr_seq *s, int layer, const float *q, int n, int n_heads,
                       const int32_t *pos, int window, float *out)
{
    if (n <= 0) return;
    const kr_kv_pool *pool = s->pool;
    check_shape(pool, n_heads, s->n_kv_heads);
    const size_t n_ints = fill_tables(b, s, NULL, layer, n, pos);
    const int d = pool->head_dim;
    if (n <= DECODE_MAX_TOKENS) {
        if (d <= 64) run_split<64>(b, pool, q, n, n_heads, s->n_kv_heads, window, n_ints, out);
        else if (d <= 128) run_split<128>(b, pool, q, n, n_heads, s->n_kv_heads, window, n_ints, out);
        else run_split<256>(b, pool, q, n, n_heads, s->n_kv_heads, window, n_ints, out);
    } else {
        if (d <= 64) chunk<64>(b, s, q, n, n_heads, window, n_ints, out);
        else if (d <= 128) chunk<128>(b, s, q, n, n_heads, window, n_ints, out);
        else chunk<256>(b, s, q, n, n_heads, window, n_ints, out);
    }
}

void kr_cuda_attention_batch(kr_backend *b, const kr_seq *const *seqs, int layer, const float *q, int n,
                             int n_heads, const int32_t *pos, int window, float *out)
{
    if (n <= 0) return;
    const kr_kv_pool *pool = seqs[0]->pool;
    const int n_kv = seqs[0]->n_kv_heads;
    check_shape(pool, n_heads, n_kv);
    for (int i = 1; i < n; i++) /* the kernels take one pool's K, V and positions */
        if (seqs[i]->pool != pool || seqs[i]->n_kv_heads != n_kv) fail("a decode batch's sequences must share one KV pool");
    const size_t n_ints = fill_tables(b, NULL, seqs, layer, n, pos);
    const int d = pool->head_dim;
    if (d <= 64) run_split<64>(b, pool, q, n, n_heads, n_kv, window, n_ints, out);
    else if (d <= 128) run_split<128>(b, pool, q, n, n_heads, n_kv, window, n_ints, out);
    else run_split<256>(b, pool, q, n, n_heads, n_kv, window, n_ints, out);
}
