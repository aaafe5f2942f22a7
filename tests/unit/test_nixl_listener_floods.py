"""A stranger's floods at the TCP listeners of a process that has a vLLM worker's (docs/security.md,
attack 11.3): a UCX listener per NIXL agent, and one per torch.distributed gloo group and the
TCPStore, on the node's address, open to any local user (and on a cluster to its network's hosts).

Unguarded, the gloo listeners (15 of the 16 of vLLM 0.32's distributed state) and the UCX ones
that nothing progressed (NixlConnector's `num_threads` workers) leave each connection its client
closed in CLOSE-WAIT, and connect-and-close calls took a worker to its descriptor limit, where it
died; idle connections did the same through every UCX listener, the shard's too (UCX gives a peer
no deadline for its first message). transport/listener_warden.py guards the UCX listeners (ListenerWarden) and
seals the others once the process groups are made (seal_tcp_listeners)."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
from stranger import needs_stranger, run_as_stranger

from transport import listener_warden, nixl

pytestmark = pytest.mark.slow  # a process start (NIXL, torch, agents: ~8 s), then floods
HOLDER = Path(__file__).resolve().parents[1] / "nixl_holder.py"
NBYTES = 4 * 1024**2
CONNECT_AND_CLOSE = 50_000  # calls at each listener
IDLE = 20_000  # connections tried at each listener, by two stranger processes at once
FD_BOUND = 4096
"""Descriptors the holder may have above its calm count under a flood (its sealed listeners take
none): the silent connections its UCX listeners keep before they pause (SILENT_CAP, 512), the
connections the kernel completed for its 3 UCX listeners before the pause (3 x LISTEN_BACKLOG,
384), and what UCX accepts before the warden notices: in its TICK_S (20 ms) at the ~50,000 a
second a stranger opens here, ~1,000, and more while the warden waits for a core on a loaded
2-core machine (peaks of 1,000-1,800 measured). A fifth of the holder's 20,000 limit, where
unguarded each connection held, or closed into CLOSE-WAIT, kept one until the process died at that limit."""

FLOOD = """
import resource, select, socket, time
# A listener that took nothing in 10 batches running (3 s) is left: it takes no connection.
GIVE_UP_AFTER = 10

resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)


def connect_batch(port, count, wait_s=0.3):
    # Connections tried at once; those not connected within wait_s (a listener dropping what
    # arrives) are given up.
    pending = {}
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex((ARGS["host"], port))
        pending[sock.fileno()] = sock
    poller = select.poll()
    for fd in pending:
        poller.register(fd, select.POLLOUT)
    connected, deadline = [], time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            poller.unregister(fd)
            sock = pending.pop(fd)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                connected.append(sock)
            else:
                sock.close()
    for sock in pending.values():
        sock.close()
    return connected


results = []
for port in ARGS["ports"]:
    started, held, connected, empty = time.monotonic(), [], 0, 0
    for tried in range(0, ARGS["count"], 256):
        batch = connect_batch(port, min(256, ARGS["count"] - tried))
        connected += len(batch)
        empty = 0 if batch else empty + 1
        if empty == GIVE_UP_AFTER:
            break
        if ARGS["idle"]:
            held += batch
        else:
            for sock in batch:
                sock.close()
    time.sleep(ARGS["hold_s"])
    for sock in held:
        sock.close()
    results.append({"port": port, "tried": tried + 256, "connected": connected,
                    "seconds": round(time.monotonic() - started, 2)})
