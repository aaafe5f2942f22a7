"""Cold start, stage by stage: from the call that adds capacity to the new instance's first token.

    python -m loadtest.cold_start --model .cache/models/tiny [--runs 3] [--no-eager]
    python -m loadtest.cold_start --model .cache/models/tiny --tensor-parallel-size 2 --cores '0|1,0|1'

Paths, each run `--runs` times, in one process (same machine state for all):
  (a) plain   - `python -m vllm.entrypoints.openai.api_server` as a user would start it;
      plain-plan - the same with vLLM's startup plan on (VLLM_ENABLE_STARTUP_PLAN=1, as our
                engines run): from its second start, the KV cache size of the first is reused;
  (b) disk    - our EngineHost start: the engine built with dummy weights, then our parallel
                safetensors loader, warm-up request;
  (c) standby - a STANDBY instance (started beforehand, untimed) activated with the weights of a
                ready peer (shared memory on one node, CUDA IPC on a GPU), then the warm-up request;
  (d) sleeping - the same with a standby that sleeps until activated (vLLM's sleep mode, level 2;
                CUDA only): its memory comes back, then the peer's weights, the warm-up request;
  (e) preimported - (b) from a server process that has imported vLLM beforehand and waits,
                holding no GPU memory (engine/preimport.py; its import is not counted);
  (f) empty-caches - (e) on a node that never ran the model: every start cache (vLLM's, Triton's,
                CUDA's, Inductor's, and XDG_CACHE_HOME) a new empty folder;
      new-node - the same, its caches first brought from this machine's as a ready peer's would be
                (deploy/node_caches.py; the export and install timed as stage node_caches, with no
                network in between).
The clock starts at the call and stops at the first streamed token of a request to the new
instance. Paths (c) and (d) also check that the activated instance's greedy tokens equal the
peer's, and on a GPU record the device memory the waiting standby held.
Prints a table, writes JSON and a PNG of the stages. Needs only `engine.*` and httpx, so it runs
on the CUDA machines too (the table is plain text; the PNG needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from engine import node_caches
from engine.config import EngineConfig, TensorParallel
from engine.engine_args import EngineArgs
from engine.environment import engine_process_env, free_port
from engine.host import EngineHost
from engine.lifecycle import StartTimeline
from engine.process import terminate_group
from engine.server_output import ServerOutput
from loadtest.output import write_results
from security.credentials import ClusterCredentials
from security.engine_access import EngineAccess

PROMPT = "The first token after a cold start"
PATHS = ("plain", "plain-plan", "disk", "preimported", "empty-caches", "new-node", "standby", "sleeping")

OUR_LEVERS = ("VLLM_ENABLE_STARTUP_PLAN", "VLLM_USE_MEGA_AOT_ARTIFACT", "VLLM_USE_BREAKABLE_CUDAGRAPH")
"""vLLM variables that our engines may run with (set in this shell) and plain vLLM does not."""

CLUSTER = ClusterCredentials.generate()
"""The engines of one run sign their weights alike (a standby takes only its cluster's peer's)."""


async def first_token(url: str, model: str, max_tokens: int = 1, prompt: str = PROMPT,
                      access: EngineAccess | None = None) -> list[str]:
    """Stream a greedy completion; return its text piece by piece (one piece per token). `access`:
    an engine of ours (engine/host.py), else plain vLLM's server."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    tokens: list[str] = []
    async with httpx.AsyncClient(timeout=120, headers=access.headers if access else None,
                                 verify=access.ssl if access else True) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    tokens.append(json.loads(line[6:])["choices"][0]["text"])
    return tokens


def weights_apart(timeline: StartTimeline) -> dict[str, float]:
    """A plain vLLM start's stages with the weights' load (the seconds vLLM reports on the line that
    ends `worker_and_model`: "Loading weights took", else "Model loading took") a stage of its own."""
    stages = timeline.stages()
    reported = float(timeline.details.get("worker_and_model_reported_s", 0.0))
    if weights := min(reported, stages.get("worker_and_model", 0.0)):
        stages["worker_and_model"] -= weights
        stages["weights"] = weights
    return stages


