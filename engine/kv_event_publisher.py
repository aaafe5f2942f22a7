"""vLLM's KV event publisher, kept inside the cluster.

vLLM publishes each engine's BlockStored / BlockRemoved events on a ZMQ PUB socket and answers
anyone who asks its replay socket for the recent ones, token ids included: everyone's prompts,
to anyone who reaches the port. `ClusterEventPublisher` is vLLM's own publisher with both sockets
bound on the engine's address as CURVE servers that admit only the plane's client key (every
router of the cluster subscribes to the PUB socket and asks the replay socket), and with token
ids, extra keys (cache salts) and session ids left out of every event: a router routes on block
hashes alone. Its sockets are bound on ports the system picks (the configured port is 0), which it
then prints (KV_EVENTS_MARK) for the engine's host to publish: no port is named before it is held.

vLLM builds its publisher from a registry in the engine-core process; a vLLM general plugin
(entry point `vllm.general_plugins`: `pdcluster_kv_events`) puts this class in place of its "zmq"
publisher there, in engines of ours only (those started with their keys in their environment;
engine/server_command.py names only our plugins in VLLM_PLUGINS).
vLLM falls back to its plain publisher, silently, where the entry point is missing, so a host
refuses to start an engine with KV events there (engine/server_command.py,
`kv_events_plugin_installed`). A plugin that is installed but fails to import in the engine's
processes vLLM only logs ("Failed to load plugin"): that case is not caught.

With KV_EVENTS_COST_ENV set (seconds), the publisher prints what it cost the engine core so far,
every that many seconds while it publishes (KV_EVENTS_COST_MARK, then JSON): the seconds spent in
`publish` on the engine core's loop thread, the CPU seconds of vLLM's sending thread, and the
loop thread's own CPU seconds, all since the first batch. loadtest/engine_extras.py reads it: an
estimate of the publisher's share of the loop where A/B throughput runs are too noisy to give
one (not in it: vLLM's making of the events, and ZMQ's own I/O thread, which encrypts and sends
off the GIL).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import msgspec
import zmq
from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, ZmqEventPublisher

from engine.environment import KV_EVENTS_COST_ENV, KV_EVENTS_COST_MARK, KV_EVENTS_MARK
from security.credentials import EngineKeys
from transport.listener_warden import watched_listeners
from transport.zmq_curve import Gate, serve_curve

_gates: dict[int, Gate] = {}  # one ZAP handler per ZMQ context


def cost_interval_s() -> float | None:
    """KV_EVENTS_COST_ENV's seconds; None when unset or not a positive number (never an error:
    a plugin that fails to import leaves vLLM's own publisher, which serves token ids, in place)."""
    try:
        seconds = float(os.environ.get(KV_EVENTS_COST_ENV, ""))
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


_COST_INTERVAL_S = cost_interval_s()


class ClusterEventPublisher(ZmqEventPublisher):
    replay_requests = 0
    """Messages taken off the replay socket so far (well-formed requests or not)."""
    REPLAYS_PER_TURN = 256
    """Replay requests served at one turn of vLLM's publishing loop (events are published between turns)."""

    def __init__(self, *args, **kwargs) -> None:
        self._cost: PublisherCost | None = None
        super().__init__(*args, **kwargs)

    def _socket_setup(self) -> None:
        keys = EngineKeys.load().kv_events
        if id(self._ctx) not in _gates:
            _gates[id(self._ctx)] = Gate(self._ctx, keys)
        if self._pub is None:
            # Bound on the engine's own address (vLLM binds only wildcard endpoints): every
            # router of the cluster subscribes here, with the plane's client key.
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(self._hwm)
            serve_curve(self._pub, keys)
            with watched_listeners():  # a stranger's silent connections shed, not kept 30 s
                self._endpoint = _bound(self._pub, self._endpoint)
        if self._replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            serve_curve(self._replay, keys)
            with watched_listeners():
                self._replay_endpoint = _bound(self._replay, self._replay_endpoint)
        print(KV_EVENTS_MARK + json.dumps({"endpoint": self._endpoint, "replay_endpoint": self._replay_endpoint}),
              flush=True)

    def _service_replay(self) -> None:
        """Every replay request waiting, up to REPLAYS_PER_TURN. vLLM's loop serves one per turn
        and then waits up to 0.1 s for an event: 10 requests a second on an idle engine (measured
        here), so a burst of 10,000 (a member's malformed ones,
        tests/unit/kv_events/test_kv_event_attacks.py) would take 17 minutes to get through.
        Publishing comes first: with an event queued it stops after one, so a member's flood of replay requests (each may resend every buffered batch) never
        holds back the engine's events."""
        for _ in range(self.REPLAYS_PER_TURN):
            self.replay_requests += 1
            super()._service_replay()
            if not self._replay.poll(0) or not self._event_queue.empty():
                return

    def publish(self, events) -> None:
        started = time.perf_counter()
        super().publish(msgspec.structs.replace(events, events=[_blinded(e) for e in events.events]))
        if _COST_INTERVAL_S is not None:
            self._count_cost(started, _COST_INTERVAL_S)

    def _count_cost(self, started: float, interval_s: float) -> None:
        now = time.perf_counter()
        if self._cost is None:
            self._cost = PublisherCost(threading.get_ident(), self._thread.ident, started)
        self._cost.add(now - started)
        if now - self._cost.reported_at >= interval_s:
            self._cost.reported_at = now
            print(KV_EVENTS_COST_MARK + json.dumps(self._cost.so_far(now)), flush=True)


