/*
 * test_flags.c - the flag tables (common/flags.h) and the HOST:PORT parser: every kind with good
 * and bad values and its range, missing values, unknown arguments, repeatable flags, stopping at
 * a command, HOSTPORT defaults split after parsing, and --help listing every flag of a table with
 * its default. HOST:PORT: names, IPv4, [IPv6], ":PORT", port 0 only where allowed, and the
 * errors naming the flag and the value. No process is started: kc_flags_parse does not exit.
 * Run: ctest -R test_flags.
 */
#include "kr_test.h"

#include "etcd.h"
#include "flags.h"
#include "log.h"
#include "rpc.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ HOST:PORT */

static void hp_ok(const char *s, unsigned opts, const char *host, int port)
{
    kc_hostport hp;
    char err[256] = "";
    int rc = kc_hostport_parse("--x", s, opts, &hp, err, sizeof err);
    CHECK(rc == 0, "'%s' refused: %s", s, err);
    if (rc == 0) {
        CHECK(!strcmp(hp.host, host) && hp.port == port, "'%s' -> '%s' %d, expected '%s' %d", s, hp.host, hp.port,
              host, port);
        CHECK(hp.text == s, "'%s': text is not the input", s);
    }
}

static void hp_bad(const char *s, unsigned opts, const char *needle)
{
    kc_hostport hp;
    char err[256] = "";
    CHECK(kc_hostport_parse("--x", s, opts, &hp, err, sizeof err) == -1, "'%s' accepted", s);
    CHECK(strstr(err, needle) != NULL, "'%s': error '%s' lacks '%s'", s, err, needle);
    CHECK(!strncmp(err, "--x: '", 6), "'%s': error '%s' does not name the flag", s, err);
}

static void test_hostport(void)
{
    hp_ok("127.0.0.1:7100", 0, "127.0.0.1", 7100);
    hp_ok("localhost:1", 0, "localhost", 1);
    hp_ok("node-3.svc.cluster.local:65535", 0, "node-3.svc.cluster.local", 65535);
    hp_ok("[::1]:9101", 0, "::1", 9101);
    hp_ok("[fe80::1%eth0]:80", 0, "fe80::1%eth0", 80);
    hp_ok("0.0.0.0:0", KC_HOSTPORT_PORT_ZERO, "0.0.0.0", 0);
    hp_ok(":7101", KC_HOSTPORT_EMPTY_HOST, "", 7101);
    hp_ok(":0", KC_HOSTPORT_EMPTY_HOST | KC_HOSTPORT_PORT_ZERO, "", 0);

    hp_bad("127.0.0.1", 0, "must be HOST:PORT");
    hp_bad("", 0, "must be HOST:PORT");
    hp_bad(":7000", 0, "the host is empty");
    hp_bad("h:0", 0, "the port '0' is not in 1..65535");
    hp_bad("h:70000", KC_HOSTPORT_PORT_ZERO, "the port '70000' is not in 0..65535");
    hp_bad("h:", 0, "the port '' is not");
    hp_bad("h:7x", 0, "the port '7x'");
    hp_bad("h:-1", KC_HOSTPORT_PORT_ZERO, "the port '-1'");
    hp_bad("h:+80", 0, "the port '+80'");
    hp_bad("h: 80", 0, "the port ' 80'");
    hp_bad("h:000080", 0, "the port '000080'");
    hp_bad("::1:7000", 0, "IPv6 host must be in brackets");
    hp_bad("[::1:7000", 0, "IPv6 host must be in brackets");
    hp_bad("[]:7000", 0, "no IPv6 address");
    hp_bad("[::1]:7000", KC_HOSTPORT_NO_IPV6, "IPv6 host is not accepted");
    hp_bad("a b:7000", 0, "the host contains ' '");
    hp_bad("http://h:7000", 0, "IPv6 host must be in brackets"); /* the scheme's ':' */
    hp_bad("h/x:7000", 0, "the host contains '/'");
    char longhost[400];
    memset(longhost, 'a', 300);
    snprintf(longhost + 300, 100, ":80");
    hp_bad(longhost, 0, "over 255 characters");

    /* without a flag: only the reason, for callers that name the value themselves */
    kc_hostport hp;
    char err[256];
    CHECK(kc_hostport_parse(NULL, "x:0", 0, &hp, err, sizeof err) == -1 && !strcmp(err, "the port '0' is not in 1..65535"),
          "bare reason: '%s'", err);

    char buf[64];
    kc_hostport_format("::1", 80, buf, sizeof buf);
    CHECK(!strcmp(buf, "[::1]:80"), "format v6: %s", buf);
    kc_hostport_format("10.0.0.1", 7100, buf, sizeof buf);
    CHECK(!strcmp(buf, "10.0.0.1:7100"), "format v4: %s", buf);
    kc_hostport_format("", 7101, buf, sizeof buf);
    CHECK(!strcmp(buf, ":7101"), "format empty host: %s", buf);
}

