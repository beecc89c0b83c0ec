"""limits.py - the checks of limits.sh: the router's limits through a real cluster of one
kvrelay-decode, one kvrelay-prefill and two kvrelay-routers on llama3-tiny.

Router "keyed": API keys from a file, --limit-concurrency 2, and per-key lines: key #1 (the flag's
cap 2), key #2 (concurrency=1), key #3 (concurrency=0 rate=30/m burst=3), --max-prompt-tokens 16,
--max-request-bytes 4096. Router "open": no keys, --limit-rate 30/m --limit-burst 1 per client
address.

Checked, with the decode node's pool held (lib/hold_pool.py) so that admitted streams wait in the
admission FIFO, where they still count: key #1's third stream is RESOURCE_EXHAUSTED naming the
concurrency limit with a retry hint while key #2 is admitted; a cancelled stream, one past its
deadline, a refused-as-invalid request and one whose channel was closed all give their slot back
(two more streams are admitted, the next refused); once the pool is released every admitted
stream completes OK. Key #3 gets its burst of 3, the 4th is refused by the rate limit, and after
the hint's wait it is admitted again. Without keys the bucket is the client address's, shared by
gRPC and the HTTP API, where curl gets 429 with Retry-After and OpenAI's error object. Prompts
over --max-prompt-tokens are INVALID_ARGUMENT / HTTP 400 naming the flag; messages and bodies over
--max-request-bytes are RESOURCE_EXHAUSTED / HTTP 413. kvrelay_limit_refusals_total counts each
refusal by limit. Run through limits.sh; every process is killed at the end.
"""
import json
import os
import re
import subprocess
import threading
import time
import urllib.request

import krprocs  # beside this script: Python puts its directory on sys.path

args = krprocs.parse_args()

import grpc  # noqa: E402
from kvrelay.v1 import kvrelay_pb2 as pb  # noqa: E402
from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc  # noqa: E402
from krprocs import check  # noqa: E402

KEYS = ("limits-key-one", "limits-key-two", "limits-key-rate")
PROMPT = [1, 2, 3, 4, 5]
RE = grpc.StatusCode.RESOURCE_EXHAUSTED
HERE = os.path.dirname(os.path.abspath(__file__))


def md(i):
    return [("authorization", "Bearer " + KEYS[i])]


def request(max_tokens=4, ids=PROMPT):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_tokens=max_tokens)


def metrics(http):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    with opener.open("http://%s/metrics" % http, timeout=10) as r:
        return r.read().decode()


def metric(http, name):
    for line in metrics(http).splitlines():
        if line.split(" ", 1)[0] == name:
            return float(line.split()[-1])
    return None


def wait_metric(http, name, want, what):
    """Waits (by polling the router's own gauge, up to 30 s) until `name` == want."""
    for _ in range(300):
        if metric(http, name) == want:
            return True
        time.sleep(0.1)
    check(False, "%s: %s stayed %s, expected %s" % (what, name, metric(http, name), want))
    return False


class Stream:
    """One Generate stream read on a thread of its own: its final status code and token count."""

    def __init__(self, gen, key, timeout=60, max_tokens=4):
        self.call = gen.Generate(request(max_tokens), timeout=timeout, metadata=md(key))
        self.code, self.details, self.tokens = None, "", 0
        self.t = threading.Thread(target=self._read)
        self.t.start()

    def _read(self):
        try:
            for msg in self.call:
                if msg.WhichOneof("event") == "delta":
                    self.tokens += len(msg.delta.ids)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.code, self.details = e.code(), e.details()

    def join(self):
        self.t.join(timeout=90)
        return self.code


def refused_now(gen, key, want, what):
    """A Generate of `key` that must be refused RESOURCE_EXHAUSTED naming `want`; returns the hint."""
    code, details = krprocs.code_of(lambda: list(gen.Generate(request(), timeout=30, metadata=md(key))))
    check(code == RE and want in details, "%s: %s %s (expected RESOURCE_EXHAUSTED '%s')" % (what, code, details, want))
    m = re.search(r"retry after (\d+) ms", details)
    check(m is not None, "%s: no retry hint in '%s'" % (what, details))
    return int(m.group(1)) if m else 0


