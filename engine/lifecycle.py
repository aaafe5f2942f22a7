"""Instance states and the timeline of a start, stage by stage."""

from __future__ import annotations

import dataclasses
import enum
import time


class InstanceState(enum.StrEnum):
    """Where an instance is in its life. Only READY instances receive traffic."""

    STANDBY = "standby"
    SLEEPING = "sleeping"
    """A standby whose GPU memory is given back but for its CUDA context and graphs (vLLM's
    sleep mode, level 2): it holds ~2 GiB instead of its share of the GPU."""
    PREIMPORTED = "preimported"
    """A server process that has imported vLLM and waits to be started (engine/preimport.py):
    no GPU memory, no weights; `activate()` starts it, saving a start its imports."""
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def is_standby(self) -> bool:
        """Waiting, with no traffic, for `activate()` to make it READY: awake (everything but
        weights), asleep, or only imported (the order in which a pool uses them)."""
        return self in STANDBY_STATES


STANDBY_STATES = (InstanceState.STANDBY, InstanceState.SLEEPING, InstanceState.PREIMPORTED)
"""Standbys' states, fastest to activate first."""


@dataclasses.dataclass
class StartTimeline:
    """Seconds since the start was asked for at which each stage ended, in order."""

    started_at: float = dataclasses.field(default_factory=time.time)
    marks: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    details: dict[str, float | str] = dataclasses.field(default_factory=dict)

    def mark(self, stage: str) -> None:
        """Record that `stage` ended now (each stage once; later marks of it are ignored)."""
        if all(name != stage for name, _ in self.marks):
            self.marks.append((stage, time.time() - self.started_at))

    def stages(self) -> dict[str, float]:
        """Duration of each stage: the time from the previous mark to its own."""
        durations, previous = {}, 0.0
        for name, at in self.marks:
            durations[name] = at - previous
            previous = at
        return durations

    def total(self) -> float:
        return self.marks[-1][1] if self.marks else 0.0

    def as_record(self) -> dict:
        """The JSON record of this start."""
        return {
            "started_at": self.started_at,
            "total_s": round(self.total(), 4),
            "stages_s": {k: round(v, 4) for k, v in self.stages().items()},
            "details": self.details,
        }
