"""Several models behind one router (`pdcluster serve --model tiny,tiny-tied`): each answers as
plain vLLM does on its own checkpoint, so no request reaches another model's engine; /v1/models
lists them; the operator's view shows a pool per model."""

from __future__ import annotations

import httpx
import pytest
from oracle import assert_conforms

from loadtest.local_cluster import LocalServer
from router.status_model import ClusterStatus

pytestmark = pytest.mark.slow
MODELS = ("tiny", "tiny-tied")


def test_each_model_answers_as_plain_vllm_on_its_own_checkpoint(artifacts, oracle):
    wanted = {model: oracle(model) for model in MODELS}  # two random models: a mis-route answers wrong
    args = ["--model", ",".join(MODELS), "--kv-cache-gib", "1"]
    with LocalServer(args, artifacts / "serve-two-models.log") as server:
        listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
        assert sorted(card["id"] for card in listed) == sorted(MODELS)
        for model in MODELS:
            assert_conforms(server.url, model, wanted[model])
        missing = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-other", "prompt": "x"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        status = ClusterStatus.model_validate(httpx.get(
            f"{server.url}/admin/status", headers=server.credentials.admin_headers(), timeout=10).json())
    assert sorted(status.models) == sorted(MODELS)
    assert sorted((p.model, p.role, p.states) for p in status.pools) == [
        (m, "colocated", {"ready": 1}) for m in sorted(MODELS)]
    assert sorted(i.instance_id for i in status.instances) == [f"{m}-colocated-0" for m in sorted(MODELS)]
