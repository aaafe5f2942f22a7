"""loadtest.host_cpu: what pd_bench records of where the machine's CPU went, the input from which
the serving simulator takes an engine's share of its core (loadtest.pd_bench_predict)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadtest.host_cpu import HostCpu, HostCpuMeter

# A process titled as vLLM titles its engine processes, which computes, reports its own CPU time and
# stays alive until told (a process that ended inside the measurement is not counted).
STAND_IN_ENGINE = """
import sys, time, setproctitle
setproctitle.setproctitle("VLLM::StandInEngine")
end = time.monotonic() + 0.6
while time.monotonic() < end:
    pass
print(time.process_time(), flush=True)
sys.stdin.read()
"""


def test_an_engine_processes_cpu_is_told_apart_from_everyone_elses():
    with HostCpuMeter() as meter:
        engine = subprocess.Popen([sys.executable, "-c", STAND_IN_ENGINE], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        engine_cpu_s = float(engine.stdout.readline())
    engine.communicate(timeout=30)
    used = meter.result
    assert used.engine_cores * used.wall_s == pytest.approx(engine_cpu_s, abs=0.05)
    assert used.other_cores * used.wall_s >= 0.0 and used.cores >= 1


def test_an_engines_share_of_its_core_is_what_the_others_leave_spread_over_every_core():
    assert HostCpu(10.0, engine_cores=1.6, other_cores=0.4, cores=2).engine_core_share == pytest.approx(0.8)
    assert HostCpu(10.0, engine_cores=0.0, other_cores=3.0, cores=2).engine_core_share == 0.0
