"""The KV store's shards following the engines' nodes (deploy/store_shards.py), and the router's
health checks (fleet/instances.py), with no engine and no Ray cluster.

`StoreShards` runs against fakes of what it asks Ray (named so: `FakeRay`, `FakeShardActorClass`,
`FakeShard`), which keep the member lists shards are told as kvstore/shard.py does (an older epoch
is ignored). The health monitor checks a stand-in engine on a real loopback socket (a stdlib HTTP
server whose /health answers what the test says).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from types import SimpleNamespace

import pytest
from rich.console import Console

from deploy import store_shards
from deploy.store_shards import STORE_SHARD_PREFIX, StoreShards
from engine.lifecycle import InstanceState
from fleet.instances import InstanceRegistry
from loadtest.engine_standin import AppStandIn, unreachable_instance
from router.health import HealthMonitor
from security.credentials import ClusterCredentials


def node(name: str) -> str:
    """A Ray node id (56 hex digits) for a name."""
    return hashlib.sha224(name.encode()).hexdigest()


def endpoint(node_id: str) -> str:
    return f"tcp://{node_id[:8]}:7000"


ROUTER_NODE, NODE_1, NODE_2, NODE_3 = node("router"), node("1"), node("2"), node("3")


class _Remote:
    """A fake actor method: `.remote(...)` gives an awaitable, as a Ray ObjectRef is."""

    def __init__(self, method) -> None:
        self._method = method

    def remote(self, *args):
        async def call():
            return self._method(*args)

        return call()


class FakeShard:
    """Stands in for one store shard actor: its endpoint, boot id and the member list it holds."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.endpoint = endpoint(node_id)
        self.boot_id = "boot-1"
        self.members: list[str] = []
        self.epoch = 0
        self.told: list[tuple[list[str], int]] = []
        self.membership = _Remote(lambda: {"endpoint": self.endpoint, "epoch": self.epoch,
                                           "boot_id": self.boot_id, "members": list(self.members)})
        self.set_members = _Remote(self._set_members)

    def _set_members(self, endpoints: list[str], epoch: int) -> None:
        self.told.append((list(endpoints), epoch))
        if epoch > self.epoch:  # as ShardServer.set_members: an older count is ignored
            self.members, self.epoch = list(endpoints), epoch


class FakeShardActorClass:
    """Stands in for `StoreShard` (the Ray actor class): `.options(...).remote(**options)` starts a
    FakeShard on the node its node-affinity strategy names."""

    def __init__(self) -> None:
        self.started: dict[str, FakeShard] = {}  # by actor name
        self.options_seen: list[dict] = []

    def options(self, name: str, scheduling_strategy, **options):
        def remote(**init) -> FakeShard:
            self.options_seen.append({**options, **init})
            shard = self.started[name] = FakeShard(scheduling_strategy.node_id)
            return shard

        return SimpleNamespace(remote=remote)


class FakeRay:
    """Stands in for the `ray` module as deploy/store_shards.py uses it: the cluster's nodes (one
    of them dead), the node this process runs on, and the actors it kills."""

    def __init__(self, nodes: set[str]) -> None:
        self.alive = set(nodes)
        self.killed: list[FakeShard] = []

    def nodes(self) -> list[dict]:
        return [{"NodeID": n, "Alive": True} for n in sorted(self.alive)] + [{"NodeID": node("dead"), "Alive": False}]

    def get_runtime_context(self):
        return SimpleNamespace(get_node_id=lambda: ROUTER_NODE)

    def kill(self, actor: FakeShard) -> None:
        self.killed.append(actor)


@pytest.fixture
def cluster(monkeypatch):
    """A fake Ray cluster of the router's node and three others, engines on none yet; returns
    (StoreShards, FakeRay, FakeShardActorClass, the set of nodes hosting engines)."""
    ray = FakeRay({ROUTER_NODE, NODE_1, NODE_2, NODE_3})
    actor_class = FakeShardActorClass()
    monkeypatch.setattr(store_shards, "ray", ray)
    monkeypatch.setattr(store_shards, "StoreShard", actor_class)
    engine_nodes: set[str] = set()

    async def fake_engine_nodes(timeout_s: float) -> set[str]:  # what the launcher asks its engines
        return set(engine_nodes)

    shards = StoreShards(ClusterCredentials.generate(), Console(quiet=True), fake_engine_nodes)
    return shards, ray, actor_class, engine_nodes


