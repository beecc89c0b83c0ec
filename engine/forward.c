/*
 * forward.c - the transformer forward pass (Llama / Mistral / Qwen2), written once against the
 * backend op table: embedding, per layer RMSNorm -> q/k/v (+bias) -> RoPE -> KV store ->
 * attention over the paged cache -> o_proj + residual -> RMSNorm -> SiLU-gated MLP + residual,
 * final RMSNorm, lm_head. Chunked prefill is repeated calls; decode is a call with one token.
 * It also keeps the KV footprint tally (DESIGN.md section 1) of every query token it runs, and
 * after each layer's attention trims the cache: during kr_prefill the sequence's eviction
 * policy (policy.h) runs its chunk rule; during decode (kr_forward, kr_forward_batch) no policy
 * runs: one rule, the same for every list whatever the policy, applies each list's
 * kr_list_rule. kr_forward_batch runs the same layer
 * loop over one row per sequence (continuous batching): weights once for all rows, cache,
 * tallies and policy per sequence, each row bit-identical to decoding its sequence alone.
 * kr_prefill_layers tells its caller, in the prompt's last chunk, when leading layers' lists
 * are final, so a prefill node can ship them while the later layers still compute.
 * What it is not: a scheduler (which sequences share a step is the caller's business).
 */
#include "kr-kv.h"
#include "kr-model.h"
#include "kr-util.h"
#include "policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Rows of one call that belong to one sequence: n_real tokens, then appended observers. */
typedef struct seq_rows {
    kr_seq *s;
    int row; /* first row of the call */
    int n; /* rows */
    int n_real;
    int64_t held; /* entries the sequence holds, for the peak tally */
} seq_rows;

struct kr_ctx {
    const kr_model *model;
    const kr_backend_ops *ops;
    kr_backend *be;
    int max_chunk;
    kr_dtype kv_dtype; /* of the pools kr_ctx_kv_pool_create makes */
    float *inv_freq; /* [head_dim/2], host */
    float *cos_sin; /* [max_chunk][head_dim/2][2], host */
    int32_t *pos; /* [max_chunk] */
    seq_rows *batch; /* [max_chunk]: a decode batch's sequences */
    /* activations, backend memory */
    float *x; /* [max_chunk][d] residual stream */
    float *xn; /* [max_chunk][d] normed */
    float *q; /* [max_chunk][n_heads*head_dim] */
    float *k; /* [max_chunk][n_kv_heads*head_dim] */
    float *v; /* [max_chunk][n_kv_heads*head_dim] */
    float *att; /* [max_chunk][n_heads*head_dim] */
    float *gate; /* [max_chunk][f] */
    float *up; /* [max_chunk][f] */
    float *logits; /* [LOGIT_ROWS][vocab] */
    int rows; /* rows the activations hold: max_chunk, more once a policy appends observers */
    kr_evict_env env; /* host scratch for the policies' scoring, grown to the longest list */
};

/* Logits are computed this many rows at a time, so the buffer stays small for large
 * vocabularies (128k x 64 rows x 4 bytes = 32 MiB) whatever the chunk size. */
enum { LOGIT_ROWS = KR_SCORE_ROWS };

/* HF's default RoPE inverse frequencies, then the llama3 rescaling when configured
 * (transformers' _compute_llama3_parameters), in float32 as HF computes them. */
static void rope_inv_freq(const kr_config *cfg, float *inv)
{
    const int half = cfg->head_dim / 2;
    for (int i = 0; i < half; i++) {
        float expo = (float)(2 * i) / (float)cfg->head_dim;
        inv[i] = 1.0f / powf(cfg->rope_theta, expo);
    }
    if (!cfg->rope_llama3) return;
    const float old_ctx = (float)cfg->rope_original_max_pos;
    const float low_wl = old_ctx / cfg->rope_low_freq_factor;
    const float high_wl = old_ctx / cfg->rope_high_freq_factor;
    for (int i = 0; i < half; i++) {
        float wl = 2.0f * (float)M_PI / inv[i];
        float f = wl > low_wl ? inv[i] / cfg->rope_factor : inv[i];
        if (!(wl < high_wl) && !(wl > low_wl)) {
            float smooth = (old_ctx / wl - cfg->rope_low_freq_factor) /
                           (cfg->rope_high_freq_factor - cfg->rope_low_freq_factor);
            f = (1.0f - smooth) * f / cfg->rope_factor + smooth * f;
        }
        inv[i] = f;
    }
}

