/*
 * flags.c - the HOST:PORT parser and the table-driven flag parser and --help printer
 * (flags.h). Parsing never exits; kc_flags_main is the one place that prints and exits.
 */
#include "flags.h"

#include "etcd.h"
#include "log.h"
#include "rpc.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

enum { HELP_COL = 26, HELP_WIDTH = 100 };

/* ------------------------------------------------------------------ HOST:PORT */

static int hp_fail(const char *flag, const char *s, char *err, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int hp_fail(const char *flag, const char *s, char *err, size_t cap, const char *fmt, ...)
{
    char why[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (flag) snprintf(err, cap, "%s: '%.200s': %s", flag, s, why);
    else snprintf(err, cap, "%s", why);
    return -1;
}

int kc_hostport_parse(const char *flag, const char *s, unsigned opts, kc_hostport *out, char *err,
                      size_t cap)
{
    const char *colon = strrchr(s, ':');
    if (!colon) return hp_fail(flag, s, err, cap, "must be HOST:PORT");
    const char *h = s;
    size_t hl = (size_t)(colon - s);
    if (hl >= 2 && s[0] == '[' && s[hl - 1] == ']') {
        if (opts & KC_HOSTPORT_NO_IPV6) return hp_fail(flag, s, err, cap, "an IPv6 host is not accepted here");
        h++;
        hl -= 2;
        if (hl == 0) return hp_fail(flag, s, err, cap, "the brackets hold no IPv6 address");
    } else if (memchr(s, ':', hl) || (hl > 0 && s[0] == '[')) {
        return hp_fail(flag, s, err, cap, "an IPv6 host must be in brackets, [::1]:PORT");
    }
    if (hl == 0 && !(opts & KC_HOSTPORT_EMPTY_HOST))
        return hp_fail(flag, s, err, cap, "must be HOST:PORT (the host is empty)");
    if (hl >= KC_HOST_MAX) return hp_fail(flag, s, err, cap, "the host is over %d characters", KC_HOST_MAX - 1);
    for (size_t k = 0; k < hl; k++) {
        unsigned char c = (unsigned char)h[k];
        if (c <= ' ' || c == '/' || c == '[' || c == ']' || c == 0x7f)
            return hp_fail(flag, s, err, cap, "the host contains '%c'", c >= ' ' && c != 0x7f ? c : '?');
    }
    const char *p = colon + 1;
    int lo = opts & KC_HOSTPORT_PORT_ZERO ? 0 : 1;
    size_t pl = strlen(p);
    long port = 0;
    int ok = pl >= 1 && pl <= 5;
    for (size_t k = 0; ok && k < pl; k++) {
        ok = p[k] >= '0' && p[k] <= '9';
        port = port * 10 + (p[k] - '0');
    }
    if (!ok || port < lo || port > 65535)
        return hp_fail(flag, s, err, cap, "the port '%.16s' is not in %d..65535", p, lo);
    out->text = s;
    memcpy(out->host, h, hl);
    out->host[hl] = 0;
    out->port = (int)port;
    return 0;
}

void kc_hostport_format(const char *host, int port, char *buf, size_t cap)
{
    int v6 = strchr(host, ':') != NULL;
    snprintf(buf, cap, "%s%s%s:%d", v6 ? "[" : "", host, v6 ? "]" : "", port);
}

/* ------------------------------------------------------------------ parsing */

static const kc_flag *find(const kc_flag *t, const char *a)
{
    for (; t && t->kind != KC_FLAG_END; t++)
        if (t->kind != KC_FLAG_SECTION && (!strcmp(t->name, a) || (t->alias && !strcmp(t->alias, a)))) return t;
    return NULL;
}

static int fail(char *err, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(char *err, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return -1;
}

static int parse_int(const char *a, const char *v, int64_t lo, int64_t hi, int64_t *out, char *err, size_t cap)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno == ERANGE) return fail(err, cap, "%s: '%.64s' is out of range [%" PRId64 ", %" PRId64 "]", a, v, lo, hi);
    if (errno || end == v || *end) return fail(err, cap, "%s: '%.64s' is not an integer", a, v);
    if (x < lo || x > hi) return fail(err, cap, "%s: %lld is out of range [%" PRId64 ", %" PRId64 "]", a, x, lo, hi);
    *out = (int64_t)x;
    return 0;
}

static int store(const kc_flag *e, const char *a, const char *v, char *err, size_t cap)
{
    switch (e->kind) {
    case KC_FLAG_INT:
    case KC_FLAG_INT64: {
        int64_t x = 0; /* set by parse_int on success; initialised for -O2's flow analysis */
        if (parse_int(a, v, e->min, e->max, &x, err, cap)) return -1;
        if (e->kind == KC_FLAG_INT) *(int *)e->dest = (int)x;
        else *(int64_t *)e->dest = x;
        return 0;
    }
    case KC_FLAG_DOUBLE: {
        char *end;
        errno = 0;
        double x = strtod(v, &end);
        if (errno || end == v || *end || !isfinite(x)) return fail(err, cap, "%s: '%.64s' is not a number", a, v);
        if (x < e->dmin || x > e->dmax) return fail(err, cap, "%s: %g is out of range [%g, %g]", a, x, e->dmin, e->dmax);
        *(double *)e->dest = x;
        return 0;
    }
    case KC_FLAG_STRING: *(const char **)e->dest = v; return 0;
    case KC_FLAG_HOSTPORT: ((kc_hostport *)e->dest)->text = v; return 0;
    case KC_FLAG_LIST:
        if (*e->count >= e->max_count) return fail(err, cap, "%s: at most %d", a, e->max_count);
        ((const char **)e->dest)[(*e->count)++] = v;
        return 0;
    case KC_FLAG_CHOICE: {
        char names[256];
        size_t at = 0;
        names[0] = 0;
        for (const kc_flag_choice *c = e->choices; c->name; c++) {
            if (!strcmp(c->name, v)) {
                *(int *)e->dest = c->value;
                return 0;
            }
            at += (size_t)snprintf(names + at, at < sizeof names ? sizeof names - at : 0, "%s%s",
                                   c == e->choices ? "" : c[1].name ? ", " : " or ", c->name);
            if (at >= sizeof names) at = sizeof names - 1;
        }
        return fail(err, cap, "%s: '%.64s' is not %s", a, v, names);
    }
    case KC_FLAG_FUNC: return e->fn(e->dest, e->name, v, err, cap);
    default: return fail(err, cap, "%s: not a flag", a);
    }
}

static int finish_table(const kc_flag *t, char *err, size_t cap)
{
    for (; t && t->kind != KC_FLAG_END; t++) {
        if (t->kind != KC_FLAG_HOSTPORT) continue;
        kc_hostport *hp = t->dest;
        if (hp->text && kc_hostport_parse(t->name, hp->text, t->opts, hp, err, cap) != 0) return -1;
    }
    return 0;
}

int kc_flags_parse(const kc_flags *f, int argc, char **argv, int *i, int *stop, char *err, size_t cap)
{
    if (stop) *stop = argc;
    for (; *i < argc; (*i)++) {
        const char *a = argv[*i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return 1;
        const kc_flag *e = a[0] == '-' ? find(f->table, a) : NULL;
        if (!e && a[0] == '-') e = find(f->more, a);
        if (!e) {
            if (a[0] != '-' && stop) {
                *stop = *i;
                break;
            }
            return fail(err, cap, "unknown argument '%s' (see --help)", a);
        }
        if (e->kind == KC_FLAG_BOOL) {
            *(int *)e->dest = 1;
            continue;
        }
        if (*i + 1 >= argc) return fail(err, cap, "%s needs a value (see --help)", a);
        if (store(e, a, argv[++*i], err, cap) != 0) return -1;
    }
    if (finish_table(f->table, err, cap) != 0 || finish_table(f->more, err, cap) != 0) return -1;
    return 0;
}

/* ------------------------------------------------------------------ --help */

/* Writes `text` from column `col`, wrapped at HELP_WIDTH, continuation lines indented to
 * HELP_COL. */
static void wrap(FILE *out, const char *text, int col)
{
    const char *p = text;
    while (*p) {
        while (*p == ' ') p++;
        size_t w = strcspn(p, " ");
        if (col > HELP_COL && col + 1 + (int)w > HELP_WIDTH) {
            fprintf(out, "\n%*s", HELP_COL, "");
            col = HELP_COL;
        } else if (col > HELP_COL) {
            fputc(' ', out);
            col++;
        }
        fwrite(p, 1, w, out);
        col += (int)w;
        p += w;
    }
    fputc('\n', out);
}

static void help_entry(FILE *out, const kc_flag *e)
{
    if (e->kind == KC_FLAG_SECTION) {
        fprintf(out, "\n%s\n", e->help);
        return;
    }
    if (!e->help) return;
    int col = fprintf(out, "  %s%s%s", e->name, e->arg ? " " : "", e->arg ? e->arg : "");
    if (e->alias) col += fprintf(out, ", %s%s%s", e->alias, e->arg ? " " : "", e->arg ? e->arg : "");
    if (col >= HELP_COL - 1) {
        fprintf(out, "\n%*s", HELP_COL, "");
    } else {
        fprintf(out, "%*s", HELP_COL - col, "");
    }
    char text[1024];
    snprintf(text, sizeof text, "%s%s%s%s", e->help ? e->help : "", e->def ? " (default " : "",
             e->def ? e->def : "", e->def ? ")" : "");
    wrap(out, text, HELP_COL);
}

char *kc_flags_help(const kc_flags *f)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&buf, &len);
    if (!out) return NULL;
    fprintf(out, "usage: %s %s\n", f->prog, f->usage);
    if (f->about) fprintf(out, "\n%s\n", f->about);
    fputc('\n', out);
    for (int k = 0; k < 2; k++)
        for (const kc_flag *e = k ? f->more : f->table; e && e->kind != KC_FLAG_END; e++) help_entry(out, e);
    help_entry(out, &(kc_flag){.kind = KC_FLAG_BOOL, .name = "-h", .alias = "--help", .help = "this help"});
    if (f->footer) fprintf(out, "\n%s\n", f->footer);
    if (fclose(out) != 0) {
        free(buf);
        return NULL;
    }
    return buf;
}

