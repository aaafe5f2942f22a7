"""Where a machine's CPU went during a load test: vLLM's engine processes against everything else
(the router, the load generator, the engines' API servers, Ray), read from /proc (Linux).

On a CPU machine whose engines each hold a core, what the other processes take is compute the
engines lose: `engine_core_share` is the share of its core an engine's steps get, which the
serving simulator takes as a stated input (`loadtest.pd_bench_predict --core-share`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

# vLLM names its processes by setproctitle: these two compute (the engine core, its CPU workers);
# its API servers and data-parallel coordinator, also "VLLM::", count with the others.
ENGINE_TITLES = (b"VLLM::EngineCore", b"VLLM::Worker")


def _machine_cpu_s() -> float:
    """CPU seconds spent by the machine's processes (/proc/stat's first line: idle, iowait and the
    hypervisor's steal left out)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _engine_cpu_s() -> dict[int, float]:
    """CPU seconds of every live vLLM engine process, by pid."""
    seconds = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().startswith(ENGINE_TITLES):
                continue
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended while read
            continue
        seconds[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


@dataclasses.dataclass(frozen=True)
class HostCpu:
    """Cores used on average between two readings: by vLLM's engine processes, by all others."""

    wall_s: float
    engine_cores: float
    other_cores: float
    cores: int

    @property
    def engine_core_share(self) -> float:
        """The share of a core left to an engine's steps where the engines hold every core, one
        each (pd_bench: two engines, two cores): the others' use spread over all of them (they run
        where the kernel puts them)."""
        return max(0.0, 1.0 - self.other_cores / self.cores)


class HostCpuMeter:
    """`with HostCpuMeter() as meter: ...` then `meter.result` (a HostCpu over the block)."""

    def __enter__(self) -> HostCpuMeter:
        self._start = (time.monotonic(), _machine_cpu_s(), _engine_cpu_s())
        self.result: HostCpu | None = None
        self.engine_cpu_s: dict[int, float] = {}  # each engine process's CPU seconds in the block
        return self

    def __exit__(self, *exc) -> None:
        started, machine, engines = self._start
        wall = max(time.monotonic() - started, 1e-9)
        # An engine process that ended inside the block is missed; one started inside it counts whole.
        self.engine_cpu_s = {pid: s - engines.get(pid, 0.0) for pid, s in _engine_cpu_s().items()}
        engine_s = sum(self.engine_cpu_s.values())
        other_s = max(_machine_cpu_s() - machine - engine_s, 0.0)
        self.result = HostCpu(wall, engine_s / wall, other_s / wall, os.cpu_count() or 1)
