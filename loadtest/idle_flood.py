"""A stranger's idle connections held at a listener for as long as a measurement runs
(docs/security.md, attack 11.1): each sends half a request line and waits; whichever the listener
closes (its header deadline, or displaced by a newcomer) is opened again, so the flood stays at its
size instead of draining while the measurement runs. A patient attacker's, not a storm: reopening
is paced (`reopen_per_s` for the whole flood; reopening at once would be the connect-and-close
attack, whose goal is that the listener survives it). On loopback the connections come from 1,000
per source address (127.0.x.y: a local user may use any of 127.0.0.0/8), so a per-address cap
does not stop them before the listener's total does.

    with IdleFlood(port, 20_000) as flood:     # the connections opened before the block runs
        ...                                    # measure
    flood.counts                               # opened (in all) and closed by the listener

Processes, not threads: one process's descriptor limit holds ~20,000 here, and the reopening
loop must not share the measuring client's GIL.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import resource
import selectors
import socket
import time
from collections import Counter

HALF_A_REQUEST_LINE = b"GET / HT"


PER_SOURCE_ADDRESS = 1000


def _connect(host: str, port: int, source: str | None) -> socket.socket | None:
    try:
        connection = socket.create_connection((host, port), timeout=5,
                                              source_address=(source, 0) if source else None)
        connection.sendall(HALF_A_REQUEST_LINE)
        connection.setblocking(False)
        return connection
    except OSError:
        return None


def _hold(host: str, port: int, count: int, process: int, reopen_per_s: float, ready, stop, results) -> None:
    """Hold `count` idle connections, reopening those the listener closes (at most
    `reopen_per_s` a second), until `stop`."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(count + 256, hard), hard))
    counts: Counter = Counter()
    selector = selectors.DefaultSelector()
    loopback = host.startswith("127.")

    def open_one() -> None:
        source = f"127.{process + 1}.{counts['attempts'] // PER_SOURCE_ADDRESS % 250}.1" if loopback else None
        counts["attempts"] += 1
        connection = _connect(host, port, source)
        counts["opened" if connection else "refused"] += 1
        if connection:
            selector.register(connection, selectors.EVENT_READ)

    for _ in range(count):
        open_one()
    ready.set()
    last = time.monotonic()
    allowance = 0.0
    while not stop.is_set():
        for key, _ in selector.select(timeout=0.1):
            selector.unregister(key.fileobj)
            key.fileobj.close()
            counts["closed_by_listener"] += 1
        now = time.monotonic()
        allowance = min(reopen_per_s, allowance + (now - last) * reopen_per_s)
        last = now
        for _ in range(min(int(allowance), count - len(selector.get_map()))):
            allowance -= 1
            open_one()
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    results.put(dict(counts))


class IdleFlood:
    """`count` idle connections at `host:port` from `processes` processes, sustained while the
    `with` block runs; `counts` (summed over processes: attempts, opened, refused,
    closed_by_listener) is filled when it ends."""

    def __init__(self, port: int, count: int, host: str = "127.0.0.1", processes: int = 2,
                 reopen_per_s: float = 1000.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._results = context.Event(), context.Queue()
        share = -(-count // processes)
        self._ready = [context.Event() for _ in range(processes)]
        self._processes = [
            context.Process(target=_hold, daemon=True,
                            args=(host, port, share, k, reopen_per_s / processes, ready, self._stop, self._results))
            for k, ready in enumerate(self._ready)]
        self.counts: Counter = Counter()

    def __enter__(self) -> IdleFlood:
        for process in self._processes:
            process.start()
        for ready in self._ready:
            if not ready.wait(timeout=300):
                self.__exit__(None, None, None)
                raise TimeoutError("the idle flood did not open its connections within 300 s")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for _ in self._processes:
            with contextlib.suppress(queue.Empty):  # a holder that died reports nothing
                self.counts.update(self._results.get(timeout=120))
        for process in self._processes:
            process.join(30)
