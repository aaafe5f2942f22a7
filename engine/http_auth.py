"""The check every HTTP route of an engine runs: the cluster's engine token, or 401.

vLLM's own `--api-key` guards only /v1 routes; its dev-mode routes (/collective_rpc, which
loads weights, /reset_prefix_cache), /health, /metrics and /tokenize stay open. This middleware
(`--middleware engine.http_auth.EngineAuthMiddleware`, applied by vLLM around its whole app) sees
every request first, websockets included, so nothing reaches an engine without the token: not a
stranger on the network, and not a client who would skip the router's keys, limits and salts.
It is a plain ASGI class (vLLM constructs it with the app alone): the token comes from the cluster
secret in the engine's environment.
"""

from __future__ import annotations

import json

from security.credentials import ClusterCredentials, bearer_matches

_DENIED = json.dumps({"error": {"message": "this engine serves only its cluster's router",
                                "type": "AuthenticationError", "code": 401}}).encode()


class EngineAuthMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self.token = ClusterCredentials.load().engine_token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not bearer_matches(authorization.decode("latin-1"), self.token):
                await self._deny(scope, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _deny(scope, send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": _DENIED})
