"""Summaries, tables, plots and comparisons of load runs."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from loadtest.runner import LoadRun
from router.metrics import percentile

PERCENTILES = (50, 90, 99)


def latency_stats(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    array = np.array(values) * 1e3
    return {"count": len(values), "mean_ms": float(array.mean()),
            **{f"p{p}_ms": percentile(array.tolist(), p) for p in PERCENTILES}}


def _prefix_hit_rate(samples: list[dict]) -> float | None:
    """Hit tokens / queried tokens of the engines' prefix caches between the first and last sample."""
    if len(samples) < 2:
        return None
    first, last = samples[0]["engines"], samples[-1]["engines"]
    hits = sum(last[u]["vllm:prefix_cache_hits_total"] - first[u]["vllm:prefix_cache_hits_total"]
               for u in last if u in first)
    queries = sum(last[u]["vllm:prefix_cache_queries_total"] - first[u]["vllm:prefix_cache_queries_total"]
                  for u in last if u in first)
    return hits / queries if queries else None


def _busiest_share(samples: list[dict]) -> float | None:
    """The share of the requests finished between the first and last sample that the busiest
    engine served (1/N is even; a hot spot shows as more)."""
    if len(samples) < 2:
        return None
    first, last = samples[0]["engines"], samples[-1]["engines"]
    key = "vllm:request_success_total"
    done = [last[u].get(key, 0.0) - first[u].get(key, 0.0) for u in last if u in first]
    return max(done) / sum(done) if sum(done) else None


def _mean_change(samples: list[dict], source: str, name: str) -> float | None:
    """The mean of histogram `name`'s observations between the first and last sample, over the
    router's (`source` "router") or every engine's ("engines")."""
    if len(samples) < 2:
        return None

    def totals(sample: dict) -> tuple[float, float]:
        parts = [sample["router"]] if source == "router" else list(sample["engines"].values())
        return (sum(p.get(f"{name}_sum", 0.0) for p in parts), sum(p.get(f"{name}_count", 0.0) for p in parts))

    (sum0, count0), (sum1, count1) = totals(samples[0]), totals(samples[-1])
    return (sum1 - sum0) / (count1 - count0) if count1 > count0 else None


def _router_added_s(samples: list[dict]) -> float | None:
    """Mean time to first byte at the router less the engines' own mean time to first token:
    what the router (and the hop to the engine) adds to a request, under this load."""
    router = _mean_change(samples, "router", "pdcluster_router_time_to_first_byte_seconds")
    engines = _mean_change(samples, "engines", "vllm:time_to_first_token_seconds")
    return router - engines if router is not None and engines is not None else None


def _remote_prefills(samples: list[dict]) -> dict | None:
    """How many requests the router prefilled on a prefill instance between the first and last
    sample, and their mean duration (the prefill part of a P/D request's time to first token)."""
    name = "pdcluster_router_remote_prefill_seconds"
    if len(samples) < 2:
        return None
    first, last = samples[0]["router"], samples[-1]["router"]
    count = last.get(f"{name}_count", 0.0) - first.get(f"{name}_count", 0.0)
    if not count:
        return None
    seconds = last[f"{name}_sum"] - first.get(f"{name}_sum", 0.0)
    return {"count": int(count), "mean_ms": 1e3 * seconds / count}


def summarize(run: LoadRun, slo_ttft_s: float, slo_tpot_s: float, label: str = "") -> dict:
    ok = [r for r in run.results if r.ok]
    tpots = [t for r in ok if (t := r.time_per_output_token_s()) is not None]
    good = [
        r for r in ok if (r.ttft_s or 0) <= slo_ttft_s and (r.time_per_output_token_s() or 0) <= slo_tpot_s
    ]
    queue = [sum(e["vllm:num_requests_waiting"] for e in s["engines"].values()) for s in run.samples]
    duration = max(run.duration_s, 1e-9)
    return {
        "label": label,
        "requests": len(run.results),
        "completed": len(ok),
        "errors": dict(collections.Counter(r.error for r in run.results if not r.ok)),
        "duration_s": run.duration_s,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": sum(r.output_tokens for r in ok) / duration,
        "goodput": len(good) / duration,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "ttft": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl": latency_stats([gap for r in ok for gap in r.inter_token_s()]),
        "tpot": latency_stats(tpots),
        "e2e": latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prefix_hit_rate": _prefix_hit_rate(run.samples),
        "busiest_share": _busiest_share(run.samples),
        "engine_ttft_mean_s": _mean_change(run.samples, "engines", "vllm:time_to_first_token_seconds"),
        "router_added_s": _router_added_s(run.samples),
        "remote_prefills": _remote_prefills(run.samples),
        "max_queue_depth": max(queue, default=0),
    }