static void free_rows(kr_ctx *c)
{
    float **acts[] = {&c->x, &c->xn, &c->q, &c->k, &c->v, &c->att, &c->gate, &c->up, &c->logits};
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) {
        if (*acts[i]) c->ops->act_free(c->be, *acts[i]);
        *acts[i] = NULL;
    }
    free(c->cos_sin);
    free(c->pos);
    free(c->batch);
    c->cos_sin = NULL;
    c->pos = NULL;
    c->batch = NULL;
    c->rows = 0;
}

/* Sizes the per-row buffers for `rows` tokens per call; done at creation and again only if a
 * policy's appended observers need more rows (once per context, not per call). */
static int ensure_rows(kr_ctx *c, int rows, char *err)
{
    if (rows <= c->rows) return KR_OK;
    free_rows(c);
    const kr_config *cfg = &c->model->cfg;
    const size_t d = (size_t)cfg->hidden_size, f = (size_t)cfg->intermediate_size;
    const size_t qd = (size_t)cfg->n_heads * cfg->head_dim, kvd = (size_t)cfg->n_kv_heads * cfg->head_dim;
    const size_t n = (size_t)rows, half = (size_t)cfg->head_dim / 2;
    c->cos_sin = malloc(n * half * 2 * sizeof(float));
    c->pos = malloc(n * sizeof(int32_t));
    c->batch = malloc(n * sizeof(seq_rows));
    c->x = c->ops->act_alloc(c->be, n * d);
    c->xn = c->ops->act_alloc(c->be, n * d);
    c->q = c->ops->act_alloc(c->be, n * qd);
    c->k = c->ops->act_alloc(c->be, n * kvd);
    c->v = c->ops->act_alloc(c->be, n * kvd);
    c->att = c->ops->act_alloc(c->be, n * qd);
    c->gate = c->ops->act_alloc(c->be, n * f);
    c->up = c->ops->act_alloc(c->be, n * f);
    c->logits = c->ops->act_alloc(c->be, (n < LOGIT_ROWS ? n : LOGIT_ROWS) * (size_t)cfg->vocab_size);
    if (!c->cos_sin || !c->pos || !c->batch || !c->x || !c->xn || !c->q || !c->k || !c->v || !c->att ||
        !c->gate || !c->up || !c->logits) {
        free_rows(c);
        return kr_errf(err, "context: out of memory for activations of %d tokens", rows);
    }
    c->rows = rows;
    return KR_OK;
}

/* Grows the policies' host scratch to lists of `cap` entries. */
static int ensure_env(kr_ctx *c, int cap, char *err)
{
    if (cap <= c->env.cap) return KR_OK;
    cap = cap < 2 * c->env.cap ? 2 * c->env.cap : cap;
    float *scores = realloc(c->env.scores, sizeof(float) * (size_t)c->model->cfg.n_heads * (size_t)cap);
    if (scores) c->env.scores = scores;
    int32_t *idx = realloc(c->env.idx, sizeof(int32_t) * 3 * (size_t)cap);
    if (idx) c->env.idx = idx;
    if (!scores || !idx) return kr_errf(err, "policy: out of memory for scores of %d entries", cap);
    c->env.cap = cap;
    return KR_OK;
}

void kr_ctx_free(kr_ctx *c)
{
    if (!c) return;
    if (c->be) {
        free_rows(c);
        c->ops->destroy(c->be);
    }
    free(c->inv_freq);
    free(c->env.scores);
    free(c->env.idx);
    free(c);
}

static int backend_stores(const kr_backend_ops *ops, kr_dtype t)
{
    return t == KR_DTYPE_F32 || ((ops->kv_dtypes >> t) & 1u);
}

static const char *backend_title(const kr_backend_ops *ops)
{
    return !strcmp(ops->name, "cuda") ? "CUDA" : !strcmp(ops->name, "cpu") ? "CPU" : ops->name;
}

/* as the tools' --kv-cache-dtype spells it */
static const char *kv_name(kr_dtype t)
{
    return t == KR_DTYPE_BF16 ? "bf16" : t == KR_DTYPE_F16 ? "f16" : "f32";
}

