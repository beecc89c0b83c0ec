/*
 * test_backend_ops.c - every op of the CUDA backend against the CPU backend (the reference
 * test_ops.c checks against double precision) on the same inputs, in the manner of ggml's
 * test-backend-ops: embed, rmsnorm, matmul, matmul_rows, swiglu, rope, kv_store, attention,
 * attention_batch, score, score_past. Weights come from kr_model_random (bf16); the CUDA side's
 * inputs are uploaded from the very host arrays the CPU side reads, so only the ops differ.
 *
 * Every output buffer (device and host) has GUARD floats of a NaN sentinel on each side that
 * must survive the op; outputs must be finite; the cache ops must leave other lists, other
 * layers and other sequences alone.
 *
 * Error budgets, CUDA vs CPU (u = 2^-8, the unit roundoff of bf16's 8-bit significand; the CPU
 * upcasts bf16 weights exactly and keeps activations f32; the CUDA backend rounds a GEMM's
 * activations to bf16 too and accumulates in f32):
 *
 *   op                 budget per element                          why
 *   embed, kv_store    exact (bit-equal)                           upcast / copy
 *   rmsnorm            1e-5 |ref| + 1e-5                           f32, another sum order
 *   swiglu             1e-5 |ref| + 1e-6                           f32 exp vs fast exp
 *   rope               1e-6 |ref| + 1e-6                           f32 fma
 *   matmul(_rows)      8u sqrt(sum_k (x_k w_k)^2) + 2^-20 (sum_k   each product off by <= u
 *                      |x_k w_k| + |y0| + |bias|)                  relative (x rounded), errors
 *                                                                  of random sign: a sqrt(K)
 *                                                                  walk, so about u sqrt(K)
 *                                                                  relative to a typical output;
 *                                                                  the CPU backend with x
 *                                                                  rounded to bf16 stays within
 *                                                                  a quarter of this budget here
 *   attention(_batch)  1e-2 max|ref| of the (token, head) row      softmax weights ~1e-2
 *                                                                  relative if scores are
 *                                                                  rounded (brief: 1e-2)
 *   score, score_past  1e-2 |ref| + 1e-6 n_obs; each observer's    sums of probabilities
 *                      row sums to 1 (total n_obs within 1e-3)
 *
 * And the contracts that are bit-exact on any backend: matmul_rows row i equals a one-row call
 * on row i; attention_batch row i equals a one-token attention call on seqs[i]; entries that
 * no observer sees score exactly 0.
 *
 * Shapes: GQA 1/4/8, head dims 64/128, odd hidden and FFN sizes, block sizes 7/16/32, lists of
 * 1, 17, 300, 4096 and 32768 entries, chunks 1/7/64, windows off and on, lists with off > 0
 * and a different length per KV head, decode batches of sequences of different lengths.
 * Skips (77) without the CUDA backend or without a usable device.
 */
#include "kt_cuda.h"

#ifdef KT_CUDA
#include "kr-util.h"

#include <stdint.h>

enum { GUARD = 64 }; /* floats of sentinel each side of every output */
static const uint32_t SENTINEL = 0x7fc0beefu; /* a quiet NaN no op produces */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1.0p-52 - 1.0);
}

static float sentinel(void)
{
    float f;
    memcpy(&f, &SENTINEL, sizeof f);
    return f;
}
static int is_sentinel(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u == SENTINEL;
}

/* the model and the two backends under test */
typedef struct env {
    const char *name;
    kr_model *m;
    const kr_config *cfg;
    kr_backend *gb, *cb;
    int bs; /* KV block size */
} env;

static const kr_backend_ops *const GPU = &kr_cuda_backend, *const CPU = &kr_cpu_backend;
enum { MAX_CHUNK = 64 };

/* ------------------------------------------------------------------ guarded buffers */

static float *host_new(size_t n)
{
    float *b = malloc(sizeof(float) * (n + 2 * GUARD));
    REQUIRE(b, "out of memory");
    for (size_t i = 0; i < n + 2 * GUARD; i++) b[i] = sentinel();
    return b + GUARD;
}
static void guards_check(const float *lo, const float *hi, const char *what)
{
    int bad = 0;
    for (int i = 0; i < GUARD; i++) bad += !is_sentinel(lo[i]) + !is_sentinel(hi[i]);
    CHECK(bad == 0, "%s: %d guard floats overwritten", what, bad);
}
static void host_free(float *p, size_t n, const char *what)
{
    guards_check(p - GUARD, p + n, what);
    free(p - GUARD);
}

