#!/usr/bin/env bash
# netns.sh - a kvrelay cluster spread over network namespaces on one machine, so that every hop
# (client -> router -> nodes, prefill -> decode over UCX/TCP, everyone -> etcd) crosses a real
# interface: one namespace per process, each with a veth whose other end is a port of a Linux
# bridge in a namespace of its own, addresses on 10.200.0.0/24 (docs/cluster.md, "Several hosts
# on one machine"). etcd (one member), the router (--etcd, --migrate), 2 prefill and 2 decode
# nodes (--etcd, --lease-ttl 3, 1 thread) on models/kjv-2l128-2k; kvrelay-cli --json in a client
# namespace. Nothing is added to the root namespace; every namespace is named
# kvrelay-netns-<pid>-<role> and removed at exit (leftovers of a dead run are removed first).
#   (0) greedy requests over the bridge equal kvrelay-generate --prompt --greedy (both add the
#       BOS), and both prefill and both decode nodes served some; TTFT printed;
#   (1) tc netem delay + loss on the prefill nodes' links: outputs still equal, TTFT printed
#       (skipped, saying so, where the kernel has no sch_netem);
#   (2) decode-1 partitioned (its bridge port down) while idle: the router marks it unreachable,
#       then suspect (times printed), requests succeed on decode-0; healed: serving and used
#       again; partitioned again while a request streams from it: the stream migrates and still
#       equals kvrelay-generate; healed: no KV block left used or reserved on either node;
#   (3) etcd partitioned for longer than the lease TTL: requests keep succeeding on the
#       router's last membership while etcd expires every lease; healed: every node is back in
#       etcd under a new lease, the router shows all four serving, and requests succeed all
#       along, also in the moment etcd's expiries reach the router before the nodes have
#       registered again (it keeps placing gone members that still answer as serving).
# Events are asserted (states, outputs, counters), never durations; the figures are printed.
# Skips (77) without root / CAP_NET_ADMIN, ip, etcd, etcdctl or curl.
# Run: ctest -R netns, or KR_SRC=. KR_BIN=build bash tests/integration/netns.sh
set -uo pipefail

bin=${KR_BIN:?KR_BIN must be the build directory}
src=${KR_SRC:?KR_SRC must be the source directory}
. "$src/tests/integration/lib.sh" # krc_*, kr_skip, fail, now, elapsed, metric, kr_*
kr_f32_input_kernels # (2) compares a migrated stream with kvrelay-generate's ids
[ "$(id -u)" = 0 ] || kr_skip "network namespaces need root (CAP_NET_ADMIN); run it as root"
command -v ip >/dev/null || kr_skip "ip (iproute2) is missing"
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli kvrelay-generate
model=$(cd "$src/models/kjv-2l128-2k" 2>/dev/null && pwd) || kr_skip "models/kjv-2l128-2k is missing"
kr_need_py
[ -x /usr/bin/etcd ] && command -v etcdctl >/dev/null || kr_skip "etcd (etcd-server, etcd-client) is not installed"
command -v curl >/dev/null || kr_skip "curl is missing"

