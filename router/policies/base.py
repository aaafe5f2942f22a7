"""The policy interface, what a policy sees of a request, and the registry."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from typing import Protocol

from fleet.instances import Instance
from router.kv_index import BlockHash, KVIndex


@dataclasses.dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at: the prompt's KV block hashes (as the engines compute them),
    its length in tokens, and its text (for character-based baselines)."""

    block_hashes: Sequence[BlockHash]
    num_tokens: int
    block_size: int
    text: str = ""
    matched: Mapping[str, int] | None = None
    """The index's match of `block_hashes` (leading blocks per holder), when the caller already
    looked it up (router/placement.py): a policy then does not walk the hashes again."""


@dataclasses.dataclass(frozen=True)
class RoutingDecision:
    instance: Instance
    cached_tokens: int = 0
    """Prompt tokens the policy expects the instance to find in its own prefix cache."""
    store_tokens: int = 0
    """Prompt tokens the policy expects the instance to fetch from the KV store."""
    scores: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """The policy's score of each candidate it weighed, by instance id (lower is better; a
    policy that scores nothing leaves it empty): what the recent placements view shows."""


DEFAULT_REQUEST_COST_TOKENS = 512.0
"""kv_aware's price of a request in flight (RouterConfig.request_cost_tokens, `pdcluster serve
--request-cost-tokens` and the simulator take it from here): set where an agent workload's tenants
pinned to one of two CPU engines left the other idle (docs/routing.md)."""


@dataclasses.dataclass
class PolicyContext:
    """What policies may use besides the request: the KV index and the cost model's rates."""

    index: KVIndex | None = None
    store_holders: frozenset[str] = frozenset()
    """Index holders that are store shards (readable by every instance), not instances."""
    fetch_cost: float = 0.05
    """Fetching a block from the store costs this fraction of computing it."""
    request_cost_tokens: float = DEFAULT_REQUEST_COST_TOKENS
    """What one request in flight on an instance costs a new one there, in prompt tokens computed."""

    def for_prefill(self) -> PolicyContext:
        """The context of the policy that picks a prefill instance: a remote prefill in flight is
        already priced in its queued prompt tokens, and no decode steps are shared there."""
        return dataclasses.replace(self, request_cost_tokens=0.0)


class RoutingPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance], request: RoutingRequest) -> RoutingDecision:
        """Pick one of `candidates` (never empty) and record the choice."""
        ...


POLICIES: dict[str, str] = {
    "round_robin": "router.policies.basic:RoundRobin",
    "least_loaded": "router.policies.basic:LeastLoaded",
    "prefix_tree_chars": "router.policies.prefix_tree:PrefixTreeChars",
    "kv_aware": "router.policies.kv_aware:KVAware",
}


def make_policy(name: str, context: PolicyContext | None = None) -> RoutingPolicy:
    """A registered policy by name, or an outside one as `module.path:ClassName`."""
    target = POLICIES.get(name, name if ":" in name else None)
    if target is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)} or module:Class")
    module_name, class_name = target.split(":")
    policy_class = getattr(importlib.import_module(module_name), class_name)
    return policy_class(context or PolicyContext())
