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
import hashlib
import hmac
import importlib.util
import json
import mmap
import os
import re
import secrets
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from transport.nixl import add_peer, new_agent, transfer

ALIGNMENT = 4096
WEIGHTS_FILE_PREFIX = "pdcluster-weights-"
_WEIGHTS_FILE_NAME = re.compile(rf"{WEIGHTS_FILE_PREFIX}[0-9a-f]{{32}}")
READ_CHUNK_BYTES = 16 * 1024**2
# safetensors dtype names -> torch dtype attribute names
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


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
        self.buffer = np.empty(0, np.uint8)
        if self.owns_file and self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)


def _allocate(nbytes: int, shm_path: Path | None) -> np.ndarray:
    """A buffer of `nbytes`: private memory, or a new file at `shm_path` only its owner may read
    (created, never reused: O_EXCL, no links followed)."""
    if shm_path is None:
        return np.empty(nbytes, np.uint8)
    descriptor = os.open(shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w+b") as handle:
        handle.truncate(max(nbytes, 1))
        return np.frombuffer(mmap.mmap(handle.fileno(), max(nbytes, 1)), np.uint8)[:nbytes]


def _map_peer_file(weights_dir: Path, name: str, nbytes: int) -> np.ndarray:
    """A peer's host copy on this node, mapped copy-on-write (pages stay shared with the peer
    unless someone writes to them). Only a name of our own making (checked by the caller), in
    our own weights folder, never through a link."""
    descriptor = os.open(weights_dir / name, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mapped) < nbytes:
        raise WeightTransferError(f"the peer's weights file holds {len(mapped)} bytes, the manifest {nbytes}")
    return np.frombuffer(mapped, np.uint8)[:nbytes]


def _safetensors_layout(model_dir: Path) -> tuple[list[TensorEntry], list[tuple[Path, int, int, int]]]:
    """Tensor entries in a flat buffer holding each file's data section at an aligned offset,
    and per file (path, file offset of its data, bytes, buffer offset)."""
    entries: list[TensorEntry] = []
    files: list[tuple[Path, int, int, int]] = []
    cursor = 0
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in paths:
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        header.pop("__metadata__", None)
        data_start = 8 + header_len
        data_bytes = max((t["data_offsets"][1] for t in header.values()), default=0)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            entries.append(TensorEntry(name, _DTYPES[info["dtype"]], tuple(info["shape"]),
                                       cursor + begin, end - begin))
        files.append((path, data_start, data_bytes, cursor))
        cursor += -(-data_bytes // ALIGNMENT) * ALIGNMENT
    return entries, files


@dataclasses.dataclass(frozen=True)
class _Chunk:
    path: Path
    file_offset: int
    buffer_offset: int
    nbytes: int


def _read_chunks(
    files: list[tuple[Path, int, int, int]],
    threads: int,
    land: Callable[[_Chunk, Callable[[memoryview], None]], None],
) -> None:
    """Read every file's data section in READ_CHUNK_BYTES chunks on `threads` threads; for each
    chunk `land(chunk, read_into)` picks the memory and calls `read_into(view)` to fill it."""
    chunks = [
        _Chunk(path, file_offset + pos, buffer_offset + pos, min(READ_CHUNK_BYTES, nbytes - pos))
        for path, file_offset, nbytes, buffer_offset in files
        for pos in range(0, nbytes, READ_CHUNK_BYTES)
    ]
    descriptors = {path: os.open(path, os.O_RDONLY) for path, *_ in files}

    def read(chunk: _Chunk) -> None:
        def read_into(view: memoryview) -> None:
            done = 0
            while done < chunk.nbytes:
                got = os.preadv(
                    descriptors[chunk.path], [view[done : chunk.nbytes]], chunk.file_offset + done
                )
                if got <= 0:
                    raise OSError(f"short read of {chunk.path} at {chunk.file_offset + done}")
                done += got

        land(chunk, read_into)

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, chunks))
    finally:
        for fd in descriptors.values():
            os.close(fd)


