"""One-sided NIXL transfers (UCX backend: RDMA on clusters, TCP or shared memory here), bounded by
a deadline. Shared by the weight plane (engine/weights.py) and the KV store (kvstore/)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

Extent = tuple[int, int]  # (address, bytes)
PIECE_BYTES = 64 * 1024**2  # several requests in flight on UCX's lanes


class NixlTransferError(RuntimeError):
    """A transfer failed, timed out, or its peer could not be reached."""


def new_agent(prefix: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"{prefix}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))


def split(extents: Sequence[Extent], piece_bytes: int = PIECE_BYTES) -> list[Extent]:
    return [
        (address + start, min(piece_bytes, length - start))
        for address, length in extents
        for start in range(0, length, piece_bytes)
    ]


def transfer(agent, op: str, local: Sequence[Extent], remote: Sequence[Extent], peer: str,
             timeout_s: float) -> None:  # fmt: skip
    """`op` ("READ" or "WRITE") between local and remote extents of equal total size: the two
    lists are cut at the same byte positions, so their pieces pair up. Raises NixlTransferError."""
    local_pieces, remote_pieces = _pair(list(local), list(remote))
    handle = None
    try:
        handle = agent.initialize_xfer(op, agent.get_xfer_descs([(a, n, 0) for a, n in local_pieces], "DRAM"),
                                       agent.get_xfer_descs([(a, n, 0) for a, n in remote_pieces], "DRAM"),
                                       peer)  # fmt: skip
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state == "PROC":
            if time.monotonic() > deadline:
                raise NixlTransferError(f"NIXL {op} of {sum(n for _, n in local_pieces)} bytes timed out "
                                        f"after {timeout_s} s")  # fmt: skip
            time.sleep(0.0002)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise NixlTransferError(f"NIXL {op} failed ({state})")
    except NixlTransferError:
        raise
    except Exception as exc:  # NIXL's own errors: an unreachable or vanished peer
        raise NixlTransferError(f"NIXL {op} failed: {exc}") from exc
    finally:
        if handle is not None:
            agent.release_xfer_handle(handle)


def _pair(local: list[Extent], remote: list[Extent]) -> tuple[list[Extent], list[Extent]]:
    """Both lists cut (in pieces of at most PIECE_BYTES) wherever either has a boundary."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise NixlTransferError("local and remote extents differ in size")
    left, right = split(local), split(remote)
    paired_left, paired_right = [], []
    i = j = used_left = used_right = 0
    while i < len(left) and j < len(right):
        take = min(left[i][1] - used_left, right[j][1] - used_right)
        paired_left.append((left[i][0] + used_left, take))
        paired_right.append((right[j][0] + used_right, take))
        used_left += take
        used_right += take
        if used_left == left[i][1]:
            i, used_left = i + 1, 0
        if used_right == right[j][1]:
            j, used_right = j + 1, 0
    return paired_left, paired_right