/* kr_ctx_params.kv_dtype for a model on a backend: auto is the weights' dtype where the backend
 * stores it, else f32; a dtype asked for by name must be one the backend stores. */
static int resolve_kv_dtype(const kr_backend_ops *ops, const kr_model *m, kr_kv_dtype want, kr_dtype *out,
                            char *err)
{
    kr_dtype t;
    switch (want) {
    case KR_KV_DTYPE_AUTO:
        t = m->weight_dtype;
        *out = backend_stores(ops, t) ? t : KR_DTYPE_F32;
        return KR_OK;
    case KR_KV_DTYPE_F32: t = KR_DTYPE_F32; break;
    case KR_KV_DTYPE_F16: t = KR_DTYPE_F16; break;
    case KR_KV_DTYPE_BF16: t = KR_DTYPE_BF16; break;
    default: return kr_errf(err, "context: KV cache dtype %d is not one of auto, f32, f16, bf16", (int)want);
    }
    if (!backend_stores(ops, t))
        return kr_errf(err, "KV cache dtype %s is not supported by the %s backend",
                       kv_name(t), backend_title(ops));
    *out = t;
    return KR_OK;
}

int kr_ctx_create(const kr_model *m, const kr_ctx_params *p, kr_ctx **out, char *err)
{
    kr_ctx_params def = {.backend = KR_BACKEND_CPU, .n_threads = 0, .max_chunk = 0};
    if (!p) p = &def;
#ifdef KR_HAVE_CUDA
    const kr_backend_ops *ops = p->backend == KR_BACKEND_CUDA ? &kr_cuda_backend : &kr_cpu_backend;
#else
    const kr_backend_ops *ops = &kr_cpu_backend;
    if (p->backend != KR_BACKEND_CPU)
        return kr_errf(err, "backend 'cuda' is not available in this build (use --backend cpu)");
#endif
    const kr_config *cfg = &m->cfg;
    int threads = p->n_threads > 0 ? p->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (threads < 1) threads = 1;
    int chunk = p->max_chunk > 0 ? p->max_chunk : 512;
    kr_dtype kv_dtype = KR_DTYPE_F32;
    if (resolve_kv_dtype(ops, m, p->kv_dtype, &kv_dtype, err) != KR_OK) return -1;
    kr_ctx *c = calloc(1, sizeof *c);
    if (!c) return kr_errf(err, "context: out of memory");
    c->model = m;
    c->ops = ops;
    c->max_chunk = chunk;
    c->kv_dtype = kv_dtype;
    if (c->ops->create(m, threads, chunk, &c->be, err) != KR_OK) {
        free(c);
        return -1;
    }
    c->inv_freq = malloc((size_t)cfg->head_dim / 2 * sizeof(float));
    if (!c->inv_freq) {
        kr_ctx_free(c);
        return kr_errf(err, "context: out of memory");
    }
    if (ensure_rows(c, chunk, err) != KR_OK) {
        kr_ctx_free(c);
        return -1;
    }
    rope_inv_freq(cfg, c->inv_freq);
    c->env.ops = c->ops;
    c->env.be = c->be;
    c->env.inv_freq = c->inv_freq;
    *out = c;
    return KR_OK;
}

int kr_ctx_n_threads(const kr_ctx *c)
{
    return c->ops->n_threads(c->be);
}

/* kv.c's allocator signature over the context's backend op */
typedef struct kv_alloc_ctx {
    const kr_backend_ops *ops;
    kr_backend *be;
} kv_alloc_ctx;

static void *kv_alloc_via(void *ctx, size_t bytes)
{
    const kv_alloc_ctx *a = ctx;
    return a->ops->kv_alloc(a->be, bytes);
}

kr_dtype kr_ctx_kv_dtype(const kr_ctx *c)
{
    return c->kv_dtype;
}

int kr_ctx_kv_pool_create(const kr_ctx *c, int block_size, int n_blocks, kr_kv_pool **out, char *err)
{
    const int hd = c->model->cfg.head_dim;
    if (!c->ops->kv_alloc) return kr_kv_pool_create(hd, block_size, n_blocks, c->kv_dtype, out, err);
    kv_alloc_ctx a = {.ops = c->ops, .be = c->be};
    return kr_kv_pool_create_in(hd, block_size, n_blocks, c->kv_dtype, kv_alloc_via, &a, c->ops->kv_free, out,
                                err);
}

