"""Attacks on the KV event plane, over real sockets on loopback: strangers at an engine's
publisher and replay socket, forged and malformed batches from a member's socket, a listening
task that fails, and fuzzed replay requests; the listener and the publisher live on through each."""

from __future__ import annotations

import asyncio
import time

import pytest
from kv_event_parts import (
    KEYS,
    listener_for,
    publisher,
    stored,
    until,
)

from router import metrics
from router.kv_event_listener import KVEventListener
from router.kv_index import KVIndex
from security.credentials import ClusterCredentials
from transport.zmq_curve import KV_EVENTS_PLANE, connect_curve


@pytest.mark.slow  # a fuzzer: seconds
async def test_a_stranger_can_neither_subscribe_nor_replay(endpoints):
    """An engine's PUB and replay sockets answer no one without the cluster's keys (no CURVE, or
    another cluster's); what members hear carries block hashes, not token ids."""
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    pub, replay = endpoints
    engine = publisher(pub, replay, "engine-a")
    context = zmq.asyncio.Context()
    strangers = [subscriber(context, pub, None),
                 subscriber(context, pub, ClusterCredentials.generate().curve(KV_EVENTS_PLANE))]
    member = subscriber(context, pub, KEYS)
    try:
        frames = None
        for _ in range(50):  # until the member's subscription reached the engine
            engine.publish(stored(5))
            if (frames := await heard(member)) is not None:
                break
        assert frames is not None, "a member never heard the engine"
        (event,) = msgspec.msgpack.decode(frames[-1], type=KVEventBatch).events
        assert event.block_hashes == [5] and event.token_ids == [] and event.extra_keys is None
        for _ in range(3):  # the strangers' handshakes had as long as the member's, and more
            engine.publish(stored(6))
            assert [await heard(s) for s in strangers] == [None, None]
        assert await replay_reply(context, replay, None) is None  # no CURVE
        other_keys = ClusterCredentials.generate().curve(KV_EVENTS_PLANE)
        assert await replay_reply(context, replay, other_keys) is None
        (event, *_) = msgspec.msgpack.decode((await replay_reply(context, replay, KEYS))[-1], type=KVEventBatch).events
        assert event.token_ids == []
    finally:
        for socket in (*strangers, member):
            socket.close(0)
        engine.shutdown()
        context.term()


def subscriber(context, pub: str, keys):
    """A SUB socket at an engine's publisher, subscribed to everything (keys: the plane's, a
    stranger's, or None for no CURVE)."""
    import zmq

    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        connect_curve(socket, keys)
    socket.connect(pub)
    return socket


async def heard(socket) -> list[bytes] | None:
    try:
        return await asyncio.wait_for(socket.recv_multipart(), 0.3)
    except TimeoutError:
        return None


async def replay_reply(context, replay: str, keys) -> list[bytes] | None:
    """The replay socket's answer to a request for the whole history, or None within a second."""
    import zmq

    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        connect_curve(socket, keys)
    socket.connect(replay)
    await socket.send_multipart((b"", (0).to_bytes(8, "big")))
    try:
        return await asyncio.wait_for(socket.recv_multipart(), 1.0)
    except TimeoutError:
        return None
    finally:
        socket.close(0)


class MemberPublisher:
    """A PUB socket bound as an engine's is, on the cluster's server key (what an engine of ours,
    or a compromised one, sends on); owns its context and ZAP handler."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        from transport.zmq_curve import Gate, serve_curve

        self.context = zmq.Context()
        self.gate = Gate(self.context, KEYS)
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.set_hwm(20_000)
        serve_curve(self.socket, KEYS)
        self.socket.bind(endpoint)

    def send_multipart(self, frames) -> None:
        self.socket.send_multipart(frames)

    def close(self) -> None:
        self.socket.close(0)
        self.gate.stop()
        self.context.term()


async def until_applied(pub, listener: KVEventListener, frames: list[bytes], applied: int) -> None:
    """Send `frames` until the listener has applied `applied` batches: a PUB socket drops what it
    sends before the SUB side's subscription reached it (a copy after that is seen as applied)."""
    deadline = time.monotonic() + 10
    while listener.batches_applied < applied:
        assert time.monotonic() < deadline, "the batch was never applied"
        pub.send_multipart(frames)
        await asyncio.sleep(0.1)


