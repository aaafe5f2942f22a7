"""Forwarding a validated request to an engine and its answer back to the client.

The engine hop uses aiohttp: its C HTTP parser costs a fraction of httpx's pure-Python h11 per
streamed chunk, which halved the router's added latency in `loadtest.router_overhead`.

A request that never reached an engine (connection refused, an engine answering 503) moves to
another instance, up to `max_attempts`. One that reached an engine and broke it (the connection
dropped, a 500, no answer in time) is not retried: a request that crashes one engine would crash
the next. Once bytes have streamed, a failure ends the stream with an OpenAI error event and
`[DONE]`, so a client never hangs. Closing the client's stream
closes the engine's, which makes vLLM abort the request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from fastapi.responses import Response, StreamingResponse

from router import metrics
from router.config import RouterConfig
from router.errors import EngineFailed, error_body
from router.instances import CapacityQueue, Instance, InstanceRegistry, LatencyWindow, PendingPrefill
from router.policies import RoutingDecision, RoutingPolicy, RoutingRequest

log = logging.getLogger(__name__)
# Turns the body for the chosen instance into the body to send it (P/D: adds the prefill's KV).
Prepare = Callable[[str, dict, RoutingRequest, RoutingDecision], Awaitable[dict]]


class _RetryableEngineError(Exception):
    pass


class Forwarder:
    """Owns the pooled HTTP client to the engines."""

    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        policy: RoutingPolicy,
        queue: CapacityQueue,
        engine_headers: dict[str, str],
        prepare: Prepare | None = None,
    ):
        self.config = config
        self.registry = registry
        self.policy = policy
        self.queue = queue
        self.first_tokens = LatencyWindow()
        self.prepare = prepare
        self.engine_headers = engine_headers
        """Sent with every request to an engine: the cluster's engine token."""
        self.timeout = aiohttp.ClientTimeout(
            total=config.max_request_s,
            connect=config.connect_timeout_s,
            sock_read=config.request_timeout_s,
        )
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        # Created lazily: aiohttp binds a session to the event loop that first uses it.
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=4096, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout,
                                                  headers=self.engine_headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(
        self, endpoint: str, body: dict, candidates: Callable[[], list[Instance]], request: RoutingRequest
    ) -> Response:
        started = time.perf_counter()
        tried: set[str] = set()
        last_error: str = "no instance tried"
        for attempt in range(self.config.max_attempts):

            def untried() -> list[Instance]:
                return [i for i in candidates() if i.instance_id not in tried]

            # Only a request no instance has failed yet waits for capacity.
            ready = await self.queue.wait(untried) if not tried else untried()
            if not ready:
                break
            decision = self.policy.choose(ready, request)
            instance = decision.instance
            tried.add(instance.instance_id)
            if attempt:
                metrics.RETRIES.inc()
            send_body = await self.prepare(endpoint, body, request, decision) if self.prepare else body
            uncached = request.num_tokens - decision.cached_tokens - decision.store_tokens
            # With the KV prefilled elsewhere, the decode instance has (almost) nothing to prefill.
            prefill = PendingPrefill(instance, 0 if "kv_transfer_params" in send_body else uncached)
            try:
                return await self._send(instance, endpoint, send_body, started, prefill)
            except _RetryableEngineError as exc:
                last_error = str(exc)
                log.warning("instance %s failed a request: %s", instance.instance_id, exc)
        raise EngineFailed(f"every instance tried failed; last error: {last_error}")

    async def _send(
        self, instance: Instance, endpoint: str, body: dict, started: float, prefill: PendingPrefill
    ) -> Response:
        self._enter(instance)
        handed_over = False
        try:
            try:
                upstream = await self.session.post(f"{instance.url}{endpoint}", json=body)
            except aiohttp.ClientConnectorError as exc:  # never connected: the request went nowhere
                self.registry.mark_failed(instance, f"unreachable: {exc!r}")
                raise _RetryableEngineError(f"unreachable: {exc!r}") from None
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                self.registry.mark_failed(instance, f"broke on a request: {exc!r}")
                raise EngineFailed("the engine failed while serving this request") from None
            if upstream.status >= 500:
                text = (await upstream.read()).decode(errors="replace")[:500]
                upstream.release()
                if upstream.status != 503:  # the engine took the request and failed on it
                    log.warning("instance %s answered %d: %s", instance.instance_id, upstream.status, text)
                    raise EngineFailed(f"the engine failed while serving this request (HTTP {upstream.status})")
                raise _RetryableEngineError(f"HTTP {upstream.status}: {text}")
            if not body.get("stream") or upstream.status != 200:
                try:
                    content = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.registry.mark_failed(instance, f"broke on a request: {exc!r}")
                    raise EngineFailed("the engine's answer broke off") from None
                finally:
                    upstream.release()
                self._observe(endpoint, upstream.status, started, first_byte=True)
                return Response(content, upstream.status, media_type="application/json")
            chunks = upstream.content.iter_any()
            try:
                first = await chunks.__anext__()
            except (aiohttp.ClientError, TimeoutError, StopAsyncIteration) as exc:
                upstream.close()
                self.registry.mark_failed(instance, f"broke on a request: {exc!r}")
                raise EngineFailed("the engine's stream ended before its first byte") from None
            first_token_s = time.perf_counter() - started
            metrics.TIME_TO_FIRST_BYTE.labels(endpoint).observe(first_token_s)
            self.first_tokens.observe(first_token_s)
            prefill.done()
            handed_over = True
            return StreamingResponse(
                self._relay(instance, endpoint, upstream, first, chunks, started),
                media_type="text/event-stream",
            )
        finally:
            prefill.done()
            if not handed_over:
                self._leave(instance)

    async def _relay(
        self,
        instance: Instance,
        endpoint: str,
        upstream: aiohttp.ClientResponse,
        first: bytes,
        chunks: AsyncIterator[bytes],
        started: float,
    ) -> AsyncIterator[bytes]:
        status, finished = 200, False
        try:
            yield first
            async for chunk in chunks:
                yield chunk
            finished = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            status = 502
            log.warning("stream from %s broke: %r", instance.instance_id, exc)
            event = error_body(f"the engine's stream broke: {exc!r}", EngineFailed.type, 502)
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            # A stream left early (client gone) is closed, not released: dropping the connection
            # makes vLLM abort the request.
            if finished:
                upstream.release()
            else:
                upstream.close()
            self._leave(instance)
            self._observe(endpoint, status, started, first_byte=False)

    def _enter(self, instance: Instance) -> None:
        instance.inflight += 1
        metrics.INFLIGHT.labels(instance.instance_id).set(instance.inflight)

    def _leave(self, instance: Instance) -> None:
        instance.inflight -= 1
        metrics.INFLIGHT.labels(instance.instance_id).set(instance.inflight)

    @staticmethod
    def _observe(endpoint: str, status: int, started: float, first_byte: bool) -> None:
        """Record a finished request; `first_byte` when its end was also its first byte (not streamed)."""
        elapsed = time.perf_counter() - started
        if first_byte:
            metrics.TIME_TO_FIRST_BYTE.labels(endpoint).observe(elapsed)
        metrics.REQUEST_LATENCY.labels(endpoint).observe(elapsed)
        metrics.REQUESTS.labels(endpoint, str(status)).inc()
