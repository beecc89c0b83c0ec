"""kvtasks.py - the synthetic tasks kvrelay's model is trained on and evaluated with.

Shared by the trainer (tools/train/train.py) and the evaluator (kvrelay-eval), so both build
sequences the same way. What it is not: a tokenizer (the token stream comes from kvrelay's own
tokenizer) or a scorer.

The tasks use dedicated tokens, added to the byte-level BPE vocabulary as non-special added
tokens (so they are plain text too: "<q><k07>"):
  <rec> <kNN> <vNNN>   a record: key NN (32 keys) holds value NNN (128 values)
  <q> <kNN>            a query: the next token is the value recorded for that key
  <cp> s1 .. sN        a span of distinct value tokens; a second "<cp>" later is followed by
                       the same span again (the copy task)
Records, queries and spans sit inside natural text (the filler), at any depth.

Run the self-check:  python3 tools/train/kvtasks.py MODEL_DIR
"""
import json
import os
import sys

import numpy as np

N_KEYS = 32
N_VALUES = 128
MARKERS = ("<rec>", "<q>", "<cp>")
COPY_SPAN = 16
COPY_ANSWER = 4  # evaluation scores a copy case on the span's first tokens (docs/eval.md)


def task_token_strings():
    """The task tokens in id order, as the trainer appends them to the vocabulary."""
    return (list(MARKERS) + ["<k%02d>" % i for i in range(N_KEYS)]
            + ["<v%03d>" % i for i in range(N_VALUES)])


class TaskVocab:
    """Ids of the task tokens and of BOS, read from a model directory's tokenizer.json."""

    def __init__(self, model_dir):
        path = os.path.join(model_dir, "tokenizer.json")
        with open(path, encoding="utf-8") as f:
            tok = json.load(f)
        added = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
        missing = [s for s in task_token_strings() if s not in added]
        if missing:
            raise ValueError("%s: not a kvrelay task model (no added token %s)" % (path, missing[0]))
        self.rec, self.q, self.cp = (added[m] for m in MARKERS)
        self.keys = np.array([added["<k%02d>" % i] for i in range(N_KEYS)], dtype=np.int64)
        self.values = np.array([added["<v%03d>" % i] for i in range(N_VALUES)], dtype=np.int64)
        self.bos = added.get("<|begin_of_text|>")
        if self.bos is None:
            raise ValueError("%s: no <|begin_of_text|> token" % path)
        self.task_ids = set(int(x) for x in [self.rec, self.q, self.cp, *self.keys, *self.values])


