"""The vLLM server's own HTTP API as its host calls it (engine/host.py): health, the workers'
collective RPC (engine/worker_extension.py), sleep and wake, the warm-up request and the request
gauges, each over a client pinned to that one process's certificate, with its token
(security/engine_access.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable

import httpx

from engine.lifecycle import EngineStartError
from engine.process import local_client
from security.engine_access import EngineAccess

RUNNING_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")  # not ..._waiting_by_reason


@dataclasses.dataclass(frozen=True)
class ServerAPI:
    """One server process's API (a new process gets a new one: another certificate and token)."""

    url: str
    access: EngineAccess
    served_model_name: str

    def client(self, timeout_s: float) -> httpx.AsyncClient:
        return local_client(timeout_s, self.access)

    async def post(self, path: str, params: dict[str, str]) -> None:
        async with self.client(60.0) as client:
            (await client.post(f"{self.url}{path}", params=params)).raise_for_status()

    async def wait_until_healthy(self, exited: Callable[[], int | None]) -> None:
        """Until /health answers 200; EngineStartError once `exited()` gives the process's exit
        code (the caller's own timeout bounds the wait)."""
        async with self.client(5.0) as client:
            while not await self._healthy(client):
                if (code := exited()) is not None:
                    raise EngineStartError(f"the vLLM server exited with code {code}")
                await asyncio.sleep(0.05)

    async def _healthy(self, client: httpx.AsyncClient) -> bool:
        try:
            return (await client.get(f"{self.url}/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def warm_up(self) -> None:
        """Readiness means a request has really run through the engine, not just /health. It asks
        for logprobs: vLLM's first logprobs request costs ~2 s of lazy set-up on the CPU build,
        which no user's first request should pay."""
        async with self.client(60.0) as client:
            response = await client.post(
                f"{self.url}/v1/completions",
                json={"model": self.served_model_name, "prompt": "warm up",
                      "max_tokens": 1, "temperature": 0, "logprobs": 1},
            )
            response.raise_for_status()

    async def worker_call(self, method: str, request: dict, timeout_s: float) -> list:
        """Call a WeightPlaneExtension method on every rank's worker; their results, by rank."""
        async with self.client(timeout_s + 5) as client:
            response = await client.post(
                f"{self.url}/collective_rpc",
                json={"method": method, "args": [json.dumps(request)], "timeout": timeout_s},
            )
        if response.status_code != 200:
            raise EngineStartError(f"{method} failed: HTTP {response.status_code} {response.text[:500]}")
        return response.json()["results"]

    async def requests_in_flight(self) -> int:
        """Requests the engine runs or queues, whichever router sent them (vLLM's own gauges)."""
        async with self.client(10) as client:
            response = await client.get(f"{self.url}/metrics")
        response.raise_for_status()
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
                       if line.partition("{")[0].partition(" ")[0] in RUNNING_GAUGES))
