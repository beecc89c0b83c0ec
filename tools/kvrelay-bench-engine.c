/*
 * kvrelay-bench-engine - engine speed against the machine's own limits, measured in the same
 * run. Prefill: tokens/s as a fraction of the GEMM peak (CPU: OpenBLAS, one sgemm per thread, as
 * the engine runs it, or for bf16 weights on the AVX-512-BF16 kernels the throughput of
 * vdpbf16ps on every thread; CUDA: one large cuBLAS bf16 GEMM with f32 accumulation). Decode,
 * alone or in batches (kr_forward_batch; tokens/s are the batch's total): tokens/s against the
 * roofline of a step, the longer of two times: the bytes it must read (weights + the KV cache of
 * every sequence of the batch in its dtype) at the measured bandwidth (a streaming read on the
 * CPU, a device-to-device copy with CUDA), and its FLOPs at the measured peak of the kernel path
 * that runs them (matmuls, 2 x params per token x batch: vdpbf16ps for bf16 weights on the
 * avx512bf16 variant, else f32 FMAs at the variant's vector width; attention, 2 x 2 x head_dim
 * per query head and cached entry: f32 FMAs; CUDA: the cuBLAS peak for both). Each decode line
 * says which bound binds and the fraction of the roofline reached, keeps the fraction of the
 * read bandwidth, and with more than one batch size the speed-up over batch 1 and the fraction
 * of the longest prompt's prefill tokens/s. The CPU's memcpy bandwidth (read + write) is
 * measured and reported too, and the JSON keeps decode's fraction of it (fraction_of_bandwidth).
 * Not a profile: a roofline says how far a run is from a bound, not where the time goes.
 *   kvrelay-bench-engine (--model DIR | --random CONFIG.json) [--dtype bf16] [--threads N]
 *                        [--kv-cache-dtype f32|bf16|f16|auto] [--prefill LIST] [--contexts LIST]
 *                        [--batch LIST] [--json]
 * e.g. --random tools/data/llama-110m.json --dtype bf16 --threads 2 --batch 1,8,32.
 * Progress goes to stderr, results to stdout (a table, or one JSON object with --json).
 */
#include "cli.h"
#include "kr.h"

#include <cblas.h>
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#ifdef KR_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

enum { MAX_LIST = 16, BLOCK = 16 };

/* A list of 1..MAX_LIST positive integers (--prefill, --contexts, --batch). */
typedef struct int_list {
    int n;
    int v[MAX_LIST];
} int_list;

static int flag_list(void *dest, const char *flag, const char *s, char *err, size_t cap)
{
    int_list *l = dest;
    int n, rc = 0;
    int32_t *v = cli_ids(flag, s, &n);
    if (n == 0 || n > MAX_LIST) {
        snprintf(err, cap, "%s: give 1 to %d values", flag, MAX_LIST);
        rc = -1;
    }
    for (int i = 0; rc == 0 && i < n; i++) {
        if (v[i] < 1) {
            snprintf(err, cap, "%s: %d must be positive", flag, v[i]);
            rc = -1;
        }
        l->v[i] = v[i];
    }
    if (rc == 0) l->n = n;
    free(v);
    return rc;
}

/* ---- limits measured in this run */

typedef struct bw_job {
    char *src, *dst;
    size_t bytes;
    int reps;
} bw_job;

static void *bw_thread(void *p)
{
    bw_job *j = p;
    for (int r = 0; r < j->reps; r++) memcpy(j->dst, j->src, j->bytes);
    return NULL;
}

/* memcpy bandwidth (bytes read + written per second) with `threads` threads, 256 MiB each way */
static double measure_copy_bandwidth(int threads)
{
    const size_t total = (size_t)256 << 20, per = total / (size_t)threads;
    bw_job jobs[256];
    pthread_t th[256];
    for (int t = 0; t < threads; t++) {
        jobs[t].src = malloc(per);
        jobs[t].dst = malloc(per);
        if (!jobs[t].src || !jobs[t].dst) cli_die(1, "out of memory for the bandwidth test");
        memset(jobs[t].src, t + 1, per);
        memset(jobs[t].dst, 0, per);
        jobs[t].bytes = per;
        jobs[t].reps = 1;
    }
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = cli_now();
        for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, bw_thread, &jobs[t]);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        double bw = 2.0 * (double)per * threads / (cli_now() - t0);
        if (bw > best) best = bw;
    }
    for (int t = 0; t < threads; t++) free(jobs[t].src), free(jobs[t].dst);
    return best;
}

/* 32-byte vectors (two SSE registers in a build without AVX): the loads a decode kernel makes */
typedef uint64_t read_vec __attribute__((vector_size(32)));

typedef struct read_job {
    const read_vec *buf;
    size_t n; /* vectors */
    uint64_t sum; /* of everything read: the loads have a result, so they stay */
} read_job;

static void *read_thread(void *p)
{
    read_job *j = p;
    /* four independent sums: one add chain would bound the loop below memory speed */
    read_vec s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    for (size_t i = 0; i + 4 <= j->n; i += 4) {
        s0 += j->buf[i];
        s1 += j->buf[i + 1];
        s2 += j->buf[i + 2];
        s3 += j->buf[i + 3];
    }
    read_vec s = s0 + s1 + s2 + s3;
    j->sum = s[0] + s[1] + s[2] + s[3];
    return NULL;
}

