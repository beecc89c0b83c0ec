/*
 * breaker.h - a node's circuit breaker (docs/failures.md): N consecutive failed calls open it
 * (the node is SUSPECT and gets no calls), after a cooldown one call is let through (the
 * half-open probe); any successful call closes it, a failure while open re-opens it for another
 * cooldown. Pure (the caller holds the lock and gives the clock): tested by
 * tests/unit/test_router_breaker.c.
 */
#ifndef RT_BREAKER_H
#define RT_BREAKER_H

#include <stdint.h>

typedef struct rt_breaker {
    int failures; /* consecutive failed calls */
    int open; /* 1: the node is suspect */
    int64_t probe_at_ms; /* while open: when the next probe may go */
} rt_breaker;

/* One call's outcome at `now_ms`. Returns 1 when this opened the breaker (it was closed), -1 when
 * it closed it (it was open), 0 otherwise. */
int rt_breaker_record(rt_breaker *b, int failed, int threshold, int64_t cooldown_ms, int64_t now_ms);

/* Whether a call may go to the node at `now_ms`: always while closed; while open only when the
 * cooldown is over, and then only once per cooldown (the probe: this moves probe_at_ms on). */
int rt_breaker_allow(rt_breaker *b, int64_t cooldown_ms, int64_t now_ms);

#endif /* RT_BREAKER_H */