static void fill_rope(kr_ctx *c, int n)
{
    const int half = c->model->cfg.head_dim / 2;
    for (int t = 0; t < n; t++) {
        float *cs = c->cos_sin + (size_t)t * half * 2;
        for (int i = 0; i < half; i++) {
            float angle = (float)c->pos[t] * c->inv_freq[i];
            cs[2 * i] = (float)cos((double)angle);
            cs[2 * i + 1] = (float)sin((double)angle);
        }
    }
}

/* The footprint of one layer's queries: token t attends the entries it sees (len - n + t + 1,
 * less those a sliding window hides); full causal attention would attend pos + 1. Only the
 * first n_real rows are query steps (appended observers are not). */
static void tally_footprint(kr_seq *s, int layer, int n, int n_real, const int32_t *pos, int window)
{
    for (int g = 0; g < s->n_kv_heads; g++) {
        const kr_kv_list *list = kr_seq_list(s, layer, g);
        for (int t = 0; t < n_real; t++) {
            int visible = list->len - n + t + 1;
            int start = window > 0 ? kr_kv_list_first_after(s->pool, list, visible, pos[t] - window) : 0;
            s->fp.attended += (double)(visible - start);
            s->fp.full += (double)(pos[t] + 1);
        }
    }
}

/* One prefill chunk as forward_rows passes it to the policy; NULL for decode calls, which get
 * the decode rule instead. In the last chunk, final_fn (may be NULL) hears which leading layers
 * are final (kr_prefill_layers). */
typedef struct chunk_info {
    int start, n_prompt, last;
    kr_layers_final_fn final_fn;
    void *final_arg;
} chunk_info;

/* The policy's chunk rule for one layer, then dropping appended observers. */
static int run_policy(kr_ctx *c, kr_seq *s, int layer, int n_real, int n_app, const chunk_info *ci,
                      char *err)
{
    const kr_policy *p = s->policy;
    int longest = 0;
    for (int g = 0; g < s->n_kv_heads; g++) {
        int len = kr_seq_list(s, layer, g)->len;
        longest = len > longest ? len : longest;
    }
    if (ensure_env(c, longest, err) != KR_OK) return -1;
    if (c->ops->sync) c->ops->sync(c->be); /* the rule reads and moves cache entries on the host */
    kr_chunk kc = {.q = c->q, .n_real = n_real, .n_appended = n_app, .start = ci->start,
                   .n_prompt = ci->n_prompt, .last = ci->last};
    p->ops->after_chunk(p, s, &c->env, &kc, layer);
    if (n_app)
        for (int g = 0; g < s->n_kv_heads; g++) {
            const kr_kv_list *l = kr_seq_list(s, layer, g);
            const int pinned = l->pinned;
            kr_seq_keep_ends(s, layer, g, l->len - n_app, 0);
            kr_seq_pin(s, layer, g, pinned);
        }
    return KR_OK;
}

/* After layer `layer` of the prompt's last chunk (its policy hook included): tells final_fn how
 * many leading layers are final when that is more than it was last told (*told). The policy's
 * final_layers op knows (TAKE prunes its warm-up layers late); otherwise each layer is final
 * once its own hook ran. The last layer makes every layer final whatever the op says, so the
 * n_layers call always comes, before any logits. */
/* Calls the caller's layers-final callback with the cache readable on the host. */
static int tell_final(kr_ctx *c, kr_seq *s, int n_final, const chunk_info *ci, char *err)
{
    if (c->ops->sync) c->ops->sync(c->be); /* the caller reads the final lists on the host */
    char why[KR_ERR_MAX] = "";
    if (ci->final_fn(ci->final_arg, s, n_final, why) != KR_OK)
        return kr_errf(err, "%s",
                       why[0] ? why : "prefill: the layers-final callback failed without a message");
    return KR_OK;
}

static int announce_final(kr_ctx *c, kr_seq *s, int layer, const chunk_info *ci, int *told, char *err)
{
    const kr_policy *p = s->policy;
    int n_final = p && p->ops->final_layers ? p->ops->final_layers(p, s, layer) : layer + 1;
    if (layer == s->n_layers - 1) n_final = s->n_layers;
    if (n_final <= *told) return KR_OK;
    if (tell_final(c, s, n_final, ci, err) != KR_OK) return -1;
    *told = n_final;
    return KR_OK;
}