/* Streaming-read bandwidth (bytes read per second), the traffic of a decode step, with
 * `threads` threads each summing its part of 1 GiB (far beyond a last-level cache: 32 MiB on
 * the development machine's EPYC), best of 5 passes. The buffers are written first: untouched
 * pages would all read the one zero page, from the cache. They ask for transparent huge pages,
 * as the engine's large arrays do (the KV pool, weights converted at load): the limit is the
 * best read the machine gives. */
static double measure_read_bandwidth(int threads)
{
    const size_t huge = (size_t)2 << 20, total = (size_t)1 << 30;
    const size_t per = total / (size_t)threads / huge * huge;
    read_job jobs[256];
    pthread_t th[256];
    for (int t = 0; t < threads; t++) {
        void *buf = aligned_alloc(huge, per);
        if (!buf) cli_die(1, "out of memory for the read bandwidth test (1 GiB)");
        madvise(buf, per, MADV_HUGEPAGE);
        memset(buf, t + 1, per);
        jobs[t].buf = buf;
        jobs[t].n = per / sizeof(read_vec);
    }
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = cli_now();
        for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, read_thread, &jobs[t]);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        double bw = (double)per * threads / (cli_now() - t0);
        if (bw > best) best = bw;
    }
    for (int t = 0; t < threads; t++) free((void *)jobs[t].buf);
    return best;
}

typedef struct gemm_job {
    float *a, *b, *c;
    int n;
} gemm_job;

static void *gemm_thread(void *p)
{
    gemm_job *j = p;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, j->n, j->n, j->n, 1.0f, j->a, j->n, j->b,
                j->n, 0.0f, j->c, j->n);
    return NULL;
}

/* sgemm FLOP/s with one single-threaded OpenBLAS sgemm per thread, as the engine calls it */
static double measure_gemm_peak(int threads)
{
    const int n = 1024;
    gemm_job jobs[256];
    pthread_t th[256];
    openblas_set_num_threads(1);
    for (int t = 0; t < threads; t++) {
        jobs[t].n = n;
        jobs[t].a = malloc(sizeof(float) * n * n);
        jobs[t].b = malloc(sizeof(float) * n * n);
        jobs[t].c = malloc(sizeof(float) * n * n);
        if (!jobs[t].a || !jobs[t].b || !jobs[t].c) cli_die(1, "out of memory for the GEMM test");
        for (int i = 0; i < n * n; i++) jobs[t].a[i] = jobs[t].b[i] = (float)(i % 7) * 0.01f;
    }
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = cli_now();
        for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, gemm_thread, &jobs[t]);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        double f = 2.0 * n * n * (double)n * threads / (cli_now() - t0);
        if (f > best) best = f;
    }
    for (int t = 0; t < threads; t++) free(jobs[t].a), free(jobs[t].b), free(jobs[t].c);
    return best;
}

/* Throughput kernels for the compute peaks: each runs *(long *)arg iterations of CHAINS
 * independent accumulator chains (more than an operation's latency times its issue rate on
 * current cores: Zen 4 issues two FMAs per cycle at 4 cycles' latency), with no memory in the
 * way, and writes a value of the sums back through arg so that the loop stays. The FMA chains
 * multiply by just under 1 and add a small constant: the sums settle near 1000, never overflow
 * and never reach a denormal. */
enum { CHAINS = 12 };

/* plain C on 4-float vectors (GCC vector extension): the width of the base variant's SSE2 code */
typedef float fma_vec4 __attribute__((vector_size(16)));
static void *fma_c_thread(void *p)
{
    fma_vec4 acc[CHAINS];
    const fma_vec4 a = {0.999999f, 0.999999f, 0.999999f, 0.999999f}, b = {1e-3f, 1e-3f, 1e-3f, 1e-3f};
    for (int c = 0; c < CHAINS; c++) acc[c] = b;
    for (long it = 0; it < *(long *)p; it++)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = acc[c] * a + b;
    float s = 0;
    for (int c = 0; c < CHAINS; c++) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    *(long *)p = (long)s;
    return NULL;
}

#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2,fma"))) static void *fma_avx2_thread(void *p)
{
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-3f);
    for (int c = 0; c < CHAINS; c++) acc[c] = b;
    for (long it = 0; it < *(long *)p; it++)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    float v[8], s = 0;
    for (int c = 0; c < CHAINS; c++) {
        _mm256_storeu_ps(v, acc[c]);
        for (int i = 0; i < 8; i++) s += v[i];
    }
    *(long *)p = (long)s;
    return NULL;
}

__attribute__((target("avx512f"))) static void *fma_avx512_thread(void *p)
{
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-3f);
    for (int c = 0; c < CHAINS; c++) acc[c] = b;
    for (long it = 0; it < *(long *)p; it++)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    float s = 0;
    for (int c = 0; c < CHAINS; c++) s += _mm512_reduce_add_ps(acc[c]);
    *(long *)p = (long)s;
    return NULL;
}

/* vdpbf16ps: 16 lanes, each two products and two adds */
__attribute__((target("avx512f,avx512bf16"))) static void *dp_thread(void *p)
{
    __m512 acc[CHAINS];
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3c003c00), b = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_setzero_ps();
    for (long it = 0; it < *(long *)p; it++)
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
    float s = 0;
    for (int c = 0; c < CHAINS; c++) s += _mm512_reduce_add_ps(acc[c]);
    *(long *)p = (long)s;
    return NULL;
}
#endif

