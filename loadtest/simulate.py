"""Offline replay of a Mooncake trace through the router's own policies and KV index.

    pdcluster simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl \
        [--policy kv_aware ...] [--instances 8 --cache-blocks 1000 --prefill-rate 20000 --speed 1
         --store-blocks 0 --fetch-cost 0.05]

A Mooncake record is (timestamp ms, input_length, output_length, hash_ids), each hash id naming
one 512-token block of the prompt, chained: equal ids mean equal prefixes. Each simulated
instance has an LRU prefix cache of `cache-blocks` blocks and a FIFO prefill queue; an optional
store tier is an LRU of `store-blocks` blocks that every instance can read, a fetched block
costing `fetch-cost` of computing it. TTFT = queue wait + (computed tokens + fetch-cost x
fetched tokens) / prefill rate. The instances publish what they store and evict to the same
`KVIndex` the live router uses (as vLLM's KV events do), and policies are built by the same
`make_policy`. Decode is not simulated.

Prints, per policy, the prefix hit rate ((cached + fetched) / prompt tokens), TTFT p50/p90/p99
and the load imbalance (max / mean requests per instance); writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import track
from rich.table import Table

from engine.config import Role
from router.instances import Instance
from router.kv_index import KVIndex
from router.policies import POLICIES, PolicyContext, RoutingRequest, make_policy

TRACE_BLOCK_TOKENS = 512
STORE_HOLDER = "store"


@dataclasses.dataclass(frozen=True)
class TraceRecord:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self) -> list[int]:
        """Tokens in each block: full blocks, then what is left in the last one."""
        sizes = [TRACE_BLOCK_TOKENS] * len(self.hash_ids)
        if sizes:
            sizes[-1] = self.input_length - TRACE_BLOCK_TOKENS * (len(sizes) - 1)
        return sizes

    def text(self) -> str:
        """A stand-in prompt text for character-based policies: 8 characters per block."""
        return "".join(f"{h:07d}|" for h in self.hash_ids)


def load_trace(path: Path, speed: float = 1.0) -> list[TraceRecord]:
    records = []
    with path.open() as lines:
        for line in lines:
            row = json.loads(line)
            records.append(TraceRecord(row["timestamp"] / 1000 / speed, row["input_length"],
                                       row["output_length"], tuple(row["hash_ids"])))
    records.sort(key=lambda r: r.arrival_s)
    return records


class LRUBlocks:
    """An LRU set of blocks with a capacity; `touch` returns what it evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def leading_hits(self, hash_ids: Sequence[int], start: int = 0) -> int:
        count = start
        while count < len(hash_ids) and hash_ids[count] in self.blocks:
            count += 1
        return count - start

    def touch(self, hash_ids: Sequence[int]) -> list[int]:
        for block in hash_ids:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        return evicted


@dataclasses.dataclass
class SimConfig:
    instances: int = 8
    cache_blocks: int = 1000
    prefill_rate: float = 20_000.0
    store_blocks: int = 0
    fetch_cost: float = 0.05


def simulate(
    trace: Sequence[TraceRecord], policy_name: str, config: SimConfig, progress: bool = True
) -> dict:
    """Replay `trace` under one policy; returns its summary and per-request TTFTs."""
    now = 0.0
    index = KVIndex(speculative_ttl_s=5.0, clock=lambda: now)
    store = LRUBlocks(config.store_blocks) if config.store_blocks else None
    context = PolicyContext(
        index=index,
        store_holders=frozenset({STORE_HOLDER}) if store else frozenset(),
        prefill_tokens_per_s=config.prefill_rate,
        fetch_cost=config.fetch_cost,
    )
    policy = make_policy(policy_name, context)
    instances = [Instance(f"sim-{i}", Role.COLOCATED, "sim://") for i in range(config.instances)]
    caches = {i.instance_id: LRUBlocks(config.cache_blocks) for i in instances}
    busy_until = dict.fromkeys(caches, 0.0)
    finishes: dict[str, collections.deque[float]] = {i.instance_id: collections.deque() for i in instances}
    counts = dict.fromkeys(caches, 0)
    ttfts, hit_tokens, prompt_tokens = [], 0, 0
    records = track(trace, description=f"{policy_name:>18}", transient=True) if progress else trace
    for record in records:
        now = record.arrival_s
        for instance in instances:
            iid = instance.instance_id
            instance.pending_prefill_tokens = max(0.0, busy_until[iid] - now) * config.prefill_rate
            while finishes[iid] and finishes[iid][0] <= now:
                finishes[iid].popleft()
            instance.inflight = len(finishes[iid])
        request = RoutingRequest(record.hash_ids, record.input_length, TRACE_BLOCK_TOKENS, record.text())
        chosen = policy.choose(instances, request).instance.instance_id
        # What really happens there, whatever the policy believed.
        sizes = record.block_tokens()
        local = caches[chosen].leading_hits(record.hash_ids)
        fetched_blocks = store.leading_hits(record.hash_ids, local) if store else 0
        cached = sum(sizes[:local])
        fetched = sum(sizes[local : local + fetched_blocks])
        computed = record.input_length - cached - fetched
        start = max(now, busy_until[chosen])
        busy_until[chosen] = start + (computed + config.fetch_cost * fetched) / config.prefill_rate
        finishes[chosen].append(busy_until[chosen])
        ttfts.append(busy_until[chosen] - now)
        counts[chosen] += 1
        hit_tokens += cached + fetched
        prompt_tokens += record.input_length
        # The engine reports what it stored and evicted; the store keeps every computed block.
        index.stored(chosen, record.hash_ids)
        index.removed(chosen, caches[chosen].touch(record.hash_ids))
        if store:
            index.stored(STORE_HOLDER, record.hash_ids)
            index.removed(STORE_HOLDER, store.touch(record.hash_ids))
    ttft = np.array(ttfts)
    per_instance = np.array(list(counts.values()))
    return {
        "policy": policy_name,
        "hit_rate": hit_tokens / prompt_tokens,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "imbalance": float(per_instance.max() / per_instance.mean()),
        "requests_per_instance": per_instance.tolist(),
        "ttfts_s": ttft.tolist(),
    }


