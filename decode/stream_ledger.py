"""Continuing a stream whose engine died: what the client has been sent, the request that goes on
from there on another instance, and that request's events in the first stream's shape.

A migratable stream asks its engine for token ids (vLLM's `return_token_ids`), which the
`StreamLedger` records and strips (unless the client asked for them too). When the engine's
stream breaks, the continuation is a completion whose prompt is the first stream's prompt token
ids (for a chat, the rendered conversation) followed by the tokens already sent, asking for the
tokens still owed. Its events are rewritten to the first stream's id, model and object (a chat's
`delta.content`), and its usage counts the request once: the original prompt, every token sent.
A stream breaks when its engine's connection fails, ends before [DONE], or stalls: no event for
`stream_stall_s` once it has begun (`without_stalls`: a frozen process or an unreachable node
never closes the connection), or sends vLLM's engine-dead error instead of its next tokens (its
API server does when its engine core died under it, as a tensor-parallel rank's death ends it).

What holds: greedy output equals a run without the fault, token for token, as far as the
numbers allow: the continuation's prompt is exactly the tokens the engine had, but their KV is
recomputed in one prefill where the first engine computed it step by step. In float32 the two
agree (tests/e2e/test_migration.py); in bfloat16 a near-tie after the break can go the other way. Seeded sampling continues deterministically, but
vLLM seeds a request's generator once, at its start, so the tokens after the fault differ from a
fault-free run's. A stop string that would span the break is not seen. Tokens whose text the
engine still held back (an unfinished UTF-8 character) are generated again, not counted as sent.

Structured output (a JSON schema or object, as `response_format` or `structured_outputs`, a
regex, an EBNF grammar, a choice) goes on in the grammar state the sent tokens put it in: the continuation carries the
grammar and those tokens in `vllm_xargs` instead of `structured_outputs`, and every engine's
logits processor (engine/grammar_continuation.py) compiles it with vLLM's xgrammar backend and
advances it over them first, so the continuation's masks are the ones vLLM's structured output
would have applied. A grammar vLLM's xgrammar check refuses (vLLM would have used another
backend) fails the continuation, and the stream ends with an error event.

Not migrated (the stream ends with an error event, as before): several choices (`n` > 1, a list
of prompts), logprobs, `echo`, tools, a structural tag or options beside the grammar, stop
strings (vLLM holds back characters, not tokens, that could start one), presence and frequency penalties (they count output tokens only: the sent ones
would escape them), and an engine that hides token ids (a reasoning parser).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.environment import GRAMMAR_ARG

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# Requests whose continuation could not be the same request: see the module docstring.
_NOT_MIGRATABLE = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "tools", "tool_choice", "stop")
_STRUCTURED = ("response_format", "structured_outputs")
_NO_GRAMMAR: dict[str, str] = {}
# Penalties on output tokens only: the sent tokens, in the continuation's prompt, would escape them.
_OUTPUT_PENALTIES = ("presence_penalty", "frequency_penalty")
# A chat's fields that a completion does not take.
_CHAT_ONLY = ("messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
              "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents",
              "reasoning_effort", "logprobs", "top_logprobs", "response_format")
_DONE = b"data: [DONE]\n\n"
# vLLM's EngineDeadError message (vllm/v1/engine/exceptions.py, the same in 0.26 and 0.32).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue."
DEFAULT_COMPLETION_TOKENS = 16  # vLLM's (and OpenAI's) max_tokens of a completion that sets none


def migratable(endpoint: str, body: dict[str, Any], structured: bool = True) -> bool:
    """Whether a stream of this request can be continued on another instance; with `structured`
    false (the engines load no grammar-continuation processor), not one under a grammar."""
    if endpoint not in (COMPLETIONS, CHAT) or not body.get("stream") or body.get("n", 1) != 1:
        return False
    if any(_is_set(body.get(name)) for name in _NOT_MIGRATABLE):
        return False
    grammar = continued_grammar(body)
    if any(body.get(name) for name in _OUTPUT_PENALTIES) or grammar is None or (grammar and not structured):
        return False
    prompt = body.get("prompt")
    return endpoint == CHAT or isinstance(prompt, str) or (isinstance(prompt, list) and isinstance(prompt[0], int))


def continued_grammar(body: dict[str, Any]) -> dict[str, str] | None:
    """The request's structured output as a continuation carries it ({kind, spec}: see
    engine/grammar_continuation.py); empty without one; None for one it cannot carry."""
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    if _is_set(response_format) and _is_set(structured):
        return None  # vLLM merges the two: not ours to redo
    if _is_set(response_format):
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        schema = (response_format.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if kind == "json_schema" and isinstance(schema, dict):
            return {"kind": "json", "spec": json.dumps(schema)}  # as vLLM serializes it (request.py)
        return {"kind": "json_object", "spec": ""} if kind == "json_object" else _NO_GRAMMAR if kind == "text" else None
    if _is_set(structured):
        if not isinstance(structured, dict):
            return None
        given = {name for name, value in structured.items() if _is_set(value)}
        if given == {"json"}:
            spec = structured["json"]
            return {"kind": "json", "spec": spec if isinstance(spec, str) else json.dumps(spec)}
        if given == {"regex"} and isinstance(structured["regex"], str):
            return {"kind": "regex", "spec": structured["regex"]}
        if given == {"grammar"} and isinstance(structured["grammar"], str):
            return {"kind": "grammar", "spec": structured["grammar"]}
        choices = structured.get("choice")
        if given == {"choice"} and isinstance(choices, list) and all(isinstance(c, str) for c in choices):
            from vllm.v1.structured_output.utils import choice_as_grammar

            return {"kind": "grammar", "spec": choice_as_grammar(choices)}  # as vLLM's xgrammar backend has it
        return {"kind": "json_object", "spec": ""} if given == {"json_object"} else None
    return _NO_GRAMMAR


def _is_engine_dead(error: Any) -> bool:
    """vLLM's EngineDeadError as an OpenAI error object. Not any 5xx: a request's own failure (a
    grammar that fails to compile, a failed KV load) is a 500 too, and would fail or take out of
    rotation every instance it went on to."""
    return (isinstance(error, dict) and isinstance(error.get("code"), int) and error["code"] >= 500
            and str(error.get("message", "")).startswith(ENGINE_DEAD_MESSAGE))


def _is_set(value: Any) -> bool:
    """Set to something that matters (`logprobs: 0` does: the sampled token's own)."""
    return value is not None and value is not False and not (isinstance(value, list | str | dict) and not value)


@dataclasses.dataclass(eq=False)  # one per stream, hashed by identity: an instance holds a set of them
class StreamLedger:
    """A migratable stream's record: the events' common fields, the prompt's token ids, the
    tokens whose text the client has, and whether the stream has finished."""

    endpoint: str
    engine_body: dict[str, Any]
    """The body the first engine was sent (tenant salt included), asking for token ids."""
    max_model_len: int
    client_wants_token_ids: bool
    head: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None
    sent_token_ids: list[int] = dataclasses.field(default_factory=list)
    held_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Tokens the engine sent without their text yet (held back): not the client's."""
    finished: bool = False
    """A choice has its finish reason: what is left (usage, [DONE]) needs no engine."""
    engine_failure: str | None = None
    """vLLM's engine-dead error, sent mid-stream instead of the next tokens by an API server whose
    engine core died under it (e.g. a tensor-parallel rank): kept from the client, and the stream
    is broken, not done."""
    done: bool = False
    continued: bool = False
    sent_before_continuation: int = 0
    _buffer: bytes = b""

    @classmethod
    def start(cls, endpoint: str, body: dict[str, Any], max_model_len: int) -> StreamLedger:
        """The ledger of a stream about to be sent with `body`; the engine is asked for token ids."""
        engine_body = {**body, "return_token_ids": True}
        return cls(endpoint, engine_body, max_model_len, client_wants_token_ids=bool(body.get("return_token_ids")))

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The client's bytes for a piece of the engine's stream (events split anywhere). A piece
        is split once: an engine's read can hold a thousand events, and splitting one off at a
        time copied the rest each time."""
        *events, self._buffer = (self._buffer + data).split(b"\n\n")
        for raw in events:
            out = self._event(raw)
            if out is not None:
                yield out

    def _event(self, raw: bytes) -> bytes | None:
        if not raw.startswith(b"data: "):
            return raw + b"\n\n"
        payload = raw[len(b"data: "):]
        if payload.strip() == b"[DONE]":
            if self.engine_failure is not None:  # the end of a broken stream, not of the answer
                return None
            self.done = True
            return _DONE
        event = json.loads(payload)
        if "error" in event and not self.finished and _is_engine_dead(event["error"]):
            self.engine_failure = event["error"]["message"]
            return None
        if "error" in event or "choices" not in event:
            return raw + b"\n\n"
        if self.continued:
            event = self._as_first_stream(event)
        else:
            self.head = self.head or {k: event[k] for k in ("id", "object", "created", "model") if k in event}
            if event.get("prompt_token_ids") is not None:  # a chat's first event: beside the choices
                self.prompt_token_ids = event["prompt_token_ids"]
        for choice in event["choices"]:
            self._record(choice)
        if not self.client_wants_token_ids:
            event.pop("prompt_token_ids", None)
            for choice in event["choices"]:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
        if not event["choices"] and "usage" not in event:
            return None
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

    def _record(self, choice: dict[str, Any]) -> None:
        if choice.get("prompt_token_ids") is not None and not self.continued:
            self.prompt_token_ids = choice["prompt_token_ids"]
        text = choice.get("text") if self.endpoint == COMPLETIONS else (choice.get("delta") or {}).get("content")
        self.held_token_ids += choice.get("token_ids") or []
        if text:
            self.sent_token_ids += self.held_token_ids
            self.held_token_ids = []
        if choice.get("finish_reason") is not None:
            self.sent_token_ids += self.held_token_ids  # its text is all out now
            self.held_token_ids = []
            self.finished = True

    @property
    def stream_id(self) -> str | None:
        """The id the client sees on every event (the first stream's, continuations included);
        None before the first event."""
        return (self.head or {}).get("id")

    def can_continue(self) -> bool:
        return self.prompt_token_ids is not None and self.head is not None and not self.done

    def continuation(self) -> dict[str, Any]:
        """The completion that goes on from what the client has."""
        body = {k: v for k, v in self.engine_body.items()
                if k not in (*_CHAT_ONLY, *_STRUCTURED, "kv_transfer_params", "truncate_prompt_tokens")}
        grammar = continued_grammar(self.engine_body)
        if grammar:  # its state after the sent tokens: engine/grammar_continuation.py
            body["vllm_xargs"] = {GRAMMAR_ARG: json.dumps({**grammar, "sent": self.sent_token_ids})}
        body["prompt"] = [*self.prompt_token_ids, *self.sent_token_ids]
        body["max_tokens"] = self._limit() - len(self.sent_token_ids)
        if "min_tokens" in body:
            body["min_tokens"] = max(0, body["min_tokens"] - len(self.sent_token_ids))
        self.continued, self.held_token_ids, self._buffer, self.engine_failure = True, [], b"", None
        self.sent_before_continuation = len(self.sent_token_ids)
        return body

    def _limit(self) -> int:
        """The request's whole output limit, vLLM's defaults included: a completion's is 16, a
        chat's whatever the context leaves (the continuation is a completion: it must be told)."""
        limit = self.engine_body.get("max_completion_tokens") or self.engine_body.get("max_tokens")
        if limit is not None:
            return limit
        return DEFAULT_COMPLETION_TOKENS if self.endpoint == COMPLETIONS else self.max_model_len - len(self.prompt_token_ids)

    def _as_first_stream(self, event: dict[str, Any]) -> dict[str, Any]:
        """A continuation event (a completion's) in the first stream's shape."""
        event.pop("prompt_token_ids", None)
        choices = []
        for choice in event["choices"]:
            choice.pop("prompt_token_ids", None)
            if self.endpoint == CHAT:
                text = choice.pop("text", "")
                choice["delta"] = {"content": text} if text else {}
            choices.append(choice)
        usage = event.get("usage")
        if usage:  # the continuation's prompt held the tokens sent before it
            usage = {"prompt_tokens": usage["prompt_tokens"] - self.sent_before_continuation,
                     "completion_tokens": usage["completion_tokens"] + self.sent_before_continuation,
                     "total_tokens": usage["total_tokens"]}
        return {**event, **self.head, "choices": choices, **({"usage": usage} if usage else {})}

    def closing(self) -> bytes:
        """The end of a stream whose engine died after its last token: the usage it was owed and [DONE]."""
        usage = b""
        if (self.engine_body.get("stream_options") or {}).get("include_usage") and self.prompt_token_ids is not None:
            prompt, completion = len(self.prompt_token_ids), len(self.sent_token_ids)
            event = {**(self.head or {}), "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
            usage = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        self.done = True
        return usage + _DONE


async def without_stalls(chunks: AsyncIterator[bytes], stall_s: float) -> AsyncIterator[bytes]:
    """`chunks`, each within `stall_s` of the one before: an engine that stops sending mid-stream
    (hung, frozen, its node unreachable) breaks the stream as a dead one does (TimeoutError), and
    a migratable stream goes on elsewhere."""
    while True:
        try:
            chunk = await asyncio.wait_for(anext(chunks), stall_s)
        except StopAsyncIteration:
            return
        yield chunk
