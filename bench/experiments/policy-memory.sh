#!/usr/bin/env bash
# policy-memory.sh - goodput of each KV eviction policy when the decode node's KV pool is small
# (docs/benchmarks.md, "Policy x memory"): one cluster of 1 prefill + 1 decode node on the
# default model, 1 thread each, prefill in 64-token chunks (kvrelay-eval's setting, so that the
# accuracy figures of docs/quality.json apply to the same specs), a decode pool of --kv-blocks
# 1200 (three 512 + 256-token requests under `full`, seven under the compressed policies that
# grow during decode, more under streaming), and for each policy alone a Poisson rate sweep with
# kvrelay-bench-serve. Writes a table with each policy's goodput per rate, its highest
# sustainable rate and its accuracy from docs/quality.json, and one plot: goodput against
# offered rate, one line per policy. Not a test: figures depend on the machine.
#
#   bench/experiments/policy-memory.sh [--bin DIR] [--quick] [--out DIR]
#
# --bin DIR: built programs (default build/: ./kvrelay build). --quick: 4 rates x 5 s per
# policy (about 3 minutes) instead of 6 rates x 10 s (about 7). --out DIR: where results go
# (default bench/results/policy-memory/): table.md, summary.json, goodput.png, one
# kvrelay-bench-serve JSON per policy (POLICY-FAMILY.json) and the cluster's logs (logs/).
#
# SLO: TTFT <= 500 ms and TPOT <= 10 ms. Highest sustainable rate: the highest offered rate of
# the sweep at which at least 90% of the measured requests were good (OK and within the SLO),
# this and every lower rate of the sweep; i.e. goodput >= 90% of the rate actually offered.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
exp_parse policy-memory "$@"

PROMPT=512 OUTPUT=256 CHUNK=64 KV_BLOCKS=1200 SLO=ttft_ms=500,tpot_ms=10 MAX_QUEUE_MS=3000
# the kvrelay-eval specs at 512 tokens and budget fraction 0.1 (B = 51 entries per list):
# docs/quality.json has their accuracy at exactly these specs, prompt length and chunk
POLICIES=(full streaming:sink=4,window=47 snapkv:mode=patched,budget=51,obs=16
  pyramidkv:mode=patched,budget=51,obs=16 take:budget=51,probe=16)
if [ "$EXP_QUICK" = 1 ]; then
  RATES=4,8,16,24 DURATION=5 WARMUP=4
else
  RATES=4,8,12,16,20,24 DURATION=10 WARMUP=6
fi

KRC_PREFILL_ARGS=(--chunk "$CHUNK")
KRC_DECODE_ARGS=(--kv-blocks "$KV_BLOCKS")
KRC_ROUTER_ARGS=(--max-queue-ms "$MAX_QUEUE_MS")
machine=$(exp_machine)
exp_cluster_start policy-memory 1 1 --threads 1

files=()
for p in "${POLICIES[@]}"; do
  f=$EXP_OUT/${p%%:*}.json
  echo "policy-memory: $p at $RATES req/s" >&2
  "$EXP_BENCH" --target "$KRC_ROUTER" --rate "$RATES" --duration "$DURATION" --warmup "$WARMUP" \
    --prompt-len "$PROMPT" --output-len "$OUTPUT" --policy "$p" --slo "$SLO" --timeout 120 \
    --json "$f" --no-progress >"$EXP_OUT/logs/${p%%:*}.txt"
  files+=("$f")
done
exp_cluster_stop

"$EXP_PY" - "$EXP_OUT" "$EXP_HERE/docs/quality.json" "$EXP_OUT/logs/policy-memory/decode-0.log" \
  "$machine" "$KV_BLOCKS" "$CHUNK" "${files[@]}" <<'PY'
import json, os, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plots import save_png

out, quality_path, decode_log, machine, kv_blocks, chunk = sys.argv[1:7]
files = sys.argv[7:]
quality = json.load(open(quality_path)) if os.path.exists(quality_path) else {"records": []}
# the decode node logs what each reservation takes: "reserved N blocks as reservation ID
# (P prompt tokens, M max_tokens, FAMILY, ...)"
need = {}
for line in open(decode_log, errors="replace"):
    m = re.search(r"reserved (\d+) blocks as reservation \d+ \(\d+ prompt tokens, \d+ max_tokens, (\w+)", line)
    if m:
        need.setdefault(m.group(2), int(m.group(1)))

def accuracy(spec, length):
    got = {}
    for r in quality["records"]:
        if r["policy"] == spec and r["length"] == length:
            got[r["task"]] = r
    return got

rows, summary = [], {"machine": machine, "kv_blocks": int(kv_blocks), "chunk": int(chunk),
                     "policies": []}
