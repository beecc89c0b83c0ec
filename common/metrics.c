/*
 * metrics.c - the Prometheus registry of metrics.h. Every value is an atomic: counters and gauges
 * hold a double as its uint64 bit pattern (compare-and-swap loops add to it), histograms hold one
 * atomic count per bucket (non-cumulative; summed when rendered) and their sum as bits. Updates
 * take no lock; registration and rendering share the registry's mutex, so a scrape never sees
 * the family table being grown.
 * Rendering follows the text exposition format 0.0.4: # HELP (backslash and newline escaped) and
 * # TYPE once per family, every series of the family after them, histograms as cumulative
 * _bucket{le=".."} samples ending with le="+Inf", then _sum and _count; label values escaped
 * (backslash, double quote, newline); numbers in the shortest form that reads back exactly,
 * +Inf/-Inf/NaN spelled as Prometheus parses them.
 * Not here: summaries, timestamps, more than one label per series, unregistering.
 * Test: ctest -R test_metrics.
 */
#include "metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { KIND_COUNTER, KIND_GAUGE, KIND_HISTOGRAM } metric_kind;

static const char *const kind_names[] = {"counter", "gauge", "histogram"};

struct kc_counter {
    _Atomic uint64_t bits; /* a double */
};

struct kc_gauge {
    _Atomic uint64_t bits; /* a double */
};

struct kc_histogram {
    double *bounds; /* [n_bounds] upper bounds, strictly increasing */
    int n_bounds;
    _Atomic uint64_t *counts;  /* [n_bounds + 1]: observations per bucket, the last one +Inf */
    _Atomic uint64_t sum_bits; /* a double */
};

/* One series: a metric and its label, kept as name and unescaped value. */
typedef struct {
    char *label_name; /* NULL: no label */
    char *label_value;
    void *metric; /* kc_counter / kc_gauge / kc_histogram by the family's kind */
} series;

typedef struct {
    char *name;
    char *help;
    metric_kind kind;
    series *series;
    int n_series;
} family;

struct kc_registry {
    pthread_mutex_t mu; /* guards the tables (not the values) */
    family *families;
    int n_families;
};

/* ------------------------------------------------------------------ doubles as atomic bits */

