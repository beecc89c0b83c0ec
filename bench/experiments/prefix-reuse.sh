#!/usr/bin/env bash
# prefix-reuse.sh - what the prefill nodes' prefix cache and the router's kv-aware placement save
# (docs/benchmarks.md, "Prefix reuse"; docs/prefix-cache.md): both workloads of
# kvrelay-bench-serve (chat: conversations resending everything so far; shared-prefix: questions
# on a few long documents), under `full` and an evicting policy that reuses (StreamingLLM), on
# four clusters of this machine's processes, 1 thread per node, a fresh one per cell:
#   P1-off  1 prefill + 1 decode, the cache off (--prefix-cache-memory 0): the baseline
#   P1-on   1 prefill + 1 decode, the cache on (the node's default budget)
#   P2-kv   2 prefill + 1 decode, the cache on, the router's kv-aware placement
#   P2-rr   2 prefill + 1 decode, the cache on, round-robin placement
# Per cell: prompt tokens, prefill tokens computed (prompt - cached), the hit rate (requests that
# reused any), cached tokens, TTFT p50 / p99, TPOT p50, goodput, errors (cache pressure must
# fail none), the KV blocks the prefill and decode pools still hold once the load is over (0
# unless a block leaked; the cache has its own memory), and the cached tokens
# tools/kvrelay-sim predicts for the same cell (its model of the cache and of placement). Then a capacity row, measured
# from the nodes: one prefill node with a small cache budget is filled with distinct 512-token
# prompts until it evicts, under `full` and under the evicting policies at budget fraction 0.1
# (51 entries per list: streaming and naive SnapKV), and kvrelay-cli status reports the states
# and bytes it holds. Writes table.md, summary.json, prefix-reuse.png, one kvrelay-bench-serve
# JSON per cell (WORKLOAD-POLICY-CLUSTER.json) and the clusters' logs (logs/). Not a test: the
# figures depend on the machine; run it on an idle one.
#
#   bench/experiments/prefix-reuse.sh [--bin DIR] [--quick] [--shape CONFIG] [--out DIR]
#
# --bin DIR: built programs (default build/: ./kvrelay build; kvrelay-cli too). --quick: 4
# conversations of 3 turns and 12 shared-prefix requests per cell, 40 capacity prompts (about 2
# minutes) instead of 24 conversations of 4 turns, 96 requests and 80 prompts (about 10).
# --shape CONFIG: the chat workload alone, cache off and on with one prefill node, on a model of
# that config's shape with random weights (e.g. tools/data/llama-110m.json), conversations opened
# at a quarter of the rate: a model whose prefill, not the RPCs and the transfer around it, is
# most of a turn's TTFT, at a load the cache-off node still keeps up with (about 7 minutes for
# llama-110m). --out DIR: where results go (default bench/results/prefix-reuse/).
#
# Requests: the default model (2 layers, 4 KV heads of 32, bf16 cache), prefill chunk 64 (the
# granularity of reuse; the router's --prefill-chunk the same), greedy with --ignore-eos. Chat:
# a 256-token system prompt, 64-token messages, 32-token answers, think time 0.5 s,
# conversations opened at RATE per second. Shared-prefix: 4 documents of 1024 tokens, 64-token
# questions, 16 output tokens, at RATE per second. SLO for goodput: TTFT <= 1000 ms, TPOT <= 50 ms.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
EXP_TAKES_SHAPE=1
exp_parse prefix-reuse "$@"
[ -x "$EXP_BIN/kvrelay-cli" ] || { echo "prefix-reuse: $EXP_BIN has no kvrelay-cli" >&2; exit 2; }

CHUNK=64 SLO=ttft_ms=1000,tpot_ms=50
POLICIES=(full "streaming:sink=4,window=60")
# budget fraction 0.1 of a 512-token prompt: 51 entries per list
CAP_POLICIES=(full "streaming:sink=4,window=47" "snapkv:mode=naive,budget=51,obs=16")
CAP_PROMPT=512 CAP_MEMORY=2M
if [ "$EXP_QUICK" = 1 ]; then
  CONVS=4 TURNS=3 CHAT_RATE=2 SP_REQS=12 SP_RATE=4 CAP_N=40
