/*
 * metrics.h - Prometheus metrics: counters, gauges and histograms (optionally with one label,
 * e.g. status="OK"), registered once at start-up in a registry and rendered in the Prometheus
 * text exposition format (version 0.0.4) for /metrics (http.h serves it).
 * Updates are lock-free atomics, safe from any thread; registration and rendering take the
 * registry's lock (register at start-up anyway: a series that appears late confuses rate()).
 * Names follow Prometheus conventions: kvrelay_<what>_<unit>[_total]; docs/observability.md lists
 * the ones kvrelay's processes export.
 * Test: ctest -R test_metrics.
 */
#ifndef KC_METRICS_H
#define KC_METRICS_H

#include <stddef.h>
#include <stdint.h>

typedef struct kc_registry kc_registry;
typedef struct kc_counter kc_counter;
typedef struct kc_gauge kc_gauge;
typedef struct kc_histogram kc_histogram;

kc_registry *kc_registry_create(void); /* NULL when out of memory */
void kc_registry_free(kc_registry *r);

/* Registration: `name` and `help` are copied; `labels` is NULL, or one `key="value"` pair
 * (e.g. "role=\"prefill\"") printed inside {} on every sample. Registering the same name twice
 * with different labels gives one family with two series. NULL when out of memory or the name
 * is not a valid metric name.
 * Details: the value is the text between the first and the last double quote, taken literally
 * (rendering escapes \, " and newline in it); the label name must be [a-zA-Z_][a-zA-Z0-9_]* and
 * not start with "__" ("le" is refused on histograms). The same name, type and label again
 * returns the same metric (a histogram only with the same bounds); the same name with another
 * type is refused. The first registration's help text is the family's. */
kc_counter *kc_counter_add(kc_registry *r, const char *name, const char *help, const char *labels);
kc_gauge *kc_gauge_add(kc_registry *r, const char *name, const char *help, const char *labels);
/* `bounds` are the buckets' upper bounds, strictly increasing (+Inf is implicit); copied. */
kc_histogram *kc_histogram_add(kc_registry *r, const char *name, const char *help,
                               const char *labels, const double *bounds, int n_bounds);

void kc_counter_inc(kc_counter *c, double by); /* by >= 0 */
void kc_gauge_set(kc_gauge *g, double v);
void kc_gauge_inc(kc_gauge *g, double by); /* by may be negative */
void kc_histogram_observe(kc_histogram *h, double v); /* NaN is ignored */
/* A negative or NaN counter increment is ignored. NULL metrics are ignored by every update. */

/* Current values (tests, and status replies built from the same numbers as /metrics). */
double kc_counter_value(kc_counter *c);
double kc_gauge_value(kc_gauge *g);
/* 1 when `name` matches [a-zA-Z_:][a-zA-Z0-9_:]*. */
int kc_metric_name_valid(const char *name);

/* Latency buckets in seconds, 1 ms .. 60 s (1-2.5-5 steps to 10 s, then 30, 60), for TTFT,
 * TPOT and transfer histograms. */
extern const double kc_latency_buckets[];
extern const int kc_n_latency_buckets;

/* Renders every metric into a malloc'd NUL-terminated string (caller frees); NULL when out of
 * memory. *len_out (may be NULL) gets its length. */
char *kc_registry_render(kc_registry *r, size_t *len_out);

#endif /* KC_METRICS_H */
