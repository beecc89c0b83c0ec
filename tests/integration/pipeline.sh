#!/usr/bin/env bash
# pipeline.sh - layer-wise pipelining of the KV transfer changes when bytes move, never what the
# decode node computes. The same requests go through a cluster whose prefill node pipelines
# (--pipeline on: each layer sent as the last chunk makes it final) and through one that sends a
# whole bundle after the prefill (--pipeline off), on the 4-layer llama3 fixture with chunked
# prefill, for every policy family (TAKE with delayed eviction, heads and hsft with policy
# files) and with f32 and int8 wire payloads. Checks:
#   - every greedy output, its log-probabilities and the usage's entries, bytes and footprint
#     are identical between the two;
#   - the pipelined node sent every request in several parts (a segment per final group of
#     layers, TAKE's warm-up layers held back into one), the other in one;
#   - neither decode node holds a block afterwards.
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
wires=(f32 int8)

# run_all MODE: every policy x wire through a fresh cluster whose prefill node has --pipeline MODE
run_all() {
  local mode=$1 i=0 p w
  KRC_DIR=$work/$mode
  mkdir -p "$KRC_DIR/out"
  KRC_PREFILL_ARGS=(--chunk 32 --pipeline "$mode")
  KRC_DECODE_ARGS=()
  KRC_ROUTER_ARGS=(--policy-dir "$work/policies")
  KRC_START_TIMEOUT=1200 # tenths of a second: the sanitizer build loads slowly on 2 cores
  krc_start "$bin" "$model" 1 1 127.0.0.1:0 --threads 1 || fatal "the --pipeline $mode cluster did not start"
  for p in "${policies[@]}"; do
    for w in "${wires[@]}"; do
      "$bin/kvrelay-cli" --router "$KRC_ROUTER" generate --ids "$(kr_prompt "$i" $((90 + 7 * i)))" \
        --max-tokens 12 --policy "$p" --kv-wire-dtype "$w" --logprobs --json \
        --timeout-ms 300000 >"$KRC_DIR/out/$i.json" 2>"$KRC_DIR/out/$i.err" ||
        fail "--pipeline $mode, $p, $w: $(errmsg "$KRC_DIR/out/$i.err")"
      i=$((i + 1))
    done
  done
  kr_blocks_zero decode-0 100 || fail "--pipeline $mode: decode-0 still holds blocks: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
  # how many parts each bundle went in, from the prefill node's log
  grep -oE 'in [0-9]+ part\(s\)' "$KRC_DIR/prefill-0.log" | awk '{ print $2 }' >"$KRC_DIR/parts"
  krc_stop
}

run_all on
run_all off

n=$(( ${#policies[@]} * ${#wires[@]} ))
out=$("$py" - "$work" "$n" "${policies[@]}" <<'EOF'
import json, sys
work, n, policies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
bad = 0
for i in range(n):
    what = f"request {i} ({policies[i // 2]}, {'f32' if i % 2 == 0 else 'int8'})"
    try:
        on, off = (json.load(open(f"{work}/{m}/out/{i}.json")) for m in ("on", "off"))
    except Exception as e:
        print(f"FAIL: {what}: no JSON from kvrelay-cli ({e})")
        bad += 1
        continue
    for key in ("ids", "logprobs"):
        if on.get(key) != off.get(key):
            print(f"FAIL: {what}: {key} differ: pipelined {on.get(key)} vs whole bundle {off.get(key)}")
            bad += 1
    for key in ("kv_entries_shipped", "kv_bytes_shipped", "kv_footprint", "kv_wire_dtype"):
        if on["usage"].get(key) != off["usage"].get(key):
            print(f"FAIL: {what}: usage {key} {on['usage'].get(key)} vs {off['usage'].get(key)}")
            bad += 1
    if not on.get("ids") or not on.get("logprobs"):
        print(f"FAIL: {what}: no ids or log-probabilities: {on}")
        bad += 1
parts = {m: [int(x) for x in open(f"{work}/{m}/parts").read().split()] for m in ("on", "off")}
if len(parts["on"]) != n or min(parts["on"], default=0) < 2:
    print(f"FAIL: the pipelining node's parts per bundle: {parts['on']} (want {n} bundles, each in 2 or more)")
    bad += 1
if parts["off"] != [1] * n:
    print(f"FAIL: the --pipeline off node's parts per bundle: {parts['off']} (want {n} x 1)")
    bad += 1
print(f"{n - min(bad, n)} of {n} requests identical with and without pipelining; parts per pipelined bundle: {sorted(set(parts['on']))}")
EOF
)
echo "$out"
fails=$((fails + $(grep -c '^FAIL' <<<"$out")))
[ "$fails" = 0 ] || { echo "FAIL: $fails check(s)"; exit 1; }
echo "PASS: pipeline"
