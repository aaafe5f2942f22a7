"""The same benchmark from two revisions of this repository, alternated in one run.

    python -m loadtest.compare_revisions --before fed1ebb [--rounds 3] [--benches router,store,routing,pd]
    python -m loadtest.compare_revisions --before main --benches serving   # before a change to the request path lands

Checks the `--before` revision out into a temporary worktree and runs each benchmark there and
here by turns (before, after, before, after, ...), with the same virtual environment, each in
its own process whose working directory and import path are its tree: what differs is the code.
Benchmarks (each prints and writes its own JSON, read back here):
  router - `loadtest.router_overhead --null-engine`: the router's own added time to first token
           and total, in front of a stand-in engine (no Ray, no vLLM);
  store  - `loadtest.store_bench`: store reads and writes (GiB/s; raw NIXL beside them);
  routing - `loadtest.routing_decision`: hashing, index match and scoring of an 8k-token prompt;
  pd     - `loadtest.pd_bench` (one run of 24 requests per topology, tiny model): TTFT, TPOT and
           throughput of colocated and P/D serving;
  idle_flood - `loadtest.router_overhead --idle-flood 20000` (one run, tiny model): a tenant's TTFT
           through the router while a stranger holds 20,000 half-sent connections at it, as
           ratios to the quiet phase of the same run;
  routing_live, routing_live_pd - `loadtest.routing_live` (the multi-tenant agent workload, 5
           seeds, two colocated instances / P/D 1+1): TTFT p50/p90/p99, wall time and cached share
           of round robin and kv_aware. This tree's load generator against each tree's server
           (the workload is newer than the revisions it compares), the others each tree's own.
Prints a table of medians over rounds and after/before ratios; writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHES = {
    "router": (["-m", "loadtest.router_overhead", "--null-engine", "--runs", "1", "--rounds", "300"],
               lambda r: {"added_ttft_ms": r["added_ms"]["ttft"], "added_total_ms": r["added_ms"]["total"]}),
    "store": (["-m", "loadtest.store_bench", "--runs", "3"],
              lambda r: {f"{row['path']}_{row['chunk_bytes'] // 1024}k_gib_s": row["gib_s"] for row in r["rows"]
                         if row["path"].startswith("store")}),
    "routing": (["-m", "loadtest.routing_decision", "--iterations", "1000"],
                lambda r: {"decision_p50_ms": r["total"]["p50_ms"], "decision_p99_ms": r["total"]["p99_ms"]}),
    "pd": (["-m", "loadtest.pd_bench", "--runs", "1", "--requests", "24"],
           lambda r: {f"{name}: {col}": v for name, row in r["medians"].items() for col, v in row.items()
                      if col in ("TTFT p50 ms", "TPOT p50 ms", "req/s")}),
    "idle_flood": (["-m", "loadtest.router_overhead", "--idle-flood", "20000", "--runs", "1", "--rounds", "200"],
                   lambda r: {f"flood/quiet {metric}": r["idle_flood"]["ratio"][metric]
                              for metric in ("median_ms", "p90_ms", "p99_ms", "health_max_ms")}),
    "routing_live": (["-m", "loadtest.routing_live", "--seeds", "5"], lambda r: _routing(r)),
    "routing_live_pd": (["-m", "loadtest.routing_live", "--seeds", "5", "--topology", "pd"], lambda r: _routing(r)),
}
SETS = {"serving": ("router", "routing", "routing_live", "routing_live_pd")}
"""Named sets of benchmarks: `serving` is what every change to router/, engine/, prefill/ or
decode/ runs before it lands (the router's own cost and the live agents workload, colocated and
P/D; ~45 min a round on the 2-core machine)."""
SERVED_FROM_TREE = {"routing_live", "routing_live_pd"}
"""Benchmarks run by this tree's script against the other tree's server (`--serve-tree`)."""


def _routing(result: dict) -> dict[str, float]:
    # None: what the tree's server cannot show (computed tokens need its placements view)
    return {f"{policy} {metric}": value for policy, row in result["medians"].items()
            for metric, value in row.items() if not metric.endswith("_ratio") and value is not None}


PLUGIN_GROUP = "vllm.general_plugins"


def tree_plugins(tree: Path, scratch: Path) -> list[str]:
    """Where the tree's own vLLM plugins are declared, when the installed package (this
    checkout's) declares them at other module paths: a directory holding a distribution of
    them, put on the tree's import path, so that the tree's engines find their own (vLLM loads
    every plugin of the name: the installed one, whose module the tree lacks, fails and is
    logged; the tree's loads)."""
    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    declared = project.get("entry-points", {}).get(PLUGIN_GROUP, {})
    installed = {(p.name, p.value) for p in entry_points(group=PLUGIN_GROUP)}
    if set(declared.items()) <= installed:
        return []
    info = scratch / "tree-plugins" / "pdcluster_tree_plugins-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pdcluster-tree-plugins\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n"
                                           + "".join(f"{name} = {value}\n" for name, value in declared.items()))
    return [str(info.parent)]


