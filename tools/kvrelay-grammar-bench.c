/*
 * kvrelay-grammar-bench - what structured output costs per decode step: the token mask of
 * kr-grammar.h over a model's vocabulary, timed while random documents of a schema are
 * "decoded" (each step: the mask, then a uniformly random allowed token, as a sampler under the
 * mask would pick). Prints the vocabulary's trie, the build times, and the mask's time per
 * step (mean, p50, p99, max) split by where the step was: inside a string (most of the trie
 * stays alive) or elsewhere (most of it is cut at the first byte).
 * Not a test: it checks nothing but that documents end (test_grammar checks them).
 * Run: kvrelay-grammar-bench --model models/kjv-2l128-2k [--schema FILE] [--steps N]
 */
#include "cli.h"
#include "kr-grammar.h"
#include "kr.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A record-like schema: strings, numbers, an enum, an array of objects. */
static const char default_schema[] =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"maxLength\":64},"
    "\"age\":{\"type\":\"integer\"},"
    "\"verse\":{\"type\":\"string\"},"
    "\"book\":{\"enum\":[\"Genesis\",\"Exodus\",\"Leviticus\",\"Numbers\",\"Deuteronomy\"]},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":16},\"maxItems\":4},"
    "\"refs\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{"
    "\"chapter\":{\"type\":\"integer\"},\"score\":{\"type\":\"number\"},\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"chapter\"],\"additionalProperties\":false},\"maxItems\":3}},"
    "\"required\":[\"name\",\"age\",\"verse\",\"book\",\"tags\",\"refs\"],\"additionalProperties\":false}";

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct series {
    double *v;
    int n;
} series;

