/*
 * backend.cu - the CUDA backend's op table and its lifetime: device selection, the one-time
 * upload of every model tensor (matrices as bf16, norm weights and biases as f32), the stream
 * and cuBLAS handle, scratch sized once for max_chunk rows, activation memory (device), KV pool
 * memory (managed), and the error checks every op file uses. The ops live one per file
 * (elementwise.cu, matmul.cu, attention.cu, score.cu); docs/cuda.md gives the design.
 */
#include "cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kr_cuda_check(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess) return;
    fprintf(stderr, "%s:%d: CUDA error in %s: %s\n", file, line, what, cudaGetErrorString(e));
    abort();
}

void kr_cublas_check(cublasStatus_t s, const char *what, const char *file, int line)
{
    if (s == CUBLAS_STATUS_SUCCESS) return;
    fprintf(stderr, "%s:%d: cuBLAS error in %s: %s\n", file, line, what, cublasGetStatusString(s));
    abort();
}

static int cmp_weight(const void *a, const void *b)
{
    const char *x = (const char *)((const kr_cuda_weight *)a)->host;
    const char *y = (const char *)((const kr_cuda_weight *)b)->host;
    return x < y ? -1 : x > y;
}

const kr_cuda_weight *kr_cuda_weight_of(const kr_backend *b, const kr_tensor *t)
{
    kr_cuda_weight key;
    key.host = t->data;
    const kr_cuda_weight *w = (const kr_cuda_weight *)bsearch(&key, b->weights, (size_t)b->n_weights,
                                                              sizeof key, cmp_weight);
    if (!w) {
        fprintf(stderr, "CUDA backend: tensor %p (%lld x %lld) was not uploaded\n", t->data,
                (long long)t->rows, (long long)t->cols);
        abort();
    }
    return w;
}

/* Slices start on 64-byte boundaries (16 int32). */
enum { TABLE_ALIGN = 16 };

int kr_cuda_tables_reserve(kr_backend *b, size_t n)
{
    size_t at = (b->tables_used + TABLE_ALIGN - 1) / TABLE_ALIGN * TABLE_ALIGN;
    if (at + n > b->dev_tables_cap) {
        /* the copies that read the earlier slices must be done before the host rewrites them */
        KR_CUDA_CHECK(cudaStreamSynchronize(b->stream));
        at = 0;
    }
    if (n > b->dev_tables_cap) {
        size_t cap = b->dev_tables_cap * 2 > n ? b->dev_tables_cap * 2 : n;
        int32_t *dev = NULL, *host = NULL;
        if (cudaMalloc((void **)&dev, cap * sizeof(int32_t)) != cudaSuccess) {
            (void)cudaGetLastError();
            return -1;
        }
        if (cudaMallocHost((void **)&host, cap * sizeof(int32_t)) != cudaSuccess) {
            (void)cudaGetLastError();
            cudaFree(dev);
            return -1;
        }
        cudaFree(b->dev_tables);
        cudaFreeHost(b->host_tables);
        b->dev_tables = dev;
        b->host_tables = host;
        b->dev_tables_cap = cap;
    }
    b->host_slice = b->host_tables + at;
    b->dev_slice = b->dev_tables + at;
    b->tables_used = at + n;
    return KR_OK;
}

/* ---------------------------------------------------------------- weight upload */

static const size_t CONVERT_ELEMS = (size_t)1 << 22; /* host conversion chunk: 4 Mi elements */

/* Host staging for conversions, allocated once per create. */
typedef struct upload_buf {
    uint16_t *bf16;
    float *f32;
} upload_buf;

