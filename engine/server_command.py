"""The vLLM OpenAI server command an engine of ours runs (its imports done ahead,
engine/preimport.py; served by engine/serving.py), and its environment: dummy weights (the weight
plane fills them), our worker extension, HTTP middleware and logits processor, KV events to the
router, and the role's KV connector."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

from engine.config import EngineConfig
from engine.environment import (
    COMPILE_KEY_PLUGIN,
    CPU_INDUCTOR_ENV,
    ENGINE_CHILDREN_FORK_ENV,
    ENGINE_PLUGINS,
    GRAMMAR_LOGITS_PROCESSOR,
    KV_EVENTS_PLUGIN,
    RANK_CORES_PLUGIN,
    engine_process_env,
    free_port,
    is_cpu_build,
)
from engine.role_spec import KV_CONNECTOR_ENV, KV_CONNECTOR_VLLM_ARGS
from engine.weights import WEIGHTS_DIR_ENV, WEIGHTS_FILE_ENV
from security.credentials import EngineKeys

SERVER_MODULE = "engine.serving"
"""vLLM's OpenAI server on our socket and TLS, run by engine/preimport.py once its imports are
done and it is told to."""
LISTEN_FD_ENV = "PDCLUSTER_LISTEN_FD"
"""The descriptor of the listening socket the host bound for the server (engine/serving.py)."""
KV_EVENTS_PLUGIN_TARGET = "engine.kv_event_publisher:register"
"""What the entry point KV_EVENTS_PLUGIN names (pyproject.toml)."""
COMPILE_KEY_PLUGIN_TARGET = "engine.compile_key:register"
"""What the entry point COMPILE_KEY_PLUGIN names (pyproject.toml)."""
RANK_CORES_PLUGIN_TARGET = "engine.rank_cores:register"
"""What the entry point RANK_CORES_PLUGIN names (pyproject.toml)."""
PLAN_KEY = "pdcluster_gpu_memory_utilization"
"""What the engine's `additional_config` holds only so that vLLM's startup plan is kept per memory
utilization (vLLM reads nothing of it)."""


def plugin_installed(name: str, target: str) -> bool:
    """Whether vLLM will find our plugin `name` (naming `target`) in the engine's processes."""
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(p.name == name and p.value == target for p in plugins)


def kv_events_plugin_installed() -> bool:
    """Whether vLLM will find our KV event publisher (engine/kv_event_publisher.py) in the engine's
    processes. Without it vLLM falls back, silently, to its plain publisher, whose replay socket
    sends every buffered batch, token ids included, to anyone who reaches it: an engine with KV
    events must not start then."""
    return plugin_installed(KV_EVENTS_PLUGIN, KV_EVENTS_PLUGIN_TARGET)


def compile_key_plugin_installed() -> bool:
    """Whether vLLM will find our compile key (engine/compile_key.py): without it an engine still
    serves, but keys its compile by its port and cores, which no other start reads."""
    return plugin_installed(COMPILE_KEY_PLUGIN, COMPILE_KEY_PLUGIN_TARGET)


def rank_cores_plugin_installed() -> bool:
    """Whether vLLM will find engine/rank_cores.py: without it a CPU engine with vLLM's NIXL
    connector still serves, but computes on the node's last core, whatever cores it was given."""
    return plugin_installed(RANK_CORES_PLUGIN, RANK_CORES_PLUGIN_TARGET)


