"""Arrival processes: when each job of a load test starts."""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Poisson:
    """Jobs at `rate` per second on average, with exponential gaps (an open loop)."""

    rate: float
    seed: int = 0
    name = "poisson"

    def start_times(self):
        rng, t = random.Random(self.seed), 0.0
        while True:
            yield t
            t += rng.expovariate(self.rate)


@dataclasses.dataclass(frozen=True)
class Constant:
    """Jobs at exactly `rate` per second."""

    rate: float
    name = "constant"

    def start_times(self):
        k = 0
        while True:
            yield k / self.rate
            k += 1


@dataclasses.dataclass(frozen=True)
class Bursts:
    """`size` jobs at once every `interval_s` seconds."""

    size: int
    interval_s: float
    name = "burst"

    def start_times(self):
        k = 0
        while True:
            yield (k // self.size) * self.interval_s
            k += 1


@dataclasses.dataclass(frozen=True)
class FixedConcurrency:
    """`concurrency` jobs in flight at all times (a closed loop): a new one starts as one ends."""

    concurrency: int
    name = "concurrency"


@dataclasses.dataclass(frozen=True)
class TraceTimes:
    """Each job starts when its trace record says (see MooncakeReplay)."""

    name = "trace"


Arrival = Poisson | Constant | Bursts | FixedConcurrency | TraceTimes
