#!/usr/bin/env bash
# eval_quick.sh - kvrelay-eval through a real cluster on the trained default model.
#
# 1. `kvrelay-eval --quick` (it starts ./kvrelay up --bin KR_BIN itself): every policy family at
#    one budget (heads with the default model's gate file), kv/copy/text; its --check asserts the exactness contract (full = one-process
#    kvrelay-generate, answers and forced log-probabilities bit for bit; full's footprint 1; a
#    streaming window holding the whole prompt = full). Here: exit 0, the JSON holds a record per
#    (policy, task, length) with finite numbers, the plot and the markdown are written, and an
#    eviction policy ships fewer bytes than full.
# 2. Bad input against a running cluster: an unknown task, a text file that is not UTF-8, one
#    too short, one holding task tokens, a missing file, a budget the policy refuses, a gate
#    file the router does not serve: each exits 2 with a message saying what is wrong, and the
#    cluster then still answers a good run with full accuracy. A broken gate file through a
#    cluster the evaluator starts: exit 2, the parser's message.
# Between the two: --calibrate-gates writes a gate file of the model's shape that the heads
# policy accepts; the quick sweep's --calibrate-out table (kv_policy auto, docs/adaptive.md)
# carries the fingerprint the committed table has, a point per (spec, length) with every task's
# score and case count, and equals the table --calibrate-from makes from the sweep's --out.
# Skips (77) without Debian's python3-grpcio, numpy, matplotlib or the stub generator.
# Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
PY=/usr/bin/python3 # not the python3 on PATH: a pyenv interpreter there may lack grpc
EVAL=$KR_SRC/tools/kvrelay-eval

if ! "$PY" -c 'import grpc, google.protobuf, numpy, matplotlib' 2>/dev/null; then
  echo "SKIP: python3-grpcio, python3-numpy or python3-matplotlib missing (the README's test command installs them)"
  exit 77
fi
if ! command -v protoc >/dev/null || [ ! -x /usr/bin/grpc_python_plugin ]; then
  echo "SKIP: protoc or grpc_python_plugin missing (the README's test command installs them)"
  exit 77
fi
tmp=$(mktemp -d)
up_pid=
cleanup() {
  [ -z "$up_pid" ] || { kill -TERM "$up_pid" 2>/dev/null || true; wait "$up_pid" 2>/dev/null || true; }
  rm -rf "$tmp"
}
trap cleanup EXIT
fail=0
bad() { echo "FAIL: $*" >&2; fail=1; }

# ---- 1. the quick sweep with its checks
if "$PY" "$EVAL" --quick --bin "$KR_BIN" --out "$tmp/q.json" --markdown "$tmp/q.md" \
  --plot "$tmp/q.png" --calibrate-out "$tmp/table.json" >"$tmp/quick.out" 2>"$tmp/quick.err"; then
  grep -q 'checks passed' "$tmp/quick.err" || bad "--quick did not report its checks"
else
  bad "kvrelay-eval --quick failed: $(tail -n 20 "$tmp/quick.err")"
fi
"$PY" - "$tmp/q.json" <<'EOF' || fail=1
import json, math, sys
d = json.load(open(sys.argv[1]))
recs = d["records"]
fams = {r["family"] for r in recs}
want = {"full", "streaming", "snapkv", "pyramidkv", "take", "sage", "heads"}
errs = []
if not want <= fams:
    errs.append("families %s, want %s" % (sorted(fams), sorted(want)))
for r in recs:
    nums = [r["kv_footprint"], r["kv_bytes_shipped"]] + [r[k] for k in ("accuracy", "ppl", "top1_agreement") if k in r]
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in nums):
        errs.append("non-finite number in %s" % r)
    if not (0 < r["kv_footprint"] <= 1 and r["cases"] == 6):
        errs.append("footprint/cases out of range: %s" % r)
    if r["task"] == "text" and not r["ppl"] >= 1:
        errs.append("perplexity below 1: %s" % r)
for task in ("kv", "copy", "text"):
    for length in (128, 256):
        full = [r for r in recs if (r["task"], r["length"], r["policy"]) == (task, length, "full")]
        snap = [r for r in recs if (r["task"], r["length"], r["family"]) == (task, length, "snapkv")]
        if len(full) != 1 or len(snap) != 1:
            errs.append("%s/%d: %d full and %d snapkv records" % (task, length, len(full), len(snap)))
            continue
        if not snap[0]["kv_bytes_shipped"] < full[0]["kv_bytes_shipped"]:
            errs.append("%s/%d: snapkv shipped no fewer bytes than full" % (task, length))