static uint64_t to_bits(double v)
{
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static double from_bits(uint64_t b)
{
    double v;
    memcpy(&v, &b, sizeof v);
    return v;
}

static void atomic_add_double(_Atomic uint64_t *bits, double by)
{
    uint64_t old = atomic_load_explicit(bits, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(bits, &old, to_bits(from_bits(old) + by),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

static double atomic_read_double(_Atomic uint64_t *bits)
{
    return from_bits(atomic_load_explicit(bits, memory_order_relaxed));
}

/* ------------------------------------------------------------------ updates */

void kc_counter_inc(kc_counter *c, double by)
{
    if (!c || !(by >= 0)) /* a counter only goes up; NaN is refused too */
        return;
    atomic_add_double(&c->bits, by);
}

void kc_gauge_set(kc_gauge *g, double v)
{
    if (g) atomic_store_explicit(&g->bits, to_bits(v), memory_order_relaxed);
}

void kc_gauge_inc(kc_gauge *g, double by)
{
    if (g) atomic_add_double(&g->bits, by);
}

void kc_histogram_observe(kc_histogram *h, double v)
{
    if (!h || isnan(v)) /* a NaN would turn _sum into NaN for good */
        return;
    /* the first bucket whose bound is >= v ("le"); n_bounds when none: the +Inf bucket */
    int lo = 0, hi = h->n_bounds;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (v <= h->bounds[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    atomic_fetch_add_explicit(&h->counts[lo], 1, memory_order_relaxed);
    atomic_add_double(&h->sum_bits, v);
}

double kc_counter_value(kc_counter *c)
{
    return c ? atomic_read_double(&c->bits) : 0;
}

double kc_gauge_value(kc_gauge *g)
{
    return g ? atomic_read_double(&g->bits) : 0;
}

/* 1-2.5-5 steps from 1 ms, then 30 s and 60 s: covers a TPOT of a few ms on a small model and a
 * TTFT of a long prompt queued behind others. */
const double kc_latency_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                     0.5,   1,      2.5,   5,    10,    30,   60};
const int kc_n_latency_buckets = (int)(sizeof kc_latency_buckets / sizeof kc_latency_buckets[0]);

/* ------------------------------------------------------------------ registration */

kc_registry *kc_registry_create(void)
{
    kc_registry *r = calloc(1, sizeof *r);
    if (r) pthread_mutex_init(&r->mu, NULL);
    return r;
}

static void metric_free(metric_kind kind, void *m)
{
    if (kind == KIND_HISTOGRAM && m) {
        kc_histogram *h = m;
        free(h->bounds);
        free(h->counts);
    }
    free(m);
}

void kc_registry_free(kc_registry *r)
{
    if (!r) return;
    for (int i = 0; i < r->n_families; i++) {
        family *f = &r->families[i];
        for (int j = 0; j < f->n_series; j++) {
            free(f->series[j].label_name);
            free(f->series[j].label_value);
            metric_free(f->kind, f->series[j].metric);
        }
        free(f->series);
        free(f->name);
        free(f->help);
    }
    free(r->families);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

int kc_metric_name_valid(const char *name)
{
    if (!name || !*name) return 0;
    for (const char *p = name; *p; p++) {
        int alpha = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' || *p == ':';
        int digit = *p >= '0' && *p <= '9';
        if (!alpha && !(digit && p != name)) return 0;
    }
    return 1;
}

/* A label name: [a-zA-Z_][a-zA-Z0-9_]*, and not one of the reserved __ names. */
static int label_name_valid(const char *s, size_t n)
{
    if (n == 0 || (n >= 2 && s[0] == '_' && s[1] == '_')) return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        int alpha = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_';
        if (!alpha && !(ch >= '0' && ch <= '9' && i > 0)) return 0;
    }
    return 1;
}

/* Splits `key="value"` into a malloc'd name and value (the bytes between the first quote and the
 * last one, taken literally: render escapes them). Returns 0, or -1 when malformed or no memory. */
static int parse_label(const char *labels, char **name_out, char **value_out)
{
    const char *eq = strchr(labels, '=');
    size_t len = strlen(labels);
    if (!eq || len < (size_t)(eq - labels) + 3 || eq[1] != '"' || labels[len - 1] != '"' ||
        !label_name_valid(labels, (size_t)(eq - labels)))
        return -1;
    const char *v = eq + 2;
    size_t vlen = (size_t)(labels + len - 1 - v);
    *name_out = strndup(labels, (size_t)(eq - labels));
    *value_out = strndup(v, vlen);
    if (!*name_out || !*value_out) {
        free(*name_out);
        free(*value_out);
        return -1;
    }
    return 0;
}

static int same_label(const series *s, const char *name, const char *value)
{
    if (!s->label_name || !name) return !s->label_name && !name;
    return strcmp(s->label_name, name) == 0 && strcmp(s->label_value, value) == 0;
}

static void *metric_new(metric_kind kind, const double *bounds, int n_bounds)
{
    if (kind != KIND_HISTOGRAM)
        return calloc(1, kind == KIND_COUNTER ? sizeof(kc_counter) : sizeof(kc_gauge));
    kc_histogram *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->n_bounds = n_bounds;
    h->bounds = malloc((size_t)(n_bounds ? n_bounds : 1) * sizeof *h->bounds);
    h->counts = calloc((size_t)n_bounds + 1, sizeof *h->counts);
    if (!h->bounds || !h->counts) {
        metric_free(KIND_HISTOGRAM, h);
        return NULL;
    }
    if (n_bounds) memcpy(h->bounds, bounds, (size_t)n_bounds * sizeof *bounds);
    return h;
}

static int bounds_equal(const kc_histogram *h, const double *bounds, int n_bounds)
{
    return h->n_bounds == n_bounds &&
           (n_bounds == 0 || memcmp(h->bounds, bounds, (size_t)n_bounds * sizeof *bounds) == 0);
}

/* Finds or adds the series; the same name, kind and label again gives the same metric. */
static void *metric_add(kc_registry *r, metric_kind kind, const char *name, const char *help,
                        const char *labels, const double *bounds, int n_bounds)
{
    if (!r || !kc_metric_name_valid(name)) return NULL;
    char *lname = NULL, *lvalue = NULL;
    void *m = NULL;
    if (labels && *labels && parse_label(labels, &lname, &lvalue) != 0) return NULL;
    if (kind == KIND_HISTOGRAM && lname && strcmp(lname, "le") == 0) /* le is the bucket's */
        goto err_label;
    pthread_mutex_lock(&r->mu);
    family *f = NULL;
    for (int i = 0; i < r->n_families && !f; i++)
        if (strcmp(r->families[i].name, name) == 0) f = &r->families[i];
    if (f && f->kind != kind) goto err_unlock;
    if (f) {
        for (int j = 0; j < f->n_series; j++)
            if (same_label(&f->series[j], lname, lvalue)) {
                m = f->series[j].metric;
                if (kind == KIND_HISTOGRAM && !bounds_equal(m, bounds, n_bounds)) m = NULL;
                goto err_unlock; /* found (or refused): nothing new to keep */
            }
    } else {
        family *fs = realloc(r->families, (size_t)(r->n_families + 1) * sizeof *fs);
        if (!fs) goto err_unlock;
        r->families = fs;
        f = &fs[r->n_families];
        *f = (family){.name = strdup(name), .help = strdup(help ? help : ""), .kind = kind};
        if (!f->name || !f->help) {
            free(f->name);
            free(f->help);
            goto err_unlock;
        }
        r->n_families++;
    }
    series *ss = realloc(f->series, (size_t)(f->n_series + 1) * sizeof *ss);
    if (!ss) goto err_unlock;
    f->series = ss;
    m = metric_new(kind, bounds, n_bounds);
    if (!m) goto err_unlock;
    ss[f->n_series++] = (series){.label_name = lname, .label_value = lvalue, .metric = m};
    pthread_mutex_unlock(&r->mu);
    return m;

err_unlock:
    pthread_mutex_unlock(&r->mu);
err_label:
    free(lname);
    free(lvalue);
    return m;
}

kc_counter *kc_counter_add(kc_registry *r, const char *name, const char *help, const char *labels)
{
    return metric_add(r, KIND_COUNTER, name, help, labels, NULL, 0);
}

kc_gauge *kc_gauge_add(kc_registry *r, const char *name, const char *help, const char *labels)
{
    return metric_add(r, KIND_GAUGE, name, help, labels, NULL, 0);
}

kc_histogram *kc_histogram_add(kc_registry *r, const char *name, const char *help,
                               const char *labels, const double *bounds, int n_bounds)
{
    if (n_bounds < 0 || (n_bounds > 0 && !bounds)) return NULL;
    for (int i = 0; i < n_bounds; i++)
        if (isnan(bounds[i]) || isinf(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
            return NULL;
    return metric_add(r, KIND_HISTOGRAM, name, help, labels, bounds, n_bounds);
}

/* ------------------------------------------------------------------ rendering */

typedef struct {
    char *buf;
    size_t len, cap;
    int oom;
} strbuf;

static void sb_reserve(strbuf *sb, size_t more)
{
    if (sb->oom || sb->len + more + 1 <= sb->cap) return;
    size_t cap = sb->cap ? sb->cap : 1024;
    while (cap < sb->len + more + 1)
        cap *= 2;
    char *b = realloc(sb->buf, cap);
    if (!b) {
        sb->oom = 1;
        return;
    }
    sb->buf = b;
    sb->cap = cap;
}

static void sb_put(strbuf *sb, const char *s, size_t n)
{
    sb_reserve(sb, n);
    if (sb->oom) return;
    memcpy(sb->buf + sb->len, s, n);
    sb->len += n;
    sb->buf[sb->len] = '\0';
}

static void sb_puts(strbuf *sb, const char *s)
{
    sb_put(sb, s, strlen(s));
}

/* Escapes backslash and newline (HELP text), and the double quote too for label values. */
static void sb_escaped(strbuf *sb, const char *s, int quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            sb_put(sb, "\\\\", 2);
        else if (*s == '\n')
            sb_put(sb, "\\n", 2);
        else if (*s == '"' && quote)
            sb_put(sb, "\\\"", 2);
        else
            sb_put(sb, s, 1);
    }
}

static int format_double(double v, char *out, size_t cap)
{
    if (isnan(v)) return snprintf(out, cap, "NaN");
    if (isinf(v)) return snprintf(out, cap, v > 0 ? "+Inf" : "-Inf");
    /* the shortest %g that reads back as the same double: 0.1 stays "0.1", 1/3 gets 17 digits */
    for (int prec = 15; prec <= 17; prec++) {
        int n = snprintf(out, cap, "%.*g", prec, v);
        if (prec == 17 || strtod(out, NULL) == v) return n;
    }
    return -1; /* not reached */
}

static void sb_double(strbuf *sb, double v)
{
    char num[40];
    format_double(v, num, sizeof num);
    sb_puts(sb, num);
}

static void sb_u64(strbuf *sb, uint64_t v)
{
    char num[24];
    snprintf(num, sizeof num, "%llu", (unsigned long long)v);
    sb_puts(sb, num);
}

/* name+suffix{label="value",le="bound"} with any of the label parts absent. */
static void sb_sample_name(strbuf *sb, const char *name, const char *suffix, const series *s,
                           const char *le)
{
    sb_puts(sb, name);
    sb_puts(sb, suffix);
    if (!s->label_name && !le) return;
    sb_put(sb, "{", 1);
    if (s->label_name) {
        sb_puts(sb, s->label_name);
        sb_put(sb, "=\"", 2);
        sb_escaped(sb, s->label_value, 1);
        sb_put(sb, "\"", 1);
        if (le) sb_put(sb, ",", 1);
    }
    if (le) {
        sb_put(sb, "le=\"", 4);
        sb_puts(sb, le);
        sb_put(sb, "\"", 1);
    }
    sb_put(sb, "}", 1);
}

static void render_histogram(strbuf *sb, const char *name, const series *s)
{
    kc_histogram *h = s->metric;
    uint64_t cumulative = 0;
    for (int b = 0; b <= h->n_bounds; b++) {
        char le[40];
        if (b < h->n_bounds)
            format_double(h->bounds[b], le, sizeof le);
        else
            snprintf(le, sizeof le, "+Inf");
        cumulative += atomic_load_explicit(&h->counts[b], memory_order_relaxed);
        sb_sample_name(sb, name, "_bucket", s, le);
        sb_put(sb, " ", 1);
        sb_u64(sb, cumulative);
        sb_put(sb, "\n", 1);
    }
    sb_sample_name(sb, name, "_sum", s, NULL);
    sb_put(sb, " ", 1);
    sb_double(sb, atomic_read_double(&h->sum_bits));
    sb_put(sb, "\n", 1);
    /* _count is the +Inf bucket read above, so the two always agree within one scrape */
    sb_sample_name(sb, name, "_count", s, NULL);
    sb_put(sb, " ", 1);
    sb_u64(sb, cumulative);
    sb_put(sb, "\n", 1);
}

char *kc_registry_render(kc_registry *r, size_t *len_out)
{
    strbuf sb = {0};
    sb_reserve(&sb, 4096);
    if (!r || sb.oom) {
        free(sb.buf);
        return NULL;
    }
    sb.buf[0] = '\0';
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n_families; i++) {
        const family *f = &r->families[i];
        if (f->help[0]) {
            sb_puts(&sb, "# HELP ");
            sb_puts(&sb, f->name);
            sb_put(&sb, " ", 1);
            sb_escaped(&sb, f->help, 0);
            sb_put(&sb, "\n", 1);
        }
        sb_puts(&sb, "# TYPE ");
        sb_puts(&sb, f->name);
        sb_put(&sb, " ", 1);
        sb_puts(&sb, kind_names[f->kind]);
        sb_put(&sb, "\n", 1);
        for (int j = 0; j < f->n_series; j++) {
            const series *s = &f->series[j];
            if (f->kind == KIND_HISTOGRAM) {
                render_histogram(&sb, f->name, s);
                continue;
            }
            sb_sample_name(&sb, f->name, "", s, NULL);
            sb_put(&sb, " ", 1);
            sb_double(&sb, f->kind == KIND_COUNTER ? kc_counter_value(s->metric)
                                                   : kc_gauge_value(s->metric));
            sb_put(&sb, "\n", 1);
        }
    }
    pthread_mutex_unlock(&r->mu);
    if (sb.oom) {
        free(sb.buf);
        return NULL;
    }
    if (len_out) *len_out = sb.len;
    return sb.buf;
}
