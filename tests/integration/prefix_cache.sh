#!/usr/bin/env bash
# prefix_cache.sh - the prefill node's prefix cache (docs/prefix-cache.md) changes what is
# computed, never what comes out. The same requests go through a cluster whose prefill node
# keeps its default cache and one started with --prefix-cache-memory 0, on the 4-layer llama3
# fixture in 32-token chunks: per policy a 100-token prompt, the same prompt grown to 150 tokens
# (a follow-up turn) and the first again, under full, streaming, naive snapkv and sage (which
# reuse) and patched snapkv (which must not). Checks:
#   - every greedy output, its log-probabilities and the usage's entries, bytes and footprint
#     are identical between the two clusters;
#   - the cached prefill node's log says how many prompt tokens came from the cache: 0, 96 and
#     96 for the policies that reuse (96: the last 32-token boundary below 100), 0 for the
#     others and for every request of the cache-less node; its /metrics count them;
#   - neither prefill node nor decode node holds a KV block afterwards.
# Run: ctest -R prefix_cache, or KR_BIN=build KR_SRC=. KR_FIXTURES=tests/fixtures bash tests/integration/prefix_cache.sh
set -uo pipefail

. "${KR_SRC:?KR_SRC must be the source directory}/tests/integration/lib.sh" # krc_*, fail, kr_*
bin=${KR_BIN:?KR_BIN must be the build directory}
fixtures=$(cd "${KR_FIXTURES:?KR_FIXTURES must be tests/fixtures}" && pwd)
kr_need_bins kvrelay-router kvrelay-prefill kvrelay-decode kvrelay-cli
kr_need_py "(the README's test command installs it)"
command -v curl >/dev/null || kr_skip "curl is missing"

work=$(mktemp -d -t kvrelay-prefix-cache-test.XXXXXX)
trap 'krc_stop; rm -rf "$work"' EXIT
model=$fixtures/models/llama3-tiny

policies=(full "streaming:sink=4,window=16,lazy=3" "snapkv:mode=naive,budget=24,obs=8" "sage:budget=32"
  "snapkv:budget=24,obs=8")
reuses=(1 1 1 1 0)
lengths=(100 150 100)

# run_all NAME PREFIX_CACHE_ARGS...: every policy x length through a fresh cluster; results in
# $work/NAME
run_all() {
  local name=$1 i=0 k p n
  shift
  KRC_DIR=$work/$name
  mkdir -p "$KRC_DIR/out"
  KRC_PREFILL_ARGS=(--chunk 32 "$@")
  KRC_DECODE_ARGS=()
  KRC_ROUTER_ARGS=()
  KRC_START_TIMEOUT=1200 # tenths of a second: the sanitizer build loads slowly on 2 cores
  krc_start "$bin" "$model" 1 1 127.0.0.1:0 --threads 1 || fatal "the $name cluster did not start"
  for k in "${!policies[@]}"; do
    p=${policies[$k]}
    for n in "${lengths[@]}"; do
      "$bin/kvrelay-cli" --router "$KRC_ROUTER" generate --ids "$(kr_prompt $((40 + k)) "$n")" \
        --max-tokens 10 --policy "$p" --logprobs --json --timeout-ms 300000 \
        >"$KRC_DIR/out/$i.json" 2>"$KRC_DIR/out/$i.err" ||
        fail "$name, $p, $n tokens: $(errmsg "$KRC_DIR/out/$i.err")"
      i=$((i + 1))
    done
  done
  kr_blocks_zero decode-0 100 || fail "$name: decode-0 still holds blocks: used=${KR_USED:-?} reserved=${KR_RESERVED:-?}"
  local pm
  pm=$(curl -s --max-time 2 "http://$(krc_http prefill-0)/metrics")
  [ "$(metric kvrelay_kv_blocks_used "$pm")" = 0 ] || fail "$name: prefill-0 still holds KV blocks"
  awk '$1 ~ /^kvrelay_prefix_cache_tokens_reused_total/ { s += $2 } END { print s + 0 }' <<<"$pm" >"$KRC_DIR/reused"
  grep -oE '[0-9]+ of them from the prefix cache' "$KRC_DIR/prefill-0.log" | awk '{ print $1 }' >"$KRC_DIR/cached"
  krc_stop
}

run_all on
run_all off --prefix-cache-memory 0

want=()
for k in "${!policies[@]}"; do
  if [ "${reuses[$k]}" = 1 ]; then want+=(0 96 96); else want+=(0 0 0); fi
done
n=$(( ${#policies[@]} * ${#lengths[@]} ))
out=$("$py" - "$work" "$n" "${want[*]}" "${policies[@]}" <<'EOF'
import json, sys
work, n, want, policies = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split()], sys.argv[4:]
bad = 0
for i in range(n):
    what = f"request {i} ({policies[i // 3]}, {(100, 150, 100)[i % 3]} tokens)"
    try:
        on, off = (json.load(open(f"{work}/{m}/out/{i}.json")) for m in ("on", "off"))
    except Exception as e:
        print(f"FAIL: {what}: no JSON from kvrelay-cli ({e})")
        bad += 1
        continue
    for key in ("ids", "logprobs"):
        if on.get(key) != off.get(key):
            print(f"FAIL: {what}: {key} differ: cached {on.get(key)} vs uncached {off.get(key)}")
            bad += 1
    for key in ("prompt_tokens", "kv_entries_shipped", "kv_bytes_shipped", "kv_footprint"):
        if on["usage"].get(key) != off["usage"].get(key):
            print(f"FAIL: {what}: usage {key} {on['usage'].get(key)} cached vs {off['usage'].get(key)}")
            bad += 1
    if not on.get("ids") or not on.get("logprobs"):
        print(f"FAIL: {what}: no ids or log-probabilities: {on}")
        bad += 1
cached = {m: [int(x) for x in open(f"{work}/{m}/cached").read().split()] for m in ("on", "off")}
if cached["on"] != want:
    print(f"FAIL: tokens from the prefix cache per request {cached['on']}, want {want}")
    bad += 1
if cached["off"] != [0] * n:
    print(f"FAIL: the cache-less node reused tokens: {cached['off']}")
    bad += 1
reused = {m: int(float(open(f"{work}/{m}/reused").read() or -1)) for m in ("on", "off")}
if reused["on"] != sum(want) or reused["off"] != 0:
    print(f"FAIL: /metrics tokens reused {reused}, want on {sum(want)}, off 0")
    bad += 1
print(f"{n - min(bad, n)} of {n} requests identical with and without the prefix cache; tokens from it per request: {cached['on']}")
EOF
)
echo "$out"
fails=$((fails + $(grep -c '^FAIL' <<<"$out")))
[ "$fails" = 0 ] || { echo "FAIL: $fails check(s)"; exit 1; }
echo "PASS: prefix_cache"
