"""Step-time profile of one vLLM engine and of the KV hand-over, for the serving simulator
(issue #37; `loadtest.step_model` fits it, `loadtest.serving_sim` runs on it).

    python -m loadtest.engine_profile --model DIR [--no-eager] [--role colocated|pd]
        [--engine-arg=--flag ...] [--quick] [--out docs/gpu/profile-h200-8b.json]

vLLM's own engine (`LLMEngine`, the API server's usage context, so its default token budget and
sequence limit) in this process, dummy weights, prefix caching on; `--role pd` adds what our P/D
engines run with (engine/role_spec.py: no async scheduling, the V1 model runner). Measured:

  prefill   time from adding prompts to their first token on an idle engine: one prompt of
            128 ... max-model-len tokens, and batches of prompts (their tokens share the budget)
  decode    the step time (median gap between a stream's tokens) of `batch` streams at a
            `context`, each prompt its own (streams sharing blocks would read them from the
            GPU's L2 cache: session 18's first profiles did, and came out too fast at long
            contexts); shapes whose KV exceeds 80% of the engine's are left out
  mixed     the step in which a `chunk`-token prompt is prefilled among `batch` decoding streams
            (the stall a colocated engine's streams pay): the time from adding it to its answer
            less the decode steps around it, so that it holds with async scheduling too
  handover  a prompt's KV (`tokens` x the model's KV bytes per token) moved device -> device in
            one copy (the lower bound one device allows: NIXL's cuda_ipc between GPUs of a node
            does no better), and device -> host -> a store shard (ours, NIXL over UCX, in a child
            process) -> host -> device, as our StoreConnector moves it (whole blocks copied to
            host memory, put, got, copied back)

Writes the profile JSON (`--out`) and prints each table with the fitted step model's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from engine.environment import UCX_LOOPBACK_ENV
from engine.role_spec import KV_CONNECTOR_ENV, KV_CONNECTOR_VLLM_ARGS


@dataclasses.dataclass
class Grid:
    prefill_tokens: tuple[int, ...]
    prefill_batches: tuple[tuple[int, int], ...]  # (prompts, tokens each)
    decode_batches: tuple[int, ...]
    contexts: tuple[int, ...]
    mixed_batches: tuple[int, ...]
    chunks: tuple[int, ...]
    handover_tokens: tuple[int, ...]
    steps: int = 24
    repeats: int = 3


FULL = Grid(prefill_tokens=(128, 512, 1024, 2048, 4096, 8000),
            prefill_batches=((4, 1024), (8, 2048), (4, 4096)),
            decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), contexts=(256, 1024, 4096),
            mixed_batches=(1, 8, 32, 64, 128), chunks=(256, 1024, 2048, 4096),
            handover_tokens=(1024, 2048, 4096, 8192, 16384), repeats=5)
QUICK = Grid(prefill_tokens=(128, 512, 1024, 2048), prefill_batches=((4, 512),),
             decode_batches=(1, 4, 16), contexts=(256, 1024), mixed_batches=(1, 8), chunks=(256, 1024),
             handover_tokens=(1024, 4096), steps=12, repeats=2)


class Driver:
    """Requests into an engine, and the time each step's outputs came back."""

    def __init__(self, engine, vocab_size: int, seed: int = 0) -> None:
        self.engine, self.vocab_size = engine, vocab_size
        self.rng, self.counter = random.Random(seed), 0
        self.tokens_out: dict[str, int] = {}
        self.finished: set[str] = set()

    def prompt(self, count: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab_size - 1) for _ in range(count)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from vllm import SamplingParams

        self.counter += 1
        request_id = f"p{self.counter}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        self.tokens_out[request_id] = 0
        return request_id

    def step(self) -> float:
        outputs = self.engine.step()
        now = time.perf_counter()
        for output in outputs:
            self.tokens_out[output.request_id] = len(output.outputs[0].token_ids)
            if output.finished:
                self.finished.add(output.request_id)
        return now

    def catch_up(self) -> None:
        """Take the outputs the engine made while this process was busy: their steps ended
        before they were taken, so their gaps here would be this process's, not the engine's."""
        while not self.engine.engine_core.outputs_queue.empty():
            self.step()

    def step_until(self, done: Callable[[], bool], timeout_s: float = 120.0) -> list[float]:
        """Step until `done()`; the return time of each step."""
        times, deadline = [], time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not get there in time")
            times.append(self.step())
        return times

    def clear(self) -> None:
        """Abort what runs and wait until the engine is idle."""
        running = [r for r in self.tokens_out if r not in self.finished]
        if running:
            self.engine.abort_request(running)
        self.step_until(lambda: not self.engine.has_unfinished_requests())
        self.tokens_out.clear()
        self.finished.clear()

    def decoding(self, batch: int, context: int, max_tokens: int) -> list[str]:
        """`batch` streams of prompts of their own decoding at `context`."""
        ids = [self.add(self.prompt(context), max_tokens) for _ in range(batch)]
        self.step_until(lambda: all(self.tokens_out[r] >= 2 for r in ids), timeout_s=600.0)
        return ids


