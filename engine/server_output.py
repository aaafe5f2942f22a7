"""What a vLLM server process prints, as its host reads it: the tail kept for error messages, the
instance's log file, the start stages, and where our KV event publisher bound its sockets."""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from engine.environment import KV_EVENTS_MARK
from engine.lifecycle import StartTimeline

LOG_TAIL_LINES = 200


class ServerOutput:
    """One server process's output, read line by line on a thread of its own: the last
    LOG_TAIL_LINES lines, each line appended to `log_path` (when the engine keeps logs) and
    marked on the host's current start timeline, and the KV event sockets the process reports
    once bound (its first KV_EVENTS_MARK line: our publisher's, written before any request)."""

    def __init__(self, process: subprocess.Popen[str], log_path: Path | None,
                 timeline: Callable[[], StartTimeline], kv_events: bool) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.kv_events_endpoint: str | None = None
        self.kv_events_replay_endpoint: str | None = None
        self._timeline, self._kv_events = timeline, kv_events
        threading.Thread(target=self._follow, args=(process, log_path), daemon=True).start()

    def _follow(self, process: subprocess.Popen[str], log_path: Path | None) -> None:
        assert process.stdout is not None
        log_file = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = open(log_path, "a", buffering=1)  # noqa: SIM115
        with log_file or contextlib.nullcontext():
            for line in process.stdout:
                if log_file is not None:
                    log_file.write(line)
                self._read(line)

    def _read(self, line: str) -> None:
        self.tail.append(line.rstrip())
        self._timeline().mark_from_log(line)
        if KV_EVENTS_MARK in line and self._kv_events and self.kv_events_endpoint is None:
            bound = json.loads(line.split(KV_EVENTS_MARK, 1)[1])
            self.kv_events_endpoint, self.kv_events_replay_endpoint = bound["endpoint"], bound["replay_endpoint"]
