/*
 * test_attention_batch.c - decode attention's batch invariance on the CPU backend: the batch op
 * (attention_batch) over n = 1..33 sequences of mixed lengths, taken in varying sets and orders,
 * must give each row bit for bit what the one-token attention op gives on that sequence alone
 * (docs/engine.md, "Batched decode"), and no NaN: with 1 and 2 threads, GQA ratios 1, 3 and 4
 * at head dims 64 and 80 (and 8 at 64, 5 at 33, which block the query heads and leave vector
 * tails), pools of f32, bf16 and f16, with and without a sliding window, on every variant of the
 * CPU backend this CPU runs. Each one-token row is also held against a double-precision
 * reference on the pool's rounded entries. The sequences' blocks are interleaved in the pool,
 * as a decode node's are. Run: ctest -R test_attention_batch
 */
#include "kr_test.h"

#include "backend.h"
#include "model_shell.h"

enum {
    N_SEQS = 33, /* the largest batch */
    KV_HEADS = 2,
    BLOCK = 16, /* pool block size */
    FILL = 24, /* entries stored per sequence per round: blocks of different sequences interleave */
    WINDOW = 100,
};

static const kr_backend_ops *ops; /* the variant under test */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1.0p-52 - 1.0);
}


/* Lengths around the kernels' edges (1, a score step of 4, a block of 16, a tile of 128, the
 * window) and between them */
static int seq_len(int i)
{
    static const int edge[] = {1, 2, 3, 4, 5, 15, 16, 17, 99, 100, 101, 127, 128, 129, 256, 257, 700};
    enum { N_EDGE = sizeof edge / sizeof edge[0] };
    return i < N_EDGE ? edge[i] : 1 + (i * 379 + 11) % 520;
}

static int has_nan(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (x[i] != x[i]) return 1;
    return 0;
}

/* The double-precision reference of one decode row: query heads q[heads][hd] of a token at
 * position len - 1 over the rounded entries k, v [len][KV_HEADS][hd]; worst error of `got`. */
static double reference_err(const float *q, const float *k, const float *v, int len, int heads, int hd, int window,
                            const float *got)
{
    const int group = heads / KV_HEADS, p = len - 1;
    double worst = 0, *w = malloc(sizeof(double) * (size_t)len);
    for (int h = 0; h < heads; h++) {
        const int g = h / group, lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
        double mx = -1e300, z = 0;
        for (int j = lo; j <= p; j++) {
            double dot = 0;
            for (int e = 0; e < hd; e++) dot += (double)q[h * hd + e] * k[((size_t)j * KV_HEADS + g) * hd + e];
            w[j] = dot / sqrt((double)hd);
            mx = w[j] > mx ? w[j] : mx;
        }
        for (int j = lo; j <= p; j++) z += w[j] = exp(w[j] - mx);
        for (int e = 0; e < hd; e++) {
            double r = 0;
            for (int j = lo; j <= p; j++) r += w[j] / z * v[((size_t)j * KV_HEADS + g) * hd + e];
            worst = kt_worst(worst, fabs(r - got[h * hd + e]));
        }
    }
    free(w);
    return worst;
}

