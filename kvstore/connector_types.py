"""What the two halves of the store connector share: the spec both derive their keys from, the
plan the scheduler hands the worker each step, and the results the worker hands back."""

from __future__ import annotations

import dataclasses
import hashlib

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvstore.lmcache_engine import CHUNK_TOKENS, KVLayout
from kvstore.settings import StoreSettings


def usable_tokens(prompt_len: int, block_size: int) -> int:
    """Prompt tokens whose KV may come from the store: whole blocks, never the last token."""
    return max(0, (prompt_len - 1) // block_size * block_size)


def salted(cache_salt: str | None) -> dict | None:
    """LMCache's request configs that put a cache salt into every chunk key (a `lmcache.tag.*`
    entry is part of the key); a digest, so the key names no salt and holds no '@'."""
    if not cache_salt:
        return None
    return {"lmcache.tag.salt": hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}


@dataclasses.dataclass(frozen=True)
class ConnectorSpec:
    """One engine's store connector, as both halves must see it (the keys they name agree)."""

    settings: StoreSettings
    block_size: int
    model: str  # the served model name (LMCache keys name it)
    layout: KVLayout
    hash_algorithm: str  # the engine's prefix_caching_hash_algo
    saves: bool  # a KV producer: stores the prompts it computes
    loads: bool  # a KV consumer: loads what the store holds

    @classmethod
    def of(cls, vllm_config, settings: StoreSettings) -> ConnectorSpec:
        transfer, model = vllm_config.kv_transfer_config, vllm_config.model_config
        block_size = vllm_config.cache_config.block_size
        if CHUNK_TOKENS % block_size:
            raise ValueError(f"store chunks of {CHUNK_TOKENS} tokens are not whole blocks of {block_size}")
        config = model.hf_text_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One layer's block holds kv_heads x block_size x 2 * head_dim elements, kv_heads being a
        # tensor-parallel rank's share (the scheduler never sees a KV tensor: this is what both
        # halves name in their keys).
        parallel = vllm_config.parallel_config
        kv_heads = model.get_num_kv_heads(parallel)
        layout = KVLayout(config.num_hidden_layers, kv_heads, head_dim, model.dtype,
                          (kv_heads, block_size, 2 * head_dim), parallel.tensor_parallel_size)
        name = model.served_model_name if isinstance(model.served_model_name, str) else model.model
        return cls(settings, block_size, name, layout, vllm_config.cache_config.prefix_caching_hash_algo,
                   transfer.is_kv_producer, transfer.is_kv_consumer)


@dataclasses.dataclass
class BlockTransfer:
    request_id: str
    token_ids: list[int]  # the prefix that moves
    block_ids: list[int]  # the request's blocks, from its first token
    skip_tokens: int = 0  # a load leaves the blocks vLLM already computed alone
    request_configs: dict | None = None  # the request's cache salt, for its keys (salted)


@dataclasses.dataclass
class StorePlan(KVConnectorMetadata):
    """Scheduler -> worker, each step."""

    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SaveResults(KVConnectorWorkerMetadata):
    """Worker -> scheduler: whether each request's save of this step landed in the store."""

    landed: dict[str, bool] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SaveResults:
        """Tensor-parallel ranks' results: a request's save landed only if every rank's did
        (each rank stores its own KV heads)."""
        assert isinstance(other, SaveResults)
        requests = self.landed.keys() | other.landed.keys()
        return SaveResults({r: self.landed.get(r, True) and other.landed.get(r, True) for r in requests})


@dataclasses.dataclass(frozen=True)
class SavedBlocks:
    """A request's prompt tokens the store holds, and whether this engine saved them."""

    tokens: int
    here: bool
