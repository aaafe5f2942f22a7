"""P/D against colocated engines on the same number of engines: TTFT and time per output token.

    python -m loadtest.pd_bench [--runs 3 --requests 40 --concurrency 4 --input-tokens 1536 --output-tokens 128]

Starts `pdcluster serve --model tiny` four times: two colocated instances; one prefill and one
decode instance handing KV over through the store shard; the same handing it over directly
(vLLM's NixlConnector); the store topology again, with the decode instance prefilling itself
while the prefill instance has more than one average prompt queued
(`--remote-prefill-max-queued-tokens`). Runs the same mixed workload (long random-token prompts,
long generations; lengths +-50%) at a fixed concurrency against each, --runs times per server
with a new seed each time (fresh prompts: no run finds another's KV). Prints a table of medians
over the runs, with ratios to colocated and the router's mean remote-prefill time (the prefill
part of a P/D request's TTFT); writes JSON (every run's summary, with the cores its engines and
all other processes used: loadtest.host_cpu) and a PNG. On a 2-core CPU
machine the engines share the cores the load generator also needs: read the ratios, not the
absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from loadtest.arrivals import FixedConcurrency
from loadtest.host_cpu import HostCpuMeter
from loadtest.local_cluster import LocalServer
from loadtest.report import summarize
from loadtest.runner import Limits, run_load
from loadtest.workloads import RandomLengths


def topologies(input_tokens: int) -> dict[str, list[str]]:
    """Two engines in each. The last one prefills on the decode instance whenever the prefill
    instance already has more than one average prompt queued."""
    every_prompt_remote = ["--prefill", "1", "--decode", "1", "--remote-prefill-min-tokens", "0"]
    store = [*every_prompt_remote, "--kv-transfer", "store"]
    return {
        "colocated x2": ["--instances", "2"],
        "P/D 1+1, KV via store": store,
        "P/D 1+1, KV direct (NIXL)": [*every_prompt_remote, "--kv-transfer", "direct"],
        "P/D 1+1, store, local when busy": [*store, "--remote-prefill-max-queued-tokens", str(input_tokens)],
    }


# (column, summary path) of the table and the plot; the medians over runs of each.
METRICS = {"TTFT p50 ms": ("ttft", "p50_ms"), "TTFT p90 ms": ("ttft", "p90_ms"),
           "TPOT p50 ms": ("tpot", "p50_ms"), "TPOT p90 ms": ("tpot", "p90_ms"),
           "req/s": ("request_throughput",)}


def value(summary: dict, path: tuple[str, ...]) -> float:
    for key in path:
        summary = summary[key]
    return summary


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-tokens", type=int, default=1536)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/pd_bench.json"))
    return parser


def medians_over_runs(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Each topology's median over its runs of every METRICS column."""
    return {name: {column: statistics.median(value(s, path) for s in summaries) for column, path in METRICS.items()}
            for name, summaries in runs.items()}


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    console = Console(width=150)
    runs: dict[str, list[dict]] = {}
    for name, flags in topologies(args.input_tokens).items():
        slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
        with LocalServer(["--model", "tiny", *flags], args.out.parent / f"pd_bench-{slug}.log") as server:
            for run in range(args.runs):
                workload = RandomLengths(args.input_tokens, args.output_tokens, range_ratio=0.5, seed=7 + run)
                with Progress(console=console, transient=True) as progress, HostCpuMeter() as cpu:
                    console.print(f"{name}: run {run + 1} of {args.runs}")
                    load = asyncio.run(run_load(server.url, workload.jobs("tiny"), FixedConcurrency(args.concurrency),
                                                Limits(args.requests), progress))
                summary = summarize(load, slo_ttft_s=2.0, slo_tpot_s=0.1, label=name)
                runs.setdefault(name, []).append({**summary, "host_cpu": dataclasses.asdict(cpu.result)})
    medians = medians_over_runs(runs)
    for name, summaries in runs.items():
        prefills = [s["remote_prefills"]["mean_ms"] for s in summaries if s["remote_prefills"]]
        medians[name]["remote prefill ms"] = statistics.median(prefills) if prefills else None
        medians[name]["errors"] = sum(sum(s["errors"].values()) for s in summaries)
    base = medians["colocated x2"]
    table = Table(title=f"{args.requests} requests, concurrency {args.concurrency}, ~{args.input_tokens} in / "
                  f"~{args.output_tokens} out; medians of {args.runs} runs (ratio to colocated)")
    for column in ("topology", "errors", *METRICS, "remote prefill ms"):
        table.add_column(column, justify="right")
    for name, m in medians.items():
        prefill = m["remote prefill ms"]
        table.add_row(name, str(m["errors"]), *(f"{m[c]:.{2 if c == 'req/s' else 1}f} ({m[c] / base[c]:.2f}x)" for c in METRICS),
                      "-" if prefill is None else f"{prefill:.1f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "medians": medians,
                                    "runs": runs}, indent=2))
    plot(runs, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """One panel per metric: each topology's median over runs, with the runs' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = ["TTFT p50 ms", "TPOT p50 ms", "req/s"]
    figure, axes = plt.subplots(1, len(columns), figsize=(12, 4))
    for axis, column in zip(axes, columns, strict=True):
        values = [[value(s, METRICS[column]) for s in summaries] for summaries in runs.values()]
        medians = [statistics.median(v) for v in values]
        errors = [[m - min(v) for m, v in zip(medians, values, strict=True)],
                  [max(v) - m for m, v in zip(medians, values, strict=True)]]
        axis.bar(
            range(len(runs)),
            medians,
            yerr=errors,
            capsize=4,
            color=["tab:gray", "tab:blue", "tab:orange", "tab:green"],
        )
        axis.set_xticks(range(len(runs)), [n.replace(", ", "\n") for n in runs], fontsize=8)
        axis.set_title(column)
    figure.suptitle("P/D vs colocated, tiny model on CPU (median of runs, bars: range)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
