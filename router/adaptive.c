/*
 * adaptive.c - the calibration table's parser and kv_policy "auto"'s selection rule
 * (adaptive.h; docs/adaptive.md says why each rule is what it is). Pure: the router's glue
 * (auto.c) loads the file, measures the pressure and says the choice back.
 * Not the table's maker (tools/kvrelay-eval --calibrate-out). Run: ctest -R 'router_adaptive|fuzz_calibration'.
 */
#include "adaptive.h"
#include "router.h" /* rt_policy_resolve: a point's file keys are resolved as a client's are */

#include <cjson/cJSON.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -1;
}

double rt_wilson_lower(double p, int n, double z)
{
    if (n <= 0 || !(p >= 0.0 && p <= 1.0)) return 0.0;
    const double z2n = z * z / (double)n;
    const double center = p + z2n / 2.0;
    const double half = z * sqrt(p * (1.0 - p) / (double)n + z2n / (4.0 * (double)n));
    const double lower = (center - half) / (1.0 + z2n);
    return lower > 0.0 ? lower : 0.0;
}

/* ------------------------------------------------------------------ the table */

/* A number member in [lo, hi]; -1 with err naming `where`.`key` otherwise. */
static int get_num(const cJSON *o, const char *key, double lo, double hi, const char *where, double *out, char *err,
                   size_t cap)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v)) return fail(err, cap, "%s.%s: missing or not a number", where, key);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi))
        return fail(err, cap, "%s.%s: %g is outside [%g, %g]", where, key, v->valuedouble, lo, hi);
    *out = v->valuedouble;
    return 0;
}

/* An integer member in [lo, hi]. */
static int get_int(const cJSON *o, const char *key, int lo, int hi, const char *where, int *out, char *err, size_t cap)
{
    double d;
    if (get_num(o, key, lo, hi, where, &d, err, cap) != 0) return -1;
    if (d != floor(d)) return fail(err, cap, "%s.%s: %g is not an integer", where, key, d);
    *out = (int)d;
    return 0;
}

static int parse_head(const cJSON *root, rt_calib *t, char *err, size_t cap)
{
    if (!cJSON_IsObject(root)) return fail(err, cap, "not a JSON object");
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(root, "kind");
    if (!cJSON_IsString(kind) || strcmp(kind->valuestring, "kvrelay-calibration") != 0)
        return fail(err, cap, "kind: not \"kvrelay-calibration\" (not a calibration table)");
    if (get_int(root, "format", 1, 1000000, "table", &t->format, err, cap) != 0) return -1;
    if (t->format != RT_CALIB_FORMAT)
        return fail(err, cap, "format: %d, and this router reads format %d", t->format, RT_CALIB_FORMAT);
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *fp = cJSON_GetObjectItemCaseSensitive(model, "fingerprint");
    if (!cJSON_IsString(fp) || strlen(fp->valuestring) != 16 || strspn(fp->valuestring, "0123456789abcdef") != 16)
        return fail(err, cap, "model.fingerprint: missing or not 16 lower-case hex digits");
    memcpy(t->fingerprint, fp->valuestring, 17);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(model, "name");
    snprintf(t->model, sizeof t->model, "%s", cJSON_IsString(name) ? name->valuestring : "?");
    if (get_int(root, "chunk", 1, 1 << 20, "table", &t->chunk, err, cap) != 0 ||
        get_int(root, "seed", -2147483647, 2147483647, "table", &t->seed, err, cap) != 0 ||
        get_int(root, "block_size", 1, 4096, "table", &t->block_size, err, cap) != 0)
        return -1;
    const cJSON *tasks = cJSON_GetObjectItemCaseSensitive(root, "tasks"), *it;
    if (!cJSON_IsArray(tasks) || cJSON_GetArraySize(tasks) < 1 || cJSON_GetArraySize(tasks) > RT_CALIB_TASKS_MAX)
        return fail(err, cap, "tasks: not an array of 1 to %d task names", RT_CALIB_TASKS_MAX);
    cJSON_ArrayForEach(it, tasks) {
        if (!cJSON_IsString(it) || !it->valuestring[0] || strlen(it->valuestring) >= sizeof t->tasks[0])
            return fail(err, cap, "tasks[%d]: not a task name of 1 to %zu bytes", t->n_tasks, sizeof t->tasks[0] - 1);
        if (rt_calib_task(t, it->valuestring) >= 0) return fail(err, cap, "tasks: '%s' twice", it->valuestring);
        snprintf(t->tasks[t->n_tasks++], sizeof t->tasks[0], "%s", it->valuestring);
    }
    const cJSON *lengths = cJSON_GetObjectItemCaseSensitive(root, "lengths");
    if (!cJSON_IsArray(lengths) || cJSON_GetArraySize(lengths) < 1 || cJSON_GetArraySize(lengths) > RT_CALIB_LENGTHS_MAX)
        return fail(err, cap, "lengths: not an array of 1 to %d prompt lengths", RT_CALIB_LENGTHS_MAX);
    cJSON_ArrayForEach(it, lengths) {
        double d = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!(d >= 1 && d <= 1 << 24) || d != floor(d)) return fail(err, cap, "lengths[%d]: not a token count", t->n_lengths);
        if (t->n_lengths && (int)d <= t->lengths[t->n_lengths - 1])
            return fail(err, cap, "lengths[%d]: %d is not above the one before (ascending, distinct)", t->n_lengths, (int)d);
        t->lengths[t->n_lengths++] = (int)d;
    }
    return 0;
}

