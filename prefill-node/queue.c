/*
 * queue.c - the prefill node's bounded FIFO and its one worker thread (prefill.h).
 *
 * Admission: a job is refused when cfg->queue jobs are already waiting behind a busy worker
 * (--queue 0: nothing waits; a request is taken only when the worker is idle). Handlers wait on
 * their job's condition variable and look at their call every PF_POLL_MS, so a job whose call
 * was cancelled or passed its deadline while waiting leaves the queue at once; a running job
 * finishes its prefill and then skips the transfer (run.c).
 */
#include "prefill.h"

#include "log.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#define PF_POLL_MS 20 /* how often a waiting handler looks at its call */

static void update_gauges(pf_node *n)
{
    kc_gauge_set(n->metrics.queue_depth, n->n_waiting);
    kc_gauge_set(n->metrics.running, n->running);
}

static void *worker_main(void *arg)
{
    pf_node *n = arg;
    pthread_mutex_lock(&n->mu);
    for (;;) {
        while (!n->head && !n->stopping)
            pthread_cond_wait(&n->work, &n->mu);
        if (!n->head) break; /* stopping, and nothing left */
        pf_job *j = n->head;
        n->head = j->next;
        if (!n->head) n->tail = NULL;
        n->n_waiting--;
        n->running = 1;
        j->state = PF_JOB_RUNNING;
        update_gauges(n);
        pthread_mutex_unlock(&n->mu);

        pf_run(n, j);

        pthread_mutex_lock(&n->mu);
        n->running = 0;
        n->outstanding_tokens -= (uint64_t)j->n_tokens;
        j->state = PF_JOB_DONE;
        update_gauges(n);
        pthread_cond_signal(&j->done);
    }
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

int pf_queue_start(pf_node *n, char *err)
{
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->work, NULL);
    n->head = n->tail = NULL;
    n->n_waiting = n->running = n->stopping = 0;
    n->outstanding_tokens = 0;
    int rc = pthread_create(&n->worker, NULL, worker_main, n);
    if (rc != 0) {
        snprintf(err, KR_ERR_MAX, "cannot start the worker thread: %s", strerror(rc));
        pthread_cond_destroy(&n->work);
        pthread_mutex_destroy(&n->mu);
        return -1;
    }
    return 0;
}

void pf_queue_stop(pf_node *n)
{
    pthread_mutex_lock(&n->mu);
    n->stopping = 1;
    pthread_cond_signal(&n->work);
    pthread_mutex_unlock(&n->mu);
    pthread_join(n->worker, NULL);
    pthread_cond_destroy(&n->work);
    pthread_mutex_destroy(&n->mu);
}

int pf_queue_submit(pf_node *n, pf_job *j, int *waiting)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->done, &ca);
    pthread_condattr_destroy(&ca);
    j->next = NULL;
    pthread_mutex_lock(&n->mu);
    /* an idle worker is about to take the queue's head: that job is not waiting */
    int idle = !n->running;
    if (n->n_waiting - idle >= n->cfg->queue) {
        *waiting = n->n_waiting - idle;
        pthread_mutex_unlock(&n->mu);
        pthread_cond_destroy(&j->done);
        return -1;
    }
    j->state = PF_JOB_QUEUED;
    if (n->tail)
        n->tail->next = j;
    else
        n->head = j;
    n->tail = j;
    n->n_waiting++;
    n->outstanding_tokens += (uint64_t)j->n_tokens;
    update_gauges(n);
    pthread_cond_signal(&n->work);
    pthread_mutex_unlock(&n->mu);
    return 0;
}

/* Takes a queued job out of the queue (under mu). */
static void unlink_job(pf_node *n, pf_job *j)
{
    pf_job *prev = NULL;
    for (pf_job *q = n->head; q; prev = q, q = q->next) {
        if (q != j) continue;
        if (prev)
            prev->next = j->next;
        else
            n->head = j->next;
        if (n->tail == j) n->tail = prev;
        n->n_waiting--;
        n->outstanding_tokens -= (uint64_t)j->n_tokens;
        update_gauges(n);
        return;
    }
}

void pf_queue_wait(pf_node *n, pf_job *j)
{
    pthread_mutex_lock(&n->mu);
    while (j->state != PF_JOB_DONE) {
        if (j->state == PF_JOB_QUEUED && atomic_load(&n->aborting)) {
            unlink_job(n, j);
            j->state = PF_JOB_DONE;
            j->code = GRPC_STATUS_UNAVAILABLE;
            j->dropped = 1;
            n->n_unanswered++;
            snprintf(j->details, sizeof j->details, "%s before this request's prefill started",
                     PF_SHUTDOWN_MSG);
            kc_warn(j->request_id, "dropped from the queue: %s", j->details);
            break;
        }
        if (j->state == PF_JOB_QUEUED && kc_call_cancelled(j->call)) {
            unlink_job(n, j);
            j->state = PF_JOB_DONE;
            j->code = pf_call_gone_code(j->call);
            snprintf(j->details, sizeof j->details, "%s while waiting in the prefill queue",
                     j->code == GRPC_STATUS_DEADLINE_EXCEEDED ? "deadline passed" : "cancelled");
            kc_warn(j->request_id, "dropped from the queue: %s", j->details);
            break;
        }
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += PF_POLL_MS * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        /* a timeout or a wake-up: either way, look again (the job is ours to return only
         * once it is done) */
        (void)pthread_cond_timedwait(&j->done, &n->mu, &until);
    }
    pthread_mutex_unlock(&n->mu);
    pthread_cond_destroy(&j->done);
}

void pf_queue_abort(pf_node *n)
{
    /* until every queued job left the queue and its handler answered: the server's shutdown,
     * which follows, would otherwise cancel the call before its UNAVAILABLE went out */
    for (int i = 0; i < 50; i++) {
        pthread_mutex_lock(&n->mu);
        int waiting = n->n_waiting + n->n_unanswered;
        pthread_mutex_unlock(&n->mu);
        if (waiting == 0)
            return;
        struct timespec ts = {0, PF_POLL_MS * 1000000L};
        nanosleep(&ts, NULL);
    }
}

void pf_queue_answered(pf_node *n)
{
    pthread_mutex_lock(&n->mu);
    n->n_unanswered--;
    pthread_mutex_unlock(&n->mu);
}

void pf_queue_load(pf_node *n, int *running, int *waiting, uint64_t *outstanding_tokens)
{
    pthread_mutex_lock(&n->mu);
    *running = n->running;
    *waiting = n->n_waiting;
    *outstanding_tokens = n->outstanding_tokens;
    pthread_mutex_unlock(&n->mu);
}
