/*
 * policy-hsft.c - HS-SFT (Hybrid Sparse SFT, paper section 2.3 and appendix A.3): per layer a
 * fraction `dense` of the KV heads keep every entry; the others are streaming heads that keep
 * `sink` sinks plus their layer's window, the layer's learned window rescaled by one common
 * factor so that dense plus streaming entries meet the global KV budget `budget` (a fraction
 * of the full cache).
 *
 *   hsft:windows=FILE,pattern=FILE,dense=a,budget=r,sink=S[,decode=grow|window:W]
 *
 * windows FILE: one line per layer, in layer order, holding that layer's learned window in
 * tokens as a positive integer (the paper's learned budget b = blocks x 128); blank lines and
 * lines starting with '#' are skipped. The paper released no code, so this format is ours.
 * pattern FILE: the gate TSV of the `heads` policy (DuoAttention / PruLong); in each layer the
 * floor(a * n_kv_heads) heads with the highest gates are dense (ties: lower head index first).
 *
 * The budget is a fraction of the full KV of the context the sequence has at the end of a
 * prefill (every (layer, KV head) holding every token); the rescale runs at the start of every
 * kr_prefill call (its first chunk, layer 0) because only then is that length known. A sequence
 * fed through kr_forward alone uses the learned windows unscaled. Streaming heads are trimmed to
 * sinks + window after every chunk, and their decode rule keeps sinks + the same window (the
 * rescale rewrites it) after every decode step, like the `heads` policy; dense heads pin
 * everything. A chunk's queries see the sinks, the window and the chunk causally.
 *
 * What it is not: training. The learned windows and the gates come from files.
 */
#include "kr-kv.h"
#include "kr-util.h"
#include "policy.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct hsft_params {
    char windows_path[256];
    char pattern[256]; /* "" when not given */
    double dense, budget; /* as given; dense < 0: not given (defaults to budget - 0.05) */
    int sink;
    int n_dense, n_stream; /* KV heads per layer */
    int *learned; /* [n_layers] learned windows, tokens */
    uint8_t *is_dense; /* [n_layers][n_kv_heads] */
} hsft_params;

/* Per sequence: the windows in force (KR_HSFT_ALL: no trimming) and the context they were
 * rescaled for (0: learned windows, no prefill yet). */
typedef struct hsft_state {
    int ctx;
    int window[]; /* [n_layers] */
} hsft_state;

/* Both values are parsed as doubles as well as checked by kr_policy_float: the budget in
 * entries is floor(budget * full), which a float's rounding would move by whole entries. */
static int parse_fraction(const char *key, const char *value, double lo, double hi, double *out, char *err)
{
    float checked;
    if (kr_policy_float(key, value, lo, hi, &checked, err) != KR_OK) return -1;
    *out = strtod(value, NULL);
    return KR_OK;
}

/* Defaults from the paper: 128 sinks (Table 6), a 10% KV budget (its headline setting, Table 1
 * and every ablation), dense fraction 5% below the budget (section 3.1: "we set the dense-head
 * ratio a to be 5% lower than the targeted KV budget"). */
static int hsft_init(kr_policy *p, char *err)
{
    hsft_params *hp = calloc(1, sizeof *hp);
    if (!hp) return kr_errf(err, "policy: out of memory");
    hp->dense = -1.0;
    hp->budget = 0.1;
    hp->sink = 128;
    p->params = hp;
    return KR_OK;
}

static int hsft_set(kr_policy *p, const char *key, const char *value, char *err)
{
    hsft_params *hp = p->params;
    int handled;
    if (kr_policy_decode_key(p, key, value, &handled, err) != KR_OK) return -1;
    if (handled) return KR_OK;
    if (!strcmp(key, "windows") || !strcmp(key, "pattern")) {
        char *dst = key[0] == 'w' ? hp->windows_path : hp->pattern;
        if (!*value) return kr_errf(err, "policy: %s= needs a file path", key);
        if (strlen(value) >= sizeof hp->pattern) return kr_errf(err, "policy: %s path too long", key);
        strcpy(dst, value);
        return KR_OK;
    }
    if (!strcmp(key, "dense")) return parse_fraction(key, value, 0.0, 1.0, &hp->dense, err);
    if (!strcmp(key, "budget")) {
        if (parse_fraction(key, value, 0.0, 1.0, &hp->budget, err) != KR_OK) return -1;
        if (hp->budget <= 0.0) return kr_errf(err, "policy: budget=%s must be > 0 (a fraction of the full KV)", value);
        return KR_OK;
    }
    if (!strcmp(key, "sink")) return kr_policy_int(key, value, 0, 1 << 30, &hp->sink, err);
    return kr_errf(err, "policy: hsft has no key '%s' (keys: windows, pattern, dense, budget, sink, decode)", key);
}

