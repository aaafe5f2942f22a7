"""A store shard's bookkeeping: pages of an arena handed out per chunk, LRU over stored chunks,
leases that pin chunks while a reader copies them, reservations that hold pages while a writer
fills them; both expire, so a client that dies strands nothing."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
from collections.abc import Sequence

import numpy as np

from transport.nixl import Extent

PAGE_BYTES = 64 * 1024
MAX_LEASES = 4096  # readers at once; each lease pins its chunks until released or expired


@dataclasses.dataclass
class _Chunk:
    nbytes: int
    checksum: int
    pages: list[int]
    extents: list[Extent]  # the pages as (offset, length) runs, what a transfer names
    committed: bool = False
    readers: int = 0


@dataclasses.dataclass(frozen=True)
class ShardStats:
    capacity_bytes: int
    used_bytes: int  # pages held by stored or reserved chunks
    stored_bytes: int  # payload of committed chunks
    reserved_bytes: int  # pages held by writes in flight
    chunks: int
    leases: int
    evictions: int
    expired: int
    rejected: int  # chunks a reader found damaged (checksum), dropped


class ChunkStore:
    """Pages of an arena of `capacity_bytes`, handed out per chunk (a chunk's pages need not be
    contiguous: NIXL transfers lists of extents). Not thread-safe: the server serialises calls."""

    def __init__(self, capacity_bytes: int, page_bytes: int = PAGE_BYTES, max_chunk_bytes: int | None = None):
        self.page_bytes = page_bytes
        self.capacity_bytes = capacity_bytes // page_bytes * page_bytes
        self.max_chunk_bytes = max_chunk_bytes or max(page_bytes, self.capacity_bytes // 2)
        """Larger chunks are refused (by default, half the store: one write never evicts all)."""
        # Free pages, next to hand out last; a chunk's pages are taken in ascending order, so a
        # fresh or recycled run of pages makes one extent (one NIXL descriptor) rather than many.
        self._free = list(range(self.capacity_bytes // page_bytes))[::-1]
        self._writing: dict[str, float] = {}  # reserved, uncommitted chunks and their deadline
        self._chunks: collections.OrderedDict[str, _Chunk] = collections.OrderedDict()  # LRU first
        self._leases: dict[int, tuple[list[str], float]] = {}
        self.evictions = self.expired = self.rejected = 0

    def reserve(self, key: str, nbytes: int, checksum: int, now: float, ttl_s: float) -> list[Extent] | None:
        """Pages for a chunk a client is about to write, as (offset, length) extents; None when
        the key is already stored or being written, the chunk could never fit (nothing is
        evicted for it), or no unleased chunk is left to evict."""
        if key in self._chunks or not 0 < nbytes <= self.max_chunk_bytes:
            return None
        pages_needed = max(1, -(-nbytes // self.page_bytes))
        while len(self._free) < pages_needed and self._evict_one():
            pass
        if len(self._free) < pages_needed:
            return None
        pages = self._free[-pages_needed:][::-1]
        del self._free[-pages_needed:]
        self._chunks[key] = _Chunk(nbytes, checksum, pages, self._runs(pages, nbytes))
        self._writing[key] = now + ttl_s
        return self._chunks[key].extents

    def commit(self, key: str) -> bool:
        """Whether `key` is stored once this returns: committed now, or already (a writer whose
        commit went unanswered asks again)."""
        chunk = self._chunks.get(key)
        if chunk is None:
            return False
        if not chunk.committed:
            chunk.committed = True
            del self._writing[key]
            self._chunks.move_to_end(key)
        return True

    def abort(self, key: str) -> None:
        chunk = self._chunks.get(key)
        if chunk is not None and not chunk.committed:
            self._drop(key)

    def contains(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, are stored."""
        count = 0
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is None or not chunk.committed:
                break
            count += 1
        return count

    def lease(self, keys: Sequence[str], now: float, ttl_s: float) -> tuple[int, list[dict]] | None:
        """Pin the stored prefix of `keys` for a reader until `release` (or the lease expires);
        None when MAX_LEASES are held already. Lease ids are random: one reader cannot release
        another's."""
        if len(self._leases) >= MAX_LEASES:
            return None
        granted = [key for key in keys[: self.contains(keys)]]
        lease_id = secrets.randbits(62)
        for key in granted:
            self._chunks[key].readers += 1
            self._chunks.move_to_end(key)
        self._leases[lease_id] = (granted, now + ttl_s)
        chunks = [{"nbytes": self._chunks[k].nbytes, "checksum": self._chunks[k].checksum,
                   "extents": self._chunks[k].extents} for k in granted]
        return lease_id, chunks

    def release(self, lease_id: int) -> None:
        keys, _ = self._leases.pop(lease_id, ([], 0.0))
        for key in keys:
            if key in self._chunks:
                self._chunks[key].readers -= 1

    def reject(self, key: str) -> None:
        """A reader found the chunk damaged: drop it (once no one else reads it) so that the next
        writer stores it afresh."""
        chunk = self._chunks.get(key)
        if chunk is not None and chunk.committed and chunk.readers == 0:
            self._drop(key)
            self.rejected += 1

    def expire(self, now: float) -> None:
        """Drop writes and leases whose client vanished before finishing."""
        for lease_id in [i for i, (_, until) in self._leases.items() if until < now]:
            self.release(lease_id)
            self.expired += 1
        for key in [k for k, until in self._writing.items() if until < now]:
            self._drop(key)
            self.expired += 1

    def corrupt(self, arena: np.ndarray, count: int) -> int:
        """Fault injection for tests: flip one byte in each of the first `count` stored chunks."""
        damaged = 0
        for chunk in itertools.islice((c for c in self._chunks.values() if c.committed), count):
            arena[chunk.pages[0] * self.page_bytes] ^= 0xFF
            damaged += 1
        return damaged

    def _runs(self, pages: list[int], nbytes: int) -> list[Extent]:
        left, extents = nbytes, []
        for page in pages:
            length = min(self.page_bytes, left)
            if extents and extents[-1][0] + extents[-1][1] == page * self.page_bytes:
                extents[-1] = (extents[-1][0], extents[-1][1] + length)
            else:
                extents.append((page * self.page_bytes, length))
            left -= length
        return extents

    def stats(self) -> ShardStats:
        held = sum(len(c.pages) for c in self._chunks.values())
        reserved = sum(len(c.pages) for c in self._chunks.values() if not c.committed)
        return ShardStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=held * self.page_bytes,
            stored_bytes=sum(c.nbytes for c in self._chunks.values() if c.committed),
            reserved_bytes=reserved * self.page_bytes,
            chunks=sum(1 for c in self._chunks.values() if c.committed),
            leases=len(self._leases),
            evictions=self.evictions,
            expired=self.expired,
            rejected=self.rejected,
        )

    def _evict_one(self) -> bool:
        victim = next((k for k, c in self._chunks.items() if c.committed and c.readers == 0), None)
        if victim is None:
            return False
        self._drop(victim)
        self.evictions += 1
        return True

    def _drop(self, key: str) -> None:
        self._writing.pop(key, None)
        self._free.extend(reversed(self._chunks.pop(key).pages))


