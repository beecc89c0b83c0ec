"""openai_vllm.py - the checks of openai_vllm.sh: vLLM's extension fields, /tokenize and
/detokenize, and strings holding U+0000, through a real cluster of one kvrelay-decode, one
kvrelay-prefill and one kvrelay-router, over HTTP (urllib: the bodies are written here byte for
byte) and gRPC (Debian's grpcio).

The model is the bundled kjv-2l128-2k with its config's eos_token_id moved to the third token of
the prompt's greedy continuation (the model's own EOS never wins an argmax), so that a greedy
request stops there unless told otherwise. Every expected text comes from `kvrelay-generate
--greedy` on the unmodified model (no EOS in reach), or from the cluster's own baseline.

Checked:
  - greedy completions stop at the moved EOS after 3 tokens; ignore_eos runs to max_tokens with
    exactly kvrelay-generate's ids and text, streamed and not, completions and chat;
  - min_tokens: no EOS or stop id among the first min_tokens ids (the prefill node masks the
    first, the decode node the others), and at least that many tokens; a stop id that is the
    greedy first token is not drawn under min_tokens 1 and ends the text at once without it; a
    stop string inside the first min_tokens tokens does not end it;
  - stop_token_ids ends at the first one generated (finish "stop"); include_stop_str_in_output
    ends the text after the stop string instead of before it;
  - skip_special_tokens / keep_special_tokens: a forced special token's text is kept or dropped;
  - the penalties change the greedy text, and with repetition_penalty 100 no token, the prefill
    node's first one included, repeats one of the prompt or of the output before it;
  - the request bodies `vllm bench serve --backend openai` and `--backend openai-chat` send
    (vllm/benchmarks/lib/endpoint_request_func.py: repetition_penalty 1.0, logprobs null,
    stream_options.include_usage, ignore_eos) are accepted and honour max_tokens;
  - out-of-range and mistyped values are 400 naming the field (gRPC: INVALID_ARGUMENT);
  - U+0000 in a prompt, a message, a stop string, a policy spec, the model, a key: 400 naming the
    field; over gRPC, in GenerateRequest.text, stop, kv_policy and TokenizeRequest.text:
    INVALID_ARGUMENT naming it; an escaped backslash before "u0000" is text and is served;
  - /tokenize (prompt and messages) equals the gRPC Tokenize and kvrelay-tokenize --chat, with
    count and max_model_len; /detokenize gives the prompt back, and a token spelling U+0000
    whole; /v1/models lists max_model_len.
Run through openai_vllm.sh (it generates the stubs); every process is killed at the end.
"""
import json
import os
import subprocess
import urllib.request

import krprocs  # beside this script: Python puts its directory on sys.path

args = krprocs.parse_args()

import grpc  # noqa: E402
from kvrelay.v1 import kvrelay_pb2 as pb  # noqa: E402
from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc  # noqa: E402
from krprocs import check, post  # noqa: E402

NAME = "kjv-vllm"
PROMPT = "And God said"
MAX = 16


def get(base, path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read().decode())


def sse(raw):
    """The JSON events of an SSE body, checking it ends with [DONE]."""
    lines = [ln[6:] for ln in raw.split("\n") if ln.startswith("data: ")]
    check(lines and lines[-1] == "[DONE]", "a stream that does not end with [DONE]: %r" % raw[-200:])
    return [json.loads(x) for x in lines[:-1]]


def one_process(model, ids, n):
    out = subprocess.run([os.path.join(args.bin, "kvrelay-generate"), "--model", model, "--ids",
                          " ".join(map(str, ids)), "--max-tokens", str(n), "--greedy", "--threads", "1",
                          "--json"], check=True, capture_output=True, timeout=300)
    return json.loads(out.stdout)


def refused(base, path, body, param, what):
    status, doc = post(base, path, body)
    err = doc.get("error", {}) if isinstance(doc, dict) else {}
    check(status == 400 and err.get("param") == param and err.get("type") == "invalid_request_error",
          "%s: want 400 naming %s, got %d %s" % (what, param, status, doc))


