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
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtasks  # noqa: E402

HELD_OUT_EVERY = 40  # every 40th chapter (paragraph) is held out for evaluation
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


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


# ================================================================== the model (HF Llama layout)

class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.input_layernorm = RMSNorm(d, c["rms_norm_eps"])
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d, c["rms_norm_eps"])
        self.gate_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], d, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        att = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd)) + mask
        att = att.softmax(-1)  # [B, H, T, T]
        y = (att @ v).transpose(1, 2).reshape(B, T, self.nh * self.hd)
        x = x + self.o_proj(y)
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, att


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Block(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        hd = c["head_dim"]
        self.register_buffer("inv_freq", 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)),
                             persistent=False)

    def forward(self, ids, keep=()):
        """Logits [B, T, V]; also the residual stream after each layer in `keep` ("h<i>") and
        the attention probabilities of each layer in `keep` ("a<i>")."""
        B, T = ids.shape
        t = torch.arange(T, dtype=torch.float32, device=ids.device)
        fr = torch.outer(t, self.inv_freq)
        emb = torch.cat((fr, fr), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = torch.full((T, T), float("-inf"), device=ids.device).triu(1)
        x, out = self.embed_tokens(ids), {}
        for i, layer in enumerate(self.layers):
            x, att = layer(x, cos, sin, mask)
            if i in keep:
                out["h%d" % i], out["a%d" % i] = x, att
        return self.lm_head(self.norm(x)), out

    def hf_state(self):
        """Tensors under their Hugging Face Llama names."""
        s = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight,
             "lm_head.weight": self.lm_head.weight}
        for i, L in enumerate(self.layers):
            p = "model.layers.%d." % i
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                s[p + "self_attn." + n + ".weight"] = getattr(L, n).weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                s[p + "mlp." + n + ".weight"] = getattr(L, n).weight
            s[p + "input_layernorm.weight"] = L.input_layernorm.weight
            s[p + "post_attention_layernorm.weight"] = L.post_attention_layernorm.weight
        return s


