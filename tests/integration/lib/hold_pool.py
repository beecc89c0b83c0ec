"""hold_pool.py - fills a decode node's KV pool to the last block with reservations of its own (Decode.Reserve,
the internal API the router uses), so that the router finds no room; then waits for a line on
stdin and releases them. Used by tests/integration/openai_api.sh (the 429 case) and admission.sh (a queue to order).
With LEAVE it stops short of that: at least LEAVE blocks stay free, and fewer than LEAVE plus one
small reservation (adaptive.sh: memory pressure without a full pool).
  python3 hold_pool.py STUBS_DIR DECODE_ADDR [LEAVE]
Prints "held N blocks in K reservations" once the node refuses a further one (or LEAVE is reached)."""
import sys

sys.path.insert(0, sys.argv[1])
import grpc  # noqa: E402
from kvrelay.v1 import internal_pb2, internal_pb2_grpc  # noqa: E402

channel = grpc.insecure_channel(sys.argv[2])
decode = internal_pb2_grpc.DecodeStub(channel)
leave = int(sys.argv[3]) if len(sys.argv) > 3 else 0
held = []
blocks = 0
for tokens in (2000, 256, 16, 1):  # big reservations first, then smaller ones into what is left
    while True:
        try:
            r = decode.Reserve(internal_pb2.ReserveRequest(request_id=f"hold-{len(held)}", prompt_tokens=tokens,
                                                           max_tokens=tokens, ttl_ms=120000), timeout=10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                sys.exit(f"hold_pool: Reserve: {e.code()}: {e.details()}")
            break
        if leave and decode.Status(internal_pb2.NodeStatusRequest(), timeout=10).free_kv_blocks < leave:
            decode.Release(internal_pb2.ReleaseRequest(reservation_id=r.reservation_id, request_id="hold-over"),
                           timeout=10)
            break  # this size went past LEAVE: smaller ones fill what is left
        held.append(r.reservation_id)
        blocks += r.reserved_blocks
        if len(held) > 5000:
            sys.exit("hold_pool: the pool never filled")
print(f"held {blocks} blocks in {len(held)} reservations", flush=True)
sys.stdin.readline()
for i, rid in enumerate(held):
    decode.Release(internal_pb2.ReleaseRequest(reservation_id=rid, request_id=f"hold-{i}"), timeout=10)
print("released", flush=True)
