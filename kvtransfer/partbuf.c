/*
 * partbuf.c - the recycled part buffers of partbuf.h. Each buffer carries a 64-byte header in
 * front of what the caller gets: its size class (0 for a plain malloc'd one), how it was
 * mapped, and, while it waits in the cache, the link to the next buffer of its class.
 * From PB_HUGE up a buffer is a mapping of its own (map_huge): one base page for the header,
 * then the buffer, aligned to PB_HUGE and marked for transparent huge pages.
 */
#include "partbuf.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

enum {
    PB_HEAD = 64, /* header bytes; keeps the caller's pointer 64-byte aligned */
    PB_MIN_SHIFT = 18, /* 256 KiB: the smallest class kept */
    PB_CLASSES = 64,
};

#define PB_HUGE ((size_t)2 << 20) /* a huge page on x86-64 and arm64 (4 KiB base pages) */

typedef struct pb_head {
    struct pb_head *next; /* in the cache: the next free buffer of the class */
    int shift; /* the class: 1 << shift bytes after the header; 0: not kept */
    size_t map_len; /* map_huge's mapping, from the header's page; 0: malloc'd */
} pb_head;

/* A buffer of `body` bytes (at least PB_HUGE) in a mapping of its own: the header at the end of
 * one base page, the body right after it, on a PB_HUGE boundary and advised MADV_HUGEPAGE, so
 * that the kernel (in its default "madvise" THP mode) backs it with huge pages. The kernel's
 * socket copies into and out of a bundle then walk one page table entry per 2 MiB instead of one
 * per 4 KiB, which in a virtual machine's nested paging is most of their cost beyond the bytes
 * (kvrelay-transfer-bench, docs/transport.md). NULL when out of address space. */
static pb_head *map_huge(size_t body)
{
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), len = (body + PB_HUGE - 1) / PB_HUGE * PB_HUGE;
    const size_t span = page + len + PB_HUGE; /* room to slide the body onto a boundary */
    if (len < body || span < len) return NULL;
    uint8_t *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    uint8_t *at = (uint8_t *)(((uintptr_t)m + page + PB_HUGE - 1) & ~(uintptr_t)(PB_HUGE - 1));
    uint8_t *start = at - page, *end = at + len;
    if (start > m) munmap(m, (size_t)(start - m));
    if (m + span > end) munmap(end, (size_t)(m + span - end));
#ifdef MADV_HUGEPAGE
    madvise(at, len, MADV_HUGEPAGE); /* advice: a kernel without THP ignores it */
#endif
    pb_head *h = (pb_head *)(at - PB_HEAD);
    h->map_len = page + len;
    return h;
}

/* Gives back a buffer's memory, however it was taken. */
static void release(pb_head *h)
{
    if (h->map_len)
        munmap((uint8_t *)h + PB_HEAD - (size_t)sysconf(_SC_PAGESIZE), h->map_len);
    else
        free(h);
}

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
        if (body >= PB_HUGE) {
            h = map_huge(body);
        } else if ((h = aligned_alloc(PB_HEAD, PB_HEAD + body))) {
            h->map_len = 0;
        }
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
    release(h);
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
