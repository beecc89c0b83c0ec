#!/usr/bin/env bash
# membership.sh - nodes registered in etcd under leases, with real processes on loopback: a real
# etcd started here (deploy/local-cluster.sh krc_etcd_start), 1 prefill + 3 decode nodes on llama3-tiny
# registered with --etcd --cluster m --lease-ttl 3, the router on --etcd when it has it (else
# the static file), kvrelay-cli --json as the client.
#   (a) every node's key is in `etcdctl get --prefix /kvrelay/` as JSON with the membership
#       fields (checked with python's json), and in the router's ClusterStatus as serving;
#   (b) kill -9 decode-2: etcd's watch sees its key deleted, with no write after the kill, and
#       the lease the key was written under no longer exists (the key went with its expired
#       lease: nothing else can remove it once the node is dead); the router shows it gone (time
#       printed, not asserted);
#   (c) SIGTERM decode-1 while long streams run on it: its key says "draining", its streams
#       finish normally, new requests succeed elsewhere, then its key is gone and it exits 0;
#   (d) etcd stopped (SIGSTOP) for 30 s while requests keep succeeding, then resumed; and
#       killed and restarted on the same data dir: the nodes' keys come back without any
#       restart (time to re-registration printed);
# and at the end decode nodes' used + reserved KV blocks are 0 (/metrics).
# Skips (77) when /usr/bin/etcd or a program is missing.
# Run: ctest -R membership, or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/membership.sh
set -uo pipefail

. "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh" # krc_*, fail, now, elapsed, kr_*
bin=${KR_BIN:?KR_BIN must be the build directory}
fixtures=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli
[ -x /usr/bin/etcd ] && command -v etcdctl >/dev/null || kr_skip "etcd (etcd-server, etcd-client) is not installed"
kr_need_py

KRC_DIR=$(mktemp -d -t kvrelay-membership.XXXXXX)
trap 'kill -CONT "${KRC_ETCD_PID:-0}" 2>/dev/null; krc_stop; krc_etcd_stop; rm -rf "$KRC_DIR"' EXIT
ttl=3

krc_etcd_start || { echo "FAIL: etcd did not start (log: $KRC_DIR/etcd.log)"; exit 1; }
echo "etcd at $KRC_ETCD"
# without an end-of-sequence token, so the streams drained in (c) surely run when SIGTERM comes
model=$KRC_DIR/model
krc_model_copy "$fixtures/models/llama3-tiny" "$model" grep -v '"eos_token_id"'
KRC_CLUSTER=m
KRC_PREFILL_ARGS=(--lease-ttl "$ttl")
KRC_DECODE_ARGS=(--lease-ttl "$ttl" --kv-blocks 4000)
KRC_ROUTER_ARGS=(--max-tokens-limit 512)
KRC_START_TIMEOUT=1200
krc_start "$bin" "$model" 1 3 127.0.0.1:0 --threads 1 || { echo "FAIL: the cluster did not start"; exit 1; }
router=$KRC_ROUTER
router_etcd=0
"$bin/kvrelay-router" --help | grep -q -- '--etcd' && router_etcd=1 # as krc_start decides
echo "cluster up: router $router (membership from $([ $router_etcd = 1 ] && echo etcd || echo the static file)), logs in $KRC_DIR"

