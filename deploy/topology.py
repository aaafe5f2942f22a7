"""Which instances a cluster runs: colocated ones, or prefill and decode pools, each with its
standbys and its ceiling; the pools the controller keeps, and the Ray resources a one-machine head
offers them."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from decode.role import DECODE
from engine.roles import COLOCATED, Role, RoleSpec
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

    @classmethod
    def from_args(cls, instances: int, prefill: int, decode: int, standby: int = 0, max_instances: int = 0,
                  target_ttft_s: float | None = None, colocated: bool = False,
                  sleeping_standbys: bool = False) -> Topology:
        if colocated and (prefill or decode):
            raise ValueError("--colocated and --prefill/--decode exclude each other")
        if sleeping_standbys and (prefill or decode or not standby):
            # A P/D engine's KV connector registers its KV cache's memory, which sleep would unmap.
            raise ValueError("--sleeping-standbys needs --standby and a colocated topology")
        if standby < 0 or max_instances < 0:
            raise ValueError("--standby and --max-instances cannot be negative")
        if target_ttft_s is not None and target_ttft_s <= 0:
            raise ValueError("--target-ttft must be positive")
        least = 0 if standby else 1  # a pool may start empty when a standby can serve it
        if prefill or decode:
            if prefill < least or decode < least or prefill + decode == 0:
                raise ValueError("a P/D topology needs --prefill >= 1 and --decode >= 1 (0 with --standby)")
            return cls(0, prefill, decode, standby, max_instances, target_ttft_s)
        if instances < least:
            raise ValueError("--instances must be at least 1 (or 0 with --standby)")
        return cls(instances, 0, 0, standby, max_instances, target_ttft_s, sleeping_standbys)

    def _counts(self) -> list[tuple[RoleSpec, int]]:
        if self.colocated or not (self.prefill or self.decode):
            return [(COLOCATED, self.colocated)]
        return [(PREFILL, self.prefill), (DECODE, self.decode)]

    def roles(self) -> list[tuple[str, RoleSpec]]:
        """The instances started at once, by id."""
        return [(f"{role.name}-{i}", role) for role, count in self._counts() for i in range(count)]

    def pools(self) -> list:
        from deploy.pool import PoolSpec

        return [
            PoolSpec(role=role, min_ready=count, max_ready=max(count, self.max_instances, 1), standby=self.standby,
                     target_ttft_s=self.target_ttft_s if role.prefills else None,
                     standby_sleeps=self.sleeping_standbys)
            for role, count in self._counts()
        ]

    def engines_at_most(self) -> int:
        return sum(pool.max_ready + pool.standby for pool in self.pools())

    def ray_resources(self) -> dict[str, float]:
        """A one-machine head offers the role resources the pools are placed by."""
        return {pool.role.ray_resource: float(pool.max_ready + pool.standby) for pool in self.pools()
                if pool.role.ray_resource}


def roles_to_start(wanted: list[tuple[str, RoleSpec]], present: list) -> list[tuple[str, RoleSpec]]:
    """The initial instances (id, role) still to start when `present` (adopted, ready) instances
    already serve: per role that many fewer, skipping ids in use."""
    taken = {i.instance_id for i in present}
    missing = collections.Counter(role for _, role in wanted)
    missing.subtract(i.role for i in present)
    chosen = []
    for instance_id, role in wanted:
        if instance_id not in taken and missing[role] > 0:
            chosen.append((instance_id, role))
            missing[role] -= 1
    return chosen


