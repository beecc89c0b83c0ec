/*
 * cpu-dispatch.c - picks the CPU backend's variant when the program loads: the engine/cpu
 * sources are compiled once per instruction set (CMakeLists.txt), and kr_cpu_backend becomes a
 * copy of the best one this CPU runs (cpuid, mostly through the compiler's __builtin_cpu_supports,
 * which also asks the OS whether it saves the wider registers). KR_CPU_ISA=avx512bf16|avx512|avx2|base in the environment
 * asks for one variant; one the CPU lacks is refused with a line on stderr and the best is
 * used instead. kr_dtype_to_f32 and kr_dtype_from_f32 (kr.h) are the same variant's row
 * conversions (engine/cpu/convert.c), whichever backend runs the model. So one binary runs
 * everywhere at the speed of the CPU it is on, and a native build (KR_NATIVE) is not needed for
 * the kernels.
 */
#include "backend.h"
#include "kr-util.h"
#include "kr.h"

#include <cpuid.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kr_backend_ops kr_cpu_backend;

/* Bit `bit` of register `reg` (0 EAX, 1 EBX, 2 ECX, 3 EDX) of CPUID leaf `leaf`, subleaf `sub`;
 * 0 when the CPU has no such leaf. For the features __builtin_cpu_supports does not name in
 * every compiler (clang 14 knows neither "f16c" nor "avx512bf16"); the OS's saving of the
 * registers they use is what the avx2 and avx512f checks beside them establish. */
static int cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit)
{
    unsigned r[4];
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3]))
        return 0;
    return (int)((r[reg] >> bit) & 1u);
}

/* best first */
static const struct {
    const char *name;
    const kr_backend_ops *ops;
    const kr_convert_ops *convert;
} variants[] = {
    {"avx512bf16", &kr_cpu_backend_avx512bf16, &kr_cpu_convert_avx512bf16},
    {"avx512", &kr_cpu_backend_avx512, &kr_cpu_convert_avx512},
    {"avx2", &kr_cpu_backend_avx2, &kr_cpu_convert_avx2},
    {"base", &kr_cpu_backend_base, &kr_cpu_convert_base},
};
enum { N_VARIANTS = sizeof variants / sizeof variants[0] };

static const char *chosen = "base";
/* base until the pick: right for a conversion made before it, by another constructor */
static const kr_convert_ops *convert = &kr_cpu_convert_base;

int kr_cpu_isa_supported(const char *name)
{
    __builtin_cpu_init();
    if (strcmp(name, "avx512bf16") == 0)
        return cpuid_bit(7, 1, 0, 5) /* AVX512_BF16 */ && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && kr_cpu_isa_supported("avx512");
    if (strcmp(name, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma");
    if (strcmp(name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               cpuid_bit(1, 0, 2, 29) /* F16C */;
    return strcmp(name, "base") == 0;
}

const char *kr_cpu_isa(void) { return chosen; }

const char *kr_cpu_isa_help(void)
{
    static char line[192];
    snprintf(line, sizeof line,
             "CPU kernels: %s, chosen at start from avx512bf16, avx512, avx2 and base by what this\n"
             "CPU runs; KR_CPU_ISA=NAME in the environment asks for one (docs/engine.md).",
             chosen);
    return line;
}

const kr_backend_ops *kr_cpu_backend_variant(const char *name)
{
    for (int i = 0; i < N_VARIANTS; i++)
        if (strcmp(variants[i].name, name) == 0)
            return variants[i].ops;
    return NULL;
}

const kr_convert_ops *kr_cpu_convert_variant(const char *name)
{
    for (int i = 0; i < N_VARIANTS; i++)
        if (strcmp(variants[i].name, name) == 0)
            return variants[i].convert;
    return NULL;
}

void kr_dtype_to_f32(kr_dtype t, const void *src, size_t n, float *dst)
{
    convert->to_f32(t, src, n, dst);
}

void kr_dtype_from_f32(kr_dtype t, const float *src, size_t n, void *dst)
{
    convert->from_f32(t, src, n, dst);
}

__attribute__((constructor)) static void kr_cpu_pick(void)
{
    const char *want = getenv("KR_CPU_ISA");
    int pick = -1;
    if (want && *want) {
        for (int i = 0; i < N_VARIANTS; i++)
            if (strcmp(variants[i].name, want) == 0)
                pick = i;
        if (pick < 0 || !kr_cpu_isa_supported(want)) {
            fprintf(stderr, "kvrelay: KR_CPU_ISA=%s: %s; using the best this CPU runs\n", want,
                    pick < 0 ? "not one of avx512bf16, avx512, avx2, base" : "this CPU lacks it");
            pick = -1;
        }
    }
    for (int i = 0; pick < 0 && i < N_VARIANTS; i++)
        if (kr_cpu_isa_supported(variants[i].name))
            pick = i;
    chosen = variants[pick].name;
    kr_cpu_backend = *variants[pick].ops;
    convert = variants[pick].convert;
    if (want && *want && strcmp(want, chosen) != 0)
        setenv("KR_CPU_ISA", chosen, 1); /* said once: a re-exec (tools/cli.c) or child agrees */
}