def curl(http, body, key=None):
    """POST /v1/completions with curl: (status, headers lower-cased, parsed body or None)."""
    argv = ["curl", "-s", "-i", "--noproxy", "*", "-H", "Content-Type: application/json", "--data-binary", "@-",
            "http://%s/v1/completions" % http]
    if key is not None:
        argv[2:2] = ["-H", "Authorization: Bearer " + KEYS[key]]
    p = subprocess.run(argv, input=body, capture_output=True, text=True, timeout=60)
    head, _, text = p.stdout.partition("\n\n")  # text mode: CR LF reads as LF
    lines = head.split("\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    headers = {ln.split(":", 1)[0].lower(): ln.split(":", 1)[1].strip() for ln in lines[1:] if ":" in ln}
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    return status, headers, doc


def concurrency(gen, http, decode):
    hold = subprocess.Popen(["/usr/bin/python3", os.path.join(HERE, "lib", "hold_pool.py"), args.stubs, decode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    with open(os.path.join(args.work, "pids"), "a") as f:
        f.write("%d\n" % hold.pid)
    line = hold.stdout.readline()
    check(line.startswith("held"), "hold_pool: %s" % line)

    a1, a2 = Stream(gen, 0), Stream(gen, 0, timeout=5)
    wait_metric(http, "kvrelay_queue_depth", 2, "key #1's two streams queued")
    hint = refused_now(gen, 0, "concurrency limit: key #1 has 2 streams in flight", "key #1's third stream")
    check(hint > 0, "the concurrency refusal's hint is %d ms" % hint)
    b1 = Stream(gen, 1)
    wait_metric(http, "kvrelay_queue_depth", 3, "key #2 admitted while key #1 is at its cap")
    refused_now(gen, 1, "concurrency limit: key #2 has 1 streams in flight", "key #2's second stream")

    # every way out gives the slot back: cancel, deadline, an invalid request, a closed channel
    a1.call.cancel()
    check(a1.join() == grpc.StatusCode.CANCELLED, "the cancelled stream ended %s" % a1.code)
    check(a2.join() == grpc.StatusCode.DEADLINE_EXCEEDED, "the stream with a 5 s deadline ended %s %s" %
          (a2.code, a2.details))
    wait_metric(http, "kvrelay_queue_depth", 1, "cancelled and expired streams left the queue")
    code, details = krprocs.code_of(lambda: list(gen.Generate(request(max_tokens=0), timeout=30, metadata=md(0))))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, "max_tokens 0: %s %s" % (code, details))
    own = grpc.insecure_channel(args.router)
    a3 = Stream(pb_grpc.GenerationStub(own), 0)
    a4 = Stream(gen, 0)
    wait_metric(http, "kvrelay_queue_depth", 3, "key #1 got both slots back")
    refused_now(gen, 0, "concurrency limit: key #1", "key #1 at its cap again")
    own.close()  # the client goes away without cancelling
    a3.join()
    wait_metric(http, "kvrelay_queue_depth", 2, "the disconnected client's stream left the queue")
    a5 = Stream(gen, 0)
    wait_metric(http, "kvrelay_queue_depth", 3, "the disconnected client's slot came back")
    refused_now(gen, 0, "concurrency limit: key #1", "key #1 at its cap after the disconnect")

    # the HTTP API counts against the same key
    status, headers, doc = curl(http, json.dumps({"model": "llama3-tiny", "prompt": PROMPT, "max_tokens": 2}), 0)
    check(status == 429, "HTTP with key #1 at its cap: %d %s" % (status, doc))
    check(headers.get("retry-after", "").isdigit() and int(headers["retry-after"]) >= 1,
          "HTTP 429 Retry-After: %s" % headers.get("retry-after"))
    err = (doc or {}).get("error", {})
    check(err.get("code") == "rate_limit_exceeded" and "concurrency limit: key #1" in err.get("message", ""),
          "HTTP 429 error object: %s" % doc)

    hold.stdin.write("\n")
    hold.stdin.flush()
    check(hold.stdout.readline().startswith("released"), "hold_pool did not release")
    hold.wait(timeout=30)
    for name, s in (("key #2's stream", b1), ("key #1's stream after the cancel", a4), ("key #1's last", a5)):
        check(s.join() == grpc.StatusCode.OK and s.tokens == 4, "%s: %s %s, %d tokens" % (name, s.code, s.details,
                                                                                        s.tokens))
    wait_metric(http, "kvrelay_requests_in_flight", 0, "every stream finished")


def rate(gen):
    """Key #3: rate 30/m (a token every 2 s), burst 3; invalid requests are cheap and still count."""
    def one():
        return krprocs.code_of(lambda: list(gen.Generate(request(max_tokens=0), timeout=30, metadata=md(2))))
    for i in range(3):
        code, details = one()
        check(code == grpc.StatusCode.INVALID_ARGUMENT, "key #3 request %d of its burst: %s %s" % (i + 1, code, details))
    hint = refused_now(gen, 2, "rate limit: key #3", "key #3 past its burst")
    check(0 < hint <= 2000, "the rate refusal's hint is %d ms (a token every 2000 ms)" % hint)
    time.sleep(hint / 1000.0 + 0.05)  # the hint says when: waiting it out must be enough
    code, details = one()
    check(code == grpc.StatusCode.INVALID_ARGUMENT, "key #3 after waiting the hint: %s %s" % (code, details))


def caps(gen, http):
    code, details = krprocs.code_of(lambda: list(gen.Generate(request(ids=list(range(1, 18))), timeout=30,
                                                              metadata=md(0))))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-tokens" in details and "17 tokens" in details,
          "a 17-token prompt over --max-prompt-tokens 16: %s %s" % (code, details))
    status, _, doc = curl(http, json.dumps({"model": "llama3-tiny", "prompt": list(range(1, 18)), "max_tokens": 2}), 0)
    check(status == 400 and "--max-prompt-tokens" in (doc or {}).get("error", {}).get("message", ""),
          "HTTP prompt over the cap: %d %s" % (status, doc))
    code, details = krprocs.code_of(lambda: list(gen.Generate(request(ids=[300] * 3000), timeout=30, metadata=md(0))))
    check(code == RE, "a 6 KB message over --max-request-bytes 4096: %s %s" % (code, details))
    status, _, doc = curl(http, json.dumps({"model": "llama3-tiny", "prompt": "x" * 5000, "max_tokens": 2}), 0)
    check(status == 413 and "--max-request-bytes" in (doc or {}).get("error", {}).get("message", ""),
          "HTTP body over the cap: %d %s" % (status, doc))


def per_peer(open_router, open_http):
    """No keys: the client address's bucket (burst 1), shared by gRPC and HTTP."""
    gen = pb_grpc.GenerationStub(grpc.insecure_channel(open_router))
    code, details = krprocs.code_of(lambda: list(gen.Generate(request(max_tokens=0), timeout=30)))
    check(code == grpc.StatusCode.INVALID_ARGUMENT, "the open router's first request: %s %s" % (code, details))
    code, details = krprocs.code_of(lambda: list(gen.Generate(request(), timeout=30)))
    check(code == RE and "rate limit: peer 127.0.0.1" in details, "the open router's second: %s %s" % (code, details))
    status, headers, doc = curl(open_http, json.dumps({"model": "llama3-tiny", "prompt": PROMPT, "max_tokens": 2}))
    check(status == 429 and headers.get("retry-after", "").isdigit(), "curl on the open router: %d %s %s" %
          (status, headers.get("retry-after"), doc))
    err = (doc or {}).get("error", {})
    check(err.get("type") == "rate_limit_exceeded" and "rate limit: peer 127.0.0.1" in err.get("message", "") and
          "param" in err, "the open router's 429 body: %s" % doc)


def main():
    b = args.bin
    dec, pre, nodes = krprocs.start_nodes(args, kv_memory="16M")
    base = [b + "/kvrelay-router", "--model", args.model, "--nodes", nodes, "--listen", "127.0.0.1:0",
            "--http", "127.0.0.1:0", "--served-model-name", "llama3-tiny"]

    p = subprocess.run(base + ["--limit-rate", "5/h"], capture_output=True, text=True, timeout=30)
    check(p.returncode == 2 and "--limit-rate: '5/h' is not a rate" in p.stderr, "--limit-rate 5/h: %s %s" %
          (p.returncode, p.stderr.strip()))
    bad = os.path.join(args.work, "bad.keys")
    with open(bad, "w") as f:
        f.write("good-key\nother-key burst=-1\n")
    p = subprocess.run(base + ["--api-key-file", bad], capture_output=True, text=True, timeout=30)
    check(p.returncode == 2 and "line 2, word 1 after the key: burst: '-1'" in p.stderr,
          "a bad burst in the key file: %s %s" % (p.returncode, p.stderr.strip()))

    keyfile = os.path.join(args.work, "router.keys")
    with open(keyfile, "w") as f:
        f.write("%s\n%s concurrency=1\n%s concurrency=0 rate=30/m burst=3\n" % KEYS)
    router, http = krprocs.start(args.work, "router", base + ["--api-key-file", keyfile, "--limit-concurrency", "2",
                                                              "--max-prompt-tokens", "16", "--max-request-bytes",
                                                              "4096", "--max-queue-ms", "60000"])
    open_router, open_http = krprocs.start(args.work, "router-open", base + ["--id", "router-open", "--limit-rate",
                                                                             "30/m", "--limit-burst", "1"])
    args.router = router
    gen = pb_grpc.GenerationStub(grpc.insecure_channel(router))
    concurrency(gen, http, dec)
    rate(gen)
    caps(gen, http)
    per_peer(open_router, open_http)

    text = metrics(http)
    for limit, want in (("concurrency", 5), ("rate", 1), ("clients", 0)):
        name = 'kvrelay_limit_refusals_total{limit="%s"}' % limit
        got = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name)]
        check(got == [want], "%s is %s, expected %d" % (name, got, want))


krprocs.run(main)
krprocs.finish("limits", args.work, names=("decode", "prefill", "router", "router-open"))
