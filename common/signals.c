/* signals.c - SIGINT/SIGTERM into a pipe (signals.h says why not sigwait). */
#include "signals.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
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
