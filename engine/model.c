/*
 * model.c - a Hugging Face checkpoint directory -> struct kr_model (weights ready for the forward
 * pass), plus random models of any shape for benchmarks.
 *
 * What it is: config.json (config.c) + model.safetensors or model.safetensors.index.json and its
 * shards (safetensors.c). Every tensor the architecture needs must exist with exactly the
 * expected shape; the big matrices stay memory-mapped in their checkpoint dtype (copied only when
 * misaligned, when the checkpoint mixes dtypes, or with opts.weights_f32), norm weights and
 * biases are converted to f32 in owned memory (an aligned f32 one is used in place). The fingerprint hashes the config's shape fields
 * and every used tensor's bytes as stored, so it does not depend on load options.
 * What it is not: the forward pass, a quantizer, or a writer. Tensors the model does not use
 * (e.g. rotary inv_freq buffers) are ignored.
 * Tests: tests/unit/test_model_load.c (fixtures and damaged copies of them).
 */
#include "kr-model.h"
#include "kr-util.h"
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* One opened checkpoint file; model->maps[n_maps] owns them. */
struct kr_mapping {
    kr_st_file *st;
    char *shard; /* file name as the index gives it (owned), or NULL for model.safetensors */
};

/* One tensor the model needs: HF name, expected shape, where it goes. */
typedef struct ld_spec {
    char name[96];
    kr_tensor *dst;
    int n_dims; /* 1: norms and biases (f32), 2: matrices (kept in the checkpoint dtype) */
    int64_t rows, cols; /* expected [rows][cols]; 1-D: [cols] */
    const char *what; /* the config fields behind the shape, for messages */
    const kr_st_tensor *src;
    const kr_st_file *file;
} ld_spec;

/* ------------------------------------------------------------------ ownership */

static void *model_alloc(kr_model *m, size_t bytes, char *err)
{
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? m->cap_owned * 2 : 64;
        void **grown = realloc(m->owned, (size_t)cap * sizeof *grown);
        if (!grown) {
            kr_errf(err, "out of memory");
            return NULL;
        }
        m->owned = grown;
        m->cap_owned = cap;
    }
    /* 64-byte aligned for the vector kernels; aligned_alloc wants a multiple of the alignment */
    void *p = kr_alloc_huge((bytes + 63) / 64 * 64 + 64);
    if (!p) {
        kr_errf(err, "out of memory allocating %zu bytes of weights", bytes);
        return NULL;
    }
    m->owned[m->n_owned++] = p;
    return p;
}

void kr_model_free(kr_model *m)
{
    if (!m) return;
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    for (int i = 0; i < m->n_maps; i++) {
        kr_st_close(m->maps[i].st);
        free(m->maps[i].shard);
    }
    free(m->maps);
    free(m->layers);
    free(m);
}

static kr_model *model_new(const kr_config *cfg, char *err)
{
    kr_model *m = calloc(1, sizeof *m);
    if (!m) {
        kr_errf(err, "out of memory");
        return NULL;
    }
    m->cfg = *cfg;
    m->layers = calloc((size_t)cfg->n_layers, sizeof *m->layers);
    if (!m->layers) {
        free(m);
        kr_errf(err, "out of memory");
        return NULL;
    }
    return m;
}

/* ------------------------------------------------------------------ accessors */

const kr_config *kr_model_config(const kr_model *m) { return &m->cfg; }
kr_dtype kr_model_weight_dtype(const kr_model *m) { return m->weight_dtype; }
size_t kr_model_weight_bytes(const kr_model *m) { return m->weight_bytes; }
const char *kr_model_fingerprint(const kr_model *m) { return m->fingerprint; }

/* ------------------------------------------------------------------ the tensor list */

