/*
 * test_model_load.c - config.json, safetensors and checkpoint loading (engine/config.c,
 * engine/safetensors.c, engine/model.c).
 *
 * What it checks: the three fixture models load with the config values their READMEs state, the
 * tensors the engine sees are byte-for-byte the file's, weights_f32 equals the exact upcast, the
 * fingerprint is stable and tells models apart, misaligned data is copied, random models are
 * deterministic; and every kind of broken checkpoint (each built in a temp dir from a fixture)
 * fails with a message naming the file and/or tensor or field.
 * Run: ctest -R test_model_load (needs KR_FIXTURES, set by CMake; skipped without it).
 */
#include "kr-model.h"
#include "kr-util.h"
#include "kr_test.h"
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *fixtures;
static char tmp_root[512];
static int tmp_seq;

/* ------------------------------------------------------------------ file helpers */

static char *slurp(const char *path, size_t *len)
{
    char *data = NULL;
    char err[KR_ERR_MAX];
    REQUIRE(kr_read_file(path, &data, len, err) == 0, "%s", err);
    return data;
}

static void spit(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    REQUIRE(f, "cannot write %s", path);
    REQUIRE(fwrite(data, 1, len, f) == len, "short write %s", path);
    fclose(f);
}

static void spit_str(const char *path, const char *s) { spit(path, s, strlen(s)); }

static void copy_file(const char *src, const char *dst)
{
    size_t len;
    char *d = slurp(src, &len);
    spit(dst, d, len);
    free(d);
}

/* A fresh directory holding a copy of fixture model `name` (weights, index and config). */
static void copy_model(const char *name, char *dir, size_t cap)
{
    snprintf(dir, cap, "%s/case%02d", tmp_root, tmp_seq++);
    REQUIRE(mkdir(dir, 0700) == 0, "mkdir %s", dir);
    char src_dir[1024];
    snprintf(src_dir, sizeof src_dir, "%s/models/%s", fixtures, name);
    DIR *d = opendir(src_dir);
    REQUIRE(d, "cannot open %s", src_dir);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strstr(e->d_name, "safetensors") && strcmp(e->d_name, "config.json") != 0) continue;
        char a[2048], b[2048];
        snprintf(a, sizeof a, "%s/%s", src_dir, e->d_name);
        snprintf(b, sizeof b, "%s/%s", dir, e->d_name);
        copy_file(a, b);
    }
    closedir(d);
}

static void rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char p[2048];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(p, &st) == 0 && S_ISDIR(st.st_mode)) rm_tree(p);
        else unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

/* Rewrites a safetensors file's header through `edit` (data section unchanged). The header is
 * padded so that the data starts at a multiple of 8, or at an odd offset with `misalign`. */
typedef void (*hdr_edit_fn)(cJSON *hdr, void *arg);
static void st_rewrite(const char *path, hdr_edit_fn edit, void *arg, int misalign)
{
    size_t len;
    char *file = slurp(path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (uint8_t)file[i];
    cJSON *hdr = cJSON_ParseWithLength(file + 8, (size_t)hlen);
    REQUIRE(hdr, "fixture header of %s does not parse", path);
    if (edit) edit(hdr, arg);
    char *text = cJSON_PrintUnformatted(hdr);
    size_t n = strlen(text), padded = n;
    while ((8 + padded) % 8 != (misalign ? 1u : 0u)) padded++;
    size_t data_len = len - 8 - (size_t)hlen;
    char *out = malloc(8 + padded + data_len);
    for (int i = 0; i < 8; i++) out[i] = (char)((uint64_t)padded >> (8 * i));
    memcpy(out + 8, text, n);
    memset(out + 8 + n, ' ', padded - n);
    memcpy(out + 8 + padded, file + 8 + hlen, data_len);
    spit(path, out, 8 + padded + data_len);
    free(out);
    free(text);
    cJSON_Delete(hdr);
    free(file);
}

/* Edits a JSON file (config or index) through `edit`. */
static void json_rewrite(const char *path, hdr_edit_fn edit, void *arg)
{
    size_t len;
    char *t = slurp(path, &len);
    cJSON *j = cJSON_Parse(t);
    REQUIRE(j, "%s does not parse", path);
    edit(j, arg);
    char *s = cJSON_Print(j);
    spit_str(path, s);
    free(s);
    cJSON_Delete(j);
    free(t);
}

static void set_field(cJSON *j, const char *key, cJSON *v)
{
    if (cJSON_GetObjectItemCaseSensitive(j, key)) cJSON_ReplaceItemInObjectCaseSensitive(j, key, v);
    else cJSON_AddItemToObject(j, key, v);
}

/* ------------------------------------------------------------------ load helpers */

static kr_model *load_ok(const char *dir, const kr_model_opts *o)
{
    char err[KR_ERR_MAX] = "";
    kr_model *m = NULL;
    REQUIRE(kr_model_load(dir, o, &m, err) == 0 && m, "loading %s: %s", dir, err);
    return m;
}

static kr_model *load_fixture(const char *name, const kr_model_opts *o, double *secs)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/%s", fixtures, name);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    kr_model *m = load_ok(dir, o);
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (secs) *secs = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    return m;
}