else
  CONVS=24 TURNS=4 CHAT_RATE=1 SP_REQS=96 SP_RATE=4 CAP_N=80
fi
CLUSTERS=("P1-off 1 0 kv-aware" "P1-on 1 on kv-aware" "P2-kv 2 on kv-aware" "P2-rr 2 on round-robin")
WORKLOADS=(chat shared-prefix) model="Default model"
if [ -n "$EXP_SHAPE" ]; then
  exp_shape_model "$EXP_SHAPE"
  WORKLOADS=(chat) CLUSTERS=("${CLUSTERS[@]:0:2}") CAP_POLICIES=()
  CHAT_RATE=$("$EXP_PY" -c "print($CHAT_RATE / 4)")
  model="The shape of $(basename "$EXP_SHAPE") with random bf16 weights (kvrelay-make-model)"
fi
machine=$(exp_machine)

cluster() { # cluster TAG N_PREFILL CACHE(0|on|SIZE) PLACEMENT
  KRC_PREFILL_ARGS=(--chunk "$CHUNK")
  [ "$3" = on ] || KRC_PREFILL_ARGS+=(--prefix-cache-memory "$3")
  KRC_ROUTER_ARGS=(--placement "$4" --prefill-chunk "$CHUNK")
  exp_cluster_start "$1" "$2" 1 --threads 1
}

