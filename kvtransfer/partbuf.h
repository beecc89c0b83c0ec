/*
 * partbuf.h - buffers for bundles and their arriving parts, recycled. A receiver that lets the transport
 * allocate each part at its size (kt_transport_reserve with a set, buf NULL) frees the part once
 * imported. Fresh large buffers cost the kernel a zeroed page per 4 KiB touched (and an munmap
 * when freed), which with several bundles in flight cost more than the transfer itself; buffers
 * over 128 KiB are therefore rounded up to a power of two (256 KiB at least) and kept after their
 * release, to be handed out again for a part of their class, up to a bound: the most bytes of
 * such buffers that were out at once (what the receiver needed at its busiest), at least
 * KT_PARTBUF_KEEP_MIN and at most KT_PARTBUF_KEEP_MAX. A fixed 256 MiB bound made eight 64 MiB
 * bundles in flight allocate and fault in fresh buffers for good (validated transfers at 64 MiB:
 * 2.3 GB/s against 3.3 with the buffers kept, kvrelay-transfer-bench --validate).
 * Smaller ones are plain allocations: malloc's heap recycles those already. From 2 MiB up a
 * buffer is 2 MiB aligned and backed by transparent huge pages where the kernel has them (it
 * gives them only to memory that asks, in its default mode): the kernel's copies into and out of
 * a bundle then take a TLB entry per 2 MiB, not per 4 KiB (kvrelay-transfer-bench: 1.2x the
 * GB/s at 4 and 16 MiB on this project's VM, docs/transport.md). Bundle buffers on both sides
 * come from here: a prefill node's send buffers as well as a receiver's parts. Thread-safe
 * (one mutex).
 * Run: ctest -R test_transport (the receive paths), test_bundle (kt_bundle_set_free).
 */
#ifndef KT_PARTBUF_H
#define KT_PARTBUF_H

#include <stddef.h>

#define KT_PARTBUF_KEEP_MIN ((size_t)256 << 20) /* the bound on kept bytes, at least */
#define KT_PARTBUF_KEEP_MAX ((size_t)4 << 30) /* and at most */

/* A buffer of at least `size` bytes (64-byte aligned; 2 MiB aligned from 2 MiB up), or NULL when
 * out of memory. */
void *kt_partbuf_alloc(size_t size);
/* Gives back a buffer from kt_partbuf_alloc (NULL: nothing). */
void kt_partbuf_free(void *p);
/* Bytes held by released buffers, waiting for reuse. */
size_t kt_partbuf_kept(void);
/* The bound on those: the peak of bytes out at once, within [KEEP_MIN, KEEP_MAX]. */
size_t kt_partbuf_keep_bound(void);

#endif
