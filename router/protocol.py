"""The OpenAI request shapes the router accepts.

The router validates what it must understand (model, prompt or messages, the sampling limits a
typo would turn into a surprise) and passes every other field through to vLLM untouched, so
vLLM's own extensions (`ignore_eos`, `min_tokens`, `kv_transfer_params`...) keep working.
Types are strict: `"max_tokens": "8"` is an error, as it is at OpenAI.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

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

    def forwarded(self) -> dict[str, Any]:
        """The body sent to the engine: exactly what the client set, extras included."""
        return self.model_dump(exclude_unset=True)


TokenId = Annotated[int, Field(ge=0)]


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`."""

    prompt: str | list[TokenId] | list[str] | list[Annotated[list[TokenId], Field(min_length=1)]] = Field(
        min_length=1
    )
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
