#!/usr/bin/env bash
# vs-llama-server.sh - a kvrelay cluster against llama.cpp's llama-server on the same model, the
# same machine and the same load through the OpenAI API (docs/benchmarks.md, "Against
# llama-server"): a single-turn closed loop at concurrency 1, 4 and 16 with both servers'
# prompt caches out of play, and the chat workload with llama-server's prompt cache on, both
# driven by tools/kvrelay-bench-serve. Not a test: the figures depend on the machine; run it
# by hand, on a machine nobody else is measuring on.
#
#   bench/vs-llama-server.sh [--llama-cpp DIR | --llama-src DIR] [--bin DIR] [--threads N]
#       [--config FILE] [--dtype T] [--levels LIST] [--requests N] [--warmup N]
#       [--prompt-len N] [--output-len N] [--chat-concurrency C] [--conversations N]
#       [--turns N] [--think-time S] [--prefix-len N] [--message-len N] [--allow-eos]
#       [--decode-cpu-sched batch|normal|idle] [--out DIR]
#
# llama-server. --llama-cpp DIR: a llama.cpp build directory holding bin/llama-server.
# --llama-src DIR: a llama.cpp checkout, in which llama-server is built (DIR/build) unless
# there. Neither: llama.cpp is cloned at the version bench/lib/llama-cpp.sh pins (b4748, the
# one bench/vs-llama.cpp.sh and docs/performance.md use; this needs the network) into
# OUT/llama.cpp and built there, Release, -DGGML_NATIVE=ON.
#
# The model. bench/gguf_model.py writes one random-weight model in the shape of --config with
# --dtype weights twice, model.safetensors for kvrelay and model.gguf for llama.cpp, with the
# same values (as bench/vs-llama.cpp.sh does). Its vocabulary size is that of a byte-level BPE
# tokenizer kvrelay-make-model trains on tools/data/corpus.txt (4242 tokens, where the shape
# says 32000), whose tokenizer.json goes beside model.safetensors: kvrelay's router needs one
# to stream text, and with it every token id the model can generate decodes on both sides.
# Prompts are token ids (cut from tools/data/corpus.txt by kvrelay's Tokenize), so both
# servers get the same ids; their answers are text, whose form differs (llama.cpp's GGUF
# carries placeholder token names) but not their token counts.
#
# The servers, tuned as their own docs say:
#   kvrelay      deploy/local-cluster.sh: router + 1 prefill + 1 decode node, each node
#                --threads N (--threads, default 2), the decode node --cpu-sched idle
#                (--decode-cpu-sched), defaults otherwise
#   llama-server -m model.gguf --threads N --threads-batch N --flash-attn --parallel P
#                --ctx-size P x (the longest request) --batch-size 512 --ubatch-size 512
#                --no-webui, P = the level's concurrency (the chat's for the chat); started
#                afresh for each level
# Why --batch-size 512 (the default is 2048; 512 is the default --ubatch-size, so every
# ubatch is computed as before): llama-server's slots share one KV cache, and a ubatch needs
# as many free cells in a row. Once that cache is full and fragmented (16 slots, each cell in
# use), a 2048-token batch of new prompts finds no room for its last ubatch; llama_decode
# (b4748) then returns 1 but keeps the ubatches it had already placed, the server retries the
# same tokens in halves, which places them again, until not one cell is left: it logs
# "failed to decode the batch: KV cache is full", releases every slot and ends each of their
# streams with an 'error: {"message": "Input prompt is too big compared to KV size..."}'
# event (40 of 64 requests at concurrency 16 in a run with the default). With a batch of
# one ubatch a failed placement keeps nothing, and as the cache holds every slot's longest
# request the halving retries find room: every request is served, a few prompt chunks in
# smaller ubatches (the count is on stderr).
# kvrelay's two nodes each compute with N threads, llama-server with N in all, as llama.cpp
# serves prefill and decode from one process; on a machine with fewer than 2N + 1 cores
# kvrelay's nodes share cores, which the table's header says. Sharing cores, the decode node
# runs under SCHED_IDLE (docs/cluster.md, "Co-located nodes"): a new prompt is computed at
# once on every core and the decode steps fill the time between prompts, which is what
# llama-server's one batch does when it puts each new prompt ahead of the running streams.
# Under the default policy the two nodes split the cores, a prompt takes three times as long,
# and the prefill queue holds the wait (--decode-cpu-sched batch measures that).
#
# The load (tools/kvrelay-bench-serve, one run per server and level, the first server
# alternating between levels so that the machine's drift falls on both):
#   single-turn  --concurrency C --num-requests N --warmup W --prompt-len P --output-len O
#                at each C of --levels (1,4,16); llama-server gets cache_prompt: false, so
#                that neither server reuses a prompt (their prompts share nothing anyway but
#                the BOS)
#   chat         --workload chat --concurrency C --conversations N --turns T --think-time S
#                --prefix-len X --message-len M --output-len O: every conversation's turns
#                resend the conversation so far (docs/benchmarks.md, "Workloads"), with
#                llama-server's prompt cache on. Through the OpenAI API an answer comes back as
#                text, so the next turn carries a stand-in of as many tokens: both servers get
#                the same ids, and a cache can reuse the previous prompt, not the answer. The
#                table gives each side's cached-token fraction (kvrelay's from
#                usage.prompt_tokens_details.cached_tokens, when its router sends it;
#                llama-server's from its timings: prompt tokens - timings.prompt_n)
# Every request asks for exactly O tokens (ignore_eos: true); --allow-eos leaves it out, for a
# router that does not take the field.
#
# Output: a markdown table on stdout, per level, of output tokens/s and TTFT p50 / p99 of each
# server and their ratios (kvrelay / llama-server: above 1 is kvrelay ahead in throughput, below
# 1 ahead in TTFT); OUT keeps the models, the servers' logs and every run's summary JSON. A
# request a server failed is counted in the table's row (errors: ...) with its message in the
# run's JSON; on stderr, after each llama-server, how many of its batches were retried smaller
# for want of KV room, and how often its KV cache was full, from its log.
# Defaults: --bin build, --threads 2, --config tools/data/llama-110m.json, --dtype bf16,
# --levels 1,4,16, --requests 64, --warmup 4, --prompt-len 512, --output-len 128,
# --chat-concurrency 4, --conversations 16, --turns 4, --think-time 1, --prefix-len 512,
# --message-len 64, --out a new temporary directory (kept).
# Exit 0, 1 when a server or a run failed, 2 for bad flags.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
. "$here/bench/lib/llama-cpp.sh"
llama= llama_src= bin=$here/build threads=2 config=$here/tools/data/llama-110m.json dtype=bf16
levels=1,4,16 requests=64 warmup=4 prompt=512 output=128 chat_c=4 convs=16 turns=4 think=1
prefix=512 message=64 eos=(--ignore-eos) out= decode_sched=idle
usage() { sed -n '2,/^[^#]/{/^#/!q;s/^# \{0,1\}//p}' "$0" || true; }
while [ $# -gt 0 ]; do
  case $1 in
    --llama-cpp) llama=${2:?--llama-cpp needs a directory}; shift 2 ;;
    --llama-src) llama_src=${2:?--llama-src needs a directory}; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --levels) levels=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --prompt-len) prompt=$2; shift 2 ;;
    --output-len) output=$2; shift 2 ;;
    --chat-concurrency) chat_c=$2; shift 2 ;;
    --conversations) convs=$2; shift 2 ;;
    --turns) turns=$2; shift 2 ;;
    --think-time) think=$2; shift 2 ;;
    --prefix-len) prefix=$2; shift 2 ;;
    --message-len) message=$2; shift 2 ;;
    --allow-eos) eos=(); shift ;;
    --decode-cpu-sched) decode_sched=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "vs-llama-server.sh: unknown flag '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done
