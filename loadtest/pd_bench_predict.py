"""What the serving simulator predicts for `loadtest.pd_bench`'s table on CPU engines (issue #37
item 3), beside what pd_bench measured.

    python -m loadtest.pd_bench_predict --profile docs/cpu/engine_profile-tiny-colocated.json \
        --pd-profile docs/cpu/engine_profile-tiny-pd.json --compare docs/cpu/pd_bench-session39.json \
        [--core-share 0.8] [--hop-ms 2] [--out results/pd_bench_predict.json]

pd_bench's four topologies, each simulated (`loadtest.serving_sim`, a closed loop) at pd_bench's
concurrency on the lengths of its prompts (its seeds: each run's prompts are RandomLengths', each
prompt its own), summarized by the load test's own `loadtest.report.summarize` and reduced to
medians over runs as pd_bench reduces them. With `--compare` the run's settings are the measured
JSON's, each topology's engines compute with the share of a core they had there (the rest went to
the router, the clients, the API servers and Ray: `loadtest.host_cpu`), and a table puts each
measured median beside its prediction; writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest import pd_bench
from loadtest.host_cpu import HostCpu
from loadtest.pd_bench import METRICS, medians_over_runs, topologies
from loadtest.report import summarize
from loadtest.runner import LoadRun
from loadtest.serving_sim import Simulation, Topology, served_span
from loadtest.simulate import TRACE_BLOCK_TOKENS, TraceRecord
from loadtest.step_model import StepModel
from loadtest.workloads import RandomLengths


@dataclasses.dataclass(frozen=True)
class Simulated:
    """How the simulator stands in for one of pd_bench's topologies."""

    topology: str  # serving_sim.Topology.parse's text
    handover: str = "store"  # the profile's hand-over path
    remote_prefill_min_tokens: int = 0  # pd_bench sends every prompt to the prefill instance


def simulated_topologies(input_tokens: int) -> dict[str, Simulated]:
    """pd_bench's topologies (by its names) as the simulator runs them."""
    return dict(zip(topologies(input_tokens), (
        Simulated("colocated:2"), Simulated("pd:1+1"), Simulated("pd:1+1", "direct"),
        Simulated(f"adaptive:1+1@{input_tokens}")), strict=True))


