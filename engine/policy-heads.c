/*
 * policy-heads.c - DuoAttention / PruLong head masks (`heads`): streaming heads keep sinks + a
 * window, dense heads keep everything.
 *
 *   heads:pattern=FILE,sparsity=s,sink=S,window=W[,decode=grow|window:W]
 *
 * FILE is the TSV DuoAttention and PruLong publish (one row per layer, one column per KV
 * head, gate values). Values are clipped to [0, 1]; DuoAttention's rule: sparsity s makes the
 * round(s * n) heads with the lowest gates (of all n KV heads of the model) streaming, the
 * others dense: every head streams at s = 1, none at s = 0.
 * A streaming head's chunk queries see sinks + window + the chunk causally; the head is trimmed
 * to sinks + window after each chunk, and its decode rule keeps sinks + the decode window
 * (decode=window:W; by default the policy's window) after each decode step.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct heads_params {
    char pattern[256];
    float sparsity;
    int sink, window;
    uint8_t *dense; /* [n_layers][n_kv_heads]: 1 dense, 0 streaming */
} heads_params;

/* PruLong's evaluation: 128 sinks, a 1024-token window; sparsity 0.5 (DuoAttention's default
 * deployment point). */
static int heads_init(kr_policy *p, char *err)
{
    heads_params *hp = calloc(1, sizeof *hp);
    if (!hp) return kr_errf(err, "policy: out of memory");
    hp->sparsity = 0.5f;
    hp->sink = 128;
    hp->window = 1024;
    p->params = hp;
    return KR_OK;
}

static int heads_set(kr_policy *p, const char *key, const char *value, char *err)
{
    heads_params *hp = p->params;
    int handled;
    if (kr_policy_decode_key(p, key, value, &handled, err) != KR_OK) return -1;
    if (handled) return KR_OK;
    if (!strcmp(key, "pattern")) {
        if (strlen(value) >= sizeof hp->pattern) return kr_errf(err, "policy: pattern path too long");
        strcpy(hp->pattern, value);
        return KR_OK;
    }
    if (!strcmp(key, "sparsity")) return kr_policy_float(key, value, 0.0, 1.0, &hp->sparsity, err);
    if (!strcmp(key, "sink")) return kr_policy_int(key, value, 0, 1 << 30, &hp->sink, err);
    if (!strcmp(key, "window")) return kr_policy_int(key, value, 0, 1 << 30, &hp->window, err);
    return kr_errf(err, "policy: heads has no key '%s' (keys: pattern, sparsity, sink, window, decode)", key);
}

/* Reads the gate TSV: n_layers rows of n_kv_heads values (tabs or spaces), clipped to [0, 1]. */
int kr_heads_read_pattern(const char *path, int n_layers, int n_kv_heads, float *gates, char *err)
{
    char *text;
    size_t len;
    if (kr_read_file(path, &text, &len, err) != KR_OK) return -1;
    int row = 0, rc = KR_OK;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *p = line;
        while (*p == ' ' || *p == '\t' || *p == '\r') p++;
        if (!*p || *p == '#') continue;
        if (row == n_layers) {
            rc = kr_errf(err, "%s: more than %d rows (the model has %d layers)", path, n_layers, n_layers);
            break;
        }
        int col = 0;
        while (*p && *p != '\r') {
            char *end;
            float v = strtof(p, &end);
            if (end == p || isnan(v)) {
                rc = kr_errf(err, "%s: row %d, column %d is not a number", path, row + 1, col + 1);
                break;
            }
            if (col == n_kv_heads) {
                rc = kr_errf(err, "%s: row %d has more than %d values (one per KV head)", path, row + 1, n_kv_heads);
                break;
            }
            gates[row * n_kv_heads + col++] = v < 0.0f ? 0.0f : v > 1.0f ? 1.0f : v;
            p = end;
            while (*p == ' ' || *p == '\t' || *p == ',') p++;
        }
        if (rc != KR_OK) break;
        if (col != n_kv_heads) {
            rc = kr_errf(err, "%s: row %d has %d values, the model has %d KV heads", path, row + 1, col, n_kv_heads);
            break;
        }
        row++;
    }
    if (rc == KR_OK && row != n_layers)
        rc = kr_errf(err, "%s: %d rows, the model has %d layers", path, row, n_layers);
    free(text);
    return rc;
}

