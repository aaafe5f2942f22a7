"""`pdcluster loadtest`: load an OpenAI-compatible endpoint (ours or a plain vLLM server).

    pdcluster loadtest --url http://127.0.0.1:8000 --workload shared_prefix --arrival poisson --rate 2 4 8
    pdcluster loadtest --url ... --workload mooncake --trace FILE --arrival trace --speed 10
    pdcluster loadtest --compare results/a.json results/b.json

Each rate is one bounded run (--requests and --duration); several rates make a sweep. Writes
per-run JSON (summary, every request, scraped metrics) and PNG plots under --out.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

from loadtest import report
from loadtest.arrivals import Bursts, Constant, FixedConcurrency, Poisson, TraceTimes
from loadtest.runner import Limits, check_target, run_load
from loadtest.workloads import AgentSessions, MooncakeReplay, MultiTurn, RandomLengths, SharedPrefix

WORKLOADS = ("random", "shared_prefix", "multi_turn", "agents", "mooncake")
ARRIVALS = ("poisson", "constant", "burst", "concurrency", "trace")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="the endpoint (loopback only)")
    parser.add_argument("--model", help="model name (default: the endpoint's first)")
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    parser.add_argument("--rate", type=float, nargs="+", default=[2.0], help="jobs/s (poisson, constant)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--burst-size", type=int, default=8)
    parser.add_argument("--burst-interval", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=100, help="stop after this many requests")
    parser.add_argument("--duration", type=float, default=600.0, help="stop starting jobs after this many s")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, s")
    parser.add_argument("--input-tokens", type=int, default=256, help="random: prompt tokens")
    parser.add_argument("--output-tokens", type=int, default=32, help="random, shared_prefix, multi_turn")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random: +- share of lengths")
    parser.add_argument("--groups", type=int, default=8, help="shared_prefix")
    parser.add_argument("--questions", type=int, default=8, help="shared_prefix")
    parser.add_argument("--system-words", type=int, default=600, help="shared_prefix")
    parser.add_argument("--turns", type=int, default=3, help="multi_turn, agents")
    parser.add_argument("--tenants", type=int, default=4, help="agents")
    parser.add_argument("--sessions", type=int, default=5, help="agents: sessions per tenant")
    parser.add_argument("--trace", type=Path, help="mooncake: a Mooncake-format JSONL")
    parser.add_argument("--block-tokens", type=int, default=512, help="mooncake: tokens per hash id")
    parser.add_argument("--max-input-tokens", type=int, default=3072, help="mooncake")
    parser.add_argument("--speed", type=float, default=1.0, help="mooncake: replay speed-up")
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="goodput SLO on TTFT, s")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="name of this run in reports")
    parser.add_argument("--out", type=Path, default=Path("results/loadtest"))
    parser.add_argument("--compare", type=Path, nargs="+", help="compare saved runs instead of loading")


def make_workload(args: argparse.Namespace):
    if args.workload == "random":
        return RandomLengths(args.input_tokens, args.output_tokens, args.range_ratio, args.seed)
    if args.workload == "shared_prefix":
        return SharedPrefix(args.groups, args.questions, args.system_words, output_tokens=args.output_tokens,
                            seed=args.seed)
    if args.workload == "multi_turn":
        return MultiTurn(args.turns, output_tokens=args.output_tokens, seed=args.seed)
    if args.workload == "agents":
        return AgentSessions(args.tenants, args.sessions, args.turns, args.system_words,
                             output_tokens=args.output_tokens, seed=args.seed)
    if args.trace is None:
        raise SystemExit("--workload mooncake needs --trace")
    return MooncakeReplay(
        args.trace, args.block_tokens, args.max_input_tokens, args.output_tokens, args.speed
    )


def make_arrival(args: argparse.Namespace, rate: float):
    return {
        "poisson": lambda: Poisson(rate, args.seed),
        "constant": lambda: Constant(rate),
        "burst": lambda: Bursts(args.burst_size, args.burst_interval),
        "concurrency": lambda: FixedConcurrency(args.concurrency),
        "trace": TraceTimes,
    }[args.arrival]()


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.compare:
        report.compare(args.compare, console)
        return 0
    if not args.url:
        raise SystemExit("--url is required (or --compare)")
    url = check_target(args.url)
    model = args.model or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    workload = make_workload(args)
    rates = args.rate if args.arrival in ("poisson", "constant") else [args.rate[0]]
    summaries = []
    for rate in rates:
        arrival = make_arrival(args, rate)
        label = args.label or f"{workload.name}-{arrival.name}"
        if len(rates) > 1:
            label += f"-{rate:g}rps"
        limits = Limits(args.requests, args.duration, args.timeout)
        with Progress(console=console, transient=True) as progress:
            load = asyncio.run(run_load(url, workload.jobs(model), arrival, limits, progress))
        summary = report.summarize(load, args.slo_ttft, args.slo_tpot, label)
        report.print_summary(summary, console)
        report.save(load, summary, args.out / f"{label}.json")
        report.plot_run(load, summary, args.out / f"{label}.png")
        summaries.append(summary)
    if len(rates) > 1:
        report.plot_sweep(summaries, rates, args.out / f"{args.label or workload.name}-sweep.png")
    console.print(f"wrote results under {args.out}")
    return 0
