"""Tool calling, asked the same way of plain vLLM and of pdcluster: the requests (tool_choice auto,
required, a named function, none; parallel calls allowed or not; streamed and not) and their
greedy answers, compared whole (token ids, content, each call's name and arguments, finish reason;
not the calls' ids, which every server draws at random)."""

from __future__ import annotations

import dataclasses
import json

import httpx

# Arguments from enums and booleans only: a random-weight model's calls then end within
# MAX_TOKENS (a free string could run to any length).
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Berlin", "Lima"]},
            "celsius": {"type": "boolean"}}, "required": ["city", "celsius"]}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
# A second turn: the assistant's calls and the tools' results in the history.
FOLLOW_UP = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "celsius": true}'}},
        {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "12 degrees, rain"},
    {"role": "tool", "tool_call_id": "call-2", "content": "14:05"},
]
MAX_TOKENS = 96
REQUESTS: dict[str, dict] = {
    "auto": {"tool_choice": "auto"},
    "required": {"tool_choice": "required"},
    "required-one-call": {"tool_choice": "required", "parallel_tool_calls": False},
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    "none": {"tool_choice": "none"},
    "follow-up": {"tool_choice": "auto", "messages": FOLLOW_UP},
}
"""Name -> what the request sets beyond the tools, the first turn and greedy sampling."""


@dataclasses.dataclass(frozen=True)
class ToolAnswer:
    token_ids: tuple[int, ...]
    content: str | None
    calls: tuple[tuple[str, str], ...]
    """Each call's function name and arguments (JSON text), in order."""
    finish_reason: str


def body(model: str, request: dict, stream: bool) -> dict:
    return {"model": model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "stream": stream, **request}


def ask(url: str, model: str, request: dict, stream: bool) -> ToolAnswer:
    sent = body(model, request, stream)
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", json=sent, timeout=300)
        assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:500]}"
        choice = response.json()["choices"][0]
        calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or ())
        return ToolAnswer(tuple(choice["token_ids"]), choice["message"]["content"], calls, choice["finish_reason"])
    return _streamed(url, sent)


def _streamed(url: str, sent: dict) -> ToolAnswer:
    tokens: list[int] = []
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    finish = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=sent, timeout=300) as response:
        assert response.status_code == 200, f"{url}: {response.status_code} {response.read()[:500]}"
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            for choice in event.get("choices", ()):
                tokens += choice.get("token_ids") or ()
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    name, arguments = calls.setdefault(call["index"], ["", ""])[:2]
                    function = call.get("function") or {}
                    calls[call["index"]] = [name + (function.get("name") or ""),
                                            arguments + (function.get("arguments") or "")]
                finish = choice.get("finish_reason") or finish
    text = "".join(content)
    return ToolAnswer(tuple(tokens), text or None, tuple((n, a) for _, (n, a) in sorted(calls.items())), finish)


def ask_all(url: str, model: str) -> dict[str, ToolAnswer]:
    """Every request of REQUESTS, not streamed and streamed (names "X" and "X-streamed")."""
    return {f"{name}{'-streamed' if stream else ''}": ask(url, model, request, stream)
            for name, request in REQUESTS.items() for stream in (False, True)}