/* cudaMemcpy from pageable memory may return before the data reaches the device, and the
 * backend's stream does not wait for the legacy stream (cudaStreamNonBlocking): synchronize */
static void dev_put(float *d, const float *h, size_t n)
{
    KT_CUDA_REQUIRE(cudaMemcpy(d, h, sizeof(float) * n, cudaMemcpyHostToDevice));
    KT_CUDA_REQUIRE(cudaDeviceSynchronize());
}
static float *dev_new(env *e, size_t n)
{
    float *base = GPU->act_alloc(e->gb, n + 2 * GUARD);
    REQUIRE(base, "act_alloc of %zu floats failed", n + 2 * GUARD);
    float *h = host_new(n);
    dev_put(base, h - GUARD, n + 2 * GUARD);
    free(h - GUARD);
    return base + GUARD;
}
static float *dev_get(env *e, const float *d, size_t n) /* a host copy (plain malloc) */
{
    float *h = malloc(sizeof(float) * (n ? n : 1));
    REQUIRE(h, "out of memory");
    GPU->to_host(e->gb, d, n, h);
    return h;
}
static void dev_free(env *e, float *d, size_t n, const char *what)
{
    float lo[GUARD], hi[GUARD];
    GPU->to_host(e->gb, d - GUARD, GUARD, lo);
    GPU->to_host(e->gb, d + n, GUARD, hi);
    guards_check(lo, hi, what);
    GPU->act_free(e->gb, d - GUARD);
}

static float *rand_host(size_t n, float scale)
{
    float *h = malloc(sizeof(float) * (n ? n : 1));
    REQUIRE(h, "out of memory");
    for (size_t i = 0; i < n; i++) h[i] = frand() * scale;
    return h;
}

/* ------------------------------------------------------------------ comparison */

/* got against ref within tol[i] (or atol + rtol |ref| when tol is NULL); where ref holds the
 * sentinel (the CPU left it), got must too. Non-finite values always fail. */
static void compare(const char *what, const float *got, const float *ref, size_t n, const double *tol,
                    double atol, double rtol)
{
    size_t bad = 0, nonfinite = 0, at = 0;
    double worst = 0; /* err / budget */
    for (size_t i = 0; i < n; i++) {
        if (is_sentinel(ref[i])) {
            if (!is_sentinel(got[i])) bad++, at = i, worst = INFINITY;
            continue;
        }
        if (!isfinite(got[i]) || !isfinite(ref[i])) {
            nonfinite++, at = i, worst = INFINITY;
            continue;
        }
        double t = tol ? tol[i] : atol + rtol * fabs((double)ref[i]);
        double err = fabs((double)got[i] - (double)ref[i]);
        if (err > t) bad++;
        double r = t > 0 ? err / t : (err > 0 ? INFINITY : 0);
        if (r > worst) worst = r, at = i;
    }
    CHECK(bad == 0 && nonfinite == 0,
          "%s: %zu of %zu outside the budget, %zu non-finite; worst at %zu: got %.9g, ref %.9g", what,
          bad, n, nonfinite, at, (double)got[at], (double)ref[at]);
    printf("  %-64s err/budget %.3g\n", what, worst);
}

static void compare_bits(const char *what, const float *a, const float *b, size_t n)
{
    size_t bad = 0, at = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float))) bad++, at = i;
    CHECK(bad == 0, "%s: %zu of %zu floats differ in bits (last at %zu: %.9g vs %.9g)", what, bad, n,
          at, (double)a[at], (double)b[at]);
}

/* ------------------------------------------------------------------ model */