/* Fills specs (room for 4 + 12 * n_layers) in a fixed order; returns the count. */
static int model_specs(kr_model *m, ld_spec *specs)
{
    const kr_config *c = &m->cfg;
    const int64_t d = c->hidden_size, f = c->intermediate_size, v = c->vocab_size;
    const int64_t q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    int n = 0;
#define SPEC(dst_, nd_, r_, c_, what_, ...)                                                    \
    do {                                                                                       \
        ld_spec *s_ = &specs[n++];                                                             \
        snprintf(s_->name, sizeof s_->name, __VA_ARGS__);                                      \
        s_->dst = (dst_);                                                                      \
        s_->n_dims = (nd_);                                                                    \
        s_->rows = (r_);                                                                       \
        s_->cols = (c_);                                                                       \
        s_->what = (what_);                                                                    \
        s_->src = NULL;                                                                        \
        s_->file = NULL;                                                                       \
    } while (0)
    SPEC(&m->embed, 2, v, d, "vocab_size, hidden_size", "model.embed_tokens.weight");
    for (int l = 0; l < c->n_layers; l++) {
        kr_layer_weights *L = &m->layers[l];
        const char *p = "model.layers";
        SPEC(&L->attn_norm, 1, 1, d, "hidden_size", "%s.%d.input_layernorm.weight", p, l);
        SPEC(&L->wq, 2, q, d, "num_attention_heads*head_dim, hidden_size",
             "%s.%d.self_attn.q_proj.weight", p, l);
        SPEC(&L->wk, 2, kv, d, "num_key_value_heads*head_dim, hidden_size",
             "%s.%d.self_attn.k_proj.weight", p, l);
        SPEC(&L->wv, 2, kv, d, "num_key_value_heads*head_dim, hidden_size",
             "%s.%d.self_attn.v_proj.weight", p, l);
        SPEC(&L->wo, 2, d, q, "hidden_size, num_attention_heads*head_dim",
             "%s.%d.self_attn.o_proj.weight", p, l);
        if (c->attn_bias) {
            SPEC(&L->bq, 1, 1, q, "num_attention_heads*head_dim", "%s.%d.self_attn.q_proj.bias",
                 p, l);
            SPEC(&L->bk, 1, 1, kv, "num_key_value_heads*head_dim", "%s.%d.self_attn.k_proj.bias",
                 p, l);
            SPEC(&L->bv, 1, 1, kv, "num_key_value_heads*head_dim", "%s.%d.self_attn.v_proj.bias",
                 p, l);
        }
        SPEC(&L->ffn_norm, 1, 1, d, "hidden_size", "%s.%d.post_attention_layernorm.weight", p, l);
        SPEC(&L->w_gate, 2, f, d, "intermediate_size, hidden_size", "%s.%d.mlp.gate_proj.weight",
             p, l);
        SPEC(&L->w_up, 2, f, d, "intermediate_size, hidden_size", "%s.%d.mlp.up_proj.weight", p,
             l);
        SPEC(&L->w_down, 2, d, f, "hidden_size, intermediate_size", "%s.%d.mlp.down_proj.weight",
             p, l);
    }
    SPEC(&m->final_norm, 1, 1, d, "hidden_size", "model.norm.weight");
    if (!c->tie_word_embeddings)
        SPEC(&m->lm_head, 2, v, d, "vocab_size, hidden_size", "lm_head.weight");
#undef SPEC
    return n;
}

/* ------------------------------------------------------------------ fingerprint */

/* FNV-1a over 64-bit words, four independent lanes so that the multiplies overlap; a pass over
 * the weights runs near memory speed. Not cryptographic: it tells checkpoints apart, nothing
 * more. */
#define KR_FNV_OFFSET 0xcbf29ce484222325ull
#define KR_FNV_PRIME 0x100000001b3ull

typedef struct kr_hash {
    uint64_t lane[4];
} kr_hash;

static void hash_init(kr_hash *h)
{
    for (int i = 0; i < 4; i++) h->lane[i] = KR_FNV_OFFSET ^ (uint64_t)i;
}

static void hash_u64(kr_hash *h, uint64_t v)
{
    h->lane[0] = (h->lane[0] ^ v) * KR_FNV_PRIME;
}

static void hash_bytes(kr_hash *h, const uint8_t *p, uint64_t n)
{
    uint64_t a = h->lane[0], b = h->lane[1], c = h->lane[2], d = h->lane[3];
    uint64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t w[4];
        memcpy(w, p + i, 32); /* p may be unaligned */
        a = (a ^ w[0]) * KR_FNV_PRIME;
        b = (b ^ w[1]) * KR_FNV_PRIME;
        c = (c ^ w[2]) * KR_FNV_PRIME;
        d = (d ^ w[3]) * KR_FNV_PRIME;
    }
    for (; i < n; i++) a = (a ^ p[i]) * KR_FNV_PRIME;
    h->lane[0] = a, h->lane[1] = b, h->lane[2] = c, h->lane[3] = d;
    hash_u64(h, n); /* so that moving bytes between tensors changes the digest */
}

static void hash_float(kr_hash *h, float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    hash_u64(h, u);
}

