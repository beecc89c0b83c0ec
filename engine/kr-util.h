/*
 * kr-util.h - the engine's small shared utilities (util.c): error messages into a caller's
 * buffer, whole-file reads, and the bf16 / f16 <-> f32 conversions the loaders, the backends and
 * the model writer use. Included by nearly every engine source and by the CUDA sources (through
 * engine/cuda/cuda.h); not installed, not part of the public contract (kr.h).
 */
#ifndef KR_UTIL_H
#define KR_UTIL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus /* the CUDA sources include this through cuda.h */
extern "C" {
#endif

/* printf-style error message into err (KR_ERR_MAX bytes; err may be NULL). Returns -1 so that
 * callers can write `return kr_errf(err, ...)`. */
int kr_errf(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

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

#ifdef __cplusplus
}
#endif

#endif /* KR_UTIL_H */
