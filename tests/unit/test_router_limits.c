/*
 * test_router_limits.c - the router's per-client limits (router/client-limits.c) with an
 * injected millisecond clock: the token bucket admits a burst, refuses the next with a retry hint
 * that is exactly when a token is back, refills at the rate and never above the burst; the
 * concurrency cap refuses the N+1th stream until one is released, a refusal takes nothing;
 * clients are counted apart; a key's own limits override the flags'; the flags and the key-file
 * options refuse bad values naming them; a full table drops idle clients and refuses only when
 * every tracked client is busy. No network, no wall clock.
 * Run: ctest -R test_router_limits.
 */
#include "kr_test.h"

#include <unistd.h>

#include "../../router/apikey.c"
#include "../../router/client-limits.c"

static rt_client client(const char *name, const rt_limit_conf *own)
{
    rt_client c = {0};
    snprintf(c.name, sizeof c.name, "%s", name);
    c.own = own;
    return c;
}

static void test_bucket(void)
{
    rt_limit_conf conf = {.rate = 2, .burst = 3}; /* 2/s: a token every 500 ms */
    rt_limits *l = rt_limits_create(&conf, 0);
    REQUIRE(l, "out of memory");
    rt_client a = client("key #1", NULL);
    int64_t t = 1000;
    for (int i = 0; i < 3; i++) {
        CHECK(rt_limits_acquire(l, &a, t) == RT_LIMIT_KIND_OK, "burst request %d refused", i + 1);
        rt_limits_release(l, &a);
    }
    CHECK(rt_limits_acquire(l, &a, t) == RT_LIMIT_KIND_RATE, "the request past the burst was admitted");
    CHECK(a.retry_after_ms == 500, "retry hint %lld ms, expected 500", (long long)a.retry_after_ms);
    CHECK(!a.held, "a refused request holds a slot");
    CHECK_ERR_HAS(a.refusal, "rate limit: key #1");
    CHECK_ERR_HAS(a.refusal, "retry after 500 ms");
    CHECK(rt_limits_acquire(l, &a, t + 499) == RT_LIMIT_KIND_RATE, "admitted 1 ms before a token is back");
    CHECK(a.retry_after_ms == 1, "retry hint %lld ms, expected 1", (long long)a.retry_after_ms);
    CHECK(rt_limits_acquire(l, &a, t + 500) == RT_LIMIT_KIND_OK, "refused once a token was back");
    rt_limits_release(l, &a);
    CHECK(rt_limits_acquire(l, &a, t + 500) == RT_LIMIT_KIND_RATE, "the token was used twice");
    /* a long quiet spell fills the bucket to the burst, no more */
    t += 100000;
    int admitted = 0;
    while (rt_limits_acquire(l, &a, t) == RT_LIMIT_KIND_OK && admitted < 10) {
        rt_limits_release(l, &a);
        admitted++;
    }
    CHECK(admitted == 3, "%d admitted after a quiet spell, expected the burst 3", admitted);
    /* another client has its own bucket */
    rt_client b = client("key #2", NULL);
    CHECK(rt_limits_acquire(l, &b, t) == RT_LIMIT_KIND_OK, "a second client was refused by the first's bucket");
    rt_limits_release(l, &b);
    /* a clock that goes back does not drain or fill */
    CHECK(rt_limits_acquire(l, &a, t - 5000) == RT_LIMIT_KIND_RATE, "a clock going back refilled the bucket");
    rt_limits_free(l);
}

