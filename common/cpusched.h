/*
 * cpusched.h - the CPU scheduling policy of a node's threads. A node's compute thread (the decode
 * node's batching thread, the prefill worker) runs for milliseconds at a time, while each
 * streamed token wakes short I/O threads (gRPC completion queues, the router's relay). Under
 * the kernel's normal policy a woken thread preempts the running one, so on a machine whose
 * cores are all busy the compute thread waits behind every token's I/O; under SCHED_BATCH a
 * woken thread does not preempt, it runs on an idle core or when the running thread's slice
 * ends. Measured on 2 vCPUs (docs/cluster.md, "CPU scheduling"): TPOT at 3-12 requests/s 20-26%
 * lower, TTFT unchanged. A decode node that shares its cores with a prefill node can go under
 * SCHED_IDLE instead: its threads then run only on cores the prefill node leaves idle, so a
 * prompt is computed at once rather than beside the decode steps (docs/cluster.md, "Co-located
 * nodes"). Neither needs privilege.
 */
#ifndef KC_CPUSCHED_H
#define KC_CPUSCHED_H

#include "flags.h"

typedef enum kc_cpu_sched { KC_SCHED_BATCH = 0, KC_SCHED_NORMAL = 1, KC_SCHED_IDLE = 2 } kc_cpu_sched;

extern const kc_flag_choice kc_cpu_sched_choices[];

/* Puts every thread the process has now under `policy`; threads started later inherit it from
 * the thread that starts them. Call it after kc_log_init and before starting threads. Returns
 * 0, or -1 after logging a warning that names the thread and the reason (the process goes on;
 * the threads before it were changed). */
int kc_cpu_sched_apply(kc_cpu_sched policy);

#define KC_FLAG_CPU_SCHED(ptr)                                                                     \
    {.kind = KC_FLAG_CHOICE, .name = "--cpu-sched", .arg = "batch|normal|idle", .dest = (ptr),      \
     .choices = kc_cpu_sched_choices, .def = "batch",                                               \
     .help = "the threads' CPU scheduling policy: batch (SCHED_BATCH: a thread woken by a "        \
             "streamed token does not preempt the compute thread), normal (SCHED_OTHER) or idle "   \
             "(SCHED_IDLE: run only on cores nothing else wants; for a decode node sharing its "     \
             "cores with a prefill node, docs/cluster.md)"}

#endif /* KC_CPUSCHED_H */
