"""KV-aware routing against round robin on real engines: time to first token, and vLLM's own
prefix-cache counters.

    python -m loadtest.routing_live [--workload agents|shared_prefix] [--policies round_robin kv_aware]
                                    [--topology colocated|pd] [--model tiny|smollm2] [--seeds 5] [--serve-tree DIR]
                                    [--serve-arg=--structured-migration ...]

For each policy it starts `pdcluster serve --model M` (tiny by default; two colocated instances, or P/D 1+1)
with `--policy P` and sends one workload per seed, each seed new prompts, at a fixed concurrency:
by default the multi-tenant agent workload (loadtest/workloads.py AgentSessions: tenants with
long system prompts, sessions whose prompts grow turn by turn with tool results). Each seed's
TTFT percentiles, wall time, the share of prompt blocks the engines found cached (their
`vllm:prefix_cache_hits/queries` counters, before and after) and the median and p90 of the prompt
tokens each request's instance had to compute (the router's placement records,
loadtest/placement_trace.py) are recorded; the table shows the
medians over seeds and each policy's ratio to the first. `--serve-tree` serves from another
checkout of this repository with this load generator (loadtest.compare_revisions uses it to
compare revisions on the same workload). Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest.arrivals import FixedConcurrency
from loadtest.local_cluster import LocalServer
from loadtest.output import write_results
from loadtest.placement_trace import PlacementTrace
from loadtest.report import summarize
from loadtest.runner import Limits, run_load
from loadtest.workloads import AgentSessions, SharedPrefix

TOPOLOGIES = {"colocated": ["--instances", "2"], "pd": ["--prefill", "1", "--decode", "1"]}
METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "wall_s", "cached_share", "busiest_share",
           "engine_ttft_mean_s", "router_added_s", "first_turn_ttft_p50_s", "later_turns_ttft_p50_s",
           "computed_tokens_p50", "computed_tokens_p90")


WARM_UP_SEED = 1_000_000
"""Prompts no measured seed shares (not -1: `random.Random` seeds with |n|, so -1 would warm seed 1's)."""


def workload(name: str, seed: int) -> AgentSessions | SharedPrefix:
    if name == "agents":
        return AgentSessions(seed=seed)
    return SharedPrefix(groups=8, questions=8, system_words=600, output_tokens=8, seed=seed)


def measure(policy: str, args: argparse.Namespace) -> list[dict]:
    """One server with `policy`; a run per seed (after an untimed warm-up run)."""
    serve = ["--model", args.model, *TOPOLOGIES[args.topology], "--policy", policy, *args.serve_arg]
    log = args.out.parent / f"routing_live-{args.topology}-{policy}.log"
    runs = []
    with LocalServer(serve, log, tree=args.serve_tree) as server:
        for seed in (None, *range(args.seeds)):  # None: the warm-up (vLLM's first requests pay lazy set-up)
            jobs = workload(args.workload, WARM_UP_SEED if seed is None else seed)
            requests = _requests(jobs)
            with PlacementTrace(server) as trace:
                load = asyncio.run(run_load(server.url, jobs.jobs(Path(args.model).name),
                                            FixedConcurrency(args.concurrency), Limits(max_requests=requests)))
            summary = summarize(load, slo_ttft_s=1.0, slo_tpot_s=0.2, label=policy)
            if seed is None:
                continue
            runs.append({"seed": seed, "requests": summary["requests"], "errors": sum(summary["errors"].values()),
                         "ttft_p50_s": summary["ttft"]["p50_ms"] / 1e3, "ttft_p90_s": summary["ttft"]["p90_ms"] / 1e3,
                         "ttft_p99_s": summary["ttft"]["p99_ms"] / 1e3, "wall_s": load.duration_s,
                         "cached_share": summary["prefix_hit_rate"],
                         **{m: summary[m] for m in ("busiest_share", "engine_ttft_mean_s", "router_added_s")},
                         **ttft_p50_by_turn(load.results), **trace.summary()})
            print(f"{policy} seed {seed}: " + " ".join(f"{m}={runs[-1][m]:.3f}" for m in METRICS if runs[-1][m] is not None), flush=True)
    return runs


def ttft_p50_by_turn(results) -> dict[str, float | None]:
    """The median TTFT of sessions' first turns (a tenant's system prompt and a task: where a
    placement that pins tenants to instances makes new sessions wait) and of their later ones."""
    def p50(turns) -> float | None:
        ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None and r.turn is not None and turns(r.turn)]
        return statistics.median(ttfts) if ttfts else None
    return {"first_turn_ttft_p50_s": p50(lambda t: t == 0), "later_turns_ttft_p50_s": p50(lambda t: t > 0)}


