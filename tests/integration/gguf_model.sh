#!/usr/bin/env bash
# gguf_model.sh - test of bench/gguf_model.py, the writer behind bench/vs-llama.cpp.sh: on a tiny
# shape, in f32 and bf16, it reads model.gguf back with a GGUF v3 reader of its own (below, not
# the writer's code) and checks the header, the alignment, the llama metadata against the config,
# the placeholder vocabulary, every tensor's name, dimensions, type and offset, that the file ends
# where the last tensor does, and that every tensor's bytes equal model.safetensors' (q/k rows
# mapped back from llama.cpp's interleaved rotary layout); that the f32 weights are the bf16
# weights widened; that two runs give the same bytes; and, when kvrelay-logits is built, that
# kvrelay loads the model and computes finite logits. It needs no llama.cpp: whether llama.cpp
# accepts the file is checked by running bench/vs-llama.cpp.sh (docs/performance.md).
# Run: ctest -R gguf_model, or KR_BIN=build KR_SRC=. bash tests/integration/gguf_model.sh
set -uo pipefail

src=${KR_SRC:?KR_SRC must be the source directory}
. "$src/tests/integration/lib.sh" # fail, kr_need_py, kr_skip
kr_need_py
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 4 query heads of 16, 2 KV heads: the q/k reordering moves rows; vocab 300 holds the 256 byte
# tokens and 41 others
cat >"$tmp/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
 "vocab_size": 300, "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-05,
 "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2}
EOF
for d in f32 bf16; do
  "$py" "$src/bench/gguf_model.py" --config "$tmp/config.json" --dtype "$d" --out "$tmp/$d" >"$tmp/$d.log" 2>&1 ||
    { cat "$tmp/$d.log"; fail "gguf_model.py --dtype $d exited non-zero"; }
done
"$py" "$src/bench/gguf_model.py" --config "$tmp/config.json" --dtype bf16 --out "$tmp/again" >/dev/null 2>&1 ||
  fail "second bf16 run failed"
for f in config.json model.safetensors model.gguf; do
  cmp -s "$tmp/bf16/$f" "$tmp/again/$f" || fail "$f differs between two runs"
done
ls "$tmp/bf16" | grep -q '\.tmp$' && fail "a temporary file was left behind"

"$py" - "$tmp" <<'PY' || fail "the GGUF / safetensors checks failed (above)"
import json, math, struct, sys

tmp = sys.argv[1]
cfg = json.load(open(tmp + "/config.json"))
bad = []

def check(ok, what):
    if not ok:
        bad.append(what)

class Reader:
    def __init__(self, data):
        self.b, self.p = data, 0
    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.b, self.p)
        self.p += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v
    def string(self):
        n = self.take("Q")
        s = self.b[self.p:self.p + n].decode("utf-8")
        self.p += n
        return s
    FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("I"), self.take("Q")
            return [self.value(et) for _ in range(n)]
        return self.take(self.FMT[t])

def read_gguf(path):
    data = open(path, "rb").read()
    r = Reader(data)
    check(data[:4] == b"GGUF", path + ": magic")
    r.p = 4
    version, n_t, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    check(version == 3, "%s: version %d" % (path, version))
    kv, types = {}, {}
    for _ in range(n_kv):
        k = r.string()
        t = r.take("I")
        check(k not in kv, "duplicate key " + k)
        kv[k], types[k] = r.value(t), t
    infos = []
    for _ in range(n_t):
        name = r.string()
        nd = r.take("I")
        dims = [r.take("Q") for _ in range(nd)]
        gtype, off = r.take("I"), r.take("Q")
        infos.append((name, dims, gtype, off))
    align = kv.get("general.alignment", 32)
    start = (r.p + align - 1) // align * align
    check(all(b == 0 for b in data[r.p:start]), path + ": padding before the data is not zeros")
    return data, kv, types, infos, start, align

def read_safetensors(path):
    data = open(path, "rb").read()
    n = struct.unpack_from("<Q", data)[0]
    hdr = json.loads(data[8:8 + n])
    check((8 + n) % 8 == 0, path + ": header not padded to 8")
    hdr.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in hdr.items()}, data, 8 + n

L, d, f, hd = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
H, KV, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
# GGUF name -> (Hugging Face name, [rows, cols] or [n])
expect = {"token_embd.weight": ("model.embed_tokens.weight", [V, d]),
          "output_norm.weight": ("model.norm.weight", [d]),
          "output.weight": ("lm_head.weight", [V, d])}
