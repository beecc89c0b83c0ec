/* cli.c - see cli.h. */
#include "cli.h"
#include "kr.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "kvrelay";

void cli_init(char **argv)
{
    const char *slash = strrchr(argv[0], '/');
    prog = slash ? slash + 1 : argv[0];
    if (getenv("OPENBLAS_NUM_THREADS")) return;
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    execv("/proc/self/exe", argv);
    /* no /proc: carry on; only the first ~0.1 s is slower */
}

void cli_die(int status, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

int cli_flag_u64(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    char *end;
    errno = 0;
    if (*v == '-') return snprintf(err, cap, "%s: '%.64s' must not be negative", flag, v), -1;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end) return snprintf(err, cap, "%s: '%.64s' is not an unsigned integer", flag, v), -1;
    *(uint64_t *)dest = (uint64_t)x;
    return 0;
}

int cli_flag_id(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    cli_id_list *l = dest;
    if (l->n == CLI_MAX_IDS) return snprintf(err, cap, "%s: at most %d", flag, CLI_MAX_IDS), -1;
    /* the table parser's own integer check, so the messages are those of every other flag */
    int64_t id;
    const kc_flag one[] = {{.kind = KC_FLAG_INT64, .name = flag, .dest = &id, .min = 0, .max = l->max},
                           {.kind = KC_FLAG_END}};
    const kc_flags f = {.prog = flag, .usage = "", .table = one};
    char *argv[] = {(char *)flag, (char *)flag, (char *)v};
    int i = 1;
    if (kc_flags_parse(&f, 3, argv, &i, NULL, err, cap) != 0) return -1;
    l->ids[l->n++] = (uint32_t)id;
    return 0;
}

int32_t *cli_ids(const char *flag, const char *s, int *n_out)
{
    size_t cap = 64, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) cli_die(1, "out of memory");
    const char *p = s;
    for (;;) {
        while (*p == ' ' || *p == ',' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX ||
            (*end && *end != ' ' && *end != ',' && *end != '\n' && *end != '\t' && *end != '\r')) {
            int len = 0;
            while (p[len] && p[len] != ' ' && p[len] != ',' && len < 32) len++;
            cli_die(2, "%s: '%.*s' is not a token id (expected non-negative integers)", flag, len, p);
        }
        if (n == cap) {
            cap *= 2;
            int32_t *grown = realloc(ids, cap * sizeof *ids);
            if (!grown) cli_die(1, "out of memory");
            ids = grown;
        }
        ids[n++] = (int32_t)v;
        p = end;
    }
    *n_out = (int)n;
    return ids;
}

char *cli_read_stdin(size_t *len_out)
{
    return cli_read_file(stdin, len_out);
}

char *cli_read_file(FILE *in, size_t *len_out)
{
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) cli_die(1, "out of memory");
    for (;;) {
        if (n + 1 >= cap) {
            cap *= 2;
            char *grown = realloc(buf, cap);
            if (!grown) cli_die(1, "out of memory");
            buf = grown;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, in);
        n += got;
        if (got == 0) break;
    }
    if (ferror(in)) cli_die(1, "read error: %s", strerror(errno));
    buf[n] = 0;
    *len_out = n;
    return buf;
}

double cli_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const kc_flag_choice cli_backends[] = {{"cpu", KR_BACKEND_CPU}, {"cuda", KR_BACKEND_CUDA}, {NULL, 0}};
const kc_flag_choice cli_weight_dtypes[] = {
    {"bf16", KR_DTYPE_BF16}, {"f16", KR_DTYPE_F16}, {"f32", KR_DTYPE_F32}, {NULL, 0}};
const kc_flag_choice cli_kv_dtypes[] = {{"f32", KR_KV_DTYPE_F32},   {"bf16", KR_KV_DTYPE_BF16},
                                        {"f16", KR_KV_DTYPE_F16},   {"auto", KR_KV_DTYPE_AUTO},
                                        {NULL, 0}};

void cli_json_exact(double v, char *buf, size_t cap)
{
    if (isfinite(v)) snprintf(buf, cap, "%.17g", v);
    else snprintf(buf, cap, "null");
}
