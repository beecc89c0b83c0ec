#!/usr/bin/env bash
# prompt-length.sh - what the KV transfer costs as prompts grow from 256 to 4000 tokens
# (docs/benchmarks.md, "Prompt length"): one cluster of 1 prefill + 1 decode node on the
# default model (context 4096 positions, so 4000 + 16 output tokens is the longest that fits),
# 1 thread each, one request at a time (closed loop, 1 client: no queueing), `full` against a
# compressed policy at each length, each with the KV bundle in f32 and in int8 (kv_wire_dtype).
# Per point: KV bytes shipped per request (Usage), TTFT
# p50 / p99 (the client's), and the bundle's transfer time, which no per-request usage carries:
# the prefill node's `kvrelay_kv_transfer_seconds` histogram (send start to the decode node's
# acknowledgement; the prefill node runs --pipeline off, so that is the whole bundle's transfer),
# read from its /metrics before and after each point, sum / count of the
# difference. Writes a table, the bytes compression ratio per length, and one plot.
# Not a test: figures depend on the machine.
#
#   bench/experiments/prompt-length.sh [--bin DIR] [--quick] [--out DIR]
#
# --bin DIR: built programs (default build/: ./kvrelay build). --quick: 4 requests per point
# (about 1 minute) instead of 20 (about 3 minutes). --out DIR: where results go (default
# bench/results/prompt-length/): table.md, summary.json, prompt-length.png, one
# kvrelay-bench-serve JSON per point (L-FAMILY-WIRE.json) and the cluster's logs (logs/).
#
# Each point starts with one warmup request of its own (a separate run, before the first
# scrape), so the histogram's difference covers exactly the point's measured requests; the
# table's bundle count says so, and its MB/s divides the prefill node's
# kvrelay_kv_bytes_shipped_total difference by the transfer time.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
exp_parse prompt-length "$@"

LENGTHS=(256 512 1024 2048 4000)
POLICIES=(full snapkv:mode=patched,budget=64,obs=8)
WIRES=(f32 int8)
OUTPUT=16
if [ "$EXP_QUICK" = 1 ]; then N=4; else N=20; fi
machine=$(exp_machine)
# whole bundles: with layer-wise pipelining the histogram would hold only what is left after the
# prefill (bench/experiments/pipeline.sh measures that)
KRC_PREFILL_ARGS=(--pipeline off)
exp_cluster_start prompt-length 1 1 --threads 1
metrics=http://$(krc_http prefill-0)/metrics

# the prefill node's transfer figures as one JSON line: {"count", "sum", "bytes", "buckets":
# {upper bound: cumulative count}}
scrape() {
  "$EXP_PY" - "$metrics" <<'PY'
import json, re, sys, urllib.request
v, buckets = {}, {}
for line in urllib.request.urlopen(sys.argv[1], timeout=10).read().decode().splitlines():
    if line.startswith("#") or not line.strip():
        continue
    name, _, value = line.rpartition(" ")
    if name.startswith("kvrelay_kv_bytes_shipped_total{"):  # one series per wire dtype: their sum
        name = "kvrelay_kv_bytes_shipped_total"
        value = str(v.get(name, 0.0) + float(value))
    m = re.fullmatch(r'kvrelay_kv_transfer_seconds_bucket\{le="([^"]+)"\}', name)
    if m:
        buckets[m.group(1)] = float(value)
    v[name] = float(value)
need = {"count": "kvrelay_kv_transfer_seconds_count", "sum": "kvrelay_kv_transfer_seconds_sum",
        "bytes": "kvrelay_kv_bytes_shipped_total"}
missing = [n for n in need.values() if n not in v]
if missing or not buckets:
    sys.exit("prompt-length: the prefill node's /metrics has no %s" % ", ".join(missing or ["transfer buckets"]))
print(json.dumps(dict({k: v[n] for k, n in need.items()}, buckets=buckets)))
PY
}

points=()
for len in "${LENGTHS[@]}"; do
  for p in "${POLICIES[@]}"; do
    for w in "${WIRES[@]}"; do
      f=$EXP_OUT/$len-${p%%:*}-$w.json
      "$EXP_BENCH" --target "$KRC_ROUTER" --concurrency 1 --num-requests 1 --prompt-len "$len" \
        --output-len "$OUTPUT" --policy "$p" --wire-dtype "$w" --timeout 120 --no-progress >/dev/null
      before=$(scrape)
      "$EXP_BENCH" --target "$KRC_ROUTER" --concurrency 1 --num-requests "$N" \
        --prompt-len "$len" --output-len "$OUTPUT" --policy "$p" --wire-dtype "$w" --timeout 120 \
        --json "$f" --no-progress >"$EXP_OUT/logs/$len-${p%%:*}-$w.txt"
      after=$(scrape)
      echo "prompt-length: $len tokens, $p, $w done" >&2
      points+=("$f" "$before" "$after")
    done
  done
done
exp_cluster_stop

"$EXP_PY" - "$EXP_OUT" "$machine" "${points[@]}" <<'PY'
import json, os, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plots import save_png

