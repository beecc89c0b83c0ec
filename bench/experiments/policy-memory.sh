#!/usr/bin/env bash
# policy-memory.sh - what each KV eviction policy serves when the decode node's KV pool is what
# binds (docs/benchmarks.md, "Policy x memory"): one cluster of 1 prefill + 1 decode node, 1
# thread each, on a model whose decode step costs what a real one does on this CPU (the shape
# of tools/data/llama-110m.json, random bf16 weights, made by kvrelay-make-model), prefill in
# 64-token chunks, 512-token prompts and 1024 output tokens: output-heavy, so that decode, and
# with it the pool, is the bottleneck rather than the prefill node. The pool holds exactly 3
# requests under `full`. Accuracy comes from docs/quality.json: the trained default model's
# figures for the same policy specs at 512 tokens (kvrelay-eval's chunk, 64), since a random
# model has none; throughput depends on the model's shape, not its weights.
#
# Two phases per policy, each policy alone on the same cluster:
#   1. capacity: a closed loop of 16 clients (more than the pool holds under any policy but
#      streaming) for CAP seconds: output tokens/s and requests/s the cluster sustains;
#   2. goodput: Poisson arrivals at multiples of `full`'s measured capacity (0.5, 1, 1.5, 2, 3x;
#      --quick: 0.5, 1, 2, 3x), RUN seconds each, against the SLO below.
# Writes table.md, summary.json and goodput.png (goodput against offered rate, one line per
# policy). Not a test: figures depend on the machine; run it on an idle one.
#
#   bench/experiments/policy-memory.sh [--bin DIR] [--quick] [--out DIR]
#
# --bin DIR: built programs (default build/: ./kvrelay build; needs kvrelay-make-model too).
# --quick: full, streaming and snapkv only, CAP 60 s and RUN 60 s (about 15 minutes) instead
# of all five policies, CAP 120 s and RUN 90 s (about 50 minutes). --out DIR: where results go
# (default bench/results/policy-memory/).
#
# SLO: TTFT <= 5000 ms (a 512-token prefill in 64-token chunks plus the wait for a pool slot)
# and TPOT <= 100 ms (10 tokens/s per stream on one core). Highest sustainable rate: the highest
# offered rate of the sweep at which at least 90% of the measured requests were good (OK and
# within the SLO), at this and every lower rate of the sweep.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
exp_parse policy-memory "$@"

PROMPT=512 OUTPUT=1024 CHUNK=64 SLO=ttft_ms=5000,tpot_ms=100 CLIENTS=16
# the kvrelay-eval specs at 512 tokens and budget fraction 0.1 (B = 51 entries per list):
# docs/quality.json has their accuracy at exactly these specs, prompt length and chunk
POLICIES=(full streaming:sink=4,window=47 snapkv:mode=patched,budget=51,obs=16
  pyramidkv:mode=patched,budget=51,obs=16 take:budget=51,probe=16)
if [ "$EXP_QUICK" = 1 ]; then
  POLICIES=("${POLICIES[@]:0:3}") MULTIPLES=(0.5 1 2 3) CAP=60 RUN=60
else
  MULTIPLES=(0.5 1 1.5 2 3) CAP=120 RUN=90
fi
# the model: 12 layers x 4 KV heads = 48 lists; `full` takes ceil((512 + 1024) / 16) = 96
# blocks of 16 entries per list, 4608 per request; the pool holds 3 of them
KV_BLOCKS=$((3 * 48 * ((PROMPT + OUTPUT + 15) / 16)))
exp_shape_model "$EXP_HERE/tools/data/llama-110m.json"

