/*
 * auto.h - kv_policy "auto" inside the router (docs/adaptive.md): the calibration table loaded
 * at start-up, --default-policy, the pressure measured from the node table and the admission
 * FIFO (or pinned by --pressure), and a request's auto spec turned into a real one before any
 * node sees it. The table and the rule themselves are adaptive.h's (pure); this is the glue.
 * Tested through the cluster: tests/integration/adaptive.sh.
 */
#ifndef RT_AUTO_H
#define RT_AUTO_H

#include "adaptive.h"
#include "router.h"

/* What the router keeps for auto, immutable after rt_auto_init. */
struct rt_auto {
    rt_calib *table; /* NULL: no table; auto requests are refused with how to make one */
    char path[1100]; /* where the table was looked for (a model directory + "/calibration.json") */
    const char *default_policy; /* --default-policy, or NULL */
    int pinned; /* --pressure: the level is `level`, whatever the pools say */
    rt_pressure level;
};

/* Start-up: loads `calibration` (NULL: MODEL_DIR/calibration.json, which may be missing) and
 * checks --default-policy and --pressure (NULL: measured). Returns 0, or -1 with err (cap bytes)
 * saying how to fix a bad table, a table of another model (--fingerprint), a bad default: the
 * router stops. rt_auto_free frees what it made either way. */
int rt_auto_init(rt_router *rt, const char *calibration, const char *default_policy, const char *pressure,
                 char *err, size_t cap);
/* Frees what rt_auto_init made (at exit, with no request left). */
void rt_auto_free(rt_router *rt);
/* The spec a request runs under when it named none: --default-policy, or "" (full). */
const char *rt_auto_default(const rt_router *rt);
/* The pressure now, with what it is made of (serving decode nodes' free and total blocks as
 * the router counts them, the admission FIFO's length). */
rt_pressure rt_auto_pressure(rt_router *rt, uint64_t *free_blocks, uint64_t *total_blocks, int *queued);

/* What auto chose for one request (rt_req.chosen): said back in Usage and the log line. */
typedef struct rt_auto_said {
    int on; /* the request asked for auto */
    char spec[RT_AUTO_SPEC_MAX]; /* the spec chosen, to serve the request with */
    double score;
    rt_pressure level;
    char reason[200];
} rt_auto_said;

/* Turns the auto spec `asked` into the spec to serve for a prompt of prompt_tokens and
 * max_tokens (said->spec), filling the rest of *said and counting the choice in
 * kvrelay_auto_choices_total{policy} and kvrelay_auto_pressure_total{pressure}. Returns OK, or INVALID_ARGUMENT with st: a bad auto spec, no
 * table, a table of another model than the nodes serve, a task the table does not score. */
grpc_status_code rt_auto_select(rt_router *rt, const char *request_id, const char *asked, int prompt_tokens,
                                int max_tokens, rt_auto_said *said, kc_status *st);

#endif /* RT_AUTO_H */
