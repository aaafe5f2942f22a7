"""The operator's routes: /metrics and /admin/*, behind the cluster's admin token.

They show which instances exist and where, what the index holds, every tenant's request counts
and timings: nothing a client should read. `pdcluster status`, load tests and Prometheus send
`Authorization: Bearer <admin token>` (security/credentials.py; Prometheus: `bearer_token_file`);
a browser (the status page) sends it as a Basic password, for reads only (router/status_page.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.admin_auth import require_admin
from router.admission import OPEN_TENANT, Admitted
from router.analysis import RequestAnalyzer
from router.openai_requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from router.status import (
    ScrapeTargetGroup,
    cluster_status,
    engine_metrics,
    engine_scrape_targets,
    read_shards,
    scrape_metrics,
)
from router.status_model import ClusterStatus
from security.credentials import ClusterCredentials, CurveKeys
from transport.zmq_curve import STORE_PLANE

AdmitRequest = Callable[[Request, type[SamplingRequest], str | None], Awaitable[Admitted]]


def add_admin_routes(app: FastAPI, credentials: ClusterCredentials, analyzer: RequestAnalyzer,
                     admitted_request: AdmitRequest, store_endpoints: tuple[str, ...]) -> None:
    """Add /metrics and /admin/* to `app` (its state holds registry, index and listener)."""
    routes = APIRouter(dependencies=[Depends(require_admin(credentials))])  # Bearer, or Basic for reads
    _add_cluster_routes(routes, app, store_endpoints, credentials.curve(STORE_PLANE))
    _add_engine_routes(routes, app)
    _add_explain_route(routes, app, analyzer, admitted_request)
    app.include_router(routes)


def _add_cluster_routes(routes: APIRouter, app: FastAPI, store_endpoints: tuple[str, ...],
                        store_keys: CurveKeys) -> None:
    """What the cluster holds and does: Prometheus' metrics, the instances, the store, the status."""
    registry, index = app.state.registry, app.state.index

    @routes.get("/metrics")
    async def prometheus_metrics() -> Response:
        await scrape_metrics(app, store_endpoints, store_keys)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/admin/instances")
    async def instances() -> dict:
        """The instances behind this router (for `pdcluster status` and benchmarks). `streams`:
        the migratable streams this router relays from each now, by the id their client sees on
        every event, with the tokens sent so far (what a fault there would hit: loadtest.faults).
        `endpoint`: the engine's sealed endpoint (nothing secret: with the cluster's secret it
        opens into an access, `ClusterCredentials.engine_access`)."""
        return {
            "instances": [
                {"instance_id": i.instance_id, "role": i.role.name, "url": i.url,
                 "state": i.state.value, "inflight": i.inflight, "index_blocks": index.num_blocks(i.instance_id),
                 "tensor_parallel_size": i.tensor_parallel_size,
                 "kv_events_endpoint": i.kv_events_endpoint, "kv_events_replay_endpoint": i.kv_events_replay_endpoint,
                 "endpoint": dataclasses.asdict(i.access.endpoint) if i.access else None,
                 "streams": [{"id": s.stream_id, "tokens_sent": len(s.sent_token_ids)} for s in i.streams]}
                for i in registry.all()
            ],
        }

    @routes.get("/admin/openapi.json", include_in_schema=False)
    async def openapi() -> dict:
        """The router's OpenAPI document: its routes and request schemas, for the operator's tools
        (a fuzzer, a client generator). Not served to anyone else: /docs, /redoc and
        /openapi.json are off (they told strangers every route, and the Swagger page loaded its
        script from a CDN)."""
        return app.openapi()

    @routes.get("/admin/store")
    async def store() -> dict:
        """The KV store's shards and their memory (used, stored, in flight, leased)."""
        return {"shards": await read_shards(store_endpoints, store_keys)}

    @routes.get("/admin/status")
    async def status() -> ClusterStatus:
        """The whole cluster in one typed snapshot (router/status_model.py): what the status
        page, `pdcluster status` and `pdcluster top` draw."""
        return await cluster_status(app, store_endpoints, store_keys)


def _add_engine_routes(routes: APIRouter, app: FastAPI) -> None:
    """Each engine's own metrics, relayed, and where Prometheus finds them."""
    registry = app.state.registry

    @routes.get("/admin/engines/{instance_id}/metrics")
    async def engine_metrics_relay(instance_id: str) -> Response:
        """vLLM's own metrics of one engine of the registry (Prometheus holds no engine token)."""
        instance = registry.get(instance_id)
        if instance is None:
            raise StarletteHTTPException(404, f"no instance {instance_id!r} behind this router")
        return await engine_metrics(instance, app.state.monitor.session)

    @routes.post("/admin/instances/{instance_id}/drain", status_code=202)
    async def drain(instance_id: str) -> dict:
        """Take an instance out of its pool as a planned shrink does: it takes no new request and
        finishes what it holds (what is left at the deadline goes on elsewhere), then stops; the
        pool controller starts another if its pool falls below its floor. Only the router that
        owns the fleet may (202: under way; /admin/instances shows it draining, then gone)."""
        if app.state.retire is None:
            raise StarletteHTTPException(409, "this router owns no engine (launch --router-only)")
        if registry.get(instance_id) is None:
            raise StarletteHTTPException(404, f"no instance {instance_id!r} behind this router")
        task = asyncio.create_task(app.state.retire(instance_id), name=f"drain-{instance_id}")
        app.state.retiring.add(task)
        task.add_done_callback(app.state.retiring.discard)
        return {"draining": instance_id}

    @routes.get("/admin/prometheus_sd", response_model=list[ScrapeTargetGroup])
    async def prometheus_sd(request: Request) -> JSONResponse:
        """Prometheus HTTP service discovery: every running engine, scraped through the relay above
        at the router's own address (never the request's Host header, which a proxy in between
        could let a caller choose, and with it where Prometheus sends its token)."""
        config = app.state.config
        groups = engine_scrape_targets(registry, f"{config.host}:{config.port}", request.url.scheme)
        return JSONResponse([g.model_dump() for g in groups], headers={"Cache-Control": "no-store"})


def _add_explain_route(routes: APIRouter, app: FastAPI, analyzer: RequestAnalyzer,
                       admitted_request: AdmitRequest) -> None:
    index = app.state.index

    @routes.post("/admin/explain")
    async def explain(request: Request) -> dict:
        """What the router sees of a request: its tokens, block hashes, and which instances hold
        how many of its leading blocks, as `?tenant=NAME`'s request (its cache salt; the open
        tenant's by default). Routes nothing."""
        kind = ChatCompletionRequest if b'"messages"' in await request.body() else CompletionRequest
        admitted = await admitted_request(request, kind, request.query_params.get("tenant", OPEN_TENANT))
        parsed = admitted.request
        routing = await analyzer.analyze(parsed, admitted.body_bytes)
        return {
            "token_ids": analyzer.token_ids(parsed),
            "block_hashes": [str(h) for h in routing.block_hashes],
            "matched_blocks": index.match(routing.block_hashes),
            "kv_event_batches": app.state.listener.batches_applied,
        }