static int parse_scores(const cJSON *scores, rt_calib *t, rt_calib_point *pt, const char *where, char *err, size_t cap)
{
    if (!cJSON_IsObject(scores)) return fail(err, cap, "%s.scores: missing or not an object", where);
    const cJSON *s;
    cJSON_ArrayForEach(s, scores) {
        int k = rt_calib_task(t, s->string);
        if (k < 0) return fail(err, cap, "%s.scores: task '%.32s' is not in tasks", where, s->string);
        char w[96];
        snprintf(w, sizeof w, "%s.scores.%s", where, t->tasks[k]);
        rt_calib_score *sc = &pt->task[k];
        if (!cJSON_IsObject(s)) return fail(err, cap, "%s: not an object", w);
        if (get_num(s, "policy", 0, 1, w, &sc->policy, err, cap) != 0 || get_num(s, "full", 0, 1, w, &sc->full, err, cap) != 0 ||
            get_int(s, "cases", 1, 1000000000, w, &sc->cases, err, cap) != 0)
            return -1;
        /* full 0 says nothing of what the policy keeps: no score for the task */
        sc->present = sc->full > 0;
        /* a point is never shown to keep more than all of full's score */
        sc->lower = sc->present ? fmin(1.0, rt_wilson_lower(sc->policy, sc->cases, RT_AUTO_Z) / sc->full) : 0.0;
    }
    return 0;
}

static int parse_points(const cJSON *root, rt_calib *t, char *err, size_t cap)
{
    const cJSON *points = cJSON_GetObjectItemCaseSensitive(root, "points"), *p;
    if (!cJSON_IsArray(points) || cJSON_GetArraySize(points) > RT_CALIB_POINTS_MAX)
        return fail(err, cap, "points: not an array of at most %d points", RT_CALIB_POINTS_MAX);
    int n = cJSON_GetArraySize(points);
    t->points = calloc(n ? (size_t)n : 1, sizeof *t->points);
    if (!t->points) return fail(err, cap, "out of memory");
    cJSON_ArrayForEach(p, points) {
        char where[32];
        snprintf(where, sizeof where, "points[%d]", t->n_points);
        rt_calib_point *pt = &t->points[t->n_points];
        const cJSON *spec = cJSON_GetObjectItemCaseSensitive(p, "spec");
        if (!cJSON_IsString(spec) || !spec->valuestring[0] || strlen(spec->valuestring) >= RT_AUTO_SPEC_MAX)
            return fail(err, cap, "%s.spec: not a policy spec of 1 to %d bytes", where, RT_AUTO_SPEC_MAX - 1);
        if (rt_auto_is(spec->valuestring)) return fail(err, cap, "%s.spec: 'auto' is not a calibrated policy", where);
        if (get_int(p, "length", 1, 1 << 24, where, &pt->length, err, cap) != 0) return -1;
        int known = 0;
        for (int i = 0; i < t->n_lengths; i++) known |= t->lengths[i] == pt->length;
        if (!known) return fail(err, cap, "%s.length: %d is not one of lengths", where, pt->length);
        pt->spec = strdup(spec->valuestring);
        if (!pt->spec) return fail(err, cap, "out of memory");
        t->n_points++;
        if (parse_scores(cJSON_GetObjectItemCaseSensitive(p, "scores"), t, pt, where, err, cap) != 0) return -1;
    }
    return 0;
}

int rt_calib_parse(const char *json, size_t len, rt_calib **out, char *err, size_t cap)
{
    rt_calib *t = calloc(1, sizeof *t);
    if (!t) return fail(err, cap, "out of memory");
    cJSON *root = cJSON_ParseWithLength(json, len);
    int rc = -1;
    if (!root) fail(err, cap, "not valid JSON");
    else if (parse_head(root, t, err, cap) == 0 && parse_points(root, t, err, cap) == 0) rc = 0;
    cJSON_Delete(root);
    if (rc != 0) {
        rt_calib_free(t);
        return -1;
    }
    *out = t;
    return 0;
}

