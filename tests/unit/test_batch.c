/*
 * test_batch.c - kr_forward_batch against kr_forward. Every fixture model (llama3-tiny bf16,
 * qwen2-tiny f16, mistral-tiny f32 and sharded) plus a random bf16 model with a sliding window:
 * sequences under different policies (full, streaming with lazy pruning and with pos=rel, sage,
 * snapkv, pyramidkv, take, heads, hsft: budgets small enough that decode evicts) and prompts are
 * prefilled twice, into two pools. Then greedy decode runs (a) one sequence at a time with
 * kr_forward in one pool and (b) continuous batching with kr_forward_batch in the other:
 * sequences join late and leave early, the batch order is shuffled every step, batch sizes run
 * from 1 to 34 (past the CPU's sgemm switch at 6 rows and the decode kernels' tiles of 6 tokens),
 * with 2 threads, and 1 for llama3-tiny. Each step's logits must be memcmp-identical, and at the
 * end every list, footprint and peak equal. ctest runs this on the CPU variant the machine picks
 * and again on the avx512 and avx2 ones (test_batch_avx512, test_batch_avx2). Then the error cases:
 * a pool that cannot give one sequence its block feeds nothing to any, duplicates, bad tokens,
 * batch sizes out of range, NULL and foreign-shaped sequences.
 */
#include "kr_test.h"
#include "policy_files.h"

#include "kr.h"

#include <stdint.h>
#include <unistd.h>

enum { N_SEQS = 34, MAX_PROMPT = 70, MAX_STEPS = 44, BLOCK = 8 };

static char tmp[256];

/* policy specs; {g} and {w} become a gate TSV and a windows file written for the model */
static const char *const SPECS[] = {
    "full",
    "streaming:sink=2,window=12,lazy=3",
    "streaming:sink=3,window=10,pos=rel",
    "sage:budget=32",
    "snapkv:mode=patched,obs=4,budget=24,decode=window:8",
    "pyramidkv:mode=naive,obs=4,budget=24",
    "take:budget=16,warmup_budget=32,probe=4,decode=window:6",
    "heads:pattern={g},sparsity=0.5,sink=2,window=8",
    "hsft:windows={w},pattern={g},budget=0.5,sink=2",
};
enum { N_SPECS = sizeof SPECS / sizeof SPECS[0] };

