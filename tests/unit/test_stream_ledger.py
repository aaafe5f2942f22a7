"""The stream ledger (decode/stream_ledger.py) on streams shaped as vLLM's, without an engine."""

from __future__ import annotations

import json

import pytest

from decode.stream_ledger import CHAT, COMPLETIONS, StreamLedger, migratable
from engine.environment import GRAMMAR_ARG


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def completion_event(text: str, token_ids: list[int], finish: str | None = None, prompt: list[int] | None = None,
                     object_: str = "text_completion", event_id: str = "cmpl-1") -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": token_ids}
    if prompt is not None:
        choice["prompt_token_ids"] = prompt
    return {"id": event_id, "object": object_, "created": 7, "model": "m", "choices": [choice]}


def events_of(data: bytes) -> list[dict | str]:
    out = []
    for raw in data.split(b"\n\n"):
        if raw:
            payload = raw.removeprefix(b"data: ").decode()
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_the_client_gets_its_stream_without_the_token_ids_it_did_not_ask_for_split_anywhere():
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    ledger = StreamLedger.start(COMPLETIONS, body, 128)
    assert ledger.engine_body["return_token_ids"] and "return_token_ids" not in body
    stream = sse(completion_event("A", [10], prompt=[1, 2]), completion_event("", [11]), completion_event("B", [12]))
    out = b"".join(b"".join(ledger.feed(stream[i:i + 5])) for i in range(0, len(stream), 5))
    events = events_of(out)
    assert [e["choices"][0]["text"] for e in events] == ["A", "", "B"]
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e["choices"][0] for e in events)
    assert ledger.prompt_token_ids == [1, 2] and ledger.sent_token_ids == [10, 11, 12]


def test_tokens_whose_text_is_held_back_are_not_counted_as_sent():
    ledger = StreamLedger.start(COMPLETIONS, {"model": "m", "prompt": "hi", "stream": True}, 128)
    list(ledger.feed(sse(completion_event("A", [10], prompt=[1]), completion_event("", [11]))))
    assert ledger.sent_token_ids == [10]  # 11's text (half a character) never reached the client
    body = ledger.continuation()
    assert body["prompt"] == [1, 10]
    assert body["max_tokens"] == 15  # a completion that set none was owed vLLM's default, 16


def test_a_chat_that_set_no_limit_is_owed_what_the_context_leaves():
    ledger = StreamLedger.start(CHAT, {"model": "m", "messages": [], "stream": True}, 128)
    first = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "prompt_token_ids": [1, 2, 3],
             "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None, "token_ids": [9, 9]}]}
    list(ledger.feed(sse(first)))
    assert ledger.continuation()["max_tokens"] == 128 - 3 - 2


