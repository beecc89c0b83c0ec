#!/usr/bin/env bash
# adaptive.sh - kv_policy auto against fixed policies on a decode pool that binds
# (docs/benchmarks.md, "Adaptive compression"): goodput over a rate sweep and the quality each
# policy actually delivers under that load. One cluster of 1 prefill + 1 decode node, 1 thread
# each, serving the trained default model (models/kjv-2l128-2k, whose calibration.json the
# router loads) with prefill in 64-token chunks (the table's chunk). The decode pool holds 2
# requests of the longest kind under `full`.
#
# The mixed workload: prompts of 256 to 2048 tokens (uniform) cut from the model's held-out text
# with 512 output tokens each (ignore_eos), Poisson arrivals; beside it, at every rate,
# kvrelay-eval sends its retrieval (kv) and held-out text cases at 512, 1024 and 2048 tokens
# through the same router under the same policy (with `full` as its reference), so the quality
# is measured on the requests the loaded cluster served, not looked up in the table. For a
# fixed policy the quality cannot depend on the load (batch invariance: a sequence's output does
# not depend on its batch), and the script checks that it is the same at every rate; for auto it
# depends on what the router chose at the pressure it saw.
#
# Phases:
#   1. capacity: `full` under a closed loop of 24 clients for CAP s; the sweep's rates are
#      multiples of its request rate (0.5, 0.75, 1, 1.25, 1.5, 2x; --quick: 0.5, 1, 1.5, 2x);
#   2. per policy and rate: the load for RUN s and the evaluation beside it.
# Writes table.md, summary.json and adaptive.png (goodput and delivered kv score against the
# offered rate) to the output directory. Not a test: figures depend on the machine; run it on an
# idle one.
#
#   bench/experiments/adaptive.sh [--bin DIR] [--quick] [--out DIR]
#
# --bin DIR: built programs (default build/: ./kvrelay build). --quick: full, sage:budget=41 and
# auto only, CAP 30 s, RUN 40 s, 10 cases per task and length (about 12 minutes) instead of
# five policies, CAP 45 s, RUN 50 s and 20 cases (about 40 minutes). --out DIR: where results
# go (default bench/results/adaptive/).
#
# Policies: full; auto:floor=0.95,task=kv (the floor is stated for retrieval: the committed
# table proves no compressed point at 0.95 for copy or text, docs/adaptive.md); the two fixed
# specs that hold kv at 0.95 at every calibrated length with the fewest entries in their family
# (sage:budget=41, snapkv:mode=patched,budget=102,obs=16); and a cheap one that does not
# (streaming:sink=4,window=37, the same 41 entries).
# SLO: TTFT <= 2000 ms and TPOT <= 10 ms. Highest sustainable rate: the highest swept rate at
# which at least 90% of the load's requests were good, at this and every lower rate.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
exp_parse adaptive "$@"
[ -f "$EXP_MODEL/calibration.json" ] || {
  echo "adaptive: $EXP_MODEL has no calibration.json (docs/adaptive.md says how to make one)" >&2
  exit 2
}

PROMPT=256:2048 LONGEST=2048 OUTPUT=512 CHUNK=64 SLO=ttft_ms=2000,tpot_ms=10 CLIENTS=24 FLOOR=0.95
AUTO=auto:floor=$FLOOR,task=kv
POLICIES=(full "$AUTO" sage:budget=41 snapkv:mode=patched,budget=102,obs=16 streaming:sink=4,window=37)
if [ "$EXP_QUICK" = 1 ]; then
  POLICIES=("${POLICIES[@]:0:3}") MULTIPLES=(0.5 1 1.5 2) CAP=30 RUN=40 CASES=10
else
  MULTIPLES=(0.5 0.75 1 1.25 1.5 2) CAP=45 RUN=50 CASES=20
fi
# 2 x 4 = 8 (layer, KV head) lists; the longest full request takes ceil((2048 + 512) / 16) =
# 160 blocks of 16 entries per list: the pool holds 2 of them
LISTS=$("$EXP_PY" -c 'import json, sys
c = json.load(open(sys.argv[1])); print(c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]))' \
  "$EXP_MODEL/config.json")
KV_BLOCKS=$((2 * LISTS * ((LONGEST + OUTPUT + 15) / 16)))

KRC_PREFILL_ARGS=(--chunk "$CHUNK")
KRC_DECODE_ARGS=(--kv-blocks "$KV_BLOCKS")
machine=$(exp_machine)
exp_cluster_start adaptive 1 1 --threads 1
slug() { local s=${1%%:*}; [ "$1" = "$AUTO" ] && s=auto; echo "$s"; }
load() { # load POLICY OUT.json LOAD-FLAGS...
  local p=$1 f=$2; shift 2
  "$EXP_BENCH" --target "$KRC_ROUTER" "$@" --prompt-len "$PROMPT" --output-len "$OUTPUT" --ignore-eos \
    --policy "$p" --slo "$SLO" --timeout 600 --json "$f" --no-progress >"${f%.json}.txt"
}

f=$EXP_OUT/full-capacity.json
echo "adaptive: full, closed loop of $CLIENTS for $CAP s" >&2
load full "$f" --concurrency "$CLIENTS" --duration "$CAP" --warmup 2
read -ra RATES <<<"$("$EXP_PY" -c 'import json, sys
c = json.load(open(sys.argv[1]))["runs"][0]["summary"]["request_throughput"]
print(" ".join("%.3g" % (float(m) * c) for m in sys.argv[2:]))' "$f" "${MULTIPLES[@]}")"

runs=()
for p in "${POLICIES[@]}"; do
  s=$(slug "$p")
  for r in "${RATES[@]}"; do
    lf=$EXP_OUT/$s-$r.json qf=$EXP_OUT/$s-$r-quality.json
    echo "adaptive: $p at $r req/s for $RUN s, kvrelay-eval beside it" >&2
    load "$p" "$lf" --rate "$r" --duration "$RUN" --warmup 2 &
    lp=$!
    sleep 5 # the load's queue and pressure build before the first case
    t0=$(date +%s.%N)
    pol=(--no-sweep) # full, the reference, and the policy under test
    [ "$p" = full ] || pol+=(--policy "$p")
    if ! "$EXP_PY" "$EXP_HERE/tools/kvrelay-eval" --router "$KRC_ROUTER" --model "$EXP_MODEL" "${pol[@]}" \
      --tasks kv,text --lengths 512,1024,2048 --cases "$CASES" --concurrency 8 --timeout 600 \
      --out "$qf" --markdown /dev/null >"${qf%.json}.log" 2>&1; then
      echo "adaptive: kvrelay-eval failed beside $p at $r req/s (${qf%.json}.log)" >&2
      rm -f "$qf"
    fi
    t1=$(date +%s.%N)
    wait "$lp" || echo "adaptive: the load at $r req/s under $p failed (${lf%.json}.txt)" >&2
    runs+=("$p|$r|$lf|$qf|$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')")
  done
done
exp_cluster_stop

"$EXP_PY" "$EXP_HERE/bench/experiments/adaptive-report.py" "$EXP_OUT" "$machine" "$KV_BLOCKS" "$CHUNK" \
  "$FLOOR" "$RUN" "$EXP_OUT/logs/adaptive/decode-0.log" "${runs[@]}"
echo "adaptive: results in $EXP_OUT (table.md, summary.json, adaptive.png)" >&2