static void env_open(env *e, const char *name, int d, int f, int heads, int kv_heads, int head_dim, int vocab,
                     int bias, int bs)
{
    char err[KR_ERR_MAX];
    kr_config c;
    memset(&c, 0, sizeof c);
    c.arch = KR_ARCH_LLAMA;
    snprintf(c.arch_name, sizeof c.arch_name, "LlamaForCausalLM");
    c.vocab_size = vocab;
    c.hidden_size = d;
    c.intermediate_size = f;
    c.n_layers = 2;
    c.n_heads = heads;
    c.n_kv_heads = kv_heads;
    c.head_dim = head_dim;
    c.max_position_embeddings = 65536;
    c.rope_theta = 10000.0f;
    c.rms_norm_eps = 1e-5f;
    c.attn_bias = bias;
    c.bos_token_id = c.eos_token_id = -1;
    c.torch_dtype = KR_DTYPE_BF16;
    e->name = name;
    e->bs = bs;
    REQUIRE(kr_model_random(&c, KR_DTYPE_BF16, 42, &e->m, err) == KR_OK, "%s: %s", name, err);
    e->cfg = kr_model_config(e->m);
    /* kr_model_random makes every norm weight 1: make them differ, so that a kernel reading the
     * wrong element shows (the model owns these buffers; both backends see them after this) */
    for (int l = 0; l < c.n_layers; l++) {
        float *an = (float *)e->m->layers[l].attn_norm.data, *fn = (float *)e->m->layers[l].ffn_norm.data;
        for (int i = 0; i < d; i++) an[i] = 1 + 0.5f * frand(), fn[i] = 1 + 0.5f * frand();
    }
    REQUIRE(GPU->create(e->m, 1, MAX_CHUNK, &e->gb, err) == KR_OK, "%s: CUDA create: %s", name, err);
    REQUIRE(CPU->create(e->m, 4, MAX_CHUNK, &e->cb, err) == KR_OK, "%s: CPU create: %s", name, err);
    printf("%s: d %d, f %d, heads %d/%d, head_dim %d, vocab %d, bias %d, block %d\n", name, d, f, heads,
           kv_heads, head_dim, vocab, bias, bs);
}

static void env_close(env *e)
{
    GPU->destroy(e->gb);
    CPU->destroy(e->cb);
    kr_model_free(e->m);
}

/* ------------------------------------------------------------------ weight and element-wise ops */

static void test_embed(env *e, int n)
{
    int d = e->cfg->hidden_size;
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        tok[i] = i == 0 ? 0 : i == 1 ? e->cfg->vocab_size - 1 : (int32_t)((frand() + 1) * 0.5 * e->cfg->vocab_size) % e->cfg->vocab_size;
    size_t cnt = (size_t)n * d;
    float *xd = dev_new(e, cnt), *ref = host_new(cnt);
    GPU->embed(e->gb, &e->m->embed, tok, n, xd);
    CPU->embed(e->cb, &e->m->embed, tok, n, ref);
    float *got = dev_get(e, xd, cnt);
    char what[128];
    snprintf(what, sizeof what, "%s embed n %d", e->name, n);
    compare_bits(what, got, ref, cnt);
    dev_free(e, xd, cnt, what);
    host_free(ref, cnt, what);
    free(got), free(tok);
}

static void test_rmsnorm(env *e, int n, int in_place)
{
    int d = e->cfg->hidden_size;
    size_t cnt = (size_t)n * d;
    float *x = rand_host(cnt, 3), *ref = host_new(cnt);
    const kr_tensor *w = &e->m->layers[1].ffn_norm;
    float *xd = dev_new(e, cnt), *yd = in_place ? xd : dev_new(e, cnt);
    dev_put(xd, x, cnt);
    GPU->rmsnorm(e->gb, xd, w, n, d, e->cfg->rms_norm_eps, yd);
    CPU->rmsnorm(e->cb, x, w, n, d, e->cfg->rms_norm_eps, ref);
    float *got = dev_get(e, yd, cnt);
    char what[128];
    snprintf(what, sizeof what, "%s rmsnorm n %d%s", e->name, n, in_place ? " in place" : "");
    compare(what, got, ref, cnt, NULL, 1e-5, 1e-5);
    if (!in_place) dev_free(e, yd, cnt, what);
    dev_free(e, xd, cnt, what);
    host_free(ref, cnt, what);
    free(got), free(x);
}

static void test_swiglu(env *e, size_t count)
{
    float *g = rand_host(count, 12), *u = rand_host(count, 2), *ref = host_new(count);
    memcpy(ref, g, sizeof(float) * count);
    float *gd = dev_new(e, count), *ud = dev_new(e, count);
    dev_put(gd, g, count), dev_put(ud, u, count);
    GPU->swiglu(e->gb, gd, ud, count);
    CPU->swiglu(e->cb, ref, u, count);
    float *got = dev_get(e, gd, count), *u_after = dev_get(e, ud, count);
    char what[128];
    snprintf(what, sizeof what, "%s swiglu count %zu", e->name, count);
    compare(what, got, ref, count, NULL, 1e-6, 1e-5);
    compare_bits("swiglu leaves u alone", u_after, u, count);
    dev_free(e, gd, count, what), dev_free(e, ud, count, what);
    host_free(ref, count, what);
    free(got), free(u_after), free(g), free(u);
}

