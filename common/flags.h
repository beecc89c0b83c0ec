/*
 * flags.h - command-line flags from a declarative table, and the one HOST:PORT parser. Every
 * kvrelay program declares its flags as a kc_flag table (name, value name, kind, destination,
 * range, default shown, help) and hands it to kc_flags_main, which parses argv, prints --help
 * from the same table, and on a bad flag prints one message naming the flag and the value and
 * exits with status 2. kc_flags_parse is the same without printing or exiting (for tests and
 * for programs that parse in stages). Not here: "--flag=value" syntax, short option clusters.
 * Test: ctest -R test_flags. docs/design.md ("Flags") shows a table.
 */
#ifndef KC_FLAGS_H
#define KC_FLAGS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ------------------------------------------------------------------ HOST:PORT */

/* What a call site allows beyond "host:port" with a port in 1..65535. */
enum {
    KC_HOSTPORT_PORT_ZERO = 1 << 0,  /* port 0: listen on an ephemeral port */
    KC_HOSTPORT_EMPTY_HOST = 1 << 1, /* ":PORT": no host (every interface) */
    KC_HOSTPORT_NO_IPV6 = 1 << 2,    /* a bracketed "[v6]" host is refused */
};

#define KC_HOST_MAX 256

typedef struct kc_hostport {
    const char *text;       /* as given ("[::1]:7100"); not owned. Set it to the default */
    char host[KC_HOST_MAX]; /* "::1": brackets off; "" for ":PORT" */
    int port;
} kc_hostport;

/* Parses "host:port", "[v6]:port" (and ":port" with KC_HOSTPORT_EMPTY_HOST). The host must
 * not contain spaces, '/', brackets other than around an IPv6 address, or a ':' outside
 * brackets. Fills *out (text = s) and returns 0, or returns -1 with err (`cap` bytes): with
 * `flag`, "FLAG: 'VALUE': why"; with flag NULL, only "why", for a caller that names the value
 * itself. The why names the problem: "must be HOST:PORT", "the port 'x' is not in 1..65535",
 * "an IPv6 host must be in brackets, [::1]:PORT", ... */
int kc_hostport_parse(const char *flag, const char *s, unsigned opts, kc_hostport *out, char *err,
                      size_t cap);
/* "host:port", "[host]:port" when host has a ':' (IPv6), ":port" for an empty host. */
void kc_hostport_format(const char *host, int port, char *buf, size_t cap);

/* ------------------------------------------------------------------ flag tables */

typedef enum kc_flag_kind {
    KC_FLAG_END = 0,  /* ends a table (a zeroed entry) */
    KC_FLAG_BOOL,     /* int *: set to 1; takes no value */
    KC_FLAG_INT,      /* int *: an integer in [min, max] */
    KC_FLAG_INT64,    /* int64_t *: an integer in [min, max] */
    KC_FLAG_DOUBLE,   /* double *: a finite number in [dmin, dmax] */
    KC_FLAG_STRING,   /* const char **: the argv string itself */
    KC_FLAG_HOSTPORT, /* kc_hostport *: .text set from argv; split at the end of parsing (the
                         default too) with `opts` */
    KC_FLAG_LIST,     /* const char *[max_count]: each use appends (repeatable); *count counts */
    KC_FLAG_CHOICE,   /* int *: the value of the name in `choices` the argument matches */
    KC_FLAG_FUNC,     /* fn(dest, flag, value, err, cap) stores the value; for special syntax */
    KC_FLAG_SECTION,  /* not a flag: `help` is a heading line in --help */
} kc_flag_kind;

typedef struct kc_flag_choice {
    const char *name; /* NULL ends the list */
    int value;
} kc_flag_choice;

/* Stores `value` of `flag` into dest. Returns 0, or -1 with a message in err (`cap` bytes)
 * that names the flag and the value. */
typedef int (*kc_flag_fn)(void *dest, const char *flag, const char *value, char *err, size_t cap);

