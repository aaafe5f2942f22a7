"""The measuring client: one streamed OpenAI request, timed chunk by chunk.

TTFT is the time to the first token event; inter-token latencies are the gaps between later
token events (one per token with vLLM's default streaming). A token event is a streamed choice
that carries generated text, even an empty piece (a token that ends mid-character), but not the
chat role announcement or the closing event with only a finish reason: the same events `vllm
bench serve` times. Errors are kept by kind (HTTP status, timeout, broken stream), not raised.

aiohttp, as in `vllm bench serve`: a client's own per-event cost shows up in what it measures,
and on a small machine it shares cores with the server. With httpx (pure-Python HTTP parsing)
the cross-check read 29% less throughput and twice the median TTFT that vllm bench read.
"""

from __future__ import annotations

import dataclasses
import json
import time

import aiohttp


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
    response_id: str | None = None
    """The id on the stream's events (the router's GET /admin/instances lists the streams each
    instance serves by it)."""
    turn: int | None = None
    """Its place in a session's turns (0: the first); None: a request of no session."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def inter_token_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:], strict=False)]

    def time_per_output_token_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def _token_text(event: dict) -> str | None:
    """The text a token event adds (first choice), or None if the event carries no token."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        text = choice.get("text") if delta is None else (None if "role" in delta else delta.get("content"))
        if text is None or (not text and choice.get("finish_reason")):
            return None
        return text
    return None


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict,
                         result: RequestResult | None = None, headers: dict[str, str] | None = None) -> RequestResult:
    """POST `body` (stream forced on, usage requested) to `url` and time its events, into
    `result` if given (a caller can watch a stream's progress there); `headers`: a tenant's key."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = result or RequestResult(started_at=time.time())
    result.started_at = time.time()
    started = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                result.error = f"http_{response.status}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = "stream"
                    break
                if result.response_id is None:
                    result.response_id = event.get("id")
                now = time.perf_counter() - started
                piece = _token_text(event)
                if piece is not None:
                    result.ttft_s = now if result.ttft_s is None else result.ttft_s
                    result.chunk_times_s.append(now)
                    result.text += piece
                if event.get("usage"):
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                    result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError:
        result.error = "connection"
    result.e2e_s = time.perf_counter() - started
    return result
