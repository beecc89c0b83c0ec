/*
 * test_router_stop.c - the router's stop-string matcher (router/stop.c) on hand-checked cases:
 * a stop string split over deltas, a held-back prefix that turns out not to be one, the earliest
 * of several stops, overlapping prefixes ("aab" in "aaab"), multi-byte UTF-8, flush, nothing after
 * a match; with include_stop_str_in_output the stop string ends the text; then a randomized
 * comparison with a direct reference (cut the whole text at the earliest occurrence once a delta
 * completes one) over random texts, stops and delta splits, which
 * also checks that no more than the longest stop minus one byte is ever held back.
 * No network. Run: ctest -R test_router_stop.
 */
#include "kr_test.h"

#include <stdint.h>

#include "../../router/stop.c"

/* Feeds `deltas` (NULL-terminated) and returns everything emitted (static buffer); *matched
 * gets whether a stop string completed. */
static const char *run(char *const *stops, int n_stops, int include, const char *const *deltas, int *matched)
{
    static char out[1024];
    size_t len = 0;
    rt_stop m;
    REQUIRE(rt_stop_init(&m, stops, n_stops, include) == 0, "init");
    *matched = 0;
    for (int i = 0; deltas[i]; i++) {
        const char *e;
        size_t elen;
        int rc = rt_stop_push(&m, deltas[i], strlen(deltas[i]), &e, &elen);
        REQUIRE(rc >= 0, "push");
        memcpy(out + len, e, elen);
        len += elen;
        if (rc == 1) *matched = 1;
    }
    const char *e;
    size_t elen;
    rt_stop_flush(&m, &e, &elen);
    memcpy(out + len, e, elen);
    len += elen;
    out[len] = 0;
    rt_stop_free(&m);
    return out;
}

/* the same with include_stop_str_in_output */
#define CASE_INC(stops_init, want, want_matched, ...)                                              \
    do {                                                                                           \
        char *stops[] = stops_init;                                                                \
        const char *deltas[] = {__VA_ARGS__, NULL};                                                \
        int matched;                                                                               \
        const char *got = run(stops, (int)(sizeof stops / sizeof *stops), 1, deltas, &matched);    \
        CHECK(!strcmp(got, want), "emitted '%s', want '%s'", got, want);                           \
        CHECK(matched == want_matched, "matched %d, want %d (want '%s')", matched, want_matched, want); \
    } while (0)

#define CASE(stops_init, want, want_matched, ...)                                                  \
    do {                                                                                           \
        char *stops[] = stops_init;                                                                \
        const char *deltas[] = {__VA_ARGS__, NULL};                                                \
        int matched;                                                                               \
        const char *got = run(stops, (int)(sizeof stops / sizeof *stops), 0, deltas, &matched);    \
        CHECK(!strcmp(got, want), "emitted '%s', want '%s'", got, want);                           \
        CHECK(matched == want_matched, "matched %d, want %d (want '%s')", matched, want_matched, want); \
    } while (0)

#define S(...) {__VA_ARGS__}

static void hand_cases(void)
{
    /* include_stop_str_in_output: the text ends after the stop string, split or not, and the
     * earliest match's own string is the one kept */
    CASE_INC(S("###"), "ab###", 1, "ab#", "#", "#cd", "more");
    CASE_INC(S("cd", "bcd"), "abcd", 1, "abcdef");
    CASE_INC(S("xyz"), "abc", 0, "ab", "c");
    /* a stop string split over three deltas: nothing of it is emitted, nor what follows */
    CASE(S("###"), "ab", 1, "ab#", "#", "#cd", "more");
    /* a held-back "#" that is not a stop after all comes out with the next delta */
    CASE(S("###"), "ab#x##y", 0, "ab#", "x", "##", "y");
    /* held back at the end: flush gives it */
    CASE(S("###"), "ab##", 0, "ab#", "#");
    /* the earliest of several stops wins, whichever is listed first */
    CASE(S("xyz", "yz"), "a", 1, "axyz");
    CASE(S("yz", "xyz"), "a", 1, "ax", "yz");
    CASE(S("xyz", "yz"), "a", 1, "ay", "z");
    /* generation ends with the delta that first completes a stop string: a longer stop that
     * started earlier but is not complete yet does not count */
    CASE(S("xyzw", "yz"), "ax", 1, "axyz", "w");
    CASE(S("xyzw", "yz"), "a", 1, "axyzw");
    /* overlapping prefixes: "aab" inside "aaab", one byte at a time */
    CASE(S("aab"), "a", 1, "a", "a", "a", "b");
    /* a stop inside one delta, text before it in the same delta */
    CASE(S("STOP"), "hello ", 1, "hel", "lo STOP now");
    /* multi-byte: the stop is a 2-byte character; the text around it is held only as needed */
    CASE(S("\xc3\xa9"), "caf", 1, "caf", "\xc3\xa9!");
    CASE(S("\xc3\xa9t\xc3\xa9"), "\xc3\xa9t\xc3\xa8", 0, "\xc3\xa9", "t", "\xc3\xa8");
    /* no stop strings: everything goes out as it comes */
    {
        char *none[1] = {NULL};
        const char *deltas[] = {"a", "b", NULL};
        int matched;
        const char *got = run(none, 0, 0, deltas, &matched);
        CHECK(!strcmp(got, "ab") && !matched, "no stops: '%s' %d", got, matched);
    }
    /* streaming: with no possible prefix, a delta is emitted whole at once */
    {
        char *stops[] = {"###"};
        rt_stop m;
        REQUIRE(rt_stop_init(&m, stops, 1, 0) == 0, "init");
        const char *e;
        size_t elen;
        CHECK(rt_stop_push(&m, "abc", 3, &e, &elen) == 0 && elen == 3, "whole delta out (%zu)", elen);
        CHECK(rt_stop_push(&m, "d#", 2, &e, &elen) == 0 && elen == 1 && e[0] == 'd', "'#' held (%zu)", elen);
        CHECK(rt_stop_push(&m, "##", 2, &e, &elen) == 1 && elen == 0, "matched across (%zu)", elen);
        CHECK(rt_stop_push(&m, "zz", 2, &e, &elen) == 1 && elen == 0, "nothing after a match");
        rt_stop_flush(&m, &e, &elen);
        CHECK(elen == 0, "nothing to flush after a match (%zu)", elen);
        rt_stop_free(&m);
    }
}

