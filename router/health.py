"""The health loop: every instance in rotation (or out of it for failing) asked for its /health
and its load (vLLM's server load: the requests it holds, whichever router sent them) each
`interval_s`; what it answers goes to the registry, which takes an instance out of rotation
after `failure_threshold` failed checks in a row and puts it back after one that passed, and
gives policies the engine's load beside this router's own (routers side by side each see every
router's requests)."""

from __future__ import annotations

import asyncio

import aiohttp

from engine.lifecycle import InstanceState
from fleet.instances import Instance, InstanceRegistry


class HealthMonitor:
    """Checks every instance's /health each `interval_s`; owns its task and `session`, the router's
    HTTP client for engines' health and metrics (no proxy taken from the environment, which would
    see the tokens), which the metrics relay borrows."""

    def __init__(self, registry: InstanceRegistry, interval_s: float, timeout_s: float, failure_threshold: int) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self._task: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self._task = asyncio.create_task(self._run(self.session), name="health-monitor")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.session:
            await self.session.close()

    async def _run(self, session: aiohttp.ClientSession) -> None:
        while True:
            instances = [i for i in self.registry.all() if i.state in (InstanceState.READY, InstanceState.FAILED)]
            await asyncio.gather(*(self.check(session, i) for i in instances))
            await asyncio.sleep(self.interval_s)

    async def check(self, session: aiohttp.ClientSession, instance: Instance) -> None:
        healthy, load = await asyncio.gather(self._healthy(session, instance), self._load(session, instance))
        self.registry.health_checked(instance, healthy, self.failure_threshold)
        if load is not None:
            self.registry.engine_reported(instance, load)

    @staticmethod
    async def _healthy(session: aiohttp.ClientSession, instance: Instance) -> bool:
        try:
            async with session.get(f"{instance.url}/health", **instance.request_options()) as answer:
                return answer.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    @staticmethod
    async def _load(session: aiohttp.ClientSession, instance: Instance) -> int | None:
        """vLLM's server load (`--enable-server-load-tracking`); None if it does not say."""
        try:
            async with session.get(f"{instance.url}/load", **instance.request_options()) as answer:
                load = (await answer.json(content_type=None)).get("server_load") if answer.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None
        return load if isinstance(load, int) and load >= 0 else None
