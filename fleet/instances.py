"""The router's view of the engine instances, and the one place that changes it.

An `Instance` is a record: where its engine serves (a sealed endpoint opened into an
`EngineAccess`, security/engine_access.py), its role and model, and the state the router keeps of
it (lifecycle state, load, health, prefill circuit, the streams it relays). Only the
`InstanceRegistry` changes that state, through the methods below, on the router's event loop:
its owner (the launcher in deploy/, or the fleet follower) moves instances through their
lifecycle (`set_state`), the health monitor and the request path report what they saw
(`mark_failed`, `health_checked`, `request_started`...), and whoever watches (the KV event
listener, the index, the status views) registers observers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from engine.lifecycle import EngineDescription, InstanceState
from engine.role_spec import RoleSpec
from security.credentials import ClusterCredentials
from security.engine_access import EngineAccess

if TYPE_CHECKING:
    from decode.stream_ledger import StreamLedger

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Instance:
    """One engine as the router sees it. Its fields past `url` are the registry's to change."""

    instance_id: str
    role: RoleSpec
    url: str
    state: InstanceState = InstanceState.READY
    inflight: int = 0
    """Requests this router has sent there and not yet seen finish (prefills included)."""
    engine_load: int = 0
    """Requests the engine itself last said it holds, whichever router sent them (vLLM's server
    load, read by every router's health loop)."""
    pending_prefill_tokens: float = 0.0
    """Prompt tokens routed there whose prefill has not finished (the router's estimate)."""
    failed_checks: int = 0
    kv_events_endpoint: str | None = None
    """The engine's KV event PUB socket (None: it publishes none)."""
    kv_events_replay_endpoint: str | None = None
    """The engine's replay socket for missed KV event batches."""
    failed_prefills: int = 0
    """Remote prefills in a row that failed or timed out (P/D)."""
    prefill_open_until: float = 0.0
    """Monotonic time until which no remote prefill is sent here (the circuit is open)."""
    model: str = dataclasses.field(kw_only=True)
    """The served model name: only requests for it come here."""
    tensor_parallel_size: int = dataclasses.field(default=1, kw_only=True)
    """Devices (ranks) its engine spans: one instance all the same, to route to and to count."""
    kv_lease_s: float | None = dataclasses.field(default=None, kw_only=True)
    """P/D direct: how long its engine holds a prompt's KV for a decode (EngineDescription)."""
    streams: set[StreamLedger] = dataclasses.field(default_factory=set, compare=False, repr=False)
    """The migratable streams the router relays from it now, a continued one from the instance it
    went on to: which streams a fault there hits (GET /admin/instances lists each one's id and
    tokens sent). Other requests count in `inflight` only."""
    access: EngineAccess | None = dataclasses.field(default=None, kw_only=True, compare=False, repr=False)
    """How to reach its engine process: that process's certificate pinned, its token. None only
    for instances nobody sends to (tests of placement)."""

    def request_options(self, headers: dict[str, str] | None = None) -> dict:
        """aiohttp's keyword arguments for a request to this engine (its TLS context and token,
        and `headers`)."""
        if self.access is None:
            raise RuntimeError(f"instance {self.instance_id} was registered with no access to its engine")
        return {"ssl": self.access.ssl, "headers": {**self.access.headers, **(headers or {})}}

    @property
    def load(self) -> int:
        """Requests there as policies count them: this router's own (exact, at once) or the
        engine's (every router's, up to a health interval old), whichever is more."""
        return max(self.inflight, self.engine_load)

    def circuit_closed(self, now: float) -> bool:
        """Whether remote prefills may go here (P/D)."""
        return self.prefill_open_until <= now


def described_instance(description: EngineDescription, role: RoleSpec, credentials: ClusterCredentials) -> Instance:
    """The instance (of `role`) an engine host describes, its endpoint's seal checked (raises
    security.engine_access.EngineAccessRefused for one its instance's host did not seal, or none)."""
    access = credentials.engine_access(description.endpoint)
    return Instance(description.instance_id, role, access.url, description.state,
                    kv_events_endpoint=description.kv_events_endpoint,
                    kv_events_replay_endpoint=description.kv_events_replay_endpoint,
                    model=description.served_model_name, access=access,
                    tensor_parallel_size=description.tensor_parallel_size, kv_lease_s=description.kv_lease_s)


class PendingPrefill:
    """Prompt tokens routed to an instance and not yet prefilled, counted until the first byte
    (or the end of a non-streamed answer) comes back: the queue the cost model charges. Made by
    `InstanceRegistry.queue_prefill`; `done()` once (later calls do nothing)."""

    def __init__(self, instance: Instance, tokens: int) -> None:
        self.instance, self.tokens = instance, max(tokens, 0)
        instance.pending_prefill_tokens += self.tokens

    def done(self) -> None:
        self.instance.pending_prefill_tokens -= self.tokens
        self.tokens = 0


