"""Routing policies: which ready instance serves a request.

Every policy implements `RoutingPolicy.choose`; the registry `POLICIES` maps a config name to
its class, so the live router and the offline simulator build policies the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from router.instances import Instance


class RoutingPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance]) -> Instance:
        """Pick one of `candidates` (never empty)."""
        ...


class RoundRobin:
    """Each instance in turn, whatever its load or cache."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Instance]) -> Instance:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded:
    """The instance with the fewest requests in flight; ties go to the first."""

    name = "least_loaded"

    def choose(self, candidates: Sequence[Instance]) -> Instance:
        return min(candidates, key=lambda i: i.inflight)


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (RoundRobin, LeastLoaded)}


def make_policy(name: str) -> RoutingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
