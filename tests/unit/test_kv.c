/*
 * test_kv.c - the paged KV cache: blocks are handed out per (layer, KV head) as sequences grow,
 * growth is all or nothing when the pool runs short (with a message saying how many blocks were
 * missing), blocks are taken lowest first whatever order they were freed in, freeing a sequence
 * returns every block, lengths are per head, entries read back as
 * written, and the window search finds the first entry past a position. Pools of bf16 and f16
 * store rows rounded to nearest even and move them intact; a context's KV dtype is the weights'
 * by default, can be overridden, and one the backend cannot store is refused. Runs of
 * consecutive blocks are taken first fit and all or nothing (across bitmap words, up to the
 * pool's end, agreeing with a brute-force search over random takes and gives), and a list that
 * adopts a run whose rows were written in place reads, grows, trims and frees like one that took
 * its blocks itself; adoption refuses what would break a list. Two threads sharing a pool, one
 * taking single blocks and one taking runs, never get the same block. Giving back a block that
 * is not taken (a run twice, a list's block behind its back) is refused and not counted:
 * KR_ASSERT stops it in the sanitizer build, and with asserts compiled out the free count and
 * the bitmap still agree.
 */
#include "kr_test.h"

#include "kr-kv.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

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
    kr_seq_extend(s, 0, 0, N);
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
    int runs; /* fill each sequence through kr_kv_pool_take_run + kr_seq_list_adopt */
    int bad, refused;
} shared_arg;

/* A sequence of 2 x 2 lists of n entries whose rows are written into one run of blocks, as a
 * decode node receives a bundle, then adopted list by list; every 5th run is given back
 * unadopted, as when a transfer fails. NULL when no run was free. */
static kr_seq *shared_adopt(shared_arg *a, int n, int round, const float *k)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p = a->pool;
    const int m = (n + p->block_size - 1) / p->block_size; /* blocks per list */
    int32_t first;
    if (kr_kv_pool_take_run(p, 4 * m, &first) != KR_OK) return NULL;
    for (int i = 0; i < 4; i++)
        for (int e = 0; e < n; e++) {
            const int32_t b = first + i * m + e / p->block_size;
            memcpy(kr_kv_key(p, b, e % p->block_size), k, p->row_bytes);
            memcpy(kr_kv_value(p, b, e % p->block_size), k, p->row_bytes);
            *kr_kv_pos(p, b, e % p->block_size) = e;
        }
    if (round % 5 == 0) {
        kr_kv_pool_give_run(p, first, 4 * m);
        return NULL;
    }
    kr_seq *s;
    if (kr_seq_create(p, 2, 2, &s, err) != KR_OK) {
        a->bad++;
        kr_kv_pool_give_run(p, first, 4 * m);
        return NULL;
    }
    for (int i = 0; i < 4; i++)
        if (kr_seq_list_adopt(s, i / 2, i % 2, first + i * m, m, n, 0, err) != KR_OK) {
            a->bad++;
            fprintf(stderr, "adopt: %s\n", err);
            kr_kv_pool_give_run(p, first + i * m, m); /* still ours; the adopted ones go with s */
        }
    return s;
}

