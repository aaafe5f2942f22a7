"""`kv_aware`: ours. Pick the instance where the request's first token comes soonest.

For each candidate the estimated cost, in prompt tokens computed, is

    queued prefill work already there                       (pending tokens)
  + the prompt tokens it would compute                      (not in its prefix cache, not in the store)
  + fetch_cost x the prompt tokens it would fetch           (from the store)
  + request_cost_tokens x this router's requests in flight there   (their steps it shares)

the least wins, ties to the fewest requests in flight (the engine's own count, every router's),
then in turn. The index answers from the engines' own KV events (exact block hashes), and the
choice is recorded as a speculative insert so the next request with the same prefix sees it
before the engine's event arrives.

Why affinity cannot drown an instance: a cache hit only saves the compute of the hit tokens, and
what is queued behind a hot instance is charged in full, so once that costs more than recomputing
the prefix elsewhere, requests go elsewhere, and that instance then holds the prefix too. The
queue is more than prefills: every request in flight there takes a share of each step the new
one runs in. Without that term a tenant whose system prompt one instance held was sent there
with four requests in flight while the other instance idled (an agent workload on two CPU
engines, docs/routing.md): its whole prompt cost more to recompute than the prefills queued.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from fleet.instances import Instance
from router.policies.base import PolicyContext, RoutingDecision, RoutingRequest


class KVAware:
    name = "kv_aware"

    def __init__(self, context: PolicyContext) -> None:
        self.context = context
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Instance], request: RoutingRequest) -> RoutingDecision:
        ctx = self.context
        matched = request.matched
        if matched is None:
            matched = ctx.index.match(request.block_hashes) if ctx.index and request.block_hashes else {}
        store_blocks = max((matched.get(s, 0) for s in ctx.store_holders), default=0)
        turn = next(self._turn)
        best: tuple | None = None
        scores: dict[str, float] = {}
        for position, instance in enumerate(candidates):
            local_blocks = matched.get(instance.instance_id, 0)
            cached = min(local_blocks * request.block_size, request.num_tokens)
            fetched = min(
                max(store_blocks - local_blocks, 0) * request.block_size, request.num_tokens - cached
            )
            computed = request.num_tokens - cached - fetched
            # This router's own requests in flight: exact at once. The engine's count (every
            # router's) is up to a health interval old, and would price the instance a request
            # just left: it breaks ties only.
            cost_tokens = (instance.pending_prefill_tokens + computed + ctx.fetch_cost * fetched
                           + ctx.request_cost_tokens * instance.inflight)
            scores[instance.instance_id] = cost_tokens
            key = (cost_tokens, instance.load, (position - turn) % len(candidates))
            if best is None or key < best[0]:
                best = (key, instance, cached, fetched)
        assert best is not None
        _, chosen, cached, fetched = best
        if ctx.index is not None and request.block_hashes:
            ctx.index.speculate(chosen.instance_id, request.block_hashes)
        return RoutingDecision(chosen, cached_tokens=cached, store_tokens=fetched, scores=scores)
