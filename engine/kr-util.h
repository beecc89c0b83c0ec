/*
 * kr-util.h - the engine's small shared utilities (util.c): its assertion macro (KR_ASSERT),
 * error messages into a caller's buffer, whole-file reads, and the bf16 / f16 <-> f32
 * conversions the loaders and the backends use (the scalar ones here; the row conversions per
 * CPU variant, engine/cpu/convert.c). Included by nearly every engine source and by the CUDA
 * sources (through engine/cuda/cuda.h); not installed, not part of the public contract (kr.h).
 */
#ifndef KR_UTIL_H
#define KR_UTIL_H

#include "kr.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef __cplusplus /* the CUDA sources include this through cuda.h */
extern "C" {
#endif

/* KR_ASSERT(cond): an invariant of the engine's state that no input may break (the KV pool's
 * bitmap against its free count, a block given back was taken, a list's length within its
 * blocks); malformed input gets an error return instead. In the sanitizer build (CMake
 * KR_SANITIZE, which defines KR_ASSERTS=1) a false condition prints file:line and the condition
 * and aborts. Otherwise it is compiled out, the condition type-checked but never evaluated:
 * decode steps pass through these checks and are hot. Where a caller's bug can break an
 * invariant (a block given back twice), the code also handles the false case itself, so a
 * Release build refuses it instead of corrupting the pool. */
#if defined(KR_ASSERTS) && KR_ASSERTS
#define KR_ASSERT(cond)                                                                        \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: KR_ASSERT(%s) failed\n", __FILE__, __LINE__, #cond);      \
            abort();                                                                           \
        }                                                                                      \
    } while (0)
#else
#define KR_ASSERT(cond) ((void)sizeof(cond))
#endif

/* printf-style error message into err (KR_ERR_MAX bytes; err may be NULL). Returns -1 so that
 * callers can write `return kr_errf(err, ...)`. */
int kr_errf(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* malloc for large arrays read in streams (weights, the KV pool): at least 64-byte aligned;
 * from 2 MiB up, 2 MiB aligned and marked for transparent huge pages, which the kernel's
 * default THP mode ("madvise") gives only to memory that asks. Freed with free(). */
void *kr_alloc_huge(size_t bytes);

/* Reads a whole file into a malloc'd, NUL-terminated buffer. */
int kr_read_file(const char *path, char **data_out, size_t *len_out, char *err);

/* bf16 / f16 <-> f32, exact for the upcast. */
static inline float kr_bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t kr_f32_to_bf16(float f) /* round to nearest even */
{
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
float kr_f16_to_f32(uint16_t h);
uint16_t kr_f32_to_f16(float f);

/* Row conversions of one variant of the CPU backend (engine/cpu/convert.c, compiled once per
 * instruction set like the rest of engine/cpu): kr_dtype_to_f32 and kr_dtype_from_f32 of kr.h,
 * bit for bit the scalar conversions above, NaN payloads included. */
typedef struct kr_convert_ops {
    void (*to_f32)(kr_dtype t, const void *src, size_t n, float *dst);
    void (*from_f32)(kr_dtype t, const float *src, size_t n, void *dst);
} kr_convert_ops;
/* Each variant, whatever the CPU (a test runs those kr_cpu_isa_supported says it runs side by
 * side); kr_dtype_to_f32 and kr_dtype_from_f32 call the one engine/cpu-dispatch.c chose. */
extern const kr_convert_ops kr_cpu_convert_avx512bf16, kr_cpu_convert_avx512, kr_cpu_convert_avx2,
    kr_cpu_convert_base;
/* The variant named avx512bf16, avx512, avx2 or base; NULL for another name. */
const kr_convert_ops *kr_cpu_convert_variant(const char *name);

#ifdef __cplusplus
}
#endif

#endif /* KR_UTIL_H */
