"""The OpenAI-compatible HTTP front: the router's parts put together (`build_app`), its routes
and error mapping. A request's way: `Intake` (router/admission.py: key, body, validation,
tenant salt) -> `RequestAnalyzer` (router/analysis.py: tokens, block hashes) -> `Forwarder`
(router/proxy.py: placement, the prefill elsewhere, the engine, the stream back)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from fleet.instances import InstanceRegistry
from router.admin import add_admin_routes
from router.admin_auth import basic_password_matches
from router.admission import (
    Admission,
    Intake,
    KeyLimits,
    Limits,
    LocalLimits,
    release_after,
    validation_message,
)
from router.analysis import RequestAnalyzer
from router.capacity import CapacityQueue
from router.config import RouterConfig
from router.errors import BadRequest, RouterError, Unauthorized, error_body
from router.health import HealthMonitor
from router.kv_event_listener import STORE_HOLDER, KVEventListener
from router.kv_index import KVIndex
from router.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from router.placement import PlacementSettings, Placer
from router.policies import PolicyContext, make_policy
from router.proxy import Forwarder
from router.status import ErrorLog, StartLog, serving_counts
from router.status_page import add_status_page
from router.streaming import EngineStream
from router.tracing import NO_SPAN, RequestTrace, RouterTracing
from security.credentials import ClusterCredentials, bearer_matches
from transport.guarded_server import GuardedServer
from transport.listener_guard import ListenerLimits, guarded_protocol
from transport.zmq_curve import KV_EVENTS_PLANE

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)
ERROR_DESCRIPTIONS = {400: "Invalid request", 401: "No or invalid API key", 404: "Unknown model or route",
                      413: "Body too large", 429: "Rate limited", 502: "Engine failed", 503: "No ready instance"}
ERROR_RESPONSES = {status: {"description": description} for status, description in ERROR_DESCRIPTIONS.items()}


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


def import_ahead() -> None:
    """Import what `build_app` imports lazily (transformers' tokenizers, vLLM's hashing and KV
    event types: seconds), e.g. in a thread while the engines start."""
    import transformers  # noqa: F401
    import vllm.distributed.kv_events  # noqa: F401
    import vllm.utils.hashing  # noqa: F401


def build_app(
    config: RouterConfig, registry: InstanceRegistry, store_endpoints: tuple[str, ...] = (),
    starts: StartLog | None = None, limits: Limits | None = None,
) -> FastAPI:
    """The router's FastAPI app; its lifespan owns the HTTP client, the health monitor and the
    KV event listener. `starts`: where whoever starts engines records each start (the status view);
    `limits`: where the per-key limits are kept (the router's own when not given)."""
    credentials = config.credentials()
    index = KVIndex(config.max_index_blocks_per_instance, config.speculative_ttl_s)
    registry.on_remove.append(index.remove_holder)  # a departed instance's blocks route nothing
    placer = _placer(config, index, store_endpoints)
    limits = limits or LocalLimits(KeyLimits(config.rate_limit_per_s, config.concurrency_per_key))
    admission = Admission(config.api_keys, limits, credentials.tenant_salt)
    if admission.open:
        log.warning("no API keys configured: anyone who reaches %s:%d may use it", config.host, config.port)
    analyzer = RequestAnalyzer(config)
    queue = CapacityQueue(config.queue_max_waiting, config.queue_timeout_s)
    forwarder = Forwarder(config, registry, placer, queue)
    monitor = HealthMonitor(registry, config.health_interval_s, config.health_timeout_s,
                            config.health_failure_threshold)
    listener = _kv_event_listener(registry, index, credentials)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        monitor.start()
        limits.start()
        listener.start()
        analyzer.start()
        try:
            yield
        finally:
            await monitor.stop()
            await limits.stop()
            await listener.stop()
            await forwarder.close()
            analyzer.close()
            if tracing:
                await asyncio.to_thread(tracing.shutdown)  # exports the spans still batched

    # Off: no OpenTelemetry set-up at all (router/tracing.py).
    tracing = RouterTracing(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
    # no /docs, /redoc or /openapi.json for anyone: the operator's is /admin/openapi.json
    app = FastAPI(title="pdcluster router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tracing = tracing
    app.state.registry, app.state.queue, app.state.first_tokens = registry, queue, forwarder.first_tokens
    app.state.config, app.state.index, app.state.listener = config, index, listener
    app.state.monitor, app.state.admission = monitor, admission
    # retire(instance_id) drains and stops an instance: set by whoever owns the engines.
    app.state.retire, app.state.retiring = None, set()
    app.state.starts, app.state.errors = starts or StartLog(), ErrorLog()
    app.state.placements = forwarder.placements
    intake = Intake(config, admission)
    _add_error_handlers(app)
    _add_openai_routes(app, intake, analyzer, forwarder)
    add_admin_routes(app, credentials, analyzer, intake.admit, store_endpoints)
    add_status_page(app, credentials)
    return app


def router_server(app: FastAPI, freeze_heap: bool = True, **uvicorn_settings) -> uvicorn.Server:
    """uvicorn's server for the router's `app` (host and port from its RouterConfig) under its
    guarded listener (transport/guarded_server.py, transport/listener_guard.py): accepts bounded
    per turn of the loop, a connection bare until its request head is in, connections capped in
    all and per
    client address, deadlines for headers and bodies; a connection counts as proven, and is
    never displaced by a newcomer, once a request on it carries a tenant's API key or the admin
    token (any request, with no API keys configured). uvicorn's logs go to the process's own
    handlers (router/log_limit.py limits their repeats there)."""
    import uvicorn

    config: RouterConfig = app.state.config
    admission: Admission = app.state.admission
    admin_token = config.credentials().admin_token

    def proves(headers: list[tuple[bytes, bytes]]) -> bool:
        authorization = next((value for name, value in headers if name == b"authorization"), b"").decode("latin-1")
        if bearer_matches(authorization, admin_token) or basic_password_matches(authorization, admin_token):
            return True
        try:
            admission.authenticate(authorization)
        except Unauthorized:
            return False
        return True

    limits = ListenerLimits(max_connections=config.max_connections, max_per_address=config.max_connections_per_address,
                            max_pending=config.max_pending_connections,
                            header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s)
    # asyncio's loop where uvicorn makes one (`run()`): GuardedServer runs on no other.
    # `freeze_heap`: off where the router shares a process (tests).
    settings = {"log_level": "warning", "log_config": None, "loop": "asyncio", **uvicorn_settings}
    return GuardedServer(uvicorn.Config(app, host=config.host, port=config.port,
                                        http=guarded_protocol("router", limits, proves=proves), **settings),
                         freeze_heap=freeze_heap)


def _placer(config: RouterConfig, index: KVIndex, store_endpoints: tuple[str, ...]) -> Placer:
    """The placement step with the configured policy for both the serving and the prefill choice,
    the store counted as a holder when there is one."""
    context = PolicyContext(
        index=index, store_holders=frozenset({STORE_HOLDER} if store_endpoints else ()),
        fetch_cost=config.fetch_cost, request_cost_tokens=config.request_cost_tokens,
    )
    return Placer(PlacementSettings(config.remote_prefill_min_tokens, config.remote_prefill_max_queued_tokens),
                  make_policy(config.policy, context), make_policy(config.policy, context.for_prefill()),
                  index=index, store_holders=context.store_holders)


def _kv_event_listener(registry: InstanceRegistry, index: KVIndex,
                       credentials: ClusterCredentials) -> KVEventListener:
    """The listener that feeds `index`, following the KV events of every instance `registry`
    holds, now and from now on."""
    listener = KVEventListener(index, registry.replay_endpoint_of, credentials.curve(KV_EVENTS_PLANE))
    for instance in registry.all():  # registered before the router was built (started, adopted)
        listener.follow(instance.instance_id, instance.kv_events_endpoint)
    registry.on_add.append(lambda instance: listener.follow(instance.instance_id, instance.kv_events_endpoint))
    registry.on_remove.append(listener.unfollow)
    return listener


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI shapes it, those of clients' routes kept in the recent errors
    (app.state.errors); an unexpected one names an incident, never its text."""
    errors: ErrorLog = app.state.errors

    def record(request: Request, kind: str, status: int, message: str) -> None:
        """Clients' errors only (an operator's 401 on /admin is none), each under its status's
        fixed description: the client's message may quote its own request (a model name, a field)."""
        if request.url.path.startswith("/v1/"):
            errors.record(kind, status, message if status == 500 else ERROR_DESCRIPTIONS.get(status, kind))

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> JSONResponse:
        record(request, exc.type, exc.status, exc.message)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = BadRequest(*validation_message(exc.errors()))
        record(request, error.type, error.status, error.message)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "InvalidRequestError"
        record(request, kind, exc.status_code, str(exc.detail))
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        incident = uuid.uuid4().hex[:12]  # the log has the exception; the client only this id
        log.exception("unexpected error (incident %s)", incident)
        record(request, "InternalServerError", 500, f"internal error (incident {incident})")
        return JSONResponse(error_body(f"internal error (incident {incident})", "InternalServerError", 500), 500)


def _add_openai_routes(app: FastAPI, intake: Intake, analyzer: RequestAnalyzer, forwarder: Forwarder) -> None:
    """POST /v1/completions and /v1/chat/completions (admission, analysis, forwarding), GET
    /v1/models and /health."""
    config, registry, tracing = app.state.config, app.state.registry, app.state.tracing

    def serving(model: str):
        return lambda: registry.ready(lambda role: role.serves_clients, model)

    async def serve(request: Request, model: type[SamplingRequest], endpoint: str) -> Response:
        trace = tracing.begin(request.headers, endpoint) if tracing else None
        release = None
        try:
            with trace.stage("pdcluster.admission") if trace else NO_SPAN:
                admitted = await intake.admit(request, model)
                release = await intake.admission.admit(admitted.key)
            with trace.stage("pdcluster.analysis") if trace else NO_SPAN:
                routing = await analyzer.analyze(admitted.request, admitted.body_bytes)
            response = await forwarder.forward(endpoint, admitted.request.forwarded(),
                                               serving(admitted.request.model), routing, trace)
        except BaseException as exc:
            if release:
                release()
            if trace:
                trace.fail(exc)
            raise
        _release_when_done(response, release, trace)
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
        intake.admission.authenticate(request.headers.get("authorization"))
        created = int(time.time())
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": created, "owned_by": "pdcluster",
                                            "max_model_len": m.max_model_len} for m in config.models]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while requests can be served: by a ready instance, or by a standby the pool
        controller activates for them (a scaled-to-zero pool is not down)."""
        ready, standby = serving_counts(registry)
        status = 200 if ready or standby else 503
        body = {"status": "ok" if status == 200 else "unavailable", "ready_instances": ready,
                "standby_instances": standby}
        return JSONResponse(body, status)


def _release_when_done(response: Response, release: Callable[[], None], trace: RequestTrace | None) -> None:
    """Give the request's slot back and end its span when `response` is done: a stream's at its
    last byte or when its client leaves, any other's now."""
    if isinstance(response, EngineStream):
        response.body_iterator = release_after(response.body_iterator, release)
        response.on_abandon.append(release)
        if trace:  # the request's span ends with the stream's last byte
            response.body_iterator = trace.until_end(response.body_iterator)
            response.on_abandon.append(lambda: trace.finish(499))
    else:
        release()
        if trace:
            trace.finish(response.status_code)
