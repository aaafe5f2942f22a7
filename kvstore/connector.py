"""`StoreConnector`: vLLM's KV connector onto the LMCache-backed store.

Loaded by vLLM with `kv_connector: StoreConnector`, `kv_connector_module_path:
kvstore.connector` (engine/host.py sets it). vLLM builds it twice:
- scheduler half: asks the store (through a lookup-only LMCache engine) how much of a new
  prompt it holds, tells vLLM to count those tokens as external prefix-cache hits, and plans each
  step's loads and saves as `StorePlan` metadata;
- worker half: before the forward pass loads the planned chunks into the request's KV blocks;
  after it stores the prompts whose KV this step completed, and waits until the store has them,
  so a prefill's answer means its KV is in the store. It reports back which saves landed
  (`SaveResults`): the scheduler tells the router (a BlockStored event of medium pdc_store) only
  about those.

Only whole blocks move, up to `usable_tokens` of a prompt: vLLM recomputes the last token, and a
stored chunk must end where a later reader's lookup will. A request's cache salt (the router sets
its tenant's) is part of every store key, as it is of vLLM's own block hashes: one tenant never
loads, nor times, another's chunks. A load that comes back short (a chunk
evicted, damaged or unreachable since the lookup) reports its blocks to vLLM, which recomputes
them (`kv_load_failure_policy: recompute`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvstore import STORE_MEDIUM
from kvstore.lmcache_engine import KVLayout, StoreSettings, build_engine
from kvstore.lmcache_plugin import flush_all, unlanded_puts
from kvstore.paged_blocks import PagedBlockConnector

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def usable_tokens(prompt_len: int, block_size: int) -> int:
    """Prompt tokens whose KV may come from the store: whole blocks, never the last token."""
    return max(0, (prompt_len - 1) // block_size * block_size)


def salted(cache_salt: str | None) -> dict | None:
    """LMCache's request configs that put a cache salt into every chunk key (a `lmcache.tag.*`
    entry is part of the key); a digest, so the key names no salt and holds no '@'."""
    if not cache_salt:
        return None
    return {"lmcache.tag.salt": hashlib.sha256(cache_salt.encode()).hexdigest()[:32]}


@dataclasses.dataclass
class BlockTransfer:
    request_id: str
    token_ids: list[int]  # the prefix that moves
    block_ids: list[int]  # the request's blocks, from its first token
    skip_tokens: int = 0  # a load leaves the blocks vLLM already computed alone
    request_configs: dict | None = None  # the request's cache salt, for its keys (salted)


@dataclasses.dataclass
class StorePlan(KVConnectorMetadata):
    loads: list[BlockTransfer] = dataclasses.field(default_factory=list)
    saves: list[BlockTransfer] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SaveResults(KVConnectorWorkerMetadata):
    """Worker -> scheduler: whether each request's save of this step landed in the store."""

    landed: dict[str, bool] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SaveResults:
        assert isinstance(other, SaveResults)
        return SaveResults({**self.landed, **other.landed})


class StoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._settings = StoreSettings.from_extra(transfer.kv_connector_extra_config or {})
        self._block_size = vllm_config.cache_config.block_size
        if self._settings.chunk_tokens % self._block_size:
            raise ValueError(f"store chunks of {self._settings.chunk_tokens} tokens are not whole "
                             f"blocks of {self._block_size}")
        self._saves = transfer.is_kv_producer
        self._loads = transfer.is_kv_consumer
        model = vllm_config.model_config
        self._model = model.served_model_name if isinstance(model.served_model_name, str) else model.model
        self._model_config = model
        self._hash_algorithm = vllm_config.cache_config.prefix_caching_hash_algo
        self._engine = None
        # scheduler state
        self._planned_loads: dict[str, tuple[int, int]] = {}  # request -> (tokens after load, computed here)
        self._blocks: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._saved: dict[str, tuple[int, bool]] = {}  # request -> (prompt tokens stored, saved by us)
        self._salts: dict[str, dict | None] = {}  # request -> its keys' salt (salted)
        self._events: list = []  # BlockStored events for blocks saved to the store, not yet taken
        self._landed: dict[str, bool] = {}  # request -> whether its save landed (SaveResults)
        self._unconfirmed: dict[str, object] = {}  # request -> its event, until its save is confirmed
        # worker state
        self._kv_caches: list[torch.Tensor] = []
        self._failed_blocks: set[int] = set()
        self._save_results: dict[str, bool] = {}

    # --- scheduler half ----------------------------------------------------------------------
    def _lookup_engine(self):
        if self._engine is None:
            self._engine = build_engine(
                self._settings, self._layout(), self._model, None, self._hash_algorithm
            )
        return self._engine

    def _layout(self) -> KVLayout:
        """The KV layout both halves name in their keys (the scheduler never sees a KV tensor):
        one layer's block holds kv_heads x block_size x 2 * head_dim elements."""
        config = self._model_config.hf_text_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        block_shape = (config.num_key_value_heads, self._block_size, 2 * head_dim)
        return KVLayout(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                        self._model_config.dtype, block_shape)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self._loads:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        usable = usable_tokens(len(prompt), self._block_size)
        if usable <= num_computed_tokens:
            return 0, False
        held = self._lookup_engine().lookup(prompt[:usable], request_configs=salted(request.cache_salt))
        held = held // self._block_size * self._block_size
        if held <= num_computed_tokens:
            return 0, False
        self._planned_loads[request.request_id] = (held, num_computed_tokens)
        return held - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self._salts[request.request_id] = salted(request.cache_salt)
        if num_external_tokens == 0:
            self._planned_loads.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StorePlan:
        plan = StorePlan()
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._prompts[new.req_id] = list(new.prompt_token_ids or [])
            held, computed_here = self._planned_loads.pop(new.req_id, (0, 0))
            if held:
                plan.loads.append(BlockTransfer(new.req_id, self._prompts[new.req_id][:held], self._blocks[new.req_id],
                                                computed_here, self._salts.get(new.req_id)))
                if held >= usable_tokens(len(self._prompts[new.req_id]), self._block_size):
                    self._saved[new.req_id] = (held, False)  # all of it came from the store: nothing to save
            self._plan_save(plan, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            if req_id in self._blocks and new_blocks is not None:
                self._blocks[req_id].extend(new_blocks[0])
            self._plan_save(plan, req_id, cached.num_computed_tokens[index], scheduler_output)
        return plan

    def _plan_save(self, plan: StorePlan, req_id: str, computed: int, scheduler_output) -> None:
        """Save a prompt in the step that completes its usable part (chunked prefill may take
        several steps)."""
        if not self._saves or req_id in self._saved or req_id not in self._prompts:
            return
        usable = usable_tokens(len(self._prompts[req_id]), self._block_size)
        if usable and computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) >= usable:
            plan.saves.append(BlockTransfer(req_id, self._prompts[req_id][:usable], self._blocks[req_id],
                                            request_configs=self._salts.get(req_id)))
            self._saved[req_id] = (usable, True)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The router passes these params to the decode instance; it finds the KV by lookup."""
        for state in (self._blocks, self._prompts, self._planned_loads, self._salts):
            state.pop(request.request_id, None)
        stored, saved_here = self._saved.pop(request.request_id, (0, False))
        if saved_here:  # blocks loaded from the store were published by the engine that saved them
            self._unconfirmed[request.request_id] = self._stored_event(request, stored // self._block_size)
            self._confirm(request.request_id)
        # Only a prefill the router asked for answers with transfer params (never a client's
        # request). They promise nothing: the decode instance finds what the store holds itself.
        asked = (request.kv_transfer_params or {}).get("do_remote_decode")
        return False, ({"kv_via_store": True} if asked else None)

    def update_connector_output(self, connector_output) -> None:
        results = connector_output.kv_connector_worker_meta
        if isinstance(results, SaveResults):
            self._landed.update(results.landed)
            for request_id in results.landed:
                self._confirm(request_id)

    def _confirm(self, request_id: str) -> None:
        """Publish a finished request's event once the worker said its save landed (either may
        come first); drop it if the save did not land."""
        if request_id in self._unconfirmed and request_id in self._landed:
            event = self._unconfirmed.pop(request_id)
            if self._landed.pop(request_id):
                self._events.append(event)

    def take_events(self) -> list:
        """vLLM publishes these with its own KV events: the router learns what the store holds."""
        events, self._events = self._events, []
        return events

    def _stored_event(self, request: Request, blocks: int):
        """The prompt's first `blocks` blocks as now held by the store, named by vLLM's own block
        hashes (tenant salt included), as vLLM's block pool would name them in its events."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in request.block_hashes[:blocks]],
            parent_block_hash=None, token_ids=request.all_token_ids[: blocks * self._block_size],
            block_size=self._block_size, lora_id=None, medium=STORE_MEDIUM, lora_name=None,
        )

    # --- worker half -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = list(kv_caches.values())
        layout = self._layout()  # the scheduler's lookups must use the same keys
        # Our whole-block copier on CUDA too, not LMCache's vLLM GPU connector: for vLLM's fused
        # K/V layout ([blocks, block, heads, 2 * head_dim], vLLM 0.26) LMCache 0.5.6 moves only
        # half of every token (LMCache#4463, open; the H200 run saw decode answer from stale
        # KV). Whole blocks need no layout knowledge, and the copies run on vLLM's own stream,
        # after the forward pass that wrote them (tests/e2e/test_pd_cuda.py passes on the H200).
        if caches[0][0].numel() != math.prod(layout.block_shape):
            raise ValueError(f"KV cache blocks of shape {tuple(caches[0].shape[1:])} do not hold "
                             f"{layout.block_shape} elements: the block copier cannot move them")
        blocks = PagedBlockConnector(layout.num_layers, self._block_size, layout.kv_heads * layout.head_dim)
        blocks.bind(caches)

        def copier(config, metadata):
            return blocks

        self._engine = build_engine(self._settings, layout, self._model, copier, self._hash_algorithm)
        self._kv_caches = caches
        log.info("store connector: %d layers, block %s, store shards %s", len(caches), tuple(caches[0].shape[1:]),
                 self._settings.endpoints)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        plan = self._get_connector_metadata()
        for load in plan.loads:
            slots = self._slots(load.block_ids, len(load.token_ids))
            got = int(self._engine.retrieve(load.token_ids, slot_mapping=slots, kvcaches=self._kv_caches,
                                            vllm_cached_tokens=load.skip_tokens,
                                            request_configs=load.request_configs).sum())
            if got < len(load.token_ids):
                first_missing = max(got, load.skip_tokens) // self._block_size
                last = len(load.token_ids) // self._block_size
                self._failed_blocks.update(load.block_ids[first_missing:last])
                log.warning("request %s: %d of %d tokens came from the store; vLLM recomputes the rest",
                            load.request_id, got, len(load.token_ids))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # whole prompts are saved once the step's forward pass is done

    def wait_for_save(self) -> None:
        plan = self._get_connector_metadata()
        if not plan.saves:
            return
        unlanded = unlanded_puts()
        for save in plan.saves:
            self._engine.store(save.token_ids, slot_mapping=self._slots(save.block_ids, len(save.token_ids)),
                               kvcaches=self._kv_caches, request_configs=save.request_configs)
        landed = flush_all(self._settings.timeout_s) and unlanded_puts() == unlanded
        if not landed:
            log.warning("the store did not take this step's KV within %.1f s", self._settings.timeout_s)
        self._save_results.update((save.request_id, landed) for save in plan.saves)

    def build_connector_worker_meta(self) -> SaveResults | None:
        results, self._save_results = self._save_results, {}
        return SaveResults(results) if results else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _slots(self, block_ids: list[int], tokens: int) -> torch.Tensor:
        """Each token's slot in the KV cache, on the cache's device (the block copier indexes the
        cache tensors with them)."""
        device = self._kv_caches[0].device
        blocks = torch.tensor(block_ids[: -(-tokens // self._block_size)], dtype=torch.long, device=device)
        offsets = torch.arange(self._block_size, device=device)
        return (blocks[:, None] * self._block_size + offsets).reshape(-1)[:tokens]
