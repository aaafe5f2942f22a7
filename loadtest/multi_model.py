"""Several models behind one router, asked for in turns: each request's TTFT, and what the
engines hold, over time.

    python -m loadtest.multi_model --models tiny,tiny-tied [--bursts 6] [--burst-size 4] \\
        [--pause 5] [--out results/multi_model.json] [-- SERVE FLAGS...]

Starts `pdcluster serve --model A,B ... SERVE FLAGS` (on a GPU, e.g. `--sleep-when-idle
--engines-per-gpu 4 --max-awake 1`), then sends bursts of concurrent streamed requests, the
models in turn, a pause between bursts; meanwhile it samples /admin/status (each instance's
state) and the GPU's memory in use (NVML; none on the CPU build) every 0.2 s. Per burst: its
model, whether that model had an awake engine when the burst began (if not, the burst waits for
a wake-up or a swap), TTFT median and max, errors. Prints a table, writes JSON and a PNG (TTFT per
request by model; awake engines and GPU memory over time).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import aiohttp
import httpx

from loadtest.cold_start import gpu_memory_used
from loadtest.local_cluster import LocalServer
from loadtest.output import write_results
from loadtest.sse_client import stream_request

PROMPT = "Write one sentence about the sea, request {k}:"


async def sample(server: LocalServer, until: asyncio.Event, samples: list[dict], every_s: float = 0.2) -> None:
    """Each instance's model and state, and the GPU's memory in use, until `until` is set."""
    async with httpx.AsyncClient(headers=server.credentials.admin_headers(), timeout=5) as client:
        while not until.is_set():
            status = (await client.get(f"{server.url}/admin/status")).json()
            samples.append({"at": time.time(), "gpu_bytes": gpu_memory_used(),
                            "instances": [(i["model"], i["state"]) for i in status["instances"]]})
            await asyncio.sleep(every_s)


def awake(sample_: dict, model: str) -> bool:
    return any(m == model and state == "ready" for m, state in sample_["instances"])


async def bursts(server: LocalServer, models: list[str], args: argparse.Namespace, samples: list[dict]) -> list[dict]:
    done = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for b in range(args.bursts):
            model = models[b % len(models)]
            was_awake = awake(samples[-1], model) if samples else None
            bodies = [{"model": model, "prompt": PROMPT.format(k=b * args.burst_size + k),
                       "max_tokens": args.max_tokens, "temperature": 0} for k in range(args.burst_size)]
            results = await asyncio.gather(*(stream_request(session, f"{server.url}/v1/completions", body)
                                             for body in bodies))
            ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
            done.append({"burst": b, "model": model, "model_was_awake": was_awake,
                         "requests": [{"started_at": r.started_at, "ttft_s": r.ttft_s, "error": r.error}
                                      for r in results],
                         "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                         "ttft_max_s": max(ttfts) if ttfts else None,
                         "errors": sum(not r.ok for r in results)})
            row = done[-1]
            print(f"burst {b} {model:12s} awake before: {was_awake!s:5s} TTFT p50 {row['ttft_p50_s'] or 0:.3f} s "
                  f"max {row['ttft_max_s'] or 0:.3f} s errors {row['errors']}", flush=True)
            await asyncio.sleep(args.pause)
    return done


async def run(server: LocalServer, models: list[str], args: argparse.Namespace) -> dict:
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(server, stop, samples))
    await asyncio.sleep(0.5)  # a first sample: which models are awake before the first burst
    try:
        results = await bursts(server, models, args, samples)
    finally:
        stop.set()
        await sampler
    return {"bursts": results, "samples": samples}


def plot(result: dict, models: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(s["at"] for s in result["samples"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    for k, model in enumerate(models):
        points = [(r["started_at"] - start, r["ttft_s"]) for b in result["bursts"] if b["model"] == model
                  for r in b["requests"] if r["ttft_s"] is not None]
        top.scatter([p[0] for p in points], [p[1] for p in points], s=10, color=f"C{k}", label=model)
    top.set_ylabel("TTFT (s)")
    top.set_yscale("log")
    top.legend(fontsize=7)
    times = [s["at"] - start for s in result["samples"]]
    for k, model in enumerate(models):
        bottom.step(times, [sum(m == model and st == "ready" for m, st in s["instances"]) for s in result["samples"]],
                    where="post", color=f"C{k}", label=f"{model} awake")
    bottom.set_ylabel("ready engines")
    bottom.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
    if any(s["gpu_bytes"] is not None for s in result["samples"]):
        memory = bottom.twinx()
        memory.plot(times, [(s["gpu_bytes"] or 0) / 2**30 for s in result["samples"]], color="gray", lw=1)
        memory.set_ylabel("GPU memory in use (GiB)")
    bottom.set_xlabel("seconds")
    bottom.legend(fontsize=7, loc="upper left")
    fig.suptitle("several models, one router, bursts in turn")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="models for `pdcluster serve --model`, comma-separated")
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--burst-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--pause", type=float, default=5.0, help="seconds between bursts")
    parser.add_argument("--out", type=Path, default=Path("results/multi_model.json"), help="JSON path (PNG beside it)")
    parser.add_argument("serve_flags", nargs=argparse.REMAINDER, help="after --: flags for `pdcluster serve`")
    args = parser.parse_args(argv)
    flags = [f for f in args.serve_flags if f != "--"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with LocalServer(["--model", args.models, *flags], args.out.with_suffix(".serve.log")) as server:
        names = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
        result = asyncio.run(run(server, names, args))
    print(f"\n{'burst':>5s} {'model':12s} {'awake':>6s} {'TTFT p50':>9s} {'max':>7s} errors")
    for b in result["bursts"]:
        print(f"{b['burst']:5d} {b['model']:12s} {b['model_was_awake']!s:>6s} {b['ttft_p50_s'] or 0:9.3f} "
              f"{b['ttft_max_s'] or 0:7.3f} {b['errors']}")
    write_results(args.out, {"models": names, "serve_flags": flags, **result}, lambda png: plot(result, names, png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
