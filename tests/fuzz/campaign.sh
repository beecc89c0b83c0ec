#!/usr/bin/env bash
# campaign.sh - a fuzzing campaign: builds the libFuzzer targets (clang, ASan+UBSan), runs each
# for a number of executions or a time, merges into tests/fuzz/corpus/<name>/ the inputs it
# found that add coverage, and prints one line per target (executions, seconds, corpus size,
# crashes). Not part of the test suite, which replays the committed corpus (docs/fuzzing.md).
#
#   tests/fuzz/campaign.sh [--build DIR] [--runs N | --time S] [--jobs J] [--nice] [TARGET...]
#
# TARGET is a fuzz target's name without "fuzz_" (bundle, chat, config, openai, safetensors,
# tokenizer, ...); none means every tests/fuzz/fuzz_*.c. Defaults: --build build-fuzz (made if
# missing: CC=clang cmake -DKR_FUZZ=ON -DKR_SANITIZE=ON -DKR_NATIVE=OFF -DKR_CUDA=OFF),
# --runs 10000000 per target, --jobs 1 (targets run one after another; J runs J at once),
# --nice runs the fuzzers at the lowest CPU priority so they use only idle cores. An input that
# runs over 60 s of wall time counts as a hang (timeout-*): on a loaded machine a starved niced
# fuzzer can reach that; run the input alone to tell a real hang from that.
# A crash leaves its input as DIR/campaign/<name>/crash-* (libFuzzer's name for it), the
# fuzzer's log beside it, and makes the script exit 1 after every target has run; reproduce with
# `DIR/fuzz_<name> DIR/campaign/<name>/crash-...`. Exit 2 for bad flags or a failed build.
set -euo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$src/build-fuzz runs=10000000 secs= jobs=1 nice_cmd=() targets=()
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --runs) runs=$2; secs=; shift 2 ;;
    --time) secs=$2; runs=; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --nice) nice_cmd=(nice -n 19); shift ;;
    -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "campaign.sh: unknown flag '$1' (--help lists them)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
for n in ${runs:+"$runs"} ${secs:+"$secs"} "$jobs"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "campaign.sh: '$n' is not a positive integer" >&2; exit 2; }
done
if [ ${#targets[@]} -eq 0 ]; then
  for f in "$src"/tests/fuzz/fuzz_*.c; do
    n=${f##*/fuzz_}
    targets+=("${n%.c}")
  done
fi
for t in "${targets[@]}"; do
  [ -f "$src/tests/fuzz/fuzz_$t.c" ] || { echo "campaign.sh: no fuzz target '$t' (tests/fuzz/fuzz_$t.c)" >&2; exit 2; }
done
command -v clang > /dev/null || { echo "campaign.sh: clang is needed (apt-get install clang)" >&2; exit 2; }

if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKR_FUZZ=ON -DKR_SANITIZE=ON \
    -DKR_NATIVE=OFF -DKR_CUDA=OFF > "$build.configure.log" 2>&1 ||
    { echo "campaign.sh: cmake failed: $build.configure.log" >&2; exit 2; }
fi
cmake --build "$build" -j "$(nproc)" --target "${targets[@]/#/fuzz_}" > "$build/campaign-build.log" 2>&1 ||
  { echo "campaign.sh: build failed: $build/campaign-build.log" >&2; exit 2; }

# one target: fuzz into a scratch corpus seeded with the committed one, then merge into the
# committed corpus only the found inputs that add coverage (its seeds stay as they are)
campaign() {
  local t=$1 work=$build/campaign/$1 corpus=$src/tests/fuzz/corpus/$1
  rm -rf "$work" && mkdir -p "$work/found" "$corpus"
  local limit=(-runs="$runs")
  [ -n "$secs" ] && limit=(-max_total_time="$secs")
  local t0=$SECONDS rc=0
  # UCX_HANDLE_ERRORS=none: the targets link UCX, whose signal handler would otherwise catch a
  # crash before libFuzzer writes the input that caused it
  (cd "$work" && UCX_HANDLE_ERRORS=none "${nice_cmd[@]}" "$build/fuzz_$t" "${limit[@]}" -print_final_stats=1 -timeout=60 \
    -rss_limit_mb=4096 "$work/found" "$corpus" > "$work/fuzz.log" 2>&1) || rc=$?
  local execs
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/fuzz.log" | tail -1)
  "${nice_cmd[@]}" "$build/fuzz_$t" -merge=1 "$corpus" "$work/found" > "$work/merge.log" 2>&1 ||
    { echo "campaign.sh: $t: merge failed: $work/merge.log" >&2; return 1; }
  local crashes
  crashes=$(find "$work" -maxdepth 1 \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  printf '%-12s executions %12s  seconds %6d  corpus %4d files %6d KB  crashes %d%s\n' "$t" "${execs:-?}" \
    $((SECONDS - t0)) "$(ls "$corpus" | wc -l)" "$(du -sk "$corpus" | cut -f1)" "$crashes" \
    "$([ "$rc" = 0 ] || echo "  (fuzzer exit $rc: $work/fuzz.log)")"
  [ "$crashes" = 0 ] && [ "$rc" = 0 ]
}

failed=0 running=0
for t in "${targets[@]}"; do
  campaign "$t" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || failed=1
    running=$((running - 1))
  fi
done
while [ "$running" -gt 0 ]; do
  wait -n || failed=1
  running=$((running - 1))
done
exit $failed
