#!/usr/bin/env bash
# tls-certs.sh - a throwaway CA and certificates for a kvrelay cluster's TLS (docs/security.md).
# Writes DIR/ca.pem + DIR/ca.key (a new CA, unless DIR already holds one) and, for each NAME,
# DIR/NAME.pem + DIR/NAME.key: an EC P-256 key and a certificate signed by that CA, valid for
# both server and client use (the router is a client of its nodes), naming 127.0.0.1 and
# localhost plus the comma-separated subjectAltNames in $KVRELAY_TLS_SANS (e.g.
# "DNS:decode-0.kvrelay,IP:10.0.0.7"): a client checks that the server's certificate names the
# address it dials. Keys are written 0600. For tests and one-machine clusters (./kvrelay up --tls);
# a real deployment gets its certificates from its own CA (cert-manager, Vault, ...).
# Run: deploy/tls-certs.sh DIR router prefill-0 decode-0 client
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    echo "usage: $0 DIR [NAME...]"
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi
command -v openssl >/dev/null || { echo "tls-certs.sh: openssl is not installed (apt-get install openssl)" >&2; exit 1; }
dir=$1
shift
mkdir -p "$dir"
umask 077
days=${KVRELAY_TLS_DAYS:-30}
sans="IP:127.0.0.1,DNS:localhost${KVRELAY_TLS_SANS:+,$KVRELAY_TLS_SANS}"

if [[ ! -f $dir/ca.pem || ! -f $dir/ca.key ]]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$dir/ca.key" -out "$dir/ca.pem" -days "$days" \
        -subj "/CN=kvrelay throwaway CA $(date -u +%Y%m%dT%H%M%S) $$" 2>/dev/null
fi
ext=$(mktemp)
trap 'rm -f "$ext" "$dir"/*.csr' EXIT
printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" "subjectAltName=$sans" >"$ext"
for name in "$@"; do
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$dir/$name.key" -out "$dir/$name.csr" -subj "/CN=$name" 2>/dev/null
    openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
        -set_serial "0x$(openssl rand -hex 16)" -days "$days" -extfile "$ext" \
        -out "$dir/$name.pem" 2>/dev/null
done
