"""CUDA IPC handles of a worker's parameters as plain data, for peers on the same node.

PyTorch shares a CUDA tensor between processes as a pickled (rebuild function, arguments) pair.
Unpickling bytes that arrive over the network runs whatever function they name, so a handle here
is a typed record of those arguments instead: numbers, a dtype name from a fixed list, and the
driver's opaque handles as base64. Opening one calls PyTorch's own `rebuild_cuda_tensor` with
classes chosen here, never taken from the message.
"""

from __future__ import annotations

import base64
import dataclasses

# The dtypes a checkpoint's parameters come in; anything else is refused.
DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "int32", "int64")


@dataclasses.dataclass(frozen=True)
class IpcTensor:
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: str
    device: int
    handle: str | None  # base64 of the driver's memory handle (None: an empty storage)
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str | None
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool

    @classmethod
    def of(cls, tensor) -> IpcTensor:
        """Share `tensor` (a CUDA tensor) with other processes of this node."""
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(tensor)
        (_, size, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _,
         counter, counter_offset, event, event_sync) = args
        return cls(tuple(size), tuple(stride), offset, str(dtype).removeprefix("torch."), device,
                   _b64(handle), size_bytes, offset_bytes, _b64(counter), counter_offset, _b64(event),
                   bool(event_sync))

    @classmethod
    def from_json(cls, raw: dict) -> IpcTensor:
        """Validate a record received from a peer: types and values, field by field."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if set(raw) != set(fields):
            raise ValueError(f"an IPC tensor record has fields {sorted(raw)}, expected {sorted(fields)}")
        record = cls(**{name: tuple(value) if name in ("size", "stride") else value for name, value in raw.items()})
        ints = [*record.size, *record.stride, record.offset, record.device, record.storage_size_bytes,
                record.storage_offset_bytes, record.ref_counter_offset]
        if not all(type(v) is int and v >= 0 for v in ints) or record.dtype not in DTYPES:
            raise ValueError("an IPC tensor record holds a negative or non-integer size, or an unknown dtype")
        if not all(isinstance(getattr(record, n), str | None) for n in ("handle", "ref_counter_handle", "event_handle")):
            raise ValueError("an IPC tensor record's handles must be base64 strings or null")
        if not isinstance(record.event_sync_required, bool):
            raise ValueError("event_sync_required must be a boolean")
        return record

    def open(self):
        """The peer's tensor, mapped into this process (no copy)."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(self.size), self.stride, self.offset, torch.storage.TypedStorage,
            getattr(torch, self.dtype), self.device, _bytes(self.handle), self.storage_size_bytes,
            self.storage_offset_bytes, False, _bytes(self.ref_counter_handle), self.ref_counter_offset,
            _bytes(self.event_handle), self.event_sync_required,
        )


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value, validate=True)
