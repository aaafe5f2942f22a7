"""`pdcluster serve` and a Ray head as child processes, for tests, benchmarks and load tests on
one machine."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from deploy.ray_head import LoopbackHead
from engine.environment import free_port
from security.credentials import ClusterCredentials
from security.engine_access import EngineAccess, EngineEndpoint


class LocalServer:
    """Runs `pdcluster serve ARGS` on a free loopback port until `stop()`; owns the process. Its
    output goes to `log_path`; the engines it starts write theirs in the folder of that name
    without the suffix (serve-pd.log: serve-pd/<instance id>.log)."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        start_timeout_s: float = 600.0,
        ready: Callable[[LocalServer], bool] | None = None,
        tree: Path | None = None,
    ):
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.ready = ready or (lambda server: httpx.get(f"{server.url}/health", timeout=2).status_code == 200)
        """When the server counts as started (default: its /health answers 200)."""
        self.tree = tree
        """Serve from this checkout of the repository (another revision's code); None: this one's."""
        self._process: subprocess.Popen | None = None

    def start(self) -> LocalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        engine_logs = self.log_path.with_suffix("")
        shutil.rmtree(engine_logs, ignore_errors=True)
        command = [sys.executable, "-m", "deploy.cli", "serve", "--port", str(self.port),
                   "--engine-log-dir", str(engine_logs), *self.args]
        env = os.environ.copy() | ({"PYTHONPATH": str(self.tree)} if self.tree else {})
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tree)
        try:
            self._wait_until_ready()
        except BaseException:  # its deadline, its exit, or the caller's (a test's timeout): nothing left running
            self.stop()
            raise
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"pdcluster serve exited ({self._process.returncode}); see {self.log_path}"
                )
            try:
                if self.ready(self):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"pdcluster serve not ready in {self.start_timeout_s} s; see {self.log_path}")

    @property
    def pid(self) -> int:
        """The `pdcluster serve` process (router, launcher and pool controller)."""
        if self._process is None:
            raise RuntimeError("not started")
        return self._process.pid

    @property
    def credentials(self) -> ClusterCredentials:
        """The cluster's credentials, as the server loaded them (the environment or its file)."""
        return ClusterCredentials.load()

    def instances(self) -> list[dict]:
        response = httpx.get(f"{self.url}/admin/instances", headers=self.credentials.admin_headers(), timeout=5)
        response.raise_for_status()
        return response.json()["instances"]

    def engine_access(self, instance_id: str) -> EngineAccess:
        """How to reach one engine of this server's directly (its pinned TLS context and token),
        as its router does: `httpx.get(f"{access.url}/metrics", headers=access.headers, verify=access.ssl)`."""
        (listed,) = [i for i in self.instances() if i["instance_id"] == instance_id]
        return self.credentials.engine_access(EngineEndpoint(**listed["endpoint"]))

    def kill(self) -> None:
        """SIGKILL the `pdcluster serve` process alone, as a crash would. On a Ray cluster it
        joined (`--address`), its engines and store shards live on; `start()` again adopts them."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

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


class RayHead:
    """A one-node Ray cluster on loopback that outlives the `pdcluster serve --address` processes
    using it (as on a `ray up` head), run as `ray start --head --block` with the token of the
    cluster secret in this process's environment or file; owns its processes. Its temp dir (sockets,
    logs) is a fresh one in `private_ray_root()`: Ray makes it 0777, the root keeps others out."""

    PORT_FLAGS = ("--port", "--node-manager-port", "--object-manager-port", "--metrics-export-port",
                  "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")

    def __init__(
        self, resources: dict[str, float] | None = None, num_cpus: int = 4, start_timeout_s: float = 60
    ):
        self.resources = resources or {}
        self.num_cpus = num_cpus
        self.start_timeout_s = start_timeout_s
        # Fixed free ports: Ray's defaults (6379, 52365, ...) would collide with another head here.
        self.ports = {flag: free_port("127.0.0.1") for flag in self.PORT_FLAGS}
        self.address = f"127.0.0.1:{self.ports['--port']}"
        from deploy.ray_head import private_ray_root

        # Short: Ray's socket paths lie under it.
        self._temp_dir = Path(tempfile.mkdtemp(prefix="head-", dir=private_ray_root()))
        self._process: subprocess.Popen | None = None

    def start(self) -> RayHead:
        from deploy.ray_head import raise_fd_limit

        ray = str(Path(sys.executable).with_name("ray"))
        head = LoopbackHead(self.num_cpus, self.resources)  # the head `pdcluster serve` starts itself
        command = [ray, "start", "--head", "--block", *head.start_flags(), f"--temp-dir={self._temp_dir}",
                   *(f"{flag}={port}" for flag, port in self.ports.items())]
        env = {**os.environ, **head.env, **ClusterCredentials.load().ray_auth_env()}
        raise_fd_limit()  # Ray's processes inherit this process's limit
        log = (self._temp_dir / "ray-start.log").open("w")
        self._process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"ray start exited ({self._process.returncode}): {self._temp_dir}/ray-start.log"
                )
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.ports["--port"])) == 0:
                    return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"Ray head not listening in {self.start_timeout_s} s")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM: `ray start --block` stops the processes it started; then the group is killed."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> RayHead:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
