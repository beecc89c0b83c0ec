/*
 * test_kv.c - the paged KV cache: blocks are handed out per (layer, KV head) as sequences grow,
 * growth is all or nothing when the pool runs short (with a message saying how many blocks were
 * missing), blocks are taken lowest first whatever order they were freed in, freeing a sequence
 * returns every block, lengths are per head, entries read back as
 * written, and the window search finds the first entry past a position. Pools of bf16 and f16
 * store rows rounded to nearest even and move them intact; a context's KV dtype is the weights'
 * by default, can be overridden, and one the backend cannot store is refused. Two threads
 * sharing a pool never get the same block.
 */
#include "kr_test.h"

#include "kr-kv.h"

#include <pthread.h>

/* A bf16 or f16 pool of an odd head_dim: kr_seq_put rounds, trims move rows intact, reads widen. */
static void check_typed_pool(kr_dtype t)
{
    char err[KR_ERR_MAX];
    enum { HD = 5, N = 11 };
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create(HD, 3, 16, t, &p, err) == KR_OK, "%s", err);
    CHECK(kr_kv_pool_dtype(p) == t && p->row_bytes == HD * 2, "%s pool: dtype %d, row of %zu bytes", kr_dtype_name(t),
          (int)kr_kv_pool_dtype(p), p->row_bytes);
    kr_seq *s;
    REQUIRE(kr_seq_create(p, 1, 1, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(s, N, err) == KR_OK, "%s", err);
    kr_seq_list(s, 0, 0)->len = N;
    float k[N][HD], v[N][HD];
    for (int i = 0; i < N; i++) {
        for (int d = 0; d < HD; d++) k[i][d] = 1.0f + (float)i / 3.0f + (float)d * 1e-3f, v[i][d] = -k[i][d] * 7.1f;
        kr_seq_put(s, 0, 0, i, k[i], v[i], i);
    }
    kr_seq_keep_ends(s, 0, 0, 2, 5); /* entries 0, 1, 6..10 */
    const int kept[] = {0, 1, 6, 7, 8, 9, 10};
    float rk[7][HD], rv[7][HD];
    int32_t rp[7];
    REQUIRE(kr_seq_list_read(s, 0, 0, 0, 7, rp, &rk[0][0], &rv[0][0], err) == KR_OK, "%s", err);
    int ok = 1;
    for (int i = 0; i < 7; i++) {
        float want_k[HD], want_v[HD];
        uint16_t tk[HD], tv[HD];
        kr_dtype_from_f32(t, k[kept[i]], HD, tk);
        kr_dtype_from_f32(t, v[kept[i]], HD, tv);
        kr_dtype_to_f32(t, tk, HD, want_k);
        kr_dtype_to_f32(t, tv, HD, want_v);
        ok &= rp[i] == kept[i] && !memcmp(rk[i], want_k, sizeof want_k) && !memcmp(rv[i], want_v, sizeof want_v) &&
              !memcmp(kr_kv_list_key(p, kr_seq_list(s, 0, 0), i), tk, sizeof tk);
    }
    CHECK(ok, "%s pool: rows after a trim are not the rounded rows written", kr_dtype_name(t));
    kr_seq_free(s);
    kr_kv_pool_free(p);
}

/* kr_ctx_params.kv_dtype: auto is the weights' dtype; an explicit dtype wins; a backend that
 * cannot store one refuses it with a message naming both */
