/*
 * test_prefix_cache.c - the prefill node's prefix cache (prefill-node/prefix-cache.c) and the
 * engine pieces under it (kr_prefill_span, kr_seq_copy, kr_policy_prefix_deterministic).
 *
 * Exactness: for every policy family, prompts that extend, branch from and repeat each other go
 * through the cache one after another; each one's state after prefill (every list's entries,
 * positions, K and V rows, pinned counts and decode rules, the next position, the footprint)
 * and its last logits row must equal a prefill from scratch bit for bit, and so must the first
 * token's log-probability. The prefix-deterministic policies must reuse exactly the tokens the
 * cache's rules give; the others never reuse and keep nothing. Then: a forced hash collision
 * never reuses another prompt's state; the memory budget holds, least recently used states go
 * first and a state in use is never evicted; a state too big for the budget is skipped, not an
 * error; every block goes back to both pools.
 * Run: ctest -R test_prefix_cache (llama3-tiny and mistral-tiny from tests/fixtures).
 */
#include "kr_test.h"
#include "policy_files.h"

#include "../../prefill-node/prefix-cache.c"

#include <unistd.h>

enum { CHUNK = 16, BLOCK = 16, MAXP = 160 };

static char gates[256], windows[256];

typedef struct setup {
    kr_model *m;
    const kr_config *cfg;
    kr_ctx *ctx;
    kr_kv_pool *pool; /* the working pool: room for one prompt and then some */
    float *ref_logits, *logits;
} setup;

static void setup_init(setup *s, const char *dir, kr_kv_dtype dtype)
{
    char err[KR_ERR_MAX];
    REQUIRE(kr_model_load(dir, NULL, &s->m, err) == KR_OK, "%s: %s", dir, err);
    s->cfg = kr_model_config(s->m);
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 2, .max_chunk = CHUNK, .kv_dtype = dtype};
    REQUIRE(kr_ctx_create(s->m, &cp, &s->ctx, err) == KR_OK, "%s", err);
    int lists = s->cfg->n_layers * s->cfg->n_kv_heads;
    REQUIRE(kr_ctx_kv_pool_create(s->ctx, BLOCK, lists * (MAXP / BLOCK + 8), &s->pool, err) == KR_OK, "%s", err);
    s->ref_logits = malloc(sizeof(float) * (size_t)s->cfg->vocab_size);
    s->logits = malloc(sizeof(float) * (size_t)s->cfg->vocab_size);
    REQUIRE(s->ref_logits && s->logits, "oom");
}

static void setup_free(setup *s)
{
    free(s->ref_logits);
    free(s->logits);
    kr_kv_pool_free(s->pool);
    kr_ctx_free(s->ctx);
    kr_model_free(s->m);
}

/* Deterministic pseudo-random token ids. */
static void fill_tokens(int32_t *t, int n, uint64_t seed, int vocab)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        t[i] = (int32_t)((seed >> 33) % (uint64_t)vocab);
    }
}

/* Every list, the next position and the footprint of a and b equal, bit for bit; quiet: only
 * say whether they are. */
