"""One OpenTelemetry trace per request: the router's spans, and the W3C `traceparent` that joins
the engines' own request spans (vLLM's `llm_request`) to them.

With `otlp_traces_endpoint` set (`pdcluster serve --otlp-traces-endpoint URL`) the router exports
its spans over OTLP/gRPC to URL, and its engines export theirs to the same URL (engine/host.py
passes vLLM's `--otlp-traces-endpoint`; vLLM takes the `traceparent` header of each request as
its span's parent). One request's spans:

    pdcluster.request           SERVER; the child of the client's `traceparent` if it sent one
    ├── pdcluster.admission     API key, body, validation, rate and concurrency limits
    ├── pdcluster.analysis      tokens and KV block hashes of the prompt
    ├── pdcluster.queue_wait    waiting for a ready instance (scale-up); ~0 when one is ready
    ├── pdcluster.placement     where: the reason, the instances, the cached tokens
    ├── pdcluster.remote_prefill    CLIENT: the prefill request (P/D, reason "remote")
    │   └── llm_request             the prefill engine's vLLM span
    ├── pdcluster.kv_handover   from the prefill's answer to the serving engine's first byte:
    │                           the KV found and loaded there, and its first step
    └── pdcluster.decode_stream CLIENT: the serving engine's stream (decode, or colocated), to
        └── llm_request         its last byte; the engine's vLLM span (one per engine the
                                stream ran on: a migrated stream continues under this span)

A retried request repeats queue_wait..decode_stream, each with `pdcluster.attempt`.

Attributes carry instance ids, roles, token counts, the placement reason, statuses and
migrations: never prompt or completion text, API keys, or tenants (a key listed without a tenant
name is its own tenant), and an error only by its type (messages may quote the request).

Off (no endpoint) costs nothing: nothing of OpenTelemetry's is imported or set up, `build_app`
holds None, and each hook is one `if trace` branch (`NO_SPAN` where a stage is a `with`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from fleet.instances import Instance
    from router.placement import Placement

SERVICE_NAME = "pdcluster-router"
REQUEST_SPAN = "pdcluster.request"
NO_SPAN = contextlib.nullcontext()
"""What a stage's `with` enters when tracing is off (yields None)."""


def instance_attributes(instance: Instance) -> dict[str, Any]:
    return {"pdcluster.instance_id": instance.instance_id, "pdcluster.role": instance.role.name}


def placement_attributes(placement: Placement, prompt_tokens: int) -> dict[str, Any]:
    attributes = {
        "pdcluster.placement.reason": placement.reason,
        "pdcluster.serve.instance_id": placement.serve.instance.instance_id,
        "pdcluster.serve.role": placement.serve.instance.role.name,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "pdcluster.cached_tokens": placement.serve.cached_tokens,
        "pdcluster.store_tokens": placement.serve.store_tokens,
        "pdcluster.uncached_tokens": placement.uncached_tokens,
    }
    if placement.prefill is not None:
        attributes["pdcluster.prefill.instance_id"] = placement.prefill.instance_id
    return attributes


