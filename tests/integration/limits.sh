#!/usr/bin/env bash
# limits.sh - the router's limits (docs/router.md "Limits") against real kvrelay-decode,
# kvrelay-prefill and kvrelay-router processes on llama3-tiny: the concurrency cap per API key
# (queued streams count: the decode node's pool is held so that streams wait in the admission
# FIFO), slots given back on cancel, deadline, error and disconnect; the token-bucket rate per
# key and per client address (gRPC and HTTP share it); --max-prompt-tokens; --max-request-bytes
# on gRPC and HTTP; curl gets 429 with Retry-After; kvrelay_limit_refusals_total. Ordering is
# asserted from statuses and the router's queue-depth gauge, never from wall-clock bounds.
# The checks are in limits.py. Skips (77) when python3-grpcio or the stub generator is missing.
# Env (set by ctest): KR_BIN, KR_SRC, KR_FIXTURES. About 15 s.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
command -v curl >/dev/null || { echo "SKIP: curl missing"; exit 77; }

kr_workdir

kr_pystubs "$tmp/stubs" kvrelay/v1/internal.proto

env -u KVRELAY_API_KEY "$PY" "$KR_SRC/tests/integration/limits.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_FIXTURES/models/llama3-tiny" --work "$tmp"
