"""How a fault run hurts a live cluster and reads what it did: an engine's whole process group
killed (or frozen) by its URL, and what the router reports afterwards (an engine's running
requests, migrations, the store's shards, its KV index). Used by loadtest/faults.py and the
end-to-end fault tests."""

from __future__ import annotations

import os
import signal
import time
from urllib.parse import urlparse

import httpx
import psutil

from loadtest.local_cluster import LocalServer
from loadtest.scrape import scrape
from security.credentials import ClusterCredentials


def kill_engine(url: str, signum: int = signal.SIGKILL) -> None:
    """SIGKILL the engine serving `url` as a lost machine would (SIGSTOP: as a frozen one would):
    the process listening on its port and the whole process group around it (server, engine
    core, worker, guard)."""
    os.killpg(engine_process_group(url), signum)


def engine_process_group(url: str) -> int:
    """The process group of the engine serving `url`. Finding it scans every process's sockets,
    which takes a busy machine a while: a test that must kill at a given moment finds it first."""
    port = urlparse(url).port
    # the socket is held by the server and the shell that guards its group (it was handed down),
    # and for a moment by any child the server forks: one that exits between the listing and
    # the lookup has no group to report. psutil finds a socket's process by scanning every
    # process's descriptors, and a busy machine's scan came back once with no owner at all (CI,
    # session 18): the scan is repeated until it names one.
    deadline = time.monotonic() + 10
    while True:
        holders = {c.pid for c in psutil.net_connections("tcp")
                   if c.status == "LISTEN" and c.laddr.port == port and c.pid}
        groups = {group for group in map(_process_group, holders) if group is not None}
        if groups or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not groups:
        raise RuntimeError(f"no process of ours listens on port {port}")
    (group,) = groups
    return group


def _process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def engine_running(server: LocalServer, instance_id: str) -> int | None:
    """Requests the engine is generating now (its vLLM metrics, relayed by the router); None when
    that is not known now: the router answered late, or the busy engine did not answer its relay
    in time (502; CI session 22)."""
    try:
        running = scrape(f"{server.url}/admin/engines/{instance_id}", ("vllm:num_requests_running",),
                         timeout_s=10, headers=server.credentials.admin_headers())
    except httpx.TimeoutException:
        return None
    except httpx.HTTPStatusError as error:
        if error.response.status_code != 502:
            raise
        return None
    return int(sum(running.values()))


def migrations(server: LocalServer) -> int:
    """Streams the router has continued on another instance so far (decode/stream_ledger.py)."""
    text = httpx.get(f"{server.url}/metrics", headers=server.credentials.admin_headers(), timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdcluster_router_migrations_total")))


def store_shards(url: str) -> list[dict]:
    admin = ClusterCredentials.load().admin_headers()
    return httpx.get(f"{url}/admin/store", headers=admin, timeout=10).json()["shards"]


def index_blocks(server: LocalServer) -> int:
    return sum(i["index_blocks"] for i in server.instances())
