"""CPU ranks share their cores: none is moved onto another's core, none spins while it waits.

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
  reader spins (`sched_yield`) for a second after each message before it waits on a notify
  socket, and a woken reader misses about every other notification (it then sleeps out a 5 s
  recheck). A prefill engine holding a prompt's KV for NIXL reads steps every millisecond, so its
  ranks spun without pause and starved the decode engine (P/D direct at TP=2 hung); a decoding
  TP=2 engine's ranks spun beside its own engine core. Here readers never spin and recheck the
  queue every millisecond while work flows (IDLE_AFTER_S), then every IDLE_RECHECK_MS: a missed
  notification costs at most a millisecond of a busy engine, an idle rank wakes 50 times a second.
  docs/tensor-parallel.md has the measurements."""

from __future__ import annotations

import time

from security.credentials import EngineKeys

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

    shm_broadcast.SpinCondition.__init__.__defaults__ = (0.0,)  # busy_loop_s, which vLLM never passes
    read_timeout = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings
    vllm_timeout_ms = read_timeout.timeout_ms

    def timeout_ms(self) -> int:
        waited_s = time.monotonic() - self.started
        return min(vllm_timeout_ms(self), BUSY_RECHECK_MS if waited_s < IDLE_AFTER_S else IDLE_RECHECK_MS)

    read_timeout.timeout_ms = timeout_ms


def register() -> None:
    """vLLM general plugin: loaded in each of an engine's processes before its workers are built."""
    from vllm.platforms import current_platform

    if EngineKeys.present() and current_platform.is_cpu():
        type(current_platform).discover_numa_topology = classmethod(no_core_reserved_for_kv_loads)
        wait_without_spinning()
