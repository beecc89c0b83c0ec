/*
 * attention.c - causal GQA attention over the paged KV cache on the CPU backend.
 * Work items are (token, KV head) pairs split over the thread pool; each item attends the
 * query heads of one GQA group over that head's block list, one tile of entries at a time with
 * an online softmax (running max and sum), so no score matrix of the whole context exists.
 * Token i of a chunk of n sees the first len - n + i + 1 entries of its list: the chunk's own
 * entries are the newest, appended before this call. A sliding window drops the oldest of those
 * (positions <= pos - window).
 */
#include "cpu.h"
#include "simd.h"

#include <math.h>

enum { TILE = 128 };

size_t kr_cpu_attention_scratch(const kr_config *cfg)
{
    size_t g = (size_t)(cfg->n_heads / cfg->n_kv_heads);
    return g * TILE + g * (size_t)cfg->head_dim + 2 * g;
}

typedef struct att_job {
    kr_backend *b;
    const kr_seq *s;
    int layer;
    const float *q;
    int n;
    int n_heads;
    const int32_t *pos;
    int window;
    float *out;
} att_job;

static void attend_one(const att_job *j, float *scratch, int i, int g)
{
    const kr_kv_pool *p = j->s->pool;
    const kr_kv_list *l = &j->s->lists[j->layer * j->s->n_kv_heads + g];
    const int d = p->head_dim, bs = p->block_size;
    const int group = j->n_heads / j->s->n_kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    float *sc = scratch; /* [group][TILE] */
    float *acc = sc + (size_t)group * TILE; /* [group][d] */
    float *m = acc + (size_t)group * d; /* [group] running max */
    float *sum = m + group; /* [group] running sum */
    const float *q = j->q + ((size_t)i * j->n_heads + (size_t)g * group) * d;
    int visible = l->len - j->n + i + 1;
    int start = j->window > 0 ? kr_kv_list_first_after(p, l, visible, j->pos[i] - j->window) : 0;

    for (int h = 0; h < group; h++) {
        m[h] = -INFINITY;
        sum[h] = 0.0f;
        for (int e = 0; e < d; e++) acc[(size_t)h * d + e] = 0.0f;
    }
    for (int j0 = start; j0 < visible; j0 += TILE) {
        int jn = visible - j0 < TILE ? visible - j0 : TILE;
        for (int jj = 0; jj < jn; jj++) {
            int e = j0 + jj;
            const float *k = kr_kv_key(p, l->blocks[e / bs], e % bs);
            for (int h = 0; h < group; h++)
                sc[(size_t)h * TILE + jj] = kr_dot_f32(q + (size_t)h * d, k, d) * scale;
        }
        for (int h = 0; h < group; h++) {
            float *s = sc + (size_t)h * TILE;
            float mt = m[h];
            for (int jj = 0; jj < jn; jj++) mt = s[jj] > mt ? s[jj] : mt;
            float corr = expf(m[h] - mt); /* exp(-inf) = 0 on the first tile */
            sum[h] = sum[h] * corr + kr_exp_shift_sum(s, jn, mt);
            kr_scale(acc + (size_t)h * d, corr, d);
            m[h] = mt;
            for (int jj = 0; jj < jn; jj++) {
                int e = j0 + jj;
                kr_axpy(acc + (size_t)h * d, s[jj], kr_kv_value(p, l->blocks[e / bs], e % bs), d);
            }
        }
    }
    float *o = j->out + ((size_t)i * j->n_heads + (size_t)g * group) * d;
    for (int h = 0; h < group; h++) {
        float inv = 1.0f / sum[h];
        for (int e = 0; e < d; e++) o[(size_t)h * d + e] = acc[(size_t)h * d + e] * inv;
    }
}

static void att_task(void *arg, int ith, int nth)
{
    const att_job *j = arg;
    int kvh = j->s->n_kv_heads;
    int64_t lo, hi;
    kr_split((int64_t)j->n * kvh, ith, nth, 1, &lo, &hi);
    for (int64_t it = lo; it < hi; it++) attend_one(j, j->b->att[ith], (int)(it / kvh), (int)(it % kvh));
}

void kr_cpu_attention(kr_backend *b, const kr_seq *s, int layer, const float *q, int n,
                      int n_heads, const int32_t *pos, int window, float *out)
{
    att_job j = {.b = b, .s = s, .layer = layer, .q = q, .n = n, .n_heads = n_heads, .pos = pos,
                 .window = window, .out = out};
    kr_threadpool_run(b->tp, att_task, &j);
}
