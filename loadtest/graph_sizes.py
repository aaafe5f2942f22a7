"""What fewer CUDA graphs, or none of torch.compile, cost decoding (issue #36 goals 1 and 2):
vLLM's offline engine with its default capture sizes and compile against other settings
(`VARIANTS`: a shorter list; whole-model decode graphs without torch.compile; graphs broken at
attention without torch.compile), time per output token at several batch sizes and throughput at
saturation, and what each engine's start took.

    python -m loadtest.graph_sizes --model /tmp/models/llama8b [--runs 2] [--variants short uncompiled]

Each variant's engine is built in a process of its own (variants alternated within a run, so
drift hits them alike); it decodes greedy batches of `--tokens` tokens each (`ignore_eos`) at
each of `--batches` after a warm-up. A batch between two captured sizes runs the next larger
graph (padded), so batches that fall between the short list's sizes are where it loses: the
default batches include such ones. Prints medians over runs and ratios to the default; writes
JSON and a PNG. CUDA only (the CPU build captures no graphs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loadtest.output import write_results

SHORT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""About 1.5x apart (a padded batch runs at most a third more rows); vLLM's default for 256
sequences is [1, 2, 4] + every 8th size to 248 + every 16th to 512: 51 sizes."""

BATCHES = (1, 8, 32, 40, 128, 160, 512)


@dataclasses.dataclass(frozen=True)
class Variant:
    """An engine's CUDA graph and compile settings: vLLM's `compilation_config` and variables."""

    compilation: dict
    env: dict[str, str] = dataclasses.field(default_factory=dict)


VARIANTS = {
    "default": Variant({}),
    "short": Variant({"cudagraph_capture_sizes": list(SHORT_SIZES)}),
    # No torch.compile (no Dynamo transform, no compiled graphs to load): decode batches replay
    # whole-model graphs, prefills run eager.
    "uncompiled": Variant({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                           "cudagraph_capture_sizes": list(SHORT_SIZES)}),
    # No torch.compile either, graphs broken at attention at run time (vLLM's breakable capture).
    "breakable": Variant({"mode": 0, "cudagraph_capture_sizes": list(SHORT_SIZES)},
                         {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}),
}
"""What each engine runs with; "default" is vLLM's own, the baseline of every ratio."""


def one_variant(model: str, variant: Variant, batches: list[int], tokens: int, load_format: str) -> dict:
    """In a child process: the engine's start and, per batch, seconds per output token."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=model, max_model_len=2048, block_size=32, gpu_memory_utilization=0.8, seed=0,
              load_format=load_format, compilation_config=variant.compilation)
    start_s = time.perf_counter() - started
    llm.generate(["warm up"] * 4, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    tpot, throughput = {}, {}
    for batch in batches:
        prompts = [f"Request {k}: tell a long story about the river and the mountain." for k in range(batch)]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        began = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        tpot[batch] = seconds / tokens  # the whole batch steps together: one step per token
        throughput[batch] = produced / seconds
    return {"start_s": start_s, "tpot_s": tpot, "tokens_per_s": throughput}


def run_child(args: argparse.Namespace, name: str) -> dict:
    command = [sys.executable, "-m", "loadtest.graph_sizes", "--child", name, "--model", args.model,
               "--tokens", str(args.tokens), "--load-format", args.load_format, "--batches", *map(str, args.batches)]
    levers = {key for variant in VARIANTS.values() for key in variant.env}  # none but this variant's
    env = {k: v for k, v in os.environ.items() if k not in levers} | VARIANTS[name].env
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"variant {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["default", "short"],
                        help="compared with vLLM's default (always run)")
    parser.add_argument("--load-format", default="auto", help="vLLM's; `dummy` for a configuration without weights")
    parser.add_argument("--child", choices=list(VARIANTS), help="run this variant in this process")
    parser.add_argument("--out", type=Path, default=Path("results/graph_sizes.json"))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_variant(args.model, VARIANTS[args.child], args.batches, args.tokens, args.load_format)))
        return 0
    names = ["default", *(name for name in args.variants if name != "default")]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, str] = {}  # a variant this vLLM refuses or fails on is dropped, the others go on
    for run in range(args.runs):
        for name in [n for n in names if n not in failed]:
            try:
                runs[name].append(run_child(args, name))
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                failed[name] = str(error)
                print(f"run {run + 1}/{args.runs} {name}: failed, dropped:\n{error}", flush=True)
                continue
            print(f"run {run + 1}/{args.runs} {name}: start {runs[name][-1]['start_s']:.1f} s", flush=True)
    if "default" in failed:
        return 1
    names = [name for name in names if name not in failed]
    runs = {name: runs[name] for name in names}
    medians = {name: {"start_s": statistics.median(r["start_s"] for r in records),
                      "tpot_s": {b: statistics.median(r["tpot_s"][str(b)] for r in records) for b in args.batches}}
               for name, records in runs.items()}
    ratios = {name: {"start_s": medians[name]["start_s"] / medians["default"]["start_s"],
                     **{b: medians[name]["tpot_s"][b] / medians["default"]["tpot_s"][b] for b in args.batches}}
              for name in names[1:]}
    print_table(args, medians, ratios)
    data = {"model": args.model, "variants": {name: dataclasses.asdict(VARIANTS[name]) for name in names},
            "tokens": args.tokens, "medians": medians, "ratio_to_default": ratios, "runs": runs, "failed": failed}
    write_results(args.out, data, lambda png: plot(data, png))
    return 0


def print_table(args: argparse.Namespace, medians: dict, ratios: dict) -> None:
    print(f"\n{Path(args.model).name}, medians of {args.runs} runs; ratios to vLLM's default")
    print(f"{'':15s} {'start s':>8s} " + " ".join(f"{'b=' + str(b):>9s}" for b in args.batches))
    for name, row in medians.items():
        print(f"{name:15s} {row['start_s']:8.1f} " + " ".join(f"{row['tpot_s'][b] * 1e3:7.2f}ms" for b in args.batches))
    for name, row in ratios.items():
        print(f"{name + ' / d':15s} {row['start_s']:8.2f} " + " ".join(f"{row[b]:9.3f}" for b in args.batches))


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3))
    for name, row in data["ratio_to_default"].items():
        batches = [b for b in row if b != "start_s"]
        axis.plot([str(b) for b in batches], [row[b] for b in batches], marker="o",
                  label=f"{name} (start {row['start_s']:.2f}x)")
    axis.axhline(1.03, color="red", linewidth=0.8, label="3% slower")
    axis.set_xlabel("batch (sequences decoding together)")
    axis.set_ylabel("time per token / vLLM default")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
