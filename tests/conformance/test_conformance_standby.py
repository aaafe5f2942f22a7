"""A standby engine (dummy weights) activated with a ready peer's weights answers as plain vLLM
does, over both ways weights travel between peers: shared memory (a peer on the same node) and
NIXL (a peer on another node: no shared-memory file offered). tiny (random, untied) goes both
ways; SmolLM2 (real, tied embeddings) through shared memory only: the two ways move the same
tensors by the same descriptor, and a SmolLM2 standby costs ~2.5 minutes of CI on two cores. The
peer itself, loaded from disk, too. A corrupted transfer is caught and the weights come from disk
instead (on tiny: the fallback is the same for every model). tiny-tied is left out: what it adds,
an output head tied to the embedding (one tensor for two names), SmolLM2 already moves.

One peer per model for the module; one standby at a time beside it (three engines at most with
the session's served one)."""

from __future__ import annotations

import asyncio

import pytest
from oracle import ask_all, assert_conforms, differences

from engine.config import EngineConfig
from engine.host import EngineHost
from engine.lifecycle import InstanceState
from security.credentials import ClusterCredentials

pytestmark = pytest.mark.slow
MODELS = ("smollm2", "tiny")
CREDENTIALS = ClusterCredentials.load()  # the session's: peers and standbys of one cluster sign alike


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def config(model, model_dir, artifacts) -> EngineConfig:
    return EngineConfig(model=model_dir(model), served_model_name=model, cpu_cores="1",
                        log_dir=artifacts / "conformance-standby")


@pytest.fixture(scope="module")
def engines(config, model, oracle):
    """A ready engine loaded from disk (the peer), checked against plain vLLM before it lends its
    weights, and a spare standby started beside it (a start costs seconds; two at once, less)."""
    peer = EngineHost(config, f"peer-{model}", host="127.0.0.1", keys=CREDENTIALS.engine_host_keys(f"peer-{model}"))
    spare = EngineHost(config, f"standby-{model}-0", host="127.0.0.1",
                       keys=CREDENTIALS.engine_host_keys(f"standby-{model}-0"))
    started = {"peer": peer, "spares": [spare], "all": [peer, spare]}

    async def start_both() -> None:
        await asyncio.gather(peer.start(), spare.start(standby=True))

    try:
        asyncio.run(start_both())
        assert_conforms(peer.access, model, oracle(model))  # the disk path
        yield started
    finally:
        for host in started["all"]:
            asyncio.run(host.stop())


@pytest.fixture(scope="module")
def peer(engines) -> EngineHost:
    return engines["peer"]


@pytest.fixture
def standby(engines, config, model, oracle):
    """A standby: the spare started beside the peer, else a new one (stopped after the test)."""
    if engines["spares"]:
        host = engines["spares"].pop()
    else:
        name = f"standby-{model}-{len(engines['all']) - 1}"
        host = EngineHost(config, name, host="127.0.0.1", keys=CREDENTIALS.engine_host_keys(name))
        engines["all"].append(host)
        asyncio.run(host.start(standby=True))
    try:
        assert host.state == InstanceState.STANDBY
        # Dummy weights until activated: it answers, but not as vLLM does (the check can fail).
        assert differences(ask_all(host.access, model), oracle(model))
        yield host
    finally:
        asyncio.run(host.stop())


@pytest.mark.parametrize(("model", "transport"), [
    pytest.param("smollm2", "shm", marks=pytest.mark.oracles("smollm2")),
    pytest.param("tiny", "shm", marks=pytest.mark.oracles("tiny")),
    pytest.param("tiny", "nixl", marks=pytest.mark.oracles("tiny"))], indirect=["model"])
def test_standby_activated_from_a_peer_answers_as_plain_vllm(model, transport, peer, standby, oracle):
    descriptor = asyncio.run(peer.export_weights(use_nixl=transport == "nixl", offer_file=transport == "shm"))
    timeline = asyncio.run(standby.activate(descriptor))
    assert standby.state == InstanceState.READY
    assert (standby.weights_record["source"], standby.weights_record["transport"]) == ("peer", transport)
    assert timeline["details"]["weights_source"] == f"peer/{transport}"
    assert_conforms(standby.access, model, oracle(model))


@pytest.mark.oracles("tiny")
@pytest.mark.parametrize("model", ["tiny"], indirect=True)
def test_a_corrupted_transfer_is_detected_and_the_weights_come_from_disk(model, peer, standby, oracle):
    weights = asyncio.run(peer.export_weights(use_nixl=False))
    shm = standby.config.weights_dir / weights.ranks[0]["shm_name"]
    original = shm.read_bytes()
    corrupted = bytearray(original)
    corrupted[len(corrupted) // 2] ^= 0xFF  # the peer's host copy, behind its manifest's back
    shm.write_bytes(corrupted)
    try:
        asyncio.run(standby.activate(weights))
    finally:
        shm.write_bytes(original)
    record = standby.weights_record
    assert record["source"] == "disk" and "digest" in record["fallback_reason"]
    assert_conforms(standby.access, model, oracle(model))
