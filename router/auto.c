/*
 * auto.c - kv_policy "auto" in the router (auto.h): the calibration table loaded at start-up,
 * the pressure from the node table, and a request's auto spec resolved through the rule
 * (adaptive.c) before validation parses the chosen spec like any other. Not the rule itself.
 * Tested by tests/integration/adaptive.sh.
 */
#include "auto.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How a missing table is made: said in every refusal. */
#define RT_AUTO_HOW "make one with tools/kvrelay-eval --model DIR --calibrate-out DIR/calibration.json " \
                    "(docs/adaptive.md)"

/* The file's bytes (malloc'd), NULL with errno. */
static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            char *b = realloc(buf, cap = cap ? 2 * cap : 65536);
            if (!b) break;
            buf = b;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    int bad = ferror(f) || !buf;
    fclose(f);
    if (bad) {
        free(buf);
        errno = EIO;
        return NULL;
    }
    *len = n;
    return buf;
}

/* A start-up refusal in err; -1. */
#define REFUSE(...) (snprintf(out_err, out_cap, __VA_ARGS__), -1)

int rt_auto_init(rt_router *rt, const char *calibration, const char *default_policy, const char *pressure,
                 char *out_err, size_t out_cap)
{
    struct rt_auto *a = calloc(1, sizeof *a);
    if (!a) return REFUSE("out of memory");
    rt->adaptive = a;
    if (pressure && rt_pressure_parse(pressure, &a->level) != 0)
        return REFUSE("--pressure: '%s' is not one of low, medium, high", pressure);
    a->pinned = pressure != NULL;
    if (calibration) snprintf(a->path, sizeof a->path, "%s", calibration);
    else snprintf(a->path, sizeof a->path, "%s/calibration.json", rt->model_dir);
    size_t len = 0;
    char *text = read_file(a->path, &len), err[512];
    if (!text && (calibration || errno != ENOENT))
        return REFUSE("--calibration %s: %s (%s)", a->path, strerror(errno), RT_AUTO_HOW);
    if (text) {
        int rc = rt_calib_parse(text, len, &a->table, err, sizeof err);
        free(text);
        if (rc != 0) return REFUSE("--calibration %s: %s (%s)", a->path, err, RT_AUTO_HOW);
        if (rt->fingerprint[0] && strcmp(rt->fingerprint, a->table->fingerprint) != 0)
            return REFUSE("--calibration %s was measured on model fingerprint %s, and --fingerprint is %s: another "
                          "model (%s)", a->path, a->table->fingerprint, rt->fingerprint, RT_AUTO_HOW);
        int dropped;
        if (rt_calib_bind(a->table, &rt->cfg, rt->policy_dir, &dropped, err, sizeof err) != 0)
            return REFUSE("--calibration %s: %s", a->path, err);
        if (dropped)
            kc_warn(NULL, "calibration %s: %d of %d points cannot be served by this router and are never chosen "
                    "(first: %s)", a->path, dropped, a->table->n_points, err);
        kc_info(NULL, "calibration %s: %d points of model %s (fingerprint %s), lengths %d..%d, %d tasks", a->path,
                a->table->n_points, a->table->model, a->table->fingerprint, a->table->lengths[0],
                a->table->lengths[a->table->n_lengths - 1], a->table->n_tasks);
    } else {
        kc_info(NULL, "no calibration table at %s: kv_policy auto is refused (%s)", a->path, RT_AUTO_HOW);
    }
    if (default_policy) {
        char spec[RT_AUTO_SPEC_MAX];
        kr_policy *p;
        rt_auto_ask ask;
        if (rt_auto_is(default_policy)) {
            if (rt_auto_parse(default_policy, &ask, err, sizeof err) != 0) return REFUSE("--default-policy: %s", err);
            if (!a->table) return REFUSE("--default-policy %s: no calibration table at %s (%s)", default_policy, a->path, RT_AUTO_HOW);
            if (ask.task[0] && rt_calib_task(a->table, ask.task) < 0)
                return REFUSE("--default-policy %s: the table %s scores no task '%s'", default_policy, a->path, ask.task);
        } else if (rt_policy_resolve(default_policy, rt->policy_dir, spec, sizeof spec, err, sizeof err) != 0 ||
                   kr_policy_parse(spec, &rt->cfg, &p, err) != KR_OK) {
            return REFUSE("--default-policy %s: %s", default_policy, err);
        } else {
            kr_policy_free(p);
        }
        a->default_policy = default_policy;
    }
    return 0;
}
#undef REFUSE

void rt_auto_free(rt_router *rt)
{
    if (!rt->adaptive) return;
    rt_calib_free(rt->adaptive->table);
    free(rt->adaptive);
    rt->adaptive = NULL;
}

