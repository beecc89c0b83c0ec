/*
 * test_seq_io.c - moving a sequence between pools as a prefill node and a decode node do:
 * - exactness: sequence A is prefilled under a policy in one pool (blocks of 16); every list is
 *   read out and appended to a new sequence B in another pool (blocks of 5, in two calls per
 *   list), B's next position set; then A decodes alone with kr_forward while every B decodes
 *   in one kr_forward_batch per step, greedily, and each step's logits must be memcmp-identical.
 *   Every fixture model, every policy family, with decode rules that trim (streaming's lazy
 *   pruning and pos=rel, sage's cap, decode windows, heads/hsft streaming heads with hsft's
 *   windows rescaled for the prompt, which the receiver must rebuild); with f32 and bf16 KV
 *   pools (and f16 for one model);
 * - the block bound: B imported into a pool of exactly kr_seq_blocks_bound blocks decodes a
 *   long continuation without running out (transients inside a step included), for every policy
 *   and block sizes 1, 3, 8, 16; under full attention one block less runs out (the bound is
 *   tight there);
 * - the rule bound: kr_list_rule_blocks_bound against each list decoded step by step under random
 *   rules (exact in entries, never below in blocks), and, summed over the lists every policy's
 *   prefill leaves, between what the sequence held and kr_seq_blocks_bound's reservation;
 * - list windows: kr_policy_list_window and kr_seq_list_window per family;
 * - errors: appending after tokens or after set_next_pos, positions not strictly increasing or
 *   not above the list's last, a pool that runs out (list untouched), pinned beyond the list,
 *   list rules out of range or after set_next_pos,
 *   set_next_pos not above a held position or after tokens, set_policy after set_next_pos,
 *   reads outside a list.
 */
#include "kr_test.h"
#include "policy_files.h"

#include "kr-util.h"
#include "policy.h"

#include <stdint.h>
#include <unistd.h>

enum { N_PROMPT = 45, N_DECODE = 30, N_LONG = 50, CHUNK = 16 };

static char tmp[256], gates[512], windows[512];

static const char *const SPECS[] = {
    "full",
    "full:decode=window:10",
    "streaming:sink=2,window=12,lazy=3",
    "streaming:sink=3,window=10,pos=rel",
    "streaming:sink=2,window=12,lazy=4,slack=3,max_drop=2",
    "streaming:sink=2,window=12,decode=grow",
    "sage:budget=32",
    "sage:budget=32,decode=window:5",
    "snapkv:mode=patched,obs=4,budget=24,decode=window:8",
    "pyramidkv:mode=naive,obs=4,budget=24",
    "take:budget=16,warmup_budget=32,probe=4,decode=window:6",
    "heads:pattern={g},sparsity=0.5,sink=2,window=8",
    "hsft:windows={w},pattern={g},budget=0.5,sink=2",
    "hsft:windows={w},pattern={g},budget=0.5,sink=2,decode=grow",
};
enum { N_SPECS = sizeof SPECS / sizeof SPECS[0] };

