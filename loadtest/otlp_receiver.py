"""A real OTLP/gRPC trace receiver on loopback (opentelemetry-proto's TraceService on grpcio), the
far end of `--otlp-traces-endpoint`: it keeps the spans it is sent, for tests to read
(tests/e2e/served_pd/test_pd_tracing.py), or drops them, as the load test's sink (`loadtest.router_overhead
--tracing`), so that what tracing costs is the exporters' work, not a collector's."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclasses.dataclass(frozen=True)
class ReceivedSpan:
    """One span as it arrived, ids in hex."""

    trace_id: str
    span_id: str
    parent_span_id: str
    """Empty for a root span."""
    name: str
    kind: int
    """OTLP's SpanKind: 2 SERVER, 3 CLIENT, 1 INTERNAL."""
    attributes: dict[str, Any]
    resource: dict[str, Any]
    """The exporting process's resource (service.name, ...)."""
    events: tuple[tuple[str, dict[str, Any]], ...]
    start_ns: int
    end_ns: int


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        self.receiver.requests += 1
        if self.receiver.keep:
            self.receiver.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OTLPReceiver:
    """`with OTLPReceiver() as receiver:` serves on 127.0.0.1 (a free port) until the block ends;
    `receiver.endpoint` is what `--otlp-traces-endpoint` takes."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.requests = 0
        """Export calls answered (kept or not)."""
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OTLPReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.stop(grace=1).wait()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    events = tuple((e.name, _attributes(e.attributes)) for e in span.events)
                    received.append(ReceivedSpan(
                        span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name, span.kind,
                        _attributes(span.attributes), resource, events, span.start_time_unix_nano,
                        span.end_time_unix_nano))
        with self._lock:
            self._spans.extend(received)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        """The spans received once `done(spans)` holds; raises TimeoutError with what came."""
        deadline = time.monotonic() + timeout_s
        while not done(spans := self.spans()):
            if time.monotonic() > deadline:
                names = sorted({(s.name, s.trace_id[:8]) for s in spans})
                raise TimeoutError(f"spans not complete after {timeout_s} s; received {names}")
            time.sleep(0.2)
        return spans
