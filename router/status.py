"""What GET /admin/status answers: the router's state gathered into one `ClusterStatus`
(router/status_model.py), and the bounded logs that only this view keeps.

    StartLog      the last engine starts, stage by stage (the launcher hands each one over
                  through a callback: the router never imports deploy/)
    PlacementLog  the last requests' placements, each candidate as the policy saw it
    ErrorLog      the last errors answered to clients (and errors_total by kind)
    read_shards   every KV store shard's Stats, as GET /admin/store and the metrics scrape read them
    cluster_status(app, ...) -> ClusterStatus
    scrape_metrics(app, ...)  the gauges GET /metrics fills from the same state at scrape time
    engine_metrics / engine_scrape_targets  vLLM's own /metrics of each engine, relayed, and the
                  Prometheus HTTP service discovery that lists them: Prometheus never holds the
                  engine token (it drives engines), only the admin token, and the router fetches
                  only engines of its registry, by id (never a URL or path from the caller)

Hazards: a store shard is asked over ZMQ with a blocking client, so `read_shards` runs it in a
thread with a timeout per shard (a dead shard costs its timeout, never the event loop). Error
messages are the router's own (its error classes, pydantic's messages): never a prompt or a key.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import aiohttp
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from engine.lifecycle import InstanceState
from fleet.instances import Instance, InstanceRegistry
from router import metrics
from router.errors import EngineFailed
from router.placement import Placement
from router.status_model import (
    ClusterStatus,
    ErrorRecord,
    HitRates,
    InstanceStatus,
    PlacementRecord,
    PoolStatus,
    RequestCounts,
    ShardStatus,
    StartRecord,
)
from security.credentials import CurveKeys

MAX_RECORDS = 50
"""Starts, placements and errors kept for the status view (ClusterStatus promises at most 50 of
each)."""
MAX_MESSAGE_CHARS = 300
SHARD_TIMEOUT_S = 5.0
SCRAPE_SHARD_TIMEOUT_S = 2.0
"""Shorter at scrape time: within Prometheus's default scrape timeout (10 s) with a shard down."""
ENGINE_METRICS_TIMEOUT_S = 5.0
SCRAPED_STATES = frozenset({InstanceState.READY, InstanceState.DRAINING})
"""Engines whose vLLM server runs and answers /metrics (a standby has none yet)."""


class StartLog:
    """The last `MAX_RECORDS` engine starts, oldest first."""

    def __init__(self, size: int = MAX_RECORDS) -> None:
        self._records: collections.deque[StartRecord] = collections.deque(maxlen=size)

    def record(self, start: StartRecord) -> None:
        self._records.append(start)

    def recent(self) -> list[StartRecord]:
        return list(self._records)


class PlacementLog:
    """The last `MAX_RECORDS` placements, oldest first. Kept as the placement step made them,
    ids and counts only (no instance, whose streams hold prompts), and made into records when
    read: a request pays for no record it may never be asked for."""

    def __init__(self, size: int = MAX_RECORDS) -> None:
        self._placements: collections.deque[tuple] = collections.deque(maxlen=size)

    def record(self, model: str, prompt_tokens: int, placement: Placement, migrated: bool = False) -> None:
        prefill = placement.prefill.instance_id if placement.prefill else None
        self._placements.append((time.time(), model, prompt_tokens, placement.hits.blocks, placement.reason.value,
                                 placement.serve.instance.instance_id, prefill, placement.candidates, migrated))

    def recent(self) -> list[PlacementRecord]:
        return [PlacementRecord(
            at=at, model=model, prompt_tokens=tokens, prompt_blocks=blocks, reason=reason, chosen=chosen,
            prefill=prefill, candidates=list(candidates),
            migrated=migrated,
        ) for at, model, tokens, blocks, reason, chosen, prefill, candidates, migrated in self._placements]


