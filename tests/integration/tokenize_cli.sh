#!/usr/bin/env bash
# tokenize_cli.sh - black-box test of kvrelay-tokenize against the shared tokenizer fixtures:
# the first cases of each family's cases.jsonl (ids exact, decode back to the text), BOS with
# --add-special, and the error paths (exit status and message). Fixtures are read in place.
# Not a tokenizer correctness suite (tests/unit/test_tokenizer.c is).
# Env: KR_BIN = build directory, KR_SHARED = the shared directory. Exit 77 = skipped.
set -u
BIN="${KR_BIN:-build}/kvrelay-tokenize"
FIX="${KR_SHARED:-../shared}/fixtures/tokenizers"
if [ ! -d "$FIX" ]; then echo "tokenize_cli: $FIX absent: SKIPPED"; exit 77; fi
if [ ! -x "$BIN" ]; then echo "tokenize_cli: $BIN not built"; exit 1; fi
if ! command -v python3 >/dev/null; then echo "tokenize_cli: python3 needed to read the cases: SKIPPED"; exit 77; fi

fail=0
checked=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Writes case k of FILE as $tmp/text (raw bytes) and $tmp/ids (space-separated).
extract() {
    python3 - "$1" "$2" "$tmp" <<'PY'
import json, sys
path, k, tmp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = [l for l in open(path, encoding="utf-8") if l.strip()]
if k >= len(lines):
    sys.exit(1)
c = json.loads(lines[k])
open(tmp + "/text", "wb").write(c["text"].encode("utf-8"))
open(tmp + "/ids", "w").write(" ".join(map(str, c["ids"])))
PY
}

for fam in llama-bpe qwen2 llama-spm; do
    dir="$FIX/$fam"
    for k in 0 1 2 3 4; do
        extract "$dir/cases.jsonl" "$k" || break
        want=$(cat "$tmp/ids")
        got=$("$BIN" --model "$dir" < "$tmp/text")
        if [ "$got" != "$want" ]; then
            echo "FAIL $fam case $k: got [$got] want [$want]"; fail=1
        fi
        if [ "$fam" != qwen2 ]; then # qwen2 texts may decode to their NFC form
            "$BIN" --model "$dir" --decode < "$tmp/ids" > "$tmp/dec"
            if ! cmp -s "$tmp/dec" "$tmp/text"; then echo "FAIL $fam case $k: decode differs"; fail=1; fi
        fi
        checked=$((checked + 1))
    done
done

# --add-special: BOS for llama-bpe (128000) and llama-spm (1), nothing for qwen2
for pair in llama-bpe:128000 llama-spm:1 qwen2:; do
    fam=${pair%%:*} bos=${pair#*:}
    plain=$(printf 'Hello world' | "$BIN" --model "$FIX/$fam")
    with=$(printf 'Hello world' | "$BIN" --model "$FIX/$fam" --add-special)
    want=${bos:+$bos }$plain
    [ "$with" = "$want" ] || { echo "FAIL $fam --add-special: [$with] want [$want]"; fail=1; }
done
# a special-token string in the text maps to its id
got=$("$BIN" --model "$FIX/llama-bpe" --text '<|begin_of_text|>Hello')
[ "$got" = "128000 9906" ] || { echo "FAIL special in text: [$got]"; fail=1; }
# output format: one line, newline at the end
printf 'Hello world' | "$BIN" --model "$FIX/llama-bpe" > "$tmp/out"
[ "$(wc -l < "$tmp/out")" = 1 ] || { echo "FAIL: output is not one line"; fail=1; }

# errors: exit non-zero with a message naming the problem
expect_err() { # status needle command...
    local want=$1 needle=$2; shift 2
    "$@" > /dev/null 2> "$tmp/err" < "${STDIN:-/dev/null}"
    local st=$?
    if [ $st -ne "$want" ] || ! grep -q -- "$needle" "$tmp/err"; then
        echo "FAIL: '$*' exit $st (want $want), stderr: $(cat "$tmp/err")"; fail=1
    fi
}
expect_err 1 "tokenizer.json" "$BIN" --model "$tmp/missing"
expect_err 2 "required" "$BIN"
expect_err 2 "unknown argument" "$BIN" --model "$FIX/llama-bpe" --bogus
expect_err 1 "out of range" "$BIN" --model "$FIX/llama-bpe" --decode --ids "999999"
expect_err 2 "not a token id" "$BIN" --model "$FIX/llama-bpe" --decode --ids "12 abc"
printf 'ab\xffcd' > "$tmp/bad"
STDIN="$tmp/bad" expect_err 1 "not valid UTF-8" "$BIN" --model "$FIX/llama-bpe"
mkdir -p "$tmp/broken" && printf '{"model": {"type": "Unigram"}}' > "$tmp/broken/tokenizer.json"
expect_err 1 "model.type \"Unigram\" is not supported" "$BIN" --model "$tmp/broken"
"$BIN" --help | grep -q "example" || { echo "FAIL: --help has no example"; fail=1; }

if [ $fail -ne 0 ]; then echo "tokenize_cli: FAILED"; exit 1; fi
echo "tokenize_cli: $checked fixture cases and the error paths passed"
