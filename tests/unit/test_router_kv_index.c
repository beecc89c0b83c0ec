/*
 * test_router_kv_index.c - kv-aware placement's record of what was sent to a prefill node
 * (router/kv-index.c):
 *   - a prompt's chain: blocks that end below its last token only ((n - 1) / chunk of them), each
 *     hash chained to the one before with common/chain-hash.h over exactly that block (the
 *     prefill node's pf_cache_hash), prompts that share blocks share their hashes, another policy
 *     or another block changes them;
 *   - match: the leading blocks held, stopping at the first missing one;
 *   - LRU: at capacity the least recently used blocks go, the deepest of a prompt first, so what
 *     is kept is always a whole prefix; a prompt sent again is kept over one sent once;
 *   - clear forgets everything and the index works on.
 * No network. Run: ctest -R test_router_kv_index.
 */
#include "kr_test.h"

#include "../../router/kv-index.c"

/* n tokens of prompt `seed`, the first `shared` of them those of seed 0 */
static void prompt(int32_t *t, int n, int seed, int shared)
{
    for (int i = 0; i < n; i++) t[i] = i < shared ? 1 + i * 7 : 1000 * seed + i * 13;
}

static void chains(void)
{
    int32_t a[200], b[200];
    prompt(a, 200, 0, 200);
    rt_chain c;
    REQUIRE(rt_chain_make("full", 32, a, 96, &c) == 0, "chain");
    CHECK(c.m == 2 && c.chunk == 32, "96 tokens in 32s: %d blocks below the end, want 2", c.m);
    rt_chain_free(&c);
    REQUIRE(rt_chain_make("full", 32, a, 97, &c) == 0, "chain");
    CHECK(c.m == 3, "97 tokens: %d blocks, want 3", c.m);
    uint64_t h0 = kc_hash_mix(kc_hash_bytes(KC_HASH_SEED, "full", 5));
    CHECK(c.h[0] == kc_chain_hash(h0, a, 32), "block 1: the policy's hash chained with its tokens");
    CHECK(c.h[2] == kc_chain_hash(c.h[1], a + 64, 32), "block 3 chained to block 2 over tokens 64..95");
    rt_chain_free(&c);
    REQUIRE(rt_chain_make("full", 32, a, 32, &c) == 0 && c.m == 0 && !c.h, "one chunk: nothing to reuse");
    rt_chain_free(&c);

    /* b shares a's first 70 tokens: two whole blocks, the third differs */
    prompt(b, 200, 1, 70);
    rt_chain ca, cb, cs, ck;
    REQUIRE(rt_chain_make("full", 32, a, 200, &ca) == 0 && rt_chain_make("full", 32, b, 200, &cb) == 0, "chains");
    CHECK(ca.h[0] == cb.h[0] && ca.h[1] == cb.h[1] && ca.h[2] != cb.h[2], "shared blocks hash alike, the next not");
    REQUIRE(rt_chain_make("streaming:sink=4,window=16", 32, a, 200, &cs) == 0, "chain");
    CHECK(cs.h[0] != ca.h[0], "another policy: another chain");
    REQUIRE(rt_chain_make("full", 16, a, 200, &ck) == 0, "chain");
    CHECK(ck.m == 12 && ck.h[1] != ca.h[0], "another block size: another chain (%d blocks)", ck.m);

    rt_kv_index *x = rt_kv_index_create(100);
    REQUIRE(x, "index");
    CHECK(rt_kv_index_match(x, &ca) == 0 && rt_kv_index_size(x) == 0, "empty");
    rt_kv_index_insert(x, &ca);
    CHECK(rt_kv_index_size(x) == 6, "a's 6 blocks held: %d", rt_kv_index_size(x));
    CHECK(rt_kv_index_match(x, &ca) == 6, "a matches whole");
    CHECK(rt_kv_index_match(x, &cb) == 2, "b matches its 2 shared blocks: %d", rt_kv_index_match(x, &cb));
    CHECK(rt_kv_index_match(x, &cs) == 0, "the same tokens under another policy: none");
    rt_kv_index_insert(x, &cb);
    CHECK(rt_kv_index_size(x) == 10, "b adds its 4 own blocks: %d", rt_kv_index_size(x));
    rt_kv_index_clear(x);
    CHECK(rt_kv_index_size(x) == 0 && rt_kv_index_match(x, &ca) == 0, "cleared");
    rt_kv_index_insert(x, &cb);
    CHECK(rt_kv_index_match(x, &cb) == 6 && rt_kv_index_match(x, &ca) == 2, "works after a clear");
    rt_kv_index_free(x);
    rt_chain_free(&ca);
    rt_chain_free(&cb);
    rt_chain_free(&cs);
    rt_chain_free(&ck);
}

static void lru(void)
{
    /* prompts of 6 blocks each (193 tokens in 32s), 10 blocks of room */
    int32_t t[4][193];
    rt_chain c[4];
    for (int k = 0; k < 4; k++) {
        prompt(t[k], 193, k + 1, 0);
        REQUIRE(rt_chain_make("full", 32, t[k], 193, &c[k]) == 0 && c[k].m == 6, "chain %d", k);
    }
    rt_kv_index *x = rt_kv_index_create(10);
    REQUIRE(x, "index");
    rt_kv_index_insert(x, &c[0]);
    rt_kv_index_insert(x, &c[1]); /* 12 blocks for 10: c[0]'s two deepest go */
    CHECK(rt_kv_index_size(x) == 10, "at capacity: %d", rt_kv_index_size(x));
    CHECK(rt_kv_index_match(x, &c[1]) == 6, "the newest prompt whole: %d", rt_kv_index_match(x, &c[1]));
    CHECK(rt_kv_index_match(x, &c[0]) == 4, "the older one keeps its first 4 blocks: %d", rt_kv_index_match(x, &c[0]));
    rt_kv_index_insert(x, &c[0]); /* sent again: whole, most recent; c[1] loses its deepest */
    CHECK(rt_kv_index_match(x, &c[0]) == 6 && rt_kv_index_match(x, &c[1]) == 4, "a prompt sent again is kept: %d %d",
          rt_kv_index_match(x, &c[0]), rt_kv_index_match(x, &c[1]));
    rt_kv_index_insert(x, &c[2]);
    rt_kv_index_insert(x, &c[3]);
    CHECK(rt_kv_index_match(x, &c[3]) == 6 && rt_kv_index_match(x, &c[2]) == 4 && rt_kv_index_match(x, &c[0]) == 0 &&
              rt_kv_index_size(x) == 10,
          "the least recently used go first: %d %d %d", rt_kv_index_match(x, &c[3]), rt_kv_index_match(x, &c[2]),
          rt_kv_index_match(x, &c[0]));
    /* a prompt longer than the index keeps its first blocks */
    int32_t big[400];
    prompt(big, 400, 9, 0);
    rt_chain cbig;
    REQUIRE(rt_chain_make("full", 32, big, 400, &cbig) == 0 && cbig.m == 12, "big chain");
    rt_kv_index_insert(x, &cbig);
    CHECK(rt_kv_index_match(x, &cbig) == 10 && rt_kv_index_size(x) == 10, "12 blocks for 10: the first 10 kept: %d",
          rt_kv_index_match(x, &cbig));
    rt_chain_free(&cbig);
    for (int k = 0; k < 4; k++) rt_chain_free(&c[k]);
    rt_kv_index_free(x);
    CHECK(rt_kv_index_create(0) == NULL, "no room: refused");
    rt_kv_index_free(NULL);
}

int main(void)
{
    chains();
    lru();
    return kt_done("test_router_kv_index");
}
