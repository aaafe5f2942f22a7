"""Taking engine actors out of service (deploy/launcher.py): a drain (out of rotation, here and at
the host, until the engine runs nothing), the way back into rotation when a drain ends in neither a
stop nor a sleep, and the end of engines and their actors."""

from __future__ import annotations

import asyncio
import contextlib
import time

import ray

from engine.lifecycle import InstanceState
from fleet.instances import Instance, InstanceRegistry


async def drained(registry: InstanceRegistry, instance: Instance, actor: ray.actor.ActorHandle | None,
                  drain_s: float) -> bool:
    """Out of rotation (DRAINING, here and at its host, where every other router of the cluster
    reads it) until it runs no request, whichever router sent it (the engine's own count), or
    `drain_s` passed; whether it is idle."""
    registry.set_state(instance, InstanceState.DRAINING)
    if actor is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(actor.set_draining.remote(True), 10)
    deadline = time.monotonic() + drain_s
    while time.monotonic() < deadline:
        if not instance.inflight and await engine_idle(actor, deadline - time.monotonic()):
            return True
        await asyncio.sleep(0.2)
    return not instance.inflight and await engine_idle(actor, 1.0)


async def engine_idle(actor: ray.actor.ActorHandle | None, timeout_s: float) -> bool:
    """Whether the engine runs or queues no request. An actor that is gone runs nothing; one that
    does not answer in time (overloaded) or is unavailable for now (its node cut off) is not idle."""
    if actor is None:
        return True
    try:
        return await asyncio.wait_for(actor.requests_in_flight.remote(), max(timeout_s, 0.1)) == 0
    except ray.exceptions.ActorDiedError:
        return True
    except Exception:
        return False


async def undrained(registry: InstanceRegistry, instance: Instance, actor: ray.actor.ActorHandle) -> None:
    """Back into rotation after a drain that did not end in a stop or a sleep (unless a health
    check moved it meanwhile)."""
    registry.set_state(instance, InstanceState.READY, unless_moved_from=InstanceState.DRAINING)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(actor.set_draining.remote(False), 10)


async def end_engines(actors: list[ray.actor.ActorHandle]) -> None:
    """Stop the engines' processes (concurrently, 30 s at most), then end their actors."""
    await asyncio.gather(*(asyncio.wait_for(a.stop.remote(), 30) for a in actors), return_exceptions=True)
    for actor in actors:
        ray.kill(actor)
