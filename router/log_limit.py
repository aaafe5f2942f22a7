"""Log lines that repeat, rate-limited: a flood must not become a flood of log.

A stranger's connections at the router's descriptor limit made every failed accept log "Too many
open files": 443,019 lines, 197 MB in ~35 s (docs/security.md, attack 11.4). `RepeatLimit` is a
logging filter that lets through at most `burst` records of one kind (logger, level, message
template) per `window_s`, counts the rest in a Prometheus counter, and when a window with
suppressed records ends says once how many it held back.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter

SUPPRESSED = Counter("pdcluster_log_lines_suppressed", "Log records held back as repeats, by logger", ["logger"])


class RepeatLimit(logging.Filter):
    def __init__(self, burst: int = 20, window_s: float = 10.0, clock=time.monotonic) -> None:
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._windows: dict[tuple[str, int, str], tuple[float, int]] = {}  # kind -> (start, count)

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        started, count = self._windows.get(kind, (now, 0))
        if now - started >= self.window_s:
            if count > self.burst:
                record.msg = f"{record.msg} [and {count - self.burst} more like it in the last {self.window_s:g} s]"
            started, count = now, 0
        self._windows[kind] = (started, count + 1)
        if count < self.burst:
            return True
        SUPPRESSED.labels(record.name).inc()
        if len(self._windows) > 10_000:  # kinds are few in practice; never an unbounded book
            self._windows.clear()
        return False


def limit_repeats(burst: int = 20, window_s: float = 10.0) -> None:
    """Put a RepeatLimit on every handler of the root logger (records of every logger that
    propagates there: uvicorn's, asyncio's, ours)."""
    limit = RepeatLimit(burst, window_s)
    for handler in logging.getLogger().handlers:
        handler.addFilter(limit)
