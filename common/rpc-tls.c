/*
 * rpc-tls.c - TLS for the gRPC hops (rpc.h, "TLS"): the --tls-* flags every program takes, the
 * start-up checks of their PEM files, and gRPC C core's SSL credentials built from them.
 * The checks use OpenSSL directly (gRPC links it): gRPC itself reads the files only when the
 * first connection is made and then reports a failed handshake, which says nothing about a key
 * that belongs to another certificate or a certificate from another CA. Here those are start-up
 * errors naming the flag and the file.
 * Not here: certificate reloading (restart the process with new files), revocation lists, name
 * overrides (a server's certificate must name the address its clients dial: docs/security.md).
 * Tests: ctest -R test_rpc_tls (unit), tests/integration/tls.sh (a cluster).
 */
#include "rpc.h"

#include <grpc/grpc_security.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A PEM file larger than this is not a certificate bundle. */
#define KC_TLS_PEM_MAX (4u << 20)

/* The files of one configuration, read and checked. */
typedef struct {
    char *cert, *key, *ca; /* NUL-terminated PEM text; NULL when the flag was not given */
} tls_pems;

static void pems_free(tls_pems *p)
{
    free(p->cert);
    free(p->key);
    free(p->ca);
    memset(p, 0, sizeof *p);
}

static int given(const char *s) { return s && *s; }

/* Reads `path` (given with `flag`) as text. Returns NULL with `st` set. */
static char *read_pem(const char *flag, const char *path, kc_status *st)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "%s %s: cannot open: %s", flag, path,
                      strerror(errno));
        return NULL;
    }
    char *buf = malloc(KC_TLS_PEM_MAX + 1);
    size_t n = buf ? fread(buf, 1, KC_TLS_PEM_MAX + 1, f) : 0;
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad || n == 0 || n > KC_TLS_PEM_MAX) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "%s %s: %s", flag, path,
                      !buf ? "out of memory" : bad ? "read error" : n == 0 ? "empty file"
                                                                          : "over 4 MiB: not a PEM file");
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    return buf;
}

/* OpenSSL's reason for the last failure, for a message; clears its error queue. */
static const char *ssl_reason(void)
{
    unsigned long e = ERR_peek_last_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    ERR_clear_error();
    return r ? r : "no PEM block found";
}

/* Never asks for a passphrase (OpenSSL would prompt on the terminal): an encrypted key fails. */
static int no_passphrase(char *buf, int size, int rwflag, void *u)
{
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

/* Every certificate in `pem` (a bundle), in order. Returns the stack (possibly empty: caller
 * checks) or NULL when out of memory. */
static STACK_OF(X509) *pem_certs(const char *pem)
{
    STACK_OF(X509) *sk = sk_X509_new_null();
    BIO *b = BIO_new_mem_buf(pem, -1);
    if (!sk || !b) {
        sk_X509_free(sk);
        BIO_free(b);
        return NULL;
    }
    X509 *x;
    while ((x = PEM_read_bio_X509(b, NULL, NULL, NULL)) != NULL)
        if (!sk_X509_push(sk, x))
            X509_free(x);
    ERR_clear_error(); /* the end of the bundle reads as an error */
    BIO_free(b);
    return sk;
}

/* Checks the files as OpenSSL will see them: the certificate file holds a certificate (then
 * its chain), the key is a private key without passphrase and matches that certificate, the CA
 * file holds at least one certificate, and, with `verify_own`, the certificate chains to that CA
 * (valid now). Returns 0, or -1 with `st` naming the flag and the file. */
static int check_pems(const kc_tls_config *cfg, const tls_pems *p, int verify_own, kc_status *st)
{
    int rc = -1;
    STACK_OF(X509) *chain = NULL, *cas = NULL;
    EVP_PKEY *key = NULL;
    X509_STORE *store = NULL;
    X509_STORE_CTX *ctx = NULL;
    if (p->ca) {
        cas = pem_certs(p->ca);
        if (!cas || sk_X509_num(cas) == 0) {
            kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                          "--tls-ca %s: no PEM certificate in it (%s)", cfg->ca_file,
                          ssl_reason());
            goto out;
        }
    }
    if (p->cert) {
        chain = pem_certs(p->cert);
        if (!chain || sk_X509_num(chain) == 0) {
            kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                          "--tls-cert %s: no PEM certificate in it (%s)", cfg->cert_file,
                          ssl_reason());
            goto out;
        }
        BIO *b = BIO_new_mem_buf(p->key, -1);
        key = b ? PEM_read_bio_PrivateKey(b, NULL, no_passphrase, NULL) : NULL;
        BIO_free(b);
        if (!key) {
            kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                          "--tls-key %s: no unencrypted PEM private key in it (%s)",
                          cfg->key_file, ssl_reason());
            goto out;
        }
        X509 *leaf = sk_X509_value(chain, 0);
        if (X509_check_private_key(leaf, key) != 1) {
            ERR_clear_error();
            kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                          "--tls-key %s does not belong to the certificate in --tls-cert %s "
                          "(a key and certificate from different pairs)",
                          cfg->key_file, cfg->cert_file);
            goto out;
        }
        if (cas && verify_own) {
            store = X509_STORE_new();
            ctx = X509_STORE_CTX_new();
            if (!store || !ctx) {
                kc_status_set(st, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
                goto out;
            }
            for (int i = 0; i < sk_X509_num(cas); i++)
                X509_STORE_add_cert(store, sk_X509_value(cas, i));
            ERR_clear_error(); /* a certificate listed twice is not an error here */
            if (X509_STORE_CTX_init(ctx, store, leaf, chain) != 1 || X509_verify_cert(ctx) != 1) {
                int e = X509_STORE_CTX_get_error(ctx);
                ERR_clear_error();
                kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                              "--tls-cert %s does not verify against --tls-ca %s: %s (peers "
                              "trusting that CA would refuse it)",
                              cfg->cert_file, cfg->ca_file, X509_verify_cert_error_string(e));
                goto out;
            }
        }
    }
    rc = 0;