/* The fields that change what the model computes (not arch_name, bos/eos or torch_dtype). */
static void hash_config(kr_hash *h, const kr_config *c)
{
    const int ints[] = {(int)c->arch, c->vocab_size, c->hidden_size, c->intermediate_size,
                        c->n_layers, c->n_heads, c->n_kv_heads, c->head_dim, c->rope_llama3,
                        c->rope_original_max_pos, c->attn_bias, c->tie_word_embeddings,
                        c->sliding_window, c->sliding_window_first_layer};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) hash_u64(h, (uint64_t)ints[i]);
    hash_float(h, c->rope_theta);
    hash_float(h, c->rms_norm_eps);
    hash_float(h, c->rope_factor);
    hash_float(h, c->rope_low_freq_factor);
    hash_float(h, c->rope_high_freq_factor);
}

static void hash_final(kr_hash *h, char out[17])
{
    uint64_t x = KR_FNV_OFFSET;
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 8; k++) x = (x ^ ((h->lane[i] >> (8 * k)) & 0xff)) * KR_FNV_PRIME;
    snprintf(out, 17, "%016llx", (unsigned long long)x);
}

/* ------------------------------------------------------------------ conversion */

/* n elements of `from` at src (any alignment) -> `to` at dst (aligned). Only same-dtype copies
 * and upcasts to f32 are needed. */
static void convert(const uint8_t *src, kr_dtype from, size_t n, kr_dtype to, void *dst)
{
    if (from == to) {
        memcpy(dst, src, n * kr_dtype_size(from));
        return;
    }
    float *out = dst; /* to == F32 */
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        out[i] = from == KR_DTYPE_BF16 ? kr_bf16_to_f32(h) : kr_f16_to_f32(h);
    }
}

/* Points spec->dst at the tensor's bytes (in the mapping when possible) in dtype `to`. */
static int materialize(kr_model *m, const ld_spec *s, kr_dtype to, size_t *copied, char *err)
{
    const kr_st_tensor *t = s->src;
    size_t n = (size_t)(s->rows * s->cols);
    size_t esize = kr_dtype_size(t->dtype);
    const void *data = t->data;
    if (t->dtype != to || (uintptr_t)t->data % esize != 0) {
        void *buf = model_alloc(m, n * kr_dtype_size(to), err);
        if (!buf) return -1;
        convert(t->data, t->dtype, n, to, buf);
        data = buf;
        *copied += n * kr_dtype_size(to);
    }
    s->dst->data = data;
    s->dst->dtype = to;
    s->dst->rows = s->rows;
    s->dst->cols = s->cols;
    m->weight_bytes += n * kr_dtype_size(to);
    return KR_OK;
}

/* ------------------------------------------------------------------ finding tensors */

static int model_add_file(kr_model *m, kr_st_file *st, const char *shard, char *err)
{
    struct kr_mapping *grown = realloc(m->maps, (size_t)(m->n_maps + 1) * sizeof *grown);
    char *name = shard ? strdup(shard) : NULL;
    if (!grown || (shard && !name)) {
        if (grown) m->maps = grown;
        free(name);
        kr_st_close(st);
        return kr_errf(err, "out of memory");
    }
    m->maps = grown;
    m->maps[m->n_maps].st = st;
    m->maps[m->n_maps].shard = name;
    m->n_maps++;
    return KR_OK;
}