static void test_rope(env *e, int n, int heads)
{
    int hd = e->cfg->head_dim, half = hd / 2;
    size_t cnt = (size_t)n * heads * hd;
    float *x = rand_host(cnt, 4), *ref = host_new(cnt), *cs = malloc(sizeof(float) * (size_t)n * half * 2);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < half; i++) {
            double a = (1000.0 + t) * pow(10000.0, -2.0 * i / hd);
            cs[((size_t)t * half + i) * 2] = (float)cos(a), cs[((size_t)t * half + i) * 2 + 1] = (float)sin(a);
        }
    memcpy(ref, x, sizeof(float) * cnt);
    float *xd = dev_new(e, cnt);
    dev_put(xd, x, cnt);
    GPU->rope(e->gb, xd, n, heads, hd, cs);
    CPU->rope(e->cb, ref, n, heads, hd, cs);
    float *got = dev_get(e, xd, cnt);
    char what[128];
    snprintf(what, sizeof what, "%s rope n %d heads %d", e->name, n, heads);
    compare(what, got, ref, cnt, NULL, 1e-6, 1e-6);
    dev_free(e, xd, cnt, what);
    host_free(ref, cnt, what);
    free(got), free(x), free(cs);
}

static double weight_at(const kr_tensor *w, size_t i)
{
    switch (w->dtype) {
    case KR_DTYPE_BF16: return kr_bf16_to_f32(((const uint16_t *)w->data)[i]);
    case KR_DTYPE_F16: return kr_f16_to_f32(((const uint16_t *)w->data)[i]);
    default: return ((const float *)w->data)[i];
    }
}

/* matmul or matmul_rows of weight `w` (a model tensor: the CUDA backend finds its device copy by
 * the host pointer) on n rows; rows = 1 also checks the one-row identity of matmul_rows. */
static void test_matmul(env *e, const char *wname, const kr_tensor *w, const kr_tensor *bias, int n,
                        int accumulate, int rows)
{
    int in = (int)w->cols, out = (int)w->rows;
    size_t nx = (size_t)n * in, ny = (size_t)n * out;
    float *x = rand_host(nx, 2), *y0 = rand_host(ny, 4), *ref = host_new(ny);
    memcpy(ref, y0, sizeof(float) * ny);
    float *xd = dev_new(e, nx), *yd = dev_new(e, ny);
    dev_put(xd, x, nx), dev_put(yd, y0, ny);
    (rows ? GPU->matmul_rows : GPU->matmul)(e->gb, w, bias, xd, n, accumulate, yd);
    (rows ? CPU->matmul_rows : CPU->matmul)(e->cb, w, bias, x, n, accumulate, ref);
    float *got = dev_get(e, yd, ny);
    double *tol = calloc(ny, sizeof(double));
    const double u = 0x1.0p-8;
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double sq = 0, ab = 0;
            for (int k = 0; k < in; k++) {
                double p = (double)x[(size_t)t * in + k] * weight_at(w, (size_t)o * in + k);
                sq += p * p, ab += fabs(p);
            }
            ab += (accumulate ? fabs(y0[(size_t)t * out + o]) : 0) + (bias ? fabs(((const float *)bias->data)[o]) : 0);
            tol[(size_t)t * out + o] = 8 * u * sqrt(sq) + 0x1.0p-20 * ab;
        }
    char what[160];
    snprintf(what, sizeof what, "%s %s %s n %d acc %d bias %d", e->name, rows ? "matmul_rows" : "matmul", wname, n,
             accumulate, bias != NULL);
    compare(what, got, ref, ny, tol, 0, 0);
    if (rows && n > 1) { /* row r alone gives the same bits as row r of the batch */
        const int pick[3] = {0, n / 2, n - 1};
        for (int k = 0; k < 3; k++) {
            int r = pick[k];
            float *x1 = dev_new(e, (size_t)in), *y1 = dev_new(e, (size_t)out);
            dev_put(x1, x + (size_t)r * in, (size_t)in), dev_put(y1, y0 + (size_t)r * out, (size_t)out);
            GPU->matmul_rows(e->gb, w, bias, x1, 1, accumulate, y1);
            float *one = dev_get(e, y1, (size_t)out);
            char w1[200];
            snprintf(w1, sizeof w1, "%s: row %d alone", what, r);
            compare_bits(w1, one, got + (size_t)r * out, (size_t)out);
            dev_free(e, x1, (size_t)in, w1), dev_free(e, y1, (size_t)out, w1);
            free(one);
        }
    }
    dev_free(e, xd, nx, what), dev_free(e, yd, ny, what);
    host_free(ref, ny, what);
    free(tol), free(got), free(x), free(y0);
}