out, machine = sys.argv[1:3]
args = sys.argv[3:]
points = []
for i in range(0, len(args), 3):
    d = json.load(open(args[i]))
    b, a = json.loads(args[i + 1]), json.loads(args[i + 2])
    n, secs, nbytes = a["count"] - b["count"], a["sum"] - b["sum"], a["bytes"] - b["bytes"]
    # the median from the histogram's difference, linear within a bucket (as Prometheus'
    # histogram_quantile): coarse (bounds 1, 2.5, 5, 10, 25 ms ...) but robust to the few
    # transfers a busy machine stretches, which move the mean
    les = sorted((float(k), a["buckets"][k] - b["buckets"].get(k, 0)) for k in a["buckets"])
    p50, lo, below = None, 0.0, 0.0
    for le, cum in les:
        if n and cum >= n / 2:
            p50 = 1e3 * (lo + (le - lo) * (n / 2 - below) / (cum - below)) if le != float("inf") else 1e3 * lo
            break
        lo, below = le, cum
    s = d["runs"][0]["summary"]
    points.append({
        "prompt_len": d["prompt_len"][0], "policy": d["policies"][0], "wire": d["wire_dtype"],
        "requests": s["requests"],
        "ok": s["ok"], "kv_bytes": s["kv_bytes_shipped"] / s["ok"] if s["ok"] else None,
        "footprint": s["kv_footprint_mean"],
        "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
        "e2e_p50": s["e2e_ms"]["p50"], "bundles": int(n),
        "transfer_ms": 1e3 * secs / n if n else None, "transfer_p50_ms": p50,
        "bundle_bytes": nbytes / n if n else None})
full = {p["prompt_len"]: p for p in points if p["policy"] == "full" and p["wire"] == "f32"}
for p in points:
    f = full.get(p["prompt_len"])
    p["bytes_ratio"] = f["kv_bytes"] / p["kv_bytes"] if f and p["kv_bytes"] else None
json.dump({"machine": machine, "points": points}, open(os.path.join(out, "summary.json"), "w"), indent=1)

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 3.6))
for spec, wire in dict.fromkeys((p["policy"], p["wire"]) for p in points):
    pts = [p for p in points if (p["policy"], p["wire"]) == (spec, wire)]
    L = [p["prompt_len"] for p in pts]
    name = "%s, %s" % (spec.split(":")[0], wire)
    ax1.plot(L, [p["kv_bytes"] / 1024 for p in pts], marker="o", label=name)
    l, = ax2.plot(L, [p["ttft_p50"] for p in pts], marker="o", label="TTFT p50, " + name)
    ax2.plot(L, [p["transfer_ms"] for p in pts], marker="s", linestyle="--", color=l.get_color(),
             label="transfer, " + name)
for a in (ax1, ax2):
    a.set_xscale("log", base=2); a.set_yscale("log"); a.grid(alpha=0.3); a.legend(fontsize=7)
    a.set_xlabel("prompt tokens")
ax1.set_ylabel("KV shipped per request (KiB)"); ax1.set_title("bytes shipped prefill -> decode", fontsize=9)
ax2.set_ylabel("ms"); ax2.set_title("TTFT p50 and bundle transfer time (1 client)", fontsize=9)
fig.tight_layout()
png = os.path.join(out, "prompt-length.png")
save_png(fig, png)

def fmt(v, spec):
    return "—" if v is None else spec % v
lines = ["Machine: %s. 1 prefill + 1 decode node, 1 thread each, prefill chunk 512, closed loop with 1 client, "
         "16 output tokens; wire: the KV bundle's payload dtype (kv_wire_dtype); transfer: the prefill node's kvrelay_kv_transfer_seconds over the point's bundles (mean = sum / count; "
         "p50 interpolated within the histogram's buckets: 1, 2.5, 5, 10, 25 ms ...)." % machine, "",
         "| prompt tokens | policy | wire | requests (bundles) | KV shipped per request | full f32 / this (bytes) | KV footprint | TTFT p50 / p99 ms | transfer mean / p50 ms | MB/s at the mean | E2E p50 ms |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
for p in points:
    mbps = p["bundle_bytes"] / (p["transfer_ms"] / 1e3) / 1e6 if p["transfer_ms"] else None
    lines.append("| %d | `%s` | %s | %d (%d) | %s | %s | %.3f | %.0f / %.0f | %s / %s | %s | %.0f |" % (
        p["prompt_len"], p["policy"], p["wire"], p["ok"], p["bundles"], fmt(p["kv_bytes"] / 1024 if p["kv_bytes"] else None, "%.0f KiB"),
        fmt(p["bytes_ratio"], "%.1f×"), p["footprint"], p["ttft_p50"], p["ttft_p99"],
        fmt(p["transfer_ms"], "%.2f"), fmt(p["transfer_p50_ms"], "%.1f"), fmt(mbps, "%.0f"), p["e2e_p50"]))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "prompt-length: results in $EXP_OUT (table.md, summary.json, prompt-length.png)" >&2