class ErrorLog:
    """The last `MAX_RECORDS` errors answered on the OpenAI routes, oldest first; each also counts in
    pdcluster_router_errors_total{kind, status}."""

    def __init__(self, size: int = MAX_RECORDS) -> None:
        self._records: collections.deque[ErrorRecord] = collections.deque(maxlen=size)
        self.total = 0

    def record(self, kind: str, status: int, message: str) -> None:
        """Count it; list it unless it is a 401 (anyone can send those, and they would push the
        errors worth reading out of the list)."""
        self.total += 1
        metrics.ERRORS.labels(kind, str(status)).inc()
        if status != 401:
            self._records.append(ErrorRecord(at=time.time(), kind=kind, status=status,
                                             message=message[:MAX_MESSAGE_CHARS]))

    def recent(self) -> list[ErrorRecord]:
        return list(self._records)


def serving_counts(registry: InstanceRegistry) -> tuple[int, int]:
    """(ready, standby) instances that serve clients: requests can be served while either is
    non-zero (a standby is activated for them: a scaled-to-zero pool is not down)."""
    serving = [i for i in registry.all() if i.role.serves_clients]
    ready = sum(1 for i in serving if i.state == InstanceState.READY)
    standby = sum(1 for i in serving if i.state.is_standby)
    return ready, standby


async def read_shards(endpoints: tuple[str, ...], keys: CurveKeys,
                      timeout_s: float = SHARD_TIMEOUT_S) -> list[dict]:
    """Each KV store shard's Stats answer (kvstore/chunk_store.py ShardStats and the shard's own
    counters) with its endpoint, or {"endpoint", "error"} for one that did not answer. The shards
    are those the first answering endpoint counts now (nodes join and leave), else `endpoints`."""
    from kvstore import messages
    from kvstore.shard_control import StoreUnavailable, request_once

    members: list[str] = []
    for endpoint in endpoints:
        with contextlib.suppress(StoreUnavailable):
            answer = await asyncio.to_thread(request_once, endpoint, messages.Members(), timeout_s, keys)
            members = answer["members"]
            break

    async def stats(endpoint: str) -> dict:
        try:
            return {"endpoint": endpoint,
                    **await asyncio.to_thread(request_once, endpoint, messages.Stats(), timeout_s, keys)}
        except StoreUnavailable as exc:
            return {"endpoint": endpoint, "error": str(exc)}

    return list(await asyncio.gather(*(stats(e) for e in members or endpoints)))


def hit_rates() -> HitRates:
    """Prompt blocks of routed requests by where they were found, from the router's counters."""
    found = metrics.prompt_blocks_by_source()
    return HitRates(prompt_blocks=sum(found.values()), instance_hit_blocks=found.get("instance", 0),
                    store_hit_blocks=found.get("store", 0))


def _pools(registry: InstanceRegistry) -> list[PoolStatus]:
    by_pool: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for instance in registry.all():
        by_pool[instance.model, instance.role.name][instance.state.value] += 1
    return [PoolStatus(model=model, role=role, states=dict(states)) for (model, role), states in sorted(by_pool.items())]


async def cluster_status(app: FastAPI, store_endpoints: tuple[str, ...], store_keys: CurveKeys) -> ClusterStatus:
    """The snapshot every operator view draws (app.state: registry, index, queue, config, starts,
    placements, errors)."""
    state = app.state
    registry, index = state.registry, state.index
    instances = [
        InstanceStatus(instance_id=i.instance_id, model=i.model, role=i.role.name, state=i.state.value, url=i.url,
                       inflight=i.inflight, pending_prefill_tokens=i.pending_prefill_tokens,
                       index_blocks=index.num_blocks(i.instance_id), tensor_parallel_size=i.tensor_parallel_size)
        for i in registry.all()
    ]
    shards = [ShardStatus.model_validate(s) for s in await read_shards(store_endpoints, store_keys)] \
        if store_endpoints else []
    ready, standby = serving_counts(registry)
    # a P/D request counts once: where it is served, not where it was prefilled
    inflight = sum(i.inflight for i in registry.all() if i.role.serves_clients)
    return ClusterStatus(
        generated_at=time.time(), models=[m.name for m in state.config.models],
        health="ok" if ready or standby else "unavailable",
        requests=RequestCounts(served=metrics.requests_answered() + state.errors.total, inflight=inflight,
                               queued=state.queue.waiting),
        pools=_pools(registry), instances=instances, starts=state.starts.recent(), hit_rates=hit_rates(),
        store=shards, recent_placements=state.placements.recent(), recent_errors=state.errors.recent(),
    )