static void test_weights(env *e)
{
    const kr_layer_weights *L = &e->m->layers[1];
    const kr_tensor *bq = L->bq.data ? &L->bq : NULL, *bk = L->bk.data ? &L->bk : NULL;
    const int ns[] = {1, 7, 64};
    for (int i = 0; i < 3; i++) {
        int n = ns[i];
        test_embed(e, n);
        test_rmsnorm(e, n, 0);
        test_rmsnorm(e, n, 1);
        test_rope(e, n, e->cfg->n_heads);
        test_rope(e, n, e->cfg->n_kv_heads);
        test_swiglu(e, (size_t)n * e->cfg->intermediate_size);
        for (int rows = 0; rows < 2; rows++) {
            test_matmul(e, "wq", &L->wq, bq, n, 0, rows);
            test_matmul(e, "wk", &L->wk, bk, n, 0, rows);
            test_matmul(e, "wo", &L->wo, NULL, n, 1, rows);
            test_matmul(e, "w_gate", &L->w_gate, NULL, n, 0, rows);
            test_matmul(e, "w_down", &L->w_down, NULL, n, 1, rows);
            test_matmul(e, "lm_head", &e->m->lm_head, NULL, n, 0, rows);
        }
    }
}

/* ------------------------------------------------------------------ cache ops */

/* Fills list (layer, g) of s with `total` random entries at positions 0..total-1, then drops
 * the oldest `drop` (off > 0 when drop is no multiple of the block size). */
static void fill_list(kr_seq *s, int layer, int g, int total, int drop)
{
    char err[KR_ERR_MAX];
    int hd = s->pool->head_dim;
    REQUIRE(kr_seq_grow_list(s, layer, g, total, err) == KR_OK, "%s", err);
    float *k = malloc(sizeof(float) * (size_t)hd), *v = malloc(sizeof(float) * (size_t)hd);
    kr_kv_list *l = kr_seq_list(s, layer, g);
    l->len = total;
    for (int i = 0; i < total; i++) {
        for (int j = 0; j < hd; j++) k[j] = frand() * 2, v[j] = frand();
        kr_seq_put(s, layer, g, i, k, v, i);
    }
    if (drop) kr_seq_keep_ends(s, layer, g, 0, total - drop);
    free(k), free(v);
}

/* a sequence whose layer-1 lists hold `total` positions minus drop[g] oldest ones per KV head
 * (drop NULL: none); layer 0 holds other data, so a kernel reading the wrong layer shows */