static int same_state(const setup *su, const kr_seq *a, const kr_seq *b, const char *what, int quiet)
{
    const int hd = su->cfg->head_dim;
    static int32_t pa[MAXP * 2], pb[MAXP * 2];
    static float ka[MAXP * 2 * 256], kb[MAXP * 2 * 256], va[MAXP * 2 * 256], vb[MAXP * 2 * 256];
    REQUIRE(hd <= 256, "head_dim %d", hd);
    char err[KR_ERR_MAX];
    int ok = 1;
    for (int l = 0; l < su->cfg->n_layers; l++)
        for (int g = 0; g < su->cfg->n_kv_heads; g++) {
            int la, lb, pina, pinb;
            kr_seq_list_shape(a, l, g, &la, &pina);
            kr_seq_list_shape(b, l, g, &lb, &pinb);
            kr_list_rule ra, rb;
            kr_seq_list_rule(a, l, g, &ra);
            kr_seq_list_rule(b, l, g, &rb);
            if (la != lb || pina != pinb || memcmp(&ra, &rb, sizeof ra) != 0) {
                if (quiet) return 0;
                CHECK(0, "%s: list (%d, %d): len %d/%d pinned %d/%d or rule differ", what, l, g, la, lb, pina, pinb);
                ok = 0;
                continue;
            }
            REQUIRE(la <= MAXP * 2, "list of %d", la);
            REQUIRE(kr_seq_list_read(a, l, g, 0, la, pa, ka, va, err) == KR_OK, "%s", err);
            REQUIRE(kr_seq_list_read(b, l, g, 0, lb, pb, kb, vb, err) == KR_OK, "%s", err);
            size_t rows = (size_t)la * (size_t)hd * sizeof(float);
            if (memcmp(pa, pb, sizeof *pa * (size_t)la) || memcmp(ka, kb, rows) || memcmp(va, vb, rows)) {
                if (quiet) return 0;
                CHECK(0, "%s: list (%d, %d): positions, K or V differ", what, l, g);
                ok = 0;
            }
        }
    kr_footprint fa, fb;
    kr_seq_footprint(a, &fa);
    kr_seq_footprint(b, &fb);
    if (kr_seq_next_pos(a) != kr_seq_next_pos(b) || fa.attended != fb.attended || fa.full != fb.full ||
        fa.steps != fb.steps || fa.peak_entries != fb.peak_entries || fa.peak_head_entries != fb.peak_head_entries) {
        if (quiet) return 0;
        CHECK(0, "%s: next_pos %d/%d or footprint (%.17g/%.17g, %.17g/%.17g, peak %lld/%lld) differ", what,
              kr_seq_next_pos(a), kr_seq_next_pos(b), fa.attended, fb.attended, fa.full, fb.full,
              (long long)fa.peak_entries, (long long)fb.peak_entries);
        ok = 0;
    }
    return ok;
}

/* Counts layers-final calls, as the node's pipeline hears them. */
typedef struct calls {
    int chunk_ends, last_final;
} calls;

static int count_final(void *arg, const kr_seq *s, int n_final, char *err)
{
    (void)s;
    (void)err;
    calls *c = arg;
    if (n_final == 0) c->chunk_ends++;
    else c->last_final = n_final;
    return KR_OK;
}

/* Prefills tokens[0, n) from scratch and through the cache (c may be NULL: no cache), compares
 * them, and returns the tokens the cache reused (-1 when the states differ). */
static int run_both(setup *su, pf_cache *c, const kr_policy *p, const int32_t *tokens, int n, const char *what)
{
    char err[KR_ERR_MAX];
    const int free0 = kr_kv_pool_n_free(su->pool);
    kr_seq *ref, *seq;
    REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &ref, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(ref, p, err) == KR_OK, "%s", err);
    calls rc = {0}, cc = {0};
    REQUIRE(kr_prefill_layers(su->ctx, ref, tokens, n, CHUNK, KR_LOGITS_LAST, su->ref_logits, count_final, &rc,
                              err) == KR_OK, "%s: %s", what, err);
    REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &seq, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(seq, p, err) == KR_OK, "%s", err);
    const pf_cache_job job = {.tokens = tokens, .n = n, .chunk = CHUNK, .policy = p, .fn = count_final, .arg = &cc};
    int reused = -2;
    REQUIRE(pf_cache_prefill(c, su->ctx, su->pool, &job, su->logits, &seq, &reused, err) == KR_OK, "%s: %s",
            what, err);
    int ok = same_state(su, ref, seq, what, 0);
    const int vocab = su->cfg->vocab_size;
    if (memcmp(su->ref_logits, su->logits, sizeof(float) * (size_t)vocab) != 0) {
        CHECK(0, "%s: the last logits row differs", what);
        ok = 0;
    }
    int32_t top_a, top_b;
    const int32_t first = kr_argmax(su->ref_logits, vocab);
    float lp_a = kr_logprob(su->ref_logits, vocab, first, &top_a), lp_b = kr_logprob(su->logits, vocab, first, &top_b);
    const int32_t forced = (first + 7) % vocab; /* a forced first token, as scoring asks for */
    float fa = kr_logprob(su->ref_logits, vocab, forced, NULL), fb = kr_logprob(su->logits, vocab, forced, NULL);
    CHECK(memcmp(&lp_a, &lp_b, sizeof lp_a) == 0 && top_a == top_b && memcmp(&fa, &fb, sizeof fa) == 0,
          "%s: log-probabilities differ", what);
    /* the last chunk announces every layer, whatever was reused */
    CHECK(cc.last_final == su->cfg->n_layers && rc.last_final == su->cfg->n_layers, "%s: layers-final %d/%d", what,
          rc.last_final, cc.last_final);
    CHECK(cc.chunk_ends <= rc.chunk_ends, "%s: %d chunk ends through the cache, %d from scratch", what,
          cc.chunk_ends, rc.chunk_ends);
    kr_seq_free(ref);
    kr_seq_free(seq);
    CHECK(kr_kv_pool_n_free(su->pool) == free0, "%s: working pool %d free, %d before", what,
          kr_kv_pool_n_free(su->pool), free0);
    return ok ? reused : -1;
}