class PublisherCost:
    """What publishing has cost since the first batch: time in `publish` on the loop thread, and
    CPU time of the sending thread and of the loop thread (their clocks, from the first batch on:
    the loop's start-up work, compile and graph capture, is left out)."""

    def __init__(self, loop_thread: int, sender_thread: int, first_at: float) -> None:
        self._loop_clock = time.pthread_getcpuclockid(loop_thread)
        self._sender_clock = time.pthread_getcpuclockid(sender_thread)
        self._loop_cpu0, self._sender_cpu0 = time.clock_gettime(self._loop_clock), time.clock_gettime(self._sender_clock)
        self.first_at = self.reported_at = first_at
        self.batches, self.publish_s = 0, 0.0

    def add(self, seconds: float) -> None:
        self.batches += 1
        self.publish_s += seconds

    def so_far(self, now: float) -> dict[str, float]:
        return {"batches": self.batches, "publish_s": self.publish_s, "wall_s": now - self.first_at,
                "sender_cpu_s": time.clock_gettime(self._sender_clock) - self._sender_cpu0,
                "loop_cpu_s": time.clock_gettime(self._loop_clock) - self._loop_cpu0}


def _bound(socket: zmq.Socket, endpoint: str) -> str:
    """Bind `socket` to `endpoint` (port 0: one the system picks); the endpoint it is bound on."""
    if endpoint.startswith("tcp://[") or endpoint.count(":") > 2:
        socket.ipv6 = True
    socket.bind(endpoint)
    return socket.last_endpoint.decode()


ROUTING_FIELDS = frozenset({"block_hashes", "parent_block_hash", "block_size", "lora_id", "lora_name", "medium",
                            "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"})
"""What a router may read of a stored block: its hash, its place and its cache group. Every other
field of vLLM's BlockStored (token ids, extra keys with cache salts, session ids, whatever a later
vLLM adds) goes out blank."""


def blanked_fields(struct_type: type[msgspec.Struct]) -> dict:
    """The blank value of every field of `struct_type` outside ROUTING_FIELDS: its default, or the
    first of an empty list, None, "" and 0 that its type admits (the routers decode these events
    with vLLM's types). Taken from the installed vLLM's struct: vLLM 0.26's has no `session_id`,
    and replacing a field the struct lacks raised in the engine core at its first stored block."""
    blanks = {}
    for field in msgspec.structs.fields(struct_type):
        if field.name in ROUTING_FIELDS:
            continue
        if field.default is not msgspec.NODEFAULT:
            blanks[field.name] = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            blanks[field.name] = field.default_factory()
        else:
            blanks[field.name] = _empty_value(field.type)
    return blanks


def _empty_value(annotation):
    for candidate in ([], None, "", 0):
        with contextlib.suppress(msgspec.ValidationError):
            return msgspec.convert(candidate, annotation)
    raise TypeError(f"no blank value for a field of type {annotation!r}")


_BLANKED = blanked_fields(BlockStored)


def _blinded(event):
    """The event without what would tell a reader the prompt: block hashes are enough to route."""
    if isinstance(event, BlockStored):
        return msgspec.structs.replace(event, **_BLANKED)
    return event


def register() -> None:
    """vLLM general plugin: in an engine of ours, our publisher stands for vLLM's "zmq" one (its
    config accepts no other name)."""
    if EngineKeys.present():
        EventPublisherFactory._registry["zmq"] = ClusterEventPublisher
