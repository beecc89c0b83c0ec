"""bench_serve.py - run by bench_serve.sh against a running cluster: every kvrelay-bench-serve run
must account for exactly what the router counted, and bad input must stop it with exit 2 and a
message naming the fault, before anything is sent. Counts only, never latencies. First, without
the cluster, the workload generators: the same seed gives the same conversations and prompts,
and every turn's prompt holds the previous turn's prompt and answer.
"""
import argparse
import http.server
import importlib.machinery
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL: " + what, file=sys.stderr)
    return cond


def counters(http):
    """(requests over every status, prompt tokens, generated tokens) from the router's /metrics."""
    text = urllib.request.urlopen("http://%s/metrics" % http, timeout=10).read().decode()
    req = prompt = gen = 0
    for line in text.splitlines():
        if line.startswith("kvrelay_requests_total{"):
            req += int(float(line.split()[-1]))
        elif line.startswith("kvrelay_prompt_tokens_total "):
            prompt = int(float(line.split()[-1]))
        elif line.startswith("kvrelay_tokens_generated_total "):
            gen = int(float(line.split()[-1]))
    return req, prompt, gen


def settled(http):
    """The counters once no request is in flight (a finished stream is counted as it ends)."""
    prev = None
    for _ in range(50):
        cur = counters(http)
        if cur == prev:
            return cur
        prev = cur
        time.sleep(0.1)
    return prev


