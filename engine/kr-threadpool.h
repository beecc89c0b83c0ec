/*
 * kr-threadpool.h - the CPU thread pool (threadpool.c): fn runs on every thread (the caller is
 * thread 0) and run returns when all are done; workers spin between jobs and park after about
 * 0.13 ms without one (docs/engine.md, "Thread pool"). Used by the CPU backend (engine/cpu/) only.
 * Not installed.
 */
#ifndef KR_THREADPOOL_H
#define KR_THREADPOOL_H

#include <stdint.h>

typedef void (*kr_task_fn)(void *arg, int ith, int nth);
typedef struct kr_threadpool kr_threadpool;
int kr_threadpool_create(int n_threads, kr_threadpool **out, char *err);
void kr_threadpool_free(kr_threadpool *tp);
int kr_threadpool_size(const kr_threadpool *tp);
/* Workers parked on the condition variable right now (0 while a step runs; n - 1 once the pool
 * has been idle a while). A snapshot, for tests and diagnostics. */
int kr_threadpool_parked(const kr_threadpool *tp);
void kr_threadpool_run(kr_threadpool *tp, kr_task_fn fn, void *arg);
/* Splits [0, n) into nth near-equal parts; part ith is [*lo, *hi). `align` rounds boundaries. */
static inline void kr_split(int64_t n, int ith, int nth, int64_t align, int64_t *lo, int64_t *hi)
{
    int64_t units = (n + align - 1) / align;
    int64_t a = units * ith / nth, b = units * (ith + 1) / nth;
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
}

#endif /* KR_THREADPOOL_H */
