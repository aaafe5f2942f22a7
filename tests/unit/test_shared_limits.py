"""Per-key limits that several routers share (router/admission.py `KeyLimits`, held by
deploy/admission_ledger.py's `AdmissionLedger`): a key gets its limits once for the whole
cluster, a router that dies leaks no slot, a ledger restarted empty learns every router's load
again, and a router that cannot reach the ledger still applies the limits alone. The ledger's
logic runs here as a plain object; tests/e2e/test_two_routers.py runs it as the Ray actor."""

from __future__ import annotations

import asyncio
import time

import pytest

from deploy.admission_ledger import AdmissionLedger, LedgerLimits
from router.admission import KeyLimits
from router.errors import RateLimited


def test_concurrency_counts_every_holders_requests_together():
    limits = KeyLimits(rate_per_s=None, max_concurrency=2)
    assert limits.acquire("k", "router-a") is None
    assert limits.acquire("k", "router-b") is None
    refusal = limits.acquire("k", "router-a")
    assert refusal and "2 requests in flight" in refusal.message
    assert limits.acquire("other", "router-a") is None  # per key
    limits.release("k", "router-b")
    assert limits.acquire("k", "router-a") is None


def test_a_refused_request_costs_no_rate_token():
    limits = KeyLimits(rate_per_s=2.0, max_concurrency=1)  # a burst of 2
    assert limits.acquire("k") is None
    assert "in flight" in limits.acquire("k").message
    limits.release("k")
    assert limits.acquire("k") is None  # the burst's second token was still there
    limits.release("k")
    assert "rate limit" in limits.acquire("k").message


def test_a_holder_restates_and_withdraws_its_own_counts():
    limits = KeyLimits(None, 3)
    for _ in range(3):
        assert limits.acquire("k", "a") is None
    limits.restate("a", {"k": 1})  # its books say one is left
    assert limits.inflight("k") == 1
    limits.forget("a")
    assert limits.inflight("k") == 0


def test_the_ledger_forgets_a_router_that_went_silent():
    ledger = AdmissionLedger(None, 1, lease_s=0.2)
    assert ledger.acquire("dead-router", "k") is None
    assert ledger.acquire("live-router", "k") is not None  # the dead one's slot still counts
    time.sleep(0.3)
    ledger.heartbeat("live-router", {})
    assert ledger.holders() == ["live-router"]
    assert ledger.acquire("live-router", "k") is None


def test_a_ledger_restarted_empty_learns_the_load_from_the_next_heartbeats():
    restarted = AdmissionLedger(None, 2)
    restarted.heartbeat("a", {"k": 1})
    restarted.heartbeat("b", {"k": 1})
    assert restarted.acquire("c", "k") is not None


class _Remote:
    """A fake Ray actor method (named so): `.remote()` calls the ledger, or fails like a dead actor."""

    def __init__(self, call, dead: list[bool]) -> None:
        self.call, self.dead = call, dead

    def remote(self, *args) -> asyncio.Future:
        """Runs at once, as Ray submits at once; a dead actor's answer never comes (the client's
        timeout decides)."""
        answer = asyncio.get_running_loop().create_future()
        if not self.dead[0]:
            answer.set_result(self.call(*args))
        return answer


class FakeLedgerHandle:
    """An AdmissionLedger behind fake actor methods (named so): the client's own logic is under test."""

    def __init__(self, ledger: AdmissionLedger) -> None:
        self.dead = [False]
        for name in ("acquire", "release", "heartbeat", "leave", "settings"):
            setattr(self, name, _Remote(getattr(ledger, name), self.dead))


async def test_two_routers_share_one_keys_limit_and_a_router_alone_keeps_it_while_the_ledger_is_away():
    handle = FakeLedgerHandle(AdmissionLedger(None, 2))
    first, second = (LedgerLimits(handle, (None, 2), call_timeout_s=0.05) for _ in range(2))
    release_first = await first.acquire("k")
    await second.acquire("k")
    with pytest.raises(RateLimited):
        await first.acquire("k")
    release_first()
    assert first.inflight == {"k": 0}
    await second.acquire("k")  # the released slot is the cluster's again

    handle.dead[0] = True  # unreachable: each router applies the same limits on its own books,
    with pytest.raises(RateLimited):  # its slots admitted by the ledger before the outage included
        await second.acquire("k")
    alone = [await first.acquire("k"), await first.acquire("k")]
    with pytest.raises(RateLimited):
        await first.acquire("k")
    assert first.inflight == {"k": 2}  # what its next heartbeat restates to the ledger

    handle.dead[0] = False  # back: the heartbeats restate what each holds, however admitted
    ledger = handle.acquire.call.__self__
    for router in (first, second):
        await handle.heartbeat.remote(router.holder, dict(router.inflight))
    assert ledger.limits.inflight("k") == 4
    for release in alone:
        release()
    assert first.inflight == {"k": 0} and ledger.limits.inflight("k") == 2


async def test_an_admission_cancelled_while_the_ledger_answers_takes_nothing():
    handle = FakeLedgerHandle(AdmissionLedger(None, 1))
    handle.dead[0] = True  # an answer that does not come before the client leaves
    limits = LedgerLimits(handle, (None, 1), call_timeout_s=10)
    waiting = asyncio.create_task(limits.acquire("k"))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert limits.inflight == {"k": 0}
