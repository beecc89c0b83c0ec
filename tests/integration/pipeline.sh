#!/usr/bin/env bash
# pipeline.sh - layer-wise pipelining of the KV transfer, and putting it into the decode node's
# memory instead of sending it, change when and how bytes move, never what the decode node
# computes. The same requests go through a cluster whose prefill node pipelines (--pipeline on:
# each layer sent as the last chunk makes it final), one that sends a whole bundle after the
# prefill (--pipeline off), and one that pipelines into a decode node in RMA mode
# (--transfer-mode rma: each part put into the reservation's mapped buffer, or its K and V into
# the run of KV blocks the reservation took and mapped), on the 4-layer
# llama3 fixture with chunked prefill, for every policy family (TAKE with delayed eviction, heads
# and hsft with policy files) and with f32, bf16 (the fixture's cache dtype) and int8 wire
# payloads. Checks:
#   - every greedy output, its log-probabilities and the usage's entries, bytes and footprint
#     are identical between the three;
#   - the pipelined nodes moved every request in several parts (a segment per final group of
#     layers, TAKE's warm-up layers held back into one), the other in one; the RMA cluster's
#     were put, the others' sent;
#   - every decode node took some parts straight into its KV blocks (bf16 ones, the cache's
#     dtype, that the prefill node padded to the blocks: those whose lists are long enough for
#     the padding to cost little), received there or put there, and copied the others;
#   - no decode node holds a block afterwards, nor counts one as reserved (the RMA run's
#     unused blocks went back).
# Run: ctest -R pipeline, or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/pipeline.sh
set -uo pipefail

. "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh" # krc_*, fail, kr_*
bin=${KR_BIN:?KR_BIN must be the build directory}
fixtures=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli
kr_need_py "(the README's test command installs it)"
command -v curl >/dev/null || kr_skip "curl is missing"

work=$(mktemp -d -t kvrelay-pipeline-test.XXXXXX)
trap 'krc_stop; rm -rf "$work"' EXIT
model=$fixtures/models/llama3-tiny
mkdir -p "$work/policies"
# gates that make some KV heads dense and some streaming; short learned windows per layer
printf '0.00\t0.75\n0.50\t1.00\n0.25\t0.00\n1.00\t0.50\n' >"$work/policies/gates.tsv"
printf '6\n10\n14\n18\n' >"$work/policies/windows.txt"

policies=(full "streaming:sink=4,window=16,lazy=3" "streaming:sink=3,window=24,pos=rel"
  "snapkv:budget=24,obs=8,decode=window:8" "pyramidkv:obs=4,budget=32"
  "take:budget=24,warmup_budget=64,warmup_layers=2,probe=8" "sage:budget=32"
  "heads:pattern=gates.tsv,sparsity=0.5,sink=2,window=12"
  "hsft:windows=windows.txt,pattern=gates.tsv,budget=0.5,sink=2")
wires=(f32 bf16 int8)

# run_all NAME PIPELINE TRANSFER: every policy x wire through a fresh cluster whose prefill node
# has --pipeline PIPELINE and whose decode node has --transfer-mode TRANSFER; results in $work/NAME
run_all() {
  local name=$1 mode=$2 transfer=$3 i=0 p w
  KRC_DIR=$work/$name
  mkdir -p "$KRC_DIR/out"
  KRC_PREFILL_ARGS=(--chunk 32 --pipeline "$mode")
  KRC_DECODE_ARGS=(--transfer-mode "$transfer")
  KRC_ROUTER_ARGS=(--policy-dir "$work/policies")
  KRC_START_TIMEOUT=1200 # tenths of a second: the sanitizer build loads slowly on 2 cores
  krc_start "$bin" "$model" 1 1 127.0.0.1:0 --threads 1 || fatal "the $name cluster did not start"
  for p in "${policies[@]}"; do
    for w in "${wires[@]}"; do
      "$bin/kvrelay-cli" --router "$KRC_ROUTER" generate --ids "$(kr_prompt "$i" $((90 + 7 * i)))" \
        --max-tokens 12 --policy "$p" --kv-wire-dtype "$w" --logprobs --json \
        --timeout-ms 300000 >"$KRC_DIR/out/$i.json" 2>"$KRC_DIR/out/$i.err" ||
        fail "$name, $p, $w: $(errmsg "$KRC_DIR/out/$i.err")"
      i=$((i + 1))
    done
  done
  kr_blocks_zero decode-0 100 || fail "$name: decode-0 still holds blocks: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
  # how many parts each bundle went in, and how, from the prefill node's log
  grep -oE 'in [0-9]+ part\(s\)' "$KRC_DIR/prefill-0.log" | awk '{ print $2 }' >"$KRC_DIR/parts"
  grep -oE '(put into|sent to) reservation' "$KRC_DIR/prefill-0.log" | awk '{ print $1 }' >"$KRC_DIR/how"
  # and how the decode node took the parts: received into its KV blocks, or copied into them
  for landing in received copied; do
    metric "kvrelay_decode_bundle_parts_total{landing=\"$landing\"}" "$KR_METRICS" >"$KRC_DIR/$landing"
  done
  krc_stop
}

