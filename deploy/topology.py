"""Which instances a cluster runs: colocated ones, or prefill and decode pools, each with its
standbys and its ceiling, the same for every model served; the pools the controller keeps, and
the Ray resources a one-machine head offers them."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from decode.role import DECODE
from engine.config import TensorParallel
from engine.role_spec import COLOCATED, Role, RoleSpec
from prefill.role import PREFILL

ROLES: dict[Role, RoleSpec] = {spec.kind: spec for spec in (COLOCATED, PREFILL, DECODE)}
"""Every role's record, by name (an adopted engine names its role)."""


@dataclass(frozen=True)
class Topology:
    """Colocated instances, or prefill and decode pools; each pool may keep standbys and grow."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    standby: int = 0
    """Standby instances per pool."""
    max_instances: int = 0
    """Ready instances per pool at most; 0: the initial count (at least 1)."""
    target_ttft_s: float | None = None
    """The prefilling pool's TTFT trigger (PoolSpec.target_ttft_s)."""
    sleeping_standbys: bool = False
    """Standbys sleep until activated (PoolSpec.standby_sleeps; colocated pools, CUDA)."""
    sleep_when_idle: bool = False
    """Idle instances sleep instead of stopping (PoolSpec.idle_sleeps; colocated pools, CUDA),
    all of a pool's if its model gets no requests: a sleeping one wakes in well under a second."""
    models: tuple[str, ...] = ("model",)
    """The served model names; each gets these pools."""
    max_awake: int | None = None
    """With sleep_when_idle: instances awake at most, across models (one GPU's worth): to wake
    one more, the pool controller first puts an idle one of another model to sleep."""
    preimported: int = 0
    """Pre-imported server processes per pool (PoolSpec.preimported)."""

    @classmethod
    def from_args(cls, instances: int, prefill: int = 0, decode: int = 0, *, standby: int = 0, max_instances: int = 0,
                  target_ttft_s: float | None = None, colocated: bool = False,
                  sleeping_standbys: bool = False, sleep_when_idle: bool = False,
                  models: tuple[str, ...] = ("model",), max_awake: int | None = None,
                  preimported: int = 0) -> Topology:
        if colocated and (prefill or decode):
            raise ValueError("--colocated and --prefill/--decode exclude each other")
        # A P/D engine's KV connector registers its KV cache's memory, which sleep would unmap.
        if sleeping_standbys and (prefill or decode or not standby):
            raise ValueError("--sleeping-standbys needs --standby and a colocated topology")
        if sleep_when_idle and (prefill or decode):
            raise ValueError("--sleep-when-idle needs a colocated topology")
        if len(models) > 1 and (prefill or decode):
            # The router's index of the KV store does not tell models apart (router/kv_event_listener.py).
            raise ValueError("several models need a colocated topology")
        if len(set(models)) != len(models):
            raise ValueError(f"model names must be distinct: {list(models)}")
        if max_awake is not None and (max_awake < 1 or not sleep_when_idle):
            raise ValueError("--max-awake needs --sleep-when-idle and is at least 1")
        if max_awake is not None and standby:
            raise ValueError("--max-awake and --standby do not combine: the sleeping engines are the standbys")
        if standby < 0 or max_instances < 0 or preimported < 0:
            raise ValueError("--standby, --preimported and --max-instances cannot be negative")
        if target_ttft_s is not None and target_ttft_s <= 0:
            raise ValueError("--target-ttft must be positive")
        least = 0 if standby or preimported else 1  # a pool may start empty when a standby can serve it
        if prefill or decode:
            if prefill < least or decode < least or prefill + decode == 0:
                raise ValueError("a P/D topology needs --prefill >= 1 and --decode >= 1 (0 with --standby "
                                 "or --preimported)")
            return cls(0, prefill, decode, standby, max_instances, target_ttft_s, models=models,
                       preimported=preimported)
        if instances < least:
            raise ValueError("--instances must be at least 1 (or 0 with --standby or --preimported)")
        return cls(instances, 0, 0, standby, max_instances, target_ttft_s, sleeping_standbys, sleep_when_idle,
                   models, max_awake, preimported)

    def _counts(self) -> list[tuple[RoleSpec, int]]:
        if self.colocated or not (self.prefill or self.decode):
            return [(COLOCATED, self.colocated)]
        return [(PREFILL, self.prefill), (DECODE, self.decode)]

    def role_kinds(self) -> list[Role]:
        """The roles of this topology's pools."""
        return [role.kind for role, _ in self._counts()]

    def id_prefix(self, model: str) -> str:
        """What a model's instance ids start with: nothing when it is the only one."""
        return f"{model}-" if len(self.models) > 1 else ""

    def roles(self, model: str) -> list[tuple[str, RoleSpec]]:
        """`model`'s instances started at once, by id."""
        prefix = self.id_prefix(model)
        return [(f"{prefix}{role.name}-{i}", role) for role, count in self._counts() for i in range(count)]

    def pools(self) -> list:
        from deploy.pool import PoolSpec

        return [
            PoolSpec(model=model, role=role, min_ready=0 if self.sleep_when_idle else count,
                     max_ready=max(count, self.max_instances, 1),
                     standby=self.standby, preimported=self.preimported,
                     target_ttft_s=self.target_ttft_s if role.prefills else None,
                     standby_sleeps=self.sleeping_standbys, idle_sleeps=self.sleep_when_idle)
            for model in self.models for role, count in self._counts()
        ]

    def ranks_at_most(self, tensor_parallel: TensorParallel) -> int:
        """Processes that run a model's shard at most (an engine runs one per device)."""
        return sum((pool.max_ready + pool.standby + pool.preimported) * tensor_parallel.for_role(pool.role.kind)
                   for pool in self.pools())

    def ray_resources(self) -> dict[str, float]:
        """A one-machine head offers the role resources the pools are placed by."""
        resources: dict[str, float] = collections.Counter()
        for pool in self.pools():
            if pool.role.ray_resource:
                resources[pool.role.ray_resource] += pool.max_ready + pool.standby + pool.preimported
        return dict(resources)


def roles_to_start(wanted: list[tuple[str, RoleSpec]], present: list, taken: set[str] = frozenset()
                   ) -> list[tuple[str, RoleSpec]]:
    """The initial instances (id, role) still to start when `present` instances (adopted, ready
    or standing by) already serve: per role that many fewer, skipping ids in use (`taken`, and
    those of `present`)."""
    taken = set(taken) | {i.instance_id for i in present}
    missing = collections.Counter(role for _, role in wanted)
    missing.subtract(i.role for i in present)
    chosen = []
    for instance_id, role in wanted:
        if instance_id not in taken and missing[role] > 0:
            chosen.append((instance_id, role))
            missing[role] -= 1
    return chosen