/* ------------------------------------------------------------------ randomized reference */

static uint64_t rng = 0x1234567;
static unsigned rnd(unsigned n)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (unsigned)(rng % n);
}

static void random_cases(void)
{
    static const char alphabet[] = "ab#";
    for (int iter = 0; iter < 3000; iter++) {
        char text[64], stop_buf[3][8];
        char *stops[3];
        int n_stops = (int)rnd(4), text_len = (int)rnd(40);
        size_t max_stop = 0;
        for (int i = 0; i < n_stops; i++) {
            int l = 1 + (int)rnd(4);
            for (int k = 0; k < l; k++) stop_buf[i][k] = alphabet[rnd(3)];
            stop_buf[i][l] = 0;
            stops[i] = stop_buf[i];
            if ((size_t)l > max_stop) max_stop = (size_t)l;
        }
        for (int k = 0; k < text_len; k++) text[k] = alphabet[rnd(3)];
        text[text_len] = 0;
        rt_stop m;
        REQUIRE(rt_stop_init(&m, stops, n_stops, 0) == 0, "init");
        char out[128];
        size_t out_len = 0;
        int matched = 0, fed = 0, cut = text_len, want_match = 0;
        while (fed < text_len) {
            int step = 1 + (int)rnd(5);
            if (step > text_len - fed) step = text_len - fed;
            /* reference: generation stops after the first delta that completes a stop string,
             * and the text is cut where the earliest complete occurrence starts */
            if (!want_match) {
                char prefix[64];
                memcpy(prefix, text, (size_t)(fed + step));
                prefix[fed + step] = 0;
                for (int i = 0; i < n_stops; i++) {
                    const char *hit = strstr(prefix, stops[i]);
                    if (hit && (!want_match || hit - prefix < cut)) cut = (int)(hit - prefix);
                    if (hit) want_match = 1;
                }
            }
            const char *e;
            size_t elen;
            int rc = rt_stop_push(&m, text + fed, (size_t)step, &e, &elen);
            fed += step;
            memcpy(out + out_len, e, elen);
            out_len += elen;
            if (rc == 1) matched = 1;
            /* liveness: at most the longest stop minus one byte is held back */
            if (!matched && max_stop > 0)
                CHECK((size_t)fed - out_len <= max_stop - 1, "held %zu bytes with stops of at most %zu",
                      (size_t)fed - out_len, max_stop);
            if (!matched && max_stop == 0) CHECK((size_t)fed == out_len, "held without stops");
        }
        const char *e;
        size_t elen;
        rt_stop_flush(&m, &e, &elen);
        memcpy(out + out_len, e, elen);
        out_len += elen;
        out[out_len] = 0;
        CHECK(matched == want_match, "text '%s': matched %d want %d", text, matched, want_match);
        CHECK((int)out_len == cut && !memcmp(out, text, out_len), "text '%s': emitted '%s', want the first %d bytes",
              text, out, cut);
        rt_stop_free(&m);
    }
}

int main(void)
{
    hand_cases();
    random_cases();
    return kt_done("test_router_stop");
}
