"""The pool controller (deploy/pool.py) against a recording stand-in for the launcher (no Ray, no
engine): standbys started, awake and sleeping ones activated, pre-imported processes used after
them, failed instances reaped once their engine is gone, several models' pools sharing a cap of
awake engines."""

from __future__ import annotations

import pytest

from decode.role import DECODE
from deploy.pool import PoolSpec
from deploy.topology import Topology
from engine.config import TensorParallel
from engine.role_spec import COLOCATED
from fleet.instances import Instance


class RecordingLauncher:
    """Stands in for the launcher (no Ray, no engine): records the standbys asked for and the
    instances activated, put to sleep or stopped, as the pool controller decides them."""

    def __init__(self, registry=None) -> None:
        self.registry = registry
        """Where it marks the instances it puts to sleep, as the launcher does (None: nowhere)."""
        self.standby_configs, self.activated, self.slept, self.stopped, self.peers_asked = [], [], [], [], []
        self.preimported_configs, self.activated_from, self.reaped, self.asked_to_reap = [], [], [], []
        self.gone: set[str] = set()
        self.most_awake = 0

    async def start_standby(self, instance_id, config, preimported=False):
        from engine.lifecycle import InstanceState

        (self.preimported_configs if preimported else self.standby_configs).append(config)
        if self.registry is not None:  # registered as the launcher does
            state = (InstanceState.PREIMPORTED if preimported else
                     InstanceState.SLEEPING if config.sleep_mode else InstanceState.STANDBY)
            self.registry.add(Instance(instance_id, config.role, f"http://127.0.0.1:{len(self.registry.all())}",
                                       state, model=config.served_model_name))

    async def peer_weights(self, model):
        self.peers_asked.append(model)
        return None

    async def activate(self, instance_id, peer):
        import asyncio

        from engine.lifecycle import InstanceState

        self.activated.append(instance_id)
        if self.registry is not None:  # waking takes a moment, as it does
            instance = self.registry.get(instance_id)
            self.activated_from.append(instance.state)
            instance.state = InstanceState.LOADING
            self.most_awake = max(self.most_awake, awake_count(self.registry))
            await asyncio.sleep(0.05)
            instance.state = InstanceState.READY
        return {"total_s": 0.0}

    async def reap(self, instance_id):
        """Stops only what `gone` names, as the launcher stops only instances whose engine exited."""
        self.asked_to_reap.append(instance_id)
        if instance_id not in self.gone:
            return False
        self.reaped.append(instance_id)
        if self.registry is not None:
            self.registry.remove(instance_id)
        return True

    async def sleep_instance(self, instance_id, drain_s):
        from engine.lifecycle import InstanceState

        self.slept.append(instance_id)
        if self.registry is not None:
            self.registry.get(instance_id).state = InstanceState.SLEEPING

    async def stop_instance(self, instance_id, drain_s):
        self.stopped.append(instance_id)


def awake_count(registry) -> int:
    from engine.lifecycle import InstanceState

    return sum(i.state in (InstanceState.READY, InstanceState.LOADING) for i in registry.all())


def engine_configs(folder, *names):
    from engine.config import EngineConfig

    (folder / "config.json").write_text("{}")  # a model folder as EngineConfig checks it; never loaded
    return [EngineConfig(model=folder, served_model_name=name) for name in names]


async def test_a_pool_starts_sleeping_standbys_and_activates_an_awake_one_first(tmp_path):
    from deploy.pool import PoolController
    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry
    from router.capacity import CapacityQueue

    registry, launcher = InstanceRegistry(), RecordingLauncher()
    spec = PoolSpec(model="m", role=COLOCATED, min_ready=0, max_ready=1, standby=1, standby_sleeps=True)
    controller = PoolController(launcher, registry, CapacityQueue(1, 1.0), [spec], engine_configs(tmp_path, "m"))
    await controller._add_standby(spec)
    assert [c.sleep_mode for c in launcher.standby_configs] == [True]
    registry.add(Instance("asleep", COLOCATED, "http://127.0.0.1:1", InstanceState.SLEEPING, model="m"))
    registry.add(Instance("awake", COLOCATED, "http://127.0.0.1:2", InstanceState.STANDBY, model="m"))
    controller._growing[spec.key] += 1
    await controller._grow(spec)
    assert launcher.activated == ["awake"]  # no wake-up to wait for


