/*
 * test_threadpool.c - the CPU thread pool (engine/threadpool.c): every job runs once on every
 * thread and its writes are visible when kr_threadpool_run returns, over thousands of jobs back
 * to back (a decode step's worth and more) and with gaps around the spin's length (a worker
 * parking as a job arrives); workers park once the pool is idle (kr_threadpool_parked) and a
 * job wakes them all; the pool is destroyed cleanly right after
 * creation, while its workers spin and while they are parked; a one-thread pool runs jobs
 * inline; a zero-thread pool is refused. Meant to run under the sanitizers as well (a race
 * between a job's writes and the caller's reads is what TSan would report). Asserts no timings.
 * run: ctest -R threadpool
 */
#include "kr_test.h"

#include "kr-threadpool.h"
#include "kr.h"

#include <time.h>

enum { MAX_THREADS = 4, JOBS_PER_STEP = 500 };

/* Every thread adds its part to its own slot: a missing, doubled or late part shows in the sum
 * the caller reads after run. */
typedef struct job {
    long job; /* which job this is: each thread writes it into seen[ith] */
    long seen[MAX_THREADS];
    long runs[MAX_THREADS]; /* how often each thread ran a job */
    int nth[MAX_THREADS]; /* the thread count each thread was told */
} job;

static void job_task(void *arg, int ith, int nth)
{
    job *j = arg;
    j->seen[ith] = j->job;
    j->runs[ith]++;
    j->nth[ith] = nth;
}

/* Runs `count` jobs back to back and checks each one ran once on every thread. */
static void run_step(kr_threadpool *tp, job *j, int count, const char *what)
{
    int n = kr_threadpool_size(tp);
    int bad = 0;
    for (int i = 0; i < count; i++) {
        j->job++;
        kr_threadpool_run(tp, job_task, j);
        for (int t = 0; t < n; t++) bad += j->seen[t] != j->job || j->nth[t] != n;
    }
    CHECK(bad == 0, "%s: %d parts of %d jobs on %d threads missing or stale", what, bad, count, n);
}

/* Waits until every worker is parked. The pool parks after about 0.13 ms idle; the bound only
 * keeps a broken pool from hanging the test. */
static int wait_parked(kr_threadpool *tp)
{
    const struct timespec ms = {0, 1000000};
    for (int i = 0; i < 60000; i++) {
        if (kr_threadpool_parked(tp) == kr_threadpool_size(tp) - 1) return 1;
        nanosleep(&ms, NULL);
    }
    return 0;
}

static kr_threadpool *make(int n)
{
    char err[KR_ERR_MAX];
    kr_threadpool *tp;
    REQUIRE(kr_threadpool_create(n, &tp, err) == KR_OK, "%s", err);
    return tp;
}

static void test_steps(int n)
{
    kr_threadpool *tp = make(n);
    job j = {0};
    run_step(tp, &j, JOBS_PER_STEP, "first step");
    /* idle: every worker parks, and the next job wakes them all */
    REQUIRE(wait_parked(tp), "%d threads: workers never parked (%d of %d parked)", n, kr_threadpool_parked(tp),
            n - 1);
    run_step(tp, &j, 1, "job after parking");
    run_step(tp, &j, JOBS_PER_STEP, "second step");
    /* jobs apart by 0 to 240 us, around the spin's length: a worker is parking as a job arrives,
     * where a lost wake-up would hang the run */
    for (int i = 0; i < 300; i++) {
        const struct timespec gap = {0, (i % 7) * 40000L};
        nanosleep(&gap, NULL);
        run_step(tp, &j, 1, "job at the parking edge");
    }
    /* a few short steps with idle gaps that let the workers park in between */
    for (int s = 0; s < 5; s++) {
        REQUIRE(wait_parked(tp), "%d threads: workers did not park again after step %d", n, s);
        run_step(tp, &j, 100, "step after parking");
    }
    for (int t = 0; t < n; t++)
        CHECK(j.runs[t] == j.job, "thread %d of %d ran %ld of %ld jobs", t, n, j.runs[t], j.job);
    /* destroyed while parked */
    REQUIRE(wait_parked(tp), "%d threads: workers did not park before destroy", n);
    kr_threadpool_free(tp);
}

static void test_destroy(int n)
{
    /* right after creation: workers may not have reached their first wait yet */
    for (int i = 0; i < 50; i++) kr_threadpool_free(make(n));
    /* right after a job: workers are spinning for the next one */
    for (int i = 0; i < 50; i++) {
        kr_threadpool *tp = make(n);
        job j = {0};
        run_step(tp, &j, 3, "job before destroy");
        kr_threadpool_free(tp);
    }
}

int main(void)
{
    char err[KR_ERR_MAX];
    kr_threadpool *tp = NULL;
    CHECK(kr_threadpool_create(0, &tp, err) != KR_OK && tp == NULL, "a pool of 0 threads was created");
    CHECK_ERR_HAS(err, "need >= 1");

    /* one thread: the caller runs every job itself and nothing ever parks */
    tp = make(1);
    job j = {0};
    run_step(tp, &j, 10, "one thread");
    CHECK(kr_threadpool_parked(tp) == 0, "a one-thread pool reports %d parked", kr_threadpool_parked(tp));
    kr_threadpool_free(tp);

    for (int n = 2; n <= MAX_THREADS; n++) {
        test_steps(n);
        test_destroy(n);
    }
    return kt_done("test_threadpool");
}