def _shard_nodes(shards: StoreShards) -> set[str]:
    return {name.removeprefix(STORE_SHARD_PREFIX) for name in shards.shards}


def _epochs(shards: StoreShards) -> set[int]:
    return {shard.epoch for shard in shards.shards.values()}


async def test_a_shard_runs_on_each_node_hosting_engines_and_the_routers(cluster):
    shards, ray, actor_class, engine_nodes = cluster
    endpoints = await shards.start(capacity_bytes=1024**2)
    # Before the engines are placed: one on every live node (the dead one gets none).
    assert _shard_nodes(shards) == {ROUTER_NODE, NODE_1, NODE_2, NODE_3}
    assert endpoints == tuple(sorted(endpoint(n) for n in _shard_nodes(shards)))
    assert all(o["capacity_bytes"] == 1024**2 and o["lifetime"] == "detached" for o in actor_class.options_seen)

    engine_nodes.update({NODE_1, NODE_2})
    endpoints = await shards.reconcile()
    assert _shard_nodes(shards) == {ROUTER_NODE, NODE_1, NODE_2}
    assert endpoints == tuple(sorted(endpoint(n) for n in (ROUTER_NODE, NODE_1, NODE_2)))
    assert all(list(endpoints) == shard.members for shard in shards.shards.values())  # every shard was told


async def test_a_node_whose_engines_left_loses_its_shard(cluster):
    shards, ray, actor_class, engine_nodes = cluster
    engine_nodes.update({NODE_1, NODE_2, NODE_3})
    await shards.start(capacity_bytes=1024**2)
    node_2 = actor_class.started[f"{STORE_SHARD_PREFIX}{NODE_2}"]

    engine_nodes.discard(NODE_2)
    endpoints = await shards.reconcile()
    assert ray.killed == [node_2]
    assert _shard_nodes(shards) == {ROUTER_NODE, NODE_1, NODE_3}
    assert node_2.endpoint not in endpoints
    # A node that leaves the cluster loses its shard too, engines or not.
    ray.alive.discard(NODE_3)
    await shards.reconcile()
    assert _shard_nodes(shards) == {ROUTER_NODE, NODE_1}


async def test_a_new_member_list_gets_a_higher_epoch_and_an_unchanged_one_keeps_it(cluster):
    shards, ray, actor_class, engine_nodes = cluster
    engine_nodes.add(NODE_1)
    ray.alive = {ROUTER_NODE, NODE_1}
    await shards.start(capacity_bytes=1024**2)
    (first,) = _epochs(shards)

    told = sum(len(s.told) for s in shards.shards.values())
    await shards.reconcile()  # nothing changed: no new epoch, nobody told again
    assert _epochs(shards) == {first}
    assert sum(len(s.told) for s in shards.shards.values()) == told

    ray.alive.add(NODE_2)  # a node joins and an engine is placed there
    engine_nodes.add(NODE_2)
    endpoints = await shards.reconcile()
    assert endpoint(NODE_2) in endpoints
    (second,) = _epochs(shards)  # the new shard and the old ones hold the same, newer list
    assert second > first
    assert all(shard.members == list(endpoints) for shard in shards.shards.values())


async def test_a_restarted_shard_is_reported_so_the_router_forgets_what_it_held(cluster):
    shards, ray, actor_class, engine_nodes = cluster
    restarts: list[bool] = []
    shards.on_restart.append(lambda: restarts.append(True))
    await shards.start(capacity_bytes=1024**2)
    await shards.reconcile()
    assert restarts == []
    actor_class.started[f"{STORE_SHARD_PREFIX}{ROUTER_NODE}"].boot_id = "boot-2"  # Ray restarted it, empty
    await shards.reconcile()
    assert restarts == [True]


class HealthSwitch:
    """The stand-in engine's app: /health answers 200 while `healthy`, else 503; it counts the
    failed answers and keeps the Authorization headers it was sent."""

    def __init__(self) -> None:
        self.healthy = True
        self.failed_answers = 0
        self.authorizations: set[str] = set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        self.authorizations.add(dict(scope["headers"]).get(b"authorization", b"").decode())
        self.failed_answers += not self.healthy
        await send({"type": "http.response.start", "status": 200 if self.healthy else 503, "headers": []})
        await send({"type": "http.response.body", "body": b""})


