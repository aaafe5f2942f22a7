"""What the per-step extras every engine of ours loads cost requests that do not use them: our
logits processor (engine/grammar_continuation.py, for migrated structured streams) and our KV
event publisher (engine/kv_event_publisher.py), against vLLM's own engine on the same checkpoint.

    python -m loadtest.engine_extras [--model tiny] [--runs 5] [--batch 32] [--tokens 128]

Each run builds vLLM's offline engine (`LLM`) in a process of its own, once per variant (plain,
logits processor, KV events, both), variants alternated within a run so drift hits them alike,
and times greedy decoding of `--batch` prompts of `--tokens` output tokens each after a warm-up:
decode throughput (output tokens per second). Prints medians over runs and each variant's ratio
to plain; writes JSON and a PNG. Runs on the CPU build and on CUDA alike (`--no-eager` there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loadtest.output import write_results

VARIANTS = {"plain": (False, False), "logits_processor": (True, False), "kv_events": (False, True), "both": (True, True),
            "kv_events_vllm": (False, "vllm")}
"""Each variant's (logits processor, KV events): "vllm" is vLLM's own publisher, not ours."""


def one_variant(model: str, logits_processor: bool, kv_events: bool | str, batch: int, tokens: int,
                eager: bool) -> float:
    """Output tokens per second of one engine (run in a child process: `python -m ... --child`)."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    from engine.environment import GRAMMAR_LOGITS_PROCESSOR, KV_EVENTS_PLUGIN

    options = {}
    if logits_processor:
        options["logits_processors"] = [GRAMMAR_LOGITS_PROCESSOR]
    if kv_events == "vllm":
        os.environ["VLLM_PLUGINS"] = ""  # none: vLLM's own ZMQ publisher
    elif kv_events:
        from security.credentials import ClusterCredentials

        os.environ.update(ClusterCredentials.generate().engine_host_keys("bench").new_process("127.0.0.1").as_env())
        os.environ["VLLM_PLUGINS"] = KV_EVENTS_PLUGIN
    if kv_events:
        options["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                     endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    llm = LLM(model=model, enforce_eager=eager, max_model_len=2048, block_size=32, gpu_memory_utilization=0.5,
              seed=0, **options)
    prompts = [f"Request {k}: tell a long story about the river and the mountain." for k in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def run_child(variant: str, args: argparse.Namespace) -> float:
    command = [sys.executable, "-m", "loadtest.engine_extras", "--child", variant, "--model", args.model,
               "--batch", str(args.batch), "--tokens", str(args.tokens), *(["--no-eager"] if args.no_eager else [])]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])["tokens_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the tiny model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--no-eager", action="store_true", help="compile and capture graphs (GPUs)")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS),
                        help="which to run (plain first: the ratios are to it)")
    parser.add_argument("--child", choices=tuple(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("results/engine_extras.json"))
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.models import ensure_model

        args.model = str(ensure_model("tiny"))
    if args.child:
        processor, events = VARIANTS[args.child]
        speed = one_variant(args.model, processor, events, args.batch, args.tokens, not args.no_eager)
        print(json.dumps({"tokens_per_s": speed}))
        return 0
    if args.variants[0] != "plain":
        parser.error("--variants begins with plain (the ratios are to it)")
    samples: dict[str, list[float]] = {v: [] for v in args.variants}
    for run in range(args.runs):
        for variant in args.variants:
            samples[variant].append(run_child(variant, args))
            print(f"run {run + 1}/{args.runs} {variant}: {samples[variant][-1]:.1f} tokens/s", flush=True)
    medians = {v: statistics.median(s) for v, s in samples.items()}
    table = Table(title=f"decode throughput, {Path(args.model).name}, batch {args.batch} x {args.tokens} tokens, "
                        f"medians of {args.runs} runs")
    for column in ("variant", "tokens/s", "ratio to plain", "runs"):
        table.add_column(column, justify="right")
    for variant, speed in medians.items():
        table.add_row(variant, f"{speed:.1f}", f"{speed / medians['plain']:.3f}",
                      " ".join(f"{s:.0f}" for s in samples[variant]))
    Console(width=120).print(table)
    data = {"model": args.model, "batch": args.batch, "tokens": args.tokens, "eager": not args.no_eager,
            "medians": medians, "ratios": {v: s / medians["plain"] for v, s in medians.items()}, "runs": samples}
    write_results(args.out, data, lambda png: plot(data, png))
    return 0


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3))
    axis.bar(list(data["ratios"]), list(data["ratios"].values()))
    axis.axhline(0.98, color="red", linewidth=0.8, label="2% below plain")
    axis.set_ylim(0.8, 1.05)
    axis.set_ylabel("decode tokens/s, ratio to plain vLLM")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
