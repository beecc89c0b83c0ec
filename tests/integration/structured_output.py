"""structured_output.py - the checks of structured_output.sh: response_format through a real
cluster of one kvrelay-decode, one kvrelay-prefill and one kvrelay-router on the bundled
kjv-2l128-2k model (which has never seen JSON), over HTTP (urllib: the bodies are written here
byte for byte), gRPC (Debian's grpcio) and, when it is installed, the official openai npm package.

Checked:
  - 200 random schemas of the supported subset (seed 38, KR_SCHEMA_SEED for another: nested
    objects with odd property names, required keys, additionalProperties false or a schema,
    enums and consts of mixed values, type lists, arrays with bounds, strings with length
    bounds), each sent once, alternating completions and chat, streamed and not, greedy and
    sampled, 8 at a time, with max_tokens a little above the schema's shortest document: every
    answer parses and validates against its schema (python3-jsonschema, a validator nobody here
    wrote), and ends with finish_reason "stop" (the document closed) unless it is a top-level
    number or literal that may end at max_tokens;
  - json_object: any JSON object, on both endpoints;
  - {"type": "text"} is no constraint (the same greedy text as without it);
  - refusals, 400 with param response_format and a message naming the fault: a malformed schema
    (a type name that does not exist, invalid JSON), an unsupported keyword (pattern, anyOf,
    $ref), a response_format that is not an object, and response_format beside ignore_eos or
    min_tokens;
  - gRPC: GenerateRequest.response_format (the object's JSON text) constrains the same way, and
    a bad schema is INVALID_ARGUMENT naming the keyword;
  - the openai npm package: chat.completions with a json_schema response_format, streamed and
    not (skipped when node or the package is missing);
  - a migration: a long document whose decode node stalls mid-stream (SIGSTOP) continues on
    another decode node under --migrate and still validates.
Run through structured_output.sh (it generates the stubs); every process is killed at the end.
"""
import json
import os
import random
import signal
import subprocess
import threading
import time
import urllib.request

import krprocs  # beside this script: Python puts its directory on sys.path

args = krprocs.parse_args()

import grpc  # noqa: E402
import jsonschema  # noqa: E402
from kvrelay.v1 import kvrelay_pb2 as pb  # noqa: E402
from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc  # noqa: E402
from krprocs import check, post  # noqa: E402

NAME = "kjv-json"
N_SCHEMAS = 200
CONCURRENCY = 8
SLACK = 24  # tokens above the shortest document's bytes


# ------------------------------------------------------------------ the schemas

NAMES = ["a", "id", "name", "x y", "quo\"te", "back\\slash", "tab\there", "ünï", "", "verse", "k9", "日本"]


def gen_value(rng):
    """A JSON value for enum / const: strings (odd ones too), integers, booleans, null."""
    return rng.choice([rng.choice(["yes", "no", "", "é", "a\"b", "line\nbreak"]), rng.randint(-50, 1000),
                       rng.choice([True, False]), None])


def gen_schema(rng, depth):
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "typelist"]
    if depth < 3:
        kinds += ["array", "object", "object"]
    k = rng.choice(kinds)
    if k == "string":
        s = {"type": "string"}
        if rng.random() < 0.5:
            s["minLength"] = rng.randint(0, 3)
        if rng.random() < 0.6:
            s["maxLength"] = s.get("minLength", 0) + rng.randint(0, 12)
        return s
    if k in ("integer", "number", "boolean", "null"):
        return {"type": k}
    if k == "enum":
        vals = []
        for _ in range(rng.randint(1, 4)):
            v = gen_value(rng)
            if v not in vals:
                vals.append(v)
        return {"enum": vals}
    if k == "const":
        return {"const": gen_value(rng)}
    if k == "typelist":
        return {"type": rng.sample(["string", "integer", "boolean", "null", "number"], rng.randint(1, 3))}
    if k == "array":
        s = {"type": "array", "items": gen_schema(rng, depth + 1)}
        if rng.random() < 0.5:
            s["minItems"] = rng.randint(0, 2)
        if rng.random() < 0.7:
            s["maxItems"] = s.get("minItems", 0) + rng.randint(0, 3)
        return s
    names = rng.sample(NAMES, rng.randint(1, 4))
    s = {"type": "object", "properties": {n: gen_schema(rng, depth + 1) for n in names}}
    s["required"] = [n for n in names if rng.random() < 0.6]
    r = rng.random()
    if r < 0.4:
        s["additionalProperties"] = False
    elif r < 0.55:
        s["additionalProperties"] = gen_schema(rng, 3)
    return s


