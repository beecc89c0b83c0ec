#!/usr/bin/env bash
# openai_api.sh - the router's OpenAI-compatible HTTP API (docs/openai.md) with clients nobody
# here wrote: the official openai npm package (tests/integration/openai/client.cjs) and curl,
# against a real cluster (1 prefill + 1 decode node, the default model) with API keys from a file
# and from KVRELAY_API_KEY. Checks: greedy HTTP text equals the gRPC API's (kvrelay-cli) for the
# same prompt and policy, completions and chat streamed and not, concurrent streams, an aborted
# stream freeing its decode blocks, every error status (400, 401, 404, 405, 413, 429 with the
# decode pool held, 503 with no decode node), a raw SSE stream read by curl, and that the keys
# never reach a log. Skips (77) when node or the openai package is missing (`./kvrelay test`
# installs them into $KR_BIN/npm). Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs; skips without grpcio
modules=$KR_BIN/npm/node_modules
if ! command -v node >/dev/null || [ ! -d "$modules/openai" ]; then
  echo "SKIP: node or the openai npm package ($modules/openai) is missing: ./kvrelay test installs them"
  exit 77
fi
if ! command -v curl >/dev/null; then
  echo "SKIP: curl missing: ./kvrelay test installs it"
  exit 77
fi

. "$KR_SRC/tests/integration/lib.sh" # krc_*, kr_cluster_workdir, fatal
kr_cluster_workdir openai

model=$KR_SRC/models/kjv-2l128-2k
name=kjv-test
key1=sk-file-7f3a9c2e51d04b8a
key2=sk-env-0c6e1b9d84f2a753
printf '# the test keys\n\n%s\n' "$key1" >"$KRC_DIR/keys"
KRC_ROUTER_ARGS=(--api-key-file "$KRC_DIR/keys" --served-model-name "$name" --max-queue-ms 300)
KRC_DECODE_ARGS=(--kv-blocks 20000)
KVRELAY_API_KEY=$key2 krc_start "$KR_BIN" "$model" 1 1 127.0.0.1:0 --threads 1 || fatal "the cluster did not start"
api=http://$KRC_ROUTER_HTTP/v1
cli=("$KR_BIN/kvrelay-cli" --router "$KRC_ROUTER" --api-key "$key1")

