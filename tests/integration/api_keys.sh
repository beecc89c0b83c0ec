#!/usr/bin/env bash
# api_keys.sh - the router's API keys (docs/router.md "API keys") against real kvrelay-decode,
# kvrelay-prefill and kvrelay-router processes on llama3-tiny: start-up errors for bad key
# sources, refusals without or with a wrong key, each key from each source accepted with output
# equal to a router without keys, health and /metrics open, kvrelay-cli with --api-key and
# KVRELAY_API_KEY, and no key in any log. The checks are in api_keys.py; stubs as in
# python_client.sh. Skips (77) when python3-grpcio or the stub generator is missing.
# Env (set by ctest): KR_BIN, KR_SRC, KR_FIXTURES. About 10 s.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio

kr_workdir

kr_pystubs "$tmp/stubs"

env -u KVRELAY_API_KEY "$PY" "$KR_SRC/tests/integration/api_keys.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_FIXTURES/models/llama3-tiny" --work "$tmp"