def compact(v):
    return len(json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode())


def min_bytes(s):
    """An upper bound of the shortest document's bytes (the shortest of each part)."""
    if "const" in s:
        return compact(s["const"])
    if "enum" in s:
        return min(compact(v) for v in s["enum"])
    t = s.get("type")
    if isinstance(t, list):
        return min(min_bytes(dict(s, type=x)) for x in t)
    if t == "string":
        return 2 + s.get("minLength", 0)
    if t in ("integer", "number"):
        return 1
    if t in ("boolean", "null"):
        return 5
    if t == "array":
        return 2 + s.get("minItems", 0) * (min_bytes(s["items"]) + 1)
    if t == "object":
        return 2 + sum(compact(n) + 2 + min_bytes(s["properties"][n]) for n in s["required"])
    return 1


def response_format(i, schema):
    return {"type": "json_schema", "json_schema": {"name": "schema_%d" % i, "schema": schema, "strict": True}}


# ------------------------------------------------------------------ one request, its checks

def text_of(kind, stream, doc):
    """The answer's text and finish reason from a completions or chat response or stream."""
    if not stream:
        c = doc["choices"][0]
        return (c["text"] if kind == "completions" else c["message"]["content"]), c["finish_reason"]
    lines = [ln[6:] for ln in doc.split("\n") if ln.startswith("data: ")]
    check(lines and lines[-1] == "[DONE]", "a stream that does not end with [DONE]")
    text, finish = "", None
    for ev in (json.loads(x) for x in lines[:-1]):
        for c in ev.get("choices", []):
            text += c["text"] if kind == "completions" else (c.get("delta", {}).get("content") or "")
            finish = c.get("finish_reason") or finish
    return text, finish


def may_end_at_length(schema):
    """A top-level value with no closing byte (a number, or a literal) may be whole at max_tokens."""
    t = schema.get("type")
    types = t if isinstance(t, list) else [t]
    return "enum" in schema or "const" in schema or any(x in ("integer", "number", "boolean", "null") for x in types)


def run_one(api, i, schema, results):
    kind = "completions" if i % 2 == 0 else "chat/completions"
    stream = i % 4 in (1, 2)
    body = {"model": NAME, "max_tokens": min_bytes(schema) + SLACK, "response_format": response_format(i, schema),
            "stream": stream}
    if i % 3 == 0:
        body.update(temperature=0.8, seed=i)
    else:
        body["temperature"] = 0
    if kind == "completions":
        body["prompt"] = "And the LORD spake unto Moses, saying,"
    else:
        body["messages"] = [{"role": "user", "content": "Answer in JSON."}]
    status, doc = post(api, "/" + kind, body)
    if status != 200:
        results[i] = "HTTP %d: %s" % (status, doc)
        return
    text, finish = text_of("completions" if kind == "completions" else "chat", stream, doc)
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (ValueError, jsonschema.ValidationError) as e:
        results[i] = "does not validate (%s): %r" % (str(e).splitlines()[0], text[:400])
        return
    if finish != "stop" and not (finish == "length" and may_end_at_length(schema)):
        results[i] = "finish_reason %s for %r" % (finish, text[:200])
        return
    results[i] = None