async def plain_start(config: EngineConfig, cores: str, startup_plan: bool = False) -> dict:
    """(a): vLLM's own server, the way its docs start it (with its startup plan on if
    `startup_plan`); its stages read off its log as our engines' are (engine/server_output.py), the
    weights apart (`weights_apart`), then `healthy` (to /health answering) and the first token."""
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(config.model),
               "--served-model-name", config.served_model_name, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(config.max_model_len), "--block-size", str(config.block_size),
               "--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        command.append("--enforce-eager")
    if config.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    env = engine_process_env("127.0.0.1", config.kv_cache_gib, cores, config.kv_hashing.seed)
    for lever in OUR_LEVERS:  # plain: vLLM's defaults, whatever this shell says
        env.pop(lever, None)
    env["VLLM_PLUGINS"] = ""  # and none of our vLLM plugins, where they are installed
    if startup_plan:
        env["VLLM_ENABLE_STARTUP_PLAN"] = "1"
    asked = time.perf_counter()
    timeline = StartTimeline()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    ServerOutput(process, None, lambda: timeline, kv_events=False)  # also drains the pipe, which would stall vLLM
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            deadline = time.monotonic() + config.start_timeout_s
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"plain vLLM server did not come up (exit {process.returncode})")
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        timeline.mark("healthy")
        healthy = time.perf_counter() - asked
        await first_token(url, config.served_model_name)
        total = time.perf_counter() - asked
    finally:  # its whole group, and the shared memory vLLM's processes leave
        terminate_group(process, grace_s=10)
    return {"stages_s": {**weights_apart(timeline), "first_token": total - healthy}, "first_token_s": total,
            "details": dict(timeline.details)}


async def fresh_start(config: EngineConfig, run: int, preimported: bool = False,
                      caches_from: dict[str, Path] | None = None, path: str | None = None) -> dict:
    """(b), or (e) if `preimported`: our EngineHost with no engine of ours before it; weights from
    disk through the weight plane. (e) starts a process that imports vLLM first (untimed, as a
    pool keeps them ahead) and records the GPU memory it held meanwhile. With `caches_from`, the
    start caches there that this process's lack are installed first, timed (f). The engine (and
    its log) is named by `path`, the benchmark's."""
    name = f"cold-{path or ('preimported' if preimported else 'disk')}-{run}"
    host = EngineHost(config, name, host="127.0.0.1", keys=CLUSTER.engine_host_keys(name))
    try:
        extra, stages = {}, {}
        if preimported:
            used_before = await settled_gpu_memory_used()
            extra["preimport_s"] = (await host.preimport())["total_s"]
            if used_before is not None:
                extra["waiting_gpu_bytes"] = gpu_memory_used() - used_before
        asked = time.perf_counter()
        if caches_from is not None:
            here = node_caches.cache_dirs(os.environ)
            # min_age_s=0: the warm starts that wrote them are over
            caches = node_caches.export(caches_from, node_caches.manifest(here), CLUSTER.weights_key, min_age_s=0)
            assert caches is not None, "the same machine's caches"
            extra["node_caches"] = dataclasses.asdict(node_caches.install(caches, here, CLUSTER.weights_key))
            stages["node_caches"] = time.perf_counter() - asked
        record = await (host.activate() if preimported else host.start())
        before_token = time.perf_counter() - asked
        await first_token(host.url, config.served_model_name, access=host.access)
        total = time.perf_counter() - asked
        record["stages_s"] = {**stages, **record["stages_s"], "first_token": total - before_token}
        return {**record, **extra, "first_token_s": total}
    finally:
        await host.stop()


