/*
 * placement.h - which node a request goes to: one interface, three implementations.
 *   round-robin   nodes in turn, starting one further for each request;
 *   least-loaded  prefill: fewest outstanding prefill tokens; decode: most free KV blocks, then
 *                 fewest running sequences (DESIGN.md section 2);
 *   kv-aware      prefill: lowest cost = outstanding prefill tokens + the prompt tokens the node
 *                 would still compute (the prompt less the prefix its prefix cache is predicted
 *                 to hold), ties as least-loaded; decode: as least-loaded (docs/prefix-cache.md,
 *                 "Placement"). Without a predicted prefix on any node it is least-loaded.
 * A placement does not pick one node: it orders all of them, best first, and the router tries
 * them in that order (a decode node that answers RESOURCE_EXHAUSTED or UNAVAILABLE sends the
 * request to the next). Under both, nodes whose last Status failed or that are draining go last,
 * so they are tried only when every healthy node refused.
 * The loads come from the router (nodes.c: each node's last Status plus the router's own
 * in-flight changes since). Pure: tested by tests/unit/test_router_placement.c.
 */
#ifndef RT_PLACEMENT_H
#define RT_PLACEMENT_H

#include <stdint.h>

typedef enum rt_role {
    RT_ROLE_PREFILL = 0,
    RT_ROLE_DECODE = 1,
} rt_role;

/* One node's load as placement sees it. */
typedef struct rt_load {
    int healthy; /* answered its last Status and is serving (not draining) */
    uint64_t prefill_tokens; /* prefill nodes: prompt tokens queued or being prefilled */
    uint64_t free_blocks; /* decode nodes: KV blocks neither used nor reserved */
    uint64_t running; /* sequences running (decode) or requests in the queue (prefill) */
    uint64_t uncached_tokens; /* prefill nodes, kv-aware: the prompt's tokens less the prefix
                                 this node's cache is predicted to hold */
} rt_load;

typedef struct rt_placement {
    const char *name;
    /* Fills order[0, n) with the indices 0..n-1 of `loads`, best first. `turn` is a counter the
     * caller advances once per placement of `role`: round-robin's starting point, and
     * least-loaded's tie-break (equal nodes take turns). */
    void (*order)(const rt_load *loads, int n, rt_role role, uint64_t turn, int *order);
} rt_placement;

extern const rt_placement rt_placement_round_robin;
extern const rt_placement rt_placement_least_loaded;
extern const rt_placement rt_placement_kv_aware;

/* "round-robin", "least-loaded" or "kv-aware"; NULL for anything else. */
const rt_placement *rt_placement_by_name(const char *name);

#endif /* RT_PLACEMENT_H */