/* The decode rule (kr_list_rule in kr.h) on every list of one layer after a decode step: the
 * pinned set grows to the first `sink` entries, the rest is pruned by Algorithm 1 with S = the
 * pinned count, and pos=rel lists get positions 0..len-1. Allocates nothing. */
static void decode_trim(kr_ctx *c, kr_seq *s, int layer)
{
    int synced = 0;
    for (int g = 0; g < s->n_kv_heads; g++) {
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        const kr_list_rule *r = &l->rule;
        kr_seq_pin(s, layer, g, r->sink > l->pinned ? r->sink : l->pinned);
        const int head = l->pinned;
        int target = r->window < 0 ? -1
                                   : kr_streaming_target(l->len, head, r->window, r->lazy, r->slack, r->max_drop);
        if ((target >= 0 || r->rel) && !synced && c->ops->sync) {
            c->ops->sync(c->be); /* the rule moves cache entries on the host */
            synced = 1;
        }
        if (target >= 0) kr_seq_keep_ends(s, layer, g, head, target - head);
        if (r->rel) kr_policy_rerotate(s, &c->env, layer, g);
    }
    /* positions restart after the cache: a pos=rel sequence's next token follows its lists */
    const kr_kv_list *first = kr_seq_list(s, layer, 0);
    if (layer == s->n_layers - 1 && first->rule.rel) s->next_pos = first->len;
}

/* Every layer over the call's n rows (rows in c->x, positions in c->pos, cos/sin filled). One
 * sequence (n_seqs == 1) attends as a chunk; a decode batch (`seqs`, one row each) attends with
 * the batch op and multiplies weights with matmul_rows, so each row rounds as it would alone.
 * Cache, footprint, peak and policy work is per sequence. */
static int run_layers(kr_ctx *c, seq_rows *sr, int n_seqs, kr_seq *const *seqs, int n,
                      const chunk_info *ci, char *err)
{
    const kr_model *m = c->model;
    const kr_config *cfg = &m->cfg;
    const kr_backend_ops *ops = c->ops;
    kr_backend *be = c->be;
    const int d = cfg->hidden_size, hd = cfg->head_dim;
    const size_t kvd = (size_t)cfg->n_kv_heads * hd;
    void (*mm)(kr_backend *, const kr_tensor *, const kr_tensor *, const float *, int, int, float *) =
        seqs ? ops->matmul_rows : ops->matmul;
    for (int i = 0; i < n_seqs; i++) sr[i].held = kr_seq_entries(sr[i].s);
    int told = 0; /* leading layers final_fn was told are final */
    for (int l = 0; l < cfg->n_layers; l++) {
        const kr_layer_weights *w = &m->layers[l];
        ops->rmsnorm(be, c->x, &w->attn_norm, n, d, cfg->rms_norm_eps, c->xn);
        mm(be, &w->wq, &w->bq, c->xn, n, 0, c->q);
        mm(be, &w->wk, &w->bk, c->xn, n, 0, c->k);
        mm(be, &w->wv, &w->bv, c->xn, n, 0, c->v);
        ops->rope(be, c->q, n, cfg->n_heads, hd, c->cos_sin);
        ops->rope(be, c->k, n, cfg->n_kv_heads, hd, c->cos_sin);
        const int window = cfg->sliding_window > 0 && l >= cfg->sliding_window_first_layer
                               ? cfg->sliding_window : 0;
        for (int i = 0; i < n_seqs; i++) {
            /* peak KV: what the cache holds at the moment a layer attends, before the policy trims */
            kr_seq *s = sr[i].s;
            for (int g = 0; g < cfg->n_kv_heads; g++) {
                kr_seq_extend(s, l, g, sr[i].n);
                const int len = kr_seq_list(s, l, g)->len;
                if (len > s->fp.peak_head_entries) s->fp.peak_head_entries = len;
            }
            sr[i].held += (int64_t)sr[i].n * cfg->n_kv_heads;
            if (sr[i].held > s->fp.peak_entries) s->fp.peak_entries = sr[i].held;
            const int32_t *pos = c->pos + sr[i].row;
            ops->kv_store(be, s, l, c->k + sr[i].row * kvd, c->v + sr[i].row * kvd, sr[i].n, pos);
            tally_footprint(s, l, sr[i].n, sr[i].n_real, pos, window);
        }
        if (seqs)
            ops->attention_batch(be, (const kr_seq *const *)seqs, l, c->q, n, cfg->n_heads, c->pos,
                                 window, c->att);
        else
            ops->attention(be, sr[0].s, l, c->q, n, cfg->n_heads, c->pos, window, c->att);
        for (int i = 0; i < n_seqs; i++) {
            kr_seq *s = sr[i].s;
            if (!ci) {
                decode_trim(c, s, l);
            } else if (s->policy) {
                /* a policy may trim earlier layers too (TAKE's delayed eviction) */
                if (run_policy(c, s, l, sr[i].n_real, sr[i].n - sr[i].n_real, ci, err) != KR_OK) return -1;
            }
            sr[i].held = kr_seq_entries(s);
        }
        /* a prefill chunk is one sequence (n_seqs == 1) */
        if (ci && ci->last && ci->final_fn && announce_final(c, sr[0].s, l, ci, &told, err) != KR_OK)
            return -1;
        mm(be, &w->wo, NULL, c->att, n, 1, c->x);
        ops->rmsnorm(be, c->x, &w->ffn_norm, n, d, cfg->rms_norm_eps, c->xn);
        mm(be, &w->w_gate, NULL, c->xn, n, 0, c->gate);
        mm(be, &w->w_up, NULL, c->xn, n, 0, c->up);
        ops->swiglu(be, c->gate, c->up, (size_t)n * cfg->intermediate_size);
        mm(be, &w->w_down, NULL, c->gate, n, 1, c->x);
    }
    if (ops->sync) ops->sync(be); /* callers may read the cache on the host (sequence export) */
    return KR_OK;
}

