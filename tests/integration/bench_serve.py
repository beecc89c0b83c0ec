"""bench_serve.py - run by bench_serve.sh against a running cluster: every kvrelay-bench-serve run
must account for exactly what the router counted, and bad input must stop it with exit 2 and a
message naming the fault, before anything is sent. Counts only, never latencies.
"""
import argparse
import json
import os
import subprocess
import sys
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
    t = time.time()
    r = subprocess.run([a.bench, "--no-progress"] + list(flags), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=300)
    name = " ".join(flags)
    if not check(r.returncode == expect, "exit %d, wanted %d: %s\nstdout:\n%s\nstderr:\n%s"
                 % (r.returncode, expect, name, r.stdout[-2000:], r.stderr[-2000:])):
        return None
    print("ok: exit %d in %.1f s: %s" % (expect, time.time() - t, name))
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


def main():
    ap = argparse.ArgumentParser()
    for flag in ("--bench", "--cli", "--router", "--http", "--work"):
        ap.add_argument(flag, required=True)
    a = ap.parse_args()
    w = a.work
    P2 = "streaming:sink=4,window=32"

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

    # ---------------------------------------------------------------- bad input: exit 2, nothing sent
    with open(w + "/bad.jsonl", "w") as f:
        f.write('{"arrival_s": 0, "prompt_tokens": 8, "output_tokens": 2}\n')
        f.write('{"arrival_s": 0.1, "prompt_tokens": 8, "output_tokens": 2}\n')
        f.write('{"arrival_s": 0.2, "prompt_tokens": 8, "output_tokens": 0}\n')
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
