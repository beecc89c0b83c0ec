"""tls_client.py - the Python side of tls.sh: Debian's python3-grpcio (a TLS client nobody here
wrote) against a kvrelay-router that serves TLS and requires a client certificate from the
cluster CA (--tls-client-auth require).

Usage: tls_client.py STUBS ROUTER CLUSTER_DIR OTHER_DIR IDS
  CLUSTER_DIR holds the cluster's ca.pem, client.pem, client.key; OTHER_DIR the same from another
  CA; IDS a prompt ("1 2 3"), generated greedily for 8 tokens.
Checked, in this order: with the CA and the client certificate, Generate answers (its ids are
printed as "ids: ..." for tls.sh to compare with a plaintext cluster's); refused with
UNAVAILABLE, each within the call's deadline: no client certificate, a certificate from another
CA (both refused by the router's handshake), the right certificate with another key (grpcio
itself refuses to use it, so no connection is made: without the key nobody can complete the
handshake), a server CA that is not the router's (the client refuses the router); a plaintext
gRPC client gets UNAVAILABLE, not a hang; raw bytes that are not TLS get the connection closed;
after all of that the first client is served again. Exits 1 on any failure.
"""
import socket
import sys
import time

stubs, router, cluster, other, prompt = sys.argv[1:6]
sys.path.insert(0, stubs)

import grpc  # noqa: E402
from kvrelay.v1 import kvrelay_pb2 as pb  # noqa: E402
from kvrelay.v1 import kvrelay_pb2_grpc as pb_grpc  # noqa: E402

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL: " + what, file=sys.stderr)


def pem(path):
    with open(path, "rb") as f:
        return f.read()


def tls_channel(ca, cert=None, key=None):
    creds = grpc.ssl_channel_credentials(root_certificates=pem(ca),
                                         private_key=pem(key) if key else None,
                                         certificate_chain=pem(cert) if cert else None)
    return grpc.secure_channel(router, creds)


def generate(channel):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[int(x) for x in prompt.split()]),
                             max_tokens=8)
    ids = []
    for msg in pb_grpc.GenerationStub(channel).Generate(req, timeout=60):
        if msg.WhichOneof("event") == "delta":
            ids.extend(msg.delta.ids)
    return ids


def refused(what, channel):
    """A ClusterStatus call on `channel` must fail with UNAVAILABLE, well within its deadline."""
    t0 = time.monotonic()
    try:
        pb_grpc.AdminStub(channel).ClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        check(False, what + ": the call was served")
    except grpc.RpcError as e:
        took = time.monotonic() - t0
        check(e.code() == grpc.StatusCode.UNAVAILABLE and took < 9,
              "%s: want UNAVAILABLE at once, got %s after %.1f s: %s" % (what, e.code(), took,
                                                                        e.details()))
        print("%s: refused: %s" % (what, e.details()))
    channel.close()


good = tls_channel(cluster + "/ca.pem", cluster + "/client.pem", cluster + "/client.key")
ids = generate(good)
check(len(ids) == 8, "with the client certificate: 8 ids, got %r" % ids)
print("ids: " + " ".join(map(str, ids)))
nodes = pb_grpc.AdminStub(good).ClusterStatus(pb.ClusterStatusRequest(), timeout=10).nodes
check(any(n.role == pb.NODE_ROLE_DECODE for n in nodes), "ClusterStatus over TLS lists no decode node")

refused("no client certificate", tls_channel(cluster + "/ca.pem"))
refused("a client certificate from another CA",
        tls_channel(cluster + "/ca.pem", other + "/client.pem", other + "/client.key"))
refused("the client certificate with another key",
        tls_channel(cluster + "/ca.pem", cluster + "/client.pem", other + "/client.key"))
refused("a client that trusts another CA",
        tls_channel(other + "/ca.pem", cluster + "/client.pem", cluster + "/client.key"))
refused("a plaintext client", grpc.insecure_channel(router))

host, port = router.rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=10) as s:
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64)
    closed = False
    try:
        while True:
            if not s.recv(4096):
                closed = True
                break
    except ConnectionResetError:
        closed = True
    except socket.timeout:
        pass
    check(closed, "raw bytes that are not TLS: the connection stayed open for 10 s")

check(generate(good) == ids, "after the refusals the router serves the same answer again")
good.close()
sys.exit(1 if failures else 0)
