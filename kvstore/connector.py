"""`StoreConnector`: vLLM's KV connector onto the LMCache-backed store.

Loaded by vLLM with `kv_connector: StoreConnector`, `kv_connector_module_path:
kvstore.connector` (engine/host.py sets it). vLLM builds it twice, once per role, and like its
own connectors (NixlConnector) each instance holds the half of its role:
- `StoreScheduler` (kvstore/store_scheduler.py, engine-core process): how much of a new prompt the
  store holds, the loads and saves of each step (`StorePlan`), and what the router is told;
- `StoreWorker` (kvstore/store_worker.py, worker process): the loads before a forward pass, the
  saves after it, and which of them landed (`SaveResults`).

Only whole blocks move, up to `usable_tokens` of a prompt: vLLM recomputes the last token, and a
stored chunk must end where a later reader's lookup will. A request's cache salt (the router sets
its tenant's) is part of every store key, as it is of vLLM's own block hashes: one tenant never
loads, nor times, another's chunks. A load that comes back short (a chunk evicted, damaged or
unreachable since the lookup) reports its blocks to vLLM, which recomputes them
(`kv_load_failure_policy: recompute`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvstore.connector_types import ConnectorSpec, SaveResults, StorePlan
from kvstore.settings import StoreSettings

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class StoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spec = ConnectorSpec.of(vllm_config, StoreSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config or {}))
        if role == KVConnectorRole.SCHEDULER:
            from kvstore.store_scheduler import StoreScheduler

            self.scheduler, self.worker = StoreScheduler(spec), None
        else:
            from kvstore.store_worker import StoreWorker

            self.scheduler, self.worker = None, StoreWorker(spec)

    # --- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StorePlan:
        return self.scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self) -> list:
        return self.scheduler.take_events()

    # --- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return None  # whole prompts are saved once the step's forward pass is done

    def wait_for_save(self) -> None:
        self.worker.save(self._get_connector_metadata())

    def build_connector_worker_meta(self) -> SaveResults | None:
        return self.worker.results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.failed_blocks()
