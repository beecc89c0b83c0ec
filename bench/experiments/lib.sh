# lib.sh - what the cluster experiments in this directory share: flag parsing (--bin, --quick,
# --out), the checks before anything starts, and a cluster of this machine's processes started
# with deploy/local-cluster.sh and stopped on exit. Sourced by the experiment scripts, not run
# on its own; docs/benchmarks.md ("Cluster experiments") says what each experiment measures.
#
# After `exp_parse NAME "$@"`: EXP_HERE (the repository), EXP_BIN, EXP_QUICK (0/1), EXP_OUT
# (created), EXP_MODEL, EXP_BENCH (kvrelay-bench-serve), EXP_PY (/usr/bin/python3), EXP_SHAPE
# (--shape CONFIG, taken only by a script that set EXP_TAKES_SHAPE=1 before exp_parse; else empty).
# `exp_shape_model CONFIG` makes a model of that config's shape with random weights
# (kvrelay-make-model) in a temporary directory removed on exit and points EXP_MODEL at it.
# `exp_cluster_start TAG N_PREFILL N_DECODE [node args...]` starts a cluster whose logs go to
# $EXP_OUT/logs/TAG (KRC_PREFILL_ARGS, KRC_DECODE_ARGS, KRC_ROUTER_ARGS as local-cluster.sh
# reads them) and sets KRC_ROUTER; `exp_cluster_stop` stops it (also run on exit).

EXP_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
EXP_PY=/usr/bin/python3
export PYTHONPATH=$EXP_HERE/bench/experiments${PYTHONPATH:+:$PYTHONPATH} # plots.py
EXP_BENCH=$EXP_HERE/tools/kvrelay-bench-serve
EXP_MODEL=$EXP_HERE/models/kjv-2l128-2k
# at top level: its declare -A would be local to a function that sourced it
# shellcheck source=../../deploy/local-cluster.sh
. "$EXP_HERE/deploy/local-cluster.sh"

exp_usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

exp_parse() {
  EXP_NAME=$1; shift
  EXP_BIN=$EXP_HERE/build EXP_QUICK=0 EXP_OUT= EXP_SHAPE=
  while [ $# -gt 0 ]; do
    case $1 in
      --bin) [ $# -ge 2 ] || { echo "$EXP_NAME: --bin needs a directory" >&2; exit 2; }
        EXP_BIN=$(cd "$2" 2>/dev/null && pwd) || { echo "$EXP_NAME: --bin $2: no such directory" >&2; exit 2; }
        shift 2 ;;
      --quick) EXP_QUICK=1; shift ;;
      --shape) [ "${EXP_TAKES_SHAPE:-0}" = 1 ] || { echo "$EXP_NAME: no --shape here (--help lists the flags)" >&2; exit 2; }
        [ $# -ge 2 ] && [ -f "$2" ] || { echo "$EXP_NAME: --shape needs a config.json file" >&2; exit 2; }
        EXP_SHAPE=$2; shift 2 ;;
      --out) [ $# -ge 2 ] || { echo "$EXP_NAME: --out needs a directory" >&2; exit 2; }
        EXP_OUT=$2; shift 2 ;;
      -h | --help) exp_usage; exit 0 ;;
      *) echo "$EXP_NAME: unknown flag '$1' (--help lists them)" >&2; exit 2 ;;
    esac
  done
  local p
  for p in kvrelay-router kvrelay-prefill kvrelay-decode; do
    [ -x "$EXP_BIN/$p" ] || {
      echo "$EXP_NAME: $EXP_BIN has no built $p; build it first (./kvrelay build, or" \
        "cmake -S . -B DIR -DCMAKE_BUILD_TYPE=Release && cmake --build DIR, then --bin DIR)" >&2
      exit 2
    }
  done
  [ -x "$EXP_PY" ] || { echo "$EXP_NAME: $EXP_PY is missing (apt-get install python3)" >&2; exit 2; }
  "$EXP_PY" -c 'import grpc, numpy, matplotlib' 2>/dev/null || {
    echo "$EXP_NAME: kvrelay-bench-serve needs Debian's python3 modules:" \
      "apt-get install python3-grpcio python3-protobuf protobuf-compiler protobuf-compiler-grpc python3-numpy python3-matplotlib" >&2
    exit 2
  }
  [ -f "$EXP_MODEL/config.json" ] || { echo "$EXP_NAME: the default model $EXP_MODEL is missing" >&2; exit 2; }
  EXP_OUT=${EXP_OUT:-$EXP_HERE/bench/results/$EXP_NAME}
  mkdir -p "$EXP_OUT" "$EXP_OUT/logs"
  EXP_OUT=$(cd "$EXP_OUT" && pwd)
  trap exp_cluster_stop EXIT
  trap 'exit 130' INT TERM
}

exp_shape_model() {
  [ -x "$EXP_BIN/kvrelay-make-model" ] || { echo "$EXP_NAME: $EXP_BIN has no kvrelay-make-model" >&2; exit 2; }
  local dims h l nh kvh im
  dims=$("$EXP_PY" -c 'import json, sys
c = json.load(open(sys.argv[1]))
print(c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
      c.get("num_key_value_heads", c["num_attention_heads"]), c["intermediate_size"])' "$1") || {
    echo "$EXP_NAME: $1: not a model config (hidden_size, num_hidden_layers, num_attention_heads," \
      "intermediate_size)" >&2
    exit 2
  }
  read -r h l nh kvh im <<<"$dims"
  EXP_SHAPE_DIR=$(mktemp -d -t "kvrelay-$EXP_NAME-model.XXXXXX")
  trap 'exp_cluster_stop; rm -rf "$EXP_SHAPE_DIR"' EXIT
  # an 8192-token tokenizer trained on the corpus, not the config's vocabulary: the embedding and
  # output rows a step reads scale with it, and the corpus has no use for more
  "$EXP_BIN/kvrelay-make-model" --corpus "$EXP_HERE/tools/data/corpus.txt" --out "$EXP_SHAPE_DIR" --vocab 8192 \
    --hidden "$h" --layers "$l" --heads "$nh" --kv-heads "$kvh" --intermediate "$im" --dtype bf16 >/dev/null
  EXP_MODEL=$EXP_SHAPE_DIR
}

exp_cluster_start() {
  local tag=$1; shift
  KRC_DIR=$EXP_OUT/logs/$tag
  rm -rf "$KRC_DIR"
  krc_start "$EXP_BIN" "$EXP_MODEL" "$1" "$2" 127.0.0.1:0 "${@:3}" || {
    echo "$EXP_NAME: the cluster '$tag' did not start (logs in $KRC_DIR)" >&2
    exit 1
  }
  echo "$EXP_NAME: cluster '$tag' up: $1 prefill + $2 decode node(s), router $KRC_ROUTER" >&2
}

exp_cluster_stop() {
  krc_stop
  unset KRC_DIR
}

# The machine, for the record: cores and load when the experiment started.
exp_machine() {
  echo "$(nproc) CPU cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at start, $(date -u +%Y-%m-%dT%H:%MZ)"
}
