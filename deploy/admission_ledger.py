"""Per-key limits shared by every router of a cluster: one named Ray actor holds them.

Routers that serve one cluster side by side (behind any TCP/HTTP balancer) must not give a key
its rate and concurrency limits once per router. `AdmissionLedger` is a detached named actor
(`pdc-admission-ledger`; Ray restarts it if its process dies) holding one `KeyLimits`
(router/admission.py, the same books a lone router keeps); `LedgerLimits` is a router's client:
one actor call per admitted request, a release sent without waiting.

Each router restates its own requests in flight every `heartbeat_s` (it knows them exactly);
the ledger forgets a router silent for `lease_s`, so a router that dies leaks no slot, and a
ledger that Ray restarted empty knows every live router's load again within one heartbeat. A
router that cannot reach the ledger within `call_timeout_s` applies the same limits on its own
(logged once per outage) rather than refuse or hang its clients.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import ray

from router.admission import KeyLimits, Refusal, once
from router.errors import RateLimited

log = logging.getLogger(__name__)
LEDGER_NAME = "pdc-admission-ledger"


class AdmissionLedger:
    """The cluster's per-key limits (a Ray actor: calls run one at a time, in each caller's order)."""

    def __init__(self, rate_per_s: float | None, max_concurrency: int | None, lease_s: float = 10.0) -> None:
        self.limits = KeyLimits(rate_per_s, max_concurrency)
        self.lease_s = lease_s
        self._seen: dict[str, float] = {}

    def settings(self) -> tuple[float | None, int | None]:
        return self.limits.settings

    def acquire(self, holder: str, key: str) -> Refusal | None:
        self._expire()
        self._seen[holder] = time.monotonic()
        return self.limits.acquire(key, holder)

    def release(self, holder: str, key: str) -> None:
        self.limits.release(key, holder)

    def heartbeat(self, holder: str, inflight: dict[str, int]) -> None:
        self._seen[holder] = time.monotonic()
        self.limits.restate(holder, inflight)
        self._expire()

    def leave(self, holder: str) -> None:
        self._seen.pop(holder, None)
        self.limits.forget(holder)

    def holders(self) -> list[str]:
        self._expire()
        return sorted(self._seen)

    def _expire(self) -> None:
        now = time.monotonic()
        for holder in [h for h, seen in self._seen.items() if now - seen > self.lease_s]:
            log.warning("router %s silent for %.0f s: its requests no longer count", holder, self.lease_s)
            self.leave(holder)


AdmissionLedgerActor = ray.remote(AdmissionLedger)


async def join_ledger(rate_per_s: float | None, max_concurrency: int | None) -> LedgerLimits:
    """This router's limits in the cluster's ledger, created by the first router that asks (every
    router's limits must be the same: one configured otherwise is refused rather than enforce
    other limits)."""
    handle = AdmissionLedgerActor.options(
        name=LEDGER_NAME, lifetime="detached", get_if_exists=True, max_restarts=-1, num_cpus=0,
    ).remote(rate_per_s, max_concurrency)
    settings = tuple(await asyncio.wait_for(handle.settings.remote(), 60))
    if settings != (rate_per_s, max_concurrency):
        raise ValueError(f"this cluster's routers limit keys to {settings[0]} requests/s and {settings[1]} in flight "
                         f"(rate, concurrency); this router was given {rate_per_s} and {max_concurrency}")
    return LedgerLimits(handle, settings)


class LedgerLimits:
    """A router's limits kept in the cluster's ledger (router/admission.py's `Limits`)."""

    def __init__(self, handle, settings: tuple[float | None, int | None], heartbeat_s: float = 2.0,
                 call_timeout_s: float = 0.5) -> None:
        self.handle = handle
        self.holder = f"router-{uuid.uuid4().hex[:12]}"
        self.heartbeat_s = heartbeat_s
        self.call_timeout_s = call_timeout_s
        self.fallback = KeyLimits(*settings)
        """The same limits on this router's own books, while the ledger cannot be reached."""
        self.inflight: dict[str, int] = {}
        """This router's requests in flight, per key, however admitted: what it restates."""
        self._outage = False
        self._task: asyncio.Task[None] | None = None

    async def acquire(self, key: str) -> Callable[[], None]:
        # Counted before the call: a heartbeat sent meanwhile then over-counts for a moment
        # (admits less), never under-counts.
        self.inflight[key] = self.inflight.get(key, 0) + 1
        try:
            refusal = await asyncio.wait_for(self.handle.acquire.remote(self.holder, key), self.call_timeout_s)
            self._outage = False
        except (TimeoutError, ray.exceptions.RayError) as exc:
            if not self._outage:
                log.warning("admission ledger unreachable (%r): this router applies the limits alone", exc)
                self._outage = True
            refusal = self._alone(key)
        except BaseException:  # cancelled (the client left): nothing was taken
            self.inflight[key] -= 1
            raise
        if refusal:
            self.inflight[key] -= 1
            raise RateLimited(refusal.message, retry_after_s=refusal.retry_after_s)
        return once(lambda: self._release(key))

    def _alone(self, key: str) -> Refusal | None:
        """The limits on this router's own books: every request it holds counts, however admitted."""
        self.fallback.restate("", {**self.inflight, key: self.inflight[key] - 1})
        return self.fallback.acquire(key)

    def _release(self, key: str) -> None:
        self.inflight[key] -= 1
        try:  # not awaited: the next heartbeat restates this router's load anyway
            self.handle.release.remote(self.holder, key)
        except ray.exceptions.RayError:
            pass

    def start(self) -> None:
        self._task = asyncio.create_task(self._heartbeats(), name="admission-ledger-heartbeat")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            self.handle.leave.remote(self.holder)
        except ray.exceptions.RayError:
            pass

    async def _heartbeats(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.handle.heartbeat.remote(self.holder, dict(self.inflight)), self.heartbeat_s)
            except ray.exceptions.RayActorError:  # ended (its owner stopped): a new one may stand
                self.handle = await asyncio.to_thread(_current_ledger, self.handle)
            except (TimeoutError, ray.exceptions.RayError) as exc:
                log.debug("admission ledger heartbeat failed: %r", exc)
            await asyncio.sleep(self.heartbeat_s)


def _current_ledger(known):
    """The cluster's ledger as Ray names it now (another launcher may have made a new one), else
    the one known."""
    try:
        return ray.get_actor(LEDGER_NAME)
    except ValueError:
        return known
