#!/usr/bin/python3
"""gguf_model.py - one random-weight Llama model written twice: as a kvrelay (Hugging Face)
model directory (config.json + model.safetensors) and as a GGUF v3 file for llama.cpp, with the
same weight values in both, so that bench/vs-llama.cpp.sh times the two engines on one model.

What it is not: a converter of real checkpoints (llama.cpp's convert_hf_to_gguf.py is), nor a
general GGUF library. It writes the llama architecture only, weights in f32 or bf16, and a
placeholder SentencePiece-style vocabulary (<unk>, <s>, </s>, the 256 byte tokens, then "tok<N>")
that lets llama.cpp load the model and nothing more: the text it would produce means nothing.
Standard library only.

    /usr/bin/python3 bench/gguf_model.py --config tools/data/llama-110m.json --dtype bf16 --out DIR

writes DIR/config.json, DIR/model.safetensors, DIR/model.gguf. The same config, dtype and seed
give byte-identical files.

Weights: every matrix element is a bf16 value with a random sign and mantissa and an exponent of
2^-7 or 2^-6 (magnitudes 0.0078 to 0.031: no zeros, denormals, infinities or NaNs, whose timing
could differ); norm weights are 1.0. The f32 model holds exactly the bf16 model's values widened,
so the two dtypes compute the same function too. Norm weights are f32 in both files and both
dtypes (llama.cpp keeps 1-D tensors f32; kvrelay converts them to f32 at load anyway).

Layouts. safetensors keeps Hugging Face's [out, in] row-major matrices. GGUF lists dimensions
fastest-first, so the same bytes carry the dimensions reversed. q_proj and k_proj rows are
reordered per head for GGUF: Hugging Face's rotary embedding pairs element i of a head with
element i + head_dim/2, llama.cpp's llama architecture pairs 2i with 2i + 1, and moving row
i + j*head_dim/2 of each head to row 2i + j makes the two compute the same attention.

GGUF v3 as written here (all little-endian): "GGUF", u32 version 3, u64 tensor count, u64
metadata count; each metadata entry is a string key (u64 length + UTF-8 bytes), a u32 value type
and the value (an array is a u32 element type, a u64 count and the elements); each tensor info is
a string name, u32 dimension count, u64 dimensions, u32 ggml type, u64 offset from the start of
the data section; the data section starts at the next multiple of general.alignment (32) and
each tensor's data is padded to that alignment.
"""
import argparse
import json
import os
import random
import struct
import sys

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

# GGUF metadata value types
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)
# ggml tensor types used here
GGML_F32, GGML_BF16 = 0, 30
# llama.cpp's general.file_type values: all f32, mostly bf16
FILE_TYPE = {"f32": 0, "bf16": 32}

# SentencePiece token types as llama.cpp reads them
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_BYTE = 1, 2, 3, 6

SCALAR = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I",
          T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q",
          T_FLOAT64: "<d"}


def gguf_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype, value):
    """The bytes of one metadata value of type vtype (without the type tag); arrays are
    (element type, list)."""
    if vtype == T_STRING:
        return gguf_string(value)
    if vtype == T_ARRAY:
        etype, items = value
        head = struct.pack("<IQ", etype, len(items))
        if etype == T_STRING:
            return head + b"".join(gguf_string(s) for s in items)
        return head + struct.pack("<%d%s" % (len(items), SCALAR[etype][1]), *items)
    return struct.pack(SCALAR[vtype], value)


