"""The router without engines: validation, error shapes, policies, dead instances."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from routers import router_client

from decode.role import DECODE
from engine.lifecycle import InstanceState
from engine.role_spec import COLOCATED
from fleet.instances import Instance, InstanceRegistry, PendingPrefill
from loadtest.engine_standin import SocketStandIn, unreachable_instance
from prefill.role import PREFILL
from router.app import build_app
from router.capacity import CapacityQueue, LatencyWindow
from router.config import RouterConfig, ServedModel
from router.errors import NoInstance
from router.placement import PlacementSettings, Placer
from router.policies import PolicyContext, RoutingRequest, make_policy
from router.proxy import Forwarder


def make_client(instances: list[Instance]) -> TestClient:
    return router_client(instances, raise_server_exceptions=True, policy="round_robin")


def test_no_instance_is_a_503_with_retry_after():
    with make_client([]) as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"]["type"] == "ServiceUnavailableError"
    with make_client([]) as client:
        assert client.get("/health").status_code == 503


def test_dead_instances_fail_fast_with_a_clean_error():
    with make_client([unreachable_instance("dead-0"), unreachable_instance("dead-1")]) as client:
        started = time.monotonic()
        first = client.post(
            "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
        second = client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        elapsed = time.monotonic() - started
    assert first.status_code == 502 and "unreachable" in first.json()["error"]["message"]
    assert second.status_code == 503  # both were taken out of rotation by the first failure
    assert elapsed < 10


def test_a_request_is_tried_only_on_its_own_models_instances():
    other = unreachable_instance("n-0")
    other.model = "n"  # another model's instance: dead too, so a try there would mark it failed
    registry = InstanceRegistry()
    for instance in (unreachable_instance("m-0"), unreachable_instance("m-1"), other):
        registry.add(instance)
    config = RouterConfig(models=(ServedModel(name="m", max_model_len=128), ServedModel(name="n", max_model_len=64)),
                          health_interval_s=60, policy="round_robin", queue_timeout_s=0)
    with TestClient(build_app(config, registry)) as client:
        listed = client.get("/v1/models").json()["data"]
        failed = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        too_long = client.post("/v1/completions", json={"model": "n", "prompt": "x", "max_tokens": 100})
    assert [(c["id"], c["max_model_len"]) for c in listed] == [("m", 128), ("n", 64)]
    assert failed.status_code == 502  # both of m's tried...
    assert registry.get("m-0").state == registry.get("m-1").state == InstanceState.FAILED
    assert other.state == InstanceState.READY  # ...and n's never
    assert too_long.status_code == 400 and "64" in too_long.json()["error"]["message"]  # n's own limit


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [[]]}, "prompt"),  # found by the fuzzer: was a 500
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": 3, "prompt": "x"}, "model"),
    ],
)
def test_validation_errors_name_the_parameter(body, param):
    with make_client([]) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"].split(".")[0] == param


def test_unknown_route_is_an_openai_404():
    with make_client([]) as client:
        response = client.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == 404


def test_models_lists_the_served_model():
    with make_client([]) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"


def test_round_robin_cycles_and_least_loaded_prefers_idle():
    instances = [Instance(f"i{n}", COLOCATED, "http://127.0.0.1:1", model="m") for n in range(3)]
    request = RoutingRequest((), 10, 32)
    rr = make_policy("round_robin")
    picks = [rr.choose(instances, request).instance.instance_id for _ in range(6)]
    assert picks == ["i0", "i1", "i2", "i0", "i1", "i2"]
    instances[0].inflight, instances[1].inflight, instances[2].inflight = 3, 1, 2
    assert make_policy("least_loaded").choose(instances, request).instance.instance_id == "i1"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope")
    assert make_policy("router.policies.basic:RoundRobin", PolicyContext()).name == "round_robin"


def test_registry_serves_only_ready_instances_of_serving_roles():
    registry = InstanceRegistry()
    registry.add(Instance("a", COLOCATED, "u", InstanceState.READY, model="m"))
    registry.add(Instance("b", COLOCATED, "u", InstanceState.LOADING, model="m"))
    registry.add(Instance("c", PREFILL, "u", InstanceState.READY, model="m"))
    assert [i.instance_id for i in registry.ready(lambda role: role.serves_clients)] == ["a"]
    with pytest.raises(ValueError):
        registry.add(Instance("a", COLOCATED, "u", model="m"))


def test_router_refuses_a_non_loopback_bind_unless_allowed():
    with pytest.raises(ValueError, match="not loopback"):
        RouterConfig(host="0.0.0.0", models=(ServedModel(name="m", max_model_len=1),))
    with pytest.raises(ValueError, match="API keys"):  # beyond loopback, only with keys
        RouterConfig(host="0.0.0.0", models=(ServedModel(name="m", max_model_len=1),), allow_remote=True)
    assert RouterConfig(host="0.0.0.0", models=(ServedModel(name="m", max_model_len=1),), allow_remote=True,
                        api_keys={"k": "t"})


async def test_capacity_queue_hands_over_the_instance_that_becomes_ready():
    queue = CapacityQueue(max_waiting=2, timeout_s=5, poll_s=0.01)
    ready: list[Instance] = []

    async def scale_up():
        await asyncio.sleep(0.2)
        ready.append(unreachable_instance("new-0"))

    waiter = asyncio.create_task(queue.wait(lambda: list(ready), "m"))
    await asyncio.sleep(0.05)
    assert queue.waiting == 1  # the pool controller's scale-up signal
    await scale_up()
    assert [i.instance_id for i in await waiter] == ["new-0"]
    assert queue.waiting == 0


async def test_capacity_queue_is_bounded_in_size_and_time():
    queue = CapacityQueue(max_waiting=1, timeout_s=0.3, poll_s=0.01)
    first = asyncio.create_task(queue.wait(list, "m"))
    await asyncio.sleep(0.05)
    with pytest.raises(NoInstance, match="queue is full"):
        await queue.wait(list, "m")
    started = time.monotonic()
    with pytest.raises(NoInstance, match="within 0.3 s") as raised:
        await first
    assert time.monotonic() - started < 1 and raised.value.retry_after_s == 5
    assert queue.waiting == 0


def test_a_request_waits_in_the_queue_then_gets_a_clean_503():
    registry = InstanceRegistry()
    config = RouterConfig(models=(ServedModel(name="m", max_model_len=128),), queue_timeout_s=0.5)
    with TestClient(build_app(config, registry)) as client:
        started = time.monotonic()
        response = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        waited = time.monotonic() - started
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert 0.5 <= waited < 3


def test_latency_window_quantile_counts_only_recent_samples_after_since():
    window = LatencyWindow(window_s=0.2)
    assert window.quantile(0.9) is None  # no samples
    for seconds in [0.1] * 9 + [2.0]:
        window.observe(seconds)
    # router.metrics.percentile, as every report computes it: between the 9th and 10th samples
    assert window.quantile(0.9) == pytest.approx(0.1 + 0.1 * 1.9) and window.quantile(1.0) == 2.0
    assert window.quantile(0.9, min_samples=11) is None
    assert window.quantile(0.9, since=time.monotonic()) is None  # none seen after a later growth
    time.sleep(0.25)
    assert window.quantile(0.5, min_samples=1) is None  # all older than the window


def pd_forwarder(prefill: Instance, **config) -> tuple[Forwarder, Instance]:
    """A P/D router's forwarder with one prefill and one decode instance (the decode unreached)."""
    registry = InstanceRegistry()
    decode = Instance("decode-0", DECODE, "http://127.0.0.1:1", model="m")
    registry.add(prefill)
    registry.add(decode)
    settings = RouterConfig(models=(ServedModel(name="m", max_model_len=4096),), remote_prefill_min_tokens=0, **config)
    placer = Placer(PlacementSettings(0, settings.remote_prefill_max_queued_tokens), make_policy("least_loaded"),
                    make_policy("least_loaded"))
    return Forwarder(settings, registry, placer, CapacityQueue(0, 0)), decode


