/* cpusched.c - the CPU scheduling policy of a node's threads (cpusched.h says why). */
#define _GNU_SOURCE
#include "cpusched.h"

#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

const kc_flag_choice kc_cpu_sched_choices[] = {
    {"batch", KC_SCHED_BATCH},
    {"normal", KC_SCHED_NORMAL},
    {"idle", KC_SCHED_IDLE},
    {NULL, 0},
};

int kc_cpu_sched_apply(kc_cpu_sched policy)
{
    struct sched_param sp = {.sched_priority = 0};
    int pol = policy == KC_SCHED_BATCH ? SCHED_BATCH : policy == KC_SCHED_IDLE ? SCHED_IDLE : SCHED_OTHER;
    DIR *d = opendir("/proc/self/task");
    if (!d) { /* no /proc: the calling thread at least, which later threads inherit from */
        if (sched_setscheduler(0, pol, &sp) == 0)
            return 0;
        kc_warn(NULL, "--cpu-sched: sched_setscheduler: %s; threads keep their policy", strerror(errno));
        return -1;
    }
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        int tid = atoi(e->d_name);
        /* a thread that ended since the listing is not an error */
        if (sched_setscheduler(tid, pol, &sp) != 0 && errno != ESRCH) {
            kc_warn(NULL, "--cpu-sched: sched_setscheduler(thread %d): %s; the threads after it keep "
                    "their policy", tid, strerror(errno));
            rc = -1;
            break;
        }
    }
    closedir(d);
    return rc;
}