out:
    X509_STORE_CTX_free(ctx);
    X509_STORE_free(store);
    EVP_PKEY_free(key);
    sk_X509_pop_free(chain, X509_free);
    sk_X509_pop_free(cas, X509_free);
    return rc;
}

/* Reads and checks the files of `cfg`: a certificate needs its key (and a key its
 * certificate). A server (router, node) requires them, and its certificate must chain to the CA
 * its peers trust, which in a cluster is its own --tls-ca; a client's certificate may come from
 * another CA than the server's it trusts. Returns 0 with *p, or -1 with `st`. */
static int load_pems(const kc_tls_config *cfg, int server, tls_pems *p, kc_status *st)
{
    memset(p, 0, sizeof *p);
    if (given(cfg->cert_file) != given(cfg->key_file) || (server && !given(cfg->cert_file))) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                      "%s: TLS needs both --tls-cert and --tls-key (a certificate and its key)",
                      given(cfg->cert_file) ? "--tls-key missing" : "--tls-cert missing");
        return -1;
    }
    if ((given(cfg->ca_file) && !(p->ca = read_pem("--tls-ca", cfg->ca_file, st))) ||
        (given(cfg->cert_file) && !(p->cert = read_pem("--tls-cert", cfg->cert_file, st))) ||
        (given(cfg->key_file) && !(p->key = read_pem("--tls-key", cfg->key_file, st))) ||
        check_pems(cfg, p, server, st) != 0) {
        pems_free(p);
        return -1;
    }
    return 0;
}

int kc_tls_enabled(const kc_tls_config *cfg)
{
    return cfg && (given(cfg->cert_file) || given(cfg->ca_file));
}

grpc_server_credentials *kc_tls_server_credentials(const kc_tls_config *cfg, kc_status *st)
{
    static const grpc_ssl_client_certificate_request_type request[] = {
        [KC_TLS_CLIENT_AUTH_NONE] = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        [KC_TLS_CLIENT_AUTH_REQUEST] = GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY,
        [KC_TLS_CLIENT_AUTH_REQUIRE] = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY,
    };
    if (cfg->client_auth != KC_TLS_CLIENT_AUTH_NONE && !given(cfg->ca_file)) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                      "verifying client certificates needs --tls-ca (the CA they must chain to)");
        return NULL;
    }
    tls_pems p;
    if (load_pems(cfg, 1, &p, st) != 0)
        return NULL;
    grpc_ssl_pem_key_cert_pair pair = {.private_key = p.key, .cert_chain = p.cert};
    /* gRPC copies the PEM text */
    grpc_server_credentials *creds = grpc_ssl_server_credentials_create_ex(
        cfg->client_auth == KC_TLS_CLIENT_AUTH_NONE ? NULL : p.ca, &pair, 1,
        request[cfg->client_auth], NULL);
    pems_free(&p);
    if (!creds)
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "gRPC refused the TLS files (--tls-*)");
    return creds;
}

