"""The router's view of the engine instances: address, role, state, load, health.

The router knows an instance by its sealed endpoint (security/engine_access.py: URL, the
certificate of its server process, the nonce of its token), opened into an `EngineAccess` when
the instance is registered; whoever starts instances (the launcher in `deploy/`) adds and removes
them. A health loop takes an instance out of rotation after `failure_threshold` failed checks in
a row and puts it back after one passing check.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp

from engine.lifecycle import InstanceState
from engine.roles import RoleSpec
from router import metrics
from router.errors import NoInstance
from security.credentials import ClusterCredentials
from security.engine_access import EngineAccess, EngineEndpoint

if TYPE_CHECKING:
    from router.migration import StreamLedger

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Instance:
    instance_id: str
    role: RoleSpec
    url: str
    state: InstanceState = InstanceState.READY
    inflight: int = 0
    """Requests the router has sent there and not yet seen finish."""
    pending_prefill_tokens: float = 0.0
    """Prompt tokens routed there whose prefill has not finished (the router's estimate)."""
    failed_checks: int = 0
    kv_events_endpoint: str | None = None
    """The engine's KV event PUB socket (None: it publishes none)."""
    kv_events_replay_endpoint: str | None = None
    """The engine's replay socket for missed KV event batches."""
    failed_prefills: int = 0
    """Remote prefills in a row that failed or timed out (P/D)."""
    prefill_open_until: float = 0.0
    """Monotonic time until which no remote prefill is sent here (the circuit is open)."""
    model: str = dataclasses.field(kw_only=True)
    """The served model name: only requests for it come here."""
    streams: set[StreamLedger] = dataclasses.field(default_factory=set, compare=False, repr=False)
    """The migratable streams the router relays from it now (router/proxy.py), a continued one
    from the instance it went on to: which streams a fault there hits (GET /admin/instances
    lists each one's id and tokens sent). Other requests count in `inflight` only."""
    access: EngineAccess | None = dataclasses.field(default=None, kw_only=True, compare=False, repr=False)
    """How to reach its engine process: that process's certificate pinned, its token. None only
    for instances nobody sends to (tests of placement)."""

    def request_options(self, headers: dict[str, str] | None = None) -> dict:
        """aiohttp's keyword arguments for a request to this engine (its TLS context and token,
        and `headers`)."""
        if self.access is None:
            raise RuntimeError(f"instance {self.instance_id} was registered with no access to its engine")
        return {"ssl": self.access.ssl, "headers": {**self.access.headers, **(headers or {})}}


def described_instance(info: dict, role: RoleSpec, credentials: ClusterCredentials) -> Instance:
    """The instance (of `role`) an engine host's `describe()` tells of, its endpoint's seal checked
    (raises security.engine_access.EngineAccessRefused for one its instance's host did not seal)."""
    access = credentials.engine_access(EngineEndpoint(**info["endpoint"]))
    return Instance(info["instance_id"], role, access.url, InstanceState(info["state"]),
                    kv_events_endpoint=info["kv_events_endpoint"],
                    kv_events_replay_endpoint=info["kv_events_replay_endpoint"],
                    model=info["served_model_name"], access=access)


class PendingPrefill:
    """Prompt tokens routed to an instance and not yet prefilled, counted until the first byte
    (or the end of a non-streamed answer) comes back: the queue the cost model charges."""

    def __init__(self, instance: Instance, tokens: int) -> None:
        self.instance, self.tokens = instance, max(tokens, 0)
        instance.pending_prefill_tokens += self.tokens

    def done(self) -> None:
        self.instance.pending_prefill_tokens -= self.tokens
        self.tokens = 0


class InstanceRegistry:
    """Instances by id. Mutated only on the router's event loop. `on_add` callbacks run for each
    instance registered (the KV event listener subscribes to it), `on_remove` ones for each that
    leaves (the KV index forgets what it held)."""

    def __init__(self) -> None:
        self._instances: dict[str, Instance] = {}
        self.on_add: list[Callable[[Instance], None]] = []
        self.on_remove: list[Callable[[str], None]] = []

    def add(self, instance: Instance) -> None:
        if instance.instance_id in self._instances:
            raise ValueError(f"instance {instance.instance_id} is already registered")
        self._instances[instance.instance_id] = instance
        for callback in self.on_add:
            callback(instance)

    def remove(self, instance_id: str) -> Instance | None:
        instance = self._instances.pop(instance_id, None)
        if instance is not None:
            for callback in self.on_remove:
                callback(instance_id)
        return instance

    def replay_endpoint_of(self, instance_id: str) -> str | None:
        instance = self._instances.get(instance_id)
        return instance.kv_events_replay_endpoint if instance else None

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def ready(self, where: Callable[[RoleSpec], bool] = lambda role: True, model: str | None = None) -> list[Instance]:
        """The ready instances whose role `where` accepts (of `model` only, if given)."""
        return [i for i in self._instances.values()
                if i.state == InstanceState.READY and where(i.role) and model in (None, i.model)]

    def mark_failed(self, instance: Instance, reason: str) -> None:
        """Out of rotation, if it is in rotation (an instance draining, asleep or starting is
        its launcher's to move)."""
        if instance.state == InstanceState.READY:
            log.warning("instance %s out of rotation: %s", instance.instance_id, reason)
            instance.state = InstanceState.FAILED


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
        try:
            async with session.get(f"{instance.url}/health", **instance.request_options()) as answer:
                healthy = answer.status == 200
        except (aiohttp.ClientError, TimeoutError):
            healthy = False
        if healthy:
            instance.failed_checks = 0
            if instance.state == InstanceState.FAILED:  # only what it failed itself: others moved meanwhile
                log.info("instance %s back in rotation", instance.instance_id)
                instance.state = InstanceState.READY
            return
        instance.failed_checks += 1
        if instance.failed_checks >= self.failure_threshold:
            self.registry.mark_failed(instance, f"{instance.failed_checks} failed health checks")


class LatencyWindow:
    """Recent times to first token of streamed requests, bounded in age and count: the pool
    controller's TTFT signal. (Non-streamed requests have no first token to time.)"""

    def __init__(self, window_s: float = 30.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def observe(self, seconds: float) -> None:
        self._samples.append((time.monotonic(), seconds))

    def quantile(self, q: float, since: float = 0.0, min_samples: int = 8) -> float | None:
        """The q-quantile (router.metrics.percentile) of the samples of the last `window_s` seen after the
        monotonic time `since`; None with fewer than `min_samples` of them."""
        oldest = max(since, time.monotonic() - self.window_s)
        recent = sorted(seconds for at, seconds in self._samples if at > oldest)
        if len(recent) < min_samples:
            return None
        return metrics.percentile(recent, 100 * q)


class CapacityQueue:
    """Where requests wait while no instance can take them (a pool scaling up from zero, every
    instance busy failing over): at most `max_waiting` at once, each at most `timeout_s`; past
    either bound the caller gets a 503 with Retry-After. Its depth is the pool controller's
    scale-up signal."""

    def __init__(self, max_waiting: int, timeout_s: float, poll_s: float = 0.05) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.waiting = 0
        self.waiting_for: collections.Counter[str] = collections.Counter()
        """Waiting requests by model: each model's pools grow on their own."""

    async def wait(self, candidates: Callable[[], list[Instance]], model: str) -> list[Instance]:
        """The candidates (instances of `model`) once there are any; raises NoInstance when full
        or timed out."""
        found = candidates()
        if found:
            return found
        if self.waiting >= self.max_waiting or self.timeout_s == 0:
            raise NoInstance("no ready instance and the wait queue is full; retry shortly", retry_after_s=2)
        self.waiting += 1
        self.waiting_for[model] += 1
        metrics.QUEUED.set(self.waiting)
        started = time.monotonic()
        try:
            while time.monotonic() - started < self.timeout_s:
                await asyncio.sleep(self.poll_s)
                found = candidates()
                if found:
                    return found
        finally:
            self.waiting -= 1
            self.waiting_for[model] -= 1
            metrics.QUEUED.set(self.waiting)
            metrics.QUEUE_WAIT.observe(time.monotonic() - started)
        raise NoInstance(
            f"no instance became ready within {self.timeout_s:g} s; retry shortly", retry_after_s=5
        )