/* FLOP/s of `kernel` (above) on `threads` threads at once, `flops` per iteration of a thread,
 * best of 4 */
static double measure_peak(int threads, void *(*kernel)(void *), double flops)
{
    const long iters = 20000000;
    long arg[256];
    pthread_t th[256];
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        double t0 = cli_now();
        for (int t = 0; t < threads; t++) arg[t] = iters, pthread_create(&th[t], NULL, kernel, &arg[t]);
        for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
        double f = flops * (double)iters * threads / (cli_now() - t0);
        if (f > best) best = f;
    }
    return best;
}

/* The AVX-512-BF16 kernels' limit: vdpbf16ps FLOP/s on `threads` threads (32 products and
 * 32 adds each) */
static double measure_bf16_dot_peak(int threads)
{
#if defined(__x86_64__)
    return measure_peak(threads, dp_thread, 64.0 * CHAINS);
#else
    (void)threads;
    return 0; /* never asked for: the avx512bf16 variant exists on x86-64 only */
#endif
}

/* f32 FMA FLOP/s on `threads` threads, at the vector width of the kernel variant this process
 * runs (kr_cpu_isa): what decode's f32 dot products and attention can reach. The plain C
 * fallback (base variant, other architectures) is a 4-float vector the compiler may or may not
 * contract into FMAs: an approximate bound. */
static double measure_fma_peak(int threads, const char **what)
{
#if defined(__x86_64__)
    const char *isa = kr_cpu_isa();
    if (!strcmp(isa, "avx512bf16") || !strcmp(isa, "avx512")) {
        *what = "f32 FMA (avx512)";
        return measure_peak(threads, fma_avx512_thread, 2.0 * 16 * CHAINS);
    }
    if (!strcmp(isa, "avx2")) {
        *what = "f32 FMA (avx2)";
        return measure_peak(threads, fma_avx2_thread, 2.0 * 8 * CHAINS);
    }
#endif
    *what = "f32 mul+add (plain C)";
    return measure_peak(threads, fma_c_thread, 2.0 * 4 * CHAINS);
}

#ifdef KR_HAVE_CUDA
static void cuda_ok(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) cli_die(1, "%s: %s", what, cudaGetErrorString(e));
}

/* device-to-device copy bandwidth (bytes read + written per second), 1 GiB each way */
static double measure_copy_bandwidth_cuda(void)
{
    const size_t bytes = (size_t)1 << 30;
    void *src, *dst;
    cudaEvent_t e0, e1;
    cuda_ok(cudaMalloc(&src, bytes), "cudaMalloc");
    cuda_ok(cudaMalloc(&dst, bytes), "cudaMalloc");
    cuda_ok(cudaMemset(src, 1, bytes), "cudaMemset");
    cuda_ok(cudaEventCreate(&e0), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&e1), "cudaEventCreate");
    double best = 0;
    for (int rep = 0; rep < 6; rep++) { /* the first warms up */
        float ms;
        cuda_ok(cudaEventRecord(e0, 0), "cudaEventRecord");
        cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0), "cudaMemcpyAsync");
        cuda_ok(cudaEventRecord(e1, 0), "cudaEventRecord");
        cuda_ok(cudaEventSynchronize(e1), "cudaEventSynchronize");
        cuda_ok(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
        double bw = 2.0 * (double)bytes / (ms * 1e-3);
        if (rep > 0 && bw > best) best = bw;
    }
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(src), cudaFree(dst);
    return best;
}

/* FLOP/s of one 8192^3 cuBLAS GEMM with bf16 inputs and f32 accumulation and output, as the
 * CUDA backend runs its GEMMs */
static double measure_gemm_peak_cuda(void)
{
    const int n = 8192;
    void *a, *b, *c;
    cublasHandle_t h;
    cudaEvent_t e0, e1;
    const float one = 1.0f, zero = 0.0f;
    cuda_ok(cudaMalloc(&a, (size_t)n * n * 2), "cudaMalloc");
    cuda_ok(cudaMalloc(&b, (size_t)n * n * 2), "cudaMalloc");
    cuda_ok(cudaMalloc(&c, (size_t)n * n * 4), "cudaMalloc");
    cuda_ok(cudaMemset(a, 0x3c, (size_t)n * n * 2), "cudaMemset"); /* bf16 0x3c3c: about 0.0115 */
    cuda_ok(cudaMemset(b, 0x3c, (size_t)n * n * 2), "cudaMemset");
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) cli_die(1, "cublasCreate failed");
    cuda_ok(cudaEventCreate(&e0), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&e1), "cudaEventCreate");
    double best = 0;
    for (int rep = 0; rep < 6; rep++) { /* the first warms up */
        float ms;
        cuda_ok(cudaEventRecord(e0, 0), "cudaEventRecord");
        if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                         &zero, c, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
            cli_die(1, "cublasGemmEx failed");
        cuda_ok(cudaEventRecord(e1, 0), "cudaEventRecord");
        cuda_ok(cudaEventSynchronize(e1), "cudaEventSynchronize");
        cuda_ok(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
        double f = 2.0 * n * n * (double)n / (ms * 1e-3);
        if (rep > 0 && f > best) best = f;
    }
    cublasDestroy(h);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    cudaFree(a), cudaFree(b), cudaFree(c);
    return best;
}
#endif

/* ---- the limits of a run and the decode roofline */

