"""Forwarding a validated request to an engine and its answer back to the client: its placement
(router/placement.py), the prefill half elsewhere when placed so (prefill/handoff.py), the
request (carrying that prefill's KV handoff), and the stream back.

The engine hop uses aiohttp: its C HTTP parser costs a fraction of httpx's pure-Python h11 per
streamed chunk, which halved the router's added latency in `loadtest.router_overhead`.

A request that never reached an engine (connection refused, an engine answering 503) moves to
another instance, up to `max_attempts`. One that reached an engine and broke it (the connection
dropped, a 500, no answer in time) is not retried: a request that crashes one engine would crash
the next. Once tokens have streamed, a broken stream goes on from them on another instance
(router/migration.py), up to `max_migrations` times; one that cannot ends with an OpenAI error
event and `[DONE]`, so a client never hangs. Closing the client's stream closes the engine's,
which makes vLLM abort the request.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
from fastapi.responses import Response

from engine.environment import ENGINE_KEEP_ALIVE_S
from prefill.handoff import PrefillClient
from router import metrics
from router.config import RouterConfig
from router.errors import EngineFailed, stream_error_event
from router.instances import CapacityQueue, Instance, InstanceRegistry, LatencyWindow, PendingPrefill
from router.migration import StreamLedger, migratable, without_stalls
from router.placement import Placement, PlacementReason, Placer
from router.policies import RoutingRequest
from router.streaming import EngineStream
from router.tracing import NO_SPAN, EngineCall, RequestTrace, instance_attributes, placement_attributes

log = logging.getLogger(__name__)
# The router's prefills metric label of a request its decode instance prefills itself, by why it
# was so placed ("local" for a short prompt or no prefill pool).
_LOCAL_PREFILL_LABELS = {PlacementReason.SHORT: "local", PlacementReason.NO_PREFILL: "local",
                         PlacementReason.LOCAL_BUSY: "local_busy"}


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
        self.prefills = PrefillClient(lambda: self.session, config.prefill_timeout_s, config.prefill_circuit_failures,
                                      config.prefill_circuit_s, registry.mark_failed)
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
            prefill = PendingPrefill(instance, computes)
            try:
                return await self._send(instance, endpoint, send_body, started, prefill, untried, trace)
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
                      if self.prefills.circuit_closed(i, now)]
        with trace.stage("pdcluster.placement") if trace else NO_SPAN as span:
            placement = self.placer.place(request, servers, prefillers)
            if span:
                attributes = placement_attributes(placement, request.num_tokens)
                span.set_attributes(attributes)
                trace.root.set_attributes(attributes)
        metrics.count_prompt_hits(placement.hits)
        send_body, computes = await self._handed_over(endpoint, body, request, placement, trace)
        return placement, send_body, computes

    async def _handed_over(self, endpoint: str, body: dict, request: RoutingRequest,
                           placement: Placement, trace: RequestTrace | None) -> tuple[dict, int]:
        if placement.prefill is None and placement.reason in _LOCAL_PREFILL_LABELS:
            metrics.PREFILLS.labels(_LOCAL_PREFILL_LABELS[placement.reason]).inc()
        if placement.prefill is None:
            return body, placement.served_prefill_tokens
        prefiller = placement.prefill
        prefiller.inflight += 1
        queued = PendingPrefill(prefiller, request.num_tokens)
        try:
            with trace.stage("pdcluster.remote_prefill", instance_attributes(prefiller), client=True) if trace \
                    else NO_SPAN as span:
                handoff = await self.prefills.run(prefiller, endpoint, body, trace.headers(span) if span else None)
                if span:
                    span.set_attribute("pdcluster.kv_handed_over", handoff is not None)
        finally:
            prefiller.inflight -= 1
            queued.done()
        if handoff is None:
            metrics.PREFILLS.labels("fallback_local").inc()
            return body, placement.uncached_tokens
        metrics.PREFILLS.labels("remote").inc()
        metrics.KV_HANDOVER_PROMPT_TOKENS.inc(request.num_tokens)
        if trace:
            trace.begin_handover(prefiller, placement.serve.instance, request.num_tokens)
        metrics.REMOTE_PREFILL.observe(handoff.seconds)
        return handoff.decode_body(body), 0

    async def _send(
        self, instance: Instance, endpoint: str, body: dict, started: float, prefill: PendingPrefill,
        others: Callable[[], list[Instance]], trace: RequestTrace | None = None,
    ) -> Response:
        call = trace.engine_call("pdcluster.decode_stream", instance) if trace else None
        ledger = (StreamLedger.start(endpoint, body, self.config.served(body["model"]).max_model_len)
                  if self.config.max_migrations and migratable(endpoint, body) else None)
        body = ledger.engine_body if ledger else body
        self._enter(instance)
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
            chunks = without_stalls(chunks, self.config.stream_stall_s)
            relay = (self._relay(instance, endpoint, upstream, first, chunks, started, call) if ledger is None
                     else self._migrating_relay(instance, endpoint, upstream, first, chunks, started, ledger, others,
                                                call))
            return EngineStream(relay, abandon=lambda: self._abandoned(instance, upstream, call))
        finally:
            prefill.done()
            if not handed_over:
                self._leave(instance)
                if call:  # an exception on its way out (a read that broke) is the engine's failure
                    call.end(502 if sys.exc_info()[0] is not None else None)

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

    async def _relay(
        self, instance: Instance, endpoint: str, upstream: aiohttp.ClientResponse, first: bytes,
        chunks: AsyncIterator[bytes], started: float, call: EngineCall | None = None,
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
            yield stream_error_event(f"the engine's stream broke: {exc!r}")
        finally:
            # A stream left early (client gone) is closed, not released: dropping the connection
            # makes vLLM abort the request.
            if finished:
                upstream.release()
            else:
                upstream.close()
            self._leave(instance)
            metrics.observe_request(endpoint, status, started, first_byte=False)
            if call:
                call.end(status)

    async def _migrating_relay(
        self, instance: Instance, endpoint: str, upstream: aiohttp.ClientResponse, first: bytes,
        chunks: AsyncIterator[bytes], started: float, ledger: StreamLedger, others: Callable[[], list[Instance]],
        call: EngineCall | None = None,
    ) -> AsyncIterator[bytes]:
        """`_relay`'s job for a migratable stream: through its ledger, and on to another
        instance (at most `max_migrations` times) when its engine's stream breaks."""
        status, migrations = 200, 0

        def let_go(broken: bool) -> None:
            """Done with this engine's stream: dropped if broken (vLLM then aborts), else pooled."""
            nonlocal instance
            (upstream.close if broken else upstream.release)()
            instance.streams.discard(ledger)
            self._leave(instance)
            instance = None

        instance.streams.add(ledger)  # here, not before: a relay that never starts never leaves
        try:
            while True:
                try:
                    for out in ledger.feed(first):
                        yield out
                    async for chunk in chunks:
                        for out in ledger.feed(chunk):
                            yield out
                    broke = None if ledger.done else "the engine's stream ended without [DONE]"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    broke = None if ledger.done else repr(exc)  # after [DONE] nothing is missing
                except ValueError as exc:  # not an event stream: nothing to go on from
                    let_go(broken=True)
                    status = 502
                    yield stream_error_event(f"the engine sent a malformed event: {exc}")
                    return
                if broke is None:
                    let_go(broken=False)
                    return
                self.registry.mark_failed(instance, f"its stream broke: {broke}")
                let_go(broken=True)
                if ledger.finished:  # only the usage and [DONE] were missing
                    yield ledger.closing()
                    return
                moved = None
                if migrations < self.config.max_migrations and ledger.can_continue():
                    migrations += 1
                    moved = await self._continue_elsewhere(endpoint, ledger, others, broke, call)
                if moved is None:
                    status = 502
                    yield stream_error_event(f"the engine's stream broke: {broke}")
                    return
                instance, upstream, first, chunks = moved
                instance.streams.add(ledger)
        finally:
            if instance is not None:  # the client left mid-stream
                let_go(broken=True)
            metrics.observe_request(endpoint, status, started, first_byte=False)
            if call:
                call.span.set_attribute("pdcluster.migrations", migrations)
                call.end(status)

    async def _continue_elsewhere(
        self, endpoint: str, ledger: StreamLedger, others: Callable[[], list[Instance]], broke: str,
        call: EngineCall | None = None,
    ) -> tuple[Instance, aiohttp.ClientResponse, bytes, AsyncIterator[bytes]] | None:
        """The continuation of `ledger`'s stream on the least loaded other instance, up to its
        first bytes; None if there is none or it failed too. Whatever ends it early (the client
        leaving cancels it) leaves the instance's books and connection as they were."""
        candidates = others()
        if not candidates:
            return None
        instance = min(candidates, key=lambda i: i.inflight)
        body = ledger.continuation()
        log.warning("stream of %s broke (%s): continuing on %s after %d tokens", endpoint, broke,
                    instance.instance_id, len(body["prompt"]) - len(ledger.prompt_token_ids))
        metrics.MIGRATIONS.inc()
        if call:  # the continuation's engine span joins the same decode_stream span
            call.span.add_event("pdcluster.migrated", instance_attributes(instance))
        self._enter(instance)
        upstream, moved = None, None
        try:
            upstream = await self.session.post(f"{instance.url}/v1/completions", json=body,
                                               **instance.request_options(call.headers if call else None))
            if upstream.status != 200:
                text = (await upstream.read()).decode(errors="replace")[:500]
                log.warning("instance %s refused a continued stream: HTTP %d %s", instance.instance_id,
                            upstream.status, text)
                if upstream.status >= 500 and upstream.status != 503:
                    self.registry.mark_failed(instance, f"failed a continued stream: HTTP {upstream.status}")
                return None
            chunks = upstream.content.iter_any()
            moved = instance, upstream, await chunks.__anext__(), without_stalls(chunks, self.config.stream_stall_s)
            return moved
        except (aiohttp.ClientError, TimeoutError, StopAsyncIteration) as exc:
            self.registry.mark_failed(instance, f"failed a continued stream: {exc!r}")
            return None
        finally:
            if moved is None:
                if upstream is not None:
                    upstream.close()
                self._leave(instance)

    def _abandoned(self, instance: Instance, upstream: aiohttp.ClientResponse, call: EngineCall | None) -> None:
        """A relay's clean-up when the client left before it began (router/streaming.py)."""
        upstream.close()
        self._leave(instance)
        if call:
            call.end(499)

    def _enter(self, instance: Instance) -> None:
        instance.inflight += 1
        metrics.INFLIGHT.labels(instance.instance_id).set(instance.inflight)

    def _leave(self, instance: Instance) -> None:
        instance.inflight -= 1
        metrics.INFLIGHT.labels(instance.instance_id).set(instance.inflight)
