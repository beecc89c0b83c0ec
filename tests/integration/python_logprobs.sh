#!/usr/bin/env bash
# python_logprobs.sh - forced-token scoring through the whole cluster, as an evaluator written
# in Python sees it: Debian's python3-grpcio with stubs protoc generates from proto/, against
# real kvrelay-decode, kvrelay-prefill and kvrelay-router processes on the bundled random-weight
# default model (made by ./kvrelay test in $KR_BIN/models/default; made here into a temp dir
# when absent). The checks are in python_logprobs.py. Skips (77) when python3-grpcio or the stub
# generator is missing: `./kvrelay test` installs them. Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
for p in kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-generate kvrelay-make-model; do
  [ -x "$KR_BIN/$p" ] || { echo "SKIP: $KR_BIN/$p is not built"; exit 77; }
done

kr_workdir

model=$KR_BIN/models/default
if [ ! -f "$model/model.safetensors" ]; then
  model=$tmp/default
  "$KR_BIN/kvrelay-make-model" --corpus "$KR_SRC/tools/data/corpus.txt" --out "$model" >"$tmp/make-model.log" 2>&1 ||
    { cat "$tmp/make-model.log"; echo "FAIL: could not make the default model"; exit 1; }
fi

kr_pystubs "$tmp/stubs"

"$PY" "$KR_SRC/tests/integration/python_logprobs.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$model" --work "$tmp"
