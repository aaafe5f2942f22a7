"""The worker's half of the store connector (vLLM's worker process, beside the KV cache): before
a step's forward pass it loads the planned chunks into the requests' KV blocks, after it stores
the prompts that step completed and waits until the store has them, and it reports which saves
landed (`SaveResults`) and which blocks a short load leaves for vLLM to recompute."""

from __future__ import annotations

import logging
import math

import torch
from vllm.distributed import get_tensor_model_parallel_rank

from kvstore.connector_types import ConnectorSpec, SaveResults, StorePlan
from kvstore.lmcache_engine import build_engine, reconnect_if_lost
from kvstore.lmcache_plugin import flush_all, unlanded_puts
from kvstore.paged_blocks import PagedBlockConnector

log = logging.getLogger(__name__)


class StoreWorker:
    def __init__(self, spec: ConnectorSpec) -> None:
        self.spec = spec
        self._engine = None
        self._kv_caches: list[torch.Tensor] = []
        self._failed_blocks: set[int] = set()
        self._save_results: dict[str, bool] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = list(kv_caches.values())
        layout = self.spec.layout  # the scheduler's lookups must use the same keys
        # Our whole-block copier on CUDA too, not LMCache's vLLM GPU connector: for vLLM's fused
        # K/V layout ([blocks, block, heads, 2 * head_dim]; vLLM 0.26, what the lent GPU machine
        # ran, the pinned build being 0.32) LMCache 0.5.6 moves only half of every token
        # (LMCache#4463, open; the H200 run saw decode answer from stale KV). Whole blocks need no
        # layout knowledge, and the copies run on vLLM's own stream, after the forward pass that
        # wrote them (tests/e2e/test_pd_cuda.py passes on the H200).
        if caches[0][0].numel() != math.prod(layout.block_shape):
            raise ValueError(f"KV cache blocks of shape {tuple(caches[0].shape[1:])} do not hold "
                             f"{layout.block_shape} elements: the block copier cannot move them")
        blocks = PagedBlockConnector(layout.num_layers, self.spec.block_size, layout.kv_heads * layout.head_dim)
        blocks.bind(caches)

        def copier(config, metadata):
            return blocks

        self._engine = build_engine(self.spec.settings, layout, self.spec.model, copier, self.spec.hash_algorithm,
                                    rank=get_tensor_model_parallel_rank())
        self._kv_caches = caches
        log.info("store connector: %d layers, block %s, store shards %s", len(caches), tuple(caches[0].shape[1:]),
                 self.spec.settings.endpoints)

    def start_load(self, plan: StorePlan) -> None:
        if plan.loads or plan.saves:
            reconnect_if_lost(self._engine)
        for load in plan.loads:
            slots = self._slots(load.block_ids, len(load.token_ids))
            got = int(self._engine.retrieve(load.token_ids, slot_mapping=slots, kvcaches=self._kv_caches,
                                            vllm_cached_tokens=load.skip_tokens,
                                            request_configs=load.request_configs).sum())
            if got < len(load.token_ids):
                first_missing = max(got, load.skip_tokens) // self.spec.block_size
                last = len(load.token_ids) // self.spec.block_size
                self._failed_blocks.update(load.block_ids[first_missing:last])
                log.warning("request %s: %d of %d tokens came from the store; vLLM recomputes the rest",
                            load.request_id, got, len(load.token_ids))

    def save(self, plan: StorePlan) -> None:
        if not plan.saves:
            return
        unlanded = unlanded_puts()
        for save in plan.saves:
            self._engine.store(save.token_ids, slot_mapping=self._slots(save.block_ids, len(save.token_ids)),
                               kvcaches=self._kv_caches, request_configs=save.request_configs)
        landed = flush_all(self.spec.settings.timeout_s) and unlanded_puts() == unlanded
        if not landed:
            log.warning("the store did not take this step's KV within %.1f s", self.spec.settings.timeout_s)
        self._save_results.update((save.request_id, landed) for save in plan.saves)

    def results(self) -> SaveResults | None:
        results, self._save_results = self._save_results, {}
        return SaveResults(results) if results else None

    def failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _slots(self, block_ids: list[int], tokens: int) -> torch.Tensor:
        """Each token's slot in the KV cache, on the cache's device (the block copier indexes the
        cache tensors with them)."""
        device = self._kv_caches[0].device
        blocks = torch.tensor(block_ids[: -(-tokens // self.spec.block_size)], dtype=torch.long, device=device)
        offsets = torch.arange(self.spec.block_size, device=device)
        return (blocks[:, None] * self.spec.block_size + offsets).reshape(-1)[:tokens]