/* ------------------------------------------------------------------ tables */

typedef struct opts {
    int verbose, threads, mode;
    int64_t bytes;
    double ratio;
    const char *name;
    kc_hostport listen, http;
    const char *keys[3];
    int n_keys;
    kc_log_level level;
    kc_tls_config tls;
    kc_etcd_config etcd;
    int odd_calls;
} opts;

static int odd_only(void *dest, const char *flag, const char *v, char *err, size_t cap)
{
    opts *o = dest;
    o->odd_calls++;
    if (strlen(v) % 2) return 0;
    snprintf(err, cap, "%s: '%s' has an even length", flag, v);
    return -1;
}

static const kc_flag_choice modes[] = {{"fast", 1}, {"slow", 2}, {"exact", 3}, {NULL, 0}};

static opts o;
static const kc_flag table[] = {
    {.kind = KC_FLAG_BOOL, .name = "--verbose", .dest = &o.verbose, .help = "say more"},
    {.kind = KC_FLAG_INT, .name = "--threads", .arg = "N", .dest = &o.threads, .min = 1, .max = 64,
     .def = "all CPUs", .help = "worker threads"},
    {.kind = KC_FLAG_INT64, .name = "--bytes", .arg = "N", .dest = &o.bytes, .min = 0, .max = INT64_MAX,
     .help = "a large count"},
    {.kind = KC_FLAG_DOUBLE, .name = "--ratio", .arg = "R", .dest = &o.ratio, .dmin = 0, .dmax = 1,
     .def = "0.5", .help = "a fraction"},
    {.kind = KC_FLAG_SECTION, .help = "Addresses:"},
    {.kind = KC_FLAG_STRING, .name = "--name", .alias = "--id", .arg = "NAME", .dest = &o.name, .help = "a name"},
    {.kind = KC_FLAG_HOSTPORT, .name = "--listen", .arg = "HOST:PORT", .dest = &o.listen,
     .opts = KC_HOSTPORT_PORT_ZERO, .def = "127.0.0.1:7100", .help = "where to listen (port 0: any free)"},
    {.kind = KC_FLAG_HOSTPORT, .name = "--http", .arg = "HOST:PORT", .dest = &o.http, .help = "HTTP"},
    {.kind = KC_FLAG_LIST, .name = "--key", .arg = "KEY", .dest = o.keys, .count = &o.n_keys, .max_count = 3,
     .help = "a key (repeatable)"},
    {.kind = KC_FLAG_CHOICE, .name = "--mode", .arg = "M", .dest = &o.mode, .choices = modes, .help = "how"},
    {.kind = KC_FLAG_FUNC, .name = "--log-level", .arg = "L", .dest = &o.level, .fn = kc_flag_log_level,
     .def = "info", .help = "debug, info, warn or error"},
    {.kind = KC_FLAG_FUNC, .name = "--odd", .arg = "S", .dest = &o, .fn = odd_only,
     .help = "a value of odd length, and a help text long enough to be wrapped onto a second line of the "
             "help output, which keeps every line within the width"},
    KC_FLAGS_TLS(&o.tls),
    KC_FLAGS_TLS_CLIENT_AUTH_REFUSED(&o.tls),
    {.kind = KC_FLAG_END},
};
static const kc_flag more[] = {
    {.kind = KC_FLAG_STRING, .name = "--etcd", .arg = "ENDPOINTS", .dest = &o.etcd.endpoints, .help = "etcd"},
    KC_FLAGS_ETCD(&o.etcd),
    {.kind = KC_FLAG_END},
};
static const kc_flags prog = {.prog = "test-prog", .usage = "[options] [COMMAND]", .about = "A test.",
                              .table = table, .more = more, .footer = "The end."};

static void reset(void)
{
    o = (opts){.threads = 4, .ratio = 0.5, .listen = {.text = "127.0.0.1:7100"}, .level = KC_LOG_INFO};
}

/* Parses a NULL-terminated argument list (argv[0] added); returns kc_flags_parse's result. */
static int parse(char *err, int *stop, ...)
{
    char *argv[32] = {"test-prog"};
    int argc = 1;
    va_list ap;
    va_start(ap, stop);
    for (char *a; (a = va_arg(ap, char *)) && argc < 31;) argv[argc++] = a;
    va_end(ap);
    reset();
    int i = 1;
    err[0] = 0;
    return kc_flags_parse(&prog, argc, argv, &i, stop, err, 256);
}

