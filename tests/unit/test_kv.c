/*
 * test_kv.c - the paged KV cache: blocks are handed out per (layer, KV head) as sequences grow,
 * growth is all or nothing when the pool runs short (with a message saying how many blocks were
 * missing), freeing a sequence returns every block, lengths are per head, entries read back as
 * written, and the window search finds the first entry past a position.
 */
#include "kr_test.h"

#include "kr-kv.h"

int main(void)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p;
    CHECK(kr_kv_pool_create(0, 16, 10, &p, err) == -1, "head_dim 0 accepted");
    CHECK_ERR_HAS(err, "head_dim");
    REQUIRE(kr_kv_pool_create(4, 4, 10, &p, err) == KR_OK, "%s", err);
    CHECK(kr_kv_blocks_for(p, 2, 2, 5) == 8, "5 tokens x 4 lists need 2 blocks each");

    kr_seq *a, *b;
    REQUIRE(kr_seq_create(p, 2, 2, &a, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_create(p, 2, 2, &b, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(a, 5, err) == KR_OK, "%s", err); /* 4 lists x 2 blocks */
    CHECK(kr_kv_pool_n_free(p) == 2, "free %d", kr_kv_pool_n_free(p));
    CHECK(kr_seq_grow(b, 1, err) == -1, "4 blocks taken from a pool with 2 free");
    CHECK_ERR_HAS(err, "4 more blocks needed, 2 free of 10");
    CHECK(kr_kv_pool_n_free(p) == 2 && kr_seq_blocks(b) == 0, "failed growth took blocks");

    /* write entries with distinct values per list; read back */
    float k[4], v[4];
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            kr_kv_list *list = kr_seq_list(a, l, h);
            list->len = 5;
            for (int i = 0; i < 5; i++) {
                for (int d = 0; d < 4; d++) k[d] = (float)(100 * l + 10 * h + i), v[d] = -k[d] - d;
                kr_seq_put(a, l, h, i, k, v, 3 * i);
            }
        }
    int ok = 1;
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            kr_kv_list *list = kr_seq_list(a, l, h);
            for (int i = 0; i < 5; i++) {
                ok &= kr_kv_list_key(p, list, i)[2] == (float)(100 * l + 10 * h + i);
                ok &= kr_kv_list_value(p, list, i)[3] == -(float)(100 * l + 10 * h + i) - 3;
                ok &= *kr_kv_list_pos(p, list, i) == 3 * i;
            }
            /* positions 0 3 6 9 12: first after 5 is index 2, after 12 is 5, after -1 is 0 */
            ok &= kr_kv_list_first_after(p, list, 5, 5) == 2;
            ok &= kr_kv_list_first_after(p, list, 5, 12) == 5;
            ok &= kr_kv_list_first_after(p, list, 5, -1) == 0;
            ok &= kr_kv_list_first_after(p, list, 3, 9) == 3;
        }
    CHECK(ok, "entries or window search wrong");
    CHECK(kr_seq_entries(a) == 20 && kr_seq_len(a, 1, 1) == 5 && kr_seq_len(a, 2, 0) == 0, "lengths");

    /* per-head lengths: shrink one list (as eviction will), growth accounts per list */
    kr_seq_list(a, 0, 0)->len = 1;
    CHECK(kr_seq_grow(a, 3, err) == KR_OK, "%s", err); /* 5 + 3 fits in the 2 blocks held */
    CHECK(kr_kv_pool_n_free(p) == 2 && kr_seq_blocks(a) == 8, "blocks %d free %d", kr_seq_blocks(a), kr_kv_pool_n_free(p));
    CHECK(kr_seq_grow(a, 4, err) == -1, "3 lists need a third block, 2 free");
    CHECK_ERR_HAS(err, "3 more blocks needed");

    kr_seq_free(a);
    CHECK(kr_kv_pool_n_free(p) == 10, "free after release %d", kr_kv_pool_n_free(p));

    /* keep_ends in both directions: 2 sinks + the newest 7 of 13 entries (head < tail: the
     * sinks move up, leading blocks go back, the offset absorbs the rest); then 3 + 1 (tail
     * moves down); growth after an offset; keep of an arbitrary subset */
    kr_seq *c;
    REQUIRE(kr_seq_create(p, 1, 1, &c, err) == KR_OK, "%s", err);
    REQUIRE(kr_seq_grow(c, 13, err) == KR_OK, "%s", err);
    kr_seq_list(c, 0, 0)->len = 13;
    for (int i = 0; i < 13; i++) {
        for (int d = 0; d < 4; d++) k[d] = (float)i, v[d] = (float)-i;
        kr_seq_put(c, 0, 0, i, k, v, i);
    }
    kr_seq_keep_ends(c, 0, 0, 2, 7);
    kr_kv_list *cl = kr_seq_list(c, 0, 0);
    const int want1[] = {0, 1, 6, 7, 8, 9, 10, 11, 12};
    ok = cl->len == 9 && cl->pinned == 2 && cl->n_blocks == 3 && kr_kv_pool_n_free(p) == 7;
    for (int i = 0; i < 9; i++)
        ok &= *kr_kv_list_pos(p, cl, i) == want1[i] && kr_kv_list_key(p, cl, i)[1] == (float)want1[i] &&
              kr_kv_list_value(p, cl, i)[0] == (float)-want1[i];
    CHECK(ok, "sinks moved up: len %d off %d blocks %d free %d", cl->len, cl->off, cl->n_blocks, kr_kv_pool_n_free(p));
    REQUIRE(kr_seq_grow(c, 2, err) == KR_OK, "%s", err);
    cl->len += 2;
    for (int i = 9; i < 11; i++) {
        for (int d = 0; d < 4; d++) k[d] = (float)(100 + i), v[d] = 0;
        kr_seq_put(c, 0, 0, i, k, v, 100 + i);
    }
    kr_seq_keep_ends(c, 0, 0, 3, 1);
    const int want2[] = {0, 1, 6, 110};
    ok = cl->len == 4 && cl->pinned == 3;
    for (int i = 0; i < 4; i++) ok &= *kr_kv_list_pos(p, cl, i) == want2[i];
    CHECK(ok, "tail moved down");
    const int32_t subset[] = {1, 3};
    kr_seq_keep(c, 0, 0, subset, 2, 1);
    CHECK(cl->len == 2 && *kr_kv_list_pos(p, cl, 0) == 1 && *kr_kv_list_pos(p, cl, 1) == 110 && cl->pinned == 1,
          "keep subset");
    kr_seq_free(c);
    CHECK(kr_kv_pool_n_free(p) == 10, "free after the offset list %d", kr_kv_pool_n_free(p));
    REQUIRE(kr_seq_grow(b, 8, err) == KR_OK, "%s", err); /* 4 lists x 2 blocks */
    kr_seq_free(b);
    kr_kv_pool_free(p);
    return kt_done("test_kv");
}
