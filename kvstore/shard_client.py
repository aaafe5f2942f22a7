"""The client side of a store shard: batched put, get and contains of KV chunks.

Control messages (kvstore/messages.py) go over the shard's ZMQ socket as a CURVE client of the
store plane (only the cluster's members get answers), bounded by `timeout_s`; the bytes move
one-sided over NIXL/UCX between a registered staging buffer of ours and the shard's arena (one
transfer per batch). Every chunk carries an xxh3 checksum computed by the writer and checked by
the reader: a chunk damaged in the store, a failed or timed-out transfer, an unreachable shard
are each reported as a miss (`StoreUnavailable` for the whole call, None for a chunk), never as
wrong KV.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvstore import messages
from kvstore.stranded_reads import StrandedReads, in_flight
from security.credentials import CurveKeys
from transport.nixl import NixlTransferError, PostedTransfer, add_peer, new_agent, transfer
from transport.zmq_curve import connect_curve

log = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The shard did not answer in time, or refused the request."""


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
ASKED_AGAIN = (messages.Hello, messages.Commit, messages.Abort, messages.Contains, messages.Stats,
               messages.Members)
"""Control messages a shard may receive twice with no harm. One unanswered for half the timeout
is sent again on a new connection (the ZMQ guide's "lazy pirate"): a REQ socket whose request or
answer was lost waits for nothing, and a write whose commit went unanswered is a store miss."""


def _new_array(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    array = np.empty(nbytes, dtype=np.uint8)
    return array, array


def checksum(data: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data))


def _op(request: messages.Request) -> str:
    return type(request).__name__.lower()


def _reply(socket, op: str, timeout_s: float, endpoint: str) -> dict:
    if not socket.poll(int(timeout_s * 1000)):
        raise StoreUnavailable(f"store shard {endpoint} did not answer {op!r} within {timeout_s} s")
    return messages.decode_reply(socket.recv())


def _socket(context, endpoint: str, keys: CurveKeys):
    import zmq

    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    connect_curve(socket, keys)
    socket.connect(endpoint)
    return socket