# ------------------------------------------------------------------ what the gRPC API says
prompt="And God said"
policy=streaming:sink=4,window=8
ref=$("${cli[@]}" generate --prompt "$prompt" --max-tokens 24 --json) || fatal "gRPC generate"
ref_policy=$("${cli[@]}" generate --prompt "$prompt" --max-tokens 24 --policy "$policy" --json) || fatal "gRPC generate --policy"
ids=$("${cli[@]}" tokenize --text "$prompt" --add-special) || fatal "gRPC tokenize"
# the chat of client.cjs as the model's chat template renders it, generated from its ids
chat_json='{"messages": [{"role": "system", "content": "In the beginning"}, {"role": "user", "content": "God created the heaven"}]}'
echo "$chat_json" >"$KRC_DIR/chat.json"
chat_ids=$("$KR_BIN/kvrelay-tokenize" --model "$model" --chat "$KRC_DIR/chat.json") || fatal "kvrelay-tokenize --chat"
ref_chat=$("${cli[@]}" generate --ids "$chat_ids" --max-tokens 20 --json) || fatal "gRPC generate of the chat prompt"
expect=$(REF="$ref" REF_POLICY="$ref_policy" IDS="$ids" REF_CHAT="$ref_chat" PROMPT="$prompt" POLICY="$policy" \
  ROUTER_METRICS="http://$KRC_ROUTER_HTTP/metrics" DECODE_METRICS="http://$(krc_http decode-0)/metrics" "$PY" -c '
import json, os
ref, pol, chat = (json.loads(os.environ[k]) for k in ("REF", "REF_POLICY", "REF_CHAT"))
text = ref["text"]
stop = text[len(text) // 2:len(text) // 2 + 3]  # three characters from the middle of the text
print(json.dumps({
    "prompt": os.environ["PROMPT"], "max_tokens": 24, "full": text,
    "full_finish": "length" if ref["finish_reason"] in ("length", "context") else "stop",
    "prompt_tokens": ref["usage"]["prompt_tokens"], "completion_tokens": ref["usage"]["completion_tokens"],
    "policy": os.environ["POLICY"], "policy_text": pol["text"],
    "prompt_ids": [int(x) for x in os.environ["IDS"].split()],
    "chat": chat["text"], "stop": stop, "long_tokens": 3000,
    "router_metrics": os.environ["ROUTER_METRICS"], "decode_metrics": os.environ["DECODE_METRICS"]}))')
[ "$(echo "$ref" | "$PY" -c 'import json,sys; print(len(json.load(sys.stdin)["text"]) >= 6)')" = True ] ||
  fatal "the gRPC reference text is too short to cut a stop string from: $ref"

# ------------------------------------------------------------------ the openai package
export NODE_PATH=$modules
KR_EXPECT=$expect node "$KR_SRC/tests/integration/openai/client.cjs" main "$api" "$key1" "$name" || fatal "client.cjs main"
KR_EXPECT=$expect node -e '
const OpenAI = require("openai");
const e = JSON.parse(process.env.KR_EXPECT);
new OpenAI({baseURL: process.argv[1], apiKey: process.argv[2], maxRetries: 0})
  .completions.create({model: process.argv[3], prompt: e.prompt, max_tokens: 24, temperature: 0})
  .then((r) => { if (r.choices[0].text !== e.full) { console.error("FAIL: the KVRELAY_API_KEY key"); process.exit(1); }
                 console.log("ok: the key from KVRELAY_API_KEY works too"); })' "$api" "$key2" "$name" ||
  fatal "the key from KVRELAY_API_KEY"

# ------------------------------------------------------------------ curl: a raw SSE stream
curl -sS -N -D "$KRC_DIR/sse.headers" -o "$KRC_DIR/sse.body" -H "Authorization: Bearer $key1" \
  -H 'Content-Type: application/json' \
  -d "{\"model\": \"$name\", \"prompt\": \"$prompt\", \"max_tokens\": 24, \"temperature\": 0, \"stream\": true}" \
  "$api/completions" || fatal "curl stream"
grep -qi '^content-type: text/event-stream' "$KRC_DIR/sse.headers" || fatal "curl: not text/event-stream: $(cat "$KRC_DIR/sse.headers")"
REF="$ref" "$PY" - "$KRC_DIR/sse.body" <<'EOF' || fatal "curl: the SSE stream"
import json, os, sys
raw = open(sys.argv[1], encoding="utf-8").read()
events = raw.split("\n\n")
assert events[-1] == "", "the stream ends with a blank line"
events = events[:-1]
assert all(e.startswith("data: ") and "\n" not in e for e in events), "every event is one data: line"
assert events[-1] == "data: [DONE]", "the last event is [DONE]"
chunks = [json.loads(e[6:]) for e in events[:-1]]
text = "".join(c["choices"][0]["text"] for c in chunks)
assert text == json.loads(os.environ["REF"])["text"], f"curl text {text!r}"
assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop") and "kvrelay" in chunks[-1]
assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
print(f"ok: curl read {len(chunks)} SSE chunks and [DONE]: the gRPC text")
EOF
code=$(curl -s -o /dev/null -w '%{http_code}' "http://$KRC_ROUTER_HTTP/healthz")
[ "$code" = 200 ] || fatal "/healthz without a key: $code"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://$KRC_ROUTER_HTTP/metrics")
[ "$code" = 200 ] || fatal "/metrics without a key: $code"
echo "ok: /healthz and /metrics stay open"

# ------------------------------------------------------------------ 429: no room in the decode pool
kr_pystubs "$KRC_DIR/stubs" kvrelay/v1/internal.proto
kr_hold_pool "$KRC_DIR/stubs" "$(krc_addr decode-0)" "$KRC_DIR" || fatal "hold_pool: $(cat "$KRC_DIR/hold.out")"
echo "ok: $(cat "$KRC_DIR/hold.out")"
KR_EXPECT=$expect node "$KR_SRC/tests/integration/openai/client.cjs" full "$api" "$key1" "$name" || fatal "client.cjs full"
kr_release_pool || fatal "hold_pool release: $(cat "$KRC_DIR/hold.out")"

# ------------------------------------------------------------------ 503: no decode node
krc_signal decode-0 KILL
KR_EXPECT=$expect node "$KR_SRC/tests/integration/openai/client.cjs" down "$api" "$key1" "$name" || fatal "client.cjs down"

# ------------------------------------------------------------------ the keys never reach a log
for f in "$KRC_DIR"/*.log; do
  if grep -q -e "$key1" -e "$key2" "$f"; then fatal "$f holds an API key"; fi
done
echo "ok: no log holds an API key"
echo "PASS"
