"""The pool controller: keeps each pool (a model's instances of one role) between its bounds
and adds capacity fast.

Per pool it watches the router's wait queue for its model, the in-flight requests per ready
instance and, where a pool has a TTFT target, the p90 time to first token of streamed requests;
and grows the pool by the fastest path available:

  1. standby  - an instance started ahead with everything but weights (awake ones first, then
                sleeping ones); activated with a ready peer's weights, its own host copy (an
                instance put to sleep when idle), or disk: well under a second;
  2. pre-imported - a server process that has imported vLLM and waits, holding no GPU memory
                (engine/preimport.py): a start without its imports;
  3. peer     - a new instance whose weights come from a ready peer instead of disk;
  4. disk     - a new instance that reads the checkpoint itself.

Used standbys and pre-imported processes are replaced in the background. A pool shrinks to `min_ready` after `idle_s`
without traffic: the instance leaving drains first (no new requests, then it finishes those it
holds), then stops, or with `idle_sleeps` goes to sleep and waits as a standby that holds ~2 GiB
of GPU memory. `min_ready=0` with a standby or `idle_sleeps` is scale-to-zero with a sub-second
way back. With `max_awake` (several models sharing one GPU) an instance wakes or starts only once
fewer than that many are awake: the longest idle one of another model (none with requests in
flight or waiting, idle for `swap_idle_s`) is put to sleep first, so a request for a sleeping model
waits one swap (~0.5 s for an 8B on an H200), not a cold start; the first time an instance goes to
sleep it also makes its host copy of the weights (7-9 s for an 8B), which that swap waits for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.actor_placement import CoreSets
from engine.config import EngineConfig
from engine.lifecycle import STANDBY_STATES, InstanceState
from engine.role_spec import RoleSpec
from fleet.instances import InstanceRegistry
from router.capacity import CapacityQueue, LatencyWindow

if TYPE_CHECKING:  # deploy.launcher imports ray, which must not happen before use_ray()
    from deploy.launcher import Launcher

log = logging.getLogger(__name__)
REAP_EVERY_S = 5.0
PoolKey = tuple[str, RoleSpec]
"""A pool: its model's served name and its role."""


class PoolSpec(BaseModel):
    """Bounds and triggers of one model's pool of one role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    """The served model name of the pool's instances."""
    role: RoleSpec
    min_ready: int = Field(1, ge=0)
    max_ready: int = Field(1, ge=1)
    standby: int = Field(0, ge=0)
    """Standby instances kept ready to activate."""
    preimported: int = Field(0, ge=0)
    """Pre-imported server processes kept besides (InstanceState.PREIMPORTED): no GPU memory,
    a start from one skips vLLM's imports."""
    standby_sleeps: bool = False
    """Standbys sleep until activated (EngineConfig.sleep_mode): ~2 GiB of GPU memory each
    instead of their share, a wake-up (~0.05 s on an H200) added to the activation."""
    idle_sleeps: bool = False
    """An idle instance above min_ready sleeps (EngineHost.sleep: its weights kept in host
    memory, ~2 GiB of GPU memory held) instead of stopping, and waits as a standby. CUDA only."""
    target_inflight: float = Field(8.0, gt=0)
    """Mean requests in flight per ready instance above which the pool grows."""
    idle_s: float = Field(120.0, gt=0)
    """A pool above min_ready with no request in flight this long loses an instance."""
    drain_s: float = Field(120.0, ge=0)
    """Longest an instance leaving the pool may take to finish its requests, taking no new ones;
    streams still open then go on on another instance (decode/stream_ledger.py)."""
    target_ttft_s: float | None = Field(None, gt=0)
    """p90 time to first token (streamed requests, the router's last 30 s, only those since this
    pool last grew) above which the pool grows. Set on the pool that prefills."""

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        if self.max_ready < self.min_ready:
            raise ValueError(
                f"{self.name} pool: max_ready {self.max_ready} < min_ready {self.min_ready}"
            )
        return self

    @property
    def key(self) -> tuple[str, RoleSpec]:
        return self.model, self.role

    @property
    def name(self) -> str:
        return f"{self.model}/{self.role.name}"


