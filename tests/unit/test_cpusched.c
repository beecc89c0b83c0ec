/*
 * test_cpusched.c - --cpu-sched (common/cpusched.h): batch puts every thread the process has
 * under SCHED_BATCH, one started before the call and one started after it (inherited); normal
 * puts them back under SCHED_OTHER; the flag takes batch and normal, defaults to batch (zero)
 * and refuses anything else naming the flag.
 * Run: ctest -R test_cpusched.
 */
#define _GNU_SOURCE
#include "kr_test.h"

#include "cpusched.h"
#include "flags.h"

#include <pthread.h>
#include <sched.h>
#include <string.h>

typedef struct probe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int asked, policy, quit;
} probe;

/* A thread that reports its own policy each time it is asked, until told to quit. */
static void *probe_main(void *arg)
{
    probe *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->quit) {
        if (p->asked) {
            p->policy = sched_getscheduler(0);
            p->asked = 0;
            pthread_cond_broadcast(&p->cv);
        }
        pthread_cond_wait(&p->cv, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static int probe_policy(probe *p)
{
    pthread_mutex_lock(&p->mu);
    p->asked = 1;
    pthread_cond_broadcast(&p->cv);
    while (p->asked)
        pthread_cond_wait(&p->cv, &p->mu);
    int pol = p->policy;
    pthread_mutex_unlock(&p->mu);
    return pol;
}

static void probe_start(probe *p, pthread_t *t)
{
    memset(p, 0, sizeof *p);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    CHECK(pthread_create(t, NULL, probe_main, p) == 0, "pthread_create");
}

static void probe_stop(probe *p, pthread_t t)
{
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_join(t, NULL);
}

static void test_apply(void)
{
    probe before, after;
    pthread_t tb, ta;
    probe_start(&before, &tb);
    CHECK(kc_cpu_sched_apply(KC_SCHED_BATCH) == 0, "batch refused");
    CHECK(sched_getscheduler(0) == SCHED_BATCH, "main thread: policy %d, not SCHED_BATCH", sched_getscheduler(0));
    CHECK(probe_policy(&before) == SCHED_BATCH, "a thread started before: policy %d", probe_policy(&before));
    probe_start(&after, &ta);
    CHECK(probe_policy(&after) == SCHED_BATCH, "a thread started after: policy %d (not inherited)",
          probe_policy(&after));
    CHECK(kc_cpu_sched_apply(KC_SCHED_NORMAL) == 0, "normal refused");
    CHECK(sched_getscheduler(0) == SCHED_OTHER && probe_policy(&before) == SCHED_OTHER &&
              probe_policy(&after) == SCHED_OTHER,
          "normal: policies %d %d %d", sched_getscheduler(0), probe_policy(&before), probe_policy(&after));
    /* last: entering SCHED_IDLE needs no privilege, leaving it does unless RLIMIT_NICE allows
     * nice 0 */
    CHECK(kc_cpu_sched_apply(KC_SCHED_IDLE) == 0, "idle refused");
    CHECK(sched_getscheduler(0) == SCHED_IDLE && probe_policy(&before) == SCHED_IDLE &&
              probe_policy(&after) == SCHED_IDLE,
          "idle: policies %d %d %d", sched_getscheduler(0), probe_policy(&before), probe_policy(&after));
    probe_stop(&before, tb);
    probe_stop(&after, ta);
}

static void test_flag(void)
{
    static int pol;
    static const kc_flag table[] = {KC_FLAG_CPU_SCHED(&pol), {.kind = KC_FLAG_END}};
    const kc_flags f = {.prog = "t", .usage = "", .table = table};
    struct {
        const char *v;
        int rc, want;
    } cases[] = {{"batch", 0, KC_SCHED_BATCH}, {"normal", 0, KC_SCHED_NORMAL}, {"idle", 0, KC_SCHED_IDLE}, {"fifo", -1, 0}, {"", -1, 0}};
    CHECK(KC_SCHED_BATCH == 0, "the zeroed config is not batch");
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char *argv[] = {"t", "--cpu-sched", (char *)cases[k].v, NULL};
        char err[256] = "";
        int i = 1;
        pol = -1;
        int rc = kc_flags_parse(&f, 3, argv, &i, NULL, err, sizeof err);
        CHECK(rc == cases[k].rc, "--cpu-sched '%s': rc %d (%s)", cases[k].v, rc, err);
        if (rc == 0)
            CHECK(pol == cases[k].want, "--cpu-sched '%s': %d", cases[k].v, pol);
        else
            CHECK(strstr(err, "--cpu-sched") != NULL, "--cpu-sched '%s': error without the flag: %s", cases[k].v, err);
    }
}

int main(void)
{
    test_apply();
    test_flag();
    return kt_done("test_cpusched");
}
