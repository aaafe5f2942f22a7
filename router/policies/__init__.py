"""Routing policies: which ready instance serves a request.

Every policy implements `RoutingPolicy.choose`, which commits to a choice (a policy may record
it: a speculative index insert, a prefix-tree insert) and returns a `RoutingDecision`. The live
router and the offline simulator (`loadtest.simulate`) build policies through `make_policy`, so
both run the same code.
"""

from router.policies.base import (
    DEFAULT_REQUEST_COST_TOKENS,
    POLICIES,
    PolicyContext,
    RoutingDecision,
    RoutingPolicy,
    RoutingRequest,
    make_policy,
)

__all__ = ["DEFAULT_REQUEST_COST_TOKENS", "POLICIES", "PolicyContext", "RoutingDecision", "RoutingPolicy", "RoutingRequest", "make_policy"]