static kr_seq *make_seq(env *e, kr_kv_pool *pool, int total, const int *drop)
{
    char err[KR_ERR_MAX];
    kr_seq *s;
    REQUIRE(kr_seq_create(pool, e->cfg->n_layers, e->cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    for (int g = 0; g < e->cfg->n_kv_heads; g++) {
        fill_list(s, 0, g, total / 2 + 1, 0);
        fill_list(s, 1, g, total, drop ? drop[g] : 0);
    }
    s->next_pos = total;
    KT_CUDA_REQUIRE(cudaDeviceSynchronize());
    return s;
}

static kr_kv_pool *make_pool(env *e, int n_seqs, int total)
{
    int blocks_per_list = total / e->bs + 2;
    int n = n_seqs * e->cfg->n_layers * e->cfg->n_kv_heads * blocks_per_list + 16;
    return kt_cuda_pool_create(e->gb, e->cfg->head_dim, e->bs, n);
}

/* drop pattern: head g loses (g * 5 + 3) % (total - keep_min + 1) oldest entries, so lengths and
 * offsets differ per head and every list keeps at least keep_min */
static int *drops_for(env *e, int total, int keep_min)
{
    int *d = calloc((size_t)e->cfg->n_kv_heads, sizeof(int));
    for (int g = 0; g < e->cfg->n_kv_heads; g++) d[g] = (g * 5 + 3) % (total - keep_min + 1);
    return d;
}

/* one list's entries: positions, keys, values */
typedef struct snap {
    int len, n;
    int32_t *pos;
    float *kv;
} snap;
static snap snap_take(const kr_seq *s, int layer, int g)
{
    char err[KR_ERR_MAX];
    snap r;
    int hd = s->pool->head_dim;
    kr_seq_list_shape(s, layer, g, &r.len, NULL);
    r.n = r.len * hd;
    r.pos = malloc(sizeof(int32_t) * (size_t)(r.len + 1));
    r.kv = malloc(sizeof(float) * (size_t)(2 * r.n + 1));
    REQUIRE(kr_seq_list_read(s, layer, g, 0, r.len, r.pos, r.kv, r.kv + r.n, err) == KR_OK, "%s", err);
    return r;
}
static void snap_same(const char *what, snap a, snap b)
{
    CHECK(a.len == b.len, "%s: lengths %d vs %d", what, a.len, b.len);
    if (a.len != b.len) return;
    CHECK(!memcmp(a.pos, b.pos, sizeof(int32_t) * (size_t)a.len), "%s: positions differ", what);
    compare_bits(what, a.kv, b.kv, (size_t)2 * a.n);
}
static void snap_free(snap a)
{
    free(a.pos), free(a.kv);
}

/* kv_store of n entries into layer 1 of two equal sequences (CPU into one, CUDA into the other),
 * whose lists held `total` entries minus per-head drops; a third sequence in the pool and layer 0
 * must not change */
static void test_kv_store(env *e, int total, int n, int dropping)
{
    char err[KR_ERR_MAX];
    int kvh = e->cfg->n_kv_heads, hd = e->cfg->head_dim;
    kr_kv_pool *pool = make_pool(e, 3, total + n);
    int *drop = dropping ? drops_for(e, total, 1) : NULL;
    uint64_t seed = rng;
    kr_seq *sc = make_seq(e, pool, total, drop);
    rng = seed;
    kr_seq *sg = make_seq(e, pool, total, drop);
    kr_seq *other = make_seq(e, pool, total, NULL);
    snap before[64];
    for (int g = 0; g < kvh && g < 32; g++) before[g] = snap_take(other, 1, g), before[32 + g] = snap_take(sg, 0, g);
    REQUIRE(kr_seq_grow(sc, n, err) == KR_OK && kr_seq_grow(sg, n, err) == KR_OK, "%s", err);
    for (int g = 0; g < kvh; g++) kr_seq_list(sc, 1, g)->len += n, kr_seq_list(sg, 1, g)->len += n;
    size_t cnt = (size_t)n * kvh * hd;
    float *k = rand_host(cnt, 3), *v = rand_host(cnt, 1);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) pos[i] = total + i;
    float *kd = dev_new(e, cnt), *vd = dev_new(e, cnt);
    dev_put(kd, k, cnt), dev_put(vd, v, cnt);
    CPU->kv_store(e->cb, sc, 1, k, v, n, pos);
    GPU->kv_store(e->gb, sg, 1, kd, vd, n, pos);
    KT_CUDA_REQUIRE(cudaDeviceSynchronize());
    char what[160];
    snprintf(what, sizeof what, "%s kv_store total %d n %d drops %d", e->name, total, n, dropping);
    for (int g = 0; g < kvh; g++) {
        snap a = snap_take(sg, 1, g), b = snap_take(sc, 1, g);
        snap_same(what, a, b);
        snap_free(a), snap_free(b);
    }
    for (int g = 0; g < kvh && g < 32; g++) {
        snap a = snap_take(other, 1, g), b = snap_take(sg, 0, g);
        snap_same("kv_store leaves other sequences alone", a, before[g]);
        snap_same("kv_store leaves other layers alone", b, before[32 + g]);
        snap_free(a), snap_free(b), snap_free(before[g]), snap_free(before[32 + g]);
    }
    printf("  %-64s bit-equal\n", what);
    dev_free(e, kd, cnt, what), dev_free(e, vd, cnt, what);
    free(k), free(v), free(pos), free(drop);
    kr_seq_free(sc), kr_seq_free(sg), kr_seq_free(other);
    kr_kv_pool_free(pool);
}

/* budget of attention outputs: 1e-2 of the largest |ref| of each (token, head) row */
static double *attention_tol(const float *ref, size_t rows, int hd)
{
    double *tol = calloc(rows * (size_t)hd, sizeof(double));
    for (size_t r = 0; r < rows; r++) {
        double mx = 0;
        for (int i = 0; i < hd; i++) mx = fmax(mx, fabs((double)ref[r * hd + i]));
        for (int i = 0; i < hd; i++) tol[r * hd + i] = 1e-2 * mx + 1e-7;
    }
    return tol;
}

/* attention of an n-token chunk (the newest n entries of every list) */
static void test_attention(env *e, int total, int n, int window, int dropping)
{
    int heads = e->cfg->n_heads, hd = e->cfg->head_dim;
    kr_kv_pool *pool = make_pool(e, 1, total);
    int *drop = dropping ? drops_for(e, total, n) : NULL;
    kr_seq *s = make_seq(e, pool, total, drop);
    size_t cnt = (size_t)n * heads * hd;
    float *q = rand_host(cnt, 2), *ref = host_new(cnt);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) pos[i] = total - n + i;
    float *qd = dev_new(e, cnt), *od = dev_new(e, cnt);
    dev_put(qd, q, cnt);
    GPU->attention(e->gb, s, 1, qd, n, heads, pos, window, od);
    CPU->attention(e->cb, s, 1, q, n, heads, pos, window, ref);
    float *got = dev_get(e, od, cnt), *q_after = dev_get(e, qd, cnt);
    double *tol = attention_tol(ref, (size_t)n * heads, hd);
    char what[160];
    snprintf(what, sizeof what, "%s attention len %d n %d window %d off %d", e->name, total, n, window,
             kr_seq_list(s, 1, e->cfg->n_kv_heads - 1)->off);
    compare(what, got, ref, cnt, tol, 0, 0);
    compare_bits("attention leaves q alone", q_after, q, cnt);
    dev_free(e, qd, cnt, what), dev_free(e, od, cnt, what);
    host_free(ref, cnt, what);
    free(tol), free(got), free(q_after), free(q), free(pos), free(drop);
    kr_seq_free(s);
    kr_kv_pool_free(pool);
}

