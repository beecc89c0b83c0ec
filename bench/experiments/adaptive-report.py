"""adaptive-report.py - the table, summary and plot of bench/experiments/adaptive.sh.

    adaptive-report.py OUT MACHINE KV_BLOCKS CHUNK FLOOR RUN DECODE_LOG POLICY|RATE|LOAD.json|QUALITY.json|EVAL_S...

For each policy and offered rate: the load's goodput and latencies (kvrelay-bench-serve's JSON)
and the quality kvrelay-eval measured beside it (its JSON: the policy's records and full's on the
same cases). The kv score is the policy's correct answers over full's on the same cases, with a
one-sided 95% Wilson interval (z = 1.645) on the policy's accuracy, divided by full's, as
docs/adaptive.md scores the calibration table; text is the top-1 agreement with full.
"""
import json
import math
import os
import re
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from plots import save_png  # noqa: E402

Z = 1.645


def wilson(p, n, sign):
    """One-sided Wilson bound of a proportion p over n trials: lower for sign -1, upper for +1."""
    if n == 0:
        return float("nan")
    d = 1 + Z * Z / n
    c = p + Z * Z / (2 * n)
    r = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return (c + sign * r) / d


def quality(path, spec):
    """The policy's delivered quality in one kvrelay-eval result: kv score against full with its
    interval, text agreement, case counts and, for auto, the specs served."""
    if not os.path.exists(path):
        return None
    recs = json.load(open(path))["records"]
    mine = [r for r in recs if r["policy"] == spec]
    full = {(r["task"], r["length"]): r for r in recs if r["policy"] == "full"}
    kv = [r for r in mine if r["task"] == "kv"]
    n = sum(r["cases"] for r in kv)
    ok = sum(round(r["accuracy"] * r["cases"]) for r in kv)
    ref = sum(round(full[(r["task"], r["length"])]["accuracy"] * r["cases"]) for r in kv)
    text = [r for r in mine if r["task"] == "text"]
    q = {"kv_cases": n, "kv_correct": ok, "kv_full_correct": ref,
         "kv_by_length": {str(r["length"]): r["accuracy"] for r in kv},
         "text_top1": sum(r["top1_agreement"] * r["cases"] for r in text) / sum(r["cases"] for r in text)
         if text else None,
         "auto_choices": {}, "auto_pressure": {}}
    if n and ref:
        full_acc = ref / n
        q["kv_score"] = ok / ref
        q["kv_score_low"] = wilson(ok / n, n, -1) / full_acc
        q["kv_score_high"] = min(wilson(ok / n, n, 1) / full_acc, 1.0)
    for r in mine:
        for key in ("auto_choices", "auto_pressure"):
            for k, v in r.get(key, {}).items():
                q[key][k] = q[key].get(k, 0) + v
    return q


def blocks_by_spec(decode_log, output_len):
    """Mean decode blocks the decode node reserved per load request (max_tokens = output_len),
    by the spec it was asked to serve."""
    got = {}
    for line in open(decode_log, errors="replace"):
        m = re.search(r"reserved (\d+) blocks as reservation \d+ \(\d+ prompt tokens, (\d+) max_tokens, "
                      r"(.*), ttl -?\d+ ms\)", line)
        if m and int(m.group(2)) == output_len:
            got.setdefault(m.group(3), []).append(int(m.group(1)))
    return {k: sum(v) / len(v) for k, v in got.items()}


