#!/usr/bin/env bash
# openai_logprobs.sh - log-probabilities and echo through the OpenAI API (completions' logprobs,
# echo and max_tokens 0; chat's logprobs and top_logprobs; streamed and not) against the gRPC
# API's TokenDelta fields and kvrelay-logits, through a real cluster (1 prefill node with
# --chunk 16 + 1 decode node, the bundled kjv-2l128-2k model). The checks are in
# openai_logprobs.py. Skips (77) when python3-grpcio or the stub generator is missing:
# `./kvrelay test` installs them. Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
for p in kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-logits; do
  [ -x "$KR_BIN/$p" ] || { echo "SKIP: $KR_BIN/$p is not built"; exit 77; }
done

kr_workdir
kr_pystubs "$tmp/stubs"

"$PY" "$KR_SRC/tests/integration/openai_logprobs.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_SRC/models/kjv-2l128-2k" --work "$tmp"
