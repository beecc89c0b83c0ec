#!/usr/bin/env bash
# pipeline.sh - what layer-wise pipelining of the KV transfer takes off the time to first token
# (docs/benchmarks.md, "Layer-wise pipelining"). One cluster of 1 prefill + 1 decode node, 1
# thread each, one request at a time (closed loop, 1 client), `full` policy and f32 bundles (the
# most bytes), prompts of 1024, 4096 and 8192 tokens, each with the prefill node's --pipeline on
# and off, over three links:
#   loopback  UCX's own choice between two processes on one host (shared memory);
#   2.5gbit   and 1gbit: the whole cluster in a network namespace whose loopback device is
#             rate-limited with a token bucket (tc tbf) and UCX held to TCP (UCX_TLS=tcp), so the
#             bundle crosses a link of that speed.
# The model is made here (kvrelay-make-model, random weights: timing does not depend on them):
# 8 layers, hidden 256, 8 query and 8 KV heads of 32, context 8320 positions: 16 KiB of f32 KV
# per prompt token (1 GiB/s moves an 8192-token bundle in 0.13 s), so that the transfer is a
# visible share of the time to first token on this CPU. Per point: TTFT p50 (the client's), the
# prefill node's per-request prefill time and what the transfer added after it (its log lines),
# TTFT minus each request's prefill time (the prefill's compute varies by 10-15% from run to run
# on a shared VM, more than the transfer: this is the figure pipelining moves), and how many of
# a bundle's parts the decode node had acknowledged before the prefill ended.
# Needs root, ip and tc for the shaped links (skipped with a message otherwise). Not a test:
# figures depend on the machine.
#
#   bench/experiments/pipeline.sh [--bin DIR] [--quick] [--out DIR]
#
# --bin DIR: built programs (default build/). --quick: 2 requests per point instead of 5.
# --out DIR: where results go (default bench/results/pipeline/): table.md, summary.json,
# pipeline.png, the kvrelay-bench-serve JSON of each point and the clusters' logs (logs/).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
exp_parse pipeline "$@"

LENGTHS=(1024 4096 8192)
LINKS=(loopback 2.5gbit 1gbit)
OUTPUT=2
if [ "$EXP_QUICK" = 1 ]; then N=2; else N=5; fi
machine=$(exp_machine)
[ -x "$EXP_BIN/kvrelay-make-model" ] || { echo "pipeline: $EXP_BIN has no kvrelay-make-model" >&2; exit 2; }

# the model, in a temporary directory (15 MiB of weights: not results)
EXP_MODEL=$(mktemp -d -t kvrelay-pipeline-model.XXXXXX)
"$EXP_BIN/kvrelay-make-model" --corpus "$EXP_HERE/tools/data/corpus.txt" --out "$EXP_MODEL" \
  --layers 8 --hidden 256 --heads 8 --kv-heads 8 --intermediate 688 --vocab 2048 >&2
sed -i -E 's/"max_position_embeddings":[[:space:]]*[0-9]+/"max_position_embeddings": 8320/' "$EXP_MODEL/config.json"

ns=kvrelay-pipe-$$
shaped_ok=1
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  shaped_ok=0
  echo "pipeline: the shaped links need root, ip and tc: measuring loopback only" >&2
fi
netns_up() { # netns_up RATE: a namespace whose loopback sends at RATE
  ip netns add "$ns"
  ip netns exec "$ns" ip link set lo up
  ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$1" burst 4mb latency 200ms
}
netns_down() { ip netns del "$ns" 2>/dev/null || true; }
# wrappers that start each program in the namespace with UCX on TCP (exec keeps the pid, so
# local-cluster.sh stops them as usual)
wrap=$(mktemp -d -t kvrelay-pipeline-bin.XXXXXX)
trap 'exp_cluster_stop; netns_down; rm -rf "$EXP_MODEL" "$wrap"' EXIT
for p in kvrelay-router kvrelay-prefill kvrelay-decode; do
  printf '#!/bin/sh\nexec ip netns exec %s env UCX_TLS=tcp "%s/%s" "$@"\n' "$ns" "$EXP_BIN" "$p" >"$wrap/$p"
  chmod +x "$wrap/$p"
done

points=()
for link in "${LINKS[@]}"; do
  if [ "$link" != loopback ]; then
    [ "$shaped_ok" = 1 ] || continue
    netns_up "$link"
    bin=$wrap run=(ip netns exec "$ns")
  else
    bin=$EXP_BIN run=()
  fi
  for mode in on off; do
    KRC_PREFILL_ARGS=(--pipeline "$mode" --max-prompt 8300)
    KRC_DECODE_ARGS=()
    KRC_ROUTER_ARGS=()
    KRC_DIR=$EXP_OUT/logs/$link-$mode
    rm -rf "$KRC_DIR"
    krc_start "$bin" "$EXP_MODEL" 1 1 127.0.0.1:0 --threads 1 ||
      { echo "pipeline: the cluster ($link, --pipeline $mode) did not start (logs in $KRC_DIR)" >&2; exit 1; }
    for len in "${LENGTHS[@]}"; do
      f=$EXP_OUT/$link-$mode-$len.json
      mark=$(wc -l <"$KRC_DIR/prefill-0.log")
      "${run[@]}" "$EXP_BENCH" --target "$KRC_ROUTER" --concurrency 1 --num-requests "$N" --warmup 1 \
        --prompt-len "$len" --output-len "$OUTPUT" --policy full --wire-dtype f32 --timeout 600 \
        --json "$f" --requests-out "$EXP_OUT/logs/$link-$mode-$len.jsonl" --no-progress \
        >"$EXP_OUT/logs/$link-$mode-$len.txt"
      # the prefill node's lines for this point's requests (the warm-up's first)
      tail -n +"$((mark + 1))" "$KRC_DIR/prefill-0.log" | grep 'prefilled ' | tail -n "$N" >"$KRC_DIR/$len.lines"
      echo "pipeline: $link, --pipeline $mode, $len tokens done" >&2
      points+=("$link" "$mode" "$f" "$KRC_DIR/$len.lines" "$EXP_OUT/logs/$link-$mode-$len.jsonl")
    done
    exp_cluster_stop
  done
  [ "$link" = loopback ] || netns_down