/* a spec whose {g} and {w} name this test's policy files */
static kr_policy *parse(const char *tmpl, const kr_config *cfg)
{
    return kr_test_policy(tmpl, cfg, gates, windows);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static void prompt_ids(int32_t *ids, int n, int salt, int vocab)
{
    for (int t = 0; t < n; t++) ids[t] = (int32_t)((t * 29 + salt * 13 + 7) % vocab);
}

/* FNV-1a over every list's length, pinned count, positions, keys and values */
static uint64_t digest(const kr_seq *s, const kr_config *cfg)
{
    char err[KR_ERR_MAX];
    uint64_t h = 1469598103934665603ull;
    for (int l = 0; l < cfg->n_layers; l++)
        for (int g = 0; g < cfg->n_kv_heads; g++) {
            int len, pinned;
            kr_seq_list_shape(s, l, g, &len, &pinned);
            size_t row = (size_t)cfg->head_dim * sizeof(float), bytes = 2 * sizeof(int) + (size_t)len * (4 + 2 * row);
            unsigned char *buf = malloc(bytes);
            memcpy(buf, &len, sizeof len);
            memcpy(buf + sizeof len, &pinned, sizeof pinned);
            int32_t *pos = (int32_t *)(buf + 2 * sizeof(int));
            float *k = (float *)(pos + len), *v = k + (size_t)len * cfg->head_dim;
            REQUIRE(kr_seq_list_read(s, l, g, 0, len, pos, k, v, err) == KR_OK, "%s", err);
            for (size_t i = 0; i < bytes; i++) h = (h ^ buf[i]) * 1099511628211ull;
            free(buf);
        }
    return h;
}

/* Rows handed over by kr_seq_list_visit, copied into the caller's arrays at `at` (kr_list_rows_fn);
 * runs must come in order, each inside one block of the pool */
typedef struct visit_rows {
    int32_t *pos;
    float *k, *v;
    size_t hd;
    int next, block_size, runs;
} visit_rows;

static int take_run(void *arg, int first, int n, const int32_t *pos, kr_dtype dtype, const void *k, const void *v,
                    char *err)
{
    visit_rows *r = arg;
    CHECK(first == r->next && n >= 1 && n <= r->block_size, "visit: run [%d, %d) after %d (blocks of %d)", first,
          first + n, r->next, r->block_size);
    memcpy(r->pos + first, pos, sizeof(int32_t) * (size_t)n);
    kr_dtype_to_f32(dtype, k, (size_t)n * r->hd, r->k + (size_t)first * r->hd);
    kr_dtype_to_f32(dtype, v, (size_t)n * r->hd, r->v + (size_t)first * r->hd);
    r->next = first + n;
    r->runs++;
    (void)err;
    return 0;
}

/* The rows kr_seq_list_fill asks for, from arrays (kr_list_fill_fn); fails at entry `fail_at` */
typedef struct fill_rows {
    const int32_t *pos;
    const float *k, *v;
    size_t hd;
    int fail_at;
} fill_rows;

static int give_run(void *arg, int first, int n, int32_t *pos, kr_dtype dtype, void *k, void *v, char *err)
{
    const fill_rows *f = arg;
    if (f->fail_at >= first && f->fail_at < first + n) return kr_errf(err, "fill refused entry %d", f->fail_at);
    memcpy(pos, f->pos + first, sizeof(int32_t) * (size_t)n);
    kr_dtype_from_f32(dtype, f->k + (size_t)first * f->hd, (size_t)n * f->hd, k);
    kr_dtype_from_f32(dtype, f->v + (size_t)first * f->hd, (size_t)n * f->hd, v);
    return 0;
}

/* b (fresh) receives every list of a, read run by run through kr_seq_list_visit, in an append and
 * a fill, with its decode rule, then a's next position */
static void copy_seq(const kr_seq *a, kr_seq *b, const kr_config *cfg, int block_size)
{
    char err[KR_ERR_MAX];
    const size_t hd = (size_t)cfg->head_dim;
    for (int l = cfg->n_layers - 1; l >= 0; l--) /* any order */
        for (int g = 0; g < cfg->n_kv_heads; g++) {
            int len, pinned;
            kr_seq_list_shape(a, l, g, &len, &pinned);
            int32_t *pos = malloc(sizeof(int32_t) * (size_t)(len + 1));
            float *k = malloc(sizeof(float) * hd * (size_t)(len + 1)), *v = malloc(sizeof(float) * hd * (size_t)(len + 1));
            visit_rows vr = {.pos = pos, .k = k, .v = v, .hd = hd, .block_size = block_size};
            REQUIRE(kr_seq_list_visit(a, l, g, 0, len, take_run, &vr, err) == KR_OK, "%s", err);
            CHECK(vr.next == len && vr.runs >= (len + block_size - 1) / block_size, "visit: %d of %d entries in %d runs",
                  vr.next, len, vr.runs);
            int half = len / 2;
            REQUIRE(kr_seq_list_append(b, l, g, half, pos, k, v, 0, err) == KR_OK, "%s", err);
            fill_rows fr = {.pos = pos + half, .k = k + hd * half, .v = v + hd * half, .hd = hd, .fail_at = -1};
            REQUIRE(kr_seq_list_fill(b, l, g, len - half, pinned, give_run, &fr, err) == KR_OK, "%s", err);
            kr_list_rule rule;
            kr_seq_list_rule(a, l, g, &rule);
            REQUIRE(kr_seq_list_set_rule(b, l, g, &rule, err) == KR_OK, "%s", err);
            free(pos);
            free(k);
            free(v);
        }
    REQUIRE(kr_seq_set_next_pos(b, kr_seq_next_pos(a), err) == KR_OK, "%s", err);
}

/* Every policy: A prefilled and decoded alone, B imported and decoded in one batch with the
 * other policies' Bs. */
static void check_exact(const kr_model *m, const char *model, kr_dtype kv)
{
    char err[KR_ERR_MAX], label[128];
    snprintf(label, sizeof label, "%s (KV %s)", model, kr_dtype_name(kv));
    const kr_config *cfg = kr_model_config(m);
    const int V = cfg->vocab_size;
    kr_ctx *c;
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = 32};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    kr_kv_pool *p1, *p2;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, 16, 4096, kv, &p1, err) == KR_OK, "%s", err);
    REQUIRE(kr_kv_pool_create(cfg->head_dim, 5, 8192, kv, &p2, err) == KR_OK, "%s", err);
    kr_policy *pol[N_SPECS];
    kr_seq *a[N_SPECS], *b[N_SPECS];
    kr_footprint fa0[N_SPECS];
    int32_t next[N_SPECS], ids[N_PROMPT];
    float *la = malloc(sizeof(float) * V), *lb = malloc(sizeof(float) * (size_t)V * N_SPECS);
    int rescaled = 0;
    for (int k = 0; k < N_SPECS; k++) {
        pol[k] = parse(SPECS[k], cfg);
        REQUIRE(kr_seq_create(p1, cfg->n_layers, cfg->n_kv_heads, &a[k], err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_set_policy(a[k], pol[k], err) == KR_OK, "%s", err);
        prompt_ids(ids, N_PROMPT - k, k, V);
        REQUIRE(kr_prefill(c, a[k], ids, N_PROMPT - k, CHUNK, KR_LOGITS_LAST, la, err) == KR_OK, "%s", err);
        next[k] = argmax(la, V); /* the first token, sampled where the prefill ran */
        kr_seq_footprint(a[k], &fa0[k]);

        /* B has no policy, as on a decode node: decode applies the rules its lists brought */
        REQUIRE(kr_seq_create(p2, cfg->n_layers, cfg->n_kv_heads, &b[k], err) == KR_OK, "%s", err);
        copy_seq(a[k], b[k], cfg, 16); /* a in p1: blocks of 16 */
        CHECK(digest(a[k], cfg) == digest(b[k], cfg), "%s %s: imported lists differ", label, SPECS[k]);
        CHECK(kr_seq_next_pos(b[k]) == kr_seq_next_pos(a[k]), "%s %s: next_pos", label, SPECS[k]);
        for (int l = 0; l < cfg->n_layers; l++)
            for (int g = 0; g < cfg->n_kv_heads; g++) {
                int wa = kr_seq_list_window(a[k], l, g), wb = kr_seq_list_window(b[k], l, g);
                CHECK(wa == wb, "%s %s: list (%d, %d) window %d at the sender, %d at the receiver", label, SPECS[k], l,
                      g, wa, wb);
                rescaled |= !strncmp(SPECS[k], "hsft", 4) && wa != kr_policy_list_window(pol[k], l, g);
            }
    }
    CHECK(rescaled, "%s: hsft's windows were not rescaled for the prompt: the import check proves nothing", label);

    int mismatches = 0, trimmed = 0;
    for (int step = 0; step < N_DECODE; step++) {
        REQUIRE(kr_forward_batch(c, b, next, N_SPECS, lb, err) == KR_OK, "%s step %d: %s", label, step, err);
        for (int k = 0; k < N_SPECS; k++) {
            int64_t before = kr_seq_entries(a[k]);
            REQUIRE(kr_forward(c, a[k], &next[k], 1, KR_LOGITS_LAST, la, err) == KR_OK, "%s", err);
            trimmed += kr_seq_entries(a[k]) <= before;
            if (memcmp(la, lb + (size_t)k * V, sizeof(float) * V) && mismatches++ < 5)
                CHECK(0, "%s %s: decode step %d differs between the sender and the receiver", label, SPECS[k], step);
            next[k] = argmax(la, V);
        }
    }
    CHECK(mismatches == 0, "%s: %d of %d rows differ", label, mismatches, N_DECODE * N_SPECS);
    CHECK(trimmed > N_DECODE, "%s: decode trimmed in only %d steps", label, trimmed);
    for (int k = 0; k < N_SPECS; k++) {
        CHECK(digest(a[k], cfg) == digest(b[k], cfg), "%s %s: lists differ after decode", label, SPECS[k]);
        kr_footprint fa, fb;
        kr_seq_footprint(a[k], &fa);
        kr_seq_footprint(b[k], &fb);
        CHECK(fb.steps == N_DECODE && fb.attended == fa.attended - fa0[k].attended && fb.full == fa.full - fa0[k].full,
              "%s %s: receiver's footprint %g/%g over %lld steps, sender's decode part %g/%g", label, SPECS[k],
              fb.attended, fb.full, (long long)fb.steps, fa.attended - fa0[k].attended, fa.full - fa0[k].full);
        kr_seq_free(a[k]);
        kr_seq_free(b[k]);
        kr_policy_free(pol[k]);
    }
    printf("%s: %d policies, %d decode steps after the move, %d rows compared, %d differ\n", label, N_SPECS,
           N_DECODE, N_DECODE * N_SPECS, mismatches);
    CHECK(kr_kv_pool_n_free(p1) == kr_kv_pool_n_blocks(p1) && kr_kv_pool_n_free(p2) == kr_kv_pool_n_blocks(p2),
          "blocks leaked");
    free(la);
    free(lb);
    kr_kv_pool_free(p1);
    kr_kv_pool_free(p2);
    kr_ctx_free(c);
}

