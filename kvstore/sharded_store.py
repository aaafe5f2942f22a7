"""Every shard of the KV store as one store: rendezvous hashing of keys over the shards, prefix
reads across them, and a member list that follows the shards as nodes join and leave."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from kvstore.settings import StoreSettings
from kvstore.shard_client import Allocate, ShardClient
from kvstore.shard_control import StoreUnavailable
from security.credentials import CurveKeys

log = logging.getLogger(__name__)


class ShardedStore:
    """All shards of the store as one: each key lives on the shard it hashes highest with
    (rendezvous hashing, so adding a shard moves only its share of the keys). Prefix semantics
    as in ShardClient: a lookup or read stops at the first key that is missing.

    The shards may change: the launcher starts one on every node that joins the cluster and
    tells every shard the new list (with a higher epoch). Shards name their list's epoch in every
    reply; before its next call, a client that has seen a newer epoch than its own asks that shard
    for the list and follows it. Keys whose owner changed miss once (vLLM recomputes them) and
    are stored on their new owner."""

    def __init__(self, settings: StoreSettings, keys: CurveKeys, staging_bytes: int = 64 * 1024**2):
        if not settings.endpoints:
            raise ValueError("a store needs at least one shard")
        self.keys, self.settings, self.staging_bytes = keys, settings, staging_bytes
        self.shards = {e: self._client(e) for e in settings.endpoints}
        self.members_epoch = 0
        self._caller_memory: list[tuple[int, int]] = []
        self._following = threading.Lock()

    def _client(self, endpoint: str) -> ShardClient:
        return ShardClient(endpoint, self.keys, self.settings.timeout_s, self.staging_bytes, self.settings.retry_after_s)

    @property
    def rejected(self) -> int:
        return sum(c.rejected for c in self.shards.values())

    def owner(self, key: str) -> ShardClient:
        return self.shards[max(self.shards, key=lambda e: xxhash.xxh3_64_intdigest(f"{e}|{key}".encode()))]

    def follow_members(self) -> None:
        """Adopt the newest member list a shard has announced, if newer than ours. A member that
        cannot be reached is left out until the list changes again."""
        newest = max(self.shards.values(), key=lambda shard: shard.members_epoch)
        if newest.members_epoch <= self.members_epoch:
            return
        with self._following:
            epoch = newest.members_epoch
            if epoch <= self.members_epoch:  # another thread followed meanwhile
                return
            try:
                members = newest.members()
            except StoreUnavailable as exc:
                log.warning("could not read the store's new shard list from %s: %s", newest.endpoint, exc)
                return
            if not members:
                return
            shards = {e: c for e, c in self.shards.items() if e in members}
            for endpoint in [e for e in members if e not in shards]:
                try:
                    shard = self._client(endpoint)
                except StoreUnavailable as exc:
                    log.warning("new store shard %s unreachable, left out: %s", endpoint, exc)
                    continue
                for address, end in self._caller_memory:
                    shard.register_caller_memory(address, end - address)
                shards[endpoint] = shard
            # One swap: calls under way on other threads finish with the old map.
            gone, self.shards = [c for e, c in self.shards.items() if e not in shards], shards
            self.members_epoch = epoch
        for shard in gone:
            shard.close()
        log.info("store shards now (epoch %d): %s", epoch, sorted(self.shards))

    def contains(self, keys: Sequence[str]) -> int:
        self.follow_members()
        count = 0
        for shard, run in self._runs(keys):
            found = shard.contains(run)
            count += found
            if found < len(run):
                break
        return count

    def get(self, keys: Sequence[str], allocate: Allocate | None = None) -> list:
        self.follow_members()
        found: list = []
        for shard, run in self._runs(keys):
            got = shard.get(run, allocate)
            found.extend(got)
            if len(got) < len(run):
                break
        return found

    def register_caller_memory(self, address: int, nbytes: int) -> None:
        self._caller_memory.append((address, address + nbytes))
        for shard in self.shards.values():
            shard.register_caller_memory(address, nbytes)

    def put(self, keys: Sequence[str], payloads: Sequence[np.ndarray]) -> int:
        self.follow_members()
        by_shard: dict[str, tuple[list[str], list[np.ndarray]]] = {}
        for key, payload in zip(keys, payloads, strict=True):
            mine = by_shard.setdefault(self.owner(key).endpoint, ([], []))
            mine[0].append(key)
            mine[1].append(payload)
        return sum(self.shards[e].put(k, p) for e, (k, p) in by_shard.items())

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()

    def _runs(self, keys: Sequence[str]) -> list[tuple[ShardClient, list[str]]]:
        """Consecutive keys grouped by owning shard, in order."""
        runs: list[tuple[ShardClient, list[str]]] = []
        for key in keys:
            shard = self.owner(key)
            if runs and runs[-1][0] is shard:
                runs[-1][1].append(key)
            else:
                runs.append((shard, [key]))
        return runs
