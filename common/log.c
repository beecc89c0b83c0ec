/*
 * log.c - kc_log: one line per event on stderr, formatted into a stack buffer and written with a
 * single write(2), so lines from concurrent threads (and processes sharing the pipe) never
 * interleave: a write of at most PIPE_BUF bytes to a pipe is atomic, hence the line cap.
 * Control characters in the message, request id or name are escaped (\n, \xHH) so one event is
 * always one line; a message over the cap is cut at a UTF-8 boundary and ends in "...".
 * Not here: log files, rotation, JSON. Test: ctest -R test_log.
 */
#include "log.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* One line, newline included: PIPE_BUF (4096 on Linux) keeps pipe writes atomic. */
#define KC_LOG_LINE_MAX 4096
#define KC_LOG_NAME_MAX 64

static const char *const level_names[] = {"DEBUG", "INFO ", "WARN ", "ERROR"};

static atomic_int log_min_level = KC_LOG_INFO;
/* Written by kc_log_init (at start-up, before other threads log), read by every line. */
static char log_name[KC_LOG_NAME_MAX] = "kvrelay";

/* Appends src to buf[*pos, cap), escaping control characters; stops before overflowing.
 * Returns 1 when all of src fit. A multi-byte UTF-8 sequence is copied whole or not at all. */
static int append_escaped(char *buf, size_t cap, size_t *pos, const char *src)
{
    size_t p = *pos;
    for (const unsigned char *s = (const unsigned char *)src; *s;) {
        char esc[5];
        size_t n;
        const unsigned char *next = s + 1;
        if (*s == '\n') {
            memcpy(esc, "\\n", 2);
            n = 2;
        } else if (*s == '\r') {
            memcpy(esc, "\\r", 2);
            n = 2;
        } else if (*s == '\t') {
            memcpy(esc, "\\t", 2);
            n = 2;
        } else if (*s < 0x20 || *s == 0x7f) {
            snprintf(esc, sizeof esc, "\\x%02x", *s);
            n = 4;
        } else {
            /* a character: its lead byte and continuation bytes go together */
            while ((*next & 0xc0) == 0x80 && next - s < 4)
                next++;
            n = (size_t)(next - s);
            if (p + n > cap) {
                *pos = p;
                return 0;
            }
            memcpy(buf + p, s, n);
            p += n;
            s = next;
            continue;
        }
        if (p + n > cap) {
            *pos = p;
            return 0;
        }
        memcpy(buf + p, esc, n);
        p += n;
        s = next;
    }
    *pos = p;
    return 1;
}

void kc_log_init(const char *name, kc_log_level min_level)
{
    if (name && *name) {
        size_t pos = 0;
        char tmp[KC_LOG_NAME_MAX];
        append_escaped(tmp, sizeof tmp - 1, &pos, name);
        tmp[pos] = '\0';
        memcpy(log_name, tmp, pos + 1);
    }
    int lv = (int)min_level;
    atomic_store(&log_min_level, lv < KC_LOG_DEBUG   ? KC_LOG_DEBUG
                                 : lv > KC_LOG_ERROR ? KC_LOG_ERROR
                                                     : lv);
}

int kc_log_parse_level(const char *s, kc_log_level *out)
{
    static const char *const names[] = {"debug", "info", "warn", "error"};
    if (!s) return -1;
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = (kc_log_level)i;
            return 0;
        }
    return -1;
}

int kc_log_enabled(kc_log_level level)
{
    return (int)level >= atomic_load_explicit(&log_min_level, memory_order_relaxed);
}

/* Writes all of buf; a pipe takes a line of this size in one piece, other files normally do. */
static void write_all(const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t w = write(STDERR_FILENO, buf, len);
        if (w < 0) {
            if (errno == EINTR) continue;
            return; /* stderr closed or full: nowhere left to report it */
        }
        buf += w;
        len -= (size_t)w;
    }
}

void kc_log(kc_log_level level, const char *request_id, const char *fmt, ...)
{
    int lv = (int)level;   /* the enum may be unsigned: compare as int */
    if (lv < KC_LOG_DEBUG) /* an out-of-range level is the nearest real one */
        lv = KC_LOG_DEBUG;
    if (lv > KC_LOG_ERROR) lv = KC_LOG_ERROR;
    if (!kc_log_enabled((kc_log_level)lv)) return;
    int saved_errno = errno; /* callers log and then look at errno */

    char line[KC_LOG_LINE_MAX];
    const size_t cap = sizeof line - 1; /* room for the newline */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    size_t pos = strftime(line, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    pos += (size_t)snprintf(line + pos, cap - pos, ".%03ldZ %s %s ", ts.tv_nsec / 1000000L,
                            level_names[lv], log_name);
    if (request_id && *request_id) {
        line[pos++] = '[';
        append_escaped(line, cap - 256, &pos, request_id); /* a huge id leaves room for text */
        line[pos++] = ']';
        line[pos++] = ' ';
    }

    char msg[KC_LOG_LINE_MAX];
    msg[0] = '\0';
    int n = 0;
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        n = vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
    }
    if (n < 0) n = snprintf(msg, sizeof msg, "(unformattable log message: %s)", fmt);
    static const char ellipsis[] = "...";
    size_t room = cap - (sizeof ellipsis - 1);
    int whole = append_escaped(line, room, &pos, msg) && (size_t)n < sizeof msg;
    if (!whole) {
        memcpy(line + pos, ellipsis, sizeof ellipsis - 1);
        pos += sizeof ellipsis - 1;
    }
    line[pos++] = '\n';
    write_all(line, pos);
    errno = saved_errno;
}