die2() { echo "vs-llama-server.sh: $*" >&2; exit 2; }
die1() { echo "vs-llama-server.sh: $*" >&2; exit 1; }
for n in "$threads" "$requests" "$prompt" "$output" "$chat_c" "$convs" "$turns" "$prefix" "$message"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || die2 "'$n' is not a positive integer"
done
[[ $warmup =~ ^[0-9]+$ ]] || die2 "--warmup '$warmup' is not an integer >= 0"
[[ $think =~ ^[0-9]+(\.[0-9]+)?$ ]] || die2 "--think-time '$think' is not a number of seconds"
[[ $levels =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die2 "--levels '$levels' is not a list like 1,4,16"
case $dtype in f32 | bf16) ;; *) die2 "--dtype: '$dtype' is not f32 or bf16" ;; esac
case $decode_sched in batch | normal | idle) ;; *) die2 "--decode-cpu-sched: '$decode_sched' is not batch, normal or idle" ;; esac
[ -z "$llama" ] || [ -z "$llama_src" ] || die2 "--llama-cpp and --llama-src conflict: give one"
[ -f "$config" ] || die2 "--config $config does not exist"
for p in kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-make-model; do
  [ -x "$bin/$p" ] || die2 "--bin $bin has no built $p (cmake --build $bin)"
done
for p in /usr/bin/python3 curl; do
  command -v "$p" >/dev/null || die2 "$p is missing (apt-get install python3 curl)"
done
out=${out:-$(mktemp -d -t kvrelay-vs-llama-server.XXXXXX)}
mkdir -p "$out/runs"
out=$(cd "$out" && pwd)

