/*
 * safetensors.c - read-only access to one .safetensors file (see safetensors.h for the contract).
 *
 * Format: u64 little-endian header length N, N bytes of JSON ({"name": {"dtype": "BF16",
 * "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {...}}), then the data
 * section; offsets are relative to the data section. The file is trusted for nothing: lengths,
 * offsets and shapes are all checked before any tensor pointer is handed out, and every message
 * names the file (and the tensor). Fuzzed by tests/fuzz/fuzz_safetensors.c.
 * Not done: checking that tensors do not overlap (harmless for a reader), big-endian hosts.
 */
#include "kr-util.h"
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The reference implementation refuses headers above 100 MB; so do we. */
#define KR_ST_MAX_HEADER (100u * 1000u * 1000u)
/* Integers above 2^53 do not survive cJSON's doubles. */
#define KR_ST_MAX_INT 9007199254740992.0

static const struct {
    const char *name;
    int size;
} kr_st_dtypes[] = {
    {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
    {"I16", 2}, {"U16", 2}, {"F16", 2}, {"BF16", 2},
    {"I32", 4}, {"U32", 4}, {"F32", 4},
    {"I64", 8}, {"U64", 8}, {"F64", 8},
};

const char *kr_st_shape_str(const int64_t *shape, int n_dims, char *buf, size_t cap)
{
    size_t n = 0;
    n += (size_t)snprintf(buf + n, cap - n, "[");
    for (int i = 0; i < n_dims && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
    return buf;
}

/* A JSON number that is an exact non-negative integer representable in a double. */
static int st_uint(const cJSON *it, uint64_t *out)
{
    if (!cJSON_IsNumber(it)) return -1;
    double v = it->valuedouble;
    if (!(v >= 0) || v > KR_ST_MAX_INT || v != floor(v)) return -1;
    *out = (uint64_t)v;
    return 0;
}

static int st_cmp_name(const void *a, const void *b)
{
    return strcmp(((const kr_st_tensor *)a)->name, ((const kr_st_tensor *)b)->name);
}

/* Fills t from one header entry and checks it against the data section. */
static int st_entry(const cJSON *e, const char *path, const uint8_t *data, uint64_t data_len,
                    kr_st_tensor *t, char *err)
{
    const char *name = t->name;
    if (!cJSON_IsObject(e))
        return kr_errf(err, "%s: tensor '%.200s': header entry is not an object", path, name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return kr_errf(err, "%s: tensor '%.200s': missing \"dtype\"", path, name);
    int esize = 0;
    for (size_t i = 0; i < sizeof kr_st_dtypes / sizeof kr_st_dtypes[0]; i++)
        if (strcmp(dt->valuestring, kr_st_dtypes[i].name) == 0) esize = kr_st_dtypes[i].size;
    if (!esize)
        return kr_errf(err, "%s: tensor '%.200s': unknown dtype \"%.16s\"", path, name,
                       dt->valuestring);
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", dt->valuestring);
    t->supported = 1;
    if (strcmp(dt->valuestring, "F32") == 0) t->dtype = KR_DTYPE_F32;
    else if (strcmp(dt->valuestring, "F16") == 0) t->dtype = KR_DTYPE_F16;
    else if (strcmp(dt->valuestring, "BF16") == 0) t->dtype = KR_DTYPE_BF16;
    else t->supported = 0;

    if (!cJSON_IsArray(shape))
        return kr_errf(err, "%s: tensor '%.200s': missing \"shape\" list", path, name);
    int nd = cJSON_GetArraySize(shape);
    if (nd > KR_ST_MAX_DIMS)
        return kr_errf(err, "%s: tensor '%.200s': %d dimensions (at most %d supported)", path,
                       name, nd, KR_ST_MAX_DIMS);
    uint64_t numel = 1;
    int zero = 0;
    for (int i = 0; i < nd; i++) {
        uint64_t d;
        if (st_uint(cJSON_GetArrayItem(shape, i), &d))
            return kr_errf(err, "%s: tensor '%.200s': shape[%d] is not a non-negative integer",
                           path, name, i);
        t->shape[i] = (int64_t)d;
        if (d == 0) zero = 1;
        else if (numel > UINT64_MAX / 8 / d) /* keeps numel * esize in range */
            return kr_errf(err, "%s: tensor '%.200s': shape is too large", path, name);
        else numel *= d;
    }
    t->n_dims = nd;
    if (zero) numel = 0;
    uint64_t need = numel * (uint64_t)esize;

    uint64_t begin, end;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 ||
        st_uint(cJSON_GetArrayItem(offs, 0), &begin) || st_uint(cJSON_GetArrayItem(offs, 1), &end))
        return kr_errf(err, "%s: tensor '%.200s': \"data_offsets\" must be two non-negative "
                       "integers", path, name);
    if (begin > end)
        return kr_errf(err, "%s: tensor '%.200s': data_offsets [%llu, %llu] run backwards", path,
                       name, (unsigned long long)begin, (unsigned long long)end);
    if (end > data_len)
        return kr_errf(err, "%s: tensor '%.200s': data_offsets [%llu, %llu] lie beyond the data "
                       "section (%llu bytes): the file is truncated or its header is wrong",
                       path, name, (unsigned long long)begin, (unsigned long long)end,
                       (unsigned long long)data_len);
    if (end - begin != need) {
        char sh[160];
        return kr_errf(err, "%s: tensor '%.200s': data_offsets [%llu, %llu] hold %llu bytes but "
                       "shape %s of %s needs %llu", path, name, (unsigned long long)begin,
                       (unsigned long long)end, (unsigned long long)(end - begin),
                       kr_st_shape_str(t->shape, nd, sh, sizeof sh), t->dtype_name,
                       (unsigned long long)need);
    }
    t->nbytes = need;
    t->data = data + begin;
    return KR_OK;
}

int kr_st_parse(const void *buf, size_t len, const char *path, kr_st_file **out, char *err)
{
    const uint8_t *bytes = buf;
    if (!path) path = "<memory>";
    if (len < 8)
        return kr_errf(err, "%s: %zu bytes is too short for a safetensors file (needs an 8-byte "
                       "header length)", path, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | bytes[i];
    if (hlen > len - 8)
        return kr_errf(err, "%s: header length %llu exceeds the file (%zu bytes): truncated, or "
                       "not a safetensors file", path, (unsigned long long)hlen, len);
    if (hlen > KR_ST_MAX_HEADER)
        return kr_errf(err, "%s: header length %llu is above the %u-byte limit", path,
                       (unsigned long long)hlen, KR_ST_MAX_HEADER);
    if (hlen < 2 || bytes[8] != '{')
        return kr_errf(err, "%s: header does not start with a JSON object: not a safetensors "
                       "file", path);

    const char *hdr = (const char *)bytes + 8, *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!root) {
        size_t at = end && end >= hdr && end <= hdr + hlen ? (size_t)(end - hdr) : 0;
        return kr_errf(err, "%s: header is not valid JSON (near byte %zu of %llu)", path, at,
                       (unsigned long long)hlen);
    }
    /* only padding may follow the object */
    for (const char *p = end; p && p < hdr + hlen; p++)
        if (*p != ' ' && *p != '\n' && *p != '\r' && *p != '\t' && *p != 0) {
            cJSON_Delete(root);
            return kr_errf(err, "%s: header has bytes after its JSON object", path);
        }

    kr_st_file *f = calloc(1, sizeof *f);
    if (!f) goto err_oom_json;
    f->path = strdup(path);
    if (!f->path) goto err_oom_file;
    f->bytes = bytes;
    f->len = len;
    if (!cJSON_IsObject(root)) {
        kr_errf(err, "%s: header is not a JSON object", path);
        goto err_file;
    }
    int cap = 0;
    for (const cJSON *e = root->child; e; e = e->next)
        if (strcmp(e->string, "__metadata__") != 0) cap++;
    f->tensors = calloc((size_t)(cap ? cap : 1), sizeof *f->tensors);
    if (!f->tensors) goto err_oom_file;
    const uint8_t *data = bytes + 8 + hlen;
    uint64_t data_len = (uint64_t)len - 8 - hlen;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) continue;
        kr_st_tensor *t = &f->tensors[f->n_tensors];
        t->name = strdup(e->string);
        if (!t->name) goto err_oom_file;
        f->n_tensors++;
        if (st_entry(e, path, data, data_len, t, err)) goto err_file;
    }
    qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, st_cmp_name);
    for (int i = 1; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0) {
            kr_errf(err, "%s: tensor '%.200s' appears twice in the header", path,
                    f->tensors[i].name);
            goto err_file;
        }
    cJSON_Delete(root);
    *out = f;
    return KR_OK;

