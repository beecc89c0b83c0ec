/*
 * test_metrics.c - common/metrics.h: the exact Prometheus text (0.0.4) of a small registry
 * (HELP escaping, TYPE once per family with two label series, escaped label values, cumulative
 * histogram buckets with +Inf, _sum, _count, +Inf/-Inf/NaN and shortest round-trip numbers),
 * histogram bucket edges (a value equal to a bound lands in that bound's bucket), exact totals
 * from concurrent updates, invalid names and labels refused, re-registration.
 * Not tested: parsing by a real Prometheus (docs/observability.md shows the scrape config).
 * Run: ctest -R test_metrics (well under a second).
 */
#include "kr_test.h"

#include "metrics.h"

#include <pthread.h>

#define N_THREADS 8
#define N_ITERS 20000

static void test_render_exact(void)
{
    kc_registry *r = kc_registry_create();
    REQUIRE(r, "registry");
    kc_counter *ok =
        kc_counter_add(r, "kvrelay_requests_total", "Requests by final status.", "status=\"OK\"");
    kc_counter *bad = kc_counter_add(r, "kvrelay_requests_total", "ignored: first help wins",
                                     "status=\"INVALID_ARGUMENT\"");
    kc_gauge *g =
        kc_gauge_add(r, "kvrelay_queue_depth", "Queued requests.\nSecond line \\ here.", NULL);
    kc_gauge *odd = kc_gauge_add(r, "odd_values", "", "path=\"a\"b\\c\nd\"");
    kc_gauge *ninf = kc_gauge_add(r, "odd_values", "", "k=\"ninf\"");
    kc_gauge *nan = kc_gauge_add(r, "odd_values", "", "k=\"nan\"");
    const double bounds[] = {0.1, 0.5, 1};
    kc_histogram *h =
        kc_histogram_add(r, "kvrelay_ttft_seconds", "Time to first token.", NULL, bounds, 3);
    REQUIRE(ok && bad && g && odd && ninf && nan && h, "registration");

    kc_counter_inc(ok, 3);
    kc_counter_inc(ok, 0.5);
    kc_counter_inc(bad, 1);
    kc_counter_inc(bad, -5);  /* refused: counters only go up */
    kc_counter_inc(bad, NAN); /* refused */
    kc_gauge_set(g, 7);
    kc_gauge_inc(g, -2);
    kc_gauge_set(odd, 1.0 / 0.0);
    kc_gauge_set(ninf, -1.0 / 0.0);
    kc_gauge_set(nan, NAN);
    kc_histogram_observe(h, 0.05);
    kc_histogram_observe(h, 0.1); /* le="0.1" includes 0.1 */
    kc_histogram_observe(h, 0.7);
    kc_histogram_observe(h, 3);
    kc_histogram_observe(h, NAN); /* ignored */

    const char *want = "# HELP kvrelay_requests_total Requests by final status.\n"
                       "# TYPE kvrelay_requests_total counter\n"
                       "kvrelay_requests_total{status=\"OK\"} 3.5\n"
                       "kvrelay_requests_total{status=\"INVALID_ARGUMENT\"} 1\n"
                       "# HELP kvrelay_queue_depth Queued requests.\\nSecond line \\\\ here.\n"
                       "# TYPE kvrelay_queue_depth gauge\n"
                       "kvrelay_queue_depth 5\n"
                       "# TYPE odd_values gauge\n"
                       "odd_values{path=\"a\\\"b\\\\c\\nd\"} +Inf\n"
                       "odd_values{k=\"ninf\"} -Inf\n"
                       "odd_values{k=\"nan\"} NaN\n"
                       "# HELP kvrelay_ttft_seconds Time to first token.\n"
                       "# TYPE kvrelay_ttft_seconds histogram\n"
                       "kvrelay_ttft_seconds_bucket{le=\"0.1\"} 2\n"
                       "kvrelay_ttft_seconds_bucket{le=\"0.5\"} 2\n"
                       "kvrelay_ttft_seconds_bucket{le=\"1\"} 3\n"
                       "kvrelay_ttft_seconds_bucket{le=\"+Inf\"} 4\n"
                       "kvrelay_ttft_seconds_sum 3.85\n"
                       "kvrelay_ttft_seconds_count 4\n";
    size_t len = 0;
    char *text = kc_registry_render(r, &len);
    REQUIRE(text, "render");
    CHECK(strcmp(text, want) == 0, "rendered:\n%s\nwanted:\n%s", text, want);
    CHECK(len == strlen(text), "len %zu vs %zu", len, strlen(text));
    free(text);

    /* a labelled histogram puts its label before le */
    kc_histogram *hl = kc_histogram_add(r, "kvrelay_batch_size", "Sequences per step.",
                                        "role=\"decode\"", bounds, 1);
    REQUIRE(hl, "labelled histogram");
    kc_histogram_observe(hl, 1.0 / 3.0);
    text = kc_registry_render(r, NULL);
    REQUIRE(text, "render");
    CHECK(strstr(text, "kvrelay_batch_size_bucket{role=\"decode\",le=\"0.1\"} 0\n"
                       "kvrelay_batch_size_bucket{role=\"decode\",le=\"+Inf\"} 1\n"
                       "kvrelay_batch_size_sum{role=\"decode\"} 0.3333333333333333\n"
                       "kvrelay_batch_size_count{role=\"decode\"} 1\n"),
          "labelled histogram:\n%s", text);
    free(text);
    kc_registry_free(r);
}

