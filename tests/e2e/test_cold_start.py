"""Cold start through the weight plane on the real CPU vLLM: a standby instance activated with a
ready peer's weights answers exactly like the peer; a corrupted transfer falls back to disk.

Two engines (a peer and a standby) for this module, beside the session's one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from engine.host import EngineHost
from engine.lifecycle import InstanceState

pytestmark = pytest.mark.slow
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 12,  # several KV blocks
    "<|im_start|>user\nWhat is a prefix cache?<|im_end|>\n<|im_start|>assistant\n",
]


def greedy_tokens(url: str, prompt: str) -> list[str]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def config(tiny_model) -> EngineConfig:
    return EngineConfig(model=tiny_model, served_model_name="tiny", cpu_cores="1", weights_key="test-key")


@pytest.fixture(scope="module")
def peer(config):
    host = EngineHost(config, "peer-under-test", host="127.0.0.1")
    asyncio.run(host.start())
    yield host
    asyncio.run(host.stop())


@pytest.fixture(scope="module")
def expected(peer) -> list[list[str]]:
    """The peer's answers, each computed once from scratch: answering from a prefix-cache hit
    changes the numerics enough to flip near-ties of greedy decoding on random weights."""
    return [greedy_tokens(peer.url, p) for p in PROMPTS]


@pytest.fixture
def standby(config):
    host = EngineHost(config, "standby-under-test", host="127.0.0.1")
    asyncio.run(host.start(standby=True))
    assert host.state == InstanceState.STANDBY
    yield host
    asyncio.run(host.stop())


def test_standby_activated_with_peer_weights_answers_exactly_like_the_peer(peer, standby, expected):
    # Before activation the standby holds dummy weights: it answers, but not like the peer.
    assert [greedy_tokens(standby.url, p) for p in PROMPTS] != expected
    timeline = asyncio.run(standby.activate(asyncio.run(peer.export_weights(use_nixl=False))))
    assert standby.state == InstanceState.READY
    assert standby.weights_record["source"] == "peer" and standby.weights_record["transport"] == "shm"
    assert timeline["details"]["weights_source"] == "peer/shm"
    assert [greedy_tokens(standby.url, p) for p in PROMPTS] == expected


def test_a_corrupted_transfer_is_detected_and_the_weights_come_from_disk(peer, standby, expected):
    descriptor = asyncio.run(peer.export_weights(use_nixl=False))
    shm = Path(descriptor["shm_path"])
    original = shm.read_bytes()
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0xFF  # the peer's host copy, behind its manifest's back
    shm.write_bytes(corrupted)
    try:
        asyncio.run(standby.activate(descriptor))
    finally:
        shm.write_bytes(original)
    record = standby.weights_record
    assert record["source"] == "disk" and "digest" in record["fallback_reason"]
    assert [greedy_tokens(standby.url, p) for p in PROMPTS] == expected
