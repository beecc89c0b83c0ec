/*
 * sampler.c - next-token choice from a row of logits: greedy (argmax, lowest id on ties), or
 * temperature, then top-k, then top-p (nucleus) over the softmax, drawn with a seeded
 * generator (splitmix64 -> xoshiro256**), so a seed reproduces a run. Buffers are sized at
 * creation; sampling does not allocate. Also the log-probability of a token under a row's full
 * softmax (kr_logprob), which forced-token scoring reports. And the penalties a row of logits
 * takes before sampling (repetition as vLLM, presence and frequency as OpenAI define them), over
 * per-sequence counts sized once (kr_penalty_*).
 */
#include "kr-util.h"
#include "kr.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct kr_sampler {
    kr_sampling p;
    int vocab;
    uint64_t st[4];
    float *prob; /* [vocab] */
    int32_t *idx; /* [vocab] */
};

void kr_sampling_default(kr_sampling *s)
{
    s->greedy = 0;
    s->temperature = 1.0f;
    s->top_k = 0;
    s->top_p = 1.0f;
    s->seed = 0;
}

int kr_sampling_check(const kr_sampling *s, char *err)
{
    if (!(s->temperature >= 0.0f) || s->temperature > 100.0f)
        return kr_errf(err, "sampling: temperature %g must be in [0, 100]", s->temperature);
    if (s->top_k < 0) return kr_errf(err, "sampling: top_k %d must be >= 0 (0: off)", s->top_k);
    if (!(s->top_p >= 0.0f) || s->top_p > 1.0f)
        return kr_errf(err, "sampling: top_p %g must be in [0, 1] (1: off)", s->top_p);
    return KR_OK;
}

