"""Store reads that outlived their deadline (kvstore/shard_client.py). UCX does not cancel a posted
remote read, so the memory it may still land in stays out of use until it has ended: the client's
staging buffer it lands in (retired, replaced by a new one) and the caller's (told by a future)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time

import numpy as np

from transport.nixl import NixlTransferError, PostedTransfer


def in_flight(read: PostedTransfer) -> bool:
    try:
        return not read.done()
    except NixlTransferError:  # failed: over, too
        return False


@dataclasses.dataclass
class _Stranded:
    reads: list[PostedTransfer]
    retired_staging: tuple[np.ndarray, object] | None  # a staging buffer (and its NIXL registration) they use
    ended: concurrent.futures.Future


class StrandedReads:
    """One client's reads left in flight, each group with what it lands in; used under the
    client's lock."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self._entries: list[_Stranded] = []

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, reads: list[PostedTransfer], retired_staging: tuple[np.ndarray, object] | None
             ) -> concurrent.futures.Future:
        """Keep `reads` (and a staging buffer they land in) until they end; the future is done then."""
        ended: concurrent.futures.Future = concurrent.futures.Future()
        self._entries.append(_Stranded(reads, retired_staging, ended))
        return ended

    def reap(self) -> None:
        """Release the groups whose reads have all ended, and tell their callers."""
        still = []
        for entry in self._entries:
            if any(in_flight(read) for read in entry.reads):
                still.append(entry)
                continue
            for read in entry.reads:
                read.release()
            if entry.retired_staging is not None:
                with contextlib.suppress(Exception):  # NIXL refusing it costs a registration, not the client
                    self.agent.deregister_memory(entry.retired_staging[1])
            entry.ended.set_result(None)
        self._entries = still

    def wait(self, deadline: float) -> None:
        """Until every read has ended or `deadline` (a time.monotonic() value) passed; then reap."""
        while any(in_flight(r) for entry in self._entries for r in entry.reads) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.reap()
