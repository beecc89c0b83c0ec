"""openai_logprobs.py - the checks of openai_logprobs.sh: log-probabilities and echo over HTTP
against the gRPC API and kvrelay-logits, through one kvrelay-prefill (--chunk 16, one thread),
one kvrelay-decode and one kvrelay-router on the bundled kjv-2l128-2k model.

Checked:
  - completions with logprobs N (non-streamed and streamed): token_logprobs, read back as
    float32, equal the gRPC stream's TokenDelta.logprobs for the same greedy request bit for bit
    (and for a seeded sampled one);
    top_logprobs hold N alternatives whose values are the gRPC alternatives' (TokenDelta
    .top_logprobs), most probable first with the greedy token first; text_offset counts bytes
    of the text; the streamed chunks carry the same values as the whole answer;
  - chat with logprobs and top_logprobs (both ways): content[i].logprob equals gRPC's for the
    prompt /tokenize renders, each entry's bytes spell its token, top_logprobs has the asked
    length; chat's logprobs without top_logprobs gives empty lists;
  - echo with logprobs and max_tokens 0 (a string prompt, and token ids as lm-evaluation-harness
    sends them): the prompt's tokens, the first one's logprob and top_logprobs null, every other
    equal bit for bit to log-softmax of kvrelay-logits' row (same ids, --chunk 16, --threads 1)
    computed as kr_logprob computes it, and to gRPC's prompt_logprobs; no completion tokens;
    the prompt spans several chunks; lm-evaluation-harness's current request (max_tokens 1, a list
    of one id prompt, seed) read as its parse_logprobs reads it: the continuation's scores and
    its is_greedy;
  - the same under an evicting policy (streaming, window 16): finite values <= 0, and after the
    window at least one differs from full's;
  - echo without logprobs prepends the prompt; echo with logprobs and max_tokens 4 has the
    prompt's tokens then 4 generated ones whose logprobs equal the non-echo request's;
  - 2 prompts x n 2 with echo and logprobs 2 (streamed and not): every choice's text, scores,
    alternatives and offsets are its own prompt's, equal to that prompt alone with seed + j;
  - the official openai npm package (tests/integration/openai/logprobs.cjs, when ./kvrelay test
    installed it) gets the same values: completions' logprobs 3 streamed and not, echo with
    max_tokens 0, chat's logprobs with top_logprobs 2 streamed and not;
  - refusals: logprobs 21, -1, "x" (param logprobs); chat top_logprobs without logprobs or 21
    (top_logprobs); echo on chat (echo); max_tokens 0 without echo (max_tokens); gRPC
    top_logprobs 21 and max_tokens 0 without prompt_logprobs are INVALID_ARGUMENT.
Run through openai_logprobs.sh (it generates the stubs); every process is killed at the end.
"""
import json
import math
import os
import shutil
import struct
import subprocess

import krprocs  # beside this script: Python puts its directory on sys.path

args = krprocs.parse_args()

import grpc  # noqa: E402
from kvrelay.v1 import kvrelay_pb2 as pb  # noqa: E402
from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc  # noqa: E402
from krprocs import check, post  # noqa: E402

NAME = "kjv-lp"
CHUNK = 16
PROMPT = ("And God said, Let there be light: and there was light. And God saw the light, that it was good: and "
          "God divided the light from the darkness. And God called the light Day, and the darkness he called "
          "Night. And the evening and the morning were the first day. And God said, Let there be a firmament in "
          "the midst of the waters")
POLICY = "streaming:sink=4,window=16"


def f32(x):
    """x rounded to float32 (None stays None): what the node's float was, if x came from it."""
    return None if x is None else struct.unpack("<f", struct.pack("<f", x))[0]


def same(a, b):
    """Bit-equal float32 values (NaN never equal)."""
    return a is not None and b is not None and a == a and b == b and struct.pack("<f", a) == struct.pack("<f", b)


def sse(raw):
    lines = [ln[6:] for ln in raw.split("\n") if ln.startswith("data: ")]
    check(lines and lines[-1] == "[DONE]", "a stream that does not end with [DONE]: %r" % raw[-200:])
    return [json.loads(x) for x in lines[:-1] if x != "[DONE]"]


def refused(api, path, body, param, what):
    status, doc = post(api, path, body)
    err = doc.get("error", {}) if isinstance(doc, dict) else {}
    check(status == 400 and err.get("param") == param, "%s: want 400 naming %s, got %d %s" % (what, param, status, doc))


def logprob_of(row, tid):
    """kr_logprob: log-sum-exp with the row's max subtracted, summed in order in double."""
    mx = max(row)
    s = 0.0
    for v in row:
        s += math.exp(v - mx)
    return f32((row[tid] - mx) - math.log(s))


