"""openai_choices.py - the checks of openai_choices.sh: n, best_of and lists of prompts through a
real cluster of one kvrelay-decode, one kvrelay-prefill (--chunk 16) and one kvrelay-router,
over HTTP (urllib: the bodies are written here; curl; the openai npm package when installed) and
gRPC (Debian's grpcio) for best_of's log-probabilities.

Checked:
  - n = 3, sampled with a seed, completions and chat, streamed and not: choice j's text and
    finish equal, bit for bit, the same request with n = 1 and seed + j; indexes 0..n-1, in
    order; a stream's chunks each name their choice, every choice ends with one finish chunk
    (with its own kvrelay figures), and the include_usage chunk sums all; usage sums the
    completion tokens of every choice and counts the prompt once;
  - the choices after the first reuse the prompt's state from the prefill node's prefix cache
    (kvrelay_prefix_cache_tokens_reused_total grows by the prompt's chunks for each);
  - temperature 0: every choice is the greedy text;
  - best_of = 3, n = 2: the two candidates (seeds seed + 0..2) with the highest mean
    log-probability per token, as the gRPC API reports them, best first; usage counts all three;
  - a list of 3 prompts (two strings and one of token ids) with n = 2: 6 choices, index =
    prompt * 2 + choice, each equal to its prompt alone with seed + choice; usage sums them;
  - refusals naming the field: n = 0, n = 17, best_of < n, best_of with stream, best_of on chat,
    too many generations for one request;
  - a generation the router refuses (its prompt over the router's --max-prompt-tokens, which only
    the generation path checks) refuses the whole request before any generation starts, with a
    real 400 naming prompt, streamed or not, and the decode node holds no block afterwards;
  - the decode node frozen once both choices of an n = 2 stream have sent a chunk (a router with
    --decode-stall-ms 500): the stream ends with one error event (service_unavailable) before
    [DONE], and the decode node holds no block once it runs again;
  - curl reads a raw n = 2 stream; the openai package reads n = 2, streamed and not.
Run through openai_choices.sh (it generates the stubs); every process is killed at the end.
"""
import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import krprocs  # beside this script: Python puts its directory on sys.path

args = krprocs.parse_args()

import grpc  # noqa: E402
from kvrelay.v1 import kvrelay_pb2 as pb  # noqa: E402
from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc  # noqa: E402
from krprocs import check, post  # noqa: E402

NAME = "kjv-choices"
# 40-odd tokens: two whole 16-token chunks the prefix cache keeps, and a last one it computes
PROMPT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
          "and darkness was upon the face of the deep.")
MAX = 12
SEED = 7


def sse(raw):
    """The JSON events of an SSE body, checking it ends with [DONE]."""
    lines = [ln[6:] for ln in raw.split("\n") if ln.startswith("data: ")]
    check(lines and lines[-1] == "[DONE]", "a stream that does not end with [DONE]: %r" % raw[-200:])
    return [json.loads(x) for x in lines[:-1]]


