/*
 * convert.c (CPU) - rows of bf16, f16 or f32 to float32 and back, at this variant's vector
 * width (simd.h). kr_dtype_to_f32 and kr_dtype_from_f32 run the chosen variant's
 * (engine/cpu-dispatch.c), so KV rows on import, prefill attention's gathered tiles and weight
 * slabs convert at the speed of the CPU the program runs on, not of the one it was built for.
 * Every variant gives bit for bit what the scalar conversions of kr-util.h give, NaNs
 * included (test_ops checks each variant the CPU runs against them).
 */
#include "cpu.h"
#include "simd.h"

#include <string.h>

void kr_cpu_to_f32(kr_dtype t, const void *src, size_t n, float *dst)
{
    const uint16_t *h = src;
    size_t i = 0;
    switch (t) {
    case KR_DTYPE_BF16:
        for (; i + KR_VL <= n; i += KR_VL) vf_store(dst + i, vf_load_bf16(h + i));
        for (; i < n; i++) dst[i] = kr_bf16_to_f32(h[i]);
        return;
    case KR_DTYPE_F16:
        for (; i + KR_VL <= n; i += KR_VL) vf_store(dst + i, vf_load_f16_exact(h + i));
        for (; i < n; i++) dst[i] = kr_f16_to_f32(h[i]);
        return;
    case KR_DTYPE_F32: break;
    }
    memcpy(dst, src, n * sizeof(float));
}

void kr_cpu_from_f32(kr_dtype t, const float *src, size_t n, void *dst)
{
    uint16_t *h = dst;
    size_t i = 0;
    switch (t) {
    case KR_DTYPE_BF16:
        for (; i + KR_VL <= n; i += KR_VL) vf_store_bf16(h + i, vf_load(src + i));
        for (; i < n; i++) h[i] = kr_f32_to_bf16(src[i]);
        return;
    case KR_DTYPE_F16:
        for (; i + KR_VL <= n; i += KR_VL) vf_store_f16(h + i, vf_load(src + i));
        for (; i < n; i++) h[i] = kr_f32_to_f16(src[i]);
        return;
    case KR_DTYPE_F32: break;
    }
    memcpy(dst, src, n * sizeof(float));
}

const kr_convert_ops KR_CPU_SYM(kr_cpu_convert) = {
    .to_f32 = kr_cpu_to_f32,
    .from_f32 = kr_cpu_from_f32,
};
