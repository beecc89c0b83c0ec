"""python_logprobs.py - the checks of python_logprobs.sh: forced continuation tokens and their
log-probabilities (GenerateRequest.forced / logprobs, TokenDelta.logprobs / top_ids) through a
real cluster of one kvrelay-decode, one kvrelay-prefill and one kvrelay-router on the bundled
random-weight default model (its config copied with a 256-token context so that "over the
context" is cheap to ask; the context does not enter the computation).

Checked, for the full policy and two eviction policies (snapkv patched with a budget, streaming):
  - the cluster's forced-token logprobs and top_ids equal `kvrelay-generate --force-ids ...
    --logprobs --json` with the same policy, chunk (16) and thread count (1) bit for bit (the
    nodes and the tool run the same kr_logprob on bit-identical logits: docs/engine.md), the ids
    are the forced ones, each delta's logprobs and top_ids align with its ids, every logprob is
    finite and <= 0 (comparisons are written so that NaN fails them), Finish says LENGTH with
    completion_tokens = len(forced);
  - forcing the greedy continuation gives top_ids equal to it;
  - EOS, a stop id and a stop string inside or alongside the forced ids do not end it early;
  - logprobs=true without forcing returns the sampled (greedy) tokens' logprobs, equal to
    kvrelay-generate --logprobs;
  - forced and normal requests at once (the decode node batches them together) give what they
    give alone;
  - a normal request without the new fields carries no logprobs or top_ids;
  - refusals, INVALID_ARGUMENT: max_tokens neither 0 nor len(forced), a forced id outside the
    vocabulary, more forced ids than --max-tokens-limit, prompt + forced over the context.
Run through python_logprobs.sh (it generates the stubs); every process is killed at the end.
"""
import json
import math
import os
import subprocess
import threading

import krprocs  # beside this script: Python puts its directory on sys.path

args = krprocs.parse_args()

import grpc  # noqa: E402
from kvrelay.v1 import kvrelay_pb2 as pb  # noqa: E402
from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc  # noqa: E402
from krprocs import check  # noqa: E402

CONTEXT = 256
CHUNK = 16
MAX_TOKENS_LIMIT = 64
POLICIES = ["full", "snapkv:mode=patched,budget=40,obs=8", "streaming:sink=4,window=16"]
def model_copy(src, dst):
    """The model with max_position_embeddings CONTEXT; every other file linked."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(os.path.abspath(src), f), os.path.join(dst, f))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["max_position_embeddings"] = CONTEXT
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return cfg


def one_process(model, ids, extra):
    """kvrelay-generate's JSON for the same request, in one process, as the nodes run it."""
    out = subprocess.run([os.path.join(args.bin, "kvrelay-generate"), "--model", model,
                          "--ids", " ".join(map(str, ids)), "--chunk", str(CHUNK), "--threads", "1",
                          "--json"] + extra, check=True, capture_output=True, timeout=300)
    return json.loads(out.stdout)


def generate(stub, req, timeout=300):
    """The whole stream: {ids, logprobs, top_ids, deltas (ids, n logprobs, n top_ids), finish}."""
    r = {"ids": [], "logprobs": [], "top_ids": [], "deltas": [], "finish": None}
    for msg in stub.Generate(req, timeout=timeout):
        if msg.WhichOneof("event") == "delta":
            d = msg.delta
            r["ids"].extend(d.ids)
            r["logprobs"].extend(d.logprobs)
            r["top_ids"].extend(d.top_ids)
            r["deltas"].append((len(d.ids), len(d.logprobs), len(d.top_ids)))
        else:
            check(r["finish"] is None, "two finish messages")
            r["finish"] = msg.finish
    return r


def all_ok_logprobs(lps):
    # written so that NaN fails: NaN <= 0 is False, isfinite(NaN) is False
    return all(isinstance(x, float) and math.isfinite(x) and x <= 0.0 for x in lps)


