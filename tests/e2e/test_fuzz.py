"""Property-based fuzzing of the router's OpenAPI schema (schemathesis), against the session's
real engine: over a thousand generated requests, valid and not, and no 5xx. Bodies may ask for
any max_tokens the schema allows; the test caps generation lengths so the run stays short.

Hypothesis is driven directly from each operation's strategy: schemathesis' pytest plugin does
not work with pytest 9 (it sets a private node attribute that pytest 9 removed)."""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis

pytestmark = pytest.mark.slow
EXAMPLES_PER_BODY = 550  # x 2 sampling endpoints: > 1,000 requests
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n", "best_of")


def capped(body):
    """Short generations, and the served model's name (a random name only ever gets the 404
    the unit tests check), so generated bodies reach the engine. A body that sets no length (both
    absent or null) would generate to the end of the context, n times: it gets `max_tokens` 4."""
    if isinstance(body, dict):
        body["model"] = "tiny"
        for field in LENGTH_FIELDS:
            value = body.get(field)
            if is_int(value) and value > 4:
                body[field] = 4
        if body.get("max_tokens") is None and not is_int(body.get("max_completion_tokens")):
            body["max_tokens"] = 4
    return body


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fuzz(operation, base_url: str, examples: int, seen: list[int]) -> None:
    """Send `examples` generated requests for one operation; none may get a 5xx."""

    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # the same requests on every run: a red run reproduces
        suppress_health_check=list(hypothesis.HealthCheck),
        database=None,
    )
    def call(case):
        case.body = capped(case.body)
        response = case.call(base_url=base_url, timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:  # OpenAI-style errors: a type and a message
            error = response.json()["error"]
            assert error["type"] and error["message"], response.text

    call()


def test_over_a_thousand_generated_requests_get_no_5xx(served):
    schema = schemathesis.openapi.from_url(f"{served.url}/admin/openapi.json",
                                           headers=served.credentials.admin_headers())
    statuses: dict[str, list[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        # Operations without inputs have one distinct request; bodies have endless ones.
        examples = EXAMPLES_PER_BODY if operation.method.upper() == "POST" else 5
        fuzz(operation, served.url, examples, statuses.setdefault(name, []))
    total = sum(len(v) for v in statuses.values())
    assert total >= 1000, {k: len(v) for k, v in statuses.items()}
    # Both valid and invalid requests were generated for the sampling endpoints.
    for name in ("POST /v1/completions", "POST /v1/chat/completions"):
        counts = {s: statuses[name].count(s) for s in set(statuses[name])}
        assert counts.get(200) and any(400 <= s < 500 for s in counts), (name, counts)
