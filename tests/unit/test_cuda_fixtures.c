/*
 * test_cuda_fixtures.c - the fixture models (tests/fixtures/models, read as test_fixtures.c
 * reads them) run through kr_ctx on the CUDA backend: logits at every stored prompt position
 * (one-shot prefill and chunks of 7) and at every greedy step within a bf16-scaled budget of
 * the stored references; the greedy token equal to the reference wherever the reference's
 * top-1/top-2 margin exceeds twice that budget (each of the two logits may move by the budget);
 * and a decode batch of every case at once giving rows bit-identical to decoding each alone
 * (kr_forward_batch's contract holds on every backend).
 *
 * Budget: the CUDA backend holds weights in bf16 and rounds each GEMM's activations to bf16
 * (u = 2^-8 unit roundoff), accumulating in f32. A GEMM output is then off by about u relative
 * (errors of random sign over K products); G = 7 n_layers + 1 GEMMs lie on a logit's path, their
 * errors adding in quadrature; a checkpoint in f32/f16 has its weights rounded to bf16 on upload
 * too, which doubles the variance of each product's error: budget = 6 u sqrt(G) rms(reference
 * row), times sqrt(2) for f32/f16 checkpoints; about 0.13 for the 4-layer bf16 model with logits
 * of rms 1 (the CPU engine matches them within 1e-4). The CPU backend with activations (and
 * f32/f16 weights) rounded to bf16 before every GEMM stays within half of it on every fixture.
 * Skips (77) without the CUDA backend or without a usable device.
 */
#include "fixture_io.h"
#include "kt_cuda.h"

#include "kr.h"

#ifdef KT_CUDA
static double worst_ratio; /* largest |diff| / budget seen, for the report */
static double weight_rounding = 1; /* sqrt(2) when the checkpoint's weights are rounded to bf16 */

static double budget(const kr_config *cfg, const float *ref_row)
{
    double ss = 0;
    for (int i = 0; i < cfg->vocab_size; i++) ss += (double)ref_row[i] * ref_row[i];
    return 6 * 0x1.0p-8 * weight_rounding * sqrt(7.0 * cfg->n_layers + 1) * sqrt(ss / cfg->vocab_size);
}

/* top-1 minus top-2 of a row */
static double margin(const float *x, int n)
{
    double a = -INFINITY, b = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > a) b = a, a = x[i];
        else if (x[i] > b) b = x[i];
    return a - b;
}

static void within(const kr_config *cfg, const float *got, const float *ref, const char *what)
{
    double tol = budget(cfg, ref), d = max_diff(got, ref, cfg->vocab_size);
    double r = d / tol;
    worst_ratio = r > worst_ratio || r != r ? r : worst_ratio;
    CHECK(d <= tol, "%s: max |diff| %.3g > budget %.3g", what, d, tol);
}

typedef struct fcase {
    const char *name;
    int n, n_pos, n_greedy;
    int32_t *prompt, *positions, *tokens;
    const float *ref_logits, *ref_greedy;
    float *alone; /* [n_greedy][vocab]: this run's greedy-step logits, decoded alone */
} fcase;

