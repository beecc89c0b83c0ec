"""simprefix.py - kvrelay-sim's model of prefix reuse: the prompts of the chat and shared-prefix
workloads as segments (a shared prefix, a conversation's messages and answers), their chain of
chunk-block keys, each prefill node's prefix cache of chunk-boundary states under a memory budget
(LRU, at most two states kept per prefill: the prompt's last boundary and its branch point), and
the router's index of what it prefilled where, which kv-aware placement reads.

Not a program: tools/simcore.py calls it (docs/simulator.md, "Prefix reuse"); the rules copied
here are docs/prefix-cache.md's. Not a model of token contents: a block's key names the segments
and offsets it covers (or, for token ids a trace gives, the ids), and a 64-bit hash chain stands
for the nodes' chain over token ids, trusted where the nodes compare tokens (a collision, 2^-64
rare, would count a hit that the real node refuses).
"""
import collections

BLOCK_ENTRIES = 16  # entries per block of the prefix cache's pool (prefill-node/prefix-cache.c)


def reuses(family, kv):
    """kr_policy_prefix_deterministic for the families the simulator models: full, streaming and
    sage (its state below the last chunk is uncompressed) always; snapkv and pyramidkv only with
    mode=naive (the default, patched, appends the prompt's last tokens to every chunk); take never
    (its probe is the prompt's end)."""
    if family in ("full", "streaming", "sage"):
        return True
    if family in ("snapkv", "pyramidkv"):
        return kv.get("mode", "patched") == "naive"
    return False


def state_entries(fp, b):
    """Entries per list of the state after the prompt's first b tokens: what the policy keeps at
    that boundary (sage evicts only in the last chunk, so its inner states are the prefix's KV)."""
    return b if fp.family == "sage" else fp.kept(b)


def chain(segs, n, chunk, spec):
    """The keys of the prompt's chunk-aligned blocks that end below its last token
    ((n - 1) // chunk of them): key i names the prompt's first (i + 1) * chunk tokens under the
    policy spec, as the nodes' h_i = hash(h_{i-1}, block i) with h_0 from the key. segs: the
    prompt's [(segment, tokens)], where a segment is a name (its tokens are the same wherever
    the name appears) or ("ids", tuple of ids) (a trace's tokens, compared as ids)."""
    m = (n - 1) // chunk
    keys, h = [], hash(("kvrelay-prefix", spec))
    it = iter(segs)
    seg, length, off = None, 0, 0
    for _ in range(m):
        pieces, need, ids_last = [], chunk, False
        while need:
            if off == length:
                seg, length = next(it)
                off = 0
            take = min(need, length - off)
            ids = isinstance(seg, tuple) and seg[:1] == ("ids",)
            if ids and ids_last:  # ids are ids however the trace split them into prefix and prompt
                pieces[-1] += seg[1][off:off + take]
            else:
                pieces.append(seg[1][off:off + take] if ids else (seg, off, off + take))
            ids_last = ids
            off += take
            need -= take
        h = hash((h, tuple(pieces)))
        keys.append(h)
    return keys


class State:
    __slots__ = ("chain", "entries", "blocks", "users")


class PrefixCache:
    """One prefill node's cache (docs/prefix-cache.md): states at chunk boundaries, each holding
    lists x ceil(entries / 16) blocks of a pool of budget / block bytes blocks; the least recently
    used state not in use is evicted for room; a state that does not fit even then is not kept.
    refs counts, per block key, the states whose chain holds it: the branch point is the
    deepest block of a prompt that any state's prompt shares."""

    def __init__(self, budget_bytes, block_bytes, lists):
        self.total = budget_bytes // block_bytes
        self.block_bytes, self.lists = block_bytes, lists
        self.states = collections.OrderedDict()  # last key -> State, least recently used first
        self.refs = {}
        self.used = 0
        self.stats = dict.fromkeys(("lookups", "hits", "tokens_reused", "inserts", "evictions", "skipped",
                                    "bypass"), 0)

    def lookup(self, keys):
        """(blocks of the longest cached prefix, the state holding it or None, the branch point
        in blocks); the hit becomes the most recently used."""
        hit, branch = 0, 0
        for i in range(len(keys), 0, -1):
            if keys[i - 1] in self.refs:
                branch = i
                break
        for i in range(branch, 0, -1):
            if keys[i - 1] in self.states:
                hit = i
                break
        st = self.states.get(keys[hit - 1]) if hit else None
        if st is not None:
            self.states.move_to_end(keys[hit - 1])
        return hit, st, branch

    def insert(self, keys, entries):
        """Keeps the state whose chain is keys (entries per list), or touches it if held."""
        last = keys[-1]
        if last in self.states:
            self.states.move_to_end(last)
            return
        need = self.lists * -(-entries // BLOCK_ENTRIES)
        free = self.total - self.used
        if need > free + sum(s.blocks for s in self.states.values() if not s.users):
            self.stats["skipped"] += 1
            return
        for k in [k for k, s in self.states.items() if not s.users]:
            if self.total - self.used >= need:
                break
            self._drop(k)
            self.stats["evictions"] += 1
        st = State()
        st.chain, st.entries, st.blocks, st.users = list(keys), entries, need, 0
        self.states[last] = st
        self.used += need
        for k in keys:
            self.refs[k] = self.refs.get(k, 0) + 1
        self.stats["inserts"] += 1

    def _drop(self, last):
        st = self.states.pop(last)
        self.used -= st.blocks
        for k in st.chain:
            c = self.refs[k] - 1
            if c:
                self.refs[k] = c
            else:
                del self.refs[k]

    def held(self):
        return {"states": len(self.states), "bytes": self.used * self.block_bytes,
                "budget_bytes": self.total * self.block_bytes}


class KvIndex:
    """The router's record of the prompt blocks it prefilled on one node (router/kv-index.c):
    at most `capacity` keys, the least recently used forgotten first; a prompt's blocks are
    touched deepest first, so what it keeps of a prompt is a whole prefix."""

    def __init__(self, capacity):
        self.capacity, self.keys = capacity, collections.OrderedDict()

    def record(self, keys):
        for k in reversed(keys):
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def predicted(self, keys):
        """Leading blocks of the prompt the node is predicted to hold."""
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


# ---------------------------------------------------------------- the workloads' prompts

def own_segment(line, name):
    """A trace line's or a generated request's own tokens: its ids when the trace gives them,
    else a segment of its own named `name`."""
    if line.get("prompt_ids") is not None:
        return ("ids", tuple(line["prompt_ids"])), len(line["prompt_ids"])
    return name, line["prompt_len"]


def prefix_segment(line):
    """The shared prefix a line names, as a segment ([] without one)."""
    if line.get("prefix") is None:
        return []
    if line.get("prefix_ids") is not None:
        return [(("ids", tuple(line["prefix_ids"])), line["prefix_len"])]
    return [(("prefix", line["prefix"]), line["prefix_len"])]


def turn_segments(line, index, prev):
    """A conversation turn's segments: the first turn its prefix and message; a later one the
    previous turn's prompt, that turn's answer (completion_tokens of its own, which no earlier
    prompt holds) and the new message. prev: (segments, answer tokens, its index) or None."""
    if prev is None:
        return prefix_segment(line) + [own_segment(line, ("msg", index))]
    segs, answer, prev_index = prev
    return segs + ([(("answer", prev_index), answer)] if answer else []) + [own_segment(line, ("msg", index))]