static int upload_matrix(const kr_tensor *t, upload_buf *ub, kr_cuda_weight *w, char *err)
{
    size_t count = (size_t)t->rows * (size_t)t->cols;
    cudaError_t e = cudaMalloc((void **)&w->dev_bf16, count * sizeof(__nv_bfloat16));
    if (e != cudaSuccess)
        return kr_errf(err, "CUDA backend: cannot allocate %.1f MiB for a %lld x %lld weight: %s",
                       (double)count * 2 / (1024.0 * 1024.0), (long long)t->rows, (long long)t->cols,
                       cudaGetErrorString(e));
    if (t->dtype == KR_DTYPE_BF16) {
        e = cudaMemcpy(w->dev_bf16, t->data, count * 2, cudaMemcpyHostToDevice);
    } else {
        for (size_t at = 0; at < count && e == cudaSuccess; at += CONVERT_ELEMS) {
            size_t m = count - at < CONVERT_ELEMS ? count - at : CONVERT_ELEMS;
            if (t->dtype == KR_DTYPE_F32) {
                const float *src = (const float *)t->data + at;
                for (size_t i = 0; i < m; i++) ub->bf16[i] = kr_f32_to_bf16(src[i]);
            } else {
                const uint16_t *src = (const uint16_t *)t->data + at;
                for (size_t i = 0; i < m; i++) ub->bf16[i] = kr_f32_to_bf16(kr_f16_to_f32(src[i]));
            }
            e = cudaMemcpy(w->dev_bf16 + at, ub->bf16, m * 2, cudaMemcpyHostToDevice);
        }
    }
    if (e != cudaSuccess) return kr_errf(err, "CUDA backend: weight upload: %s", cudaGetErrorString(e));
    return KR_OK;
}

static int upload_vector(const kr_tensor *t, upload_buf *ub, kr_cuda_weight *w, char *err)
{
    size_t count = (size_t)t->rows * (size_t)t->cols;
    cudaError_t e = cudaMalloc((void **)&w->dev_f32, count * sizeof(float));
    if (e != cudaSuccess)
        return kr_errf(err, "CUDA backend: cannot allocate a %zu-float vector: %s", count,
                       cudaGetErrorString(e));
    for (size_t at = 0; at < count && e == cudaSuccess; at += CONVERT_ELEMS) {
        size_t m = count - at < CONVERT_ELEMS ? count - at : CONVERT_ELEMS;
        for (size_t i = 0; i < m; i++) {
            const char *row = (const char *)t->data;
            switch (t->dtype) {
            case KR_DTYPE_F32: ub->f32[i] = ((const float *)row)[at + i]; break;
            case KR_DTYPE_F16: ub->f32[i] = kr_f16_to_f32(((const uint16_t *)row)[at + i]); break;
            case KR_DTYPE_BF16: ub->f32[i] = kr_bf16_to_f32(((const uint16_t *)row)[at + i]); break;
            }
        }
        e = cudaMemcpy(w->dev_f32 + at, ub->f32, m * sizeof(float), cudaMemcpyHostToDevice);
    }
    if (e != cudaSuccess) return kr_errf(err, "CUDA backend: weight upload: %s", cudaGetErrorString(e));
    return KR_OK;
}

/* Adds t to the table unless absent (bias of a model without biases) or already there (a tied
 * lm_head is the embedding itself). */
static int add_weight(kr_backend *b, const kr_tensor *t, int matrix, upload_buf *ub, char *err)
{
    if (!t->data) return KR_OK;
    for (int i = 0; i < b->n_weights; i++)
        if (b->weights[i].host == t->data) return KR_OK;
    kr_cuda_weight *w = &b->weights[b->n_weights];
    memset(w, 0, sizeof *w);
    w->host = t->data;
    w->rows = t->rows;
    w->cols = t->cols;
    b->n_weights++; /* counted before the upload so that destroy frees a partial one */
    return matrix ? upload_matrix(t, ub, w, err) : upload_vector(t, ub, w, err);
}

