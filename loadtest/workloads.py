"""Workloads: what a load test sends.

A workload yields `Job`s; a job is one request, or a multi-turn session whose later turns carry
the earlier answers. Prompts are text, or token ids where exact token counts matter (random
lengths, trace replay), sent through /v1/completions, which accepts ids as the prompt.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from pathlib import Path

WORDS = (
    "cache prefix block token router decode prefill engine store shard latency queue warm cold start "
    "cluster instance request stream model weight memory transfer graph capture kernel batch schedule "
    "river mountain garden window paper orange silver quiet rapid gentle ancient modern simple"
).split()
# Token ids for synthetic prompts: inside any real vocabulary, clear of the special tokens.
TOKEN_ID_RANGE = (10, 1000)


def random_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def random_token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(count)]


@dataclasses.dataclass
class Job:
    """One unit of load. `turns` holds one request body, or a session's user messages."""

    endpoint: str
    body: dict
    turns: list[str] = dataclasses.field(default_factory=list)
    """A session's user messages, each sent after the history so far (the body's own `messages`
    first, then every earlier turn and its answer)."""
    arrival_s: float | None = None
    """When a trace says this job arrives (seconds from the start); None: the arrival process decides."""
    api_key: str | None = None
    """The tenant's API key its requests carry (None: none)."""


@dataclasses.dataclass(frozen=True)
class RandomLengths:
    """Token-id prompts of `input_tokens` (+- `range_ratio`), `output_tokens` each (vllm bench's `random`)."""

    input_tokens: int = 256
    output_tokens: int = 32
    range_ratio: float = 0.0
    seed: int = 0
    name = "random"

    def jobs(self, model: str) -> Iterator[Job]:
        rng = random.Random(self.seed)
        while True:
            low = int(self.input_tokens * (1 - self.range_ratio))
            high = int(self.input_tokens * (1 + self.range_ratio))
            body = {"model": model, "prompt": random_token_ids(rng, rng.randint(max(low, 1), max(high, 1))),
                    "max_tokens": self.output_tokens, "temperature": 0, "ignore_eos": True}
            yield Job("/v1/completions", body)


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """`groups` system prompts, each followed by `questions` different questions, interleaved
    across groups (g0q0, g1q0, ..., g0q1, ...): the order in which a load-only router scatters a
    group over its instances and a cache-aware one should not."""

    groups: int = 8
    questions: int = 8
    system_words: int = 600
    question_words: int = 30
    output_tokens: int = 16
    seed: int = 0
    name = "shared_prefix"

    def jobs(self, model: str) -> Iterator[Job]:
        rng = random.Random(self.seed)
        systems = [
            f"You are assistant number {g}. " + random_text(rng, self.system_words)
            for g in range(self.groups)
        ]
        while True:
            for q in range(self.questions):
                for g in range(self.groups):
                    messages = [
                        {"role": "system", "content": systems[g]},
                        {
                            "role": "user",
                            "content": f"Question {q}: " + random_text(rng, self.question_words),
                        },
                    ]
                    body = {"model": model, "messages": messages, "max_tokens": self.output_tokens,
                            "temperature": 0, "ignore_eos": True}
                    yield Job("/v1/chat/completions", body)


@dataclasses.dataclass(frozen=True)
class MultiTurn:
    """Chat sessions of `turns` user messages; each turn resends the whole history, answers included."""

    turns: int = 3
    user_words: int = 40
    output_tokens: int = 16
    seed: int = 0
    name = "multi_turn"

    def jobs(self, model: str) -> Iterator[Job]:
        rng = random.Random(self.seed)
        session = 0
        while True:
            questions = [
                f"Session {session} turn {t}: " + random_text(rng, self.user_words) for t in range(self.turns)
            ]
            body = {"model": model, "messages": [], "max_tokens": self.output_tokens, "temperature": 0,
                    "ignore_eos": True}
            yield Job("/v1/chat/completions", body, turns=questions)
            session += 1


@dataclasses.dataclass(frozen=True)
class AgentSessions:
    """Agents of several tenants, the workload a prefix-aware router exists for: each tenant a long
    system prompt (its instructions and tools), each session a task whose turns grow by a tool's
    result and the next step, resent whole with the answers so far: `tenants x sessions x turns`
    chat requests. Sessions come interleaved across tenants (t0s0, t1s0, ..., t0s1, ...), the
    order in which a load-only router scatters a tenant's prompt over its instances. With `keys`
    (one per tenant) each tenant's requests carry its API key, so its cache salt keeps it apart."""

    tenants: int = 4
    sessions: int = 5
    turns: int = 4
    system_words: int = 600
    tool_words: int = 120
    user_words: int = 20
    output_tokens: int = 16
    seed: int = 0
    keys: tuple[str, ...] = ()
    name = "agents"

    def jobs(self, model: str) -> Iterator[Job]:
        rng = random.Random(self.seed)
        systems = [f"You are tenant {t}'s agent. Tools: search, fetch, compute. " + random_text(rng, self.system_words)
                   for t in range(self.tenants)]
        for session in range(self.sessions):
            for tenant in range(self.tenants):
                task = f"Task {tenant}.{session}: " + random_text(rng, self.user_words)
                steps = [f"Tool result {step}: " + random_text(rng, self.tool_words) + "\nNext: "
                         + random_text(rng, self.user_words) for step in range(1, self.turns)]
                body = {"model": model, "messages": [{"role": "system", "content": systems[tenant]}],
                        "max_tokens": self.output_tokens, "temperature": 0, "ignore_eos": True}
                yield Job("/v1/chat/completions", body, turns=[task, *steps],
                          api_key=self.keys[tenant] if self.keys else None)


@dataclasses.dataclass(frozen=True)
class MooncakeReplay:
    """Replay a Mooncake trace with token-id prompts in which equal hash ids are equal blocks.

    Each hash id becomes `block_tokens` token ids drawn from a generator seeded by the id, so two
    records sharing their first k hash ids share exactly their first k x `block_tokens` tokens.
    `block_tokens` (default 512, the trace's own) scales the prompts to a model's context;
    prompts are cut to `max_input_tokens` and outputs to `max_output_tokens`.
    """

    trace: Path
    block_tokens: int = 512
    max_input_tokens: int = 3072
    max_output_tokens: int = 64
    speed: float = 1.0
    name = "mooncake"

    def records(self) -> list[dict]:
        with self.trace.open() as lines:
            records = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["timestamp"])
        if any(r.get("block_tokens", 512) != 512 for r in records):  # loadtest.agents_trace's, for the simulator
            raise ValueError(f"{self.trace}: its hash ids name blocks of another size than Mooncake's 512 tokens")
        return records

    def prompt(self, record: dict) -> list[int]:
        scale = self.block_tokens / 512
        length = min(max(int(record["input_length"] * scale), 1), self.max_input_tokens)
        tokens: list[int] = []
        for hash_id in record["hash_ids"]:
            if len(tokens) >= length:
                break
            tokens += random_token_ids(random.Random(hash_id), self.block_tokens)
        return tokens[:length]

    def jobs(self, model: str) -> Iterator[Job]:
        records = self.records()
        start = records[0]["timestamp"] if records else 0
        for record in records:
            body = {"model": model, "prompt": self.prompt(record), "temperature": 0, "ignore_eos": True,
                    "max_tokens": max(1, min(record["output_length"], self.max_output_tokens))}
            yield Job("/v1/completions", body, arrival_s=(record["timestamp"] - start) / 1000 / self.speed)


Workload = RandomLengths | SharedPrefix | MultiTurn | MooncakeReplay
