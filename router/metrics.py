"""The router's Prometheus metrics (served at GET /metrics), and the one definition of a
percentile that the router's own signals and every report use."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

from router.errors import RouterError
from router.placement import PlacementReason, PromptHits


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, interpolated between the two nearest ranks
    (numpy's default, and `vllm bench serve`'s): the pool controller's TTFT trigger and the load
    reports read the same number from the same samples."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

REQUESTS = Counter(
    "pdcluster_router_requests", "Requests answered, by endpoint and HTTP status.", ["endpoint", "status"]
)
TIME_TO_FIRST_BYTE = Histogram(
    "pdcluster_router_time_to_first_byte_seconds",
    "From the request's arrival to the engine's first response bytes (the first token when streaming).",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
)
REQUEST_LATENCY = Histogram(
    "pdcluster_router_request_seconds",
    "From the request's arrival to its last byte.",
    ["endpoint"],
    buckets=LATENCY_BUCKETS,
)
# Per-instance series are labelled `instance_id`: Prometheus's own `instance` label names the
# scraped target (the router), and a metric label of that name would be renamed `exported_instance`.
INFLIGHT = Gauge("pdcluster_router_inflight_requests", "Requests being served, by instance.", ["instance_id"])
RETRIES = Counter(
    "pdcluster_router_retries", "Requests moved to another instance before any byte was streamed."
)
MIGRATIONS = Counter(
    "pdcluster_router_migrations", "Streams continued on another instance after their engine's stream broke."
)
INSTANCES = Gauge(
    "pdcluster_router_instances", "Instances known to the router, by role and state.", ["role", "state"]
)
PREFILLS = Counter(
    "pdcluster_router_prefills",
    "Where requests to decode instances were prefilled: remote, local (short or no prefill pool), "
    "local_busy (the prefill instance had more queued than --remote-prefill-max-queued-tokens), "
    "fallback_local (the remote prefill failed).",
    ["where"],
)
KV_HANDOVER_PROMPT_TOKENS = Counter(
    "pdcluster_router_kv_handover_prompt_tokens",
    "Prompt tokens of requests whose KV a prefill instance computed and handed over to a decode "
    "instance (one hand-over per pdcluster_router_prefills_total{where=\"remote\"}). Tokens, not "
    "bytes: the router does not see the KV; each token's KV is 2 x layers x KV heads x head size "
    "x dtype bytes of the model, and pdcluster_store_stored_bytes shows what the store holds.",
)
REMOTE_PREFILL = Histogram(
    "pdcluster_router_remote_prefill_seconds",
    "Remote prefills that handed KV over: from sending the request to a prefill instance to its "
    "answer (through the store, its KV is stored by then). The rest of a P/D request's time to "
    "first token is the decode instance's: loading that KV and its first step.",
    buckets=LATENCY_BUCKETS,
)
KV_EVENTS_REJECTED = Counter(
    "pdcluster_router_kv_events_rejected",
    "KV event messages dropped: undecodable, forged or of an unknown instance (the listener goes on).",
)
QUEUED = Gauge("pdcluster_router_queued_requests", "Requests waiting for an instance to become ready.")
QUEUE_WAIT = Histogram(
    "pdcluster_router_queue_wait_seconds",
    "How long requests waited for an instance to become ready.",
    buckets=LATENCY_BUCKETS,
)
ERRORS = Counter(
    "pdcluster_router_errors",
    "Errors the router answered to clients, by OpenAI error type and HTTP status (a stream that "
    "breaks after its first byte counts in pdcluster_router_requests_total, status 502).",
    ["kind", "status"],
)
PROMPT_BLOCKS = Counter(
    "pdcluster_router_prompt_blocks",
    "Full KV blocks of routed prompts by where the router's index found them: 'instance' (in the "
    "chosen instance's prefix cache), 'store' (not there but in the KV store), 'none' (computed).",
    ["found"],
)



def _all_subclasses(cls: type) -> list[type]:
    return [cls] + [sub for direct in cls.__subclasses__() for sub in _all_subclasses(direct)]


# Each known label set starts at 0: a rate() sees the first error, hit or hand-over (a series
# that first appears at 1 shows no increase to Prometheus).
for _error in _all_subclasses(RouterError):
    ERRORS.labels(_error.type, str(_error.status))
for _found in ("instance", "store", "none"):
    PROMPT_BLOCKS.labels(_found)
FALLBACK_LOCAL = "fallback_local"
"""The prefills metric's label of a request whose remote prefill failed (its decode instance prefilled)."""
for _where in {r.prefilled_where for r in PlacementReason} - {None} | {FALLBACK_LOCAL}:
    PREFILLS.labels(_where)

