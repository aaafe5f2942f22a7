"""ZMQ listeners under a stranger's floods (docs/security.md, attack 11.5): a store shard's control
socket and an engine's KV-event sockets accept every connection in ZMQ's own I/O thread and keep
a silent one 30 s; the listener warden (transport/listener_warden.py) sheds those that send no
greeting and pauses the listeners while too many are open. Another local user's 20,000 idle
connections and 50,000 connect-and-close calls at the shard leave its descriptors bounded and it
answers its members; the KV-event sockets, behind the same warden, take a smaller flood each (the
full one's minutes are spent once, on the shard) and still publish and replay to the router."""

from __future__ import annotations

import asyncio
import os
import resource
from urllib.parse import urlparse

import pytest
from flood import connect_and_close, idle_connections, open_descriptors
from kv_event_parts import listener_for, publisher, stored, until
from stranger import needs_stranger
from test_store_attacks import KEYS, answered

from kvstore import messages
from kvstore.shard import ShardServer
from router.kv_index import KVIndex
from security.credentials import ClusterCredentials
from transport.listener_warden import SILENT_CAP

pytestmark = [pytest.mark.slow, needs_stranger]
CREDENTIALS = ClusterCredentials.load()  # the session's (tests/conftest.py)


def ceiling() -> int:
    """Descriptors the floods may add at most: the warden's cap on silent connections, the
    listeners' backlogs and what arrives between two of its looks, far under the limit."""
    return min(4096 + SILENT_CAP, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)


def test_a_store_shards_control_socket_answers_through_idle_and_churning_strangers():
    shard = ShardServer(4 * 1024**2, KEYS, page_bytes=64 * 1024)
    try:
        port = urlparse(shard.endpoint).port
        calm = open_descriptors(os.getpid())
        with idle_connections(port, 20_000, send="") as held:
            assert answered(shard.endpoint, KEYS, messages.Hello(), timeout_s=10)
            assert open_descriptors(os.getpid()) - calm < ceiling()
        assert held["opened"] + held["failed"] == 20_000
        connect_and_close(port, 50_000)
        assert answered(shard.endpoint, KEYS, messages.Hello(), timeout_s=10)
        assert open_descriptors(os.getpid()) - calm < 64
    finally:
        shard.close()


async def test_an_engines_kv_event_sockets_publish_and_replay_through_a_strangers_floods(monkeypatch):
    monkeypatch.setenv(*CREDENTIALS.engine_host_keys("colocated-0").new_process("127.0.0.1").as_env().popitem())
    engine = publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "engine-a")
    index = KVIndex()
    listener = listener_for(index, {"engine-a": engine._replay_endpoint}.get)
    try:
        calm = open_descriptors(os.getpid())
        for endpoint in (engine._endpoint, engine._replay_endpoint):
            port = urlparse(endpoint).port
            with idle_connections(port, 4_000, send=""):
                await asyncio.sleep(0.5)
                assert open_descriptors(os.getpid()) - calm < ceiling()
            await asyncio.to_thread(connect_and_close, port, 5_000)
        listener.start()  # a router that starts now: it replays what it missed, then subscribes
        listener.follow("engine-a", engine._endpoint)
        engine.publish(stored(1, 2))
        await until(lambda: index.match([1, 2]) == {"engine-a": 2}, timeout_s=15)
        assert open_descriptors(os.getpid()) - calm < 64
    finally:
        await listener.stop()
        engine.shutdown()