int rt_calib_task(const rt_calib *t, const char *name)
{
    for (int i = 0; i < t->n_tasks; i++)
        if (!strcmp(t->tasks[i], name)) return i;
    return -1;
}

int rt_calib_bind(rt_calib *t, const kr_config *cfg, const char *policy_dir, int *dropped, char *err, size_t cap)
{
    char kerr[KR_ERR_MAX];
    *dropped = 0;
    if (kr_kv_pool_create(cfg->head_dim, t->block_size, 1, KR_DTYPE_F32, &t->pool, kerr) != KR_OK)
        return fail(err, cap, "a pool of block size %d: %s", t->block_size, kerr);
    t->n_layers = cfg->n_layers;
    t->n_kv_heads = cfg->n_kv_heads;
    err[0] = 0;
    for (int i = 0; i < t->n_points; i++) {
        rt_calib_point *pt = &t->points[i];
        char spec[RT_AUTO_SPEC_MAX], perr[KR_ERR_MAX];
        if (rt_policy_resolve(pt->spec, policy_dir, spec, sizeof spec, perr, sizeof perr) != 0 ||
            kr_policy_parse(spec, cfg, &pt->policy, perr) != KR_OK) {
            pt->policy = NULL;
            if (!(*dropped)++) snprintf(err, cap, "points[%d] '%.200s': %s", i, pt->spec, perr);
        }
    }
    return 0;
}

void rt_calib_free(rt_calib *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_points; i++) {
        free(t->points[i].spec);
        kr_policy_free(t->points[i].policy);
    }
    free(t->points);
    kr_kv_pool_free(t->pool);
    free(t);
}

/* ------------------------------------------------------------------ the ask */

int rt_auto_is(const char *spec)
{
    return !strncmp(spec, "auto", 4) && (spec[4] == 0 || spec[4] == ':');
}

int rt_auto_parse(const char *spec, rt_auto_ask *out, char *err, size_t cap)
{
    rt_auto_ask a = {.floor = RT_AUTO_DEFAULT_FLOOR};
    if (!rt_auto_is(spec)) return fail(err, cap, "not an auto spec");
    const char *p = spec[4] ? spec + 5 : spec + 4;
    while (*p) {
        const char *end = strchr(p, ','), *eq = strchr(p, '=');
        size_t item = end ? (size_t)(end - p) : strlen(p);
        if (!eq || eq > p + item)
            return fail(err, cap, "auto: '%.*s' is not key=value (keys: floor, task)", (int)(item > 64 ? 64 : item), p);
        size_t klen = (size_t)(eq - p), vlen = item - klen - 1;
        char v[32];
        if (vlen == 0 || vlen >= sizeof v)
            return fail(err, cap, "auto: %.*s: empty or too long a value", (int)(klen > 32 ? 32 : klen), p);
        memcpy(v, eq + 1, vlen);
        v[vlen] = 0;
        if (klen == 5 && !memcmp(p, "floor", 5)) {
            char *e;
            double f = strtod(v, &e);
            if (*e || !(f > 0.0 && f <= 1.0))
                return fail(err, cap, "auto: floor=%s: the floor is a share of full's score in (0, 1]", v);
            a.floor = f;
        } else if (klen == 4 && !memcmp(p, "task", 4)) {
            if (strcmp(v, "kv") && strcmp(v, "copy") && strcmp(v, "text"))
                return fail(err, cap, "auto: task=%s: unknown task (tasks: kv, copy, text)", v);
            snprintf(a.task, sizeof a.task, "%.15s", v);
        } else {
            return fail(err, cap, "auto: unknown key '%.*s' (keys: floor, task)", (int)(klen > 32 ? 32 : klen), p);
        }
        p += item;
        if (*p == ',') p++;
    }
    *out = a;
    return 0;
}

/* ------------------------------------------------------------------ the rule */

static int64_t blocks_of(const rt_calib *t, const kr_policy *p, int prompt_tokens, int max_tokens)
{
    return kr_seq_blocks_bound(t->pool, p, t->n_layers, t->n_kv_heads, prompt_tokens, max_tokens > 0 ? max_tokens - 1 : 0);
}

/* The point's guarantee for the ask: its lower bound for the task, or the smallest over every
 * task of the table; -1 when a needed score is missing. */