/* A shard name from the index must be a plain file name inside the model directory. */
static int shard_name_ok(const char *s)
{
    return s[0] && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* Resolves every spec through the index's weight_map, opening each shard once. */
static int find_sharded(kr_model *m, const char *dir, const char *index_path, ld_spec *specs,
                        int n_specs, char *err)
{
    char *text;
    size_t len;
    if (kr_read_file(index_path, &text, &len, err)) return -1;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root) {
        size_t at = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        kr_errf(err, "%s: invalid JSON near byte %zu", index_path, at);
        goto err_text;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        kr_errf(err, "%s: missing \"weight_map\" object", index_path);
        goto err_json;
    }
    for (int i = 0; i < n_specs; i++) {
        ld_spec *s = &specs[i];
        const cJSON *sh = cJSON_GetObjectItemCaseSensitive(wm, s->name);
        if (!sh) {
            kr_errf(err, "%s: missing tensor '%s' (not in weight_map)", index_path, s->name);
            goto err_json;
        }
        if (!cJSON_IsString(sh) || !shard_name_ok(sh->valuestring)) {
            kr_errf(err, "%s: weight_map gives tensor '%s' a shard that is not a file name in "
                    "the model directory", index_path, s->name);
            goto err_json;
        }
        const kr_st_file *file = NULL;
        for (int k = 0; k < m->n_maps && !file; k++)
            if (strcmp(m->maps[k].shard, sh->valuestring) == 0) file = m->maps[k].st;
        if (!file) {
            char path[4096], inner[KR_ERR_MAX];
            if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, sh->valuestring) >= sizeof path) {
                kr_errf(err, "%s: path too long", dir);
                goto err_json;
            }
            kr_st_file *st;
            if (kr_st_open(path, &st, inner)) {
                kr_errf(err, "%s: tensor '%s' is in shard '%s': %s", index_path, s->name,
                        sh->valuestring, inner);
                goto err_json;
            }
            if (model_add_file(m, st, sh->valuestring, err)) goto err_json;
            file = st;
        }
        s->file = file;
        s->src = kr_st_find(file, s->name);
        if (!s->src) {
            kr_errf(err, "%s: maps tensor '%s' to shard '%s', but %s has no such tensor",
                    index_path, s->name, sh->valuestring, file->path);
            goto err_json;
        }
    }
    cJSON_Delete(root);
    free(text);
    return KR_OK;

err_json:
    cJSON_Delete(root);
err_text:
    free(text);
    return -1;
}

static int find_tensors(kr_model *m, const char *dir, ld_spec *specs, int n_specs, char *err)
{
    char path[4096];
    if ((size_t)snprintf(path, sizeof path, "%s/model.safetensors", dir) >= sizeof path)
        return kr_errf(err, "%s: path too long", dir);
    if (access(path, F_OK) != 0) {
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        if (access(path, F_OK) != 0)
            return kr_errf(err, "%s: no model.safetensors or model.safetensors.index.json (only "
                           "safetensors checkpoints are supported)", dir);
        return find_sharded(m, dir, path, specs, n_specs, err);
    }
    kr_st_file *st;
    if (kr_st_open(path, &st, err)) return -1;
    if (model_add_file(m, st, NULL, err)) return -1;
    for (int i = 0; i < n_specs; i++) {
        specs[i].file = st;
        specs[i].src = kr_st_find(st, specs[i].name);
        if (!specs[i].src)
            return kr_errf(err, "%s: missing tensor '%s' (needed by %s with %d layers)", path,
                           specs[i].name, m->cfg.arch_name, m->cfg.n_layers);
    }
    return KR_OK;
}

