"""A new node's start caches from a ready engine on another node (engine/node_caches.py), before
the first engine there starts: with them its compile, kernel and startup-plan work is read, not
redone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import ray

from engine.node_caches import InstalledCaches

log = logging.getLogger(__name__)


async def bring_caches(new: ray.actor.ActorHandle, peers: Iterable[ray.actor.ActorHandle],
                       timeout_s: float = 120.0) -> InstalledCaches | None:
    """Install into `new`'s node what the first of `peers` on another node with the same GPU type
    and versions has in its caches and that node lacks. None if no peer had any to give; a peer
    that fails or is slow is passed over, and the start goes on without (caches only save time).
    `timeout_s` counts from `new`'s placement (an autoscaler may take minutes to add its node)."""
    try:
        node = await new.node_id.remote()
        return await asyncio.wait_for(_bring(new, node, peers), timeout_s)
    except Exception as exc:  # noqa: BLE001 - never a reason for a start to fail
        log.warning("no start caches from a peer: %s", exc)
        return None


async def _bring(new: ray.actor.ActorHandle, node: str, peers: Iterable[ray.actor.ActorHandle]
                 ) -> InstalledCaches | None:
    wanted = None
    for peer in peers:
        if await peer.node_id.remote() == node:
            continue  # shares this node's caches already
        wanted = wanted or await new.cache_manifest.remote()
        caches = await peer.export_caches.remote(wanted)
        if caches is None:
            continue  # another GPU type or other versions
        if not caches.files:
            return None  # the node has what a peer would give
        installed = await new.install_caches.remote(caches)
        log.info("start caches from a peer: %d files, %.1f MiB (%d refused)",
                 installed.files, installed.bytes / 2**20, installed.refused)
        return installed
    return None