static void check_batches(kr_backend *b, kr_dtype dt, int group, int hd, int window)
{
    char err[KR_ERR_MAX];
    const int heads = group * KV_HEADS;
    const size_t row = (size_t)heads * hd; /* floats of one token's q or output */
    int len[N_SEQS], total = 0;
    for (int i = 0; i < N_SEQS; i++) total += len[i] = seq_len(i);
    kr_kv_pool *pool;
    REQUIRE(kr_kv_pool_create(hd, BLOCK, 2 * (total / BLOCK + N_SEQS), dt, &pool, err) == KR_OK, "%s", err);

    /* every sequence grows by FILL entries per round, so their blocks alternate in the pool */
    kr_seq *seqs[N_SEQS];
    float *k[N_SEQS], *v[N_SEQS]; /* [len][KV_HEADS][hd], rounded to dt as the pool holds them */
    int32_t *pos = malloc(sizeof(int32_t) * 1024);
    for (int i = 0; i < 1024; i++) pos[i] = i;
    for (int i = 0; i < N_SEQS; i++) {
        REQUIRE(kr_seq_create(pool, 1, KV_HEADS, &seqs[i], err) == KR_OK, "%s", err);
        size_t n = (size_t)len[i] * KV_HEADS * hd;
        k[i] = malloc(sizeof(float) * n), v[i] = malloc(sizeof(float) * n);
        for (size_t x = 0; x < n; x++) k[i][x] = frand() * 2, v[i][x] = frand();
    }
    for (int done = 0; done < 1024; done += FILL)
        for (int i = 0; i < N_SEQS; i++) {
            int n = len[i] - done < FILL ? len[i] - done : FILL;
            if (n <= 0) continue;
            REQUIRE(kr_seq_grow(seqs[i], n, err) == KR_OK, "%s", err);
            for (int g = 0; g < KV_HEADS; g++) kr_seq_list(seqs[i], 0, g)->len = done + n;
            const size_t at = (size_t)done * KV_HEADS * hd;
            ops->kv_store(b, seqs[i], 0, k[i] + at, v[i] + at, n, pos + done);
        }
    for (int i = 0; i < N_SEQS; i++) {
        size_t n = (size_t)len[i] * KV_HEADS * hd;
        void *tmp = malloc(n * sizeof(float));
        kr_dtype_from_f32(dt, k[i], n, tmp), kr_dtype_to_f32(dt, tmp, n, k[i]);
        kr_dtype_from_f32(dt, v[i], n, tmp), kr_dtype_to_f32(dt, tmp, n, v[i]);
        free(tmp);
    }

    /* each sequence alone: the one-token attention op, against the reference */
    float *q = malloc(sizeof(float) * N_SEQS * row), *alone = malloc(sizeof(float) * N_SEQS * row);
    for (size_t x = 0; x < N_SEQS * row; x++) q[x] = frand() * 2;
    double worst = 0;
    for (int i = 0; i < N_SEQS; i++) {
        ops->attention(b, seqs[i], 0, q + i * row, 1, heads, pos + len[i] - 1, window, alone + i * row);
        worst = kt_worst(worst, reference_err(q + i * row, k[i], v[i], len[i], heads, hd, window, alone + i * row));
    }
    CHECK(worst < 1e-5, "%s group %d hd %d window %d: one-token rows off the reference by %.3g", kr_dtype_name(dt),
          group, hd, window, worst);

    /* batches of n: sequences n, n+1, ... (mod N_SEQS), so the sets and the orders vary */
    const kr_seq *batch[N_SEQS];
    int32_t bpos[N_SEQS];
    float *bq = malloc(sizeof(float) * N_SEQS * row), *out = malloc(sizeof(float) * N_SEQS * row);
    int bad = 0, nan = 0, first_n = 0, first_r = 0;
    for (int n = 1; n <= N_SEQS; n++) {
        for (int r = 0; r < n; r++) {
            int i = (r + n) % N_SEQS;
            batch[r] = seqs[i];
            bpos[r] = len[i] - 1;
            memcpy(bq + r * row, q + i * row, sizeof(float) * row);
        }
        ops->attention_batch(b, batch, 0, bq, n, heads, bpos, window, out);
        nan |= has_nan(out, n * row);
        for (int r = 0; r < n; r++)
            if (memcmp(out + r * row, alone + (size_t)((r + n) % N_SEQS) * row, sizeof(float) * row) && bad++ == 0)
                first_n = n, first_r = r;
    }
    CHECK(!nan && !has_nan(alone, N_SEQS * row), "%s group %d hd %d window %d: NaN in the output", kr_dtype_name(dt),
          group, hd, window);
    CHECK(bad == 0, "%s group %d hd %d window %d, %d threads: %d batched rows differ from the sequence alone, first row %d of %d",
          kr_dtype_name(dt), group, hd, window, ops->n_threads(b), bad, first_r, first_n);

    free(bq), free(out), free(q), free(alone), free(pos);
    for (int i = 0; i < N_SEQS; i++) kr_seq_free(seqs[i]), free(k[i]), free(v[i]);
    kr_kv_pool_free(pool);
}

int main(void)
{
    static const struct { int group, hd; } shapes[] = {{1, 64}, {3, 64}, {4, 64}, {1, 80}, {3, 80}, {4, 80},
                                                     {8, 64}, {5, 33}};
    static const kr_dtype dts[] = {KR_DTYPE_F32, KR_DTYPE_BF16, KR_DTYPE_F16};
    int ran = 0;
    for (const char *const *isa = (const char *const[]){"avx512bf16", "avx512", "avx2", "base", NULL}; *isa; isa++) {
        if (!kr_cpu_isa_supported(*isa)) {
            printf("test_attention_batch: this CPU does not run the %s variant: skipped\n", *isa);
            continue;
        }
        ops = kr_cpu_backend_variant(*isa);
        REQUIRE(ops, "no %s variant", *isa);
        printf("test_attention_batch: the %s variant\n", *isa);
        for (int threads = 1; threads <= 2; threads++)
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                char err[KR_ERR_MAX];
                const int heads = shapes[s].group * KV_HEADS;
                kr_model m = kr_test_model_shell(heads * shapes[s].hd, 64, heads, KV_HEADS, shapes[s].hd);
                kr_backend *b;
                REQUIRE(ops->create(&m, threads, 64, &b, err) == KR_OK, "%s", err);
                for (int t = 0; t < 3; t++)
                    for (int window = 0; window <= WINDOW; window += WINDOW)
                        check_batches(b, dts[t], shapes[s].group, shapes[s].hd, window);
                ops->destroy(b);
            }
        ran++;
    }
    CHECK(ran >= 1, "no variant of the CPU backend runs here");
    return kt_done("test_attention_batch");
}
