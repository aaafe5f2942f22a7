"""The prefill half of a disaggregated request, and the KV handoff it yields.

The prefill instance gets the client's request with `max_tokens=1` and vLLM's
`kv_transfer_params` asking for a remote decode (`prefill_body`); it computes the prompt, its
connector hands the KV over (through the store, or held for the decode instance's NIXL reads),
and it answers with transfer params that the decode instance needs (`KVHandoff`): with
NixlConnector its engine, blocks, host and port; with the store a marker (the decode instance
finds the KV by lookup). Degrade, don't fail: an error or a timeout yields no handoff, and the
decode instance prefills itself; a prefill instance that fails or times out
`circuit_failures` times in a row gets no prefill for `circuit_s` (one that hangs while passing
its health checks costs one timeout, not one per request), then one request tries it again.

With NixlConnector the prefill instance holds the prompt's blocks for its KV lease from the
prefill's end (EngineConfig.kv_lease_s); a decode read after that returns whatever the blocks hold
by then, silently wrong. So the wait for such a prefill ends at a share of its lease too
(`PrefillHop.deadline_s`): the rest is the decode instance's, to take the request in and send
its first heartbeat, which extends the lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from fleet.instances import Instance, InstanceRegistry

log = logging.getLogger(__name__)
# Request fields that make no sense for the one-token prefill request.
PREFILL_DROPS = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "n", "logprobs",
                 "top_logprobs", "echo")
# What asks vLLM's connectors (ours and NixlConnector alike) to keep a prompt's KV for a decode
# elsewhere.
REMOTE_DECODE = {"do_remote_decode": True}
HANDOVER_LEASE_SHARE = 0.75
"""Of a prefill instance's KV lease, what its prefill and answer may take."""


@dataclasses.dataclass(frozen=True)
class KVHandoff:
    """A prefilled prompt's KV, as the decode instance is told where to find it."""

    transfer_params: Mapping[str, Any]
    """The prefill's answer, verbatim (vLLM's `kv_transfer_params`)."""
    prefill_instance: str
    seconds: float
    """From sending the prefill request to its answer (the KV is handed over by then)."""

    def decode_body(self, body: dict) -> dict:
        """The client's request as the decode instance gets it."""
        return {**body, "kv_transfer_params": dict(self.transfer_params)}


def prefill_body(body: dict) -> dict:
    """The client's request as the prefill instance gets it: one token, KV kept for a decode."""
    return {**{k: v for k, v in body.items() if k not in PREFILL_DROPS}, "max_tokens": 1, "stream": False,
            "kv_transfer_params": REMOTE_DECODE}


class PrefillHop:
    """Runs the prefill half of placed requests over the router's pooled HTTP session: each is
    booked on its prefill instance while it runs (a request, and its prompt in the instance's
    queue) and counted into the instance's circuit, all through the fleet's registry."""

    def __init__(self, registry: InstanceRegistry, session: Callable[[], aiohttp.ClientSession], timeout_s: float,
                 circuit_failures: int, circuit_s: float) -> None:
        self.registry = registry
        self.session = session
        self.timeout_s = timeout_s
        self.circuit_failures = circuit_failures
        self.circuit_s = circuit_s

    async def run(self, instance: Instance, endpoint: str, body: dict, prompt_tokens: int,
                  trace_headers: Mapping[str, str] | None = None) -> KVHandoff | None:
        """Prefill `body` on `instance`; None (and the reason logged) if it failed or timed out.
        `trace_headers`: the W3C trace context the engine's request span joins (router/tracing.py)."""
        with self.registry.request(instance):
            queued = self.registry.queue_prefill(instance, prompt_tokens)
            try:
                return await self._prefilled(instance, endpoint, body, trace_headers)
            finally:
                queued.done()

    def deadline_s(self, instance: Instance) -> float:
        """Longest wait for `instance`'s prefill: the timeout, and a share of its KV lease if it has one."""
        if instance.kv_lease_s is None:
            return self.timeout_s
        return min(self.timeout_s, instance.kv_lease_s * HANDOVER_LEASE_SHARE)

    async def _prefilled(self, instance: Instance, endpoint: str, body: dict,
                         trace_headers: Mapping[str, str] | None) -> KVHandoff | None:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.deadline_s(instance)):
                async with self.session().post(f"{instance.url}{endpoint}", json=prefill_body(body),
                                               **instance.request_options(dict(trace_headers or {}))) as response:
                    answer = await response.json(content_type=None)
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {str(answer)[:300]}")
            params = answer.get("kv_transfer_params")
            if not params:
                raise RuntimeError("the prefill instance returned no kv_transfer_params")
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            self._failed(instance, exc)
            return None
        self.registry.prefill_succeeded(instance)
        return KVHandoff(params, instance.instance_id, time.monotonic() - started)

    def _failed(self, instance: Instance, exc: Exception) -> None:
        if isinstance(exc, aiohttp.ClientConnectionError):
            self.registry.mark_failed(instance, f"unreachable: {exc!r}")
        if self.registry.prefill_failed(instance, self.circuit_failures, self.circuit_s):
            log.warning("no remote prefills on %s for %g s", instance.instance_id, self.circuit_s)
        log.warning("prefill on %s failed (%r); the decode instance prefills locally", instance.instance_id, exc)
