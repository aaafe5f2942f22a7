"""Cold start through the weight plane on the real CPU vLLM: a standby instance activated with a
ready peer's weights answers as plain vLLM does; a corrupted transfer falls back to disk.

Two engines (a peer and a standby) for this module, beside the session's one."""

from __future__ import annotations

import asyncio

import pytest
from oracle import ask_all, differences

from engine.config import EngineConfig
from engine.host import EngineHost
from engine.lifecycle import InstanceState

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def config(tiny_model) -> EngineConfig:
    return EngineConfig(model=tiny_model, served_model_name="tiny", cpu_cores="1")


@pytest.fixture(scope="module")
def peer(config):
    host = EngineHost(config, "peer-under-test", host="127.0.0.1")
    asyncio.run(host.start())
    yield host
    asyncio.run(host.stop())


@pytest.fixture(scope="module")
def expected(oracle) -> dict:
    return oracle("tiny")


@pytest.fixture
def standby(config):
    host = EngineHost(config, "standby-under-test", host="127.0.0.1")
    asyncio.run(host.start(standby=True))
    assert host.state == InstanceState.STANDBY
    yield host
    asyncio.run(host.stop())


def test_standby_activated_with_peer_weights_answers_exactly_like_the_peer(peer, standby, expected):
    # Before activation the standby holds dummy weights: it answers, but not as vLLM does.
    assert differences(ask_all(standby.url, "tiny", headers=standby.auth_headers), expected)
    timeline = asyncio.run(standby.activate(asyncio.run(peer.export_weights(use_nixl=False))))
    assert standby.state == InstanceState.READY
    assert standby.weights_record["source"] == "peer" and standby.weights_record["transport"] == "shm"
    assert timeline["details"]["weights_source"] == "peer/shm"
    assert not differences(ask_all(standby.url, "tiny", headers=standby.auth_headers), expected)


def test_a_corrupted_transfer_is_detected_and_the_weights_come_from_disk(peer, standby, expected):
    descriptor = asyncio.run(peer.export_weights(use_nixl=False))
    shm = standby.config.weights_dir / descriptor["shm_name"]
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
    assert not differences(ask_all(standby.url, "tiny", headers=standby.auth_headers), expected)
