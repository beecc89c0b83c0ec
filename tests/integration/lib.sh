# lib.sh - the shell helpers the integration tests (tests/integration/*.sh) and the soak test
# (tests/soak/soak.sh) share; sourced first thing, after `set -uo pipefail`:
#   . "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh"
# It sources deploy/local-cluster.sh (krc_*: start, signal, restart and stop a local cluster,
# free ports, model copies), so a test that runs a cluster needs nothing else. Sourcing it only
# defines functions and sets `fails=0`; every check a test makes stays in the test.
# Not here: the Python gRPC client setup, which skips a test at source time when python3-grpcio
# is missing (lib/pystubs.sh).
# Needs KR_SRC (set by ctest) and, for the helpers that run programs, KR_BIN.
. "$KR_SRC/deploy/local-cluster.sh"

# ---- skipping (exit 77, ctest's SKIP_RETURN_CODE)

# kr_skip MESSAGE: prints "SKIP: MESSAGE" and exits 77
kr_skip() { echo "SKIP: $*"; exit 77; }
# kr_f32_input_kernels: every process started after it runs the CPU kernels that keep matmul
# inputs f32. A test comparing a migrated stream with one-process greedy ids needs it: the
# re-prefill computes the KV of the generated tokens as a prompt, and on a CPU with AVX-512-BF16
# a prompt's matmuls of bf16 weights round their inputs to bf16 where decode kept them f32
# (docs/engine.md, "Numerics"), which can move a greedy argmax.
kr_f32_input_kernels() { if grep -qw avx512_bf16 /proc/cpuinfo; then export KR_CPU_ISA=avx512; fi; }
# kr_need_bins PROGRAM...: skips the test unless every program is built in KR_BIN
kr_need_bins() {
  local p
  for p in "$@"; do [ -x "${KR_BIN:?KR_BIN must be the build directory}/$p" ] || kr_skip "$KR_BIN/$p is not built"; done
}
# kr_need_py [HINT]: sets py to Debian's /usr/bin/python3 (a pyenv python3 earlier on PATH may
# lack the Debian modules the tests use), or skips the test saying it is missing (and HINT)
kr_need_py() {
  py=/usr/bin/python3
  [ -x "$py" ] || kr_skip "$py is missing${1:+ $1}"
}

# ---- failing

# fail MESSAGE: prints "FAIL: MESSAGE", counts it in $fails and goes on (the test ends with
# exit 1 when fails > 0): for tests whose checks are independent
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
# fatal MESSAGE: prints "FAIL: MESSAGE" and the end of the router's log to stderr and exits 1:
# for tests whose later steps need the earlier ones to have held
fatal() {
  echo "FAIL: $*" >&2
  echo "--- router log:" >&2
  tail -n 40 "$KRC_DIR/router.log" >&2 || true
  exit 1
}
# errmsg FILE: the first 600 bytes of a client's error output on one line, for a FAIL message
errmsg() { head -c 600 "$1" | tr '\n' ' '; }

# ---- time

# now: the time in seconds with nanoseconds, for elapsed
now() { date +%s.%N; }
# elapsed T0 T1: T1 - T0 in seconds with two decimals (needs py: kr_need_py)
elapsed() { "$py" -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.2f}")' "$1" "$2"; }

# ---- the cluster's work directory

# kr_cluster_workdir NAME: makes KRC_DIR, and at exit releases a held pool (kr_hold_pool,
# lib/pystubs.sh), stops the cluster and removes KRC_DIR
kr_cluster_workdir() {
  KRC_DIR=$(mktemp -d -t "kvrelay-$1.XXXXXX")
  trap kr_cluster_cleanup EXIT
}
kr_cluster_cleanup() {
  [ -z "${KR_HOLD_PID:-}" ] || kill "$KR_HOLD_PID" 2>/dev/null || true
  krc_stop
  rm -rf "$KRC_DIR"
}

# ---- what the router says about its nodes (kvrelay-cli status --json)

# kr_status_field ID FIELD: reads `kvrelay-cli status --json` on stdin and prints FIELD of node
# ID: "absent" when the router lists no such node, "unknown" when the input is not JSON (the
# router was not answering)
kr_status_field() {
  "$py" -c '
import json, sys
try:
    nodes = json.load(sys.stdin)["nodes"]
except ValueError:
    print("unknown")
else:
    print(next((n[sys.argv[2]] for n in nodes if n["id"] == sys.argv[1]), "absent"))' "$1" "$2"
}
# kr_node_field ROUTER ID FIELD: FIELD of node ID as router ROUTER reports it (kr_status_field)
kr_node_field() { "$KR_BIN/kvrelay-cli" --router "$1" status --json 2>/dev/null | kr_status_field "$2" "$3"; }
# kr_wait_state ROUTER ID LIMIT STATE...: waits up to LIMIT seconds (polling every 0.1 s) for
# router ROUTER to report node ID in one of the STATEs; prints the time it saw it (now) and
# returns 0, or returns 1
kr_wait_state() {
  local r=$1 id=$2 limit=$3 t st w
  shift 3
  for ((t = 0; t < limit * 10; t++)); do
    st=$(kr_node_field "$r" "$id" state)
    for w in "$@"; do [ "$st" = "$w" ] && { now; return 0; }; done
    sleep 0.1
  done
  return 1
}
# kr_served_by FILE [ROLE]: the node that served a `kvrelay-cli generate --json` answer saved in
# FILE, as its usage.served_by reports it (ROLE: decode_node unless given); prints nothing when
# FILE holds no answer
kr_served_by() {
  "$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["usage"]["served_by"][sys.argv[2]])' "$1" "${2:-decode_node}" 2>/dev/null
}

# ---- metrics and KV blocks

# metric NAME TEXT: the value of the unlabelled Prometheus sample NAME in TEXT (empty if none)
metric() { awk -v m="$1" '$1 == m { print $2 }' <<<"$2"; }
# kr_blocks_zero NODE TRIES: polls decode node NODE's /metrics (krc_http's port) every 0.1 s, at
# most TRIES times, until it holds no used and no reserved KV block: returns 0 then, else 1. Either
# way KR_METRICS holds the last metrics read, and KR_USED and KR_RESERVED the two counts ("" when
# the node did not answer), for the caller's message.
kr_blocks_zero() {
  local t
  for ((t = 0; t < $2; t++)); do
    KR_METRICS=$(curl -s --max-time 2 "http://$(krc_http "$1")/metrics")
    KR_USED=$(metric kvrelay_kv_blocks_used "$KR_METRICS")
    KR_RESERVED=$(metric kvrelay_kv_blocks_reserved "$KR_METRICS")
    [ "${KR_USED:-x}" = 0 ] && [ "${KR_RESERVED:-x}" = 0 ] && return 0
    sleep 0.1
  done
  return 1
}

# ---- clients

# kr_prompt SEED [N]: N (default 24) token ids in 1..500 from a fixed pseudo-random sequence
# seeded by SEED, space-separated: the same prompt for the same SEED on every run
kr_prompt() { awk -v n="${2:-24}" -v s="$1" 'BEGIN { x = s * 7919 + 17; for (k = 0; k < n; k++) { x = (x * 1103515245 + 12345) % 2147483648; printf "%s%d", (k ? " " : ""), 1 + x % 500 } }'; }
# kr_wait_clients: waits for every background client whose pid the test added to CLIENTS, and
# empties CLIENTS
kr_wait_clients() {
  local p
  for p in "${CLIENTS[@]}"; do wait "$p"; done
  CLIENTS=()
}