def read_from_disk(model_dir: Path, shm_path: Path | None = None, threads: int = 8) -> WeightSet:
    """Read every safetensors file of `model_dir` into one flat host buffer (a shared-memory file
    at `shm_path`, if given) with `threads` parallel positional reads; digests are computed
    on the way out, for serving peers."""
    entries, files = _safetensors_layout(model_dir)
    total = (files[-1][3] + files[-1][2]) if files else 0
    buffer = _allocate(total, shm_path)
    view = memoryview(buffer)
    _read_chunks(
        files, threads, lambda c, read_into: read_into(view[c.buffer_offset : c.buffer_offset + c.nbytes])
    )
    weights = WeightSet(WeightManifest(model_id(model_dir), tuple(entries), total), buffer,
                        shm_path, owns_file=shm_path is not None)
    weights.manifest = dataclasses.replace(weights.manifest, digests=weights.compute_digests(threads))
    return weights


def stream_to_device(model_dir: Path, device, threads: int = 8):
    """Disk -> pinned staging slots -> one device buffer: each slot's host-to-device copy runs on
    its reading thread's CUDA stream while other threads read on, so the disk and the PCIe link
    work at once and no pageable or whole-model host buffer is touched.
    Returns (name, device tensor) pairs, views of that buffer."""
    import queue
    import threading

    import torch

    entries, files = _safetensors_layout(model_dir)
    total = (files[-1][3] + files[-1][2]) if files else 0
    target = torch.empty(total, dtype=torch.uint8, device=device)
    slots: queue.Queue = queue.Queue()
    for _ in range(2 * threads):
        slots.put((torch.empty(READ_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event()))
    local = threading.local()

    def land(chunk: _Chunk, read_into: Callable[[memoryview], None]) -> None:
        if not hasattr(local, "stream"):
            local.stream = torch.cuda.Stream(device)
        slot, copied = slots.get()
        copied.synchronize()  # this slot's previous copy has left it
        read_into(memoryview(slot.numpy()))
        with torch.cuda.stream(local.stream):
            target[chunk.buffer_offset : chunk.buffer_offset + chunk.nbytes].copy_(
                slot[: chunk.nbytes], non_blocking=True
            )
            copied.record(local.stream)
        slots.put((slot, copied))

    _read_chunks(files, threads, land)
    torch.cuda.synchronize(device)
    return _device_views(entries, target)


def _device_views(entries: list[TensorEntry], target) -> list[tuple[str, object]]:
    import torch

    tensors = []
    for entry in entries:
        dtype = getattr(torch, entry.dtype)
        view = target[entry.offset : entry.offset + entry.nbytes].view(dtype)
        tensors.append((entry.name, view.view(entry.shape)))
    return tensors


# --- serving weights to peers, and fetching them ---------------------------------------------


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
        buffer = _nixl_read(descriptor["nixl"], _allocate(manifest.total_bytes, own_file), timeout_s)
        weights = WeightSet(manifest, buffer, own_file, owns_file=own_file is not None)
        transport = "nixl"
    else:
        raise WeightTransferError("the peer offers neither a weights file on this node nor NIXL")
    transferred = time.perf_counter()
    weights.verify(threads)
    return weights, FetchRecord(transport, manifest.total_bytes, transferred - started,
                                time.perf_counter() - transferred)


def _nixl_read(remote: dict, buffer: np.ndarray, timeout_s: float) -> np.ndarray:
    """One-sided READ of the peer's registered buffer into `buffer`, bounded by `timeout_s`."""
    if buffer.nbytes != remote["nbytes"]:
        raise WeightTransferError(
            f"the peer offers {remote['nbytes']} bytes, the manifest says {buffer.nbytes}"
        )
    agent = new_agent("pdc-fetch")
    registration = agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
    try:
        peer = add_peer(agent, base64.b64decode(remote["metadata"]))
        transfer(agent, "READ", [(buffer.ctypes.data, buffer.nbytes)], [(remote["address"], buffer.nbytes)],
                 peer, timeout_s)
        agent.remove_remote_agent(peer)
        return buffer
    except Exception as exc:  # NixlTransferError, or NIXL's own: an unreachable or vanished peer
        raise WeightTransferError(f"NIXL read failed: {exc}") from exc
    finally:
        agent.deregister_memory(registration)
