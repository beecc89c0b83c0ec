"""simulator.py - checks of tools/kvrelay-sim, run by simulator.sh (which says what and why).

  simulator.py SRC WORKDIR
"""
import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys

SRC, WORK = sys.argv[1], sys.argv[2]
TOOL = os.path.join(SRC, "tools", "kvrelay-sim")
VALID = os.path.join(SRC, "bench", "results", "sim-validate")
BOUND = 0.15  # the bound
failures = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        failures.append(msg)


def load(name, path):
    loader = importlib.machinery.SourceFileLoader(name, path)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(mod)
    return mod


def tool(*argv):
    return subprocess.run([sys.executable, TOOL] + list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)


sim = load("kvrelay_sim", TOOL)


def argv_of(real):
    """The simulator's flags for a recorded kvrelay-bench-serve run of sim-validate.sh."""
    rates = ",".join("%g" % r["mode"]["rate"] for r in real["runs"])
    lens = lambda v: "%d:%d" % tuple(v) if v[0] != v[1] else str(v[0])  # noqa: E731
    return ["--rate", rates, "--duration", "%g" % real["duration_s"], "--warmup", str(real["warmup"]),
            "--prompt-len", lens(real["prompt_len"]), "--output-len", lens(real["output_len"]),
            "--seed", str(real["seed"]), "--slo", ",".join("%s=%g" % kv for kv in real["slo"].items())] + \
        sum((["--policy", p] for p in real["policies"]), [])


# 1. the small validation case: the committed real 1 + 1 runs, simulated again as the validation
#    did (the profile calibrated beside them, the median of 9 jitter replicas, compute costs scaled
#    by the probes taken before the real runs): at both rates every figure within the 15%
real = json.load(open(os.path.join(VALID, "real-P1-D1.json")))
scale = json.load(open(os.path.join(VALID, "sim-P1-D1.json")))["sim"]["compute_scale"]
simd = sim.sim_json(argv_of(real) + ["--profile", os.path.join(VALID, "profile.json"), "--prefill", "1",
                                     "--decode", "1", "--replicas", "9", "--compute-scale", str(scale)])
errs = sim.compare_runs(real, simd)
check(len(errs) == 6 * len(real["runs"]), "validation: every metric compared (%d)" % len(errs))
for run, metric, a, b, err in errs:
    check(err <= BOUND, "validation 1+1 %s %s: real %.2f, simulated %.2f, error %.1f%% <= %.0f%%"
          % (run, metric, a, b, 100 * err, 100 * BOUND))

# 2. the same summary format as kvrelay-bench-serve: the same keys, and its plots draw it
for key in ("summary",):
    check(set(real["runs"][0][key]) == set(simd["runs"][0][key]), "summary keys equal kvrelay-bench-serve's")
check(set(real) - {"api", "target"} <= set(simd), "top-level keys include kvrelay-bench-serve's")
out = os.path.join(WORK, "plot")
r = tool("run", "--rate", "5", "--num-requests", "20", "--policy", "full", "--policy", "streaming:sink=4,window=60",
         "--plot", out, "--json", os.path.join(WORK, "p.json"), "--no-progress")
check(r.returncode == 0 and os.path.getsize(os.path.join(out, "latency-cdf.png")) > 0,
      "run --plot draws kvrelay-bench-serve's latency CDFs (exit %d)" % r.returncode)

# 3. same seed, same figures
a = tool("run", "--rate", "20", "--num-requests", "50", "--json", os.path.join(WORK, "a.json"), "--no-progress")
b = tool("run", "--rate", "20", "--num-requests", "50", "--json", os.path.join(WORK, "b.json"), "--no-progress")
sa, sb = (json.load(open(os.path.join(WORK, f)))["runs"][0]["summary"] for f in ("a.json", "b.json"))
check(a.returncode == 0 and sa == sb, "two runs with one seed give identical summaries")

# 4. admission is FIFO: a pool that holds one request at a time serves them in arrival order,
#    each after the previous one ended, and the later ones wait in the queue
rows = os.path.join(WORK, "rows.jsonl")
r = tool("run", "--rate", "1000", "--num-requests", "6", "--prompt-len", "256", "--output-len", "16",
         "--kv-blocks", "200", "--requests-out", rows, "--no-progress")
rs = [json.loads(x) for x in open(rows)]
first = [x["sent_s"] + x["ttft_s"] for x in rs]
check(r.returncode == 0 and all(x["status"] == "OK" for x in rs), "FIFO case: every request OK")
check(first == sorted(first), "FIFO case: first tokens in arrival order")
# (placed after the previous one ended: its first token comes after that end; queue_s starts
# only once the router's own work on the request is done, so sent_s + queue_s is not the time)
check(all(rs[i]["sent_s"] + rs[i]["ttft_s"] >= rs[i - 1]["end_s"] - 1e-9 for i in range(1, len(rs))),
      "FIFO case: each request placed only after the previous one ended")
