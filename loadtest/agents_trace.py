"""The multi-tenant agent workload (loadtest/workloads.py `AgentSessions`) as a Mooncake-format
trace, for `pdcluster simulate` to replay what `loadtest.routing_live` runs live.

    python -m loadtest.agents_trace [--tokens-per-word 2.55] [--turn-s 0.5] [--concurrency 4] [--seed 0]
                                   [--block-tokens 32] [--out results/agents.jsonl]
    pdcluster simulate --trace results/agents.jsonl --instances 2 --cache-blocks 4000 --policy round_robin kv_aware

Each request's prompt is its session's history in the order the live client sends it: the
tenant's system prompt, the task, then per earlier turn the answer (`output_tokens`) and the next
tool result; word counts become tokens at `--tokens-per-word` (the tiny model's tokenizer: ~2.55).
Equal prefixes get equal hash ids block by block (`--block-tokens`: the engines' 32, or 512 as
Mooncake's traces; written in each record), so the replay's KV index sees what the engines' would.
The live client is a closed loop (`--concurrency` sessions at a time, each turn sent when the
last one answers); the trace is its open-loop image: each turn about `--turn-s` after the one
before (the live run's wall time x concurrency / requests), and a session starts when a slot frees, in the live order. The live
seeds change the prompts' words, not their structure; `--seed` here draws the turns' durations.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import random
from pathlib import Path

from engine.config import KVHashing
from loadtest.workloads import AgentSessions

ENGINE_BLOCK_TOKENS = KVHashing().block_size


def prompt_units(workload: AgentSessions, tenant: int, session: int, turn: int,
                 tokens_per_word: float) -> list[tuple]:
    """One token-sized unit per prompt token, named by what it belongs to: equal names, equal tokens."""
    def part(name: tuple, words: int) -> list[tuple]:
        return [(*name, k) for k in range(round(words * tokens_per_word))]

    units = part(("system", tenant), workload.system_words) + part(("task", tenant, session), workload.user_words)
    for earlier in range(turn):
        units += [("answer", tenant, session, earlier, k) for k in range(workload.output_tokens)]
        units += part(("step", tenant, session, earlier), workload.tool_words + workload.user_words)
    return units


def hash_ids(units: list[tuple], block_tokens: int, numbers: dict[bytes, int]) -> list[int]:
    """Chained block ids: block b's id names every unit up to its end, as a prefix hash does;
    `numbers` gives each distinct prefix the next integer (ids as small as a trace's, no collisions)."""
    ids, chain = [], hashlib.sha256()
    for start in range(0, len(units), block_tokens):
        chain.update(repr(units[start:start + block_tokens]).encode())
        ids.append(numbers.setdefault(chain.copy().digest(), len(numbers)))
    return ids


def records(workload: AgentSessions, tokens_per_word: float, turn_s: float, concurrency: int,
            seed: int = 0, block_tokens: int = ENGINE_BLOCK_TOKENS) -> list[dict]:
    """Mooncake records (timestamp ms, input_length, output_length, hash_ids), sorted by arrival.
    Each turn lasts `turn_s` x uniform(0.5, 1.5): in lockstep the sessions would meet round robin's
    turn in the same order every round, and it would keep each session on one instance."""
    rng = random.Random(seed)
    slots = [0.0] * concurrency  # when each of the client's slots frees
    rows, numbers = [], {}
    for session in range(workload.sessions):
        for tenant in range(workload.tenants):  # the live order: t0s0, t1s0, ..., t0s1, ...
            at = heapq.heappop(slots)
            for turn in range(workload.turns):
                units = prompt_units(workload, tenant, session, turn, tokens_per_word)
                rows.append({"timestamp": round(at * 1000), "input_length": len(units),
                             "output_length": workload.output_tokens, "hash_ids": hash_ids(units, block_tokens, numbers),
                             "block_tokens": block_tokens})
                at += turn_s * rng.uniform(0.5, 1.5)
            heapq.heappush(slots, at)
    return sorted(rows, key=lambda row: row["timestamp"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-word", type=float, default=2.55)
    parser.add_argument("--turn-s", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="of the turns' durations")
    parser.add_argument("--block-tokens", type=int, default=ENGINE_BLOCK_TOKENS,
                        help="tokens a hash id names: the engines' block size by default (Mooncake's 512 hides "
                             "what prompts of a few hundred tokens share)")
    parser.add_argument("--out", type=Path, default=Path("results/agents.jsonl"))
    args = parser.parse_args(argv)
    rows = records(AgentSessions(), args.tokens_per_word, args.turn_s, args.concurrency, args.seed,
                   args.block_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {args.out} ({len(rows)} requests)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
