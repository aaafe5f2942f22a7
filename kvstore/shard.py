"""A store shard: KV chunks in one registered host-memory arena, one shard per node.

`ChunkStore` (kvstore/chunk_store.py) is the bookkeeping. `ShardServer` owns the arena, registers it with
a NIXL agent so clients read and write it one-sided over UCX (RDMA on clusters, TCP or shared
memory here), and answers the small control messages (kvstore/messages.py: reserve, commit,
lease, release, contains, stats) on a ZMQ socket. `StoreShardActor` is the Ray actor that owns a
server: placement, lifetime and the handle the launcher and tests hold.

Only the cluster's members talk to a shard: its control socket is a CURVE server that admits the
store plane's client key alone (transport/zmq_curve.py), so a stranger learns neither the arena's
NIXL metadata nor any address in it. Every message is decoded and bounded before it is acted on;
a bad one gets an error reply and changes nothing. The NIXL data plane itself has no per-peer
access control (UCX admits any peer that knows the agent's metadata): shards and engines must
sit on a private network (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvstore import messages
from kvstore.chunk_store import PAGE_BYTES, ChunkStore, ShardStats
from security.credentials import CurveKeys, ShardKeys, runtime_dir, write_private
from transport.address import node_address
from transport.listener_warden import watched_listeners
from transport.nixl import Extent, new_agent
from transport.zmq_curve import Gate, serve_curve

log = logging.getLogger(__name__)
PROBE_BYTES = 64
"""A registered area of zeros apart from the arena, that a client reads once when it meets the
shard (kvstore/shard_client.py `_warm`): UCX sets up its connection then, not on a request's read."""


class ShardServer:
    """The arena, its NIXL registration and the control socket, served on a thread."""

    def __init__(self, capacity_bytes: int, keys: CurveKeys, host: str = "127.0.0.1", ttl_s: float = 30.0,
                 page_bytes: int = PAGE_BYTES, fault_injection: bool = False, port: int = 0,
                 on_death: Callable[[], None] | None = None):
        """Serves on `port` of `host` (0: any free port), to holders of the store plane's CURVE
        client key. `on_death` runs if the serving thread ever dies (the actor exits, and Ray
        restarts it: a shard that cannot answer must not look alive)."""
        import zmq

        self._context = zmq.Context()
        self._gate = Gate(self._context, keys)
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 1024**2)  # control messages only; UCX moves the data
        serve_curve(self._socket, keys)
        try:  # first: a port that is taken fails the shard before it holds any memory
            with watched_listeners():  # a stranger's silent connections shed, not kept 30 s
                if port:
                    self._socket.bind(f"tcp://{host}:{port}")
                else:
                    port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self._socket.close(0)
            self._gate.stop()
            self._context.term()
            raise
        self.endpoint = f"tcp://{host}:{port}"
        self.port = port
        self.boot_id = secrets.token_hex(8)
        """Changes with every start: a shard restarted on the same endpoint is a new one."""
        self.fault_injection = fault_injection  # tests only: honours the "corrupt" op
        self.store = ChunkStore(capacity_bytes, page_bytes)
        self.ttl_s = ttl_s
        self.arena = np.zeros(self.store.capacity_bytes, dtype=np.uint8)  # touched now, not mid-request
        self.base = self.arena.ctypes.data
        self.probe = np.zeros(PROBE_BYTES, dtype=np.uint8)  # what a new client reads first: no one's KV
        self.agent = new_agent("pdc-store")
        self._registration = self.agent.register_memory(
            [(self.base, self.arena.nbytes, 0, ""), (self.probe.ctypes.data, PROBE_BYTES, 0, "")], "DRAM")
        self.members: tuple[str, ...] = ()  # every shard of the store (set_members), unknown at first
        self.members_epoch = 0
        self.malformed = 0  # messages answered with an error before any op ran
        self._on_death = on_death
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pdc-store-shard", daemon=True)
        self._thread.start()

    @property
    def serving(self) -> bool:
        return self._thread.is_alive()

    def handle(self, request: messages.Request) -> dict:
        """The answer to one control message; every answer names the epoch of the member list
        this shard holds, so clients learn of a newer one (members) from any reply."""
        with self._lock:
            reply = self._answer(request, time.monotonic())
            reply.setdefault("members_epoch", self.members_epoch)
            return reply

    def set_members(self, endpoints: Sequence[str], epoch: int) -> None:
        """The store's shards as the launcher last counted them (epoch: its count's number; an
        older one is ignored)."""
        with self._lock:
            if epoch > self.members_epoch:
                self.members, self.members_epoch = tuple(endpoints), epoch

    def _answer(self, request: messages.Request, now: float) -> dict:
        self.store.expire(now)
        match request:
            case messages.Hello():
                return {"agent": self.agent.get_agent_metadata(), "page_bytes": self.store.page_bytes,
                        "probe": [self.probe.ctypes.data, PROBE_BYTES]}
            case messages.Reserve(nbytes=sizes) if max(sizes, default=0) > self.store.max_chunk_bytes:
                return {"error": f"chunks are limited to {self.store.max_chunk_bytes} bytes on this shard"}
            case messages.Reserve(keys=keys, nbytes=sizes, checksums=sums):
                granted = [self.store.reserve(k, n, c, now, self.ttl_s)
                           for k, n, c in zip(keys, sizes, sums, strict=True)]
                return {"extents": [self._absolute(e) if e else None for e in granted],
                        "agent_name": self.agent.name}
            case messages.Commit(keys=keys):
                return {"committed": sum(self.store.commit(k) for k in keys)}
            case messages.Abort(keys=keys):
                for key in keys:
                    self.store.abort(key)
                return {}
            case messages.Contains(keys=keys):
                return {"count": self.store.contains(keys)}
            case messages.Lease(keys=keys):
                leased = self.store.lease(keys, now, self.ttl_s)
                if leased is None:
                    return {"error": "too many reads in flight on this shard"}
                lease_id, chunks = leased
                for chunk in chunks:
                    chunk["extents"] = self._absolute(chunk["extents"])
                return {"lease": lease_id, "chunks": chunks, "agent_name": self.agent.name}
            case messages.Release(lease=lease_id, damaged=damaged):
                self.store.release(lease_id)
                for key in damaged:
                    self.store.reject(key)
                return {}
            case messages.Stats():
                return {**dataclasses.asdict(self.store.stats()), "pid": os.getpid(), "boot_id": self.boot_id,
                        "malformed": self.malformed, "refused_handshakes": self._gate.refused}
            case messages.Members():
                return {"members": list(self.members)}
            case messages.Corrupt(count=count) if self.fault_injection:
                return {"damaged": self.store.corrupt(self.arena, count)}
        return {"error": f"{type(request).__name__.lower()} is not served here"}

    def stats(self) -> ShardStats:
        with self._lock:
            self.store.expire(time.monotonic())
            return self.store.stats()

    def corrupt(self, count: int) -> int:
        with self._lock:
            return self.store.corrupt(self.arena, count)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._socket.close(0)
        self._gate.stop()
        self._context.term()
        self.agent.deregister_memory(self._registration)

    def _absolute(self, extents: list[Extent]) -> list[Extent]:
        return [(self.base + offset, length) for offset, length in extents]

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stopped.is_set():
                if poller.poll(200):
                    self._serve_one(self._socket.recv_multipart())
        except BaseException:
            if not self._stopped.is_set():
                log.exception("the store shard's serving thread died")
                if self._on_death is not None:
                    self._on_death()
            raise

    def _serve_one(self, frames: list[bytes]) -> None:
        """Answer one message. From a REQ client it is [identity, b"", payload]; anything else is
        answered with an error where it can be, and dropped otherwise."""
        if len(frames) < 2:
            self.malformed += 1
            return
        identity, payload = frames[0], frames[-1]
        try:
            if len(frames) != 3 or frames[1] != b"":
                raise messages.ProtocolError(f"expected [identity, empty, payload], got {len(frames)} frames")
            reply = self.handle(messages.decode(payload))
        except messages.ProtocolError as exc:
            self.malformed += 1
            reply = {"error": f"malformed request: {exc}"[:300], "members_epoch": self.members_epoch}
        except Exception as exc:  # a bug answering one request must not stop the shard
            log.exception("store shard failed to answer a request")
            reply = {"error": f"{type(exc).__name__}", "members_epoch": self.members_epoch}
        self._socket.send_multipart([identity, b"", messages.encode(reply)])