void kc_flags_die(const kc_flags *f, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", f->prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(2);
}

int kc_flags_main(const kc_flags *f, int argc, char **argv, int allow_rest)
{
    char err[512];
    int i = 1, stop = argc;
    int rc = kc_flags_parse(f, argc, argv, &i, allow_rest ? &stop : NULL, err, sizeof err);
    if (rc < 0) kc_flags_die(f, "%s", err);
    if (rc == 1) {
        /* one write: `--help | grep -q X` under pipefail would otherwise fail when grep exits
         * before a second write */
        char *text = kc_flags_help(f);
        if (!text) kc_flags_die(f, "out of memory");
        size_t n = strlen(text);
        int ok = fwrite(text, 1, n, stdout) == n && fflush(stdout) == 0;
        free(text);
        exit(ok ? 0 : 1);
    }
    return stop;
}

/* ------------------------------------------------------------------ shared callbacks */

int kc_flag_log_level(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    if (kc_log_parse_level(v, dest) == 0) return 0;
    return fail(err, cap, "%s: '%.64s' is not debug, info, warn or error", flag, v);
}

/* kc_flag_bytes and kc_flag_bytes_positive: the number must be > 0 when `positive`, else >= 0 */
static int flag_bytes(void *dest, const char *flag, const char *s, int positive, char *err, size_t cap)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !(positive ? v > 0 : v >= 0))
        return positive ? fail(err, cap, "%s: '%s' is not a positive size (e.g. 512M, 2G)", flag, s)
                        : fail(err, cap, "%s: '%s' is not a size (e.g. 0, 512M, 2G)", flag, s);
    double mul = 1;
    if (*end == 'K' || *end == 'k')
        mul = 1024.0;
    else if (*end == 'M' || *end == 'm')
        mul = 1024.0 * 1024.0;
    else if (*end == 'G' || *end == 'g')
        mul = 1024.0 * 1024.0 * 1024.0;
    else if (*end)
        return fail(err, cap, "%s: '%s': unknown unit '%s' (K, M or G)", flag, s, end);
    if (*end && end[1] && strcmp(end + 1, "iB") != 0 && strcmp(end + 1, "B") != 0)
        return fail(err, cap, "%s: '%s': unknown unit '%s' (K, M or G)", flag, s, end);
    if (v * mul > 1e15) return fail(err, cap, "%s: '%s' is too large", flag, s);
    *(int64_t *)dest = (int64_t)(v * mul);
    return 0;
}

int kc_flag_bytes(void *dest, const char *flag, const char *s, char *err, size_t cap)
{
    return flag_bytes(dest, flag, s, 0, err, cap);
}

int kc_flag_bytes_positive(void *dest, const char *flag, const char *s, char *err, size_t cap)
{
    return flag_bytes(dest, flag, s, 1, err, cap);
}

int kc_flag_etcd(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    if (kc_etcd_flag(dest, flag, v)) return 0;
    return fail(err, cap, "unknown argument '%s' (see --help)", flag);
}

int kc_flag_tls(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    if (kc_tls_flag(dest, flag, v)) return 0;
    return fail(err, cap, "unknown argument '%s' (see --help)", flag);
}
