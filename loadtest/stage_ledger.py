"""The stage ledger of a start from nothing (issue #36 goal 5): where the seconds to the first
token go, for each `loadtest.cold_start` result named, beside the split the seeds give a cold
start (weights ~30%, runtime initialisation ~22%, KV cache ~18%, CUDA graphs ~32%).

    python -m loadtest.stage_ledger --out docs/gpu/stage_ledger-m8b.json \\
        "ours, compiled (H200)=docs/gpu/cold_start-m8b-fresh-graphs.json:preimported" \\
        "ours, uncompiled (H100)=docs/gpu/cold_start-m8b-fresh-uncompiled.json:preimported" \\
        "plain vLLM (H100)=docs/gpu/cold_start-m8b-fresh-uncompiled.json:plain"

Each argument is LABEL=FILE:PATH[#RUN], PATH one of the file's paths (its medians, or run RUN's
stages). Our
timeline's stages are grouped into the seeds' four, with torch.compile and the first request
apart; plain vLLM's start is split the same way where its log was read (loadtest.cold_start
since session 29), one "unsplit" bar where it was not. Prints seconds and shares per group, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadtest.output import write_results

GROUPS = {
    "weights": ("weights", "weights_checksum"),
    # node_caches: a new node's start caches arriving from a peer (engine/node_caches.py)
    "runtime": ("spawn_and_import", "engine_process", "worker_and_model", "engine_ready", "api_server", "healthy",
                "node_caches"),
    "compile": ("compile",),
    "KV cache": ("profile_and_kv_cache",),
    "CUDA graphs": ("graph_capture",),
    "first request": ("warmup_request", "first_token"),
    "unsplit": ("server_up",),
}
"""Timeline stages (engine/lifecycle.py) by what they do; `server_up` is plain vLLM's whole start
as loadtest.cold_start timed it before it read plain vLLM's log (results of sessions up to 29)."""

SEEDS_SPLIT = {"weights": 0.30, "runtime": 0.22, "KV cache": 0.18, "CUDA graphs": 0.32}


def ledger_row(stages: dict[str, float]) -> dict[str, float]:
    """Seconds per group; a stage no group names is an error (a new stage must be placed)."""
    unknown = set(stages) - {stage for names in GROUPS.values() for stage in names}
    if unknown:
        raise ValueError(f"stages in no group: {sorted(unknown)}")
    return {group: sum(stages.get(stage, 0.0) for stage in names) for group, names in GROUPS.items()}


def read_run(spec: str) -> tuple[str, dict[str, float]]:
    label, _, source = spec.partition("=")
    file, _, path = source.rpartition(":")
    path, _, run = path.partition("#")
    result = json.loads(Path(file).read_text())
    stages = result["records"][path][int(run)]["stages_s"] if run else result["summary"][path]["stages_s"]
    return label, ledger_row(stages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="LABEL=FILE:PATH[#RUN]")
    parser.add_argument("--out", type=Path, default=Path("results/stage_ledger.json"))
    args = parser.parse_args(argv)
    rows = dict(map(read_run, args.runs))
    used = [group for group in GROUPS if any(row[group] for row in rows.values())]
    print(f"{'':40s} {'total s':>8s} " + " ".join(f"{group:>13s}" for group in used))
    for label, row in rows.items():
        total = sum(row.values())
        print(f"{label:40s} {total:8.2f} "
              + " ".join(f"{row[g]:6.2f} ({row[g] / total:4.0%})" for g in used))
    print(f"{'the seeds split':40s} {'':8s} " + " ".join(
        f"{'':6s} ({SEEDS_SPLIT[g]:4.0%})" if g in SEEDS_SPLIT else f"{'':13s}" for g in used))
    data = {"groups": {group: list(stages) for group, stages in GROUPS.items()}, "seeds_split": SEEDS_SPLIT,
            "seconds": rows, "sources": args.runs}
    write_results(args.out, data, lambda png: plot(rows, used, png))
    return 0


def plot(rows: dict[str, dict[str, float]], groups: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (seconds, shares) = plt.subplots(1, 2, figsize=(12, 1.2 + 0.6 * len(rows)))
    share_rows = {label: {g: row[g] / sum(row.values()) for g in groups} for label, row in rows.items()}
    share_rows["the seeds' split"] = {g: SEEDS_SPLIT.get(g, 0.0) for g in groups}
    colours = dict(zip(groups, plt.cm.tab10.colors, strict=False))
    for axis, table, unit in ((seconds, rows, "seconds to the first token"), (shares, share_rows, "share")):
        labels = list(table)
        left = [0.0] * len(labels)
        for group in groups:
            widths = [table[label][group] for label in labels]
            axis.barh(labels, widths, left=left, color=colours[group], label=group)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        axis.set_xlabel(unit)
        axis.invert_yaxis()
    seconds.legend(loc="lower right", fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
