#!/usr/bin/env bash
# cluster.sh - the disaggregated cluster end to end, as separate processes on loopback: a router,
# 2 prefill nodes and 2 decode nodes (deploy/local-cluster.sh) on a fixture model, driven by
# kvrelay-cli (a real gRPC client of the public API). Checks:
#   - 32 concurrent streaming requests with mixed policies (full, streaming, snapkv, sage):
#     every greedy output is token for token what kvrelay-generate gives in one process with the
#     same policy and chunk, and usage reports kv_entries_shipped = entries kept after prefill and
#     kv_bytes_shipped = the bytes those entries take in the cache (the prefill node's default
#     payload is its cache's dtype, here the weights' bf16), and the same KV footprint;
#   - a client that cancels mid-stream and one whose deadline passes leave both decode nodes with
#     zero reserved and zero used KV blocks (read from their /metrics);
#   - bad requests get INVALID_ARGUMENT naming the problem and the cluster keeps serving.
# Run: ctest -R cluster, or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/cluster.sh
set -uo pipefail

. "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh" # krc_*, fail, metric, kr_*
bin=${KR_BIN:?KR_BIN must be the build directory}
fixtures=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli kvrelay-generate
kr_need_py "(the README's test command installs it)"
command -v curl >/dev/null || kr_skip "curl is missing"

KRC_DIR=$(mktemp -d -t kvrelay-cluster-test.XXXXXX)
trap 'krc_stop; rm -rf "$KRC_DIR"' EXIT

# The fixture with a short context (max_position_embeddings 160), so "prompt over the model's
# context" is cheap to send; weights are the fixture's own files. The context does not enter
# the computation (llama3 scaling uses original_max_position_embeddings), and every process
# here loads this same directory.
model=$KRC_DIR/model
krc_model_copy "$fixtures/models/llama3-tiny" "$model" sed -E 's/"max_position_embeddings": *[0-9]+/"max_position_embeddings": 160/'
grep -q '"max_position_embeddings": 160' "$model/config.json" || { echo "FAIL: could not edit config.json"; exit 1; }

chunk=32
KRC_PREFILL_ARGS=(--chunk "$chunk")
KRC_DECODE_ARGS=()
KRC_ROUTER_ARGS=(--max-tokens-limit 64)
KRC_START_TIMEOUT=1200 # tenths of a second: the sanitizer build loads slowly on 2 cores
krc_start "$bin" "$model" 2 2 127.0.0.1:0 --threads 1 || { echo "FAIL: the cluster did not start"; exit 1; }
router=$KRC_ROUTER
echo "cluster up: router $router (logs in $KRC_DIR)"
cli() { "$bin/kvrelay-cli" --router "$router" "$@"; }

# ---- 32 concurrent requests, mixed policies, against one-process generation
policies=(full "streaming:sink=4,window=16" "snapkv:budget=24,obs=8,decode=window:8" "sage:budget=32")
n_req=32
max_tokens=24
mkdir -p "$KRC_DIR/req"
for ((i = 0; i < n_req; i++)); do
  # prompts of 20..139 ids from a fixed pseudo-random sequence (vocabulary 512)
  len=$((20 + (i * 37) % 120))
  ids=$(awk -v n="$len" -v s="$i" 'BEGIN { x = s * 7919 + 13; for (k = 0; k < n; k++) { x = (x * 1103515245 + 12345) % 2147483648; printf "%s%d", (k ? " " : ""), 1 + x % 500 } }')
  echo "$ids" >"$KRC_DIR/req/$i.ids"
  echo "${policies[$((i % ${#policies[@]}))]}" >"$KRC_DIR/req/$i.policy"
done
clients=()
for ((i = 0; i < n_req; i++)); do
  cli generate --ids "$(cat "$KRC_DIR/req/$i.ids")" --max-tokens "$max_tokens" \
    --policy "$(cat "$KRC_DIR/req/$i.policy")" --timeout-ms 600000 --json \
    >"$KRC_DIR/req/$i.got" 2>"$KRC_DIR/req/$i.err" &
  clients+=($!)