/* Loading must fail, leave the output alone, and name every needle (NULL-terminated). */
static void expect_fail_(const char *what, const char *dir, const char **needles)
{
    char err[KR_ERR_MAX] = "";
    kr_model *m = (kr_model *)(uintptr_t)0x1;
    int rc = kr_model_load(dir, NULL, &m, err);
    CHECK(rc == -1, "%s: load succeeded", what);
    CHECK(m == (kr_model *)(uintptr_t)0x1, "%s: output written on failure", what);
    if (rc == 0 && m != (kr_model *)(uintptr_t)0x1) kr_model_free(m);
    for (int i = 0; needles[i]; i++) CHECK_ERR_HAS(err, needles[i]);
    printf("  %-28s -> %s\n", what, err);
}
#define EXPECT_FAIL(what, dir, ...) expect_fail_(what, dir, (const char *[]){__VA_ARGS__, NULL})

static float elem(const kr_tensor *t, int64_t i)
{
    if (t->dtype == KR_DTYPE_F32) return ((const float *)t->data)[i];
    uint16_t h = ((const uint16_t *)t->data)[i];
    return t->dtype == KR_DTYPE_BF16 ? kr_bf16_to_f32(h) : kr_f16_to_f32(h);
}

static int64_t numel(const kr_tensor *t) { return t->rows * t->cols; }