async def test_a_pool_keeps_preimported_processes_and_uses_them_after_standbys(tmp_path):
    """Awake standby > sleeping one > pre-imported process (issue #23), each kind kept to its count."""
    import asyncio

    from deploy.pool import PoolController
    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry
    from router.capacity import CapacityQueue

    registry = InstanceRegistry()
    launcher = RecordingLauncher(registry)
    spec = PoolSpec(model="m", role=COLOCATED, min_ready=0, max_ready=3, standby=1, preimported=2,
                    standby_sleeps=True)
    controller = PoolController(launcher, registry, CapacityQueue(1, 1.0), [spec], engine_configs(tmp_path, "m"))
    for _ in range(4):  # one start of each kind per step, up to its count
        controller._step(spec)
        await asyncio.sleep(0.01)
    assert [c.sleep_mode for c in launcher.standby_configs] == [True]
    assert [c.sleep_mode for c in launcher.preimported_configs] == [False, False]  # nothing to wake
    registry.add(Instance("awake", COLOCATED, "http://127.0.0.1:9", InstanceState.STANDBY, model="m"))
    for _ in range(4):
        controller._growing[spec.key] += 1
        await controller._grow(spec)
    assert launcher.activated_from == [InstanceState.STANDBY, InstanceState.SLEEPING,
                                       InstanceState.PREIMPORTED, InstanceState.PREIMPORTED]


async def test_failed_and_waiting_instances_are_asked_about_and_reaped_once_their_engine_is_gone(tmp_path):
    """A killed engine's actor holds its place (a GPU, its role's resource) until stopped, and a
    dead standby or pre-imported process would be counted as a standby forever: the pool asks the
    launcher to reap failed and waiting instances, which stops those whose engine is gone."""
    import asyncio

    from deploy.pool import PoolController
    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry
    from router.capacity import CapacityQueue

    registry = InstanceRegistry()
    launcher = RecordingLauncher(registry)
    launcher.gone = {"dead", "dead-preimported"}
    spec = PoolSpec(model="m", role=DECODE, min_ready=1, max_ready=1)
    controller = PoolController(launcher, registry, CapacityQueue(1, 1.0), [spec], engine_configs(tmp_path, "m"))
    for iid, state in [("dead", InstanceState.FAILED), ("frozen", InstanceState.FAILED),
                       ("dead-preimported", InstanceState.PREIMPORTED), ("standby", InstanceState.STANDBY),
                       ("live", InstanceState.READY)]:
        registry.add(Instance(iid, DECODE, f"http://127.0.0.1:{len(registry.all())}", state, model="m"))
    controller._step(spec)
    controller._step(spec)  # asked once, not on every step
    await asyncio.sleep(0.01)
    assert sorted(launcher.asked_to_reap) == ["dead", "dead-preimported", "frozen", "standby"]
    assert sorted(launcher.reaped) == ["dead", "dead-preimported"]
    assert sorted(i.instance_id for i in registry.all()) == ["frozen", "live", "standby"]


def test_preimported_processes_count_among_the_engines_a_head_places():
    topology = Topology.from_args(0, 0, 0, preimported=2, max_instances=2)  # scale-to-zero on them
    assert [(p.min_ready, p.preimported) for p in topology.pools()] == [(0, 2)]
    assert topology.ranks_at_most(TensorParallel()) == 4
    with pytest.raises(ValueError, match="--preimported"):
        Topology.from_args(1, 0, 0, preimported=-1)


def test_several_models_get_pools_of_their_own_and_ids_that_name_them():
    topology = Topology.from_args(1, 0, 0, sleep_when_idle=True, models=("a", "b"))
    assert [(p.model, p.role, p.min_ready, p.idle_sleeps) for p in topology.pools()] == [
        ("a", COLOCATED, 0, True), ("b", COLOCATED, 0, True)]  # a model nobody asks for may sleep entirely
    assert topology.roles("b") == [("b-colocated-0", COLOCATED)]
    assert Topology.from_args(1, 0, 0).roles("a") == [("colocated-0", COLOCATED)]  # one model: ids as before
    with pytest.raises(ValueError, match="colocated"):
        Topology.from_args(0, 1, 1, models=("a", "b"))
    with pytest.raises(ValueError, match="--sleep-when-idle"):
        Topology.from_args(0, 1, 1, sleep_when_idle=True)


