#!/usr/bin/env bash
# soak.sh - the soak under faults (tests/soak/soak.sh) for about a minute on the build under test
# (CI's is the ASan+UBSan build): 2 prefill + 2 decode nodes and two routers under closed-loop
# load while nodes are killed and restarted, stopped and continued, etcd restarted and clients
# drop streams; it fails on a wrong output, an unclear error, a KV block left used or reserved,
# or a sanitizer report. Outcomes only: no timing is asserted. KR_SOAK_S sets the duration
# (default 60), KR_SOAK_SEED the seed (default 1).
# Run: ctest -R soak, or KR_BIN=build KR_SRC=. bash tests/integration/soak.sh
set -uo pipefail
exec bash "${KR_SRC:?KR_SRC must be the source directory}/tests/soak/soak.sh" \
  --bin "${KR_BIN:?KR_BIN must be the build directory}" --duration "${KR_SOAK_S:-60}" --seed "${KR_SOAK_SEED:-1}"
