"""The guarded listener (transport/listener_guard.py): at a cap a newcomer displaces the oldest
connection that has proven nothing, never a proven one; with none pending it is refused. The
router's server (transport/guarded_server.py): accepting a flood of connections never crowds out
a request in flight, and a connection costs no protocol until its request head is in."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import time

import pytest
import uvicorn
import uvicorn.server
from waiting import until

from engine.environment import free_port
from transport.guarded_server import ACCEPTS_PER_TURN, MAX_HEAD_BYTES, SWEEP_S, BareConnection, GuardedServer
from transport.listener_guard import ConnectionBook, ListenerLimits, guarded_protocol


class Connection:
    """A connection as the book sees it (named so: no socket)."""

    def __init__(self, name: str) -> None:
        self.name, self.closed = name, None

    def close(self, reason: str) -> None:
        self.closed = reason


def test_a_newcomer_displaces_the_oldest_pending_connection_never_a_proven_one():
    book = ConnectionBook(ListenerLimits(max_connections=3, max_per_address=3), "test")
    old, proven, young = Connection("old"), Connection("proven"), Connection("young")
    for connection in (old, proven, young):
        assert book.admit(connection, "10.0.0.1")
    book.proven(proven)
    newcomer = Connection("new")
    assert book.admit(newcomer, "10.0.0.2")
    assert (old.closed, proven.closed, young.closed) == ("displaced", None, None)
    book.proven(young)
    book.proven(newcomer)
    refused = Connection("refused")
    assert not book.admit(refused, "10.0.0.3") and refused.closed is None  # none pending: refused
    assert set(book.open) == {proven, young, newcomer}


def test_one_address_cannot_take_another_addresss_place():
    book = ConnectionBook(ListenerLimits(max_connections=10, max_per_address=2), "test")
    theirs = [Connection(f"t{k}") for k in range(2)]
    mine = Connection("mine")
    for connection in theirs:
        assert book.admit(connection, "10.0.0.9")
    assert book.admit(mine, "10.0.0.1")
    third = Connection("t2")
    assert book.admit(third, "10.0.0.9")  # its own oldest pending makes room, not mine
    assert theirs[0].closed == "displaced" and mine.closed is None
    book.release(mine)
    assert book.per_address == {"10.0.0.9": 2} and len(book.open) == 2


def test_a_closed_pending_connection_leaves_nothing_behind_and_the_address_cap_holds_after_churn():
    """(A released pending connection once stayed in its address's pending pool: every stranger's
    connection was kept alive for good, and the address cap then "displaced" closed ones.)"""
    book = ConnectionBook(ListenerLimits(max_connections=100, max_per_address=2), "test")
    for k in range(50):
        churned = Connection(f"churned{k}")
        assert book.admit(churned, "10.0.0.9")
        book.release(churned)
    assert book.open == {} and book.per_address == {} and book._pending == {} and book._pending_by_address == {}
    held = [Connection(f"held{k}") for k in range(3)]
    for connection in held:
        assert book.admit(connection, "10.0.0.9")
    assert [c.closed for c in held] == ["displaced", None, None] and book.per_address == {"10.0.0.9": 2}


def test_strangers_pending_connections_are_capped_below_the_total():
    book = ConnectionBook(ListenerLimits(max_connections=10, max_per_address=10, max_pending=2), "test")
    serving = Connection("serving")
    assert book.admit(serving, "10.0.0.1")
    book.proven(serving)
    idle = [Connection(f"idle{k}") for k in range(3)]
    for connection in idle:
        assert book.admit(connection, f"10.0.1.{len(book.open)}")
    assert [c.closed for c in idle] == ["displaced", None, None] and serving.closed is None
    assert len(book.open) == 3


def test_a_request_in_flight_waits_behind_a_few_accepts_and_no_collection_of_the_start_up_heap():
    """A stranger's 500 connections queued in the kernel at once, with a tenant's request on a
    kept-alive connection that needs a few turns of the loop (as forwarding to an engine does):
    it is answered after a few batches of accepts, not after all 500 (uvicorn's own batch of
    2,048 accepted them in one turn: seconds of delay per request under a sustained flood). And
    the objects the process built before serving are out of the collector's walks from then on."""
    seen: list[int] = []
    turns = 4

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        for _ in range(turns):
            await asyncio.sleep(0)
        seen.append(len(protocol.book.open))  # connections accepted by the time it is answered
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    protocol = guarded_protocol("test", ListenerLimits(max_connections=4096))
    frozen, stranger = threading.Event(), []
    try:
        with serving(app, protocol, freeze_heap=True) as (server, port):
            assert gc.get_freeze_count() > 10_000
            with socket.create_connection(("127.0.0.1", port), timeout=10) as tenant:
                request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
                tenant.sendall(request)
                assert answer(tenant).startswith(b"HTTP/1.1 200")
                server.servers[0].get_loop().call_soon_threadsafe(frozen.wait, 30)  # the loop stops here
                tenant.sendall(request)
                stranger += [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(500)]
                frozen.set()
                assert answer(tenant).startswith(b"HTTP/1.1 200")
            assert seen[-1] <= (turns + 3) * ACCEPTS_PER_TURN < 500, seen
    finally:
        frozen.set()
        for connection in stranger:
            connection.close()
        gc.unfreeze()  # this test process's own heap, back to the collector