done
# the references, computed while the cluster works
for ((i = 0; i < n_req; i++)); do
  "$bin/kvrelay-generate" --model "$model" --ids "$(cat "$KRC_DIR/req/$i.ids")" --greedy \
    --max-tokens "$max_tokens" --policy "$(cat "$KRC_DIR/req/$i.policy")" --chunk "$chunk" \
    --threads 1 --json --stats >"$KRC_DIR/req/$i.want" 2>"$KRC_DIR/req/$i.want.err" ||
    fail "kvrelay-generate for request $i: $(tail -n1 "$KRC_DIR/req/$i.want.err")"
done
for p in "${clients[@]}"; do wait "$p" || true; done
head_dim=$("$py" -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])' "$model/config.json")
out=$("$py" - "$KRC_DIR/req" "$n_req" "$head_dim" <<'EOF'
import json, os, sys
d, n, hd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bad = 0
served = set()
for i in range(n):
    pol = open(f"{d}/{i}.policy").read().strip()
    try:
        got = json.load(open(f"{d}/{i}.got"))
    except Exception as e:
        print(f"FAIL: request {i} ({pol}): no JSON from kvrelay-cli: {open(f'{d}/{i}.err').read().strip()[-300:]}")
        bad += 1
        continue
    want = json.load(open(f"{d}/{i}.want"))
    u, s = got["usage"], want["stats"]
    problems = []
    if got["ids"] != want["ids"]:
        problems.append(f"ids {got['ids']} != one-process {want['ids']}")
    if u["kv_entries_shipped"] != s["kv_entries_kept"]:
        problems.append(f"kv_entries_shipped {u['kv_entries_shipped']} != entries kept {s['kv_entries_kept']}")
    if u["kv_wire_dtype"].lower() != s["kv_cache_dtype"].lower():
        problems.append(f"kv_wire_dtype {u['kv_wire_dtype']} is not the cache's {s['kv_cache_dtype']}")
    if u["kv_bytes_shipped"] != s["kv_bytes_kept"] or s["kv_bytes_kept"] != s["kv_entries_kept"] * 2 * hd * 2:
        problems.append(f"kv_bytes_shipped {u['kv_bytes_shipped']} != {s['kv_entries_kept']} x {2 * hd * 2} "
                        f"(kept {s['kv_bytes_kept']})")
    if abs(u["kv_footprint"] - s["kv_footprint"]) > 1e-9 * max(1.0, s["kv_footprint"]):
        problems.append(f"kv_footprint {u['kv_footprint']} != one-process {s['kv_footprint']}")
    if u["prompt_tokens"] != s["prompt_tokens"] or u["completion_tokens"] != len(want["ids"]):
        problems.append(f"token counts {u['prompt_tokens']}/{u['completion_tokens']}")
    sb = u.get("served_by", {})
    served.add((sb.get("prefill_node"), sb.get("decode_node")))
    for p in problems:
        print(f"FAIL: request {i} ({pol}): {p}")
    bad += bool(problems)
nodes = {x for pair in served for x in pair}
for want_node in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
    if want_node not in nodes:
        print(f"FAIL: no request was served by {want_node} (served_by pairs: {sorted(served, key=str)})")
        bad += 1
print(f"checked {n} requests: {n - bad} match one-process generation" if bad <= n else "")
EOF
)
echo "$out"
nf=$(grep -c '^FAIL' <<<"$out")
fails=$((fails + nf))

# ---- cancellation and deadlines free the decode slot
cli generate --ids "1 2 3 4 5 6 7 8" --max-tokens 64 --cancel-after 3 --json >"$KRC_DIR/cancel.out" 2>"$KRC_DIR/cancel.err" ||
  fail "cancel-after run failed: $(tail -n1 "$KRC_DIR/cancel.err")"
# deadlines that pass at different stages (before placement, during prefill or decode); any of
# them must end DEADLINE_EXCEEDED and leave nothing behind
for ms in 1 30 120; do
  if cli generate --ids "$(cat "$KRC_DIR/req/5.ids")" --max-tokens 64 --timeout-ms $ms >/dev/null 2>"$KRC_DIR/deadline.err"; then
    echo "note: the $ms ms deadline did not pass before the request finished"
  else
    grep -q DEADLINE_EXCEEDED "$KRC_DIR/deadline.err" || fail "$ms ms deadline: expected DEADLINE_EXCEEDED, got: $(tail -n1 "$KRC_DIR/deadline.err")"
  fi
done
for node in decode-0 decode-1; do
  kr_blocks_zero "$node" 100 || fail "$node still holds blocks after cancel/deadline: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
done