def raw_batch(events: bytes) -> bytes:
    """A KVEventBatch as msgpack, its events array given as raw msgpack (what no encoder of ours makes)."""
    import msgspec

    return b"\x92" + msgspec.msgpack.encode(time.time()) + events


def forged_stored(block_hashes: bytes = b"\x91\x01", extra_keys: bytes = b"\xc0") -> bytes:
    """One BlockStored as raw msgpack (a tagged struct is a map), with its block hashes and extra keys raw."""
    import msgspec

    fields = {"type": "BlockStored", "parent_block_hash": None, "token_ids": [], "block_size": 32,
              "lora_id": None, "medium": "CPU", "lora_name": None}
    encoded = msgspec.msgpack.encode(fields)
    head = bytes([encoded[0] + 2]) + encoded[1:]  # a fixmap: two more entries follow
    return (b"\x91" + head + msgspec.msgpack.encode("block_hashes") + block_hashes
            + msgspec.msgpack.encode("extra_keys") + extra_keys)


def encoded(batch) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(batch)


FORGED = {  # (topic, sequence number, payload) of a member's batch that decodes, or nearly
    "block hashes that are not hashes": lambda: (b"engine-a", 1, raw_batch(forged_stored(b"\x92\xa1x\x91\x01"))),
    "extra keys nested past the decoder's depth": lambda: (
        b"engine-a", 1, raw_batch(forged_stored(extra_keys=b"\x91" + b"\x91" * 100_000 + b"\xc0"))),
    "a sequence number no engine reaches": lambda: (b"engine-a", 2**63 - 1, encoded(stored(66))),
    "a negative sequence number": lambda: (b"engine-a", -5, encoded(stored(66))),
    "an instance the router does not know": lambda: (b"engine-x", 0, encoded(stored(66))),
}


@pytest.mark.parametrize("kind", FORGED)
async def test_a_forged_batch_is_dropped_and_counted_and_the_index_goes_on(endpoints, kind):
    """From a member's socket: a batch that decodes (or raises while decoding) but that no engine
    sends. It is dropped and counted, and the holder's next real batch applies as if it never came."""
    endpoint, replay = endpoints
    index = KVIndex()
    listener = listener_for(index, {"engine-a": replay}.get, replay_timeout_s=0.2)  # no replay answers
    pub = MemberPublisher(endpoint)
    listener.follow("engine-a", endpoint)
    listener.start()
    try:
        await until_applied(pub, listener, [b"engine-a", (0).to_bytes(8, "big"), encoded(stored(1))], applied=1)
        rejected = metrics.KV_EVENTS_REJECTED._value.get()
        topic, seq, payload = FORGED[kind]()
        pub.send_multipart([topic, seq.to_bytes(8, "big", signed=True), payload])
        await until(lambda: metrics.KV_EVENTS_REJECTED._value.get() == rejected + 1)
        pub.send_multipart([b"engine-a", (1).to_bytes(8, "big"), encoded(stored(2))])
        await until(lambda: index.match([1, 2]) == {"engine-a": 2})
        assert index.match([66]) == {} and index.holders() == ["engine-a"]
        assert listener.resyncs == 0 and listener.batches_applied == 2
    finally:
        pub.close()
        await listener.stop()


async def test_a_failed_listening_task_is_logged_and_listens_again(endpoints, caplog):
    endpoint, replay = endpoints
    index = KVIndex()
    listener = listener_for(index, {"engine-a": replay}.get, restart_delay_s=0.05)
    pub = MemberPublisher(endpoint)
    listener.follow("engine-a", endpoint)
    listener.start()
    receive = listener._socket.recv_multipart
    failures = [RuntimeError("the socket broke")]

    async def breaking_once():
        if failures:
            raise failures.pop()
        return await receive()

    listener._socket.recv_multipart = breaking_once
    try:
        await until_applied(pub, listener, [b"engine-a", (0).to_bytes(8, "big"), encoded(stored(1))], applied=1)
        assert listener.restarts == 1
        assert "the KV event listener failed" in caplog.text and "the socket broke" in caplog.text
    finally:
        pub.close()
        await listener.stop()


