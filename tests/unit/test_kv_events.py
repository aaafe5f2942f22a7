"""The KV event listener against vLLM's own ZMQ publisher, over real sockets on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.environment import free_port
from router.kv_events import KVEventListener
from router.kv_index import KVIndex


def publisher(endpoint: str, replay: str, topic: str):
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay, topic=topic)


def stored(*hashes: int, medium: str = "CPU"):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    event = BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[0] * 32 * len(hashes),
                        block_size=32, lora_id=None, medium=medium, lora_name=None)  # fmt: skip
    return KVEventBatch(ts=time.time(), events=[event])


def removed(*hashes: int):
    from vllm.distributed.kv_events import BlockRemoved, KVEventBatch

    return KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=list(hashes), medium="CPU")])


def cleared():
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

    return KVEventBatch(ts=time.time(), events=[AllBlocksCleared()])


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.fixture
def endpoints():
    return f"tcp://127.0.0.1:{free_port('127.0.0.1')}", f"tcp://127.0.0.1:{free_port('127.0.0.1')}"


async def test_events_missed_before_the_router_started_are_replayed(endpoints):
    sub, replay = endpoints
    engine = publisher(sub, replay, "engine-a")
    try:
        for k in range(3):  # nobody listens yet: these are really lost on the PUB socket
            engine.publish(stored(k))
        await asyncio.sleep(0.3)
        index = KVIndex()
        listener = KVEventListener(index, sub, {"engine-a": replay}.get)
        listener.start()
        try:
            await asyncio.sleep(0.5)  # let the PUB side connect
            engine.publish(stored(3))
            await until(lambda: index.match([0, 1, 2, 3]) == {"engine-a": 4})
            engine.publish(removed(1))
            await until(lambda: index.match([0, 1, 2, 3]) == {"engine-a": 1})
            engine.publish(cleared())
            await until(lambda: index.match([0]) == {})
            assert listener.resyncs == 0
        finally:
            await listener.stop()
    finally:
        engine.shutdown()


async def test_a_restarted_router_rebuilds_its_index_before_any_new_event(endpoints):
    """A router that starts while an engine already serves (a restart) catches up from the
    engine's replay buffer at once, instead of waiting for its next batch."""
    sub, replay = endpoints
    engine = publisher(sub, replay, "engine-a")
    try:
        for batch in (stored(0, 1), stored(2), removed(0), stored(3)):
            engine.publish(batch)
        await asyncio.sleep(0.3)
        index = KVIndex()
        listener = KVEventListener(index, sub, {"engine-a": replay}.get)
        listener.start(holders=["engine-a"])
        try:
            await until(lambda: index.expected_seq("engine-a") == 4)
            assert index.num_blocks("engine-a") == 3
            assert index.match([1, 2, 3]) == {"engine-a": 3} and index.match([0]) == {}
            await asyncio.sleep(0.5)  # let the PUB side reconnect
            engine.publish(stored(4))  # the live stream goes on where the replay ended
            await until(lambda: index.match([1, 2, 3, 4]) == {"engine-a": 4})
            assert listener.resyncs == 0
        finally:
            await listener.stop()
    finally:
        engine.shutdown()


async def test_a_gap_that_cannot_be_replayed_resyncs_the_holder(endpoints):
    sub, _ = endpoints
    index = KVIndex()
    index.stored("engine-b", [42])
    index.apply_batch("engine-b", 0, lambda: None)
    import msgspec

    listener = KVEventListener(index, sub, lambda holder: None)  # no replay socket known
    await listener.receive("engine-b", 5, msgspec.msgpack.encode(stored(7)))
    assert listener.resyncs == 1
    assert index.match([42]) == {}  # stale entries from before the gap are gone
    assert index.match([7]) == {"engine-b": 1}
    assert index.expected_seq("engine-b") == 6


async def test_blocks_an_engine_saved_to_the_store_are_indexed_as_the_stores(endpoints):
    import msgspec

    from kvstore import STORE_MEDIUM
    from router.kv_events import STORE_HOLDER

    index = KVIndex()
    listener = KVEventListener(index, endpoints[0], lambda holder: None)
    await listener.receive("prefill-0", 0, msgspec.msgpack.encode(stored(1, 2)))
    await listener.receive("prefill-0", 1, msgspec.msgpack.encode(stored(1, 2, medium=STORE_MEDIUM)))
    assert index.match([1, 2]) == {"prefill-0": 2, STORE_HOLDER: 2}
    await listener.receive("prefill-0", 2, msgspec.msgpack.encode(cleared()))  # the engine's cache only
    assert index.match([1, 2]) == {STORE_HOLDER: 2}