def test_a_connection_costs_no_protocol_until_its_request_head_is_in_and_a_request_in_pieces_is_served_whole():
    """Half a request line (the idle flood's) keeps a connection bare: in the book, pending, with no
    uvicorn protocol; a tenant's POST whose head and body arrive in pieces is answered with its
    whole body, as if it had come at once."""
    protocol = guarded_protocol("test", ListenerLimits(max_connections=64))
    with serving(echo, protocol) as (server, port):
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
        for connection in idle:
            connection.sendall(b"GET /v1/models HT")
        body = b'{"prompt": "' + b"x" * 3000 + b'"}'
        pieces = [b"POST /echo HTTP/1.1\r\nhost: x\r\n", b"content-length: %d\r\n" % len(body),
                  b"\r", b"\n" + body[:1000], body[1000:]]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as tenant:
            for piece in pieces:
                tenant.sendall(piece)
                time.sleep(0.05)
            assert answer(tenant, body).startswith(b"HTTP/1.1 200")
            (served,) = server.server_state.connections
            # Nagle off, as on asyncio's own accepts: a streamed answer's events are not held back
            # for the client's delayed ACK (40 ms a request when it was on)
            assert served.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        until(lambda: len(protocol.book.open) == 8, "the tenant's connection closed", every_s=0.02)
        assert all(isinstance(connection, BareConnection) for connection in protocol.book.open)
        assert len(protocol.book._pending) == 8 and not server.server_state.connections
        for connection in idle:
            connection.close()
        until(lambda: not protocol.book.open, "the idle connections closed", every_s=0.02)


