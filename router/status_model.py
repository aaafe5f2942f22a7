"""What an operator sees of a running cluster: one typed snapshot, served as JSON at
GET /admin/status and drawn by the status page (GET /status), `pdcluster status` and
`pdcluster top`. Every view reads this model and nothing else, so they show the same state."""

from __future__ import annotations

from pydantic import BaseModel, Field, computed_field

from router.placement import CandidateView


class InstanceStatus(BaseModel):
    instance_id: str
    model: str
    role: str
    """prefill, decode or colocated."""
    state: str
    """engine.lifecycle.InstanceState's value: standby, loading, warming, ready, draining, ..."""
    url: str
    inflight: int
    """Requests the router has sent there and not yet seen finish."""
    pending_prefill_tokens: float
    index_blocks: int
    """KV blocks of this instance in the router's index."""
    tensor_parallel_size: int = 1
    """Devices (ranks) its engine spans."""


class PoolStatus(BaseModel):
    model: str
    role: str
    states: dict[str, int]
    """Instances of this model and role by state (only states with at least one instance)."""


class StartRecord(BaseModel):
    """One engine start, stage by stage (engine.lifecycle.StartTimeline)."""

    instance_id: str
    role: str
    path: str
    """disk, peer, standby_start or standby (an activation)."""
    started_at: float
    """Unix time the start was asked for."""
    total_s: float
    stages_s: dict[str, float]
    """Each stage's duration, in the order the stages ran."""


class HitRates(BaseModel):
    """Prompt KV blocks of routed requests found where the request went, since the router started."""

    prompt_blocks: int
    instance_hit_blocks: int
    """Already in the chosen instance's prefix cache (as the router's index saw it)."""
    store_hit_blocks: int
    """Not there, but in the KV store (loaded instead of recomputed)."""

    @computed_field
    @property
    def instance_hit_rate(self) -> float | None:
        return self.instance_hit_blocks / self.prompt_blocks if self.prompt_blocks else None

    @computed_field
    @property
    def store_hit_rate(self) -> float | None:
        return self.store_hit_blocks / self.prompt_blocks if self.prompt_blocks else None


class ShardStatus(BaseModel):
    endpoint: str
    capacity_bytes: int | None = None
    used_bytes: int | None = None
    chunks: int | None = None
    error: str | None = None
    """Why this shard did not answer (the other fields are then None)."""


class PlacementRecord(BaseModel):
    """Where one request went and why: a hot spot shows as one instance chosen over and over
    with the longest queue."""

    at: float
    """Unix time."""
    model: str
    prompt_tokens: int
    prompt_blocks: int
    reason: str
    """router.placement.PlacementReason: colocated, short, no_prefill, local_busy, remote."""
    chosen: str
    """The instance that served it."""
    prefill: str | None
    """The instance that prefilled it first (P/D), if any."""
    candidates: list[CandidateView]
    """Each serving candidate as the policy weighed it (router.placement.CandidateView)."""
    migrated: bool = False
    """The continuation of a stream whose engine broke (router/relay.py), not a new request."""


class ErrorRecord(BaseModel):
    at: float
    """Unix time."""
    kind: str
    """The OpenAI error type (e.g. RateLimitError, ServiceUnavailableError)."""
    status: int
    message: str


class RequestCounts(BaseModel):
    served: int
    """Requests answered since the router started, any status."""
    inflight: int
    queued: int
    """Waiting for an instance to become ready."""


class ClusterStatus(BaseModel):
    generated_at: float
    models: list[str]
    """The served model names, as /v1/models lists them."""
    health: str
    """ok or unavailable, as GET /health says."""
    requests: RequestCounts
    pools: list[PoolStatus]
    instances: list[InstanceStatus]
    starts: list[StartRecord] = Field(default_factory=list)
    """The last starts, oldest first (at most 50)."""
    hit_rates: HitRates
    store: list[ShardStatus] = Field(default_factory=list)
    recent_placements: list[PlacementRecord] = Field(default_factory=list)
    """The last requests' placements, oldest first (at most 50)."""
    recent_errors: list[ErrorRecord] = Field(default_factory=list)
    """The last errors answered to clients on the OpenAI routes, oldest first (at most 50; 401s
    only counted): each with its status's fixed description (or, for a 500, the incident id),
    never the client's own message, which may quote its request."""
