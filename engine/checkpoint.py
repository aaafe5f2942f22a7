"""A checkpoint's safetensors files read into memory: into one flat host buffer with parallel
positional reads (`read_from_disk`, the CPU build's weights and the host copy peers read), or
streamed through pinned staging slots to one device buffer (`stream_to_device`, CUDA), the disk
and the PCIe link working at once."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.weights import TensorEntry, WeightManifest, WeightSet, allocate, model_id

ALIGNMENT = 4096
READ_CHUNK_BYTES = 16 * 1024**2
# safetensors dtype names -> torch dtype attribute names
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}


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
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path.name}: {name} is {info['dtype']}, a safetensors dtype the weight "
                                 f"loader does not read (it reads {', '.join(_DTYPES)})")
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
    buffer = allocate(total, shm_path)
    view = memoryview(buffer)
    _read_chunks(
        files, threads, lambda c, read_into: read_into(view[c.buffer_offset : c.buffer_offset + c.nbytes])
    )
    weights = WeightSet(WeightManifest(model_id(model_dir), tuple(entries), total), buffer,
                        shm_path, owns_file=shm_path is not None)
    weights.manifest = dataclasses.replace(weights.manifest, digests=weights.compute_digests(threads))
    return weights


def host_tensors(model_dir: Path) -> Iterator[tuple[str, object]]:
    """The checkpoint's tensors one at a time in host memory, read as they are asked for: what
    each rank of a tensor-parallel engine on GPUs takes its shard from (stream_to_device would put the whole
    checkpoint on every rank's device first: 141 GB for a 70B model on an 80 GB GPU)."""
    from safetensors import safe_open

    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt", device="cpu") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                yield name, tensors.get_tensor(name)


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
