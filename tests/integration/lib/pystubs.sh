# pystubs.sh - sourced by the integration tests whose clients are Python's grpcio (a client
# nobody here wrote): checks that Debian's python3-grpcio, protoc and the gRPC Python plugin are
# there (else the test skips with exit 77: `./kvrelay test` installs them), and generates stubs.
#   PY            the interpreter to run clients with (Debian's /usr/bin/python3: a pyenv
#                 python3 earlier on PATH may lack the Debian grpc modules)
#   kr_workdir    makes the temp dir $tmp and, at exit, kills every pid listed in $tmp/pids (the
#                 Python side's processes, even if Python died first) and removes it
#   kr_pystubs DIR [PROTO...]
#                 stubs for proto/kvrelay/v1/kvrelay.proto and the given protos under proto/
#                 (e.g. kvrelay/v1/internal.proto) into DIR, plus grpc.health.v1 as the module
#                 `kvhealth` (a top-level "grpc" directory of stubs would shadow the grpc package
#                 itself; the proto's package, and so its method paths, stays grpc.health.v1)
# Needs KR_SRC (set by ctest).
PY=/usr/bin/python3
KR_GRPC_PLUGIN=/usr/bin/grpc_python_plugin
if ! "$PY" -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "SKIP: python3-grpcio missing (the README's test command installs it)"
  exit 77
fi
if ! command -v protoc >/dev/null || [ ! -x "$KR_GRPC_PLUGIN" ]; then
  echo "SKIP: protoc or $KR_GRPC_PLUGIN missing (protobuf-compiler, protobuf-compiler-grpc; the README's test command installs them)"
  exit 77
fi

kr_pystubs() {
  local dir=$1 p protos=()
  shift
  for p in kvrelay/v1/kvrelay.proto "$@"; do protos+=("$KR_SRC/proto/$p"); done
  mkdir -p "$dir/.health/kvhealth"
  protoc -I "$KR_SRC/proto" --python_out="$dir" --grpc_out="$dir" --plugin=protoc-gen-grpc="$KR_GRPC_PLUGIN" \
    "${protos[@]}"
  cp "$KR_SRC/proto/grpc/health/v1/health.proto" "$dir/.health/kvhealth/health.proto"
  protoc -I "$dir/.health" --python_out="$dir" --grpc_out="$dir" --plugin=protoc-gen-grpc="$KR_GRPC_PLUGIN" \
    "$dir/.health/kvhealth/health.proto"
}

kr_workdir() {
  tmp=$(mktemp -d)
  trap kr_workdir_cleanup EXIT
}
kr_workdir_cleanup() {
  if [ -f "$tmp/pids" ]; then
    while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done <"$tmp/pids"
  fi
  rm -rf "$tmp"
}

# kr_hold_pool STUBS DECODE_ADDR DIR [LEAVE]: fills the decode node's KV pool (all but LEAVE
# blocks, when given) with reservations of a
# Python process of its own (lib/hold_pool.py, stubs with kvrelay/v1/internal.proto), so that
# the router finds no room; returns once the pool is full (1 if it could not be filled; the
# reason in DIR/hold.out). kr_release_pool: releases them and waits for that process (1 on error).
kr_hold_pool() {
  local stubs=$1 addr=$2 dir=$3 leave=${4:-} i
  KR_HOLD_DIR=$dir
  mkfifo "$dir/hold.in"
  "$PY" "$KR_SRC/tests/integration/lib/hold_pool.py" "$stubs" "$addr" $leave <"$dir/hold.in" >"$dir/hold.out" 2>&1 &
  KR_HOLD_PID=$!
  exec 9>"$dir/hold.in"
  for ((i = 0; i < 300; i++)); do
    grep -q held "$dir/hold.out" && return 0
    kill -0 "$KR_HOLD_PID" 2>/dev/null || break
    sleep 0.1
  done
  return 1
}
kr_release_pool() {
  echo >&9
  exec 9>&-
  wait "$KR_HOLD_PID" && grep -q released "$KR_HOLD_DIR/hold.out"
}
