/*
 * test_log.c - common/log.h with stderr captured through a pipe: the line shape (UTC ISO-8601
 * with milliseconds, padded level, process name, [request id]), no brackets without an id,
 * level filtering (and filtered macros not evaluating their arguments), control characters
 * escaped so an event stays one line, over-long messages cut at a UTF-8 boundary with "...",
 * odd input (NULL format, out-of-range level), errno preserved, and lines of 8 concurrent
 * threads never interleaving.
 * Run: ctest -R test_log (well under a second).
 */
#include "kr_test.h"

#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <regex.h>
#include <time.h>
#include <unistd.h>

#define N_THREADS 8
#define N_LINES 400
#define PAYLOAD 300

/* ------------------------------------------------------------------ capturing stderr */

static struct {
    int saved_fd;
    int read_fd;
    pthread_t reader;
    char *buf;
    size_t len, cap;
} cap;

static void *reader_main(void *arg)
{
    char chunk[8192];
    for (;;) {
        ssize_t n = read(cap.read_fd, chunk, sizeof chunk);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return NULL;
        if (cap.len + (size_t)n + 1 > cap.cap) {
            cap.cap = 2 * (cap.len + (size_t)n + 1);
            cap.buf = realloc(cap.buf, cap.cap);
            if (!cap.buf) abort();
        }
        memcpy(cap.buf + cap.len, chunk, (size_t)n);
        cap.len += (size_t)n;
        cap.buf[cap.len] = '\0';
    }
}

/* From here to capture_end, everything written to fd 2 is collected (a thread reads the pipe
 * so that writers never block on a full pipe). */
static void capture_begin(void)
{
    int fds[2];
    REQUIRE(pipe(fds) == 0, "pipe");
    fflush(stderr);
    cap.saved_fd = dup(2);
    REQUIRE(cap.saved_fd >= 0 && dup2(fds[1], 2) == 2, "dup2");
    close(fds[1]);
    cap.read_fd = fds[0];
    cap.len = 0;
    REQUIRE(pthread_create(&cap.reader, NULL, reader_main, NULL) == 0, "reader thread");
}

/* Restores stderr and returns what was written (owned by `cap`, valid until the next begin). */
static const char *capture_end(void)
{
    dup2(cap.saved_fd, 2); /* closes the pipe's last write end: the reader sees EOF */
    close(cap.saved_fd);
    pthread_join(cap.reader, NULL);
    close(cap.read_fd);
    return cap.buf ? cap.buf : "";
}

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* ------------------------------------------------------------------ tests */

static void test_shape(void)
{
    kc_log_init("decode-0", KC_LOG_DEBUG);
    capture_begin();
    time_t before = time(NULL);
    kc_info("req-42", "reserved %d blocks (free %d)", 96, 3904);
    kc_warn(NULL, "no request id");
    kc_error("", "empty request id");
    kc_debug("r", "debug %s", "shown");
    time_t after = time(NULL);
    const char *out = capture_end();

    regex_t re;
    REQUIRE(
        regcomp(&re,
                "^([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})\\.[0-9]{3}Z "
                "INFO  decode-0 \\[req-42\\] reserved 96 blocks \\(free 3904\\)\n"
                "[0-9T:.Z-]{24} WARN  decode-0 no request id\n"
                "[0-9T:.Z-]{24} ERROR decode-0 empty request id\n"
                "[0-9T:.Z-]{24} DEBUG decode-0 \\[r\\] debug shown\n$",
                REG_EXTENDED) == 0,
        "regcomp");
    regmatch_t m[7];
    int match = regexec(&re, out, 7, m, 0) == 0;
    CHECK(match, "log lines have the wrong shape:\n%s", out);
    if (match) { /* the timestamp is UTC and now (timegm reads it back as UTC) */
        int f[6];
        for (int i = 0; i < 6; i++)
            f[i] = atoi(out + m[i + 1].rm_so);
        struct tm tm = {.tm_year = f[0] - 1900,
                        .tm_mon = f[1] - 1,
                        .tm_mday = f[2],
                        .tm_hour = f[3],
                        .tm_min = f[4],
                        .tm_sec = f[5]};
        time_t t = timegm(&tm);
        CHECK(t >= before && t <= after, "timestamp %ld not within [%ld, %ld]: not UTC?", (long)t,
              (long)before, (long)after);
    }
    regfree(&re);
}

static int evaluated;
static int side_effect(void)
{
    return ++evaluated;
}

static void test_levels(void)
{
    kc_log_level l = KC_LOG_INFO;
    CHECK(kc_log_parse_level("debug", &l) == 0 && l == KC_LOG_DEBUG, "debug");
    CHECK(kc_log_parse_level("warn", &l) == 0 && l == KC_LOG_WARN, "warn");
    CHECK(kc_log_parse_level("error", &l) == 0 && l == KC_LOG_ERROR, "error");
    CHECK(kc_log_parse_level("info", &l) == 0 && l == KC_LOG_INFO, "info");
    CHECK(kc_log_parse_level("INFO ", &l) != 0 && kc_log_parse_level("", &l) != 0 &&
              kc_log_parse_level(NULL, &l) != 0 && kc_log_parse_level("warning", &l) != 0,
          "bad levels accepted");

    kc_log_init("prefill-1", KC_LOG_WARN);
    CHECK(!kc_log_enabled(KC_LOG_INFO) && kc_log_enabled(KC_LOG_WARN), "enabled");
    capture_begin();
    kc_debug("a", "hidden %d", side_effect());
    kc_info("a", "hidden %d", side_effect());
    kc_warn("a", "shown");
    kc_log(KC_LOG_ERROR, "a", "shown too");
    const char *out = capture_end();
    CHECK(evaluated == 0, "a filtered macro evaluated its arguments");
    CHECK(count_lines(out) == 2 && !strstr(out, "hidden") &&
              strstr(out, "WARN  prefill-1 [a] shown\n") &&
              strstr(out, "ERROR prefill-1 [a] shown too\n"),
          "filtering at WARN:\n%s", out);
}

