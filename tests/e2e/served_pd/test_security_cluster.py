"""What keeps a cluster whole when its router goes and comes back, on a real Ray cluster
(docs/security.md, attacks 7 and 10): a new launcher adopts only actors that prove the cluster's
secret, a failed restart leaves the fleet it adopted serving, and a store shard that restarts
empty takes the store's entries out of the router's KV index.

The actors a launcher adopts here are fakes (`FakeActor`: the calls adoption makes, nothing
served), named as our engines and shards are, in the namespace a launcher looks in; the shard's
restart is a real one, in a real `pdcluster serve`."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from deploy.launcher import Launcher
from deploy.ray_head import RAY_NAMESPACE
from deploy.store_shards import STORE_SHARD_PREFIX
from engine.config import EngineConfig
from engine.lifecycle import EngineDescription
from engine.role_spec import Role
from fleet.instances import InstanceRegistry
from loadtest.engine_standin import StandInIdentity
from loadtest.local_cluster import RayHead
from router.kv_event_listener import STORE_HOLDER
from security.credentials import ClusterCredentials

pytestmark = pytest.mark.slow
CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)
IMPOSTOR = ClusterCredentials.generate()  # one with Ray's token (it reached the cluster) but not this secret
LONG = " ".join(f"line {k}: the store holds this prompt until its shard restarts." for k in range(60))


def fake_actor_class():
    """A Ray actor class standing for an engine or a store shard of whoever holds `credentials`;
    it records the calls a launcher makes. (Defined in a function: Ray's workers then get the
    class itself, not a reference to this test module, which they cannot import.)"""
    import ray

    class FakeActor:
        def __init__(self, credentials: ClusterCredentials, kind: str, description: dict):
            self.credentials, self.kind, self.description = credentials, kind, description
            self.called: list[str] = []

        def prove(self, nonce: str) -> str:
            self.called.append("prove")
            return self.credentials.prove(self.kind, nonce)

        def describe(self) -> dict:
            self.called.append("describe")
            return self.description

        def stop(self) -> dict:
            self.called.append("stop")
            return self.description

        def close(self) -> None:
            self.called.append("close")

        def calls(self) -> list[str]:
            return list(self.called)

    return ray.remote(num_cpus=0)(FakeActor)


@pytest.fixture(scope="module")
def ray_driver():
    """A Ray head of its own (as on a `ray up` head) and this process as its driver."""
    import ray

    with RayHead() as head:
        ray.init(address=head.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        try:
            yield fake_actor_class()
        finally:
            ray.shutdown()


@pytest.fixture
def fake_actor(ray_driver):
    """`fake_actor(name, credentials, kind)`: a detached named FakeActor; all are ended after the test."""
    import ray

    made = []

    def make(name: str, credentials: ClusterCredentials, kind: str = "engine", description: dict | None = None):
        actor = ray_driver.options(name=name, lifetime="detached").remote(credentials, kind, description or {})
        made.append(actor)
        return actor

    yield make
    for actor in made:
        ray.kill(actor)


@pytest.fixture
def config(tmp_path) -> EngineConfig:
    (tmp_path / "config.json").write_text("{}")  # a model folder, as far as the config checks
    return EngineConfig(model=tmp_path, served_model_name="tiny")


def ready_engine(instance_id: str, config: EngineConfig, kv_store: bool = True) -> EngineDescription:
    """What a ready colocated engine of `config`'s model describes itself as (its endpoint sealed
    under the cluster's key of that instance), one of a fleet with a KV store unless `kv_store` is false."""
    return StandInIdentity(instance_id, 9, CREDENTIALS).description(
        model=str(config.model), served_model_name=config.served_model_name, kv_store=kv_store)


def calls(actor) -> list[str]:
    import ray

    return ray.get(actor.calls.remote(), timeout=30)


