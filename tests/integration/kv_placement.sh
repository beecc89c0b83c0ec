#!/usr/bin/env bash
# kv_placement.sh - kv-aware placement (docs/prefix-cache.md, "Placement") sends a prompt to the
# prefill node whose prefix cache holds its beginning, where round-robin spreads it. A cluster of
# 2 prefill nodes (--chunk 32, which the router takes from their Status) and 1 decode node on the 4-layer
# llama3 fixture gets 9 requests one after another: 3 documents of 96 tokens (3 chunks), each
# asked 3 different 20-token questions, documents in turn (D0 D1 D2 D0 D1 D2 D0 D1 D2). A
# prefill node keeps the state at a prompt's last chunk boundary, here the document, so a
# question hits when its document's earlier question was prefilled on the same node. Checks:
#   - kv-aware: every document's questions go to one node; the 6 later questions each reuse 96
#     tokens (the router's kvrelay_prompt_tokens_cached_total 576, its log line per request),
#     exactly as predicted (kvrelay_placement_predicted_cached_tokens_total 576); placements
#     counted 6 by reason prefix, 3 no_prefix; kvrelay-cli status shows the nodes' caches;
#   - round-robin on the same requests alternates the nodes and reuses less (288 here: only a
#     document's third question finds it where its first went);
#   - the node holding a document restarted (SIGKILL, same address): the router forgets what it
#     sent there, the document's next question is placed with no prefix predicted, the one after
#     it with 96 predicted and reused;
#   - no KV block held afterwards by the decode node.
# Run: ctest -R kv_placement, or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/kv_placement.sh
set -uo pipefail

. "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh" # krc_*, fail, kr_*
bin=${KR_BIN:?KR_BIN must be the build directory}
fixtures=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli
kr_need_py "(the README's test command installs it)"
command -v curl >/dev/null || kr_skip "curl is missing"

work=$(mktemp -d -t kvrelay-kv-placement-test.XXXXXX)
trap 'krc_stop; rm -rf "$work"' EXIT
model=$fixtures/models/llama3-tiny

# question DOC Q: document DOC's 96 tokens then question Q's 20
question() { echo "$(kr_prompt $((70 + $1)) 96) $(kr_prompt $((80 + 10 * $1 + $2)) 20)"; }

# rmetric NAME [LABELS]: the router's metric, 0 when absent
rmetric() {
  local name=$1
  [ -z "${2:-}" ] || name="$1{$2}"
  curl -s --max-time 2 "http://$KRC_ROUTER_HTTP/metrics" | awk -v m="$name" '$1 == m { v = $2 } END { print v + 0 }'
}

# ask NAME I DOC Q: one greedy request; its answer in $KRC_DIR/out/I.json, its prefill node in
# SERVED ("?" when it failed)
ask() {
  SERVED="?"
  "$bin/kvrelay-cli" --router "$KRC_ROUTER" generate --ids "$(question "$3" "$4")" --max-tokens 4 --json \
    --timeout-ms 300000 >"$KRC_DIR/out/$2.json" 2>"$KRC_DIR/out/$2.err" ||
    { fail "$1: request $2 (document $3, question $4): $(errmsg "$KRC_DIR/out/$2.err")"; return; }
  SERVED=$(kr_served_by "$KRC_DIR/out/$2.json" prefill_node)
}

# start NAME PLACEMENT: a fresh cluster
start() {
  KRC_DIR=$work/$1
  mkdir -p "$KRC_DIR/out"
  KRC_PREFILL_ARGS=(--chunk 32)
  KRC_DECODE_ARGS=()
  # kv-aware learns the chunk from the nodes' Status; round-robin is given it
  KRC_ROUTER_ARGS=(--placement "$2")
  [ "$2" = kv-aware ] || KRC_ROUTER_ARGS+=(--prefill-chunk 32)
  KRC_START_TIMEOUT=1200 # tenths of a second: the sanitizer build loads slowly on 2 cores
  krc_start "$bin" "$model" 2 1 127.0.0.1:0 --threads 1 || fatal "the $1 cluster did not start"
  [ "$2" = kv-aware ] || return 0
  local i
  for ((i = 0; i < 300; i++)); do
    grep -q "kv-aware placement: prefill chunk 32, as node prefill-[01] reports" "$KRC_DIR/router.log" && return 0
    sleep 0.1
  done
  fatal "the router did not take the prefill nodes' chunk (32) from their Status"
}

# run NAME: the 9 requests, documents in turn; the prefill node of each in NODES[DOC] (space-separated)
run() {
  local i=0 q d
  NODES=("" "" "")
  for q in 0 1 2; do
    for d in 0 1 2; do
      ask "$1" $i $d $q
      NODES[$d]+="$SERVED "
      i=$((i + 1))
    done
  done
}

# ---- kv-aware
start kv kv-aware
run kv-aware
for d in 0 1 2; do
  read -r -a got <<<"${NODES[$d]}"
  [ "${#got[@]}" = 3 ] && [ "${got[0]}" = "${got[1]}" ] && [ "${got[1]}" = "${got[2]}" ] ||
    fail "kv-aware: document $d's questions went to '${NODES[$d]}', want one node"