static void *shared_worker(void *arg)
{
    shared_arg *a = arg;
    char err[KR_ERR_MAX];
    unsigned rng = (unsigned)a->tag * 2654435761u + 1;
    for (int round = 0; round < SHARED_ROUNDS; round++) {
        rng = rng * 1103515245u + 12345u;
        const int n = 1 + (int)(rng >> 16) % 40;
        const float mark = (float)(a->tag * 1000000 + round);
        float k[4] = {mark, mark, mark, mark};
        kr_seq *s;
        if (a->runs) {
            if (!(s = shared_adopt(a, n, round, k))) {
                a->refused++;
                continue;
            }
        } else {
            if (kr_seq_create(a->pool, 2, 2, &s, err) != KR_OK) {
                a->bad++;
                continue;
            }
            if (kr_seq_grow(s, n, err) != KR_OK) {
                a->refused++;
                kr_seq_free(s);
                continue;
            }
            for (int l = 0; l < 2; l++)
                for (int h = 0; h < 2; h++) {
                    kr_seq_extend(s, l, h, n);
                    for (int i = 0; i < n; i++) kr_seq_put(s, l, h, i, k, k, i);
                }
        }
        kr_seq_keep_ends(s, 0, 1, 2, n / 3); /* trims return blocks meanwhile */
        for (int l = 0; l < 2; l++)
            for (int h = 0; h < 2; h++) {
                const kr_kv_list *list = kr_seq_list(s, l, h);
                for (int i = 0; i < list->len; i++)
                    a->bad += *(const float *)kr_kv_list_key(a->pool, list, i) != mark ||
                              *(const float *)kr_kv_list_value(a->pool, list, i) != mark;
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
    shared_arg a[2] = {{.pool = p, .tag = 1}, {.pool = p, .tag = 2, .runs = 1}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++) REQUIRE(pthread_create(&t[i], NULL, shared_worker, &a[i]) == 0, "thread");
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    CHECK(a[0].bad == 0 && a[1].bad == 0, "entries overwritten by the other thread: %d, %d", a[0].bad, a[1].bad);
    CHECK(a[0].refused < SHARED_ROUNDS && a[1].refused < SHARED_ROUNDS, "every growth refused: %d, %d of %d",
          a[0].refused, a[1].refused, SHARED_ROUNDS);
    CHECK(kr_kv_pool_n_free(p) == SHARED_BLOCKS, "blocks leaked: %d free of %d", kr_kv_pool_n_free(p),
          SHARED_BLOCKS);
    kr_kv_pool_free(p);
}

/* kr_kv_pool_take_run, or -1 */
static int32_t take_run(kr_kv_pool *p, int n)
{
    int32_t first = -7;
    return kr_kv_pool_take_run(p, n, &first) == KR_OK ? first : -1;
}

/* Runs are first fit from the lowest id, all or nothing, across bitmap words and up to the end
 * of a pool whose size is not a multiple of 64; the free count follows; single-block takes after
 * runs still get the lowest free block. */
static void check_take_run(void)
{
    char err[KR_ERR_MAX];
    enum { N = 200 }; /* 3 words and 8 bits */
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create(4, 3, N, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);

    /* an empty pool */
    CHECK(take_run(p, 5) == 0 && kr_kv_pool_n_free(p) == N - 5, "run of 5: free %d", kr_kv_pool_n_free(p));
    CHECK(take_run(p, 64) == 5 && kr_kv_pool_n_free(p) == N - 69, "run of 64 across words 0 and 1");
    CHECK(take_run(p, N - 68) == -1 && kr_kv_pool_n_free(p) == N - 69, "a run longer than the free blocks");
    CHECK(take_run(p, 0) == -1 && take_run(p, -1) == -1 && take_run(p, N + 1) == -1, "n outside 1..n_blocks");
    int32_t untouched = 123;
    CHECK(kr_kv_pool_take_run(p, N, &untouched) == -1 && untouched == 123, "a failed take wrote *first");
    kr_kv_pool_give_run(p, 0, 5);
    kr_kv_pool_give_run(p, 5, 64);
    CHECK(kr_kv_pool_n_free(p) == N, "given back: free %d", kr_kv_pool_n_free(p));

    /* the whole pool, then runs ending exactly at its last block */
    CHECK(take_run(p, N) == 0 && kr_kv_pool_n_free(p) == 0, "the whole pool");
    CHECK(take_run(p, 1) == -1, "a block from an exhausted pool");
    kr_kv_pool_give_run(p, 0, N);
    CHECK(take_run(p, N - 10) == 0 && take_run(p, 10) == N - 10 && take_run(p, 1) == -1, "a run at the end");
    kr_kv_pool_give_run(p, N - 3, 3);
    CHECK(take_run(p, 4) == -1 && take_run(p, 3) == N - 3, "the last 3 blocks, the pool's padding bits unused");

    /* fragmented: every other block free */
    for (int b = 0; b < N - 3; b += 2) kr_kv_pool_give_run(p, b, 1);
    CHECK(kr_kv_pool_n_free(p) == 99, "every other block of 0..196: free %d", kr_kv_pool_n_free(p));
    CHECK(take_run(p, 2) == -1 && take_run(p, 64) == -1 && kr_kv_pool_n_free(p) == 99, "a run of 2 in a comb");
    CHECK(take_run(p, 1) == 0 && take_run(p, 1) == 2 && kr_kv_pool_n_free(p) == 97, "runs of 1 in a comb");
    kr_seq *s;
    REQUIRE(kr_seq_create(p, 1, 1, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(s, 3, err) == KR_OK, "%s", err); /* one single block: the lowest free */
    CHECK(kr_seq_list(s, 0, 0)->blocks[0] == 4, "single take after runs got %d, not 4", kr_seq_list(s, 0, 0)->blocks[0]);
    kr_seq_free(s);
    int comb_bad = 0;
    for (int b = 4; b < N - 3; b += 2) comb_bad += take_run(p, 1) != b; /* the comb again, lowest first */
    CHECK(comb_bad == 0 && kr_kv_pool_n_free(p) == 0, "comb refilled: %d out of order, free %d", comb_bad,
          kr_kv_pool_n_free(p));
    kr_kv_pool_give_run(p, 0, 1);
    kr_kv_pool_give_run(p, 2, 1);
    CHECK(kr_kv_pool_n_free(p) == 2, "free %d", kr_kv_pool_n_free(p));
    CHECK(take_run(p, 1) == 0 && take_run(p, 1) == 2, "a lowered hint");

    /* runs across word boundaries, first fit skipping holes too short */
    kr_kv_pool_give_run(p, 10, 3); /* 10..12 */
    kr_kv_pool_give_run(p, 60, 10); /* 60..69 straddles bit 64 */
    kr_kv_pool_give_run(p, 126, 5); /* 126..130 straddles bit 128 */
    CHECK(take_run(p, 4) == 60 && take_run(p, 6) == 64, "runs of 4 and 6 in 60..69");
    CHECK(take_run(p, 5) == 126 && take_run(p, 3) == 10 && kr_kv_pool_n_free(p) == 0, "runs of 5 and 3");
    /* 100..149 and 151..199 free: runs of n < 64 across bit 128, then of n >= 64 around a hole */
    kr_kv_pool_give_run(p, 100, 50);
    kr_kv_pool_give_run(p, 151, 49);
    CHECK(take_run(p, 51) == -1 && take_run(p, 50) == 100 && take_run(p, 49) == 151, "runs around block 150");
    kr_kv_pool_give_run(p, 0, 130);
    kr_kv_pool_give_run(p, 131, 69);
    CHECK(take_run(p, 131) == -1 && take_run(p, 70) == 131 - 131 && kr_kv_pool_n_free(p) == 129,
          "first fit of 70: free %d", kr_kv_pool_n_free(p));
    kr_kv_pool_give_run(p, 0, 70);
    CHECK(take_run(p, 130) == 0 && take_run(p, 70) == -1 && take_run(p, 69) == 131 && kr_kv_pool_n_free(p) == 0,
          "runs of 130 and 69 on both sides of block 130: free %d", kr_kv_pool_n_free(p));
    kr_kv_pool_give_run(p, 0, 130);
    kr_kv_pool_give_run(p, 131, 69);
    kr_kv_pool_give_run(p, 130, 1);
    CHECK(kr_kv_pool_n_free(p) == N, "free %d", kr_kv_pool_n_free(p));
    kr_kv_pool_free(p);
}

/* Random takes and gives of runs agree with a brute-force first-fit search over a shadow map of
 * the free blocks, on a pool of 300 blocks (4 words and 44 bits), runs of 1 to 150. */
static void check_take_run_random(void)
{
    char err[KR_ERR_MAX];
    enum { N = 300, ROUNDS = 20000, HELD = 64 };
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create(2, 1, N, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);
    char is_free[N];
    memset(is_free, 1, sizeof is_free);
    int32_t held_first[HELD];
    int held_n[HELD], n_held = 0, n_free = N, bad = 0;
    unsigned rng = 12345u;
    for (int round = 0; round < ROUNDS && !bad; round++) {
        rng = rng * 1103515245u + 12345u;
        const unsigned r = rng >> 8;
        if (n_held == HELD || (n_held && r % 2)) { /* give back a held run */
            const int i = (int)(r / 2 % (unsigned)n_held);
            kr_kv_pool_give_run(p, held_first[i], held_n[i]);
            for (int b = 0; b < held_n[i]; b++) is_free[held_first[i] + b] = 1;
            n_free += held_n[i];
            held_first[i] = held_first[--n_held], held_n[i] = held_n[n_held];
        } else {
            const int n = r / 2 % 4 ? 1 + (int)(r / 8 % 24) : 1 + (int)(r / 8 % 150);
            int want = -1;
            for (int b = 0, len = 0; b < N && want < 0; b++)
                if ((len = is_free[b] ? len + 1 : 0) == n) want = b - n + 1;
            const int32_t got = take_run(p, n);
            bad += got != want;
            if (got != want) fprintf(stderr, "round %d: run of %d at %d, first fit is %d\n", round, n, got, want);
            if (got >= 0 && got == want) {
                for (int b = 0; b < n; b++) is_free[got + b] = 0;
                n_free -= n;
                held_first[n_held] = got, held_n[n_held++] = n;
            }
        }
        bad += kr_kv_pool_n_free(p) != n_free;
    }
    CHECK(bad == 0, "%d mismatches with the brute-force first fit", bad);
    for (int i = 0; i < n_held; i++) kr_kv_pool_give_run(p, held_first[i], held_n[i]);
    CHECK(kr_kv_pool_n_free(p) == N, "free %d of %d", kr_kv_pool_n_free(p), N);
    kr_kv_pool_free(p);
}

/* Entry e of the adopted lists: key d = 1000 * list + 10 * e + d, value its negative, position 3e + 1. */
static float adopt_key(int list, int e, int d)
{
    return (float)(1000 * list + 10 * e + d);
}

/* Rows written in place into a run, adopted, then read, grown, trimmed and freed like any list;
 * the refusals leave the list empty and the blocks with the caller. */
static void check_adopt(void)
{
    char err[KR_ERR_MAX];
    enum { HD = 4, B = 4, N = 70, LEN0 = 10, LEN1 = 33 };
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create(HD, B, N, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);
    kr_seq *other, *s;
    REQUIRE(kr_seq_create(p, 1, 1, &other, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(other, 1, err) == KR_OK, "%s", err); /* block 0 */
    REQUIRE(kr_seq_create(p, 1, 2, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow_list(s, 0, 1, 1, err) == KR_OK, "%s", err); /* list 1 gets a block array */
    kr_seq_release_spare(s);
    CHECK(kr_seq_blocks(s) == 0 && kr_seq_list(s, 0, 1)->cap_blocks == 4 && kr_kv_pool_n_free(p) == N - 1,
          "spare released: blocks %d cap %d free %d", kr_seq_blocks(s), kr_seq_list(s, 0, 1)->cap_blocks,
          kr_kv_pool_n_free(p));

    /* one run for both lists, lists in order, as a bundle lays them out: 3 + 9 blocks */
    const int m0 = (LEN0 + B - 1) / B, m1 = (LEN1 + B - 1) / B;
    int32_t first;
    REQUIRE(kr_kv_pool_take_run(p, m0 + m1, &first) == KR_OK, "no run of %d", m0 + m1);
    CHECK(first == 1 && kr_kv_pool_n_free(p) == N - 1 - m0 - m1, "run at %d, free %d", first, kr_kv_pool_n_free(p));
    void *rk, *rv;
    int32_t *rpos;
    kr_kv_pool_run_rows(p, first, &rk, &rv, &rpos);
    CHECK(rk == kr_kv_key(p, first, 0) && rv == kr_kv_value(p, first, 0) && rpos == kr_kv_pos(p, first, 0) &&
          (uint8_t *)kr_kv_key(p, first + 2, 1) == (uint8_t *)rk + (2 * B + 1) * p->row_bytes,
          "run rows are not the blocks' slots laid end to end");
    const int lens[2] = {LEN0, LEN1}, starts[2] = {first, first + m0};
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < lens[h]; e++) {
            const int32_t b = starts[h] + e / B;
            float *k = kr_kv_key(p, b, e % B), *v = kr_kv_value(p, b, e % B);
            for (int d = 0; d < HD; d++) k[d] = adopt_key(h, e, d), v[d] = -adopt_key(h, e, d);
            *kr_kv_pos(p, b, e % B) = 3 * e + 1;
        }
    REQUIRE(kr_seq_list_adopt(s, 0, 0, starts[0], m0, LEN0, 2, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_list_adopt(s, 0, 1, starts[1], m1, LEN1, 0, err) == KR_OK, "%s", err);
    int ok = kr_seq_blocks(s) == m0 + m1 && kr_seq_len(s, 0, 0) == LEN0 && kr_seq_len(s, 0, 1) == LEN1 &&
             kr_seq_entries(s) == LEN0 + LEN1 && kr_kv_pool_n_free(p) == N - 1 - m0 - m1;
    for (int h = 0; h < 2; h++) {
        const kr_kv_list *l = kr_seq_list(s, 0, h);
        ok &= l->off == 0 && l->n_blocks <= l->cap_blocks && l->pinned == (h ? 0 : 2);
        for (int e = 0; e < lens[h]; e++)
            ok &= *kr_kv_list_pos(p, l, e) == 3 * e + 1 &&
                  ((const float *)kr_kv_list_key(p, l, e))[3] == adopt_key(h, e, 3) &&
                  ((const float *)kr_kv_list_value(p, l, e))[1] == -adopt_key(h, e, 1);
    }
    float rk1[LEN1][HD];
    int32_t rp1[LEN1];
    REQUIRE(kr_seq_list_read(s, 0, 1, 0, LEN1, rp1, &rk1[0][0], NULL, err) == KR_OK, "%s", err);
    for (int e = 0; e < LEN1; e++) ok &= rp1[e] == 3 * e + 1 && rk1[e][2] == adopt_key(1, e, 2);
    int len, pinned;
    kr_seq_list_shape(s, 0, 0, &len, &pinned);
    CHECK(ok && len == LEN0 && pinned == 2, "adopted lists do not read back as written");

    /* grow list 0 by 5 entries: one more block (the lowest free), rows put after the adopted ones */
    REQUIRE(kr_seq_grow_list(s, 0, 0, 5, err) == KR_OK, "%s", err);
    const kr_kv_list *l0 = kr_seq_list(s, 0, 0);
    CHECK(l0->n_blocks == 4 && l0->blocks[3] == first + m0 + m1 && l0->cap_blocks >= 4 &&
          kr_kv_pool_n_free(p) == N - 2 - m0 - m1, "grown: %d blocks, last %d, free %d", l0->n_blocks,
          l0->blocks[3], kr_kv_pool_n_free(p));
    float k[HD], v[HD];
    for (int e = LEN0; e < LEN0 + 5; e++) {
        for (int d = 0; d < HD; d++) k[d] = adopt_key(0, e, d), v[d] = -adopt_key(0, e, d);
        kr_seq_put(s, 0, 0, e, k, v, 3 * e + 1);
    }
    kr_seq_extend(s, 0, 0, 5);
    /* keep 2 sinks and the newest 6 of 15: entries 0, 1, 9..14; the first block goes back */
    kr_seq_keep_ends(s, 0, 0, 2, 6);
    const int want[] = {0, 1, 9, 10, 11, 12, 13, 14};
    ok = l0->len == 8 && l0->pinned == 2 && l0->n_blocks == 3 && l0->blocks[0] == first + 1 &&
         kr_kv_pool_n_free(p) == N - 1 - m0 - m1;
    for (int i = 0; i < 8; i++)
        ok &= *kr_kv_list_pos(p, l0, i) == 3 * want[i] + 1 &&
              ((const float *)kr_kv_list_key(p, l0, i))[0] == adopt_key(0, want[i], 0) &&
              ((const float *)kr_kv_list_value(p, l0, i))[2] == -adopt_key(0, want[i], 2);
    CHECK(ok, "keep_ends of an adopted list: len %d pinned %d off %d blocks %d free %d", l0->len, l0->pinned, l0->off,
          l0->n_blocks, kr_kv_pool_n_free(p));
    /* keep a subset of list 1: its tail blocks go back */
    const int32_t keep[] = {0, 5, 17, 32};
    kr_seq_keep(s, 0, 1, keep, 4, 1);
    const kr_kv_list *l1 = kr_seq_list(s, 0, 1);
    ok = l1->len == 4 && l1->pinned == 1 && l1->n_blocks == 1 && kr_seq_blocks(s) == 4;
    for (int i = 0; i < 4; i++) ok &= *kr_kv_list_pos(p, l1, i) == 3 * keep[i] + 1;
    CHECK(ok, "keep of an adopted list: len %d blocks %d", l1->len, l1->n_blocks);
    kr_seq_free(s);
    kr_seq_free(other);
    CHECK(kr_kv_pool_n_free(p) == N, "blocks leaked: %d free of %d", kr_kv_pool_n_free(p), N);

    /* refusals: each leaves the list empty and the run with the caller */
    REQUIRE(kr_seq_create(p, 1, 2, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_kv_pool_take_run(p, 3, &first) == KR_OK, "no run of 3");
    for (int e = 0; e < 3 * B; e++) *kr_kv_pos(p, first + e / B, e % B) = e;
    const struct { int32_t first; int n, len, pinned; const char *msg; } bad[] = {
        {first, 2, 10, 0, "n must be ceil(len / block_size)"},
        {first, 3, 8, 0, "n must be ceil(len / block_size)"},
        {first, 1, 0, 0, "n must be ceil(len / block_size)"},
        {first, 0, 1, 0, "n must be ceil(len / block_size)"},
        {first, -1, 0, 0, "n must be ceil(len / block_size)"},
        {first, 3, 10, 11, "pinned = 11"},
        {first, 3, 10, -1, "pinned = -1"},
        {N - 2, 3, 10, 0, "outside the pool"},
        {-1, 3, 10, 0, "outside the pool"},
        {first + 1, 3, 10, 0, "free in the pool"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        CHECK(kr_seq_list_adopt(s, 0, 0, bad[i].first, bad[i].n, bad[i].len, bad[i].pinned, err) == -1,
              "adopt of %d blocks at %d for %d entries, %d pinned accepted", bad[i].n, bad[i].first, bad[i].len,
              bad[i].pinned);
        CHECK_ERR_HAS(err, bad[i].msg);
    }
    CHECK(kr_seq_list_adopt(s, 1, 0, first, 3, 10, 0, err) == -1, "list (1, 0) of a 1-layer sequence");
    CHECK_ERR_HAS(err, "does not exist");
    *kr_kv_pos(p, first + 1, 2) = 5; /* entry 6 repeats entry 5's position */
    CHECK(kr_seq_list_adopt(s, 0, 0, first, 3, 10, 0, err) == -1, "positions not increasing accepted");
    CHECK_ERR_HAS(err, "position 5 at entry 6");
    *kr_kv_pos(p, first + 1, 2) = 6;
    *kr_kv_pos(p, first, 0) = -1;
    CHECK(kr_seq_list_adopt(s, 0, 0, first, 3, 10, 0, err) == -1, "a negative position accepted");
    CHECK_ERR_HAS(err, "position -1 at entry 0");
    *kr_kv_pos(p, first, 0) = 0;
    CHECK(kr_seq_blocks(s) == 0 && kr_seq_entries(s) == 0 && kr_kv_pool_n_free(p) == N - 3,
          "a refused adopt changed the list or the pool: blocks %d free %d", kr_seq_blocks(s), kr_kv_pool_n_free(p));
    CHECK(kr_seq_list_adopt(s, 0, 0, first, 0, 0, 0, err) == KR_OK && kr_seq_blocks(s) == 0, "n 0, len 0: %s", err);
    /* a list whose entries end inside a block refuses more: adopt 1 block of 3 entries, then the
     * other 2 blocks into the same list */
    REQUIRE(kr_seq_list_adopt(s, 0, 0, first, 1, 3, 0, err) == KR_OK, "%s", err);
    CHECK(kr_seq_list_adopt(s, 0, 0, first + 1, 2, 8, 0, err) == -1, "adopt after a part-filled block accepted");
    CHECK_ERR_HAS(err, "holds 3 entries from slot 0 of its 1 blocks");
    /* one whose entries fill its blocks takes more, positions above its last one, pinned count not
     * shrinking: block first + 1 (entries 100..103), then block first + 2 (104..107) */
    for (int e = 0; e < 2 * B; e++)
        *kr_kv_pos(p, first + 1 + e / B, e % B) = 100 + e;
    REQUIRE(kr_seq_list_adopt(s, 0, 1, first + 1, 1, B, 1, err) == KR_OK, "%s", err);
    *kr_kv_pos(p, first + 2, 0) = 103;
    CHECK(kr_seq_list_adopt(s, 0, 1, first + 2, 1, B, 1, err) == -1, "a position not above the list's accepted");
    CHECK_ERR_HAS(err, "position 103 at entry 4");
    *kr_kv_pos(p, first + 2, 0) = 104;
    CHECK(kr_seq_list_adopt(s, 0, 1, first + 2, 1, B, 0, err) == -1, "a pinned count that shrinks accepted");
    CHECK_ERR_HAS(err, "1 of them pinned before");
    REQUIRE(kr_seq_list_adopt(s, 0, 1, first + 2, 1, B, 2, err) == KR_OK, "%s", err);
    int len1, pinned1;
    int32_t got[2 * B];
    kr_seq_list_shape(s, 0, 1, &len1, &pinned1);
    REQUIRE(kr_seq_list_read(s, 0, 1, 0, 2 * B, got, NULL, NULL, err) == KR_OK, "%s", err);
    CHECK(len1 == 2 * B && pinned1 == 2 && kr_seq_blocks(s) == 3, "continued list: len %d pinned %d blocks %d",
          len1, pinned1, kr_seq_blocks(s));
    for (int e = 0; e < 2 * B; e++)
        CHECK(got[e] == 100 + e, "continued list: entry %d at position %d", e, got[e]);
    /* a closed sequence refuses too */
    int32_t spare;
    REQUIRE(kr_kv_pool_take_run(p, 1, &spare) == KR_OK, "no free block");
    *kr_kv_pos(p, spare, 0) = 200;
    REQUIRE(kr_seq_set_next_pos(s, 300, err) == KR_OK, "%s", err);
    CHECK(kr_seq_list_adopt(s, 0, 1, spare, 1, 1, 2, err) == -1, "adopt into a closed sequence accepted");
    CHECK_ERR_HAS(err, "closed by kr_seq_set_next_pos");
    kr_kv_pool_give_run(p, spare, 1);
    kr_seq_free(s);
    CHECK(kr_kv_pool_n_free(p) == N, "blocks leaked: %d free of %d", kr_kv_pool_n_free(p), N);
    kr_kv_pool_free(p);
}

/* Takes blocks one at a time (a list of block size 1 grown an entry at a time) until the pool
 * refuses: returns how many it got, all of them ids inside the pool, or -1. */
static int take_all_singly(kr_kv_pool *p)
{
    char err[KR_ERR_MAX];
    kr_seq *s;
    REQUIRE(kr_seq_create(p, 1, 1, &s, err) == KR_OK, "%s", err);
    int n = 0, bad = 0;
    while (n <= kr_kv_pool_n_blocks(p) && kr_seq_grow(s, 1, err) == KR_OK) {
        kr_seq_extend(s, 0, 0, 1);
        bad += kr_seq_list(s, 0, 0)->blocks[n++] >= kr_kv_pool_n_blocks(p);
    }
    CHECK_ERR_HAS(err, "KV pool exhausted");
    if (bad) {
        fprintf(stderr, "%d blocks taken past the pool's end\n", bad);
        exit(1); /* freeing them would write past the bitmap */
    }
    kr_seq_free(s);
    return n;
}

enum { DG_BLOCKS = 70 }; /* two bitmap words */

/* A run given back twice, or overlapping free blocks, or outside the pool: refused, the free
 * count unchanged, and takes after it get exactly the free blocks. */
static int give_run_twice(void)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create(2, 1, DG_BLOCKS, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);
    int32_t first;
    REQUIRE(kr_kv_pool_take_run(p, DG_BLOCKS, &first) == KR_OK && first == 0, "the whole pool");
    CHECK(kr_kv_pool_give_run(p, 60, 10) == KR_OK && kr_kv_pool_n_free(p) == 10, "free %d", kr_kv_pool_n_free(p));
    CHECK(kr_kv_pool_give_run(p, 55, 10) == -1, "a run with 5 free blocks given back"); /* KR_ASSERT stops here */
    CHECK(kr_kv_pool_give_run(p, 60, 10) == -1, "a run given back twice");
    CHECK(kr_kv_pool_give_run(p, -1, 2) == -1 && kr_kv_pool_give_run(p, DG_BLOCKS - 1, 2) == -1 &&
          kr_kv_pool_give_run(p, 0, -3) == -1, "a run outside the pool given back");
    CHECK(kr_kv_pool_n_free(p) == 10, "refused gives changed the free count: %d", kr_kv_pool_n_free(p));
    CHECK(take_all_singly(p) == 10, "takes after refused gives");
    CHECK(kr_kv_pool_give_run(p, 0, 60) == KR_OK && kr_kv_pool_n_free(p) == DG_BLOCKS, "free %d",
          kr_kv_pool_n_free(p));
    kr_kv_pool_free(p);
    return kt_failures;
}

/* A block a list holds, given back as a run (the pool cannot tell it from a run nobody holds):
 * when the list frees it again the second give is not counted. */
static int give_held_block(void)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p;
    kr_seq *s;
    REQUIRE(kr_kv_pool_create(2, 1, DG_BLOCKS, KR_DTYPE_F32, &p, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(p, 1, 1, &s, err) == KR_OK && kr_seq_grow(s, 3, err) == KR_OK, "%s", err);
    kr_seq_extend(s, 0, 0, 3); /* blocks 0, 1, 2 */
    CHECK(kr_kv_pool_give_run(p, 1, 1) == KR_OK, "block 1 is taken");
    kr_seq_free(s); /* gives block 1 a second time: KR_ASSERT stops here */
    CHECK(kr_kv_pool_n_free(p) == DG_BLOCKS, "free %d of %d after a double give", kr_kv_pool_n_free(p), DG_BLOCKS);
    CHECK(take_all_singly(p) == DG_BLOCKS, "takes after a double give");
    kr_kv_pool_free(p);
    return kt_failures;
}

/* Runs a scenario with a bad give in a child process: with KR_ASSERT on (the sanitizer build)
 * the child must abort at the bad give; with it compiled out it must finish with its checks
 * passed, the pool still consistent. */
static void check_bad_give(const char *what, int (*scenario)(void))
{
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    REQUIRE(pid >= 0, "fork");
    if (pid == 0) _exit(scenario() ? 1 : 0);
    int st;
    REQUIRE(waitpid(pid, &st, 0) == pid, "waitpid");
#if defined(KR_ASSERTS) && KR_ASSERTS
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "%s: KR_ASSERT did not stop it (wait status %#x)", what, st);
    if (WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT) printf("%s: stopped by KR_ASSERT, as it must be\n", what);
#else
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: the pool broke (wait status %#x)", what, st);
#endif
}

int main(void)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p;
    CHECK(kr_kv_pool_create(0, 16, 10, KR_DTYPE_F32, &p, err) == -1, "head_dim 0 accepted");
    CHECK_ERR_HAS(err, "head_dim");
    check_lowest_first();
    check_take_run();
    check_take_run_random();
    check_adopt();
    check_shared_pool();
    check_bad_give("a run given back twice", give_run_twice);
    check_bad_give("a list's block given back behind its back", give_held_block);
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
            kr_seq_extend(a, l, h, 5);
            for (int i = 0; i < 5; i++) {
                for (int d = 0; d < 4; d++) k[d] = (float)(100 * l + 10 * h + i), v[d] = -k[d] - d;
                kr_seq_put(a, l, h, i, k, v, 3 * i);
            }
        }
    int ok = 1;
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            const kr_kv_list *list = kr_seq_list(a, l, h);
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

    /* per-head lengths: trim one list to 1 entry (as eviction does; its second block goes back),
     * growth accounts per list */
    kr_seq_keep_ends(a, 0, 0, 1, 0);
    CHECK(kr_seq_grow(a, 3, err) == KR_OK, "%s", err); /* 1 + 3 and 5 + 3 fit in the blocks held */
    CHECK(kr_kv_pool_n_free(p) == 3 && kr_seq_blocks(a) == 7, "blocks %d free %d", kr_seq_blocks(a), kr_kv_pool_n_free(p));
    CHECK(kr_seq_grow(a, 4, err) == -1, "each list needs another block, 3 free");
    CHECK_ERR_HAS(err, "4 more blocks needed, 3 free of 10");

    kr_seq_free(a);
    CHECK(kr_kv_pool_n_free(p) == 10, "free after release %d", kr_kv_pool_n_free(p));

    /* keep_ends in both directions: 2 sinks + the newest 7 of 13 entries (head < tail: the
     * sinks move up, leading blocks go back, the offset absorbs the rest); then 3 + 1 (tail
     * moves down); growth after an offset; keep of an arbitrary subset */
    kr_seq *c;
    REQUIRE(kr_seq_create(p, 1, 1, &c, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(c, 13, err) == KR_OK, "%s", err);
    kr_seq_extend(c, 0, 0, 13);
    for (int i = 0; i < 13; i++) {
        for (int d = 0; d < 4; d++) k[d] = (float)i, v[d] = (float)-i;
        kr_seq_put(c, 0, 0, i, k, v, i);
    }
    kr_seq_keep_ends(c, 0, 0, 2, 7);
    const kr_kv_list *cl = kr_seq_list(c, 0, 0);
    const int want1[] = {0, 1, 6, 7, 8, 9, 10, 11, 12};
    ok = cl->len == 9 && cl->pinned == 2 && cl->n_blocks == 3 && kr_kv_pool_n_free(p) == 7;
    for (int i = 0; i < 9; i++)
        ok &= *kr_kv_list_pos(p, cl, i) == want1[i] &&
              ((const float *)kr_kv_list_key(p, cl, i))[1] == (float)want1[i] &&
              ((const float *)kr_kv_list_value(p, cl, i))[0] == (float)-want1[i];
    CHECK(ok, "sinks moved up: len %d off %d blocks %d free %d", cl->len, cl->off, cl->n_blocks, kr_kv_pool_n_free(p));
    REQUIRE(kr_seq_grow(c, 2, err) == KR_OK, "%s", err);
    kr_seq_extend(c, 0, 0, 2);
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
