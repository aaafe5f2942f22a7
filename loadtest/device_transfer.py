"""For loadtest/d2d_weights.py, the benchmark of device-to-device weights: the ways it compares
(engines use CUDA IPC with typed handles, engine/worker_extension.py).

Weights from device to device: a warm peer's tensors as one flat region per dtype, sent to a
new instance over torch.distributed (NCCL between GPUs, over NVLink within a node; gloo on the
CPU build, which is how the tests run it) and verified on the receiving device, never staged in
host memory.

The sender packs once (`pack`); each transfer is then one send per dtype region. The receiver
gets the layout and checksums first (a small object), allocates the regions on its device,
receives, checks each region with `region_checksum` (a position-weighted sum computed on the
device) and hands out views (`unpack`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.distributed as dist

from engine.device_checksum import region_checksum

_SLICE_ELEMENTS = 1 << 27


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # elements into its dtype's region
    numel: int


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    entries: tuple[Entry, ...]
    region_numel: dict[str, int]
    """Elements per dtype region, padded so every region is a whole number of 32-bit words."""

    @property
    def nbytes(self) -> int:
        return sum(n * getattr(torch, d).itemsize for d, n in self.region_numel.items())


def pack(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[FlatLayout, dict[str, torch.Tensor]]:
    """Copy tensors into one flat region per dtype on their device; returns layout and regions."""
    items = list(tensors)
    sizes: dict[str, int] = {}
    entries = []
    for name, tensor in items:
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append(Entry(name, dtype, tuple(tensor.shape), sizes.get(dtype, 0), tensor.numel()))
        sizes[dtype] = sizes.get(dtype, 0) + tensor.numel()
    per_word = {d: max(1, 4 // getattr(torch, d).itemsize) for d in sizes}
    sizes = {d: -(-n // per_word[d]) * per_word[d] for d, n in sizes.items()}
    device = items[0][1].device if items else torch.device("cpu")
    regions = {d: torch.zeros(n, dtype=getattr(torch, d), device=device) for d, n in sizes.items()}
    for entry, (_, tensor) in zip(entries, items, strict=True):
        regions[entry.dtype][entry.offset : entry.offset + entry.numel].copy_(tensor.reshape(-1))
    return FlatLayout(tuple(entries), sizes), regions


def unpack(layout: FlatLayout, regions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views into the regions, by tensor name (no copies)."""
    return {e.name: regions[e.dtype][e.offset : e.offset + e.numel].view(e.shape) for e in layout.entries}


def checksums(regions: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    return {dtype: region_checksum(region) for dtype, region in regions.items()}


def _pieces(regions: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each region cut in slices, all posted at once so NCCL keeps several channels busy."""
    return [
        regions[dtype][start : start + _SLICE_ELEMENTS]
        for dtype in sorted(regions)
        for start in range(0, regions[dtype].numel(), _SLICE_ELEMENTS)
    ]


def send_weights(layout: FlatLayout, regions: dict[str, torch.Tensor], dst: int, group=None) -> None:
    """Send the layout and checksums (one small object), then every region."""
    header = [layout, checksums(regions)]
    dist.send_object_list(header, dst=dst, group=group, device=_object_device(regions))
    ops = [dist.P2POp(dist.isend, piece, dst, group) for piece in _pieces(regions)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def recv_weights(src: int, device: torch.device, group=None) -> tuple[FlatLayout, dict[str, torch.Tensor]]:
    """Receive what `send_weights` sends into fresh regions on `device`; raise ValueError when a
    region's checksum differs from the sender's."""
    header: list = [None, None]
    dist.recv_object_list(header, src=src, group=group, device=device if device.type == "cuda" else None)
    layout, expected = header
    regions = {
        d: torch.empty(n, dtype=getattr(torch, d), device=device) for d, n in layout.region_numel.items()
    }
    ops = [dist.P2POp(dist.irecv, piece, src, group) for piece in _pieces(regions)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    verify(regions, expected)
    return layout, regions


def verify(regions: dict[str, torch.Tensor], expected: dict[str, tuple[int, int]]) -> None:
    """Raise ValueError naming the regions whose checksum differs from the sender's."""
    got = checksums(regions)
    bad = [d for d in regions if tuple(got[d]) != tuple(expected[d])]
    if bad:
        raise ValueError(f"weight regions {bad} arrived corrupted (checksum mismatch)")


def ipc_handles(regions: dict[str, torch.Tensor]) -> dict:
    """CUDA IPC handles of the regions, for another process on the same node (`open_ipc`). The
    sender keeps the regions alive while anyone may read them."""
    from torch.multiprocessing.reductions import reduce_tensor

    return {dtype: reduce_tensor(region) for dtype, region in regions.items()}


def fetch_ipc(
    handles: dict, expected: dict[str, tuple[int, int]], device: torch.device
) -> dict[str, torch.Tensor]:
    """Copy a same-node peer's regions to `device` (peer to peer over NVLink, or within the peer's
    own GPU) and verify them."""
    regions = {}
    for dtype, (rebuild, args) in handles.items():
        source = rebuild(*args)  # a copy even on the peer's own GPU: the peer keeps its memory
        regions[dtype] = torch.empty_like(source, device=device).copy_(source, non_blocking=True)
    verify(regions, expected)
    return regions


def _object_device(regions: dict[str, torch.Tensor]) -> torch.device | None:
    device = next(iter(regions.values())).device if regions else torch.device("cpu")
    return device if device.type == "cuda" else None