def main():
    b = args.bin
    vocab_model = args.model
    # the prompt's ids and greedy continuation on the unmodified model
    ids = [int(x) for x in subprocess.run([b + "/kvrelay-tokenize", "--model", vocab_model, "--text", PROMPT,
                                           "--add-special"], check=True, capture_output=True,
                                          text=True).stdout.split()]
    ref = one_process(vocab_model, ids, 48)
    greedy = ref["ids"]
    eos = greedy[2]
    check(eos not in greedy[:2], "the moved EOS %d is among the first two greedy ids %s" % (eos, greedy[:2]))

    model = os.path.join(args.work, "model")
    os.makedirs(model)
    for f in os.listdir(vocab_model):
        if f not in ("config.json", "SHA256SUMS"):
            os.symlink(os.path.join(os.path.abspath(vocab_model), f), os.path.join(model, f))
    cfg = json.load(open(os.path.join(vocab_model, "config.json")))
    cfg["eos_token_id"] = eos
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"))
    args.model = model
    _, _, nodes = krprocs.start_nodes(args)
    router, http = krprocs.start(args.work, "router", [b + "/kvrelay-router", "--model", model, "--nodes", nodes,
                                 "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                 "--served-model-name", NAME])
    base = "http://" + http
    api = base + "/v1"
    gen = pb_grpc.GenerationStub(grpc.insecure_channel(router))

    def grpc_run(**kw):
        """The whole gRPC stream: (ids, text, finish)."""
        sampling = kw.pop("sampling", pb.Sampling())
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling, **kw)
        out_ids, text, fin = [], "", None
        for msg in gen.Generate(req, timeout=120):
            if msg.WhichOneof("event") == "delta":
                out_ids.extend(msg.delta.ids)
                text += msg.delta.text
            else:
                fin = msg.finish
        return out_ids, text, fin

    def complete(**kw):
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX, "temperature": 0}
        body.update(kw)
        status, doc = post(api, "/completions", body)
        check(status == 200, "completions %s: %d %s" % (kw, status, doc))
        return doc if status == 200 else {"choices": [{"text": "", "finish_reason": None}], "usage": {}}

    # ---------------------------------------------------------------- EOS and ignore_eos
    d = complete()
    check(d["choices"][0]["finish_reason"] == "stop" and d["usage"].get("completion_tokens") == 3,
          "greedy without ignore_eos should stop at the moved EOS after 3 tokens: %s" % d)
    d = complete(ignore_eos=True)
    want_text = one_process(vocab_model, ids, MAX)["text"]
    check(d["choices"][0]["finish_reason"] == "length" and d["usage"].get("completion_tokens") == MAX,
          "ignore_eos: %s" % d)
    check(d["choices"][0]["text"] == want_text, "ignore_eos text %r != kvrelay-generate's %r"
          % (d["choices"][0]["text"], want_text))
    got_ids, _, fin = grpc_run(max_tokens=MAX, ignore_eos=True)
    check(got_ids == greedy[:MAX] and fin.reason == pb.FINISH_REASON_LENGTH,
          "gRPC ignore_eos: ids %s != %s (%s)" % (got_ids, greedy[:MAX], fin))
    got_ids, _, fin = grpc_run(max_tokens=MAX)
    check(got_ids == greedy[:3] and fin.reason == pb.FINISH_REASON_EOS, "gRPC without ignore_eos: %s %s"
          % (got_ids, fin))

    # ---------------------------------------------------------------- min_tokens
    got_ids, _, fin = grpc_run(max_tokens=MAX, min_tokens=8)
    check(len(got_ids) >= 8 and eos not in got_ids[:8], "min_tokens 8: ids %s" % got_ids)
    d = complete(min_tokens=8)
    check(d["usage"].get("completion_tokens", 0) >= 8, "HTTP min_tokens 8: %s" % d)
    stop_id = greedy[5]
    got_ids, _, fin = grpc_run(max_tokens=MAX, ignore_eos=True, stop_ids=[stop_id], min_tokens=10)
    check(len(got_ids) >= 10 and stop_id not in got_ids[:10], "min_tokens 10 with stop id %d: %s"
          % (stop_id, got_ids))
    # the first token is the prefill node's: a stop id there ends the text at once, unless
    # min_tokens keeps it from being drawn (then the row's next best is)
    got_ids, _, fin = grpc_run(max_tokens=MAX, ignore_eos=True, stop_ids=[greedy[0]])
    check(got_ids == greedy[:1] and fin.reason == pb.FINISH_REASON_STOP,
          "stop id %d, the greedy first token: %s %s" % (greedy[0], got_ids, fin))
    got_ids, _, fin = grpc_run(max_tokens=4, ignore_eos=True, stop_ids=[greedy[0]], min_tokens=1)
    check(len(got_ids) == 4 and got_ids[0] != greedy[0],
          "min_tokens 1 with the greedy first token %d as stop id: %s" % (greedy[0], got_ids))
    # a stop string the first tokens spell does not end the text before min_tokens
    d = complete(ignore_eos=True, max_tokens=40, stop=["him"], min_tokens=5)
    t = d["choices"][0]["text"]
    check(t.startswith(" unto him,") and "him" not in t[len(" unto him,"):] and d["choices"][0]["finish_reason"] == "stop",
          "stop 'him' with min_tokens 5: %r" % t)
    refused(api, "/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 4, "min_tokens": 5},
            "min_tokens", "min_tokens over max_tokens")

    # ---------------------------------------------------------------- stop_token_ids, stop strings
    d = complete(ignore_eos=True, stop_token_ids=[stop_id])
    check(d["choices"][0]["finish_reason"] == "stop" and d["usage"].get("completion_tokens") == 6,
          "stop_token_ids [%d]: %s" % (stop_id, d))
    full = complete(ignore_eos=True, max_tokens=24)["choices"][0]["text"]
    cut = full.find("Jordan")
    check(cut > 0, "no 'Jordan' in the greedy text %r" % full)
    d = complete(ignore_eos=True, max_tokens=24, stop="Jordan")
    check(d["choices"][0]["text"] == full[:cut], "stop 'Jordan': %r" % d["choices"][0]["text"])
    d = complete(ignore_eos=True, max_tokens=24, stop="Jordan", include_stop_str_in_output=True)
    check(d["choices"][0]["text"] == full[:cut + 6], "include_stop_str_in_output: %r" % d["choices"][0]["text"])

    # ---------------------------------------------------------------- special tokens
    special = cfg["bos_token_id"]
    forced = greedy[:2] + [special] + greedy[2:4]
    _, kept, _ = grpc_run(forced=pb.TokenIds(ids=forced), keep_special_tokens=True)
    _, skipped, _ = grpc_run(forced=pb.TokenIds(ids=forced))
    status, doc = post(base, "/detokenize", {"model": NAME, "tokens": [special]})
    spelled = doc.get("prompt", "") if status == 200 else ""
    check(spelled and spelled in kept and spelled not in skipped,
          "keep_special_tokens: the special token %d spells %r: kept %r, skipped %r" % (special, spelled, kept, skipped))
    d = complete(ignore_eos=True, skip_special_tokens=False)
    check(d["choices"][0]["text"] == want_text, "skip_special_tokens false without special tokens: %r" % d)

    # ---------------------------------------------------------------- penalties
    base_ids, _, _ = grpc_run(max_tokens=40, ignore_eos=True)
    rep_ids, _, _ = grpc_run(max_tokens=40, ignore_eos=True, sampling=pb.Sampling(repetition_penalty=100.0))
    check(all(rep_ids[i] not in ids + rep_ids[:i] for i in range(len(rep_ids))),
          "repetition_penalty 100: a token repeats: %s" % rep_ids)
    check(any(base_ids[i] in ids + base_ids[:i] for i in range(len(base_ids))),
          "the baseline repeats no token, so the check above proves nothing: %s" % base_ids)
    # the prefill node's first token too: a prompt whose greedy next token is one of its own
    k = next(i for i in range(1, len(greedy)) if greedy[i] in ids + greedy[:i])
    longer = pb.TokenIds(ids=ids + greedy[:k])
    first_base = [m.delta.ids[0] for m in gen.Generate(pb.GenerateRequest(
        token_ids=longer, max_tokens=1, ignore_eos=True), timeout=120) if m.WhichOneof("event") == "delta"]
    first_rep = [m.delta.ids[0] for m in gen.Generate(pb.GenerateRequest(
        token_ids=longer, max_tokens=1, ignore_eos=True, sampling=pb.Sampling(repetition_penalty=100.0)),
        timeout=120) if m.WhichOneof("event") == "delta"]
    check(first_base and first_base[0] in longer.ids,
          "the baseline's first token %s is not in its prompt, so the check below proves nothing" % first_base)
    check(first_rep and first_rep[0] not in longer.ids,
          "repetition_penalty 100: the first token %s repeats one of the prompt" % first_rep)
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5}):
        d = complete(ignore_eos=True, max_tokens=40, **kw)
        check(d["choices"][0]["text"] != complete(ignore_eos=True, max_tokens=40)["choices"][0]["text"],
              "%s does not change the greedy text" % kw)
    d = complete(ignore_eos=True, max_tokens=40, presence_penalty=0, frequency_penalty=0, repetition_penalty=1)
    check(d["usage"].get("completion_tokens") == 40, "neutral penalties: %s" % d)

    # ---------------------------------------------------------------- vllm bench serve's bodies
    bench = {"model": NAME, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 12, "logprobs": None,
             "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    status, raw = post(api, "/completions", bench)
    check(status == 200, "vllm bench serve's completions body: %d %s" % (status, raw))
    if status == 200:
        ev = sse(raw)
        usage = [e["usage"] for e in ev if e.get("usage")]
        text = "".join(e["choices"][0]["text"] for e in ev if e["choices"])
        check(usage and usage[-1]["completion_tokens"] == 12, "bench completions usage %s" % usage)
        check(len(text) > 0, "bench completions: no text")  # sampled at temperature 1: any text
    chat = {"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            "max_completion_tokens": 12, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    status, raw = post(api, "/chat/completions", chat)
    check(status == 200, "vllm bench serve's chat body: %d %s" % (status, raw))
    if status == 200:
        usage = [e["usage"] for e in sse(raw) if e.get("usage")]
        check(usage and usage[-1]["completion_tokens"] == 12, "bench chat usage %s" % usage)
    chat.update(stream=False, stream_options=None)
    status, doc = post(api, "/chat/completions", chat)
    check(status == 200 and doc["usage"]["completion_tokens"] == 12, "chat with ignore_eos, not streamed: %s" % doc)

    # ---------------------------------------------------------------- refusals
    for field, value in (("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", "x"),
                         ("repetition_penalty", 101), ("presence_penalty", 2.5), ("frequency_penalty", -3),
                         ("min_tokens", -1), ("min_tokens", 1.5), ("stop_token_ids", [99999]),
                         ("stop_token_ids", "x"), ("stop_token_ids", [1.5]), ("ignore_eos", "yes"),
                         ("skip_special_tokens", 1), ("include_stop_str_in_output", "no")):
        for path in ("/completions", "/chat/completions"):
            body = {"model": NAME, "max_tokens": 4, field: value}
            body.update({"prompt": PROMPT} if path == "/completions" else {"messages": [{"role": "user", "content": PROMPT}]})
            refused(api, path, body, field, "%s %s = %r" % (path, field, value))
    refused(api, "/completions", {"model": NAME, "prompt": PROMPT, "best_of_n": 2}, "best_of_n", "an unknown field")
    for sampling, needle in ((pb.Sampling(repetition_penalty=-1), "repetition_penalty"),
                             (pb.Sampling(presence_penalty=3), "presence_penalty"),
                             (pb.Sampling(frequency_penalty=float("nan")), "frequency_penalty")):
        code, details = krprocs.code_of(lambda: grpc_run(max_tokens=4, sampling=sampling))
        check(code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, "gRPC %s: %s %s" % (needle, code, details))
    code, details = krprocs.code_of(lambda: grpc_run(max_tokens=4, min_tokens=5))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in details, "gRPC min_tokens: %s %s"
          % (code, details))

    # ---------------------------------------------------------------- U+0000
    nul = "\\u0000"
    for path, body, param in (
            ("/completions", '{"model": "%s", "prompt": "And%s God", "max_tokens": 4}' % (NAME, nul), "prompt"),
            ("/completions", '{"model": "%s", "prompt": ["And%s"], "max_tokens": 4}' % (NAME, nul), "prompt"),
            ("/completions", '{"model": "%s", "prompt": "And", "stop": ["a", "b%s"], "max_tokens": 4}' % (NAME, nul),
             "stop"),
            ("/completions", '{"model": "%s", "prompt": "And", "kv_policy": "full%sx"}' % (NAME, nul), "kv_policy"),
            ("/completions", '{"model": "%s%s", "prompt": "And"}' % (NAME, nul), "model"),
            ("/completions", '{"model": "%s", "prompt": "And", "user%s": 1}' % (NAME, nul), "user"),
            ("/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "In%s the"}]}'
             % (NAME, nul), "messages"),
            ("/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": '
             '[{"type": "text", "text": "x%s"}]}]}' % (NAME, nul), "messages")):
        refused(api, path, body.encode(), param, "U+0000 in %s of %s" % (param, path))
    refused(base, "/tokenize", ('{"prompt": "a%sb"}' % nul).encode(), "prompt", "U+0000 in /tokenize's prompt")
    refused(api, "/completions", b'{"model": "' + NAME.encode() + b'", "prompt": "And\x00 God"}', "prompt",
            "a raw NUL byte in the prompt")
    # an escaped backslash followed by "u0000" is six characters of text
    status, doc = post(api, "/completions", ('{"model": "%s", "prompt": "And \\\\u0000", "max_tokens": 2}'
                                             % NAME).encode())
    check(status == 200, "an escaped backslash before u0000: %d %s" % (status, doc))
    for what, call in (
            ("text", lambda: list(gen.Generate(pb.GenerateRequest(text="And\x00 God", max_tokens=2), timeout=30))),
            ("stop", lambda: grpc_run(max_tokens=2, stop=["ok", "a\x00b"])),
            ("kv_policy", lambda: grpc_run(max_tokens=2, kv_policy="full\x00,x")),
            ("text", lambda: gen.Tokenize(pb.TokenizeRequest(text="a\x00b"), timeout=30))):
        code, details = krprocs.code_of(call)
        check(code == grpc.StatusCode.INVALID_ARGUMENT and ("." + what + " holds U+0000") in details,
              "gRPC U+0000 in %s: %s %s" % (what, code, details))

    # ---------------------------------------------------------------- /tokenize, /detokenize, /v1/models
    status, doc = post(base, "/tokenize", {"model": NAME, "prompt": PROMPT})
    check(status == 200 and doc.get("tokens") == ids and doc.get("count") == len(ids)
          and doc.get("max_model_len") == cfg["max_position_embeddings"], "/tokenize: %d %s (ids %s)" % (status, doc, ids))
    check(list(gen.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special=True), timeout=30).ids) == ids,
          "gRPC Tokenize disagrees with kvrelay-tokenize")
    text = "In the beginning God created the heaven and the earth."
    status, doc = post(base, "/tokenize", {"prompt": text, "add_special_tokens": False})
    check(status == 200 and doc["count"] == len(doc["tokens"]) > 0, "/tokenize without special tokens: %s" % doc)
    status, back = post(base, "/detokenize", {"model": NAME, "tokens": doc.get("tokens", [])})
    check(status == 200 and back == {"prompt": text}, "/detokenize round trip: %s" % back)
    msgs = [{"role": "user", "content": "In the beginning"}]
    with open(os.path.join(args.work, "chat.json"), "w") as f:
        json.dump({"messages": msgs}, f)
    want = [int(x) for x in subprocess.run([b + "/kvrelay-tokenize", "--model", model, "--chat",
                                            os.path.join(args.work, "chat.json")], check=True, capture_output=True,
                                           text=True).stdout.split()]
    status, doc = post(base, "/tokenize", {"model": NAME, "messages": msgs})
    check(status == 200 and doc.get("tokens") == want, "/tokenize of messages: %s, want %s" % (doc, want))
    refused(base, "/detokenize", {"tokens": [cfg["vocab_size"]]}, "tokens", "/detokenize of an id outside the vocabulary")
    # the byte-level vocabulary's token for the byte 0 spells U+0000: it comes back whole
    vocab = json.load(open(os.path.join(model, "tokenizer.json")))["model"]["vocab"]
    nul_id = vocab.get("\u0100")
    check(nul_id is not None, "the model's vocabulary has no token for the byte 0")
    a, b_ = (post(base, "/tokenize", {"prompt": w, "add_special_tokens": False})[1]["tokens"] for w in ("a", "b"))
    status, doc = post(base, "/detokenize", {"tokens": a + [nul_id] + b_})
    check(status == 200 and doc == {"prompt": "a\x00b"}, "/detokenize of a token spelling U+0000: %d %s" % (status, doc))
    refused(base, "/tokenize", {"prompt": "x", "messages": msgs}, "prompt", "/tokenize of both")
    refused(base, "/tokenize", {"prompt": "x", "truncate": 3}, "truncate", "/tokenize with an unknown field")
    status, doc = post(base, "/tokenize", {"model": "other", "prompt": "x"})
    check(status == 404, "/tokenize of another model: %d %s" % (status, doc))
    models = get(api, "/models")
    check(models["data"][0].get("max_model_len") == cfg["max_position_embeddings"], "/v1/models: %s" % models)


krprocs.run(main)
krprocs.finish("openai_vllm", args.work)