class RouterTracing:
    """The router's tracer: its own provider (not OpenTelemetry's global one, so nothing else in
    the process exports through it), spans batched off the request path and sent over OTLP/gRPC."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # ALWAYS_ON, not the default ParentBased: a client's traceparent may name its trace, never
        # turn the operator's tracing off (its sampled flag is not obeyed).
        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}), sampler=ALWAYS_ON)
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=urlparse(endpoint).scheme != "https")
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdcluster.router")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, headers: Mapping[str, str], endpoint: str) -> RequestTrace:
        """The request's span, a child of the client's `traceparent` if it sent a valid one (its
        `tracestate` is not taken: nothing of the client's goes on to the engines but the trace id)."""
        from opentelemetry.trace import SpanKind

        carrier = {"traceparent": headers["traceparent"]} if "traceparent" in headers else {}
        span = self.tracer.start_span(REQUEST_SPAN, context=self.propagator.extract(carrier), kind=SpanKind.SERVER,
                                      attributes={"http.route": endpoint})
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Export what is batched, then stop (blocks up to the exporter's timeout)."""
        self.provider.shutdown()


@dataclasses.dataclass
class EngineCall:
    """A span around requests to engines, and the headers that make the engines' spans its children."""

    span: Span
    headers: dict[str, str]
    request: RequestTrace
    status: int = 502
    """The engine's HTTP status, once it answered; 502 if it never did."""

    def end(self, status: int | None = None) -> None:
        from opentelemetry.trace import StatusCode

        status = self.status if status is None else status
        self.request.status = status  # a stream that broke ends its request's span as an error too
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(StatusCode.ERROR)
        self.span.end()


class RequestTrace:
    """One request's spans: stages are children of its `pdcluster.request` span, which ends with
    the answer's last byte (`until_end`, `finish`) or its error (`fail`)."""

    def __init__(self, tracing: RouterTracing, root: Span) -> None:
        from opentelemetry.trace import set_span_in_context

        self._tracing = tracing
        self.root = root
        self._context = set_span_in_context(root)
        self._handover: Span | None = None
        self.status = 200
        """The answer's status as the last engine call ended it (a stream's error event: 502)."""
        self.attempt = 0

    def child(self, name: str, attributes: Mapping[str, Any] | None = None, client: bool = False) -> Span:
        from opentelemetry.trace import SpanKind

        return self._tracing.tracer.start_span(
            name, context=self._context, kind=SpanKind.CLIENT if client else SpanKind.INTERNAL,
            attributes={**(attributes or {}), "pdcluster.attempt": self.attempt})

    @contextlib.contextmanager
    def stage(self, name: str, attributes: Mapping[str, Any] | None = None, client: bool = False) -> Iterator[Span]:
        """A child span around a `with` block; an exception marks it failed, by its type only."""
        span = self.child(name, attributes, client)
        try:
            yield span
        except BaseException as exc:
            _mark_failed(span, exc)
            raise
        finally:
            span.end()

    def engine_call(self, name: str, instance: Instance) -> EngineCall:
        """A CLIENT span for requests to `instance`, with the `traceparent` they carry."""
        span = self.child(name, instance_attributes(instance), client=True)
        return EngineCall(span, self.headers(span), self)

    def headers(self, span: Span) -> dict[str, str]:
        """The W3C trace context (`traceparent`) of a request sent under `span`."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=set_span_in_context(span))
        return carrier

    def begin_handover(self, prefill: Instance, serve: Instance, tokens: int) -> None:
        """The prefill answered with its KV handed over; the span ends at the serving engine's
        first byte (`first_byte`)."""
        if self._handover is not None:  # an earlier attempt's, whose serving engine refused it
            self._handover.end()
        self._handover = self.child("pdcluster.kv_handover", {
            "pdcluster.prefill.instance_id": prefill.instance_id, "pdcluster.serve.instance_id": serve.instance_id,
            "gen_ai.usage.prompt_tokens": tokens})

    def first_byte(self, call: EngineCall) -> None:
        call.span.add_event("first_byte")
        if self._handover is not None:
            self._handover.end()
            self._handover = None

    def finish(self, status: int) -> None:
        from opentelemetry.trace import StatusCode

        if self._handover is not None:  # the serving engine never answered
            self._handover.end()
        self.root.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.root.set_status(StatusCode.ERROR)
        self.root.end()

    def fail(self, exc: BaseException) -> None:
        """The request ended with an error (its status, if a router error; else 500)."""
        from router.errors import RouterError

        _mark_failed(self.root, exc)
        self.finish(exc.status if isinstance(exc, RouterError) else 500)

    async def until_end(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`body`, the request's span ending with its last byte (or when the client leaves)."""
        try:
            async for chunk in body:
                yield chunk
        finally:
            self.finish(self.status)


def _mark_failed(span: Span, exc: BaseException) -> None:
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", type(exc).__name__)
    span.set_status(StatusCode.ERROR)
