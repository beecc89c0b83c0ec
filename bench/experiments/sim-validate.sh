#!/usr/bin/env bash
# sim-validate.sh - tools/kvrelay-sim against real runs on this machine (docs/simulator.md,
# "Validation"): the same workload through a real cluster (kvrelay-bench-serve) and through the
# simulator (the same flags and seed, so the same arrivals and lengths; each figure the median of
# 9 jitter replicas, as the real ones are medians of repeats), 1 prefill + 1 decode
# and 2 + 2 nodes with 1 thread each, at two moderate Poisson rates (6 and 12 requests/s).
# Writes a table of TTFT and TPOT p50 / p90, goodput and throughput, real against simulated with
# the relative error, a plot, and every summary JSON. Not a test (real timings on a shared
# machine are noisy; the load average is recorded); tests/integration/simulator.sh re-simulates
# the committed 1 + 1 runs.
#
#   bench/experiments/sim-validate.sh [--bin DIR] [--quick] [--out DIR] [--profile FILE]
#                                     [--repeat N]
#
# --bin DIR: built programs (default build/). --quick: 10 s per rate instead of 20 (about 7
# minutes in all instead of 11, the calibration included). --out DIR: where results go (default
# bench/results/sim-validate/): table.md, sim-validate.png, real-P1-D1.json, sim-P1-D1.json, ... and the clusters' logs.
# --profile FILE: the simulator's profile; by default `kvrelay-sim calibrate` measures one first
# (profile.json in --out), so that calibration and the real runs see the same machine load.
# --repeat N: real runs per layout (default 5), each on a fresh cluster with the same arrivals;
# the table compares the simulation with the median over them and gives their spread (min-max),
# since on a shared machine one real run's tails move 50-70% from the next. real-P1-D1.json is
# that median (the format of one run), real-P1-D1-rK.json each run.
#
# Before each real run, on its fresh cluster, `kvrelay-sim probe --target` serves calibration's
# open loop for 10 s and compares its TTFT and TPOT with calibration's; each layout is simulated with --compute-scale the median of its runs' probes
# (probes.txt), so that the simulation costs what the machine did while the real runs ran.
#
# Requests: prompts uniform in 256..768 tokens, 128 output tokens, policy full, default chunk
# (512) and pool (1 GiB). SLO: TTFT <= 500 ms and TPOT <= 10 ms (as pd-ratio.sh).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
PROFILE= REPEAT=5
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --profile) [ $# -ge 2 ] || { echo "sim-validate: --profile needs a file" >&2; exit 2; }
      PROFILE=$2; shift 2 ;;
    --repeat) [[ ${2:-} =~ ^[1-9][0-9]?$ ]] || { echo "sim-validate: --repeat needs a count 1..99" >&2; exit 2; }
      REPEAT=$2; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
[ -z "$PROFILE" ] || [ -f "$PROFILE" ] || { echo "sim-validate: --profile $PROFILE: no such file" >&2; exit 2; }
exp_parse sim-validate "${args[@]+"${args[@]}"}"
if [ -z "$PROFILE" ]; then
  PROFILE=$EXP_OUT/profile.json
  "$EXP_PY" "$EXP_HERE/tools/kvrelay-sim" calibrate --bin "$EXP_BIN" --name sim-validate --out "$PROFILE" \
    2>"$EXP_OUT/logs/calibrate.txt" || { echo "sim-validate: calibration failed:" >&2; tail -n 5 "$EXP_OUT/logs/calibrate.txt" >&2; exit 1; }
fi

LAYOUTS=("1 1" "2 2")
RATES=6,12 WARMUP=5 SLO=ttft_ms=500,tpot_ms=10
DURATION=20
[ "$EXP_QUICK" = 1 ] && DURATION=10
LOAD=(--rate "$RATES" --duration "$DURATION" --warmup "$WARMUP" --prompt-len 256:768 --output-len 128
  --policy full --slo "$SLO" --seed 1)
machine=$(exp_machine)

