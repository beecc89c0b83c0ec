/*
 * attention.c - causal GQA attention over the paged KV cache on the CPU backend.
 * Two paths, both with an online softmax (running max and sum) over tiles of entries, so no
 * score matrix of the whole context exists:
 * - few tokens (decode), and decode batches (token i of sequence i): work items are (token, KV
 *   head) pairs, which threads claim one at a time from a shared counter (items differ in cost
 *   by their list's length); each item runs the query heads of one GQA group over that head's
 *   block list in register-blocked kernels: every key row is loaded (and widened) once for the
 *   group's scores, every value row once for the group's outputs;
 * - many tokens (prefill): work items are (KV head, block of 64 queries); each tile of 128 keys
 *   and values is gathered once from its blocks and used by every query head of the group
 *   through two sgemm calls (scores = Q K^T, output += P V), flash-attention style.
 * Token i of a chunk of n sees the first len - n + i + 1 entries of its list: the chunk's own
 * entries are the newest, appended before this call. A sliding window drops the oldest of those
 * (positions <= pos - window).
 * A bf16 or f16 cache is widened as it is read (in registers on the decode path, while gathering
 * a tile on the prefill path); the arithmetic is the f32 path's on the rounded entries.
 * Not here: the scoring op's attention (score.c).
 */
#include "cpu.h"
#include "simd.h"

#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

enum {
    TILE = 128, /* entries per softmax tile (both paths) */
    QBLOCK = 64, /* queries per work item on the prefill path */
    BLOCKED_MIN_TOKENS = 16, /* chunks at least this long take the prefill path */
    ROWS = 4, /* key rows per step of the decode score kernel (vf_sum4 reduces four) */
    CHUNKS = 4, /* vectors of each output row the decode P.V kernel keeps in registers */
};

/* Query heads per pass of the decode kernels: the score kernel holds HEAD_BLOCK x ROWS
 * accumulators and ROWS key vectors, the P.V kernel HEAD_BLOCK x CHUNKS outputs and CHUNKS value
 * vectors: 21 of AVX-512's 32 registers, 13 of AVX2's 16 with 2 heads. */
#if KR_CPU_LEVEL == 1
#define HEAD_BLOCK 2
#else
#define HEAD_BLOCK 4
#endif

#define KR_ALWAYS_INLINE static inline __attribute__((always_inline))

size_t kr_cpu_attention_scratch(const kr_config *cfg)
{
    size_t g = (size_t)(cfg->n_heads / cfg->n_kv_heads), d = (size_t)cfg->head_dim;
    size_t one = g * TILE + g * d + 3 * g;
    size_t blocked = 2 * TILE * d + g * QBLOCK * TILE + g * QBLOCK * d + 2 * g * QBLOCK;
    return one > blocked ? one : blocked;
}

typedef struct att_job {
    kr_backend *b;
    const kr_seq *s; /* one sequence: a chunk of n tokens */
    const kr_seq *const *seqs; /* or a decode batch: token i of seqs[i] */
    int layer;
    const float *q;
    int n;
    int n_heads;
    const int32_t *pos;
    int window;
    float *out;
    atomic_int next; /* decode: the next (token, KV head) item to claim */
} att_job;

/* Asks for the key and value rows of entries [j0, j0 + n) of list l into L2, a block's run of rows
 * at a time: an item's first tile, while the item before is computed. A list's blocks lie wherever
 * the pool had free ones (in a decode node's large, long-used pool, far apart), so the hardware
 * prefetcher, which follows address streams, meets each 2-4 KB block cold. Later tiles are asked
 * for from inside the tile before (tile_heads). */
static void prefetch_rows(const kr_kv_pool *p, const kr_kv_list *l, int j0, int n)
{
    int i = l->off + j0, b = i / p->block_size, slot = i % p->block_size;
    while (n > 0) {
        int run = p->block_size - slot < n ? p->block_size - slot : n;
        const char *k = kr_kv_key(p, l->blocks[b], slot), *v = kr_kv_value(p, l->blocks[b], slot);
        for (size_t off = 0; off < (size_t)run * p->row_bytes; off += 64) {
            __builtin_prefetch(k + off, 0, 2);
            __builtin_prefetch(v + off, 0, 2);
        }
        n -= run, b++, slot = 0;
    }
}

