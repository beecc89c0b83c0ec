/*
 * fixture_io.h - reading the reference fixtures of tests/fixtures/models (cases.json and
 * logits.bin; their README gives the format), shared by test_fixtures.c (CPU) and
 * test_cuda_fixtures.c (CUDA).
 */
#ifndef KT_FIXTURE_IO_H
#define KT_FIXTURE_IO_H

#include "kr_test.h"

#include <cjson/cJSON.h>
#include <stdint.h>

static inline char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    REQUIRE(f, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    REQUIRE(fread(buf, 1, (size_t)n, f) == (size_t)n, "short read %s", path);
    buf[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static inline int32_t *json_ids(const cJSON *arr, int *n)
{
    *n = cJSON_GetArraySize(arr);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(*n > 0 ? *n : 1));
    for (int i = 0; i < *n; i++) ids[i] = (int32_t)cJSON_GetArrayItem(arr, i)->valuedouble;
    return ids;
}

static inline double max_diff(const float *a, const float *b, int n)
{
    double m = 0;
    for (int i = 0; i < n; i++) m = kt_worst(m, fabs((double)a[i] - (double)b[i])); /* NaN stays NaN */
    return m;
}

static inline int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

#endif
