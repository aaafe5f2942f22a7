"""The client side of a store shard: batched put, get and contains of KV chunks.

Control messages go over the shard's ZMQ socket (kvstore/shard_control.py), bounded by
`timeout_s`; the bytes move one-sided over NIXL/UCX between a registered staging buffer of ours
(or the caller's registered memory) and the shard's arena (one transfer per batch). Every chunk
carries an xxh3 checksum computed by the writer and checked by the reader: a chunk damaged in
the store, a failed or timed-out transfer, an unreachable shard are each reported as a miss
(`StoreUnavailable` for the whole call, None for a chunk), never as wrong KV.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import xxhash

from kvstore import messages
from kvstore.shard_control import ShardControl, StoreUnavailable
from kvstore.stranded_reads import StrandedReads, in_flight
from security.credentials import CurveKeys
from transport.nixl import NixlTransferError, PostedTransfer, add_peer, new_agent, transfer

log = logging.getLogger(__name__)


class ReadInFlight(StoreUnavailable):
    """A read outlived its deadline and is still posted. UCX does not cancel a posted remote read,
    so the memory it lands in (the caller's, from `allocate`) must stay untouched until `ended` is
    done (once the client has seen the read end, on a later call or at close): the caller frees
    it then, never before."""

    def __init__(self, message: str, ended: concurrent.futures.Future) -> None:
        super().__init__(message)
        self.ended = ended


Allocate = Callable[[int], tuple[np.ndarray, object]]
# A read is posted in pieces of about this size, so that the first pieces are checked and
# copied while the later ones are still on the wire.
READ_PIECE_BYTES = 4 * 1024**2


def _new_array(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    array = np.empty(nbytes, dtype=np.uint8)
    return array, array


def checksum(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))


def _group(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices grouped so each group holds at most `limit` bytes (or one item)."""
    groups: list[list[int]] = [[]]
    used = 0
    for index, size in enumerate(sizes):
        if groups[-1] and used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(index)
        used += size
    return [g for g in groups if g]


def _intact_prefix(chunks: list[tuple[int, np.ndarray, np.ndarray, object]]) -> int:
    """How many of the (expected checksum, landed bytes, ...) chunks, from the first, are intact."""
    for count, (expected, landing, *_) in enumerate(chunks):
        if checksum(landing) != expected:
            return count
    return len(chunks)


@dataclasses.dataclass
class _Piece:
    """One posted read of consecutive chunks, and the verifier's count of its intact ones."""

    chunks: list[tuple[int, np.ndarray, np.ndarray, object]] = dataclasses.field(default_factory=list)
    read: PostedTransfer | None = None
    verdict: concurrent.futures.Future | None = None


class ShardClient:
    def __init__(self, endpoint: str, keys: CurveKeys, timeout_s: float, staging_bytes: int = 64 * 1024**2,
                 retry_after_s: float | None = None):
        """`retry_after_s`: how long the shard counts as down after a call timed out (default:
        twice `timeout_s`, as StoreSettings.retry_after_s)."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.control = ShardControl(endpoint, keys, timeout_s, 2 * timeout_s if retry_after_s is None else retry_after_s)
        self._lock = threading.Lock()  # one request and one staging buffer at a time
        self.staging = np.zeros(staging_bytes, dtype=np.uint8)
        self.agent = new_agent("pdc-kv")
        self._registration = self.agent.register_memory(
            [(self.staging.ctypes.data, self.staging.nbytes, 0, "")], "DRAM"
        )
        hello = self.control.call(messages.Hello())
        self.peer = add_peer(self.agent, hello["agent"])
        self._verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdc-kv-verify")
        self.rejected = 0  # chunks whose checksum did not match
        self._caller_memory: list[tuple[int, int]] = []  # caller memory transfers use directly
        self._caller_registrations: list = []
        self._stranded = StrandedReads(self.agent)
        self._warm(hello.get("probe"))

    @property
    def members_epoch(self) -> int:
        """The newest member list the shard has said it holds."""
        return self.control.members_epoch

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """The client's lock (one request and one staging buffer at a time), with the stranded
        reads that have ended released first."""
        with self._lock:
            self._stranded.reap()
            yield

    def register_caller_memory(self, address: int, nbytes: int) -> None:
        """Register [address, address + nbytes) (LMCache's buffer of memory objects) with our NIXL
        agent: chunks `get` allocates there are read straight into it, and payloads `put` is
        given from there are written straight from it; neither goes through the staging buffer."""
        with self._lock:
            registration = self.agent.register_memory([(address, nbytes, 0, "")], "DRAM")
            self._caller_registrations.append(registration)
            self._caller_memory.append((address, address + nbytes))

    def _registered(self, array: np.ndarray) -> bool:
        start = array.ctypes.data
        return any(low <= start and start + array.nbytes <= high for low, high in self._caller_memory)

    def contains(self, keys: Sequence[str]) -> int:
        with self._turn():
            return self.control.call(messages.Contains(list(keys)))["count"]

    def stats(self) -> dict:
        with self._turn():
            return self.control.call(messages.Stats())

    def members(self) -> list[str]:
        """Every shard of the store, as the launcher last told this one (see ShardedStore)."""
        with self._turn():
            return self.control.call(messages.Members())["members"]

    def put(self, keys: Sequence[str], payloads: Sequence[np.ndarray]) -> int:
        """Store chunks (uint8 arrays); returns how many were written (keys already stored, or
        that found no room, are skipped)."""
        written = 0
        with self._turn():
            for batch in self._batches([p.nbytes for p in payloads]):
                written += self._put_batch([keys[i] for i in batch], [payloads[i] for i in batch])
        return written

    def get(self, keys: Sequence[str], allocate: Allocate | None = None) -> list:
        """The stored prefix of `keys`, each chunk verified; stops at the first miss or damaged
        chunk (what follows it is useless to a prefix cache). Each chunk goes to
        `allocate(nbytes)` (a uint8 array and what to return for it; the caller's own memory),
        else to a new array. Memory allocated for chunks not returned is the caller's to free."""
        with self._turn():
            reply = self.control.call(messages.Lease(list(keys)))
            damaged: list[str] = []
            try:
                self._meet(reply["agent_name"])
                found, bad = self._read(reply["chunks"], allocate or _new_array)
                if bad:  # the shard drops it: the next writer stores it afresh
                    damaged.append(keys[len(found)])
                return found
            finally:  # its answer is collected before our next message, off the read's path
                self.control.call(messages.Release(reply["lease"], damaged), answer_later=True)

    def close(self) -> None:
        with self._lock:
            self._stranded.wait(time.monotonic() + self.timeout_s)
            if self._stranded:  # their memory stays given away: better lost than written into
                log.warning("closing with %d reads from %s still in flight", len(self._stranded), self.endpoint)
            try:  # NIXL may refuse to let go of a peer or memory a transfer still holds: closed anyway
                with contextlib.suppress(Exception):
                    self.agent.remove_remote_agent(self.peer)
                for registration in [self._registration, *self._caller_registrations]:
                    with contextlib.suppress(Exception):
                        self.agent.deregister_memory(registration)
            finally:
                self.control.close()
                self._verifier.shutdown(wait=True)

    def _put_batch(self, keys: list[str], payloads: list[np.ndarray]) -> int:
        sums = [checksum(p) for p in payloads]
        reply = self.control.call(messages.Reserve(keys, [p.nbytes for p in payloads], sums))
        granted = [(k, p, e) for k, p, e in zip(keys, payloads, reply["extents"], strict=True) if e]
        if not granted:
            return 0
        self._meet(reply["agent_name"])
        local, remote, offset = [], [], 0
        for _, payload, extents in granted:
            if self._registered(payload):
                local.append((payload.ctypes.data, payload.nbytes))
            else:
                self.staging[offset : offset + payload.nbytes] = payload
                local.append((self.staging.ctypes.data + offset, payload.nbytes))
                offset += payload.nbytes
            remote.extend((address, length) for address, length in extents)
        names = [k for k, _, _ in granted]
        try:
            transfer(self.agent, "WRITE", local, remote, self.peer, self.timeout_s)
        except NixlTransferError:
            self.control.call(messages.Abort(names))
            raise
        return self.control.call(messages.Commit(names))["committed"]

    def _read(self, chunks: list[dict], allocate: Allocate) -> tuple[list, bool]:
        """The leased chunks that arrived intact, up to the first damaged one; and whether one was.
        Each chunk lands in its allocated memory if that is registered (register_caller_memory), else
        in the staging buffer and is copied there once checked. A piece's checksums run on the
        verifier thread as soon as it has landed, while later pieces are still moving (over shared
        memory a read is a copy made by the posting thread, which lets go of the GIL meanwhile)."""
        found: list = []
        for batch in self._batches([c["nbytes"] for c in chunks]):
            pieces: list[_Piece] = []
            deadline = time.monotonic() + self.timeout_s
            staged = 0
            try:
                for group in _group([chunks[i]["nbytes"] for i in batch], READ_PIECE_BYTES):
                    piece = _Piece()
                    local, remote = [], []
                    for index in (batch[i] for i in group):
                        nbytes = chunks[index]["nbytes"]
                        target, result = allocate(nbytes)
                        landing = target if self._registered(target) else self.staging[staged:][:nbytes]
                        staged += 0 if landing is target else nbytes
                        local.append((landing.ctypes.data, nbytes))
                        remote.extend((a, n) for a, n in chunks[index]["extents"])
                        piece.chunks.append((chunks[index]["checksum"], landing, target, result))
                    piece.read = PostedTransfer(self.agent, "READ", local, remote, self.peer)
                    pieces.append(piece)
                    self._verify_landed(pieces, deadline=None)
                self._verify_landed(pieces, deadline)
                for piece in pieces:
                    try:
                        intact = piece.verdict.result(timeout=max(0.0, deadline - time.monotonic()))
                    except TimeoutError as exc:
                        raise StoreUnavailable(f"checking a read from {self.endpoint} timed out") from exc
                    for _, landing, target, result in piece.chunks[:intact]:
                        if landing is not target:
                            target[:] = landing
                        found.append(result)
                    if intact < len(piece.chunks):
                        self.rejected += 1
                        log.warning("a stored KV chunk failed its checksum: treated as a miss and dropped")
                        return found, True
            finally:  # reads still in flight write into our memory, checks read it: let them end
                stranded = self._let_reads_end(pieces, deadline)
                if stranded:
                    raise self._strand(stranded, staged > 0)
        return found, False

    def _let_reads_end(self, pieces: list[_Piece], deadline: float) -> list[PostedTransfer]:
        """Wait (until `deadline`) for each piece's read and check; release those that ended; the
        reads still in flight."""
        stranded = []
        for piece in pieces:
            with contextlib.suppress(NixlTransferError):
                piece.read.wait(deadline)
            if in_flight(piece.read):
                stranded.append(piece.read)
                continue
            piece.read.release()
            if piece.verdict is not None:
                with contextlib.suppress(Exception):
                    piece.verdict.result(timeout=max(0.0, deadline - time.monotonic()))
        return stranded

    def _strand(self, reads: list[PostedTransfer], used_staging: bool) -> ReadInFlight:
        """Keep `reads` and their memory out of use until they end (kvstore/stranded_reads.py): a
        staging buffer they land in is replaced by a new one."""
        retired = None
        if used_staging:
            fresh = np.zeros(self.staging.nbytes, dtype=np.uint8)
            registration = self.agent.register_memory([(fresh.ctypes.data, fresh.nbytes, 0, "")], "DRAM")
            retired = (self.staging, self._registration)
            self.staging, self._registration = fresh, registration
        log.warning("%d reads from %s still in flight past their deadline: their memory is kept until they end",
                    len(reads), self.endpoint)
        return ReadInFlight(f"a read from {self.endpoint} is still in flight past its deadline",
                            self._stranded.keep(reads, retired))

    def _verify_landed(self, pieces: list[_Piece], deadline: float | None) -> None:
        """Hand each landed, unchecked piece (in order) to the verifier thread; with a deadline,
        wait for every piece to land, else stop at the first one still in flight."""
        for piece in pieces:
            if piece.verdict is not None:
                continue
            if deadline is None and not piece.read.done():
                return
            if deadline is not None:
                piece.read.wait(deadline)
            piece.verdict = self._verifier.submit(_intact_prefix, piece.chunks)

    def _batches(self, sizes: list[int]) -> list[list[int]]:
        """Indices grouped so each group fits the staging buffer."""
        if sizes and max(sizes) > self.staging.nbytes:
            raise ValueError(
                f"a {max(sizes)}-byte chunk exceeds the {self.staging.nbytes}-byte staging buffer"
            )
        return _group(sizes, self.staging.nbytes)

    def _meet(self, agent_name: str) -> None:
        """Transfer with the shard's NIXL agent `agent_name`. Another name than the one we know
        means the shard behind our endpoint was restarted (a new agent, a new arena): learn it."""
        if agent_name == self.peer:
            return
        hello = self.control.call(messages.Hello())
        with contextlib.suppress(Exception):  # the old agent is gone; forgetting it may complain
            self.agent.remove_remote_agent(self.peer)
        self.peer = add_peer(self.agent, hello["agent"])
        self._warm(hello.get("probe"))
        log.info("store shard %s was restarted: now reading from its agent %s", self.endpoint, self.peer)

    def _warm(self, probe: list[int] | None) -> None:
        """Read the shard's probe area once, now: UCX connects to the shard's agent on the first
        transfer (its wire-up over loopback TCP, which needs both sides' progress threads), and
        on two loaded cores a request's first read once waited the whole timeout for it (issue
        #34). A failure here is only logged: reads try again."""
        try:
            address, nbytes = int(probe[0]), min(int(probe[1]), 4096)
        except (TypeError, ValueError, IndexError):  # an older shard names none
            return
        started, read = time.perf_counter(), None
        try:
            read = PostedTransfer(self.agent, "READ", [(self.staging.ctypes.data, nbytes)], [(address, nbytes)],
                                  self.peer)
            read.wait(time.monotonic() + self.timeout_s)
        except NixlTransferError as exc:
            log.warning("store shard %s: the first transfer failed (%s); reads will try again", self.endpoint, exc)
            if read is not None and in_flight(read):
                self._strand([read], used_staging=True)
            elif read is not None:
                read.release()
            return
        read.release()
        log.info("store shard %s: transfers set up in %.3f s", self.endpoint, time.perf_counter() - started)
