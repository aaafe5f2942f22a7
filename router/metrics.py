"""The router's Prometheus metrics (served at GET /metrics), and the one definition of a
percentile that the router's own signals and every report use."""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram


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
INFLIGHT = Gauge("pdcluster_router_inflight_requests", "Requests being served.", ["instance"])
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
REMOTE_PREFILL = Histogram(
    "pdcluster_router_remote_prefill_seconds",
    "Remote prefills that handed KV over: from sending the request to a prefill instance to its "
    "answer (through the store, its KV is stored by then). The rest of a P/D request's time to "
    "first token is the decode instance's: loading that KV and its first step.",
    buckets=LATENCY_BUCKETS,
)
KV_EVENTS_REJECTED = Counter(
    "pdcluster_router_kv_events_rejected",
    "KV event messages dropped because they did not decode (the listener goes on).",
)
QUEUED = Gauge("pdcluster_router_queued_requests", "Requests waiting for an instance to become ready.")
QUEUE_WAIT = Histogram(
    "pdcluster_router_queue_wait_seconds",
    "How long requests waited for an instance to become ready.",
    buckets=LATENCY_BUCKETS,
)