async def test_a_prefill_instance_with_too_much_queued_leaves_the_prefill_to_decode():
    def prefilled(where: str) -> float:
        return REGISTRY.get_sample_value("pdcluster_router_prefills_total", {"where": where}) or 0.0

    prefill = unreachable_instance("prefill-0", PREFILL)
    forwarder, decode = pd_forwarder(prefill, remote_prefill_max_queued_tokens=1000, prefill_timeout_s=5)
    body, request = {"model": "m", "prompt": "p"}, RoutingRequest((), 600, 32)
    try:
        queued = PendingPrefill(prefill, 1200)  # another request's prompt, not yet prefilled
        busy = prefilled("local_busy")
        placement, sent, computes = await forwarder.prepare("/v1/completions", body, request, [decode])
        assert (placement.reason, sent, computes) == ("local_busy", body, 600)
        assert prefilled("local_busy") == busy + 1
        queued.done()  # now under the limit: the router tries the prefill instance (refused: local)
        fallback = prefilled("fallback_local")
        placement, sent, computes = await forwarder.prepare("/v1/completions", body, request, [decode])
        assert (placement.reason, sent, computes) == ("remote", body, 600)
        assert prefilled("fallback_local") == fallback + 1 and prefilled("local_busy") == busy + 1
    finally:
        await forwarder.close()


