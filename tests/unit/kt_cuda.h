/*
 * kt_cuda.h - what the CUDA tests share: whether they can run at all, and a KV pool whose keys,
 * values and positions live where the CUDA backend keeps them (its kv_alloc: managed memory
 * that both its kernels and the host code address, engine/cuda/cuda.h).
 *
 * KT_CUDA is defined when the build has the CUDA backend (KR_HAVE_CUDA) and the CUDA runtime
 * header is on the test's include path; without it the CUDA tests print SKIP and exit 77.
 */
#ifndef KT_CUDA_H
#define KT_CUDA_H

#include "kr_test.h"

#if defined(KR_HAVE_CUDA) && defined(__has_include)
#if __has_include(<cuda_runtime.h>)
#define KT_CUDA 1
#endif
#endif

#ifdef KT_CUDA
#include "backend.h"

#include <cuda_runtime.h>

/* 1 when a CUDA device can run kernels; else 0 with the reason in `why`. */
static inline int kt_cuda_usable(char *why, size_t cap)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(why, cap, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
        return 0;
    }
    if (n == 0) {
        snprintf(why, cap, "cudaGetDeviceCount found no device");
        return 0;
    }
    return 1;
}

#define KT_CUDA_REQUIRE(x)                                                                     \
    do {                                                                                       \
        cudaError_t kt_e_ = (x);                                                               \
        REQUIRE(kt_e_ == cudaSuccess, "%s: %s", #x, cudaGetErrorString(kt_e_));                \
    } while (0)

static void *kt_cuda_kv_alloc(void *backend, size_t bytes)
{
    return kr_cuda_backend.kv_alloc((kr_backend *)backend, bytes);
}

/* A pool in the memory the CUDA backend `gb` keeps KV pools in (what kr_ctx_kv_pool_create
 * gives a CUDA context), for tests that drive the ops without a kr_ctx. */
static inline kr_kv_pool *kt_cuda_pool_create(kr_backend *gb, int head_dim, int block_size, int n_blocks)
{
    char err[KR_ERR_MAX];
    kr_kv_pool *p;
    REQUIRE(kr_kv_pool_create_in(head_dim, block_size, n_blocks, KR_DTYPE_F32, kt_cuda_kv_alloc, gb,
                                 kr_cuda_backend.kv_free, &p, err) == KR_OK, "%s", err);
    return p;
}
#endif /* KT_CUDA */

/* The skip line and exit code of a CUDA test that cannot run here (call first in main). */
static inline void kt_cuda_skip_unless_usable(void)
{
#ifdef KT_CUDA
    char why[256];
    if (!kt_cuda_usable(why, sizeof why)) {
        printf("SKIP: no usable CUDA device (%s)\n", why);
        exit(KT_SKIP);
    }
#elif defined(KR_HAVE_CUDA)
    printf("SKIP: built with CUDA but cuda_runtime.h is not on the tests' include path\n");
    exit(KT_SKIP);
#else
    printf("SKIP: built without CUDA (nvcc not found)\n");
    exit(KT_SKIP);
#endif
}

#endif
