"""LMCache's "GPU connector" for vLLM's paged KV cache, on the CPU build and on CUDA: copies whole
KV blocks between vLLM's per-layer cache tensors and LMCache memory objects.

Per-token copies must know how each attention backend lays a block out, and these layouts keep
changing: on the CPU build a block of one layer is `[kv_heads, block_size, 2 * head_dim]` read as
a K region then a V region; vLLM on CUDA (0.26, what the lent GPU machine ran; the pinned build is
0.32) packs K and V per head (`[block_size, kv_heads, 2 * head_dim]`), which LMCache 0.5.6's own
connector moves only half of (LMCache#4463). Whole blocks need no layout: a chunk holds its
blocks' bytes as they are, so it can only be loaded by an engine with the same layout, which the
store key's layout tag ensures (kvstore/lmcache_engine.py). The KV connector only stores and
loads whole blocks. On CUDA the copies are plain blocking tensor copies on vLLM's current stream:
ordered after the forward pass that wrote the blocks, and done before LMCache reuses the memory
object.
"""

from __future__ import annotations

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface


class PagedBlockConnector(GPUConnectorInterface):
    def __init__(self, num_layers: int, block_size: int, hidden_per_token: int):
        self.num_layers = num_layers
        self.block_size = block_size
        self.hidden_per_token = hidden_per_token  # kv_heads * head_dim
        self.kv_caches: list[torch.Tensor] = []  # per layer: [num_blocks, ...one block...]

    def bind(self, kv_caches: list[torch.Tensor]) -> None:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV cache tensors for {self.num_layers} layers")
        self.kv_caches = kv_caches

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_per_token])

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        blocks, chunk = self._blocks(memory_obj, start, end, kwargs["slot_mapping"])
        for layer, cache in enumerate(self.kv_caches):
            chunk[layer] = cache[blocks].reshape(len(blocks), -1)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        """Blocks before `vllm_cached_tokens` (LMCache's own keyword for it) are left alone: vLLM
        computed them (they may be shared)."""
        blocks, chunk = self._blocks(memory_obj, start, end, kwargs["slot_mapping"])
        first = min(len(blocks), max(0, (kwargs.get("vllm_cached_tokens", 0) - start) // self.block_size))
        for layer, cache in enumerate(self.kv_caches):
            loaded = chunk[layer][first:].reshape(len(blocks) - first, *cache.shape[1:])
            cache[blocks[first:]] = loaded.to(cache.device)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def _blocks(self, memory_obj, start: int, end: int, slot_mapping: torch.Tensor):
        """The block ids of tokens [start, end) and the memory object as [layer, block, bytes]."""
        if start % self.block_size or end % self.block_size:
            raise ValueError(f"tokens [{start}, {end}) are not whole blocks of {self.block_size}")
        slots = slot_mapping[start : end : self.block_size].to(torch.long)
        if bool((slots % self.block_size).any()):
            raise ValueError("a block's first token is not at the block's first slot")
        blocks = slots // self.block_size
        chunk = memory_obj.tensor.reshape(-1).view(self.kv_caches[0].dtype)
        return blocks, chunk.reshape(self.num_layers, len(blocks), -1)