static uint64_t splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t next_u64(uint64_t *s)
{
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

int kr_sampler_create(const kr_sampling *s, int vocab_size, kr_sampler **out, char *err)
{
    if (kr_sampling_check(s, err) != KR_OK) return -1;
    if (vocab_size < 1) return kr_errf(err, "sampler: vocabulary size %d", vocab_size);
    kr_sampler *sp = calloc(1, sizeof *sp);
    if (!sp) return kr_errf(err, "sampler: out of memory");
    sp->p = *s;
    sp->vocab = vocab_size;
    sp->prob = malloc((size_t)vocab_size * sizeof *sp->prob);
    sp->idx = malloc((size_t)vocab_size * sizeof *sp->idx);
    if (!sp->prob || !sp->idx) {
        kr_sampler_free(sp);
        return kr_errf(err, "sampler: out of memory");
    }
    uint64_t x = s->seed;
    for (int i = 0; i < 4; i++) sp->st[i] = splitmix(&x);
    *out = sp;
    return KR_OK;
}

void kr_sampler_free(kr_sampler *sp)
{
    if (!sp) return;
    free(sp->prob);
    free(sp->idx);
    free(sp);
}

static int32_t argmax(const float *logits, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

int32_t kr_argmax(const float *logits, int vocab)
{
    return argmax(logits, vocab);
}

float kr_logprob(const float *logits, int vocab, int32_t id, int32_t *top_id)
{
    return kr_logprob_top(logits, vocab, id, top_id, 0, NULL, NULL);
}

float kr_logprob_top(const float *logits, int vocab, int32_t id, int32_t *top_id, int k, int32_t *ids,
                     float *lps)
{
    int32_t best = argmax(logits, vocab);
    if (top_id) *top_id = best;
    /* every term exp(l - max) is in (0, 1] and the max's own term is 1, so the sum is in
     * [1, vocab]: no overflow, and log(sum) >= 0 keeps the result <= 0 */
    double mx = (double)logits[best], sum = 0.0;
    for (int i = 0; i < vocab; i++) sum += exp((double)logits[i] - mx);
    const double lsum = log(sum);
    if (k > vocab) k = vocab;
    int have = 0; /* ids[0, have) sorted: larger logit first, then lower id */
    for (int32_t i = 0; i < vocab && k > 0; i++) {
        if (have == k && !(logits[i] > logits[ids[k - 1]])) continue; /* ties keep the lower id */
        int at = have < k ? have++ : k - 1;
        while (at > 0 && logits[i] > logits[ids[at - 1]]) {
            ids[at] = ids[at - 1];
            at--;
        }
        ids[at] = i;
    }
    for (int i = 0; i < have; i++) lps[i] = (float)(((double)logits[ids[i]] - mx) - lsum);
    return (float)(((double)logits[id] - mx) - lsum);
}

/* order: larger prob first, then lower id (deterministic) */
static int before(const float *prob, int32_t a, int32_t b)
{
    return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
}

static void swap(int32_t *a, int32_t *b)
{
    int32_t t = *a;
    *a = *b;
    *b = t;
}

/* Moves the k best of idx[0..n) to idx[0..k) (unordered): quickselect. */
static void select_top(const float *prob, int32_t *idx, int n, int k)
{
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int32_t pivot = idx[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (before(prob, idx[i], pivot)) i++;
            while (before(prob, pivot, idx[j])) j--;
            if (i <= j) swap(&idx[i++], &idx[j--]);
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

static void sort_desc(const float *prob, int32_t *idx, int n) /* insertion into a heap-free sort */
{
    /* shell sort: n is the candidate count after top-k, or the vocabulary for pure top-p */
    static const int gaps[] = {1750, 701, 301, 132, 57, 23, 10, 4, 1};
    for (size_t g = 0; g < sizeof gaps / sizeof gaps[0]; g++) {
        int gap = gaps[g];
        for (int i = gap; i < n; i++) {
            int32_t v = idx[i];
            int j = i;
            for (; j >= gap && before(prob, v, idx[j - gap]); j -= gap) idx[j] = idx[j - gap];
            idx[j] = v;
        }
    }
}

int32_t kr_sampler_sample(kr_sampler *sp, const float *logits)
{
    const int n = sp->vocab;
    if (sp->p.greedy || sp->p.temperature <= 0.0f) return argmax(logits, n);
    float mx = logits[argmax(logits, n)], inv_t = 1.0f / sp->p.temperature;
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        sp->prob[i] = expf((logits[i] - mx) * inv_t);
        total += sp->prob[i];
        sp->idx[i] = i;
    }
    int cand = n;
    if (sp->p.top_k > 0 && sp->p.top_k < n) {
        select_top(sp->prob, sp->idx, n, sp->p.top_k);
        cand = sp->p.top_k;
        total = 0.0;
        for (int i = 0; i < cand; i++) total += sp->prob[sp->idx[i]];
    }
    if (sp->p.top_p > 0.0f && sp->p.top_p < 1.0f) {
        sort_desc(sp->prob, sp->idx, cand);
        double cum = 0.0, limit = sp->p.top_p * total;
        int keep = 0;
        while (keep < cand) { /* the smallest prefix whose mass reaches top_p */
            cum += sp->prob[sp->idx[keep++]];
            if (cum >= limit) break;
        }
        cand = keep;
        total = cum;
    }
    double r = (double)(next_u64(sp->st) >> 11) * 0x1.0p-53 * total, acc = 0.0;
    for (int i = 0; i < cand; i++) {
        acc += sp->prob[sp->idx[i]];
        if (r < acc) return sp->idx[i];
    }
    return sp->idx[cand - 1];
}

/* ------------------------------------------------------------------ penalties */

struct kr_penalty_state {
    kr_penalties p;
    int vocab;
    int32_t *count; /* [vocab]: occurrences in the output */
    uint8_t *seen; /* [vocab]: in the prompt or the output */
    int32_t *ids; /* [vocab]: the distinct seen ids, n_ids of them, in order of first sight */
    int n_ids;
};

void kr_penalties_default(kr_penalties *p)
{
    p->repetition = 1.0f;
    p->presence = 0.0f;
    p->frequency = 0.0f;
}

int kr_penalties_check(const kr_penalties *p, char *err)
{
    if (!(p->repetition > 0.0f) || p->repetition > 100.0f)
        return kr_errf(err, "repetition_penalty %g must be in (0, 100] (1: off)", p->repetition);
    if (!(p->presence >= -2.0f) || p->presence > 2.0f)
        return kr_errf(err, "presence_penalty %g must be in [-2, 2] (0: off)", p->presence);
    if (!(p->frequency >= -2.0f) || p->frequency > 2.0f)
        return kr_errf(err, "frequency_penalty %g must be in [-2, 2] (0: off)", p->frequency);
    return KR_OK;
}

int kr_penalties_active(const kr_penalties *p)
{
    return p->repetition != 1.0f || p->presence != 0.0f || p->frequency != 0.0f;
}

static void see(kr_penalty_state *s, int32_t id)
{
    if (s->seen[id]) return;
    s->seen[id] = 1;
    s->ids[s->n_ids++] = id;
}

int kr_penalty_create(const kr_penalties *p, int vocab, const int32_t *prompt, int n_prompt,
                      kr_penalty_state **out, char *err)
{
    if (kr_penalties_check(p, err) != KR_OK) return -1;
    if (vocab < 1) return kr_errf(err, "penalties: vocabulary size %d", vocab);
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= vocab)
            return kr_errf(err, "penalties: prompt[%d] = %d is outside the vocabulary [0, %d)", i, prompt[i], vocab);
    kr_penalty_state *s = calloc(1, sizeof *s);
    if (!s) return kr_errf(err, "penalties: out of memory");
    s->p = *p;
    s->vocab = vocab;
    s->count = calloc((size_t)vocab, sizeof *s->count);
    s->seen = calloc((size_t)vocab, sizeof *s->seen);
    s->ids = malloc((size_t)vocab * sizeof *s->ids);
    if (!s->count || !s->seen || !s->ids) {
        kr_penalty_free(s);
        return kr_errf(err, "penalties: out of memory");
    }
    /* the repetition penalty is the only one the prompt's tokens take part in */
    for (int i = 0; p->repetition != 1.0f && i < n_prompt; i++) see(s, prompt[i]);
    *out = s;
    return KR_OK;
}

void kr_penalty_free(kr_penalty_state *s)
{
    if (!s) return;
    free(s->count);
    free(s->seen);
    free(s->ids);
    free(s);
}

void kr_penalty_add(kr_penalty_state *s, int32_t id)
{
    if (id < 0 || id >= s->vocab) return;
    if (s->count[id] < INT32_MAX) s->count[id]++;
    see(s, id);
}

void kr_penalty_apply(const kr_penalty_state *s, const float *logits, float *out)
{
    if (out != logits) memcpy(out, logits, (size_t)s->vocab * sizeof *out);
    const float r = s->p.repetition;
    for (int i = 0; i < s->n_ids; i++) {
        int32_t id = s->ids[i];
        float l = out[id];
        if (r != 1.0f) l = l > 0.0f ? l / r : l * r;
        int32_t c = s->count[id];
        l -= s->p.frequency * (float)c;
        if (c > 0) l -= s->p.presence;
        out[id] = l;
    }
}

const float *kr_draw_row(const kr_penalty_state *pen, const kr_draw_mask *m, const float *logits, int vocab,
                         float *out)
{
    if (!pen && !m->on) return logits;
    if (pen)
        kr_penalty_apply(pen, logits, out);
    else
        memcpy(out, logits, (size_t)vocab * sizeof *out);
    if (m->on) {
        if (m->eos >= 0 && m->eos < vocab) out[m->eos] = -INFINITY;
        for (int i = 0; i < m->n_stop; i++) out[m->stop[i]] = -INFINITY;
    }
    return out;
}
