"""vLLM's compile cache key, without the settings that differ engine to engine.

vLLM keys its torch.compile cache by every vLLM setting but a short list (`vllm.envs.compile_factors`).
Two that a host sets per engine are not on that list, in 0.26 (the GPU build) nor in 0.32 (the CPU
build): the NIXL side channel's port, picked free at each start of a directly connected P/D engine
(engine/server_command.py), and the cores a CPU engine's threads are bound to. With them in the key
every such start compiled again, and the compile a node installs from a peer (engine/node_caches.py)
was never read. The port shapes no graph: it is left out. Of the cores, only how many each rank has
may (Inductor's CPU code tunes its loops to the thread count, correct at any count): the key holds
that count instead of which cores. A vLLM general plugin (entry point `pdcluster_compile_key`, named
in every engine's VLLM_PLUGINS) does this in engines of ours only (those started with their keys in
their environment)."""

from __future__ import annotations

import functools

import vllm.envs

from engine.rank_cores import core_ranges
from security.credentials import EngineKeys

PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
CORES = "VLLM_CPU_OMP_THREADS_BIND"


def factors_without_per_engine_settings(compile_factors):
    """`compile_factors` (vLLM's) without the port, and with the cores each rank has counted."""

    @functools.wraps(compile_factors)
    def factors() -> dict[str, object]:
        kept = {name: value for name, value in compile_factors().items() if name != PORT}
        if isinstance(kept.get(CORES), str):
            kept[CORES] = cores_per_rank(kept[CORES])
        return kept

    factors.pdcluster_wrapped = True
    return factors


def cores_per_rank(binding: str) -> str:
    """vLLM's binding ("0-3|4,5": ranks apart by "|", cores as lists and ranges) as the number of
    distinct cores of each rank, as many threads as vLLM runs there ("4|2"); its words ("auto",
    "nobind") as they are."""
    try:
        return "|".join(str(_distinct(rank)) for rank in binding.split("|"))
    except ValueError:
        return binding


def _distinct(rank: str) -> int:
    """The cores a rank's list ("0-3,2-5") names, each once (its ranges merged, not expanded)."""
    ranges = sorted(core_ranges(rank))
    count, end = 0, -1
    for first, last in ranges:
        count += max(0, last - max(first, end + 1) + 1)
        end = max(end, last)
    return count


def register() -> None:
    """vLLM general plugin: vLLM loads it in each of an engine's processes before any compile, and
    reads `vllm.envs.compile_factors` through the module at each use."""
    if EngineKeys.present() and not getattr(vllm.envs.compile_factors, "pdcluster_wrapped", False):
        vllm.envs.compile_factors = factors_without_per_engine_settings(vllm.envs.compile_factors)
