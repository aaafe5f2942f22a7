"""A router that owns nothing follows the fleet another launcher owns (deploy/follower.py): engines
that prove the cluster's secret are registered in their hosts' states, those gone are removed,
other models and impostors are left alone (an impostor asked once, not at every look). Ray's
named actors are fakes here (named so); tests/e2e/test_two_routers.py follows a real fleet."""

from __future__ import annotations

import asyncio

import pytest

from deploy import follower as follower_module
from deploy.follower import FleetFollower
from engine.lifecycle import EngineDescription, InstanceState
from fleet.instances import InstanceRegistry
from loadtest.engine_standin import StandInIdentity
from security.credentials import ClusterCredentials

CREDENTIALS = ClusterCredentials.generate()
MODEL = ("/models/tiny", "tiny")


class _Method:
    """A fake actor method (named so): `.remote()` answers at once."""

    def __init__(self, answer) -> None:
        self.answer, self.calls = answer, 0

    def remote(self, *args) -> asyncio.Future:
        self.calls += 1
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self.answer(*args))
        except Exception as exc:  # as Ray raises an actor's error where its answer is awaited
            future.set_exception(exc)
        return future


class FakeEngineActor:
    """`sealed_by`: the cluster whose instance key seals its endpoint (default: `credentials`')."""

    def __init__(self, name: str, credentials: ClusterCredentials, model=MODEL, state: str = "ready",
                 sealed_by: ClusterCredentials | None = None) -> None:
        self.identity = StandInIdentity(name, 1, sealed_by or credentials)
        self.fields = {"model": model[0], "served_model_name": model[1], "state": state}
        self._actor_id = type("FakeActorId", (), {"hex": lambda _, name=name: f"id-{name}"})()
        self.prove = _Method(lambda nonce: credentials.prove("engine", nonce))
        self.answering = True
        self.describe = _Method(self._describe)

    def _describe(self) -> EngineDescription:
        if not self.answering:
            raise TimeoutError("a busy actor, a slow node")
        return self.identity.description(**{**self.fields, "state": InstanceState(self.fields["state"])})


@pytest.fixture
def actors(monkeypatch) -> dict[str, FakeEngineActor]:
    named: dict[str, FakeEngineActor] = {}
    monkeypatch.setattr(follower_module.ray.util, "list_named_actors", lambda: list(named))
    monkeypatch.setattr(follower_module.ray, "get_actor", lambda name: named[name])
    return named


async def test_the_fleet_is_followed_as_its_owner_changes_it(actors):
    actors["tiny-colocated-0"] = FakeEngineActor("tiny-colocated-0", CREDENTIALS)
    actors["other-colocated-0"] = FakeEngineActor("other-colocated-0", CREDENTIALS, model=("/models/x", "other"))
    actors["tiny-colocated-1"] = FakeEngineActor("tiny-colocated-1", CREDENTIALS, state="loading")
    registry = InstanceRegistry()
    follower = FleetFollower(registry, CREDENTIALS, {MODEL})
    await follower.sync()
    assert [i.instance_id for i in registry.all()] == ["tiny-colocated-0"]  # its model's, serving or able to

    actors["tiny-colocated-1"].fields["state"] = "ready"  # the owner's start finished
    actors["tiny-colocated-0"].fields["state"] = "draining"  # the owner drains it
    await follower.sync()
    states = {i.instance_id: i.state for i in registry.all()}
    assert states == {"tiny-colocated-0": InstanceState.DRAINING, "tiny-colocated-1": InstanceState.READY}

    actors["tiny-colocated-1"].answering = False  # one look without its answer: nothing changes
    await follower.sync()
    assert {i.instance_id for i in registry.all()} == {"tiny-colocated-0", "tiny-colocated-1"}
    actors["tiny-colocated-1"].answering = True

    registry.get("tiny-colocated-1").state = InstanceState.FAILED  # this router's health checks say so
    del actors["tiny-colocated-0"]  # stopped by its owner
    await follower.sync()
    assert {i.instance_id: i.state for i in registry.all()} == {"tiny-colocated-1": InstanceState.FAILED}


async def test_an_impostor_is_neither_followed_nor_asked_at_every_look(actors):
    impostor = actors["tiny-colocated-9"] = FakeEngineActor("tiny-colocated-9", ClusterCredentials.generate())
    registry = InstanceRegistry()
    follower = FleetFollower(registry, CREDENTIALS, {MODEL})
    for _ in range(3):
        await follower.sync()
    assert registry.all() == [] and impostor.prove.calls == 1 and impostor.describe.calls == 0


async def test_an_actor_that_proves_itself_but_publishes_an_endpoint_not_sealed_by_its_instance_is_not_followed(
        actors):
    """Someone with Ray's token and an engine's proof key, but not its instance's key (an engine's
    host of another cluster, or of another instance), cannot point the router at its listener."""
    actors["tiny-colocated-0"] = FakeEngineActor("tiny-colocated-0", CREDENTIALS,
                                                 sealed_by=ClusterCredentials.generate())
    registry = InstanceRegistry()
    await FleetFollower(registry, CREDENTIALS, {MODEL}).sync()
    assert registry.all() == []
