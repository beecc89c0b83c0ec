#!/usr/bin/env bash
# overhead.sh - the serving overhead of one request (docs/benchmarks.md, "Serving overhead"):
# TPOT through a cluster (router + 1 prefill + 1 decode node, deploy/local-cluster.sh) against
# the single-process engine (kvrelay-generate) on the same model, prompt, token count and
# threads, per KV policy. Rounds interleave the two (engine, cluster, next policy, ...) so that
# the machine's other load falls on both alike; the figures are medians over rounds. Not a test:
# the figures depend on the machine; run it by hand.
#
#   bench/overhead.sh [--bin DIR] [--model DIR] [--threads N] [--tokens N] [--prompt-chars N]
#                     [--rounds N] [--limit R] [--out DIR] [--no-pin] [--policy SPEC]...
#
# Defaults: --bin build, a model made by kvrelay-make-model (random bf16 weights, the shape of
# tools/data/llama-110m.json with the vocabulary tools/data/corpus.txt gives: hidden 768, 12
# layers, 12/4 heads, MLP 2048, vocab 4242: 82 M parameters, 164 MB), --threads 1 (each node's
# compute threads and the engine's), --tokens 128 (max_tokens, the first token included),
# --prompt-chars 2000 (the start of tools/data/corpus.txt: 441 tokens on that model), --rounds
# 9 (a 5-round median moved by about 4% from run to run on a 2-vCPU VM), --limit 1.05, a temporary directory (kept; its path is printed) for runs.tsv, the model and
# the cluster's logs, and the policies full, streaming:sink=4,window=64 and
# snapkv:mode=patched,budget=64,obs=8.
#
# Engine TPOT: decode_seconds / (generated_tokens - 1) from `kvrelay-generate --stats --json`
# (the time after prefill, one forward per token after the first). Cluster TPOT: the router's
# Usage.tpot_s from `kvrelay-cli generate --json` (first token relayed -> last token relayed,
# over completion - 1); the decode node's own tpot (its join -> its last token, from its log) is
# kept in runs.tsv to tell the node's share from the router's. Besides wall time, CPU time per
# decode token, which the machine's other load does not inflate: the engine's (wait4 rusage of a
# --tokens run minus a 2-token run, over --tokens - 2) against the decode node's batching thread
# (its /proc schedstat over the request, over completion - 1; the bundle import included), and
# that thread's run-queue wait per token (time it was runnable but another thread had the CPU).
# Every run must produce exactly --tokens tokens (random weights rarely sample EOS; a run that
# ends early stops the bench).
# Pinning (default on a machine of 2 or more CPUs; --no-pin turns it off): the engine and the
# decode node's --threads busiest threads (its compute: found after the warm-up requests) run on
# the last CPU(s), everything else (the decode node's gRPC, transport and HTTP threads, the
# router, the prefill node, the client) on the others, as a deployment gives a decode node's
# compute cores of its own: both sides of the ratio then compute on a core nobody else wakes up
# on, and the per-token wake-ups land on the other cores.
# Each round's cluster run follows its engine run within seconds, so the summary's "paired" ratio
# (the median over rounds of cluster / engine per round) is what --limit checks: the host's
# speed drifts by 10-25% between rounds on a shared virtual machine, and a ratio of two medians
# taken over different rounds carries that drift.
# Exit 0 when every policy's ratio is within --limit, 1 when one is not, 2 for bad flags.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bin=$here/build model= threads=1 tokens=128 chars=2000 rounds=9 limit=1.05 out= policies=() pin=1
while [ $# -gt 0 ]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --prompt-chars) chars=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --limit) limit=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --policy) policies+=("$2"); shift 2 ;;
    --no-pin) pin=0; shift ;;
    -h | --help) sed -n '2,/^# Exit 0/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "overhead.sh: unknown flag '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
for n in "$threads" "$tokens" "$chars" "$rounds"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "overhead.sh: '$n' is not a positive integer" >&2; exit 2; }
done
[ "$tokens" -ge 2 ] || { echo "overhead.sh: --tokens must be at least 2 (TPOT needs two tokens)" >&2; exit 2; }
for p in kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli kvrelay-generate kvrelay-make-model; do
  [ -x "$bin/$p" ] || {
    echo "overhead.sh: --bin $bin has no built $p (cmake --build $bin --target $p)" >&2
    exit 2
  }
