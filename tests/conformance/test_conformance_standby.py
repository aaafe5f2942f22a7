"""A standby engine (dummy weights) activated with a ready peer's weights answers as plain vLLM
does: SmolLM2 (real, tied embeddings) over shared memory, the tiny tied model over NIXL; the peer
itself, loaded from disk, too. (The untied tiny model over shared memory: tests/e2e/test_cold_start.py.)"""

from __future__ import annotations

import asyncio

import pytest
from oracle import ask_all, assert_conforms, differences

from engine.config import EngineConfig
from engine.host import EngineHost
from engine.lifecycle import InstanceState

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("model", "transport"), [("smollm2", "shm"), ("tiny-tied", "nixl")])
def test_standby_activated_from_a_peer_answers_as_plain_vllm(model, transport, oracle, model_dir, artifacts):
    want = oracle(model)
    config = EngineConfig(model=model_dir(model), served_model_name=model, cpu_cores="1",
                          log_dir=artifacts / "conformance-standby")
    peer = EngineHost(config, f"peer-{model}", host="127.0.0.1")
    standby = EngineHost(config, f"standby-{model}", host="127.0.0.1")

    async def start_both() -> None:
        await asyncio.gather(peer.start(), standby.start(standby=True))

    try:
        asyncio.run(start_both())
        assert_conforms(peer.url, model, want, peer.auth_headers)  # the disk path
        assert standby.state == InstanceState.STANDBY
        assert differences(ask_all(standby.url, model, headers=standby.auth_headers), want)  # dummy weights: the check can fail
        # Over NIXL as for a peer on another node: no shared-memory file offered.
        descriptor = asyncio.run(peer.export_weights(use_nixl=transport == "nixl", offer_file=transport == "shm"))
        asyncio.run(standby.activate(descriptor))
        assert (standby.weights_record["source"], standby.weights_record["transport"]) == ("peer", transport)
        assert_conforms(standby.url, model, want, standby.auth_headers)
    finally:
        asyncio.run(standby.stop())
        asyncio.run(peer.stop())