check(all(x["queue_s"] > 0 for x in rs[1:]), "FIFO case: the later requests waited in the queue")

# 5. a faster link gives an earlier first token (long prompts, full cache, H100-like profile; an
#    f32 payload, whose bytes the link feels: a bf16 one mostly hides behind the pipelined prefill)
ttft = {}
for g in ("100g", "400g"):
    d = sim.sim_json(["--profile", os.path.join(SRC, "tools", "sim-profiles", "h100-llama8b-%s.json" % g),
                      "--kv-memory", "50G", "--rate", "2", "--num-requests", "40", "--prompt-len", "8000",
                      "--output-len", "16", "--kv-dtype", "f32"])
    ttft[g] = d["runs"][0]["summary"]["ttft_ms"]["p50"]
check(ttft["400g"] < ttft["100g"], "TTFT p50 at 400 Gb/s (%.1f ms) below 100 Gb/s (%.1f ms)" % (ttft["400g"], ttft["100g"]))

# 6. jitter: the profile's measured per-request spread makes requests of one length differ
#    (a few prompt lengths, far apart in time, so nothing queues); --jitter off gives each
#    length one cost; --replicas N reports medians over N draws; without jitter it runs once
jit_prof = os.path.join(WORK, "jitter-profile.json")
p = json.load(open(os.path.join(SRC, "tools", "sim-profiles", "h100-llama8b-400g.json")))
p["jitter"] = {"prefill": [0.5, 1.0, 2.0], "decode": [0.8, 1.0, 1.25]}
json.dump(p, open(jit_prof, "w"))


def ttfts(*flags):
    rows = os.path.join(WORK, "jit.jsonl")
    r = tool("run", "--profile", jit_prof, "--rate", "0.5", "--num-requests", "30", "--prompt-len", "2000",
             "--output-len", "8", "--requests-out", rows, "--json", os.path.join(WORK, "jit.json"),
             "--no-progress", *flags)
    return r.returncode, [x["ttft_s"] for x in map(json.loads, open(rows))], json.load(open(os.path.join(WORK, "jit.json")))


rc, on, _ = ttfts()
check(rc == 0 and max(on) > 1.3 * min(on), "jitter on: one prompt length, TTFT %.1f-%.1f ms" % (1e3 * min(on), 1e3 * max(on)))
rc, off, _ = ttfts("--jitter", "off")
check(rc == 0 and max(off) - min(off) < 1e-9, "jitter off: one prompt length, one TTFT (%.3f-%.3f ms)"
      % (1e3 * min(off), 1e3 * max(off)))
check(min(on) < off[0] < max(on), "the model's cost lies inside the jittered ones")
rc, _, d3 = ttfts("--replicas", "3")
rc1, _, d1 = ttfts("--replicas", "3", "--jitter", "off")
check(rc == 0 and d3["runs"][0]["replicas"] == 3 and d3["sim"]["jitter"] and rc1 == 0
      and d1["runs"][0]["replicas"] == 1 and not d1["sim"]["jitter"],
      "--replicas 3: three draws with jitter, one run without")

# 7. --compute-scale: every compute cost times F (twice the costs, a later first token at a load
#    that queues nothing); recorded in the summary
ttft = {}
for f in ("1", "2"):
    d = sim.sim_json(["--profile", jit_prof, "--jitter", "off", "--rate", "0.5", "--num-requests", "10",
                      "--prompt-len", "4000", "--output-len", "8", "--compute-scale", f])
    ttft[f] = d["runs"][0]["summary"]["ttft_ms"]["p50"]
    check(d["sim"]["compute_scale"] == float(f), "--compute-scale %s recorded in the summary" % f)
check(1.8 * ttft["1"] < ttft["2"] < 2.0 * ttft["1"] + 1e-9,
      "--compute-scale 2: TTFT p50 %.1f ms against %.1f (compute doubles, the link does not)" % (ttft["2"], ttft["1"]))

# 8. host.prefill_beside_decode: on shared cores a prompt that arrives while another request
#    decodes runs at that speed; one that arrives to an idle cluster does not
side_trace = os.path.join(WORK, "beside.jsonl")
open(side_trace, "w").write('{"arrival_s": 0, "prompt_tokens": 512, "output_tokens": 2000}\n'
                            '{"arrival_s": 0.1, "prompt_tokens": 512, "output_tokens": 4}\n'
                            '{"arrival_s": 5, "prompt_tokens": 512, "output_tokens": 4}\n')
