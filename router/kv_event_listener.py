"""Feeding the KV index from vLLM's KV events.

Every engine runs vLLM's own publisher (`--kv-events-config`; engine/kv_event_publisher.py puts it on the
cluster's CURVE keys and strips token ids): a PUB socket with the instance id as topic and a
replay ROUTER socket, both bound on the engine's address as CURVE servers. The router's one SUB
socket connects to every engine it knows (`follow`, as instances are registered) with the plane's
client key, so every router of a cluster keeps its own index from the same events, and one
router more is one subscriber more, not a change to any engine. A message that fails in any way (it does not decode, names an instance the
router does not know, carries a sequence number no publisher sends, or raises while applied) is
dropped and counted, never fatal; should the listening task itself fail (its socket), it is
logged and listens again.

Each batch carries a sequence number. A gap (a slow joiner, a dropped message, a restarted
engine) triggers a replay from the engine's buffer; if the replay cannot cover the gap the
holder's entries are cleared and rebuilt from the next events, since stale entries are worse
than none. A router that follows an engine that already serves (a restart, a second router, an
engine registered while it publishes) replays that engine's buffer from the start, so its index
holds what the engine holds before the next request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from kvstore import STORE_MEDIUM
from router import metrics
from router.kv_index import KVIndex
from security.credentials import CurveKeys
from transport.zmq_curve import connect_curve

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVEventBatch

log = logging.getLogger(__name__)
END_SEQ = -1
MAX_SEQ = 2**53
"""Sequence numbers are below this: vLLM counts an engine's batches from 0, one per step at most,
so no engine comes near it (centuries at 1,000 steps/s). A larger one is forged or corrupt, and
applying it would freeze the holder's entries (every real batch after it would look applied)."""
STORE_HOLDER = "kv-store"
"""The index holder for blocks in the KV store (one for all shards: every instance reads all)."""


