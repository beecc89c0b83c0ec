/*
 * sampler.c - next-token choice from a row of logits: greedy (argmax, lowest id on ties), or
 * temperature, then top-k, then top-p (nucleus) over the softmax, drawn with a seeded
 * generator (splitmix64 -> xoshiro256**), so a seed reproduces a run. Buffers are sized at
 * creation; sampling does not allocate. Also the log-probability of a token under a row's full
 * softmax (kr_logprob), which forced-token scoring reports.
 */
#include "kr-util.h"
#include "kr.h"

#include <math.h>
#include <stdlib.h>

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
    int32_t best = argmax(logits, vocab);
    if (top_id) *top_id = best;
    /* every term exp(l - max) is in (0, 1] and the max's own term is 1, so the sum is in
     * [1, vocab]: no overflow, and log(sum) >= 0 keeps the result <= 0 */
    double mx = (double)logits[best], sum = 0.0;
    for (int i = 0; i < vocab; i++) sum += exp((double)logits[i] - mx);
    return (float)(((double)logits[id] - mx) - log(sum));
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
