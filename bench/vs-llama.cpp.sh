#!/usr/bin/env bash
# vs-llama.cpp.sh - kvrelay's CPU engine against llama.cpp on the same model, the same weights and
# the same thread count (docs/performance.md): prefill of a 512-token prompt, decode of one
# sequence at contexts 128 and 2048, and decode of batches of 8 and 32 sequences at those
# contexts, for f32 and bf16 weights. Not a test: the figures depend on the machine;
# run it by hand. llama.cpp is not part of this repository: build it yourself (below) and point
# --llama-cpp at the build directory.
#
#   bench/vs-llama.cpp.sh --llama-cpp DIR [--bin DIR] [--threads N] [--rounds N] [--config FILE]
#                         [--dtypes LIST] [--prompt N] [--contexts LIST] [--batches LIST]
#                         [--decode-tokens N] [--repeat N] [--out DIR] [--llama-args "ARGS"]
#                         [--llama-shared-prompt]
#
# Building llama.cpp at the version bench/lib/llama-cpp.sh pins (b4748):
#   git clone https://github.com/ggml-org/llama.cpp llama.cpp
#   git -C llama.cpp checkout c392e5094deaf2d1a7c18683214f007fad3fe42b
#   cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
#   cmake --build llama.cpp/build -j --target llama-bench llama-batched-bench
# and pass --llama-cpp llama.cpp/build (the directory holding bin/llama-bench and
# bin/llama-batched-bench).
# llama-batched-bench times the batches; with --batches '' llama-bench alone does, unless it lacks
# the depth option (-d, --n-depth; older versions such as b4748): then batched-bench also times
# decode at a context.
#
# What runs. bench/gguf_model.py writes, per dtype, one random-weight model in the shape of
# --config twice: config.json + model.safetensors for kvrelay and model.gguf for llama.cpp, with
# the same values (q/k rows reordered for llama.cpp's rotary layout). Each round runs, per dtype
# and per test, kvrelay and llama.cpp back to back (which goes first alternates between rounds),
# so that the machine's other load, which drifts within minutes on a shared machine, falls on
# both sides of a ratio alike:
#   prefill 512:  kvrelay-bench-engine --model M --threads N --prefill 512 --contexts 1
#                   --decode-tokens 1 --repeat 3 --json              (the prefill figure)
#                 llama-bench -m M.gguf -t N -p 512 -n 0 -r 3 -o jsonl    (after its warm-up)
#   decode at C:  kvrelay-bench-engine --model M --threads N --prefill 1 --contexts C
#                   --decode-tokens 32 --repeat 3 --json             (the decode figure)
#                 llama-bench -m M.gguf -t N -p 0 -n 32 -d C -r 3 -o jsonl, or without -d:
#                 llama-batched-bench -m M.gguf -t N -tb N -c C+288 -npp C,C,C -ntg 32 -npl 1
#                   --output-format jsonl        (32 decode steps after each C-token prompt)
#   decode at C, batch B (every B of --batches in one run of each program):
#                 kvrelay-bench-engine --model M --threads N --prefill 1 --contexts C
#                   --batch 8,32 --decode-tokens 32 --repeat 1 --json
#                 llama-batched-bench -m M.gguf -t N -tb N -c 32*(C+32) -npp C -ntg 32
#                   -npl 8,32 --output-format jsonl
#                 (B sequences, each with its own C-token prompt, then 32 steps of one token per
#                 sequence; -c must hold B x (C + 32) cells, or batched-bench skips the batch)
# Each side's figure is a best of 3 (kvrelay-bench-engine's own rule; the best of llama-bench's
# 3 samples; the best of batched-bench's 3 prompts), except for the batches: one sample of 32
# steps on each side (batched-bench times decode only after a prefill of B x C tokens, the
# costly part of the run, so the rounds are the repeats there). The table shows the median over
# rounds of each engine and the ratio kvrelay / llama.cpp of those medians; beside it the paired
# ratio, the median of each round's ratio (a round's two runs are seconds apart, so it carries
# less of the drift between rounds), and the range of the per-round ratios. Decode tok/s is 1 /
# the time of one step at that context (batch 1); decode at a batch B is the batch's total, B /
# the time of one step (batched-bench's S_TG t/s, speed_tg = B x 32 / the 32 steps' time);
# prefill tok/s is prompt tokens / prefill time.
#
# The batches cost: both sides prefill B x C tokens per batch size (65536 at batch 32 and
# context 2048); fewer --batches or --contexts shorten a run. llama.cpp b4748 keeps one KV cache
# for all the sequences, and its attention runs every token's query over all of the cache's
# cells in use, masked (B x (C + 32) at batch B), where kvrelay's runs over the sequence's own
# C + 32: at long contexts and large batches llama.cpp does up to B times the attention work, in
# its prefill as in its decode. That is how it decodes independent sequences at that version, so
# the rows compare it as it is. --llama-shared-prompt gives batched-bench -pps: one C-token
# prompt prefilled once, its cells shared by the B sequences, so that a batch at context 2048
# costs llama.cpp one 2048-token prefill instead of B (at batch 32 the unshared prefill took
# over 11 minutes on 2 vCPUs). Its decode then attends over C + 32 B cells instead of
# B (C + 32): llama.cpp does less work than kvrelay, which keeps each sequence's own KV, so a
# row kvrelay wins under it, it wins with llama.cpp given the easier job.
#
# Not the same work in every respect: llama.cpp keeps its KV cache in f16 by default, kvrelay in
# the weights' dtype (--llama-args "-ctk f32 -ctv f32" asks llama.cpp for f32, which the b4748
# llama-bench refuses; --llama-args goes to every
# llama.cpp program run, so give only flags they all take); llama.cpp's bf16 matmul rounds the
# activations to bf16, and so does kvrelay's prefill on a CPU with AVX-512-BF16 (elsewhere it
# keeps them f32). Both compute the logits of a prompt's last token only.
#
# Defaults: --bin build, --threads 2, --rounds 3, --config tools/data/llama-110m.json (hidden 768,
# 12 layers, 12/4 heads, MLP 2048, vocab 32000), --dtypes f32,bf16, --prompt 512, --contexts
# 128,2048, --batches 8,32 ('' for none), --decode-tokens 32, --repeat 3, --out a new temporary
# directory (kept; it holds the models, every raw output and runs.tsv). Exit 0, 1 when a run
# failed, 2 for bad flags.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/lib/llama-cpp.sh"
llama= bin=$here/build threads=2 rounds=3 config=$here/tools/data/llama-110m.json dtypes=f32,bf16
prompt=512 contexts=128,2048 batches=8,32 steps=32 repeat=3 out= llama_args= pps=
# the header above, up to its first line that is no comment; a reader that stops early
# (--help | grep -q) is no error
usage() { sed -n '2,/^[^#]/{/^#/!q;s/^# \{0,1\}//p}' "$0" || true; }
while [ $# -gt 0 ]; do
  case $1 in
    --llama-cpp) llama=${2:?--llama-cpp needs a directory}; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --dtypes) dtypes=$2; shift 2 ;;
    --prompt) prompt=$2; shift 2 ;;
    --contexts) contexts=$2; shift 2 ;;
    --batches) batches=$2; shift 2 ;;
    --decode-tokens) steps=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --llama-args) llama_args=$2; shift 2 ;;
    --llama-shared-prompt) pps=-pps; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "vs-llama.cpp.sh: unknown flag '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