static void report(const char *what, series *s)
{
    if (!s->n) {
        printf("  %-10s no steps\n", what);
        return;
    }
    qsort(s->v, (size_t)s->n, sizeof *s->v, cmp_double);
    double sum = 0;
    for (int i = 0; i < s->n; i++) sum += s->v[i];
    printf("  %-10s %6d steps  mean %8.1f us  p50 %8.1f us  p99 %8.1f us  max %8.1f us\n", what, s->n,
           sum / s->n * 1e6, s->v[s->n / 2] * 1e6, s->v[(int)(s->n * 0.99)] * 1e6, s->v[s->n - 1] * 1e6);
}

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *dir = NULL, *schema_file = NULL;
    int steps = 2000, budget = 400, within = 0;
    uint64_t seed = 1;
    const kc_flag table[] = {
        {.kind = KC_FLAG_STRING, .name = "--model", .arg = "DIR", .dest = &dir,
         .help = "the directory holding tokenizer.json (required)"},
        {.kind = KC_FLAG_STRING, .name = "--schema", .arg = "FILE", .dest = &schema_file, .def = "a record of 6 fields",
         .help = "a JSON Schema file, or a response_format object (it has a \"type\" of json_object or json_schema)"},
        {.kind = KC_FLAG_INT, .name = "--steps", .arg = "N", .dest = &steps, .min = 1, .max = 10000000, .def = "2000",
         .help = "decode steps to time in all (documents are decoded one after the other)"},
        {.kind = KC_FLAG_INT, .name = "--budget", .arg = "N", .dest = &budget, .min = 1, .max = 1000000, .def = "400",
         .help = "random tokens per document before the shortest way to its end is taken"},
        {.kind = KC_FLAG_INT, .name = "--within", .arg = "N", .dest = &within, .min = 0, .max = 1000000, .def = "0",
         .help = "time kr_grammar_mask_budget as the serving nodes use it: each document gets N tokens (it ends\n"
                 "when closed or when they are spent), random allowed ones; 0: the plain mask and --budget"},
        {.kind = KC_FLAG_FUNC, .name = "--seed", .arg = "N", .dest = &seed, .fn = cli_flag_u64, .def = "1",
         .help = "seed of the random token choices"},
        {.kind = KC_FLAG_END},
    };
    const kc_flags flags = {
        .prog = "kvrelay-grammar-bench",
        .usage = "--model DIR [--schema FILE] [--steps N] [--budget N | --within N] [--seed N]",
        .about = "Times the structured-output token mask (docs/structured-output.md) per decode step over\n"
                 "the model's vocabulary, on random documents of the schema.",
        .table = table,
    };
    kc_flags_main(&flags, argc, argv, 0);
    if (!dir) kc_flags_die(&flags, "--model is required");

    char err[KR_ERR_MAX];
    char *schema = NULL;
    size_t schema_len = sizeof default_schema - 1;
    if (schema_file) {
        FILE *f = fopen(schema_file, "rb");
        if (!f) cli_die(1, "--schema %s: cannot open", schema_file);
        schema = cli_read_file(f, &schema_len);
        fclose(f);
    }
    const char *text = schema ? schema : default_schema;
    kr_tokenizer *tok;
    if (kr_tokenizer_load(dir, &tok, err)) cli_die(1, "%s", err);
    double t0 = now_s();
    kr_grammar_vocab *v;
    kr_grammar_scratch *scr;
    if (kr_grammar_vocab_create(tok, NULL, 0, &v, err) || kr_grammar_scratch_create(v, &scr, err)) cli_die(1, "%s", err);
    double t1 = now_s();
    kr_grammar *g = NULL;
    int is_format = strstr(text, "\"json_object\"") || strstr(text, "\"json_schema\"");
    int rc = is_format ? kr_grammar_compile(text, schema_len, NULL, &g, err)
                       : kr_grammar_compile_schema(text, schema_len, NULL, &g, err);
    if (rc || !g) cli_die(1, "%s: %s", schema_file ? schema_file : "schema", rc ? err : "no constraint (text)");
    double t2 = now_s();
    int nv = kr_grammar_vocab_n(v);
    printf("vocabulary %s: %d ids; vocabulary trie built in %.1f ms; schema compiled in %.3f ms\n", dir, nv,
           (t1 - t0) * 1e3, (t2 - t1) * 1e3);

    kr_matcher *m, *tmp;
    if (kr_matcher_create(g, &m, err) || kr_matcher_create(g, &tmp, err)) cli_die(1, "%s", err);
    uint32_t *mask = malloc((size_t)(nv + 31) / 32 * 4);
    series in_str = {malloc((size_t)steps * sizeof(double)), 0}, other = {malloc((size_t)steps * sizeof(double)), 0};
    if (!mask || !in_str.v || !other.v) cli_die(1, "out of memory");
    uint64_t rng = seed;
    long allowed_sum = 0;
    int docs = 0, n_doc = 0;
    double accept_s = 0;
    for (int s = 0; s < steps; s++) {
        /* where the step is: inside a string if a quote opened one (cheap probe: a letter) */
        kr_matcher_copy(tmp, m);
        int in_string = kr_matcher_feed(tmp, 'q') == 0;
        double a = now_s();
        int count = within ? kr_grammar_mask_budget(v, m, scr, within - n_doc, mask) : kr_grammar_mask(v, m, scr, mask);
        double b = now_s();
        series *ser = in_string ? &in_str : &other;
        ser->v[ser->n++] = b - a;
        if (count <= 0) cli_die(1, "no token allowed: a bug (test_grammar should have caught it)");
        allowed_sum += count;
        int32_t id = -1;
        if (within || n_doc < budget) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            int r = (int)((rng >> 33) % (uint64_t)count);
            for (int32_t i = 0; id < 0; i++)
                if ((mask[i >> 5] >> (i & 31) & 1) && r-- == 0) id = i;
        } else { /* finish: the allowed token after which the end is nearest */
            uint32_t best = UINT32_MAX;
            for (int32_t i = 0; i < nv; i++) {
                if (!(mask[i >> 5] >> (i & 31) & 1)) continue;
                kr_matcher_copy(tmp, m);
                kr_matcher_accept_token(tmp, v, i);
                uint32_t left = kr_matcher_remaining(tmp);
                if (left < best || (left == best && kr_matcher_ended(tmp))) best = left, id = i;
            }
        }
        a = now_s();
        if (kr_matcher_accept_token(m, v, id)) cli_die(1, "an allowed token was refused: a bug");
        accept_s += now_s() - a;
        n_doc++;
        if (kr_matcher_ended(m) || (within && (kr_matcher_closed(m) || n_doc == within))) {
            if (within && !kr_matcher_can_end(m)) cli_die(1, "a document is not whole within its budget: a bug");
            docs++;
            n_doc = 0;
            kr_matcher_reset(m);
        }
    }
    printf("%d steps, %d documents ended, %.0f tokens allowed per step on average; advancing by a token: %.2f us\n",
           steps, docs, (double)allowed_sum / steps, accept_s / steps * 1e6);
    printf("mask time per step:\n");
    report("in string", &in_str);
    report("elsewhere", &other);
    series all = {malloc((size_t)steps * sizeof(double)), 0};
    if (!all.v) cli_die(1, "out of memory");
    memcpy(all.v, in_str.v, (size_t)in_str.n * sizeof(double));
    memcpy(all.v + in_str.n, other.v, (size_t)other.n * sizeof(double));
    all.n = in_str.n + other.n;
    report("all", &all);
    free(all.v);
    free(in_str.v);
    free(other.v);
    free(mask);
    free(schema);
    kr_matcher_free(m);
    kr_matcher_free(tmp);
    kr_grammar_free(g);
    kr_grammar_scratch_free(scr);
    kr_grammar_vocab_free(v);
    kr_tokenizer_free(tok);
    return 0;
}
