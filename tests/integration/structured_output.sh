#!/usr/bin/env bash
# structured_output.sh - response_format (docs/structured-output.md) through a real cluster (1
# prefill + 1 decode node, the bundled kjv-2l128-2k model): 200 random schemas whose every answer
# must parse and validate, json_object, the refusals naming the keyword, gRPC's
# GenerateRequest.response_format and the openai npm package. The checks are in
# structured_output.py. Skips (77) when python3-grpcio, the stub generator or python3-jsonschema
# is missing: `./kvrelay test` installs them. Env (set by ctest): KR_BIN, KR_SRC;
# KR_SCHEMA_SEED for other schemas.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
for p in kvrelay-router kvrelay-prefill kvrelay-decode; do
  [ -x "$KR_BIN/$p" ] || { echo "SKIP: $KR_BIN/$p is not built"; exit 77; }
done
if ! "$PY" -c 'import jsonschema' 2>/dev/null; then
  echo "SKIP: python3-jsonschema missing (the README's test command installs it)"
  exit 77
fi

kr_workdir
kr_pystubs "$tmp/stubs"

"$PY" "$KR_SRC/tests/integration/structured_output.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_SRC/models/kjv-2l128-2k" --work "$tmp"