static void check_ctx_dtype(void)
{
    char err[KR_ERR_MAX];
    kr_config c;
    memset(&c, 0, sizeof c);
    snprintf(c.arch_name, sizeof c.arch_name, "LlamaForCausalLM");
    c.vocab_size = 64, c.hidden_size = 32, c.intermediate_size = 48, c.n_layers = 1, c.n_heads = 4;
    c.n_kv_heads = 2, c.head_dim = 8, c.max_position_embeddings = 128, c.rope_theta = 10000.0f;
    c.rms_norm_eps = 1e-5f, c.bos_token_id = c.eos_token_id = -1;
    const kr_dtype weights[] = {KR_DTYPE_F32, KR_DTYPE_BF16, KR_DTYPE_F16};
    const struct { kr_kv_dtype ask; int same_as_weights; kr_dtype want; } cases[] = {
        {KR_KV_DTYPE_AUTO, 1, KR_DTYPE_F32}, {KR_KV_DTYPE_F32, 0, KR_DTYPE_F32},
        {KR_KV_DTYPE_BF16, 0, KR_DTYPE_BF16}, {KR_KV_DTYPE_F16, 0, KR_DTYPE_F16}};
    for (int w = 0; w < 3; w++) {
        kr_model *m;
        c.torch_dtype = weights[w];
        REQUIRE(kr_model_random(&c, weights[w], 7, &m, err) == KR_OK, "%s", err);
        for (int i = 0; i < 4; i++) {
            kr_ctx *ctx;
            kr_ctx_params cp = {.n_threads = 1, .max_chunk = 4, .kv_dtype = cases[i].ask};
            REQUIRE(kr_ctx_create(m, &cp, &ctx, err) == KR_OK, "%s", err);
            kr_dtype want = cases[i].same_as_weights ? weights[w] : cases[i].want;
            kr_kv_pool *p;
            REQUIRE(kr_ctx_kv_pool_create(ctx, 4, 8, &p, err) == KR_OK, "%s", err);
            CHECK(kr_ctx_kv_dtype(ctx) == want && kr_kv_pool_dtype(p) == want,
                  "weights %s, kv_dtype %d: context %s, pool %s, expected %s", kr_dtype_name(weights[w]),
                  (int)cases[i].ask, kr_dtype_name(kr_ctx_kv_dtype(ctx)), kr_dtype_name(kr_kv_pool_dtype(p)),
                  kr_dtype_name(want));
            kr_kv_pool_free(p);
            kr_ctx_free(ctx);
        }
        kr_ctx *ctx;
        kr_ctx_params bad = {.n_threads = 1, .kv_dtype = (kr_kv_dtype)9};
        CHECK(kr_ctx_create(m, &bad, &ctx, err) == -1, "kv_dtype 9 accepted");
        CHECK_ERR_HAS(err, "not one of auto, f32, f16, bf16");
#ifdef KR_HAVE_CUDA
        /* refused before the backend starts: no GPU needed */
        kr_ctx_params cuda = {.backend = KR_BACKEND_CUDA, .n_threads = 1, .kv_dtype = KR_KV_DTYPE_BF16};
        CHECK(kr_ctx_create(m, &cuda, &ctx, err) == -1, "a bf16 KV cache on the CUDA backend was accepted");
        CHECK_ERR_HAS(err, "KV cache dtype bf16 is not supported by the CUDA backend");
#endif
        kr_model_free(m);
    }
    kr_kv_pool *p;
    CHECK(kr_kv_pool_create(4, 4, 4, (kr_dtype)7, &p, err) == -1, "pool dtype 7 accepted");
    CHECK_ERR_HAS(err, "not one of F32, BF16, F16");
}

/* Blocks are taken lowest first, whatever order they were freed in: a new sequence's lists lie
 * together and in order (what lets the hardware prefetcher follow a list read front to back),
 * across a bitmap word boundary too. */
