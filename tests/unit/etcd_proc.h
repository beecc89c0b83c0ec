/*
 * etcd_proc.h - a real single-member etcd for tests: free loopback ports (bound to port 0 first),
 * a data directory from mkdtemp, start / kill / restart on the same data directory, and waiting
 * for its /health. Header-only (static functions): tests/unit/ builds one program per test_*.c.
 * Tests that use it exit 77 (skipped) when /usr/bin/etcd is missing (Debian: etcd-server).
 */
#ifndef KR_TEST_ETCD_PROC_H
#define KR_TEST_ETCD_PROC_H

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TEST_ETCD_BIN "/usr/bin/etcd"
#define TEST_ETCDCTL_BIN "/usr/bin/etcdctl"

typedef struct test_etcd {
    pid_t pid;
    char dir[256];      /* mkdtemp: data in dir/data, the log in dir/etcd.log */
    int client_port;
    int peer_port;
    char endpoint[64];  /* "127.0.0.1:PORT" */
    const char *tls_cert; /* set before the first start: serve clients over TLS with these PEM */
    const char *tls_key;  /* files (then readiness is "the port accepts", not /health) */
} test_etcd;

static double test_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* A loopback port nobody listens on right now (bound to 0, read back, closed). */
static int test_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

/* 1 when GET /health on the client port says healthy (with TLS: when the port accepts). */
static int test_etcd_healthy(const test_etcd *e)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)e->client_port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct timeval tv = {.tv_sec = 1};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    int ok = 0;
    int connected = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    if (connected && e->tls_cert) {
        ok = 1;
    } else if (connected) {
        static const char req[] = "GET /health HTTP/1.0\r\n\r\n";
        char buf[1024];
        size_t n = 0;
        ssize_t r;
        if (write(fd, req, sizeof req - 1) == (ssize_t)(sizeof req - 1)) {
            while (n + 1 < sizeof buf && (r = read(fd, buf + n, sizeof buf - 1 - n)) > 0)
                n += (size_t)r;
        }
        buf[n] = '\0';
        ok = strstr(buf, "\"health\":\"true\"") != NULL;
    }
    close(fd);
    return ok;
}

/* Starts etcd: the first time on new ports and a new data directory, afterwards (after
 * test_etcd_kill) on the same ports and data. Waits up to 20 s for /health. Returns 0 or -1. */
static int test_etcd_start(test_etcd *e)
{
    if (!e->dir[0]) {
        snprintf(e->dir, sizeof e->dir, "/tmp/kr-etcd-XXXXXX");
        if (!mkdtemp(e->dir))
            return -1;
        e->client_port = test_free_port();
        e->peer_port = test_free_port();
        if (e->client_port <= 0 || e->peer_port <= 0 || e->client_port == e->peer_port)
            return -1;
        snprintf(e->endpoint, sizeof e->endpoint, "127.0.0.1:%d", e->client_port);
    }
    char data[300], log[300], client[64], peer[64], cluster[80];
    snprintf(data, sizeof data, "%s/data", e->dir);
    snprintf(log, sizeof log, "%s/etcd.log", e->dir);
    snprintf(client, sizeof client, "%s://127.0.0.1:%d", e->tls_cert ? "https" : "http",
             e->client_port);
    snprintf(peer, sizeof peer, "http://127.0.0.1:%d", e->peer_port);
    snprintf(cluster, sizeof cluster, "t=%s", peer);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        if (e->tls_cert)
            execl(TEST_ETCD_BIN, TEST_ETCD_BIN, "--name", "t", "--data-dir", data,
                  "--listen-client-urls", client, "--advertise-client-urls", client,
                  "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                  "--initial-cluster", cluster, "--cert-file", e->tls_cert, "--key-file",
                  e->tls_key, (char *)NULL);
        else
            execl(TEST_ETCD_BIN, TEST_ETCD_BIN, "--name", "t", "--data-dir", data,
                  "--listen-client-urls", client, "--advertise-client-urls", client,
                  "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                  "--initial-cluster", cluster, (char *)NULL);
        _exit(127);
    }
    e->pid = pid;
    double t0 = test_now();
    while (test_now() - t0 < 20) {
        if (test_etcd_healthy(e))
            return 0;
        if (waitpid(pid, NULL, WNOHANG) == pid) {
            e->pid = 0;
            fprintf(stderr, "etcd exited at start; see %s\n", log);
            return -1;
        }
        usleep(50000);
    }
    fprintf(stderr, "etcd not healthy within 20 s; see %s\n", log);
    return -1;
}

/* Stops etcd with `sig` (SIGKILL: a crash) and reaps it; the data directory stays. */
static void test_etcd_kill(test_etcd *e, int sig)
{
    if (e->pid <= 0)
        return;
    kill(e->pid, sig);
    waitpid(e->pid, NULL, 0);
    e->pid = 0;
}

/* Kills etcd and removes its directory. */
static void test_etcd_cleanup(test_etcd *e)
{
    test_etcd_kill(e, SIGKILL);
    if (e->dir[0] && strncmp(e->dir, "/tmp/kr-etcd-", 13) == 0) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", e->dir);
        if (system(cmd) != 0)
            fprintf(stderr, "could not remove %s\n", e->dir);
    }
}

#endif /* KR_TEST_ETCD_PROC_H */
