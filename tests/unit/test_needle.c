/*
 * test_needle.c - a needle in a haystack through the real forward pass (kr_prefill): which
 * eviction policies keep one far token that the question's attention concentrates on.
 *
 * The model is built so the answer is forced, not learned: a 2-layer GQA model (4 query heads,
 * 2 KV heads, head_dim 16) from kr_model_random whose weights are then overwritten:
 *   - embeddings are one-hot (token t -> e_t), so after RMSNorm every token is 8 e_t;
 *   - wo and the MLP's down projection are zero, so the residual stream stays the embedding and
 *     both layers see the same q and k;
 *   - two key/query dimension pairs are used, the lowest RoPE frequencies (dims 6 and 7 of 16,
 *     rope_theta 1e6: at most 0.01 rad over the prompt, so rotation leaves the dot products);
 *     dim 7 ("needle"): question-token queries and the needle's key, logit +12;
 *     dim 6 ("decoy"): every non-question query and decoy keys, logit +12, and the needle's
 *     key at -12, so an observer that is not the question scores the needle *below* every
 *     filler token (ties can not save it).
 * Prompt: 256 tokens, chunks of 64, observers/window 8; the needle at 30 (its chunk's last 8
 * are fillers), 16 decoys in every chunk (positions 40..55 mod 64), the question = the last 8.
 *
 * Expected: patched snapkv/pyramidkv append the question to every chunk, so it scores the
 * needle top and every (layer, KV head) keeps it; naive chunked eviction scores the needle's
 * chunk with filler observers and drops it before the question arrives; streaming with a
 * small window drops it; sage (post-fill, chosen by the last token's query) keeps it. To add a
 * policy (e.g. take), add one line to `cases` in main.
 */
#include "kr_test.h"

#include "kr-kv.h"
#include "kr-model.h"

enum { V = 64, D = 64, HD = 16, NHEADS = 4, NKV = 2, LAYERS = 2, N = 256, CHUNK = 64 };
enum { TOK_NEEDLE = 1, TOK_Q = 2, TOK_DECOY = 3, NEEDLE_POS = 30, DIM_DECOY = HD / 2 - 2, DIM_NEEDLE = HD / 2 - 1 };

static kr_model *needle_model(void)
{
    char err[KR_ERR_MAX];
    kr_config c;
    memset(&c, 0, sizeof c);
    c.arch = KR_ARCH_LLAMA;
    snprintf(c.arch_name, sizeof c.arch_name, "LlamaForCausalLM");
    c.vocab_size = V;
    c.hidden_size = D;
    c.intermediate_size = 32;
    c.n_layers = LAYERS;
    c.n_heads = NHEADS;
    c.n_kv_heads = NKV;
    c.head_dim = HD;
    c.max_position_embeddings = 4096;
    c.rope_theta = 1e6f;
    c.rms_norm_eps = 1e-6f;
    c.bos_token_id = c.eos_token_id = -1;
    c.torch_dtype = KR_DTYPE_F32;
    kr_model *m;
    REQUIRE(kr_model_random(&c, KR_DTYPE_F32, 42, &m, err) == KR_OK, "%s", err);
    /* weights of a random model are owned allocations: writable */
    float *emb = (float *)m->embed.data;
    memset(emb, 0, sizeof(float) * V * D);
    for (int t = 0; t < V; t++) emb[t * D + t] = 1.0f;
    /* xn = 8 e_t; a weight w gives a component 8 w; logit = q.k / sqrt(16) = 12 needs
     * q = k = sqrt(48), w = sqrt(48) / 8 */
    const float w = sqrtf(48.0f) / 8.0f;
    for (int l = 0; l < LAYERS; l++) {
        kr_layer_weights *lw = &m->layers[l];
        float *wq = (float *)lw->wq.data, *wk = (float *)lw->wk.data;
        memset(wq, 0, sizeof(float) * NHEADS * HD * D);
        memset(wk, 0, sizeof(float) * NKV * HD * D);
        memset((void *)lw->wo.data, 0, sizeof(float) * D * NHEADS * HD);
        memset((void *)lw->w_down.data, 0, sizeof(float) * D * 32);
        for (int h = 0; h < NHEADS; h++) {
            wq[(h * HD + DIM_NEEDLE) * D + TOK_Q] = w;
            for (int t = 0; t < V; t++)
                if (t != TOK_Q) wq[(h * HD + DIM_DECOY) * D + t] = w;
        }
        for (int g = 0; g < NKV; g++) {
            wk[(g * HD + DIM_NEEDLE) * D + TOK_NEEDLE] = w;
            wk[(g * HD + DIM_DECOY) * D + TOK_NEEDLE] = -w;
            wk[(g * HD + DIM_DECOY) * D + TOK_DECOY] = w;
        }
    }
    return m;
}

