#!/usr/bin/env python3
"""structured-output.py - what the structured-output mask costs the decode node per step
(docs/structured-output.md, "Measured cost"), measured on a real cluster (1 prefill + 1 decode
node, one thread each) from the decode node's own metrics: kvrelay_decode_step_seconds (the
batched forward call) and kvrelay_decode_grammar_mask_seconds (one sequence's mask computed and
applied), at batch 1 and batch 8 (that many concurrent requests), with a record schema
(strings, an integer, an enum, an array of objects) against the same requests unconstrained
(ignore_eos, the same max_tokens).

  bench/structured-output.py --bin build [--model models/kjv-2l128-2k] [--spm DIR] [--requests 16]

--spm DIR: measure on a 32,000-token vocabulary too: the model's layers with a random embedding
and output head of 32,000 rows and the sentencepiece tokenizer in DIR (e.g.
$KR_SHARED/fixtures/tokenizers/llama-spm), made in the work directory. The text is nonsense;
only the mask's cost matters here. Prints one line per (vocabulary, batch).
"""
import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import urllib.request

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "tests", "integration"))
import krprocs  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"type": "object", "additionalProperties": False, "required": ["k", "v"],
                                            "properties": {"k": {"type": "string", "maxLength": 12},
                                                           "v": {"type": "string", "maxLength": 24}}}}}}


def spm_model(model, spm, out):
    """The model's layers with a 32,000-row random embedding and head, and spm's tokenizer."""
    import numpy as np
    os.makedirs(out, exist_ok=True)
    raw = open(os.path.join(model, "model.safetensors"), "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    vocab = 32000
    rng = np.random.default_rng(1)
    tensors = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        tensors[k] = (v["dtype"], v["shape"], body[a:b])
    hidden = tensors["model.embed_tokens.weight"][1][1]
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        f32 = (rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float32)
        bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        tensors[k] = ("BF16", [vocab, hidden], bf16)
    header, off = {}, 0
    for k, (dt, shape, data) in tensors.items():
        header[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)) + hj)
        for k in header:
            f.write(tensors[k][2])
    cfg = json.load(open(os.path.join(model, "config.json")))
    cfg.update(vocab_size=vocab, bos_token_id=1, eos_token_id=2)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    json.dump({"bos_token_id": 1, "eos_token_id": 2}, open(os.path.join(out, "generation_config.json"), "w"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(spm, name), os.path.join(out, name))
    return out


def metrics(http):
    text = urllib.request.urlopen("http://%s/metrics" % http, timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("kvrelay_decode_step_seconds", "kvrelay_decode_grammar_mask_seconds"):
            for part in ("_sum", "_count"):
                if line.startswith(name + part + " "):
                    out[name + part] = float(line.split()[1])
    return out


def post(api, body):
    req = urllib.request.Request(api + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read().decode())


def run(api, http, n, conc, body):
    """n requests, conc at a time: (forward s per step, steps, masks, mask s per mask, tokens)."""
    before = metrics(http)
    pending = list(range(n))
    lock = threading.Lock()
    tokens = [0]

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop()
            d = post(api, dict(body, seed=i))
            with lock:
                tokens[0] += d["usage"]["completion_tokens"]

    ts = [threading.Thread(target=worker) for _ in range(conc)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    after = metrics(http)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    steps = d["kvrelay_decode_step_seconds_count"]
    masks = d.get("kvrelay_decode_grammar_mask_seconds_count", 0)
    return (d["kvrelay_decode_step_seconds_sum"] / max(steps, 1), steps, masks,
            d.get("kvrelay_decode_grammar_mask_seconds_sum", 0) / max(masks, 1), tokens[0])


def measure(b, model, work, label, n):
    krprocs._procs.clear()
    dec, dhttp = krprocs.start(work, "decode", [b + "/kvrelay-decode", "--model", model, "--id", "decode-0",
                                                "--listen", "127.0.0.1:0", "--transfer", "127.0.0.1:0",
                                                "--http", "127.0.0.1:0", "--kv-memory", "256M", "--threads", "1",
                                                "--max-batch", "8"])
    pre, _ = krprocs.start(work, "prefill", [b + "/kvrelay-prefill", "--model", model, "--id", "prefill-0",
                                             "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "1"])
    nodes = os.path.join(work, "nodes.json")
    json.dump({"prefill": [{"id": "prefill-0", "address": pre}], "decode": [{"id": "decode-0", "address": dec}]},
              open(nodes, "w"))
    _, http = krprocs.start(work, "router", [b + "/kvrelay-router", "--model", model, "--nodes", nodes,
                                             "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                             "--served-model-name", "m"])
    api = "http://%s/v1" % http
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    base = {"model": "m", "prompt": "And God said", "max_tokens": 128, "temperature": 0.8}
    try:
        for conc in (1, 8):
            fw0, steps0, _, _, tok0 = run(api, dhttp, n, conc, dict(base, ignore_eos=True))
            fw, steps, masks, mask, tok = run(api, dhttp, n, conc, dict(base, response_format=rf))
            per_step = mask * masks / max(steps, 1)
            print("%s batch %d: unconstrained %.3f ms/step (%d steps, %d tokens); constrained %.3f ms/step forward "
                  "(%d steps, %d tokens) + mask %.1f us/sequence, %.3f ms/step (%.1f%% of the forward)"
                  % (label, conc, fw0 * 1e3, steps0, tok0, fw * 1e3, steps, tok, mask * 1e6, per_step * 1e3,
                     100 * per_step / fw if fw > 0 else 0), flush=True)
    finally:
        krprocs.stop_all()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", default=os.path.join(here, "..", "models", "kjv-2l128-2k"))
    ap.add_argument("--spm")
    ap.add_argument("--requests", type=int, default=16)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kr-so-bench-")
    try:
        measure(a.bin, a.model, work, os.path.basename(os.path.normpath(a.model)), a.requests)
        if a.spm:
            m = spm_model(a.model, a.spm, os.path.join(work, "spm32k"))
            measure(a.bin, m, work, "32k sentencepiece vocabulary", a.requests)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if krprocs.failures:
        print("\n".join(krprocs.failures), file=sys.stderr)
        sys.exit(1)


main()
