"""simulator_adaptive.py - kv_policy auto in tools/kvrelay-sim (tools/simadaptive.py), run by
simulator.sh: the rule gives the router's choices on the synthetic table of
tests/unit/test_router_adaptive.c (the same cases, the same answers); on a memory-bound decode pool
auto serves full while the pool has room and compressed specs once it fills, every choice at or
above its floor, and sustains the rate where full queues; bad input exits 2 naming the flag.

  simulator_adaptive.py SRC WORKDIR
"""
import json
import os
import subprocess
import sys

SRC, WORK = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(SRC, "tools"))
import simadaptive  # noqa: E402
import simcore  # noqa: E402

TOOL = os.path.join(SRC, "tools", "kvrelay-sim")
failures = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        failures.append(msg)


def error(msg):
    raise simcore.SimError(msg)


# 1. the unit test's synthetic table: lengths 256 and 1024, kv and text, 2 layers x 2 KV heads
pts = [("streaming:sink=4,window=12", 256, 1.0, 1000, 0.97, 1000), ("streaming:sink=4,window=28", 256, 0.5, 1000, 1.0, 1000),
       ("streaming:sink=4,window=44", 256, 1.0, 20, 1.0, 20), ("streaming:sink=4,window=60", 256, 1.0, 1000, 1.0, 1000),
       ("full", 256, 1.0, 1000, 1.0, 1000), ("streaming:sink=4,window=124", 1024, 1.0, 1000, None, 0)]
table = {"kind": "kvrelay-calibration", "format": 1, "model": {"fingerprint": "0123456789abcdef"}, "chunk": 64,
         "seed": 1, "block_size": 16, "tasks": ["kv", "text"], "lengths": [256, 1024], "points": []}
for spec, length, kv, kvn, text, textn in pts:
    scores = {"kv": {"policy": kv, "full": 1, "cases": kvn}}
    if textn:
        scores["text"] = {"policy": text, "full": 1, "cases": textn}
    table["points"].append({"spec": spec, "length": length, "scores": scores})
path = os.path.join(WORK, "synthetic-calibration.json")
json.dump(table, open(path, "w"))
t = simadaptive.Table(path, simcore.Footprint, error)
full = simcore.Footprint("full")


def choose(ask, n, out, level):
    return t.choose(simadaptive.parse_auto(ask, error), n, out, level,
                    lambda fp, n, o, b: simcore.blocks_bound(fp, n, o, 4, b), full)


want = [("auto:floor=1", 200, 8, "high", "full"), ("auto:floor=0.5", 200, 8, "low", "full"),
        ("auto:floor=0.95", 200, 8, "high", "streaming:sink=4,window=12"),
        ("auto:floor=0.95", 200, 8, "medium", "streaming:sink=4,window=60"),
        ("auto:floor=0.99", 200, 8, "high", "streaming:sink=4,window=60"),
        ("auto:floor=0.9,task=text", 200, 8, "high", "streaming:sink=4,window=12"),
        ("auto:floor=0.9", 900, 8, "high", "full"), ("auto:floor=0.9,task=kv", 900, 8, "high", "streaming:sink=4,window=124"),
        ("auto:floor=0.5,task=kv", 2000, 8, "high", "full"), ("auto:floor=0.5,task=kv", 10, 1, "high", "full")]
for ask, n, out, level, spec in want:
    got = choose(ask, n, out, level)
    check(got[0] == spec, "rule: %s, %d tokens, %s pressure -> %s (%s)" % (ask, n, level, got[0], got[2]))
check(all(simadaptive.pressure(*a) == w for a, w in (((100, 100, 0), "low"), ((49, 100, 0), "medium"),
                                                        ((24, 100, 0), "high"), ((100, 100, 1), "high"))),
      "pressure levels as the router's")

# 2. a memory-bound pool: full queues at 32 requests/s, auto keeps full at 8 and compresses at 32
cal = os.path.join(SRC, "models", "kjv-2l128-2k", "calibration.json")
base = ["run", "--decode", "1", "--prefill", "2", "--kv-blocks", "600", "--rate", "8,32", "--duration", "30",
        "--prompt-len", "256:500", "--output-len", "128", "--jitter", "off", "--no-progress", "--calibration", cal]
runs = {}
for pol in ("full", "auto:floor=0.95,task=kv"):
    out = os.path.join(WORK, "adaptive-%s" % pol.split(":")[0])
    r = subprocess.run([sys.executable, TOOL] + base + ["--policy", pol, "--json", out + ".json", "--requests-out",
                                                        out + ".jsonl"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True)
    check(r.returncode == 0, "sim run --policy %s (%s)" % (pol, r.stderr.strip()[-300:]))
    if r.returncode:
        continue
    runs[pol] = (json.load(open(out + ".json")), [json.loads(x) for x in open(out + ".jsonl")])
if len(runs) == 2:
    (sfull, _), (sauto, rows) = runs["full"], runs["auto:floor=0.95,task=kv"]
    chosen = {(x["auto_pressure"], x["auto_policy"]) for x in rows if x.get("auto_policy")}
    check(len([x for x in rows if x.get("auto_policy")]) == len(rows), "every auto request says its choice")
    check(all(x["auto_score"] >= 0.95 for x in rows), "every choice holds the floor 0.95")
    check(("low", "full") in chosen and any(p == "high" and s != "full" for p, s in chosen),
          "full while the pool has room, compressed under high pressure: %s" % sorted(chosen)[:6])
    p50 = [run["summary"]["ttft_ms"]["p50"] for run in sfull["runs"]]
    a50 = [run["summary"]["ttft_ms"]["p50"] for run in sauto["runs"]]
    check(a50[1] < 0.1 * p50[1], "at 32/s full queues (TTFT p50 %.0f ms), auto does not (%.1f ms)" % (p50[1], a50[1]))

# 3. bad input
for argv, want_msg in ((["--policy", "auto"], "--calibration FILE"),
                       (["--policy", "auto:floor=2", "--calibration", cal], "(0, 1]"),
                       (["--policy", "auto", "--calibration", os.path.join(WORK, "none.json")], "none.json")):
    r = subprocess.run([sys.executable, TOOL, "run", "--rate", "1", "--duration", "1"] + argv,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    check(r.returncode == 2 and want_msg in r.stderr, "%s: exit 2 naming %s (exit %d: %s)"
          % (" ".join(argv), want_msg, r.returncode, r.stderr.strip().splitlines()[-1:] or ""))

if failures:
    print("%d check(s) failed" % len(failures))
    sys.exit(1)