def bench_prompts(input_tokens: int, output_tokens: int, requests: int, seed: int) -> list[TraceRecord]:
    """The prompts pd_bench sends in a run with `seed`: their lengths, no block shared."""
    jobs = itertools.islice(RandomLengths(input_tokens, output_tokens, range_ratio=0.5, seed=seed).jobs("tiny"), requests)
    ids = itertools.count()
    records = []
    for job in jobs:
        length = len(job.body["prompt"])
        blocks = tuple(next(ids) for _ in range(-(-length // TRACE_BLOCK_TOKENS)))
        records.append(TraceRecord(0.0, length, output_tokens, blocks))
    return records


def measured_core_shares(measured_json: dict | None) -> dict[str, float]:
    """The share of its core each topology's engines had in pd_bench's runs (median over runs;
    loadtest.host_cpu): what the router, the clients, the API servers and Ray left them."""
    shares = {}
    for name, summaries in (measured_json or {}).get("runs", {}).items():
        cpus = [HostCpu(**s["host_cpu"]) for s in summaries if "host_cpu" in s]
        if cpus:
            shares[name] = statistics.median(cpu.engine_core_share for cpu in cpus)
    return shares


def predict(args: argparse.Namespace, settings: dict, core_shares: dict[str, float]) -> dict[str, list[dict]]:
    """Each topology's simulated runs (pd_bench's summaries), one per measured run's seed, its
    engines computing with their measured share of a core (--core-share: one share for all)."""
    model = StepModel.load(args.profile)
    pd_model = StepModel.load(args.pd_profile) if args.pd_profile else model
    runs: dict[str, list[dict]] = {}
    for name, simulated in simulated_topologies(settings["input_tokens"]).items():
        topology = Topology.parse(simulated.topology, settings["input_tokens"])
        for run in range(settings["runs"]):
            simulation = Simulation(topology, model, pd_model.handovers[simulated.handover], pd_model,
                                    hop_s=args.hop_ms / 1e3,
                                    remote_prefill_min_tokens=simulated.remote_prefill_min_tokens,
                                    core_share=core_shares.get(name, 1.0) if args.core_share is None else args.core_share)
            prompts = bench_prompts(settings["input_tokens"], settings["output_tokens"], settings["requests"], 7 + run)
            results = simulation.run_closed(prompts, settings["concurrency"])
            load = LoadRun(results, [], 0.0, served_span(results))
            runs.setdefault(name, []).append(summarize(load, slo_ttft_s=2.0, slo_tpot_s=0.1, label=name))
    return runs


def print_table(predicted: dict, measured: dict | None, console: Console) -> None:
    table = Table(title="pd_bench: measured / predicted (error of the prediction), medians over runs"
                  if measured else "pd_bench predicted, medians over runs")
    for column in ("topology", *METRICS):
        table.add_column(column, justify="right")
    for name, row in predicted.items():
        cells = []
        for column in METRICS:
            form = "{:.2f}" if column == "req/s" else "{:.1f}"
            if measured is None:
                cells.append(form.format(row[column]))
                continue
            truth = measured[name][column]
            cells.append(f"{form.format(truth)} / {form.format(row[column])} ({row[column] / truth - 1:+.0%})")
        table.add_row(name, *cells)
    console.print(table)


def plot(predicted: dict, measured: dict | None, path: Path) -> None:
    """One panel per metric: each topology's measured and predicted medians side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = ["TTFT p50 ms", "TPOT p50 ms", "req/s"]
    names = list(predicted)
    figure, axes = plt.subplots(1, len(columns), figsize=(13, 4))
    for axis, column in zip(axes, columns, strict=True):
        if measured is not None:
            axis.bar([i - 0.2 for i in range(len(names))], [measured[n][column] for n in names], 0.4,
                     label="measured", color="tab:gray")
        axis.bar([i + 0.2 for i in range(len(names))], [predicted[n][column] for n in names], 0.4,
                 label="predicted", color="tab:blue")
        axis.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=7)
        axis.set_title(column)
    axes[0].legend()
    figure.suptitle("pd_bench on CPU: measured against the serving simulator (medians over runs)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True, help="the colocated engines' engine_profile JSON")
    parser.add_argument("--pd-profile", type=Path, help="the P/D engines' (engine_profile --role pd)")
    parser.add_argument("--compare", type=Path, help="pd_bench's JSON: its settings, and its medians beside ours")
    parser.add_argument("--hop-ms", type=float, default=2.0, help="the router's hop from a prefill to its decode")
    parser.add_argument("--core-share", type=float, help="the share of its core an engine computes with "
                        "(default: pd_bench's measurement per topology, else 1)")
    parser.add_argument("--out", type=Path, default=Path("results/pd_bench_predict.json"))
    args = parser.parse_args(argv)
    measured_json = json.loads(args.compare.read_text()) if args.compare else None
    # pd_bench's own settings: those the measured run had, else its defaults
    defaults = vars(pd_bench.arguments().parse_args([]))
    settings = {key: int(measured_json["args"][key]) if measured_json else defaults[key]
                for key in ("runs", "requests", "concurrency", "input_tokens", "output_tokens")}
    core_shares = measured_core_shares(measured_json)
    runs = predict(args, settings, core_shares)
    predicted = medians_over_runs(runs)
    measured = measured_json["medians"] if measured_json else None
    print_table(predicted, measured, Console(width=200))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "settings": settings, "core_shares": core_shares,
                                    "predicted": predicted, "measured": measured, "runs": runs}, indent=1))
    plot(predicted, measured, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