def request_once(endpoint: str, request: messages.Request, timeout_s: float, keys: CurveKeys) -> dict:
    """One control message to a shard, with no transfer agent (stats, fault injection)."""
    import zmq

    context = zmq.Context()
    socket = _socket(context, endpoint, keys)
    try:
        socket.send(messages.encode(request))
        reply = _reply(socket, _op(request), timeout_s, endpoint)
    finally:
        socket.close(0)
        context.term()
    if "error" in reply:
        raise StoreUnavailable(f"store shard refused {_op(request)!r}: {reply['error']}")
    return reply


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
        import zmq

        self.endpoint = endpoint
        self.keys = keys
        self.timeout_s = timeout_s
        self.retry_after_s = 2 * timeout_s if retry_after_s is None else retry_after_s
        self._down_until = 0.0  # after a timeout, calls fail fast (a miss) instead of each waiting
        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = None
        self._unanswered: str | None = None  # the op whose answer is still to be read
        self.members_epoch = 0  # the newest member list the shard has said it holds
        self._lock = threading.Lock()  # one request and one staging buffer at a time
        self.staging = np.zeros(staging_bytes, dtype=np.uint8)
        self.agent = new_agent("pdc-kv")
        self._registration = self.agent.register_memory(
            [(self.staging.ctypes.data, self.staging.nbytes, 0, "")], "DRAM"
        )
        self.peer = add_peer(self.agent, self._call(messages.Hello())["agent"])
        self._verifier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdc-kv-verify")
        self.rejected = 0  # chunks whose checksum did not match
        self._caller_memory: list[tuple[int, int]] = []  # caller memory transfers use directly
        self._caller_registrations: list = []
        self._stranded = StrandedReads(self.agent)

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
        with self._lock:
            return self._call(messages.Contains(list(keys)))["count"]

    def stats(self) -> dict:
        with self._lock:
            return self._call(messages.Stats())

    def members(self) -> list[str]:
        """Every shard of the store, as the launcher last told this one (see ShardedStore)."""
        with self._lock:
            return self._call(messages.Members())["members"]

    def put(self, keys: Sequence[str], payloads: Sequence[np.ndarray]) -> int:
        """Store chunks (uint8 arrays); returns how many were written (keys already stored, or
        that found no room, are skipped)."""
        written = 0
        with self._lock:
            self._stranded.reap()
            for batch in self._batches([p.nbytes for p in payloads]):
                written += self._put_batch([keys[i] for i in batch], [payloads[i] for i in batch])
        return written

    def get(self, keys: Sequence[str], allocate: Allocate | None = None) -> list:
        """The stored prefix of `keys`, each chunk verified; stops at the first miss or damaged
        chunk (what follows it is useless to a prefix cache). Each chunk goes to
        `allocate(nbytes)` (a uint8 array and what to return for it; the caller's own memory),
        else to a new array. Memory allocated for chunks not returned is the caller's to free."""
        with self._lock:
            self._stranded.reap()
            reply = self._call(messages.Lease(list(keys)))
            damaged: list[str] = []
            try:
                self._meet(reply["agent_name"])
                found, bad = self._read(reply["chunks"], allocate or _new_array)
                if bad:  # the shard drops it: the next writer stores it afresh
                    damaged.append(keys[len(found)])
                return found
            finally:  # its answer is collected before our next message, off the read's path
                self._call(messages.Release(reply["lease"], damaged), answer_later=True)

    def close(self) -> None:
        with self._lock:
            self._stranded.wait(time.monotonic() + self.timeout_s)
            if self._stranded:  # their memory stays given away: better lost than written into
                log.warning("closing with %d reads from %s still in flight", len(self._stranded), self.endpoint)
            self.agent.remove_remote_agent(self.peer)
            for registration in [self._registration, *self._caller_registrations]:
                self.agent.deregister_memory(registration)
            if self._socket is not None:
                with contextlib.suppress(StoreUnavailable):  # a release sent last is delivered
                    self._collect_answer()
                self._socket.close(0)
            self._context.term()
            self._verifier.shutdown(wait=True)

    def _put_batch(self, keys: list[str], payloads: list[np.ndarray]) -> int:
        sums = [checksum(p) for p in payloads]
        reply = self._call(messages.Reserve(keys, [p.nbytes for p in payloads], sums))
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
            self._call(messages.Abort(names))
            raise
        return self._call(messages.Commit(names))["committed"]

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
            retired = (self.staging, self._registration)
            self.staging = np.zeros(self.staging.nbytes, dtype=np.uint8)
            self._registration = self.agent.register_memory(
                [(self.staging.ctypes.data, self.staging.nbytes, 0, "")], "DRAM")
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

    def _call(self, request: messages.Request, answer_later: bool = False) -> dict:
        """One control message and its answer. With `answer_later`, return once it is sent: its
        answer is read (and a refusal logged) before the next message, or at close."""
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"store shard {self.endpoint} is unreachable; retrying after a pause")
        if self._socket is None:
            self._socket = _socket(self._context, self.endpoint, self.keys)
        try:
            self._collect_answer()
            self._socket.send(messages.encode(request))
            if answer_later:
                self._unanswered = _op(request)
                return {}
            reply = self._answer(_op(request)) if not isinstance(request, ASKED_AGAIN) else self._ask_twice(request)
        except StoreUnavailable:
            self._socket.close(0)
            self._socket = None
            self._unanswered = None
            self._down_until = time.monotonic() + self.retry_after_s
            raise
        if "error" in reply:
            raise StoreUnavailable(f"store shard refused {_op(request)!r}: {reply['error']}")
        return reply

    def _meet(self, agent_name: str) -> None:
        """Transfer with the shard's NIXL agent `agent_name`. Another name than the one we know
        means the shard behind our endpoint was restarted (a new agent, a new arena): learn it."""
        if agent_name == self.peer:
            return
        metadata = self._call(messages.Hello())["agent"]
        with contextlib.suppress(Exception):  # the old agent is gone; forgetting it may complain
            self.agent.remove_remote_agent(self.peer)
        self.peer = add_peer(self.agent, metadata)
        log.info("store shard %s was restarted: now reading from its agent %s", self.endpoint, self.peer)

    def _ask_twice(self, request: messages.Request) -> dict:
        """The answer to `request` (sent): waited for half the timeout, then for the other half
        to the same request sent again on a new connection."""
        op = _op(request)
        try:
            return self._answer(op, self.timeout_s / 2)
        except StoreUnavailable:
            log.warning("store shard %s did not answer %r within %.1f s: asking again on a new connection",
                        self.endpoint, op, self.timeout_s / 2)
        self._socket.close(0)
        self._socket = _socket(self._context, self.endpoint, self.keys)
        self._socket.send(messages.encode(request))
        try:
            reply = self._answer(op, self.timeout_s / 2)
        except StoreUnavailable:
            raise StoreUnavailable(f"store shard {self.endpoint} did not answer {op!r} within {self.timeout_s} s "
                                   "(asked twice)") from None
        log.warning("store shard %s answered %r on the new connection", self.endpoint, op)
        return reply

    def _answer(self, op: str, timeout_s: float | None = None) -> dict:
        reply = _reply(self._socket, op, self.timeout_s if timeout_s is None else timeout_s, self.endpoint)
        self.members_epoch = max(self.members_epoch, reply.get("members_epoch", 0))
        return reply

    def _collect_answer(self) -> None:
        if self._unanswered is None:
            return
        op, self._unanswered = self._unanswered, None
        reply = self._answer(op)
        if "error" in reply:
            log.warning("store shard %s refused %r: %s", self.endpoint, op, reply["error"])