kv_full = [r["accuracy"] for r in recs if r["task"] == "kv" and r["policy"] == "full"]
if not all(a >= 0.8 for a in kv_full):  # the trained model retrieves at these lengths
    errs.append("full-cache kv accuracy %s" % kv_full)
if not {c["family"] for c in d["critical"]} >= want - {"full"}:
    errs.append("critical footprints for %s only" % sorted({c["family"] for c in d["critical"]}))
for e in errs:
    print("FAIL: " + e, file=sys.stderr)
sys.exit(1 if errs else 0)
EOF
[ -s "$tmp/q.png" ] && [ "$(head -c 4 "$tmp/q.png" | od -An -c | tr -d ' ')" = '211PNG' ] || bad "no PNG plot written"

# ---- the calibration table, from the sweep and from its records
fp=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["model"]["fingerprint"])' \
  "$KR_SRC/models/kjv-2l128-2k/calibration.json")
"$PY" "$EVAL" --calibrate-from "$tmp/q.json" --fingerprint "$fp" --calibrate-out "$tmp/table2.json" \
  >/dev/null 2>"$tmp/table2.err" || bad "--calibrate-from failed: $(tail -n 5 "$tmp/table2.err")"
"$PY" - "$tmp/table.json" "$tmp/table2.json" "$fp" <<'EOF' || fail=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
errs = []
if a["model"]["fingerprint"] != sys.argv[3]:
    errs.append("the sweep's table says fingerprint %s, the committed one %s" % (a["model"]["fingerprint"], sys.argv[3]))
if (a["kind"], a["format"], a["tasks"], a["lengths"], a["chunk"]) != ("kvrelay-calibration", 1, ["kv", "copy", "text"], [128, 256], 64):
    errs.append("table head %s" % {k: a[k] for k in ("kind", "format", "tasks", "lengths", "chunk")})
for p in a["points"]:
    for t in ("kv", "copy", "text"):
        s = p["scores"].get(t)
        if not s or s["cases"] != 6 or not (0 <= s["policy"] <= 1 and 0 <= s["full"] <= 1):
            errs.append("%s at %d, %s: %s" % (p["spec"], p["length"], t, s))
if len(a["points"]) != len({(p["spec"], p["length"]) for p in a["points"]}) or len(a["points"]) < 14:
    errs.append("%d points" % len(a["points"]))
a.pop("source"), b.pop("source")
if a != b:
    errs.append("--calibrate-from made another table than the sweep")
for e in errs:
    print("FAIL: " + e, file=sys.stderr)
sys.exit(1 if errs else 0)
EOF
grep -q '^### kv, 128 tokens' "$tmp/q.md" && grep -q '^| snapkv | ' "$tmp/q.md" || bad "the markdown lacks the kv/128 table or its snapkv row"

# ---- gate calibration: a gate file the heads policy takes, gates in [0, 1], the largest 1
if "$PY" "$EVAL" --bin "$KR_BIN" --calibrate-gates "$tmp/gates.tsv" --lengths 128 --cases 2 \
  --seed 99 >"$tmp/cal.out" 2>"$tmp/cal.err"; then
  "$PY" - "$tmp/gates.tsv" "$KR_SRC/models/kjv-2l128-2k/config.json" <<'EOF' || fail=1
