#!/usr/bin/env bash
# adaptive.sh - kv_policy auto through a real cluster (docs/adaptive.md): 1 prefill + 1 decode
# node on the default model, whose calibration table the router loads from the model directory.
# With the decode pool empty the router's pressure is low and auto serves full; with all but a
# tenth of the pool held by reservations of the test's own (lib/hold_pool.py) it is high and the
# same request gets a compressed spec that reserves fewer blocks, with a score at or above the
# floor; both said back in gRPC usage, the OpenAI response's kvrelay object, the router's log,
# kvrelay_auto_choices_total and kvrelay-cli status. Then the refusals: a floor outside (0, 1],
# an unknown task, a model without a table (a router that starts without one), a table of
# another model (a router given one), each INVALID_ARGUMENT / HTTP 400 with its message, the
# cluster serving on; a router refuses to start with a missing --calibration file or a table
# whose fingerprint is not --fingerprint's; --default-policy with --pressure pinned.
# Skips (77) without python3-grpcio or the stub generator. Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs, kr_hold_pool; skips without grpcio
. "$KR_SRC/tests/integration/lib.sh" # krc_*, kr_cluster_workdir, fatal
kr_cluster_workdir adaptive
command -v curl >/dev/null || kr_skip "curl missing: ./kvrelay test installs it"

model=$KR_SRC/models/kjv-2l128-2k
KRC_DECODE_ARGS=(--kv-blocks 2000)
unset KVRELAY_API_KEY # a cluster without API keys, whatever the caller's environment says
krc_start "$KR_BIN" "$model" 1 1 127.0.0.1:0 --threads 1 || fatal "the cluster did not start"
cli() { "$KR_BIN/kvrelay-cli" --router "$KRC_ROUTER" "$@"; }
ids=$(kr_prompt 1 500) # 500 tokens: the 512 bucket
ask="auto:floor=0.95,task=kv"
# jget FILE EXPR: a Python expression over the JSON document `d` in FILE
jget() { "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"; }

# ------------------------------------------------------------------ low pressure: full
cli status >"$KRC_DIR/status.low"
grep -q '^pressure: low (2000/2000 decode KV blocks free, 0 requests queued' "$KRC_DIR/status.low" ||
  fatal "idle cluster: $(tail -n1 "$KRC_DIR/status.low")"
cli generate --ids "$ids" --max-tokens 4 --policy "$ask" --request-id auto-low --json >"$KRC_DIR/low.json" ||
  fatal "auto at low pressure failed"
a='d["usage"]["auto"]'
[ "$(jget "$KRC_DIR/low.json" "($a['policy'], $a['pressure'], $a['score'], d['usage']['kv_footprint']) == ('full', 'low', 1, 1)")" = True ] ||
  fatal "low pressure: $(cat "$KRC_DIR/low.json")"
echo "ok: low pressure: auto serves full"

# ------------------------------------------------------------------ high pressure: compressed
kr_pystubs "$KRC_DIR/stubs" kvrelay/v1/internal.proto
kr_hold_pool "$KRC_DIR/stubs" "$(krc_addr decode-0)" "$KRC_DIR" 200 || fatal "hold_pool: $(cat "$KRC_DIR/hold.out")"
echo "ok: $(cat "$KRC_DIR/hold.out")"
cli status >"$KRC_DIR/status.high"
grep -q '^pressure: high (' "$KRC_DIR/status.high" || fatal "held pool: $(tail -n1 "$KRC_DIR/status.high")"
cli status --json >"$KRC_DIR/status.json"
[ "$(jget "$KRC_DIR/status.json" 'd["pressure"]["level"]')" = high ] || fatal "status --json: $(cat "$KRC_DIR/status.json")"
echo "ok: kvrelay-cli status: $(tail -n1 "$KRC_DIR/status.high")"
cli generate --ids "$ids" --max-tokens 4 --policy "$ask" --request-id auto-high --json >"$KRC_DIR/high.json" ||
  fatal "auto at high pressure failed"
chosen=$(jget "$KRC_DIR/high.json" 'd["usage"]["auto"]["policy"]')
[ "$chosen" != full ] && [ "$(jget "$KRC_DIR/high.json" 'd["usage"]["auto"]["pressure"]')" = high ] ||
  fatal "high pressure: $(cat "$KRC_DIR/high.json")"
