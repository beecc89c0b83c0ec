/*
 * backend.c - the CPU backend's op table and its small element-wise ops (embedding, RMSNorm,
 * RoPE, SiLU gating, KV store: rows rounded to the pool's dtype, f32, bf16 or f16). The heavy
 * ops live in matmul.c and attention.c.
 * Everything is float32 from exactly upcast weights: this backend is the oracle others are
 * tested against, so it favours the straightforward computation HF transformers does.
 */
#include "cpu.h"
#include "kr-util.h"
#include "simd.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { SLAB_BYTES = 2 << 20 };

static void cpu_destroy(kr_backend *b)
{
    if (!b) return;
    int n = b->tp ? kr_threadpool_size(b->tp) : 0;
    for (int i = 0; i < n; i++) {
        if (b->slab) free(b->slab[i]);
        if (b->att) free(b->att[i]);
    }
    free(b->slab);
    free(b->att);
    free(b->xperm);
    free(b->xbf16);
    kr_threadpool_free(b->tp);
    free(b);
}

static int cpu_create(const kr_model *m, int n_threads, int max_chunk, kr_backend **out, char *err)
{
    kr_backend *b = calloc(1, sizeof *b);
    if (!b) return kr_errf(err, "CPU backend: out of memory");
    b->model = m;
    b->max_chunk = max_chunk;
    /* each worker calls sgemm on its own rows: OpenBLAS must not start threads of its own */
    openblas_set_num_threads(1);
    if (kr_threadpool_create(n_threads, &b->tp, err) != KR_OK) {
        free(b);
        return -1;
    }
    const kr_config *cfg = &m->cfg;
    int widest = cfg->hidden_size > cfg->intermediate_size ? cfg->hidden_size : cfg->intermediate_size;
    if (cfg->n_heads * cfg->head_dim > widest) widest = cfg->n_heads * cfg->head_dim;
    b->slab_floats = SLAB_BYTES / sizeof(float);
    if (b->slab_floats < (size_t)widest * 16) b->slab_floats = (size_t)widest * 16;
    b->att_floats = kr_cpu_attention_scratch(cfg);
    b->slab = calloc((size_t)n_threads, sizeof *b->slab);
    b->att = calloc((size_t)n_threads, sizeof *b->att);
    size_t xrows = (size_t)(max_chunk > GEMM_MIN_TOKENS ? max_chunk : GEMM_MIN_TOKENS);
    /* rows padded to 64 bytes (matmul.c's dot_ldx): the decode kernels' loads never split a line */
    b->xperm = aligned_alloc(64, (sizeof(float) * xrows * ((size_t)widest + 16) + 63) & ~(size_t)63);
    b->xbf16_rows = (int)xrows;
    b->xbf16 = aligned_alloc(64, (sizeof(uint16_t) * xrows * ((size_t)widest + 32) + 63) & ~(size_t)63);
    if (!b->slab || !b->att || !b->xperm || !b->xbf16) goto err_oom;
    for (int i = 0; i < n_threads; i++) {
        b->slab[i] = malloc(b->slab_floats * sizeof(float));
        b->att[i] = malloc(b->att_floats * sizeof(float));
        if (!b->slab[i] || !b->att[i]) goto err_oom;
    }
    *out = b;
    return KR_OK;
err_oom:
    cpu_destroy(b);
    return kr_errf(err, "CPU backend: out of memory for scratch buffers");
}

static int cpu_n_threads(const kr_backend *b)
{
    return kr_threadpool_size(b->tp);
}

static float *cpu_act_alloc(kr_backend *b, size_t n_floats)
{
    return malloc(n_floats * sizeof(float));
}

static void cpu_act_free(kr_backend *b, float *p)
{
    free(p);
}

static void cpu_to_host(kr_backend *b, const float *src, size_t n_floats, float *dst)
{
    memcpy(dst, src, n_floats * sizeof(float));
}

static void cpu_embed(kr_backend *b, const kr_tensor *emb, const int32_t *tokens, int n, float *x)
{
    const int64_t d = emb->cols;
    const size_t esz = kr_dtype_size(emb->dtype);
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)emb->data + (size_t)tokens[i] * (size_t)d * esz;
        kr_cpu_to_f32(emb->dtype, row, (size_t)d, x + (int64_t)i * d);
    }
}