static void test_odd_input(void)
{
    kc_log_init("name\nwith newline", KC_LOG_DEBUG);
    capture_begin();
    errno = 1234;
    kc_info("id\nx", "two\nlines\tand\x01 bell");
    CHECK(errno == 1234, "errno changed to %d", errno);
    const char *volatile null_fmt = NULL;
    kc_log(KC_LOG_INFO, NULL, null_fmt, 1);
    kc_log((kc_log_level)99, NULL, "level out of range");
    kc_log((kc_log_level)-5, NULL, "level below range");

    /* over-long: 10000 ASCII bytes, then 3000 two-byte characters */
    char *big = malloc(10001);
    REQUIRE(big, "malloc");
    memset(big, 'x', 10000);
    big[10000] = '\0';
    kc_info("long", "%s", big);
    char *utf = malloc(6001);
    REQUIRE(utf, "malloc");
    for (int i = 0; i < 3000; i++)
        memcpy(utf + 2 * i, "\xc3\xa9", 2); /* é */
    utf[6000] = '\0';
    kc_info("utf", "%s", utf);
    const char *out = capture_end();

    CHECK(count_lines(out) == 6, "6 events must give 6 lines:\n%s", out);
    CHECK(strstr(out, " name\\nwith newline [id\\nx] two\\nlines\\tand\\x01 bell\n"),
          "control characters not escaped:\n%s", out);
    CHECK(strstr(out, "with newline \n"), "NULL format: an empty message expected:\n%s", out);
    CHECK(strstr(out, "ERROR name\\nwith newline level out of range\n"), "level 99 -> ERROR");
    CHECK(strstr(out, "DEBUG name\\nwith newline level below range\n"), "level -5 -> DEBUG");
    const char *l = out;
    for (int i = 0; i < 4; i++)
        l = strchr(l, '\n') + 1;
    const char *end = strchr(l, '\n');
    size_t len = (size_t)(end - l) + 1;
    CHECK(len <= 4096 && len > 4000, "long line is %zu bytes", len);
    CHECK(strncmp(end - 3, "...", 3) == 0 && end[-4] == 'x', "long line does not end in x...");
    l = end + 1;
    end = strchr(l, '\n');
    len = (size_t)(end - l) + 1;
    CHECK(len <= 4096 && len > 4000, "long UTF-8 line is %zu bytes", len);
    CHECK(strncmp(end - 5, "\xc3\xa9...", 5) == 0, "long UTF-8 line not cut between characters");
    free(big);
    free(utf);
}

/* ------------------------------------------------------------------ concurrency */

static void *writer(void *arg)
{
    int t = (int)(intptr_t)arg;
    char payload[PAYLOAD + 1];
    memset(payload, 'a' + t, PAYLOAD);
    payload[PAYLOAD] = '\0';
    char rid[16];
    snprintf(rid, sizeof rid, "t%d", t);
    for (int i = 0; i < N_LINES; i++)
        kc_info(rid, "%d %s end", i, payload);
    return NULL;
}

static void test_concurrent(void)
{
    kc_log_init("conc", KC_LOG_INFO);
    capture_begin();
    pthread_t th[N_THREADS];
    for (int t = 0; t < N_THREADS; t++)
        REQUIRE(pthread_create(&th[t], NULL, writer, (void *)(intptr_t)t) == 0, "thread");
    for (int t = 0; t < N_THREADS; t++)
        pthread_join(th[t], NULL);
    const char *out = capture_end();

    int next[N_THREADS] = {0}, bad = 0, lines = 0;
    for (const char *l = out; *l; lines++) {
        const char *end = strchr(l, '\n');
        if (!end) {
            bad++;
            break;
        }
        int t, i, off = 0;
        /* "<24-char time> INFO  conc [tT] I <payload> end" */
        if (end - l < 25 || sscanf(l + 25, "INFO  conc [t%d] %d %n", &t, &i, &off) != 2 ||
            off == 0 || t < 0 || t >= N_THREADS || i != next[t]) {
            bad++;
        } else {
            const char *p = l + 25 + off;
            int ok = end - p == PAYLOAD + 4 && strncmp(end - 4, " end", 4) == 0;
            for (int k = 0; ok && k < PAYLOAD; k++)
                ok = p[k] == 'a' + t;
            bad += !ok;
            next[t]++;
        }
        l = end + 1;
    }
    CHECK(lines == N_THREADS * N_LINES, "%d lines, want %d", lines, N_THREADS * N_LINES);
    CHECK(bad == 0, "%d lines interleaved or out of order", bad);
}

int main(void)
{
    test_shape();
    test_levels();
    test_odd_input();
    test_concurrent();
    return kt_done("test_log");
}
