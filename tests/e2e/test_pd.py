"""Prefill/decode disaggregation on real CPU engines: same tokens as one engine, KV really moved,
a killed prefill costs no request."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from loadtest.faults import kill_engine
from loadtest.scrape import scrape

pytestmark = pytest.mark.slow
LONG = " ".join(f"line {k}: the quick brown fox jumps over the lazy dog." for k in range(60))
PROMPTS = {
    "shorter-than-a-block": {"prompt": "Hello there"},
    "several-blocks": {"prompt": LONG},
    "chat": {
        "messages": [{"role": "system", "content": LONG[:900]}, {"role": "user", "content": "Summarize."}]
    },
}


def generate(url: str, body: dict, max_tokens: int = 16) -> list[int]:
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    full = {"model": "tiny", **body, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{url}{endpoint}", json=full, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def engine_url(server, role: str) -> str:
    (instance,) = [i for i in server.instances() if i["role"] == role]
    return instance["url"]


@pytest.mark.parametrize("name", list(PROMPTS))
def test_pd_output_equals_a_single_engine_token_for_token(served, served_pd, name):
    assert generate(served_pd.url, PROMPTS[name]) == generate(served.url, PROMPTS[name])


def test_concurrent_pd_requests_equal_a_single_engine(served, served_pd):
    bodies = [{"prompt": f"Request {k}. " + LONG[: 400 + 150 * k]} for k in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        disaggregated = list(pool.map(lambda b: generate(served_pd.url, b), bodies))
    assert disaggregated == [generate(served.url, b) for b in bodies]


def test_decode_counts_the_transferred_kv_as_external_prefix_hits(served_pd):
    decode = engine_url(served_pd, "decode")
    before = scrape(decode)
    prompt = "A fresh prompt nobody sent before. " + LONG
    generate(served_pd.url, {"prompt": prompt}, max_tokens=4)
    after = scrape(decode)
    hits = after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
    prompt_tokens = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert prompt_tokens > 500
    assert hits >= prompt_tokens - 32  # all full blocks came from the prefill instance
    router = scrape(served_pd.url)
    assert router['pdcluster_router_prefills_total{where="remote"}'.split("{")[0]] > 0


def test_a_killed_prefill_costs_no_request(served, served_pd):
    """Runs last in this module: it takes the prefill instance away for good."""
    bodies = [{"prompt": f"Killed prefill {k}. " + LONG * 2} for k in range(4)]
    expected = [generate(served.url, b) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, served_pd.url, b) for b in bodies]
        time.sleep(0.05)
        kill_engine(engine_url(served_pd, "prefill"))
        results = [f.result(timeout=120) for f in futures]  # none hangs, none fails
    assert results == expected
    after = [generate(served_pd.url, b) for b in bodies[:1]]  # and the next one prefills locally
    assert after == expected[:1]