def measure_prefill(driver: Driver, grid: Grid, max_len: int) -> list[dict]:
    rows = []
    shapes = [(1, n) for n in grid.prefill_tokens if n < max_len] + list(grid.prefill_batches)
    for prompts, tokens in shapes:
        seconds = []
        for _ in range(grid.repeats):
            started = time.perf_counter()
            ids = [driver.add(driver.prompt(tokens), 1) for _ in range(prompts)]
            finished = driver.step_until(lambda ids=ids: all(r in driver.finished for r in ids))[-1]
            seconds.append(finished - started)
            driver.clear()
        rows.append({"prompts": prompts, "tokens": tokens, "seconds": statistics.median(seconds), "samples_s": seconds})
    return rows


def measure_decode(driver: Driver, grid: Grid, max_seqs: int, kv_tokens: int) -> list[dict]:
    rows = []
    for context in grid.contexts:
        for batch in (b for b in grid.decode_batches if b <= max_seqs and b * (context + 64) <= 0.8 * kv_tokens):
            driver.decoding(batch, context, grid.steps + 32)
            driver.catch_up()
            times = [driver.step() for _ in range(grid.steps + 1)]
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            rows.append({"batch": batch, "context": context, "step_s": statistics.median(gaps), "gaps_s": gaps})
            driver.clear()
    return rows


def measure_mixed(driver: Driver, grid: Grid, max_len: int, budget: int, max_seqs: int) -> list[dict]:
    rows = []
    for batch in (b for b in grid.mixed_batches if b < max_seqs):
        for chunk in (c for c in grid.chunks if c + batch <= budget):
            context = 1024
            driver.decoding(batch, context, max_len - context - 1)
            stalls = []
            for _ in range(grid.repeats):
                driver.catch_up()
                before = [driver.step() for _ in range(5)]
                decode_step = statistics.median(b - a for a, b in zip(before, before[1:], strict=False))
                prefill = driver.add(driver.prompt(chunk), 1)
                window = before[-1:] + driver.step_until(lambda prefill=prefill: prefill in driver.finished)
                # The window's steps but one were decode steps (with async scheduling the step that
                # computed the prompt may answer a step later, so no single gap is it).
                stalls.append(window[-1] - window[0] - (len(window) - 2) * decode_step)
            rows.append({"batch": batch, "context": context, "chunk": chunk, "step_s": statistics.median(stalls),
                         "samples_s": stalls})
            driver.clear()
    return rows


def kv_bytes_per_token(engine) -> int:
    config = engine.vllm_config
    model, parallel = config.model_config, config.parallel_config
    element = config.cache_config.cache_dtype
    itemsize = model.dtype.itemsize if element in ("auto", None) else 1
    return 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size() * itemsize


def engine_args(args: argparse.Namespace):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    extra = list(args.engine_arg) + (list(KV_CONNECTOR_VLLM_ARGS) if args.role == "pd" else [])
    parsed = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--model", str(args.model), "--load-format", "dummy", "--max-model-len", str(args.max_model_len),
         "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--enable-prefix-caching",
         *(["--enforce-eager"] if args.eager else []), *extra])
    return EngineArgs.from_cli_args(parsed)


