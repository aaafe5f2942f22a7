"""Work repeated in the background: a step every few seconds that one failure does not end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


def every(interval_s: float, step: Callable[[], Awaitable[object]], name: str) -> asyncio.Task[None]:
    """A task that awaits `step()` every `interval_s` until cancelled; a step that fails is logged
    and the next one runs on time."""

    async def repeat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except Exception:
                log.exception("%s failed; trying again in %g s", name, interval_s)

    return asyncio.create_task(repeat(), name=name)
