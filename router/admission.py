"""Admission: who may send requests, how many, and which tenant's cache they use.

API keys map to tenants. With no keys configured the endpoint is open (the launcher warns). Each
tenant's requests carry a cache salt derived from the tenant under the cluster secret (an HMAC:
no one can compute another tenant's), which vLLM folds into the first block's hash, and so do the
router's index and the KV store's keys: one tenant never hits (nor times) another's cached
prompt. Per key, a token bucket bounds the request rate and a counter the requests in flight;
beyond either the answer is 429 with Retry-After. Routers that serve one cluster together share
these limits (deploy/admission_ledger.py), so a key gets its limits once, not once per router.
"""

from __future__ import annotations

import dataclasses
import hmac
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi import Request
from pydantic import ValidationError

from router.config import RouterConfig
from router.errors import BadRequest, ModelNotFound, PayloadTooLarge, RateLimited, Unauthorized
from router.openai_requests import SamplingRequest

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


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a key may not send another request now, and when it may try again."""

    message: str
    retry_after_s: float


class KeyLimits:
    """Per key: a token bucket bounds the request rate, a count the requests in flight. The counts
    are kept per holder (a router), so that several routers can share one `KeyLimits` (the
    cluster's admission ledger, deploy/admission_ledger.py) and each can restate or withdraw its
    own: a holder's counts are what it says they are."""

    def __init__(self, rate_per_s: float | None, max_concurrency: int | None) -> None:
        self.rate_per_s = rate_per_s
        self.max_concurrency = max_concurrency
        self._buckets: dict[str, _Bucket] = {}
        self._inflight: dict[str, dict[str, int]] = {}  # holder -> key -> requests in flight

    @property
    def settings(self) -> tuple[float | None, int | None]:
        return self.rate_per_s, self.max_concurrency

    def acquire(self, key: str, holder: str = "") -> Refusal | None:
        """Take one of `key`'s request slots for `holder`; None when taken, else why not."""
        if self.max_concurrency and self.inflight(key) >= self.max_concurrency:
            return Refusal(f"at most {self.max_concurrency} requests in flight per key", 1.0)
        if self.rate_per_s:
            bucket = self._buckets.setdefault(key, _Bucket(self.rate_per_s, max(1.0, self.rate_per_s)))
            wait = bucket.take()
            if wait:
                return Refusal(f"rate limit of {self.rate_per_s:g} requests/s exceeded", wait)
        counts = self._inflight.setdefault(holder, {})
        counts[key] = counts.get(key, 0) + 1
        return None

    def release(self, key: str, holder: str = "") -> None:
        counts = self._inflight.get(holder, {})
        if counts.get(key, 0) > 0:
            counts[key] -= 1

    def inflight(self, key: str) -> int:
        return sum(counts.get(key, 0) for counts in self._inflight.values())

    def restate(self, holder: str, counts: dict[str, int]) -> None:
        """`holder`'s requests in flight are `counts` (what it holds, from its own books)."""
        self._inflight[holder] = {key: n for key, n in counts.items() if n > 0}

    def forget(self, holder: str) -> None:
        """`holder` is gone: its requests no longer count."""
        self._inflight.pop(holder, None)


class Limits(Protocol):
    """Where a router takes a key's request slots: its own `LocalLimits`, or the slots every
    router shares (deploy/admission_ledger.py)."""

    async def acquire(self, key: str) -> Callable[[], None]:
        """Take a slot (raises RateLimited); returns the function that gives it back (once)."""
        ...

    def start(self) -> None:
        """Begin what the limits need in the background (the router's lifespan calls it)."""

    async def stop(self) -> None: ...


class LocalLimits:
    """One router's own limits."""

    def __init__(self, limits: KeyLimits) -> None:
        self.limits = limits

    async def acquire(self, key: str) -> Callable[[], None]:
        return take_slot(self.limits, key)

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def take_slot(limits: KeyLimits, key: str, holder: str = "") -> Callable[[], None]:
    """`limits.acquire`, raising RateLimited on a refusal; returns the slot's one-time release."""
    refusal = limits.acquire(key, holder)
    if refusal:
        raise RateLimited(refusal.message, retry_after_s=refusal.retry_after_s)
    return once(lambda: limits.release(key, holder))


def once(function: Callable[[], None]) -> Callable[[], None]:
    """`function`, run at the first call only."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            function()

    return call


class Admission:
    def __init__(self, api_keys: dict[str, str], limits: Limits, tenant_salt: Callable[[str], str]) -> None:
        self.api_keys = api_keys
        self.tenant_salt = tenant_salt
        self.limits = limits

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
        return self.tenant_cache_salt(self.tenant(key), client_salt)

    def tenant_cache_salt(self, tenant: str, client_salt: str | None) -> str | None:
        if self.open:
            return client_salt
        salt = self.tenant_salt(tenant)
        return f"{salt}:{client_salt}" if client_salt else salt

    async def admit(self, key: str) -> Callable[[], None]:
        """Take one of `key`'s request slots; returns the function that gives it back (once)."""
        return await self.limits.acquire(key)


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

    async def admit(self, request: Request, model: type[SamplingRequest], as_tenant: str | None = None) -> Admitted:
        """`as_tenant`: the request of that tenant, for the operator (already authenticated as
        such), who holds no tenant's key; else the caller's API key decides."""
        key = "" if as_tenant is not None else self.admission.authenticate(request.headers.get("authorization"))
        body = await self._bounded_body(request)
        parsed = self.parse(body, model)
        limit = self.config.max_sequences_per_request
        if parsed.sequences() > limit:
            raise BadRequest(f"at most {limit} sequences (prompts x n) per request", param="n")
        asked = getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens
        longest = self.config.served(parsed.model).max_model_len
        if asked is not None and asked > longest:
            raise BadRequest(f"max_tokens is limited to the model's {longest} tokens", param="max_tokens")
        client_salt = getattr(parsed, "cache_salt", None)
        salt = (self.admission.tenant_cache_salt(as_tenant, client_salt) if as_tenant is not None
                else self.admission.cache_salt(key, client_salt))
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
