/*
 * cli.h - small helpers shared by the engine command-line programs in tools/: id lists, reading
 * stdin, and what their kc_flag tables (common/flags.h) share beyond the kinds flags.h has:
 * callbacks for unsigned 64-bit values and repeatable token ids, the --backend and weight
 * --dtype choices. Every program declares its flags in such a table, which parses argv and
 * prints its --help; every parse error names the flag and the bad value and exits with status 2.
 */
#ifndef KR_CLI_H
#define KR_CLI_H

#include "flags.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Prints "PROG: message" to stderr and exits with `status`. */
void cli_die(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
/* First call of every program: names it for messages, and makes sure OpenBLAS starts
 * single-threaded. The engine calls sgemm from its own threads; OpenBLAS's pthread build
 * otherwise starts one thread per core at load, which spins for ~0.1 s and competes with the
 * engine's workers. OPENBLAS_NUM_THREADS is only read at load, so the program re-executes
 * itself once with it set (unless the user set it). */
void cli_init(char **argv);

/* KC_FLAG_FUNC callbacks (flags.h's kc_flag_fn; dest in parentheses). */
/* (uint64_t) 0..UINT64_MAX: "'-1' must not be negative", "'x' is not an unsigned integer" */
int cli_flag_u64(void *dest, const char *flag, const char *v, char *err, size_t cap);
/* (cli_id_list) a repeatable id flag (--stop-id): each use appends one id in [0, max]; an
 * out-of-range or non-integer value is refused as a KC_FLAG_INT64 flag's would be. */
enum { CLI_MAX_IDS = 64 };
typedef struct cli_id_list {
    int64_t max; /* the largest id accepted; set before parsing */
    int n;
    uint32_t ids[CLI_MAX_IDS]; /* [n] in the order given */
} cli_id_list;
int cli_flag_id(void *dest, const char *flag, const char *v, char *err, size_t cap);

/* Parses "1 2 3" (spaces, commas or newlines between) into a malloc'd array; dies on a bad
 * entry, naming it. */
int32_t *cli_ids(const char *flag, const char *s, int *n_out);
/* Reads all of a stream into a malloc'd NUL-terminated buffer. */
char *cli_read_file(FILE *f, size_t *len_out);
char *cli_read_stdin(size_t *len_out);
/* --backend's values for a KC_FLAG_CHOICE entry: cpu and cuda, as kr_backend_kind. */
extern const kc_flag_choice cli_backends[];
/* --dtype's values for weights: bf16, f16 and f32, as kr_dtype. */
extern const kc_flag_choice cli_weight_dtypes[];
/* --kv-cache-dtype's values: f32, bf16, f16 and auto (the weights' dtype), as kr_kv_dtype. */
extern const kc_flag_choice cli_kv_dtypes[];
#define CLI_KV_DTYPE_HELP "KV cache dtype: f32, bf16, f16, or auto (the weights' dtype; f32 on the CUDA backend)"
/* A JSON number that parses back to exactly `v` ("%.17g"; cJSON's own printer settles for 15
 * digits when they compare nearly equal), or "null" when v is not finite. For values that
 * must compare bit for bit, e.g. log-probabilities (float32 widened to double). */
void cli_json_exact(double v, char *buf, size_t cap);
/* Seconds on a monotonic clock. */
double cli_now(void);

#endif
