"""Several models behind one router on a running Ray cluster (as on a `ray up` head): /v1/models
lists them, an unknown one is refused, the operator's view shows a pool per model; then the
router killed and started again: the new router adopts the engines the dead one left (one per
model: tiny, tiny-tied, SmolLM2), rebuilds its KV index from the engines' event buffers before any new
request, and the same warm engines answer with their prefix caches, each model as plain vLLM
does on its own checkpoint. (The fault suite, `python -m loadtest.faults --scenario
router-restarted`, does it under load.)"""

from __future__ import annotations

import time

import httpx
import pytest
from oracle import assert_conforms

from loadtest.local_cluster import LocalServer, RayHead
from loadtest.scrape import scrape_engine
from router.status_model import ClusterStatus

HITS = "vllm:prefix_cache_hits_total"
MODELS = ("tiny", "tiny-tied", "smollm2")  # a request that reached another model answers wrong; two tokenizers
pytestmark = [pytest.mark.slow, pytest.mark.oracles(*MODELS)]
PROMPT = " ".join(
    f"Item {k}: the router must survive its own restart without a cold engine." for k in range(30)
)


def complete(url: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def check_the_models_are_served_apart(server: LocalServer) -> None:
    """Each model listed and in a pool of its own; a model not served refused by name."""
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert sorted(card["id"] for card in listed) == sorted(MODELS)
    missing = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-other", "prompt": "x"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    status = ClusterStatus.model_validate(httpx.get(
        f"{server.url}/admin/status", headers=server.credentials.admin_headers(), timeout=10).json())
    assert sorted(status.models) == sorted(MODELS)
    assert sorted((p.model, p.role, p.states) for p in status.pools) == [
        (m, "colocated", {"ready": 1}) for m in sorted(MODELS)]
    assert sorted(i.instance_id for i in status.instances) == [f"{m}-colocated-0" for m in sorted(MODELS)]


def wait_for(read, done, timeout_s: float):
    """`read()` again until `done` holds for what it returned; that value."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        assert time.monotonic() < deadline, f"not reached in time: {value}"
        time.sleep(0.2)
    return value


@pytest.mark.timeout(900)
def test_models_served_apart_then_a_restarted_router_adopts_their_engines_and_rebuilds_its_index(artifacts, model_dir, oracle):
    wanted = {model: oracle(model) for model in MODELS}
    for model in MODELS:
        model_dir(model)
    args = ["--model", ",".join(MODELS), "--instances", "1", "--kv-cache-gib", "1"]
    with RayHead() as head:
        server = LocalServer(["--address", head.address, *args], artifacts / "serve-restart-1.log")
        try:
            server.start()
            check_the_models_are_served_apart(server)
            first = complete(server.url)
            before = {i["instance_id"]: i for i in server.instances()}
            tiny = before["tiny-colocated-0"]
            assert tiny["index_blocks"] >= len(PROMPT.split()) // 32  # the index knows the prompt
            server.kill()
            server.log_path = artifacts / "serve-restart-2.log"
            restarted_at = time.monotonic()
            server.start()
            restart_s = time.monotonic() - restarted_at
            # Before any new request, the index holds what the engines hold.
            after = wait_for(lambda: {i["instance_id"]: i for i in server.instances()},
                             lambda now: now.keys() == before.keys() and all(
                                 now[k]["index_blocks"] == before[k]["index_blocks"] for k in now), 10)
            assert {k: (i["url"], i["state"]) for k, i in after.items()} == {
                k: (i["url"], "ready") for k, i in before.items()}
            engine = server.engine_access(tiny["instance_id"])
            hits = scrape_engine(engine, (HITS,))[HITS]
            assert complete(server.url) == first
            warm = scrape_engine(engine, (HITS,))[HITS] - hits
            assert warm >= tiny["index_blocks"] * 32 - 32  # its prefix cache came through the restart
            assert f"adopted {len(MODELS)} engine(s)" in server.log_path.read_text()
            for model in MODELS:  # every adopted engine answers right
                assert_conforms(server.url, model, wanted[model])
            print(f"router restart: {restart_s:.1f} s to /health 200, {tiny['index_blocks']} blocks rebuilt")
        finally:
            server.stop()
