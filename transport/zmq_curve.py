"""ZMQ sockets that talk only to holders of the cluster's CURVE keys.

CURVE encrypts a connection and proves the server's identity to the client; the server learns
the client's public key, and only a ZAP handler on the server's context turns that into a yes or
no (without one, libzmq admits any key pair). `Gate` is that handler: it admits the one client key
of a plane (security/credentials.py derives both pairs from the cluster secret), so a peer that
does not hold the secret never completes a handshake, and no message of its reaches our code.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from security.credentials import CurveKeys

log = logging.getLogger(__name__)
ZAP_DOMAIN = "pdcluster"
# The cluster's CURVE planes, each with its own key pairs (security/credentials.py).
STORE_PLANE = "store"  # the KV store's control sockets (kvstore/shard.py)
KV_EVENTS_PLANE = "kv-events"  # engines' KV event sockets and the router's (engine/ and router/kv_event_listener.py)


def serve_curve(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Make `socket` (before bind or connect) the CURVE server of its plane."""
    socket.curve_secretkey = keys.server_secret
    socket.curve_publickey = keys.server_public
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN.encode()
    socket.zap_enforce_domain = True  # no ZAP handler answering: no client admitted (not all)


def connect_curve(socket: zmq.Socket, keys: CurveKeys) -> None:
    """Make `socket` (before bind or connect) a CURVE client of its plane."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret


class _Allowlist:
    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key == self.client_public
        if not allowed:
            self.refused += 1
        return allowed


class Gate:
    """The ZAP handler of one ZMQ context: CURVE clients with the plane's client key only. Owns a
    thread (pyzmq's ThreadAuthenticator) or, for an asyncio context, a task; `stop()` ends it."""

    def __init__(self, context: zmq.Context, keys: CurveKeys) -> None:
        self._allowlist = _Allowlist(keys.client_public)
        if isinstance(context, zmq.asyncio.Context):
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._authenticator = AsyncioAuthenticator(context, log=log)
        else:
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(context, log=log)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._allowlist)

    @property
    def refused(self) -> int:
        """Handshakes refused so far (a key other than the plane's)."""
        return self._allowlist.refused

    def stop(self) -> None:
        self._authenticator.stop()
