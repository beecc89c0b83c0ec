#!/usr/bin/env bash
# decode-batch.sh - what batched decode buys through the cluster (docs/benchmarks.md, "Decode
# batches through the cluster"): 1 prefill + 1 decode node on the shape of
# tools/data/llama-110m.json with random bf16 weights (made by kvrelay-make-model), and a closed
# loop of 16 clients sending 512-token prompts for 128 output tokens, under `full` and under a
# patched SnapKV budget of 64. The decode pool is the node's default (every policy fits all 16
# sequences): this measures the decode step's batching, not memory; policy-memory.sh is the
# experiment where the pool binds. Two layouts of the nodes, each on a cluster of its own:
#   split      1 thread each, the nodes' defaults (each node a core's worth of work)
#   colocated  2 threads each, the decode node --cpu-sched idle (docs/cluster.md, "Co-located
#              nodes": a prompt takes every core at once, decode fills the time between)
#
# Each round runs every policy for DUR seconds on the same cluster; the rounds alternate the
# policies so that a drift of the machine shows as spread, not as a difference. Besides the
# client's figures, each run records the CPU seconds each node's process spent (from
# /proc/PID/stat), so that the table says which node is the bottleneck.
# Writes runs.json and table.md. Not a test: figures depend on the machine; run it on an idle
# one.
#
#   bench/experiments/decode-batch.sh [--bin DIR] [--quick] [--out DIR]
#
# --bin DIR: built programs (default build/: ./kvrelay build). --quick: 1 round of 30 s per
# policy and layout (about 4 minutes) instead of 3 rounds of 60 s (about 15 minutes). --out DIR: where
# results go (default bench/results/decode-batch/).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
exp_parse decode-batch "$@"
[ -x "$EXP_BIN/kvrelay-make-model" ] || { echo "decode-batch: $EXP_BIN has no kvrelay-make-model" >&2; exit 2; }

PROMPT=512 OUTPUT=128 CLIENTS=16
POLICIES=(full snapkv:mode=patched,budget=64,obs=8)
if [ "$EXP_QUICK" = 1 ]; then ROUNDS=1 DUR=30; else ROUNDS=3 DUR=60; fi
EXP_MODEL=$(mktemp -d -t kvrelay-decode-batch-model.XXXXXX)
"$EXP_BIN/kvrelay-make-model" --corpus "$EXP_HERE/tools/data/corpus.txt" --out "$EXP_MODEL" --vocab 8192 \
  --hidden 768 --layers 12 --heads 12 --kv-heads 4 --intermediate 2048 --dtype bf16 >/dev/null
trap 'exp_cluster_stop; rm -rf "$EXP_MODEL"' EXIT

machine=$(exp_machine)
cpu_s() { # cpu_s PID: user + system CPU seconds of the process so far
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"
}
runs=()
for layout in split colocated; do
  if [ "$layout" = split ]; then threads=1 KRC_DECODE_ARGS=(); else threads=2 KRC_DECODE_ARGS=(--cpu-sched idle); fi
  exp_cluster_start "decode-batch-$layout" 1 1 --threads "$threads"
  pre=$(krc_pid prefill-0) dec=$(krc_pid decode-0)
  for ((r = 1; r <= ROUNDS; r++)); do
    for p in "${POLICIES[@]}"; do
      f=$EXP_OUT/$layout-${p%%:*}-round$r.json
      echo "decode-batch: $layout, round $r/$ROUNDS, $p, closed loop of $CLIENTS for $DUR s" >&2
      p0=$(cpu_s "$pre") d0=$(cpu_s "$dec") t0=$(date +%s.%N)
      "$EXP_BENCH" --target "$KRC_ROUTER" --concurrency "$CLIENTS" --duration "$DUR" --warmup 4 \
        --prompt-len "$PROMPT" --output-len "$OUTPUT" --ignore-eos --policy "$p" --timeout 600 \
        --text "$EXP_HERE/tools/data/corpus.txt" --json "$f" --no-progress >"${f%.json}.txt"
      t1=$(date +%s.%N) p1=$(cpu_s "$pre") d1=$(cpu_s "$dec")
      runs+=("$layout" "$f" "$(echo "$p1 - $p0" | bc -l)" "$(echo "$d1 - $d0" | bc -l)" "$(echo "$t1 - $t0" | bc -l)")
    done
  done
  exp_cluster_stop
done

"$EXP_PY" - "$EXP_OUT" "$machine" "${runs[@]}" <<'PY'
import json, statistics, sys

out, machine = sys.argv[1:3]
args = sys.argv[3:]
rows, runs = [], []
for i in range(0, len(args), 5):
    layout, f = args[i], args[i + 1]
    pre_cpu, dec_cpu, wall = float(args[i + 2]), float(args[i + 3]), float(args[i + 4])
    d = json.load(open(f))
    s = d["runs"][0]["summary"]
    run = {"layout": layout, "policy": d["policies"][0], "file": f.rsplit("/", 1)[-1],
           "requests_per_s": s["request_throughput"], "output_tokens_per_s": s["output_token_throughput"],
           "ttft_p50": s["ttft_ms"]["p50"], "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"],
           "errors": sum(s["errors"].values()),
           "prefill_busy": pre_cpu / wall, "decode_busy": dec_cpu / wall, "wall_s": wall}
    runs.append(run)
    rows.append("| %s | `%s` | %s | %.2f | %.0f | %.0f | %.1f / %.1f | %.2f | %.2f | %d |" % (
        layout, run["policy"], run["file"].split("-round")[-1].split(".")[0], run["requests_per_s"],
        run["output_tokens_per_s"], run["ttft_p50"], run["tpot_p50"], run["tpot_p99"],
        run["prefill_busy"], run["decode_busy"], run["errors"]))
json.dump({"machine": machine, "runs": runs}, open(out + "/runs.json", "w"), indent=1)
by = {}
for r in runs:
    by.setdefault((r["layout"], r["policy"]), []).append(r["output_tokens_per_s"])
with open(out + "/table.md", "w") as t:
    t.write("Machine: %s\n\n" % machine)
    t.write("| layout | policy | round | req/s | output tok/s | TTFT p50 ms | TPOT p50 / p99 ms | prefill node busy | decode node busy | errors |\n")
    t.write("|---|---|---|---|---|---|---|---|---|---|\n")
    t.write("\n".join(rows) + "\n\n")
    for (l, p), v in by.items():
        t.write("- %s, `%s`: output tok/s median %.0f (%.0f-%.0f over %d rounds)\n" % (
            l, p, statistics.median(v), min(v), max(v), len(v)))
print(open(out + "/table.md").read())
PY
