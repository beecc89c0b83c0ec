#!/usr/bin/env bash
# failures.sh - the router's failure rules (docs/failures.md) against real processes on loopback:
# 2 prefill + 2 decode nodes (deploy/local-cluster.sh, static membership) on llama3-tiny, two
# routers on the same nodes (one plain, one with --migrate), kvrelay-cli --json as the client.
#   (a) kill -9 a decode node during 8 streams of 400 tokens: every stream on it ends
#       UNAVAILABLE naming the node (within 5 s of the kill), the others complete;
#   (d) restart it on the same gRPC and UCX ports: it is used again (served_by), nothing else
#       restarted;
#   (b) the same kill through the --migrate router: every stream completes with the ids of
#       kvrelay-generate --greedy on the same prompt;
#   (c) kill -9 a prefill node (--threads 1) holding queued long prompts: all complete; it is
#       restarted before (e);
#   (e) SIGSTOP a decode node while it streams: its streams end UNAVAILABLE after
#       --decode-stall-ms, ClusterStatus shows it suspect, requests succeed on the other;
#       SIGCONT: serving again and used again;
#   (f) SIGTERM a decode node while it streams: the router sees it draining, its streams finish,
#       new requests go to the other;
#   (h) SIGSTOP a prefill node holding queued requests: they time out (--prefill-timeout-ms)
#       and complete on the other prefill node;
#   (g) when etcd is installed: a router with --etcd follows member keys written with etcdctl
#       (added, draining, deleted: gone, another model fingerprint: not used, back); etcd
#       stopped: requests keep succeeding; restarted: the router sees changes again.
# After each scenario every live decode node's used + reserved KV blocks return to 0. The
# detect/recover times are printed (docs/failures.md quotes them); none is asserted except the
# 5 s detection bound docs/failures.md promises for (a), with slack for the sanitizer build.
# Run: ctest -R failures, or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/failures.sh
set -uo pipefail

. "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh" # krc_*, fail, now, elapsed, errmsg, kr_*
bin=${KR_BIN:?KR_BIN must be the build directory}
fixtures=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli kvrelay-generate
kr_need_py

KRC_DIR=$(mktemp -d -t kvrelay-failures.XXXXXX)
trap 'krc_stop; rm -rf "$KRC_DIR"' EXIT

# The fixture without an end-of-sequence token (eos_token_id removed from its config), so every
# stream runs to max_tokens and is surely still streaming when a node is killed or stopped: with
# EOS, a random tiny model ends some streams early and unpredictably. The weights are the
# fixture's own files; every process and the one-process references load this directory.
model=$KRC_DIR/model
krc_model_copy "$fixtures/models/llama3-tiny" "$model" grep -v '"eos_token_id"'
grep -q eos_token_id "$model/config.json" && { echo "FAIL: could not remove eos_token_id"; exit 1; }
kr_f32_input_kernels # (b) compares migrated streams with one-process greedy ids
chunk=32
KRC_PREFILL_ARGS=(--chunk "$chunk")
KRC_DECODE_ARGS=()
KRC_ROUTER_ARGS=(--max-tokens-limit 512 --prefill-timeout-ms 20000)
KRC_START_TIMEOUT=1200
krc_start "$bin" "$model" 2 2 127.0.0.1:0 --threads 1 || { echo "FAIL: the cluster did not start"; exit 1; }
krc_spawn router-m "$bin/kvrelay-router" --model "$model" --id router-m --nodes "$KRC_DIR/nodes.json" \
  --listen 127.0.0.1:0 --http 127.0.0.1:0 --max-tokens-limit 512 --prefill-timeout-ms 8000 --migrate
krc_wait_serving router-m "$(krc_pid router-m)" >/dev/null || { echo "FAIL: router-m did not start"; exit 1; }
router=$KRC_ROUTER
router_m=$(krc_addr router-m)
echo "cluster up: router $router, router-m $router_m (logs in $KRC_DIR)"

