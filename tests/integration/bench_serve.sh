#!/usr/bin/env bash
# bench_serve.sh - tools/kvrelay-bench-serve against a real cluster (1 prefill + 1 decode node,
# the default model): what it says it sent must be what the router counted. bench_serve.py runs
# the tool and checks, against the router's /metrics read before and after each run
# (kvrelay_requests_total over every status, kvrelay_prompt_tokens_total,
# kvrelay_tokens_generated_total), exact equality for: ~10 s of Poisson load under two policies
# (with warmup, a plot, per-request rows); a replayed 12-line trace (its lengths, ids, text and
# policies, request by request); a short rate sweep; the OpenAI HTTP API; the chat workload over
# gRPC and over the OpenAI API (each turn the previous prompt + answer + a message, sent after
# the previous answer ended), the shared-prefix workload and a trace of conversations with a
# shared prefix; --ignore-eos. Before the cluster, the generators alone: the same seed gives the
# same conversations, turns extend their previous turns, documents are shared. Then bad input (a
# malformed trace line, an unknown SLO key, conflicting flags, targets that do not answer): exit
# 2 with the line, key, flags or address named, and nothing sent. Counts only, never latencies.
# Skips (77) without python3-grpcio, numpy, matplotlib or the stub generator.
# Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY; skips without grpcio or protoc
if ! "$PY" -c 'import numpy, matplotlib' 2>/dev/null; then
  echo "SKIP: python3-numpy or python3-matplotlib missing (the README's test command installs them)"
  exit 77
fi
. "$KR_SRC/deploy/local-cluster.sh"
KRC_DIR=$(mktemp -d -t kvrelay-bench-serve.XXXXXX)
cleanup() {
  krc_stop
  rm -rf "$KRC_DIR"
}
trap cleanup EXIT

unset KVRELAY_API_KEY # a cluster without API keys, whatever the caller's environment says
KRC_DECODE_ARGS=(--kv-blocks 20000)
krc_start "$KR_BIN" "$KR_SRC/models/kjv-2l128-2k" 1 1 127.0.0.1:0 --threads 1 || {
  echo "FAIL: the cluster did not start" >&2
  exit 1
}
"$PY" "$KR_SRC/tests/integration/bench_serve.py" --bench "$KR_SRC/tools/kvrelay-bench-serve" \
  --cli "$KR_BIN/kvrelay-cli" --router "$KRC_ROUTER" --http "$KRC_ROUTER_HTTP" --work "$KRC_DIR" || {
  echo "--- router log:" >&2
  tail -n 30 "$KRC_DIR/router.log" >&2 || true
  exit 1
}
echo "PASS"
