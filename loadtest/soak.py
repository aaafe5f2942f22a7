"""Soak: many concurrent streams for a long time; errors, the router's memory and p99 TTFT over time.

    python -m loadtest.soak [--minutes 10] [--streams 32] [--url http://127.0.0.1:8000 --router-pid PID]

Without --url it starts `pdcluster serve --model tiny` itself. Every stream sends greedy random
prompts (128 tokens in, 32 out) back to back. The router's RSS is read from /proc every 5 s.
Prints a table per window, writes JSON and a PNG (p99 TTFT and router RSS over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from loadtest.arrivals import FixedConcurrency
from loadtest.local_cluster import LocalServer
from loadtest.runner import Limits, run_load
from loadtest.workloads import RandomLengths
from router.metrics import percentile

WINDOW_S = 30.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def watch_rss(pid: int, samples: list[tuple[float, float]], started: float) -> None:
    while True:
        samples.append((time.perf_counter() - started, rss_mib(pid)))
        await asyncio.sleep(5)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    return percentile(values, 99)


async def soak(url: str, router_pid: int, minutes: float, streams: int) -> dict:
    rss: list[tuple[float, float]] = []
    started = time.perf_counter()
    watcher = asyncio.create_task(watch_rss(router_pid, rss, started))
    try:
        with Progress() as progress:
            run = await run_load(
                url, RandomLengths(input_tokens=128, output_tokens=32).jobs("tiny"),
                FixedConcurrency(streams), Limits(max_requests=10**9, duration_s=minutes * 60, request_timeout_s=120),
                progress,
            )
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    rss.append((time.perf_counter() - started, rss_mib(router_pid)))
    windows = []
    for start in range(0, int(run.duration_s), int(WINDOW_S)):
        in_window = [r for r in run.results if start <= r.started_at - run.started_at < start + WINDOW_S]
        ttfts = [r.ttft_s for r in in_window if r.ok and r.ttft_s is not None]
        windows.append({"t_s": start, "requests": len(in_window), "errors": sum(not r.ok for r in in_window),
                        "ttft_p50_s": statistics.median(ttfts) if ttfts else None, "ttft_p99_s": p99(ttfts)})
    errors: dict[str, int] = {}
    for result in run.results:
        if not result.ok:
            errors[result.error] = errors.get(result.error, 0) + 1
    return {"minutes": minutes, "streams": streams, "requests": len(run.results), "errors": errors,
            "duration_s": run.duration_s, "rss_mib": rss, "rss_start_mib": rss[0][1], "rss_end_mib": rss[-1][1],
            "windows": windows}


def report(result: dict, out: Path, console: Console) -> None:
    table = Table(title=f"soak: {result['streams']} streams, {result['minutes']:g} min")
    for column in ("from (s)", "requests", "errors", "TTFT p50 (ms)", "TTFT p99 (ms)"):
        table.add_column(column, justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    for w in result["windows"]:
        table.add_row(
            str(w["t_s"]), str(w["requests"]), str(w["errors"]), ms(w["ttft_p50_s"]), ms(w["ttft_p99_s"])
        )
    console.print(table)
    console.print(f"requests {result['requests']}, errors {sum(result['errors'].values())} {result['errors']}; "
                  f"router RSS {result['rss_start_mib']:.0f} MiB at start, {result['rss_end_mib']:.0f} MiB at end")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    from loadtest.report import _pyplot

    plt = _pyplot()
    fig, left = plt.subplots(figsize=(8, 3.5))
    points = [
        (w["t_s"] / 60, w["ttft_p99_s"] * 1000) for w in result["windows"] if w["ttft_p99_s"] is not None
    ]
    left.plot([p[0] for p in points], [p[1] for p in points], marker="o", label="TTFT p99 per 30 s")
    left.set_xlabel("minutes")
    left.set_ylabel("TTFT p99 (ms)")
    right = left.twinx()
    right.plot([t / 60 for t, _ in result["rss_mib"]], [m for _, m in result["rss_mib"]], color="gray",
               linestyle="--", label="router RSS")
    right.set_ylabel("router RSS (MiB)")
    right.set_ylim(bottom=0)
    fig.legend(loc="lower right", fontsize=7)
    left.set_title(f"soak: {result['streams']} streams, {sum(result['errors'].values())} errors")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--url", help="a running pdcluster router (loopback)")
    parser.add_argument("--router-pid", type=int, help="its process id (with --url)")
    parser.add_argument("--out", type=Path, default=Path("results/soak.json"))
    args = parser.parse_args(argv)
    console = Console()
    if args.url:
        if args.router_pid is None:
            parser.error("--url needs --router-pid")
        result = asyncio.run(soak(args.url, args.router_pid, args.minutes, args.streams))
    else:
        with LocalServer(["--model", "tiny"], Path("results/soak-serve.log")) as server:
            result = asyncio.run(soak(server.url, server.pid, args.minutes, args.streams))
    report(result, args.out, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
