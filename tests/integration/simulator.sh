#!/usr/bin/env bash
# simulator.sh - tools/kvrelay-sim (docs/simulator.md), without a cluster, in about 10 s:
# the small validation case (the committed real 1 prefill + 1 decode runs of
# bench/experiments/sim-validate.sh, simulated again with the profile calibrated beside them:
# TTFT and TPOT p50 / p90 and goodput within 15%); kvrelay-bench-serve's summary format (the same
# keys; its plots draw the simulator's runs); one seed, one result; FIFO admission in event order
# (a pool for one request at a time serves them in arrival order, each after the previous ended);
# a faster link gives an earlier first token; bad input exits 2 naming the flag, key or line.
# Skips (77) without python3-numpy or python3-matplotlib. Env (set by ctest): KR_SRC.
set -euo pipefail
PY=/usr/bin/python3
if ! "$PY" -c 'import numpy, matplotlib' 2>/dev/null; then
  echo "SKIP: python3-numpy or python3-matplotlib missing (the README's test command installs them)"
  exit 77
fi
work=$(mktemp -d -t kvrelay-sim-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$PY" "$KR_SRC/tests/integration/simulator.py" "$KR_SRC" "$work"
echo "PASS"
