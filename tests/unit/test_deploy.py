"""Deploying, offline: cluster YAMLs against Ray's own schema, the topology and placement from
flags, when a pool grows, and the launcher's drains and sleeps (no Ray actor behind it). The pool
controller's decisions: tests/unit/test_pool_controller.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from decode.role import DECODE
from deploy.actor_placement import placement_options
from deploy.cluster import ClusterConfigError, validate_cluster_yaml
from deploy.pool import PoolSpec, wants_more
from deploy.topology import Topology, roles_to_start
from engine.role_spec import COLOCATED
from fleet.instances import Instance
from prefill.role import PREFILL

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = sorted((ROOT / "deploy" / "clusters").glob("*.yaml"))


def test_every_cluster_file_the_readme_names_is_one_validated_here():
    """The README's cluster steps tell a user which file to copy: each is among those checked below."""
    named = set(re.findall(r"deploy/clusters/[\w.-]+\.yaml", (ROOT / "README.md").read_text()))
    assert named and named <= {str(p.relative_to(ROOT)) for p in CLUSTERS}, named


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.name)
def test_cluster_yaml_validates_against_rays_schema(path):
    config = validate_cluster_yaml(path)
    assert config["cluster_name"].startswith("pdcluster")


def test_gpu_cluster_has_role_node_types_with_bounds():
    config = validate_cluster_yaml(Path(CLUSTERS[0].parent / "aws-gpu.yaml"))
    types = config["available_node_types"]
    assert types["prefill_gpu"]["resources"]["prefill"] >= 1
    assert types["decode_gpu"]["resources"]["decode"] >= 1
    assert types["decode_gpu"]["min_workers"] == 0  # decode scales from zero
    assert types["decode_gpu"]["max_workers"] > 0


def test_a_broken_yaml_is_reported_with_its_path(tmp_path):
    config = yaml.safe_load(CLUSTERS[0].read_text())
    config["provider"]["no_such_field"] = 1
    config["nonsense"] = True
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(config))
    with pytest.raises(ClusterConfigError, match="broken.yaml"):
        validate_cluster_yaml(broken)


def test_pools_are_placed_by_role_resources():
    assert placement_options(PREFILL, gpus=1) == {
        "num_cpus": 0,
        "num_gpus": 1,
        "resources": {"prefill": 1},
    }
    assert placement_options(COLOCATED, gpus=0) == {"num_cpus": 0, "num_gpus": 0}


def test_topology_from_flags():
    assert Topology.from_args(2, 0, 0).roles("model") == [
        ("colocated-0", COLOCATED),
        ("colocated-1", COLOCATED),
    ]
    assert [r for _, r in Topology.from_args(1, 1, 2).roles("model")] == [PREFILL, DECODE, DECODE]
    with pytest.raises(ValueError, match="prefill"):
        Topology.from_args(1, 1, 0)
    assert Topology.from_args(2, 0, 0, colocated=True) == Topology.from_args(2, 0, 0)
    with pytest.raises(ValueError, match="--colocated"):
        Topology.from_args(1, 1, 1, colocated=True)


def test_topology_pools_scale_to_zero_only_with_a_standby():
    pools = Topology.from_args(0, 0, 0, standby=1, max_instances=2).pools()
    assert [(p.role, p.min_ready, p.max_ready, p.standby) for p in pools] == [(COLOCATED, 0, 2, 1)]
    with pytest.raises(ValueError, match="--standby"):
        Topology.from_args(0, 0, 0)
    pd = Topology.from_args(1, 1, 0, standby=1)
    assert [(p.role, p.min_ready, p.max_ready) for p in pd.pools()] == [
        (PREFILL, 1, 1),
        (DECODE, 0, 1),
    ]
    assert pd.ray_resources() == {"prefill": 2.0, "decode": 2.0}  # ready at most + standby, per pool
    with pytest.raises(ValueError, match="max_ready"):
        PoolSpec(model="m", role=DECODE, min_ready=3, max_ready=2)


