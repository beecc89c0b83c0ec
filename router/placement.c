/* placement.c - round-robin, least-loaded and kv-aware orderings; see placement.h. */
#include "placement.h"

#include <string.h>

/* The node's distance from this turn's starting point: round-robin's order, and the tie-break
 * that lets equally loaded nodes take turns under least-loaded. */
static uint64_t rotation(int i, int n, uint64_t turn)
{
    return ((uint64_t)i + (uint64_t)n - turn % (uint64_t)n) % (uint64_t)n;
}

/* How an ordering weighs the loads. */
typedef enum rule {
    RULE_TURNS, /* round-robin */
    RULE_LOAD, /* least-loaded */
    RULE_COST, /* kv-aware: a prefill node's cost first, then as least-loaded */
} rule;

/* The prefill tokens node x would have to compute before this prompt's first token: what is
 * queued there plus the prompt less its predicted cached prefix. */
static uint64_t cost(const rt_load *x)
{
    return x->prefill_tokens + x->uncached_tokens;
}

/* -1 when node a goes before node b. */
static int compare(const rt_load *loads, int n, rt_role role, uint64_t turn, rule how, int a, int b)
{
    const rt_load *x = &loads[a], *y = &loads[b];
    if (x->healthy != y->healthy) return x->healthy ? -1 : 1;
    if (how == RULE_COST && role == RT_ROLE_PREFILL && cost(x) != cost(y)) return cost(x) < cost(y) ? -1 : 1;
    if (how != RULE_TURNS) {
        if (role == RT_ROLE_PREFILL) {
            if (x->prefill_tokens != y->prefill_tokens) return x->prefill_tokens < y->prefill_tokens ? -1 : 1;
            if (x->running != y->running) return x->running < y->running ? -1 : 1;
        } else {
            if (x->free_blocks != y->free_blocks) return x->free_blocks > y->free_blocks ? -1 : 1;
            if (x->running != y->running) return x->running < y->running ? -1 : 1;
        }
    }
    uint64_t ra = rotation(a, n, turn), rb = rotation(b, n, turn);
    return ra < rb ? -1 : ra > rb;
}

/* Insertion sort: a cluster has a handful of nodes, and this keeps the order stable. */
static void sort(const rt_load *loads, int n, rt_role role, uint64_t turn, rule how, int *order)
{
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++) {
        int v = order[i], j = i;
        while (j > 0 && compare(loads, n, role, turn, how, v, order[j - 1]) < 0) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
}

static void order_round_robin(const rt_load *loads, int n, rt_role role, uint64_t turn, int *order)
{
    sort(loads, n, role, turn, RULE_TURNS, order);
}

static void order_least_loaded(const rt_load *loads, int n, rt_role role, uint64_t turn, int *order)
{
    sort(loads, n, role, turn, RULE_LOAD, order);
}

static void order_kv_aware(const rt_load *loads, int n, rt_role role, uint64_t turn, int *order)
{
    sort(loads, n, role, turn, RULE_COST, order);
}

const rt_placement rt_placement_round_robin = {.name = "round-robin", .order = order_round_robin};
const rt_placement rt_placement_least_loaded = {.name = "least-loaded", .order = order_least_loaded};
const rt_placement rt_placement_kv_aware = {.name = "kv-aware", .order = order_kv_aware};

const rt_placement *rt_placement_by_name(const char *name)
{
    if (!strcmp(name, rt_placement_round_robin.name)) return &rt_placement_round_robin;
    if (!strcmp(name, rt_placement_least_loaded.name)) return &rt_placement_least_loaded;
    if (!strcmp(name, rt_placement_kv_aware.name)) return &rt_placement_kv_aware;
    return NULL;
}