def schemas_through(api):
    seed = int(os.environ.get("KR_SCHEMA_SEED", "38"))
    rng = random.Random(seed)
    schemas = [gen_schema(rng, 0) for _ in range(N_SCHEMAS)]
    results = [False] * N_SCHEMAS
    pending = list(range(N_SCHEMAS))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                i = pending.pop(0)
            try:
                run_one(api, i, schemas[i], results)
            except Exception as e:  # a crash is that schema's failure
                results[i] = "exception %r" % (e,)

    threads = [threading.Thread(target=worker) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [(i, r) for i, r in enumerate(results) if r is not None]
    for i, r in bad[:10]:
        check(False, "schema %d (seed %d) %s: %s" % (i, seed, json.dumps(schemas[i]), r))
    check(not bad, "%d of %d schemas answered with a valid document" % (N_SCHEMAS - len(bad), N_SCHEMAS))
    print("ok: %d random schemas (seed %d), every answer parses and validates" % (N_SCHEMAS - len(bad), seed))


# ------------------------------------------------------------------ the rest

def refusals(api):
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}}, "type", {}),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "^a"}}},
         "pattern", {}),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"anyOf": [{"type": "string"}]}}}, "anyOf", {}),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"properties": {"a": {"$ref": "#/x"}}}}},
         "$ref", {}),
        ({"type": "json_schema", "json_schema": {"name": "s"}}, "schema", {}),
        ({"type": "xml"}, "type", {}),
        ("json_object", "object", {}),
        ({"type": "json_object"}, "ignore_eos", {"ignore_eos": True}),
        ({"type": "json_object"}, "min_tokens", {"min_tokens": 2}),
    ]
    for rf, word, extra in cases:
        for path, body in (("/chat/completions", chat),
                           ("/completions", {"model": NAME, "prompt": "x", "max_tokens": 8})):
            b = dict(body, response_format=rf, **extra)
            status, doc = post(api, path, b)
            err = doc.get("error", {}) if isinstance(doc, dict) else {}
            check(status == 400 and err.get("param") == "response_format" and word in err.get("message", ""),
                  "%s with response_format %s %s: want 400 naming %r, got %d %s" % (path, json.dumps(rf), extra, word,
                                                                                    status, doc))
    print("ok: malformed and unsupported schemas are 400 naming the keyword")


def json_object_and_text(api):
    for path, body in (("/completions", {"prompt": "And God said"}),
                       ("/chat/completions", {"messages": [{"role": "user", "content": "And God said"}]})):
        for stream in (False, True):
            b = dict(body, model=NAME, max_tokens=64, temperature=0, stream=stream,
                     response_format={"type": "json_object"})
            status, doc = post(api, path, b)
            check(status == 200, "json_object on %s: HTTP %d %s" % (path, status, doc))
            if status != 200:
                continue
            text, finish = text_of("completions" if path == "/completions" else "chat", stream, doc)
            try:
                ok = isinstance(json.loads(text), dict) and finish == "stop"
            except ValueError:
                ok = False
            check(ok, "json_object on %s (stream %s): %r, finish %s" % (path, stream, text, finish))
    plain = {"model": NAME, "prompt": "And God said", "max_tokens": 16, "temperature": 0}
    _, a = post(api, "/completions", plain)
    _, b = post(api, "/completions", dict(plain, response_format={"type": "text"}))
    check(a["choices"][0]["text"] == b["choices"][0]["text"], "{\"type\": \"text\"} changed the text: %r vs %r"
          % (a["choices"][0]["text"], b["choices"][0]["text"]))
    print("ok: json_object answers are JSON objects; type text is no constraint")


