"""`pdcluster`: the one command line.

pdcluster model tiny|smollm2 [DIR]     build a local model (no network needed)
pdcluster serve [--model smollm2] ...  Ray head on loopback, engines, router on 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console

from engine.config import Role
from engine.environment import is_loopback, use_ray
from engine.models import BUILDERS, COMPLETE_MARKER, default_model_root

console = Console(stderr=True)
# Tests only: store shards then honour the "corrupt" op (fault injection into stored chunks).
STORE_FAULT_INJECTION_ENV = "PDCLUSTER_STORE_FAULT_INJECTION"


def _env(name: str, default: str) -> str:
    return os.environ.get(f"PDCLUSTER_{name}", default)


def _add_model_parser(subparsers) -> None:
    parser = subparsers.add_parser("model", help="build a local model checkpoint")
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument("dir", nargs="?", type=Path, help="target folder (default: the model cache)")
    parser.set_defaults(func=_cmd_model)


def _add_serve_parser(subparsers, name: str = "serve", help: str = "serve a model through the OpenAI API"):
    parser = subparsers.add_parser(name, help=help)
    parser.add_argument(
        "--model",
        default=_env("MODEL", "smollm2"),
        help="tiny, smollm2, or a checkpoint folder (env PDCLUSTER_MODEL)",
    )
    parser.add_argument("--served-model-name", help="name clients send (default: the model's)")
    parser.add_argument("--instances", type=int, default=1, help="colocated engine instances")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="colocated engines, each prefilling and decoding its own requests (the default without "
        "--prefill/--decode; --instances sets how many)",
    )
    parser.add_argument("--prefill", type=int, default=0, help="prefill instances (P/D topology)")
    parser.add_argument("--decode", type=int, default=0, help="decode instances (P/D topology)")
    parser.add_argument(
        "--standby",
        type=int,
        default=0,
        help="standby instances per pool (started without weights, activated in < 1 s)",
    )
    parser.add_argument(
        "--max-instances",
        type=int,
        default=0,
        help="ready instances per pool at most when scaling up (default: the initial count)",
    )
    parser.add_argument(
        "--target-ttft",
        type=float,
        default=None,
        help="grow the pool that prefills (prefill, else colocated) while the p90 time to first "
        "token of streamed requests over the last 30 s is above this (s)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        help="longest a request waits for an instance to become ready (s)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        help="the cluster's secret (default: env PDCLUSTER_SECRET, else ~/.config/pdcluster/secret, "
        "made by `pdcluster serve` when missing); every credential is derived from it",
    )
    parser.add_argument(
        "--start-log",
        type=Path,
        default=Path(_env("START_LOG", "results/starts.jsonl")),
        help="one JSON line per engine start, stage by stage (env PDCLUSTER_START_LOG)",
    )
    parser.add_argument(
        "--remote-prefill-min-tokens",
        type=int,
        default=256,
        help="below this many uncached prompt tokens, decode prefills locally",
    )
    parser.add_argument(
        "--remote-prefill-max-queued-tokens",
        type=int,
        default=None,
        help="P/D: when the prefill instance has more prompt tokens queued, decode prefills locally "
        "(shorter TTFT while prefill is the bottleneck; decode steps wait behind those prefills)",
    )
    parser.add_argument(
        "--kv-transfer",
        choices=("store", "direct"),
        default=_env("KV_TRANSFER", "store"),
        help="P/D: hand KV over through the LMCache-backed store shards, or directly prefill -> decode (NIXL)",
    )
    parser.add_argument(
        "--store-gib", type=float, default=2.0, help="host memory of each node's KV store shard"
    )
    parser.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(_env("PORT", "8000")))
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="join this Ray cluster instead of starting a head on loopback",
    )
    parser.add_argument("--policy", default="kv_aware", help="routing policy (router.policies.POLICIES)")
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        help="a file of KEY:TENANT lines (or env PDCLUSTER_API_KEYS=KEY:TENANT,...); none: an open "
        "endpoint, on loopback only. Keys never go on the command line (`ps` shows it)",
    )
    parser.add_argument("--rate-limit", type=float, help="requests/s per API key")
    parser.add_argument("--max-concurrency-per-key", type=int, help="requests in flight per API key")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--no-eager", action="store_true", help="allow compilation / CUDA graphs")
    parser.add_argument(
        "--engine-log-dir",
        type=Path,
        help="write each engine's whole vLLM output to DIR/<instance id>.log on its node",
    )
    parser.add_argument("--start-timeout", type=float, default=300.0, help="per engine, once placed")
    parser.add_argument(
        "--placement-timeout",
        type=float,
        default=900.0,
        help="longest wait for Ray to place the engines (autoscaling included)",
    )
    parser.set_defaults(func=_cmd_serve)  # fmt: skip
    return parser


def _add_module_parser(subparsers, name: str, module, help: str) -> None:
    """A subcommand whose arguments and runner live in `module` (add_arguments, run)."""
    parser = subparsers.add_parser(name, help=help, description=module.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def _add_cluster_parsers(subparsers) -> None:
    launch = _add_serve_parser(subparsers, "launch", "start router and pools on a running Ray cluster")
    launch.set_defaults(address="auto")
    up = subparsers.add_parser("up", help="`ray up` a cluster YAML, then launch pdcluster on its head")
    up.add_argument("cluster_yaml", type=Path)
    up.add_argument("launch_args", nargs=argparse.REMAINDER, help="flags for `pdcluster launch` (--port ...)")
    up.set_defaults(func=_cmd_up)
    down = subparsers.add_parser("down", help="stop pdcluster and `ray down` the cluster")
    down.add_argument("cluster_yaml", type=Path)
    down.set_defaults(func=_cmd_down)
    status = subparsers.add_parser("status", help="pools, instances and their states")
    status.add_argument("--url", default=f"http://127.0.0.1:{_env('PORT', '8000')}")
    status.add_argument("--secret-file", type=Path, help="the cluster's secret (as for serve)")
    status.set_defaults(func=_cmd_status)


def _cmd_up(args: argparse.Namespace) -> int:
    from deploy import cluster

    port_parser = argparse.ArgumentParser(add_help=False)
    port_parser.add_argument("--port", type=int, default=8000)
    args.port = port_parser.parse_known_args(args.launch_args)[0].port
    try:
        url = cluster.up(args.cluster_yaml, args.launch_args, args.port)
    except (cluster.ClusterConfigError, RuntimeError, TimeoutError, OSError) as exc:  # CredentialsError too
        console.print(f"[red]pdcluster up failed:[/] {exc}")
        return 1
    console.print(
        f"pdcluster is serving on the head at {url} (`ray attach {args.cluster_yaml} -p {args.port}`)"
    )
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from deploy import cluster

    cluster.down(args.cluster_yaml)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    import httpx
    from rich.table import Table

    from security.credentials import ClusterCredentials

    try:
        headers = ClusterCredentials.load(args.secret_file).admin_headers()
        health = httpx.get(f"{args.url}/health", timeout=5).json()
        response = httpx.get(f"{args.url}/admin/instances", headers=headers, timeout=5)
        response.raise_for_status()
        instances = response.json()["instances"]
    except (httpx.HTTPError, RuntimeError) as exc:
        console.print(f"[red]no router at {args.url}:[/] {exc!r}")
        return 1
    table = Table(title=f"pdcluster at {args.url}: {health['status']}")
    for column in ("instance", "role", "state", "in flight", "url"):
        table.add_column(column)
    for i in instances:
        table.add_row(i["instance_id"], i["role"], i["state"], str(i["inflight"]), i["url"])
    Console().print(table)
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from engine.models import ensure_model

    print(ensure_model(args.name, args.dir))
    return 0


def resolve_model(model: str) -> tuple[Path, str]:
    """A builder name is built (in its own process: torch must not load here) and cached."""
    if model in BUILDERS:
        path = default_model_root() / model
        if not (path / COMPLETE_MARKER).exists():  # a built model costs no child process (seconds)
            subprocess.run([sys.executable, "-m", "deploy.cli", "model", model, str(path)], check=True)
        return path, model
    path = Path(model)
    return path, path.name


def load_api_keys(path: Path | None) -> dict[str, str]:
    """The API keys from `path` (KEY:TENANT per line or comma-separated), else from env
    PDCLUSTER_API_KEYS."""
    spec = path.read_text() if path else os.environ.get("PDCLUSTER_API_KEYS", "")
    return parse_api_keys(spec.replace("\n", ","))


def parse_api_keys(spec: str) -> dict[str, str]:
    """ "KEY:TENANT,KEY:TENANT" -> {KEY: TENANT}; a key without a tenant is its own tenant."""
    keys = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, _, tenant = item.partition(":")
        if key in keys:
            raise ValueError(f"API key listed twice: {key[:4]}...")
        keys[key] = tenant or key
    return keys


@dataclass(frozen=True)
class Topology:
    """Colocated instances, or prefill and decode pools; each pool may keep standbys and grow."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    standby: int = 0
    """Standby instances per pool."""
    max_instances: int = 0
    """Ready instances per pool at most; 0: the initial count (at least 1)."""
    target_ttft_s: float | None = None
    """The prefilling pool's TTFT trigger (PoolSpec.target_ttft_s)."""

    @classmethod
    def from_args(cls, instances: int, prefill: int, decode: int, standby: int = 0, max_instances: int = 0,
                  target_ttft_s: float | None = None, colocated: bool = False) -> Topology:  # fmt: skip
        if colocated and (prefill or decode):
            raise ValueError("--colocated and --prefill/--decode exclude each other")
        if standby < 0 or max_instances < 0:
            raise ValueError("--standby and --max-instances cannot be negative")
        if target_ttft_s is not None and target_ttft_s <= 0:
            raise ValueError("--target-ttft must be positive")
        least = 0 if standby else 1  # a pool may start empty when a standby can serve it
        if prefill or decode:
            if prefill < least or decode < least or prefill + decode == 0:
                raise ValueError("a P/D topology needs --prefill >= 1 and --decode >= 1 (0 with --standby)")
            return cls(0, prefill, decode, standby, max_instances, target_ttft_s)
        if instances < least:
            raise ValueError("--instances must be at least 1 (or 0 with --standby)")
        return cls(instances, 0, 0, standby, max_instances, target_ttft_s)

    def _counts(self) -> list[tuple[Role, int]]:
        if self.colocated or not (self.prefill or self.decode):
            return [(Role.COLOCATED, self.colocated)]
        return [(Role.PREFILL, self.prefill), (Role.DECODE, self.decode)]

    def roles(self) -> list[tuple[str, Role]]:
        """The instances started at once, by id."""
        return [(f"{role.value}-{i}", role) for role, count in self._counts() for i in range(count)]

    def pools(self) -> list:
        from deploy.pool import PoolSpec

        return [
            PoolSpec(role=role, min_ready=count, max_ready=max(count, self.max_instances, 1), standby=self.standby,
                     target_ttft_s=self.target_ttft_s if role != Role.DECODE else None)  # decode does not prefill
            for role, count in self._counts()
        ]  # fmt: skip

    def engines_at_most(self) -> int:
        return sum(pool.max_ready + pool.standby for pool in self.pools())

    def ray_resources(self) -> dict[str, float]:
        """A one-machine head offers the role resources the pools are placed by."""
        return {pool.role.value: float(pool.max_ready + pool.standby) for pool in self.pools()
                if pool.role != Role.COLOCATED}  # fmt: skip