/* what a compute peak bounds: each runs on its own kernel path */
enum { USE_PREFILL, USE_MATMUL, USE_ATTENTION, USES };
static const char *const use_name[USES] = {"prefill", "decode matmuls", "attention"};

/* What the run's figures are fractions of, measured once before any timing */
typedef struct limits {
    double read_bw; /* bytes/s bounding a decode step's reads: a streaming read (CPU), a device copy (CUDA) */
    const char *read_what;
    double copy_bw; /* bytes read + written per second by memcpy (CPU) or a device copy (CUDA) */
    const char *copy_what;
    int read_measured; /* read_bw is a read of its own (CPU), not the copy */
    double peak[USES]; /* FLOP/s of the kernel path each use runs on */
    const char *peak_what[USES];
} limits;

static void measure_limits(int backend, int threads, kr_dtype weights, limits *lim)
{
    memset(lim, 0, sizeof *lim);
    if (backend == KR_BACKEND_CUDA) {
#ifdef KR_HAVE_CUDA
        /* every use against the one cuBLAS peak: attention runs on CUDA cores, not on the tensor
         * cores a bf16 GEMM uses, so its bound is optimistic (a roofline is an upper bound) */
        fprintf(stderr, "bench: measuring device copy bandwidth and cuBLAS bf16 GEMM peak\n");
        lim->copy_bw = lim->read_bw = measure_copy_bandwidth_cuda();
        lim->copy_what = lim->read_what = "device-to-device copy";
        double gemm = measure_gemm_peak_cuda();
        for (int u = 0; u < USES; u++) lim->peak[u] = gemm, lim->peak_what[u] = "cuBLAS bf16 GEMM";
#else
        cli_die(1, "--backend cuda: built without CUDA"); /* kr_ctx_create refused it already */
#endif
        return;
    }
    fprintf(stderr, "bench: measuring memory bandwidth and the compute peaks on %d threads\n", threads);
    lim->read_bw = measure_read_bandwidth(threads), lim->read_what = "read", lim->read_measured = 1;
    lim->copy_bw = measure_copy_bandwidth(threads), lim->copy_what = "memcpy";
    /* attention is f32 FMAs everywhere; so are the decode matmuls except bf16 weights on the
     * AVX-512-BF16 kernels, which multiply with vdpbf16ps as their prefill GEMM does; prefill of
     * other weights runs OpenBLAS sgemm */
    lim->peak[USE_ATTENTION] = measure_fma_peak(threads, &lim->peak_what[USE_ATTENTION]);
    if (!strcmp(kr_cpu_isa(), "avx512bf16") && weights == KR_DTYPE_BF16) {
        lim->peak[USE_PREFILL] = lim->peak[USE_MATMUL] = measure_bf16_dot_peak(threads);
        lim->peak_what[USE_PREFILL] = lim->peak_what[USE_MATMUL] = "vdpbf16ps";
    } else {
        lim->peak[USE_PREFILL] = measure_gemm_peak(threads), lim->peak_what[USE_PREFILL] = "sgemm";
        lim->peak[USE_MATMUL] = lim->peak[USE_ATTENTION], lim->peak_what[USE_MATMUL] = lim->peak_what[USE_ATTENTION];
    }
}

/* "vdpbf16ps peak 450.0 GFLOP/s (prefill, decode matmuls), f32 FMA (avx512) peak ..." */
static void print_peaks(const limits *lim)
{
    for (int u = 0; u < USES; u++) {
        int first = 1;
        for (int v = 0; v < u; v++) first &= strcmp(lim->peak_what[v], lim->peak_what[u]) != 0;
        if (!first) continue;
        printf("%s%s peak %.1f GFLOP/s (", u ? ", " : "", lim->peak_what[u], lim->peak[u] / 1e9);
        for (int v = u, n = 0; v < USES; v++)
            if (!strcmp(lim->peak_what[v], lim->peak_what[u])) printf("%s%s", n++ ? ", " : "", use_name[v]);
        printf(")");
    }
    printf("\n");
}

/* ---- engine timings */

typedef struct bench {
    kr_ctx *ctx;
    const kr_policy *policy;
    const kr_config *cfg;
    kr_kv_pool *pool;
    int chunk, repeat;
    int32_t *tokens; /* [longest prompt or context + decode] random ids */
    float *logits;
} bench;

static kr_seq *new_seq(bench *b)
{
    char err[KR_ERR_MAX];
    kr_seq *s;
    if (kr_seq_create(b->pool, b->cfg->n_layers, b->cfg->n_kv_heads, &s, err) != KR_OK ||
        kr_seq_set_policy(s, b->policy, err) != KR_OK)
        cli_die(1, "%s", err);
    return s;
}

static double time_prefill(bench *b, int n)
{
    char err[KR_ERR_MAX];
    double best = 1e30;
    for (int r = 0; r < b->repeat; r++) {
        kr_seq *s = new_seq(b);
        double t0 = cli_now();
        if (kr_prefill(b->ctx, s, b->tokens, n, b->chunk, KR_LOGITS_LAST, b->logits, err) != KR_OK)
            cli_die(1, "prefill: %s", err);
        double dt = cli_now() - t0;
        if (dt < best) best = dt;
        kr_seq_free(s);
    }
    return best;
}

typedef struct decode_run {
    double seconds; /* per step, best of the repeats */
    double entries; /* KV entries held (all layers and heads), averaged over the timed steps */
    double footprint; /* the sequence's KV footprint at the end */
} decode_run;