class StandInEngine(AppStandIn):
    """Stands in for an engine's server (no engine runs), served as engines are (TLS, token)."""

    def __init__(self, instance_id: str = "colocated-0") -> None:
        self.switch = HealthSwitch()
        super().__init__(self.switch, instance_id)


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the health monitor did not get there in time"
        await asyncio.sleep(0.01)


def _monitor(registry: InstanceRegistry, failure_threshold: int) -> HealthMonitor:
    return HealthMonitor(registry, interval_s=0.05, timeout_s=2.0, failure_threshold=failure_threshold)


async def test_an_instance_failing_health_checks_leaves_rotation_and_comes_back_when_it_passes():
    registry = InstanceRegistry()
    with StandInEngine() as engine:
        instance = engine.instance()
        registry.add(instance)
        monitor = _monitor(registry, failure_threshold=3)
        monitor.start()
        try:
            await asyncio.sleep(0.3)  # passing checks change nothing
            assert registry.ready() == [instance]
            engine.switch.healthy = False
            await _until(lambda: not registry.ready())
            assert instance.state == InstanceState.FAILED
            assert engine.switch.failed_answers >= 3  # not on the first failed check: three in a row
            engine.switch.healthy = True
            await _until(lambda: registry.ready() == [instance])
        finally:
            await monitor.stop()
    # every check carried this engine process's token (the stand-in's own check refuses others)
    assert engine.switch.authorizations == {f"Bearer {engine.keys.engine_token}"}


async def test_an_instance_nobody_answers_for_leaves_rotation():
    registry = InstanceRegistry()
    instance = unreachable_instance("colocated-0")
    registry.add(instance)
    monitor = _monitor(registry, failure_threshold=2)
    monitor.start()
    try:
        await _until(lambda: instance.state == InstanceState.FAILED)
    finally:
        await monitor.stop()


async def test_passing_checks_do_not_put_back_what_the_launcher_took_out():
    """A draining or sleeping instance is its launcher's to move: healthy, it still gets no traffic."""
    registry = InstanceRegistry()
    with StandInEngine() as engine:
        draining = engine.instance(state=InstanceState.DRAINING)
        sleeping = dataclasses.replace(engine.instance(state=InstanceState.SLEEPING), instance_id="colocated-1")
        registry.add(draining)
        registry.add(sleeping)
        monitor = _monitor(registry, failure_threshold=1)
        monitor.start()
        try:
            await asyncio.sleep(0.3)
        finally:
            await monitor.stop()
    assert (draining.state, sleeping.state) == (InstanceState.DRAINING, InstanceState.SLEEPING)
    assert registry.ready() == []


class LoadedEngine:
    """A stand-in engine's app that says it holds `load` requests (vLLM's /load) and counts the
    completions it gets."""

    def __init__(self, load: int) -> None:
        self.load, self.completions = load, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b"{}"
        if scope["path"] == "/load":
            body = f'{{"server_load": {self.load}}}'.encode()
        elif scope["path"] == "/v1/completions":
            self.completions += 1
            body = b'{"choices": [{"index": 0, "text": "ok"}]}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


async def test_routers_side_by_side_count_the_load_the_engines_report():
    """Another router's requests fill one engine (it says so on /load): this router, which sent
    it none, sends its own to the other, and its health loop keeps both in rotation."""
    from router.policies import PolicyContext, RoutingRequest, make_policy

    busy, idle = LoadedEngine(load=7), LoadedEngine(load=0)
    with AppStandIn(busy, "c-0") as busy_engine, AppStandIn(idle, "c-1") as idle_engine:
        registry = InstanceRegistry()
        instances = [busy_engine.instance(), idle_engine.instance()]
        for instance in instances:
            registry.add(instance)
        monitor = _monitor(registry, failure_threshold=2)
        monitor.start()
        try:
            await _until(lambda: instances[0].engine_load == 7)
        finally:
            await monitor.stop()
        policy = make_policy("kv_aware", PolicyContext())
        chosen = {policy.choose(instances, RoutingRequest((), 0, 32)).instance.instance_id for _ in range(4)}
        assert chosen == {"c-1"} and [i.load for i in instances] == [7, 0]
        assert registry.ready() == instances