def _requests(jobs) -> int:
    if isinstance(jobs, AgentSessions):
        return jobs.tenants * jobs.sessions * jobs.turns
    return jobs.groups * jobs.questions


def medians(runs: list[dict]) -> dict[str, float]:
    values = {metric: [r[metric] for r in runs if r[metric] is not None] for metric in METRICS}
    return {metric: statistics.median(v) if v else None for metric, v in values.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("agents", "shared_prefix"), default="agents")
    parser.add_argument("--policies", nargs="+", default=["round_robin", "kv_aware"])
    parser.add_argument("--topology", choices=tuple(TOPOLOGIES), default="colocated")
    parser.add_argument("--model", default="tiny",
                        help="a model of `pdcluster model` (smollm2: a prefill that costs what a cache hit saves)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--serve-tree", type=Path, help="serve from this checkout of the repository")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="one more argument of pdcluster serve (repeatable), e.g. --serve-arg=--structured-migration")
    parser.add_argument("--out", type=Path, default=Path("results/routing_live.json"))
    args = parser.parse_args(argv)
    results = {policy: measure(policy, args) for policy in args.policies}
    summary = {policy: medians(runs) for policy, runs in results.items()}
    base = summary[args.policies[0]]
    table = Table(title=f"{args.workload}, {args.model}, {args.topology}, concurrency {args.concurrency}: medians of "
                        f"{args.seeds} seeds (ratios to {args.policies[0]})")
    for column in ("policy", "TTFT p50 s", "ratio", "TTFT p90 s", "ratio", "TTFT p99 s", "ratio", "wall s",
                   "cached share", "busiest share",
                   "engine TTFT mean s", "router adds s", "p50 first turns s", "p50 later turns s",
                   "computed tokens p50", "p90"):
        table.add_column(column, justify="right")
    for policy, row in summary.items():
        row.update({f"{m}_ratio": row[m] / base[m] for m in METRICS if base[m] and row[m] is not None})
        table.add_row(policy, *(f"{row[m]:.3f}" for m in ("ttft_p50_s",)), f"{row['ttft_p50_s_ratio']:.2f}",
                      f"{row['ttft_p90_s']:.3f}", f"{row['ttft_p90_s_ratio']:.2f}", f"{row['ttft_p99_s']:.3f}",
                      f"{row['ttft_p99_s_ratio']:.2f}", f"{row['wall_s']:.1f}", f"{row['cached_share']:.3f}",
                      *(f"{row[m]:.3f}" if row[m] is not None else "-"
                        for m in ("busiest_share", "engine_ttft_mean_s", "router_added_s", "first_turn_ttft_p50_s",
                                  "later_turns_ttft_p50_s")),
                      *(f"{row[m]:.0f}" if row[m] is not None else "-" for m in ("computed_tokens_p50", "computed_tokens_p90")))
    Console(width=190).print(table)
    data = {"workload": args.workload, "model": args.model, "topology": args.topology, "seeds": args.seeds, "concurrency": args.concurrency,
            "serve_tree": str(args.serve_tree) if args.serve_tree else None, "medians": summary, "runs": results}
    write_results(args.out, data, lambda png: plot(summary, png, table.title))
    return 0


def plot(summary: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    metrics = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
    width = 0.8 / len(summary)
    for k, (policy, row) in enumerate(summary.items()):
        axis.bar([i + k * width for i in range(len(metrics))], [row[m] for m in metrics], width, label=policy)
    axis.set_xticks([i + width * (len(summary) - 1) / 2 for i in range(len(metrics))], ["TTFT p50", "p90", "p99"])
    axis.set_ylabel("seconds")
    axis.set_title(title, fontsize=8)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
