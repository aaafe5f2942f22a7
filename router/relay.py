"""An engine's answer stream relayed to the client, and moved on when the engine breaks.

`StreamRelay.plain` relays a stream as it comes; `StreamRelay.migrating` relays it through its
ledger (decode/stream_ledger.py) and, when the engine's stream breaks, continues it on another
instance from the tokens already sent, at most `max_migrations` times. That instance is chosen by
the router's own placement step and policy, as a new request with the stream's prompt would be
(the caller's `continue_on`). A stream that cannot go on ends with an OpenAI error event and `[DONE]`, so a
client never hangs; a client that leaves closes the engine's stream, which makes vLLM abort it.
What a stream holds on an instance (its request, its place in the instance's streams) is booked
with the fleet's registry and given back however the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import aiohttp

from decode.stream_ledger import StreamLedger, without_stalls
from fleet.instances import Instance, InstanceRegistry
from router import metrics
from router.errors import stream_error_event
from router.tracing import EngineCall, instance_attributes

log = logging.getLogger(__name__)

Moved = tuple[Instance, aiohttp.ClientResponse, bytes, AsyncIterator[bytes]]
"""Where a stream went on: the instance, its response, its first bytes, the rest."""


class StreamRelay:
    def __init__(self, registry: InstanceRegistry, session: Callable[[], aiohttp.ClientSession], stall_s: float,
                 max_migrations: int) -> None:
        self.registry, self.session = registry, session
        self.stall_s, self.max_migrations = stall_s, max_migrations

    async def plain(self, instance: Instance, endpoint: str, upstream: aiohttp.ClientResponse, first: bytes,
                    chunks: AsyncIterator[bytes], ended: Callable[[int], None]) -> AsyncIterator[bytes]:
        """The stream as it comes; `ended(status)` once it is over (200, or 502: it broke)."""
        status, finished = 200, False
        try:
            yield first
            async for chunk in chunks:
                yield chunk
            finished = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            status = 502
            log.warning("stream from %s broke: %r", instance.instance_id, exc)
            yield stream_error_event(f"the engine's stream broke: {exc!r}")
        finally:
            # A stream left early (client gone) is closed, not released: dropping the connection
            # makes vLLM abort the request.
            (upstream.release if finished else upstream.close)()
            self.registry.request_ended(instance)
            ended(status)

    async def migrating(self, instance: Instance, endpoint: str, upstream: aiohttp.ClientResponse, first: bytes,
                        chunks: AsyncIterator[bytes], ledger: StreamLedger, others: Callable[[], list[Instance]],
                        call: EngineCall | None, ended: Callable[[int, int], None],
                        continue_on: Callable[[list[Instance]], Instance]) -> AsyncIterator[bytes]:
        """`plain`'s job for a migratable stream, going on elsewhere when its engine's stream
        breaks: on the one of `others()` that `continue_on` picks (the placement step's choice for
        the stream's request); `ended(status, migrations)` once it is over."""
        status, migrations = 200, 0
        current: Instance | None = instance

        def let_go(broken: bool) -> None:
            """Done with this engine's stream: dropped if broken (vLLM then aborts), else pooled."""
            nonlocal current
            (upstream.close if broken else upstream.release)()
            self.registry.relayed(current, ledger)
            self.registry.request_ended(current)
            current = None

        self.registry.relays(instance, ledger)  # here, not before: a relay that never starts never leaves
        try:
            while True:
                broke = yield_error = None
                try:
                    for out in ledger.feed(first):
                        yield out
                    async for chunk in chunks:
                        for out in ledger.feed(chunk):
                            yield out
                    broke = None if ledger.done else (ledger.engine_failure or "the engine's stream ended without [DONE]")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    broke = None if ledger.done else repr(exc)  # after [DONE] nothing is missing
                except ValueError as exc:  # not an event stream: nothing to go on from
                    yield_error = f"the engine sent a malformed event: {exc}"
                if yield_error is not None or broke is None:
                    let_go(broken=yield_error is not None)
                    if yield_error is not None:
                        status = 502
                        yield stream_error_event(yield_error)
                    return
                self.registry.mark_failed(current, f"its stream broke: {broke}")
                let_go(broken=True)
                if ledger.finished:  # only the usage and [DONE] were missing
                    yield ledger.closing()
                    return
                moved = None
                if migrations < self.max_migrations and ledger.can_continue():
                    migrations += 1
                    moved = await self._continue_elsewhere(endpoint, ledger, others, continue_on, broke, call)
                if moved is None:
                    status = 502
                    yield stream_error_event(f"the engine's stream broke: {broke}")
                    return
                current, upstream, first, chunks = moved
                self.registry.relays(current, ledger)
        finally:
            if current is not None:  # the client left mid-stream
                let_go(broken=True)
            ended(status, migrations)

    async def _continue_elsewhere(self, endpoint: str, ledger: StreamLedger, others: Callable[[], list[Instance]],
                                  continue_on: Callable[[list[Instance]], Instance], broke: str,
                                  call: EngineCall | None) -> Moved | None:
        """The continuation of `ledger`'s stream on another instance (the placement step's choice),
        up to its first bytes; None if there is none or it failed too. Whatever ends it early (the
        client leaving cancels it) leaves the instance's books and connection as they were."""
        candidates = others()
        if not candidates:
            return None
        instance = continue_on(candidates)
        body = ledger.continuation()
        log.warning("stream of %s broke (%s): continuing on %s after %d tokens", endpoint, broke,
                    instance.instance_id, len(body["prompt"]) - len(ledger.prompt_token_ids))
        metrics.MIGRATIONS.inc()
        if call:  # the continuation's engine span joins the same decode_stream span
            call.span.add_event("pdcluster.migrated", instance_attributes(instance))
        self.registry.request_started(instance)
        upstream, moved = None, None
        try:
            upstream = await self.session().post(f"{instance.url}/v1/completions", json=body,
                                                 **instance.request_options(call.headers if call else None))
            if upstream.status != 200:
                text = (await upstream.read()).decode(errors="replace")[:500]
                log.warning("instance %s refused a continued stream: HTTP %d %s", instance.instance_id,
                            upstream.status, text)
                if upstream.status >= 500 and upstream.status != 503:
                    self.registry.mark_failed(instance, f"failed a continued stream: HTTP {upstream.status}")
                return None
            chunks = upstream.content.iter_any()
            moved = instance, upstream, await chunks.__anext__(), without_stalls(chunks, self.stall_s)
            return moved
        except (aiohttp.ClientError, TimeoutError, StopAsyncIteration) as exc:
            self.registry.mark_failed(instance, f"failed a continued stream: {exc!r}")
            return None
        finally:
            if moved is None:
                if upstream is not None:
                    upstream.close()
                self.registry.request_ended(instance)