static double guarantee(const rt_calib *t, const rt_calib_point *pt, int task)
{
    if (task >= 0) return pt->task[task].present ? pt->task[task].lower : -1.0;
    double g = INFINITY;
    for (int k = 0; k < t->n_tasks; k++) {
        if (!pt->task[k].present) return -1.0;
        if (pt->task[k].lower < g) g = pt->task[k].lower;
    }
    return g;
}

static void choose_full(rt_auto_choice *c, const char *fmt, ...)
{
    va_list ap;
    snprintf(c->spec, sizeof c->spec, "full");
    c->score = 1.0;
    c->blocks = c->full_blocks;
    va_start(ap, fmt);
    vsnprintf(c->reason, sizeof c->reason, fmt, ap);
    va_end(ap);
}

int rt_auto_choose(const rt_calib *t, const rt_auto_ask *ask, int prompt_tokens, int max_tokens, rt_pressure level,
                   rt_auto_choice *out, char *err, size_t cap)
{
    int task = -1;
    if (ask->task[0] && (task = rt_calib_task(t, ask->task)) < 0)
        return fail(err, cap, "auto: task=%s: the calibration table of %s scores no such task", ask->task, t->model);
    rt_auto_choice c = {.level = level};
    c.full_blocks = blocks_of(t, NULL, prompt_tokens, max_tokens);
    const char *lvl = rt_pressure_name(level);
    if (ask->floor >= 1.0) {
        choose_full(&c, "floor=1: full");
    } else if (level == RT_PRESSURE_LOW) {
        choose_full(&c, "low pressure: full");
    } else {
        for (int i = 0; i < t->n_lengths && !c.length; i++)
            if (t->lengths[i] >= prompt_tokens) c.length = t->lengths[i];
        /* medium pressure stops half way from full's 1 to the floor */
        const double target = level == RT_PRESSURE_MEDIUM ? ask->floor + (1.0 - ask->floor) / 2.0 : ask->floor;
        int best = -1;
        double best_g = 0;
        int64_t best_b = 0;
        for (int i = 0; c.length && i < t->n_points; i++) {
            const rt_calib_point *pt = &t->points[i];
            if (pt->length != c.length || !pt->policy || !strcmp(pt->spec, "full")) continue;
            double g = guarantee(t, pt, task);
            if (!(g >= target)) continue;
            int64_t b = blocks_of(t, pt->policy, prompt_tokens, max_tokens);
            if (b < 0) continue;
            if (best < 0 || b < best_b || (b == best_b && g > best_g)) best = i, best_b = b, best_g = g;
        }
        if (!c.length)
            choose_full(&c, "%s pressure: a prompt of %d tokens is longer than every calibrated length: full", lvl,
                        prompt_tokens);
        else if (best < 0)
            choose_full(&c, "%s pressure: no point at length %d holds %.3f for %s: full", lvl, c.length, target,
                        task >= 0 ? t->tasks[task] : "every task");
        else if (best_b >= c.full_blocks)
            choose_full(&c, "%s pressure: no point holding %.3f reserves fewer blocks than full", lvl, target);
        else {
            snprintf(c.spec, sizeof c.spec, "%s", t->points[best].spec);
            c.score = best_g;
            c.blocks = best_b;
            snprintf(c.reason, sizeof c.reason, "%s pressure: fewest blocks (%lld of full's %lld) holding %.3f at length %d",
                     lvl, (long long)best_b, (long long)c.full_blocks, target, c.length);
        }
    }
    *out = c;
    return 0;
}

/* ------------------------------------------------------------------ pressure */

rt_pressure rt_pressure_level(uint64_t free_blocks, uint64_t total_blocks, int queued)
{
    if (queued > 0) return RT_PRESSURE_HIGH;
    if (total_blocks == 0) return RT_PRESSURE_LOW; /* nothing known yet: no reason to compress */
    if (free_blocks * 4 < total_blocks) return RT_PRESSURE_HIGH;
    if (free_blocks * 2 < total_blocks) return RT_PRESSURE_MEDIUM;
    return RT_PRESSURE_LOW;
}

static const char *const pressure_names[RT_PRESSURE_LEVELS] = {"low", "medium", "high"};

const char *rt_pressure_name(rt_pressure p)
{
    return (unsigned)p < RT_PRESSURE_LEVELS ? pressure_names[p] : "?";
}

int rt_pressure_parse(const char *s, rt_pressure *out)
{
    for (int i = 0; i < RT_PRESSURE_LEVELS; i++)
        if (!strcmp(s, pressure_names[i])) {
            *out = (rt_pressure)i;
            return 0;
        }
    return -1;
}