plt.figure(figsize=(6.4, 4.2))
for f in files:
    d = json.load(open(f))
    spec = d["policies"][0]
    plen, olen = d["prompt_len"][0], d["output_len"][0]
    runs = []
    for r in d["runs"]:
        s = r["summary"]
        errs = sum(s["errors"].values())
        runs.append({
            "rate": r["mode"]["rate"], "requests": s["requests"], "ok": s["ok"], "good": s["good"],
            "errors": errs, "goodput": s["goodput"], "throughput": s["request_throughput"],
            "attainment": s["good"] / s["requests"] if s["requests"] else 0.0,
            "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"],
            "queue_p99": s["queue_ms"]["p99"],
            "kv_bytes": s["kv_bytes_shipped"] / s["ok"] if s["ok"] else None,
            "footprint": s["kv_footprint_mean"]})
    sustainable = None
    for x in sorted(runs, key=lambda x: x["rate"]):
        if x["attainment"] < 0.9:
            break
        sustainable = x["rate"]
    q = accuracy(spec, plen)
    fam = spec.split(":")[0]
    p = {"policy": spec, "prompt_len": plen, "output_len": olen, "slo": d["slo"],
         "sustainable_rate": sustainable, "peak_goodput": max(x["goodput"] for x in runs),
         "blocks_per_request": need.get(fam), "runs": runs,
         "kv_accuracy": q.get("kv", {}).get("accuracy"),
         "text_top1": q.get("text", {}).get("top1_agreement"),
         "quality_footprint": q.get("kv", {}).get("kv_footprint")}
    summary["policies"].append(p)
    plt.plot([x["rate"] for x in runs], [x["goodput"] for x in runs], marker="o", label=spec)
rates = sorted({x["rate"] for p in summary["policies"] for x in p["runs"]})
plt.plot(rates, rates, color="0.6", linestyle=":", label="offered")
plt.plot(rates, [0.9 * r for r in rates], color="0.8", linestyle=":", label="90% of offered")
slo = summary["policies"][0]["slo"]
plt.xlabel("offered rate (req/s, Poisson)")
plt.ylabel("goodput (req/s within the SLO)")
plt.title("goodput by KV policy, decode pool %s blocks (TTFT<=%g ms, TPOT<=%g ms)"
          % (kv_blocks, slo.get("ttft_ms", 0), slo.get("tpot_ms", 0)), fontsize=9)
plt.legend(fontsize=7)
plt.grid(alpha=0.3)
plt.tight_layout()
png = os.path.join(out, "goodput.png")
save_png(plt.gcf(), png)
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)

def fmt(v, spec="%.1f"):
    return "—" if v is None else spec % v
lines = ["Machine: %s. Decode pool %s blocks of 16 entries, prefill chunk %s, 1 thread per node. "
         "SLO: %s. Sustainable: the highest swept rate at which >= 90%% of the requests (and at "
         "every lower rate) met the SLO." % (machine, kv_blocks, chunk,
         ", ".join("%s <= %g" % kv for kv in slo.items())), "",
         "| policy | blocks per request (requests the pool holds) | goodput at each offered rate (req/s) | highest sustainable rate | peak goodput | KV shipped per request | kv accuracy / text top-1 (docs/quality.json, %d tokens) |" % plen,
         "|---|---|---|---|---|---|---|"]
for p in summary["policies"]:
    kvb = [x["kv_bytes"] for x in p["runs"] if x["kv_bytes"]]
    lines.append("| `%s` | %s | %s | %s | %.1f | %s | %s / %s |" % (
        p["policy"], "%d (%d)" % (p["blocks_per_request"], int(kv_blocks) // p["blocks_per_request"])
        if p["blocks_per_request"] else "—",
        ", ".join("%g: %.1f" % (x["rate"], x["goodput"]) for x in p["runs"]),
        fmt(p["sustainable_rate"], "%g req/s") if p["sustainable_rate"] else "< %g req/s" % p["runs"][0]["rate"],
        p["peak_goodput"], fmt(kvb[0] / 1024 if kvb else None, "%.0f KiB"),
        fmt(p["kv_accuracy"], "%.2f"), fmt(p["text_top1"], "%.2f")))
lines += ["", "Per rate (TTFT / TPOT in ms; attainment = good / measured requests; errors = refused after the router's queue cap):", "",
          "| policy | offered req/s | served req/s | goodput | attainment | TTFT p50 / p99 | TPOT p50 / p99 | queue wait p99 | errors |",
          "|---|---|---|---|---|---|---|---|---|"]
for p in summary["policies"]:
    for x in p["runs"]:
        lines.append("| `%s` | %g | %.1f | %.1f | %.0f%% | %.0f / %.0f | %.2f / %.2f | %.0f | %d |" % (
            p["policy"].split(":")[0], x["rate"], x["throughput"], x["goodput"], 100 * x["attainment"],
            x["ttft_p50"], x["ttft_p99"], x["tpot_p50"], x["tpot_p99"], x["queue_p99"], x["errors"]))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "policy-memory: results in $EXP_OUT (table.md, summary.json, goodput.png)" >&2