static void test_bucket_edges(void)
{
    kc_registry *r = kc_registry_create();
    kc_histogram *h =
        kc_histogram_add(r, "lat_seconds", "x", NULL, kc_latency_buckets, kc_n_latency_buckets);
    REQUIRE(h, "latency histogram");
    CHECK(kc_latency_buckets[0] == 0.001 && kc_latency_buckets[kc_n_latency_buckets - 1] == 60,
          "latency buckets span 1 ms .. 60 s");
    for (int i = 1; i < kc_n_latency_buckets; i++)
        CHECK(kc_latency_buckets[i] > kc_latency_buckets[i - 1], "bucket %d not increasing", i);
    /* every bound itself, and a hair above it */
    for (int i = 0; i < kc_n_latency_buckets; i++) {
        kc_histogram_observe(h, kc_latency_buckets[i]);
        kc_histogram_observe(h, nextafter(kc_latency_buckets[i], 1e9));
    }
    kc_histogram_observe(h, -1); /* below every bound: the first bucket */
    char *text = kc_registry_render(r, NULL);
    REQUIRE(text, "render");
    /* le=bound[i] holds: -1, bounds[0..i] and the hairs above bounds[0..i-1] = 2i + 2 */
    for (int i = 0; i < kc_n_latency_buckets; i++) {
        char le[64], line[128];
        snprintf(le, sizeof le, "%.15g", kc_latency_buckets[i]);
        snprintf(line, sizeof line, "lat_seconds_bucket{le=\"%s\"} %d\n", le, 2 * i + 2);
        CHECK(strstr(text, line), "missing '%s' in\n%s", line, text);
    }
    char line[128];
    snprintf(line, sizeof line, "lat_seconds_bucket{le=\"+Inf\"} %d\nlat_seconds_sum",
             2 * kc_n_latency_buckets + 1);
    CHECK(strstr(text, line), "missing '%s'", line);
    snprintf(line, sizeof line, "lat_seconds_count %d\n", 2 * kc_n_latency_buckets + 1);
    CHECK(strstr(text, line), "missing '%s'", line);
    free(text);
    kc_registry_free(r);
}

typedef struct {
    kc_counter *c;
    kc_gauge *g;
    kc_histogram *h;
} shared_metrics;

static void *hammer(void *arg)
{
    shared_metrics *m = arg;
    for (int i = 0; i < N_ITERS; i++) {
        kc_counter_inc(m->c, 1);
        kc_gauge_inc(m->g, (i & 1) ? -0.5 : 1.5);
        kc_histogram_observe(m->h, (double)(i % 4)); /* 0,1,2,3: exact in binary */
    }
    return NULL;
}

static void test_concurrency(void)
{
    kc_registry *r = kc_registry_create();
    const double bounds[] = {0.5, 1.5, 2.5};
    shared_metrics m = {
        kc_counter_add(r, "hits_total", "h", NULL),
        kc_gauge_add(r, "level", "l", NULL),
        kc_histogram_add(r, "obs", "o", NULL, bounds, 3),
    };
    REQUIRE(m.c && m.g && m.h, "registration");
    pthread_t t[N_THREADS];
    for (int i = 0; i < N_THREADS; i++)
        REQUIRE(pthread_create(&t[i], NULL, hammer, &m) == 0, "thread");
    /* scrapes while the writers run must not disturb them */
    for (int i = 0; i < 20; i++)
        free(kc_registry_render(r, NULL));
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(t[i], NULL);
    double total = (double)N_THREADS * N_ITERS;
    CHECK(kc_counter_value(m.c) == total, "counter %.17g != %.17g", kc_counter_value(m.c), total);
    CHECK(kc_gauge_value(m.g) == total / 2, "gauge %.17g != %.17g", kc_gauge_value(m.g), total / 2);
    char *text = kc_registry_render(r, NULL);
    REQUIRE(text, "render");
    char want[512];
    long q = (long)total / 4;
    snprintf(want, sizeof want,
             "obs_bucket{le=\"0.5\"} %ld\nobs_bucket{le=\"1.5\"} %ld\nobs_bucket{le=\"2.5\"} %ld\n"
             "obs_bucket{le=\"+Inf\"} %ld\nobs_sum %ld\nobs_count %ld\n",
             q, 2 * q, 3 * q, 4 * q, 6 * q, 4 * q);
    CHECK(strstr(text, want), "histogram totals: want\n%s\ngot\n%s", want, text);
    free(text);
    kc_registry_free(r);
}