def test_blank_lines_before_a_request_keep_it_bare_and_a_head_past_the_limit_is_answered_431():
    """(Four bytes of CRLFs once made a connection look like a whole head: a protocol built for a
    stranger who then sends half a line.)"""
    protocol = guarded_protocol("test", ListenerLimits(max_connections=64))
    with serving(echo, protocol) as (_, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as blank_first, \
                socket.create_connection(("127.0.0.1", port), timeout=10) as endless:
            blank_first.sendall(b"\r\n\r\nGET /v1/mo")
            start = b"GET / HTTP/1.1\r\nx-pad: "
            endless.sendall(start + b"a" * (MAX_HEAD_BYTES - len(start)))  # no more: a clean close
            assert endless.recv(4096).startswith(b"HTTP/1.1 431") and endless.recv(1) == b""
            until(lambda: len(protocol.book.open) == 1, "the long head closed", every_s=0.02)
            assert all(isinstance(connection, BareConnection) for connection in protocol.book.open)
            blank_first.sendall(b"dels HTTP/1.1\r\nhost: x\r\n\r\n")
            assert blank_first.recv(4096).startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as in_two_pieces:
            # (the limit once held only for what one read brought: two 10 KiB pieces were served)
            in_two_pieces.sendall(start + b"a" * 10_000)
            time.sleep(0.1)
            in_two_pieces.sendall(b"a" * 10_000 + b"\r\nhost: x\r\n\r\n")
            try:
                reply = in_two_pieces.recv(4096)
            except ConnectionResetError:  # the 431 lost to the reset that unread bytes cause
                reply = b""
            assert not reply.startswith(b"HTTP/1.1 200"), reply


def test_a_connection_displaced_while_it_is_handed_over_is_aborted_and_leaves_the_book_clean():
    """A bare connection whose head is in, displaced before its protocol is connected: the protocol
    aborts the transport instead of taking a place it no longer has."""
    protocol_class = guarded_protocol("test", ListenerLimits(max_connections=8, max_pending=1))
    book = protocol_class.book
    handed_over = ReadAheadStandIn("10.0.0.1", bytearray(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"))
    assert book.admit(handed_over, handed_over.address)
    assert book.admit(Connection("newcomer"), "10.0.0.2") and handed_over.closed == "displaced"
    loop = asyncio.new_event_loop()
    try:
        protocol = protocol_class(config=uvicorn.Config(echo), server_state=uvicorn.server.ServerState(),
                                  app_state={}, _loop=loop)
        protocol.handed_over = handed_over
        transport = TransportStandIn()
        protocol.connection_made(transport)
    finally:
        loop.close()
    assert transport.aborted and protocol not in book.open and book.per_address == {"10.0.0.2": 1}


class ReadAheadStandIn(Connection):
    """A bare connection whose head is in (named so: no socket)."""

    def __init__(self, address: str, head: bytearray) -> None:
        super().__init__(address)
        self.address, self.head = address, head


class TransportStandIn:
    """What a protocol sees of its transport (named so: no socket)."""

    aborted = False

    def get_extra_info(self, name: str, default=None):
        return ("10.0.0.1", 40000) if name == "peername" else default

    def abort(self) -> None:
        self.aborted = True


def test_pipelined_requests_read_ahead_with_the_head_are_answered_in_order():
    protocol = guarded_protocol("test", ListenerLimits(max_connections=64))
    with serving(echo, protocol) as (_, port), socket.create_connection(("127.0.0.1", port), timeout=10) as tenant:
        tenant.sendall(b"".join(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n%02d" % k
                                for k in range(3)))
        received = b""
        while received.count(b"HTTP/1.1 200") < 3 or not received.endswith(b"02"):
            chunk = tenant.recv(4096)
            assert chunk, received
            received += chunk
        assert received.index(b"\r\n\r\n00") < received.index(b"\r\n\r\n01") < received.index(b"\r\n\r\n02")


def test_a_bare_connection_is_displaced_by_a_newcomer_and_closed_at_its_header_deadline():
    protocol = guarded_protocol("test", ListenerLimits(max_connections=64, max_pending=2, header_timeout_s=1.5))
    with serving(echo, protocol) as (_, port):
        first, second, third = (socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3))
        assert first.recv(1) == b""  # displaced by the third
        second.setblocking(False)
        with pytest.raises(BlockingIOError):  # still open: its deadline is seconds away
            second.recv(1)
        second.setblocking(True)
        started = time.monotonic()
        assert second.recv(1) == b"" and third.recv(1) == b""  # nothing sent: the deadline
        assert time.monotonic() - started < 1.5 + SWEEP_S + 5
        with socket.create_connection(("127.0.0.1", port), timeout=10) as tenant:
            tenant.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nok")
            assert answer(tenant).startswith(b"HTTP/1.1 200")
        for connection in (first, second, third):
            connection.close()


def test_shutdown_closes_the_listener_and_every_bare_connection():
    protocol = guarded_protocol("test", ListenerLimits(max_connections=64))
    with serving(echo, protocol) as (_, port):
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        idle.sendall(b"GET")
        until(lambda: len(protocol.book.open) == 1, "the connection accepted", every_s=0.02)
    with idle:
        assert idle.recv(1) == b""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return
    raise AssertionError("the listener still accepts after shutdown")


async def echo(scope, receive, send) -> None:
    """Answers a request with its body."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(app, protocol, freeze_heap: bool = False):
    """A GuardedServer of `app` under `protocol` on a free port, in a thread, until the block ends
    (then shut down and its thread joined). Yields the server and its port."""
    server = GuardedServer(uvicorn.Config(app, host="127.0.0.1", port=free_port("127.0.0.1"), http=protocol,
                                          loop="asyncio", log_level="warning", backlog=2048),
                           freeze_heap=freeze_heap)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        until(lambda: server.started, "the server started", every_s=0.02)
        yield server, server.config.port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not stop"


def answer(connection: socket.socket, body: bytes = b"ok") -> bytes:
    """One whole response whose body is `body`."""
    received = b""
    while not received.endswith(b"\r\n\r\n" + body):
        chunk = connection.recv(4096)
        assert chunk, received
        received += chunk
    return received
