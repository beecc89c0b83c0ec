#!/usr/bin/env bash
# openai_choices.sh - several choices and prompts in one OpenAI API request (n, best_of, a list
# of prompts; docs/openai.md "Several choices and prompts") through a real cluster (1 prefill
# node with a 16-token chunk, so that its prefix cache serves the choices' shared prompt, 1
# decode node, the router; the bundled kjv-2l128-2k model), over HTTP (urllib, curl and, when
# ./kvrelay test installed it, the official openai npm package) and gRPC for the
# log-probabilities best_of ranks by. The checks are in openai_choices.py. Skips (77) when
# python3-grpcio or the stub generator is missing. Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
for p in kvrelay-router kvrelay-prefill kvrelay-decode; do
  [ -x "$KR_BIN/$p" ] || { echo "SKIP: $KR_BIN/$p is not built"; exit 77; }
done

kr_workdir
kr_pystubs "$tmp/stubs"

"$PY" "$KR_SRC/tests/integration/openai_choices.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_SRC/models/kjv-2l128-2k" --work "$tmp"
