"""The OpenAI request shapes the router accepts.

The router validates what it must understand (model, prompt or messages, the sampling limits a
typo would turn into a surprise) and passes on, untouched, the other OpenAI fields and the vLLM
sampling extensions a client may use (`ignore_eos`, `min_tokens`, `top_k`, structured outputs...),
an allowlist. Fields that steer the cluster itself are refused, never forwarded: KV transfer
parameters (a client could make a decode engine pull or pin blocks it names), request ids and
priorities, logits processors, and client chat templates (a template is code the router and the
engine would run); the fields only the cluster sets are refused at any depth of a request (inside
`metadata` or a tool's arguments too). JSON schemas are checked before an engine compiles them
(router/schemas.py). Types are strict: `"max_tokens": "8"` is an error, as it is at OpenAI.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.environment import GRAMMAR_ARG
from router.schemas import check_refs, request_schemas

# Fields a client may set beyond the ones declared below, passed to vLLM as they are.
PASSED_THROUGH = frozenset({
    "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p", "repetition_penalty",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
    "bad_words", "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids", "response_format",
    "structured_outputs", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "chat_template_kwargs", "cache_salt", "suffix", "echo",
    "reasoning_effort", "documents", "metadata", "store", "service_tier",
})
# Fields that steer the cluster or run code: refused with a 400 naming the field.
REFUSED = {
    "kv_transfer_params": "KV transfer parameters are the router's to set",
    "chat_template": "client chat templates are not accepted; the model's own is used",
    "request_id": "request ids are assigned by the server",
    "priority": "scheduling priorities are not a client's to set",
    "logits_processors": "logits processors are not accepted",
    "vllm_xargs": "vllm_xargs are not accepted",
    "mm_processor_kwargs": "multimodal processor options are not accepted",
}
# Keys only the cluster sets, refused wherever they appear in a request's passed-through fields:
# no engine reads them below the top level today, and none ever should from a client.
INTERNAL_KEYS = frozenset({"kv_transfer_params", "vllm_xargs", GRAMMAR_ARG})
# OpenAI's `metadata`: at most 16 pairs of text, keys of 64 characters, values of 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# chat_template_kwargs: a few scalar options for the model's own template (e.g. enable_thinking),
# never a parameter of the rendering itself (`chat_template` there would run a client's template).
MAX_TEMPLATE_OPTIONS, MAX_TEMPLATE_OPTION_CHARS = 8, 256
RENDERING_PARAMETERS = frozenset({
    "chat_template", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# Content parts of a message: text only (pdcluster serves text models; an image_url part would
# make an engine fetch a URL of the client's choosing).
MESSAGE_FIELDS = frozenset({"name", "tool_calls", "tool_call_id"})
MAX_STRUCTURE_BYTES = 64 * 1024  # response_format, structured_outputs, tools: compiled by the engine

StopSequences = Annotated[str, Field(max_length=1024)] | list[Annotated[str, Field(max_length=1024)]]


class SamplingRequest(BaseModel):
    """Fields common to both endpoints."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stop: StopSequences | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _allowed_extras(self) -> SamplingRequest:
        for name in self.model_extra or {}:
            if name in REFUSED:
                raise ValueError(f"{name}: {REFUSED[name]}")
            if name not in PASSED_THROUGH:
                raise ValueError(f"{name}: unsupported field")
        extra = self.model_extra or {}
        options = extra.get("chat_template_kwargs")
        if options is not None and not (
            isinstance(options, dict) and len(options) <= MAX_TEMPLATE_OPTIONS
            and not RENDERING_PARAMETERS & options.keys()
            and all(isinstance(v, bool | int | float) or (isinstance(v, str) and len(v) <= MAX_TEMPLATE_OPTION_CHARS)
                    for v in options.values())
        ):
            raise ValueError(f"chat_template_kwargs: at most {MAX_TEMPLATE_OPTIONS} scalar options for the "
                             "model's template, none of its rendering's parameters")
        for name in ("response_format", "structured_outputs", "tools", "tool_choice", "logit_bias", "bad_words"):
            if name in extra and len(json.dumps(extra[name])) > MAX_STRUCTURE_BYTES:
                raise ValueError(f"{name}: larger than {MAX_STRUCTURE_BYTES} bytes")
        _check_metadata(extra.get("metadata"))
        for name, value in extra.items():
            _refuse_internal_keys(name, value)
        for field, schema in request_schemas(extra):
            check_refs(field, schema)
        return self

    def forwarded(self) -> dict[str, Any]:
        """The body sent to the engine: exactly what the client set."""
        return self.model_dump(exclude_unset=True)

    def sequences(self) -> int:
        """How many sequences the request asks the engines for (prompts x n)."""
        return self.n

    def template_options(self) -> dict[str, Any]:
        """The chat-template options a client may set (a chat's rendering depends on them), and
        the tools, which a tool-calling template renders into the prompt."""
        extra = self.model_extra or {}
        options = {k: extra[k] for k in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
                   if k in extra}
        if "tools" in extra:
            options["tools"] = extra["tools"]
        return options



def _check_metadata(metadata: Any) -> None:
    if metadata is not None and not (
        isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_PAIRS
        and all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY_CHARS and isinstance(v, str)
                and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items())
    ):
        raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} text pairs (keys of {MAX_METADATA_KEY_CHARS} "
                         f"characters at most, values of {MAX_METADATA_VALUE_CHARS})")


def _refuse_internal_keys(field: str, value: Any) -> None:
    """Raise if an INTERNAL_KEYS key appears anywhere in `value` (iteratively: depth is the client's)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            internal = INTERNAL_KEYS & item.keys()
            if internal:
                raise ValueError(f"{field}: {sorted(internal)[0]} is the cluster's to set")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`."""

    prompt: str | list[TokenId] | list[str] | list[Annotated[list[TokenId], Field(min_length=1)]] = Field(
        min_length=1
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    def sequences(self) -> int:
        prompts = len(self.prompt) if isinstance(self.prompt, list) and not isinstance(self.prompt[0], int) else 1
        return prompts * self.n


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    @model_validator(mode="after")
    def _known_fields(self) -> ChatMessage:
        unknown = (self.model_extra or {}).keys() - MESSAGE_FIELDS
        if unknown:
            raise ValueError(f"messages: unsupported field {sorted(unknown)[0]}")
        return self


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
