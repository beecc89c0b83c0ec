/*
 * partbuf.h - buffers for arriving bundle parts, recycled. A receiver that lets the transport
 * allocate each part at its size (kt_transport_reserve_bundle with buf NULL) frees the part once
 * imported. Fresh large buffers cost the kernel a zeroed page per 4 KiB touched (and an munmap
 * when freed), which with several bundles in flight cost more than the transfer itself; buffers
 * over 128 KiB are therefore rounded up to a power of two (256 KiB at least) and kept after their
 * release, up to KT_PARTBUF_KEEP_BYTES in all, to be handed out again for a part of their class.
 * Smaller ones are plain allocations: malloc's heap recycles those already. Thread-safe (one
 * mutex).
 * Run: ctest -R test_transport (the receive paths), test_bundle (kt_bundle_set_free).
 */
#ifndef KT_PARTBUF_H
#define KT_PARTBUF_H

#include <stddef.h>

#define KT_PARTBUF_KEEP_BYTES ((size_t)256 << 20) /* released buffers kept for reuse, at most */

/* A buffer of at least `size` bytes (64-byte aligned), or NULL when out of memory. */
void *kt_partbuf_alloc(size_t size);
/* Gives back a buffer from kt_partbuf_alloc (NULL: nothing). */
void kt_partbuf_free(void *p);
/* Bytes held by released buffers, waiting for reuse. */
size_t kt_partbuf_kept(void);

#endif