async def test_an_idle_model_sleeps_and_a_request_for_a_sleeping_one_wakes_only_its_own(tmp_path):
    import asyncio

    from deploy.pool import PoolController
    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry
    from router.capacity import CapacityQueue

    registry, launcher, queue = InstanceRegistry(), RecordingLauncher(), CapacityQueue(4, 5.0)
    specs = [PoolSpec(model=m, role=COLOCATED, min_ready=0, max_ready=1, idle_sleeps=True, idle_s=0.01)
             for m in ("a", "b")]
    controller = PoolController(launcher, registry, queue, specs, engine_configs(tmp_path, "a", "b"))
    registry.add(Instance("a-colocated-0", COLOCATED, "http://127.0.0.1:1", model="a"))
    registry.add(Instance("a-colocated-1", COLOCATED, "http://127.0.0.1:3", InstanceState.SLEEPING, model="a"))
    registry.add(Instance("b-colocated-0", COLOCATED, "http://127.0.0.1:2", InstanceState.SLEEPING, model="b"))
    waiting = asyncio.create_task(queue.wait(lambda: registry.ready(model="b"), "b"))  # a request for b
    await asyncio.sleep(0.05)  # it waits; a has been idle past idle_s
    for spec in specs:
        controller._step(spec)
    await asyncio.sleep(0.05)  # the spawned sleep and activation
    assert launcher.slept == ["a-colocated-0"] and launcher.stopped == []
    assert launcher.activated == ["b-colocated-0"] and launcher.peers_asked == ["b"]
    waiting.cancel()
    await controller.stop()


async def test_under_max_awake_a_sleeping_model_wakes_only_after_an_idle_other_sleeps(tmp_path):
    from deploy.pool import PoolController
    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry
    from router.capacity import CapacityQueue

    registry = InstanceRegistry()
    launcher = RecordingLauncher(registry)
    specs = {m: PoolSpec(model=m, role=COLOCATED, min_ready=0, max_ready=1, idle_sleeps=True) for m in ("a", "b")}
    controller = PoolController(launcher, registry, CapacityQueue(4, 5.0), list(specs.values()),
                                engine_configs(tmp_path, "a", "b"), max_awake=1, room_timeout_s=0.3, swap_idle_s=0)
    awake = Instance("a-colocated-0", COLOCATED, "http://127.0.0.1:1", model="a")
    registry.add(awake)
    registry.add(Instance("b-colocated-0", COLOCATED, "http://127.0.0.1:2", InstanceState.SLEEPING, model="b"))

    awake.inflight = 1  # a is busy: b waits for room, then gives up; a keeps serving
    controller._growing[specs["b"].key] += 1
    await controller._grow(specs["b"])
    assert launcher.slept == [] and launcher.activated == [] and awake.state == InstanceState.READY

    awake.inflight = 0  # a is idle: it sleeps first, then b wakes
    controller._growing[specs["b"].key] += 1
    await controller._grow(specs["b"])
    assert launcher.slept == ["a-colocated-0"] and launcher.activated == ["b-colocated-0"]


async def test_under_max_awake_grows_at_once_never_wake_more_than_allowed(tmp_path):
    import asyncio

    from deploy.pool import PoolController
    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry
    from router.capacity import CapacityQueue

    registry = InstanceRegistry()
    launcher = RecordingLauncher(registry)
    specs = {m: PoolSpec(model=m, role=COLOCATED, min_ready=0, max_ready=1, idle_sleeps=True) for m in "abc"}
    controller = PoolController(launcher, registry, CapacityQueue(4, 5.0), list(specs.values()),
                                engine_configs(tmp_path, *"abc"), max_awake=1, room_timeout_s=5, swap_idle_s=0)
    registry.add(Instance("a-colocated-0", COLOCATED, "http://127.0.0.1:1", model="a"))
    for m in "bc":
        registry.add(Instance(f"{m}-colocated-0", COLOCATED, "http://127.0.0.1:2", InstanceState.SLEEPING, model=m))
    for m in "bc":
        controller._growing[specs[m].key] += 1
    await asyncio.gather(controller._grow(specs["b"]), controller._grow(specs["c"]))
    assert sorted(launcher.activated) == ["b-colocated-0", "c-colocated-0"]  # both got their turn...
    assert launcher.most_awake == 1 and awake_count(registry) == 1  # ...one at a time
