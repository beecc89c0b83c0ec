"""simulator_prefix.py - checks of kvrelay-sim's prefix reuse (docs/simulator.md, "Prefix reuse"),
run by simulator.sh: the hit rate and cached tokens of a small chat workload equal what the
cache's rules give by hand; a budget holds as many states as their blocks say, a compressed
policy's several times full's; kv-aware placement keeps a conversation on one prefill node and
reuses more than round-robin; the cache off reuses nothing and prefills slower; a policy that is
not prefix-deterministic never reuses; conversation traces play turn after answer; a trace's
repeated token ids are reused. About 5 s.

  simulator_prefix.py SRC WORKDIR
"""
import json
import os
import subprocess
import sys

SRC, WORK = sys.argv[1], sys.argv[2]
TOOL = os.path.join(SRC, "tools", "kvrelay-sim")
H100 = os.path.join(SRC, "tools", "sim-profiles", "h100-llama8b-400g.json")
failures = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg, flush=True)
    if not cond:
        failures.append(msg)


def run(tag, *flags):
    """(summary JSON's first run, its rows, the document) of kvrelay-sim run with these flags."""
    out, rows = os.path.join(WORK, tag + ".json"), os.path.join(WORK, tag + ".jsonl")
    r = subprocess.run([sys.executable, TOOL, "run", "--json", out, "--requests-out", rows, "--no-progress"]
                       + list(flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    if r.returncode != 0:
        check(False, "%s: exit %d: %s" % (tag, r.returncode, r.stderr.strip()[-300:]))
        return None, [], None
    doc = json.load(open(out))
    return doc["runs"][0], [json.loads(x) for x in open(rows)], doc


# 1. the hand model: one prefill node, a budget that evicts nothing, a closed loop at concurrency
#    1 (every prefill after the last): chunk C = 64, a system prompt of P = 200 tokens, messages
#    of 64, answers of 32, 3 turns. A turn-1 prompt (n1 = 264) keeps its last boundary (256,
#    which holds part of its message); the second conversation's turn 1 shares only the system
#    prompt's whole chunks (192), finds no state there and keeps one (the branch point); from the
#    third conversation on, turn 1 continues from it. Turn k > 1 continues from turn k-1's last
#    boundary: (n_{k-1} - 1) // C * C (the previous answer is never cached).
C, P, MSG, OUT, TURNS, CONVS = 64, 200, 64, 32, 3, 5
chat = ["--workload", "chat", "--conversations", str(CONVS), "--turns", str(TURNS), "--think-time", "0",
        "--prefix-len", str(P), "--message-len", str(MSG), "--output-len", str(OUT), "--chunk", str(C)]


def by_hand(conv, turn):
    """Cached tokens of conversation conv's turn (both from 0) by the cache's rules."""
    if turn == 0:
        return 0 if conv < 2 else P // C * C
    n_prev = P + MSG + (turn - 1) * (OUT + MSG)
    return (n_prev - 1) // C * C


run1, rows, _ = run("hand", *chat, "--concurrency", "1", "--prefix-cache-memory", "1G")
want = {(j, k): by_hand(j, k) for j in range(CONVS) for k in range(TURNS)}
got = {(int(r["conversation"][1:]), r["turn"] - 1): r["cached_tokens"] for r in rows}
check(got == want, "chat by hand: every turn's cached tokens as the rules give them (%s)"
      % ("equal" if got == want else "got %s, want %s" % (sorted(got.items()), sorted(want.items()))))
hits = sum(1 for v in want.values() if v > 0)
s = run1 and run1["summary"]
check(s and abs(s["cache_hit_rate"] - hits / len(want)) < 1e-9 and s["cached_tokens"] == sum(want.values()),
      "chat by hand: hit rate %s = %d/%d, cached tokens %s = %d"
      % (s and s["cache_hit_rate"], hits, len(want), s and s["cached_tokens"], sum(want.values())))
pc = run1 and run1["prefix_cache"]
check(pc and pc["hits"] == hits and pc["lookups"] == len(want) and pc["tokens_reused"] == sum(want.values())
      and pc["evictions"] == 0, "chat by hand: the node's counters agree (%s)" % pc)
# states: each prompt's last boundary, plus the one branch point; a repeated boundary is kept once
states = len({(j, k) for j in range(CONVS) for k in range(TURNS)}) + 1
check(pc and pc["states"] == states, "chat by hand: %s states held, %d by hand" % (pc and pc["states"], states))
check(all(r["prompt_tokens"] == P + MSG + (r["turn"] - 1) * (OUT + MSG) for r in rows),
      "chat: a turn's prompt is the previous prompt, its answer and a new message")

# 2. the budget: distinct 1024-token prompts (chunk 256: each keeps its state at 768 tokens)
#    under a budget of 10 full states; a state takes lists x ceil(entries / 16) blocks of
#    16 x (2 x head_dim x 2 + 4) bytes (bf16 cache). Under streaming (128 entries kept) the same
#    budget holds 6x as many.
prof = json.load(open(H100))
lists, hd = prof["model"]["layers"] * prof["model"]["kv_heads"], prof["model"]["head_dim"]
block = 16 * (2 * hd * 2 + 4)
budget = 10 * lists * (768 // 16) * block
held = {}
for policy, entries in (("full", 768), ("streaming:sink=4,window=124", 128)):
    r, _, _ = run("budget-" + policy[:4], "--profile", H100, "--kv-memory", "8G", "--rate", "2", "--num-requests", "120",
                  "--prompt-len", "1024", "--output-len", "2", "--chunk", "256", "--policy", policy,
                  "--prefix-cache-memory", str(budget))
    pc = r and r["prefix_cache"]
    want = budget // block // (lists * -(-entries // 16))
    held[policy] = pc and pc["states"]
    check(pc and pc["states"] == min(want, 120) and pc["evictions"] == pc["inserts"] - pc["states"]
          and pc["hits"] == 0, "budget %s: %s states held (%d by hand), evictions = inserts - held"
          % (policy, pc and pc["states"], want))
check(held["full"] and held["streaming:sink=4,window=124"] >= 6 * held["full"],
      "budget: streaming holds %sx full's states in the same bytes" %
      (held["full"] and held["streaming:sink=4,window=124"] / held["full"]))

# 3. placement with 2 prefill nodes: kv-aware keeps every turn of a conversation on the node of
#    its turn 1 (the load is light) and reuses more than round-robin; the cache off reuses
#    nothing and its first tokens come later
two = chat[:1] + ["chat", "--conversations", "12", "--turns", "4", "--think-time", "0.5"] + chat[8:] + \
    ["--rate", "2", "--prefill", "2", "--decode", "2"]
res = {}
for placement in ("kv-aware", "round-robin"):
    r, rows, _ = run("place-" + placement, *two, "--placement", placement)
    res[placement] = (r, rows)
    nodes = {}
    for x in rows:
        nodes.setdefault(x["conversation"], set()).add(x["served_by"]["prefill"])
    res[placement] += (bool(rows) and all(len(v) == 1 for v in nodes.values()),)
check(res["kv-aware"][2], "kv-aware: every conversation's turns on one prefill node")
check(not res["round-robin"][2], "round-robin: conversations spread over both nodes")
ca, cr = (res[p][0]["summary"]["cached_tokens"] for p in ("kv-aware", "round-robin"))
check(ca > cr, "kv-aware reuses more prompt tokens than round-robin (%d > %d)" % (ca, cr))
off, _, _ = run("off", *two, "--prefix-cache-memory", "0")
check(off and off["summary"]["cached_tokens"] == 0 and "prefix_cache" not in off,
      "cache off: nothing reused, no cache figures")
check(off and off["summary"]["ttft_ms"]["p50"] > res["kv-aware"][0]["summary"]["ttft_ms"]["p50"],
      "cache off: TTFT p50 %.2f ms above the cache's %.2f ms" %
      (off["summary"]["ttft_ms"]["p50"], res["kv-aware"][0]["summary"]["ttft_ms"]["p50"]))

# 4. a policy that is not prefix-deterministic (snapkv's default, patched) goes around the cache
r, rows, _ = run("patched", *chat, "--concurrency", "1", "--policy", "snapkv:budget=64")
check(r and r["summary"]["cached_tokens"] == 0 and r["prefix_cache"]["bypass"] == len(rows),
      "patched snapkv: never reuses, every prefill a bypass")
r, rows, _ = run("naive", *chat, "--concurrency", "1", "--policy", "snapkv:budget=64,mode=naive")
check(r and r["summary"]["cached_tokens"] > 0, "naive snapkv: reuses")

# 5. a conversation trace: turns follow their answers after think_s; token ids repeated across
#    lines are reused
trace = os.path.join(WORK, "conv.jsonl")
with open(trace, "w") as f:
    for line in ({"arrival_s": 0, "conversation": "a", "turn": 1, "prefix": "sys", "prefix_tokens": 300,
                  "prompt_tokens": 40, "output_tokens": 20},
                 {"arrival_s": 0.1, "conversation": "b", "turn": 1, "prefix": "sys", "prompt_tokens": 50,
                  "output_tokens": 20},
                 {"conversation": "a", "turn": 2, "think_s": 0.5, "prompt_tokens": 30, "output_tokens": 10},
                 {"arrival_s": 5, "prompt_tokens": list(range(1, 200)), "output_tokens": 4},
                 {"arrival_s": 6, "prefix": "ids", "prefix_tokens": list(range(1, 100)),
                  "prompt_tokens": list(range(100, 200)) + [7] * 60, "output_tokens": 4}):
        f.write(json.dumps(line) + "\n")
r, rows, doc = run("trace", "--trace", trace, "--chunk", "64")
if rows:
    a1, b1, a2, x, y = rows
    check(a2["prompt_tokens"] == a1["prompt_tokens"] + 20 + 30, "trace: turn 2 = turn 1's prompt + answer + message")
    check(a2["sent_s"] >= a1["end_s"] + 0.5 - 1e-9, "trace: turn 2 sent think_s after turn 1's answer ended")
    check(a2["cached_tokens"] == (a1["prompt_tokens"] - 1) // 64 * 64, "trace: turn 2 continues from turn 1's state")
    check(y["cached_tokens"] == 192, "trace: ids an earlier line sent reused, wherever the prefix ends (%s of 192)"
          % y["cached_tokens"])
    check(doc["workload"] == "trace", "trace: the summary says so")
if failures:
    print("%d check(s) failed" % len(failures))
    sys.exit(1)
