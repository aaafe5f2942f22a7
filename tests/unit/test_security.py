"""Attacks on the router's edges and an engine's HTTP routes, without engines (docs/security.md):
each must fail. Also the cluster secret itself: where it lives and who may read it."""

from __future__ import annotations

import os
import stat

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from routers import router_client

from engine.http_auth import MAX_RPC_BODY_BYTES, EngineAuthMiddleware
from engine.role_spec import COLOCATED
from fleet.instances import Instance, InstanceRegistry
from router.app import build_app
from router.config import RouterConfig, ServedModel
from security.credentials import SECRET_ENV, ClusterCredentials, CredentialsError, EngineKeys, runtime_dir

CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)
ENGINE_PROCESS = CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1")
"""The keys one engine process of the session's cluster would be given."""
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_PROCESS.engine_token}"}


def router(**config) -> TestClient:
    return router_client(models=(ServedModel(name="m", max_model_len=64),), **config)


# What clients may call (with their API key, when keys are configured); everything else the
# router answers is the operator's.
CLIENT_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}


def test_every_operator_route_needs_the_admin_token():
    """Every route the app has beyond the clients' (so a route added later is covered too)."""
    with router() as client:
        routes = [(method, route.path.replace("{instance_id}", "colocated-0").replace("{name}", "status.js"))
                  for route in client.app.routes if route.path not in CLIENT_ROUTES
                  for method in getattr(route, "methods", ())]
        assert {"/metrics", "/admin/instances", "/admin/store", "/admin/status", "/status"} <= {p for _, p in routes}
        for method, path in routes:
            assert client.request(method, path).status_code == 401, path
            assert client.request(method, path, headers={"authorization": "Bearer k1"}).status_code == 401, path
            assert client.request(method, path, headers=ENGINE_HEADERS).status_code == 401, path
            if method == "GET":
                assert client.get(path, headers=CREDENTIALS.admin_headers()).status_code != 401, path


@pytest.mark.parametrize(("field", "value"), [
    ("kv_transfer_params", {"do_remote_prefill": True, "remote_block_ids": [1, 2]}),
    ("chat_template", "{% for x in range(10**9) %}{% endfor %}"),
    ("priority", -1000), ("request_id", "someone-elses"), ("vllm_xargs", {"a": 1}),
    ("logits_processors", ["os.system"]), ("chat_template_kwargs", {"x": "y" * 10_000}),
    ("an_unknown_field", 1), ("chat_template_kwargs", {"chat_template": "{{ 7 * 7 }}"}),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 70_000]}}}),
])
def test_internal_and_unknown_fields_are_refused_not_forwarded(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with router() as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(field)


@pytest.mark.parametrize("message", [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]},
    {"role": "user", "content": [{"type": "text", "text": "hi", "extra": 1}]},
    {"role": "user", "content": "hi", "audio": {"url": "file:///etc/passwd"}},
])
def test_messages_carry_text_only(message):
    """Any part an engine would fetch, open or render beyond text is refused at the edge."""
    with router() as client:
        response = client.post("/v1/chat/completions", json={"model": "m", "messages": [message]})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("messages")


def test_a_body_larger_than_any_prompt_is_refused_untokenized():
    with router() as client:  # max_model_len 64: no prompt of this size could fit
        response = client.post("/v1/completions", json={"model": "m", "prompt": "a " * 80_000})
    assert response.status_code == 400 and "cannot fit" in response.json()["error"]["message"]


def test_one_requests_work_is_bounded():
    with router(max_sequences_per_request=8) as client:
        too_many = {"model": "m", "prompt": ["a", "b", "c"], "n": 3}  # 9 sequences
        assert client.post("/v1/completions", json=too_many).status_code == 400
        too_long = {"model": "m", "prompt": "a", "max_tokens": 65}  # over max_model_len
        assert client.post("/v1/completions", json=too_long).status_code == 400
        assert client.post("/v1/completions", json={"model": "m", "prompt": "a", "n": 8}).status_code == 503


def test_a_500_names_an_incident_never_the_exception(monkeypatch):
    with router() as client:
        app = client.app

        @app.get("/boom")
        async def boom():
            raise RuntimeError("secret detail: /home/user/.ssh/id_rsa")

        response = client.get("/boom")
    assert response.status_code == 500
    assert "secret" not in response.text and "incident" in response.json()["error"]["message"]


def test_models_need_a_key_when_keys_are_configured():
    with router(api_keys={"k1": "a"}) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"authorization": "Bearer k1"}).status_code == 200


