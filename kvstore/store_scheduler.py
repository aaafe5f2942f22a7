"""The scheduler's half of the store connector (vLLM's engine-core process): how much of a new
prompt the store holds (a lookup-only LMCache engine), which loads and saves each step does
(`StorePlan`), and which blocks the router may be told the store now holds (only saves the worker
confirmed, `SaveResults`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore import STORE_MEDIUM
from kvstore.connector_types import (
    BlockTransfer,
    ConnectorSpec,
    SavedBlocks,
    SaveResults,
    StorePlan,
    salted,
    usable_tokens,
)
from kvstore.lmcache_engine import build_engine, reconnect_if_lost

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class StoreScheduler:
    def __init__(self, spec: ConnectorSpec) -> None:
        self.spec = spec
        self._engine = None
        self._planned_loads: dict[str, tuple[int, int]] = {}  # request -> (tokens after load, computed here)
        self._blocks: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        self._saved: dict[str, SavedBlocks] = {}
        self._salts: dict[str, dict | None] = {}  # request -> its keys' salt (salted)
        self._events: list = []  # BlockStored events for blocks saved to the store, not yet taken
        self._landed: dict[str, bool] = {}  # request -> whether its save landed (SaveResults)
        self._unconfirmed: dict[str, object] = {}  # request -> its event, until its save is confirmed

    def _lookup_engine(self):
        if self._engine is None:
            self._engine = build_engine(self.spec.settings, self.spec.layout, self.spec.model, None,
                                        self.spec.hash_algorithm)
        reconnect_if_lost(self._engine)
        return self._engine

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.spec.loads:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        usable = usable_tokens(len(prompt), self.spec.block_size)
        if usable <= num_computed_tokens:
            return 0, False
        held = self._lookup_engine().lookup(prompt[:usable], request_configs=salted(request.cache_salt))
        held = held // self.spec.block_size * self.spec.block_size
        if held <= num_computed_tokens:
            return 0, False
        self._planned_loads[request.request_id] = (held, num_computed_tokens)
        return held - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self._salts[request.request_id] = salted(request.cache_salt)
        if num_external_tokens == 0:
            self._planned_loads.pop(request.request_id, None)

    def build_meta(self, scheduler_output: SchedulerOutput) -> StorePlan:
        plan = StorePlan()
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._prompts[new.req_id] = list(new.prompt_token_ids or [])
            held, computed_here = self._planned_loads.pop(new.req_id, (0, 0))
            if held:
                plan.loads.append(BlockTransfer(new.req_id, self._prompts[new.req_id][:held], self._blocks[new.req_id],
                                                computed_here, self._salts.get(new.req_id)))
                if held >= usable_tokens(len(self._prompts[new.req_id]), self.spec.block_size):
                    self._saved[new.req_id] = SavedBlocks(held, here=False)  # all from the store: nothing to save
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
        if not self.spec.saves or req_id in self._saved or req_id not in self._prompts:
            return
        usable = usable_tokens(len(self._prompts[req_id]), self.spec.block_size)
        if usable and computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) >= usable:
            plan.saves.append(BlockTransfer(req_id, self._prompts[req_id][:usable], self._blocks[req_id],
                                            request_configs=self._salts.get(req_id)))
            self._saved[req_id] = SavedBlocks(usable, here=True)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The router passes these params to the decode instance; it finds the KV by lookup."""
        for state in (self._blocks, self._prompts, self._planned_loads, self._salts):
            state.pop(request.request_id, None)
        saved = self._saved.pop(request.request_id, SavedBlocks(0, here=False))
        if saved.here:  # blocks loaded from the store were published by the engine that saved them
            self._unconfirmed[request.request_id] = self._stored_event(request, saved.tokens // self.spec.block_size)
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
            parent_block_hash=None, token_ids=[],  # hashes are all the router needs
            block_size=self.spec.block_size, lora_id=None, medium=STORE_MEDIUM, lora_name=None,
        )

