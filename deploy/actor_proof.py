"""Which named actors in pdcluster's Ray namespace are ours: an engine or store shard proves it
holds the cluster's secret by answering a fresh challenge. A launcher adopting what a dead one
left (deploy/launcher.py) and a router that owns nothing (deploy/follower.py) trust no other."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets

import ray

from deploy.store_shards import STORE_SHARD_PREFIX
from security.credentials import ClusterCredentials

log = logging.getLogger(__name__)


async def proven_actors(credentials: ClusterCredentials, handles: dict[str, ray.actor.ActorHandle],
                        timeout_s: float) -> dict[str, ray.actor.ActorHandle]:
    """The actors among `handles` (by name) that answer a fresh challenge with the cluster's proof."""
    nonce = secrets.token_hex(16)
    kinds = {name: "store-shard" if name.startswith(STORE_SHARD_PREFIX) else "engine" for name in handles}
    answers = await asyncio.gather(*(asyncio.wait_for(h.prove.remote(nonce), timeout_s) for h in handles.values()),
                                   return_exceptions=True)
    proven = {}
    for (name, handle), answer in zip(handles.items(), answers, strict=True):
        expected = credentials.prove(kinds[name], nonce)
        if isinstance(answer, str) and hmac.compare_digest(answer, expected):
            proven[name] = handle
        else:
            log.warning("named actor %s does not hold the cluster's secret: not adopted, left alone", name)
    return proven