die2() { echo "vs-llama.cpp.sh: $*" >&2; exit 2; }
for n in "$threads" "$rounds" "$prompt" "$steps" "$repeat"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || die2 "'$n' is not a positive integer"
done
[[ $contexts =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die2 "--contexts '$contexts' is not a list like 128,2048"
[[ $batches =~ ^([1-9][0-9]*(,[1-9][0-9]*)*)?$ ]] || die2 "--batches '$batches' is not a list like 8,32 (or '')"
IFS=, read -r -a dtype_list <<<"$dtypes"
for d in "${dtype_list[@]}"; do
  case $d in f32 | bf16) ;; *) die2 "--dtypes: '$d' is not f32 or bf16" ;; esac
done
hint=$(llama_cpp_build_hint llama-bench llama-batched-bench)
[ -n "$llama" ] || die2 "--llama-cpp DIR is required: a llama.cpp build directory holding bin/llama-bench.
  Build one:
$hint
  then pass --llama-cpp llama.cpp/build (--help says more)"
lb=$llama/bin/llama-bench
[ -x "$lb" ] || die2 "--llama-cpp $llama has no bin/llama-bench. Build it:
$hint"
# decode at a context: llama-bench's depth option when it has one, else llama-batched-bench
if "$lb" --help 2>&1 | grep -q -- '--n-depth'; then
  decode_tool=llama-bench
else
  decode_tool=llama-batched-bench
  [ -x "$llama/bin/llama-batched-bench" ] || die2 "this llama-bench has no depth option (-d), so decode
  at a context needs bin/llama-batched-bench, which $llama lacks. Build it:
$hint"
fi
[ -z "$batches" ] || [ -x "$llama/bin/llama-batched-bench" ] || die2 "--batches $batches needs
  bin/llama-batched-bench, which $llama lacks. Build it:
$hint
  (or pass --batches '' to leave the batches out)"
[ -x "$bin/kvrelay-bench-engine" ] || die2 "--bin $bin has no built kvrelay-bench-engine (cmake --build $bin --target kvrelay-bench-engine)"
[ -f "$config" ] || die2 "--config $config does not exist"
py=/usr/bin/python3
[ -x "$py" ] || die2 "$py is missing (apt-get install python3)"
out=${out:-$(mktemp -d -t kvrelay-vs-llama.XXXXXX)}
mkdir -p "$out/raw"
IFS=, read -r -a ctx_list <<<"$contexts"
IFS=, read -r -a batch_list <<<"$batches"
max_batch=0
for b in "${batch_list[@]}"; do [ "$b" -gt "$max_batch" ] && max_batch=$b; done

# the llama.cpp commit: the source tree's git when the build directory sits in one, else what
# llama-bench was built with (unknown when it was built outside git)
llama_commit=$(llama_cpp_commit "$llama")
cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512f|avx512_bf16|amx_bf16)$' | tr '\n' ' ' || true)
echo "vs-llama.cpp.sh: $(nproc) CPUs ($cpu; $flags), load $(cut -d' ' -f1-3 /proc/loadavg);" \
  "$rounds rounds, $threads threads; llama.cpp $llama (decode via $decode_tool); output in $out" >&2

llama_models "$out/models" "$config" "$dtypes"