blocks() { curl -s --max-time 2 "http://$(krc_http "$1")/metrics"; }
# every decode node named: used + reserved blocks back to 0 (polls up to 20 s)
check_blocks() {
  local what=$1 node; shift
  for node in "$@"; do
    kr_blocks_zero "$node" 200 || fail "$what: $node still holds KV blocks: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
  done
}
# gen DIR NAME ROUTER MAX_TOKENS IDS: one client in the background, its end time in NAME.end
gen() {
  local d=$1 name=$2 r=$3 mt=$4 ids=$5
  ("$bin/kvrelay-cli" --router "$r" generate --ids "$ids" --max-tokens "$mt" --timeout-ms 120000 --json \
    >"$d/$name.got" 2>"$d/$name.err"
   echo "$? $(now)" >"$d/$name.end") &
  CLIENTS+=($!)
}
CLIENTS=() # kr_wait_clients waits for them (not for the cluster's processes)
# waits until decode node $1 has sequences running (used blocks > 0), up to 30 s
wait_busy() {
  local t
  for ((t = 0; t < 300; t++)); do
    [ "$(metric kvrelay_kv_blocks_used "$(blocks "$1")")" != 0 ] && [ -n "$(metric kvrelay_kv_blocks_used "$(blocks "$1")")" ] && return 0
    sleep 0.1
  done
  return 1
}

# finished_before_kill NODE FILE: the stream answered in FILE ended OK on NODE before NODE was
# killed: its last tokens can reach the client after the kill, but NODE logged the end
finished_before_kill() {
  local rid
  rid=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["request_id"])' "$2" 2>/dev/null)
  [ -n "$rid" ] && grep -q "\[$rid\] decode of reservation [0-9]* ended OK" "$KRC_DIR/$1.log"
}

n_streams=8
max_tokens=400
transfer0=$("$bin/kvrelay-cli" --router "$router" status --json |
  "$py" -c 'import json,sys; print(next(n["transfer_address"] for n in json.load(sys.stdin)["nodes"] if n["id"] == "decode-0"))')
transfer1=$("$bin/kvrelay-cli" --router "$router" status --json |
  "$py" -c 'import json,sys; print(next(n["transfer_address"] for n in json.load(sys.stdin)["nodes"] if n["id"] == "decode-1"))')

# ---- (a) a decode node dies mid-stream
d=$KRC_DIR/a; mkdir -p "$d"
for ((i = 0; i < n_streams; i++)); do gen "$d" "$i" "$router" $max_tokens "$(kr_prompt $i)"; done
wait_busy decode-0 || fail "(a) decode-0 never ran a sequence"
sleep 0.3
t_kill=$(now)
krc_signal decode-0 KILL
kr_wait_clients
affected=0 worst=0
for ((i = 0; i < n_streams; i++)); do
  read -r rc t_end <"$d/$i.end"
  if [ "$rc" = 0 ]; then
    by=$(kr_served_by "$d/$i.got")
    [ "$by" = decode-1 ] || finished_before_kill decode-0 "$d/$i.got" ||
      fail "(a) stream $i completed on '$by' after decode-0 was killed"
  else
    affected=$((affected + 1))
    grep -q "UNAVAILABLE" "$d/$i.err" && grep -q "decode node decode-0 failed after [0-9]* tokens were sent" "$d/$i.err" ||
      fail "(a) stream $i: expected UNAVAILABLE naming decode-0, got: $(errmsg "$d/$i.err")"
    dt=$(elapsed "$t_kill" "$t_end")
    worst=$("$py" -c "print(max($worst, $dt))")
  fi
done
[ $affected -gt 0 ] || fail "(a) no stream was on decode-0 when it was killed"
"$py" -c "import sys; sys.exit(0 if $worst < 5 else 1)" || fail "(a) an affected stream took ${worst} s to end (over 5 s)"
echo "(a) decode-0 killed: $affected of $n_streams streams ended UNAVAILABLE, the last ${worst} s after the kill; the others completed on decode-1"
check_blocks "(a)" decode-1

