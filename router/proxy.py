"""Forwarding a validated request to an engine and its answer back to the client.

A request that fails before any byte reached the client (connection refused, engine error) moves
to another instance, up to `max_attempts`; once bytes have streamed, a failure ends the stream
with an OpenAI error event and `[DONE]`, so a client never hangs. Closing the client's stream
closes the engine's, which makes vLLM abort the request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
from fastapi.responses import Response, StreamingResponse

from router import metrics
from router.config import RouterConfig
from router.errors import EngineFailed, NoInstance, RouterError, error_body
from router.instances import Instance, InstanceRegistry

log = logging.getLogger(__name__)

Chooser = Callable[[Sequence[Instance]], Instance]


class _RetryableEngineError(Exception):
    pass


class Forwarder:
    """Owns the pooled HTTP client to the engines."""

    def __init__(self, config: RouterConfig, registry: InstanceRegistry, choose: Chooser):
        self.config = config
        self.registry = registry
        self.choose = choose
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s,
                read=config.request_timeout_s,
                write=config.connect_timeout_s,
                pool=config.connect_timeout_s,
            ),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512),
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def forward(self, endpoint: str, body: dict, candidates: Callable[[], list[Instance]]) -> Response:
        started = time.perf_counter()
        tried: set[str] = set()
        last_error: str = "no instance tried"
        for attempt in range(self.config.max_attempts):
            ready = [i for i in candidates() if i.instance_id not in tried]
            if not ready:
                break
            instance = self.choose(ready)
            tried.add(instance.instance_id)
            if attempt:
                metrics.RETRIES.inc()
            try:
                return await self._send(instance, endpoint, body, started)
            except _RetryableEngineError as exc:
                last_error = str(exc)
                log.warning("instance %s failed a request: %s", instance.instance_id, exc)
        if not tried:
            raise NoInstance("no ready instance can serve this request; retry shortly", retry_after_s=2)
        raise EngineFailed(f"every instance tried failed; last error: {last_error}")

    async def _send(self, instance: Instance, endpoint: str, body: dict, started: float) -> Response:
        request = self.client.build_request("POST", f"{instance.url}{endpoint}", json=body)
        self._enter(instance)
        handed_over = False
        try:
            try:
                upstream = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                self.registry.mark_failed(instance, f"unreachable: {exc!r}")
                raise _RetryableEngineError(f"unreachable: {exc!r}") from None
            if upstream.status_code >= 500:
                text = (await upstream.aread()).decode(errors="replace")[:500]
                await upstream.aclose()
                raise _RetryableEngineError(f"HTTP {upstream.status_code}: {text}")
            if not body.get("stream") or upstream.status_code != 200:
                try:
                    content = await upstream.aread()
                except httpx.HTTPError as exc:
                    raise _RetryableEngineError(f"broken response: {exc!r}") from None
                finally:
                    await upstream.aclose()
                self._observe(endpoint, upstream.status_code, started, started_stream=None)
                return Response(content, upstream.status_code, media_type="application/json")
            chunks = upstream.aiter_raw()
            try:
                first = await chunks.__anext__()
            except (httpx.HTTPError, StopAsyncIteration) as exc:
                await upstream.aclose()
                raise _RetryableEngineError(f"stream ended before its first byte: {exc!r}") from None
            metrics.TIME_TO_FIRST_BYTE.labels(endpoint).observe(time.perf_counter() - started)
            handed_over = True
            return StreamingResponse(
                self._relay(instance, endpoint, upstream, first, chunks, started),
                media_type="text/event-stream",
            )
        finally:
            if not handed_over:
                self._leave(instance)

    async def _relay(
        self,
        instance: Instance,
        endpoint: str,
        upstream: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
        started: float,
    ) -> AsyncIterator[bytes]:
        status = 200
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as exc:
            status = 502
            log.warning("stream from %s broke: %r", instance.instance_id, exc)
            event = error_body(f"the engine's stream broke: {exc!r}", EngineFailed.type, 502)
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            self._leave(instance)
            self._observe(endpoint, status, started, started_stream=True)

    def _enter(self, instance: Instance) -> None:
        instance.inflight += 1
        metrics.INFLIGHT.labels(instance.instance_id).set(instance.inflight)

    def _leave(self, instance: Instance) -> None:
        instance.inflight -= 1
        metrics.INFLIGHT.labels(instance.instance_id).set(instance.inflight)

    @staticmethod
    def _observe(endpoint: str, status: int, started: float, started_stream: bool | None) -> None:
        elapsed = time.perf_counter() - started
        if started_stream is None:
            metrics.TIME_TO_FIRST_BYTE.labels(endpoint).observe(elapsed)
        metrics.REQUEST_LATENCY.labels(endpoint).observe(elapsed)
        metrics.REQUESTS.labels(endpoint, str(status)).inc()


__all__ = ["Forwarder", "RouterError"]
