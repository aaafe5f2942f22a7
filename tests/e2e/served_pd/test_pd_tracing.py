"""One OpenTelemetry trace per request across the router and both vLLM engines of a P/D request
(router/tracing.py): a real OTLP/gRPC receiver (loadtest/otlp_receiver.py) and this package's
`pdcluster serve` of one prefill and one decode tiny engine started with
`--otlp-traces-endpoint`, every request prefilled remotely. The engines' spans are vLLM's own
(`llm_request`, from its output processor), joined through the `traceparent` the router sends.
The receiver also holds the spans of this package's other tests: each test picks its own
requests' traces by id, or by a start after its request was sent."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest

from loadtest.local_cluster import LocalServer
from loadtest.otlp_receiver import OTLPReceiver, ReceivedSpan
from router.tracing import REQUEST_SPAN, SERVICE_NAME

pytestmark = pytest.mark.slow
CANARY = "zebracanary"
"""A word of every prompt here: no span may carry it."""
PROMPT = f"The {CANARY} tells a long story about tracing requests across a cluster of engines. " * 3
STAGES = ("pdcluster.admission", "pdcluster.analysis", "pdcluster.queue_wait", "pdcluster.placement",
          "pdcluster.remote_prefill", "pdcluster.kv_handover", "pdcluster.decode_stream")
ENGINE_SPAN = "llm_request"
MAX_TOKENS = 8


@pytest.fixture
def traced_pd(served_pd, otlp_receiver):
    return served_pd, otlp_receiver


def complete(server: LocalServer, headers: dict | None = None, stream: bool = True) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response


def whole_trace(receiver: OTLPReceiver, trace_id: str) -> list[ReceivedSpan]:
    """The trace's spans once the router's request span and both engines' spans have arrived
    (each process exports in batches, seconds apart)."""

    def done(spans: list[ReceivedSpan]) -> bool:
        names = [s.name for s in spans if s.trace_id == trace_id]
        return REQUEST_SPAN in names and names.count(ENGINE_SPAN) >= 2

    return [s for s in receiver.wait_for(done, timeout_s=60) if s.trace_id == trace_id]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


def assert_pd_chain(spans: list[ReceivedSpan]) -> ReceivedSpan:
    """Router root -> each stage; remote_prefill -> the prefill engine's span; decode_stream ->
    the decode engine's span. Returns the root."""
    root = one(spans, REQUEST_SPAN)
    assert root.resource["service.name"] == SERVICE_NAME
    assert root.kind == 2  # SERVER
    for name in STAGES:
        assert one(spans, name).parent_span_id == root.span_id, name
    assert root.attributes["pdcluster.placement.reason"] == "remote"
    assert root.attributes["http.response.status_code"] == 200

    prefill_call, decode_call = one(spans, "pdcluster.remote_prefill"), one(spans, "pdcluster.decode_stream")
    assert prefill_call.kind == decode_call.kind == 3  # CLIENT
    assert prefill_call.attributes["pdcluster.kv_handed_over"] is True
    engines = {s.parent_span_id: s for s in spans if s.name == ENGINE_SPAN}
    assert set(engines) == {prefill_call.span_id, decode_call.span_id}
    prefill_engine, decode_engine = engines[prefill_call.span_id], engines[decode_call.span_id]
    # Each vLLM span comes from the engine the router says it called, in its role.
    assert prefill_engine.resource["pdcluster.role"] == "prefill"
    assert prefill_engine.resource["pdcluster.instance_id"] == root.attributes["pdcluster.prefill.instance_id"]
    assert prefill_engine.resource["pdcluster.instance_id"] == prefill_call.attributes["pdcluster.instance_id"]
    assert decode_engine.resource["pdcluster.role"] == "decode"
    assert decode_engine.resource["pdcluster.instance_id"] == root.attributes["pdcluster.serve.instance_id"]
    # The prefill request computes the prompt and one token; the decode engine generates the answer.
    assert prefill_engine.attributes["gen_ai.usage.completion_tokens"] == 1
    assert decode_engine.attributes["gen_ai.usage.completion_tokens"] == MAX_TOKENS
    assert prefill_engine.attributes["gen_ai.usage.prompt_tokens"] == root.attributes["gen_ai.usage.prompt_tokens"]
    # The stream span lasts to the last byte: past the handover, within the request's span.
    handover = one(spans, "pdcluster.kv_handover")
    assert prefill_call.end_ns <= handover.end_ns <= decode_call.end_ns <= root.end_ns
    return root


def test_a_pd_request_is_one_trace_joined_to_the_clients(traced_pd):
    server, receiver = traced_pd
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    response = complete(server, headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert response.text.rstrip().endswith("data: [DONE]")

    spans = whole_trace(receiver, trace_id)
    root = assert_pd_chain(spans)
    assert root.parent_span_id == client_span  # joined to the client's trace
    assert one(spans, "pdcluster.decode_stream").attributes["pdcluster.role"] == "decode"


def test_a_request_without_traceparent_starts_its_own_trace(traced_pd):
    server, receiver = traced_pd
    sent_ns = time.time_ns()  # spans of earlier tests' requests may still arrive: all began before
    complete(server, stream=False)

    def new_roots(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.name == REQUEST_SPAN and s.start_ns >= sent_ns]

    (root,) = new_roots(receiver.wait_for(new_roots, 30))
    assert root.parent_span_id == ""
    assert_pd_chain(whole_trace(receiver, root.trace_id))


def test_a_refused_request_ends_its_span_with_the_status(traced_pd):
    server, receiver = traced_pd
    trace_id = secrets.token_hex(16)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": -1}
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30).status_code == 400

    spans = receiver.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == REQUEST_SPAN for s in spans), 30)
    root = one([s for s in spans if s.trace_id == trace_id], REQUEST_SPAN)
    assert root.attributes["http.response.status_code"] == 400
    assert root.attributes["error.type"] == "BadRequest"
    assert not [s for s in spans if s.trace_id == trace_id and s.name == "pdcluster.placement"]


def test_no_span_carries_prompt_text_or_secrets(traced_pd, first_engine_tokens):
    server, receiver = traced_pd
    complete(server)  # at least one request's spans, whichever test ran first
    receiver.wait_for(lambda spans: sum(s.name == ENGINE_SPAN for s in spans) >= 2, 60)
    credentials = server.credentials
    engine_tokens = {*first_engine_tokens, *(server.engine_access(i["instance_id"]).token for i in server.instances())}
    tokens = [*engine_tokens, *(value.split()[-1] for value in credentials.admin_headers().values())]
    forbidden = [CANARY, credentials.secret.hex(), *tokens]
    for span in receiver.spans():
        texts = [str(v) for v in (*span.attributes.values(), *span.resource.values())]
        texts += [str(v) for _, attributes in span.events for v in attributes.values()]
        for text in texts:
            for secret in forbidden:
                assert secret not in text, (span.name, text[:80])
