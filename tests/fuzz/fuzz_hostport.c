/*
 * fuzz_hostport.c - kc_hostport_parse (common/flags.h) on arbitrary bytes: the first byte picks
 * the options (KC_HOSTPORT_*), the rest up to a NUL is the text. A refusal must name the flag
 * and the value; an acceptance must give a host without brackets, spaces or '/', of fewer than
 * KC_HOST_MAX bytes, a port the options allow, and text that kc_hostport_format writes back in
 * a form that parses to the same host and port.
 * Run: ctest -R fuzz_hostport (replay of tests/fuzz/corpus/hostport/ + mutations), or with
 * -DKR_FUZZ=ON: ./fuzz_hostport tests/fuzz/corpus/hostport.
 */
#include "flags.h"

#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0) return 0;
    unsigned opts = data[0] & 7u;
    char s[600];
    size_t n = size - 1 < sizeof s - 1 ? size - 1 : sizeof s - 1;
    memcpy(s, data + 1, n);
    s[n] = 0;
    kc_hostport hp;
    char err[512];
    if (kc_hostport_parse("--addr", s, opts, &hp, err, sizeof err) != 0) {
        if (strncmp(err, "--addr: '", 9) != 0) __builtin_trap();
        return 0;
    }
    size_t hl = strlen(hp.host);
    if (hp.text != s || hl >= KC_HOST_MAX || strpbrk(hp.host, " /[]\t\n")) __builtin_trap();
    if (hp.port < 0 || hp.port > 65535 || (hp.port == 0 && !(opts & KC_HOSTPORT_PORT_ZERO))) __builtin_trap();
    if (hl == 0 && !(opts & KC_HOSTPORT_EMPTY_HOST)) __builtin_trap();
    if (strchr(hp.host, ':') && (opts & KC_HOSTPORT_NO_IPV6)) __builtin_trap();
    char back[KC_HOST_MAX + 16];
    kc_hostport_format(hp.host, hp.port, back, sizeof back);
    kc_hostport again;
    if (kc_hostport_parse("--addr", back, opts, &again, err, sizeof err) != 0) __builtin_trap();
    if (strcmp(again.host, hp.host) != 0 || again.port != hp.port) __builtin_trap();
    return 0;
}
