#!/usr/bin/env bash
# tls.sh - TLS on every gRPC hop (docs/security.md), end to end on llama3-tiny with certificates
# from deploy/tls-certs.sh: a cluster CA and another CA. Checks:
#   - start-up refuses unusable TLS files with a message naming the flag: a key of another
#     certificate, a certificate from another CA, a missing file, a router without --tls-ca, a
#     bad --tls-client-auth, --tls-client-auth on a node, kvrelay-cli with a missing CA file;
#   - etcd (when installed) serving TLS with client-certificate auth: the nodes and the router
#     register and watch through --etcd-ca/--etcd-cert/--etcd-key; etcdctl without a client
#     certificate is refused;
#   - a TLS cluster (router with --tls-client-auth require, 1 prefill + 1 decode node, mutual TLS
#     between them) answers greedy requests with exactly the ids a plaintext cluster gives;
#   - a decode node whose certificate comes from another CA is in the membership but never
#     joins: the router cannot reach it (its state is not serving) and sends it nothing;
#   - the router's HTTP port (OpenAI API, /healthz) is HTTPS with its certificate; plain HTTP fails;
#   - kvrelay-cli without a client certificate, or without TLS, is refused (UNAVAILABLE, with a
#     hint); Python's grpcio (tls_client.py) is refused without a certificate, with one from
#     another CA, with another key, trusting another CA, in plaintext, and as raw bytes, and the
#     router serves on after all of it.
# Run: ctest -R '^tls$', or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/tls.sh
set -uo pipefail

bin=${KR_BIN:?KR_BIN must be the build directory}
src=${KR_SRC:?KR_SRC must be the source directory}
model=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)/models/llama3-tiny
. "$src/tests/integration/lib.sh" # krc_*, kr_cluster_workdir, fatal, kr_need_bins, kr_skip
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli
command -v openssl >/dev/null || kr_skip "openssl is not installed"
. "$src/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
kr_cluster_workdir tls
work=$KRC_DIR
trap 'krc_stop; krc_etcd_stop; rm -rf "$work"' EXIT
KRC_START_TIMEOUT=1200 # tenths of a second: the sanitizer build loads slowly on 2 cores

tls=$work/tls other=$work/other
"$src/deploy/tls-certs.sh" "$tls" router prefill-0 decode-0 client >/dev/null || fatal "tls-certs.sh (cluster CA)"
"$src/deploy/tls-certs.sh" "$other" decode-9 client >/dev/null || fatal "tls-certs.sh (other CA)"

# ---- start-up refusals: each program exits non-zero with a message naming the problem
refuses() { # refuses WANT PROGRAM ARGS...
  local want=$1 out; shift
  out=$("$@" 2>&1 </dev/null) && fatal "$* started (wanted a refusal: $want)"
  grep -qF -- "$want" <<<"$out" || fatal "$*: message lacks '$want': $out"
  echo "refused as expected: ${out##*$'\n'}"
}
refuses "does not belong to the certificate in --tls-cert" "$bin/kvrelay-decode" --model "$model" \
  --tls-cert "$tls/decode-0.pem" --tls-key "$other/decode-9.key" --tls-ca "$tls/ca.pem"
refuses "does not verify against --tls-ca $tls/ca.pem" "$bin/kvrelay-prefill" --model "$model" \
  --tls-cert "$other/decode-9.pem" --tls-key "$other/decode-9.key" --tls-ca "$tls/ca.pem"
refuses "--tls-cert $work/nope.pem: cannot open" "$bin/kvrelay-decode" --model "$model" \
  --tls-cert "$work/nope.pem" --tls-key "$tls/decode-0.key" --tls-ca "$tls/ca.pem"
refuses "(missing --tls-ca)" "$bin/kvrelay-router" --model "$model" --nodes /dev/null \
  --tls-cert "$tls/router.pem" --tls-key "$tls/router.key"
refuses "--tls-client-auth 'maybe'" "$bin/kvrelay-router" --model "$model" --nodes /dev/null \
  --tls-cert "$tls/router.pem" --tls-key "$tls/router.key" --tls-ca "$tls/ca.pem" --tls-client-auth maybe
refuses "--tls-client-auth is for the router's public port" "$bin/kvrelay-prefill" --model "$model" \
  --tls-cert "$tls/prefill-0.pem" --tls-key "$tls/prefill-0.key" --tls-ca "$tls/ca.pem" --tls-client-auth require
refuses "--tls-ca $work/nope.pem: cannot open" "$bin/kvrelay-cli" --router 127.0.0.1:1 --tls-ca "$work/nope.pem" status

# ---- a plaintext cluster's greedy answers: the reference
prompts=("1 2 3 4 5 6 7 8" "400 17 33 250 9 9 120 61 77 300 12 5 88 140 201 3 44")
policies=(full "streaming:sink=4,window=16")
answer() { # answer OUT CLI-ARGS...: the greedy ids of every prompt x policy, one line each
  local out=$1 p q line; shift
  : >"$out"
  for p in "${prompts[@]}"; do
    for q in "${policies[@]}"; do
      line=$("$bin/kvrelay-cli" --router "$KRC_ROUTER" "$@" generate --ids "$p" --max-tokens 8 \
        --policy "$q" --timeout-ms 120000 --json) || fatal "generate '$p' ($q) $*"
      "$PY" -c 'import json,sys; r=json.loads(sys.argv[1]); print(" ".join(map(str, r["ids"])), r["usage"]["served_by"]["decode_node"])' "$line" >>"$out"
    done
  done
}
KRC_DIR=$work/plain
krc_start "$bin" "$model" 1 1 127.0.0.1:0 --threads 1 || fatal "the plaintext cluster did not start"
answer "$work/plain.ids"
krc_stop

