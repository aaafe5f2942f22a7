"""The OpenAI-compatible HTTP front: routes, validation, error mapping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import Role
from engine.lifecycle import InstanceState
from router import metrics
from router.admission import Admission, release_after
from router.config import RouterConfig
from router.disagg import RemotePrefill
from router.errors import BadRequest, ModelNotFound, PayloadTooLarge, RouterError, error_body
from router.hashing import PromptHasher
from router.instances import CapacityQueue, HealthMonitor, InstanceRegistry
from router.kv_events import STORE_HOLDER, KVEventListener
from router.kv_index import KVIndex
from router.policies import PolicyContext, RoutingRequest, make_policy
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from router.proxy import Forwarder

log = logging.getLogger(__name__)
SERVING_ROLES = (Role.COLOCATED, Role.DECODE)
ERROR_RESPONSES = {
    status: {"description": description}
    for status, description in ((400, "Invalid request"), (401, "No or invalid API key"),
                                (404, "Unknown model"), (413, "Body too large"), (429, "Rate limited"),
                                (502, "Engine failed"), (503, "No ready instance"))
}  # fmt: skip


def _body_schema(model: type[SamplingRequest]) -> dict:
    """The request model's JSON schema for the OpenAPI document, with its $defs inlined."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"content": content, "required": True}}


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(location) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


class RequestAnalyzer:
    """Turns a validated request into what routing policies see (tokens, block hashes, text)."""

    # Tokenizing a long prompt takes milliseconds: off the event loop beyond this many chars.
    INLINE_CHARS = 2048

    def __init__(self, config: RouterConfig) -> None:
        self.block_size = config.block_size
        self.hasher = (
            PromptHasher(config.tokenizer, config.block_size, config.hash_seed) if config.tokenizer else None
        )

    async def analyze(self, request: SamplingRequest) -> RoutingRequest:
        text = _prompt_text(request)
        if self.hasher is None:
            return RoutingRequest((), 0, self.block_size, text)
        try:
            if len(text) > self.INLINE_CHARS:
                tokens = await asyncio.to_thread(self.token_ids, request)
            else:
                tokens = self.token_ids(request)
        except (TypeError, ValueError, jinja2.TemplateError) as exc:  # e.g. a message with no content
            param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
            raise BadRequest(f"the {param} cannot be tokenized for this model: {exc}", param=param) from None
        hashes = self.hasher.block_hashes(tokens, getattr(request, "cache_salt", None))
        return RoutingRequest(hashes, len(tokens), self.block_size, text)

    def token_ids(self, request: SamplingRequest) -> list[int]:
        assert self.hasher is not None
        if isinstance(request, ChatCompletionRequest):
            messages = [m.model_dump(exclude_unset=True) for m in request.messages]
            return self.hasher.chat_tokens(messages, request.model_extra or {})
        assert isinstance(request, CompletionRequest)
        return self.hasher.completion_tokens(request.prompt)


def _prompt_text(request: SamplingRequest) -> str:
    if isinstance(request, ChatCompletionRequest):
        return "\n".join(str(m.content) for m in request.messages if m.content)
    prompt = request.prompt  # type: ignore[attr-defined]
    return prompt if isinstance(prompt, str) else ""


