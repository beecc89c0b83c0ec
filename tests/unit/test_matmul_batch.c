/*
 * test_matmul_batch.c - the decode matmul's batch invariance on the CPU backend: matmul_rows over
 * n = 1..33 tokens must give each token's row bit for bit what the one-token call gives, and so
 * must matmul below its GEMM switch (6 tokens), with 1 and 2 threads (which must agree with each
 * other too), with and without bias and accumulation, for f32, bf16 and f16 weights, on every
 * variant of the CPU backend this CPU runs (docs/engine.md, "Decode batches"). Shapes: the
 * kernels' vector and tile widths dividing them, and not (odd inputs, tails of every length).
 * Each one-token row is also held against a double-precision reference on the x the variant
 * multiplies (rounded to bf16 where bf16_x_min_tokens says so), which a NaN fails.
 * Run: ctest -R test_matmul_batch
 */
#include "kr_test.h"

#include "backend.h"
#include "kr-util.h"
#include "model_shell.h"

enum { MAX_N = 33, GEMM_ROWS = 6 };

static const kr_backend_ops *ops; /* the variant under test */

static uint64_t rng = 0x2545f4914f6cdd1dull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1.0p-52 - 1.0);
}

typedef struct mm_case {
    kr_tensor w, bias;
    const float *wf; /* the weights widened, for the reference */
    const float *x; /* [MAX_N][in] */
    const float *y0; /* [MAX_N][out]: what y holds before an accumulating call */
    int accumulate, with_bias;
} mm_case;

/* y[n][out] from one call of op over the first n tokens, y preset to y0 */
static void run(kr_backend *b, const mm_case *c, int rows_op, int n, float *y)
{
    const int out = (int)c->w.rows;
    memcpy(y, c->y0, sizeof(float) * (size_t)n * out);
    (rows_op ? ops->matmul_rows : ops->matmul)(b, &c->w, c->with_bias ? &c->bias : NULL, c->x, n,
                                               c->accumulate, y);
}

/* The one-token rows against the double reference: worst absolute error */
static double reference_error(const mm_case *c, const float *one)
{
    const int in = (int)c->w.cols, out = (int)c->w.rows;
    const int bf16_x = c->w.dtype == KR_DTYPE_BF16 && ops->bf16_x_min_tokens == 1;
    double worst = 0;
    for (int t = 0; t < MAX_N; t++)
        for (int o = 0; o < out; o++) {
            double r = (c->accumulate ? c->y0[t * out + o] : 0) + (c->with_bias ? ((const float *)c->bias.data)[o] : 0);
            for (int i = 0; i < in; i++) {
                float xi = c->x[t * in + i];
                if (bf16_x) xi = kr_bf16_to_f32(kr_f32_to_bf16(xi));
                r += (double)xi * c->wf[(size_t)o * in + i];
            }
            worst = kt_worst(worst, fabs(r - one[t * out + o]));
        }
    return worst;
}

static void check_case(kr_backend *b1, kr_backend *b2, const mm_case *c, const char *isa)
{
    const int in = (int)c->w.cols, out = (int)c->w.rows;
    float *one = malloc(sizeof(float) * MAX_N * out), *y = malloc(sizeof(float) * MAX_N * out);
    mm_case single = *c;
    /* each token alone, one thread: the rows every other call must reproduce */
    for (int t = 0; t < MAX_N; t++) {
        single.x = c->x + (size_t)t * in;
        single.y0 = c->y0 + (size_t)t * out;
        run(b1, &single, 1, 1, one + (size_t)t * out);
    }
    const double worst = reference_error(c, one);
    CHECK(worst < 2e-5 * sqrt((double)in), "%s %s in %d out %d: one-token rows err %.3g", isa,
          kr_dtype_name(c->w.dtype), in, out, worst);
    int bad = 0;
    for (int threads = 1; threads <= 2; threads++)
        for (int n = 1; n <= MAX_N; n++)
            for (int rows_op = 0; rows_op <= 1; rows_op++) {
                if (!rows_op && n >= GEMM_ROWS) continue; /* matmul's GEMM rounds its own way */
                run(threads == 1 ? b1 : b2, c, rows_op, n, y);
                if (memcmp(y, one, sizeof(float) * (size_t)n * out) && bad++ < 3)
                    CHECK(0, "%s %s in %d out %d bias %d acc %d: %s of %d tokens, %d threads differs from one-token calls",
                          isa, kr_dtype_name(c->w.dtype), in, out, c->with_bias, c->accumulate,
                          rows_op ? "matmul_rows" : "matmul", n, threads);
            }
    free(one);
    free(y);
}

