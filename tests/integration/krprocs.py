"""krprocs.py - what the Python cluster tests share: a failure list with check(), and kvrelay
processes started from their command lines (each waits for its serving line) and stopped with
SIGTERM, which must be a clean shutdown. Every pid is appended to WORK/pids, so the calling
shell script can kill what is left if Python itself dies.
"""
import json
import os
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request

failures = []
_procs = []


def parse_args():
    """The command line every Python cluster test takes from its shell script: --bin (the
    programs), --stubs (the generated gRPC stubs, made importable here), --model, --work (a
    temporary directory)."""
    import argparse
    ap = argparse.ArgumentParser()
    for flag in ("--bin", "--stubs", "--model", "--work"):
        ap.add_argument(flag, required=True)
    args = ap.parse_args()
    sys.path.insert(0, args.stubs)
    return args


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL: " + what, file=sys.stderr)


def start(work, name, argv, timeout=120):
    """Starts a process (stderr to WORK/name.log), waits for its serving line, returns
    (grpc address, http address)."""
    log = open(os.path.join(work, name + ".log"), "wb")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
    _procs.append((name, p))
    with open(os.path.join(work, "pids"), "a") as f:
        f.write("%d\n" % p.pid)
    deadline = time.time() + timeout
    line = b""
    while time.time() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 0.5)
        if r:
            ch = os.read(p.stdout.fileno(), 1)  # unbuffered: select must see what is left
            if not ch:
                break
            if ch != b"\n":
                line += ch
                continue
            words = line.decode().split()
            if "serving" in words and "grpc" in words and "http" in words:
                return words[words.index("grpc") + 1], words[words.index("http") + 1]
            line = b""
        elif p.poll() is not None:
            break
    raise RuntimeError("%s printed no serving line (exit %s); see its log" % (name, p.poll()))


def start_nodes(args, kv_memory="64M", prefill_args=()):
    """Starts one kvrelay-decode (decode-0, `kv_memory` of KV pool) and one kvrelay-prefill
    (prefill-0, with prefill_args added) on args.model, one thread each, and writes
    WORK/nodes.json, the static membership naming them; returns (decode address, prefill
    address, nodes.json path)."""
    b = args.bin
    dec, _ = start(args.work, "decode", [b + "/kvrelay-decode", "--model", args.model, "--id", "decode-0",
                                         "--listen", "127.0.0.1:0", "--transfer", "127.0.0.1:0",
                                         "--http", "127.0.0.1:0", "--kv-memory", kv_memory, "--threads", "1"])
    pre, _ = start(args.work, "prefill", [b + "/kvrelay-prefill", "--model", args.model, "--id", "prefill-0",
                                          "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "1",
                                          *prefill_args])
    nodes = os.path.join(args.work, "nodes.json")
    with open(nodes, "w") as f:
        json.dump({"prefill": [{"id": "prefill-0", "address": pre}],
                   "decode": [{"id": "decode-0", "address": dec}]}, f)
    return dec, pre, nodes


def signal(name, sig):
    """Sends signal `sig` to the latest process started as `name`."""
    for n, p in reversed(_procs):
        if n == name:
            os.kill(p.pid, sig)
            return
    raise KeyError(name)


def stop_all():
    """SIGTERM to every started process, newest first; a process that does not stop within
    20 s or exits non-zero is a failure."""
    for name, p in reversed(_procs):
        if p.poll() is None:
            p.terminate()
    for name, p in reversed(_procs):
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            failures.append("%s did not stop on SIGTERM within 20 s" % name)
        if p.returncode != 0:
            failures.append("%s exited with %s" % (name, p.returncode))


def run(main):
    """Runs main(); an exception is a failure (with its traceback), and every started process
    is stopped either way."""
    try:
        main()
    except Exception as e:  # a crash is a failure with the processes' logs shown
        failures.append("exception: %r" % (e,))
        import traceback
        traceback.print_exc()
    finally:
        stop_all()


def code_of(fn):
    """Calls fn(); returns the gRPC (status code, details) it failed with, or (OK, "")."""
    import grpc
    try:
        fn()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def finish(test, work, names=("decode", "prefill", "router")):
    """Ends a test: with failures, the last lines of each process's log and exit 1; otherwise
    a line saying every check passed."""
    if failures:
        for name in names:
            path = os.path.join(work, name + ".log")
            if os.path.exists(path):
                tail = open(path, "rb").read().decode(errors="replace").splitlines()[-25:]
                print("---- %s log (last lines)\n%s" % (name, "\n".join(tail)), file=sys.stderr)
        print("%s: %d failure(s)" % (test, len(failures)), file=sys.stderr)
        sys.exit(1)
    print("%s: all checks passed" % test)


def post(base, path, body, raw=False, timeout=600):
    """POSTs `body` (a dict sent as JSON, or bytes sent as they are) to base + path: (status, the
    answer parsed as JSON, or its text when it is not JSON or `raw` asks for the text, e.g. a
    stream's SSE)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    if raw:
        return status, text
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