KRC_PREFILL_ARGS=(--chunk "$CHUNK")
KRC_DECODE_ARGS=(--kv-blocks "$KV_BLOCKS")
machine=$(exp_machine)
exp_cluster_start policy-memory 1 1 --threads 1
bench() { # bench POLICY OUT.json LOAD-FLAGS...
  local p=$1 f=$2; shift 2
  "$EXP_BENCH" --target "$KRC_ROUTER" "$@" --prompt-len "$PROMPT" --output-len "$OUTPUT" --policy "$p" \
    --slo "$SLO" --timeout 900 --text "$EXP_HERE/tools/data/corpus.txt" --json "$f" --no-progress \
    >"${f%.json}.txt"
}
caps=() sweeps=() rates=
for p in "${POLICIES[@]}"; do
  f=$EXP_OUT/${p%%:*}-capacity.json
  echo "policy-memory: $p, closed loop of $CLIENTS for $CAP s" >&2
  bench "$p" "$f" --concurrency "$CLIENTS" --duration "$CAP" --warmup 2
  caps+=("$f")
  if [ -z "$rates" ]; then # multiples of full's capacity, the first policy's
    rates=$("$EXP_PY" -c 'import json, sys
c = json.load(open(sys.argv[1]))["runs"][0]["summary"]["request_throughput"]
print(",".join("%.3g" % (float(m) * c) for m in sys.argv[2:]))' "$f" "${MULTIPLES[@]}")
  fi
done
for p in "${POLICIES[@]}"; do
  f=$EXP_OUT/${p%%:*}.json
  echo "policy-memory: $p at $rates req/s, $RUN s each" >&2
  bench "$p" "$f" --rate "$rates" --duration "$RUN" --warmup 2
  sweeps+=("$f")
done
exp_cluster_stop

"$EXP_PY" - "$EXP_OUT" "$EXP_HERE/docs/quality.json" "$EXP_OUT/logs/policy-memory/decode-0.log" \
  "$machine" "$KV_BLOCKS" "$CHUNK" "${caps[@]}" "${sweeps[@]}" <<'PY'
import json, os, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plots import save_png

out, quality_path, decode_log, machine, kv_blocks, chunk = sys.argv[1:7]
files = sys.argv[7:]
caps, files = files[:len(files) // 2], files[len(files) // 2:]
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
for cf, f in zip(caps, files):
    c = json.load(open(cf))["runs"][0]["summary"]
    capacity = {"requests_per_s": c["request_throughput"], "output_tokens_per_s": c["output_token_throughput"],
                "ttft_p50": c["ttft_ms"]["p50"], "tpot_p50": c["tpot_ms"]["p50"], "tpot_p99": c["tpot_ms"]["p99"],
                "errors": sum(c["errors"].values())}
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
         "blocks_per_request": need.get(fam), "capacity": capacity, "runs": runs,
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
full_cap = summary["policies"][0]["capacity"]["output_tokens_per_s"]
lines = ["Machine: %s. Model: the llama-110m shape, random bf16 weights. Decode pool %s blocks of "
         "16 entries, prefill chunk %s, 1 thread per node, %d-token prompts, %d output tokens. "
         "SLO: %s. Capacity: a closed loop of 16 clients. Sustainable: the highest swept rate at "
         "which >= 90%% of the requests (and at every lower rate) met the SLO." % (machine, kv_blocks,
         chunk, plen, olen, ", ".join("%s <= %g" % kv for kv in slo.items())), "",
         "| policy | blocks per request (requests the pool holds) | capacity: output tok/s (x full), req/s, TPOT p50 ms | goodput at each offered rate (req/s) | highest sustainable rate | KV shipped per request | kv accuracy / text top-1 (docs/quality.json, %d tokens) |" % plen,
         "|---|---|---|---|---|---|---|"]
for p in summary["policies"]:
    kvb = [x["kv_bytes"] for x in p["runs"] if x["kv_bytes"]]
    cap = p["capacity"]
    lines.append("| `%s` | %s | %.0f (%.2fx), %.2f, %.0f | %s | %s | %s | %s / %s |" % (
        p["policy"], "%d (%d)" % (p["blocks_per_request"], int(kv_blocks) // p["blocks_per_request"])
        if p["blocks_per_request"] else "—",
        cap["output_tokens_per_s"], cap["output_tokens_per_s"] / full_cap if full_cap else 0,
        cap["requests_per_s"], cap["tpot_p50"],
        ", ".join("%.3g: %.2f" % (x["rate"], x["goodput"]) for x in p["runs"]),
        fmt(p["sustainable_rate"], "%.3g req/s") if p["sustainable_rate"] else "< %.3g req/s" % p["runs"][0]["rate"],
        fmt(kvb[0] / 1024 if kvb else None, "%.0f KiB"),
        fmt(p["kv_accuracy"], "%.2f"), fmt(p["text_top1"], "%.2f")))
lines += ["", "Per rate (TTFT / TPOT in ms; attainment = good / measured requests; errors = refused after the router's queue cap):", "",
          "| policy | offered req/s | served req/s | goodput | attainment | TTFT p50 / p99 | TPOT p50 / p99 | queue wait p99 | errors |",
          "|---|---|---|---|---|---|---|---|---|"]
for p in summary["policies"]:
    for x in p["runs"]:
        lines.append("| `%s` | %.3g | %.2f | %.2f | %.0f%% | %.0f / %.0f | %.1f / %.1f | %.0f | %d |" % (
            p["policy"].split(":")[0], x["rate"], x["throughput"], x["goodput"], 100 * x["attainment"],
            x["ttft_p50"], x["ttft_p99"], x["tpot_p50"], x["tpot_p99"], x["queue_p99"], x["errors"]))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "policy-memory: results in $EXP_OUT (table.md, summary.json, goodput.png)" >&2