# llama-server: the given build, else built in the given or a fresh pinned checkout
if [ -z "$llama" ]; then
  if [ -z "$llama_src" ]; then
    llama_src=$out/llama.cpp
    if [ ! -d "$llama_src/.git" ]; then
      echo "vs-llama-server.sh: cloning llama.cpp at $LLAMA_CPP_PIN into $llama_src" >&2
      llama_cpp_fetch "$llama_src" || die1 "could not clone $LLAMA_CPP_REPO (no network?); give --llama-cpp or --llama-src"
    fi
  fi
  llama=$llama_src/build
  if [ ! -x "$llama/bin/llama-server" ]; then
    echo "vs-llama-server.sh: building llama-server in $llama" >&2
    llama_cpp_build "$llama_src" "$llama" llama-server || exit 1
  fi
fi
server=$llama/bin/llama-server
[ -x "$server" ] || die2 "--llama-cpp $llama has no bin/llama-server. Build it:
$(llama_cpp_build_hint llama-server)"
llama_commit=$(llama_cpp_commit "$llama")
[ "${llama_commit:-}" = "$LLAMA_CPP_PIN" ] || echo "vs-llama-server.sh: note: llama.cpp is at" \
  "${llama_commit:-an unknown commit}, not the pinned $LLAMA_CPP_PIN" >&2

# the model: the corpus tokenizer's vocabulary, the shape of --config, written for both engines
model=$out/models/$dtype
if [ ! -f "$model/tokenizer.json" ]; then
  "$bin/kvrelay-make-model" --corpus "$here/tools/data/corpus.txt" --out "$out/tokenizer" --vocab 32000 \
    --hidden 64 --layers 1 --heads 2 --kv-heads 1 --intermediate 64 >/dev/null ||
    die1 "kvrelay-make-model could not train the tokenizer"
  vocab=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
    "$out/tokenizer/config.json")
  llama_models "$out/models" "$config" "$dtype" "$vocab" || die1 "bench/gguf_model.py failed"
  cp "$out/tokenizer/tokenizer.json" "$out/tokenizer/tokenizer_config.json" "$model/"
fi

cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
echo "vs-llama-server.sh: $(nproc) CPUs ($cpu), load $(cut -d' ' -f1-3 /proc/loadavg); $threads threads;" \
  "llama-server $server; output in $out" >&2

. "$here/deploy/local-cluster.sh"
export KRC_DIR=$out/cluster
mkdir -p "$KRC_DIR"
llama_pid=
cleanup() {
  [ -z "$llama_pid" ] || { kill "$llama_pid" 2>/dev/null; wait "$llama_pid" 2>/dev/null || true; }
  krc_stop
}
trap cleanup EXIT
unset KVRELAY_API_KEY
KRC_DECODE_ARGS=(--cpu-sched "$decode_sched")
krc_start "$bin" "$model" 1 1 127.0.0.1:0 --threads "$threads" || die1 "the kvrelay cluster did not start (logs in $KRC_DIR)"
kv_url=http://$KRC_ROUTER_HTTP/v1

# llama_start SLOTS CTX_PER_SLOT NAME: llama-server on a free port, until /health answers 200
llama_start() {
  local port i
  port=$(/usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$server" -m "$model/model.gguf" --host 127.0.0.1 --port "$port" --threads "$threads" \
    --threads-batch "$threads" --flash-attn --parallel "$1" --ctx-size $(($1 * $2)) \
    --batch-size 512 --ubatch-size 512 --no-webui \
    >"$out/runs/llama-server-$3.log" 2>&1 &
  llama_pid=$!
  llama_url=http://127.0.0.1:$port/v1
  for ((i = 0; i < 600; i++)); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")" = 200 ] && return 0
    kill -0 "$llama_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "vs-llama-server.sh: llama-server did not serve; the end of its log:" >&2
  tail -n 15 "$out/runs/llama-server-$3.log" >&2
  return 1
}
# llama_stop NAME: stops llama-server; says how often its KV cache had no room (its log's lines)
llama_stop() {
  local log=$out/runs/llama-server-$1.log full retries
  kill "$llama_pid" 2>/dev/null || true
  wait "$llama_pid" 2>/dev/null || true
  llama_pid=
  full=$(grep -c 'KV cache is full' "$log" || true)
  retries=$(grep -c 'failed to find free space in the KV cache' "$log" || true)
  [ "$full$retries" = 00 ] || echo "vs-llama-server.sh: llama-server ($1): $retries batches retried smaller" \
    "for want of free KV cells in a row; KV cache full $full times (each failing every slot's" \
    "request); see $log" >&2
}

