#!/usr/bin/env bash
# api_keys.sh - the router's API keys (docs/router.md "API keys") against real kvrelay-decode,
# kvrelay-prefill and kvrelay-router processes on llama3-tiny: start-up errors for bad key
# sources, refusals without or with a wrong key, each key from each source accepted with output
# equal to a router without keys, health and /metrics open, kvrelay-cli with --api-key and
# KVRELAY_API_KEY, and no key in any log. The checks are in api_keys.py; stubs as in
# python_client.sh. Skips (77) when python3-grpcio or the stub generator is missing.
# Env (set by ctest): KR_BIN, KR_SRC, KR_FIXTURES. About 10 s.
set -euo pipefail
PY=/usr/bin/python3 # not the python3 on PATH: a pyenv interpreter there may lack grpc (STACK.md)
PLUGIN=/usr/bin/grpc_python_plugin

if ! "$PY" -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "SKIP: python3-grpcio missing (the README's test command installs it)"
  exit 77
fi
if ! command -v protoc >/dev/null || [ ! -x "$PLUGIN" ]; then
  echo "SKIP: protoc or $PLUGIN missing (protobuf-compiler, protobuf-compiler-grpc)"
  exit 77
fi

tmp=$(mktemp -d)
cleanup() {
  if [ -f "$tmp/pids" ]; then
    while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done < "$tmp/pids"
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

mkdir -p "$tmp/stubs" "$tmp/health/kvhealth"
protoc -I "$KR_SRC/proto" --python_out="$tmp/stubs" --grpc_out="$tmp/stubs" \
  --plugin=protoc-gen-grpc="$PLUGIN" "$KR_SRC/proto/kvrelay/v1/kvrelay.proto"
cp "$KR_SRC/proto/grpc/health/v1/health.proto" "$tmp/health/kvhealth/health.proto"
protoc -I "$tmp/health" --python_out="$tmp/stubs" --grpc_out="$tmp/stubs" \
  --plugin=protoc-gen-grpc="$PLUGIN" "$tmp/health/kvhealth/health.proto"

env -u KVRELAY_API_KEY "$PY" "$KR_SRC/tests/integration/api_keys.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_FIXTURES/models/llama3-tiny" --work "$tmp"
