/* breaker.c - a node's circuit breaker; see breaker.h. */
#include "breaker.h"

int rt_breaker_record(rt_breaker *b, int failed, int threshold, int64_t cooldown_ms, int64_t now_ms)
{
    if (!failed) {
        int was_open = b->open;
        b->failures = 0;
        b->open = 0;
        return was_open ? -1 : 0;
    }
    b->failures++;
    if (b->open) { /* the probe failed: another cooldown */
        b->probe_at_ms = now_ms + cooldown_ms;
        return 0;
    }
    if (b->failures < threshold) return 0;
    b->open = 1;
    b->probe_at_ms = now_ms + cooldown_ms;
    return 1;
}

int rt_breaker_allow(rt_breaker *b, int64_t cooldown_ms, int64_t now_ms)
{
    if (!b->open) return 1;
    if (now_ms < b->probe_at_ms) return 0;
    b->probe_at_ms = now_ms + cooldown_ms; /* one probe per cooldown */
    return 1;
}
