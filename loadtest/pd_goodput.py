"""Goodput of P/D against colocated serving, at two SLOs, one engine per GPU (issue #21).

    python -m loadtest.pd_goodput --model DIR [--topologies colocated,pd-direct,pd-store]
        [--rates 4,8,12,16 --duration 30 --input-tokens 4096 --output-tokens 256] [--cpu]

Each topology runs on two engines, our router in front: `colocated` two engines that prefill and
decode; `pd-direct` a prefill engine and a decode engine, KV read by the decode engine straight
from the prefill's GPU (vLLM's NixlConnector over UCX: cuda_ipc between GPUs of a node);
`pd-store` the same through a store shard (our StoreConnector, LMCache); `pd-adaptive` pd-direct
with the decode engine prefilling itself while a prompt already waits at the prefill engine
(the router's --remote-prefill-max-queued-tokens). For each rate, Poisson
arrivals of random-token prompts for --duration seconds. Reported per topology and rate: TTFT,
TPOT and inter-token-gap percentiles, throughput, and goodput (requests per second that met the
SLO) at the streaming SLO (TTFT <= 300 ms and the request's own p99 gap <= 12 ms) and the loose
one (TTFT <= 1 s, TPOT <= 25 ms). Prints a table, writes JSON and a PNG of goodput against rate.

No Ray (the GPU machine has none): engines are `EngineHost`s started by this process with dummy
weights (--model may be `engine.models.write_llama8b_shape`'s configuration alone), the router a
child process serving the real app over HTTP, so the load generator's event loop is not the
router's. `--cpu` runs the same on the CPU build (two small engines: a smoke run, not a figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from decode.role import DECODE
from engine.config import EngineConfig
from engine.environment import free_port
from engine.lifecycle import EngineDescription
from engine.role_spec import COLOCATED, RoleSpec
from loadtest.arrivals import FixedConcurrency, Poisson
from loadtest.report import latency_stats
from loadtest.runner import Limits, run_load
from loadtest.sse_client import RequestResult
from loadtest.workloads import RandomLengths
from prefill.role import PREFILL
from router.metrics import percentile
from security.credentials import SECRET_ENV, ClusterCredentials

HOST = "127.0.0.1"
REMOTE_PREFILL_MIN_TOKENS = 0
"""The router's threshold in these runs: every prompt through the prefill engine, the P/D path
measured whole (loadtest.pd_predict simulates with the same)."""
TOPOLOGIES: dict[str, tuple[RoleSpec, RoleSpec]] = {
    "colocated": (COLOCATED, COLOCATED), "pd-direct": (PREFILL, DECODE), "pd-store": (PREFILL, DECODE),
    "pd-adaptive": (PREFILL, DECODE),
}


@dataclasses.dataclass(frozen=True)
class SLO:
    name: str
    ttft_s: float
    p99_gap_s: float | None = None
    tpot_s: float | None = None

    def met(self, result: RequestResult) -> bool:
        if not result.ok or result.ttft_s is None or result.ttft_s > self.ttft_s:
            return False
        if self.tpot_s is not None and (result.time_per_output_token_s() or 0.0) > self.tpot_s:
            return False
        gaps = result.inter_token_s()
        return self.p99_gap_s is None or not gaps or percentile(gaps, 99) <= self.p99_gap_s


STREAMING = SLO("streaming", ttft_s=0.3, p99_gap_s=0.012)
LOOSE = SLO("loose", ttft_s=1.0, tpot_s=0.025)


def summarize(results: list[RequestResult], duration_s: float, offered: float) -> dict:
    ok = [r for r in results if r.ok]
    duration_s = max(duration_s, 1e-9)
    return {
        "offered_rps": offered, "requests": len(results), "completed": len(ok),
        "errors": len(results) - len(ok), "duration_s": duration_s,
        "throughput_rps": len(ok) / duration_s,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration_s,
        **{f"goodput_{slo.name}_rps": sum(slo.met(r) for r in ok) / duration_s for slo in (STREAMING, LOOSE)},
        **{f"attainment_{slo.name}": sum(slo.met(r) for r in ok) / max(len(results), 1) for slo in (STREAMING, LOOSE)},
        "ttft": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot": latency_stats([t for r in ok if (t := r.time_per_output_token_s()) is not None]),
        "itl": latency_stats([gap for r in ok for gap in r.inter_token_s()]),
    }


def _router_process(config: dict, described: list[EngineDescription]) -> None:
    """The router's app over HTTP, in a process of its own, in front of the engines `described`
    (their hosts' `describe()`)."""
    from fleet.instances import InstanceRegistry, described_instance
    from router.app import build_app, router_server
    from router.config import RouterConfig

    router_config = RouterConfig(**config)
    roles = {role.kind: role for role in (COLOCATED, PREFILL, DECODE)}
    registry = InstanceRegistry()
    for engine in described:
        registry.add(described_instance(engine, roles[engine.role], router_config.credentials()))
    router_server(build_app(router_config, registry)).run()


class Fleet:
    """Two engines of a topology and the router in front of them; `stop` ends all of it."""

    def __init__(self, args: argparse.Namespace, topology: str) -> None:
        self.args, self.topology = args, topology
        self.credentials = ClusterCredentials.load()
        self.hosts, self.shard, self.router = [], None, None
        self.url = ""

    async def start(self) -> None:
        from engine.host import EngineHost

        args = self.args
        if self.topology == "pd-store":
            from kvstore.shard import ShardServer
            from transport.zmq_curve import STORE_PLANE

            self.shard = ShardServer(int(args.store_gib * 1024**3), self.credentials.curve(STORE_PLANE), host=HOST)
        for index, role in enumerate(TOPOLOGIES[self.topology]):
            config = EngineConfig(
                model=args.model, served_model_name="model", role=role, max_model_len=args.max_model_len,
                enforce_eager=args.cpu, gpu_memory_utilization=0.85, kv_cache_gib=args.kv_cache_gib,
                keep_host_weights=False, start_timeout_s=600,
                cpu_cores=str(index + 1) if args.cpu else None, gpu_ids=None if args.cpu else str(index),
                kv_store_endpoints=(self.shard.endpoint,) if self.shard else (),
                log_dir=args.out.parent / f"logs-{self.topology}",
            )
            instance_id = f"{role.name}-{index}"
            self.hosts.append(EngineHost(config, instance_id, host=HOST,
                                         keys=self.credentials.engine_host_keys(instance_id)))
        # Standby: the engines keep vLLM's dummy weights (random, as the model is).
        await asyncio.gather(*(host.start(standby=True) for host in self.hosts))
        port = free_port(HOST)
        config = {"port": port, "models": [{"name": "model", "max_model_len": args.max_model_len, "tokenizer": args.model}],
                  "cluster_secret": self.credentials.secret.hex(), "remote_prefill_min_tokens": REMOTE_PREFILL_MIN_TOKENS,
                  "queue_timeout_s": 0}
        if self.topology == "pd-adaptive":  # the decode engine prefills while one prompt waits at the prefill's
            config["remote_prefill_max_queued_tokens"] = args.input_tokens
        described = [h.describe() for h in self.hosts]
        self.router = multiprocessing.get_context("spawn").Process(target=_router_process, args=(config, described))
        self.router.start()
        self.url = f"http://{HOST}:{port}"
        await _wait_for(f"{self.url}/health", timeout_s=60)

    async def stop(self) -> None:
        if self.router is not None:
            self.router.terminate()
            self.router.join(10)
        await asyncio.gather(*(host.stop() for host in self.hosts), return_exceptions=True)
        if self.shard is not None:
            self.shard.close()


async def _wait_for(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} did not come up in {timeout_s:.0f} s")


async def measure(args: argparse.Namespace, topology: str, console: Console, rows: list[dict],
                  save: Callable[[], None]) -> None:
    """Every rate on one topology's fleet; `save` after each (a run cut short keeps what it measured)."""
    fleet = Fleet(args, topology)
    try:
        await fleet.start()
        # A few requests first: lazy first-request work (NIXL's handshake between the P/D engines,
        # the router's first connections) is no rate's to pay.
        warm_up = RandomLengths(args.input_tokens, 8, seed=999).jobs("model")
        await run_load(fleet.url, warm_up, FixedConcurrency(2), Limits(max_requests=6, duration_s=300))
        for k, rate in enumerate(args.rates):
            workload = RandomLengths(args.input_tokens, args.output_tokens, seed=1000 * k + 1)  # fresh prompts
            limits = Limits(max_requests=int(rate * args.duration) + 1, duration_s=args.duration, request_timeout_s=300)
            run = await run_load(fleet.url, workload.jobs("model"), Poisson(rate, seed=k), limits)
            # Goodput over the time to serve what was offered, drain included.
            row = {"topology": topology, **summarize(run.results, run.duration_s, rate)}
            rows.append(row)
            save()
            console.print(f"{topology} @ {rate:g} req/s: {row['throughput_rps']:.2f} served, goodput "
                          f"{row['goodput_streaming_rps']:.2f} / {row['goodput_loose_rps']:.2f}")
    finally:
        await fleet.stop()


def print_table(rows: list[dict], console: Console) -> None:
    table = Table(title="goodput (req/s meeting the SLO): streaming = TTFT<=300 ms & p99 gap<=12 ms; "
                        "loose = TTFT<=1 s & TPOT<=25 ms")
    for column in ("topology", "offered", "served", "good stream", "good loose", "TTFT p50/p99 ms",
                   "TPOT p50/p99 ms", "ITL p50/p99 ms", "errors"):
        table.add_column(column, justify="left" if column == "topology" else "right")

    def ms(stats: dict) -> str:
        return f"{stats['p50_ms']:.0f} / {stats['p99_ms']:.0f}" if stats["count"] else "-"

    for row in rows:
        table.add_row(row["topology"], f"{row['offered_rps']:g}", f"{row['throughput_rps']:.2f}",
                      f"{row['goodput_streaming_rps']:.2f}", f"{row['goodput_loose_rps']:.2f}", ms(row["ttft"]),
                      ms(row["tpot"]), ms(row["itl"]), str(row["errors"]))
    console.print(table)


def plot(rows: list[dict], path: Path) -> None:
    from loadtest.report import _pyplot

    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, slo in zip(axes, (STREAMING, LOOSE), strict=True):
        for topology in dict.fromkeys(r["topology"] for r in rows):
            mine = [r for r in rows if r["topology"] == topology]
            axis.plot([r["offered_rps"] for r in mine], [r[f"goodput_{slo.name}_rps"] for r in mine], "o-",
                      label=topology)
        axis.set(title=f"{slo.name} SLO", xlabel="offered req/s", ylabel="goodput req/s")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--topologies", type=lambda s: s.split(","), default=["colocated", "pd-direct"])
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[4, 8, 12, 16])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--input-tokens", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="CPU build only")
    parser.add_argument("--store-gib", type=float, default=32.0)
    parser.add_argument("--cpu", action="store_true", help="the CPU build: eager, one core per engine")
    parser.add_argument("--out", type=Path, default=Path("pd_goodput"))
    args = parser.parse_args(argv)
    unknown = set(args.topologies) - TOPOLOGIES.keys()
    if unknown:
        parser.error(f"unknown topologies {sorted(unknown)}; choose from {sorted(TOPOLOGIES)}")
    # Every part of this run (engines, router, the sampler's scrapes) on one fresh secret.
    os.environ.setdefault(SECRET_ENV, ClusterCredentials.generate().secret.hex())
    console = Console()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def save() -> None:
        run_info = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
        args.out.with_suffix(".json").write_text(json.dumps(run_info, indent=1))

    for topology in args.topologies:
        try:
            asyncio.run(measure(args, topology, console, rows, save))
        except Exception as exc:  # one topology's failure leaves the others' figures standing
            console.print(f"[red]{topology} failed:[/] {exc}")
            rows.append({"topology": topology, "failed": str(exc)[-2000:]})
            save()
    rows = [row for row in rows if "failed" not in row]
    print_table(rows, console)
    plot(rows, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
