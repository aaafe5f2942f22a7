"""One-sided NIXL transfers (UCX backend: RDMA on clusters, TCP or shared memory here), bounded by
a deadline. Shared by the weight plane (engine/weights.py) and the KV store (kvstore/)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Sequence

from transport.listener_warden import watched_listeners

Extent = tuple[int, int]  # (address, bytes)
PIECE_BYTES = 64 * 1024**2  # several requests in flight on UCX's lanes


class NixlTransferError(RuntimeError):
    """A transfer failed, timed out, or its peer could not be reached."""


class NixlTimeoutError(NixlTransferError):
    """A transfer still in flight at its deadline."""


# NIXL's Python API (nixl._api.nixl_agent) starts UCX's progress thread with no delay between
# polls, so every agent spins a core even when idle (measured: 1.0 CPU-second per second; on a
# 2-core machine with a shard and two engines, most of the machine). With a delay the thread waits
# on UCX's event fd between events instead: 0.03 CPU-s/s idle, and loopback reads ran 2x faster
# (loadtest.store_bench, docs/pd.md). The thread stays: a shard's UCX worker must progress to
# serve one-sided reads over TCP (with no thread, transfers to it time out).
PROGRESS_THREAD_DELAY_US = 100

# A CPU rank computes on its own core(s), and vLLM's NixlConnector makes its agent in the rank's
# thread: NIXL's progress thread would inherit those cores and take the UCX worker's spinlock there
# beside the rank's thread (which takes it to poll its reads). While the progress thread loops, as it
# does while a new connection settles, on one core the thread spinning for the lock holds the core
# the holder needs (docs/tensor-parallel.md). None: the threads inherit the making thread's cores.
_backend_thread_cores: frozenset[int] | None = None


def run_backend_threads_on(cores: Iterable[int]) -> None:
    """Start the threads of the UCX backends this process's NIXL agents make from now on (NIXL's
    progress thread, UCX's async thread) on `cores` (a whole engine's), whatever cores the thread
    that makes the agent (one rank's) runs on."""
    global _backend_thread_cores
    _backend_thread_cores = frozenset(cores)


def quiet_progress_threads() -> None:
    """Make every NIXL agent created in this process from now on (ours and vLLM's NixlConnector
    alike) use PROGRESS_THREAD_DELAY_US, whatever the Python API sets; and keep every one of its
    UCX workers progressed and their TCP listeners watched (`_guarded_agent_type`)."""
    from nixl import _api

    config_type = _api.nixlBind.nixlAgentConfig
    if getattr(config_type, "pdcluster_quiet", False):
        return

    class QuietAgentConfig(config_type):
        pdcluster_quiet = True

        def __setattr__(self, name, value):
            if name == "pthrDelay":
                value = PROGRESS_THREAD_DELAY_US
            elif name == "useProgThread":  # a UCX worker nobody progresses never closes a connection
                value = True
            super().__setattr__(name, value)

    _api.nixlBind.nixlAgentConfig = QuietAgentConfig
    _api.nixlBind.nixlAgent = _guarded_agent_type(_api.nixlBind.nixlAgent)


def _guarded_agent_type(agent_type):
    """NIXL's native agent, its UCX backends made with every UCX worker progressed and their TCP
    listeners handed to the warden.

    Each UCX worker has a TCP listener (UCT's TCP interface, on the node's address: 127.0.0.1
    here) that accepts anyone; an accepted connection is read, and closed once its peer left, only
    when that worker is progressed. With `num_threads` (vLLM's NixlConnector asks for 4) NIXL's
    UCX backend adds one "dedicated" worker per thread, progressed only while it carries a
    transfer: an idle one never reads its accepted connections, and each its client closed stays in
    CLOSE-WAIT holding a descriptor (1,000 connect-and-close calls: 1,000 more, for each of the 4),
    until a stranger's calls take the process to its descriptor limit (docs/security.md, attack
    11.3). Without them every worker is one the progress thread polls."""

    class GuardedAgent(agent_type):
        def createBackend(self, backend, params):
            params = dict(params)
            if backend == "UCX":
                params.pop("num_threads", None)
            own_cores = os.sched_getaffinity(0)  # this thread's: the threads it starts inherit them
            if _backend_thread_cores is not None:
                os.sched_setaffinity(0, _backend_thread_cores)
            try:
                with watched_listeners():
                    return super().createBackend(backend, params)
            finally:
                os.sched_setaffinity(0, own_cores)

    return GuardedAgent


def new_agent(prefix: str):
    from nixl._api import nixl_agent, nixl_agent_config

    quiet_progress_threads()
    return nixl_agent(f"{prefix}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))


def add_peer(agent, metadata: bytes) -> str:
    """Load a remote agent's metadata into `agent`; returns the remote agent's name. As a str:
    NIXL's binding returns it as bytes, while agents know their own name (`agent.name`) as str,
    and the two never compare equal."""
    name = agent.add_remote_agent(metadata)
    return name.decode() if isinstance(name, bytes) else name


def split(extents: Sequence[Extent], piece_bytes: int = PIECE_BYTES) -> list[Extent]:
    return [
        (address + start, min(piece_bytes, length - start))
        for address, length in extents
        for start in range(0, length, piece_bytes)
    ]


class PostedTransfer:
    """One NIXL request, posted at construction and in flight until `wait()` sees it done;
    `release()` frees its handle (call it once the transfer is over: its buffers are in use until
    then). Raises NixlTransferError."""

    def __init__(self, agent, op: str, local: Sequence[Extent], remote: Sequence[Extent], peer: str):
        local_pieces, remote_pieces = _pair(list(local), list(remote))
        self.agent, self.op, self.nbytes = agent, op, sum(n for _, n in local_pieces)
        self.handle = None
        try:
            self.handle = agent.initialize_xfer(op, agent.get_xfer_descs([(a, n, 0) for a, n in local_pieces], "DRAM"),
                                                agent.get_xfer_descs([(a, n, 0) for a, n in remote_pieces], "DRAM"),
                                                peer)
            self.state = agent.transfer(self.handle)
        except Exception as exc:  # NIXL's own errors: an unreachable or vanished peer
            self.release()
            raise NixlTransferError(f"NIXL {op} failed: {exc}") from exc

    def done(self) -> bool:
        """Whether the transfer has finished, without waiting (raises if it failed)."""
        try:
            if self.state == "PROC":
                self.state = self.agent.check_xfer_state(self.handle)
        except Exception as exc:
            raise NixlTransferError(f"NIXL {self.op} failed: {exc}") from exc
        if self.state not in ("PROC", "DONE"):
            raise NixlTransferError(f"NIXL {self.op} failed ({self.state})")
        return self.state == "DONE"

    def wait(self, deadline: float) -> None:
        """Until the transfer is done (or `deadline`, a time.monotonic() value, passes)."""
        while not self.done():
            if time.monotonic() > deadline:
                raise NixlTimeoutError(f"NIXL {self.op} of {self.nbytes} bytes timed out")
            time.sleep(0.0002)

    def release(self) -> None:
        if self.handle is not None:
            self.agent.release_xfer_handle(self.handle)
            self.handle = None


def transfer(agent, op: str, local: Sequence[Extent], remote: Sequence[Extent], peer: str,
             timeout_s: float) -> None:
    """`op` ("READ" or "WRITE") between local and remote extents of equal total size: the two
    lists are cut at the same byte positions, so their pieces pair up. Raises NixlTransferError."""
    posted = PostedTransfer(agent, op, local, remote, peer)
    try:
        posted.wait(time.monotonic() + timeout_s)
    finally:
        posted.release()


def _pair(local: list[Extent], remote: list[Extent]) -> tuple[list[Extent], list[Extent]]:
    """Both lists cut (in pieces of at most PIECE_BYTES) wherever either has a boundary."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise NixlTransferError("local and remote extents differ in size")
    left, right = split(local), split(remote)
    paired_left, paired_right = [], []
    i = j = used_left = used_right = 0
    while i < len(left) and j < len(right):
        take = min(left[i][1] - used_left, right[j][1] - used_right)
        paired_left.append((left[i][0] + used_left, take))
        paired_right.append((right[j][0] + used_right, take))
        used_left += take
        used_right += take
        if used_left == left[i][1]:
            i, used_left = i + 1, 0
        if used_right == right[j][1]:
            j, used_right = j + 1, 0
    return paired_left, paired_right
