"""The router's lesser holes of issue #31 (docs/security.md, attacks 13.x): schemas vLLM cannot
compile, internal keys at any depth, one tenant's unbounded work, a keys file others can read,
repeated log lines. No engine: the router refuses before one would be asked."""

from __future__ import annotations

import logging
import os

import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from routers import router_client

from deploy.serve import load_api_keys
from router.config import DEFAULT_CONCURRENCY_PER_KEY, RouterConfig, ServedModel
from router.log_limit import RepeatLimit
from security.credentials import CredentialsError, write_private

MODEL = (ServedModel(name="m", max_model_len=64),)


def router(**config) -> TestClient:
    return router_client(**config)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


@pytest.mark.parametrize(("field", "value", "named"), [
    ("response_format", schema_format(LOOP), "response_format.json_schema.schema"),
    ("response_format", schema_format({"$ref": "#"}), "response_format.json_schema.schema"),
    ("response_format", schema_format({"$ref": "#/$defs/none"}), "response_format.json_schema.schema"),
    ("structured_outputs", {"json": {"$ref": "https://example.com/schema.json"}}, "structured_outputs.json"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": LOOP}}], "tools.0.function.parameters"),
    ("metadata", {"note": {"kv_transfer_params": {"do_remote_decode": True}}}, "metadata"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"vllm_xargs": {}}}}}}], "tools"),
    ("structured_outputs", {"json": {"type": "object", "pdc_grammar": "continue"}}, "structured_outputs"),
])
def test_what_an_engine_would_refuse_or_never_read_is_a_400_naming_the_field(field, value, named):
    with router() as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == named


def test_a_recursive_schema_with_structure_between_its_references_passes():
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    with router() as client:  # no engine behind: a 503 means it passed the router's checks
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": schema_format(tree)}
        assert client.post("/v1/chat/completions", json=body).status_code == 503


def test_tenants_get_a_default_bound_on_work_in_flight_and_operators_set_their_own():
    assert RouterConfig(models=MODEL, api_keys={"k": "t"}).concurrency_per_key == DEFAULT_CONCURRENCY_PER_KEY
    assert RouterConfig(models=MODEL, api_keys={"k": "t"}, max_concurrency_per_key=1000).concurrency_per_key == 1000
    assert RouterConfig(models=MODEL).concurrency_per_key is None  # no tenants: nobody to keep apart


def test_an_api_keys_file_others_can_read_is_refused(tmp_path):
    keys = tmp_path / "keys"
    write_private(keys, "k1:tenant-a\n")
    assert load_api_keys(keys) == {"k1": "tenant-a"}
    os.chmod(keys, 0o644)
    with pytest.raises(CredentialsError, match="readable by others"):
        load_api_keys(keys)


def test_repeated_log_lines_are_held_back_and_counted():
    now = [0.0]
    limit = RepeatLimit(burst=3, window_s=10, clock=lambda: now[0])
    before = REGISTRY.get_sample_value("pdcluster_log_lines_suppressed_total", {"logger": "asyncio"}) or 0

    def record(message: str = "socket.accept() out of system resource") -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    assert [limit.filter(record()) for _ in range(1000)].count(True) == 3
    assert limit.filter(record("another line"))  # counted by kind
    now[0] = 11.0
    summary = record()
    assert limit.filter(summary) and "997 more like it" in summary.msg
    after = REGISTRY.get_sample_value("pdcluster_log_lines_suppressed_total", {"logger": "asyncio"})
    assert after - before == 997
