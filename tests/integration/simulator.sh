#!/usr/bin/env bash
# simulator.sh - tools/kvrelay-sim (docs/simulator.md), without a cluster, in about 20 s:
# the small validation case (the committed real 1 prefill + 1 decode runs, both rates, of
# bench/experiments/sim-validate.sh, simulated again with the profile calibrated beside them:
# TTFT and TPOT p50 / p90 and goodput within 15%); kvrelay-bench-serve's summary format (the same
# keys; its plots draw the simulator's runs); one seed, one result; FIFO admission in event order
# (a pool for one request at a time serves them in arrival order, each after the previous ended);
# a faster link gives an earlier first token; bad input exits 2 naming the flag, key or line.
# Then the KV cache's dtype (the profile's model.kv_cache_dtype): the decode pool has the blocks
# the decode node computes for the same --kv-memory (block_size x (2 x head_dim x dtype bytes +
# 4)), a bf16 pool nearly twice an f32 one's; the bundle payload follows the cache's dtype unless
# --kv-dtype names one; a profile without the key exits 2 naming it. Then prefix reuse
# (simulator_prefix.py): a small chat workload's hit rate and cached tokens equal the cache's
# rules worked by hand, budgets, kv-aware against round-robin placement, conversation traces.
# Then kv_policy auto (simulator_adaptive.py): the router's rule on the unit test's synthetic
# table, and on a memory-bound pool full while it has room, compressed specs at the floor once
# it fills.
# Skips (77) without python3-numpy or python3-matplotlib. Env (set by ctest): KR_SRC.
set -euo pipefail
PY=/usr/bin/python3
if ! "$PY" -c 'import numpy, matplotlib' 2>/dev/null; then
  echo "SKIP: python3-numpy or python3-matplotlib missing (the README's test command installs them)"
  exit 77
fi
work=$(mktemp -d -t kvrelay-sim-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$PY" "$KR_SRC/tests/integration/simulator.py" "$KR_SRC" "$work"
"$PY" "$KR_SRC/tests/integration/simulator_prefix.py" "$KR_SRC" "$work"
"$PY" "$KR_SRC/tests/integration/simulator_adaptive.py" "$KR_SRC" "$work"
"$PY" - "$KR_SRC" "$work" <<'PY'
import json, os, subprocess, sys
src, work = sys.argv[1:3]
base = json.load(open(os.path.join(src, "tools", "sim-profiles", "h100-llama8b-400g.json")))
failures = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        failures.append(msg)


def run(cache_dtype, *flags):
    """(exit status, stderr, summary, request rows) of a small run under the H100-like profile
    with model.kv_cache_dtype set (None: the key left out)."""
    prof = json.loads(json.dumps(base))
    prof["model"].pop("kv_cache_dtype")
    if cache_dtype:
        prof["model"]["kv_cache_dtype"] = cache_dtype
    path, out, rows = (os.path.join(work, "kv-%s.%s" % (cache_dtype, x)) for x in ("profile.json", "json", "jsonl"))
    json.dump(prof, open(path, "w"))
    r = subprocess.run([sys.executable, os.path.join(src, "tools", "kvrelay-sim"), "run", "--profile", path,
                        "--kv-memory", "1G", "--rate", "1", "--num-requests", "3", "--prompt-len", "1000",
                        "--output-len", "4", "--json", out, "--requests-out", rows, "--no-progress"] + list(flags),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    if r.returncode != 0:
        return r.returncode, r.stderr, None, None
    return 0, r.stderr, json.load(open(out)), [json.loads(x) for x in open(rows)]


m = base["model"]
lists = m["layers"] * m["kv_heads"]
blocks = {}
for dt, size in (("f32", 4), ("bf16", 2), ("f16", 2)):
    rc, err, doc, rows = run(dt)
    want = (1 << 30) // (16 * (m["head_dim"] * 2 * size + 4))  # decode-node/main.c's block budget
    blocks[dt] = doc["sim"]["kv_blocks"] if doc else None
    check(rc == 0 and blocks[dt] == want, "%s cache: %s blocks in 1 GiB, the decode node's %d" % (dt, blocks[dt], want))
    check(rc == 0 and doc["wire_dtype"] == dt and all(r["kv_bytes_shipped"] == 1000 * lists * 2 * m["head_dim"] * size
                                                      for r in rows),
          "%s cache: bundles in %s by default (wire_dtype %s)" % (dt, dt, doc and doc["wire_dtype"]))
check(blocks["bf16"] and blocks["f32"] and blocks["bf16"] > 1.99 * blocks["f32"],
      "a bf16 pool holds about twice the blocks of an f32 one (%s against %s)" % (blocks["bf16"], blocks["f32"]))
rc, err, doc, rows = run("bf16", "--kv-dtype", "f32")
check(rc == 0 and doc["wire_dtype"] == "f32" and doc["sim"]["kv_blocks"] == blocks["bf16"]
      and all(r["kv_bytes_shipped"] == 1000 * lists * 2 * m["head_dim"] * 4 for r in rows),
      "bf16 cache with --kv-dtype f32: f32 bundles, the pool still bf16")
rc, err, _, _ = run(None)
check(rc == 2 and "model.kv_cache_dtype" in err, "a profile without model.kv_cache_dtype: exit 2 naming it (exit %d: %s)"
      % (rc, err.strip().splitlines()[-1:]))
if failures:
    print("%d check(s) failed" % len(failures))
    sys.exit(1)
PY
echo "PASS"
