/*
 * test_router_breaker.c - the circuit breaker of router/breaker.c with a clock the test moves:
 * it opens after exactly `threshold` consecutive failures (a success in between starts the count
 * again); while open no call is allowed until the cooldown is over, then exactly one (the probe)
 * per cooldown; a failed probe re-opens it for another cooldown, a successful call closes it;
 * the return values say when it opened and closed.
 * No network. Run: ctest -R test_router_breaker.
 */
#include "kr_test.h"

#include "../../router/breaker.c"

static void opens_after_threshold(void)
{
    rt_breaker b = {0};
    CHECK(rt_breaker_record(&b, 1, 3, 1000, 0) == 0 && !b.open, "1 failure of 3");
    CHECK(rt_breaker_record(&b, 1, 3, 1000, 10) == 0 && !b.open, "2 failures of 3");
    CHECK(rt_breaker_record(&b, 0, 3, 1000, 20) == 0 && b.failures == 0, "a success resets the count");
    CHECK(rt_breaker_record(&b, 1, 3, 1000, 30) == 0 && rt_breaker_record(&b, 1, 3, 1000, 40) == 0, "2 again");
    CHECK(rt_breaker_allow(&b, 1000, 45) == 1, "closed: calls allowed");
    CHECK(rt_breaker_record(&b, 1, 3, 1000, 50) == 1 && b.open, "the 3rd consecutive failure opens it");
    CHECK(rt_breaker_record(&b, 1, 3, 1000, 60) == 0 && b.open, "more failures: still open, no second 'opened'");
    rt_breaker one = {0};
    CHECK(rt_breaker_record(&one, 1, 1, 500, 0) == 1, "threshold 1 opens at the first failure");
}

static void probes(void)
{
    rt_breaker b = {0};
    for (int i = 0; i < 3; i++) rt_breaker_record(&b, 1, 3, 1000, 100);
    REQUIRE(b.open, "open");
    CHECK(rt_breaker_allow(&b, 1000, 100) == 0, "no call right after opening");
    CHECK(rt_breaker_allow(&b, 1000, 1099) == 0, "none before the cooldown is over");
    CHECK(rt_breaker_allow(&b, 1000, 1100) == 1, "the probe when the cooldown is over");
    CHECK(rt_breaker_allow(&b, 1000, 1101) == 0, "only one probe per cooldown");
    CHECK(rt_breaker_record(&b, 1, 3, 1000, 1500) == 0 && b.open, "the probe failed: still open");
    CHECK(rt_breaker_allow(&b, 1000, 2400) == 0, "a failed probe starts another cooldown from its failure");
    CHECK(rt_breaker_allow(&b, 1000, 2500) == 1, "the next probe");
    CHECK(rt_breaker_record(&b, 0, 3, 1000, 2600) == -1 && !b.open && b.failures == 0, "a good probe closes it");
    CHECK(rt_breaker_allow(&b, 1000, 2601) == 1 && rt_breaker_allow(&b, 1000, 2602) == 1, "closed: every call allowed");
    CHECK(rt_breaker_record(&b, 0, 3, 1000, 2700) == 0, "a success while closed changes nothing");
    /* after closing it takes the full threshold again */
    CHECK(rt_breaker_record(&b, 1, 3, 1000, 2800) == 0 && !b.open, "one failure after closing does not re-open");
}

int main(void)
{
    opens_after_threshold();
    probes();
    return kt_done("test_router_breaker");
}
