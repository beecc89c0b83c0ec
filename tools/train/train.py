#!/usr/bin/python3
"""train.py - trains kvrelay's default model: a small Llama that writes King James English and
retrieves keys and copies spans from long contexts, so that KV eviction has something to destroy.

What it writes: a Hugging Face Llama directory (config.json, generation_config.json,
model.safetensors in bf16, tokenizer.json, tokenizer_config.json with a chat_template,
training.json) that kvrelay and `transformers` load unchanged. The tokenizer is the byte-level
BPE that kvrelay-make-model trains on the corpus, plus the task tokens of kvtasks.py.
What it is not: a general trainer (one architecture, one data mix, CPU or one GPU).

Run (docs/models.md has the exact command behind the committed model):
  /usr/bin/python3 tools/train/train.py --out models/kvrelay-kjv --tokens 60e6
  /usr/bin/python3 tools/train/train.py --out models/kvrelay-kjv --tokens 60e6 --resume
Deterministic from --seed; resumable from the checkpoint in --work (written every few minutes);
progress on stderr (step, tokens/s, losses, answer accuracy, ETA).
"""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtasks  # noqa: E402

HELD_OUT_EVERY = 40  # every 40th chapter (paragraph) is held out for evaluation
STAGES = (128, 256, 512, 1024, 2048)  # curriculum: the longest sequence of each stage
CHAT_TEMPLATE = (
    '{#- The model continues plain text (King James English) and never saw role markers: the\n'
    "    prompt is BOS and the messages' contents, system messages first, one per line, so a\n"
    '    one-message chat is the same prompt as that text sent to /v1/completions. #}\n'
    '{%- set ns = namespace(parts=[]) %}\n'
    "{%- for message in messages if message['role'] == 'system' %}\n"
    "    {%- set ns.parts = ns.parts + [message['content']] %}\n"
    '{%- endfor %}\n'
    "{%- for message in messages if message['role'] != 'system' %}\n"
    "    {%- set ns.parts = ns.parts + [message['content']] %}\n"
    '{%- endfor %}\n'
    "{{- bos_token + ns.parts | join('\\n') }}")


def die(msg, code=2):
    print("train.py: " + msg, file=sys.stderr)
    sys.exit(code)


def log(msg):
    print("train.py: " + msg, file=sys.stderr, flush=True)


# ================================================================== corpus and tokenizer

