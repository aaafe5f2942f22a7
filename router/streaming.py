"""An engine's answer streamed to the client, with the clean-up that must run however the client
leaves.

Starlette streams a body beside a watch for the client's disconnect. A client already gone when
the response starts (its timeout shorter than the time to first token) cancels it at its first
write that waits, before the body's generator ever started, so that generator's own `finally`
never runs: the
engine's connection stays open, the instance counts a request it does not serve (a drain then
waits its whole deadline), and the admission slot is never given back (with the cluster's
ledger, a key shut out on every router). `on_abandon` callbacks run then, and only then.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse


class EngineStream(StreamingResponse):
    def __init__(self, body: AsyncIterator[bytes], abandon: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.on_abandon: list[Callable[[], None]] = [abandon]

    async def __call__(self, scope, receive, send) -> None:
        started = False
        body = self.body_iterator

        async def tracked() -> AsyncIterator[bytes]:
            nonlocal started
            started = True
            async for chunk in body:
                yield chunk

        self.body_iterator = tracked()
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not started:
                for callback in self.on_abandon:
                    callback()
