# shellcheck shell=bash
# llama-cpp.sh - what the bench scripts that run llama.cpp share; sourced, not run: the pinned
# llama.cpp source and how to build its programs from it, the commit a build came from, and the
# random-weight models both engines load (bench/gguf_model.py). Not a llama.cpp installer: a
# fresh clone of llama.cpp needs the network, everything else works offline.
#
#   . "$here/bench/lib/llama-cpp.sh"        ($here: the repository root)
#   llama_cpp_build_hint TARGET...          how to build those programs, for an error message
#   llama_cpp_fetch DIR                     clones llama.cpp at the pin into DIR
#   llama_cpp_build SRC BUILD TARGET...     configures BUILD from the source SRC and builds them
#   llama_cpp_commit DIR                    the commit of a build directory's source ('' if unknown)
#   llama_models OUT CONFIG DTYPES [VOCAB]  OUT/DTYPE/{config.json,model.safetensors,model.gguf}
#                                           per dtype of the comma-separated list (one kept
#                                           in OUT is reused only when made from the same CONFIG)

# b4748 (2025-02-21), the version docs/performance.md measured
LLAMA_CPP_REPO=https://github.com/ggml-org/llama.cpp
LLAMA_CPP_PIN=c392e5094deaf2d1a7c18683214f007fad3fe42b

llama_cpp_build_hint() {
  printf '    git clone %s llama.cpp && git -C llama.cpp checkout %s\n' "$LLAMA_CPP_REPO" "$LLAMA_CPP_PIN"
  printf '    cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF\n'
  printf '    cmake --build llama.cpp/build -j --target %s\n' "$*"
}

llama_cpp_fetch() {
  git clone -q "$LLAMA_CPP_REPO" "$1" && git -C "$1" checkout -q "$LLAMA_CPP_PIN"
}

# the build's output goes to BUILD/kvrelay-build.log; its last lines are shown when it fails
llama_cpp_build() {
  local src=$1 build=$2 log
  shift 2
  mkdir -p "$build"
  log=$build/kvrelay-build.log
  { cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF &&
    cmake --build "$build" -j "$(nproc)" --target "$@"; } >"$log" 2>&1 ||
    { echo "${0##*/}: building $* in $build failed; the end of $log:" >&2; tail -n 15 "$log" >&2; return 1; }
}

# the source tree's git when the build directory sits in one (or is one)
llama_cpp_commit() {
  git -C "$1" rev-parse HEAD 2>/dev/null || git -C "$1/.." rev-parse HEAD 2>/dev/null || true
}

# a dtype's model already written is kept: the same config, dtype and seed give the same files
llama_models() {
  local out=$1 config=$2 vocab=${4:-} d list want
  IFS=, read -r -a list <<<"$3"
  # an OUT kept from an earlier run is reused only for the same config and vocabulary
  want="$(cat "$config")"$'\n'"vocab ${vocab:-config}"
  for d in "${list[@]}"; do
    [ -f "$out/$d/model.gguf" ] && [ "$(cat "$out/$d/made-from" 2>/dev/null)" = "$want" ] && continue
    echo "${0##*/}: writing the $d model ($config${vocab:+, vocabulary $vocab})" >&2
    /usr/bin/python3 "${here:?the sourcing script sets here to the repository root}/bench/gguf_model.py" --config "$config" --dtype "$d" --out "$out/$d" \
      ${vocab:+--vocab "$vocab"} >/dev/null || return 1
    printf '%s\n' "$want" >"$out/$d/made-from"
  done
}
