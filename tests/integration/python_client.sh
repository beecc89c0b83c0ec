#!/usr/bin/env bash
# python_client.sh - a gRPC client nobody here wrote talks to kvrelay-router: Debian's
# python3-grpcio with stubs that protoc generates from proto/ into a temp dir, against real
# kvrelay-decode, kvrelay-prefill and kvrelay-router processes on llama3-tiny (ephemeral ports).
# The checks are in python_client.py. Skips (77) when python3-grpcio or the stub generator is
# missing: `./kvrelay test` installs them. Env (set by ctest): KR_BIN, KR_SRC, KR_FIXTURES.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio

kr_workdir

kr_pystubs "$tmp/stubs"

"$PY" "$KR_SRC/tests/integration/python_client.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_FIXTURES/models/llama3-tiny" --work "$tmp"