# ---- the TLS cluster, with etcd over TLS when installed, and a node from another CA
KRC_DIR=$work/cluster
KRC_TLS_DIR=$tls
KRC_TLS_CLIENT_AUTH=require
mkdir -p "$KRC_DIR"
rogue_etcd=()
if krc_etcd_start; then
  echo "etcd with TLS and client-certificate auth at $KRC_ETCD"
  etcdctl --endpoints "https://$KRC_ETCD" --cacert "$tls/ca.pem" --dial-timeout 3s endpoint health >/dev/null 2>&1 &&
    fatal "etcdctl without a client certificate was let in"
  # the node from another CA may reach etcd: only the router's own check keeps it out
  rogue_etcd=(--etcd "$KRC_ETCD" --cluster local --etcd-ca "$tls/ca.pem" --etcd-cert "$tls/client.pem"
    --etcd-key "$tls/client.key")
else
  echo "etcd is not installed or did not start: static membership"
fi
krc_spawn decode-9 "$bin/kvrelay-decode" --model "$model" --id decode-9 --listen 127.0.0.1:0 \
  --transfer 127.0.0.1:0 --http 127.0.0.1:0 --threads 1 --tls-cert "$other/decode-9.pem" \
  --tls-key "$other/decode-9.key" --tls-ca "$other/ca.pem" "${rogue_etcd[@]}"
krc_start "$bin" "$model" 1 1 127.0.0.1:0 --threads 1 || fatal "the TLS cluster did not start"
echo "TLS cluster up: router $KRC_ROUTER (logs in $KRC_DIR)"
grep -q "TLS: gRPC port with .*client certificates: require" "$KRC_DIR/router.log" || fatal "the router does not say it serves TLS"
mine=(--tls-ca "$tls/ca.pem" --tls-cert "$tls/client.pem" --tls-key "$tls/client.key")

# the router knows decode-9 (membership) but cannot reach it over mutual TLS
status=""
for ((i = 0; i < 100; i++)); do
  status=$("$bin/kvrelay-cli" --router "$KRC_ROUTER" "${mine[@]}" status --json) || fatal "status over TLS"
  grep -q '"decode-9"' <<<"$status" && break
  sleep 0.1
done
rogue_state=$("$PY" -c 'import json,sys; print([n["state"] for n in json.loads(sys.argv[1])["nodes"] if n["id"] == "decode-9"])' "$status")
echo "decode-9 (another CA) in the router's view: $rogue_state"
[ "$rogue_state" != "[]" ] || fatal "decode-9 is not in the membership: the test proves nothing"
grep -qE "unreachable|suspect" <<<"$rogue_state" || fatal "decode-9, certified by another CA, is $rogue_state"

answer "$work/tls.ids" "${mine[@]}"
diff "$work/plain.ids" "$work/tls.ids" >/dev/null || fatal "TLS answers differ from plaintext ones: $(diff "$work/plain.ids" "$work/tls.ids")"
grep -q decode-9 "$work/tls.ids" && fatal "a request was decoded on decode-9 (another CA)"
echo "greedy answers over TLS equal the plaintext cluster's ($(wc -l <"$work/tls.ids") requests, all on decode-0)"

# kvrelay-cli without the client certificate, and without TLS: refused with a hint
out=$("$bin/kvrelay-cli" --router "$KRC_ROUTER" --tls-ca "$tls/ca.pem" status 2>&1) && fatal "status without a client certificate was served"
grep -q "UNAVAILABLE" <<<"$out" && grep -q "client certificate" <<<"$out" || fatal "no client certificate: $out"
out=$("$bin/kvrelay-cli" --router "$KRC_ROUTER" status 2>&1) && fatal "plaintext status to a TLS router was served"
grep -q "UNAVAILABLE" <<<"$out" && grep -q "give --tls-ca" <<<"$out" || fatal "plaintext client: $out"

# the HTTP port: HTTPS with the router's certificate (the OpenAI API and /healthz); plain HTTP fails
out=$("$PY" - "$KRC_ROUTER_HTTP" "$tls/ca.pem" <<'EOF'
import json, ssl, sys, urllib.request
addr, ca = sys.argv[1:3]
ctx = ssl.create_default_context(cafile=ca)
models = json.load(urllib.request.urlopen("https://%s/v1/models" % addr, context=ctx, timeout=10))
print("https models:", [m["id"] for m in models["data"]])
print("https healthz:", urllib.request.urlopen("https://%s/healthz" % addr, context=ctx, timeout=10).status)
try:
    urllib.request.urlopen("http://%s/healthz" % addr, timeout=10)
    print("plain http: served")
except Exception as e:
    print("plain http: refused (%s)" % type(e).__name__)
EOF
) || fatal "HTTPS on the router's HTTP port: $out"
echo "$out"
grep -q "https healthz: 200" <<<"$out" && grep -q "plain http: refused" <<<"$out" || fatal "HTTP port: $out"

# grpcio: refusals of every kind, then served again
kr_pystubs "$work/stubs"
out=$("$PY" "$src/tests/integration/tls_client.py" "$work/stubs" "$KRC_ROUTER" "$tls" "$other" "${prompts[0]}" 2>&1) ||
  fatal "tls_client.py: $out"
echo "$out"
want=$(head -n1 "$work/plain.ids" | cut -d' ' -f1-8)
grep -qx "ids: $want" <<<"$out" || fatal "grpcio over TLS got other ids than the plaintext cluster ($want)"
echo "PASS"
