"""Cold start of one engine, stage by stage: from the start call to the first streamed token.

    python -m loadtest.engine_start --model PATH [--runs 3] [--no-eager] [--out results/engine_start.json]

Runs `engine.host.EngineHost` without Ray (the same code a Ray actor runs): each run starts a
fresh vLLM server, waits for its warm-up request, then times a streamed request's first token,
and stops it. Prints each run's stages (from vLLM's own log lines) and their medians; writes
JSON. Runs on the CPU build and on CUDA machines alike; it needs only the engine's imports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.host import EngineHost


async def one_start(config: EngineConfig, run: int) -> dict:
    host = EngineHost(config, f"start-{run}", host="127.0.0.1")
    asked = time.perf_counter()
    try:
        record = await host.start()
        body = {"model": config.served_model_name, "prompt": "The first token after a cold start",
                "max_tokens": 4, "temperature": 0, "stream": True}  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", f"{host.url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break
        record["first_token_s"] = time.perf_counter() - asked
        return record
    finally:
        await host.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-eager", action="store_true", help="compile and capture CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=Path("results/engine_start.json"))
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, served_model_name=args.model.name, enforce_eager=not args.no_eager,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)  # fmt: skip
    records = []
    for run in range(args.runs):
        record = asyncio.run(one_start(config, run))
        records.append(record)
        stages = " ".join(f"{k}={v:.2f}" for k, v in record["stages_s"].items())
        print(f"run {run}: first token after {record['first_token_s']:.2f} s; {stages}", flush=True)
    stage_names = list(records[0]["stages_s"])
    medians = {name: statistics.median(r["stages_s"].get(name, 0.0) for r in records) for name in stage_names}
    medians["first_token_s"] = statistics.median(r["first_token_s"] for r in records)
    print("medians: " + " ".join(f"{k}={v:.2f}" for k, v in medians.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": str(args.model), "eager": not args.no_eager, "runs": records,
                                    "medians_s": medians}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