typedef struct kc_flag {
    kc_flag_kind kind;
    const char *name;               /* "--listen" */
    const char *alias;              /* a second spelling ("--max-prompt"), or NULL */
    const char *arg;                /* the value's name in --help ("HOST:PORT"); NULL for BOOL */
    void *dest;                     /* as the kind says */
    int64_t min, max;               /* INT, INT64 */
    double dmin, dmax;              /* DOUBLE */
    unsigned opts;                  /* HOSTPORT: KC_HOSTPORT_* */
    const kc_flag_choice *choices;  /* CHOICE */
    kc_flag_fn fn;                  /* FUNC */
    int *count;                     /* LIST: entries stored so far */
    int max_count;                  /* LIST: capacity of dest */
    const char *def;                /* the default --help shows, or NULL */
    const char *help;               /* one paragraph; --help wraps it. NULL: accepted but not
                                       listed (a flag taken only to refuse it with a clearer
                                       message after parsing) */
} kc_flag;

/* A program's flags and the text around them in --help. */
typedef struct kc_flags {
    const char *prog;     /* "kvrelay-router": messages start with "PROG: " */
    const char *usage;    /* what follows "usage: PROG " (one or more lines) */
    const char *about;    /* a paragraph after the usage line, or NULL */
    const kc_flag *table; /* ends with a KC_FLAG_END entry */
    const kc_flag *more;  /* a second table parsed alongside (a command's common flags), or NULL */
    const char *footer;   /* printed last, as is, or NULL */
} kc_flags;

/* Parses argv[*i..argc) against the tables; -h and --help are built in. With `stop` NULL every
 * argument must be a flag; otherwise parsing stops at the first one that is not and *stop is
 * its index (argc when there is none). *i is where to start (1 for a whole argv) and ends where
 * parsing stopped. Returns 0 when parsed, 1 when --help was asked (nothing after it is read),
 * or -1 with a message in err (`cap` bytes): an unknown argument, a missing value, a bad
 * number, out of range, a bad choice or HOST:PORT, each naming the flag and the value.
 * HOSTPORT destinations are split after the last argument, the defaults included. */
int kc_flags_parse(const kc_flags *f, int argc, char **argv, int *i, int *stop, char *err,
                   size_t cap);
/* The --help text, malloc'd (the caller frees it), or NULL when out of memory. */
char *kc_flags_help(const kc_flags *f);
/* kc_flags_parse from argv[1], then: --help printed to stdout in one write and exit 0; an error
 * printed as "PROG: message" to stderr and exit 2. Returns the index parsing stopped at (as
 * *stop; argc when `allow_rest` is 0). */
int kc_flags_main(const kc_flags *f, int argc, char **argv, int allow_rest);
/* Prints "PROG: message" to stderr and exits with status 2: for checks after parsing that
 * involve several flags. */
void kc_flags_die(const kc_flags *f, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));

/* FUNC callbacks shared by the programs (dest in parentheses). */
int kc_flag_log_level(void *dest, const char *flag, const char *v, char *err, size_t cap); /* kc_log_level */
int kc_flag_etcd(void *dest, const char *flag, const char *v, char *err, size_t cap);      /* kc_etcd_config */
int kc_flag_tls(void *dest, const char *flag, const char *v, char *err, size_t cap);       /* kc_tls_config */
/* A byte count (int64_t): digits with an optional K, M or G (also KB, KiB, ...), powers of 1024;
 * kc_flag_bytes takes 0, kc_flag_bytes_positive does not */
int kc_flag_bytes(void *dest, const char *flag, const char *v, char *err, size_t cap);
int kc_flag_bytes_positive(void *dest, const char *flag, const char *v, char *err, size_t cap);

/* The entries every serving program shares: the etcd connection (etcd.h, kc_etcd_flags_finish
 * checks them after parsing; --etcd itself is declared by each program, its help differs) and
 * TLS (rpc.h, kc_tls_flags_finish). `cfg` points to a kc_etcd_config / kc_tls_config. */