static void check_case(kr_ctx *ctx, kr_kv_pool *pool, const kr_config *cfg, const char *model, fcase *c)
{
    char err[KR_ERR_MAX], what[256];
    const int vocab = cfg->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)c->n * vocab);
    const int chunks[] = {0, 7};
    for (int k = 0; k < 2; k++) {
        kr_seq *s;
        REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
        REQUIRE(kr_prefill(ctx, s, c->prompt, c->n, chunks[k], KR_LOGITS_ALL, lg, err) == KR_OK, "%s", err);
        for (int j = 0; j < c->n_pos; j++) {
            snprintf(what, sizeof what, "%s/%s chunk %d position %d", model, c->name, chunks[k], c->positions[j]);
            within(cfg, lg + (size_t)c->positions[j] * vocab, c->ref_logits + (size_t)j * vocab, what);
        }
        kr_seq_free(s);
    }
    /* greedy steps, following the reference tokens even after a mismatch */
    kr_seq *s;
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(ctx, s, c->prompt, c->n, 0, KR_LOGITS_LAST, c->alone, err) == KR_OK, "%s", err);
    int decided = 0;
    for (int step = 0; step < c->n_greedy; step++) {
        float *row = c->alone + (size_t)step * vocab;
        const float *ref = c->ref_greedy + (size_t)step * vocab;
        snprintf(what, sizeof what, "%s/%s greedy step %d", model, c->name, step);
        within(cfg, row, ref, what);
        if (margin(ref, vocab) > 2 * budget(cfg, ref)) {
            decided++;
            CHECK(argmax(row, vocab) == c->tokens[step], "%s: token %d, expected %d (margin %.3g)", what,
                  argmax(row, vocab), c->tokens[step], margin(ref, vocab));
        }
        if (step + 1 < c->n_greedy)
            REQUIRE(kr_forward(ctx, s, &c->tokens[step], 1, KR_LOGITS_LAST, row + vocab, err) == KR_OK, "%s", err);
    }
    printf("  %s/%s: %d of %d greedy tokens decided by margin\n", model, c->name, decided, c->n_greedy);
    kr_seq_free(s);
    free(lg);
}

/* every case prefilled, then decoded in one batch (those with steps left): each row bit-equal
 * to the same step decoded alone */
static void check_batch(kr_ctx *ctx, kr_kv_pool *pool, const kr_config *cfg, const char *model, fcase *cs, int n)
{
    char err[KR_ERR_MAX];
    const int vocab = cfg->vocab_size;
    kr_seq **seqs = malloc(sizeof(kr_seq *) * (size_t)n), **batch = malloc(sizeof(kr_seq *) * (size_t)n);
    int32_t *tok = malloc(sizeof(int32_t) * (size_t)n);
    int *who = malloc(sizeof(int) * (size_t)n), most = 0;
    float *lg = malloc(sizeof(float) * (size_t)n * vocab);
    for (int i = 0; i < n; i++) {
        REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &seqs[i], err) == KR_OK, "%s", err);
        REQUIRE(kr_prefill(ctx, seqs[i], cs[i].prompt, cs[i].n, 0, KR_LOGITS_NONE, NULL, err) == KR_OK, "%s", err);
        most = cs[i].n_greedy > most ? cs[i].n_greedy : most;
    }
    int rows = 0;
    for (int step = 0; step + 1 < most; step++) {
        int b = 0;
        for (int i = 0; i < n; i++)
            if (step + 1 < cs[i].n_greedy) batch[b] = seqs[i], tok[b] = cs[i].tokens[step], who[b++] = i;
        REQUIRE(kr_forward_batch(ctx, batch, tok, b, lg, err) == KR_OK, "%s", err);
        for (int r = 0; r < b; r++, rows++) {
            const float *alone = cs[who[r]].alone + (size_t)(step + 1) * vocab;
            CHECK(!memcmp(lg + (size_t)r * vocab, alone, sizeof(float) * vocab),
                  "%s/%s: batched step %d (batch of %d) differs from decoding alone by %.3g", model,
                  cs[who[r]].name, step + 1, b, max_diff(lg + (size_t)r * vocab, alone, vocab));
        }
    }
    printf("  %s: %d batched decode rows bit-equal to decoding alone\n", model, rows);
    for (int i = 0; i < n; i++) kr_seq_free(seqs[i]);
    free(seqs), free(batch), free(tok), free(who), free(lg);
}

/* DIR/MODEL + tail into path (4096 bytes) */
static void model_path(char *path, const char *dir, const char *model, const char *tail)
{
    REQUIRE(snprintf(path, 4096, "%s/%s%s", dir, model, tail) < 4096, "path too long: %s/%s", dir, model);
}

