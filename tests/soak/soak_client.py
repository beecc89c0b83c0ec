"""soak_client.py - the client side of tests/soak/soak.sh: a fixed pool of greedy requests, their
fault-free outputs, a load of those requests while faults are injected, and the final check.

Not a load generator for latency figures (tools/kvrelay-bench-serve is): it records each
request's generated ids, which the bench does not, because the soak's question is whether any
output was wrong, not how fast it came.

  soak_client.py pool      --model DIR --seed N --size N --policy SPEC... --out pool.json
  soak_client.py reference --stubs DIR --router ADDR --pool pool.json --out refs.json
  soak_client.py load      --stubs DIR --router ADDR [--router ADDR2] --pool pool.json
                           --duration S --concurrency C --drop P --seed N --out rows.jsonl
  soak_client.py check     --pool pool.json --refs refs.json --rows rows.jsonl --faults faults.txt

A request of the pool is a prompt of token ids (BOS + seeded ids), a KV policy and max_tokens;
greedy decoding makes its output a function of those alone, so every completed run of it must
give the reference's ids and finish reason. `load` runs C closed-loop clients, alternating over
the routers given; a fraction P of the requests is dropped by the client mid-stream (cancelled
after a seeded number of tokens). `check` accepts, per request: OK with the reference's output
(or, migrated by a --migrate router under a lossy policy, the reference's ids up to the
migration point: docs/failures.md says the rest may differ);
UNAVAILABLE naming a node, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED with details; a client drop
(CANCELLED by the client). Any other status, or any output that is not the reference (for an
error or a drop: not a prefix of it), is a violation. It prints the figures and exits 1 on one.
Run by soak.sh, which generates the gRPC stubs (tests/integration/lib/pystubs.sh).
"""
import argparse
import json
import random
import re
import sys
import threading
import time

CLEAR_ERRORS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
DROPPED = "DROPPED"  # the client cancelled the stream itself


def die(msg):
    print("soak_client: " + msg, file=sys.stderr)
    sys.exit(2)


