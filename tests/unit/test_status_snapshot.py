"""GET /admin/status (router/status.py): the snapshot the operator views draw, and the prompt-hit
counts placement feeds it. No engine runs: the instances are registered, not started."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from routers import router_client

from decode.role import DECODE
from engine.lifecycle import InstanceState
from engine.role_spec import COLOCATED
from fleet.instances import Instance, InstanceRegistry
from loadtest.engine_standin import unreachable_instance
from router.app import build_app
from router.config import RouterConfig, ServedModel
from router.kv_index import KVIndex
from router.placement import PlacementSettings, Placer, PromptHits
from router.policies import PolicyContext, RoutingRequest, make_policy
from router.status import StartLog
from router.status_model import ClusterStatus, StartRecord
from security.credentials import ClusterCredentials


def test_placement_counts_blocks_held_by_the_chosen_instance_then_the_store():
    index = KVIndex()
    hashes = (1, 2, 3, 4, 5)
    index.stored("d", hashes[:2])
    index.stored("store", hashes[:4])
    placer = Placer(PlacementSettings(0), make_policy("least_loaded"), make_policy("least_loaded"),
                    index=index, store_holders=frozenset({"store"}))
    decode = Instance("d", DECODE, "u", model="m")
    placement = placer.place(RoutingRequest(hashes, 80, 16), [decode], [])
    assert placement.hits == PromptHits(blocks=5, instance=2, store=2)
    other = placer.place(RoutingRequest((9, 8), 32, 16), [decode], [])
    assert other.hits == PromptHits(blocks=2, instance=0, store=0)


def test_placement_shows_each_candidate_as_the_policy_weighed_it():
    index = KVIndex()
    hashes = tuple(range(1, 9))
    index.stored("warm", hashes[:6])
    index.stored("store", hashes)
    placer = Placer(PlacementSettings(0), make_policy("kv_aware", PolicyContext(index, frozenset({"store"}), request_cost_tokens=100)),
                    make_policy("kv_aware"), index=index, store_holders=frozenset({"store"}))
    warm, cold = Instance("warm", COLOCATED, "u", model="m"), Instance("cold", COLOCATED, "u", model="m")
    warm.pending_prefill_tokens, warm.inflight, warm.engine_load = 40.0, 3, 5
    placement = placer.place(RoutingRequest(hashes, 128, 16), [cold, warm], [])
    views = {c.instance_id: c for c in placement.candidates}
    assert (views["warm"].cached_blocks, views["warm"].store_blocks, views["warm"].queued_tokens,
            views["warm"].inflight, views["warm"].load) == (6, 2, 40.0, 3, 5)
    assert (views["cold"].cached_blocks, views["cold"].store_blocks, views["cold"].inflight) == (0, 8, 0)
    # kv_aware's estimate in prompt tokens: queued + computed + fetched at 5% of computing + 100
    # a request this router has in flight (the engine's count is not priced); the warm one's queue outweighs what its cache saves over the store,
    # and the lower score wins.
    assert views["warm"].score == pytest.approx(40 + 0.05 * 32 + 300) and views["cold"].score == pytest.approx(0.05 * 128)
    assert placement.serve.instance is cold


def test_admin_status_lists_recent_placements_and_never_a_prompt():
    secret_prompt = "the tenant's confidential prompt"
    with router_client([unreachable_instance("dead-0"), unreachable_instance("dead-1")], policy="kv_aware") as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": secret_prompt}).status_code == 502
        response = client.get("/admin/status", headers=ClusterCredentials.load().admin_headers())
    assert response.status_code == 200 and secret_prompt not in response.text
    placements = ClusterStatus.model_validate(response.json()).recent_placements
    # A connection refused is retried on the other instance: two placements, the second among
    # the one left (the first is out of rotation).
    assert [sorted(c.instance_id for c in p.candidates) for p in placements] == [
        ["dead-0", "dead-1"], [placements[1].chosen]]
    assert {p.chosen for p in placements} == {"dead-0", "dead-1"}
    assert all((p.model, p.reason, p.prefill) == ("m", "colocated", None) for p in placements)
    assert all(c.score is not None and c.cached_blocks == 0 for p in placements for c in p.candidates)


def test_admin_status_shows_pools_starts_errors_and_is_closed_to_others():
    registry = InstanceRegistry()
    registry.add(Instance("c-0", COLOCATED, "http://127.0.0.1:1", model="m"))
    registry.add(Instance("c-1", COLOCATED, "http://127.0.0.1:2", InstanceState.STANDBY, model="m"))
    starts = StartLog()
    starts.record(StartRecord(instance_id="c-0", role="colocated", path="disk", started_at=1.0, total_s=3.0,
                              stages_s={"spawn": 1.0, "weights": 2.0}))
    credentials = ClusterCredentials.load()  # the session's (tests/conftest.py)
    config = RouterConfig(models=(ServedModel(name="m", max_model_len=128),), health_interval_s=60, queue_timeout_s=0,
                          cluster_secret=credentials.secret.hex())
    admin = credentials.admin_headers()
    not_found = {"kind": "NotFoundError", "status": "404"}
    errors_before = REGISTRY.get_sample_value("pdcluster_router_errors_total", not_found)
    with TestClient(build_app(config, registry, starts=starts)) as client:
        secret_prompt = "my secret prompt"
        assert client.post("/v1/completions", json={"model": "nope", "prompt": secret_prompt}).status_code == 404
        assert client.get("/admin/status").status_code == 401
        response = client.get("/admin/status", headers=admin)
    assert response.status_code == 200
    status = ClusterStatus.model_validate(response.json())
    assert status.health == "ok" and status.models == ["m"]
    assert [(p.role, p.states) for p in status.pools] == [("colocated", {"ready": 1, "standby": 1})]
    assert {i.instance_id: i.state for i in status.instances} == {"c-0": "ready", "c-1": "standby"}
    assert [s.stages_s for s in status.starts] == [{"spawn": 1.0, "weights": 2.0}]
    kinds = [(e.kind, e.status) for e in status.recent_errors]
    assert kinds == [("NotFoundError", 404)]  # the 401 on /admin/status was no client's error
    assert all(secret_prompt not in e.message for e in status.recent_errors)
    assert REGISTRY.get_sample_value("pdcluster_router_errors_total", not_found) == errors_before + 1
    assert status.store == [] and status.requests.served >= 1


def test_engine_metrics_discovery_lists_running_engines_and_the_relay_takes_only_their_ids():
    registry = InstanceRegistry()
    registry.add(unreachable_instance("d-0", DECODE))  # nothing listens
    registry.add(Instance("c-1", COLOCATED, "http://127.0.0.1:2", InstanceState.STANDBY, model="m"))  # no vLLM server yet
    credentials = ClusterCredentials.load()
    config = RouterConfig(models=(ServedModel(name="m", max_model_len=128),), health_interval_s=60, queue_timeout_s=0,
                          cluster_secret=credentials.secret.hex())
    admin = credentials.admin_headers()
    with TestClient(build_app(config, registry), base_url="http://router.example:9000") as client:
        assert client.get("/admin/prometheus_sd").status_code == 401
        engine_token = credentials.engine_host_keys("d-0").new_process("127.0.0.1").engine_token
        assert client.get("/admin/engines/d-0/metrics", headers={"authorization": f"Bearer {engine_token}"}
                          ).status_code == 401
        targets = client.get("/admin/prometheus_sd", headers=admin).json()
        # The router's own address, not the Host header the request came with (a proxy could let a caller
        # choose it, and with it where Prometheus sends its admin token).
        assert targets == [{"targets": [f"{config.host}:{config.port}"], "labels": {
            "__metrics_path__": "/admin/engines/d-0/metrics", "__scheme__": "http", "instance_id": "d-0",
            "role": "decode"}}]
        assert client.get("/admin/engines/nope/metrics", headers=admin).status_code == 404
        assert client.get("/admin/engines/d-0/metrics", headers=admin).status_code == 502  # refused, bounded