static pf_cache *cache_new(setup *su, int64_t budget)
{
    char err[KR_ERR_MAX];
    pf_cache *c;
    const pf_cache_config cfg = {.budget_bytes = budget, .chunk = CHUNK, .block_size = BLOCK, .model = su->m,
                                 .kv_dtype = kr_ctx_kv_dtype(su->ctx)};
    REQUIRE(pf_cache_create(&cfg, &c, err) == 0, "%s", err);
    return c;
}

/* Blocks the cache holds, from its stats, equal to what its pool lent out. */
static int64_t cache_blocks(const pf_cache *c)
{
    int64_t b = 0;
    for (int f = 0; f < kr_policy_n_families(); f++) b += pf_cache_family_stats(c, f)->blocks;
    CHECK(b == pf_cache_n_blocks(c) - pf_cache_n_free(c), "stats say %lld blocks, the pool lent %d", (long long)b,
          pf_cache_n_blocks(c) - pf_cache_n_free(c));
    return b;
}

/* The prompts, one after another through one cache:
 *   P1 100 tokens: nothing cached; keeps its last boundary, 96.
 *   P2 P1's first 70 + 50 others: shares 64 with P1 (no state there): keeps 64 and 112.
 *   P3 P1 + 30 more: continues from P1's 96.
 *   P4 P2's first 90 + 20 others: shares 80 with P2, whose state at 64 it continues from.
 *   P1 again: continues from its own 96.
 *   P5 shorter than a chunk: nothing to reuse or keep. */
static void check_policies(setup *su, const char *model)
{
    static const struct {
        const char *spec;
        int deterministic;
    } specs[] = {
        {"full", 1},
        {"streaming:sink=4,window=24", 1},
        {"streaming:sink=2,window=20,lazy=3,pos=rel", 1},
        {"heads:pattern={g},sparsity=0.5,sink=4,window=12", 1},
        {"sage:budget=32", 1},
        {"snapkv:mode=naive,budget=40,obs=8", 1},
        {"snapkv:mode=naive,ratio=0.5,obs=4", 1},
        {"pyramidkv:mode=naive,budget=40,obs=8", 1},
        {"pyramidkv:mode=naive,ratio=0.3,obs=4", 1},
        {"snapkv:budget=40,obs=8", 0},
        {"pyramidkv:ratio=0.5,obs=4", 0},
        {"take:budget=32,probe=8,warmup_layers=2", 0},
        {"hsft:windows={w},pattern={g},budget=0.5,sink=4", 0},
    };
    int32_t p1[100], p2[120], p3[130], p4[110], p5[10];
    const int vocab = su->cfg->vocab_size;
    fill_tokens(p1, 100, 1, vocab);
    memcpy(p2, p1, sizeof(int32_t) * 70);
    fill_tokens(p2 + 70, 50, 2, vocab);
    p2[70] = (p1[70] + 1) % vocab; /* differs right at 70 */
    memcpy(p3, p1, sizeof p1);
    fill_tokens(p3 + 100, 30, 3, vocab);
    memcpy(p4, p2, sizeof(int32_t) * 90);
    fill_tokens(p4 + 90, 20, 4, vocab);
    p4[90] = (p2[90] + 1) % vocab;
    fill_tokens(p5, 10, 5, vocab);
    const struct {
        const int32_t *t;
        int n, reuse;
    } runs[] = {{p1, 100, 0}, {p2, 120, 0}, {p3, 130, 96}, {p4, 110, 64}, {p1, 100, 96}, {p5, 10, 0}};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        kr_policy *p = kr_test_policy(specs[i].spec, su->cfg, gates, windows);
        CHECK(kr_policy_prefix_deterministic(p) == specs[i].deterministic, "%s: prefix-deterministic %d",
              specs[i].spec, kr_policy_prefix_deterministic(p));
        pf_cache *c = cache_new(su, 64 << 20);
        int total = 0;
        for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
            char what[256];
            snprintf(what, sizeof what, "%s %s run %zu", model, specs[i].spec, r);
            int reused = run_both(su, c, p, runs[r].t, runs[r].n, what);
            int want = specs[i].deterministic ? runs[r].reuse : 0;
            CHECK(reused == want, "%s: reused %d tokens, expected %d", what, reused, want);
            total += reused > 0 ? reused : 0;
        }
        const pf_cache_stats *st = pf_cache_family_stats(c, kr_policy_family(p));
        if (specs[i].deterministic) {
            CHECK(st->hits == 3 && st->tokens_reused == 256 && st->inserts == 6 && st->entries == 6,
                  "%s: hits %llu reused %llu inserts %llu entries %lld", specs[i].spec,
                  (unsigned long long)st->hits, (unsigned long long)st->tokens_reused,
                  (unsigned long long)st->inserts, (long long)st->entries);
        } else {
            CHECK(st->hits == 0 && st->inserts == 0 && st->entries == 0 && st->never == 6,
                  "%s: a policy that is not prefix-deterministic: hits %llu inserts %llu bypassed %llu",
                  specs[i].spec, (unsigned long long)st->hits, (unsigned long long)st->inserts,
                  (unsigned long long)st->never);
        }
        CHECK(cache_blocks(c) * pf_cache_block_bytes(c) <= 64 << 20, "over budget");
        printf("%s %-48s reused %3d tokens over %zu prompts\n", model, specs[i].spec, total,
               sizeof runs / sizeof runs[0]);
        pf_cache_free(c);
        kr_policy_free(p);
    }
}

