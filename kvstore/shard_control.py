"""The control half of a store shard's client: typed messages (kvstore/messages.py) over the
shard's ZMQ socket, as a CURVE client of the store plane (only the cluster's members get answers),
each answered within `timeout_s` or failed as `StoreUnavailable`. A REQ socket whose request or
answer was lost waits for nothing, so a message the shard may see twice is asked again on a new
connection after half the timeout (the ZMQ guide's "lazy pirate"); after a timeout the shard is
skipped (a miss at once) for `retry_after_s`. The bytes move in kvstore/shard_client.py."""

from __future__ import annotations

import contextlib
import logging
import time

from kvstore import messages
from security.credentials import CurveKeys
from transport.zmq_curve import connect_curve

log = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The shard did not answer in time, or refused the request."""


ASKED_AGAIN = (messages.Hello, messages.Commit, messages.Contains, messages.Stats, messages.Members)
"""Control messages a shard may receive twice with no harm. One unanswered for half the timeout
is sent again on a new connection (the ZMQ guide's "lazy pirate"): a REQ socket whose request or
answer was lost waits for nothing, and a write whose commit went unanswered is a store miss. A
commit names keys, not a reservation: one repeated after its reservation expired and another
writer reserved the key commits that writer's chunk early, which a reader's checksum then finds
damaged (a miss). Not abort: repeated, it would drop such a writer's reservation."""


def _op(request: messages.Request) -> str:
    return type(request).__name__.lower()


def _reply(socket, op: str, timeout_s: float, endpoint: str) -> dict:
    if not socket.poll(int(timeout_s * 1000)):
        raise StoreUnavailable(f"store shard {endpoint} did not answer {op!r} within {timeout_s} s")
    return messages.decode_reply(socket.recv())


def _socket(context, endpoint: str, keys: CurveKeys):
    import zmq

    socket = context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    connect_curve(socket, keys)
    socket.connect(endpoint)
    return socket


def request_once(endpoint: str, request: messages.Request, timeout_s: float, keys: CurveKeys) -> dict:
    """One control message to a shard, with no transfer agent (stats, fault injection)."""
    import zmq

    context = zmq.Context()
    socket = _socket(context, endpoint, keys)
    try:
        socket.send(messages.encode(request))
        reply = _reply(socket, _op(request), timeout_s, endpoint)
    finally:
        socket.close(0)
        context.term()
    if "error" in reply:
        raise StoreUnavailable(f"store shard refused {_op(request)!r}: {reply['error']}")
    return reply


class ShardControl:
    """One shard's control socket; used under its client's lock."""

    def __init__(self, endpoint: str, keys: CurveKeys, timeout_s: float, retry_after_s: float) -> None:
        import zmq

        self.endpoint, self.keys = endpoint, keys
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._down_until = 0.0  # after a timeout, calls fail fast (a miss) instead of each waiting
        self._context = zmq.Context()
        self._socket = None
        self._unanswered: str | None = None  # the op whose answer is still to be read
        self.members_epoch = 0  # the newest member list the shard has said it holds

    def close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(StoreUnavailable):  # a release sent last is delivered
                self._collect_answer()
            self._socket.close(0)
        self._context.term()

    def call(self, request: messages.Request, answer_later: bool = False) -> dict:
        """One control message and its answer. With `answer_later`, return once it is sent: its
        answer is read (and a refusal logged) before the next message, or at close."""
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"store shard {self.endpoint} is unreachable; retrying after a pause")
        if self._socket is None:
            self._socket = _socket(self._context, self.endpoint, self.keys)
        try:
            self._collect_answer()
            self._socket.send(messages.encode(request))
            if answer_later:
                self._unanswered = _op(request)
                return {}
            reply = self._answer(_op(request)) if not isinstance(request, ASKED_AGAIN) else self._ask_twice(request)
        except StoreUnavailable:
            if self._socket is not None:
                self._socket.close(0)
            self._socket = None
            self._unanswered = None
            self._down_until = time.monotonic() + self.retry_after_s
            raise
        if "error" in reply:
            raise StoreUnavailable(f"store shard refused {_op(request)!r}: {reply['error']}")
        return reply

    def _ask_twice(self, request: messages.Request) -> dict:
        """The answer to `request` (sent), waited for half the timeout; then the same request goes
        again on a new connection, and the first answer on either is taken, for the other half."""
        import zmq

        op, first, wait_ms = _op(request), self._socket, int(self.timeout_s / 2 * 1000)
        if first.poll(wait_ms):
            return self._take(first)
        log.warning("store shard %s did not answer %r within %.1f s: asking again on a new connection",
                    self.endpoint, op, self.timeout_s / 2)
        self._socket, answered = None, None  # set again to the connection that answers
        second = _socket(self._context, self.endpoint, self.keys)
        try:
            second.send(messages.encode(request))
            poller = zmq.Poller()
            for connection in (first, second):
                poller.register(connection, zmq.POLLIN)
            ready = dict(poller.poll(wait_ms))
            answered = first if first in ready else second if second in ready else None
            if answered is None:
                raise StoreUnavailable(f"store shard {self.endpoint} did not answer {op!r} within "
                                       f"{self.timeout_s} s (asked twice)")
            reply = self._take(answered)
        finally:
            for connection in (first, second):
                if connection is not answered:
                    connection.close(0)
        self._socket = answered
        log.warning("store shard %s answered %r on the %s connection", self.endpoint, op,
                    "first" if answered is first else "new")
        return reply

    def _take(self, connection) -> dict:
        """The answer waiting on `connection`."""
        reply = messages.decode_reply(connection.recv())
        self.members_epoch = max(self.members_epoch, reply.get("members_epoch", 0))
        return reply

    def _answer(self, op: str) -> dict:
        if not self._socket.poll(int(self.timeout_s * 1000)):
            raise StoreUnavailable(f"store shard {self.endpoint} did not answer {op!r} within {self.timeout_s} s")
        return self._take(self._socket)

    def _collect_answer(self) -> None:
        if self._unanswered is None:
            return
        op, self._unanswered = self._unanswered, None
        reply = self._answer(op)
        if "error" in reply:
            log.warning("store shard %s refused %r: %s", self.endpoint, op, reply["error"])
