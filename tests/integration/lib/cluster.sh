# cluster.sh - sourced by integration tests that run a cluster with deploy/local-cluster.sh:
# kr_cluster_workdir NAME makes KRC_DIR, and at exit releases a held pool (kr_hold_pool), stops
# the cluster and removes KRC_DIR; fail MESSAGE prints it with the end of the router's log and
# exits 1. Needs KR_SRC (set by ctest).
. "$KR_SRC/deploy/local-cluster.sh"
# kr_need_bins PROGRAM...: skips the test (exit 77) unless every program is built in KR_BIN
kr_need_bins() {
  local p
  for p in "$@"; do [ -x "${KR_BIN:?KR_BIN must be the build directory}/$p" ] || { echo "SKIP: $KR_BIN/$p is not built"; exit 77; }; done
}
kr_cluster_workdir() {
  KRC_DIR=$(mktemp -d -t "kvrelay-$1.XXXXXX")
  trap kr_cluster_cleanup EXIT
}
kr_cluster_cleanup() {
  [ -z "${KR_HOLD_PID:-}" ] || kill "$KR_HOLD_PID" 2>/dev/null || true
  krc_stop
  rm -rf "$KRC_DIR"
}
fail() {
  echo "FAIL: $*" >&2
  echo "--- router log:" >&2
  tail -n 40 "$KRC_DIR/router.log" >&2 || true
  exit 1
}