@pytest.mark.slow  # a fuzzer: seconds
async def test_malformed_messages_are_dropped_and_counted_and_the_listener_lives(endpoints):
    """From a member's socket (strangers never complete a handshake): wrong frame counts, short
    sequence numbers, negative ones, random payloads, a topic that is not text or no instance's. 10,000 of them,
    sent 500 at a time (a PUB socket drops what goes past its high-water mark, 1,000), each lot
    counted before the next: every one arrives, every one is rejected, and a good batch after them
    still applies."""
    import random

    endpoint, replay = endpoints
    index = KVIndex()
    listener = listener_for(index, {"engine-z": replay}.get)
    pub = MemberPublisher(endpoint)
    listener.follow("engine-z", endpoint)
    listener.start()
    rng = random.Random(11)
    try:
        await until_applied(pub, listener, [b"engine-z", (0).to_bytes(8, "big"), encoded(stored(9))], applied=1)
        rejected = metrics.KV_EVENTS_REJECTED._value.get()
        for n in range(10_000):
            frames = [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.choice((1, 2, 3, 3, 4)))]
            if n % 4 == 0 and len(frames) == 3:
                frames[1] = (n).to_bytes(8, "big")  # a good sequence number, a random payload
            if n % 4 == 1:  # a good batch of a known instance, under a sequence number no engine sends
                frames = [b"engine-z", rng.randrange(-2**63, 0).to_bytes(8, "big", signed=True), encoded(stored(n))]
            pub.send_multipart(frames)
            if n % 500 == 499:
                await until(lambda sent=n + 1: metrics.KV_EVENTS_REJECTED._value.get() - rejected == sent,
                            timeout_s=20)
        pub.send_multipart((b"engine-z", (1).to_bytes(8, "big"), encoded(stored(10))))
        await until(lambda: index.match([9, 10]) == {"engine-z": 2})  # it still applies good ones
        assert metrics.KV_EVENTS_REJECTED._value.get() - rejected == 10_000
        assert index.holders() == ["engine-z"] and index.num_blocks("engine-z") == 2
    finally:
        pub.close()
        await listener.stop()


REPLAY_FUZZ = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ZMTP_CURVE_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32


def replay_dealer(context, endpoint: str, keys):
    """A DEALER socket at an engine's replay socket, as the router's replay client opens it (keys:
    the plane's, a stranger's, or None for no CURVE at all)."""
    import zmq

    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 0)  # every answer kept until read
    if keys is not None:
        connect_curve(socket, keys)
    socket.connect(endpoint)
    return socket


def random_replay_request(rng, n: int) -> list[bytes]:
    """What a DEALER sends an engine's replay socket (its ROUTER adds the sender's identity):
    random frame counts and bytes; requests shaped right (an empty frame, then a start of any
    length, an empty one, negative ones); now and then a megabyte."""
    if n % 5 == 0:
        return [b"", rng.randbytes(rng.choice((0, 1, 7, 8, 9, 64)))]
    if n % 5 == 1:
        return [rng.choice((b"", b"\x00")), rng.randrange(-2**63, 0).to_bytes(8, "big", signed=True)]
    if n % 1000 == 2:
        return [b"", rng.randbytes(1_000_000)]
    return [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.choice((1, 2, 2, 3, 4)))]


@pytest.mark.slow  # a fuzzer: seconds
async def test_malformed_replay_requests_leave_the_publisher_replaying_and_publishing(endpoints, caplog):
    """An engine's replay socket (a ROUTER that vLLM serves in its publishing thread), as our
    publisher binds it. Strangers (no CURVE, another cluster's keys, the server's public key with a
    key pair of their own, random bytes at the port with and without a ZMTP greeting) reach no
    code: no answer, not one message taken. A member's 10,000 random requests, sent 250 at a time
    (each lot answered before the next: every one is taken off the socket, those shaped as
    requests answered). After all of that the router's own replay client catches up on the
    engine's history and the engine's next batch reaches the router's index."""
    import logging
    import random

    import zmq

    pub, replay = endpoints
    engine = publisher(pub, replay, "engine-a")
    context = zmq.Context()
    rng = random.Random(19)
    sockets = []  # closed before the context ends, however the test ends
    try:
        for k in (1, 2, 3):  # the history a router catches up on
            engine.publish(stored(k))
        await strangers_reach_no_code(engine, context, replay, rng, sockets)
        caplog.set_level(logging.ERROR, logger="vllm.distributed.kv_events")  # a warning per malformed one
        sockets.append(member := replay_dealer(context, replay, KEYS))
        sent = fuzz_replay_requests(engine, member, rng)
        assert engine.replay_requests == sent == REPLAY_FUZZ + REPLAY_FUZZ // 250
        assert engine._thread.is_alive()
        await router_catches_up_and_follows(engine, pub, replay)
        assert engine.replay_requests > sent  # the router's replay took the same road
    finally:
        for each in sockets:
            each.close(0)
        context.term()
        engine.shutdown()


