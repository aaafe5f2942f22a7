"""The OpenAI-compatible HTTP front: routes, validation, error mapping."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.lifecycle import InstanceState
from router.admin import add_admin_routes
from router.admission import Admission, release_after
from router.analysis import RequestAnalyzer
from router.config import RouterConfig
from router.errors import BadRequest, ModelNotFound, PayloadTooLarge, RouterError, error_body
from router.instances import CapacityQueue, HealthMonitor, InstanceRegistry
from router.kv_events import STORE_HOLDER, KVEventListener
from router.kv_index import KVIndex
from router.placement import PlacementSettings, Placer
from router.policies import PolicyContext, make_policy
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from router.proxy import Forwarder
from transport.zmq_curve import KV_EVENTS_PLANE

log = logging.getLogger(__name__)
ERROR_RESPONSES = {
    status: {"description": description}
    for status, description in ((400, "Invalid request"), (401, "No or invalid API key"),
                                (404, "Unknown model"), (413, "Body too large"), (429, "Rate limited"),
                                (502, "Engine failed"), (503, "No ready instance"))
}


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
    if first.get("type") == "value_error" and not location:  # the request's own checks name the field
        message = str(first["ctx"]["error"])
        return message, message.partition(":")[0]
    param = ".".join(location) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def build_app(
    config: RouterConfig, registry: InstanceRegistry, store_endpoints: tuple[str, ...] = ()
) -> FastAPI:
    """The router's FastAPI app; its lifespan owns the HTTP client, the health monitor and the
    KV event listener."""
    index = KVIndex(config.max_index_blocks_per_instance, config.speculative_ttl_s)
    registry.on_remove.append(index.remove_holder)  # a departed instance's blocks route nothing
    context = PolicyContext(
        index=index, store_holders=frozenset({STORE_HOLDER} if store_endpoints else ()),
        prefill_tokens_per_s=config.prefill_tokens_per_s, fetch_cost=config.fetch_cost,
    )
    placer = Placer(PlacementSettings(config.remote_prefill_min_tokens, config.remote_prefill_max_queued_tokens),
                    make_policy(config.policy, context), make_policy(config.policy, context))
    credentials = config.credentials()
    analyzer = RequestAnalyzer(config)
    admission = Admission(config.api_keys, config.rate_limit_per_s, config.max_concurrency_per_key,
                          credentials.tenant_salt)
    if admission.open:
        log.warning("no API keys configured: anyone who reaches %s:%d may use it", config.host, config.port)
    queue = CapacityQueue(config.queue_max_waiting, config.queue_timeout_s)
    forwarder = Forwarder(config, registry, placer, queue, credentials.engine_headers())
    monitor = HealthMonitor(registry, config.health_interval_s, config.health_timeout_s,
                            config.health_failure_threshold, credentials.engine_headers())
    listener = (
        KVEventListener(index, config.kv_events_endpoint, registry.replay_endpoint_of,
                        credentials.curve(KV_EVENTS_PLANE))
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
            analyzer.close()

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
        incident = uuid.uuid4().hex[:12]  # the log has the exception; the client only this id
        log.exception("unexpected error (incident %s)", incident)
        return JSONResponse(error_body(f"internal error (incident {incident})", "InternalServerError", 500), 500)

    def check_model(request: SamplingRequest) -> None:
        if request.model != config.served_model_name:
            raise ModelNotFound(f"The model `{request.model}` does not exist.", param="model")

    def serving_instances():
        return registry.ready(lambda role: role.serves_clients)

    def parse(body: bytes, model: type[SamplingRequest]) -> SamplingRequest:
        # pydantic-core parses and validates the raw bytes in one pass, several times faster
        # than FastAPI's body handling; the schema is still published through openapi_extra.
        try:
            parsed = model.model_validate_json(body)
        except ValidationError as exc:
            raise BadRequest(*_validation_message(exc.errors())) from None
        check_model(parsed)
        return parsed

    async def bounded_body(request: Request) -> bytes:
        """The body, read as it arrives and refused once past the cap (chunked bodies too)."""
        too_large = PayloadTooLarge(f"request bodies are limited to {config.max_body_bytes} bytes")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > config.max_body_bytes:
                raise too_large
        return bytes(body)

    async def admitted_request(request: Request, model: type[SamplingRequest]) -> tuple[str, SamplingRequest]:
        """Authenticate, bound the body and the work, validate, and salt the cache with the
        caller's tenant."""
        key = admission.authenticate(request.headers.get("authorization"))
        parsed = parse(await bounded_body(request), model)
        if parsed.sequences() > config.max_sequences_per_request:
            raise BadRequest(f"at most {config.max_sequences_per_request} sequences (prompts x n) per request",
                             param="n")
        asked = getattr(parsed, "max_completion_tokens", None) or parsed.max_tokens
        if asked is not None and asked > config.max_model_len:
            raise BadRequest(f"max_tokens is limited to the model's {config.max_model_len} tokens",
                             param="max_tokens")
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
    async def models(request: Request) -> dict:
        admission.authenticate(request.headers.get("authorization"))
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
            1 for i in registry.all() if i.state == InstanceState.STANDBY and i.role.serves_clients
        )
        status = 200 if ready or standby else 503
        body = {"status": "ok" if status == 200 else "unavailable", "ready_instances": ready,
                "standby_instances": standby}
        return JSONResponse(body, status)

    add_admin_routes(app, credentials, analyzer, admitted_request, store_endpoints)
    return app