# bench SERVER NAME FLAGS...: one kvrelay-bench-serve run into runs/NAME-SERVER.{json,log}
bench() {
  local who=$1 name=$2 url=$kv_url
  shift 2
  [ "$who" = kvrelay ] || url=$llama_url
  echo "vs-llama-server.sh: $name, $who (load $(cut -d' ' -f1 /proc/loadavg))" >&2
  "$here/tools/kvrelay-bench-serve" --openai "$url" --target "$KRC_ROUTER" --text "$here/tools/data/corpus.txt" \
    --no-progress --output-len "$output" "${eos[@]}" --json "$out/runs/$name-$who.json" "$@" \
    >"$out/runs/$name-$who.log" 2>&1 ||
    { tail -n 12 "$out/runs/$name-$who.log" >&2; die1 "kvrelay-bench-serve failed against $who ($name)"; }
}

# both NAME INDEX FLAGS...: the run against each server, in the order the index's parity says
both() {
  local name=$1 k=$2 cached=(--extra-body '{"cache_prompt": false}')
  shift 2
  [ "$name" != chat ] || cached=()
  if [ $((k % 2)) = 0 ]; then bench kvrelay "$name" "$@"; bench llama "$name" "${cached[@]}" "$@"
  else bench llama "$name" "${cached[@]}" "$@"; bench kvrelay "$name" "$@"; fi
}

IFS=, read -r -a level_list <<<"$levels"
k=0
for c in "${level_list[@]}"; do
  llama_start "$c" $((prompt + output + 16)) "c$c" || exit 1
  both "c$c" "$k" --concurrency "$c" --num-requests "$requests" --warmup "$warmup" --prompt-len "$prompt"
  llama_stop "c$c"
  k=$((k + 1))
done
llama_start "$chat_c" $((prefix + turns * (message + output) + 16)) chat || exit 1
both chat "$k" --workload chat --concurrency "$chat_c" --conversations "$convs" --turns "$turns" \
  --think-time "$think" --prefix-len "$prefix" --message-len "$message"
llama_stop chat

/usr/bin/python3 - "$out" "$levels" "$threads" "$(nproc)" "${llama_commit:-unknown}" "$dtype" "$config" \
  "$decode_sched" <<'PY'
import json, os, sys
out, levels, threads, cpus, commit, dtype, config, decode_sched = sys.argv[1:]
threads, cpus = int(threads), int(cpus)

def summary(name, who):
    with open(os.path.join(out, "runs", "%s-%s.json" % (name, who))) as f:
        return json.load(f)["runs"][0]["summary"]

def ratio(a, b):
    return "%.2f" % (a / b) if a is not None and b else "-"

def ms(d, key):
    return "%.1f" % d[key] if d[key] is not None else "-"

def cached(s):
    return "%.2f" % s["cached_token_fraction"] if s.get("cached_token_fraction") is not None else "-"

print("kvrelay (router + 1 prefill + 1 decode node, --threads %d each, decode node --cpu-sched %s) vs "
      "llama-server (--threads %d), %s weights of %s, llama.cpp %s, %d CPUs%s" % (
      threads, decode_sched, threads, dtype, os.path.basename(config), commit,
      cpus, "" if cpus > 2 * threads else " (kvrelay's nodes share cores)"))
print("| load | kvrelay tok/s | llama-server tok/s | throughput ratio | kvrelay TTFT p50 / p99 ms "
      "| llama-server TTFT p50 / p99 ms | TTFT p50 ratio | cached tokens kvrelay / llama-server |")
print("|---|---|---|---|---|---|---|---|")
names = [("c%s" % c, "closed loop, concurrency %s" % c) for c in levels.split(",")] + [("chat", "chat")]
for name, label in names:
    kv, ll = summary(name, "kvrelay"), summary(name, "llama")
    if kv["ok"] < kv["requests"] or ll["ok"] < ll["requests"]:
        label += " (errors: kvrelay %d, llama-server %d)" % (kv["requests"] - kv["ok"], ll["requests"] - ll["ok"])
    print("| %s | %.1f | %.1f | %s | %s / %s | %s / %s | %s | %s / %s |" % (
        label, kv["output_token_throughput"], ll["output_token_throughput"],
        ratio(kv["output_token_throughput"], ll["output_token_throughput"]),
        ms(kv["ttft_ms"], "p50"), ms(kv["ttft_ms"], "p99"), ms(ll["ttft_ms"], "p50"), ms(ll["ttft_ms"], "p99"),
        ratio(kv["ttft_ms"]["p50"], ll["ttft_ms"]["p50"]), cached(kv), cached(ll)))
PY
echo "vs-llama-server.sh: load at the end $(cut -d' ' -f1-3 /proc/loadavg); every run's summary in $out/runs" >&2
