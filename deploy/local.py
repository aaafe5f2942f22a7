"""`pdcluster serve` as a child process, for tests, benchmarks and load tests on one machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from engine.host import free_port


class LocalServer:
    """Runs `pdcluster serve ARGS` on a free loopback port until `stop()`; owns the process."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        start_timeout_s: float = 600.0,
        ready: Callable[[LocalServer], bool] | None = None,
    ):
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.ready = ready or (lambda server: httpx.get(f"{server.url}/health", timeout=2).status_code == 200)
        """When the server counts as started (default: its /health answers 200)."""
        self._process: subprocess.Popen | None = None

    def start(self) -> LocalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        command = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(self.port), *self.args]
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"pdcluster serve exited ({self._process.returncode}); see {self.log_path}"
                )
            try:
                if self.ready(self):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"pdcluster serve not ready in {self.start_timeout_s} s; see {self.log_path}")

    @property
    def pid(self) -> int:
        """The `pdcluster serve` process (router, launcher and pool controller)."""
        if self._process is None:
            raise RuntimeError("not started")
        return self._process.pid

    def instances(self) -> list[dict]:
        return httpx.get(f"{self.url}/admin/instances", timeout=5).json()["instances"]

    def stop(self, grace_s: float = 60.0) -> None:
        """Ctrl-C, as a user would; SIGKILL if it has not finished after `grace_s`."""
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