int kr_hsft_read_windows(const char *path, int n_layers, int *windows, char *err)
{
    char *text;
    size_t len;
    if (kr_read_file(path, &text, &len, err) != KR_OK) return -1;
    int n = 0, line_no = 0, rc = KR_OK;
    for (char *line = text, *next; line && rc == KR_OK; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        line_no++;
        char *at = line;
        while (*at == ' ' || *at == '\t' || *at == '\r') at++;
        if (!*at || *at == '#') continue;
        char *end;
        errno = 0;
        long v = strtol(at, &end, 10);
        char *rest = end;
        while (*rest == ' ' || *rest == '\t' || *rest == '\r') rest++;
        if (end == at || *rest || errno || v < 1 || v > (1 << 30)) {
            size_t shown = strcspn(at, "\r");
            rc = kr_errf(err, "%s:%d: expected one window size in tokens (an integer in [1, %d]), got '%.*s'",
                         path, line_no, 1 << 30, (int)(shown > 40 ? 40 : shown), at);
        } else if (n == n_layers) {
            rc = kr_errf(err, "%s:%d: more than %d windows (one line per layer; the model has %d layers)",
                         path, line_no, n_layers, n_layers);
        } else {
            windows[n++] = (int)v;
        }
    }
    if (rc == KR_OK && n != n_layers)
        rc = kr_errf(err, "%s: %d windows, expected %d (one line per layer)", path, n, n_layers);
    free(text);
    return rc;
}

void kr_hsft_choose_dense(const float *gates, int n_layers, int n_kv_heads, int n_dense, uint8_t *dense)
{
    for (int l = 0; l < n_layers; l++) {
        const float *g = gates + (size_t)l * n_kv_heads;
        uint8_t *d = dense + (size_t)l * n_kv_heads;
        memset(d, 0, (size_t)n_kv_heads);
        /* n_dense rounds of "highest gate not chosen yet, lowest index on ties" */
        for (int k = 0; k < n_dense; k++) {
            int best = -1;
            for (int h = 0; h < n_kv_heads; h++)
                if (!d[h] && (best < 0 || g[h] > g[best])) best = h;
            d[best] = 1;
        }
    }
}

/* Entries a streaming head holds at context ctx with window w. */
static int64_t stream_entries(int ctx, int sink, int w)
{
    int64_t held = (int64_t)sink + w;
    return held < ctx ? held : ctx;
}

/* Layer window floor(c * learned) for a common scale c, capped to the parser's range. */
static int window_at(double c, int learned)
{
    double w = floor(c * learned);
    return w > (double)(1 << 30) ? 1 << 30 : (int)w;
}

/* Entries the whole cache holds at context ctx with windows floor(c * learned[l]); writes them. */
static int64_t total_at(const int *learned, int n_layers, int n_dense, int n_stream, int sink, int ctx,
                        double c, int *windows)
{
    int64_t total = (int64_t)n_layers * n_dense * ctx;
    for (int l = 0; l < n_layers; l++) {
        windows[l] = window_at(c, learned[l]);
        total += (int64_t)n_stream * stream_entries(ctx, sink, windows[l]);
    }
    return total;
}

int64_t kr_hsft_rescale(const int *learned, int n_layers, int n_dense, int n_stream, int sink, double budget,
                        int ctx, int *windows)
{
    const int n_kv = n_dense + n_stream;
    const int64_t full = (int64_t)n_layers * n_kv * ctx;
    /* a budget caps entries: floor, with a margin for the decimal fraction's binary rounding */
    const int64_t cap = (int64_t)floor(budget * (double)full + 1e-6);
    if (n_stream == 0 || cap >= full) { /* everything fits: nothing to evict */
        for (int l = 0; l < n_layers; l++) windows[l] = KR_HSFT_ALL;
        return full;
    }
    /* The largest common scale c whose floored windows fit. total_at is non-decreasing in c:
     * bisect keeping total(lo) <= cap < total(hi). At the first hi every window reaches the
     * context, so the cache is full there (> cap). */
    int min_learned = learned[0];
    for (int l = 1; l < n_layers; l++) min_learned = learned[l] < min_learned ? learned[l] : min_learned;
    double lo = 0.0, hi = (double)ctx / min_learned + 1.0;
    int64_t total = total_at(learned, n_layers, n_dense, n_stream, sink, ctx, lo, windows);
    if (total > cap) return total; /* dense heads and sinks alone exceed it: windows 0 */
    for (int it = 0; it < 200; it++) {
        double mid = lo + (hi - lo) / 2;
        if (mid <= lo || mid >= hi) break;
        if (total_at(learned, n_layers, n_dense, n_stream, sink, ctx, mid, windows) <= cap) lo = mid;
        else hi = mid;
    }
    total = total_at(learned, n_layers, n_dense, n_stream, sink, ctx, lo, windows);
    /* The layers whose window steps up between lo and hi are those a common scale cannot grow
     * without passing the cap all together. Give them +1 one layer at a time (n_stream entries
     * each) while the cap allows, larger learned windows first (ties: lower layer), so the
     * budget ends short by less than n_stream entries. Each such layer sits at a step of
     * floor(c * learned), so a smaller learned window never passes a larger one. */
    while (total + n_stream <= cap) {
        int best = -1;
        for (int l = 0; l < n_layers; l++) {
            int w_lo = window_at(lo, learned[l]), w_hi = window_at(hi, learned[l]);
            if (windows[l] != w_lo || stream_entries(ctx, sink, w_hi) <= stream_entries(ctx, sink, w_lo))
                continue; /* already grown, or does not grow next */
            if (best < 0 || learned[l] > learned[best]) best = l;
        }
        if (best < 0) break;
        windows[best]++;
        total += n_stream;
    }
    return total;
}

