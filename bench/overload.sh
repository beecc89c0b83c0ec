#!/usr/bin/env bash
# overload.sh - the router's admission FIFO under sustained overload (docs/benchmarks.md,
# "Admission under overload"): a cluster of 1 prefill + 1 decode node on the default model whose
# decode KV pool holds only a few requests (--kv-blocks), so that the pool, not the prefill node,
# is what runs out; kvrelay-bench-serve measures what that cluster sustains (closed loop), then
# offers FACTOR times that as Poisson arrivals and reports the queue wait (Usage.queue_s) of the
# admitted requests. Not a test: figures depend on the machine; run it by hand.
#
#   bench/overload.sh [--bin DIR] [--kv-blocks N] [--prompt-len N] [--output-len N]
#                     [--duration S] [--factor F] [--max-queue-ms MS] [--out DIR]
#
# Defaults: --bin build, --kv-blocks 1040 (4 requests of 256 + 256 tokens under the full cache),
# 256, 256, 30 s, 1.5, the router's --max-queue-ms 60000 (a smaller one turns the growing backlog
# into a steady state: requests that would wait longer are refused RESOURCE_EXHAUSTED), a
# temporary directory (kept; its path is printed). Writes capacity.json, overload.json,
# overload-rows.jsonl, overload.txt and the cluster's logs there. Besides p50/p99 it prints the
# queue wait by arrival window (FIFO: waits grow with the backlog and stay narrow within a
# window) and how many requests were admitted after a later arrival (FIFO: none, up to the
# difference between the client's send time and the router's arrival time).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/build kv_blocks=1040 plen=256 olen=256 duration=30 factor=1.5 max_queue_ms=60000 out=
while [ $# -gt 0 ]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --kv-blocks) kv_blocks=$2; shift 2 ;;
    --prompt-len) plen=$2; shift 2 ;;
    --output-len) olen=$2; shift 2 ;;
    --duration) duration=$2; shift 2 ;;
    --factor) factor=$2; shift 2 ;;
    --max-queue-ms) max_queue_ms=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "overload.sh: unknown flag '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -x "$bin/kvrelay-router" ] || {
  echo "overload.sh: --bin $bin holds no built kvrelay-router (build it first: cmake --build $bin)" >&2
  exit 2
}
out=${out:-$(mktemp -d -t kvrelay-overload.XXXXXX)}
mkdir -p "$out"
bench=$here/tools/kvrelay-bench-serve
. "$here/deploy/local-cluster.sh"
KRC_DIR=$out/cluster
trap krc_stop EXIT
KRC_DECODE_ARGS=(--kv-blocks "$kv_blocks")
KRC_ROUTER_ARGS=(--max-queue-ms "$max_queue_ms")
krc_start "$bin" "$here/models/kjv-2l128-2k" 1 1 127.0.0.1:0 --threads 1 || exit 1
echo "overload.sh: cluster up (decode pool $kv_blocks blocks, --max-queue-ms $max_queue_ms)," \
  "router $KRC_ROUTER; output in $out" >&2

# what the cluster sustains: enough clients that the pool is always full
"$bench" --target "$KRC_ROUTER" --concurrency 16 --num-requests 150 --warmup 10 \
  --prompt-len "$plen" --output-len "$olen" --json "$out/capacity.json" --no-progress >"$out/capacity.txt"
cap=$(/usr/bin/python3 -c 'import json, sys
print("%.2f" % json.load(open(sys.argv[1]))["runs"][0]["summary"]["request_throughput"])' "$out/capacity.json")
rate=$(/usr/bin/python3 -c 'import sys; print("%.2f" % (float(sys.argv[1]) * float(sys.argv[2])))' "$cap" "$factor")
echo "overload.sh: the cluster sustains $cap req/s (closed loop, 16 clients); offering $rate req/s for $duration s" >&2

"$bench" --target "$KRC_ROUTER" --rate "$rate" --duration "$duration" --prompt-len "$plen" \
  --output-len "$olen" --json "$out/overload.json" --requests-out "$out/overload-rows.jsonl" |
  tee "$out/overload.txt"
/usr/bin/python3 - "$out/overload.json" "$out/overload-rows.jsonl" "$cap" <<'PY' | tee -a "$out/overload.txt"
import json, sys
import numpy as np
run = json.load(open(sys.argv[1]))["runs"][0]
rows = [json.loads(line) for line in open(sys.argv[2])]
s, q = run["summary"], run["summary"]["queue_ms"]
print("capacity %s req/s, offered %g req/s: %d admitted and served, refused %s" % (
    sys.argv[3], run["mode"]["rate"], s["ok"], s["errors"] or "none"))
if not q["n"]:
    sys.exit(0)
print("queue wait of the admitted requests: p50 %.0f ms, p90 %.0f ms, p99 %.0f ms, max %.0f ms; "
      "p99 / p50 = %.2f (target <= 2)" % (q["p50"], q["p90"], q["p99"], q["max"],
                                          q["p99"] / q["p50"] if q["p50"] else float("inf")))
ok = sorted((r for r in rows if r["status"] == "OK"), key=lambda r: r["sent_s"])
width = 5.0
print("arrival window (s)  admitted  refused  queue p50 (ms)  queue p99 (ms)")
t, end = 0.0, max(r["sent_s"] for r in rows)
while t <= end:
    w = [r["queue_s"] * 1e3 for r in ok if t <= r["sent_s"] < t + width]
    refused = sum(1 for r in rows if r["status"] != "OK" and t <= r["sent_s"] < t + width)
    print("%8.0f-%-9.0f %9d %8d %15s %15s" % (t, t + width, len(w), refused,
          "%.0f" % np.percentile(w, 50) if w else "-", "%.0f" % np.percentile(w, 99) if w else "-"))
    t += width
# a request is admitted at sent + queue wait; FIFO admits in arrival order. 5 ms of slack: the
# client's send time is not the router's arrival time
adm = [r["sent_s"] + r["queue_s"] for r in ok]
later_min = float("inf")
late = 0
for i in range(len(ok) - 1, -1, -1):
    if later_min < adm[i] - 0.005:
        late += 1
    later_min = min(later_min, adm[i])
print("admitted after a later arrival (by more than 5 ms): %d of %d" % (late, len(ok)))
PY
