"""HTTP listeners that a stranger cannot exhaust: bounded connections, each with deadlines.

uvicorn (the router's server, and vLLM's inside every engine) accepts every connection and keeps
it until the client closes it: no deadline for a request's headers, none for its body, no cap on
connections. 20,000 connections sending half a request line each held the router at its file
descriptor limit, and every tenant's request timed out for as long as they stayed
(docs/security.md, attack 11.4). `guarded_protocol` is uvicorn's httptools protocol with:

- a `ConnectionBook` per listener: at most `max_connections` in all, `max_per_address` from one
  client address and `max_pending` still *pending* (nothing proven yet: no complete request, or
  for an engine no request carrying its token). A connection that would pass a cap takes the
  place of the oldest pending one (of its address, for that cap), which is closed; with none
  pending it is refused. So a flood of idle connections displaces only itself, never a
  connection that is serving, and holds at most `max_pending` of the process's memory;
- deadlines: a request's headers within `header_timeout_s` of its first byte (or of the
  connection), its body within `body_timeout_s` of its headers, a TLS handshake within
  `tls_handshake_timeout_s`; past one the connection is closed;
- TLS, when given a context, done by the protocol itself (`loop.start_tls`) after the book admitted
  the connection, so a connection is counted and timed from its accept, not from a handshake a
  stranger may never finish.

uvicorn takes the class as its `http` setting (`uvicorn.Config(http=...)`). Counters of refused
and closed connections are Prometheus metrics of the process.

The router's server (transport/guarded_server.py) also keeps a connection bare, out of
this protocol, until its first request head is in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import ssl
from collections.abc import Callable
from typing import Protocol

from prometheus_client import Counter, Gauge
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)
FD_RESERVE = 1024
"""Descriptors a process keeps for everything but its listener's connections (files, its own
clients, the engines it calls)."""

CONNECTIONS = Gauge("pdcluster_listener_connections", "Open connections of this listener", ["listener"])
CLOSED = Counter("pdcluster_listener_connections_closed", "Connections this listener closed or refused, by why",
                 ["listener", "reason"])


@dataclasses.dataclass(frozen=True)
class ListenerLimits:
    """How many connections a listener holds and how long each may take to prove itself."""

    max_connections: int = 16384
    """In all; lowered to fit this process's descriptor limit (`fitted`)."""
    max_per_address: int = 1024
    """From one client address (raise it behind a balancer whose address every client shares)."""
    max_pending: int = 1024
    """Connections that have proven nothing yet. Each with a protocol costs ~30 objects that every
    full garbage collection walks with the loop stopped: 16,384 idle ones made those walks 0.3-1 s
    (the router's keep none until their request head is in: transport/guarded_server.py)."""
    header_timeout_s: float = 10.0
    """From a request's first byte (or the connection's accept) to its last header."""
    body_timeout_s: float = 60.0
    """From a request's headers to its last body byte."""
    tls_handshake_timeout_s: float = 5.0

    @classmethod
    def for_engine(cls) -> ListenerLimits:
        """An engine's: no cap per address. Its callers are a few routers and its host, each
        keeping many connections from one address, and on one node every local user shares
        127.0.0.1 with them: a stranger's connections are told apart by never proving
        themselves (no token), and those are displaced first. No cap on pending ones below the
        total: a caller's connection is pending through its TLS handshake too, which a smaller
        pool's turnover under a flood could cut short."""
        limits = cls()
        return dataclasses.replace(limits, max_per_address=limits.max_connections, max_pending=limits.max_connections)

    def fitted(self) -> ListenerLimits:
        """These limits with `max_connections` under this process's descriptor limit, the soft
        limit first raised to the hard one (a stranger's connections cost the process
        descriptors; Linux's default soft limit of 1024 would be reached first)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        room = max(64, soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else self.max_connections
        return dataclasses.replace(self, max_connections=min(self.max_connections, room),
                                   max_per_address=min(self.max_per_address, room),
                                   max_pending=min(self.max_pending, room))


class ConnectionBook:
    """The connections of one listener: how many, from where, and which are still pending, oldest
    first. Used on the listener's event loop only."""

    def __init__(self, limits: ListenerLimits, name: str) -> None:
        self.limits, self.name = limits, name
        self.open: dict[GuardedConnection, str] = {}
        self.per_address: dict[str, int] = {}
        self._pending: dict[GuardedConnection, None] = {}  # insertion order: oldest first
        self._pending_by_address: dict[str, dict[GuardedConnection, None]] = {}

    def admit(self, connection: GuardedConnection, address: str) -> bool:
        """Whether `connection` may stay; at a cap, the oldest pending connection (of its address,
        for the address's cap) is closed to make room, if there is one."""
        caps = ((lambda: self.per_address.get(address, 0) >= self.limits.max_per_address,
                 lambda: self._pending_by_address.get(address, {})),
                (lambda: len(self._pending) >= self.limits.max_pending, lambda: self._pending),
                (lambda: len(self.open) >= self.limits.max_connections, lambda: self._pending))
        for crowded, pending in caps:  # each judged after the displacement the one before made
            if not crowded():
                continue
            pool = pending()
            if not pool:
                CLOSED.labels(self.name, "refused").inc()
                return False
            victim = next(iter(pool))
            self.release(victim)
            victim.close("displaced")
        self.open[connection] = address
        self.per_address[address] = self.per_address.get(address, 0) + 1
        self._pending[connection] = None
        self._pending_by_address.setdefault(address, {})[connection] = None
        CONNECTIONS.labels(self.name).set(len(self.open))
        return True

    def proven(self, connection: GuardedConnection) -> None:
        """`connection` is serving: never displaced from now on."""
        address = self.open.get(connection)
        if address is not None:
            self._unpend(connection, address)

    def release(self, connection: GuardedConnection) -> None:
        address = self.open.pop(connection, None)
        if address is None:
            return
        self._unpend(connection, address)
        self.per_address[address] -= 1
        if not self.per_address[address]:
            del self.per_address[address]
        CONNECTIONS.labels(self.name).set(len(self.open))

    def _unpend(self, connection: GuardedConnection, address: str) -> None:
        """`connection` out of the pending pools (its address's dropped once empty)."""
        self._pending.pop(connection, None)
        pending_here = self._pending_by_address.get(address)
        if pending_here is not None:
            pending_here.pop(connection, None)
            if not pending_here:
                del self._pending_by_address[address]