/* Every matrix of the model, in a fixed order. */
static int matrices(const kr_model *m, const kr_tensor **out)
{
    int n = 0;
    out[n++] = &m->embed;
    for (int l = 0; l < m->cfg.n_layers; l++) {
        const kr_layer_weights *L = &m->layers[l];
        const kr_tensor *ts[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (int k = 0; k < 7; k++) out[n++] = ts[k];
    }
    if (!m->cfg.tie_word_embeddings) out[n++] = &m->lm_head;
    return n;
}

/* The tensor's bytes read straight from a single-file checkpoint, independent of safetensors.c. */
static void *raw_tensor(const char *file, const char *name, char *dtype, size_t *nbytes)
{
    size_t len;
    char *d = slurp(file, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | (uint8_t)d[i];
    cJSON *h = cJSON_ParseWithLength(d + 8, (size_t)hlen);
    cJSON *e = cJSON_GetObjectItemCaseSensitive(h, name);
    REQUIRE(e, "%s not in %s", name, file);
    cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    size_t b = (size_t)cJSON_GetArrayItem(off, 0)->valuedouble;
    size_t en = (size_t)cJSON_GetArrayItem(off, 1)->valuedouble;
    snprintf(dtype, 8, "%s", cJSON_GetObjectItemCaseSensitive(e, "dtype")->valuestring);
    void *out = malloc(en - b);
    memcpy(out, d + 8 + hlen + b, en - b);
    *nbytes = en - b;
    cJSON_Delete(h);
    free(d);
    return out;
}

static void check_norms(const kr_model *m, const char *name)
{
    float lo = 2, hi = -2;
    double sum = 0;
    int n = 0;
    for (int l = 0; l < m->cfg.n_layers; l++)
        for (int k = 0; k < 2; k++) {
            const kr_tensor *t = k ? &m->layers[l].ffn_norm : &m->layers[l].attn_norm;
            CHECK(t->dtype == KR_DTYPE_F32 && t->rows == 1 && t->cols == m->cfg.hidden_size,
                  "%s: norm layout", name);
            for (int64_t i = 0; i < numel(t); i++) {
                float v = ((const float *)t->data)[i];
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
                sum += v, n++;
            }
        }
    /* READMEs: RMSNorm weights 1 +- 0.05 (a standard deviation: the extremes reach ~0.18) */
    CHECK(fabs(sum / n - 1.0) < 0.02 && lo > 0.7f && hi < 1.3f && hi > lo,
          "%s: norm weights mean %g in [%g, %g]", name, sum / n, lo, hi);
}

/* ------------------------------------------------------------------ good fixtures */

static void test_llama3(void)
{
    double secs;
    kr_model *m = load_fixture("llama3-tiny", NULL, &secs);
    const kr_config *c = kr_model_config(m);
    CHECK(c->arch == KR_ARCH_LLAMA && strcmp(c->arch_name, "LlamaForCausalLM") == 0, "arch");
    CHECK(c->vocab_size == 512 && c->hidden_size == 256 && c->intermediate_size == 688, "sizes");
    CHECK(c->n_layers == 4 && c->n_heads == 8 && c->n_kv_heads == 2 && c->head_dim == 32, "GQA");
    CHECK(c->max_position_embeddings == 131072, "max pos %d", c->max_position_embeddings);
    CHECK(c->rope_theta == 500000.0f && c->rms_norm_eps == 1e-5f, "theta/eps");
    CHECK(c->rope_llama3 && c->rope_factor == 8.0f && c->rope_low_freq_factor == 1.0f &&
          c->rope_high_freq_factor == 4.0f && c->rope_original_max_pos == 8192, "llama3 rope");
    CHECK(!c->attn_bias && !c->tie_word_embeddings, "bias/tie");
    CHECK(c->bos_token_id == 509 && c->eos_token_id == 510, "bos/eos");
    CHECK(c->torch_dtype == KR_DTYPE_BF16, "torch_dtype");
    CHECK(kr_model_weight_dtype(m) == KR_DTYPE_BF16, "weights kept bf16");
    CHECK(m->layers[0].wq.rows == 256 && m->layers[0].wq.cols == 256, "wq shape");
    CHECK(m->layers[0].wk.rows == 64 && m->layers[0].wk.cols == 256, "wk shape");
    CHECK(m->layers[3].w_down.rows == 256 && m->layers[3].w_down.cols == 688, "w_down shape");
    CHECK(m->lm_head.data && m->lm_head.data != m->embed.data, "untied head");
    CHECK(m->layers[0].bq.data == NULL, "no biases");
    check_norms(m, "llama3");

    /* bf16 matrices: 4 layers * (256*256 + 2*64*256 + 256*256 + 3*688*256) + 2 * 512*256,
     * norms f32: (2*4 + 1) * 256 */
    size_t mats = 4 * (256 * 256 + 2 * 64 * 256 + 256 * 256 + 3 * 688 * 256) + 2 * 512 * 256;
    size_t want = mats * 2 + 9 * 256 * 4;
    CHECK(kr_model_weight_bytes(m) == want, "weight bytes %zu, want %zu", kr_model_weight_bytes(m),
          want);

    /* The bytes the engine sees are the file's bytes. */
    char file[1024], dt[8];
    snprintf(file, sizeof file, "%s/models/llama3-tiny/model.safetensors", fixtures);
    size_t nb;
    void *raw = raw_tensor(file, "model.layers.1.self_attn.q_proj.weight", dt, &nb);
    CHECK(strcmp(dt, "BF16") == 0 && nb == 256 * 256 * 2 && memcmp(raw, m->layers[1].wq.data,
          nb) == 0, "layer 1 q_proj bytes");
    free(raw);
    raw = raw_tensor(file, "model.norm.weight", dt, &nb);
    int same = nb == 256 * 2;
    for (int i = 0; same && i < 256; i++)
        same = kr_bf16_to_f32(((uint16_t *)raw)[i]) == ((const float *)m->final_norm.data)[i];
    CHECK(same, "final norm = upcast of the file's bf16");
    free(raw);

    /* weights_f32: every matrix equals the exact upcast; the fingerprint does not change */
    kr_model_opts o = {.weights_f32 = 1};
    kr_model *f = load_fixture("llama3-tiny", &o, NULL);
    CHECK(kr_model_weight_dtype(f) == KR_DTYPE_F32, "f32 dtype");
    CHECK(kr_model_weight_bytes(f) == mats * 4 + 9 * 256 * 4, "f32 bytes");
    const kr_tensor *a[64], *b[64];
    int na = matrices(m, a), nb2 = matrices(f, b), bad = 0;
    CHECK(na == nb2 && na == 30, "matrix count %d", na);
    for (int k = 0; k < na; k++) {
        CHECK(b[k]->dtype == KR_DTYPE_F32 && a[k]->rows == b[k]->rows && a[k]->cols == b[k]->cols,
              "f32 matrix %d layout", k);
        for (int64_t i = 0; i < numel(a[k]); i++) bad += elem(a[k], i) != elem(b[k], i);
    }
    CHECK(bad == 0, "%d f32 values differ from the bf16 upcast", bad);
    CHECK(strcmp(kr_model_fingerprint(m), kr_model_fingerprint(f)) == 0, "fingerprint vs f32");
    kr_model_free(f);
    printf("  llama3-tiny loaded in %.4f s, fingerprint %s\n", secs, kr_model_fingerprint(m));
    kr_model_free(m);
}

static void test_qwen2(void)
{
    double secs;
    kr_model *m = load_fixture("qwen2-tiny", NULL, &secs);
    const kr_config *c = kr_model_config(m);
    CHECK(c->arch == KR_ARCH_QWEN2, "arch");
    CHECK(c->vocab_size == 512 && c->hidden_size == 128 && c->intermediate_size == 352, "sizes");
    CHECK(c->n_layers == 3 && c->n_heads == 4 && c->n_kv_heads == 2, "GQA");
    CHECK(c->head_dim == 32, "head_dim from hidden/heads: %d", c->head_dim);
    CHECK(c->rope_theta == 1e6f && c->rms_norm_eps == 1e-6f && !c->rope_llama3, "rope/eps");
    CHECK(c->attn_bias && c->tie_word_embeddings, "qwen2 biases and tied head");
    CHECK(c->bos_token_id == 509 && c->eos_token_id == 509, "bos/eos");
    CHECK(c->torch_dtype == KR_DTYPE_F16 && kr_model_weight_dtype(m) == KR_DTYPE_F16, "f16");
    CHECK(m->lm_head.data == m->embed.data && m->lm_head.rows == 512, "tied lm_head");
    for (int l = 0; l < 3; l++) {
        const kr_layer_weights *L = &m->layers[l];
        CHECK(L->bq.data && L->bq.dtype == KR_DTYPE_F32 && L->bq.rows == 1 && L->bq.cols == 128,
              "bq %d", l);
        CHECK(L->bk.data && L->bk.cols == 64 && L->bv.data && L->bv.cols == 64, "bk/bv %d", l);
    }
    /* biases have std 0.1: not all zero, not huge */
    float mx = 0;
    for (int i = 0; i < 128; i++) {
        float v = ((const float *)m->layers[0].bq.data)[i];
        mx = v > mx ? v : -v > mx ? -v : mx;
    }
    CHECK(mx > 0.05f && mx < 1.0f, "bias magnitude %g", mx);
    check_norms(m, "qwen2");

    char file[1024], dt[8];
    snprintf(file, sizeof file, "%s/models/qwen2-tiny/model.safetensors", fixtures);
    size_t nb;
    void *raw = raw_tensor(file, "model.layers.2.self_attn.k_proj.bias", dt, &nb);
    int same = strcmp(dt, "F16") == 0 && nb == 64 * 2;
    for (int i = 0; same && i < 64; i++)
        same = kr_f16_to_f32(((uint16_t *)raw)[i]) == ((const float *)m->layers[2].bk.data)[i];
    CHECK(same, "k_proj bias = upcast of the file's f16");
    free(raw);

    kr_model_opts o = {.weights_f32 = 1};
    kr_model *f = load_fixture("qwen2-tiny", &o, NULL);
    const kr_tensor *a[64], *b[64];
    int na = matrices(m, a), bad = 0;
    matrices(f, b);
    for (int k = 0; k < na; k++)
        for (int64_t i = 0; i < numel(a[k]); i++) bad += elem(a[k], i) != elem(b[k], i);
    CHECK(bad == 0, "%d f32 values differ from the f16 upcast", bad);
    CHECK(f->lm_head.data == f->embed.data, "still tied with f32");
    kr_model_free(f);

    /* Data at an odd offset (unaligned for f16) is copied, with the same values. */
    char dir[1024], path[1100];
    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_rewrite(path, NULL, NULL, 1);
    kr_model *u = load_ok(dir, NULL);
    const kr_tensor *ut[64];
    matrices(u, ut);
    bad = 0;
    for (int k = 0; k < na; k++) {
        CHECK((uintptr_t)ut[k]->data % 2 == 0, "aligned copy");
        bad += memcmp(a[k]->data, ut[k]->data, (size_t)numel(a[k]) * 2) != 0;
    }
    CHECK(bad == 0, "%d misaligned tensors differ", bad);
    CHECK(strcmp(kr_model_fingerprint(u), kr_model_fingerprint(m)) == 0, "fingerprint vs copy");
    kr_model_free(u);
    printf("  qwen2-tiny  loaded in %.4f s, fingerprint %s\n", secs, kr_model_fingerprint(m));
    kr_model_free(m);
}

static void test_mistral(void)
{
    double secs;
    kr_model_opts verbose = {.verbose = 1};
    kr_model *m = load_fixture("mistral-tiny", &verbose, &secs);
    const kr_config *c = kr_model_config(m);
    CHECK(c->arch == KR_ARCH_MISTRAL, "arch");
    CHECK(c->n_layers == 2 && c->n_heads == 4 && c->n_kv_heads == 4 && c->head_dim == 32, "MHA");
    CHECK(c->hidden_size == 128 && c->intermediate_size == 320, "sizes");
    CHECK(c->rope_theta == 10000.0f && c->rms_norm_eps == 1e-5f && !c->rope_llama3, "rope");
    CHECK(!c->attn_bias && !c->tie_word_embeddings, "no bias, untied");
    CHECK(c->bos_token_id == 1 && c->eos_token_id == 2, "bos/eos");
    CHECK(kr_model_weight_dtype(m) == KR_DTYPE_F32 && c->torch_dtype == KR_DTYPE_F32, "f32");
    CHECK(m->n_maps == 2, "two shards mapped, got %d", m->n_maps);
    CHECK(m->lm_head.data != m->embed.data && m->lm_head.rows == 512, "lm_head");
    check_norms(m, "mistral");
    /* f32 checkpoint, aligned: even the norms are used in place, nothing is copied */
    CHECK(m->n_owned == 0, "owned buffers %d", m->n_owned);
    char file[1024], dt[8];
    snprintf(file, sizeof file, "%s/models/mistral-tiny/model-00002-of-00002.safetensors",
             fixtures);
    size_t nb;
    void *raw = raw_tensor(file, "model.layers.1.mlp.up_proj.weight", dt, &nb);
    CHECK(nb == 320 * 128 * 4 && memcmp(raw, m->layers[1].w_up.data, nb) == 0, "shard 2 bytes");
    free(raw);
    printf("  mistral-tiny loaded in %.4f s, fingerprint %s\n", secs, kr_model_fingerprint(m));
    kr_model_free(m);
}

static void test_fingerprints(void)
{
    const char *names[] = {"llama3-tiny", "qwen2-tiny", "mistral-tiny"};
    char fp[3][17];
    for (int i = 0; i < 3; i++) {
        kr_model *a = load_fixture(names[i], NULL, NULL), *b = load_fixture(names[i], NULL, NULL);
        const char *s = kr_model_fingerprint(a);
        CHECK(strlen(s) == 16 && strspn(s, "0123456789abcdef") == 16, "hex: %s", s);
        CHECK(strcmp(s, kr_model_fingerprint(b)) == 0, "%s: stable", names[i]);
        snprintf(fp[i], sizeof fp[i], "%s", s);
        kr_model_free(a);
        kr_model_free(b);
    }
    CHECK(strcmp(fp[0], fp[1]) && strcmp(fp[0], fp[2]) && strcmp(fp[1], fp[2]), "distinct");
}

static void test_random(void)
{
    char err[KR_ERR_MAX];
    kr_config c;
    char path[1024];
    snprintf(path, sizeof path, "%s/models/qwen2-tiny", fixtures);
    REQUIRE(kr_config_load(path, &c, err) == 0, "%s", err);
    kr_model *a, *b, *d;
    REQUIRE(kr_model_random(&c, KR_DTYPE_BF16, 7, &a, err) == 0, "%s", err);
    REQUIRE(kr_model_random(&c, KR_DTYPE_BF16, 7, &b, err) == 0, "%s", err);
    REQUIRE(kr_model_random(&c, KR_DTYPE_BF16, 8, &d, err) == 0, "%s", err);
    const kr_tensor *ta[64], *tb[64], *td[64];
    int n = matrices(a, ta), same = 1, differ = 0;
    matrices(b, tb);
    matrices(d, td);
    double sum = 0, sq = 0, mx = 0;
    int64_t cnt = 0;
    for (int k = 0; k < n; k++) {
        size_t bytes = (size_t)numel(ta[k]) * 2;
        same &= memcmp(ta[k]->data, tb[k]->data, bytes) == 0;
        differ += memcmp(ta[k]->data, td[k]->data, bytes) != 0;
        for (int64_t i = 0; i < numel(ta[k]); i++) {
            double v = elem(ta[k], i);
            sum += v, sq += v * v, cnt++;
            mx = fabs(v) > mx ? fabs(v) : mx;
        }
    }
    double mean = sum / (double)cnt, sd = sqrt(sq / (double)cnt - mean * mean);
    CHECK(same, "same seed, same weights");
    CHECK(differ == n, "other seed, other weights (%d of %d differ)", differ, n);
    CHECK(fabs(mean) < 1e-3 && sd > 0.018 && sd < 0.022 && mx < 0.035, "mean %g sd %g max %g",
          mean, sd, mx);
    CHECK(a->lm_head.data == a->embed.data, "tied");
    CHECK(((const float *)a->layers[1].ffn_norm.data)[5] == 1.0f, "norms are 1");
    CHECK(a->layers[0].bq.data && a->layers[0].bq.dtype == KR_DTYPE_F32, "biases");
    CHECK(kr_model_weight_dtype(a) == KR_DTYPE_BF16, "dtype");
    CHECK(strcmp(kr_model_fingerprint(a), kr_model_fingerprint(b)) == 0 &&
          strcmp(kr_model_fingerprint(a), kr_model_fingerprint(d)) != 0, "random fingerprints");
    kr_model_free(a);
    kr_model_free(b);
    kr_model_free(d);

    c.n_kv_heads = 3;
    kr_model *x = NULL;
    CHECK(kr_model_random(&c, KR_DTYPE_F32, 1, &x, err) == -1 && x == NULL, "bad random cfg");
    CHECK_ERR_HAS(err, "num_key_value_heads");
}

/* ------------------------------------------------------------------ config.json */

static void test_config_parse(void)
{
    char err[KR_ERR_MAX];
    kr_config c;
    const char *base = "{\"architectures\":[\"LlamaForCausalLM\"],\"vocab_size\":100,"
                       "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":2,"
                       "\"num_attention_heads\":4";
    char j[2048];
#define PARSE(extra) (snprintf(j, sizeof j, "%s%s}", base, extra), \
                      kr_config_parse(j, strlen(j), "cfg.json", &c, err))
    CHECK(PARSE("") == 0, "minimal: %s", err);
    CHECK(c.n_kv_heads == 4 && c.head_dim == 16 && c.rope_theta == 10000.0f && !c.rope_llama3,
          "defaults");
    CHECK(c.bos_token_id == -1 && c.eos_token_id == -1 && !c.tie_word_embeddings, "defaults 2");
    CHECK(PARSE(",\"eos_token_id\":[128001,128008,128009],\"bos_token_id\":null") == 0, "%s", err);
    CHECK(c.eos_token_id == 128001 && c.bos_token_id == -1, "eos list");
    CHECK(PARSE(",\"attention_bias\":true,\"rope_scaling\":{\"type\":\"default\"}") == 0, "%s",
          err);
    CHECK(c.attn_bias && !c.rope_llama3, "llama attention_bias");
    CHECK(PARSE(",\"num_key_value_heads\":3") == -1, "heads %% kv");
    CHECK_ERR_HAS(err, "num_key_value_heads");
    CHECK_ERR_HAS(err, "cfg.json");
    CHECK(PARSE(",\"head_dim\":15") == -1, "odd head_dim");
    CHECK_ERR_HAS(err, "head_dim");
    CHECK(PARSE(",\"num_key_value_heads\":-2") == -1, "negative");
    CHECK_ERR_HAS(err, "num_key_value_heads");
    CHECK(PARSE(",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}") == -1, "yarn");
    CHECK_ERR_HAS(err, "yarn");
    CHECK(PARSE(",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8}") == -1, "llama3 args");
    CHECK_ERR_HAS(err, "low_freq_factor");
    CHECK(PARSE(",\"mlp_bias\":true") == -1, "mlp_bias");
    CHECK_ERR_HAS(err, "mlp_bias");
    CHECK(PARSE(",\"hidden_act\":\"gelu\"") == -1, "gelu");
    CHECK_ERR_HAS(err, "hidden_act");
    CHECK(PARSE(",\"torch_dtype\":\"int8\"") == -1, "dtype");
    CHECK_ERR_HAS(err, "torch_dtype");
    CHECK(PARSE(",\"max_position_embeddings\":1.5") == -1, "non-integer");
    CHECK_ERR_HAS(err, "max_position_embeddings");
    snprintf(j, sizeof j, "{\"architectures\":[\"LlamaForCausalLM\"]}");
    CHECK(kr_config_parse(j, strlen(j), "cfg.json", &c, err) == -1, "missing");
    CHECK_ERR_HAS(err, "vocab_size");
#undef PARSE
    /* sliding windows */
    const char *mis = "{\"architectures\":[\"MistralForCausalLM\"],\"vocab_size\":100,"
                      "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":2,"
                      "\"num_attention_heads\":4,\"max_position_embeddings\":32768,";
    snprintf(j, sizeof j, "%s\"sliding_window\":4096}", mis);
    CHECK(kr_config_parse(j, strlen(j), "m.json", &c, err) == 0, "mistral window: %s", err);
    CHECK(c.sliding_window == 4096 && c.sliding_window_first_layer == 0, "window %d from %d",
          c.sliding_window, c.sliding_window_first_layer);
    snprintf(j, sizeof j, "%s\"sliding_window\":null}", mis);
    CHECK(kr_config_parse(j, strlen(j), "m.json", &c, err) == 0 && c.sliding_window == 0, "null window");
    snprintf(j, sizeof j, "%s\"sliding_window\":-3}", mis);
    CHECK(kr_config_parse(j, strlen(j), "m.json", &c, err) == -1, "negative window");
    CHECK_ERR_HAS(err, "sliding_window");
    const char *qw = "{\"architectures\":[\"Qwen2ForCausalLM\"],\"vocab_size\":100,"
                     "\"hidden_size\":64,\"intermediate_size\":96,\"num_hidden_layers\":2,"
                     "\"num_attention_heads\":4,\"sliding_window\":128,";
    snprintf(j, sizeof j, "%s\"use_sliding_window\":true,\"max_window_layers\":1}", qw);
    CHECK(kr_config_parse(j, strlen(j), "q.json", &c, err) == 0, "qwen2 window: %s", err);
    CHECK(c.sliding_window == 128 && c.sliding_window_first_layer == 1, "qwen2 window layers");
    snprintf(j, sizeof j, "%s\"use_sliding_window\":true,\"max_window_layers\":2}", qw);
    CHECK(kr_config_parse(j, strlen(j), "q.json", &c, err) == 0, "no layer windowed: %s", err);
    CHECK(c.attn_bias && !c.tie_word_embeddings, "qwen2 implicit bias");
    /* not NUL-terminated input must not be overread (ASan) */
    char *exact = malloc(5);
    memcpy(exact, "{\"a\":", 5);
    CHECK(kr_config_parse(exact, 5, "x.json", &c, err) == -1, "truncated json");
    CHECK_ERR_HAS(err, "x.json");
    free(exact);
}

/* ------------------------------------------------------------------ safetensors, in memory */

static void test_safetensors_parse(void)
{
    char err[KR_ERR_MAX];
    /* a hand-written file: one F32 [2] tensor, one F64 [2] tensor, metadata */
    const char *hdr = "{\"__metadata__\":{\"format\":\"pt\"},"
                      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                      "\"b\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[8,24]}}";
    size_t hl = strlen(hdr), len = 8 + hl + 24;
    uint8_t *buf = calloc(1, len);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    float one = 1.0f;
    memcpy(buf + 8 + hl, &one, 4);
    kr_st_file *f = NULL;
    REQUIRE(kr_st_parse(buf, len, "mem.safetensors", &f, err) == 0, "%s", err);
    CHECK(f->n_tensors == 2, "metadata ignored");
    const kr_st_tensor *t = NULL;
    CHECK(kr_st_get(f, "a", &t, err) == 0 && t->dtype == KR_DTYPE_F32 && t->shape[0] == 2, "a");
    CHECK(kr_st_get(f, "b", &t, err) == -1, "F64 refused");
    CHECK_ERR_HAS(err, "mem.safetensors");
    CHECK_ERR_HAS(err, "'b'");
    CHECK_ERR_HAS(err, "F64");
    CHECK(kr_st_get(f, "c", &t, err) == -1, "missing");
    CHECK_ERR_HAS(err, "'c'");
    kr_st_close(f);
    /* the file cut short: b's data lies beyond the end */
    f = NULL;
    CHECK(kr_st_parse(buf, len - 1, "mem.safetensors", &f, err) == -1 && !f, "truncated");
    CHECK_ERR_HAS(err, "'b'");
    CHECK_ERR_HAS(err, "truncated");
    CHECK(kr_st_parse(buf, 5, "mem.safetensors", &f, err) == -1, "tiny");
    free(buf);
}

/* ------------------------------------------------------------------ broken checkpoints */

static void edit_arch(cJSON *j, void *arg)
{
    set_field(j, "architectures", cJSON_CreateStringArray((const char *[]){arg}, 1));
}
static void edit_kv_heads(cJSON *j, void *arg) { set_field(j, "num_key_value_heads", cJSON_CreateNumber(3)); }
static void edit_rope(cJSON *j, void *arg)
{
    cJSON *rs = cJSON_CreateObject();
    cJSON_AddStringToObject(rs, "rope_type", "dynamic");
    cJSON_AddNumberToObject(rs, "factor", 2.0);
    set_field(j, "rope_scaling", rs);
}
/* q_proj of layer 0 (F16 [128,128], 32768 bytes) re-declared as I8 [128,256]: same bytes */
static void edit_dtype(cJSON *j, void *arg)
{
    cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "model.layers.0.self_attn.q_proj.weight");
    set_field(e, "dtype", cJSON_CreateString("I8"));
    set_field(e, "shape", cJSON_CreateIntArray((const int[]){128, 256}, 2));
}
static void edit_drop(cJSON *j, void *arg)
{
    cJSON *e = cJSON_DetachItemFromObjectCaseSensitive(j, arg);
    REQUIRE(e, "no %s", (const char *)arg);
    cJSON_AddItemToObject(j, "renamed.weight", e);
}
static void edit_transpose(cJSON *j, void *arg)
{
    cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "model.layers.1.mlp.gate_proj.weight");
    set_field(e, "shape", cJSON_CreateIntArray((const int[]){128, 352}, 2));
}
static void edit_offsets(cJSON *j, void *arg)
{
    cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "model.layers.1.mlp.up_proj.weight");
    cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    double b = cJSON_GetArrayItem(off, 0)->valuedouble;
    double end = *(const double *)arg < 0 ? cJSON_GetArrayItem(off, 1)->valuedouble - 2
                                          : *(const double *)arg;
    set_field(e, "data_offsets", cJSON_CreateDoubleArray((const double[]){b, end}, 2));
}
static void edit_index_norm(cJSON *j, void *arg)
{
    cJSON *wm = cJSON_GetObjectItemCaseSensitive(j, "weight_map");
    set_field(wm, "model.norm.weight", cJSON_CreateString("model-00001-of-00002.safetensors"));
}