class Shape:
    """The model's shape, from a Hugging Face config.json."""

    def __init__(self, cfg, vocab=None):
        self.hidden = int(cfg["hidden_size"])
        self.inter = int(cfg["intermediate_size"])
        self.layers = int(cfg["num_hidden_layers"])
        self.heads = int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads", self.heads))
        self.head_dim = int(cfg.get("head_dim") or self.hidden // self.heads)
        self.vocab = int(vocab or cfg["vocab_size"])
        self.ctx = int(cfg.get("max_position_embeddings", 4096))
        self.rope_theta = float(cfg.get("rope_theta", 10000.0))
        self.eps = float(cfg.get("rms_norm_eps", 1e-5))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if cfg.get("rope_scaling"):
            raise SystemExit("gguf_model.py: rope_scaling is not written to GGUF; use a config without it")
        if self.head_dim % 2 or self.heads % self.kv_heads:
            raise SystemExit("gguf_model.py: head_dim must be even and kv heads must divide heads")


def tensors(shape):
    """[(hf_name, gguf_name, [rows, cols] or [n], kind)] in file order; kind is 'matrix',
    'norm', or 'q'/'k' (matrices whose rows GGUF reorders per head)."""
    d, f, hd = shape.hidden, shape.inter, shape.head_dim
    q, kv = shape.heads * hd, shape.kv_heads * hd
    out = [("model.embed_tokens.weight", "token_embd.weight", [shape.vocab, d], "matrix")]
    for l in range(shape.layers):
        hf, gg = "model.layers.%d." % l, "blk.%d." % l
        out += [
            (hf + "input_layernorm.weight", gg + "attn_norm.weight", [d], "norm"),
            (hf + "self_attn.q_proj.weight", gg + "attn_q.weight", [q, d], "q"),
            (hf + "self_attn.k_proj.weight", gg + "attn_k.weight", [kv, d], "k"),
            (hf + "self_attn.v_proj.weight", gg + "attn_v.weight", [kv, d], "matrix"),
            (hf + "self_attn.o_proj.weight", gg + "attn_output.weight", [d, q], "matrix"),
            (hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", [d], "norm"),
            (hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", [f, d], "matrix"),
            (hf + "mlp.up_proj.weight", gg + "ffn_up.weight", [f, d], "matrix"),
            (hf + "mlp.down_proj.weight", gg + "ffn_down.weight", [d, f], "matrix"),
        ]
    out.append(("model.norm.weight", "output_norm.weight", [d], "norm"))
    if not shape.tied:
        out.append(("lm_head.weight", "output.weight", [shape.vocab, d], "matrix"))
    return out


def n_elems(dims):
    n = 1
    for x in dims:
        n *= x
    return n


# bf16's high byte is the sign and the top 7 exponent bits: keep the sign, force the exponent
# bits to 0111100x so the biased exponent is 120 or 121 (the low byte's top bit picks which)
HIGH_BYTE = bytes((b & 0x80) | 0x3C for b in range(256))


def random_bf16(rng, n):
    """n random bf16 values (2n bytes, little-endian) as described in the file's comment."""
    buf = bytearray(2 * n)
    buf[0::2] = rng.randbytes(n)
    buf[1::2] = rng.randbytes(n).translate(HIGH_BYTE)
    return buf


def bf16_to_f32(b16):
    """bf16 bytes widened exactly to f32 bytes (the bf16 is the f32's high half)."""
    n = len(b16) // 2
    out = bytearray(4 * n)
    out[2::4] = b16[0::2]
    out[3::4] = b16[1::2]
    return out


def permute_rope_rows(data, rows, row_bytes, head_dim):
    """Rows reordered per head from Hugging Face's half-split rotary layout to llama.cpp's
    interleaved one: the new row 2i + j of a head is the old row i + j*head_dim/2."""
    half = head_dim // 2
    out = bytearray(len(data))
    for h in range(rows // head_dim):
        base = h * head_dim
        for i in range(half):
            for j in range(2):
                src = (base + i + j * half) * row_bytes
                dst = (base + 2 * i + j) * row_bytes
                out[dst:dst + row_bytes] = data[src:src + row_bytes]
    return out


def vocabulary(n):
    """A placeholder SentencePiece vocabulary of n tokens: (tokens, scores, types)."""
    toks = ["<unk>", "<s>", "</s>"]
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL]
    if n >= 3 + 256:
        toks += ["<0x%02X>" % b for b in range(256)]
        types += [TOKEN_BYTE] * 256
    toks = toks[:n]
    types = types[:n]
    while len(toks) < n:
        toks.append("tok%d" % len(toks))
        types.append(TOKEN_NORMAL)
    scores = [0.0 if t != TOKEN_NORMAL else -float(i) for i, t in enumerate(types)]
    return toks, scores, types


def metadata(shape, dtype, name):
    toks, scores, types = vocabulary(shape.vocab)
    u32 = T_UINT32
    return [
        ("general.architecture", T_STRING, "llama"),
        ("general.name", T_STRING, name),
        ("general.alignment", u32, ALIGNMENT),
        ("general.file_type", u32, FILE_TYPE[dtype]),
        ("llama.context_length", u32, shape.ctx),
        ("llama.embedding_length", u32, shape.hidden),
        ("llama.block_count", u32, shape.layers),
        ("llama.feed_forward_length", u32, shape.inter),
        ("llama.attention.head_count", u32, shape.heads),
        ("llama.attention.head_count_kv", u32, shape.kv_heads),
        ("llama.attention.key_length", u32, shape.head_dim),
        ("llama.attention.value_length", u32, shape.head_dim),
        ("llama.rope.dimension_count", u32, shape.head_dim),
        ("llama.rope.freq_base", T_FLOAT32, shape.rope_theta),
        ("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, shape.eps),
        ("llama.vocab_size", u32, shape.vocab),
        ("tokenizer.ggml.model", T_STRING, "llama"),
        ("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, toks)),
        ("tokenizer.ggml.scores", T_ARRAY, (T_FLOAT32, scores)),
        ("tokenizer.ggml.token_type", T_ARRAY, (T_INT32, types)),
        ("tokenizer.ggml.unknown_token_id", u32, 0),
        ("tokenizer.ggml.bos_token_id", u32, 1),
        ("tokenizer.ggml.eos_token_id", u32, 2),
        ("tokenizer.ggml.add_bos_token", T_BOOL, True),
        ("tokenizer.ggml.add_eos_token", T_BOOL, False),
    ]


def pad_to(n, a):
    return (n + a - 1) // a * a


def write_model(cfg, dtype, out_dir, seed=1, vocab=None, name="kvrelay-random"):
    shape = Shape(cfg, vocab)
    specs = tensors(shape)
    esize = {"f32": 4, "bf16": 2}[dtype]
    sizes = [n_elems(dims) * (4 if kind == "norm" else esize) for _, _, dims, kind in specs]

    # safetensors header: offsets into the data that follows it, padded to 8 bytes with spaces
    st_meta = {"__metadata__": {"format": "pt"}}
    off = 0
    for (hf, _, dims, kind), size in zip(specs, sizes):
        st_dtype = "F32" if kind == "norm" or dtype == "f32" else "BF16"
        st_meta[hf] = {"dtype": st_dtype, "shape": dims, "data_offsets": [off, off + size]}
        off += size
    st_header = json.dumps(st_meta, separators=(",", ":")).encode()
    st_header += b" " * (pad_to(len(st_header), 8) - len(st_header))

    # GGUF header, metadata and tensor infos; offsets relative to the aligned data section
    kvs = metadata(shape, dtype, name)
    gg = bytearray(GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(specs), len(kvs)))
    for key, vtype, value in kvs:
        gg += gguf_string(key) + struct.pack("<I", vtype) + gguf_value(vtype, value)
    off = 0
    for (_, gname, dims, kind), size in zip(specs, sizes):
        gtype = GGML_F32 if kind == "norm" or dtype == "f32" else GGML_BF16
        gg += gguf_string(gname) + struct.pack("<I", len(dims))
        gg += struct.pack("<%dQ" % len(dims), *reversed(dims))
        gg += struct.pack("<IQ", gtype, off)
        off = pad_to(off + size, ALIGNMENT)
    gg += b"\0" * (pad_to(len(gg), ALIGNMENT) - len(gg))

    os.makedirs(out_dir, exist_ok=True)
    hf_cfg = dict(cfg)
    hf_cfg["vocab_size"] = shape.vocab
    hf_cfg["torch_dtype"] = "float32" if dtype == "f32" else "bfloat16"
    paths = {k: os.path.join(out_dir, k) for k in ("config.json", "model.safetensors", "model.gguf")}
    tmp = {k: p + ".tmp" for k, p in paths.items()}
    with open(tmp["config.json"], "w") as f:
        json.dump(hf_cfg, f, indent=2)
        f.write("\n")
    rng = random.Random(seed)
    one_f32 = struct.pack("<f", 1.0)
    with open(tmp["model.safetensors"], "wb") as st, open(tmp["model.gguf"], "wb") as gf:
        st.write(struct.pack("<Q", len(st_header)) + st_header)
        gf.write(gg)
        for (_, _, dims, kind), size in zip(specs, sizes):
            if kind == "norm":
                data = one_f32 * dims[0]
            else:
                data = random_bf16(rng, n_elems(dims))
                if dtype == "f32":
                    data = bf16_to_f32(data)
            st.write(data)
            if kind in ("q", "k"):
                data = permute_rope_rows(data, dims[0], dims[1] * esize, shape.head_dim)
            gf.write(data)
            gf.write(b"\0" * (pad_to(size, ALIGNMENT) - size))
    for k in paths:
        os.replace(tmp[k], paths[k])
    return paths


def main():
    ap = argparse.ArgumentParser(
        description="Write one random-weight Llama model as config.json + model.safetensors "
        "(kvrelay) and model.gguf (llama.cpp) with the same weights.")
    ap.add_argument("--config", required=True, help="a Hugging Face config.json (the shape)")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="bf16", help="matrix dtype (bf16)")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random weights (1)")
    ap.add_argument("--vocab", type=int, help="vocabulary size instead of the config's")
    a = ap.parse_args()
    try:
        with open(a.config) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit("gguf_model.py: --config %s: %s" % (a.config, e))
    if a.vocab is not None and a.vocab < 3:
        sys.exit("gguf_model.py: --vocab must be at least 3 (<unk>, <s>, </s>)")
    paths = write_model(cfg, a.dtype, a.out, a.seed, a.vocab)
    for p in paths.values():
        print("%s %d bytes" % (p, os.path.getsize(p)))


if __name__ == "__main__":
    main()
