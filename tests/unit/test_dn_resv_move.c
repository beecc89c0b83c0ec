/*
 * test_dn_resv_move.c - dn_resv_move (decode-node/resv.c) makes exactly the reservation moves
 * WAITING -> READY, WAITING -> FAILED and READY -> DECODING, and refuses every other one,
 * leaving the state as it was.
 * Run: ctest -R test_dn_resv_move (under a second).
 */
#include "kr_test.h"

#include "../../decode-node/import.c"
#include "../../decode-node/loop.c"
#include "../../decode-node/resv.c"

int main(void)
{
    kc_log_init("decode", KC_LOG_ERROR + 1); /* the refusals are expected: keep them quiet */
    static const char *const name[] = {"WAITING", "READY", "FAILED", "DECODING"};
    for (int from = DN_RESV_WAITING; from <= DN_RESV_DECODING; from++) {
        for (int to = DN_RESV_WAITING; to <= DN_RESV_DECODING; to++) {
            dn_resv r = {.id = 1, .state = (dn_resv_state)from};
            const int legal = (from == DN_RESV_WAITING && (to == DN_RESV_READY || to == DN_RESV_FAILED)) ||
                              (from == DN_RESV_READY && to == DN_RESV_DECODING);
            int rc = dn_resv_move(&r, (dn_resv_state)to);
            CHECK(rc == (legal ? 0 : -1), "%s -> %s returned %d", name[from], name[to], rc);
            CHECK(r.state == (dn_resv_state)(legal ? to : from), "%s -> %s left %s", name[from],
                  name[to], name[r.state]);
        }
    }
    return kt_failures ? 1 : 0;
}