# run_kvrelay ROUND DTYPE TEST, run_llama ROUND DTYPE TEST (TEST: pp, tgC for decode at C, tbC
# for decode at C in every batch of --batches): raw outputs into
# $out/raw/rROUND-DTYPE-TEST-{kvrelay.json,llama.jsonl} and their .err
run_kvrelay() {
  local f=$out/raw/r$1-$2-$3-kvrelay args
  case $3 in
    pp) args=(--prefill "$prompt" --contexts 1 --decode-tokens 1 --repeat "$repeat") ;;
    tg*) args=(--prefill 1 --contexts "${3#tg}" --decode-tokens "$steps" --repeat "$repeat") ;;
    tb*) args=(--prefill 1 --contexts "${3#tb}" --batch "$batches" --decode-tokens "$steps" --repeat 1) ;;
  esac
  "$bin/kvrelay-bench-engine" --model "$out/models/$2" --threads "$threads" "${args[@]}" \
    --json >"$f.json" 2>"$f.err" ||
    { echo "vs-llama.cpp.sh: kvrelay-bench-engine failed (round $1, $2, $3):" >&2; tail -n 5 "$f.err" >&2; return 1; }
}
run_llama() {
  local f=$out/raw/r$1-$2-$3-llama m=$out/models/$2/model.gguf c=${3#t?} npp= i
  for ((i = 0; i < repeat; i++)); do npp+=${npp:+,}$c; done # batched-bench: one sample per prompt
  # shellcheck disable=SC2086 # --llama-args is split on purpose
  if [ "$3" = pp ]; then
    "$lb" -m "$m" -t "$threads" -p "$prompt" -n 0 -r "$repeat" -o jsonl $llama_args >"$f.jsonl" 2>"$f.err"
  elif [ "${3:0:2}" = tb ]; then
    "$llama/bin/llama-batched-bench" -m "$m" -t "$threads" -tb "$threads" -c $((max_batch * (c + steps))) \
      -npp "$c" -ntg "$steps" -npl "$batches" $pps --output-format jsonl $llama_args >"$f.jsonl" 2>"$f.err"
  elif [ "$decode_tool" = llama-bench ]; then
    "$lb" -m "$m" -t "$threads" -p 0 -n "$steps" -d "$c" -r "$repeat" -o jsonl $llama_args >"$f.jsonl" 2>"$f.err"
  else
    "$llama/bin/llama-batched-bench" -m "$m" -t "$threads" -tb "$threads" -c $((c + steps + 256)) \
      -npp "$npp" -ntg "$steps" -npl 1 --output-format jsonl $llama_args >"$f.jsonl" 2>"$f.err"
  fi || { echo "vs-llama.cpp.sh: llama.cpp failed (round $1, $2, $3):" >&2; tail -n 5 "$f.err" >&2; return 1; }
}

tests=(pp)
for c in "${ctx_list[@]}"; do
  tests+=("tg$c")
  [ -z "$batches" ] || tests+=("tb$c")
done
for ((r = 1; r <= rounds; r++)); do
  for d in "${dtype_list[@]}"; do
    for t in "${tests[@]}"; do
      echo "vs-llama.cpp.sh: round $r/$rounds, $d, $t (load $(cut -d' ' -f1 /proc/loadavg))" >&2
      if [ $((r % 2)) = 1 ]; then run_kvrelay "$r" "$d" "$t" || exit 1; run_llama "$r" "$d" "$t" || exit 1
      else run_llama "$r" "$d" "$t" || exit 1; run_kvrelay "$r" "$d" "$t" || exit 1; fi
    done
  done
done

# the table: medians over rounds; runs.tsv: every round's figures
"$py" - "$out" "$rounds" "$dtypes" "$prompt" "$contexts" "$batches" "$threads" "$decode_tool" "${llama_commit:-}" \
  "$pps" <<'PY'
import json, os, statistics, sys
out, rounds, dtypes, prompt, contexts, batches, threads, tool, commit, pps = sys.argv[1:]
rounds, prompt = int(rounds), int(prompt)
contexts = [int(c) for c in contexts.split(",")]
batches = [int(b) for b in batches.split(",")] if batches else []

def jsonl(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip().startswith("{")]

# (test, context, batch, label) in the order of the runs; batch 0 is the batch-1 decode of its
# own run (llama-bench -d, or batched-bench -npl 1), context 0 the prefill
tests = [("pp", 0, 0, "prefill %d" % prompt)]
for c in contexts:
    tests.append(("tg%d" % c, c, 0, "decode at %d" % c))
    tests += [("tb%d" % c, c, b, "decode at %d, batch %d" % (c, b)) for b in batches]

build = None

def kvrelay_figure(k, c, b):
    if not c:
        return k["prefill"][0]["tokens_per_second"]
    return [e for e in k["decode"] if e["batch"] == max(b, 1)][0]["tokens_per_second"]

def llama_figures(path, c, b):
    global build
    ll = []
    for e in jsonl(path):
        if not build and e.get("build_commit"):  # llama-bench's lines carry it, batched-bench's not
            build = (e["build_commit"], e.get("build_number"))
        if not c:
            ll += e["samples_ts"] if e["n_prompt"] == prompt and e["n_gen"] == 0 else []
        elif b or tool != "llama-bench":  # batched-bench: speed_tg is pl x tg / the tg steps' time
            ll += [e["speed_tg"]] if e["pp"] == c and e["pl"] == max(b, 1) else []
        else:
            ll += e["samples_ts"] if e["n_depth"] == c and e["n_gen"] > 0 else []
    return ll

rows = []  # (dtype, test, round, kvrelay, llama)
for d in dtypes.split(","):
    for r in range(1, rounds + 1):
        for test, c, b, t in tests:
            base = os.path.join(out, "raw", "r%d-%s-%s-" % (r, d, test))
            with open(base + "kvrelay.json") as f:
                kv = kvrelay_figure(json.load(f), c, b)
            ll = llama_figures(base + "llama.jsonl", c, b)
            if not ll:
                sys.exit("vs-llama.cpp.sh: round %d, %s, %s: llama.cpp reported no figure (%sllama.err)"
                         % (r, d, t, base))
            rows.append((d, t, r, kv, max(ll)))

with open(os.path.join(out, "runs.tsv"), "w") as f:
    f.write("dtype\ttest\tround\tkvrelay_tok_s\tllama_cpp_tok_s\tratio\n")
    for d, t, r, a, b in rows:
        f.write("%s\t%s\t%d\t%.2f\t%.2f\t%.3f\n" % (d, t, r, a, b, a / b))

if not commit:
    commit = "%s (build %s, from llama-bench)" % build if build else "unknown"
print("kvrelay vs llama.cpp, %d threads, median of %d rounds (each a best of its repeats); "
      "llama.cpp %s; decode via %s%s" % (int(threads), rounds, commit, tool,
                                         (", batches via llama-batched-bench" + (" -pps (one prompt shared by the "
                                          "batch's sequences)" if pps else "")) if batches else ""))
print("| weights | test | kvrelay tok/s | llama.cpp tok/s | ratio | paired ratio | per-round ratios |")
print("|---|---|---|---|---|---|---|")
seen = []
for d, t, *_ in rows:
    if (d, t) not in seen:
        seen.append((d, t))
for d, t in seen:
    sel = [x for x in rows if x[0] == d and x[1] == t]
    a = statistics.median(x[3] for x in sel)
    b = statistics.median(x[4] for x in sel)
    ratios = [x[3] / x[4] for x in sel]
    print("| %s | %s | %.1f | %.1f | %.2f | %.2f | %.2f-%.2f |" %
          (d, t, a, b, a / b, statistics.median(ratios), min(ratios), max(ratios)))
PY
echo "vs-llama.cpp.sh: load at the end $(cut -d' ' -f1-3 /proc/loadavg); every round's figures in $out/runs.tsv" >&2