def profile_engine(args: argparse.Namespace, grid: Grid) -> dict:
    from vllm import LLMEngine, __version__
    from vllm.usage.usage_lib import UsageContext

    if args.role == "pd":
        os.environ.update(dict(KV_CONNECTOR_ENV))
    engine = LLMEngine.from_engine_args(engine_args(args), usage_context=UsageContext.OPENAI_API_SERVER)
    config = engine.vllm_config
    scheduler, cache = config.scheduler_config, config.cache_config
    budget = scheduler.max_num_batched_tokens
    driver = Driver(engine, config.model_config.get_vocab_size())
    driver.decoding(4, 512, 64)  # warm-up: the first requests' lazy work is no figure's
    driver.clear()
    profile = {
        "vllm": __version__, "role": args.role, "model": str(args.model),
        "engine": {"max_num_batched_tokens": budget, "max_num_seqs": scheduler.max_num_seqs,
                   "kv_capacity_tokens": cache.num_gpu_blocks * cache.block_size, "block_size": cache.block_size,
                   "async_scheduling": bool(scheduler.async_scheduling), "max_model_len": args.max_model_len,
                   "enforce_eager": args.eager},
        "kv_bytes_per_token": kv_bytes_per_token(engine),
        "prefill": measure_prefill(driver, grid, args.max_model_len),
        "decode": measure_decode(driver, grid, scheduler.max_num_seqs,
                                 cache.num_gpu_blocks * cache.block_size),
        "mixed": measure_mixed(driver, grid, args.max_model_len, budget, scheduler.max_num_seqs),
    }
    engine.engine_core.shutdown()  # its process and device memory, before the hand-over's turn
    return profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="CUDA graphs (GPU)")
    parser.add_argument("--role", choices=("colocated", "pd"), default="colocated")
    parser.add_argument("--engine-arg", action="append", default=[], help="one more vLLM engine flag")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--quick", action="store_true", help="a small grid (the CPU build's tiny model)")
    parser.add_argument("--out", type=Path, default=Path("results/engine_profile.json"))
    args = parser.parse_args(argv)
    grid = QUICK if args.quick else FULL
    os.environ.update(UCX_LOOPBACK_ENV)
    from loadtest.kv_handover import measure_handover

    profile = profile_engine(args, grid)
    profile["device"] = _device_name()
    profile["handover"] = measure_handover(grid.handover_tokens, profile["kv_bytes_per_token"], grid.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1))
    print_summary(profile)
    print(f"wrote {args.out}")
    return 0


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def print_summary(profile: dict) -> None:
    from loadtest.step_model import StepModel

    model = StepModel.fit(profile)
    errors = iter(model.fit_errors(profile))
    print(f"{profile['device']}, vLLM {profile['vllm']}, {profile['role']}: budget "
          f"{profile['engine']['max_num_batched_tokens']} tokens, {profile['engine']['max_num_seqs']} seqs, "
          f"KV {profile['engine']['kv_capacity_tokens']} tokens x {profile['kv_bytes_per_token']} B")
    for row in profile["prefill"]:
        print(f"prefill {row['prompts']} x {row['tokens']:>6d}: {row['seconds'] * 1e3:9.2f} ms   fit {next(errors):+.1%}")
    for row in profile["decode"]:
        print(f"decode  {row['batch']:>4d} @ {row['context']:>5d}: {row['step_s'] * 1e3:9.2f} ms   fit {next(errors):+.1%}")
    for row in profile["mixed"]:
        print(f"mixed   {row['batch']:>4d} + {row['chunk']:>5d}: {row['step_s'] * 1e3:9.2f} ms   fit {next(errors):+.1%}")
    for row in profile["handover"]:
        print(f"handover {row['tokens']:>6d} tokens: direct {row['direct_s'] * 1e3:8.2f} ms, store "
              f"{row['store_s'] * 1e3:8.2f} ms (d2h {row['d2h_s'] * 1e3:.2f}, put {row['put_s'] * 1e3:.2f}, "
              f"get {row['get_s'] * 1e3:.2f}, h2d {row['h2d_s'] * 1e3:.2f})")


if __name__ == "__main__":
    raise SystemExit(main())
