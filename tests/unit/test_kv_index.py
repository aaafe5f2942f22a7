"""The KV index: events, speculative expiry, sequence gaps, bounded memory."""

from __future__ import annotations

import pytest

from router.kv_index import KVIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_match_counts_leading_blocks_per_holder(clock):
    index = KVIndex(clock=clock)
    index.stored("a", [1, 2, 3])
    index.stored("b", [1, 2])
    index.stored("c", [2, 3])  # holds later blocks but not the first: no prefix match
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.match([9, 1]) == {}
    assert index.match([]) == {}


def test_removed_and_cleared_blocks_stop_matching(clock):
    index = KVIndex(clock=clock)
    index.stored("a", [1, 2, 3])
    index.removed("a", [2])
    assert index.match([1, 2, 3]) == {"a": 1}
    index.removed("b", [1])  # unknown holder: nothing happens
    index.clear("a")
    assert index.match([1]) == {}
    assert index.num_blocks("a") == 0


def test_speculative_blocks_expire_unless_confirmed(clock):
    index = KVIndex(speculative_ttl_s=2.0, clock=clock)
    index.speculate("a", [1, 2, 3])
    index.speculate("b", [1, 2])
    index.stored("b", [1])  # the engine confirmed block 1 only
    clock.now = 1.0
    assert index.match([1, 2, 3]) == {"a": 3, "b": 2}
    clock.now = 3.0
    assert index.match([1, 2, 3]) == {"b": 1}
    assert index.num_blocks("a") == 0


def test_speculation_never_downgrades_a_confirmed_block(clock):
    index = KVIndex(speculative_ttl_s=1.0, clock=clock)
    index.stored("a", [1])
    index.speculate("a", [1, 2])
    clock.now = 5.0
    assert index.match([1, 2]) == {"a": 1}


def test_sequence_gaps_are_reported_and_resync_restarts(clock):
    index = KVIndex(clock=clock)
    applied = []
    assert index.apply_batch("a", 0, lambda: applied.append(0))
    assert index.apply_batch("a", 1, lambda: applied.append(1))
    assert not index.apply_batch("a", 3, lambda: applied.append(3))  # batch 2 was lost
    assert index.expected_seq("a") == 2
    assert not index.apply_batch("b", 5, lambda: applied.append(5))  # a late start: replay from 0
    index.stored("a", [7])
    index.resync("a", 3)
    assert index.match([7]) == {}
    assert index.apply_batch("a", 3, lambda: applied.append(3))
    assert applied == [0, 1, 3]


def test_memory_is_bounded_per_holder_evicting_the_earliest_stored(clock):
    index = KVIndex(max_blocks_per_holder=3, clock=clock)
    index.stored("a", [1, 2, 3])
    index.stored("a", [1])  # stored again: the newest now
    index.stored("a", [4])
    assert index.num_blocks("a") == 3
    assert index.match([2]) == {}
    assert index.match([1]) == {"a": 1}
    index.remove_holder("a")
    assert index.holders() == []
