#!/usr/bin/env bash
# pd-ratio.sh - goodput and latency of three prefill:decode layouts (docs/benchmarks.md,
# "P:D ratio"): 1:1, 1:2 and 2:1 nodes on the default model, every node with 1 thread, one KV
# policy (full), the same Poisson rate sweep against each layout in turn (a fresh cluster per
# layout). Writes a table of goodput and TTFT / TPOT p50 / p99 per layout and rate, each
# layout's highest sustainable rate, and one plot (goodput, TTFT p99 and TPOT p99 against offered
# rate, one line per layout). Not a test: on a machine with fewer cores than processes (router,
# nodes, this client) the layouts compete for the same CPU, and that is part of what it shows.
#
#   bench/experiments/pd-ratio.sh [--bin DIR] [--quick] [--out DIR]
#
# --bin DIR: built programs (default build/: ./kvrelay build). --quick: 4 rates x 5 s per
# layout (about 2 minutes) instead of 5 rates x 10 s (about 4). --out DIR: where results go
# (default bench/results/pd-ratio/): table.md, summary.json, pd-ratio.png, one
# kvrelay-bench-serve JSON per layout (P1-D1.json, ...) and the clusters' logs (logs/).
#
# Requests: 512-token prompts, 128 output tokens, policy full, default prefill chunk (512) and
# decode pool (1 GiB: memory is not the limit here). SLO: TTFT <= 500 ms and TPOT <= 10 ms;
# highest sustainable rate as in policy-memory.sh (>= 90% of the requests good, at that rate and
# every lower one of the sweep).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
exp_parse pd-ratio "$@"

PROMPT=512 OUTPUT=128 POLICY=full SLO=ttft_ms=500,tpot_ms=10 MAX_QUEUE_MS=3000
LAYOUTS=("1 1" "1 2" "2 1")
if [ "$EXP_QUICK" = 1 ]; then
  RATES=8,16,24,32 DURATION=5 WARMUP=4
else
  RATES=8,16,24,32,40 DURATION=10 WARMUP=6
fi
KRC_ROUTER_ARGS=(--max-queue-ms "$MAX_QUEUE_MS")
machine=$(exp_machine)

files=()
for layout in "${LAYOUTS[@]}"; do
  read -r np nd <<<"$layout"
  tag=P$np-D$nd
  exp_cluster_start "$tag" "$np" "$nd" --threads 1
  echo "pd-ratio: $np prefill : $nd decode at $RATES req/s" >&2
  "$EXP_BENCH" --target "$KRC_ROUTER" --rate "$RATES" --duration "$DURATION" --warmup "$WARMUP" \
    --prompt-len "$PROMPT" --output-len "$OUTPUT" --policy "$POLICY" --slo "$SLO" --timeout 120 \
    --json "$EXP_OUT/$tag.json" --no-progress >"$EXP_OUT/logs/$tag.txt"
  exp_cluster_stop
  files+=("$EXP_OUT/$tag.json")
done

"$EXP_PY" - "$EXP_OUT" "$machine" "${files[@]}" <<'PY'
import json, os, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plots import save_png

out, machine = sys.argv[1:3]
summary = {"machine": machine, "layouts": []}
fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(10.5, 3.5))
for f in sys.argv[3:]:
    d = json.load(open(f))
    tag = os.path.basename(f)[:-5]
    np_, nd = tag[1:].split("-D")
    runs = []
    for r in d["runs"]:
        s = r["summary"]
        runs.append({"rate": r["mode"]["rate"], "requests": s["requests"], "ok": s["ok"],
                     "good": s["good"], "errors": sum(s["errors"].values()),
                     "throughput": s["request_throughput"], "goodput": s["goodput"],
                     "attainment": s["good"] / s["requests"] if s["requests"] else 0.0,
                     "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
                     "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"],
                     "queue_p99": s["queue_ms"]["p99"],
                     "lag_p99": r["dispatch_lag_ms"]["p99"],
                     "client_cpu": r["client"]["cpu_s"] / r["client"]["wall_s"]})
    sustainable = None
    for x in sorted(runs, key=lambda x: x["rate"]):
        if x["attainment"] < 0.9:
            break
        sustainable = x["rate"]
    label = "%s:%s" % (np_, nd)
    summary["layouts"].append({"layout": label, "prefill": int(np_), "decode": int(nd),
                               "policy": d["policies"][0], "prompt_len": d["prompt_len"][0],
                               "output_len": d["output_len"][0], "slo": d["slo"],
                               "sustainable_rate": sustainable, "runs": runs})
    ax1.plot([x["rate"] for x in runs], [x["goodput"] for x in runs], marker="o", label="P:D " + label)
    ax2.plot([x["rate"] for x in runs], [x["ttft_p99"] for x in runs], marker="o", label="P:D " + label)
    ax3.plot([x["rate"] for x in runs], [x["tpot_p99"] for x in runs], marker="o", label="P:D " + label)
rates = sorted({x["rate"] for l in summary["layouts"] for x in l["runs"]})
ax1.plot(rates, rates, color="0.6", linestyle=":", label="offered")
slo = summary["layouts"][0]["slo"]
ax1.set_xlabel("offered rate (req/s)"); ax1.set_ylabel("goodput (req/s)")
ax1.set_title("goodput (TTFT<=%g ms, TPOT<=%g ms)" % (slo.get("ttft_ms", 0), slo.get("tpot_ms", 0)), fontsize=9)
ax2.set_xlabel("offered rate (req/s)"); ax2.set_ylabel("TTFT p99 (ms)"); ax2.set_yscale("log")
ax2.set_title("TTFT p99", fontsize=9)
ax3.set_xlabel("offered rate (req/s)"); ax3.set_ylabel("TPOT p99 (ms)"); ax3.set_yscale("log")
ax3.set_title("TPOT p99", fontsize=9)
for a in (ax1, ax2, ax3):
    a.grid(alpha=0.3); a.legend(fontsize=7)
fig.tight_layout()
png = os.path.join(out, "pd-ratio.png")
save_png(fig, png)
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)

l0 = summary["layouts"][0]
lines = ["Machine: %s. Policy `%s`, %d-token prompts, %d output tokens, 1 thread per node. SLO: %s. "
         "Sustainable: the highest swept rate at which >= 90%% of the requests (and at every lower rate) met the SLO."
         % (machine, l0["policy"], l0["prompt_len"], l0["output_len"],
            ", ".join("%s <= %g" % kv for kv in slo.items())), "",
         "| P:D | highest sustainable rate | offered req/s | served req/s | goodput | attainment | TTFT p50 / p99 ms | TPOT p50 / p99 ms | queue wait p99 ms | errors | send lag p99 ms |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
for l in summary["layouts"]:
    for i, x in enumerate(l["runs"]):
        sus = ("%g req/s" % l["sustainable_rate"] if l["sustainable_rate"] else "< %g req/s" % l["runs"][0]["rate"]) if i == 0 else ""
        lines.append("| %s | %s | %g | %.1f | %.1f | %.0f%% | %.0f / %.0f | %.2f / %.2f | %.0f | %d | %.0f |" % (
            l["layout"] if i == 0 else "", sus, x["rate"], x["throughput"], x["goodput"],
            100 * x["attainment"], x["ttft_p50"], x["ttft_p99"], x["tpot_p50"], x["tpot_p99"],
            x["queue_p99"], x["errors"], x["lag_p99"]))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "pd-ratio: results in $EXP_OUT (table.md, summary.json, pd-ratio.png)" >&2
