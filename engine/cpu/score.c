/*
 * score.c (CPU) - the attention half of the scoring primitive: observers' softmax attention over
 * each (layer, KV head) list, summed over observers, averaged per GQA group or kept per query
 * head; `score_past` is the same with every observer seeing the same prefix of its list (an
 * observer placed after the entries it scores). Softmax sums in double: selections should not
 * flip on rounding.
 * Work items are KV heads, split over the thread pool.
 */
#include "cpu.h"
#include "simd.h"

#include <math.h>
#include <string.h>

enum { TILE = 128 }; /* entries whose row pointers are looked up at once */

typedef struct score_job {
    kr_backend *b;
    const kr_seq *s;
    int layer;
    const float *q;
    int n_obs, n_heads, per_head;
    int hidden; /* < 0: causal (observer i sees len - n_obs + i + 1); else all see len - hidden */
    float *scores;
    size_t stride;
} score_job;

/* Two passes per observer (running max and sum, then the probabilities), so no buffer the
 * size of the context is needed. */
static void score_head(const score_job *j, int g)
{
    const kr_kv_pool *p = j->s->pool;
    const kr_kv_list *l = &j->s->lists[j->layer * j->s->n_kv_heads + g];
    const int d = p->head_dim, group = j->n_heads / j->s->n_kv_heads;
    const float scale = 1.0f / sqrtf((float)d);
    if (!j->per_head) memset(j->scores + (size_t)g * j->stride, 0, sizeof(float) * (size_t)l->len);
    for (int h = 0; h < group; h++) {
        float *out = j->per_head ? j->scores + (size_t)(g * group + h) * j->stride
                                 : j->scores + (size_t)g * j->stride;
        const double w = j->per_head ? 1.0 : 1.0 / group;
        if (j->per_head) memset(out, 0, sizeof(float) * (size_t)l->len);
        for (int i = 0; i < j->n_obs; i++) {
            const float *q = j->q + ((size_t)i * j->n_heads + (size_t)g * group + h) * d;
            int vis = j->hidden < 0 ? l->len - j->n_obs + i + 1 : l->len - j->hidden;
            double mx = -INFINITY, z = 0.0;
            const void *krow[TILE];
            for (int e0 = 0; e0 < vis; e0 += TILE) {
                int n = vis - e0 < TILE ? vis - e0 : TILE;
                kr_kv_list_rows(p, l, e0, n, krow, NULL);
                for (int jj = 0; jj < n; jj++) {
                    double x = kr_dot_row(q, krow[jj], p->dtype, d) * scale;
                    if (x > mx) {
                        z = z * exp(mx - x) + 1.0;
                        mx = x;
                    } else {
                        z += exp(x - mx);
                    }
                }
            }
            for (int e0 = 0; e0 < vis; e0 += TILE) {
                int n = vis - e0 < TILE ? vis - e0 : TILE;
                kr_kv_list_rows(p, l, e0, n, krow, NULL);
                for (int jj = 0; jj < n; jj++) {
                    double x = kr_dot_row(q, krow[jj], p->dtype, d) * scale;
                    out[e0 + jj] += (float)(w * exp(x - mx) / z);
                }
            }
        }
    }
}

static void score_task(void *arg, int ith, int nth)
{
    const score_job *j = arg;
    int64_t lo, hi;
    kr_split(j->s->n_kv_heads, ith, nth, 1, &lo, &hi);
    for (int64_t g = lo; g < hi; g++) score_head(j, (int)g);
}

void kr_cpu_score(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                  int n_heads, int per_head, float *scores, size_t stride)
{
    score_job j = {.b = b, .s = s, .layer = layer, .q = q_obs, .n_obs = n_obs, .n_heads = n_heads,
                   .per_head = per_head, .hidden = -1, .scores = scores, .stride = stride};
    kr_threadpool_run(b->tp, score_task, &j);
}

void kr_cpu_score_past(kr_backend *b, const kr_seq *s, int layer, const float *q_obs, int n_obs,
                       int n_heads, int per_head, int n_hidden, float *scores, size_t stride)
{
    score_job j = {.b = b, .s = s, .layer = layer, .q = q_obs, .n_obs = n_obs, .n_heads = n_heads,
                   .per_head = per_head, .hidden = n_hidden, .scores = scores, .stride = stride};
    kr_threadpool_run(b->tp, score_task, &j);
}
