/*
 * test_prefill_layers.c - kr_prefill_layers' promise to a layer-wise pipelined KV transfer: on
 * llama3-tiny (4 layers, 2 KV heads), a 300-token prompt prefilled in chunks of 64 and in one
 * chunk, with no policy and under every policy family with a spec that evicts here (TAKE with
 * warmup_layers 0, 2, 3 and 4, so that its delayed eviction matters):
 * - the callback's n_final strictly increases, starts where the policy allows (TAKE: above its
 *   first scoring layer max(W - 1, 0), whose hook prunes the warm-up layers), ends at n_layers,
 *   and comes before the logits are written (the logits buffer still holds its sentinel);
 * - every list of each newly final layer, snapshotted in the callback through kr_seq_list_visit
 *   (length, pinned count, decode rule, positions, K and V rows), is byte-identical after the
 *   call, and identical to the lists of the same prompt prefilled by kr_prefill;
 * - the logits equal kr_prefill's bit for bit;
 * - a callback that fails stops the prefill: kr_prefill_layers returns -1 with its message (or
 *   a default one when it wrote none, or none at all with err NULL), the sequence still frees.
 * Runs on the CPU backend only.
 */
#include "kr_test.h"
#include "policy_files.h"

#include "kr.h"

#include <stdint.h>
#include <unistd.h>

enum { N_PROMPT = 300, CHUNK = 64, MAX_CHUNK = 320 };

static char tmp[256], gates[512], windows[512];

typedef struct spec_case {
    const char *spec; /* NULL: a sequence without a policy; {g} and {w}: the files below */
    int first_final; /* the first n_final the callback gets */
    int evicts; /* the prefill leaves fewer entries than the whole prompt's */
} spec_case;

static const spec_case CASES[] = {
    {NULL, 1, 0},
    {"full", 1, 0},
    {"streaming:sink=4,window=32,lazy=3", 1, 1},
    {"streaming:sink=3,window=40,pos=rel", 1, 1},
    {"snapkv:mode=patched,obs=8,budget=48,decode=window:8", 1, 1},
    {"snapkv:mode=naive,obs=8,ratio=0.5", 1, 1},
    {"pyramidkv:mode=naive,obs=4,budget=48", 1, 1},
    {"take:budget=32,warmup_budget=96,warmup_layers=0,probe=8", 1, 1},
    {"take:budget=32,warmup_budget=96,warmup_layers=2,probe=8", 2, 1},
    {"take:budget=32,warmup_budget=96,warmup_layers=3,probe=8,decode=window:6", 3, 1},
    {"take:budget=32,warmup_budget=96,warmup_layers=4,probe=8", 4, 1},
    {"sage:budget=64", 1, 1},
    {"heads:pattern={g},sparsity=0.5,sink=2,window=16", 1, 1},
    {"hsft:windows={w},pattern={g},budget=0.5,sink=2", 1, 1},
};
enum { N_CASES = sizeof CASES / sizeof CASES[0] };

/* a spec whose {g} and {w} name this test's policy files */
static kr_policy *parse(const char *tmpl, const kr_config *cfg)
{
    return kr_test_policy(tmpl, cfg, gates, windows);
}

/* ------------------------------------------------------------------ list snapshots */

/* A list as bytes: len, pinned, rule, then positions, K rows and V rows. */
typedef struct blob {
    unsigned char *data;
    size_t bytes;
} blob;

typedef struct blob_fill {
    int32_t *pos;
    float *k, *v;
    size_t hd;
    int next;
} blob_fill;

static int fill_run(void *arg, int first, int n, const int32_t *pos, kr_dtype dtype, const void *k, const void *v,
                    char *err)
{
    blob_fill *f = arg;
    CHECK(first == f->next && n >= 1, "visit: run [%d, %d) after %d", first, first + n, f->next);
    memcpy(f->pos + first, pos, sizeof(int32_t) * (size_t)n);
    kr_dtype_to_f32(dtype, k, (size_t)n * f->hd, f->k + (size_t)first * f->hd);
    kr_dtype_to_f32(dtype, v, (size_t)n * f->hd, f->v + (size_t)first * f->hd);
    f->next = first + n;
    (void)err;
    return 0;
}

