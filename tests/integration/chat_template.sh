#!/usr/bin/env bash
# chat_template.sh - the chat template renderer against jinja2 (chat_template.py: the built-in
# templates, the default model's and handwritten ones in the style of real HF templates, over
# random conversations, byte for byte), then kvrelay-tokenize --chat's own behaviour: ids of the
# rendered text, --no-generation-prompt, --text-only, and its refusals (exit status, message).
# Skips (77) without Debian's python3-jinja2. Env (set by ctest): KR_BIN, KR_SRC.
set -u
PY=/usr/bin/python3 # not the python3 on PATH: a pyenv interpreter there may lack jinja2
BIN="${KR_BIN:-build}/kvrelay-tokenize"
SRC="${KR_SRC:-.}"
MODEL="$SRC/models/kjv-2l128-2k"
if [ ! -x "$BIN" ]; then echo "chat_template: $BIN not built"; exit 1; fi
if ! "$PY" -c 'import jinja2' 2>/dev/null; then
  echo "chat_template: python3-jinja2 missing: SKIPPED (the README's test command installs it)"
  exit 77
fi
export OPENBLAS_NUM_THREADS=1 # no re-exec per run (tools/cli.h)
fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$PY" "$SRC/tests/integration/chat_template.py" "$BIN" "$MODEL"
st=$?
[ $st -eq 0 ] || { [ $st -eq 77 ] && exit 77; fail=1; }

# --chat: the default model's template joins the contents (system first) after BOS
printf '%s' '{"messages": [{"role": "user", "content": "And God said"}, {"role": "system", "content": "In the beginning"}]}' > "$tmp/c.json"
got=$("$BIN" --model "$MODEL" --chat "$tmp/c.json" --text-only)
want=$(printf '<|begin_of_text|>In the beginning\nAnd God said')
[ "$got" = "$want" ] || { echo "FAIL: --text-only gave [$got]"; fail=1; }
ids=$("$BIN" --model "$MODEL" --chat "$tmp/c.json")
want_ids=$(printf '%s' "$want" | "$BIN" --model "$MODEL")
[ "$ids" = "$want_ids" ] || { echo "FAIL: --chat ids [$ids] want [$want_ids]"; fail=1; }
case "$ids" in 2045\ *) ;; *) echo "FAIL: --chat ids do not start with BOS 2045: [$ids]"; fail=1 ;; esac
# a bare list on stdin, a built-in template, with and without the generation prompt
echo '[{"role":"user","content":"Hi"}]' > "$tmp/bare.json"
got=$("$BIN" --model "$MODEL" --chat - --template builtin:chatml --text-only < "$tmp/bare.json")
want=$(printf '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n')
[ "$got" = "$want" ] || { echo "FAIL: builtin:chatml gave [$got]"; fail=1; }
got=$("$BIN" --model "$MODEL" --chat "$tmp/bare.json" --template builtin:llama3 --text-only --no-generation-prompt)
want=$(printf '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>')
[ "$got" = "$want" ] || { echo "FAIL: builtin:llama3 --no-generation-prompt gave [$got]"; fail=1; }
"$BIN" --model "$MODEL" --show-template 2>&1 >/dev/null | grep -q "tokenizer_config.json" || { echo "FAIL: --show-template does not say where the template came from"; fail=1; }

expect_err() { # status needle command...
  local want=$1 needle=$2; shift 2
  "$@" > /dev/null 2> "$tmp/err" < /dev/null
  local st=$?
  if [ $st -ne "$want" ] || ! grep -q -- "$needle" "$tmp/err"; then
    echo "FAIL: '$*' exit $st (want $want), stderr: $(cat "$tmp/err")"; fail=1
  fi
}
echo '[{"role":"assistant","content":"x"}]' > "$tmp/bad_order.json"
expect_err 1 "Conversation roles must alternate" "$BIN" --model "$MODEL" --chat "$tmp/bad_order.json" --template builtin:mistral
printf '{%% for m in messages %%}{{ m.content|nosuch }}{%% endfor %%}' > "$tmp/bad.jinja"
expect_err 1 "line 1 column 37: no filter named 'nosuch'" "$BIN" --model "$MODEL" --chat "$tmp/bare.json" --template "$tmp/bad.jinja"
printf '{%% if true %%}never closed' > "$tmp/open.jinja"
expect_err 1 "expected {% endif %}" "$BIN" --model "$MODEL" --chat "$tmp/bare.json" --template "$tmp/open.jinja"
expect_err 2 "no built-in chat template named 'nope'" "$BIN" --model "$MODEL" --chat "$tmp/bare.json" --template builtin:nope
echo '{"messages": 5}' > "$tmp/notlist.json"
expect_err 1 "expected {\"messages\": \[...\]}" "$BIN" --model "$MODEL" --chat "$tmp/notlist.json"
expect_err 1 "cannot open" "$BIN" --model "$MODEL" --chat "$tmp/missing.json"
expect_err 2 "need --chat" "$BIN" --model "$MODEL" --text-only
expect_err 2 "exclude each other" "$BIN" --model "$MODEL" --chat "$tmp/bare.json" --text-only --jsonl
mkdir -p "$tmp/notype" && cp "$MODEL/tokenizer.json" "$tmp/notype/" && echo '{"model_type": "gpt2"}' > "$tmp/notype/config.json"
expect_err 1 "the model has no chat template" "$BIN" --model "$tmp/notype" --chat "$tmp/bare.json"

if [ $fail -ne 0 ]; then echo "chat_template: FAILED"; exit 1; fi
echo "chat_template: jinja2 comparison and kvrelay-tokenize --chat passed"