def kjv_units():
    """The King James Bible from Debian's bible-kjv, one (title, text) unit per chapter."""
    try:
        out = subprocess.run(["bible", "-l0", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                             text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        die("cannot run 'bible' (apt-get install bible-kjv): %s" % e, 1)
    units, cur = [], None
    for line in out.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+\d+\s+(.*)$", line)
        if m and cur is not None:
            cur[1].append(m.group(1).strip())
        else:
            cur = (line.strip(), [])
            units.append(cur)
    return ["%s\n%s\n\n" % (t, " ".join(v)) for t, v in units if v]


def file_units(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        die("--corpus %s: %s" % (path, e), 1)
    units = [p.strip() + "\n\n" for p in re.split(r"\n\s*\n", text) if p.strip()]
    if len(units) < 2 * HELD_OUT_EVERY:
        die("--corpus %s: %d paragraphs; at least %d are needed (blank-line separated)"
            % (path, len(units), 2 * HELD_OUT_EVERY), 1)
    return units


def run_tool(args, stdin=None):
    try:
        return subprocess.run(args, check=True, capture_output=True, input=stdin).stdout
    except OSError as e:
        die("cannot run %s: %s (build first: ./kvrelay build)" % (args[0], e), 1)
    except subprocess.CalledProcessError as e:
        die("%s failed: %s" % (" ".join(args), e.stderr.decode(errors="replace").strip()), 1)


def make_tokenizer(bin_dir, corpus_path, vocab, tok_dir):
    """BPE from kvrelay-make-model, then the task tokens appended as non-special added tokens."""
    run_tool([os.path.join(bin_dir, "kvrelay-make-model"), "--corpus", corpus_path, "--out",
              tok_dir, "--vocab", str(vocab)])
    os.remove(os.path.join(tok_dir, "model.safetensors"))  # its random weights are not ours
    with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    n = max(a["id"] for a in tok["added_tokens"]) + 1
    for i, s in enumerate(kvtasks.task_token_strings()):
        entry = {"id": n + i, "content": s, "single_word": False, "lstrip": False,
                 "rstrip": False, "normalized": False, "special": False}
        tok["added_tokens"].append(entry)
        tcfg["added_tokens_decoder"][str(n + i)] = {k: v for k, v in entry.items() if k != "id"}
    tcfg["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(tok_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False, indent=1)
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tcfg, f, ensure_ascii=False, indent=1)
    return n + len(kvtasks.task_token_strings())


def tokenize(bin_dir, tok_dir, path):
    with open(path, "rb") as f:
        data = f.read()
    out = run_tool([os.path.join(bin_dir, "kvrelay-tokenize"), "--model", tok_dir], stdin=data)
    return np.array(out.split(), dtype=np.int32)


def prepare(args, work):
    """Corpus split, tokenizer and token streams in `work` (done once; resume reuses them)."""
    done = os.path.join(work, "data.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    units = kjv_units() if args.corpus == "kjv" else file_units(args.corpus)
    train = [u for i, u in enumerate(units) if i % HELD_OUT_EVERY != HELD_OUT_EVERY // 2]
    held = [u for i, u in enumerate(units) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2]
    for name, us in (("train.txt", train), ("heldout.txt", held)):
        with open(os.path.join(work, name), "w", encoding="utf-8") as f:
            f.write("".join(us))
    tok_dir = os.path.join(work, "tokenizer")
    n_vocab = make_tokenizer(args.bin, os.path.join(work, "train.txt"), args.bpe_vocab, tok_dir)
    for name in ("train", "heldout"):
        ids = tokenize(args.bin, tok_dir, os.path.join(work, name + ".txt"))
        np.save(os.path.join(work, name + ".npy"), ids)
    info = {"n_vocab": n_vocab, "corpus": args.corpus, "train_units": len(train),
            "heldout_units": len(held)}
    with open(done, "w") as f:
        json.dump(info, f)
    return info


# ================================================================== main

def parse_args():
    ap = argparse.ArgumentParser(
        description="Train kvrelay's default model (docs/models.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="model directory to write (refused if it exists, unless --resume)")
    ap.add_argument("--work", help="checkpoint and data directory (default: build/train/NAME)")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
    ap.add_argument("--init", help="start from this model directory's weights (same shape and tokenizer; "
                                   "the optimizer and the auxiliary probes start fresh)")
    ap.add_argument("--bin", default="build", help="directory with kvrelay-make-model and kvrelay-tokenize")
    ap.add_argument("--corpus", default="kjv", help="'kjv' (Debian's bible-kjv) or a UTF-8 text file")
    ap.add_argument("--bpe-vocab", type=int, default=2048, help="BPE vocabulary with specials, before the task tokens")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--rope-theta", type=float, default=1e5)
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=1024, help="longest training sequence (the last curriculum stage)")
    ap.add_argument("--tokens", type=float, default=60e6, help="training tokens in all")
    ap.add_argument("--stop-step", type=int, default=0,
                    help="stop (final evaluation and export) after this step, with the learning-rate "
                         "schedule of --tokens (0: run all --tokens)")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--p-kv", type=float, default=0.45, help="share of key-value sequences")
    ap.add_argument("--p-copy", type=float, default=0.2, help="share of copy sequences (the rest is text)")
    ap.add_argument("--answer-weight", type=float, default=4.0)
    ap.add_argument("--probe-layer", type=int, default=0)
    ap.add_argument("--probe-weight", type=float, default=0.5)
    ap.add_argument("--probe-frac", type=float, default=0.1)
    ap.add_argument("--attn-layer", type=int, default=1)
    ap.add_argument("--attn-weight", type=float, default=1.0)
    ap.add_argument("--advance-at", type=float, default=0.9,
                    help="key-value answer accuracy that ends a curriculum stage")
    ap.add_argument("--advance-copy-at", type=float, default=0.7,
                    help="copy answer accuracy that ends a curriculum stage (copy is learned later)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--log-every", type=int, default=20)
    a = ap.parse_args()
    if a.hidden % a.heads or a.heads % a.kv_heads or (a.hidden // a.heads) % 2:
        ap.error("--heads must divide --hidden, --kv-heads divide --heads, head_dim be even")
    if not (0 <= a.probe_layer < a.layers and 0 <= a.attn_layer < a.layers):
        ap.error("--probe-layer and --attn-layer must name layers of the model")
    if a.max_len not in STAGES or a.max_len > a.max_pos:
        ap.error("--max-len must be one of %s and at most --max-pos" % (STAGES,))
    if a.tokens <= 0 or a.batch_tokens < a.max_len // 2:
        ap.error("--tokens must be positive and --batch-tokens at least half of --max-len")
    if a.stop_step < 0:
        ap.error("--stop-step must be 0 (off) or a step count")
    if not (0 <= a.p_kv and 0 <= a.p_copy and a.p_kv + a.p_copy <= 1):
        ap.error("--p-kv and --p-copy are shares that sum to at most 1")
    return a


def main():
    args = parse_args()
    out = args.out.rstrip("/")
    work = args.work or os.path.join("build", "train", os.path.basename(out))
    ckpt = os.path.join(work, "checkpoint.pt")
    if args.resume:
        if not os.path.exists(ckpt):
            die("--resume: no checkpoint at %s" % ckpt)
    elif os.path.exists(out) or os.path.exists(ckpt):
        die("%s exists: refusing to overwrite (--resume continues its run; or remove it)"
            % (out if os.path.exists(out) else ckpt))
    if args.init and not os.path.isfile(os.path.join(args.init, "model.safetensors")):
        die("--init %s: no model.safetensors there" % args.init)
    os.makedirs(work, exist_ok=True)
    info = prepare(args, work)
    if args.init:
        with open(os.path.join(args.init, "tokenizer.json"), "rb") as a, \
                open(os.path.join(work, "tokenizer", "tokenizer.json"), "rb") as b:
            if a.read() != b.read():
                die("--init %s: its tokenizer.json differs from the one this run made (another "
                    "corpus or --bpe-vocab?)" % args.init)
    import trainer  # torch: imported only once the arguments and directories are known good
    try:
        trainer.run(args, out, work, info, [s for s in STAGES if s <= args.max_len], log)
    except RuntimeError as e:
        die(str(e), 1)


if __name__ == "__main__":
    main()
