"""The pool controller: keeps each role's pool between its bounds and adds capacity fast.

Per role it watches the router's wait queue, the in-flight requests per ready instance and, where
a pool has a TTFT target, the p90 time to first token of streamed requests; and grows the pool
by the fastest path available:

  1. standby  - an instance started ahead with everything but weights; activated with a ready
                peer's weights (or from disk) in well under a second on the CPU build;
  2. peer     - a new instance whose weights come from a ready peer instead of disk;
  3. disk     - a new instance that reads the checkpoint itself.

Used standbys are replaced in the background. A pool shrinks to `min_ready` after `idle_s`
without traffic; `min_ready=0` with a standby is scale-to-zero with a sub-second way back. An
instance leaving drains first: no new requests, then it stops once those it holds are done.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig
from engine.lifecycle import InstanceState
from engine.roles import RoleSpec
from router.instances import CapacityQueue, InstanceRegistry, LatencyWindow

if TYPE_CHECKING:  # deploy.launcher imports ray, which must not happen before use_ray()
    from deploy.launcher import Launcher

log = logging.getLogger(__name__)


class PoolSpec(BaseModel):
    """Bounds and triggers of one role's pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: RoleSpec
    min_ready: int = Field(1, ge=0)
    max_ready: int = Field(1, ge=1)
    standby: int = Field(0, ge=0)
    """Standby instances kept ready to activate."""
    standby_sleeps: bool = False
    """Standbys sleep until activated (EngineConfig.sleep_mode): ~2 GiB of GPU memory each
    instead of their share, a wake-up (~0.05 s on an H200) added to the activation."""
    target_inflight: float = Field(8.0, gt=0)
    """Mean requests in flight per ready instance above which the pool grows."""
    idle_s: float = Field(120.0, gt=0)
    """A pool above min_ready with no request in flight this long loses an instance."""
    drain_s: float = Field(120.0, ge=0)
    """Longest an instance leaving the pool may take to finish its requests, taking no new ones;
    streams still open then go on on another instance (router/migration.py)."""
    target_ttft_s: float | None = Field(None, gt=0)
    """p90 time to first token (streamed requests, the router's last 30 s, only those since this
    pool last grew) above which the pool grows. Set on the pool that prefills."""

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        if self.max_ready < self.min_ready:
            raise ValueError(
                f"{self.role.name} pool: max_ready {self.max_ready} < min_ready {self.min_ready}"
            )
        return self


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
        config: EngineConfig,
        core_sets: list[str] | None = None,
        interval_s: float = 0.05,
        first_tokens: LatencyWindow | None = None,
    ) -> None:
        self.launcher = launcher
        self.registry = registry
        self.queue = queue
        self.first_tokens = first_tokens
        self.specs = {spec.role: spec for spec in specs}
        self.config = config
        self.interval_s = interval_s
        self._cores = itertools.cycle(core_sets or [None])
        self._ids = itertools.count()
        self._growing: dict[RoleSpec, int] = {role: 0 for role in self.specs}
        self._standby_starting: dict[RoleSpec, int] = {role: 0 for role in self.specs}
        self._standby_failures: dict[RoleSpec, int] = {role: 0 for role in self.specs}
        self._standby_retry_at: dict[RoleSpec, float] = {role: 0.0 for role in self.specs}
        """After a failed standby start, the next waits 2, 4, ... 60 s: no storm of starts."""
        self._last_busy: dict[RoleSpec, float] = {role: time.monotonic() for role in self.specs}
        self._grown_at: dict[RoleSpec, float] = {role: 0.0 for role in self.specs}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run(), name="pool-controller")
        if any(spec.standby or spec.max_ready > spec.min_ready for spec in self.specs.values()):
            # Ask a peer for its weights now, not on the first scale-up's critical path.
            self._spawn(self.launcher.peer_weights(), "peer-weights")

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
                    log.exception("pool controller step for %s failed", spec.role.name)
            await asyncio.sleep(self.interval_s)

    def _instances(self, role: RoleSpec, state: InstanceState) -> list:
        return [i for i in self.registry.all() if i.role == role and i.state == state]

    def _standbys(self, role: RoleSpec) -> list:
        """Standbys of `role`, awake ones first (they skip the wake-up)."""
        return self._instances(role, InstanceState.STANDBY) + self._instances(role, InstanceState.SLEEPING)

    def _step(self, spec: PoolSpec) -> None:
        role = spec.role
        ready = self._instances(role, InstanceState.READY)
        inflight = sum(i.inflight for i in ready)
        # Requests wait for serving instances; without prefill instances decode prefills locally.
        queued = self.queue.waiting if role.waits_on_queue else 0
        if inflight or queued:
            self._last_busy[role] = time.monotonic()
        ttft_p90 = None
        if spec.target_ttft_s is not None and self.first_tokens is not None:
            ttft_p90 = self.first_tokens.quantile(0.9, since=self._grown_at[role])
        grow = wants_more(spec, len(ready), inflight, queued, self._growing[role], ttft_p90)
        if grow and len(ready) + self._growing[role] < spec.max_ready:
            self._growing[role] += 1
            self._spawn(self._grow(spec), f"grow-{role.name}")
        standbys = len(self._standbys(role)) + self._standby_starting[role]
        if standbys < spec.standby and time.monotonic() >= self._standby_retry_at[role]:
            self._standby_starting[role] += 1
            self._spawn(self._add_standby(spec), f"standby-{role.name}")
        idle = time.monotonic() - self._last_busy[role]
        if len(ready) > spec.min_ready and idle > spec.idle_s and not self._growing[role]:
            self._last_busy[role] = time.monotonic()
            leaving = min(reversed(ready), key=lambda i: i.inflight)
            self._spawn(self.launcher.stop_instance(leaving.instance_id, spec.drain_s), f"shrink-{role.name}")

    def _new_id(self, role: RoleSpec) -> str:
        return f"{role.name}-{int(time.time())}-{next(self._ids)}"

    def _config(self, role: RoleSpec) -> EngineConfig:
        return self.config.model_copy(update={"role": role, "cpu_cores": next(self._cores)})

    async def _grow(self, spec: PoolSpec) -> None:
        decided = time.monotonic()
        try:
            peer = await self.launcher.peer_weights()
            standbys = self._standbys(spec.role)
            if standbys:
                instance_id, path = standbys[0].instance_id, "standby"
                timeline = await self.launcher.activate(instance_id, peer)
            else:
                instance_id, path = self._new_id(spec.role), "peer" if peer else "disk"
                started = await self.launcher.start_instances(
                    [(instance_id, self._config(spec.role))], peer=peer, progress=False
                )
                timeline = started[0].timeline
            log.info("%s pool grew by %s via %s in %.3f s (start %.3f s)", spec.role.name, instance_id, path,
                     time.monotonic() - decided, timeline["total_s"])
        except Exception:
            log.exception("growing the %s pool failed", spec.role.name)
        finally:
            self._growing[spec.role] -= 1
            self._grown_at[spec.role] = time.monotonic()

    async def _add_standby(self, spec: PoolSpec) -> None:
        try:
            config = self._config(spec.role).model_copy(update={"sleep_mode": spec.standby_sleeps})
            await self.launcher.start_standby(self._new_id(spec.role), config)
            self._standby_failures[spec.role] = 0
        except Exception:
            failures = self._standby_failures[spec.role] = self._standby_failures[spec.role] + 1
            self._standby_retry_at[spec.role] = time.monotonic() + min(60.0, 2.0**failures)
            log.exception("starting a %s standby failed (%d in a row)", spec.role.name, failures)
        finally:
            self._standby_starting[spec.role] -= 1
