"""The engine server's process plumbing: a process group that dies with its actor, and HTTPS
clients for the node's own engine servers."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

import httpx

from security.engine_access import EngineAccess

_PR_SET_PDEATHSIG = 1

# The server runs under a shell that leads its process group, with a watcher in the background
# that kills the whole group once the actor process is gone. Needed because Ray SIGKILLs a dead
# actor's direct children (the shell, or before it the server), and vLLM's engine core and worker
# outlive their server (seen: orphans holding 2 GB each). The watcher, orphaned, survives that.
# The server keeps the shell's stdin (a background job's is /dev/null otherwise): it waits on it
# for its start (engine/preimport.py).
GROUP_GUARD = """
actor=$1; shift
"$@" <&0 & server=$!
( trap "" TERM
  while kill -0 "$actor" 2>/dev/null && kill -0 "$server" 2>/dev/null; do sleep 1; done
  kill -KILL 0 ) &
trap 'kill -TERM "$server" 2>/dev/null' TERM
while kill -0 "$server" 2>/dev/null; do wait "$server"; done
"""


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the actor process dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def local_client(timeout_s: float, access: EngineAccess) -> httpx.AsyncClient:
    """A client for this node's engine server: its TLS context (that server's certificate alone;
    no CA certificates loaded, which took 20-55 ms per client here), its token, no proxy."""
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), verify=access.ssl, trust_env=False,
                             headers=access.headers)


def spawn_group(command: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> subprocess.Popen[str]:
    """`command` under GROUP_GUARD in a process group of its own (so `terminate_group` ends its
    engine core and workers too), dying with this process, its stdin a pipe (engine/preimport.py
    waits on it), its output one text stream."""
    return subprocess.Popen(
        ["bash", "-c", GROUP_GUARD, "pdcluster-engine", str(os.getpid()), *command],
        env=env, pass_fds=pass_fds, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1, start_new_session=True, preexec_fn=die_with_parent,
    )


VLLM_SHARED_MEMORY = re.compile(r"psm_[0-9a-f]+|vllm_dist_[0-9a-f]+-.+-cpushm_\d+")
"""Names of the /dev/shm files vLLM's processes make and leave behind when killed: Python's shared
memory (vLLM's broadcast queues between engine core and workers) and the CPU build's
tensor-parallel communicator's (which vLLM never removes). A `psm_` segment the group only
attached to would match too: our engines attach to none."""


def group_shared_memory(pgid: int) -> set[Path]:
    """The vLLM shared-memory files (VLLM_SHARED_MEMORY) that processes of group `pgid` map now."""
    found = set()
    for entry in os.scandir("/proc"):
        try:
            if not entry.name.isdigit() or os.getpgid(int(entry.name)) != pgid:
                continue
            with open(f"/proc/{entry.name}/maps", errors="surrogateescape") as maps:
                paths = {fields[5] for fields in map(str.split, maps) if len(fields) == 6}
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found |= {Path(path) for path in paths
                  if path.startswith("/dev/shm/") and VLLM_SHARED_MEMORY.fullmatch(path.removeprefix("/dev/shm/"))}
    return found


def terminate_group(process: subprocess.Popen[str], grace_s: float, shared_memory: Iterable[Path] = ()) -> None:
    """SIGTERM to `process`'s group, SIGKILL after `grace_s`, and to what lingers (the server may be
    gone while its engine core and workers live on in its group); then remove the vLLM
    shared-memory files the group mapped (`shared_memory`, seen earlier: the group may be gone
    already, killed; and what it maps now), which are host memory until removed. A leader reaped
    before (its exit seen by `poll`) leaves its group id free for another process's group: then
    only the files seen earlier are removed (the group guard killed its group when the server died)."""
    shared_memory = set(shared_memory)
    if process.returncode is None:  # not reaped: the group id is still this group's
        shared_memory |= group_shared_memory(process.pid)
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    for path in shared_memory:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
