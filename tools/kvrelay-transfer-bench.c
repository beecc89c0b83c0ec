/*
 * kvrelay-transfer-bench - GB/s of kvrelay's bundle transport (kvtransfer/transport.h) over
 * loopback, next to ucx_perftest's figure for the same transport (UCX_TLS) and message size,
 * run by this program, and their ratio.
 * What it measures: one bundle at a time, reserve + send + acknowledgement (the full protocol a
 * prefill node pays), sender and receiver as two UCX contexts in this process; ucx_perftest runs
 * as a server and a client process with -t TEST -s SIZE. It is not a test: nothing is asserted.
 * Run: kvrelay-transfer-bench [--sizes 1,4,16,64,256,1024] [--tls tcp] [--test ucp_am_bw]
 * (sizes in MiB). Progress on stderr, the table on stdout. Figures: docs/transport.md.
 */
#include <inttypes.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"
#include "transport.h"

static void usage(void)
{
    printf("usage: kvrelay-transfer-bench [--sizes MIB,...] [--tls LIST] [--test NAME] "
           "[--iters N] [--port P]\n"
           "  --sizes  bundle sizes in MiB (default 1,4,16,64,256,1024)\n"
           "  --tls    UCX_TLS for both kvrelay and ucx_perftest (default tcp: what endpoints in\n"
           "           PEER error mode use on one host)\n"
           "  --test   ucx_perftest test to compare with (default ucp_am_bw; tag_bw also useful)\n"
           "  --iters  transfers per size (default: about 4 GiB moved, 3..200)\n"
           "  --port   first TCP port for ucx_perftest (default 13500)\n");
}

static void noop_cb(void *arg, uint64_t id, int status, uint64_t bytes, const char *err)
{
    int *st = arg;
    *st = status == 0 ? 1 : -1;
    (void)id;
    (void)bytes;
    (void)err;
}

/* Seconds per bundle of `size` bytes through the transport, or -1. */
static double bench_kvrelay(kt_transport *rx, kt_transport *tx, uint8_t *src, uint8_t *dst,
                            uint64_t size, int iters)
{
    char err[KT_ERR_MAX];
    double t0 = 0;
    for (int i = -1; i < iters; i++) { /* i = -1: warm-up (connects) */
        if (i == 0)
            t0 = cli_now();
        volatile int st = 0;
        if (kt_transport_reserve(rx, (uint64_t)(i + 2), dst, size, 60.0, 0, noop_cb, (void *)&st,
                                 err) != 0 ||
            kt_transport_send_wait(tx, "127.0.0.1", kt_transport_port(rx), (uint64_t)(i + 2),
                                   src, size, 60.0, err) != 0) {
            fprintf(stderr, "kvrelay-transfer-bench: %s\n", err);
            return -1;
        }
        while (st == 0) /* the receive callback follows the ack by microseconds */
            usleep(10);
    }
    return (cli_now() - t0) / iters;
}

/* MiB/s of `ucx_perftest -t test -s size`, or -1 (reason in why). */
static double bench_perftest(const char *test, uint64_t size, int iters, int port, char *why,
                             size_t why_len)
{
    char ports[16], sizes[32], ns[16];
    snprintf(ports, sizeof ports, "%d", port);
    snprintf(sizes, sizeof sizes, "%" PRIu64, size);
    snprintf(ns, sizeof ns, "%d", iters);
    pid_t srv = fork();
    if (srv == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execlp("ucx_perftest", "ucx_perftest", "-p", ports, (char *)NULL);
        _exit(127);
    }
    usleep(300000);
    int p[2];
    if (pipe(p) != 0)
        return -1;
    pid_t cl = fork();
    if (cl == 0) {
        dup2(p[1], 1);
        dup2(p[1], 2);
        close(p[0]);
        execlp("ucx_perftest", "ucx_perftest", "127.0.0.1", "-p", ports, "-t", test, "-s", sizes,
               "-n", ns, "-w", "2", (char *)NULL);
        _exit(127);
    }
    close(p[1]);
    char buf[65536];
    size_t len = 0;
    ssize_t n;
    while ((n = read(p[0], buf + len, sizeof buf - 1 - len)) > 0)
        len += (size_t)n;
    close(p[0]);
    buf[len] = 0;
    int st = 0;
    waitpid(cl, &st, 0);
    kill(srv, SIGTERM);
    waitpid(srv, NULL, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 127) {
        snprintf(why, why_len, "ucx_perftest not found (apt-get install ucx-utils)");
        return -1;
    }
    const char *f = strstr(buf, "Final:");
    double v[6];
    if (!f || sscanf(f + 6, "%lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4],
                     &v[5]) != 6) {
        snprintf(why, why_len, "ucx_perftest gave no Final line (exit status %d)", st);
        return -1;
    }
    return v[5]; /* overall bandwidth, MiB/s */
}