/* The horizontal sums of four vectors, out[0..4), each by a fixed tree of its own lanes: a sum
 * does not depend on the other three vectors. */
static inline void vf_sum4(kr_vf a, kr_vf b, kr_vf c, kr_vf d, float *out)
{
#if KR_CPU_LEVEL >= 2
    /* 128-bit lanes: ab = [a0+a2, a1+a3, b0+b2, b1+b3], then s = [a, b, c, d] in four floats each */
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4e));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xb1));
    s = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12), s);
    _mm_storeu_ps(out, _mm512_castps512_ps128(s));
#elif KR_CPU_LEVEL == 1
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
#else
    out[0] = a, out[1] = b, out[2] = c, out[3] = d;
#endif
}

/* KR_VL elements of a cache row of dtype t from element i, widened exactly; t is a constant
 * wherever the kernels below are instantiated, so the switch folds away */
KR_ALWAYS_INLINE kr_vf load_kv(kr_dtype t, const void *row, int i)
{
    switch (t) {
    case KR_DTYPE_BF16: return vf_load_bf16((const uint16_t *)row + i);
    case KR_DTYPE_F16: return vf_load_f16((const uint16_t *)row + i);
    case KR_DTYPE_F32: break;
    }
    return vf_load((const float *)row + i);
}

KR_ALWAYS_INLINE float kv_at(kr_dtype t, const void *row, int i)
{
    switch (t) {
    case KR_DTYPE_BF16: return kr_bf16_to_f32(((const uint16_t *)row)[i]);
    case KR_DTYPE_F16: return kr_f16_to_f32(((const uint16_t *)row)[i]);
    case KR_DTYPE_F32: break;
    }
    return ((const float *)row)[i];
}

/* Scores of key rows k[0..ROWS) against nh query heads q[nh][d]: s[h * TILE + r] = q_h . k_r *
 * scale for r < nr (rows past nr are padding: computed, and stored past the tile's entries only
 * when d is a whole number of vectors, where the ROWS scores are stored at once). Each key chunk is loaded
 * once for the nh heads. A score sums its chunk products in one accumulator in element order,
 * then that accumulator's lanes (vf_sum4), then the elements past the last whole chunk. */
KR_ALWAYS_INLINE void score_rows(kr_dtype t, int nh, const float *q, int d, const void *const *k, int nr,
                                 float scale, float *s)
{
    kr_vf acc[HEAD_BLOCK][ROWS];
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) acc[h][r] = vf_zero();
    int i = 0;
    for (; i + KR_VL <= d; i += KR_VL) {
        kr_vf kv[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) kv[r] = load_kv(t, k[r], i);
#pragma GCC unroll 4
        for (int h = 0; h < nh; h++) {
            kr_vf qv = vf_load(q + (size_t)h * d + i);
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) acc[h][r] = vf_fma(qv, kv[r], acc[h][r]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++) {
        float sum[ROWS];
        vf_sum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3], sum);
        if (i == d) { /* no elements past the last chunk: the ROWS scores at once (padding too) */
#pragma GCC unroll 4
            for (int r = 0; r < ROWS; r++) s[(size_t)h * TILE + r] = sum[r] * scale;
            continue;
        }
        for (int r = 0; r < nr; r++) {
            float x = sum[r];
            for (int e = i; e < d; e++) x += q[(size_t)h * d + e] * kv_at(t, k[r], e);
            s[(size_t)h * TILE + r] = x * scale;
        }
    }
}

/* Outputs [i, i + nc * KR_VL) of nh heads (out[nh][d]) over value rows v[0..n): each output is
 * first multiplied by its head's corr, then accumulates p[h * TILE + j] * v_j in entry order
 * j = 0, 1, ..., held in registers across the tile; each value chunk is loaded once for the nh
 * heads. */
