/* signals.c - SIGINT/SIGTERM into a pipe (signals.h says why not sigwait). */
#include "signals.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int stop_pipe[2] = {-1, -1};

static void on_stop_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    ssize_t w = write(stop_pipe[1], &b, 1); /* async-signal-safe; a full pipe: one is pending */
    (void)w;
    errno = saved;
}

int kc_signals_init(void)
{
    if (stop_pipe[0] < 0 && pipe(stop_pipe) != 0) return -1;
    if (fcntl(stop_pipe[1], F_SETFL, O_NONBLOCK) != 0) return -1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0) return -1;
    signal(SIGPIPE, SIG_IGN);
    return 0;
}

int kc_signals_wait(void)
{
    unsigned char b = 0;
    for (;;) {
        ssize_t r = read(stop_pipe[0], &b, 1);
        if (r == 1) return b;
        if (r < 0 && errno == EINTR) continue;
        return SIGTERM; /* the pipe broke: stop rather than spin */
    }
}

int kc_signals_wait_ms(int timeout_ms)
{
    struct pollfd p = {.fd = stop_pipe[0], .events = POLLIN};
    int r = poll(&p, 1, timeout_ms);
    if (r <= 0)
        return 0; /* timeout, or EINTR: the caller looks again */
    return kc_signals_wait(); /* readable: does not block */
}

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

kc_drain_end kc_signals_drain(int (*idle)(void *user), void *user, double timeout_s)
{
    double deadline = mono_now() + timeout_s;
    for (;;) {
        if (idle(user))
            return KC_DRAIN_DONE;
        double left = deadline - mono_now();
        if (left <= 0)
            return KC_DRAIN_TIMEOUT;
        if (kc_signals_wait_ms(left < 0.1 ? (int)(left * 1000.0) + 1 : 100))
            return KC_DRAIN_SIGNAL;
    }
}