static blob list_blob(const kr_seq *s, int layer, int g, int head_dim)
{
    char err[KR_ERR_MAX];
    int len, pinned;
    kr_list_rule rule;
    kr_seq_list_shape(s, layer, g, &len, &pinned);
    memset(&rule, 0, sizeof rule);
    kr_seq_list_rule(s, layer, g, &rule);
    const size_t hd = (size_t)head_dim, head = 2 * sizeof(int) + sizeof rule;
    blob b = {.bytes = head + (size_t)len * (sizeof(int32_t) + 2 * hd * sizeof(float))};
    b.data = calloc(1, b.bytes);
    REQUIRE(b.data, "out of memory");
    memcpy(b.data, &len, sizeof len);
    memcpy(b.data + sizeof len, &pinned, sizeof pinned);
    memcpy(b.data + 2 * sizeof(int), &rule, sizeof rule);
    int32_t *pos = (int32_t *)(b.data + head);
    float *k = (float *)(pos + len), *v = k + (size_t)len * hd;
    blob_fill f = {.pos = pos, .k = k, .v = v, .hd = hd};
    REQUIRE(kr_seq_list_visit(s, layer, g, 0, len, fill_run, &f, err) == KR_OK, "%s", err);
    CHECK(f.next == len, "visit: %d of %d entries", f.next, len);
    return b;
}

static int blob_same(const blob *a, const blob *b)
{
    return a->bytes == b->bytes && !memcmp(a->data, b->data, a->bytes);
}

/* `early`'s entries are the first entries of `now` (positions, K and V rows, bit for bit). */
static int blob_prefix(const blob *early, const blob *now, int head_dim)
{
    int a, b;
    memcpy(&a, early->data, sizeof a);
    memcpy(&b, now->data, sizeof b);
    if (a > b) return 0;
    const size_t hd = (size_t)head_dim, head = 2 * sizeof(int) + sizeof(kr_list_rule);
    const int32_t *pa = (const int32_t *)(early->data + head), *pb = (const int32_t *)(now->data + head);
    const float *ka = (const float *)(pa + a), *kb = (const float *)(pb + b);
    const float *va = ka + (size_t)a * hd, *vb = kb + (size_t)b * hd;
    return !memcmp(pa, pb, sizeof(int32_t) * (size_t)a) && !memcmp(ka, kb, sizeof(float) * (size_t)a * hd) &&
           !memcmp(va, vb, sizeof(float) * (size_t)a * hd);
}

/* ------------------------------------------------------------------ the callback */

typedef struct spy {
    const kr_config *cfg;
    const float *logits; /* kr_prefill_layers' logits buffer */
    const float *sentinel; /* what it held before the call */
    size_t logit_floats;
    int calls, told, first; /* told: the last n_final; first: the first */
    int ordered; /* every n_final above the one before, within 1..n_layers */
    int before_logits; /* the n_layers call saw the logits buffer untouched */
    int fail_at; /* return -1 at this n_final (0: never) */
    const char *fail_msg; /* written into err when failing (NULL: nothing) */
    blob *snap; /* [n_layers * n_kv_heads], filled as layers become final */
    int chunk_calls; /* n_final = 0: a chunk before the last ended (full, or no policy) */
    blob *early; /* [n_layers * n_kv_heads]: every list at the latest such call */
} spy;