#define KC_FLAGS_ETCD(cfg)                                                                         \
    {.kind = KC_FLAG_FUNC, .name = "--etcd-ca", .arg = "FILE", .fn = kc_flag_etcd, .dest = (cfg),  \
     .help = "TLS to etcd: CA bundle (PEM)"},                                                      \
    {.kind = KC_FLAG_FUNC, .name = "--etcd-cert", .arg = "FILE", .fn = kc_flag_etcd, .dest = (cfg),\
     .help = "TLS client certificate (with --etcd-key)"},                                          \
    {.kind = KC_FLAG_FUNC, .name = "--etcd-key", .arg = "FILE", .fn = kc_flag_etcd, .dest = (cfg), \
     .help = "TLS client key"},                                                                    \
    {.kind = KC_FLAG_FUNC, .name = "--etcd-user", .arg = "NAME", .fn = kc_flag_etcd, .dest = (cfg),\
     .help = "etcd auth user; the password comes from the environment variable "                  \
             "KVRELAY_ETCD_PASSWORD (not a flag: ps shows flags)"}
#define KC_FLAGS_TLS(cfg)                                                                          \
    {.kind = KC_FLAG_FUNC, .name = "--tls-cert", .arg = "FILE", .fn = kc_flag_tls, .dest = (cfg),  \
     .help = "TLS: this process's certificate (PEM; turns TLS on)"},                               \
    {.kind = KC_FLAG_FUNC, .name = "--tls-key", .arg = "FILE", .fn = kc_flag_tls, .dest = (cfg),   \
     .help = "TLS: its private key (PEM, unencrypted)"},                                           \
    {.kind = KC_FLAG_FUNC, .name = "--tls-ca", .arg = "FILE", .fn = kc_flag_tls, .dest = (cfg),    \
     .help = "TLS: the CA (PEM) peers' certificates must chain to"}
#define KC_FLAGS_TLS_CLIENT_AUTH(cfg)                                                              \
    {.kind = KC_FLAG_FUNC, .name = "--tls-client-auth", .arg = "none|request|require",             \
     .fn = kc_flag_tls, .dest = (cfg), .def = "none",                                              \
     .help = "public port: ask clients for a certificate from --tls-ca (the hops to nodes are "    \
             "always mutual TLS)"}
/* A node takes --tls-client-auth only for kc_tls_flags_finish to say why it does not apply. */
#define KC_FLAGS_TLS_CLIENT_AUTH_REFUSED(cfg)                                                      \
    {.kind = KC_FLAG_FUNC, .name = "--tls-client-auth", .arg = "MODE", .fn = kc_flag_tls, .dest = (cfg)}

/* A node's registration in etcd and its TLS: --etcd (registering under
 * /kvrelay/CLUSTER/nodes/ROLE/ID), --cluster, --lease-ttl, the etcd and TLS entries above.
 * `role` is a string literal ("prefill"); the others point into the node's config. */
#define KC_FLAGS_NODE(role, endpoints, cluster, lease_ttl_s, etcd, tls)                             \
    {.kind = KC_FLAG_STRING, .name = "--etcd", .arg = "ENDPOINTS", .dest = (endpoints),            \
     .help = "register in etcd (\"127.0.0.1:2379,...\") under a lease: /kvrelay/CLUSTER/nodes/"    \
             role "/ID; etcd being down does not stop serving (registration retries)"},           \
    {.kind = KC_FLAG_STRING, .name = "--cluster", .arg = "NAME", .dest = (cluster),                \
     .def = "\"default\"", .help = "etcd cluster name"},                                           \
    {.kind = KC_FLAG_INT, .name = "--lease-ttl", .arg = "S", .dest = (lease_ttl_s), .min = 2,      \
     .max = 3600, .def = "10", .help = "etcd lease TTL in seconds"},                               \
    KC_FLAGS_ETCD(etcd), KC_FLAGS_TLS(tls), KC_FLAGS_TLS_CLIENT_AUTH_REFUSED(tls)

#endif /* KC_FLAGS_H */
