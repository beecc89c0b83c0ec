/* stop.c - stop-string matching with held-back prefixes; see stop.h. */
#include "stop.h"

#include <stdlib.h>
#include <string.h>

int rt_stop_init(rt_stop *m, char *const *stops, int n, int include)
{
    memset(m, 0, sizeof *m);
    size_t *lens = calloc(n > 0 ? (size_t)n : 1, sizeof *lens);
    char *buf = malloc(64);
    if (!lens || !buf) {
        free(lens);
        free(buf);
        return -1;
    }
    for (int i = 0; i < n; i++) lens[i] = strlen(stops[i]);
    m->stops = stops;
    m->stop_lens = lens;
    m->n_stops = n;
    m->include = include;
    m->buf = buf;
    m->cap = 64;
    return 0;
}

void rt_stop_free(rt_stop *m)
{
    free((void *)m->stop_lens);
    free(m->buf);
    memset(m, 0, sizeof *m);
}

/* Earliest complete occurrence of any stop string in buf[0, len): its offset, or -1, and the
 * length of the stop string found there (the first listed among those that match at it). A plain
 * scan: stop strings are short and the buffer holds one delta plus a held-back prefix. */
static long first_match(const rt_stop *m, const char *buf, size_t len, size_t *stop_len)
{
    for (size_t at = 0; at < len; at++)
        for (int i = 0; i < m->n_stops; i++)
            if (m->stop_lens[i] <= len - at && memcmp(buf + at, m->stops[i], m->stop_lens[i]) == 0) {
                *stop_len = m->stop_lens[i];
                return (long)at;
            }
    return -1;
}

/* Longest suffix of buf[0, len) that is a proper prefix of some stop string: the text that a
 * later delta could still complete into a stop string. */
static size_t held_suffix(const rt_stop *m, const char *buf, size_t len)
{
    size_t best = 0;
    for (int i = 0; i < m->n_stops; i++) {
        size_t k = m->stop_lens[i] - 1 < len ? m->stop_lens[i] - 1 : len;
        for (; k > best; k--)
            if (memcmp(buf + len - k, m->stops[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

int rt_stop_push(rt_stop *m, const char *delta, size_t len, const char **out, size_t *out_len)
{
    *out = "";
    *out_len = 0;
    if (m->matched) return 1;
    /* drop what the previous call emitted; keep what it held back */
    memmove(m->buf, m->buf + m->emitted, m->len - m->emitted);
    m->len -= m->emitted;
    m->emitted = 0;
    if (m->len + len + 1 > m->cap) {
        size_t cap = m->cap;
        while (cap < m->len + len + 1) cap *= 2;
        char *grown = realloc(m->buf, cap);
        if (!grown) return -1;
        m->buf = grown;
        m->cap = cap;
    }
    memcpy(m->buf + m->len, delta, len);
    m->len += len;
    size_t stop_len = 0;
    long hit = first_match(m, m->buf, m->len, &stop_len);
    if (hit >= 0) {
        m->matched = 1;
        m->emitted = m->len; /* nothing is kept after a match */
        *out = m->buf;
        *out_len = (size_t)hit + (m->include ? stop_len : 0);
        return 1;
    }
    m->emitted = m->len - held_suffix(m, m->buf, m->len);
    *out = m->buf;
    *out_len = m->emitted;
    return 0;
}

void rt_stop_flush(rt_stop *m, const char **out, size_t *out_len)
{
    *out = "";
    *out_len = 0;
    if (m->matched) return;
    *out = m->buf + m->emitted;
    *out_len = m->len - m->emitted;
    m->emitted = m->len;
}
