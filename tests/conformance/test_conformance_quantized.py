"""A quantized checkpoint (tiny-w8a8: compressed-tensors W8A8 int8, the format the CPU build runs
with its own int8 kernels) answers as plain vLLM does on it on every CPU load path: an engine
started from disk (dummy weights, then the checkpoint through vLLM's in-place reload, which
quantizes and repacks each layer again) and a standby activated from that engine's weights over
shared memory. Sleeping standbys are CUDA-only (docs/conformance.md).

Plain vLLM first, then one peer and one standby started together: two engines at most."""

from __future__ import annotations

import asyncio

import pytest
from engine_pair import peer_and_standby
from oracle import ask_all, assert_conforms, differences

from engine.config import EngineConfig
from engine.lifecycle import InstanceState
from security.credentials import ClusterCredentials

pytestmark = [pytest.mark.slow, pytest.mark.oracles("tiny-w8a8")]
MODEL = "tiny-w8a8"
CREDENTIALS = ClusterCredentials.load()


@pytest.fixture(scope="module")
def engines(model_dir, artifacts, oracle):
    """The oracle's answers (before our engines take the cores), a ready engine loaded from disk
    (the peer) and a standby started beside it."""
    want = oracle(MODEL)
    config = EngineConfig(model=model_dir(MODEL), served_model_name=MODEL, cpu_cores="1",
                          log_dir=artifacts / "conformance-quantized")
    with peer_and_standby(config, MODEL, CREDENTIALS) as hosts:
        yield hosts, want


def test_a_quantized_engine_started_from_disk_answers_as_plain_vllm(engines):
    hosts, want = engines
    peer = hosts["peer"]
    assert peer.weights_record["source"] == "disk" and not peer.weights_record["fallback_reason"]
    assert_conforms(peer.access, MODEL, want)


def test_a_quantized_standby_activated_from_a_peer_answers_as_plain_vllm(engines):
    hosts, want = engines
    peer, standby = hosts["peer"], hosts["standby"]
    assert standby.state == InstanceState.STANDBY
    # Dummy weights until activated: it answers, but not as vLLM does (the check can fail).
    assert differences(ask_all(standby.access, MODEL), want)
    timeline = asyncio.run(standby.activate(asyncio.run(peer.export_weights(use_nixl=False))))
    assert standby.state == InstanceState.READY
    assert (standby.weights_record["source"], standby.weights_record["transport"]) == ("peer", "shm")
    assert timeline["details"]["weights_source"] == "peer/shm"
    assert_conforms(standby.access, MODEL, want)
