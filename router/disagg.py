"""Prefill/decode orchestration: run a request's prefill on a prefill instance, then hand its KV
to the decode instance that streams the answer.

The prefill instance gets the request with `max_tokens=1` and vLLM's `kv_transfer_params`
asking for a remote decode; it answers with the params that name its KV blocks, which go to the
decode instance with the original request; the decode instance's connector reads the blocks
(NIXL over UCX) and vLLM counts them as external prefix-cache hits. Degrade, don't fail: no
ready prefill instance, a short uncached suffix, a prefill error or timeout all mean the decode
instance prefills locally, and a failed KV read there is recomputed (`kv_load_failure_policy`).
Optionally, so does a prefill pool with too much queued (`remote_prefill_max_queued_tokens`).

A prefill instance that fails or times out `prefill_circuit_failures` times in a row gets no
remote prefill for `prefill_circuit_s` (its circuit is open: one that hangs while passing its
health checks costs one timeout, not one per request); then one request tries it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from engine.config import Role
from router import metrics
from router.config import RouterConfig
from router.instances import Instance, InstanceRegistry, PendingPrefill
from router.policies import RoutingDecision, RoutingPolicy, RoutingRequest

log = logging.getLogger(__name__)
# Request fields that make no sense for the one-token prefill request.
PREFILL_DROPS = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n", "logprobs",
                 "top_logprobs", "echo")


class RemotePrefill:
    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        policy: RoutingPolicy,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.config = config
        self.registry = registry
        self.policy = policy
        self.session = session

    async def prepare(
        self, endpoint: str, body: dict, request: RoutingRequest, decode: RoutingDecision
    ) -> dict:
        """The body to send to the decode instance: with the prefill's KV params, or unchanged."""
        if decode.instance.role != Role.DECODE:
            return body
        uncached = request.num_tokens - decode.cached_tokens - decode.store_tokens
        now = time.monotonic()
        prefills = [i for i in self.registry.ready((Role.PREFILL,)) if i.prefill_open_until <= now]
        if not prefills or uncached < self.config.remote_prefill_min_tokens:
            metrics.PREFILLS.labels("local").inc()
            return body
        chosen = self.policy.choose(prefills, request).instance
        limit = self.config.remote_prefill_max_queued_tokens
        if limit is not None and chosen.pending_prefill_tokens > limit:
            metrics.PREFILLS.labels("local_busy").inc()
            return body
        params = await self._prefill(chosen, endpoint, body, request.num_tokens)
        if params is None:
            metrics.PREFILLS.labels("fallback_local").inc()
            return body
        metrics.PREFILLS.labels("remote").inc()
        return {**body, "kv_transfer_params": params}

    async def _prefill(self, instance: Instance, endpoint: str, body: dict, tokens: int) -> dict | None:
        prefill_body = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        instance.inflight += 1
        pending = PendingPrefill(instance, tokens)
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                async with self.session().post(f"{instance.url}{endpoint}", json=prefill_body) as response:
                    answer = await response.json(content_type=None)
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {str(answer)[:300]}")
            params = answer.get("kv_transfer_params")
            if not params:
                raise RuntimeError("the prefill instance returned no kv_transfer_params")
            metrics.REMOTE_PREFILL.observe(time.monotonic() - started)
            instance.failed_prefills = 0
            return params
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            if isinstance(exc, aiohttp.ClientConnectionError):
                self.registry.mark_failed(instance, f"unreachable: {exc!r}")
            instance.failed_prefills += 1
            if instance.failed_prefills >= self.config.prefill_circuit_failures:
                instance.prefill_open_until = time.monotonic() + self.config.prefill_circuit_s
                log.warning("no remote prefills on %s for %g s", instance.instance_id, self.config.prefill_circuit_s)
            log.warning(
                "prefill on %s failed (%r); the decode instance prefills locally", instance.instance_id, exc
            )
            return None
        finally:
            instance.inflight -= 1
            pending.done()
