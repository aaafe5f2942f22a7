"""The router's HTTP server: uvicorn's, accepting connections itself so that a stranger's costs the
event loop as little as it can.

asyncio accepts up to its `backlog` connections each time a listener is ready (uvicorn's 2,048:
one readiness queued seconds of set-ups ahead of every request in flight) and builds a transport,
uvicorn's protocol and a task for each before anything judges it. A flood of connections that
send half a request line and are reconnected as fast as the listener displaces them then costs
the loop ~100 us a connection (docs/benchmarks.md, issue #31). `GuardedServer` takes the
listener's readiness from asyncio and, per turn of the loop:

- accepts at most ACCEPTS_PER_TURN connections (the kernel still queues the config's `backlog`);
- keeps each one *bare*: the socket, in the listener's `ConnectionBook` as a pending connection,
  read into a buffer until a whole request head (headers and their blank line) is in, or answered
  431 past MAX_HEAD_BYTES. No
  transport, protocol or task is built for a connection that never sends one: a displaced or
  timed-out one is just closed. Its header deadline counts from its accept (checked every
  SWEEP_S);
- hands a connection whose head is in to uvicorn's protocol (transport/listener_guard.py), which
  parses the bytes read so far before any others.

The acceptor takes over a copy of each listening socket uvicorn bound and closes the loop's own
server. It runs on asyncio's loop (the router's; uvloop's resumes reading after a protocol is
made whatever the protocol asked, which the read-ahead head could upset). The listener must not
be TLS (the router's is not). `freeze_heap` keeps
the process's start-up heap out of every garbage collection from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import logging
import socket
import time
from collections.abc import Callable

import uvicorn

from transport.listener_guard import CLOSED, ConnectionBook, GuardedConnection, client_address

log = logging.getLogger(__name__)

ACCEPTS_PER_TURN = 16
"""Connections accepted each time a listener is ready: a turn of accepts costs a request in flight
at most this many set-ups (4 a turn measured the same as 16: docs/benchmarks.md)."""
SWEEP_S = 0.5
"""How often bare connections past their header deadline are closed."""
MAX_HEAD_BYTES = 16 * 1024
"""A request head longer than this is answered 431 and closed (Node's limit; nginx's default
buffers hold 4 x 8 KiB): what a stranger's pending connections can make the router hold. (A
client that sent more than was read may see a reset rather than the 431.)"""
TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
             b"content-length: 0\r\n\r\n")
ACCEPT_RETRY_S = 1.0
"""How long accepting pauses when the process is out of descriptors or memory (asyncio's own)."""
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class BareConnection:
    """An accepted socket that has not sent a whole request head: a pending connection in the
    listener's book, with no transport or protocol (a `HeadReadAhead` once its head is in)."""

    __slots__ = ("acceptor", "sock", "address", "accepted_at", "head", "head_starts", "transported")

    def __init__(self, acceptor: HeadFirstAcceptor, sock: socket.socket, address: str) -> None:
        self.acceptor, self.sock, self.address = acceptor, sock, address
        self.accepted_at, self.head = time.monotonic(), bytearray()
        self.head_starts: int | None = None
        """Where the request line begins: blank lines before it are skipped, as HTTP parsers do."""
        self.transported = False
        """Whether an asyncio transport owns the socket (it closes it from then on)."""

    def head_is_in(self, new_bytes: int) -> bool:
        """Whether the head's blank line is among the bytes read (the last `new_bytes` of them
        new). A bare-LF ending counts too: the parser refuses it at once."""
        if self.head_starts is None:
            blank = len(self.head) - len(self.head.lstrip(b"\r\n"))
            if blank == len(self.head):
                return False
            self.head_starts = blank
        start = max(self.head_starts, len(self.head) - new_bytes - 3)
        return self.head.find(b"\r\n\r\n", start) >= 0 or self.head.find(b"\n\n", start) >= 0

    def close(self, reason: str) -> None:
        """Closed by the book (displaced) or a deadline."""
        CLOSED.labels(self.acceptor.book.name, reason).inc()
        self.acceptor.drop(self)


class HeadFirstAcceptor:
    """Accepting on one listening socket, in the place of asyncio's: connections kept bare until
    their first request head is in, then made uvicorn's."""

    def __init__(self, listener: socket.socket, protocol_factory: Callable[[], GuardedConnection],
                 book: ConnectionBook) -> None:
        self.listener, self.protocol_factory, self.book = listener, protocol_factory, book
        self.loop = asyncio.get_running_loop()
        self.bare: dict[BareConnection, None] = {}  # oldest first: their deadlines in order
        self._sweeping: asyncio.TimerHandle | None = None
        self._handing_over: set[asyncio.Task] = set()

    def start(self) -> None:
        self.listener.setblocking(False)
        self.loop.add_reader(self.listener.fileno(), self._accept)
        self._sweeping = self.loop.call_later(SWEEP_S, self._sweep)

    def close(self) -> None:
        """The listener and every bare connection closed; no more sweeps."""
        if self._sweeping is not None:
            self._sweeping.cancel()
        if self.listener.fileno() != -1:
            self.loop.remove_reader(self.listener.fileno())
            self.listener.close()
        for bare in list(self.bare):
            self.drop(bare)

    def drop(self, bare: BareConnection) -> None:
        if bare in self.bare:
            self._unwatch(bare)
            self.book.release(bare)
            bare.sock.close()

    def _unwatch(self, bare: BareConnection) -> None:
        """`bare` no longer read nor timed here."""
        del self.bare[bare]
        self.loop.remove_reader(bare.sock.fileno())

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as error:
                if error.errno not in OUT_OF_RESOURCES:
                    raise  # asyncio's loop logs it; the reader stays
                log.warning("%s: accepting paused %.0f s: %s", self.book.name, ACCEPT_RETRY_S, error)
                self.loop.remove_reader(self.listener.fileno())
                self.loop.call_later(ACCEPT_RETRY_S, self._resume)
                return
            sock.setblocking(False)
            bare = BareConnection(self, sock, client_address(peer))
            if not self.book.admit(bare, bare.address):
                sock.close()
                continue
            self.bare[bare] = None
            self.loop.add_reader(sock.fileno(), self._read, bare)

    def _resume(self) -> None:
        if self.listener.fileno() != -1:  # not closed meanwhile
            self.loop.add_reader(self.listener.fileno(), self._accept)

    def _read(self, bare: BareConnection) -> None:
        try:
            data = bare.sock.recv(MAX_HEAD_BYTES - len(bare.head))  # the rest is the transport's
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset) before its head was in
            self.drop(bare)
            return
        bare.head += data
        if bare.head_is_in(len(data)):
            self._hand_over(bare)
        elif len(bare.head) >= MAX_HEAD_BYTES:
            with contextlib.suppress(OSError):
                bare.sock.send(TOO_LARGE)
            bare.close("head_too_large")

    def _hand_over(self, bare: BareConnection) -> None:
        """`bare` to uvicorn's protocol, which takes its place in the book once it is connected."""
        self._unwatch(bare)
        task = self.loop.create_task(self._connect(bare))
        self._handing_over.add(task)
        task.add_done_callback(functools.partial(self._handed_over, bare))

    async def _connect(self, bare: BareConnection) -> None:
        protocol = self.protocol_factory()
        protocol.handed_over = bare
        # asyncio makes the transport before its first wait: from here on a failure or a
        # cancellation closes the transport, and the socket with it
        bare.transported = True
        await self.loop.connect_accepted_socket(lambda: protocol, bare.sock)

    def _handed_over(self, bare: BareConnection, task: asyncio.Task) -> None:
        self._handing_over.discard(task)
        if task.cancelled() or task.exception() is not None:
            self.book.release(bare)  # a no-op where the protocol took its place
            if not bare.transported:
                bare.sock.close()
            if not task.cancelled():
                log.warning("%s: a connection not handed over: %r", self.book.name, task.exception())

    async def finish_handing_over(self) -> None:
        """Wait until every connection being handed over is its protocol's (or closed)."""
        await asyncio.gather(*self._handing_over, return_exceptions=True)

    def _sweep(self) -> None:
        try:
            expired = time.monotonic() - self.book.limits.header_timeout_s
            for bare in list(self.bare):
                if bare.accepted_at > expired:
                    break
                bare.close("header_timeout")
        finally:
            self._sweeping = self.loop.call_later(SWEEP_S, self._sweep)


