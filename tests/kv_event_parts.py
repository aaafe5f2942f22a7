"""What the KV event tests share (tests/unit/kv_events/, and the floods of
tests/unit/test_zmq_listener_floods.py): the session's cluster keys, a publisher as an engine
runs it, a router's listener, vLLM's event batches, fresh endpoints."""

from __future__ import annotations

import asyncio
import time

from engine.environment import free_port
from router.kv_event_listener import KVEventListener
from security.credentials import ClusterCredentials
from transport.zmq_curve import KV_EVENTS_PLANE

CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)
KEYS = CREDENTIALS.curve(KV_EVENTS_PLANE)


def publisher(endpoint: str, replay: str, topic: str, ours: bool = True):
    """An engine's publisher: ours (engine/kv_event_publisher.py), or vLLM's plain one (a stranger)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    from engine.kv_event_publisher import ClusterEventPublisher

    kind = ClusterEventPublisher if ours else ZmqEventPublisher
    return kind(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay, topic=topic)


def listener_for(index, replay_endpoint_of, **options) -> KVEventListener:
    return KVEventListener(index, replay_endpoint_of, KEYS, **options)


def stored(*hashes: int, medium: str = "CPU"):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    event = BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[0] * 32 * len(hashes),
                        block_size=32, lora_id=None, medium=medium, lora_name=None)
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


def fresh_endpoints() -> tuple[str, str]:
    """A PUB and a replay endpoint on free loopback ports."""
    return f"tcp://127.0.0.1:{free_port('127.0.0.1')}", f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