done
[ ${#policies[@]} -gt 0 ] ||
  policies=(full streaming:sink=4,window=64 snapkv:mode=patched,budget=64,obs=8)
out=${out:-$(mktemp -d -t kvrelay-overhead.XXXXXX)}
mkdir -p "$out"
py=/usr/bin/python3

if [ -z "$model" ]; then
  model=$out/model
  [ -f "$model/model.safetensors" ] ||
    "$bin/kvrelay-make-model" --corpus "$here/tools/data/corpus.txt" --out "$model" --vocab 8192 \
      --hidden 768 --layers 12 --heads 12 --kv-heads 4 --intermediate 2048 --dtype bf16 \
      >"$out/make-model.log" 2>&1 || { cat "$out/make-model.log" >&2; exit 1; }
fi
[ -f "$model/config.json" ] || { echo "overhead.sh: --model $model has no config.json" >&2; exit 2; }
prompt=$(head -c "$chars" "$here/tools/data/corpus.txt" | tr '\n' ' ')

. "$here/deploy/local-cluster.sh"
KRC_DIR=$out/cluster
trap krc_stop EXIT
KRC_DECODE_ARGS=(--threads "$threads")
KRC_PREFILL_ARGS=(--threads "$threads")
krc_start "$bin" "$model" 1 1 127.0.0.1:0 --log-level info || exit 1
# CPU sets: the compute one (decode node, engine) and the rest; none without pinning
ncpu=$(nproc)
compute_cpus= other_cpus=
if [ "$pin" = 1 ] && [ "$ncpu" -ge 2 ] && command -v taskset >/dev/null; then
  compute_cpus=$((ncpu - (threads < ncpu - 1 ? threads : ncpu - 1)))-$((ncpu - 1))
  other_cpus=0-$((ncpu - (threads < ncpu - 1 ? threads : ncpu - 1) - 1))
  for id in router prefill-0 decode-0; do taskset -a -pc "$other_cpus" "$(krc_pid "$id")" >/dev/null; done
fi
on() { # on CPUS COMMAND...: runs COMMAND on those CPUs (as it is when CPUS is empty)
  local cpus=$1; shift
  if [ -n "$cpus" ]; then taskset -c "$cpus" "$@"; else "$@"; fi
}
echo "overhead.sh: cluster up, router $KRC_ROUTER; model $model; $(nproc) CPUs, load" \
  "$(cut -d' ' -f1-3 /proc/loadavg); ${compute_cpus:+decode node and engine on CPU(s) $compute_cpus, the rest on $other_cpus; }output in $out" >&2

# engine POLICY -> "tpot_s prompt_tokens generated_tokens cpu_s_per_token": the CPU per decode
# token is (CPU of a --tokens run - CPU of a 2-token run) / (--tokens - 2), from wait4's rusage
engine() {
  on "$compute_cpus" $py - "$1" "$bin/kvrelay-generate" --model "$model" --prompt "$prompt" --greedy --ignore-eos \
    --threads "$threads" --stats --json 2>"$out/engine.err" <<'PY'
import json, os, subprocess, sys
policy, cmd, n = sys.argv[1], sys.argv[2:], int(os.environ["OVH_TOKENS"])
def run(k):
    p = subprocess.Popen(cmd + ["--policy", policy, "--max-tokens", str(k)], stdout=subprocess.PIPE)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = status
    if status:
        sys.exit("kvrelay-generate failed (%s)" % status)
    return json.loads(out)["stats"], ru.ru_utime + ru.ru_stime
s, cpu = run(n)
_, cpu2 = run(2)
g = s["generated_tokens"]
print("%.9f %d %d %.9f" % (s["decode_seconds"] / (g - 1) if g > 1 else 0, s["prompt_tokens"], g,
                          (cpu - cpu2) / (n - 2) if n > 2 else 0))
PY
}
# The decode node's threads: "tid cpu_ns runqueue_wait_ns" (/proc/PID/task/*/schedstat).
threads_of() {
  local t
  for t in /proc/"$1"/task/*; do echo "${t##*/} $(cut -d' ' -f1,2 "$t/schedstat" 2>/dev/null)"; done
}
# cluster POLICY -> "tpot_s prompt_tokens completion_tokens decode_node_tpot_s loop_cpu_s loop_wait_s"
# (the last two per token, of the decode node's busiest thread over the request: its batching loop)
cluster() {
  local js rid a b dpid
  dpid=$(krc_pid decode-0)
  a=$(threads_of "$dpid")
  js=$(on "$other_cpus" "$bin/kvrelay-cli" --router "$KRC_ROUTER" generate --prompt "$prompt" --max-tokens "$tokens" \
    --policy "$1" --json 2>"$out/cli.err")
  b=$(threads_of "$dpid")
  rid=$($py -c 'import json, sys; print(json.loads(sys.argv[1])["request_id"])' "$js")
  # the decode node logs its own tpot when the stream ends, just before the router's finish
  local i line=
  for ((i = 0; i < 50; i++)); do
    line=$(grep -F "$rid" "$KRC_DIR/decode-0.log" | grep -F ' ended OK ' || true)
    [ -n "$line" ] && break
    sleep 0.02
  done
  $py -c 'import json, re, sys
u = json.loads(sys.argv[1])["usage"]
m = re.search(r"tpot ([0-9.]+) ms", sys.argv[2])
before = {l.split()[0]: l.split()[1:] for l in sys.argv[3].splitlines() if len(l.split()) == 3}
after = {l.split()[0]: l.split()[1:] for l in sys.argv[4].splitlines() if len(l.split()) == 3}
d = [(int(after[t][0]) - int(before[t][0]), int(after[t][1]) - int(before[t][1])) for t in after if t in before]
cpu, wait = max(d) if d else (0, 0)
n = max(u.get("completion_tokens", 0) - 1, 1)
print("%.9f %d %d %.9f %.9f %.9f" % (u.get("tpot_s", 0), u.get("prompt_tokens", 0), u.get("completion_tokens", 0),
                                    float(m.group(1)) / 1e3 if m else -1, cpu / 1e9 / n, wait / 1e9 / n))' \
    "$js" "$line" "$a" "$b"
}

# one request per policy first: the decode pool's pages and both nodes' caches warm up
for p in "${policies[@]}"; do cluster "$p" >/dev/null; done
# then the decode node's compute threads (the most CPU so far) move to the compute CPUs
if [ -n "$compute_cpus" ]; then
  threads_of "$(krc_pid decode-0)" | sort -k2,2nr | head -n "$threads" | while read -r tid _; do
    taskset -pc "$compute_cpus" "$tid" >/dev/null
  done
fi

export OVH_TOKENS=$tokens
printf 'round\tpolicy\tengine_tpot_s\tcluster_tpot_s\tdecode_node_tpot_s\tprompt_tokens\tengine_cpu_s\tloop_cpu_s\tloop_wait_s\n' \
  >"$out/runs.tsv"
for ((r = 1; r <= rounds; r++)); do
  for p in "${policies[@]}"; do
    read -r et ep en ec < <(engine "$p")
    read -r ct cp cn dt lc lw < <(cluster "$p")
    if [ "$en" != "$tokens" ] || [ "$cn" != "$tokens" ]; then
      echo "overhead.sh: $p: the engine gave $en and the cluster $cn tokens, not $tokens" \
        "(EOS?); pick another --prompt-chars or model" >&2
      exit 1
    fi
    [ "$ep" = "$cp" ] || echo "overhead.sh: $p: prompt of $ep tokens in the engine, $cp through the router" >&2
    printf '%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$r" "$p" "$et" "$ct" "$dt" "$ep" "$ec" "$lc" "$lw" \
      >>"$out/runs.tsv"
    awk -v r="$r" -v n="$rounds" -v p="$p" -v e="$et" -v c="$ct" -v ec="$ec" -v lc="$lc" -v lw="$lw" 'BEGIN {
      printf "overhead.sh: round %d/%d %-38s TPOT engine %.2f cluster %.2f ms; CPU/token engine %.2f" \
        " decode loop %.2f ms, its run-queue wait %.2f ms\n", r, n, p, e * 1e3, c * 1e3, ec * 1e3,
        lc * 1e3, lw * 1e3 }' >&2
  done