def bench(a, *flags, expect=0):
    """Runs the tool; None (a failure recorded) unless it exits `expect` (an exit status or a tuple)."""
    t = time.time()
    r = subprocess.run([a.bench, "--no-progress"] + list(flags), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    name = " ".join(flags)
    if not check(r.returncode in (expect if isinstance(expect, tuple) else (expect,)), "exit %d, wanted %s: %s\nstdout:\n%s\n"
                 "stderr:\n%s" % (r.returncode, expect, name, r.stdout[-2000:], r.stderr[-2000:])):
        return None
    print("ok: exit %d in %.1f s: %s" % (r.returncode, time.time() - t, name))
    return r


def rows_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_counts(what, before, after, sent):
    d = tuple(x - y for x, y in zip(after, before))
    want = (sent["requests"], sent["prompt_tokens"], sent["completion_tokens"])
    check(d == want, "%s: the router counted (requests, prompt tokens, generated tokens) %s, the "
                     "bench says it sent %s" % (what, d, want))
    if d == want:
        print("ok: %s: router and bench agree: %d requests, %d prompt tokens, %d generated" % ((what,) + d))


def rows_match_sent(what, rows, sent):
    check(len(rows) == sent["requests"], "%s: %d rows in --requests-out, %d sent" % (what, len(rows), sent["requests"]))
    check(sum(r["prompt_tokens"] for r in rows) == sent["prompt_tokens"], "%s: rows' prompt tokens" % what)
    check(sum(r["tokens_received"] for r in rows) == sent["completion_tokens"], "%s: rows' tokens" % what)
    for r in rows:
        if not check(r["status"] == "OK", "%s: request %d ended %s: %s" % (what, r["index"], r["status"], r["error"])):
            return
        check(r["completion_tokens"] == r["tokens_received"],
              "%s: request %d: usage says %d tokens, %d were streamed" % (what, r["index"], r["completion_tokens"],
                                                                           r["tokens_received"]))
        if r["finish_reason"] == "length":
            check(r["completion_tokens"] == r["max_tokens"], "%s: request %d: finish length after %d of %d tokens"
                  % (what, r["index"], r["completion_tokens"], r["max_tokens"]))
        else:
            check(r["finish_reason"] == "eos" and r["completion_tokens"] <= r["max_tokens"],
                  "%s: request %d: finish %s" % (what, r["index"], r["finish_reason"]))
        check(r["served_by"] == {"prefill": "prefill-0", "decode": "decode-0"},
              "%s: request %d served by %s" % (what, r["index"], r["served_by"]))
        check(r["queue_s"] is not None and r["kv_bytes_shipped"] > 0 and r["peak_kv_entries"] > 0,
              "%s: request %d lacks usage figures: %s" % (what, r["index"], r))
        check(r["ttft_s"] is not None and r["e2e_s"] is not None and len(r["itl_s"]) >= 0,
              "%s: request %d lacks timings" % (what, r["index"]))


class FakeText:
    """A PromptSource without a router: BOS 1, then the ids 100..399 as the text."""
    bos, ids = [1], list(range(100, 400))


def check_generators(a):
    """The chat and shared-prefix generators and the turn assembly, on a fake text."""
    mod = importlib.machinery.SourceFileLoader("kvrelay_bench_serve", a.bench).load_module()
    FakeText.window, FakeText.prompt = mod.PromptSource.window, mod.PromptSource.prompt
    chat = ["--target", "h:1", "--workload", "chat", "--concurrency", "2", "--conversations", "6", "--turns",
            "2:4", "--prefixes", "2", "--prefix-len", "20", "--message-len", "3:9", "--output-len", "2:5"]

    def play(seed):
        """Every turn of every conversation, with answers [7] * completion_tokens."""
        plan = mod.Plan(mod.parse_args(chat + ["--seed", str(seed)]), FakeText(), None)
        out = []
        for j, turns in enumerate(plan.sessions):
            prev = None
            for k, (index, line) in enumerate(turns):
                req = plan.turn(j, index, line, prev, k == len(turns) - 1)
                answer = [7] * req["output_len"]
                out.append((j, line["turn"], line["think_s"], req["prompt_ids"], answer, req["reusable_tokens"]))
                prev = (req["prompt_ids"], {"completion_tokens": len(answer), "output_ids": answer})
        return out
    first, again, other = play(1), play(1), play(2)
    check(first == again, "chat: the same seed gave other conversations")
    check(first != other, "chat: seeds 1 and 2 gave the same conversations")
    check(len({x[0] for x in first}) == 6 and {len([x for x in first if x[0] == j]) for j in range(6)} <= {2, 3, 4},
          "chat: not 6 conversations of 2 to 4 turns: %s" % [(x[0], x[1]) for x in first])
    systems = set()
    for (j, turn, think, ids, answer, reusable), prev in zip(first, [None] + first):
        if turn == 1:
            check(think == 0 and 23 <= len(ids) <= 29 and ids[0] == 1, "chat: a first turn is not system + message")
            systems.add(tuple(ids[:20]))
        else:
            want = prev[3] + prev[4]
            check(prev[0] == j and ids[:len(want)] == want and 3 <= len(ids) - len(want) <= 9 and reusable == len(want)
                  and think >= 0, "chat: conversation %d turn %d does not extend its previous prompt and answer" % (j, turn))
    check(len(systems) == 2, "chat: %d distinct system prompts, --prefixes 2" % len(systems))
    shared = mod.parse_args(["--target", "h:1", "--workload", "shared-prefix", "--rate", "5", "--prefixes", "3",
                             "--prefix-len", "30", "--message-len", "4"])
    reqs = [mod.Plan(shared, FakeText(), None).request(i) for i in range(12)]
    check([r["prompt_ids"] for r in reqs] == [mod.Plan(shared, FakeText(), None).request(i)["prompt_ids"]
                                                for i in range(12)], "shared-prefix: not deterministic")
    docs = {}
    for r in reqs:
        docs.setdefault(r["prefix"], set()).add(tuple(r["prompt_ids"][:30]))
        check(r["prompt_len"] == 34 and len(r["prompt_ids"]) == 34, "shared-prefix: a prompt of %d tokens" % r["prompt_len"])
    check(len(docs) == 3 and all(len(v) == 1 for v in docs.values()) and len(set().union(*docs.values())) == 3,
          "shared-prefix: documents are not 3 distinct prefixes shared by their requests: %s" % docs)
    if not failures:
        print("ok: generators: deterministic per seed, turns extend their previous turns, prefixes shared")


def chat_rows_ok(what, rows, prefix_len, message, grpc):
    """A chat run's rows: every turn OK, its prompt = the previous prompt + its answer + a message
    (or, turn 1, the system prompt + a message), sent only after the previous answer ended."""
    by = {}
    for r in rows:
        by.setdefault(r["conversation"], []).append(r)
    for c, turns in by.items():
        turns.sort(key=lambda r: r["turn"])
        check([r["turn"] for r in turns] == list(range(1, len(turns) + 1)), "%s: %s has turns %s"
              % (what, c, [r["turn"] for r in turns]))
        for prev, r in zip([None] + turns, turns):
            if prev is None:
                check(r["prompt_tokens"] == prefix_len + message and r["reusable_tokens"] in (0, prefix_len),
                      "%s: %s turn 1: prompt %d, reusable %d" % (what, c, r["prompt_tokens"], r["reusable_tokens"]))
                continue
            grown = prev["prompt_tokens"] + prev["completion_tokens"] + message
            reused = prev["prompt_tokens"] + (prev["completion_tokens"] if grpc else 0)
            check(r["prompt_tokens"] == grown and r["reusable_tokens"] == reused,
                  "%s: %s turn %d: prompt %d, reusable %d; wanted %d, %d" % (what, c, r["turn"], r["prompt_tokens"],
                                                                          r["reusable_tokens"], grown, reused))
            check(r["sent_s"] >= prev["end_s"], "%s: %s turn %d sent at %.3f s, before the previous answer ended at "
                  "%.3f s" % (what, c, r["turn"], r["sent_s"], prev["end_s"]))
            check(r["cached_tokens"] is None or 0 <= r["cached_tokens"] <= r["prompt_tokens"],
                  "%s: %s turn %d: cached_tokens %s" % (what, c, r["turn"], r["cached_tokens"]))
    return by


class LlamaServerStub(http.server.BaseHTTPRequestHandler):
    """The parts of llama-server's OpenAI API the bench reads: a model owned by llamacpp, and
    streamed completions of max_tokens chunks whose last chunk has usage and timings (prompt_n:
    all but 3 of the prompt's tokens evaluated). Keeps every request body in `bodies`. With
    `failing` set, a stream ends as b4748's does when a request fails after its 200: one chunk,
    then an 'error: JSON' line (not a data: line), then [DONE]."""
    bodies = []
    failing = False
    error = "Input prompt is too big compared to KV size. Please try increasing KV size."

    def log_message(self, *args):
        pass

    def send(self, body, ctype):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        self.send(json.dumps({"object": "list", "data": [{"id": "stub", "object": "model", "owned_by": "llamacpp"}]}),
                  "application/json")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        LlamaServerStub.bodies.append(req)
        n, p = req["max_tokens"], len(req["prompt"])
        if LlamaServerStub.failing:
            err = {"code": 500, "message": LlamaServerStub.error, "type": "server_error"}
            self.send("data: %s\n\nerror: %s\n\ndata: [DONE]\n\n" % (json.dumps(
                {"choices": [{"text": "x", "index": 0, "finish_reason": None}]}), json.dumps(err)), "text/event-stream")
            return
        events = [{"choices": [{"text": "x", "index": 0, "finish_reason": None}]}] * n + [
            {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
             "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n},
             "timings": {"prompt_n": p - 3, "predicted_n": n}}]
        self.send("".join("data: %s\n\n" % json.dumps(e) for e in events) + "data: [DONE]\n\n", "text/event-stream")


def check_foreign_openai(a, w):
    """Another server's OpenAI API (a llama-server stub): --ignore-eos and --extra-body reach its
    bodies, no kvrelay field does, and its timings give the cached tokens; a stream ended by an
    'error:' line is an error row carrying its message."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), LlamaServerStub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = bench(a, "--openai", "http://127.0.0.1:%d/v1" % srv.server_address[1], "--target", a.router,
                  "--concurrency", "2", "--num-requests", "4", "--prompt-len", "20", "--output-len", "3",
                  "--ignore-eos", "--extra-body", '{"cache_prompt": false}', "--json", w + "/stub.json",
                  "--requests-out", w + "/stub.jsonl")
    finally:
        srv.shutdown()
    if not r:
        return
    bodies, rows = LlamaServerStub.bodies, rows_of(w + "/stub.jsonl")
    s = json.load(open(w + "/stub.json"))["runs"][0]["summary"]
    check(len(bodies) == 4 and all(b["ignore_eos"] is True and b["cache_prompt"] is False and "kv_policy" not in b
                                   and len(b["prompt"]) == 20 for b in bodies),
          "llama-server stub: the bodies sent: %s" % bodies)
    check(all(x["status"] == "OK" and x["cached_tokens"] == 3 and x["completion_tokens"] == 3 for x in rows)
          and s["cached_tokens"] == 12 and s["cache_hit_rate"] == 1.0 and "prefix cache" in r.stdout,
          "llama-server stub: rows %s, summary cached %s" % ([(x["status"], x["error"], x["cached_tokens"])
                                                             for x in rows], s.get("cached_tokens")))
    # a request that fails in mid-stream: the row says so, with the server's message
    LlamaServerStub.failing = True
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), LlamaServerStub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = bench(a, "--openai", "http://127.0.0.1:%d/v1" % srv.server_address[1], "--target", a.router,
                  "--concurrency", "1", "--num-requests", "2", "--prompt-len", "20", "--output-len", "3",
                  "--json", w + "/stub-failing.json", "--requests-out", w + "/stub-failing.jsonl", expect=1)
    finally:
        srv.shutdown()
        LlamaServerStub.failing = False
    if r:
        frows = rows_of(w + "/stub-failing.jsonl")
        check(len(frows) == 2 and all(x["status"] == "HTTP 200 error event" and x["error"] == LlamaServerStub.error
                                      for x in frows),
              "llama-server stub, failing: rows %s" % [(x["status"], x["error"]) for x in frows])


def main():
    ap = argparse.ArgumentParser()
    for flag in ("--bench", "--cli", "--router", "--http", "--work"):
        ap.add_argument(flag, required=True)
    a = ap.parse_args()
    w = a.work
    P2 = "streaming:sink=4,window=32"
    check_generators(a)

    # ---------------------------------------------------------------- ~10 s of Poisson load
    before = settled(a.http)
    r = bench(a, "--target", a.router, "--rate", "20", "--duration", "10", "--warmup", "4",
              "--prompt-len", "64", "--output-len", "16", "--policy", "full", "--policy", P2,
              "--json", w + "/load.json", "--requests-out", w + "/load.jsonl", "--plot", w + "/plots",
              "--slo", "ttft_ms=500,tpot_ms=50,e2e_ms=2000")
    if r:
        out = json.load(open(w + "/load.json"))
        run = out["runs"][0]
        sent, s = run["sent"], run["summary"]
        check_counts("rate 20 for 10 s", before, settled(a.http), sent)
        rows = rows_of(w + "/load.jsonl")
        rows_match_sent("rate 20 for 10 s", rows, sent)
        check(sent["warmup"] == 4 and s["requests"] == sent["requests"] - 4,
              "warmup: %d sent, %d warmup, %d measured" % (sent["requests"], sent["warmup"], s["requests"]))
        check(120 <= sent["requests"] <= 300, "%d requests in 10 s at 20/s" % sent["requests"])
        check(all(x["prompt_tokens"] == 64 and x["max_tokens"] == 16 for x in rows), "lengths are not 64 and 16")
        per = run["policies"]
        check(set(per) == {"full", P2}, "policies in the summary: %s" % list(per))
        if set(per) == {"full", P2}:
            check(per["full"]["requests"] + per[P2]["requests"] == s["requests"]
                  and abs(per["full"]["requests"] - per[P2]["requests"]) <= 1,
                  "the policies do not alternate: %d and %d of %d" % (per["full"]["requests"],
                                                                     per[P2]["requests"], s["requests"]))
            check(per[P2]["kv_bytes_shipped"] < per["full"]["kv_bytes_shipped"],
                  "streaming shipped no fewer KV bytes than full")
        check(s["errors"] == {} and s["ok"] == s["requests"], "errors: %s" % s["errors"])
        check(0 <= s["good"] <= s["ok"] and s["goodput"] is not None,
              "goodput: %s good of %d ok" % (s.get("good"), s["ok"]))
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms"):
            check(s[key]["n"] > 0, "no %s samples" % key)
        check("TTFT" in r.stdout and "goodput" in r.stdout and P2 in r.stdout, "the table lacks rows:\n" + r.stdout)
        check(os.path.getsize(w + "/plots/latency-cdf.png") > 1000, "no latency CDF plot")

    # ---------------------------------------------------------------- a replayed trace
    text = "And God said, Let there be light"
    ids = subprocess.run([a.cli, "--router", a.router, "tokenize", "--text", text, "--add-special"],
                         stdout=subprocess.PIPE, text=True, check=True).stdout.split()
    trace = [  # arrival_s, prompt, output_tokens, policy
        (0.00, 40, 8, "full"), (0.05, 120, 4, P2), (0.10, 17, 12, None),
        (0.30, [2045, 5, 9, 2, 44, 7], 6, "snapkv:mode=patched,budget=32,obs=8"),
        (0.30, 200, 3, P2), (0.45, text, 5, "full"), (0.60, 64, 16, None), (0.80, 33, 1, "full"),
        (0.90, 300, 9, "streaming:sink=4,window=64"), (1.10, 8, 7, P2), (1.20, 96, 2, None),
        (1.50, 50, 10, "snapkv:mode=patched,budget=32,obs=8")]
    with open(w + "/trace.jsonl", "w") as f:
        for at, prompt, out_len, pol in trace:
            line = {"arrival_s": at, "output_tokens": out_len}
            line["prompt" if isinstance(prompt, str) else "prompt_tokens"] = prompt
            if pol:
                line["policy"] = pol
            f.write(json.dumps(line) + "\n")
    before = settled(a.http)
    r = bench(a, "--target", a.router, "--trace", w + "/trace.jsonl", "--policy", "full", "--policy", P2,
              "--json", w + "/trace.json", "--requests-out", w + "/trace-rows.jsonl")
    if r:
        sent = json.load(open(w + "/trace.json"))["runs"][0]["sent"]
        check_counts("trace", before, settled(a.http), sent)
        rows = rows_of(w + "/trace-rows.jsonl")
        rows_match_sent("trace", rows, sent)
        check(len(rows) == len(trace), "trace: %d rows for %d lines" % (len(rows), len(trace)))
        for k, (row, (at, prompt, out_len, pol)) in enumerate(zip(rows, trace)):
            want_len = len(ids) if isinstance(prompt, str) else len(prompt) if isinstance(prompt, list) else prompt
            want_pol = pol or ("full", P2)[k % 2]  # lines without a policy cycle through --policy
            check(row["trace_line"] == k + 1 and row["prompt_tokens"] == want_len and row["max_tokens"] == out_len
                  and row["policy"] == want_pol and row["scheduled_s"] == at,
                  "trace line %d: sent %s, the line says prompt %d, output %d, policy %s, at %g"
                  % (k + 1, {x: row[x] for x in ("trace_line", "prompt_tokens", "max_tokens", "policy",
                                                 "scheduled_s")}, want_len, out_len, want_pol, at))

    # ---------------------------------------------------------------- a sweep of two rates
    before = settled(a.http)
    r = bench(a, "--target", a.router, "--rate", "10,30", "--num-requests", "5", "--prompt-len", "16:48",
              "--output-len", "4:8", "--policy", "full", "--policy", P2, "--json", w + "/sweep.json",
              "--plot", w + "/plots")
    if r:
        runs = json.load(open(w + "/sweep.json"))["runs"]
        check([x["mode"]["rate"] for x in runs] == [10, 30], "sweep runs: %s" % [x["mode"] for x in runs])
        total = {k: sum(x["sent"][k] for x in runs) for k in ("requests", "prompt_tokens", "completion_tokens")}
        check_counts("sweep", before, settled(a.http), total)
        check(runs[0]["sent"] == runs[1]["sent"], "a sweep's runs did not send the same requests: %s"
              % [x["sent"] for x in runs])
        check(os.path.getsize(w + "/plots/sweep.png") > 1000, "no sweep plot")

    # ---------------------------------------------------------------- the OpenAI HTTP API
    before = settled(a.http)
    r = bench(a, "--openai", "http://%s/v1" % a.http, "--target", a.router, "--concurrency", "2",
              "--num-requests", "6", "--prompt-len", "24:40", "--output-len", "6", "--policy", "full",
              "--policy", P2, "--wire-dtype", "int8", "--json", w + "/openai.json",
              "--requests-out", w + "/openai.jsonl")
    if r:
        out = json.load(open(w + "/openai.json"))
        sent = out["runs"][0]["sent"]
        check(out["api"] == "openai" and sent["requests"] == 6, "openai run: %s, %s" % (out["api"], sent))
        check_counts("openai", before, settled(a.http), sent)
        orows = rows_of(w + "/openai.jsonl")
        rows_match_sent("openai", orows, sent)
        check(out["wire_dtype"] == "int8" and all(x["kv_wire_dtype"] == "int8+scale" for x in orows),
              "--wire-dtype int8: %s, rows say %s" % (out["wire_dtype"], {x["kv_wire_dtype"] for x in orows}))

    # ---------------------------------------------------------------- chat, gRPC: real answers appended
    before = settled(a.http)
    r = bench(a, "--target", a.router, "--workload", "chat", "--concurrency", "2", "--conversations", "3",
              "--warmup", "1", "--turns", "3", "--think-time", "0.05", "--prefix-len", "48", "--message-len", "8",
              "--output-len", "6", "--json", w + "/chat.json", "--requests-out", w + "/chat.jsonl")
    if r:
        run = json.load(open(w + "/chat.json"))["runs"][0]
        check_counts("chat", before, settled(a.http), run["sent"])
        rows = rows_of(w + "/chat.jsonl")
        rows_match_sent("chat", rows, run["sent"])
        by = chat_rows_ok("chat", rows, 48, 8, True)
        check(len(by) == 4 and len(rows) == 12 and run["summary"]["requests"] == 9,
              "chat: %d conversations, %d rows, %d measured; wanted 4 (1 warmup), 12, 9"
              % (len(by), len(rows), run["summary"]["requests"]))
        s = run["summary"]
        check(s["reusable_tokens"] == sum(x["reusable_tokens"] for x in rows if not x["warmup"]) > 0
              and "prefix cache" in r.stdout, "chat: the summary's reuse figures: %s" % {k: s.get(k) for k in (
                  "reusable_tokens", "cached_tokens", "cache_hit_rate")})

    # ---------------------------------------------------------------- chat, OpenAI: stand-in answers
    before = settled(a.http)
    r = bench(a, "--openai", "http://%s/v1" % a.http, "--target", a.router, "--workload", "chat", "--rate", "4",
              "--conversations", "2", "--turns", "2", "--think-time", "0", "--prefix-len", "32", "--message-len",
              "5", "--output-len", "4", "--json", w + "/chat-openai.json", "--requests-out", w + "/chat-openai.jsonl")
    if r:
        run = json.load(open(w + "/chat-openai.json"))["runs"][0]
        check_counts("chat over openai", before, settled(a.http), run["sent"])
        rows = rows_of(w + "/chat-openai.jsonl")
        check(len(rows) == 4 and all(x["status"] == "OK" for x in rows), "chat over openai: rows %s"
              % [(x["status"], x["error"]) for x in rows])
        chat_rows_ok("chat over openai", rows, 32, 5, False)

    # ---------------------------------------------------------------- shared prefixes
    before = settled(a.http)
    r = bench(a, "--target", a.router, "--workload", "shared-prefix", "--rate", "20", "--num-requests", "8",
              "--prefixes", "2", "--prefix-len", "40", "--message-len", "8", "--output-len", "4",
              "--json", w + "/shared.json", "--requests-out", w + "/shared.jsonl")
    if r:
        run = json.load(open(w + "/shared.json"))["runs"][0]
        check_counts("shared prefix", before, settled(a.http), run["sent"])
        rows = rows_of(w + "/shared.jsonl")
        rows_match_sent("shared prefix", rows, run["sent"])
        seen = set()
        for x in sorted(rows, key=lambda x: x["sent_s"]):
            check(x["prompt_tokens"] == 48 and x["prefix"] in ("doc-0", "doc-1")
                  and x["reusable_tokens"] == (40 if x["prefix"] in seen else 0),
                  "shared prefix: request %d: %s" % (x["index"], {k: x[k] for k in ("prefix", "prompt_tokens",
                                                                                    "reusable_tokens")}))
            seen.add(x["prefix"])

    # ---------------------------------------------------------------- a trace with conversations
    with open(w + "/conv.jsonl", "w") as f:
        for line in [
                {"conversation": "a", "turn": 1, "arrival_s": 0, "prefix": "sys", "prefix_tokens": 30,
                 "prompt_tokens": 6, "output_tokens": 3},
                {"arrival_s": 0.05, "prompt_tokens": 12, "output_tokens": 2, "policy": P2},
                {"conversation": 7, "turn": 1, "arrival_s": 0.1, "prefix": "sys", "prompt_tokens": [5, 9, 11],
                 "output_tokens": 4},
                {"conversation": "a", "turn": 2, "think_s": 0.05, "prompt_tokens": 4, "output_tokens": 3},
                {"conversation": 7, "turn": 2, "prompt_tokens": [12, 13], "output_tokens": 2},
                {"conversation": "a", "turn": 3, "think_s": 0.02, "prompt_tokens": 5, "output_tokens": 1}]:
            f.write(json.dumps(line) + "\n")
    before = settled(a.http)
    r = bench(a, "--target", a.router, "--trace", w + "/conv.jsonl", "--json", w + "/conv.json",
              "--requests-out", w + "/conv-rows.jsonl")
    if r:
        sent = json.load(open(w + "/conv.json"))["runs"][0]["sent"]
        check_counts("conversation trace", before, settled(a.http), sent)
        rows = rows_of(w + "/conv-rows.jsonl")
        rows_match_sent("conversation trace", rows, sent)
        check([(x["trace_line"], x["conversation"], x["turn"]) for x in rows] ==
              [(1, "a", 1), (2, None, None), (3, "7", 1), (4, "a", 2), (5, "7", 2), (6, "a", 3)],
              "conversation trace: rows %s" % [(x["trace_line"], x["conversation"], x["turn"]) for x in rows])
        if len(rows) == 6:
            a1, lone, s1, a2, s2, a3 = rows
            # the prefix is reusable when conversation a sent it first (it is due 0.1 s before)
            check(lone["prompt_tokens"] == 12 and lone["policy"] == P2 and s1["prompt_tokens"] == 33
                  and s1["reusable_tokens"] == (30 if a1["sent_s"] < s1["sent_s"] else 0),
                  "conversation trace: lone %d, conversation 7 turn 1 %d (reusable %d)"
                  % (lone["prompt_tokens"], s1["prompt_tokens"], s1["reusable_tokens"]))
            for prev, x, own in ((a1, a2, 4), (a2, a3, 5), (s1, s2, 2)):
                check(x["prompt_tokens"] == prev["prompt_tokens"] + prev["completion_tokens"] + own
                      and x["sent_s"] >= prev["end_s"], "conversation trace: line %d does not follow line %d"
                      % (x["trace_line"], prev["trace_line"]))

    # ---------------------------------------------------------------- --ignore-eos is sent when asked
    for api in (["--openai", "http://%s/v1" % a.http], []):
        r = bench(a, *api, "--target", a.router, "--concurrency", "1", "--num-requests", "2", "--prompt-len", "16",
                  "--output-len", "5", "--ignore-eos", "--json", w + "/eos.json", "--requests-out", w + "/eos.jsonl",
                  expect=(0, 1, 2))
        if r and r.returncode == 2:  # a proto without the field: refused before anything is sent
            check(not api and "no GenerateRequest.ignore_eos" in r.stderr, "--ignore-eos: %s" % r.stderr)
        elif r:
            out = json.load(open(w + "/eos.json"))
            rows = rows_of(w + "/eos.jsonl")
            # a router that reads ignore_eos streams every max_tokens; one that does not names it in its 400
            check(out["ignore_eos"] is True and len(rows) == 2 and (
                all(x["status"] == "OK" and x["finish_reason"] == "length" and x["completion_tokens"] == 5
                    for x in rows)
                or all(x["status"] in ("HTTP 400", "INVALID_ARGUMENT") and "ignore_eos" in x["error"] for x in rows)),
                "--ignore-eos %s: %s" % (out["api"], [(x["status"], x["error"], x.get("finish_reason")) for x in rows]))

    check_foreign_openai(a, w)

    # ---------------------------------------------------------------- bad input: exit 2, nothing sent
    with open(w + "/bad.jsonl", "w") as f:
        f.write('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 2}\n')
        f.write('{"arrival_s": 0.1, "prompt_tokens": 8, "output_tokens": 2}\n')
        f.write('{"arrival_s": 0.2, "prompt_tokens": 8, "output_tokens": 0}\n')
    with open(w + "/bad-turn.jsonl", "w") as f:
        f.write('{"conversation": "x", "turn": 1, "arrival_s": 0, "prompt_tokens": 8, "output_tokens": 2}\n')
        f.write('{"conversation": "x", "turn": 3, "prompt_tokens": 8, "output_tokens": 2}\n')
    with open(w + "/bad-json.jsonl", "w") as f:
        f.write('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 2}\n\n{"arrival_s": 1,\n')
    before = settled(a.http)
    cases = [
        (["--target", a.router, "--trace", w + "/bad.jsonl"], "bad.jsonl:3: output_tokens"),
        (["--target", a.router, "--trace", w + "/bad-json.jsonl"], "bad-json.jsonl:3: not a JSON object"),
        (["--target", a.router, "--rate", "5", "--slo", "ttft_ms=100,tpot=5"], "unknown key 'tpot'"),
        (["--target", a.router, "--rate", "5", "--concurrency", "2"], "--rate and --concurrency conflict"),
        (["--target", a.router, "--trace", w + "/bad.jsonl", "--num-requests", "3"],
         "--trace and --num-requests conflict"),
        (["--target", a.router, "--rate", "5", "--num-requests", "3", "--duration", "2"],
         "--num-requests and --duration conflict"),
        (["--target", a.router, "--burstiness", "0.5", "--concurrency", "2"], "--burstiness needs --rate"),
        (["--target", a.router, "--rate", "5", "--prompt-len", "9:3"], "argument --prompt-len: '9:3'"),
        (["--target", a.router, "--trace", w + "/bad-turn.jsonl"], "bad-turn.jsonl:2: conversation x: turn 3 after "
         "its turn 1 (line 1)"),
        (["--target", a.router, "--workload", "chat", "--rate", "2", "--num-requests", "3"],
         "--num-requests and --workload chat conflict"),
        (["--target", a.router, "--rate", "2", "--think-time", "1"], "--think-time needs --workload chat"),
        (["--target", "127.0.0.1:1", "--rate", "5", "--connect-timeout", "1"], "--target 127.0.0.1:1: no router answers"),
        (["--openai", "http://127.0.0.1:1/v1", "--target", a.router, "--rate", "5", "--connect-timeout", "1"],
         "--openai http://127.0.0.1:1/v1: the router does not answer"),
    ]
    for flags, want in cases:
        r = bench(a, *flags, expect=2)
        if r:
            check(want in r.stderr and "Traceback" not in r.stderr,
                  "%s: stderr does not say %r:\n%s" % (" ".join(flags), want, r.stderr))
    check(settled(a.http) == before, "bad input sent requests: %s -> %s" % (before, settled(a.http)))

    if failures:
        print("%d checks failed" % len(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