def test_the_continuation_asks_for_what_is_still_owed_with_the_same_salt_and_no_handoff():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10,
            "min_tokens": 3, "stream": True, "cache_salt": "tenant-a", "seed": 5,
            "stream_options": {"include_usage": True}}
    ledger = StreamLedger.start(CHAT, body, 128)
    ledger.engine_body["kv_transfer_params"] = {"do_remote_prefill": True}
    first = {"id": "chat-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "prompt_token_ids": [1, 2, 3],
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    token = {**first, "prompt_token_ids": None,
             "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None, "token_ids": [20, 21]}]}
    list(ledger.feed(sse(first, token)))
    continuation = ledger.continuation()
    assert continuation["prompt"] == [1, 2, 3, 20, 21]
    assert continuation["max_tokens"] == 8 and continuation["min_tokens"] == 1
    assert continuation["cache_salt"] == "tenant-a" and continuation["seed"] == 5
    assert not {"messages", "max_completion_tokens", "kv_transfer_params"} & continuation.keys()


def test_continuation_events_take_the_first_streams_shape_and_usage_counts_the_request_once():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    ledger = StreamLedger.start(CHAT, body, 128)
    first = {"id": "chat-1", "object": "chat.completion.chunk", "created": 7, "model": "m", "prompt_token_ids": [1, 2],
             "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None, "token_ids": [30]}]}
    list(ledger.feed(sse(first)))
    ledger.continuation()
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}  # its prompt held the 1 sent token
    out = events_of(b"".join(ledger.feed(sse(
        completion_event("b", [31], prompt=[1, 2, 30], event_id="cmpl-9"),
        completion_event("c", [32, 33], finish="length", event_id="cmpl-9"),
        {"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "m", "choices": [], "usage": usage},
        "[DONE]"))))
    assert [(e["id"], e["object"], e["created"]) for e in out[:3]] == [("chat-1", "chat.completion.chunk", 7)] * 3
    assert [e["choices"][0]["delta"] for e in out[:2]] == [{"content": "b"}, {"content": "c"}]
    assert out[2]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert out[3] == "[DONE]" and ledger.done and ledger.sent_token_ids == [30, 31, 32, 33]


def test_a_stream_that_broke_after_its_last_token_is_closed_with_its_usage():
    body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    ledger = StreamLedger.start(COMPLETIONS, body, 128)
    list(ledger.feed(sse(completion_event("A", [10, 11], finish="stop", prompt=[1, 2, 3]))))
    assert ledger.finished
    closing = events_of(ledger.closing())
    assert closing[0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert closing[1] == "[DONE]"


@pytest.mark.parametrize(("endpoint", "body", "expected"), [
    (COMPLETIONS, {"prompt": "a", "stream": True}, True),
    (COMPLETIONS, {"prompt": [1, 2], "stream": True}, True),
    (CHAT, {"messages": [], "stream": True}, True),
    (COMPLETIONS, {"prompt": "a"}, False),  # not streamed
    (COMPLETIONS, {"prompt": ["a", "b"], "stream": True}, False),  # two prompts
    (CHAT, {"messages": [], "stream": True, "n": 2}, False),
    (CHAT, {"messages": [], "stream": True, "logprobs": True}, False),
    (CHAT, {"messages": [], "stream": True, "response_format": {"type": "json_object"}}, True),  # the grammar goes on
    (CHAT, {"messages": [], "stream": True, "response_format": {"type": "structural_tag"}}, False),
    (COMPLETIONS, {"prompt": "a", "stream": True, "structured_outputs": {"regex": "[a-z]+"}}, True),
    (COMPLETIONS, {"prompt": "a", "stream": True, "structured_outputs": {"choice": ["x", "y"]}}, True),
    (COMPLETIONS, {"prompt": "a", "stream": True, "structured_outputs": {"choice": "x"}}, False),  # not a list
    (COMPLETIONS, {"prompt": "a", "stream": True,  # an option the continuation would not keep
                   "structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}}, False),
    (CHAT, {"messages": [], "stream": True, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}}, False),  # vLLM merges the two
    (COMPLETIONS, {"prompt": "a", "stream": True, "echo": True}, False),
    (COMPLETIONS, {"prompt": "a", "stream": True, "logprobs": 0}, False),  # the sampled token's own
    (COMPLETIONS, {"prompt": "a", "stream": True, "stop": ["\n\n"]}, False),  # held-back characters
    (COMPLETIONS, {"prompt": "a", "stream": True, "stop": []}, True),
    (CHAT, {"messages": [], "stream": True, "presence_penalty": 0.5}, False),  # counts output tokens
    (CHAT, {"messages": [], "stream": True, "presence_penalty": 0.0, "repetition_penalty": 1.2}, True),
    # tool calls: their deltas are the engine's parser's, whose state no continuation takes over
    (CHAT, {"messages": [], "stream": True, "tools": [{"type": "function", "function": {"name": "f"}}]}, False),
    (CHAT, {"messages": [], "stream": True, "tool_choice": "none"}, False),
])
def test_what_can_be_migrated(endpoint, body, expected):
    assert migratable(endpoint, body) is expected


def test_a_structured_continuation_carries_its_grammar_and_the_tokens_sent():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for structure in ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                      {"structured_outputs": {"json": schema}}):
        body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 10, **structure}
        ledger = StreamLedger.start(COMPLETIONS, body, 128)
        list(ledger.feed(sse(completion_event("{", [90], prompt=[1, 2]), completion_event('"a', [91, 92]))))
        continuation = ledger.continuation()
        assert "response_format" not in continuation and "structured_outputs" not in continuation
        assert json.loads(continuation["vllm_xargs"][GRAMMAR_ARG]) == {
            "kind": "json", "spec": json.dumps(schema), "sent": [90, 91, 92]}
        assert continuation["prompt"] == [1, 2, 90, 91, 92] and continuation["max_tokens"] == 7
    plain = StreamLedger.start(COMPLETIONS, {"model": "m", "prompt": "x", "stream": True}, 128)
    list(plain.feed(sse(completion_event("A", [10], prompt=[1]))))
    assert "vllm_xargs" not in plain.continuation()  # nothing to carry


@pytest.mark.parametrize(("structured", "sent", "follows"), [
    ({"choice": ["yes", "no way"]}, "no", True),  # part way into a choice: it goes on from there
    ({"choice": ["yes", "no way"]}, "maybe", False),
    ({"grammar": 'root ::= "a" ("b" | "c")+'}, "abcb", True),
    ({"regex": "[0-9]+"}, "42", True),
])
def test_a_continued_grammar_compiles_as_vllm_would_and_starts_past_the_sent_text(structured, sent, follows):
    """The grammar a continuation carries goes through vLLM's own xgrammar check and compiler (a
    choice as the grammar vLLM's backend makes of it), and it takes the sent text exactly when
    the text follows the grammar."""
    import xgrammar
    from vllm import SamplingParams

    from decode.stream_ledger import continued_grammar
    from engine.grammar_continuation import GrammarContinuation

    grammar = continued_grammar({"structured_outputs": structured})
    arg = {**grammar, "sent": []}
    GrammarContinuation.validate_params(SamplingParams(extra_args={GRAMMAR_ARG: json.dumps(arg)}))
    compiled = (xgrammar.Grammar.from_ebnf(grammar["spec"]) if grammar["kind"] == "grammar"
                else xgrammar.Grammar.from_regex(grammar["spec"]))
    assert _accepts_prefix(compiled, sent) is follows


def _accepts_prefix(grammar, text: str) -> bool:
    """Whether `text` can begin a string of `grammar` (a byte-level matcher, no tokenizer)."""
    import xgrammar

    tokenizer = xgrammar.TokenizerInfo([chr(c) for c in range(32, 127)])
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(tokenizer).compile_grammar(grammar))
    return all(matcher.accept_string(c) for c in text)


def test_a_stream_under_a_grammar_migrates_only_where_engines_can_continue_it():
    """Without the grammar-continuation processor (`--structured-migration` off, the default) a
    structured stream ends with an error event when its engine dies; plain ones still migrate."""
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    assert migratable(CHAT, chat, structured=False) and migratable(CHAT, chat, structured=True)
    assert not migratable(CHAT, {**chat, "response_format": schema}, structured=False)
    assert migratable(CHAT, {**chat, "response_format": schema}, structured=True)


def test_an_engine_that_died_mid_stream_breaks_it_and_its_continuation_ends_it():
    """vLLM's API server outliving its engine core (a tensor-parallel rank died) sends its
    engine-dead error event and [DONE]: the client gets neither, the stream can go on."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True}
    ledger = StreamLedger.start(COMPLETIONS, body, 128)
    message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
    dead = {"error": {"message": message, "type": "InternalServerError", "param": None, "code": 500}}
    out = b"".join(ledger.feed(sse(completion_event("A", [10], prompt=[1, 2]), dead, "[DONE]")))
    assert [e["choices"][0]["text"] for e in events_of(out)] == ["A"]
    assert not ledger.done and ledger.can_continue() and ledger.engine_failure == message
    assert ledger.continuation()["prompt"] == [1, 2, 10] and ledger.engine_failure is None
    out = b"".join(ledger.feed(sse(completion_event("B", [11], finish="length"), "[DONE]")))
    assert events_of(out)[-1] == "[DONE]" and ledger.done


@pytest.mark.parametrize("error", [
    {"message": "too long", "type": "BadRequestError", "param": None, "code": 400},
    # a request's own failure (vLLM's GenerationError: a grammar, a KV load), not the engine's
    {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}])
def test_a_requests_own_error_is_the_clients_and_ends_its_stream(error):
    ledger = StreamLedger.start(COMPLETIONS, {"model": "m", "prompt": "hi", "stream": True}, 128)
    out = b"".join(ledger.feed(sse(completion_event("A", [10], prompt=[1]), {"error": error}, "[DONE]")))
    assert events_of(out)[1:] == [{"error": error}, "[DONE]"] and ledger.done and ledger.engine_failure is None
