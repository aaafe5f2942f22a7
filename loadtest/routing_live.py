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
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from loadtest.arrivals import FixedConcurrency
from loadtest.local_cluster import LocalServer
from loadtest.report import summarize
from loadtest.runner import Limits, run_load
from loadtest.workloads import SharedPrefix


def measure(policy: str, instances: int, workload: SharedPrefix, concurrency: int, log_dir: Path) -> dict:
    args = ["--model", "tiny", "--instances", str(instances), "--policy", policy]
    with LocalServer(args, log_dir / f"routing_live-{policy}.log") as server:
        limits = Limits(max_requests=workload.groups * workload.questions)
        with Progress(transient=True) as progress:
            load = asyncio.run(
                run_load(server.url, workload.jobs("tiny"), FixedConcurrency(concurrency), limits, progress)
            )
    summary = summarize(load, slo_ttft_s=1.0, slo_tpot_s=0.2, label=policy)
    return {
        "policy": policy,
        "requests": summary["requests"],
        "errors": sum(summary["errors"].values()),
        "vllm_prefix_hit_rate": summary["prefix_hit_rate"],
        "ttft_p50_s": summary["ttft"]["p50_ms"] / 1e3,
        "ttft_p90_s": summary["ttft"]["p90_ms"] / 1e3,
        "ttft_mean_s": summary["ttft"]["mean_ms"] / 1e3,
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
    workload = SharedPrefix(args.groups, args.questions, args.system_words, output_tokens=8)
    results = [measure(p, args.instances, workload, args.concurrency, args.out.parent) for p in args.policies]
    base = results[0]
    table = Table(title=f"{args.instances} engines, {args.groups} groups x {args.questions} questions, "
                  f"concurrency {args.concurrency} (ratios to {base['policy']})")
    for column in ("policy", "errors", "vLLM prefix hit rate", "hit ratio", "TTFT p50 s", "p50 ratio",
                   "TTFT p90 s", "p90 ratio"):
        table.add_column(column, justify="right")
    for r in results:
        r["hit_rate_ratio"] = r["vllm_prefix_hit_rate"] / max(base["vllm_prefix_hit_rate"], 1e-9)
        r["ttft_p50_ratio"] = r["ttft_p50_s"] / base["ttft_p50_s"]
        r["ttft_p90_ratio"] = r["ttft_p90_s"] / base["ttft_p90_s"]
        table.add_row(r["policy"], str(r["errors"]), f"{r['vllm_prefix_hit_rate']:.3f}", f"{r['hit_rate_ratio']:.2f}",
                      f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p50_ratio']:.2f}", f"{r['ttft_p90_s']:.3f}",
                      f"{r['ttft_p90_ratio']:.2f}")
    Console(width=130).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"workload": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