class GuardedServer(uvicorn.Server):
    """uvicorn's server whose listeners accept through a `HeadFirstAcceptor` each, their kernel
    queue kept at the config's `backlog`, and (`freeze_heap`) whose process's start-up heap is
    kept out of every garbage collection from then on. The config's `http` is a class that
    `guarded_protocol` made without TLS. `started` is true once all of that is done."""

    _guarded = False

    def __init__(self, config: uvicorn.Config, freeze_heap: bool = True) -> None:
        protocol = config.http
        if not (isinstance(protocol, type) and issubclass(protocol, GuardedConnection)) or protocol.tls is not None \
                or config.ssl_certfile is not None or config.uds is not None or config.fd is not None:
            raise ValueError("GuardedServer serves a guarded_protocol class without TLS as its `http`, on a host "
                             "and port")
        super().__init__(config)
        self.freeze_heap = freeze_heap
        self.acceptors: list[HeadFirstAcceptor] = []

    @property
    def started(self) -> bool:
        return self._started and self._guarded

    @started.setter
    def started(self, value: bool) -> None:  # set by uvicorn
        self._started = value

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if not isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop):
            raise RuntimeError("GuardedServer runs on asyncio's own event loop (uvicorn's loop='asyncio')")
        await super().startup(sockets)
        config = self.config
        # the protocol as uvicorn's startup makes it for the loop's accepts, which ours replace
        protocol_factory = functools.partial(config.http_protocol_class, config=config,
                                             server_state=self.server_state, app_state=self.lifespan.state)
        try:
            for server in self.servers:
                # proto too: asyncio sets TCP_NODELAY only on sockets whose proto says TCP
                listeners = [socket.fromfd(s.fileno(), s.family, s.type, s.proto) for s in server.sockets]
                server.close()  # the loop's accepts stop; each listening socket lives on in its copy
                for listener in listeners:
                    acceptor = HeadFirstAcceptor(listener, protocol_factory, config.http.book)
                    acceptor.start()
                    self.acceptors.append(acceptor)
            if self.freeze_heap:
                # What start-up built lives as long as the process (as vLLM's server does,
                # freeze_gc_heap): a full collection walked the router's ~400,000 such objects, ~0.25 s
                # with the loop stopped, and a stranger's connections make full collections frequent
                # (docs/benchmarks.md). The price: start-up objects that become garbage stay.
                gc.collect()
                gc.freeze()
        finally:
            self._guarded = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in self.acceptors:
            acceptor.close()
        # a connection still being handed over is uvicorn's before uvicorn tells each to stop
        await asyncio.gather(*(acceptor.finish_handing_over() for acceptor in self.acceptors))
        await super().shutdown(sockets)
