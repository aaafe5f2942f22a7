"""Admission: who may send requests, how many, and which tenant's cache they use.

API keys map to tenants. With no keys configured the endpoint is open (the launcher warns). Each
tenant's requests carry a cache salt derived from the tenant under the cluster secret (an HMAC:
no one can compute another tenant's), which vLLM folds into the first block's hash, and so do the
router's index and the KV store's keys: one tenant never hits (nor times) another's cached
prompt. Per key, a token bucket bounds the request rate and a counter the requests in flight;
beyond either the answer is 429 with Retry-After.
"""

from __future__ import annotations

import dataclasses
import hmac
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from router.config import RouterConfig
from router.errors import BadRequest, ModelNotFound, PayloadTooLarge, RateLimited, Unauthorized
from router.protocol import SamplingRequest

OPEN_TENANT = "public"


class _Bucket:
    def __init__(self, rate_per_s: float, burst: float) -> None:
        self.rate, self.burst = rate_per_s, burst
        self.tokens, self.updated = burst, time.monotonic()

    def take(self) -> float:
        """0 if a request may pass now, else the seconds until it may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Admission:
    def __init__(self, api_keys: dict[str, str], rate_per_s: float | None, max_concurrency: int | None,
                 tenant_salt: Callable[[str], str]) -> None:
        self.api_keys = api_keys
        self.tenant_salt = tenant_salt
        self.rate_per_s = rate_per_s
        self.max_concurrency = max_concurrency
        self._buckets: dict[str, _Bucket] = {}
        self._inflight: dict[str, int] = {}

    @property
    def open(self) -> bool:
        return not self.api_keys

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key (the Bearer token), or the open tenant when no keys are configured."""
        if self.open:
            return ""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        for key in self.api_keys:  # constant-time comparison: no timing hint about valid keys
            if hmac.compare_digest(key.encode(), token.encode()):
                return key
        raise Unauthorized("invalid API key")

    def tenant(self, key: str) -> str:
        return self.api_keys.get(key, OPEN_TENANT)

    def cache_salt(self, key: str, client_salt: str | None) -> str | None:
        """The salt the request's KV blocks are hashed with: the tenant's, then the client's own."""
        if self.open:
            return client_salt
        salt = self.tenant_salt(self.tenant(key))
        return f"{salt}:{client_salt}" if client_salt else salt

    def admit(self, key: str) -> Callable[[], None]:
        """Take one of `key`'s request slots; returns the function that gives it back (once)."""
        if self.rate_per_s:
            bucket = self._buckets.setdefault(key, _Bucket(self.rate_per_s, max(1.0, self.rate_per_s)))
            wait = bucket.take()
            if wait:
                raise RateLimited(
                    f"rate limit of {self.rate_per_s:g} requests/s exceeded", retry_after_s=wait
                )
        if self.max_concurrency and self._inflight.get(key, 0) >= self.max_concurrency:
            raise RateLimited(f"at most {self.max_concurrency} requests in flight per key", retry_after_s=1)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._inflight[key] -= 1

        return release


async def release_after(body: AsyncIterator[bytes], release: Callable[[], None]) -> AsyncIterator[bytes]:
    """A streamed body that gives its request slot back when it ends, however it ends."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        release()


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """An OpenAI-style message and the parameter it names, from pydantic's errors."""
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "value_error" and not location:  # the request's own checks name the field
        message = str(first["ctx"]["error"])
        return message, message.partition(":")[0]
    param = ".".join(location) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A request let in: whose (its API key), what, and how large its body was (what its
    analysis may cost is bounded by that, whatever fields it sits in)."""

    key: str
    request: SamplingRequest
    body_bytes: int


class Intake:
    """A client's request from the wire to a validated one of its tenant: the key checked, the
    body read against its cap as it arrives (chunked too), parsed and validated in one pass
    (pydantic-core on the raw bytes, several times faster than FastAPI's body handling), the work
    bounded, the cache salted with the tenant's salt."""

    def __init__(self, config: RouterConfig, admission: Admission) -> None:
        self.config = config
        self.admission = admission

    async def admit(self, request: Request, model: type[SamplingRequest]) -> Admitted:
        key = self.admission.authenticate(request.headers.get("authorization"))
        body = await self._bounded_body(request)
        parsed = self.parse(body, model)
        limit = self.config.max_sequences_per_request
        if parsed.sequences() > limit:
            raise BadRequest(f"at most {limit} sequences (prompts x n) per request", param="n")
        asked = getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens
        longest = self.config.served(parsed.model).max_model_len
        if asked is not None and asked > longest:
            raise BadRequest(f"max_tokens is limited to the model's {longest} tokens", param="max_tokens")
        salt = self.admission.cache_salt(key, getattr(parsed, "cache_salt", None))
        if salt is not None:
            parsed.cache_salt = salt  # an extra field: forwarded to vLLM, hashed by the analyzer
        return Admitted(key, parsed, len(body))

    def parse(self, body: bytes, model: type[SamplingRequest]) -> SamplingRequest:
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as exc:
            raise BadRequest(*validation_message(exc.errors())) from None
        if self.config.served(parsed.model) is None:
            raise ModelNotFound(f"The model `{parsed.model}` does not exist.", param="model")
        return parsed

    async def _bounded_body(self, request: Request) -> bytes:
        cap = self.config.max_body_bytes
        too_large = PayloadTooLarge(f"request bodies are limited to {cap} bytes")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > cap:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > cap:
                raise too_large
        return bytes(body)
