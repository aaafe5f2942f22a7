"""Where a request runs: one pure, synchronous step, the same for the live router and for the
simulator (`loadtest.simulate`).

    place(request, servers, prefillers) -> Placement(serve, prefill | None, reason)

`serve` is the instance that streams the answer (colocated, or decode in P/D), chosen by the
routing policy (filter -> score -> pick: the candidates are the ready instances of a serving
role, the policy scores them by the time their first token would take and records its choice).
`prefill` is the instance that computes the prompt elsewhere first, or None when the serving
instance prefills itself. The reasons, in the order they are tried:

  colocated   the serving instance has no KV connector: it prefills its own requests;
  short       the uncached part of the prompt is under `remote_prefill_min_tokens`;
  no_prefill  no prefill instance is ready (or every one's circuit is open);
  local_busy  the chosen prefill instance has more than `remote_prefill_max_queued_tokens`
              prompt tokens queued: the decode instance prefills, sooner, at the cost of decode
              steps that wait behind that prefill;
  remote      the prefill instance computes the prompt and hands its KV over.

Hazards: a policy's `choose` records a speculative index insert, so `place` is not idempotent;
call it once per attempt. The prefill instance's queue (`pending_prefill_tokens`) is charged by
the caller while the prefill runs, not here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from router.instances import Instance
from router.policies import RoutingDecision, RoutingPolicy, RoutingRequest


@dataclasses.dataclass(frozen=True)
class PlacementSettings:
    remote_prefill_min_tokens: int = 256
    remote_prefill_max_queued_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class Placement:
    serve: RoutingDecision
    """The instance that streams the answer, and what the policy expects it to find cached."""
    prefill: Instance | None
    """Where the prompt is prefilled first; None: by the serving instance."""
    reason: str
    uncached_tokens: int
    """Prompt tokens in neither the serving instance's cache nor the store: the prefill work."""

    @property
    def served_prefill_tokens(self) -> int:
        """What the serving instance computes itself (its queue is charged with it)."""
        return 0 if self.prefill is not None else self.uncached_tokens


class Placer:
    def __init__(self, settings: PlacementSettings, serve_policy: RoutingPolicy, prefill_policy: RoutingPolicy):
        self.settings = settings
        self.serve_policy = serve_policy
        self.prefill_policy = prefill_policy

    def place(self, request: RoutingRequest, servers: Sequence[Instance], prefillers: Sequence[Instance]) -> Placement:
        """`servers`: ready instances that may stream the answer (never empty); `prefillers`:
        ready prefill instances whose circuit is closed."""
        serve = self.serve_policy.choose(servers, request)
        uncached = max(0, request.num_tokens - serve.cached_tokens - serve.store_tokens)

        def placed(prefill: Instance | None, reason: str) -> Placement:
            return Placement(serve, prefill, reason, uncached)

        if not serve.instance.role.kv_transfer:
            return placed(None, "colocated")
        if uncached < self.settings.remote_prefill_min_tokens:
            return placed(None, "short")
        if not prefillers:
            return placed(None, "no_prefill")
        prefill = self.prefill_policy.choose(prefillers, request).instance
        limit = self.settings.remote_prefill_max_queued_tokens
        if limit is not None and prefill.pending_prefill_tokens > limit:
            return placed(None, "local_busy")
        return placed(prefill, "remote")
