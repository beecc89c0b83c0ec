/*
 * fuzz_calibration.c - fuzz target for kv_policy auto's calibration table (router/adaptive.c,
 * docs/adaptive.md): the JSON text through rt_calib_parse. A refusal must carry a message; an
 * accepted table must hold what the parser promises (format 1, a 16-digit fingerprint,
 * ascending lengths, every point at one of them, scores in [0, 1] with cases >= 1 and a bound
 * no larger than the score allows), and once bound to a small model the rule must answer every
 * ask at every pressure level with a spec whose guarantee holds the floor. Anything else aborts.
 * Run: ctest -R fuzz_calibration, or build with -DKR_FUZZ=ON (clang) for libFuzzer.
 */
#include "../../router/adaptive.c"
#include "../../router/policy.c"

#include <stdint.h>

static void check_table(const rt_calib *t)
{
    if (t->format != RT_CALIB_FORMAT || strlen(t->fingerprint) != 16 || t->n_tasks < 1 || t->n_lengths < 1) abort();
    for (int i = 1; i < t->n_lengths; i++)
        if (t->lengths[i] <= t->lengths[i - 1]) abort();
    for (int i = 0; i < t->n_points; i++) {
        const rt_calib_point *p = &t->points[i];
        int known = 0;
        for (int k = 0; k < t->n_lengths; k++) known |= t->lengths[k] == p->length;
        if (!known || !p->spec || !p->spec[0]) abort();
        for (int k = 0; k < t->n_tasks; k++) {
            const rt_calib_score *s = &p->task[k];
            if (!s->present) continue;
            if (!(s->policy >= 0 && s->policy <= 1 && s->full > 0 && s->full <= 1 && s->cases >= 1)) abort();
            if (!(s->lower >= 0 && s->lower <= 1 && s->lower <= s->policy / s->full + 1e-12)) abort();
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512] = "";
    rt_calib *t = NULL;
    if (rt_calib_parse((const char *)data, size, &t, err, sizeof err) != 0) {
        if (t || !err[0]) abort();
        return 0;
    }
    check_table(t);
    kr_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.n_layers = 2;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 2;
    cfg.head_dim = 8;
    cfg.hidden_size = 32;
    cfg.intermediate_size = 32;
    int dropped;
    if (rt_calib_bind(t, &cfg, NULL, &dropped, err, sizeof err) != 0) abort();
    static const char *asks[] = {"auto", "auto:floor=0.5", "auto:floor=1", "auto:floor=0.8,task=kv",
                                 "auto:floor=0.9,task=text"};
    for (size_t a = 0; a < sizeof asks / sizeof asks[0]; a++)
        for (int l = 0; l < RT_PRESSURE_LEVELS; l++) {
            rt_auto_ask ask;
            rt_auto_choice c;
            if (rt_auto_parse(asks[a], &ask, err, sizeof err) != 0) abort();
            int prompt = t->lengths[l % t->n_lengths] - l;
            if (rt_auto_choose(t, &ask, prompt > 0 ? prompt : 1, 4, (rt_pressure)l, &c, err, sizeof err) != 0) {
                if (!ask.task[0] || rt_calib_task(t, ask.task) >= 0) abort();
                continue;
            }
            if (!(c.score >= ask.floor) || !c.spec[0]) abort();
        }
    rt_calib_free(t);
    return 0;
}
