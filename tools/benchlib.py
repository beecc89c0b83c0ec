"""benchlib.py - what kvrelay-bench-serve (real runs) and kvrelay-sim (simulated ones) share so
that both take the same load and write the same runs: the load, request-length and output flags
with their checks, the runs' modes (a rate sweep, a closed loop, a trace), which requests a run
sends when, and the shape of the generated workloads (the chat workload's conversations and
turns, the shared-prefix workload's documents), without their tokens. Not a program; both tools
import it from tools/.
"""
import argparse
import math


def length_spec():
    """'256' (fixed) or '128:512' (uniform, both ends included) -> (lo, hi)."""
    def parse(s):
        try:
            parts = [int(x) for x in s.split(":")]
        except ValueError:
            raise argparse.ArgumentTypeError("'%s': expected N or LO:HI (token counts)" % s)
        if len(parts) == 1:
            parts *= 2
        if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
            raise argparse.ArgumentTypeError("'%s': expected N or LO:HI with 1 <= LO <= HI" % s)
        return tuple(parts)
    return parse


def uniform(rng, lo_hi):
    """A length drawn uniformly from (lo, hi), both ends included."""
    lo, hi = lo_hi
    return lo if lo == hi else int(rng.integers(lo, hi + 1))


def rate_list(s):
    try:
        rates = [float(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError("'%s': expected requests/s, or several separated by commas" % s)
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError("'%s': every rate must be a positive number" % s)
    return rates


SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


def slo_spec(s):
    """'ttft_ms=200,tpot_ms=50' -> {key: milliseconds}; an unknown key is an error naming it."""
    out = {}
    for item in s.split(","):
        if not item.strip():
            continue
        key, eq, val = item.partition("=")
        key = key.strip()
        if key not in SLO_KEYS:
            raise argparse.ArgumentTypeError("unknown key '%s' (keys: %s)" % (key, ", ".join(SLO_KEYS)))
        try:
            v = float(val)
        except ValueError:
            v = float("nan")
        if not eq or not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError("%s needs a positive number of milliseconds ('%s')" % (key, item))
        out[key] = v
    if not out:
        raise argparse.ArgumentTypeError("'%s': no key=value in it (keys: %s)" % (s, ", ".join(SLO_KEYS)))
    return out


def add_load_args(g):
    """The load group: open loop, closed loop, or a trace, and how long."""
    g.add_argument("--rate", type=rate_list, metavar="R[,R...]",
                   help="open loop: requests per second; several comma-separated values = a sweep")
    g.add_argument("--burstiness", type=float, metavar="B",
                   help="gamma arrivals of shape B (with --rate; 1 = Poisson, the default)")
    g.add_argument("--concurrency", type=int, metavar="C",
                   help="closed loop: C requests in flight, the next sent as one ends")
    g.add_argument("--num-requests", type=int, metavar="N",
                   help="measured requests per run (default 100 unless --duration)")
    g.add_argument("--duration", type=float, metavar="S",
                   help="send for S seconds per run (after the warmup) instead of --num-requests")
    g.add_argument("--warmup", type=int, default=0, metavar="W",
                   help="requests sent first and left out of every figure (0)")
    g.add_argument("--trace", metavar="FILE.jsonl",
                   help="replay this trace (above): exactly its requests at its arrival times")
    g.add_argument("--seed", type=int, default=1, help="seed of arrivals, lengths and prompt windows (1)")


def add_request_args(g):
    """The requests' lengths and policies."""
    g.add_argument("--prompt-len", type=length_spec(), default=(256, 256), metavar="N|LO:HI",
                   help="prompt tokens, fixed or uniform in [LO, HI] (256)")
    g.add_argument("--output-len", type=length_spec(), default=(64, 64), metavar="N|LO:HI",
                   help="max_tokens, fixed or uniform in [LO, HI] (64)")
    g.add_argument("--policy", action="append", default=[], metavar="SPEC",
                   help="KV policy spec (docs/policies.md), repeatable: requests cycle through "
                        "them (default: full)")


WORKLOADS = ("single", "chat", "shared-prefix")


def add_workload_args(g):
    """The workload group: independent prompts, conversations, or prompts sharing long prefixes.
    Defaults are None where a flag given to the wrong workload must be refused."""
    g.add_argument("--workload", choices=WORKLOADS, default="single",
                   help="single: independent prompts (--prompt-len; the default); chat: conversations "
                        "whose every turn resends the conversation so far; shared-prefix: requests made "
                        "of one of --prefixes long documents and a question of their own")
    g.add_argument("--conversations", type=int, metavar="N",
                   help="chat: measured conversations per run, after the --warmup ones (16)")
    g.add_argument("--turns", type=length_spec(), metavar="N|LO:HI",
                   help="chat: turns per conversation, fixed or uniform (4)")
    g.add_argument("--think-time", type=float, metavar="S",
                   help="chat: mean seconds from an answer's end to the next turn's send, exponential "
                        "(0: none) (1)")
    g.add_argument("--prefixes", type=int, metavar="K",
                   help="the distinct shared prefixes: chat's system prompts (1), shared-prefix's "
                        "documents (4); each request draws one")
    g.add_argument("--prefix-len", type=int, metavar="N",
                   help="tokens of each shared prefix, the model's BOS included (chat 256, shared-prefix 1024)")
    g.add_argument("--message-len", type=length_spec(), metavar="N|LO:HI",
                   help="tokens of a user message (chat) or a question (shared-prefix), fixed or uniform (64)")


def check_workload_args(ap, a):
    """Flags that do not belong to --workload stop with ap.error naming them; fills the workload's
    defaults. Called before check_load_args, which fills --num-requests."""
    chat_only = (("--conversations", a.conversations), ("--turns", a.turns), ("--think-time", a.think_time))
    shaped = (("--prefixes", a.prefixes), ("--prefix-len", a.prefix_len), ("--message-len", a.message_len))
    if a.workload == "single":
        for flag, val in chat_only + shaped:
            if val is not None:
                ap.error("%s needs --workload chat%s" % (flag, "" if (flag, val) in chat_only else " or shared-prefix"))
        return
    if a.trace:
        ap.error("--trace and --workload %s conflict: a trace carries its own conversations and prefixes" % a.workload)
    if a.prompt_len != (256, 256):
        ap.error("--prompt-len and --workload %s conflict: a prompt is a shared prefix (--prefix-len) and a "
                 "message (--message-len)" % a.workload)
    if a.workload == "chat":
        for flag, val in (("--num-requests", a.num_requests), ("--duration", a.duration)):
            if val is not None:
                ap.error("%s and --workload chat conflict: a chat run sends --conversations N (its turns "
                         "follow their answers)" % flag)
        a.conversations = 16 if a.conversations is None else a.conversations
        a.turns = a.turns or (4, 4)
        a.think_time = 1.0 if a.think_time is None else a.think_time
        if a.conversations < 1:
            ap.error("--conversations must be at least 1")
        if not (a.think_time >= 0 and math.isfinite(a.think_time)):
            ap.error("--think-time must be 0 or more seconds")
    else:
        for flag, val in chat_only:
            if val is not None:
                ap.error("%s needs --workload chat" % flag)
    a.prefixes = a.prefixes if a.prefixes is not None else 1 if a.workload == "chat" else 4
    a.prefix_len = a.prefix_len if a.prefix_len is not None else 256 if a.workload == "chat" else 1024
    a.message_len = a.message_len or (64, 64)
    if a.prefixes < 1 or a.prefix_len < 1:
        ap.error("--prefixes and --prefix-len must be at least 1")


def chat_conversations(args):
    """The generated chat workload's conversations, warmup ones first: each a list of its turns,
    {conversation, turn (from 1), think_s, prefix (turn 1: its system prompt's name), prefix_len,
    message_len, output_len}. Conversation j comes from [seed, j, 5] alone, so the same flags give
    the same conversations whatever the rate or the concurrency."""
    import numpy as np
    out = []
    for j in range(args.warmup + args.conversations):
        rng = np.random.default_rng([args.seed, j, 5])
        system = "system-%d" % int(rng.integers(0, args.prefixes))
        turns = []
        for k in range(1, uniform(rng, args.turns) + 1):
            think = float(rng.exponential(args.think_time)) if k > 1 and args.think_time > 0 else 0.0
            turns.append({"conversation": "c%d" % j, "turn": k, "think_s": think,
                          "prefix": system if k == 1 else None, "prefix_len": args.prefix_len if k == 1 else 0,
                          "message_len": uniform(rng, args.message_len), "output_len": uniform(rng, args.output_len)})
        out.append(turns)
    return out


def shared_prefix_request(args, rng):
    """One request of the shared-prefix workload from its own rng: (document name, question
    length, output length)."""
    doc = "doc-%d" % int(rng.integers(0, args.prefixes))
    return doc, uniform(rng, args.message_len), uniform(rng, args.output_len)


def add_output_args(g):
    g.add_argument("--slo", type=slo_spec, metavar="KEY=MS,...",
                   help="goodput bounds: ttft_ms, tpot_ms, e2e_ms (a request is good when it is OK "
                        "and meets every one given)")
    g.add_argument("--json", metavar="OUT", help="write the summaries (every run) as JSON")
    g.add_argument("--requests-out", metavar="FILE.jsonl", help="write one JSON line per request")
    g.add_argument("--plot", metavar="DIR",
                   help="write latency CDFs (latency-cdf.png) and, for a sweep, goodput and "
                        "throughput against rate (sweep.png) into DIR")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def check_load_args(ap, a):
    """Conflicting and incomplete load flags stop with ap.error naming them; fills the defaults
    (--num-requests 100, a.policies)."""
    if a.rate and a.concurrency is not None:
        ap.error("--rate and --concurrency conflict: one is open loop, the other closed loop")
    if a.trace:
        for flag, val in (("--rate", a.rate), ("--concurrency", a.concurrency),
                          ("--num-requests", a.num_requests), ("--duration", a.duration),
                          ("--burstiness", a.burstiness)):
            if val is not None:
                ap.error("--trace and %s conflict: a trace sets its own arrivals and count" % flag)
        if a.warmup:
            ap.error("--trace and --warmup conflict: a replayed trace sends exactly its requests")
        for flag, val, default in (("--prompt-len", a.prompt_len, (256, 256)),
                                   ("--output-len", a.output_len, (64, 64))):
            if val != default:
                ap.error("--trace and %s conflict: the trace gives every request's lengths" % flag)
    elif not a.rate and a.concurrency is None:
        ap.error("say how to send: --rate R (open loop), --concurrency C (closed loop) or --trace FILE")
    if a.burstiness is not None and not a.rate:
        ap.error("--burstiness needs --rate")
    if a.burstiness is not None and not (a.burstiness > 0 and math.isfinite(a.burstiness)):
        ap.error("--burstiness must be a positive number")
    if a.num_requests is not None and a.duration is not None:
        ap.error("--num-requests and --duration conflict: give one")
    if a.num_requests is None and a.duration is None and not a.trace:
        a.num_requests = 100
    if a.num_requests is not None and a.num_requests < 1:
        ap.error("--num-requests must be at least 1")
    if a.duration is not None and not (a.duration > 0 and math.isfinite(a.duration)):
        ap.error("--duration must be a positive number of seconds")
    if a.concurrency is not None and a.concurrency < 1:
        ap.error("--concurrency must be at least 1")
    if a.warmup < 0:
        ap.error("--warmup must be 0 or more")
    if any(not p.strip() for p in a.policy):
        ap.error("--policy: an empty spec (use 'full' for the full cache)")
    a.policies = a.policy or ["full"]


def run_modes(args, trace, where):
    """One mode per run (a trace, a closed loop, or each rate of a sweep); `where` ends each
    label (the API and target, or the simulated cluster)."""
    if trace is not None:
        return [{"arrivals": "trace", "rate": None, "short": "trace",
                 "label": "trace %s (%d requests), %s" % (args.trace, len(trace), where)}]
    if args.concurrency is not None:
        return [{"arrivals": "closed", "concurrency": args.concurrency, "rate": None,
                 "short": "concurrency %d" % args.concurrency,
                 "label": "concurrency %d, %s" % (args.concurrency, where)}]
    kind = "poisson" if args.burstiness in (None, 1.0) else "gamma"
    modes = []
    for r in args.rate:
        short = "rate %g/s %s%s" % (r, kind, "" if kind == "poisson" else " (burstiness %g)" % args.burstiness)
        modes.append({"arrivals": kind, "rate": r, "burstiness": args.burstiness or 1.0,
                      "short": short, "label": "%s, %s" % (short, where)})
    return modes


def requests_total(args, trace):
    """Requests a run sends, warmup included; None when --duration decides."""
    if trace is not None:
        return len(trace)
    return args.warmup + args.num_requests if args.num_requests is not None else None


def open_loop(args, plan, rate):
    """(index, arrival s) of every request of an open-loop run or a trace, in order: --num-requests
    after the warmup, or those sent within --duration of the first measured one."""
    n_total = requests_total(args, plan.trace)
    times = (r["arrival_s"] for r in plan.trace) if plan.trace is not None else plan.arrivals(rate)
    measure_from = None
    for i, at in enumerate(times):
        if n_total is not None and i >= n_total:
            return
        if n_total is None and i >= args.warmup:
            if measure_from is None:
                measure_from = at
            elif at - measure_from >= args.duration:
                return
        yield i, at


class ClosedLoop:
    """The closed loop's request counter: next_index(now) gives the next request's index, or None
    when the run has sent all it should (--num-requests after the warmup, or --duration after the
    first measured send). Not locked: the real bench calls it under its own lock."""

    def __init__(self, args, trace):
        self.args, self.n_total = args, requests_total(args, trace)
        self.next, self.measure_from = 0, None

    def next_index(self, now):
        i, a = self.next, self.args
        if self.n_total is not None and i >= self.n_total:
            return None
        if self.n_total is None and i >= a.warmup:
            if self.measure_from is None:
                self.measure_from = now
            elif now - self.measure_from >= a.duration:
                return None
        self.next = i + 1
        return i
