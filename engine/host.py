"""EngineHost: owns one vLLM OpenAI server process and its lifecycle.

The host runs inside a Ray actor (`EngineActor`), so Ray places it (GPUs, role resources) and
the router finds it by handle; tokens flow over HTTP straight from the vLLM server to the router,
not through Ray. The host starts the server on the node's address, follows its log to time each
start-up stage, sends a warm-up request before it reports READY, answers health checks and stops
the whole process group on `stop()` or when the actor dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from engine.config import EngineConfig, Role
from engine.environment import engine_env, is_cpu_build
from engine.lifecycle import InstanceState, StartTimeline

# vLLM log lines that end a start-up stage, in the order they appear, with the seconds vLLM
# itself reports where it does.
STAGE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("spawn_and_import", re.compile(r"vLLM API server version|version \d+\.\d+")),
    ("engine_process", re.compile(r"Initializing a V1 LLM engine")),
    ("worker_start_and_weights", re.compile(r"Loading weights took (?P<s>[\d.]+) seconds")),
    ("graph_capture", re.compile(r"Graph capturing finished in (?P<s>[\d.]+) secs")),
    ("kv_cache_and_profile", re.compile(r"init engine .* took (?P<s>[\d.]+) s")),
    ("api_server", re.compile(r"Application startup complete")),
)
LOG_TAIL_LINES = 200
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the actor process dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EngineStartError(RuntimeError):
    """The engine did not become ready; the message carries the tail of its log."""


class EngineHost:
    """One vLLM server process. Methods are async so a Ray actor serves them concurrently."""

    def __init__(self, config: EngineConfig, instance_id: str, host: str | None = None):
        self.config = config
        self.instance_id = instance_id
        self.host = host or node_address()
        self.port = free_port(self.host)
        self.kv_events_replay_endpoint = (
            f"tcp://{self.host}:{free_port(self.host)}" if config.kv_events_endpoint else None
        )
        self.state = InstanceState.STANDBY
        self.timeline = StartTimeline()
        self._process: subprocess.Popen[str] | None = None
        self._log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def describe(self) -> dict:
        """What the router needs to know about this instance."""
        return {
            "instance_id": self.instance_id,
            "role": self.config.role.value,
            "url": self.url,
            "state": self.state.value,
            "served_model_name": self.config.served_model_name,
            "max_model_len": self.config.max_model_len,
            "kv_events_replay_endpoint": self.kv_events_replay_endpoint,
            "pid": self._process.pid if self._process else None,
            "last_stage": self.timeline.marks[-1][0] if self.timeline.marks else "",
            "elapsed_s": time.time() - self.timeline.started_at,
        }

    def server_command(self) -> list[str]:
        c = self.config
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(c.model),
            "--served-model-name", c.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(c.max_model_len),
            "--block-size", str(c.block_size),
            "--gpu-memory-utilization", str(c.gpu_memory_utilization),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if c.enforce_eager:
            command.append("--enforce-eager")
        if c.kv_events_endpoint:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "topic": self.instance_id,
                "endpoint": c.kv_events_endpoint,
                "replay_endpoint": self.kv_events_replay_endpoint,
            }
            command += ["--kv-events-config", json.dumps(events)]
        if c.role != Role.COLOCATED:
            command += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return command + list(c.extra_args)

    def kv_transfer_config(self) -> dict:
        """vLLM's NixlConnector: the decode instance reads the prefill's KV blocks one-sided over
        UCX (RDMA on clusters, TCP here); a failed read is recomputed, never an error."""
        return {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu" if is_cpu_build() else "cuda",
            "kv_load_failure_policy": "recompute",
        }

    async def start(self) -> dict:
        """Start the server, wait for health, send a warm-up request; returns the timeline."""
        if self.state not in (InstanceState.STANDBY, InstanceState.STOPPED, InstanceState.FAILED):
            raise EngineStartError(f"{self.instance_id} is {self.state.value}; cannot start")
        self.timeline = StartTimeline()
        self.state = InstanceState.LOADING
        env = {**os.environ, **engine_env(self.host, self.config.kv_cache_gib, self.config.cpu_cores)}
        if self.config.role != Role.COLOCATED:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port(self.host))
        self._process = subprocess.Popen(
            self.server_command(),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: stop() ends engine core and workers too
            preexec_fn=_die_with_parent,
        )
        threading.Thread(target=self._follow_log, args=(self._process,), daemon=True).start()
        try:
            await asyncio.wait_for(self._wait_until_ready(), self.config.start_timeout_s)
        except Exception as exc:
            self.state = InstanceState.FAILED
            self._terminate(grace_s=5)
            reason = (
                "timed out (raise EngineConfig.start_timeout_s)"
                if isinstance(exc, asyncio.TimeoutError)
                else str(exc)
            )
            tail = "\n".join(list(self._log_tail)[-40:])
            raise EngineStartError(f"{self.instance_id} failed to start: {reason}\n{tail}") from None
        self.state = InstanceState.READY
        return self.timeline.as_record()

    def _follow_log(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self._log_tail.append(line.rstrip())
            for stage, pattern in STAGE_PATTERNS:
                match = pattern.search(line)
                if match:
                    self.timeline.mark(stage)
                    if "s" in match.groupdict():
                        self.timeline.details[f"{stage}_reported_s"] = float(match["s"])

    async def _wait_until_ready(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
            while not await self._healthy(client):
                if self._process is None or self._process.poll() is not None:
                    code = self._process.returncode if self._process else None
                    raise EngineStartError(f"the vLLM server exited with code {code}")
                await asyncio.sleep(0.1)
            self.timeline.mark("api_server")
            self.state = InstanceState.WARMING
            # Readiness means a request has really run through the engine, not just /health.
            response = await client.post(
                f"{self.url}/v1/completions",
                json={"model": self.config.served_model_name, "prompt": "warm up",
                      "max_tokens": 1, "temperature": 0},
                timeout=httpx.Timeout(60.0),
            )  # fmt: skip
            response.raise_for_status()
            self.timeline.mark("warmup_request")

    async def _healthy(self, client: httpx.AsyncClient) -> bool:
        try:
            return (await client.get(f"{self.url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def health(self) -> dict:
        """The instance's state, re-checked against its process and /health."""
        if self.state == InstanceState.READY:
            alive = self._process is not None and self._process.poll() is None
            async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
                if not alive or not await self._healthy(client):
                    self.state = InstanceState.FAILED
        return self.describe()

    async def stop(self, grace_s: float = 10.0) -> dict:
        """Stop the server: SIGTERM to its process group, SIGKILL after `grace_s`."""
        if self.state != InstanceState.STOPPED:
            self.state = InstanceState.DRAINING
            await asyncio.to_thread(self._terminate, grace_s)
            self.state = InstanceState.STOPPED
        return self.describe()

    def _terminate(self, grace_s: float) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        # The server may be gone while its engine core and workers linger in its group.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def node_address() -> str:
    """The address this process's Ray node uses (loopback on a one-machine cluster)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