done

"$EXP_PY" - "$EXP_OUT" "$machine" "${points[@]}" <<'PY'
import json, os, re, statistics, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plots import save_png

out, machine = sys.argv[1:3]
args = sys.argv[3:]
pts = []
for i in range(0, len(args), 5):
    link, mode, f, lines, rows = args[i:i + 5]
    d = json.load(open(f))
    s = d["runs"][0]["summary"]
    # one client, one request at a time: the measured rows and the node's lines are in order
    ttft = [1e3 * r["ttft_s"] for r in map(json.loads, open(rows)) if not r["warmup"] and r.get("ttft_s") is not None]
    pre, xfer, early, parts = [], [], [], []
    for line in open(lines):
        m = re.search(r"in (\d+) part\(s\), (\d+) sent during prefill.*prefill ([0-9.]+) s, transfer ([0-9.]+) s", line)
        if m:
            parts.append(int(m.group(1))); early.append(int(m.group(2)))
            pre.append(float(m.group(3))); xfer.append(float(m.group(4)))
    if len(ttft) != len(pre):
        sys.exit("pipeline: %s: %d measured requests but %d prefill log lines" % (f, len(ttft), len(pre)))
    pts.append({"link": link, "pipeline": mode, "prompt_len": d["prompt_len"][0], "ok": s["ok"],
                # what the request spent outside the prefill's compute: placement, the transfer
                # left after the prefill, the decode node's admission, the first token's relay
                "beyond_prefill_ms": statistics.median(t - 1e3 * p for t, p in zip(ttft, pre)),
                "ttft_p50": s["ttft_ms"]["p50"], "kv_bytes": s["kv_bytes_shipped"] / s["ok"] if s["ok"] else None,
                "prefill_ms": 1e3 * statistics.median(pre) if pre else None,
                "transfer_after_ms": 1e3 * statistics.median(xfer) if xfer else None,
                "parts": max(parts) if parts else None,
                "parts_early": statistics.median(early) if early else None})
json.dump({"machine": machine, "points": pts}, open(os.path.join(out, "summary.json"), "w"), indent=1)

def get(link, mode, L):
    for p in pts:
        if (p["link"], p["pipeline"], p["prompt_len"]) == (link, mode, L):
            return p

links = list(dict.fromkeys(p["link"] for p in pts))
lengths = sorted({p["prompt_len"] for p in pts})
lines = ["Machine: %s. Model: 8 layers, 8 KV heads of 32 (16 KiB of f32 KV per token), random weights. "
         "1 prefill + 1 decode node, 1 thread each, prefill chunk 512, 1 client, `full` policy, f32 bundle, "
         "%d output tokens, %s requests per point after a warm-up. Prefill and 'transfer after prefill': the prefill "
         "node's medians (its log: prefill_s, and transfer_s = from the last part written to its acknowledgement). "
         "TTFT beyond prefill: the median over requests of the client's TTFT minus that request's prefill_s, "
         "which leaves out the prefill's own run-to-run noise. Parts early: a bundle's parts the decode node had "
         "acknowledged before the prefill ended." % (machine, 2, pts[0]["ok"] if pts else "?"), "",
         "| link | prompt tokens | KV shipped | prefill ms (off / on) | TTFT p50 off → on ms | transfer after prefill off → on ms | TTFT beyond prefill off → on ms | saved | parts (early) |",
         "|---|---|---|---|---|---|---|---|---|"]
for link in links:
    for L in lengths:
        on, off = get(link, "on", L), get(link, "off", L)
        if not on or not off:
            continue
        saved = off["beyond_prefill_ms"] - on["beyond_prefill_ms"]
        lines.append("| %s | %d | %.1f MiB | %.0f / %.0f | %.0f → %.0f | %.1f → %.1f | %.0f → %.0f | %.0f ms (%.0f%%) | %s (%s) |" % (
            link, L, on["kv_bytes"] / 2**20, off["prefill_ms"], on["prefill_ms"], off["ttft_p50"],
            on["ttft_p50"], off["transfer_after_ms"], on["transfer_after_ms"], off["beyond_prefill_ms"],
            on["beyond_prefill_ms"], saved, 100 * saved / off["beyond_prefill_ms"], on["parts"],
            on["parts_early"]))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))

fig, axes = plt.subplots(1, len(links), figsize=(3.4 * len(links), 3.3), sharey=False)
if len(links) == 1:
    axes = [axes]
for ax, link in zip(axes, links):
    for mode, style in (("off", "o--"), ("on", "s-")):
        ps = [get(link, mode, L) for L in lengths]
        ax.plot(lengths, [p["beyond_prefill_ms"] if p else None for p in ps], style,
                label="TTFT minus prefill, pipeline " + mode)
    ax.set_title(link, fontsize=9); ax.set_xlabel("prompt tokens"); ax.grid(alpha=0.3)
    ax.set_xscale("log", base=2)
axes[0].set_ylabel("ms beyond the prefill's compute"); axes[0].legend(fontsize=7)
fig.tight_layout()
save_png(fig, os.path.join(out, "pipeline.png"))
PY
echo "pipeline: results in $EXP_OUT (table.md, summary.json, pipeline.png)" >&2
