"""The router's placement records, gathered while a load runs: how many prompt tokens each request's
serving instance had to compute, those the router's index said neither it nor the store held
(requests prefilled remotely, in P/D, left out). Where two policies' medians of these are equal,
no placement can make the median request's first token come sooner."""

from __future__ import annotations

import threading
import time

import httpx

from loadtest.local_cluster import LocalServer
from router.metrics import percentile


class PlacementTrace:
    """Reads the router's `GET /admin/status` every `interval_s` in a thread, from `with` entry to
    exit (the router keeps its last 50 placements); placements made before entry are left out.
    A router without the records, or with others (an older revision's), gives none."""

    def __init__(self, server: LocalServer, block_size: int | None = None, interval_s: float = 2.0) -> None:
        from engine.config import KVHashing

        self.block_size = block_size or KVHashing().block_size  # what `pdcluster serve` runs with unless told
        self.server, self.interval_s = server, interval_s
        self._records: dict[tuple[float, str], dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._since = 0.0

    def __enter__(self) -> PlacementTrace:
        self._since = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._read()  # the last ones

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()

    def _read(self) -> None:
        try:
            status = httpx.get(f"{self.server.url}/admin/status", headers=self.server.credentials.admin_headers(),
                               timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return
        for record in status.get("recent_placements", ()):
            chosen = [c for c in record.get("candidates", ()) if c.get("instance_id") == record.get("chosen")]
            # A remote prefill (P/D) is computed where the record does not say what was cached.
            if (chosen and record.get("at", 0) >= self._since and not record.get("migrated")
                    and record.get("prefill") is None):
                held = chosen[0]["cached_blocks"] + chosen[0]["store_blocks"]
                self._records[(record["at"], record["chosen"])] = {"prompt_tokens": record["prompt_tokens"],
                                                                  "held_blocks": held}

    def computed_tokens(self) -> list[int]:
        """Each request's prompt tokens that the instance serving it held neither in its own cache
        nor could fetch from the store; requests prefilled remotely (P/D) are left out."""
        return [max(r["prompt_tokens"] - r["held_blocks"] * self.block_size, 0) for r in self._records.values()]

    def summary(self) -> dict[str, float | None]:
        computed = self.computed_tokens()
        return {f"computed_tokens_p{q}": percentile(computed, q) if computed else None for q in (50, 90)}