int main(int argc, char **argv)
{
    cli_init(argv);
    const char *sizes_s = "1,4,16,64,256,1024", *tls = "tcp", *test = "ucp_am_bw";
    int iters_flag = 0, port = 13500;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage();
            return 0;
        } else if (!strcmp(argv[i], "--sizes")) {
            sizes_s = cli_value(argc, argv, &i);
        } else if (!strcmp(argv[i], "--tls")) {
            tls = cli_value(argc, argv, &i);
        } else if (!strcmp(argv[i], "--test")) {
            test = cli_value(argc, argv, &i);
        } else if (!strcmp(argv[i], "--iters")) {
            iters_flag = (int)cli_long("--iters", cli_value(argc, argv, &i), 1, 100000);
        } else if (!strcmp(argv[i], "--port")) {
            port = (int)cli_long("--port", cli_value(argc, argv, &i), 1024, 65000);
        } else {
            cli_die(2, "unknown flag %s (see --help)", argv[i]);
        }
    }
    int n_sizes = 0;
    int32_t *mib = cli_ids("--sizes", sizes_s, &n_sizes);
    uint64_t max = 0;
    for (int i = 0; i < n_sizes; i++) {
        if (mib[i] < 1 || mib[i] > 4096)
            cli_die(2, "--sizes: %d MiB is outside 1..4096", mib[i]);
        if ((uint64_t)mib[i] << 20 > max)
            max = (uint64_t)mib[i] << 20;
    }
    setenv("UCX_TLS", tls, 1);
    char err[KT_ERR_MAX];
    kt_transport *rx = NULL, *tx = NULL;
    kt_transport_config rc = {.listen_host = "127.0.0.1", .name = "bench-rx"};
    kt_transport_config tc = {.name = "bench-tx"};
    if (kt_transport_create(&rc, &rx, err) != 0 || kt_transport_create(&tc, &tx, err) != 0)
        cli_die(1, "%s", err);
    uint8_t *src = malloc(max), *dst = malloc(max);
    if (!src || !dst)
        cli_die(1, "cannot allocate 2 x %" PRIu64 " bytes", max);
    for (uint64_t i = 0; i < max; i++)
        src[i] = (uint8_t)(i * 131 + 7);
    memset(dst, 0, max);

    printf("# UCX_TLS=%s, loopback; kvrelay = reserve + send + ack, one bundle at a time; "
           "perftest = ucx_perftest -t %s (overall)\n", tls, test);
    printf("%10s %14s %14s %8s\n", "size_MiB", "kvrelay_GB/s", "perftest_GB/s", "ratio");
    for (int i = 0; i < n_sizes; i++) {
        uint64_t size = (uint64_t)mib[i] << 20;
        int iters = iters_flag ? iters_flag : (int)((4ull << 30) / size);
        iters = iters_flag ? iters : (iters < 3 ? 3 : iters > 200 ? 200 : iters);
        fprintf(stderr, "kvrelay-transfer-bench: %d MiB x %d through kvrelay...\n", mib[i], iters);
        double sec = bench_kvrelay(rx, tx, src, dst, size, iters);
        double ours = sec > 0 ? size / sec / 1e9 : -1;
        fprintf(stderr, "kvrelay-transfer-bench: %d MiB x %d through ucx_perftest -t %s...\n",
                mib[i], iters, test);
        char why[256] = "";
        double pt = bench_perftest(test, size, iters, port + i, why, sizeof why);
        double ptg = pt > 0 ? pt * 1048576.0 / 1e9 : -1;
        if (pt > 0)
            printf("%10d %14.2f %14.2f %8.2f\n", mib[i], ours, ptg, ours / ptg);
        else
            printf("%10d %14.2f %14s %8s   # %s\n", mib[i], ours, "n/a", "n/a", why);
        fflush(stdout);
    }
    kt_transport_destroy(tx);
    kt_transport_destroy(rx);
    free(src);
    free(dst);
    free(mib);
    return 0;
}
