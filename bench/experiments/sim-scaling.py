#!/usr/bin/python3
"""sim-scaling.py - cluster experiments past one machine, simulated by tools/kvrelay-sim under an
H100-like profile (docs/simulator.md, "Experiments past one machine"). Each experiment is one
command and writes a markdown table, a JSON of every figure and a PNG:

  bench/experiments/sim-scaling.py pd-ratio        P:D ratio at 16 nodes, node counts 2+2 .. 64+64
  bench/experiments/sim-scaling.py policy-memory   sustainable rate per KV policy, fixed decode memory
  bench/experiments/sim-scaling.py compression-pd  how compression moves the best P:D ratio
  bench/experiments/sim-scaling.py link-speed      10..400 Gb/s links, f32 vs bf16 wire, full vs snapkv,
                                                   with and without layer-wise pipelining
  bench/experiments/sim-scaling.py all

Flags: --quick (fewer bisection steps and requests: about a third of the time), --out DIR
(default bench/results/sim-scaling/), --profile FILE (default
tools/sim-profiles/h100-llama8b-400g.json), --docs (also copy the PNGs to docs/simulator-*.png).

What it is not: a measurement. Every figure is the simulator's under a hand-written profile
(each number's source is in the profile); the validation against real runs is on this machine's
small model only. "Sustainable rate": the highest Poisson rate at which >= 90% of the requests
meet the SLO, found by doubling then bisection (each point a fresh simulated run of 30 s of
arrivals after 3 s of warmup; --quick: 15 s and one bisection step less).
"""
import argparse
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from plots import save_png  # noqa: E402

_loader = importlib.machinery.SourceFileLoader("kvrelay_sim", os.path.join(SRC, "tools", "kvrelay-sim"))
sim = importlib.util.module_from_spec(importlib.util.spec_from_loader(_loader.name, _loader))
_loader.exec_module(sim)

PROMPT, OUTPUT = "1024:4096", "256"
SLO = "ttft_ms=2000,tpot_ms=60"
BASE = ["--prompt-len", PROMPT, "--output-len", OUTPUT, "--kv-dtype", "bf16", "--chunk", "2048",
        "--kv-memory", "50G", "--max-batch", "256", "--slo", SLO]
NOTE = ("Prompts uniform in %s tokens, %s output tokens, Poisson arrivals; decode pools of 50 GiB "
        "(what an 80 GB H100 keeps after 16 GB of weights and activations) unless said; chunk 2048; "
        "bf16 wire unless said; SLO %s; sustainable = the highest rate with >= 90%% of the requests "
        "meeting it." % (PROMPT, OUTPUT, SLO.replace(",", ", ")))


