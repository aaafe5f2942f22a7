"""Cross-check `pdcluster loadtest` against an independent client, `vllm bench serve`.

    python -m loadtest.crosscheck [--url http://127.0.0.1:8000] [--runs 3]

Both clients send the same workload (random token prompts of --input-tokens, --output-tokens
each with ignore_eos, --requests of them, at --concurrency in flight, or with Poisson arrivals
at --rate when --concurrency is 0) to the same endpoint,
alternating run by run with a fresh seed each run so no run finds another's prompts cached. The
table compares medians over runs of request throughput and median TTFT. Without --url it
starts `pdcluster serve --model tiny` itself. `vllm bench serve` is driven through its module
(`vllm.benchmarks.serve`), since the `vllm` command needs the distribution named "vllm".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from loadtest.arrivals import FixedConcurrency, Poisson
from loadtest.local_cluster import LocalServer
from loadtest.report import summarize
from loadtest.runner import Limits, run_load
from loadtest.workloads import RandomLengths


def vllm_bench(url: str, model: str, tokenizer: str, args: argparse.Namespace, seed: int) -> dict:
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    with tempfile.TemporaryDirectory() as out:
        bench_args = parser.parse_args([
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(args.input_tokens),
            "--random-output-len", str(args.output_tokens), "--num-prompts", str(args.requests),
            "--request-rate", str(args.rate) if not args.concurrency else "inf",
            *(["--max-concurrency", str(args.concurrency)] if args.concurrency else []),
            "--seed", str(seed), "--ignore-eos", "--disable-tqdm",
            "--save-result", "--result-dir", out, "--result-filename", "bench.json",
        ])
        asyncio.run(serve.main_async(bench_args)) if hasattr(serve, "main_async") else serve.main(bench_args)
        result = json.loads((Path(out) / "bench.json").read_text())
    return {"request_throughput": result["request_throughput"], "median_ttft_ms": result["median_ttft_ms"],
            "completed": result["completed"]}


def ours(url: str, model: str, args: argparse.Namespace, seed: int) -> dict:
    workload = RandomLengths(args.input_tokens, args.output_tokens, seed=seed)
    arrival = FixedConcurrency(args.concurrency) if args.concurrency else Poisson(args.rate, seed)
    load = asyncio.run(run_load(url, workload.jobs(model), arrival, Limits(args.requests)))
    summary = summarize(load, 1.0, 0.2)
    return {"request_throughput": summary["request_throughput"], "median_ttft_ms": summary["ttft"]["p50_ms"],
            "completed": summary["completed"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight; 0: Poisson at --rate")
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("results/crosscheck.json"))
    args = parser.parse_args(argv)
    server = (
        None if args.url else LocalServer(["--model", "tiny"], Path("results/crosscheck-serve.log")).start()
    )
    try:
        url = args.url or server.url
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        from engine.models import default_model_root

        tokenizer = str(default_model_root() / model) if (default_model_root() / model).exists() else model
        runs: dict[str, list[dict]] = {"vllm bench serve": [], "pdcluster loadtest": []}
        for run in range(args.runs):
            runs["vllm bench serve"].append(vllm_bench(url, model, tokenizer, args, seed=1000 + 2 * run))
            runs["pdcluster loadtest"].append(ours(url, model, args, seed=1001 + 2 * run))
    finally:
        if server:
            server.stop()
    medians = {client: {key: statistics.median(r[key] for r in results)
                        for key in ("request_throughput", "median_ttft_ms")} for client, results in runs.items()}
    theirs, mine = medians["vllm bench serve"], medians["pdcluster loadtest"]
    load_shape = f"concurrency {args.concurrency}" if args.concurrency else f"Poisson {args.rate} req/s"
    table = Table(title=f"{args.requests} requests, {load_shape}, {args.input_tokens} in / "
                  f"{args.output_tokens} out, median of {args.runs} runs")
    for column in ("client", "req/s", "median TTFT ms"):
        table.add_column(column, justify="right")
    for client, m in medians.items():
        table.add_row(client, f"{m['request_throughput']:.3f}", f"{m['median_ttft_ms']:.1f}")
    ratios = {key: mine[key] / theirs[key] for key in mine}
    table.add_row(
        "ratio ours / vllm", f"{ratios['request_throughput']:.3f}", f"{ratios['median_ttft_ms']:.3f}"
    )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                    "medians": medians, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