grpc_channel_credentials *kc_tls_channel_credentials(const kc_tls_config *cfg, kc_status *st)
{
    if (!given(cfg->ca_file)) {
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT,
                      "a TLS client needs --tls-ca (the CA the server's certificate chains to)");
        return NULL;
    }
    tls_pems p;
    if (load_pems(cfg, 0, &p, st) != 0)
        return NULL;
    grpc_ssl_pem_key_cert_pair pair = {.private_key = p.key, .cert_chain = p.cert};
    grpc_channel_credentials *creds = grpc_ssl_credentials_create(p.ca, p.cert ? &pair : NULL,
                                                                  NULL, NULL);
    pems_free(&p);
    if (!creds)
        kc_status_set(st, GRPC_STATUS_INVALID_ARGUMENT, "gRPC refused the TLS files (--tls-*)");
    return creds;
}

int kc_tls_read_pair(const kc_tls_config *cfg, char **cert, char **key, kc_status *st)
{
    tls_pems p;
    if (load_pems(cfg, 1, &p, st) != 0)
        return -1;
    *cert = p.cert;
    *key = p.key;
    free(p.ca);
    return 0;
}

/* ------------------------------------------------------------------ process flags */

int kc_tls_flag(kc_tls_config *c, const char *flag, const char *v)
{
    if (!strcmp(flag, "--tls-cert"))
        c->cert_file = v;
    else if (!strcmp(flag, "--tls-key"))
        c->key_file = v;
    else if (!strcmp(flag, "--tls-ca"))
        c->ca_file = v;
    else if (!strcmp(flag, "--tls-client-auth"))
        c->client_auth_arg = v;
    else
        return 0;
    return 1;
}

int kc_tls_flags_finish(kc_tls_config *c, kc_tls_role role, char *err)
{
    kc_status st = {0};
    const char *a = c->client_auth_arg;
    if (a && role != KC_TLS_ROLE_ROUTER) {
        snprintf(err, 256, "--tls-client-auth is for the router's public port; %s",
                 role == KC_TLS_ROLE_NODE ? "nodes always require a certificate from --tls-ca"
                                          : "a client presents --tls-cert/--tls-key or nothing");
        return -1;
    }
    if (!a || !strcmp(a, "none"))
        c->client_auth = KC_TLS_CLIENT_AUTH_NONE;
    else if (!strcmp(a, "request"))
        c->client_auth = KC_TLS_CLIENT_AUTH_REQUEST;
    else if (!strcmp(a, "require"))
        c->client_auth = KC_TLS_CLIENT_AUTH_REQUIRE;
    else {
        snprintf(err, 256, "--tls-client-auth '%s': want none, request or require", a);
        return -1;
    }
    if (role == KC_TLS_ROLE_NODE)
        c->client_auth = KC_TLS_CLIENT_AUTH_REQUIRE; /* internal hops are mutual TLS */
    if (!kc_tls_enabled(c)) {
        if (given(c->key_file) || a) {
            snprintf(err, 256, "%s without --tls-cert/--tls-ca: TLS is off, so it would be "
                     "ignored", given(c->key_file) ? "--tls-key" : "--tls-client-auth");
            return -1;
        }
        return 0;
    }
    if (role != KC_TLS_ROLE_CLIENT && (!given(c->cert_file) || !given(c->ca_file))) {
        snprintf(err, 256, "TLS on %s needs --tls-cert, --tls-key and --tls-ca (missing %s): "
                 "its hops to %s are mutual TLS from the cluster CA",
                 role == KC_TLS_ROLE_NODE ? "a node" : "the router",
                 !given(c->cert_file) ? "--tls-cert" : "--tls-ca",
                 role == KC_TLS_ROLE_NODE ? "the router" : "the nodes");
        return -1;
    }
    /* build the credentials once, as the program will: every file problem shows up now */
    grpc_init();
    grpc_channel_credentials *cc = NULL;
    grpc_server_credentials *sc = NULL;
    if (role == KC_TLS_ROLE_CLIENT)
        cc = kc_tls_channel_credentials(c, &st);
    else
        sc = kc_tls_server_credentials(c, &st);
    int rc = cc || sc ? 0 : -1;
    if (rc != 0)
        snprintf(err, 256, "%s", st.details);
    if (cc)
        grpc_channel_credentials_release(cc);
    if (sc)
        grpc_server_credentials_release(sc);
    grpc_shutdown();
    return rc;
}