for l in range(L):
    g, h = "blk.%d." % l, "model.layers.%d." % l
    expect.update({
        g + "attn_norm.weight": (h + "input_layernorm.weight", [d]),
        g + "attn_q.weight": (h + "self_attn.q_proj.weight", [H * hd, d]),
        g + "attn_k.weight": (h + "self_attn.k_proj.weight", [KV * hd, d]),
        g + "attn_v.weight": (h + "self_attn.v_proj.weight", [KV * hd, d]),
        g + "attn_output.weight": (h + "self_attn.o_proj.weight", [d, H * hd]),
        g + "ffn_norm.weight": (h + "post_attention_layernorm.weight", [d]),
        g + "ffn_gate.weight": (h + "mlp.gate_proj.weight", [f, d]),
        g + "ffn_up.weight": (h + "mlp.up_proj.weight", [f, d]),
        g + "ffn_down.weight": (h + "mlp.down_proj.weight", [d, f])})

weights = {}
for dt, gtype_m, st_m, esz in (("f32", 0, "F32", 4), ("bf16", 30, "BF16", 2)):
    data, kv, types, infos, start, align = read_gguf("%s/%s/model.gguf" % (tmp, dt))
    st, _, _ = read_safetensors("%s/%s/model.safetensors" % (tmp, dt))
    hf_cfg = json.load(open("%s/%s/config.json" % (tmp, dt)))
    check(hf_cfg["torch_dtype"] == {"f32": "float32", "bf16": "bfloat16"}[dt], dt + ": torch_dtype")
    want = {"general.architecture": "llama", "llama.embedding_length": d, "llama.block_count": L,
            "llama.feed_forward_length": f, "llama.attention.head_count": H,
            "llama.attention.head_count_kv": KV, "llama.rope.dimension_count": hd,
            "llama.context_length": cfg["max_position_embeddings"], "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "general.file_type": {"f32": 0, "bf16": 32}[dt]}
    for k, v in want.items():
        check(kv.get(k) == v, "%s: %s is %r, not %r" % (dt, k, kv.get(k), v))
    check(abs(kv["llama.attention.layer_norm_rms_epsilon"] - 1e-5) < 1e-9, dt + ": rms eps")
    check(kv["llama.rope.freq_base"] == 10000.0, dt + ": rope base")
    check(types["llama.block_count"] == 4, dt + ": block_count is not a uint32")
    toks = kv["tokenizer.ggml.tokens"]
    check(len(toks) == V and len(kv["tokenizer.ggml.scores"]) == V and
          len(kv["tokenizer.ggml.token_type"]) == V, dt + ": vocabulary arrays are not vocab_size long")
    check(len(set(toks)) == V, dt + ": duplicate tokens")
    check(toks[:3] == ["<unk>", "<s>", "</s>"] and toks[3 + 10] == "<0x0A>", dt + ": special / byte tokens")
    check(kv["tokenizer.ggml.token_type"][3:259] == [6] * 256, dt + ": byte token types")

    names = [i[0] for i in infos]
    check(sorted(names) == sorted(expect), dt + ": tensor names %s" % sorted(set(names) ^ set(expect)))
    check(len(names) == len(set(names)), dt + ": duplicate tensor names")
    end = 0
    for name, dims, gtype, off in infos:
        if name not in expect:
            continue
        hf, shape = expect[name]
        norm = len(shape) == 1
        esize = 4 if norm else esz
        check(off % align == 0, "%s %s: offset %d not aligned" % (dt, name, off))
        check(dims == list(reversed(shape)), "%s %s: dims %s, want %s reversed" % (dt, name, dims, shape))
        check(gtype == (0 if norm else gtype_m), "%s %s: ggml type %d" % (dt, name, gtype))
        nbytes = esize
        for x in shape:
            nbytes *= x
        g = data[start + off:start + off + nbytes]
        end = max(end, off + nbytes)
        sdt, sshape, s = st[hf]
        check(sshape == shape and sdt == ("F32" if norm else st_m), "%s %s: safetensors %s %s" % (dt, hf, sdt, sshape))
        check(len(g) == nbytes == len(s), "%s %s: %d bytes in GGUF, %d in safetensors, %d wanted" % (dt, name, len(g), len(s), nbytes))
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            # GGUF row h*hd + 2i + j holds Hugging Face row h*hd + i + j*hd/2
            rb = shape[1] * esize
            back = bytearray(nbytes)
            for row in range(shape[0]):
                h, rest = divmod(row, hd)
                i, j = divmod(rest, 2)
                src = h * hd + i + j * (hd // 2)
                back[src * rb:(src + 1) * rb] = g[row * rb:(row + 1) * rb]
            check(back == s, "%s %s: rows are not safetensors' rows reordered" % (dt, name))
            check(g != s, "%s %s: rows were not reordered" % (dt, name))
        else:
            check(g == s, "%s %s: bytes differ from safetensors" % (dt, name))
        if norm:
            check(set(struct.unpack("<%df" % shape[0], g)) == {1.0}, "%s %s: norm weights not 1.0" % (dt, name))
        weights[(dt, hf)] = s
    check(len(data) == (start + end + align - 1) // align * align, "%s: file is %d bytes, data ends at %d" % (dt, len(data), start + end))

# f32 = bf16 widened: every f32 is the bf16 value with two zero low bytes, and finite, not tiny
for (dt, hf), s in weights.items():
    if dt != "bf16" or hf.endswith("norm.weight"):
        continue
    b16 = struct.unpack("<%dH" % (len(s) // 2), s)
    f32 = struct.unpack("<%dI" % (len(s) // 2), weights[("f32", hf)])
    check(all(a == (b << 16) for a, b in zip(f32, b16)), "f32 %s is not bf16 %s widened" % (hf, hf))
    vals = struct.unpack("<%df" % len(b16), weights[("f32", hf)])
    check(all(math.isfinite(x) and 2 ** -7 <= abs(x) < 2 ** -5 for x in vals), hf + ": values out of range")
    # a bf16 of this range takes one of 512 values; a random tensor shows most of them
    check(len(set(vals)) > min(len(vals) // 4, 400), hf + ": values not random")

for b in bad:
    print("FAIL:", b)
sys.exit(1 if bad else 0)
PY

# kvrelay loads the safetensors half and computes finite logits. On the avx512bf16 kernels a bf16
# model's matmuls round their inputs to bf16 (docs/engine.md, "Numerics"), so both dtypes run
# the avx512 ones, which compute what the f32 model does: the logits then say whether the two
# files hold the same values (a CPU without AVX-512 refuses the variant and runs its best, also
# exact)
if [ -x "${KR_BIN:-}/kvrelay-logits" ]; then
  for d in f32 bf16; do
    KR_CPU_ISA=avx512 "$KR_BIN/kvrelay-logits" --model "$tmp/$d" --ids "1 5 9 200" --out "$tmp/$d.logits" --threads 1 \
      >"$tmp/$d.klog" 2>&1 || { cat "$tmp/$d.klog"; fail "kvrelay-logits on the $d model failed"; continue; }
    "$py" -c 'import math, struct, sys
b = open(sys.argv[1], "rb").read()
v = struct.unpack("<%df" % (len(b) // 4), b)
sys.exit(0 if len(v) == 4 * 300 and all(math.isfinite(x) for x in v) else 1)' "$tmp/$d.logits" ||
      fail "kvrelay-logits on the $d model: not 4 x 300 finite logits"
  done
  # same values in both dtypes: the logits agree to float rounding
  "$py" -c 'import struct, sys
a, b = (struct.unpack("<1200f", open(p, "rb").read()) for p in sys.argv[1:3])
sys.exit(0 if max(abs(x - y) for x, y in zip(a, b)) < 1e-3 else 1)' "$tmp/f32.logits" "$tmp/bf16.logits" ||
    fail "f32 and bf16 models give different logits"
else
  echo "note: ${KR_BIN:-KR_BIN}/kvrelay-logits is not built; the kvrelay load check is skipped"
fi

# the bench script refuses to run without a llama.cpp build and says how to make one
out=$(bash "$src/bench/vs-llama.cpp.sh" --llama-cpp "$tmp/none" 2>&1)
[ $? -eq 2 ] || fail "vs-llama.cpp.sh without a llama.cpp build did not exit 2"
grep -q 'cmake --build llama.cpp/build -j --target llama-bench' <<<"$out" || fail "vs-llama.cpp.sh does not say how to build llama-bench: $out"
bash "$src/bench/vs-llama.cpp.sh" --help | grep -q 'DGGML_NATIVE=ON' || fail "vs-llama.cpp.sh --help lacks the build command"

[ "$fails" -eq 0 ] && echo "PASS: gguf_model" || exit 1