/* dtype and exact shape of every found tensor */
static int check_specs(const ld_spec *specs, int n_specs, char *err)
{
    for (int i = 0; i < n_specs; i++) {
        const ld_spec *s = &specs[i];
        const kr_st_tensor *t;
        if (kr_st_get(s->file, s->name, &t, err)) return -1;
        int64_t want[2] = {s->rows, s->cols};
        const int64_t *w = s->n_dims == 2 ? want : want + 1;
        int ok = t->n_dims == s->n_dims;
        for (int k = 0; ok && k < s->n_dims; k++) ok = t->shape[k] == w[k];
        if (!ok) {
            char got[160], exp[64];
            return kr_errf(err, "%s: tensor '%s' has shape %s, expected %s (%s)", s->file->path,
                           s->name, kr_st_shape_str(t->shape, t->n_dims, got, sizeof got),
                           kr_st_shape_str(w, s->n_dims, exp, sizeof exp), s->what);
        }
    }
    return KR_OK;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int kr_model_load(const char *dir, const kr_model_opts *opts, kr_model **out, char *err)
{
    kr_model_opts o = {0};
    if (opts) o = *opts;
    double t0 = now_s();
    kr_config cfg;
    if (kr_config_load(dir, &cfg, err)) return -1;
    kr_model *m = model_new(&cfg, err);
    if (!m) return -1;
    ld_spec *specs = malloc((size_t)(4 + 12 * cfg.n_layers) * sizeof *specs);
    if (!specs) {
        kr_errf(err, "out of memory");
        goto err_model;
    }
    int n_specs = model_specs(m, specs);
    if (find_tensors(m, dir, specs, n_specs, err)) goto err_specs;
    if (check_specs(specs, n_specs, err)) goto err_specs;

    /* The matrices keep their checkpoint dtype if they all share one. */
    kr_dtype wdt = KR_DTYPE_F32;
    int first = 1, mixed = 0;
    uint64_t file_bytes = 0;
    for (int i = 0; i < n_specs; i++) {
        file_bytes += specs[i].src->nbytes;
        if (specs[i].n_dims != 2) continue;
        if (first) wdt = specs[i].src->dtype;
        else if (specs[i].src->dtype != wdt) mixed = 1;
        first = 0;
    }
    if (mixed || o.weights_f32) wdt = KR_DTYPE_F32;
    if (o.verbose)
        fprintf(stderr, "kvrelay: loading %s (%s, %d layers): %d tensors from %d file(s), "
                "%.1f MiB%s ...\n", dir, cfg.arch_name, cfg.n_layers, n_specs, m->n_maps,
                (double)file_bytes / (1 << 20), mixed ? " (mixed dtypes: converting to F32)"
                : o.weights_f32 ? " (converting to F32)" : "");

    kr_hash h;
    size_t copied = 0;
    hash_init(&h);
    hash_config(&h, &cfg);
    for (int i = 0; i < n_specs; i++) {
        const ld_spec *s = &specs[i];
        if (materialize(m, s, s->n_dims == 2 ? wdt : KR_DTYPE_F32, &copied, err)) goto err_specs;
        hash_u64(&h, (uint64_t)s->src->dtype);
        hash_bytes(&h, s->src->data, s->src->nbytes);
    }
    hash_final(&h, m->fingerprint);
    if (cfg.tie_word_embeddings) m->lm_head = m->embed;
    m->weight_dtype = wdt;
    free(specs);
    if (o.verbose)
        fprintf(stderr, "kvrelay: loaded in %.2f s: weights %s, %.1f MiB held (%.1f MiB copied), "
                "fingerprint %s\n", now_s() - t0, kr_dtype_name(wdt),
                (double)m->weight_bytes / (1 << 20), (double)copied / (1 << 20), m->fingerprint);
    *out = m;
    return KR_OK;

err_specs:
    free(specs);
err_model:
    kr_model_free(m);
    return -1;
}

/* ------------------------------------------------------------------ random models */

/* Deterministic fill, independent of the thread count: the weights are cut into blocks of
 * KR_RAND_BLOCK elements, each seeded from (seed, tensor, block). */
#define KR_RAND_BLOCK (1 << 16)

typedef struct rand_job {
    kr_tensor **tensors;
    int n_tensors;
    uint64_t seed;
    int nth;
    int ith;
} rand_job;

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Elements [lo, hi) of data, uniform in [-a, a) with a = 0.02 * sqrt(3) (standard deviation
 * 0.02, like HF's init). xorshift64 fills a small buffer of 16-bit draws, and a separate
 * branch-free loop (which the compiler vectorises) scales and converts them: a few GB/s per core.
 * bf16 is truncated, not rounded: it is noise either way. */
static void rand_block(void *data, kr_dtype dt, size_t lo, size_t hi, uint64_t state)
{
    const float scale = 0.0346410162f / 32768.0f;
    int16_t draws[1024];
    float v[1024];
    uint64_t st[4]; /* four independent streams: their latency chains overlap */
    for (int j = 0; j < 4; j++) st[j] = splitmix64(state + (uint64_t)j) | 1;
    for (size_t i = lo; i < hi; i += 1024) {
        size_t n = hi - i < 1024 ? hi - i : 1024;
        for (size_t k = 0; k < 1024; k += 16)
            for (int j = 0; j < 4; j++) {
                st[j] ^= st[j] << 13;
                st[j] ^= st[j] >> 7;
                st[j] ^= st[j] << 17;
                memcpy(&draws[k + 4 * (size_t)j], &st[j], 8);
            }
        for (size_t k = 0; k < 1024; k++) v[k] = (float)draws[k] * scale;
        if (dt == KR_DTYPE_F32) {
            memcpy((float *)data + i, v, n * 4);
        } else if (dt == KR_DTYPE_BF16) {
            uint16_t *o = (uint16_t *)data + i;
            uint32_t u[1024];
            memcpy(u, v, sizeof u);
            for (size_t k = 0; k < n; k++) o[k] = (uint16_t)(u[k] >> 16);
        } else {
            uint16_t *o = (uint16_t *)data + i;
            for (size_t k = 0; k < n; k++) o[k] = kr_f32_to_f16(v[k]);
        }
    }
}

/* Thread ith takes a contiguous run of blocks (first touch of neighbouring pages from
 * different threads contends in the kernel). */
static void *rand_worker(void *arg)
{
    const rand_job *j = arg;
    uint64_t total = 0;
    for (int t = 0; t < j->n_tensors; t++) {
        size_t n = (size_t)(j->tensors[t]->rows * j->tensors[t]->cols);
        total += (n + KR_RAND_BLOCK - 1) / KR_RAND_BLOCK;
    }
    uint64_t first = total * (uint64_t)j->ith / (uint64_t)j->nth;
    uint64_t last = total * (uint64_t)(j->ith + 1) / (uint64_t)j->nth;
    uint64_t block_id = 0;
    for (int t = 0; t < j->n_tensors && block_id < last; t++) {
        const kr_tensor *x = j->tensors[t];
        size_t n = (size_t)(x->rows * x->cols);
        for (size_t lo = 0; lo < n; lo += KR_RAND_BLOCK, block_id++) {
            if (block_id < first || block_id >= last) continue;
            size_t hi = lo + KR_RAND_BLOCK < n ? lo + KR_RAND_BLOCK : n;
            uint64_t s = splitmix64(j->seed ^ splitmix64(((uint64_t)t << 40) ^ lo));
            rand_block((void *)x->data, x->dtype, lo, hi, s);
        }
    }
    return NULL;
}

int kr_model_random(const kr_config *cfg, kr_dtype dtype, uint64_t seed, kr_model **out,
                    char *err)
{
    if (kr_config_check(cfg, "random model config", err)) return -1;
    if (dtype != KR_DTYPE_F32 && dtype != KR_DTYPE_F16 && dtype != KR_DTYPE_BF16)
        return kr_errf(err, "random model: dtype %d is not one of F32, F16, BF16", (int)dtype);
    kr_model *m = model_new(cfg, err);
    if (!m) return -1;
    ld_spec *specs = malloc((size_t)(4 + 12 * cfg->n_layers) * sizeof *specs);
    kr_tensor **mats = malloc((size_t)(4 + 12 * cfg->n_layers) * sizeof *mats);
    if (!specs || !mats) {
        kr_errf(err, "out of memory");
        goto err_specs;
    }
    int n_specs = model_specs(m, specs), n_mats = 0;
    uint64_t vstate = splitmix64(seed ^ 0x5eed);
    for (int i = 0; i < n_specs; i++) {
        const ld_spec *s = &specs[i];
        kr_dtype dt = s->n_dims == 2 ? dtype : KR_DTYPE_F32;
        size_t n = (size_t)(s->rows * s->cols);
        void *buf = model_alloc(m, n * kr_dtype_size(dt), err);
        if (!buf) goto err_specs;
        *s->dst = (kr_tensor){.data = buf, .dtype = dt, .rows = s->rows, .cols = s->cols};
        m->weight_bytes += n * kr_dtype_size(dt);
        if (s->n_dims == 2) {
            mats[n_mats++] = s->dst;
        } else if (strstr(s->name, ".bias")) {
            rand_block(buf, KR_DTYPE_F32, 0, n, vstate = splitmix64(vstate));
        } else {
            for (size_t k = 0; k < n; k++) ((float *)buf)[k] = 1.0f; /* norms */
        }
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nth = ncpu < 1 ? 1 : ncpu > 64 ? 64 : (int)ncpu;
    rand_job jobs[64];
    pthread_t tids[64];
    int started[64] = {0};
    for (int t = 0; t < nth; t++)
        jobs[t] = (rand_job){.tensors = mats, .n_tensors = n_mats, .seed = seed, .nth = nth,
                             .ith = t};
    for (int t = 1; t < nth; t++)
        started[t] = pthread_create(&tids[t], NULL, rand_worker, &jobs[t]) == 0;
    for (int t = 0; t < nth; t++)
        if (t == 0 || !started[t]) rand_worker(&jobs[t]); /* a thread that did not start */
    for (int t = 1; t < nth; t++)
        if (started[t]) pthread_join(tids[t], NULL);
    if (cfg->tie_word_embeddings) m->lm_head = m->embed;
    m->weight_dtype = dtype;
    /* Identified by what generated it, not by a pass over (possibly many GiB of) bytes. */
    kr_hash h;
    hash_init(&h);
    hash_config(&h, cfg);
    hash_u64(&h, 0x72616e646f6dull); /* "random" */
    hash_u64(&h, (uint64_t)dtype);
    hash_u64(&h, seed);
    hash_final(&h, m->fingerprint);
    free(mats);
    free(specs);
    *out = m;
    return KR_OK;

err_specs:
    free(mats);
    free(specs);
    kr_model_free(m);
    return -1;
}
