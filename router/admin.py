"""The operator's routes: /metrics and /admin/*, behind the cluster's admin token.

They show which instances exist and where, what the index holds, every tenant's request counts
and timings: nothing a client should read. `pdcluster status`, load tests and Prometheus send
`Authorization: Bearer <admin token>` (security/credentials.py; Prometheus: `bearer_token_file`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import metrics
from router.admission import Admitted
from router.analysis import RequestAnalyzer
from router.errors import Unauthorized
from router.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from security.credentials import ClusterCredentials, bearer_matches
from transport.zmq_curve import STORE_PLANE

AdmitRequest = Callable[[Request, type[SamplingRequest]], Awaitable[Admitted]]


def add_admin_routes(app: FastAPI, credentials: ClusterCredentials, analyzer: RequestAnalyzer,
                     admitted_request: AdmitRequest, store_endpoints: tuple[str, ...]) -> None:
    """Add /metrics and /admin/* to `app` (its state holds registry, index and listener)."""

    def admin_only(request: Request) -> None:
        if not bearer_matches(request.headers.get("authorization"), credentials.admin_token):
            raise Unauthorized("this endpoint needs the cluster's admin token")

    routes = APIRouter(dependencies=[Depends(admin_only)])
    registry, index = app.state.registry, app.state.index

    @routes.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.INSTANCES.clear()
        for instance in registry.all():
            metrics.INSTANCES.labels(instance.role.name, instance.state.value).inc()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/admin/instances")
    async def instances() -> dict:
        """The instances behind this router (for `pdcluster status` and benchmarks)."""
        return {
            "instances": [
                {"instance_id": i.instance_id, "role": i.role.name, "url": i.url,
                 "state": i.state.value, "inflight": i.inflight, "index_blocks": index.num_blocks(i.instance_id),
                 "kv_events_replay_endpoint": i.kv_events_replay_endpoint}
                for i in registry.all()
            ],
            "kv_events_endpoint": app.state.config.kv_events_endpoint,
        }

    @routes.get("/admin/store")
    async def store() -> dict:
        """The KV store's shards and their memory (used, stored, in flight, leased)."""
        from kvstore import protocol
        from kvstore.client import StoreUnavailable, request_once
        
        keys = credentials.curve(STORE_PLANE)
        members: list[str] = []  # the shards as now counted (nodes join and leave), else ours
        for endpoint in store_endpoints:
            with contextlib.suppress(StoreUnavailable):
                members = (await asyncio.to_thread(request_once, endpoint, protocol.Members(), 5.0, keys))["members"]
                break
        shards = []
        for endpoint in members or store_endpoints:
            try:
                stats = await asyncio.to_thread(request_once, endpoint, protocol.Stats(), 5.0, keys)
            except StoreUnavailable as exc:
                stats = {"error": str(exc)}
            shards.append({"endpoint": endpoint, **stats})
        return {"shards": shards}

    @routes.post("/admin/explain")
    async def explain(request: Request) -> dict:
        """What the router sees of a request: its tokens, block hashes, and which instances hold
        how many of its leading blocks. Routes nothing."""
        kind = ChatCompletionRequest if b'"messages"' in await request.body() else CompletionRequest
        admitted = await admitted_request(request, kind)
        parsed = admitted.request
        routing = await analyzer.analyze(parsed, admitted.body_bytes)
        listener = app.state.listener
        return {
            "token_ids": analyzer.token_ids(parsed) if analyzer.hasher else None,
            "block_hashes": [str(h) for h in routing.block_hashes],
            "matched_blocks": index.match(routing.block_hashes),
            "kv_event_batches": listener.batches_applied if listener else 0,
        }

    app.include_router(routes)
