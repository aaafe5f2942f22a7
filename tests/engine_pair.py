"""A ready engine loaded from disk (the peer) and a standby started beside it, for the conformance
tests of a standby activated from a peer: started together, stopped together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from engine.config import EngineConfig
from engine.host import EngineHost
from security.credentials import ClusterCredentials


@contextlib.contextmanager
def peer_and_standby(config: EngineConfig, suffix: str, credentials: ClusterCredentials) -> Iterator[dict[str, EngineHost]]:
    hosts = {name: EngineHost(config, f"{name}-{suffix}", host="127.0.0.1",
                              keys=credentials.engine_host_keys(f"{name}-{suffix}"))
             for name in ("peer", "standby")}

    async def start_both() -> None:
        await asyncio.gather(hosts["peer"].start(), hosts["standby"].start(standby=True))

    try:
        asyncio.run(start_both())
        yield hosts
    finally:
        for host in hosts.values():
            asyncio.run(host.stop())
