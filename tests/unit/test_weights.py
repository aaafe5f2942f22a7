"""The weight plane without engines: disk reads, peer transfers (shared memory and NIXL over UCX),
digests, signatures, and a peer that dies mid-offer."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from engine.weights import (
    WeightExporter,
    WeightIntegrityError,
    WeightTransferError,
    fetch_from_peer,
    model_id,
    read_from_disk,
)

HOST = "127.0.0.1"
OTHER_MODEL_ID = "0" * 24  # no checkpoint has it


@pytest.fixture(autouse=True)
def _ucx_on_loopback(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_TLS", "tcp,self,sm")


@pytest.fixture
def served_weights(tiny_model, tmp_path):
    """A peer's weights read from disk into a shared-memory file, offered with a key."""
    weights = read_from_disk(tiny_model, shm_path=tmp_path / "peer-weights")
    exporter = WeightExporter(weights, HOST, key="cluster-key")
    yield weights, exporter
    exporter.close()


def checkpoint(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def test_disk_read_holds_exactly_the_checkpoint(tiny_model, served_weights):
    weights, _ = served_weights
    expected, got = checkpoint(tiny_model), dict(weights.tensors())
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert len(weights.manifest.digests) == len(expected)


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_peer_transfer_is_bit_identical_and_verified(tiny_model, served_weights, transport, tmp_path):
    weights, exporter = served_weights
    descriptor = exporter.descriptor()
    if transport == "nixl":
        descriptor["shm_path"] = None  # as seen from another node
    received, record = fetch_from_peer(descriptor, model_id(tiny_model), "cluster-key", HOST,
                                       timeout_s=30, shm_path=tmp_path / "mine")  # fmt: skip
    assert record.transport == transport and record.nbytes == weights.manifest.total_bytes
    mine = dict(received.tensors())
    for name, tensor in checkpoint(tiny_model).items():
        assert torch.equal(mine[name], tensor), name
    received.close()


def test_a_corrupted_peer_buffer_is_detected(tiny_model, served_weights):
    weights, exporter = served_weights
    victim = weights.manifest.tensors[len(weights.manifest.tensors) // 2]
    weights.buffer[victim.offset + 7] ^= 0x10  # one bit of one tensor, after the digests were taken
    for shm in (True, False):
        descriptor = exporter.descriptor()
        if not shm:
            descriptor["shm_path"] = None
        with pytest.raises(WeightIntegrityError, match=victim.name):
            fetch_from_peer(descriptor, model_id(tiny_model), "cluster-key", HOST, timeout_s=30)


def test_signatures_and_model_identity_are_enforced(tiny_model, served_weights):
    _, exporter = served_weights
    descriptor = exporter.descriptor(use_nixl=False)
    with pytest.raises(WeightTransferError, match="not signed with the cluster key"):
        fetch_from_peer(descriptor, model_id(tiny_model), "another-key", HOST)
    unsigned = {**descriptor, "signature": None}
    with pytest.raises(WeightTransferError, match="not signed"):
        fetch_from_peer(unsigned, model_id(tiny_model), "cluster-key", HOST)
    with pytest.raises(WeightTransferError, match="needs"):
        fetch_from_peer(descriptor, OTHER_MODEL_ID, "cluster-key", HOST)
    # Without a key on the receiving side the digests still guard the bytes.
    received, _ = fetch_from_peer(unsigned, model_id(tiny_model), None, HOST)
    received.close()


PEER_SCRIPT = """
import json, sys, time
from pathlib import Path
from engine.weights import WeightExporter, read_from_disk
weights = read_from_disk(Path(sys.argv[1]))
print(json.dumps(WeightExporter(weights, "127.0.0.1", None).descriptor()), flush=True)
time.sleep(600)
"""


def test_a_peer_that_died_costs_a_clean_error_not_a_hang(tiny_model):
    peer = subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, str(tiny_model)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = peer.stdout.readline()
        while not line.startswith("{"):  # NIXL logs to stdout too
            line = peer.stdout.readline()
        descriptor = json.loads(line)
    finally:
        peer.kill()
        peer.wait()
    started = time.monotonic()
    with pytest.raises(WeightTransferError):
        fetch_from_peer(descriptor, model_id(tiny_model), None, HOST, timeout_s=5)
    assert time.monotonic() - started < 30