[ "$(jget "$KRC_DIR/high.json" '0.95 <= d["usage"]["auto"]["score"] < 1 and d["usage"]["kv_footprint"] < 1')" = True ] ||
  fatal "high pressure: the score or footprint: $(cat "$KRC_DIR/high.json")"
blocks() { sed -n "s/.*\[$1\] reserved \([0-9]*\) blocks on .*/\1/p" "$KRC_DIR/router.log"; }
[ "$(blocks auto-high)" -lt "$(blocks auto-low)" ] ||
  fatal "the compressed spec reserved $(blocks auto-high) blocks, full $(blocks auto-low)"
grep -q "\[auto-high\] kv_policy $ask -> '$chosen' (score 0\.[0-9]*, .*pressure high" "$KRC_DIR/router.log" ||
  fatal "the router's log does not say the choice"
echo "ok: high pressure: auto serves '$chosen' ($(blocks auto-high) decode blocks, full took $(blocks auto-low))"

body='{"model": "kjv-2l128-2k", "prompt": ['"${ids// /, }"'], "max_tokens": 4, "kv_policy": "'"$ask"'"}'
code=$(curl -sS -o "$KRC_DIR/oa.json" -w '%{http_code}' -H 'Content-Type: application/json' -d "$body" \
  "http://$KRC_ROUTER_HTTP/v1/completions")
[ "$code" = 200 ] || fatal "OpenAI auto: HTTP $code $(cat "$KRC_DIR/oa.json")"
[ "$(jget "$KRC_DIR/oa.json" 'd["kvrelay"]["auto"]["policy"], d["kvrelay"]["auto"]["pressure"]')" = "('$chosen', 'high')" ] ||
  fatal "OpenAI auto: $(cat "$KRC_DIR/oa.json")"
echo "ok: the OpenAI response's kvrelay.auto says it too"
kr_release_pool || fatal "hold_pool release: $(cat "$KRC_DIR/hold.out")"

metrics=$(curl -s "http://$KRC_ROUTER_HTTP/metrics")
grep -q '^kvrelay_auto_choices_total{policy="full"} 1$' <<<"$metrics" &&
  grep -qxF "kvrelay_auto_choices_total{policy=\"$chosen\"} 2" <<<"$metrics" &&
  grep -q '^kvrelay_auto_pressure_total{pressure="low"} 1$' <<<"$metrics" &&
  grep -q '^kvrelay_auto_pressure_total{pressure="high"} 2$' <<<"$metrics" ||
  fatal "the choices' metrics: $(grep kvrelay_auto <<<"$metrics")"
echo "ok: kvrelay_auto_choices_total and kvrelay_auto_pressure_total count each choice"

# ------------------------------------------------------------------ refusals
refuse() { # refuse SPEC WORDS: INVALID_ARGUMENT with WORDS in the message, on gRPC and HTTP 400
  local spec=$1 words=$2 r=${3:-$KRC_ROUTER} h=${4:-$KRC_ROUTER_HTTP}
  if "$KR_BIN/kvrelay-cli" --router "$r" generate --ids "$ids" --max-tokens 2 --policy "$spec" >"$KRC_DIR/r.out" 2>"$KRC_DIR/r.err"; then
    fatal "'$spec' was served"
  fi
  grep -q "INVALID_ARGUMENT" "$KRC_DIR/r.err" && grep -qF -- "$words" "$KRC_DIR/r.err" ||
    fatal "'$spec': $(cat "$KRC_DIR/r.err")"
  code=$(curl -sS -o "$KRC_DIR/r.json" -w '%{http_code}' -H 'Content-Type: application/json' \
    -d '{"model": "kjv-2l128-2k", "prompt": [1, 2, 3], "max_tokens": 2, "kv_policy": "'"$spec"'"}' "http://$h/v1/completions")
  [ "$code" = 400 ] && grep -qF -- "$words" "$KRC_DIR/r.json" || fatal "HTTP '$spec': $code $(cat "$KRC_DIR/r.json")"
  echo "ok: '$spec' refused: $(head -c 300 "$KRC_DIR/r.err")"
}
refuse "auto:floor=0" "(0, 1]"
refuse "auto:floor=1.5" "(0, 1]"
refuse "auto:task=poem" "unknown task"
refuse "auto:budget=3" "unknown key"
cli generate --ids "$ids" --max-tokens 2 --policy "auto:floor=1" --json >"$KRC_DIR/one.json" || fatal "floor=1 failed"
[ "$(jget "$KRC_DIR/one.json" 'd["usage"]["auto"]["policy"]')" = full ] || fatal "floor=1: $(cat "$KRC_DIR/one.json")"
echo "ok: the cluster serves on (floor=1: full)"