def save(run: LoadRun, summary: dict, path: Path) -> None:
    """The summary, every request's measurements and the scraped metrics, as JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    requests = [{"started_at": r.started_at, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "output_tokens": r.output_tokens,
                 "prompt_tokens": r.prompt_tokens, "itl_s": r.inter_token_s(), "error": r.error}
                for r in run.results]
    path.write_text(json.dumps({"summary": summary, "requests": requests, "metrics": run.samples}, indent=1))


def print_summary(summary: dict, console: Console) -> None:
    table = Table(title=f"load test {summary['label']}: {summary['completed']}/{summary['requests']} completed "
                  f"in {summary['duration_s']:.1f} s")
    for column in ("metric", "mean ms", "p50 ms", "p90 ms", "p99 ms"):
        table.add_column(column, justify="right")
    for metric in ("ttft", "itl", "tpot", "e2e"):
        s = summary[metric]
        cells = [f"{s[k]:.1f}" if k in s else "-" for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")]
        table.add_row(metric, *cells)
    console.print(table)
    hit = summary["prefix_hit_rate"]
    console.print(
        f"throughput {summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} tok/s; "
        f"goodput {summary['goodput']:.2f} req/s (TTFT <= {summary['slo']['ttft_s']} s, TPOT <= "
        f"{summary['slo']['tpot_s']} s); errors {summary['errors'] or 'none'}; prefix hit rate "
        f"{'n/a' if hit is None else f'{hit:.3f}'}; max queue {summary['max_queue_depth']:.0f}"
    )


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run: LoadRun, summary: dict, path: Path) -> None:
    """Latency CDFs and TTFT over time (with the engines' queue depth)."""
    plt = _pyplot()
    figure, (cdf, timeline) = plt.subplots(1, 2, figsize=(12, 4.5))
    ok = [r for r in run.results if r.ok]
    series = {"TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
              "ITL": [g for r in ok for g in r.inter_token_s()],
              "E2E": [r.e2e_s for r in ok if r.e2e_s is not None]}
    for name, values in series.items():
        if values:
            ordered = np.sort(np.array(values) * 1e3)
            cdf.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=name)
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms, log scale)")
    cdf.set_ylabel("fraction")
    cdf.set_title("latency CDFs")
    cdf.legend()
    points = [(r.started_at - run.started_at, r.ttft_s * 1e3) for r in ok if r.ttft_s is not None]
    if points:
        timeline.scatter(*zip(*points, strict=True), s=8, label="TTFT (ms)")
    timeline.set_xlabel("request start (s)")
    timeline.set_ylabel("TTFT (ms)")
    timeline.set_title("TTFT over time")
    queue = timeline.twinx()
    queue.plot([s["t"] for s in run.samples],
               [sum(e["vllm:num_requests_waiting"] for e in s["engines"].values()) for s in run.samples],
               color="tab:red", label="queued in engines")
    queue.set_ylabel("requests waiting in engines", color="tab:red")
    figure.suptitle(f"{summary['label']}: {summary['request_throughput']:.2f} req/s")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_sweep(summaries: list[dict], rates: list[float], path: Path) -> None:
    """Throughput and TTFT against the offered rate."""
    plt = _pyplot()
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    throughput.plot(rates, [s["request_throughput"] for s in summaries], "o-", label="achieved")
    throughput.plot(rates, [s["goodput"] for s in summaries], "s--", label="goodput")
    throughput.plot(rates, rates, ":", color="grey", label="offered")
    throughput.set_xlabel("offered rate (req/s)")
    throughput.set_ylabel("req/s")
    throughput.legend()
    throughput.set_title("throughput vs rate")
    for p in PERCENTILES:
        ttft.plot(rates, [s["ttft"].get(f"p{p}_ms", np.nan) for s in summaries], "o-", label=f"p{p}")
    ttft.set_xlabel("offered rate (req/s)")
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_title("TTFT vs rate")
    ttft.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def compare(paths: list[Path], console: Console) -> list[dict]:
    """Side by side: the summaries of several saved runs (ratios to the first)."""
    summaries = [json.loads(p.read_text())["summary"] for p in paths]
    rows = [("requests completed", lambda s: s["completed"]), ("errors", lambda s: sum(s["errors"].values())),
            ("req/s", lambda s: s["request_throughput"]), ("output tok/s", lambda s: s["output_token_throughput"]),
            ("goodput req/s", lambda s: s["goodput"]), ("prefix hit rate", lambda s: s["prefix_hit_rate"])]
    for metric in ("ttft", "itl", "tpot", "e2e"):
        for p in ("p50", "p90", "p99"):
            rows.append((f"{metric} {p} ms", lambda s, m=metric, p=p: s[m].get(f"{p}_ms")))
    table = Table(title="comparison (ratio to the first)")
    table.add_column("metric")
    for path, summary in zip(paths, summaries, strict=True):
        table.add_column(summary.get("label") or path.stem, justify="right")
    for name, get in rows:
        base = get(summaries[0])
        cells = []
        for summary in summaries:
            value = get(summary)
            text = "-" if value is None else f"{value:.3g}"
            if value is not None and base and summary is not summaries[0]:
                text += f" ({value / base:.2f}x)"
            cells.append(text)
        table.add_row(name, *cells)
    console.print(table)
    return summaries