/* decode steps of `batch` sequences at context `ctx_len` (best of repeat runs of `steps` steps;
 * one sequence through kr_forward, more through kr_forward_batch); entries and footprint summed
 * and averaged over the batch */
static decode_run time_decode(bench *b, int ctx_len, int steps, int batch)
{
    char err[KR_ERR_MAX];
    kr_seq **s = malloc(sizeof(kr_seq *) * (size_t)batch);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)batch);
    float *lg = malloc(sizeof(float) * (size_t)batch * (size_t)b->cfg->vocab_size);
    if (!s || !tok || !lg) cli_die(1, "out of memory for a batch of %d", batch);
    for (int j = 0; j < batch; j++) {
        s[j] = new_seq(b);
        if (kr_prefill(b->ctx, s[j], b->tokens, ctx_len, b->chunk, KR_LOGITS_LAST, b->logits, err) != KR_OK)
            cli_die(1, "prefill: %s", err);
    }
    decode_run run = {.seconds = 1e30};
    double held = 0;
    for (int r = 0; r < b->repeat; r++) {
        double t0 = cli_now();
        for (int i = 0; i < steps; i++) {
            for (int j = 0; j < batch; j++) tok[j] = b->tokens[ctx_len + r * steps + i];
            int rc = batch == 1 ? kr_forward(b->ctx, s[0], tok, 1, KR_LOGITS_LAST, lg, err)
                                : kr_forward_batch(b->ctx, s, tok, batch, lg, err);
            if (rc != KR_OK) cli_die(1, "decode: %s", err);
        }
        double dt = (cli_now() - t0) / steps;
        if (dt < run.seconds) run.seconds = dt;
        for (int j = 0; j < batch; j++) held += (double)kr_seq_entries(s[j]);
    }
    run.entries = held / b->repeat;
    run.footprint = 0;
    for (int j = 0; j < batch; j++) {
        kr_footprint fp;
        kr_seq_footprint(s[j], &fp);
        run.footprint += (fp.full > 0 ? fp.attended / fp.full : 1.0) / batch;
        kr_seq_free(s[j]);
    }
    free(s), free(tok), free(lg);
    return run;
}

/* ---- decode against its roofline */

/* The work of a decode step, from the model's shape */
typedef struct step_cost {
    double weight_bytes; /* weights a step reads: every matrix once (the embedding is a lookup of
                          * one row per sequence, left out) */
    double params; /* weights a token multiplies, 2 FLOPs each */
    double entry_bytes; /* one cached entry of one (layer, KV head): its K and V rows in the cache's dtype */
    double entry_flops; /* attention over one such entry for one query token: for each of the
                         * n_heads / n_kv_heads query heads of the group, QK^T and PV, 2 x 2 x head_dim */
} step_cost;

typedef struct decode_fig {
    int context, batch;
    decode_run run;
    double tokens_per_s, bytes, mm_flops, att_flops; /* per step */
    double roofline_s; /* the larger of bandwidth_s and compute_s */
    double bandwidth_s; /* bytes at the read bandwidth */
    double compute_s; /* matmuls at their peak, then attention at its: one after the other */
    const char *bound; /* which of the two binds: "bandwidth" or "compute" */
} decode_fig;

/* A timed decode run against its roofline. The bytes a step must read are every weight matrix
 * once and every cached K and V entry the policy holds in the batch (run.entries), whatever the
 * batch size; the FLOPs grow with it. */
static decode_fig decode_figures(const limits *lim, const step_cost *sc, int context, int batch, decode_run run)
{
    decode_fig f = {.context = context, .batch = batch, .run = run, .tokens_per_s = batch / run.seconds};
    f.bytes = sc->weight_bytes + run.entries * sc->entry_bytes;
    f.mm_flops = 2.0 * sc->params * batch;
    f.att_flops = run.entries * sc->entry_flops;
    f.bandwidth_s = f.bytes / lim->read_bw;
    f.compute_s = f.mm_flops / lim->peak[USE_MATMUL] + f.att_flops / lim->peak[USE_ATTENTION];
    f.bound = f.compute_s > f.bandwidth_s ? "compute" : "bandwidth";
    f.roofline_s = f.compute_s > f.bandwidth_s ? f.compute_s : f.bandwidth_s;
    return f;
}

/* figures a decode line is also compared with, where this run timed them (else 0) */
typedef struct decode_refs {
    double batch1_tokens_per_s; /* the same context at batch 1 */
    double prefill_tokens_per_s; /* the longest prompt's prefill */
    int prefill_tokens;
} decode_refs;

