"""loadtest.host_cpu: what pd_bench records of where the machine's CPU went, the input from which
the serving simulator takes an engine's share of its core (loadtest.pd_bench_predict)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadtest.host_cpu import HostCpu, HostCpuMeter

# A process titled as vLLM titles an engine core, which computes, reports its own CPU time, and
# does it again when told: pd_bench's engines were running (and had computed) before it measures.
STAND_IN_ENGINE = """
import sys, time, setproctitle
setproctitle.setproctitle("VLLM::EngineCore_StandIn")
for _ in range(2):
    end = time.monotonic() + 0.4
    while time.monotonic() < end:
        pass
    print(time.process_time(), flush=True)
    sys.stdin.readline()
"""


def test_an_engine_process_is_counted_for_what_it_computed_inside_the_measurement_only():
    engine = subprocess.Popen([sys.executable, "-c", STAND_IN_ENGINE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        before = float(engine.stdout.readline())  # its start and first burn: not to be counted
        with HostCpuMeter() as meter:
            engine.stdin.write("go\n")
            engine.stdin.flush()
            after = float(engine.stdout.readline())
        assert meter.engine_cpu_s[engine.pid] == pytest.approx(after - before, abs=0.05)
        assert after - before > 0.05  # it did compute inside
        assert meter.result.engine_cores * meter.result.wall_s >= meter.engine_cpu_s[engine.pid] - 1e-9
    finally:
        engine.communicate("\n", timeout=30)


def test_an_engines_share_of_its_core_is_what_the_others_leave_spread_over_every_core():
    assert HostCpu(10.0, engine_cores=1.6, other_cores=0.4, cores=2).engine_core_share == pytest.approx(0.8)
    assert HostCpu(10.0, engine_cores=0.0, other_cores=3.0, cores=2).engine_core_share == 0.0