/* Why the others never reuse: continuing prompt b from the state prompt a left at a shared
 * boundary (what a cache hit would do) must give what prefilling b from scratch gives exactly
 * for the prefix-deterministic policies, and something else for the others (patched
 * observers and TAKE's probe are the prompt's last tokens; HS-SFT sizes its windows for the
 * prompt's length). This also shows same_state telling states apart. */
static void check_continuation(setup *su)
{
    static const struct {
        const char *spec;
        int deterministic;
    } specs[] = {
        {"full", 1}, {"streaming:sink=4,window=24", 1}, {"sage:budget=32", 1},
        {"snapkv:mode=naive,budget=40,obs=8", 1}, {"snapkv:budget=40,obs=8", 0},
        {"pyramidkv:ratio=0.5,obs=4", 0}, {"take:budget=32,probe=8,warmup_layers=2", 0},
        {"hsft:windows={w},pattern={g},budget=0.5,sink=4", 0},
    };
    char err[KR_ERR_MAX];
    int32_t a[100], b[130];
    fill_tokens(a, 100, 21, su->cfg->vocab_size);
    memcpy(b, a, sizeof a);
    fill_tokens(b + 100, 30, 22, su->cfg->vocab_size);
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        kr_policy *p = kr_test_policy(specs[i].spec, su->cfg, gates, windows);
        kr_seq *ref, *cont;
        REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &ref, err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &cont, err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_set_policy(ref, p, err) == KR_OK && kr_seq_set_policy(cont, p, err) == KR_OK, "%s", err);
        REQUIRE(kr_prefill(su->ctx, ref, b, 130, CHUNK, KR_LOGITS_LAST, su->ref_logits, err) == KR_OK, "%s", err);
        kr_prompt_span sa = {.tokens = a, .n = 100, .from = 0, .to = 96, .chunk = CHUNK};
        kr_prompt_span sb = {.tokens = b, .n = 130, .from = 96, .to = 130, .chunk = CHUNK};
        REQUIRE(kr_prefill_span(su->ctx, cont, &sa, KR_LOGITS_NONE, NULL, NULL, NULL, err) == KR_OK, "%s", err);
        REQUIRE(kr_prefill_span(su->ctx, cont, &sb, KR_LOGITS_LAST, su->logits, NULL, NULL, err) == KR_OK, "%s",
                err);
        int same = same_state(su, ref, cont, specs[i].spec, 1) &&
                   !memcmp(su->ref_logits, su->logits, sizeof(float) * (size_t)su->cfg->vocab_size);
        CHECK(same == specs[i].deterministic, "%s: continuing another prompt's state %s prefilling from scratch",
              specs[i].spec, same ? "equals" : "differs from");
        kr_seq_free(ref);
        kr_seq_free(cont);
        kr_policy_free(p);
    }
}

