/*
 * threadpool.c - a fork-join pool for the engine's kernels. kr_threadpool_run runs one function
 * on every thread (the caller is thread 0) and returns when all are done. Workers spin for a
 * short while between jobs (a decode step dispatches dozens of small jobs back to back, and a
 * futex wake costs more than the job), then sleep on a condition variable so an idle engine
 * uses no CPU. Not a general task queue: one job at a time, one caller at a time.
 */
#include "kr-threadpool.h"
#include "kr-util.h"
#include "kr.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Short: a decode step's jobs follow each other within microseconds, so a worker rarely sleeps
 * mid-step; a longer spin only burns a core that a serial stretch of the caller (a policy
 * trimming the cache) or another process on a 2-core machine needs (measured: 2^14 and more
 * made decode several times slower under load). */
enum { SPIN_BEFORE_SLEEP = 1 << 12 };

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
    atomic_uint gen; /* bumped once per job */
    atomic_int done; /* workers finished with the current job */
    atomic_int stop;
    int sleepers; /* guarded by mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void *worker_main(void *p)
{
    worker *w = p;
    kr_threadpool *tp = w->tp;
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&tp->gen, memory_order_acquire)) == seen) {
            if (++spins < SPIN_BEFORE_SLEEP) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&tp->mu);
            tp->sleepers++;
            while (atomic_load(&tp->gen) == seen) pthread_cond_wait(&tp->cv, &tp->mu);
            tp->sleepers--;
            pthread_mutex_unlock(&tp->mu);
            spins = 0;
        }
        seen = g;
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
    if (tp->sleepers) pthread_cond_broadcast(&tp->cv);
    pthread_mutex_unlock(&tp->mu);
    fn(arg, 0, tp->n);
    while (atomic_load_explicit(&tp->done, memory_order_acquire) != tp->n - 1) cpu_relax();
}