def build_app(
    config: RouterConfig, registry: InstanceRegistry, store_endpoints: tuple[str, ...] = ()
) -> FastAPI:
    """The router's FastAPI app; its lifespan owns the HTTP client, the health monitor and the
    KV event listener."""
    index = KVIndex(config.max_index_blocks_per_instance, config.speculative_ttl_s)
    context = PolicyContext(
        index=index, store_holders=frozenset({STORE_HOLDER} if store_endpoints else ()),
        prefill_tokens_per_s=config.prefill_tokens_per_s, fetch_cost=config.fetch_cost,
    )  # fmt: skip
    policy = make_policy(config.policy, context)
    analyzer = RequestAnalyzer(config)
    admission = Admission(config.api_keys, config.rate_limit_per_s, config.max_concurrency_per_key)
    if admission.open:
        log.warning("no API keys configured: anyone who reaches %s:%d may use it", config.host, config.port)
    prefill_policy = make_policy(config.policy, context)
    queue = CapacityQueue(config.queue_max_waiting, config.queue_timeout_s)
    forwarder = Forwarder(config, registry, policy, queue)
    forwarder.prepare = RemotePrefill(config, registry, prefill_policy, lambda: forwarder.session).prepare
    monitor = HealthMonitor(
        registry, config.health_interval_s, config.health_timeout_s, config.health_failure_threshold
    )
    listener = (
        KVEventListener(index, config.kv_events_endpoint, registry.replay_endpoint_of)
        if config.kv_events_endpoint
        else None
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        monitor.start()
        if listener:
            listener.start(holders=[i.instance_id for i in registry.all()])
        try:
            yield
        finally:
            await monitor.stop()
            if listener:
                await listener.stop()
            await forwarder.close()

    app = FastAPI(title="pdcluster router", lifespan=lifespan)
    app.state.registry = registry
    app.state.queue = queue
    app.state.first_tokens = forwarder.first_tokens
    app.state.config = config
    app.state.index = index
    app.state.listener = listener

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, exc: RouterError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return BadRequest(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "InvalidRequestError"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(error_body(f"internal error: {exc!r}", "InternalServerError", 500), 500)

    def check_model(request: SamplingRequest) -> None:
        if request.model != config.served_model_name:
            raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")

    def serving_instances():
        return registry.ready(SERVING_ROLES)

    def parse(body: bytes, model: type[SamplingRequest]) -> SamplingRequest:
        # pydantic-core parses and validates the raw bytes in one pass, several times faster
        # than FastAPI's body handling; the schema is still published through openapi_extra.
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as exc:
            raise BadRequest(*_validation_message(exc.errors())) from None
        check_model(parsed)
        return parsed

    async def admitted_request(request: Request, model: type[SamplingRequest]) -> tuple[str, SamplingRequest]:
        """Authenticate, bound the body, validate, and salt the cache with the caller's tenant."""
        key = admission.authenticate(request.headers.get("authorization"))
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise PayloadTooLarge(f"request bodies are limited to {config.max_body_bytes} bytes")
        body = await request.body()
        if len(body) > config.max_body_bytes:
            raise PayloadTooLarge(f"request bodies are limited to {config.max_body_bytes} bytes")
        parsed = parse(body, model)
        salt = admission.cache_salt(key, getattr(parsed, "cache_salt", None))
        if salt is not None:
            parsed.cache_salt = salt  # an extra field: forwarded to vLLM, hashed by the analyzer
        return key, parsed

    async def serve(request: Request, model: type[SamplingRequest], endpoint: str) -> Response:
        key, parsed = await admitted_request(request, model)
        release = admission.admit(key)
        try:
            routing = await analyzer.analyze(parsed)
            response = await forwarder.forward(endpoint, parsed.forwarded(), serving_instances, routing)
        except BaseException:
            release()
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = release_after(response.body_iterator, release)
        else:
            release()
        return response

    @app.post("/v1/completions", responses=ERROR_RESPONSES, openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, "/v1/completions")

    @app.post(
        "/v1/chat/completions", responses=ERROR_RESPONSES, openapi_extra=_body_schema(ChatCompletionRequest)
    )
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pdcluster",
            "max_model_len": config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while requests can be served: by a ready instance, or by a standby the pool
        controller activates for them (a scaled-to-zero pool is not down)."""
        ready = len(serving_instances())
        standby = sum(
            1 for i in registry.all() if i.state == InstanceState.STANDBY and i.role in SERVING_ROLES
        )
        status = 200 if ready or standby else 503
        body = {"status": "ok" if status == 200 else "unavailable", "ready_instances": ready,
                "standby_instances": standby}  # fmt: skip
        return JSONResponse(body, status)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.INSTANCES.clear()
        for instance in registry.all():
            metrics.INSTANCES.labels(instance.role.value, instance.state.value).inc()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/instances")
    async def instances() -> dict:
        """The instances behind this router (for `pdcluster status` and benchmarks)."""
        return {
            "instances": [
                {"instance_id": i.instance_id, "role": i.role.value, "url": i.url,
                 "state": i.state.value, "inflight": i.inflight, "index_blocks": index.num_blocks(i.instance_id)}
                for i in registry.all()
            ]
        }  # fmt: skip

    @app.get("/admin/store")
    async def store() -> dict:
        """The KV store's shards and their memory (used, stored, in flight, leased)."""
        from kvstore.client import StoreUnavailable, request_once

        members: list[str] = []  # the shards as now counted (nodes join and leave), else ours
        for endpoint in store_endpoints:
            with contextlib.suppress(StoreUnavailable):
                members = (await asyncio.to_thread(request_once, endpoint, {"op": "members"}, 5.0))["members"]
                break
        shards = []
        for endpoint in members or store_endpoints:
            try:
                stats = await asyncio.to_thread(request_once, endpoint, {"op": "stats"}, 5.0)
            except StoreUnavailable as exc:
                stats = {"error": str(exc)}
            shards.append({"endpoint": endpoint, **stats})
        return {"shards": shards}

    @app.post("/admin/explain")
    async def explain(request: Request) -> dict:
        """What the router sees of a request: its tokens, block hashes, and which instances hold
        how many of its leading blocks. Routes nothing."""
        kind = ChatCompletionRequest if b'"messages"' in await request.body() else CompletionRequest
        _, parsed = await admitted_request(request, kind)
        routing = await analyzer.analyze(parsed)
        return {
            "token_ids": analyzer.token_ids(parsed) if analyzer.hasher else None,
            "block_hashes": [str(h) for h in routing.block_hashes],
            "matched_blocks": index.match(routing.block_hashes),
            "kv_event_batches": listener.batches_applied if listener else 0,
        }

    return app
