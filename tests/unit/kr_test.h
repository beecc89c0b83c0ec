/*
 * kr_test.h - the tiny assertion kit of the unit tests. A test program returns 0 when every
 * check passed, 1 when one failed, 77 (ctest SKIPPED) when a fixture it needs is absent.
 */
#ifndef KR_TEST_H
#define KR_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kt_failures;

#define KT_SKIP 77
#define CHECK(cond, ...)                                                                       \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            kt_failures++;                                                                     \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);          \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
        }                                                                                      \
    } while (0)
/* Stops the test at once: for preconditions whose failure makes the rest meaningless. */
#define REQUIRE(cond, ...)                                                                     \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: REQUIRE(%s) failed: ", __FILE__, __LINE__, #cond);        \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fputc('\n', stderr);                                                               \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
/* An error message must contain `needle`. */
#define CHECK_ERR_HAS(err, needle)                                                             \
    CHECK(strstr((err), (needle)) != NULL, "error '%s' lacks '%s'", (err), (needle))

/* The larger of a running worst error and e, NaN once either is NaN: fmax would drop a NaN and
 * let a broken result pass a `worst < tol` check. */
static inline double kt_worst(double worst, double e)
{
    return worst != worst || e != e ? NAN : e > worst ? e : worst;
}

/* $name or NULL */
static inline const char *kt_env(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

static inline int kt_done(const char *name)
{
    if (kt_failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, kt_failures);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

#endif
