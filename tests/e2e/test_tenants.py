"""Tenant isolation of the prefix cache, counted by vLLM itself: tenant B's identical prompt
gets no hit from tenant A's cached blocks, while tenant A's second request hits."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from engine.role_spec import COLOCATED
from fleet.instances import Instance, InstanceRegistry
from loadtest.scrape import scrape_engine
from router.app import build_app
from router.config import RouterConfig, ServedModel
from security.credentials import ClusterCredentials

pytestmark = pytest.mark.slow
HITS = "vllm:prefix_cache_hits_total"


def test_one_tenant_never_hits_anothers_cached_prompt(served, tiny_model):
    (listed,) = served.instances()
    engine = served.engine_access(listed["instance_id"])
    registry = InstanceRegistry()
    registry.add(Instance(listed["instance_id"], COLOCATED, engine.url, model="tiny", access=engine))
    config = RouterConfig(models=(ServedModel(name="tiny", max_model_len=4096, tokenizer=tiny_model),), health_interval_s=60,
                          api_keys={"key-a": "tenant-a", "key-b": "tenant-b"},
                          cluster_secret=ClusterCredentials.load().secret.hex())
    prompt = f"A private prompt {uuid.uuid4()} " + "with a long shared body. " * 60
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def hits_after(key: str) -> float:
        before = scrape_engine(engine, (HITS,))[HITS]
        response = router.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        return scrape_engine(engine, (HITS,))[HITS] - before

    with TestClient(build_app(config, registry)) as router:
        assert hits_after("key-a") == 0  # a fresh prompt
        assert hits_after("key-b") == 0  # identical text, other tenant: no hit
        assert hits_after("key-a") > 200  # the first tenant's second request hits its own blocks
        assert hits_after("key-b") > 200  # and tenant B now has its own copy
