"""The KV event listener against vLLM's own ZMQ publisher (as our engines run it: on the cluster's
CURVE keys, token ids stripped), over real sockets on loopback: replay, restart, gaps, the
store's blocks; what the publisher leaves on an event and what publishing costs it. The attacks
on both ends: tests/unit/test_kv_event_attacks.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from kv_event_parts import (
    cleared,
    listener_for,
    publisher,
    removed,
    stored,
    until,
)

from router.kv_index import KVIndex


async def test_events_missed_before_the_router_started_are_replayed(endpoints):
    pub, replay = endpoints
    engine = publisher(pub, replay, "engine-a")
    try:
        for k in range(3):  # nobody listens yet: these are really lost on the PUB socket
            engine.publish(stored(k))
        await asyncio.sleep(0.3)
        index = KVIndex()
        listener = listener_for(index, {"engine-a": replay}.get)
        listener.start()
        listener.follow("engine-a", pub)
        try:
            await asyncio.sleep(0.5)  # let the SUB side connect
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
    """A router that starts while an engine already serves (a restart, a second router) catches
    up from the engine's replay buffer at once, instead of waiting for its next batch."""
    pub, replay = endpoints
    engine = publisher(pub, replay, "engine-a")
    try:
        for batch in (stored(0, 1), stored(2), removed(0), stored(3)):
            engine.publish(batch)
        await asyncio.sleep(0.3)
        index = KVIndex()
        listener = listener_for(index, {"engine-a": replay}.get)
        listener.follow("engine-a", pub)  # registered before the router started: followed at start
        listener.start()
        try:
            await until(lambda: index.expected_seq("engine-a") == 4)
            assert index.num_blocks("engine-a") == 3
            assert index.match([1, 2, 3]) == {"engine-a": 3} and index.match([0]) == {}
            await asyncio.sleep(0.5)  # let the SUB side connect
            engine.publish(stored(4))  # the live stream goes on where the replay ended
            await until(lambda: index.match([1, 2, 3, 4]) == {"engine-a": 4})
            assert listener.resyncs == 0
        finally:
            await listener.stop()
    finally:
        engine.shutdown()


async def test_a_gap_that_cannot_be_replayed_resyncs_the_holder(endpoints):
    _, replay = endpoints
    index = KVIndex()
    index.stored("engine-b", [42])
    index.apply_batch("engine-b", 0, lambda: None)
    import msgspec

    listener = listener_for(index, {"engine-b": replay}.get, replay_timeout_s=0.2)  # nothing answers there
    await listener.receive("engine-b", 5, msgspec.msgpack.encode(stored(7)))
    assert listener.resyncs == 1
    assert index.match([42]) == {}  # stale entries from before the gap are gone
    assert index.match([7]) == {"engine-b": 1}
    assert index.expected_seq("engine-b") == 6


async def test_blocks_an_engine_saved_to_the_store_are_indexed_as_the_stores(endpoints):
    import msgspec

    from kvstore import STORE_MEDIUM
    from router.kv_event_listener import STORE_HOLDER

    index = KVIndex()
    listener = listener_for(index, {"prefill-0": endpoints[1]}.get)
    await listener.receive("prefill-0", 0, msgspec.msgpack.encode(stored(1, 2)))
    await listener.receive("prefill-0", 1, msgspec.msgpack.encode(stored(1, 2, medium=STORE_MEDIUM)))
    assert index.match([1, 2]) == {"prefill-0": 2, STORE_HOLDER: 2}
    await listener.receive("prefill-0", 2, msgspec.msgpack.encode(cleared()))  # the engine's cache only
    assert index.match([1, 2]) == {STORE_HOLDER: 2}


async def test_an_instance_that_leaves_while_its_history_is_replayed_leaves_no_entries():
    """The replay's answer arrives after the instance left (the registry removed it, the index
    forgot it): applying it would bring back entries of an instance the router no longer has."""
    known = {"engine-a": "tcp://127.0.0.1:1"}
    index = KVIndex()
    listener = listener_for(index, known.get)
    answered = asyncio.Event()

    async def slow_replay(holder: str, start: int):
        await answered.wait()
        return [(0, stored(1, 2))]

    listener._replay = slow_replay
    catching_up = asyncio.create_task(listener.catch_up("engine-a"))
    await asyncio.sleep(0.05)
    known.pop("engine-a")  # removed meanwhile (router/app.py: the index forgets it too)
    index.remove_holder("engine-a")
    answered.set()
    await catching_up
    assert index.match([1, 2]) == {} and index.holders() == []