KR_ALWAYS_INLINE void pv_chunks(kr_dtype t, int nh, int nc, const float *p, const void *const *v, int n, int i,
                                const float *corr, int d, float *out)
{
    kr_vf acc[HEAD_BLOCK][CHUNKS];
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++) {
        kr_vf c = vf_set1(corr[h]);
#pragma GCC unroll 4
        for (int x = 0; x < nc; x++) acc[h][x] = vf_mul(vf_load(out + (size_t)h * d + i + x * KR_VL), c);
    }
    for (int j = 0; j < n; j++) {
        kr_vf vv[CHUNKS];
#pragma GCC unroll 4
        for (int x = 0; x < nc; x++) vv[x] = load_kv(t, v[j], i + x * KR_VL);
#pragma GCC unroll 4
        for (int h = 0; h < nh; h++) {
            kr_vf w = vf_set1(p[(size_t)h * TILE + j]);
#pragma GCC unroll 4
            for (int x = 0; x < nc; x++) acc[h][x] = vf_fma(w, vv[x], acc[h][x]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 4
        for (int x = 0; x < nc; x++) vf_store(out + (size_t)h * d + i + x * KR_VL, acc[h][x]);
}

/* Scratch of a block of query heads of one item (see attend_one) */
typedef struct head_block {
    const float *q; /* [nh][d] */
    float *sc; /* [nh][TILE] scores, then probabilities */
    float *acc; /* [nh][d] outputs so far, not yet divided by the sum */
    float *m, *sum, *corr; /* [nh] running max and sum; this tile's rescaling of acc */
    const void *const *pk, *const *pv; /* the next tile's rows, pn of them, to ask for (or NULL) */
    int pn, row_bytes; /* row_bytes: of one key or value row */
} head_block;

/* The online softmax step of one tile of n scores for nh heads: the scores become exp(s - max),
 * the running max and sum move on, corr is exp(old max - new max). The max is taken a vector at a
 * time (one compare per score after another was a tenth of a decode step's attention). Not inlined into the kernels:
 * the vectorised exp's constants, hoisted, would take the registers their accumulators need. */
static __attribute__((noinline)) void softmax_tile(const head_block *hb, int nh, int n)
{
    for (int h = 0; h < nh; h++) {
        float *s = hb->sc + (size_t)h * TILE;
        float mt = hb->m[h];
        int j = 0;
        if (n >= KR_VL) { /* the lanes' maxima, then theirs: a max is exact in any order */
            kr_vf vm = vf_load(s);
            for (j = KR_VL; j + KR_VL <= n; j += KR_VL) vm = vf_max(vm, vf_load(s + j));
            float lanes[KR_VL];
            vf_store(lanes, vm);
            for (int x = 0; x < KR_VL; x++) mt = lanes[x] > mt ? lanes[x] : mt;
        }
        for (; j < n; j++) mt = s[j] > mt ? s[j] : mt;
        hb->corr[h] = expf(hb->m[h] - mt); /* exp(-inf) = 0 on the first tile */
        hb->sum[h] = hb->sum[h] * hb->corr[h] + kr_exp_shift_sum(s, n, mt);
        hb->m[h] = mt;
    }
}

/* One tile of n entries (key rows k padded to a multiple of ROWS, value rows v) for the nh heads
 * of hb: scores, the online softmax step, then acc = acc * corr + P V. With hb->pk, each step of
 * the scores asks for the next tile's rows of as many entries into L2: spread through the tile,
 * not a tile's 512 prefetches at once into L1, which held up the kernel's own loads and pushed
 * the tile's value rows out before P V read them (llama-110m's shape, bf16 cache, context 2048, 1
 * thread, the thread's CPU time on a busy machine: 8 sequences 1.19-1.40 ms instead of 2.0-2.2,
 * 32 sequences 5.1-5.5 ms instead of 8.5-8.8, one sequence unchanged). */
KR_ALWAYS_INLINE void tile_heads(kr_dtype t, int nh, const head_block *hb, int d, const void *const *k,
                                 const void *const *v, int n)
{
    const float scale = 1.0f / sqrtf((float)d);
    for (int j = 0; j < n; j += ROWS) {
        if (hb->pk)
            for (int r = j; r < j + ROWS && r < hb->pn; r++)
                for (int off = 0; off < hb->row_bytes; off += 64) {
                    __builtin_prefetch((const char *)hb->pk[r] + off, 0, 2);
                    __builtin_prefetch((const char *)hb->pv[r] + off, 0, 2);
                }
        score_rows(t, nh, hb->q, d, k + j, n - j < ROWS ? n - j : ROWS, scale, hb->sc + j);
    }
    softmax_tile(hb, nh, n);
    int i = 0;
    for (; i + CHUNKS * KR_VL <= d; i += CHUNKS * KR_VL) pv_chunks(t, nh, CHUNKS, hb->sc, v, n, i, hb->corr, d, hb->acc);
    for (; i + KR_VL <= d; i += KR_VL) pv_chunks(t, nh, 1, hb->sc, v, n, i, hb->corr, d, hb->acc);
    for (int h = 0; h < nh; h++) /* the elements past the last whole vector */
        for (int e = i; e < d; e++) {
            float y = hb->acc[(size_t)h * d + e] * hb->corr[h];
            for (int j = 0; j < n; j++) y += hb->sc[(size_t)h * TILE + j] * kv_at(t, v[j], e);
            hb->acc[(size_t)h * d + e] = y;
        }
}

/* tile_heads instantiated for each head count of a block, for one dtype */
KR_ALWAYS_INLINE void tile_dtype(kr_dtype t, int nh, const head_block *hb, int d, const void *const *k,
                                 const void *const *v, int n)
{
    switch (nh) {
    case 1: tile_heads(t, 1, hb, d, k, v, n); return;
#if HEAD_BLOCK > 2
    case 2: tile_heads(t, 2, hb, d, k, v, n); return;
    case 3: tile_heads(t, 3, hb, d, k, v, n); return;
#endif
    default: tile_heads(t, HEAD_BLOCK, hb, d, k, v, n); return;
    }
}

static void tile_run(kr_dtype t, int nh, const head_block *hb, int d, const void *const *k, const void *const *v,
                     int n)
{
    switch (t) {
    case KR_DTYPE_BF16: tile_dtype(KR_DTYPE_BF16, nh, hb, d, k, v, n); return;
    case KR_DTYPE_F16: tile_dtype(KR_DTYPE_F16, nh, hb, d, k, v, n); return;
    case KR_DTYPE_F32: break;
    }
    tile_dtype(KR_DTYPE_F32, nh, hb, d, k, v, n);
}

/* One token's query heads of one GQA group (q, out: [group][d]) over the first `visible`
 * entries of list l, less those at positions <= pos - window when window > 0. Both the chunk
 * path (token i of n sees len - n + i + 1) and the batch path (every token sees its whole list)
 * come here, so a batched row is the one-token call's row bit for bit: nothing in it depends on
 * the call's other items or on the thread that runs it. */
static void attend_one(const kr_kv_pool *p, const kr_kv_list *l, int visible, int32_t pos, int window,
                       const float *q, int group, float *scratch, float *o)
{
    const int d = p->head_dim;
    float *sc = scratch; /* [group][TILE] */
    float *acc = sc + (size_t)group * TILE; /* [group][d] */
    float *m = acc + (size_t)group * d; /* [group] running max */
    float *sum = m + group; /* [group] running sum */
    float *corr = sum + group; /* [group] */
    int start = window > 0 ? kr_kv_list_first_after(p, l, visible, pos - window) : 0;

    for (int h = 0; h < group; h++) {
        m[h] = -INFINITY;
        sum[h] = 0.0f;
        for (int e = 0; e < d; e++) acc[(size_t)h * d + e] = 0.0f;
    }
    const void *rows[2][2][TILE + ROWS - 1]; /* [this tile, the next][keys, values] */
    int cur = 0;
    if (start < visible) kr_kv_list_rows(p, l, start, visible - start < TILE ? visible - start : TILE, rows[0][0], rows[0][1]);
    for (int j0 = start; j0 < visible; j0 += TILE) {
        int jn = visible - j0 < TILE ? visible - j0 : TILE;
        const void **krow = rows[cur][0], **vrow = rows[cur][1];
        for (int r = jn; r % ROWS; r++) krow[r] = krow[jn - 1]; /* the score kernel's padding */
        int nn = visible - j0 - jn < TILE ? visible - j0 - jn : TILE;
        if (nn > 0) kr_kv_list_rows(p, l, j0 + jn, nn, rows[!cur][0], rows[!cur][1]);
        for (int h0 = 0; h0 < group; h0 += HEAD_BLOCK) {
            head_block hb = {.q = q + (size_t)h0 * d, .sc = sc + (size_t)h0 * TILE, .acc = acc + (size_t)h0 * d,
                             .m = m + h0, .sum = sum + h0, .corr = corr + h0,
                             .pk = h0 == 0 && nn > 0 ? rows[!cur][0] : NULL, .pv = rows[!cur][1], .pn = nn, .row_bytes = (int)p->row_bytes};
            tile_run(p->dtype, group - h0 < HEAD_BLOCK ? group - h0 : HEAD_BLOCK, &hb, d, krow, vrow, jn);
        }
        cur = !cur;
    }
    for (int h = 0; h < group; h++) {
        float inv = 1.0f / sum[h];
        for (int e = 0; e < d; e++) o[(size_t)h * d + e] = acc[(size_t)h * d + e] * inv;
    }
}

/* Token i, KV head g: of the chunk of j->s, or of seqs[i] in a batch; *visible: the entries of
 * its list it sees (before the window) */
static const kr_kv_list *item_list(const att_job *j, int i, int g, const kr_seq **s, int *visible)
{
    *s = j->seqs ? j->seqs[i] : j->s;
    const kr_kv_list *l = &(*s)->lists[j->layer * (*s)->n_kv_heads + g];
    *visible = j->seqs ? l->len : l->len - j->n + i + 1;
    return l;
}

static void attend_item(const att_job *j, float *scratch, int i, int g)
{
    const kr_seq *s;
    int visible;
    const kr_kv_list *l = item_list(j, i, g, &s, &visible);
    const int group = j->n_heads / s->n_kv_heads;
    const size_t at = ((size_t)i * j->n_heads + (size_t)g * group) * (size_t)s->pool->head_dim;
    attend_one(s->pool, l, visible, j->pos[i], j->window, j->q + at, group, scratch, j->out + at);
}

/* The first tile of item (i, g), asked for while the item before it is computed */
static void prefetch_item(const att_job *j, int i, int g)
{
    const kr_seq *s;
    int visible;
    const kr_kv_list *l = item_list(j, i, g, &s, &visible);
    int start = j->window > 0 ? kr_kv_list_first_after(s->pool, l, visible, j->pos[i] - j->window) : 0;
    prefetch_rows(s->pool, l, start, visible - start < TILE ? visible - start : TILE);
}

/* Queries i0 .. i1-1 of the chunk, KV head g, all query heads of its group. */
static void attend_block(const att_job *j, float *scratch, int g, int i0, int i1)
{
    const kr_kv_pool *p = j->s->pool;
    const kr_kv_list *l = &j->s->lists[j->layer * j->s->n_kv_heads + g];
    const int d = p->head_dim, nq = i1 - i0;
    const int group = j->n_heads / j->s->n_kv_heads, qstride = j->n_heads * d;
    const float scale = 1.0f / sqrtf((float)d);
    float *kt = scratch; /* [TILE][d] gathered keys */
    float *vt = kt + (size_t)TILE * d; /* [TILE][d] gathered values */
    float *sc = vt + (size_t)TILE * d; /* [group][QBLOCK][TILE] scores, then probabilities */
    float *acc = sc + (size_t)group * QBLOCK * TILE; /* [group][QBLOCK][d] */
    float *m = acc + (size_t)group * QBLOCK * d; /* [group][QBLOCK] */
    float *sum = m + group * QBLOCK; /* [group][QBLOCK] */
    int lo[QBLOCK], hi[QBLOCK]; /* visible entries [lo, hi) of each query */

    for (int r = 0; r < nq; r++) {
        int i = i0 + r;
        hi[r] = l->len - j->n + i + 1;
        lo[r] = j->window > 0 ? kr_kv_list_first_after(p, l, hi[r], j->pos[i] - j->window) : 0;
    }
    for (int x = 0; x < group * QBLOCK; x++) m[x] = -INFINITY, sum[x] = 0.0f;
    for (size_t x = 0; x < (size_t)group * QBLOCK * d; x++) acc[x] = 0.0f;

    for (int j0 = lo[0]; j0 < hi[nq - 1]; j0 += TILE) {
        int jn = hi[nq - 1] - j0 < TILE ? hi[nq - 1] - j0 : TILE;
        const void *krow[TILE], *vrow[TILE];
        kr_kv_list_rows(p, l, j0, jn, krow, vrow);
        for (int e = 0; e < jn; e++) {
            kr_cpu_to_f32(p->dtype, krow[e], (size_t)d, kt + (size_t)e * d);
            kr_cpu_to_f32(p->dtype, vrow[e], (size_t)d, vt + (size_t)e * d);
        }
        for (int h = 0; h < group; h++) {
            float *s = sc + (size_t)h * QBLOCK * TILE;
            float *o = acc + (size_t)h * QBLOCK * d;
            const float *q = j->q + (size_t)i0 * qstride + (size_t)(g * group + h) * d;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, jn, d, scale, q, qstride, kt, d,
                        0.0f, s, TILE);
            for (int r = 0; r < nq; r++) {
                float *row = s + (size_t)r * TILE;
                int a = lo[r] - j0 > 0 ? lo[r] - j0 : 0, b = hi[r] - j0 < jn ? hi[r] - j0 : jn;
                int x = h * QBLOCK + r;
                if (a >= b) { /* nothing of this tile is visible to this query */
                    memset(row, 0, sizeof(float) * (size_t)jn);
                    continue;
                }
                float mt = m[x];
                for (int c = a; c < b; c++) mt = row[c] > mt ? row[c] : mt;
                float corr = expf(m[x] - mt);
                sum[x] = sum[x] * corr + kr_exp_shift_sum(row + a, b - a, mt);
                m[x] = mt;
                kr_scale(o + (size_t)r * d, corr, d);
                memset(row, 0, sizeof(float) * (size_t)a);
                memset(row + b, 0, sizeof(float) * (size_t)(jn - b));
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, jn, 1.0f, s, TILE, vt, d,
                        1.0f, o, d);
        }
    }
    for (int h = 0; h < group; h++)
        for (int r = 0; r < nq; r++) {
            float inv = 1.0f / sum[h * QBLOCK + r];
            const float *o = acc + ((size_t)h * QBLOCK + r) * d;
            float *dst = j->out + (size_t)(i0 + r) * qstride + (size_t)(g * group + h) * d;
            for (int e = 0; e < d; e++) dst[e] = o[e] * inv;
        }
}

static void att_task(void *arg, int ith, int nth)
{
    att_job *j = arg;
    int kvh = j->seqs ? j->seqs[0]->n_kv_heads : j->s->n_kv_heads;
    if (j->seqs || j->n < BLOCKED_MIN_TOKENS) {
        /* items cost as many entries as they see, which differ across a batch: each thread
         * claims the next item when it is free, and the one after that before it starts, so the
         * first tile of that one is fetched meanwhile */
        const int items = j->n * kvh;
        int it = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        while (it < items) {
            int after = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
            if (after < items) prefetch_item(j, after / kvh, after % kvh);
            attend_item(j, j->b->att[ith], it / kvh, it % kvh);
            it = after;
        }
        return;
    }
    /* later query blocks see more keys: interleave items so threads get similar work */
    int blocks = (j->n + QBLOCK - 1) / QBLOCK;
    for (int64_t it = ith; it < (int64_t)blocks * kvh; it += nth) {
        int qb = (int)(it / kvh), g = (int)(it % kvh);
        int i0 = qb * QBLOCK, i1 = i0 + QBLOCK < j->n ? i0 + QBLOCK : j->n;
        attend_block(j, j->b->att[ith], g, i0, i1);
    }
}

void kr_cpu_attention(kr_backend *b, const kr_seq *s, int layer, const float *q, int n,
                      int n_heads, const int32_t *pos, int window, float *out)
{
    att_job j = {.b = b, .s = s, .layer = layer, .q = q, .n = n, .n_heads = n_heads, .pos = pos,
                 .window = window, .out = out};
    kr_threadpool_run(b->tp, att_task, &j);
}

void kr_cpu_attention_batch(kr_backend *b, const kr_seq *const *seqs, int layer, const float *q, int n,
                            int n_heads, const int32_t *pos, int window, float *out)
{
    att_job j = {.b = b, .seqs = seqs, .layer = layer, .q = q, .n = n, .n_heads = n_heads, .pos = pos,
                 .window = window, .out = out};
    kr_threadpool_run(b->tp, att_task, &j);
}
