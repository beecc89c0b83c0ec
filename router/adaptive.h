/*
 * adaptive.h - kv_policy "auto" (docs/adaptive.md): a model's calibration table (what each
 * policy spec kept of the full cache's score, per task and prompt-length bucket, measured by
 * kvrelay-eval --calibrate-out), the memory-pressure levels, and the selection rule that picks a
 * request's spec from the table: among the points whose score's lower confidence bound holds the
 * floor, the one that reserves the fewest decode blocks, moving toward the floor as pressure
 * rises. Pure: no network, no router state (router/auto.c feeds it the pressure and the
 * request). Tested by tests/unit/test_router_adaptive.c; the parser by tests/fuzz/fuzz_calibration.c.
 */
#ifndef RT_ADAPTIVE_H
#define RT_ADAPTIVE_H

#include "kr.h"

#include <stddef.h>
#include <stdint.h>

#define RT_CALIB_FORMAT 1 /* the table's "format" this parser reads */
#define RT_CALIB_TASKS_MAX 8
#define RT_CALIB_LENGTHS_MAX 32
#define RT_CALIB_POINTS_MAX 4096
#define RT_AUTO_Z 1.6448536269514722 /* one-sided 95% normal quantile: the Wilson bound's z */
#define RT_AUTO_DEFAULT_FLOOR 0.95 /* "auto" without floor= */
#define RT_AUTO_SPEC_MAX 1024 /* bytes of a chosen spec, as rt_req.policy */

/* The decode pools' pressure (rt_pressure_level). */
typedef enum rt_pressure {
    RT_PRESSURE_LOW = 0, /* at least half of the decode blocks free and nobody queued: full */
    RT_PRESSURE_MEDIUM, /* a quarter to a half free: half way from 1 down to the floor */
    RT_PRESSURE_HIGH, /* under a quarter free, or requests waiting for room: down to the floor */
    RT_PRESSURE_LEVELS
} rt_pressure;

/* One task's score of one point: `policy` measured on `cases` cases against full's `full`. */
typedef struct rt_calib_score {
    int present;
    double policy, full; /* accuracy (kv, copy) or top-1 agreement with full (text; full = 1) */
    int cases;
    double lower; /* the one-sided Wilson lower bound of policy at RT_AUTO_Z, over full, at most 1 */
} rt_calib_score;

/* One calibrated point: a spec measured at prompts of `length` tokens. */
typedef struct rt_calib_point {
    char *spec; /* as the table gives it (malloc'd) */
    int length;
    rt_calib_score task[RT_CALIB_TASKS_MAX]; /* indexed like rt_calib.tasks */
    kr_policy *policy; /* parsed by rt_calib_bind (NULL before, or when it did not parse) */
} rt_calib_point;

/* A calibration table, immutable once bound. */
typedef struct rt_calib {
    int format;
    char fingerprint[17]; /* the model's kr_model_fingerprint */
    char model[128]; /* the model directory's name, for messages */
    int chunk, seed, block_size;
    int n_tasks;
    char tasks[RT_CALIB_TASKS_MAX][16];
    int n_lengths;
    int lengths[RT_CALIB_LENGTHS_MAX]; /* ascending, distinct */
    int n_points;
    rt_calib_point *points;
    int n_layers, n_kv_heads; /* of the bound config */
    kr_kv_pool *pool; /* one block of block_size: what kr_seq_blocks_bound needs to count blocks */
} rt_calib;

/* Parses a table from JSON text (`len` bytes, need not be NUL-terminated), checked field by
 * field (docs/adaptive.md's schema, "format" RT_CALIB_FORMAT). On success *out is the table
 * (free with rt_calib_free); else -1 with err (cap bytes) naming the field. */
int rt_calib_parse(const char *json, size_t len, rt_calib **out, char *err, size_t cap);
/* Parses every point's spec for the model `cfg` (file keys resolved in policy_dir, as a client's
 * would be) so that the rule can count its blocks. A point whose spec does not parse is left out
 * of every choice; *dropped says how many (the first one's reason in err). Returns 0, or -1 with
 * err when the pool cannot be made. */
int rt_calib_bind(rt_calib *t, const kr_config *cfg, const char *policy_dir, int *dropped, char *err, size_t cap);
void rt_calib_free(rt_calib *t);
/* The index of task `name` in the table, -1 when it has none. */
int rt_calib_task(const rt_calib *t, const char *name);

/* A client's "auto" spec: auto, or auto:floor=F,task=T (either key optional, in any order). */
typedef struct rt_auto_ask {
    double floor; /* in (0, 1] */
    char task[16]; /* "" = every task of the table */
} rt_auto_ask;

/* 1 when spec asks for the adaptive policy ("auto" or "auto:..."). */
int rt_auto_is(const char *spec);
/* Parses an "auto" spec. Returns 0, or -1 with err: an unknown key, a floor outside (0, 1] or
 * not a number, a task other than kv, copy, text. */
int rt_auto_parse(const char *spec, rt_auto_ask *out, char *err, size_t cap);

/* What the rule chose. */
typedef struct rt_auto_choice {
    char spec[RT_AUTO_SPEC_MAX]; /* "full" or the point's spec */
    double score; /* the guarantee: the smallest lower bound over the tasks held (1 for full) */
    int64_t blocks; /* decode blocks the spec reserves for the request (at the table's block size) */
    int64_t full_blocks; /* what full would */
    int length; /* the bucket used (0: none) */
    rt_pressure level;
    char reason[200];
} rt_auto_choice;

/* The selection rule (docs/adaptive.md): for a prompt of prompt_tokens and max_tokens to
 * generate at pressure `level`. floor 1 and low pressure give full; otherwise the bucket is the
 * smallest calibrated length >= the prompt (longer than every bucket: full), the candidates
 * are its points whose lower bound >= the level's target for the asked task (every task of the
 * table when none is named), and the one with the fewest blocks wins (ties: the higher bound,
 * then the earlier in the table); full when none qualifies or full reserves no more. Returns 0,
 * or -1 with err when the ask names a task the table does not score. */
int rt_auto_choose(const rt_calib *t, const rt_auto_ask *ask, int prompt_tokens, int max_tokens, rt_pressure level,
                   rt_auto_choice *out, char *err, size_t cap);

/* The level from the serving decode nodes' free and total blocks and the admission FIFO. */
rt_pressure rt_pressure_level(uint64_t free_blocks, uint64_t total_blocks, int queued);
const char *rt_pressure_name(rt_pressure p);
/* "low", "medium", "high" -> *out; -1 otherwise. */
int rt_pressure_parse(const char *s, rt_pressure *out);
/* The one-sided Wilson score lower bound of a proportion p measured on n trials at z. */
double rt_wilson_lower(double p, int n, double z);

#endif /* RT_ADAPTIVE_H */
