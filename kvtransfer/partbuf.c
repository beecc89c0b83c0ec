/*
 * partbuf.c - the recycled part buffers of partbuf.h. Each buffer carries a 64-byte header in
 * front of what the caller gets: its size class (0 for a plain malloc'd one) and, while it waits
 * in the cache, the link to the next buffer of its class.
 */
#include "partbuf.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

enum {
    PB_HEAD = 64, /* header bytes; keeps the caller's pointer 64-byte aligned */
    PB_MIN_SHIFT = 18, /* 256 KiB: the smallest class kept */
    PB_CLASSES = 64,
};

typedef struct pb_head {
    struct pb_head *next; /* in the cache: the next free buffer of the class */
    int shift; /* the class: 1 << shift bytes after the header; 0: not kept */
} pb_head;

static struct {
    pthread_mutex_t lock;
    pb_head *free[PB_CLASSES];
    size_t kept;
    size_t out, peak; /* bytes of kept-class buffers handed out now, and at most so far */
} cache = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* Under cache.lock. */
static size_t keep_bound(void)
{
    return cache.peak < KT_PARTBUF_KEEP_MIN   ? KT_PARTBUF_KEEP_MIN
           : cache.peak > KT_PARTBUF_KEEP_MAX ? KT_PARTBUF_KEEP_MAX
                                              : cache.peak;
}

/* The class of a `size`-byte request: the smallest power of two at least size, or 0 below the
 * smallest class or beyond the largest. */
static int class_of(size_t size)
{
    if (size <= ((size_t)1 << (PB_MIN_SHIFT - 1)) || size > ((size_t)1 << (PB_CLASSES - 2)))
        return 0;
    int shift = PB_MIN_SHIFT;
    while (((size_t)1 << shift) < size) shift++;
    return shift;
}

void *kt_partbuf_alloc(size_t size)
{
    int shift = class_of(size);
    pb_head *h = NULL;
    if (shift) {
        pthread_mutex_lock(&cache.lock);
        h = cache.free[shift];
        if (h) {
            cache.free[shift] = h->next;
            cache.kept -= (size_t)1 << shift;
        }
        pthread_mutex_unlock(&cache.lock);
    }
    if (!h) {
        size_t body = shift ? (size_t)1 << shift : (size + PB_HEAD - 1) / PB_HEAD * PB_HEAD;
        if (body < size) return NULL; /* size near SIZE_MAX */
        h = aligned_alloc(PB_HEAD, PB_HEAD + body);
        if (!h) return NULL;
        h->shift = shift;
    }
    if (shift) {
        pthread_mutex_lock(&cache.lock);
        cache.out += (size_t)1 << shift;
        if (cache.out > cache.peak) cache.peak = cache.out;
        pthread_mutex_unlock(&cache.lock);
    }
    h->next = NULL;
    return (uint8_t *)h + PB_HEAD;
}

void kt_partbuf_free(void *p)
{
    if (!p) return;
    pb_head *h = (pb_head *)((uint8_t *)p - PB_HEAD);
    if (h->shift) {
        size_t bytes = (size_t)1 << h->shift;
        pthread_mutex_lock(&cache.lock);
        cache.out -= bytes;
        int keep = cache.kept + bytes <= keep_bound();
        if (keep) {
            h->next = cache.free[h->shift];
            cache.free[h->shift] = h;
            cache.kept += bytes;
        }
        pthread_mutex_unlock(&cache.lock);
        if (keep) return;
    }
    free(h);
}

size_t kt_partbuf_keep_bound(void)
{
    pthread_mutex_lock(&cache.lock);
    size_t bound = keep_bound();
    pthread_mutex_unlock(&cache.lock);
    return bound;
}

size_t kt_partbuf_kept(void)
{
    pthread_mutex_lock(&cache.lock);
    size_t kept = cache.kept;
    pthread_mutex_unlock(&cache.lock);
    return kept;
}