class StoreShardActor:
    """Ray actor body (deploy/launcher.py wraps it with `ray.remote`): one shard on this node,
    owned by this actor, serving on the node's address.

    When Ray restarts the actor after its process died (the launcher asks for restarts), the new
    shard serves on the port the old one had, kept in a file on the node: clients know shards by
    endpoint, and theirs reconnect by themselves. The restarted shard is empty (its reads are
    misses, recomputed) and has a new NIXL agent, which clients learn from its replies.

    It gets the keys a shard needs (`ShardKeys`), not the cluster's secret: Ray keeps an actor's
    arguments in its GCS."""

    def __init__(self, capacity_bytes: int, keys: ShardKeys, ttl_s: float = 30.0, fault_injection: bool = False):
        import ray

        self._keys = keys
        name = ray.get_runtime_context().get_actor_name() or f"unnamed-{os.getpid()}"
        self._port_file = runtime_dir() / f"store-shard-{name}.port"
        port = _previous_port(self._port_file)
        server = functools.partial(ShardServer, capacity_bytes, keys.store, node_address(),
                                   ttl_s, fault_injection=fault_injection, on_death=lambda: os._exit(1))
        try:
            self.server = server(port=port)
        except Exception:  # the old port is taken: serve anyway (clients of the old one miss)
            log.exception("store shard could not serve on its previous port %d again", port)
            self.server = server()
        write_private(self._port_file, str(self.server.port))

    def membership(self) -> dict:
        """This shard's endpoint, its boot id and the member list it holds (see
        ShardServer.set_members)."""
        if not self.server.serving:
            raise RuntimeError("the store shard no longer serves")
        return {"endpoint": self.server.endpoint, "epoch": self.server.members_epoch, "boot_id": self.server.boot_id,
                "members": list(self.server.members)}

    def prove(self, nonce: str) -> str:
        """That this actor holds the cluster's proof key (a launcher adopts only shards that do)."""
        return self._keys.prove(nonce)

    def set_members(self, endpoints: list[str], epoch: int) -> None:
        self.server.set_members(endpoints, epoch)

    def stats(self) -> dict:
        return dataclasses.asdict(self.server.stats())

    def close(self) -> None:
        self.server.close()
        self._port_file.unlink(missing_ok=True)


def _previous_port(path: Path) -> int:
    """The port a shard of this name served on before a restart (0: none, or nothing usable)."""
    try:
        return int(path.read_text()) if path.exists() and not path.is_symlink() else 0
    except ValueError:
        return 0