def over_grpc(router):
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(router))
    schema = {"type": "object", "properties": {"book": {"enum": ["Genesis", "Exodus"]},
                                                "chapter": {"type": "integer"},
                                                "verses": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                           "maxItems": 2}},
              "required": ["book", "chapter", "verses"], "additionalProperties": False}
    rf = json.dumps(response_format(0, schema))
    for seed in (None, 7):
        q = pb.GenerateRequest(text="In the beginning", max_tokens=min_bytes(schema) + SLACK, response_format=rf)
        if seed is not None:
            q.sampling.temperature = 0.9
            q.sampling.seed = seed
        text, finish = "", None
        for m in stub.Generate(q, timeout=300):
            if m.HasField("delta"):
                text += m.delta.text
            else:
                finish = m.finish.reason
        try:
            jsonschema.validate(json.loads(text), schema)
            ok = finish == pb.FINISH_REASON_EOS
        except (ValueError, jsonschema.ValidationError):
            ok = False
        check(ok, "gRPC response_format (seed %s): %r, finish %s" % (seed, text, finish))
    bad = json.dumps(response_format(0, {"type": "string", "format": "date"}))
    code, details = krprocs.code_of(lambda: list(stub.Generate(pb.GenerateRequest(text="x", max_tokens=4,
                                                                                  response_format=bad), timeout=60)))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and "format" in details and details.startswith("response_format"),
          "gRPC unsupported keyword: %s %s" % (code, details))
    code, details = krprocs.code_of(lambda: list(stub.Generate(pb.GenerateRequest(
        text="x", max_tokens=4, ignore_eos=True, response_format='{"type":"json_object"}'), timeout=60)))
    check(code == grpc.StatusCode.INVALID_ARGUMENT and "ignore_eos" in details, "gRPC with ignore_eos: %s %s"
          % (code, details))
    print("ok: gRPC GenerateRequest.response_format")


SDK = r"""
const OpenAI = require('openai');
const [base, model] = process.argv.slice(1);
const client = new OpenAI({ baseURL: base, apiKey: 'none', maxRetries: 0, timeout: 300000 });
const schema = { type: 'object', properties: { answer: { type: 'string', maxLength: 12 },
                 ok: { type: 'boolean' } }, required: ['answer', 'ok'], additionalProperties: false };
const rf = { type: 'json_schema', json_schema: { name: 'reply', schema, strict: true } };
(async () => {
  const msgs = [{ role: 'user', content: 'And God said' }];
  const r = await client.chat.completions.create({ model, messages: msgs, max_tokens: 64, response_format: rf });
  const d = JSON.parse(r.choices[0].message.content);
  if (typeof d.answer !== 'string' || typeof d.ok !== 'boolean' || r.choices[0].finish_reason !== 'stop')
    throw new Error('not the schema: ' + r.choices[0].message.content);
  let text = '';
  const s = await client.chat.completions.create({ model, messages: msgs, max_tokens: 64, response_format: rf,
                                                   stream: true, temperature: 0.9, seed: 3 });
  for await (const c of s) text += (c.choices[0] && c.choices[0].delta.content) || '';
  const e = JSON.parse(text);
  if (typeof e.answer !== 'string' || typeof e.ok !== 'boolean') throw new Error('streamed: ' + text);
  try {
    await client.chat.completions.create({ model, messages: msgs, max_tokens: 8,
      response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', minimum: 1 } } } });
    throw new Error('an unsupported keyword was accepted');
  } catch (err) {
    if (err.status !== 400 || !String(err.message).includes('minimum')) throw err;
  }
  console.log('ok: the openai npm package: json_schema streamed and not, and a 400 naming the keyword');
})().catch((e) => { console.error('FAIL: ' + e.message); process.exit(1); });
"""


def with_sdk(api):
    modules = os.path.join(args.bin, "npm", "node_modules")
    if not os.path.isdir(os.path.join(modules, "openai")) or subprocess.run(["which", "node"],
                                                                           capture_output=True).returncode:
        print("skipped: the openai npm package (%s) or node is missing" % modules)
        return
    r = subprocess.run(["node", "-e", SDK, api, NAME], env=dict(os.environ, NODE_PATH=modules),
                       capture_output=True, text=True, timeout=600)
    print(r.stdout.strip())
    check(r.returncode == 0, "the openai npm package: %s" % r.stderr.strip()[-500:])


