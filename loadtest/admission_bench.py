"""What sharing the per-key limits between routers costs a request: one admission (take a slot,
give it back) with the router's own limits against the cluster's ledger, a Ray actor on a
one-node Ray head of this process's own (deploy/admission_ledger.py), same run, medians.

    python -m loadtest.admission_bench [--requests 2000] [--runs 5] [--concurrency 1 16]

Sequential requests show the round trip each admission adds; concurrent ones (asyncio tasks of
one router) show what the single actor serves at once.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.environment import use_ray
from loadtest.output import write_results
from router.admission import KeyLimits, Limits, LocalLimits
from security.credentials import ClusterCredentials


async def admissions_per_s(limits: Limits, requests: int, concurrency: int) -> float:
    """Admissions (acquire, then release) per second, `concurrency` at a time, over 64 keys."""
    keys = [f"key-{k}" for k in range(64)]

    async def worker(offset: int) -> None:
        for k in range(offset, requests, concurrency):
            release = await limits.acquire(keys[k % len(keys)])
            release()

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return requests / (time.perf_counter() - started)


async def measure(args: argparse.Namespace) -> dict:
    from deploy.admission_ledger import join_ledger

    ledger = await join_ledger(None, 1_000_000)
    local = LocalLimits(KeyLimits(None, 1_000_000))
    rows = []
    for concurrency in args.concurrency:
        runs = {"local": [], "ledger": []}
        for _ in range(args.runs):  # alternated, so both see the same machine
            for name, limits in (("local", local), ("ledger", ledger)):
                runs[name].append(await admissions_per_s(limits, args.requests, concurrency))
        medians = {name: statistics.median(values) for name, values in runs.items()}
        rows.append({"concurrency": concurrency, "runs": runs,
                     "local_us": 1e6 / medians["local"], "ledger_us": 1e6 / medians["ledger"],
                     "ledger_per_s": medians["ledger"]})
    return {"requests": args.requests, "runs": args.runs, "rows": rows}


def draw(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [str(r["concurrency"]) for r in rows]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    positions = range(len(rows))
    axis.bar([p - width / 2 for p in positions], [r["local_us"] for r in rows], width, label="router's own limits")
    axis.bar([p + width / 2 for p in positions], [r["ledger_us"] for r in rows], width, label="shared ledger (Ray actor)")
    axis.set_xticks(list(positions), labels)
    axis.set_xlabel("admissions in flight")
    axis.set_ylabel("µs per admission (median)")
    axis.set_yscale("log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, default=Path("results/admission_bench.json"))
    args = parser.parse_args(argv)
    from deploy.ray_head import start_ray

    use_ray(ClusterCredentials.generate().ray_auth_env(), loopback=True)  # a head of its own, as serve's
    start_ray(None)
    import ray

    try:
        results = asyncio.run(measure(args))
    finally:
        ray.shutdown()
    table = Table(title=f"one admission: the router's own limits vs the shared ledger ({args.runs} runs, medians)")
    for column in ("in flight", "own limits, µs", "ledger, µs", "ledger / own", "ledger admissions/s"):
        table.add_column(column)
    for row in results["rows"]:
        table.add_row(str(row["concurrency"]), f"{row['local_us']:.1f}", f"{row['ledger_us']:.1f}",
                      f"{row['ledger_us'] / row['local_us']:.0f}x", f"{row['ledger_per_s']:.0f}")
    Console().print(table)
    write_results(args.out, results, lambda png: draw(results, png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
