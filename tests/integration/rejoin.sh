#!/usr/bin/env bash
# rejoin.sh - a node restarted after a long downtime is used again as soon as it is back
# (docs/failures.md, "A node restarts at the same address"), with static membership and, when
# etcd is installed, with membership in etcd. Real processes on loopback: 1 prefill + 2 decode
# nodes (deploy/local-cluster.sh) on llama3-tiny, kvrelay-cli --json as the client.
#   1. kill -9 decode-0; requests go on to decode-1 until the router has given decode-0 up
#      (suspect, unreachable or gone);
#   2. it stays down for REJOIN_DOWN_S seconds (default 8: several rounds of the node channel's
#      reconnect backoff, which would otherwise have grown past the downtime);
#   3. restarted on the same gRPC and UCX ports: the router sees it serving, and requests are
#      placed on it again; no KV block stays used or reserved.
# Events, not clocks, decide: the test waits for the router's state and for a request served by
# decode-0. The time from the node's restart to the router's "serving" is printed (the figure
# docs/failures.md quotes), never asserted.
# Run: ctest -R rejoin, or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/rejoin.sh
set -uo pipefail

. "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh" # krc_*, fatal, now, elapsed, kr_*
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli
bin=$KR_BIN
fixtures=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)
kr_need_py
down_s=${REJOIN_DOWN_S:-8}
kr_cluster_workdir rejoin
model=$fixtures/models/llama3-tiny
# node_field ID FIELD: the router's ClusterStatus field for node ID ("unknown" when the status
# call did not answer, e.g. on a loaded machine)
node_field() { kr_node_field "$KRC_ROUTER" "$1" "$2"; }
# wait_state ID SECONDS STATE... : returns once the router gives node ID one of the states
wait_state() { kr_wait_state "$KRC_ROUTER" "$@" >/dev/null; }
# request N: one short greedy request; prints the decode node that served it
request() {
  local out=$KRC_DIR/req.json
  "$bin/kvrelay-cli" --router "$KRC_ROUTER" generate --ids "$((3 + $1 % 200)) 7 11 13" --max-tokens 4 \
    --timeout-ms 30000 --json >"$out" 2>"$KRC_DIR/req.err" || fatal "request $1: $(tail -n1 "$KRC_DIR/req.err")"
  kr_served_by "$out"
}
# blocks_free NODE...: every decode node named holds no used or reserved KV block (polls 20 s)
blocks_free() {
  local node
  for node in "$@"; do kr_blocks_zero "$node" 200 || fatal "$node still holds KV blocks"; done
}

# one round on the running cluster ($1 names the membership)
rejoin_round() {
  local mode=$1 transfer0 i used t_restart
  transfer0=$(node_field decode-0 transfer_address)
  [[ $transfer0 == *:* ]] || fatal "$mode: no transfer address for decode-0 ($transfer0)"
  krc_signal decode-0 KILL
  for ((i = 0; ; i++)); do
    [ "$(request "$i")" = decode-1 ] || fatal "$mode: request $i after the kill was not served by decode-1"
    case $(node_field decode-0 state) in suspect | unreachable | gone) break ;; esac
    [ $i -lt 200 ] || fatal "$mode: the router never gave up the killed decode-0"
  done
  echo "$mode: decode-0 killed, the router sees it $(node_field decode-0 state); down for $down_s s"
  sleep "$down_s"
  t_restart=$(now)
  krc_restart decode-0 --listen "$(krc_addr decode-0)" --transfer "$transfer0" --http "$(krc_http decode-0)" ||
    fatal "$mode: decode-0 did not restart on its ports"
  local t_up; t_up=$(now)
  wait_state decode-0 60 serving || fatal "$mode: the router does not see the restarted decode-0 serving"
  local t_serving; t_serving=$(now)
  used=0
  for ((i = 0; i < 20 && used == 0; i++)); do [ "$(request $((500 + i)))" = decode-0 ] && used=1; done
  [ $used = 1 ] || fatal "$mode: 20 requests after decode-0 came back, none was placed on it"
  blocks_free decode-0 decode-1
  echo "$mode: decode-0 serving at the router $(elapsed "$t_up" "$t_serving") s after it was up again" \
    "($(elapsed "$t_restart" "$t_serving") s after its restart began); used again after $i request(s)"
}

KRC_DECODE_ARGS=()
krc_start "$bin" "$model" 1 2 127.0.0.1:0 --threads 1 || fatal "the static cluster did not start"
rejoin_round static
krc_stop

if krc_etcd_start; then
  krc_start "$bin" "$model" 1 2 127.0.0.1:0 --threads 1 || fatal "the etcd cluster did not start"
  wait_state decode-0 60 serving && wait_state decode-1 60 serving || fatal "etcd: the decode nodes are not serving"
  rejoin_round etcd
  krc_stop
  krc_etcd_stop
else
  echo "etcd is not installed: the etcd round is skipped"
fi
echo "rejoin: ok"
