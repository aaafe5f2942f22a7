"""Launcher.reap with fake actors (named so; no Ray cluster): an instance is stopped only when its
engine is known gone (its process exited, or its actor died), never when it is merely slow or
unavailable for now, which it may come back from."""

from __future__ import annotations

import pytest
import ray.exceptions

from deploy import launcher as launcher_module
from deploy.launcher import Launcher
from engine.lifecycle import InstanceState
from engine.role_spec import COLOCATED
from fleet.instances import Instance, InstanceRegistry
from loadtest.engine_standin import StandInIdentity
from security.credentials import ClusterCredentials


class FakeMethod:
    """A fake actor method: `.remote()` gives an awaitable that answers or raises `answer`."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self, *args):
        async def call():
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return call()


class FakeActor:
    def __init__(self, describe) -> None:
        self.describe = FakeMethod(describe)
        self.stop = FakeMethod({})
        self.requests_in_flight = FakeMethod(0)


@pytest.fixture
def killed(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(launcher_module.ray, "kill", calls.append)
    monkeypatch.setattr("deploy.draining.ray.kill", calls.append)
    return calls


@pytest.mark.parametrize(("describe", "reaped"), [
    (StandInIdentity("i", 1).description(exited=True), True),  # its engine process exited (killed, crashed)
    (ray.exceptions.ActorDiedError(), True),  # the actor itself is gone
    (StandInIdentity("i", 1).description(exited=False), False),  # alive: frozen or slow, it may come back
    (ray.exceptions.ActorUnavailableError("its node is cut off", None), False),  # may come back too
    (TimeoutError("no answer"), False),
])
async def test_only_an_instance_whose_engine_is_gone_is_stopped(killed, describe, reaped):
    registry = InstanceRegistry()
    launcher = Launcher(registry, ClusterCredentials.generate())
    actor = FakeActor(describe)
    launcher._actors["i"] = actor
    registry.add(Instance("i", COLOCATED, "http://127.0.0.1:1", InstanceState.FAILED, model="m"))
    assert await launcher.reap("i") is reaped
    assert (registry.get("i") is None) is reaped
    assert (actor in killed) is reaped
    assert ("i" in launcher._actors) is not reaped