err_oom_file:
    kr_errf(err, "%s: out of memory parsing the header", path);
err_file:
    kr_st_close(f);
    cJSON_Delete(root);
    return -1;
err_oom_json:
    cJSON_Delete(root);
    return kr_errf(err, "%s: out of memory parsing the header", path);
}

int kr_st_open(const char *path, kr_st_file **out, char *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kr_errf(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        kr_errf(err, "%s: cannot stat: %s", path, strerror(errno));
        goto err_fd;
    }
    if (!S_ISREG(st.st_mode)) {
        kr_errf(err, "%s: not a regular file", path);
        goto err_fd;
    }
    size_t len = (size_t)st.st_size;
    if (len < 8) {
        kr_errf(err, "%s: %zu bytes is too short for a safetensors file", path, len);
        goto err_fd;
    }
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
        kr_errf(err, "%s: cannot mmap %zu bytes: %s", path, len, strerror(errno));
        goto err_fd;
    }
    close(fd); /* the mapping keeps the file */
    kr_st_file *f;
    if (kr_st_parse(map, len, path, &f, err)) goto err_map;
    f->map = map;
    f->map_len = len;
    *out = f;
    return KR_OK;

err_map:
    munmap(map, len);
    return -1;
err_fd:
    close(fd);
    return -1;
}

void kr_st_close(kr_st_file *f)
{
    if (!f) return;
    for (int i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    if (f->map) munmap(f->map, f->map_len);
    free(f->path);
    free(f);
}

const kr_st_tensor *kr_st_find(const kr_st_file *f, const char *name)
{
    kr_st_tensor key = {.name = (char *)name};
    return bsearch(&key, f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, st_cmp_name);
}

int kr_st_get(const kr_st_file *f, const char *name, const kr_st_tensor **out, char *err)
{
    const kr_st_tensor *t = kr_st_find(f, name);
    if (!t) return kr_errf(err, "%s: missing tensor '%.200s'", f->path, name);
    if (!t->supported)
        return kr_errf(err, "%s: tensor '%.200s' has dtype %s, which is not supported (BF16, F16 "
                       "or F32)", f->path, name, t->dtype_name);
    *out = t;
    return KR_OK;
}
