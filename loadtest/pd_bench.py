"""P/D against colocated engines on the same number of engines: TTFT and time per output token.

    python -m loadtest.pd_bench [--requests 40 --concurrency 4 --input-tokens 1536 --output-tokens 128]

Starts `pdcluster serve --model tiny` three times: two colocated instances; one prefill and one
decode instance handing KV over through the store shard; the same handing it over directly
(vLLM's NixlConnector). Runs the same mixed workload (long random-token prompts,
long generations; lengths +-50%) at a fixed concurrency against each. Prints a table with
ratios to colocated and writes JSON. On a 2-core CPU machine both engines share the cores the
load generator also needs: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deploy.local import LocalServer
from loadtest.arrivals import FixedConcurrency
from loadtest.report import summarize
from loadtest.runner import Limits, run_load
from loadtest.workloads import RandomLengths

TOPOLOGIES = {
    "colocated x2": ["--instances", "2"],
    "P/D 1+1, KV via store": ["--prefill", "1", "--decode", "1", "--kv-transfer", "store"],
    "P/D 1+1, KV direct (NIXL)": ["--prefill", "1", "--decode", "1", "--kv-transfer", "direct"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-tokens", type=int, default=1536)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/pd_bench.json"))
    args = parser.parse_args(argv)
    summaries = {}
    for name, flags in TOPOLOGIES.items():
        slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
        log = args.out.parent / f"pd_bench-{slug}.log"
        with LocalServer(["--model", "tiny", *flags], log) as server:
            workload = RandomLengths(args.input_tokens, args.output_tokens, range_ratio=0.5, seed=7)
            load = asyncio.run(run_load(server.url, workload.jobs("tiny"), FixedConcurrency(args.concurrency),
                                        Limits(args.requests)))  # fmt: skip
        summaries[name] = summarize(load, slo_ttft_s=2.0, slo_tpot_s=0.1, label=name)
    base = summaries["colocated x2"]
    table = Table(title=f"{args.requests} requests, concurrency {args.concurrency}, ~{args.input_tokens} in / "
                  f"~{args.output_tokens} out (ratio to colocated)")  # fmt: skip
    for column in ("topology", "errors", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "TPOT p90 ms", "req/s"):
        table.add_column(column, justify="right")
    for name, s in summaries.items():

        def cell(metric: str, p: str, s: dict = s) -> str:
            return f"{s[metric][p]:.1f} ({s[metric][p] / base[metric][p]:.2f}x)"

        table.add_row(name, str(sum(s["errors"].values())), cell("ttft", "p50_ms"), cell("ttft", "p90_ms"),
                      cell("tpot", "p50_ms"), cell("tpot", "p90_ms"),
                      f"{s['request_throughput']:.2f} ({s['request_throughput'] / base['request_throughput']:.2f}x)")  # fmt: skip
    Console(width=140).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summaries": summaries},
                                   indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
