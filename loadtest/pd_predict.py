"""What the serving simulator predicts for a load test, beside what the load test measured (issue
#37 item 3).

    python -m loadtest.pd_predict --profile docs/gpu/engine_profile-h200-8b.json \
        [--topologies colocated:2,pd:1+1,adaptive:1+1] [--rates 4,8,12,16] [--duration 20]
        [--workload 4096/256] [--handover direct --network nvlink]
        [--compare docs/gpu/pd_goodput-h200x2-run1.json ...] [--out results/pd_predict.json]

Runs `loadtest.serving_sim` for each topology and rate with the seeds `loadtest.pd_goodput` used
(rate k of the list: Poisson seed k), prints pd_goodput's table for the prediction, and with
`--compare` (pd_goodput or pd_bench JSON) a table of measured against predicted: served rate,
goodput at both SLOs, TTFT p50, TPOT p50, gap p99, and the error of each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest.serving_sim import NETWORKS_GBIT, Topology, Workload, simulate_rate
from loadtest.step_model import Handover, StepModel

# pd_goodput's topology names -> the simulator's, for two engines
MEASURED_NAMES = {"colocated": "colocated:2", "pd-direct": "pd:1+1", "pd-adaptive": "adaptive:1+1",
                  "pd-store": "pd:1+1"}


def models_and_handover(args: argparse.Namespace, network: str) -> tuple[StepModel, StepModel, Handover]:
    """The colocated engines' step model, the P/D engines' and the hand-over over `network`."""
    model = StepModel.load(args.profile)
    pd_model = StepModel.load(args.pd_profile) if args.pd_profile else model
    handover = pd_model.handovers[args.handover]
    link = NETWORKS_GBIT[network]
    return model, pd_model, handover if link is None else handover.over_network(link)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", type=Path, required=True, help="loadtest.engine_profile's JSON")
    parser.add_argument("--pd-profile", type=Path, help="the P/D engines' (engine_profile --role pd); default --profile")
    parser.add_argument("--workload", default="4096/256", help="INPUT/OUTPUT tokens, or a Mooncake trace (.jsonl)")
    parser.add_argument("--handover", choices=("direct", "store"), default="direct")
    parser.add_argument("--duration", type=float, default=20.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--network", choices=sorted(NETWORKS_GBIT), default="nvlink",
                        help="the link a hand-over's bytes cross (the profile's path bounds it too)")
    parser.add_argument("--topologies", default="colocated:2,pd:1+1,adaptive:1+1")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[4, 8, 12, 16])
    parser.add_argument("--compare", type=Path, nargs="*", default=[], help="measured pd_goodput JSON")
    parser.add_argument("--out", type=Path, default=Path("results/pd_predict.json"))


def measured_rows(paths: list[Path]) -> dict[tuple[str, float], dict]:
    """Measured rows by (simulator topology, offered rate); the first of each wins."""
    rows: dict[tuple[str, float], dict] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            if "failed" not in row and row["topology"] in MEASURED_NAMES:
                rows.setdefault((MEASURED_NAMES[row["topology"]], row["offered_rps"]), row)
    return rows


COMPARED = (("served", lambda r: r["throughput_rps"], "{:.2f}"),
            ("good stream", lambda r: r["goodput_streaming_rps"], "{:.2f}"),
            ("good loose", lambda r: r["goodput_loose_rps"], "{:.2f}"),
            ("TTFT p50 ms", lambda r: r["ttft"]["p50_ms"], "{:.0f}"),
            ("TPOT p50 ms", lambda r: r["tpot"]["p50_ms"], "{:.1f}"),
            ("gap p99 ms", lambda r: r["itl"]["p99_ms"], "{:.1f}"))


def comparison(predicted: list[dict], measured: dict[tuple[str, float], dict]) -> list[dict]:
    """Each predicted row with its measured twin: the values of COMPARED and their errors."""
    pairs = []
    for row in predicted:
        twin = measured.get((row["topology"], row["offered_rps"]))
        if twin is None:
            continue
        values = {name: (get(twin), get(row)) for name, get, _ in COMPARED}
        pairs.append({"topology": row["topology"], "offered_rps": row["offered_rps"], "values": values})
    return pairs


def print_comparison(pairs: list[dict], console: Console) -> None:
    table = Table(title="measured / predicted (error of the prediction)")
    for column in ("topology", "offered", *(name for name, _, _ in COMPARED)):
        table.add_column(column, justify="left" if column == "topology" else "right")
    for pair in pairs:
        cells = []
        for name, _, form in COMPARED:
            measured, predicted = pair["values"][name]
            error = f" ({predicted / measured - 1:+.0%})" if measured else ""
            cells.append(f"{form.format(measured)} / {form.format(predicted)}{error}")
        table.add_row(pair["topology"], f"{pair['offered_rps']:g}", *cells)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    from loadtest.pd_goodput import REMOTE_PREFILL_MIN_TOKENS, print_table

    console = Console(width=200)
    model, pd_model, handover = models_and_handover(args, args.network)
    workload = Workload.parse(args.workload)
    mean_input = int(workload.mean_lengths()[0])
    rows = []
    for name in args.topologies.split(","):
        topology = Topology.parse(name, mean_input)
        for seed, rate in enumerate(args.rates):
            rows.append(simulate_rate(topology, model, handover, workload, rate, args.duration, seed, pd_model,
                                      remote_prefill_min_tokens=REMOTE_PREFILL_MIN_TOKENS))
    print_table(rows, console)
    pairs = comparison(rows, measured_rows(args.compare))
    if pairs:
        print_comparison(pairs, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "compared": pairs}, indent=1))
    console.print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