class Exp:
    def __init__(self, args):
        self.args, self.prof0 = args, sim.read_profile(args.profile)
        self.steps = 4 if args.quick else 5
        self.duration = 15 if args.quick else 30
        self.t0 = time.monotonic()

    def log(self, msg):
        print("sim-scaling: [%4.0f s] %s" % (time.monotonic() - self.t0, msg), file=sys.stderr, flush=True)

    def attain(self, prof, argv, rate):
        """(fraction of requests meeting the SLO, summary) of a run at `rate`: 3 s of warmup, then
        DURATION s of arrivals, long against a request's life (a few seconds), so that a queue
        that grows shows."""
        d = sim.sim_json(argv + ["--rate", "%g" % rate, "--duration", str(self.duration),
                                 "--warmup", str(max(1, int(3 * rate)))], prof)
        s = d["runs"][0]["summary"]
        return s["good"] / s["requests"], s

    def sustainable(self, argv, nodes, prof=None, guess=2.0):
        """(highest rate meeting the SLO for >= 90% of requests, that run's summary)."""
        prof = prof or self.prof0
        lo, lo_s, hi = 0.0, None, guess * nodes
        while True:  # double until a rate fails
            a, s = self.attain(prof, argv, hi)
            if a < 0.9:
                break
            lo, lo_s, hi = hi, s, hi * 2
        for _ in range(self.steps):
            mid = (lo + hi) / 2 if lo > 0 else hi / 2
            a, s = self.attain(prof, argv, mid)
            if a >= 0.9:
                lo, lo_s = mid, s
            else:
                hi = mid
        return lo, lo_s

    def write(self, name, lines, fig, data):
        out = os.path.join(self.args.out, name)
        os.makedirs(out, exist_ok=True)
        lines = ["Simulated (tools/kvrelay-sim, profile `%s`): %s" % (os.path.basename(self.args.profile), NOTE),
                 ""] + lines
        with open(os.path.join(out, "table.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(out, "%s.json" % name), "w") as f:
            json.dump(data, f, indent=1)
        png = os.path.join(out, "%s.png" % name)
        save_png(fig, png)
        if self.args.docs:
            shutil.copy(png, os.path.join(SRC, "docs", "simulator-%s.png" % name))
        print("\n".join(lines))
        self.log("%s: results in %s" % (name, out))


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as p
    return p


def ratio_sweep(e, policy, total=16):
    rows = []
    for p in range(2, total - 1, 2):
        d = total - p
        rate, s = e.sustainable(BASE + ["--prefill", str(p), "--decode", str(d), "--policy", policy], total)
        e.log("%s, %d+%d: %.1f req/s" % (policy, p, d, rate))
        rows.append({"prefill": p, "decode": d, "policy": policy, "rate": rate, "per_node": rate / total,
                     "ttft_p90": s["ttft_ms"]["p90"] if s else None, "tpot_p90": s["tpot_ms"]["p90"] if s else None})
    return rows


def fmt(x, f="%.1f"):
    return f % x if x is not None else "-"


def exp_pd_ratio(e):
    ratio = ratio_sweep(e, "full")
    best = max(ratio, key=lambda r: r["rate"])
    frac = best["prefill"] / (best["prefill"] + best["decode"])
    scale = []
    for n in (2, 8, 32, 64):
        for tag, p, d in (("1:1", n, n), ("best", max(1, round(2 * n * frac)), 2 * n - max(1, round(2 * n * frac)))):
            rate, s = e.sustainable(BASE + ["--prefill", str(p), "--decode", str(d), "--policy", "full"], 2 * n)
            e.log("scale %s %d+%d: %.1f req/s" % (tag, p, d, rate))
            scale.append({"layout": tag, "prefill": p, "decode": d, "rate": rate, "per_node": rate / (2 * n),
                          "ttft_p90": s["ttft_ms"]["p90"] if s else None, "tpot_p90": s["tpot_ms"]["p90"] if s else None})
    lines = ["P:D at 16 nodes, policy full:", "", "| P:D | sustainable req/s | per node | TTFT p90 ms | TPOT p90 ms |",
             "|---|---|---|---|---|"]
    lines += ["| %d:%d | %.1f | %.2f | %s | %s |" % (r["prefill"], r["decode"], r["rate"], r["per_node"],
                                                    fmt(r["ttft_p90"], "%.0f"), fmt(r["tpot_p90"])) for r in ratio]
    lines += ["", "Node counts (1:1, and the 16-node best ratio %d:%d scaled):" % (best["prefill"], best["decode"]), "",
              "| layout | P+D | sustainable req/s | per node | TTFT p90 ms | TPOT p90 ms |", "|---|---|---|---|---|---|"]
    lines += ["| %s | %d+%d | %.1f | %.2f | %s | %s |" % (r["layout"], r["prefill"], r["decode"], r["rate"], r["per_node"],
                                                         fmt(r["ttft_p90"], "%.0f"), fmt(r["tpot_p90"])) for r in scale]
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(10, 3.4))
    a1.plot([r["prefill"] for r in ratio], [r["rate"] for r in ratio], "o-")
    a1.set_xlabel("prefill nodes (of 16; the rest decode)")
    a1.set_ylabel("sustainable req/s")
    a1.set_title("P:D ratio at 16 nodes (full)", fontsize=9)
    for tag, m in (("1:1", "o-"), ("best", "s--")):
        xs = [r for r in scale if r["layout"] == tag]
        a2.plot([r["prefill"] + r["decode"] for r in xs], [r["per_node"] for r in xs], m,
                label="%s" % ("1:1" if tag == "1:1" else "%d:%d scaled" % (best["prefill"], best["decode"])))
    a2.set_xscale("log", base=2)
    a2.set_xlabel("nodes (P + D)")
    a2.set_ylabel("sustainable req/s per node")
    a2.set_title("node counts up to 64 + 64", fontsize=9)
    a2.legend(fontsize=7)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    e.write("pd-ratio", lines, fig, {"ratio": ratio, "scale": scale})


POLICIES = ("full", "streaming:sink=4,window=1020", "snapkv:budget=1024", "take:budget=1024", "sage:budget=1024")


def exp_policy_memory(e):
    rows = []
    for mem in ("8G", "50G"):
        for pol in POLICIES:
            argv = BASE + ["--prefill", "4", "--decode", "4", "--kv-memory", mem, "--policy", pol]
            rate, s = e.sustainable(argv, 8)
            e.log("%s, %s pools: %.1f req/s" % (pol, mem, rate))
            rows.append({"memory": mem, "policy": pol, "rate": rate,
                         "kv_mb_per_req": s["kv_bytes_shipped"] / s["ok"] / 1e6 if s and s["ok"] else None,
                         "ttft_p90": s["ttft_ms"]["p90"] if s else None, "tpot_p90": s["tpot_ms"]["p90"] if s else None,
                         "queue_p90": s["queue_ms"]["p90"] if s else None})
    lines = ["4 prefill + 4 decode nodes, decode pools of 8 GiB (memory-bound) and 50 GiB per node:", "",
             "| decode pool | policy | sustainable req/s | KV shipped MB/request | TTFT p90 ms | TPOT p90 ms | queue p90 ms |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| %s | `%s` | %.1f | %s | %s | %s | %s |" % (r["memory"], r["policy"], r["rate"], fmt(r["kv_mb_per_req"]),
                                                            fmt(r["ttft_p90"], "%.0f"), fmt(r["tpot_p90"]),
                                                            fmt(r["queue_p90"], "%.0f")) for r in rows]
    p = plt()
    fig, ax = p.subplots(figsize=(8, 3.4))
    w = 0.38
    for k, mem in enumerate(("8G", "50G")):
        xs = [r for r in rows if r["memory"] == mem]
        ax.bar([i + (k - 0.5) * w for i in range(len(xs))], [r["rate"] for r in xs], w, label="%sB decode pools" % mem)
    ax.set_xticks(range(len(POLICIES)))
    ax.set_xticklabels([x.split(":")[0] + ("\n" + x.split(":")[1] if ":" in x else "") for x in POLICIES], fontsize=7)
    ax.set_ylabel("sustainable req/s (4+4 nodes)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    e.write("policy-memory", lines, fig, {"rows": rows})


def exp_compression_pd(e):
    res = {}
    for pol in ("full", "snapkv:budget=512"):
        res[pol] = ratio_sweep(e, pol)
    lines = ["16 nodes, P:D swept, full against patched SnapKV at 512 entries per list:", "",
             "| P:D | full req/s | snapkv:budget=512 req/s |", "|---|---|---|"]
    for a, b in zip(res["full"], res["snapkv:budget=512"]):
        lines.append("| %d:%d | %.1f | %.1f |" % (a["prefill"], a["decode"], a["rate"], b["rate"]))
    for pol, rows in res.items():
        best = max(rows, key=lambda r: r["rate"])
        lines.append("")
        lines.append("Best for `%s`: %d:%d (%.1f req/s)." % (pol, best["prefill"], best["decode"], best["rate"]))
    p = plt()
    fig, ax = p.subplots(figsize=(6, 3.4))
    for pol, rows in res.items():
        ax.plot([r["prefill"] for r in rows], [r["rate"] for r in rows], "o-", label=pol)
    ax.set_xlabel("prefill nodes (of 16; the rest decode)")
    ax.set_ylabel("sustainable req/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    e.write("compression-pd", lines, fig, res)


def exp_link_speed(e):
    rows = []
    for gbit in (10, 25, 100, 400):
        prof = json.loads(json.dumps(e.prof0))
        prof["transfer"]["bandwidth_Bps"] = gbit / 8 * 1e9 * 0.8
        for pol in ("full", "snapkv:budget=512"):
            for dt, pipe in (("f32", "off"), ("bf16", "off"), ("f32", "on"), ("bf16", "on")):
                argv = BASE + ["--prefill", "8", "--decode", "8", "--policy", pol, "--kv-dtype", dt,
                               "--pipeline", pipe]
                rate, s = e.sustainable(argv, 16, prof)
                fixed = sim.sim_json(argv + ["--rate", "30", "--num-requests", "600"], prof)["runs"][0]["summary"]
                costs = sim.Costs(prof, 2048, dt, pipe == "on")
                fp = sim.Footprint(pol)
                _, wire = costs.bundle_bytes(fp.kept(2560))
                e.log("%d Gb/s %s %s pipeline %s: %.1f req/s" % (gbit, pol, dt, pipe, rate))
                rows.append({"gbit": gbit, "policy": pol, "dtype": dt, "pipeline": pipe, "rate": rate,
                             "transfer_ms": 1e3 * costs.transfer_s(wire),
                             "after_prefill_ms": 1e3 * costs.transfer_after_prefill_s(2560, fp, wire),
                             "ttft_p50": fixed["ttft_ms"]["p50"], "ttft_p90": fixed["ttft_ms"]["p90"]})
    lines = ["8 prefill + 8 decode nodes; link speed at 80% efficiency; transfer of a 2560-token prompt's "
             "bundle (the mean prompt), and what of it is left when the prefill's compute ends (all of it "
             "without pipelining; with it, what the parts sent during the prefill did not cover); TTFT at "
             "a fixed 30 req/s:", "",
             "| link Gb/s | policy | wire | pipeline | transfer ms (2560 tokens) | left after the prefill ms | "
             "TTFT p50 / p90 ms at 30 req/s | sustainable req/s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += ["| %d | `%s` | %s | %s | %.1f | %.1f | %.0f / %.0f | %.1f |" % (
        r["gbit"], r["policy"], r["dtype"], r["pipeline"], r["transfer_ms"], r["after_prefill_ms"],
        r["ttft_p50"], r["ttft_p90"], r["rate"]) for r in rows]
    p = plt()
    fig, (a1, a2) = p.subplots(1, 2, figsize=(10, 3.4))
    for pol in ("full", "snapkv:budget=512"):
        for dt, pipe, m in (("f32", "off", "o-"), ("bf16", "off", "s--"), ("f32", "on", "^:"), ("bf16", "on", "v-.")):
            xs = [r for r in rows if (r["policy"], r["dtype"], r["pipeline"]) == (pol, dt, pipe)]
            label = "%s, %s, pipeline %s" % (pol, dt, pipe)
            a1.plot([r["gbit"] for r in xs], [r["ttft_p50"] for r in xs], m, label=label)
            a2.plot([r["gbit"] for r in xs], [r["rate"] for r in xs], m, label=label)
    a1.set_ylabel("TTFT p50 at 30 req/s (ms)")
    a2.set_ylabel("sustainable req/s (8+8)")
    for a in (a1, a2):
        a.set_xscale("log")
        a.set_xlabel("link Gb/s")
        a.grid(alpha=0.3)
        a.legend(fontsize=5)
    fig.tight_layout()
    e.write("link-speed", lines, fig, {"rows": rows})


EXPERIMENTS = {"pd-ratio": exp_pd_ratio, "policy-memory": exp_policy_memory,
               "compression-pd": exp_compression_pd, "link-speed": exp_link_speed}


def main(argv):
    ap = argparse.ArgumentParser(prog="sim-scaling.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=sorted(EXPERIMENTS) + ["all"])
    ap.add_argument("--quick", action="store_true", help="fewer bisection steps and requests")
    ap.add_argument("--out", default=os.path.join(SRC, "bench", "results", "sim-scaling"), metavar="DIR")
    ap.add_argument("--profile", default=os.path.join(SRC, "tools", "sim-profiles", "h100-llama8b-400g.json"))
    ap.add_argument("--docs", action="store_true", help="copy the PNGs to docs/simulator-*.png")
    a = ap.parse_args(argv)
    e = Exp(a)
    for name in (sorted(EXPERIMENTS) if a.experiment == "all" else [a.experiment]):
        EXPERIMENTS[name](e)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except sim.SimError as err:
        print("sim-scaling: error: %s" % err, file=sys.stderr)
        sys.exit(2)
