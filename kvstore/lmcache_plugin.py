"""The store shards as an LMCache remote storage plugin.

LMCache loads `ShardConnectorAdapter` from `extra_config` (`remote_storage_plugin.pdc_store.*`,
set by kvstore/lmcache_engine.py) and asks it for a `RemoteConnector`; LMCache keeps doing the
chunking, the prefix hashing, the lookups and its local CPU tier, and calls this connector for
the remote tier. Every failure of the store is a miss for LMCache (its own contract: a remote
that cannot answer returns None), counted in `misses_from_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import numpy as np
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore.settings import StoreSettings
from kvstore.shard_client import ReadInFlight
from kvstore.shard_control import StoreUnavailable
from kvstore.sharded_store import ShardedStore
from security.credentials import EngineKeys
from transport.nixl import NixlTransferError

log = logging.getLogger(__name__)
PLUGIN_NAME = "pdc_store"
_STORE_ERRORS = (StoreUnavailable, NixlTransferError)


def _free(memory_objects: list, abandoned_read: asyncio.Future | None = None) -> None:
    """Give LMCache its buffers back (those of `abandoned_read`, a read nobody waits for any more,
    once it is done: a store failure is a miss nobody is told of, anything else is logged)."""
    if abandoned_read is not None:
        if abandoned_read.cancelled():  # its thread may still write into them (loop shutdown): kept
            return
        failure = abandoned_read.exception()
        if isinstance(failure, ReadInFlight):
            _free_once_ended(memory_objects, failure, abandoned_read.get_loop())
            return
        if failure is not None and not isinstance(failure, _STORE_ERRORS):
            log.error("an abandoned store read failed", exc_info=failure)
    for memory_object in memory_objects:
        memory_object.ref_count_down()


def _free_once_ended(memory_objects: list, read: ReadInFlight, loop: asyncio.AbstractEventLoop) -> None:
    """Give LMCache the buffers of `read` (still in flight past its deadline: UCX may still write
    into them) on `loop`, once the store client has seen it end."""

    def ended(_) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nothing to give back to
            loop.call_soon_threadsafe(_free, memory_objects)

    read.ended.add_done_callback(ended)


class ShardConnectorAdapter(ConnectorAdapter):
    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_NAME}")

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return ShardRemoteConnector(context)


class ShardRemoteConnector(RemoteConnector):
    """LMCache's remote tier on a store shard. Puts run on LMCache's event loop; `flush` lets the
    KV connector wait for them before it reports a prefill's KV as ready."""

    live: list[ShardRemoteConnector] = []  # this process's connectors, for `flush_all`

    def __init__(self, context: ConnectorContext):
        super().__init__(context.config, context.metadata)
        extra = context.config.extra_config or {}
        self.loop = context.loop
        self.local_cpu_backend = context.local_cpu_backend
        settings = StoreSettings.from_extra(extra["pdc_store.settings"])
        self.client = ShardedStore(settings, EngineKeys.load().store)  # the engine's: a client's keys only
        buffer = getattr(self.local_cpu_backend.memory_allocator, "buffer", None)
        if buffer is not None and buffer.numel() and buffer.device.type == "cpu":
            # Chunks move straight between LMCache's memory objects and the store.
            self.client.register_caller_memory(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        self.misses_from_errors = 0
        self.unlanded = 0  # puts that left a chunk unstored (an error, no room, a timeout)
        self._pending = 0
        self._idle = threading.Condition()
        ShardRemoteConnector.live.append(self)

    # --- lookups ---------------------------------------------------------------------------
    async def exists(self, key) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key) -> bool:
        return self.batched_contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys) -> int:
        try:
            return self.client.contains([k.to_string() for k in keys])
        except _STORE_ERRORS as exc:
            self.misses_from_errors += 1
            log.warning("store lookup failed, treated as a miss: %s", exc)
            return 0

    async def batched_async_contains(self, lookup_id: str, keys, pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, keys)

    # --- reads -----------------------------------------------------------------------------
    async def get(self, key):
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys):
        allocated: list = []

        def allocate(nbytes: int):
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            if obj is None:
                raise StoreUnavailable("LMCache has no free buffer for a chunk")
            allocated.append(obj)
            return np.frombuffer(obj.byte_array, dtype=np.uint8)[:nbytes], self.reshape_partial_chunk(
                obj, nbytes
            )

        reading = asyncio.ensure_future(asyncio.to_thread(self.client.get, [k.to_string() for k in keys], allocate))
        try:
            objects = await asyncio.shield(reading)
        except asyncio.CancelledError:
            # LMCache stopped waiting; the thread goes on filling buffers nobody will take: each is
            # freed once it is done. (Cancelled after this returned, its result is dropped unfreed:
            # a window of one loop turn that LMCache's API leaves.)
            reading.add_done_callback(lambda done: _free(allocated, done))
            raise
        except _STORE_ERRORS as exc:
            self.misses_from_errors += 1
            log.warning("store read failed, treated as a miss: %s", exc)
            if isinstance(exc, ReadInFlight):
                _free_once_ended(allocated, exc, asyncio.get_running_loop())
                return [None] * len(keys)
            objects = []
        _free(allocated[len(objects) :])  # landed but not returned: a damaged chunk's buffer
        return objects + [None] * (len(keys) - len(objects))

    # --- writes ----------------------------------------------------------------------------
    async def put(self, key, memory_obj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys, memory_objs) -> None:
        with self._idle:
            self._pending += 1
        try:
            payloads = [np.frombuffer(o.byte_array, dtype=np.uint8) for o in memory_objs]
            names = [k.to_string() for k in keys]
            written = await asyncio.to_thread(self.client.put, names, payloads)
            # Keys already stored are skipped, not lost: count only what the store lacks.
            if written < len(names) and await asyncio.to_thread(self.client.contains, names) < len(names):
                self.unlanded += 1
        except _STORE_ERRORS as exc:
            self.unlanded += 1
            log.warning("store write failed; the chunks stay uncached: %s", exc)
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until no put is in flight; False if `timeout_s` passed first. Puts are started on
        LMCache's loop in submission order: once a no-op queued now has run, every put submitted
        before it has registered itself as pending."""

        async def barrier() -> None:
            return None

        try:
            asyncio.run_coroutine_threadsafe(barrier(), self.loop).result(timeout_s)
        except TimeoutError:
            return False
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    async def list(self):
        return []

    async def close(self) -> None:
        if self in ShardRemoteConnector.live:
            ShardRemoteConnector.live.remove(self)
        await asyncio.to_thread(self.client.close)  # it may wait for reads in flight: not on LMCache's loop


def flush_all(timeout_s: float) -> bool:
    return all(connector.flush(timeout_s) for connector in list(ShardRemoteConnector.live))


def unlanded_puts() -> int:
    """Puts of this process's connectors that left chunks unstored, so far."""
    return sum(connector.unlanded for connector in list(ShardRemoteConnector.live))
