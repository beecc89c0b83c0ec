/*
 * test_window.c - sliding-window attention (Mistral's "sliding_window") against a recomputation:
 * in a one-layer model the last token's logits depend only on the tokens it attends, and RoPE
 * scores depend only on position differences, so with window W the last token of a long prompt
 * must give the logits of the last W tokens fed alone (within float rounding). The model is
 * mistral-tiny's weights under a config cut to one layer, with and without a window; the
 * footprint must count exactly the windowed entries.
 */
#include "kr_test.h"

#include "kr.h"

#include <unistd.h>

static char tmp[256];

static void write_model(const char *fx, int window)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "rm -rf %s/m && mkdir -p %s/m && for f in %s/models/mistral-tiny/*.safetensors "
             "%s/models/mistral-tiny/model.safetensors.index.json; do ln -s \"$f\" %s/m/; done && "
             "sed -e 's/\"num_hidden_layers\": *[0-9]*/\"num_hidden_layers\": 1/' "
             "-e 's/\"sliding_window\": *null/\"sliding_window\": %d/' "
             "%s/models/mistral-tiny/config.json > %s/m/config.json && grep -q '\"sliding_window\": %d' %s/m/config.json",
             tmp, tmp, fx, fx, tmp, window, fx, tmp, window, tmp);
    REQUIRE(system(cmd) == 0, "cannot write the windowed model: %s", cmd);
}

static void last_logits(const kr_model *m, const int32_t *ids, int n, int chunk, float *out, kr_footprint *fp)
{
    char err[KR_ERR_MAX];
    const kr_config *cfg = kr_model_config(m);
    kr_ctx *c;
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = 64};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    kr_seq *s;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, 16, 1024, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(c, s, ids, n, chunk, KR_LOGITS_LAST, out, err) == KR_OK, "%s", err);
    if (fp) kr_seq_footprint(s, fp);
    kr_seq_free(s);
    kr_kv_pool_free(pool);
    kr_ctx_free(c);
}

int main(void)
{
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    snprintf(tmp, sizeof tmp, "/tmp/kr_test_window.XXXXXX");
    REQUIRE(mkdtemp(tmp), "mkdtemp");
    char dir[512], err[KR_ERR_MAX];
    snprintf(dir, sizeof dir, "%s/m", tmp);

    enum { N = 100, W = 16, V = 512 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 37 + 11) % V);
    float windowed[V], alone[V], full[V];

    write_model(fx, W);
    kr_model *m;
    REQUIRE(kr_model_load(dir, NULL, &m, err) == KR_OK, "%s", err);
    CHECK(kr_model_config(m)->sliding_window == W, "window not read");
    kr_footprint fp;
    const int chunks[] = {N, 7, 1};
    for (int k = 0; k < 3; k++) {
        last_logits(m, ids, N, chunks[k], windowed, &fp);
        last_logits(m, ids + N - W, W, 0, alone, NULL);
        double d = 0;
        for (int i = 0; i < V; i++) d = kt_worst(d, fabs((double)windowed[i] - alone[i]));
        CHECK(d < 2e-5, "chunk %d: windowed last token differs from the last %d tokens alone by %.3g",
              chunks[k], W, d);
        /* per KV head: token p attends min(p + 1, W) entries */
        double expect = 0, full_count = 0;
        for (int p = 0; p < N; p++) expect += p + 1 < W ? p + 1 : W, full_count += p + 1;
        int kvh = kr_model_config(m)->n_kv_heads;
        CHECK(fp.attended == expect * kvh && fp.full == full_count * kvh, "footprint %g/%g, expected %g/%g",
              fp.attended, fp.full, expect * kvh, full_count * kvh);
    }
    kr_model_free(m);

    /* the window must matter: the same weights without it give other logits */
    write_model(fx, 0);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "sed -i 's/\"sliding_window\": 0/\"sliding_window\": null/' %s/m/config.json", tmp);
    REQUIRE(system(cmd) == 0, "sed");
    REQUIRE(kr_model_load(dir, NULL, &m, err) == KR_OK, "%s", err);
    last_logits(m, ids, N, 0, full, NULL);
    double d = 0;
    for (int i = 0; i < V; i++) d = kt_worst(d, fabs((double)windowed[i] - full[i]));
    CHECK(d > 1e-3, "window had no effect (%.3g)", d);
    kr_model_free(m);

    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    (void)system(cmd);
    return kt_done("test_window");
}