def model_config(args, n_vocab, tok_dir):
    with open(os.path.join(tok_dir, "config.json")) as f:
        made = json.load(f)
    hd = args.hidden // args.heads
    return {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": made["bos_token_id"], "eos_token_id": made["eos_token_id"],
        "head_dim": hd, "hidden_act": "silu", "hidden_size": args.hidden,
        "intermediate_size": args.intermediate, "max_position_embeddings": args.max_pos,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": args.heads,
        "num_hidden_layers": args.layers, "num_key_value_heads": args.kv_heads,
        "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_theta": args.rope_theta,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": n_vocab,
    }


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous().to(torch.bfloat16)
        raw = t.view(torch.int16).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def export(model, cfg, tok_dir, out, meta):
    """Writes the model directory into a temporary sibling, then swaps it in with renames."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".tmp-", dir=parent)
    for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tok_dir, n), os.path.join(tmp, n))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(tmp, "training.json"), "w") as f:
        json.dump(meta, f, indent=1)
    write_safetensors(os.path.join(tmp, "model.safetensors"), model.hf_state())
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".old-", dir=parent)
        os.rename(out, os.path.join(old, "m"))
    os.rename(tmp, out)
    if old:
        shutil.rmtree(old)


# ================================================================== batches and losses

STAGES = (128, 256, 512, 1024, 2048)


def make_batch(step, args, tv, stream, max_len):
    """The batch of `step`: deterministic from (seed, step), so a resumed run sees the same data."""
    rng = np.random.default_rng([args.seed, step])
    L = int(rng.choice([max_len // 2, (3 * max_len) // 4, max_len]))
    B = max(1, args.batch_tokens // L)
    seqs = []
    for _ in range(B):
        r = rng.random()
        if r < args.p_kv:
            seqs.append(kvtasks.kv_seq(rng, tv, stream, L, args.answer_weight))
        elif r < args.p_kv + args.p_copy:
            seqs.append(kvtasks.copy_seq(rng, tv, stream, L, args.answer_weight))
        else:
            seqs.append(kvtasks.text_seq(rng, tv, stream, L))
    ids = torch.from_numpy(np.stack([s.ids for s in seqs]))
    w = torch.from_numpy(np.stack([s.weight for s in seqs]))
    return ids, w, seqs


def losses(model, ids, w, seqs, tv_task, args, probes):
    x, y = ids[:, :-1], ids[:, 1:]
    pl, al = args.probe_layer, args.attn_layer
    logits, keep = model(x, keep=(pl, al))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    lm = (ce * w.reshape(-1)).sum() / w.sum()
    # answers: accuracy per task (kv answers follow a key; copy answers follow <cp> or a span)
    stats = {}
    pred = logits.argmax(-1)
    for kind in ("kv", "copy"):
        hit = tot = 0
        for b, s in enumerate(seqs):
            if s.answers and (s.ids[s.answers[0]] in tv_task["keys"]) == (kind == "kv"):
                a = torch.tensor(s.answers)
                hit += int((pred[b, a] == y[b, a]).sum())
                tot += len(s.answers)
        stats[kind] = (hit, tot)
    # probes: the probe layer's stream must hold the tokens one and two positions back
    h = keep["h%d" % pl]
    T = x.shape[1]
    probe = torch.zeros(())
    for back, P in ((1, probes[0]), (2, probes[1])):
        hh, tgt = h[:, back:], x[:, :T - back]
        sel = torch.isin(tgt, tv_task["all"]) | (torch.rand(tgt.shape) < args.probe_frac)
        if sel.any():
            probe = probe + F.cross_entropy(P(hh[sel]), tgt[sel])
    # retrieval head: head 0 of the attention layer attends to the token to be retrieved
    att = keep["a%d" % al][:, 0]  # [B, T, T]
    bi, qi, ki, gi, g = [], [], [], [], 0
    for b, s in enumerate(seqs):
        for q, ks in s.attn:
            for k in ks:
                bi.append(b), qi.append(q), ki.append(k), gi.append(g)
            g += 1
    attn = torch.zeros(())
    if g:
        p = att[torch.tensor(bi), torch.tensor(qi), torch.tensor(ki)]
        mass = torch.zeros(g).index_add(0, torch.tensor(gi), p)
        attn = -(mass + 1e-9).log().mean()
    total = lm + args.probe_weight * probe + args.attn_weight * attn
    return total, lm, probe, attn, stats


@torch.no_grad()
def quick_eval(model, tv, stream, lengths, cases, seed):
    """Full-cache accuracy on kv and copy cases from held-out text (greedy, teacher-forced copy)."""
    model.eval()
    res = {}
    for L in lengths:
        rng = np.random.default_rng([seed, 7, L])
        for kind, make in (("kv", kvtasks.kv_case), ("copy", kvtasks.copy_case)):
            ok = 0
            for i in range(cases):
                p, a = make(rng, tv, stream, L, (i + 0.5) / cases)
                ids = torch.tensor([p + a[:-1]])
                pred = model(ids)[0][0, len(p) - 1:].argmax(-1).tolist()
                ok += pred == a
            res["%s@%d" % (kind, L)] = ok / cases
    model.train()
    return res


# ================================================================== main

def parse_args():
    ap = argparse.ArgumentParser(
        description="Train kvrelay's default model (docs/models.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="model directory to write (refused if it exists, unless --resume)")
    ap.add_argument("--work", help="checkpoint and data directory (default: build/train/NAME)")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --work")
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
    os.makedirs(work, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    info = prepare(args, work)
    tok_dir = os.path.join(work, "tokenizer")
    tv = kvtasks.TaskVocab(tok_dir)
    train_ids = np.load(os.path.join(work, "train.npy"))
    held_ids = np.load(os.path.join(work, "heldout.npy"))
    cfg = model_config(args, info["n_vocab"], tok_dir)
    model = Llama(cfg)
    V = cfg["vocab_size"]
    probes = nn.ModuleList([nn.Linear(args.hidden, V, bias=False) for _ in range(2)])
    params = list(model.parameters()) + list(probes.parameters())
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    st = {"step": 0, "tokens": 0, "stage": 0, "ema": {"kv": 0.0, "copy": 0.0}, "evals": []}
    if args.resume:
        ck = torch.load(ckpt)
        model.load_state_dict(ck["model"])
        probes.load_state_dict(ck["probes"])
        opt.load_state_dict(ck["opt"])
        st = ck["state"]
        log("resumed at step %d (%.1f M tokens, stage %d)" % (st["step"], st["tokens"] / 1e6, st["stage"]))
    tv_task = {"keys": set(int(k) for k in tv.keys), "all": torch.tensor(sorted(tv.task_ids))}
    stages = [s for s in STAGES if s <= args.max_len]
    n_params = sum(p.numel() for p in model.parameters())
    log("model: %d layers, hidden %d, %d/%d heads, vocab %d, %.2f M parameters; %s tokens of text "
        "(%d held out); %d thread(s)" % (args.layers, args.hidden, args.heads, args.kv_heads, V,
                                         n_params / 1e6, len(train_ids), len(held_ids), args.threads))

    def save(final=False):
        meta = {"args": {k: v for k, v in vars(args).items() if k not in ("resume",)},
                "step": st["step"], "tokens": st["tokens"], "stage_max_len": stages[st["stage"]],
                "evals": st["evals"][-1:], "complete": final, "corpus": info}
        export(model, cfg, tok_dir, out, meta)
        shutil.copy(os.path.join(work, "heldout.txt"), os.path.join(out, "heldout.txt"))
        tmp = ckpt + ".tmp"
        torch.save({"model": model.state_dict(), "probes": probes.state_dict(),
                    "opt": opt.state_dict(), "state": st}, tmp)
        os.replace(tmp, ckpt)

    t0 = time.time()
    t_ck, tok0 = t0, st["tokens"]
    agg = {"loss": 0.0, "lm": 0.0, "probe": 0.0, "attn": 0.0, "n": 0}
    while st["tokens"] < args.tokens:
        frac = st["tokens"] / args.tokens
        lr = args.lr * min(1.0, (st["step"] + 1) / args.warmup)
        if frac > 0.8:  # linear decay to a tenth over the last fifth
            lr *= 1.0 - 0.9 * (frac - 0.8) / 0.2
        for g in opt.param_groups:
            g["lr"] = lr
        ids, w, seqs = make_batch(st["step"], args, tv, train_ids, stages[st["stage"]])
        total, lm, probe, attn, stats = losses(model, ids, w, seqs, tv_task, args, probes)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if not math.isfinite(float(total)):
            die("loss is %s at step %d: stopping (resume from the last checkpoint with a lower --lr)"
                % (float(total), st["step"]), 1)
        st["step"] += 1
        st["tokens"] += ids.numel() - ids.shape[0]
        for k, v in (("loss", total), ("lm", lm), ("probe", probe), ("attn", attn)):
            agg[k] += float(v)
        agg["n"] += 1
        for kind, (hit, tot) in stats.items():
            if tot:
                st["ema"][kind] = 0.95 * st["ema"][kind] + 0.05 * hit / tot
        if (st["stage"] + 1 < len(stages) and st["ema"]["kv"] >= args.advance_at
                and st["ema"]["copy"] >= args.advance_copy_at):
            st["stage"] += 1
            st["ema"] = {"kv": 0.0, "copy": 0.0}
            log("curriculum: sequences up to %d tokens from step %d" % (stages[st["stage"]], st["step"]))
        if st["step"] % args.log_every == 0:
            el = time.time() - t0
            tps = (st["tokens"] - tok0) / el
            eta = (args.tokens - st["tokens"]) / tps if tps > 0 else 0
            n = agg["n"]
            log("step %d | %.2f M tok | %.0f tok/s | loss %.3f lm %.3f probe %.3f attn %.3f | "
                "answers kv %.2f copy %.2f | len<=%d | lr %.2e | ETA %dm" % (
                    st["step"], st["tokens"] / 1e6, tps, agg["loss"] / n, agg["lm"] / n,
                    agg["probe"] / n, agg["attn"] / n, st["ema"]["kv"], st["ema"]["copy"],
                    stages[st["stage"]], lr, eta / 60))
            agg = {"loss": 0.0, "lm": 0.0, "probe": 0.0, "attn": 0.0, "n": 0}
        if time.time() - t_ck > args.ckpt_minutes * 60:
            ev = quick_eval(model, tv, held_ids, [256, 512, 1024], 16, args.seed)
            st["evals"].append({"step": st["step"], "tokens": st["tokens"], **ev})
            log("eval (full cache, held-out filler): " + " ".join("%s %.2f" % kv for kv in ev.items()))
            save()
            t_ck = time.time()
    ev = quick_eval(model, tv, held_ids, [256, 512, 1024], 32, args.seed)
    st["evals"].append({"step": st["step"], "tokens": st["tokens"], **ev})
    log("final eval (full cache): " + " ".join("%s %.2f" % kv for kv in ev.items()))
    save(final=True)
    log("wrote %s (%d steps, %.1f M tokens, %.0f s)" % (out, st["step"], st["tokens"] / 1e6, time.time() - t0))


if __name__ == "__main__":
    main()