async def scrape_metrics(app: FastAPI, store_endpoints: tuple[str, ...], store_keys: CurveKeys) -> None:
    """Set the gauges that mirror state (instances by role and state, each instance's load, the
    last starts' stages, each store shard's memory) from app.state, just before GET /metrics
    renders them: an instance, start or shard that left leaves no stale series."""
    registry, index = app.state.registry, app.state.index
    for gauge in (metrics.INSTANCES, metrics.INFLIGHT, metrics.PENDING_PREFILL_TOKENS, metrics.INDEX_BLOCKS,
                  metrics.INSTANCE_DEVICES, metrics.RECENT_START_STAGES):
        gauge.clear()
    for start in app.state.starts.recent():
        for stage, seconds in start.stages_s.items():
            metrics.RECENT_START_STAGES.labels(start.instance_id, start.path, stage).set(seconds)
    for instance in registry.all():
        metrics.INSTANCES.labels(instance.role.name, instance.state.value).inc()
        metrics.INFLIGHT.labels(instance.instance_id).set(instance.inflight)
        metrics.PENDING_PREFILL_TOKENS.labels(instance.instance_id).set(instance.pending_prefill_tokens)
        metrics.INDEX_BLOCKS.labels(instance.instance_id).set(index.num_blocks(instance.instance_id))
        metrics.INSTANCE_DEVICES.labels(instance.instance_id).set(instance.tensor_parallel_size)
    if not store_endpoints:
        return
    shards = await read_shards(store_endpoints, store_keys, SCRAPE_SHARD_TIMEOUT_S)
    for gauge in (metrics.STORE_SHARD_UP, *metrics.STORE_GAUGES.values()):
        gauge.clear()
    for shard in shards:
        endpoint = shard["endpoint"]
        metrics.STORE_SHARD_UP.labels(endpoint).set(0 if "error" in shard else 1)
        for field, gauge in metrics.STORE_GAUGES.items():
            if field in shard:
                gauge.labels(endpoint).set(shard[field])


class ScrapeTargetGroup(BaseModel):
    """One entry of Prometheus's HTTP service discovery answer (http_sd_config)."""

    targets: list[str]
    labels: dict[str, str]


def engine_scrape_targets(registry: InstanceRegistry, router_netloc: str, scheme: str) -> list[ScrapeTargetGroup]:
    """Each running engine as a target on this router (`router_netloc`: its host:port), scraped
    through the relay with the admin token Prometheus already has."""
    return [
        ScrapeTargetGroup(targets=[router_netloc], labels={
            "__metrics_path__": f"/admin/engines/{i.instance_id}/metrics", "__scheme__": scheme,
            "instance_id": i.instance_id, "role": i.role.name})
        for i in registry.all() if i.state in SCRAPED_STATES
    ]


async def engine_metrics(instance: Instance, session: aiohttp.ClientSession) -> Response:
    """`instance`'s vLLM /metrics, fetched with `session` (the health monitor's: no proxy) within
    ENGINE_METRICS_TIMEOUT_S; 502 if it does not answer."""
    try:
        async with session.get(f"{instance.url}/metrics", timeout=aiohttp.ClientTimeout(total=ENGINE_METRICS_TIMEOUT_S),
                               **instance.request_options()) as answer:
            status, content = answer.status, await answer.read()
            media_type = answer.headers.get("content-type", "text/plain")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineFailed(f"engine {instance.instance_id} did not answer its metrics: {type(exc).__name__}") from None
    if status != 200:
        raise EngineFailed(f"engine {instance.instance_id} answered its metrics with HTTP {status}")
    return Response(content, media_type=media_type)
