"""The router's spans without vLLM (router/tracing.py): a real router app, a real OTLP/gRPC
receiver, and a stand-in engine (named so: an ASGI app that streams canned events and keeps the
trace context it was sent), so the span tree and the `traceparent` an engine gets are checked in
the unit tier. tests/e2e/served_pd/test_pd_tracing.py checks the whole P/D chain with real engines."""

from __future__ import annotations

import secrets

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from routers import router_client

from loadtest.engine_standin import AppStandIn
from loadtest.otlp_receiver import OTLPReceiver
from router.config import RouterConfig, ServedModel
from router.tracing import REQUEST_SPAN

COLOCATED_STAGES = ("pdcluster.admission", "pdcluster.analysis", "pdcluster.queue_wait", "pdcluster.placement",
                    "pdcluster.decode_stream")


class TraceKeeper:
    """The stand-in engine's app: answers any request with three SSE events and [DONE]; keeps
    each POST's `traceparent` and `tracestate`."""

    def __init__(self) -> None:
        self.traceparents: list[str | None] = []
        self.tracestates: list[str | None] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST":  # not the router's health checks
            self.traceparents.append(dict(scope["headers"]).get(b"traceparent", b"").decode() or None)
            self.tracestates.append(dict(scope["headers"]).get(b"tracestate", b"").decode() or None)
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(3):
            await send({"type": "http.response.body", "body": b'data: {"choices": [{"text": "x"}]}\n\n',
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


class StandInEngine(AppStandIn):
    """A stand-in engine (named so) serving a TraceKeeper."""

    def __init__(self) -> None:
        self.keeper = TraceKeeper()
        super().__init__(self.keeper, "colocated-0")

    @property
    def traceparents(self) -> list[str | None]:
        return self.keeper.traceparents

    @property
    def tracestates(self) -> list[str | None]:
        return self.keeper.tracestates


def router(engine: StandInEngine, endpoint: str | None) -> TestClient:
    return router_client([engine.instance()], raise_server_exceptions=True, otlp_traces_endpoint=endpoint,
                         queue_timeout_s=30)


def test_a_request_is_one_trace_and_the_engine_joins_its_stream_span():
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "m", "prompt": "a prompt no span may carry", "max_tokens": 3, "stream": True}
    with OTLPReceiver() as receiver, StandInEngine() as engine:
        with router(engine, receiver.endpoint) as client:  # leaving it flushes the router's spans
            response = client.post("/v1/completions", json=body,
                                   headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
            assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
        spans = receiver.spans()
    assert {s.trace_id for s in spans} == {trace_id}
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == sorted((REQUEST_SPAN, *COLOCATED_STAGES))  # no prefill elsewhere
    root, stream = by_name[REQUEST_SPAN], by_name["pdcluster.decode_stream"]
    assert root.parent_span_id == client_span
    assert all(by_name[name].parent_span_id == root.span_id for name in COLOCATED_STAGES)
    assert root.attributes["pdcluster.placement.reason"] == "colocated"
    assert root.attributes["pdcluster.serve.instance_id"] == stream.attributes["pdcluster.instance_id"] == "colocated-0"
    assert stream.attributes["http.response.status_code"] == 200
    assert [name for name, _ in stream.events] == ["first_byte"]
    # The engine's request carried the stream span's context: its own span would be that span's child.
    assert engine.traceparents == [f"00-{trace_id}-{stream.span_id}-01"]
    assert not any("no span may carry" in str(v) for s in spans for v in s.attributes.values())


def test_a_client_cannot_turn_tracing_off_or_send_its_tracestate_to_the_engines():
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00",  # sampled flag off
               "tracestate": "vendor=chosen-by-the-client"}
    with OTLPReceiver() as receiver, StandInEngine() as engine:
        with router(engine, receiver.endpoint) as client:
            body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
        spans = receiver.spans()
    assert REQUEST_SPAN in {s.name for s in spans}  # recorded all the same, in the client's trace
    assert {s.trace_id for s in spans} == {trace_id}
    (sent,) = engine.traceparents
    assert sent.endswith("-01") and engine.tracestates == [None]


def test_off_sets_nothing_up_and_sends_no_trace_context():
    with StandInEngine() as engine, router(engine, None) as client:
        assert client.app.state.tracing is None
        headers = {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}
        response = client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True}, headers=headers)
        assert response.status_code == 200
    assert engine.traceparents == [None]


@pytest.mark.parametrize("endpoint", ["127.0.0.1:4317", "grpc://127.0.0.1:4317", "http://127.0.0.1",
                                      "http://user:token@127.0.0.1:4317", "http://127.0.0.1:4317?key=k"])
def test_an_endpoint_is_a_plain_url_with_no_credentials(endpoint):
    with pytest.raises(ValidationError):
        RouterConfig(models=(ServedModel(name="m", max_model_len=128),), otlp_traces_endpoint=endpoint)
