"""Offline replay of a Mooncake trace through the router's own placement step, policies and KV
index.

    pdcluster simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl \
        [--policy kv_aware ...] [--instances 8 --cache-blocks 1000 --prefill-rate 20000 --speed 1
         --store-blocks 0 --fetch-cost 0.05 --request-cost-tokens 512] [--prefill-instances 0 --remote-prefill-min-tokens 1024
         --remote-prefill-max-queued-tokens N]

A Mooncake record is (timestamp ms, input_length, output_length, hash_ids), each hash id naming
one 512-token block of the prompt (or "block_tokens", where a record says: loadtest.agents_trace),
chained: equal ids mean equal prefixes. Each simulated
instance has an LRU prefix cache of `cache-blocks` blocks and a FIFO prefill queue; an optional
store tier is an LRU of `store-blocks` blocks that every instance can read, a fetched block
costing `fetch-cost` of computing it. TTFT = queue wait + (computed tokens + fetch-cost x
fetched tokens) / prefill rate. The instances publish what they store and evict to the same
`KVIndex` the live router uses (as vLLM's KV events do), and requests are placed by the same
`Placer` (router/placement.py) with policies built by the same `make_policy`. With
`--prefill-instances N` the `--instances` are decode instances and N prefill instances join them:
a request the placer prefills remotely is computed there, and its KV (every prompt block) is
handed to the decode instance at `fetch-cost` of computing it; with
`--remote-prefill-max-queued-tokens` a decode instance prefills itself while the chosen prefill
instance has more queued (the router's `local_busy`). Decode itself is not simulated here
(`loadtest.serving_sim` steps engines through prefill and decode on measured step times).

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

from decode.role import DECODE
from engine.role_spec import COLOCATED
from fleet.instances import Instance, InstanceRegistry
from prefill.role import PREFILL
from router.kv_event_listener import STORE_HOLDER
from router.kv_index import KVIndex
from router.metrics import percentile
from router.placement import DEFAULT_REMOTE_PREFILL_MIN_TOKENS, PlacementSettings, Placer
from router.policies import DEFAULT_REQUEST_COST_TOKENS, POLICIES, PolicyContext, RoutingRequest, make_policy

TRACE_BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class TraceRecord:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_size: int = TRACE_BLOCK_TOKENS
    """Tokens a hash id names (a record's optional "block_tokens"; Mooncake's traces: 512)."""

    def block_tokens(self) -> list[int]:
        """Tokens in each block: full blocks, then what is left in the last one."""
        sizes = [self.block_size] * len(self.hash_ids)
        if sizes:
            sizes[-1] = self.input_length - self.block_size * (len(sizes) - 1)
        return sizes

    def text(self) -> str:
        """A stand-in prompt text for character-based policies: 8 characters per block."""
        return "".join(f"{h:07d}|" for h in self.hash_ids)


def load_trace(path: Path, speed: float = 1.0) -> list[TraceRecord]:
    records = []
    with path.open() as lines:
        for line in lines:
            row = json.loads(line)
            records.append(TraceRecord(row["timestamp"] / 1000 / speed, row["input_length"], row["output_length"],
                                       tuple(row["hash_ids"]), row.get("block_tokens", TRACE_BLOCK_TOKENS)))
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
    prefill_instances: int = 0
    request_cost_tokens: float = DEFAULT_REQUEST_COST_TOKENS
    remote_prefill_min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS
    remote_prefill_max_queued_tokens: int | None = None


class _SimInstance:
    """One simulated engine: its prefix cache, its FIFO prefill queue, its requests in flight."""

    def __init__(self, instance: Instance, config: SimConfig) -> None:
        self.instance, self.cache, self.busy_until = instance, LRUBlocks(config.cache_blocks), 0.0
        self.finishes: collections.deque[float] = collections.deque()
        self.requests = 0

    def observe(self, registry: InstanceRegistry, now: float, prefill_rate: float) -> None:
        """What the router would know of it now (its queue, its requests in flight)."""
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        registry.observed(self.instance, len(self.finishes), max(0.0, self.busy_until - now) * prefill_rate)

    def compute(self, record: TraceRecord, start: float, store: LRUBlocks | None, config: SimConfig) -> tuple[float, int]:
        """Prefill `record` here from `start` on (queued behind earlier work); returns when it is
        done and the prompt tokens it found cached or fetched."""
        sizes = record.block_tokens()
        local = self.cache.leading_hits(record.hash_ids)
        fetched_blocks = store.leading_hits(record.hash_ids, local) if store else 0
        cached, fetched = sum(sizes[:local]), sum(sizes[local : local + fetched_blocks])
        computed = record.input_length - cached - fetched
        self.busy_until = max(start, self.busy_until) + (computed + config.fetch_cost * fetched) / config.prefill_rate
        return self.busy_until, cached + fetched


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
        fetch_cost=config.fetch_cost, request_cost_tokens=config.request_cost_tokens,
    )
    settings = PlacementSettings(config.remote_prefill_min_tokens, config.remote_prefill_max_queued_tokens)
    placer = Placer(settings, make_policy(policy_name, context), make_policy(policy_name, context.for_prefill()))
    sims = _fleet(config)
    registry = InstanceRegistry()
    for sim in sims.values():
        registry.add(sim.instance)
    servers = [s.instance for s in sims.values() if s.instance.role.serves_clients]
    prefillers = [s.instance for s in sims.values() if s.instance.role.takes_remote_prefills]
    ttfts, hit_tokens, prompt_tokens, remote = [], 0, 0, 0
    records = track(trace, description=f"{policy_name:>18}", transient=True) if progress else trace
    for record in records:
        now = record.arrival_s
        for sim in sims.values():
            sim.observe(registry, now, config.prefill_rate)
        request = RoutingRequest(record.hash_ids, record.input_length, record.block_size, record.text())
        placement = placer.place(request, servers, prefillers)
        served = sims[placement.serve.instance.instance_id]
        # What really happens there, whatever the policy believed.
        if placement.prefill is not None:
            remote += 1
            computing = sims[placement.prefill.instance_id]
            done, hits = computing.compute(record, now, store, config)
            done += config.fetch_cost * record.input_length / config.prefill_rate  # the KV handoff
            served.busy_until = max(served.busy_until, done)
            served.cache.touch(record.hash_ids)  # it now holds the prompt's blocks
            _published(index, computing, record, store)
        else:
            done, hits = served.compute(record, now, store, config)
        served.finishes.append(done)
        served.requests += 1
        ttfts.append(done - now)
        hit_tokens += hits
        prompt_tokens += record.input_length
        _published(index, served, record, store)
    ttft = np.array(ttfts)
    per_instance = np.array([sims[i.instance_id].requests for i in servers])
    return {
        "policy": policy_name,
        "hit_rate": hit_tokens / prompt_tokens,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "imbalance": float(per_instance.max() / per_instance.mean()),
        "requests_per_instance": per_instance.tolist(),
        "remote_prefills": remote,
        "ttfts_s": ttft.tolist(),
    }


def _fleet(config: SimConfig) -> dict[str, _SimInstance]:
    """The simulated instances by id: `instances` that serve (decode ones when there are prefill
    instances, else colocated), then the `prefill_instances`."""
    serving_role = DECODE if config.prefill_instances else COLOCATED
    sims = {f"sim-{i}": _SimInstance(Instance(f"sim-{i}", serving_role, "sim://", model="sim"), config)
            for i in range(config.instances)}
    sims |= {f"prefill-{i}": _SimInstance(Instance(f"prefill-{i}", PREFILL, "sim://", model="sim"), config)
             for i in range(config.prefill_instances)}
    return sims


def _published(index: KVIndex, sim: _SimInstance, record: TraceRecord, store: LRUBlocks | None) -> None:
    """The engine reports what it stored and evicted; the store keeps every computed block."""
    iid = sim.instance.instance_id
    index.stored(iid, record.hash_ids)
    index.removed(iid, sim.cache.touch(record.hash_ids))
    if store:
        index.stored(STORE_HOLDER, record.hash_ids)
        index.removed(STORE_HOLDER, store.touch(record.hash_ids))


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
    parser.add_argument("--cache-blocks", type=int, default=1000,
                        help="each instance's prefix cache, in the trace's blocks (512 tokens, or its records' own)")
    parser.add_argument("--prefill-rate", type=float, default=20_000.0, help="tokens/s per instance")
    parser.add_argument("--speed", type=float, default=1.0, help="replay speed-up of the arrival times")
    parser.add_argument("--store-blocks", type=int, default=0)
    parser.add_argument("--fetch-cost", type=float, default=0.05)
    parser.add_argument("--request-cost-tokens", type=float, default=DEFAULT_REQUEST_COST_TOKENS,
                        help="kv_aware's price of a request in flight (pdcluster serve's flag)")
    parser.add_argument("--prefill-instances", type=int, default=0,
                        help="P/D: this many prefill instances; --instances are then decode instances")
    parser.add_argument("--remote-prefill-min-tokens", type=int, default=DEFAULT_REMOTE_PREFILL_MIN_TOKENS)
    parser.add_argument("--remote-prefill-max-queued-tokens", type=int, default=None,
                        help="P/D: when the prefill instance has more prompt tokens queued, decode prefills locally")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    console = Console()
    trace = load_trace(args.trace, args.speed)
    config = SimConfig(instances=args.instances, cache_blocks=args.cache_blocks, prefill_rate=args.prefill_rate,
                       store_blocks=args.store_blocks, fetch_cost=args.fetch_cost,
                       prefill_instances=args.prefill_instances, request_cost_tokens=args.request_cost_tokens,
                       remote_prefill_min_tokens=args.remote_prefill_min_tokens,
                       remote_prefill_max_queued_tokens=args.remote_prefill_max_queued_tokens)
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
