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

Given the KV index, `place` matches the prompt once, before the policy chooses (its speculative
insert would count the blocks as held), and both counts where they were found (`PromptHits`) and
hands the match to the policies in the request.

Hazards: a policy's `choose` records a speculative index insert, so `place` is not idempotent;
call it once per attempt. The prefill instance's queue (`pending_prefill_tokens`) is charged by
the caller while the prefill runs, not here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from fleet.instances import Instance
from router.kv_index import KVIndex
from router.policies import RoutingDecision, RoutingPolicy, RoutingRequest


class PlacementReason(enum.StrEnum):
    """Why a request runs where it does (the module's docstring says when each applies): the
    placement span carries it, the router's prefills metric counts by `prefilled_where`. A new
    reason is written here alone."""

    COLOCATED = "colocated"
    SHORT = "short"
    NO_PREFILL = "no_prefill"
    LOCAL_BUSY = "local_busy"
    REMOTE = "remote"

    @property
    def prefilled_where(self) -> str | None:
        """Where such a request to a decode instance is prefilled (the prefills metric's label):
        remote, local (a short prompt, no prefill pool), local_busy; None for a colocated one."""
        return _PREFILLED_WHERE[self]


_PREFILLED_WHERE = {PlacementReason.COLOCATED: None, PlacementReason.SHORT: "local",
                    PlacementReason.NO_PREFILL: "local", PlacementReason.LOCAL_BUSY: "local_busy",
                    PlacementReason.REMOTE: "remote"}


DEFAULT_REMOTE_PREFILL_MIN_TOKENS = 1024
"""Below this many uncached prompt tokens a decode instance prefills itself (RouterConfig,
`pdcluster serve --remote-prefill-min-tokens` and the simulators take it from here). Dynamo's
disaggregated router decides the same way, remote only past `max_local_prefill_length` (1000)
uncached tokens. At 256 an agent's next turn (its prefix held by the decode instance, ~300 new
tokens) went through the prefill hop, and kv_aware's knowledge of the cache bought nothing in P/D
(docs/routing.md, issue #32)."""


@dataclasses.dataclass(frozen=True)
class PlacementSettings:
    remote_prefill_min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS
    remote_prefill_max_queued_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class PromptHits:
    """A prompt's full KV blocks, and how many of its leading ones the serving instance held
    (as the router's index saw them) or, beyond those, the store did."""

    blocks: int = 0
    instance: int = 0
    store: int = 0


@dataclasses.dataclass(frozen=True)
class CandidateView:
    """One instance the serving policy weighed, as it stood when the request was placed: the
    prompt's leading blocks it held (by the router's index), those the store held beyond them,
    its queued prefill tokens, this router's requests in flight there and the engine's own count,
    and the policy's score (None: the policy scores nothing, e.g. round robin)."""

    instance_id: str
    cached_blocks: int
    store_blocks: int
    queued_tokens: float
    inflight: int
    load: int
    score: float | None


@dataclasses.dataclass(frozen=True)
class Placement:
    serve: RoutingDecision
    """The instance that streams the answer, and what the policy expects it to find cached."""
    prefill: Instance | None
    """Where the prompt is prefilled first; None: by the serving instance."""
    reason: PlacementReason
    uncached_tokens: int
    """Prompt tokens in neither the serving instance's cache nor the store: the prefill work."""
    hits: PromptHits = PromptHits()
    candidates: tuple[CandidateView, ...] = ()
    """Every serving candidate as the policy saw it (the recent placements view, a hot spot's
    evidence)."""

    @property
    def served_prefill_tokens(self) -> int:
        """What the serving instance computes itself (its queue is charged with it)."""
        return 0 if self.prefill is not None else self.uncached_tokens


class Placer:
    def __init__(self, settings: PlacementSettings, serve_policy: RoutingPolicy, prefill_policy: RoutingPolicy,
                 index: KVIndex | None = None, store_holders: frozenset[str] = frozenset()):
        self.settings = settings
        self.serve_policy = serve_policy
        self.prefill_policy = prefill_policy
        self.index = index
        """Where `PromptHits` are looked up (None: not counted)."""
        self.store_holders = store_holders

    def place(self, request: RoutingRequest, servers: Sequence[Instance], prefillers: Sequence[Instance]) -> Placement:
        """`servers`: ready instances that may stream the answer (never empty); `prefillers`:
        ready prefill instances whose circuit is closed."""
        if self.index is not None and request.block_hashes:  # once, for the hits and the policies
            request = dataclasses.replace(request, matched=self.index.match(request.block_hashes))
        matched = request.matched or {}
        serve = self.serve_policy.choose(servers, request)
        uncached = max(0, request.num_tokens - serve.cached_tokens - serve.store_tokens)
        held = matched.get(serve.instance.instance_id, 0)
        in_store = max((matched.get(holder, 0) for holder in self.store_holders), default=0)
        hits = PromptHits(len(request.block_hashes), held, max(in_store - held, 0))
        candidates = tuple(
            CandidateView(i.instance_id, matched.get(i.instance_id, 0), max(in_store - matched.get(i.instance_id, 0), 0),
                          i.pending_prefill_tokens, i.inflight, i.load, serve.scores.get(i.instance_id))
            for i in servers)

        def placed(prefill: Instance | None, reason: PlacementReason) -> Placement:
            return Placement(serve, prefill, reason, uncached, hits, candidates)

        if not serve.instance.role.kv_transfer:
            return placed(None, PlacementReason.COLOCATED)
        if uncached < self.settings.remote_prefill_min_tokens:
            return placed(None, PlacementReason.SHORT)
        if not prefillers:
            return placed(None, PlacementReason.NO_PREFILL)
        prefill = self.prefill_policy.choose(prefillers, request).instance
        limit = self.settings.remote_prefill_max_queued_tokens
        if limit is not None and prefill.pending_prefill_tokens > limit:
            return placed(None, PlacementReason.LOCAL_BUSY)
        return placed(prefill, PlacementReason.REMOTE)
