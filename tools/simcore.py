"""simcore.py - kvrelay-sim's model of the cluster and its event loop: a cost profile read and
checked, the KV policies' footprints (entries kept per list after prefill and per decode step, as
the engine's max_entries rules give them), the cost models (chunked prefill, the bundle's bytes and
its pipelined transfer, batched decode steps), the cores the nodes share, and the discrete-event
simulation of the router, prefill and decode nodes that turns one run's arrivals (or a chat run's
conversations, turn after answer) into kvrelay-bench-serve's per-request rows. The prefix cache
and the router's index for kv-aware placement are tools/simprefix.py's.

Not a program: tools/kvrelay-sim imports it from tools/ and owns the flags, the runs' summaries,
calibration and comparison (docs/simulator.md has the model). It loads kvrelay-bench-serve as a
module because the simulator reads and writes that tool's formats, and its BenchError is the
simulator's bad-input error.
"""
import heapq
import importlib.machinery
import importlib.util
import json
import math
import os
import sys
import time

import simadaptive
import simprefix

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = "kvrelay-sim"

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "int8": 1, "fp8": 1}
QUANTIZED = ("int8", "fp8")  # a float32 scale per K and V row besides the bytes (docs/bundle.md)
CACHE_DTYPES = ("f32", "bf16", "f16")  # what the nodes' KV caches store (kr_kv_dtype)


def _load_bench_serve():
    """kvrelay-bench-serve as a module: its flag types, trace reader, request plan, summary,
    percentiles, goodput, printing and plots are the simulator's, so both write one format."""
    path = os.path.join(HERE, "kvrelay-bench-serve")
    loader = importlib.machinery.SourceFileLoader("kvrelay_bench_serve", path)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(mod)
    return mod


bench = _load_bench_serve()
benchlib = sys.modules["benchlib"]  # tools/benchlib.py, which kvrelay-bench-serve imported
SimError = bench.BenchError  # bad input: one line naming the flag, file or line; exit 2


def log(msg):
    print(PROG + ": " + msg, file=sys.stderr, flush=True)


# ================================================================== profiles

PROFILE_KEYS = {
    "model": ("layers", "kv_heads", "head_dim", "max_position"),
    "prefill": ("fixed_s", "per_token_s", "per_attended_s"),
    "decode": ("fixed_s", "per_seq_s", "per_entry_s"),
    "transfer": ("latency_s", "bandwidth_Bps"),
    "cluster": ("ttft_s", "join_s"),
}


def read_profile(path):
    """A profile as a dict, every required number checked (the fault names the file and key)."""
    try:
        with open(path) as f:
            p = json.load(f)
    except OSError as e:
        raise SimError("--profile %s: %s" % (path, e.strerror))
    except ValueError as e:
        raise SimError("--profile %s: not JSON (%s)" % (path, e))
    if not isinstance(p, dict) or p.get("format") != 1:
        raise SimError("--profile %s: not a kvrelay-sim profile (\"format\": 1 missing)" % path)
    for sec, keys in PROFILE_KEYS.items():
        if not isinstance(p.get(sec), dict):
            raise SimError("--profile %s: section \"%s\" missing" % (path, sec))
        for k in keys:
            v = p[sec].get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise SimError("--profile %s: %s.%s must be a number >= 0, not %s" % (path, sec, k, json.dumps(v)))
    if p["transfer"]["bandwidth_Bps"] <= 0:
        raise SimError("--profile %s: transfer.bandwidth_Bps must be positive" % path)
    if p["model"].get("kv_cache_dtype") not in CACHE_DTYPES:
        raise SimError("--profile %s: model.kv_cache_dtype must be one of %s, not %s: the nodes' KV cache "
                       "dtype, which sizes the decode pool's blocks and the default wire (the weights' dtype "
                       "on the CPU backend, f32 on CUDA; the decode node's model line names it, and "
                       "`kvrelay-sim calibrate` records it)"
                       % (path, ", ".join(CACHE_DTYPES), json.dumps(p["model"].get("kv_cache_dtype"))))
    cores = p.get("host", {}).get("cores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, (int, float)) or cores <= 0):
        raise SimError("--profile %s: host.cores must be a positive number or null" % path)
    beside = p.get("host", {}).get("prefill_beside_decode", 1.0)
    if isinstance(beside, bool) or not isinstance(beside, (int, float)) or not 0 < beside <= 1:
        raise SimError("--profile %s: host.prefill_beside_decode must be a number in (0, 1], not %s"
                       % (path, json.dumps(beside)))
    jit = p.get("jitter")
    if jit is not None:
        if not isinstance(jit, dict):
            raise SimError("--profile %s: jitter must be an object (prefill, decode) or absent" % path)
        for k in JITTER_KEYS:
            q = jit.get(k)
            if q is None:
                continue
            if (not isinstance(q, list) or len(q) < 2 or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                                             or not math.isfinite(x) or x <= 0 for x in q)
                    or any(b < a for a, b in zip(q, q[1:]))):
                raise SimError("--profile %s: jitter.%s must be ascending quantiles (at least 2 positive "
                               "numbers), not %s" % (path, k, json.dumps(q)[:80]))
    p.setdefault("policy_factor", {})
    return p


