"""`pdcluster serve` / `launch`: the composition root. Reads the configuration, loads the
cluster's credentials, joins or starts Ray, adopts what a previous launcher left, starts the store
and the engines, builds the router and the pool controller, serves until Ctrl-C, and stops what it
started (a failed restart leaves the fleet it adopted serving)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console

from deploy.topology import Topology, roles_to_start
from engine.config import EngineConfig, TensorParallel
from engine.engine_args import EngineArgs
from engine.environment import is_cpu_build, is_loopback, use_ray
from engine.models import BUILDERS, default_model_root, is_complete
from router.config import RouterConfig, ServedModel
from security.credentials import ClusterCredentials, CredentialsError, read_private

log = logging.getLogger(__name__)
console = Console(stderr=True)
# Tests only: store shards then honour the "corrupt" op (fault injection into stored chunks).
STORE_FAULT_INJECTION_ENV = "PDCLUSTER_STORE_FAULT_INJECTION"
SHUTDOWN_DRAIN_S = 120.0
"""Longest Ctrl-C / SIGTERM waits for the requests in flight before the engines stop."""


def resolve_models(models: str, served_model_name: str | None) -> list[tuple[Path, str]]:
    """`--model`'s comma-separated models as (folder, served name) each; a name given by
    `--served-model-name` only with one model."""
    resolved = [resolve_model(model.strip()) for model in models.split(",") if model.strip()]
    if not resolved:
        raise ValueError("--model names no model")
    if served_model_name:
        if len(resolved) > 1:
            raise ValueError("--served-model-name names one model; several are served by their own names")
        resolved = [(resolved[0][0], served_model_name)]
    return resolved


def resolve_model(model: str) -> tuple[Path, str]:
    """A builder name is built (in its own process: torch must not load here) and cached."""
    if model in BUILDERS:
        path = default_model_root() / model
        if not is_complete(path):  # a built model costs no child process (seconds)
            subprocess.run([sys.executable, "-m", "deploy.cli", "model", model, str(path)], check=True)
        return path, model
    path = Path(model)
    return path, path.name


def load_api_keys(path: Path | None) -> dict[str, str]:
    """The API keys from `path` (KEY:TENANT per line or comma-separated; the file the operator's
    alone, as the secret's: security.credentials.read_private), else from env PDCLUSTER_API_KEYS."""
    spec = read_private(path) if path else os.environ.get("PDCLUSTER_API_KEYS", "")
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


def serve(args: argparse.Namespace) -> int:
    """`pdcluster serve` and `pdcluster launch`."""

    try:
        models = resolve_models(args.model, args.served_model_name)
        topology = Topology.from_args(
            args.instances, args.prefill, args.decode, standby=args.standby, max_instances=args.max_instances,
            target_ttft_s=args.target_ttft, colocated=args.colocated, sleeping_standbys=args.sleeping_standbys,
            sleep_when_idle=args.sleep_when_idle, models=tuple(name for _, name in models), max_awake=args.max_awake,
            preimported=args.preimported)
        _check_gpu_sharing(args, topology)
        store_bytes = _store_bytes(args, topology)
        if args.router_only and args.address is None:
            raise ValueError("--router-only serves the engines of a running cluster: give its --address")
        # One machine makes its own secret; a cluster's head must be given one (README, cluster steps).
        credentials = ClusterCredentials.load(args.secret_file, create=args.address is None)
        secret = credentials.secret.hex()
        engine_args = _engine_args(args, topology)
        engine_args.check(models[0][0], topology.role_kinds())
        engine_configs = _engine_configs(args, models, topology, engine_args)
        router_config = _router_config(args, models, engine_configs, secret)
    except (ValidationError, ValueError, OSError, CredentialsError) as exc:
        console.print(f"[red]invalid configuration:[/] {exc}")
        return 2
    # Loopback: else Ray swaps a loopback address for the machine's routable one.
    use_ray(credentials.ray_auth_env(), loopback=args.address is None or is_loopback(args.address.rpartition(":")[0]))
    if args.router_only:
        return asyncio.run(_serve_beside(engine_configs, router_config, args.address))
    return asyncio.run(_serve(engine_configs, router_config, topology, args.address, args.placement_timeout,
                              args.start_log, store_bytes))


def _check_gpu_sharing(args: argparse.Namespace, topology: Topology) -> None:
    """Engines that share a GPU or sleep: flags that fit together, and a build that has GPUs."""
    if args.engines_per_gpu < 1:
        raise ValueError("--engines-per-gpu must be at least 1")
    if args.max_awake is not None and args.engines_per_gpu < 2:
        raise ValueError("--max-awake is for engines that share a GPU: give --engines-per-gpu K > 1")
    if args.max_awake is None and args.engines_per_gpu * args.gpu_memory_utilization > 1:
        raise ValueError(f"{args.engines_per_gpu} engines x --gpu-memory-utilization "
                         f"{args.gpu_memory_utilization:g} exceed one GPU: lower it to 1/K at most, or let "
                         "them take turns (--sleep-when-idle --max-awake N)")
    gpu_only = topology.sleeping_standbys or topology.sleep_when_idle or args.engines_per_gpu > 1
    if gpu_only and args.address is None and is_cpu_build():
        raise ValueError("--sleeping-standbys, --sleep-when-idle and --engines-per-gpu need CUDA engines: "
                         "vLLM's CPU build has no sleep mode and no GPU to share")


def _store_bytes(args: argparse.Namespace, topology: Topology) -> int:
    """Each node's KV store shard's host memory; 0: no store (P/D directly, colocated sharing nothing)."""
    pd = topology.prefill or topology.decode
    if args.shared_store:
        _check_shared_store(topology, pd)
    runs_store = args.shared_store or (pd and args.kv_transfer == "store")
    return int(args.store_gib * 1024**3) if runs_store else 0


def _check_shared_store(topology: Topology, pd: bool) -> None:
    if pd:
        raise ValueError("--shared-store is for colocated instances: a P/D topology hands KV over through "
                         "the store already (--kv-transfer store) or directly")
    if len(topology.models) > 1:
        # The router's index of the store does not tell models apart (router/kv_event_listener.py).
        raise ValueError("--shared-store serves one model")
    if topology.sleeping_standbys or topology.sleep_when_idle:
        raise ValueError("--shared-store and sleeping engines exclude each other: the store's KV connector "
                         "registers the KV cache's memory, which sleep unmaps")


def _engine_args(args: argparse.Namespace, topology: Topology) -> EngineArgs:
    """The vLLM flags the user gave each pool."""
    pd = topology.prefill or topology.decode
    if not pd and (args.prefill_engine_arg or args.decode_engine_arg):
        raise ValueError("--prefill-engine-arg and --decode-engine-arg are for a P/D topology's pools: "
                         "give colocated engines --engine-arg")
    return EngineArgs.from_flags(args.engine_arg, args.prefill_engine_arg, args.decode_engine_arg)


def _tensor_parallel(args: argparse.Namespace, topology: Topology, model: Path) -> TensorParallel:
    """The devices each pool's engines span, serving `model`."""
    pd = topology.prefill or topology.decode
    if not pd and (args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size):
        raise ValueError("--prefill-tensor-parallel-size and --decode-tensor-parallel-size are for a P/D "
                         "topology's pools: give colocated engines --tensor-parallel-size")
    sizes = TensorParallel(every_pool=args.tensor_parallel_size, prefill=args.prefill_tensor_parallel_size,
                           decode=args.decode_tensor_parallel_size)
    if pd:
        sizes.check_pd(direct=args.kv_transfer == "direct", model=model)
    return sizes


def _engine_configs(args: argparse.Namespace, models: list[tuple[Path, str]], topology: Topology,
                    engine_args: EngineArgs) -> list[EngineConfig]:
    """One engine config per model: the engines of its pools all start from it."""
    return [EngineConfig(
        model=path,
        served_model_name=name,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        enforce_eager=not args.no_eager,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        gpu_share=1 / args.engines_per_gpu,
        sleep_mode=topology.sleep_when_idle,
        start_timeout_s=args.start_timeout,
        kv_store_timeout_s=args.store_timeout, kv_lease_s=args.kv_lease,
        structured_migration=args.structured_migration,
        log_dir=args.engine_log_dir.resolve() if args.engine_log_dir else None,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        engine_args=engine_args,
        tensor_parallel=_tensor_parallel(args, topology, path),
    ) for path, name in models]


def _router_config(args: argparse.Namespace, models: list[tuple[Path, str]], engine_configs: list[EngineConfig],
                   secret: str) -> RouterConfig:
    """The router's config, serving every model of `models` (hashing prompts as their engines do)."""
    return RouterConfig(
        host=args.host, port=args.port, policy=args.policy, request_cost_tokens=args.request_cost_tokens,
        models=tuple(ServedModel(name=name, max_model_len=args.max_model_len, tokenizer=path)
                     for path, name in models),
        kv_hashing=engine_configs[0].kv_hashing, allow_remote=args.address is not None,
        remote_prefill_min_tokens=args.remote_prefill_min_tokens,
        remote_prefill_max_queued_tokens=args.remote_prefill_max_queued_tokens,
        api_keys=load_api_keys(args.api_keys_file), rate_limit_per_s=args.rate_limit, cluster_secret=secret,
        max_concurrency_per_key=args.max_concurrency_per_key,
        max_connections_per_address=args.max_connections_per_address, header_timeout_s=args.header_timeout,
        queue_timeout_s=args.queue_timeout, max_migrations=args.max_migrations,
        stream_stall_s=args.stream_stall_timeout, request_timeout_s=args.request_timeout,
        structured_migration=args.structured_migration,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


async def _serve(engine_configs, router_config, topology, address: str | None, placement_timeout_s: float,
                 start_log: Path, store_bytes: int = 0) -> int:
    from deploy.launcher import Launcher
    from deploy.ray_head import start_ray
    from fleet.instances import InstanceRegistry

    started_head = start_ray(address, resources=topology.ray_resources())
    failed = True
    registry = InstanceRegistry()
    launcher = Launcher(registry, router_config.credentials(), console, start_log)
    controller = limits = None
    try:
        limits = await _shared_limits(router_config)
        app, controller = await _start_fleet(launcher, registry, engine_configs, router_config, topology,
                                             address, placement_timeout_s, store_bytes, limits)
        await _serve_router(app, app.state.config)
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
        import ray

        if limits is not None and not failed:
            ray.kill(limits.handle)  # the cluster's routers go with its fleet
        if started_head:
            ray.shutdown()


async def _serve_beside(engine_configs, router_config, address: str) -> int:
    """`launch --router-only`: a router more for the fleet another launcher on the cluster at
    `address` owns (deploy/follower.py). It starts and stops nothing but itself."""
    from deploy.follower import FleetFollower
    from deploy.ray_head import start_ray
    from fleet.instances import InstanceRegistry
    from router.app import build_app
    from router.kv_event_listener import STORE_HOLDER

    start_ray(address)
    registry = InstanceRegistry()
    served = {(str(c.model), c.served_model_name) for c in engine_configs}
    follower = FleetFollower(registry, router_config.credentials(), served)
    try:
        limits = await _shared_limits(router_config)
        await follower.sync()
        console.print(f"following {len(registry.all())} engine(s) and {len(follower.store_endpoints)} store "
                      "shard(s) another launcher owns")
        app = build_app(router_config, registry, store_endpoints=follower.store_endpoints, limits=limits)
        follower.on_store_restart = lambda: app.state.index.clear(STORE_HOLDER)
        follower.start()
        await _serve_router(app, router_config)
        return 0
    except Exception as exc:
        console.print(f"[red]pdcluster launch --router-only failed:[/] {exc or repr(exc)}")
        return 1
    finally:
        await follower.stop()


async def _shared_limits(router_config):
    """The per-key limits every router of the cluster shares (deploy/admission_ledger.py); None
    when there are none."""
    from deploy.admission_ledger import join_ledger

    if router_config.rate_limit_per_s is None and router_config.concurrency_per_key is None:
        return None
    return await join_ledger(router_config.rate_limit_per_s, router_config.concurrency_per_key)


async def _start_fleet(launcher, registry, engine_configs, router_config, topology, address: str | None,
                       placement_timeout_s: float, store_bytes: int, limits=None):
    """Adopt what a previous launcher left, start the store and the missing engines, build the
    router's app and the pool controller (started); returns both."""
    from deploy.actor_placement import CoreSets, cpu_core_sets
    from deploy.pool import PoolController
    from router.app import build_app, import_ahead
    from router.kv_event_listener import STORE_HOLDER
    from router.status import StartLog

    starts = StartLog()  # every start from here on, for the router's status view
    launcher.on_start.append(starts.record)

    # A router restarted on a running cluster takes over the engines its predecessor left.
    await launcher.adopt(engine_configs, topology.role_kinds(), keep_store=store_bytes > 0)
    shards: tuple[str, ...] = ()
    if store_bytes:
        fault_injection = os.environ.get(STORE_FAULT_INJECTION_ENV) == "1"
        # Adopted shards are kept; nodes without one get one, now and as they join.
        shards = await launcher.start_store_shards(store_bytes, fault_injection)
        launcher.watch_store()
    # Every engine publishes its KV events, for every router of the cluster (router/kv_event_listener.py).
    engine_configs = [c.model_copy(update={"kv_events": True, "kv_store_endpoints": shards}) for c in engine_configs]
    taken = {i.instance_id for i in registry.all()}
    roles = [(instance_id, role, config) for config in engine_configs
             for instance_id, role in roles_to_start(topology.roles(config.served_model_name),
                                                     _serving(registry, config.served_model_name), taken)]
    ranks = topology.ranks_at_most(engine_configs[0].tensor_parallel)
    cores = CoreSets(cpu_core_sets(ranks, os.cpu_count() or 1) if is_cpu_build() and not address else [])
    configs = [(instance_id, cores.bound(config.model_copy(update={"role": role})))
               for instance_id, role, config in roles]
    imported = asyncio.create_task(asyncio.to_thread(import_ahead))  # the router's, while engines start
    try:
        await _start_initial(launcher, configs, placement_timeout_s, topology.max_awake,
                             one_by_one=any(c.gpu_share < 1 for c in engine_configs))
    except BaseException:
        imported.cancel()  # not awaited: the start's own error is what the caller must see
        raise
    await imported
    app = build_app(router_config, registry, store_endpoints=shards, starts=starts, limits=limits)
    launcher.store.on_restart.append(lambda: app.state.index.clear(STORE_HOLDER))
    app.state.retire = lambda instance_id: launcher.stop_instance(instance_id, drain_s=SHUTDOWN_DRAIN_S)
    # Instances the controller adds get the core sets the initial ones left, then all in turn.
    controller = PoolController(launcher, registry, app.state.queue, topology.pools(), engine_configs,
                                cores=cores, first_tokens=app.state.first_tokens,
                                id_prefix=topology.id_prefix, max_awake=topology.max_awake)
    controller.start()
    return app, controller


def _serving(registry, model: str) -> list:
    """`model`'s instances that count as started: ready, or standing by (asleep or not)."""
    from engine.lifecycle import InstanceState

    return [i for i in registry.all() if i.model == model and (i.state == InstanceState.READY or i.state.is_standby)]


async def _start_initial(launcher, configs: list, placement_timeout_s: float, max_awake: int | None,
                         one_by_one: bool) -> None:
    """The initial engines, together; `one_by_one` (engines sharing a GPU: concurrent starts
    mis-size their KV caches) one after another, and under `max_awake` all but the last
    `max_awake` put to sleep right after their start (a starting engine needs its share of the GPU
    free: vLLM checks)."""
    if not one_by_one:
        await launcher.start_instances(configs, placement_timeout_s)
        return
    for k, (instance_id, config) in enumerate(configs):
        await launcher.start_instances([(instance_id, config)], placement_timeout_s)
        if max_awake is not None and k < len(configs) - max_awake:
            await launcher.sleep_instance(instance_id, drain_s=0.0)


async def _serve_router(app, router_config) -> None:
    """Serve the router's app until Ctrl-C / SIGTERM, then drain: no new connection, the requests
    in flight finish (for at most SHUTDOWN_DRAIN_S), and only then the engines stop."""
    from router.app import router_server

    server = router_server(app, timeout_graceful_shutdown=SHUTDOWN_DRAIN_S)
    url = f"http://{router_config.host}:{router_config.port}"
    names = [m.name for m in router_config.models]
    console.print(f"[bold]pdcluster[/] serving [cyan]{', '.join(names)}[/] at {url}")
    console.print(
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{names[0]}", '
        f'"messages": [{{"role": "user", "content": "Hello!"}}]}}\''
    )
    _keep_cleanup_on_signals()
    await server.serve()
    if not server.started:  # it could not listen (uvicorn logged why)
        raise RuntimeError(f"the router could not serve on {url}")


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