static int on_final(void *arg, const kr_seq *s, int n_final, char *err)
{
    spy *sp = arg;
    const kr_config *cfg = sp->cfg;
    if (n_final == 0) { /* a chunk's end: its entries are final, later chunks only append */
        if (sp->told) sp->ordered = 0; /* never inside the last chunk */
        sp->chunk_calls++;
        for (int i = 0; i < cfg->n_layers * cfg->n_kv_heads; i++) {
            free(sp->early[i].data);
            sp->early[i] = list_blob(s, i / cfg->n_kv_heads, i % cfg->n_kv_heads, cfg->head_dim);
        }
        return KR_OK;
    }
    if (!(n_final > sp->told && n_final <= cfg->n_layers)) sp->ordered = 0;
    if (sp->calls++ == 0) sp->first = n_final;
    if (n_final == cfg->n_layers)
        sp->before_logits = !memcmp(sp->logits, sp->sentinel, sp->logit_floats * sizeof(float));
    if (sp->fail_at && n_final >= sp->fail_at) {
        if (sp->fail_msg) snprintf(err, KR_ERR_MAX, "%s (at %d layers)", sp->fail_msg, n_final);
        return -1;
    }
    for (int l = sp->told > 0 ? sp->told : 0; l < n_final && l < cfg->n_layers; l++)
        for (int g = 0; g < cfg->n_kv_heads; g++)
            sp->snap[l * cfg->n_kv_heads + g] = list_blob(s, l, g, cfg->head_dim);
    if (n_final > sp->told) sp->told = n_final;
    return KR_OK;
}

static void prompt_ids(int32_t *ids, int n, int vocab)
{
    for (int t = 0; t < n; t++) ids[t] = (int32_t)(((int64_t)t * t * 7 + t * 29 + 11) % vocab);
}

/* ------------------------------------------------------------------ the checks */