class KVEventListener:
    """Owns the SUB socket, its task, and the replay sockets it opens."""

    def __init__(
        self,
        index: KVIndex,
        replay_endpoint_of: Callable[[str], str | None],
        keys: CurveKeys,
        replay_timeout_s: float = 1.0,
        restart_delay_s: float = 1.0,
    ) -> None:
        """`replay_endpoint_of`: an instance's replay socket, None for one the router does not
        know, whose messages are dropped (a departed instance's late batches must not bring its
        entries back; an engine's batches from before it was registered are replayed later, at
        its first batch after). `restart_delay_s`: the pause before listening again after the
        listening task failed."""
        from vllm.distributed.kv_events import KVEventBatch

        self.index = index
        self.keys = keys
        self.replay_endpoint_of = replay_endpoint_of
        self.replay_timeout_s = replay_timeout_s
        self.restart_delay_s = restart_delay_s
        self.batches_applied = 0
        self.resyncs = 0
        self.restarts = 0
        """Times the listening task failed and was started again."""
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._context = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._followed: dict[str, str] = {}  # holder -> its PUB endpoint

    def start(self) -> None:
        """Listen to every engine followed so far, catching up on their history."""
        self._socket = self._open_socket()
        self._listen(delay_s=0.0)
        for holder in self._followed:
            self._catch_up_later(holder)

    def _open_socket(self) -> zmq.asyncio.Socket:
        """The SUB socket, connected to every engine followed."""
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.MAXMSGSIZE, 64 * 1024**2)
        connect_curve(socket, self.keys)
        for endpoint in self._followed.values():
            socket.connect(endpoint)
        return socket

    def follow(self, holder: str, endpoint: str | None) -> None:
        """Subscribe to `holder`'s events at `endpoint` (None: it publishes none) and catch up on
        what its buffer holds; before `start()`, once listening."""
        if endpoint is None or holder in self._followed:
            return
        self._followed[holder] = endpoint
        if self._socket is not None:
            self._socket.connect(endpoint)
            self._catch_up_later(holder)

    def unfollow(self, holder: str) -> None:
        endpoint = self._followed.pop(holder, None)
        if endpoint is not None and self._socket is not None:
            try:
                self._socket.disconnect(endpoint)
            except zmq.ZMQError:  # never connected
                pass

    def _catch_up_later(self, holder: str) -> None:
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(self.catch_up(holder), name=f"kv-catch-up-{holder}"))

    def _listen(self, delay_s: float) -> None:
        task = asyncio.create_task(self._run(delay_s), name="kv-event-listener")
        task.add_done_callback(self._restart_if_failed)
        self._tasks = [t for t in self._tasks if not t.done()] + [task]

    def _restart_if_failed(self, task: asyncio.Task[None]) -> None:
        """A listener that stopped by itself would leave the index following nothing, silently."""
        if self._stopping or task.cancelled():
            return
        self.restarts += 1
        log.error("the KV event listener failed; listening again in %g s", self.restart_delay_s,
                  exc_info=task.exception())
        if self._socket is not None:  # a new socket: the old one may be what failed
            self._socket.close(linger=0)
        self._socket = self._open_socket()
        self._listen(self.restart_delay_s)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket:
            self._socket.close(linger=0)
        self._context.term()

    async def _run(self, delay_s: float) -> None:
        assert self._socket is not None
        await asyncio.sleep(delay_s)
        while True:
            frames = await self._socket.recv_multipart()
            try:
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise ValueError(f"a KV event message of {len(frames)} frames")
                topic, seq_bytes, payload = frames
                await self.receive(topic.decode(), int.from_bytes(seq_bytes, "big", signed=True), payload)
            except Exception as exc:  # whatever one message does, it is dropped, never fatal
                metrics.KV_EVENTS_REJECTED.inc()
                log.warning("dropped a KV event message: %s: %s", type(exc).__name__, str(exc)[:200])

    async def receive(self, holder: str, seq: int, payload: bytes) -> None:
        """Apply one batch, replaying or resyncing first if batches were missed. A batch of a
        holder the router does not know, with a sequence number out of range, or that does not
        decode raises before anything is replayed or applied."""
        if self.replay_endpoint_of(holder) is None:
            raise ValueError(f"KV events of an instance the router does not know: {holder[:64]!r}")
        if not 0 <= seq < MAX_SEQ:
            raise ValueError(f"sequence number {seq} out of range")
        batch = self._decoder.decode(payload)
        if self._apply(holder, seq, batch):
            return
        await self.catch_up(holder, live_seq=seq)
        if self.replay_endpoint_of(holder) is not None:  # still registered after the replay's wait
            self._apply(holder, seq, batch)

    async def catch_up(self, holder: str, live_seq: int | None = None) -> None:
        """Apply what `holder`'s replay buffer holds beyond the index's last batch. If the buffer
        no longer reaches back that far (or, with `live_seq`, the batch just received is past a
        gap the replay cannot fill), forget the holder's entries and go on from the earliest
        batch there is."""
        expected = self.index.expected_seq(holder)
        replayed = await self._replay(holder, expected)
        if self.replay_endpoint_of(holder) is None:
            return  # it left while the replay ran: its entries must not come back
        first = replayed[0][0] if replayed else live_seq
        if first is not None and first != expected:
            self.resyncs += 1
            log.warning(
                "KV events of %s: batches %d..%d not replayable; resyncing", holder, expected, first - 1
            )
            self.index.resync(holder, first)
        for replay_seq, replay_batch in replayed:
            self._apply(holder, replay_seq, replay_batch)

    def _apply(self, holder: str, seq: int, batch: KVEventBatch) -> bool:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if seq < self.index.expected_seq(holder):
            return True  # already applied (a replay overlapping the live stream)

        def apply() -> None:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    # Blocks an engine saved to the shared store are the store's, not the engine's.
                    self.index.stored(
                        STORE_HOLDER if event.medium == STORE_MEDIUM else holder, event.block_hashes
                    )
                elif isinstance(event, BlockRemoved):
                    self.index.removed(holder, event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    self.index.clear(holder)
            self.batches_applied += 1

        return self.index.apply_batch(holder, seq, apply)

    async def _replay(self, holder: str, start: int) -> list[tuple[int, KVEventBatch]]:
        """The batches from `start` on that `holder`'s replay socket holds; none if it does not
        answer in time, or answers anything malformed."""
        endpoint = self.replay_endpoint_of(holder)
        if endpoint is None:
            return []
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        connect_curve(socket, self.keys)
        batches: list[tuple[int, KVEventBatch]] = []
        try:
            socket.connect(endpoint)
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    _, _, seq_bytes, payload = await socket.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big", signed=True)
                    if seq == END_SEQ:
                        return batches
                    if not start <= seq < MAX_SEQ:
                        raise ValueError(f"replayed sequence number {seq} out of range")
                    batches.append((seq, self._decoder.decode(payload)))
        except (TimeoutError, ValueError, msgspec.DecodeError, RecursionError, zmq.ZMQError) as exc:
            log.warning("KV event replay from %s failed: %s: %s", holder, type(exc).__name__, str(exc)[:200])
            return []
        finally:
            socket.close(linger=0)
