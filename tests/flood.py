"""A stranger's floods of a listener (docs/security.md, attacks 11.x), run as another local user
(tests/stranger.py): connect-and-close calls, and connections held idle, half a request line sent.

    with idle_connections(port, 20_000):       # held until the block ends
        ...                                     # the listener must still serve
    connect_and_close(port, 50_000)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from stranger import StrangerProcess, run_as_stranger

CONNECT_AND_CLOSE = '''
import socket, time
refused = 0
started = time.monotonic()
for _ in range(ARGS["count"]):
    try:
        socket.create_connection((ARGS["host"], ARGS["port"]), timeout=5).close()
    except OSError:
        refused += 1
print(json.dumps({"refused": refused, "seconds": time.monotonic() - started}))
'''

HOLD_IDLE = '''
import resource, socket, sys, time
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (min(ARGS["count"] + 64, hard), hard))
held, failed = [], 0
for _ in range(ARGS["count"]):
    try:
        connection = socket.create_connection((ARGS["host"], ARGS["port"]), timeout=5)
        connection.sendall(ARGS["send"].encode())
        held.append(connection)
    except OSError:
        failed += 1
print("ready", flush=True)
sys.stdin.readline()  # held until told
closed = 0
for connection in held:  # which of them the listener closed meanwhile
    connection.setblocking(False)
    try:
        closed += connection.recv(1) == b""
    except BlockingIOError:
        pass
    except OSError:
        closed += 1
print(json.dumps({"opened": len(held), "failed": failed, "closed_by_listener": closed}))
'''


def connect_and_close(port: int, count: int, host: str = "127.0.0.1") -> dict:
    """`count` connections opened and closed at once, one after another, as the stranger."""
    return run_as_stranger(CONNECT_AND_CLOSE, {"host": host, "port": port, "count": count}, timeout_s=600)


@contextlib.contextmanager
def idle_connections(port: int, count: int, host: str = "127.0.0.1", processes: int = 2,
                     send: str = "GET / HT") -> Iterator[dict]:
    """`count` connections from the stranger (over `processes` processes: one process's descriptor
    limit is ~20,000 here), each having sent `send` (half a request line), held while the block
    runs. Yields a dict filled when the block ends: opened, failed, closed_by_listener (summed)."""
    share = -(-count // processes)
    holders = [StrangerProcess(HOLD_IDLE, {"host": host, "port": port, "count": share, "send": send})
               for _ in range(processes)]
    outcome: dict = {"opened": 0, "failed": 0, "closed_by_listener": 0}
    try:
        for holder in holders:
            holder.ready(timeout_s=300)
        yield outcome
    finally:
        for holder in holders:
            if holder.process.poll() is None:
                holder.tell("go")
        for holder in holders:
            for key, value in holder.result(timeout_s=300).items():
                outcome[key] += value


def open_descriptors(pid: int) -> int:
    """How many file descriptors process `pid` holds now."""
    return len(os.listdir(f"/proc/{pid}/fd"))