async def strangers_reach_no_code(engine, context, replay: str, rng, sockets: list) -> None:
    """No CURVE, another cluster's keys, the server's public key with a key pair of their own, and
    random bytes at the port (with and without a ZMTP greeting): no answer, no message taken."""
    import contextlib
    import dataclasses
    import socket

    import zmq

    from engine.kv_event_publisher import _gates

    gate = _gates[id(engine._ctx)]
    refused = gate.refused
    other_cluster = ClusterCredentials.generate().curve(KV_EVENTS_PLANE)
    for keys in (None, other_cluster, dataclasses.replace(other_cluster, server_public=KEYS.server_public)):
        sockets.append(stranger := replay_dealer(context, replay, keys))
        for n in range(500):  # under the socket's high-water mark: none blocks
            with contextlib.suppress(zmq.Again):
                stranger.send_multipart(random_replay_request(rng, n), zmq.NOBLOCK)
    host, port = replay.removeprefix("tcp://").split(":")
    for n in range(200):
        with socket.create_connection((host, int(port)), timeout=2) as raw:
            raw.sendall((ZMTP_CURVE_GREETING if n % 2 else b"") + rng.randbytes(rng.randrange(1, 512)))
    await until(lambda: gate.refused > refused)  # the ZAP handler turned the own key pair away
    await asyncio.sleep(0.5)
    assert [s.poll(0) for s in sockets] == [0, 0, 0]  # no answer
    assert engine.replay_requests == 0  # and not one message of theirs reached vLLM's code


def fuzz_replay_requests(engine, member, rng) -> int:
    """REPLAY_FUZZ random requests from a member, 250 at a time, each lot closed by a request past
    the history and answered before the next; how many were sent."""
    sent = 0
    for lot in range(REPLAY_FUZZ // 250):
        requests = [random_replay_request(rng, n) for n in range(lot * 250, (lot + 1) * 250)]
        requests.append([b"", (2**64 - 1).to_bytes(8, "big")])  # a request past the history: the lot's end
        for frames in requests:
            member.send_multipart(frames)
        sent += len(requests)
        ends = sum(len(frames) == 2 for frames in requests)  # each request shaped right: one end marker
        deadline = time.monotonic() + 20
        while ends:
            assert member.poll(max(0, int((deadline - time.monotonic()) * 1000))), \
                f"lot {lot}: {ends} answers missing; {engine.replay_requests} of {sent} taken"
            answer = member.recv_multipart()
            ends -= answer[2] == END_SEQ
    return sent


async def router_catches_up_and_follows(engine, pub: str, replay: str) -> None:
    """The router's own replay client catches up on the engine's history (blocks 1-3), and the
    engine's next batches reach the router's index."""
    import contextlib

    index = KVIndex()
    listener = listener_for(index, {"engine-a": replay}.get)
    listener.follow("engine-a", pub)
    listener.start()
    try:
        await until(lambda: index.expected_seq("engine-a") == 3)  # replayed: nothing was published since
        assert index.match([1, 2, 3]) == {"engine-a": 3} and listener.resyncs == 0
        for k in range(4, 50):  # live now (a batch the SUB side missed is replayed at the next)
            engine.publish(stored(k))
            with contextlib.suppress(AssertionError):
                await until(lambda k=k: index.expected_seq("engine-a") == k, timeout_s=0.5)
                break
        assert index.match(list(range(1, k + 1))) == {"engine-a": k}
    finally:
        await listener.stop()
