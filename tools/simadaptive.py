"""simadaptive.py - kv_policy "auto" in kvrelay-sim: the router's selection rule (router/adaptive.c,
docs/adaptive.md) over the same calibration table, so that simulated clusters choose each
request's spec as the router would. The rule, step for step as the C: a point's score is the
one-sided 95% Wilson lower bound of its measured score over full's (capped at 1); the bucket is
the smallest calibrated length at or above the prompt (longer than all: full); low pressure is
full, medium aims half way from 1 to the floor, high at the floor; among the bucket's points
holding the target, the fewest decode blocks (ties: the higher bound, then the earlier point),
full when none qualifies or full reserves no more. The pressure comes from the simulated decode
pools and admission FIFO by the router's thresholds.

Not a program: tools/simcore.py calls it when a request's policy is auto. Points whose family
the simulator does not model (heads, hsft) are left out, as a router without their files leaves
them. tests/integration/simulator.py checks it against the C rule's cases.
"""
import json
import math

Z = 1.6448536269514722  # one-sided 95%, as RT_AUTO_Z
DEFAULT_FLOOR = 0.95
TASKS = ("kv", "copy", "text")
LEVELS = ("low", "medium", "high")


def is_auto(spec):
    return spec == "auto" or spec.startswith("auto:")


def parse_auto(spec, error):
    """'auto[:floor=F,task=T]' -> (floor, task or None); error(msg) raises the caller's error."""
    floor, task = DEFAULT_FLOOR, None
    for item in filter(None, spec[5:].split(",")):
        k, eq, v = item.partition("=")
        if not eq or not v:
            error("auto: '%s' is not key=value (keys: floor, task)" % item)
        if k == "floor":
            try:
                floor = float(v)
            except ValueError:
                floor = math.nan
            if not (0 < floor <= 1):
                error("auto: floor=%s: the floor is a share of full's score in (0, 1]" % v)
        elif k == "task":
            if v not in TASKS:
                error("auto: task=%s: unknown task (tasks: kv, copy, text)" % v)
            task = v
        else:
            error("auto: unknown key '%s' (keys: floor, task)" % k)
    return floor, task


def wilson_lower(p, n, z=Z):
    if n <= 0 or not (0 <= p <= 1):
        return 0.0
    z2n = z * z / n
    half = z * math.sqrt(p * (1 - p) / n + z2n / (4 * n))
    return max(0.0, (p + z2n / 2 - half) / (1 + z2n))


def pressure(free, total, queued):
    """The router's level (rt_pressure_level) from free and total decode blocks and the FIFO."""
    if queued > 0:
        return "high"
    if total == 0:
        return "low"
    if free * 4 < total:
        return "high"
    if free * 2 < total:
        return "medium"
    return "low"


class Table:
    """A calibration table (docs/adaptive.md, format 1) with each point's bounds and footprint.
    footprint(spec) -> the simulator's Footprint, or None for a family it does not model."""

    def __init__(self, path, footprint, error):
        try:
            with open(path) as f:
                t = json.load(f)
            if t.get("kind") != "kvrelay-calibration" or t.get("format") != 1:
                error("--calibration %s: not a format 1 kvrelay-calibration table" % path)
            self.tasks, self.lengths, self.block_size = list(t["tasks"]), list(t["lengths"]), int(t["block_size"])
            self.points = []
            for p in t["points"]:
                fp = footprint(p["spec"]) if p["spec"] != "full" else None
                if p["spec"] == "full" or fp is None:
                    continue
                lower = {k: min(1.0, wilson_lower(s["policy"], s["cases"]) / s["full"])
                         for k, s in p["scores"].items() if s["full"] > 0}
                self.points.append((p["length"], p["spec"], fp, lower))
        except (OSError, ValueError, KeyError, TypeError) as e:
            error("--calibration %s: %s" % (path, e))

    def choose(self, ask, n, out, level, blocks, full_fp):
        """(spec, score, reason) for a prompt of n tokens and out to generate at `level`;
        blocks(fp, n, out, block_size) counts a spec's decode blocks as the router does."""
        floor, task = ask
        full_b = blocks(full_fp, n, out, self.block_size)
        if floor >= 1:
            return "full", 1.0, "floor=1: full"
        if level == "low":
            return "full", 1.0, "low pressure: full"
        length = next((x for x in self.lengths if x >= n), None)
        if length is None:
            return "full", 1.0, "%s pressure: a prompt of %d tokens is longer than every calibrated length: full" % (level, n)
        target = floor + (1 - floor) / 2 if level == "medium" else floor
        need = [task] if task else self.tasks
        best = None
        for length_p, spec, fp, lower in self.points:
            if length_p != length or any(k not in lower for k in need):
                continue
            g = min(lower[k] for k in need)
            if not g >= target:
                continue
            b = blocks(fp, n, out, self.block_size)
            if best is None or b < best[0] or (b == best[0] and g > best[1]):
                best = (b, g, spec, fp)
        if best is None:
            return "full", 1.0, "%s pressure: no point at length %d holds %.3f: full" % (level, length, target)
        if best[0] >= full_b:
            return "full", 1.0, "%s pressure: no point holding %.3f reserves fewer blocks than full" % (level, target)
        return best[2], best[1], "%s pressure: fewest blocks (%d of full's %d)" % (level, best[0], full_b)
