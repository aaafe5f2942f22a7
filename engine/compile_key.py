"""vLLM's compile cache key, without the settings that differ engine to engine.

vLLM keys its torch.compile cache by every vLLM setting but a short list (`vllm.envs.compile_factors`).
Two that a host sets per engine are not on that list, in 0.26 (the GPU build) nor in 0.32 (the CPU
build): the NIXL side channel's port, picked free at each start of a directly connected P/D engine
(engine/server_command.py), and the cores a CPU engine's threads are bound to. Neither shapes a
compiled graph, yet with them in the key every such start compiled again, and the compile a node
installs from a peer (engine/node_caches.py) was never read. A vLLM general plugin (entry point
`pdcluster_compile_key`, named in every engine's VLLM_PLUGINS) leaves them out, in engines of ours
only (those started with their keys in their environment)."""

from __future__ import annotations

import functools

import vllm.envs

from security.credentials import EngineKeys

PER_ENGINE_SETTINGS = frozenset({"VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_CPU_OMP_THREADS_BIND"})
"""What a host sets apart for each engine and no compiled graph depends on."""


def factors_without_per_engine_settings(compile_factors):
    """`compile_factors` (vLLM's) without PER_ENGINE_SETTINGS."""

    @functools.wraps(compile_factors)
    def factors() -> dict[str, object]:
        return {name: value for name, value in compile_factors().items() if name not in PER_ENGINE_SETTINGS}

    factors.pdcluster_wrapped = True
    return factors


def register() -> None:
    """vLLM general plugin: vLLM loads it in each of an engine's processes before any compile, and
    reads `vllm.envs.compile_factors` through the module at each use."""
    if EngineKeys.present() and not getattr(vllm.envs.compile_factors, "pdcluster_wrapped", False):
        vllm.envs.compile_factors = factors_without_per_engine_settings(vllm.envs.compile_factors)
