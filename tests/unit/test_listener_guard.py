"""The guarded listener (transport/listener_guard.py): at a cap a newcomer displaces the oldest
connection that has proven nothing, never a proven one; with none pending it is refused; accepting
a flood of connections never crowds out a request in flight."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time

import uvicorn

from engine.environment import free_port
from transport.listener_guard import (
    ACCEPTS_PER_TURN,
    ConnectionBook,
    GuardedServer,
    ListenerLimits,
    guarded_protocol,
)


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
    server = GuardedServer(uvicorn.Config(app, host="127.0.0.1", port=free_port("127.0.0.1"), http=protocol,
                                          loop="asyncio", log_level="warning", backlog=2048))
    threading.Thread(target=server.run, daemon=True).start()
    port, frozen = server.config.port, threading.Event()
    stranger: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
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
        server.should_exit = True
        gc.unfreeze()  # this test process's own heap, back to the collector


def answer(connection: socket.socket) -> bytes:
    """One whole response of the test's app (its body: b"ok")."""
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        chunk = connection.recv(4096)
        assert chunk, received
        received += chunk
    return received
