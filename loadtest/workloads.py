"""Workloads: what prompts a load test sends, in what order."""

from __future__ import annotations

import dataclasses
import random

WORDS = (
    "cache prefix block token router decode prefill engine store shard latency queue warm cold start "
    "cluster instance request stream model weight memory transfer graph capture kernel batch schedule "
    "river mountain garden window paper orange silver quiet rapid gentle ancient modern simple"
).split()


def random_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclasses.dataclass(frozen=True)
class SharedPrefixWorkload:
    """`groups` system prompts, each followed by `questions` different questions.

    Requests are interleaved across groups (g0q0, g1q0, ..., g0q1, ...), the order in which a
    load-only router scatters a group over its instances and a cache-aware one should not.
    """

    groups: int = 8
    questions: int = 8
    system_words: int = 600
    question_words: int = 30
    seed: int = 0

    def chat_bodies(self, model: str, max_tokens: int) -> list[dict]:
        rng = random.Random(self.seed)
        systems = [
            f"You are assistant number {g}. " + random_text(rng, self.system_words)
            for g in range(self.groups)
        ]
        bodies = []
        for q in range(self.questions):
            for g in range(self.groups):
                messages = [
                    {"role": "system", "content": systems[g]},
                    {"role": "user", "content": f"Question {q}: " + random_text(rng, self.question_words)},
                ]
                bodies.append({"model": model, "messages": messages, "max_tokens": max_tokens,
                               "temperature": 0, "ignore_eos": True})  # fmt: skip
        return bodies
