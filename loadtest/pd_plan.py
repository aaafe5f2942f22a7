"""Pool sizes for a workload, an SLO and a GPU count, planned with the serving simulator (issue
#37 item 4): `pdcluster plan`.

    pdcluster plan --profile docs/gpu/engine_profile-h200-8b-colocated.json \
        --pd-profile docs/gpu/engine_profile-h200-8b-pd.json --gpus 8 [--workload 4096/256 | trace.jsonl]
        [--slo streaming|loose] [--network nvlink|rdma-400|tcp-100 ...] [--duration 20] [--out results/plan.json]

For each GPU count, the candidates are all-colocated, P/D splits (prefill share 1/8 ... 3/4 of the
GPUs; every prompt prefilled by the prefill pool, as loadtest.pd_goodput measures P/D: the router's
--remote-prefill-min-tokens 0, without which prompts shorter than its default stay on the decode
engines) and the same splits adaptive (decode prefills while a prefill engine has more than one
mean prompt queued: the router's --remote-prefill-max-queued-tokens); each is simulated
(`loadtest.serving_sim`) at offered rates around the GPUs' estimated capacity (0.25x ... 1.5x).
A candidate's goodput is its best over those rates; the plan is the candidate with the most, and
P/D pays at the offered rates where the best P/D candidate serves 5% more goodput than
all-colocated (where it stops paying is where that list ends). With several `--network` values the whole plan
is made for each: a hand-over's bytes cross that link (the profile's own path bounds it too), so
the table shows how the answer moves with the network. One GPU per engine (tensor parallelism is
not in the profile). Prints the plan with `pdcluster serve` flags; writes JSON and a PNG of
goodput against offered rate per candidate (the first GPU count and network).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import shlex
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest.output import write_results
from loadtest.pd_goodput import LOOSE, REMOTE_PREFILL_MIN_TOKENS, STREAMING
from loadtest.pd_predict import add_common_arguments, models_and_handover
from loadtest.serving_sim import DECODE_MODEL, NETWORKS_GBIT, Topology, Workload, simulate_rate
from loadtest.step_model import Step, StepModel, chunked_prefill

__doc__ += "\n" + DECODE_MODEL  # `pdcluster plan --help` states the model it plans with

PREFILL_SHARES = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4)
LOAD_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


def candidates(gpus: int, mean_input: int) -> list[Topology]:
    splits = sorted({min(max(round(gpus * share), 1), gpus - 1) for share in PREFILL_SHARES}) if gpus > 1 else []
    return ([Topology(f"colocated:{gpus}", gpus)]
            + [Topology(f"pd:{p}+{gpus - p}", gpus - p, p) for p in splits]
            + [Topology(f"adaptive:{p}+{gpus - p}@{mean_input}", gpus - p, p, mean_input) for p in splits])


def capacity_per_gpu(model: StepModel, mean_input: float, mean_output: float) -> float:
    """Requests per second one engine could finish if it did nothing but them: a prompt's
    prefill alone, plus its share of decode steps at a 64-sequence batch."""
    prefill_s = sum(model.seconds(s) for s in chunked_prefill([int(mean_input)], model.max_num_batched_tokens))
    step = model.seconds(Step(64, int(64 * (mean_input + mean_output / 2))))
    return 1.0 / (prefill_s + mean_output * step / 64)


def plan_one(args: argparse.Namespace, gpus: int, network: str, console: Console) -> dict:
    """Every candidate for `gpus` at every rate, over `network`, in `args.jobs` processes; the
    best per SLO."""
    model, _, _ = models_and_handover(args, network)
    workload = _workload(args.workload)
    mean_input, mean_output = workload.mean_lengths()
    rates = [round(gpus * capacity_per_gpu(model, mean_input, mean_output) * f, 2) for f in LOAD_FACTORS]
    tasks = [(args.profile, args.pd_profile, args.handover, network, args.workload, topology, rate, args.duration, seed)
             for topology in candidates(gpus, int(mean_input)) for seed, rate in enumerate(rates)]
    if args.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(_simulated, tasks))
    else:
        rows = [_simulated(task) for task in tasks]
    rows = [row | {"network": network, "gpus": gpus} for row in rows]
    console.print(f"{gpus} GPUs, {network}: {len(rows)} runs simulated")
    return {"gpus": gpus, "network": network, "workload": workload.name, "rates": rates, "rows": rows,
            "best": {slo.name: best_for(rows, slo.name) for slo in (STREAMING, LOOSE)}}


@functools.cache
def _workload(text: str) -> Workload:
    return Workload.parse(text)


@functools.cache
def _models(profile: Path, pd_profile: Path | None, handover: str, network: str):
    return models_and_handover(argparse.Namespace(profile=profile, pd_profile=pd_profile, handover=handover), network)


def _simulated(task: tuple) -> dict:
    """One (topology, rate) of a plan, in whichever process runs it (profiles and trace loaded once per process)."""
    profile, pd_profile, handover_kind, network, workload, topology, rate, duration, seed = task
    model, pd_model, handover = _models(profile, pd_profile, handover_kind, network)
    return simulate_rate(topology, model, handover, _workload(workload), rate, duration, seed, pd_model,
                         remote_prefill_min_tokens=REMOTE_PREFILL_MIN_TOKENS)


def best_for(rows: list[dict], slo: str) -> dict:
    """The candidate with the most goodput at `slo` (its best over the rates), all-colocated's,
    and the offered rates at which the best P/D candidate there beats all-colocated by 5%."""
    key = f"goodput_{slo}_rps"
    peak: dict[str, float] = {}
    by_rate: dict[float, dict[str, float]] = {}
    for row in rows:
        peak[row["topology"]] = max(peak.get(row["topology"], 0.0), row[key])
        by_rate.setdefault(row["offered_rps"], {})[row["topology"]] = row[key]
    colocated = next(name for name in peak if name.startswith("colocated"))
    best = max(peak, key=lambda name: (peak[name], name == colocated))
    pays = [rate for rate, at in sorted(by_rate.items())
            if max(v for name, v in at.items() if name != colocated) > 1.05 * at[colocated]]
    return {"topology": best, "goodput_rps": peak[best], "colocated_goodput_rps": peak[colocated],
            "vs_colocated": peak[best] / peak[colocated] if peak[colocated] else None,
            "pd_pays_at_rps": pays, "serve_flags": serve_flags(best)}


def serve_flags(name: str) -> str:
    """`pdcluster serve`'s pool flags for a candidate."""
    topology = Topology.parse(name, 0)
    if not topology.prefill:
        return f"--instances {topology.serving}"
    flags = (f"--prefill {topology.prefill} --decode {topology.serving} "
             f"--remote-prefill-min-tokens {REMOTE_PREFILL_MIN_TOKENS}")
    if topology.max_queued_tokens is not None:
        flags += f" --remote-prefill-max-queued-tokens {topology.max_queued_tokens}"
    return flags


