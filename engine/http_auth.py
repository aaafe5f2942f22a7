"""The check every HTTP request to an engine passes first: the engine process's token, a route the
cluster uses, and for /collective_rpc one of our weight-plane methods; anything else is refused.

vLLM's own `--api-key` guards only /v1 routes; its dev-mode routes (/collective_rpc, which runs
any worker method by name, /reset_prefix_cache), /health, /metrics, /tokenize and the rest stay
open. This middleware (`--middleware engine.http_auth.EngineAuthMiddleware`, applied by vLLM
around its whole app) sees every request first, so nothing reaches an engine without the token:
not a stranger on the network, and not a client who would skip the router's keys, limits and
salts. A holder of the token (the router, the engine's host) still reaches only the routes below:
a leaked token runs no worker method but ours. It is a plain ASGI class (vLLM constructs it with
the app alone): the token comes from the engine's keys in its environment
(security/credentials.EngineKeys), one token per engine process (security/engine_access.py).
"""

from __future__ import annotations

import json

from security.credentials import EngineKeys, bearer_matches

# What the router and the engine's host call (router/proxy.py, fleet/instances.py, engine/host.py)
# and what an operator scrapes.
ROUTES = frozenset({
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("GET", "/health"), ("GET", "/load"), ("GET", "/metrics"), ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"),
    ("POST", "/sleep"), ("POST", "/wake_up"),
})
WORKER_METHODS = frozenset({"pdc_load_weights", "pdc_export_weights", "pdc_release_weights", "pdc_keep_host_copy",
                            "pdc_seal_listeners", "pdc_prepare_transfers"})
# A weight descriptor names every parameter with its handle and checksum: ~150 KB for an 8B
# Llama (64 KiB refused it on the H200), MBs for a large MoE. Read only from token holders.
MAX_RPC_BODY_BYTES = 64 * 1024 * 1024


def _error(status: int, kind: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


class EngineAuthMiddleware:
    def __init__(self, app, token: str | None = None) -> None:
        """`token`: the one to admit; by default this engine process's own (EngineKeys, from the
        environment its host gave it)."""
        self.app = app
        self.token = token or EngineKeys.load().engine_token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":  # no route of ours is one
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not bearer_matches(authorization.decode("latin-1"), self.token):
            await _respond(send, 401, _error(401, "AuthenticationError", "this engine serves only its cluster's router"))
            return
        if (scope["method"], scope["path"]) not in ROUTES:
            await _respond(send, 404, _error(404, "NotFoundError", "not a route of this cluster's engines"))
            return
        if scope["path"] == "/collective_rpc":
            body = await _read_body(receive, MAX_RPC_BODY_BYTES)
            if body is None:
                await _respond(send, 413, _error(413, "RequestTooLarge", "a collective_rpc body over the limit"))
                return
            if _rpc_method(body) not in WORKER_METHODS:
                await _respond(send, 403, _error(403, "PermissionError", "not a worker method of pdcluster's"))
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


async def _respond(send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None past `limit` bytes or if the client went away."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return b"".join(chunks)


def _rpc_method(body: bytes) -> str | None:
    try:
        request = json.loads(body)
    except ValueError:
        return None
    return request.get("method") if isinstance(request, dict) else None


def _replay(body: bytes, receive):
    """A `receive` that hands the app the body this middleware already read, then the client's
    own messages (its disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