/* Logits of rows [first, first + rows) of the residual stream into host `logits`. */
static void compute_logits(kr_ctx *c, int first, int rows, int rows_alone, float *logits)
{
    const kr_model *m = c->model;
    const kr_config *cfg = &m->cfg;
    const kr_backend_ops *ops = c->ops;
    const int d = cfg->hidden_size;
    ops->rmsnorm(c->be, c->x + (size_t)first * d, &m->final_norm, rows, d, cfg->rms_norm_eps, c->xn);
    for (int r0 = 0; r0 < rows; r0 += LOGIT_ROWS) {
        int nr = rows - r0 < LOGIT_ROWS ? rows - r0 : LOGIT_ROWS;
        (rows_alone ? ops->matmul_rows : ops->matmul)(c->be, &m->lm_head, NULL, c->xn + (size_t)r0 * d,
                                                        nr, 0, c->logits);
        ops->to_host(c->be, c->logits, (size_t)nr * cfg->vocab_size, logits + (size_t)r0 * cfg->vocab_size);
    }
}

static int check_seq_shape(const kr_ctx *c, const kr_seq *s, const char *what, int index, char *err)
{
    const kr_config *cfg = &c->model->cfg;
    if (s->n_layers != cfg->n_layers || s->n_kv_heads != cfg->n_kv_heads || s->pool->head_dim != cfg->head_dim)
        return kr_errf(err, "%s: sequence %d has %d layers x %d KV heads x head_dim %d, the model %d x %d x %d",
                       what, index, s->n_layers, s->n_kv_heads, s->pool->head_dim, cfg->n_layers,
                       cfg->n_kv_heads, cfg->head_dim);
    if (!backend_stores(c->ops, s->pool->dtype))
        return kr_errf(err, "%s: sequence %d: KV cache dtype %s is not supported by the %s backend", what, index,
                       kv_name(s->pool->dtype), backend_title(c->ops));
    return KR_OK;
}

static int check_token(const kr_ctx *c, int32_t id, int index, const char *what, char *err)
{
    int vocab = c->model->cfg.vocab_size;
    if (id < 0 || id >= vocab)
        return kr_errf(err, "%s: token id %d at index %d is outside the vocabulary [0, %d)", what, id, index,
                       vocab);
    return KR_OK;
}

