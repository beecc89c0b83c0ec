# local-cluster.sh - start and stop a kvrelay cluster on this machine: M decode nodes, N prefill
# nodes and one router, separate processes on loopback (DESIGN.md section 2), with a static
# membership file. Sourced by `./kvrelay up|demo` and by tests/integration/cluster*.sh; not run
# on its own. Every process logs to $KRC_DIR/<id>.log and prints its serving line to
# $KRC_DIR/<id>.out; ports are ephemeral (127.0.0.1:0) except the router's public one.
#
#   krc_start BIN MODEL N_PREFILL N_DECODE ROUTER_LISTEN [extra args for every node...]
#       sets KRC_DIR (unless set), KRC_ROUTER (host:port), KRC_ROUTER_HTTP, KRC_PIDS
#       extra args per role: KRC_PREFILL_ARGS, KRC_DECODE_ARGS, KRC_ROUTER_ARGS (arrays)
#   krc_stop            SIGTERM every process it started (SIGKILL after 10 s), newest first
#   krc_addr ID         the gRPC address a started process printed
#   krc_http ID         its HTTP address
#   krc_pid ID          the pid of the (latest) process started as ID
#   krc_signal ID SIG   sends SIG (KILL, STOP, CONT, ...) to it
#   krc_restart ID ARGS...  starts ID again with the same program and arguments plus ARGS (e.g.
#                       --listen and --transfer of its old ports: the last flag wins), waits for
#                       it to serve; its earlier log is kept as ID.log.N
#
# TLS (docs/security.md): when KRC_TLS_DIR is set, krc_start makes (with deploy/tls-certs.sh,
# unless they exist) a CA in $KRC_TLS_DIR/ca.pem and one certificate per process, ID.pem +
# ID.key, plus client.pem + client.key for clients, and gives every process --tls-cert, --tls-key
# and --tls-ca: mutual TLS on every gRPC hop. KRC_TLS_CLIENT_AUTH (none, request, require) is
# passed to the router as --tls-client-auth.
#   krc_tls_args ID     prints the TLS flags of process ID (nothing when KRC_TLS_DIR is unset)
#
# Membership in etcd (docs/cluster.md): when KRC_ETCD is set (host:port, e.g. by
# krc_etcd_start), krc_start gives every node --etcd KRC_ETCD --cluster KRC_CLUSTER (default
# "local") and the router --etcd instead of --nodes when its --help offers --etcd.
#   krc_etcd_start [CLIENT_PORT PEER_PORT]
#       starts /usr/bin/etcd with its data in $KRC_DIR/etcd (kept across restarts) on the given
#       loopback ports (default: free ones); sets KRC_ETCD, KRC_ETCD_PID, KRC_ETCD_CLIENT_PORT,
#       KRC_ETCD_PEER_PORT. Returns 1 when etcd is not installed or did not come up. With
#       KRC_TLS_DIR set, etcd serves clients over TLS and requires a client certificate from its
#       CA (--client-cert-auth; certificate etcd.pem); krc_start then gives every process
#       --etcd-ca, and its own certificate as --etcd-cert/--etcd-key.
#   krc_etcd_stop       SIGTERM it (SIGKILL after 10 s); the data dir stays

KRC_PIDS=()
KRC_IDS=()

# Waits for the serving line of process $1 (id) with pid $2; prints "grpc http".
krc_wait_serving() {
  local id=$1 pid=$2 out="$KRC_DIR/$1.out" i line
  for ((i = 0; i < ${KRC_START_TIMEOUT:-600}; i++)); do
    line=$(grep -m1 'serving grpc ' "$out" 2>/dev/null || true)
    if [ -n "$line" ]; then
      echo "$line" | sed -E 's/.*serving grpc ([^ ]+) http ([^ ]+).*/\1 \2/'
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      # the log's own lines: a sanitizer build's leak report at exit would bury the reason
      echo "kvrelay: $id exited before serving; the end of its log ($KRC_DIR/$id.log, without sanitizer reports):" >&2
      grep -v -E '^ +#[0-9]|^(Direct|Indirect) leak|^SUMMARY: |^=+$|^$' "$KRC_DIR/$id.log" | tail -n 20 >&2
      return 1
    fi
    sleep 0.1
  done
  echo "kvrelay: $id did not serve within $((${KRC_START_TIMEOUT:-600} / 10)) s (log: $KRC_DIR/$id.log)" >&2
  return 1
}

# krc_spawn ID PROGRAM ARGS... : starts one process in the background, records it (and its
# command line, for krc_restart).
declare -A KRC_CMDS=()
krc_spawn() {
  local id=$1; shift
  # emptied here, not by the redirection below: that runs in the child, possibly after the
  # caller's krc_wait_serving has read a previous run's serving line from the old file
  : >"$KRC_DIR/$id.out"
  "$@" >"$KRC_DIR/$id.out" 2>"$KRC_DIR/$id.log" &
  KRC_PIDS+=($!)
  KRC_IDS+=("$id")
  KRC_CMDS[$id]=$(printf '%q ' "$@")
}