def parse_args():
    ap = argparse.ArgumentParser(prog="soak_client.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("pool", "reference", "load", "check"))
    ap.add_argument("--model", help="pool: the model directory (its vocabulary and special ids)")
    ap.add_argument("--size", type=int, default=48, help="pool: distinct requests (48)")
    ap.add_argument("--policy", action="append", default=[], help="pool: KV policy spec, repeatable")
    ap.add_argument("--prompt-len", default="16:400", help="pool: prompt tokens LO:HI (16:400)")
    ap.add_argument("--output-len", default="8:64", help="pool: max_tokens LO:HI (8:64)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stubs", help="directory of the generated gRPC stubs")
    ap.add_argument("--router", action="append", default=[], help="router gRPC address, repeatable")
    ap.add_argument("--pool")
    ap.add_argument("--refs")
    ap.add_argument("--rows")
    ap.add_argument("--faults", help="check: the injected faults, one kind per line")
    ap.add_argument("--router-log", action="append", default=[],
                    help="check: a router's log, for the requests it migrated (repeatable)")
    ap.add_argument("--duration", type=float, default=60.0, help="load: seconds of sending")
    ap.add_argument("--concurrency", type=int, default=6, help="load: clients in flight")
    ap.add_argument("--drop", type=float, default=0.08, help="load: fraction dropped mid-stream")
    ap.add_argument("--timeout", type=float, default=90.0, help="a request's deadline, seconds")
    ap.add_argument("--out")
    a = ap.parse_args()
    need = {"pool": ("model", "out"), "reference": ("stubs", "pool", "out"),
            "load": ("stubs", "pool", "out"), "check": ("pool", "refs", "rows")}[a.command]
    for name in need:
        if getattr(a, name) is None:
            die("%s needs --%s" % (a.command, name))
    if a.command in ("reference", "load") and not a.router:
        die("%s needs --router" % a.command)
    if not 0 <= a.drop <= 1:
        die("--drop %g: a fraction in [0, 1]" % a.drop)
    if a.concurrency < 1 or a.size < 1 or a.duration <= 0:
        die("--concurrency, --size and --duration take positive values")
    return a


def span(flag, text):
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        die("%s %s: LO:HI expected" % (flag, text))
    if not 1 <= lo <= hi:
        die("%s %s: 1 <= LO <= HI expected" % (flag, text))
    return lo, hi


def make_pool(a):
    cfg = json.load(open(a.model + "/config.json"))
    specials = [x for x in (cfg.get("bos_token_id"), cfg.get("eos_token_id")) if isinstance(x, int)]
    top = min(specials + [cfg["vocab_size"]])  # ordinary ids lie below the special ones here
    plo, phi = span("--prompt-len", a.prompt_len)
    olo, ohi = span("--output-len", a.output_len)
    policies = a.policy or ["full"]
    rng = random.Random(a.seed)
    pool = []
    for i in range(a.size):
        n = rng.randint(plo, phi)
        ids = ([cfg["bos_token_id"]] if isinstance(cfg.get("bos_token_id"), int) else []) + \
            [rng.randrange(4, top) for _ in range(n)]
        pool.append({"item": i, "ids": ids, "policy": policies[i % len(policies)],
                     "max_tokens": rng.randint(olo, ohi)})
    json.dump(pool, open(a.out, "w"))


def connect(a):
    sys.path.insert(0, a.stubs)
    global grpc, pb
    import grpc
    from kvrelay.v1 import kvrelay_pb2 as pb
    from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc
    stubs = []
    for addr in a.router:
        ch = grpc.insecure_channel(addr)
        try:
            grpc.channel_ready_future(ch).result(timeout=30)
        except grpc.FutureTimeoutError:
            die("--router %s: no answer within 30 s" % addr)
        stubs.append((addr, pb_grpc.GenerationStub(ch)))
    return stubs


def send(stub, item, timeout, drop_after, request_id):
    """One streamed request, under the client's own request id (the routers' logs name it, so a
    row without a finish is still found there). Returns the row: status (OK, a gRPC code's name,
    or DROPPED), the ids received, the finish reason and nodes when it finished."""
    req = pb.GenerateRequest(max_tokens=item["max_tokens"], kv_policy=item["policy"], request_id=request_id)
    req.token_ids.ids.extend(item["ids"])
    row = {"item": item["item"], "request_id": request_id, "ids": [], "status": None, "details": "",
           "finish": None, "served_by": None}
    call = stub.Generate(req, timeout=timeout)
    try:
        for ev in call:
            if ev.WhichOneof("event") == "delta":
                row["ids"].extend(ev.delta.ids)
                if drop_after is not None and len(row["ids"]) >= drop_after and row["status"] is None:
                    row["status"] = DROPPED
                    call.cancel()
            else:
                u = ev.finish.usage
                row["finish"] = ev.finish.reason
                row["served_by"] = [u.served_by.prefill_node, u.served_by.decode_node]
        row["status"] = row["status"] or "OK"
    except grpc.RpcError as e:
        if row["status"] != DROPPED:
            row["status"], row["details"] = e.code().name, e.details() or ""
    return row


def reference(a):
    """Each pool request once, fault-free, a few at a time (retried on a clear error, which a
    loaded machine may give): the outputs every later run must reproduce."""
    stubs = connect(a)
    pool = json.load(open(a.pool))
    refs, lock, todo = {}, threading.Lock(), list(pool)

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop()
            for attempt in range(3):
                row = send(stubs[0][1], item, a.timeout, None, "soak-ref-%d-%d" % (item["item"], attempt))
                if row["status"] == "OK" or row["status"] not in CLEAR_ERRORS:
                    break
            with lock:
                refs[item["item"]] = row
    ths = [threading.Thread(target=worker) for _ in range(min(4, a.concurrency))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    bad = [r for r in refs.values() if r["status"] != "OK"]
    json.dump({str(k): v for k, v in refs.items()}, open(a.out, "w"))
    if bad:
        die("the fault-free pass failed %d of %d requests; the first: %s: %s"
            % (len(bad), len(pool), bad[0]["status"], bad[0]["details"]))
    print("reference: %d requests, fault-free, all OK" % len(pool))


def load(a):
    stubs = connect(a)
    pool = json.load(open(a.pool))
    out = open(a.out, "w")
    lock = threading.Lock()
    end = time.monotonic() + a.duration
    counter = [0]

    def worker(w):
        rng = random.Random(a.seed * 1000 + w)
        while time.monotonic() < end:
            with lock:
                n = counter[0]
                counter[0] += 1
            item = rng.choice(pool)
            addr, stub = stubs[n % len(stubs)]
            drop = rng.randint(1, max(1, item["max_tokens"] // 2)) if rng.random() < a.drop else None
            try:
                row = send(stub, item, a.timeout, drop, "soak-%d-%d" % (a.seed, n))
            except Exception as e:  # a client bug is a failed row, never a lost one
                row = {"item": item["item"], "request_id": "soak-%d-%d" % (a.seed, n), "ids": [],
                       "status": "CLIENT_ERROR", "details": "%s: %s" % (type(e).__name__, e),
                       "finish": None, "served_by": None}
            row["router"], row["drop_after"] = addr, drop
            with lock:
                out.write(json.dumps(row) + "\n")
                out.flush()
    ths = [threading.Thread(target=worker, args=(w,)) for w in range(a.concurrency)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    out.close()


def migrations(logs):
    """{request id: tokens sent before its first migration} from the routers' logs."""
    pat = re.compile(r"\[([^\]]+)\] migrating: .* after (\d+) tokens were sent")
    out = {}
    for path in logs:
        for line in open(path, errors="replace"):
            m = pat.search(line)
            if m:
                out.setdefault(m.group(1), int(m.group(2)))
    return out


def check(a):
    pool = {p["item"]: p for p in json.load(open(a.pool))}
    refs = {int(k): v for k, v in json.load(open(a.refs)).items()}
    rows = [json.loads(line) for line in open(a.rows) if line.strip()]
    faults = {}
    if a.faults:
        for line in open(a.faults):
            if line.strip():
                faults[line.split()[0]] = faults.get(line.split()[0], 0) + 1
    drops = sum(r["status"] == DROPPED for r in rows)
    if drops:
        faults["client-drop"] = drops
    migrated = migrations(a.router_log)
    by_status, mismatches, unclear, diverged = {}, [], [], 0
    completed = 0
    for r in rows:
        ref = refs[r["item"]]
        st = r["status"]
        by_status[st] = by_status.get(st, 0) + 1
        completed += st == "OK"
        # an error or a drop: the tokens streamed before it must be the reference's first ones
        exact = (r["ids"] == ref["ids"] and r["finish"] == ref["finish"]) if st == "OK" \
            else r["ids"] == ref["ids"][:len(r["ids"])]
        sent = migrated.get(r.get("request_id"))
        if exact:
            pass
        elif sent is not None and pool[r["item"]]["policy"] != "full" and r["ids"][:sent] == ref["ids"][:sent]:
            # a lossy policy re-applied to the prompt plus the tokens sent keeps other entries
            # (docs/failures.md, --migrate): the output may differ after the migration point
            diverged += 1
        else:
            mismatches.append(r)
        if st not in ("OK", DROPPED) and not (st in CLEAR_ERRORS and r["details"] and
                                               (st != "UNAVAILABLE" or "node" in r["details"])):
            unclear.append(r)
    print("requests:        %d (%d distinct; references from a fault-free pass)" % (len(rows), len(pool)))
    print("completed:       %d" % completed)
    print("errors:          %s" % (", ".join("%s %d" % kv for kv in sorted(by_status.items()) if kv[0] != "OK") or "none"))
    print("faults injected: %s" % (", ".join("%s %d" % kv for kv in sorted(faults.items())) or "none"))
    print("migrated:        %d (%d with a lossy policy diverging after the migration, as documented)"
          % (sum(r.get("request_id") in migrated for r in rows), diverged))
    print("mismatches:      %d" % len(mismatches))
    print("unclear errors:  %d" % len(unclear))
    for r in mismatches[:5]:
        ref = refs[r["item"]]
        k = next((i for i, (x, y) in enumerate(zip(r["ids"], ref["ids"])) if x != y),
                 min(len(r["ids"]), len(ref["ids"])))
        print("  MISMATCH item %d (%s) %s via %s, %s %s: from token %d got %s, reference %s "
              "(%d vs %d tokens, finish %s vs %s)"
              % (r["item"], pool[r["item"]]["policy"], r.get("request_id"), r.get("router"), r["status"],
                 r["served_by"], k, r["ids"][k:k + 6], ref["ids"][k:k + 6], len(r["ids"]), len(ref["ids"]),
                 r["finish"], ref["finish"]))
    for r in unclear[:5]:
        print("  UNCLEAR item %d via %s: %s: %s" % (r["item"], r.get("router"), r["status"], r["details"]))
    examples = {}
    for r in rows:
        if r["status"] in CLEAR_ERRORS:
            examples.setdefault(r["status"], r["details"])
    for st, d in sorted(examples.items()):
        print("  e.g. %s: %s" % (st, d))
    if not rows or completed == 0:
        print("  no request completed")
        return 1
    return 1 if mismatches or unclear else 0


def main():
    a = parse_args()
    if a.command == "pool":
        make_pool(a)
    elif a.command == "reference":
        reference(a)
    elif a.command == "load":
        load(a)
    else:
        sys.exit(check(a))


if __name__ == "__main__":
    main()
