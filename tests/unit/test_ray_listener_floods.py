"""Ray's listeners under a stranger's floods (issue 31: every listener survives 50,000
connect-and-close calls and 20,000 idle connections from a stranger with its fd count bounded,
and still serves).

A head as the YAMLs and `RayHead` start it (`ray start`, token auth, private temp dir), a named
actor (a worker's gRPC listener), and another local user with no credential flooding the GCS,
the raylet's node manager and the actor's listener (tests/flood.py): 50,000 connect-and-close
calls, then 20,000 idle connections that send nothing, from 2 processes (this machine allows
20,000 descriptors a process, stranger's and Ray's alike, and not more: not even root may raise
it here). The Ray
driver that checks serving (a call to the actor, a put and get, a new actor in a new worker
process) runs in a process of its own: a driver whose raylet dies exits.

What holds: after each connect-and-close flood the process's descriptors are back to what they
were and Ray serves. During one they are not bounded: gRPC closes connections later than it
accepts them (peaks of 4,000-19,900 here, of a 20,000 limit; the object manager and a worker
reached it). A worker held at its limit by idle connections still serves its callers.

What does not (strict xfails, `RayGapStillOpen`): Ray's gRPC servers (C++ gRPC ~1.57 in Ray
2.60) accept every connection and keep one that never speaks HTTP/2 for as long as the client
does (200 held 150 s: none closed), with no cap on their number; Ray sets only message sizes,
keepalive and ping settings on them and takes no other server option, and this gRPC has no
`grpc.max_allowed_incoming_connections`. So 20,000 idle connections hold a process at its
descriptor limit: at the GCS, no new worker can register (a new actor fails while they stay; one
took ~60 s after they went); at the raylet, no new worker starts (a new actor fails), and when
the raylet starts one without a runtime env it aborts ("Too many workers, failed to create a
file", worker_pool.cc) and the node dies. Raising the limit (deploy/ray_head.py
`raise_fd_limit`, the YAMLs' `ulimit -n`) moves that cliff; it does not bound the count.
The full counts fit: 1:40-2:00 on this 2-core machine when no other flood shares it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from flood import connect_and_close, idle_connections, open_descriptors
from stranger import needs_stranger

from loadtest.local_cluster import RayHead

pytestmark = [pytest.mark.slow, needs_stranger]

REPO = Path(__file__).resolve().parents[2]
CHURN_CALLS = 50_000
IDLE_CONNECTIONS = 20_000
FD_SLACK = 50
"""Descriptors a process may hold past its count before a flood once the flood is over."""


class RayGapStillOpen(AssertionError):
    """A requirement Ray 2.60 does not meet (the module docstring says why)."""


# The Ray driver, in a process of its own: makes the actor, then answers each line it reads (a
# timeout in seconds) with what served: a call to the actor, a put and get, a new actor in a new
# worker process (as each engine and shard pdcluster starts is).
DRIVER_SCRIPT = """
import json, os, sys, time
import ray

ray.init(address=sys.argv[1], namespace="pdc-listener-floods", log_to_driver=False)

@ray.remote(num_cpus=0)
class Echo:
    def pid(self):
        return os.getpid()

    def echo(self, value):
        return value

def attempt(check, timeout):
    try:
        return bool(check(timeout))
    except Exception as exc:
        return type(exc).__name__

def new_actor(timeout):
    # An environment of its own: a new worker process, never one of the pool's idle ones.
    fresh = Echo.options(runtime_env={"env_vars": {"PDC_FRESH_WORKER": str(time.time_ns())}}).remote()
    try:
        return ray.get(fresh.echo.remote(2), timeout=timeout) == 2
    finally:
        ray.kill(fresh)

echo = Echo.options(name="echo").remote()
print(json.dumps({"actor_pid": ray.get(echo.pid.remote(), timeout=120)}), flush=True)
for line in sys.stdin:
    timeout = float(line)
    started = time.monotonic()
    served = {"actor_call": attempt(lambda t: ray.get(echo.echo.remote(1), timeout=t) == 1, timeout),
              "put_get": attempt(lambda t: ray.get(ray.put(b"x" * 4096), timeout=t) == b"x" * 4096, timeout),
              "new_actor": attempt(new_actor, timeout)}
    served["seconds"] = round(time.monotonic() - started, 2)
    print(json.dumps(served), flush=True)
