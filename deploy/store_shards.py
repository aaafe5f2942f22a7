"""The KV store's shards on a Ray cluster: one Ray actor per node that hosts engines (and the
router's node), started, followed as nodes join and leave, told the member list, stopped.

Ray restarts a shard whose process dies, on its node and endpoint (an empty store: misses until
refilled); a shard that answers with a new boot id is such a restart, and `on_restart` callbacks
let the router forget what it thought the store held.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import ray
from rich.console import Console

from deploy.periodic import every
from kvstore.shard import StoreShardActor
from security.credentials import ClusterCredentials

log = logging.getLogger(__name__)
STORE_SHARD_PREFIX = "store-"
StoreShard = ray.remote(StoreShardActor)
EngineNodes = Callable[[float], Awaitable[set[str]]]


class StoreShards:
    """Owns the shard actors of one launcher (started or adopted)."""

    def __init__(self, credentials: ClusterCredentials, console: Console, engine_nodes: EngineNodes) -> None:
        self.credentials = credentials
        self.console = console
        self.engine_nodes = engine_nodes
        self.shards: dict[str, ray.actor.ActorHandle] = {}  # by actor name (the node's)
        self.on_restart: list[Callable[[], None]] = []
        self._options: dict = {}  # how a shard is started (start)
        self._boots: dict[str, str] = {}  # the boot id each shard last answered with
        self._watch: asyncio.Task | None = None

    async def start(self, capacity_bytes: int, fault_injection: bool = False, timeout_s: float = 120.0) -> tuple[str, ...]:
        """One shard on every node of the cluster (the engines are about to be placed); returns
        their endpoints. `watch()` then keeps one where engines run as nodes join and leave."""
        # The shard's own keys, not the secret: Ray keeps an actor's arguments in its GCS.
        self._options = {"capacity_bytes": capacity_bytes, "fault_injection": fault_injection,
                         "keys": self.credentials.shard_keys()}
        endpoints = await self.reconcile(timeout_s, engine_nodes=set(_all_nodes()))
        if not endpoints:
            raise RuntimeError(f"no KV store shard answered within {timeout_s:g} s")
        self.console.print(f"KV store: {len(endpoints)} shard(s) of {capacity_bytes / 1024**3:.1f} GiB: "
                           f"{', '.join(endpoints)}")
        return endpoints

    def adopt(self, shards: dict[str, ray.actor.ActorHandle], keep: bool) -> None:
        """Shards a previous launcher left (already proven ours): kept, or ended."""
        for name, actor in shards.items():
            if keep:
                self.shards[name] = actor
            else:
                ray.kill(actor)

    async def reconcile(self, timeout_s: float = 10.0, engine_nodes: set[str] | None = None) -> tuple[str, ...]:
        """Keep a shard on this process's node and on every node that hosts one of our engines
        (`engine_nodes`; by default asked of the engines): start the missing ones (with the
        options of `start`), end those on nodes that host none any more (a shard
        would keep an idle node from being scaled down; its chunks are a cache), and tell every
        shard the list of those that answer, under a new epoch when it changed: store clients
        follow it (ShardedStore). Returns the list."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if engine_nodes is None:
            engine_nodes = await self.engine_nodes(timeout_s)
        alive = set(_all_nodes())
        wanted = alive & (engine_nodes | {ray.get_runtime_context().get_node_id()})
        for node_id in wanted:
            name = f"{STORE_SHARD_PREFIX}{node_id}"
            if name not in self.shards and self._options:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                self.shards[name] = StoreShard.options(
                    name=name, lifetime="detached", num_cpus=0, scheduling_strategy=strategy, max_restarts=-1
                ).remote(**self._options)
        for name in [n for n in self.shards if n.removeprefix(STORE_SHARD_PREFIX) not in wanted]:
            ray.kill(self.shards.pop(name))
        answers = await asyncio.gather(*(asyncio.wait_for(h.membership.remote(), timeout_s)
                                         for h in self.shards.values()), return_exceptions=True)
        live = {name: a for name, a in zip(self.shards, answers, strict=True) if isinstance(a, dict)}
        restarted = [n for n, a in live.items() if self._boots.get(n, a["boot_id"]) != a["boot_id"]]
        self._boots.update((n, a["boot_id"]) for n, a in live.items())
        if restarted:
            log.warning("KV store shard(s) restarted, empty: %s", restarted)
            for callback in self.on_restart:
                callback()
        members = sorted(a["endpoint"] for a in live.values())
        newest = max(live.values(), key=lambda a: a["epoch"], default={"epoch": 0, "members": []})
        epoch = newest["epoch"] if newest["members"] == members else newest["epoch"] + 1
        await asyncio.gather(*(asyncio.wait_for(self.shards[name].set_members.remote(members, epoch), timeout_s)
                               for name, a in live.items() if a["epoch"] < epoch), return_exceptions=True)
        if epoch != newest["epoch"]:
            log.info("KV store shards (epoch %d): %s", epoch, members)
        return tuple(members)

    def watch(self, interval_s: float = 5.0) -> None:
        """Reconcile the shards with the cluster's nodes every `interval_s`, until `stop()`."""
        self._watch = every(interval_s, self.reconcile, "reconciling the KV store's shards")

    async def stop(self, keep_serving: bool = False) -> None:
        """End the watch; close and end every shard unless `keep_serving` (a failed restart)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if keep_serving:
            return
        await asyncio.gather(*(asyncio.wait_for(s.close.remote(), 10) for s in self.shards.values()),
                             return_exceptions=True)
        for shard in self.shards.values():
            ray.kill(shard)
        self.shards.clear()


def _all_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"]]
