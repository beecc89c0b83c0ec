#!/usr/bin/env bash
# python_client.sh - a gRPC client nobody here wrote talks to kvrelay-router: Debian's
# python3-grpcio with stubs that protoc generates from proto/ into a temp dir, against real
# kvrelay-decode, kvrelay-prefill and kvrelay-router processes on llama3-tiny (ephemeral ports).
# The checks are in python_client.py. Skips (77) when python3-grpcio or the stub generator is
# missing: `./kvrelay test` installs them. Env (set by ctest): KR_BIN, KR_SRC, KR_FIXTURES.
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

tmp=$(mktemp -d)
cleanup() {
  # every process the client started, even if it died before its own cleanup ran
  if [ -f "$tmp/pids" ]; then
    while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done < "$tmp/pids"
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

mkdir -p "$tmp/stubs" "$tmp/health/kvhealth"
protoc -I "$KR_SRC/proto" --python_out="$tmp/stubs" --grpc_out="$tmp/stubs" \
  --plugin=protoc-gen-grpc="$PLUGIN" "$KR_SRC/proto/kvrelay/v1/kvrelay.proto"
# grpc.health.v1 as its own module name: a top-level "grpc" directory of stubs would shadow the
# grpc package itself. The proto's package (and so the method paths) stays grpc.health.v1.
cp "$KR_SRC/proto/grpc/health/v1/health.proto" "$tmp/health/kvhealth/health.proto"
protoc -I "$tmp/health" --python_out="$tmp/stubs" --grpc_out="$tmp/stubs" \
  --plugin=protoc-gen-grpc="$PLUGIN" "$tmp/health/kvhealth/health.proto"

"$PY" "$KR_SRC/tests/integration/python_client.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_FIXTURES/models/llama3-tiny" --work "$tmp"