def logits_rows(model, ids, vocab):
    out = os.path.join(args.work, "logits.bin")
    subprocess.run([os.path.join(args.bin, "kvrelay-logits"), "--model", model, "--ids", " ".join(map(str, ids)),
                    "--out", out, "--chunk", str(CHUNK), "--threads", "1"], check=True, capture_output=True,
                   timeout=300)
    raw = open(out, "rb").read()
    check(len(raw) == 4 * vocab * len(ids), "kvrelay-logits wrote %d bytes for %d rows" % (len(raw), len(ids)))
    flat = struct.unpack("<%df" % (len(raw) // 4), raw)
    return [flat[i * vocab:(i + 1) * vocab] for i in range(len(ids))]


def main():
    b = args.bin
    model = args.model
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    _, _, nodes = krprocs.start_nodes(args, prefill_args=("--chunk", str(CHUNK)))
    router, http = krprocs.start(args.work, "router", [b + "/kvrelay-router", "--model", model, "--nodes", nodes,
                                                       "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                                       "--served-model-name", NAME])
    base = "http://" + http
    api = base + "/v1"
    gen = pb_grpc.GenerationStub(grpc.insecure_channel(router))
    _, tk = post(base, "/tokenize", {"prompt": PROMPT})
    ids = tk["tokens"]
    check(len(ids) > 2 * CHUNK, "the prompt should span several %d-token chunks: %d ids" % (CHUNK, len(ids)))

    def grpc_run(prompt_ids, sampling=None, **kw):
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling or pb.Sampling(), **kw)
        r = {"ids": [], "lps": [], "alts": [], "prompt": [], "prompt_alts": [], "finish": None, "deltas": 0}
        for msg in gen.Generate(req, timeout=300):
            if msg.WhichOneof("event") == "delta":
                d = msg.delta
                r["deltas"] += 1
                r["ids"].extend(d.ids)
                r["lps"].extend(d.logprobs)
                r["alts"].extend([(list(a.ids), list(a.logprobs)) for a in d.top_logprobs])
                r["prompt"].extend(d.prompt_logprobs)
                r["prompt_alts"].extend([(list(a.ids), list(a.logprobs)) for a in d.prompt_top_logprobs])
            else:
                r["finish"] = msg.finish
        return r

    def completion(**kw):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        body.update(kw)
        status, doc = post(api, "/completions", body)
        check(status == 200, "completions %s: %d %s" % (kw, status, doc))
        return doc["choices"][0] if status == 200 else {"text": "", "logprobs": None}

    # ---------------------------------------------------------------- completions' logprobs
    g = grpc_run(ids, max_tokens=8, logprobs=True, top_logprobs=5)
    check(len(g["ids"]) == 8 and len(g["lps"]) == 8 and len(g["alts"]) == 8, "gRPC logprobs: %s" % g)
    for i, (aids, alps) in enumerate(g["alts"]):
        check(len(aids) == 5 and aids[0] == g["ids"][i] and same(alps[0], g["lps"][i]),
              "gRPC greedy token %d should be its first alternative: %s %s" % (i, aids, alps))
        check(all(alps[k] >= alps[k + 1] for k in range(4)), "alternatives not sorted: %s" % alps)
    c = completion(logprobs=5)
    lp = c["logprobs"] or {}
    check(len(lp.get("tokens", [])) == 8 and len(lp.get("token_logprobs", [])) == 8, "logprobs object: %s" % lp)
    for i, v in enumerate(lp.get("token_logprobs", [])):
        check(same(f32(v), g["lps"][i]), "token %d: HTTP logprob %r != gRPC %r" % (i, v, g["lps"][i]))
        tops = lp["top_logprobs"][i]
        check(len(tops) == 5 and sorted(f32(x) for x in tops.values()) == sorted(g["alts"][i][1]),
              "token %d: top_logprobs %s != gRPC's %s" % (i, tops, g["alts"][i][1]))
    text = c["text"].encode()
    offs = lp.get("text_offset", [])
    check(offs and offs[0] == 0 and all(offs[k] <= offs[k + 1] for k in range(len(offs) - 1)) and offs[-1] < len(text),
          "text_offset %s for a %d-byte text" % (offs, len(text)))
    for k, tok in enumerate(lp.get("tokens", [])):
        check(text[offs[k]:].startswith(tok.encode()) or tok.startswith("bytes:"),
              "token %d %r is not at its offset %d of %r" % (k, tok, offs[k], text))
    # streamed: the chunks carry the same values
    status, raw = post(api, "/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                             "logprobs": 5, "stream": True}, raw=True)
    got = []
    for ev in sse(raw) if status == 200 else []:
        for ch in ev.get("choices", []):
            if ch.get("logprobs"):
                got.extend(ch["logprobs"]["token_logprobs"])
    check(status == 200 and len(got) == 8 and all(same(f32(a), b2) for a, b2 in zip(got, g["lps"])),
          "streamed logprobs %s != gRPC %s" % (got, g["lps"]))

    # a seeded sampled request: the same tokens, so the same values as gRPC's
    gs = grpc_run(ids, sampling=pb.Sampling(temperature=0.8, seed=7), max_tokens=8, logprobs=True, top_logprobs=2)
    c = completion(logprobs=2, temperature=0.8, seed=7)
    tl = (c["logprobs"] or {}).get("token_logprobs", [])
    check(len(tl) == 8 and all(same(f32(a), b2) for a, b2 in zip(tl, gs["lps"])),
          "seeded sampled logprobs %s != gRPC %s" % (tl, gs["lps"]))

    # ---------------------------------------------------------------- chat
    msgs = [{"role": "user", "content": "In the beginning"}]
    _, ct = post(base, "/tokenize", {"messages": msgs})
    gc = grpc_run(ct["tokens"], max_tokens=6, logprobs=True, top_logprobs=3)
    status, d = post(api, "/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 6, "temperature": 0,
                                                "logprobs": True, "top_logprobs": 3})
    content = d["choices"][0]["logprobs"]["content"] if status == 200 else []
    check(status == 200 and len(content) == len(gc["lps"]) == 6, "chat logprobs: %d %s" % (status, d))
    for i, e in enumerate(content):
        check(same(f32(e["logprob"]), gc["lps"][i]), "chat token %d: %r != gRPC %r" % (i, e["logprob"], gc["lps"][i]))
        check(bytes(e["bytes"]).decode(errors="replace") == e["token"] or e["token"].startswith("bytes:"),
              "chat token %d: bytes %s do not spell %r" % (i, e["bytes"], e["token"]))
        check(len(e["top_logprobs"]) == 3 and same(f32(e["top_logprobs"][0]["logprob"]), gc["alts"][i][1][0]),
              "chat token %d alternatives %s" % (i, e["top_logprobs"]))
    status, raw = post(api, "/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": 6, "temperature": 0,
                                                  "logprobs": True, "stream": True}, raw=True)
    got = []
    for ev in sse(raw) if status == 200 else []:
        for ch in ev.get("choices", []):
            for e in (ch.get("logprobs") or {}).get("content", []):
                got.append(e["logprob"])
                check(e["top_logprobs"] == [], "chat without top_logprobs: %s" % e)
    check(len(got) == 6 and all(same(f32(a), b2) for a, b2 in zip(got, gc["lps"])),
          "streamed chat logprobs %s != gRPC %s" % (got, gc["lps"]))

    # ---------------------------------------------------------------- echo: the prompt's scores
    rows = logits_rows(model, ids, vocab)
    want = [None] + [logprob_of(rows[i], ids[i + 1]) for i in range(len(ids) - 1)]
    for prompt in (PROMPT, ids):
        c = completion(prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        lp = c["logprobs"] or {}
        tl = lp.get("token_logprobs", [])
        check(len(tl) == len(ids) and tl[0] is None and lp["top_logprobs"][0] is None,
              "echo max_tokens 0: %d token_logprobs for %d ids, first %r" % (len(tl), len(ids), tl[:1]))
        bad = [i for i in range(1, min(len(tl), len(ids))) if not same(f32(tl[i]), want[i])]
        check(not bad, "echo scores differ from kvrelay-logits at %s: %s vs %s" % (bad[:5], [tl[i] for i in bad[:5]],
                                                                                [want[i] for i in bad[:5]]))
        check(c["text"] == PROMPT and c["finish_reason"] == "length", "echo text %r" % c["text"])
        for i in range(1, min(len(tl), len(ids))):
            top = lp["top_logprobs"][i]
            check(len(top) == 1 and f32(max(top.values())) >= f32(tl[i]), "echo top_logprobs %d: %s" % (i, top))
    g0 = grpc_run(ids, max_tokens=0, prompt_logprobs=True)
    check(g0["ids"] == [] and len(g0["prompt"]) == len(ids) - 1 and g0["finish"] is not None and
          g0["finish"].usage.completion_tokens == 0 and g0["finish"].reason == pb.FINISH_REASON_LENGTH,
          "gRPC scored-only request: %s" % g0)
    check(all(same(g0["prompt"][i - 1], want[i]) for i in range(1, len(ids))), "gRPC prompt_logprobs != kvrelay-logits")
    # the whole request as lm-evaluation-harness sends it: a prompt of ids, its usage
    status, d = post(api, "/completions", {"model": NAME, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
                                           "temperature": 0, "seed": 1234})
    check(status == 200 and d["usage"]["completion_tokens"] == 0 and d["usage"]["prompt_tokens"] == len(ids),
          "lm-eval request: %d %s" % (status, d))
    # lm-evaluation-harness's current local-completions loglikelihood request (its _create_payload
    # and parse_logprobs: max_tokens 1, the continuation's scores token_logprobs[ctxlen:-1], greedy
    # when each equals its top_logprobs' max)
    ctxlen = len(ids) // 2
    status, d = post(api, "/completions", {"model": NAME, "prompt": [ids], "temperature": 0, "max_tokens": 1,
                                           "logprobs": 1, "seed": 1234, "echo": True})
    lp = d["choices"][0]["logprobs"] if status == 200 else {"token_logprobs": [], "top_logprobs": []}
    cont, tops = lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]
    greedy = all(t == max(top.values()) for t, top in zip(cont, tops))
    want_greedy = all(rows[i - 1].index(max(rows[i - 1])) == ids[i] for i in range(ctxlen, len(ids)))
    check(status == 200 and len(lp["token_logprobs"]) == len(ids) + 1 and
          all(same(f32(a), w) for a, w in zip(cont, want[ctxlen:])) and greedy == want_greedy,
          "lm-eval's request: %d, continuation %s, greedy %s (want %s)" % (status, cont[:4], greedy, want_greedy))
    # under an evicting policy: the policy's chunked prefill's own scores
    c = completion(max_tokens=0, echo=True, logprobs=1, kv_policy=POLICY)
    tl = (c["logprobs"] or {}).get("token_logprobs", [])
    check(len(tl) == len(ids) and tl[0] is None and all(x is not None and math.isfinite(x) and x <= 0 for x in tl[1:]),
          "echo under %s: %s" % (POLICY, tl))
    check(any(not same(f32(tl[i]), want[i]) for i in range(2 * CHUNK, len(tl))),
          "echo under %s equals full's everywhere past the window" % POLICY)
    # streamed echo: the first chunk has the prompt and its scores
    status, raw = post(api, "/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 0, "echo": True,
                                             "logprobs": 1, "stream": True}, raw=True)
    evs = sse(raw) if status == 200 else []
    first = evs[0]["choices"][0] if evs else {}
    tl = (first.get("logprobs") or {}).get("token_logprobs", [])
    check(first.get("text") == PROMPT and len(tl) == len(ids) and all(same(f32(tl[i]), want[i]) for i in range(1, len(ids))),
          "streamed echo's first chunk: %s" % first)
    # echo without logprobs, and echo + logprobs + generated tokens
    c = completion(echo=True, max_tokens=4)
    plain = completion(max_tokens=4, logprobs=0)
    check(c["text"] == PROMPT + plain["text"] and c["logprobs"] is None, "echo text %r" % c["text"])
    c = completion(echo=True, max_tokens=4, logprobs=0)
    lp = c["logprobs"] or {}
    tl = lp.get("token_logprobs", [])
    check(len(tl) == len(ids) + 4 and all(same(f32(tl[len(ids) + k]), f32(plain["logprobs"]["token_logprobs"][k]))
                                          for k in range(4)), "echo + 4 tokens: %s" % tl)
    check(lp.get("text_offset", [None] * (len(ids) + 1))[len(ids)] == len(PROMPT.encode()) and
          all(t == {} for t in lp.get("top_logprobs", [None])[1:]), "echo + logprobs 0: offsets / tops %s" % lp)

    # ---------------------------------------------------------------- several prompts x n: each choice its own
    # echo and scores, equal to its prompt alone with its seed (seed + j for the j-th sample)
    other = ids[:CHUNK + 3]
    body = {"model": NAME, "prompt": [ids, other], "n": 2, "max_tokens": 3, "temperature": 0.8, "seed": 11,
            "echo": True, "logprobs": 2}
    status, d = post(api, "/completions", body)
    chs = sorted(d.get("choices", []), key=lambda x: x["index"]) if status == 200 else []
    check(status == 200 and len(chs) == 4, "2 prompts x n 2 with echo and logprobs: %d %s" % (status, d))
    status, raw = post(api, "/completions", dict(body, stream=True), raw=True)
    streamed = {}
    for ev in sse(raw) if status == 200 else []:
        for ch in ev.get("choices", []):
            streamed.setdefault(ch["index"], []).extend((ch.get("logprobs") or {}).get("token_logprobs", []))
    for ch in chs:
        p, j = divmod(ch["index"], 2)
        one = completion(prompt=(ids, other)[p], max_tokens=3, temperature=0.8, seed=11 + j, echo=True, logprobs=2)
        lp, lp1 = ch["logprobs"] or {}, one["logprobs"] or {}
        check(ch["text"] == one["text"] and lp.get("token_logprobs") == lp1.get("token_logprobs") and
              lp.get("text_offset") == lp1.get("text_offset") and lp.get("top_logprobs") == lp1.get("top_logprobs"),
              "choice %d (prompt %d, sample %d) differs from its prompt alone with seed %d" % (ch["index"], p, j, 11 + j))
        check(streamed.get(ch["index"]) == lp1.get("token_logprobs"),
              "streamed choice %d's token_logprobs differ from its prompt alone" % ch["index"])

    # ---------------------------------------------------------------- the official openai npm package
    modules = os.path.join(args.bin, "npm", "node_modules")
    if os.path.isdir(os.path.join(modules, "openai")) and shutil.which("node"):
        env = dict(os.environ, NODE_PATH=modules)
        p = subprocess.run(["node", os.path.join(os.path.dirname(os.path.abspath(__file__)), "openai", "logprobs.cjs"),
                            api, NAME, PROMPT], capture_output=True, text=True, timeout=300, env=env)
        check(p.returncode == 0, "logprobs.cjs: %s" % p.stderr[-500:])
        sdk = json.loads(p.stdout) if p.returncode == 0 else {}
        g3 = grpc_run(ids, max_tokens=8, logprobs=True, top_logprobs=3)
        for what in ("completion", "completion_stream"):
            got = sdk.get(what, {})
            got = got.get("token_logprobs", []) if isinstance(got, dict) else got
            check(len(got) == 8 and all(same(f32(a), b2) for a, b2 in zip(got, g3["lps"])),
                  "SDK %s logprobs %s != gRPC %s" % (what, got, g3["lps"]))
        tops = (sdk.get("completion") or {}).get("top_logprobs", [])
        check(len(tops) == 8 and all(sorted(f32(v) for v in t.values()) == sorted(a[1]) for t, a in zip(tops, g3["alts"])),
              "SDK completion top_logprobs %s" % tops)
        tl = (sdk.get("echo") or {}).get("token_logprobs", [])
        check(sdk.get("echo_text") == PROMPT and len(tl) == len(ids) and tl[0] is None and
              all(same(f32(tl[i]), want[i]) for i in range(1, len(ids))), "SDK echo: %s" % sdk.get("echo"))
        gc2 = grpc_run(ct["tokens"], max_tokens=6, logprobs=True, top_logprobs=2)
        chat = sdk.get("chat", [])
        check(len(chat) == 6 and all(same(f32(e["logprob"]), b2) and len(e["top_logprobs"]) == 2
                                     for e, b2 in zip(chat, gc2["lps"])), "SDK chat logprobs %s" % chat)
        got = sdk.get("chat_stream", [])
        check(len(got) == 6 and all(same(f32(a), b2) for a, b2 in zip(got, gc2["lps"])),
              "SDK streamed chat logprobs %s != gRPC %s" % (got, gc2["lps"]))
    else:
        print("note: node or the openai npm package (%s) missing: the SDK checks were skipped" % modules)

    # ---------------------------------------------------------------- refusals
    for v in (21, -1, "x", True):
        refused(api, "/completions", {"model": NAME, "prompt": PROMPT, "logprobs": v}, "logprobs", "logprobs %r" % v)
    refused(api, "/chat/completions", {"model": NAME, "messages": msgs, "top_logprobs": 2}, "top_logprobs",
            "top_logprobs without logprobs")
    refused(api, "/chat/completions", {"model": NAME, "messages": msgs, "logprobs": True, "top_logprobs": 21},
            "top_logprobs", "top_logprobs 21")
    refused(api, "/chat/completions", {"model": NAME, "messages": msgs, "echo": True}, "echo", "echo on chat")
    refused(api, "/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 0}, "max_tokens", "max_tokens 0")
    code, _ = krprocs.code_of(lambda: grpc_run(ids, max_tokens=4, top_logprobs=21))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, "gRPC top_logprobs 21: %s" % code)
    code, _ = krprocs.code_of(lambda: grpc_run(ids, max_tokens=0))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, "gRPC max_tokens 0 without prompt_logprobs: %s" % code)


krprocs.run(main)
krprocs.finish("openai_logprobs", args.work)