static int hsft_finish(kr_policy *p, const kr_config *cfg, char *err)
{
    hsft_params *hp = p->params;
    const int n_layers = cfg->n_layers, n_kv = cfg->n_kv_heads;
    if (!hp->windows_path[0])
        return kr_errf(err, "policy: hsft needs windows=FILE (the learned window of each layer in tokens, "
                       "one line per layer)");
    if (hp->dense < 0.0) hp->dense = hp->budget - 0.05 > 0.0 ? hp->budget - 0.05 : 0.0;
    /* the paper keeps a fraction of each layer's heads dense; a count of heads is whole, and
     * rounding down keeps the dense part within `dense` (the margin absorbs 0.7 * 10 = 6.99..) */
    hp->n_dense = (int)floor(hp->dense * n_kv + 1e-9);
    hp->n_stream = n_kv - hp->n_dense;
    if ((double)hp->n_dense / n_kv > hp->budget + 1e-12)
        return kr_errf(err, "policy: hsft dense=%g keeps %d of %d KV heads per layer dense, more than "
                       "budget=%g of the cache (lower dense or raise budget)", hp->dense, hp->n_dense,
                       n_kv, hp->budget);
    hp->learned = malloc(sizeof(int) * (size_t)n_layers);
    hp->is_dense = malloc((size_t)n_layers * (size_t)n_kv);
    if (!hp->learned || !hp->is_dense) return kr_errf(err, "policy: out of memory");
    if (kr_hsft_read_windows(hp->windows_path, n_layers, hp->learned, err) != KR_OK) return -1;
    memset(hp->is_dense, 0, (size_t)n_layers * (size_t)n_kv);
    if (hp->pattern[0]) {
        float *gates = malloc(sizeof(float) * (size_t)n_layers * (size_t)n_kv);
        if (!gates) return kr_errf(err, "policy: out of memory");
        int rc = kr_heads_read_pattern(hp->pattern, n_layers, n_kv, gates, err);
        if (rc == KR_OK) kr_hsft_choose_dense(gates, n_layers, n_kv, hp->n_dense, hp->is_dense);
        free(gates);
        if (rc != KR_OK) return -1;
    } else if (hp->n_dense > 0) {
        return kr_errf(err, "policy: hsft dense=%g makes %d KV heads per layer dense: it needs pattern=FILE "
                       "(the gate TSV that ranks them)", hp->dense, hp->n_dense);
    }
    kr_policy_spec_add(p, "windows", "%s", hp->windows_path);
    if (hp->pattern[0]) kr_policy_spec_add(p, "pattern", "%s", hp->pattern);
    kr_policy_spec_add(p, "dense", "%g", hp->dense);
    kr_policy_spec_add(p, "budget", "%g", hp->budget);
    kr_policy_spec_add(p, "sink", "%d", hp->sink);
    /* decode= not given: each layer's own rescaled window (not one W, so nothing to print) */
    return KR_OK;
}

static int hsft_state_init(const kr_policy *p, kr_seq *s, char *err)
{
    const hsft_params *hp = p->params;
    hsft_state *st = malloc(sizeof *st + sizeof(int) * (size_t)p->n_layers);
    if (!st) return kr_errf(err, "policy: out of memory");
    st->ctx = 0;
    memcpy(st->window, hp->learned, sizeof(int) * (size_t)p->n_layers);
    s->policy_state = st;
    return KR_OK;
}

/* Streaming heads keep sinks + `window` (KR_HSFT_ALL: everything); dense heads pin everything
 * (DESIGN.md section 1: a dense head's pinned set is the whole list). */
