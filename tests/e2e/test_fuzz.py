"""Property-based fuzzing of the router's OpenAPI schema (schemathesis), against the session's
real engine: over a thousand generated requests, valid and not, and no 5xx. Bodies may ask for
any max_tokens the schema allows; the test caps generation lengths so the run stays short."""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis

pytestmark = pytest.mark.slow
EXAMPLES_PER_OPERATION = 200  # x 7 operations: > 1,000 requests
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n", "best_of")


@pytest.fixture(scope="module")
def router_schema(served):
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("router_schema")
SEEN: list[int] = []


@schema.parametrize()
@hypothesis.settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,  # the same requests on every run: a red run reproduces
    suppress_health_check=list(hypothesis.HealthCheck),
)
def test_no_request_gets_a_5xx(case):
    if isinstance(case.body, dict):
        for field in LENGTH_FIELDS:
            value = case.body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 4:
                case.body[field] = 4
    response = case.call(timeout=60)
    SEEN.append(response.status_code)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if response.status_code >= 400:  # OpenAI-style errors: a type and a message
        error = response.json()["error"]
        assert error["type"] and error["message"]


def test_the_fuzzer_sent_over_a_thousand_requests():
    # Runs after the generated cases (pytest keeps file order).
    assert len(SEEN) >= 1000, len(SEEN)
