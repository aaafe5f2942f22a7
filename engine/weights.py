"""The weight plane: a model's checkpoint tensors as one flat host buffer with a manifest.

A buffer is filled from disk (parallel reads of the safetensors files, `read_from_disk`) or from
a warm peer that holds the same model (`fetch_from_peer`): mapped read-only from the peer's shared
memory file when both run on one node, read one-sided over NIXL/UCX otherwise (RDMA on clusters,
TCP here). Every buffer carries per-tensor digests; a received buffer is checked tensor by tensor,
and every descriptor a peer offers (manifest, digests, where to read) is signed with the cluster's
weights key (security/credentials.py), so a transfer can neither be corrupted nor forged
unnoticed. A shared-memory file is created 0600 under an unguessable name; a descriptor names it
by that name alone, which the receiver checks and looks up in its own weights folder: no path
ever comes from a caller. The engine then takes the tensors through
vLLM's own in-place `reload_weights` (engine/worker_extension.py).

The buffer keeps the checkpoint layout, not the engine's kernel layout: on the CPU build vLLM
repacks linear weights outside the module's parameters, so only checkpoint tensors can be handed
from one engine to another and re-processed by the receiver.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import fcntl
import hashlib
import hmac
import importlib.util
import json
import logging
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from transport.nixl import NixlTimeoutError, add_peer, new_agent, transfer

logger = logging.getLogger(__name__)

WEIGHTS_FILE_PREFIX = "pdcluster-weights-"
# Set by the engine's host (engine/server_command.py): the node's folder of weights files, and where
# the worker (engine/worker_extension.py) keeps the host copy of its weights that its node's peers
# may map (a name of the host's making, never a caller's; unset: no copy).
WEIGHTS_DIR_ENV = "PDCLUSTER_WEIGHTS_DIR"
WEIGHTS_FILE_ENV = "PDCLUSTER_WEIGHTS_FILE"
_WEIGHTS_FILE_NAME = re.compile(rf"{WEIGHTS_FILE_PREFIX}[0-9a-f]{{32}}")


class WeightTransferError(RuntimeError):
    """A peer could not deliver the weights (unreachable, timed out, wrong model, bad signature)."""


class WeightIntegrityError(WeightTransferError):
    """Received bytes do not match the manifest's digests."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    offset: int  # in the flat buffer
    nbytes: int


@dataclasses.dataclass(frozen=True)
class WeightManifest:
    """What a flat buffer holds: the model it belongs to, each tensor's place, each one's digest."""

    model_id: str
    tensors: tuple[TensorEntry, ...]
    total_bytes: int
    digests: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WeightManifest:
        raw = json.loads(text)
        tensors = tuple(
            TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["nbytes"])
            for t in raw["tensors"]
        )
        return cls(raw["model_id"], tensors, raw["total_bytes"], tuple(raw["digests"]))



@dataclasses.dataclass(frozen=True)
class PeerWeights:
    """What a ready engine offers a new engine of its model: one signed descriptor per rank of
    its tensor-parallel group (engine/worker_extension.py `pdc_export_weights`), rank r's for the
    new engine's rank r. Only an engine of the same tensor-parallel size can use it."""

    instance_id: str
    ranks: tuple[dict, ...]

    @property
    def tensor_parallel_size(self) -> int:
        return len(self.ranks)

    @property
    def sharded(self) -> bool:
        """Each rank offers its own shard (CUDA IPC), not the whole checkpoint (a host copy)."""
        return any(rank.get("kind") == "cuda_ipc" for rank in self.ranks)


def sign(key: str, descriptor: dict) -> str:
    """HMAC-SHA256 of a descriptor's canonical JSON, its `signature` field left out."""
    body = json.dumps({k: v for k, v in descriptor.items() if k != "signature"}, sort_keys=True)
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()