def run(tree: Path, bench: str, out: Path) -> dict[str, float]:
    arguments, extract = BENCHES[bench]
    # Both trees serve the same checkpoints (this checkout's, where it has built them).
    models = os.environ.get("PDCLUSTER_MODEL_ROOT") or str(REPO / ".cache" / "models")
    if bench in SERVED_FROM_TREE:
        arguments, tree = [*arguments, "--serve-tree", str(tree)], REPO
    path = [str(tree), *tree_plugins(tree, out.parent)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PDCLUSTER_MODEL_ROOT": models}
    subprocess.run([sys.executable, *arguments, "--out", str(out)], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=3600)
    return extract(json.loads(out.read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a git revision (the tree before the change)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--benches", default="router,store",
                        help=f"comma-separated names of {sorted(BENCHES)}, or a set: {SETS}")
    parser.add_argument("--out", type=Path, default=Path("results/compare_revisions.json"))
    args = parser.parse_args(argv)
    benches = [bench for name in args.benches.split(",") for bench in SETS.get(name, (name,))]
    if unknown := set(benches) - BENCHES.keys():
        parser.error(f"unknown benchmarks {sorted(unknown)}")
    samples: dict[str, dict[str, dict[str, list[float]]]] = {b: {"before": {}, "after": {}} for b in benches}
    with tempfile.TemporaryDirectory(prefix="pdc-before-") as scratch:
        before = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before), args.before],
                       check=True, capture_output=True)
        try:
            for round_ in range(args.rounds):
                for bench in benches:
                    for side, tree in (("before", before), ("after", REPO)):
                        values = run(tree, bench, Path(scratch) / f"{bench}-{side}-{round_}.json")
                        for name, value in values.items():
                            samples[bench][side].setdefault(name, []).append(value)
                        print(f"round {round_ + 1}/{args.rounds} {bench} {side}: {values}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], check=False)
    rows = summarize(samples)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"before": args.before, "rounds": args.rounds, "rows": rows}, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def summarize(samples: dict[str, dict[str, dict[str, list[float]]]]) -> list[dict]:
    """Per benchmark and metric (those both trees gave), the medians over rounds and after/before;
    printed as a table."""
    rows = []
    print(f"\n{'bench':7s} {'metric':44s} {'before':>9s} {'after':>9s} {'after/before':>13s}")
    for bench, sides in samples.items():
        for name, values in sides["before"].items():
            if name not in sides["after"]:
                continue
            b, a = statistics.median(values), statistics.median(sides["after"][name])
            rows.append({"bench": bench, "metric": name, "before": b, "after": a, "ratio": a / b if b else None,
                         "before_runs": values, "after_runs": sides["after"][name]})
            print(f"{bench:7s} {name:44s} {b:9.3f} {a:9.3f} {a / b if b else float('nan'):13.3f}")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    rows = [r for r in rows if r["ratio"] is not None]
    labels = [f"{r['bench']}: {r['metric']}" for r in rows]
    axis.barh(labels, [r["ratio"] for r in rows])
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.set_xlabel("after / before (medians; time: lower is better, GiB/s: higher is better)")
    axis.set_title("The same benchmarks from two revisions, alternated in one run")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