const char *rt_auto_default(const rt_router *rt)
{
    return rt->adaptive && rt->adaptive->default_policy ? rt->adaptive->default_policy : "";
}

rt_pressure rt_auto_pressure(rt_router *rt, uint64_t *free_blocks, uint64_t *total_blocks, int *queued)
{
    uint64_t free_sum = 0, total = 0;
    pthread_mutex_lock(&rt->mu);
    for (int i = 0; i < rt->n_nodes; i++) {
        const rt_node *x = rt->nodes[i];
        if (x->role != RT_ROLE_DECODE || x->gone || !x->reachable || x->fingerprint_bad ||
            x->view != KVRELAY__V1__NODE_STATE__NODE_STATE_SERVING)
            continue;
        /* its last Status, less what this router reserved there since (as placement counts) */
        int64_t f = (int64_t)x->free_blocks - (x->own_blocks - x->own_blocks_polled);
        free_sum += f > 0 ? (uint64_t)f : 0;
        total += x->total_blocks;
    }
    pthread_mutex_unlock(&rt->mu);
    *free_blocks = free_sum < total ? free_sum : total;
    *total_blocks = total;
    *queued = atomic_load(&rt->queued);
    const struct rt_auto *a = rt->adaptive;
    return a && a->pinned ? a->level : rt_pressure_level(*free_blocks, total, *queued);
}

/* The model the nodes serve: --fingerprint or etcd's, else the first that a Status reported. */
static void served_fingerprint(rt_router *rt, char out[17])
{
    out[0] = 0;
    pthread_mutex_lock(&rt->mu);
    if (rt->fingerprint[0]) memcpy(out, rt->fingerprint, 17);
    for (int i = 0; !out[0] && i < rt->n_nodes; i++)
        if (!rt->nodes[i]->gone && rt->nodes[i]->reachable && rt->nodes[i]->status_fingerprint[0])
            memcpy(out, rt->nodes[i]->status_fingerprint, 17);
    pthread_mutex_unlock(&rt->mu);
}

grpc_status_code rt_auto_select(rt_router *rt, const char *request_id, const char *asked, int prompt_tokens,
                                int max_tokens, rt_auto_said *said, kc_status *st)
{
    const struct rt_auto *a = rt->adaptive;
    char err[512];
    rt_auto_ask ask;
    if (rt_auto_parse(asked, &ask, err, sizeof err) != 0)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "kv_policy '%.64s': %s", asked, err), st->code;
    if (!a || !a->table)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                             "kv_policy '%.64s': the router has no calibration table for model %.64s: %s", asked,
                             rt->served_model, RT_AUTO_HOW), st->code;
    char fp[17];
    served_fingerprint(rt, fp);
    if (fp[0] && strcmp(fp, a->table->fingerprint) != 0)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                             "kv_policy '%.64s': the router's calibration table was measured on model fingerprint "
                             "%s, and the nodes serve %s: %s", asked, a->table->fingerprint, fp, RT_AUTO_HOW), st->code;
    uint64_t free_blocks, total;
    int queued;
    rt_pressure level = rt_auto_pressure(rt, &free_blocks, &total, &queued);
    rt_auto_choice c;
    if (rt_auto_choose(a->table, &ask, prompt_tokens, max_tokens, level, &c, err, sizeof err) != 0)
        return kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "kv_policy '%.64s': %s", asked, err), st->code;
    said->on = 1;
    said->score = c.score;
    said->level = level;
    memcpy(said->spec, c.spec, sizeof said->spec); /* the same size: a table's spec fits */
    snprintf(said->reason, sizeof said->reason, "%s", c.reason);
    /* a series per spec the table can give and per level (the registry takes one label each) */
    char label[RT_AUTO_SPEC_MAX + 16];
    snprintf(label, sizeof label, "policy=\"%s\"", c.spec);
    kc_counter_inc(kc_counter_add(rt->m.reg, "kvrelay_auto_choices_total",
                                  "Requests with kv_policy auto, by the spec the router chose", label), 1);
    snprintf(label, sizeof label, "pressure=\"%s\"", rt_pressure_name(level));
    kc_counter_inc(kc_counter_add(rt->m.reg, "kvrelay_auto_pressure_total",
                                  "Requests with kv_policy auto, by the pressure level they were chosen at", label), 1);
    kc_info(request_id, "kv_policy %s -> '%s' (score %.3f, %" PRIu64 " decode blocks of full's %" PRIu64
            ", pressure %s: %" PRIu64 "/%" PRIu64 " blocks free, %d queued): %s",
            asked, c.spec, c.score, (uint64_t)c.blocks, (uint64_t)c.full_blocks, rt_pressure_name(level), free_blocks,
            total, queued, c.reason);
    return GRPC_STATUS_OK;
}