/* Imports a prefill of N_PROMPT under `pol` into a pool of `n_blocks` blocks of `bs` and decodes
 * N_LONG tokens; returns the steps that ran (N_LONG when none ran out), the most blocks seen. */
static int decode_in_pool(kr_ctx *c, const kr_config *cfg, const kr_policy *pol, const kr_seq *a, int32_t first,
                          int bs, int64_t n_blocks, int *most)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *pool;
    kr_seq *b;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, bs, (int)n_blocks, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &b, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(b, pol, err) == KR_OK, "%s", err);
    copy_seq(a, b, cfg, 16); /* a in check_bound's pool: blocks of 16 */
    float *lg = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    int32_t tok = first;
    int steps = 0;
    *most = kr_seq_blocks(b);
    for (; steps < N_LONG; steps++) {
        if (kr_forward(c, b, &tok, 1, KR_LOGITS_LAST, lg, err) != KR_OK) break;
        tok = argmax(lg, cfg->vocab_size);
        if (kr_seq_blocks(b) > *most) *most = kr_seq_blocks(b);
    }
    free(lg);
    kr_seq_free(b);
    CHECK(kr_kv_pool_n_free(pool) == kr_kv_pool_n_blocks(pool), "blocks leaked");
    kr_kv_pool_free(pool);
    return steps;
}