def metric(http, name):
    with urllib.request.urlopen("http://%s/metrics" % http, timeout=30) as r:
        text = r.read().decode()
    m = re.search(r"^%s(?:\{[^}]*\})? ([0-9.e+]+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else 0.0


def refused(api, path, body, param, what):
    status, doc = post(api, path, body)
    err = doc.get("error", {}) if isinstance(doc, dict) else {}
    check(status == 400 and err.get("param") == param and err.get("type") == "invalid_request_error",
          "%s: want 400 naming %s, got %d %s" % (what, param, status, doc))


def start_cluster(b, model):
    dec, dec_http = krprocs.start(args.work, "decode", [b + "/kvrelay-decode", "--model", model, "--id", "decode-0",
                                                 "--listen", "127.0.0.1:0", "--transfer", "127.0.0.1:0",
                                                 "--http", "127.0.0.1:0", "--kv-memory", "64M", "--threads", "1"])
    pre, pre_http = krprocs.start(args.work, "prefill", [b + "/kvrelay-prefill", "--model", model, "--id", "prefill-0",
                                                         "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                                         "--threads", "1", "--chunk", "16"])
    nodes = os.path.join(args.work, "nodes.json")
    with open(nodes, "w") as f:
        json.dump({"prefill": [{"id": "prefill-0", "address": pre}], "decode": [{"id": "decode-0", "address": dec}]}, f)
    router, http = krprocs.start(args.work, "router", [b + "/kvrelay-router", "--model", model, "--nodes", nodes,
                                                      "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                                      "--served-model-name", NAME, "--max-prompt-tokens", "60"])
    return router, http, pre_http, dec_http


def main():
    b = args.bin
    router, http, pre_http, dec_http = start_cluster(b, args.model)
    api = "http://%s/v1" % http
    gen = pb_grpc.GenerationStub(grpc.insecure_channel(router))

    def complete(path="/completions", **kw):
        body = {"model": NAME, "max_tokens": MAX}
        body.update(kw)
        if path == "/completions":
            body.setdefault("prompt", PROMPT)
        status, doc = post(api, path, body)
        check(status == 200, "%s %s: %d %s" % (path, kw, status, doc))
        return doc if status == 200 else {"choices": [], "usage": {}}

    def text_of(choice):
        return choice["message"]["content"] if "message" in choice else choice["text"]

    def singles(k, path="/completions", seed=SEED, **kw):
        """The same request with n = 1 and seeds seed .. seed + k - 1: [(text, finish, usage, kvrelay)]."""
        out = []
        for j in range(k):
            doc = complete(path, seed=seed + j, **kw)
            c = doc["choices"][0] if doc["choices"] else {}
            out.append((text_of(c) if c else None, c.get("finish_reason"), doc["usage"], doc.get("kvrelay", {})))
        return out

    def same_as_singles(doc, refs, what, n_prompts=1):
        n = len(refs) // n_prompts
        cs = doc["choices"]
        check([c["index"] for c in cs] == list(range(len(refs))), "%s: indexes %s" % (what, [c["index"] for c in cs]))
        for i, (c, (text, finish, _, _)) in enumerate(zip(cs, refs)):
            check(text_of(c) == text and c["finish_reason"] == finish,
                  "%s: choice %d (prompt %d, seed + %d) is %r/%s, alone %r/%s" %
                  (what, i, i // n, i % n, text_of(c), c["finish_reason"], text, finish))
        u = doc["usage"]
        want_completion = sum(r[2]["completion_tokens"] for r in refs)
        want_prompt = sum(refs[p * n][2]["prompt_tokens"] for p in range(n_prompts))
        check(u["completion_tokens"] == want_completion and u["prompt_tokens"] == want_prompt and
              u["total_tokens"] == want_prompt + want_completion,
              "%s: usage %s, want %d prompt + %d completion tokens" % (what, u, want_prompt, want_completion))

    # ---------------------------------------------------------------- n = 3, completions
    reused0 = metric(pre_http, "kvrelay_prefix_cache_tokens_reused_total")
    doc = complete(n=3, seed=SEED)
    reused = metric(pre_http, "kvrelay_prefix_cache_tokens_reused_total") - reused0
    refs = singles(3)
    same_as_singles(doc, refs, "n=3")
    check(len({r[0] for r in refs}) > 1, "n=3: the seeds gave one text for all: %s" % refs)
    n_prompt = refs[0][2]["prompt_tokens"]
    chunks = (n_prompt - 1) // 16 * 16
    check(chunks >= 32 and reused >= 2 * chunks,
          "n=3: the prefix cache reused %g tokens for the choices after the first (want 2 x %d)" % (reused, chunks))
    shipped = doc.get("kvrelay", {}).get("kv_bytes_shipped")
    check(shipped == sum(r[3]["kv_bytes_shipped"] for r in refs) and shipped > 0,
          "n=3: kv_bytes_shipped %s, want the sum of the three bundles %s" % (shipped, [r[3] for r in refs]))
    print("ok: n=3 equals three requests with seeds %d..%d; the prefix cache served %g tokens (2 x %d of the "
          "prompt's %d), %d bytes shipped in 3 bundles" % (SEED, SEED + 2, reused, chunks, n_prompt, shipped))

    # ---------------------------------------------------------------- n = 3, streamed
    status, raw = post(api, "/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": MAX, "n": 3,
                                             "seed": SEED, "stream": True, "stream_options": {"include_usage": True}})
    check(status == 200, "n=3 stream: %d %s" % (status, raw))
    events = sse(raw) if status == 200 else []
    texts, finishes = {}, {}
    for e in events[:-1]:
        check(len(e["choices"]) == 1 and e["usage"] is None, "a stream chunk with %d choices" % len(e["choices"]))
        c = e["choices"][0]
        check(c["index"] not in finishes, "choice %d has a chunk after its finish" % c["index"])
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            finishes[c["index"]] = c["finish_reason"]
            check(e.get("kvrelay", {}).get("decode_node") == "decode-0",
                  "choice %d's finish chunk carries its kvrelay figures: %s" % (c["index"], e))
    check(sorted(texts) == [0, 1, 2] and all(texts[j] == refs[j][0] and finishes.get(j) == refs[j][1]
                                             for j in range(3)),
          "n=3 stream: %s / %s, want %s" % (texts, finishes, refs))
    last = events[-1] if events else {}
    check(last.get("choices") == [] and last.get("usage", {}).get("completion_tokens") ==
          doc["usage"]["completion_tokens"] and last["usage"]["prompt_tokens"] == n_prompt,
          "n=3 stream: the usage chunk %s, want %s" % (last, doc["usage"]))
    print("ok: n=3 streamed: every chunk names its choice, each choice's text and finish as alone, usage summed")

    # ---------------------------------------------------------------- chat, n = 2
    msgs = [{"role": "user", "content": "In the beginning"}]
    chat = complete("/chat/completions", messages=msgs, n=2, seed=SEED)
    crefs = singles(2, "/chat/completions", messages=msgs)
    same_as_singles(chat, crefs, "chat n=2")
    status, raw = post(api, "/chat/completions", {"model": NAME, "messages": msgs, "max_tokens": MAX, "n": 2,
                                                  "seed": SEED, "stream": True})
    ctexts, roles = {}, {}
    for e in sse(raw) if status == 200 else []:
        c = e["choices"][0]
        roles.setdefault(c["index"], c["delta"].get("role"))
        ctexts[c["index"]] = ctexts.get(c["index"], "") + c["delta"].get("content", "")
    check(status == 200 and ctexts == {0: crefs[0][0], 1: crefs[1][0]} and roles == {0: "assistant", 1: "assistant"},
          "chat n=2 stream: %s %s, want %s" % (ctexts, roles, crefs))
    print("ok: chat n=2, streamed and not, equals two requests with seeds %d, %d" % (SEED, SEED + 1))

    # ---------------------------------------------------------------- temperature 0
    greedy = complete(n=3, temperature=0)
    g1 = complete(temperature=0)
    check([text_of(c) for c in greedy["choices"]] == [text_of(g1["choices"][0])] * 3,
          "n=3 greedy: %s, want 3 x %r" % (greedy["choices"], g1["choices"][0]))
    print("ok: n=3 at temperature 0: three times the greedy text")

    # ---------------------------------------------------------------- best_of
    ids = post("http://" + http, "/tokenize", {"prompt": PROMPT})[1]["tokens"]
    cands = []
    for j in range(3):
        lps, text = [], ""
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=MAX, logprobs=True,
                                 sampling=pb.Sampling(temperature=1.0, top_p=1.0, seed=11 + j))
        for msg in gen.Generate(req, timeout=300):
            if msg.WhichOneof("event") == "delta":
                lps.extend(msg.delta.logprobs)
                text += msg.delta.text
        cands.append((sum(lps) / len(lps), j, text))
    ranked = sorted(cands, key=lambda c: (-c[0], c[1]))
    bo = complete(n=2, best_of=3, seed=11)
    got = [c["text"] for c in bo["choices"]]
    check(got == [ranked[0][2], ranked[1][2]] and [c["index"] for c in bo["choices"]] == [0, 1],
          "best_of=3 n=2: %s, want the two best of %s" % (got, ranked))
    bo_refs = singles(3, seed=11)
    check([r[0] for r in bo_refs] == [c[2] for c in cands], "best_of: HTTP and gRPC texts differ: %s %s" % (bo_refs, cands))
    check(bo["usage"]["completion_tokens"] == sum(r[2]["completion_tokens"] for r in bo_refs),
          "best_of: usage %s counts every candidate" % bo["usage"])
    print("ok: best_of=3 n=2 returns the candidates with mean log-probabilities %.4f, %.4f (of %.4f, %.4f, %.4f)"
          % (ranked[0][0], ranked[1][0], cands[0][0], cands[1][0], cands[2][0]))

    # ---------------------------------------------------------------- a list of prompts
    prompts = ["And God said", ids[:9], "The LORD is my shepherd"]
    lst = complete(prompt=prompts, n=2, seed=5)
    lrefs = []
    for p in prompts:
        lrefs += singles(2, prompt=p, seed=5)
    same_as_singles(lst, lrefs, "3 prompts x n=2", n_prompts=3)
    print("ok: 3 prompts x n=2: 6 choices numbered prompt-major, each as its prompt alone")

    # ---------------------------------------------------------------- refusals
    refused(api, "/completions", {"model": NAME, "prompt": "x", "n": 0}, "n", "n=0")
    refused(api, "/completions", {"model": NAME, "prompt": "x", "n": 17}, "n", "n=17")
    refused(api, "/chat/completions", {"model": NAME, "messages": msgs, "n": 17}, "n", "chat n=17")
    refused(api, "/completions", {"model": NAME, "prompt": "x", "n": 1.5}, "n", "n=1.5")
    refused(api, "/completions", {"model": NAME, "prompt": "x", "n": 3, "best_of": 2}, "best_of", "best_of < n")
    refused(api, "/completions", {"model": NAME, "prompt": "x", "best_of": 2, "stream": True}, "best_of",
            "best_of with stream")
    refused(api, "/completions", {"model": NAME, "prompt": "x", "best_of": 17}, "best_of", "best_of=17")
    refused(api, "/chat/completions", {"model": NAME, "messages": msgs, "best_of": 2}, "best_of", "best_of on chat")
    refused(api, "/completions", {"model": NAME, "prompt": ["x"] * 5, "n": 16}, "prompt", "80 generations")
    refused(api, "/completions", {"model": NAME, "prompt": ["x", 3]}, "prompt", "a list holding a number after a string")
    refused(api, "/completions", {"model": NAME, "prompt": ["x", ""]}, "prompt", "an empty prompt in a list")
    print("ok: n, best_of and prompt lists out of range are 400 naming the field")

    # ---------------------------------------------------------------- one generation fails
    # the second prompt is over the router's --max-prompt-tokens (60), which only the router's
    # generation path checks: every generation is checked before any starts, so the request is
    # refused whole with that error, streamed or not; nothing is held on the decode node
    long_prompt = PROMPT + " " + PROMPT
    for stream in (False, True):
        status, doc = post(api, "/completions", {"model": NAME, "prompt": [PROMPT, long_prompt], "n": 2,
                                                 "max_tokens": 64, "seed": SEED, "stream": stream})
        err = doc.get("error", {}) if isinstance(doc, dict) else {}
        check(status == 400 and err.get("param") == "prompt" and "--max-prompt-tokens" in err.get("message", ""),
              "a failing generation (stream %s): want 400 naming prompt, got %d %s" % (stream, status, doc))
    deadline = time.time() + 20
    while time.time() < deadline:
        held = (metric(dec_http, "kvrelay_kv_blocks_used"), metric(dec_http, "kvrelay_kv_blocks_reserved"))
        if held == (0, 0):
            break
        time.sleep(0.2)
    check(held == (0, 0), "after the failed requests the decode node holds %s blocks (used, reserved)" % (held,))
    print("ok: a generation the router refuses refuses the request (400 naming prompt, streamed and not); "
          "no block held")

    # ---------------------------------------------------------------- curl and the openai package
    out = subprocess.run(["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d",
                          json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": MAX, "n": 2, "seed": SEED,
                                      "stream": True}), api + "/completions"],
                         capture_output=True, text=True, timeout=300)
    ctexts = {}
    for e in sse(out.stdout):
        ctexts[e["choices"][0]["index"]] = ctexts.get(e["choices"][0]["index"], "") + e["choices"][0]["text"]
    check(ctexts == {0: refs[0][0], 1: refs[1][0]}, "curl n=2 stream: %s" % ctexts)
    modules = os.path.join(args.bin, "npm", "node_modules")
    if os.path.isdir(os.path.join(modules, "openai")):
        js = """
const OpenAI = require('openai');
const [base, model, prompt, want] = process.argv.slice(1);
const refs = JSON.parse(want);
(async () => {
  const c = new OpenAI({ baseURL: base, apiKey: 'none', maxRetries: 0, timeout: 300000 });
  const r = await c.completions.create({ model, prompt, max_tokens: %d, n: 2, seed: %d });
  const texts = r.choices.map((x) => x.text);
  const s = {};
  for await (const ch of await c.completions.create({ model, prompt, max_tokens: %d, n: 2, seed: %d, stream: true }))
    for (const x of ch.choices) s[x.index] = (s[x.index] || '') + x.text;
  const ok = JSON.stringify(texts) === JSON.stringify(refs) && s[0] === refs[0] && s[1] === refs[1];
  console.log(ok ? 'ok: the openai package reads n=2, streamed and not' : 'FAIL: ' + JSON.stringify([texts, s, refs]));
  process.exit(ok ? 0 : 1);
})().catch((e) => { console.error('FAIL: ' + e); process.exit(1); });
""" % (MAX, SEED, MAX, SEED)
        r = subprocess.run(["node", "-e", js, api, NAME, PROMPT, json.dumps([refs[0][0], refs[1][0]])],
                           env=dict(os.environ, NODE_PATH=modules), capture_output=True, text=True, timeout=300)
        print(r.stdout.strip())
        check(r.returncode == 0, "the openai package: %s %s" % (r.stdout, r.stderr))
    else:
        print("note: the openai npm package is not installed (./kvrelay test installs it): its check skipped")

    # ---------------------------------------------------------------- a node failing mid-stream
    # last: it leaves the decode node's breaker open. A router whose watcher gives up on a decode
    # stream silent for 500 ms; the decode node is frozen (SIGSTOP) once both choices streamed a
    # chunk: the first generation to fail fails the request, the other is cancelled, and the
    # stream, begun with 200, ends with an error event before [DONE]. A Release the frozen node
    # could not take is left to the reservation's expiry (--prefill-timeout-ms + 5 s: 8 s here)
    stall_router, stall_http = krprocs.start(args.work, "router-stall", [
        b + "/kvrelay-router", "--model", args.model, "--nodes", os.path.join(args.work, "nodes.json"),
        "--id", "router-stall", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--served-model-name", NAME,
        "--decode-stall-ms", "500", "--prefill-timeout-ms", "3000"])
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "n": 2, "seed": SEED,
            "stream": True}
    req = urllib.request.Request("http://%s/v1/completions" % stall_http, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    seen, events, frozen = set(), [], False
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line[6:] != "[DONE]" and "choices" in json.loads(line[6:]):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
                if not frozen and seen == {0, 1}:
                    krprocs.signal("decode", signal.SIGSTOP)
                    frozen = True
    finally:
        if frozen:
            krprocs.signal("decode", signal.SIGCONT)
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    check(frozen and events[-1:] == ["[DONE]"] and len(errors) == 1 and errors[0].get("code") == "service_unavailable"
          and "--decode-stall-ms" in errors[0].get("message", ""),
          "a decode node failing under n=2: want one error event (service_unavailable) before [DONE], got %s" %
          events[-3:])
    deadline = time.time() + 25
    while time.time() < deadline:
        held = (metric(dec_http, "kvrelay_kv_blocks_used"), metric(dec_http, "kvrelay_kv_blocks_reserved"))
        if held == (0, 0):
            break
        time.sleep(0.2)
    check(held == (0, 0), "after the failed stream the decode node holds %s blocks (used, reserved)" % (held,))
    print("ok: a decode node failing mid-stream under n=2 ends the stream with one error event; no block held")


krprocs.run(main)
krprocs.finish("openai_choices", args.work)