def infinite_cache_hit_rate(trace: Sequence[TraceRecord]) -> float:
    """The hit rate of one cache that never evicts: the ceiling for any policy."""
    seen: set[int] = set()
    hits = total = 0
    for record in trace:
        for block, size in zip(record.hash_ids, record.block_tokens(), strict=True):
            hits += size if block in seen else 0
            total += size
        seen.update(record.hash_ids)
    return hits / total


def print_table(results: list[dict], title: str, console: Console) -> None:
    table = Table(title=title)
    for column in ("policy", "hit rate", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "imbalance"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["policy"], f"{r['hit_rate']:.3f}", f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p90_s']:.3f}",
                      f"{r['ttft_p99_s']:.3f}", f"{r['imbalance']:.3f}")
    console.print(table)


def plot(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        values = np.sort(np.array(r["ttfts_s"]))
        cdf.plot(values, np.arange(1, len(values) + 1) / len(values), label=r["policy"])
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (s, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT CDF")
    cdf.legend()
    names = [r["policy"] for r in results]
    x = np.arange(len(names))
    for offset, key in ((-0.2, "ttft_p50_s"), (0.0, "ttft_p90_s"), (0.2, "ttft_p99_s")):
        bars.bar(
            x + offset, [r[key] for r in results], width=0.2, label=key.replace("ttft_", "").replace("_s", "")
        )
    bars.set_xticks(x, [f"{n}\nhit {r['hit_rate']:.2f}" for n, r in zip(names, results, strict=True)])
    bars.set_ylabel("TTFT (s)")
    bars.set_yscale("log")
    bars.set_title("TTFT percentiles")
    bars.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL")
    parser.add_argument("--policy", nargs="+", default=list(POLICIES), help="policies to compare")
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=1000)
    parser.add_argument("--prefill-rate", type=float, default=20_000.0, help="tokens/s per instance")
    parser.add_argument("--speed", type=float, default=1.0, help="replay speed-up of the arrival times")
    parser.add_argument("--store-blocks", type=int, default=0)
    parser.add_argument("--fetch-cost", type=float, default=0.05)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = Console()
    trace = load_trace(args.trace, args.speed)
    config = SimConfig(
        args.instances, args.cache_blocks, args.prefill_rate, args.store_blocks, args.fetch_cost
    )
    results = [simulate(trace, name, config) for name in args.policy]
    title = (f"{args.trace.name}: {len(trace)} requests, {config.instances} instances x {config.cache_blocks} "
             f"blocks, {config.prefill_rate:g} tok/s, store {config.store_blocks} blocks")
    print_table(results, title, console)
    ceiling = infinite_cache_hit_rate(trace)
    console.print(f"hit rate of one infinite cache: {ceiling:.3f}")
    stem = f"simulate-{args.trace.stem}-store{config.store_blocks}"
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"trace": str(args.trace), "config": dataclasses.asdict(config), "speed": args.speed,
               "infinite_cache_hit_rate": ceiling,
               "results": [{k: v for k, v in r.items() if k != "ttfts_s"} for r in results]}
    (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=2))
    plot(results, title, args.out / f"{stem}.png")
    console.print(f"wrote {args.out / stem}.json and .png")
    return 0