JITTER_KEYS = ("prefill", "decode")  # per-request cost factors, as quantiles (docs/simulator.md)
JITTER_QUANTILES = 21  # 0, 5, ..., 100%: what calibrate writes


class Jitter:
    """Per-request cost factors drawn from the profile's measured quantiles (inverse CDF,
    linear between quantiles): a request's prefill work and its share of every decode step are
    multiplied by its own factor. One generator per replica, seeded by --seed, drawn in request
    index order (a chat run's in the order its turns are sent), so one seed and replica give one
    result."""

    def __init__(self, prof, seed, replica, on):
        import numpy as np
        self.np = np
        jit = (prof.get("jitter") or {}) if on else {}
        self.q = {k: np.asarray(jit[k], dtype=np.float64) for k in JITTER_KEYS if jit.get(k)}
        self.rng = np.random.default_rng([seed, 13, replica])

    def any(self):
        return bool(self.q)

    def draw(self, key):
        q = self.q.get(key)
        if q is None:
            return 1.0
        return float(self.np.interp(self.rng.random() * (len(q) - 1), self.np.arange(len(q)), q))


# ================================================================== KV policies

def _sim_error(msg):
    raise SimError(msg)


def auto_table(args, specs):
    """Loads --calibration into args.auto_table when a spec of `specs` is kv_policy auto, and
    checks each auto spec against it (SimError naming the flag or spec)."""
    auto = [s for s in specs if simadaptive.is_auto(s)]
    args.auto_table = None
    if not auto:
        return
    if not getattr(args, "calibration", None):
        raise SimError("--policy '%s': auto needs --calibration FILE (kvrelay-eval --calibrate-out makes one; "
                       "docs/adaptive.md)" % auto[0])

    def footprint(spec):
        try:
            return Footprint(spec)
        except SimError:
            return None  # a family the simulator does not model: never chosen
    args.auto_table = simadaptive.Table(args.calibration, footprint, _sim_error)
    for s in auto:
        _, task = simadaptive.parse_auto(s, lambda m: _sim_error("--policy '%s': %s" % (s, m)))
        if task and task not in args.auto_table.tasks:
            raise SimError("--policy '%s': the calibration table %s scores no task '%s'" % (s, args.calibration, task))


def parse_policy(spec):
    """'name:key=value,...' -> (family, {key: value}) for the families the simulator models."""
    name, _, rest = spec.partition(":")
    kv = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise SimError("--policy '%s': '%s' is not key=value" % (spec, item))
        kv[k] = v
    if name not in FOOTPRINTS:
        raise SimError("--policy '%s': the simulator models %s (heads and hsft keep per-head windows "
                       "it does not model)" % (spec, ", ".join(sorted(FOOTPRINTS))))
    return name, kv


def _int(spec, kv, key, default):
    v = kv.get(key, default)
    try:
        return int(v)
    except (TypeError, ValueError):
        raise SimError("--policy '%s': %s=%s is not an integer" % (spec, key, v))


def _decode_window(spec, kv):
    """decode=grow (None) or decode=window:W (W)."""
    d = kv.get("decode", "grow")
    if d == "grow":
        return None
    if d.startswith("window:"):
        return _int(spec, {"w": d[7:]}, "w", None)
    raise SimError("--policy '%s': decode=%s (grow or window:W)" % (spec, d))


class Footprint:
    """A policy's entries per (layer, KV head) list as a function of the prompt length, from the
    engine's max_entries rules (engine/policy-*.c; docs/policies.md): `kept(n)` after prefill (what
    the bundle carries), `at(n, g)` after g decode tokens, and `cap` the most a list holds during
    prefill (bounds a chunk's attention). windowed: the list's decode window (blocks bound)."""

    def __init__(self, spec):
        self.spec = spec
        self.family, self.kv = parse_policy(spec)
        FOOTPRINTS[self.family](self, spec, self.kv)

    def at(self, n, g):
        k = self.kept(n)
        if self.decode_window is not None:
            return k + min(g, self.decode_window + 1)
        if self.grow_cap is not None:
            return min(k + g, self.grow_cap)
        return k + g


def _fp_full(f, spec, kv):
    f.kept, f.cap, f.decode_window, f.grow_cap, f.windowed = (lambda n: n), None, None, None, False


def _fp_streaming(f, spec, kv):
    sink, window, lazy = _int(spec, kv, "sink", 4), _int(spec, kv, "window", 2044), _int(spec, kv, "lazy", 1)
    grows = kv.get("decode", "prune") == "grow"
    c = sink + window + max(lazy - 1, 0)
    f.kept = (lambda n: n) if lazy == 0 else (lambda n: min(n, c))
    f.cap = None if lazy == 0 else c
    f.decode_window, f.windowed = None, lazy > 0 and not grows
    f.grow_cap = None if (lazy == 0 or grows) else c + 1