side = {}
for b in (1.0, 0.5):
    p = json.load(open(os.path.join(SRC, "tools", "sim-profiles", "this-machine.json")))
    p["host"]["prefill_beside_decode"] = b
    path = os.path.join(WORK, "beside-%g.json" % b)
    json.dump(p, open(path, "w"))
    rows = os.path.join(WORK, "beside-%g.jsonl" % b)
    r = tool("run", "--profile", path, "--trace", side_trace, "--jitter", "off", "--requests-out", rows, "--no-progress")
    side[b] = [x["ttft_s"] for x in map(json.loads, open(rows))] if r.returncode == 0 else [math.nan] * 3
check(1.6 < side[0.5][1] / side[1.0][1] < 2.2 and abs(side[0.5][2] - side[1.0][2]) < 1e-9
      and abs(side[0.5][0] - side[1.0][0]) < 1e-9,
      "prefill_beside_decode 0.5: the prompt beside a decoding request %.2f ms against %.2f; those alone %.2f, %.2f ms"
      % (1e3 * side[0.5][1], 1e3 * side[1.0][1], 1e3 * side[0.5][2], 1e3 * side[1.0][2]))

# calibration's overlap ratios: requests alone against requests beside another's decoding
def row(sent, ttft, e2e, tpot):
    return {"status": "OK", "sent_s": sent, "ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot}


rows = [row(float(i), 0.010, 0.020, 0.0002) for i in range(10)]  # alone
for i in range(10):  # a long decode, and a request arriving during it whose prefill and decoding overlap it
    rows += [row(100.0 + i, 0.010, 0.500, 0.0002), row(100.1 + i, 0.015, 0.030, 0.0003)]
ratios = (sim.overlap_ratio(rows, "ttft"), sim.overlap_ratio(rows, "tpot"), sim.overlap_ratio(rows[:12], "ttft"))
check(ratios[0] is not None and abs(ratios[0] - 1.5) < 1e-9 and ratios[1] is not None and abs(ratios[1] - 1.5) < 1e-9
      and ratios[2] is None, "overlap ratios 1.5 and 1.5, and none from too few requests beside: %s" % (ratios,))

# 9. bad input: exit 2 and a line naming the flag, key or line
bad_prof = os.path.join(WORK, "bad-profile.json")
p = json.load(open(os.path.join(SRC, "tools", "sim-profiles", "h100-llama8b-400g.json")))
del p["decode"]["per_seq_s"]
json.dump(p, open(bad_prof, "w"))
trace = os.path.join(WORK, "t.jsonl")
open(trace, "w").write('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 4}\n'
                       '{"arrival_s": 1, "prompt": "hello", "output_tokens": 4}\n')
bad_side = os.path.join(WORK, "bad-beside.json")
p = json.load(open(os.path.join(SRC, "tools", "sim-profiles", "this-machine.json")))
p["host"]["prefill_beside_decode"] = 0
json.dump(p, open(bad_side, "w"))
bad_jit = os.path.join(WORK, "bad-jitter.json")
p = json.load(open(jit_prof))
p["jitter"]["decode"] = [1.2, 1.0]
json.dump(p, open(bad_jit, "w"))
for argv, want in ((["run", "--rate", "1", "--policy", "heads"], "--policy 'heads'"),
                   (["run", "--rate", "1", "--profile", bad_jit], "jitter.decode"),
                   (["run", "--rate", "1", "--replicas", "0"], "--replicas"),
                   (["run", "--rate", "1", "--compute-scale", "nan"], "--compute-scale"),
                   (["probe", "--profile", jit_prof], "no \"probe\""),
                   (["probe", "--profile", jit_prof, "--target", "127.0.0.1:1"], "cluster_measured.open"),
                   (["run", "--rate", "1", "--profile", bad_prof], "decode.per_seq_s"),
                   (["run", "--rate", "1", "--profile", bad_side], "host.prefill_beside_decode"),
                   (["run", "--trace", trace], "t.jsonl:2"),
                   (["run", "--rate", "1", "--prefill", "0"], "--prefill"),
                   (["frobnicate"], "unknown command 'frobnicate'")):
    r = tool(*argv)
    check(r.returncode == 2 and want in r.stderr, "%s: exit 2 naming %s (exit %d: %s)"
          % (" ".join(argv[:3]), want, r.returncode, r.stderr.strip().splitlines()[-1:] or ""))

if failures:
    print("%d check(s) failed" % len(failures))
    sys.exit(1)