static void check_shape(kr_backend *b1, kr_backend *b2, kr_dtype dt, int in, int out, const char *isa)
{
    const size_t es = kr_dtype_size(dt);
    void *w = malloc((size_t)in * out * es);
    float *wf = malloc(sizeof(float) * (size_t)in * out), *bias = malloc(sizeof(float) * out);
    float *x = malloc(sizeof(float) * MAX_N * in), *y0 = malloc(sizeof(float) * MAX_N * out);
    for (size_t i = 0; i < (size_t)in * out; i++) {
        float v = frand() * 0.1f;
        if (dt == KR_DTYPE_BF16) ((uint16_t *)w)[i] = kr_f32_to_bf16(v), wf[i] = kr_bf16_to_f32(((uint16_t *)w)[i]);
        else if (dt == KR_DTYPE_F16) ((uint16_t *)w)[i] = kr_f32_to_f16(v), wf[i] = kr_f16_to_f32(((uint16_t *)w)[i]);
        else ((float *)w)[i] = wf[i] = v;
    }
    for (int i = 0; i < out; i++) bias[i] = frand();
    for (int i = 0; i < MAX_N * in; i++) x[i] = frand();
    for (int i = 0; i < MAX_N * out; i++) y0[i] = frand();
    mm_case c = {.w = {.data = w, .dtype = dt, .rows = out, .cols = in},
                 .bias = {.data = bias, .dtype = KR_DTYPE_F32, .rows = 1, .cols = out},
                 .wf = wf, .x = x, .y0 = y0};
    for (int k = 0; k < 3; k++) { /* plain; bias; bias and accumulation */
        c.with_bias = k >= 1;
        c.accumulate = k == 2;
        check_case(b1, b2, &c, isa);
    }
    free(w), free(wf), free(bias), free(x), free(y0);
}

int main(void)
{
    char err[KR_ERR_MAX];
    /* the widest input sizes the backends' scratch */
    kr_model m = kr_test_model_shell(1037, 160, 2, 1, 16);
    int ran = 0;
    for (const char *const *isa = (const char *const[]){"avx512bf16", "avx512", "avx2", "base", NULL}; *isa; isa++) {
        if (!kr_cpu_isa_supported(*isa)) {
            printf("test_matmul_batch: this CPU does not run the %s variant: skipped\n", *isa);
            continue;
        }
        ops = kr_cpu_backend_variant(*isa);
        kr_backend *b1, *b2;
        REQUIRE(ops->create(&m, 1, MAX_N, &b1, err) == KR_OK, "%s", err);
        REQUIRE(ops->create(&m, 2, MAX_N, &b2, err) == KR_OK, "%s", err);
        const kr_dtype dts[] = {KR_DTYPE_F32, KR_DTYPE_BF16, KR_DTYPE_F16};
        for (int i = 0; i < 3; i++) {
            check_shape(b1, b2, dts[i], 96, 160, *isa); /* every width divides */
            check_shape(b1, b2, dts[i], 37, 19, *isa); /* none does */
            check_shape(b1, b2, dts[i], 1037, 35, *isa); /* long rows with every tail */
        }
        ops->destroy(b1);
        ops->destroy(b2);
        printf("test_matmul_batch: the %s variant\n", *isa);
        ran++;
    }
    CHECK(ran >= 1, "no variant of the CPU backend runs here");
    return kt_done("test_matmul_batch");
}