void kr_heads_choose_dense(const float *gates, int n, float sparsity, uint8_t *dense)
{
    const int n_stream = (int)floor((double)sparsity * n + 0.5);
    /* the n - n_stream highest gates over all heads, as one row (ties: lower index dense) */
    kr_hsft_choose_dense(gates, 1, n, n - n_stream, dense);
}

static int heads_finish(kr_policy *p, const kr_config *cfg, char *err)
{
    heads_params *hp = p->params;
    if (!hp->pattern[0]) return kr_errf(err, "policy: heads needs pattern=FILE (the gate TSV)");
    int n = cfg->n_layers * cfg->n_kv_heads;
    float *gates = malloc(sizeof(float) * (size_t)n);
    hp->dense = malloc((size_t)n);
    if (!gates || !hp->dense) {
        free(gates);
        return kr_errf(err, "policy: out of memory");
    }
    if (kr_heads_read_pattern(hp->pattern, cfg->n_layers, cfg->n_kv_heads, gates, err) != KR_OK) {
        free(gates);
        return -1;
    }
    kr_heads_choose_dense(gates, n, hp->sparsity, hp->dense);
    free(gates);
    kr_policy_spec_add(p, "pattern", "%s", hp->pattern);
    kr_policy_spec_add(p, "sparsity", "%g", hp->sparsity);
    kr_policy_spec_add(p, "sink", "%d", hp->sink);
    kr_policy_spec_add(p, "window", "%d", hp->window);
    if (p->decode_window == -2) p->decode_window = hp->window;
    return KR_OK;
}

static void heads_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                              int layer)
{
    const heads_params *hp = p->params;
    for (int g = 0; g < s->n_kv_heads; g++) {
        if (hp->dense[layer * s->n_kv_heads + g]) continue;
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        if (l->len > hp->sink + hp->window) kr_seq_keep_ends(s, layer, g, hp->sink, hp->window);
        else kr_seq_pin(s, layer, g, hp->sink);
    }
}

/* dense heads grow; streaming heads keep sinks + the decode window */
static void heads_list_rule(const kr_policy *p, const kr_seq *s, int layer, int kv_head, kr_list_rule *rule)
{
    const heads_params *hp = p->params;
    if (hp->dense[layer * p->n_kv_heads + kv_head]) return;
    rule->sink = hp->sink;
    rule->window = p->decode_window;
}

static int heads_max_entries(const kr_policy *p, int n_prompt, int n_generate)
{
    return n_prompt + n_generate; /* dense heads hold everything */
}

/* Dense heads hold everything; a streaming head holds at most sinks + window after each chunk
 * and, during decode, sinks + the decode window plus the token being added. */
static void heads_list_max_entries(const kr_policy *p, int n_prompt, int n_generate, int *most)
{
    const heads_params *hp = p->params;
    const int64_t total = (int64_t)n_prompt + n_generate;
    int64_t after = (int64_t)hp->sink + hp->window < n_prompt ? (int64_t)hp->sink + hp->window : n_prompt;
    int64_t held = after;
    if (n_generate > 0 && p->decode_window < 0) {
        held = after + n_generate;
    } else if (n_generate > 0) {
        int64_t kept = (int64_t)hp->sink + p->decode_window > after ? (int64_t)hp->sink + p->decode_window : after;
        held = kept + 1 < total ? kept + 1 : total;
    }
    for (int i = 0; i < p->n_layers * p->n_kv_heads; i++) most[i] = hp->dense[i] ? (int)total : (int)held;
}

static void heads_free(kr_policy *p)
{
    heads_params *hp = p->params;
    if (hp) free(hp->dense);
}

const kr_policy_ops kr_policy_heads = {
    .name = "heads",
    .init = heads_init,
    .set = heads_set,
    .finish = heads_finish,
    .after_chunk = heads_after_chunk,
    .max_entries = heads_max_entries,
    .list_max_entries = heads_list_max_entries,
    .list_rule = heads_list_rule,
    .free_params = heads_free,
};