static int upload_model(kr_backend *b, const kr_model *m, char *err)
{
    const int per_layer = 12;
    b->weights = (kr_cuda_weight *)calloc((size_t)m->cfg.n_layers * per_layer + 3, sizeof(kr_cuda_weight));
    upload_buf ub;
    ub.bf16 = (uint16_t *)malloc(CONVERT_ELEMS * sizeof(uint16_t));
    ub.f32 = (float *)malloc(CONVERT_ELEMS * sizeof(float));
    int rc = KR_OK;
    if (!b->weights || !ub.bf16 || !ub.f32) {
        rc = kr_errf(err, "CUDA backend: out of host memory for the weight upload");
        goto out;
    }
    if (add_weight(b, &m->embed, 1, &ub, err) || add_weight(b, &m->lm_head, 1, &ub, err) ||
        add_weight(b, &m->final_norm, 0, &ub, err)) {
        rc = -1;
        goto out;
    }
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const kr_layer_weights *w = &m->layers[l];
        const kr_tensor *mats[] = {&w->wq, &w->wk, &w->wv, &w->wo, &w->w_gate, &w->w_up, &w->w_down};
        const kr_tensor *vecs[] = {&w->attn_norm, &w->ffn_norm, &w->bq, &w->bk, &w->bv};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0] && rc == KR_OK; i++)
            rc = add_weight(b, mats[i], 1, &ub, err);
        for (size_t i = 0; i < sizeof vecs / sizeof vecs[0] && rc == KR_OK; i++)
            rc = add_weight(b, vecs[i], 0, &ub, err);
        if (rc != KR_OK) goto out;
    }
    qsort(b->weights, (size_t)b->n_weights, sizeof *b->weights, cmp_weight);
out:
    free(ub.bf16);
    free(ub.f32);
    return rc;
}

/* ---------------------------------------------------------------- lifetime */

static void cuda_destroy(kr_backend *b)
{
    if (!b) return;
    if (b->stream) cudaStreamSynchronize(b->stream);
    for (int i = 0; i < b->n_weights; i++) {
        cudaFree(b->weights[i].dev_bf16);
        cudaFree(b->weights[i].dev_f32);
    }
    free(b->weights);
    cudaFree(b->xb);
    cudaFree(b->dev_tables);
    cudaFreeHost(b->host_tables);
    cudaFree(b->dev_scratch);
    cudaFreeHost(b->host_scores);
    if (b->cublas) cublasDestroy(b->cublas);
    if (b->stream) cudaStreamDestroy(b->stream);
    free(b);
}

/* Scratch for attention partials and scores: per row and query head, up to ATT_SPLITS partial
 * results of head_dim + 2 floats (output, max, sum) for decode attention split along the
 * sequence. attention.cu and score.cu check their needs against dev_scratch_floats. */
enum { ATT_SPLITS = 64 };

static int cuda_create(const kr_model *m, int n_threads, int max_chunk, kr_backend **out, char *err)
{
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e == cudaSuccess && n_dev < 1) e = cudaErrorNoDevice;
    if (e == cudaSuccess) e = cudaSetDevice(0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return kr_errf(err, "CUDA backend: no usable GPU: %s", cudaGetErrorString(e));
    }
    kr_backend *b = (kr_backend *)calloc(1, sizeof *b);
    if (!b) return kr_errf(err, "CUDA backend: out of memory");
    b->model = m;
    b->device = 0;
    b->max_chunk = max_chunk;
    const kr_config *cfg = &m->cfg;
    int widest = cfg->hidden_size > cfg->intermediate_size ? cfg->hidden_size : cfg->intermediate_size;
    if (cfg->n_heads * cfg->head_dim > widest) widest = cfg->n_heads * cfg->head_dim;
    b->xb_elems = (size_t)max_chunk * (size_t)widest;
    b->dev_scratch_floats = (size_t)max_chunk * (size_t)cfg->n_heads * ATT_SPLITS * (size_t)(cfg->head_dim + 2);
    b->host_scores_floats = (size_t)cfg->n_heads * 4096;
    const char *what = "stream";
    e = cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) what = "activation scratch", e = cudaMalloc((void **)&b->xb, b->xb_elems * sizeof(__nv_bfloat16));
    if (e == cudaSuccess) what = "attention scratch", e = cudaMalloc((void **)&b->dev_scratch, b->dev_scratch_floats * sizeof(float));
    if (e == cudaSuccess) what = "score staging", e = cudaMallocHost((void **)&b->host_scores, b->host_scores_floats * sizeof(float));
    if (e != cudaSuccess) {
        kr_errf(err, "CUDA backend: cannot create the %s: %s", what, cudaGetErrorString(e));
        cuda_destroy(b);
        return -1;
    }
    cublasStatus_t s = cublasCreate(&b->cublas);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetStream(b->cublas, b->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        kr_errf(err, "CUDA backend: cuBLAS: %s", cublasGetStatusString(s));
        cuda_destroy(b);
        return -1;
    }
    /* room for a whole decode step's uploads between two syncs at most batch and context sizes
     * (16 MiB pinned); a bigger step waits for the stream when it runs out */
    const size_t chunk_ints = (size_t)max_chunk * (size_t)(cfg->n_kv_heads + 1) * 4;
    if (kr_cuda_tables_reserve(b, chunk_ints > ((size_t)1 << 22) ? chunk_ints : (size_t)1 << 22) != KR_OK) {
        kr_errf(err, "CUDA backend: cannot allocate block tables");
        cuda_destroy(b);
        return -1;
    }
    b->tables_used = 0;
    if (upload_model(b, m, err) != KR_OK) {
        cuda_destroy(b);
        return -1;
    }
    *out = b;
    return KR_OK;
}