static void bad(const char *needle, int rc, const char *err)
{
    CHECK(rc == -1, "accepted, expected '%s'", needle);
    CHECK(strstr(err, needle) != NULL, "error '%s' lacks '%s'", err, needle);
}

static void test_parse(void)
{
    char err[256];
    int rc = parse(err, NULL, "--verbose", "--threads", "8", "--bytes", "9000000000", "--ratio", "0.25", "--id", "n1",
                   "--listen", "[::1]:0", "--http", "h:80", "--key", "a", "--key", "b", "--mode", "exact",
                   "--log-level", "debug", "--odd", "abc", "--tls-ca", "ca.pem", "--etcd", "e:2379", "--etcd-user",
                   "u", NULL);
    CHECK(rc == 0, "good flags refused: %s", err);
    CHECK(o.verbose == 1 && o.threads == 8 && o.bytes == 9000000000LL && o.ratio == 0.25, "numbers");
    CHECK(o.name && !strcmp(o.name, "n1"), "alias --id stores into --name");
    CHECK(!strcmp(o.listen.host, "::1") && o.listen.port == 0, "listen %s %d", o.listen.host, o.listen.port);
    CHECK(!strcmp(o.http.host, "h") && o.http.port == 80, "http");
    CHECK(o.n_keys == 2 && !strcmp(o.keys[0], "a") && !strcmp(o.keys[1], "b"), "repeatable");
    CHECK(o.mode == 3 && o.level == KC_LOG_DEBUG && o.odd_calls == 1, "choice, log level, callback");
    CHECK(o.tls.ca_file && !strcmp(o.tls.ca_file, "ca.pem"), "--tls-ca via kc_tls_flag");
    CHECK(o.etcd.endpoints && o.etcd.user && !strcmp(o.etcd.user, "u"), "--etcd, --etcd-user from the second table");
    rc = parse(err, NULL, "--tls-client-auth", "require", NULL);
    CHECK(rc == 0 && o.tls.client_auth_arg && !strcmp(o.tls.client_auth_arg, "require"), "an unlisted entry is parsed");

    /* defaults: untouched values stay, a HOSTPORT default is split too, an unset one is not */
    rc = parse(err, NULL, NULL);
    CHECK(rc == 0 && o.threads == 4 && !strcmp(o.listen.host, "127.0.0.1") && o.listen.port == 7100 && !o.http.text,
          "defaults: %s", err);

    /* the last of a repeated flag wins */
    rc = parse(err, NULL, "--threads", "2", "--threads", "3", NULL);
    CHECK(rc == 0 && o.threads == 3, "last value wins");

    bad("unknown argument '--bogus' (see --help)", parse(err, NULL, "--bogus", "1", NULL), err);
    bad("unknown argument 'stray' (see --help)", parse(err, NULL, "stray", NULL), err);
    bad("--threads needs a value (see --help)", parse(err, NULL, "--threads", NULL), err);
    bad("--threads: 'x' is not an integer", parse(err, NULL, "--threads", "x", NULL), err);
    bad("--threads: '' is not an integer", parse(err, NULL, "--threads", "", NULL), err);
    bad("--threads: '3.5' is not an integer", parse(err, NULL, "--threads", "3.5", NULL), err);
    bad("--threads: 0 is out of range [1, 64]", parse(err, NULL, "--threads", "0", NULL), err);
    bad("--threads: 65 is out of range [1, 64]", parse(err, NULL, "--threads", "65", NULL), err);
    bad("--bytes: '99999999999999999999' is out of range", parse(err, NULL, "--bytes", "99999999999999999999", NULL), err);
    bad("--bytes: -1 is out of range", parse(err, NULL, "--bytes", "-1", NULL), err);
    bad("--ratio: 'nan' is not a number", parse(err, NULL, "--ratio", "nan", NULL), err);
    bad("--ratio: '1e999' is not a number", parse(err, NULL, "--ratio", "1e999", NULL), err);
    bad("--ratio: 1.5 is out of range [0, 1]", parse(err, NULL, "--ratio", "1.5", NULL), err);
    bad("--listen: 'nohost': must be HOST:PORT", parse(err, NULL, "--listen", "nohost", NULL), err);
    bad("--http: 'h:0': the port '0' is not in 1..65535", parse(err, NULL, "--http", "h:0", NULL), err);
    bad("--key: at most 3", parse(err, NULL, "--key", "a", "--key", "b", "--key", "c", "--key", "d", NULL), err);
    bad("--mode: 'quick' is not fast, slow or exact", parse(err, NULL, "--mode", "quick", NULL), err);
    bad("--log-level: 'loud' is not debug, info, warn or error", parse(err, NULL, "--log-level", "loud", NULL), err);
    bad("--odd: 'ab' has an even length", parse(err, NULL, "--odd", "ab", NULL), err);
    bad("unknown argument '--tls-other'", parse(err, NULL, "--tls-other", "x", NULL), err);

    /* --help wins over what follows it, even bad flags */
    CHECK(parse(err, NULL, "--threads", "2", "--help", "--bogus", NULL) == 1, "--help");
    CHECK(parse(err, NULL, "-h", NULL) == 1, "-h");

    /* stopping at a command: flags before it, then the rest from its index */
    int stop = -1;
    rc = parse(err, &stop, "--threads", "5", "run", "--verbose", NULL);
    CHECK(rc == 0 && stop == 3 && o.threads == 5 && !o.verbose, "stop at the command: rc %d stop %d", rc, stop);
    rc = parse(err, &stop, "--threads", "5", NULL);
    CHECK(rc == 0 && stop == 3, "no command: stop is argc (%d)", stop);
    /* a value that looks like a command is still the flag's value */
    rc = parse(err, &stop, "--id", "run", NULL);
    CHECK(rc == 0 && stop == 3 && !strcmp(o.name, "run"), "a flag's value is not the command");
}

