#!/usr/bin/env bash
# soak.sh - the cluster under load and faults for a chosen time, then four checks: every request
# either completed with the output of a fault-free run of the same request or ended with a clear
# error; no decode node holds a used or reserved KV block; no sanitizer reported anything; no
# process ended unless the chaos loop killed it.
# Not part of the default test run at its full length (tests/integration/soak.sh runs it for
# about a minute); docs/failures.md ("Soak") has the figures of a 30-minute run.
#
#   tests/soak/soak.sh [--duration S] [--bin DIR] [--seed N] [--model DIR] [--concurrency C]
#                      [--drop P] [--no-etcd] [--keep]
#
# The cluster (deploy/local-cluster.sh): 2 prefill + 2 decode nodes and two routers on the same
# nodes, one plain and one with --migrate, membership in a local etcd when etcd is installed (else
# the static file); the programs of --bin, meant to be the ASan+UBSan build of `./kvrelay test`.
# The client (soak_client.py): a seeded pool of greedy requests (token-id prompts, a mix of KV
# policies, prefill in chunks of 32 so that policies evict), sent once fault-free for the
# references, then by C closed-loop clients over both routers for S seconds; a fraction P is
# dropped by its client mid-stream. Meanwhile the chaos loop, one fault at a time with a seeded
# pause before each: kill -9 a prefill or decode node and restart it on its ports after a short
# downtime, SIGSTOP one for 1-8 s then SIGCONT, restart etcd. Exit 0 when every check holds,
# 1 on a violation, 2 on bad flags, 77 when the Python gRPC client cannot be set up.
set -uo pipefail
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }
bad() { echo "soak.sh: $*" >&2; exit 2; }
duration=1800 bin=$src/build-test seed=1 model=$src/models/kjv-2l128-2k concurrency=6 drop=0.08
use_etcd=1 keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --duration) duration=${2:-}; [[ $duration =~ ^[1-9][0-9]*$ ]] || bad "--duration takes seconds >= 1"; shift 2 ;;
    --bin) bin=${2:-}; [ -d "$bin" ] || bad "--bin '$bin' is not a directory"; shift 2 ;;
    --seed) seed=${2:-}; [[ $seed =~ ^[0-9]+$ ]] || bad "--seed takes an integer >= 0"; shift 2 ;;
    --model) model=${2:-}; [ -f "$model/config.json" ] || bad "--model '$model' has no config.json"; shift 2 ;;
    --concurrency) concurrency=${2:-}; [[ $concurrency =~ ^[1-9][0-9]*$ ]] || bad "--concurrency takes a count >= 1"; shift 2 ;;
    --drop) drop=${2:-}; [[ $drop =~ ^(0(\.[0-9]+)?|1(\.0*)?)$ ]] || bad "--drop takes a fraction in [0, 1]"; shift 2 ;;
    --no-etcd) use_etcd=0; shift ;;
    --keep) keep=1; shift ;;
    *) bad "unknown option '$1' (try --help)" ;;
  esac
done
bin=$(cd "$bin" && pwd)
export KR_SRC=$src KR_BIN=$bin
. "$src/tests/integration/lib.sh"  # krc_* helpers, kr_need_bins, kr_blocks_zero
kr_f32_input_kernels # migrated streams are checked against one-process greedy ids
. "$src/tests/integration/lib/pystubs.sh"  # PY, kr_pystubs; skips without python3-grpcio
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli
client=$src/tests/soak/soak_client.py
nodes=(prefill-0 prefill-1 decode-0 decode-1)

KRC_DIR=$(mktemp -d -t kvrelay-soak.XXXXXX)
verdict=1 client_pid=
soak_cleanup() {
  [ -z "$client_pid" ] || kill "$client_pid" 2>/dev/null || true
  krc_stop
  krc_etcd_stop
  if [ $verdict = 0 ] && [ $keep = 0 ]; then rm -rf "$KRC_DIR"; else echo "soak: logs kept in $KRC_DIR"; fi
}
trap soak_cleanup EXIT
trap 'exit 130' INT TERM
die() { echo "soak: FAIL: $*" >&2; exit 1; }
faults=$KRC_DIR/faults.txt
: >"$faults"
RANDOM=$seed

