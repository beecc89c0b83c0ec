/*
 * proc.h - starting kvrelay's processes from C tests, as a user would: fork/exec the program,
 * wait for its one "serving" line on stdout ("<role> <id>: serving grpc HOST:PORT http HOST:PORT",
 * DESIGN.md / docs/cluster.md), learn the ports it bound, and stop it at the end.
 * Header-only (static functions): tests/unit/ builds one program per test_*.c.
 */
#ifndef KR_TEST_PROC_H
#define KR_TEST_PROC_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct test_proc {
    pid_t pid;
    int out_fd; /* the child's stdout (after the serving line: drained by test_proc_stop) */
    char grpc[128]; /* "127.0.0.1:PORT" */
    char http[128];
    char line[512]; /* the serving line */
} test_proc;

/* Starts argv[0] (a path) with argv, stderr inherited (the test's log shows the process's log),
 * and waits up to timeout_s for the serving line. Returns 0, or -1 with a message on stderr
 * (the process is killed then). */
static int test_proc_start(char *const argv[], double timeout_s, test_proc *p)
{
    memset(p, 0, sizeof *p);
    int fds[2];
    if (pipe(fds) != 0) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fds[1]);
    p->pid = pid;
    p->out_fd = fds[0];
    size_t n = 0;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        struct timespec t1;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double left = timeout_s - ((double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
        struct pollfd pfd = {.fd = p->out_fd, .events = POLLIN};
        if (left <= 0 || poll(&pfd, 1, (int)(left * 1000) + 1) <= 0) {
            fprintf(stderr, "proc: %s printed no serving line within %.0f s\n", argv[0], timeout_s);
            break;
        }
        ssize_t r = read(p->out_fd, p->line + n, 1);
        if (r <= 0) {
            fprintf(stderr, "proc: %s exited before serving\n", argv[0]);
            break;
        }
        if (p->line[n] != '\n') {
            if (n + 2 < sizeof p->line) n++;
            continue;
        }
        p->line[n] = 0;
        const char *g = strstr(p->line, "serving grpc "), *h = strstr(p->line, " http ");
        if (g && h && sscanf(g, "serving grpc %127s", p->grpc) == 1 && sscanf(h, " http %127s", p->http) == 1)
            return 0;
        n = 0; /* some other line: keep reading */
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    close(p->out_fd);
    p->pid = 0;
    return -1;
}

/* A loopback TCP port that a listening socket holds (*fd; close it when done), for a test of a
 * program given a port another process has. Returns the port, or -1. */
static inline int test_port_held(int *fd)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    *fd = socket(AF_INET, SOCK_STREAM, 0);
    if (*fd < 0) return -1;
    if (bind(*fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(*fd, 1) != 0 ||
        getsockname(*fd, (struct sockaddr *)&a, &len) != 0) {
        close(*fd);
        return -1;
    }
    return ntohs(a.sin_port);
}

/* Runs argv[0] (a path) with argv to its end, output inherited. Returns its status as waitpid
 * gives it, or -1 when it could not be started. */
static inline int test_proc_run(char *const argv[])
{
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return -1;
    return status;
}

/* Sends `sig` (SIGTERM: a clean shutdown; SIGKILL: a crash) and reaps the process. Returns its
 * exit status as waitpid gives it, or -1 when it had to be killed after timeout_s. */
static int test_proc_stop(test_proc *p, int sig, double timeout_s)
{
    if (p->pid <= 0) return -1;
    kill(p->pid, sig);
    int status = -1;
    for (int i = 0; i < (int)(timeout_s * 100); i++) {
        if (waitpid(p->pid, &status, WNOHANG) == p->pid) goto done;
        usleep(10000);
    }
    fprintf(stderr, "proc: pid %d did not stop within %.0f s, killing it\n", (int)p->pid, timeout_s);
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    status = -1;
done:
    close(p->out_fd);
    p->pid = 0;
    return status;
}

/* GET `path` from the HTTP address "HOST:PORT" (HTTP/1.0): the whole response, malloc'd, at
 * most 64 KiB; an empty string when it cannot connect (the caller's checks then fail). */
static inline char *test_http_get(const char *http, const char *path)
{
    char host[64], req[256];
    int port, fd = -1;
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf) return NULL;
    buf[0] = 0;
    if (sscanf(http, "%63[^:]:%d", host, &port) != 2 || (fd = socket(AF_INET, SOCK_STREAM, 0)) < 0)
        return buf;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    snprintf(req, sizeof req, "GET %s HTTP/1.0\r\n\r\n", path);
    if (inet_pton(AF_INET, host, &sa.sin_addr) == 1 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0 &&
        write(fd, req, strlen(req)) == (ssize_t)strlen(req)) {
        ssize_t got;
        while (len + 1 < cap && (got = read(fd, buf + len, cap - 1 - len)) > 0) len += (size_t)got;
    }
    buf[len] = 0;
    close(fd);
    return buf;
}

/* The value of the /metrics sample line that starts with `series` + ' ', or -1 when absent. */
static inline double test_metric(const char *http, const char *series)
{
    char *buf = test_http_get(http, "/metrics");
    double v = -1;
    const size_t sl = strlen(series);
    for (char *line = buf; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL)
        if (!strncmp(line, series, sl) && line[sl] == ' ') {
            v = strtod(line + sl + 1, NULL);
            break;
        }
    free(buf);
    return v;
}

#endif /* KR_TEST_PROC_H */