/* a decode batch over sequences of the given lengths (odd-indexed ones with per-head drops) */
static void test_attention_batch(env *e, const int *lens, int n, int window)
{
    int heads = e->cfg->n_heads, hd = e->cfg->head_dim, most = 0;
    for (int i = 0; i < n; i++) most = lens[i] > most ? lens[i] : most;
    kr_kv_pool *pool = make_pool(e, n, most);
    kr_seq **seqs = malloc(sizeof(kr_seq *) * (size_t)n);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
        int *drop = (i & 1) ? drops_for(e, lens[i], 1) : NULL;
        seqs[i] = make_seq(e, pool, lens[i], drop);
        pos[i] = lens[i] - 1;
        free(drop);
    }
    size_t row = (size_t)heads * hd, cnt = (size_t)n * row;
    float *q = rand_host(cnt, 2), *ref = host_new(cnt);
    float *qd = dev_new(e, cnt), *od = dev_new(e, cnt);
    dev_put(qd, q, cnt);
    GPU->attention_batch(e->gb, (const kr_seq *const *)seqs, 1, qd, n, heads, pos, window, od);
    CPU->attention_batch(e->cb, (const kr_seq *const *)seqs, 1, q, n, heads, pos, window, ref);
    float *got = dev_get(e, od, cnt);
    double *tol = attention_tol(ref, (size_t)n * heads, hd);
    char what[160];
    snprintf(what, sizeof what, "%s attention_batch n %d (longest %d) window %d", e->name, n, most, window);
    compare(what, got, ref, cnt, tol, 0, 0);
    for (int i = 0; i < n; i++) { /* row i equals attention on seqs[i] alone, bit for bit */
        float *o1 = dev_new(e, row);
        GPU->attention(e->gb, seqs[i], 1, qd + i * row, 1, heads, &pos[i], window, o1);
        float *one = dev_get(e, o1, row);
        char w1[200];
        snprintf(w1, sizeof w1, "%s: row %d (len %d) alone", what, i, lens[i]);
        compare_bits(w1, got + i * row, one, row);
        dev_free(e, o1, row, w1);
        free(one);
    }
    dev_free(e, qd, cnt, what), dev_free(e, od, cnt, what);
    host_free(ref, cnt, what);
    for (int i = 0; i < n; i++) kr_seq_free(seqs[i]);
    free(tol), free(got), free(q), free(seqs), free(pos);
    kr_kv_pool_free(pool);
}

