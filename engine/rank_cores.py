"""CPU ranks share their cores: none is moved onto another's core, none spins waiting for work.

Two habits of vLLM's that suit a GPU server's many host cores starve an engine on a CPU server, where
every core computes. A vLLM general plugin (entry point `pdcluster_rank_cores`, named in every
engine's VLLM_PLUGINS) changes both in engines of ours (those started with their keys in their
environment) on the CPU build:

- vLLM's NixlConnector worker, when a rank creates it, pins the calling thread -- the rank's compute
  thread -- to the last core of each NUMA node (`current_platform.discover_numa_topology()`, meant
  as a core reserved for KV loads), whatever VLLM_CPU_OMP_THREADS_BIND said: every rank of every
  directly connected P/D engine on a node computed on that one core. The topology names no core
  here (vLLM uses it for nothing else, 0.26 and 0.32), so the binding stays as the host gave it.
- A tensor-parallel engine's processes pass work through vLLM's shared-memory message queue, whose
  reader spins (`sched_yield`) for a second after each message, longer than any gap between steps,
  so a TP engine's ranks and engine core spin from a request's first token to its last; only then
  does a reader wait on a notify socket, which drops notifications (vLLM rechecks every 5 s for
  that). Here the queue's readers never spin: they poll, rechecking every BUSY_RECHECK_MS for their
  first IDLE_AFTER_S of waiting and every IDLE_RECHECK_MS after, so a lost notification costs a
  millisecond within a step and at most IDLE_RECHECK_MS in a long wait, and an idle rank wakes 50
  times a second. (A writer still yields in a loop while the queue's ring is full.)
- vLLM's NixlConnector makes its NIXL agent in a rank's thread, whose UCX backend would start its
  progress thread on the rank's own core, where it takes the UCX worker's lock beside the rank's
  thread: the threads of agents made in an engine of ours start on all the engine's cores instead
  (transport/nixl.py `run_backend_threads_on`).
  docs/tensor-parallel.md has the measurements."""

from __future__ import annotations

import functools
import os
import time

from security.credentials import EngineKeys
from transport.nixl import run_backend_threads_on

BUSY_RECHECK_MS = 1
IDLE_AFTER_S = 0.1
IDLE_RECHECK_MS = 20


def no_core_reserved_for_kv_loads(cls) -> list[list[int]]:
    """`discover_numa_topology` as the NIXL worker reads it: no core to move the rank onto."""
    return []


def wait_without_spinning() -> None:
    """The message queue's readers poll from their first wait (no busy loop), at most BUSY_RECHECK_MS
    while they have waited under IDLE_AFTER_S for the next message, IDLE_RECHECK_MS after that."""
    from vllm.distributed.device_communicators import shm_broadcast

    spin_condition = shm_broadcast.SpinCondition
    spin_condition.__init__ = functools.partialmethod(spin_condition.__init__, busy_loop_s=0.0)
    read_timeout = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings
    vllm_timeout_ms = read_timeout.timeout_ms

    def timeout_ms(self) -> int:
        waited_s = time.monotonic() - self.started
        return min(vllm_timeout_ms(self), BUSY_RECHECK_MS if waited_s < IDLE_AFTER_S else IDLE_RECHECK_MS)

    read_timeout.timeout_ms = timeout_ms


def core_ranges(cores: str) -> list[tuple[int, int]]:
    """A core list of vLLM's binding ("0-3,5") as (first, last) ranges. ValueError for its words
    ("auto", "nobind")."""
    ranges = []
    for part in cores.split(","):
        first, _, last = part.partition("-")
        ranges.append((int(first), int(last or first)))
    return ranges


def bound_cores(binding: str) -> frozenset[int]:
    """The cores of this machine that vLLM's binding names ("0-3|4,5": ranks apart by "|")."""
    machine = os.cpu_count() or 1
    return frozenset(core for first, last in core_ranges(binding.replace("|", ","))
                     for core in range(first, min(last, machine - 1) + 1))


def register() -> None:
    """vLLM general plugin: loaded in each of an engine's processes before its workers are built."""
    from vllm.platforms import current_platform

    if EngineKeys.present() and current_platform.is_cpu():
        type(current_platform).discover_numa_topology = classmethod(no_core_reserved_for_kv_loads)
        wait_without_spinning()
        try:
            run_backend_threads_on(bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")))
        except ValueError:  # vLLM picks the cores: no engine's set to name
            pass
