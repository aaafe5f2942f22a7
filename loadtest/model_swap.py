"""Several models on one GPU, one awake at a time: what a swap costs, in time and memory.

    python -m loadtest.model_swap --models DIR,DIR,DIR,DIR [--rounds 8] [--no-eager]

Every model gets an engine of ours in sleep mode (EngineHost, weights from disk), started one
after another (concurrent starts on one GPU mis-size their KV caches). Each answers a reference
prompt (greedy), keeps a pinned host copy of its weights and sleeps. Then `--rounds` swaps, round
robin: the awake engine sleeps, the next one wakes from its host copy (no awake peer holds its
model) and streams the first token of a request; the clock runs from the sleep call to that token.

Recorded: each swap's stages; whether the woken engine's greedy tokens equal its own before it
first slept (a swap that serves another model's weights, or stale ones, fails it); the GPU memory
the sleeping engines hold (NVML); the wake's host-to-device rate against pinned host-to-device
bandwidth measured on the same GPU, in a process of its own. CUDA only (the CPU build has no sleep
mode). Prints a table, writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.host import EngineHost
from loadtest.cold_start import first_token, gpu_memory_used
from loadtest.output import write_results

REFERENCE_PROMPT = "Which model answers this prompt"
REFERENCE_TOKENS = 16
PINNED_BANDWIDTH = """
import statistics, sys, torch
nbytes = int(sys.argv[1])
host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
times = []
for _ in range(6):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); device.copy_(host, non_blocking=True); end.record(); end.synchronize()
    times.append(start.elapsed_time(end) / 1000)