def running(http):
    """The decode node's kvrelay_running_sequences."""
    text = urllib.request.urlopen("http://%s/metrics" % http, timeout=10).read().decode()
    return next((float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("kvrelay_running_sequences ")), 0)


def migration():
    """A document that outlives its decode node: a second cluster of one prefill and two decode
    nodes under a --migrate router; the decode node serving a long document is stopped (SIGSTOP)
    once ten items were streamed, the router's --decode-stall-ms moves the request to the other one,
    whose prefill and decode nodes feed their matchers the tokens sent so far: the answer must
    still validate."""
    b, work = args.bin, os.path.join(args.work, "migrate")
    os.makedirs(work)
    dec = []
    for k in range(2):
        g, h = krprocs.start(work, "decode%d" % k, [b + "/kvrelay-decode", "--model", args.model, "--id",
                                                    "decode-%d" % k, "--listen", "127.0.0.1:0", "--transfer",
                                                    "127.0.0.1:0", "--http", "127.0.0.1:0", "--kv-memory", "64M",
                                                    "--threads", "1"])
        dec.append((g, h))
    pre, _ = krprocs.start(work, "prefill", [b + "/kvrelay-prefill", "--model", args.model, "--id", "prefill-0",
                                             "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "1"])
    nodes = os.path.join(work, "nodes.json")
    json.dump({"prefill": [{"id": "prefill-0", "address": pre}],
               "decode": [{"id": "decode-%d" % k, "address": g} for k, (g, _) in enumerate(dec)]}, open(nodes, "w"))
    _, http = krprocs.start(work, "router", [b + "/kvrelay-router", "--model", args.model, "--nodes", nodes,
                                             "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--migrate",
                                             "--decode-stall-ms", "4000", "--served-model-name", NAME])
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 300}
    body = {"model": NAME, "prompt": "And God said", "max_tokens": 900, "temperature": 0, "stream": True,
            "response_format": response_format(0, schema)}
    req = urllib.request.Request("http://%s/v1/completions" % http, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    stopped = None
    with urllib.request.urlopen(req, timeout=600) as r:
        first, seen = b"", ""
        while seen.count(",") < 10:  # well into the document: the matchers have a past to replay
            line = r.readline()
            if not line:
                break
            first += line
            if line.startswith(b"data: {"):
                seen += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        deadline = time.time() + 10
        while stopped is None and time.time() < deadline:  # the decode node that took it
            for k, (_, h) in enumerate(dec):
                if running(h) > 0:
                    stopped = k
                    krprocs.signal("decode%d" % k, signal.SIGSTOP)  # the stream stalls
                    break
            time.sleep(0.005)
        raw = (first + r.read()).decode()
    if stopped is not None:
        krprocs.signal("decode%d" % stopped, signal.SIGCONT)  # so that it stops cleanly at the end
    text, finish = text_of("completions", True, raw)
    log = open(os.path.join(work, "router.log"), errors="replace").read()
    check(stopped is not None and "migrating:" in log,
          "no migration happened (stopped decode node %s): the document was finished too soon" % stopped)
    try:
        jsonschema.validate(json.loads(text), schema)
        ok = finish == "stop"
    except (ValueError, jsonschema.ValidationError):
        ok = False
    check(ok, "the migrated document: %r..., finish %s" % (text[:200], finish))
    if ok:
        print("ok: a document migrated mid-stream to another decode node still validates")


def main():
    b = args.bin
    _, _, nodes = krprocs.start_nodes(args)
    # a node starved on a loaded machine is not a failed one here (the default stall limit is 5 s)
    router, http = krprocs.start(args.work, "router", [b + "/kvrelay-router", "--model", args.model, "--nodes", nodes,
                                 "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0",
                                 "--decode-stall-ms", "60000", "--served-model-name", NAME])
    api = "http://" + http + "/v1"
    refusals(api)
    json_object_and_text(api)
    over_grpc(router)
    with_sdk(api)
    schemas_through(api)
    migration()


krprocs.run(main)
krprocs.finish("structured_output", args.work)
