/*
 * policy-pyramid.c - PyramidKV adapted to chunked prefill: SnapKV's selection (policy-snapkv.c,
 * whose ops it shares) with the total budget spread over the layers by PyramidKV's schedule,
 * more entries in the lower layers (kr_pyramid_budget). With ratio=p the schedule is applied per
 * chunk with C = c + k, which is what PruLong's evaluation passes to PyramidKVCluster
 * (capacity_override); with budget=B it is applied to everything cached.
 */
#include "policy.h"

enum { PYRAMID_BETA = 20 }; /* PyramidKV's beta (PyramidKVCluster default, the paper's setting) */

int kr_pyramid_budget(int C, int W, int L, int layer, int n)
{
    if (n <= C) return n; /* PyramidKV: q_len < max_capacity_prompt keeps everything */
    if (n < 2 * (C - W)) return C; /* its middle branch: SnapKV's uniform C - W plus the window */
    int lo = (C - W) / PYRAMID_BETA, hi = 2 * (C - W) - lo;
    if (hi >= n - W) { /* clamped to the prompt: the first layer keeps it all */
        hi = n - W;
        lo = 2 * (C - W) - hi;
    }
    int steps = L > 1 ? (hi - lo) / (L - 1) : 0;
    return hi - layer * steps + W;
}

static int pyramidkv_init(kr_policy *p, char *err)
{
    return kr_snap_init(p, 1, err);
}

const kr_policy_ops kr_policy_pyramidkv = {
    .name = "pyramidkv",
    .init = pyramidkv_init,
    .set = kr_snap_set,
    .finish = kr_snap_finish,
    .appended = kr_snap_appended,
    .after_chunk = kr_snap_after_chunk,
    .max_entries = kr_snap_max_entries,
};
