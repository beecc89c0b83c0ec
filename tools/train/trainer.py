"""trainer.py - the model and the training loop of tools/train/train.py (which parses the
command line, checks the directories and prepares the data before this module loads torch).

The model is a Hugging Face Llama written out in torch: RMSNorm, RoPE in the rotate-half
layout, GQA, SiLU MLP, untied head. Its tensors carry Hugging Face's names (Llama.hf_state), so
the export is a plain bf16 safetensors file. Training adds two auxiliary losses, used in training
only and never exported: linear probes that make the probe layer's residual stream hold the
tokens one and two positions back, and a loss that makes head 0 of the attention layer attend to
the token a query or a copy retrieves (an induction head that eviction can then starve).
"""
import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtasks

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


def read_safetensors(path):
    """{name: float32 tensor} of a safetensors file of bf16/f32 tensors (as export writes)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        a, b = h["data_offsets"]
        if h["dtype"] == "BF16":
            t = torch.from_numpy(np.frombuffer(data[a:b], dtype=np.int16).copy()).view(torch.bfloat16)
        elif h["dtype"] == "F32":
            t = torch.from_numpy(np.frombuffer(data[a:b], dtype=np.float32).copy())
        else:
            raise RuntimeError("%s: tensor %s is %s (bf16 or f32 expected)" % (path, name, h["dtype"]))
        out[name] = t.float().reshape(h["shape"])
    return out


def load_init(model, cfg, init):
    """Starts from the weights of model directory `init` (same shape and vocabulary)."""
    with open(os.path.join(init, "config.json")) as f:
        ic = json.load(f)
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "rope_theta"):
        if ic.get(k) != cfg[k]:
            raise RuntimeError("--init %s: %s is %s, this run's is %s" % (init, k, ic.get(k), cfg[k]))
    w = read_safetensors(os.path.join(init, "model.safetensors"))
    with torch.no_grad():
        for name, p in model.hf_state().items():
            if name not in w or tuple(w[name].shape) != tuple(p.shape):
                raise RuntimeError("--init %s: tensor %s missing or of another shape" % (init, name))
            p.copy_(w[name])


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


def export(model, cfg, tok_dir, out, meta, heldout):
    """Writes the model directory (with the held-out text and a SHA256SUMS in sha256sum's
    format) into a temporary sibling, then swaps it in with renames."""
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
    shutil.copy(heldout, os.path.join(tmp, "heldout.txt"))
    sums = []
    for n in sorted(os.listdir(tmp)):
        with open(os.path.join(tmp, n), "rb") as f:
            sums.append("%s  %s\n" % (hashlib.sha256(f.read()).hexdigest(), n))
    with open(os.path.join(tmp, "SHA256SUMS"), "w") as f:
        f.write("".join(sums))
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".old-", dir=parent)
        os.rename(out, os.path.join(old, "m"))
    os.rename(tmp, out)
    if old:
        shutil.rmtree(old)


# ================================================================== batches and losses



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
                a = torch.tensor(s.answers, device=ids.device)
                hit += int((pred[b, a] == y[b, a]).sum())
                tot += len(s.answers)
        stats[kind] = (hit, tot)
    # probes: the probe layer's stream must hold the tokens one and two positions back
    h = keep["h%d" % pl]
    T = x.shape[1]
    probe = torch.zeros((), device=ids.device)
    for back, P in ((1, probes[0]), (2, probes[1])):
        hh, tgt = h[:, back:], x[:, :T - back]
        sel = torch.isin(tgt, tv_task["all"]) | (torch.rand(tgt.shape).to(tgt.device) < args.probe_frac)
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
    attn = torch.zeros((), device=ids.device)
    if g:
        def t(v):
            return torch.tensor(v, device=att.device)
        p = att[t(bi), t(qi), t(ki)]
        mass = torch.zeros(g, device=att.device).index_add(0, t(gi), p)
        attn = -(mass + 1e-9).log().mean()
    total = lm + args.probe_weight * probe + args.attn_weight * attn
    return total, lm, probe, attn, stats


@torch.no_grad()
def quick_eval(model, tv, stream, lengths, cases, seed):
    """Full-cache accuracy on kv and copy cases from held-out text (greedy, teacher-forced copy
    of the span's first kvtasks.COPY_ANSWER tokens, as kvrelay-eval scores it)."""
    model.eval()
    res = {}
    for L in lengths:
        rng = np.random.default_rng([seed, 7, L])
        for kind, make in (("kv", kvtasks.kv_case), ("copy", kvtasks.copy_case)):
            ok = 0
            for i in range(cases):
                if kind == "copy":
                    p, a = make(rng, tv, stream, L, (i + 0.5) / cases, answer=kvtasks.COPY_ANSWER)
                else:
                    p, a = make(rng, tv, stream, L, (i + 0.5) / cases)
                ids = torch.tensor([p + a[:-1]], device=model.inv_freq.device)
                pred = model(ids)[0][0, len(p) - 1:].argmax(-1).tolist()
                ok += pred == a
            res["%s@%d" % (kind, L)] = ok / cases
    model.train()
    return res


def run(args, out, work, info, stages, log):
    """Trains (or resumes) and exports to `out` at every checkpoint and at the end."""
    ckpt = os.path.join(work, "checkpoint.pt")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok_dir = os.path.join(work, "tokenizer")
    tv = kvtasks.TaskVocab(tok_dir)
    train_ids = np.load(os.path.join(work, "train.npy"))
    held_ids = np.load(os.path.join(work, "heldout.npy"))
    cfg = model_config(args, info["n_vocab"], tok_dir)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Llama(cfg).to(dev)
    V = cfg["vocab_size"]
    probes = nn.ModuleList([nn.Linear(args.hidden, V, bias=False) for _ in range(2)]).to(dev)
    params = list(model.parameters()) + list(probes.parameters())
    decay = [p for p in params if p.dim() >= 2]
    nodecay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": nodecay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    st = {"step": 0, "tokens": 0, "stage": 0, "ema": {"kv": 0.0, "copy": 0.0}, "evals": []}
    if args.resume:
        ck = torch.load(ckpt, map_location="cpu")
        model.load_state_dict(ck["model"])
        probes.load_state_dict(ck["probes"])
        opt.load_state_dict(ck["opt"])
        torch.set_rng_state(ck["torch_rng"])  # the probes' position sampling goes on as unbroken
        st = ck["state"]
        log("resumed at step %d (%.1f M tokens, stage %d)" % (st["step"], st["tokens"] / 1e6, st["stage"]))
    elif args.init:
        load_init(model, cfg, args.init)
        log("weights from %s" % args.init)
    tv_task = {"keys": set(int(k) for k in tv.keys), "all": torch.tensor(sorted(tv.task_ids), device=dev)}
    n_params = sum(p.numel() for p in model.parameters())
    log("model: %d layers, hidden %d, %d/%d heads, vocab %d, %.2f M parameters; %s tokens of text "
        "(%d held out); %s" % (args.layers, args.hidden, args.heads, args.kv_heads, V, n_params / 1e6,
                               len(train_ids), len(held_ids),
                               torch.cuda.get_device_name(dev) if dev.type == "cuda"
                               else "CPU, %d thread(s)" % args.threads))

    def save(final=False):
        meta = {"args": {k: v for k, v in vars(args).items() if k not in ("resume",)},
                "step": st["step"], "tokens": st["tokens"], "stage_max_len": stages[st["stage"]],
                "evals": st["evals"][-1:], "complete": final, "corpus": info}
        export(model, cfg, tok_dir, out, meta, os.path.join(work, "heldout.txt"))
        tmp = ckpt + ".tmp"
        torch.save({"model": model.state_dict(), "probes": probes.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                    "opt": opt.state_dict(), "state": st}, tmp)
        os.replace(tmp, ckpt)

    t0 = time.time()
    t_ck, tok0 = t0, st["tokens"]
    agg = {"loss": 0.0, "lm": 0.0, "probe": 0.0, "attn": 0.0, "n": 0}
    while st["tokens"] < args.tokens and not (args.stop_step and st["step"] >= args.stop_step):
        frac = st["tokens"] / args.tokens
        lr = args.lr * min(1.0, (st["step"] + 1) / args.warmup)
        if frac > 0.8:  # linear decay to a tenth over the last fifth
            lr *= 1.0 - 0.9 * (frac - 0.8) / 0.2
        for g in opt.param_groups:
            g["lr"] = lr
        ids, w, seqs = make_batch(st["step"], args, tv, train_ids, stages[st["stage"]])
        ids, w = ids.to(dev), w.to(dev)
        total, lm, probe, attn, stats = losses(model, ids, w, seqs, tv_task, args, probes)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if not math.isfinite(float(total)):
            raise RuntimeError("loss is %s at step %d: stopping (resume from the last checkpoint "
                               "with a lower --lr)" % (float(total), st["step"]))
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