done
kv_cached=$(rmetric kvrelay_prompt_tokens_cached_total)
kv_predicted=$(rmetric kvrelay_placement_predicted_cached_tokens_total)
by_prefix=$(rmetric kvrelay_placements_total 'reason="prefix"')
by_none=$(rmetric kvrelay_placements_total 'reason="no_prefix"')
[ "$kv_cached" = 576 ] || fail "kv-aware: $kv_cached prompt tokens from the prefix caches, want 576 (6 x 96)"
[ "$kv_predicted" = 576 ] || fail "kv-aware: $kv_predicted tokens predicted cached, want 576"
[ "$by_prefix" = 6 ] && [ "$by_none" = 3 ] ||
  fail "kv-aware: placements by prefix $by_prefix, no_prefix $by_none; want 6 and 3"
usage_cached=$("$py" -c 'import json, sys; print(sum(json.load(open(f))["usage"]["cached_tokens"] for f in sys.argv[1:]))' \
  "$KRC_DIR"/out/[0-8].json)
[ "$usage_cached" = 576 ] || fail "kv-aware: the answers' usage.cached_tokens sum to $usage_cached, want 576"
[ "$(grep -c "finished: .* prompt (96 cached)" "$KRC_DIR/router.log")" = 6 ] ||
  fail "kv-aware: the router's finish lines do not say 96 cached tokens for 6 requests"
logged=$(grep -c "from its prefix cache (placement predicted 96)" "$KRC_DIR/router.log")
[ "$logged" = 6 ] || fail "kv-aware: $logged router log lines of a prefix reused as predicted, want 6"
status=$("$bin/kvrelay-cli" --router "$KRC_ROUTER" status --json)
reused=$("$py" -c 'import json, sys; print(sum(n["prefix_cache_tokens_reused"] for n in json.load(sys.stdin)["nodes"]))' <<<"$status")
[ "$reused" = 576 ] || fail "kv-aware: kvrelay-cli status --json sums $reused tokens reused over the nodes, want 576"
table=$("$bin/kvrelay-cli" --router "$KRC_ROUTER" status)
[ "$(grep -cE '^prefill-[01] .* states .* MiB, [0-9]+/[0-9]+ hits, [0-9]+ tokens reused$' <<<"$table")" = 2 ] ||
  fail "kvrelay-cli status does not show both prefill nodes' prefix caches: $table"

# the node holding document 0 restarts: forgotten, then learnt again
read -r -a got <<<"${NODES[0]}"
holder=${got[0]}
krc_signal "$holder" KILL
krc_restart "$holder" --listen "$(krc_addr "$holder")" --http "$(krc_http "$holder")" || fatal "$holder did not restart"
for ((t = 0; t < 300; t++)); do
  grep -q "node $holder: it restarted: forgetting" "$KRC_DIR/router.log" && break
  sleep 0.1
done
grep -q "node $holder: it restarted: forgetting the [0-9]* prompt blocks placed there" "$KRC_DIR/router.log" ||
  fail "the router did not forget what it sent to the restarted $holder"
kr_wait_state "$KRC_ROUTER" "$holder" 30 serving >/dev/null || fail "the router does not see $holder serving again"
before=$(rmetric kvrelay_placement_predicted_cached_tokens_total)
ask restart 9 0 3
after=$(rmetric kvrelay_placement_predicted_cached_tokens_total)
none=$(rmetric kvrelay_placements_total 'reason="no_prefix"')
[ "$after" = "$before" ] && [ "$none" = 4 ] ||
  fail "after the restart: predicted $before -> $after tokens, no_prefix placements $none; want nothing predicted, 4"
cached_before=$(rmetric kvrelay_prompt_tokens_cached_total)
ask restart 10 0 4
[ "$(rmetric kvrelay_placement_predicted_cached_tokens_total)" = $((after + 96)) ] &&
  [ "$(rmetric kvrelay_prompt_tokens_cached_total)" = $((cached_before + 96)) ] ||
  fail "after the restart, document 0's next question: predicted and reused should both grow by 96"
kr_blocks_zero decode-0 100 || fail "kv-aware: decode-0 still holds blocks: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
krc_stop

# ---- round-robin on the same requests
start rr round-robin
run round-robin
rr_cached=$(rmetric kvrelay_prompt_tokens_cached_total)
[ "$(rmetric kvrelay_placements_total 'reason="no_prefix"')" = 0 ] || fail "round-robin counted kv-aware placements"
[ "$rr_cached" -lt "$kv_cached" ] || fail "round-robin reused $rr_cached tokens, kv-aware $kv_cached: want fewer"
kr_blocks_zero decode-0 100 || fail "round-robin: decode-0 still holds blocks"
krc_stop

echo "prompt tokens from the prefill nodes' prefix caches over 9 requests: kv-aware $kv_cached (predicted $kv_predicted), round-robin $rr_cached"
[ "$fails" = 0 ] || { echo "FAIL: $fails check(s)"; exit 1; }
echo "PASS: kv_placement"
