"""Which instance (or store shard) holds which KV blocks.

Fed by vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared, one publisher per engine,
each batch with a sequence number) and by speculative inserts for requests just routed, which
expire after `speculative_ttl_s` unless an event confirms them: a burst of same-prefix requests
then lands together before the engine has reported anything.

Hazards handled here: a sequence gap means lost events, so `apply_batch` reports it and the caller
must replay or `clear` that holder (stale entries are worse than none); memory is bounded per
holder, evicting its earliest stored blocks first (the engines' own BlockRemoved events keep
each holder well under the bound; the bound only stops a lost-events leak).

Complexity: `match` walks the request's blocks once and intersects holder sets, O(blocks x
holders); inserts and removals are O(1) per block.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

BlockHash = Hashable


class KVIndex:
    def __init__(
        self,
        max_blocks_per_holder: int = 1_000_000,
        speculative_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_blocks_per_holder = max_blocks_per_holder
        self.speculative_ttl_s = speculative_ttl_s
        self.clock = clock
        self._holders: dict[BlockHash, set[str]] = {}
        # Per holder, its blocks in LRU order; value = expiry time of a speculative entry, or None.
        self._blocks: dict[str, collections.OrderedDict[BlockHash, float | None]] = {}
        self._last_seq: dict[str, int] = {}
        # Speculative inserts in expiry order, so expired ones are purged without a scan.
        self._speculative: collections.deque[tuple[float, str, BlockHash]] = collections.deque()

    # --- events -------------------------------------------------------------------------------
    def apply_batch(self, holder: str, seq: int, apply: Callable[[], None]) -> bool:
        """Run `apply` (the batch's events) if `seq` is the next one expected from `holder`.

        Returns False on a gap, without applying: the caller replays the missed batches or
        resyncs the holder. A holder's first expected batch is 0 (its publisher's first), so
        a router that starts late replays an engine's history instead of missing it. Holders
        are instance ids, unique per engine start: a restarted engine counts from 0 again.
        """
        if seq != self.expected_seq(holder):
            return False
        apply()
        self._last_seq[holder] = seq
        return True

    def resync(self, holder: str, next_seq: int) -> None:
        """Forget `holder`'s blocks and accept its batches again from `next_seq` on."""
        self.clear(holder)
        self._last_seq[holder] = next_seq - 1

    def expected_seq(self, holder: str) -> int:
        return self._last_seq.get(holder, -1) + 1

    def stored(self, holder: str, hashes: Iterable[BlockHash]) -> None:
        self._insert(holder, hashes, expiry=None)

    def speculate(self, holder: str, hashes: Iterable[BlockHash]) -> None:
        """Blocks `holder` will hold once the request just sent there is prefilled."""
        self._insert(holder, hashes, expiry=self.clock() + self.speculative_ttl_s)

    def removed(self, holder: str, hashes: Iterable[BlockHash]) -> None:
        blocks = self._blocks.get(holder)
        if blocks is None:
            return
        for block_hash in hashes:
            if blocks.pop(block_hash, _MISSING) is not _MISSING:
                self._drop_holder(block_hash, holder)

    def clear(self, holder: str) -> None:
        """Forget every block of `holder` (AllBlocksCleared, a lost-event resync, a dead instance)."""
        for block_hash in self._blocks.pop(holder, {}):
            self._drop_holder(block_hash, holder)

    def remove_holder(self, holder: str) -> None:
        self.clear(holder)
        self._last_seq.pop(holder, None)

    # --- queries ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each holder, how many of the leading `hashes` it holds (holders with 0 left out)."""
        self.expire()
        matched: dict[str, int] = {}
        alive: set[str] = set(self._holders.get(hashes[0], _EMPTY)) if hashes else set()
        for position in range(1, len(hashes)):
            if not alive:
                break
            still = alive.intersection(self._holders.get(hashes[position], _EMPTY))
            for holder in alive - still:
                matched[holder] = position
            alive = still
        for holder in alive:
            matched[holder] = len(hashes)
        return matched

    def num_blocks(self, holder: str) -> int:
        """Blocks `holder` has reported, and its speculative ones not yet expired."""
        self.expire()
        return len(self._blocks.get(holder, ()))

    def holders(self) -> list[str]:
        return list(self._blocks)

    # --- internals ----------------------------------------------------------------------------
    def _insert(self, holder: str, hashes: Iterable[BlockHash], expiry: float | None) -> None:
        blocks = self._blocks.setdefault(holder, collections.OrderedDict())
        for block_hash in hashes:
            previous = blocks.get(block_hash, _MISSING)
            if previous is _MISSING:
                self._holders.setdefault(block_hash, set()).add(holder)
            if previous is None:
                blocks.move_to_end(block_hash)  # a speculative insert never downgrades a confirmed block
                continue
            blocks[block_hash] = expiry
            blocks.move_to_end(block_hash)
            if expiry is not None:
                self._speculative.append((expiry, holder, block_hash))
        while len(blocks) > self.max_blocks_per_holder:
            evicted, _ = blocks.popitem(last=False)
            self._drop_holder(evicted, holder)

    def expire(self) -> None:
        """Drop speculative entries whose time is up and that no event confirmed."""
        now = self.clock()
        while self._speculative and self._speculative[0][0] < now:
            expiry, holder, block_hash = self._speculative.popleft()
            blocks = self._blocks.get(holder)
            # Only if the entry is still that speculation (not confirmed, not re-speculated).
            if blocks is not None and blocks.get(block_hash, _MISSING) == expiry:
                del blocks[block_hash]
                self._drop_holder(block_hash, holder)

    def _drop_holder(self, block_hash: BlockHash, holder: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._holders[block_hash]


_MISSING = object()
_EMPTY: frozenset[str] = frozenset()
