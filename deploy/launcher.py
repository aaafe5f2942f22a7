"""Starting pdcluster's engines on Ray (joined or started by deploy/ray_head.py): the engine
actors, their starts, their registration with the router.

`Launcher` owns every actor it creates and stops them all on `shutdown()`. Every start is timed
stage by stage: a Prometheus histogram per path and stage, and one JSON line per start in
`start_log`.

Engines and store shards (deploy/store_shards.py) are detached, named actors in the `pdcluster`
namespace: a launcher that dies without `shutdown()` (the router process killed, OOM) leaves them
serving, and the next launcher on the same Ray cluster adopts them (`adopt()`, only actors that
prove the cluster's secret) instead of starting cold ones. (With a Ray head of its own, the head,
and so everything, goes down with the process anyway.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import ray
from prometheus_client import Histogram
from rich.console import Console
from rich.live import Live
from rich.table import Table

from deploy.actor_placement import placement_options
from deploy.actor_proof import proven_actors
from deploy.admission_ledger import LEDGER_NAME
from deploy.draining import drained, end_engines, undrained
from deploy.node_caches import CACHES_TIMEOUT_S, CacheCourier, CachePeer, EngineKind
from deploy.store_shards import STORE_SHARD_PREFIX, StoreShards
from deploy.topology import ROLES
from engine.config import EngineConfig
from engine.environment import is_cpu_build
from engine.host import EngineHost, SleepRefused
from engine.lifecycle import EngineDescription, InstanceState
from engine.role_spec import Role, RoleSpec
from engine.weights import PeerWeights
from fleet.instances import InstanceRegistry, described_instance
from router.status_model import StartRecord
from security.credentials import ClusterCredentials
from security.engine_access import EngineAccessRefused

log = logging.getLogger(__name__)
EngineActor = ray.remote(EngineHost)
START_SECONDS = Histogram(
    "pdcluster_engine_start_stage_seconds",
    "Engine start stages by path (disk, peer, standby_start, standby, preimport, preimported); stage 'total' is "
    "the sum.",
    ["path", "stage"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320),
)


@dataclass
class StartedInstance:
    instance_id: str
    actor: ray.actor.ActorHandle
    url: str
    role: RoleSpec
    timeline: dict


class Launcher:
    """Creates engine actors, waits for them to be ready, registers them with the router."""

    def __init__(self, registry: InstanceRegistry, credentials: ClusterCredentials, console: Console | None = None,
                 start_log: Path | None = None):
        self.registry = registry
        self.credentials = credentials
        """The cluster's: engines and shards get keys derived from it; adopted actors must prove
        they are the cluster's with theirs."""
        self.console = console or Console(stderr=True)
        self.start_log = start_log
        self.on_start: list[Callable[[StartRecord], None]] = []
        """Called with each finished start (the router's status view keeps the last ones)."""
        self.instances: dict[str, StartedInstance] = {}
        self._actors: dict[str, ray.actor.ActorHandle] = {}
        self._adopted: set[str] = set()  # engines a launcher before this one started
        self._descriptors: dict[str, PeerWeights] = {}
        self._not_peers: set[str] = set()
        """Weight descriptors of ready instances, by instance id (see peer_weights)."""
        self.store = StoreShards(credentials, self.console, self._engine_nodes)
        self.caches = CacheCourier()

    async def start_store_shards(self, capacity_bytes: int, fault_injection: bool = False) -> tuple[str, ...]:
        """One KV store shard on this node and every node that will host engines (deploy/store_shards.py)."""
        return await self.store.start(capacity_bytes, fault_injection)

    def watch_store(self) -> None:
        self.store.watch()

    async def _engine_nodes(self, timeout_s: float) -> set[str]:
        """The Ray nodes our engines run on (a store shard is kept on each)."""
        answers = await asyncio.gather(*(asyncio.wait_for(a.node_id.remote(), timeout_s)
                                         for a in self._actors.values()), return_exceptions=True)
        return {node for node in answers if isinstance(node, str)}

    async def adopt(self, configs: list[EngineConfig], roles: Collection[Role], keep_store: bool,
                    timeout_s: float = 10.0) -> tuple[str, ...]:
        """Take over what a launcher that died left on this Ray cluster: its ready and standby
        engines of the models of `configs` in the topology's `roles` are registered as they are
        (weights, KV cache and all); its store shards are kept if `keep_store`, the new fleet's own
        (StoreShards.reconcile then keeps those that answer, where engines run). Any other engine of
        ours there (another model, role or tensor-parallel size, a start cut short, one that does not
        answer, one whose use of the store differs) is stopped.
        Only actors that prove they hold the cluster's secret are ours: a named actor anyone else put
        in the namespace is neither adopted nor used."""
        started = time.monotonic()
        handles = {name: ray.get_actor(name) for name in ray.util.list_named_actors() if name != LEDGER_NAME}
        if not handles:
            return ()
        ours = await proven_actors(self.credentials, handles, timeout_s)
        shards = {n: h for n, h in ours.items() if n.startswith(STORE_SHARD_PREFIX)}
        engines = {n: h for n, h in ours.items() if n not in shards}
        answers = dict(zip(engines, await asyncio.gather(
            *(asyncio.wait_for(h.describe.remote(), timeout_s) for h in engines.values()),
            return_exceptions=True), strict=True))
        adopted, ended = [], []
        served = {(str(c.model), c.served_model_name) for c in configs}
        sizes = {c.served_model_name: c.tensor_parallel for c in configs}
        for name, actor in engines.items():
            described = answers[name]
            if not (isinstance(described, EngineDescription) and described.serves(served)
                    and (described.state == InstanceState.READY or described.state.is_standby)
                    and described.role in roles  # a P/D engine's connector in a colocated fleet, or back
                    # an engine of another size would share no KV chunk or weight shard with the new ones
                    and described.tensor_parallel_size == sizes[described.served_model_name].for_role(described.role)
                    # its KV connector is fixed at its start: one without the store in a fleet with one would
                    # never load what the others saved (nor save for them), and one with it needs the shards
                    and described.kv_store == keep_store):
                ended.append(actor)
                continue
            try:
                self._register(name, actor, described, {})
            except EngineAccessRefused:  # proven, but its endpoint not sealed by its host
                ended.append(actor)
                continue
            self._actors[name] = actor
            self._adopted.add(name)
            adopted.append(name)
        await end_engines(ended)
        self.store.adopt(shards, keep_store)
        self.console.print(f"adopted {len(adopted)} engine(s) {adopted} and {len(self.store.shards)} store shard(s) "
                           f"in {time.monotonic() - started:.2f} s; stopped {len(ended)} engine(s) that did not fit")
        return tuple(adopted)

    def _register(self, instance_id: str, actor: ray.actor.ActorHandle, described: EngineDescription,
                  timeline: dict) -> StartedInstance:
        """Keep a started or adopted engine; register it with the router."""
        instance = described_instance(described, ROLES[described.role], self.credentials)
        record = StartedInstance(instance_id, actor, instance.url, instance.role, timeline)
        self.instances[instance_id] = record
        self.registry.add(instance)
        return record

    def _create_actor(self, config: EngineConfig, instance_id: str) -> ray.actor.ActorHandle:
        options = placement_options(config.role, gpus=0 if is_cpu_build() else config.num_gpus)
        actor = EngineActor.options(
            name=instance_id, lifetime="detached", max_concurrency=64, **options
        ).remote(config, instance_id, keys=self.credentials.engine_host_keys(instance_id))
        self._actors[instance_id] = actor
        return actor

    async def start_instances(
        self,
        configs: list[tuple[str, EngineConfig]],
        placement_timeout_s: float = 900.0,
        peer: PeerWeights | None = None,
        standby: bool = False,
        progress: bool = True,
        preimported: bool = False,
    ) -> list[StartedInstance]:
        """Start one engine per (instance_id, config) concurrently, showing their progress; with
        weights from `peer` (a descriptor of `peer_weights()`) or disk, as standbys without, or
        only up to their imports (`preimported`).

        An engine Ray cannot place within `placement_timeout_s` (no node offers its role's
        resource, and the autoscaler added none) fails the start; so does a failed engine. Only one
        start at a time may show `progress` (a live table); the pool controller's starts do not."""
        if not configs:
            return []
        actors = {iid: self._create_actor(cfg, iid) for iid, cfg in configs}
        kinds = {iid: EngineKind(cfg.served_model_name, cfg.role.name, cfg.tensor_parallel_size) for iid, cfg in configs}
        starts = {iid: asyncio.ensure_future(self._start(actor, kinds[iid], standby, peer, preimported, placement_timeout_s))
                  for iid, actor in actors.items()}
        deadline = (time.monotonic() + placement_timeout_s + max(cfg.start_timeout_s for _, cfg in configs)
                    + CACHES_TIMEOUT_S)
        live = (
            Live(self._progress_table(actors, {}), console=self.console, transient=True) if progress else None
        )
        try:
            with live or contextlib.nullcontext():
                while not all(task.done() for task in starts.values()):
                    if time.monotonic() > deadline:
                        waiting = sorted(iid for iid, task in starts.items() if not task.done())
                        raise TimeoutError(f"engines not started in time (no node for their role?): {waiting}; "
                                           "raise --placement-timeout")
                    if live is not None:
                        live.update(self._progress_table(actors, await self._describe_all(actors)))
                    await asyncio.wait(list(starts.values()), timeout=0.5)
        except BaseException:  # timed out, or cancelled (a shutdown): no start left to fail unheard
            for task in starts.values():
                task.cancel()
            raise
        failed = {iid: task.exception() for iid, task in starts.items() if task.exception()}
        for instance_id, exc in failed.items():  # their engines are stopped already; end the actors too
            ray.kill(self._actors.pop(instance_id))
            self._append_to_start_log({"instance_id": instance_id, "path": "failed", "error": str(exc)})
        if failed:
            raise next(iter(failed.values()))  # EngineStartError with the engine's log tail
        started = []
        for instance_id, task in starts.items():
            timeline = task.result()
            described = await actors[instance_id].describe.remote()
            started.append(self._register(instance_id, actors[instance_id], described, timeline))
            path = ("preimport" if preimported else "standby_start" if standby
                    else timeline["details"].get("weights_source", "disk"))
            self._record(instance_id, path.split("/")[0], timeline)
        return started

    async def _start(self, actor: ray.actor.ActorHandle, kind: EngineKind, standby: bool, peer: PeerWeights | None,
                     preimported: bool, placement_timeout_s: float) -> dict:
        """One engine's start (or pre-import), after its node's caches came from a ready engine on
        another node, if there is one (deploy/node_caches.py)."""
        ready = [CachePeer(self.instances[i.instance_id].actor, EngineKind(i.model, i.role.name, i.tensor_parallel_size))
                 for i in self.registry.ready() if i.instance_id in self.instances]
        installed = await self.caches.bring(actor, kind, ready, placement_timeout_s)
        timeline = await (actor.preimport.remote() if preimported else actor.start.remote(standby=standby, peer=peer))
        if installed is not None:
            timeline["details"]["node_caches"] = f"{installed.units} units, {installed.bytes / 2**20:.1f} MiB from a peer"
        return timeline

    async def start_standby(self, instance_id: str, config: EngineConfig, preimported: bool = False
                            ) -> StartedInstance:
        """An instance with everything but weights, registered as STANDBY, or SLEEPING with
        `sleep_mode`; or, if `preimported`, a server process that has only imported vLLM, holding no
        GPU memory (PREIMPORTED). Either gets no traffic until `activate()`."""
        return (await self.start_instances([(instance_id, config)], standby=True, progress=False,
                                           preimported=preimported))[0]

    async def activate(self, instance_id: str, peer: PeerWeights | None) -> dict:
        """Give a standby its weights (from `peer`, else disk) and put it in rotation."""
        record = self.instances[instance_id]
        instance = self.registry.get(instance_id)
        if instance is None or not instance.state.is_standby:
            raise RuntimeError(f"{instance_id} is not a registered standby")
        path = "preimported" if instance.state == InstanceState.PREIMPORTED else "standby"
        self.registry.set_state(instance, InstanceState.LOADING)  # no second activation of the same standby
        try:
            timeline = await record.actor.activate.remote(peer)
        except Exception:
            self.registry.set_state(instance, InstanceState.FAILED)
            raise
        self.registry.set_state(instance, InstanceState.READY)
        record.timeline = timeline
        self._record(instance_id, path, timeline)
        return timeline

    async def peer_weights(self, model: str) -> PeerWeights | None:
        """A weight descriptor of some ready instance of `model` (None if none can offer one). A
        descriptor does not change while its instance lives, so each is asked for once; the
        first ask sets up the peer's side (a NIXL agent: ~0.5 s on the CPU build)."""
        for instance in self.registry.ready(model=model):
            record = self.instances.get(instance.instance_id)
            if record is None or instance.instance_id in self._not_peers:
                continue
            if instance.instance_id in self._descriptors:
                return self._descriptors[instance.instance_id]
            try:
                descriptor = await asyncio.wait_for(record.actor.export_weights.remote(), 30)
            except Exception as exc:  # try the next peer; disk is the last resort
                log.warning("peer %s cannot offer its weights: %s", instance.instance_id, exc)
                self._not_peers.add(instance.instance_id)  # e.g. a woken sleeper (no CUDA IPC): not asked again
                continue
            self._descriptors[instance.instance_id] = descriptor
            return descriptor
        return None

    async def stop_instance(self, instance_id: str, drain_s: float = 0.0) -> None:
        """Take an instance out of rotation, let it finish what it holds (at most `drain_s`; what
        is left then goes on elsewhere, decode/stream_ledger.py), stop its engine, end its actor."""
        instance, actor = self.registry.get(instance_id), self._actors.get(instance_id)
        try:
            if instance is not None:
                await drained(self.registry, instance, actor, drain_s)
            if actor is not None:
                await end_engines([actor])
        finally:  # also when cancelled (a shutdown stops the pool controller first): no actor left behind
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            self._actors.pop(instance_id, None)
            self.instances.pop(instance_id, None)
            self._descriptors.pop(instance_id, None)
            self.registry.remove(instance_id)

    async def reap(self, instance_id: str) -> bool:
        """Stop an instance whose engine process has exited (killed, crashed) or whose actor is
        gone, so that its place (its GPU, its role's resource) is free for a replacement; True if
        it did. One that is only unresponsive (frozen, overloaded) is left: it may come back."""
        actor = self._actors.get(instance_id)
        try:
            described = await asyncio.wait_for(actor.describe.remote(), 4) if actor is not None else None
        except ray.exceptions.ActorDiedError:  # the actor itself is gone
            described = None
        except Exception:  # no answer, or unavailable for now (its node cut off): not known to be dead
            return False
        if described is not None and not described.exited:
            return False
        log.warning("%s: its engine is gone; stopping it to free its place", instance_id)
        await self.stop_instance(instance_id)
        return True

    async def sleep_instance(self, instance_id: str, drain_s: float) -> None:
        """Take a ready instance out of rotation, let it finish what it holds, and put it to sleep
        (EngineHost.sleep): it waits as a SLEEPING standby that `activate()` wakes. One still busy
        after `drain_s`, or that could not keep a host copy of its weights (SleepRefused, raised),
        goes back into rotation awake; one whose sleep failed otherwise is stopped."""
        instance, record = self.registry.get(instance_id), self.instances.get(instance_id)
        if instance is None or record is None or instance.state != InstanceState.READY:
            return
        if not await drained(self.registry, instance, record.actor, drain_s):
            await undrained(self.registry, instance, record.actor)
            return
        self._descriptors.pop(instance_id, None)
        try:
            timeline = await record.actor.sleep.remote()
        except SleepRefused:
            await undrained(self.registry, instance, record.actor)
            raise
        except Exception:
            await self.stop_instance(instance_id)  # half asleep, or gone: not to be served again
            raise
        self.registry.set_state(instance, InstanceState.SLEEPING)
        self.console.print(f"[green]{instance_id}[/] asleep in {timeline['total_s']:.2f} s "
                           + " ".join(f"{k}={v:.2f}" for k, v in timeline["stages_s"].items()))

    def _record(self, instance_id: str, path: str, timeline: dict) -> None:
        for stage, seconds in timeline["stages_s"].items():
            START_SECONDS.labels(path, stage).observe(seconds)
        START_SECONDS.labels(path, "total").observe(timeline["total_s"])
        record = StartRecord(instance_id=instance_id, role=self.instances[instance_id].role.name, path=path,
                             started_at=timeline["started_at"], total_s=timeline["total_s"],
                             stages_s=timeline["stages_s"])
        for callback in self.on_start:
            callback(record)
        self._append_to_start_log({"instance_id": instance_id, "path": path, **timeline})
        self.console.print(
            f"[green]{instance_id}[/] {path}: {timeline['total_s']:.2f} s "
            + " ".join(f"{k}={v:.2f}" for k, v in timeline["stages_s"].items())
        )

    def _append_to_start_log(self, entry: dict) -> None:
        """One start (its timeline), or one failed start (path "failed", the error with its engine's
        log tail), as a line of JSON."""
        if self.start_log is not None:
            self.start_log.parent.mkdir(parents=True, exist_ok=True)
            with self.start_log.open("a") as out:
                out.write(json.dumps(entry) + "\n")

    @staticmethod
    async def _describe_all(actors: dict[str, ray.actor.ActorHandle]) -> dict[str, EngineDescription]:
        results = await asyncio.gather(
            *(asyncio.wait_for(a.describe.remote(), 2) for a in actors.values()),
            return_exceptions=True,
        )
        return {iid: r for iid, r in zip(actors, results, strict=False) if isinstance(r, EngineDescription)}

    @staticmethod
    def _progress_table(actors: dict, described: dict[str, EngineDescription]) -> Table:
        table = Table(title="starting engines", show_edge=False)
        for column in ("instance", "role", "state", "stage done", "elapsed"):
            table.add_column(column)
        for instance_id in actors:
            engine = described.get(instance_id)
            table.add_row(instance_id, *((engine.role.value, engine.state.value, engine.last_stage,
                                          f"{engine.elapsed_s:.1f} s") if engine else ("", "starting", "", "")))
        return table

    async def shutdown(self, keep_adopted: bool = False) -> None:
        """Stop every engine this launcher created and the store's shards; with `keep_adopted`
        (a router restart that failed) leave what it adopted serving, for the next attempt."""
        kept = self._adopted if keep_adopted else set()
        for name, actor in self._actors.items():
            if name not in self.instances:  # its start is cut short (it may wait for a place): no stop to ask
                ray.kill(actor)
        await end_engines([a for name, a in self._actors.items() if name not in kept and name in self.instances])
        for instance_id in self._actors:
            self.registry.remove(instance_id)
        self._actors.clear()
        self.instances.clear()
        self._descriptors.clear()
        if kept:
            log.warning("left %d adopted engine(s) and the store's shards serving: %s", len(kept), sorted(kept))
        await self.store.stop(keep_serving=bool(kept))
