/*
 * safetensors.h - one safetensors file, memory-mapped and validated (engine internal).
 *
 * What it is: the header (8-byte little-endian length, then a JSON object name -> {dtype, shape,
 * data_offsets}) parsed and checked against the file: every tensor's bytes lie inside the data
 * section and their count equals product(shape) * dtype size. After a successful open every
 * kr_st_tensor.data points at valid bytes; nothing else has to be re-checked.
 * What it is not: a writer, or a model loader (model.c maps names to weights, checks shapes and
 * converts dtypes). Tensors of dtypes other than BF16/F16/F32 are parsed (so that their offsets
 * are checked) but refused by kr_st_get with an error naming file, tensor and dtype.
 */
#ifndef KR_SAFETENSORS_H
#define KR_SAFETENSORS_H

#include "kr.h"

#define KR_ST_MAX_DIMS 8

typedef struct kr_st_tensor {
    char *name; /* owned by the file */
    char dtype_name[8]; /* as written: "BF16", "I8", ... */
    int supported; /* dtype is BF16, F16 or F32 */
    kr_dtype dtype; /* valid when supported */
    int n_dims;
    int64_t shape[KR_ST_MAX_DIMS];
    uint64_t nbytes; /* data_offsets[1] - data_offsets[0] */
    const uint8_t *data; /* into the file's bytes; alignment NOT guaranteed */
} kr_st_tensor;

typedef struct kr_st_file {
    char *path; /* owned */
    const uint8_t *bytes; /* the whole file */
    size_t len;
    void *map; /* the mmap when opened from disk (owned), else NULL */
    size_t map_len;
    kr_st_tensor *tensors; /* [n_tensors], sorted by name; owned */
    int n_tensors;
} kr_st_file;

/* Parses a safetensors image already in memory. `buf` is borrowed: it must outlive the file
 * object and is never written. `path` is only used in messages. For the fuzzer and tests. */
int kr_st_parse(const void *buf, size_t len, const char *path, kr_st_file **out, char *err);
/* Maps `path` read-only and parses it. The mapping lives until kr_st_close. */
int kr_st_open(const char *path, kr_st_file **out, char *err);
/* Releases everything of the file (accepts NULL). */
void kr_st_close(kr_st_file *f);
/* The tensor called `name`, or NULL. */
const kr_st_tensor *kr_st_find(const kr_st_file *f, const char *name);
/* Like kr_st_find but a missing tensor or an unsupported dtype is an error naming the file and
 * the tensor. */
int kr_st_get(const kr_st_file *f, const char *name, const kr_st_tensor **out, char *err);
/* "[512, 256]" into buf. */
const char *kr_st_shape_str(const int64_t *shape, int n_dims, char *buf, size_t cap);

#endif
