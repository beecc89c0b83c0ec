#!/usr/bin/env bash
# python_logprobs.sh - forced-token scoring through the whole cluster, as an evaluator written
# in Python sees it: Debian's python3-grpcio with stubs protoc generates from proto/, against
# real kvrelay-decode, kvrelay-prefill and kvrelay-router processes on the bundled random-weight
# default model (made by ./kvrelay test in $KR_BIN/models/default; made here into a temp dir
# when absent). The checks are in python_logprobs.py. Skips (77) when python3-grpcio or the stub
# generator is missing: `./kvrelay test` installs them. Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
PY=/usr/bin/python3 # not the python3 on PATH: a pyenv interpreter there may lack grpc (STACK.md)
PLUGIN=/usr/bin/grpc_python_plugin

if ! "$PY" -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "SKIP: python3-grpcio missing (the README's test command installs it)"
  exit 77
fi
if ! command -v protoc >/dev/null || [ ! -x "$PLUGIN" ]; then
  echo "SKIP: protoc or $PLUGIN missing (protobuf-compiler, protobuf-compiler-grpc; the README's test command installs them)"
  exit 77
fi
for p in kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-generate kvrelay-make-model; do
  [ -x "$KR_BIN/$p" ] || { echo "SKIP: $KR_BIN/$p is not built"; exit 77; }
done

tmp=$(mktemp -d)
cleanup() {
  if [ -f "$tmp/pids" ]; then
    while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done < "$tmp/pids"
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

model=$KR_BIN/models/default
if [ ! -f "$model/model.safetensors" ]; then
  model=$tmp/default
  "$KR_BIN/kvrelay-make-model" --corpus "$KR_SRC/tools/data/corpus.txt" --out "$model" >"$tmp/make-model.log" 2>&1 ||
    { cat "$tmp/make-model.log"; echo "FAIL: could not make the default model"; exit 1; }
fi

mkdir -p "$tmp/stubs"
protoc -I "$KR_SRC/proto" --python_out="$tmp/stubs" --grpc_out="$tmp/stubs" \
  --plugin=protoc-gen-grpc="$PLUGIN" "$KR_SRC/proto/kvrelay/v1/kvrelay.proto"

"$PY" "$KR_SRC/tests/integration/python_logprobs.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$model" --work "$tmp"