typedef struct norm_job {
    const float *x;
    const float *w;
    int n, d;
    float eps;
    float *y;
} norm_job;

static void norm_task(void *arg, int ith, int nth)
{
    const norm_job *j = arg;
    int64_t lo, hi;
    kr_split(j->n, ith, nth, 1, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        const float *x = j->x + t * j->d;
        float *y = j->y + t * j->d;
        double ss = 0.0;
        for (int e = 0; e < j->d; e++) ss += (double)x[e] * x[e];
        float inv = 1.0f / sqrtf((float)(ss / j->d) + j->eps);
        for (int e = 0; e < j->d; e++) y[e] = j->w[e] * (x[e] * inv);
    }
}

static void cpu_rmsnorm(kr_backend *b, const float *x, const kr_tensor *w, int n, int d, float eps,
                        float *y)
{
    norm_job j = {.x = x, .w = w->data, .n = n, .d = d, .eps = eps, .y = y};
    kr_threadpool_run(b->tp, norm_task, &j);
}

typedef struct glu_job {
    float *g;
    const float *u;
    size_t count;
} glu_job;

static void glu_task(void *arg, int ith, int nth)
{
    const glu_job *j = arg;
    int64_t lo, hi;
    kr_split((int64_t)j->count, ith, nth, 16, &lo, &hi);
    int64_t i = lo;
    /* sigmoid(g) from t = exp(-|g|), which never overflows: 1 / (1 + t) for g >= 0, t / (1 + t)
     * below; the vector exp is within a few ulp of expf (a libm call per element was 8% of a
     * prefill) */
    const kr_vf one = vf_set1(1.0f);
    for (; i + KR_VL <= hi; i += KR_VL) {
        kr_vf g = vf_load(j->g + i), t = kr_vexp_nonpos(vf_neg_abs(g));
        kr_vf sig = vf_div(vf_select_nonneg(g, one, t), vf_add(one, t));
        vf_store(j->g + i, vf_mul(vf_mul(g, sig), vf_load(j->u + i)));
    }
    for (; i < hi; i++) {
        float g = j->g[i];
        j->g[i] = g / (1.0f + expf(-g)) * j->u[i];
    }
}

static void cpu_swiglu(kr_backend *b, float *g, const float *u, size_t count)
{
    glu_job j = {.g = g, .u = u, .count = count};
    kr_threadpool_run(b->tp, glu_task, &j);
}

static void cpu_rope(kr_backend *b, float *x, int n, int n_heads, int head_dim, const float *cos_sin)
{
    const int half = head_dim / 2;
    for (int t = 0; t < n; t++) {
        const float *cs = cos_sin + (size_t)t * half * 2;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)t * n_heads + h) * head_dim;
            for (int i = 0; i < half; i++) {
                float c = cs[2 * i], s = cs[2 * i + 1], x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c - x2 * s;
                v[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

static void cpu_kv_store(kr_backend *b, kr_seq *s, int layer, const float *k, const float *v, int n,
                         const int32_t *pos)
{
    const int kvh = s->n_kv_heads, d = s->pool->head_dim;
    for (int g = 0; g < kvh; g++) {
        int base = kr_seq_list(s, layer, g)->len - n;
        for (int t = 0; t < n; t++) {
            size_t off = ((size_t)t * kvh + g) * d;
            kr_seq_put(s, layer, g, base + t, k + off, v + off, pos[t]);
        }
    }
}

const kr_backend_ops KR_CPU_SYM(kr_cpu_backend) = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .n_threads = cpu_n_threads,
    .act_alloc = cpu_act_alloc,
    .act_free = cpu_act_free,
    .to_host = cpu_to_host,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = kr_cpu_matmul,
    .matmul_rows = kr_cpu_matmul_rows,
    .swiglu = cpu_swiglu,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = kr_cpu_attention,
    .attention_batch = kr_cpu_attention_batch,
    .score = kr_cpu_score,
    .score_past = kr_cpu_score_past,
    .kv_dtypes = 1u << KR_DTYPE_F32 | 1u << KR_DTYPE_BF16 | 1u << KR_DTYPE_F16,
    .bf16_x_min_tokens = KR_CPU_LEVEL >= 3 ? 1 : 0,
};
