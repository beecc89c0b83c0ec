/*
 * test_router_placement.c - the router's two placements (router/placement.c) on loads small
 * enough to check by hand: round-robin starts one node further per turn; least-loaded orders
 * prefill nodes by outstanding prefill tokens and decode nodes by free KV blocks, then running
 * sequences; equal nodes take turns; nodes that failed their last Status or are draining go last
 * under both; the names map to the implementations.
 * No network. Run: ctest -R test_router_placement.
 */
#include "kr_test.h"

#include "../../router/placement.c"

static void check_order(const rt_placement *p, const rt_load *loads, int n, rt_role role, uint64_t turn,
                        const int *want, const char *what)
{
    int got[8];
    p->order(loads, n, role, turn, got);
    char g[64] = "", w[64] = "";
    for (int i = 0; i < n; i++) {
        snprintf(g + strlen(g), sizeof g - strlen(g), "%d ", got[i]);
        snprintf(w + strlen(w), sizeof w - strlen(w), "%d ", want[i]);
    }
    CHECK(!strcmp(g, w), "%s (%s, turn %llu): got %s, want %s", what, p->name, (unsigned long long)turn, g, w);
}

static void round_robin(void)
{
    const rt_placement *p = &rt_placement_round_robin;
    rt_load l[3] = {{.healthy = 1, .prefill_tokens = 900}, {.healthy = 1}, {.healthy = 1, .free_blocks = 5}};
    /* loads do not matter to round-robin */
    check_order(p, l, 3, RT_ROLE_PREFILL, 0, (int[]){0, 1, 2}, "turn 0");
    check_order(p, l, 3, RT_ROLE_PREFILL, 1, (int[]){1, 2, 0}, "turn 1");
    check_order(p, l, 3, RT_ROLE_DECODE, 5, (int[]){2, 0, 1}, "turn 5");
    /* an unhealthy node goes last, the others keep their turn order */
    l[1].healthy = 0;
    check_order(p, l, 3, RT_ROLE_DECODE, 1, (int[]){2, 0, 1}, "node 1 unhealthy");
    check_order(p, l, 3, RT_ROLE_DECODE, 0, (int[]){0, 2, 1}, "node 1 unhealthy, turn 0");
    rt_load one = {.healthy = 1};
    check_order(p, &one, 1, RT_ROLE_PREFILL, 7, (int[]){0}, "one node");
}

static void least_loaded(void)
{
    const rt_placement *p = &rt_placement_least_loaded;
    /* prefill: fewest outstanding tokens first, whatever the turn */
    rt_load pl[3] = {{.healthy = 1, .prefill_tokens = 500},
                     {.healthy = 1, .prefill_tokens = 20},
                     {.healthy = 1, .prefill_tokens = 100}};
    check_order(p, pl, 3, RT_ROLE_PREFILL, 0, (int[]){1, 2, 0}, "prefill by tokens");
    check_order(p, pl, 3, RT_ROLE_PREFILL, 2, (int[]){1, 2, 0}, "prefill by tokens, turn 2");
    /* equal tokens: fewer queued/running first, then take turns */
    pl[0].prefill_tokens = 20;
    pl[0].running = 1;
    check_order(p, pl, 3, RT_ROLE_PREFILL, 0, (int[]){1, 0, 2}, "prefill tie on tokens, by running");
    pl[0].running = 0;
    check_order(p, pl, 3, RT_ROLE_PREFILL, 0, (int[]){0, 1, 2}, "prefill tie, turn 0");
    check_order(p, pl, 3, RT_ROLE_PREFILL, 1, (int[]){1, 0, 2}, "prefill tie, turn 1");
    /* decode: most free blocks first; free-block ties by fewest running; then turns */
    rt_load dl[4] = {{.healthy = 1, .free_blocks = 10, .running = 0},
                     {.healthy = 1, .free_blocks = 80, .running = 9},
                     {.healthy = 1, .free_blocks = 80, .running = 2},
                     {.healthy = 1, .free_blocks = 300, .running = 50}};
    check_order(p, dl, 4, RT_ROLE_DECODE, 0, (int[]){3, 2, 1, 0}, "decode by free blocks, running");
    /* the emptiest node failed its Status: it goes last */
    dl[3].healthy = 0;
    check_order(p, dl, 4, RT_ROLE_DECODE, 0, (int[]){2, 1, 0, 3}, "decode, node 3 unhealthy");
    /* the prefill tokens do not matter to decode, nor free blocks to prefill */
    rt_load mix[2] = {{.healthy = 1, .free_blocks = 1, .prefill_tokens = 0},
                      {.healthy = 1, .free_blocks = 2, .prefill_tokens = 9}};
    check_order(p, mix, 2, RT_ROLE_DECODE, 0, (int[]){1, 0}, "decode ignores prefill tokens");
    check_order(p, mix, 2, RT_ROLE_PREFILL, 0, (int[]){0, 1}, "prefill ignores free blocks");
}

static void names(void)
{
    CHECK(rt_placement_by_name("round-robin") == &rt_placement_round_robin, "round-robin");
    CHECK(rt_placement_by_name("least-loaded") == &rt_placement_least_loaded, "least-loaded");
    CHECK(rt_placement_by_name("random") == NULL, "unknown name");
    CHECK(rt_placement_by_name("") == NULL, "empty name");
}

int main(void)
{
    round_robin();
    least_loaded();
    names();
    return kt_done("test_router_placement");
}
