"""Admission: API keys, per-key rate and concurrency limits, tenant salts, body size."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from deploy.serve import parse_api_keys
from fleet.instances import InstanceRegistry
from router.admission import Admission, KeyLimits, LocalLimits
from router.app import build_app
from router.config import RouterConfig, ServedModel
from router.errors import RateLimited, Unauthorized
from security.credentials import ClusterCredentials

BODY = {"model": "m", "prompt": "x"}
UNLIMITED = LocalLimits(KeyLimits(None, None))


def client(**config) -> TestClient:
    settings = RouterConfig(models=(ServedModel(name="m", max_model_len=64),), health_interval_s=60,
                            queue_timeout_s=0, **config)
    return TestClient(build_app(settings, InstanceRegistry()))


@pytest.mark.parametrize(
    "header,status", [(None, 401), ("Bearer wrong", 401), ("Basic k1", 401), ("Bearer k1", 503)]
)
def test_keys_are_required_when_configured(header, status):
    headers = {"authorization": header} if header else {}
    with client(api_keys={"k1": "a"}) as c:
        response = c.post("/v1/completions", json=BODY, headers=headers)
    assert response.status_code == status  # 503: admitted, but no engine in this test
    if status == 401:
        assert response.json()["error"]["type"] == "AuthenticationError"


def test_without_keys_the_endpoint_is_open():
    with client() as c:
        assert c.post("/v1/completions", json=BODY).status_code == 503


def test_rate_limit_answers_429_with_retry_after():
    with client(api_keys={"k1": "a", "k2": "b"}, rate_limit_per_s=1) as c:
        first = c.post("/v1/completions", json=BODY, headers={"authorization": "Bearer k1"})
        second = c.post("/v1/completions", json=BODY, headers={"authorization": "Bearer k1"})
        other = c.post("/v1/completions", json=BODY, headers={"authorization": "Bearer k2"})
    assert first.status_code == 503 and other.status_code == 503  # each key has its own bucket
    assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1


async def test_concurrency_slots_are_given_back():
    admission = Admission({"k": "t"}, LocalLimits(KeyLimits(rate_per_s=None, max_concurrency=1)), tenant_salt=str)
    release = await admission.admit("k")
    with pytest.raises(RateLimited):
        await admission.admit("k")
    release()
    release()  # twice is harmless
    (await admission.admit("k"))()


def test_tenant_salts_differ_per_tenant_and_keep_the_clients_own():
    keys = {"ka": "a", "ka2": "a", "kb": "b"}
    admission = Admission(keys, UNLIMITED, ClusterCredentials.generate().tenant_salt)
    assert admission.cache_salt("ka", None) == admission.cache_salt("ka2", None)  # same tenant
    assert admission.cache_salt("ka", None) != admission.cache_salt("kb", None)
    assert admission.cache_salt("ka", "mine").endswith(":mine")
    assert Admission({}, UNLIMITED, str).cache_salt("", "mine") == "mine"
    with pytest.raises(Unauthorized):
        admission.authenticate("Bearer kc")
    # Another cluster's secret gives other salts: no one can compute a tenant's salt from its name.
    other = Admission(keys, UNLIMITED, ClusterCredentials.generate().tenant_salt)
    assert other.cache_salt("ka", None) != admission.cache_salt("ka", None)


def test_oversized_bodies_are_refused_with_413():
    with client(max_body_bytes=1024) as c:
        response = c.post("/v1/completions", json={"model": "m", "prompt": "x" * 5000})
        assert response.status_code == 413
        # Chunked, with no length declared: counted as it arrives.
        chunks = iter([b'{"model": "m", "prompt": "', *([b"x" * 512] * 8), b'"}'])
        response = c.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert response.status_code == 413


def test_api_keys_flag():
    assert parse_api_keys("k1:a, k2:b,k3") == {"k1": "a", "k2": "b", "k3": "k3"}
    with pytest.raises(ValueError):
        parse_api_keys("k1:a,k1:b")


KEY = "sk-tenant-a-0123456789"
SECRET = ClusterCredentials.generate().secret.hex()
MODEL = ServedModel(name="m", max_model_len=64)


def quotes(text: str, message: str) -> bool:
    """Whether `message` holds any 8 characters of `text` in a row (pydantic cuts long inputs short)."""
    return any(text[start:start + 8] in message for start in range(len(text) - 7))


@pytest.mark.parametrize("config", [
    {"models": (MODEL,), "cluster_secret": SECRET, "host": "0.0.0.0", "api_keys": {KEY: "a"}},  # allow_remote unset
    {"models": (MODEL, MODEL), "api_keys": {KEY: "a"}, "cluster_secret": SECRET},  # two models of one name
    {"models": (MODEL,), "cluster_secret": SECRET, "api_keys": {KEY: 5}},  # a tenant that is not text
], ids=["remote", "models", "tenant"])
def test_no_config_error_quotes_a_key_or_the_secret(config):
    """deploy/serve.py prints a configuration's errors: neither the keys nor the secret may be in them."""
    with pytest.raises(ValidationError) as error:
        RouterConfig(**config)
    assert not quotes(KEY, str(error.value)) and not quotes(SECRET, str(error.value)), str(error.value)


def test_a_configs_repr_shows_no_key():
    config = RouterConfig(models=(MODEL,), api_keys={KEY: "a"}, cluster_secret=SECRET)
    for text in (repr(config), str(config)):
        assert not quotes(KEY, text) and not quotes(SECRET, text)


def test_the_operator_explains_a_tenants_request_without_its_key():
    """/admin/explain takes the admin token (no tenant's key) and the tenant by name."""
    admin = ClusterCredentials.from_hex(SECRET).admin_headers()
    with client(api_keys={KEY: "a"}, cluster_secret=SECRET) as c:
        assert c.post("/admin/explain?tenant=a", json=BODY, headers=admin).status_code == 200
        assert c.post("/admin/explain", json=BODY, headers={"authorization": f"Bearer {KEY}"}).status_code == 401