def wants_more(spec: PoolSpec, ready: int, inflight: int, queued: int, growing: int,
               ttft_p90: float | None) -> bool:
    """Whether `spec`'s pool should start one more instance now. Below `min_ready` always; past
    it, one at a time (the effect of an instance still starting is not seen yet) when requests
    wait, when the ready ones carry more than `target_inflight` each, or when first tokens come
    later than `target_ttft_s`."""
    if ready < spec.min_ready:
        return True
    if growing:
        return False
    slow = spec.target_ttft_s is not None and ttft_p90 is not None and ttft_p90 > spec.target_ttft_s
    return queued > 0 or (ready > 0 and inflight / ready > spec.target_inflight) or slow


class PoolController:
    """Owns the scaling task; every instance it starts is owned by the launcher."""

    def __init__(
        self,
        launcher: Launcher,
        registry: InstanceRegistry,
        queue: CapacityQueue,
        specs: list[PoolSpec],
        configs: list[EngineConfig],
        cores: CoreSets | None = None,
        interval_s: float = 0.05,
        first_tokens: LatencyWindow | None = None,
        id_prefix: Callable[[str], str] = lambda model: "",
        max_awake: int | None = None,
        room_timeout_s: float = 30.0,
        swap_idle_s: float = 1.0,
    ) -> None:
        self.launcher = launcher
        self.registry = registry
        self.queue = queue
        self.first_tokens = first_tokens
        self.specs = {spec.key: spec for spec in specs}
        self.configs = {config.served_model_name: config for config in configs}
        """Each model's engine configuration (its role and cores set per instance)."""
        self.id_prefix = id_prefix
        self.max_awake = max_awake
        """Instances awake at most, across pools (Topology.max_awake); None: no bound."""
        self.room_timeout_s = room_timeout_s
        """Longest a grow waits for an awake instance of another model to become idle."""
        self.swap_idle_s = swap_idle_s
        """An instance is put to sleep for another model's only after its model has had no request
        in flight or waiting this long: no swap back and forth on every request."""
        self._reserved = 0
        """Grows under way that `_make_room` let through: awake soon, not registered yet."""
        self._unsleepable: set[str] = set()
        """Instances whose sleep was refused (no host copy of their weights): not asked again."""
        self.interval_s = interval_s
        self._cores = cores or CoreSets([])
        """Each new engine's CPU cores (CPU build; none: vLLM binds)."""
        self._ids = itertools.count()
        self._growing: dict[PoolKey, int] = dict.fromkeys(self.specs, 0)
        self._reserves = {(key, preimported): _Reserve() for key in self.specs for preimported in (False, True)}
        """Each pool's standbys (False) and pre-imported processes (True) being started."""
        self._last_busy: dict[PoolKey, float] = dict.fromkeys(self.specs, time.monotonic())
        self._grown_at: dict[PoolKey, float] = dict.fromkeys(self.specs, 0.0)
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None
        self._reap_asked_at: dict[str, float] = {}
        """When each failed or waiting instance was last asked whether its engine is gone."""
        self._reaping: set[str] = set()
        """Instances being asked now (one question at a time each)."""

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run(), name="pool-controller")
        for model in {spec.model for spec in self.specs.values() if spec.standby or spec.max_ready > spec.min_ready}:
            # Ask a peer for its weights now, not on the first scale-up's critical path.
            self._spawn(self.launcher.peer_weights(model), f"peer-weights-{model}")

    async def stop(self) -> None:
        for task in [self._loop, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._loop, *self._tasks] if t), return_exceptions=True)

    def _spawn(self, work, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        while True:
            for spec in self.specs.values():
                try:
                    self._step(spec)
                except Exception:  # one bad step must not stop scaling
                    log.exception("pool controller step for %s failed", spec.name)
            await asyncio.sleep(self.interval_s)

    def _instances(self, spec: PoolSpec, state: InstanceState) -> list:
        return [i for i in self.registry.all() if (i.model, i.role) == spec.key and i.state == state]

    def _standbys(self, spec: PoolSpec) -> list:
        """Standbys of `spec`'s pool, fastest to activate first: awake, asleep, pre-imported."""
        return [i for state in STANDBY_STATES for i in self._instances(spec, state)]

    def _step(self, spec: PoolSpec) -> None:
        key = spec.key
        self._reap_gone(spec)
        ready = self._instances(spec, InstanceState.READY)
        inflight = sum(i.inflight for i in ready)
        # Requests wait for serving instances; without prefill instances decode prefills locally.
        queued = self.queue.waiting_for[spec.model] if spec.role.waits_on_queue else 0
        if inflight or queued:
            self._last_busy[key] = time.monotonic()
        ttft_p90 = None
        if spec.target_ttft_s is not None and self.first_tokens is not None:
            ttft_p90 = self.first_tokens.quantile(0.9, since=self._grown_at[key])
        grow = wants_more(spec, len(ready), inflight, queued, self._growing[key], ttft_p90)
        if grow and len(ready) + self._growing[key] < spec.max_ready:
            self._growing[key] += 1
            self._spawn(self._grow(spec), f"grow-{spec.name}")
        for preimported, wanted in ((False, spec.standby), (True, spec.preimported)):
            reserve = self._reserves[key, preimported]
            kept = self._instances(spec, InstanceState.PREIMPORTED) if preimported else [
                i for i in self._standbys(spec) if i.state != InstanceState.PREIMPORTED]
            if len(kept) + reserve.starting < wanted and time.monotonic() >= reserve.retry_at:
                reserve.starting += 1
                self._spawn(self._add_standby(spec, preimported), f"standby-{spec.name}")
        idle = time.monotonic() - self._last_busy[key]
        if len(ready) > spec.min_ready and idle > spec.idle_s and not self._growing[key]:
            self._last_busy[key] = time.monotonic()
            leaving = min(reversed(ready), key=lambda i: i.inflight)
            if spec.idle_sleeps:
                self._spawn(self._sleep(leaving.instance_id, spec.drain_s), f"sleep-{spec.name}")
            else:
                self._spawn(self.launcher.stop_instance(leaving.instance_id, spec.drain_s), f"shrink-{spec.name}")

    def _reap_gone(self, spec: PoolSpec) -> None:
        """Failed and waiting (standby) instances whose engine is gone are stopped, so that their
        replacements can take their place: a failed one is replaced as the pool grows below
        min_ready, a standby one as the pool keeps its standbys. Each is asked at most every
        REAP_EVERY_S, one question at a time."""
        now = time.monotonic()
        for instance in self._instances(spec, InstanceState.FAILED) + self._standbys(spec):
            iid = instance.instance_id
            if iid not in self._reaping and now - self._reap_asked_at.get(iid, 0.0) >= REAP_EVERY_S:
                self._reap_asked_at[iid] = now
                self._reaping.add(iid)
                self._spawn(self._reap(iid), f"reap-{iid}")
        for iid in [i for i in self._reap_asked_at if self.registry.get(i) is None and i not in self._reaping]:
            del self._reap_asked_at[iid]  # gone: forgotten

    async def _reap(self, instance_id: str) -> None:
        try:
            await self.launcher.reap(instance_id)
        finally:
            self._reaping.discard(instance_id)

    def _new_id(self, spec: PoolSpec) -> str:
        return f"{self.id_prefix(spec.model)}{spec.role.name}-{int(time.time())}-{next(self._ids)}"

    def _config(self, spec: PoolSpec) -> EngineConfig:
        return self._cores.bound(self.configs[spec.model].model_copy(update={"role": spec.role}))

    async def _grow(self, spec: PoolSpec) -> None:
        decided = time.monotonic()
        reserved = False
        try:
            reserved = await self._make_room(spec)
            peer = await self.launcher.peer_weights(spec.model)
            standbys = self._standbys(spec)
            if standbys:
                instance_id, path = standbys[0].instance_id, standbys[0].state.value
                timeline = await self.launcher.activate(instance_id, peer)
            else:
                instance_id, path = self._new_id(spec), "peer" if peer else "disk"
                started = await self.launcher.start_instances([(instance_id, self._config(spec))], peer=peer,
                                                              progress=False)
                timeline = started[0].timeline
            log.info("%s pool grew by %s via %s in %.3f s (start %.3f s)", spec.name, instance_id, path,
                     time.monotonic() - decided, timeline["total_s"])
        except Exception:
            log.exception("growing the %s pool failed", spec.name)
        finally:
            self._growing[spec.key] -= 1
            self._reserved -= reserved
            self._grown_at[spec.key] = time.monotonic()

    async def _sleep(self, instance_id: str, drain_s: float) -> None:
        try:
            await self.launcher.sleep_instance(instance_id, drain_s)
        except Exception:  # refused (it stays awake) or failed (it was stopped): the launcher says which
            log.exception("%s could not sleep", instance_id)
            self._unsleepable.add(instance_id)

    def _awake(self) -> list:
        """Instances holding their GPU memory: ready, coming up, or leaving."""
        holding = (InstanceState.READY, InstanceState.LOADING, InstanceState.WARMING, InstanceState.DRAINING)
        return [i for i in self.registry.all() if i.state in holding]

    async def _make_room(self, spec: PoolSpec) -> bool:
        """Under `max_awake`, put idle instances of other models to sleep (the longest idle
        first) until one more may be awake, and hold that room (True: the caller releases it);
        raises after `room_timeout_s` with none idle."""
        if self.max_awake is None:
            return False
        deadline = time.monotonic() + self.room_timeout_s
        while len(self._awake()) + self._reserved >= self.max_awake:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.max_awake} instance(s) awake and none idle for {self.room_timeout_s:g} s")
            now = time.monotonic()
            idle = [i for i in self.registry.ready() if i.model != spec.model and not i.inflight
                    and i.instance_id not in self._unsleepable and self.queue.waiting_for[i.model] == 0
                    and now - self._last_busy.get((i.model, i.role), 0.0) >= self.swap_idle_s
                    and self.specs.get((i.model, i.role), spec).idle_sleeps]
            if idle:
                leaving = min(idle, key=lambda i: self._last_busy.get((i.model, i.role), 0.0))
                log.info("%s pool: %s goes to sleep to make room", spec.name, leaving.instance_id)
                await self._sleep(leaving.instance_id, drain_s=0.0)
                if leaving.state == InstanceState.SLEEPING:
                    continue
            await asyncio.sleep(self.interval_s)  # none idle, or it took a request meanwhile
        self._reserved += 1  # no await since the check: no other grow took this room
        return True

    async def _add_standby(self, spec: PoolSpec, preimported: bool = False) -> None:
        reserve = self._reserves[spec.key, preimported]
        try:
            sleeps = spec.idle_sleeps or (spec.standby_sleeps and not preimported)
            config = self._config(spec).model_copy(update={"sleep_mode": sleeps})
            await self.launcher.start_standby(self._new_id(spec), config, preimported=preimported)
            reserve.failures = 0
        except Exception:
            reserve.failures += 1
            reserve.retry_at = time.monotonic() + min(60.0, 2.0**reserve.failures)
            log.exception("starting a %s %s failed (%d in a row)", spec.name,
                          "pre-imported process" if preimported else "standby", reserve.failures)
        finally:
            reserve.starting -= 1


@dataclasses.dataclass
class _Reserve:
    """Standbys (or pre-imported processes) of one pool being started. After a failed start the
    next waits 2, 4, ... 60 s: no storm of starts."""

    starting: int = 0
    failures: int = 0
    retry_at: float = 0.0