static void check_lowest_first(void)
{
    char err[KR_ERR_MAX];
    enum { N_SEQ = 12, BLOCKS = 150 };
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create(4, 2, BLOCKS, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);
    kr_seq *s[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) { /* 2 lists x 6 blocks each: blocks 0..143 */
        REQUIRE(kr_seq_create(p, 1, 2, &s[i], err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_grow(s[i], 12, err) == KR_OK, "%s", err);
    }
    const int order[N_SEQ] = {7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 6, 4}; /* freed out of order */
    for (int i = 0; i < N_SEQ; i++)
        if (order[i] != 5 && order[i] != 6) kr_seq_free(s[order[i]]);
    CHECK(kr_kv_pool_n_free(p) == BLOCKS - 24, "free %d", kr_kv_pool_n_free(p));
    kr_seq *t;
    REQUIRE(kr_seq_create(p, 1, 2, &t, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(t, 120, err) == KR_OK, "%s", err); /* 60 blocks per list */
    /* 0..59 for the first list, then past s[5] (60..71) and s[6] (72..83): 84..143 */
    int want = 0, bad = 0;
    for (int h = 0; h < 2; h++) {
        const kr_kv_list *l = kr_seq_list(t, 0, h);
        for (int b = 0; b < l->n_blocks; b++) {
            if (want == 60) want = 84;
            bad += l->blocks[b] != want++;
        }
    }
    CHECK(bad == 0, "%d blocks out of lowest-first order", bad);
    kr_seq_free(t);
    kr_seq_free(s[5]);
    kr_seq_free(s[6]);
    CHECK(kr_kv_pool_n_free(p) == BLOCKS, "blocks leaked: %d free of %d", kr_kv_pool_n_free(p), BLOCKS);
    kr_kv_pool_free(p);
}

/* Two threads share one pool, as a decode node's loop and its transport thread do: each grows,
 * trims and frees sequences of its own, marking every entry with its thread and sequence. No
 * block is ever handed to both (each reads back only its own marks), growth that finds the pool
 * short fails cleanly, and every block comes back. */
enum { SHARED_BLOCKS = 96, SHARED_ROUNDS = 3000 };

typedef struct shared_arg {
    kr_kv_pool *pool;
    int tag;
    int bad, refused;
} shared_arg;

static void *shared_worker(void *arg)
{
    shared_arg *a = arg;
    char err[KR_ERR_MAX];
    unsigned rng = (unsigned)a->tag * 2654435761u + 1;
    for (int round = 0; round < SHARED_ROUNDS; round++) {
        kr_seq *s;
        if (kr_seq_create(a->pool, 2, 2, &s, err) != KR_OK) {
            a->bad++;
            continue;
        }
        rng = rng * 1103515245u + 12345u;
        const int n = 1 + (int)(rng >> 16) % 40;
        if (kr_seq_grow(s, n, err) != KR_OK) {
            a->refused++;
            kr_seq_free(s);
            continue;
        }
        const float mark = (float)(a->tag * 1000000 + round);
        float k[4] = {mark, mark, mark, mark};
        for (int l = 0; l < 2; l++)
            for (int h = 0; h < 2; h++) {
                kr_seq_list(s, l, h)->len = n;
                for (int i = 0; i < n; i++) kr_seq_put(s, l, h, i, k, k, i);
            }
        kr_seq_keep_ends(s, 0, 1, 2, n / 3); /* trims return blocks meanwhile */
        for (int l = 0; l < 2; l++)
            for (int h = 0; h < 2; h++) {
                const kr_kv_list *list = kr_seq_list(s, l, h);
                for (int i = 0; i < list->len; i++)
                    a->bad += *(const float *)kr_kv_list_key(a->pool, list, i) != mark;
            }
        kr_seq_free(s);
    }
    return NULL;
}

static void check_shared_pool(void)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create(4, 4, SHARED_BLOCKS, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);
    shared_arg a[2] = {{.pool = p, .tag = 1}, {.pool = p, .tag = 2}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++) REQUIRE(pthread_create(&t[i], NULL, shared_worker, &a[i]) == 0, "thread");
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    CHECK(a[0].bad == 0 && a[1].bad == 0, "entries overwritten by the other thread: %d, %d", a[0].bad, a[1].bad);
    CHECK(a[0].refused + a[1].refused < 2 * SHARED_ROUNDS, "every growth refused");
    CHECK(kr_kv_pool_n_free(p) == SHARED_BLOCKS, "blocks leaked: %d free of %d", kr_kv_pool_n_free(p),
          SHARED_BLOCKS);
    kr_kv_pool_free(p);
}

int main(void)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p;
    CHECK(kr_kv_pool_create(0, 16, 10, KR_DTYPE_F32, &p, err) == -1, "head_dim 0 accepted");
    CHECK_ERR_HAS(err, "head_dim");
    check_lowest_first();
    check_shared_pool();
    REQUIRE(kr_kv_pool_create(4, 4, 10, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);
    CHECK(kr_kv_blocks_for(p, 2, 2, 5) == 8, "5 tokens x 4 lists need 2 blocks each");

    kr_seq *a, *b;
    REQUIRE(kr_seq_create(p, 2, 2, &a, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(p, 2, 2, &b, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(a, 5, err) == KR_OK, "%s", err); /* 4 lists x 2 blocks */
    CHECK(kr_kv_pool_n_free(p) == 2, "free %d", kr_kv_pool_n_free(p));
    CHECK(kr_seq_grow(b, 1, err) == -1, "4 blocks taken from a pool with 2 free");
    CHECK_ERR_HAS(err, "4 more blocks needed, 2 free of 10");
    CHECK(kr_kv_pool_n_free(p) == 2 && kr_seq_blocks(b) == 0, "failed growth took blocks");

    /* write entries with distinct values per list; read back */
    float k[4], v[4];
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            kr_kv_list *list = kr_seq_list(a, l, h);
            list->len = 5;
            for (int i = 0; i < 5; i++) {
                for (int d = 0; d < 4; d++) k[d] = (float)(100 * l + 10 * h + i), v[d] = -k[d] - d;
                kr_seq_put(a, l, h, i, k, v, 3 * i);
            }
        }
    int ok = 1;
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            kr_kv_list *list = kr_seq_list(a, l, h);
            for (int i = 0; i < 5; i++) {
                ok &= ((const float *)kr_kv_list_key(p, list, i))[2] == (float)(100 * l + 10 * h + i);
                ok &= ((const float *)kr_kv_list_value(p, list, i))[3] == -(float)(100 * l + 10 * h + i) - 3;
                ok &= *kr_kv_list_pos(p, list, i) == 3 * i;
            }
            /* positions 0 3 6 9 12: first after 5 is index 2, after 12 is 5, after -1 is 0 */
            ok &= kr_kv_list_first_after(p, list, 5, 5) == 2;
            ok &= kr_kv_list_first_after(p, list, 5, 12) == 5;
            ok &= kr_kv_list_first_after(p, list, 5, -1) == 0;
            ok &= kr_kv_list_first_after(p, list, 3, 9) == 3;
        }
    CHECK(ok, "entries or window search wrong");
    CHECK(kr_seq_entries(a) == 20 && kr_seq_len(a, 1, 1) == 5 && kr_seq_len(a, 2, 0) == 0, "lengths");

    /* per-head lengths: shrink one list (as eviction will), growth accounts per list */
    kr_seq_list(a, 0, 0)->len = 1;
    CHECK(kr_seq_grow(a, 3, err) == KR_OK, "%s", err); /* 5 + 3 fits in the 2 blocks held */
    CHECK(kr_kv_pool_n_free(p) == 2 && kr_seq_blocks(a) == 8, "blocks %d free %d", kr_seq_blocks(a), kr_kv_pool_n_free(p));
    CHECK(kr_seq_grow(a, 4, err) == -1, "3 lists need a third block, 2 free");
    CHECK_ERR_HAS(err, "3 more blocks needed");

    kr_seq_free(a);
    CHECK(kr_kv_pool_n_free(p) == 10, "free after release %d", kr_kv_pool_n_free(p));

    /* keep_ends in both directions: 2 sinks + the newest 7 of 13 entries (head < tail: the
     * sinks move up, leading blocks go back, the offset absorbs the rest); then 3 + 1 (tail
     * moves down); growth after an offset; keep of an arbitrary subset */
    kr_seq *c;
    REQUIRE(kr_seq_create(p, 1, 1, &c, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(c, 13, err) == KR_OK, "%s", err);
    kr_seq_list(c, 0, 0)->len = 13;
    for (int i = 0; i < 13; i++) {
        for (int d = 0; d < 4; d++) k[d] = (float)i, v[d] = (float)-i;
        kr_seq_put(c, 0, 0, i, k, v, i);
    }
    kr_seq_keep_ends(c, 0, 0, 2, 7);
    kr_kv_list *cl = kr_seq_list(c, 0, 0);
    const int want1[] = {0, 1, 6, 7, 8, 9, 10, 11, 12};
    ok = cl->len == 9 && cl->pinned == 2 && cl->n_blocks == 3 && kr_kv_pool_n_free(p) == 7;
    for (int i = 0; i < 9; i++)
        ok &= *kr_kv_list_pos(p, cl, i) == want1[i] &&
              ((const float *)kr_kv_list_key(p, cl, i))[1] == (float)want1[i] &&
              ((const float *)kr_kv_list_value(p, cl, i))[0] == (float)-want1[i];
    CHECK(ok, "sinks moved up: len %d off %d blocks %d free %d", cl->len, cl->off, cl->n_blocks, kr_kv_pool_n_free(p));
    REQUIRE(kr_seq_grow(c, 2, err) == KR_OK, "%s", err);
    cl->len += 2;
    for (int i = 9; i < 11; i++) {
        for (int d = 0; d < 4; d++) k[d] = (float)(100 + i), v[d] = 0;
        kr_seq_put(c, 0, 0, i, k, v, 100 + i);
    }
    kr_seq_keep_ends(c, 0, 0, 3, 1);
    const int want2[] = {0, 1, 6, 110};
    ok = cl->len == 4 && cl->pinned == 3;
    for (int i = 0; i < 4; i++) ok &= *kr_kv_list_pos(p, cl, i) == want2[i];
    CHECK(ok, "tail moved down");
    const int32_t subset[] = {1, 3};
    kr_seq_keep(c, 0, 0, subset, 2, 1);
    CHECK(cl->len == 2 && *kr_kv_list_pos(p, cl, 0) == 1 && *kr_kv_list_pos(p, cl, 1) == 110 && cl->pinned == 1,
          "keep subset");
    kr_seq_free(c);
    CHECK(kr_kv_pool_n_free(p) == 10, "free after the offset list %d", kr_kv_pool_n_free(p));
    REQUIRE(kr_seq_grow(b, 8, err) == KR_OK, "%s", err); /* 4 lists x 2 blocks */
    kr_seq_free(b);
    kr_kv_pool_free(p);
    check_typed_pool(KR_DTYPE_BF16);
    check_typed_pool(KR_DTYPE_F16);
    check_ctx_dtype();
    return kt_done("test_kv");
}