def ended(actor, timeout_s: float = 30) -> bool:
    """Whether `actor` is gone within `timeout_s` (ray.kill takes effect a moment later)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            calls(actor)
        except ray.exceptions.RayActorError:
            return True
        time.sleep(0.2)
    return False


async def test_a_launcher_adopts_only_actors_that_prove_the_cluster_secret(fake_actor, config):
    """Named as an engine and a shard of ours would be, in our namespace, ready and of our model:
    without the secret they are neither adopted nor told to stop (not ours to end)."""
    ours = fake_actor("tiny-colocated-0", CREDENTIALS, description=ready_engine("tiny-colocated-0", config))
    engine = fake_actor("tiny-colocated-1", IMPOSTOR, description=ready_engine("tiny-colocated-1", config))
    shard = fake_actor(f"{STORE_SHARD_PREFIX}impostor", IMPOSTOR, kind="store-shard")
    posing = fake_actor(f"{STORE_SHARD_PREFIX}posing", CREDENTIALS, kind="engine")  # an engine's proof, as a shard
    registry = InstanceRegistry()
    launcher = Launcher(registry, CREDENTIALS)
    adopted = await launcher.adopt([config], {Role.COLOCATED}, keep_store=True)
    assert adopted == ("tiny-colocated-0",)
    assert [i.instance_id for i in registry.all()] == ["tiny-colocated-0"]
    assert launcher.store.shards == {}
    assert calls(ours) == ["prove", "describe"]
    assert calls(engine) == calls(shard) == calls(posing) == ["prove"]


async def test_a_launcher_stops_engines_that_no_longer_fit_the_fleet(fake_actor, config):
    """A restart that turns the store on or off (`--shared-store`, `--kv-transfer`) or changes the
    topology cannot reuse an engine started the other way: its KV connector was fixed at its start.
    It is stopped, not adopted."""
    with_store = fake_actor("tiny-colocated-0", CREDENTIALS, description=ready_engine("tiny-colocated-0", config))
    without = fake_actor("tiny-colocated-1", CREDENTIALS,
                         description=ready_engine("tiny-colocated-1", config, kv_store=False))
    colocated = {Role.COLOCATED}
    assert await Launcher(InstanceRegistry(), CREDENTIALS).adopt([config], colocated, keep_store=False) == (
        "tiny-colocated-1",)
    assert ended(with_store)
    assert await Launcher(InstanceRegistry(), CREDENTIALS).adopt([config], {Role.PREFILL, Role.DECODE},
                                                                 keep_store=False) == ()
    assert ended(without)


async def test_a_failed_router_restart_leaves_the_adopted_fleet_serving(fake_actor, config):
    """A launcher whose router failed to start (`shutdown(keep_adopted=True)`) stops neither the
    engines nor the shards it adopted; the next attempt adopts them again, and its clean stop ends them."""
    engine = fake_actor("tiny-colocated-0", CREDENTIALS, description=ready_engine("tiny-colocated-0", config))
    shard = fake_actor(f"{STORE_SHARD_PREFIX}node", CREDENTIALS, kind="store-shard")
    failed = Launcher(InstanceRegistry(), CREDENTIALS)
    await failed.adopt([config], {Role.COLOCATED}, keep_store=True)
    await failed.shutdown(keep_adopted=True)
    assert calls(engine) == ["prove", "describe"] and calls(shard) == ["prove"]  # still there, untouched
    again = Launcher(InstanceRegistry(), CREDENTIALS)
    assert await again.adopt([config], {Role.COLOCATED}, keep_store=True) == ("tiny-colocated-0",)
    assert list(again.store.shards) == [f"{STORE_SHARD_PREFIX}node"]
    await again.shutdown()
    assert ended(engine) and ended(shard)


def store_entries(server) -> int:
    """How many of LONG's leading blocks the router's index says the store holds."""
    body = {"model": "tiny", "prompt": LONG}
    explained = httpx.post(f"{server.url}/admin/explain", json=body, headers=server.credentials.admin_headers(),
                           timeout=30).json()
    return explained["matched_blocks"].get(STORE_HOLDER, 0)


def wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.5)


def test_a_restarted_store_shard_takes_the_stores_entries_out_of_the_index(served_pd):
    """A shard Ray restarted holds nothing: the router must not send decode instances to load what
    the index still says the store holds (each would be a miss, a wasted round trip)."""
    response = httpx.post(f"{served_pd.url}/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 1},
                          timeout=120)
    assert response.status_code == 200, response.text
    wait_for(lambda: store_entries(served_pd) > 0, 30)  # the prefill instance's saves, as events
    (shard,) = httpx.get(f"{served_pd.url}/admin/store", headers=served_pd.credentials.admin_headers(),
                         timeout=10).json()["shards"]
    os.kill(shard["pid"], signal.SIGKILL)
    wait_for(lambda: store_entries(served_pd) == 0, 90)  # Ray restarts it; the launcher's watch sees a new boot
