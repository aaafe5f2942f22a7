"""The router's view of prompts agrees with the engine's: tokens, block hashes, KV events."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.slow
BLOCK = 32
LONG = " ".join(f"word{k} of the shared system prompt." for k in range(40))
REQUESTS = [
    ("/v1/completions", {"model": "tiny", "prompt": LONG}),
    ("/v1/completions", {"model": "tiny", "prompt": LONG, "cache_salt": "tenant-a"}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "system", "content": LONG}, {"role": "user", "content": "And a question?"}]}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": LONG}, {"type": "text", "text": "Part two."}]}]}),
]


def engine_prompt_tokens(answer: dict) -> list[int]:
    return answer.get("prompt_token_ids") or answer["choices"][0]["prompt_token_ids"]


@pytest.mark.parametrize("endpoint,body", REQUESTS, ids=["completion", "salted", "chat", "chat-parts"])
def test_router_tokens_and_block_hashes_are_the_engines(served, endpoint, body):
    answer = httpx.post(f"{served.url}{endpoint}", json={**body, "max_tokens": 1, "return_token_ids": True},
                        timeout=60).json()
    explained = httpx.post(f"{served.url}/admin/explain", json=body, headers=served.credentials.admin_headers(), timeout=10).json()
    assert explained["token_ids"] == engine_prompt_tokens(answer)
    full_blocks = len(explained["token_ids"]) // BLOCK
    assert full_blocks >= 5
    # Past the speculative TTL only blocks the engine itself reported (KV events) still match,
    # so equal counts mean the router's hashes are the engine's, block for block.
    time.sleep(2.5)
    explained = httpx.post(f"{served.url}/admin/explain", json=body, headers=served.credentials.admin_headers(), timeout=10).json()
    (instance,) = served.instances()
    assert explained["matched_blocks"] == {instance["instance_id"]: full_blocks}
    assert explained["kv_event_batches"] > 0


def test_salted_prompts_share_no_blocks_with_unsalted_ones(served):
    plain = httpx.post(f"{served.url}/admin/explain", json=REQUESTS[0][1], headers=served.credentials.admin_headers(), timeout=10).json()
    salted = httpx.post(f"{served.url}/admin/explain", json=REQUESTS[1][1], headers=served.credentials.admin_headers(), timeout=10).json()
    assert plain["token_ids"] == salted["token_ids"]
    assert not set(plain["block_hashes"]) & set(salted["block_hashes"])