/* Every chunk hash equal: the tokens alone must decide. */
static uint64_t same_hash(uint64_t parent, const int32_t *tokens, int n)
{
    (void)parent;
    (void)tokens;
    (void)n;
    return 42;
}

static void check_collision(setup *su)
{
    char err[KR_ERR_MAX];
    kr_policy *p;
    REQUIRE(kr_policy_parse("streaming:sink=4,window=24", su->cfg, &p, err) == KR_OK, "%s", err);
    pf_cache *c = cache_new(su, 64 << 20);
    pf_cache_set_hash(c, same_hash);
    int32_t a[100], b[100], a2[120];
    fill_tokens(a, 100, 11, su->cfg->vocab_size);
    fill_tokens(b, 100, 12, su->cfg->vocab_size);
    memcpy(a2, a, sizeof a);
    fill_tokens(a2 + 100, 20, 13, su->cfg->vocab_size);
    CHECK(run_both(su, c, p, a, 100, "collision: a") == 0, "a: nothing cached yet");
    CHECK(run_both(su, c, p, b, 100, "collision: b") == 0, "b has another prompt's hashes, not its tokens");
    const pf_cache_stats *st = pf_cache_family_stats(c, kr_policy_family(p));
    CHECK(st->collisions >= 1, "the collision was not seen (%llu)", (unsigned long long)st->collisions);
    /* the tokens decide both ways: a real prefix is still found under colliding hashes */
    CHECK(run_both(su, c, p, a2, 120, "collision: a2") == 96, "a2 extends a");
    pf_cache_free(c);
    kr_policy_free(p);
}

/* Prompt i of the budget test: 100 tokens of its own. */
static void budget_prompt(int32_t *t, int i, int vocab)
{
    fill_tokens(t, 100, 100 + (uint64_t)i, vocab);
}