def _fp_budget(key, default):
    def make(f, spec, kv):
        b = _int(spec, kv, key, default)
        if b is None or b < 1:
            raise SimError("--policy '%s': needs %s=B (B >= 1)" % (spec, key))
        f.kept = lambda n: min(n, b)
        f.cap, f.decode_window, f.grow_cap = b, _decode_window(spec, kv), None
        f.windowed = f.decode_window is not None
    return make


def _fp_snapkv(f, spec, kv):
    if "budget" in kv:
        return _fp_budget("budget", None)(f, spec, kv)
    if "ratio" not in kv:
        raise SimError("--policy '%s': snapkv needs budget=B or ratio=p" % spec)
    try:
        p = float(kv["ratio"])
    except ValueError:
        p = float("nan")
    if not 0 <= p < 1:
        raise SimError("--policy '%s': ratio=%s must be in [0, 1)" % (spec, kv["ratio"]))
    obs = _int(spec, kv, "obs", 64)
    f.kept = lambda n: min(n, int(round((1 - p) * n)) + obs)
    f.cap, f.decode_window, f.grow_cap = None, _decode_window(spec, kv), None
    f.windowed = f.decode_window is not None


def _fp_sage(f, spec, kv):
    b = _int(spec, kv, "budget", 8192)
    f.kept, f.cap, f.decode_window, f.windowed = (lambda n: min(n, b + 1)), None, None, True
    f.grow_cap = b + 1  # SAGE's own decode rule: the cache stays at B + 1


FOOTPRINTS = {"full": _fp_full, "streaming": _fp_streaming, "snapkv": _fp_snapkv,
              "pyramidkv": _fp_snapkv, "take": _fp_budget("budget", 512), "sage": _fp_sage}


# ================================================================== the cost models

