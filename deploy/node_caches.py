"""A new node's start caches from a ready engine on another node (engine/node_caches.py), before
an engine starts there: its compile, kernel and startup-plan work is then read, not redone."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Sequence

import ray

from engine.node_caches import InstalledCaches

log = logging.getLogger(__name__)

CACHES_TIMEOUT_S = 60.0
"""What bringing a node its caches may add to a start, once the engine's actor is placed."""


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """What an engine's compile and startup plan follow, of what the launcher knows: its model, its
    role (each pool's own engine arguments) and its tensor-parallel size. Engines of one kind under
    one launcher share the rest (dtype, every pool's arguments); a peer adopted from an earlier
    launch with other arguments may send a compile the engine keys apart: time lost, no more."""

    model: str
    role: str
    tensor_parallel_size: int


@dataclasses.dataclass(frozen=True)
class CachePeer:
    """A ready engine that a new node's caches may come from, and its kind."""

    actor: ray.actor.ActorHandle
    kind: EngineKind


def peers_in_turn(peers: Sequence[CachePeer], kind: EngineKind, turn: int) -> list[ray.actor.ActorHandle]:
    """Whom a bring for an engine of `kind` asks, in order: the peers of that kind (theirs is the
    compile it needs; another peer offers units too, and the first peer that sends any ends the
    bring), else those of its model, else every peer (Triton's kernels, which models share); from
    `turn` places along, so that new nodes spread over them."""
    chosen = ([p.actor for p in peers if p.kind == kind] or [p.actor for p in peers if p.kind.model == kind.model]
              or [p.actor for p in peers])
    first = turn % max(len(chosen), 1)
    return [*chosen[first:], *chosen[:first]]


class CacheCourier:
    """Brings each node that an engine is about to start on the caches a ready peer elsewhere has
    and it lacks: one bring per node and engine kind at a time (starts of that kind on the same node
    wait for it, not for another copy), peers asked in turn, each step bounded; any failure only
    costs the time saved.
    """

    def __init__(self, timeout_s: float = CACHES_TIMEOUT_S, step_timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self._bringing: dict[tuple[str, EngineKind], asyncio.Future] = {}
        self._brings = itertools.count()
        """Each bring asks the ready peers from the next one on: new nodes spread over them."""
        self._nodes: dict[ray.actor.ActorHandle, str] = {}
        """Each engine actor's node (it never moves): asked once, not at every start."""

    async def _node_of(self, actor: ray.actor.ActorHandle, timeout_s: float) -> str:
        if actor not in self._nodes:
            self._nodes[actor] = await asyncio.wait_for(actor.node_id.remote(), timeout_s)
        return self._nodes[actor]

    async def bring(self, new: ray.actor.ActorHandle, kind: EngineKind, peers: Sequence[CachePeer],
                    placement_timeout_s: float) -> InstalledCaches | None:
        """Caches into the node of `new`, an engine of `kind`, from a peer on another node that
        offers any (asked as `peers_in_turn` orders them); None when none did (or another start
        of that kind there brought them)."""
        try:
            node = await self._node_of(new, placement_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the start itself will say what is wrong
            log.warning("no start caches: the engine's node is unknown (%s)", exc)
            return None
        if (node, kind) in self._bringing:
            await asyncio.wait([self._bringing[node, kind]], timeout=self.timeout_s)
            return None
        asked = peers_in_turn(peers, kind, next(self._brings))
        bringing = self._bringing[node, kind] = asyncio.ensure_future(
            asyncio.wait_for(self._bring(new, node, asked), self.timeout_s))
        try:
            return await bringing
        except TimeoutError:
            log.warning("no start caches for node %s within %.0f s", node, self.timeout_s)
            return None
        finally:
            del self._bringing[node, kind]

    async def _bring(self, new: ray.actor.ActorHandle, node: str, peers: Sequence[ray.actor.ActorHandle]
                     ) -> InstalledCaches | None:
        step = self.step_timeout_s
        wanted = None
        for peer in peers:
            try:
                if await self._node_of(peer, step) == node:
                    continue  # shares this node's caches already
                wanted = wanted or await asyncio.wait_for(new.cache_manifest.remote(), step)
                caches = await asyncio.wait_for(peer.export_caches.remote(wanted), step)
                if caches is None or not caches.units:
                    continue  # another GPU type or other versions, or nothing the node lacks
                # Units land whole, so a start that goes on while this is cut short reads each or none.
                installed = await asyncio.wait_for(new.install_caches.remote(caches), step)
            except Exception as exc:  # noqa: BLE001 - a dead or slow peer: the next one
                log.warning("start caches not brought from a peer: %r", exc)
                continue
            if not installed.units:
                if installed.refused:
                    continue  # not the cluster's, or nothing of it fit
                return None  # another bring to this node installed them first
            log.info("start caches for node %s: %d units, %.1f MiB (%d refused)",
                     node, installed.units, installed.bytes / 2**20, installed.refused)
            return installed
        return None