/* score (n_hidden < 0) or score_past, per_head or averaged per KV head */
static void test_score(env *e, int total, int n_obs, int per_head, int n_hidden, int dropping)
{
    int heads = e->cfg->n_heads, kvh = e->cfg->n_kv_heads, hd = e->cfg->head_dim, group = heads / kvh;
    int keep_min = n_obs > n_hidden + 1 ? n_obs : n_hidden + 1;
    kr_kv_pool *pool = make_pool(e, 1, total);
    int *drop = dropping ? drops_for(e, total, keep_min) : NULL;
    kr_seq *s = make_seq(e, pool, total, drop);
    size_t cnt = (size_t)n_obs * heads * hd, stride = (size_t)total + 3;
    int rows = per_head ? heads : kvh;
    float *q = rand_host(cnt, 2), *qd = dev_new(e, cnt);
    dev_put(qd, q, cnt);
    float *got = host_new((size_t)rows * stride), *ref = host_new((size_t)rows * stride);
    if (n_hidden < 0) {
        GPU->score(e->gb, s, 1, qd, n_obs, heads, per_head, got, stride);
        CPU->score(e->cb, s, 1, q, n_obs, heads, per_head, ref, stride);
    } else {
        GPU->score_past(e->gb, s, 1, qd, n_obs, heads, per_head, n_hidden, got, stride);
        CPU->score_past(e->cb, s, 1, q, n_obs, heads, per_head, n_hidden, ref, stride);
    }
    char what[160];
    snprintf(what, sizeof what, "%s %s len %d obs %d per_head %d hidden %d drops %d", e->name,
             n_hidden < 0 ? "score" : "score_past", total, n_obs, per_head, n_hidden, dropping);
    compare(what, got, ref, (size_t)rows * stride, NULL, 1e-6 * n_obs, 1e-2);
    for (int r = 0; r < rows; r++) { /* each observer's probabilities sum to 1 */
        int g = per_head ? r / group : r, len;
        kr_seq_list_shape(s, 1, g, &len, NULL);
        double sum = 0;
        int hidden_nonzero = 0;
        for (int j = 0; j < len; j++) {
            sum += got[(size_t)r * stride + j];
            if (n_hidden > 0 && j >= len - n_hidden) hidden_nonzero += got[(size_t)r * stride + j] != 0.0f;
        }
        CHECK(fabs(sum - n_obs) <= 1e-3 * n_obs, "%s: row %d sums to %.6g, not %d", what, r, sum, n_obs);
        CHECK(hidden_nonzero == 0, "%s: row %d scores %d hidden entries", what, r, hidden_nonzero);
    }
    dev_free(e, qd, cnt, what);
    host_free(got, (size_t)rows * stride, what), host_free(ref, (size_t)rows * stride, what);
    free(q), free(drop);
    kr_seq_free(s);
    kr_kv_pool_free(pool);
}

static void test_cache(env *e, int long_case)
{
    test_kv_store(e, 0, 1, 0);
    test_kv_store(e, 17, 7, 1);
    test_kv_store(e, 300, 64, 1);

    const struct { int total, n, window, drops; } at[] = {
        {1, 1, 0, 0},      {17, 7, 0, 0},       {17, 1, 5, 1},     {17, 17, 0, 0},
        {300, 64, 0, 1},   {300, 7, 100, 1},    {300, 1, 0, 1},    {300, 64, 33, 0},
        {4096, 1, 0, 0},   {4096, 64, 0, 1},    {4096, 7, 1000, 1}, {4096, 1, 4096, 0},
    };
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) test_attention(e, at[i].total, at[i].n, at[i].window, at[i].drops);
    if (long_case) {
        test_attention(e, 32768, 1, 0, 0);
        test_attention(e, 32768, 7, 4096, 1);
    }
    const int lens[] = {1, 17, 300, 4096, 33, 2, 300};
    test_attention_batch(e, lens, 7, 0);
    test_attention_batch(e, lens, 7, 64);
    test_attention_batch(e, lens + 3, 1, 0);

    for (int per_head = 0; per_head < 2; per_head++) {
        test_score(e, 17, 1, per_head, -1, 0);
        test_score(e, 300, 7, per_head, -1, 1);
        test_score(e, 4096, 64, per_head, -1, 1);
        test_score(e, 300, 8, per_head, 0, 1);
        test_score(e, 300, 8, per_head, 8, 1);
        test_score(e, 4096, 16, per_head, 16, 0);
    }
}

int main(void)
{
    kt_cuda_skip_unless_usable();
    env e;
    /* GQA 1, head_dim 64, odd sizes, q/k/v biases, a block size that divides nothing */
    env_open(&e, "gqa1-hd64", 333, 517, 4, 4, 64, 1001, 1, 7);
    test_weights(&e);
    test_cache(&e, 0);
    env_close(&e);
    /* GQA 4, head_dim 128 */
    env_open(&e, "gqa4-hd128", 777, 2049, 8, 2, 128, 2003, 0, 16);
    test_weights(&e);
    test_cache(&e, 0);
    env_close(&e);
    /* GQA 8, head_dim 64 */
    env_open(&e, "gqa8-hd64", 1031, 1999, 16, 2, 64, 517, 0, 32);
    test_weights(&e);
    test_cache(&e, 0);
    env_close(&e);
    /* GQA 8, head_dim 128, the 32768-entry lists */
    env_open(&e, "gqa8-hd128", 1024, 1536, 8, 1, 128, 256, 0, 16);
    test_cache(&e, 1);
    env_close(&e);
    return kt_done("test_backend_ops");
}
#else
int main(void)
{
    kt_cuda_skip_unless_usable();
    return 0;
}
#endif