static void hsft_trim(const hsft_params *hp, kr_seq *s, int layer, int window)
{
    for (int g = 0; g < s->n_kv_heads; g++) {
        const kr_kv_list *l = kr_seq_list(s, layer, g);
        if (hp->is_dense[layer * s->n_kv_heads + g]) kr_seq_pin(s, layer, g, l->len);
        else if (window != KR_HSFT_ALL && l->len - hp->sink > window) kr_seq_keep_ends(s, layer, g, hp->sink, window);
        else kr_seq_pin(s, layer, g, hp->sink);
    }
}

/* Dense heads pin every entry and are never trimmed; streaming heads keep sinks + the decode
 * window: decode=window:W, never trimmed with decode=grow, by default their layer's window (the
 * learned one, until a prefill rescales it). */
static void hsft_list_rule(const kr_policy *p, const kr_seq *s, int layer, int kv_head, kr_list_rule *rule)
{
    const hsft_params *hp = p->params;
    if (hp->is_dense[layer * p->n_kv_heads + kv_head]) {
        rule->sink = INT_MAX;
        return;
    }
    rule->sink = hp->sink;
    if (p->decode_window != -2) rule->window = p->decode_window;
    else if (s) rule->window = ((const hsft_state *)s->policy_state)->window[layer];
    else rule->window = hp->learned[layer];
}

static void hsft_after_chunk(const kr_policy *p, kr_seq *s, const kr_evict_env *env, const kr_chunk *c,
                             int layer)
{
    const hsft_params *hp = p->params;
    hsft_state *st = s->policy_state;
    if (c->start == 0 && layer == 0) {
        /* a new prefill: the context at its end is what came before plus this prompt (next_pos
         * already counts this chunk); the streaming heads' decode rules follow the rescale */
        int ctx = s->next_pos - c->n_real + c->n_prompt;
        kr_hsft_rescale(hp->learned, p->n_layers, hp->n_dense, hp->n_stream, hp->sink, hp->budget, ctx, st->window);
        st->ctx = ctx;
        for (int i = 0; i < p->n_layers * p->n_kv_heads; i++)
            kr_policy_set_list_rule(p, s, i / p->n_kv_heads, i % p->n_kv_heads);
    }
    hsft_trim(hp, s, layer, st->window[layer]);
}

/* Dense heads hold everything; a streaming head holds what prefill left (sinks + its layer's
 * window rescaled for n_prompt) and during decode sinks + the decode window plus the token
 * being added. */
static void hsft_list_max_entries(const kr_policy *p, int n_prompt, int n_generate, int *most)
{
    const hsft_params *hp = p->params;
    const int total = n_prompt + n_generate, H = p->n_kv_heads;
    int *w = malloc(sizeof(int) * (size_t)p->n_layers);
    if (w) kr_hsft_rescale(hp->learned, p->n_layers, hp->n_dense, hp->n_stream, hp->sink, hp->budget, n_prompt, w);
    for (int l = 0; l < p->n_layers; l++) {
        int held = total; /* no memory: the safe bound */
        if (w) {
            int after = w[l] == KR_HSFT_ALL ? n_prompt : (int)stream_entries(n_prompt, hp->sink, w[l]);
            int during = after;
            if (n_generate > 0 && p->decode_window == -1) { /* decode=grow */
                during = after + n_generate;
            } else if (n_generate > 0) {
                int dw = p->decode_window >= 0 ? p->decode_window : w[l];
                during = dw == KR_HSFT_ALL ? total : (int)stream_entries(total, hp->sink, dw + 1);
            }
            held = after > during ? after : during;
        }
        for (int g = 0; g < H; g++) most[l * H + g] = hp->is_dense[l * H + g] ? total : held;
    }
    free(w);
}

static int hsft_max_entries(const kr_policy *p, int n_prompt, int n_generate)
{
    const int lists = p->n_layers * p->n_kv_heads;
    int *each = malloc(sizeof(int) * (size_t)lists), most = n_prompt + n_generate;
    if (!each) return most; /* the safe bound */
    hsft_list_max_entries(p, n_prompt, n_generate, each);
    most = 0;
    for (int i = 0; i < lists; i++) most = each[i] > most ? each[i] : most;
    free(each);
    return most;
}

static void hsft_free(kr_policy *p)
{
    hsft_params *hp = p->params;
    free(hp->learned);
    free(hp->is_dense);
}

const kr_policy_ops kr_policy_hsft = {
    .name = "hsft",
    .init = hsft_init,
    .set = hsft_set,
    .finish = hsft_finish,
    .state_init = hsft_state_init,
    .after_chunk = hsft_after_chunk,
    .max_entries = hsft_max_entries,
    .list_max_entries = hsft_list_max_entries,
    .list_rule = hsft_list_rule,
    .free_params = hsft_free,
};
