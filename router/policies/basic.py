"""Load-only baselines: round robin and least loaded."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from fleet.instances import Instance
from router.policies.base import PolicyContext, RoutingDecision, RoutingRequest


class RoundRobin:
    """Each instance in turn, whatever its load or cache."""

    name = "round_robin"

    def __init__(self, context: PolicyContext) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Instance], request: RoutingRequest) -> RoutingDecision:
        return RoutingDecision(candidates[next(self._counter) % len(candidates)])


class LeastLoaded:
    """The instance with the least queued prefill work, then the fewest requests in flight."""

    name = "least_loaded"

    def __init__(self, context: PolicyContext) -> None:
        pass

    def choose(self, candidates: Sequence[Instance], request: RoutingRequest) -> RoutingDecision:
        return RoutingDecision(min(candidates, key=lambda i: (i.pending_prefill_tokens, i.load)))