static void test_help(void)
{
    char *h = kc_flags_help(&prog);
    REQUIRE(h, "kc_flags_help");
    CHECK(!strncmp(h, "usage: test-prog [options] [COMMAND]\n", 37), "usage line: %.60s", h);
    CHECK(strstr(h, "A test.") && strstr(h, "The end.") && strstr(h, "\nAddresses:\n"), "about, footer, section");
    for (int k = 0; k < 2; k++)
        for (const kc_flag *e = k ? more : table; e->kind != KC_FLAG_END; e++) {
            if (e->kind == KC_FLAG_SECTION || !e->help) continue;
            char want[128];
            snprintf(want, sizeof want, "  %s%s%s", e->name, e->arg ? " " : "", e->arg ? e->arg : "");
            CHECK(strstr(h, want) != NULL, "--help lacks '%s'", want);
            if (e->def) {
                snprintf(want, sizeof want, "(default %s)", e->def);
                CHECK(strstr(h, want) != NULL, "--help lacks '%s' for %s", want, e->name);
            }
        }
    CHECK(strstr(h, "--id NAME") && strstr(h, "  -h, --help"), "alias and -h, --help");
    CHECK(!strstr(h, "--tls-client-auth"), "an entry without help is not listed");
    for (const char *line = h; *line;) {
        size_t n = strcspn(line, "\n");
        CHECK(n <= 100, "a --help line of %zu characters: %.*s", n, (int)n, line);
        line += n + (line[n] == '\n');
    }
    free(h);
}

/* kc_flag_bytes and kc_flag_bytes_positive: units, suffixes, and what each refuses */
static void test_bytes(void)
{
    static const struct { const char *s; int64_t want; } ok[] = {
        {"0", 0}, {"4096", 4096}, {"1.5K", 1536}, {"512M", 536870912}, {"2G", 2147483648LL},
        {"64MiB", 67108864}, {"3kB", 3072},
    };
    char err[256];
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        int64_t v = -1;
        CHECK(kc_flag_bytes(&v, "--size", ok[i].s, err, sizeof err) == 0 && v == ok[i].want,
              "'%s': got %lld, want %lld", ok[i].s, (long long)v, (long long)ok[i].want);
    }
    static const struct { const char *s, *needle; int positive; } refused[] = {
        {"", "is not a size", 0}, {"-1", "is not a size", 0}, {"2T", "unknown unit 'T'", 0},
        {"2Mx", "unknown unit 'Mx'", 0}, {"1e20", "too large", 0}, {"nan", "is not a size", 0},
        {"0", "is not a positive size", 1}, {"-5M", "is not a positive size", 1}, {"3Q", "unknown unit", 1},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        int64_t v = 7;
        int rc = (refused[i].positive ? kc_flag_bytes_positive : kc_flag_bytes)(&v, "--size", refused[i].s, err, sizeof err);
        bad(refused[i].needle, rc, err);
        CHECK(v == 7, "'%s' refused but wrote %lld", refused[i].s, (long long)v);
    }
    int64_t v = 0;
    CHECK(kc_flag_bytes_positive(&v, "--size", "2G", err, sizeof err) == 0 && v == 2147483648LL, "positive 2G: %lld",
          (long long)v);
}

int main(void)
{
    test_hostport();
    test_parse();
    test_help();
    test_bytes();
    return kt_done("test_flags");
}