class Costs:
    """The profile's cost models. Times are seconds of one node's compute at full speed."""

    def __init__(self, prof, chunk, wire_dtype, pipeline=True):
        """wire_dtype: the bundle payload's, or "auto" for the KV cache's (the prefill node's
        --kv-dtype auto: the rows as cached)."""
        self.p, self.chunk, self.pipeline = prof, chunk, pipeline
        m = prof["model"]
        self.layers = m["layers"]
        self.lists = m["layers"] * m["kv_heads"]
        self.head_dim = m["head_dim"]
        self.max_position = m["max_position"]
        self.cache_dtype = m["kv_cache_dtype"]
        self.wire_dtype = self.cache_dtype if wire_dtype == "auto" else wire_dtype
        self.row_bytes = self.head_dim * DTYPE_BYTES[self.wire_dtype] + (4 if self.wire_dtype in QUANTIZED else 0)
        # pool bytes of one entry of one list, as the decode node sizes its blocks: K and V rows
        # in the cache's dtype and a position
        self.entry_bytes = self.head_dim * 2 * DTYPE_BYTES[self.cache_dtype] + 4

    def chunk_s(self, n, fp, start=0, held=0):
        """Chunked prefill of n tokens, chunk by chunk: [(tokens, seconds)], the fixed cost in
        the first; each chunk costs per token + per (query, attended key) pair, its queries
        attending to what the policy kept of the chunks before plus the chunk (causal); times
        the family's measured scoring factor. start: tokens continued from a prefix cache's
        state of `held` entries per list (computed from there)."""
        pf = self.p["prefill"]
        f = self.p["policy_factor"].get(fp.family, 1.0)
        out, cached, at = [], held, start
        while at < n:
            c = min(self.chunk, n - at)
            t = pf["per_token_s"] * c + pf["per_attended_s"] * c * (cached + (c + 1) / 2.0)
            out.append((c, (t + (pf["fixed_s"] if at == start else 0.0)) * f))
            cached = cached + c if fp.cap is None else min(cached + c, fp.cap)
            at += c
        return out

    def prefill_s(self, n, fp, start=0, held=0):
        return sum(t for _, t in self.chunk_s(n, fp, start, held))

    def transfer_after_prefill_s(self, n, fp, wire_bytes, start=0, held=0):
        """What the bundle's transfer adds after the prefill's compute. Without pipelining, all
        of it. With it (docs/prefill-node.md, "Layer-wise pipelining"), parts cross the link one
        at a time as they become final: under full (no cap: every entry final once computed) an
        early part with each chunk's entries at its end (at most 32, every k-th chunk), then a
        segment per layer of the last chunk as its layers compute, the last layer's when the
        compute ends; what is still moving then is added. A prefix continued from the cache
        (start tokens) is final from the start: under full it goes with the first part."""
        if not self.pipeline or self.layers < 2:
            return self.transfer_s(wire_bytes)
        chunks = self.chunk_s(n, fp, start, held)
        parts, now = [], 0.0  # (ready time, bytes)
        ends = len(chunks) - 1
        every = max(1, -(-ends // 32))
        pending = wire_bytes * start / n if fp.cap is None else 0.0
        for i, (c, t) in enumerate(chunks[:-1]):
            now += t
            if fp.cap is None:
                pending += wire_bytes * c / n
                if (i + 1) % every == 0:
                    parts.append((now, pending))
                    pending = 0.0
        last_c, last_t = chunks[-1]
        rest = wire_bytes - sum(b for _, b in parts)
        for layer in range(self.layers):
            parts.append((now + last_t * (layer + 1) / self.layers, rest / self.layers))
        end, free = now + last_t, 0.0
        for ready, b in parts:
            free = max(ready, free) + self.transfer_s(b)
        return max(free - end, 0.0)

    def bundle_bytes(self, entries_per_list):
        """(payload bytes as Usage.kv_bytes_shipped counts them, bytes on the wire: docs/bundle.md)."""
        e = entries_per_list * self.lists
        payload = e * 2 * self.row_bytes
        return payload, payload + 4 * e + 40 * self.lists + 256

    def transfer_s(self, wire_bytes):
        t = self.p["transfer"]
        return t["latency_s"] + wire_bytes / t["bandwidth_Bps"]

    def step_s(self, batch, entries):
        """One batched decode forward: batch sequences reading `entries` KV entries per list in
        all. With per-request factors, batch is their sum and entries the sum of each sequence's
        entries times its factor."""
        d = self.p["decode"]
        return d["fixed_s"] + d["per_seq_s"] * batch + d["per_entry_s"] * entries


def blocks_bound(fp, n_prompt, max_tokens, lists, block_size):
    """kr_seq_blocks_bound: blocks the sequence may hold at its worst (engine/seq-io.c)."""
    most = fp.at(n_prompt, max_tokens - 1)
    span = most + block_size - 1 if fp.windowed else most
    return lists * ((span + block_size - 1) // block_size)


# ================================================================== the simulation

class Compute:
    """Compute jobs of every node. With host.cores null each node has its own device (a job runs
    at full speed); with host.cores C every node shares C cores with B cores' worth of other
    users' runnable threads (host.background, or --background): n busy jobs each run at min(1, C / (n + B))
    of full speed (processor sharing), as this machine's processes do; a prefill job runs at
    host.prefill_beside_decode of that while a decode batch steps (calibrate measures it: each
    token a batch streams wakes threads in three processes, and they preempt the prefill
    thread far more than the CPU time they use says)."""

    def __init__(self, sim, cores, background, beside):
        self.sim, self.cores, self.background, self.beside = sim, cores, background, beside
        self.active, self.last = [], 0.0

    def rates(self):
        """Each job's share: the scheduler shares the cores among our jobs and the machine's
        other runnable threads (`background` of them on average)."""
        r = min(1.0, self.cores / (len(self.active) + self.background))
        slow = r * self.beside if any(j[3] == "decode" for j in self.active) else r
        return [slow if j[3] == "prefill" else r for j in self.active]

    def _advance(self):
        if self.active:
            for j, r in zip(self.active, self.rates()):
                j[0] -= (self.sim.now - self.last) * r
        self.last = self.sim.now

    def _reschedule(self):
        for j, r in zip(self.active, self.rates()):
            j[2] += 1
            self.sim.at(self.sim.now + max(j[0], 0.0) / r, self._end, j, j[2])

    def start(self, work, done, kind=None):
        """Runs `work` seconds of one core's compute, then calls done(); kind "prefill" or
        "decode" for the nodes' forwards (see prefill_beside_decode), None for other work."""
        if self.cores is None:
            self.sim.at(self.sim.now + work, done)
            return
        self._advance()
        self.active.append([work, done, 0, kind])
        self._reschedule()

    def _end(self, job, version):
        if version != job[2]:
            return  # superseded by a reschedule
        self._advance()
        self.active.remove(job)
        self._reschedule()
        job[1]()


class Request:
    __slots__ = ("i", "warmup", "policy", "fp", "n", "out", "arrival", "row", "bound", "entries",
                 "generated", "enqueued", "dnode", "pnode", "times", "queued", "attended", "full", "pf", "df",
                 "segs", "keys", "start", "held", "hit_state", "branch", "session")


class DecodeNode:
    def __init__(self, i, blocks):
        self.id, self.total, self.reserved = "decode-%d" % i, blocks, 0
        self.joining, self.running, self.stepping = [], [], False

    def free(self):
        return self.total - self.reserved


class PrefillNode:
    def __init__(self, i, cache, index):
        self.i, self.id, self.fifo, self.busy, self.outstanding = i, "prefill-%d" % i, [], False, 0
        self.cache, self.index = cache, index  # its prefix cache (None: off); the router's index of it


class Sim:
    def __init__(self, args, prof, costs):
        self.args, self.prof, self.costs = args, prof, costs
        self.now, self.events, self.n_events = 0.0, [], 0
        host = prof.get("host", {})
        bg = args.background if args.background is not None else host.get("background", 0.0)
        self.compute = Compute(self, host.get("cores"), bg, host.get("prefill_beside_decode", 1.0))
        budget = args.prefix_cache_memory
        self.prefill = [PrefillNode(i, simprefix.PrefixCache(budget, simprefix.BLOCK_ENTRIES * costs.entry_bytes,
                                                             costs.lists) if budget else None,
                                    simprefix.KvIndex(args.kv_index_blocks)) for i in range(args.prefill)]
        self.decode = [DecodeNode(i, args.kv_blocks) for i in range(args.decode)]
        self.fifo, self.backoff = [], 0.010
        self.turn = 0
        self.done = 0
        self.on_end = None  # called with each request as it ends (the closed loop's next send)
        self.fps = {}  # Footprints of the specs kv_policy auto chose

    def at(self, t, fn, *a):
        self.n_events += 1
        heapq.heappush(self.events, (t, self.n_events, fn, a))

    def run(self, progress):
        """Every event in time order (ties in the order they were scheduled); progress(self)
        every 2 s of wall time."""
        last = time.monotonic()
        while self.events:
            t, _, fn, a = heapq.heappop(self.events)
            self.now = t
            fn(*a)
            if time.monotonic() - last > 2:
                last = time.monotonic()
                progress(self)

    def prefix_figures(self):
        """The prefill nodes' prefix cache counters summed, and what they hold at the end (the
        nodes' kvrelay_prefix_cache_* metrics); None with the cache off."""
        caches = [p.cache for p in self.prefill if p.cache is not None]
        if not caches:
            return None
        out = {k: sum(c.stats[k] for c in caches) for k in caches[0].stats}
        for k in ("states", "bytes", "budget_bytes"):
            out[k] = sum(c.held()[k] for c in caches)
        out["hit_rate"] = out["hits"] / out["lookups"] if out["lookups"] else None
        return out

    # ---------------------------------------------------------- the router

    def arrive(self, r):
        r.row["sent_s"] = self.now
        if r.fp is None:  # kv_policy auto: the router chooses as it validates the request
            self._auto(r)
        cpu = self.prof["cluster"].get("cpu_per_request_s", 0.0)
        if cpu > 0:  # the router's and the client's work for a request, before it is placed
            self.compute.start(cpu, lambda: self._routed(r))
        else:
            self._routed(r)

    def _auto(self, r):
        """The router's auto rule (tools/simadaptive.py) at the pressure the router sees now: every
        decode node's free and total blocks and the admission FIFO's length."""
        level = simadaptive.pressure(sum(d.free() for d in self.decode), sum(d.total for d in self.decode),
                                     len(self.fifo))
        lists, bs = self.costs.lists, self.args.block_size
        spec, score, reason = self.args.auto_table.choose(
            simadaptive.parse_auto(r.policy, _sim_error), r.n, r.out, level,
            lambda fp, n, out, b: blocks_bound(fp, n, out, lists, b), self.fps.setdefault("full", Footprint("full")))
        r.fp = self.fps.setdefault(spec, Footprint(spec))
        r.bound = blocks_bound(r.fp, r.n, r.out, lists, bs)
        if self.args.prefix_cache_memory > 0 and simprefix.reuses(r.fp.family, r.fp.kv):
            r.keys = simprefix.chain(r.segs, r.n, self.args.chunk, spec)
        r.row.update(auto_policy=spec, auto_score=score, auto_pressure=level, auto_reason=reason)

    def _routed(self, r):
        if self.fifo:
            self._enqueue(r)  # a request never overtakes one that waits
        elif not self._place(r):
            self._enqueue(r)
            self.backoff = 0.010
            self._head_later()

    def _enqueue(self, r):
        r.enqueued = self.now
        r.queued = True
        self.fifo.append(r)
        self.at(self.now + self.args.max_queue_ms / 1e3, self._queue_timeout, r)

    def _queue_timeout(self, r):
        if r.queued:  # the head's pending retry serves whoever heads the FIFO next
            self.fifo.remove(r)
            r.queued = False
            self._fail(r, "RESOURCE_EXHAUSTED", "every decode node is full; gave up after %d ms "
                       "(--max-queue-ms)" % self.args.max_queue_ms)

    def _head_later(self):
        """The head's next try: 10 ms after a failed one, doubling to 500 ms (router/generate.c)."""
        self.at(self.now + self.backoff, self._head_try)
        self.backoff = min(self.backoff * 2, 0.5)

    def _head_try(self):
        while self.fifo:
            r = self.fifo[0]
            if not self._place(r):
                self._head_later()
                return
            self.fifo.pop(0)
            r.queued = False
            self.backoff = 0.010  # the next head tries at once, with a fresh backoff

    def _order(self, nodes, key):
        n, turn = len(nodes), self.turn
        rot = [(i - turn) % n for i in range(n)]
        if self.args.placement == "round-robin":
            return sorted(range(n), key=lambda i: rot[i])
        return sorted(range(n), key=lambda i: key(nodes[i]) + (rot[i],))

    def _place(self, r):
        """Reserve on a decode node and queue the prefill; False when every decode node is full."""
        order = self._order(self.decode, lambda d: (-d.free(), len(d.running) + len(d.joining)))
        d = next((self.decode[i] for i in order if self.decode[i].free() >= r.bound), None)
        if d is None:
            if all(r.bound > x.total for x in self.decode):
                self._fail(r, "OUT_OF_RANGE", "need %d blocks, more than a decode node's whole pool of %d"
                           % (r.bound, self.decode[0].total))
                return True
            return False
        if self.args.placement == "kv-aware" and r.keys:
            # the router's rule (docs/prefix-cache.md): cost = queued prefill tokens + prompt
            # tokens not predicted cached; ties in least-loaded's order
            chunk = self.args.chunk
            porder = self._order(self.prefill, lambda p: (p.outstanding + r.n - p.index.predicted(r.keys) * chunk,
                                                          p.outstanding, len(p.fifo) + p.busy))
        else:
            porder = self._order(self.prefill, lambda p: (p.outstanding, len(p.fifo) + p.busy))
        p = self.prefill[porder[0]]
        self.turn += 1
        d.reserved += r.bound
        r.dnode, r.pnode = d, p
        r.row["queue_s"] = self.now - r.enqueued if r.enqueued is not None else 0.0
        p.outstanding += r.n
        p.fifo.append(r)
        if not p.busy:
            self._prefill_next(p)
        return True

    def _fail(self, r, status, error):
        r.row.update(status=status, error=error, end_s=self.now, token_times_s=[], tokens_received=0)
        self._ended(r)

    def _ended(self, r):
        self.done += 1
        if self.on_end:
            self.on_end(r)

    # ---------------------------------------------------------- prefill nodes

    def _prefill_next(self, p):
        if not p.fifo:
            p.busy = False
            return
        p.busy = True
        r = p.fifo.pop(0)
        self._lookup(p, r)
        self.compute.start(self.costs.prefill_s(r.n, r.fp, r.start, r.held) * r.pf, lambda: self._prefilled(p, r),
                           "prefill")

    def _lookup(self, p, r):
        """The node's prefix cache before a prefill: the longest cached prefix (held while the
        prefill runs) and the branch point. A policy that does not reuse goes around it."""
        r.start = r.held = r.branch = 0
        r.hit_state = None
        c = p.cache
        if c is None:
            return
        if not simprefix.reuses(r.fp.family, r.fp.kv):
            c.stats["bypass"] += 1
            return
        if not r.keys:
            return
        c.stats["lookups"] += 1
        hit, st, r.branch = c.lookup(r.keys)
        if st is not None:
            st.users += 1
            r.hit_state, r.start, r.held = st, hit * self.args.chunk, st.entries
            c.stats["hits"] += 1
            c.stats["tokens_reused"] += r.start

    def _keep(self, p, r):
        """After the prefill: the states at the branch point and the last boundary are kept, the
        hit released, and the router records the prompt on the node that prefilled it."""
        c = p.cache
        if c is None or not r.keys:
            return
        if r.hit_state is not None:
            r.hit_state.users -= 1
        chunk = self.args.chunk
        if r.branch * chunk > r.start:
            c.insert(r.keys[:r.branch], simprefix.state_entries(r.fp, r.branch * chunk))
        c.insert(r.keys, simprefix.state_entries(r.fp, len(r.keys) * chunk))
        p.index.record(r.keys)

    def _prefilled(self, p, r):
        kept = r.fp.kept(r.n)
        payload, wire = self.costs.bundle_bytes(kept)
        r.row.update(kv_bytes_shipped=payload, kv_entries_shipped=kept * self.costs.lists)
        if r.row.get("cached_tokens") is not None:
            r.row["cached_tokens"] = r.start
        r.entries = kept
        self._keep(p, r)
        self.at(self.now + self.costs.transfer_after_prefill_s(r.n, r.fp, wire, r.start, r.held), self._shipped, p, r)

    def _shipped(self, p, r):
        p.outstanding -= r.n
        self._prefill_next(p)
        self.at(self.now + self.prof["cluster"]["ttft_s"], self._first_token, r)

    def _first_token(self, r):
        r.times.append(self.now)
        r.generated = 1
        if r.out == 1:
            self._finish(r, r.dnode)
            return
        self.at(self.now + self.prof["cluster"]["join_s"], self._import, r)

    # ---------------------------------------------------------- decode nodes

    def _import(self, r):
        """The decode node's work per request before the sequence joins (the Decode call, the
        bundle's import into its blocks): on the shared cores, off the batch's steps."""
        cpu = self.prof["decode"].get("import_s", 0.0)
        if cpu > 0:
            self.compute.start(cpu, lambda: self._join(r))
        else:
            self._join(r)

    def _join(self, r):
        d = r.dnode
        d.joining.append(r)
        if not d.stepping:
            self._step(d)

    def _step(self, d):
        d.running.extend(d.joining)
        d.joining = []
        if not d.running:
            d.stepping = False
            return
        d.stepping = True
        mb, t = self.args.max_batch, 0.0
        for at in range(0, len(d.running), mb):
            part = d.running[at:at + mb]
            t += self.costs.step_s(sum(x.df for x in part), sum(x.df * x.entries for x in part))
        self.compute.start(t, lambda: self._stepped(d), "decode")

    def _stepped(self, d):
        cpu = self.prof["cluster"].get("cpu_per_token_s", 0.0)
        if cpu > 0:  # relaying the step's tokens (router, client): off the path, but on the cores
            self.compute.start(cpu * len(d.running), lambda: None)
        still = []
        for r in d.running:
            r.attended += r.entries
            r.full += r.n + r.generated
            r.generated += 1
            r.entries = r.fp.at(r.n, r.generated - 1)
            r.times.append(self.now)
            if r.generated >= r.out:
                self._finish(r, d)
            else:
                still.append(r)
        d.running = still
        self._step(d)

    def _finish(self, r, d):
        d.reserved -= r.bound
        kept = r.fp.kept(r.n)
        r.row.update(status="OK", end_s=self.now, token_times_s=r.times, tokens_received=r.generated,
                     completion_tokens=r.generated, finish_reason="length",
                     kv_footprint=(r.n + r.attended) / (r.n + r.full) if r.full else kept / r.n,
                     peak_kv_entries=max(kept, r.entries) * self.costs.lists,
                     served_by={"prefill": r.pnode.id, "decode": d.id}, request_id="sim-%d" % r.i)
        self._ended(r)


# ================================================================== a run

class NoPrompt:
    """bench.Plan cuts prompts from a tokenized text; the simulator needs only their lengths."""
    bos = []

    def prompt(self, rng, n):
        return None


def shares_prefixes(args, plan):
    """Whether a run's prompts may share prefixes (conversations, named prefixes, token ids from a
    trace): its rows then carry cached_tokens and reusable_tokens, and its summary the bench's
    cache figures; a run of independent synthetic prompts keeps the summary it had before."""
    if plan.sessions is not None or getattr(args, "workload", "single") == "shared-prefix":
        return True
    return plan.trace is not None and any(t["prefix"] is not None or t["prompt_ids"] is not None for t in plan.trace)


def request_plan(args, plan, i):
    """Request i of a run that is not a chat run, as bench.Plan.request gives it (the same draws
    for the same seed), and its prompt's segments (simprefix.chain)."""
    if plan.trace is None and getattr(args, "workload", "single") == "shared-prefix":
        import numpy as np
        doc, qlen, out = benchlib.shared_prefix_request(args, np.random.default_rng([args.seed, i]))
        q = {"index": i, "warmup": i < args.warmup, "policy": args.policies[i % len(args.policies)],
             "prefix": doc, "prefix_len": args.prefix_len, "prompt_len": args.prefix_len + qlen, "output_len": out,
             "trace_line": None, "prompt_ids": None, "prefix_ids": None}
    else:
        q = plan.request(i)
        if q["prompt_len"] is None:  # a trace line with text: its length is unknown here
            raise SimError("%s:%d: the simulator needs prompt_tokens (a count or ids), not prompt text"
                           % (args.trace, q["trace_line"]))
    if q.get("prompt_ids") is not None:  # the whole prompt's ids (a trace's)
        return q, [(("ids", tuple(q["prompt_ids"])), q["prompt_len"])]
    return q, simprefix.prefix_segment(q) + [(("req", i), q["prompt_len"] - q["prefix_len"])]


def turn_plan(args, plan, j, index, line, prev):
    """A chat run's turn (session j, its line) as a request and its segments; prev: the previous
    turn's Request or None. As bench.Plan.turn: the previous prompt, its answer (the tokens it
    generated) and the turn's message."""
    segs = simprefix.turn_segments(line, index, prev and (prev.segs, prev.generated, prev.i))
    q = {"index": index, "warmup": plan.trace is None and j < args.warmup, "trace_line": line["trace_line"],
         "policy": line["policy"] or args.policies[index % len(args.policies)], "output_len": line["output_len"],
         "prompt_len": sum(n for _, n in segs), "conversation": line["conversation"], "turn": line["turn"],
         "prefix": line["prefix"], "prefix_len": line["prefix_len"],
         "reusable_tokens": prev.n + prev.generated if prev is not None else 0}
    return q, segs


def simulate(args, prof, costs, plan, rate, label, fps, jitter):
    """One run, as kvrelay-bench-serve's run_one: (rows in index order (before derive), the
    client's figures, the prefix caches' figures summed over the prefill nodes). A chat run plays
    its conversations as the bench does: each turn sent think_s after the previous answer ends,
    a conversation stopped by a failed turn."""
    sim = Sim(args, prof, costs)
    reqs, seen = [], set()
    report = shares_prefixes(args, plan)
    reusing = args.prefix_cache_memory > 0

    def add(q, at, segs):
        r = Request()
        r.i, r.warmup, r.policy, r.n, r.out = q["index"], q["warmup"], q["policy"], q["prompt_len"], q["output_len"]
        if r.n + r.out > costs.max_position:
            raise SimError("request %d needs %d positions (prompt + output); the profile's model has %d"
                           % (r.i, r.n + r.out, costs.max_position))
        auto = simadaptive.is_auto(r.policy)  # chosen at arrival (Sim._auto)
        r.fp = None if auto else fps.setdefault(r.policy, Footprint(r.policy))
        r.bound = None if auto else blocks_bound(r.fp, r.n, r.out, costs.lists, args.block_size)
        r.arrival, r.enqueued, r.queued, r.dnode, r.pnode = at, None, False, None, None
        r.times, r.generated, r.entries, r.attended, r.full = [], 0, 0, 0, 0
        r.pf, r.df = jitter.draw("prefill"), jitter.draw("decode")
        r.segs, r.session = segs, None
        r.keys = simprefix.chain(segs, r.n, args.chunk, r.policy) \
            if reusing and not auto and simprefix.reuses(r.fp.family, r.fp.kv) else []
        r.row = {"index": r.i, "warmup": r.warmup, "policy": r.policy, "trace_line": q["trace_line"],
                 "scheduled_s": at, "prompt_tokens": r.n, "max_tokens": r.out, "status": None,
                 "error": None, "queue_s": 0.0, "kv_bytes_shipped": 0, "kv_entries_shipped": 0}
        if report:  # as the bench counts them: a named prefix is reusable once an earlier request sent it
            reusable = q.get("reusable_tokens", 0)
            if q.get("prefix") is not None:
                if q["prefix"] in seen:
                    reusable = max(reusable, q["prefix_len"])
                seen.add(q["prefix"])
            r.row.update(conversation=q.get("conversation"), turn=q.get("turn"), prefix=q.get("prefix"),
                         reusable_tokens=reusable, cached_tokens=0)
        reqs.append(r)
        sim.at(at, sim.arrive, r)
        return r

    if plan.sessions is not None:
        def play(j, k, prev):
            index, line = plan.sessions[j][k]
            q, segs = turn_plan(args, plan, j, index, line, prev)
            add(q, sim.now, segs).session = (j, k)

        def turn_ended(r):
            j, k = r.session
            if r.row["status"] == "OK" and k + 1 < len(plan.sessions[j]):
                sim.at(sim.now + plan.sessions[j][k + 1][1]["think_s"], play, j, k + 1, r)
            elif args.concurrency is not None and plan.trace is None:
                start_next()
        pending = iter(range(len(plan.sessions)))

        def start_next():
            j = next(pending, None)
            if j is not None:
                play(j, 0, None)
        sim.on_end = turn_ended
        if args.concurrency is not None and plan.trace is None:
            for _ in range(args.concurrency):
                start_next()
        else:
            starts = (x[0][1]["arrival_s"] for x in plan.sessions) if plan.trace is not None else plan.arrivals(rate)
            for j, at in zip(range(len(plan.sessions)), starts):
                sim.at(at, play, j, 0, None)
    elif args.concurrency is not None and plan.trace is None:
        loop = benchlib.ClosedLoop(args, plan.trace)

        def next_one(ended=None):
            i = loop.next_index(sim.now)
            if i is not None:
                q, segs = request_plan(args, plan, i)
                add(q, sim.now, segs)
        sim.on_end = next_one
        for _ in range(args.concurrency):
            next_one()
    else:
        for i, at in benchlib.open_loop(args, plan, rate):
            q, segs = request_plan(args, plan, i)
            add(q, at, segs)
    wall0 = time.monotonic()

    def progress(s):
        if not args.no_progress:
            log("%s: %d/%d requests done, simulated %.1f s, %.0f s of wall time"
                % (label, s.done, len(reqs), s.now, time.monotonic() - wall0))
    sim.run(progress)
    rows = []
    for r in sorted(reqs, key=lambda x: x.i):
        if r.row["status"] is None:  # cannot happen: every request ends OK or refused
            raise RuntimeError("request %d never ended" % r.i)
        rows.append(r.row)
    return rows, {"cpu_s": 0.0, "wall_s": time.monotonic() - wall0, "simulated_s": sim.now}, sim.prefix_figures()
