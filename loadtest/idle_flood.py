"""A stranger's idle connections held at a listener for as long as a measurement runs
(docs/security.md, attack 11.1): each sends half a request line and waits; whichever the listener
closes (its header deadline, or displaced by a newcomer) is opened again, so the flood stays near
its size instead of draining while the measurement runs. Reopening is paced (`reopen_per_s` for
the whole flood, by default the whole flood every 5 s: the router's header deadline is 10 s), a
patient attacker's, not a storm: reopening at once would be the connect-and-close attack, whose
goal is that the listener survives it. On loopback the connections come 1,000 per source address
(127.P.N.1, P the holding process, N the thousand: a local user may use any of 127.0.0.0/8), so a
per-address cap does not stop them before the listener's total does.

    with IdleFlood("127.0.0.1", port, 20_000) as flood:   # connections opened before the block
        ...                                                # measure
    flood.counts      # attempts, opened, refused (by the listener), failed_here (our own limits),
                      # closed_by_listener, held_min (each holder's fewest held, summed)

Processes, not threads: one process's descriptor limit holds ~20,000 here, and the reopening
loop must not share the measuring client's GIL.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import queue
import resource
import selectors
import socket
import time
from collections import Counter

HALF_A_REQUEST_LINE = b"GET / HT"
PER_SOURCE_ADDRESS = 1000
OUR_OWN_LIMITS = {errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.EADDRINUSE}
"""Errors that say the flooding process ran out of something, not that the listener refused."""


class _Holder:
    """One process's share of the flood: its connections and its counts."""

    def __init__(self, host: str, port: int, process: int) -> None:
        self.host, self.port, self.process = host, port, process
        self.loopback = host.startswith("127.")
        self.selector = selectors.DefaultSelector()
        self.counts: Counter = Counter()

    def held(self) -> int:
        return len(self.selector.get_map())

    def open_one(self) -> None:
        thousand = self.counts["attempts"] // PER_SOURCE_ADDRESS % 250
        source = (f"127.{self.process + 1}.{thousand}.1", 0) if self.loopback else None
        self.counts["attempts"] += 1
        connection = None
        try:
            connection = socket.create_connection((self.host, self.port), timeout=5, source_address=source)
            connection.sendall(HALF_A_REQUEST_LINE)
            connection.setblocking(False)
        except OSError as error:
            if connection is not None:
                connection.close()
            self.counts["failed_here" if error.errno in OUR_OWN_LIMITS else "refused"] += 1
            return
        self.counts["opened"] += 1
        self.selector.register(connection, selectors.EVENT_READ)

    def reap_closed(self) -> None:
        for key, _ in self.selector.select(timeout=0.1):
            self.selector.unregister(key.fileobj)
            key.fileobj.close()
            self.counts["closed_by_listener"] += 1

    def close(self) -> None:
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()
        self.selector.close()


def _hold(host: str, port: int, count: int, process: int, reopen_per_s: float, ready, stop, results) -> None:
    """Hold `count` idle connections, reopening those the listener closes (at most
    `reopen_per_s` a second), until `stop`; put the counts on `results`."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(count + 256, hard), hard))
    holder = _Holder(host, port, process)
    for _ in range(count):
        holder.open_one()
    ready.set()
    held_min, allowance, last = holder.held(), 0.0, time.monotonic()
    while not stop.is_set():
        holder.reap_closed()
        held_min = min(held_min, holder.held())
        now = time.monotonic()
        allowance = min(max(1.0, reopen_per_s), allowance + (now - last) * reopen_per_s)  # a token bucket
        last = now
        for _ in range(min(int(allowance), count - holder.held())):
            allowance -= 1
            holder.open_one()
    holder.close()
    results.put({**holder.counts, "held_min": held_min})


class IdleFlood:
    """`count` idle connections at `host:port` from `processes` processes, sustained while the
    `with` block runs; `counts` (summed over processes) is filled when it ends."""

    def __init__(self, host: str, port: int, count: int, processes: int = 2,
                 reopen_per_s: float | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, self._results = context.Event(), context.Queue()
        rate = (reopen_per_s if reopen_per_s is not None else count / 5) / processes
        shares = [count // processes + (k < count % processes) for k in range(processes)]
        self._ready = [context.Event() for _ in range(processes)]
        self._processes = [
            context.Process(target=_hold, daemon=True,
                            args=(host, port, share, k, rate, ready, self._stop, self._results))
            for k, (share, ready) in enumerate(zip(shares, self._ready, strict=True))]
        self.counts: Counter = Counter()

    def __enter__(self) -> IdleFlood:
        for process in self._processes:
            process.start()
        deadline = time.monotonic() + 300
        while not all(ready.is_set() for ready in self._ready):
            if time.monotonic() > deadline or any(not p.is_alive() for p in self._processes):
                self.__exit__(None, None, None)
                raise RuntimeError("the idle flood's holders did not open their connections (died or past 300 s)")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for _ in self._processes:
            with contextlib.suppress(queue.Empty):  # a holder that died reports nothing
                self.counts.update(self._results.get(timeout=60))
        for process in self._processes:
            process.join(30)
            if process.is_alive():  # its connections would distort what runs next
                process.kill()
                process.join()