run_all on on am
run_all off off am
run_all rma on rma

n=$(( ${#policies[@]} * ${#wires[@]} ))
out=$("$py" - "$work" "$n" "${policies[@]}" <<'EOF'
import json, sys
work, n, policies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
bad = 0
for i in range(n):
    what = f"request {i} ({policies[i // 3]}, {('f32', 'bf16', 'int8')[i % 3]})"
    try:
        on, off, rma = (json.load(open(f"{work}/{m}/out/{i}.json")) for m in ("on", "off", "rma"))
    except Exception as e:
        print(f"FAIL: {what}: no JSON from kvrelay-cli ({e})")
        bad += 1
        continue
    for other, name in ((off, "whole bundle"), (rma, "put")):
        for key in ("ids", "logprobs"):
            if on.get(key) != other.get(key):
                print(f"FAIL: {what}: {key} differ: pipelined {on.get(key)} vs {name} {other.get(key)}")
                bad += 1
        for key in ("kv_entries_shipped", "kv_bytes_shipped", "kv_footprint", "kv_wire_dtype"):
            if on["usage"].get(key) != other["usage"].get(key):
                print(f"FAIL: {what}: usage {key} {on['usage'].get(key)} vs {name} {other['usage'].get(key)}")
                bad += 1
    if not on.get("ids") or not on.get("logprobs"):
        print(f"FAIL: {what}: no ids or log-probabilities: {on}")
        bad += 1
parts = {m: [int(x) for x in open(f"{work}/{m}/parts").read().split()] for m in ("on", "off", "rma")}
for m in ("on", "rma"):
    if len(parts[m]) != n or min(parts[m], default=0) < 2:
        print(f"FAIL: the {m} cluster's parts per bundle: {parts[m]} (want {n} bundles, each in 2 or more)")
        bad += 1
for m, want in (("on", "sent"), ("off", "sent"), ("rma", "put")):
    how = open(f"{work}/{m}/how").read().split()
    if how != [want] * n:
        print(f"FAIL: the {m} cluster's bundles went {how} (want {n} x {want})")
        bad += 1
# The bf16 parts with long enough lists (padded to the decode node's blocks, in its cache's
# dtype) land in the blocks, received as active messages or put by RMA into the run the
# reservation took; the rest are copied (f32 and int8 converted).
landings = {}
for m in ("on", "off", "rma"):
    got = landings[m] = {l: int(float(open(f"{work}/{m}/{l}").read() or -1)) for l in ("received", "copied")}
    if got["received"] <= 0 or got["copied"] <= 0 or got["received"] + got["copied"] < sum(parts[m]):
        print(f"FAIL: the {m} cluster's decode node took parts {got}: want some received into its "
              f"blocks, some copied, {sum(parts[m])} in all")
        bad += 1
if parts["off"] != [1] * n:
    print(f"FAIL: the --pipeline off node's parts per bundle: {parts['off']} (want {n} x 1)")
    bad += 1
print(f"{n - min(bad, n)} of {n} requests identical pipelined, whole and put; parts per pipelined bundle: {sorted(set(parts['on']))}; parts received into / copied into KV blocks: {landings}")
EOF
)
echo "$out"
fails=$((fails + $(grep -c '^FAIL' <<<"$out")))
[ "$fails" = 0 ] || { echo "FAIL: $fails check(s)"; exit 1; }
echo "PASS: pipeline"