@contextlib.contextmanager
def new_node_caches() -> Iterator[None]:
    """Every start cache of the engines started meanwhile (they inherit this process's
    environment) in new empty folders, as on a node that never ran an engine."""
    root = Path(tempfile.mkdtemp(prefix="pdc-new-node-"))
    # also the caches a peer does not send: a new node's are empty too (XDG_CACHE_HOME: FlashInfer's, ...)
    variables = [spec.variable for spec in node_caches.CACHES.values()] + [
        "CUDA_CACHE_PATH", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME"]
    fresh = {variable: str(root / variable.lower()) for variable in variables}
    before = {variable: os.environ.get(variable) for variable in fresh}
    os.environ.update(fresh)
    try:
        yield
    finally:
        for variable, value in before.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        shutil.rmtree(root, ignore_errors=True)


def gpu_memory_used() -> int | None:
    """Bytes in use on GPU 0 by all processes (NVML: no CUDA context of our own); None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)
    except Exception:  # no NVML, no driver, no GPU: the CPU build
        return None


async def settled_gpu_memory_used(timeout_s: float = 30.0) -> int | None:
    """gpu_memory_used() once two readings 0.5 s apart agree: a process killed just before (the
    previous path's server) gives its memory back over seconds."""
    deadline, last = time.monotonic() + timeout_s, gpu_memory_used()
    while last is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = gpu_memory_used()
        if now == last:
            break
        last = now
    return last


async def standby_start(config: EngineConfig, peer: EngineHost, run: int, check_tokens: int,
                        sleep: bool = False) -> dict:
    """(c), or (d) if `sleep`: activate a standby with the peer's weights; the standby's own
    start is not counted."""
    config = config.model_copy(update={"sleep_mode": sleep})
    name = f"cold-{'sleeping' if sleep else 'standby'}-{run}"
    standby = EngineHost(config, name, host="127.0.0.1", keys=CLUSTER.engine_host_keys(name))
    try:
        used_before = await settled_gpu_memory_used()
        untimed = await standby.start(standby=True)
        used_waiting = gpu_memory_used()
        descriptor = await peer.export_weights(use_nixl=False)
        asked = time.perf_counter()
        record = await standby.activate(descriptor)
        before_token = time.perf_counter() - asked
        await first_token(standby.url, config.served_model_name, access=standby.access)
        total = time.perf_counter() - asked
        record["stages_s"]["first_token"] = total - before_token
        # A prompt neither has seen: a prefix-cache hit on one side only changes the numerics
        # enough to flip near-ties of greedy decoding (random weights are full of them).
        check = f"{run} and its tokens must match the peer's"
        ours = await first_token(standby.url, config.served_model_name, check_tokens, check, access=standby.access)
        theirs = await first_token(peer.url, config.served_model_name, check_tokens, check, access=peer.access)
        theirs_again = await first_token(peer.url, config.served_model_name, check_tokens, check, access=peer.access)
        # Joined: where a stream cuts its text pieces depends on detokenizer timing, not the tokens.
        return {**record, "first_token_s": total, "tokens_match_peer": "".join(ours) == "".join(theirs),
                "peer_repeats_itself": "".join(theirs) == "".join(theirs_again), "tokens": [ours, theirs],
                "standby_start_s": untimed["total_s"], "weights": standby.weights_record,
                "waiting_gpu_bytes": used_waiting - used_before if used_before is not None else None}
    finally:
        await standby.stop()


async def bench(
    config: EngineConfig, runs: int, cores: tuple[str, str], paths: tuple[str, ...] = PATHS
) -> dict[str, list[dict]]:
    peer_config = config.model_copy(update={"cpu_cores": cores[0]})
    new_config = config.model_copy(update={"cpu_cores": cores[1]})
    peer = EngineHost(peer_config, "cold-peer", host="127.0.0.1", keys=CLUSTER.engine_host_keys("cold-peer"))
    if {"standby", "sleeping"} & set(paths):
        await peer.start()
    results: dict[str, list[dict]] = {path: [] for path in paths}
    try:
        for run in range(runs):
            for path in paths:
                if path in ("plain", "plain-plan"):
                    record = await plain_start(new_config, cores[1], startup_plan=path == "plain-plan")
                elif path in ("disk", "preimported"):
                    record = await fresh_start(new_config, run, preimported=path == "preimported")
                elif path in ("empty-caches", "new-node"):
                    warm = node_caches.cache_dirs(os.environ)
                    with new_node_caches():
                        record = await fresh_start(new_config, run, preimported=True,
                                                   caches_from=warm if path == "new-node" else None, path=path)
                else:
                    record = await standby_start(new_config, peer, run, check_tokens=8, sleep=path == "sleeping")
                results[path].append(record)
                stages = " ".join(f"{k}={v:.3f}" for k, v in record["stages_s"].items())
                details = record.get("details", {})
                source = details.get("weights_source", "")
                if "weights_fallback_reason" in details:
                    source += f" (fallback: {details['weights_fallback_reason']})"
                if record.get("waiting_gpu_bytes") is not None:
                    source += f" (held {record['waiting_gpu_bytes'] / 2**30:.2f} GiB while waiting)"
                print(f"run {run} {path:8s} first token after {record['first_token_s']:.3f} s: {stages} {source}",
                      flush=True)
    finally:
        await peer.stop()
    return results


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for path, records in results.items():
        stages = list(dict.fromkeys(name for r in records for name in r["stages_s"]))
        summary[path] = {
            "first_token_s": statistics.median(r["first_token_s"] for r in records),
            "stages_s": {n: statistics.median(r["stages_s"].get(n, 0.0) for r in records) for n in stages},
        }
        held = [r["waiting_gpu_bytes"] for r in records if r.get("waiting_gpu_bytes") is not None]
        if held:
            summary[path]["waiting_gpu_gib"] = statistics.median(held) / 2**30
        if any("tokens_match_peer" in r for r in records):
            summary[path]["tokens_match_peer"] = all(r["tokens_match_peer"] for r in records)
    if "plain" in summary:
        baseline = summary["plain"]["first_token_s"]
        for path in summary:
            summary[path]["speedup_vs_plain"] = baseline / summary[path]["first_token_s"]
    return summary


def print_table(model: str, summary: dict[str, dict], runs: int) -> None:
    print(f"\ncold start, {model}, medians of {runs} runs (seconds from the call to the first token)")
    print(f"{'path':10s} {'first token':>12s} {'vs plain':>9s} {'held GiB':>9s} {'=peer':>6s}  stages")
    for path, row in summary.items():
        stages = " ".join(f"{k}={v:.3f}" for k, v in row["stages_s"].items())
        speedup = f"{row['speedup_vs_plain']:8.1f}x" if "speedup_vs_plain" in row else " " * 9
        held = f"{row['waiting_gpu_gib']:9.2f}" if "waiting_gpu_gib" in row else " " * 9
        equal = str(row.get("tokens_match_peer", "")).rjust(6)
        print(f"{path:10s} {row['first_token_s']:12.3f} {speedup} {held} {equal}  {stages}")


def plot(summary: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    for row_index, row in enumerate(summary.values()):
        left = 0.0
        for stage, seconds in row["stages_s"].items():
            ax.barh(row_index, seconds, left=left, label=stage)
            left += seconds
        ax.text(left, row_index, f" {row['first_token_s']:.2f} s", va="center")
    ax.set_yticks(range(len(summary)), list(summary))
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel("seconds from the call to the first token (symlog)")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=6, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-eager", action="store_true", help="compile and capture CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cores", default="0,1", help="CPU cores of the peer and of the new instance "
                        "(a tensor-parallel engine's per rank: '0|1,0|1')")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks of every engine, plain vLLM's too")
    parser.add_argument("--paths", default="plain,disk,standby", help=f"which of {','.join(PATHS)} to run")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG beside it)")
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="a vLLM flag for our engines only, as `pdcluster serve --engine-arg` takes it "
                             "(plain vLLM keeps its defaults); repeatable")
    parser.add_argument("--engine-log-dir", type=Path, default=None, help="keep each engine's whole log there")
    args = parser.parse_args(argv)
    config = EngineConfig(model=args.model, served_model_name=args.model.name, enforce_eager=not args.no_eager,
                          gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                          log_dir=args.engine_log_dir, engine_args=EngineArgs.from_flags(args.engine_arg, [], []),
                          tensor_parallel=TensorParallel(every_pool=args.tensor_parallel_size))
    cores = tuple(args.cores.split(","))
    paths = tuple(args.paths.split(","))
    if not set(paths) <= set(PATHS):
        parser.error(f"--paths takes some of {','.join(PATHS)}")
    results = asyncio.run(bench(config, args.runs, (cores[0], cores[1]), paths))
    summary = summarize(results)
    tp = f"-tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print_table(args.model.name + tp.replace("-", ", "), summary, args.runs)
    out = args.out or Path("results") / f"cold_start-{args.model.name}{tp}.json"
    levers = {"engine_args": list(config.engine_args.every_pool),
              "env": {name: os.environ[name] for name in OUR_LEVERS if name in os.environ}}
    write_results(out, {"model": str(args.model), "eager": not args.no_eager, "runs": args.runs, "ours": levers,
                        "summary": summary,
                        "records": results}, lambda png: plot(summary, f"cold start, {args.model.name}{tp}", png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