/* One case at one chunk size: the reference by kr_prefill, then kr_prefill_layers with the spy. */
static void check_case(kr_ctx *c, kr_kv_pool *pool, const kr_config *cfg, const spec_case *sc, int chunk)
{
    char err[KR_ERR_MAX];
    const char *label = sc->spec ? sc->spec : "(no policy)";
    const int V = cfg->vocab_size, L = cfg->n_layers, H = cfg->n_kv_heads;
    int32_t ids[N_PROMPT];
    prompt_ids(ids, N_PROMPT, V);
    kr_policy *pol = sc->spec ? parse(sc->spec, cfg) : NULL;
    kr_seq *ref, *s;
    REQUIRE(kr_seq_create(pool, L, H, &ref, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(pool, L, H, &s, err) == KR_OK, "%s", err);
    if (pol) {
        REQUIRE(kr_seq_set_policy(ref, pol, err) == KR_OK, "%s", err);
        REQUIRE(kr_seq_set_policy(s, pol, err) == KR_OK, "%s", err);
    }
    float *want = malloc(sizeof(float) * (size_t)V), *got = malloc(sizeof(float) * (size_t)V);
    float *sentinel = malloc(sizeof(float) * (size_t)V);
    REQUIRE(want && got && sentinel, "out of memory");
    REQUIRE(kr_prefill(c, ref, ids, N_PROMPT, chunk, KR_LOGITS_LAST, want, err) == KR_OK, "%s: %s", label, err);

    for (int i = 0; i < V; i++) sentinel[i] = (float)(i % 7) - 1234.5f; /* never a logit of this model */
    memcpy(got, sentinel, sizeof(float) * (size_t)V);
    blob *snap = calloc((size_t)L * H, sizeof(blob)), *early = calloc((size_t)L * H, sizeof(blob));
    REQUIRE(snap && early, "out of memory");
    spy sp = {.cfg = cfg, .logits = got, .sentinel = sentinel, .logit_floats = (size_t)V, .ordered = 1,
              .snap = snap, .early = early};
    REQUIRE(kr_prefill_layers(c, s, ids, N_PROMPT, chunk, KR_LOGITS_LAST, got, on_final, &sp, err) == KR_OK,
            "%s: %s", label, err);

    CHECK(sp.ordered, "%s chunk %d: n_final not strictly increasing within 1..%d", label, chunk, L);
    /* full and no policy: one chunk-end call per chunk before the last, every other policy none */
    const int keeps = !pol || !strcmp(sc->spec, "full");
    const int eff = chunk > 0 && chunk < MAX_CHUNK ? chunk : MAX_CHUNK; /* kr_prefill's rule */
    const int want_chunk_calls = keeps ? (N_PROMPT - 1) / eff : 0;
    CHECK(sp.chunk_calls == want_chunk_calls, "%s chunk %d: %d chunk-end calls, expected %d", label, chunk,
          sp.chunk_calls, want_chunk_calls);
    CHECK(sp.told == L, "%s chunk %d: the last n_final was %d, not n_layers %d", label, chunk, sp.told, L);
    CHECK(sp.first == sc->first_final, "%s chunk %d: the first n_final was %d, expected %d", label, chunk, sp.first,
          sc->first_final);
    if (pol && !strncmp(sc->spec, "take", 4)) {
        const char *w = strstr(kr_policy_spec(pol), "warmup_layers=");
        int W = w ? atoi(w + strlen("warmup_layers=")) : -1;
        int first_layer = W > 0 ? W - 1 : 0;
        CHECK(w && sp.first > first_layer, "%s chunk %d: the first n_final %d announces a warm-up layer before layer "
              "%d pruned it", label, chunk, sp.first, first_layer);
    }
    CHECK(sp.before_logits, "%s chunk %d: the n_layers call came after the logits were written", label, chunk);
    CHECK(!memcmp(got, want, sizeof(float) * (size_t)V), "%s chunk %d: logits differ from kr_prefill's", label,
          chunk);
    CHECK(kr_seq_next_pos(s) == kr_seq_next_pos(ref), "%s chunk %d: next_pos %d, kr_prefill's %d", label, chunk,
          kr_seq_next_pos(s), kr_seq_next_pos(ref));

    int changed = 0, differ = 0;
    for (int l = 0; l < L; l++)
        for (int g = 0; g < H; g++) {
            blob now = list_blob(s, l, g, cfg->head_dim), r = list_blob(ref, l, g, cfg->head_dim);
            blob *then = &snap[l * H + g];
            if (early[l * H + g].data && !blob_prefix(&early[l * H + g], &now, cfg->head_dim))
                CHECK(0, "%s chunk %d: list (%d, %d)'s entries at the last chunk-end call are not the "
                      "first entries of the final list", label, chunk, l, g);
            free(early[l * H + g].data);
            if (!then->data || !blob_same(then, &now)) {
                changed++;
                CHECK(0, "%s chunk %d: list (%d, %d) changed after it was announced final", label, chunk, l, g);
            }
            if (!blob_same(&now, &r)) {
                differ++;
                CHECK(0, "%s chunk %d: list (%d, %d) differs from kr_prefill's", label, chunk, l, g);
            }
            free(now.data);
            free(r.data);
            free(then->data);
        }
    if (sc->evicts)
        CHECK(kr_seq_entries(s) < (int64_t)L * H * N_PROMPT, "%s chunk %d: nothing was evicted (%lld entries)", label,
              chunk, (long long)kr_seq_entries(s));
    free(snap);
    free(early);
    free(want);
    free(got);
    free(sentinel);
    kr_seq_free(s);
    kr_seq_free(ref);
    kr_policy_free(pol);
}

/* A callback that fails stops the prefill with its message; the sequence still frees. */
static void check_failure(kr_ctx *c, kr_kv_pool *pool, const kr_config *cfg)
{
    char err[KR_ERR_MAX];
    const int V = cfg->vocab_size;
    int32_t ids[N_PROMPT];
    prompt_ids(ids, N_PROMPT, V);
    float *logits = malloc(sizeof(float) * (size_t)V), *sentinel = malloc(sizeof(float) * (size_t)V);
    REQUIRE(logits && sentinel, "out of memory");
    const char *specs[] = {NULL, "take:budget=32,warmup_budget=96,warmup_layers=3,probe=8",
                           "streaming:sink=4,window=32"};
    for (int k = 0; k < 3; k++) {
        for (int mode = 0; mode < 3; mode++) { /* 0: a message, 1: none, 2: err NULL */
            kr_policy *pol = specs[k] ? parse(specs[k], cfg) : NULL;
            kr_seq *s;
            REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
            if (pol) REQUIRE(kr_seq_set_policy(s, pol, err) == KR_OK, "%s", err);
            for (int i = 0; i < V; i++) sentinel[i] = logits[i] = -4321.0f;
            blob *snap = calloc((size_t)cfg->n_layers * cfg->n_kv_heads, sizeof(blob));
            blob *early = calloc((size_t)cfg->n_layers * cfg->n_kv_heads, sizeof(blob));
            REQUIRE(snap && early, "out of memory");
            spy sp = {.cfg = cfg, .logits = logits, .sentinel = sentinel, .logit_floats = (size_t)V, .ordered = 1,
                      .snap = snap, .early = early, .fail_at = cfg->n_layers - 1,
                      .fail_msg = mode == 0 ? "link to decode node lost" : NULL};
            snprintf(err, sizeof err, "untouched");
            int rc = kr_prefill_layers(c, s, ids, N_PROMPT, CHUNK, KR_LOGITS_LAST, logits, on_final, &sp,
                                       mode == 2 ? NULL : err);
            const char *label = specs[k] ? specs[k] : "(no policy)";
            CHECK(rc == -1, "%s: a failing callback did not fail the prefill", label);
            CHECK(!memcmp(logits, sentinel, sizeof(float) * (size_t)V), "%s: logits written after a failed callback",
                  label);
            CHECK(sp.calls >= 1 && sp.told < cfg->n_layers, "%s: %d calls, last told %d", label, sp.calls, sp.told);
            if (mode == 0) {
                char want[128];
                snprintf(want, sizeof want, "link to decode node lost (at %d layers)", cfg->n_layers - 1);
                CHECK(!strcmp(err, want), "%s: err '%s', expected '%s'", label, err, want);
            } else if (mode == 1) {
                CHECK_ERR_HAS(err, "callback failed");
            } else {
                CHECK(!strcmp(err, "untouched"), "%s: err written though NULL was passed", label);
            }
            for (int i = 0; i < cfg->n_layers * cfg->n_kv_heads; i++) {
                free(snap[i].data);
                free(early[i].data);
            }
            free(snap);
            free(early);
            kr_seq_free(s);
            kr_policy_free(pol);
        }
    }
    CHECK(kr_kv_pool_n_free(pool) == kr_kv_pool_n_blocks(pool), "blocks leaked: %d of %d free",
          kr_kv_pool_n_free(pool), kr_kv_pool_n_blocks(pool));
    free(logits);
    free(sentinel);
}

/* Prompt scoring's rows, gathered into arg's [n][vocab] (kr_rows_fn). */
typedef struct scored {
    float *rows;
    int vocab, calls, next;
} scored;

static int take_rows(void *arg, int first, int rows, const float *logits, char *err)
{
    scored *sc = arg;
    if (first != sc->next || rows < 1 || rows > KR_SCORE_ROWS) {
        snprintf(err, KR_ERR_MAX, "rows [%d, %d) after %d", first, first + rows, sc->next);
        return -1;
    }
    memcpy(sc->rows + (size_t)first * sc->vocab, logits, sizeof(float) * (size_t)rows * sc->vocab);
    sc->next = first + rows;
    sc->calls++;
    return KR_OK;
}

/* kr_prompt_span's scoring: every prompt row, in order, bit for bit what kr_forward with
 * KR_LOGITS_ALL gives over the same chunks (kvrelay-logits), and the last row's logits the same
 * as without scoring. */
static void check_scoring(kr_ctx *c, kr_kv_pool *pool, const kr_config *cfg)
{
    char err[KR_ERR_MAX];
    const int n = N_PROMPT, vocab = cfg->vocab_size;
    int32_t ids[N_PROMPT];
    prompt_ids(ids, n, vocab);
    float *want = malloc(sizeof(float) * (size_t)n * vocab), *got = malloc(sizeof(float) * (size_t)n * vocab);
    float *buf = malloc(sizeof(float) * KR_SCORE_ROWS * (size_t)vocab), *last = malloc(sizeof(float) * vocab),
          *last_plain = malloc(sizeof(float) * vocab);
    REQUIRE(want && got && buf && last && last_plain, "out of memory");
    kr_seq *s;
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    for (int at = 0; at < n; at += CHUNK) {
        int len = n - at < CHUNK ? n - at : CHUNK;
        REQUIRE(kr_forward(c, s, ids + at, len, KR_LOGITS_ALL, want + (size_t)at * vocab, err) == KR_OK, "%s", err);
    }
    kr_seq_free(s);
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill(c, s, ids, n, CHUNK, KR_LOGITS_LAST, last_plain, err) == KR_OK, "%s", err);
    kr_seq_free(s);
    scored sc = {.rows = got, .vocab = vocab};
    const kr_prompt_span sp = {.tokens = ids, .n = n, .from = 0, .to = n, .chunk = CHUNK, .pos0 = 0,
                               .score_fn = take_rows, .score_arg = &sc, .score_buf = buf};
    REQUIRE(kr_seq_create(pool, cfg->n_layers, cfg->n_kv_heads, &s, err) == KR_OK, "%s", err);
    REQUIRE(kr_prefill_span(c, s, &sp, KR_LOGITS_LAST, last, NULL, NULL, err) == KR_OK, "%s", err);
    kr_seq_free(s);
    CHECK(sc.next == n, "scored %d of %d rows", sc.next, n);
    CHECK(!memcmp(want, got, sizeof(float) * (size_t)n * vocab), "scored rows differ from kr_forward's");
    CHECK(!memcmp(last, last_plain, sizeof(float) * vocab), "scoring changed the last row's logits");
    printf("prompt scoring: %d rows in %d calls, bit-identical to kr_forward per chunk\n", n, sc.calls);
    free(want);
    free(got);
    free(buf);
    free(last);
    free(last_plain);
}