# Filled at scrape time from the router's state (router/status.py scrape_metrics).
PENDING_PREFILL_TOKENS = Gauge(
    "pdcluster_router_pending_prefill_tokens",
    "Prompt tokens routed to an instance whose prefill has not finished (the router's estimate).",
    ["instance_id"],
)
INSTANCE_DEVICES = Gauge(
    "pdcluster_router_instance_devices", "Devices (tensor-parallel ranks) each instance's engine spans.", ["instance_id"]
)
INDEX_BLOCKS = Gauge(
    "pdcluster_router_index_blocks", "KV blocks the router's index holds for each instance.", ["instance_id"]
)
RECENT_START_STAGES = Gauge(
    "pdcluster_router_recent_start_stage_seconds",
    "Each stage's duration in the last engine starts (router/status.py StartLog, at most 50; "
    "pdcluster_engine_start_stage_seconds has all starts, by path and stage).",
    ["instance_id", "path", "stage"],
)
STORE_SHARD_UP = Gauge(
    "pdcluster_store_shard_up", "1 if the KV store shard answered the scrape's Stats request, else 0.", ["shard"]
)
STORE_CAPACITY = Gauge("pdcluster_store_capacity_bytes", "A KV store shard's arena.", ["shard"])
STORE_USED = Gauge(
    "pdcluster_store_used_bytes", "Pages a KV store shard has handed out (stored and reserved chunks).", ["shard"]
)
STORE_STORED = Gauge("pdcluster_store_stored_bytes", "Payload of a shard's committed chunks.", ["shard"])
STORE_RESERVED = Gauge("pdcluster_store_reserved_bytes", "Pages held by writes in flight.", ["shard"])
STORE_CHUNKS = Gauge("pdcluster_store_chunks", "Committed chunks in a KV store shard.", ["shard"])
STORE_GAUGES = {"capacity_bytes": STORE_CAPACITY, "used_bytes": STORE_USED, "stored_bytes": STORE_STORED,
                "reserved_bytes": STORE_RESERVED, "chunks": STORE_CHUNKS}
"""Each shard's Stats field and the gauge it fills."""


def count_prompt_hits(hits: PromptHits) -> None:
    if hits.blocks:
        PROMPT_BLOCKS.labels("instance").inc(hits.instance)
        PROMPT_BLOCKS.labels("store").inc(hits.store)
        PROMPT_BLOCKS.labels("none").inc(hits.blocks - hits.instance - hits.store)


def _totals(counter: Counter, label: str | None = None) -> dict[str, float]:
    """A counter's `_total` samples summed by one label's value (all under "" without one)."""
    sums: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels.get(label, "") if label else ""
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def prompt_blocks_by_source() -> dict[str, int]:
    return {found: int(value) for found, value in _totals(PROMPT_BLOCKS, "found").items()}


def requests_answered() -> int:
    """Requests the engines answered through this router (errors the router answers itself are
    counted by router.status.ErrorLog)."""
    return int(sum(_totals(REQUESTS).values()))


def observe_request(endpoint: str, status: int, started: float, first_byte: bool) -> None:
    """Record a request the engines answered (`started`: its time.perf_counter() at arrival);
    `first_byte` when its end was also its first byte (not streamed)."""
    elapsed = time.perf_counter() - started
    if first_byte:
        TIME_TO_FIRST_BYTE.labels(endpoint).observe(elapsed)
    REQUEST_LATENCY.labels(endpoint).observe(elapsed)
    REQUESTS.labels(endpoint, str(status)).inc()
