"""What the per-step extras every engine of ours loads cost requests that do not use them: our
logits processor (engine/grammar_continuation.py, for migrated structured streams) and our KV
event publisher (engine/kv_event_publisher.py), against vLLM's own engine on the same checkpoint.

    python -m loadtest.engine_extras [--model tiny] [--runs 5] [--repeats 1] [--batch 32] [--tokens 128]

Each run builds vLLM's offline engine (`LLM`) in a process of its own, once per variant (plain,
logits processor, KV events, both), variants alternated within a run so drift hits them alike,
and times greedy decoding of `--batch` prompts of `--tokens` output tokens each after a warm-up
(`--repeats` times, the median kept):
decode throughput (output tokens per second of wall time), and output tokens per CPU second of
the engine's processes (its own and vLLM's engine core, user and system time). On the CPU build
the second tracks the first (vLLM's OpenMP threads spin while they wait), so neither resolves a
2% cost against this machine's 20-30% noise from run to run; on a GPU the wall-time ratio is the
one that counts, and it moves by as much within one engine. So variants with our publisher also
report its own share of the engine core: the seconds it spent publishing on vLLM's loop thread
plus its sending thread's CPU seconds, over the loop thread's CPU seconds, from the first batch
(the publisher's KV_EVENTS_COST_MARK reports): an estimate of what the loop loses to it, without
vLLM's making of the events, and with no router subscribed (ZMQ's I/O thread, which would
encrypt and send off the GIL, idles here). Prints medians over runs and each variant's ratios to plain; writes
JSON and a PNG. Runs on the CPU build and on CUDA alike (`--no-eager` there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.environment import KV_EVENTS_COST_MARK
from loadtest.output import write_results

VARIANTS = {"plain": (False, False), "logits_processor": (True, False), "kv_events": (False, True), "both": (True, True),
            "kv_events_vllm": (False, "vllm")}
"""Each variant's (logits processor, KV events): "vllm" is vLLM's own publisher, not ours."""


METRICS = ("tokens_per_s", "tokens_per_cpu_s")


def cpu_seconds_by_process() -> dict[int, float]:
    """User and system seconds of this process and every live descendant (vLLM's engine core,
    compile workers), by pid."""
    import psutil

    here = psutil.Process()
    seconds = {}
    for process in (here, *here.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            seconds[process.pid] = sum(process.cpu_times()[:2])
    return seconds


def cpu_seconds_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots by the processes alive at the second (one that
    ended meanwhile is left out, not counted negative)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def one_variant(model: str, logits_processor: bool, kv_events: bool | str, batch: int, tokens: int,
                eager: bool, repeats: int) -> dict[str, float | list[float]]:
    """Output tokens per second and per CPU second of one engine, medians of `repeats` timed
    batches (run in a child process: `python -m ... --child`)."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    from engine.environment import GRAMMAR_LOGITS_PROCESSOR, KV_EVENTS_COST_ENV, KV_EVENTS_PLUGIN

    options = {}
    if logits_processor:
        options["logits_processors"] = [GRAMMAR_LOGITS_PROCESSOR]
    if kv_events == "vllm":
        os.environ["VLLM_PLUGINS"] = ""  # none: vLLM's own ZMQ publisher
    elif kv_events:
        from security.credentials import ClusterCredentials

        os.environ.update(ClusterCredentials.generate().engine_host_keys("bench").new_process("127.0.0.1").as_env())
        os.environ["VLLM_PLUGINS"] = KV_EVENTS_PLUGIN
        os.environ[KV_EVENTS_COST_ENV] = "0.25"  # the engine core prints what publishing cost it
    if kv_events:
        options["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                     endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    llm = LLM(model=model, enforce_eager=eager, max_model_len=2048, block_size=32, gpu_memory_utilization=0.5,
              seed=0, **options)
    prompts = [f"Request {k}: tell a long story about the river and the mountain." for k in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    measured: dict[str, list[float]] = {metric: [] for metric in METRICS}
    for _ in range(repeats):
        cpu_before, started = cpu_seconds_by_process(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu_seconds = time.perf_counter() - started, cpu_seconds_between(cpu_before, cpu_seconds_by_process())
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        measured["tokens_per_s"].append(generated / seconds)
        measured["tokens_per_cpu_s"].append(generated / cpu_seconds)
    return {**{metric: statistics.median(values) for metric, values in measured.items()},
            "tokens_per_s_each": measured["tokens_per_s"]}


def cpu_list(text: str) -> set[int]:
    """`0-3,8` -> {0, 1, 2, 3, 8}."""
    cores = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def run_child(variant: str, args: argparse.Namespace) -> dict[str, float | list[float]]:
    command = [sys.executable, "-m", "loadtest.engine_extras", "--child", variant, "--model", args.model,
               "--batch", str(args.batch), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
               *(["--no-eager"] if args.no_eager else [])]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    pin = (lambda: os.sched_setaffinity(0, args.cpus)) if args.cpus else None
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200, preexec_fn=pin)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        log = args.out.with_suffix(f".{variant}.log")  # vLLM logs the engine core's cause to stdout
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + done.stderr)
        raise RuntimeError(f"{variant} failed (its whole output: {log}):\n{done.stderr[-3000:]}")
    measured = json.loads(lines[-1])
    costs = [line.split(KV_EVENTS_COST_MARK, 1)[1] for line in done.stdout.splitlines() if KV_EVENTS_COST_MARK in line]
    if costs:  # our publisher's last report, as of the end of the timed batches
        cost = json.loads(costs[-1])
        measured["publisher_share"] = (cost["publish_s"] + cost["sender_cpu_s"]) / cost["loop_cpu_s"]
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: the tiny model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed batches per engine start, their median kept (throughput on the H200 "
                             "varies more from one start to the next than within one)")
    parser.add_argument("--no-eager", action="store_true", help="compile and capture graphs (GPUs)")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS),
                        help="which to run (plain first: the ratios are to it)")
    parser.add_argument("--cpus", type=cpu_list, default=None,
                        help="cores every engine runs on, e.g. 0-7 (the same for every variant: on the H200's "
                             "host, where the engine core lands moves throughput between two modes)")
    parser.add_argument("--child", choices=tuple(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("results/engine_extras.json"))
    args = parser.parse_args(argv)
    if args.model is None:
        from engine.models import ensure_model

        args.model = str(ensure_model("tiny"))
    if args.child:
        processor, events = VARIANTS[args.child]
        print(json.dumps(one_variant(args.model, processor, events, args.batch, args.tokens, not args.no_eager,
                                     args.repeats)))
        return 0
    if args.repeats < 1:
        parser.error("--repeats is at least 1")
    if args.cpus and not args.cpus <= os.sched_getaffinity(0):
        parser.error(f"--cpus: this process may run on {sorted(os.sched_getaffinity(0))} only")
    if args.variants[0] != "plain":
        parser.error("--variants begins with plain (the ratios are to it)")
    samples: dict[str, dict[str, list[float]]] = {m: {v: [] for v in args.variants} for m in METRICS}
    each_start: dict[str, list[list[float]]] = {v: [] for v in args.variants}  # tokens/s of every repeat
    shares: dict[str, list[float]] = {}  # our publisher's CPU over the engine core loop's, by start
    for run in range(args.runs):
        for variant in args.variants:
            measured = run_child(variant, args)
            for metric in METRICS:
                samples[metric][variant].append(measured[metric])
            each_start[variant].append(measured["tokens_per_s_each"])
            if "publisher_share" in measured:
                shares.setdefault(variant, []).append(measured["publisher_share"])
            print(f"run {run + 1}/{args.runs} {variant}: {measured['tokens_per_s']:.1f} tokens/s, "
                  f"{measured['tokens_per_cpu_s']:.1f} tokens/CPU s", flush=True)
    medians = {m: {v: statistics.median(s) for v, s in by_variant.items()} for m, by_variant in samples.items()}
    ratios = {m: {v: value / by_variant["plain"] for v, value in by_variant.items()} for m, by_variant in medians.items()}
    print_table(args, medians, ratios, samples, shares)
    data = {"model": args.model, "batch": args.batch, "tokens": args.tokens, "eager": not args.no_eager,
            "repeats": args.repeats, "cpus": sorted(args.cpus or os.sched_getaffinity(0)),
            "medians": medians, "ratios": ratios, "runs": samples, "repeats_by_start": each_start,
            "publisher_share": {v: {"median": statistics.median(s), "runs": s} for v, s in shares.items()}}
    write_results(args.out, data, lambda png: plot(data, png))
    return 0


def print_table(args: argparse.Namespace, medians: dict, ratios: dict, samples: dict, shares: dict) -> None:
    table = Table(title=f"decode, {Path(args.model).name}, batch {args.batch} x {args.tokens} tokens, "
                        f"medians of {args.runs} runs")
    for column in ("variant", "tokens/s", "ratio", "tokens/CPU s", "ratio", "runs, tokens/CPU s",
                   "publisher / loop CPU"):
        table.add_column(column, justify="right")
    for variant in args.variants:
        table.add_row(variant, *(f"{value:.{digits}f}" for metric in METRICS
                                 for value, digits in ((medians[metric][variant], 1), (ratios[metric][variant], 3))),
                      " ".join(f"{s:.0f}" for s in samples["tokens_per_cpu_s"][variant]),
                      f"{statistics.median(shares[variant]):.2%}" if variant in shares else "-")
    Console(width=160).print(table)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3))
    variants = list(data["ratios"]["tokens_per_s"])
    for offset, (metric, label) in zip((-0.2, 0.2), (("tokens_per_s", "per wall second"),
                                                     ("tokens_per_cpu_s", "per CPU second")), strict=True):
        axis.bar([k + offset for k in range(len(variants))], [data["ratios"][metric][v] for v in variants],
                 width=0.4, label=label)
    axis.set_xticks(range(len(variants)), variants)
    axis.axhline(0.98, color="red", linewidth=0.8, label="2% below plain")
    axis.set_ylim(0.8, 1.05)
    axis.set_ylabel("decode tokens, ratio to plain vLLM")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