print(nbytes / statistics.median(times[1:]))
"""


def pinned_bandwidth(nbytes: int = 4 * 1024**3) -> float:
    """Bytes/s of one pinned host-to-device copy (median of 5 after a first), in a process of its
    own so that this one holds no CUDA context beside the engines."""
    result = subprocess.run([sys.executable, "-c", PINNED_BANDWIDTH, str(nbytes)], capture_output=True,
                            text=True, check=True, timeout=300)
    return float(result.stdout.strip().splitlines()[-1])


async def reference(host: EngineHost) -> str:
    return "".join(await first_token(host.url, host.config.served_model_name, REFERENCE_TOKENS,
                                     REFERENCE_PROMPT, access=host.access))


async def start_all(configs: list[EngineConfig]) -> tuple[list[EngineHost], dict[str, str], list[dict]]:
    """Start each engine, take its reference answer, put it to sleep (one at a time)."""
    hosts, answers, starts = [], {}, []
    for k, config in enumerate(configs):
        host = EngineHost(config, f"swap-{k}", host="127.0.0.1")
        hosts.append(host)
        record = await host.start()
        answers[host.instance_id] = await reference(host)
        record["first_sleep"] = await host.sleep()
        starts.append(record)
        print(f"{host.instance_id} ({config.model.name}) started in {record['total_s']:.1f} s, asleep "
              f"(host copy {record['first_sleep']['stages_s']['host_copy']:.2f} s): {answers[host.instance_id]!r}",
              flush=True)
    return hosts, answers, starts


async def swap(awake: EngineHost | None, target: EngineHost, answer: str) -> dict:
    """Sleep `awake`, wake `target`, its first token; then check its answer."""
    asked = time.perf_counter()
    stages: dict[str, float] = {}
    if awake is not None:
        stages["sleep_previous"] = (await awake.sleep())["total_s"]
    woken = await target.activate(None)
    before_token = time.perf_counter()
    await first_token(target.url, target.config.served_model_name, access=target.access)
    total = time.perf_counter() - asked
    stages.update(woken["stages_s"])
    stages["first_token"] = time.perf_counter() - before_token
    weights = target.weights_record
    return {"model": target.config.model.name, "swap_s": total, "stages_s": stages,
            "weights_source": weights["source"], "weights_bytes": weights["bytes"],
            "h2d_bytes_per_s": weights["bytes"] / weights["transfer_s"] if weights["source"] == "host" else None,
            "tokens_equal": await reference(target) == answer}


async def bench(configs: list[EngineConfig], rounds: int) -> dict:
    idle = gpu_memory_used()
    hosts, answers, starts = await start_all(configs)
    try:
        asleep = gpu_memory_used()
        swaps, awake = [], None
        for r in range(rounds):
            target = hosts[r % len(hosts)]
            record = await swap(awake, target, answers[target.instance_id])
            awake = target
            swaps.append(record)
            stages = " ".join(f"{k}={v:.3f}" for k, v in record["stages_s"].items())
            print(f"swap {r} -> {record['model']}: {record['swap_s']:.3f} s ({stages}) "
                  f"source={record['weights_source']} equal={record['tokens_equal']}", flush=True)
    finally:
        await asyncio.gather(*(h.stop() for h in hosts), return_exceptions=True)
    held = (asleep - idle) / len(hosts) if idle is not None and asleep is not None else None
    return {"starts": starts, "swaps": swaps, "sleeping_gpu_bytes_each": held}


def summarize(result: dict, bandwidth: float | None) -> dict:
    swaps = [s for s in result["swaps"] if "sleep_previous" in s["stages_s"]]  # a real swap: one slept
    stages = list(dict.fromkeys(name for s in swaps for name in s["stages_s"]))
    rates = [s["h2d_bytes_per_s"] for s in swaps if s["h2d_bytes_per_s"]]
    summary = {
        "swaps": len(swaps),
        "swap_s_median": statistics.median(s["swap_s"] for s in swaps),
        "swap_s_max": max(s["swap_s"] for s in swaps),
        "stages_s": {n: statistics.median(s["stages_s"].get(n, 0.0) for s in swaps) for n in stages},
        "tokens_equal": all(s["tokens_equal"] for s in result["swaps"]),
        "sleeping_gib_each": (result["sleeping_gpu_bytes_each"] or 0) / 2**30,
        "wake_h2d_gb_per_s": statistics.median(rates) / 1e9 if rates else None,
        "pinned_h2d_gb_per_s": bandwidth / 1e9 if bandwidth else None,
    }
    if rates and bandwidth:
        summary["wake_vs_pinned"] = statistics.median(rates) / bandwidth
    return summary


def plot(result: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swaps = [s for s in result["swaps"] if "sleep_previous" in s["stages_s"]]
    colors = {stage: f"C{k}" for k, stage in enumerate(summary["stages_s"])}
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for row, record in enumerate(swaps):
        left = 0.0
        for stage, seconds in record["stages_s"].items():
            ax.barh(row, seconds, left=left, label=stage, color=colors[stage])
            left += seconds
        ax.text(left, row, f" {record['model']} {record['swap_s']:.2f} s", va="center", fontsize=7)
    ax.set_xlim(0, 1.3 * max(s["swap_s"] for s in swaps))  # room for the labels
    ax.set_xlabel("seconds from the sleep call to the woken model's first token")
    ax.set_ylabel("swap")
    ax.set_title(f"model swaps, one GPU: median {summary['swap_s_median']:.2f} s, "
                 f"{summary['sleeping_gib_each']:.2f} GiB per sleeping engine")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="checkpoint folders, comma-separated (distinct models)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--no-eager", action="store_true", help="compile and capture CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("results/model_swap.json"), help="JSON path (PNG beside it)")
    args = parser.parse_args(argv)
    models = [Path(m) for m in args.models.split(",")]
    configs = [EngineConfig(model=m, served_model_name=m.name, sleep_mode=True, enforce_eager=not args.no_eager,
                            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)
               for m in models]
    bandwidth = pinned_bandwidth()
    result = asyncio.run(bench(configs, args.rounds))
    summary = summarize(result, bandwidth)
    print(f"\n{len(models)} models on one GPU, {summary['swaps']} swaps (sleep one, wake the next from its host "
          "copy, first token)")
    for key, value in summary.items():
        print(f"  {key:22s} {value}")
    write_results(args.out, {"models": [str(m) for m in models], "eager": not args.no_eager, "summary": summary,
                             **result}, lambda png: plot(result, summary, png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