static void needle_prompt(int32_t *ids)
{
    uint64_t x = 7;
    for (int i = 0; i < N; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = 4 + (int32_t)((x >> 33) % (V - 4)); /* fillers: 4..63 */
        if (i % CHUNK >= 40 && i % CHUNK < 56) ids[i] = TOK_DECOY;
    }
    ids[NEEDLE_POS] = TOK_NEEDLE;
    for (int i = N - 8; i < N; i++) ids[i] = TOK_Q;
}

/* Prefills the needle prompt under `spec`; returns how many (layer, KV head) lists still hold
 * the needle's position (of LAYERS * NKV). */
static int needle_lists_keeping(kr_ctx *ctx, kr_kv_pool *pool, const kr_config *cfg, const char *spec)
{
    char err[KR_ERR_MAX];
    int32_t ids[N];
    needle_prompt(ids);
    kr_policy *p;
    kr_seq *s;
    REQUIRE(kr_policy_parse(spec, cfg, &p, err) == KR_OK, "%s: %s", spec, err);
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(s, p, err) == KR_OK, "%s", err);
    float logits[V];
    REQUIRE(kr_prefill(ctx, s, ids, N, CHUNK, KR_LOGITS_LAST, logits, err) == KR_OK, "%s: %s", spec, err);
    int keeping = 0;
    for (int l = 0; l < cfg->n_layers; l++)
        for (int g = 0; g < cfg->n_kv_heads; g++) {
            const kr_kv_list *list = kr_seq_list(s, l, g);
            int found = 0;
            for (int e = 0; e < list->len; e++)
                found |= *kr_kv_list_pos(pool, list, e) == NEEDLE_POS;
            keeping += found;
        }
    printf("%-45s needle kept in %d of %d lists (entries held %lld)\n", spec, keeping,
           cfg->n_layers * cfg->n_kv_heads, (long long)kr_seq_entries(s));
    kr_seq_free(s);
    kr_policy_free(p);
    return keeping;
}

int main(void)
{
    char err[KR_ERR_MAX];
    kr_model *m = needle_model();
    const kr_config *cfg = kr_model_config(m);
    kr_ctx *ctx;
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 2, .max_chunk = CHUNK};
    REQUIRE(kr_ctx_create(m, &cp, &ctx, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    REQUIRE(kr_kv_pool_create(HD, 16, 1024, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);

    const int all = LAYERS * NKV;
    const struct { const char *spec; int keeps; } cases[] = {
        {"full", 1},
        {"snapkv:mode=patched,obs=8,budget=16", 1},
        {"snapkv:mode=patched,obs=8,ratio=0.75", 1},
        /* budget 108: the last layer keeps (108-8)//20 = 5 selected entries at the end, room for
         * the needle's avg-pooled neighbourhood */
        {"pyramidkv:mode=patched,obs=8,budget=108", 1},
        {"snapkv:mode=naive,obs=8,budget=16", 0},
        {"snapkv:mode=naive,obs=8,ratio=0.75", 0},
        {"pyramidkv:mode=naive,obs=8,budget=108", 0},
        {"streaming:sink=4,window=16", 0},
        {"sage:budget=32", 1},
        /* TAKE: the question is the probe, appended to every chunk; warm-up layer 0 keeps Bw
         * until the last chunk, then the indices chosen at layer 0 */
        {"take:budget=16,warmup_budget=32,warmup_layers=1,probe=8", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int k = needle_lists_keeping(ctx, pool, cfg, cases[i].spec);
        if (cases[i].keeps) CHECK(k == all, "%s kept the needle in %d of %d lists", cases[i].spec, k, all);
        else CHECK(k == 0, "%s should have dropped the needle, %d of %d lists kept it", cases[i].spec, k, all);
    }
    CHECK(kr_kv_pool_n_free(pool) == kr_kv_pool_n_blocks(pool), "blocks leaked");
    kr_kv_pool_free(pool);
    kr_ctx_free(ctx);
    kr_model_free(m);
    return kt_done("test_needle");
}