# routers of their own on the same nodes
router2() { # router2 ID ARGS...: a second router on the cluster's nodes; sets R2 and R2_HTTP
  local id=$1
  shift
  krc_spawn "$id" "$KR_BIN/kvrelay-router" --id "$id" --nodes "$KRC_DIR/nodes.json" --listen 127.0.0.1:0 \
    --http 127.0.0.1:0 "$@"
  krc_wait_serving "$id" "${KRC_PIDS[-1]}" >/dev/null || fatal "router $id did not start"
  R2=$(krc_addr "$id")
  R2_HTTP=$(krc_http "$id")
}
notable="$KRC_DIR/notable"
mkdir -p "$notable"
for f in "$model"/*; do [ "${f##*/}" = calibration.json ] || ln -s "$f" "$notable/"; done
router2 r-none --model "$notable" --served-model-name kjv-2l128-2k
refuse "auto" "kvrelay-eval --model DIR --calibrate-out" "$R2" "$R2_HTTP"
"$PY" -c 'import json, sys; t = json.load(open(sys.argv[1])); t["model"]["fingerprint"] = "0123456789abcdef"
json.dump(t, open(sys.argv[2], "w"))' "$model/calibration.json" "$KRC_DIR/other.json"
router2 r-other --model "$model" --calibration "$KRC_DIR/other.json"
refuse "auto:floor=0.9" "measured on model fingerprint 0123456789abcdef, and the nodes serve 2c827e390d0dfc58" "$R2" "$R2_HTTP"

if "$KR_BIN/kvrelay-router" --model "$model" --nodes "$KRC_DIR/nodes.json" --listen 127.0.0.1:0 --http 127.0.0.1:0 \
  --calibration "$KRC_DIR/missing.json" >/dev/null 2>"$KRC_DIR/start.err"; then
  fatal "a router started with a missing --calibration"
fi
grep -q "missing.json: No such file.*kvrelay-eval" "$KRC_DIR/start.err" || fatal "missing table: $(cat "$KRC_DIR/start.err")"
if "$KR_BIN/kvrelay-router" --model "$model" --nodes "$KRC_DIR/nodes.json" --listen 127.0.0.1:0 --http 127.0.0.1:0 \
  --fingerprint 0123456789abcdef >/dev/null 2>"$KRC_DIR/start.err"; then
  fatal "a router started with a table of another model"
fi
grep -q "measured on model fingerprint 2c827e390d0dfc58, and --fingerprint is 0123456789abcdef" "$KRC_DIR/start.err" ||
  fatal "another model's table: $(cat "$KRC_DIR/start.err")"
echo "ok: a router refuses to start with a missing table or another model's"

router2 r-default --model "$model" --default-policy "$ask" --pressure high
"$KR_BIN/kvrelay-cli" --router "$R2" generate --ids "$ids" --max-tokens 4 --json >"$KRC_DIR/def.json" ||
  fatal "--default-policy failed"
[ "$(jget "$KRC_DIR/def.json" 'd["usage"]["auto"]["policy"], d["usage"]["auto"]["pressure"]')" = "('$chosen', 'high')" ] ||
  fatal "--default-policy with --pressure high: $(cat "$KRC_DIR/def.json")"
"$KR_BIN/kvrelay-cli" --router "$R2" status | grep -q '^pressure: high' || fatal "a pinned level is not reported"
echo "ok: --default-policy $ask with --pressure high serves '$chosen' to a request that names none"
echo "PASS"
