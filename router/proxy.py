"""Forwarding a validated request to an engine and its answer back to the client, in steps with
one job each: the placement (router/placement.py), the prefill half elsewhere when placed so
(prefill/handoff.py), the request to the serving instance (carrying that prefill's KV handoff),
and the relay of its answer (router/relay.py, which moves a broken stream on). What a request
holds on an instance is booked with the fleet's registry (fleet/instances.py).

The engine hop uses aiohttp: its C HTTP parser costs a fraction of httpx's pure-Python h11 per
streamed chunk, which halved the router's added latency in `loadtest.router_overhead`.

A request that never reached an engine (connection refused, an engine answering 503) moves to
another instance, up to `max_attempts`. One that reached an engine and broke it (the connection
dropped, a 500, no answer in time) is not retried: a request that crashes one engine would crash
the next. Once tokens have streamed, a broken stream goes on from them on another instance
(router/relay.py), up to `max_migrations` times; one that cannot ends with an OpenAI error
event and `[DONE]`, so a client never hangs.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import aiohttp
from fastapi.responses import Response

from decode.stream_ledger import StreamLedger, migratable, without_stalls
from engine.environment import ENGINE_KEEP_ALIVE_S
from fleet.instances import Instance, InstanceRegistry, PendingPrefill
from prefill.handoff import PrefillHop
from router import metrics
from router.capacity import CapacityQueue, LatencyWindow
from router.config import RouterConfig
from router.errors import EngineFailed
from router.placement import Placement, Placer
from router.policies import RoutingRequest
from router.relay import StreamRelay
from router.status import PlacementLog
from router.streaming import EngineStream
from router.tracing import NO_SPAN, EngineCall, RequestTrace, instance_attributes, placement_attributes

log = logging.getLogger(__name__)


class _RetryableEngineError(Exception):
    pass


class Forwarder:
    """Owns the pooled HTTP client to the engines."""

    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        placer: Placer,
        queue: CapacityQueue,
    ):
        self.config = config
        self.registry = registry
        self.placer = placer
        self.queue = queue
        self.first_tokens = LatencyWindow()
        self.placements = PlacementLog()
        self.prefills = PrefillHop(registry, lambda: self.session, config.prefill_timeout_s,
                                   config.prefill_circuit_failures, config.prefill_circuit_s)
        self.relay = StreamRelay(registry, lambda: self.session, config.stream_stall_s, config.max_migrations)
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
            # Idle connections closed well before the engine would close them (ENGINE_KEEP_ALIVE_S).
            connector = aiohttp.TCPConnector(limit=4096, keepalive_timeout=ENGINE_KEEP_ALIVE_S / 2)
            # no proxy from the environment: it would see the engines' tokens (aiohttp's default)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(
        self, endpoint: str, body: dict, candidates: Callable[[], list[Instance]], request: RoutingRequest,
        trace: RequestTrace | None = None,
    ) -> Response:
        started = time.perf_counter()
        tried: set[str] = set()
        last_error: str = "no instance tried"
        for attempt in range(self.config.max_attempts):

            def untried() -> list[Instance]:
                return [i for i in candidates() if i.instance_id not in tried]

            if trace:
                trace.attempt = attempt
            # Only a request no instance has failed yet waits for capacity.
            with trace.stage("pdcluster.queue_wait") if trace and not tried else NO_SPAN:
                ready = await self.queue.wait(untried, body["model"]) if not tried else untried()
            if not ready:
                break
            if attempt:
                metrics.RETRIES.inc()
            placement, send_body, computes = await self.prepare(endpoint, body, request, ready, trace)
            instance = placement.serve.instance
            tried.add(instance.instance_id)
            prefill = self.registry.queue_prefill(instance, computes)
            try:
                return await self._send(instance, endpoint, send_body, started, prefill, untried, request, trace)
            except _RetryableEngineError as exc:
                last_error = str(exc)
                log.warning("instance %s failed a request: %s", instance.instance_id, exc)
        raise EngineFailed(f"every instance tried failed; last error: {last_error}")

    async def prepare(self, endpoint: str, body: dict, request: RoutingRequest,
                      servers: list[Instance], trace: RequestTrace | None = None) -> tuple[Placement, dict, int]:
        """Place the request among `servers` (and the prefill instances whose circuit is
        closed), run its prefill elsewhere if so placed; returns the placement, the body for the
        serving instance (with the prefill's KV handoff if it succeeded) and the prompt tokens
        the serving instance will compute itself."""
        now = time.monotonic()
        prefillers = [i for i in self.registry.ready(lambda role: role.takes_remote_prefills, body["model"])
                      if i.circuit_closed(now)]
        with trace.stage("pdcluster.placement") if trace else NO_SPAN as span:
            placement = self.placer.place(request, servers, prefillers)
            if span:
                attributes = placement_attributes(placement, request.num_tokens)
                span.set_attributes(attributes)
                trace.root.set_attributes(attributes)
        metrics.count_prompt_hits(placement.hits)
        self.placements.record(body["model"], request.num_tokens, placement)
        send_body, computes = await self._handed_over(endpoint, body, request, placement, trace)
        return placement, send_body, computes

    async def _handed_over(self, endpoint: str, body: dict, request: RoutingRequest,
                           placement: Placement, trace: RequestTrace | None) -> tuple[dict, int]:
        if placement.prefill is None:
            if placement.reason.prefilled_where:
                metrics.PREFILLS.labels(placement.reason.prefilled_where).inc()
            return body, placement.served_prefill_tokens
        prefiller = placement.prefill
        with trace.stage("pdcluster.remote_prefill", instance_attributes(prefiller), client=True) if trace \
                else NO_SPAN as span:
            handoff = await self.prefills.run(prefiller, endpoint, body, request.num_tokens,
                                              trace.headers(span) if span else None)
            if span:
                span.set_attribute("pdcluster.kv_handed_over", handoff is not None)
        if handoff is None:
            metrics.PREFILLS.labels(metrics.FALLBACK_LOCAL).inc()
            return body, placement.uncached_tokens
        metrics.PREFILLS.labels(placement.reason.prefilled_where).inc()
        metrics.KV_HANDOVER_PROMPT_TOKENS.inc(request.num_tokens)
        if trace:
            trace.begin_handover(prefiller, placement.serve.instance, request.num_tokens)
        metrics.REMOTE_PREFILL.observe(handoff.seconds)
        return handoff.decode_body(body), 0

    async def _send(
        self, instance: Instance, endpoint: str, body: dict, started: float, prefill: PendingPrefill,
        others: Callable[[], list[Instance]], request: RoutingRequest, trace: RequestTrace | None = None,
    ) -> Response:
        call = trace.engine_call("pdcluster.decode_stream", instance) if trace else None
        ledger = (StreamLedger.start(endpoint, body, self.config.served(body["model"]).max_model_len)
                  if self.config.max_migrations and migratable(endpoint, body, self.config.structured_migration)
                  else None)
        body = ledger.engine_body if ledger else body
        self.registry.request_started(instance)
        handed_over = False
        try:
            upstream = await self._post(instance, endpoint, body, call)
            if not body.get("stream") or upstream.status != 200:
                return await self._whole_answer(instance, endpoint, upstream, started, call, trace)
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
            if trace:
                trace.first_byte(call)
            prefill.done()
            handed_over = True
            return EngineStream(self._relayed(instance, endpoint, upstream, first, chunks, started, ledger, others,
                                              request, call),
                                abandon=lambda: self._abandoned(instance, upstream, call))
        finally:
            prefill.done()
            if not handed_over:
                self.registry.request_ended(instance)
                if call:  # an exception on its way out (a read that broke) is the engine's failure
                    call.end(502 if sys.exc_info()[0] is not None else None)

    def _relayed(self, instance: Instance, endpoint: str, upstream: aiohttp.ClientResponse, first: bytes, chunks,
                 started: float, ledger: StreamLedger | None, others: Callable[[], list[Instance]],
                 request: RoutingRequest, call: EngineCall | None):
        """The relay of a stream that has begun (router/relay.py), its end recorded here."""
        chunks = without_stalls(chunks, self.config.stream_stall_s)

        def ended(status: int, migrations: int = 0) -> None:
            metrics.observe_request(endpoint, status, started, first_byte=False)
            if call:
                if ledger is not None:
                    call.span.set_attribute("pdcluster.migrations", migrations)
                call.end(status)

        if ledger is None:
            return self.relay.plain(instance, endpoint, upstream, first, chunks, ended)

        def continue_on(candidates: list[Instance]) -> Instance:  # as the placement step would place it
            placement = self.placer.place(request, candidates, [])
            self.placements.record(instance.model, request.num_tokens, placement, migrated=True)
            return placement.serve.instance

        return self.relay.migrating(instance, endpoint, upstream, first, chunks, ledger, others, call, ended,
                                    continue_on)

    async def _post(self, instance: Instance, endpoint: str, body: dict,
                    call: EngineCall | None) -> aiohttp.ClientResponse:
        """`body` to `instance`, up to its answer's status line. A request that never connected, or
        that the engine refused with a 503, may go to another instance (_RetryableEngineError);
        one the engine took and broke on may not (EngineFailed)."""
        try:
            upstream = await self.session.post(f"{instance.url}{endpoint}", json=body,
                                               **instance.request_options(call.headers if call else None))
        except aiohttp.ClientConnectorError as exc:  # never connected: the request went nowhere
            self.registry.mark_failed(instance, f"unreachable: {exc!r}")
            raise _RetryableEngineError(f"unreachable: {exc!r}") from None
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            self.registry.mark_failed(instance, f"broke on a request: {exc!r}")
            raise EngineFailed("the engine failed while serving this request") from None
        if call:
            call.status = upstream.status
        if upstream.status >= 500:
            text = (await upstream.read()).decode(errors="replace")[:500]
            upstream.release()
            if upstream.status != 503:  # the engine took the request and failed on it
                log.warning("instance %s answered %d: %s", instance.instance_id, upstream.status, text)
                raise EngineFailed(f"the engine failed while serving this request (HTTP {upstream.status})")
            raise _RetryableEngineError(f"HTTP {upstream.status}: {text}")
        return upstream

    async def _whole_answer(self, instance: Instance, endpoint: str, upstream: aiohttp.ClientResponse,
                            started: float, call: EngineCall | None, trace: RequestTrace | None) -> Response:
        """A non-streamed answer (or an error status), read whole and passed on."""
        try:
            content = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.registry.mark_failed(instance, f"broke on a request: {exc!r}")
            raise EngineFailed("the engine's answer broke off") from None
        finally:
            upstream.release()
        metrics.observe_request(endpoint, upstream.status, started, first_byte=True)
        if trace:  # not streamed: the whole answer is its first byte
            trace.first_byte(call)
        return Response(content, upstream.status, media_type="application/json")

    def _abandoned(self, instance: Instance, upstream: aiohttp.ClientResponse, call: EngineCall | None) -> None:
        """A relay's clean-up when the client left before it began (router/streaming.py)."""
        upstream.close()
        self.registry.request_ended(instance)
        if call:
            call.end(499)
