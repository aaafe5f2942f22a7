"""The KV connector's parts without a vLLM engine: the block copier between paged KV caches and
LMCache memory objects, and LMCache's engine storing through our plugin into a real shard and a
second engine loading the same blocks back (what the prefill and decode workers do)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import types

import pytest
import torch

from kvstore.connector_types import SaveResults, salted, usable_tokens
from kvstore.lmcache_engine import KVLayout, build_engine, close_engine
from kvstore.paged_blocks import PagedBlockConnector
from kvstore.settings import StoreSettings
from kvstore.shard import ShardServer
from security.credentials import ClusterCredentials
from transport.zmq_curve import STORE_PLANE

CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)
KEYS = CREDENTIALS.curve(STORE_PLANE)
VLLM_HASH = "sha256"  # vLLM's default prefix_caching_hash_algo, as an engine passes it

LAYERS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 4, 2, 64, 32, 48


@pytest.fixture(autouse=True)
def no_engine_thread_outlives_its_test():
    """Each LMCache engine a test builds is closed with the stats-logger thread LMCache's builder
    started for it: one left running aborted a whole test run at its end (session 27's CI)."""
    yield
    assert not [t for t in threading.enumerate() if t.name == "stats-logger-thread"]


def caches(seed: int | None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed or 0)
    shape = (BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM)  # one layer as vLLM's CPU build allocates it
    return [(torch.randn(shape, generator=generator) if seed is not None else torch.zeros(shape)).to(torch.bfloat16)
            for _ in range(LAYERS)]


def slots(block_ids: list[int], tokens: int) -> torch.Tensor:
    blocks = torch.tensor(block_ids)
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:tokens]


def test_usable_tokens_are_whole_blocks_and_never_the_last_token():
    assert [usable_tokens(n, 32) for n in (1, 32, 33, 64, 65, 100)] == [0, 0, 32, 32, 64, 96]


def test_blocks_round_trip_and_a_load_leaves_already_computed_blocks_alone():
    source, target = caches(1), caches(None)
    copier = PagedBlockConnector(LAYERS, BLOCK, KV_HEADS * HEAD_DIM)
    chunk = types.SimpleNamespace(tensor=torch.empty(copier.get_shape(4 * BLOCK), dtype=torch.bfloat16))
    copier.bind(source)
    copier.from_gpu(chunk, 0, 4 * BLOCK, slot_mapping=slots([5, 9, 2, 30], 4 * BLOCK))
    copier.bind(target)
    copier.to_gpu(chunk, 0, 4 * BLOCK, slot_mapping=slots([1, 2, 3, 4], 4 * BLOCK), vllm_cached_tokens=BLOCK)
    for layer in range(LAYERS):
        assert torch.equal(target[layer][[2, 3, 4]], source[layer][[9, 2, 30]])
        assert not target[layer][1].any()  # skipped: vLLM had computed it
    with pytest.raises(ValueError, match="whole blocks"):
        copier.from_gpu(chunk, 0, BLOCK + 1, slot_mapping=slots([5, 9], BLOCK + 1))