static void test_broken(void)
{
    char dir[1024], p[1200];
    printf("broken checkpoints:\n");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_rewrite(p, edit_arch, "GPT2LMHeadModel");
    EXPECT_FAIL("unsupported architecture", dir, "config.json", "GPT2LMHeadModel",
                "LlamaForCausalLM");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    st_rewrite(p, edit_dtype, NULL, 0);
    EXPECT_FAIL("unsupported dtype", dir, "model.safetensors",
                "model.layers.0.self_attn.q_proj.weight", "I8");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    st_rewrite(p, edit_drop, "model.layers.2.self_attn.v_proj.bias", 0);
    EXPECT_FAIL("missing tensor", dir, "model.safetensors", "model.layers.2.self_attn.v_proj.bias");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    st_rewrite(p, edit_transpose, NULL, 0);
    EXPECT_FAIL("mis-shaped tensor", dir, "model.safetensors",
                "model.layers.1.mlp.gate_proj.weight", "[128, 352]", "expected [352, 128]");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    REQUIRE(truncate(p, 600000) == 0, "truncate");
    EXPECT_FAIL("truncated file", dir, "model.safetensors", "truncated", "tensor '");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    {
        size_t len;
        char *d = slurp(p, &len);
        uint64_t big = (uint64_t)len * 4;
        for (int i = 0; i < 8; i++) d[i] = (char)(big >> (8 * i));
        spit(p, d, len);
        free(d);
    }
    EXPECT_FAIL("header length beyond file", dir, "model.safetensors", "header length");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    double beyond = 1e9;
    st_rewrite(p, edit_offsets, &beyond, 0);
    EXPECT_FAIL("data_offsets beyond file", dir, "model.safetensors",
                "model.layers.1.mlp.up_proj.weight", "beyond");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    double shorter = -1;
    st_rewrite(p, edit_offsets, &shorter, 0);
    EXPECT_FAIL("data_offsets vs shape", dir, "model.safetensors",
                "model.layers.1.mlp.up_proj.weight", "needs 90112");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/config.json", dir);
    spit_str(p, "{\"architectures\": [\"Qwen2ForCausalLM\"], \"vocab_size\": 512,,}");
    EXPECT_FAIL("bad JSON in config", dir, "config.json", "invalid JSON");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    {
        size_t len;
        char *d = slurp(p, &len);
        char *colon = memchr(d + 8, ':', 200); /* first key/value separator -> garbage */
        REQUIRE(colon, "no ':' in header");
        *colon = '#';
        spit(p, d, len);
        free(d);
    }
    EXPECT_FAIL("bad JSON in header", dir, "model.safetensors", "not valid JSON");

    copy_model("mistral-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    unlink(p);
    EXPECT_FAIL("missing shard", dir, "model-00002-of-00002.safetensors", "tensor '",
                "model.safetensors.index.json");

    copy_model("mistral-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    json_rewrite(p, edit_index_norm, NULL);
    EXPECT_FAIL("shard lacks the tensor", dir, "model.norm.weight",
                "model-00001-of-00002.safetensors", "no such tensor");

    copy_model("qwen2-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_rewrite(p, edit_kv_heads, NULL);
    EXPECT_FAIL("heads not divisible", dir, "config.json", "num_key_value_heads (3)");

    copy_model("llama3-tiny", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/config.json", dir);
    json_rewrite(p, edit_rope, NULL);
    EXPECT_FAIL("unknown rope type", dir, "config.json", "dynamic", "llama3");

    snprintf(dir, sizeof dir, "%s/case%02d", tmp_root, tmp_seq++);
    REQUIRE(mkdir(dir, 0700) == 0, "mkdir");
    EXPECT_FAIL("no config", dir, "config.json");
    snprintf(p, sizeof p, "%s/models/qwen2-tiny/config.json", fixtures);
    char q[1200];
    snprintf(q, sizeof q, "%s/config.json", dir);
    copy_file(p, q);
    EXPECT_FAIL("no weights", dir, "model.safetensors");
}

int main(void)
{
    fixtures = kt_env("KR_FIXTURES");
    if (!fixtures) {
        fprintf(stderr, "KR_FIXTURES not set: skipped\n");
        return KT_SKIP;
    }
    const char *tmp = kt_env("TMPDIR");
    snprintf(tmp_root, sizeof tmp_root, "%s/kr_load_XXXXXX", tmp ? tmp : "/tmp");
    REQUIRE(mkdtemp(tmp_root), "mkdtemp %s", tmp_root);

    test_config_parse();
    test_safetensors_parse();
    test_llama3();
    test_qwen2();
    test_mistral();
    test_fingerprints();
    test_random();
    test_broken();

    rm_tree(tmp_root);
    return kt_done("test_model_load");
}