static void test_refusals(void)
{
    kc_registry *r = kc_registry_create();
    const char *bad_names[] = {"", "1abc", "a-b", "a b", "é", "a.b", "x{}", NULL};
    for (int i = 0; bad_names[i]; i++) {
        CHECK(!kc_counter_add(r, bad_names[i], "h", NULL), "name '%s' accepted", bad_names[i]);
        CHECK(!kc_metric_name_valid(bad_names[i]), "'%s' valid", bad_names[i]);
    }
    CHECK(!kc_gauge_add(r, NULL, "h", NULL), "NULL name accepted");
    const char *good_names[] = {"a", "_a", ":a", "a:b_c9", "kvrelay_kv_blocks_used", NULL};
    for (int i = 0; good_names[i]; i++)
        CHECK(kc_metric_name_valid(good_names[i]), "'%s' invalid", good_names[i]);
    const char *bad_labels[] = {"status",         "status=OK", "=\"x\"",    "9s=\"x\"",
                                "__name__=\"x\"", "s=\"x",     "a-b=\"x\"", NULL};
    for (int i = 0; bad_labels[i]; i++)
        CHECK(!kc_counter_add(r, "c_total", "h", bad_labels[i]), "labels '%s' accepted",
              bad_labels[i]);
    const double up[] = {1, 2}, down[] = {2, 1}, same[] = {1, 1}, inf[] = {1, 1.0 / 0.0};
    CHECK(!kc_histogram_add(r, "h1", "h", NULL, down, 2), "decreasing bounds accepted");
    CHECK(!kc_histogram_add(r, "h1", "h", NULL, same, 2), "repeated bound accepted");
    CHECK(!kc_histogram_add(r, "h1", "h", NULL, inf, 2), "explicit +Inf bound accepted");
    CHECK(!kc_histogram_add(r, "h1", "h", "le=\"1\"", up, 2), "label le accepted on a histogram");

    /* re-registration: the same series again is the same metric; another type is refused */
    kc_counter *c1 = kc_counter_add(r, "c_total", "h", "k=\"v\"");
    kc_counter *c2 = kc_counter_add(r, "c_total", "h", "k=\"v\"");
    CHECK(c1 && c1 == c2, "same series twice gave %p and %p", (void *)c1, (void *)c2);
    CHECK(!kc_gauge_add(r, "c_total", "h", NULL), "a gauge under a counter's name accepted");
    kc_histogram *h1 = kc_histogram_add(r, "h1", "h", NULL, up, 2);
    CHECK(h1 && kc_histogram_add(r, "h1", "h", NULL, up, 2) == h1, "same histogram twice");
    CHECK(!kc_histogram_add(r, "h1", "h", NULL, up, 1), "same histogram with other bounds");
    char *text = kc_registry_render(r, NULL);
    REQUIRE(text, "render");
    const char *p = strstr(text, "# TYPE c_total counter");
    CHECK(p && !strstr(p + 1, "# TYPE c_total"), "TYPE once per family:\n%s", text);
    free(text);
    kc_registry_free(r);

    /* an empty registry renders as empty text; NULLs are harmless */
    r = kc_registry_create();
    size_t len = 99;
    text = kc_registry_render(r, &len);
    CHECK(text && len == 0 && text[0] == '\0', "empty registry");
    free(text);
    kc_registry_free(r);
    kc_registry_free(NULL);
    kc_counter_inc(NULL, 1);
    kc_gauge_set(NULL, 1);
    kc_histogram_observe(NULL, 1);
}

int main(void)
{
    test_render_exact();
    test_bucket_edges();
    test_concurrency();
    test_refusals();
    return kt_done("test_metrics");
}
