"""Scale-up from zero: a burst of requests arrives while no instance is ready; the router queues
them, the pool controller activates the standby, and every request is served, none lost, none
waiting beyond its timeout, with the tokens of an ordinary engine."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from oracle import assert_conforms

from loadtest.local_cluster import LocalServer

pytestmark = pytest.mark.slow
QUEUE_TIMEOUT_S = 60
PROMPTS = [f"Request number {i} arrives while the pool is empty." for i in range(8)]


def has_standby(server: LocalServer) -> bool:
    return any(i["state"] == "standby" for i in server.instances())


async def completion(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[int, str, float]:
    started = time.monotonic()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    response = await client.post(f"{url}/v1/completions", json=body)
    text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text
    return response.status_code, text, time.monotonic() - started


async def one(url: str, prompt: str) -> str:
    async with httpx.AsyncClient(timeout=60) as client:
        status, text, _ = await completion(client, url, prompt)
    assert status == 200, text
    return text


async def burst(url: str) -> list[tuple[int, str, float]]:
    async with httpx.AsyncClient(timeout=QUEUE_TIMEOUT_S + 30) as client:
        return await asyncio.gather(*(completion(client, url, p) for p in PROMPTS))


def test_a_burst_on_an_empty_pool_is_queued_and_served_by_the_activated_standby(served, artifacts, tmp_path):
    start_log = tmp_path / "starts.jsonl"
    args = ["--model", "tiny", "--instances", "0", "--standby", "1", "--max-instances", "1",
            "--queue-timeout", str(QUEUE_TIMEOUT_S), "--start-log", str(start_log)]
    with LocalServer(args, artifacts / "serve-scale-up.log", ready=has_standby) as server:
        assert not [i for i in server.instances() if i["state"] == "ready"]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 200 and health.json()["standby_instances"] == 1  # not down
        results = asyncio.run(burst(server.url))
        states = [i["state"] for i in server.instances()]
        # The activated instance answers like the session's ordinary engine (same model, greedy),
        # on a prompt neither has seen, one request at a time (batches change the numerics).
        fresh = "A prompt that only the comparison sends"
        ours = asyncio.run(one(server.url, fresh))
    assert ours == asyncio.run(one(served.url, fresh))
    statuses = [status for status, _, _ in results]
    assert statuses == [200] * len(PROMPTS), results
    assert max(seconds for _, _, seconds in results) < QUEUE_TIMEOUT_S
    assert "ready" in states
    paths = [json.loads(line)["path"] for line in start_log.read_text().splitlines()]
    assert "standby_start" in paths and "standby" in paths, paths


@pytest.mark.oracles("tiny")
def test_a_pool_of_one_preimported_process_serves_a_burst_as_plain_vllm(artifacts, oracle, tmp_path):
    """Scale-to-zero on a pre-imported process (issue #23): vLLM imported, no engine started; the
    burst waits in the queue while the pool starts it, and the engine answers as plain vLLM."""
    start_log = tmp_path / "starts.jsonl"
    args = ["--model", "tiny", "--instances", "0", "--preimported", "1", "--max-instances", "1",
            "--queue-timeout", str(QUEUE_TIMEOUT_S), "--start-log", str(start_log)]
    preimported = lambda server: any(i["state"] == "preimported" for i in server.instances())  # noqa: E731
    with LocalServer(args, artifacts / "serve-preimported.log", ready=preimported) as server:
        health = httpx.get(f"{server.url}/health", timeout=5).json()
        assert health["ready_instances"] == 0 and health["standby_instances"] == 1  # not down
        results = asyncio.run(burst(server.url))
        assert [status for status, _, _ in results] == [200] * len(PROMPTS), results
        assert_conforms(server.url, "tiny", oracle("tiny"))
        # The pool imports a replacement meanwhile (~18 s here; the burst may be over sooner).
        deadline = time.monotonic() + 120
        while not preimported(server):
            assert time.monotonic() < deadline, server.instances()
            time.sleep(0.5)
    paths = [json.loads(line)["path"] for line in start_log.read_text().splitlines()]
    # Imported ahead, started for the burst, and a replacement imported.
    assert paths[0] == "preimport" and "preimported" in paths and paths.count("preimport") >= 2, paths


def test_first_tokens_later_than_the_target_grow_the_pool(artifacts, tmp_path):
    """One request at a time (no queue, one in flight: neither of the other triggers fires), with
    a TTFT target no engine meets: once the router has timed enough streamed first tokens the
    controller adds an instance, from the standby."""
    start_log = tmp_path / "starts.jsonl"
    args = ["--model", "tiny", "--instances", "1", "--standby", "1", "--max-instances", "2",
            "--target-ttft", "0.001", "--start-log", str(start_log)]
    with LocalServer(args, artifacts / "serve-ttft-trigger.log", ready=has_standby) as server:
        assert len([i for i in server.instances() if i["state"] == "ready"]) == 1
        body = {"model": "tiny", "prompt": "Count slowly:", "max_tokens": 4, "temperature": 0, "stream": True}
        ready, deadline = 1, time.monotonic() + 90
        while ready < 2 and time.monotonic() < deadline:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                assert "[DONE]" in "".join(response.iter_text())
            ready = len([i for i in server.instances() if i["state"] == "ready"])
    assert ready == 2
    paths = [json.loads(line)["path"] for line in start_log.read_text().splitlines()]
    assert "standby" in paths, paths