@pytest.mark.slow  # a process or engine of its own: ~3 s
def test_a_prompt_stored_by_one_engine_is_loaded_bit_identical_by_another(monkeypatch):
    monkeypatch.setenv(*CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").as_env().popitem())  # as an engine's host sets them
    shard = ShardServer(64 * 1024**2, KEYS, page_bytes=64 * 1024)
    engines = []
    try:
        settings = StoreSettings(endpoints=(shard.endpoint,), timeout_s=5.0)
        layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, (KV_HEADS, BLOCK, 2 * HEAD_DIM))
        writer_caches, reader_caches = caches(2), caches(None)
        writer_blocks = PagedBlockConnector(LAYERS, BLOCK, KV_HEADS * HEAD_DIM)
        writer_blocks.bind(writer_caches)
        reader_blocks = PagedBlockConnector(LAYERS, BLOCK, KV_HEADS * HEAD_DIM)
        reader_blocks.bind(reader_caches)
        engines.append(writer := build_engine(settings, layout, "tiny", lambda config, metadata: writer_blocks,
                                              VLLM_HASH))
        engines.append(reader := build_engine(settings, layout, "tiny", lambda config, metadata: reader_blocks,
                                              VLLM_HASH))
        engines.append(lookup := build_engine(settings, layout, "tiny", None, VLLM_HASH))
        tokens = list(range(1000, 1000 + 13 * BLOCK + 5))  # a full 256-token chunk and a partial one
        usable = usable_tokens(len(tokens), BLOCK)
        writer.store(tokens[:usable], slot_mapping=slots(list(range(10, 23)), usable))
        from kvstore.lmcache_plugin import flush_all

        assert flush_all(10.0)
        assert shard.stats().chunks == 2
        assert lookup.lookup(tokens[:usable]) == usable
        loaded = reader.retrieve(tokens[:usable], slot_mapping=slots(list(range(30, 43)), usable))
        assert int(loaded.sum()) == usable
        for layer in range(LAYERS):
            assert torch.equal(reader_caches[layer][30:43], writer_caches[layer][10:23])
        engines.append(build_engine(settings, layout, "another-model", None, VLLM_HASH))
        assert engines[-1].lookup(tokens[:usable]) == 0  # keys carry the model and layout
    finally:
        for engine in engines:
            close_engine(engine)
        shard.close()


@pytest.mark.slow  # a process or engine of its own: ~3 s
def test_lmcache_buffers_a_stranded_read_may_still_fill_go_back_only_once_it_ends(monkeypatch):
    """A store read still in flight past its deadline (a stand-in stalls it: tests/unit/
    test_store_shard.py `stall_reads`) is a miss, and the LMCache buffers it may still land in
    stay taken until the store client has seen it end; then they go back."""
    from test_store_shard import stall_reads

    from kvstore.lmcache_plugin import ShardRemoteConnector, flush_all

    monkeypatch.setenv(*CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").as_env().popitem())
    shard = ShardServer(64 * 1024**2, KEYS, page_bytes=64 * 1024)
    settings = StoreSettings(endpoints=(shard.endpoint,), timeout_s=0.5)
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, (KV_HEADS, BLOCK, 2 * HEAD_DIM))
    blocks = PagedBlockConnector(LAYERS, BLOCK, KV_HEADS * HEAD_DIM)
    blocks.bind(caches(5))
    known = len(ShardRemoteConnector.live)
    engine = build_engine(settings, layout, "tiny", lambda config, metadata: blocks, VLLM_HASH)
    try:
        connector = ShardRemoteConnector.live[known]
        tokens = list(range(5000, 5000 + 4 * BLOCK + 1))
        usable = usable_tokens(len(tokens), BLOCK)
        engine.store(tokens[:usable], slot_mapping=slots(list(range(4)), usable))
        assert flush_all(10.0)
        keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens[:usable])]
        allocator = connector.local_cpu_backend.memory_allocator.pin_allocator
        idle, release = allocator.num_active_allocations, stall_reads(monkeypatch)

        def get() -> list:
            return asyncio.run_coroutine_threadsafe(connector.batched_get(keys), connector.loop).result(30)

        assert get() == [None] * len(keys) and connector.misses_from_errors == 1
        time.sleep(0.3)
        assert allocator.num_active_allocations > idle  # kept: the read may still land in them
        release.set()
        landed = get()  # the client sees the stranded read ended before this one
        assert None not in landed
        for memory_object in landed:  # what LMCache would do with a read's answer once used
            memory_object.ref_count_down()
        deadline = time.monotonic() + 10
        while allocator.num_active_allocations != idle:  # the stranded read's buffers given back
            assert time.monotonic() < deadline, (allocator.num_active_allocations, idle)
            time.sleep(0.05)
    finally:
        close_engine(engine)
        shard.close()