static int cuda_n_threads(const kr_backend *b)
{
    return 1;
}

static float *cuda_act_alloc(kr_backend *b, size_t n_floats)
{
    float *p = NULL;
    if (cudaMalloc((void **)&p, n_floats * sizeof(float)) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cuda_act_free(kr_backend *b, float *p)
{
    KR_CUDA_CHECK(cudaStreamSynchronize(b->stream));
    KR_CUDA_CHECK(cudaFree(p));
}

static void cuda_sync(kr_backend *b)
{
    KR_CUDA_CHECK(cudaStreamSynchronize(b->stream));
    b->tables_used = 0; /* every upload so far is done: the slices may be rewritten */
}

static void cuda_to_host(kr_backend *b, const float *src, size_t n_floats, float *dst)
{
    KR_CUDA_CHECK(cudaMemcpyAsync(dst, src, n_floats * sizeof(float), cudaMemcpyDeviceToHost, b->stream));
    cuda_sync(b);
}

/* The KV pool in managed memory: the host code that edits lists (kv.c, policies, sequence
 * import/export) reads and writes it as before, the kernels read it through block tables. */
static void *cuda_kv_alloc(kr_backend *b, size_t bytes)
{
    void *p = NULL;
    if (cudaMallocManaged(&p, bytes, cudaMemAttachGlobal) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    /* the kernels are its main users: keep its pages on the GPU, readable from the host */
    cudaMemLocation loc;
    loc.type = cudaMemLocationTypeDevice;
    loc.id = b->device;
    (void)cudaMemAdvise(p, bytes, cudaMemAdviseSetPreferredLocation, loc);
    (void)cudaGetLastError(); /* advice is optional (not supported everywhere) */
    return p;
}

static void cuda_kv_free(void *p)
{
    /* kernels of any context may still read it: cudaFree waits for the device */
    KR_CUDA_CHECK(cudaDeviceSynchronize());
    KR_CUDA_CHECK(cudaFree(p));
}

extern "C" const kr_backend_ops kr_cuda_backend = {
    /* .name = */ "cuda",
    /* .create = */ cuda_create,
    /* .destroy = */ cuda_destroy,
    /* .n_threads = */ cuda_n_threads,
    /* .act_alloc = */ cuda_act_alloc,
    /* .act_free = */ cuda_act_free,
    /* .to_host = */ cuda_to_host,
    /* .kv_alloc = */ cuda_kv_alloc,
    /* .kv_free = */ cuda_kv_free,
    /* .sync = */ cuda_sync,
    /* .embed = */ kr_cuda_embed,
    /* .rmsnorm = */ kr_cuda_rmsnorm,
    /* .matmul = */ kr_cuda_matmul,
    /* .matmul_rows = */ kr_cuda_matmul_rows,
    /* .swiglu = */ kr_cuda_swiglu,
    /* .rope = */ kr_cuda_rope,
    /* .kv_store = */ kr_cuda_kv_store,
    /* .attention = */ kr_cuda_attention,
    /* .attention_batch = */ kr_cuda_attention_batch,
    /* .score = */ kr_cuda_score,
    /* .score_past = */ kr_cuda_score_past,
    /* .kv_dtypes = */ 1u << KR_DTYPE_F32, /* the kernels read and write f32 pools only */
    /* .bf16_x_min_tokens = */ 2, /* one row takes the GEMV on f32 x, more a cuBLAS bf16 GEMM */
};