static void decode_report(cJSON *dec, const limits *lim, const decode_fig *f, const decode_refs *ref, int json)
{
    const double dt = f->run.seconds, frac_read = f->bytes / dt / lim->read_bw, frac_roof = f->roofline_s / dt;
    const double speedup = f->batch > 1 && ref->batch1_tokens_per_s > 0 ? f->tokens_per_s / ref->batch1_tokens_per_s : 0;
    const double of_prefill = f->batch > 1 && ref->prefill_tokens > 0 ? f->tokens_per_s / ref->prefill_tokens_per_s : 0;
    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "context", f->context);
    cJSON_AddNumberToObject(e, "batch", f->batch);
    cJSON_AddNumberToObject(e, "seconds_per_step", dt);
    cJSON_AddNumberToObject(e, "tokens_per_second", f->tokens_per_s);
    cJSON_AddNumberToObject(e, "bytes_per_step", f->bytes);
    cJSON_AddNumberToObject(e, "fraction_of_bandwidth", f->bytes / dt / lim->copy_bw); /* of the copy */
    if (lim->read_measured) cJSON_AddNumberToObject(e, "fraction_of_read_bandwidth", frac_read);
    cJSON_AddNumberToObject(e, "matmul_flops_per_step", f->mm_flops);
    cJSON_AddNumberToObject(e, "attention_flops_per_step", f->att_flops);
    cJSON_AddNumberToObject(e, "bandwidth_bound_seconds", f->bandwidth_s);
    cJSON_AddNumberToObject(e, "compute_bound_seconds", f->compute_s);
    cJSON_AddNumberToObject(e, "roofline_tokens_per_s", f->batch / f->roofline_s);
    cJSON_AddNumberToObject(e, "fraction_of_roofline", frac_roof);
    cJSON_AddStringToObject(e, "bound", f->bound);
    if (speedup > 0) cJSON_AddNumberToObject(e, "speedup_over_batch1", speedup);
    if (of_prefill > 0) cJSON_AddNumberToObject(e, "fraction_of_prefill", of_prefill);
    cJSON_AddNumberToObject(e, "kv_entries", f->run.entries);
    cJSON_AddNumberToObject(e, "kv_footprint", f->run.footprint);
    cJSON_AddItemToArray(dec, e);
    if (json) return;
    printf("decode at %5d, batch %2d: %9.1f tokens/s = %.2f of roofline %.1f (%s bound); %6.1f MB read per step, "
           "%5.1f GB/s = %.2f of %s bandwidth; KV footprint %.3f", f->context, f->batch, f->tokens_per_s, frac_roof,
           f->batch / f->roofline_s, f->bound, f->bytes / 1e6, f->bytes / dt / 1e9, frac_read, lim->read_what,
           f->run.footprint);
    if (speedup > 0) printf("; %.2fx batch 1", speedup);
    if (of_prefill > 0) printf("; %.2f of prefill %d", of_prefill, ref->prefill_tokens);
    printf("\n");
}

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *model_dir = NULL, *random_cfg = NULL, *policy = "full";
    int dtype = KR_DTYPE_BF16, backend = KR_BACKEND_CPU, json = 0, kv_dtype = KR_KV_DTYPE_AUTO;
    kr_model_opts mo = {.verbose = 1};
    int threads = 0, decode_tokens = 32, chunk = 512, repeat = 3;
    int_list prefill = {1, {512}}, contexts = {2, {128, 2048}}, batches = {1, {1}};
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &model_dir,
         .help = "a Hugging Face model directory"},
        {.kind = KC_FLAG_STRING, .name = "--random", .arg = "CONFIG", .dest = &random_cfg,
         .help = "a config.json: that shape with random weights (no checkpoint)"},
        {.kind = KC_FLAG_CHOICE, .name = "--dtype", .arg = "D", .dest = &dtype, .choices = cli_weight_dtypes,
         .def = "bf16", .help = "weights for --random: bf16, f16 or f32"},
        {.kind = KC_FLAG_BOOL, .name = "--weights-f32", .dest = &mo.weights_f32,
         .help = "convert a checkpoint's bf16/f16 weights to f32 at load"},
        {.kind = KC_FLAG_INT, .name = "--threads", .arg = "N", .dest = &threads, .min = 1, .max = 256,
         .def = "all online CPUs", .help = "CPU threads"},
        {.kind = KC_FLAG_CHOICE, .name = "--backend", .arg = "B", .dest = &backend, .choices = cli_backends,
         .def = "cpu", .help = "cpu or cuda"},
        {.kind = KC_FLAG_CHOICE, .name = "--kv-cache-dtype", .arg = "T", .dest = &kv_dtype,
         .choices = cli_kv_dtypes, .def = "auto", .help = CLI_KV_DTYPE_HELP},
        {.kind = KC_FLAG_STRING, .name = "--policy", .arg = "SPEC", .dest = &policy, .def = "full",
         .help = "KV policy: full, streaming, heads, hsft, snapkv, pyramidkv, take, sage; name:key=value,... "
                 "(docs/policies.md)"},
        {.kind = KC_FLAG_FUNC, .name = "--prefill", .arg = "LIST", .dest = &prefill, .fn = flag_list,
         .def = "512", .help = "prompt lengths to time prefill at"},
        {.kind = KC_FLAG_FUNC, .name = "--contexts", .arg = "LIST", .dest = &contexts, .fn = flag_list,
         .def = "128,2048", .help = "contexts to time decode at"},
        {.kind = KC_FLAG_FUNC, .name = "--batch", .arg = "LIST", .dest = &batches, .fn = flag_list,
         .def = "1", .help = "sequences decoded together (tokens/s: the batch's total; each batch is compared with batch 1 "
                             "when both are listed)"},
        {.kind = KC_FLAG_INT, .name = "--decode-tokens", .arg = "N", .dest = &decode_tokens, .min = 1,
         .max = 1 << 16, .def = "32", .help = "decode steps timed per context"},
        {.kind = KC_FLAG_INT, .name = "--chunk", .arg = "C", .dest = &chunk, .min = 1, .max = 1 << 16,
         .def = "512", .help = "prefill chunk size"},
        {.kind = KC_FLAG_INT, .name = "--repeat", .arg = "R", .dest = &repeat, .min = 1, .max = 100,
         .def = "3", .help = "best of R timings"},
        {.kind = KC_FLAG_BOOL, .name = "--json", .dest = &json, .help = "one JSON object on stdout"},
        {.kind = KC_FLAG_END},
    };
    char footer[512];
    snprintf(footer, sizeof footer, "%s\n\n%s", kr_cpu_isa_help(),
             "example: kvrelay-bench-engine --random tools/data/llama-110m.json --dtype bf16 --threads 2");
    const kc_flags flags = {
        .prog = "kvrelay-bench-engine",
        .usage = "(--model DIR | --random CONFIG.json) [options]",
        .about = "Measures prefill and decode speed and prints each as a fraction of a limit measured\n"
                 "in the same run: the GEMM peak for prefill; for decode the roofline of a step, the\n"
                 "longer of its bytes at the read bandwidth and its FLOPs at the peak of the kernels\n"
                 "that run them (vdpbf16ps for bf16 weights on avx512bf16, else f32 FMAs), with the\n"
                 "bound that binds.",
        .table = table,
        .footer = footer,
    };
    kc_flags_main(&flags, argc, argv, 0);
    if (!model_dir == !random_cfg) cli_die(2, "give exactly one of --model and --random (see --help)");

    char err[KR_ERR_MAX];
    kr_model *m;
    double t_load = cli_now();
    if (model_dir) {
        if (kr_model_load(model_dir, &mo, &m, err) != KR_OK) cli_die(1, "%s", err);
    } else {
        char *text;
        size_t len;
        FILE *f = fopen(random_cfg, "rb");
        if (!f) cli_die(1, "--random: cannot open '%s'", random_cfg);
        text = cli_read_file(f, &len);
        fclose(f);
        kr_config cfg;
        if (kr_config_parse(text, len, random_cfg, &cfg, err) != KR_OK) cli_die(1, "%s", err);
        free(text);
        fprintf(stderr, "bench: random %s weights for the shape in %s\n", kr_dtype_name((kr_dtype)dtype), random_cfg);
        if (kr_model_random(&cfg, (kr_dtype)dtype, 1234, &m, err) != KR_OK) cli_die(1, "%s", err);
    }
    t_load = cli_now() - t_load;
    const kr_config *cfg = kr_model_config(m);

    int longest = 0;
    for (int i = 0; i < prefill.n; i++) longest = prefill.v[i] > longest ? prefill.v[i] : longest;
    for (int i = 0; i < contexts.n; i++)
        longest = contexts.v[i] + decode_tokens * repeat > longest ? contexts.v[i] + decode_tokens * repeat : longest;
    kr_policy *pol;
    if (kr_policy_parse(policy, cfg, &pol, err) != KR_OK) cli_die(2, "--policy: %s", err);
    bench b = {.cfg = cfg, .policy = pol, .chunk = chunk, .repeat = repeat};
    kr_ctx_params cp = {.backend = (kr_backend_kind)backend, .n_threads = threads, .max_chunk = chunk,
                        .kv_dtype = (kr_kv_dtype)kv_dtype};
    if (kr_ctx_create(m, &cp, &b.ctx, err) != KR_OK) cli_die(1, "%s", err);
    int nth = kr_ctx_n_threads(b.ctx), most_batch = 1;
    for (int i = 0; i < batches.n; i++) most_batch = batches.v[i] > most_batch ? batches.v[i] : most_batch;
    if (most_batch > chunk) cli_die(2, "--batch: %d is more than --chunk %d (a batch is one step)", most_batch, chunk);
    int blocks = ((longest + kr_policy_appended(pol, longest) + 2 * BLOCK - 1) / BLOCK) * cfg->n_layers *
                 cfg->n_kv_heads * most_batch;
    if (kr_ctx_kv_pool_create(b.ctx, BLOCK, blocks, &b.pool, err) != KR_OK) cli_die(1, "%s", err);
    b.tokens = malloc(sizeof(int32_t) * (size_t)longest);
    b.logits = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < longest; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b.tokens[i] = (int32_t)(x % (uint64_t)cfg->vocab_size);
    }

    limits lim;
    measure_limits(backend, nth, kr_model_weight_dtype(m), &lim);
    /* FLOPs per token: 2 per weight of every matrix a token multiplies (the embedding is a lookup) */
    const double d = cfg->hidden_size, f = cfg->intermediate_size, hd = cfg->head_dim;
    const double params = cfg->n_layers * (d * cfg->n_heads * hd * 2 + d * cfg->n_kv_heads * hd * 2 + 3 * d * f) +
                          d * cfg->vocab_size;
    const step_cost sc = {
        .weight_bytes = (double)kr_model_weight_bytes(m) -
                        (cfg->tie_word_embeddings ? 0.0 : (double)cfg->vocab_size * d * kr_dtype_size(kr_model_weight_dtype(m))),
        .params = params,
        .entry_bytes = hd * 2 * (double)kr_dtype_size(kr_ctx_kv_dtype(b.ctx)),
        .entry_flops = 4.0 * hd * cfg->n_heads / cfg->n_kv_heads,
    };

    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", model_dir ? model_dir : random_cfg);
    cJSON_AddStringToObject(root, "weights", kr_dtype_name(kr_model_weight_dtype(m)));
    cJSON_AddStringToObject(root, "kv_cache_dtype", kr_dtype_name(kr_ctx_kv_dtype(b.ctx)));
    cJSON_AddStringToObject(root, "policy", kr_policy_spec(pol));
    cJSON_AddNumberToObject(root, "threads", nth);
    cJSON_AddNumberToObject(root, "params_per_token", params);
    cJSON_AddNumberToObject(root, "weight_bytes", (double)kr_model_weight_bytes(m));
    cJSON_AddNumberToObject(root, "load_seconds", t_load);
    cJSON_AddStringToObject(root, "backend", backend == KR_BACKEND_CUDA ? "cuda" : "cpu");
    cJSON_AddStringToObject(root, "cpu_isa", kr_cpu_isa());
    cJSON_AddStringToObject(root, "copy_bandwidth_of", lim.copy_what);
    cJSON_AddNumberToObject(root, "copy_bandwidth_GBps", lim.copy_bw / 1e9);
    cJSON_AddStringToObject(root, "gemm_peak_of", lim.peak_what[USE_PREFILL]);
    cJSON_AddNumberToObject(root, "gemm_peak_GFLOPs", lim.peak[USE_PREFILL] / 1e9);
    cJSON_AddStringToObject(root, "decode_matmul_peak_of", lim.peak_what[USE_MATMUL]);
    cJSON_AddNumberToObject(root, "decode_matmul_peak_GFLOPs", lim.peak[USE_MATMUL] / 1e9);
    cJSON_AddStringToObject(root, "attention_peak_of", lim.peak_what[USE_ATTENTION]);
    cJSON_AddNumberToObject(root, "attention_peak_GFLOPs", lim.peak[USE_ATTENTION] / 1e9);
    if (lim.read_measured) cJSON_AddNumberToObject(root, "read_bandwidth_GBps", lim.read_bw / 1e9);
    if (!json) {
        printf("model %s: %s weights, %.1f M params per token, %.1f MiB, %d threads (%s), policy %s, "
               "%s KV cache\n", model_dir ? model_dir : random_cfg, kr_dtype_name(kr_model_weight_dtype(m)),
               params / 1e6, kr_model_weight_bytes(m) / 1048576.0, nth,
               backend == KR_BACKEND_CUDA ? "cuda" : kr_cpu_isa(), kr_policy_spec(pol),
               kr_dtype_name(kr_ctx_kv_dtype(b.ctx)));
        printf("limits: ");
        if (lim.read_measured) printf("read bandwidth %.1f GB/s, ", lim.read_bw / 1e9);
        printf("%s bandwidth %.1f GB/s (read+write), ", lim.copy_what, lim.copy_bw / 1e9);
        print_peaks(&lim);
    }
    decode_refs ref = {0};
    cJSON *pre = cJSON_AddArrayToObject(root, "prefill");
    for (int i = 0; i < prefill.n; i++) {
        int n = prefill.v[i];
        fprintf(stderr, "bench: prefill %d tokens x %d\n", n, repeat);
        double dt = time_prefill(&b, n);
        /* attention FLOPs: causal QK^T and PV over n(n+1)/2 pairs per query head */
        double att = 4.0 * cfg->n_layers * cfg->n_heads * hd * (double)n * (n + 1) / 2.0;
        /* lm_head runs for the last token only: prefill returns one row of logits */
        double head = (double)cfg->hidden_size * cfg->vocab_size;
        double flops = 2.0 * (params - head) * n + 2.0 * head + att;
        double frac = flops / dt / lim.peak[USE_PREFILL];
        if (n >= ref.prefill_tokens) ref.prefill_tokens = n, ref.prefill_tokens_per_s = n / dt;
        cJSON *e = cJSON_CreateObject();
        cJSON_AddNumberToObject(e, "tokens", n);
        cJSON_AddNumberToObject(e, "seconds", dt);
        cJSON_AddNumberToObject(e, "tokens_per_second", n / dt);
        cJSON_AddNumberToObject(e, "fraction_of_gemm_peak", frac);
        cJSON_AddItemToArray(pre, e);
        if (!json)
            printf("prefill %5d tokens: %9.1f tokens/s  %6.1f GFLOP/s = %.2f of %s peak\n", n, n / dt,
                   flops / dt / 1e9, frac, lim.peak_what[USE_PREFILL]);
    }
    /* every batch of a context is timed before its lines print: each line compares with batch 1 */
    cJSON *dec = cJSON_AddArrayToObject(root, "decode");
    for (int i = 0; i < contexts.n; i++) {
        int c = contexts.v[i];
        decode_fig fig[MAX_LIST];
        ref.batch1_tokens_per_s = 0;
        for (int j = 0; j < batches.n; j++) {
            int nb = batches.v[j];
            fprintf(stderr, "bench: decode at context %d, batch %d (%d steps x %d)\n", c, nb, decode_tokens, repeat);
            fig[j] = decode_figures(&lim, &sc, c, nb, time_decode(&b, c, decode_tokens, nb));
            if (nb == 1) ref.batch1_tokens_per_s = fig[j].tokens_per_s;
        }
        for (int j = 0; j < batches.n; j++) decode_report(dec, &lim, &fig[j], &ref, json);
    }
    if (json) {
        char *s = cJSON_Print(root);
        puts(s);
        free(s);
    }
    cJSON_Delete(root);
    free(b.tokens);
    free(b.logits);
    kr_kv_pool_free(b.pool);
    kr_ctx_free(b.ctx);
    kr_policy_free(pol);
    kr_model_free(m);
    return 0;
}