def print_plans(plans: list[dict], console: Console) -> None:
    table = Table(title="plans: the candidate with the most goodput per SLO (simulated)")
    for column in ("GPUs", "network", "SLO", "best", "goodput req/s", "colocated", "vs colocated",
                   "P/D pays at req/s", "pdcluster serve"):
        table.add_column(column)
    for plan in plans:
        for slo, best in plan["best"].items():
            ratio = f"{best['vs_colocated']:.2f}x" if best["vs_colocated"] else "-"
            pays = ", ".join(f"{r:g}" for r in best["pd_pays_at_rps"]) or "none"
            table.add_row(str(plan["gpus"]), plan["network"], slo, best["topology"], f"{best['goodput_rps']:.2f}",
                          f"{best['colocated_goodput_rps']:.2f}", ratio, pays, best["serve_flags"])
    console.print(table)


def plot(plan: dict, path: Path) -> None:
    from loadtest.report import _pyplot

    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, slo in zip(axes, (STREAMING, LOOSE), strict=True):
        for name in dict.fromkeys(r["topology"] for r in plan["rows"]):
            mine = [r for r in plan["rows"] if r["topology"] == name]
            style = "k-" if name.startswith("colocated") else ("--" if name.startswith("adaptive") else "-")
            axis.plot([r["offered_rps"] for r in mine], [r[f"goodput_{slo.name}_rps"] for r in mine], style,
                      marker="o", markersize=3, label=name)
        axis.set(title=f"{plan['gpus']} GPUs, {plan['workload']}, {plan['network']}: {slo.name} SLO",
                 xlabel="offered req/s", ylabel="goodput req/s (simulated)")
        axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--gpus", type=int, nargs="+", default=[8])
    parser.add_argument("--networks", nargs="+", choices=sorted(NETWORKS_GBIT), default=["rdma-400"],
                        help="plan for each link between prefill and decode engines")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="simulations run in parallel")
    parser.add_argument("--out", type=Path, default=Path("results/plan.json"))
    parser.add_argument("--serve-args", type=Path, metavar="FILE",
                        help="write the plan's pool flags (the first --gpus and --networks, at --slo), one per "
                        "line, for `pdcluster serve --model M @FILE` to start its pools from")
    parser.add_argument("--slo", choices=(STREAMING.name, LOOSE.name), default=STREAMING.name,
                        help="the SLO whose plan --serve-args holds")


def run(args: argparse.Namespace) -> int:
    console = Console(width=220)
    plans = [plan_one(args, gpus, network, console) for gpus in args.gpus for network in args.networks]
    print_plans(plans, console)
    write_results(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "plans": plans},
                  lambda png: plot(plans[0], png))
    if args.serve_args:
        best = plans[0]["best"][args.slo]
        args.serve_args.parent.mkdir(parents=True, exist_ok=True)
        args.serve_args.write_text("".join(f"{token}\n" for token in shlex.split(best["serve_flags"])))
        console.print(f"{best['topology']} ({plans[0]['gpus']} GPUs, {args.slo} SLO): "
                      f"pdcluster serve --model MODEL @{args.serve_args}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
