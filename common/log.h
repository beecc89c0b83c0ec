/*
 * log.h - one line per event on stderr, the same shape in every process:
 *   2026-11-21T10:15:02.123Z INFO  decode-0 [req-42] reserved 96 blocks (free 3904)
 * (UTC time with milliseconds, level, the process's name, the request id when there is one).
 * Lines are written with one write(2) each, so lines of concurrent threads never interleave.
 * What it is not: a log shipper or a structured (JSON) logger. Test: ctest -R test_log.
 */
#ifndef KC_LOG_H
#define KC_LOG_H

typedef enum kc_log_level {
    KC_LOG_DEBUG = 0,
    KC_LOG_INFO = 1,
    KC_LOG_WARN = 2,
    KC_LOG_ERROR = 3,
} kc_log_level;

/* Sets the process name shown on every line (copied) and the lowest level printed. */
void kc_log_init(const char *name, kc_log_level min_level);
/* Parses "debug", "info", "warn", "error"; returns -1 for anything else. */
int kc_log_parse_level(const char *s, kc_log_level *out);
/* Writes one line. `request_id` may be NULL or "" (no [..] part). Thread-safe. */
void kc_log(kc_log_level level, const char *request_id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* 1 when lines of `level` are printed. */
int kc_log_enabled(kc_log_level level);

/* The macros do not evaluate their arguments when the level is filtered out. A line is at most
 * 4096 bytes (longer messages are cut and end in "..."); control characters are escaped. */
#define KC_LOG_AT(level, rid, ...) \
    (kc_log_enabled(level) ? kc_log(level, rid, __VA_ARGS__) : (void)0)
#define kc_debug(rid, ...) KC_LOG_AT(KC_LOG_DEBUG, rid, __VA_ARGS__)
#define kc_info(rid, ...) KC_LOG_AT(KC_LOG_INFO, rid, __VA_ARGS__)
#define kc_warn(rid, ...) KC_LOG_AT(KC_LOG_WARN, rid, __VA_ARGS__)
#define kc_error(rid, ...) KC_LOG_AT(KC_LOG_ERROR, rid, __VA_ARGS__)

#endif /* KC_LOG_H */