# ---- (d) the killed decode node restarts on the same gRPC and UCX ports
t_start=$(now)
krc_restart decode-0 --listen "$(krc_addr decode-0)" --transfer "$transfer0" --http "$(krc_http decode-0)" ||
  fail "(d) decode-0 did not restart on its ports"
t_serving=$(kr_wait_state "$router" decode-0 30 serving) || fail "(d) the router does not see decode-0 serving again"
used0=0
for ((i = 0; i < 8 && used0 == 0; i++)); do
  "$bin/kvrelay-cli" --router "$router" generate --ids "$(kr_prompt $((100 + i)))" --max-tokens 8 --json >"$KRC_DIR/d.got" 2>"$KRC_DIR/d.err" ||
    fail "(d) request $i: $(errmsg "$KRC_DIR/d.err")"
  [ "$(kr_served_by "$KRC_DIR/d.got")" = decode-0 ] && used0=1
done
[ $used0 = 1 ] || fail "(d) no request went to the restarted decode-0"
echo "(d) decode-0 restarted: serving at the router $(elapsed "$t_start" "${t_serving:-$t_start}") s after its restart began; used again: $used0"
check_blocks "(d)" decode-0 decode-1

# ---- (b) the same kill through the --migrate router: every stream completes, same greedy ids
d=$KRC_DIR/b; mkdir -p "$d"
kr_wait_state "$router_m" decode-0 30 serving >/dev/null || fail "(b) router-m does not see decode-0 serving"
for ((i = 0; i < n_streams; i++)); do gen "$d" "$i" "$router_m" $max_tokens "$(kr_prompt $((200 + i)))"; done
wait_busy decode-1 || fail "(b) decode-1 never ran a sequence"
sleep 0.3
t_kill=$(now)
krc_signal decode-1 KILL
kr_wait_clients
migrated=0
for ((i = 0; i < n_streams; i++)); do
  read -r rc t_end <"$d/$i.end"
  [ "$rc" = 0 ] || { fail "(b) stream $i failed: $(errmsg "$d/$i.err")"; continue; }
  [ "$(kr_served_by "$d/$i.got")" = decode-0 ] || finished_before_kill decode-1 "$d/$i.got" ||
    fail "(b) stream $i finished on $(kr_served_by "$d/$i.got") after decode-1 was killed"
