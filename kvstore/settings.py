"""How an engine reaches the KV store: its shards and the timeouts of every call, one typed record
that every layer below the connector reads (LMCache's engine, our LMCache plugin, the sharded
store, each shard's client)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StoreSettings:
    """What `kv_connector_extra_config` carries (engine/server_command.py sets it from the engine's
    config, `EngineConfig.kv_store_timeout_s`): every layer below the connector (LMCache's engine,
    our plugin, the sharded store, each shard's client) takes its timeouts from here."""

    endpoints: tuple[str, ...]  # the store's shards (ZMQ control sockets)
    timeout_s: float = 5.0
    transfer_buffer_gib: float = 0.25  # LMCache's per-engine memory for chunks in flight

    @property
    def retry_after_s(self) -> float:
        """How long a shard that did not answer in `timeout_s` counts as down (its calls are misses
        at once instead of each waiting again)."""
        return 2 * self.timeout_s

    def as_extra(self) -> dict:
        return {"endpoints": list(self.endpoints), "timeout_s": self.timeout_s,
                "transfer_buffer_gib": self.transfer_buffer_gib}

    @classmethod
    def from_extra(cls, extra: dict) -> StoreSettings:
        if not extra.get("endpoints"):
            raise ValueError("kv_connector_extra_config needs the store shards' 'endpoints'")
        return cls(endpoints=tuple(extra["endpoints"]), timeout_s=float(extra.get("timeout_s", cls.timeout_s)),
                   transfer_buffer_gib=float(extra.get("transfer_buffer_gib", cls.transfer_buffer_gib)))