def test_the_router_sends_the_engine_token_to_engines_and_clients_cannot_skip_it(monkeypatch):
    """A stand-in engine behind the same middleware as ours: the router's request passes, a
    client's straight request (with or without a tenant key) does not; and even the token reaches
    only the cluster's routes and no worker method but ours."""
    monkeypatch.setenv(*ENGINE_PROCESS.as_env().popitem())
    engine = FastAPI()

    @engine.post("/v1/completions")
    async def completions():
        return {"choices": [{"text": "ok"}]}

    @engine.post("/collective_rpc")
    async def collective_rpc(request: dict):
        return {"ran": request["method"]}

    @engine.post("/tokenize")
    async def tokenize():
        return {"tokens": []}

    engine.add_middleware(EngineAuthMiddleware)
    token = ENGINE_HEADERS
    with TestClient(engine) as direct:
        another = CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").engine_token
        assert direct.post("/v1/completions", json={}, headers={"authorization": f"Bearer {another}"}).status_code == 401
        assert direct.post("/v1/completions", json={}).status_code == 401
        assert direct.post("/v1/completions", json={}, headers={"authorization": "Bearer k1"}).status_code == 401
        assert direct.post("/v1/completions", json={}, headers=token).status_code == 200
        for path in ("/collective_rpc", "/reset_prefix_cache", "/health", "/metrics", "/tokenize"):
            assert direct.post(path).status_code == 401 and direct.get(path).status_code == 401
        assert direct.post("/tokenize", json={}, headers=token).status_code == 404
        ours = direct.post("/collective_rpc", json={"method": "pdc_export_weights", "args": []}, headers=token)
        assert ours.json() == {"ran": "pdc_export_weights"}
        for method in ("execute_model", "__init__", "pdc_load_weights_x", None):
            refused = direct.post("/collective_rpc", json={"method": method}, headers=token)
            assert refused.status_code == 403
        huge = {"method": "pdc_load_weights", "args": ["x" * (MAX_RPC_BODY_BYTES + 1)]}
        assert direct.post("/collective_rpc", json=huge, headers=token).status_code == 413


def test_leaving_instances_are_forgotten_by_the_index():
    registry = InstanceRegistry()
    config = RouterConfig(models=(ServedModel(name="m", max_model_len=64),), health_interval_s=60)
    app = build_app(config, registry)
    registry.add(Instance("gone-0", COLOCATED, "http://127.0.0.1:9", model="m"))
    app.state.index.stored("gone-0", [1, 2, 3])
    registry.remove("gone-0")
    assert app.state.index.match([1, 2, 3]) == {}


def test_the_secret_file_is_its_owners_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV)
    path = tmp_path / "cfg" / "secret"
    with pytest.raises(CredentialsError, match="no cluster secret"):
        ClusterCredentials.load(path)
    made = ClusterCredentials.load(path, create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ClusterCredentials.load(path) == made
    os.chmod(path, 0o644)
    with pytest.raises(CredentialsError, match="readable by others"):
        ClusterCredentials.load(path)


def test_the_secret_is_never_read_through_a_link(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV)
    ClusterCredentials.load(tmp_path / "real", create=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError):
        ClusterCredentials.load(tmp_path / "link")


def test_a_runtime_folder_planted_by_someone_else_is_not_used(tmp_path, monkeypatch):
    """Another user who made /tmp/pdcluster-<our uid> first (here: a link to a folder of
    theirs) gets none of our files: we fall back to a folder under our home."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "shared"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "shared").mkdir()
    (tmp_path / "theirs").mkdir(mode=0o777)
    (tmp_path / "shared" / f"pdcluster-{os.getuid()}").symlink_to(tmp_path / "theirs")
    chosen = runtime_dir()
    assert chosen == tmp_path / "home" / ".cache" / "pdcluster" / "run"
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o700


def test_an_engine_process_gets_its_keys_and_no_other_credential(monkeypatch):
    """What a vLLM process would give away if it were made to read its own environment: its own
    keys, never the cluster secret, the store's server key, Ray's token, a tenant's API keys or
    anything of the operator's named like a credential."""
    from engine.environment import engine_process_env

    for name in ("RAY_AUTH_TOKEN", "PDCLUSTER_API_KEYS", "GITHUB_TOKEN", "DB_PASSWORD", "OPENAI_API_KEY",
                 "MY_SERVICE_CREDENTIALS", "AWS_ACCESS_KEY_ID"):
        monkeypatch.setenv(name, "do-not-leak")
    env = engine_process_env("127.0.0.1", 1, None, "0") | ENGINE_PROCESS.as_env()
    assert "do-not-leak" not in str(env) and CREDENTIALS.secret.hex() not in str(env)
    monkeypatch.setattr(os, "environ", env)
    keys = EngineKeys.load()
    assert keys.engine_token == ENGINE_PROCESS.engine_token and keys.store.server_secret == b""
    assert CREDENTIALS.engine_key("colocated-0").hex() not in str(env)  # the instance's key stays with its host
    assert keys.store.server_public == CREDENTIALS.curve("store").server_public
    assert CREDENTIALS.admin_token not in str(env) and CREDENTIALS.ray_token not in str(env)
    assert CREDENTIALS.curve("store").server_secret.decode() not in str(env)


def test_derived_keys_differ_per_use_and_per_cluster():
    one, other = ClusterCredentials.generate(), ClusterCredentials.generate()
    keys = [one.engine_key("a").hex(), one.admin_token, one.weights_key, one.ray_token, one.tenant_salt("a")]
    assert len(set(keys)) == len(keys)
    assert one.tenant_salt("a") != other.tenant_salt("a") and one.engine_key("a") != other.engine_key("a")
    assert one.curve("store").server_public != one.curve("kv-events").server_public
    assert one.secret.hex() not in repr(one) and one.curve("store").server_secret.decode() not in repr(
        one.curve("store"))
