/*
 * threadpool.c - a fork-join pool for the engine's kernels. kr_threadpool_run runs one function
 * on every thread (the caller is thread 0) and returns when all are done. Between jobs a worker
 * spins on the job counter with a pause instruction for SPIN_NS, then parks on a condition
 * variable, so an idle engine (a server between requests) uses no CPU. On free cores a decode
 * step's ~130 jobs follow each other within the spin and a worker parks about once per step; on
 * an oversubscribed machine it parks at nearly every job, which is what keeps decode from
 * collapsing there (docs/engine.md, "Thread pool"). Not a general task queue: one job at a time,
 * one caller at a time. Tested by tests/unit/test_threadpool.c.
 */
#include "kr-threadpool.h"
#include "kr-util.h"
#include "kr.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* How long a worker spins without a job before it parks (ns). Measured on a 2-core EPYC VM
 * (docs/engine.md, "Thread pool"): with the cores to itself a worker parks about once per decode
 * step at this length, so spinning longer has nothing left to save; on the machine shared with
 * other processes, spinning 2 ms made decode 3-5 times slower, and spinning 2 ms with
 * sched_yield after 60 us was no faster than this. Time, not a count of pauses: a pause takes
 * 30 ns on that EPYC, 140 cycles on recent Intel parts and a few cycles on older ones. */
enum { SPIN_NS = 128000 };
/* The clock is read once per this many pauses (about 2 us; a read costs about one pause). */
enum { PAUSES_PER_CLOCK = 64 };

typedef struct worker {
    kr_threadpool *tp;
    int ith;
    pthread_t thread;
} worker;

struct kr_threadpool {
    int n; /* threads including the caller */
    worker *workers; /* [n - 1] */
    kr_task_fn fn;
    void *arg;
    atomic_uint gen; /* bumped once per job, under mu */
    atomic_int done; /* workers finished with the current job */
    atomic_int stop;
    atomic_int parked; /* workers waiting on cv; changed under mu, read without it */
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Waits until the job counter moves past `seen` and returns its new value. No lost wake-up: the
 * counter is bumped under mu and re-read under mu before waiting, and the bump broadcasts when
 * anyone is parked. */
static unsigned wait_for_job(kr_threadpool *tp, unsigned seen)
{
    const int64_t idle_since = now_ns();
    for (unsigned spins = 1;; spins++) {
        unsigned g = atomic_load_explicit(&tp->gen, memory_order_acquire);
        if (g != seen) return g;
        cpu_relax();
        if (spins % PAUSES_PER_CLOCK || now_ns() - idle_since < SPIN_NS) continue;
        pthread_mutex_lock(&tp->mu);
        atomic_fetch_add_explicit(&tp->parked, 1, memory_order_relaxed);
        while (atomic_load_explicit(&tp->gen, memory_order_relaxed) == seen) pthread_cond_wait(&tp->cv, &tp->mu);
        atomic_fetch_sub_explicit(&tp->parked, 1, memory_order_relaxed);
        pthread_mutex_unlock(&tp->mu);
        return atomic_load_explicit(&tp->gen, memory_order_acquire);
    }
}

static void *worker_main(void *p)
{
    worker *w = p;
    kr_threadpool *tp = w->tp;
    unsigned seen = 0;
    for (;;) {
        seen = wait_for_job(tp, seen);
        if (atomic_load(&tp->stop)) return NULL;
        tp->fn(tp->arg, w->ith, tp->n);
        atomic_fetch_add_explicit(&tp->done, 1, memory_order_release);
    }
}

int kr_threadpool_create(int n_threads, kr_threadpool **out, char *err)
{
    if (n_threads < 1) return kr_errf(err, "thread pool: %d threads requested (need >= 1)", n_threads);
    kr_threadpool *tp = calloc(1, sizeof *tp);
    if (!tp) return kr_errf(err, "thread pool: out of memory");
    tp->n = n_threads;
    pthread_mutex_init(&tp->mu, NULL);
    pthread_cond_init(&tp->cv, NULL);
    tp->workers = calloc((size_t)n_threads, sizeof *tp->workers);
    if (!tp->workers) goto err_oom;
    for (int i = 1; i < n_threads; i++) {
        worker *w = &tp->workers[i - 1];
        w->tp = tp;
        w->ith = i;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            tp->n = i; /* only the started ones get joined */
            kr_threadpool_free(tp);
            return kr_errf(err, "thread pool: cannot start thread %d of %d", i, n_threads);
        }
    }
    *out = tp;
    return KR_OK;
err_oom:
    pthread_cond_destroy(&tp->cv);
    pthread_mutex_destroy(&tp->mu);
    free(tp);
    return kr_errf(err, "thread pool: out of memory");
}

void kr_threadpool_free(kr_threadpool *tp)
{
    if (!tp) return;
    pthread_mutex_lock(&tp->mu);
    atomic_store(&tp->stop, 1);
    atomic_fetch_add(&tp->gen, 1);
    pthread_cond_broadcast(&tp->cv);
    pthread_mutex_unlock(&tp->mu);
    for (int i = 1; i < tp->n; i++) pthread_join(tp->workers[i - 1].thread, NULL);
    pthread_cond_destroy(&tp->cv);
    pthread_mutex_destroy(&tp->mu);
    free(tp->workers);
    free(tp);
}

int kr_threadpool_size(const kr_threadpool *tp)
{
    return tp->n;
}

int kr_threadpool_parked(const kr_threadpool *tp)
{
    return atomic_load_explicit(&tp->parked, memory_order_relaxed);
}

void kr_threadpool_run(kr_threadpool *tp, kr_task_fn fn, void *arg)
{
    if (tp->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    tp->fn = fn;
    tp->arg = arg;
    atomic_store_explicit(&tp->done, 0, memory_order_relaxed);
    pthread_mutex_lock(&tp->mu);
    atomic_fetch_add_explicit(&tp->gen, 1, memory_order_release);
    if (atomic_load_explicit(&tp->parked, memory_order_relaxed)) pthread_cond_broadcast(&tp->cv);
    pthread_mutex_unlock(&tp->mu);
    fn(arg, 0, tp->n);
    while (atomic_load_explicit(&tp->done, memory_order_acquire) != tp->n - 1) cpu_relax();
}
