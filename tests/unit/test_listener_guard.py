"""The guarded listener's book (transport/listener_guard.py): at a cap a newcomer displaces the
oldest connection that has proven nothing, never a proven one; with none pending it is refused."""

from __future__ import annotations

from transport.listener_guard import ConnectionBook, ListenerLimits


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