import json, math, sys
rows = [l.split("\t") for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")]
cfg = json.load(open(sys.argv[2]))
g = [float(x) for r in rows for x in r]
ok = (len(rows) == cfg["num_hidden_layers"] and all(len(r) == cfg["num_key_value_heads"] for r in rows)
      and all(math.isfinite(x) and 0 <= x <= 1 for x in g) and max(g) == 1.0)
sys.exit(0 if ok else "FAIL: calibrated gates %s" % rows)
EOF
  "$KR_BIN/kvrelay-generate" --model "$KR_SRC/models/kjv-2l128-2k" --prompt "And God said" \
    --max-tokens 4 --policy "heads:pattern=$tmp/gates.tsv,sparsity=0.5,sink=4,window=8" >/dev/null ||
    bad "the heads policy refused the calibrated gate file"
else
  bad "--calibrate-gates failed: $(tail -n 5 "$tmp/cal.err")"
fi

# ---- 2. bad input, against one running cluster
"$KR_SRC/kvrelay" up --bin "$KR_BIN" --port 0 --no-etcd --chunk 64 >"$tmp/up.out" 2>"$tmp/up.err" &
up_pid=$!
router=
for _ in $(seq 600); do
  router=$(sed -n 's/^router: //p' "$tmp/up.out")
  [ -n "$router" ] && break
  kill -0 "$up_pid" 2>/dev/null || break
  sleep 0.1
done
[ -n "$router" ] || { bad "./kvrelay up did not start: $(tail -n 20 "$tmp/up.err")"; exit 1; }

expect_error() { # expect_error PATTERN ARGS...
  local pat=$1 rc=0; shift
  "$PY" "$EVAL" --router "$router" --lengths 128 --cases 2 --no-sweep "$@" >"$tmp/e.out" 2>"$tmp/e.err" || rc=$?
  [ "$rc" = 2 ] || bad "kvrelay-eval $* exited $rc, not 2: $(tail -n 5 "$tmp/e.err")"
  grep -q -- "$pat" "$tmp/e.err" || bad "kvrelay-eval $*: no '$pat' in: $(tail -n 5 "$tmp/e.err")"
  ! grep -q Traceback "$tmp/e.err" || bad "kvrelay-eval $*: a Python traceback instead of a message"
}
printf 'text \377\376 not utf-8\n' >"$tmp/binary.txt"
echo "In the beginning God created the heaven and the earth." >"$tmp/short.txt"
{ for i in $(seq 200); do echo "And the LORD spake unto Moses, saying <q><k07> again and again."; done; } >"$tmp/tasky.txt"
printf '1\t1\tx\n' >"$tmp/broken-gates.tsv"
expect_error "unknown task 'poems'" --tasks poems
expect_error "not UTF-8" --text "$tmp/binary.txt"
expect_error "tokens; the longest case needs" --text "$tmp/short.txt"
expect_error "holds task tokens" --text "$tmp/tasky.txt"
expect_error "No such file" --text "$tmp/no-such-file.txt"
expect_error "budget" --tasks kv --policy "snapkv:budget=8,obs=16"
expect_error "no policy files" --tasks kv --policy "heads:pattern=broken-gates.tsv"
expect_error "unknown policy family" --families snapkv,nonsense
expect_error "unknown wire dtype 'int4'" --wire-dtypes f32,int4
expect_error "needs --calibrate-out" --calibrate-from "$tmp/q.json"
expect_error "not a kvrelay-eval --out file" --calibrate-from "$tmp/short.txt" --calibrate-out "$tmp/x.json"

# a broken gate file, through a cluster the evaluator starts with the file's directory as --policy-dir
rc=0
"$PY" "$EVAL" --bin "$KR_BIN" --gates "$tmp/broken-gates.tsv" --families heads --tasks kv \
  --lengths 128 --cases 2 --budgets 0.5 >"$tmp/e.out" 2>"$tmp/e.err" || rc=$?
[ "$rc" = 2 ] && grep -q 'broken-gates.tsv: row 1, column 3 is not a number' "$tmp/e.err" ||
  bad "a broken gate file: exit $rc, $(tail -n 3 "$tmp/e.err")"

# the cluster still serves: a good run on the same router, every point also with an int8 bundle
# (the wire dtype sweep: the same entries shipped in about a quarter of f32's bytes)
"$PY" "$EVAL" --router "$router" --lengths 256 --cases 4 --tasks kv --no-sweep --wire-dtypes int8 \
  --policy snapkv:budget=64,obs=16 --out "$tmp/after.json" >"$tmp/after.out" 2>"$tmp/after.err" ||
  bad "a good run after the bad ones failed: $(tail -n 5 "$tmp/after.err")"
"$PY" -c '
import json, sys
d = json.load(open(sys.argv[1]))
acc = [r["accuracy"] for r in d["records"]]
if len(acc) != 4 or not all(a >= 0.75 for a in acc):
    sys.exit("after the bad runs: accuracies %s" % acc)
by = {(r["policy"], r["wire_dtype"]): r for r in d["records"]}
for pol in ("full", "snapkv:budget=64,obs=16"):
    f, q = by[(pol, "f32")], by[(pol, "int8")]
    if not (q["kv_entries_shipped"] == f["kv_entries_shipped"] and 0 < q["kv_bytes_shipped"] < 0.4 * f["kv_bytes_shipped"]):
        sys.exit("%s: int8 shipped %r bytes for %r entries, f32 %r for %r" % (pol, q["kv_bytes_shipped"],
                 q["kv_entries_shipped"], f["kv_bytes_shipped"], f["kv_entries_shipped"]))
if by[("full", "int8")]["family"] != "full+int8":
    sys.exit("the int8 full point is grouped as %r" % by[("full", "int8")]["family"])
' "$tmp/after.json" || fail=1

[ $fail = 0 ] && echo "eval_quick: all checks passed"
exit $fail