/* The sum of kr_list_rule_blocks_bound over the L x H lists of s as they are, in blocks of `bs`. */
static int64_t rules_bound(const kr_seq *s, int L, int H, int bs, int n_generate)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *probe;
    REQUIRE(kr_kv_pool_create(4, bs, 1, KR_DTYPE_F32, &probe, err) == KR_OK, "%s", err);
    int64_t total = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < H; g++) {
            kr_list_rule rule;
            int len, pinned;
            kr_seq_list_rule(s, l, g, &rule);
            kr_seq_list_shape(s, l, g, &len, &pinned);
            int64_t b = kr_list_rule_blocks_bound(probe, &rule, len, pinned, n_generate);
            CHECK(b >= 0, "list (%d, %d): no bound", l, g);
            total += b;
        }
    kr_kv_pool_free(probe);
    return total;
}

static void check_bound(const kr_model *m, const char *label)
{
    char err[KR_ERR_MAX];
    const kr_config *cfg = kr_model_config(m);
    const int V = cfg->vocab_size, L = cfg->n_layers, H = cfg->n_kv_heads;
    kr_ctx *c;
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = 32};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    kr_kv_pool *big;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, 16, 4096, KR_DTYPE_F32, &big, err) == KR_OK, "%s", err);
    const int sizes[] = {1, 3, 8, 16};
    int32_t ids[N_PROMPT];
    float *lg = malloc(sizeof(float) * V);
    double loosest = 1.0;
    for (int k = -1; k < N_SPECS; k++) { /* -1: no policy */
        kr_policy *pol = k < 0 ? NULL : parse(SPECS[k], cfg);
        const char *name = k < 0 ? "(no policy)" : SPECS[k];
        kr_seq *a;
        REQUIRE(kr_seq_create(big, L, H, &a, err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_set_policy(a, pol, err) == KR_OK, "%s", err);
        prompt_ids(ids, N_PROMPT, k + 3, V);
        REQUIRE(kr_prefill(c, a, ids, N_PROMPT, CHUNK, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
        int32_t first = argmax(lg, V);
        int arrive = pol ? kr_policy_max_entries(pol, N_PROMPT, 0) : N_PROMPT;
        for (int l = 0; l < L; l++)
            for (int g = 0; g < H; g++)
                CHECK(kr_seq_len(a, l, g) <= arrive, "%s %s: list (%d, %d) arrives with %d entries, max_entries says %d",
                      label, name, l, g, kr_seq_len(a, l, g), arrive);
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++) {
            kr_kv_pool *probe;
            REQUIRE(kr_kv_pool_create(cfg->head_dim, sizes[z], 1, KR_DTYPE_F32, &probe, err) == KR_OK, "%s", err);
            int64_t bound = kr_seq_blocks_bound(probe, pol, L, H, N_PROMPT, N_LONG);
            kr_kv_pool_free(probe);
            REQUIRE(bound > 0, "%s %s: bound %lld", label, name, (long long)bound);
            int most;
            int ran = decode_in_pool(c, cfg, pol, a, first, sizes[z], bound, &most);
            CHECK(ran == N_LONG, "%s %s, blocks of %d: a pool of the bound's %lld blocks ran out after %d of %d steps",
                  label, name, sizes[z], (long long)bound, ran, N_LONG);
            CHECK(most <= bound, "%s %s: %d blocks held, bound %lld", label, name, most, (long long)bound);
            /* what a decode node checks the bundle's rules against: the real lists pass */
            int64_t by_rules = rules_bound(a, L, H, sizes[z], N_LONG);
            CHECK(by_rules >= most && by_rules <= bound, "%s %s, blocks of %d: the lists' rules bound %lld blocks, "
                  "held %d, reserved %lld", label, name, sizes[z], (long long)by_rules, most, (long long)bound);
            if ((double)bound / most > loosest) loosest = (double)bound / most;
            if (!pol || !strcmp(SPECS[k], "full")) { /* full attention: the bound is exact */
                CHECK(most == bound, "%s %s, blocks of %d: held %d, bound %lld", label, name, sizes[z], most,
                      (long long)bound);
                ran = decode_in_pool(c, cfg, pol, a, first, sizes[z], bound - 1, &most);
                CHECK(ran < N_LONG, "%s %s, blocks of %d: one block less than the bound still ran", label, name,
                      sizes[z]);
            }
        }
        kr_seq_free(a);
        kr_policy_free(pol);
    }
    printf("%s: every policy decodes %d tokens in a pool of kr_seq_blocks_bound blocks (bound / most held <= %.2f)\n",
           label, N_LONG, loosest);
    free(lg);
    kr_kv_pool_free(big);
    kr_ctx_free(c);
}

/* kr_policy_list_window and kr_seq_list_window per family (llama3-tiny: 4 layers, 2 KV heads,
 * 8 query heads) */
static void check_windows(const kr_model *m)
{
    char err[KR_ERR_MAX];
    const kr_config *cfg = kr_model_config(m);
    const int L = cfg->n_layers, H = cfg->n_kv_heads;
    struct {
        const char *spec;
        int window; /* every list; -2: checked below */
    } simple[] = {
        {"full", -1},
        {"full:decode=window:10", 10},
        {"streaming:sink=2,window=12,lazy=3", 12},
        {"streaming:sink=2,window=12,lazy=0", -1},
        {"streaming:sink=2,window=12,decode=grow", -1},
        {"sage:budget=32", 9}, /* S = 8, k = 4, R = 32 - 8 - 4*4 = 8: R + 1 */
        {"sage:budget=32,decode=window:5", 5},
        {"sage:budget=32,decode=grow", -1},
        {"snapkv:mode=patched,obs=4,budget=24,decode=window:8", 8},
        {"pyramidkv:mode=naive,obs=4,budget=24", -1},
        {"take:budget=16,warmup_budget=32,probe=4", -1},
        {"hsft:windows={w},pattern={g},budget=0.5,sink=2,decode=grow", -1},
        {"hsft:windows={w},pattern={g},budget=0.5,sink=2,decode=window:7", 7},
    };
    for (size_t i = 0; i < sizeof simple / sizeof simple[0]; i++) {
        kr_policy *p = parse(simple[i].spec, cfg);
        for (int l = 0; l < L; l++)
            for (int g = 0; g < H; g++)
                CHECK(kr_policy_list_window(p, l, g) == simple[i].window, "%s: list (%d, %d) window %d, expected %d",
                      simple[i].spec, l, g, kr_policy_list_window(p, l, g), simple[i].window);
        kr_policy_free(p);
    }
    CHECK(kr_policy_list_window(NULL, 0, 0) == -1, "no policy: dense");

    /* heads: the half of the lists with the highest gates dense (DuoAttention's sparsity rule) */
    float all[64];
    uint8_t is_dense[64];
    for (int l = 0; l < L; l++)
        for (int g = 0; g < H; g++) all[l * H + g] = kr_test_gate(l, g);
    kr_heads_choose_dense(all, L * H, 0.5f, is_dense);
    kr_policy *p = parse("heads:pattern={g},sparsity=0.5,sink=2,window=8", cfg);
    int dense = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < H; g++) {
            int want = is_dense[l * H + g] ? -1 : 8;
            dense += want < 0;
            CHECK(kr_policy_list_window(p, l, g) == want, "heads: list (%d, %d) window %d, expected %d", l, g,
                  kr_policy_list_window(p, l, g), want);
        }
    CHECK(dense > 0 && dense < L * H, "heads: %d dense lists: the pattern does not split", dense);
    kr_policy_free(p);

    /* hsft's own rule: learned windows without a sequence, rescaled for the prompt with one;
     * sage's own rule: B + 1 minus the list's pinned count */
    kr_ctx *c;
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = 32};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    REQUIRE(kr_kv_pool_create(cfg->head_dim, 16, 1024, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    float *lg = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    int32_t ids[N_PROMPT];
    prompt_ids(ids, N_PROMPT, 1, cfg->vocab_size);
    p = parse("hsft:windows={w},pattern={g},budget=0.5,sink=2", cfg);
    int learned[16], rescaled[16];
    for (int l = 0; l < L; l++) learned[l] = kr_test_window(l);
    kr_hsft_rescale(learned, L, 0, H, 2, 0.5, N_PROMPT, rescaled); /* dense 0.45 of 2 heads: none */
    kr_seq *s;
    REQUIRE(kr_seq_create(pool, L, H, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(s, p, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(c, s, ids, N_PROMPT, CHUNK, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    for (int l = 0; l < L; l++) {
        CHECK(kr_policy_list_window(p, l, 1) == learned[l], "hsft layer %d: policy window %d, learned %d", l,
              kr_policy_list_window(p, l, 1), learned[l]);
        CHECK(kr_seq_list_window(s, l, 1) == rescaled[l], "hsft layer %d: sequence window %d, rescaled %d", l,
              kr_seq_list_window(s, l, 1), rescaled[l]);
    }
    kr_seq_free(s);
    kr_policy_free(p);
    p = parse("sage:budget=32", cfg);
    REQUIRE(kr_seq_create(pool, L, H, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_set_policy(s, p, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(c, s, ids, N_PROMPT, CHUNK, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    for (int l = 0; l < L; l++)
        for (int g = 0; g < H; g++) {
            int len, pinned;
            kr_seq_list_shape(s, l, g, &len, &pinned);
            CHECK(pinned > 8 && kr_seq_list_window(s, l, g) == 33 - pinned, "sage list (%d, %d): %d pinned, window %d",
                  l, g, pinned, kr_seq_list_window(s, l, g));
        }
    kr_seq_free(s);
    kr_policy_free(p);
    free(lg);
    kr_kv_pool_free(pool);
    kr_ctx_free(c);
}

static void check_errors(const kr_model *m)
{
    char err[KR_ERR_MAX] = "";
    const kr_config *cfg = kr_model_config(m);
    const int L = cfg->n_layers, H = cfg->n_kv_heads, hd = cfg->head_dim;
    kr_ctx *c;
    kr_ctx_params cp = {.n_threads = 2, .max_chunk = 32};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    REQUIRE(kr_kv_pool_create(hd, 4, 2, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err); /* 8 entries in all */
    float kv[2][9 * 64] = {{0}};
    int32_t pos[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    kr_seq *s;
    REQUIRE(kr_seq_create(pool, L, H, &s, err) == KR_OK, "%s", err);

    CHECK(kr_seq_list_append(s, 0, 0, 9, pos, kv[0], kv[1], 0, err) == -1, "9 entries in 8 slots");
    CHECK_ERR_HAS(err, "KV pool exhausted");
    int len, pinned;
    kr_seq_list_shape(s, 0, 0, &len, &pinned);
    CHECK(len == 0 && kr_kv_pool_n_free(pool) == 2, "a failed append changed the list (%d entries, %d free)", len,
          kr_kv_pool_n_free(pool));
    int32_t twice[2] = {3, 3}, down[2] = {5, 4}, neg[1] = {-1};
    CHECK(kr_seq_list_append(s, 0, 0, 2, twice, kv[0], kv[1], 0, err) == -1, "equal positions");
    CHECK_ERR_HAS(err, "position 3 at entry 1");
    CHECK(kr_seq_list_append(s, 0, 0, 2, down, kv[0], kv[1], 0, err) == -1, "decreasing positions");
    CHECK(kr_seq_list_append(s, 0, 0, 1, neg, kv[0], kv[1], 0, err) == -1, "negative position");
    CHECK_ERR_HAS(err, ">= 0 and strictly increasing");
    CHECK(kr_seq_list_append(s, 0, 0, 2, pos, kv[0], kv[1], 3, err) == -1, "pinned 3 of 2");
    CHECK_ERR_HAS(err, "pinned = 3");
    CHECK(kr_seq_list_append(s, L, 0, 1, pos, kv[0], kv[1], 0, err) == -1, "layer out of range");
    CHECK_ERR_HAS(err, "does not exist");
    CHECK(kr_seq_list_append(s, 0, 0, 1, NULL, kv[0], kv[1], 0, err) == -1, "NULL positions");
    CHECK(kr_seq_list_append(s, 0, 0, -1, pos, kv[0], kv[1], 0, err) == -1, "n = -1");

    CHECK(kr_seq_list_append(s, 0, 0, 5, pos + 2, kv[0], kv[1], 2, err) == KR_OK, "%s", err); /* positions 2..6 */
    CHECK(kr_seq_list_append(s, 0, 0, 1, pos + 6, kv[0], kv[1], 2, err) == -1, "position 6 again");
    CHECK_ERR_HAS(err, "not above the one before it (6)");
    kr_seq_list_shape(s, 0, 0, &len, &pinned);
    CHECK(len == 5 && pinned == 2, "list holds %d, %d pinned", len, pinned);
    int32_t back[5];
    CHECK(kr_seq_list_read(s, 0, 0, 1, 4, back, NULL, NULL, err) == KR_OK && back[0] == 3 && back[3] == 6,
          "read back %d..%d", back[0], back[3]);
    CHECK(kr_seq_list_read(s, 0, 0, 2, 4, back, NULL, NULL, err) == -1, "read past the end");
    CHECK_ERR_HAS(err, "outside its 5 entries");
    CHECK(kr_seq_list_read(s, 0, 0, -1, 1, back, NULL, NULL, err) == -1, "read before the start");
    CHECK(kr_seq_list_read(s, 0, H, 0, 1, back, NULL, NULL, err) == -1, "head out of range");
    kr_seq_list_shape(s, -1, 0, &len, &pinned);
    CHECK(len == 0 && pinned == 0, "a list that does not exist has no shape");

    /* a fill whose rows fail or come out of order leaves the list and the pool as they were */
    fill_rows fr = {.pos = pos + 7, .k = kv[0], .v = kv[1], .hd = (size_t)hd, .fail_at = 1};
    CHECK(kr_seq_list_fill(s, 0, 0, 2, 2, give_run, &fr, err) == -1, "fill that fails");
    CHECK_ERR_HAS(err, "fill refused entry 1");
    kr_seq_list_shape(s, 0, 0, &len, &pinned);
    CHECK(len == 5 && pinned == 2 && kr_kv_pool_n_free(pool) == 0, "a failed fill changed the list (%d entries, %d "
          "pinned, %d blocks free)", len, pinned, kr_kv_pool_n_free(pool));
    fr.pos = down;
    fr.fail_at = -1;
    CHECK(kr_seq_list_fill(s, 0, 0, 2, 2, give_run, &fr, err) == -1, "fill below the list's last position");
    CHECK_ERR_HAS(err, "position 5 at entry 0");
    kr_seq_list_shape(s, 0, 0, &len, &pinned);
    CHECK(len == 5 && pinned == 2 && kr_kv_pool_n_free(pool) == 0, "a refused fill changed the list");

    kr_list_rule rule = {.sink = 4, .window = 8, .lazy = 2, .slack = 1, .max_drop = 3, .rel = 1}, got;
    CHECK(kr_seq_list_set_rule(s, 0, 0, &rule, err) == KR_OK, "%s", err);
    kr_seq_list_rule(s, 0, 0, &got);
    CHECK(!memcmp(&got, &rule, sizeof rule) && kr_seq_list_window(s, 0, 0) == 8, "rule read back");
    kr_seq_list_rule(s, 0, 1, &got);
    CHECK(got.window == -1 && got.sink == 0 && !got.rel, "a list without a rule is never trimmed");
    rule.window = -2;
    CHECK(kr_seq_list_set_rule(s, 0, 0, &rule, err) == -1, "window -2");
    CHECK_ERR_HAS(err, "window is out of range");
    rule.window = 8;
    rule.rel = 2;
    CHECK(kr_seq_list_set_rule(s, 0, 0, &rule, err) == -1, "rel 2");
    CHECK_ERR_HAS(err, "rel is out of range");
    rule.rel = 0;
    rule.slack = -1;
    CHECK(kr_seq_list_set_rule(s, 0, 0, &rule, err) == -1, "slack -1");
    CHECK_ERR_HAS(err, "slack is out of range");
    CHECK(kr_seq_list_set_rule(s, L, 0, &rule, err) == -1, "layer out of range");
    CHECK_ERR_HAS(err, "does not exist");

    CHECK(kr_seq_set_next_pos(s, 6, err) == -1, "next_pos at a held position");
    CHECK_ERR_HAS(err, "not above position 6");
    CHECK(kr_seq_set_next_pos(s, -3, err) == -1, "negative next_pos");
    CHECK(kr_seq_set_next_pos(s, 7, err) == KR_OK, "%s", err);
    CHECK(kr_seq_next_pos(s) == 7, "next_pos %d", kr_seq_next_pos(s));
    CHECK(kr_seq_list_append(s, 0, 1, 1, pos, kv[0], kv[1], 0, err) == -1, "append after set_next_pos");
    CHECK_ERR_HAS(err, "closed by kr_seq_set_next_pos");
    rule.slack = 0;
    CHECK(kr_seq_list_set_rule(s, 0, 1, &rule, err) == -1, "rule after set_next_pos");
    CHECK_ERR_HAS(err, "closed by kr_seq_set_next_pos");
    CHECK(kr_seq_set_policy(s, NULL, err) == -1, "set_policy after set_next_pos");
    CHECK_ERR_HAS(err, "before kr_seq_set_next_pos");
    kr_seq_free(s);

    /* a sequence fed tokens takes neither */
    kr_kv_pool *big;
    REQUIRE(kr_kv_pool_create(hd, 16, 256, KR_DTYPE_F32, &big, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(big, L, H, &s, err) == KR_OK, "%s", err);
    float *lg = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    REQUIRE(kr_prefill(c, s, pos, 4, 0, KR_LOGITS_LAST, lg, err) == KR_OK, "%s", err);
    int32_t later[1] = {100};
    CHECK(kr_seq_list_append(s, 0, 0, 1, later, kv[0], kv[1], 0, err) == -1, "append after tokens");
    CHECK_ERR_HAS(err, "fed tokens");
    CHECK(kr_seq_set_next_pos(s, 100, err) == -1, "set_next_pos after tokens");
    CHECK_ERR_HAS(err, "already fed 4 tokens");
    kr_seq_free(s);
    free(lg);

    CHECK(kr_seq_blocks_bound(big, NULL, L, H, -1, 5) == -1, "negative prompt");
    CHECK(kr_seq_blocks_bound(big, NULL, L, H, 5, -1) == -1, "negative generate");
    kr_policy *p = parse("full", cfg);
    CHECK(kr_seq_blocks_bound(big, p, L + 1, H, 5, 5) == -1, "policy for another shape");
    CHECK(kr_seq_blocks_bound(big, p, L, H, 16, 16) == (int64_t)L * H * 2, "full, 32 entries in blocks of 16: %lld",
          (long long)kr_seq_blocks_bound(big, p, L, H, 16, 16));
    kr_policy_free(p);
    CHECK(kr_kv_pool_n_free(pool) == 2 && kr_kv_pool_n_free(big) == 256, "blocks leaked");
    kr_kv_pool_free(big);
    kr_kv_pool_free(pool);
    kr_ctx_free(c);
}

/* One list under `rule` step by step as forward.c's decode_trim runs it (kr_streaming_target,
 * the pinned set growing to the sink, keep_ends moving the offset when it drops the front):
 * the most blocks it holds in blocks of bs. */
static int64_t rule_brute(const kr_list_rule *r, int count, int pinned, int n_generate, int bs)
{
    int len = count, off = 0;
    int64_t most = (count + bs - 1) / bs;
    for (int t = 0; t < n_generate; t++) {
        len++;
        int64_t held = (off + len + bs - 1) / bs;
        if (held > most) most = held;
        int head = pinned;
        if (r->sink > head) head = r->sink < len ? r->sink : len;
        int target = r->window < 0 ? -1 : kr_streaming_target(len, head, r->window, r->lazy, r->slack, r->max_drop);
        if (target >= 0 && target < len && target - head > head)
            off = (off + len - target) % bs; /* kr_seq_keep_ends drops the front */
        if (target >= 0) len = target;
        pinned = head;
    }
    return most;
}

/* kr_list_rule_blocks_bound against rule_brute for random rules, counts and block sizes: never
 * below it, and exact in entries (blocks of 1). */
static void check_rule_bound(void)
{
    char err[KR_ERR_MAX];
    uint64_t x = 0x2545f4914f6cdd1dull;
    int n = 0, tight = 0;
    for (int i = 0; i < 20000; i++) {
        uint64_t v[10];
        for (int j = 0; j < 10; j++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v[j] = x;
        }
        kr_list_rule r = {.sink = (int)(v[0] % 12), .window = (int)(v[1] % 40) - 1, .lazy = (int)(v[2] % 8),
                          .slack = (int)(v[3] % 10), .max_drop = (int)(v[4] % 6), .rel = (int)(v[5] & 1)};
        if (v[5] % 7 == 0) r.sink = 1 << 30; /* a sink beyond any length: never trims */
        int count = (int)(v[6] % 120), pinned = count ? (int)(v[7] % (uint64_t)(count + 1)) : 0;
        int gen = (int)(v[8] % 150), bs = 1 + (int)(v[9] % 17);
        kr_kv_pool *pool;
        REQUIRE(kr_kv_pool_create(4, bs, 1, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
        int64_t got = kr_list_rule_blocks_bound(pool, &r, count, pinned, gen);
        int64_t want = rule_brute(&r, count, pinned, gen, bs);
        kr_kv_pool_free(pool);
        CHECK(got >= want, "sink %d window %d lazy %d slack %d max_drop %d, %d entries (%d pinned), %d steps, blocks "
              "of %d: bound %lld, the list held %lld", r.sink, r.window, r.lazy, r.slack, r.max_drop, count, pinned,
              gen, bs, (long long)got, (long long)want);
        tight += got == want;
        REQUIRE(kr_kv_pool_create(4, 1, 1, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
        got = kr_list_rule_blocks_bound(pool, &r, count, pinned, gen);
        want = rule_brute(&r, count, pinned, gen, 1);
        kr_kv_pool_free(pool);
        CHECK(got == want, "sink %d window %d lazy %d slack %d max_drop %d, %d entries (%d pinned), %d steps: peak "
              "%lld entries, the bound says %lld", r.sink, r.window, r.lazy, r.slack, r.max_drop, count, pinned, gen,
              (long long)want, (long long)got);
        n++;
    }
    kr_kv_pool *pool;
    REQUIRE(kr_kv_pool_create(4, 16, 1, KR_DTYPE_F32, &pool, err) == KR_OK, "%s", err);
    kr_list_rule r = {.sink = 0, .window = 4, .lazy = 1};
    CHECK(kr_list_rule_blocks_bound(pool, &r, 5, 6, 1) == -1, "pinned beyond count");
    CHECK(kr_list_rule_blocks_bound(pool, &r, 5, 0, -1) == -1, "negative generate");
    r.window = -2;
    CHECK(kr_list_rule_blocks_bound(pool, &r, 5, 0, 1) == -1, "window -2");
    kr_kv_pool_free(pool);
    printf("kr_list_rule_blocks_bound: %d random rules, never below step-by-step decode, exact in entries; %d of them "
           "exact in blocks too\n", n, tight);
}

int main(void)
{
    check_rule_bound();
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    snprintf(tmp, sizeof tmp, "/tmp/kr_test_seq_io.XXXXXX");
    REQUIRE(mkdtemp(tmp), "mkdtemp");
    snprintf(gates, sizeof gates, "%s/gates.tsv", tmp);
    snprintf(windows, sizeof windows, "%s/windows.txt", tmp);
    const char *models[] = {"llama3-tiny", "qwen2-tiny", "mistral-tiny"};
    char dir[4096], err[KR_ERR_MAX];
    for (int i = 0; i < 3; i++) {
        kr_model *m;
        snprintf(dir, sizeof dir, "%s/models/%s", fx, models[i]);
        REQUIRE(kr_model_load(dir, NULL, &m, err) == KR_OK, "%s: %s", dir, err);
        kr_test_policy_files(kr_model_config(m), gates, windows);
        check_exact(m, models[i], KR_DTYPE_F32);
        check_exact(m, models[i], KR_DTYPE_BF16); /* bf16 rows cross as f32 exactly and round back to themselves */
        if (i == 1) check_exact(m, models[i], KR_DTYPE_F16);
        check_bound(m, models[i]);
        if (i == 0) {
            check_windows(m);
            check_errors(m);
        }
        kr_model_free(m);
    }
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    CHECK(system(cmd) == 0, "cannot remove %s", tmp);
    return kt_done("test_seq_io");
}