/* Feeds n_real tokens at the sequence's next positions, then n_app appended observer tokens at
 * positions app_pos.. (their KV is dropped after the policy saw it). */
static int forward_rows(kr_ctx *c, kr_seq *s, const int32_t *tokens, int n_real, const int32_t *app,
                        int n_app, int app_pos, const chunk_info *ci, kr_logits_mode mode,
                        float *logits, char *err)
{
    const kr_model *m = c->model;
    const int n = n_real + n_app;
    if (n_real < 1 || n_real > c->max_chunk)
        return kr_errf(err, "forward: %d tokens in one call (allowed 1..%d)", n_real, c->max_chunk);
    if (ensure_rows(c, n, err) != KR_OK) return -1;
    if (check_seq_shape(c, s, "forward", 0, err) != KR_OK) return -1;
    for (int i = 0; i < n; i++)
        if (check_token(c, i < n_real ? tokens[i] : app[i - n_real], i, "forward", err) != KR_OK) return -1;
    if (kr_seq_grow(s, n, err) != KR_OK) return -1;

    for (int t = 0; t < n_real; t++) c->pos[t] = s->next_pos + t;
    for (int t = 0; t < n_app; t++) c->pos[n_real + t] = app_pos + t;
    fill_rope(c, n);
    /* advanced before the layers, so a policy that re-assigns positions (pos=rel) has the last word */
    s->next_pos += n_real;
    s->fp.steps += n_real;

    c->ops->embed(c->be, &m->embed, tokens, n_real, c->x);
    if (n_app) c->ops->embed(c->be, &m->embed, app, n_app, c->x + (size_t)n_real * m->cfg.hidden_size);
    seq_rows one = {.s = s, .row = 0, .n = n, .n_real = n_real};
    if (run_layers(c, &one, 1, NULL, n, ci, err) != KR_OK) return -1;
    if (mode == KR_LOGITS_NONE) return KR_OK;
    int first = mode == KR_LOGITS_ALL ? 0 : n_real - 1;
    compute_logits(c, first, n_real - first, 0, logits);
    return KR_OK;
}

int kr_forward(kr_ctx *c, kr_seq *s, const int32_t *tokens, int n, kr_logits_mode mode,
               float *logits, char *err)
{
    return forward_rows(c, s, tokens, n, NULL, 0, 0, NULL, mode, logits, err);
}

int kr_forward_batch(kr_ctx *c, kr_seq *const *seqs, const int32_t *tokens, int n, float *logits,
                     char *err)
{
    if (n < 1 || n > c->max_chunk)
        return kr_errf(err, "forward_batch: %d sequences in one step (allowed 1..%d, the context's max_chunk)",
                       n, c->max_chunk);
    if (!seqs || !tokens || !logits)
        return kr_errf(err, "forward_batch: seqs, tokens and logits must not be NULL");
    for (int i = 0; i < n; i++) {
        if (!seqs[i]) return kr_errf(err, "forward_batch: sequence %d is NULL", i);
        if (check_seq_shape(c, seqs[i], "forward_batch", i, err) != KR_OK) return -1;
        if (check_token(c, tokens[i], i, "forward_batch", err) != KR_OK) return -1;
        for (int j = 0; j < i; j++)
            if (seqs[j] == seqs[i])
                return kr_errf(err, "forward_batch: sequence %d is also sequence %d (one token per sequence "
                               "per step)", i, j);
    }
    /* room for every sequence first, so running out of blocks feeds nothing to anyone */
    char why[KR_ERR_MAX];
    for (int i = 0; i < n; i++)
        if (kr_seq_grow(seqs[i], 1, why) != KR_OK) {
            for (int j = 0; j < i; j++) kr_seq_release_spare(seqs[j]);
            return kr_errf(err, "forward_batch: sequence %d: %s (nothing was fed to any sequence)", i, why);
        }

    seq_rows *sr = c->batch;
    for (int i = 0; i < n; i++) {
        kr_seq *s = seqs[i];
        c->pos[i] = s->next_pos;
        s->next_pos++;
        s->fp.steps++;
        sr[i] = (seq_rows){.s = s, .row = i, .n = 1, .n_real = 1};
    }
    fill_rope(c, n);
    c->ops->embed(c->be, &c->model->embed, tokens, n, c->x);
    if (run_layers(c, sr, n, seqs, n, NULL, err) != KR_OK) return -1;
    compute_logits(c, 0, n, 1, logits);
    return KR_OK;
}