def test_blinding_leaves_only_routing_fields_on_any_vllms_event():
    """Our publisher sends a stored block's hash, place and cache group, and every other field
    of vLLM's BlockStored blank, as the installed vLLM defines the event: vLLM 0.26 (the `gpu`
    extra) has no `session_id`, and blanking it by name raised inside the engine core at its
    first stored block, killing every engine with KV events on the H200 (found there by
    loadtest.engine_extras); a field a later vLLM adds goes out blank too."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored

    from engine.kv_event_publisher import _blinded, blanked_fields

    class BlockStoredOfSomeVllm(msgspec.Struct):  # a stand-in: 0.26's shape, and a field to come
        block_hashes: list[int]
        token_ids: list[int]
        prompt_text: str
        extra_keys: list | None = None

    assert blanked_fields(BlockStoredOfSomeVllm) == {"token_ids": [], "prompt_text": "", "extra_keys": None}
    secret = {"token_ids": list(range(64)), "extra_keys": [("salt",), ("salt",)]}
    if "session_id" in BlockStored.__struct_fields__:
        secret["session_id"] = "tenant-a-session"
    stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, block_size=32, lora_id=None, medium="GPU",
                         lora_name=None, **secret)
    blinded = _blinded(stored)
    assert all(getattr(blinded, name) in ([], None) for name in secret)
    assert (blinded.block_hashes, blinded.block_size, blinded.medium) == ([1, 2], 32, "GPU")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(blinded), type=BlockStored)  # as a router reads it
    assert decoded.block_hashes == [1, 2] and decoded.token_ids == []


def test_the_publisher_reports_what_publishing_cost_the_loop(endpoints, monkeypatch, capsys):
    """With KV_EVENTS_COST_ENV set, our publisher prints its cost (loadtest/engine_extras.py reads
    it on the H200, where A/B throughput is too noisy for a 2% bound): the batches, the time in
    `publish`, and the CPU time of its sending thread and of the thread that publishes, from the
    first batch on."""
    import json

    from engine import kv_event_publisher
    from engine.environment import KV_EVENTS_COST_MARK

    monkeypatch.setattr(kv_event_publisher, "_COST_INTERVAL_S", 0.0)  # as the variable would set it: every batch
    engine = publisher(*endpoints, topic="cost")
    try:
        engine.publish(stored(1))
        busy_until = time.thread_time() + 0.2  # the loop's own work between batches
        while time.thread_time() < busy_until:
            pass
        for k in range(2, 6):
            engine.publish(stored(k))
    finally:
        engine.shutdown()
    reports = [json.loads(line.split(KV_EVENTS_COST_MARK, 1)[1])
               for line in capsys.readouterr().out.splitlines() if KV_EVENTS_COST_MARK in line]
    last = reports[-1]
    assert len(reports) == 5 and last["batches"] == 5
    assert 0.18 <= last["loop_cpu_s"] <= last["wall_s"] + 0.05
    assert 0 < last["publish_s"] < last["wall_s"] and last["sender_cpu_s"] >= 0


@pytest.mark.parametrize(("value", "seconds"), [("0.5", 0.5), ("0", 0.0), ("", None), ("half a second", None),
                                                ("-1", None), (None, None)])
def test_a_bad_cost_interval_is_ignored_not_raised(monkeypatch, value, seconds):
    """The variable is read when vLLM imports our plugin in the engine core: raising there would
    leave vLLM's own publisher, which serves token ids, in our place."""
    from engine.environment import KV_EVENTS_COST_ENV
    from engine.kv_event_publisher import cost_interval_s

    if value is None:
        monkeypatch.delenv(KV_EVENTS_COST_ENV, raising=False)
    else:
        monkeypatch.setenv(KV_EVENTS_COST_ENV, value)
    assert cost_interval_s() == seconds
