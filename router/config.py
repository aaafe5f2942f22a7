"""The router's typed configuration."""

from __future__ import annotations

import secrets
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from engine.config import KVHashing, OtlpEndpoint
from engine.environment import is_loopback
from router.placement import DEFAULT_REMOTE_PREFILL_MIN_TOKENS
from router.policies import DEFAULT_REQUEST_COST_TOKENS
from security.credentials import ClusterCredentials

DEFAULT_CONCURRENCY_PER_KEY = 64
"""Requests one API key may have in flight when the operator set no bound (each at most
`max_sequences_per_request` sequences): a tenant cannot take every engine's batch alone."""


class ServedModel(BaseModel):
    """One model the router serves, each with its own instances."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    """The model name clients send (the engines' served model name)."""
    max_model_len: int = Field(ge=1)
    tokenizer: Path | None = None
    """Model folder whose tokenizer the router hashes prompts with; None routes on load only."""


class RouterConfig(BaseModel):
    # No error quotes its input: it holds the API keys and the cluster secret, and deploy/serve.py
    # prints the error.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    host: str = "127.0.0.1"
    """Address the HTTP endpoint binds to."""
    port: int = Field(8000, ge=0, le=65535)
    models: tuple[ServedModel, ...] = Field(min_length=1)
    """The models clients may ask for (/v1/models lists them); a request goes only to instances
    of its model."""
    policy: str = "kv_aware"
    """Routing policy: a name in router.policies.POLICIES, or module:Class."""
    kv_hashing: KVHashing = KVHashing()
    """The engines' (their block size, seed and hash algorithm: the router's hashes are theirs)."""
    speculative_ttl_s: float = Field(2.0, gt=0)
    """How long a just-routed request's blocks count as held before an event confirms them."""
    max_index_blocks_per_instance: int = Field(1_000_000, ge=1)
    fetch_cost: float = Field(0.05, ge=0, le=1)
    """Fetching a block from the KV store costs this share of computing it."""
    request_cost_tokens: float = Field(DEFAULT_REQUEST_COST_TOKENS, ge=0)
    """What one request in flight on an instance costs a new one there, in prompt tokens
    computed (kv_aware; router/policies/kv_aware.py says why)."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Longest wait to open a connection to an engine."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for an engine's next bytes of a response (raise for very long generations)."""
    stream_stall_s: float = Field(30.0, gt=0)
    """Longest gap between an engine's events once its stream has begun: past it the engine counts
    as broken and the stream goes on elsewhere (decode/stream_ledger.py), as if it had died."""
    max_request_s: float = Field(3600.0, gt=0)
    """Longest a whole request may take, streaming included."""
    max_attempts: int = Field(2, ge=1)
    """Instances tried for a request that failed before any byte was streamed."""
    structured_migration: bool = False
    """Streams under a grammar (JSON schema or object, regex, EBNF, choice) migrate too: the
    engines then load the grammar-continuation processor (EngineConfig.structured_migration; one
    flag sets both)."""
    max_migrations: int = Field(1, ge=0)
    """Times a stream whose engine broke goes on from its sent tokens on another instance
    (decode/stream_ledger.py); 0: it ends with an error event."""
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    health_failure_threshold: int = Field(2, ge=1)
    remote_prefill_min_tokens: int = Field(DEFAULT_REMOTE_PREFILL_MIN_TOKENS, ge=0)
    """P/D: a request whose uncached prompt part is shorter is prefilled by its decode instance."""
    remote_prefill_max_queued_tokens: int | None = Field(None, ge=0)
    """P/D: when the chosen prefill instance already has more prompt tokens routed to it and not
    yet prefilled, the decode instance prefills locally: shorter TTFT while the prefill pool is
    the bottleneck, at the cost of decode steps that wait behind that prefill. None: always remote."""
    prefill_timeout_s: float = Field(60.0, gt=0)
    """P/D: longest wait for a prefill instance; past it the decode instance prefills locally.
    Shorter for a prefill instance with a KV lease (prefill/handoff.py `PrefillHop.deadline_s`)."""
    prefill_circuit_failures: int = Field(2, ge=1)
    """P/D: failed or timed-out remote prefills in a row after which an instance gets none..."""
    prefill_circuit_s: float = Field(30.0, gt=0)
    """...for this long (then one request tries it again)."""
    queue_max_waiting: int = Field(256, ge=0)
    """Requests that may wait for an instance to become ready (scale-up); beyond: 503."""
    queue_timeout_s: float = Field(30.0, ge=0)
    """Longest a request waits for an instance to become ready; 0 answers 503 at once."""
    api_keys: dict[str, str] = Field(default_factory=dict, repr=False)
    """API key -> tenant. Empty: the endpoint is open to anyone who can reach it. Never printed."""
    rate_limit_per_s: float | None = Field(None, gt=0)
    """Requests per second per API key (a token bucket); None: unlimited."""
    max_concurrency_per_key: int | None = Field(None, ge=1)
    """Requests in flight per API key; None: DEFAULT_CONCURRENCY_PER_KEY when API keys are
    configured (one tenant's work stays bounded unless the operator raises it), else unlimited."""
    max_connections: int = Field(16384, ge=64)
    """Client connections held at once (lowered to fit the process's descriptor limit). A new one
    past it takes the place of the oldest that has not yet sent an authorized request (an idle
    or half-sent one), or is refused (transport/listener_guard.py)."""
    max_connections_per_address: int = Field(1024, ge=1)
    """The same, from one client address (raise it behind a balancer whose address every client
    shares)."""
    max_pending_connections: int = Field(1024, ge=1)
    """Connections held at once that have not yet sent an authorized request; past it a new one
    takes the place of the oldest of them. Each holds up to 16 KiB of its request head while bare,
    and ~30 objects for the collector to walk once it has a protocol
    (transport/listener_guard.py ListenerLimits.max_pending)."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Longest a client may take to send a request's headers (from its first byte, or the
    connection's opening): past it the connection is closed."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Longest a client may take to send a request's body once its headers are in."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body accepted (413 beyond), counted as it arrives (chunked bodies too)."""
    tokenize_processes: int = Field(1, ge=1)
    """Processes that tokenize long prompts (short ones are tokenized on the event loop)."""
    tokenize_max_waiting: int = Field(64, ge=0)
    """Long prompts that may wait for a tokenizing process; beyond, 503 with Retry-After."""
    tokenize_timeout_s: float = Field(10.0, gt=0)
    """Longest a prompt may take to tokenize (400 beyond)."""
    max_chars_per_token: int = Field(64, ge=1)
    """A prompt longer than max_model_len x this many characters cannot fit: refused untokenized."""
    max_sequences_per_request: int = Field(16, ge=1)
    """Prompts x n of one request at most (400 beyond): one request's work stays bounded."""
    otlp_traces_endpoint: OtlpEndpoint | None = None
    """Export one OpenTelemetry trace per request over OTLP/gRPC there (router/tracing.py); None:
    tracing off, at no cost."""
    allow_remote: bool = False
    """Allow binding beyond loopback (for a cluster's head node; needs API keys)."""
    cluster_secret: SecretStr = Field(default_factory=lambda: SecretStr(secrets.token_hex(32)))
    """The cluster's secret (security/credentials.py), the engines' too: the router presents the
    engine token to them, checks the admin token on /admin/* and /metrics, and derives tenant
    salts from it."""

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_and_tenants_are_text(cls, value: object) -> object:
        """Checked here, not by pydantic's own check, whose error would name the key as its location."""
        if not (isinstance(value, dict)
                and all(isinstance(key, str) and key and isinstance(tenant, str) for key, tenant in value.items())):
            raise ValueError("api_keys must map each API key (non-empty text) to its tenant (text)")
        return value

    @property
    def concurrency_per_key(self) -> int | None:
        """Requests in flight per API key: the configured bound, or the default one for tenants."""
        if self.max_concurrency_per_key is not None or not self.api_keys:
            return self.max_concurrency_per_key
        return DEFAULT_CONCURRENCY_PER_KEY

    @model_validator(mode="after")
    def _distinct_models(self) -> RouterConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be distinct: {names}")
        return self

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> RouterConfig:
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(f"host {self.host} is not loopback; set allow_remote to bind it")
        if not is_loopback(self.host) and not self.api_keys:
            raise ValueError(f"the router would serve anyone who reaches {self.host}: give it API keys "
                             "(--api-keys-file) to bind beyond loopback")
        return self

    def served(self, name: str) -> ServedModel | None:
        """The served model clients call `name`, if any."""
        return next((m for m in self.models if m.name == name), None)

    @property
    def block_size(self) -> int:
        return self.kv_hashing.block_size

    def credentials(self) -> ClusterCredentials:
        return ClusterCredentials.from_hex(self.cluster_secret.get_secret_value())