krc_pid() {
  local i
  for ((i = ${#KRC_IDS[@]} - 1; i >= 0; i--)); do
    [ "${KRC_IDS[$i]}" = "$1" ] && { echo "${KRC_PIDS[$i]}"; return 0; }
  done
  return 1
}

krc_signal() { kill -"$2" "$(krc_pid "$1")"; }

krc_restart() {
  local id=$1 n=1; shift
  while [ -e "$KRC_DIR/$id.log.$n" ]; do n=$((n + 1)); done
  mv "$KRC_DIR/$id.log" "$KRC_DIR/$id.log.$n"
  eval "krc_spawn $id ${KRC_CMDS[$id]} $(printf '%q ' "$@")"
  krc_wait_serving "$id" "${KRC_PIDS[-1]}" >/dev/null
}

krc_addr() { sed -nE 's/.*serving grpc ([^ ]+) http.*/\1/p' "$KRC_DIR/$1.out" | head -n1; }
krc_http() { sed -nE 's/.*serving grpc [^ ]+ http ([^ ]+).*/\1/p' "$KRC_DIR/$1.out" | head -n1; }

krc_tls_args() {
  [ -n "${KRC_TLS_DIR:-}" ] || return 0
  printf '%s\n' --tls-cert "$KRC_TLS_DIR/$1.pem" --tls-key "$KRC_TLS_DIR/$1.key" --tls-ca "$KRC_TLS_DIR/ca.pem"
  [ -z "${KRC_ETCD:-}" ] ||
    printf '%s\n' --etcd-ca "$KRC_TLS_DIR/ca.pem" --etcd-cert "$KRC_TLS_DIR/$1.pem" --etcd-key "$KRC_TLS_DIR/$1.key"
}

# The certificates krc_start's processes need (those not there yet) for NP prefill and ND decode
# nodes.
krc_tls_certs() {
  local np=$1 nd=$2 i names=() n
  for n in router client $(for ((i = 0; i < np; i++)); do echo "prefill-$i"; done) \
    $(for ((i = 0; i < nd; i++)); do echo "decode-$i"; done); do
    [ -f "$KRC_TLS_DIR/$n.pem" ] || names+=("$n")
  done
  [ ${#names[@]} -eq 0 ] || "$(dirname "${BASH_SOURCE[0]}")/tls-certs.sh" "$KRC_TLS_DIR" "${names[@]}"
}

krc_start() {
  local bin=$1 model=$2 np=$3 nd=$4 listen=$5; shift 5
  KRC_DIR=${KRC_DIR:-$(mktemp -d -t kvrelay-cluster.XXXXXX)}
  mkdir -p "$KRC_DIR"
  local i id nodes="$KRC_DIR/nodes.json" dec=() pre=() reg=() tls=()
  [ -z "${KRC_ETCD:-}" ] || reg=(--etcd "$KRC_ETCD" --cluster "${KRC_CLUSTER:-local}")
  if [ -n "${KRC_TLS_DIR:-}" ]; then
    krc_tls_certs "$np" "$nd" || { echo "kvrelay: could not make the TLS certificates in $KRC_TLS_DIR" >&2; return 1; }
  fi
  # decode nodes first: prefill nodes and the router need nothing from them at start, but the
  # router's membership file lists their addresses
  for ((i = 0; i < nd; i++)); do
    id=decode-$i
    mapfile -t tls < <(krc_tls_args "$id")
    krc_spawn "$id" "$bin/kvrelay-decode" --model "$model" --id "$id" --listen 127.0.0.1:0 \
      --transfer 127.0.0.1:0 --http 127.0.0.1:0 "${reg[@]}" "${tls[@]}" "${KRC_DECODE_ARGS[@]}" "$@"
  done
  for ((i = 0; i < np; i++)); do
    id=prefill-$i
    mapfile -t tls < <(krc_tls_args "$id")
    krc_spawn "$id" "$bin/kvrelay-prefill" --model "$model" --id "$id" --listen 127.0.0.1:0 \
      --http 127.0.0.1:0 "${reg[@]}" "${tls[@]}" "${KRC_PREFILL_ARGS[@]}" "$@"
  done
  for ((i = 0; i < ${#KRC_IDS[@]}; i++)); do
    krc_wait_serving "${KRC_IDS[$i]}" "${KRC_PIDS[$i]}" >/dev/null || return 1
    case ${KRC_IDS[$i]} in
      decode-*) dec+=("{\"id\": \"${KRC_IDS[$i]}\", \"address\": \"$(krc_addr "${KRC_IDS[$i]}")\"}") ;;
      prefill-*) pre+=("{\"id\": \"${KRC_IDS[$i]}\", \"address\": \"$(krc_addr "${KRC_IDS[$i]}")\"}") ;;
    esac
  done
  local IFS=,
  echo "{\"prefill\": [${pre[*]}], \"decode\": [${dec[*]}]}" >"$nodes"
  unset IFS
  local members=(--nodes "$nodes")
  # grep -c reads all of --help: grep -q would exit at the first match, and with pipefail the
  # router's SIGPIPE on the rest of a help text over 4 KiB would read as "no --etcd"
  if [ -n "${KRC_ETCD:-}" ] && "$bin/kvrelay-router" --help 2>/dev/null | grep -c -- '--etcd' >/dev/null; then
    members=(--etcd "$KRC_ETCD" --cluster "${KRC_CLUSTER:-local}")
  fi
  mapfile -t tls < <(krc_tls_args router)
  [ -z "${KRC_TLS_DIR:-}" ] || [ -z "${KRC_TLS_CLIENT_AUTH:-}" ] || tls+=(--tls-client-auth "$KRC_TLS_CLIENT_AUTH")
  krc_spawn router "$bin/kvrelay-router" --model "$model" --id router "${members[@]}" \
    --listen "$listen" --http 127.0.0.1:0 "${tls[@]}" "${KRC_ROUTER_ARGS[@]}"
  krc_wait_serving router "${KRC_PIDS[-1]}" >/dev/null || return 1
  KRC_ROUTER=$(krc_addr router)
  KRC_ROUTER_HTTP=$(krc_http router)
}

krc_stop() {
  local i pid
  for ((i = ${#KRC_PIDS[@]} - 1; i >= 0; i--)); do
    kill -TERM "${KRC_PIDS[$i]}" 2>/dev/null || true
  done
  for pid in "${KRC_PIDS[@]}"; do
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  KRC_PIDS=()
  KRC_IDS=()
}

# ------------------------------------------------------------------ etcd

# Two free loopback TCP ports (the kernel's choice; released just before etcd binds them).
krc_free_ports() {
  /usr/bin/python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))'
}

krc_etcd_start() {
  [ -x /usr/bin/etcd ] || command -v etcd >/dev/null 2>&1 || return 1
  KRC_DIR=${KRC_DIR:-$(mktemp -d -t kvrelay-cluster.XXXXXX)}
  local c=${1:-} p=${2:-} i
  if [ -z "$c" ] || [ -z "$p" ]; then
    read -r c p < <(krc_free_ports) || return 1
  fi
  local peer=http://127.0.0.1:$p client=http://127.0.0.1:$c tls=() ctl=()
  if [ -n "${KRC_TLS_DIR:-}" ]; then
    [ -f "$KRC_TLS_DIR/etcd.pem" ] || "$(dirname "${BASH_SOURCE[0]}")/tls-certs.sh" "$KRC_TLS_DIR" etcd client || return 1
    client=https://127.0.0.1:$c
    tls=(--cert-file "$KRC_TLS_DIR/etcd.pem" --key-file "$KRC_TLS_DIR/etcd.key"
      --trusted-ca-file "$KRC_TLS_DIR/ca.pem" --client-cert-auth)
    ctl=(--cacert "$KRC_TLS_DIR/ca.pem" --cert "$KRC_TLS_DIR/client.pem" --key "$KRC_TLS_DIR/client.key")
  fi
  etcd --name kvrelay --data-dir "$KRC_DIR/etcd" --listen-client-urls "$client" \
    --advertise-client-urls "$client" --listen-peer-urls "$peer" \
    --initial-advertise-peer-urls "$peer" --initial-cluster "kvrelay=$peer" "${tls[@]}" \
    >>"$KRC_DIR/etcd.log" 2>&1 &
  KRC_ETCD_PID=$!
  for ((i = 0; i < 100; i++)); do
    if etcdctl --endpoints "$client" --dial-timeout 1s "${ctl[@]}" endpoint health >/dev/null 2>&1; then
      KRC_ETCD=127.0.0.1:$c KRC_ETCD_CLIENT_PORT=$c KRC_ETCD_PEER_PORT=$p
      return 0
    fi
    kill -0 "$KRC_ETCD_PID" 2>/dev/null || break
    sleep 0.1
  done
  echo "kvrelay: etcd did not come up on $client; the end of $KRC_DIR/etcd.log:" >&2
  tail -n 10 "$KRC_DIR/etcd.log" >&2
  krc_etcd_stop
  return 1
}

krc_etcd_stop() {
  local i
  [ -n "${KRC_ETCD_PID:-}" ] || return 0
  kill -TERM "$KRC_ETCD_PID" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do kill -0 "$KRC_ETCD_PID" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$KRC_ETCD_PID" 2>/dev/null || true
  wait "$KRC_ETCD_PID" 2>/dev/null || true
  KRC_ETCD_PID=
}

# krc_model_copy SRC DST CMD... : a variant of the model directory SRC in DST for tests: every
# file symlinked, except config.json, written through the filter CMD (stdin -> stdout), and
# generation_config.json, left out (its defaults would repeat what CMD changed).
krc_model_copy() {
  local src=$1 dst=$2 f; shift 2
  mkdir -p "$dst"
  for f in "$src"/*; do
    case ${f##*/} in config.json | generation_config.json) ;; *) ln -s "$f" "$dst/" ;; esac
  done
  "$@" <"$src/config.json" >"$dst/config.json"
}