@pytest.mark.slow  # a process or engine of its own: ~3 s
def test_a_read_lmcache_stopped_waiting_for_gives_its_buffers_back_once_it_ends(monkeypatch):
    """LMCache cancels a remote get it has stopped waiting for (its `blocking_timeout_secs`), while
    the read's thread goes on and fills buffers nobody takes: they go back to LMCache once it ends
    (they leaked, one transfer buffer per abandoned read)."""
    from kvstore.lmcache_plugin import ShardRemoteConnector, flush_all

    monkeypatch.setenv(*CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").as_env().popitem())
    shard = ShardServer(64 * 1024**2, KEYS, page_bytes=64 * 1024)
    settings = StoreSettings(endpoints=(shard.endpoint,), timeout_s=5.0)
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, (KV_HEADS, BLOCK, 2 * HEAD_DIM))
    writer_blocks, reader_blocks = (PagedBlockConnector(LAYERS, BLOCK, KV_HEADS * HEAD_DIM) for _ in range(2))
    writer_blocks.bind(caches(4))
    reader_blocks.bind(caches(None))
    engines = [build_engine(settings, layout, "tiny", lambda config, metadata: writer_blocks, VLLM_HASH)]
    try:
        known = len(ShardRemoteConnector.live)
        engines.append(build_engine(settings, layout, "tiny", lambda config, metadata: reader_blocks, VLLM_HASH))
        connector = ShardRemoteConnector.live[known]
        tokens = list(range(3000, 3000 + 16 * BLOCK + 1))
        usable = usable_tokens(len(tokens), BLOCK)
        engines[0].store(tokens[:usable], slot_mapping=slots(list(range(16)), usable))
        assert flush_all(10.0)
        keys = [key for _, _, key in engines[1].token_database.process_tokens(tokens=tokens[:usable])]
        allocator = connector.local_cpu_backend.memory_allocator.pin_allocator
        idle, allocated, allocate = allocator.num_active_allocations, [], connector.local_cpu_backend.allocate
        monkeypatch.setattr(connector.local_cpu_backend, "allocate",  # a spy: counts, changes nothing
                            lambda *args, **kwargs: allocated.append(1) or allocate(*args, **kwargs))
        (client,) = connector.client.shards.values()
        with client._lock:  # another read holds the client: this one waits in its thread
            reading = asyncio.run_coroutine_threadsafe(connector.batched_get(keys), connector.loop)
            time.sleep(0.3)
            reading.cancel()  # as LMCache does once its own wait runs out
        deadline = time.monotonic() + 10
        while len(allocated) < len(keys) or allocator.num_active_allocations != idle:  # landed, then given back
            assert time.monotonic() < deadline, (len(allocated), allocator.num_active_allocations, idle)
            time.sleep(0.05)
        assert connector.misses_from_errors == 0 and reading.cancelled()
    finally:
        for engine in engines:
            close_engine(engine)
        shard.close()


@pytest.mark.slow  # a process or engine of its own: ~3 s
def test_a_tensor_parallel_ranks_chunks_are_found_by_that_rank_of_that_size_alone(monkeypatch):
    """Each rank holds its own KV heads: a chunk rank 0 of a TP=2 engine stored must be found by
    rank 0 of a TP=2 engine, and by no other rank or size (it would load another rank's heads)."""
    monkeypatch.setenv(*CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").as_env().popitem())
    shard = ShardServer(64 * 1024**2, KEYS, page_bytes=64 * 1024)
    settings = StoreSettings(endpoints=(shard.endpoint,), timeout_s=5.0)
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, (KV_HEADS, BLOCK, 2 * HEAD_DIM), 2)
    blocks = PagedBlockConnector(LAYERS, BLOCK, KV_HEADS * HEAD_DIM)
    blocks.bind(caches(3))
    engines = [build_engine(settings, layout, "tiny", lambda config, metadata: blocks, VLLM_HASH, rank=0)]
    try:
        tokens = list(range(2000, 2000 + 8 * BLOCK + 1))
        usable = usable_tokens(len(tokens), BLOCK)
        engines[0].store(tokens[:usable], slot_mapping=slots(list(range(8)), usable))
        from kvstore.lmcache_plugin import flush_all

        assert flush_all(10.0)
        for size, rank, found in [(2, 0, usable), (2, 1, 0), (1, 0, 0)]:
            other = dataclasses.replace(layout, tensor_parallel_size=size)
            engines.append(build_engine(settings, other, "tiny", None, VLLM_HASH, rank=rank))
            assert engines[-1].lookup(tokens[:usable]) == found, (size, rank)
    finally:
        for engine in engines:
            close_engine(engine)
        shard.close()


