"""How long the router's decision takes: block hashing + index lookup + scoring.

    python -m loadtest.routing_decision [--tokens 8192 --instances 16 --iterations 2000]

An 8k-token prompt (token ids; tokenization is measured apart) over 16 instances whose index
entries hold 50,000 other blocks each plus a different share of this prompt's prefix. Each
iteration hashes the prompt afresh (vLLM's sha256 chain), matches it in the index and scores
every instance with the `kv_aware` policy (which also records its speculative insert). Prints
p50/p99 per part and in total; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.config import KVHashing
from engine.role_spec import COLOCATED
from fleet.instances import Instance
from router.hashing import PromptHasher
from router.kv_index import KVIndex
from router.metrics import percentile
from router.policies import PolicyContext, RoutingRequest, make_policy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="model folder for the tokenizer (default: the tiny model)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/routing_decision.json"))
    args = parser.parse_args(argv)
    from engine.models import ensure_model

    model = args.model or ensure_model("tiny")
    hasher = PromptHasher(model, KVHashing(block_size=args.block_size))
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(args.tokens)]
    prompt_hashes = hasher.block_hashes(tokens)
    index = KVIndex(speculative_ttl_s=0.001)  # speculation expires at once: every iteration alike
    instances = [Instance(f"i{k}", COLOCATED, "http://127.0.0.1:1", model="bench") for k in range(args.instances)]
    for k, instance in enumerate(instances):
        index.stored(instance.instance_id, (rng.getrandbits(64) for _ in range(50_000)))
        index.stored(instance.instance_id, prompt_hashes[: len(prompt_hashes) * k // args.instances])
    policy = make_policy("kv_aware", PolicyContext(index=index))
    parts: dict[str, list[float]] = {"hash": [], "match+score": [], "total": []}
    text = " ".join(map(str, tokens[:2000]))
    tokenize = []
    for iteration in range(args.iterations):
        started = time.perf_counter()
        hashes = hasher.block_hashes(tokens)
        hashed = time.perf_counter()
        policy.choose(instances, RoutingRequest(hashes, len(tokens), args.block_size))
        done = time.perf_counter()
        parts["hash"].append((hashed - started) * 1e3)
        parts["match+score"].append((done - hashed) * 1e3)
        parts["total"].append((done - started) * 1e3)
        if iteration < 200:
            t = time.perf_counter()
            hasher.tokenizer.encode(text)
            tokenize.append((time.perf_counter() - t) * 1e3)
    result = {
        "tokens": args.tokens, "instances": args.instances, "iterations": args.iterations,
        "blocks": len(prompt_hashes),
        **{part: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99)} for part, v in parts.items()},
        "tokenize_2000_words_p50_ms": statistics.median(tokenize),
    }
    table = Table(title=f"routing decision, {args.tokens}-token prompt, {args.instances} instances")
    for column in ("part", "p50 ms", "p99 ms"):
        table.add_column(column, justify="right")
    for part in parts:
        table.add_row(part, f"{result[part]['p50_ms']:.3f}", f"{result[part]['p99_ms']:.3f}")
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