/* Prompt scoring (kr_prompt_span): the logits of the chunk's len real rows, still in the residual
 * stream after forward_rows, in the pieces compute_logits takes them for KR_LOGITS_ALL, so each
 * row rounds as kr_forward's. */
static int score_chunk(kr_ctx *c, const kr_prompt_span *sp, int at, int len, char *err)
{
    for (int r0 = 0; r0 < len; r0 += LOGIT_ROWS) {
        int nr = len - r0 < LOGIT_ROWS ? len - r0 : LOGIT_ROWS;
        compute_logits(c, r0, nr, 0, sp->score_buf);
        char why[KR_ERR_MAX] = "";
        if (sp->score_fn(sp->score_arg, at + r0, nr, sp->score_buf, why) != KR_OK)
            return kr_errf(err, "%s", why[0] ? why : "prefill: the scoring callback failed without a message");
    }
    return KR_OK;
}

int kr_prefill(kr_ctx *c, kr_seq *s, const int32_t *tokens, int n, int chunk, kr_logits_mode mode,
               float *logits, char *err)
{
    return kr_prefill_layers(c, s, tokens, n, chunk, mode, logits, NULL, NULL, err);
}

int kr_prefill_layers(kr_ctx *c, kr_seq *s, const int32_t *tokens, int n, int chunk,
                      kr_logits_mode mode, float *logits, kr_layers_final_fn fn, void *arg,
                      char *err)
{
    const kr_prompt_span sp = {.tokens = tokens, .n = n, .from = 0, .to = n, .chunk = chunk,
                               .pos0 = s->next_pos};
    return kr_prefill_span(c, s, &sp, mode, logits, fn, arg, err);
}

int kr_prefill_span(kr_ctx *c, kr_seq *s, const kr_prompt_span *sp, kr_logits_mode mode,
                    float *logits, kr_layers_final_fn fn, void *arg, char *err)
{
    const int32_t *tokens = sp->tokens;
    const int n = sp->n;
    if (n < 1) return kr_errf(err, "prefill: empty prompt");
    int chunk = sp->chunk;
    if (chunk <= 0 || chunk > c->max_chunk) chunk = c->max_chunk;
    if (sp->from < 0 || sp->from >= sp->to || sp->to > n || sp->from % chunk != 0 ||
        (sp->to != n && sp->to % chunk != 0))
        return kr_errf(err, "prefill: span [%d, %d) of a %d-token prompt does not start and end on "
                       "%d-token chunk boundaries (or the prompt's end)", sp->from, sp->to, n, chunk);
    const int vocab = c->model->cfg.vocab_size;
    /* room for the span up front, so running out of blocks fails before any work */
    if (!s->policy && kr_seq_grow(s, sp->to - sp->from, err) != KR_OK) return -1;
    /* observers a policy appends to every chunk but the last: the prompt's last rows */
    const kr_policy *p = s->policy;
    int n_app = p ? kr_policy_appended(p, n) : 0;
    const int pos0 = sp->pos0;
    for (int at = sp->from; at < sp->to; at += chunk) {
        int len = sp->to - at < chunk ? sp->to - at : chunk;
        int last = at + len == n;
        kr_logits_mode m = mode == KR_LOGITS_ALL ? KR_LOGITS_ALL : (last ? mode : KR_LOGITS_NONE);
        float *dst = mode == KR_LOGITS_ALL ? logits + (size_t)at * vocab : logits;
        chunk_info ci = {.start = at, .n_prompt = n, .last = last, .final_fn = fn, .final_arg = arg};
        int app = last ? 0 : n_app;
        if (forward_rows(c, s, tokens + at, len, tokens + n - app, app, pos0 + n - app,
                         &ci, m, dst, err) != KR_OK)
            return -1;
        if (sp->score_fn && score_chunk(c, sp, at, len, err) != KR_OK) return -1;
        /* a chunk before the last, for a sequence whose entries are final once computed: n_final
         * 0 (kr.h) */
        if (!last && fn && (!p || p->ops->keeps_prompt) && tell_final(c, s, 0, &ci, err) != KR_OK)
            return -1;
    }
    return KR_OK;
}