class InstanceRegistry:
    """Instances by id, and every change of their state. Used on the router's event loop only.

    Observers: `on_add` (the KV event listener subscribes to the instance), `on_remove` (the KV
    index forgets what it held), `on_request` (a policy or view that follows load: called with
    the instance and +1 when a request starts there, -1 when it ends)."""

    def __init__(self) -> None:
        self._instances: dict[str, Instance] = {}
        self.on_add: list[Callable[[Instance], None]] = []
        self.on_remove: list[Callable[[str], None]] = []
        self.on_request: list[Callable[[Instance, int], None]] = []

    # --- membership: its owner's (deploy/) ------------------------------------------------------

    def add(self, instance: Instance) -> None:
        if instance.instance_id in self._instances:
            raise ValueError(f"instance {instance.instance_id} is already registered")
        self._instances[instance.instance_id] = instance
        for callback in self.on_add:
            callback(instance)

    def remove(self, instance_id: str) -> Instance | None:
        instance = self._instances.pop(instance_id, None)
        if instance is not None:
            for callback in self.on_remove:
                callback(instance_id)
        return instance

    def set_state(self, instance: Instance, state: InstanceState, unless_moved_from: InstanceState | None = None) -> bool:
        """Move `instance` through its lifecycle (its owner's call: starts, drains, sleeps). With
        `unless_moved_from`, only if it is still in that state (the health monitor may have
        moved it meanwhile); whether it moved."""
        if unless_moved_from is not None and instance.state != unless_moved_from:
            return False
        instance.state = state
        return True

    # --- what the router sees ------------------------------------------------------------------

    def mark_failed(self, instance: Instance, reason: str) -> None:
        """Out of rotation, if it is in rotation (an instance draining, asleep or starting is
        its owner's to move)."""
        if instance.state == InstanceState.READY:
            log.warning("instance %s out of rotation: %s", instance.instance_id, reason)
            instance.state = InstanceState.FAILED

    def health_checked(self, instance: Instance, healthy: bool, failure_threshold: int) -> None:
        """A health check's answer: out of rotation after `failure_threshold` failed ones in a row,
        back after one that passed (only what it failed itself: others moved meanwhile)."""
        if healthy:
            instance.failed_checks = 0
            if instance.state == InstanceState.FAILED:
                log.info("instance %s back in rotation", instance.instance_id)
                instance.state = InstanceState.READY
            return
        instance.failed_checks += 1
        if instance.failed_checks >= failure_threshold:
            self.mark_failed(instance, f"{instance.failed_checks} failed health checks")

    @contextlib.contextmanager
    def request(self, instance: Instance) -> Iterator[None]:
        """A request (or a prefill) runs there for the block's length."""
        self.request_started(instance)
        try:
            yield
        finally:
            self.request_ended(instance)

    def request_started(self, instance: Instance) -> None:
        instance.inflight += 1
        for callback in self.on_request:
            callback(instance, +1)

    def request_ended(self, instance: Instance) -> None:
        instance.inflight -= 1
        for callback in self.on_request:
            callback(instance, -1)

    def engine_reported(self, instance: Instance, load: int) -> None:
        """What the engine said it holds (its health loop's reading of vLLM's server load)."""
        instance.engine_load = load

    def observed(self, instance: Instance, inflight: int, pending_prefill_tokens: float) -> None:
        """Load measured from outside this router's books (the simulator's engines)."""
        instance.inflight, instance.pending_prefill_tokens = inflight, pending_prefill_tokens

    def queue_prefill(self, instance: Instance, tokens: int) -> PendingPrefill:
        """`tokens` of prompt to prefill there, counted until the returned record's `done()`."""
        return PendingPrefill(instance, tokens)

    def prefill_succeeded(self, instance: Instance) -> None:
        instance.failed_prefills = 0

    def prefill_failed(self, instance: Instance, circuit_failures: int, circuit_s: float) -> bool:
        """A remote prefill failed or timed out there; after `circuit_failures` in a row no remote
        prefill goes there for `circuit_s` (whether the circuit opened now)."""
        instance.failed_prefills += 1
        if instance.failed_prefills < circuit_failures:
            return False
        instance.prefill_open_until = time.monotonic() + circuit_s
        return True

    def relays(self, instance: Instance, ledger: StreamLedger) -> None:
        """`instance` streams `ledger`'s request now."""
        instance.streams.add(ledger)

    def relayed(self, instance: Instance, ledger: StreamLedger) -> None:
        instance.streams.discard(ledger)

    # --- lookups ------------------------------------------------------------------------------

    def replay_endpoint_of(self, instance_id: str) -> str | None:
        instance = self._instances.get(instance_id)
        return instance.kv_events_replay_endpoint if instance else None

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def ready(self, where: Callable[[RoleSpec], bool] = lambda role: True, model: str | None = None) -> list[Instance]:
        """The ready instances whose role `where` accepts (of `model` only, if given)."""
        return [i for i in self._instances.values()
                if i.state == InstanceState.READY and where(i.role) and model in (None, i.model)]
