"""The measuring client: one streamed OpenAI request, timed chunk by chunk.

TTFT is the time to the first content-bearing SSE event; inter-token latencies are the gaps
between later content events (one per token with vLLM's default streaming); errors are kept by
kind (HTTP status, timeout, broken stream) instead of raised.
"""

from __future__ import annotations

import dataclasses
import json
import time

import httpx


@dataclasses.dataclass
class RequestResult:
    started_at: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    error: str | None = None
    """None, or the kind of failure: "http_<status>", "timeout", "connection", "stream"."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:], strict=False)]

    def time_per_output_token_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _content(event: dict) -> str:
    """The text an SSE event adds (first choice)."""
    for choice in event.get("choices") or ():
        return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return ""


async def stream_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    """POST `body` (stream forced on, usage requested) to `url` and time its events."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(started_at=time.time())
    started = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"http_{response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = "stream"
                    break
                now = time.perf_counter() - started
                if piece := _content(event):
                    result.ttft_s = now if result.ttft_s is None else result.ttft_s
                    result.chunk_times_s.append(now)
                    result.text += piece
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                    result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
    except httpx.TimeoutException:
        result.error = "timeout"
    except httpx.TransportError:
        result.error = "connection"
    result.e2e_s = time.perf_counter() - started
    return result
