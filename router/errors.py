"""One error hierarchy for the router, each mapped to an OpenAI error response.

`{"error": {"message", "type", "param", "code"}}` with the HTTP status in `code`, as OpenAI and
vLLM answer. "No instance" (503) is kept apart from "all overloaded" (429).
"""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse


class RouterError(Exception):
    status = 500
    type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.message, self.type, self.status, self.param)

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class BadRequest(RouterError):
    status = 400
    type = "BadRequestError"


class Unauthorized(RouterError):
    status = 401
    type = "AuthenticationError"


class RateLimited(RouterError):
    """The caller's key is over its rate or concurrency limit (not the cluster's capacity)."""

    status = 429
    type = "RateLimitError"


class PayloadTooLarge(RouterError):
    status = 413
    type = "BadRequestError"


class ModelNotFound(RouterError):
    status = 404
    type = "NotFoundError"


class NoInstance(RouterError):
    """No ready instance can take the request (none started yet, or all failed)."""

    status = 503
    type = "ServiceUnavailableError"


class Overloaded(RouterError):
    """The router itself is at a bound (long prompts being tokenized); retry shortly."""

    status = 503
    type = "ServiceUnavailableError"


class EngineFailed(RouterError):
    """The engine broke while serving and no other instance could take the request over."""

    status = 502
    type = "BadGatewayError"


def error_body(message: str, type_: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def stream_error_event(message: str) -> bytes:
    """The server-sent events that end a broken stream: an OpenAI error (an engine's failure), and
    [DONE]."""
    return f"data: {json.dumps(error_body(message, EngineFailed.type, 502))}\n\ndata: [DONE]\n\n".encode()
