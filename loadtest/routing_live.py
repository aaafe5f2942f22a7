"""KV-aware routing against round robin on real engines: vLLM's own prefix-cache counters and TTFT.

    python -m loadtest.routing_live [--policies round_robin kv_aware] [--instances 2]

For each policy it starts `pdcluster serve --model tiny --instances N --policy P`, sends the same
shared-prefix workload (groups of questions behind long system prompts, interleaved across
groups) at a fixed concurrency, and reads the prefix-cache hit and query counters from every
engine's /metrics before and after. Prints a table with ratios to the first policy; writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from deploy.local import LocalServer
from loadtest.client import RequestResult, stream_request
from loadtest.scrape import prefix_cache_counts
from loadtest.workloads import SharedPrefixWorkload


async def run_workload(
    url: str, bodies: list[dict], concurrency: int, progress: Progress
) -> list[RequestResult]:
    task = progress.add_task("requests", total=len(bodies))
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:

        async def one(body: dict) -> RequestResult:
            async with gate:
                result = await stream_request(client, f"{url}/v1/chat/completions", body)
                progress.advance(task)
                return result

        return await asyncio.gather(*(one(b) for b in bodies))


def measure(
    policy: str, instances: int, workload: SharedPrefixWorkload, concurrency: int, log_dir: Path
) -> dict:
    args = ["--model", "tiny", "--instances", str(instances), "--policy", policy]
    with LocalServer(args, log_dir / f"routing_live-{policy}.log") as server:
        engines = [i["url"] for i in server.instances()]
        hits0, queries0 = prefix_cache_counts(engines)
        with Progress(transient=True) as progress:
            results = asyncio.run(
                run_workload(server.url, workload.chat_bodies("tiny", 8), concurrency, progress)
            )
        hits1, queries1 = prefix_cache_counts(engines)
    ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
    return {
        "policy": policy,
        "requests": len(results),
        "errors": sum(not r.ok for r in results),
        "vllm_prefix_hit_tokens": hits1 - hits0,
        "vllm_prefix_query_tokens": queries1 - queries0,
        "vllm_prefix_hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
        "ttft_mean_s": statistics.fmean(ttfts),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", nargs="+", default=["round_robin", "kv_aware"])
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("results/routing_live.json"))
    args = parser.parse_args(argv)
    workload = SharedPrefixWorkload(args.groups, args.questions, args.system_words)
    results = [measure(p, args.instances, workload, args.concurrency, args.out.parent) for p in args.policies]
    base = results[0]
    table = Table(title=f"{args.instances} engines, {args.groups} groups x {args.questions} questions, "
                  f"concurrency {args.concurrency} (ratios to {base['policy']})")  # fmt: skip
    for column in ("policy", "errors", "vLLM prefix hit rate", "hit ratio", "TTFT p50 s", "p50 ratio",
                   "TTFT p90 s", "p90 ratio"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in results:
        r["hit_rate_ratio"] = r["vllm_prefix_hit_rate"] / max(base["vllm_prefix_hit_rate"], 1e-9)
        r["ttft_p50_ratio"] = r["ttft_p50_s"] / base["ttft_p50_s"]
        r["ttft_p90_ratio"] = r["ttft_p90_s"] / base["ttft_p90_s"]
        table.add_row(r["policy"], str(r["errors"]), f"{r['vllm_prefix_hit_rate']:.3f}", f"{r['hit_rate_ratio']:.2f}",
                      f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p50_ratio']:.2f}", f"{r['ttft_p90_s']:.3f}",
                      f"{r['ttft_p90_ratio']:.2f}")  # fmt: skip
    Console(width=130).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"workload": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
