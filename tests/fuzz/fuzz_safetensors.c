/*
 * fuzz_safetensors.c - kr_st_parse on arbitrary bytes: it must either refuse them with a message
 * or hand out tensors whose every byte lies inside the input (touched here, so ASan sees any
 * lie). Not a model-level fuzzer: shapes are not checked against a config.
 * Run: ctest -R fuzz_safetensors (replay of tests/fuzz/corpus/safetensors/ + mutations), or with
 * -DKR_FUZZ=ON: ./fuzz_safetensors tests/fuzz/corpus/safetensors.
 */
#include "safetensors.h"

#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[KR_ERR_MAX];
    kr_st_file *f = NULL;
    if (kr_st_parse(data, size, "fuzz.safetensors", &f, err) != 0) {
        if (!strstr(err, "fuzz.safetensors")) __builtin_trap(); /* every message names the file */
        return 0;
    }
    volatile uint8_t sink = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const kr_st_tensor *t = &f->tensors[i];
        if (t->nbytes) sink ^= t->data[0] ^ t->data[t->nbytes - 1];
        if (kr_st_find(f, t->name) != t) __builtin_trap();
        const kr_st_tensor *g;
        if (kr_st_get(f, t->name, &g, err) == 0 && !g->supported) __builtin_trap();
    }
    (void)sink;
    kr_st_close(f);
    return 0;
}
