#!/usr/bin/env bash
# trained_model.sh - the committed models are the ones their SHA256SUMS name: the default
# (models/kjv-2l128-2k) and the base it was fine-tuned from (models/kjv-2l128); the default
# loads and retrieves, and the trainer refuses bad runs before it touches anything.
#
# Checked: sha256 of every file of both models; kvtasks' self-check on the default's tokenizer;
# key-value cases (held-out filler, needle at every depth, seed fixed) answered by
# kvrelay-generate in one process with the full cache: at least 0.8 correct of 24 at 512 tokens
# and of 8 at 2048 (docs/models.md gives the measured figures); the demo's retrieval prompt
# gives <v093>; the trainer's refusals: an existing --out without --resume, --resume without a
# checkpoint, a bad shape, an unreadable corpus, an --init directory without weights (each exit
# status and message). torch is not needed: the trainer checks everything before it imports
# torch. Skips (77) without Debian's python3-numpy.
# Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
PY=/usr/bin/python3 # not the python3 on PATH: a pyenv interpreter there may lack numpy
MODEL=$KR_SRC/models/kjv-2l128-2k
TRAIN=$KR_SRC/tools/train/train.py

if ! "$PY" -c 'import numpy' 2>/dev/null; then
  echo "SKIP: python3-numpy missing (the README's test command installs it)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
bad() { echo "FAIL: $*" >&2; fail=1; }

for m in kjv-2l128-2k kjv-2l128; do
  (cd "$KR_SRC/models/$m" && sha256sum --quiet -c SHA256SUMS) || bad "models/$m does not match its SHA256SUMS"
done
"$PY" "$KR_SRC/tools/train/kvtasks.py" "$MODEL" || bad "kvtasks self-check"

# Retrieval with the full cache, one process: the cases come from kvtasks, as kvrelay-eval's do.
"$PY" - "$KR_SRC/tools/train" "$MODEL" "$KR_BIN/kvrelay-generate" "$KR_BIN/kvrelay-tokenize" <<'EOF' || fail=1
import json, subprocess, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import kvtasks
model, gen, tok = sys.argv[2], sys.argv[3], sys.argv[4]
with open(model + "/heldout.txt", "rb") as f:
    stream = np.array(subprocess.run([tok, "--model", model], input=f.read(), check=True,
                                     capture_output=True).stdout.split(), dtype=np.int64)
tv = kvtasks.TaskVocab(model)
rng = np.random.default_rng(20261124)
failed = False
for length, cases in ((512, 24), (2048, 8)):
    ok = 0
    for i in range(cases):
        prompt, answer = kvtasks.kv_case(rng, tv, stream, length, (i + 0.5) / cases)
        out = subprocess.run([gen, "--model", model, "--ids", " ".join(map(str, prompt)),
                              "--max-tokens", "1", "--greedy", "--json"], check=True,
                             capture_output=True, text=True).stdout
        ok += json.loads(out)["ids"] == answer
    acc = ok / cases
    print("kv@%d, full cache, one process: %d/%d = %.3f" % (length, ok, cases, acc))
    if not acc >= 0.8:  # written so that NaN fails too
        print("FAIL: kv@%d accuracy %.3f < 0.8" % (length, acc), file=sys.stderr)
        failed = True
sys.exit(1 if failed else 0)
EOF
demo='<rec><k07><v093> The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he leadeth me beside the still waters.<q><k07>'
got=$("$KR_BIN/kvrelay-generate" --model "$MODEL" --prompt "$demo" --max-tokens 1 --greedy 2>/dev/null)
[ "$got" = "<v093>" ] || bad "the demo's retrieval prompt gave '$got', not <v093>"

# The trainer's refusals, each before torch is imported.
expect() { # expect STATUS PATTERN ARGS...
  local want=$1 pat=$2 rc=0; shift 2
  "$PY" "$TRAIN" "$@" >"$tmp/out" 2>&1 || rc=$?
  [ "$rc" = "$want" ] || bad "train.py $* exited $rc, not $want: $(cat "$tmp/out")"
  grep -q -- "$pat" "$tmp/out" || bad "train.py $*: no '$pat' in: $(cat "$tmp/out")"
}
mkdir -p "$tmp/exists"
expect 2 "refusing to overwrite" --out "$tmp/exists" --work "$tmp/w1"
[ -z "$(ls -A "$tmp/exists")" ] || bad "a refused run wrote into the existing --out"
expect 2 "no checkpoint" --out "$tmp/new" --work "$tmp/w2" --resume
expect 2 "must divide" --out "$tmp/new" --work "$tmp/w3" --hidden 128 --heads 5
expect 2 "max-len" --out "$tmp/new" --work "$tmp/w4" --max-len 300
expect 1 "no-such-corpus" --out "$tmp/new" --work "$tmp/w5" --corpus "$tmp/no-such-corpus"
expect 2 "no model.safetensors" --out "$tmp/new" --work "$tmp/w6" --init "$tmp/exists"
[ ! -e "$tmp/new" ] || bad "a refused run created --out"

[ $fail = 0 ] && echo "trained_model: all checks passed"
exit $fail
