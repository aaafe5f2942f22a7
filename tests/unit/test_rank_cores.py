"""CPU ranks share their cores (engine/rank_cores.py): in a directly connected P/D engine a rank's
compute stays where the host bound it (vLLM's NixlConnector worker moves the thread that creates it
onto the cores `discover_numa_topology` names, the last of each NUMA node), a rank waiting for
work on vLLM's message queue does not spin on a core its peers compute on, and the threads a rank's
NIXL agent starts do not share the rank's one core with it (transport/nixl.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition
from vllm.platforms import current_platform
from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

from decode.role import DECODE
from engine.config import EngineConfig
from engine.environment import RANK_CORES_PLUGIN, is_cpu_build
from engine.rank_cores import BUSY_RECHECK_MS, IDLE_RECHECK_MS
from engine.server_command import rank_cores_plugin_installed, server_env
from security.credentials import ClusterCredentials
from transport import nixl

pytestmark = pytest.mark.skipif(not is_cpu_build(), reason="the plugin changes vLLM on the CPU build only")


@pytest.fixture
def in_an_engine_of_ours(tmp_path, monkeypatch):
    """This process as one of an engine's, with the plugin loaded as vLLM loads it there; what the
    plugin changes in vLLM is put back afterwards."""
    platform = type(current_platform)
    monkeypatch.setattr(platform, "discover_numa_topology", platform.discover_numa_topology)
    monkeypatch.setattr(SpinCondition, "__init__", SpinCondition.__init__)
    read_timeout = MessageQueue.ReadTimeoutWithWarnings
    monkeypatch.setattr(read_timeout, "timeout_ms", read_timeout.timeout_ms)
    (tmp_path / "config.json").write_text("{}")
    config = EngineConfig(model=tmp_path, served_model_name="m", role=DECODE, cpu_cores="0")
    keys = ClusterCredentials.generate().engine_host_keys("decode-0").new_process("127.0.0.1")
    monkeypatch.setattr(os, "environ", server_env(config, "127.0.0.1", "decode-0", keys, None))
    assert rank_cores_plugin_installed()  # what a host checks before it starts such an engine
    return lambda: load_plugins_by_group(DEFAULT_PLUGINS_GROUP)[RANK_CORES_PLUGIN]()


def test_a_direct_pd_engine_of_ours_reserves_no_core_for_nixl(in_an_engine_of_ours):
    assert current_platform.discover_numa_topology()  # vLLM's: this machine's last core, NIXL's pick
    in_an_engine_of_ours()
    assert current_platform.discover_numa_topology() == []  # the NIXL worker then moves no thread


class ReaderWait:
    """A rank's read of vLLM's message queue while its writer is quiet for a while and then writes
    without a notification (the notify socket drops some): how often the reader gave up its core to
    spin (`sched_yield`), the timeout of each poll it slept in, and what it read."""

    def __init__(self, quiet_s: float, monkeypatch):
        self.yields, self.poll_timeouts, self.received = 0, [], []
        monkeypatch.setattr(shm_broadcast, "sched_yield", self.count_yield)
        writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=2)
        reader = MessageQueue.create_from_handle(writer.export_handle(), rank=0)
        ready = threading.Thread(target=reader.wait_until_ready)
        ready.start()
        writer.wait_until_ready()
        ready.join(timeout=30)
        writer.enqueue("first")
        assert reader.dequeue(timeout=30) == "first"
        self.yields = 0
        poll = reader._spin_condition.poller.poll
        monkeypatch.setattr(reader._spin_condition.poller, "poll", lambda timeout: self.poll(poll, timeout))
        monkeypatch.setattr(writer._spin_condition, "notify", lambda: None)
        waiting = threading.Thread(target=lambda: self.received.append(reader.dequeue(timeout=30)))
        waiting.start()
        time.sleep(quiet_s)
        writer.enqueue("second")
        waiting.join(timeout=30)

    def count_yield(self) -> None:
        self.yields += 1

    def poll(self, poll, timeout: int):
        self.poll_timeouts.append(timeout)
        return poll(timeout)


def test_a_rank_of_ours_waits_for_work_without_spinning(in_an_engine_of_ours, monkeypatch):
    vllms = ReaderWait(0.5, monkeypatch)
    assert vllms.received == ["second"]
    assert vllms.yields > 100 and not vllms.poll_timeouts  # vLLM's reader spins a second after each message
    in_an_engine_of_ours()
    ours = ReaderWait(0.5, monkeypatch)
    assert ours.received == ["second"]  # read though its notification was lost
    assert ours.yields == 0
    assert set(ours.poll_timeouts) == {BUSY_RECHECK_MS, IDLE_RECHECK_MS}  # a millisecond first, then idle rechecks
    assert ours.poll_timeouts == sorted(ours.poll_timeouts)


def test_the_threads_a_ranks_nixl_agent_starts_run_on_its_engines_cores(in_an_engine_of_ours, monkeypatch):
    """A rank's thread bound to its one core makes a NIXL agent, as vLLM's NixlConnector does: the
    threads its UCX backend starts (NIXL's progress thread; UCX's async thread, where it is the
    process's first) run on every core of the engine, so a progress thread looping under the UCX
    worker's spinlock never holds the one core the rank's thread needs to take that lock (the stalled
    first KV reads of P/D direct at TP=2); the rank's thread keeps its core."""
    engine_cores = os.sched_getaffinity(0)
    assert len(engine_cores) >= 2, "a machine of two cores at least (CI's has two)"
    rank_core = min(engine_cores)
    monkeypatch.setattr(nixl, "_backend_thread_cores", None)  # and back after the test
    load_plugin = in_an_engine_of_ours
    monkeypatch.setitem(os.environ, "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in sorted(engine_cores)))
    load_plugin()
    made: dict[str, set[int]] = {}

    def rank():
        os.sched_setaffinity(0, {rank_core})  # this thread's only: pytest's keeps its cores
        threads = set(os.listdir("/proc/self/task"))
        agent = nixl.new_agent("pdc-rank")
        made.update({tid: os.sched_getaffinity(int(tid)) for tid in set(os.listdir("/proc/self/task")) - threads})
        made["rank"] = os.sched_getaffinity(0)
        del agent

    thread = threading.Thread(target=rank)
    thread.start()
    thread.join(timeout=60)
    assert made.pop("rank") == {rank_core}
    assert made and all(cores == engine_cores for cores in made.values()), made
