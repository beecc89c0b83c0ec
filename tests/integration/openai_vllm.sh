#!/usr/bin/env bash
# openai_vllm.sh - vLLM's extension fields (ignore_eos, min_tokens, stop_token_ids, the
# penalties, skip_special_tokens, include_stop_str_in_output), /tokenize and /detokenize, and
# strings holding U+0000, through a real cluster (1 prefill + 1 decode node, the bundled
# kjv-2l128-2k model with its config's EOS moved to a token its greedy text produces, so that a
# request would stop early), over HTTP and gRPC. The checks are in openai_vllm.py. Skips (77)
# when python3-grpcio or the stub generator is missing: `./kvrelay test` installs them.
# Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
for p in kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-generate kvrelay-tokenize; do
  [ -x "$KR_BIN/$p" ] || { echo "SKIP: $KR_BIN/$p is not built"; exit 77; }
done

kr_workdir
kr_pystubs "$tmp/stubs"

"$PY" "$KR_SRC/tests/integration/openai_vllm.py" --bin "$KR_BIN" --stubs "$tmp/stubs" \
  --model "$KR_SRC/models/kjv-2l128-2k" --work "$tmp"