# ---- the cluster
etcd_note="static membership (nodes.json)"
# (a free port krc_etcd_start picked may be taken by another process before etcd binds it)
for try in 1 2 3; do
  [ $use_etcd = 1 ] && krc_etcd_start && { etcd_note="etcd at $KRC_ETCD"; break; }
done
KRC_PREFILL_ARGS=(--chunk 32)
KRC_DECODE_ARGS=()
KRC_ROUTER_ARGS=()
krc_start "$bin" "$model" 2 2 127.0.0.1:0 --threads 1 || die "the cluster did not start (logs in $KRC_DIR)"
members=(--nodes "$KRC_DIR/nodes.json")
[ -z "${KRC_ETCD:-}" ] || members=(--etcd "$KRC_ETCD" --cluster "${KRC_CLUSTER:-local}")
krc_spawn router-m "$bin/kvrelay-router" --model "$model" --id router-m "${members[@]}" \
  --listen 127.0.0.1:0 --http 127.0.0.1:0 --migrate
krc_wait_serving router-m "$(krc_pid router-m)" >/dev/null || die "router-m did not start"
routers=("$KRC_ROUTER" "$(krc_addr router-m)")
echo "soak: cluster up (2 prefill + 2 decode nodes, routers ${routers[*]}, $etcd_note; logs in $KRC_DIR)"

# every node serving at the router before the fault-free pass, and the decode nodes' transfer
# addresses, which a restart must reuse (the router and prefill nodes know them)
status_json() { "$bin/kvrelay-cli" --router "$KRC_ROUTER" status --json 2>/dev/null; }
for ((t = 0; ; t++)); do
  n=$(status_json | "$PY" -c 'import json,sys; print(sum(n["state"] == "serving" for n in json.load(sys.stdin)["nodes"] if n["role"] != "router"))' 2>/dev/null)
  [ "${n:-0}" = 4 ] && break
  [ $t -lt 600 ] || die "the router does not see the 4 nodes serving"
  sleep 0.1
done
declare -A transfer=()
for id in decode-0 decode-1; do
  transfer[$id]=$(status_json | "$PY" -c 'import json,sys; print(next(n["transfer_address"] for n in json.load(sys.stdin)["nodes"] if n["id"] == sys.argv[1]))' "$id")
  [[ ${transfer[$id]} == *:* ]] || die "no transfer address for $id"
done

# ---- the requests and their fault-free outputs
kr_pystubs "$KRC_DIR/stubs"
"$PY" "$client" pool --model "$model" --seed "$seed" --out "$KRC_DIR/pool.json" --policy full \
  --policy streaming:sink=4,window=32 --policy snapkv:mode=patched,budget=36,obs=8 \
  --policy pyramidkv:mode=patched,budget=48,obs=8 --policy sage:budget=64 || die "no request pool"
"$PY" "$client" reference --stubs "$KRC_DIR/stubs" --router "$KRC_ROUTER" --pool "$KRC_DIR/pool.json" \
  --out "$KRC_DIR/refs.json" || die "the fault-free pass failed"

# ---- load and chaos
"$PY" "$client" load --stubs "$KRC_DIR/stubs" --router "${routers[0]}" --router "${routers[1]}" \
  --pool "$KRC_DIR/pool.json" --duration "$duration" --concurrency "$concurrency" --drop "$drop" \
  --seed "$seed" --out "$KRC_DIR/rows.jsonl" &