# "id state" per member key under /kvrelay/m/nodes/; fails (prints nothing, status 1) when a
# value is not member JSON
members() {
  etcdctl --endpoints "$KRC_ETCD" --dial-timeout 2s --command-timeout 2s get --prefix /kvrelay/m/nodes/ --print-value-only 2>/dev/null |
    "$py" -c '
import json, sys
need = {"id": str, "role": str, "state": str, "grpc": str, "transfer": str, "fingerprint": str,
        "kv_capacity": int, "version": str, "start_unix_ms": int}
for line in sys.stdin:
    if not line.strip():
        continue
    m = json.loads(line)
    for k, t in need.items():
        if not isinstance(m.get(k), t):
            sys.exit("field %s of %s: %r" % (k, line.strip(), m.get(k)))
    assert m["role"] in ("prefill", "decode") and m["state"] in ("serving", "draining"), line
    assert m["role"] == "prefill" or m["transfer"], line
    assert len(m["fingerprint"]) == 16 and m["kv_capacity"] > 0 and m["start_unix_ms"] > 0, line
    print(m["id"], m["state"])'
}
member_state() { members | awk -v id="$1" '$1 == id { print $2 }'; }
# waits up to $2 s until member $1 has state $3 ("" = no key); prints the time it was seen
wait_member() {
  local id=$1 limit=$2 want=$3 t
  for ((t = 0; t < limit * 20; t++)); do
    [ "$(member_state "$id")" = "$want" ] && { now; return 0; }
    sleep 0.05
  done
  return 1
}
# the state router ClusterStatus gives node $1 ("absent" when not listed)
node_state() { kr_node_field "$router" "$1" state; }
# waits up to $2 s until node $1 is in one of the states $3...; prints the time it was seen
wait_state() { kr_wait_state "$router" "$@"; }
blocks_zero() { # decode node $1: used + reserved blocks 0 within 20 s
  kr_blocks_zero "$1" 200 ||
    fail "$1 still holds KV blocks: $(grep -E '^kvrelay_kv_blocks_(used|reserved) ' <<<"$KR_METRICS" | tr '\n' ' ')"
}
CLIENTS=()
gen() { # gen NAME MAX_TOKENS SEED: one client in the background
  ("$bin/kvrelay-cli" --router "$router" generate --ids "$(kr_prompt "$3")" --max-tokens "$2" \
     --timeout-ms 120000 --json >"$KRC_DIR/$1.got" 2>"$KRC_DIR/$1.err"
   echo $? >"$KRC_DIR/$1.rc") &
  CLIENTS+=($!)
}
one_request() { # one short request must succeed; prints its decode node
  "$bin/kvrelay-cli" --router "$router" generate --ids "$(kr_prompt "$1")" --max-tokens 4 --json \
    >"$KRC_DIR/one.got" 2>"$KRC_DIR/one.err" || { fail "$2: $(tail -n1 "$KRC_DIR/one.err")"; return 1; }
  kr_served_by "$KRC_DIR/one.got"
}

# ---- (a) registered: JSON in etcd, serving in ClusterStatus
for id in prefill-0 decode-0 decode-1 decode-2; do
  wait_member "$id" 10 serving >/dev/null || fail "(a) $id is not in etcd as serving: $(members | tr '\n' ';')"
  if [ $router_etcd = 1 ]; then
    wait_state "$id" 10 serving >/dev/null || fail "(a) ClusterStatus: $id is $(node_state "$id"), not serving"
  fi
done
echo "(a) in etcd: $(members | tr '\n' ';')"
etcdctl --endpoints "$KRC_ETCD" get --prefix /kvrelay/ | sed -n 2p

# ---- (b) kill -9: the key goes with its lease, which expires because nobody keeps it alive
# the key, its lease and etcd's revision just before the kill: the key's history from there on
# is read back afterwards (etcdctl watch --rev replays it), so no event can be missed
key=$(etcdctl --endpoints "$KRC_ETCD" get --prefix /kvrelay/m/nodes/ --keys-only | grep '/decode-2$')
read -r lease rev < <(etcdctl --endpoints "$KRC_ETCD" get "$key" -w json |
  "$py" -c 'import json,sys; j = json.load(sys.stdin); print("%x" % j["kvs"][0]["lease"], j["header"]["revision"])' 2>/dev/null)
[ -n "$key" ] && [ -n "$lease" ] || fail "(b) decode-2's key or its lease not found in etcd (key '$key', lease '$lease')"
t0=$(now)
krc_signal decode-2 KILL
t_gone=$(wait_member decode-2 $((ttl + 10)) "") || fail "(b) decode-2's key is still in etcd $((ttl + 10)) s after kill -9"
events=$(timeout 5 etcdctl --endpoints "$KRC_ETCD" watch --rev $((${rev:-0} + 1)) "$key" 2>/dev/null |
  grep -E '^(PUT|DELETE)$' | tr '\n' ' ')
[ "$events" = "DELETE " ] || fail "(b) etcd events on decode-2's key since the kill: '$events', not one DELETE"
ttl_out=$(etcdctl --endpoints "$KRC_ETCD" lease timetolive "$lease" 2>&1)
grep -q 'already expired\|not found' <<<"$ttl_out" || fail "(b) decode-2's key is gone but its lease $lease is still alive: $ttl_out"
t_rgone=
if [ $router_etcd = 1 ]; then
  t_rgone=$(wait_state decode-2 10 gone absent) || fail "(b) ClusterStatus still shows decode-2 as $(node_state decode-2)"
fi
echo "(b) decode-2 killed: key deleted with its lease $lease after $(elapsed "$t0" "${t_gone:-$t0}") s (lease TTL $ttl s)${t_rgone:+, gone in ClusterStatus after $(elapsed "$t0" "$t_rgone") s}"
[ -n "$(one_request 50 "(b) a request after the kill")" ] || true

# ---- (c) SIGTERM drains decode-1: streams on it finish, new work goes elsewhere, key goes
for ((i = 0; i < 4; i++)); do gen "c$i" 300 $((100 + i)); done
for ((t = 0; t < 300; t++)); do # until decode-1 runs a sequence
  m=$(curl -s --max-time 2 "http://$(krc_http decode-1)/metrics")
  [ "$(metric kvrelay_running_sequences "$m")" != 0 ] && [ -n "$(metric kvrelay_running_sequences "$m")" ] && break
  sleep 0.05