def check_scored(what, got, forced, want):
    """A forced request's stream against kvrelay-generate's JSON for the same forcing."""
    check(got["ids"] == forced, "%s: ids %s != forced %s" % (what, got["ids"], forced))
    check(len(got["logprobs"]) == len(forced) and len(got["top_ids"]) == len(forced),
          "%s: %d logprobs, %d top_ids for %d forced" % (what, len(got["logprobs"]), len(got["top_ids"]), len(forced)))
    check(all(n == nl == nt for n, nl, nt in got["deltas"] if n), "%s: a delta's logprobs/top_ids do not align "
          "with its ids: %s" % (what, got["deltas"]))
    check(all_ok_logprobs(got["logprobs"]), "%s: logprobs not finite and <= 0: %s" % (what, got["logprobs"]))
    check(want["ids"] == forced, "%s: kvrelay-generate ids %s" % (what, want["ids"]))
    check(all_ok_logprobs(want["logprobs"]), "%s: kvrelay-generate logprobs %s" % (what, want["logprobs"]))
    # bit for bit: same logits, same kr_logprob (float32 on the wire, float32 widened in JSON)
    same = len(got["logprobs"]) == len(want["logprobs"]) and all(
        a == b for a, b in zip(got["logprobs"], want["logprobs"]))
    check(same, "%s: cluster logprobs %s != kvrelay-generate %s" % (what, got["logprobs"], want["logprobs"]))
    check(got["top_ids"] == want["top_ids"], "%s: cluster top_ids %s != kvrelay-generate %s"
          % (what, got["top_ids"], want["top_ids"]))
    f = got["finish"]
    check(f is not None and f.reason == pb.FINISH_REASON_LENGTH and f.usage.completion_tokens == len(forced),
          "%s: finish %s" % (what, f))