def test_a_restarted_launcher_starts_only_what_adoption_did_not_cover():
    wanted = Topology.from_args(0, prefill=2, decode=1).roles("model")
    assert roles_to_start(wanted, []) == wanted
    adopted = [Instance("prefill-1", PREFILL, "http://127.0.0.1:1", model="m"),
               Instance("decode-1700000000-0", DECODE, "http://127.0.0.1:2", model="m")]
    assert roles_to_start(wanted, adopted) == [("prefill-0", PREFILL)]


def test_the_ttft_target_goes_to_the_pool_that_prefills():
    pd = Topology.from_args(1, 1, 1, target_ttft_s=0.5).pools()
    assert [(p.role, p.target_ttft_s) for p in pd] == [(PREFILL, 0.5), (DECODE, None)]
    assert Topology.from_args(1, 0, 0, target_ttft_s=0.5).pools()[0].target_ttft_s == 0.5
    with pytest.raises(ValueError, match="--target-ttft"):
        Topology.from_args(1, 0, 0, target_ttft_s=0)


@pytest.mark.parametrize(
    ("ready", "inflight", "queued", "growing", "ttft_p90", "grow"),
    [
        (0, 0, 0, 1, None, True),  # below min_ready: always, even while one starts
        (1, 1, 0, 0, None, False),  # light load, no TTFT samples yet
        (1, 0, 1, 0, None, True),  # a request waits
        (1, 9, 0, 0, None, True),  # more than target_inflight per instance
        (1, 1, 0, 0, 0.4, False),  # first tokens within target
        (1, 1, 0, 0, 0.6, True),  # first tokens later than target
        (1, 9, 1, 1, 0.6, False),  # every trigger, but one instance is already starting
    ],
)
def test_when_a_pool_grows(ready, inflight, queued, growing, ttft_p90, grow):
    spec = PoolSpec(model="m", role=COLOCATED, min_ready=1, max_ready=4, target_inflight=8, target_ttft_s=0.5)
    assert wants_more(spec, ready, inflight, queued, growing, ttft_p90) is grow
    untargeted = spec.model_copy(update={"target_ttft_s": None})
    assert wants_more(untargeted, 1, 1, 0, 0, ttft_p90=9.0) is False  # no target, no TTFT trigger


def bare_launcher(registry):
    """A Launcher with its registry and books only: no Ray actor behind it."""
    from deploy.launcher import Launcher

    launcher = Launcher.__new__(Launcher)
    launcher.registry, launcher._actors, launcher.instances, launcher._descriptors = registry, {}, {}, {}
    return launcher


async def test_an_instance_leaving_its_pool_takes_no_new_request_and_finishes_what_it_holds():
    import asyncio

    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry

    registry = InstanceRegistry()
    leaving = Instance("colocated-0", COLOCATED, "http://127.0.0.1:1", model="m")
    leaving.state, leaving.inflight = InstanceState.READY, 1
    registry.add(leaving)
    launcher = bare_launcher(registry)
    stopping = asyncio.create_task(launcher.stop_instance("colocated-0", drain_s=30))
    await asyncio.sleep(0.3)
    assert leaving.state == InstanceState.DRAINING and registry.ready() == []  # no new request
    assert registry.get("colocated-0") is leaving and not stopping.done()  # its stream goes on
    leaving.inflight = 0  # the stream ended
    await asyncio.wait_for(stopping, 2)
    assert registry.get("colocated-0") is None


class _FakeRemote:
    """A fake Ray actor method (named so): `.remote()` answers at once with `answer()`."""

    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self, *args):
        import asyncio

        future = asyncio.get_running_loop().create_future()
        future.set_result(self.answer(*args))
        return future