def main(argv):
    out, machine, kv_blocks, chunk, floor, run_s, decode_log = argv[1:8]
    floor = float(floor)
    policies, order = {}, []
    for item in argv[8:]:
        spec, rate, lf, qf, eval_s = item.split("|")
        d = json.load(open(lf))
        s = d["runs"][0]["summary"]
        if spec not in policies:
            policies[spec] = {"policy": spec, "runs": [], "prompt_len": d["prompt_len"],
                              "output_len": d["output_len"], "slo": d["slo"]}
            order.append(spec)
        q = quality(qf, spec)
        policies[spec]["runs"].append({
            "rate": float(rate), "requests": s["requests"], "ok": s["ok"], "good": s["good"],
            "errors": sum(s["errors"].values()), "goodput": s["goodput"], "throughput": s["request_throughput"],
            "attainment": s["good"] / s["requests"] if s["requests"] else 0.0,
            "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "tpot_p50": s["tpot_ms"]["p50"], "tpot_p99": s["tpot_ms"]["p99"],
            "footprint": s["kv_footprint_mean"], "load_auto_choices": s.get("auto_choices"),
            "load_auto_pressure": s.get("auto_pressure"), "quality": q, "eval_s": float(eval_s),
            "load_s": s["duration_s"]})
    olen = policies[order[0]]["output_len"][0]
    blocks = blocks_by_spec(decode_log, olen)
    for p in policies.values():
        sustainable = None
        for x in sorted(p["runs"], key=lambda x: x["rate"]):
            if x["attainment"] < 0.9:
                break
            sustainable = x["rate"]
        p["sustainable_rate"] = sustainable
        p["peak_goodput"] = max(x["goodput"] for x in p["runs"])
        scores = [x["quality"]["kv_score"] for x in p["runs"] if x["quality"] and "kv_score" in x["quality"]]
        p["kv_score_min"] = min(scores) if scores else None
        p["kv_score_same_every_rate"] = len(set(scores)) <= 1 if scores else None
        texts = [x["quality"]["text_top1"] for x in p["runs"] if x["quality"] and x["quality"]["text_top1"] is not None]
        p["text_top1_min"] = min(texts) if texts else None
        p["blocks_per_request"] = blocks.get(p["policy"])
        chosen = {}
        for x in p["runs"]:
            for k, v in (x["load_auto_choices"] or {}).items():
                chosen[k] = chosen.get(k, 0) + v
        if chosen and all(k in blocks for k in chosen):  # auto: the served specs' means, weighted
            p["blocks_per_request"] = sum(blocks[k] * v for k, v in chosen.items()) / sum(chosen.values())
    auto = next((p for p in policies.values() if p["policy"].startswith("auto")), None)
    full = policies.get("full")
    fixed_ok = [p for p in policies.values() if p is not auto and p["kv_score_min"] is not None
                and p["kv_score_min"] >= floor]
    best = max(fixed_ok, key=lambda p: p["sustainable_rate"] or 0, default=None)
    verdict = {}
    if auto and full:
        a, b, f = auto["sustainable_rate"] or 0, (best["sustainable_rate"] or 0) if best else 0, full["sustainable_rate"] or 0
        held = [x for x in auto["runs"] if x["quality"] and "kv_score" in x["quality"]]
        verdict = {"auto_sustainable": a, "best_fixed_holding_floor": best["policy"] if best else None,
                   "best_fixed_sustainable": b, "full_sustainable": f,
                   "auto_vs_best_fixed": a >= b, "auto_vs_full": a / f if f else None,
                   "auto_quality_within_error": bool(held) and all(x["quality"]["kv_score_high"] >= floor for x in held),
                   "auto_quality_point_estimate_min": min((x["quality"]["kv_score"] for x in held), default=None),
                   "auto_quality_rates_measured": len(held), "auto_quality_rates": len(auto["runs"])}
    summary = {"machine": machine, "kv_blocks": int(kv_blocks), "chunk": int(chunk), "floor": floor,
               "run_s": float(run_s), "policies": [policies[k] for k in order], "verdict": verdict}
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    for i, k in enumerate(order):  # one colour per policy in both panels
        p = policies[k]
        ax1.plot([x["rate"] for x in p["runs"]], [x["goodput"] for x in p["runs"]], marker="o", label=k,
                 color="C%d" % i)
        pts = [(x["rate"], x["quality"]["kv_score"]) for x in p["runs"] if x["quality"] and "kv_score" in x["quality"]]
        if k != "full" and pts:
            ax2.plot([r for r, _ in pts], [v for _, v in pts], marker="o", label=k, color="C%d" % i)
    rates = sorted({x["rate"] for p in policies.values() for x in p["runs"]})
    ax1.plot(rates, rates, color="0.6", linestyle=":", label="offered")
    ax1.set_xlabel("offered rate (req/s, Poisson)")
    ax1.set_ylabel("goodput (req/s within the SLO)")
    ax1.set_title("goodput, decode pool %s blocks" % kv_blocks, fontsize=9)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    ax2.axhline(floor, color="0.5", linestyle="--", label="floor %.2f" % floor)
    ax2.set_xlabel("offered rate (req/s, Poisson)")
    ax2.set_ylabel("kv score delivered under the load (x full)")
    ax2.set_title("retrieval quality measured beside the load", fontsize=9)
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, os.path.join(out, "adaptive.png"))

    def fmt(v, spec="%.2f"):
        return "—" if v is None else spec % v
    slo = policies[order[0]]["slo"]
    plen = policies[order[0]]["prompt_len"]
    lines = ["Machine: %s. Model: models/kjv-2l128-2k (its calibration.json). Decode pool %s blocks of 16 "
             "entries, prefill chunk %s, 1 thread per node. Load: %d-%d-token prompts (uniform), %d output "
             "tokens, Poisson, %s s per rate; beside it kvrelay-eval's kv and text cases at 512, 1024 and "
             "2048 tokens under the same policy. SLO: %s. Sustainable: the highest swept rate at which >= 90%% "
             "of the load's requests (and at every lower rate) met the SLO." % (
                 machine, kv_blocks, chunk, plen[0], plen[1], olen, run_s,
                 ", ".join("%s <= %g" % kv for kv in slo.items())), "",
             "| policy | decode blocks per load request (mean) | goodput at each offered rate (req/s) | highest sustainable rate | kv score delivered (min over rates; same at every rate) | text top-1 (min) |",
             "|---|---|---|---|---|---|"]
    for k in order:
        p = policies[k]
        lines.append("| `%s` | %s | %s | %s | %s%s | %s |" % (
            k, fmt(p["blocks_per_request"], "%.0f"),
            ", ".join("%.3g: %.2f" % (x["rate"], x["goodput"]) for x in p["runs"]),
            fmt(p["sustainable_rate"], "%.3g req/s") if p["sustainable_rate"] else "< %.3g req/s" % p["runs"][0]["rate"],
            fmt(p["kv_score_min"]), "" if p["kv_score_same_every_rate"] is None else
            ("; yes" if p["kv_score_same_every_rate"] else "; no"), fmt(p["text_top1_min"])))
    if auto:
        lines += ["", "`%s` per rate: what the router chose (the load's requests and the evaluation's) and the "
                  "quality delivered (kv score with its one-sided 95%% Wilson interval over the cases; the "
                  "evaluation's time against the load's):" % auto["policy"], "",
                  "| offered req/s | goodput | TTFT p50 / p99 ms | TPOT p50 / p99 ms | pressure (load) | specs served (load) | kv score [low, high] (cases) | text top-1 | eval s / load s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for x in auto["runs"]:
            q = x["quality"] or {}
            lines.append("| %.3g | %.2f | %.0f / %.0f | %.2f / %.2f | %s | %s | %s | %s | %.0f / %.0f |" % (
                x["rate"], x["goodput"], x["ttft_p50"], x["ttft_p99"], x["tpot_p50"], x["tpot_p99"],
                ", ".join("%s %d" % kv for kv in (x["load_auto_pressure"] or {}).items()) or "—",
                "; ".join("`%s` %d" % kv for kv in (x["load_auto_choices"] or {}).items()) or "—",
                "%.3f [%.3f, %.3f] (%d)" % (q["kv_score"], q["kv_score_low"], q["kv_score_high"], q["kv_cases"])
                if "kv_score" in q else "—", fmt(q.get("text_top1")), x["eval_s"] + 5, x["load_s"]))
    lines += ["", "Per rate (every policy):", "",
              "| policy | offered req/s | served req/s | goodput | attainment | TTFT p50 / p99 | TPOT p50 / p99 | errors |",
              "|---|---|---|---|---|---|---|---|"]
    for k in order:
        for x in policies[k]["runs"]:
            lines.append("| `%s` | %.3g | %.2f | %.2f | %.0f%% | %.0f / %.0f | %.2f / %.2f | %d |" % (
                k.split(":")[0] if not k.startswith("auto") else k, x["rate"], x["throughput"], x["goodput"],
                100 * x["attainment"], x["ttft_p50"], x["ttft_p99"], x["tpot_p50"], x["tpot_p99"], x["errors"]))
    if verdict:
        lines += ["", "Verdict: auto sustains %.3g req/s; the best fixed policy whose delivered kv score is >= %.2f "
                  "(%s) sustains %.3g (auto %s); full sustains %.3g (auto / full %s); auto's delivered kv score "
                  "at every rate is %s the floor within its sampling error (lowest point estimate %s)." % (
                      verdict["auto_sustainable"], floor, verdict["best_fixed_holding_floor"],
                      verdict["best_fixed_sustainable"], ">= it" if verdict["auto_vs_best_fixed"] else "below it",
                      verdict["full_sustainable"], fmt(verdict["auto_vs_full"]),
                      "at or above" if verdict["auto_quality_within_error"] else "NOT at or above",
                      fmt(verdict["auto_quality_point_estimate_min"], "%.3f"))]
    open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
