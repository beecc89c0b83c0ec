"""api_keys.py - the checks of api_keys.sh: the router's API keys through a real cluster of one
kvrelay-decode, one kvrelay-prefill and two kvrelay-routers on llama3-tiny: one router without
keys (the reference), one with a key from each source (--api-key, --api-key-file,
KVRELAY_API_KEY).

Checked: start-up errors (an empty key file, a file of comments only, a missing file, a key with
a space on the command line, in a file, in KVRELAY_API_KEY) exit 2 naming the source (and the
line) but not the key; Generate, Tokenize and ClusterStatus without metadata, with a wrong key
and with a malformed authorization are UNAUTHENTICATED with details saying which; each key is
accepted ("Bearer" in any case) and Generate's output equals the keyless router's; the health
Check and /metrics need no key, and refused Generate calls count as
kvrelay_requests_total{status="UNAUTHENTICATED"}; kvrelay-cli works with --api-key and with
KVRELAY_API_KEY and without a key exits 1 with a message saying what to do; no log holds a key.
Run through api_keys.sh (it generates the stubs); every process is killed at the end.
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
from krprocs import check  # noqa: E402
from kvhealth import health_pb2, health_pb2_grpc  # noqa: E402

KEY_FLAG = "flag-key-7f3a9c1e"
KEY_FILE = "file-key-91c2d04b"
KEY_ENV = "env-key-5d6e8a27"
SECRETS = (KEY_FLAG, KEY_FILE, KEY_ENV, "bad key-secret", "wrong-key-0000")
MISSING = "missing API key: send metadata 'authorization: Bearer KEY'"
PROMPT = [1, 2, 3, 4, 5]
errlogs = []  # stderr of the routers that failed to start, searched for keys too


def generate(gen, md):
    ids = []
    for msg in gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_tokens=8),
                            timeout=60, metadata=md):
        if msg.WhichOneof("event") == "delta":
            ids.extend(msg.delta.ids)
    return ids


def startup_errors(nodes):
    """Bad key sources stop the router at start-up (exit 2) with a message naming the source."""
    def write(name, text):
        p = os.path.join(args.work, name)
        with open(p, "w") as f:
            f.write(text)
        return p
    base = [args.bin + "/kvrelay-router", "--model", args.model, "--nodes", nodes,
            "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"]
    empty = write("empty.keys", "")
    comments = write("comments.keys", "# nothing here\n\n")
    spaced = write("spaced.keys", "# one good, one bad\n%s\nbad key-secret\n" % KEY_FILE)
    cases = [
        (["--api-key-file", empty], {}, "--api-key-file %s: no key in it" % empty),
        (["--api-key-file", comments], {}, "--api-key-file %s: no key in it" % comments),
        (["--api-key-file", os.path.join(args.work, "absent.keys")], {}, "absent.keys: cannot read it"),
        (["--api-key", "bad key-secret"], {}, "--api-key (occurrence 1): byte 4 of the key is a space"),
        (["--api-key-file", spaced], {}, "spaced.keys line 3, word 1 after the key: not a limit"),
        ([], {"KVRELAY_API_KEY": "bad key-secret"}, "KVRELAY_API_KEY (environment): byte 4"),
    ]
    for extra, env, want in cases:
        p = subprocess.run(base + extra, capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, **env))
        errlogs.append(p.stderr)
        check(p.returncode == 2, "%s %s: exit %s, expected 2" % (extra, env, p.returncode))
        check(want in p.stderr, "%s %s: stderr lacks '%s': %s" % (extra, env, want, p.stderr.strip()))


def refused(what, fn):
    """Every way of not having a key, on one call: UNAUTHENTICATED saying which."""
    for md, want in ((None, MISSING), ([("authorization", "Bearer wrong-key-0000")], "invalid API key"),
                     ([("authorization", "Basic ZmxhZy1rZXk=")], "malformed authorization"),
                     ([("x-api-key", KEY_FLAG)], MISSING)):
        code, details = krprocs.code_of(lambda: fn(md))
        check(code == grpc.StatusCode.UNAUTHENTICATED, "%s with %s: %s %s" % (what, md, code, details))
        check(want in details, "%s with %s: details '%s' lack '%s'" % (what, md, details, want))
        check(not any(s in details for s in SECRETS), "%s: the details echo a key: %s" % (what, details))


def unauthenticated_count(http):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    with opener.open("http://%s/metrics" % http, timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith('kvrelay_requests_total{status="UNAUTHENTICATED"}'):
            return float(line.split()[-1])
    return None


def cli(router, argv, env_key=None):
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_API_KEY"}
    if env_key:
        env["KVRELAY_API_KEY"] = env_key
    return subprocess.run([args.bin + "/kvrelay-cli", "--router", router] + argv, capture_output=True,
                          text=True, timeout=60, env=env)


def main():
    b = args.bin
    dec, pre, nodes = krprocs.start_nodes(args)
    startup_errors(nodes)

    open_router, _ = krprocs.start(args.work, "router-open", [b + "/kvrelay-router", "--model", args.model,
                                                              "--nodes", nodes, "--id", "router-open",
                                                              "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0"])
    keyfile = os.path.join(args.work, "router.keys")
    with open(keyfile, "w") as f:
        f.write("# keys of the test\n\n%s  \r\n" % KEY_FILE)
    os.environ["KVRELAY_API_KEY"] = KEY_ENV  # the keyed router's third source; the others never see it
    try:
        router, http = krprocs.start(args.work, "router", [b + "/kvrelay-router", "--model", args.model,
                                                           "--nodes", nodes, "--listen", "127.0.0.1:0",
                                                           "--http", "127.0.0.1:0", "--api-key", KEY_FLAG,
                                                           "--api-key-file", keyfile])
    finally:
        del os.environ["KVRELAY_API_KEY"]

    ref = generate(pb_grpc.GenerationStub(grpc.insecure_channel(open_router)), None)
    check(len(ref) == 8, "the keyless router's Generate: %s" % ref)

    channel = grpc.insecure_channel(router)
    gen = pb_grpc.GenerationStub(channel)
    admin = pb_grpc.AdminStub(channel)
    health = health_pb2_grpc.HealthStub(channel)

    # ---- refusals
    refused("Generate", lambda md: generate(gen, md))
    refused("Tokenize", lambda md: gen.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10, metadata=md))
    refused("ClusterStatus", lambda md: admin.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=md))

    # ---- open without a key: health, /metrics (4 refused Generate calls counted there)
    for svc in ("", "kvrelay.v1.Generation", "kvrelay.v1.Admin"):
        r = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=10)
        check(r.status == health_pb2.HealthCheckResponse.SERVING, "health '%s' without a key: %s" % (svc, r.status))
    n = unauthenticated_count(http)
    check(n == 4, "kvrelay_requests_total{status=\"UNAUTHENTICATED\"} is %s, expected 4" % n)

    # ---- every key works, with the same output as without keys
    for key, scheme in ((KEY_FLAG, "Bearer"), (KEY_FILE, "bearer"), (KEY_ENV, "BEARER")):
        md = [("authorization", "%s %s" % (scheme, key))]
        code, details = krprocs.code_of(lambda: check(generate(gen, md) == ref, "Generate with %s differs" % scheme))
        check(code == grpc.StatusCode.OK, "Generate with a good key: %s %s" % (code, details))
        # no tokenizer in the fixture: past the key check, Tokenize is refused for that instead
        code, details = krprocs.code_of(lambda: gen.Tokenize(pb.TokenizeRequest(text="hi"), timeout=10, metadata=md))
        check(code == grpc.StatusCode.FAILED_PRECONDITION, "Tokenize with a good key: %s %s" % (code, details))
        nodes_seen = admin.ClusterStatus(pb.ClusterStatusRequest(), timeout=10, metadata=md).nodes
        check(len(nodes_seen) == 3, "ClusterStatus with a good key: %d nodes" % len(nodes_seen))
    channel.close()

    # ---- kvrelay-cli
    ids_arg = ["generate", "--ids", " ".join(map(str, PROMPT)), "--max-tokens", "8", "--json"]
    for how, argv, env_key in (("--api-key", ["--api-key", KEY_FLAG] + ids_arg, None),
                               ("--api-key after the command", ids_arg + ["--api-key", KEY_FILE], None),
                               ("KVRELAY_API_KEY", ids_arg, KEY_ENV)):
        p = cli(router, argv, env_key)
        check(p.returncode == 0, "kvrelay-cli with %s: exit %d: %s" % (how, p.returncode, p.stderr.strip()))
        if p.returncode == 0:
            check(json.loads(p.stdout)["ids"] == ref, "kvrelay-cli with %s: %s" % (how, p.stdout.strip()))
    p = cli(router, ["status"], KEY_ENV)
    check(p.returncode == 0 and "decode-0" in p.stdout, "kvrelay-cli status with KVRELAY_API_KEY: %s" % p.stderr)
    p = cli(router, ["status"])
    check(p.returncode == 1, "kvrelay-cli without a key: exit %d" % p.returncode)
    check("UNAUTHENTICATED: missing API key" in p.stderr and "--api-key KEY or $KVRELAY_API_KEY" in p.stderr,
          "kvrelay-cli without a key says: %s" % p.stderr.strip())
    p = cli(router, ["--api-key", "wrong-key-0000", "tokenize", "--text", "hi"])
    check(p.returncode == 1 and "UNAUTHENTICATED: invalid API key" in p.stderr,
          "kvrelay-cli with a wrong key: exit %d: %s" % (p.returncode, p.stderr.strip()))
    p = cli(router, ["status", "--api-key", "bad key-secret"])
    check(p.returncode == 2 and "--api-key: byte 4" in p.stderr and "secret" not in p.stderr,
          "kvrelay-cli with a bad key: exit %d: %s" % (p.returncode, p.stderr.strip()))
    p = cli(open_router, ["status"])
    check(p.returncode == 0, "kvrelay-cli without a key on the keyless router: %s" % p.stderr.strip())

    with open(os.path.join(args.work, "router.log"), errors="replace") as f:
        log = f.read()
    check("API keys: 3 (1 from --api-key, 1 from --api-key-file, 1 from KVRELAY_API_KEY)" in log,
          "the router's log lacks its key count")


krprocs.run(main)
# no log, and no start-up error, holds a key
for name in sorted(os.listdir(args.work)):
    if name.endswith(".log"):
        with open(os.path.join(args.work, name), errors="replace") as f:
            text = f.read()
        for s in SECRETS:
            check(s not in text, "%s contains the key '%s'" % (name, s))
for text in errlogs:
    for s in SECRETS:
        check(s not in text, "a start-up error contains the key '%s'" % s)
krprocs.finish("api_keys", args.work)
