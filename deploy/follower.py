"""A router that owns nothing (`pdcluster launch --router-only`): it serves the engines another
launcher on the same Ray cluster owns, side by side with that launcher's router, behind any
TCP/HTTP balancer.

`FleetFollower` looks at the cluster's named actors every `interval_s`: engines of the served
models that prove the cluster's secret are registered in the state their host reports (ready,
standing by, asleep, draining: the owner's pool controller moves them), engines that are gone
are removed, and the store shards' endpoints and restarts are followed. It never starts, stops
or moves an actor: scaling is the owner's alone (one pool controller per cluster), and the
engines outlive this router. What every router of a cluster shares comes from the engines and
Ray: each keeps its own KV index from the engines' KV events (router/kv_event_listener.py), and the
per-key limits are kept in the cluster's admission ledger (deploy/admission_ledger.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ray

from deploy.actor_proof import proven_actors
from deploy.admission_ledger import LEDGER_NAME
from deploy.periodic import every
from deploy.store_shards import STORE_SHARD_PREFIX
from deploy.topology import ROLES
from engine.lifecycle import STANDBY_STATES, EngineDescription, InstanceState
from fleet.instances import InstanceRegistry, described_instance
from security.credentials import ClusterCredentials
from security.engine_access import EngineAccessRefused

log = logging.getLogger(__name__)
# The states an engine's host reports that the router mirrors; FAILED is the router's own verdict
# (its health checks), which a host that still says "ready" does not overrule.
REASK_S = 60.0
"""How long an actor that did not prove the secret is left alone before it is asked again."""
HOST_STATES = {InstanceState.READY, InstanceState.DRAINING, *STANDBY_STATES}


class FleetFollower:
    """Keeps `registry` equal to the fleet of the models `served` ((model path, served name)
    pairs) that the cluster runs; `on_store_restart` runs when a shard came back empty."""

    def __init__(self, registry: InstanceRegistry, credentials: ClusterCredentials, served: set[tuple[str, str]],
                 on_store_restart: Callable[[], None] = lambda: None, timeout_s: float = 10.0) -> None:
        self.registry = registry
        self.credentials = credentials
        self.served = served
        self.on_store_restart = on_store_restart
        self.timeout_s = timeout_s
        self.store_endpoints: tuple[str, ...] = ()
        self._proven: dict[str, str] = {}  # actor id -> name, for actors that proved the secret once
        self._refused: dict[str, float] = {}  # actor id -> when it last failed to prove it
        self._boots: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None

    async def sync(self) -> None:
        """One look at the cluster: register, update and remove instances; follow the shards."""
        handles = await asyncio.to_thread(_named_actors)  # GCS calls: never on the router's event loop
        now = time.monotonic()
        unknown = {n: h for n, h in handles.items() if h._actor_id.hex() not in self._proven
                   and now - self._refused.get(h._actor_id.hex(), -REASK_S) >= REASK_S}
        proven = await proven_actors(self.credentials, unknown, self.timeout_s)
        for name, handle in unknown.items():
            if name in proven:
                self._proven[handle._actor_id.hex()] = name
            else:  # an impostor, or an actor too busy to answer: asked again in REASK_S
                self._refused[handle._actor_id.hex()] = now
        ours = {n: h for n, h in handles.items() if self._proven.get(h._actor_id.hex()) == n}
        shards = {n: h for n, h in ours.items() if n.startswith(STORE_SHARD_PREFIX)}
        engines = {n: h for n, h in ours.items() if n not in shards}
        await asyncio.gather(self._follow_engines(engines), self._follow_shards(shards))

    async def _follow_engines(self, engines: dict) -> None:
        answers = await asyncio.gather(*(asyncio.wait_for(h.describe.remote(), self.timeout_s)
                                         for h in engines.values()), return_exceptions=True)
        described = dict(zip(engines, answers, strict=True))
        # Named and proven, but not answering this time (busy, a slow node): kept as they are.
        seen = {name for name, answer in described.items() if not isinstance(answer, EngineDescription)}
        for name, engine in described.items():
            if name in seen or not engine.serves(self.served) or engine.state not in HOST_STATES:
                continue  # another model's; starting, stopping: not to be served yet, or any more
            seen.add(name)
            instance = self.registry.get(name)
            if instance is None:
                try:
                    self.registry.add(described_instance(engine, ROLES[engine.role], self.credentials))
                except EngineAccessRefused as exc:  # proven actor, endpoint not its host's: never sent to
                    log.error("not following %s: %s", name, exc)
                    continue
                log.info("following %s (%s) at %s", name, engine.state.value, engine.url)
            elif not (instance.state == InstanceState.FAILED and engine.state == InstanceState.READY):
                self.registry.set_state(instance, engine.state)  # its health checks' FAILED stays
        for instance in self.registry.all():
            if instance.instance_id not in seen:
                log.info("%s left the cluster's fleet", instance.instance_id)
                self.registry.remove(instance.instance_id)

    async def _follow_shards(self, shards: dict) -> None:
        answers = await asyncio.gather(*(asyncio.wait_for(h.membership.remote(), self.timeout_s)
                                         for h in shards.values()), return_exceptions=True)
        live = {name: a for name, a in zip(shards, answers, strict=True) if isinstance(a, dict)}
        if any(self._boots.get(n, a["boot_id"]) != a["boot_id"] for n, a in live.items()):
            self.on_store_restart()
        self._boots = {n: a["boot_id"] for n, a in live.items()}
        self.store_endpoints = tuple(sorted(a["endpoint"] for a in live.values()))

    def start(self, interval_s: float = 2.0) -> None:
        self._task = every(interval_s, self.sync, "following the cluster's fleet")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _named_actors() -> dict[str, ray.actor.ActorHandle]:
    return {name: ray.get_actor(name) for name in ray.util.list_named_actors() if name != LEDGER_NAME}
