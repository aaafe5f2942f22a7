"""Routing policies, table-driven, on the same index the live router uses."""

from __future__ import annotations

import pytest

from engine.role_spec import COLOCATED
from fleet.instances import Instance
from router.kv_index import KVIndex
from router.policies import POLICIES, PolicyContext, RoutingRequest, make_policy
from router.policies.prefix_tree import CharRadixTree

BLOCK = 32


def instances(n: int, pending: tuple[float, ...] = ()) -> list[Instance]:
    out = [Instance(f"i{k}", COLOCATED, "http://127.0.0.1:1", model="m") for k in range(n)]
    for instance, tokens in zip(out, pending, strict=False):
        instance.pending_prefill_tokens = tokens
    return out


def request(blocks: int, extra_tokens: int = 5, first: int = 0) -> RoutingRequest:
    return RoutingRequest(tuple(range(first, first + blocks)), blocks * BLOCK + extra_tokens, BLOCK, "")


@pytest.mark.parametrize(
    "held,pending,store,expected,cached,fetched",
    [
        # (blocks each instance holds of a 10-block prompt, their queued tokens, store blocks, ...)
        ((0, 10, 4), (0, 0, 0), 0, "i1", 320, 0),  # the full prefix wins
        ((0, 10, 4), (0, 100, 0), 0, "i1", 320, 0),  # a short queue is worth the hit
        ((0, 10, 4), (0, 1000, 0), 0, "i2", 128, 0),  # a long queue is not: next best cache
        ((0, 10, 0), (0, 5000, 0), 0, "i0", 0, 0),  # a hot prefix does not drown its holder
        ((0, 0, 4), (0, 0, 0), 10, "i2", 128, 192),  # local blocks first, the rest from the store
        ((0, 0, 0), (50, 0, 20), 10, "i1", 0, 320),  # store hits are the same everywhere: load decides
    ],
)
def test_kv_aware_trades_cache_hits_against_queues(held, pending, store, expected, cached, fetched):
    index = KVIndex()
    for k, blocks in enumerate(held):
        index.stored(f"i{k}", range(blocks))
    if store:
        index.stored("store", range(store))
    context = PolicyContext(index=index, store_holders=frozenset({"store"} if store else ()), fetch_cost=0.05)
    decision = make_policy("kv_aware", context).choose(instances(3, pending), request(10))
    assert (decision.instance.instance_id, decision.cached_tokens, decision.store_tokens) == (
        expected,
        cached,
        fetched,
    )


def test_kv_aware_charges_the_requests_in_flight():
    """The hot spot seen live (an agent tenant's 2,021-token prompt, held by an instance with four
    requests in flight and 820 prompt tokens queued, while the other idled): the load now counts,
    in prompt tokens computed, and the idle instance recomputes the prompt; with one request in
    flight the hit still wins. Without the load term (0) the cache alone decides. The engine's
    own count (up to a health interval old: it still counts a request that just left) breaks
    ties only."""
    prompt = RoutingRequest(tuple(range(63)), 2021, BLOCK, "")

    def choose(load: int, request_cost_tokens: float, engine_load: int = 0) -> str:
        index = KVIndex()  # each choice its own: a choice speculates its blocks into the index
        index.stored("i0", range(50))
        pool = instances(2, (820.0, 0.0))
        pool[0].inflight, pool[0].engine_load = load, engine_load
        context = PolicyContext(index=index, request_cost_tokens=request_cost_tokens)
        decision = make_policy("kv_aware", context).choose(pool, prompt)
        assert decision.scores["i1"] == 2021  # all of it computed, nothing queued, nothing in flight
        assert decision.scores["i0"] == 820 + 2021 - 50 * BLOCK + request_cost_tokens * load
        return decision.instance.instance_id

    assert choose(4, 512) == "i1"
    assert choose(1, 512) == "i0"
    assert choose(4, 0) == "i0"
    assert choose(0, 512, engine_load=4) == "i0"


def test_kv_aware_speculation_keeps_a_burst_together_before_events_arrive():
    index = KVIndex(speculative_ttl_s=60)
    policy = make_policy("kv_aware", PolicyContext(index=index))
    pool = instances(4)
    picks = [policy.choose(pool, request(40)).instance.instance_id for _ in range(3)]
    assert picks == ["i0", "i0", "i0"]  # no event yet, but the first request's blocks are expected there
    pool[0].pending_prefill_tokens = 50_000  # then its queue outgrows the hit
    assert policy.choose(pool, request(40)).instance.instance_id != "i0"


def test_kv_aware_spreads_unrelated_requests_evenly():
    policy = make_policy("kv_aware", PolicyContext(index=KVIndex()))
    pool = instances(4)
    picks = [policy.choose(pool, request(3, first=100 * k)).instance.instance_id for k in range(8)]
    assert sorted(picks) == ["i0", "i0", "i1", "i1", "i2", "i2", "i3", "i3"]


def test_every_policy_works_without_an_index_or_hashes():
    for name in POLICIES:
        decision = make_policy(name).choose(instances(2), RoutingRequest((), 0, BLOCK, ""))
        assert decision.instance.instance_id in {"i0", "i1"}


def test_char_radix_tree_matches_splits_and_evicts():
    tree = CharRadixTree()
    tree.insert("hello world")
    tree.insert("hello there")
    assert tree.match("hello world!") == 11
    assert tree.match("hello th") == 8
    assert tree.match("help") == 3
    assert tree.size == len("hello ") + len("world") + len("there")
    tree.match("hello world")  # "there" is now the least recently used leaf
    tree.evict_to(11)
    assert tree.match("hello there") == 6
    assert tree.match("hello world") == 11


def test_prefix_tree_chars_follows_text_unless_load_is_imbalanced():
    policy = make_policy("prefix_tree_chars")
    pool = instances(2)
    text_request = RoutingRequest((), 10, BLOCK, "system prompt: be helpful. question one")
    first = policy.choose(pool, text_request).instance
    again = policy.choose(pool, RoutingRequest((), 10, BLOCK, "system prompt: be helpful. question two"))
    assert again.instance is first
    first.inflight = 100  # imbalanced beyond SGLang's thresholds: the least loaded wins
    other = policy.choose(pool, text_request).instance
    assert other is not first