static void check_budget(setup *su)
{
    char err[KR_ERR_MAX];
    kr_policy *p;
    REQUIRE(kr_policy_parse("full", su->cfg, &p, err) == KR_OK, "%s", err);
    const int lists = su->cfg->n_layers * su->cfg->n_kv_heads;
    const int per_state = lists * (96 / BLOCK); /* a 100-token prompt keeps its first 96 */
    pf_cache *probe = cache_new(su, 1 << 20);
    const int64_t bb = pf_cache_block_bytes(probe);
    pf_cache_free(probe);
    /* room for two and a half states */
    const int64_t budget = bb * (per_state * 5 / 2);
    pf_cache *c = cache_new(su, budget);
    const int f = kr_policy_family(p);
    const pf_cache_stats *st = pf_cache_family_stats(c, f);
    int32_t t[100];
    for (int i = 0; i < 6; i++) {
        budget_prompt(t, i, su->cfg->vocab_size);
        char what[64];
        snprintf(what, sizeof what, "budget: prompt %d", i);
        CHECK(run_both(su, c, p, t, 100, what) == 0, "%s: distinct prompts share nothing", what);
        CHECK(cache_blocks(c) * bb <= budget, "%s: %lld bytes held over the budget %lld", what,
              (long long)(cache_blocks(c) * bb), (long long)budget);
    }
    CHECK(st->entries == 2 && st->evictions == 4, "entries %lld evictions %llu", (long long)st->entries,
          (unsigned long long)st->evictions);
    /* the most recent two are held, the oldest went first */
    budget_prompt(t, 5, su->cfg->vocab_size);
    CHECK(run_both(su, c, p, t, 100, "budget: 5 again") == 96, "the newest state was evicted");
    budget_prompt(t, 0, su->cfg->vocab_size);
    CHECK(run_both(su, c, p, t, 100, "budget: 0 again") == 0, "the oldest state was kept");
    /* a state in use is never evicted: hold prompt 7's while three others come and go */
    budget_prompt(t, 7, su->cfg->vocab_size);
    run_both(su, c, p, t, 100, "budget: 7");
    pf_cache_hit held;
    pf_cache_lookup(c, p, t, 100, &held);
    CHECK(held.entry && held.tokens == 96, "prompt 7's state is not found");
    for (int i = 8; i < 11; i++) {
        budget_prompt(t, i, su->cfg->vocab_size);
        run_both(su, c, p, t, 100, "budget: churn");
        CHECK(cache_blocks(c) * bb <= budget, "over budget while a state is held");
    }
    pf_cache_release(c, &held);
    budget_prompt(t, 7, su->cfg->vocab_size);
    CHECK(run_both(su, c, p, t, 100, "budget: 7 again") == 96, "a state in use was evicted");
    pf_cache_free(c);

    /* a budget below one 96-token state: it is skipped, every request still served, and the
     * 48-token state already held is not evicted for a state that could not fit anyway */
    c = cache_new(su, bb * (per_state - 1));
    st = pf_cache_family_stats(c, f);
    int32_t short_prompt[50];
    fill_tokens(short_prompt, 50, 77, su->cfg->vocab_size);
    CHECK(run_both(su, c, p, short_prompt, 50, "budget: short") == 0, "nothing cached yet");
    for (int i = 0; i < 3; i++) {
        budget_prompt(t, 0, su->cfg->vocab_size);
        CHECK(run_both(su, c, p, t, 100, "budget: too small") == 0, "nothing fits, nothing is reused");
    }
    CHECK(st->skipped == 3 && st->entries == 1 && st->evictions == 0 &&
              pf_cache_n_free(c) == pf_cache_n_blocks(c) - lists * 3,
          "skipped %llu entries %lld evictions %llu", (unsigned long long)st->skipped, (long long)st->entries,
          (unsigned long long)st->evictions);
    CHECK(run_both(su, c, p, short_prompt, 50, "budget: short again") == 48, "the short state was lost");
    pf_cache_free(c);
    kr_policy_free(p);
}

/* kr_seq_copy into a pool of another block size and back, then the prefill continued: still the
 * prefill from scratch, bit for bit (a copy packs lists from slot 0, in any block size). A pool
 * of another dtype or head_dim is refused. */
static void check_copy_layouts(setup *su)
{
    char err[KR_ERR_MAX];
    kr_policy *p = kr_test_policy("streaming:sink=4,window=24", su->cfg, gates, windows);
    int32_t t[130];
    fill_tokens(t, 130, 31, su->cfg->vocab_size);
    kr_seq *ref, *part, *odd, *back;
    REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &ref, err) == KR_OK &&
                kr_seq_set_policy(ref, p, err) == KR_OK,
            "%s", err);
    REQUIRE(kr_prefill(su->ctx, ref, t, 130, CHUNK, KR_LOGITS_LAST, su->ref_logits, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &part, err) == KR_OK &&
                kr_seq_set_policy(part, p, err) == KR_OK,
            "%s", err);
    kr_prompt_span sp = {.tokens = t, .n = 130, .from = 0, .to = 96, .chunk = CHUNK};
    REQUIRE(kr_prefill_span(su->ctx, part, &sp, KR_LOGITS_NONE, NULL, NULL, NULL, err) == KR_OK, "%s", err);
    kr_kv_pool *five;
    REQUIRE(kr_kv_pool_create(su->cfg->head_dim, 5, 400, kr_ctx_kv_dtype(su->ctx), &five, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_copy(part, five, NULL, &odd, err) == KR_OK, "%s", err);
    kr_seq_free(part);
    REQUIRE(kr_seq_copy(odd, su->pool, p, &back, err) == KR_OK, "%s", err);
    kr_seq_free(odd);
    CHECK(kr_kv_pool_n_free(five) == kr_kv_pool_n_blocks(five), "the 5-entry pool leaked");
    sp = (kr_prompt_span){.tokens = t, .n = 130, .from = 96, .to = 130, .chunk = CHUNK};
    REQUIRE(kr_prefill_span(su->ctx, back, &sp, KR_LOGITS_LAST, su->logits, NULL, NULL, err) == KR_OK, "%s", err);
    CHECK(same_state(su, ref, back, "copied through 5-entry blocks", 0) &&
              !memcmp(su->ref_logits, su->logits, sizeof(float) * (size_t)su->cfg->vocab_size),
          "a copy through another block size changed the prefill");
    kr_kv_pool *other;
    kr_dtype od = kr_ctx_kv_dtype(su->ctx) == KR_DTYPE_F32 ? KR_DTYPE_BF16 : KR_DTYPE_F32;
    REQUIRE(kr_kv_pool_create(su->cfg->head_dim, 16, 100, od, &other, err) == KR_OK, "%s", err);
    kr_seq *none = NULL;
    CHECK(kr_seq_copy(back, other, NULL, &none, err) == -1 && !none, "copied into a pool of another dtype");
    CHECK_ERR_HAS(err, "the pool holds");
    kr_kv_pool_free(other);
    kr_kv_pool_free(five);
    kr_seq_free(back);
    kr_seq_free(ref);
    kr_policy_free(p);
}

