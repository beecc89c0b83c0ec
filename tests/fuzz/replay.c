/*
 * replay.c - runs a fuzz target without libFuzzer: every file of the corpus directory given
 * as argv[1], then KR_FUZZ_MUTATIONS (default 2000) seeded random mutations of them (byte
 * flips, truncations, insertions, splices). Under ASan/UBSan this makes each fuzz target a
 * regression test that CI runs; real fuzzing uses -DKR_FUZZ=ON with clang.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct { uint8_t *data; size_t size; } input;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static int load(const char *path, input *in)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    in->data = malloc((size_t)n + 1);
    in->size = fread(in->data, 1, (size_t)n, f);
    fclose(f);
    return 0;
}

int main(int argc, char **argv)
{
    input *seeds = NULL; /* every file of the corpus: campaigns grow it past any fixed count */
    int n_seeds = 0, cap = 0;
    if (argc > 1) {
        DIR *d = opendir(argv[1]);
        if (!d) {
            fprintf(stderr, "replay: cannot open corpus %s\n", argv[1]);
            return 1;
        }
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            if (n_seeds == cap) {
                cap = cap ? 2 * cap : 256;
                seeds = realloc(seeds, (size_t)cap * sizeof *seeds);
                if (!seeds) {
                    fprintf(stderr, "replay: out of memory for %d seeds\n", cap);
                    return 1;
                }
            }
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[1], e->d_name);
            if (load(path, &seeds[n_seeds]) == 0) n_seeds++;
        }
        closedir(d);
    }
    for (int i = 0; i < n_seeds; i++) LLVMFuzzerTestOneInput(seeds[i].data, seeds[i].size);
    const char *m = getenv("KR_FUZZ_MUTATIONS");
    long mutations = m ? atol(m) : 2000;
    uint8_t *buf = malloc(1 << 20);
    for (long k = 0; k < mutations && n_seeds > 0; k++) {
        input *s = &seeds[next() % (uint64_t)n_seeds];
        size_t n = s->size < (1 << 19) ? s->size : (1 << 19);
        memcpy(buf, s->data, n);
        int edits = 1 + (int)(next() % 8);
        for (int j = 0; j < edits; j++) {
            switch (next() % 5) {
            case 0: if (n) buf[next() % n] ^= (uint8_t)(1u << (next() % 8)); break;
            case 1: if (n) buf[next() % n] = (uint8_t)next(); break;
            case 2: if (n) n = next() % n; break; /* truncate */
            case 3: if (n < (1 << 19)) { size_t at = n ? next() % n : 0; memmove(buf + at + 1, buf + at, n - at); buf[at] = (uint8_t)next(); n++; } break;
            case 4: { input *o = &seeds[next() % (uint64_t)n_seeds]; if (o->size && n) { size_t at = next() % n, from = next() % o->size, len = o->size - from; if (at + len > (1 << 19)) len = (1 << 19) - at; memcpy(buf + at, o->data + from, len); if (at + len > n) n = at + len; } } break;
            }
        }
        uint8_t *copy = malloc(n ? n : 1); /* exact-size copy so ASan sees overreads */
        memcpy(copy, buf, n);
        LLVMFuzzerTestOneInput(copy, n);
        free(copy);
    }
    free(buf);
    for (int i = 0; i < n_seeds; i++) free(seeds[i].data);
    free(seeds);
    printf("replay: %d seeds, %ld mutations, no crash\n", n_seeds, mutations);
    return 0;
}