def filler_window(rng, stream, n):
    """n consecutive tokens of the filler stream (a 1-D int array), from a random offset."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if len(stream) <= n:
        raise ValueError("filler text has %d tokens; %d are needed" % (len(stream), n))
    at = int(rng.integers(0, len(stream) - n))
    return np.asarray(stream[at:at + n], dtype=np.int64)


# ------------------------------------------------------------------ evaluation cases

def kv_case(rng, tv, stream, length, depth, n_distract=3):
    """A key-value retrieval case of exactly `length` prompt tokens (BOS included).

    The needle record starts at `depth` (0 = right after BOS, 1 = just before the query);
    `n_distract` other records with other keys sit at random depths. The prompt ends with the
    query "<q> <key>"; the answer is the one value token. Returns (prompt ids, answer ids).
    """
    n_rec = 1 + n_distract
    n_fill = length - 1 - 3 * n_rec - 2
    if n_fill < 0:
        raise ValueError("kv: length %d is too short for %d records" % (length, n_rec))
    keys = rng.choice(tv.keys, size=n_rec, replace=False)
    vals = rng.choice(tv.values, size=n_rec, replace=True)
    fill = filler_window(rng, stream, n_fill)
    cut_needle = int(round(min(max(depth, 0.0), 1.0) * n_fill))
    cuts = [cut_needle] + [int(c) for c in rng.integers(0, n_fill + 1, size=n_distract)]
    order = sorted(range(n_rec), key=lambda i: (cuts[i], i))
    out, prev = [tv.bos], 0
    for i in order:
        out.extend(fill[prev:cuts[i]])
        out.extend([tv.rec, keys[i], vals[i]])
        prev = cuts[i]
    out.extend(fill[prev:])
    out.extend([tv.q, keys[0]])
    assert len(out) == length
    return [int(x) for x in out], [int(vals[0])]


def copy_case(rng, tv, stream, length, depth, span=COPY_SPAN, answer=None):
    """A copy case of exactly `length` prompt tokens: "<cp> s1..sN" at `depth`, text, then "<cp>".

    The answer is the span again (N distinct value tokens): all of it, or its first `answer`
    tokens. Returns (prompt, answer).
    """
    n_fill = length - 1 - (1 + span) - 1
    if n_fill < 0:
        raise ValueError("copy: length %d is too short for a %d-token span" % (length, span))
    s = rng.choice(tv.values, size=span, replace=False)
    fill = filler_window(rng, stream, n_fill)
    cut = int(round(min(max(depth, 0.0), 1.0) * n_fill))
    out = [tv.bos] + list(fill[:cut]) + [tv.cp] + list(s) + list(fill[cut:]) + [tv.cp]
    assert len(out) == length
    return [int(x) for x in out], [int(x) for x in s[:answer]]


# ------------------------------------------------------------------ training sequences

class TrainSeq:
    """One training sequence: ids [T+1]; the loss weight of predicting ids[t+1] at t [T];
    attention targets (query position, [key positions holding the answer]) for the retrieval
    head; answer positions (where t predicts a retrieved token)."""

    def __init__(self, ids, weight, attn, answers):
        self.ids, self.weight, self.attn, self.answers = ids, weight, attn, answers


def text_seq(rng, tv, stream, length):
    ids = np.concatenate([[tv.bos], filler_window(rng, stream, length)])
    return TrainSeq(ids, np.ones(length, dtype=np.float32), [], [])


def kv_seq(rng, tv, stream, length, answer_weight):
    """Records and queries at random depths among text; every query's answer is supervised."""
    n_rec = int(rng.integers(1, max(2, min(N_KEYS, length // 24)) + 1))
    n_q = int(rng.integers(n_rec, 2 * n_rec + 1))
    n_fill = length - 3 * (n_rec + n_q)
    if n_fill < 1:
        return text_seq(rng, tv, stream, length)
    keys = rng.choice(tv.keys, size=n_rec, replace=False)
    vals = rng.choice(tv.values, size=n_rec, replace=True)
    kinds = ["r"] + list(rng.permutation(["r"] * (n_rec - 1) + ["q"] * n_q))
    cuts = np.sort(rng.integers(0, n_fill + 1, size=len(kinds)))
    fill = filler_window(rng, stream, n_fill)
    ids, weight, attn, answers = [tv.bos], [], [], []
    seen, where, prev = [], {}, 0  # records placed; key -> positions holding its value
    for kind, cut in zip(kinds, cuts):
        ids.extend(fill[prev:cut])
        prev = cut
        if kind == "r":
            i = len(seen)
            ids.extend([tv.rec, keys[i], vals[i]])
            where[i] = [len(ids) - 1]
            seen.append(i)
        else:
            i = seen[int(rng.integers(0, len(seen)))]
            ids.extend([tv.q, keys[i], vals[i]])
            answers.append(len(ids) - 2)  # position of the key: it predicts the value
            attn.append((len(ids) - 2, list(where[i])))  # the record's value or an earlier answer
            where[i].append(len(ids) - 1)
    ids.extend(fill[prev:])
    ids = np.asarray(ids, dtype=np.int64)
    weight = np.ones(len(ids) - 1, dtype=np.float32)
    # Unpredictable next tokens carry no loss: the key after <rec>/<q>, a record's value.
    for t in range(len(ids) - 1):
        if ids[t] in (tv.rec, tv.q) or (t >= 1 and ids[t - 1] == tv.rec):
            weight[t] = 0.0
    weight[answers] = answer_weight
    return TrainSeq(ids, weight, attn, answers)


def copy_seq(rng, tv, stream, length, answer_weight):
    """A span early, text, the marker again and the span repeated: the repeat is supervised."""
    span = int(rng.integers(4, COPY_SPAN + 1))
    n_fill = length - 2 * (1 + span)
    if n_fill < 1:
        return text_seq(rng, tv, stream, length)
    s = rng.choice(tv.values, size=span, replace=False)
    fill = filler_window(rng, stream, n_fill)
    a = int(rng.integers(0, n_fill))
    b = int(rng.integers(a, n_fill + 1))
    ids = ([tv.bos] + list(fill[:a]) + [tv.cp] + list(s) + list(fill[a:b]) + [tv.cp] + list(s)
           + list(fill[b:]))
    ids = np.asarray(ids, dtype=np.int64)
    first = 1 + a + 1  # position of s1 in the first occurrence
    second = first + span + (b - a)  # position of the second <cp>
    weight = np.ones(len(ids) - 1, dtype=np.float32)
    weight[first - 1:first + span - 1] = 0.0  # the first span is random
    answers = list(range(second, second + span))  # <cp>, s1..s(N-1) predict s1..sN
    weight[answers] = answer_weight
    attn = [(second + j, [first + j]) for j in range(span)]
    return TrainSeq(ids, weight, attn, answers)


def _self_check(model_dir):
    tv = TaskVocab(model_dir)
    rng = np.random.default_rng(1)
    stream = rng.integers(0, 256, size=5000)
    for length in (64, 300, 1024):
        for depth in (0.0, 0.5, 1.0):
            p, a = kv_case(rng, tv, stream, length, depth)
            assert len(p) == length and a[0] in tv.values
            p, a = copy_case(rng, tv, stream, length, depth)
            assert len(p) == length and len(a) == COPY_SPAN
        for make in (kv_seq, copy_seq):
            s = make(rng, tv, stream, length, 4.0)
            assert len(s.ids) == length + 1 and len(s.weight) == length
            for q, ks in s.attn:
                assert all(k < q and s.ids[k] == s.ids[q + 1] for k in ks)
    print("kvtasks: self-check passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: kvtasks.py MODEL_DIR")
    _self_check(sys.argv[1])
