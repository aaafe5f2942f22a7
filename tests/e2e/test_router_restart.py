"""The router killed and started again on a running Ray cluster (as on a `ray up` head): the new
router adopts the engine the dead one left, rebuilds its KV index from the engine's event buffer
before any new request, and the same warm engine answers with the same tokens from its prefix
cache, as plain vLLM would. (The fault suite, `python -m loadtest.faults --scenario router-restarted`, does it under
load.)"""

from __future__ import annotations

import time

import httpx
import pytest
from oracle import assert_conforms

from deploy.local import LocalServer, RayHead
from loadtest.scrape import scrape
from security.credentials import ClusterCredentials

pytestmark = pytest.mark.slow
ENGINE = ClusterCredentials.load().engine_headers()  # the session's secret (tests/conftest.py)
HITS = "vllm:prefix_cache_hits_total"
PROMPT = " ".join(
    f"Item {k}: the router must survive its own restart without a cold engine." for k in range(30)
)


def complete(url: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def wait_for(read, done, timeout_s: float):
    """`read()` again until `done` holds for what it returned; that value."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        assert time.monotonic() < deadline, f"not reached in time: {value}"
        time.sleep(0.2)
    return value


@pytest.mark.timeout(900)
def test_a_restarted_router_adopts_the_engine_and_rebuilds_its_index(tiny_model, artifacts, oracle):
    args = ["--model", "tiny", "--instances", "1", "--kv-cache-gib", "1"]
    with RayHead() as head:
        server = LocalServer(["--address", head.address, *args], artifacts / "serve-restart-1.log")
        try:
            server.start()
            first = complete(server.url)
            (before,) = server.instances()
            assert before["index_blocks"] >= len(PROMPT.split()) // 32  # the index knows the prompt
            engine_url = before["url"]
            server.kill()
            server.log_path = artifacts / "serve-restart-2.log"
            restarted_at = time.monotonic()
            server.start()
            restart_s = time.monotonic() - restarted_at
            # Before any new request, the index holds what the engine holds.
            (after,) = wait_for(
                server.instances, lambda i: i[0]["index_blocks"] == before["index_blocks"], 10
            )
            assert (after["instance_id"], after["url"], after["state"]) == (
                before["instance_id"],
                engine_url,
                "ready",
            )
            hits = scrape(engine_url, (HITS,), headers=ENGINE)[HITS]
            assert complete(server.url) == first
            assert scrape(engine_url, (HITS,), headers=ENGINE)[HITS] - hits >= before["index_blocks"] * 32 - 32  # warm cache
            assert "adopted 1 engine(s)" in server.log_path.read_text()
            assert_conforms(server.url, "tiny", oracle("tiny"))  # the adopted engine answers right
            print(f"router restart: {restart_s:.1f} s to /health 200, {after['index_blocks']} blocks rebuilt")
        finally:
            server.stop()
