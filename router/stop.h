/*
 * stop.h - stop strings matched on the text a request generates, as it streams out in deltas.
 * Text that could still turn out to be the start of a stop string is held back until the next
 * delta settles it; a completed stop string ends the text just before it, or just after it when
 * the matcher includes stop strings (whatever followed it in the same delta is never emitted). The concatenation of everything
 * emitted plus rt_stop_flush is the generated text cut at the earliest stop string.
 * Deltas are complete UTF-8 characters (kr_detok) and stop strings valid UTF-8, so a held-back
 * suffix or a cut always falls on a character boundary.
 * Not thread-safe: one matcher per request. Pure (no I/O): tested by tests/unit/test_router_stop.c.
 */
#ifndef RT_STOP_H
#define RT_STOP_H

#include <stddef.h>

typedef struct rt_stop {
    char *const *stops; /* borrowed: must outlive the matcher */
    const size_t *stop_lens; /* owned copy of each stop's length */
    int n_stops;
    int include; /* a matched stop string is emitted, at the end of the text */
    char *buf; /* [emitted last call | held back] */
    size_t len, emitted, cap;
    int matched;
} rt_stop;

/* `stops` (n >= 0 non-empty strings) are borrowed; `include`: the text ends after the stop string
 * matched, not before it. Returns 0, or -1 when out of memory. */
int rt_stop_init(rt_stop *m, char *const *stops, int n, int include);
void rt_stop_free(rt_stop *m);
/* Feeds one delta. *out / *out_len get the text that may be emitted now (it points into the
 * matcher, valid until the next call). Returns 1 when a stop string completed (the output is the
 * text before it, or up to its end with `include`; later calls emit nothing and return 1), 0 when not, -1 when out of memory. */
int rt_stop_push(rt_stop *m, const char *delta, size_t len, const char **out, size_t *out_len);
/* The end of generation without a stop string: whatever was held back. */
void rt_stop_flush(rt_stop *m, const char **out, size_t *out_len);

#endif /* RT_STOP_H */