static void test_concurrency(void)
{
    rt_limit_conf conf = {.concurrency = 2};
    rt_limits *l = rt_limits_create(&conf, 0);
    REQUIRE(l, "out of memory");
    rt_client s[3] = {client("peer 10.0.0.1", NULL), client("peer 10.0.0.1", NULL), client("peer 10.0.0.1", NULL)};
    rt_client other = client("peer 10.0.0.2", NULL);
    CHECK(rt_limits_acquire(l, &s[0], 0) == RT_LIMIT_KIND_OK && s[0].held, "stream 1 refused");
    CHECK(rt_limits_acquire(l, &s[1], 0) == RT_LIMIT_KIND_OK && s[1].held, "stream 2 refused");
    CHECK(rt_limits_acquire(l, &s[2], 0) == RT_LIMIT_KIND_CONCURRENCY, "stream 3 admitted over the cap 2");
    CHECK(s[2].retry_after_ms == RT_LIMIT_CONCURRENCY_RETRY_MS, "retry hint %lld", (long long)s[2].retry_after_ms);
    CHECK_ERR_HAS(s[2].refusal, "concurrency limit: peer 10.0.0.1 has 2 streams in flight");
    CHECK(rt_limits_in_flight(l, "peer 10.0.0.1") == 2, "in flight %d after a refusal", rt_limits_in_flight(l, "peer 10.0.0.1"));
    CHECK(rt_limits_acquire(l, &other, 0) == RT_LIMIT_KIND_OK, "another client refused by the first's streams");
    rt_limits_release(l, &s[2]); /* not held: nothing given back */
    CHECK(rt_limits_in_flight(l, "peer 10.0.0.1") == 2, "releasing a refused request gave a slot back");
    rt_limits_release(l, &s[0]);
    rt_limits_release(l, &s[0]); /* twice: once only */
    CHECK(rt_limits_in_flight(l, "peer 10.0.0.1") == 1, "in flight %d after one release", rt_limits_in_flight(l, "peer 10.0.0.1"));
    CHECK(rt_limits_acquire(l, &s[2], 0) == RT_LIMIT_KIND_OK, "refused after a stream ended");
    rt_limits_release(l, &s[1]);
    rt_limits_release(l, &s[2]);
    rt_limits_release(l, &other);
    CHECK(rt_limits_in_flight(l, "peer 10.0.0.1") == 0 && rt_limits_in_flight(l, "peer 10.0.0.2") == 0, "a slot leaked");
    rt_limits_free(l);
}

static void test_own_limits(void)
{
    rt_limit_conf conf = {.concurrency = 1, .rate = 1, .burst = 1};
    rt_limits *l = rt_limits_create(&conf, 0);
    REQUIRE(l, "out of memory");
    rt_limit_conf own = {.concurrency = 0, .rate = -1, .burst = 4}; /* no cap, the flag's rate, burst 4 */
    rt_client k[4];
    for (int i = 0; i < 4; i++) {
        k[i] = client("key #7", &own);
        CHECK(rt_limits_acquire(l, &k[i], 0) == RT_LIMIT_KIND_OK, "request %d of the key with its own limits refused", i + 1);
    }
    rt_client fifth = client("key #7", &own);
    CHECK(rt_limits_acquire(l, &fifth, 0) == RT_LIMIT_KIND_RATE, "past the key's own burst 4");
    CHECK(fifth.retry_after_ms == 1000, "retry hint %lld at the flag's rate 1/s", (long long)fifth.retry_after_ms);
    for (int i = 0; i < 4; i++) rt_limits_release(l, &k[i]);
    /* nothing limits anyone: nothing is tracked */
    rt_limit_conf none = {0};
    rt_limits *open = rt_limits_create(&none, 0);
    REQUIRE(open, "out of memory");
    rt_client c = client("peer x", NULL);
    CHECK(rt_limits_acquire(open, &c, 0) == RT_LIMIT_KIND_OK && !c.held, "an unlimited client holds a slot");
    rt_limits_free(open);
    rt_limits_free(l);
}

static void test_table_full(void)
{
    rt_limit_conf conf = {.concurrency = 5, .rate = 1, .burst = 2};
    rt_limits *l = rt_limits_create(&conf, 3);
    REQUIRE(l, "out of memory");
    rt_client c[5];
    char name[32];
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "peer %d", i);
        c[i] = client(name, NULL);
        CHECK(rt_limits_acquire(l, &c[i], 0) == RT_LIMIT_KIND_OK, "client %d refused", i);
    }
    c[3] = client("peer 3", NULL);
    CHECK(rt_limits_acquire(l, &c[3], 0) == RT_LIMIT_KIND_CLIENTS, "a 4th client fit a table of 3 busy ones");
    CHECK_ERR_HAS(c[3].refusal, "clients limit");
    rt_limits_release(l, &c[0]);
    CHECK(rt_limits_acquire(l, &c[3], 0) == RT_LIMIT_KIND_CLIENTS, "client 0 was dropped with a drained bucket");
    /* once client 0's bucket is full again it is the same as a new one: dropped for the newcomer */
    CHECK(rt_limits_acquire(l, &c[3], 1000) == RT_LIMIT_KIND_OK, "no room although client 0 is idle and full");
    CHECK(rt_limits_in_flight(l, "peer 1") == 1 && rt_limits_in_flight(l, "peer 2") == 1, "a busy client was dropped");
    for (int i = 1; i < 4; i++) rt_limits_release(l, &c[i]);
    rt_limits_free(l);
}