def check_signature(key: str, descriptor: dict) -> None:
    if not hmac.compare_digest(str(descriptor.get("signature") or ""), sign(key, descriptor)):
        raise WeightTransferError("the peer's weight descriptor is not signed with the cluster's weights key")


def new_weights_file(weights_dir: Path) -> Path:
    """Where an instance keeps the host copy it offers its node's peers: an unguessable name."""
    return weights_dir / f"{WEIGHTS_FILE_PREFIX}{secrets.token_hex(16)}"


def model_id(model_dir: Path) -> str:
    """Identifies a checkpoint by its config and the names and sizes of its weight files."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:24]


def _tensor_digest(view: memoryview) -> str:
    return hashlib.blake2b(view, digest_size=16).hexdigest()


class WeightSet:
    """A flat uint8 buffer of checkpoint tensors and its manifest. Owns its shared-memory file when
    it made one (`close()` removes it); a mapped peer file is only unmapped."""

    def __init__(self, manifest: WeightManifest, buffer: np.ndarray, shm_path: Path | None = None,
                 owns_file: bool = False):
        self.manifest = manifest
        self.buffer = buffer
        self.shm_path = shm_path
        self.owns_file = owns_file

    def tensors(self) -> Iterator[tuple[str, object]]:
        """(name, torch.Tensor) views into the buffer, no copies."""
        import torch

        for entry in self.manifest.tensors:
            dtype = getattr(torch, entry.dtype)
            count = entry.nbytes // dtype.itemsize
            flat = torch.frombuffer(self.buffer, dtype=dtype, count=count, offset=entry.offset)
            yield entry.name, flat.view(entry.shape)

    def compute_digests(self, threads: int = 8) -> tuple[str, ...]:
        view = memoryview(self.buffer)
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:  # hashlib drops the GIL
            return tuple(
                pool.map(lambda e: _tensor_digest(view[e.offset : e.offset + e.nbytes]),
                         self.manifest.tensors)
            )

    def verify(self, threads: int = 8) -> None:
        """Raise WeightIntegrityError naming the tensors whose bytes differ from the manifest."""
        actual = self.compute_digests(threads)
        bad = [e.name for e, want, got in zip(self.manifest.tensors, self.manifest.digests, actual,
                                              strict=True) if want != got]
        if bad:
            raise WeightIntegrityError(f"{len(bad)} tensors fail their digest: {bad[:5]}")

    def close(self) -> None:
        # removed while still mapped (so locked): a sweep never finds it unlocked under its name
        if self.owns_file and self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)
        self.buffer = np.empty(0, np.uint8)


def allocate(nbytes: int, shm_path: Path | None) -> np.ndarray:
    """A buffer of `nbytes`: private memory, or a new file at `shm_path` only its owner may read
    (created, never reused: O_EXCL, no links followed). The file carries a shared lock for as long
    as its mapping lives (the mapping holds a duplicate of the locked descriptor), which the kernel
    drops when the process dies however it dies: what `remove_orphaned_weights` goes by."""
    if shm_path is None:
        return np.empty(nbytes, np.uint8)
    descriptor = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
        handle.truncate(max(nbytes, 1))
        return np.frombuffer(mmap.mmap(handle.fileno(), max(nbytes, 1)), np.uint8)[:nbytes]


def remove_orphaned_weights(weights_dir: Path, min_age_s: float = 10.0) -> int:
    """Remove the weights files in `weights_dir` whose owner died without removing its own (a
    killed engine process or actor; `ray stop`): regular files of this user's, of our naming, that
    no process holds locked (`allocate`). Each is host memory (a tmpfs file) until removed. Files
    younger than `min_age_s` are left (their owner may be between creating and locking), and any
    file this cannot lock or remove is kept. Returns the bytes freed (logged); a standby that
    still maps a removed file copy-on-write keeps those pages until it unmaps them."""
    freed = 0
    for path in weights_dir.glob(f"{WEIGHTS_FILE_PREFIX}*"):
        if _WEIGHTS_FILE_NAME.fullmatch(path.name):
            freed += _remove_if_orphaned(path, min_age_s)
    if freed:
        logger.warning("removed %.2f GiB of weights files that engines killed on this node left behind", freed / 2**30)
    return freed


def _remove_if_orphaned(path: Path, min_age_s: float) -> int:
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # a link, or gone meanwhile
        return 0
    try:
        status = os.fstat(descriptor)
        if (not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid()
                or time.time() - status.st_ctime < min_age_s):
            return 0
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its owner lives
        named = os.stat(path, follow_symlinks=False)  # still this file under that name
        if (named.st_dev, named.st_ino) != (status.st_dev, status.st_ino):
            return 0
        path.unlink()
        return status.st_blocks * 512
    except OSError:  # locked, gone, or a filesystem without locks: kept
        return 0
    finally:
        os.close(descriptor)


def _map_peer_file(weights_dir: Path, name: str, nbytes: int) -> np.ndarray:
    """A peer's host copy on this node, mapped copy-on-write (pages stay shared with the peer
    unless someone writes to them). Only a name of our own making (checked by the caller), in
    our own weights folder, never through a link."""
    descriptor = os.open(weights_dir / name, os.O_RDONLY | os.O_NOFOLLOW)
    status = os.fstat(descriptor)
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        os.close(descriptor)
        raise WeightTransferError(f"{name} is not a weights file of this user's alone")
    with os.fdopen(descriptor, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mapped) < nbytes:
        raise WeightTransferError(f"the peer's weights file holds {len(mapped)} bytes, the manifest {nbytes}")
    return np.frombuffer(mapped, np.uint8)[:nbytes]


class WeightExporter:
    """Offers a WeightSet to peers: its shared-memory file (same node) and a NIXL agent that has
    the buffer registered for one-sided reads (any node). Owned by the serving worker."""

    def __init__(self, weights: WeightSet, host: str, key: str):
        self.weights = weights
        self.host = host
        self.key = key
        self._agent = None
        self._registration = None

    def descriptor(self, use_nixl: bool = True, offer_file: bool = True) -> dict:
        """For `fetch_from_peer`, signed; NIXL is offered where it is installed (not needed on
        one node), the shared-memory file unless `offer_file` is False (for peers elsewhere)."""
        own_file = self.weights.shm_path if self.weights.owns_file and offer_file else None
        described: dict = {
            "kind": "host_copy",
            "host": self.host,
            "manifest": self.weights.manifest.to_json(),
            "shm_name": own_file.name if own_file is not None else None,
            "nixl": self._nixl_descriptor() if use_nixl and importlib.util.find_spec("nixl") else None,
        }
        return described | {"signature": sign(self.key, described)}

    def _nixl_descriptor(self) -> dict:
        if self._agent is None:
            self._agent = new_agent("pdc-weights")
            address = self.weights.buffer.ctypes.data
            self._registration = self._agent.register_memory(
                [(address, self.weights.buffer.nbytes, 0, "")], "DRAM"
            )
        return {
            "agent": self._agent.name,
            "metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "address": self.weights.buffer.ctypes.data,
            "nbytes": self.weights.buffer.nbytes,
        }

    def close(self) -> None:
        if self._agent is not None and self._registration is not None:
            self._agent.deregister_memory(self._registration)
        self._agent = self._registration = None
        self.weights.close()


@dataclasses.dataclass
class FetchRecord:
    transport: str  # "shm" or "nixl"
    nbytes: int
    transfer_s: float
    verify_s: float


def fetch_from_peer(
    descriptor: dict,
    expected_model_id: str,
    key: str,
    local_host: str,
    weights_dir: Path,
    timeout_s: float = 60.0,
    threads: int = 8,
    own_file: Path | None = None,
) -> tuple[WeightSet, FetchRecord]:
    """Get a peer's weights and check them: signature, model, digests. On the peer's node with
    its file there: map it; otherwise read it over NIXL (into a new file of ours at `own_file`,
    when given, so this instance can serve peers in turn)."""
    check_signature(key, descriptor)
    manifest = WeightManifest.from_json(descriptor["manifest"])
    if manifest.model_id != expected_model_id:
        raise WeightTransferError(
            f"the peer holds model {manifest.model_id}, this instance needs {expected_model_id}"
        )
    started = time.perf_counter()
    name = descriptor.get("shm_name")
    if name is not None and not _WEIGHTS_FILE_NAME.fullmatch(str(name)):
        raise WeightTransferError(f"the peer names no weights file of ours: {str(name)[:80]!r}")
    if name and descriptor["host"] == local_host and (weights_dir / name).exists():
        buffer = _map_peer_file(weights_dir, name, manifest.total_bytes)
        weights, transport = WeightSet(manifest, buffer, weights_dir / name), "shm"
    elif descriptor.get("nixl"):
        buffer = _nixl_read(descriptor["nixl"], allocate(manifest.total_bytes, own_file), timeout_s)
        weights = WeightSet(manifest, buffer, own_file, owns_file=own_file is not None)
        transport = "nixl"
    else:
        raise WeightTransferError("the peer offers neither a weights file on this node nor NIXL")
    transferred = time.perf_counter()
    weights.verify(threads)
    return weights, FetchRecord(transport, manifest.total_bytes, transferred - started,
                                time.perf_counter() - transferred)


FIRST_READ_BYTES = 4096
FIRST_READ_TIMEOUT_S = 10.0
FIRST_READ_TRIES = 3
"""A read from a peer starts with its first FIRST_READ_BYTES, and one not done in
FIRST_READ_TIMEOUT_S is tried again by a new agent (a new connection), FIRST_READ_TRIES times in
all, before the whole read: a weight read between two agents of one machine was seen never to
complete, in two CI runs and no other (docs/tensor-parallel.md), and a read of gigabytes cannot
tell a stalled connection from a slow one."""


def _nixl_read(remote: dict, buffer: np.ndarray, timeout_s: float) -> np.ndarray:
    """One-sided READ of the peer's registered buffer into `buffer`, bounded by `timeout_s`."""
    if buffer.nbytes != remote["nbytes"]:
        raise WeightTransferError(
            f"the peer offers {remote['nbytes']} bytes, the manifest says {buffer.nbytes}"
        )
    deadline = time.monotonic() + timeout_s
    whole = ([(buffer.ctypes.data, buffer.nbytes)], [(remote["address"], buffer.nbytes)])
    first = min(FIRST_READ_BYTES, buffer.nbytes)
    for tries in range(1, FIRST_READ_TRIES + 1):
        agent = new_agent("pdc-fetch")
        registration = agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
        try:
            peer = add_peer(agent, base64.b64decode(remote["metadata"]))
            try:  # a stalled try's endpoint is closed too, not left to the serving peer's worker
                try:
                    transfer(agent, "READ", [(buffer.ctypes.data, first)], [(remote["address"], first)], peer,
                             min(FIRST_READ_TIMEOUT_S, deadline - time.monotonic()))
                except NixlTimeoutError:
                    logger.warning("NIXL: a first read from the peer was not done in %g s (try %d of %d)",
                                   FIRST_READ_TIMEOUT_S, tries, FIRST_READ_TRIES)
                    continue
                transfer(agent, "READ", *whole, peer, deadline - time.monotonic())
                return buffer
            finally:
                agent.remove_remote_agent(peer)
        except Exception as exc:  # NixlTransferError, or NIXL's own: an unreachable or vanished peer
            raise WeightTransferError(f"NIXL read failed: {exc}") from exc
        finally:
            agent.deregister_memory(registration)
    raise WeightTransferError(f"NIXL read failed: no first read done in {FIRST_READ_TRIES} tries")