prefix=kvrelay-netns
tag=$prefix-$$
# Leftovers of runs whose script is gone (killed before its trap ran): their processes are
# killed by pid and their namespaces deleted (the veths and the bridge go with them). A run
# still alive (a parallel ctest) is left alone.
for ns in $(ip netns list 2>/dev/null | awk '{ print $1 }' | grep "^$prefix-[0-9]*-"); do
  owner=${ns#"$prefix"-}
  owner=${owner%%-*}
  grep -qa netns.sh "/proc/$owner/cmdline" 2>/dev/null && continue
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  ip netns del "$ns" 2>/dev/null && echo "removed the leftover namespace $ns"
done
ip netns add "$tag-br" 2>/dev/null || kr_skip "cannot create a network namespace (ip netns add: no CAP_NET_ADMIN?)"
NAMESPACES=("$tag-br")

KRC_DIR=$(mktemp -d -t kvrelay-netns.XXXXXX)
cleanup() {
  local i pid ns
  kill "${refs_pid:-}" "${refs_long_pid:-}" 2>/dev/null
  for pid in "${KRC_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for ((i = 0; i < 50; i++)); do
    pid=
    for p in "${KRC_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && pid=$p; done
    [ -z "$pid" ] && break
    sleep 0.1
  done
  for pid in "${KRC_PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
  for ns in "${NAMESPACES[@]}"; do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  if [ $fails = 0 ]; then rm -rf "$KRC_DIR"; else echo "logs kept in $KRC_DIR"; fi
}
trap cleanup EXIT
trap 'fails=$((fails + 1)); exit 130' INT TERM

# ------------------------------------------------------------------ the network
# one namespace per process; eth0 in it, v-<role> on the bridge br0 in $tag-br
declare -A ADDR=([etcd]=10.200.0.10 [router]=10.200.0.20 [prefill-0]=10.200.0.30 [prefill-1]=10.200.0.31
  [decode-0]=10.200.0.40 [decode-1]=10.200.0.41 [client]=10.200.0.50)
ROLES=(etcd router prefill-0 prefill-1 decode-0 decode-1 client)
nsx() { local r=$1; shift; ip netns exec "$tag-$r" "$@"; }
net() {
  ip -n "$tag-br" link add br0 type bridge || return 1
  ip -n "$tag-br" link set br0 up || return 1
  local r
  for r in "${ROLES[@]}"; do
    ip netns add "$tag-$r" || return 1
    NAMESPACES+=("$tag-$r")
    ip -n "$tag-br" link add "v-$r" type veth peer name eth0 netns "$tag-$r" || return 1
    ip -n "$tag-br" link set "v-$r" master br0 up || return 1
    ip -n "$tag-$r" addr add "${ADDR[$r]}/24" dev eth0 || return 1
    ip -n "$tag-$r" link set eth0 up || return 1
    ip -n "$tag-$r" link set lo up || return 1
  done
}
net || { echo "FAIL: could not build the namespaces and the bridge"; fails=1; exit 1; }
# A partition: the node's bridge port goes down, so nothing reaches it and nothing it sends
# leaves the veth (silently dropped both ways, no reset: a cut cable, not a dead process).
part() { ip -n "$tag-br" link set "v-$1" down; }
unpart() { ip -n "$tag-br" link set "v-$1" up; }

# ------------------------------------------------------------------ requests and references
PROMPTS=("In the beginning God created the heaven and the earth." "And the LORD spake unto Moses, saying,"
  "Blessed are the poor in spirit:" "The LORD is my shepherd; I shall not want."
  "And it came to pass in those days," "For God so loved the world,"
  "Then answered Jesus and said unto them," "Hear, O Israel:")
mkdir -p "$KRC_DIR/want" "$KRC_DIR/req"
# want I N: kvrelay-generate's greedy ids for prompt I and N tokens, in one process: the first N
# of a cached run of max(N, 48) tokens (greedy ids do not depend on max_tokens)
want() {
  local n=$(($2 > 48 ? $2 : 48))
  local f=$KRC_DIR/want/$1.$n
  [ -s "$f" ] || "$bin/kvrelay-generate" --model "$model" --prompt "${PROMPTS[$1]}" --max-tokens "$n" --greedy \
    --threads 1 --json 2>"$f.err" >"$f"
  "$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["ids"][:int(sys.argv[2])])' "$f" "$2"
}
long=1000
# the one-process references, made while the cluster starts (kvrelay-generate needs no network)
(for ((i = 0; i < ${#PROMPTS[@]}; i++)); do want "$i" 48; done) >/dev/null 2>&1 &
refs_pid=$!
(want 0 $long; want 1 $long) >/dev/null 2>&1 &
refs_long_pid=$!

# ------------------------------------------------------------------ the cluster
E=${ADDR[etcd]}
krc_spawn etcd ip netns exec "$tag-etcd" /usr/bin/etcd --name e0 --data-dir "$KRC_DIR/etcd" \
  --listen-client-urls "http://$E:2379" --advertise-client-urls "http://$E:2379" \
  --listen-peer-urls "http://$E:2380" --initial-advertise-peer-urls "http://$E:2380" \
  --initial-cluster "e0=http://$E:2380"
ectl() { nsx client etcdctl --endpoints "$E:2379" --dial-timeout 2s --command-timeout 2s "$@"; }
for ((i = 0; i < 100; i++)); do ectl endpoint health >/dev/null 2>&1 && break; sleep 0.1; done
ectl endpoint health >/dev/null 2>&1 || { fail "etcd does not answer across the bridge (log: $KRC_DIR/etcd.log)"; exit 1; }

ttl=3
reg=(--etcd "$E:2379" --cluster netns --lease-ttl $ttl)
# UCX over TCP on the veth: sockaddr connections need tcp, and UCX_NET_DEVICES keeps its TCP
# lanes on eth0 (not lo, whose 127.0.0.1 would mean another namespace on the far side)
ucx=(env UCX_TLS=tcp UCX_NET_DEVICES=eth0)
for r in decode-0 decode-1; do
  a=${ADDR[$r]}
  krc_spawn "$r" ip netns exec "$tag-$r" "${ucx[@]}" "$bin/kvrelay-decode" --model "$model" --id "$r" \
    --listen "$a:7000" --transfer "$a:7001" --http "$a:7002" --threads 1 --kv-blocks 8000 "${reg[@]}"
done
for r in prefill-0 prefill-1; do
  a=${ADDR[$r]}
  krc_spawn "$r" ip netns exec "$tag-$r" "${ucx[@]}" "$bin/kvrelay-prefill" --model "$model" --id "$r" \
    --listen "$a:7000" --http "$a:7002" --threads 1 "${reg[@]}"
done
R=${ADDR[router]}
# --prefill-timeout-ms 10000: a reservation orphaned by a partition (its Reserve arrived, the
# answer did not) expires within that + 5 s, inside the 20 s the leak checks wait
krc_spawn router ip netns exec "$tag-router" "$bin/kvrelay-router" --model "$model" --id router \
  --etcd "$E:2379" --cluster netns --listen "$R:7000" --http "$R:7002" --migrate --decode-stall-ms 2000 \
  --prefill-timeout-ms 10000
for ((i = 0; i < ${#KRC_IDS[@]}; i++)); do
  [ "${KRC_IDS[$i]}" = etcd ] && continue
  KRC_START_TIMEOUT=600 krc_wait_serving "${KRC_IDS[$i]}" "${KRC_PIDS[$i]}" >/dev/null ||
    { fail "${KRC_IDS[$i]} did not start"; exit 1; }
done

cli() { nsx client "$bin/kvrelay-cli" --router "$R:7000" "$@"; }
status_json() { cli status --json 2>/dev/null; }
node_state() { status_json | kr_status_field "$1" state 2>/dev/null; }
# wait_state ID SECONDS STATE... : prints the time once the router shows the node in one of them
wait_state() {
  local id=$1 end=$(($(date +%s) + $2)) st w
  shift 2
  while [ "$(date +%s)" -le $end ]; do
    st=$(node_state "$id")
    for w in "$@"; do [ "$st" = "$w" ] && { now; return 0; }; done
    sleep 0.1
  done
  return 1
}
# log_at FILE AFTER PATTERN [line]: the time (epoch s) of the first line of FILE matching the extended
# regex PATTERN logged after AFTER (epoch s), or the line itself; the logs' timestamps are UTC
# with milliseconds
log_at() {
  "$py" - "$@" <<'PY'
import datetime, re, sys
after = float(sys.argv[2])
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z ", line)
    if not m or not re.search(sys.argv[3], line):
        continue
    t = datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp()
    if t >= after - 0.001:
        print(line.rstrip() if len(sys.argv) > 4 else "%.3f" % t)
        break
else:
    sys.exit(1)
PY
}
metrics() { nsx client curl -s --max-time 2 "http://${ADDR[$1]}:7002/metrics"; }
# blocks_zero WHAT NODE: used and reserved KV blocks back to 0 (polls up to 20 s); prints the time
blocks_zero() {
  local m end=$(($(date +%s) + 20))
  while [ "$(date +%s)" -le $end ]; do
    m=$(metrics "$2")
    [ "$(metric kvrelay_kv_blocks_used "$m")" = 0 ] && [ "$(metric kvrelay_kv_blocks_reserved "$m")" = 0 ] && { now; return 0; }
    sleep 0.1
  done
  fail "$1: $2 still holds KV blocks: $(grep -E '^kvrelay_kv_blocks_(used|reserved) ' <<<"$m" | tr '\n' ' ')" >&2
  return 1
}
field() { "$py" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval("d" + sys.argv[2]))' "$1" "$2" 2>/dev/null; }

for r in prefill-0 prefill-1 decode-0 decode-1; do
  wait_state "$r" 20 serving >/dev/null || fail "the router does not show $r serving (membership from etcd)"
done
echo "cluster up across namespaces $tag-*: etcd $E, router $R, prefill ${ADDR[prefill-0]} ${ADDR[prefill-1]}, decode ${ADDR[decode-0]} ${ADDR[decode-1]} (logs in $KRC_DIR)"
echo "decode-1 as etcd has it: $(ectl get --print-value-only /kvrelay/netns/nodes/decode/decode-1)"

# req NAME I N: one greedy request of prompt I from the client namespace (background); the
# outcome in req/NAME.{got,err,rc}
CLIENTS=()
req() {
  (cli generate --prompt "${PROMPTS[$2]}" --max-tokens "$3" --timeout-ms 60000 --json \
     >"$KRC_DIR/req/$1.got" 2>"$KRC_DIR/req/$1.err"
   echo $? >"$KRC_DIR/req/$1.rc") &
  CLIENTS+=($!)
}
# check NAME I N WHAT: request NAME succeeded with the one-process ids
check() {
  local got
  [ "$(cat "$KRC_DIR/req/$1.rc")" = 0 ] || { fail "$4: request $1 failed: $(tail -n1 "$KRC_DIR/req/$1.err")"; return 1; }
  got=$(field "$KRC_DIR/req/$1.got" '["ids"]')
  [ "$got" = "$(want "$2" "$3")" ] || { fail "$4: request $1 (prompt $2): $got differs from kvrelay-generate $(want "$2" "$3")"; return 1; }
}
by() { field "$KRC_DIR/req/$1.got" "[\"usage\"][\"served_by\"][\"$2\"]"; }
ttft_ms() { "$py" -c 'import json,sys; print("%.1f" % (json.load(open(sys.argv[1]))["usage"]["ttft_s"] * 1000))' "$KRC_DIR/req/$1.got"; }
median() { tr ' ' '\n' | sort -n | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)]; else print "-" }'; }

# ---- (0) correct across the bridge; every node serves
wait "$refs_pid"
declare -A SEEN=()
for round in 0 1 2; do
  for ((i = 0; i < ${#PROMPTS[@]}; i++)); do req "r$round.$i" "$i" 48; done
  kr_wait_clients
  for ((i = 0; i < ${#PROMPTS[@]}; i++)); do
    check "r$round.$i" "$i" 48 "(0)" && SEEN[$(by "r$round.$i" prefill_node)]=1 && SEEN[$(by "r$round.$i" decode_node)]=1
  done
  [ -n "${SEEN[prefill-0]:-}" ] && [ -n "${SEEN[prefill-1]:-}" ] && [ -n "${SEEN[decode-0]:-}" ] && [ -n "${SEEN[decode-1]:-}" ] && break
done
for r in prefill-0 prefill-1 decode-0 decode-1; do [ -n "${SEEN[$r]:-}" ] || fail "(0) $r served no request"; done
# ttft_run TAG: TTFT of 4 requests one at a time (no queueing); prints "median (each)"
ttft_run() {
  local i ts=()
  for ((i = 0; i < 4; i++)); do
    req "$1$i" "$i" 8
    kr_wait_clients
    check "$1$i" "$i" 8 "TTFT run $1" && ts+=("$(ttft_ms "$1$i")")
  done
  echo "$(echo "${ts[*]}" | median) ms (${ts[*]})"
}
ttft0=$(ttft_run t)
echo "(0) ${#PROMPTS[@]} concurrent requests x $((round + 1)) equal kvrelay-generate; served by: ${!SEEN[*]}; TTFT over the bridge, one request at a time: median $ttft0"

# ---- (1) delay and loss on the prefill nodes' links
netem_err=$(tc -n "$tag-client" qdisc add dev lo root netem delay 1ms 2>&1)
netem_ok=$?
tc -n "$tag-client" qdisc del dev lo root 2>/dev/null
if [ $netem_ok != 0 ]; then
  echo "(1) SKIPPED: no tc netem here (tc: ${netem_err:-tc missing}; the kernel lacks sch_netem): no delay or loss added"
else
  # on eth0 of both prefill nodes: every packet they send (to decode nodes over UCX, answers to
  # the router) waits 20 ms and 1% are lost
  for r in prefill-0 prefill-1; do tc -n "$tag-$r" qdisc add dev eth0 root netem delay 20ms loss 1% || fail "(1) netem on $r"; done
  ttft1=$(ttft_run n)
  for ((i = 0; i < ${#PROMPTS[@]}; i++)); do req "nc$i" "$i" 48; done
  kr_wait_clients
  for ((i = 0; i < ${#PROMPTS[@]}; i++)); do check "nc$i" "$i" 48 "(1) concurrent"; done
  for r in prefill-0 prefill-1; do tc -n "$tag-$r" qdisc del dev eth0 root; done
  echo "(1) netem delay 20ms loss 1% on the prefill nodes' links: ${#PROMPTS[@]} concurrent requests still equal kvrelay-generate; TTFT median $ttft1, against $ttft0 without"
fi

# ---- (2) a partitioned decode node
# transitions of node $1 at the router after time $2, from its log: "unreachable suspect gone serving"
transitions() {
  local w t out=
  for w in unreachable suspect gone serving; do
    t=$(log_at "$KRC_DIR/router.log" "$2" "node $1 \\(.*-> $w") && out+="$(elapsed "$2" "$t") $w"$'\n'
  done
  echo " $(sort -n <<<"$out" | awk 'NF { printf "%s%s %s s", (n++ ? ", " : ""), $2, $1 }')"
}
# (a) while it holds no request: the router's Status polls fail (400 ms timeout), 3 failures open
# its breaker, and its etcd lease (TTL 3 s) expires too; requests sent at the cut succeed
blocks_zero "(2) before" decode-1 >/dev/null
t0=$(now)
part decode-1
for ((i = 0; i < 4; i++)); do req "pa$i" "$i" 24; done
wait_state decode-1 15 suspect gone >/dev/null || fail "(2) the router does not show decode-1 suspect or gone 15 s into its partition: $(node_state decode-1)"
kr_wait_clients
for ((i = 0; i < 4; i++)); do
  check "pa$i" "$i" 24 "(2) during the partition" && [ "$(by "pa$i" decode_node)" != decode-0 ] &&
    fail "(2) request pa$i was served by $(by "pa$i" decode_node) during its partition"
done
log_at "$KRC_DIR/router.log" "$t0" "node decode-1 \\(.*-> (suspect|gone)" >/dev/null || fail "(2) the router logged no suspect/gone for decode-1"
echo "(2) decode-1 partitioned while idle; at the router after the cut:$(transitions decode-1 "$t0"); 4 requests sent at the cut all equal kvrelay-generate, served by decode-0"
t1=$(now)
unpart decode-1
wait_state decode-1 20 serving >/dev/null || fail "(2) decode-1 not serving 20 s after the partition healed"
# a Reserve that reached decode-1 at the cut but whose answer was lost holds blocks until its TTL;
# while it does, least-loaded placement rightly prefers decode-0: wait for the pools to be equal
blocks_zero "(2) after the heal" decode-1 >/dev/null
used=0
for ((i = 0; i < 8 && used == 0; i++)); do
  req "pb$i" $((i % 4)) 24
  kr_wait_clients
  check "pb$i" $((i % 4)) 24 "(2) after healing" && [ "$(by "pb$i" decode_node)" = decode-1 ] && used=1
done
[ $used = 1 ] || fail "(2) no request went to decode-1 after the partition healed"
echo "(2) healed (partition of $(elapsed "$t0" "$t1") s); after the heal:$(transitions decode-1 "$t1"); used again: $used"

# (b) a request streaming from decode-1 when it is cut: the router's stall timeout
# (--decode-stall-ms 2000) ends that stream and --migrate continues it on decode-0
m_before=$(grep -c "migrating:" "$KRC_DIR/router.log")
req s0 0 $long
req s1 1 $long
on1=0 end=$(($(date +%s) + 10))
while [ "$(date +%s)" -le $end ]; do
  m=$(metric kvrelay_running_sequences "$(metrics decode-1)")
  [ -n "$m" ] && [ "$m" != 0 ] && { on1=1; break; }
  sleep 0.05
done
[ $on1 = 1 ] || fail "(2) no request streamed from decode-1"
t0=$(now)
part decode-1
kr_wait_clients
t_end=$(now)
wait "$refs_long_pid"
check s0 0 $long "(2) streaming"
check s1 1 $long "(2) streaming"
migrated=$(($(grep -c "migrating:" "$KRC_DIR/router.log") - m_before))
[ $migrated -gt 0 ] || fail "(2) no stream was migrated off the partitioned decode-1"
t_mig=$(log_at "$KRC_DIR/router.log" "$t0" "migrating: decode node decode-1")
echo "(2) decode-1 partitioned while streaming ($long-token answers): $migrated stream(s) migrated to decode-0 $(elapsed "$t0" "${t_mig:-$t0}") s after the cut, both equal kvrelay-generate, clients done $(elapsed "$t0" "$t_end") s after the cut; at the router:$(transitions decode-1 "$t0")"
t1=$(now)
unpart decode-1
wait_state decode-1 20 serving >/dev/null || fail "(2) decode-1 not serving 20 s after the second partition healed"
t_free=$(blocks_zero "(2) after healing" decode-1) || fails=$((fails + 1)) # its own count was the subshell's
blocks_zero "(2) after healing" decode-0 >/dev/null
echo "(2) healed (partition of $(elapsed "$t0" "$t1") s); after the heal:$(transitions decode-1 "$t1"); decode-1's KV blocks all free (used 0, reserved 0) $(elapsed "$t1" "${t_free:-$t1}") s after"

# ---- (3) etcd partitioned for longer than the lease TTL
keys() { nsx etcd etcdctl --endpoints "$E:2379" --dial-timeout 1s --command-timeout 1s get --prefix --keys-only /kvrelay/netns/nodes/ 2>/dev/null | grep -c .; }
node_states() {
  status_json | "$py" -c 'import json,sys; print(" ".join(sorted(n["id"] + "=" + n["state"] for n in json.load(sys.stdin)["nodes"] if n["id"] in ("prefill-0", "prefill-1", "decode-0", "decode-1"))))'
}
all_serving="decode-0=serving decode-1=serving prefill-0=serving prefill-1=serving"
wait_state decode-1 10 serving >/dev/null
[ "$(keys)" = 4 ] || fail "(3) etcd does not hold the 4 member keys before the partition: $(keys)"
t0=$(now)
part etcd
ok=0 n=0 t_exp=
while :; do
  req "e$n" $((n % ${#PROMPTS[@]})) 16
  kr_wait_clients
  check "e$n" $((n % ${#PROMPTS[@]})) 16 "(3) during the etcd partition" && ok=$((ok + 1))
  n=$((n + 1))
  # etcd's own view, asked inside its namespace (its address is local there: no bridge)
  [ -z "$t_exp" ] && [ "$(keys)" = 0 ] && t_exp=$(now)
  [ -n "$t_exp" ] && [ "$(elapsed "$t0" "$(now)" | cut -d. -f1)" -ge $((ttl + 3)) ] && break
  [ "$(elapsed "$t0" "$(now)" | cut -d. -f1)" -ge 15 ] && break
done
[ -n "$t_exp" ] || fail "(3) etcd still holds member keys $(elapsed "$t0" "$(now)") s into its partition (lease TTL $ttl s)"
states=$(node_states)
[ "$states" = "$all_serving" ] || fail "(3) the router does not keep its membership during the etcd partition: $states"
t1=$(now)
echo "(3) etcd partitioned for $(elapsed "$t0" "$t1") s: every member key gone from etcd (leases expired) $(elapsed "$t0" "${t_exp:-$t0}") s after the cut (TTL $ttl s); the router kept its last membership ($states); $ok of $n requests succeeded"
unpart etcd
ok=0 n=0 gap=0 t_reg= t_all=
while :; do
  req "h$n" $((n % ${#PROMPTS[@]})) 16
  kr_wait_clients
  if [ "$(cat "$KRC_DIR/req/h$n.rc")" != 0 ] && grep -q "no \(decode\|prefill\) node can take the request" "$KRC_DIR/req/h$n.err"; then
    gap=$((gap + 1))
  else
    check "h$n" $((n % ${#PROMPTS[@]})) 16 "(3) after the etcd partition healed" && ok=$((ok + 1))
  fi
  n=$((n + 1))
  [ -z "$t_reg" ] && [ "$(keys)" = 4 ] && t_reg=$(now)
  [ -n "$t_reg" ] && [ "$(node_states)" = "$all_serving" ] && { t_all=$(now); break; }
  [ "$(elapsed "$t1" "$(now)" | cut -d. -f1)" -ge 20 ] && break
done
[ -n "$t_reg" ] || fail "(3) the nodes did not register again within 20 s of etcd's partition healing ($(keys) keys)"
[ -n "$t_all" ] || fail "(3) the router does not show the four nodes serving after etcd's partition healed: $(node_states)"
t_gone=$(log_at "$KRC_DIR/router.log" "$t1" "node .* -> gone")
t_back=$(log_at "$KRC_DIR/router.log" "$t1" "is a member again")
echo "(3) healed: all 4 member keys back under new leases $(elapsed "$t1" "${t_reg:-$t1}") s after the heal; the router saw the expiries (nodes gone) at ${t_gone:+$(elapsed "$t1" "$t_gone") s} and the nodes back from ${t_back:+$(elapsed "$t1" "$t_back") s}; $ok of $n requests meanwhile succeeded"
if [ $gap -gt 0 ]; then
  # the router keeps placing a member whose lease expired while it still answers Status as
  # serving (RT_GONE_GRACE_MS): none of these may fail for want of a node
  fail "(3) $gap of $n requests right after etcd's partition healed failed 'no decode/prefill node can take the request', although every node was reachable and serving"
  log_at "$KRC_DIR/router.log" "$t1" "node .* -> gone" line | sed 's/^/  router: /'
  log_at "$KRC_DIR/router.log" "$t1" "no decode node can take" line | sed 's/^/  router: /'
fi
for r in decode-0 decode-1; do blocks_zero "(3) at the end" "$r" >/dev/null; done

[ $fails = 0 ] && echo "netns: all checks passed" || echo "netns: $fails failure(s)"
[ $fails = 0 ]