print(json.dumps({"results": results}))
"""


class Holder:
    """tests/nixl_holder.py, reading from a shard-like agent of this process."""

    def __init__(self) -> None:
        self.shard_memory = np.frombuffer(np.random.default_rng(2).bytes(NBYTES), dtype=np.uint8)
        self.shard = nixl.new_agent("pdc-store")
        self.shard.register_memory([(self.shard_memory.ctypes.data, NBYTES, 0, "")], "DRAM")
        metadata = base64.b64encode(self.shard.get_agent_metadata()).decode()
        self.process = subprocess.Popen(
            [sys.executable, str(HOLDER), metadata, str(self.shard_memory.ctypes.data), str(NBYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.offer = self._answer()

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"the holder exited ({self.process.wait()})")

    def ask(self, question: str) -> dict:
        self.process.stdin.write(f"{question}\n")
        self.process.stdin.flush()
        return self._answer()

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def sockets(self, status: str) -> list:
        return [c for c in psutil.Process(self.process.pid).net_connections("tcp") if c.status == status]

    def calm_descriptors(self, timeout_s: float = 10) -> int:
        """Its descriptor count once no connection of the floods is left (two readings alike)."""
        deadline, last = time.monotonic() + timeout_s, -1
        while time.monotonic() < deadline:
            count = self.descriptors()
            if count == last and not self.sockets(psutil.CONN_CLOSE_WAIT):
                return count
            last = count
            time.sleep(0.3)
        raise AssertionError(f"still {self.descriptors()} descriptors, "
                             f"{len(self.sockets(psutil.CONN_CLOSE_WAIT))} connections in CLOSE-WAIT")


class PeakDescriptors:
    """The most descriptors the holder had while the block ran, read every 5 ms."""

    def __init__(self, holder: Holder) -> None:
        self.holder, self.peak, self._done = holder, 0, threading.Event()

    def __enter__(self) -> PeakDescriptors:
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self.holder.descriptors())


def flood(ports: list[int], count: int, idle: bool, processes_each: int) -> list[dict]:
    """`count` connections tried at each port, by `processes_each` stranger processes per port, all
    ports at once; each closed at once, or (idle) held until its process has tried all of its own."""
    args = {"host": "127.0.0.1", "count": count // processes_each, "idle": idle, "hold_s": 0.5 if idle else 0}
    with concurrent.futures.ThreadPoolExecutor(len(ports) * processes_each) as pool:
        runs = [pool.submit(run_as_stranger, FLOOD, {**args, "ports": [port]}, 240)
                for port in ports for _ in range(processes_each)]
        return [result for run in runs for result in run.result()["results"]]


@pytest.fixture(scope="module")
def holder():
    holder = Holder()
    holder.listeners = sorted(c.laddr.port for c in holder.sockets(psutil.CONN_LISTEN))
    holder.ucx, holder.sealed = holder.offer["ucx_ports"], holder.offer["sealed_ports"]
    holder.calm = holder.calm_descriptors()
    yield holder
    holder.process.kill()
    holder.process.wait()


def landed_at(ports: list[int], landed: list[dict]) -> int:
    return sum(r["connected"] for r in landed if r["port"] in ports)


def assert_still_serving(holder: Holder) -> None:
    """Nothing of the flood left open; the same listeners; a new peer reads the weights; the
    connector's connection to its shard still carries reads; the gloo groups still reduce."""
    assert holder.calm_descriptors() <= holder.calm + 2
    assert sorted(c.laddr.port for c in holder.sockets(psutil.CONN_LISTEN)) == holder.listeners
    assert holder.ask("gloo")["all_reduced"]
    assert holder.ask("read")["crc"] == zlib.crc32(holder.shard_memory)
    fetched = np.zeros(NBYTES, dtype=np.uint8)
    reader = nixl.new_agent("pdc-fetch")
    registration = reader.register_memory([(fetched.ctypes.data, NBYTES, 0, "")], "DRAM")
    peer = nixl.add_peer(reader, base64.b64decode(holder.offer["weights"]))
    nixl.transfer(reader, "READ", [(fetched.ctypes.data, NBYTES)], [(holder.offer["address"], NBYTES)], peer, 20)
    reader.remove_remote_agent(peer)
    reader.deregister_memory(registration)
    assert zlib.crc32(fetched) == holder.offer["crc"]


def test_each_agent_of_a_worker_listens_once_and_the_rest_is_sealed(holder):
    """NixlConnector asks for 4 threads: NIXL would add a UCX worker (and listener) per thread,
    progressed only while it carries a transfer."""
    assert len(holder.ucx) == len(holder.offer["agents"])
    assert len(holder.sealed) >= 2  # the TCPStore and the gloo groups'
    assert sorted(holder.ucx + holder.sealed) == holder.listeners


@needs_stranger
def test_a_strangers_connect_and_close_calls_leave_nothing_open(holder):
    with PeakDescriptors(holder) as during:
        landed = flood(holder.listeners, CONNECT_AND_CLOSE, idle=False, processes_each=1)
    assert during.peak <= holder.calm + FD_BOUND, (during.peak - holder.calm, landed)
    assert landed_at(holder.ucx, landed) >= len(holder.ucx) * CONNECT_AND_CLOSE // 2, landed
    assert landed_at(holder.sealed, landed) == 0, landed
    assert_still_serving(holder)


@needs_stranger
def test_a_strangers_idle_connections_are_shed_and_capped(holder):
    with PeakDescriptors(holder) as during:
        landed = flood(holder.listeners, IDLE, idle=True, processes_each=2)
    assert during.peak <= holder.calm + FD_BOUND, (during.peak - holder.calm, landed)
    assert landed_at(holder.ucx, landed) >= len(holder.ucx) * listener_warden.SILENT_CAP, landed
    assert landed_at(holder.sealed, landed) == 0, landed
    assert holder.ask("warden")["shed"] >= len(holder.ucx) * listener_warden.SILENT_CAP
    assert_still_serving(holder)