# held N_PREFILL: KV blocks still held once the load is over, prefill pools and decode pool
# together (the prefix cache has its own memory): anything but 0 is a leak
held() {
  local i used=0 u
  for ((i = 0; i < $1; i++)); do
    u=$(curl -sf "http://$(krc_http prefill-$i)/metrics" | awk '$1 == "kvrelay_kv_blocks_used" { print $2 }')
    used=$((used + ${u:-0}))
  done
  u=$("$EXP_PY" -c 'import json, sys
print(sum(n["total_kv_blocks"] - n["free_kv_blocks"] for n in json.load(sys.stdin)["nodes"] if n["role"] == "decode"))' \
    <"$(ls -t "$EXP_OUT"/*.status.json | head -1)")
  echo $((used + u))
}

files=()
for w in "${WORKLOADS[@]}"; do
  if [ "$w" = chat ]; then
    load=(--workload chat --conversations "$CONVS" --turns "$TURNS" --think-time 0.5 --prefix-len 256
      --message-len 64 --output-len 32 --rate "$CHAT_RATE")
  else
    load=(--workload shared-prefix --prefixes 4 --prefix-len 1024 --message-len 64 --output-len 16
      --num-requests "$SP_REQS" --rate "$SP_RATE")
  fi
  for p in "${POLICIES[@]}"; do
    for c in "${CLUSTERS[@]}"; do
      read -r tag np cache placement <<<"$c"
      f=$EXP_OUT/$w-${p%%:*}-$tag.json
      cluster "$w-${p%%:*}-$tag" "$np" "$cache" "$placement"
      echo "prefix-reuse: $w, $p, $tag" >&2
      "$EXP_BENCH" --target "$KRC_ROUTER" "${load[@]}" --policy "$p" --ignore-eos --slo "$SLO" --timeout 300 \
        --json "$f" --no-progress >"${f%.json}.txt"
      "$EXP_BIN/kvrelay-cli" --router "$KRC_ROUTER" status --json >"${f%.json}.status.json"
      held "$np" >"${f%.json}.held"
      exp_cluster_stop
      # the simulator's prediction of the same cell (the cache's rules, not its costs)
      sim=(--prefill "$np" --placement "$placement" --chunk "$CHUNK")
      [ "$cache" = on ] || sim+=(--prefix-cache-memory "$cache")
      "$EXP_PY" "$EXP_HERE/tools/kvrelay-sim" run "${load[@]}" "${sim[@]}" --policy "$p" --slo "$SLO" \
        --json "${f%.json}.sim.json" --no-progress >/dev/null
      files+=("$f")
    done
  done
done

# capacity: distinct prompts into one node's small cache until it evicts; what it then holds
caps=()
for p in ${CAP_POLICIES[@]+"${CAP_POLICIES[@]}"}; do
  tag=capacity-${p%%:*}
  cluster "$tag" 1 "$CAP_MEMORY" kv-aware
  echo "prefix-reuse: capacity, $p, $CAP_N prompts of $CAP_PROMPT tokens into $CAP_MEMORY" >&2
  "$EXP_BENCH" --target "$KRC_ROUTER" --concurrency 1 --num-requests "$CAP_N" --prompt-len "$CAP_PROMPT" \
    --output-len 1 --policy "$p" --timeout 300 --json "$EXP_OUT/$tag.json" --no-progress >"$EXP_OUT/$tag.txt"
  "$EXP_BIN/kvrelay-cli" --router "$KRC_ROUTER" status --json >"$EXP_OUT/$tag.status.json"
  curl -sf "http://$(krc_http prefill-0)/metrics" >"$EXP_OUT/$tag.metrics.txt" || : >"$EXP_OUT/$tag.metrics.txt"
  exp_cluster_stop
  caps+=("$p=$EXP_OUT/$tag")
done

"$EXP_PY" - "$EXP_OUT" "$machine" "$model" "$CAP_MEMORY" "$CAP_PROMPT" "$CAP_N" ${caps[@]+"${caps[@]}"} -- "${files[@]}" <<'PY'
import json, os, re, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plots import save_png

out, machine, model, cap_memory, cap_prompt, cap_n = sys.argv[1:7]
rest = sys.argv[7:]
caps, files = rest[:rest.index("--")], rest[rest.index("--") + 1:]
summary = {"machine": machine, "cells": [], "capacity": []}
for f in files:
    d = json.load(open(f))
    s = d["runs"][0]["summary"]
    w, tag = d["workload"], os.path.basename(f)[:-5].rsplit("-", 2)[-2:]
    nodes = json.load(open(f[:-5] + ".status.json"))["nodes"]
    cached = s.get("cached_tokens") or 0
    sim = json.load(open(f[:-5] + ".sim.json"))["runs"][0]["summary"]
    summary["cells"].append({
        "workload": w, "policy": d["policies"][0], "cluster": "-".join(tag), "requests": s["requests"], "ok": s["ok"],
        "prompt_tokens": s["prompt_tokens"], "cached_tokens": cached,
        "prefill_tokens_computed": s["prompt_tokens"] - cached, "hit_rate": s.get("cache_hit_rate"),
        "reusable_tokens": s.get("reusable_tokens"),
        "node_tokens_reused": sum(n["prefix_cache_tokens_reused"] for n in nodes if n["role"] == "prefill"),
        "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"], "tpot_p50": s["tpot_ms"]["p50"],
        "goodput": s["goodput"], "errors": sum(s["errors"].values()),
        "blocks_held_after": int(open(f[:-5] + ".held").read()),
        "sim_cached_tokens": sim.get("cached_tokens") or 0, "sim_hit_rate": sim.get("cache_hit_rate")})


def metric(text, name, policy):
    m = re.search(r'^%s\{policy="%s"\} (\S+)' % (name, policy), text, re.M)
    return float(m.group(1)) if m else None


for c in caps:
    # SPEC=PATH, the spec with '=' signs of its own: the path is the output directory's
    spec, base = c[:c.rindex("=" + out)], c[c.rindex("=" + out) + 1:]
    node = [n for n in json.load(open(base + ".status.json"))["nodes"] if n["role"] == "prefill"][0]
    text = open(base + ".metrics.txt").read()
    fam = spec.split(":")[0]
    summary["capacity"].append({
        "policy": spec, "prompts": int(cap_n), "prompt_len": int(cap_prompt), "budget_bytes": node["prefix_cache_budget_bytes"],
        "states": node["prefix_cache_entries"], "bytes": node["prefix_cache_bytes"],
        "evictions": metric(text, "kvrelay_prefix_cache_evictions_total", fam),
        "inserts": metric(text, "kvrelay_prefix_cache_inserts_total", fam)})