def test_a_save_landed_only_where_every_tensor_parallel_rank_saved_its_heads():
    rank0, rank1 = SaveResults({"a": True, "b": True, "c": False}), SaveResults({"a": False, "b": True, "c": True})
    assert rank0.aggregate(rank1).landed == rank1.aggregate(rank0).landed == {"a": False, "b": True, "c": False}


def test_building_an_lmcache_engine_keeps_vllms_prefix_hash_root():
    """LMCache re-seeds vLLM's block-hash root in its process with its own hash algorithm; with
    any other than the engine's, every block hash after the first store lookup changed (seen:
    the router's index stopped matching the engines' KV events after their first request)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(get_hash_fn_by_name(VLLM_HASH))  # as vLLM's scheduler does
    root = kv_cache_utils.NONE_HASH
    shard = ShardServer(8 * 1024**2, KEYS, page_bytes=64 * 1024)
    settings = StoreSettings(endpoints=(shard.endpoint,), timeout_s=5.0)
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, (KV_HEADS, BLOCK, 2 * HEAD_DIM))
    engine = build_engine(settings, layout, "tiny", None, VLLM_HASH)
    try:
        assert kv_cache_utils.NONE_HASH == root
    finally:
        close_engine(engine)
        shard.close()


def scheduler_half(saves: bool = True):
    """The scheduler's half of a producer's connector (no lookups: not a consumer)."""
    from kvstore.connector_types import ConnectorSpec
    from kvstore.store_scheduler import StoreScheduler

    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, (KV_HEADS, BLOCK, 2 * HEAD_DIM))
    spec = ConnectorSpec(StoreSettings(endpoints=("tcp://127.0.0.1:9",)), BLOCK, "m", layout, VLLM_HASH,
                         saves=saves, loads=False)
    return StoreScheduler(spec)


def step(new=(), cached=(), scheduled=None):
    """vLLM's SchedulerOutput for one step, as far as the connector reads it (a stand-in: its
    real constructor takes thirty fields the connector never reads)."""
    cached_ids = [c[0] for c in cached]
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, block_ids=(blocks,), prompt_token_ids=prompt,
                                                  num_computed_tokens=0) for r, prompt, blocks in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=cached_ids, new_block_ids=[None] * len(cached),
                                                    num_computed_tokens=[c[1] for c in cached]),
        num_scheduled_tokens=scheduled or {})


HASHES = [bytes([k]) * 32 for k in (1, 2, 3)]  # vLLM's block hashes are bytes


def finished(request_id: str, prompt: list[int], asked: bool):
    return types.SimpleNamespace(request_id=request_id, cache_salt="tenant-salt", block_hashes=HASHES,
                                 all_token_ids=prompt, kv_transfer_params={"do_remote_decode": True} if asked else None)


def test_a_prompt_is_saved_in_the_step_that_completes_it_and_announced_once_it_landed():

    scheduler = scheduler_half()
    prompt = list(range(100))  # 3 whole blocks usable (the last token is never stored)
    scheduler.update_state_after_alloc(finished("r1", prompt, True), None, 0)
    first = scheduler.build_meta(step(new=[("r1", prompt, [4, 5, 6, 7])], scheduled={"r1": 64}))
    assert first.saves == []  # chunked prefill: 64 of 96 usable tokens computed
    second = scheduler.build_meta(step(cached=[("r1", 64)], scheduled={"r1": 36}))
    (save,) = second.saves
    assert (save.token_ids, save.block_ids) == (prompt[:96], [4, 5, 6, 7])
    assert save.request_configs == salted("tenant-salt")  # the tenant's salt goes into the keys
    done, params = scheduler.request_finished(finished("r1", prompt, asked=True), [4, 5, 6, 7])
    assert params == {"kv_via_store": True}
    assert scheduler.take_events() == []  # not before the worker says the save landed
    scheduler.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=SaveResults({"r1": True})))
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    (event,) = scheduler.take_events()
    assert event.block_hashes == [maybe_convert_block_hash(h) for h in HASHES] and event.token_ids == []


def test_a_save_that_did_not_land_is_never_announced_and_clients_get_no_transfer_params():
    from kvstore.connector_types import SaveResults

    scheduler = scheduler_half()
    prompt = list(range(70))
    scheduler.update_state_after_alloc(finished("r2", prompt, False), None, 0)
    scheduler.build_meta(step(new=[("r2", prompt, [1, 2, 3])], scheduled={"r2": 70}))
    scheduler.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=SaveResults({"r2": False})))
    assert scheduler.request_finished(finished("r2", prompt, asked=False), [1, 2, 3]) == (False, None)
    assert scheduler.take_events() == []


@pytest.mark.slow  # a shard and an engine of its own: ~5 s
def test_an_engine_whose_shard_did_not_answer_at_first_finds_the_store_once_it_does(monkeypatch):
    """A shard too slow for the first hello (two loaded cores, an engine's first request) left the
    engine's store connection lost for good, every lookup a miss (a CI run of
    tests/e2e/test_pd_migration.py, session 27): LMCache retries only from a health monitor our
    engines do not run. Each lookup now has it reconnect, on a thread, at LMCache's pace."""
    from engine.environment import free_port
    from kvstore.lmcache_engine import reconnect_if_lost

    monkeypatch.setenv(*CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").as_env().popitem())
    port = free_port("127.0.0.1")
    settings = StoreSettings(endpoints=(f"tcp://127.0.0.1:{port}",), timeout_s=0.5)  # nothing answers yet
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, (KV_HEADS, BLOCK, 2 * HEAD_DIM))
    engines = [lookup := build_engine(settings, layout, "tiny", None, VLLM_HASH)]
    shard = None
    try:
        (backend,) = [b for b in lookup.storage_manager.storage_backends.values() if hasattr(b, "connection")]
        assert backend.connection is None
        backend.min_reconnect_interval = 0.5  # LMCache's 10 s, shortened for the test
        shard = ShardServer(64 * 1024**2, KEYS, page_bytes=64 * 1024, port=port)
        tokens = list(range(3000, 3000 + 8 * BLOCK + 1))
        deadline = time.monotonic() + 30
        while backend.connection is None:
            assert time.monotonic() < deadline, "never reconnected"
            reconnect_if_lost(lookup)
            time.sleep(0.1)
        writer_blocks = PagedBlockConnector(LAYERS, BLOCK, KV_HEADS * HEAD_DIM)
        writer_blocks.bind(caches(4))
        engines.append(writer := build_engine(settings, layout, "tiny", lambda config, metadata: writer_blocks,
                                              VLLM_HASH))
        usable = usable_tokens(len(tokens), BLOCK)
        writer.store(tokens[:usable], slot_mapping=slots(list(range(8)), usable))
        from kvstore.lmcache_plugin import flush_all

        assert flush_all(10.0)
        assert lookup.lookup(tokens[:usable]) == usable  # the store, found through the new connection
    finally:
        for engine in engines:
            close_engine(engine)
        if shard is not None:
            shard.close()