static void check_errors(setup *su)
{
    char err[KR_ERR_MAX];
    pf_cache *c;
    const pf_cache_config cfg = {.budget_bytes = 100, .chunk = CHUNK, .block_size = BLOCK, .model = su->m,
                                 .kv_dtype = kr_ctx_kv_dtype(su->ctx)};
    CHECK(pf_cache_create(&cfg, &c, err) == -1, "a budget below one block");
    CHECK_ERR_HAS(err, "less than one KV block");
    /* a span that does not start on a chunk boundary */
    kr_seq *s;
    REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    int32_t t[40];
    fill_tokens(t, 40, 9, su->cfg->vocab_size);
    kr_prompt_span sp = {.tokens = t, .n = 40, .from = 5, .to = 40, .chunk = CHUNK};
    CHECK(kr_prefill_span(su->ctx, s, &sp, KR_LOGITS_NONE, NULL, NULL, NULL, err) == -1, "from 5");
    CHECK_ERR_HAS(err, "chunk boundaries");
    sp = (kr_prompt_span){.tokens = t, .n = 40, .from = 0, .to = 20, .chunk = CHUNK};
    CHECK(kr_prefill_span(su->ctx, s, &sp, KR_LOGITS_NONE, NULL, NULL, NULL, err) == -1, "to 20");
    kr_seq_free(s);
    /* a policy with per-sequence state cannot be copied */
    kr_policy *take = kr_test_policy("take:budget=32,probe=8", su->cfg, gates, windows);
    REQUIRE(kr_seq_create(su->pool, su->cfg->n_layers, su->cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(s, take, err) == KR_OK, "%s", err);
    kr_seq *copy = NULL;
    CHECK(kr_seq_copy(s, su->pool, NULL, &copy, err) == -1 && !copy, "take's state copied");
    CHECK_ERR_HAS(err, "per-sequence state");
    kr_seq_free(s);
    kr_policy_free(take);
}

int main(void)
{
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    char tmp[64] = "/tmp/kr_test_prefix_cache.XXXXXX";
    REQUIRE(mkdtemp(tmp), "mkdtemp");
    snprintf(gates, sizeof gates, "%s/gates.tsv", tmp);
    snprintf(windows, sizeof windows, "%s/windows.txt", tmp);
    const struct {
        const char *model;
        kr_kv_dtype dtype;
    } cases[] = {{"llama3-tiny", KR_KV_DTYPE_F32}, {"mistral-tiny", KR_KV_DTYPE_BF16}};
    for (int i = 0; i < 2; i++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/models/%s", fx, cases[i].model);
        setup su;
        setup_init(&su, dir, cases[i].dtype);
        kr_test_policy_files(su.cfg, gates, windows);
        const int free0 = kr_kv_pool_n_free(su.pool);
        check_policies(&su, cases[i].model);
        if (i == 0) {
            check_continuation(&su);
            check_copy_layouts(&su);
            check_collision(&su);
            check_budget(&su);
            check_errors(&su);
        }
        CHECK(kr_kv_pool_n_free(su.pool) == free0, "%s: the working pool leaked", cases[i].model);
        setup_free(&su);
    }
    unlink(gates);
    unlink(windows);
    rmdir(tmp);
    return kt_done("test_prefix_cache");
}