done

$py - "$out/runs.tsv" "$limit" "$threads" "$tokens" "$rounds" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
limit = float(sys.argv[2])
print("TPOT at one request, median of %s rounds: %s thread(s) per process, %s tokens, prompt %s tokens"
      % (sys.argv[5], sys.argv[3], sys.argv[4], rows[0]["prompt_tokens"]))
w = max(len(r["policy"]) for r in rows)
print("%-*s  %9s  %10s  %6s  %6s  %5s  |  %10s  %10s  %9s  %10s" % (
    w, "policy", "engine ms", "cluster ms", "ratio", "paired", "limit", "engine CPU", "loop CPU",
    "CPU ratio", "loop wait"))
over = 0
med = lambda p, k: statistics.median(float(r[k]) for r in rows if r["policy"] == p) * 1e3
for p in dict.fromkeys(r["policy"] for r in rows):
    e, c, ec, lc, lw = (med(p, k) for k in ("engine_tpot_s", "cluster_tpot_s", "engine_cpu_s", "loop_cpu_s",
                                            "loop_wait_s"))
    paired = statistics.median(float(r["cluster_tpot_s"]) / float(r["engine_tpot_s"])
                               for r in rows if r["policy"] == p)
    over += not paired <= limit  # NaN counts as over
    print("%-*s  %9.3f  %10.3f  %6.3f  %6.3f  %5.2f  |  %10.3f  %10.3f  %9.3f  %10.3f%s" % (
        w, p, e, c, c / e, paired, limit, ec, lc, lc / ec if ec else 0, lw,
        "" if paired <= limit else "  OVER"))
print("(ratio: of the two medians; paired: the median over rounds of each round's cluster / engine, which"
      " the host's drift between rounds does not move, and what --limit checks. CPU: ms per decode token, the"
      " engine's whole process, the decode node's batching thread; loop wait: ms per token that thread was"
      " runnable but not running)")
sys.exit(1 if over else 0)
PY