async def test_a_drain_waits_for_what_other_routers_sent_the_engine():
    """Another router's requests are not in this router's books: the engine's own count decides."""
    import asyncio

    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry

    registry = InstanceRegistry()
    leaving = Instance("colocated-0", COLOCATED, "http://127.0.0.1:1", model="m")
    registry.add(leaving)
    engine = {"running": 1, "draining": None}
    actor = type("FakeEngineActor", (), {
        "set_draining": _FakeRemote(lambda draining: engine.update(draining=draining)),
        "requests_in_flight": _FakeRemote(lambda: engine["running"]), "stop": _FakeRemote(lambda: None)})()
    launcher = bare_launcher(registry)
    launcher._actors["colocated-0"] = actor
    stopping = asyncio.create_task(launcher.stop_instance("colocated-0", drain_s=30))
    await asyncio.sleep(0.5)
    assert leaving.state == InstanceState.DRAINING and engine["draining"] is True  # every router reads it
    assert not stopping.done()  # this router holds nothing there, the engine still runs one
    engine["running"] = 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ray.kill", lambda actor: None)
        await asyncio.wait_for(stopping, 2)
    assert registry.get("colocated-0") is None


async def test_a_drain_ends_at_its_deadline():
    import asyncio

    from fleet.instances import InstanceRegistry

    registry = InstanceRegistry()
    stuck = Instance("colocated-0", COLOCATED, "http://127.0.0.1:1", model="m")
    stuck.inflight = 1
    registry.add(stuck)
    launcher = bare_launcher(registry)
    started = time.monotonic()
    await asyncio.wait_for(launcher.stop_instance("colocated-0", drain_s=0.2), 2)
    assert time.monotonic() - started >= 0.2  # it waited for the stream, then no longer
    assert registry.get("colocated-0") is None


def test_sleeping_standbys_are_for_colocated_pools_with_standbys():
    pools = Topology.from_args(1, 0, 0, standby=2, sleeping_standbys=True).pools()
    assert [(p.role, p.standby, p.standby_sleeps) for p in pools] == [(COLOCATED, 2, True)]
    with pytest.raises(ValueError, match="--sleeping-standbys"):
        Topology.from_args(0, 1, 1, standby=1, sleeping_standbys=True)  # P/D: the KV connector's memory
    with pytest.raises(ValueError, match="--sleeping-standbys"):
        Topology.from_args(1, 0, 0, sleeping_standbys=True)  # nothing to put to sleep


class SleepyActor:
    """Stands in for an engine actor: its `sleep` answers as told, its engine runs nothing."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.calls = error, 0
        self.sleep = self
        self.set_draining, self.requests_in_flight = _FakeRemote(lambda draining: None), _FakeRemote(lambda: 0)

    async def _answer(self):
        self.calls += 1
        if self.error:
            raise self.error
        return {"total_s": 0.1, "stages_s": {"host_copy": 0.05, "sleep": 0.05}}

    def remote(self):
        return self._answer()


@pytest.mark.parametrize("case", ["busy", "refused", "broken", "asleep"])
async def test_an_instance_put_to_sleep_ends_asleep_awake_or_stopped(case):
    from rich.console import Console

    from deploy.launcher import StartedInstance
    from engine.host import SleepRefused
    from engine.lifecycle import InstanceState
    from fleet.instances import InstanceRegistry

    registry = InstanceRegistry()
    instance = Instance("c-0", COLOCATED, "http://127.0.0.1:1", model="m")
    instance.inflight = 1 if case == "busy" else 0
    registry.add(instance)
    launcher = bare_launcher(registry)
    launcher.console = Console(quiet=True)
    error = {"refused": SleepRefused("no pinned memory"), "broken": RuntimeError("sleep timed out")}.get(case)
    actor = SleepyActor(error)
    launcher.instances["c-0"] = StartedInstance("c-0", actor, instance.url, COLOCATED, {})
    if error:
        with pytest.raises(type(error)):
            await launcher.sleep_instance("c-0", drain_s=0.2)
    else:
        await launcher.sleep_instance("c-0", drain_s=0.2)
    expected = {"busy": (InstanceState.READY, 0), "refused": (InstanceState.READY, 1),
                "asleep": (InstanceState.SLEEPING, 1)}
    if case == "broken":  # half asleep or gone: out of the registry, never served again
        assert registry.get("c-0") is None and actor.calls == 1
    else:
        assert (instance.state, actor.calls) == expected[case]