async def test_no_prefill_is_waited_for_past_most_of_its_kv_lease():
    """P/D direct: the prefill instance keeps a prompt's KV for the lease, from its prefill's end; a
    hand-over waited for longer could reach the decode instance after the blocks were freed, and its
    reads would return whatever they hold by then. Past the share of the lease, however long
    prefill_timeout_s, the decode instance prefills itself."""
    hung = SocketStandIn("hang", "prefill-0")
    prefill = hung.instance(PREFILL)
    prefill.kv_lease_s = 1  # as its engine's description says (EngineConfig.kv_lease_s)
    forwarder, decode = pd_forwarder(prefill, prefill_timeout_s=600)
    body, request = {"model": "m", "prompt": "p"}, RoutingRequest((), 600, 32)
    try:
        assert forwarder.prefills.deadline_s(prefill) == 0.75
        async with asyncio.timeout(30):  # far less than prefill_timeout_s
            placement, sent, computes = await forwarder.prepare("/v1/completions", body, request, [decode])
        assert (placement.reason, sent, computes) == ("remote", body, 600)  # no kv_transfer_params: local
        assert hung.requests == 1
    finally:
        await forwarder.close()
        hung.close()


def test_placement_is_one_pure_step():
    """Colocated instances prefill themselves; a decode instance gets a remote prefill unless the
    uncached prompt is short, no prefill instance is ready, or the chosen one is too busy."""
    prefill, decode, colocated = (Instance("p", PREFILL, "u", model="m"), Instance("d", DECODE, "u", model="m"),
                                  Instance("c", COLOCATED, "u", model="m"))
    placer = Placer(PlacementSettings(256, 1000), make_policy("least_loaded"), make_policy("least_loaded"))
    long, short = RoutingRequest((), 600, 32), RoutingRequest((), 100, 32)
    assert placer.place(long, [colocated], [prefill]).reason == "colocated"
    assert placer.place(short, [decode], [prefill]).reason == "short"
    assert placer.place(long, [decode], []).reason == "no_prefill"
    remote = placer.place(long, [decode], [prefill])
    assert (remote.reason, remote.prefill, remote.serve.instance, remote.served_prefill_tokens) == (
        "remote", prefill, decode, 0)
    prefill.pending_prefill_tokens = 1001
    assert placer.place(long, [decode], [prefill]).reason == "local_busy"


def test_a_request_that_broke_an_engine_is_not_retried_on_another():
    engines = [SocketStandIn("crash", f"e{k}") for k in range(2)]
    try:
        with make_client([e.instance() for e in engines]) as client:
            response = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 502
        assert sorted(e.requests for e in engines) == [0, 1]  # it reached one engine, and only one
    finally:
        for engine in engines:
            engine.close()


async def test_a_hanging_prefill_instance_costs_timeouts_until_its_circuit_opens():
    hung = SocketStandIn("hang", "prefill-0")
    prefill = hung.instance(PREFILL)
    forwarder, decode = pd_forwarder(prefill, prefill_timeout_s=0.5, prefill_circuit_failures=2,
                                     prefill_circuit_s=60)
    body, request = {"model": "m", "prompt": "p"}, RoutingRequest((), 600, 32)
    try:
        reasons = [(await forwarder.prepare("/v1/completions", body, request, [decode]))[0].reason for _ in range(4)]
        assert reasons == ["remote", "remote", "no_prefill", "no_prefill"]
        assert hung.requests == 2  # two timeouts, then no request goes there for a minute
        assert prefill.prefill_open_until > time.monotonic() + 50
    finally:
        await forwarder.close()
        hung.close()
