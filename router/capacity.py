"""Capacity as requests meet it: where they wait while no instance can take them, and how long
their first tokens took (both the pool controller's signals to grow a pool)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from fleet.instances import Instance
from router import metrics
from router.errors import NoInstance


class LatencyWindow:
    """Recent times to first token of streamed requests, bounded in age and count: the pool
    controller's TTFT signal. (Non-streamed requests have no first token to time.)"""

    def __init__(self, window_s: float = 30.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def observe(self, seconds: float) -> None:
        self._samples.append((time.monotonic(), seconds))

    def quantile(self, q: float, since: float = 0.0, min_samples: int = 8) -> float | None:
        """The q-quantile (router.metrics.percentile) of the samples of the last `window_s` seen after the
        monotonic time `since`; None with fewer than `min_samples` of them."""
        oldest = max(since, time.monotonic() - self.window_s)
        recent = sorted(seconds for at, seconds in self._samples if at > oldest)
        if len(recent) < min_samples:
            return None
        return metrics.percentile(recent, 100 * q)


class CapacityQueue:
    """Where requests wait while no instance can take them (a pool scaling up from zero, every
    instance busy failing over): at most `max_waiting` at once, each at most `timeout_s`; past
    either bound the caller gets a 503 with Retry-After. Its depth is the pool controller's
    scale-up signal."""

    def __init__(self, max_waiting: int, timeout_s: float, poll_s: float = 0.05) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.waiting = 0
        self.waiting_for: collections.Counter[str] = collections.Counter()
        """Waiting requests by model: each model's pools grow on their own."""

    async def wait(self, candidates: Callable[[], list[Instance]], model: str) -> list[Instance]:
        """The candidates (instances of `model`) once there are any; raises NoInstance when full
        or timed out."""
        found = candidates()
        if found:
            return found
        if self.waiting >= self.max_waiting or self.timeout_s == 0:
            raise NoInstance("no ready instance and the wait queue is full; retry shortly", retry_after_s=2)
        self.waiting += 1
        self.waiting_for[model] += 1
        metrics.QUEUED.set(self.waiting)
        started = time.monotonic()
        try:
            while time.monotonic() - started < self.timeout_s:
                await asyncio.sleep(self.poll_s)
                found = candidates()
                if found:
                    return found
        finally:
            self.waiting -= 1
            self.waiting_for[model] -= 1
            metrics.QUEUED.set(self.waiting)
            metrics.QUEUE_WAIT.observe(time.monotonic() - started)
        raise NoInstance(
            f"no instance became ready within {self.timeout_s:g} s; retry shortly", retry_after_s=5
        )
