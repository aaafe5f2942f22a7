"""Instance states, what an engine's host tells of its engine (`EngineDescription`), and the
timeline of a start, stage by stage (read off the server's log)."""

from __future__ import annotations

import dataclasses
import enum
import re
import time

from engine.preimport import PREIMPORTED_MARK
from engine.role_spec import Role
from security.engine_access import EngineEndpoint


class EngineStartError(RuntimeError):
    """The engine did not become ready; the message carries the tail of its log."""


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


@dataclasses.dataclass(frozen=True)
class EngineDescription:
    """What an engine's host tells whoever asks it through Ray (its launcher, a following router,
    a launcher adopting it, the progress table): one typed record, read the same everywhere."""

    instance_id: str
    role: Role
    model: str
    """The checkpoint's folder, as the host was configured."""
    served_model_name: str
    max_model_len: int
    state: InstanceState
    url: str
    endpoint: EngineEndpoint | None
    """Its server process's sealed endpoint; None before a process exists."""
    kv_events_endpoint: str | None
    kv_events_replay_endpoint: str | None
    pid: int | None
    exited: bool
    """Its server process ran and has ended."""
    last_stage: str
    """The start-up stage its timeline reached last."""
    elapsed_s: float
    """Seconds since its current start (or activation) began."""
    tensor_parallel_size: int = 1
    """Devices (ranks) the engine spans."""
    kv_store: bool = False
    """It saves and loads KV through the cluster's store shards (P/D through the store, or
    `--shared-store`): fixed at its start, so only a fleet with a store may adopt it."""
    kv_lease_s: float | None = None
    """P/D direct: how long it holds a prompt's KV for a decode engine (EngineConfig.kv_lease_s);
    None where it hands none over that way. Every router reads it here, its own or adopted."""

    def serves(self, served: set[tuple[str, str]]) -> bool:
        """Whether it is an engine of one of `served`'s (checkpoint, served name) pairs."""
        return (self.model, self.served_model_name) in served


# Log lines that end a start-up stage, in the order they appear, with the seconds vLLM itself
# reports where it does (vLLM 0.26 on CUDA, 0.32's CPU build; a stage whose line a build does not
# print is counted in the next).
STAGE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("preimport", re.compile(re.escape(PREIMPORTED_MARK))),
    ("spawn_and_import", re.compile(r"vLLM API server version|version \d+\.\d+")),
    ("engine_process", re.compile(r"Initializing a V1 LLM engine")),
    # the worker up and the model built (our engines' weights are dummy here, loaded later)
    ("worker_and_model", re.compile(r"(?:Loading weights took|Model loading took .*? and) (?P<s>[\d.]+) seconds")),
    ("compile", re.compile(r"torch.compile took (?P<s>[\d.]+) s in total")),
    # the profiling run, the CUDA graphs' memory profile (none with a startup plan), the KV cache
    ("profile_and_kv_cache", re.compile(r"[CG]PU KV cache size: [\d,]+ tokens")),
    ("graph_capture", re.compile(r"Graph capturing finished in (?P<s>[\d.]+) secs")),
    ("engine_ready", re.compile(r"init engine .* took (?P<s>[\d.]+) s")),
    ("api_server", re.compile(r"Application startup complete")),
)

STARTUP_PLAN_APPLIED = re.compile(r"Applying persisted startup plan")
"""vLLM reused the KV cache size of an earlier start (engine/server_command.py, server_env)."""


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

    def mark_split(self, stage: str, last_part: str, last_part_s: float) -> None:
        """Record that `stage` ended now, its last `last_part_s` seconds (a step the stage's call
        timed inside it) as a stage of its own named `last_part`; just `stage` when that is 0."""
        if last_part_s <= 0:
            self.mark(stage)
            return
        now = time.time() - self.started_at
        if all(name != stage for name, _ in self.marks):
            self.marks.append((stage, max(now - last_part_s, self.marks[-1][1] if self.marks else 0.0)))
        self.mark(last_part)

    def mark_from_log(self, line: str) -> None:
        """Mark the stage a line of the server's log ends, if it ends one (STAGE_PATTERNS), with the
        seconds that line reports; like the mark, the first line of a stage's counts."""
        for stage, pattern in STAGE_PATTERNS:
            match = pattern.search(line)
            if match:
                self.mark(stage)
                if "s" in match.groupdict():
                    self.details.setdefault(f"{stage}_reported_s", float(match["s"]))
        if STARTUP_PLAN_APPLIED.search(line):
            self.details["startup_plan"] = "applied"

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
