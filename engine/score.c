/*
 * score.c - the host half of the scoring primitive shared by every attention-guided policy
 * (DESIGN.md section 1): 1-D pooling of the observers' attention and top-k selection. The
 * attention half is the backend op `score`. Ties in top-k go to the lower index so a selection
 * is reproducible across backends.
 */
#include "policy.h"

#include <math.h>
#include <stdlib.h>

void kr_pool1d(const float *in, int n, int kernel, int use_max, float *out)
{
    const int half = kernel / 2;
    for (int j = 0; j < n; j++) {
        int a = j - half < 0 ? 0 : j - half, b = j + half >= n ? n - 1 : j + half;
        if (use_max) {
            float m = -INFINITY;
            for (int i = a; i <= b; i++) m = in[i] > m ? in[i] : m;
            out[j] = m;
        } else {
            double sum = 0.0;
            for (int i = a; i <= b; i++) sum += in[i];
            out[j] = (float)(sum / kernel); /* zero padding counts: torch count_include_pad */
        }
    }
}

/* heap of indices, the root the *worst* kept: lower score, or equal score and higher index */
static int worse(const float *s, int32_t a, int32_t b)
{
    return s[a] < s[b] || (s[a] == s[b] && a > b);
}

static void sift_down(const float *s, int32_t *h, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < n && worse(s, h[l], h[w])) w = l;
        if (r < n && worse(s, h[r], h[w])) w = r;
        if (w == i) return;
        int32_t t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int kr_topk(const float *scores, int n, int k, int32_t *tmp, int32_t *idx)
{
    if (k <= 0) return 0;
    if (k >= n) {
        for (int i = 0; i < n; i++) idx[i] = i;
        return n;
    }
    for (int i = 0; i < k; i++) tmp[i] = i;
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(scores, tmp, k, i);
    for (int i = k; i < n; i++) {
        if (worse(scores, tmp[0], i)) {
            tmp[0] = i;
            sift_down(scores, tmp, k, 0);
        }
    }
    for (int i = 0; i < k; i++) idx[i] = tmp[i];
    qsort(idx, (size_t)k, sizeof *idx, cmp_i32);
    return k;
}