def server_command(config: EngineConfig, host: str, port: int, instance_id: str) -> list[str]:
    c = config
    command = [
        sys.executable, "-m", "engine.preimport", SERVER_MODULE,
        "--model", str(c.model),
        "--served-model-name", c.served_model_name,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(c.max_model_len),
        "--block-size", str(c.block_size),
        "--prefix-caching-hash-algo", c.kv_hashing.algorithm,
        "--gpu-memory-utilization", str(c.gpu_memory_utilization),
        "--disable-uvicorn-access-log",
        "--enable-server-load-tracking",  # GET /load: what every router's policy counts (router/health.py)
        "--load-format", "dummy",
        "--worker-extension-cls", "engine.worker_extension.WeightPlaneExtension",
        "--middleware", "engine.http_auth.EngineAuthMiddleware",
        # vLLM's startup plan (server_env) is keyed without the utilization: a plan measured at
        # 0.9 would size a 0.45 engine's KV cache for 0.9 (compiled graphs too are then kept per
        # utilization).
        "--additional-config", json.dumps({PLAN_KEY: c.gpu_memory_utilization}),
    ]
    if c.tensor_parallel_size > 1:
        # The ranks are the engine actor's child processes: reaped with it, on the GPUs Ray gave it.
        command += ["--tensor-parallel-size", str(c.tensor_parallel_size), "--distributed-executor-backend", "mp"]
    if c.structured_migration:
        command += ["--logits-processors", GRAMMAR_LOGITS_PROCESSOR]
    if c.enforce_eager:
        command.append("--enforce-eager")
    if c.sleep_mode:
        command.append("--enable-sleep-mode")
    if c.dtype != "auto":
        command += ["--dtype", c.dtype]
    if c.kv_events:
        # port 0: the publisher binds ports of the system's choosing and reports them (KV_EVENTS_MARK)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": instance_id,
            "endpoint": f"tcp://{_zmq_host(host)}:0",
            "replay_endpoint": f"tcp://{_zmq_host(host)}:0",
        }
        command += ["--kv-events-config", json.dumps(events)]
    if c.runs_kv_connector:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config(c)), *KV_CONNECTOR_VLLM_ARGS]
    if c.otlp_traces_endpoint:
        command += ["--otlp-traces-endpoint", c.otlp_traces_endpoint]
    return command + list(c.engine_args.for_role(c.role.kind))


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def kv_transfer_config(config: EngineConfig) -> dict:
    """With a store: our StoreConnector (kvstore/), every instance saving the prompts it
    computes and loading what the store holds: `kv_both` for both pools, since a prefill instance
    loads the prefix another one stored (its store hits) and a decode instance stores the prompts
    it prefills itself (a short one, a fallback) for the next. Without: vLLM's NixlConnector, the
    decode instance reading the prefill's blocks one-sided over UCX, each role as vLLM names it
    (`kv_producer`, `kv_consumer`), the prefill holding them for `kv_lease_s`. Either way a
    failed load is recomputed, never an error."""
    shared = {"kv_load_failure_policy": "recompute"}
    if config.kv_store_endpoints:  # kvstore/settings.py StoreSettings reads the extra config
        return {**shared, "kv_role": "kv_both", "kv_connector": "StoreConnector",
                "kv_connector_module_path": "kvstore.connector",
                "kv_connector_extra_config": {"endpoints": list(config.kv_store_endpoints),
                                              "timeout_s": config.kv_store_timeout_s}}
    return {**shared, "kv_role": config.role.direct_kv_role, "kv_connector": "NixlConnector",
            "kv_buffer_device": "cpu" if is_cpu_build() else "cuda",
            "kv_connector_extra_config": {"kv_lease_duration": config.kv_lease_s}}


def server_env(config: EngineConfig, host: str, instance_id: str, keys: EngineKeys,
               weights_file: Path | None) -> dict[str, str]:
    """The server process's whole environment (engine_process_env: scrubbed of credentials but
    the engine's own `keys`)."""
    env = engine_process_env(host, config.kv_cache_gib, config.cpu_cores, config.kv_hashing.seed)
    # /collective_rpc and /reset_prefix_cache, for weights; like every route, behind the token
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(keys.as_env())
    env["VLLM_PLUGINS"] = ",".join(ENGINE_PLUGINS)  # ours alone
    if not config.otlp_traces_endpoint:
        # The engine core and its workers forked from the server process, which imported them
        # ahead (engine/preimport.py), not spawned to import vLLM again (~8 s each on CPU). On
        # CUDA vLLM's own default, which its command line turns to spawn; the CPU build, which
        # spawns every child, is made to fork by the server (engine/serving.py). With tracing the
        # server sets up its exporter's threads before it starts the core, and a fork of those is
        # not what vLLM runs: spawn then.
        if is_cpu_build():
            env[ENGINE_CHILDREN_FORK_ENV] = "1"
            env.update(CPU_INDUCTOR_ENV)
        else:
            env["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    # vLLM's startup plan: the KV cache size its first start on this GPU type, configuration and
    # memory utilization (server_command) measured, kept under VLLM_CACHE_ROOT beside the compile
    # cache, is reused by the starts after it, which skip profiling the CUDA graphs' memory (0-10 s
    # of an 8B start on an H200). vLLM applies it only when the fingerprint matches and at least as
    # much memory is free as then; each start that profiles saves its own.
    env["VLLM_ENABLE_STARTUP_PLAN"] = "1"
    if config.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = config.gpu_ids
    env[WEIGHTS_DIR_ENV] = str(config.weights_dir)
    if weights_file is not None:
        env[WEIGHTS_FILE_ENV] = str(weights_file)
    if config.runs_kv_connector:
        env.update(KV_CONNECTOR_ENV)
    if config.otlp_traces_endpoint:  # vLLM's spans name their engine; gRPC, as the router's
        env.update(OTEL_SERVICE_NAME="pdcluster-engine", OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="grpc",
                   OTEL_RESOURCE_ATTRIBUTES=f"pdcluster.instance_id={instance_id},pdcluster.role={config.role.name}")
    if config.runs_nixl:  # its side channel (kv_transfer_config)
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port(host))
    return env