done
pid1=$(krc_pid decode-1)
t0=$(now)
krc_signal decode-1 TERM
t_dr=$(wait_member decode-1 5 draining) || fail "(c) decode-1's key never said draining"
[ $router_etcd = 1 ] && { wait_state decode-1 10 draining gone absent >/dev/null || fail "(c) ClusterStatus: decode-1 is $(node_state decode-1)"; }
for ((i = 0; i < 3; i++)); do
  d=$(one_request $((200 + i)) "(c) request $i while decode-1 drains")
  [ -z "$d" ] || [ "$d" = decode-0 ] || fail "(c) request $i during the drain went to $d"
done
kr_wait_clients
on1=0
for ((i = 0; i < 4; i++)); do
  [ "$(cat "$KRC_DIR/c$i.rc")" = 0 ] || fail "(c) stream $i did not finish: $(tail -n1 "$KRC_DIR/c$i.err")"
  [ "$(kr_served_by "$KRC_DIR/c$i.got")" = decode-1 ] && on1=$((on1 + 1))
done
[ $on1 -gt 0 ] || fail "(c) no stream ran on decode-1 (nothing was drained)"
t_dg=$(wait_member decode-1 30 "") || fail "(c) decode-1's key stayed after its drain"
rc=
for ((t = 0; t < 300; t++)); do kill -0 "$pid1" 2>/dev/null || break; sleep 0.1; done
wait "$pid1" 2>/dev/null; rc=$?
[ "$rc" = 0 ] || fail "(c) decode-1 exited $rc after draining"
echo "(c) decode-1 SIGTERMed with $on1 of 4 streams on it: draining in etcd after $(elapsed "$t0" "${t_dr:-$t0}") s, all finished, key gone after $(elapsed "$t0" "${t_dg:-$t0}") s, exit $rc"
blocks_zero decode-0

# ---- (d) etcd frozen for 30 s: requests keep succeeding; then etcd killed and restarted on the
# same data dir: every live node's key comes back with no restart
kill -STOP "$KRC_ETCD_PID"
t0=$(now)
n_ok=0
while [ "$(elapsed "$t0" "$(now)" | cut -d. -f1)" -lt 30 ]; do
  [ -n "$(one_request $((300 + n_ok)) "(d) a request while etcd is frozen")" ] && n_ok=$((n_ok + 1))
  sleep 1
done
[ $router_etcd = 1 ] && { [ "$(node_state decode-0)" = serving ] || fail "(d) ClusterStatus: decode-0 is $(node_state decode-0) while etcd is frozen"; }
kill -CONT "$KRC_ETCD_PID"
t0=$(now)
echo "(d) etcd frozen for 30 s: $n_ok requests succeeded meanwhile"
# the leases (3 s) expired meanwhile as far as etcd's clock goes: the nodes must re-register
t_back=$(wait_member decode-0 30 serving) || fail "(d) decode-0 not back in etcd after SIGCONT"
echo "(d) after SIGCONT: decode-0's key there (serving) $(elapsed "$t0" "${t_back:-$t0}") s later"
ports="$KRC_ETCD_CLIENT_PORT $KRC_ETCD_PEER_PORT"
krc_etcd_stop
[ -n "$(one_request 400 "(d) a request while etcd is down")" ] || true
krc_etcd_start $ports || fail "(d) etcd did not restart on the same ports"
t0=$(now)
for id in prefill-0 decode-0; do
  t=$(wait_member "$id" 30 serving) || { fail "(d) $id did not re-register after etcd restarted"; continue; }
  echo "(d) etcd restarted on its data dir: $id's key back after $(elapsed "$t0" "$t") s"
done
[ -z "$(member_state decode-1)$(member_state decode-2)" ] || fail "(d) a dead node came back: $(members | tr '\n' ';')"
# etcd restored the keys and leases from its data dir: they stay only if kept alive
sleep $((ttl + 2))
for id in prefill-0 decode-0; do
  [ "$(member_state "$id")" = serving ] || fail "(d) $id's key did not survive TTL + 2 s after the restart (no keep-alive)"
done
grep -h 'membership:' "$KRC_DIR/decode-0.log" | tail -n 4 | sed 's/^/(d) decode-0: /'
[ -n "$(one_request 500 "(d) a request after etcd came back")" ] || true
blocks_zero decode-0

[ $fails = 0 ] && echo "membership: all scenarios passed" || echo "membership: $fails failure(s)"
[ $fails = 0 ]
