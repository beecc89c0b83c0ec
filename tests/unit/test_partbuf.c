/*
 * test_partbuf.c - the recycled part buffers (kvtransfer/partbuf.h): a released large buffer is
 * handed out again for a part of its size class and holds the whole part; small ones and ones
 * past the kept bound are not kept; the bound follows the most bytes out at once, between its
 * floor and its ceiling; buffers are 64-byte aligned, and 2 MiB aligned from 2 MiB up (their own
 * mappings, for huge pages). Under the sanitizer build a
 * write past what was asked for, a double release or a buffer lost on the way would fail here.
 * Run: ctest -R test_partbuf
 */
#include "kr_test.h"

#include "partbuf.h"

#include <stdint.h>
#include <string.h>

int main(void)
{
    const size_t mib = (size_t)1 << 20;
    CHECK(kt_partbuf_kept() == 0, "nothing kept at start: %zu", kt_partbuf_kept());

    uint8_t *a = kt_partbuf_alloc(3 * mib);
    REQUIRE(a, "3 MiB");
    CHECK(((uintptr_t)a & (2 * mib - 1)) == 0, "from 2 MiB up, 2 MiB aligned (huge pages): %p",
          (void *)a);
    memset(a, 0xab, 4 * mib); /* the class: 3 MiB rounds up to 4 */
    kt_partbuf_free(a);
    CHECK(kt_partbuf_kept() == 4 * mib, "the released 4 MiB class kept: %zu", kt_partbuf_kept());
    uint8_t *b = kt_partbuf_alloc(4 * mib - 7);
    CHECK(b == a, "the same class is handed out again (%p, was %p)", (void *)b, (void *)a);
    CHECK(kt_partbuf_kept() == 0, "and taken out of the cache: %zu", kt_partbuf_kept());
    uint8_t *c = kt_partbuf_alloc(5 * mib);
    REQUIRE(c, "5 MiB");
    CHECK(c != b, "another class, another buffer");
    memset(c, 1, 5 * mib);
    kt_partbuf_free(b);
    kt_partbuf_free(c);
    CHECK(kt_partbuf_kept() == 12 * mib, "4 + 8 MiB kept: %zu", kt_partbuf_kept());

    uint8_t *m = kt_partbuf_alloc(mib); /* a kept class below 2 MiB: from the heap */
    REQUIRE(m, "1 MiB");
    CHECK(((uintptr_t)m & 63) == 0, "64-byte aligned: %p", (void *)m);
    memset(m, 3, mib);
    kt_partbuf_free(m);
    CHECK(kt_partbuf_kept() == 13 * mib, "4 + 8 + 1 MiB kept: %zu", kt_partbuf_kept());
    uint8_t *s = kt_partbuf_alloc(1000);
    REQUIRE(s, "1000 bytes");
    CHECK(((uintptr_t)s & 63) == 0, "a small one is 64-byte aligned too");
    memset(s, 2, 1000);
    kt_partbuf_free(s);
    CHECK(kt_partbuf_kept() == 13 * mib, "a small buffer is not kept: %zu", kt_partbuf_kept());
    kt_partbuf_free(NULL);

    /* the bound follows the most bytes out at once: 40 buffers of 16 MiB out together raise it
     * from its floor to 640 MiB, and the kept bytes never exceed it */
    CHECK(kt_partbuf_keep_bound() == KT_PARTBUF_KEEP_MIN, "the bound starts at its floor: %zu",
          kt_partbuf_keep_bound());
    enum { N = 40 };
    uint8_t *big[N];
    for (int i = 0; i < N; i++) {
        big[i] = kt_partbuf_alloc(16 * mib);
        REQUIRE(big[i], "16 MiB number %d", i);
        big[i][16 * mib - 1] = (uint8_t)i;
    }
    for (int i = 0; i < N; i++) kt_partbuf_free(big[i]);
    const size_t bound = kt_partbuf_keep_bound();
    CHECK(bound == (size_t)N * 16 * mib, "the bound is the peak out: %zu", bound);
    CHECK(kt_partbuf_kept() <= bound && kt_partbuf_kept() >= bound - 16 * mib,
          "kept %zu of at most %zu", kt_partbuf_kept(), bound);

    /* and stops at its ceiling: five 1 GiB buffers (address space only: nothing is written past
     * each header) */
    uint8_t *huge[5];
    for (int i = 0; i < 5; i++) REQUIRE((huge[i] = kt_partbuf_alloc((size_t)1 << 30)), "1 GiB number %d", i);
    for (int i = 0; i < 5; i++) kt_partbuf_free(huge[i]);
    CHECK(kt_partbuf_keep_bound() == KT_PARTBUF_KEEP_MAX, "the bound stops at %zu: %zu",
          KT_PARTBUF_KEEP_MAX, kt_partbuf_keep_bound());
    CHECK(kt_partbuf_kept() <= KT_PARTBUF_KEEP_MAX, "kept %zu", kt_partbuf_kept());
    return kt_done("test_partbuf");
}