static void check_model(const char *dir, const char *model)
{
    char path[4096], err[KR_ERR_MAX];
    model_path(path, dir, model, "");
    kr_model *m;
    REQUIRE(kr_model_load(path, NULL, &m, err) == KR_OK, "load %s: %s", path, err);
    const kr_config *cfg = kr_model_config(m);
    weight_rounding = kr_model_weight_dtype(m) == KR_DTYPE_BF16 ? 1 : sqrt(2.0);
    kr_ctx_params cp = {.backend = KR_BACKEND_CUDA, .n_threads = 1, .max_chunk = 512};
    kr_ctx *ctx;
    REQUIRE(kr_ctx_create(m, &cp, &ctx, err) == KR_OK, "%s: CUDA context: %s", model, err);
    kr_kv_pool *pool;
    REQUIRE(kr_ctx_kv_pool_create(ctx, 16, 8192, &pool, err) == KR_OK, "%s", err);

    size_t len;
    model_path(path, dir, model, "/cases.json");
    char *json = slurp(path, &len);
    model_path(path, dir, model, "/logits.bin");
    float *ref = (float *)slurp(path, &len);
    cJSON *root = cJSON_Parse(json);
    REQUIRE(root, "bad cases.json for %s", model);
    const cJSON *c, *cases = cJSON_GetObjectItem(root, "cases");
    int n = cJSON_GetArraySize(cases), i = 0;
    fcase *cs = calloc((size_t)(n > 0 ? n : 1), sizeof *cs);
    cJSON_ArrayForEach(c, cases)
    {
        fcase *f = &cs[i++];
        const cJSON *greedy = cJSON_GetObjectItem(c, "greedy");
        f->name = cJSON_GetObjectItem(c, "name")->valuestring;
        f->prompt = json_ids(cJSON_GetObjectItem(c, "prompt"), &f->n);
        f->positions = json_ids(cJSON_GetObjectItem(c, "positions"), &f->n_pos);
        f->tokens = json_ids(cJSON_GetObjectItem(greedy, "tokens"), &f->n_greedy);
        size_t off_logits = (size_t)cJSON_GetObjectItem(cJSON_GetObjectItem(c, "logits"), "offset")->valuedouble;
        size_t off_greedy = (size_t)cJSON_GetObjectItem(cJSON_GetObjectItem(greedy, "logits"), "offset")->valuedouble;
        f->ref_logits = ref + off_logits / sizeof(float);
        f->ref_greedy = ref + off_greedy / sizeof(float);
        f->alone = malloc(sizeof(float) * (size_t)(f->n_greedy > 0 ? f->n_greedy : 1) * cfg->vocab_size);
        check_case(ctx, pool, cfg, model, f);
    }
    CHECK(n >= 4, "%s: only %d cases", model, n);
    check_batch(ctx, pool, cfg, model, cs, n);
    CHECK(kr_kv_pool_n_free(pool) == kr_kv_pool_n_blocks(pool), "%s: blocks leaked", model);
    printf("%s (weights %s, on CUDA): %d cases; worst |diff| / budget %.3g\n", model,
           kr_dtype_name(kr_model_weight_dtype(m)), n, worst_ratio);
    worst_ratio = 0;
    for (i = 0; i < n; i++) free(cs[i].prompt), free(cs[i].positions), free(cs[i].tokens), free(cs[i].alone);
    free(cs);
    cJSON_Delete(root);
    free(json);
    free(ref);
    kr_kv_pool_free(pool);
    kr_ctx_free(ctx);
    kr_model_free(m);
}

int main(void)
{
    kt_cuda_skip_unless_usable();
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/models", fx);
    const char *models[] = {"llama3-tiny", "qwen2-tiny", "mistral-tiny"};
    for (int i = 0; i < 3; i++) check_model(dir, models[i]);
    return kt_done("test_cuda_fixtures");
}
#else
int main(void)
{
    kt_cuda_skip_unless_usable();
    return 0;
}
#endif