/* gates that make about half the heads of every model dense; windows growing with depth */
static void write_policy_files(const kr_config *cfg, char *gates, char *windows, size_t cap)
{
    snprintf(gates, cap, "%s/gates.tsv", tmp);
    snprintf(windows, cap, "%s/windows.txt", tmp);
    kr_test_policy_files(cfg, gates, windows);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* every list of a and b holds the same entries (positions, keys, values) and pinned counts */
static int same_lists(const kr_seq *a, const kr_seq *b, const kr_config *cfg)
{
    char err[KR_ERR_MAX];
    const size_t hd = (size_t)cfg->head_dim;
    for (int l = 0; l < cfg->n_layers; l++)
        for (int g = 0; g < cfg->n_kv_heads; g++) {
            int la, pa, lb, pb;
            kr_seq_list_shape(a, l, g, &la, &pa);
            kr_seq_list_shape(b, l, g, &lb, &pb);
            if (la != lb || pa != pb) return 0;
            int32_t *pos = malloc(sizeof(int32_t) * 2 * (size_t)(la + 1));
            float *kv = malloc(sizeof(float) * 4 * hd * (size_t)(la + 1));
            float *ka = kv, *va = kv + hd * la, *kb = kv + 2 * hd * la, *vb = kv + 3 * hd * la;
            REQUIRE(kr_seq_list_read(a, l, g, 0, la, pos, ka, va, err) == KR_OK, "%s", err);
            REQUIRE(kr_seq_list_read(b, l, g, 0, lb, pos + la, kb, vb, err) == KR_OK, "%s", err);
            int same = !memcmp(pos, pos + la, sizeof(int32_t) * (size_t)la) &&
                       !memcmp(ka, kb, sizeof(float) * hd * (size_t)la) && !memcmp(va, vb, sizeof(float) * hd * (size_t)la);
            free(pos);
            free(kv);
            if (!same) return 0;
        }
    return 1;
}

typedef struct plan {
    int spec; /* index into SPECS */
    int n_prompt;
    int join; /* the step of the schedule at which it joins the batch */
    int steps; /* decode tokens it is fed */
} plan;

/* Decodes N_SEQS sequences of `m` both ways and compares; `label` names the model. */
static void check_model(const kr_model *m, const char *label, int n_threads)
{
    char err[KR_ERR_MAX], gates[512], windows[512], spec[1024];
    const kr_config *cfg = kr_model_config(m);
    const int V = cfg->vocab_size;
    write_policy_files(cfg, gates, windows, sizeof gates);
    kr_policy *pol[N_SPECS];
    for (int k = 0; k < N_SPECS; k++) {
        kr_test_expand(SPECS[k], gates, windows, spec, sizeof spec);
        REQUIRE(kr_policy_parse(spec, cfg, &pol[k], err) == KR_OK, "%s: %s", spec, err);
    }
    kr_ctx *c;
    kr_ctx_params cp = {.n_threads = n_threads, .max_chunk = 40};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    kr_kv_pool *pa, *pb;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, BLOCK, 8192, KR_DTYPE_F32, &pa, err) == KR_OK, "%s", err);
    REQUIRE(kr_kv_pool_create(cfg->head_dim, BLOCK, 8192, KR_DTYPE_F32, &pb, err) == KR_OK, "%s", err);

    /* who joins when and stays how long: the first three start together, the rest trickle in
     * over the first ten steps, some leave early, so the batch grows to all of them and shrinks
     * back to one */
    plan pl[N_SEQS];
    for (int i = 0; i < N_SEQS; i++) {
        pl[i].spec = i % N_SPECS;
        pl[i].n_prompt = 20 + (i * 23) % (MAX_PROMPT - 20);
        pl[i].join = i < 3 ? 0 : 1 + i % 10;
        pl[i].steps = i == 0 ? MAX_STEPS : 12 + (i * 7) % 20;
    }
    kr_seq *sa[N_SEQS], *sb[N_SEQS];
    int32_t next[N_SEQS];
    int done[N_SEQS] = {0};
    float *la = malloc(sizeof(float) * V), *lb = malloc(sizeof(float) * (size_t)V * N_SEQS);
    int32_t prompt[MAX_PROMPT];
    for (int i = 0; i < N_SEQS; i++) {
        for (int t = 0; t < pl[i].n_prompt; t++) prompt[t] = (int32_t)((t * 31 + i * 17 + 3) % V);
        REQUIRE(kr_seq_create(pa, cfg->n_layers, cfg->n_kv_heads, &sa[i], err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_create(pb, cfg->n_layers, cfg->n_kv_heads, &sb[i], err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_set_policy(sa[i], pol[pl[i].spec], err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_set_policy(sb[i], pol[pl[i].spec], err) == KR_OK, "%s", err);
        REQUIRE(kr_prefill(c, sa[i], prompt, pl[i].n_prompt, 16, KR_LOGITS_LAST, la, err) == KR_OK, "%s", err);
        REQUIRE(kr_prefill(c, sb[i], prompt, pl[i].n_prompt, 16, KR_LOGITS_LAST, lb, err) == KR_OK, "%s", err);
        CHECK(!memcmp(la, lb, sizeof(float) * V), "%s seq %d: prefill not deterministic", label, i);
        next[i] = argmax(la, V);
    }

    int sizes_seen[N_SEQS + 1] = {0}, evicted = 0, mismatches = 0, rows = 0;
    for (int step = 0;; step++) {
        kr_seq *batch[N_SEQS];
        int32_t tok[N_SEQS];
        int who[N_SEQS], n = 0, alive = 0;
        for (int i = 0; i < N_SEQS; i++) {
            if (done[i] == pl[i].steps) continue;
            alive++;
            if (step >= pl[i].join) who[n++] = i;
        }
        if (!alive) break;
        if (!n) continue;
        for (int k = n - 1; k > 0; k--) { /* shuffled order */
            int r = (int)(next_rand() % (uint32_t)(k + 1)), t = who[k];
            who[k] = who[r];
            who[r] = t;
        }
        for (int k = 0; k < n; k++) batch[k] = sb[who[k]], tok[k] = next[who[k]];
        REQUIRE(kr_forward_batch(c, batch, tok, n, lb, err) == KR_OK, "%s step %d: %s", label, step, err);
        sizes_seen[n] = 1;
        for (int k = 0; k < n; k++) {
            int i = who[k];
            int64_t before = kr_seq_entries(sa[i]);
            REQUIRE(kr_forward(c, sa[i], &tok[k], 1, KR_LOGITS_LAST, la, err) == KR_OK, "%s", err);
            evicted |= kr_seq_entries(sa[i]) <= before;
            if (memcmp(la, lb + (size_t)k * V, sizeof(float) * V) && mismatches++ < 5)
                CHECK(0, "%s step %d: seq %d (%s, row %d of %d) differs from kr_forward", label, step, i,
                      SPECS[pl[i].spec], k, n);
            next[i] = argmax(la, V);
            done[i]++;
            rows++;
        }
    }
    CHECK(mismatches == 0, "%s: %d rows differ", label, mismatches);
    CHECK(sizes_seen[1] && sizes_seen[N_SEQS], "%s: batch sizes 1 and %d not both run", label, N_SEQS);
    CHECK(evicted, "%s: no policy evicted anything during decode", label);
    for (int i = 0; i < N_SEQS; i++) {
        kr_footprint fa, fb;
        kr_seq_footprint(sa[i], &fa);
        kr_seq_footprint(sb[i], &fb);
        CHECK(fa.attended == fb.attended && fa.full == fb.full && fa.steps == fb.steps,
              "%s seq %d (%s): footprint %g/%g over %lld steps vs batched %g/%g over %lld", label, i,
              SPECS[pl[i].spec], fa.attended, fa.full, (long long)fa.steps, fb.attended, fb.full, (long long)fb.steps);
        CHECK(fa.peak_entries == fb.peak_entries && fa.peak_head_entries == fb.peak_head_entries,
              "%s seq %d: peaks %lld/%lld vs batched %lld/%lld", label, i, (long long)fa.peak_entries,
              (long long)fa.peak_head_entries, (long long)fb.peak_entries, (long long)fb.peak_head_entries);
        CHECK(fa.steps == pl[i].n_prompt + pl[i].steps, "%s seq %d: %lld steps", label, i, (long long)fa.steps);
        CHECK(kr_seq_next_pos(sa[i]) == kr_seq_next_pos(sb[i]), "%s seq %d: next_pos", label, i);
        CHECK(kr_seq_blocks(sa[i]) == kr_seq_blocks(sb[i]), "%s seq %d: blocks %d vs %d", label, i,
              kr_seq_blocks(sa[i]), kr_seq_blocks(sb[i]));
        CHECK(same_lists(sa[i], sb[i], cfg), "%s seq %d (%s): lists differ", label, i, SPECS[pl[i].spec]);
        kr_seq_free(sa[i]);
        kr_seq_free(sb[i]);
    }
    CHECK(kr_kv_pool_n_free(pa) == kr_kv_pool_n_blocks(pa) && kr_kv_pool_n_free(pb) == kr_kv_pool_n_blocks(pb),
          "%s: blocks leaked", label);
    printf("%s, %d threads: %d sequences, batch sizes 1..%d: %d rows compared with kr_forward, %d differ\n", label,
           n_threads, N_SEQS, N_SEQS, rows, mismatches);
    free(la);
    free(lb);
    kr_kv_pool_free(pa);
    kr_kv_pool_free(pb);
    kr_ctx_free(c);
    for (int k = 0; k < N_SPECS; k++) kr_policy_free(pol[k]);
}

typedef struct seq_state {
    int next_pos;
    int64_t entries;
    int blocks;
    kr_footprint fp;
} seq_state;

static seq_state state_of(const kr_seq *s)
{
    seq_state st = {.next_pos = kr_seq_next_pos(s), .entries = kr_seq_entries(s), .blocks = kr_seq_blocks(s)};
    kr_seq_footprint(s, &st.fp);
    return st;
}

static int same_state(seq_state a, seq_state b)
{
    return a.next_pos == b.next_pos && a.entries == b.entries && a.blocks == b.blocks &&
           a.fp.attended == b.fp.attended && a.fp.steps == b.fp.steps && a.fp.peak_entries == b.fp.peak_entries;
}

static void check_errors(const kr_model *m)
{
    char err[KR_ERR_MAX];
    const kr_config *cfg = kr_model_config(m);
    const int lists = cfg->n_layers * cfg->n_kv_heads;
    kr_ctx *c;
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = 8};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    /* blocks of 4, both sequences with their blocks full (the next token needs a new block in
     * every list): y can get its blocks, then x cannot, so y's must go back */
    kr_kv_pool *pool;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, 4, 5 * lists - 1, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    kr_seq *x, *y, *z;
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &x, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &y, err) == KR_OK, "%s", err);
    int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    float *lg = malloc(sizeof(float) * (size_t)cfg->vocab_size * 4);
    REQUIRE(kr_prefill(c, y, ids, 4, 0, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(c, x, ids, 8, 0, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    CHECK(kr_kv_pool_n_free(pool) == 2 * lists - 1, "free blocks %d", kr_kv_pool_n_free(pool));
    seq_state x0 = state_of(x), y0 = state_of(y);
    int free0 = kr_kv_pool_n_free(pool);

    kr_seq *both[3] = {y, x, NULL};
    int32_t tok[3] = {9, 10, 11};
    CHECK(kr_forward_batch(c, both, tok, 2, lg, err) == -1, "x cannot grow: the batch must fail");
    CHECK_ERR_HAS(err, "sequence 1: KV pool exhausted");
    CHECK_ERR_HAS(err, "nothing was fed");
    CHECK(same_state(state_of(x), x0) && same_state(state_of(y), y0), "a failed batch changed a sequence");
    CHECK(kr_kv_pool_n_free(pool) == free0, "a failed batch kept blocks: %d free, was %d", kr_kv_pool_n_free(pool), free0);
    /* without x it goes */
    CHECK(kr_forward_batch(c, both, tok, 1, lg, err) == KR_OK, "%s", err);
    CHECK(kr_seq_next_pos(y) == 5 && kr_kv_pool_n_free(pool) == lists - 1, "y fed: next_pos %d, %d free",
          kr_seq_next_pos(y), kr_kv_pool_n_free(pool));
    free0 = kr_kv_pool_n_free(pool);
    y0 = state_of(y);

    both[0] = x, both[1] = y, both[2] = x;
    CHECK(kr_forward_batch(c, both, tok, 3, lg, err) == -1, "duplicate accepted");
    CHECK_ERR_HAS(err, "sequence 2 is also sequence 0");
    both[2] = NULL;
    CHECK(kr_forward_batch(c, both, tok, 3, lg, err) == -1, "NULL accepted");
    CHECK_ERR_HAS(err, "sequence 2 is NULL");
    both[0] = y, both[1] = x;
    int32_t bad[2] = {5, cfg->vocab_size};
    CHECK(kr_forward_batch(c, both, bad, 2, lg, err) == -1, "token = vocab accepted");
    CHECK_ERR_HAS(err, "outside the vocabulary");
    bad[1] = -1;
    CHECK(kr_forward_batch(c, both, bad, 2, lg, err) == -1, "token -1 accepted");
    CHECK_ERR_HAS(err, "token id -1 at index 1");
    CHECK(kr_forward_batch(c, both, tok, 0, lg, err) == -1, "n = 0 accepted");
    CHECK_ERR_HAS(err, "0 sequences");
    CHECK(kr_forward_batch(c, both, tok, 9, lg, err) == -1, "n > max_chunk accepted");
    CHECK_ERR_HAS(err, "allowed 1..8");
    CHECK(kr_forward_batch(c, both, NULL, 2, lg, err) == -1, "NULL tokens accepted");
    /* a sequence shaped for another model */
    REQUIRE(kr_seq_create(pool, cfg->n_layers + 1, cfg->n_kv_heads, &z, err) == KR_OK, "%s", err);
    both[0] = y, both[1] = z;
    CHECK(kr_forward_batch(c, both, tok, 2, lg, err) == -1, "foreign shape accepted");
    CHECK_ERR_HAS(err, "sequence 1 has");
    CHECK(same_state(state_of(x), x0) && same_state(state_of(y), y0), "a refused batch changed a sequence");
    CHECK(kr_kv_pool_n_free(pool) == free0, "blocks moved by refused batches");
    kr_seq_free(z);
    kr_seq_free(x);
    kr_seq_free(y);
    CHECK(kr_kv_pool_n_free(pool) == kr_kv_pool_n_blocks(pool), "blocks leaked");
    kr_kv_pool_free(pool);
    kr_ctx_free(c);
    free(lg);
}

int main(void)
{
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    snprintf(tmp, sizeof tmp, "/tmp/kr_test_batch.XXXXXX");
    REQUIRE(mkdtemp(tmp), "mkdtemp");
    char dir[4096], err[KR_ERR_MAX];
    const char *models[] = {"llama3-tiny", "qwen2-tiny", "mistral-tiny"};
    kr_model *m;
    for (int i = 0; i < 3; i++) {
        snprintf(dir, sizeof dir, "%s/models/%s", fx, models[i]);
        REQUIRE(kr_model_load(dir, NULL, &m, err) == KR_OK, "%s: %s", dir, err);
        check_model(m, models[i], 2);
        if (i == 0) check_model(m, models[i], 1);
        if (i == 0) check_errors(m);
        kr_model_free(m);
    }
    /* a sliding window in every layer (no fixture has one): mistral-tiny's shape, random bf16 */
    kr_config cfg;
    snprintf(dir, sizeof dir, "%s/models/mistral-tiny", fx);
    REQUIRE(kr_config_load(dir, &cfg, err) == KR_OK, "%s", err);
    cfg.sliding_window = 12;
    cfg.sliding_window_first_layer = 0;
    REQUIRE(kr_model_random(&cfg, KR_DTYPE_BF16, 5, &m, err) == KR_OK, "%s", err);
    check_model(m, "mistral-shaped, random bf16, sliding window 12", 2);
    kr_model_free(m);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    CHECK(system(cmd) == 0, "cannot remove %s", tmp);
    return kt_done("test_batch");
}
