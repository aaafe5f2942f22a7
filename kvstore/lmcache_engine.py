"""LMCache engines for the two halves of the KV connector, configured in one place.

Both halves key chunks the same way: LMCache's chunk hashes over the token ids (with the
engine's own prefix-cache hash, seeded by PYTHONHASHSEED, set alike in every engine), prefixed by
a model tag that also names the KV layout (block shape, dtype, CPU ISA) and by the engine's
tensor-parallel size and the writer's rank (LMCache's world size and worker id): a chunk is only
ever loaded by the same rank of an engine that lays KV out the way its writer did. The scheduler
looks up rank 0's chunks for all ranks (they save together); a rank that then finds fewer loads
what it can and vLLM recomputes the rest (`kv_load_failure_policy`). The worker half copies whole blocks
with `PagedBlockConnector` (on the CPU build and on CUDA); the scheduler half only looks up (no
KV memory).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import uuid
from collections.abc import Callable

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from kvstore.lmcache_plugin import PLUGIN_NAME
from kvstore.settings import StoreSettings

CHUNK_TOKENS = 256  # LMCache's chunk: the unit of a store key (whole KV blocks of any block size we use)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_shape: tuple[int, ...]  # one layer's block, as vLLM allocates it (a rank's KV heads)
    tensor_parallel_size: int = 1

    def tag(self, model: str) -> str:
        isa = torch.backends.cpu.get_cpu_capability() if not torch.cuda.is_available() else "cuda"
        shape = "x".join(map(str, self.block_shape))
        return f"{model.replace('@', '_')}|{str(self.dtype).removeprefix('torch.')}|{shape}|{isa}"


def build_engine(
    settings: StoreSettings,
    layout: KVLayout,
    model: str,
    gpu_connector: Callable[[LMCacheEngineConfig, LMCacheMetadata], object] | None,
    hash_algorithm: str,
    rank: int = 0,
) -> LMCacheEngine:
    """A worker's engine, whose `gpu_connector(config, metadata)` builds the KV copier, or without
    one the scheduler's lookup-only engine (LMCache's own scheduler role builds no storage, so it
    too is a worker to LMCache, with a token-sized buffer).

    `hash_algorithm` must be the vLLM engine's own (`prefix_caching_hash_algo`): LMCache re-seeds
    vLLM's prefix-hash root (`kv_cache_utils.init_none_hash`) with it in this process, and any
    other algorithm would change every block hash vLLM computes from then on (its own prefix
    cache, its KV events, and so the router's index would no longer match them). `rank`: the
    worker's tensor-parallel rank, in every key it names."""
    config = LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK_TOKENS,
        "local_cpu": False,  # the store shard is the host-memory tier
        "max_local_cpu_size": settings.transfer_buffer_gib if gpu_connector else 0.01,
        "save_unfull_chunk": True,
        "pre_caching_hash_algorithm": hash_algorithm,
        # LMCache's own wait on a remote call, in whole seconds. It starts before ours, which has
        # a deadline per call and per batch, and spans the client's lock: twice ours and a second
        # lets ours decide a read of one batch even behind another (LMCache's firing first cancelled
        # a read whose thread went on holding the client). It bounds the scheduler's lookups too.
        "blocking_timeout_secs": math.ceil(2 * settings.timeout_s) + 1,
        "remote_storage_plugins": [PLUGIN_NAME],
        "extra_config": {
            f"remote_storage_plugin.{PLUGIN_NAME}.module_path": "kvstore.lmcache_plugin",
            f"remote_storage_plugin.{PLUGIN_NAME}.class_name": "ShardConnectorAdapter",
            "pdc_store.settings": settings.as_extra(),
            "save_chunk_meta": False,
        },
    })
    metadata = LMCacheMetadata(
        model_name=layout.tag(model), world_size=layout.tensor_parallel_size,
        local_world_size=layout.tensor_parallel_size, worker_id=rank, local_worker_id=rank,
        kv_dtype=layout.dtype, kv_shape=(layout.num_layers, 2, CHUNK_TOKENS, layout.kv_heads,
                                         layout.head_dim),
        role="worker", chunk_size=CHUNK_TOKENS,
    )
    name = f"pdc-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(
        name, config, metadata, gpu_connector(config, metadata) if gpu_connector else None,
        lambda tensor, src: tensor, lambda obj, src: obj,
    )
    engine.post_init()
    _built_names[id(engine)] = name
    return engine


_built_names: dict[int, str] = {}  # LMCacheEngineBuilder's name of each engine built here, by id


def close_engine(engine: LMCacheEngine) -> None:
    """Close `engine` and stop the stats-logger thread LMCache's builder started for it, which
    `engine.close()` leaves running (every 10 s it adds the engine's hit counts into tensors, and
    once did so while a test process was finalizing: the process aborted). Through the builder's
    `destroy`, which closes the engine once (closing it again may wait on its store connection),
    logs rather than raises what closing it raised, and resets LMCache's stats monitor, which every
    engine of the process shares: for an engine's end, not while others still serve."""
    LMCacheEngineBuilder.destroy(_built_names.pop(id(engine)))


_reconnecting: set[int] = set()  # remote backends a thread is reconnecting now (by id)
_reconnecting_lock = threading.Lock()


def reconnect_if_lost(engine: LMCacheEngine) -> None:
    """Reconnect, on a thread of its own, each of `engine`'s store backends whose connection is
    lost. LMCache retries a failed connection only from its health monitor, which an engine built
    here (no LMCacheManager) does not run: a shard slow to answer the first hello (two loaded
    cores at an engine's first request) left that engine without the store for good, every
    lookup a miss. Called on every lookup, load and save: cheap while connected; never blocks
    (a hello may take the store's timeout twice); LMCache's own 10 s between tries are kept."""
    for backend in engine.storage_manager.storage_backends.values():
        if not isinstance(backend, RemoteBackend) or backend.connection is not None:
            continue
        with _reconnecting_lock:
            if id(backend) in _reconnecting:
                continue
            _reconnecting.add(id(backend))
        threading.Thread(target=_reconnect, args=(backend,), daemon=True, name="pdc-store-reconnect").start()


def _reconnect(backend: RemoteBackend) -> None:
    try:
        time.sleep(max(0.0, backend.failure_time + backend.min_reconnect_interval - time.time()))
        backend.init_connection()  # a failure is logged by LMCache and retried at the next call
    finally:
        with _reconnecting_lock:
            _reconnecting.discard(id(backend))