def main():
    model = os.path.join(args.work, "model")
    cfg = model_copy(args.model, model)
    vocab, eos = cfg["vocab_size"], cfg["eos_token_id"]
    b = args.bin
    dec, _ = krprocs.start(args.work, "decode", [b + "/kvrelay-decode", "--model", model, "--id", "decode-0",
                           "--listen", "127.0.0.1:0", "--transfer", "127.0.0.1:0",
                           "--http", "127.0.0.1:0", "--kv-memory", "64M", "--threads", "1"])
    pre, _ = krprocs.start(args.work, "prefill", [b + "/kvrelay-prefill", "--model", model, "--id", "prefill-0",
                            "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "1",
                            "--chunk", str(CHUNK)])
    nodes = os.path.join(args.work, "nodes.json")
    with open(nodes, "w") as f:
        json.dump({"prefill": [{"id": "prefill-0", "address": pre}],
                   "decode": [{"id": "decode-0", "address": dec}]}, f)
    router, _ = krprocs.start(args.work, "router", [b + "/kvrelay-router", "--model", model, "--nodes", nodes,
                              "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                              "--max-tokens-limit", str(MAX_TOKENS_LIMIT)])
    channel = grpc.insecure_channel(router)
    gen = pb_grpc.GenerationStub(channel)

    # a real text prompt (BOS included) of ~100 tokens, and held-out text to score
    text = ("The relay carries the compressed cache from the prefill node to the decode node. "
            "Each node keeps what its policy allows, and the router streams the tokens back. ")
    prompt = list(gen.Tokenize(pb.TokenizeRequest(text=text * 3, add_special=True), timeout=30).ids)
    check(60 <= len(prompt) <= 200, "prompt of %d tokens" % len(prompt))
    held_out = list(gen.Tokenize(pb.TokenizeRequest(text=" the decode node keeps the window and the sink",
                                                    add_special=False), timeout=30).ids)
    check(len(held_out) >= 4, "held-out text of %d tokens" % len(held_out))
    # EOS inside the forced ids must not end the request
    forced = held_out[:3] + [eos] + held_out[3:] + [eos, held_out[0]]
    entries_full = len(prompt) * cfg["num_hidden_layers"] * cfg["num_key_value_heads"]

    refs = {}
    for pol in POLICIES:
        want = one_process(model, prompt, ["--force-ids", " ".join(map(str, forced)), "--logprobs", "--policy", pol])
        refs[pol] = want
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), forced=pb.TokenIds(ids=forced),
                                 kv_policy=pol, request_id="score-" + pol.split(":")[0],
                                 # ignored when forcing: they must not stop it or change a thing
                                 stop_ids=[held_out[1]], stop=["the"],
                                 sampling=pb.Sampling(temperature=0.9, seed=7))
        got = generate(gen, req)
        check_scored("forced, %s" % pol, got, forced, want)
        if pol != "full" and got["finish"] is not None:
            check(got["finish"].usage.kv_entries_shipped < entries_full,
                  "%s evicts: shipped %d of %d entries" % (pol, got["finish"].usage.kv_entries_shipped, entries_full))
        # logprobs differ between policies once eviction bites (else the test proves little)
    check(refs["full"]["logprobs"] != refs[POLICIES[2]]["logprobs"], "streaming gives the same logprobs as full")

    # ---- top_ids of the forced greedy continuation are that continuation
    n = 12
    for pol in POLICIES[:2]:
        greedy = generate(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=n, kv_policy=pol))
        g = greedy["ids"]
        check(len(g) >= 1, "greedy %s: %s" % (pol, g))
        got = generate(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), forced=pb.TokenIds(ids=g),
                                               max_tokens=len(g), kv_policy=pol))
        check(got["ids"] == g and got["top_ids"] == g, "forcing the greedy tokens %s (%s): top_ids %s"
              % (g, pol, got["top_ids"]))
        check(all_ok_logprobs(got["logprobs"]) and len(got["logprobs"]) == len(g),
              "greedy forced logprobs %s" % got["logprobs"])

    # ---- logprobs without forcing: the greedy tokens' own, as kvrelay-generate --logprobs
    want = one_process(model, prompt, ["--max-tokens", "8", "--greedy", "--logprobs", "--policy", POLICIES[2]])
    got = generate(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=8, logprobs=True,
                                           kv_policy=POLICIES[2]))
    k = len(got["ids"])  # the cluster stops at EOS, kvrelay-generate --ids does not
    check(k >= 1 and got["ids"] == want["ids"][:k], "logprobs=true ids %s != %s" % (got["ids"], want["ids"]))
    check(got["logprobs"] == want["logprobs"][:k] and all_ok_logprobs(got["logprobs"]),
          "logprobs=true: %s != kvrelay-generate %s" % (got["logprobs"], want["logprobs"][:k]))
    check(got["top_ids"] == got["ids"], "greedy tokens are their steps' argmax: %s vs %s" % (got["top_ids"], got["ids"]))

    # ---- a normal request carries none of it
    got = generate(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=6))
    check(len(got["ids"]) >= 1 and not got["logprobs"] and not got["top_ids"],
          "a normal request got logprobs %s / top_ids %s" % (got["logprobs"], got["top_ids"]))

    # ---- forced and normal sequences together in the decode node's batches
    results = {}

    def run(key, req):
        try:
            results[key] = generate(gen, req)
        except grpc.RpcError as e:
            results[key] = e

    normal_alone = generate(gen, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=len(forced)))
    threads = []
    for i in range(6):
        pol = POLICIES[i % len(POLICIES)]
        if i % 2 == 0:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), forced=pb.TokenIds(ids=forced), kv_policy=pol)
        else:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_tokens=len(forced))
        t = threading.Thread(target=run, args=((i, pol), req))
        threads.append(t)
        t.start()
    for t in threads:
        t.join()
    for (i, pol), got in sorted(results.items()):
        if isinstance(got, grpc.RpcError):
            check(False, "concurrent request %d: %s %s" % (i, got.code(), got.details()))
        elif i % 2 == 0:
            check_scored("concurrent forced %d, %s" % (i, pol), got, forced, refs[pol])
        else:
            check(got["ids"] == normal_alone["ids"] and not got["logprobs"],
                  "concurrent normal %d: %s != alone %s" % (i, got["ids"], normal_alone["ids"]))

    # ---- refusals
    def bad(req, needle):
        code, details = krprocs.code_of(lambda: generate(gen, req, timeout=30))
        check(code == grpc.StatusCode.INVALID_ARGUMENT and needle in details,
              "%s: got %s %r" % (needle, code, details))

    ids = pb.TokenIds(ids=prompt[:8])
    bad(pb.GenerateRequest(token_ids=ids, forced=pb.TokenIds(ids=[1, 2, 3]), max_tokens=4), "max_tokens")
    bad(pb.GenerateRequest(token_ids=ids, forced=pb.TokenIds(ids=[1, 2, 3]), max_tokens=2), "max_tokens")
    bad(pb.GenerateRequest(token_ids=ids, forced=pb.TokenIds(ids=[1, vocab])), "forced.ids[1]")
    bad(pb.GenerateRequest(token_ids=ids, forced=pb.TokenIds(ids=[1] * (MAX_TOKENS_LIMIT + 1))), "max-tokens-limit")
    bad(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * (CONTEXT - 10)), forced=pb.TokenIds(ids=[2] * 20)),
        "context")
    # max_tokens equal to the forced length is accepted, as is 0
    got = generate(gen, pb.GenerateRequest(token_ids=ids, forced=pb.TokenIds(ids=[1, 2, 3]), max_tokens=3))
    check(got["ids"] == [1, 2, 3] and len(got["logprobs"]) == 3, "max_tokens == len(forced): %s" % got["ids"])
    # one forced token: the prefill node alone scores it
    got = generate(gen, pb.GenerateRequest(token_ids=ids, forced=pb.TokenIds(ids=[eos])))
    check(got["ids"] == [eos] and len(got["logprobs"]) == 1 and all_ok_logprobs(got["logprobs"]),
          "one forced EOS: %s %s" % (got["ids"], got["logprobs"]))
    channel.close()


krprocs.run(main)
krprocs.finish("python_logprobs", args.work)
