"""Attacks on a running cluster from another host (docs/security.md), each tried for real and
reported as what the attacker got. ray_up_scenario.py runs this script in a network namespace of
its own, a veth pair away from the cluster's, with no credential of the cluster in its
environment: it reads the targets from the JSON file its argument names (endpoints a port scan would find too, not the
cluster's secret) and prints what each listener answered, as JSON."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import msgpack
import zmq


def _zmq_answer(kind: int, endpoint: str, frames: list[bytes], curve_keys=None, wait_s: float = 2.0):
    """What a stranger's ZMQ socket of `kind` gets back (None: nothing)."""
    context = zmq.Context()
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if curve_keys is not None:  # a key pair of its own, even the server's public key
        public, secret = zmq.curve_keypair()
        socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = curve_keys, public, secret
    socket.connect(endpoint)
    try:
        socket.send_multipart(frames)
        return socket.recv_multipart() if socket.poll(int(wait_s * 1000)) else None
    finally:
        socket.close(0)
        context.term()


def _zmq_answers(asks: list[tuple]) -> list:
    """`_zmq_answer(*ask)` for each ask, all at once: a listener that holds out its silence costs
    one wait, not one per probe."""
    with ThreadPoolExecutor(max_workers=max(1, len(asks))) as pool:
        return list(pool.map(lambda ask: _zmq_answer(*ask), asks))


def client_routes(client: httpx.Client, router_url: str) -> dict[str, dict[str, int]]:
    """The clients' routes without an API key and with a wrong one."""
    calls = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
             ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})]
    keys = {"none": {}, "wrong": {"Authorization": "Bearer sk-guessed"}}
    return {path: {name: client.request(method, f"{router_url}{path}", json=body, headers=headers).status_code
                   for name, headers in keys.items()}
            for method, path, body in calls}


def router_edges(client: httpx.Client, router_url: str) -> dict[str, int]:
    return {path: client.get(f"{router_url}{path}").status_code for path in ("/metrics", "/admin/instances",
                                                                             "/admin/store", "/status")}


def engine_routes(engine_urls: list[str]) -> dict[str, list[int]]:
    """Every route an engine has, called without the engine token: the weight loader that once
    ran pickled code, the dev routes, the OpenAI routes, health and metrics. A stranger cannot
    verify an engine's certificate and does not care to: it skips the check and talks TLS."""
    calls = [("POST", "/collective_rpc", {"method": "pdc_load_weights", "args": ['{"peer": {"kind": "cuda_ipc"}}']}),
             ("POST", "/reset_prefix_cache", None), ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
             ("GET", "/metrics", None), ("GET", "/health", None), ("POST", "/tokenize", {"prompt": "x"})]
    seen: dict[str, list[int]] = {}
    with httpx.Client(timeout=10, verify=False) as client:
        for url in engine_urls:
            for method, path, body in calls:
                seen.setdefault(path, []).append(client.request(method, f"{url}{path}", json=body).status_code)
    return seen


def store_shards(endpoints: list[str]) -> dict[str, list]:
    """A shard's hello (its NIXL metadata) and a reserve of 10**12 bytes, asked plainly and with a
    CURVE key pair of the attacker's own."""
    hello, reserve = msgpack.packb({"op": "hello"}), msgpack.packb(
        {"op": "reserve", "keys": ["x"], "nbytes": [10**12], "checksums": [0]})
    return {
        "plain": _zmq_answers([(zmq.REQ, e, [m]) for e in endpoints for m in (hello, reserve)]),
        "own_curve_key": _zmq_answers([(zmq.REQ, e, [hello], zmq.curve_keypair()[0]) for e in endpoints]),
    }


def kv_event_replay(replay_endpoints: list[str]) -> list:
    """Engines' replay sockets, asked for every buffered batch (with token ids, before)."""
    return _zmq_answers([(zmq.DEALER, e, [b"", (0).to_bytes(8, "big")]) for e in replay_endpoints])


def kv_event_subscriptions(pub_endpoints: list[str], listen_s: float) -> dict[str, list]:
    """Engines' KV event PUB sockets, subscribed to for `listen_s` (while the cluster serves
    requests, so there are events to hear), plainly and with a CURVE key pair of the attacker's
    own: every message heard, per endpoint (the events name every tenant's prompt blocks)."""
    context = zmq.Context()
    sockets = {}
    for name, own_key in (("plain", False), ("own_curve_key", True)):
        for endpoint in pub_endpoints:
            socket = context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            if own_key:
                public, secret = zmq.curve_keypair()
                socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = public, public, secret
            socket.connect(endpoint)
            sockets[(name, endpoint)] = socket
    heard: dict[str, list] = {"plain": [], "own_curve_key": []}
    deadline = time.monotonic() + listen_s
    poller = zmq.Poller()
    for socket in sockets.values():
        poller.register(socket, zmq.POLLIN)
    while (left := deadline - time.monotonic()) > 0:
        for socket, _ in poller.poll(int(left * 1000)):
            name = next(n for (n, _), s in sockets.items() if s is socket)
            heard[name].append(socket.recv_multipart())
    for socket in sockets.values():
        socket.close(0)
    context.term()
    return heard


def _grpc_status(call) -> str:
    """The status a gRPC call without Ray's token ends with ("OK" would mean it was served)."""
    try:
        call(timeout=10)
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def ray_gcs(address: str) -> str:
    """Ray's GCS asked for the cluster's nodes (their addresses and ports)."""
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        return _grpc_status(lambda timeout: stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(),
                                                                timeout=timeout))


def ray_client(address: str) -> str:
    """Ray's client server (`ray://`, which `ray start --head` opens on 10001): a driver's first call."""
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = ray_client_pb2_grpc.RayletDriverStub(channel)
        request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
        return _grpc_status(lambda timeout: stub.ClusterInfo(request, timeout=timeout))


def dashboard_agents(client: httpx.Client, agent_urls: list[str]) -> dict[str, dict[str, int | str]]:
    """Each node's dashboard agent (HTTP): a job submitted to it (a command run on that node), and
    its health route, which Ray leaves open to anyone by design (it answers "success", no more)."""
    job = {"entrypoint": "true", "submission_id": "stranger"}
    seen: dict[str, dict[str, int | str]] = {}
    for url in agent_urls:
        try:
            seen[url] = {"submit_job": client.post(f"{url}/api/job_agent/jobs/", json=job).status_code,
                         "health": client.get(f"{url}/api/local_raylet_healthz").status_code}
        except httpx.ConnectError:
            seen[url] = {"submit_job": "refused", "health": "refused"}
    return seen


def main() -> int:
    targets = json.loads(Path(sys.argv[1]).read_text())
    # First, while the cluster serves the requests the scenario sends for as long.
    subscriptions = kv_event_subscriptions(targets["kv_events"], targets["listen_s"])
    with httpx.Client(timeout=10) as client:
        seen = {
            "kv_event_subscriptions": subscriptions,
            "client_routes": client_routes(client, targets["router"]),
            "router_edges": router_edges(client, targets["router"]),
            "engine_routes": engine_routes(targets["engines"]),
            "store_shards": store_shards(targets["store_shards"]),
            "kv_event_replay": kv_event_replay(targets["kv_event_replay"]),
            "ray_gcs": ray_gcs(targets["ray_gcs"]),
            "ray_client": ray_client(targets["ray_client"]),
            "dashboard_agents": dashboard_agents(client, targets["dashboard_agents"]),
        }
    json.dump(seen, sys.stdout, default=bytes.hex)  # the frames of a reply, should one come
    return 0


if __name__ == "__main__":
    sys.exit(main())