def client_address(peer: object) -> str:
    """The client's address, as a book counts connections by it, from a socket's peer name."""
    return peer[0] if isinstance(peer, tuple) else str(peer)


class HeadReadAhead(Protocol):
    """A connection booked, and its first request head read, before its protocol was made."""

    address: str
    head: bytearray


class GuardedConnection(HttpToolsProtocol):
    """uvicorn's httptools protocol under a `ConnectionBook` and deadlines (the class that
    `guarded_protocol` makes binds `book`, `tls` and `proves`)."""

    book: ConnectionBook
    tls: ssl.SSLContext | None = None
    proves: Callable[[list[tuple[bytes, bytes]]], bool] = staticmethod(lambda headers: True)
    """Whether a request's headers prove the connection is a client's (an engine: its token)."""
    handed_over: HeadReadAhead | None = None
    """The connection as it was booked before this protocol was made (transport/guarded_server.py
    reads a request head on the bare socket): this protocol takes its place in the book and parses
    its head as soon as the connection is made."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._raw, self._early = transport, []
        handed_over, self.handed_over = self.handed_over, None
        if handed_over is not None:
            if handed_over not in self.book.open:  # displaced while it was being handed over
                self._admitted = False
                transport.abort()
                return
            self.book.release(handed_over)  # its place, taken at once below
            address = handed_over.address
        else:
            address = client_address(transport.get_extra_info("peername"))
        if not self.book.admit(self, address):
            self._admitted = False
            transport.abort()
            return
        self._admitted = True
        self._limit(self.book.limits.header_timeout_s, "header_timeout")
        if self.tls is None:
            super().connection_made(transport)
            if handed_over is not None:
                self.data_received(bytes(handed_over.head))
        else:
            self._handshake = self.loop.create_task(self._secure(transport, self._start_tls_now(transport)))

    async def _secure(self, transport: asyncio.Transport, handshake) -> None:
        try:
            secured = await handshake
        except (TimeoutError, OSError, ssl.SSLError, ConnectionError):
            if self._admitted:  # not closed by a deadline or displaced: the handshake failed
                CLOSED.labels(self.book.name, "tls_handshake").inc()
            self._forget()
            transport.abort()
            return
        if secured is None or secured.is_closing() or not self._admitted:
            self._forget()
            transport.abort()
            return
        super().connection_made(secured)
        early, self._early = self._early, []
        for data in early:
            super().data_received(data)

    def _start_tls_now(self, transport: asyncio.Transport):
        """`loop.start_tls` begun now, in connection_made: it puts its TLS protocol in this one's
        place before it first waits, and run later (as a task) it would come too late under
        uvloop, which starts reading right after connection_made and ignores a pause asked before:
        the client's first TLS bytes would reach this protocol instead. Returns an awaitable of
        the secured transport."""
        starting = self.loop.start_tls(transport, self, self.tls, server_side=True,
                                       ssl_handshake_timeout=self.book.limits.tls_handshake_timeout_s)
        try:
            waiting = starting.send(None)
        except StopIteration as done:
            return _ready(done.value)
        return _resumed(starting, waiting)

    def _limit(self, seconds: float, reason: str) -> None:
        self._unlimit()
        self._deadline = self.loop.call_later(seconds, self.close, reason)

    def _unlimit(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def close(self, reason: str) -> None:
        """Close the connection now (a deadline passed, or it was displaced)."""
        CLOSED.labels(self.book.name, reason).inc()
        if self.transport is None:  # before uvicorn's part (a TLS handshake): it never ends it
            self._forget()
        self._raw.abort()

    def _forget(self) -> None:
        """Out of the book, its deadline off (once)."""
        if getattr(self, "_admitted", False):
            self._admitted = False
            self._unlimit()
            self.book.release(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        if self.transport is not None:  # uvicorn's part began (after TLS, when TLS is on)
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:  # decrypted before start_tls returned: parsed once it has
            self._early.append(data)
            return
        if self._deadline is None and self.cycle is not None and self.cycle.response_complete:
            # the next request on a kept-alive connection: its headers have a deadline too
            self._limit(self.book.limits.header_timeout_s, "header_timeout")
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._unlimit()
        if self.proves(self.headers):
            self.book.proven(self)
        super().on_headers_complete()
        if not self.parser.should_upgrade() and self.cycle is not None and self.cycle.more_body:
            self._limit(self.book.limits.body_timeout_s, "body_timeout")

    def on_message_complete(self) -> None:
        self._unlimit()
        super().on_message_complete()


async def _ready(value):
    return value


async def _resumed(coroutine, waiting):
    """Run `coroutine` on from the future it waits on (`waiting`) to its end."""
    try:
        while True:
            await asyncio.wait({waiting})
            try:
                waiting = coroutine.send(None)
            except StopIteration as done:
                return done.value
    finally:
        coroutine.close()


def guarded_protocol(name: str, limits: ListenerLimits = ListenerLimits(), tls: ssl.SSLContext | None = None,
                     proves: Callable[[list[tuple[bytes, bytes]]], bool] | None = None) -> type[GuardedConnection]:
    """The protocol class for one listener (uvicorn's `http` setting), its book's metrics labelled
    `name`. `tls`: a server context the protocol handshakes with itself."""
    attributes = {"book": ConnectionBook(limits.fitted(), name), "tls": tls}
    if proves is not None:
        attributes["proves"] = staticmethod(proves)
    return type(f"GuardedConnection[{name}]", (GuardedConnection,), attributes)
