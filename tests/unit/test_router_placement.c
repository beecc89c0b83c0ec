/*
 * test_router_placement.c - the router's three placements (router/placement.c) on loads small
 * enough to check by hand: round-robin starts one node further per turn; least-loaded orders
 * prefill nodes by outstanding prefill tokens and decode nodes by free KV blocks, then running
 * sequences; equal nodes take turns; kv-aware orders prefill nodes by queued tokens + the prompt
 * tokens each would compute (the longest predicted prefix wins at equal load, a queue longer than
 * the saving loses to an idle node, ties fall to least-loaded's order) and is least-loaded when
 * no node holds a prefix (checked on random loads) and for decode nodes; nodes that failed their
 * last Status or are draining go last under all; the names map to the implementations.
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

/* a kv-aware load: healthy, `queued` prefill tokens, and `uncached` of the prompt to compute */
static rt_load kv(uint64_t queued, uint64_t uncached)
{
    return (rt_load){.healthy = 1, .prefill_tokens = queued, .uncached_tokens = uncached};
}

static void kv_aware(void)
{
    const rt_placement *p = &rt_placement_kv_aware;
    /* a 1000-token prompt: node 1 holds 512 of it, node 2 holds 768, node 0 nothing */
    rt_load l[3] = {kv(0, 1000), kv(0, 488), kv(0, 232)};
    for (uint64_t t = 0; t < 3; t++) check_order(p, l, 3, RT_ROLE_PREFILL, t, (int[]){2, 1, 0}, "longest prefix first");
    /* node 2's queue: below its saving over node 0 (768) it still wins; at it, the tie goes to
     * the emptier queue (least-loaded's order); past it, node 0 comes first */
    l[1].prefill_tokens = 1000;
    l[2].prefill_tokens = 767;
    check_order(p, l, 3, RT_ROLE_PREFILL, 0, (int[]){2, 0, 1}, "queue below the saving");
    l[2].prefill_tokens = 768;
    check_order(p, l, 3, RT_ROLE_PREFILL, 0, (int[]){0, 2, 1}, "queue equal to the saving: tie by queue");
    l[2].prefill_tokens = 5000;
    check_order(p, l, 3, RT_ROLE_PREFILL, 1, (int[]){0, 1, 2}, "queue past the saving: the idle node");
    /* equal cost and equal queue: turns */
    rt_load e[2] = {kv(100, 300), kv(100, 300)};
    check_order(p, e, 2, RT_ROLE_PREFILL, 0, (int[]){0, 1}, "equal, turn 0");
    check_order(p, e, 2, RT_ROLE_PREFILL, 1, (int[]){1, 0}, "equal, turn 1");
    /* an unhealthy node goes last whatever it holds */
    rt_load u[2] = {kv(0, 1000), kv(0, 0)};
    u[1].healthy = 0;
    check_order(p, u, 2, RT_ROLE_PREFILL, 0, (int[]){0, 1}, "unhealthy last");
    /* without a prefix anywhere (every node computes the whole prompt) and for decode nodes it is
     * least-loaded, on random loads and turns */
    uint64_t x = 12345;
    for (int trial = 0; trial < 2000; trial++) {
        rt_load r[5];
        int n = 1 + trial % 5;
        for (int i = 0; i < n; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            r[i] = (rt_load){.healthy = (x >> 60) != 0, .prefill_tokens = (x >> 8) % 4 * 100,
                             .free_blocks = (x >> 20) % 3, .running = (x >> 30) % 2, .uncached_tokens = 640};
        }
        for (int role = 0; role < 2; role++) {
            int a[5], b[5];
            p->order(r, n, (rt_role)role, (uint64_t)trial, a);
            rt_placement_least_loaded.order(r, n, (rt_role)role, (uint64_t)trial, b);
            CHECK(!memcmp(a, b, (size_t)n * sizeof *a), "trial %d (%s, %d nodes): kv-aware differs from least-loaded",
                  trial, role ? "decode" : "prefill", n);
        }
    }
}

static void names(void)
{
    CHECK(rt_placement_by_name("round-robin") == &rt_placement_round_robin, "round-robin");
    CHECK(rt_placement_by_name("least-loaded") == &rt_placement_least_loaded, "least-loaded");
    CHECK(rt_placement_by_name("kv-aware") == &rt_placement_kv_aware, "kv-aware");
    CHECK(rt_placement_by_name("random") == NULL, "unknown name");
    CHECK(rt_placement_by_name("") == NULL, "empty name");
}

int main(void)
{
    round_robin();
    least_loaded();
    kv_aware();
    names();
    return kt_done("test_router_placement");
}
