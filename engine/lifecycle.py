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
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def is_standby(self) -> bool:
        """Waiting for weights, awake or asleep: no traffic; `activate()` makes it READY."""
        return self in (InstanceState.STANDBY, InstanceState.SLEEPING)


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
