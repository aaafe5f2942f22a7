"""Tool calls through the router answer as plain vLLM's do, with the same options
(`--engine-arg=--enable-auto-tool-choice --engine-arg=--tool-call-parser=hermes`): tool_choice auto,
required (parallel calls allowed or not), a named function and none, streamed and not, and a
second turn carrying the calls and their results; and the router renders a tool request's prompt
token for token as its engine does, so such requests find their cached prefix."""

from __future__ import annotations

import httpx
import pytest
import tool_calls

from engine.config import KVHashing
from router.hashing import PromptHasher
from router.openai_requests import ChatCompletionRequest

pytestmark = [pytest.mark.slow, pytest.mark.oracles("tiny")]


def test_tool_calls_answer_as_plain_vllm(served, oracle):
    want = oracle.tool_calls()
    assert any(answer.calls for answer in want.values()), "no request made a call: the test would prove nothing"
    got = tool_calls.ask_all(served.url, "tiny")
    differ = {name: (got[name], answer) for name, answer in want.items() if got[name] != answer}
    assert not differ, "\n".join(f"{name}: ours {ours}, vLLM's {theirs}" for name, (ours, theirs) in differ.items())


@pytest.mark.parametrize("name", ["auto", "follow-up"])
def test_the_router_renders_a_tool_request_as_its_engine(served, tiny_model, name):
    sent = tool_calls.body("tiny", tool_calls.REQUESTS[name], stream=False) | {"max_tokens": 1}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=sent, timeout=60)
    assert response.status_code == 200, response.text
    engines = response.json()["prompt_token_ids"]
    request = ChatCompletionRequest.model_validate(sent)
    hasher = PromptHasher(tiny_model, KVHashing())
    routers = hasher.chat_tokens([m.model_dump(exclude_unset=True) for m in request.messages], request.template_options())
    assert routers == engines
