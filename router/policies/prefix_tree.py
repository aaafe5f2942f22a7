"""`prefix_tree_chars`: the character-tree baseline of SGLang's router (and Ray Serve's
prefix-aware router).

Algorithm (SGLang `cache_aware`): when the load is imbalanced, i.e. (max - min) requests in
flight > `balance_abs_threshold` and max > min x `balance_rel_threshold`, pick the least loaded
instance. Otherwise match the request's text against each instance's tree of texts it was sent;
if the best match covers more than `cache_threshold` of the text, pick that instance, else the
instance whose tree is smallest. The text is inserted into the chosen instance's tree; a tree
over `max_tree_chars` loses its least recently used leaves. Defaults are SGLang's.

Hazards (why it is a baseline): the tree believes what it routed, not what the engine holds, so
evictions and restarts go unseen; characters are not tokens, so match rates are approximate.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from fleet.instances import Instance
from router.policies.base import PolicyContext, RoutingDecision, RoutingRequest


class _Node:
    __slots__ = ("children", "edge", "last_used", "parent")

    def __init__(self, edge: str, parent: _Node | None, last_used: int) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.last_used = last_used


class CharRadixTree:
    """A radix tree of strings that counts its characters and evicts least recently used leaves."""

    def __init__(self) -> None:
        self._clock = itertools.count()
        self.root = _Node("", None, 0)
        self.size = 0

    def match(self, text: str) -> int:
        """Length of the longest prefix of `text` stored in the tree."""
        node, matched = self.root, 0
        while matched < len(text):
            child = node.children.get(text[matched])
            if child is None:
                break
            common = _common_prefix(child.edge, text, matched)
            child.last_used = next(self._clock)
            matched += common
            if common < len(child.edge):
                break
            node = child
        return matched

    def insert(self, text: str) -> None:
        node, position, now = self.root, 0, next(self._clock)
        while position < len(text):
            child = node.children.get(text[position])
            if child is None:
                node.children[text[position]] = _Node(text[position:], node, now)
                self.size += len(text) - position
                return
            common = _common_prefix(child.edge, text, position)
            if common < len(child.edge):  # split the edge where the texts part
                middle = _Node(child.edge[:common], node, now)
                node.children[text[position]] = middle
                child.edge = child.edge[common:]
                child.parent = middle
                middle.children[child.edge[0]] = child
                child = middle
            child.last_used = now
            position += common
            node = child

    def evict_to(self, max_chars: int) -> None:
        while self.size > max_chars:
            leaves = [n for n in self._nodes() if not n.children and n is not self.root]
            for leaf in sorted(leaves, key=lambda n: n.last_used):
                if self.size <= max_chars:
                    return
                assert leaf.parent is not None
                del leaf.parent.children[leaf.edge[0]]
                self.size -= len(leaf.edge)

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_prefix(edge: str, text: str, start: int) -> int:
    limit = min(len(edge), len(text) - start)
    i = 0
    while i < limit and edge[i] == text[start + i]:
        i += 1
    return i


class PrefixTreeChars:
    name = "prefix_tree_chars"

    def __init__(
        self,
        context: PolicyContext,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        max_tree_chars: int = 2**24,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_chars = max_tree_chars
        self.trees: dict[str, CharRadixTree] = {}

    def choose(self, candidates: Sequence[Instance], request: RoutingRequest) -> RoutingDecision:
        loads = [i.load for i in candidates]
        imbalanced = (max(loads) - min(loads) > self.balance_abs_threshold
                      and max(loads) > min(loads) * self.balance_rel_threshold)
        trees = [self.trees.setdefault(i.instance_id, CharRadixTree()) for i in candidates]
        if imbalanced or not request.text:
            chosen = min(range(len(candidates)), key=lambda k: loads[k])
        else:
            matches = [tree.match(request.text) for tree in trees]
            best = max(range(len(candidates)), key=lambda k: matches[k])
            if matches[best] / len(request.text) > self.cache_threshold:
                chosen = best
            else:
                chosen = min(range(len(candidates)), key=lambda k: trees[k].size)
        if request.text:
            trees[chosen].insert(request.text)
            trees[chosen].evict_to(self.max_tree_chars)
        return RoutingDecision(candidates[chosen])