full_states = next((x["states"] for x in summary["capacity"] if x["policy"] == "full"), None)
for x in summary["capacity"]:
    x["states_over_full"] = x["states"] / full_states if full_states else None
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)

fmt = lambda v, p=0: "-" if v is None else "%.*f" % (p, v)  # noqa: E731
lines = ["Machine: %s. %s, prefill chunk 64, 1 thread per node; `cached` is what the nodes "
         "reported in Usage.cached_tokens; `computed` = prompt - cached; vs off: computed and TTFT p50 over the "
         "same workload and policy with the cache off." % (machine, model), "",
         "| workload | policy | cluster | requests (ok) | prompt tokens | computed | vs off | hit rate | cached | "
         "TTFT p50 / p99 ms | vs off | TPOT p50 ms | goodput req/s | errors | blocks held after | simulated cached |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
base = {(c["workload"], c["policy"]): c for c in summary["cells"] if c["cluster"] == "P1-off"}
for c in summary["cells"]:
    b = base.get((c["workload"], c["policy"]))
    lines.append("| %s | %s | %s | %d (%d) | %d | %d | %s | %s | %d | %s / %s | %s | %s | %s | %d | %d | %d |" % (
        c["workload"], c["policy"], c["cluster"], c["requests"], c["ok"], c["prompt_tokens"],
        c["prefill_tokens_computed"],
        fmt(c["prefill_tokens_computed"] / b["prefill_tokens_computed"], 2) if b and b["prefill_tokens_computed"] else "-",
        fmt(c["hit_rate"], 2), c["cached_tokens"], fmt(c["ttft_p50"], 1), fmt(c["ttft_p99"], 1),
        fmt(c["ttft_p50"] / b["ttft_p50"], 2) if b and b["ttft_p50"] else "-", fmt(c["tpot_p50"], 2),
        fmt(c["goodput"], 2), c["errors"], c["blocks_held_after"], c["sim_cached_tokens"]))
lines += ["", "Capacity (measured: kvrelay-cli status after %s distinct %s-token prompts into one prefill node's "
          "%s budget):" % (cap_n, cap_prompt, cap_memory), "",
          "| policy | states held | bytes held | budget bytes | inserts | evictions | states / full's |",
          "|---|---|---|---|---|---|---|"]
for x in summary["capacity"]:
    lines.append("| %s | %d | %d | %d | %s | %s | %s |" % (x["policy"], x["states"], x["bytes"], x["budget_bytes"],
                                                          fmt(x["inserts"]), fmt(x["evictions"]),
                                                          fmt(x["states_over_full"], 1)))
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))

workloads = list(dict.fromkeys(c["workload"] for c in summary["cells"]))
fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 6.5), squeeze=False)
for j, w in enumerate(workloads):
    cells = [c for c in summary["cells"] if c["workload"] == w]
    labels = ["%s\n%s" % (c["policy"].split(":")[0], c["cluster"]) for c in cells]
    x = range(len(cells))
    axes[0][j].bar(x, [c["prefill_tokens_computed"] for c in cells], color="tab:blue")
    axes[0][j].set_title("%s: prefill tokens computed" % w, fontsize=9)
    axes[1][j].bar(x, [c["ttft_p50"] or 0 for c in cells], color="tab:orange")
    axes[1][j].set_title("%s: TTFT p50 (ms)" % w, fontsize=9)
    for a in (axes[0][j], axes[1][j]):
        a.set_xticks(list(x))
        a.set_xticklabels(labels, fontsize=6)
        a.grid(alpha=0.3, axis="y")
fig.tight_layout()
save_png(fig, os.path.join(out, "prefix-reuse.png"))
PY
echo "prefix-reuse: results in $EXP_OUT (table.md, summary.json, prefix-reuse.png)" >&2