# ---- bad input: a clear status, and nothing else harmed
expect_invalid() { # expect_invalid WHAT PATTERN cli-args...
  local what=$1 pat=$2; shift 2
  if cli "$@" >/dev/null 2>"$KRC_DIR/bad.err"; then
    fail "$what was accepted"
  elif ! grep -q "INVALID_ARGUMENT" "$KRC_DIR/bad.err" || ! grep -qi -- "$pat" "$KRC_DIR/bad.err"; then
    fail "$what: expected INVALID_ARGUMENT mentioning '$pat', got: $(tail -n1 "$KRC_DIR/bad.err")"
  fi
}
long=$(seq 1 170 | tr '\n' ' ')
expect_invalid "an empty prompt" "prompt" generate --ids "" --max-tokens 4
expect_invalid "a prompt over the context" "context" generate --ids "$long" --max-tokens 4
expect_invalid "an unknown policy" "nosuchpolicy" generate --ids "1 2 3" --max-tokens 4 --policy nosuchpolicy
expect_invalid "a malformed policy" "window" generate --ids "1 2 3" --max-tokens 4 --policy "streaming:window=abc"
expect_invalid "max_tokens 0" "max_tokens" generate --ids "1 2 3" --max-tokens 0
expect_invalid "max_tokens over the limit" "max_tokens" generate --ids "1 2 3" --max-tokens 65
expect_invalid "an id outside the vocabulary" "vocab" generate --ids "1 2 99999" --max-tokens 4
# garbage bytes on every public and internal RPC (a raw gRPC client: python3-grpcio)
if "$py" -c 'import grpc' 2>/dev/null; then
  garbage=$("$py" - "$router" "$(krc_addr prefill-0)" "$(krc_addr decode-0)" <<'EOF'
import sys, grpc
router, prefill, decode = sys.argv[1:4]
calls = [(router, "/kvrelay.v1.Generation/Generate", True), (router, "/kvrelay.v1.Generation/Tokenize", False),
         (router, "/kvrelay.v1.Admin/ClusterStatus", False), (router, "/grpc.health.v1.Health/Check", False),
         (prefill, "/kvrelay.v1.Prefill/Prefill", False), (prefill, "/kvrelay.v1.Prefill/Status", False),
         (decode, "/kvrelay.v1.Decode/Reserve", False), (decode, "/kvrelay.v1.Decode/Decode", True),
         (decode, "/kvrelay.v1.Decode/Release", False), (decode, "/kvrelay.v1.Decode/Status", False)]
junk = bytes([0xff, 0xff, 0xff, 0x07, 0x12, 0x99, 0x01, 0x0a, 0xff])
for addr, path, stream in calls:
    ch = grpc.insecure_channel(addr)
    try:
        if stream:
            for _ in ch.unary_stream(path)(junk, timeout=20):
                pass
        else:
            ch.unary_unary(path)(junk, timeout=20)
        print(f"FAIL: garbage to {path} was accepted")
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
            print(f"FAIL: garbage to {path}: {e.code()} {e.details()}")
    ch.close()
EOF
)
  [ -n "$garbage" ] && echo "$garbage"
  fails=$((fails + $(grep -c '^FAIL' <<<"$garbage")))
else
  echo "note: python3-grpcio missing, garbage-bytes checks skipped"
fi
# still serving, and still right, after all of that
i=1
got=$(cli generate --ids "$(cat "$KRC_DIR/req/$i.ids")" --max-tokens "$max_tokens" --policy "$(cat "$KRC_DIR/req/$i.policy")" --json 2>&1)
"$py" -c 'import json,sys; a=json.loads(sys.argv[1]); b=json.load(open(sys.argv[2])); sys.exit(a["ids"] != b["ids"])' "$got" "$KRC_DIR/req/$i.want" ||
  fail "after the bad input, request $i no longer matches: $got"
for ((k = 0; k < ${#KRC_PIDS[@]}; k++)); do
  kill -0 "${KRC_PIDS[$k]}" 2>/dev/null || fail "${KRC_IDS[$k]} died (log: $(tail -n 3 "$KRC_DIR/${KRC_IDS[$k]}.log"))"
done

if [ $fails -ne 0 ]; then
  echo "$fails check(s) failed; process logs:"
  for id in "${KRC_IDS[@]}"; do echo "--- $id"; tail -n 15 "$KRC_DIR/$id.log"; done
  exit 1
fi
echo "PASS"
