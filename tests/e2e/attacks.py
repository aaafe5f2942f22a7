"""Attacks on a running cluster from another address (docs/security.md, attacks 1-8), each tried
for real and reported as what the attacker got. Run by ray_up_scenario.py inside its network
namespace: the cluster's components bind node addresses 127.0.0.1-3, the attacker connects from
127.0.0.9. It knows the endpoints (a port scan would find them too), not the cluster's secret."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import msgpack
import zmq

ATTACKER = "127.0.0.9"


def _stranger_http() -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=ATTACKER), timeout=10)


def _zmq_answer(kind: int, endpoint: str, frames: list[bytes], curve_keys=None, wait_s: float = 2.0):
    """What a stranger's ZMQ socket of `kind`, connected from ATTACKER, gets back (None: nothing)."""
    context = zmq.Context()
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if curve_keys is not None:  # a key pair of its own, even the server's public key
        public, secret = zmq.curve_keypair()
        socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = curve_keys, public, secret
    socket.connect(endpoint.replace("tcp://", f"tcp://{ATTACKER};"))
    try:
        socket.send_multipart(frames)
        return socket.recv_multipart() if socket.poll(int(wait_s * 1000)) else None
    finally:
        socket.close(0)
        context.term()


def engine_routes(engine_urls: list[str]) -> dict[str, list[int]]:
    """Every route an engine has, called without the engine token: the weight loader that once
    ran pickled code, the dev routes, the OpenAI routes, health and metrics."""
    calls = [("POST", "/collective_rpc", {"method": "pdc_load_weights", "args": ['{"peer": {"kind": "cuda_ipc"}}']}),
             ("POST", "/reset_prefix_cache", None), ("POST", "/v1/completions", {"model": "tiny", "prompt": "x"}),
             ("GET", "/metrics", None), ("GET", "/health", None), ("POST", "/tokenize", {"prompt": "x"})]
    seen: dict[str, list[int]] = {}
    with _stranger_http() as client:
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
        "plain": [_zmq_answer(zmq.REQ, e, [m]) for e in endpoints for m in (hello, reserve)],
        "own_curve_key": [_zmq_answer(zmq.REQ, e, [hello], curve_keys=zmq.curve_keypair()[0]) for e in endpoints],
    }


def kv_event_replay(replay_endpoints: list[str]) -> list:
    """Engines' replay sockets, asked for every buffered batch (with token ids, before)."""
    return [_zmq_answer(zmq.DEALER, e, [b"", (0).to_bytes(8, "big")]) for e in replay_endpoints]


def forged_kv_events(sub_endpoint: str, batches_before, batches_after_wait) -> dict:
    """Forged BlockStored batches published to the router's SUB socket: the index's batch count
    (from /admin/explain) before and after."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    event = BlockStored(block_hashes=[12345], parent_block_hash=None, token_ids=[], block_size=32,
                        lora_id=None, medium="CPU", lora_name=None)
    payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[event]))
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(sub_endpoint.replace("tcp://", f"tcp://{ATTACKER};"))
    before = batches_before()
    time.sleep(1.0)
    for seq in range(100):
        socket.send_multipart([b"prefill-0", seq.to_bytes(8, "big"), payload])
    time.sleep(1.0)
    socket.close(0)
    context.term()
    return {"batches_before": before, "batches_after": batches_after_wait()}


def ray_gcs(address: str) -> int:
    """A driver without the cluster's Ray token: its exit code (0 would mean it joined)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    code = f"import ray; ray.init(address={address!r}, log_to_driver=False); print('joined')"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode


def router_edges(router_url: str) -> dict[str, int]:
    with _stranger_http() as client:
        return {path: client.get(f"{router_url}{path}").status_code
                for path in ("/metrics", "/admin/instances", "/admin/store")}