int main(void)
{
    const char *fx = kt_env("KR_FIXTURES");
    REQUIRE(fx, "KR_FIXTURES is not set (run through ctest)");
    char dir[4096], err[KR_ERR_MAX];
    snprintf(dir, sizeof dir, "%s/models/llama3-tiny", fx);
    if (access(dir, R_OK) != 0) {
        fprintf(stderr, "test_prefill_layers: %s is absent\n", dir);
        return KT_SKIP;
    }
    snprintf(tmp, sizeof tmp, "/tmp/kr_test_prefill_layers.XXXXXX");
    REQUIRE(mkdtemp(tmp), "mkdtemp");
    snprintf(gates, sizeof gates, "%s/gates.tsv", tmp);
    snprintf(windows, sizeof windows, "%s/windows.txt", tmp);
    kr_model *m;
    REQUIRE(kr_model_load(dir, NULL, &m, err) == KR_OK, "%s: %s", dir, err);
    const kr_config *cfg = kr_model_config(m);
    kr_test_policy_files(cfg, gates, windows);
    kr_ctx *c;
    kr_ctx_params cp = {.backend = KR_BACKEND_CPU, .n_threads = 2, .max_chunk = MAX_CHUNK};
    REQUIRE(kr_ctx_create(m, &cp, &c, err) == KR_OK, "%s", err);
    kr_kv_pool *pool;
    REQUIRE(kr_ctx_kv_pool_create(c, 16, 1024, &pool, err) == KR_OK, "%s", err);

    const int chunks[] = {CHUNK, 0}; /* several chunks; one (the context's max_chunk) */
    for (int k = 0; k < N_CASES; k++)
        for (int i = 0; i < 2; i++) check_case(c, pool, cfg, &CASES[k], chunks[i]);
    printf("kr_prefill_layers: %d policy configurations x 2 chunkings, every announced list unchanged after the "
           "call, logits bit-identical to kr_prefill\n", N_CASES);
    check_failure(c, pool, cfg);
    check_scoring(c, pool, cfg);

    kr_kv_pool_free(pool);
    kr_ctx_free(c);
    kr_model_free(m);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    CHECK(system(cmd) == 0, "cannot remove %s", tmp);
    return kt_done("test_prefill_layers");
}
