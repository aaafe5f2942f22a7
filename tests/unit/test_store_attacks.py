"""Attacks on a store shard's control socket (docs/security.md, attacks 2.x): strangers get no
answer at all; a member's malformed or absurd messages get an error and change nothing; 10,000
random frames leave the shard serving; a shard whose serving thread dies says so."""

from __future__ import annotations

import ctypes
import dataclasses
import random
import socket
import time

import msgpack
import pytest
import zmq

from kvstore import messages
from kvstore.shard import ShardServer
from kvstore.shard_client import ShardClient
from kvstore.shard_control import StoreUnavailable, request_once
from security.credentials import ClusterCredentials
from transport.zmq_curve import STORE_PLANE, connect_curve

KEYS = ClusterCredentials.generate().curve(STORE_PLANE)
FRAMES = 10_000


@pytest.fixture
def shard():
    died = []
    server = ShardServer(4 * 1024**2, KEYS, page_bytes=64 * 1024, on_death=lambda: died.append(True))
    server.died = died
    yield server
    server.close()


def stored_chunks(server: ShardServer, count: int = 4) -> ShardClient:
    client = ShardClient(server.endpoint, KEYS, timeout_s=5.0, staging_bytes=1024**2)
    payloads = [bytes([i]) * 100_000 for i in range(count)]
    import numpy as np

    assert client.put([f"k{i}" for i in range(count)], [np.frombuffer(p, np.uint8) for p in payloads]) == count
    return client


def answered(endpoint: str, keys, request, timeout_s: float = 1.0) -> bool:
    try:
        request_once(endpoint, request, timeout_s, keys)
        return True
    except StoreUnavailable as exc:
        return "refused" in str(exc)  # an error reply is an answer too


@pytest.mark.slow  # a fuzzer: seconds
def test_strangers_get_no_answer(shard):
    stranger = ClusterCredentials.generate().curve(STORE_PLANE)  # another cluster's keys
    assert not answered(shard.endpoint, stranger, messages.Hello())
    knows_the_server = dataclasses.replace(stranger, server_public=KEYS.server_public)
    assert not answered(shard.endpoint, knows_the_server, messages.Hello())  # the ZAP gate refuses
    context = zmq.Context()
    plain = context.socket(zmq.REQ)  # no CURVE at all
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(shard.endpoint)
    plain.send(msgpack.packb({"op": "hello"}))
    assert not plain.poll(1000)
    plain.close(0)
    context.term()
    assert shard.stats().chunks == 0 and shard._gate.refused >= 1
    assert answered(shard.endpoint, KEYS, messages.Hello())  # a member is answered


def test_absurd_sizes_are_an_error_and_evict_nothing(shard):
    client = stored_chunks(shard)
    try:
        before = client.stats()
        for sizes in ([10**12], [shard.store.capacity_bytes + 1]):
            with pytest.raises(StoreUnavailable, match="limited"):
                request_once(shard.endpoint, messages.Reserve(["huge"], sizes, [0]), 5.0, KEYS)
        for bad in ({"op": "reserve", "keys": ["x"], "nbytes": [-1], "checksums": [0]},
                    {"op": "reserve", "keys": ["x", "y"], "nbytes": [1], "checksums": [0]},
                    {"op": "contains", "keys": ["x"] * (messages.MAX_KEYS + 1)},
                    {"op": "lease", "keys": ["k" * 100_000]},
                    {"op": "corrupt", "count": 1}):
            with pytest.raises(StoreUnavailable):
                request_once(shard.endpoint, bad, 5.0, KEYS)
        after = client.stats()
        assert (after["chunks"], after["evictions"], after["stored_bytes"]) == (
            before["chunks"], before["evictions"], before["stored_bytes"])
        assert after["malformed"] >= 4
    finally:
        client.close()


@pytest.mark.slow  # a fuzzer: seconds
def test_ten_thousand_random_frames_leave_the_shard_serving(shard):
    """From a member's socket (a stranger's never reach the decoder): random frame counts, random
    bytes, random msgpack values. Each is answered with an error or dropped; none stops the shard."""
    client = stored_chunks(shard, 2)
    rng = random.Random(7)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    connect_curve(dealer, KEYS)
    dealer.connect(shard.endpoint)
    values = [None, 1, -1, 2**63, "x", b"\x00", [], {}, {"op": 5}, {"op": "reserve"}, {"op": "release", "lease": -3}]
    try:
        for n in range(FRAMES):
            kind = n % 3
            if kind == 0:
                frames = [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
            elif kind == 1:
                frames = [b"", msgpack.packb(rng.choice(values))]
            else:
                frames = [b"", msgpack.packb({"op": rng.choice(["hello", "lease", "reserve", "commit", "x"]),
                                               "keys": rng.choice(values)})]
            dealer.send_multipart(frames)
            while dealer.poll(0):
                dealer.recv_multipart()
        time.sleep(0.5)
        assert shard.serving and not shard.died
        assert len(client.get(["k0", "k1"])) == 2  # still serving its members, data intact
        assert client.stats()["malformed"] > FRAMES // 2
    finally:
        dealer.close(0)
        context.term()
        client.close()


def test_random_bytes_at_the_port_reach_no_code(shard):
    """A stranger speaking no ZMTP at all: connections open and close, nothing else."""
    host, port = shard.endpoint.removeprefix("tcp://").split(":")
    rng = random.Random(3)
    for _ in range(200):
        with socket.create_connection((host, int(port)), timeout=2) as raw:
            raw.sendall(rng.randbytes(rng.randrange(1, 512)))
    assert shard.serving and shard.malformed == 0  # the handshake failed before any message


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_shard_whose_serving_thread_dies_says_so(shard):
    """The fault, raised in the serving thread itself (CPython's async exception: a crash we
    cannot cause through the socket any more)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(shard._thread.ident), ctypes.py_object(SystemExit))
    shard._thread.join(timeout=5)
    assert not shard.serving and shard.died == [True]  # the actor's on_death: os._exit, Ray restarts it
