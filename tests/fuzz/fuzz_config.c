/*
 * fuzz_config.c - kr_config_parse on arbitrary bytes (not NUL-terminated): it must refuse them
 * with a message naming the file, or return a config that passes kr_config_check.
 * Run: ctest -R fuzz_config (replay of tests/fuzz/corpus/config/ + mutations), or with
 * -DKR_FUZZ=ON: ./fuzz_config tests/fuzz/corpus/config.
 */
#include "kr-model.h" /* kr_config_check */

#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[KR_ERR_MAX];
    kr_config c;
    if (kr_config_parse((const char *)data, size, "fuzz.json", &c, err) != 0) {
        if (!strstr(err, "fuzz.json")) __builtin_trap();
        return 0;
    }
    if (kr_config_check(&c, "fuzz.json", err) != 0) __builtin_trap();
    if (c.n_heads % c.n_kv_heads != 0 || c.head_dim % 2 != 0) __builtin_trap();
    return 0;
}
