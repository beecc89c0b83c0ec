#!/usr/bin/env bash
# admission.sh - the router's admission FIFO (docs/router.md, "Admission"): with the decode
# node's KV pool held by reservations of the test's own (lib/hold_pool.py), requests sent one
# after another all wait; once the pool is released they must be admitted (reserved on the
# decode node) in the order they arrived, all complete, and each reports the time it queued.
# Ordering is read from the router's log (its "accepted" and "reserved" lines per request id),
# never from wall-clock thresholds. A cluster of 1 prefill + 1 decode node on the default model.
# Skips (77) without python3-grpcio or the stub generator. Env (set by ctest): KR_BIN, KR_SRC.
set -euo pipefail
. "$KR_SRC/tests/integration/lib/pystubs.sh" # PY, kr_pystubs, kr_hold_pool; skips without grpcio
. "$KR_SRC/tests/integration/lib.sh" # krc_*, kr_cluster_workdir, fatal
kr_cluster_workdir admission

n=8
KRC_ROUTER_ARGS=(--max-queue-ms 60000)
KRC_DECODE_ARGS=(--kv-blocks 4000)
unset KVRELAY_API_KEY # a cluster without API keys, whatever the caller's environment says
krc_start "$KR_BIN" "$KR_SRC/models/kjv-2l128-2k" 1 1 127.0.0.1:0 --threads 1 ||
  fatal "the cluster did not start"
kr_pystubs "$KRC_DIR/stubs" kvrelay/v1/internal.proto
kr_hold_pool "$KRC_DIR/stubs" "$(krc_addr decode-0)" "$KRC_DIR" || fatal "hold_pool: $(cat "$KRC_DIR/hold.out")"
echo "ok: $(cat "$KRC_DIR/hold.out")"

queue_depth() {
  curl -s "http://$KRC_ROUTER_HTTP/metrics" | sed -n 's/^kvrelay_queue_depth \([0-9]*\).*/\1/p'
}
pids=()
for ((i = 0; i < n; i++)); do
  "$KR_BIN/kvrelay-cli" --router "$KRC_ROUTER" generate --prompt "And God said" --max-tokens 4 \
    --request-id "fifo-$i" --json >"$KRC_DIR/out.$i" 2>"$KRC_DIR/err.$i" &
  pids+=($!)
  # the next one arrives after this one waits: arrival order is then the order of the loop
  for _ in $(seq 200); do [ "$(queue_depth)" = $((i + 1)) ] && break; sleep 0.02; done
  [ "$(queue_depth)" = $((i + 1)) ] || fatal "request $i did not queue (kvrelay_queue_depth $(queue_depth))"
done
echo "ok: $n requests wait in the router's queue"
kr_release_pool || fatal "hold_pool release: $(cat "$KRC_DIR/hold.out")"
for ((i = 0; i < n; i++)); do
  wait "${pids[$i]}" || fatal "request fifo-$i: $(cat "$KRC_DIR/err.$i")"
done
echo "ok: all $n completed"

# arrival order (accepted) and admission order (reserved on the decode node), by request id
accepted=$(sed -n 's/.*\[\(fifo-[0-9]*\)\] accepted:.*/\1/p' "$KRC_DIR/router.log" | tr '\n' ' ')
reserved=$(sed -n 's/.*\[\(fifo-[0-9]*\)\] reserved .* blocks on .*/\1/p' "$KRC_DIR/router.log" | tr '\n' ' ')
echo "arrived:  $accepted"
echo "admitted: $reserved"
[ "$(echo $accepted | wc -w)" = $n ] || fatal "the router accepted $(echo $accepted | wc -w) of $n requests"
[ "$accepted" = "$reserved" ] || fatal "admission order differs from arrival order"
echo "ok: admitted in arrival order"
for ((i = 0; i < n; i++)); do
  grep -q "\[fifo-$i\] finished: .*(queued [0-9.]* s)" "$KRC_DIR/router.log" || fatal "fifo-$i logged no queue time"
done
[ "$(queue_depth)" = 0 ] || fatal "kvrelay_queue_depth is $(queue_depth) after all finished"
metrics=$(curl -s "http://$KRC_ROUTER_HTTP/metrics")
for m in queue_wait e2e ttft; do
  grep -q "^kvrelay_${m}_seconds_count{policy=\"full\"} $n\$" <<<"$metrics" ||
    fatal "kvrelay_${m}_seconds{policy=\"full\"} did not count the $n requests"
done
grep -q '^kvrelay_queue_wait_seconds_count{policy="streaming"} 0$' <<<"$metrics" ||
  fatal "another policy family's histogram counted them"
echo "ok: the latency histograms by policy family counted them"
dmetrics=$(curl -s "http://$(krc_http decode-0)/metrics")
grep -q "^kvrelay_decode_step_seconds_count [1-9]" <<<"$dmetrics" || fatal "the decode node timed no step"
grep -q '^kvrelay_kv_blocks_used_by_policy{policy="full"} 0$' <<<"$dmetrics" ||
  fatal "the decode node still counts blocks for the finished requests"
echo "ok: the decode node timed its steps and holds no block for any policy"
echo "PASS"