done
migrated=$(grep -c "migrating:" "$KRC_DIR/router-m.log")
t_last=$(cat "$d"/*.end | awk '{ print $2 }' | sort -n | tail -n1)
# the references (one process, greedy)
for ((i = 0; i < n_streams; i++)); do
  "$bin/kvrelay-generate" --model "$model" --ids "$(kr_prompt $((200 + i)))" --greedy --max-tokens $max_tokens \
    --chunk "$chunk" --threads 1 --json >"$d/$i.want" 2>"$d/$i.want.err" || fail "(b) kvrelay-generate $i: $(errmsg "$d/$i.want.err")"
  "$py" - "$d/$i.got" "$d/$i.want" "$i" <<'EOF' || fails=$((fails + 1))
import json, sys
got, want = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
if got["ids"] != want["ids"]:
    n = next((k for k, (a, b) in enumerate(zip(got["ids"], want["ids"])) if a != b), min(len(got["ids"]), len(want["ids"])))
    print(f"FAIL: (b) stream {sys.argv[3]}: ids differ from one-process greedy at position {n} "
          f"({len(got['ids'])} vs {len(want['ids'])} tokens)")
    sys.exit(1)
EOF
done
[ "$migrated" -gt 0 ] || fail "(b) no stream was migrated"
echo "(b) decode-1 killed under --migrate: $migrated streams migrated to decode-0, all $n_streams completed with the one-process greedy ids; the last ended $(elapsed "$t_kill" "$t_last") s after the kill"
check_blocks "(b)" decode-0

krc_restart decode-1 --listen "$(krc_addr decode-1)" --transfer "$transfer1" --http "$(krc_http decode-1)" ||
  fail "decode-1 did not restart"
kr_wait_state "$router" decode-1 30 serving >/dev/null || fail "the router does not see decode-1 serving again"

# ---- (c) a prefill node dies while it holds queued requests
d=$KRC_DIR/c; mkdir -p "$d"
n_long=12
for ((i = 0; i < n_long; i++)); do gen "$d" "$i" "$router" 4 "$(kr_prompt $((300 + i)) 900)"; done
for ((t = 0; t < 300; t++)); do
  q=$("$bin/kvrelay-cli" --router "$router" status --json 2>/dev/null |
    "$py" -c 'import json,sys; print(next(n["queued_requests"] for n in json.load(sys.stdin)["nodes"] if n["id"] == "prefill-0"))' 2>/dev/null)
  [ "${q:-0}" -gt 0 ] && break
  sleep 0.1
done
[ "${q:-0}" -gt 0 ] || fail "(c) prefill-0 never had a queue"
t_kill=$(now)
krc_signal prefill-0 KILL
kr_wait_clients
for ((i = 0; i < n_long; i++)); do
  read -r rc t_end <"$d/$i.end"
  [ "$rc" = 0 ] || fail "(c) request $i failed: $(errmsg "$d/$i.err")"
done
retried=$(grep -c "retrying once on another prefill node" "$KRC_DIR/router.log")
t_last=$(cat "$d"/*.end | awk '{ print $2 }' | sort -n | tail -n1)
t_suspect=$(kr_wait_state "$router" prefill-0 10 suspect) || fail "(c) prefill-0 not suspect"
echo "(c) prefill-0 killed with ${q:-0} queued: all $n_long requests completed ($retried retried on prefill-1), the last $(elapsed "$t_kill" "$t_last") s after the kill; prefill-0 suspect by $(elapsed "$t_kill" "${t_suspect:-$t_kill}") s"
check_blocks "(c)" decode-0 decode-1
# back before (e): a request whose bundle is on its way to the decode node frozen there holds
# prefill-1's one worker until --prefill-timeout-ms, and the requests queued behind it are then
# retried on prefill-0
krc_restart prefill-0 --listen "$(krc_addr prefill-0)" --http "$(krc_http prefill-0)" || fail "(c) prefill-0 did not restart"
kr_wait_state "$router" prefill-0 30 serving >/dev/null || fail "(c) the router does not see prefill-0 serving again"

# ---- (e) a frozen decode node (SIGSTOP: its sockets stay open, nothing answers), stopped while
# it streams: its streams end after --decode-stall-ms (default 5 s), the others complete
d=$KRC_DIR/e; mkdir -p "$d"
for ((i = 0; i < 4; i++)); do gen "$d" "$i" "$router" $max_tokens "$(kr_prompt $((600 + i)))"; done
# stopped as soon as decode-1 holds blocks: 400 tokens of this tiny model take well under a
# second, so a pause here lets its streams finish first
wait_busy decode-1 || fail "(e) decode-1 never ran a sequence"
t_stop=$(now)
krc_signal decode-1 STOP
t_suspect=$(kr_wait_state "$router" decode-1 20 suspect) || fail "(e) decode-1 not suspect after SIGSTOP"
kr_wait_clients
stalled=0 worst=0
for ((i = 0; i < 4; i++)); do
  read -r rc t_end <"$d/$i.end"
  [ "$rc" = 0 ] && continue
  stalled=$((stalled + 1))
  grep -q "decode node decode-1 failed after [0-9]* tokens were sent: no message for" "$d/$i.err" ||
    fail "(e) stream $i: expected UNAVAILABLE naming decode-1 and the stall, got: $(errmsg "$d/$i.err")"
  worst=$("$py" -c "print(max($worst, $(elapsed "$t_stop" "$t_end")))")
done
[ $stalled -gt 0 ] || fail "(e) no stream was on decode-1 when it was stopped"
for ((i = 0; i < 4; i++)); do
  "$bin/kvrelay-cli" --router "$router" generate --ids "$(kr_prompt $((400 + i)))" --max-tokens 8 --json >"$KRC_DIR/e.got" 2>"$KRC_DIR/e.err" ||
    fail "(e) request $i while decode-1 is stopped: $(errmsg "$KRC_DIR/e.err")"
  [ "$(kr_served_by "$KRC_DIR/e.got")" = decode-0 ] || fail "(e) request $i went to $(kr_served_by "$KRC_DIR/e.got")"
done
t_cont=$(now)
krc_signal decode-1 CONT
t_back=$(kr_wait_state "$router" decode-1 20 serving) || fail "(e) decode-1 not serving after SIGCONT"
# decode nodes are placed by most free KV blocks: until decode-1 has freed its stalled streams'
# blocks (and a Status poll has told the router), decode-0 looks emptier and takes every request
kr_blocks_zero decode-1 200 || fail "(e) decode-1 still holds KV blocks after SIGCONT: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
used1=0
for ((i = 0; i < 30 && used1 == 0; i++)); do
  "$bin/kvrelay-cli" --router "$router" generate --ids "$(kr_prompt $((500 + i)))" --max-tokens 8 --json >"$KRC_DIR/e.got" 2>"$KRC_DIR/e.err" ||
    fail "(e) request $i after SIGCONT: $(errmsg "$KRC_DIR/e.err")"
  [ "$(kr_served_by "$KRC_DIR/e.got")" = decode-1 ] && used1=1
done
[ $used1 = 1 ] || fail "(e) decode-1 not used again after SIGCONT"
echo "(e) decode-1 SIGSTOPped: $stalled streams on it ended UNAVAILABLE (stall), the last ${worst} s after the stop; suspect after $(elapsed "$t_stop" "${t_suspect:-$t_stop}") s; after SIGCONT serving again in $(elapsed "$t_cont" "${t_back:-$t_cont}") s and used again: $used1"
check_blocks "(e)" decode-0 decode-1

# ---- (f) a decode node drains on SIGTERM: its streams finish, new requests go to the other
d=$KRC_DIR/f; mkdir -p "$d"
for ((i = 0; i < 4; i++)); do gen "$d" "$i" "$router" 500 "$(kr_prompt $((700 + i)))"; done
wait_busy decode-0 || fail "(f) decode-0 never ran a sequence"
t_term=$(now)
krc_signal decode-0 TERM
# the router learns of the drain from a Status poll (every 500 ms) or a refused Reserve; a drain
# that ends before either leaves the node unreachable instead: both mean "not chosen"
t_drain=$(kr_wait_state "$router" decode-0 10 draining unreachable suspect) || fail "(f) the router kept decode-0 serving after its SIGTERM"
f_state=$(kr_node_field "$router" decode-0 state)
for ((i = 0; i < 4; i++)); do
  "$bin/kvrelay-cli" --router "$router" generate --ids "$(kr_prompt $((800 + i)))" --max-tokens 8 --json >"$KRC_DIR/f.got" 2>"$KRC_DIR/f.err" ||
    fail "(f) request $i while decode-0 drains: $(errmsg "$KRC_DIR/f.err")"
  [ "$(kr_served_by "$KRC_DIR/f.got")" = decode-1 ] || fail "(f) request $i went to $(kr_served_by "$KRC_DIR/f.got")"
done
kr_wait_clients
for ((i = 0; i < 4; i++)); do
  read -r rc t_end <"$d/$i.end"
  [ "$rc" = 0 ] || fail "(f) stream $i did not finish while decode-0 drained: $(errmsg "$d/$i.err")"
done
echo "(f) decode-0 SIGTERMed: ${f_state:-?} at the router after $(elapsed "$t_term" "${t_drain:-$t_term}") s; its streams finished, new requests went to decode-1"
check_blocks "(f)" decode-1

# ---- (h) a frozen prefill node (SIGSTOP) holding queued requests: each times out after the
# --migrate router's --prefill-timeout-ms (8 s) and is retried once on the other prefill node.
# The cap counts queue wait too, so prefill-0 must get through its own four prompts and the four
# retried ones within it: 600-token prompts take 0.3-0.5 s each there under ASan on a loaded
# machine, and more at a load average of 9 (900-token ones behind a 3 s cap, and 600-token ones
# behind 5 s at that load, did not always make it)
kr_wait_state "$router_m" prefill-0 30 serving >/dev/null || fail "(h) router-m does not see prefill-0 serving"
kr_wait_state "$router_m" decode-1 30 serving >/dev/null || fail "(h) router-m does not see decode-1 serving"
d=$KRC_DIR/h; mkdir -p "$d"
for ((i = 0; i < 8; i++)); do gen "$d" "$i" "$router_m" 4 "$(kr_prompt $((1000 + i)) 600)"; done
for ((t = 0; t < 300; t++)); do
  q=$("$bin/kvrelay-cli" --router "$router_m" status --json 2>/dev/null |
    "$py" -c 'import json,sys; print(next(n["queued_requests"] for n in json.load(sys.stdin)["nodes"] if n["id"] == "prefill-1"))' 2>/dev/null)
  [ "${q:-0}" -gt 0 ] && break
  sleep 0.1
done
# (a busy machine may drain the queue between two polls: then the stop catches what is in flight)
[ "${q:-0}" -gt 0 ] || echo "note: (h) no queue seen on prefill-1 before the stop"
t_stop=$(now)
krc_signal prefill-1 STOP
kr_wait_clients
for ((i = 0; i < 8; i++)); do
  read -r rc t_end <"$d/$i.end"
  [ "$rc" = 0 ] || fail "(h) request $i failed: $(errmsg "$d/$i.err")"
done
t_last=$(cat "$d"/*.end | awk '{ print $2 }' | sort -n | tail -n1)
timed_out=$(grep -c "no answer within --prefill-timeout-ms" "$KRC_DIR/router-m.log")
krc_signal prefill-1 CONT
echo "(h) prefill-1 SIGSTOPped with ${q:-0} queued: all 8 requests completed ($timed_out timed out and were retried), the last $(elapsed "$t_stop" "$t_last") s after the stop"
check_blocks "(h)" decode-1

# ---- (g) membership from etcd (only when etcd is installed): the router follows member keys
# written with etcdctl for the live nodes: added, draining, deleted (gone), another model
if "$bin/kvrelay-router" --help | grep -q -- '--etcd' && krc_etcd_start; then
  ectl() { etcdctl --endpoints "$KRC_ETCD" --dial-timeout 2s "$@" >/dev/null; }
  member() { # member ROLE ID STATE FINGERPRINT
    printf '{"id": "%s", "role": "%s", "state": "%s", "grpc": "%s", "transfer": "", "fingerprint": "%s", "kv_capacity": 0, "version": "test", "start_unix_ms": 0}' \
      "$2" "$1" "$3" "$(krc_addr "$2")" "$4"
  }
  fp=00000000000000aa
  ectl put /kvrelay/t/nodes/prefill/prefill-1 "$(member prefill prefill-1 serving $fp)"
  ectl put /kvrelay/t/nodes/decode/decode-1 "$(member decode decode-1 serving $fp)"
  krc_spawn router-e "$bin/kvrelay-router" --model "$model" --id router-e --etcd "$KRC_ETCD" --cluster t \
    --listen 127.0.0.1:0 --http 127.0.0.1:0
  krc_wait_serving router-e "$(krc_pid router-e)" >/dev/null || fail "(g) router-e did not start"
  router_e=$(krc_addr router-e)
  kr_wait_state "$router_e" decode-1 10 serving >/dev/null || fail "(g) decode-1 not serving from etcd membership"
  "$bin/kvrelay-cli" --router "$router_e" generate --ids "$(kr_prompt 900)" --max-tokens 8 --json >"$KRC_DIR/g.got" 2>"$KRC_DIR/g.err" ||
    fail "(g) a request through etcd membership: $(errmsg "$KRC_DIR/g.err")"
  t0=$(now)
  ectl put /kvrelay/t/nodes/decode/decode-1 "$(member decode decode-1 draining $fp)"
  t_drain=$(kr_wait_state "$router_e" decode-1 10 draining) || fail "(g) draining in etcd not seen"
  t1=$(now)
  ectl del /kvrelay/t/nodes/decode/decode-1
  t_gone=$(kr_wait_state "$router_e" decode-1 10 gone) || fail "(g) a deleted member is not gone"
  if "$bin/kvrelay-cli" --router "$router_e" generate --ids "$(kr_prompt 901)" --max-tokens 8 >/dev/null 2>"$KRC_DIR/g.err"; then
    fail "(g) a request was served with no decode member"
  fi
  ectl put /kvrelay/t/nodes/decode/decode-1 "$(member decode decode-1 serving 00000000000000bb)"
  sleep 1
  if "$bin/kvrelay-cli" --router "$router_e" generate --ids "$(kr_prompt 902)" --max-tokens 8 >/dev/null 2>"$KRC_DIR/g.err"; then
    fail "(g) a member with another model fingerprint was used"
  fi
  grep -q "decode-1 serves model fingerprint 00000000000000bb" "$KRC_DIR/router-e.log" || fail "(g) the fingerprint mismatch was not logged"
  ectl put /kvrelay/t/nodes/decode/decode-1 "$(member decode decode-1 serving $fp)"
  t2=$(now)
  t_back=$(kr_wait_state "$router_e" decode-1 10 serving) || fail "(g) decode-1 not back"
  "$bin/kvrelay-cli" --router "$router_e" generate --ids "$(kr_prompt 903)" --max-tokens 8 --json >"$KRC_DIR/g.got" 2>"$KRC_DIR/g.err" ||
    fail "(g) a request after the member came back: $(errmsg "$KRC_DIR/g.err")"
  echo "(g) etcd membership: draining seen after $(elapsed "$t0" "${t_drain:-$t0}") s, a deleted key gone after $(elapsed "$t1" "${t_gone:-$t1}") s, back after $(elapsed "$t2" "${t_back:-$t2}") s"
  # etcd goes away: the router serves on the last membership; back on the same ports (same data):
  # the router watches again by itself
  ports="$KRC_ETCD_CLIENT_PORT $KRC_ETCD_PEER_PORT"
  krc_etcd_stop
  for ((i = 0; i < 3; i++)); do
    "$bin/kvrelay-cli" --router "$router_e" generate --ids "$(kr_prompt $((910 + i)))" --max-tokens 8 >/dev/null 2>"$KRC_DIR/g.err" ||
      fail "(g) request $i with etcd down: $(errmsg "$KRC_DIR/g.err")"
  done
  # shellcheck disable=SC2086
  krc_etcd_start $ports || fail "(g) etcd did not restart"
  t3=$(now)
  ectl del /kvrelay/t/nodes/decode/decode-1
  t_rewatch=$(kr_wait_state "$router_e" decode-1 30 gone) || fail "(g) after etcd restarted the router did not see a change"
  echo "(g) etcd stopped: requests kept succeeding; restarted: a change seen $(elapsed "$t3" "${t_rewatch:-$t3}") s after the restart"
  krc_etcd_stop
else
  echo "(g) skipped: etcd is not installed or the router has no --etcd"
fi

if [ $fails -gt 0 ]; then
  echo "$fails failures (logs: $KRC_DIR, kept)"
  trap 'krc_stop' EXIT
  exit 1
fi
echo "failures: all checks passed"