static void test_parsing(void)
{
    rt_limit_conf c = {0};
    char err[256];
    CHECK(rt_limits_flag(&c, "--limit-rate", "30/m", err, sizeof err) == 1 && c.rate == 0.5, "30/m -> %g", c.rate);
    CHECK(rt_limits_flag(&c, "--limit-rate", "5/s", err, sizeof err) == 1 && c.rate == 5, "5/s -> %g", c.rate);
    CHECK(rt_limits_flag(&c, "--limit-burst", "7", err, sizeof err) == 1 && c.burst == 7, "burst %g", c.burst);
    CHECK(rt_limits_flag(&c, "--limit-concurrency", "3", err, sizeof err) == 1 && c.concurrency == 3, "conc %ld", c.concurrency);
    CHECK(rt_limits_flag(&c, "--limit-other", "3", err, sizeof err) == 0, "an unknown --limit- flag taken");
    static const char *const bad_rates[] = {"", "x", "-1", "nan", "inf", "5/h", "5/", "1e9"};
    for (size_t i = 0; i < sizeof bad_rates / sizeof bad_rates[0]; i++) {
        err[0] = 0;
        CHECK(rt_limits_flag(&c, "--limit-rate", bad_rates[i], err, sizeof err) == -1, "rate '%s' accepted", bad_rates[i]);
        CHECK_ERR_HAS(err, "--limit-rate");
    }
    CHECK(rt_limits_flag(&c, "--limit-concurrency", "-2", err, sizeof err) == -1, "a negative cap accepted");
    CHECK_ERR_HAS(err, "--limit-concurrency: '-2'");
    CHECK(rt_limits_flag(&c, "--limit-burst", "2.5", err, sizeof err) == -1, "a fractional burst accepted");
    rt_limit_conf o = {-1, -1, -1};
    CHECK(rt_limit_option(&o, "rate=2", 6, err, sizeof err) == 0 && o.rate == 2, "rate=2");
    CHECK(rt_limit_option(&o, "burst=9 trailing", 7, err, sizeof err) == 0 && o.burst == 9, "burst=9 (length-bounded)");
    CHECK(rt_limit_option(&o, "concurrency=x", 13, err, sizeof err) == -1, "concurrency=x accepted");
    CHECK_ERR_HAS(err, "concurrency: 'x'");
    CHECK(rt_limit_option(&o, "s3cret-part", 11, err, sizeof err) == -1, "a bare word accepted");
    CHECK(strstr(err, "s3cret") == NULL, "the error '%s' echoes the word", err);
}

/* Limits in a key file, and the client names the router gives. */
static void test_key_file(void)
{
    char dir[] = "/tmp/kr_limits_XXXXXX";
    REQUIRE(mkdtemp(dir), "mkdtemp");
    char path[256];
    snprintf(path, sizeof path, "%s/keys", dir);
    FILE *f = fopen(path, "w");
    REQUIRE(f, "cannot write %s", path);
    fputs("plain-key\nfast-key  rate=100/s\tburst=50 concurrency=0 \nbad-key rate=often\n", f);
    fclose(f);
    const char *files[] = {path};
    rt_apikeys *k = NULL;
    char err[512] = "";
    CHECK(rt_apikeys_load(NULL, 0, files, 1, NULL, &k, err, sizeof err) == -1, "rate=often accepted");
    CHECK_ERR_HAS(err, "line 3, word 1 after the key: rate: 'often' is not a rate");
    f = fopen(path, "w");
    REQUIRE(f, "cannot write %s", path);
    fputs("plain-key\nfast-key  rate=100/s\tburst=50 concurrency=0 \n", f);
    fclose(f);
    REQUIRE(rt_apikeys_load(NULL, 0, files, 1, NULL, &k, err, sizeof err) == 0, "%s", err);
    rt_client c;
    rt_client_init(&c, k, "Bearer fast-key", 15, "10.0.0.9");
    CHECK(!strcmp(c.name, "key #2"), "name '%s'", c.name);
    CHECK(c.own && c.own->rate == 100 && c.own->burst == 50 && c.own->concurrency == 0, "fast-key's own limits");
    rt_client_init(&c, k, "Bearer plain-key", 16, "10.0.0.9");
    CHECK(!strcmp(c.name, "key #1") && c.own && c.own->rate < 0 && c.own->burst < 0 && c.own->concurrency < 0,
          "plain-key: '%s' with limits of its own", c.name);
    rt_client_init(&c, NULL, NULL, 0, "10.0.0.9");
    CHECK(!strcmp(c.name, "peer 10.0.0.9") && !c.own, "without keys: '%s'", c.name);
    rt_client_init(&c, NULL, NULL, 0, "");
    CHECK(!strcmp(c.name, "peer unknown"), "no address: '%s'", c.name);
    rt_apikeys_free(k);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    test_bucket();
    test_concurrency();
    test_own_limits();
    test_table_full();
    test_parsing();
    test_key_file();
    if (kt_failures) return 1;
    printf("test_router_limits: all checks passed\n");
    return 0;
}
