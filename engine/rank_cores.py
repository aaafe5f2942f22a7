"""Each CPU rank's compute stays on the cores its host bound it to, NIXL or not.

On the CPU build, vLLM's NixlConnector worker, when a rank creates it, pins the calling thread to
the last core of each NUMA node (`current_platform.discover_numa_topology()`, meant as a core
reserved for KV loads), and that thread is the rank's compute thread: whatever
VLLM_CPU_OMP_THREADS_BIND said, every rank of every directly connected P/D engine on a node then
computes on that one core (on a 2-core machine the prefill's and the decode's both on core 1, a
TP=2 engine's two ranks on one). vLLM uses that topology for nothing else (0.26, 0.32). A vLLM
general plugin (entry point `pdcluster_rank_cores`, named in every engine's VLLM_PLUGINS) has it
name no core in engines of ours (those started with their keys in their environment): the
connector then leaves the thread's binding as it was. On a CPU server of several NUMA nodes that
gives up the core vLLM meant for KV loads: a rank's loads run on its own cores, as its compute does."""

from __future__ import annotations

from security.credentials import EngineKeys


def no_core_reserved_for_kv_loads(cls) -> list[list[int]]:
    """`discover_numa_topology` as the NIXL worker reads it: no core to move the rank onto."""
    return []


def register() -> None:
    """vLLM general plugin: loaded in each of an engine's processes before its workers are built."""
    from vllm.platforms import current_platform

    if EngineKeys.present() and current_platform.is_cpu():
        type(current_platform).discover_numa_topology = classmethod(no_core_reserved_for_kv_loads)