"""


class Driver:
    """The Ray driver process (DRIVER_SCRIPT)."""

    def __init__(self, address: str):
        self.process = subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, address], cwd=REPO, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy())
        started = self.process.stdout.readline()
        if not started:
            raise RuntimeError(f"the Ray driver exited ({self.process.wait()})")
        self.actor_pid = json.loads(started)["actor_pid"]

    def serves(self, timeout_s: float = 30) -> dict:
        """What served (True, or the error's name); {"driver": "exited"} if the driver died."""
        try:
            self.process.stdin.write(f"{timeout_s}\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            return {"driver": "exited"}
        line = self.process.stdout.readline()
        return json.loads(line) if line else {"driver": "exited"}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def listening_pid(port: int) -> int:
    (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    return pid


def actor_port(pid: int) -> int:
    (port,) = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN"}
    return port


class FdPeak:
    """The most descriptors `pid` held while in use, sampled every 0.2 s."""

    def __init__(self, pid: int):
        self.process, self.peak, self._done = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            try:
                self.peak = max(self.peak, self.process.num_fds())
            except psutil.Error:  # it died
                return
            time.sleep(0.2)

    def __enter__(self) -> FdPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fds_back(pid: int, baseline: int, within_s: float = 15) -> int:
    """`pid`'s descriptor count once back within FD_SLACK of `baseline` (or at `within_s`)."""
    deadline = time.monotonic() + within_s
    while (count := open_descriptors(pid)) > baseline + FD_SLACK and time.monotonic() < deadline:
        time.sleep(0.2)
    return count


@pytest.fixture(scope="module")
def cluster(artifacts):
    """The head, the driver and its actor, and where each flood's numbers are kept."""
    results: dict[str, dict] = {}
    with RayHead(num_cpus=2) as head:
        driver = Driver(head.address)
        try:
            yield head, driver, results
        finally:
            driver.close()
            artifacts.mkdir(parents=True, exist_ok=True)
            (artifacts / "ray-listener-floods.json").write_text(json.dumps(results, indent=1))


def _targets(head: RayHead, driver: Driver) -> dict[str, tuple[int, int]]:
    """Listener name: (port, pid of the process behind it)."""
    gcs, raylet = head.ports["--port"], head.ports["--node-manager-port"]
    return {"gcs": (gcs, listening_pid(gcs)), "raylet": (raylet, listening_pid(raylet)),
            "worker": (actor_port(driver.actor_pid), driver.actor_pid)}


SERVED = {"actor_call": True, "put_get": True, "new_actor": True}


def _served(result: dict) -> dict:
    return {key: result.get(key) for key in SERVED}


def _idle(port: int):
    """The stranger's IDLE_CONNECTIONS connections at `port`, silent, held while the block runs."""
    return idle_connections(port, IDLE_CONNECTIONS, send="")


@pytest.mark.parametrize("listener", ["gcs", "raylet", "worker"])
def test_connect_and_close_floods_leave_fds_where_they_were_and_ray_serving(cluster, listener):
    head, driver, results = cluster
    port, pid = _targets(head, driver)[listener]
    before = open_descriptors(pid)
    with FdPeak(pid) as peak:
        flood = connect_and_close(port, CHURN_CALLS)
    after = fds_back(pid, before)
    served = driver.serves()
    results[f"{listener} connect-and-close"] = {"port": port, "flood": flood, "fds_before": before,
                                               "fds_peak": peak.peak, "fds_after": after,
                                               "served_after": served}
    assert flood["refused"] == 0  # every call reached the listener
    assert _alive(pid) and after <= before + FD_SLACK
    assert _served(served) == SERVED


def test_idle_connections_at_a_worker_leave_it_serving(cluster):
    head, driver, results = cluster
    port, pid = _targets(head, driver)["worker"]
    before = open_descriptors(pid)
    with _idle(port) as idle:
        during_fds = open_descriptors(pid)
        served_during = driver.serves()
    after = fds_back(pid, before)
    served_after = driver.serves()
    results["worker idle"] = {"port": port, "flood": idle, "fds_before": before, "fds_during": during_fds,
                              "fds_after": after, "served_during": served_during,
                              "served_after": served_after}
    assert idle["opened"] == IDLE_CONNECTIONS
    assert _served(served_during) == SERVED and _served(served_after) == SERVED
    assert after <= before + FD_SLACK


@pytest.mark.xfail(raises=RayGapStillOpen, strict=True,
                   reason="Ray's gRPC servers keep every idle connection, uncapped (module docstring)")
def test_idle_connections_at_the_gcs_leave_it_starting_workers(cluster):
    head, driver, results = cluster
    port, pid = _targets(head, driver)["gcs"]
    before = open_descriptors(pid)
    with _idle(port) as idle:
        during_fds = open_descriptors(pid)
        served_during = driver.serves(timeout_s=10)
    after = fds_back(pid, before)
    results["gcs idle"] = {"port": port, "flood": idle, "fds_before": before, "fds_during": during_fds,
                           "fds_after": after, "served_during": served_during}
    # What holds: the calls on connections already open, and the descriptors given back.
    assert served_during["actor_call"] is True and served_during["put_get"] is True
    assert _alive(pid) and after <= before + FD_SLACK
    if served_during["new_actor"] is not True:
        raise RayGapStillOpen(f"no new actor while {idle['opened']} idle connections held the GCS at "
                              f"{during_fds} descriptors: {served_during['new_actor']}")


@pytest.mark.xfail(raises=RayGapStillOpen, strict=True,
                   reason="no worker starts while the raylet is at its descriptor limit (module docstring)")
def test_idle_connections_at_the_raylet_leave_it_alive_and_starting_workers(cluster):
    """Last: the raylet it floods may abort (and the head with it)."""
    head, driver, results = cluster
    port, pid = _targets(head, driver)["raylet"]
    before = open_descriptors(pid)
    with _idle(port) as idle:
        during_fds = open_descriptors(pid)
        served_during = driver.serves(timeout_s=10)
        raylet_alive = _alive(pid)
    results["raylet idle"] = {"port": port, "flood": idle, "fds_before": before, "fds_during": during_fds,
                              "served_during": served_during, "raylet_alive": raylet_alive}
    if not raylet_alive or _served(served_during) != SERVED:
        raise RayGapStillOpen(f"{idle['opened']} idle connections held the raylet at {during_fds} "
                              f"descriptors: alive {raylet_alive}, served {served_during}")
