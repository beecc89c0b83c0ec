/*
 * attention.c - causal GQA attention over the paged KV cache on the CPU backend.
 * Two paths, both with an online softmax (running max and sum) over tiles of entries, so no
 * score matrix of the whole context exists:
 * - few tokens (decode), and decode batches (token i of sequence i): work items are (token, KV
 *   head) pairs; each attends the query heads of one GQA group over that head's block list with
 *   vector dot products;
 * - many tokens (prefill): work items are (KV head, block of 64 queries); each tile of 128 keys
 *   and values is gathered once from its blocks and used by every query head of the group
 *   through two sgemm calls (scores = Q K^T, output += P V), flash-attention style.
 * Token i of a chunk of n sees the first len - n + i + 1 entries of its list: the chunk's own
 * entries are the newest, appended before this call. A sliding window drops the oldest of those
 * (positions <= pos - window).
 * A bf16 or f16 cache is widened as it is read (in registers on the decode path, while gathering
 * a tile on the prefill path); the arithmetic is the f32 path's on the rounded entries.
 */
#include "cpu.h"
#include "simd.h"

#include <cblas.h>
#include <math.h>
#include <string.h>

enum {
    TILE = 128, /* entries per softmax tile (both paths) */
    QBLOCK = 64, /* queries per work item on the prefill path */
    BLOCKED_MIN_TOKENS = 16, /* chunks at least this long take the prefill path */
};

size_t kr_cpu_attention_scratch(const kr_config *cfg)
{
    size_t g = (size_t)(cfg->n_heads / cfg->n_kv_heads), d = (size_t)cfg->head_dim;
    size_t one = g * TILE + g * d + 2 * g;
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
} att_job;

/* Asks for the key and value rows of entries [j0, j0 + n) of list l, a block's run of rows at a
 * time. A list's blocks lie wherever the pool had free ones (in a decode node's large, long-used
 * pool, far apart), so the hardware prefetcher, which follows address streams, meets each 2-4 KB
 * block cold; fetched one tile ahead, they arrive while the tile before is computed. */
static void prefetch_rows(const kr_kv_pool *p, const kr_kv_list *l, int j0, int n)
{
    int i = l->off + j0, b = i / p->block_size, slot = i % p->block_size;
    while (n > 0) {
        int run = p->block_size - slot < n ? p->block_size - slot : n;
        const char *k = kr_kv_key(p, l->blocks[b], slot), *v = kr_kv_value(p, l->blocks[b], slot);
        for (size_t off = 0; off < (size_t)run * p->row_bytes; off += 64) {
            __builtin_prefetch(k + off, 0, 3);
            __builtin_prefetch(v + off, 0, 3);
        }
        n -= run, b++, slot = 0;
    }
}

/* One token's query heads of one GQA group (q, out: [group][d]) over the first `visible`
 * entries of list l, less those at positions <= pos - window when window > 0. Both the chunk
 * path (token i of n sees len - n + i + 1) and the batch path (every token sees its whole list)
 * come here, so a batched row is the one-token call's row bit for bit. */
static void attend_one(const kr_kv_pool *p, const kr_kv_list *l, int visible, int32_t pos, int window,
                       const float *q, int group, float *scratch, float *o)
{
    const int d = p->head_dim;
    const float scale = 1.0f / sqrtf((float)d);
    float *sc = scratch; /* [group][TILE] */
    float *acc = sc + (size_t)group * TILE; /* [group][d] */
    float *m = acc + (size_t)group * d; /* [group] running max */
    float *sum = m + group; /* [group] running sum */
    int start = window > 0 ? kr_kv_list_first_after(p, l, visible, pos - window) : 0;

    for (int h = 0; h < group; h++) {
        m[h] = -INFINITY;
        sum[h] = 0.0f;
        for (int e = 0; e < d; e++) acc[(size_t)h * d + e] = 0.0f;
    }
    const kr_dtype t = p->dtype;
    const void *krow[TILE], *vrow[TILE];
    for (int j0 = start; j0 < visible; j0 += TILE) {
        int jn = visible - j0 < TILE ? visible - j0 : TILE;
        kr_kv_list_rows(p, l, j0, jn, krow, vrow);
        if (j0 + jn < visible)
            prefetch_rows(p, l, j0 + jn, visible - j0 - jn < TILE ? visible - j0 - jn : TILE);
        for (int jj = 0; jj < jn; jj++)
            for (int h = 0; h < group; h++)
                sc[(size_t)h * TILE + jj] = kr_dot_row(q + (size_t)h * d, krow[jj], t, d) * scale;
        for (int h = 0; h < group; h++) {
            float *s = sc + (size_t)h * TILE;
            float mt = m[h];
            for (int jj = 0; jj < jn; jj++) mt = s[jj] > mt ? s[jj] : mt;
            float corr = expf(m[h] - mt); /* exp(-inf) = 0 on the first tile */
            sum[h] = sum[h] * corr + kr_exp_shift_sum(s, jn, mt);
            kr_scale(acc + (size_t)h * d, corr, d);
            m[h] = mt;
        }
        for (int jj = 0; jj < jn; jj++) /* each value row once for the whole group */
            for (int h = 0; h < group; h++)
                kr_axpy_row(acc + (size_t)h * d, sc[(size_t)h * TILE + jj], vrow[jj], t, d);
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
    const att_job *j = arg;
    int kvh = j->seqs ? j->seqs[0]->n_kv_heads : j->s->n_kv_heads;
    int64_t lo, hi;
    if (j->seqs || j->n < BLOCKED_MIN_TOKENS) {
        kr_split((int64_t)j->n * kvh, ith, nth, 1, &lo, &hi);
        for (int64_t it = lo; it < hi; it++) {
            if (it + 1 < hi) prefetch_item(j, (int)((it + 1) / kvh), (int)((it + 1) % kvh));
            attend_item(j, j->b->att[ith], (int)(it / kvh), (int)(it % kvh));
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