client_pid=$!
pause() { sleep "$(($1 / 10)).$(($1 % 10))"; } # pause TENTHS
# restart ID: the node again on its own gRPC and UCX ports, which the router and the prefill
# nodes know. Its HTTP port (metrics only) is taken again too, unless another process on this
# machine bound it meanwhile (it was ephemeral): then a fresh one.
restart() {
  local id=$1 try args=(--listen "$(krc_addr "$1")" --http "$(krc_http "$1")")
  [ -z "${transfer[$id]:-}" ] || args+=(--transfer "${transfer[$id]}")
  for try in 1 2 3 4; do
    [ $try -lt 3 ] || args+=(--http 127.0.0.1:0)
    krc_restart "$id" "${args[@]}" && return 0
    echo "soak: $id did not restart (try $try)" >&2
    sleep 1
  done
  die "$id could not be restarted on its ports"
}
# a process that ended without being killed here is a crash: counted, and the node restarted
crashes=0
check_alive() {
  local id
  for id in router router-m "${nodes[@]}"; do
    kill -0 "$(krc_pid "$id")" 2>/dev/null && continue
    echo "soak: CRASH: $id exited by itself (log: $KRC_DIR/$id.log)"
    crashes=$((crashes + 1))
    case $id in router*) die "$id is gone" ;; *) restart "$id" ;; esac
  done
}
echo "soak: load and chaos for $duration s (seed $seed)"
while kill -0 "$client_pid" 2>/dev/null; do
  pause $((10 + RANDOM % 30))
  kill -0 "$client_pid" 2>/dev/null || break
  check_alive
  id=${nodes[RANDOM % 4]} role=${id%-*}
  roll=$((RANDOM % 100))
  if [ $roll -lt 60 ]; then
    echo "kill-$role $id" >>"$faults"
    pid=$(krc_pid "$id")
    kill -KILL "$pid"
    wait "$pid" 2>/dev/null
    pause $((5 + RANDOM % 25))
    restart "$id"
  elif [ $roll -lt 85 ]; then
    echo "stop-$role $id" >>"$faults"
    krc_signal "$id" STOP
    pause $((10 + RANDOM % 70))
    krc_signal "$id" CONT
  elif [ -n "${KRC_ETCD:-}" ]; then
    echo "restart-etcd" >>"$faults"
    krc_etcd_stop
    pause $((5 + RANDOM % 20))
    krc_etcd_start "$KRC_ETCD_CLIENT_PORT" "$KRC_ETCD_PEER_PORT" || { sleep 1; krc_etcd_start "$KRC_ETCD_CLIENT_PORT" "$KRC_ETCD_PEER_PORT"; } ||
      die "etcd did not come back on its ports"
  fi
done
wait "$client_pid"
rc=$?
client_pid=
[ $rc = 0 ] || die "the load client exited $rc"
check_alive
echo "soak: load done; checking"

# ---- the checks: KV blocks back to 0 on every decode node, then the processes stopped (their
# leak check runs at exit) and every log searched for sanitizer reports
leaks=0
for id in decode-0 decode-1; do
  kr_blocks_zero "$id" 600 && continue
  echo "soak: LEAK: $id still holds KV blocks 60 s after the load: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
  leaks=$((leaks + 1))
done
krc_stop
krc_etcd_stop
sanitizer=0
for f in "$KRC_DIR"/*.log "$KRC_DIR"/*.log.*; do
  [ -f "$f" ] || continue
  if grep -q -E "ERROR: AddressSanitizer|runtime error:|LeakSanitizer" "$f"; then
    sanitizer=$((sanitizer + 1))
    echo "soak: SANITIZER report in $f:"
    grep -m5 -E "ERROR: AddressSanitizer|runtime error:|LeakSanitizer|SUMMARY" "$f" | sed 's/^/  /'
  fi
done
"$PY" "$client" check --pool "$KRC_DIR/pool.json" --refs "$KRC_DIR/refs.json" \
  --rows "$KRC_DIR/rows.jsonl" --faults "$faults" --router-log "$KRC_DIR/router.log" --router-log "$KRC_DIR/router-m.log"
outcome=$?
echo "leaks:           $leaks decode node(s) holding KV blocks"
echo "sanitizer:       $sanitizer log(s) with a report"
echo "crashes:         $crashes"
[ $outcome = 0 ] && [ $leaks = 0 ] && [ $sanitizer = 0 ] && [ $crashes = 0 ] && verdict=0
[ $verdict = 0 ] && echo "soak: ok" || echo "soak: FAIL"
exit $verdict