for layout in "${LAYOUTS[@]}"; do
  read -r np nd <<<"$layout"
  tag=P$np-D$nd
  scales=()
  for ((k = 1; k <= REPEAT; k++)); do
    exp_cluster_start "$tag" "$np" "$nd" --threads 1
    # the cluster's speed now against the calibration's (a VM drifts 10-20% between minutes)
    probe=$("$EXP_PY" "$EXP_HERE/tools/kvrelay-sim" probe --target "$KRC_ROUTER" --profile "$PROFILE" \
      2>>"$EXP_OUT/logs/probe.txt") ||
      probe='{"compute_scale": 1}' # a profile without calibrate's loops (logs/probe.txt says why): as written
    echo "$tag r$k $probe" >>"$EXP_OUT/probes.txt"
    scales+=("$("$EXP_PY" -c 'import json, sys; print(json.loads(sys.argv[1])["compute_scale"])' "$probe")")
    "$EXP_BENCH" --target "$KRC_ROUTER" "${LOAD[@]}" --timeout 120 --json "$EXP_OUT/real-$tag-r$k.json" \
      --no-progress >"$EXP_OUT/logs/real-$tag-r$k.txt"
    exp_cluster_stop
  done
  scale=$("$EXP_PY" -c 'import statistics, sys; print(statistics.median(map(float, sys.argv[1:])))' "${scales[@]}")
  "$EXP_PY" "$EXP_HERE/tools/kvrelay-sim" run --profile "$PROFILE" --prefill "$np" --decode "$nd" \
    "${LOAD[@]}" --replicas 9 --compute-scale "$scale" --json "$EXP_OUT/sim-$tag.json" --no-progress \
    >"$EXP_OUT/logs/sim-$tag.txt"
done
echo "$machine, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end" >"$EXP_OUT/machine.txt"

"$EXP_PY" - "$EXP_OUT" "$(cat "$EXP_OUT/machine.txt")" "$PROFILE" "$EXP_HERE/tools/kvrelay-sim" "$REPEAT" <<'PY'
import importlib.machinery, importlib.util, json, os, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plots import save_png

out, machine, profile, tool, repeat = sys.argv[1:6]
repeat = int(repeat)


def spread(docs, run_index, metric):
    """min-max over the repeats of one compare_runs metric, as text."""
    vals = []
    for d in docs:
        for run, m, a, _b, _e in sim.compare_runs(d, d):
            if m == metric and run == run_index:
                vals.append(a)
    return "%.2f-%.2f" % (min(vals), max(vals)) if vals else ""
loader = importlib.machinery.SourceFileLoader("kvrelay_sim", tool)  # its compare_runs: one comparison
sim = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
loader.exec_module(sim)
prof = json.load(open(profile))
scales = {}
for tag in ("P1-D1", "P2-D2"):
    scales[tag] = json.load(open(os.path.join(out, "sim-%s.json" % tag)))["sim"]["compute_scale"]
lines = ["Machine: %s. Profile `%s` (host.background %.2f, measured at calibration). Prompts 256..768 tokens (uniform), 128 output tokens, policy full, "
         "1 thread per node, Poisson arrivals; SLO TTFT <= 500 ms, TPOT <= 10 ms. Real: the median of %d runs "
         "(each on a fresh cluster, the same arrivals), their range beside it. Simulated: the median of 9 jitter "
         "replicas, compute costs scaled by the cluster probe before the real runs (1+1: %.3f, 2+2: %.3f)."
         % (machine, os.path.basename(profile), prof["host"].get("background", 0.0), repeat,
            scales["P1-D1"], scales["P2-D2"]),
         "", "| P+D | rate | metric | real | real range | simulated | error |", "|---|---|---|---|---|---|---|"]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
worst = 0.0
for tag in ("P1-D1", "P2-D2"):
    reps = [json.load(open(os.path.join(out, "real-%s-r%d.json" % (tag, k)))) for k in range(1, repeat + 1)]
    real = sim.median_of(reps)
    with open(os.path.join(out, "real-%s.json" % tag), "w") as f:
        json.dump(real, f, indent=1)
    simd = json.load(open(os.path.join(out, "sim-%s.json" % tag)))
    label = tag[1:].replace("-D", "+")
    for run, metric, a, b, err in sim.compare_runs(real, simd):
        worst = max(worst, err)
        lines.append("| %s | %s | %s | %.2f | %s | %.2f | %.1f%% |" % (label, run.split()[1], metric, a,
                                                                     spread(reps, run, metric), b, 100 * err))
    for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
        for d, style, who in ((real, "o-", "real"), (simd, "s--", "sim")):
            rates = [r["mode"]["rate"] for r in d["runs"]]
            for q, c in (("p50", "C0" if tag == "P1-D1" else "C1"), ("p90", "C2" if tag == "P1-D1" else "C3")):
                ax.plot(rates, [r["summary"][key][q] for r in d["runs"]], style, color=c, ms=4,
                        label="%s %s %s" % (label, q, who))
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel(key.replace("_ms", " (ms)").upper())
        ax.grid(alpha=0.3)
axes[0].legend(fontsize=6, ncol=2)
fig.suptitle("kvrelay-sim against real runs (solid: real, dashed: simulated)", fontsize=9)
fig.tight_layout()
save_png(fig, os.path.join(out, "sim-validate.png"))
lines.append("")
lines.append("Worst relative error: %.1f%%." % (100 * worst))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "sim-validate: results in $EXP_OUT (table.md, sim-validate.png, real-*.json, sim-*.json)" >&2