def roles_to_start(wanted: list[tuple[str, Role]], present: list) -> list[tuple[str, Role]]:
    """The initial instances (id, role) still to start when `present` (adopted, ready) instances
    already serve: per role that many fewer, skipping ids in use."""
    taken = {i.instance_id for i in present}
    missing = collections.Counter(role for _, role in wanted)
    missing.subtract(i.role for i in present)
    chosen = []
    for instance_id, role in wanted:
        if instance_id not in taken and missing[role] > 0:
            chosen.append((instance_id, role))
            missing[role] -= 1
    return chosen


def _cmd_serve(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from router.config import RouterConfig
    from security.credentials import ClusterCredentials, CredentialsError

    model_path, default_name = resolve_model(args.model)
    name = args.served_model_name or default_name
    try:
        # One machine makes its own secret; a cluster's head must be given one (README, cluster steps).
        credentials = ClusterCredentials.load(args.secret_file, create=args.address is None)
        secret = credentials.secret.hex()
        engine_config = EngineConfig(
            model=model_path,
            served_model_name=name,
            max_model_len=args.max_model_len,
            kv_cache_gib=args.kv_cache_gib,
            enforce_eager=not args.no_eager,
            start_timeout_s=args.start_timeout,
            cluster_secret=secret,
            log_dir=args.engine_log_dir.resolve() if args.engine_log_dir else None,
        )
        router_config = RouterConfig(
            host=args.host, port=args.port, served_model_name=name,
            max_model_len=args.max_model_len, policy=args.policy, tokenizer=model_path,
            block_size=engine_config.block_size, allow_remote=args.address is not None,
            remote_prefill_min_tokens=args.remote_prefill_min_tokens,
            remote_prefill_max_queued_tokens=args.remote_prefill_max_queued_tokens,
            api_keys=load_api_keys(args.api_keys_file), rate_limit_per_s=args.rate_limit, cluster_secret=secret,
            max_concurrency_per_key=args.max_concurrency_per_key,
            queue_timeout_s=args.queue_timeout,
        )  # fmt: skip
        topology = Topology.from_args(args.instances, args.prefill, args.decode, args.standby, args.max_instances,
                                      args.target_ttft, args.colocated)  # fmt: skip
    except (ValidationError, ValueError, OSError, CredentialsError) as exc:
        console.print(f"[red]invalid configuration:[/] {exc}")
        return 2
    # Loopback: else Ray swaps a loopback address for the machine's routable one.
    use_ray(credentials.ray_auth_env(), loopback=args.address is None or is_loopback(args.address.rpartition(":")[0]))
    pd = topology.prefill or topology.decode
    store_bytes = int(args.store_gib * 1024**3) if pd and args.kv_transfer == "store" else 0
    return asyncio.run(_serve(engine_config, router_config, topology, args.address, args.placement_timeout,
                              args.start_log, store_bytes))  # fmt: skip


async def _serve(engine_config, router_config, topology, address: str | None, placement_timeout_s: float,
                 start_log: Path, store_bytes: int = 0) -> int:  # fmt: skip
    import uvicorn

    from deploy.launcher import Launcher, cpu_core_sets, start_ray
    from deploy.pool import PoolController
    from engine.environment import free_port, is_cpu_build
    from engine.host import node_address
    from router.app import build_app
    from router.instances import InstanceRegistry
    from router.kv_events import STORE_HOLDER

    started_head = start_ray(address, resources=topology.ray_resources())
    failed = True
    registry = InstanceRegistry()
    launcher = Launcher(registry, router_config.credentials(), console, start_log)
    controller = None
    try:
        # A router restarted on a running cluster takes over the engines its predecessor left.
        adopted = await launcher.adopt(engine_config, keep_store=store_bytes > 0)
        # The engines publish their KV events to the router's SUB socket, on the router's node.
        events_host = node_address()
        events_endpoint = adopted.kv_events_endpoint or f"tcp://{events_host}:{free_port(events_host)}"
        router_config = router_config.model_copy(update={"kv_events_endpoint": events_endpoint})
        engine_config = engine_config.model_copy(update={"kv_events_endpoint": events_endpoint})
        roles = roles_to_start(topology.roles(), registry.ready(tuple(Role)))
        engines = topology.engines_at_most()
        cores = cpu_core_sets(engines, os.cpu_count() or 1) if is_cpu_build() and not address else []
        configs = [
            (
                instance_id,
                engine_config.model_copy(update={"role": role, "cpu_cores": cores[k] if cores else None}),
            )
            for k, (instance_id, role) in enumerate(roles)
        ]
        if store_bytes:
            fault_injection = os.environ.get(STORE_FAULT_INJECTION_ENV) == "1"
            # Adopted shards are kept; nodes without one get one, now and as they join.
            shards = await launcher.start_store_shards(store_bytes, fault_injection)
            launcher.watch_store()
            engine_config = engine_config.model_copy(update={"kv_store_endpoints": shards})
            configs = [(i, c.model_copy(update={"kv_store_endpoints": shards})) for i, c in configs]
        await launcher.start_instances(configs, placement_timeout_s)
        app = build_app(router_config, registry, store_endpoints=engine_config.kv_store_endpoints)
        launcher.on_store_restart.append(lambda: app.state.index.clear(STORE_HOLDER))
        # Instances the controller adds get the core sets the initial ones left (all, if none).
        controller = PoolController(launcher, registry, app.state.queue, topology.pools(), engine_config,
                                    core_sets=cores[len(roles):] or cores or None,
                                    first_tokens=app.state.first_tokens)  # fmt: skip
        controller.start()
        server = uvicorn.Server(
            uvicorn.Config(app, host=router_config.host, port=router_config.port, log_level="warning")
        )
        url = f"http://{router_config.host}:{router_config.port}"
        console.print(f"[bold]pdcluster[/] serving [cyan]{router_config.served_model_name}[/] at {url}")
        console.print(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{router_config.served_model_name}", '
            f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\''
        )
        _keep_cleanup_on_signals()
        await server.serve()
        if not server.started:  # it could not listen (uvicorn logged why)
            raise RuntimeError(f"the router could not serve on {url}")
        failed = False
        return 0
    except Exception as exc:  # a failed start: say why, stop what started, exit non-zero
        console.print(f"[red]pdcluster serve failed:[/] {exc or repr(exc)}")  # some errors have no message
        return 1
    finally:
        console.print("stopping engines...")
        if controller is not None:
            await controller.stop()
        # A failed restart leaves the fleet it adopted serving: the next attempt adopts it again.
        await launcher.shutdown(keep_adopted=failed)
        if started_head:
            import ray

            ray.shutdown()


def _keep_cleanup_on_signals() -> None:
    """uvicorn handles Ctrl-C / SIGTERM, then re-raises the signal once it has stopped: under the
    default handlers that cancels (SIGINT) or kills (SIGTERM) this process before it stops its
    engines. Swallow that first re-raise; a further signal interrupts the clean-up."""
    raised = {"count": 0}

    def on_signal(signum, frame) -> None:
        raised["count"] += 1
        if raised["count"] > 1:
            raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="pdcluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(required=True, metavar="COMMAND")
    _add_model_parser(subparsers)
    _add_serve_parser(subparsers)
    _add_cluster_parsers(subparsers)
    from loadtest import cli as loadtest_cli
    from loadtest import simulate

    _add_module_parser(
        subparsers, "simulate", simulate, "replay a Mooncake trace through the routing policies"
    )
    _add_module_parser(subparsers, "loadtest", loadtest_cli, "load an OpenAI endpoint and report")
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: everything started was stopped on the way out
        return 130


if __name__ == "__main__":
    sys.exit(main())
