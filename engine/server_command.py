"""The vLLM OpenAI server command an engine of ours runs (its imports done ahead,
engine/preimport.py): dummy weights (the weight plane fills them), our worker extension, HTTP
middleware and logits processor, KV events to the router, and the role's KV connector."""

from __future__ import annotations

import importlib.metadata
import json
import sys

from engine.config import EngineConfig
from engine.environment import GRAMMAR_LOGITS_PROCESSOR, KV_EVENTS_PLUGIN, is_cpu_build

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""vLLM's OpenAI server, run by engine/preimport.py once its imports are done and it is told to."""
KV_EVENTS_PLUGIN_TARGET = "engine.kv_events:register"
"""What the entry point KV_EVENTS_PLUGIN names (pyproject.toml)."""


def kv_events_plugin_installed() -> bool:
    """Whether vLLM will find our KV event publisher (engine/kv_events.py) in the engine's
    processes. Without it vLLM falls back, silently, to its plain publisher, whose replay socket
    sends every buffered batch, token ids included, to anyone who reaches it: an engine with KV
    events must not start then."""
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(p.name == KV_EVENTS_PLUGIN and p.value == KV_EVENTS_PLUGIN_TARGET for p in plugins)


def server_command(config: EngineConfig, host: str, port: int, instance_id: str,
                   kv_events_endpoint: str | None, kv_events_replay_endpoint: str | None) -> list[str]:
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
        "--load-format", "dummy",
        "--worker-extension-cls", "engine.worker_extension.WeightPlaneExtension",
        "--middleware", "engine.http_auth.EngineAuthMiddleware",
        "--logits-processors", GRAMMAR_LOGITS_PROCESSOR,
    ]
    if c.enforce_eager:
        command.append("--enforce-eager")
    if c.sleep_mode:
        command.append("--enable-sleep-mode")
    if c.dtype != "auto":
        command += ["--dtype", c.dtype]
    if kv_events_endpoint:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": instance_id,
            "endpoint": kv_events_endpoint,
            "replay_endpoint": kv_events_replay_endpoint,
        }
        command += ["--kv-events-config", json.dumps(events)]
    if c.role.kv_transfer:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config(c))]
    if c.otlp_traces_endpoint:
        command += ["--otlp-traces-endpoint", c.otlp_traces_endpoint]
    return command + list(c.role.vllm_args) + list(c.extra_args)


def kv_transfer_config(config: EngineConfig) -> dict:
    """With a store: our StoreConnector (kvstore/), every instance saving the prompts it
    computes and loading what the store holds. Without: vLLM's NixlConnector, the decode
    instance reading the prefill's blocks one-sided over UCX. Either way a failed load is
    recomputed, never an error."""
    shared = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    if config.kv_store_endpoints:
        return {**shared, "kv_connector": "StoreConnector", "kv_connector_module_path": "kvstore.connector",
                "kv_connector_extra_config": {"endpoints": list(config.kv_store_endpoints),
                                              "timeout_s": config.kv_store_timeout_s}}
    return {**shared, "kv_connector": "NixlConnector", "kv_buffer_device": "cpu" if is_cpu_build() else "cuda"}
